"""The ctnetlink codec (``proxy.nfqueue.ctnetlink``) on messages built here, byte by byte.

The kernel's own answers are checked in tests/dataplane/test_dp_ctnetlink.py;
here, the shapes a kernel may send that one run cannot show: a tuple with a
zone (off the fast layout), an ICMP entry (no ports), a message cut short, an
error, and several messages in one buffer.
"""

from __future__ import annotations

import socket
import struct

from proxy.nfqueue import ctnetlink as ct
from proxy.nfqueue.netlink import attr
from proxy.util.nlmsg import NLMSG_DONE, NLMSG_ERROR

ENTRY = (ct.NFNL_SUBSYS_CTNETLINK << 8) | ct.IPCTNL_MSG_CT_NEW


def nested(kind: int, *parts: bytes) -> bytes:
    return attr(kind | ct.NLA_F_NESTED, b"".join(parts))


def tuple_attr(kind: int, family: int, src: str, dst: str, proto: int,
               ports: tuple[int, int] | None = None, zone: int | None = None) -> bytes:
    v6 = family == socket.AF_INET6
    ip = nested(ct.CTA_TUPLE_IP,
                attr(ct.CTA_IP_V6_SRC if v6 else ct.CTA_IP_V4_SRC, socket.inet_pton(family, src)),
                attr(ct.CTA_IP_V6_DST if v6 else ct.CTA_IP_V4_DST, socket.inet_pton(family, dst)))
    l4 = [attr(ct.CTA_PROTO_NUM, bytes([proto]))]
    if ports is not None:
        l4 += [attr(ct.CTA_PROTO_SRC_PORT, struct.pack("!H", ports[0])),
               attr(ct.CTA_PROTO_DST_PORT, struct.pack("!H", ports[1]))]
    parts = [ip, nested(ct.CTA_TUPLE_PROTO, *l4)]
    if zone is not None:
        parts.append(attr(3, struct.pack("!H", zone)))  # CTA_TUPLE_ZONE
    return nested(kind, *parts)


def entry(family: int, orig: bytes, reply: bytes, status: int, tcp_state: int | None = None
          ) -> bytes:
    body = orig + reply + attr(ct.CTA_STATUS, struct.pack("!I", status))
    body += attr(7, struct.pack("!I", 120))  # CTA_TIMEOUT: skipped
    if tcp_state is not None:
        body += nested(ct.CTA_PROTOINFO, nested(ct.CTA_PROTOINFO_TCP, attr(
            ct.CTA_PROTOINFO_TCP_STATE, bytes([tcp_state]))))
    head = struct.pack("=BBH", family, 0, 0)
    return struct.pack("=IHHII", 20 + len(body), ENTRY, 2, 1, 0) + head + body


def control(kind: int, error: int = 0) -> bytes:
    body = struct.pack("=i", -error) + b"\0" * 16 if kind == NLMSG_ERROR else struct.pack("=i", 0)
    return struct.pack("=IHHII", 16 + len(body), kind, 2, 1, 0) + body


def parse(buf: bytes) -> tuple[list[ct.CtEntry], ct.DumpEnd]:
    out: list[ct.CtEntry] = []
    end = ct.parse(buf, len(buf), out)
    return out, end


V4 = socket.AF_INET
V6 = socket.AF_INET6
TCP_DNAT = entry(
    V4, tuple_attr(ct.CTA_TUPLE_ORIG, V4, "10.0.0.9", "192.168.0.2", 6, (40000, 30080)),
    tuple_attr(ct.CTA_TUPLE_REPLY, V4, "10.244.1.5", "10.0.0.9", 6, (8080, 40000)),
    0x1AE, tcp_state=3)


def test_tcp_and_udp_entries_of_both_families_in_one_buffer() -> None:
    udp6 = entry(V6, tuple_attr(ct.CTA_TUPLE_ORIG, V6, "fd00::9", "fd00::2", 17, (5353, 53)),
                 tuple_attr(ct.CTA_TUPLE_REPLY, V6, "fd00:244::5", "fd00::9", 17, (53, 5353)),
                 0x188)
    got, end = parse(TCP_DNAT + udp6 + control(NLMSG_DONE))
    assert end == ct.DumpEnd(True, 0)
    assert got == [
        ct.CtEntry(6, "10.0.0.9", 40000, "192.168.0.2", 30080, "10.244.1.5", 0x1AE, 3),
        ct.CtEntry(17, "fd00::9", 5353, "fd00::2", 53, "fd00:244::5", 0x188, None),
    ]


def test_entries_off_the_fast_layout_are_walked() -> None:
    zoned = entry(V4, tuple_attr(ct.CTA_TUPLE_ORIG, V4, "10.0.0.9", "10.0.0.2", 17, (1, 2),
                                 zone=7),
                  tuple_attr(ct.CTA_TUPLE_REPLY, V4, "10.0.0.2", "10.0.0.9", 17, (2, 1), zone=7), 8)
    echo = entry(V4, tuple_attr(ct.CTA_TUPLE_ORIG, V4, "10.0.0.9", "10.0.0.2", 1),
                 tuple_attr(ct.CTA_TUPLE_REPLY, V4, "10.0.0.2", "10.0.0.9", 1), 8)
    got, end = parse(zoned + echo)
    assert end == ct.DumpEnd(False, 0), "no DONE yet: the caller reads on"
    assert got == [ct.CtEntry(17, "10.0.0.9", 1, "10.0.0.2", 2, "10.0.0.2", 8, None),
                   ct.CtEntry(1, "10.0.0.9", 0, "10.0.0.2", 0, "10.0.0.2", 8, None)]


def test_a_message_cut_short_ends_the_buffer_and_an_error_ends_the_dump() -> None:
    got, end = parse(TCP_DNAT + TCP_DNAT[:40])
    assert len(got) == 1 and end == ct.DumpEnd(False, 0)
    got, end = parse(control(NLMSG_ERROR, 1))  # EPERM: no CAP_NET_ADMIN
    assert got == [] and end == ct.DumpEnd(True, 1)
    got, end = parse(control(NLMSG_ERROR, 0) + TCP_DNAT)  # an ack is no error
    assert len(got) == 1 and end == ct.DumpEnd(False, 0)


def test_a_dump_request_asks_the_kernel_to_filter() -> None:
    plain = ct.dump_request(V4)
    length, kind, flags = struct.unpack_from("=IHH", plain)
    assert (length, kind, flags) == (20, 0x101, 0x301)  # CT_GET, REQUEST | DUMP
    assert plain[16] == V4
    filtered = ct.dump_request(V6, proto=6, status=0x20, status_mask=0x20)
    assert filtered[16] == V6 and len(filtered) == struct.unpack_from("=I", filtered)[0]
    attrs = {}
    at = 20
    while at < len(filtered):
        size, kind = struct.unpack_from("=HH", filtered, at)
        attrs[kind & 0x3FFF] = filtered[at + 4:at + size]
        at += (size + 3) & ~3
    assert set(attrs) == {ct.CTA_FILTER, ct.CTA_TUPLE_ORIG, ct.CTA_STATUS, ct.CTA_STATUS_MASK}
    assert attrs[ct.CTA_STATUS] == attrs[ct.CTA_STATUS_MASK] == b"\0\0\0\x20"
    assert attrs[ct.CTA_FILTER][4:] == struct.pack("=I", ct.CTA_FILTER_FLAG_PROTO_NUM)
    assert bytes([6]) in attrs[ct.CTA_TUPLE_ORIG]
