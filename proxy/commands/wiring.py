"""``kpx node`` once it has claimed its network namespace: one node's proxy, wired together.

Owns: the event loop, signals, and the wiring source -> hub -> proxier ->
{dataplane, healthz}. One sync computes what each snapshot means and hands
both the same result, so the healthCheckNodePort can never claim endpoints
the dataplane does not forward to. ``proxy.commands.node`` checks the flags
and claims the namespace first.

Never: make a forwarding decision or touch a socket itself.

Signals: SIGTERM stops accepting, lets established connections drain up to
``--shutdown-grace``, then exits 0. SIGINT (Ctrl-C) does the same without
waiting for a successor. SIGHUP re-reads the state file.

One instance per network namespace (``proxy.lifecycle.ownership``): a second one exits
at once. A restart is SIGTERM to the old one and a new ``kpx node`` started
at once, and it refuses no connection: on SIGTERM the old one keeps
accepting for up to ``--handover-wait`` (default 2s, at most
``--shutdown-grace``) while it waits for a successor to ask for its NodePort
listeners. One that asks receives the listening sockets themselves
(``proxy.lifecycle.handover``), applies its first state, accepts on them and says
so; only then does the old one stop accepting, close its health ports and
pass the owner name; it drains meanwhile (it waits at most
``--shutdown-grace`` for that "serving", then hands over anyway: the
successor holds the queues). Without a successor the old one stops accepting
when the wait is over, and new connections are refused from then on. The
health ports (``/healthz``, healthCheckNodePorts, metrics) are closed and
bound again, a blip health checkers tolerate. ``--workers N`` keeps the
older way: the supervisor's workers close their listeners at SIGTERM and
the new instance binds its own, a short refusal window. The return path stays
until the last kpx of the namespace exits.

IPv6: as kube-proxy's MetaProxier, a second dataplane serves the IPv6 family
(``Dataplane(family=6)``), fed by the same sync (``Proxier(dataplane6=)``):
it listens once the Node has an IPv6 address, serves the IPv6 service VIPs
(``LocalVIPs(family=6)``, its own VIP guard), and a handover passes its
sockets on with the IPv4 ones. Not made on a kernel without IPv6.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import logging
import os
import signal
import socket
import subprocess
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from typing import Any

import uvloop

from healthz.proxy_health import ProxyHealth
from healthz.sidecar import Sidecar
from proxy.commands.configz import CONFIGZ_NAME, kube_proxy_configuration
from proxy.commands.workers import supervise
from proxy.core.sync import SyncConfig
from proxy.defaults import DEFAULT_MAX_BYTES
from proxy.lifecycle.ownership import Listeners, Offer, Ownership, Successor, live_pids
from proxy.nfqueue import conntrack, rules
from proxy.nfqueue.dataplane import QUEUE_KEY, NfqueueDataplane
from proxy.proxier import Proxier
from proxy.sources.hub import StateHub
from proxy.sources.kubeapi import KubeAPISource
from proxy.sources.kubeconfig import KubeConfig
from proxy.sources.statefile import StateFileSource
from proxy.userspace.dataplane import Dataplane
from proxy.userspace.transparent import (
    NFT_TABLE,
    ReturnPathGuard,
    RoutingConfig,
    TransparentRouting,
    close_time_wait_legs,
)
from proxy.userspace.vips import LocalVIPs, VIPGuard
from proxy.util import spawn

log = logging.getLogger(__name__)


def make_source(args: argparse.Namespace, hub: StateHub,
                config: KubeConfig | None) -> StateFileSource | KubeAPISource:
    """The state file if one is named, else the Kubernetes API (as kube-proxy reads it).

    ``config`` is ``node.source_config``'s answer, checked before the claim: None
    for the state file, else how to reach the API server."""
    if config is None:
        return StateFileSource(
            args.state, hub, max_bytes=getattr(args, "state_max_bytes", DEFAULT_MAX_BYTES)
        )
    return KubeAPISource(config, hub, args.hostname_override)


async def start_source(
    source: StateFileSource | KubeAPISource, timeout: float
) -> asyncio.Task[None]:
    """Start following the source, with the first state applied when this returns.

    Applying first means a node whose healthz answers already has its NodePorts
    listening (bounded by ``timeout`` for the API, which may be unreachable).
    A big file is read and parsed in a worker thread, as every later load is
    (``StateFileSource.load_async``): ``kpx healthz`` already serves while it starts.
    """
    if isinstance(source, StateFileSource):
        await source.load_async()
    task = asyncio.create_task(source.run(), name="state-source")
    if isinstance(source, KubeAPISource):
        await source.wait_synced(timeout=timeout)
    return task


def sync_config(args: argparse.Namespace) -> SyncConfig:
    """What the flags say about the rules, for the proxier's sync."""
    return SyncConfig(
        node_name=args.hostname_override,
        masquerade_all=getattr(args, "masquerade_all", False),
        nodeport_cidrs=tuple(args.nodeport_addresses or ()),
        vips=True,
    )


