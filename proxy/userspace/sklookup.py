"""Every service VIP's connections and datagrams to one socket: an eBPF ``sk_lookup`` program.

Owns: in the namespace kpx runs in, one ``BPF_PROG_TYPE_SK_LOOKUP`` program
linked to the namespace, a hash map of the served ``(VIP, port, protocol)``
triples and a two-slot sockmap: slot 0 the TCP VIP listener, slot 1 the UDP
VIP socket. When the kernel looks for the socket of a TCP SYN or of a UDP
datagram to a local address (the VIPs are local: ``proxy.userspace.vips``),
the program finds the triple in the map and hands the lookup the socket of
that protocol's slot (``bpf_sk_assign``), whatever address that socket is
bound to; everything else (other protocols, pairs not served for that
protocol, an empty slot) goes on to the normal lookup. TCP and UDP on the
same ``VIP:port`` are independent entries, as Services declare them.

The accepted TCP socket's own address is the VIP and port the client
dialled, so ``getsockname()`` says which service it is. A UDP socket has no
per-flow socket: it learns the VIP and port a datagram was sent to from
``IP_RECVORIGDSTADDR`` (``IP_PKTINFO`` gives the address but not the port).
An answer's source port is always its socket's own, which ``IP_PKTINFO``
cannot change, so ``proxy.userspace.udp`` answers through a socket bound to
``VIP:port`` (one the program overrides, so it never receives).

Never: touch another namespace, or outlive the process: the program and
maps are reference-counted by their fds (no pinning), so they go when kpx
exits, however it exits. Several kpx processes (``--workers``, a restart's
successor) each link their own program; they steer to the same listener or
to one of a reuseport group, which the kernel then picks from.

Why ``sk_lookup`` (Linux 5.9+, ``CONFIG_BPF_SYSCALL``), against the two other
ways to reach one listener for many addresses (figures: docs/PERFORMANCE.md,
"Service VIPs"):

- nft ``tproxy`` into a transparent listener: a pod's packets cross the
  node's pod bridge, and with ``br_netfilter`` (which kube-proxy's iptables
  mode needs, and which applies wherever the module is loaded) prerouting
  runs at the bridge, before the IP layer drops the socket ``tproxy``
  assigned: the pod's SYN meets no listener and is reset;
- conntrack DNAT (``redirect``) to it: works through the bridge, but nat
  chains switch connection tracking on for every packet in the namespace,
  NodePort traffic included: 7-12 µs of CPU per connection, 10-15% fewer
  connections per second on this VM;
- a listener per ``VIP:port`` (IPVS mode's way) needs no program, but costs
  a descriptor, a bind and an epoll entry each: 10,000 ClusterIPs next to
  10,000 NodePorts exceed a 20,000-fd limit, and the binds make an apply
  1.8 times slower.

The socket lookup is the last step of local delivery, after the bridge and
every hook, so the program sees pods, the node's own processes (over
``lo``) and outside clients alike, with no conntrack and no rule per VIP.
No compiler or library is needed: the program is 35 instructions written
here, loaded with bpf(2) through ctypes.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import socket
import struct
from collections.abc import Iterable, Iterator

NR_BPF = 321
"""bpf(2) on x86_64 (``__NR_bpf``); kpx runs on x86_64 Linux."""

# bpf(2) commands, map and program types (``include/uapi/linux/bpf.h``).
BPF_MAP_CREATE = 0
BPF_MAP_UPDATE_ELEM = 2
BPF_MAP_DELETE_ELEM = 3
BPF_PROG_LOAD = 5
BPF_MAP_UPDATE_BATCH = 26
BPF_MAP_DELETE_BATCH = 27
BPF_LINK_CREATE = 28
BPF_MAP_TYPE_HASH = 1
BPF_MAP_TYPE_SOCKMAP = 15
BPF_F_NO_PREALLOC = 1
BPF_PROG_TYPE_SK_LOOKUP = 30
BPF_SK_LOOKUP = 36
BPF_PSEUDO_MAP_FD = 1

HELPER_MAP_LOOKUP = 1
HELPER_SK_RELEASE = 86
HELPER_SK_ASSIGN = 124
SK_PASS = 1

# struct bpf_sk_lookup: offsets of the fields the program reads.
CTX_FAMILY = 8
CTX_PROTOCOL = 12
CTX_LOCAL_IP4 = 40
CTX_LOCAL_PORT = 60

MAX_PAIRS = 1 << 18
"""Capacity of the pair map (no preallocation: memory follows what is in it)."""
BATCH = 2048
"""Pairs per batch syscall: the loop waits for each (1.3 ms in the kernel, 0.4 ms
to build its keys; 8,192 took 7 ms)."""

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


def _bpf(cmd: int, attr: bytes) -> int:
    # The kernel reads at most what it knows of ``union bpf_attr``; zeros past
    # what we pack keep newer fields at their defaults.
    buf = ctypes.create_string_buffer(attr, 144)
    ret = _libc.syscall(NR_BPF, cmd, buf, 144)
    if ret < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"bpf({cmd}): {os.strerror(err)}")
    return int(ret)


def _insn(op: int, dst: int = 0, src: int = 0, off: int = 0, imm: int = 0) -> bytes:
    return struct.pack("=BBhi", op, (src << 4) | dst, off, imm)


def _ld_map(dst: int, fd: int) -> bytes:
    """``dst = &map`` (a two-slot ``BPF_LD | BPF_IMM | BPF_DW`` with a map fd)."""
    return _insn(0x18, dst, BPF_PSEUDO_MAP_FD, 0, fd) + _insn(0)


PROTOCOLS = {"TCP": socket.IPPROTO_TCP, "UDP": socket.IPPROTO_UDP}
"""The protocols the program steers, by the names Services use; sk_lookup knows no others."""
SLOTS = {"TCP": 0, "UDP": 1}
"""The sockmap slot of each protocol's socket (the program hard-codes TCP 0, UDP 1)."""
_SLOT_OF_TYPE = {socket.SOCK_STREAM: "TCP", socket.SOCK_DGRAM: "UDP"}


