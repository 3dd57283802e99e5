"""Service VIPs local to the node: one kpx-owned ``local`` route per VIP, and no ARP for them.

Owns: in the namespace kpx runs in, the ``local`` routes that make each
service VIP (clusterIP, externalIP, ingress IP with ipMode VIP) a local
address, and the two ARP settings that keep the node from claiming them on
the wire:

- ``ip route add local <VIP>/32 dev lo table local proto 107 scope host``,
  one per VIP. ``proto 107`` (``VIP_PROTO``) is the mark by which kpx finds
  exactly its own routes again: the listing filters on it and every delete
  names it, and the kernel deletes only a route whose protocol matches;
- ``net.ipv4.conf.all.arp_ignore=1`` and ``arp_announce=2``: a local route
  makes the VIP a local address of the whole node, and with ``arp_ignore=0``
  (the kernel's default) the node answers ARP for *any* local address on
  *every* interface, so it would claim every clusterIP on the node network
  and steal externalIPs and LB IPs that the network routes to another node.
  ``arp_ignore=1`` answers only for addresses configured on the interface
  the request came in on (a VIP never is); ``arp_announce=2`` never uses a
  VIP as the source of the node's own ARP requests. The kernel applies the
  stricter of ``all`` and the interface's value, so ``all`` is enough; a
  value that is already as strict (an operator's ``arp_ignore=2``) is left
  alone. This is what IPVS mode's ``strictARP`` sets.

Never: touch any namespace other than the current one; add, replace or
delete a route that is not kpx's (a VIP that is local already through
someone else's route, such as IPVS's addresses on ``kube-ipvs0``, is left
to it and reported as ``foreign``); restore an ARP setting someone changed
after kpx did; remove routes or restore ARP settings while another kpx
process in the namespace is alive (``proxy.lifecycle.ownership``: presence
names, the routing lock).

Why ``local`` routes and not addresses (IPVS puts each VIP on a ``dummy``
device, ``kube-ipvs0``): a route in the ``local`` table is all the kernel
consults to call an IPv4 address local (``inet_addr_type``: input routing,
``bind``), so one route per VIP does what an address does, without one:
nothing shows up in ``ip addr`` (no tool or agent mistakes a VIP for a node
IP, no ``src`` for outgoing traffic is ever picked from it), no ``dummy``
device is needed (some kernels have none), and it works the same where
``dummy`` exists, next to an IPVS ``kube-ipvs0`` as well.

What follows from the VIP being local: packets from pods, from outside
(externalIPs, LB IPs routed to the node) and from the node's own processes
(which loop through ``lo`` and so through prerouting too) are delivered
locally; a node process connecting to a VIP gets the VIP itself as its
source address (a local route has no ``src``), as with IPVS.

Which ``VIP:port`` reaches kpx, and how:

- the socket lookup of a SYN to a served ``VIP:port`` is handed *one*
  listener for every VIP, by an eBPF ``sk_lookup`` program
  (``proxy.userspace.sklookup``, which says why not TPROXY, conntrack DNAT
  or a listener per ``VIP:port``); the accepted socket's own address is the
  VIP and port, so ``getsockname()`` names the service;
- the nft table ``ip kpx_vips`` (``nft_table``: written anew once, then
  changed in place, one transaction per change, so its hook stays) holds
  a filter chain in prerouting that looks at SYNs to a VIP only: a
  ClusterIP with internalTrafficPolicy Local and no local endpoint
  (``drop_all``), and an external VIP with eTP Local and none
  (``drop_external``: SYNs from the cluster CIDRs and from the node's own
  addresses still pass, they get Cluster semantics) are dropped, no SYN-ACK,
  no RST; any other port (one no service declares, a service with no
  endpoint) gets an RST, as nftables mode rejects "traffic to invalid ports
  on active cluster IPs", even where a node process listens on ``0.0.0.0``
  at that port. The node's own SYNs to a VIP meet it too: the VIP is local,
  so they loop through ``lo`` and its prerouting. A filter chain with no
  ``ct`` match switches no connection tracking on. Before those, an LB
  ingress IP's port whose service has ``loadBalancerSourceRanges`` meets
  kube-proxy's firewall: a ``firewall`` verdict map jumps it to the
  service's ``fw_<n>`` chain, which drops a source outside the ranges.

Traffic to anything else leaves at the chain's first rule (one set
lookup), so unrelated packets never cost userspace work.

Sharing: the routes and ARP settings are the namespace's, not the
process's (``--workers N``, a restart's successor draining next to it). A
sync touches only the VIPs that differ, under the routing lock (a route
that stays wanted is never deleted and re-added, so it has no gap); the
newest sync wins, also over a draining predecessor's set. ``remove_all``
runs only when no other kpx is present, and removes every kpx-owned route,
whoever added it. The ARP settings' values
from before kpx are carried in an abstract UNIX name (``<base>.arp.<pid>.
<n>.<arp_ignore>.<arp_announce>``, ``x`` for "was already strict enough")
that every kpx of the namespace that installed holds for its life: a
successor copies its predecessor's originals instead of taking kpx's own
values for the node's, so whoever exits last restores the node's values.
A kpx killed with SIGKILL takes its name along: its routes are removed by
the next kpx, but the ARP settings stay strict (the originals died with it).

Something outside kpx may delete the routes (``ip route flush``, a network
manager that cleans foreign routes such as systemd-networkd with
``ManageForeignRoutes=yes``): ``ensure``, run every sync period by the
owner, puts back what is missing and reports it. It also sees a node
address added on a VIP after kpx's route (the kernel's ``local`` route
beside kpx's), or removed again, and moves the VIP into or out of the
guard's ``foreign`` set.

IPv6 (``LocalVIPs(family=6)``, the IPv6 dataplane's): the same design in the
other family. Each VIP is ``local <VIP>/128 dev lo table local proto 107``
(the kernel's IPv6 input routing delivers to a ``local`` route as IPv4's
does, and ``ip6_route_del`` matches the proto too); the table is ``ip6
kpx_vips``, beside ``ip kpx_vips``, with ``ipv6_addr`` sets, the IPv6
``--cluster-cidr`` prefixes in ``passed`` and ICMPv6 port unreachable for
UDP; the listener and UDP socket the program steers to are on ``::1``
(``LISTEN_ADDRESS6``: IPv6 has no other loopback address, and ``::1`` is
never a NodePort). No sysctl: IPv6 has no ``arp_ignore``, and needs none.
A node answers a Neighbour Solicitation only for an address configured on
the interface it arrived on (or one an operator added for proxy NDP), so a
VIP that is a route and never an address is never claimed on any link;
addresses on ``lo`` (even ``nodad``) would add DAD and ``ip addr`` noise for
nothing. The bind a UDP answer needs from ``VIP:port`` takes
``IPV6_TRANSPARENT`` (IPv6's bind checks addresses, not routes).

Subprocesses and not pyroute2, for the reason ``transparent.py`` gives (the
event loop); the steps are written once, sans I/O, and driven by
``transparent``'s ``_drive`` (start, exit) or ``_drive_async``
(``proxy.util.spawn``: no thread, no fork, the loop never waits). A change
of any size is one ``ip -batch`` run for the additions and one for the
removals, diffed against kpx's own record of the table (``LocalTable``),
which is listed again only when a line fails; a ``VIPTarget`` is validated
and rendered before it reaches the loop. ``/proc/sys`` is read and written
directly (never blocks).
"""

