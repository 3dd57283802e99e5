"""NFQUEUE over NETLINK_NETFILTER, spoken from Python: the codec and one queue socket.

Owns: the bytes of the ``nfnetlink_queue`` protocol (``linux/netfilter/
nfnetlink_queue.h``) that kpx needs, as pure functions over buffers: CONFIG
requests (bind a queue, copy range and mode, queue length, flags), the
parsing of a received buffer into queued packets and netlink acks, the
addresses and ports of an IPv4 or IPv6 packet's first bytes (an IPv6
packet's extension headers walked to the transport header), and VERDICT
messages,
many of which go to the kernel as one datagram. ``QueueSocket`` is the thin
shell around them: one netlink socket bound to one queue number.

Never: decide anything about a packet (the caller's decision picks the
verdict and its mark: ``proxy.nfqueue.rules`` says what a mark means), touch
netfilter rules, block the event loop (``read_batch`` and ``send_verdicts``
never wait; only the constructor waits, bounded, for its config acks), or
hold a packet: a packet read is the caller's to answer, and one never
answered stays in the kernel's queue until the socket closes (then it is
dropped, fail-closed, like everything queued to a queue nobody reads).

Why no libnetfilter_queue (or ctypes to it): the protocol is five message
shapes of fixed little structs, and speaking it directly costs nothing per
packet that the library would save. CPython's ``socket`` has ``AF_NETLINK``;
everything else is ``struct``, and the per-SYN work is a ``recv_into``, a
few ``unpack_from`` and one ``pack`` (``verdict_batch``).

The wire format, for a reader of the code below:

- every message is ``nlmsghdr`` (len, type, flags, seq, pid: host order),
  then ``nfgenmsg`` (family, version 0, queue number *big-endian*), then
  attributes: ``nlattr`` (len, type: host order) and a value padded to 4
  bytes. Attribute *values* of nfnetlink_queue are big-endian;
- a message's type is ``NFNL_SUBSYS_QUEUE << 8 | NFQNL_MSG_*``;
- the kernel answers a request that asks for it (``NLM_F_ACK``), and any
  request that fails, with ``NLMSG_ERROR`` carrying ``-errno`` (0: success)
  and the request's header, whose ``seq`` names the request;
- one ``recv`` may hold several messages, each starting at the previous
  one's length rounded up to 4; one ``send`` may hold several requests,
  which the kernel handles in order (``netlink_rcv_skb``).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import select
import socket
import struct
import time
from collections.abc import Iterable, Sequence
from typing import NamedTuple

from proxy.util.lograte import RateLimitedLog
from proxy.util.nlmsg import (
    NLM_F_ACK,
    NLM_F_REQUEST,
    NLMSG_ERROR,
    NLMSGERR,
    NLMSGHDR,
)

log = logging.getLogger(__name__)

NETLINK_NETFILTER = 12
NFNL_SUBSYS_QUEUE = 3

# nfnetlink_queue message types (the low byte of nlmsg_type).
NFQNL_MSG_PACKET = 0
NFQNL_MSG_VERDICT = 1
NFQNL_MSG_CONFIG = 2

# netlink (linux/netlink.h): the framing is proxy.util.nlmsg's; the rest is ours.
NLA_TYPE_MASK = 0x3FFF
"""An attribute's type without ``NLA_F_NESTED`` / ``NLA_F_NET_BYTEORDER``."""
SOL_NETLINK = 270
SO_RCVBUFFORCE = 33
"""Not in CPython's ``socket`` module (asm-generic/socket.h)."""
NETLINK_CAP_ACK = 10
"""An error ack carries the request's header only, not the whole request back."""

