"""nfq-pyfloor: ``nfqfloor.c`` in Python, the floor of a Python NFQUEUE reader (kpx bench).

The same work as the C floor, in the fewest Python steps: bind the queue, then read
(one blocking ``recv``, then non-blocking ones until EAGAIN, at most 64), and answer
each queued IPv4 packet NF_ACCEPT with a mark chosen round robin from those given for
its TCP destination port (keeping the packet's own bits outside MASK), in one datagram.
A packet for any other port is dropped. One thread, no event loop, no decision.

So in one run, kpx-nfq's gap to the C floor splits into what any Python reader pays on
this machine (this one's gap to the C floor: the interpreter, woken cold) and what
kpx's reader adds to it (kpx-nfq's gap to this one: its parsing, plans and ``decide``).

usage: python nfqpyfloor.py QUEUE MASK PORT=MARK[,MARK...]...
"""

from __future__ import annotations

import errno
import os
import socket
import struct
import sys
import time

NETLINK_NETFILTER = 12
SO_RCVBUFFORCE = 33
SOL_NETLINK, NETLINK_NO_ENOBUFS = 270, 5
SUBSYS_QUEUE = 3 << 8
MSG_PACKET, MSG_VERDICT, MSG_CONFIG = 0, 1, 2
NLM_F_REQUEST, NLM_F_ACK = 1, 4
NLMSG_ERROR = 2
CFG_CMD, CFG_PARAMS, CFG_QUEUE_MAXLEN = 1, 2, 3
CMD_BIND, COPY_PACKET = 1, 2
PACKET_HDR, MARK, PAYLOAD = 1, 3, 10
VERDICT_HDR = 2
NF_DROP, NF_ACCEPT = 0, 1

NLMSG = struct.Struct("=IHHII")
NLATTR = struct.Struct("=HH")
BE32 = struct.Struct("!I")
ACCEPT = struct.Struct("=IHHIIBBH" "HHII" "HHI")
"""A whole NF_ACCEPT verdict with a mark: header, nfgenmsg, verdict and mark attributes."""
DROP = struct.Struct("=IHHIIBBH" "HHII")


def message(kind: int, queue: int, body: bytes, flags: int = NLM_F_REQUEST) -> bytes:
    head = struct.pack("=BBH", socket.AF_UNSPEC, 0, socket.htons(queue))
    return NLMSG.pack(NLMSG.size + len(head) + len(body), SUBSYS_QUEUE | kind, flags,
                      0, 0) + head + body


def request(sock: socket.socket, queue: int, body: bytes) -> int:
    """Send one config request and wait for the kernel's answer: 0, or its errno.

    Asked for (``NLM_F_ACK``), so a refused bind is an error here, not a reader that
    silently gets no packet. Nothing is queued to us before the bind, so the next
    message is the answer.
    """
    sock.send(message(MSG_CONFIG, queue, body, NLM_F_REQUEST | NLM_F_ACK))
    answer = sock.recv(512)
    if NLMSG.unpack_from(answer)[1] != NLMSG_ERROR:
        return 0
    return -struct.unpack_from("=i", answer, NLMSG.size)[0]


def configure(sock: socket.socket, queue: int) -> None:
    """Bind the queue, retrying for up to 5 s while another socket still has it (EPERM: a
    process being replaced; EBUSY), then set the copy range and the queue's length."""
    bind = attr(CFG_CMD, struct.pack("=BxH", CMD_BIND, socket.htons(socket.AF_INET)))
    deadline = time.monotonic() + 5
    while err := request(sock, queue, bind):
        if err not in (errno.EPERM, errno.EBUSY) or time.monotonic() >= deadline:
            sys.exit(f"nfqpyfloor: bind queue {queue}: {os.strerror(err)}")
        time.sleep(0.05)
    if err := request(sock, queue, attr(CFG_PARAMS, struct.pack("!IB", 80, COPY_PACKET))
                      + attr(CFG_QUEUE_MAXLEN, BE32.pack(4096))):
        sys.exit(f"nfqpyfloor: queue {queue} params: {os.strerror(err)}")


