"""``kpx node``: one node's proxy, wired together.

Owns: flags (named as kube-proxy names them), the event loop, signals, and
the wiring source -> hub -> proxier -> {dataplane, healthz}. One sync
computes what each snapshot means and hands both the same result, so the
healthCheckNodePort can never claim endpoints the dataplane does not
forward to.

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
import ipaddress
import logging
import os
import resource
import signal
import socket
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import uvloop

from healthz.proxy_health import ProxyHealth
from healthz.sidecar import Sidecar
from proxy.commands.check import add_max_bytes_flag
from proxy.commands.workers import supervise
from proxy.core.addresses import parse_nodeport_addresses
from proxy.core.flows import UDP_TIMEOUT, UDP_TIMEOUT_STREAM
from proxy.core.sync import SyncConfig
from proxy.lifecycle.ownership import Ownership, OwnershipError, Successor, live_pids
from proxy.nfqueue import conntrack
from proxy.nfqueue.dataplane import DEFAULT_BATCH_WAIT, MAX_BATCH_WAIT, NfqueueDataplane
from proxy.nfqueue.rules import DEFAULT_QUEUE
from proxy.proxier import Proxier
from proxy.sources.hub import StateHub
from proxy.sources.kubeapi import KubeAPISource, KubeConfig, KubeConfigError
from proxy.sources.statefile import DEFAULT_MAX_BYTES, StateFileSource
from proxy.userspace.dataplane import UDP_FLOW_LIMIT, Dataplane
from proxy.userspace.forwarder import TCP_TIMEOUT_CLOSE_WAIT, TCP_TIMEOUT_ESTABLISHED
from proxy.userspace.transparent import ReturnPathGuard, RoutingConfig, TransparentRouting
from proxy.userspace.vips import LocalVIPs, VIPGuard

log = logging.getLogger(__name__)

HANDOVER_WAIT = 2.0
"""``--handover-wait``: long enough for a successor started with the SIGTERM to
reach its handover request (a Python start, about half a second); short, because
a stop with no successor keeps accepting that long before it drains."""


def parse_duration(text: str) -> float:
    """Go-style durations as kube-proxy flags take them: ``30s``, ``1m``, ``500ms``, ``100us``,
    ``2``. The longer suffixes are tried first: ``100us`` also ends in ``s``."""
    units = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
    for suffix in ("ns", "us", "µs", "ms", "s", "m", "h"):
        if text.endswith(suffix):
            return float(text[: -len(suffix)]) * units[suffix]
    return float(text)


PROXY_MODES = ("userspace", "nfqueue")
"""``--proxy-mode``: kube-proxy's flag name; userspace is the relay, nfqueue SYN-time decisions."""


def parse_timeout(text: str) -> float:
    """A duration that may be 0 (off, as kube-proxy's "leave as is") but not negative."""
    seconds = parse_duration(text)
    if seconds < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: must be >= 0 (0 turns it off)")
    return seconds


parse_timeout.__name__ = "duration"  # argparse names the type: "invalid duration value"


def parse_positive(text: str) -> float:
    """A duration above 0: a UDP flow that expires at once would re-pick every datagram."""
    seconds = parse_duration(text)
    if seconds <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: must be > 0")
    return seconds


parse_positive.__name__ = "duration"


def parse_flow_limit(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: not a whole number") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: must be at least 1")
    return n


parse_flow_limit.__name__ = "count"


