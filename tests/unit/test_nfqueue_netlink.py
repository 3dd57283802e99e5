"""The NFQUEUE codec: exact bytes out, hand-built kernel buffers in, no socket.

Buffers are built here field by field (``_nlmsg``, ``_nla``), not with the
module's own builders, so a wrong constant or layout in ``proxy.nfqueue.
netlink`` cannot agree with itself. Byte-exact expectations are for the
little-endian hosts kpx runs on (netlink headers are in host order).
"""

from __future__ import annotations

import errno
import socket
import struct
import sys
from typing import Any

import pytest

from proxy.nfqueue import netlink
from proxy.nfqueue.netlink import Ack, Flow, Packet, QueueSocket

little_endian = pytest.mark.skipif(sys.byteorder != "little", reason="netlink is host order")

QUEUE = 7
# A SYN with the options a Linux client sends (MSS, SACK, timestamps, NOP, window scale), built
# with scapy, checksums valid: 10.77.1.2:40612 -> 10.77.1.1:30080; 20 bytes IPv4 + 40 TCP.
SYN = bytes.fromhex(
    "4500003c1c464000400607da0a4d01020a4d0101"
    "9ea475801234567800000000a002faf0b9a00000020405b40402080a000000010000000001030307"
)


def _nla(kind: int, value: bytes) -> bytes:
    n = 4 + len(value)
    return struct.pack("<HH", n, kind) + value + bytes(-n % 4)


def _nlmsg(kind: int, body: bytes, seq: int = 0, family: int = socket.AF_INET,
           res_id: int = QUEUE) -> bytes:
    nfgen = struct.pack("<BB", family, 0) + struct.pack(">H", res_id)
    return struct.pack("<IHHII", 16 + 4 + len(body), kind, 0, seq, 0) + nfgen + body


def _packet_msg(packet_id: int, payload: bytes, mark: int | None = None, hook: int = 0,
                extra: bytes = b"") -> bytes:
    body = _nla(1, struct.pack(">IHB", packet_id, 0x0800, hook))  # NFQA_PACKET_HDR
    body += extra
    if mark is not None:
        body += _nla(3, struct.pack(">I", mark))  # NFQA_MARK
    body += _nla(10, payload)  # NFQA_PAYLOAD
    return _nlmsg(0x0300, body)  # NFNL_SUBSYS_QUEUE << 8 | NFQNL_MSG_PACKET


def _error_msg(seq: int, err: int) -> bytes:
    request = struct.pack("<IHHII", 40, 0x0302, 5, seq, 0)
    msg = struct.pack("<i", -err) + request
    return struct.pack("<IHHII", 16 + len(msg), 2, 0x100, seq, 4242) + msg


def _buffer() -> bytes:
    """What one recv can hold: two packets (one with odd-length payload and extra attributes),
    an ack, a refused verdict, and a DONE that is skipped."""
    return b"".join([
        _packet_msg(1, SYN, mark=0x4000, hook=0),
        _nlmsg(3, b""),  # NLMSG_DONE
        _error_msg(2, 0),
        _packet_msg(2, SYN[:57], hook=3, extra=(
            _nla(5, struct.pack(">I", 2))  # NFQA_IFINDEX_INDEV
            + _nla(9, struct.pack(">H2x6s2x", 6, b"\x02\x00\x00\x00\x00\x01"))  # NFQA_HWADDR
            + _nla(0x4000 | 13, struct.pack(">I", 60)))),  # CAP_LEN, NET_BYTEORDER flag set
        _error_msg(77, errno.ENOENT),
    ])


# -- parsing -----------------------------------------------------------------------------------

@little_endian
def test_a_buffer_of_several_messages_parses_to_packets_and_acks() -> None:
    got = netlink.parse(_buffer())
    assert got.packets == [
        Packet(1, 0x4000, SYN, hook=0),
        Packet(2, 0, SYN[:57], hook=3),  # no NFQA_MARK: the kernel omits a zero mark
    ]
    assert got.acks == [Ack(2, 0), Ack(77, errno.ENOENT)]


@little_endian
def test_parse_reads_only_the_first_n_bytes_of_a_reused_buffer() -> None:
    one = _packet_msg(9, SYN)
    buf = bytearray(4096)
    buf[:len(one)] = one
    buf[len(one):len(one) + 8] = b"\xff" * 8  # an older, longer datagram's leftovers
    assert netlink.parse(buf, len(one)).packets == [Packet(9, 0, SYN)]


@little_endian
def test_attribute_padding_is_skipped_for_every_payload_length() -> None:
    for n in range(0, 9):
        msg = _packet_msg(5, SYN[:n], mark=1)
        assert len(msg) % 4 == 0
        assert netlink.parse(msg + _packet_msg(6, SYN)).packets == [
            Packet(5, 1, SYN[:n]), Packet(6, 0, SYN)]


