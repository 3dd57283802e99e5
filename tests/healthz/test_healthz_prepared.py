"""The sidecar's per-snapshot work is prepared off the loop, with the same results.

``prepare`` runs in the state source's worker thread (issue "Robustness",
point 5: reading 50,000 services on the loop delayed /healthz); ``sync`` on
the loop then reuses it, for that very snapshot only.
"""

from __future__ import annotations

from hzutil import FakeClock, ep, eps_slice, free_port, lb_service, snap

from healthz.proxy_health import SyncMetrics
from healthz.service_health import ServiceHealthServer
from proxy.metrics import REGISTRY
from proxy.sources.hub import ProxyHealth

T0 = 1_800_000_000.0
COUNT = "kubeproxy_network_programming_duration_seconds_count"
DROPPING = "kubeproxy_sync_proxy_rules_no_local_endpoints_total"


def sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def test_sync_metrics_prepared_or_not_give_the_same_gauges() -> None:
    clock = FakeClock(T0)
    here, gone = lb_service("here", node_port=30001), lb_service("gone", node_port=30002)
    first = snap([here, gone], [eps_slice(here, [ep("10.1.0.1", "node-a")], trigger_time=T0 + 1),
                                eps_slice(gone, [ep("10.1.0.2", "node-b")], trigger_time=T0 + 1)])
    second = snap([here, gone], [eps_slice(here, [ep("10.1.0.1", "node-a")], trigger_time=T0 + 1),
                                 eps_slice(gone, [], trigger_time=T0 + 2)], generation=2)
    prepared = SyncMetrics("node-a", clock=clock)
    plain = SyncMetrics("node-a", clock=clock)
    n0 = sample(COUNT)
    clock.advance(3)
    prepared.prepare(first)
    prepared.sync(first)
    assert sample(DROPPING, traffic_policy="external") == 1
    assert sample(COUNT) == n0 + 2
    prepared.prepare(second)
    prepared.sync(second)
    assert sample(DROPPING, traffic_policy="external") == 0
    assert sample(COUNT) == n0 + 3  # only the slice whose trigger changed

    plain.prepare(second)  # prepared for another snapshot: not used for this one
    plain.sync(first)
    assert sample(DROPPING, traffic_policy="external") == 1
    assert sample(COUNT) == n0 + 5
    plain.sync(second)
    assert sample(DROPPING, traffic_policy="external") == 0
    assert sample(COUNT) == n0 + 6


def test_prepared_trigger_times_are_measured_against_the_last_sync() -> None:
    clock = FakeClock(T0)
    svc = lb_service()
    state = snap([svc], [eps_slice(svc, [], trigger_time=T0 + 1)])
    metrics = SyncMetrics("node-a", clock=clock)
    n0 = sample(COUNT)
    metrics.prepare(state)
    metrics.sync(state)  # no prepared data left: measured afresh, already seen
    metrics.sync(state)
    assert sample(COUNT) == n0 + 1


async def test_health_checks_prepared_or_not_serve_the_same_counts() -> None:
    svc = lb_service("lb", hc_port=free_port(), node_port=30001)
    state = snap([svc], [eps_slice(svc, [ep("10.1.0.1", "node-a"), ep("10.1.0.2", "node-a")])])
    other = snap([svc], [eps_slice(svc, [ep("10.1.0.1", "node-a")])], generation=2)
    for prepare_with in (state, other, None):
        server = ServiceHealthServer("node-a", ProxyHealth(), ["127.0.0.1"])
        if prepare_with is not None:
            server.prepare(prepare_with)
        try:
            server.sync(state)
            assert server.local_endpoints("default/lb") == 2, prepare_with
            assert server._prepared.peek(prepare_with or state) is None
        finally:
            await server.stop()
