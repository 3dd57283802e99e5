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
No compiler or library is needed: the program is 35 instructions (41 for
IPv6) written here, loaded with bpf(2) through ctypes.

One program per family: ``SkLookup(family=6)`` reads the context's
``local_ip6`` into a 24-byte key and passes IPv4 lookups, the IPv4 one the
reverse; each family's dataplane links its own, and a socket of its family
(``::1`` for the IPv6 VIP listener) takes the lookups it assigns.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import resource
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
CTX_LOCAL_IP6 = 44
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


def _lift_memlock() -> bool:
    """Raise RLIMIT_MEMLOCK as libbpf does for kernels that charge BPF to it; True if raised.

    To unlimited where allowed (CAP_SYS_RESOURCE: a privileged container, root
    on a node), else the soft limit to the hard one. Kernels since 5.11 charge
    BPF memory to the memory cgroup instead and never call this: only their
    EPERM does, and they raise no EPERM for memory.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if soft == resource.RLIM_INFINITY:
        return False
    for limits in ((resource.RLIM_INFINITY, resource.RLIM_INFINITY), (hard, hard)):
        if limits[0] == soft:
            continue
        try:
            resource.setrlimit(resource.RLIMIT_MEMLOCK, limits)
        except (OSError, ValueError):
            continue
        return True
    return False


def _insn(op: int, dst: int = 0, src: int = 0, off: int = 0, imm: int = 0) -> bytes:
    return struct.pack("=BBhi", op, (src << 4) | dst, off, imm)


PROTOCOLS = {"TCP": socket.IPPROTO_TCP, "UDP": socket.IPPROTO_UDP}
"""The protocols the program steers, by the names Services use; sk_lookup knows no others."""
SLOTS = {"TCP": 0, "UDP": 1}
"""The sockmap slot of each protocol's socket (the program hard-codes TCP 0, UDP 1)."""
_SLOT_OF_TYPE = {socket.SOCK_STREAM: "TCP", socket.SOCK_DGRAM: "UDP"}


def program(pairs_fd: int, sockmap_fd: int, family: int = 4) -> bytes:
    """The sk_lookup program: a served ``(local_ip, local_port, protocol)`` to its socket.

    ``family`` 4 reads ``local_ip4``, 6 the four words of ``local_ip6``; a
    lookup of the other family is passed (each family's dataplane links its
    own program, as kube-proxy runs a proxier per family). The pair map's
    key is that address (network order), then ``local_port`` (host order,
    u32), then ``protocol`` (u32), exactly as the program stores them
    (``pair_key``). The sockmap slot follows the protocol: TCP 0, UDP 1
    (``SLOTS``); the kernel would refuse a socket of the other protocol
    anyway (``-EPROTOTYPE``), and a missing one is passed.
    """
    if family not in (4, 6):
        raise ValueError(f"family {family}: must be 4 or 6")
    words = (CTX_LOCAL_IP4,) if family == 4 else tuple(CTX_LOCAL_IP6 + 4 * i for i in range(4))
    key_len = 4 * len(words) + 8
    slot_at = -key_len - 4
    tcp, udp = socket.IPPROTO_TCP, socket.IPPROTO_UDP
    # (opcode, dst, src, offset, imm, the label a jump goes to); labels: slot numbers.
    code: list[tuple[int, int, int, int, int, str | None]] = []

    def op(o: int, dst: int = 0, src: int = 0, off: int = 0, imm: int = 0,
           to: str | None = None) -> None:
        code.append((o, dst, src, off, imm, to))

    labels: dict[str, int] = {}
    op(0xBF, 6, 1)                                        # r6 = ctx
    op(0x61, 2, 6, CTX_FAMILY)                            # r2 = ctx->family
    op(0x55, 2, 0, imm=_AF[family], to="pass")            # not this family: pass
    op(0x61, 7, 6, CTX_PROTOCOL)                          # r7 = ctx->protocol
    op(0xB7, 8, 0, imm=SLOTS["TCP"])                      # r8 = slot = TCP's
    op(0x15, 7, 0, imm=tcp, to="key")                     # TCP: to the key
    op(0xB7, 8, 0, imm=SLOTS["UDP"])                      # r8 = slot = UDP's
    op(0x55, 7, 0, imm=udp, to="pass")                    # neither TCP nor UDP: pass
    labels["key"] = len(code)
    for i, at in enumerate(words):                        # key[0:4n] = the local address
        op(0x61, 2, 6, at)
        op(0x63, 10, 2, -key_len + 4 * i)
    op(0x61, 2, 6, CTX_LOCAL_PORT)                        # then local_port
    op(0x63, 10, 2, -8)
    op(0x63, 10, 7, -4)                                   # then protocol
    op(0xBF, 2, 10)                                       # r2 = &key
    op(0x07, 2, 0, imm=-key_len)
    op(0x18, 1, BPF_PSEUDO_MAP_FD, imm=pairs_fd)          # r1 = pairs (two slots)
    op(0)
    op(0x85, imm=HELPER_MAP_LOOKUP)                       # r0 = lookup(pairs, &key)
    op(0x15, 0, 0, imm=0, to="pass")                      # not served: pass
    op(0x63, 10, 8, slot_at)                              # slot, on the stack
    op(0xBF, 2, 10)                                       # r2 = &slot
    op(0x07, 2, 0, imm=slot_at)
    op(0x18, 1, BPF_PSEUDO_MAP_FD, imm=sockmap_fd)        # r1 = sockmap (two slots)
    op(0)
    op(0x85, imm=HELPER_MAP_LOOKUP)                       # r0 = the socket, referenced
    op(0x15, 0, 0, imm=0, to="pass")                      # none: pass
    op(0xBF, 7, 0)                                        # r7 = sk
    op(0xBF, 1, 6)                                        # sk_assign(ctx, sk, 0)
    op(0xBF, 2, 7)
    op(0xB7, 3, 0, imm=0)
    op(0x85, imm=HELPER_SK_ASSIGN)
    op(0xBF, 1, 7)                                        # sk_release(sk)
    op(0x85, imm=HELPER_SK_RELEASE)
    labels["pass"] = len(code)
    op(0xB7, 0, 0, imm=SK_PASS)                           # pass: r0 = SK_PASS
    op(0x95)                                              # exit
    return b"".join(_insn(o, dst, src, off if to is None else labels[to] - i - 1, imm)
                    for i, (o, dst, src, off, imm, to) in enumerate(code))


