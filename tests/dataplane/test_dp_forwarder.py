"""The forwarder's own machinery: connect deadlines, batched metrics, the epoll set.

In-process on loopback, under both loops. A connect that never completes is
made without a firewall: a listener whose accept queue is full drops SYNs
(``listen(0)`` plus one connection nobody accepts), so the proxy's connect
to it hangs like one to a dead host.
"""

from __future__ import annotations

import asyncio
import logging
import select
import socket
import time
from collections.abc import Iterator

import pytest

from lab.common import eventually
from proxy.metrics import REGISTRY
from proxy.proxier import Proxier
from proxy.userspace import forwarder
from proxy.userspace.dataplane import Dataplane
from proxy.userspace.forwarder import Forwarder
from tests.support.loops import NODE, NODE_IP, free_port, run_on, snap, web
from tests.support.wiring import sync_config

pytestmark = pytest.mark.usefixtures("relay_kind")  # both relays: conftest.py

KEY = "default/web"


@pytest.fixture
def stuck_port() -> Iterator[int]:
    """A port on 127.0.0.5 whose connects hang: its accept queue is full."""
    lis = socket.socket()
    lis.bind(("127.0.0.5", 0))
    lis.listen(0)
    port = lis.getsockname()[1]
    filler = socket.create_connection(("127.0.0.5", port), timeout=2)
    probe = socket.socket()
    probe.settimeout(0.3)
    try:
        with pytest.raises(TimeoutError):
            probe.connect(("127.0.0.5", port))  # SYNs are dropped now
        yield port
    finally:
        probe.close()
        filler.close()
        lis.close()


def ask(port: int, timeout: float = 5.0) -> str:
    """The backend's name, "reset" or "eof", through the NodePort."""
    try:
        with socket.create_connection((NODE_IP, port), timeout=timeout) as s:
            s.sendall(b"PEER\n")
            data = s.recv(100)
            return data.decode().split()[0] if data else "eof"
    except ConnectionResetError:
        return "reset"


def sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, {"service_port": KEY, **labels}) or 0.0


def test_connect_timeout_moves_on_to_the_next_endpoint(
    loop_kind: str, backends, stuck_port: int, caplog: pytest.LogCaptureFixture
) -> None:
    good = backends("127.0.0.9", stuck_port, name="good")
    np_ = free_port()
    caplog.set_level(logging.WARNING, logger="proxy.userspace.forwarder")

    async def scenario() -> None:
        dp = Dataplane(loop=asyncio.get_running_loop(), connect_timeout=0.3)
        px = Proxier(sync_config(NODE), dataplane=dp)
        px.sync(snap(*web(np_, stuck_port, "127.0.0.5", "127.0.0.9")))
        try:
            t0 = time.monotonic()
            answers = [await asyncio.to_thread(ask, np_) for _ in range(4)]
            assert answers == ["good"] * 4
            # Round-robin met the stuck endpoint at least once: 0.3 s each.
            assert time.monotonic() - t0 >= 0.3
        finally:
            dp.close()

    run_on(loop_kind, scenario)
    timeouts = [r.getMessage() for r in caplog.records if "timed out" in r.getMessage()]
    assert timeouts and all(f"127.0.0.5:{stuck_port}" in m for m in timeouts), timeouts
    assert len(good.seen) == 4


def test_every_stuck_connect_times_out_and_resets_its_client(
    loop_kind: str, stuck_port: int
) -> None:
    """Many connects in flight share one deadline queue; none is forgotten."""
    np_ = free_port()

    async def scenario() -> None:
        dp = Dataplane(loop=asyncio.get_running_loop(), connect_timeout=0.3)
        px = Proxier(sync_config(NODE), dataplane=dp)
        px.sync(snap(*web(np_, stuck_port, "127.0.0.5")))
        try:
            t0 = time.monotonic()
            answers = await asyncio.gather(*(asyncio.to_thread(ask, np_) for _ in range(12)))
            assert answers == ["reset"] * 12
            assert time.monotonic() - t0 < 3.0
            await eventually(lambda: dp.active_connections() == 0, 2,
                             what="every connection to end")
            assert dp.forwarder.connecting() == 0
        finally:
            dp.close()

    run_on(loop_kind, scenario)