def node_sidecar(hub: StateHub, args: argparse.Namespace) -> Sidecar:
    """``kpx node``'s health and metrics ports; ``/configz`` says what its flags are."""
    return Sidecar.from_flags(
        hub.health, args, configz={CONFIGZ_NAME: kube_proxy_configuration(args)}
    )


def attach_proxier(args: argparse.Namespace, hub: StateHub, sidecar: Sidecar | None,
                   dataplane: Dataplane | NfqueueDataplane,
                   dataplane6: Dataplane | NfqueueDataplane | None) -> None:
    """The one sync, subscribed to ``hub``: the dataplanes' plans and healthz's plain data."""
    Proxier(
        sync_config(args),
        dataplane=dataplane,
        dataplane6=dataplane6,
        services=sidecar.services if sidecar is not None else None,
        health=hub.health,
        healthz_ipv6=sidecar.serve_healthz_ipv6 if sidecar is not None else None,
    ).attach(hub)


async def serve(args: argparse.Namespace, config: KubeConfig | None) -> int:
    """Serve the claimed namespace until stopped; ``config``: see ``make_source``."""
    loop = asyncio.get_running_loop()
    # Before anything is installed: a signal's default action would end this
    # process mid-start and leave the return path, VIPs and sysctls behind.
    signals = Signals(loop)
    hub = StateHub(ProxyHealth(timeout=2 * args.sync_period))
    source = make_source(args, hub, config)
    workers = max(1, args.workers)
    worker_index = getattr(args, "worker_index", 0)
    ownership: Ownership | None = getattr(args, "ownership", None)
    # A successor holds the listening sockets of the kpx node it takes over
    # from; its first sync adopts them instead of binding new ones.
    claim = ownership.claim if ownership is not None else None
    if args.proxy_mode == "nfqueue":
        return await serve_nfqueue(args, loop, hub, source, ownership, signals)
    # ClusterIPs, externalIPs and VIP-mode LB IPs become local addresses of
    # the node (proxy.userspace.vips), as IPVS mode does with kube-ipvs0.
    local_vips = LocalVIPs()
    inherited = dict(claim.take_listeners()) if claim is not None else {}
    common: dict[str, Any] = dict(
        loop=loop,
        transparent=not args.no_transparent,
        connect_timeout=args.connect_timeout,
        cluster_cidrs=args.cluster_cidr,
        reuse_port=workers > 1,
        workers=workers,
        install_routing=workers == 1,
        tcp_timeout_established=args.conntrack_tcp_timeout_established,
        tcp_timeout_close_wait=args.conntrack_tcp_timeout_close_wait,
        udp_timeout=args.conntrack_udp_timeout,
        udp_timeout_stream=args.conntrack_udp_timeout_stream,
        udp_flow_limit=args.udp_flow_limit,
    )
    dataplane = Dataplane(
        **common,
        inherited={k: s for k, s in inherited.items() if ":" not in k[0]},
        local_vips=local_vips,
        vip_port=getattr(args, "vip_port", 0),
        health=hub.health,
    )
    if getattr(args, "no_transparent6", False):
        # A --workers supervisor could not install the IPv6 return path: SNAT.
        common = {**common, "transparent": False}
    # The IPv6 family's VIPs (IPv6 ClusterIPs, externalIPs, LB IPs): its own
    # routes, ip6 table and sk_lookup program, steered to a listener on ::1.
    local_vips6 = LocalVIPs(family=6) if ipv6_available() else None
    dataplane6 = Dataplane(
        **common, inherited={k: s for k, s in inherited.items() if ":" in k[0]}, family=6,
        local_vips=local_vips6, vip_port=getattr(args, "vip_port6", 0), health=hub.health,
    ) if local_vips6 is not None else None
    planes = [dp for dp in (dataplane, dataplane6) if dp is not None]
    sidecar = None
    if not args.no_healthz and worker_index == 0:
        sidecar = node_sidecar(hub, args)
    attach_proxier(args, hub, sidecar, dataplane, dataplane6)

    watcher = await start_source_unless_stopped(source, args.sync_period, signals)
    leftovers: asyncio.Task[None] | None = None
    unqueued = asyncio.Event()
    """Set once no nfqueue rule queues SYNs here: what READY waits for, besides the sync."""
    if worker_index == 0:
        # The listeners are up: now SYNs that nfqueue rules left behind would
        # queue to nobody can reach them.
        leftovers = asyncio.create_task(remove_nfqueue_leftovers(
            rules.FAMILIES if local_vips6 is not None else (4,), unqueued),
            name="nfqueue-leftovers")
    else:
        unqueued.set()

    # The namespace's owner (worker 0 for --workers) keeps the return path
    # whole, as kube-proxy re-syncs its rules every sync period.
    if ownership is not None:
        ownership.attach(loop)  # a successor attaches once it owns the name
    vip_guards: list[asyncio.Task[None]] = []
    if worker_index == 0:
        for lv in (local_vips, local_vips6):
            if lv is not None:
                vip_guards.append(asyncio.create_task(
                    VIPGuard(lv, hub.health, args.sync_period).run(),
                    name=f"vip-guard-ipv{lv.family}"))
    guards: list[asyncio.Task[None]] = []
    for dp in planes:
        if dp.transparent_active and worker_index == 0:
            routing = TransparentRouting(RoutingConfig(family=dp.family))
            guards.append(asyncio.create_task(
                ReturnPathGuard(routing, hub.health, args.sync_period).run(),
                name=f"return-path-guard-ipv{dp.family}",
            ))

    sidecar_started = False

    async def start_sidecar() -> None:
        nonlocal sidecar_started
        if sidecar is not None:
            sidecar_started = True
            await sidecar.start()

    async def serving() -> None:
        """Listening, and no SYN queued elsewhere: an nfqueue-mode predecessor decides SYNs
        until READY, and its rules would queue them to nobody after it."""
        await synced(planes)
        await unqueued.wait()

    takeover: asyncio.Task[None] | None = None
    if ownership is not None and claim is not None:
        takeover = asyncio.create_task(take_over(ownership, loop, serving(), start_sidecar),
                                       name="take-over")
    else:
        await start_sidecar()

    interrupted, stopper = await run_until_stopped(loop, args, source, watcher, "", signals)

    if takeover is not None and not takeover.done():
        takeover.cancel()
        await asyncio.gather(takeover, return_exceptions=True)
    for guard in guards:
        guard.cancel()  # only the owner repairs; a successor takes that over
    for vip_guard in vip_guards:
        vip_guard.cancel()
    if leftovers is not None:
        # A NAT keeper still waited out stays: the next kpx takes it over.
        leftovers.cancel()
        await asyncio.gather(leftovers, return_exceptions=True)
    source.stop()

    successor, offer = await offer_handover(
        args, ownership, loop, interrupted, "accepting",
        lambda want: [kv for dp in planes for kv in dp.listening_sockets()])
    log.info("stopping: no new connections, draining for up to %.1fs", args.shutdown_grace)
    for dp in planes:
        await dp.stop_accepting()
    if sidecar_started and sidecar is not None:
        await sidecar.stop()
    if successor is not None:
        # Its accept loop runs on the very sockets this one just stopped
        # watching; it gets the owner name (and binds the health ports).
        await successor.finish()
        log.info("handed this network namespace to kpx node pid %d; draining", successor.pid)
    elif ownership is not None:
        # Listeners and health ports are closed: a new kpx node binds them now,
        # while this one drains on the return path they share.
        ownership.release()
        log.info("released this network namespace: a new kpx node may take over")
    # Both families drain at once, within the one grace period.
    await asyncio.gather(*(dp.drain(args.shutdown_grace) for dp in planes))
    for dp in planes:
        dp.close()  # removes the return path only if no other kpx is present
    if offer is not None:
        offer.close()
    watcher.cancel()
    stopper.cancel()
    log.info("kpx node %s stopped", args.hostname_override)
    return 0


