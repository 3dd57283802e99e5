"""The relay, in-process on loopback: bytes, half-close, resets, retries, limits.

Clients are blocking sockets in worker threads (real, independent peers);
the Dataplane runs on the test's event loop, uvloop and asyncio both.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import socket
import struct
import threading
import time

import pytest

from lab.common import eventually
from proxy import metrics
from proxy.proxier import Proxier
from proxy.userspace.dataplane import Dataplane
from proxy.userspace.forwarder import READ_SIZE
from tests.support.backends import pattern_stream
from tests.support.loops import NODE, NODE_IP, free_port, run_on, serving, snap, syncing, web
from tests.support.objects import service
from tests.support.wiring import sync_config

pytestmark = pytest.mark.usefixtures("relay_kind")  # both relays: conftest.py

MiB = 1024 * 1024


def connect(port: int, addr: str = NODE_IP, timeout: float = 5.0) -> socket.socket:
    return socket.create_connection((addr, port), timeout=timeout)


def read_all(s: socket.socket, limit: int = 1 << 30) -> bytes:
    buf = bytearray()
    while len(buf) < limit:
        data = s.recv(262144)
        if not data:
            break
        buf += data
    return bytes(buf)


def counter(metric, *labels: str) -> float:
    return metric.labels(*labels)._value.get()


def test_halfclose_64mib_upload_sha_intact(loop_kind: str, backends) -> None:
    be = backends()
    np_ = free_port()
    block = os.urandom(MiB)
    digest = hashlib.sha256(block * 64).hexdigest()

    def client() -> str:
        with connect(np_) as s:
            s.sendall(b"SHA\n")
            for _ in range(64):
                s.sendall(block)
            s.shutdown(socket.SHUT_WR)  # half-close: the answer must still come
            return read_all(s).decode()

    async def scenario() -> None:
        async with serving(snap(*web(np_, be.port, "127.0.0.1"))) as dp:
            answer = await asyncio.to_thread(client)
            assert answer.split() == [digest, str(64 * MiB)]
            await eventually(lambda: dp.active_connections() == 0, 2,
                             what="the half-closed pair to be closed")

    run_on(loop_kind, scenario)


def test_halfclose_echo_and_download_intact(loop_kind: str, backends) -> None:
    be = backends()
    np_ = free_port()
    payload = os.urandom(8 * MiB)
    n = 32 * MiB

    def echo() -> bytes:
        with connect(np_) as s:
            s.sendall(b"ECHO\n")
            got: list[bytes] = []
            reader = threading.Thread(target=lambda: got.append(read_all(s)))
            reader.start()
            s.sendall(payload)
            s.shutdown(socket.SHUT_WR)
            reader.join(20)
            return got[0]

    def download() -> str:
        with connect(np_) as s:
            s.sendall(f"SEND {n}\n".encode())
            return hashlib.sha256(read_all(s)).hexdigest()

    expected = hashlib.sha256(b"".join(pattern_stream(n))).hexdigest()

    async def scenario() -> None:
        async with serving(snap(*web(np_, be.port, "127.0.0.1"))) as dp:
            assert await asyncio.to_thread(echo) == payload
            assert await asyncio.to_thread(download) == expected
            await eventually(lambda: dp.active_connections() == 0, 2,
                             what="every connection to end")

    run_on(loop_kind, scenario)


def test_both_directions_congested_at_once_lose_nothing(loop_kind: str, backends) -> None:
    """Each side paused for one direction must still take data for the other.

    The backend sends 24 MiB without reading while the client sends 24 MiB
    without reading: the proxy's sends fall short toward both, so each
    socket is paused for reading while it still has data to take. A relay
    that forgets the pending write of a paused socket deadlocks here.
    """
    be = backends()
    np_ = free_port()
    n = 24 * MiB
    payload = os.urandom(n)
    expected = b"".join(pattern_stream(n))

    def client() -> bytes:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
            s.settimeout(20)
            s.connect((NODE_IP, np_))
            s.sendall(f"BURST {n}\n".encode())

            def send() -> None:
                with contextlib.suppress(OSError):
                    s.sendall(payload)
                    s.shutdown(socket.SHUT_WR)

            t = threading.Thread(target=send)
            t.start()
            time.sleep(0.5)  # read nothing while both directions fill up
            got = read_all(s)
            t.join(20)
            return got

    async def scenario() -> None:
        async with serving(snap(*web(np_, be.port, "127.0.0.1"))):
            got = await asyncio.to_thread(client)
            assert got[:n] == expected
            assert got[n:] == f"{n}\n".encode()

    run_on(loop_kind, scenario, timeout=60)


def test_backend_rst_resets_client(loop_kind: str, backends) -> None:
    be = backends()
    np_ = free_port()

    def client() -> str:
        with connect(np_) as s:
            s.sendall(b"RST\n")
            assert s.recv(3) == b"ok\n"
            s.sendall(b"x")  # the backend now closes with an RST
            try:
                data = s.recv(10)
            except ConnectionResetError:
                return "reset"
            return f"got {data!r}"

    async def scenario() -> None:
        async with serving(snap(*web(np_, be.port, "127.0.0.1"))):
            assert await asyncio.to_thread(client) == "reset"

    run_on(loop_kind, scenario)


def test_client_rst_resets_backend(loop_kind: str, backends) -> None:
    be = backends()
    np_ = free_port()

    def client() -> None:
        s = connect(np_)
        s.sendall(b"ECHO\nabc")
        assert s.recv(3) == b"abc"
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        s.close()

    async def scenario() -> None:
        async with serving(snap(*web(np_, be.port, "127.0.0.1"))):
            await asyncio.to_thread(client)
            for _ in range(100):
                if be.events:
                    break
                await asyncio.sleep(0.02)
            assert be.events == [("ECHO", "reset")]

    run_on(loop_kind, scenario)


def test_upstream_close_is_a_fin_not_a_reset(loop_kind: str, backends) -> None:
    be = backends()
    np_ = free_port()

    def client() -> bytes:
        with connect(np_) as s:
            s.sendall(b"SEND 1000\n")
            return read_all(s)  # EOF, not ConnectionResetError

    async def scenario() -> None:
        async with serving(snap(*web(np_, be.port, "127.0.0.1"))):
            assert len(await asyncio.to_thread(client)) == 1000

    run_on(loop_kind, scenario)


def test_refused_endpoint_retried_on_another(loop_kind: str, backends, caplog) -> None:
    port = free_port("127.0.0.9")
    be = backends("127.0.0.9", port, name="good")
    np_ = free_port()
    caplog.set_level(logging.WARNING, logger="proxy.userspace.forwarder")
    key = "default/web"
    failures0 = counter(metrics.UPSTREAM_CONNECT_FAILURES, key)

    def client() -> str:
        with connect(np_) as s:
            s.sendall(b"PEER\n")
            return read_all(s).decode().split()[0]

    async def scenario() -> None:
        # 127.0.0.5 has nothing on that port: ECONNREFUSED, sorted first.
        async with serving(snap(*web(np_, port, "127.0.0.5", "127.0.0.9"))):
            names = [await asyncio.to_thread(client) for _ in range(4)]
            assert names == ["good"] * 4

    run_on(loop_kind, scenario)
    assert counter(metrics.UPSTREAM_CONNECT_FAILURES, key) - failures0 >= 2
    msgs = [r.getMessage() for r in caplog.records]
    assert any(
        key in m and f"127.0.0.5:{port}" in m and "127.0.0.1:" in m and "refused" in m.lower()
        for m in msgs
    ), msgs
    assert len(be.seen) == 4


def test_every_endpoint_refused_resets_client(loop_kind: str) -> None:
    port = free_port("127.0.0.5")
    np_ = free_port()
    rejected0 = counter(metrics.CONNECTIONS_REJECTED, "default/web")

    def client() -> str:
        # On loopback the RST can arrive before connect() even returns.
        try:
            with connect(np_) as s:
                s.sendall(b"PEER\n")
                return f"data {s.recv(10)!r}"
        except ConnectionResetError:
            return "reset"

    async def scenario() -> None:
        async with serving(snap(*web(np_, port, "127.0.0.5", "127.0.0.6"))) as dp:
            assert await asyncio.to_thread(client) == "reset"
            await eventually(lambda: dp.active_connections() == 0, 2,
                             what="every connection to end")

    run_on(loop_kind, scenario)
    assert counter(metrics.CONNECTIONS_REJECTED, "default/web") - rejected0 == 1


def _max_buffered(dp: Dataplane) -> int:
    return dp.forwarder.max_buffered()


# A relay holds at most one unsent read per direction; the kernel's socket
# buffers hold the rest, and a full one stalls the sender.
BUFFER_BOUND = READ_SIZE


def test_backpressure_slow_backend_bounds_memory(loop_kind: str, backends) -> None:
    be = backends()
    np_ = free_port()
    stop = threading.Event()
    sent = [0]

    def client() -> None:
        with connect(np_) as s:
            s.sendall(b"HOLD\n")
            s.settimeout(0.5)
            chunk = b"x" * 65536
            deadline = time.monotonic() + 8
            try:
                while not stop.is_set() and time.monotonic() < deadline:
                    sent[0] += s.send(chunk)
            except TimeoutError:
                pass  # everything is full: the proxy stopped reading us
            stop.wait(5)

    async def scenario() -> None:
        async with serving(snap(*web(np_, be.port, "127.0.0.1"))) as dp:
            t = asyncio.ensure_future(asyncio.to_thread(client))
            worst = 0
            last, still = -1, 0.0
            # Sample while the client pushes, until it has made no progress
            # for 0.3 s: stalled by flow control, not absorbed by the proxy.
            for _ in range(300):
                await asyncio.sleep(0.02)
                worst = max(worst, _max_buffered(dp))
                still = still + 0.02 if sent[0] == last else 0.0
                last = sent[0]
                if still >= 0.3 and be.holding.is_set():
                    break
            assert still >= 0.3, "the client must end up stalled"
            assert worst <= BUFFER_BOUND, worst
            stop.set()
            await t

    run_on(loop_kind, scenario)


def test_backpressure_slow_client_bounds_memory_and_loses_nothing(
    loop_kind: str, backends
) -> None:
    be = backends()
    np_ = free_port()
    n = 48 * MiB
    go = threading.Event()

    def client() -> int:
        with connect(np_) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
            s.sendall(f"SEND {n}\n".encode())
            go.wait(10)  # a slow reader: nothing is read for a while
            return len(read_all(s))

    async def scenario() -> None:
        async with serving(snap(*web(np_, be.port, "127.0.0.1"))) as dp:
            t = asyncio.ensure_future(asyncio.to_thread(client))
            worst = 0
            for _ in range(50):
                await asyncio.sleep(0.02)
                worst = max(worst, _max_buffered(dp))
            assert worst <= BUFFER_BOUND, worst
            go.set()
            assert await t == n

    run_on(loop_kind, scenario)


def test_drain_waits_for_live_connections_then_resets_the_rest(loop_kind: str, backends) -> None:
    be = backends()
    np_ = free_port()

    def drip() -> bytes:
        with connect(np_) as s:
            s.sendall(b"DRIP 8\n")
            return read_all(s)

    def hold(result: list[str]) -> None:
        with connect(np_) as s:
            s.sendall(b"HOLD\n")
            try:
                data = s.recv(10)
                result.append(f"eof {data!r}")
            except ConnectionResetError:
                result.append("reset")

    async def scenario() -> None:
        async with serving(snap(*web(np_, be.port, "127.0.0.1"))) as dp:
            t = asyncio.ensure_future(asyncio.to_thread(drip))
            await asyncio.sleep(0.1)
            await dp.stop_accepting()
            assert dp.listeners() == []
            with pytest.raises(ConnectionRefusedError):
                await asyncio.to_thread(connect, np_)
            assert await dp.drain(3.0) == 0  # the drip ends well within grace
            assert (await t).count(b"drip") == 8

            # Now one that never ends: reset at the deadline.
            dp2 = Dataplane(loop=asyncio.get_running_loop())
            px2 = Proxier(sync_config(NODE), dataplane=dp2)
            px2.sync(snap(*web(np_, be.port, "127.0.0.1")))
            result: list[str] = []
            t2 = asyncio.ensure_future(asyncio.to_thread(hold, result))
            for _ in range(100):
                if be.holding.is_set():
                    break
                await asyncio.sleep(0.02)
            await dp2.stop_accepting()
            t0 = time.monotonic()
            assert await dp2.drain(0.3) == 1
            assert time.monotonic() - t0 < 1.5
            await t2
            assert result == ["reset"]
            await eventually(lambda: dp2.active_connections() == 0, 2,
                             what="every connection to end")
            dp2.close()

    run_on(loop_kind, scenario)


def test_affinity_survives_reload(loop_kind: str, backends) -> None:
    port = free_port("127.0.0.7")
    backends("127.0.0.7", port, name="a")
    backends("127.0.0.8", port, name="b")
    np_ = free_port()

    def who() -> str:
        with connect(np_) as s:
            s.sendall(b"PEER\n")
            return read_all(s).decode().split()[0]

    async def scenario() -> None:
        state = snap(*web(np_, port, "127.0.0.7", "127.0.0.8", affinity=60))
        async with syncing(state) as px:
            dp = px.dataplane
            assert isinstance(dp, Dataplane)
            first = {await asyncio.to_thread(who) for _ in range(4)}
            assert len(first) == 1
            # An unrelated change is a new snapshot; the balancer must persist.
            objs = web(np_, port, "127.0.0.7", "127.0.0.8", affinity=60)
            px.sync(snap(*objs, service("other", free_port(), 9), generation=2))
            again = {await asyncio.to_thread(who) for _ in range(4)}
            assert again == first
            px.sync(snap(*web(np_, port, "127.0.0.7", "127.0.0.8"), generation=3))
            spread = {await asyncio.to_thread(who) for _ in range(4)}
            assert spread == {"a", "b"}

    run_on(loop_kind, scenario)


def test_metrics_count_bytes_once_at_close(loop_kind: str, backends) -> None:
    be = backends()
    np_ = free_port()
    key = "default/web"
    up0 = counter(metrics.BYTES, key, "to_endpoint")
    down0 = counter(metrics.BYTES, key, "to_client")
    fwd0 = counter(metrics.CONNECTIONS_FORWARDED, key, "true")

    def client() -> None:
        with connect(np_) as s:
            s.sendall(b"SEND 5000\n")
            assert len(read_all(s)) == 5000

    async def scenario() -> None:
        async with serving(snap(*web(np_, be.port, "127.0.0.1"))):
            await asyncio.to_thread(client)
            await eventually(lambda: metrics.REGISTRY.get_sample_value(
                "kubeproxy_kpx_active_connections", {"service_port": key}) == 0, 2,
                what="the active connections gauge to come back to 0")

    run_on(loop_kind, scenario)
    assert counter(metrics.BYTES, key, "to_endpoint") - up0 == len(b"SEND 5000\n")
    assert counter(metrics.BYTES, key, "to_client") - down0 == 5000
    # Node-originated (loopback client): always SNAT.
    assert counter(metrics.CONNECTIONS_FORWARDED, key, "true") - fwd0 == 1