# Config attributes and their values.
NFQA_CFG_CMD = 1
NFQA_CFG_PARAMS = 2
NFQA_CFG_QUEUE_MAXLEN = 3
NFQA_CFG_MASK = 4
NFQA_CFG_FLAGS = 5
NFQNL_CFG_CMD_BIND = 1
NFQNL_CFG_CMD_UNBIND = 2
NFQNL_CFG_CMD_PF_BIND = 3
NFQNL_CFG_CMD_PF_UNBIND = 4
NFQNL_COPY_META = 1
NFQNL_COPY_PACKET = 2
NFQA_CFG_F_FAIL_OPEN = 0x1
"""Queue full (or the socket's buffer full): accept the packet instead of dropping it."""

# Packet and verdict attributes.
NFQA_PACKET_HDR = 1
NFQA_VERDICT_HDR = 2
NFQA_MARK = 3
NFQA_PAYLOAD = 10

NF_DROP = 0
NF_ACCEPT = 1

_NLMSGHDR = NLMSGHDR
_NFGENMSG = struct.Struct("=BBH")  # res_id is packed big-endian by hand (``_be16``)
_NLATTR = struct.Struct("=HH")
_NLMSGERR = NLMSGERR
_PACKET_HDR = struct.Struct("!IHB")  # packet_id, hw_protocol, hook (7 bytes, packed)
_BE32 = struct.Struct("!I")
_HDR_LEN = _NLMSGHDR.size + _NFGENMSG.size  # 20: where the attributes start

_VERDICT_TYPE = (NFNL_SUBSYS_QUEUE << 8) | NFQNL_MSG_VERDICT
_PACKET_TYPE = (NFNL_SUBSYS_QUEUE << 8) | NFQNL_MSG_PACKET
_CONFIG_TYPE = (NFNL_SUBSYS_QUEUE << 8) | NFQNL_MSG_CONFIG

# One verdict, as a struct: header, nfgenmsg, VERDICT_HDR attribute (12), MARK attribute (8).
_VERDICT_MARK = struct.Struct("=IHHIIBBHHHIIHHI")
_VERDICT_NOMARK = struct.Struct("=IHHIIBBHHHII")


_new = tuple.__new__
"""Makes a NamedTuple record in C, without its Python ``__new__``: the per-SYN path's."""
_ntoa = socket.inet_ntoa


def _align(n: int) -> int:
    return (n + 3) & ~3


def _be16(value: int) -> int:
    """``value`` as a host-order u16 whose bytes are its big-endian form (``htons``)."""
    return socket.htons(value & 0xFFFF)


# -- building requests -----------------------------------------------------------------

def attr(kind: int, value: bytes) -> bytes:
    """One netlink attribute: header, value, zero padding to a multiple of 4."""
    n = _NLATTR.size + len(value)
    return _NLATTR.pack(n, kind) + value + b"\0" * (-n % 4)


def message(kind: int, queue: int, body: bytes = b"", *, flags: int = NLM_F_REQUEST,
            seq: int = 0, family: int = socket.AF_UNSPEC) -> bytes:
    """One nfnetlink_queue message of type ``NFQNL_MSG_<kind>`` for ``queue``."""
    return (_NLMSGHDR.pack(_HDR_LEN + len(body), (NFNL_SUBSYS_QUEUE << 8) | kind, flags, seq, 0)
            + _NFGENMSG.pack(family, 0, _be16(queue)) + body)


def config_bind(queue: int, seq: int = 0, family: int = socket.AF_INET) -> bytes:
    """CONFIG CMD BIND: this socket receives what ``queue`` holds (of ``family``).

    The kernel refuses with EPERM if another socket has the queue, EBUSY if
    this one has it already. There is no unbinding someone else's queue: the
    kernel frees a queue when its socket closes, however its process ended.
    (``NFQNL_CFG_CMD_PF_BIND``, ``config_pf_bind``, is a no-op since Linux
    3.8; ``QueueSocket`` still sends it for both families first.)
    """
    return message(NFQNL_MSG_CONFIG, queue,
                   attr(NFQA_CFG_CMD, struct.pack("!BBH", NFQNL_CFG_CMD_BIND, 0, family)),
                   flags=NLM_F_REQUEST | NLM_F_ACK, seq=seq, family=socket.AF_UNSPEC)