async def remove_nfqueue_leftovers(families: tuple[int, ...],
                                   unqueued: asyncio.Event | None = None) -> None:
    """Remove the rules an nfqueue-mode kpx left (userspace mode), as kube-proxy cleans up
    its other modes' rules at start; keep NAT on until the connections they DNATed close.

    They would queue every SYN to a served port to a queue that nobody reads
    here: the kernel drops them (or with ``--queue-bypass`` lets them meet
    the node undecided). A SIGKILL leaves them, and so does a restart into
    this mode (the old process sees a successor present). The connections
    they DNATed are conntrack's, and go on only while a nat chain is there:
    so each table becomes a NAT keeper (``rules.keep_nat``), removed once
    none of them is open (``wait_out_nat_keepers``).

    The look is ``nft list tables`` and ``iptables-save`` from the loop
    (``spawn``: no thread, and the relay stays a single-threaded process).
    Removing is a few ``iptables``/``nft`` calls that block the loop, once,
    and only when there is something to remove. ``unqueued`` is set after
    it (or after it failed: nothing better will come): a restart's successor
    says READY then, while its nfqueue-mode predecessor still decides the
    SYNs queued until the rules went.
    """
    try:
        keepers = await _remove_queueing(families)
    finally:
        if unqueued is not None:
            unqueued.set()
    if keepers:
        await wait_out_nat_keepers(families)