def attr(kind: int, value: bytes) -> bytes:
    size = NLATTR.size + len(value)
    return NLATTR.pack(size, kind) + value + b"\0" * (-size % 4)


def parse_ports(args: list[str]) -> dict[int, list[int]]:
    ports: dict[int, list[int]] = {}
    for arg in args:
        port, _, marks = arg.partition("=")
        ports[int(port)] = [int(m, 0) for m in marks.split(",") if m]
        if not ports[int(port)]:
            raise SystemExit(f"nfqpyfloor: {arg}: no mark")
    return ports


def main(argv: list[str]) -> int:
    if len(argv) < 3:
        print("usage: nfqpyfloor QUEUE MASK PORT=MARK[,MARK...]...", file=sys.stderr)
        return 2
    queue, mask = int(argv[0], 0), int(argv[1], 0)
    ports = parse_ports(argv[2:])
    turn = dict.fromkeys(ports, 0)
    keep = ~mask & 0xFFFFFFFF
    sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC,
                         NETLINK_NETFILTER)
    sock.bind((0, 0))
    sock.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, 8 << 20)
    sock.setsockopt(SOL_NETLINK, NETLINK_NO_ENOBUFS, 1)
    configure(sock, queue)
    print(f"nfqpyfloor: queue {queue} bound, {len(ports)} port(s)", file=sys.stderr, flush=True)
    hq = socket.htons(queue)
    buf = bytearray(1 << 16)
    while True:
        out: list[bytes] = []
        flags = 0
        for _ in range(64):
            try:
                n = sock.recv_into(buf, 0, flags)
            except BlockingIOError:
                break
            flags = socket.MSG_DONTWAIT
            off = 0
            while off + NLMSG.size <= n:
                length, kind = NLMSG.unpack_from(buf, off)[:2]
                if kind & 0xFF == MSG_PACKET:
                    at, end = off + NLMSG.size + 4, off + length
                    packet_id = packet_mark = mark = -1
                    while at + NLATTR.size <= end:
                        size, akind = NLATTR.unpack_from(buf, at)
                        akind &= 0x7FFF
                        if akind == PACKET_HDR:
                            packet_id = BE32.unpack_from(buf, at + 4)[0]
                        elif akind == MARK:
                            packet_mark = BE32.unpack_from(buf, at + 4)[0]
                        elif akind == PAYLOAD and buf[at + 4] >> 4 == 4 and buf[at + 13] == 6:
                            tcp = at + 4 + (buf[at + 4] & 0x0F) * 4
                            marks = ports.get(buf[tcp + 2] << 8 | buf[tcp + 3])
                            if marks:
                                port = buf[tcp + 2] << 8 | buf[tcp + 3]
                                mark = marks[turn[port] % len(marks)]
                                turn[port] += 1
                        at += (size + 3) & ~3
                    if packet_id >= 0:
                        if mark >= 0:
                            own = packet_mark & keep if packet_mark >= 0 else 0
                            out.append(ACCEPT.pack(
                                ACCEPT.size, SUBSYS_QUEUE | MSG_VERDICT, NLM_F_REQUEST, 0, 0,
                                socket.AF_UNSPEC, 0, hq, 12, VERDICT_HDR,
                                socket.htonl(NF_ACCEPT), socket.htonl(packet_id), 8, MARK,
                                socket.htonl(own | mark)))
                        else:
                            out.append(DROP.pack(
                                DROP.size, SUBSYS_QUEUE | MSG_VERDICT, NLM_F_REQUEST, 0, 0,
                                socket.AF_UNSPEC, 0, hq, 12, VERDICT_HDR,
                                socket.htonl(NF_DROP), socket.htonl(packet_id)))
                off += (length + 3) & ~3
        if out:
            sock.send(b"".join(out))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
