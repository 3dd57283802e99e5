"""Conntrack's table, read over ctnetlink from Python: a filtered dump, fast.

Owns: the bytes of a ctnetlink dump (``linux/netfilter/nfnetlink_conntrack.h``)
that kpx needs, as pure functions over buffers (``dump_request``,
``parse``), and ``dump``, the thin shell that asks this namespace's kernel and
reads every answer. An entry comes back as a ``CtEntry``: its protocol, both
ends of its original direction, the source of its reply direction (where a
DNATed connection went), its status bits and its TCP state.

Also ``delete``: the few entries ``conntrack.clean_stale_udp`` names, by their
original direction. Never: write an entry, or run on the event loop (a dump
of a busy node's table takes milliseconds to read).

Why not pyroute2's ``Conntrack.dump_entries``, which kpx used at first: it
decodes every attribute of every entry into objects, through an event loop
step per entry, about 0.8 ms an entry here. A node with 20,000 connections
cost 16 s of CPU per look, with the GIL held for most of it: the NAT keeper's
look every 5 s (``wiring.wait_out_nat_keepers``) then never stopped, and a
sync's stale-UDP clean-up in nfqueue mode starved the thread that answers
SYNs. This reads only what kpx uses, with ``struct``, at a few microseconds an
entry; the kernel filters first where it can.

The wire format, for a reader of the code below (as ``netlink.py`` has it):
``nlmsghdr``, ``nfgenmsg`` (the family), then attributes. Nested attributes
carry ``NLA_F_NESTED``; values are big-endian (addresses as their bytes, ports
u16, status u32, the protocol and the TCP state u8). A dump is answered by
many messages over many ``recv``s, ended by ``NLMSG_DONE``.

Kernel-side filters (``dump_request``): the original direction's layer-4
protocol (Linux 5.8 and later: ``CTA_FILTER``), and status bits under a mask
(``CTA_STATUS`` with ``CTA_STATUS_MASK``, Linux 5.15 and later: pyroute2's
note). An older kernel ignores what it does not know and sends more; the
callers check every entry they are given anyway.
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import struct
from collections.abc import Iterable, Iterator
from typing import NamedTuple

from proxy.nfqueue.netlink import NETLINK_NETFILTER, NLA_TYPE_MASK, SO_RCVBUFFORCE, attr
from proxy.util.nlmsg import (
    NLM_F_ACK,
    NLM_F_DUMP,
    NLM_F_REQUEST,
    NLMSG_DONE,
    NLMSG_ERROR,
    NLMSGERR,
    NLMSGHDR,
)

NFNL_SUBSYS_CTNETLINK = 1
IPCTNL_MSG_CT_NEW = 0
IPCTNL_MSG_CT_GET = 1
IPCTNL_MSG_CT_DELETE = 2
NLA_F_NESTED = 0x8000

# ctattr_type
CTA_TUPLE_ORIG = 1
CTA_TUPLE_REPLY = 2
CTA_STATUS = 3
CTA_PROTOINFO = 4
CTA_FILTER = 25
CTA_STATUS_MASK = 26
# ctattr_tuple, ctattr_ip, ctattr_l4proto
CTA_TUPLE_IP = 1
CTA_TUPLE_PROTO = 2
CTA_IP_V4_SRC, CTA_IP_V4_DST, CTA_IP_V6_SRC, CTA_IP_V6_DST = 1, 2, 3, 4
CTA_PROTO_NUM, CTA_PROTO_SRC_PORT, CTA_PROTO_DST_PORT = 1, 2, 3
# ctattr_protoinfo, ctattr_protoinfo_tcp
CTA_PROTOINFO_TCP = 1
CTA_PROTOINFO_TCP_STATE = 1
# ctattr_filter, and its flags
CTA_FILTER_ORIG_FLAGS = 1
CTA_FILTER_FLAG_PROTO_NUM = 1 << 3

_NFGENMSG = struct.Struct("=BBH")
_NLATTR = struct.Struct("=HH")
_HDR_LEN = NLMSGHDR.size + _NFGENMSG.size
_BE16 = struct.Struct("!H")
_BE32 = struct.Struct("!I")
_ENTRY_TYPE = (NFNL_SUBSYS_CTNETLINK << 8) | IPCTNL_MSG_CT_NEW
_ADDRESSES = {CTA_IP_V4_SRC: 0, CTA_IP_V4_DST: 1, CTA_IP_V6_SRC: 0, CTA_IP_V6_DST: 1}
"""Which end an address attribute is: 0 the source, 1 the destination."""


class CtEntry(NamedTuple):
    """What kpx reads of one conntrack entry."""

    proto: int
    src: str
    sport: int
    dst: str
    dport: int
    reply_src: str
    """The reply direction's source: where a DNATed connection went."""
    status: int
    tcp_state: int | None
    """``TCP_CONNTRACK_*``; None for any other protocol."""