def config_pf_bind(family: int, seq: int = 0) -> bytes:
    """CONFIG CMD PF_BIND: have the kernel queue packets of ``family`` to nfnetlink_queue.

    One socket bound to a queue receives every family queued to that number
    (an ``iptables`` and an ``ip6tables`` rule may both name it). Since
    Linux 3.8 this command is acknowledged and does nothing (the handler is
    registered for every family); before, IPv6 packets were not queued
    without it. kpx sends it for AF_INET and AF_INET6 ahead of the bind, as
    libnetfilter_queue's users do, so neither kind of kernel loses a family.
    """
    return message(NFQNL_MSG_CONFIG, 0,
                   attr(NFQA_CFG_CMD, struct.pack("!BBH", NFQNL_CFG_CMD_PF_BIND, 0, family)),
                   flags=NLM_F_REQUEST | NLM_F_ACK, seq=seq, family=family)


def config_unbind(queue: int, seq: int = 0) -> bytes:
    """CONFIG CMD UNBIND: give the queue back (ENODEV if nobody has it, EPERM if not ours)."""
    return message(NFQNL_MSG_CONFIG, queue,
                   attr(NFQA_CFG_CMD, struct.pack("!BBH", NFQNL_CFG_CMD_UNBIND, 0, 0)),
                   flags=NLM_F_REQUEST | NLM_F_ACK, seq=seq)


def config_params(queue: int, copy_range: int, seq: int = 0,
                  mode: int = NFQNL_COPY_PACKET) -> bytes:
    """CONFIG PARAMS: copy the first ``copy_range`` bytes of each packet to us.

    Until this is set a bound queue copies nothing and the kernel drops what
    it queues, so it goes right after the bind.
    """
    return message(NFQNL_MSG_CONFIG, queue,
                   attr(NFQA_CFG_PARAMS, struct.pack("!IB", copy_range, mode)),
                   flags=NLM_F_REQUEST | NLM_F_ACK, seq=seq)


def config_maxlen(queue: int, maxlen: int, seq: int = 0) -> bytes:
    """CONFIG QUEUE_MAXLEN: how many packets may wait for a verdict (the kernel's default: 1024)."""
    return message(NFQNL_MSG_CONFIG, queue, attr(NFQA_CFG_QUEUE_MAXLEN, _BE32.pack(maxlen)),
                   flags=NLM_F_REQUEST | NLM_F_ACK, seq=seq)


def config_flags(queue: int, flags: int, mask: int, seq: int = 0) -> bytes:
    """CONFIG FLAGS: set the ``NFQA_CFG_F_*`` bits of ``mask`` to their values in ``flags``."""
    return message(NFQNL_MSG_CONFIG, queue,
                   attr(NFQA_CFG_FLAGS, _BE32.pack(flags)) + attr(NFQA_CFG_MASK, _BE32.pack(mask)),
                   flags=NLM_F_REQUEST | NLM_F_ACK, seq=seq)


class Verdict(NamedTuple):
    """The answer for one queued packet: ``NF_ACCEPT`` or ``NF_DROP``, and the mark to set.

    ``mark`` None leaves the packet's mark as it is; an int *replaces* the
    whole mark (the kernel has no masked form), so the caller keeps other
    software's bits (``rules.MarkLayout.verdict_mark``).
    """

    packet_id: int
    verdict: int
    mark: int | None = None


def accept(packet_id: int, mark: int | None = None) -> Verdict:
    return Verdict(packet_id, NF_ACCEPT, mark)


def drop(packet_id: int) -> Verdict:
    return Verdict(packet_id, NF_DROP)