from __future__ import annotations

import asyncio
import ipaddress
import itertools
import logging
import os
import re
import socket
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple, TypeVar

from healthz.proxy_health import ProxyHealth
from proxy import metrics
from proxy.lifecycle.ownership import (
    BASE_NAME,
    abstract_names,
    live_pids,
    routing_lock,
    routing_lock_async,
)
from proxy.userspace.transparent import Steps, _drive, _drive_async
from proxy.util.nfttable import NftTable, Object, elements

log = logging.getLogger(__name__)

VIP_PROTO = 107
"""0x6b, "k": the ``proto`` of every kpx VIP route, its ownership mark.

It cannot collide with the kernel's own values (0-4: unspec, redirect,
kernel, boot, static) nor with any protocol registered in ``rtnetlink.h``
or iproute2's ``rt_protos`` (8-18, 42, 99, 186-192: routing daemons, dhcp,
keepalived). kube-proxy uses no route protocol of its own (IPVS mode's VIP
routes are the kernel's, ``proto kernel``, made for the addresses on
``kube-ipvs0``), and Cilium marks its routes ``proto kernel``. Overridable (``LocalVIPs(proto=)``)
for a node where other software picked 107 too."""

LOCAL_TABLE = "local"

ARP_SETTINGS: dict[str, tuple[int, frozenset[int]]] = {
    "arp_ignore": (1, frozenset({1, 2, 3, 8})),
    "arp_announce": (2, frozenset({2})),
}
"""sysctl -> (the value kpx sets, the values that already keep a VIP off ARP).

arp_ignore 1-3 all require the target to be configured on the incoming
interface (or of a narrower scope), 8 never replies; 4-7 are reserved and
behave as 0. For arp_announce only 2 keeps a VIP out of the node's own requests."""

ARP_SYSCTL_DIR = Path("/proc/sys/net/ipv4/conf/all")
THREAD_NET_UNIX = Path("/proc/thread-self/net/unix")
"""Not ``/proc/net/unix``: that one follows ``/proc/self``, the *process's* first
thread, so a thread that joined another namespace (``setns``) would look at
the wrong one."""

_seq = itertools.count()


def vip(address: str, family: int = 4) -> str:
    """The canonical text of one VIP of ``family``; ValueError for anything that is not one.

    Never the unspecified, loopback, multicast or limited broadcast address
    (they are local already, or never a destination); for IPv6 not a
    link-local (it needs a zone, and is no service address) nor an
    IPv4-mapped one either. ``inet_pton`` takes strict dotted quads only, and
    is a tenth of ``ipaddress``'s cost: 50,000 VIPs are validated in a sync.
    """
    if family == 6:
        packed = _packed(address, socket.AF_INET6)
        if (packed[0] == 0xFF or (packed[0] == 0xFE and packed[1] & 0xC0 == 0x80)
                or packed[:15] == bytes(15) or packed[:12] == bytes(10) + b"\xff\xff"):
            raise ValueError(f"{address!r}: not usable as a service VIP")
        return socket.inet_ntop(socket.AF_INET6, packed)
    packed = _packed(address, socket.AF_INET)
    first = packed[0]
    if (first == 127 or 224 <= first <= 239 or packed == b"\0\0\0\0"
            or packed == b"\xff\xff\xff\xff"):
        raise ValueError(f"{address!r}: not usable as a service VIP")
    return socket.inet_ntop(socket.AF_INET, packed)


def _packed(address: str, af: socket.AddressFamily) -> bytes:
    """``address`` of family ``af``, packed; ValueError naming it (and the family it is)."""
    try:
        return socket.inet_pton(af, address.strip())
    except OSError:
        ipaddress.ip_address(address.strip())  # ValueError naming it, unless the other family
        given, made = ("IPv4", "IPv6") if af == socket.AF_INET6 else ("IPv6", "IPv4")
        raise ValueError(f"{address!r}: an {given} address where {made} VIPs are made local"
                         ) from None


NFT_TABLE = "kpx_vips"
LISTEN_ADDRESS = "127.0.0.107"
"""Where the one VIP listener binds (107: kpx's mark, as ``VIP_PROTO``). The
``sk_lookup`` program hands it connections for any VIP; bound on loopback
it is never reached from off the node, and no NodePort listener ever binds
this address, so a successor tells it from the NodePort sockets passed on
to it. A node process dialling it directly meets no service and is reset."""

LISTEN_ADDRESS6 = "::1"
"""The IPv6 VIP listener's address: IPv6 has one loopback address only, and
the IPv6 NodePort listeners never bind it (``::1`` is never a NodePort), so
here too the successor tells the VIP listener apart by its address."""


def listen_address(family: int) -> str:
    """Where ``family``'s VIP listener (and UDP VIP socket) binds."""
    return LISTEN_ADDRESS6 if family == 6 else LISTEN_ADDRESS


def _ip(family: int) -> str:
    """nft's name of the family, as in ``table ip6 kpx_vips``."""
    return "ip6" if family == 6 else "ip"


VIPPort = tuple[str, int]
FirewallPort = tuple[str, str, int]
"""An LB IP, ``tcp`` or ``udp``, a port: one key of the ``firewall`` verdict map."""

_COMMENT_SAFE = re.compile(r"[a-z0-9][a-z0-9./-]*")
"""What a service key (``namespace/name``, both DNS labels) is made of: safe in an nft
comment. Anything else is left out of the comment rather than quoted."""


