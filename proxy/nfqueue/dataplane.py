"""``--proxy-mode nfqueue``: Python decides each connection's SYN, the kernel forwards the rest.

Owns: the queue socket (``proxy.nfqueue.netlink``), the rules that feed it
and act on its verdicts (``proxy.nfqueue.rules``), and the per-service-port
balancers. For each queued SYN, and each UDP datagram that starts a flow,
it applies the plan in force for the address, port and protocol the packet
is for (``decision.decide``, the very function the relay uses) and answers:

- Forward: NF_ACCEPT with a mark naming the endpoint's slot (and the
  masquerade bit when the decision SNATs); the nft maps DNAT to it and
  conntrack carries the connection from then on, in the kernel;
- Drop: NF_DROP (the client retransmits, then times out);
- Reject: NF_ACCEPT with the REJECT mark, answered with a TCP reset (UDP:
  ICMP port unreachable).

A UDP flow stays where its first datagram went for as long as conntrack
keeps it; when an endpoint stops being served, the entries pinned to it
are deleted (``conntrack.stale_udp``), as kube-proxy does, so the flow's
next datagram is decided again instead of vanishing.

Slots: every endpoint ``(ip, port)`` of a frontend (a NodePort, or a VIP's
port; per protocol) has a stable slot there, and the DNAT maps are keyed by
slot and frontend (``Slots``). A new plan table is put in force only once
``nft`` has written the maps it needs, so a verdict never names a slot the
kernel does not have yet; a slot is retired one sync after its endpoint
left, so SYNs decided just before still find it. A SYN the table in force
has no plan for was queued by the table being written (its transaction has
committed, or nothing would queue that SYN), and that table decides it.

Dual-stack: one instance serves both families, where kube-proxy's
MetaProxier runs a proxier per family. The queue number is one kernel
object that one socket binds, and both families' rules (``ip kpx_nfq``,
``ip6 kpx_nfq``, and the iptables and ip6tables rules) queue to it, so two
instances would fight over it. Inside, everything else is per family, as
two proxiers' would be: plans and tables (``Tables``), slots and the DNAT
maps they number, what each nft table holds, the UDP conntrack cleanup,
and the balancers. ``apply`` takes either family's result (the proxier
hands this one instance both, as its ``dataplane`` and ``dataplane6``); an
IPv4 result's ``ipv6`` sets the IPv6 half too (``empty_result`` when the
node has none: the IPv6 table then serves nothing). A queued packet's IP
version picks the family's table.

Threads: the queue is read by a thread of its own, asleep in ``poll``; the
event loop keeps the syncs, whose walk over every plan runs in a worker
thread (``proxy.util.background``). So SYNs do not wait for a sync (at tens
of thousands of services, every SYN queued while the loop walked the plans
waited the walk out), nor /healthz for either. They share only immutable
tables, swapped by reference.

Restarts: the socket moves to the successor (``listening_sockets``, passed
over ``proxy.lifecycle.ownership``'s handover), so the queue stays bound.
The successor works out its first tables while this process still
decides (``successor``, ``prepared``); once it has stopped, ``proceed``
writes them in place, and the SYNs queued meanwhile wait in the socket for
them. Without that handover the queue is read only once the first tables
are in force, too: a SYN queued by leftover rules (a SIGKILLed kpx's, whose
slots may name other endpoints) waits for the new ones.

Never: relay a byte, retry a failed connect (the endpoint's RST reaches the
client, as with iptables mode), or touch a rule that is not kpx's. The
rules are installed once the queue is bound, changed element by element on
each sync (the whole table when that is refused), and removed at exit only
when no other kpx is present in the namespace.

What differs from the relay (the README has the table): no retry, the
connect timeout is the client's, half-close/RST/backpressure are the
kernel's, drain follows conntrack (nothing to drain in this process), and
no byte counts are kept.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import os
import select
import socket
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import NamedTuple, TypeVar

from healthz.proxy_health import ProxyHealth
from proxy import metrics
from proxy.core.balancer import Balancer
from proxy.core.decision import Drop, Forward, PlanKey, PortPlan, decide
from proxy.core.sync import SyncResult, empty_result
from proxy.defaults import DEFAULT_BATCH_WAIT
from proxy.lifecycle.ownership import live_pids
from proxy.nfqueue import conntrack, netlink, rules
from proxy.nfqueue.netlink import NF_ACCEPT, Verdict
from proxy.util import spawn
from proxy.util.background import OffLoop
from proxy.util.lograte import RateLimitedLog

log = logging.getLogger(__name__)
_T = TypeVar("_T")

TCP = 6
UDP = 17
FULL_SYNC_PERIOD = 3600.0
"""Seconds between whole-table writes, whatever changed: kube-proxy's ``FullSyncPeriod``
(an hour), after which anything changed by hand in kpx's table is put right even if no
element-by-element change ran into it."""
METRICS_FLUSH_INTERVAL = 1.0
"""Seconds between metric flushes: what a scrape may lag behind the verdicts."""
QUEUE_KEY = "nfqueue"
"""The queue socket's key among a handover's listening sockets: ``(QUEUE_KEY, queue)``."""
BIND_RETRY = 0.1
"""Seconds between attempts to bind a queue a predecessor still holds (a restart)."""
PUT_RETRY = 1.0
"""Seconds between attempts to put a sync's rules in force after one failed."""
UNREAD_ATTEMPTS = 2
"""Failed attempts at the first tables after which the queue, once this process's, is read
anyway and every SYN refused: see ``_read_without_tables``."""


