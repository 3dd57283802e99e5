"""The netfilter side of ``--proxy-mode nfqueue``: which SYNs are queued, what a mark does.

Owns: in the namespace kpx runs in, the nft tables ``ip kpx_nfq`` (IPv4)
and ``ip6 kpx_nfq`` (IPv6) and, on a kernel without nft's ``queue``
expression, two iptables and two ip6tables rules (mangle PREROUTING and
OUTPUT, comment ``kpx-nfqueue``); and, once a kpx in userspace mode has
taken their place, each family's NAT keeper ``kpx_nfq_keep`` (``keep_nat``),
until the connections they DNATed have closed. Pure functions render them
(``nft_script``, ``iptables_rules``, ``keep_script``) and say what a mark
means (``MarkLayout``); ``install``, ``remove``, ``keep_nat`` and
``nft_queue_supported`` run ``nft``/``iptables``/``ip6tables`` with
``subprocess`` (blocking: start and exit only).

Each family is its own table, as kube-proxy's ``ip kube-proxy`` and ``ip6
kube-proxy`` are: the same chains over ``ip6 daddr``, ``ipv6_addr`` sets
and maps, ``dnat ip6 to``, and ICMPv6 for a refused UDP flow. Both queue to
the one queue number, which one socket reads (``netlink.QueueSocket``).
IPv6 never queues a NodePort SYN to ``::1`` (``ip6 daddr ::1 return``):
iptables mode has no IPv6 localhost NodePorts, there being no
``route_localnet`` to let a DNATed ``::1`` packet leave the node.

Never: touch another namespace, or a rule or table that is not kpx's (the
table is kpx's by name; an iptables rule by its comment); decide anything
(the caller answers each queued SYN: ``proxy.nfqueue.netlink``).

How a connection goes (xt path; the nft path queues from the marking rule
itself and has no iptables rule):

1. prerouting (output, for the node's own clients), priority mangle - 1:
   ``mark_*`` sets the ``queued`` bit on a SYN (``tcp flags & (fin | syn |
   rst | ack) == syn``) to a served port: ``tcp dport @ports`` on any local
   address (NodePorts), or ``ip daddr . tcp dport @pairs`` (a port on one
   address); and on a UDP datagram that starts a flow (``ct state new``)
   to ``@udp_ports`` or ``@udp_pairs``. Every other packet costs one or two
   compares;
2. priority mangle: the iptables rule ``-m mark --mark Q/Q -j NFQUEUE``
   queues it; Python answers NF_DROP, or NF_ACCEPT with a mark;
3. priority mangle + 1: ``reject_*`` answers the REJECT mark with a TCP
   reset (the client sees ECONNREFUSED at once), or for UDP with ICMP port
   unreachable;
4. priority dstnat: ``dnat_*`` DNATs to ``vip_targets[mark & target, daddr,
   protocol, dport]``, or failing that ``np_targets[mark & target, protocol,
   dport]``: the mark carries an endpoint's slot within its frontend;
5. postrouting, srcnat: ``snat_postrouting`` masquerades when the mark
   has the masquerade bit.

Conntrack then carries every later packet of the connection, in the kernel,
through the NAT that step 4 (and 5) bound: nothing else is queued. A SYN
retransmitted after its connection was DNATed is not queued again
(``ct status dnat``); one whose first copy was dropped is (its conntrack
entry was never confirmed), and gets a fresh decision. A UDP flow is
pinned the same way until conntrack forgets it (``nf_conntrack_udp_timeout``
and ``_stream``), or until kpx deletes its entry because the endpoint went
(``proxy.nfqueue.conntrack.stale_udp``).

Why a set and one constant rule, not a rule per port (``-m multiport
--dports``, 15 ports a rule): nft looks a SYN up in a hash set once however
many ports are served, and a sync changes set elements in one atomic
transaction; iptables rules are walked one by one for *every* packet that
reaches the chain (3,000 NodePorts: 200 rules), and each change rewrites
the chain. The iptables rule exists only because this kernel lacks nft's
``queue`` (``CONFIG_NFT_QUEUE``): ``-j NFQUEUE`` reaches the kernel as an xt
target through ``nft_compat``. So it matches one mark bit and never changes
as ports come and go. (``nft list`` shows that rule as ``queue num N``,
translated back by libxtables: it is still the xt target.)

Fail-closed by default: with no socket bound to the queue (kpx is dead or
restarting), the kernel drops the queued SYNs and clients retransmit, as a
full queue does. ``QueueConfig.bypass`` (``--queue-bypass``, nft ``bypass``)
accepts them instead, but an accepted SYN without a verdict's mark is not
DNATed: it is delivered to the node itself, where nothing listens on a
NodePort (a reset) or, worse, something else on that port answers. A SYN
dropped now is a connection made a second later; a SYN let through is a
refused or misrouted one.
"""

from __future__ import annotations

import json
import logging
import shlex
import socket
import subprocess
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

from proxy.util.nfttable import NftTable
from proxy.util.nfttable import elements as _elements

log = logging.getLogger(__name__)

NFT_TABLE = "kpx_nfq"
KEEP_TABLE = "kpx_nfq_keep"
"""The table that keeps NAT on for the connections an nfqueue-mode kpx DNATed, once a kpx in
userspace mode has removed that kpx's rules (``keep_nat``)."""
DEFAULT_QUEUE = 7078
"""kpx's number (as ``proxy.userspace.transparent.DEFAULT_TABLE``); 0-65535."""
COMMENT = "kpx-nfqueue"
"""What makes an iptables rule kpx's: ``remove`` deletes exactly the rules carrying it."""