def parse_cidrs(text: str) -> list[ipaddress.IPv4Network | ipaddress.IPv6Network]:
    try:
        return parse_nodeport_addresses(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e


def add_node_flags(parser: argparse.ArgumentParser) -> None:
    """Flags shared by ``kpx node`` and ``kpx healthz``."""
    parser.add_argument(
        "--hostname-override",
        default=socket.gethostname(),
        help="this node's name: endpoints with this nodeName are local (default: hostname)",
    )
    parser.add_argument(
        "--state", type=Path, default=None,
        help="YAML file of v1 Node, v1 Service and discovery.k8s.io/v1 EndpointSlice objects"
        " (default: watch them in the Kubernetes API)",
    )
    parser.add_argument(
        "--kubeconfig", type=Path, default=None, metavar="PATH",
        help="kubeconfig for the API server (default: the in-cluster service account)",
    )
    parser.add_argument(
        "--master", default=None, metavar="URL",
        help="API server address; overrides the kubeconfig's server",
    )
    parser.add_argument(
        "--nodeport-addresses", type=parse_cidrs, default=[], metavar="CIDR,...",
        help="serve NodePorts only on node addresses inside these CIDRs (default: all)",
    )
    parser.add_argument(
        "--healthz-bind-address", default="0.0.0.0:10256", metavar="IP:PORT",
        help="node /healthz and /livez (default 0.0.0.0:10256)",
    )
    parser.add_argument(
        "--metrics-bind-address", default="127.0.0.1:10249", metavar="IP:PORT",
        help="/metrics and /proxyMode (default 127.0.0.1:10249)",
    )
    parser.add_argument(
        "--sync-period", type=parse_duration, default=30.0, metavar="DURATION",
        help="health turns bad when an update waits longer than twice this (default 30s)",
    )
    add_max_bytes_flag(parser)


def configure(parser: argparse.ArgumentParser) -> None:
    add_node_flags(parser)
    parser.add_argument(
        "--masquerade-all", action="store_true",
        help="SNAT every eTP=Cluster hop, also to endpoints on this node (iptables mode)",
    )
    parser.add_argument(
        "--cluster-cidr", type=parse_cidrs, default=[], metavar="CIDR,...",
        help="pod CIDRs: their NodePort traffic gets Cluster semantics, like detect-local-mode",
    )
    parser.add_argument("--no-healthz", action="store_true", help="do not run the healthz sidecar")
    parser.add_argument(
        "--no-transparent", action="store_true",
        help="never preserve the client IP (SNAT everything); no routing is installed",
    )
    parser.add_argument(
        "--shutdown-grace", type=parse_duration, default=10.0, metavar="DURATION",
        help="how long SIGTERM lets established connections drain (default 10s)",
    )
    parser.add_argument(
        "--handover-wait", type=parse_duration, default=HANDOVER_WAIT, metavar="DURATION",
        help="how long SIGTERM keeps the NodePorts accepting while waiting for a new kpx node"
        " to take them over; at most --shutdown-grace, 0: stop at once (default 2s)",
    )
    parser.add_argument(
        "--takeover-wait", type=parse_timeout, default=0.0, metavar="DURATION",
        help="when another kpx node serves this namespace, wait this long for it to stop and"
        " take its listeners over, instead of exiting at once (a DaemonSet's surge pod;"
        " default 0)",
    )
    parser.add_argument(
        "--proxy-mode", choices=PROXY_MODES, default="userspace",
        help="userspace: relay every connection (default); nfqueue: decide each SYN in"
        " Python, let conntrack DNAT forward the rest in the kernel",
    )
    parser.add_argument(
        "--conntrack-max-per-core", type=int, default=conntrack.CONNTRACK_MAX_PER_CORE,
        metavar="N", help="nfqueue mode: conntrack entries per CPU to make room for; 0 leaves"
        f" nf_conntrack_max as it is (default {conntrack.CONNTRACK_MAX_PER_CORE})",
    )
    parser.add_argument(
        "--conntrack-min", type=int, default=conntrack.CONNTRACK_MIN, metavar="N",
        help=f"nfqueue mode: at least this many conntrack entries (default"
        f" {conntrack.CONNTRACK_MIN})",
    )
    parser.add_argument(
        "--queue-num", type=int, default=DEFAULT_QUEUE, metavar="N",
        help=f"nfqueue mode: the NFQUEUE number SYNs are queued to (default {DEFAULT_QUEUE})",
    )
    parser.add_argument(
        "--queue-bypass", action="store_true",
        help="nfqueue mode: fail open (while no kpx reads the queue, SYNs pass undecided,"
        " hence un-DNATed) instead of the default fail-closed (they are dropped and retried)",
    )
    parser.add_argument(
        "--queue-batch-wait", type=parse_timeout, default=DEFAULT_BATCH_WAIT,
        metavar="DURATION",
        help="nfqueue mode: after SYNs came several at once (a busy node), let the next ones"
        " gather this long before reading them, so one wake-up decides a batch; a lone SYN"
        " never waits; 0: never wait (default 100us)",
    )
    parser.add_argument(
        "--workers", type=int, default=1, metavar="N",
        help="worker processes sharing the NodePorts via SO_REUSEPORT (default 1)",
    )
    parser.add_argument(
        "--connect-timeout", type=parse_duration, default=2.0, metavar="DURATION",
        help="upstream connect timeout per endpoint before trying another (default 2s)",
    )

    parser.add_argument(
        "--conntrack-tcp-timeout-established", type=parse_timeout,
        default=TCP_TIMEOUT_ESTABLISHED, metavar="DURATION",
        help="reset a connection idle (no byte either way) this long; 0: never (default 24h)",
    )
    parser.add_argument(
        "--conntrack-tcp-timeout-close-wait", type=parse_timeout,
        default=TCP_TIMEOUT_CLOSE_WAIT, metavar="DURATION",
        help="reset a half-closed connection (one side sent FIN) idle this long;"
        " 0: the established timeout applies (default 1h)",
    )
    parser.add_argument(
        "--conntrack-udp-timeout", type=parse_positive, default=UDP_TIMEOUT,
        metavar="DURATION",
        help="end a UDP flow that never got a reply after this long idle (default 30s)",
    )
    parser.add_argument(
        "--conntrack-udp-timeout-stream", type=parse_positive, default=UDP_TIMEOUT_STREAM,
        metavar="DURATION",
        help="end a UDP flow that got replies after this long idle (default 2m)",
    )
    parser.add_argument(
        "--udp-flow-limit", type=parse_flow_limit, default=UDP_FLOW_LIMIT, metavar="N",
        help="UDP flows held at once; a new one in a full table evicts the flow idle"
        f" the longest (default {UDP_FLOW_LIMIT}; each holds a socket)",
    )


def make_source(args: argparse.Namespace, hub: StateHub) -> StateFileSource | KubeAPISource:
    """The state file if one is named, else the Kubernetes API (as kube-proxy reads it)."""
    if args.state is not None:
        if args.kubeconfig is not None or args.master is not None:
            raise KubeConfigError("--state excludes --kubeconfig and --master")
        return StateFileSource(
            args.state, hub, max_bytes=getattr(args, "state_max_bytes", DEFAULT_MAX_BYTES)
        )
    return KubeAPISource(
        KubeConfig.load(args.kubeconfig, args.master), hub, args.hostname_override
    )


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


async def serve(args: argparse.Namespace) -> int:
    loop = asyncio.get_running_loop()
    hub = StateHub(ProxyHealth(timeout=2 * args.sync_period))
    # Bad flags or credentials fail here, before anything touches the namespace.
    try:
        source = make_source(args, hub)
    except KubeConfigError as e:
        log.error("%s", e)
        return 2
    workers = max(1, args.workers)
    worker_index = getattr(args, "worker_index", 0)
    ownership: Ownership | None = getattr(args, "ownership", None)
    # A successor holds the listening sockets of the kpx node it takes over
    # from; its first sync adopts them instead of binding new ones.
    claim = ownership.claim if ownership is not None else None
    if args.proxy_mode == "nfqueue":
        return await serve_nfqueue(args, loop, hub, source, ownership)
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
        sidecar = Sidecar.from_flags(hub.health, args)
    Proxier(
        sync_config(args),
        dataplane=dataplane,
        dataplane6=dataplane6,
        services=sidecar.services if sidecar is not None else None,
        health=hub.health,
        healthz_ipv6=sidecar.serve_healthz_ipv6 if sidecar is not None else None,
    ).attach(hub)

    watcher = await start_source(source, args.sync_period)

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

    async def take_over() -> None:
        """A successor: say "serving" once synced, then own the name and the health ports."""
        assert ownership is not None
        await ownership.take_over(synced(planes))
        ownership.attach(loop)
        await start_sidecar()  # the old one has closed its health ports by now

    takeover: asyncio.Task[None] | None = None
    if claim is not None:
        takeover = asyncio.create_task(take_over(), name="take-over")
    else:
        await start_sidecar()

    interrupted, stopper = await run_until_stopped(loop, args, source, watcher, "")

    if takeover is not None and not takeover.done():
        takeover.cancel()
        await asyncio.gather(takeover, return_exceptions=True)
    for guard in guards:
        guard.cancel()  # only the owner repairs; a successor takes that over
    for vip_guard in vip_guards:
        vip_guard.cancel()
    source.stop()

    successor = None
    offer = None
    window = min(args.handover_wait, args.shutdown_grace)
    if ownership is not None:
        if workers == 1 and window > 0 and not interrupted.is_set():
            offer = ownership.offer(loop)
        if offer is None:
            ownership.stopping()  # a successor started now waits for the owner name
    if offer is not None:
        log.info("stopping: accepting for up to %.1fs more while a new kpx node may take "
                 "the listeners over", window)
        waiting = asyncio.create_task(
            offer.wait(lambda: [kv for dp in planes for kv in dp.listening_sockets()], window,
                       args.shutdown_grace))
        cut = asyncio.create_task(interrupted.wait())
        await asyncio.wait({waiting, cut}, return_when=asyncio.FIRST_COMPLETED)
        cut.cancel()
        if not waiting.done():  # SIGINT: stop now
            waiting.cancel()
        successor = (await asyncio.gather(waiting, return_exceptions=True))[0]
        if not isinstance(successor, Successor):
            successor = None
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


def raise_nofile_limit() -> None:
    """Every proxied connection holds two fds: take the hard limit, as kube-proxy's
    userspace mode did, instead of failing at the soft default of 1024."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (OSError, ValueError) as e:
            log.warning("cannot raise the open-file limit from %d to %d: %s", soft, hard, e)
    presize_fd_table()


FD_TABLE_PRESIZE_MAX = 65536
"""Fds the table is grown to at start, at most: 512 KiB of kernel memory per process."""


def presize_fd_table(limit: int | None = None) -> int:
    """Grow this process's fd table to the open-file limit now, while it has one thread.

    The kernel doubles a process's fd table when an fd lands past its end;
    in a process with several threads (the state loader's, for a big state)
    each doubling waits for an RCU grace period, 10-15 ms in which the
    thread that opened the fd, here the event loop binding listeners, is
    stuck. Placing one fd at the top once, single-threaded, makes the table
    its final size up front; every later open is a plain slot fill. Returns
    the size reached (0 if it could not be done, which only costs those stalls).
    """
    if limit is None:
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        limit = soft if soft != resource.RLIM_INFINITY else FD_TABLE_PRESIZE_MAX
    top = min(limit, FD_TABLE_PRESIZE_MAX) - 1
    if top < 3:
        return 0
    try:
        os.fstat(top)
    except OSError:
        pass  # free, as expected: fill it for a moment
    else:
        return top + 1  # in use (inherited?): the table is that big already; never clobber it
    try:
        fd = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return 0
    try:
        os.dup2(fd, top, inheritable=False)
        os.close(top)
    except OSError as e:
        log.debug("cannot presize the fd table to %d: %s", top + 1, e)
        return 0
    finally:
        os.close(fd)
    return top + 1


async def run_until_stopped(
    loop: asyncio.AbstractEventLoop, args: argparse.Namespace,
    source: StateFileSource | KubeAPISource, watcher: asyncio.Task[Any], mode: str,
) -> tuple[asyncio.Event, asyncio.Task[Any]]:
    """Serve until SIGTERM or SIGINT, or until the state source dies; SIGHUP re-reads it.

    Returns ``interrupted`` (set by SIGINT: stop now, no handover window) and
    the task waiting for the signal, for the caller to cancel once stopped.
    """
    stop = asyncio.Event()
    interrupted = asyncio.Event()

    def interrupt() -> None:
        interrupted.set()
        stop.set()

    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, interrupt)
    loop.add_signal_handler(signal.SIGHUP, source.reload)
    log.info("kpx node %s running%s (state from %s)", args.hostname_override, mode,
             args.state or "the Kubernetes API")
    stopper = asyncio.create_task(stop.wait(), name="stop-signal")
    await asyncio.wait({watcher, stopper}, return_when=asyncio.FIRST_COMPLETED)
    if watcher.done() and watcher.exception() is not None:
        log.error("state source died", exc_info=watcher.exception())
    return interrupted, stopper


async def serve_nfqueue(args: argparse.Namespace, loop: asyncio.AbstractEventLoop,
                        hub: StateHub, source: StateFileSource | KubeAPISource,
                        ownership: Ownership | None) -> int:
    """``kpx node --proxy-mode nfqueue``: the same sync and healthz, a SYN-deciding dataplane.

    A restart needs no socket handover: the old process gives the queue back
    when it stops, the new one binds it (retrying meanwhile), and every
    established connection keeps flowing in conntrack throughout. SYNs in
    between are dropped (fail-closed) and retransmitted, or with
    ``--queue-bypass`` pass undecided.
    """
    conntrack.apply(conntrack.Settings.from_flags(args))
    dataplane = NfqueueDataplane(loop=loop, queue=args.queue_num, bypass=args.queue_bypass,
                                 batch_wait=args.queue_batch_wait,
                                 cluster_cidrs=args.cluster_cidr, health=hub.health)
    sidecar = None if args.no_healthz else Sidecar.from_flags(hub.health, args)
    # One instance serves both families (one queue, one socket): it is the IPv6
    # dataplane too, so the proxier hands it the IPv6 result and reports IPv6.
    Proxier(sync_config(args), dataplane=dataplane,
            dataplane6=dataplane if 6 in dataplane.families else None,
            services=sidecar.services if sidecar is not None else None,
            health=hub.health,
            healthz_ipv6=sidecar.serve_healthz_ipv6 if sidecar is not None else None,
            ).attach(hub)
    watcher = await start_source(source, args.sync_period)
    if ownership is not None:
        ownership.attach(loop)
    if sidecar is not None:
        await sidecar.start()
    interrupted, stopper = await run_until_stopped(loop, args, source, watcher,
                                                   " in nfqueue mode")
    source.stop()
    if ownership is not None:
        ownership.stopping()
    await dataplane.stop_accepting()  # the queue is free for a successor from here
    if sidecar is not None:
        await sidecar.stop()
    if ownership is not None:
        ownership.release()
        # A rolling restart's successor announces itself once it has the owner
        # name: wait for it a moment, so the rules stay. Removing them would
        # unhook NAT from every established connection until it reinstalls
        # them, and reset those connections.
        window = 0.0 if interrupted.is_set() else min(args.handover_wait, args.shutdown_grace)
        deadline = loop.time() + window
        while loop.time() < deadline and not live_pids() - {os.getpid()}:
            await asyncio.sleep(0.05)
    dataplane.close()  # removes the rules only if no other kpx is present
    watcher.cancel()
    stopper.cancel()
    log.info("kpx node %s stopped", args.hostname_override)
    return 0


def run_on_uvloop(main: Coroutine[Any, Any, int]) -> int:
    """Run ``main`` on uvloop, the loop kube-proxy's userspace relay needs to keep up."""
    return uvloop.run(main)


def run_worker(args: argparse.Namespace) -> int:
    return run_on_uvloop(serve(args))


def run(args: argparse.Namespace) -> int:
    """Check the flags, claim the network namespace, then serve (one process or N workers).

    The claim comes before any port or routing is touched: a second
    ``kpx node`` here exits at once (status 1) naming the one that serves,
    instead of retrying its ports forever and deleting the routing the other
    one needs when it exits (``proxy.lifecycle.ownership``). When the one that serves
    is stopping (SIGTERM), this one takes over from it instead: it receives
    its listening sockets here and ``serve`` adopts them.
    """
    raise_nofile_limit()
    try:  # fail on bad flags before anything touches the namespace
        make_source(args, StateHub())
    except KubeConfigError as e:
        log.error("%s", e)
        return 2
    if args.proxy_mode == "nfqueue" and args.workers > 1:
        log.error("--workers: nfqueue mode decides SYNs in one process (one queue); use"
                  " --workers 1")
        return 2
    if not 0 <= args.queue_num <= 0xFFFF:
        log.error("--queue-num %d: must be 0-65535", args.queue_num)
        return 2
    if args.queue_batch_wait > MAX_BATCH_WAIT:
        log.error("--queue-batch-wait %gs: at most %gms (each gathered SYN waits this long)",
                  args.queue_batch_wait, MAX_BATCH_WAIT * 1000)
        return 2
    try:
        # One process takes the old one's listening sockets over; --workers
        # cannot share them, so they wait for the owner name (and bind anew).
        ownership = Ownership.acquire(listeners=args.workers <= 1, standby=args.takeover_wait)
    except OwnershipError as e:
        log.error("%s", e)
        return 1
    args.ownership = ownership
    try:
        if args.workers > 1:
            return supervise(args, run_worker)
        return run_worker(args)
    finally:
        ownership.close()
