"""A return path that cannot be restored makes the proxy unhealthy, everywhere health shows.

``ReturnPathGuard`` runs the routing's ``ensure`` every sync period; here the
routing is a fake (no namespace, nothing installed), so a failure can be
injected: while it lasts, ``/healthz``, ``/livez`` and a healthCheckNodePort
with a local endpoint all say 503; once a round succeeds they say 200 again.
Repairs and failures are counted.
"""

from __future__ import annotations

import asyncio
import json
import threading

from healthz.proxy_health import NodeHealthServer, ProxyHealth
from healthz.registry import REGISTRY
from proxy.core.model import Node
from proxy.userspace.transparent import ReturnPathGuard, TransparentRouting
from tests.support.health import (
    ep,
    eps_slice,
    free_port,
    get,
    http_raw,
    lb_service,
    snap,
    split_response,
)
from tests.support.wiring import HealthChecks


def sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


class FakeRouting(TransparentRouting):
    """``ensure`` scripted: each call pops the next outcome (parts restored, or an error)."""

    def __init__(self, outcomes: list[list[str] | Exception]) -> None:
        super().__init__()
        self.outcomes = outcomes
        self.calls = 0
        self.threads: set[str] = set()

    def ensure(self) -> list[str]:
        self.calls += 1
        self.threads.add(threading.current_thread().name)
        out = self.outcomes.pop(0)
        if isinstance(out, Exception):
            raise out
        return out

    async def ensure_async(self) -> list[str]:
        await asyncio.sleep(0)  # the real one awaits its subprocesses
        return self.ensure()


def test_a_fault_makes_the_proxy_unhealthy_until_cleared() -> None:
    health = ProxyHealth(timeout=60.0)
    assert health.healthy()
    health.set_fault("return-path", "nft: Operation not permitted")
    assert not health.healthy()
    health.clear_fault("return-path")
    assert health.healthy()


async def test_guard_marks_unhealthy_while_repair_fails_and_counts_repairs() -> None:
    health = ProxyHealth(timeout=60.0)
    node = NodeHealthServer(health)
    health.sync_node(Node("node-a").eligible)
    port = free_port()
    svc = lb_service(hc_port=port)
    hc = HealthChecks("node-a", health, ["127.0.0.1"])
    hc.sync(snap([svc], [eps_slice(svc, [ep("10.1.0.1", "node-a")])]))
    repaired = sample("kubeproxy_kpx_return_path_repairs_total", part="rule")
    failed = sample("kubeproxy_kpx_return_path_repair_failures_total")

    routing = FakeRouting([["rule"], RuntimeError("ip rule add: Permission denied"), []])
    guard = ReturnPathGuard(routing, health, period=0.01)
    try:
        # Missing and put back within the round: counted, and healthy throughout.
        assert await guard.check() == ["rule"]
        assert health.healthy() and node.document(with_node=True)[0]
        assert sample("kubeproxy_kpx_return_path_repairs_total", part="rule") == repaired + 1
        assert (await hc_answer(port))[0] == 200

        # Cannot be put back: every health answer is 503 until a round succeeds.
        assert await guard.check() == []
        ok, doc = node.document(with_node=True)
        assert (ok, doc["healthy"]) == (False, False)
        assert node.document(with_node=False)[0] is False  # /livez too
        status, body = await hc_answer(port)
        assert status == 503 and body["localEndpoints"] == 1
        assert body["serviceProxyHealthy"] is False
        assert sample("kubeproxy_kpx_return_path_repair_failures_total") == failed + 1
        assert health.faults == {"return-path": "ip rule add: Permission denied"}

        assert await guard.check() == []
        assert health.healthy() and node.document(with_node=True)[0]
        assert (await hc_answer(port))[0] == 200
        assert routing.calls == 3
    finally:
        await hc.stop()


async def hc_answer(port: int) -> tuple[int, dict[str, object]]:
    head, body = split_response(await http_raw(port, get()))
    return int(head.split(b" ", 2)[1]), json.loads(body)


async def test_guard_runs_every_period_and_starts_no_thread() -> None:
    health = ProxyHealth(timeout=60.0)
    routing = FakeRouting([[], [], [], [], []])
    guard = ReturnPathGuard(routing, health, period=0.02)
    threads = threading.active_count()
    task = asyncio.create_task(guard.run())
    try:
        for _ in range(200):  # bounded: 2 s
            if routing.calls >= 3:
                break
            await asyncio.sleep(0.01)
    finally:
        task.cancel()
    assert routing.calls >= 3
    assert health.healthy()
    # The check awaits the loop's own subprocesses (ensure_async): a thread would
    # switch the process to glibc's multi-threaded paths for good
    # (proxy.sources.statefile.INLINE_MAX_BYTES), so none is started, not even an executor's.
    assert threading.active_count() == threads
    assert routing.threads == {threading.current_thread().name}