@little_endian
def test_every_truncation_is_a_value_error_or_a_whole_prefix() -> None:
    buf = _buffer()
    whole = netlink.parse(buf)
    bounds: dict[int, int] = {}
    off = count = 0
    while off < len(buf):
        off += struct.unpack_from("<I", buf, off)[0]
        count += 1
        bounds[off] = count
    for cut in range(1, len(buf)):
        if cut in bounds:
            got = netlink.parse(buf[:cut])
            assert len(got.packets) + len(got.acks) <= len(whole.packets) + len(whole.acks)
            continue
        with pytest.raises(ValueError, match="netlink"):
            netlink.parse(buf[:cut])


@little_endian
@pytest.mark.parametrize(("bad", "why"), [
    (struct.pack("<IHHII", 8, 0x0300, 0, 0, 0), "says 8 bytes"),  # shorter than its header
    (_nlmsg(0x0300, struct.pack("<HH", 40, 1) + bytes(8)), "attribute at offset 20"),
    (_nlmsg(0x0300, struct.pack("<HH", 2, 1)), "attribute at offset 20 says 2"),
    (_nlmsg(0x0300, _nla(10, SYN)), "no packet header"),
    (_nlmsg(0x0300, _nla(1, b"\0\0\0\1")), "packet header at offset 20"),
    (_nlmsg(0x0300, _nla(1, bytes(7)) + _nla(3, b"\1")), "mark at offset"),
    (struct.pack("<IHHII", 20, 2, 0, 0, 0) + b"\0\0\0\0", "error message"),
], ids=["short-message", "long-attribute", "short-attribute", "no-packet-header",
        "short-packet-header", "short-mark", "short-error"])
