"""Idle connections expire as kube-proxy's conntrack flags say, and busy ones never do.

``--conntrack-tcp-timeout-established`` / ``--conntrack-tcp-timeout-close-wait``
as the Dataplane's ``tcp_timeout_established`` / ``tcp_timeout_close_wait``,
in-process on loopback under both loops. The backend's ``QUIET`` command
never sends and never closes; it records "reset" when the proxy resets it.
A sweep every timeout/4 expires a connection between one timeout and 1.5
timeouts after its last byte, so the bounds below are that plus slack for a
loaded machine.
"""

from __future__ import annotations

import asyncio
import socket
import time

import pytest

from lab.common import eventually
from proxy import metrics
from proxy.userspace.forwarder import SWEEP_MAX_INTERVAL, Forwarder
from tests.support.backends import Server
from tests.support.loops import NODE_IP, free_port, run_on, serving, snap, web

pytestmark = pytest.mark.usefixtures("relay_kind")  # both relays: conftest.py

KEY = "default/web"
SLACK = 2.0
"""Seconds a loaded machine may add to the sweep's own lateness."""


def expired(reason: str) -> float:
    return metrics.REGISTRY.get_sample_value(
        "kubeproxy_kpx_connections_expired_total", {"service_port": KEY, "reason": reason}
    ) or 0.0


def wait_reset(s: socket.socket, limit: float) -> float:
    """Seconds until ``s`` is reset; fails on data, EOF or no reset within ``limit``."""
    t0 = time.monotonic()
    s.settimeout(limit)
    try:
        data = s.recv(100)
    except ConnectionResetError:
        return time.monotonic() - t0
    except TimeoutError:
        raise AssertionError(f"not reset within {limit}s") from None
    raise AssertionError(f"expected a reset, got {data!r}")


async def backend_saw(be: Server, event: tuple[str, str], timeout: float = 5) -> None:
    await eventually(lambda: event in be.events, timeout, what=f"the backend to see {event}")


def test_quiet_established_connection_is_reset_on_both_sides(loop_kind: str, backends) -> None:
    """A backend that never sends nor closes, a client that waits: both get an RST."""
    be = backends()
    np_ = free_port()
    before = expired("established")

    def client() -> float:
        with socket.create_connection((NODE_IP, np_), timeout=5) as s:
            s.sendall(b"QUIET\n")  # the last byte either way
            return wait_reset(s, 1.0 + 0.5 + SLACK + 3)

    async def scenario() -> None:
        async with serving(snap(*web(np_, be.port)), tcp_timeout_established=1.0,
                           tcp_timeout_close_wait=0) as dp:
            idle = await asyncio.to_thread(client)
            assert 1.0 <= idle < 1.5 + SLACK, idle  # never early, late by a sweep or two
            await backend_saw(be, ("QUIET", "reset"))
            await eventually(lambda: dp.active_connections() == 0, 2,
                             what="the expired connection to be counted out")

    run_on(loop_kind, scenario)
    assert expired("established") - before == 1


def test_half_closed_quiet_connection_is_reset_after_close_wait(loop_kind: str, backends) -> None:
    """A client that sends FIN and goes quiet (the backend too): close-wait applies, and
    only to it; an equally quiet connection that is not half-closed stays up."""
    be = backends()
    np_ = free_port()
    before = expired("close_wait"), expired("established")

    def half_closer() -> float:
        with socket.create_connection((NODE_IP, np_), timeout=5) as s:
            s.sendall(b"QUIET\n")
            s.shutdown(socket.SHUT_WR)
            return wait_reset(s, 1.0 + 0.5 + SLACK + 3)

    async def scenario() -> None:
        async with serving(snap(*web(np_, be.port)), tcp_timeout_established=60.0,
                           tcp_timeout_close_wait=1.0) as dp:
            quiet = await asyncio.to_thread(socket.create_connection, (NODE_IP, np_), 5)
            try:
                quiet.sendall(b"QUIET\n")
                idle = await asyncio.to_thread(half_closer)
                assert 1.0 <= idle < 1.5 + SLACK, idle
                await backend_saw(be, ("QUIET", "reset"))
                # The other one is idle as long, but established: 60 s to go.
                await eventually(lambda: dp.active_connections() == 1, 2,
                                 what="the expired connection to be counted out")
                assert be.events == [("QUIET", "reset")]
                quiet.setblocking(False)
                try:
                    quiet.recv(1)
                except BlockingIOError:
                    pass  # still open, nothing to read: as it should be
                else:
                    raise AssertionError("the established connection was ended")
            finally:
                quiet.close()

    run_on(loop_kind, scenario)
    assert expired("close_wait") - before[0] == 1
    assert expired("established") - before[1] == 0


