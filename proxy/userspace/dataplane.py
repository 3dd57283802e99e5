"""The userspace NodePort dataplane: a sync's plans in, listeners and relays out.

Owns: putting each sync's decision table (``proxy.core.sync.SyncResult``,
computed by the proxier) in force and reconciling the listening sockets to
match; the per-service-port balancers (kept across syncs so ClientIP
affinity survives reloads); the transparent return path for the process's
lifetime; and the SIGTERM sequence (stop accepting, drain, close).

Never: read a snapshot or build plans (the proxier's one sync does),
handle signals, block the event loop for long, or let one bad listener stop
the others: a bind or filter failure is logged with service, address and
port, and retried every ``retry_interval`` and on the next sync.

Keeping the loop free during a big sync: ``prepare`` builds the forwarder's
port table and the wanted listeners in the source's worker thread when the
proxier offers it (``StateHub`` preparers), and ``apply`` on the loop finds
them ready. ``apply`` swaps the decision table at once, then reconciles
listeners ``RECONCILE_BATCH`` at a time (and, after the first batch, for
at most ``RECONCILE_SLICE``), yielding to the loop between slices: binding
10,000 new listeners in one piece would hold every new connection and health
probe for as long as that takes. A sync with fewer changes than one batch
finishes inside ``apply``; a newer ``apply`` supersedes the rest of an
unfinished one.

Per (address, nodePort), from the plan:

- ``plan.listen`` False (no endpoint anywhere): no socket at all, so the
  kernel answers RST (REJECT, kpx decision 2);
- ``plan.drop_external``: the socket stays and the SYN filter goes on; it
  passes SYNs from the node's own addresses and 127.0.0.0/8 (those get
  Cluster semantics) and comes off when local endpoints come back (DROP,
  kpx decision 1). A listener bound to 127.0.0.1 never gets it: its
  sources are always local;
- otherwise a plain listener.

One dataplane serves one IP family (``family``), as kube-proxy runs one
proxier per family (its MetaProxier): a dual-stack node runs an IPv4 one
and an IPv6 one, each applying its family's ``SyncResult``. Two instances
and not one that holds both, because nothing but the return path is shared:
each family has its own plans under the same nodePort keys, its own
listeners (``0.0.0.0`` and ``::``, ``IPV6_V6ONLY``), SYN filter program,
balancers (kube-proxy's affinity is per family too) and forwarder; and the
return path's shared part, the ``inet`` nft table, is written
idempotently by either (``proxy.userspace.transparent``).

Addresses (``SyncResult.listen_hosts``, ``proxy.core.addresses``): without
``--nodeport-addresses``, one wildcard ``0.0.0.0`` socket per NodePort, which
is iptables mode's ``--dst-type LOCAL``: every local address, 127.0.0.1
included, whether or not the Node object lists it. With CIDRs, one socket
per node IP (IPv4, from the Node object) and 127.0.0.1 that falls inside one
of them, as in kube-proxy.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import ipaddress
import logging
import resource
import socket
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import NamedTuple

from healthz.proxy_health import ProxyHealth
from proxy import metrics
from proxy.core.addresses import LOCALHOST, Network
from proxy.core.balancer import Balancer
from proxy.core.decision import PlanKey, PortPlan
from proxy.core.flows import UDP_TIMEOUT, UDP_TIMEOUT_STREAM, FlowTable
from proxy.core.sync import SyncResult
from proxy.defaults import TCP_TIMEOUT_CLOSE_WAIT, TCP_TIMEOUT_ESTABLISHED, UDP_FLOW_LIMIT
from proxy.userspace import synfilter
from proxy.userspace.corefwd import CoreAcceptSet, CoreForwarder, make_forwarder
from proxy.userspace.forwarder import (
    PortMetrics,
    PortState,
)
from proxy.userspace.listener import AcceptSet, Listener
from proxy.userspace.sklookup import SkLookup
from proxy.userspace.transparent import RoutingConfig, TransparentRouting, transparent_capable
from proxy.userspace.udp import UdpForwarder, UdpFront
from proxy.userspace.vips import (
    Firewall,
    FirewallPort,
    Interception,
    LocalVIPs,
    VIPPort,
    VIPTarget,
    firewall_sources,
    listen_address,
)
from proxy.util.prepared import Prepared

log = logging.getLogger(__name__)

LOG_EACH_LISTENER_UP_TO = 32
VIPS_SETTLE = 5.0
"""Seconds a stopping kpx lets a VIP change in flight finish before cancelling it."""
RECONCILE_BATCH = 128
"""Listener operations (open, close, filter) per slice of the loop: about 2 ms of binds
on a fast machine. The first slice, inside ``apply``, does this many, so a sync with
fewer changes is in force when ``apply`` returns.

Small, because a slice delays every step of what waits behind it: an HTTP
probe of /healthz takes five loop iterations, each one slice late."""
RECONCILE_SLICE = 0.002
"""Seconds after which a later slice yields even before ``RECONCILE_BATCH`` operations:
on a slower machine 128 binds took 10 ms a slice (docs/PERFORMANCE.md)."""
ListenerKey = tuple[str, int]
Wanted = tuple[PlanKey, str]
"""A wanted listener's plan key and SYN filter: ``""`` or ``"external"``."""


_VIP_COUNTS: dict[int, tuple[int, int]] = {}
"""Per family, the VIPs and steered ports last put in force: the gauges are their sums
(kube-proxy has no such metric, so no ``ip_family`` label to split it by)."""