def test_a_malformed_message_is_a_value_error(bad: bytes, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        netlink.parse(bad)


# -- the packet's first bytes --------------------------------------------------------------

def test_flow_of_a_real_syn() -> None:
    assert netlink.flow(SYN) == Flow("10.77.1.2", "10.77.1.1", socket.IPPROTO_TCP, 40612, 30080)


def test_flow_reads_the_ports_after_ip_options() -> None:
    opts = bytes([0x94, 4, 0, 0])  # Router Alert: IHL 6
    hdr = bytearray(SYN[:20])
    hdr[0] = 0x46
    assert netlink.flow(bytes(hdr) + opts + SYN[20:24]).dport == 30080


def test_flow_of_udp_and_of_a_protocol_without_ports() -> None:
    udp = bytearray(SYN[:20])
    udp[9] = socket.IPPROTO_UDP
    assert netlink.flow(bytes(udp) + struct.pack("!HHHH", 53, 5353, 8, 0)) == Flow(
        "10.77.1.2", "10.77.1.1", socket.IPPROTO_UDP, 53, 5353)
    icmp = bytearray(SYN[:20])
    icmp[9] = socket.IPPROTO_ICMP
    assert netlink.flow(bytes(icmp)) == Flow("10.77.1.2", "10.77.1.1", 1, 0, 0)


@pytest.mark.parametrize(("payload", "why"), [
    (SYN[:19], "less than a header"),
    (SYN[:22], "the ports end at 24"),
    (b"\x50" + SYN[1:], "version 5"),
    (b"\x44" + SYN[1:], "header length 16"),
    (b"", "empty"),
], ids=["short-header", "no-ports", "version-5", "short-ihl", "empty"])
def test_flow_refuses_what_is_not_a_whole_ipv4_header(payload: bytes, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        netlink.flow(payload)


# -- what goes to the kernel -------------------------------------------------------------------

@little_endian
def test_a_verdict_batch_of_two_is_these_exact_bytes() -> None:
    got = netlink.verdict_batch(QUEUE, [netlink.accept(0x01020304, 0x00011000), netlink.drop(5)])
    assert got == bytes.fromhex(
        # nlmsghdr: len 40, type 0x0301 (queue, VERDICT), flags REQUEST, seq = packet id, pid 0
        "28000000" "0103" "0100" "04030201" "00000000"
        # nfgenmsg: AF_UNSPEC, version 0, queue 7 big-endian
        "00" "00" "0007"
        # NFQA_VERDICT_HDR (len 12, type 2): NF_ACCEPT, packet id (big-endian)
        "0c00" "0200" "00000001" "01020304"
        # NFQA_MARK (len 8, type 3): the mark, big-endian
        "0800" "0300" "00011000"
        # the second message: len 32, no mark; NF_DROP for packet 5
        "20000000" "0103" "0100" "05000000" "00000000"
        "00" "00" "0007"
        "0c00" "0200" "00000000" "00000005"
    )


@little_endian
def test_config_messages_ask_for_an_ack_and_pad_their_attributes() -> None:
    assert netlink.config_bind(QUEUE, seq=3) == bytes.fromhex(
        "1c000000" "0203" "0500" "03000000" "00000000"  # len 28, CONFIG, REQUEST|ACK, seq 3
        "00" "00" "0007"
        "0800" "0100" "01" "00" "0002"  # NFQA_CFG_CMD: BIND, pad, pf AF_INET big-endian
    )
    params = netlink.config_params(QUEUE, 80, seq=4)
    assert params[20:] == bytes.fromhex("0900" "0200" "00000050" "02" "000000")  # 5 bytes + pad
    assert struct.unpack_from("<I", params)[0] == len(params) == 32
    flags = netlink.config_flags(QUEUE, netlink.NFQA_CFG_F_FAIL_OPEN,
                                 netlink.NFQA_CFG_F_FAIL_OPEN)
    assert flags[20:] == bytes.fromhex("0800" "0500" "00000001" "0800" "0400" "00000001")
    assert netlink.config_maxlen(QUEUE, 4096)[20:] == bytes.fromhex("0800" "0300" "00001000")


@little_endian
def test_a_verdict_round_trips_through_a_reader_of_its_fields() -> None:
    verdicts = [netlink.accept(i, None if i % 3 else i * 7) for i in range(1, 50)]
    buf = netlink.verdict_batch(0xFFFF, verdicts)
    back = []
    off = 0
    while off < len(buf):
        length, kind, _f, seq, _p = struct.unpack_from("<IHHII", buf, off)
        assert kind == 0x0301 and struct.unpack_from(">H", buf, off + 18)[0] == 0xFFFF
        verdict, pid = struct.unpack_from(">II", buf, off + 24)
        mark = struct.unpack_from(">I", buf, off + 36)[0] if length == 40 else None
        assert seq == pid
        back.append(netlink.Verdict(pid, verdict, mark))
        off += length
    assert back == verdicts
    assert netlink.parse(buf) == ([], [])  # valid framing; nothing a reader keeps


# -- the socket's handling of what recv says (no kernel: a stand-in socket) ----------------

class _FakeSock:
    def __init__(self, results: list[Any]) -> None:
        self.results = results
        self.sent: list[bytes] = []

    def recv_into(self, buf: bytearray, *args: Any) -> int:
        r = self.results.pop(0) if self.results else BlockingIOError()
        if isinstance(r, BaseException):
            raise r
        buf[:len(r)] = r
        return len(r)

    def send(self, data: bytes) -> int:
        self.sent.append(data)
        return len(data)


def _queue_with(results: list[Any]) -> tuple[QueueSocket, _FakeSock]:
    q = QueueSocket.__new__(QueueSocket)
    q.queue, q.enobufs, q.verdict_errors, q._seq, q._pending = QUEUE, 0, 0, 0, []
    q._buf = bytearray(netlink.RECV_SIZE)
    q._warn = netlink.RateLimitedLog(netlink.log)
    fake = _FakeSock(results)
    q._sock = fake  # type: ignore[assignment]
    return q, fake


@little_endian
def test_read_batch_carries_on_past_lost_messages_and_counts_refused_verdicts(
        caplog: pytest.LogCaptureFixture) -> None:
    q, _ = _queue_with([
        _packet_msg(1, SYN),
        OSError(errno.ENOBUFS, "No buffer space available"),
        _packet_msg(2, SYN) + _error_msg(9, errno.ENOENT),
        b"\x05\x00\x00\x00",  # garbage: skipped, logged
        _packet_msg(3, SYN),
    ])
    assert [p.packet_id for p in q.read_batch()] == [1, 2, 3]
    assert (q.enobufs, q.verdict_errors) == (1, 1)
    text = caplog.text
    assert "dropped queued packets" in text and "packet 9 refused" in text
    assert q.read_batch() == []  # EAGAIN: nothing, at once


@little_endian
def test_read_batch_stops_after_max_reads() -> None:
    q, fake = _queue_with([_packet_msg(i, SYN) for i in range(1, 11)])
    assert len(q.read_batch(max_reads=4)) == 4
    assert len(fake.results) == 6


def test_send_verdicts_is_one_datagram_up_to_the_limit() -> None:
    q, fake = _queue_with([])
    q.send_verdicts([])
    assert fake.sent == []
    q.send_verdicts([netlink.accept(i, 1) for i in range(1, 11)])
    assert len(fake.sent) == 1 and len(fake.sent[0]) == 400
    many = [netlink.accept(i, 1) for i in range(1, 4000)]
    q.send_verdicts(many)
    assert len(fake.sent) == 1 + -(-len(many) // (netlink.MAX_DATAGRAM // 40))
    assert all(len(d) <= netlink.MAX_DATAGRAM for d in fake.sent)