def test_busy_connections_are_never_expired(loop_kind: str, backends) -> None:
    """Traffic both ways, or one way after a half-close, keeps a connection alive for
    well past both timeouts, while a quiet one beside them is reset."""
    be = backends()
    np_ = free_port()
    before = expired("established") + expired("close_wait")
    run_for = 3.0  # three times either timeout

    def echo_chatter() -> int:
        with socket.create_connection((NODE_IP, np_), timeout=5) as s:
            s.sendall(b"ECHO\n")
            n = 0
            deadline = time.monotonic() + run_for
            while time.monotonic() < deadline and n < 100:
                s.sendall(b"x")
                assert s.recv(1) == b"x"
                n += 1
                time.sleep(0.2)
            return n

    def half_closed_download() -> int:
        lines = int(run_for / 0.05)
        with socket.create_connection((NODE_IP, np_), timeout=5) as s:
            s.sendall(f"DRIP {lines}\n".encode())
            s.shutdown(socket.SHUT_WR)  # half-closed, but the backend keeps sending
            data = b""
            while chunk := s.recv(4096):
                data += chunk
            return data.count(b"drip")

    def quiet() -> float:
        with socket.create_connection((NODE_IP, np_), timeout=5) as s:
            s.sendall(b"QUIET\n")
            return wait_reset(s, 1.5 + SLACK + 3)

    async def scenario() -> None:
        async with serving(snap(*web(np_, be.port)), tcp_timeout_established=1.0,
                           tcp_timeout_close_wait=1.0) as dp:
            t0 = time.monotonic()
            chats, drips, idle = await asyncio.gather(
                asyncio.to_thread(echo_chatter), asyncio.to_thread(half_closed_download),
                asyncio.to_thread(quiet),
            )
            assert time.monotonic() - t0 >= run_for
            assert chats >= 10
            assert drips == int(run_for / 0.05)
            assert idle < 1.5 + SLACK  # the sweeps did run meanwhile
            await eventually(lambda: not dp.active_connections(), 5,
                             what="the finished connections to end")

    run_on(loop_kind, scenario)
    assert expired("established") + expired("close_wait") - before == 1


def test_a_slow_reader_still_taking_data_is_not_idle(loop_kind: str, backends) -> None:
    """The proxy has handed MBs to the kernel for a client that reads 4 KiB at a time:
    no read or write of the proxy's moves for seconds, yet the kernel keeps
    delivering, so the connection is busy (conntrack sees the segments)."""
    be = backends()
    np_ = free_port()
    run_for = 3.0
    before = expired("established")

    def slow_reader() -> int:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.settimeout(5)
            s.connect((NODE_IP, np_))
            s.sendall(b"SEND 67108864\n")
            got = 0
            deadline = time.monotonic() + run_for
            while time.monotonic() < deadline:
                chunk = s.recv(4096)  # ConnectionResetError fails the test
                assert chunk, "the backend never ends early"
                got += len(chunk)
                time.sleep(0.1)
            return got

    async def scenario() -> None:
        async with serving(snap(*web(np_, be.port)), tcp_timeout_established=1.0,
                           tcp_timeout_close_wait=1.0):
            assert await asyncio.to_thread(slow_reader) > 0

    run_on(loop_kind, scenario)
    assert expired("established") == before


def test_zero_turns_expiry_off(loop_kind: str, backends) -> None:
    """0 for both flags (kube-proxy's "leave as is"): no sweep at all."""
    be = backends()
    np_ = free_port()

    async def scenario() -> None:
        async with serving(snap(*web(np_, be.port)), tcp_timeout_established=0,
                           tcp_timeout_close_wait=0) as dp:
            s = await asyncio.to_thread(socket.create_connection, (NODE_IP, np_), 5)
            try:
                s.sendall(b"QUIET\n")
                await eventually(lambda: dp.active_connections() == 1
                                 and dp.forwarder.linked() == 1, 5, what="linked")
                assert dp.forwarder.sweep_interval == 0
                assert not dp.forwarder.sweeping
            finally:
                s.close()

    run_on(loop_kind, scenario)


def test_sweep_interval_follows_the_shortest_timeout() -> None:
    """timeout/4, at most SWEEP_MAX_INTERVAL; none when both are off; never negative."""
    loop = asyncio.new_event_loop()
    try:
        assert Forwarder(loop).sweep_interval == SWEEP_MAX_INTERVAL  # 24h and 1h
        assert Forwarder(loop, tcp_timeout_established=1.0,
                         tcp_timeout_close_wait=0).sweep_interval == 0.25
        assert Forwarder(loop, tcp_timeout_established=0,
                         tcp_timeout_close_wait=8.0).sweep_interval == 2.0
        assert Forwarder(loop, tcp_timeout_established=0,
                         tcp_timeout_close_wait=0).sweep_interval == 0
        with pytest.raises(ValueError):
            Forwarder(loop, tcp_timeout_established=-1.0)
    finally:
        loop.close()
