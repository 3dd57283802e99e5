"""A refusing service under load writes a bounded log: first lines in full, then summaries.

Before rate limiting, each connection to a service whose two endpoints
refuse wrote three warning lines (two failed connects, one reset): one
client with 50 connections wrote 25-30 MB in 10 s. The log here is what a
file handler on ``proxy.userspace.forwarder`` receives, counted in lines and bytes.
"""

from __future__ import annotations

import asyncio
import io
import logging
import re
import socket
import time
from collections.abc import Iterator

import pytest

from lab.common import eventually
from proxy.userspace import forwarder
from tests.support.loops import NODE_IP, free_port, run_on, serving, snap, web

CONNECTIONS = 300
SUMMARY = re.compile(r" … and ([\d,]+) more like this in the last [\d.]+ s$")


@pytest.fixture
def log_file() -> Iterator[io.StringIO]:
    """The forwarder's warnings as a log file would hold them."""
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    lg = logging.getLogger("proxy.userspace.forwarder")
    old_level = lg.level
    lg.addHandler(handler)
    lg.setLevel(logging.WARNING)
    try:
        yield out
    finally:
        lg.removeHandler(handler)
        lg.setLevel(old_level)


def refusing(node_port: int):
    """Two endpoints with nothing listening: every connect is refused."""
    port = free_port("127.0.0.5")
    return port, web(node_port, port, "127.0.0.5", "127.0.0.6")


def hammer(node_port: int, n: int) -> int:
    """``n`` connections, one after the other; how many were reset (all, if refused)."""
    resets = 0
    for _ in range(n):
        try:
            with socket.create_connection((NODE_IP, node_port), timeout=5) as s:
                s.sendall(b"GET / HTTP/1.0\r\n\r\n")
                if s.recv(10) == b"":
                    continue
        except (ConnectionResetError, ConnectionRefusedError, BrokenPipeError):
            resets += 1
    return resets


def events_in(lines: list[str], what: str) -> int:
    """How many events the lines about ``what`` stand for: 1 each, plus each summary's N."""
    total = 0
    for line in lines:
        if what in line:
            m = SUMMARY.search(line)
            total += 1 + (int(m.group(1).replace(",", "")) if m else 0)
    return total


def test_refused_connections_write_a_bounded_log_with_summaries(
    loop_kind: str, log_file: io.StringIO
) -> None:
    np_ = free_port()
    port, state = refusing(np_)
    spans: list[float] = []

    async def scenario() -> None:
        async with serving(snap(*state)):
            t0 = time.monotonic()
            assert await asyncio.to_thread(hammer, np_, CONNECTIONS) == CONNECTIONS
            spans.append(time.monotonic() - t0)
            during = log_file.getvalue().splitlines()
            # Two causes (connect refused, reset), each at most two lines a window.
            windows = 1 + int(spans[0] // forwarder.LOG_WINDOW)
            assert len(during) <= 2 * 2 * windows, during[:10]
        # Closing the dataplane says what was held back.

    run_on(loop_kind, scenario)
    text = log_file.getvalue()
    lines = text.splitlines()
    windows = 1 + int(spans[0] // forwarder.LOG_WINDOW)
    assert len(lines) <= 2 * 2 * windows + 2, lines[:10]
    assert len(text) < 4096, len(text)
    # The first of each cause is there in full.
    first_connect = next(ln for ln in lines if "connect to endpoint" in ln)
    assert re.search(rf"default/web: connect to endpoint 127\.0\.0\.[56]:{port} for client "
                     r"127\.0\.0\.1:\d+ failed \(Connection refused, SNAT\)$", first_connect)
    assert any("client 127.0.0.1:" in ln and "reset: " in ln for ln in lines)
    # Nothing is lost: the summaries account for every event.
    assert any(SUMMARY.search(ln) for ln in lines), lines
    assert events_in(lines, "connect to endpoint") == 2 * CONNECTIONS
    assert events_in(lines, "reset: ") == CONNECTIONS


def test_a_burst_that_stops_is_summarised_without_another_event(
    loop_kind: str, log_file: io.StringIO, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The window's timer writes the summary; nothing else has to happen."""
    monkeypatch.setattr(forwarder, "LOG_WINDOW", 0.5)
    np_ = free_port()
    _, state = refusing(np_)

    async def scenario() -> None:
        async with serving(snap(*state)) as dp:
            assert dp.forwarder.logs.window == 0.5
            assert await asyncio.to_thread(hammer, np_, 20) == 20
            # Every window closed by the timer, and the summaries account for all.
            try:
                await eventually(lambda: not len(dp.forwarder.logs) and events_in(
                    log_file.getvalue().splitlines(), "connect to endpoint") >= 40, 5, 0.05)
            except TimeoutError:
                raise AssertionError(log_file.getvalue()) from None
            assert any(SUMMARY.search(ln) for ln in log_file.getvalue().splitlines())
            assert events_in(log_file.getvalue().splitlines(), "reset: ") == 20

    run_on(loop_kind, scenario)
