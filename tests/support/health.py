"""Helpers for the healthz tests: snapshots built by hand, raw HTTP, port checks.

Snapshots come straight from ``proxy.core.model`` (``tests.support.model``)
so these tests never depend on the YAML parser; ``lb_service``, ``ep``,
``eps_slice``, ``snap`` and ``NODES`` are those builders under the names and
defaults the healthz tests use (an eTP=Local LoadBalancer ``python-lb``);
``FakeClock`` is ``tests.support.clock.FakeClock`` (a settable wall clock).
HTTP is spoken over raw sockets where the exact bytes matter. Waiting is
always "until a condition holds, or fail at a deadline" (``lab.common``),
never a bare sleep.
"""

from __future__ import annotations

import asyncio
import re
import socket
from collections.abc import Callable, Iterable

from lab import common
from proxy.core.model import Service, ServicePort
from tests.support.clock import FakeClock
from tests.support.model import NODES
from tests.support.model import endpoint as ep
from tests.support.model import endpoint_slice as eps_slice
from tests.support.model import service as _service
from tests.support.model import snapshot as snap
from tests.support.netns import free_port
from tests.support.probes import ss_listening

__all__ = [
    "NODES",
    "FakeClock",
    "ep",
    "eps_slice",
    "eventually",
    "free_port",
    "get",
    "http_raw",
    "lb_service",
    "listening_sockets",
    "refuses",
    "snap",
    "split_response",
]


def lb_service(
    name: str = "python-lb",
    hc_port: int = 0,
    *,
    namespace: str = "default",
    policy: str = "Local",
    type: str = "LoadBalancer",
    node_port: int = 30080,
    ports: Iterable[ServicePort] | None = None,
) -> Service:
    """``model.service`` with the healthz defaults: an eTP=Local LoadBalancer."""
    return _service(name, policy, type=type, hc_port=hc_port,  # type: ignore[arg-type]
                    node_port=node_port, ports=ports, namespace=namespace)


async def http_raw(
    port: int, request: bytes, host: str = "127.0.0.1", timeout: float = 2.0
) -> bytes:
    """Send ``request`` and return every byte until the server closes."""
    async with asyncio.timeout(timeout):
        reader, writer = await asyncio.open_connection(host, port)
        try:
            writer.write(request)
            await writer.drain()
            return await reader.read()
        finally:
            writer.close()


def get(path: str = "/healthz", method: str = "GET") -> bytes:
    return f"{method} {path} HTTP/1.1\r\nHost: probe\r\nConnection: close\r\n\r\n".encode()


_DATE = re.compile(rb"\r\nDate: [A-Z][a-z]{2}, \d\d [A-Z][a-z]{2} \d{4} \d\d:\d\d:\d\d GMT\r\n")


def split_response(raw: bytes) -> tuple[bytes, bytes]:
    """``(head with the Date value replaced by DATE, body)``; asserts a well-formed Date."""
    head, sep, body = raw.partition(b"\r\n\r\n")
    assert sep, raw
    head += b"\r\n"
    assert _DATE.search(head), head
    return _DATE.sub(b"\r\nDate: DATE\r\n", head), body


def refuses(port: int, host: str = "127.0.0.1") -> bool:
    """True iff a connect to ``host`` (either family) gets RST (ECONNREFUSED) right now."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.settimeout(2.0)
        try:
            s.connect((host, port))
        except ConnectionRefusedError:
            return True
    return False


def listening_sockets(port: int) -> str:
    """``ss -ltnH`` lines for sockets in LISTEN on ``port`` (empty when none)."""
    return "\n".join(ss_listening(port))


async def eventually(
    predicate: Callable[[], object], timeout: float = 2.0, interval: float = 0.01
) -> None:
    """``lab.common.eventually`` with the healthz defaults; ``TimeoutError`` at the deadline."""
    await common.eventually(predicate, timeout, interval)
