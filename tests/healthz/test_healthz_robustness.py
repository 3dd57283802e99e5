"""Slow and silent clients cannot stall a health-check port.

Each test holds many connections that never finish a request and asserts
that a real probe still gets its complete answer before a deadline.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from healthz.proxy_health import ProxyHealth
from healthz.registry import REGISTRY
from healthz.service_health import render_body
from tests.support.health import (
    ep,
    eps_slice,
    eventually,
    free_port,
    get,
    http_raw,
    lb_service,
    snap,
)
from tests.support.wiring import HealthChecks

BODY = render_body("default", "python-lb", 1, True)


def closed_count(reason: str) -> float:
    value = REGISTRY.get_sample_value(
        "kubeproxy_kpx_healthz_connections_closed_total", {"reason": reason}
    )
    return value or 0.0


@contextmanager
def idle_clients(port: int, n: int, send: bytes = b"") -> Iterator[list[socket.socket]]:
    """``n`` connected sockets that send ``send`` (maybe nothing) and then go quiet."""
    socks: list[socket.socket] = []
    try:
        for _ in range(n):
            s = socket.create_connection(("127.0.0.1", port), timeout=2)
            if send:
                s.sendall(send)
            socks.append(s)
        yield socks
    finally:
        for s in socks:
            s.close()


async def serving(
    max_connections: int = 100, header_timeout: float = 5.0
) -> tuple[HealthChecks, int]:
    port = free_port()
    hc = HealthChecks(
        "node-a",
        ProxyHealth(),
        ["127.0.0.1"],
        max_connections=max_connections,
        header_timeout=header_timeout,
    )
    svc = lb_service(hc_port=port)
    hc.sync(snap([svc], [eps_slice(svc, [ep("10.1.0.1", "node-a")])]))
    return hc, port


@pytest.mark.parametrize(
    "send",
    [b"", b"GET /healthz HTTP/1.1\r\nHost: x\r\n"],
    ids=["silent", "unfinished-headers"],
)
async def test_200_idle_connections_do_not_stop_a_probe(send: bytes) -> None:
    hc, port = await serving(max_connections=100, header_timeout=30.0)
    evicted_before = closed_count("limit")
    try:
        with idle_clients(port, 200, send):
            # Let the server accept all 200 first (half of them get evicted),
            # so the probe arrives at a listener that is already full.
            await eventually(lambda: closed_count("limit") - evicted_before >= 100)
            start = time.monotonic()
            raw = await http_raw(port, get(), timeout=1.0)
            assert time.monotonic() - start < 1.0
            assert raw.startswith(b"HTTP/1.1 200 OK\r\n")
            assert raw.endswith(b"\r\n\r\n" + BODY)
            # The cap held: the oldest idle connection made room for the probe.
            assert closed_count("limit") - evicted_before >= 101
    finally:
        await hc.stop()


async def test_silent_connection_is_closed_at_the_header_timeout() -> None:
    hc, port = await serving(header_timeout=0.3)
    timeouts_before = closed_count("header_timeout")
    try:
        for send in (b"", b"GET / HTTP/1.1\r\nHo"):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            start = time.monotonic()
            writer.write(send)
            # Dribble a byte now and then: data alone must not extend the deadline.
            async with asyncio.timeout(3):
                for _ in range(3):
                    writer.write(b"X" if send else b"")
                    await asyncio.sleep(0.05)
                assert await reader.read() == b""
            elapsed = time.monotonic() - start
            assert 0.25 <= elapsed < 2.0, elapsed
            writer.close()
        assert closed_count("header_timeout") - timeouts_before >= 2
    finally:
        await hc.stop()


async def test_keepalive_connection_gets_a_fresh_deadline_per_request() -> None:
    hc, port = await serving(header_timeout=0.5)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        async with asyncio.timeout(5):
            for _ in range(3):
                writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
                await reader.readuntil(BODY)
                await asyncio.sleep(0.3)  # idle, but less than one deadline
            # Then idle past the deadline: closed.
            assert await reader.read() == b""
    finally:
        writer.close()
        await hc.stop()


async def test_oversized_headers_are_refused_with_400() -> None:
    hc, port = await serving()
    try:
        huge = b"GET / HTTP/1.1\r\nHost: x\r\nX-Junk: " + b"a" * 20000 + b"\r\n\r\n"
        raw = await http_raw(port, huge)
        assert raw.split(b"\r\n", 1)[0].endswith(b"400 Bad Request")
        assert (await http_raw(port, get())).endswith(BODY)
    finally:
        await hc.stop()