@dataclass(frozen=True, slots=True)
class Firewall:
    """One service's ``loadBalancerSourceRanges`` in one family's table (kube-proxy's
    ``firewall-*`` chain): a new connection to one of ``ports`` from outside ``sources``
    is dropped. ``sources``: the ranges, and the LB IPs with ``allowFromNode``, as
    non-overlapping CIDRs (``firewall_sources``)."""

    service: str
    sources: tuple[str, ...]
    ports: frozenset[FirewallPort]


def firewall_sources(ranges: Iterable[ipaddress.IPv4Network | ipaddress.IPv6Network],
                     also: Iterable[str] = ()) -> tuple[str, ...]:
    """``ranges`` and the addresses ``also``, merged into non-overlapping CIDRs (one family).

    nft refuses overlapping intervals in one set (``10.0.0.0/8, 10.1.0.0/16``,
    or an LB IP inside a range), which a user's list may well hold.
    """
    nets = [*ranges, *(ipaddress.ip_network(a) for a in also)]
    return tuple(str(n) for n in ipaddress.collapse_addresses(nets))  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True)
class Interception:
    """What the node's nft table does with SYNs to its VIPs, for one sync (plain data).

    ``served``: passed, for the ``sk_lookup`` program to steer to the VIP
    listener; ``drop_all``: dropped from everyone; ``drop_external``: dropped
    unless from ``passed`` (the cluster CIDRs) or the node itself. Any other
    ``VIP:port`` is rejected.
    """

    served: frozenset[VIPPort] = frozenset()
    drop_all: frozenset[VIPPort] = frozenset()
    drop_external: frozenset[VIPPort] = frozenset()
    passed: tuple[str, ...] = ()
    udp_served: frozenset[VIPPort] = frozenset()
    """UDP ports, as the three TCP sets: steered to the UDP socket, dropped
    (every datagram, not only a first one), or else rejected with ICMP port
    unreachable, which is what kube-proxy's REJECT sends for UDP."""
    udp_drop_all: frozenset[VIPPort] = frozenset()
    udp_drop_external: frozenset[VIPPort] = frozenset()
    loopback: frozenset[int] = frozenset()
    """IPv6 only: the TCP NodePorts that ``::1`` must refuse (RST to the SYN). The IPv6
    dataplane's ``::`` listeners would accept it, but iptables mode serves no IPv6
    localhost NodePort, so there the SYN meets a closed port."""
    udp_loopback: frozenset[int] = frozenset()
    """The same for UDP NodePorts: ICMPv6 port unreachable, a closed port's answer."""
    firewalls: tuple[Firewall, ...] = ()
    """``loadBalancerSourceRanges``: checked before every other rule, TCP and UDP."""


@dataclass(frozen=True, slots=True, eq=False)
class VIPTarget:
    """What one sync wants of the namespace: canonical VIPs, their rules, the rendered table.

    ``diff``: the route changes from the local table ``LocalVIPs.known`` was
    when it was built, worked out and rendered beforehand (None: on the loop).
    """

    vips: frozenset[str]
    rules: Interception | None
    nft: NftTable | None
    diff: RouteDiff | None = None

    @classmethod
    def build(cls, wanted: Iterable[str], rules: Interception | None,
              table: str = NFT_TABLE, known: LocalTable | None = None,
              proto: int = VIP_PROTO, family: int = 4) -> VIPTarget:
        """Validate ``wanted`` as VIPs of ``family`` (ValueError: ``vip``), render the
        table and, given the table as it is ``known``, the route changes; pure, any thread."""
        vips = frozenset(vip(a, family) for a in wanted)
        return cls(vips, rules,
                   None if rules is None else nft_table(vips, rules, table, family),
                   None if known is None else RouteDiff.between(known, vips, proto))

    def same(self, other: VIPTarget | None) -> bool:
        return other is self or (other is not None and self.vips == other.vips
                                 and self.rules == other.rules)


SORT_UP_TO = 4096
T = TypeVar("T")


def ordered(items: Iterable[T]) -> list[T]:
    """``items`` sorted, for logs, tests and stable texts; as they come past ``SORT_UP_TO``.

    Neither ``ip -batch`` nor nft cares about order, and sorting 50,000 VIPs
    is one C call that holds the GIL 10-15 ms while the loop waits for it
    (the VIP work runs in the source's thread, next to the loop).
    """
    items = list(items)
    return sorted(items) if len(items) <= SORT_UP_TO else items  # type: ignore[type-var]


class RouteDiff(NamedTuple):
    """The route changes that take ``base`` to a wanted set, and their ``ip -batch`` texts."""

    base: LocalTable
    add: tuple[str, ...]
    delete: tuple[str, ...]
    add_script: str
    delete_script: str

    @classmethod
    def between(cls, base: LocalTable, wanted: frozenset[str], proto: int) -> RouteDiff:
        add = tuple(ordered(wanted - base.ours - base.others))
        delete = tuple(ordered(base.ours - wanted))
        return cls(base, add, delete, batch_script(add, (), proto),
                   batch_script((), delete, proto))