def program(pairs_fd: int, sockmap_fd: int) -> bytes:
    """The sk_lookup program: a served IPv4 ``(local_ip4, local_port, protocol)`` to its socket.

    The pair map's key is the context's ``local_ip4`` (network order), then
    ``local_port`` (host order, u32), then ``protocol`` (u32), exactly as the
    program stores them (``pair_key``). The sockmap slot follows the
    protocol: TCP 0, UDP 1 (``SLOTS``); the kernel would refuse a socket of
    the other protocol anyway (``-EPROTOTYPE``), and a missing one is passed.
    """
    to_pass = 33  # the slot of ``r0 = SK_PASS``; a jump's offset counts from the next slot
    tcp, udp = socket.IPPROTO_TCP, socket.IPPROTO_UDP
    return b"".join([
        _insn(0xBF, 6, 1),                                    # 0  r6 = ctx
        _insn(0x61, 2, 6, CTX_FAMILY),                        # 1  r2 = ctx->family
        _insn(0x55, 2, 0, to_pass - 3, socket.AF_INET),       # 2  not IPv4: pass
        _insn(0x61, 7, 6, CTX_PROTOCOL),                      # 3  r7 = ctx->protocol
        _insn(0xB7, 8, 0, 0, SLOTS["TCP"]),                   # 4  r8 = slot = TCP's
        _insn(0x15, 7, 0, 8 - 6, tcp),                        # 5  TCP: to the key
        _insn(0xB7, 8, 0, 0, SLOTS["UDP"]),                   # 6  r8 = slot = UDP's
        _insn(0x55, 7, 0, to_pass - 8, udp),                  # 7  neither TCP nor UDP: pass
        _insn(0x61, 2, 6, CTX_LOCAL_IP4),                     # 8  key[0:4] = local_ip4
        _insn(0x63, 10, 2, -12),                              # 9
        _insn(0x61, 2, 6, CTX_LOCAL_PORT),                    # 10 key[4:8] = local_port
        _insn(0x63, 10, 2, -8),                               # 11
        _insn(0x63, 10, 7, -4),                               # 12 key[8:12] = protocol
        _insn(0xBF, 2, 10),                                   # 13 r2 = &key
        _insn(0x07, 2, 0, 0, -12),                            # 14
        _ld_map(1, pairs_fd),                                 # 15-16 r1 = pairs
        _insn(0x85, 0, 0, 0, HELPER_MAP_LOOKUP),              # 17 r0 = lookup(pairs, &key)
        _insn(0x15, 0, 0, to_pass - 19, 0),                   # 18 not served: pass
        _insn(0x63, 10, 8, -16),                              # 19 slot, on the stack
        _insn(0xBF, 2, 10),                                   # 20 r2 = &slot
        _insn(0x07, 2, 0, 0, -16),                            # 21
        _ld_map(1, sockmap_fd),                               # 22-23 r1 = sockmap
        _insn(0x85, 0, 0, 0, HELPER_MAP_LOOKUP),              # 24 r0 = the socket, referenced
        _insn(0x15, 0, 0, to_pass - 26, 0),                   # 25 none: pass
        _insn(0xBF, 7, 0),                                    # 26 r7 = sk
        _insn(0xBF, 1, 6),                                    # 27 sk_assign(ctx, sk, 0)
        _insn(0xBF, 2, 7),                                    # 28
        _insn(0xB7, 3, 0, 0, 0),                              # 29
        _insn(0x85, 0, 0, 0, HELPER_SK_ASSIGN),               # 30
        _insn(0xBF, 1, 7),                                    # 31 sk_release(sk)
        _insn(0x85, 0, 0, 0, HELPER_SK_RELEASE),              # 32
        _insn(0xB7, 0, 0, 0, SK_PASS),                        # 33 pass: r0 = SK_PASS
        _insn(0x95),                                          # 34 exit
    ])