async def _remove_queueing(families: tuple[int, ...]) -> bool:
    """The rules gone (``remove_nfqueue_leftovers``); True if a NAT keeper is there now."""
    try:
        tables = (await spawn.run(["nft", "list", "tables"])).stdout
        saves = []
        for family in families:
            with contextlib.suppress(FileNotFoundError):  # no ip6tables: nothing of it
                saves.append((await spawn.run(rules.save_argv(family))).stdout)
        if rules.left_behind(tables, saves):
            removed = rules.keep_nat(rules.QueueConfig(), families)
            log.info("removed the rules an nfqueue-mode kpx left here (%d iptables/ip6tables"
                     " rule(s); its kpx_nfq tables are now %s, which keeps the connections"
                     " they DNATed translated until they close): they queued SYNs that no"
                     " process reads", removed, rules.KEEP_TABLE)
            return True
    except (OSError, RuntimeError, ValueError, subprocess.SubprocessError) as exc:
        log.error("could not remove the rules an nfqueue-mode kpx left: %s; SYNs to the "
                  "ports they name may be dropped", exc)
        return False
    return f" {rules.KEEP_TABLE}" in tables  # an earlier relay's, not yet waited out


NAT_KEEP_POLL = 5.0
"""Seconds between looks at conntrack for the connections a NAT keeper is for."""