def _nested(kind: int, body: bytes) -> bytes:
    return attr(kind | NLA_F_NESTED, body)


def dump_request(family: int, proto: int | None = None, status: int = 0,
                 status_mask: int = 0, seq: int = 1) -> bytes:
    """A dump of ``family``'s entries (``socket.AF_INET`` or ``AF_INET6``), of ``proto``
    only (None: every protocol) and with ``status & status_mask == status`` (a mask of 0:
    any)."""
    body = b""
    if proto is not None:
        body += _nested(CTA_FILTER, attr(CTA_FILTER_ORIG_FLAGS,
                                         struct.pack("=I", CTA_FILTER_FLAG_PROTO_NUM)))
        body += _nested(CTA_TUPLE_ORIG, _nested(CTA_TUPLE_PROTO,
                                                attr(CTA_PROTO_NUM, bytes([proto]))))
    if status_mask:
        body += attr(CTA_STATUS, _BE32.pack(status)) + attr(CTA_STATUS_MASK,
                                                            _BE32.pack(status_mask))
    return (NLMSGHDR.pack(_HDR_LEN + len(body), (NFNL_SUBSYS_CTNETLINK << 8) | IPCTNL_MSG_CT_GET,
                           NLM_F_REQUEST | NLM_F_DUMP, seq, 0)
            + _NFGENMSG.pack(family, 0, 0) + body)


def delete_request(family: int, proto: int, src: str, sport: int, dst: str, dport: int,
                   seq: int = 1) -> bytes:
    """Delete the entry whose original direction is ``src:sport -> dst:dport`` over
    ``proto`` (acknowledged: 0, or ENOENT when it expired meanwhile)."""
    v6 = family == socket.AF_INET6
    orig = _nested(CTA_TUPLE_ORIG, _nested(
        CTA_TUPLE_IP,
        attr(CTA_IP_V6_SRC if v6 else CTA_IP_V4_SRC, socket.inet_pton(family, src))
        + attr(CTA_IP_V6_DST if v6 else CTA_IP_V4_DST, socket.inet_pton(family, dst)),
    ) + _nested(
        CTA_TUPLE_PROTO,
        attr(CTA_PROTO_NUM, bytes([proto])) + attr(CTA_PROTO_SRC_PORT, _BE16.pack(sport))
        + attr(CTA_PROTO_DST_PORT, _BE16.pack(dport)),
    ))
    return (NLMSGHDR.pack(_HDR_LEN + len(orig), (NFNL_SUBSYS_CTNETLINK << 8)
                           | IPCTNL_MSG_CT_DELETE, NLM_F_REQUEST | NLM_F_ACK, seq, 0)
            + _NFGENMSG.pack(family, 0, 0) + orig)


def _attrs(buf: bytes | memoryview, start: int, end: int) -> Iterator[tuple[int, int, int]]:
    """``(type, value start, value end)`` of each attribute in ``buf[start:end]``."""
    unpack = _NLATTR.unpack_from
    while start + 4 <= end:
        size, kind = unpack(buf, start)
        if size < 4 or start + size > end:
            return
        yield kind & NLA_TYPE_MASK, start + 4, start + size
        start += (size + 3) & ~3


