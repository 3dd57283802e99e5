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

For a TCP socket, absolute loads are relative to the TCP header; the
source address is reached through the ancillary ``SKF_NET_OFF`` base: at
offset 12 of an IPv4 header, at offset 8 of an IPv6 one (16 bytes, four
32-bit loads). A listener's filter sees only its own family's packets, so
an IPv6 listener gets the IPv6 program (``family=6``), which passes the
node's IPv6 addresses and ``::1`` instead of 127.0.0.0/8.
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
BPF_ALU_MOD_K = 0x94  # BPF_ALU | BPF_MOD | BPF_K
BPF_RET_A = 0x16  # BPF_RET | BPF_A

TCP_FLAGS_OFFSET = 13
TCP_SYN = 0x02
TCP_ACK = 0x10
IPV4_SRC_OFFSET = 12
IPV6_SRC_OFFSET = 8
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
    family: int = 4,
) -> list[Instruction]:
    """The filter for a listener of ``family`` whose external SYNs must be dropped.

    Accepts every packet whose source is one of ``local_addresses``, the
    family's loopback (127.0.0.0/8, ``::1``), or in ``pass_networks``
    (``--cluster-cidr``: pod traffic gets Cluster semantics, so its SYNs
    must reach the proxy), then drops pure SYNs (SYN set, ACK clear) and
    accepts the rest. Addresses and networks of the other family are
    ignored: the listener never sees them.
    """
    if family not in (4, 6):
        raise ValueError(f"family {family}: must be 4 or 6")
    words = 1 if family == 4 else 4
    loopback = "127.0.0.0/8" if family == 4 else "::1/128"
    tests: list[tuple[int, int]] = []  # (network, prefix length), each one a test
    for a in dict.fromkeys(local_addresses):
        ip = ipaddress.ip_address(a)
        if ip.version == family:
            tests.append((int(ip), ip.max_prefixlen))
    n_addrs = len(tests)
    tests.append((int(ipaddress.ip_network(loopback).network_address),
                  ipaddress.ip_network(loopback).prefixlen))
    for net in dict.fromkeys(pass_networks):
        if net.version == family:
            tests.append((int(net.network_address), net.prefixlen))
    n_nets = len(tests) - n_addrs - 1
    if family == 4 and n_addrs + 3 * n_nets > MAX_ADDRESSES:
        raise ValueError(
            f"{n_addrs} local addresses and {n_nets} networks; "
            f"a SYN filter holds at most {MAX_ADDRESSES} tests"
        )
    if family == 6 and 8 * (n_addrs + n_nets) > MAX_ADDRESSES:
        raise ValueError(
            f"{n_addrs} local IPv6 addresses and {n_nets} networks; "
            f"an IPv6 SYN filter holds at most {MAX_ADDRESSES // 8} of them"
        )

    # Each test: per 32-bit word its prefix covers, load the source word,
    # mask it if the prefix ends inside it, compare; a mismatch jumps to the
    # next test, the last word's match to accept. Then the pure-SYN test
    # (3), accept, drop.
    blocks: list[list[tuple[int, int, int]]] = []  # per test: (offset, mask, value) per word
    base = SKF_NET_OFF + (IPV4_SRC_OFFSET if family == 4 else IPV6_SRC_OFFSET)
    for value, plen in tests:
        block = []
        for i in range(words):
            bits = min(32, max(0, plen - 32 * i))
            if not bits:
                break
            mask = (0xFFFFFFFF << (32 - bits)) & 0xFFFFFFFF
            word = (value >> (32 * (words - 1 - i))) & 0xFFFFFFFF
            block.append((base + 4 * i, mask, word & mask))
        blocks.append(block)
    # IPv4 tests are one word each: a test after an unmasked one finds the
    # source still in the accumulator, whichever way it was reached, and
    # skips the load (the program IPv4 listeners have always had).
    loads = [i == 0 or words > 1 or blocks[i - 1][0][1] != 0xFFFFFFFF
             for i in range(len(blocks))]
    sizes = [sum(2 if mask != 0xFFFFFFFF else 1 for _, mask, _ in b) + len(b) - (not load)
             for b, load in zip(blocks, loads, strict=True)]
    accept_at = sum(sizes) + 3
    prog: list[Instruction] = []
    for block, size, load in zip(blocks, sizes, loads, strict=True):
        next_test = len(prog) + size
        for j, (offset, mask, word) in enumerate(block):
            if load or j:
                prog.append((BPF_LD_W_ABS, 0, 0, _u32(offset)))
            if mask != 0xFFFFFFFF:
                prog.append((BPF_ALU_AND_K, 0, 0, mask))
            here = len(prog) + 1
            jt = accept_at - here if j == len(block) - 1 else 0
            prog.append((BPF_JMP_JEQ_K, jt, next_test - here, word))
    prog.append((BPF_LD_B_ABS, 0, 0, TCP_FLAGS_OFFSET))
    prog.append((BPF_ALU_AND_K, 0, 0, TCP_SYN | TCP_ACK))
    # jt skips the accept instruction and lands on drop.
    prog.append((BPF_JMP_JEQ_K, 1, 0, TCP_SYN))
    prog.append((BPF_RET_K, 0, 0, ACCEPT))
    prog.append((BPF_RET_K, 0, 0, DROP))
    assert len(prog) == accept_at + 2
    if any(jt > 255 or jf > 255 for _, jt, jf, _ in prog):
        raise ValueError("SYN filter too long for cBPF's 8-bit jumps")
    return prog