async def wait_out_nat_keepers(families: tuple[int, ...]) -> None:
    """Remove each family's NAT keeper once no connection it keeps NAT on for is open.

    A look each ``NAT_KEEP_POLL``: the keeper's frontends (``nft``, from the
    loop) and conntrack's DNATed entries toward them (ctnetlink, in a thread:
    ``conntrack.dnat_toward``). A long-lived connection keeps it as long as
    it lasts, which costs a nat chain that NATs nothing anew, and conntrack
    on for the relay's traffic. An nfqueue-mode kpx that starts meanwhile
    removes it in its first write (its own nat chains take over).
    """
    while True:
        waiting = 0
        for family in families:
            fam = "ip6" if family == 6 else "ip"
            listed = await spawn.run(["nft", "-j", "list", "table", fam, rules.KEEP_TABLE])
            fronts = rules.frontends(listed.stdout) if listed.returncode == 0 else None
            if fronts is None:
                continue
            try:
                open_ = await asyncio.to_thread(conntrack.dnat_toward, fronts, family)
            except OSError as exc:
                log.warning("IPv%d NAT keeper: conntrack not read: %s; looking again in %.0fs",
                            family, exc, NAT_KEEP_POLL)
                open_ = 1
            if open_:
                waiting += open_
                continue
            res = await spawn.run(["nft", "-f", "-"], rules.remove_script(rules.KEEP_TABLE,
                                                                           family))
            if res.returncode == 0:
                log.info("removed the IPv%d NAT keeper (%s): no connection an nfqueue-mode"
                         " kpx DNATed is open any more", family, rules.KEEP_TABLE)
        if not waiting:
            return
        await asyncio.sleep(NAT_KEEP_POLL)


LEFTOVER_POLL = 1.0
"""Seconds between looks for the last other kpx to have gone (``remove_relay_leftovers``)."""


async def remove_relay_leftovers(dataplane: NfqueueDataplane) -> None:
    """nfqueue mode: remove the client-IP return path a relay left, once no other kpx is
    present, as the relay's cleanup at start removes an nfqueue-mode kpx's rules.

    A relay restarted into nfqueue mode leaves it: it drains with its
    successor present, and whoever exits last removes the return path. Here
    that is this process, which installs none (plain DNAT keeps the client
    IP), so nobody else would. It marks only packets of transparent sockets,
    which this mode never opens: harmless, but not this mode's to keep. So
    once the first tables are in force, this waits for the draining relay to
    exit (a look at the presence names each ``LEFTOVER_POLL``, as long as it
    takes), then removes each family's part it finds.

    The relay's closed connections are not harmless: their TIME_WAIT sockets
    drop the replies of clients' new connections (``close_relay_time_wait``).
    So they are closed at once, again at each look while the relay drains
    (its connections close meanwhile), and once more after it has gone.
    """
    await dataplane.synced.wait()
    families = dataplane.families
    while True:
        others = live_pids() - {os.getpid()}
        families = await close_relay_time_wait(dataplane, families)
        if not others:
            break
        await asyncio.sleep(LEFTOVER_POLL)
    for family in dataplane.families:
        try:
            removed = await TransparentRouting(RoutingConfig(family=family)).remove_left_behind()
        except (OSError, RuntimeError, ValueError, subprocess.SubprocessError) as exc:
            log.error("could not remove the IPv%d return path a userspace-mode kpx left: %s",
                      family, exc)
            continue
        if removed:
            log.info("removed the IPv%d client-IP return path a userspace-mode kpx left here"
                     " (nft table inet %s, its fwmark rule and route): nfqueue mode keeps the"
                     " client IP by DNAT", family, NFT_TABLE)


HandedOn = list[tuple[tuple[str, int], socket.socket]]


def handed_on(want: Mapping[str, object], queue: HandedOn) -> HandedOn | None:
    """What an nfqueue-mode kpx passes a successor whose WANT frame says ``want``, of its
    ``queue`` socket (``NfqueueDataplane.listening_sockets``).

    One in nfqueue mode asks for the queue and gets its socket. One in
    userspace mode gets nothing: it binds its own listeners and removes this
    one's queueing rules before it says READY, and this one decides SYNs
    until then. Any other (an older kpx, which does not say its mode) is
    turned away (None): it might hold the queue bound and never read it.
    """
    if want.get("queue"):
        return queue
    return [] if want.get("mode") == "userspace" else None