def verdict_batch(queue: int, verdicts: Iterable[Verdict]) -> bytes:
    """Many verdicts as one datagram: the messages back to back (each is a multiple of 4).

    Each is one VERDICT message, made by one ``struct.pack``; its ``seq`` is
    the packet id, so an error ack names the packet. Not
    ``NFQNL_MSG_VERDICT_BATCH``: that one gives *every* packet up to an id the
    same verdict and mark, and each SYN here has a mark of its own.
    """
    qid = _be16(queue)
    htonl, with_mark, without = socket.htonl, _VERDICT_MARK.pack, _VERDICT_NOMARK.pack
    out = []
    for pid, verdict, mark in verdicts:
        if mark is None:
            out.append(without(32, _VERDICT_TYPE, NLM_F_REQUEST, pid, 0, 0, 0, qid,
                               12, NFQA_VERDICT_HDR, htonl(verdict), htonl(pid)))
        else:
            out.append(with_mark(40, _VERDICT_TYPE, NLM_F_REQUEST, pid, 0, 0, 0, qid,
                                 12, NFQA_VERDICT_HDR, htonl(verdict), htonl(pid),
                                 8, NFQA_MARK, htonl(mark & 0xFFFFFFFF)))
    return b"".join(out)


# -- parsing what the kernel sends ------------------------------------------------------

class Packet(NamedTuple):
    """One queued packet: its id (to answer), its mark, its first bytes (from the IP header).

    ``mark`` is 0 when the packet had none: the kernel sends ``NFQA_MARK``
    only for a mark that is not zero, so its absence *is* zero. ``hook`` is
    the netfilter hook it was queued from (0 prerouting, 3 output).
    """

    packet_id: int
    mark: int
    payload: bytes
    hook: int = 0


class Ack(NamedTuple):
    """An ``NLMSG_ERROR``: ``error`` is 0 for a plain ack, else a positive errno."""

    seq: int
    error: int


class Received(NamedTuple):
    packets: list[Packet]
    acks: list[Ack]


def parse(buf: bytes | bytearray | memoryview, n: int | None = None) -> Received:
    """Every message in ``buf[:n]``: queued packets and acks; ValueError if it is malformed.

    Other messages (``NLMSG_DONE``, ``NLMSG_NOOP``, types of other
    subsystems) are skipped. A message or attribute that claims more bytes
    than there are, or fewer than its own header, is a ValueError naming the
    offset: the kernel never sends one, so it means the buffer was cut.

    This runs once per new connection, on a reader just woken, where every
    step costs several times what it costs in a loop (``docs/PERFORMANCE.md``):
    records are made by ``tuple.__new__``, not the NamedTuple's Python
    constructor.
    """
    view = memoryview(buf)
    end = len(view) if n is None else n
    packets: list[Packet] = []
    acks: list[Ack] = []
    header = _NLMSGHDR.unpack_from
    off = 0
    while off < end:
        if end - off < _NLMSGHDR.size:
            raise ValueError(f"netlink: {end - off} bytes at offset {off}, less than a header")
        length, kind, _flags, _seq, _pid = header(view, off)
        stop = off + length
        if length < _NLMSGHDR.size or stop > end:
            raise ValueError(f"netlink: message at offset {off} says {length} bytes,"
                             f" {end - off} left")
        if kind == _PACKET_TYPE:
            packets.append(_packet(view, off + _HDR_LEN, stop))
        elif kind == NLMSG_ERROR:
            if length < _NLMSGHDR.size + _NLMSGERR.size + _NLMSGHDR.size:
                raise ValueError(f"netlink: error message at offset {off} is {length} bytes")
            (err,) = _NLMSGERR.unpack_from(view, off + _NLMSGHDR.size)
            # The request's own header follows: its seq is the one we chose.
            req_seq = header(view, off + _NLMSGHDR.size + _NLMSGERR.size)[3]
            acks.append(Ack(req_seq, -err))
        off += _align(length)
    return _new(Received, (packets, acks))



