"""The sk_lookup program steers UDP VIP datagrams to one UDP socket, apart from TCP.

Each test runs in a fresh network namespace (``in_fresh_netns``: a thread
that joined it, so its ``ip`` subprocesses and sockets are the namespace's)
where ``10.96.0.53`` is a ``local`` route, as ``proxy.userspace.vips`` makes
a VIP, and one ``SkLookup`` has a TCP listener and a UDP socket, both on
``127.0.0.107``, in its two slots. Nothing here touches the initial namespace.

What the UDP dataplane will rely on, proved against the kernel: a datagram to
a served ``VIP:port`` reaches the UDP socket with the VIP and port in its
ancillary data; an answer sent with ``IP_PKTINFO``'s ``ipi_spec_dst`` = VIP
reaches the client from the VIP (and from the socket's own port: pktinfo
cannot set a port); TCP and UDP on the same ``VIP:port`` are steered
independently; unserving stops the steering.
"""

from __future__ import annotations

import contextlib
import os
import select
import socket
import struct
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from proxy.userspace.sklookup import SkLookup, pair_key
from tests.support.netns import in_fresh_netns

pytestmark = [pytest.mark.lab,
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root (netns, bpf)")]

VIP = "10.96.0.53"
PORT = 53
SERVER_IP = "127.0.0.107"
"""Where the steered sockets are bound: not the VIP, so only steering reaches them."""
CLIENT_IP = "127.0.0.1"

# ``<linux/in.h>``; Python's ``socket`` has neither constant before 3.13 (IP_PKTINFO)
# or at all (IP_RECVORIGDSTADDR).
IP_PKTINFO = 8
IP_RECVORIGDSTADDR = 20
IN_PKTINFO = struct.Struct("=i4s4s")
"""``struct in_pktinfo { int ipi_ifindex; struct in_addr ipi_spec_dst, ipi_addr; }``."""
NOTHING = 0.3
"""Seconds a socket must stay silent for "not steered"."""


def pktinfo_cmsg(spec_dst: str, ifindex: int = 0) -> tuple[int, int, bytes]:
    """The ``sendmsg`` control message that makes ``spec_dst`` an answer's source address.

    On send the kernel reads ``ipi_spec_dst`` as the source address (it
    must be local: a VIP is) and ``ipi_ifindex`` as the outgoing interface
    (0: let the route choose); ``ipi_addr`` is ignored on send.
    """
    return (socket.IPPROTO_IP, IP_PKTINFO,
            IN_PKTINFO.pack(ifindex, socket.inet_aton(spec_dst), bytes(4)))


@dataclass(frozen=True)
class Received:
    data: bytes
    peer: tuple[str, int]
    pktinfo_dst: str
    """``ipi_addr``: the destination address in the datagram's IP header."""
    orig_dst: tuple[str, int]
    """``IP_RECVORIGDSTADDR``: the destination address and port (the service's)."""


def receive(sock: socket.socket, timeout: float = 1.0) -> Received | None:
    """The next datagram on ``sock`` with its destination, or None if none comes in time.

    Waits with ``select`` as an event loop would: the socket sits in a
    sockmap, and readiness must still be signalled.
    """
    if not select.select([sock], [], [], timeout)[0]:
        return None
    data, ancdata, _flags, peer = sock.recvmsg(2048, socket.CMSG_SPACE(64), socket.MSG_DONTWAIT)
    found: dict[int, bytes] = {}
    for level, kind, payload in ancdata:
        if level == socket.IPPROTO_IP:
            found[kind] = payload
    _ifindex, _spec_dst, addr = IN_PKTINFO.unpack(found[IP_PKTINFO][:IN_PKTINFO.size])
    # struct sockaddr_in: family (host order), port and address (network order).
    orig_port, orig_addr = struct.unpack_from("!H4s", found[IP_RECVORIGDSTADDR], 2)
    return Received(data, peer, socket.inet_ntoa(addr),
                    (socket.inet_ntoa(orig_addr), orig_port))


@dataclass
class Lab:
    sk: SkLookup
    tcp: socket.socket
    """A listener in the TCP slot: what a TCP connect would reach if wrongly steered."""
    udp: socket.socket
    """The UDP socket in the UDP slot, bound to ``SERVER_IP:PORT``."""

    def serve(self, proto: str, *pairs: tuple[str, int]) -> None:
        for _ in self.sk.changes(frozenset(pairs), proto=proto):
            pass


@contextlib.contextmanager
def lab() -> Iterator[Lab]:
    """In the current (fresh) namespace: the VIP local, a program, both sockets steered to."""
    subprocess.run(["ip", "route", "add", "local", f"{VIP}/32", "dev", "lo", "table", "local"],
                   check=True, capture_output=True)
    with contextlib.ExitStack() as stack:
        sk = SkLookup()
        stack.callback(sk.close)
        tcp = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
        tcp.bind((SERVER_IP, 0))
        tcp.listen(8)
        udp = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_DGRAM))
        udp.setsockopt(socket.IPPROTO_IP, IP_PKTINFO, 1)
        udp.setsockopt(socket.IPPROTO_IP, IP_RECVORIGDSTADDR, 1)
        udp.bind((SERVER_IP, PORT))
        udp.setblocking(False)
        sk.steer_to(tcp)
        sk.steer_to(udp)
        yield Lab(sk, tcp, udp)


def client() -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind((CLIENT_IP, 0))  # not the VIP (a node process's default source for it)
    s.settimeout(1.0)
    return s