def _count_vips(family: int, vips: int, ports: int) -> None:
    _VIP_COUNTS[family] = (vips, ports)
    metrics.SERVICE_VIPS.set(sum(v for v, _ in _VIP_COUNTS.values()))
    metrics.SERVICE_VIP_PORTS.set(sum(p for _, p in _VIP_COUNTS.values()))


VIPWant = tuple[Interception, bool, VIPTarget]
"""What one sync asks of the VIPs: the rules its plans want, whether a served port has
ClientIP affinity (``--workers`` then steer by client IP), and the target to put in force."""


def vip_rules(plans: Mapping[PlanKey, PortPlan], passed: tuple[str, ...] = (),
              udp_plans: Mapping[PlanKey, PortPlan] | None = None,
              family: int = 4) -> tuple[Interception, bool]:
    """Sort the VIP plans into served, dropped and (by leaving them out) rejected ports (pure).

    No endpoint anywhere (``plan.listen`` False): in no set, so the table
    rejects it. A ClusterIP with iTP=Local and nothing here: ``drop_all``. An
    external VIP with eTP=Local and nothing here: ``drop_external`` *and*
    ``served``, since pods and the node still get Cluster semantics. The
    second value: some served TCP port has ClientIP affinity. ``udp_plans``
    fill the UDP sets the same way. For ``family`` 6, every NodePort that
    has listeners is one ``::1`` refuses (``Interception.loopback``).
    A served LB IP port with ``loadBalancerSourceRanges`` (``plan.source_ranges``)
    is also in its service's ``Firewall``, which the table checks first.
    """
    def sort(table: Mapping[PlanKey, PortPlan]) -> tuple[frozenset[VIPPort], ...]:
        served: set[VIPPort] = set()
        drop_all: set[VIPPort] = set()
        drop_external: set[VIPPort] = set()
        for plan in table.values():
            if plan.vip is None or not plan.listen:
                continue
            key = (plan.vip, plan.port.port)
            if plan.drop_all:
                drop_all.add(key)
                continue
            if plan.drop_external:
                drop_external.add(key)
            served.add(key)
        return frozenset(served), frozenset(drop_all), frozenset(drop_external)

    affinity = any(p.vip is not None and p.listen and not p.drop_all and p.affinity_seconds
                   for p in plans.values())
    served, drop_all, drop_external = sort(plans)
    udp_served, udp_drop_all, udp_drop_external = sort(udp_plans or {})
    loopback: frozenset[int] = frozenset()
    udp_loopback: frozenset[int] = frozenset()
    if family == 6:
        loopback = frozenset(p.node_port for p in plans.values() if p.vip is None and p.listen)
        udp_loopback = frozenset(p.node_port for p in (udp_plans or {}).values()
                                 if p.vip is None and p.listen)
    rules = Interception(served, drop_all, drop_external, passed,
                         udp_served, udp_drop_all, udp_drop_external, loopback, udp_loopback,
                         firewalls(plans, udp_plans or {}))
    return rules, affinity


def firewalls(plans: Mapping[PlanKey, PortPlan],
              udp_plans: Mapping[PlanKey, PortPlan]) -> tuple[Firewall, ...]:
    """The ``loadBalancerSourceRanges`` firewalls of one family's plans, by service (pure).

    Only plans that carry ranges are in one: an LB IP of a service with
    endpoints (``decision.build_plan``); the relay's ``decide`` drops the same
    sources, for a connection that got past the table.
    """
    found: dict[tuple[str, tuple[str, ...]], set[FirewallPort]] = {}
    for proto, table in (("tcp", plans), ("udp", udp_plans)):
        for plan in table.values():
            if plan.vip is None or not plan.source_ranges or not plan.listen:
                continue
            sources = firewall_sources(plan.source_ranges, plan.source_vips)
            found.setdefault((plan.service.key, sources), set()).add(
                (plan.vip, proto, plan.port.port))
    return tuple(Firewall(key, sources, frozenset(ports))
                 for (key, sources), ports in sorted(found.items()))


class _PortTable(NamedTuple):
    """A forwarder table for one set of plans (``Dataplane._port_table``)."""

    before: dict[PlanKey, PortState]
    """The table in force it was made from."""
    ports: dict[PlanKey, PortState]
    balancers: dict[str, Balancer]
    """Every service port's balancer: the ones it had, and new ones. A service port
    that is gone has none here, so its balancer is dropped."""
    metrics: dict[str, PortMetrics]
    """Every service port's counters ever made: kept, as a Prometheus counter is."""