def _layout(addr: int) -> struct.Struct:
    """How the kernel lays out a TCP or UDP tuple (``ctnetlink_dump_tuples``) with addresses
    of ``addr`` bytes: the IP attribute (source, destination), then the protocol attribute
    (number, source port, destination port). Attribute headers are host order, so the
    ports come out byte-swapped (``socket.ntohs``)."""
    return struct.Struct(f"=HHHH{addr}sHH{addr}sHHHHB3xHHH2xHHH2x")


_TUPLES = {socket.AF_INET: (_layout(4), 4 + 2 * (4 + 4)),
           socket.AF_INET6: (_layout(16), 4 + 2 * (4 + 16))}
"""Per family: the fixed layout, and the length its IP attribute has."""
_PROTO_LEN = 4 + 8 + 8 + 8
_FAST = (CTA_TUPLE_IP, CTA_IP_V4_SRC, CTA_IP_V4_DST, CTA_TUPLE_PROTO, CTA_PROTO_NUM,
         CTA_PROTO_SRC_PORT, CTA_PROTO_DST_PORT)
_FAST6 = (CTA_TUPLE_IP, CTA_IP_V6_SRC, CTA_IP_V6_DST, CTA_TUPLE_PROTO, CTA_PROTO_NUM,
          CTA_PROTO_SRC_PORT, CTA_PROTO_DST_PORT)


def _tuple(buf: bytes | memoryview, start: int, end: int, family: int
           ) -> tuple[str, str, int, int, int]:
    """``(src, dst, proto, sport, dport)`` of a ``CTA_TUPLE_*`` attribute's value.

    Nearly every entry is TCP or UDP, laid out as ``_layout`` says: one
    ``unpack_from``, its attribute types checked. Anything else is walked.
    """
    layout, ip_len = _TUPLES[family]
    if end - start >= layout.size:
        (iplen, ipt, _, srct, src, _, dstt, dst, plen, pt, _, numt, num, _, spt, sp, _, dpt,
         dp) = layout.unpack_from(buf, start)
        if iplen == ip_len and plen == _PROTO_LEN and (
                ipt & NLA_TYPE_MASK, srct, dstt, pt & NLA_TYPE_MASK, numt, spt, dpt) == (
                _FAST if family == socket.AF_INET else _FAST6):
            return (socket.inet_ntop(family, src), socket.inet_ntop(family, dst), num,
                    socket.ntohs(sp), socket.ntohs(dp))
    ends = ["", ""]
    proto = sport = dport = 0
    for kind, vs, ve in _attrs(buf, start, end):
        if kind == CTA_TUPLE_IP:
            for akind, a, b in _attrs(buf, vs, ve):
                end_ = _ADDRESSES.get(akind)
                if end_ is not None:
                    ends[end_] = socket.inet_ntop(family, bytes(buf[a:b]))
        elif kind == CTA_TUPLE_PROTO:
            for pkind, a, _ in _attrs(buf, vs, ve):
                if pkind == CTA_PROTO_NUM:
                    proto = buf[a]
                elif pkind == CTA_PROTO_SRC_PORT:
                    sport = _BE16.unpack_from(buf, a)[0]
                elif pkind == CTA_PROTO_DST_PORT:
                    dport = _BE16.unpack_from(buf, a)[0]
    return ends[0], ends[1], proto, sport, dport


def _tcp_state(buf: bytes | memoryview, start: int, end: int) -> int | None:
    for kind, vs, ve in _attrs(buf, start, end):
        if kind == CTA_PROTOINFO_TCP:
            for tkind, a, _ in _attrs(buf, vs, ve):
                if tkind == CTA_PROTOINFO_TCP_STATE:
                    return buf[a]
    return None


class DumpEnd(NamedTuple):
    """``parse``'s last word on a buffer: whether the dump is over, and its error (0: none)."""

    done: bool
    errno: int