class Table(NamedTuple):
    """What the verdicts read of one family: the plans and target indices in force, together."""

    plans: Mapping[PlanKey, PortPlan]
    served: rules.Served
    udp_plans: Mapping[PlanKey, PortPlan]
    marks: Mapping[tuple[int, PlanKey], Mapping[tuple[str, int], tuple[int, int]]]
    """(protocol, plan's table key) -> endpoint -> its FORWARD marks (without, with
    masquerade): what a verdict sends, made once per sync."""
    live: frozenset[tuple[int, int, str]] = frozenset()
    """(family, protocol, service port key) of every plan: the balancers worth keeping."""
    endpoints: int = 0
    """Distinct endpoints the marks name, for the log (counted with the rest, off the loop)."""

    def plan(self, proto: int, dst: str, dport: int) -> PortPlan | None:
        """The plan a packet to ``dst:dport`` meets: its address's own, else the NodePort's."""
        t = self.plans if proto == TCP else self.udp_plans if proto == UDP else None
        return None if t is None else t.get((dst, dport)) or t.get(dport)


EMPTY = Table({}, rules.Served(), {}, {}, frozenset())


class Tables(NamedTuple):
    """Both families' tables, swapped together: a packet's IP version picks one."""

    v4: Table = EMPTY
    v6: Table = EMPTY

    def of(self, family: int) -> Table:
        return self.v6 if family == 6 else self.v4


class _Plans(NamedTuple):
    """One family's share of the latest ``apply``."""

    plans: Mapping[PlanKey, PortPlan]
    hosts: tuple[str, ...]
    udp_plans: Mapping[PlanKey, PortPlan]


class _Wanted(NamedTuple):
    """The latest ``apply``, waiting to be put in force."""

    generation: int
    v4: _Plans
    v6: _Plans


_new = tuple.__new__
"""A NamedTuple record made in C (``netlink._new``): the verdict of every forwarded SYN."""
_NONE: Mapping[tuple[str, int], tuple[int, int]] = {}

_UDP = "udp"
"""The ``per_port`` key of UDP counts: the UDP metrics have no service label."""


class Targets:
    """Stable endpoint -> index numbering for the ``targets`` map, with one sync of grace."""

    def __init__(self, max_index: int) -> None:
        self.max_index = max_index
        self._index: dict[tuple[str, int], int] = {}
        self._retiring: dict[tuple[str, int], int] = {}
        self._free: list[int] = []
        self._next = 1

    def assign(self, wanted: Iterable[tuple[str, int]]) -> dict[int, tuple[str, int]]:
        """Number ``wanted``; returns the whole map to write (retiring entries included).

        ValueError when more endpoints are wanted than the mark can number.
        """
        wanted = set(wanted)
        # Retired a sync ago: their indices are free again.
        self._free.extend(self._retiring.values())
        self._retiring = {ep: i for ep, i in self._index.items() if ep not in wanted}
        self._index = {ep: i for ep, i in self._index.items() if ep in wanted}
        for ep in sorted(wanted - self._index.keys()):
            if self._free:
                i = self._free.pop()
            elif self._next <= self.max_index:
                i, self._next = self._next, self._next + 1
            else:
                raise ValueError(f"nfqueue mode numbers at most {self.max_index} distinct"
                                 f" endpoints; this state has more")
            self._index[ep] = i
        return {i: ep for ep, i in (*self._index.items(), *self._retiring.items())}

    @property
    def index(self) -> dict[tuple[str, int], int]:
        return dict(self._index)


def frontend(plan: PortPlan, proto: str) -> rules.Frontend:
    """Where ``plan`` is reached: (VIP or None for a NodePort, protocol, port)."""
    if plan.vip is None:
        return (None, proto, plan.port.node_port)
    return (plan.vip, proto, plan.port.port)


class Slots:
    """A ``Targets`` numbering per frontend: the DNAT maps' keys are (slot, frontend).

    Why per frontend: the mark has room for 32,766 numbers, and a node serves
    every endpoint of the cluster; a service port rarely has more than a few
    hundred. A frontend that goes keeps its slots for one more sync, as an
    endpoint does.
    """

    def __init__(self, max_slot: int) -> None:
        self.max_slot = max_slot
        self._fronts: dict[rules.Frontend, Targets] = {}

    def assign(self, wanted: Mapping[rules.Frontend, Iterable[tuple[str, int]]]
               ) -> dict[rules.Frontend, dict[int, tuple[str, int]]]:
        """Number each frontend's endpoints; the whole of both maps to write.

        ValueError naming the frontend when one has more endpoints than a mark numbers.
        """
        out: dict[rules.Frontend, dict[int, tuple[str, int]]] = {}
        for fe, eps in wanted.items():
            t = self._fronts.get(fe)
            if t is None:
                t = self._fronts[fe] = Targets(self.max_slot)
            try:
                out[fe] = t.assign(eps)
            except ValueError:
                vip, proto, port = fe
                raise ValueError(f"{vip or 'NodePort'} {port}/{proto}: more than"
                                 f" {self.max_slot} endpoints") from None
        for fe in [fe for fe in self._fronts if fe not in wanted]:
            retiring = self._fronts[fe].assign(())
            if retiring:
                out[fe] = retiring
            else:
                del self._fronts[fe]
        return out

    def index(self, fe: rules.Frontend) -> dict[tuple[str, int], int]:
        t = self._fronts.get(fe)
        return {} if t is None else t.index


