"""Netlink's own framing (``linux/netlink.h``), shared by every family kpx speaks.

Owns: the message header and its types and flags, and the error ack's code.
``proxy.nfqueue.netlink`` (NFQUEUE), ``proxy.nfqueue.ctnetlink`` (conntrack) and
``proxy.userspace.transparent`` (sock_diag) each build their own family's
messages on top; this is what they have in common, so it is written once.

The header is host order: ``len``, ``type``, ``flags``, ``seq``, ``pid``. An
``NLMSG_ERROR`` message carries ``-errno`` (0: an ack) right after it.
"""

from __future__ import annotations

import struct

NLMSG_NOOP = 1
NLMSG_ERROR = 2
NLMSG_DONE = 3
NLMSG_OVERRUN = 4
NLM_F_REQUEST = 0x1
NLM_F_ACK = 0x4
NLM_F_DUMP = 0x300
"""``NLM_F_ROOT | NLM_F_MATCH``: every object of the kind asked for."""

NLMSGHDR = struct.Struct("=IHHII")
NLMSGERR = struct.Struct("=i")


def header(body_len: int, kind: int, flags: int, seq: int = 0) -> bytes:
    """The header of a message of ``kind`` whose body is ``body_len`` bytes."""
    return NLMSGHDR.pack(NLMSGHDR.size + body_len, kind, flags, seq, 0)


def error_code(buf: bytes | bytearray | memoryview, off: int = 0) -> int:
    """The errno an ``NLMSG_ERROR`` message at ``off`` carries (0: an ack)."""
    return -NLMSGERR.unpack_from(buf, off + NLMSGHDR.size)[0]