def nft_table(vips: Iterable[str], rules: Interception, table: str = NFT_TABLE,
              family: int = 4) -> NftTable:
    """The nft table that holds exactly ``rules``, rendered once (``NftTable``): written
    anew the first time, so that a leftover (a crashed kpx, an older set) vanishes in
    the same transaction, and in place over the last one after that, so that the
    guard's base chain and its hook stay (``proxy.util.nfttable`` says why).

    The guard looks at SYNs only (``tcp flags & (syn | ack) == syn``): the
    rest of a connection, and a node process's own packets *from* a VIP
    (its replies), pass untouched.
    UDP has no first packet to tell apart, so ``udp_guard`` judges every
    datagram to a VIP: dropped, steered, or rejected with ICMP port
    unreachable (kube-proxy's REJECT for UDP). The drop and reject rules
    count what they turn away (``nft list table ip kpx_vips``): an
    operator's first question about a timing-out VIP.

    ``loadBalancerSourceRanges`` come first, as kube-proxy's
    ``firewall-check`` does before any DNAT: the ``firewall`` verdict map,
    keyed ``daddr . l4proto . dport`` as kube-proxy's ``firewall-ips``,
    jumps a new connection (a SYN; for UDP every datagram) to an LB IP port
    to its service's chain ``fw_<n>``, which drops a source outside the
    ranges (``ip saddr != { ranges } drop``) and returns otherwise, so the
    guard goes on. ``jump``, not kube-proxy's ``goto``: the guard is a base
    chain, and a ``goto`` that fell off its target would end in the policy's
    accept and skip the rules after it.

    ``family`` 6 writes the same table in the ``ip6`` family (``ip6
    kpx_vips``, beside ``ip kpx_vips``), with ``ipv6_addr`` sets and ICMPv6's
    port unreachable for UDP, and refuses the NodePorts on ``::1``
    (``Interception.loopback``): loopback traffic passes prerouting too.
    """
    ip, addr = ("ip6", "ipv6_addr") if family == 6 else ("ip", "ipv4_addr")
    unreachable = "icmpv6 type port-unreachable" if family == 6 else "icmp type port-unreachable"

    def pairs(s: frozenset[VIPPort]) -> str:
        return elements(f"{a} . {p}" for a, p in ordered(s))

    def fw_rule(fw: Firewall) -> str:
        comment = f' comment "{fw.service}"' if _COMMENT_SAFE.fullmatch(fw.service) else ""
        return f"    {ip} saddr != {{ {', '.join(fw.sources)} }} counter drop{comment}\n"

    fw_elements = elements(f"{a} . {proto} . {port} : jump fw_{i}"
                           for i, fw in enumerate(rules.firewalls)
                           for a, proto, port in ordered(fw.ports))
    loopback: list[Object] = []
    if family == 6:
        loopback = [
            ("set", "loopback", "type inet_service;",
             elements(map(str, sorted(rules.loopback)))),
            ("set", "udp_loopback", "type inet_service;",
             elements(map(str, sorted(rules.udp_loopback)))),
            ("chain", "loopback_guard", "",
             f"    tcp dport @loopback tcp flags & (syn | ack) == syn reject with tcp reset\n"
             f"    udp dport @udp_loopback reject with {unreachable}\n"),
        ]
    udp_guard = (
        f"    {ip} daddr . meta l4proto . udp dport vmap @firewall\n"
        f"    {ip} daddr . udp dport @udp_drop_all counter drop\n"
        f"    {ip} daddr . udp dport @udp_drop_external {ip} saddr != @passed"
        f" fib saddr type != local counter drop\n"
        f"    {ip} daddr . udp dport @udp_served return\n"
        # kpx's own answer from a served VIP:port to a node client whose source
        # is the VIP itself (an unbound socket: a local route has no src).
        f"    meta iif lo {ip} saddr . udp sport @udp_served return\n"
        f"    {ip} daddr @foreign return\n"
        f"    counter reject with {unreachable}\n"
    )
    guard = (
        ("    ip6 daddr ::1 jump loopback_guard\n" if family == 6 else "")
        + f"    {ip} daddr != @vips return\n"
        f"    meta l4proto udp jump udp_guard\n"
        f"    tcp flags & (syn | ack) != syn return\n"
        f"    {ip} daddr . meta l4proto . tcp dport vmap @firewall\n"
        f"    {ip} daddr . tcp dport @drop_all counter drop\n"
        f"    {ip} daddr . tcp dport @drop_external {ip} saddr != @passed"
        f" fib saddr type != local counter drop\n"
        f"    {ip} daddr . tcp dport @served return\n"
        f"    {ip} daddr @foreign return\n"
        f"    meta l4proto tcp counter reject with tcp reset\n"
    )
    pair = f"type {addr} . inet_service;"
    return NftTable.render(ip, table, [
        *loopback,
        *(("chain", f"fw_{i}", "", fw_rule(fw)) for i, fw in enumerate(rules.firewalls)),
        ("map", "firewall", f"type {addr} . inet_proto . inet_service : verdict;", fw_elements),
        ("set", "vips", f"type {addr};", elements(ordered(vips))),
        ("set", "served", pair, pairs(rules.served)),
        ("set", "drop_all", pair, pairs(rules.drop_all)),
        ("set", "drop_external", pair, pairs(rules.drop_external)),
        ("set", "passed", f"type {addr}; flags interval;", elements(rules.passed)),
        # VIPs that are local through someone else's route (a node address used as
        # an externalIP or LB IP): their undeclared ports are the node's, not refused.
        ("set", "foreign", f"type {addr};", ""),
        ("set", "udp_served", pair, pairs(rules.udp_served)),
        ("set", "udp_drop_all", pair, pairs(rules.udp_drop_all)),
        ("set", "udp_drop_external", pair, pairs(rules.udp_drop_external)),
        ("chain", "udp_guard", "", udp_guard),
        ("chain", "guard", "type filter hook prerouting priority mangle; policy accept;", guard),
    ])


def nft_script(vips: Iterable[str], rules: Interception, table: str = NFT_TABLE,
               family: int = 4) -> str:
    """``nft_table``'s transaction anew: the text a first write sends."""
    return nft_table(vips, rules, table, family).anew()


def _write_steps(nft: NftTable, foreign: Iterable[str],
                 before: frozenset[tuple[str, str]] | None) -> Steps[None]:
    """Write the table ``nft``, with the wanted VIPs local through a route kpx does not own
    (a node address: the guard leaves their other ports alone) in its ``foreign`` set.

    ``before``: the objects of the table this process last wrote, changed in
    place (``NftTable.in_place``); None, or a table nft will not change so
    (someone else's hand, a kpx of another layout), writes it anew.
    """
    foreign = ordered(foreign)
    extra = f"add element {nft.ref} foreign {{ {', '.join(foreign)} }}\n" if foreign else ""
    if before is not None:
        res = yield ["nft", "-f", "-"], nft.in_place(before) + extra
        if res.returncode == 0:
            return
        log.warning("service VIP rules: table %s is not as kpx left it (%s); writing it anew",
                    nft.ref, (res.stderr.strip() or str(res.returncode)).splitlines()[0][:200])
    yield from _rules_steps(nft.anew() + extra)


def _foreign_steps(table: str, foreign: Iterable[str], before: Iterable[str]) -> Steps[None]:
    """Make the ``foreign`` set of ``table`` (``ip kpx_vips``) exactly ``foreign``, atomically.

    A node address added or removed while kpx's own route for it stays
    (``ip addr add`` of an address that is a VIP already) changes no route of
    kpx's and no wanted VIP: only this set, so the node's other ports on the
    address are given back, or refused again, without rewriting the table.
    """
    foreign, before = frozenset(foreign), frozenset(before)
    if came := ordered(foreign - before):
        log.info("service VIPs now local through a route kpx does not own as well (a node"
                 " address); their other ports are left to the node: %s", " ".join(came[:10]))
    if went := ordered(before - foreign):
        log.info("service VIPs no longer local through a route kpx does not own; their"
                 " undeclared ports are refused again: %s", " ".join(went[:10]))
    text = f"flush set {table} foreign\n"
    if foreign:
        text += f"add element {table} foreign {{ {', '.join(ordered(foreign))} }}\n"
    yield from _rules_steps(text)