Mechanism = Literal["nft", "xt"]
"""How served SYNs reach the queue: nft's ``queue`` expression, or iptables' xt ``NFQUEUE``."""

_TIMEOUT = 10.0
_MAX_DELETES = 16
"""``iptables -D`` attempts per rule at removal: more copies than this is not kpx's doing."""

_KUBE_PROXY_BITS = 0xC000
"""kube-proxy's masquerade (0x4000) and drop (0x8000) marks."""
_USERSPACE_BIT = 0x2000
"""kpx's userspace mode's return-path bit (``proxy.userspace.transparent.DEFAULT_MARK``)."""


@dataclass(frozen=True, slots=True)
class MarkLayout:
    """The bits of the packet mark that mode nfqueue uses; ``mask`` is all of them.

    Default (``mask`` 0xffff1000)::

        0x0000_1000  queued      set on a served SYN before queueing; kept by
                                 every verdict, so each rule below acts only on
                                 a packet kpx decided (never on someone else's
                                 bits that happen to look like a target)
        0x7fff_0000  target      an endpoint's slot within its frontend, the
                                 DNAT maps' key with it (1-32766 endpoints
                                 per service port), or all ones: REJECT
        0x8000_0000  masquerade  SNAT to the outgoing interface's address

    Outside: kube-proxy's 0x4000/0x8000, the userspace mode's 0x2000,
    Cilium's 0x0f00 and Istio's 0x539. The mark only lives on the SYN
    while it crosses the node (the verdict sets it, conntrack keeps the NAT,
    a veth to a pod clears it), so the high half, which Calico (0xffff0000
    by default), kube-router and Tailscale also use, is shared only with
    what looks at that one packet; on such a node move ``target`` and
    ``masquerade`` elsewhere. The kernel's verdict *replaces* the mark, so
    ``verdict_mark`` keeps every bit outside ``mask`` as the packet had it.
    """

    queued: int = 0x0000_1000
    target: int = 0x7FFF_0000
    masquerade: int = 0x8000_0000

    def __post_init__(self) -> None:
        bits = (self.queued, self.target, self.masquerade)
        if any(b <= 0 or b > 0xFFFFFFFF for b in bits):
            raise ValueError("mark bits must be non-zero 32-bit values")
        if (self.queued & self.target or self.queued & self.masquerade
                or self.target & self.masquerade):
            raise ValueError("mark layout: queued, target and masquerade overlap")
        if self.queued & (self.queued - 1) or self.masquerade & (self.masquerade - 1):
            raise ValueError("mark layout: queued and masquerade must be one bit each")
        low = self.target & -self.target
        if (self.target + low) & self.target:
            raise ValueError(f"mark layout: target {self.target:#x} is not contiguous")
        if self.target >> self.shift < 3:
            raise ValueError(f"mark layout: target {self.target:#x} holds no index")
        if self.mask & (_KUBE_PROXY_BITS | _USERSPACE_BIT):
            raise ValueError(f"mark layout {self.mask:#x} takes kube-proxy's 0xc000 or kpx"
                             f" userspace's 0x2000")

    @property
    def mask(self) -> int:
        return self.queued | self.target | self.masquerade

    @property
    def shift(self) -> int:
        return (self.target & -self.target).bit_length() - 1

    @property
    def max_index(self) -> int:
        """The highest target index (all ones is REJECT; 0 is no target)."""
        return (self.target >> self.shift) - 1

    @property
    def reject(self) -> int:
        """The mark of a REJECT verdict."""
        return self.target | self.queued

    def key(self, index: int) -> int:
        """Target ``index`` as the ``targets`` map's key: the mark's target bits."""
        if not 1 <= index <= self.max_index:
            raise ValueError(f"target index {index}: 1-{self.max_index}")
        return index << self.shift

    def forward(self, index: int, masquerade: bool = False) -> int:
        """The mark of a FORWARD verdict to target ``index`` (with SNAT if ``masquerade``)."""
        return self.key(index) | self.queued | (self.masquerade if masquerade else 0)

    def verdict_mark(self, packet_mark: int, decided: int) -> int:
        """The whole mark to send: the packet's own bits outside ``mask``, then ours."""
        return (packet_mark & ~self.mask & 0xFFFFFFFF) | decided


Endpoint = tuple[str, int]
Frontend = tuple[str | None, str, int]
"""Where a service port is reached: (VIP, or None for a NodePort on any served address;
``"tcp"`` or ``"udp"``; port). The DNAT maps are keyed by slot and frontend."""


@dataclass(frozen=True, slots=True)
class Served:
    """What the table serves (plain data; the caller's sync builds it).

    ``ports``: TCP ports queued on every local address (NodePorts).
    ``pairs``: ``(address, port)`` queued on that address only (a VIP, an
    externalIP, ``--nodeport-addresses``). ``udp_ports`` and ``udp_pairs``:
    the same for UDP, whose first datagram of a new flow is queued.
    ``targets``: frontend -> slot -> endpoint ``(ip, port)``: a FORWARD mark
    carries the slot, the packet names the frontend (its destination address
    for a VIP, its protocol and port), and the pair is the DNAT maps' key.
    A slot the caller retires must stay in the map until no packet can still
    carry it (the next sync after its last verdict): a missing key means no
    DNAT.
    """

    ports: frozenset[int] = frozenset()
    pairs: frozenset[Endpoint] = frozenset()
    targets: Mapping[Frontend, Mapping[int, Endpoint]] = field(default_factory=dict)
    vips: frozenset[str] = frozenset()
    """Service VIPs: a SYN to one of them at a port not in ``pairs`` (undeclared, or no
    endpoint) is answered with a reset, and a new UDP flow not in ``udp_pairs`` with
    ICMP port unreachable, as nftables mode rejects "traffic to invalid ports on active
    cluster IPs"; without this it would be routed on, the VIP not being a local address
    in this mode."""
    udp_ports: frozenset[int] = frozenset()
    udp_pairs: frozenset[Endpoint] = frozenset()