def _queued(plans: Mapping[PlanKey, PortPlan], hosts: tuple[str, ...], vips: set[str]
            ) -> tuple[frozenset[int], frozenset[tuple[str, int]]]:
    """One protocol's ``(ports, pairs)``; adds every VIP seen to ``vips``."""
    wildcard = "0.0.0.0" in hosts or "::" in hosts
    ports: set[int] = set()
    pairs: set[tuple[str, int]] = set()
    for plan in plans.values():
        if plan.vip is not None:
            vips.add(plan.vip)
            if plan.listen:
                pairs.add((plan.vip, plan.port.port))
        elif plan.listen:
            if wildcard:
                ports.add(plan.port.node_port)
            else:
                pairs.update((h, plan.port.node_port) for h in hosts)
    return frozenset(ports), frozenset(pairs)


def _endpoints(plans: Mapping[PlanKey, PortPlan], udp_plans: Mapping[PlanKey, PortPlan]
               ) -> dict[rules.Frontend, set[tuple[str, int]]]:
    """Every frontend's endpoints: both sets, since a local terminating endpoint (eTP=Local's
    fallback) is in ``local`` only while ready ones elsewhere fill ``cluster``."""
    out: dict[rules.Frontend, set[tuple[str, int]]] = {}
    for name, table in (("tcp", plans), ("udp", udp_plans)):
        for plan in table.values():
            out.setdefault(frontend(plan, name), set()).update(
                ep.addr for eps in (plan.cluster, plan.local) for ep in eps)
    return out


def served_for(plans: Mapping[PlanKey, PortPlan], listen_hosts: Iterable[str],
               targets: Mapping[rules.Frontend, Mapping[int, tuple[str, int]]],
               udp_plans: Mapping[PlanKey, PortPlan] | None = None) -> rules.Served:
    """What the table must queue for ``plans`` and ``udp_plans`` (pure).

    A NodePort with endpoints is queued on every local address (``0.0.0.0``
    or ``::`` in ``listen_hosts``; never ``::1``, which the IPv6 table
    turns away) or on the given ones (``--nodeport-addresses``);
    a VIP port on its VIP. A port without endpoints is not queued: a TCP
    NodePort then meets no listener (RST), a UDP one the node's own ICMP
    port unreachable, a VIP the table's reject.
    """
    hosts = tuple(listen_hosts)
    vips: set[str] = set()
    ports, pairs = _queued(plans, hosts, vips)
    udp_ports, udp_pairs = _queued(udp_plans or {}, hosts, vips)
    return rules.Served(ports, pairs, {fe: dict(t) for fe, t in targets.items()},
                        frozenset(vips), udp_ports, udp_pairs)


def ipv6_available() -> bool:
    """Whether this namespace's kernel has IPv6 (not booted with ``ipv6.disable=1``)."""
    return os.path.isdir("/proc/sys/net/ipv6")


def _count(per_port: Mapping[tuple[str, str], int]) -> None:
    """The relay's metrics, per batch: a SYN is a connection decided, a datagram a flow."""
    for (key, what), n in per_port.items():
        if key == _UDP:
            if what == "forward":
                metrics.UDP_FLOWS_CREATED.inc(n)
            else:
                metrics.UDP_DATAGRAMS_DROPPED.labels(
                    "dropped" if what == "drop" else "rejected").inc(n)
            continue
        metrics.CONNECTIONS_ACCEPTED.labels(key).inc(n)
        if what == "snat" or what == "direct":
            metrics.CONNECTIONS_FORWARDED.labels(key, "true" if what == "snat" else "false").inc(n)
        elif what == "drop":
            metrics.CONNECTIONS_DROPPED.labels(key).inc(n)
        else:
            metrics.CONNECTIONS_REJECTED.labels(key).inc(n)