def _rules_steps(script: str) -> Steps[None]:
    res = yield ["nft", "-f", "-"], script
    if res.returncode != 0:
        raise RuntimeError(f"nft -f (service VIP rules): {res.stderr.strip() or res.returncode}")


def rule_counters(listing: str) -> dict[str, int]:
    """Packets each counting rule of ``nft list chain/table ip kpx_vips`` turned away.

    Keys: ``drop_all``, ``drop_external``, ``reject``, and the same three
    with ``udp_`` for UDP datagrams; ``firewall``: new connections (TCP and
    UDP) from outside a service's ``loadBalancerSourceRanges``, every
    ``fw_<n>`` chain's summed.
    """
    out: dict[str, int] = {}
    udp = ""
    firewall = False
    for line in listing.splitlines():
        if line.strip().startswith("chain "):
            chain = line.split()[1]
            udp = "udp_" if chain == "udp_guard" else ""
            firewall = chain.startswith("fw_")
        m = re.search(r"counter packets (\d+)", line)
        if m is None:
            continue
        if firewall:
            out["firewall"] = out.get("firewall", 0) + int(m.group(1))
            continue
        key = ("drop_all" if "drop_all" in line else "drop_external"
               if "drop_external" in line else "reject" if "reject" in line else None)
        key = None if key is None else udp + key
        if key is not None:
            out[key] = int(m.group(1))
    return out


def _rules_present_steps(table: str = NFT_TABLE, family: int = 4) -> Steps[bool]:
    """Is the table there with its guard chain? (Not its elements: the listing is cheap.)"""
    res = yield ["nft", "list", "chain", _ip(family), table, "guard"], None
    return res.returncode == 0 and "reject with tcp reset" in res.stdout


def _rules_remove_steps(table: str = NFT_TABLE, family: int = 4) -> Steps[bool]:
    res = yield ["nft", "list", "table", _ip(family), table], None
    if res.returncode != 0:
        return False
    res = yield ["nft", "delete", "table", _ip(family), table], None
    if res.returncode != 0:
        raise RuntimeError(f"nft delete table {_ip(family)} {table}: {res.stderr.strip()}")
    return True


@dataclass(frozen=True, slots=True)
class VIPChanges:
    """What one sync (or ``ensure``) did; every tuple is sorted.

    ``added``: routes kpx added (for ``ensure``: put back after something
    deleted them). ``removed``: kpx routes deleted, no longer wanted.
    ``foreign``: wanted VIPs that are local through a route kpx does not own
    (left alone; kpx adds its own once that one goes). ``arp``: the ARP
    settings kpx set now (first install) or set back (``ensure``).
    ``rules``: the nft table was written (for ``ensure``: it was missing).
    """

    added: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()
    foreign: tuple[str, ...] = ()
    arp: tuple[str, ...] = ()
    rules: bool = False

    @property
    def changed(self) -> bool:
        return bool(self.added or self.removed or self.arp or self.rules)


class LocalTable(NamedTuple):
    """One family's ``local`` table as far as VIPs are concerned."""

    ours: frozenset[str]
    """Host routes of type local with kpx's proto."""
    others: frozenset[str]
    """Every host-route destination with a route that is not kpx's (any type, any proto).

    It may be in ``ours`` too: an address added to an interface after kpx
    made it a VIP gets the kernel's ``local`` route (``proto kernel``, its
    device) beside kpx's, and is the node's as much as a VIP."""


def parse_local_table(listing: str, proto: int = VIP_PROTO) -> LocalTable:
    """Read ``ip -N -o -4 route show table local`` (or ``-6``): one route per line.

    ``-N`` prints type, protocol and scope as numbers (type 2 is ``local``),
    so a name for 107 in some ``rt_protos.d`` file changes nothing. Only
    host routes count. Lines, not JSON: a successor that finds 50,000 routes
    reads them in 10 ms where ``json.loads`` and the dicts took 80 ms of loop.
    """
    ours: set[str] = set()
    others: set[str] = set()
    mark = f" proto {proto} "
    for line in listing.splitlines():
        kind, _, rest = line.partition(" ")
        dst = rest.split(" ", 1)[0].removesuffix("/32").removesuffix("/128")
        if not dst or "/" in dst or dst == "default":
            continue
        mine = kind in ("2", "local") and mark in line + " "
        (ours if mine else others).add(dst)
    return LocalTable(frozenset(ours), frozenset(others))


def batch_script(add: Iterable[str], delete: Iterable[str], proto: int = VIP_PROTO) -> str:
    """The ``ip -batch`` input for one change: deletes first, then adds.

    ``add``, never ``replace``: a route that exists already (even someone
    else's with the same destination) makes the line fail instead of being
    overwritten. Every delete names the proto, so the kernel can match only
    a kpx route (IPv6 matches it too, ``ip6_route_del``). An IPv6 VIP is a
    ``/128``: ``ip`` takes the family from the address.
    """
    def host(a: str) -> str:
        return f"{a}/128" if ":" in a else f"{a}/32"

    lines = [f"route del local {host(a)} table {LOCAL_TABLE} proto {proto}" for a in delete]
    lines += [f"route add local {host(a)} dev lo table {LOCAL_TABLE} proto {proto} scope host"
              for a in add]
    return "".join(line + "\n" for line in lines)


def _list_argv(family: int = 4) -> list[str]:
    return ["ip", "-N", "-o", f"-{family}", "route", "show", "table", LOCAL_TABLE]


def _table_steps(proto: int, family: int = 4) -> Steps[LocalTable]:
    res = yield _list_argv(family), None
    if res.returncode != 0:
        raise RuntimeError(f"ip route show table local: {res.stderr.strip() or res.returncode}")
    return parse_local_table(res.stdout, proto)


def _batch_steps(add: Iterable[str], delete: Iterable[str], proto: int) -> Steps[str]:
    """One ``ip -batch`` run; the error text if any line failed ("" if none did)."""
    return (yield from _batch_text_steps(batch_script(add, delete, proto)))


def _batch_text_steps(text: str) -> Steps[str]:
    res = yield ["ip", "-force", "-batch", "-"], text
    return "" if res.returncode == 0 else (res.stderr.strip() or f"ip exit {res.returncode}")