@dataclass(frozen=True, slots=True)
class QueueConfig:
    """Where served SYNs go and how: queue number, fail-open or not, marks, names."""

    queue: int = DEFAULT_QUEUE
    bypass: bool = False
    """Fail-open (``--queue-bypass``): with no socket on the queue, accept instead of drop."""
    layout: MarkLayout = field(default_factory=MarkLayout)
    table: str = NFT_TABLE
    comment: str = COMMENT

    def __post_init__(self) -> None:
        if not 0 <= self.queue <= 0xFFFF:
            raise ValueError(f"queue number {self.queue}: 0-65535")


# -- rendering (pure) ---------------------------------------------------------------------

def _port(p: int) -> str:
    if isinstance(p, bool) or not isinstance(p, int) or not 1 <= p <= 0xFFFF:
        raise ValueError(f"port {p!r}: 1-65535")
    return str(p)


Family = Literal[4, 6]
FAMILIES: tuple[Family, ...] = (4, 6)


@dataclass(frozen=True, slots=True)
class _Nft:
    """What differs between the two families' tables: names and address types."""

    family: str
    """nft's table family: ``ip`` or ``ip6``."""
    addr: str
    """nft's address type: ``ipv4_addr`` or ``ipv6_addr``."""
    daddr: str
    """The destination address expression: ``ip daddr`` or ``ip6 daddr``."""
    unreachable: str
    """How a refused UDP flow is answered."""
    af: int
    name: str


_NFT: dict[int, _Nft] = {
    4: _Nft("ip", "ipv4_addr", "ip daddr", "icmp type port-unreachable", socket.AF_INET, "IPv4"),
    6: _Nft("ip6", "ipv6_addr", "ip6 daddr", "icmpv6 type port-unreachable", socket.AF_INET6,
            "IPv6"),
}


def _nft_family(family: int) -> _Nft:
    try:
        return _NFT[family]
    except KeyError:
        raise ValueError(f"IP family {family!r}: 4 or 6") from None


def _address(a: str, family: int = 4) -> str:
    """``a`` in its canonical text for ``family``; ValueError naming it otherwise."""
    f = _nft_family(family)
    try:
        return socket.inet_ntop(f.af, socket.inet_pton(f.af, a))
    except (OSError, TypeError):
        raise ValueError(f"{a!r}: not an {f.name} address") from None


def _ipv4(a: str) -> str:
    return _address(a, 4)


def queue_statement(cfg: QueueConfig) -> str:
    """nft's own ``queue`` statement for ``cfg`` (the nft path)."""
    return f"queue num {cfg.queue}{' bypass' if cfg.bypass else ''}"


SETS = ("ports", "pairs", "udp_ports", "udp_pairs", "vips")
MAPS = ("np_targets", "vip_targets")


class Elements(NamedTuple):
    """``served`` as the full script writes it: each set's elements, each map's key -> value."""

    sets: dict[str, frozenset[str]]
    maps: dict[str, dict[str, str]]


def _pair(a: str, p: int, family: int = 4) -> str:
    return f"{_address(a, family)} . {_port(p)}"


def _sets(served: Served) -> dict[str, frozenset[int] | frozenset[Endpoint] | frozenset[str]]:
    return {"ports": served.ports, "pairs": served.pairs, "udp_ports": served.udp_ports,
            "udp_pairs": served.udp_pairs, "vips": served.vips}


def _set_element(name: str, item: int | Endpoint | str, family: int = 4) -> str:
    if name in ("ports", "udp_ports"):
        return _port(item)  # type: ignore[arg-type]
    if name == "vips":
        return _address(item, family)  # type: ignore[arg-type]
    a, p = item  # type: ignore[misc]
    return _pair(a, p, family)


def _target_key(fe: Frontend, slot: int, layout: MarkLayout, family: int = 4
                ) -> tuple[str, str]:
    """``(map name, key text)`` of ``slot`` at frontend ``fe``."""
    vip, proto, port = fe
    if proto not in ("tcp", "udp"):
        raise ValueError(f"frontend protocol {proto!r}: tcp or udp")
    if vip is None:
        return "np_targets", f"{layout.key(slot):#010x} . {proto} . {_port(port)}"
    return ("vip_targets",
            f"{layout.key(slot):#010x} . {_address(vip, family)} . {proto} . {_port(port)}")


def elements(served: Served, layout: MarkLayout, family: int = 4) -> Elements:
    """Render ``served``'s elements (pure); ValueError for a bad port, address (of another
    family, too), slot or protocol."""
    sets = {name: frozenset(_set_element(name, x, family) for x in items)
            for name, items in _sets(served).items()}
    maps: dict[str, dict[str, str]] = {"np_targets": {}, "vip_targets": {}}
    for fe, slots in served.targets.items():
        for i, (a, p) in slots.items():
            name, key = _target_key(fe, i, layout, family)
            maps[name][key] = _pair(a, p, family)
    return Elements(sets, maps)