def _packet(view: memoryview, start: int, end: int) -> Packet:
    if start > end:
        raise ValueError(f"netlink: packet message ends at {end}, inside its header")
    packet_id = -1
    hook = mark = 0
    payload = b""
    off = start
    while off < end:
        if end - off < _NLATTR.size:
            raise ValueError(f"netlink: {end - off} bytes at offset {off}, less than an attribute")
        alen, akind = _NLATTR.unpack_from(view, off)
        if alen < _NLATTR.size or off + alen > end:
            raise ValueError(f"netlink: attribute at offset {off} says {alen} bytes,"
                             f" {end - off} left")
        akind &= NLA_TYPE_MASK
        if akind == NFQA_PACKET_HDR:
            if alen < _NLATTR.size + _PACKET_HDR.size:
                raise ValueError(f"netlink: packet header at offset {off} is {alen} bytes")
            packet_id, _proto, hook = _PACKET_HDR.unpack_from(view, off + _NLATTR.size)
        elif akind == NFQA_MARK:
            if alen < _NLATTR.size + 4:
                raise ValueError(f"netlink: mark at offset {off} is {alen} bytes")
            (mark,) = _BE32.unpack_from(view, off + _NLATTR.size)
        elif akind == NFQA_PAYLOAD:
            payload = bytes(view[off + _NLATTR.size:off + alen])
        off += _align(alen)
    if packet_id < 0:
        raise ValueError(f"netlink: packet message at offset {start - _HDR_LEN}"
                         f" has no packet header")
    return _new(Packet, (packet_id, mark, payload, hook))

class Flow(NamedTuple):
    """What a decision needs of a packet: addresses (IPv4 or IPv6 text), protocol, ports
    (0 if none), and the IP version (4 or 6), which picks the family's plans."""

    src: str
    dst: str
    proto: int
    sport: int
    dport: int
    family: int = 4


_IPV4 = struct.Struct("!B8xB2x4s4s")
"""Version and IHL; (TOS, length, id, fragment, TTL); protocol; (checksum); source; destination."""
_IPV6 = struct.Struct("!B5xB1x16s16s")
"""Version (and traffic class); (the rest of it, flow label, payload length); next header;
(hop limit); source; destination: the fixed 40-byte header."""
_PORTS = struct.Struct("!HH")
_IPV4_PORTS = struct.Struct("!B8xB2x4s4sHH")
"""``_IPV4`` and the ports right after it: the usual packet (no IP options) in one unpack."""
_WITH_PORTS = (socket.IPPROTO_TCP, socket.IPPROTO_UDP, socket.IPPROTO_SCTP)

# IPv6 extension headers (RFC 8200 4.1, RFC 7045): the ones a transport header may follow.
_EXT_LEN8 = frozenset({0, 43, 60, 135, 139, 140})
"""Hop-by-Hop, Routing, Destination Options, Mobility, HIP, Shim6: next header, then
their length in 8-octet units not counting the first 8."""
_EXT_FRAGMENT = 44
_EXT_AH = 51
"""Authentication Header: its length is in 4-octet units, minus 2."""
_EXTENSIONS = _EXT_LEN8 | {_EXT_FRAGMENT, _EXT_AH}
MAX_EXTENSION_HEADERS = 8
"""More than this in one packet is refused: no legitimate SYN carries that many, and a
chain of them is a cheap way to make every queued packet expensive to read."""