class NfqueueDataplane:
    """The SYN-deciding dataplane: a ``proxier.Backend`` for ``--proxy-mode nfqueue``."""

    mode = "nfqueue"
    FAULT = "nfqueue-rules"
    """The ``ProxyHealth`` fault held while no sync's rules are in force."""

    def __init__(
        self,
        *,
        loop: asyncio.AbstractEventLoop,
        queue: int = rules.DEFAULT_QUEUE,
        bypass: bool = False,
        cluster_cidrs: Iterable[str | ipaddress.IPv4Network | ipaddress.IPv6Network] = (),
        config: rules.QueueConfig | None = None,
        bind_timeout: float = 30.0,
        health: ProxyHealth | None = None,
        batch_wait: float = DEFAULT_BATCH_WAIT,
        successor: bool = False,
        inherited: socket.socket | None = None,
    ) -> None:
        self.loop = loop
        self.batch_wait = batch_wait
        """Seconds the reader lets SYNs gather after a batch of more than one (0: never)."""
        self.cfg = config or rules.QueueConfig(queue=queue, bypass=bypass)
        self.cluster_cidrs = tuple(ipaddress.ip_network(c, strict=False) for c in cluster_cidrs)
        self.local_addresses: frozenset[str] = frozenset()
        """The node's addresses of both families: "from the node itself" for ``decide``."""
        self.families: tuple[int, ...] = rules.FAMILIES if ipv6_available() else (4,)
        """The families whose rules kpx installs: both, unless the kernel has no IPv6."""
        self.synced = asyncio.Event()
        self.prepared = asyncio.Event()
        """Set once the first sync's tables are worked out: all a successor does while its
        predecessor still holds the queue (``successor``)."""
        self._go = asyncio.Event()
        """Clear while a predecessor holds the queue: nothing is bound or written until
        ``proceed``."""
        if not successor:
            self._go.set()
        self._inherited = inherited
        """The queue socket a predecessor passed on (``successor``): adopted, not bound anew."""
        self.generation = -1
        self.generation_in_force = -1
        self._bind_timeout = bind_timeout
        self._health = health
        if health is not None:
            # /healthz answers 200 once the rules of a sync are in force, not when
            # the sync is handed over: a lab or a readiness probe that trusts it
            # must not send a first packet that nothing decides yet.
            health.set_fault(self.FAULT, "nfqueue rules not in force yet")
        self._sock: netlink.QueueSocket | None = None
        self._mechanism: rules.Mechanism | None = None
        self._slots = {f: Slots(self.cfg.layout.max_index) for f in rules.FAMILIES}
        """Each family's own numbering: its nft table has its own DNAT maps."""
        self._installed: set[int] = set()
        """The families whose queueing rules are in (``_install``): the first write, and any
        after a failed one, is theirs."""
        self._written: dict[int, rules.Served | None] = {f: None for f in rules.FAMILIES}
        """What each family's table holds, as kpx last wrote it; None: not known, write it
        whole."""
        self._whole_at = {f: time.monotonic() for f in rules.FAMILIES}
        """When each family's whole table was last written (``install`` counts)."""
        self._tables = Tables()
        self._pending: Tables | None = None
        """The tables being written: what a SYN the current ones have no plan for is
        decided by (see ``_answer``)."""
        self._udp_serving: dict[int, object] = {}
        """What each family's last stale-UDP cleanup was for (``conntrack.serving``):
        another runs only when it changes, which is when a flow can have gone stale."""
        self._ipv6_warned = False
        self._latest: dict[int, _Plans] = dict.fromkeys(rules.FAMILIES, _Plans({}, (), {}))
        """Each family's latest ``apply``: what the next write puts in force."""
        self._node_ips: dict[int, frozenset[str]] = dict.fromkeys(rules.FAMILIES, frozenset())
        self._balancers: dict[tuple[int, int, str], Balancer] = {}
        self._wanted: _Wanted | None = None
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self._accepting = True
        self._warn = RateLimitedLog(log)
        self._counts: dict[tuple[str, str], int] = {}
        """(service port, verdict) -> packets since the last ``flush_metrics``."""
        self._reader: threading.Thread | None = None
        self._worker = OffLoop("nfqueue-sync")
        """The syncs' worker thread (``off_loop``), started at the first sync."""
        self._stop_reading = False
        self._wake_r = self._wake_w = -1
        """The pipe that wakes the reader to stop."""
        self.decided = {"forward": 0, "drop": 0, "reject": 0, "unknown": 0}
        """SYNs answered since start, by verdict (``unknown``: no plan for it)."""

    # -- what the node command asks of a dataplane ----------------------------------

    transparent_active = False
    """The client IP is kept by plain DNAT: no transparent return path is installed."""

    def listening_sockets(self) -> list[tuple[tuple[str, int], socket.socket]]:
        """The queue socket, for a restart's successor (``QUEUE_KEY``, the queue number).

        The socket moves, not the queue: it stays bound, and what the kernel
        queues while the two processes change places waits in it.
        """
        if self._sock is None or not self._accepting:
            return []
        return [((QUEUE_KEY, self.cfg.queue), self._sock.socket)]

    def listeners(self) -> list[tuple[str, int, str]]:
        return []

    def tcp_endpoints(self, family: int) -> frozenset[tuple[str, int]]:
        """Every TCP endpoint ``(address, port)`` of ``family`` the tables in force may
        forward to."""
        return frozenset(ep.addr for plan in self._tables.of(family).plans.values()
                         for eps in (plan.cluster, plan.local) for ep in eps)

    def active_connections(self) -> int:
        return 0  # connections live in conntrack, not here

    def prepare(self, sync: SyncResult) -> None:
        """Nothing ahead of time: the table is rendered when it is written."""

    def apply(self, sync: SyncResult) -> None:
        """Put ``sync`` in force: write the rules for it, then swap the tables (newest wins).

        Either family's result: the proxier hands this one instance the IPv4
        result (as ``dataplane``) and the IPv6 one (as ``dataplane6``), as
        MetaProxier feeds its two proxiers. An IPv4 result also sets the IPv6
        family from its ``ipv6`` (``empty_result`` when None: the node has no
        IPv6, so the IPv6 table serves nothing), so a caller that hands over
        only the IPv4 result serves both; the IPv6 result that follows in the
        same sync is that same object. Both go in together, by one writer.
        """
        if self._closed:
            return
        if sync.family == 6:
            v6, v4 = sync, None
        else:
            v6, v4 = sync.ipv6 or empty_result(sync.generation, 6), sync
        if 6 not in self.families and (v6.plans or v6.udp_plans):
            if not self._ipv6_warned:
                self._ipv6_warned = True
                log.error("nfqueue: the node has IPv6 addresses but this kernel has no IPv6;"
                          " IPv6 services are not served")
            v6 = empty_result(sync.generation, 6)
        if v4 is not None:
            self._latest[4] = _Plans(v4.plans, v4.listen_hosts, v4.udp_plans)
            self._node_ips[4] = frozenset(v4.node_ips)
        self._latest[6] = _Plans(v6.plans, v6.listen_hosts, v6.udp_plans)
        self._node_ips[6] = frozenset(v6.node_ips)
        self.generation = sync.generation
        self.local_addresses = self._node_ips[4] | self._node_ips[6]
        self._wanted = _Wanted(self.generation, self._latest[4], self._latest[6])
        if self._task is None or self._task.done():
            self._task = self.loop.create_task(self._put(), name="nfqueue-rules")

    async def applied(self) -> None:
        """Wait until the rules and table of the latest ``apply`` are in force (tests)."""
        while self._task is not None and not self._task.done():
            await asyncio.shield(self._task)

    def proceed(self) -> None:
        """The predecessor has given the queue back (or is gone): bind it and take over.

        Only for a dataplane made with ``successor=True``; others proceed at once.
        """
        self._go.set()

    async def _put(self) -> None:
        """Work out the tables, bind the queue (first time), write them, swap; again if newer.

        The queue is read only once the first tables are in force. A SYN
        queued before then (by a predecessor's rules, whose slots may name
        other endpoints) waits in the kernel and is decided by the new ones.
        A successor stops after working out its first tables (``prepared``)
        until ``proceed``: its predecessor decides SYNs until then, and holds
        the queue, so the queue is unread only while the tables are written.
        """
        failed = 0  # attempts at the first tables
        while self._wanted is not None and not self._closed:
            wanted = self._wanted
            generation = wanted.generation
            self._wanted = None
            try:
                if self._mechanism is None:
                    self._mechanism = await self.off_loop(rules.choose_mechanism,
                                                           self.cfg.queue)
                # Off the loop, as the rendering below is: at tens of thousands of
                # services this walk takes a good part of a second, which /healthz
                # must not wait out (the plans are immutable; only this task
                # touches the slots).
                pending = Tables(*[await self.off_loop(self._tabulate, *want, fam)
                                   for fam, want in ((4, wanted.v4), (6, wanted.v6))])
                # The first write's look at the tables there, while a predecessor
                # still reads the queue (``_install``).
                objects = (None if self._installed.issuperset(self.families)
                           else await self.off_loop(self._table_objects))
                self.prepared.set()
                await self._go.wait()
                if self._sock is None:
                    await self._bind()
                    if self._sock is None:
                        return  # stopped meanwhile: the queue stays free for a successor
                self._pending = pending
                if objects is not None:
                    await self._install(pending, objects)
                else:
                    for family in self.families:
                        await self._write(pending.of(family).served, self._mechanism, family)
                        self._written[family] = pending.of(family).served
            except (OSError, ValueError, RuntimeError) as exc:
                self._pending = None
                # Unknown now: the next attempt writes the whole tables.
                self._written = dict.fromkeys(rules.FAMILIES)
                # Retried every PUT_RETRY while it fails: rate-limited, per cause.
                self._warn.log(logging.ERROR, ("put", type(exc).__name__),
                               "nfqueue: generation %d not put in force: %s; the last one"
                               " stays", generation, exc)
                if self.generation_in_force < 0:
                    if self._health is not None:
                        self._health.set_fault(self.FAULT, f"no rules in force: {exc}")
                    failed += 1
                    if failed >= UNREAD_ATTEMPTS and self._go.is_set():
                        await self._read_without_tables()
                if self._wanted is None:
                    self._wanted = wanted
                await asyncio.sleep(PUT_RETRY)
                continue
            self._tables, self._pending = pending, None
            self.generation_in_force = generation
            self.synced.set()
            if self._health is not None:
                self._health.clear_fault(self.FAULT)
            v4, v6 = pending.v4.served, pending.v6.served
            log.info("nfqueue rules in force (generation %d): %d ports on every address,"
                     " %d address:port pairs, %d endpoints (IPv6: %d ports, %d pairs,"
                     " %d endpoints)", generation,
                     len(v4.ports) + len(v4.udp_ports), len(v4.pairs) + len(v4.udp_pairs),
                     pending.v4.endpoints, len(v6.ports) + len(v6.udp_ports),
                     len(v6.pairs) + len(v6.udp_pairs), pending.v6.endpoints)
            for family in self.families:
                await self._clean_udp(pending.of(family).udp_plans, family)

    async def _read_without_tables(self) -> None:
        """The first tables cannot be put in force: read the queue anyway, refusing every SYN.

        The queue is this process's (its predecessor passed it on, or is gone),
        and a predecessor's (or a SIGKILLed kpx's) rules go on queueing SYNs to
        it. Unread, each would wait in the kernel until the queue is full,
        then be dropped (or, with ``--queue-bypass``, meet the node
        undecided): every client of every port would time out, with no end in
        sight if the failure is in the input (a port with more endpoints than
        a mark numbers). Read with no tables, each is refused at once, as a
        port with no endpoints is, and ``/healthz`` says 503 meanwhile (the
        fault). Not at the first failure: a write that fails once (nft or the
        xtables lock busy) costs the waiting SYNs a second, not a refusal.
        """
        if self._reader is not None or not self._accepting:
            return
        if self._sock is None:
            try:
                await self._bind()
            except OSError as exc:
                log.error("nfqueue %d: cannot bind the queue: %s", self.cfg.queue, exc)
                return
        if self._start_reading():
            log.error("nfqueue %d: no rules of this process are in force; every SYN queued"
                      " is refused until a sync's are", self.cfg.queue)

    def _start_reading(self) -> bool:
        """Start the reader, unless it runs, the queue is not bound or this one is stopping;
        True if it started."""
        if self._reader is not None or self._sock is None or not self._accepting:
            return False
        self._start_reader(self._sock)
        return True

    def _table_objects(self) -> dict[int, frozenset[tuple[str, str]] | None]:
        return {f: rules.table_objects(self.cfg.table, f) for f in self.families}

    async def _install(self, pending: Tables,
                       objects: Mapping[int, frozenset[tuple[str, str]] | None]) -> None:
        """The first write: every family's whole table in one transaction, then the reader,
        then the queueing rules.

        From the bind (a successor: from taking the queue over) until the
        reader starts, the queue is unread and the SYNs queued meanwhile wait
        in it. So only what their verdicts need comes in between: the tables,
        whose slots the marks name (written in place, which keeps the waiting
        SYNs: ``rules.nft_script``). The queueing rules come after: a
        predecessor's are in place already, and on a fresh start nothing is
        queued before they are. A family whose rules failed is installed
        again, whole, at the next attempt.
        """
        assert self._mechanism is not None
        served = {f: pending.of(f).served for f in self.families}
        await self.off_loop(rules.write_tables, self.cfg, served, self._mechanism, objects)
        now = time.monotonic()
        for family in self.families:
            self._written[family], self._whole_at[family] = served[family], now
        self._tables = pending  # in the kernel now: what the verdicts may name
        self._start_reading()
        for family in self.families:
            await self.off_loop(rules.queue_syns, self.cfg, self._mechanism, family)
            self._installed.add(family)

    async def _write(self, served: rules.Served, mechanism: rules.Mechanism,
                     family: int = 4) -> None:
        """Make ``family``'s table hold ``served``: the change since the last write, else the
        whole table.

        The change is a few elements per endpoint that moved, where the whole
        table is every service's; it is refused as a whole if the table is not
        what kpx last wrote (someone deleted an element, or the table), and
        the whole table then puts it right, as it does once per
        ``FULL_SYNC_PERIOD`` anyway.
        """
        table = self.cfg.table
        if time.monotonic() - self._whole_at[family] >= FULL_SYNC_PERIOD:
            self._written[family] = None  # re-check: whatever was changed by hand goes
        written = self._written[family]
        if written is not None:
            delta = await self.off_loop(rules.update_script, table, written, served,
                                         self.cfg.layout, family)
            if not delta:
                return
            res = await spawn.run(["nft", "-f", "-"], delta)
            if res.returncode == 0:
                return
            log.warning("nfqueue: table %s (IPv%d) is not as kpx left it (%s); writing it"
                        " whole", table, family, res.stderr.strip() or res.returncode)
        await self.off_loop(rules.write_table, self.cfg, served, mechanism, family)
        self._whole_at[family] = time.monotonic()

    async def off_loop(self, fn: Callable[..., _T], *args: object) -> _T:
        """``fn(*args)`` in the sync's worker thread, the loop first for the GIL meanwhile.

        The syncs' blocking calls (``nft``, conntrack, sock_diag) run here, one
        at a time and in order. (When pyroute2 still read conntrack, two threads
        importing it at once met a half-made module: ``ImportError: ...
        partially initialized module``.)
        """
        return await self._worker.call(fn, *args)

    def _tabulate(self, plans: Mapping[PlanKey, PortPlan], hosts: tuple[str, ...],
                  udp_plans: Mapping[PlanKey, PortPlan], family: int = 4) -> Table:
        """Slots for every endpoint of ``family``, and the table that writing them puts in
        force."""
        slots = self._slots[family]
        targets = slots.assign(_endpoints(plans, udp_plans))
        live = frozenset({*((family, TCP, p.key) for p in plans.values()),
                          *((family, UDP, p.key) for p in udp_plans.values())})
        marks = self._marks(plans, udp_plans, slots)
        return Table(plans, served_for(plans, hosts, targets, udp_plans), udp_plans, marks, live,
                     len({ep for fe in marks.values() for ep in fe}))

    def _marks(self, plans: Mapping[PlanKey, PortPlan], udp_plans: Mapping[PlanKey, PortPlan],
               slots: Slots) -> dict[tuple[int, PlanKey], dict[tuple[str, int], tuple[int, int]]]:
        lay = self.cfg.layout
        # Slots are small numbers that every frontend reuses: each one's pair of
        # marks is worked out once, not twice per endpoint of every plan.
        by_slot: dict[int, tuple[int, int]] = {}

        def both(i: int) -> tuple[int, int]:
            pair = by_slot.get(i)
            if pair is None:
                pair = by_slot[i] = (lay.forward(i), lay.forward(i, True))
            return pair

        out: dict[tuple[int, PlanKey], dict[tuple[str, int], tuple[int, int]]] = {}
        for num, name, table in ((TCP, "tcp", plans), (UDP, "udp", udp_plans)):
            for key, plan in table.items():
                out[(num, key)] = {ep: both(i)
                                   for ep, i in slots.index(frontend(plan, name)).items()}
        return out

    async def _clean_udp(self, udp_plans: Mapping[PlanKey, PortPlan], family: int = 4) -> None:
        """Delete the UDP flows of ``family`` conntrack still pins to an endpoint no longer
        served.

        After the table is in force, so a flow deleted here is decided again
        by the new plans. A failure is logged and retried at the next change.
        """
        wanted = conntrack.serving(udp_plans)
        if wanted == self._udp_serving.get(family):
            return
        local = self.local_addresses
        try:
            n = await self.off_loop(conntrack.clean_stale_udp, wanted, local, family)
        except Exception as exc:  # best effort: never the end of the rules task
            log.error("nfqueue: stale UDP conntrack entries (IPv%d) not deleted: %s", family, exc)
            return
        self._udp_serving[family] = wanted
        if n:
            metrics.UDP_FLOWS_REPICKED.inc(n)
            log.info("nfqueue: deleted %d UDP conntrack entr%s pinned to an endpoint no longer"
                     " served; their next datagrams are decided again", n,
                     "y" if n == 1 else "ies")

    async def _bind(self) -> None:
        """Bind the queue; a predecessor may hold it for a moment (a restart): retry.

        The reader starts once the first tables are in force (``_put``).
        """
        inherited, self._inherited = self._inherited, None
        if inherited is not None:
            try:
                self._sock = netlink.QueueSocket(self.cfg.queue, fail_open=self.cfg.bypass,
                                                 adopt=inherited)
            except OSError as exc:
                inherited.close()
                log.warning("nfqueue %d: cannot take the predecessor's socket over: %s;"
                            " binding the queue anew", self.cfg.queue, exc)
            else:
                log.info("nfqueue %d taken over from the predecessor (%s)", self.cfg.queue,
                         "fail-open: --queue-bypass" if self.cfg.bypass else "fail-closed")
                return
        deadline = time.monotonic() + self._bind_timeout
        while self._sock is None:
            if not self._accepting:
                return  # stopped meanwhile: the queue stays free for a successor
            try:
                self._sock = netlink.QueueSocket(self.cfg.queue, fail_open=self.cfg.bypass)
            except OSError as exc:
                if time.monotonic() >= deadline:
                    raise
                self._warn.warning(("bind",), "nfqueue %d: %s; retrying (a kpx being replaced"
                                   " still holds it?)", self.cfg.queue, exc)
                await asyncio.sleep(BIND_RETRY)
        log.info("nfqueue %d bound (%s)", self.cfg.queue,
                 "fail-open: --queue-bypass" if self.cfg.bypass else "fail-closed")

    # -- the hot path: one batch of SYNs, in the reader thread ---------------------------

    def _start_reader(self, sock: netlink.QueueSocket) -> None:
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self._reader = threading.Thread(target=self._read, args=(sock,),
                                        name=f"nfqueue-{self.cfg.queue}", daemon=True)
        self._reader.start()

    def _read(self, sock: netlink.QueueSocket) -> None:
        """The reader thread: answer every batch until woken to stop (that one too), then
        flush the counts.

        Why a thread and not the event loop's reader: the loop also runs the
        syncs and /healthz, and a SYN queued while it is busy waits until it
        is done. The two share the ``Table``, swapped whole (one reference);
        the balancers are this thread's alone. It sleeps in ``poll`` on the
        queue and the wake pipe, with no timeout while no count waits to be
        flushed: an idle node costs nothing.

        Two paces, as a NIC's interrupt moderation: after a wake-up that found
        one SYN, the next one's verdict is sent before anything else is read
        (an idle node's client waits for nothing but its own SYN); after one
        that found several, the node is busy, and SYNs gather for
        ``batch_wait`` between reads (one wake-up and one send for many).
        """
        poller = select.poll()
        poller.register(sock.fileno(), select.POLLIN)
        poller.register(self._wake_r, select.POLLIN)
        flushed = time.monotonic()
        tables = self._fresh(None)
        lone = True
        while True:
            poller.poll(METRICS_FLUSH_INTERVAL * 1000 if self._counts else None)
            # Woken to stop: what has come is still answered (one last batch). A
            # successor that took the socket over reads whatever comes after; one
            # that binds anew sees the queue free as soon as this one closes it.
            last = self._stop_reading
            tables = self._fresh(tables)
            if lone and not last:
                # An idle node's SYN is answered before anything else is asked
                # of the kernel: the read that finds the queue empty (a failed
                # recv, an exception) comes after its verdict, not before.
                got = self._take(sock, tables, 1)
                if got == 1:
                    got += self._take(sock, tables, netlink.MAX_READS) or 0
            else:
                got = self._take(sock, tables, netlink.MAX_READS)
            if last:
                break
            if got is None:
                time.sleep(0.1)  # a read failed (logged): the socket is asked again soon
                continue
            lone = got <= 1
            if not lone and self.batch_wait:
                # Interrupt moderation, as a NIC's adaptive rx-usecs: SYNs that
                # came together mean a busy node, where a wake-up per SYN (two
                # context switches, a poll, a recv that fails) costs more than
                # deciding it. Let the next ones gather. A lone SYN never waits:
                # the one-at-a-time client of an idle node keeps its latency.
                time.sleep(self.batch_wait)
            now = time.monotonic()
            if now - flushed >= METRICS_FLUSH_INTERVAL:
                flushed = now
                self.flush_metrics()
        self.flush_metrics()

    def _fresh(self, tables: Tables | None) -> Tables:
        """The tables in force, and balancers for only their plans once they were swapped."""
        if self._tables is not tables:
            tables = self._tables
            live = tables.v4.live | tables.v6.live
            self._balancers = {k: b for k, b in self._balancers.items() if k in live}
        return tables

    def _take(self, sock: netlink.QueueSocket, tables: Tables, max_reads: int) -> int | None:
        """Read up to ``max_reads`` datagrams and answer every packet in them: how many
        there were, or None when the read failed (logged)."""
        try:
            packets = sock.read_batch(max_reads)
        except OSError as exc:
            if not self._stop_reading:
                self._warn.warning(("read", exc.errno), "nfqueue %d: read failed: %s;"
                                   " retrying", self.cfg.queue, exc)
            return None
        if packets:
            try:
                self._answer(sock, packets, tables)
            except Exception:
                # A bug must not end the thread: every later SYN would wait in
                # the kernel unanswered. This batch's packets are dropped (their
                # clients retransmit) and the next batch is decided afresh.
                self._warn.warning(("answer",), "nfqueue %d: a batch could not be decided;"
                                   " its packets are dropped", self.cfg.queue,
                                   exc_info=True)
                with contextlib.suppress(OSError):
                    sock.send_verdicts([netlink.drop(p.packet_id) for p in packets])
        return len(packets)

    def _answer(self, sock: netlink.QueueSocket, packets: list[netlink.Packet],
                tables: Tables) -> None:
        """Decide ``packets`` by ``tables`` (the ones in force) and send the verdicts at once.

        Each packet by its own family's table: its IP version says which. A
        packet that table has no plan for was queued by the rules of the
        table being written (``_pending``): ``nft`` has committed that
        transaction, or the packet would not have been queued, so its slots
        are in the kernel and its plans decide the packet. Without this, a
        new port's first SYNs were refused in the moment between the commit
        and the swap.
        """
        lay = self.cfg.layout
        keep = ~lay.mask & 0xFFFFFFFF  # the packet's own bits, kept by every verdict
        local, cidrs = self.local_addresses, self.cluster_cidrs
        now = time.monotonic()
        verdicts: list[Verdict] = []
        counts, per_port, balancers = self.decided, self._counts, self._balancers
        # Names bound once per batch: each lookup skipped is a few cold cache lines.
        flow, append = netlink.flow, verdicts.append
        for packet_id, packet_mark, payload, _hook in packets:
            try:
                src, dst, proto, sport, dport, family = flow(payload)
            except ValueError:
                append(netlink.drop(packet_id))
                counts["unknown"] += 1
                continue
            by = tables.v6 if family == 6 else tables.v4
            plan = by.plan(proto, dst, dport)
            if plan is None:
                # The tables being written; or, once ``_put`` has swapped them in (it sets
                # ``_tables`` before it clears ``_pending``), the tables in force now.
                later = self._pending
                if later is None:
                    later = self._tables
                if later is not tables:
                    by = later.v6 if family == 6 else later.v4
                    plan = by.plan(proto, dst, dport)
            if plan is None:
                # Served by neither table (the port went since it was queued).
                append(netlink.accept(packet_id, lay.verdict_mark(packet_mark, lay.reject)))
                counts["unknown"] += 1
                continue
            bkey = (family, proto, plan.key)
            balancer = balancers.get(bkey)
            if balancer is None:
                balancer = balancers[bkey] = Balancer()
            udp = proto == UDP
            d = decide(plan, src, local, balancer, now, (), cidrs)
            if type(d) is Forward:
                both = by.marks.get((proto, plan.table_key), _NONE).get(d.endpoint.addr)
                if both is not None:
                    mark = both[1] if d.snat else both[0]
                    append(_new(Verdict, (packet_id, NF_ACCEPT, (packet_mark & keep) | mark)))
                    counts["forward"] += 1
                    k = (_UDP, "forward") if udp else (plan.key, "snat" if d.snat else "direct")
                    per_port[k] = per_port.get(k, 0) + 1
                    continue
                d = Drop(f"{d.endpoint} has no target index yet")
            if isinstance(d, Drop):
                append(netlink.drop(packet_id))
                counts["drop"] += 1
                k = (_UDP if udp else plan.key, "drop")
            else:
                append(netlink.accept(packet_id, lay.verdict_mark(packet_mark, lay.reject)))
                counts["reject"] += 1
                k = (_UDP if udp else plan.key, "reject")
            per_port[k] = per_port.get(k, 0) + 1
            if log.isEnabledFor(logging.DEBUG):
                log.debug("%s:%d -> %s:%d: %s", src, sport, dst, dport, d.reason)
        sock.send_verdicts(verdicts)

    def flush_metrics(self) -> None:
        """Add the counts since the last flush to Prometheus (the reader does it every second).

        Not per batch: the SYNs of a busy node mostly come one per wake-up, and
        two labelled ``inc`` calls cost more than deciding the SYN did. Called
        by the reader thread, or once it has stopped.
        """
        counts, self._counts = self._counts, {}
        _count(counts)

    # -- stopping -------------------------------------------------------------------------

    async def stop_accepting(self) -> None:
        """Stop deciding, and close this process's copy of the queue socket.

        A successor that took the socket over (``listening_sockets``) holds the
        queue from here on; else the queue is free for one to bind. Established
        flows are conntrack's either way.
        """
        self._accepting = False
        await asyncio.to_thread(self._stop_reader)

    def _stop_reader(self) -> None:
        """Wake the reader to stop and wait for it, then close the queue. Idempotent.

        The socket is closed only once the thread is out of ``poll`` and
        ``recv``: an fd closed under a thread that waits on it leaves it
        waiting, and a reused fd number could be read by it.
        """
        self._stop_reading = True
        reader, self._reader = self._reader, None  # one caller joins and closes
        if reader is not None:
            os.write(self._wake_w, b"\0")
            reader.join()
            for fd in (self._wake_r, self._wake_w):
                os.close(fd)
        else:
            self.flush_metrics()
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if self._inherited is not None:
            self._inherited.close()
            self._inherited = None

    async def drain(self, grace: float) -> int:
        return 0  # nothing to drain here: the kernel forwards every established flow

    def close(self) -> None:
        """Stop, and remove the rules when no other kpx is left in the namespace."""
        if self._closed:
            return
        self._closed = True
        if self._task is not None:
            self._task.cancel()
        self._worker.close()
        self._stop_reader()
        if live_pids() - {os.getpid()}:
            log.info("nfqueue: another kpx is present; its rules stay")
            return
        try:
            removed = rules.remove(self.cfg, self.families)
        except (OSError, RuntimeError) as exc:
            log.error("nfqueue: could not remove the rules: %s", exc)
            return
        log.info("nfqueue: rules removed (%d iptables/ip6tables rule(s))", removed)