_AF = {4: socket.AF_INET, 6: socket.AF_INET6}
_ANY = {4: "0.0.0.0", 6: "::"}


def pair_key(ip: str, port: int, proto: str = "TCP") -> bytes:
    """The pair map's key for ``ip:port`` over ``proto`` (the layout ``program`` builds).

    An IPv6 ``ip`` makes the 24-byte key of the IPv6 program's map.
    """
    packed = socket.inet_pton(socket.AF_INET6, ip) if ":" in ip else socket.inet_aton(ip)
    return packed + struct.pack("=II", port, PROTOCOLS[proto])


def _proto(proto: str) -> str:
    if proto not in PROTOCOLS:
        raise ValueError(f"sk_lookup steers TCP and UDP only, not {proto!r}")
    return proto


class SkLookup:
    """The namespace-linked program, its pair map and its two-socket sockmap.

    Construct it in the namespace to serve (OSError if the kernel refuses:
    no ``sk_lookup``, no CAP_BPF; an EPERM from a kernel before 5.11 that
    charges BPF to RLIMIT_MEMLOCK lifts that limit and builds once more);
    ``steer_to(sock)`` sets the TCP listener or the UDP socket;
    ``changes(served, proto)`` yields the pair map changes for one protocol
    as batch syscalls, so a caller on the event loop can yield between them;
    ``close()`` unlinks.
    """

    def __init__(self, family: int = 4) -> None:
        if family not in _AF:
            raise ValueError(f"family {family}: must be 4 or 6")
        self.family = family
        """The lookups it steers: IPv4 or IPv6 (the other family's are passed)."""
        self._fds: list[int] = []
        try:
            self._create()
        except OSError as exc:
            # Before Linux 5.11 maps and programs are charged to RLIMIT_MEMLOCK,
            # which refuses them with EPERM: the pair map alone is charged
            # several MiB (its 2^18 buckets), over the usual default limit
            # (64 KiB, or 8 MiB under a recent systemd) a container inherits.
            if exc.errno != errno.EPERM or not _lift_memlock():
                raise
            self._create()
        self._served: dict[str, set[tuple[str, int]]] = {proto: set() for proto in PROTOCOLS}
        """Per protocol, the pairs the map holds now (updated batch by batch)."""

    def _create(self) -> None:
        """The maps, the program and its link to this thread's namespace; all or none."""
        family = self.family
        try:
            self.pairs_fd = self._keep(_bpf(BPF_MAP_CREATE, struct.pack(
                "=IIIII", BPF_MAP_TYPE_HASH, len(pair_key(_ANY[family], 0)), 1, MAX_PAIRS,
                BPF_F_NO_PREALLOC)))
            self.sockmap_fd = self._keep(_bpf(BPF_MAP_CREATE, struct.pack(
                "=IIIII", BPF_MAP_TYPE_SOCKMAP, 4, 8, len(SLOTS), 0)))
            self.prog_fd = self._keep(self._load(program(self.pairs_fd, self.sockmap_fd,
                                                         family)))
            netns = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
            try:
                self.link_fd = self._keep(_bpf(BPF_LINK_CREATE, struct.pack(
                    "=IIII", self.prog_fd, netns, BPF_SK_LOOKUP, 0)))
            finally:
                os.close(netns)
        except BaseException:
            self.close()
            raise

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
        Its family must be the program's: the kernel refuses an IPv4 socket
        for an IPv6 lookup (``-EAFNOSUPPORT``) when it assigns, where nobody
        would see the error.
        """
        proto = _SLOT_OF_TYPE.get(sock.type)
        if proto is None:
            raise ValueError(f"sk_lookup steers to TCP or UDP sockets, not {sock.type!r}")
        if sock.family != _AF[self.family]:
            raise ValueError(f"the IPv{self.family} sk_lookup program cannot steer to a"
                             f" {sock.family.name} socket")
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