def pair_key(ip: str, port: int, proto: str = "TCP") -> bytes:
    """The pair map's key for ``ip:port`` over ``proto`` (the layout ``program`` builds)."""
    return socket.inet_aton(ip) + struct.pack("=II", port, PROTOCOLS[proto])


def _proto(proto: str) -> str:
    if proto not in PROTOCOLS:
        raise ValueError(f"sk_lookup steers TCP and UDP only, not {proto!r}")
    return proto


class SkLookup:
    """The namespace-linked program, its pair map and its two-socket sockmap.

    Construct it in the namespace to serve (OSError if the kernel refuses:
    no ``sk_lookup``, no CAP_BPF); ``steer_to(sock)`` sets the TCP listener
    or the UDP socket; ``changes(served, proto)`` yields the pair map
    changes for one protocol as batch syscalls, so a caller on the event
    loop can yield between them; ``close()`` unlinks.
    """

    def __init__(self) -> None:
        self._fds: list[int] = []
        try:
            self.pairs_fd = self._keep(_bpf(BPF_MAP_CREATE, struct.pack(
                "=IIIII", BPF_MAP_TYPE_HASH, len(pair_key("0.0.0.0", 0)), 1, MAX_PAIRS,
                BPF_F_NO_PREALLOC)))
            self.sockmap_fd = self._keep(_bpf(BPF_MAP_CREATE, struct.pack(
                "=IIIII", BPF_MAP_TYPE_SOCKMAP, 4, 8, len(SLOTS), 0)))
            self.prog_fd = self._keep(self._load(program(self.pairs_fd, self.sockmap_fd)))
            netns = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
            try:
                self.link_fd = self._keep(_bpf(BPF_LINK_CREATE, struct.pack(
                    "=IIII", self.prog_fd, netns, BPF_SK_LOOKUP, 0)))
            finally:
                os.close(netns)
        except BaseException:
            self.close()
            raise
        self._served: dict[str, set[tuple[str, int]]] = {proto: set() for proto in PROTOCOLS}
        """Per protocol, the pairs the map holds now (updated batch by batch)."""

    @property
    def served(self) -> set[tuple[str, int]]:
        """The TCP pairs the map holds now (the dataplane's VIP listener's)."""
        return self._served["TCP"]

    def served_of(self, proto: str) -> set[tuple[str, int]]:
        """The pairs the map holds now for ``proto`` ("TCP" or "UDP")."""
        return self._served[_proto(proto)]

    def _keep(self, fd: int) -> int:
        self._fds.append(fd)
        return fd

    @staticmethod
    def _load(code: bytes) -> int:
        insns = ctypes.create_string_buffer(code, len(code))
        license_ = ctypes.create_string_buffer(b"GPL")
        log = ctypes.create_string_buffer(1 << 16)
        attr = struct.pack(
            "=IIQQIIQII16sII", BPF_PROG_TYPE_SK_LOOKUP, len(code) // 8,
            ctypes.addressof(insns), ctypes.addressof(license_), 1, len(log),
            ctypes.addressof(log), 0, 0, b"kpx_vips", 0, BPF_SK_LOOKUP)
        try:
            return _bpf(BPF_PROG_LOAD, attr)
        except OSError as exc:
            why = log.value.decode(errors="replace").strip().splitlines()[-3:]
            raise OSError(exc.errno, f"cannot load the sk_lookup program: {exc.strerror}"
                          f"{': ' + ' / '.join(why) if why else ''}") from None

    def steer_to(self, sock: socket.socket) -> None:
        """Make ``sock`` the one every served pair of its protocol goes to.

        A listening TCP socket (``SOCK_STREAM``) takes the TCP slot, a bound
        UDP socket (``SOCK_DGRAM``) the UDP one: the type says which, so a
        caller cannot put a socket where the kernel would refuse to assign it.
        """
        proto = _SLOT_OF_TYPE.get(sock.type)
        if proto is None:
            raise ValueError(f"sk_lookup steers to TCP or UDP sockets, not {sock.type!r}")
        key = ctypes.create_string_buffer(struct.pack("=I", SLOTS[proto]), 4)
        value = ctypes.create_string_buffer(struct.pack("=Q", sock.fileno()), 8)
        _bpf(BPF_MAP_UPDATE_ELEM, struct.pack(
            "=IIQQQ", self.sockmap_fd, 0, ctypes.addressof(key), ctypes.addressof(value), 0))

    def changes(self, served: frozenset[tuple[str, int]], proto: str = "TCP") -> Iterator[None]:
        """Make the map's ``proto`` pairs ``served``: one batch syscall per ``next``.

        Adds first, then deletes; the other protocol's pairs are left as
        they are. On OSError the map holds what the batches before it did,
        and ``served_of(proto)`` says so.
        """
        mine = self._served[_proto(proto)]
        add = list(served.difference(mine))
        gone = list(mine.difference(served))
        for i in range(0, len(add), BATCH):
            chunk = add[i:i + BATCH]
            self._batch(BPF_MAP_UPDATE_BATCH, chunk, proto)
            mine.update(chunk)
            yield
        for i in range(0, len(gone), BATCH):
            chunk = gone[i:i + BATCH]
            self._batch(BPF_MAP_DELETE_BATCH, chunk, proto)
            mine.difference_update(chunk)
            yield

    def _batch(self, cmd: int, pairs: Iterable[tuple[str, int]], proto: str) -> None:
        pairs = list(pairs)
        if not pairs:
            return
        keys = ctypes.create_string_buffer(b"".join(pair_key(a, p, proto) for a, p in pairs))
        values = ctypes.create_string_buffer(b"\1" * len(pairs))
        # { u64 in_batch, out_batch, keys, values; u32 count, map_fd; u64 elem_flags, flags }
        attr = struct.pack("=QQQQIIQQ", 0, 0, ctypes.addressof(keys),
                           ctypes.addressof(values) if cmd == BPF_MAP_UPDATE_BATCH else 0,
                           len(pairs), self.pairs_fd, 0, 0)
        try:
            _bpf(cmd, attr)
        except OSError as exc:
            if exc.errno != errno.ENOENT:  # deleting what is not there is done
                raise

    def close(self) -> None:
        """Unlink the program and free the maps (the kernel frees what no fd holds). Idempotent."""
        for fd in reversed(self._fds):
            with contextlib.suppress(OSError):
                os.close(fd)
        self._fds.clear()
