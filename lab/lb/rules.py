"""The load balancer's pure decisions: probe verdicts, the serving set, the PROXY header.

Owns: folding probe results into a node's health (``observe``), choosing
the nodes that get new connections, fail-open included (``serving``), the
PROXY protocol v1/v2 header (``proxy_header``), and naming a failed
connection the way a cloud console does (``describe_error``, which
``kpx lab``'s own probes share).

Never: do I/O, read the clock or hold state. The daemon and the tests call
the very same functions, so a threshold rule is tested without a network.
"""

from __future__ import annotations

import asyncio
import errno
import ipaddress
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from lab.lb.config import Backend, ProxyProtocol

HealthState = Literal["initial", "healthy", "unhealthy"]

PROXY_V2_SIGNATURE = b"\r\n\r\n\x00\r\nQUIT\n"


@dataclass(frozen=True, slots=True)
class Health:
    """One node's probe state. ``passes``/``fails`` are the current streaks."""

    state: HealthState = "initial"
    passes: int = 0
    fails: int = 0

    @property
    def healthy(self) -> bool:
        return self.state == "healthy"


def observe(h: Health, ok: bool, healthy_threshold: int, unhealthy_threshold: int) -> Health:
    """Fold one probe result into a node's state (pure: the daemon and tests share it).

    Only *consecutive* results count: one pass resets the failure streak and
    vice versa, so a flapping node never crosses a threshold of 2. A node
    leaves ``initial`` on whichever threshold it reaches first.
    """
    passes, fails = (h.passes + 1, 0) if ok else (0, h.fails + 1)
    state = h.state
    if ok and state != "healthy" and passes >= healthy_threshold:
        state = "healthy"
    elif not ok and state != "unhealthy" and fails >= unhealthy_threshold:
        state = "unhealthy"
    return Health(state, passes, fails)


def serving(
    backends: Sequence[Backend], health: Mapping[str, Health]
) -> tuple[list[Backend], bool]:
    """The nodes that get new connections, and whether that is the fail-open set.

    Healthy nodes in spec order; if there are none, every node (fail open, as
    GCP and AWS network LBs do), flagged so status and demos can say so.
    """
    up = [b for b in backends if health.get(b.name, Health()).healthy]
    if up:
        return up, False
    return list(backends), True


def proxy_header(version: ProxyProtocol, src: tuple[str, int], dst: tuple[str, int]) -> bytes:
    """The PROXY protocol header announcing ``src`` (the client) and ``dst`` (the LB front).

    v1 is the text line of haproxy's proxy-protocol.txt section 2.1; v2 is the
    binary form (section 2.2): the 12-byte signature, version 2 + PROXY
    command (0x21), TCP over IPv4 (0x11), then a 12-byte address block. IPv6
    addresses get the TCP6 / 0x21-family forms.
    """
    if version == "none":
        return b""
    s_ip, d_ip = ipaddress.ip_address(src[0]), ipaddress.ip_address(dst[0])
    v6 = s_ip.version == 6 or d_ip.version == 6
    if v6:
        s_ip, d_ip = (
            ipaddress.IPv6Address(f"::ffff:{a}") if a.version == 4 else a for a in (s_ip, d_ip)
        )
    if version == "v1":
        family = "TCP6" if v6 else "TCP4"
        return f"PROXY {family} {s_ip} {d_ip} {src[1]} {dst[1]}\r\n".encode("ascii")
    if version == "v2":
        addresses = s_ip.packed + d_ip.packed + struct.pack("!HH", src[1], dst[1])
        fam = 0x21 if v6 else 0x11
        return PROXY_V2_SIGNATURE + struct.pack("!BBH", 0x21, fam, len(addresses)) + addresses
    raise ValueError(f"unknown PROXY protocol version {version!r}")


def describe_error(exc: BaseException) -> str:
    """A probe failure as a cloud console would show it: timeout, refused, reset...

    The one namer of failed probes: the load balancer's health checks and
    ``kpx lab``'s own healthz probes use the same words.
    """
    if isinstance(exc, TimeoutError):
        return "timeout"
    if isinstance(exc, ConnectionRefusedError):
        return "refused"
    if isinstance(exc, ConnectionResetError):
        return "reset"
    if isinstance(exc, OSError) and exc.errno in (errno.EHOSTUNREACH, errno.ENETUNREACH):
        return "unreachable"
    if isinstance(exc, asyncio.IncompleteReadError | EOFError):
        return "closed without an answer"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror.lower()
    return f"error: {type(exc).__name__}: {exc}"