def program_bytes(program: Iterable[Instruction]) -> bytes:
    """The program as the kernel's array of ``struct sock_filter``."""
    return b"".join(_INSN.pack(*insn) for insn in program)


def run_program(program: list[Instruction], src_ip: str, tcp_flags: int) -> bool:
    """Interpret ``program`` for one TCP segment from ``src_ip``; True means accepted.

    A tiny cBPF interpreter covering the opcodes ``syn_drop_program`` and
    ``reuseport_steering_program`` emit, over a network header of
    ``src_ip``'s family with the source in place (as the kernel shows it
    through ``SKF_NET_OFF``), so tests can check the program's meaning and
    not only its bytes.
    """
    return program_result(program, src_ip, tcp_flags) != 0


def program_result(program: list[Instruction], src_ip: str, tcp_flags: int) -> int:
    """What ``program`` returns for one TCP segment from ``src_ip``."""
    ip = ipaddress.ip_address(src_ip)
    if ip.version == 4:
        header = bytes(IPV4_SRC_OFFSET) + ip.packed + bytes(4)
    else:
        header = bytes(IPV6_SRC_OFFSET) + ip.packed + bytes(16)
    acc = 0
    pc = 0
    for _ in range(len(program) + 1):
        code, jt, jf, k = program[pc]
        if code == BPF_LD_W_ABS:
            offset = k - _u32(SKF_NET_OFF)
            if not 0 <= offset <= len(header) - 4:
                raise ValueError(f"unsupported load offset {k:#x}")
            acc = int.from_bytes(header[offset:offset + 4], "big")
        elif code == BPF_LD_B_ABS:
            if k != TCP_FLAGS_OFFSET:
                raise ValueError(f"unsupported byte load offset {k}")
            acc = tcp_flags & 0xFF
        elif code == BPF_ALU_AND_K:
            acc &= k
        elif code == BPF_ALU_MOD_K:
            acc %= k
        elif code == BPF_JMP_JEQ_K:
            pc += jt if acc == k else jf
        elif code == BPF_RET_K:
            return k
        elif code == BPF_RET_A:
            return acc
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


def reuseport_steering_program(workers: int, family: int = 4) -> list[Instruction]:
    """``socks[src_ip % workers]``: the index of the listener in the group.

    For IPv6, the source's last 32 bits: the part that differs between
    clients of one prefix.
    """
    if workers < 1:
        raise ValueError("workers must be at least 1")
    offset = IPV4_SRC_OFFSET if family == 4 else IPV6_SRC_OFFSET + 12
    return [
        (BPF_LD_W_ABS, 0, 0, _u32(SKF_NET_OFF + offset)),
        (BPF_ALU_MOD_K, 0, 0, workers),
        (BPF_RET_A, 0, 0, 0),
    ]


def attach_reuseport(sock: socket.socket, program: list[Instruction]) -> None:
    """Set the reuseport group's selection program (after ``listen``). Raises OSError."""
    _set_program(sock, SO_ATTACH_REUSEPORT_CBPF, program)


def detach_reuseport(sock: socket.socket) -> None:
    """Back to the kernel's 4-tuple hash; a group without a program is left as it is."""
    _detach(sock, SO_DETACH_REUSEPORT_BPF)