def update_script(table: str, old: Served, new: Served, layout: MarkLayout,
                  family: int = 4) -> str:
    """The one transaction that turns table ``table`` from ``old`` into ``new``; "" if equal.

    Deletions first: a map key whose endpoint changed is deleted and added
    again. Atomic like the full script, and as long as the change rather
    than the table: at 30,000 services a changed endpoint is a few elements
    where the whole table is hundreds of thousands, and only those are
    rendered (a frontend whose slots are unchanged is one dict comparison).
    It fails as a whole (nothing changes) if the table is not what ``old``
    says, e.g. an element to delete is missing; the caller then writes the
    whole table.
    """
    dels: dict[str, list[str]] = {}
    adds: dict[str, list[str]] = {}
    olds, news = _sets(old), _sets(new)
    for name in SETS:
        o, n = olds[name], news[name]
        if o == n:
            continue
        gone = [_set_element(name, x, family) for x in o - n]  # type: ignore[operator]
        came = [_set_element(name, x, family) for x in n - o]  # type: ignore[operator]
        if gone:
            dels[name] = gone
        if came:
            adds[name] = came
    for fe in old.targets.keys() | new.targets.keys():
        o_slots, n_slots = old.targets.get(fe, {}), new.targets.get(fe, {})
        if o_slots == n_slots:
            continue
        for i, ep in o_slots.items():
            if n_slots.get(i) != ep:
                name, key = _target_key(fe, i, layout, family)
                dels.setdefault(name, []).append(key)
        for i, ep in n_slots.items():
            if o_slots.get(i) != ep:
                name, key = _target_key(fe, i, layout, family)
                adds.setdefault(name, []).append(f"{key} : {_pair(*ep, family)}")
    # Unsorted: nft takes elements in any order, and sorting the hundreds of
    # thousands of a big change is a C call that holds the GIL throughout,
    # while the queue's reader waits with a SYN to decide.
    fam = _nft_family(family).family
    out = [f"delete element {fam} {table} {name} {{ {', '.join(items)} }}\n"
           for name, items in dels.items()]
    out += [f"add element {fam} {table} {name} {{ {', '.join(items)} }}\n"
            for name, items in adds.items()]
    return "".join(out)


CHAINS = ("mark_prerouting", "mark_output", "reject_prerouting", "reject_output",
          "dnat_prerouting", "dnat_output", "snat_postrouting")
OBJECTS = frozenset({*(("set", n) for n in SETS), *(("map", n) for n in MAPS),
                     *(("chain", n) for n in CHAINS)})
"""What kpx's table holds: its sets, maps and chains (``table_objects`` reads them back)."""