def parse(buf: bytes | memoryview, n: int, entries: list[CtEntry]) -> DumpEnd:
    """Append the entries in ``buf[:n]`` (one ``recv`` of a dump) to ``entries``.

    An entry whose family is not an IP one, or that lacks its original
    tuple, is skipped.
    """
    unpack, attr_header = NLMSGHDR.unpack_from, _NLATTR.unpack_from
    off = 0
    while off + NLMSGHDR.size <= n:
        length, kind = unpack(buf, off)[:2]
        if length < NLMSGHDR.size or off + length > n:
            break
        if kind == NLMSG_DONE:
            return DumpEnd(True, 0)
        if kind == NLMSG_ERROR:
            code = -NLMSGERR.unpack_from(buf, off + NLMSGHDR.size)[0]
            if code:
                return DumpEnd(True, code)
        elif kind == _ENTRY_TYPE and length >= _HDR_LEN:
            family = buf[off + NLMSGHDR.size]
            if family in (socket.AF_INET, socket.AF_INET6):
                orig = reply = None
                status = 0
                state = None
                at, end = off + _HDR_LEN, off + length
                while at + 4 <= end:  # the attributes, walked inline: this runs per entry
                    size, akind = attr_header(buf, at)
                    if size < 4 or at + size > end:
                        break
                    akind &= NLA_TYPE_MASK
                    if akind == CTA_TUPLE_ORIG:
                        orig = _tuple(buf, at + 4, at + size, family)
                    elif akind == CTA_TUPLE_REPLY:
                        reply = _tuple(buf, at + 4, at + size, family)
                    elif akind == CTA_STATUS:
                        status = _BE32.unpack_from(buf, at + 4)[0]
                    elif akind == CTA_PROTOINFO:
                        state = _tcp_state(buf, at + 4, at + size)
                    at += (size + 3) & ~3
                if orig is not None:
                    src, dst, proto, sport, dport = orig
                    entries.append(CtEntry(proto, src, sport, dst, dport,
                                           reply[0] if reply else "", status, state))
        off += (length + 3) & ~3
    return DumpEnd(False, 0)


def _socket(timeout: float) -> socket.socket:
    sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC,
                         NETLINK_NETFILTER)
    sock.bind((0, 0))
    sock.settimeout(timeout)
    return sock


def delete(family: int, flows: Iterable[tuple[int, str, int, str, int]],
           timeout: float = 10.0) -> int:
    """Delete each ``(proto, src, sport, dst, dport)`` entry of ``family`` (4 or 6), by its
    original direction; returns how many were deleted (one that expired meanwhile is not).

    Blocking: run it off the event loop. Raises ``OSError`` for any refusal but ENOENT.
    """
    af = socket.AF_INET6 if family == 6 else socket.AF_INET
    deleted = 0
    with _socket(timeout) as sock:
        buf = bytearray(4096)
        for seq, (proto, src, sport, dst, dport) in enumerate(flows, 1):
            sock.send(delete_request(af, proto, src, sport, dst, dport, seq))
            n = sock.recv_into(buf)
            end = parse(buf, n, [])
            if end.errno == errno.ENOENT:
                continue
            if end.errno:
                raise OSError(end.errno, f"conntrack delete {src}:{sport} -> {dst}:{dport}:"
                                         f" {os.strerror(end.errno)}")
            deleted += 1
    return deleted


def dump(family: int, proto: int | None = None, status: int = 0, status_mask: int = 0,
         timeout: float = 10.0) -> list[CtEntry]:
    """This namespace's conntrack entries of ``family`` (4 or 6), filtered as
    ``dump_request`` says (the kernel filters what it can; the caller checks the rest).

    Blocking: run it off the event loop. Raises ``OSError`` for a refused dump
    (EPERM without CAP_NET_ADMIN) or one that stops answering for ``timeout``.
    """
    af = socket.AF_INET6 if family == 6 else socket.AF_INET
    sock = _socket(timeout)
    try:
        with contextlib.suppress(OSError):  # the default buffer only means more recvs
            sock.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, 4 << 20)
        sock.send(dump_request(af, proto, status, status_mask))
        buf = bytearray(1 << 17)
        entries: list[CtEntry] = []
        while True:
            n = sock.recv_into(buf)
            end = parse(buf, n, entries)
            if end.errno:
                raise OSError(end.errno, f"conntrack dump: {os.strerror(end.errno)}")
            if end.done:
                return entries
    finally:
        sock.close()
