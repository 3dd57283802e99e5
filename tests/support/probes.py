"""Observing the wire and the kernel from outside the proxy: raw SYNs and ``ss``.

Owns: the scapy probes. ``syn_answers(netns, targets, window)`` runs
this module as a script (``python -m tests.support.probes``) inside a
namespace: it sends one pure SYN per target from a source port no socket
owns, sniffs ``window`` seconds on ``iface`` and reports the TCP flags of
every answer per target, plus any ICMP the targets sent. ``syn_probe``
classifies the first answer the way the dataplane tests state it: a dropped
SYN gets *no* answer at all (``none``), a rejected one an RST at once
(``rst``), a served one a SYN-ACK (``synack``). ``udp_answers`` does the
same with one UDP datagram per target: replies and ICMP, or silence.

Also: ``ss_listening`` (LISTEN sockets, ``ss -ltnH``) and ``ss_drops`` (a
listener's drop counter, ``ss -m``), optionally inside a namespace.

Targets may be IPv4 or IPv6 (``ip`` with a colon), mixed in one probe;
ICMPv6 errors are reported like ICMP ones (``PORT_UNREACHABLE``).

Never: import scapy outside the probe process.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent.parent


def syn_answers(netns: str, targets: Iterable[tuple[str, int]], window: float = 1.5,
                iface: str = "eth0") -> tuple[dict[str, list[str]], list[str]]:
    """Send one raw SYN per target from ``netns`` and sniff ``window`` seconds on ``iface``.

    Returns ``({"ip:port": [tcp flags of each answer]}, [icmp messages from the targets])``.
    """
    result = _probe(netns, targets, window, iface, "tcp")
    return result["tcp"], result["icmp"]


def udp_answers(netns: str, targets: Iterable[tuple[str, int]], window: float = 1.5,
                iface: str = "eth0") -> tuple[dict[str, list[str]], list[str]]:
    """One raw ``WHO`` datagram per target from ``netns``; sniff ``window`` seconds.

    Returns ``({"ip:port": [each UDP reply's payload]}, [icmp errors about the
    targets, "target type/code"])``: silence is two empty lists, a rejected
    port an ICMP ``3/3`` (port unreachable) and no reply.
    """
    result = _probe(netns, targets, window, iface, "udp")
    return result["udp"], result["icmp"]


def _probe(netns: str, targets: Iterable[tuple[str, int]], window: float, iface: str,
           proto: str) -> dict[str, Any]:
    """Run this module's probe process in ``netns``; its JSON result."""
    argv = ["ip", "netns", "exec", netns, sys.executable, "-m", "tests.support.probes",
            json.dumps([list(t) for t in targets]), str(window), iface, proto]
    try:
        done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True,
                              timeout=30 + window, check=False)
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"scapy probe hung: {exc}") from exc
    if done.returncode != 0:
        raise AssertionError(f"scapy probe failed ({done.returncode}):\n{done.stderr}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def first_answer(flags: list[str]) -> str:
    """``synack``, ``rst``, ``none`` (no answer) or ``other:<flags>``, from the first answer."""
    if not flags:
        return "none"
    if "R" in flags[0]:
        return "rst"
    if "S" in flags[0] and "A" in flags[0]:
        return "synack"
    return f"other:{flags[0]}"


def syn_probe(netns: str, *targets: tuple[str, int], timeout: float = 1.0,
              iface: str = "eth0") -> list[str]:
    """One pure SYN per target from ``netns``: ``synack``, ``rst`` or ``none`` for each."""
    tcp, _ = syn_answers(netns, targets, window=timeout, iface=iface)
    return [first_answer(tcp[f"{ip}:{port}"]) for ip, port in targets]


def _ss(argv: list[str], netns: str | None) -> str:
    if netns:
        argv = ["ip", "netns", "exec", netns, *argv]
    res = subprocess.run(argv, capture_output=True, text=True, timeout=10, check=False)
    if res.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {res.stderr.strip()}")
    return res.stdout


def ss_listening(port: int, netns: str | None = None) -> list[str]:
    """``ss -ltnH`` lines of the TCP sockets in LISTEN on ``port`` (none: ``[]``)."""
    out = _ss(["ss", "-ltnH", f"sport = :{port}"], netns)
    return [ln for ln in out.splitlines() if ln.strip()]


def ss_drops(port: int, netns: str) -> int:
    """The listener's socket drop counter (``d`` in ``ss -m``): SYNs the filter ate."""
    out = _ss(["ss", "-ltnmH", f"sport = :{port}"], netns)
    return sum(int(d) for d in re.findall(r"\bd(\d+)\)", out))  # every address


# ------------------------------------------------------------ the probe process

PORT_UNREACHABLE = {4: "3/3", 6: "1/4"}
"""How ``udp_answers`` spells a rejected port per family: ICMP 3/3, ICMPv6 1/4."""

_SPORTS = range(20000, 30000)
"""Source ports below the ephemeral range: no real socket of ours can own them."""


def _main(argv: list[str]) -> None:  # pragma: no cover - runs inside a namespace
    import random
    import threading
    import time

    # The layers and the sniffer only: ``scapy.all`` loads every protocol scapy
    # knows and costs 1.2 s more per probe, and the suite runs many.
    from scapy.config import conf
    from scapy.layers.inet import ICMP, IP, TCP, UDP, IPerror
    from scapy.layers.inet6 import (
        ICMPv6DestUnreach,
        ICMPv6PacketTooBig,
        ICMPv6ParamProblem,
        ICMPv6TimeExceeded,
        IPerror6,
        IPv6,
    )
    from scapy.sendrecv import AsyncSniffer
    from scapy.supersocket import L3RawSocket, L3RawSocket6

    conf.verb = 0
    targets = [tuple(t) for t in json.loads(argv[0])]
    window, iface = float(argv[1]), argv[2]
    udp = len(argv) > 3 and argv[3] == "udp"
    sports = random.sample(_SPORTS, len(targets))
    want = {(ip, port, sp): f"{ip}:{port}" for (ip, port), sp in zip(targets, sports, strict=True)}
    ips = {ip for ip, _ in targets}
    seen: dict[str, list[str]] = {f"{ip}:{port}": [] for ip, port in targets}
    icmp: list[str] = []

    def net(p):  # the IPv4 or IPv6 header, whichever the packet has
        return p[IP] if IP in p else p[IPv6] if IPv6 in p else None  # noqa: SIM401 - no .get

    icmp6_errors = (ICMPv6DestUnreach, ICMPv6PacketTooBig, ICMPv6TimeExceeded,
                    ICMPv6ParamProblem)

    def error(p):  # an ICMP or ICMPv6 error, else None (``in`` matches exact layers only)
        if ICMP in p:
            return p[ICMP]
        return next((p[kind] for kind in icmp6_errors if kind in p), None)

    def about(p) -> str:
        """The target an ICMP error is about: the quoted datagram's destination.

        Not the ICMP's source: an error made in prerouting (an nft ``reject``
        for a VIP) leaves from the node's address toward the client.
        """
        for quoted in (IPerror, IPerror6):
            if quoted in p:
                return p[quoted].dst
        return net(p).src

    def keep(p) -> bool:
        header = net(p)
        if header is None:
            return False
        if error(p) is not None:
            return about(p) in ips
        if header.src not in ips:
            return False  # our own SYNs, and the kernel's RST to any SYN-ACK, are ignored
        l4 = UDP if udp else TCP
        return l4 in p and (header.src, p[l4].sport, p[l4].dport) in want

    started = threading.Event()
    sniffer = AsyncSniffer(iface=iface, store=True, lfilter=keep,
                           started_callback=started.set)
    sniffer.start()
    if not started.wait(10):
        sys.exit("sniffer did not start")
    raws = {4: L3RawSocket(), 6: L3RawSocket6()}
    try:
        for (ip, port, sp) in want:
            v6 = ":" in ip
            header = IPv6(dst=ip) if v6 else IP(dst=ip)
            if udp:
                packet = header / UDP(sport=sp, dport=port) / b"WHO"
            else:
                packet = header / TCP(sport=sp, dport=port, flags="S",
                                      seq=random.getrandbits(32))
            raws[6 if v6 else 4].send(packet)
    finally:
        for raw in raws.values():
            raw.close()
    time.sleep(window)  # the observation window: silence is the thing measured
    sniffer.stop()
    for p in sniffer.results or []:
        err = error(p)
        if err is not None:
            icmp.append(f"{about(p)} {err.type}/{err.code}")
            continue
        src = net(p).src
        if udp:
            seen[want[(src, p[UDP].sport, p[UDP].dport)]].append(
                bytes(p[UDP].payload).decode(errors="replace"))
        else:
            seen[want[(src, p[TCP].sport, p[TCP].dport)]].append(str(p[TCP].flags))
    print(json.dumps({"udp" if udp else "tcp": seen, "icmp": icmp}))


if __name__ == "__main__":
    _main(sys.argv[1:])