def nft_script(cfg: QueueConfig, served: Served, mechanism: Mechanism = "xt",
               family: int = 4, in_place: bool = False) -> str:
    """The nft transaction that makes ``family``'s table ``cfg.table`` exactly this, atomically.

    Declaring then deleting the table first makes a leftover (a killed kpx,
    an older set) vanish in the same transaction that writes the new one:
    no moment without rules, and never two copies. ValueError for a bad
    port, address or slot, before anything runs.

    ``in_place``, for a table that holds kpx's ``OBJECTS`` and nothing else:
    declare each one, flush it and fill it again instead, to the same end.
    No base chain goes, and that matters to the queue: when a netfilter hook
    is unregistered, the kernel drops every packet waiting in any queue of
    the namespace (``nf_queue_nf_hook_drop``). A replacement would drop the
    SYNs queued while it is written, such as those a restart's successor
    holds until its first table is in; and now and then a SYN to a nat
    chain replaced whole slips between the two tables (``proxy.util.nfttable``).
    """
    lay = cfg.layout
    f = _nft_family(family)
    el = elements(served, lay, family)
    ports, pairs, udp_ports, udp_pairs, vips = (_elements(sorted(el.sets[n])) for n in SETS)
    np_targets, vip_targets = (_elements(f"{k} : {v}" for k, v in sorted(el.maps[n].items()))
                               for n in MAPS)
    q = lay.queued
    then = f" {queue_statement(cfg)}" if mechanism == "nft" else " return"
    mark = f"meta mark set meta mark | {q:#x}"

    def marking(hook: str) -> str:
        # A queued bit someone else set (SO_MARK, a MARK or CONNMARK rule) is
        # cleared first, from every packet: the xt rule queues on that bit
        # alone, and a segment that is not a bare SYN must never reach the
        # reader, which would decide it as a new connection. Then most packets
        # leave at the second or third line: a TCP segment that is not a bare
        # SYN, a datagram of a flow conntrack already knows.
        stay = then if mechanism == "nft" else ""
        # IPv6 localhost is never a NodePort (see the module's docstring).
        loopback = "    ip6 daddr ::1 return\n" if family == 6 else ""
        return (
            f"    meta mark & {q:#x} == {q:#x} meta mark set meta mark & {~q & 0xFFFFFFFF:#x}\n"
            f"    tcp flags & (fin | syn | rst | ack) != syn return\n"
            f"    meta l4proto udp ct state != new return\n"
            f"    ct status dnat return\n"
            f"{loopback}"
            f"    tcp dport @ports fib daddr type local {mark}{then}\n"
            f"    {f.daddr} . tcp dport @pairs {mark}{stay}\n"
            f"    udp dport @udp_ports fib daddr type local {mark}{then}\n"
            f"    {f.daddr} . udp dport @udp_pairs {mark}{stay}\n"
            f"    meta mark & {q:#x} != {q:#x} {f.daddr} @vips meta l4proto tcp"
            f" reject with tcp reset\n"
            f"    meta mark & {q:#x} != {q:#x} {f.daddr} @vips meta l4proto udp"
            f" reject with {f.unreachable}\n"
        )

    reject = (
        f"    meta mark & {lay.reject:#x} == {lay.reject:#x} meta l4proto tcp"
        f" reject with tcp reset\n"
        f"    meta mark & {lay.reject:#x} == {lay.reject:#x} meta l4proto udp"
        f" reject with {f.unreachable}\n"
    )
    dnat = (
        f"    meta mark & {q:#x} == {q:#x} meta l4proto {{ tcp, udp }}"
        f" dnat {f.family} to meta mark & {lay.target:#x} . {f.daddr} . meta l4proto"
        f" . th dport map @vip_targets\n"
        f"    meta mark & {q:#x} == {q:#x} meta l4proto {{ tcp, udp }}"
        f" dnat {f.family} to meta mark & {lay.target:#x} . meta l4proto . th dport"
        f" map @np_targets\n"
    )
    masq = lay.masquerade | q
    a, fam = f.addr, f.family
    # (kind, name, declaration, contents): sets and maps on one line, chains on several.
    # nft 1.0.6 takes the name ``dstnat`` in prerouting only: -100 is the same.
    objects = [
        ("set", "ports", "type inet_service;", ports),
        ("set", "pairs", f"type {a} . inet_service;", pairs),
        ("set", "udp_ports", "type inet_service;", udp_ports),
        ("set", "udp_pairs", f"type {a} . inet_service;", udp_pairs),
        ("set", "vips", f"type {a};", vips),
        ("map", "np_targets", f"type mark . inet_proto . inet_service : {a} . inet_service;",
         np_targets),
        ("map", "vip_targets",
         f"type mark . {a} . inet_proto . inet_service : {a} . inet_service;", vip_targets),
        *(("chain", f"mark_{hook}",
           f"type filter hook {hook} priority mangle - 1; policy accept;", marking(hook))
          for hook in ("prerouting", "output")),
        *(("chain", f"reject_{hook}",
           f"type filter hook {hook} priority mangle + 1; policy accept;", reject)
          for hook in ("prerouting", "output")),
        *(("chain", f"dnat_{hook}", f"type nat hook {hook} priority -100; policy accept;", dnat)
          for hook in ("prerouting", "output")),
        ("chain", "snat_postrouting", "type nat hook postrouting priority 100; policy accept;",
         f"    meta mark & {masq:#x} == {masq:#x} masquerade\n"),
    ]

    table = NftTable.render(fam, cfg.table, objects)
    return table.in_place() if in_place else table.anew()


def write_table(cfg: QueueConfig, served: Served, mechanism: Mechanism, family: int = 4) -> None:
    """Write ``family``'s whole table: in place when it holds just kpx's objects, else anew.

    In place keeps the hooks, and so the packets queued meanwhile
    (``nft_script``). A table in place that nft refuses all the same (a set
    of another type, say) is replaced. RuntimeError if that fails too;
    ValueError for bad input, before anything runs.
    """
    what = f"table {_nft_family(family).family} {cfg.table}"
    if table_objects(cfg.table, family) == OBJECTS:
        script = nft_script(cfg, served, mechanism, family, in_place=True)
        res = _run(["nft", "-f", "-"], script)
        if res.returncode == 0:
            return
        log.warning("nfqueue: %s could not be written in place (%s); replacing it", what,
                    res.stderr.strip() or res.returncode)
    _nft(nft_script(cfg, served, mechanism, family), what)


def write_tables(cfg: QueueConfig, served: Mapping[int, Served], mechanism: Mechanism,
                 objects: Mapping[int, frozenset[tuple[str, str]] | None]) -> None:
    """Write each family's whole table (``served``: family -> what it serves) in one ``nft``
    transaction, each in place when ``objects`` (``table_objects``, listed beforehand)
    says it holds just kpx's objects.

    For a restart's successor: between taking the queue over and reading it,
    the queue is unread, and one ``nft`` run for both families is half of
    two (most of a run is ``nft`` starting and reading the ruleset). The
    listing comes before, while the predecessor still reads the queue: it
    changes elements, never objects. If the transaction is refused (a table
    changed meanwhile), each family is written on its own, as
    ``write_table`` does. RuntimeError if that fails too; ValueError for bad
    input, before anything runs.

    A NAT keeper a relay left (``keep_nat``) goes in the same transaction:
    these tables' nat chains keep NAT on for the connections it waited out.
    Only the first write does this, before any SYN of this process is
    queued (deleting a hook drops whatever waits in the queue).
    """
    script = "".join(nft_script(cfg, served[f], mechanism, f, in_place=objects.get(f) == OBJECTS)
                     + remove_script(KEEP_TABLE, f) for f in served)
    res = _run(["nft", "-f", "-"], script)
    if res.returncode == 0:
        return
    log.warning("nfqueue: tables %s not written in one transaction (%s); writing each on its"
                " own", cfg.table, res.stderr.strip() or res.returncode)
    for family, each in served.items():
        write_table(cfg, each, mechanism, family)
        _nft(remove_script(KEEP_TABLE, family), f"delete table {_nft_family(family).family}"
                                                f" {KEEP_TABLE}")


