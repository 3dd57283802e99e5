"""DROP without a firewall: a classic BPF filter that discards pure SYNs.

Owns: building the cBPF program (a pure function, so its bytes are unit
tested) and attaching it to / detaching it from one listening socket.

Never: decide *when* to drop (``decision.PortPlan.drop_external`` does),
touch netfilter, or attach to a loopback listener (its sources are always
local, so there is nothing to drop there).

Why this works (kpx decision 1): ``tcp_v4_rcv()`` runs the listener's socket
filter before any request socket exists, so a SYN the filter rejects gets
neither SYN-ACK nor RST and the client's connect times out, exactly like
kube-proxy's ``DROP``. The filter must match only *pure* SYNs: the final ACK
of an in-flight handshake also passes the listener's filter, and accepted
children inherit it. SYNs from the node's own addresses (and 127.0.0.0/8)
pass, because node-originated traffic gets Cluster semantics even under
eTP=Local. Attach and detach are atomic; no listener restart is needed.

On a wildcard (``0.0.0.0``) listener, the default without
``--nodeport-addresses``, the one filter covers every local address:
external SYNs to any of them are dropped, while a connection to 127.0.0.1
comes from 127.0.0.0/8 (unless a local program binds another local source
on purpose), which passes, so localhost NodePorts keep working on the same
socket.

For a TCP socket, absolute loads are relative to the TCP header; the IPv4
source address is reached through the ancillary ``SKF_NET_OFF`` base.
"""

from __future__ import annotations

import ctypes
import errno
import ipaddress
import socket
import struct
from collections.abc import Iterable

SO_ATTACH_FILTER = 26
SO_DETACH_FILTER = 27
SKF_NET_OFF = -0x100000

# cBPF opcodes (linux/filter.h, linux/bpf_common.h).
BPF_LD_W_ABS = 0x20  # BPF_LD | BPF_W | BPF_ABS
BPF_LD_B_ABS = 0x30  # BPF_LD | BPF_B | BPF_ABS
BPF_ALU_AND_K = 0x54  # BPF_ALU | BPF_AND | BPF_K
BPF_JMP_JEQ_K = 0x15  # BPF_JMP | BPF_JEQ | BPF_K
BPF_RET_K = 0x06  # BPF_RET | BPF_K

TCP_FLAGS_OFFSET = 13
TCP_SYN = 0x02
TCP_ACK = 0x10
IPV4_SRC_OFFSET = 12
ACCEPT = 0xFFFFFFFF
DROP = 0

MAX_ADDRESSES = 240
"""Conditional jumps reach at most 255 instructions ahead; stay well inside."""

Instruction = tuple[int, int, int, int]
"""``struct sock_filter``: (code, jt, jf, k)."""

_INSN = struct.Struct("HBBI")


def _u32(value: int) -> int:
    return value & 0xFFFFFFFF


def syn_drop_program(
    local_addresses: Iterable[str],
    pass_networks: Iterable[ipaddress.IPv4Network | ipaddress.IPv6Network] = (),
) -> list[Instruction]:
    """The filter for a listener whose external SYNs must be dropped.

    Accepts every packet whose IPv4 source is one of ``local_addresses``, in
    127.0.0.0/8, or in ``pass_networks`` (``--cluster-cidr``: pod traffic gets
    Cluster semantics, so its SYNs must reach the proxy), then drops pure SYNs
    (SYN set, ACK clear) and accepts the rest. IPv6 is ignored: kpx listens on
    IPv4 only.
    """
    addrs: list[int] = []
    for a in dict.fromkeys(local_addresses):
        ip = ipaddress.ip_address(a)
        if ip.version == 4:
            addrs.append(int(ip))
    nets = [
        (int(net.network_address), int(net.netmask))
        for net in dict.fromkeys(pass_networks)
        if net.version == 4
    ]
    if len(addrs) + 3 * len(nets) > MAX_ADDRESSES:
        raise ValueError(
            f"{len(addrs)} local addresses and {len(nets)} networks; "
            f"a SYN filter holds at most {MAX_ADDRESSES} tests"
        )

    n, m = len(addrs), len(nets)
    # Layout: [0] load source, [1..n] address tests, [n+1..n+2] 127/8 test,
    # 3 per pass network (reload source, mask, compare), then the pure-SYN
    # test (3), accept, drop.
    accept_at = n + 3 + 3 * m + 3
    prog: list[Instruction] = [(BPF_LD_W_ABS, 0, 0, _u32(SKF_NET_OFF + IPV4_SRC_OFFSET))]

    def to_accept(value: int) -> Instruction:
        return (BPF_JMP_JEQ_K, accept_at - (len(prog) + 1), 0, value)

    for addr in addrs:
        prog.append(to_accept(addr))
    prog.append((BPF_ALU_AND_K, 0, 0, 0xFF000000))
    prog.append(to_accept(0x7F000000))
    for net, mask in nets:
        prog.append((BPF_LD_W_ABS, 0, 0, _u32(SKF_NET_OFF + IPV4_SRC_OFFSET)))
        prog.append((BPF_ALU_AND_K, 0, 0, mask))
        prog.append(to_accept(net))
    prog.append((BPF_LD_B_ABS, 0, 0, TCP_FLAGS_OFFSET))
    prog.append((BPF_ALU_AND_K, 0, 0, TCP_SYN | TCP_ACK))
    # jt skips the accept instruction and lands on drop.
    prog.append((BPF_JMP_JEQ_K, 1, 0, TCP_SYN))
    prog.append((BPF_RET_K, 0, 0, ACCEPT))
    prog.append((BPF_RET_K, 0, 0, DROP))
    assert len(prog) == accept_at + 2
    return prog