def default_max_connections() -> int:
    """Half the fds we may open, less a reserve: each relay holds two."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 0
    return max(16, (soft - 128) // 2)


class Dataplane:
    """All NodePort listeners and relays of one node (one kpx process).

    Construct it on the event loop's thread. With ``transparent=True`` the
    return-path routing is installed here, in the current network namespace,
    and removed by ``close()``. Given ``health`` and ``local_vips``, /healthz
    answers 503 until the first sync's VIPs are in force (``VIP_FAULT``), as
    nfqueue mode's does until its rules are: whoever waits for a healthy node
    (a lab, a readiness probe) may then use its ClusterIPs at once.
    """

    VIP_FAULT = "service-vips"

    def __init__(
        self,
        *,
        loop: asyncio.AbstractEventLoop,
        transparent: bool = False,
        connect_timeout: float = 2.0,
        reuse_port: bool = False,
        backlog: int = 1024,
        max_connections: int | None = None,
        retry_interval: float = 1.0,
        routing: RoutingConfig | None = None,
        cluster_cidrs: Iterable[str | Network] | None = None,
        workers: int = 1,
        install_routing: bool = True,
        tcp_timeout_established: float = TCP_TIMEOUT_ESTABLISHED,
        tcp_timeout_close_wait: float = TCP_TIMEOUT_CLOSE_WAIT,
        inherited: Mapping[ListenerKey, socket.socket] | None = None,
        local_vips: LocalVIPs | None = None,
        vip_port: int = 0,
        udp_timeout: float = UDP_TIMEOUT,
        udp_timeout_stream: float = UDP_TIMEOUT_STREAM,
        udp_flow_limit: int = UDP_FLOW_LIMIT,
        health: ProxyHealth | None = None,
        family: int = 4,
    ) -> None:
        if family not in (4, 6):
            raise ValueError(f"family {family}: must be 4 or 6")
        self.loop = loop
        self.family = family
        """The IP family this dataplane serves (a sync of another family is refused)."""
        if local_vips is not None and local_vips.family != family:
            raise ValueError(f"the IPv{family} dataplane was given IPv{local_vips.family} VIPs")
        self.local_vips = local_vips
        """Makes each sync's VIPs local and steers their ports here (None: VIPs not served)."""
        self._health = health if local_vips is not None else None
        self._fault_family: str | None = "IPv6" if family == 6 else None
        """The IPv6 VIPs' fault is IPv6's only: IPv4 keeps answering healthy for its own."""
        if self._health is not None:
            self._health.set_fault(self.VIP_FAULT, "service VIPs not in force yet",
                                   self._fault_family)
        self.vip_address = listen_address(family)
        """Where the VIP listener and UDP VIP socket bind: ``127.0.0.107`` or ``::1``."""
        self.vip_port = vip_port
        """The VIP listener's port on ``vip_address`` (0: the kernel picks; ``--workers``
        share one the supervisor reserved)."""
        self._vip_listener: Listener | None = None
        self._vips_wanted: VIPTarget | None = None
        self._vips_applied: VIPTarget | None = None
        self._vips_generation = -1
        """The generation whose apply last changed what ``_vips_wanted`` holds."""
        self._vips_task: asyncio.Task[None] | None = None
        self.reuse_port = reuse_port
        self.backlog = backlog
        self.retry_interval = retry_interval

        self.workers = workers
        self._routing: TransparentRouting | None = None
        transparent_ok = False
        if transparent and install_routing:
            self._routing = TransparentRouting(
                dataclasses.replace(routing or RoutingConfig(), family=family))
            transparent_ok = self._routing.install()
        elif transparent:
            # A supervisor installed the namespace's return path for all its
            # workers; this process only needs the socket option.
            transparent_ok = transparent_capable(family) is None
        self.forwarder = make_forwarder(
            loop,
            connect_timeout=connect_timeout,
            transparent=transparent_ok,
            max_connections=default_max_connections() if max_connections is None
            else max_connections,
            tcp_timeout_established=tcp_timeout_established,
            tcp_timeout_close_wait=tcp_timeout_close_wait,
            family=family,
        )
        self.forwarder.on_room = self._resume_blocked
        self.accept_set: AcceptSet | CoreAcceptSet = (
            self.forwarder.accept_set() if isinstance(self.forwarder, CoreForwarder)
            else AcceptSet(self.loop))
        """Every listener's socket, polled as one (listener.py says why); the core's
        when it relays (``proxy.userspace.corefwd``)."""
        self.forwarder.cluster_cidrs = tuple(
            ipaddress.ip_network(c, strict=False) for c in cluster_cidrs or ()
        )
        # Merged: nft refuses overlapping intervals in one set (10.0.0.0/8 with
        # 10.244.0.0/16, or one CIDR twice), and the VIP table would never be written.
        self._passed = tuple(str(c) for c in ipaddress.collapse_addresses(
            c for c in self.forwarder.cluster_cidrs if c.version == family))
        """What the VIP guard lets through a Local drop: pods (``--cluster-cidr``), of
        this family only, as its nft sets are (a dual-stack cluster gives both)."""
        self.udp = UdpForwarder(loop, self.forwarder,
                                FlowTable(udp_flow_limit, udp_timeout, udp_timeout_stream))
        """UDP service ports: flows, their sockets, replies (``proxy.userspace.udp``)."""
        self._udp_desired: dict[ListenerKey, PlanKey] = {}
        self._udp_fronts: dict[ListenerKey, UdpFront] = {}
        self._udp_failed: dict[ListenerKey, str] = {}
        self._udp_vip_front: UdpFront | None = None
        """The one socket every UDP VIP port is steered to (like ``_vip_listener``)."""

        self._balancers: dict[str, Balancer] = {}
        self._metrics: dict[str, PortMetrics] = {}
        self._plans: dict[PlanKey, PortPlan] = {}
        self._prepared: Prepared[tuple[dict[ListenerKey, Wanted], _PortTable,
                                       VIPWant | None]] = Prepared()
        """What ``prepare`` built for one sync: its wanted listeners and port table."""
        self._reconciling: Iterator[None] | None = None
        self.clock: Callable[[], float] = time.perf_counter
        """What a reconcile slice's budget is measured with (a test may step it)."""
        self._reconcile_handle: asyncio.Handle | None = None
        self._reconcile_started = 0.0
        self._node_ips: tuple[str, ...] = ()
        self._program: list[synfilter.Instruction] | None = synfilter.syn_drop_program(
            (), family=family)
        self._desired: dict[ListenerKey, Wanted] = {}
        self._listeners: dict[ListenerKey, Listener] = {}
        self._inherited: dict[ListenerKey, socket.socket] = dict(inherited or {})
        """Listening sockets passed on by the kpx node this one took over from
        (``proxy.lifecycle.handover``), unwatched until a sync wants them: adopted in
        place of a new bind, so their accept queues carry on. The first
        complete reconcile closes those no plan wants."""
        self.synced = asyncio.Event()
        """Set once a reconcile has gone through every wanted listener."""
        self._failed: dict[ListenerKey, str] = {}
        self._blocked: set[Listener] = set()
        self._retry_handle: asyncio.TimerHandle | None = None
        self._accepting = True
        self._closed = False
        self.generation = -1
        self._sk: SkLookup | None = None
        """The sk_lookup program that hands VIP connections to the VIP listener."""
        if local_vips is not None:
            try:
                self._sk = SkLookup(family)
            except OSError as exc:
                log.error("service VIPs cannot be steered to kpx (%s); every VIP port is"
                          " refused", exc)
            # Now, not at the first sync: ``prepare`` then knows what can be served.
            self._open_vip_listener()
            self._open_udp_vip_front()

    # -- public API --------------------------------------------------------------

    @property
    def transparent_active(self) -> bool:
        return self.forwarder.transparent

    @property
    def local_addresses(self) -> tuple[str, ...]:
        return self._node_ips

    def active_connections(self) -> int:
        return len(self.forwarder.active)

    def plans(self) -> dict[PlanKey, PortPlan]:
        return dict(self._plans)

    def listeners(self) -> list[tuple[str, int, str]]:
        """``(address, port, state)`` for every wanted listener, sorted.

        The address is ``0.0.0.0`` for the wildcard listener (no
        ``--nodeport-addresses``), which serves every local address.
        States: serving, dropping, paused, or ``error: <why>`` when binding or
        filtering failed and is being retried.
        """
        out = [(a, p, lis.state) for (a, p), lis in self._listeners.items()]
        out += [(a, p, f"error: {why}") for (a, p), why in self._failed.items()]
        if self._vip_listener is not None:
            out.append((self.vip_address, self._vip_listener.port, self._vip_listener.state))
        return sorted(out)

    def udp_sockets(self) -> list[tuple[str, int, str]]:
        """``(address, port, state)`` of every UDP socket that receives for a service, sorted."""
        out = [(a, p, "serving") for (a, p) in self._udp_fronts]
        out += [(a, p, f"error: {why}") for (a, p), why in self._udp_failed.items()]
        vf = self._udp_vip_front
        if vf is not None and vf.sock is not None:
            out.append((vf.host, vf.port, "serving"))
        return sorted(out)

    def listening_sockets(self) -> list[tuple[ListenerKey, socket.socket]]:
        """Every open listener's socket by (address, port): what a handover passes on.

        The listeners keep accepting on them; ``stop_accepting`` closes only
        this process's copies.
        """
        out = [(key, lis.sock) for key, lis in self._listeners.items() if lis.sock is not None]
        vl = self._vip_listener
        if vl is not None and vl.sock is not None:
            out.append(((self.vip_address, vl.port), vl.sock))
        return out

    def prepare(self, sync: SyncResult) -> None:
        """Build what ``apply(sync)`` needs, now, in the caller's thread (a hub preparer's).

        Pure work that ``apply`` would otherwise do on the loop: the wanted
        listeners, the forwarder's port table (``_port_table``), and the VIPs
        validated with their nft table rendered (``VIPTarget``: 50,000 VIPs
        would hold the loop for about 100 ms).
        """
        if self._closed:
            return
        vips = None
        if self.local_vips is not None:
            with contextlib.suppress(ValueError):  # apply says why, on the loop
                vips = self._vip_want(sync)
        self._prepared.put(sync, (
            self._desired_for(sync.plans, sync.listen_hosts), self._port_table(sync.plans), vips,
        ))

    @staticmethod
    def _desired_for(
        plans: dict[PlanKey, PortPlan], hosts: Iterable[str]
    ) -> dict[ListenerKey, Wanted]:
        """Which listeners ``plans`` want: each one's plan key and SYN filter (pure).

        A NodePort plan listens on every host; VIP plans share the one VIP
        listener (``_sync_vips``). The filter is ``"external"`` (drop SYNs but
        the node's and pods') on every dropping listener but a 127.0.0.1 one:
        the wildcard one included, since the program itself lets the node's
        addresses and 127.0.0.0/8 through; else ``""``.
        """
        hosts = tuple(hosts)
        desired: dict[ListenerKey, Wanted] = {}
        for key, plan in plans.items():
            if not plan.listen or plan.vip is not None:
                continue
            for a in hosts:
                desired[(a, key)] = (  # type: ignore[index]
                    key, "external" if plan.drop_external and a != LOCALHOST else ""
                )
        return desired

    def reconciling(self) -> bool:
        """Whether listener reconciliation is still under way (a big sync, in slices)."""
        return self._reconciling is not None

    def apply(self, sync: SyncResult) -> None:
        """Put ``sync`` in force: swap the decision table, reconcile listeners (in slices)."""
        if self._closed:
            return
        if sync.family != self.family:
            raise ValueError(f"the IPv{self.family} dataplane was handed the IPv{sync.family}"
                             f" sync of generation {sync.generation}")
        self.generation = sync.generation
        prepared = self._prepared.take(sync)
        desired, table, vips = prepared if prepared is not None else (None, None, None)
        self._swap_plans(sync.plans, table)

        node_ips = sync.node_ips
        if node_ips != self._node_ips:
            self._node_ips = node_ips
            self.forwarder.local_addresses = frozenset(node_ips)
            try:
                self._program = synfilter.syn_drop_program(
                    node_ips, self.forwarder.cluster_cidrs, self.family
                )
            except ValueError as exc:
                log.error("cannot build the SYN filter for %s: %s", ", ".join(node_ips), exc)
                self._program = None

        self._desired = (
            desired if desired is not None else self._desired_for(sync.plans, sync.listen_hosts)
        )
        self.udp.swap(sync.udp_plans)
        self._udp_desired = self._udp_desired_for(sync.udp_plans, sync.listen_hosts)
        if self.local_vips is not None:
            if vips is None:
                try:
                    vips = self._vip_want(sync)
                except ValueError as exc:
                    log.error("service VIPs of generation %d not put in force: %s; the last"
                              " ones stay", sync.generation, exc)
            if vips is not None:
                self._sync_vips(*vips)
        self._reconcile()

    # -- service VIPs ------------------------------------------------------------

    def _vip_want(self, sync: SyncResult) -> VIPWant:
        """``vip_rules`` of the sync and its ``VIPTarget``; ValueError for a bad VIP."""
        wanted, affinity = vip_rules(sync.plans, self._passed, sync.udp_plans, self.family)
        return wanted, affinity, self._vip_target(sync.vips, wanted)

    def _steerable(self, wanted: Interception) -> Interception:
        """What can be served now: nothing without the program, or without its socket."""
        if self._sk is None:
            return dataclasses.replace(wanted, served=frozenset(), udp_served=frozenset())
        if self._vip_listener is None:
            wanted = dataclasses.replace(wanted, served=frozenset())
        if self._udp_vip_front is None:
            wanted = dataclasses.replace(wanted, udp_served=frozenset())
        return wanted

    def _vip_target(self, vips: frozenset[str], wanted: Interception) -> VIPTarget:
        """The VIPs and table ``wanted`` asks for, as far as they can be served now.

        Pure but for reading whether the listener and program are there:
        ``prepare`` calls it off the loop. What cannot be served is refused.
        ValueError for a VIP that is not one (``vips.vip``).
        """
        lv = self.local_vips
        assert lv is not None
        return VIPTarget.build(vips, self._steerable(wanted), lv.nft_table, lv.known, lv.proto,
                               self.family)

    def _sync_vips(self, wanted: Interception, affinity: bool, target: VIPTarget) -> None:
        """Put the VIPs, their steering and their nft table in force, in the background.

        The decision table is swapped already, so a connection to a VIP port
        that just changed meets its new plan. The pair map is a few batch
        syscalls; the routes and the table are the ``ip`` and ``nft`` runs of
        ``LocalVIPs.sync_async``, which the loop never waits for. While one
        runs, a newer sync only replaces what is wanted (newest wins); the
        run that follows puts it in force.
        """
        vl = self._vip_listener
        if vl is None and wanted.served:
            vl = self._open_vip_listener()
        assert target.rules is not None
        steerable = self._steerable(wanted)
        if (target.rules.served, target.rules.udp_served) != (steerable.served,
                                                              steerable.udp_served):
            target = self._vip_target(target.vips, wanted)  # a socket came or went
        if vl is not None:
            self._set_vip_steering(vl, affinity)
        if not target.same(self._vips_wanted):
            self._vips_wanted = target
            self._vips_generation = self.generation
        if self._vips_task is None or self._vips_task.done():
            self._vips_task = self.loop.create_task(self._put_vips(), name="service-vips")

    async def _put_vips(self) -> None:
        assert self.local_vips is not None
        while (not self._closed and self._vips_wanted is not None
               and not self._vips_wanted.same(self._vips_applied)):
            target, generation = self._vips_wanted, self._vips_generation
            rules = target.rules
            assert rules is not None
            try:
                # Steering is a superset of the routes at every instant: new
                # pairs before their route exists, gone ones after it went. A
                # local route without steering would answer its SYNs with RST.
                sk = self._sk
                await self._steer(rules.served | (sk.served if sk else set()),
                                  rules.udp_served | (sk.served_of("UDP") if sk else set()))
                await self.local_vips.sync_async(target)
                await self._steer(rules.served, rules.udp_served)
            except (OSError, ValueError, RuntimeError) as exc:
                log.error("cannot put %d service VIPs in force: %s; retrying in %.1fs",
                          len(target.vips), exc, self.retry_interval)
                await asyncio.sleep(self.retry_interval)
                continue
            self._vips_applied = target
            if self._health is not None:
                self._health.clear_fault(self.VIP_FAULT, self._fault_family)
            _count_vips(self.family, len(target.vips), len(rules.served) + len(rules.udp_served))
            vl = self._vip_listener
            log.info("IPv%d service VIPs in force (generation %d): %d VIPs, %d ports steered to"
                     " %s:%d, %d dropping", self.family, generation, len(target.vips),
                     len(rules.served), self.vip_address, vl.port if vl is not None else 0,
                     len(rules.drop_all) + len(rules.drop_external))

    async def _steer(self, served: frozenset[VIPPort], udp_served: frozenset[VIPPort]) -> None:
        if self._sk is not None:
            for _ in self._sk.changes(served):
                await asyncio.sleep(0)  # a batch syscall each: let connections in
            for _ in self._sk.changes(udp_served, proto="UDP"):
                await asyncio.sleep(0)

    async def vips_synced(self) -> None:
        """Wait until the VIPs and rules of the latest ``apply`` are in force (tests, bench)."""
        while self._vips_task is not None and not self._vips_task.done():
            await asyncio.shield(self._vips_task)

    def _open_vip_listener(self) -> Listener | None:
        """The one listener every VIP port is steered to; None if it cannot bind.

        Adopts the one a predecessor passed on (the only socket on
        ``vip_address`` among them): its accept queue carries on.
        """
        key = next((k for k in self._inherited if k[0] == self.vip_address
                    and (not self.vip_port or k[1] == self.vip_port)), None)
        adopt = self._inherited.pop(key) if key is not None else None
        lis = Listener(
            self.loop, self.vip_address, key[1] if key is not None else self.vip_port,
            self.forwarder.on_accept, admit=self.forwarder.has_capacity,
            on_blocked=self._on_blocked, backlog=self.backlog, reuse_port=self.reuse_port,
            label="service VIPs", accept_set=self.accept_set, steered=True,
        )
        try:
            try:
                lis.open(None, adopt=adopt)
            except OSError:
                if adopt is None:
                    raise
                adopt.close()
                lis.open(None)
            if self._sk is not None:
                assert lis.sock is not None
                self._sk.steer_to(lis.sock)
        except OSError as exc:
            lis.close()
            log.error("cannot open the service VIP listener on %s:%d: %s; every VIP port is"
                      " refused until it can", self.vip_address, lis.port,
                      exc.strerror or exc)
            self._schedule_retry()
            return None
        log.info("service VIPs steered to %s:%d%s", self.vip_address, lis.port,
                 " (socket taken over)" if adopt is not None else "")
        self._vip_listener = lis
        return lis

    def _open_udp_vip_front(self) -> None:
        """The one UDP socket every UDP VIP port is steered to; logged and retried if it fails."""
        front = UdpFront(self.udp, self.vip_address, 0, None, "service VIPs")
        try:
            front.open()
            if self._sk is not None:
                assert front.sock is not None
                self._sk.steer_to(front.sock)
        except OSError as exc:
            front.close()
            log.error("cannot open the UDP service VIP socket on %s: %s; every UDP VIP port is"
                      " rejected until it can", self.vip_address, exc.strerror or exc)
            self._schedule_retry()
            return
        self._udp_vip_front = front

    # -- UDP NodePorts ---------------------------------------------------------------

    @staticmethod
    def _udp_desired_for(plans: Mapping[PlanKey, PortPlan], hosts: Iterable[str]
                         ) -> dict[ListenerKey, PlanKey]:
        """The UDP NodePort sockets ``plans`` want: one per host, none without endpoints."""
        hosts = tuple(hosts)
        return {(a, plan.port.node_port): key for key, plan in plans.items()
                if plan.listen and plan.vip is None for a in hosts}

    def _reconcile_udp(self) -> None:
        """Bind what is wanted and missing, close what is not (REJECT is the closed port).

        UDP NodePorts are few next to TCP's, so this runs in one piece.
        """
        want = self._udp_desired if self._accepting else {}
        for key in [k for k in self._udp_fronts if self._udp_fronts[k].table_key != want.get(k)]:
            self._udp_fronts.pop(key).close()
            log.info("closed UDP socket %s:%d", *key)
        self._udp_failed = {k: v for k, v in self._udp_failed.items() if k in want}
        for key, table_key in want.items():
            if key in self._udp_fronts:
                continue
            plan = self.udp.ports[table_key].plan
            front = UdpFront(self.udp, key[0], key[1], table_key, plan.key)
            try:
                # Always SO_REUSEPORT: a restart's successor binds beside this
                # process (which closes its copy when it stops accepting)
                # instead of failing until it has gone, and ``--workers`` share
                # the port. With workers, a client's datagrams all meet one of
                # them (by source IP), so flows and ClientIP affinity hold.
                front.open(reuse_port=True)
                if self.workers > 1:
                    assert front.sock is not None
                    synfilter.attach_reuseport(
                        front.sock, synfilter.reuseport_steering_program(self.workers,
                                                                         self.family))
            except OSError as exc:
                front.close()
                why = exc.strerror or str(exc)
                if self._udp_failed.get(key) != why:
                    log.error("cannot listen on UDP %s:%d for %s: %s; retrying every %.1fs",
                              key[0], key[1], plan.key, why, self.retry_interval)
                self._udp_failed[key] = why
                continue
            self._udp_failed.pop(key, None)
            self._udp_fronts[key] = front
            log.info("listening on UDP %s:%d for %s", key[0], key[1], plan.key)
        if self._udp_failed:
            self._schedule_retry()

    def _close_udp(self) -> None:
        for front in self._udp_fronts.values():
            front.close()
        self._udp_fronts.clear()
        self._udp_failed.clear()
        if self._udp_vip_front is not None:
            self._udp_vip_front.close()
            self._udp_vip_front = None

    def _set_vip_steering(self, lis: Listener, affinity: bool) -> None:
        try:
            lis.set_steering(self.workers if self.workers > 1 and affinity else 0)
        except OSError as exc:
            log.warning("service VIP listener: cannot steer by client IP: %s", exc)

    async def stop_accepting(self) -> None:
        """Close every listener (SIGTERM step 1); relays keep running.

        After a handover the successor holds the same sockets, so closing
        this process's copies ends its accepting, not the listening.
        """
        self._close_listeners()
        self.forwarder.flush_metrics()
        await self._settle_vips()

    async def _settle_vips(self, timeout: float = VIPS_SETTLE) -> None:
        """Let a VIP change in flight finish (or cancel it after ``timeout``).

        It holds the namespace's routing lock across its ``ip``/``nft`` runs, on
        this loop; ``close`` then takes the same lock blocking the loop, so a
        change still in flight would hold it until the lock's timeout.
        """
        task = self._vips_task
        if task is None or task.done():
            return
        done, _ = await asyncio.wait({task}, timeout=timeout)
        if not done:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    def _close_listeners(self) -> None:
        """No new connections from here on: every listener closed, no retries."""
        self._accepting = False
        self._cancel_retry()
        self._cancel_reconcile()
        for lis in self._listeners.values():
            lis.close()
        self._listeners.clear()
        if self._vip_listener is not None:
            self._vip_listener.close()
            self._blocked.discard(self._vip_listener)
            self._vip_listener = None
        self._close_inherited(all_of_them=True)
        self._close_udp()
        self._failed.clear()
        self._blocked.clear()
        self._update_gauge()

    async def drain(self, grace: float) -> int:
        """Wait up to ``grace`` seconds for relays to end, then RST the rest.

        Returns how many connections had to be reset.
        """
        n = len(self.forwarder.active)
        if n:
            log.info("draining %d connection(s) for up to %.1fs", n, grace)
        if await self.forwarder.wait_idle(grace):
            return 0
        aborted = self.forwarder.abort_all()  # synchronous: every socket is closed
        log.warning("grace period over: reset %d connection(s)", aborted)
        return aborted

    def close(self) -> None:
        """Release everything: listeners, connections (RST), routing. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._close_listeners()
        self.accept_set.close()
        self.forwarder.close()
        self.udp.close()
        if self._vips_task is not None:
            self._vips_task.cancel()
        if self._sk is not None:
            self._sk.close()
        if self.local_vips is not None and self.local_vips.installed:
            self.local_vips.remove_all()  # only if no other kpx is present
        if self._routing is not None:
            self._routing.remove()
            self.forwarder.transparent = False
        self._update_gauge()

    # -- reconciliation ----------------------------------------------------------

    def _port_table(self, plans: dict[PlanKey, PortPlan]) -> _PortTable:
        """The forwarder's table for ``plans``, made from the current one without changing it.

        Pure, so ``prepare`` builds it in the source's thread, off the loop
        that relays (10,000 new PortStates are a noticeable stall). A plan that ``PlanCache`` handed
        back unchanged keeps its PortState: one endpoint change among 10,000
        services rebuilds one, not 10,000.
        """
        before = self.forwarder.ports
        balancers, metrics_of = self._balancers, self._metrics
        kept: dict[str, Balancer] = {}
        new_metrics: dict[str, PortMetrics] = {}
        ports: dict[PlanKey, PortState] = {}
        for port, plan in plans.items():
            state = before.get(port)
            key = plan.key
            if state is not None and state.plan is plan:
                ports[port] = state
                kept[key] = state.balancer
                continue
            balancer = kept.get(key)
            if balancer is None:
                balancer = balancers.get(key)
                if balancer is None:
                    balancer = Balancer()
                kept[key] = balancer
            m = metrics_of.get(key)
            if m is None:
                m = new_metrics.get(key)
                if m is None:
                    m = new_metrics[key] = PortMetrics(key)
            ports[port] = PortState(plan, balancer, m)
        # Whole dicts, so that the loop swaps them in one assignment each: merging
        # 50,000 new entries and sweeping out the gone ones there was a stall of its
        # own at a big publish (docs/PERFORMANCE.md, "The relay's stall during a
        # 50,000-service apply").
        metrics = {**metrics_of, **new_metrics} if new_metrics else metrics_of
        return _PortTable(before, ports, kept, metrics)

    def _swap_plans(self, plans: dict[PlanKey, PortPlan], table: _PortTable | None = None) -> None:
        """Put ``plans`` in force; ``table`` is their ``_port_table`` if ``prepare`` made it.

        Only ``_swap_plans`` changes the table, balancers and metrics, so a
        table made from the very table in force is still right; else it is
        made again here.
        """
        if table is None or table.before is not self.forwarder.ports:
            table = self._port_table(plans)
        self._balancers = table.balancers
        self._metrics = table.metrics
        # One assignment: a connection accepted from here on sees the new
        # table, one accepted before keeps the PortState it started with.
        self.forwarder.ports = table.ports
        self._plans = plans

    def _reconcile(self) -> None:
        """Start reconciling listeners to ``_desired``; a big change continues in slices."""
        if not self._accepting:
            return
        self._reconcile_udp()
        self._cancel_reconcile()
        self._reconcile_started = time.perf_counter()
        self._reconciling = self._reconcile_steps()
        self._reconcile_slice(budget=None)

    def _reconcile_slice(self, budget: float | None = RECONCILE_SLICE) -> None:
        """Up to ``RECONCILE_BATCH`` steps, and, given a ``budget``, no more after it has
        run out (``clock``); then the rest is called soon."""
        self._reconcile_handle = None
        steps = self._reconciling
        if steps is None:
            return
        clock = self.clock
        deadline = None if budget is None else clock() + budget
        for _ in range(RECONCILE_BATCH):
            if next(steps, StopIteration) is StopIteration:
                self._reconciling = None
                return
            if deadline is not None and clock() >= deadline:
                break
        # More to do: let connections and probes through first.
        self._reconcile_handle = self.loop.call_soon(self._reconcile_slice)

    def _cancel_reconcile(self) -> None:
        if self._reconcile_handle is not None:
            self._reconcile_handle.cancel()
            self._reconcile_handle = None
        self._reconciling = None

    def _reconcile_steps(self) -> Iterator[None]:
        """The listener work of one sync, one operation per ``next``.

        Each step re-reads ``_desired`` and ``_plans`` as they are *now*: the
        generator is dropped (``_cancel_reconcile``) whenever a newer sync
        starts its own, so it never works from a stale table.
        """
        gone = [k for k in self._listeners if k not in self._desired]
        new = sum(1 for k in self._desired if k not in self._listeners)
        # One line per listener reads well for a lab's handful of services; a
        # sync of thousands gets a summary, and the details at debug level.
        level = logging.INFO if len(gone) + new <= LOG_EACH_LISTENER_UP_TO else logging.DEBUG
        for key in gone:
            lis = self._listeners.pop(key)
            lis.close()
            self._blocked.discard(lis)
            log.log(level, "closed listener %s:%d (%s)", key[0], key[1], lis.label)
            yield
        if level == logging.DEBUG:
            log.info("listeners: opening %d, closed %d", new, len(gone))
        for key in [k for k in self._failed if k not in self._desired]:
            del self._failed[key]

        retry = False
        for key, (plan_key, mode) in list(self._desired.items()):
            yield
            addr, port = key
            plan = self._plans[plan_key]
            drop = mode == "external"
            program = self._program if drop else None
            steer = self.workers if self.workers > 1 and plan.affinity_seconds else 0
            if drop and program is None:
                # No valid filter for these addresses: serving is the safer
                # failure than dropping node-originated traffic too.
                self._note_failure(key, plan, "no SYN filter (see earlier error)")
                retry = True
                program = None
            lis = self._listeners.get(key)
            adopt = self._inherited.pop(key, None) if lis is None else None
            try:
                if lis is None:
                    lis = Listener(
                        self.loop, addr, port, self.forwarder.on_accept,
                        admit=self.forwarder.has_capacity, on_blocked=self._on_blocked,
                        backlog=self.backlog, reuse_port=self.reuse_port, label=plan.key,
                        steer_workers=steer, accept_set=self.accept_set,
                    )
                    try:
                        lis.open(program, adopt=adopt)
                    except OSError as exc:
                        if adopt is None:
                            raise
                        # Not the socket it claims to be, or it cannot take our
                        # filter: a socket of our own is the safer one to serve.
                        adopt.close()
                        log.warning("%s:%d (%s): cannot take the inherited socket over: %s; "
                                    "binding anew", addr, port, plan.key, exc.strerror or exc)
                        adopt = None
                        lis.open(program)
                    self._listeners[key] = lis
                    log.log(level, "listening on %s:%d for %s%s%s", addr, port, plan.key,
                            " (dropping external SYNs)" if program else "",
                            " (socket taken over)" if adopt is not None else "")
                else:
                    lis.label = plan.key
                    was = lis.dropping
                    lis.set_filter(program)
                    lis.set_steering(steer)
                    if was != lis.dropping:
                        log.info("%s:%d (%s): %s", addr, port, plan.key,
                                 "dropping external SYNs: no local endpoint" if lis.dropping
                                 else "local endpoints back: accepting external SYNs")
            except OSError as exc:
                self._note_failure(key, plan, exc.strerror or str(exc), exc)
                retry = True
                continue
            if not (drop and self._program is None):
                self._failed.pop(key, None)
        self._close_inherited()
        self.synced.set()
        if retry:
            self._schedule_retry()
        self._update_gauge()
        if level == logging.DEBUG:
            log.info("listeners reconciled in %.0f ms (%d listening)",
                     (time.perf_counter() - self._reconcile_started) * 1000,
                     len(self._listeners))

    def _close_inherited(self, all_of_them: bool = False) -> None:
        """Close the inherited sockets no plan wants (or, stopping, all of them)."""
        for key in [k for k in self._inherited if all_of_them or k not in self._desired]:
            self._inherited.pop(key).close()
            if not all_of_them:
                log.info("closed listener %s:%d taken over but not wanted", *key)

    def _note_failure(
        self, key: ListenerKey, plan: PortPlan, why: str, exc: OSError | None = None
    ) -> None:
        # Log when a failure starts or changes, not on every retry.
        if self._failed.get(key) != why:
            what = "listen on" if key not in self._listeners else "set the SYN filter on"
            log.warning(
                "%s: cannot %s %s:%d: %s%s; retrying every %.1fs",
                plan.key, what, key[0], key[1], why,
                f" (errno {exc.errno})" if exc is not None and exc.errno else "",
                self.retry_interval,
            )
        self._failed[key] = why

    def _schedule_retry(self) -> None:
        if self._retry_handle is None and not self._closed:
            self._retry_handle = self.loop.call_later(self.retry_interval, self._retry)

    def _cancel_retry(self) -> None:
        if self._retry_handle is not None:
            self._retry_handle.cancel()
            self._retry_handle = None

    def _retry(self) -> None:
        self._retry_handle = None
        if not self._accepting or self._closed:
            return
        reopened = False
        if self._udp_vip_front is None and self._sk is not None:
            self._open_udp_vip_front()
            reopened = self._udp_vip_front is not None
        if self._vips_wanted is not None and (self._vip_listener is None or reopened):
            # A VIP socket failed to bind, or has just bound: again, for what the
            # last apply wanted (``_sync_vips`` re-renders when what is servable changed).
            self._sync_vips(*vip_rules(self._plans, self._passed, self.udp.plans(), self.family),
                            self._vips_wanted)
        if self._failed or self._udp_failed:
            self._reconcile()

    def _on_blocked(self, lis: Listener) -> None:
        self._blocked.add(lis)
        self._update_gauge()

    def _resume_blocked(self) -> None:
        if not self._blocked:
            return
        blocked = list(self._blocked)
        self._blocked.clear()
        for lis in blocked:
            lis.resume()
        self._update_gauge()

    def _update_gauge(self) -> None:
        counts = {"serving": 0, "dropping": 0, "paused": 0}
        every = list(self._listeners.values())
        if self._vip_listener is not None:
            every.append(self._vip_listener)
        for lis in every:
            st = lis.state
            if st in counts:
                counts[st] += 1
        for state, n in counts.items():
            metrics.LISTENERS.labels(state).set(n)