def _change_steps(wanted: frozenset[str], proto: int, delete_unwanted: bool,
                  nft: NftTable | None = None, known: LocalTable | None = None,
                  diff: RouteDiff | None = None, family: int = 4,
                  written: frozenset[tuple[str, str]] | None = None
                  ) -> Steps[tuple[VIPChanges, LocalTable]]:
    """Make every wanted VIP local; with ``delete_unwanted``, delete kpx's other routes.

    ``nft`` (``nft_table``), if given, is written between the adds and
    the deletes: a VIP is local before any rule steers to it, and loses its
    rules before it stops being local (a steered SYN to a VIP that is not
    local would be forwarded, not refused). ``written``: the objects of the
    table this process last wrote, which it then changes in place.

    ``known``: the table as this process last left it. With it nothing is
    listed unless a batch line fails (someone else's route is there, or one
    of ours went): reading back 50,000 routes costs the loop about 80 ms,
    and the batch's exit status already says whether the kernel agreed.

    ``diff``: the same worked out beforehand from ``known`` (``RouteDiff``),
    used only if ``known`` is still the very table it was made from.

    Returns what changed and the table as it now is. Raises RuntimeError if,
    afterwards, a wanted VIP is still not local or an unwanted kpx route is
    still there.
    """
    table = known if known is not None else (yield from _table_steps(proto, family))
    if diff is None or diff.base is not table or not delete_unwanted:
        diff = RouteDiff.between(table, wanted, proto)
        if not delete_unwanted:
            diff = diff._replace(delete=(), delete_script="")
    add, delete = list(diff.add), list(diff.delete)
    errors: list[str] = []
    if nft is not None:
        if add:
            errors.append((yield from _batch_text_steps(diff.add_script)))
        yield from _write_steps(nft, wanted & table.others, written)
        if delete:
            errors.append((yield from _batch_text_steps(diff.delete_script)))
    elif add or delete:
        errors.append((yield from _batch_steps(add, delete, proto)))
    errors = [e for e in errors if e]
    if errors:
        log.info("VIP routes: the table was not as kpx left it (%s); reading it back",
                 errors[0].splitlines()[0][:200])
        after = yield from _table_steps(proto, family)
        again = sorted(wanted - after.ours - after.others)
        if again:  # ours that went while we trusted the record: once more, now we know
            errors.append((yield from _batch_steps(again, (), proto)))
            after = yield from _table_steps(proto, family)
            add = sorted(set(add).union(again))
        missing = sorted(wanted - after.ours - after.others)
        left = sorted(after.ours.intersection(delete))
        if missing or left:
            raise RuntimeError(
                f"VIP routes: still missing {missing[:10]}, still present {left[:10]}: "
                f"{errors[0][:500]}")
        # A line that failed because someone else's route appeared meanwhile is fine.
        add = sorted(after.ours.intersection(add))
        if nft is not None and wanted & after.others != wanted & table.others:
            yield from _foreign_steps(nft.ref, wanted & after.others, wanted & table.others)
        table = after
    else:
        table = LocalTable(table.ours.union(add).difference(delete), table.others)
    changes = VIPChanges(added=tuple(add), removed=tuple(delete),
                         foreign=tuple(sorted(wanted & table.others)),
                         rules=nft is not None)
    return changes, table


def _ensure_steps(wanted: frozenset[str], proto: int, nft: NftTable | None,
                  table_name: str = NFT_TABLE, known: LocalTable | None = None,
                  family: int = 4) -> Steps[tuple[VIPChanges, LocalTable]]:
    """Put back missing routes, and the nft table if it is gone; never deletes.

    One listing of the whole ``local`` table (one ``ip`` run, a split per
    route), not only kpx's routes: a wanted VIP that became local through
    someone else's route as well (a node address added after kpx made it a
    VIP), or stopped being so, moves in or out of the guard's ``foreign``
    set here, not at the next VIP change. ``known`` (the last sync's table)
    is what the nft set holds; if nothing changed, it stays the table (a
    ``RouteDiff`` made from it beforehand still applies).
    """
    table = yield from _table_steps(proto, family)
    if known is not None and table == known and wanted <= known.ours | known.others:
        changes, table = VIPChanges(foreign=tuple(sorted(wanted & known.others))), known
    else:
        changes, table = yield from _change_steps(wanted, proto, delete_unwanted=False,
                                                  known=table, family=family)
    if nft is not None:
        foreign = wanted & table.others
        if not (yield from _rules_present_steps(table_name, family)):
            yield from _write_steps(nft, foreign, None)
            changes = VIPChanges(changes.added, changes.removed, changes.foreign, rules=True)
        elif known is None or foreign != wanted & known.others:
            yield from _foreign_steps(f"{_ip(family)} {table_name}", foreign,
                                      wanted & known.others if known is not None else ())
    return changes, table


def _remove_steps(proto: int, table_name: str = NFT_TABLE, family: int = 4
                  ) -> Steps[tuple[str, ...]]:
    """The nft table first (nothing steers to a VIP that is going), then every kpx route."""
    yield from _rules_remove_steps(table_name, family)
    table = yield from _table_steps(proto, family)
    if not table.ours:
        return ()
    res = yield ["ip", "-force", "-batch", "-"], batch_script((), sorted(table.ours), proto)
    after = yield from _table_steps(proto, family)
    if after.ours:
        raise RuntimeError(f"VIP routes still present after removing them: {sorted(after.ours)}: "
                           f"{res.stderr.strip() or f'ip exit {res.returncode}'}")
    return tuple(sorted(table.ours))