def tcp_connects(addr: tuple[str, int]) -> bool:
    """Does a TCP connect to ``addr`` succeed (False: refused, nothing listens)?"""
    with socket.socket() as s:
        s.settimeout(1.0)
        try:
            s.connect(addr)
        except ConnectionRefusedError:
            return False
        return True


# -- 1: steered in, answered as the VIP -----------------------------------------------------

def udp_steered_and_answered_as_the_vip() -> None:
    with lab() as lb, client() as cli:
        lb.serve("UDP", (VIP, PORT), (VIP, PORT + 1))
        assert lb.sk.served_of("UDP") == {(VIP, PORT), (VIP, PORT + 1)}
        assert lb.sk.served == set() and lb.sk.served_of("TCP") == set()

        cli.sendto(b"query", (VIP, PORT))
        got = receive(lb.udp)
        assert got is not None, "the datagram to the VIP was not steered"
        assert got.data == b"query" and got.peer == cli.getsockname()
        assert got.pktinfo_dst == VIP and got.orig_dst == (VIP, PORT)

        lb.udp.sendmsg([b"answer"], [pktinfo_cmsg(VIP)], 0, got.peer)
        data, source = cli.recvfrom(100)
        assert (data, source) == (b"answer", (VIP, PORT))

        # One socket for every port: the port comes from IP_RECVORIGDSTADDR
        # (pktinfo has none), and an answer leaves from the socket's own port.
        cli.sendto(b"other", (VIP, PORT + 1))
        got = receive(lb.udp)
        assert got is not None and got.orig_dst == (VIP, PORT + 1)
        lb.udp.sendmsg([b"answer"], [pktinfo_cmsg(VIP)], 0, got.peer)
        assert cli.recvfrom(100)[1] == (VIP, PORT)


def test_a_served_udp_pair_reaches_the_udp_socket_which_answers_as_the_vip() -> None:
    in_fresh_netns("sku1", udp_steered_and_answered_as_the_vip)


# -- 2: TCP and UDP on one VIP:port are independent -----------------------------------------

def protocols_independent() -> None:
    with lab() as lb, client() as cli:
        lb.serve("UDP", (VIP, PORT))
        # The TCP slot holds a listener: a refusal means the program did not steer the SYN.
        assert not tcp_connects((VIP, PORT))  # UDP's pair steers no SYN

        lb.serve("TCP", (VIP, PORT))
        lb.serve("UDP")
        assert lb.sk.served == {(VIP, PORT)} and lb.sk.served_of("UDP") == set()
        assert tcp_connects((VIP, PORT))
        conn, _ = lb.tcp.accept()
        assert conn.getsockname() == (VIP, PORT)
        conn.close()
        cli.sendto(b"query", (VIP, PORT))
        assert receive(lb.udp, NOTHING) is None  # TCP's pair steers no datagram

        lb.serve("UDP", (VIP, PORT))  # both: each protocol to its own socket
        assert tcp_connects((VIP, PORT))
        lb.tcp.accept()[0].close()
        cli.sendto(b"query", (VIP, PORT))
        got = receive(lb.udp)
        assert got is not None and got.orig_dst == (VIP, PORT)


def test_tcp_and_udp_on_the_same_vip_port_are_steered_independently() -> None:
    in_fresh_netns("sku2", protocols_independent)


# -- 3: unserving stops the steering ----------------------------------------------------------

def unserved_no_longer_steered() -> None:
    with lab() as lb, client() as cli:
        lb.serve("TCP", (VIP, PORT))
        lb.serve("UDP", (VIP, PORT))
        cli.sendto(b"before", (VIP, PORT))
        assert receive(lb.udp) is not None

        for _ in lb.sk.changes(frozenset(), proto="UDP"):
            pass
        assert lb.sk.served_of("UDP") == set() and lb.sk.served == {(VIP, PORT)}
        cli.sendto(b"after", (VIP, PORT))
        assert receive(lb.udp, NOTHING) is None
        # Nothing else listens there: the kernel's port unreachable comes back.
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as conn:
            conn.settimeout(1.0)
            conn.connect((VIP, PORT))
            conn.send(b"after")
            with pytest.raises(ConnectionRefusedError):
                conn.recv(100)
        assert tcp_connects((VIP, PORT))  # TCP's pair is untouched
        lb.tcp.accept()[0].close()


def test_an_unserved_udp_pair_is_no_longer_steered() -> None:
    in_fresh_netns("sku3", unserved_no_longer_steered)


# -- the pure pieces --------------------------------------------------------------------------

def test_the_key_names_the_protocol_and_the_api_refuses_what_it_cannot_steer() -> None:
    assert pair_key(VIP, PORT, "TCP") != pair_key(VIP, PORT, "UDP")
    assert pair_key(VIP, PORT) == pair_key(VIP, PORT, "TCP")
    assert pair_key(VIP, PORT, "UDP") == socket.inet_aton(VIP) + struct.pack("=II", PORT, 17)
    assert pktinfo_cmsg(VIP)[2] == bytes(4) + socket.inet_aton(VIP) + bytes(4)


def refusals() -> None:
    with lab() as lb:
        with pytest.raises(ValueError):
            lb.sk.served_of("SCTP")
        with pytest.raises(ValueError):
            next(lb.sk.changes(frozenset({(VIP, PORT)}), proto="SCTP"))
        with socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP) as raw, \
                pytest.raises(ValueError):
            lb.sk.steer_to(raw)


def test_other_protocols_are_refused() -> None:
    in_fresh_netns("sku4", refusals)