def table_objects(table: str = NFT_TABLE, family: int = 4) -> frozenset[tuple[str, str]] | None:
    """The ``(kind, name)`` of every set, map and chain of ``family``'s table now; None if
    there is no such table (or nft cannot say). ``nft -t`` leaves the elements out."""
    res = _run(["nft", "-j", "-t", "list", "table", _nft_family(family).family, table])
    if res.returncode != 0:
        return None
    try:
        listed = json.loads(res.stdout)["nftables"]
        return frozenset((kind, obj[kind]["name"]) for obj in listed for kind in obj
                         if kind in ("set", "map", "chain"))
    except (ValueError, KeyError, TypeError):
        return None


def remove_script(table: str = NFT_TABLE, family: int = 4) -> str:
    """Delete ``family``'s table if it is there: declaring it first makes the delete never fail."""
    fam = _nft_family(family).family
    return f"table {fam} {table}\ndelete table {fam} {table}\n"


def probe_script(queue: int) -> str:
    """A scratch table with one ``queue`` rule, for ``nft -c``: the kernel checks, nothing stays."""
    return (f"table ip kpx_nfq_probe {{\n  chain probe {{\n    queue num {queue}\n  }}\n}}\n"
            f"delete table ip kpx_nfq_probe\n")


def iptables_rules(cfg: QueueConfig) -> list[list[str]]:
    """The xt rules (mangle table), each as ``iptables-save`` prints it after ``-A``.

    One per hook, whatever is served: they match the ``queued`` bit only.
    Appended (``-A``), not inserted: a queued SYN skips the rest of the
    chain it was queued from, so kpx's rule comes after everyone else's.
    """
    q = cfg.layout.queued
    tail = ["-m", "mark", "--mark", f"{q:#x}/{q:#x}", "-m", "comment", "--comment", cfg.comment,
            "-j", "NFQUEUE", "--queue-num", str(cfg.queue)]
    if cfg.bypass:
        tail.append("--queue-bypass")
    return [[chain, *tail] for chain in ("PREROUTING", "OUTPUT")]


def iptables_argv(op: str, rule: list[str], family: int = 4) -> list[str]:
    """``iptables -t mangle <op> <rule>`` (``ip6tables`` for IPv6); ``op`` is ``-A``, ``-C``
    or ``-D``."""
    return [_IPTABLES[family], "-w", "5", "-t", "mangle", op, *rule]


_IPTABLES = {4: "iptables", 6: "ip6tables"}


def save_argv(family: int = 4) -> list[str]:
    """``iptables-save -t mangle`` (``ip6tables-save``): where kpx's rules are listed."""
    return [f"{_IPTABLES[family]}-save", "-t", "mangle"]


def kpx_rules(save: str, comment: str = COMMENT) -> list[list[str]]:
    """kpx's rules in ``iptables-save -t mangle`` output, as ``[chain, *args]`` lists."""
    out: list[list[str]] = []
    for line in save.splitlines():
        if not line.startswith("-A "):
            continue
        argv = shlex.split(line)
        for i in range(len(argv) - 1):
            if argv[i] == "--comment" and argv[i + 1] == comment:
                out.append(argv[1:])
                break
    return out


# -- applying (subprocess, blocking) ---------------------------------------------------

def _run(argv: list[str], stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, input=stdin, capture_output=True, text=True,
                          timeout=_TIMEOUT, check=False)


def _nft(script: str, what: str) -> None:
    res = _run(["nft", "-f", "-"], script)
    if res.returncode != 0:
        raise RuntimeError(f"nft -f ({what}): {res.stderr.strip() or res.returncode}")


def nft_queue_supported(queue: int = DEFAULT_QUEUE) -> bool:
    """Does this kernel have nft's ``queue`` expression? Asked with ``nft -c``: nothing is added.

    The kernel itself validates a checked transaction, so a missing
    ``nft_queue`` answers ENOENT ("No such file or directory") here too.
    RuntimeError for any other failure (no nft, no CAP_NET_ADMIN).
    """
    res = _run(["nft", "-c", "-f", "-"], probe_script(queue))
    if res.returncode == 0:
        return True
    if "No such file or directory" in res.stderr:
        return False
    raise RuntimeError(f"nft -c (queue probe): {res.stderr.strip() or res.returncode}")


def choose_mechanism(queue: int = DEFAULT_QUEUE) -> Mechanism:
    """nft's ``queue`` where the kernel has it, else xt NFQUEUE; logs the choice.

    A check only (``nft_queue_supported``): a successor asks it while its
    predecessor still serves, so that installing is all that is left once
    the queue is its own.
    """
    if nft_queue_supported(queue):
        log.info("nfqueue: queueing SYNs with nft's queue expression (queue %d)", queue)
        return "nft"
    log.info("nfqueue: this kernel has no nft queue expression (CONFIG_NFT_QUEUE);"
             " queueing SYNs with iptables -j NFQUEUE (queue %d)", queue)
    return "xt"


def _saved(family: int = 4) -> str | None:
    """``iptables-save -t mangle`` (``ip6tables-save``) now; None if there is none to ask."""
    try:
        res = _run(save_argv(family))
    except FileNotFoundError:
        return None
    if res.returncode != 0:
        raise RuntimeError(f"{_IPTABLES[family]}-save: {res.stderr.strip() or res.returncode}")
    return res.stdout


