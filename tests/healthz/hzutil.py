"""Helpers for the healthz tests: snapshots built by hand, raw HTTP, port checks.

Snapshots come straight from ``proxy.core.model`` so these tests never depend on
the YAML parser. HTTP is spoken over raw sockets where the exact bytes matter.
Waiting is always "until a condition holds, or fail at a deadline", never a
bare sleep.
"""

from __future__ import annotations

import asyncio
import re
import socket
import subprocess
from collections.abc import Callable, Iterable

from proxy.core.model import (
    Endpoint,
    EndpointPort,
    EndpointSlice,
    Node,
    Service,
    ServicePort,
    Snapshot,
)

NODES = (
    Node("node-a", internal_ips=("192.0.2.1",)),
    Node("node-b", internal_ips=("192.0.2.2",)),
    Node("node-c", internal_ips=("192.0.2.3",)),
)


class FakeClock:
    """A settable wall clock for ``ProxyHealth``."""

    def __init__(self, now: float = 1_800_000_000.25) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def free_port() -> int:
    """A TCP port nobody listens on right now (the kernel's pick)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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
    return Service(
        namespace=namespace,
        name=name,
        type=type,  # type: ignore[arg-type]
        ports=tuple(ports) if ports is not None else (ServicePort("", "TCP", 80, 8080, node_port),),
        external_traffic_policy=policy,  # type: ignore[arg-type]
        health_check_node_port=hc_port,
    )


def ep(
    address: str,
    node: str | None,
    *,
    ready: bool = True,
    serving: bool = True,
    terminating: bool = False,
) -> Endpoint:
    return Endpoint(address, node, ready=ready, serving=serving, terminating=terminating)


def eps_slice(
    service: Service,
    endpoints: Iterable[Endpoint],
    *,
    ports: Iterable[EndpointPort] = (EndpointPort("", 8080),),
    name: str | None = None,
    trigger_time: float | None = None,
) -> EndpointSlice:
    return EndpointSlice(
        namespace=service.namespace,
        name=name or f"{service.name}-abcde",
        service_name=service.name,
        endpoints=tuple(endpoints),
        ports=tuple(ports),
        trigger_time=trigger_time,
    )


def snap(
    services: Iterable[Service] = (),
    slices: Iterable[EndpointSlice] = (),
    nodes: Iterable[Node] = NODES,
    generation: int = 1,
) -> Snapshot:
    return Snapshot(
        nodes=tuple(nodes), services=tuple(services), slices=tuple(slices), generation=generation
    )


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
    """True iff a connect gets RST (ECONNREFUSED) right now."""
    with socket.socket() as s:
        s.settimeout(2.0)
        try:
            s.connect((host, port))
        except ConnectionRefusedError:
            return True
    return False


def listening_sockets(port: int) -> str:
    """``ss -ltnH`` lines for sockets in LISTEN on ``port`` (empty when none)."""
    out = subprocess.run(
        ["ss", "-ltnH", f"sport = :{port}"], capture_output=True, text=True, check=True
    )
    return out.stdout.strip()


async def eventually(
    predicate: Callable[[], bool], timeout: float = 2.0, interval: float = 0.01
) -> None:
    """Wait until ``predicate()`` holds; fail at the deadline."""
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(interval)