class LocalVIPs:
    """The node's set of local VIPs, kept equal to a wanted set; shared with any other kpx.

    ``sync(wanted)`` adds the missing VIP routes and deletes kpx's unwanted
    ones; the first call also sets the ARP settings (``install``). ``ensure``
    re-checks the last wanted set and puts back only what is missing (the
    owner's guard, every sync period). ``remove_all`` (exit) deletes every
    kpx VIP route and restores the ARP settings, unless another kpx is
    present. Every change holds the namespace's routing lock. ``sync_async``
    and ``ensure_async`` run on the event loop without blocking it.
    """

    def __init__(self, *, base: str = BASE_NAME, proto: int = VIP_PROTO,
                 sysctl_dir: Path = ARP_SYSCTL_DIR, net_unix: Path = THREAD_NET_UNIX,
                 family: int = 4) -> None:
        if family not in (4, 6):
            raise ValueError(f"family {family}: must be 4 or 6")
        self.family = family
        """The VIPs it makes local: IPv4 (``ip kpx_vips``, ARP settings) or IPv6
        (``ip6 kpx_vips``, no settings at all: the module docstring says why)."""
        self.base = base
        self.proto = proto
        self.sysctl_dir = sysctl_dir
        self.net_unix = net_unix
        self.wanted: frozenset[str] = frozenset()
        """The last set handed to ``sync``, canonical; what ``ensure`` keeps."""
        self.nft_table = NFT_TABLE
        self._rules: Interception | None = None
        self._nft: NftTable | None = None
        """The nft table of the last ``sync`` with rules: what ``ensure`` writes back."""
        self._written: frozenset[tuple[str, str]] | None = None
        """The objects of the nft table this process last wrote: the next sync changes that
        table in place (None: none yet, or removed; written anew)."""
        self._known: LocalTable | None = None
        """The local table as this process last saw or left it (None: list it first)."""
        self._seq = next(_seq)
        self._name: socket.socket | None = None
        """Held while installed: carries the ARP settings' original values."""
        self._originals: dict[str, int | None] = {}
        """sysctl -> its value before any kpx of the namespace changed it (None: left alone)."""
        self._warned: set[str] = set()
        self._installed6 = False
        """IPv6: installed (there are no ARP originals whose name would say so)."""

    @property
    def installed(self) -> bool:
        return self._name is not None or self._installed6

    # -- sync, ensure --------------------------------------------------------------------

    def install(self) -> tuple[str, ...]:
        """Set the ARP settings and hold their originals, without any VIP; idempotent.

        ``sync`` does this by itself. The ``--workers`` supervisor calls it
        before forking (and ``remove_all`` after the workers exit), so the
        originals outlive every worker. Returns the settings written now.
        """
        with routing_lock(self.base):
            return self._arp()

    def sync(self, wanted: Iterable[str], rules: Interception | None = None) -> VIPChanges:
        """Make exactly ``wanted`` (plus anything foreign) the kpx VIPs; blocking (start, tests).

        ``rules``: also write the nft table (``nft_table``); None leaves it
        alone. ValueError for an entry that is not a VIP of the family (``vip``),
        before anything changes; RuntimeError if the routes or rules could
        not be made so.
        """
        target = VIPTarget.build(wanted, rules, self.nft_table, family=self.family)
        with routing_lock(self.base):
            arp = self._arp()
            changes = self._record(target, _drive(self._change(target)))
        self._log(changes)
        return _with_arp(changes, arp)

    async def sync_async(self, target: VIPTarget) -> VIPChanges:
        """``sync`` of a ``VIPTarget`` on the running loop: the loop's subprocesses, no thread.

        The target is built beforehand (``VIPTarget.build``, off the loop for
        a big state): validating and rendering 50,000 VIPs is not loop work.
        """
        async with routing_lock_async(self.base):
            arp = self._arp()
            changes = self._record(target, await _drive_async(self._change(target)))
        self._log(changes)
        return _with_arp(changes, arp)

    @property
    def known(self) -> LocalTable | None:
        """The local table as this process last saw or left it: what ``VIPTarget.build`` diffs."""
        return self._known

    def _change(self, target: VIPTarget) -> Steps[tuple[VIPChanges, LocalTable]]:
        return _change_steps(target.vips, self.proto, True, target.nft, self._known,
                             target.diff, self.family, self._written)

    def _record(self, target: VIPTarget | None,
                result: tuple[VIPChanges, LocalTable]) -> VIPChanges:
        """Remember the table as it now is, and (a sync) what ``ensure`` keeps."""
        changes, self._known = result
        if target is not None:
            self.wanted = target.vips
            self._rules, self._nft = target.rules, target.nft
            if target.nft is not None:
                self._written = target.nft.names
        return changes

    def _ensure(self) -> Steps[tuple[VIPChanges, LocalTable]]:
        return _ensure_steps(self.wanted, self.proto, self._nft, self.nft_table, self._known,
                             self.family)

    def ensure(self) -> VIPChanges:
        """Put back what is missing of the last ``sync``: routes, rules, ARP settings.

        Never deletes a route; brings the guard's ``foreign`` set up to date.
        Returns what was repaired (``added``, ``rules``, ``arp``); nothing
        before the first ``sync``/``install``.
        """
        if not self.installed:
            return VIPChanges()
        with routing_lock(self.base):
            arp = self._arp()
            changes = self._record(None, _drive(self._ensure()))
        return _with_arp(changes, arp)

    async def ensure_async(self) -> VIPChanges:
        """``ensure`` on the running loop (the guard's check, every sync period)."""
        if not self.installed:
            return VIPChanges()
        async with routing_lock_async(self.base):
            arp = self._arp()
            changes = self._record(None, await _drive_async(self._ensure()))
        return _with_arp(changes, arp)

    def _log(self, changes: VIPChanges) -> None:
        if changes.added or changes.removed:
            log.info("service VIPs: %d local (%d added, %d removed)%s", len(self.wanted),
                     len(changes.added), len(changes.removed),
                     f"; {len(changes.foreign)} already local through a route kpx does not "
                     f"own, left to it" if changes.foreign else "")

    # -- removal -------------------------------------------------------------------------

    def remove_all(self) -> bool:
        """Delete every kpx VIP route and restore the ARP settings, unless another kpx is present.

        Returns True if removed, False if left in place for the other kpx
        (which removes them when it exits last). Either way this process
        stops holding the originals. Blocking: for exit.
        """
        try:
            with routing_lock(self.base):
                if self._left_to_others():
                    return False
                removed = _drive(_remove_steps(self.proto, self.nft_table, self.family))
                self._written = None
                restored = self._restore_arp()
        finally:
            self._release()
        if removed or restored:
            log.info("service VIPs removed: %d route(s)%s", len(removed),
                     f"; restored {', '.join(restored)}" if restored else "")
        return True

    def _left_to_others(self) -> bool:
        others = sorted(self._other_pids())
        if others:
            log.info("service VIPs and ARP settings left in place: kpx pid %s in this namespace"
                     " still uses them", ", ".join(map(str, others)))
        return bool(others)

    def _other_pids(self) -> set[int]:
        """Every other kpx process present: presence names, and holders of originals."""
        pids = live_pids(self.base, self.net_unix)
        for info in self._holders():
            pids.add(info[0])
        return pids - {os.getpid()}

    # -- ARP settings and their originals ------------------------------------------------

    def _holders(self) -> list[tuple[int, dict[str, int | None]]]:
        """(pid, originals) of every originals name in this namespace but this object's."""
        prefix = f"{self.base}.arp."
        own = self._name_text()
        out: list[tuple[int, dict[str, int | None]]] = []
        for name in sorted(abstract_names(prefix, self.net_unix)):
            if self._name is not None and name == own:
                continue
            fields = name[len(prefix):].split(".")
            if len(fields) != 2 + len(ARP_SETTINGS):
                continue
            try:
                pid = int(fields[0])
                values = {key: None if v == "x" else int(v)
                          for key, v in zip(ARP_SETTINGS, fields[2:], strict=True)}
            except ValueError:
                continue
            out.append((pid, values))
        return out

    def _name_text(self) -> str:
        values = ".".join("x" if self._originals.get(k) is None else str(self._originals[k])
                          for k in ARP_SETTINGS)
        return f"{self.base}.arp.{os.getpid()}.{self._seq}.{values}"

    def _arp(self) -> tuple[str, ...]:
        """Make each ARP setting strict enough; on the first call, learn and hold the originals.

        The originals come from another kpx's name when one is present (its
        values are the node's; what this process reads now may be kpx's own),
        else from what is read now. Called under the routing lock. A setting
        that cannot be written (a read-only ``/proc/sys``) is one warning: the
        VIPs work without it, only ARP hygiene is missing.

        IPv6 has none to set: a node answers a Neighbour Solicitation only for
        an address configured on the interface it came in on (or with proxy
        NDP, for entries someone added), and a VIP is a route, never an
        address, so it is never claimed on the wire.
        """
        if self.family == 6:
            self._installed6 = True
            return ()
        first = self._name is None
        holders = self._holders() if first else []
        if first:
            self._originals = dict(holders[0][1]) if holders else {}
        written: list[str] = []
        for key, (value, strict) in ARP_SETTINGS.items():
            try:
                current = self._read(key)
                if first and not holders:
                    self._originals[key] = None if current in strict else current
                if current not in strict:
                    self._write(key, value)
                    written.append(key)
            except (OSError, ValueError) as exc:
                if key not in self._warned:
                    self._warned.add(key)
                    log.warning("cannot set net.ipv4.conf.all.%s=%d: %s; the node may answer"
                                " ARP for service VIPs", key, value, exc)
                if first and not holders:
                    self._originals.setdefault(key, None)
        if first:
            self._originals = {k: self._originals.get(k) for k in ARP_SETTINGS}
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_NONBLOCK)
            try:
                s.bind("\0" + self._name_text())
            except BaseException:
                s.close()
                raise
            self._name = s
        return tuple(written)

    def _restore_arp(self) -> tuple[str, ...]:
        """Put back each original kpx replaced, unless someone changed it after kpx did."""
        restored: list[str] = []
        for key, (value, _strict) in ARP_SETTINGS.items():
            original = self._originals.get(key)
            if original is None:
                continue
            try:
                current = self._read(key)
                if current != value:
                    log.info("net.ipv4.conf.all.%s is %d, not kpx's %d: left as it is",
                             key, current, value)
                    continue
                self._write(key, original)
                restored.append(f"{key}={original}")
            except (OSError, ValueError) as exc:
                log.warning("cannot restore net.ipv4.conf.all.%s=%d: %s", key, original, exc)
        return tuple(restored)

    def _release(self) -> None:
        """Done with VIPs: the originals go with the name (whoever still holds one has them)."""
        self._installed6 = False
        if self._name is not None:
            self._name.close()
            self._name = None
        self._originals = {}
        self.wanted = frozenset()
        self._rules = self._script = None
        self._known = None

    def _read(self, key: str) -> int:
        return int((self.sysctl_dir / key).read_text().strip())

    def _write(self, key: str, value: int) -> None:
        (self.sysctl_dir / key).write_text(f"{value}\n")

    def close(self) -> None:
        """Stop holding the originals without removing anything (tests; a failed start)."""
        self._release()