def program_bytes(program: Iterable[Instruction]) -> bytes:
    """The program as the kernel's array of ``struct sock_filter``."""
    return b"".join(_INSN.pack(*insn) for insn in program)


def run_program(program: list[Instruction], src_ip: str, tcp_flags: int) -> bool:
    """Interpret ``program`` for one IPv4 TCP segment; True means accepted.

    A tiny cBPF interpreter covering the opcodes ``syn_drop_program`` emits,
    so tests can check the program's meaning and not only its bytes.
    """
    src = int(ipaddress.IPv4Address(src_ip))
    acc = 0
    pc = 0
    for _ in range(len(program) + 1):
        code, jt, jf, k = program[pc]
        if code == BPF_LD_W_ABS:
            if k != _u32(SKF_NET_OFF + IPV4_SRC_OFFSET):
                raise ValueError(f"unsupported load offset {k:#x}")
            acc = src
        elif code == BPF_LD_B_ABS:
            if k != TCP_FLAGS_OFFSET:
                raise ValueError(f"unsupported byte load offset {k}")
            acc = tcp_flags & 0xFF
        elif code == BPF_ALU_AND_K:
            acc &= k
        elif code == BPF_JMP_JEQ_K:
            pc += jt if acc == k else jf
        elif code == BPF_RET_K:
            return k != 0
        else:
            raise ValueError(f"unsupported opcode {code:#x}")
        pc += 1
    raise ValueError("program does not terminate")


def _set_program(sock: socket.socket, option: int, program: list[Instruction]) -> None:
    raw = program_bytes(program)
    buf = ctypes.create_string_buffer(raw, len(raw))
    # struct sock_fprog { unsigned short len; struct sock_filter *filter; }:
    # native alignment pads the short to the pointer, as the kernel expects.
    fprog = struct.pack("HL", len(program), ctypes.addressof(buf))
    sock.setsockopt(socket.SOL_SOCKET, option, fprog)


def attach(sock: socket.socket, program: list[Instruction]) -> None:
    """Attach (or atomically replace) ``sock``'s filter. Raises OSError."""
    _set_program(sock, SO_ATTACH_FILTER, program)


def _detach(sock: socket.socket, option: int) -> None:
    try:
        sock.setsockopt(socket.SOL_SOCKET, option, 0)
    except OSError as exc:
        if exc.errno != errno.ENOENT:  # nothing attached: already the wanted state
            raise


def detach(sock: socket.socket) -> None:
    """Remove ``sock``'s filter; a socket without one is left as it is."""
    _detach(sock, SO_DETACH_FILTER)



# -- worker steering ------------------------------------------------------------
#
# With ``--workers N`` every worker holds its own SO_REUSEPORT listener on the
# same address and port. By default the kernel spreads connections over them
# by a hash of the 4-tuple, so one client's connections land on different
# workers, each with its own affinity table. For ClientIP session affinity
# the group gets a reuseport program that picks the socket by the client's
# IPv4 source address alone: the same client always meets the same worker,
# hence the same affinity record.

SO_ATTACH_REUSEPORT_CBPF = 51
SO_DETACH_REUSEPORT_BPF = 68
BPF_ALU_MOD_K = 0x94  # BPF_ALU | BPF_MOD | BPF_K
BPF_RET_A = 0x16  # BPF_RET | BPF_A


def reuseport_steering_program(workers: int) -> list[Instruction]:
    """``socks[src_ip % workers]``: the index of the listener in the group."""
    if workers < 1:
        raise ValueError("workers must be at least 1")
    return [
        (BPF_LD_W_ABS, 0, 0, _u32(SKF_NET_OFF + IPV4_SRC_OFFSET)),
        (BPF_ALU_MOD_K, 0, 0, workers),
        (BPF_RET_A, 0, 0, 0),
    ]


def attach_reuseport(sock: socket.socket, program: list[Instruction]) -> None:
    """Set the reuseport group's selection program (after ``listen``). Raises OSError."""
    _set_program(sock, SO_ATTACH_REUSEPORT_CBPF, program)


def detach_reuseport(sock: socket.socket) -> None:
    """Back to the kernel's 4-tuple hash; a group without a program is left as it is."""
    _detach(sock, SO_DETACH_REUSEPORT_BPF)