def test_counters_are_batched_and_the_active_gauge_is_live(
    loop_kind: str, backends, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(forwarder, "METRICS_FLUSH_INTERVAL", 60.0)  # only explicit flushes
    be = backends()
    np_ = free_port()
    accepted0 = sample("kubeproxy_kpx_connections_accepted_total")
    forwarded0 = sample("kubeproxy_kpx_connections_forwarded_total", snat="true")

    def hold() -> socket.socket:
        s = socket.create_connection((NODE_IP, np_), timeout=5)
        s.sendall(b"HOLD\n")
        return s

    async def scenario() -> None:
        dp = Dataplane(loop=asyncio.get_running_loop())
        px = Proxier(sync_config(NODE), dataplane=dp)
        px.sync(snap(*web(np_, be.port, "127.0.0.1")))
        held: list[socket.socket] = []
        try:
            for _ in range(3):
                held.append(await asyncio.to_thread(hold))
            for _ in range(200):
                if dp.forwarder.linked() == 3:
                    break
                await asyncio.sleep(0.01)
            # Live at scrape time, whatever the batching.
            assert sample("kubeproxy_kpx_active_connections") == 3
            # Counted, not yet pushed: one flush is pending.
            assert sample("kubeproxy_kpx_connections_accepted_total") == accepted0
            assert dp.forwarder._flush_timer is not None
            dp.forwarder.flush_metrics()
            assert sample("kubeproxy_kpx_connections_accepted_total") - accepted0 == 3
            assert sample("kubeproxy_kpx_connections_forwarded_total", snat="true") \
                - forwarded0 == 3
            dp.close()  # resets all three
            assert sample("kubeproxy_kpx_active_connections") == 0
        finally:
            for s in held:
                s.close()
            dp.close()

    run_on(loop_kind, scenario)


class _FakeEpoll:
    def __init__(self, events: list[tuple[int, int]]) -> None:
        self.events = events

    def poll(self, timeout: float) -> list[tuple[int, int]]:
        events, self.events = self.events, []
        return events


class _FakeSide:
    """Stands in for a relay's socket: records its events, can act on one."""

    def __init__(self, name: str, sock: socket.socket, seen: list[str]) -> None:
        self.name = name
        self.sock = sock
        self.fd = sock.fileno()
        self.seen = seen
        self.closed = False
        self.out = None
        self.relay = None
        self.action = None

    def on_event(self, events: int) -> None:
        self.seen.append(self.name)
        if self.action is not None:
            self.action()


def test_an_fd_closed_in_a_batch_gets_none_of_its_stale_events() -> None:
    """A socket closed while a batch is handled may be replaced under the same
    fd number in that batch (a connect retry); the old socket's event, still
    in the batch, must not reach the new owner."""
    loop = asyncio.new_event_loop()
    pairs = [socket.socketpair() for _ in range(3)]
    try:
        fwd = Forwarder(loop)
        seen: list[str] = []
        a, b, newcomer = (_FakeSide(name, pair[0], seen)
                          for name, pair in zip(("a", "b", "newcomer"), pairs, strict=True))

        def close_b_and_reuse_its_fd() -> None:
            old_fd = b.fd
            fwd.close_side(b)  # type: ignore[arg-type]
            newcomer.fd = old_fd  # as if the next socket got b's number
            fwd._sides[old_fd] = newcomer  # type: ignore[assignment]

        a.action = close_b_and_reuse_its_fd  # type: ignore[assignment]
        fwd._sides = {a.fd: a, b.fd: b}  # type: ignore[dict-item]
        fwd._ep = _FakeEpoll([(a.fd, select.EPOLLIN), (b.fd, select.EPOLLIN)])  # type: ignore[assignment]
        fwd._poll()
        assert seen == ["a"]
        # The next batch is new events: the newcomer gets its own.
        fwd._ep = _FakeEpoll([(newcomer.fd, select.EPOLLIN)])  # type: ignore[assignment]
        fwd._poll()
        assert seen == ["a", "newcomer"]
        fwd._ep = None
    finally:
        for x, y in pairs:
            x.close()
            y.close()
        loop.close()

