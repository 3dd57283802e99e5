"""nfqueue mode's IPv6 half, without a socket: the packet parser, the ip6 table, the tables.

Packets are built here field by field (``ip6``, ``ext``), not with the
module's own code, so a wrong offset in ``netlink.flow6`` cannot agree with
itself; one is built by scapy as well. The ip6 table's text is checked for
what differs from the IPv4 one; ``test_dp_nfqueue_ipv6`` loads it into a
kernel. The dataplane's reader is driven by hand, as in
``test_nfqueue_dataplane``: a packet's IP version picks its family's plans.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import struct
import sys
from collections.abc import Iterator

import pytest

from proxy.core.decision import build_plans
from proxy.core.sync import SyncConfig, compute_sync, empty_result
from proxy.k8s import parse_state
from proxy.nfqueue import netlink, rules
from proxy.nfqueue.dataplane import NfqueueDataplane, Tables, served_for
from proxy.nfqueue.netlink import NF_ACCEPT, Flow, Packet, Verdict
from proxy.nfqueue.rules import MarkLayout, QueueConfig, Served
from tests.support.objects import endpoint, endpoint_slice, node, service, state_yaml

CLIENT6, NODE6 = "fd00:77:1::2", "fd00:77:1::1"
TCP, UDP = socket.IPPROTO_TCP, socket.IPPROTO_UDP
SYN_TCP = struct.pack("!HHIIBBHHH", 40000, 30080, 1, 0, 5 << 4, 0x02, 65535, 0, 0)
"""The first 20 bytes of a TCP SYN 40000 -> 30080."""


def ip6(nxt: int, rest: bytes, src: str = CLIENT6, dst: str = NODE6) -> bytes:
    """A fixed IPv6 header (version 6, payload length, next header, hop limit 64), then ``rest``."""
    return struct.pack("!IHBB16s16s", 0x6000_0000, len(rest), nxt, 64,
                       socket.inet_pton(socket.AF_INET6, src),
                       socket.inet_pton(socket.AF_INET6, dst)) + rest


def ext(nxt: int, units8: int) -> bytes:
    """A Hop-by-Hop/Routing/Destination Options header of ``(units8 + 1) * 8`` bytes (PadN)."""
    size = (units8 + 1) * 8
    return bytes([nxt, units8, 1, size - 4]) + bytes(size - 4)


def fragment(nxt: int, offset: int, more: bool) -> bytes:
    return struct.pack("!BBHI", nxt, 0, (offset << 3) | int(more), 0x1234)


def flow(payload: bytes) -> tuple[str, str, int, int, int, int]:
    return tuple(netlink.flow(payload))  # type: ignore[return-value]


# -- the parser ---------------------------------------------------------------------------------

def test_a_plain_ipv6_syn() -> None:
    assert netlink.flow(ip6(TCP, SYN_TCP)) == Flow(CLIENT6, NODE6, TCP, 40000, 30080, 6)


def test_the_addresses_are_rfc_5952_text_as_the_model_spells_them() -> None:
    f = netlink.flow(ip6(TCP, SYN_TCP, src="FD00:0:0:0:0:0:0:2", dst="fd00:0077:0001::0001"))
    assert (f.src, f.dst) == ("fd00::2", "fd00:77:1::1")


def test_the_ports_are_read_behind_a_chain_of_extension_headers() -> None:
    """Hop-by-Hop (8), Destination Options (16), Routing (24), then TCP: lengths in 8-octet
    units past the first 8, each naming the next."""
    chain = ext(60, 0) + ext(43, 1) + ext(TCP, 2) + SYN_TCP
    assert flow(ip6(0, chain)) == (CLIENT6, NODE6, TCP, 40000, 30080, 6)


def test_an_authentication_header_counts_in_4_octet_units() -> None:
    ah = bytes([UDP, 4]) + bytes(22)  # (4 + 2) * 4 = 24 bytes
    udp = struct.pack("!HHHH", 5353, 53, 8, 0)
    assert flow(ip6(51, ah + udp)) == (CLIENT6, NODE6, UDP, 5353, 53, 6)


def test_a_first_fragment_has_its_ports_and_a_later_one_is_refused() -> None:
    assert netlink.flow(ip6(44, fragment(TCP, 0, True) + SYN_TCP)).dport == 30080
    with pytest.raises(ValueError, match="non-first fragment"):
        netlink.flow(ip6(44, fragment(TCP, 185, False) + SYN_TCP))


def test_a_protocol_without_ports_ends_the_walk_with_none() -> None:
    assert flow(ip6(58, bytes(8))) == (CLIENT6, NODE6, 58, 0, 0, 6)  # ICMPv6
    assert flow(ip6(0, ext(59, 0))) == (CLIENT6, NODE6, 59, 0, 0, 6)  # No Next Header
    assert flow(ip6(50, bytes(16))) == (CLIENT6, NODE6, 50, 0, 0, 6)  # ESP: opaque


@pytest.mark.parametrize(("payload", "why"), [
    (ip6(TCP, SYN_TCP)[:39], "less than a header"),
    (ip6(TCP, SYN_TCP)[:42], "the ports end at 44"),
    (ip6(0, ext(TCP, 1) + SYN_TCP)[:44], "extension header 0 at 40 is cut off"),
    (ip6(0, ext(TCP, 3) + SYN_TCP)[:70], "the ports end at 76"),
    (ip6(0, ext(0, 0) * 9 + ext(TCP, 0) + SYN_TCP), "more than 8 extension headers"),
    (b"\x70" + ip6(TCP, SYN_TCP)[1:], "version 7"),
], ids=["short-header", "short-ports", "cut-extension", "ports-past-extension",
        "too-many-extensions", "version-7"])
def test_what_cannot_be_read_safely_is_refused(payload: bytes, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        netlink.flow(payload)


def test_a_packet_scapy_builds_reads_the_same() -> None:
    from scapy.layers.inet import TCP as ScapyTCP
    from scapy.layers.inet6 import IPv6, IPv6ExtHdrDestOpt, IPv6ExtHdrHopByHop

    pkt = (IPv6(src=CLIENT6, dst=NODE6) / IPv6ExtHdrHopByHop() / IPv6ExtHdrDestOpt()
           / ScapyTCP(sport=40001, dport=30081, flags="S", options=[("MSS", 1440)]))
    assert netlink.flow(bytes(pkt)) == Flow(CLIENT6, NODE6, TCP, 40001, 30081, 6)


def test_the_default_copy_range_holds_a_syn_behind_extension_headers() -> None:
    syn = ip6(0, ext(60, 0) + ext(TCP, 2) + SYN_TCP + bytes(20))  # 20 bytes of TCP options
    assert netlink.flow(syn[:netlink.DEFAULT_COPY_RANGE]).dport == 30080


@pytest.mark.skipif(sys.byteorder != "little", reason="netlink is host order")
def test_the_family_bind_names_the_family_in_both_places() -> None:
    msg = netlink.config_pf_bind(socket.AF_INET6, seq=9)
    assert msg == bytes.fromhex(
        "1c000000" "0203" "0500" "09000000" "00000000"  # len 28, CONFIG, REQUEST|ACK, seq 9
        "0a" "00" "0000"  # nfgenmsg: AF_INET6, version 0, queue 0
        "0800" "0100" "03" "00" "000a"  # NFQA_CFG_CMD: PF_BIND, pad, pf AF_INET6 big-endian
    )


# -- the ip6 table -------------------------------------------------------------------------------

SERVED6 = Served(ports=frozenset({30080}), pairs=frozenset({("fd00:96::10", 80)}),
                 targets={(None, "tcp", 30080): {1: ("fd00:1::2", 8080)},
                          ("fd00:96::10", "tcp", 80): {1: ("fd00:1::2", 8080)}},
                 vips=frozenset({"fd00:96::10"}), udp_pairs=frozenset({("fd00:96::10", 53)}))


def test_the_ip6_table_is_the_ip_one_over_ipv6() -> None:
    script = rules.nft_script(QueueConfig(), SERVED6, "xt", 6)
    assert script.startswith("table ip6 kpx_nfq\ndelete table ip6 kpx_nfq\n")
    assert "ip daddr" not in script and "ipv4_addr" not in script and "dnat ip to" not in script
    assert "set pairs { type ipv6_addr . inet_service; elements = { fd00:96::10 . 80 }; }" in script
    assert "0x00010000 . tcp . 30080 : fd00:1::2 . 8080" in script
    assert "0x00010000 . fd00:96::10 . tcp . 80 : fd00:1::2 . 8080" in script
    assert script.count("dnat ip6 to") == 4
    assert script.count("reject with icmpv6 type port-unreachable") == 4
    # Before the NodePort lines of both hooks: ::1 is never a NodePort.
    for hook in ("prerouting", "output"):
        chain = script.split(f"chain mark_{hook}")[1]
        assert chain.index("ip6 daddr ::1 return") < chain.index("tcp dport @ports")
    assert "::1" not in rules.nft_script(QueueConfig(), Served(), "xt", 4)


def test_an_address_of_the_other_family_is_refused_by_name() -> None:
    bad = Served(pairs=frozenset({("10.96.0.10", 80)}))
    with pytest.raises(ValueError, match=r"'10\.96\.0\.10': not an IPv6 address"):
        rules.nft_script(QueueConfig(), bad, "xt", 6)
    with pytest.raises(ValueError, match="'fd00::1': not an IPv4 address"):
        rules.nft_script(QueueConfig(), Served(vips=frozenset({"fd00::1"})), "xt", 4)
    with pytest.raises(ValueError, match="IP family 5"):
        rules.remove_script("t", 5)


def test_a_change_to_the_ip6_table_is_written_to_the_ip6_table() -> None:
    delta = rules.update_script("kpx_nfq", Served(), SERVED6, MarkLayout(), 6)
    assert delta and all(ln.startswith("add element ip6 kpx_nfq ")
                         for ln in delta.splitlines())
    assert rules.iptables_argv("-A", ["OUTPUT"], 6)[0] == "ip6tables"


# -- the dataplane: one queue, two families -------------------------------------------------

class Sent:
    """What ``_answer`` uses of a queue socket: it only sends."""

    def __init__(self) -> None:
        self.sent: list[Verdict] = []

    def send_verdicts(self, verdicts: list[Verdict]) -> None:
        self.sent.extend(verdicts)


@pytest.fixture
def dataplane() -> Iterator[NfqueueDataplane]:
    loop = asyncio.new_event_loop()
    yield NfqueueDataplane(loop=loop)
    loop.close()


def syn4(dport: int, src: str, dst: str) -> bytes:
    return struct.pack("!BBHHHBBH4s4s", 0x45, 0, 40, 1, 0, 64, TCP, 0,
                       socket.inet_aton(src), socket.inet_aton(dst)) + SYN_TCP[:2] + \
        struct.pack("!H", dport) + SYN_TCP[4:]


def test_each_packet_is_decided_by_its_own_familys_plans(dataplane: NfqueueDataplane) -> None:
    """The same nodePort in both families, each with its own endpoints and its own slots:
    an IPv6 SYN gets the IPv6 endpoint's slot in the ip6 table, an IPv4 one the IPv4's."""
    dp = dataplane
    snap = parse_state(state_yaml(
        node("node-a", "10.77.1.1", NODE6),
        service(cluster_ip="10.96.0.10", ipFamilyPolicy="PreferDualStack",
                ipFamilies=["IPv4", "IPv6"], clusterIPs=["10.96.0.10", "fd00:96::10"]),
        endpoint_slice("web", endpoint("10.1.0.2", "node-a"), endpoint("10.1.0.3", "node-a"),
                       name="web-v4"),
        endpoint_slice("web", endpoint("fd00:1::2", "node-a"), name="web-v6",
                       address_type="IPv6"),
    ))
    sync = compute_sync(snap, SyncConfig(node_name="node-a", vips=True))
    assert sync.ipv6 is not None
    t4 = dp._tabulate(sync.plans, sync.listen_hosts, sync.udp_plans, 4)
    t6 = dp._tabulate(sync.ipv6.plans, sync.ipv6.listen_hosts, sync.ipv6.udp_plans, 6)
    assert t6.served.ports == {30080} and ("fd00:96::10", 80) in t6.served.pairs
    assert t6.served.targets[(None, "tcp", 30080)] == {1: ("fd00:1::2", 8080)}
    dp.local_addresses = frozenset({"10.77.1.1", NODE6})
    q = Sent()
    packets = [Packet(1, 0, ip6(TCP, SYN_TCP)),
               Packet(2, 0, ip6(TCP, SYN_TCP, dst="fd00:96::10")[:40] + SYN_TCP[:2]
                      + struct.pack("!H", 80) + SYN_TCP[4:])]
    packets += [Packet(3 + i, 0, syn4(30080, f"192.0.2.{i + 1}", "10.77.1.1")) for i in range(4)]
    dp._answer(q, packets, Tables(t4, t6))  # type: ignore[arg-type]
    lay = dp.cfg.layout
    # Slot 1 of the IPv6 NodePort and of the IPv6 ClusterIP: fd00:1::2; an outside client
    # of a ClusterIP is masqueraded, of a NodePort with a local endpoint not.
    assert q.sent[:2] == [Verdict(1, NF_ACCEPT, lay.forward(1)),
                          Verdict(2, NF_ACCEPT, lay.forward(1, masquerade=True))]
    # IPv4 clients are balanced over the two IPv4 endpoints, slots 1 and 2 of the ip table.
    assert {v.mark for v in q.sent[2:]} <= {lay.forward(1), lay.forward(2)}
    assert sorted(k[0] for k in dp._balancers) == [4, 6]  # one balancer per family
    # An IPv6 SYN with only the IPv4 table in force is served by neither: refused.
    q2 = Sent()
    dp._answer(q2, [Packet(9, 0, ip6(TCP, SYN_TCP))], Tables(t4))  # type: ignore[arg-type]
    assert q2.sent == [Verdict(9, NF_ACCEPT, lay.reject)]


def test_nodeport_addresses_of_ipv6_narrow_the_ip6_table_to_those_addresses() -> None:
    snap = parse_state(state_yaml(
        node("node-a", "10.77.1.1", NODE6, "fd00:99::1"),
        service(cluster_ip="10.96.0.10", ipFamilyPolicy="PreferDualStack",
                ipFamilies=["IPv4", "IPv6"], clusterIPs=["10.96.0.10", "fd00:96::10"]),
        endpoint_slice("web", endpoint("fd00:1::2", "node-a"), address_type="IPv6"),
    ))
    every = compute_sync(snap, SyncConfig(node_name="node-a")).ipv6
    assert every is not None and every.listen_hosts == ("::",)
    assert served_for(every.plans, every.listen_hosts, {}).ports == {30080}
    cidrs = (ipaddress.ip_network("fd00:77::/32"), ipaddress.ip_network("10.0.0.0/8"))
    narrow = compute_sync(snap, SyncConfig(node_name="node-a", nodeport_cidrs=cidrs)).ipv6
    assert narrow is not None
    served = served_for(narrow.plans, narrow.listen_hosts, {})
    assert served.ports == set() and served.pairs == {(NODE6, 30080)}
    assert "fd00:77:1::1 . 30080" in rules.nft_script(QueueConfig(), served, "xt", 6)


def test_an_ipv4_only_node_gives_the_ipv6_table_nothing(dataplane: NfqueueDataplane) -> None:
    dp = dataplane
    snap = parse_state(state_yaml(node("node-a", "10.77.1.1"), service(),
                                  endpoint_slice("web", endpoint("10.1.0.2", "node-a"))))
    sync = compute_sync(snap, SyncConfig(node_name="node-a"))
    assert sync.ipv6 is None
    dp._task = asyncio.Future(loop=dp.loop)  # no writer started: only the request is looked at
    dp.apply(sync)
    wanted = dp._wanted
    assert wanted is not None
    assert wanted.v6.plans == {} and wanted.v6.hosts == () and wanted.v6.udp_plans == {}
    assert 30080 in wanted.v4.plans
    assert build_plans(snap, "node-a", family=6) == {}


def test_each_familys_result_sets_its_own_half_as_the_proxier_fans_them_out(
        dataplane: NfqueueDataplane) -> None:
    """Registered as both ``dataplane`` and ``dataplane6``: the IPv4 result (whose ``ipv6``
    it also reads) and then the IPv6 one; an IPv6 result alone leaves the IPv4 half."""
    dp = dataplane
    snap = parse_state(state_yaml(
        node("node-a", "10.77.1.1", NODE6),
        service(cluster_ip="10.96.0.10", ipFamilyPolicy="PreferDualStack",
                ipFamilies=["IPv4", "IPv6"], clusterIPs=["10.96.0.10", "fd00:96::10"]),
        endpoint_slice("web", endpoint("10.1.0.2", "node-a"), name="web-v4"),
        endpoint_slice("web", endpoint("fd00:1::2", "node-a"), name="web-v6",
                       address_type="IPv6"),
    ))
    sync = compute_sync(snap, SyncConfig(node_name="node-a"))
    assert sync.ipv6 is not None
    dp._task = asyncio.Future(loop=dp.loop)  # no writer started: only the request is looked at
    dp.apply(sync)
    dp.apply(sync.ipv6)
    wanted = dp._wanted
    assert wanted is not None and wanted.generation == sync.generation
    assert wanted.v4.plans is sync.plans and wanted.v6.plans is sync.ipv6.plans
    assert wanted.v6.hosts == ("::",)
    assert dp.local_addresses == {"10.77.1.1", NODE6}
    gone = empty_result(sync.generation + 1, 6)
    dp.apply(gone)
    assert dp._wanted is not None and dp._wanted.v4.plans is sync.plans
    assert dp._wanted.v6.plans == {} and dp.local_addresses == {"10.77.1.1"}