def _ensure_xt(cfg: QueueConfig, family: int = 4) -> int:
    """Exactly one copy of each wanted rule of ``family``, and no other kpx rule; returns
    rules added.

    Wanted rules go in first: while an old configuration's rule (another
    queue number) is still ahead of ours, its SYNs are dropped, not let
    through. ``iptables_rules`` renders as ``iptables-save`` prints, so a
    rule is recognised by its text; should some version print it otherwise,
    the last ``-C`` puts back a rule deleted for looking foreign.
    """
    wanted = iptables_rules(cfg)
    added = _append_missing(wanted, family)
    keep = {tuple(r): 1 for r in wanted}
    stale = 0
    for rule in _kpx_saved(cfg.comment, family) or []:
        if keep.get(tuple(rule), 0) > 0:
            keep[tuple(rule)] -= 1
            continue
        stale += _run(iptables_argv("-D", rule, family)).returncode == 0
    if stale:
        log.info("nfqueue: removed %d %s rule(s) of an earlier kpx", stale, _IPTABLES[family])
        added += _append_missing(wanted, family)
    return added


def _append_missing(rules: list[list[str]], family: int = 4) -> int:
    added = 0
    for rule in rules:
        if _run(iptables_argv("-C", rule, family)).returncode == 0:
            continue
        res = _run(iptables_argv("-A", rule, family))
        if res.returncode != 0:
            raise RuntimeError(f"{_IPTABLES[family]} -A {' '.join(rule)}: {res.stderr.strip()}")
        added += 1
    return added


def _kpx_saved(comment: str, family: int = 4) -> list[list[str]] | None:
    save = _saved(family)
    return None if save is None else kpx_rules(save, comment)


def install(cfg: QueueConfig, served: Served, mechanism: Mechanism | None = None,
            family: int = 4) -> Mechanism:
    """Make the namespace queue ``family``'s ``served`` SYNs and act on verdicts; idempotent.

    ``mechanism`` None: probe the kernel (``choose_mechanism``). The table
    goes first (it only marks; nothing is queued without the iptables rule),
    then the rule. The nft path also removes a previous run's iptables
    rules. Bind the queue socket before this. Returns the mechanism used.
    Each family is installed on its own (the caller installs both, with the
    mechanism the first one found).
    """
    if mechanism is None:
        mechanism = choose_mechanism(cfg.queue)
    write_table(cfg, served, mechanism, family)  # ValueError: nothing changed yet
    queue_syns(cfg, mechanism, family)
    return mechanism


def queue_syns(cfg: QueueConfig, mechanism: Mechanism, family: int = 4) -> None:
    """``install``'s second half: with xt, exactly one copy of each queueing rule of
    ``family``; with nft's ``queue`` (in the table), none. Idempotent."""
    if mechanism == "xt":
        _ensure_xt(cfg, family)
    else:
        _remove_xt(cfg, family)


def _remove_xt(cfg: QueueConfig, family: int = 4) -> int:
    removed = 0
    if _kpx_saved(cfg.comment, family) is None:
        return 0
    for rule in iptables_rules(cfg):
        for _ in range(_MAX_DELETES):
            if _run(iptables_argv("-D", rule, family)).returncode != 0:
                break
            removed += 1
    for rule in _kpx_saved(cfg.comment, family) or []:  # another configuration's, left by a crash
        for _ in range(_MAX_DELETES):
            if _run(iptables_argv("-D", rule, family)).returncode != 0:
                break
            removed += 1
    left = _kpx_saved(cfg.comment, family)
    if left:
        raise RuntimeError(f"{_IPTABLES[family]} rules still present after removing them: {left}")
    return removed


def remove(cfg: QueueConfig, families: Iterable[int] = FAMILIES) -> int:
    """Delete every kpx rule of ``families``: the iptables rules first (nothing is queued),
    then the table.

    Idempotent; without an ``iptables`` (``ip6tables``) binary only the
    table is removed. Returns the iptables and ip6tables rules deleted. The
    ``mangle`` table that ``iptables-nft`` made for kpx's rules goes too, but
    only while it is empty (``mangle_is_empty``): with anyone's rule in it,
    it stays.
    """
    removed = 0
    for family in families:
        removed += _remove_xt(cfg, family)
        fam = _nft_family(family).family
        _nft(remove_script(cfg.table, family), f"delete table {fam} {cfg.table}")
        _remove_empty_mangle(family)
    return removed


KEPT_SETS = ("ports", "pairs", "udp_ports", "udp_pairs")


class Frontends(NamedTuple):
    """The ports an nfqueue-mode table served: what its DNATed connections were made to."""

    ports: frozenset[tuple[str, int]] = frozenset()
    """``(protocol, port)`` served on every local address: NodePorts."""
    pairs: frozenset[tuple[str, str, int]] = frozenset()
    """``(protocol, address, port)`` served on one address: VIP ports, or NodePorts on
    ``--nodeport-addresses``."""

    def __or__(self, other: object) -> Frontends:
        if not isinstance(other, Frontends):
            return NotImplemented
        return Frontends(self.ports | other.ports, self.pairs | other.pairs)


def frontends(listing: str) -> Frontends | None:
    """What ``nft -j list table FAMILY kpx_nfq`` (or ``kpx_nfq_keep``) served; None if the
    listing is not one (pure).

    Read from its sets ``ports`` and ``pairs`` (TCP) and ``udp_ports`` and
    ``udp_pairs``: a NodePort is an ``int`` element, a pair a ``concat``.
    """
    try:
        items = json.loads(listing)["nftables"]
        ports: set[tuple[str, int]] = set()
        pairs: set[tuple[str, str, int]] = set()
        for item in items:
            spec = item.get("set") if isinstance(item, dict) else None
            if not spec or spec.get("name") not in KEPT_SETS:
                continue
            proto = "udp" if spec["name"].startswith("udp_") else "tcp"
            for elem in spec.get("elem", []):
                if isinstance(elem, int):
                    ports.add((proto, elem))
                else:
                    addr, port = elem["concat"]
                    pairs.add((proto, str(addr), int(port)))
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
    return Frontends(frozenset(ports), frozenset(pairs))