def _with_arp(changes: VIPChanges, arp: tuple[str, ...]) -> VIPChanges:
    return VIPChanges(changes.added, changes.removed, changes.foreign, arp, changes.rules)


class VIPGuard:
    """Re-checks every sync period that the node still has kpx's VIP routes and ARP settings.

    The same contract as ``ReturnPathGuard``: what kpx installs, it owns and
    re-checks. A route deleted outside kpx is put back, counted
    (``kubeproxy_kpx_vip_repairs_total{part}``) and logged; while a check
    fails, ``ProxyHealth`` carries a fault, so health answers 503. Only the
    namespace's owner runs one; it is cancelled at SIGTERM. The IPv6 VIPs'
    guard's fault is IPv6's only (``ProxyHealth`` family faults), as the
    IPv6 return path's is: IPv4 VIPs still work.
    """

    FAULT = "service-vips"

    def __init__(self, vips: LocalVIPs, health: ProxyHealth, period: float) -> None:
        self.vips = vips
        self.health = health
        self.period = period
        self.version = vips.family
        """4 or 6: the family of the VIPs it guards."""
        self.family: str | None = "IPv6" if vips.family == 6 else None

    async def check(self) -> VIPChanges:
        try:
            changes = await self.vips.ensure_async()
        except Exception as exc:  # cannot vouch for the VIPs: health says so
            why = str(exc) or type(exc).__name__
            if self.health.fault(self.FAULT, self.family) != why:
                log.error("IPv%d service VIPs broken and not restorable: %s",
                          self.version, why)
            self.health.set_fault(self.FAULT, why, self.family)
            return VIPChanges()
        if changes.added:
            metrics.VIP_REPAIRS.labels(part="route").inc(len(changes.added))
            log.warning("service VIPs: %d route(s) were missing (removed outside kpx); restored",
                        len(changes.added))
        if changes.arp:
            metrics.VIP_REPAIRS.labels(part="arp").inc()
        if changes.rules:
            metrics.VIP_REPAIRS.labels(part="rules").inc()
            log.warning("service VIPs: nft table %s %s was missing (removed outside kpx);"
                        " restored", _ip(self.version), self.vips.nft_table)
        if self.health.fault(self.FAULT, self.family) is not None:
            log.info("IPv%d service VIPs restored; healthy again", self.version)
            self.health.clear_fault(self.FAULT, self.family)
        return changes

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.period)
            await self.check()
