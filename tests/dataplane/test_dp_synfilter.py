"""The SYN-drop program: its exact bytes, its meaning, and attach/detach.

The kernel behaviour (a dropped SYN gets no answer on the wire) is proven in
test_dp_netns.py; here the program is checked without any traffic.
"""

from __future__ import annotations

import socket
import struct

import pytest

from proxy.userspace import synfilter
from proxy.userspace.synfilter import run_program, syn_drop_program

SYN, ACK, RST, FIN, PSH = 0x02, 0x10, 0x04, 0x01, 0x08


def test_program_bytes_golden() -> None:
    prog = syn_drop_program(["10.0.0.1", "192.168.1.7"])
    raw = synfilter.program_bytes(prog)
    words = [struct.unpack("HBBI", raw[i : i + 8]) for i in range(0, len(raw), 8)]
    assert words == [
        (0x20, 0, 0, 0xFFF0000C),  # ld [SKF_NET_OFF + 12]: IPv4 source
        (0x15, 6, 0, 0x0A000001),  # jeq 10.0.0.1 -> accept
        (0x15, 5, 0, 0xC0A80107),  # jeq 192.168.1.7 -> accept
        (0x54, 0, 0, 0xFF000000),  # and #0xff000000
        (0x15, 3, 0, 0x7F000000),  # jeq 127.0.0.0/8 -> accept
        (0x30, 0, 0, 13),  # ldb [13]: TCP flags
        (0x54, 0, 0, 0x12),  # and #SYN|ACK
        (0x15, 1, 0, 0x02),  # jeq #SYN -> drop
        (0x06, 0, 0, 0xFFFFFFFF),  # accept
        (0x06, 0, 0, 0),  # drop
    ]


def test_program_without_addresses_is_the_spec_filter_plus_loopback() -> None:
    prog = syn_drop_program([])
    assert prog[-5:] == [
        (0x30, 0, 0, 13), (0x54, 0, 0, 0x12), (0x15, 1, 0, 0x02),
        (0x06, 0, 0, 0xFFFFFFFF), (0x06, 0, 0, 0),
    ]


@pytest.mark.parametrize(
    ("src", "flags", "accepted"),
    [
        ("203.0.113.9", SYN, False),  # external pure SYN: dropped
        ("203.0.113.9", SYN | ACK, True),  # not a pure SYN
        ("203.0.113.9", ACK, True),  # the handshake's final ACK must pass
        ("203.0.113.9", ACK | PSH, True),  # data on an accepted child
        ("203.0.113.9", FIN | ACK, True),
        ("203.0.113.9", RST, True),
        ("203.0.113.9", SYN | 0x40 | 0x80, False),  # SYN with ECE|CWR (ECN setup)
        ("10.0.0.1", SYN, True),  # the node's own address: Cluster semantics
        ("192.168.1.7", SYN, True),
        ("127.0.0.1", SYN, True),
        ("127.9.9.9", SYN, True),
        ("10.0.0.2", SYN, False),  # a neighbour is external
    ],
)
def test_program_meaning(src: str, flags: int, accepted: bool) -> None:
    prog = syn_drop_program(["10.0.0.1", "192.168.1.7"])
    assert run_program(prog, src, flags) is accepted


def test_ipv6_and_duplicates_ignored() -> None:
    assert syn_drop_program(["10.0.0.1", "fd00::1", "10.0.0.1"]) == syn_drop_program(["10.0.0.1"])


def test_too_many_addresses_refused() -> None:
    addrs = [f"10.1.{i // 256}.{i % 256}" for i in range(synfilter.MAX_ADDRESSES + 1)]
    with pytest.raises(ValueError, match="at most"):
        syn_drop_program(addrs)
    # The largest allowed program still has reachable jumps.
    prog = syn_drop_program(addrs[:-1])
    assert all(jt <= 255 for _, jt, _, _ in prog)
    assert run_program(prog, addrs[0], SYN) and not run_program(prog, "10.9.9.9", SYN)


def test_attach_replace_detach_on_a_real_listener() -> None:
    s = socket.socket()
    try:
        s.bind(("127.0.0.1", 0))
        synfilter.detach(s)  # nothing attached: a no-op, not ENOENT
        synfilter.attach(s, syn_drop_program(["10.0.0.1"]))
        synfilter.attach(s, syn_drop_program(["10.0.0.2"]))  # atomic replace
        s.listen()
        # Loopback sources pass the filter: the listener still serves.
        c = socket.create_connection(s.getsockname(), timeout=2)
        c.close()
        synfilter.detach(s)
        synfilter.detach(s)
    finally:
        s.close()