def keep_script(fronts: Frontends, family: int = 4, table: str = NFT_TABLE) -> str:
    """The nft transaction that swaps ``family``'s table ``table`` for the NAT keeper.

    Why a keeper: the kernel tracks connections in a namespace only while a
    rule there needs conntrack, and translates them only while a nat chain of
    their family is registered; on a node without kube-proxy, kpx's table
    was both. Deleting it would leave every connection it DNATed untracked:
    the client's next segment meets the node itself, which resets it. The
    keeper is one nat chain whose one rule (``ct status dnat``, no
    statement: it changes nothing) holds conntrack on, and the ``fronts`` it
    was for, so whichever kpx finds it knows which connections it waits out
    (``proxy.nfqueue.conntrack.dnat_toward``). It goes in before the old
    table goes, in the same transaction. ValueError for a bad port or
    address, before anything runs.
    """
    f = _nft_family(family)
    by_name: dict[str, list[str]] = {n: [] for n in KEPT_SETS}
    for proto, port in fronts.ports:
        by_name["udp_ports" if proto == "udp" else "ports"].append(_port(port))
    for proto, addr, port in fronts.pairs:
        by_name["udp_pairs" if proto == "udp" else "pairs"].append(_pair(addr, port, family))
    types = {"ports": "inet_service", "udp_ports": "inet_service",
             "pairs": f"{f.addr} . inet_service", "udp_pairs": f"{f.addr} . inet_service"}
    sets = "".join(f"  set {n} {{ type {types[n]};{_elements(sorted(by_name[n]))} }}\n"
                   for n in KEPT_SETS)
    return (remove_script(KEEP_TABLE, family)
            + f"table {f.family} {KEEP_TABLE} {{\n{sets}"
            + "  chain nat {\n    type nat hook prerouting priority -100; policy accept;\n"
            + "    ct status dnat\n  }\n}\n" + remove_script(table, family))


def kept(family: int = 4) -> Frontends | None:
    """The frontends ``family``'s NAT keeper is for; None if there is none."""
    res = _run(["nft", "-j", "list", "table", _nft_family(family).family, KEEP_TABLE])
    return frontends(res.stdout) if res.returncode == 0 else None


def keep_nat(cfg: QueueConfig, families: Iterable[int] = FAMILIES) -> int:
    """``remove``, except that each family's table becomes its NAT keeper (``keep_script``),
    for the connections it DNATed; returns the iptables and ip6tables rules deleted.

    The queueing rules go first, so nothing is queued. A keeper there
    already (an earlier switch, not yet waited out) keeps its frontends too.
    """
    removed = 0
    for family in families:
        removed += _remove_xt(cfg, family)
        fam = _nft_family(family).family
        res = _run(["nft", "-j", "list", "table", fam, cfg.table])
        fronts = frontends(res.stdout) if res.returncode == 0 else None
        if fronts is not None:
            fronts = fronts | (kept(family) or Frontends())
            _nft(keep_script(fronts, family, cfg.table), f"keep NAT for {fam} {cfg.table}")
        else:
            _nft(remove_script(cfg.table, family), f"delete table {fam} {cfg.table}")
        _remove_empty_mangle(family)
    return removed


def left_behind(tables: str, saves: Iterable[str], cfg: QueueConfig | None = None) -> bool:
    """Whether ``nft list tables`` and ``iptables-save -t mangle`` (``save_argv``) outputs show
    a table or rule of an nfqueue-mode kpx (pure).

    What a kpx in the other mode asks at start (a SIGKILL, or a restart into
    userspace mode, leaves them): the rules queue SYNs to a queue that no
    process reads, so the kernel drops every new connection to a port they
    served. Any kpx rule counts, whatever its queue number.
    """
    cfg = cfg or QueueConfig()
    ours = {f"table {_nft_family(f).family} {cfg.table}" for f in FAMILIES}
    return (any(line.strip() in ours for line in tables.splitlines())
            or any(kpx_rules(save, cfg.comment) for save in saves))


def mangle_is_empty(listing: str) -> bool:
    """Whether ``nft -j list table ip mangle`` shows nothing but accept-policy chains (pure).

    Such a table is what ``iptables-nft`` leaves after its last rule is
    deleted; removing it changes no packet's fate. A rule, a set, a drop
    policy, anything else: not empty.
    """
    try:
        items = json.loads(listing)["nftables"]
    except (ValueError, KeyError, TypeError):
        return False
    for item in items:
        if not isinstance(item, dict):
            return False
        kind = next(iter(item), "")
        if kind in ("metainfo", "table"):
            continue
        if kind != "chain" or item["chain"].get("policy", "accept") != "accept":
            return False
    return True


def _remove_empty_mangle(family: int = 4) -> None:
    fam = _nft_family(family).family
    try:
        res = _run(["nft", "-j", "list", "table", fam, "mangle"])
    except FileNotFoundError:
        return
    if res.returncode == 0 and mangle_is_empty(res.stdout):
        _run(["nft", "delete", "table", fam, "mangle"])