def flow(payload: bytes | bytearray | memoryview) -> Flow:
    """The addresses, protocol and (TCP, UDP, SCTP) ports of an IPv4 or IPv6 packet's first
    bytes; ValueError when they cannot be read there (the caller drops the packet).

    IPv4: too short for its own header (and the ports, for a protocol that
    has them) is refused; a queue's copy range (``DEFAULT_COPY_RANGE``)
    always holds them (IPv4 header at most 60, ports the next 4). IPv6:
    ``flow6``.
    """
    if not payload:
        raise ValueError("IP: an empty packet")
    if payload[0] == 0x45 and len(payload) >= 24:
        # The usual IPv4 packet, without options: one unpack reads all of it.
        _, proto, src, dst, sport, dport = _IPV4_PORTS.unpack_from(payload)
        if proto not in _WITH_PORTS:
            sport = dport = 0
        return _new(Flow, (_ntoa(src), _ntoa(dst), proto, sport, dport, 4))
    version = payload[0] >> 4
    if version == 6:
        return flow6(payload)
    if len(payload) < 20:
        raise ValueError(f"IPv4: {len(payload)} bytes, less than a header")
    vihl, proto, src, dst = _IPV4.unpack_from(payload)
    if vihl >> 4 != 4:
        raise ValueError(f"IPv4: version {vihl >> 4}")
    ihl = (vihl & 0x0F) * 4
    if ihl < 20:
        raise ValueError(f"IPv4: header length {ihl}")
    sport = dport = 0
    if proto in _WITH_PORTS:
        if len(payload) < ihl + 4:
            raise ValueError(f"IPv4: {len(payload)} bytes, the ports end at {ihl + 4}")
        sport, dport = _PORTS.unpack_from(payload, ihl)
    return Flow(socket.inet_ntoa(src), socket.inet_ntoa(dst), proto, sport, dport)


def flow6(payload: bytes | bytearray | memoryview) -> Flow:
    """An IPv6 packet's addresses, upper-layer protocol and ports (pure).

    The fixed header, then the extension headers a transport header may
    follow, walked by their own length fields: Hop-by-Hop, Routing,
    Destination Options, Mobility, HIP, Shim6 and AH. A packet the walk
    cannot finish safely is refused (ValueError), never guessed at: a
    header cut off by the copy range, more than ``MAX_EXTENSION_HEADERS``,
    a non-first fragment (it has no ports; conntrack reassembles before
    the queue anyway, so one never arrives here). ESP and "no next header"
    end the walk with that protocol and no ports: no plan serves them.
    Addresses are RFC 5952 text (``inet_ntop``), as the model spells them.
    """
    n = len(payload)
    if n < 40:
        raise ValueError(f"IPv6: {n} bytes, less than a header")
    ver, nxt, src, dst = _IPV6.unpack_from(payload)
    if ver >> 4 != 6:
        raise ValueError(f"IPv6: version {ver >> 4}")
    off = 40
    for _ in range(MAX_EXTENSION_HEADERS + 1):
        if nxt in _WITH_PORTS:
            if n < off + 4:
                raise ValueError(f"IPv6: {n} bytes, the ports end at {off + 4}")
            sport, dport = _PORTS.unpack_from(payload, off)
            break
        if nxt in _EXTENSIONS:
            if n < off + 8:
                raise ValueError(f"IPv6: extension header {nxt} at {off} is cut off at {n}")
            if nxt == _EXT_FRAGMENT:
                # Fragment offset (13 bits) and M flag: only an unfragmented or first
                # fragment carries the transport header.
                if (payload[off + 2] << 8 | payload[off + 3]) & 0xFFF8:
                    raise ValueError("IPv6: a non-first fragment has no ports")
                size = 8
            elif nxt == _EXT_AH:
                size = (payload[off + 1] + 2) * 4
            else:
                size = (payload[off + 1] + 1) * 8
            nxt = payload[off]
            off += size
            continue
        sport = dport = 0  # ESP, ICMPv6, No Next Header, ...: no ports to read
        break
    else:
        raise ValueError(f"IPv6: more than {MAX_EXTENSION_HEADERS} extension headers")
    return Flow(socket.inet_ntop(socket.AF_INET6, src), socket.inet_ntop(socket.AF_INET6, dst),
                nxt, sport, dport, 6)


# -- the socket ---------------------------------------------------------------------------