async def close_relay_time_wait(dataplane: NfqueueDataplane, families: tuple[int, ...]
                                ) -> tuple[int, ...]:
    """Close the TIME_WAIT sockets a relay's client-IP connections left toward the endpoints
    in force (``close_time_wait_legs``: each would take the SYN-ACK of a client's next
    connection that happens to reuse its port), for each of ``families``; returns those
    worth asking again (a kernel that cannot close them is told once, and logged once)."""
    again = []
    for family in families:
        endpoints = dataplane.tcp_endpoints(family)
        try:
            # The dataplane's worker, beside the syncs' blocking calls, off the loop.
            closed = await dataplane.off_loop(close_time_wait_legs, family, endpoints)
        except Exception as exc:  # best effort: never the end of the leftovers task
            log.error("could not close the IPv%d TIME_WAIT sockets a userspace-mode kpx left:"
                      " %s; a client reusing one's port times out until it expires", family, exc)
            continue
        again.append(family)
        if closed:
            log.info("closed %d IPv%d TIME_WAIT socket(s) that a userspace-mode kpx's"
                     " client-IP connections left toward endpoints: each would drop the"
                     " SYN-ACK of a client's connection reusing its port", closed, family)
    return tuple(again)


async def take_over(ownership: Ownership, loop: asyncio.AbstractEventLoop,
                    ready: Awaitable[object], then: Callable[[], Awaitable[None]]) -> None:
    """A successor: say "serving" once ``ready``, own the name, then ``then`` (the health
    ports: the old one has closed them by now)."""
    await ownership.take_over(ready)
    ownership.attach(loop)
    await then()


async def offer_handover(
    args: argparse.Namespace, ownership: Ownership | None, loop: asyncio.AbstractEventLoop,
    interrupted: asyncio.Event, doing: str,
    listeners: Listeners,
) -> tuple[Successor | None, Offer | None]:
    """Stopping: keep ``doing`` it for ``--handover-wait`` while a successor may take over.

    Returns the successor once it serves (None: nobody came in time, or
    SIGINT cut the wait) and the offer, for the caller to close when it
    exits: until then a third instance that asks is told BUSY. No offer
    (``--workers``, SIGINT, a zero window): a successor started now waits
    for the owner name instead.
    """
    window = min(args.handover_wait, args.shutdown_grace)
    offer = None
    if ownership is not None:
        if args.workers <= 1 and window > 0 and not interrupted.is_set():
            offer = ownership.offer(loop)
        if offer is None:
            ownership.stopping()
    if offer is None:
        return None, None
    log.info("stopping: %s for up to %.1fs more while a new kpx node may take over",
             doing, window)
    waiting = asyncio.create_task(offer.wait(listeners, window, args.shutdown_grace))
    cut = asyncio.create_task(interrupted.wait())
    await asyncio.wait({waiting, cut}, return_when=asyncio.FIRST_COMPLETED)
    cut.cancel()
    if not waiting.done():  # SIGINT: stop now
        waiting.cancel()
    successor = (await asyncio.gather(waiting, return_exceptions=True))[0]
    return (successor if isinstance(successor, Successor) else None), offer


def ipv6_available() -> bool:
    """Whether this kernel has IPv6 at all: else no IPv6 dataplane is made."""
    try:
        socket.socket(socket.AF_INET6, socket.SOCK_STREAM).close()
    except OSError:
        return False
    return True


async def synced(planes: list[Dataplane]) -> None:
    """Until every family's dataplane has reconciled its listeners once."""
    for dp in planes:
        await dp.synced.wait()