def test_cluster_cidr_sources_pass_the_drop_filter() -> None:
    """With --cluster-cidr, pod SYNs get Cluster semantics, so they must not be dropped."""
    import ipaddress

    from proxy.userspace.synfilter import TCP_SYN, run_program, syn_drop_program

    prog = syn_drop_program(["10.77.0.12"], [ipaddress.ip_network("10.244.0.0/16")])
    assert run_program(prog, "10.244.3.7", TCP_SYN)       # a pod on any node
    assert run_program(prog, "10.77.0.12", TCP_SYN)       # the node itself
    assert run_program(prog, "127.0.0.1", TCP_SYN)        # localhost
    assert not run_program(prog, "10.79.0.100", TCP_SYN)  # an external client
    assert not run_program(prog, "10.245.0.1", TCP_SYN)   # just outside the CIDR
    assert syn_drop_program(["10.77.0.12"]) == syn_drop_program(["10.77.0.12"], [])


# -- IPv6 ---------------------------------------------------------------------------


def test_ipv6_program_reads_the_source_at_net_offset_8() -> None:
    """An IPv6 listener's filter: the node's IPv6 addresses and ::1 pass, others' SYNs drop."""
    from proxy.userspace.synfilter import (
        SKF_NET_OFF,
        TCP_ACK,
        TCP_SYN,
        run_program,
        syn_drop_program,
    )

    prog = syn_drop_program(["fd77:1::1", "10.0.0.1", "2001:db8::7"], family=6)
    loads = {k for code, _, _, k in prog if code == 0x20}
    # Four 32-bit loads of the 16-byte source at SKF_NET_OFF + 8, nothing else.
    assert loads == {(SKF_NET_OFF + 8 + 4 * i) & 0xFFFFFFFF for i in range(4)}
    for src, passes in [("fd77:1::1", True), ("2001:db8::7", True), ("::1", True),
                        ("fd77:1::2", False), ("fd77:1:0:0:1::1", False), ("2001:db8::", False),
                        ("::2", False), ("fe80::1", False)]:
        assert run_program(prog, src, TCP_SYN) is passes, src
        assert run_program(prog, src, TCP_SYN | TCP_ACK)  # a handshake's ACK always passes
        assert run_program(prog, src, TCP_ACK)
    # The IPv4 address given is not in it: an IPv6 listener never sees IPv4.
    assert prog == syn_drop_program(["fd77:1::1", "2001:db8::7"], family=6)


def test_ipv6_program_passes_pod_networks_by_prefix() -> None:
    import ipaddress

    from proxy.userspace.synfilter import TCP_SYN, run_program, syn_drop_program

    nets = [ipaddress.ip_network("fd00:244::/56"), ipaddress.ip_network("10.244.0.0/16"),
            ipaddress.ip_network("fd00:abc::/33")]
    prog = syn_drop_program(["fd77:1::1"], nets, family=6)
    assert run_program(prog, "fd00:244:0:ff::9", TCP_SYN)      # a pod, any node
    assert not run_program(prog, "fd00:244:0:100::9", TCP_SYN)  # just past the /56
    assert run_program(prog, "fd00:abc:7fff::1", TCP_SYN)     # the /33 ends inside word 2
    assert not run_program(prog, "fd00:abc:8000::1", TCP_SYN)
    assert not run_program(prog, "fd77:9::1", TCP_SYN)


def test_ipv6_program_size_is_bounded() -> None:
    from proxy.userspace.synfilter import syn_drop_program

    addrs = [f"fd77::{i:x}" for i in range(31)]
    assert len(syn_drop_program(addrs[:29], family=6)) < 255
    with pytest.raises(ValueError, match="IPv6"):
        syn_drop_program(addrs, family=6)


def test_ipv6_reuseport_steering_uses_the_source_low_word() -> None:
    import ipaddress

    from proxy.userspace.synfilter import program_result, reuseport_steering_program

    prog = reuseport_steering_program(4, family=6)
    assert program_result(prog, "fd77:1::7", 0x02) == 7 % 4
    assert program_result(prog, "fd77:1::1:6", 0x02) == 0x10006 % 4
    assert program_result(reuseport_steering_program(3), "10.0.0.5", 0x02) == int(
        ipaddress.IPv4Address("10.0.0.5")) % 3


def test_ipv6_filter_attaches_to_an_ipv6_socket() -> None:
    with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
        synfilter.attach(s, syn_drop_program(["fd77:1::1"], family=6))
        synfilter.detach(s)