DEFAULT_COPY_RANGE = 128
"""Room for the ports behind an IPv4 header (20-60 bytes), and behind an IPv6 header (40)
with a few extension headers (``flow6``). A SYN is shorter (at most 60 bytes over IPv4,
80 over IPv6), so only a UDP datagram is copied up to this."""
DEFAULT_MAXLEN = 4096
DEFAULT_RCVBUF = 8 << 20
"""Room for about 20,000 queued SYNs while the loop is busy elsewhere, before the
kernel drops any: it charges each message's buffer (about 830 bytes for a
SYN copied 80 bytes) against twice the size asked (``socket(7)``)."""
RECV_SIZE = 1 << 16
MAX_READS = 256
"""``recv`` calls per ``read_batch``: bounds one call's work; the fd stays readable."""
CONFIG_TIMEOUT = 2.0
MAX_DATAGRAM = 64 << 10
"""Bytes of verdicts per ``send``: far under the socket's send buffer (208 KiB by default)."""


class QueueSocket:
    """A NETLINK_NETFILTER socket bound to NFQUEUE number ``queue`` in the current namespace.

    The constructor binds the queue and configures it (copy ``copy_range``
    bytes, ``maxlen`` waiting packets, ``fail_open``), checking the kernel's
    ack of each step: OSError naming the step if one fails (EPERM: another
    socket has the queue). Then ``read_batch()`` whenever ``fileno()`` is
    readable, and ``send_verdicts()`` for what it returned. Not thread-safe:
    one owner.

    Bind it *before* the rules that queue to it go in: a queue with rules
    and no socket drops (fail-closed) or bypasses (``--queue-bypass``)
    every packet sent to it.

    ``adopt``: a socket that has the queue already, received from the
    process that bound it (a restart's handover): the queue stays bound
    throughout, and what waits in it stays too. It is configured again, not
    bound.
    """

    def __init__(self, queue: int, *, copy_range: int = DEFAULT_COPY_RANGE,
                 maxlen: int = DEFAULT_MAXLEN, rcvbuf: int = DEFAULT_RCVBUF,
                 fail_open: bool = False, timeout: float = CONFIG_TIMEOUT,
                 adopt: socket.socket | None = None) -> None:
        self.queue = queue
        self.enobufs = 0
        """Times the kernel said it dropped messages for us (ENOBUFS on recv)."""
        self.verdict_errors = 0
        """Verdicts the kernel refused (ENOENT: the packet id was not waiting)."""
        # A verdict's seq is its packet id (``verdict_batch``): an adopted queue may
        # have numbered packets already, so its config numbers itself far above them.
        self._seq = 0 if adopt is None else 0xF000_0000
        self._pending: list[Packet] = []
        """Packets that arrived while the constructor waited for an ack."""
        self._buf = bytearray(RECV_SIZE)
        self._warn = RateLimitedLog(log)
        self._sock = adopt or socket.socket(
            socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC, NETLINK_NETFILTER)
        try:
            if adopt is None:
                self._sock.bind((0, 0))
            with contextlib.suppress(OSError):
                self._sock.setsockopt(SOL_NETLINK, NETLINK_CAP_ACK, 1)
            self._set_rcvbuf(rcvbuf)
            self._sock.setblocking(False)
            deadline = time.monotonic() + timeout
            if adopt is None:
                for family in (socket.AF_INET, socket.AF_INET6):
                    self._config(f"family {family} bind",
                                 config_pf_bind(family, self._next_seq()), deadline)
                self._config("bind", config_bind(queue, self._next_seq()), deadline)
            self._config(f"copy range {copy_range}",
                         config_params(queue, copy_range, self._next_seq()), deadline)
            self._config(f"queue length {maxlen}",
                         config_maxlen(queue, maxlen, self._next_seq()), deadline)
            self._config(f"fail-open {'on' if fail_open else 'off'}",
                         config_flags(queue, NFQA_CFG_F_FAIL_OPEN if fail_open else 0,
                                      NFQA_CFG_F_FAIL_OPEN, self._next_seq()), deadline)
        except BaseException:
            self._sock.close()
            raise

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def _set_rcvbuf(self, size: int) -> None:
        """SO_RCVBUFFORCE passes ``net.core.rmem_max`` (CAP_NET_ADMIN); else as much as allowed."""
        try:
            self._sock.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, size)
        except OSError:
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, size)

    def _config(self, what: str, request: bytes, deadline: float) -> None:
        """Send one config request and wait (until ``deadline``) for its ack."""
        seq = _NLMSGHDR.unpack_from(request)[3]
        self._sock.send(request)
        while True:  # acks of ours, and packets that came meanwhile: the deadline bounds it
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._sock], [], [], left)[0]:
                break
            n = self._recv()
            if not n:
                continue
            got = parse(self._buf, n)
            self._pending.extend(got.packets)
            for ack in got.acks:
                if ack.seq == seq:
                    if ack.error:
                        raise OSError(ack.error, f"nfqueue {self.queue}: {what}:"
                                      f" {os.strerror(ack.error)}")
                    return
        raise OSError(errno.ETIMEDOUT, f"nfqueue {self.queue}: {what}: no answer from the kernel")

    def _recv(self) -> int | None:
        """One datagram into the buffer: its size; 0 if messages were lost; None if none waits."""
        try:
            return self._sock.recv_into(self._buf)
        except BlockingIOError:
            return None
        except OSError as exc:
            if exc.errno != errno.ENOBUFS:
                raise
        # The socket's buffer overflowed: the kernel already dropped (or, fail-open,
        # accepted) the packets it could not hand us. Nothing to answer for them.
        self.enobufs += 1
        self._warn.warning(("enobufs", self.queue),
                           "nfqueue %d: the kernel dropped queued packets (receive buffer"
                           " full, %d times so far); their clients retransmit",
                           self.queue, self.enobufs)
        return 0

    def fileno(self) -> int:
        return self._sock.fileno()

    @property
    def socket(self) -> socket.socket:
        """The netlink socket itself: what a restart's handover passes on (``adopt``)."""
        return self._sock

    def read_batch(self, max_reads: int = MAX_READS) -> list[Packet]:
        """Every packet waiting now, without blocking: reads until EAGAIN or ``max_reads``.

        A message that cannot be parsed is logged and skipped (its packet, if
        any, waits in the kernel until the socket closes). Error acks are
        refused verdicts: counted and logged.
        """
        out, self._pending = self._pending, []
        for _ in range(max_reads):
            n = self._recv()
            if n is None:
                break
            if not n:
                continue
            try:
                got = parse(self._buf, n)
            except ValueError as exc:
                self._warn.warning(("parse", self.queue), "nfqueue %d: %s", self.queue, exc)
                continue
            out.extend(got.packets)
            for ack in got.acks:
                if ack.error:
                    self.verdict_errors += 1
                    self._warn.warning(("verdict", self.queue, ack.error),
                                       "nfqueue %d: verdict for packet %d refused: %s",
                                       self.queue, ack.seq, os.strerror(ack.error))
        return out

    def send_verdicts(self, verdicts: Sequence[Verdict]) -> None:
        """All of ``verdicts`` in one datagram (or a few, past ``MAX_DATAGRAM``).

        The kernel handles them in order inside this ``send``: for an
        accepted SYN that includes its NAT, routing and forwarding.
        """
        per = MAX_DATAGRAM // 40
        if len(verdicts) <= per:
            if verdicts:
                self._sock.send(verdict_batch(self.queue, verdicts))
            return
        for i in range(0, len(verdicts), per):
            self._sock.send(verdict_batch(self.queue, verdicts[i:i + per]))

    def close(self) -> None:
        """Give the queue back (the kernel drops whatever still waits in it). Idempotent."""
        self._sock.close()

    def __enter__(self) -> QueueSocket:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