class Signals:
    """SIGTERM, SIGINT and SIGHUP, handled from the start of ``serve``.

    Until ``run_until_stopped`` a stop is only recorded (and cuts the wait for
    the first state short: ``start_source_unless_stopped``); a SIGHUP then is
    a re-read once the source runs. Without this, either signal ended a
    starting kpx by its default action, before any cleanup.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.stop = asyncio.Event()
        self.interrupted = asyncio.Event()
        self._reload: Callable[[], None] | None = None
        self._hup = False
        loop.add_signal_handler(signal.SIGTERM, self.stop.set)
        loop.add_signal_handler(signal.SIGINT, self._interrupt)
        loop.add_signal_handler(signal.SIGHUP, self._on_hup)

    def _interrupt(self) -> None:
        self.interrupted.set()
        self.stop.set()

    def _on_hup(self) -> None:
        if self._reload is None:
            self._hup = True
        else:
            self._reload()

    def serving(self, reload: Callable[[], None]) -> None:
        """From now on SIGHUP calls ``reload``; one that came while starting does so now."""
        self._reload = reload
        if self._hup:
            self._hup = False
            reload()


async def start_source_unless_stopped(
    source: StateFileSource | KubeAPISource, timeout: float, signals: Signals
) -> asyncio.Task[Any]:
    """``start_source``, cut short by a stop signal (an API server that does not answer
    holds the first state back for up to ``timeout``): then a finished task."""
    starting = asyncio.ensure_future(start_source(source, timeout))
    stopped = asyncio.ensure_future(signals.stop.wait())
    try:
        await asyncio.wait({starting, stopped}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopped.cancel()
    if starting.done():
        return starting.result()
    starting.cancel()
    await asyncio.gather(starting, return_exceptions=True)
    log.info("stopped while waiting for the first state")
    return asyncio.ensure_future(asyncio.sleep(0))


async def run_until_stopped(
    loop: asyncio.AbstractEventLoop, args: argparse.Namespace,
    source: StateFileSource | KubeAPISource, watcher: asyncio.Task[Any], mode: str,
    signals: Signals | None = None,
) -> tuple[asyncio.Event, asyncio.Task[Any]]:
    """Serve until SIGTERM or SIGINT, or until the state source dies; SIGHUP re-reads it.

    Returns ``interrupted`` (set by SIGINT: stop now, no handover window) and
    the task waiting for the signal, for the caller to cancel once stopped.
    """
    signals = signals or Signals(loop)
    stop, interrupted = signals.stop, signals.interrupted
    signals.serving(source.reload)
    log.info("kpx node %s running%s (state from %s)", args.hostname_override, mode,
             args.state or "the Kubernetes API")
    stopper = asyncio.create_task(stop.wait(), name="stop-signal")
    await asyncio.wait({watcher, stopper}, return_when=asyncio.FIRST_COMPLETED)
    if watcher.done() and watcher.exception() is not None:
        log.error("state source died", exc_info=watcher.exception())
    return interrupted, stopper


async def serve_nfqueue(args: argparse.Namespace, loop: asyncio.AbstractEventLoop,
                        hub: StateHub, source: StateFileSource | KubeAPISource,
                        ownership: Ownership | None, signals: Signals | None = None) -> int:
    """``kpx node --proxy-mode nfqueue``: the same sync and healthz, a SYN-deciding dataplane.

    A restart hands the queue over as the relay hands its listeners over
    (``Ownership.offer``): the new one receives the queue's socket itself,
    so the queue never stops being bound. The old process goes on deciding
    SYNs while the new one starts, reads its state and works out its tables
    (``NfqueueDataplane.prepared``). Then the new one says READY, the old
    one answers what it has read and passes the owner name, and the new one
    writes its tables (in place: see ``rules.nft_script``) and answers the
    SYNs that waited in the socket meanwhile. So no SYN waits for a
    retransmit. The rules stay in place throughout (removing them would
    unhook NAT from every established connection, which conntrack carries
    all along). Without a successor, SYNs are dropped (fail-closed) until
    one binds, or with ``--queue-bypass`` pass undecided.

    A relay's successor (the mode changed) has no queue passed to it: it
    binds one and puts its rules in force before it says READY, since the
    relay then closes its listeners. Then it closes the TIME_WAIT sockets
    the relay's connections left, and the relay's return path once it has
    gone (``remove_relay_leftovers``).
    """
    signals = signals or Signals(loop)
    conntrack.apply(conntrack.Settings.from_flags(args))
    claim = ownership.claim if ownership is not None else None
    inherited = claim.take_listeners() if claim is not None else {}
    queue = inherited.pop((QUEUE_KEY, args.queue_num), None)
    for sock in inherited.values():
        sock.close()  # a relay's listening sockets (the mode changed): none is used here
    # A predecessor that passed no queue holds none (a relay: the mode changed), so this
    # one binds and puts its rules in force at once, while the old one still accepts.
    queue_passed = claim is not None and queue is not None
    dataplane = NfqueueDataplane(loop=loop, queue=args.queue_num, bypass=args.queue_bypass,
                                 batch_wait=args.queue_batch_wait,
                                 cluster_cidrs=args.cluster_cidr, health=hub.health,
                                 successor=queue_passed, inherited=queue)
    sidecar = None if args.no_healthz else node_sidecar(hub, args)
    # One instance serves both families (one queue, one socket): it is the IPv6
    # dataplane too, so the proxier hands it the IPv6 result and reports IPv6.
    attach_proxier(args, hub, sidecar, dataplane,
                   dataplane if 6 in dataplane.families else None)
    watcher = await start_source_unless_stopped(source, args.sync_period, signals)
    sidecar_started = False

    async def start() -> None:
        """Bind the queue (once the old one let go, for a successor) and the health ports."""
        nonlocal sidecar_started
        dataplane.proceed()
        if sidecar is not None:
            sidecar_started = True
            await sidecar.start()

    takeover: asyncio.Task[None] | None = None
    if ownership is not None and claim is not None:
        # READY tells the old one to stop. An nfqueue-mode one goes on deciding SYNs until
        # it passes the queue, so its successor needs only its tables worked out. A relay
        # closes its listeners: until this one's rules are in force, a SYN would meet no
        # listener and be refused.
        ready = dataplane.prepared.wait() if queue_passed else dataplane.synced.wait()
        takeover = asyncio.create_task(take_over(ownership, loop, ready, start),
                                       name="take-over")
    else:
        if ownership is not None:
            ownership.attach(loop)
        await start()
    leftovers = asyncio.create_task(remove_relay_leftovers(dataplane), name="relay-leftovers")
    interrupted, stopper = await run_until_stopped(loop, args, source, watcher,
                                                   " in nfqueue mode", signals)
    leftovers.cancel()
    if takeover is not None and not takeover.done():
        takeover.cancel()
        await asyncio.gather(takeover, return_exceptions=True)
    source.stop()
    successor, offer = await offer_handover(args, ownership, loop, interrupted,
                                            "deciding SYNs",
                                            lambda want: handed_on(
                                                want, dataplane.listening_sockets()))
    # The successor holds the queue's socket from here, or it is free for one to bind.
    await dataplane.stop_accepting()
    if sidecar_started and sidecar is not None:
        await sidecar.stop()
    if successor is not None:
        await successor.finish()  # it binds the queue now, and the health ports
        log.info("handed this network namespace to kpx node pid %d", successor.pid)
    elif ownership is not None:
        ownership.release()
        if offer is not None and offer.declined:
            # One came that binds a queue of its own (a relay, an older kpx): it takes
            # the owner name now and then announces itself. Wait for it a moment, so
            # the rules stay: removing them would unhook NAT from every established
            # connection until it puts them back.
            deadline = loop.time() + min(args.handover_wait, args.shutdown_grace)
            while loop.time() < deadline and not live_pids() - {os.getpid()}:
                await asyncio.sleep(0.02)
    dataplane.close()  # removes the rules only if no other kpx is present
    if offer is not None:
        offer.close()
    watcher.cancel()
    stopper.cancel()
    log.info("kpx node %s stopped", args.hostname_override)
    return 0


def run_on_uvloop(main: Coroutine[Any, Any, int]) -> int:
    """Run ``main`` on uvloop, the loop kube-proxy's userspace relay needs to keep up."""
    return uvloop.run(main)


def run_worker(args: argparse.Namespace, config: KubeConfig | None) -> int:
    return run_on_uvloop(serve(args, config))


def serve_claimed(args: argparse.Namespace, config: KubeConfig | None) -> int:
    """Serve the namespace ``node.run`` claimed: in this process, or in ``--workers`` forks.

    ``config`` is where the state comes from, as ``node.source_config`` checked it."""
    if args.workers > 1:
        return supervise(args, functools.partial(run_worker, config=config))
    return run_worker(args, config)
