"""The proxier's one sync: one computation per snapshot, handed to the dataplane and healthz.

Also kube-proxy's sync metrics, which the sync sets (the no-local-endpoints
gauge, network programming latency), and the pure half prepared in the
source's worker thread giving exactly what the loop would compute.
"""

from __future__ import annotations

import dataclasses

import pytest

from healthz.proxy_health import ProxyHealth
from healthz.service_health import ServiceHealthServer
from proxy.core.sync import SyncConfig, SyncResult
from proxy.proxier import Proxier
from tests.support.health import FakeClock, ep, eps_slice, free_port, lb_service, snap
from tests.support.wiring import sample, sync_config

T0 = 1_800_000_000.0
COUNT = "kubeproxy_network_programming_duration_seconds_count"
TOTAL = "kubeproxy_network_programming_duration_seconds_sum"
DROPPING = "kubeproxy_sync_proxy_rules_no_local_endpoints_total"
LAST = "kubeproxy_sync_proxy_rules_last_timestamp_seconds"
DURATIONS = "kubeproxy_sync_proxy_rules_duration_seconds_count"


def proxier(clock: FakeClock | None = None, **kw: object) -> Proxier:
    return Proxier(sync_config("node-a"), clock=clock or FakeClock(T0), **kw)  # type: ignore[arg-type]


class Recorder:
    """A dataplane that keeps what the sync hands it."""

    def __init__(self, fail: bool = False) -> None:
        self.prepared: list[SyncResult] = []
        self.applied: list[SyncResult] = []
        self.fail = fail

    def prepare(self, sync: SyncResult) -> None:
        self.prepared.append(sync)

    def apply(self, sync: SyncResult) -> None:
        self.applied.append(sync)
        if self.fail:
            raise OSError("dataplane broke")


def test_no_local_endpoints_gauge_counts_dropping_local_service_ports() -> None:
    here = lb_service("here", node_port=30001)
    elsewhere = lb_service("elsewhere", node_port=30002)
    nowhere = lb_service("nowhere", node_port=30003)
    cluster = lb_service("cluster", policy="Cluster", node_port=30004)
    proxier().sync(
        snap(
            [here, elsewhere, nowhere, cluster],
            [
                eps_slice(here, [ep("10.1.0.1", "node-a")]),
                eps_slice(elsewhere, [ep("10.1.0.2", "node-b")]),
                eps_slice(cluster, [ep("10.1.0.3", "node-b")]),
            ],
        )
    )
    # Only "elsewhere" drops: "nowhere" rejects, "cluster" forwards.
    assert sample(DROPPING, traffic_policy="external", ip_family="IPv4") == 1
    assert sample(DROPPING, traffic_policy="internal", ip_family="IPv4") == 0


def test_network_programming_latency_observed_once_per_new_trigger() -> None:
    clock = FakeClock(T0)
    px = proxier(clock)
    svc = lb_service()
    n0, s0 = sample(COUNT, ip_family="IPv4"), sample(TOTAL, ip_family="IPv4")

    # A trigger from before we started measures our start-up: ignored.
    px.sync(snap([svc], [eps_slice(svc, [], trigger_time=T0 - 100)]))
    assert sample(COUNT, ip_family="IPv4") == n0

    clock.advance(2.0)
    state = snap([svc], [eps_slice(svc, [], trigger_time=T0 + 1.5)])
    px.sync(state)
    assert sample(COUNT, ip_family="IPv4") == n0 + 1
    assert sample(TOTAL, ip_family="IPv4") == pytest.approx(s0 + 0.5)
    px.sync(state)  # same trigger again: not a new change
    assert sample(COUNT, ip_family="IPv4") == n0 + 1


def test_a_failed_sync_is_timed_but_not_reported_as_synced() -> None:
    """kube-proxy moves ``last_timestamp`` and observes the network programming latency
    only once the rules went in ("the last time proxy rules were *successfully*
    synced"): a stuck kpx must show as stuck. The changes are measured when a sync puts
    them in force."""
    clock = FakeClock(T0)
    dp = Recorder()
    px = proxier(clock, dataplane=dp)
    svc = lb_service()
    px.sync(snap([svc], []))
    last = sample(LAST, ip_family="IPv4")
    n0, d0 = sample(COUNT, ip_family="IPv4"), sample(DURATIONS, ip_family="IPv4")
    s0 = sample(TOTAL, ip_family="IPv4")
    clock.advance(2.0)
    dp.fail = True
    state = snap([svc], [eps_slice(svc, [], trigger_time=T0 + 1.5)], generation=2)
    with pytest.raises(OSError):
        px.sync(state)
    assert sample(LAST, ip_family="IPv4") == last
    assert sample(COUNT, ip_family="IPv4") == n0
    assert sample(DURATIONS, ip_family="IPv4") == d0 + 1  # every attempt is timed
    clock.advance(1.0)
    dp.fail = False
    px.sync(state)
    assert sample(LAST, ip_family="IPv4") == T0 + 3.0
    assert sample(COUNT, ip_family="IPv4") == n0 + 1
    assert sample(TOTAL, ip_family="IPv4") == pytest.approx(s0 + 1.5)  # from its trigger


def test_sync_metrics_prepared_or_not_give_the_same_gauges() -> None:
    clock = FakeClock(T0)
    here, gone = lb_service("here", node_port=30001), lb_service("gone", node_port=30002)
    first = snap([here, gone], [eps_slice(here, [ep("10.1.0.1", "node-a")], trigger_time=T0 + 1),
                                eps_slice(gone, [ep("10.1.0.2", "node-b")], trigger_time=T0 + 1)])
    second = snap([here, gone], [eps_slice(here, [ep("10.1.0.1", "node-a")], trigger_time=T0 + 1),
                                 eps_slice(gone, [], trigger_time=T0 + 2)], generation=2)
    prepared = proxier(clock)
    plain = proxier(clock)
    n0 = sample(COUNT, ip_family="IPv4")
    clock.advance(3)
    prepared.prepare(first)
    prepared.sync(first)
    assert sample(DROPPING, traffic_policy="external", ip_family="IPv4") == 1
    assert sample(COUNT, ip_family="IPv4") == n0 + 2
    prepared.prepare(second)
    prepared.sync(second)
    assert sample(DROPPING, traffic_policy="external", ip_family="IPv4") == 0
    assert sample(COUNT, ip_family="IPv4") == n0 + 3  # only the slice whose trigger changed

    plain.prepare(second)  # prepared for another snapshot: not used for this one
    plain.sync(first)
    assert sample(DROPPING, traffic_policy="external", ip_family="IPv4") == 1
    assert sample(COUNT, ip_family="IPv4") == n0 + 5
    plain.sync(second)
    assert sample(DROPPING, traffic_policy="external", ip_family="IPv4") == 0
    assert sample(COUNT, ip_family="IPv4") == n0 + 6


def test_prepared_trigger_times_are_measured_against_the_last_sync() -> None:
    clock = FakeClock(T0)
    svc = lb_service()
    state = snap([svc], [eps_slice(svc, [], trigger_time=T0 + 1)])
    px = proxier(clock)
    n0 = sample(COUNT, ip_family="IPv4")
    px.prepare(state)
    px.sync(state)  # no prepared data left: measured afresh, already seen
    px.sync(state)
    assert sample(COUNT, ip_family="IPv4") == n0 + 1


def test_one_computation_per_snapshot_reaches_every_consumer() -> None:
    """The dataplane gets the very result it was prepared with; healthz gets its parts."""
    dataplane = Recorder()
    health = ProxyHealth()
    services = ServiceHealthServer(health)  # not started: records, binds nothing
    px = proxier(dataplane=dataplane, services=services, health=health)
    svc = lb_service("lb", hc_port=free_port(), node_port=30001)
    state = snap([svc], [eps_slice(svc, [ep("10.1.0.1", "node-a"), ep("10.1.0.2", "node-a")])])
    px.prepare(state)
    px.sync(state)
    assert dataplane.applied == dataplane.prepared, "prepared once, applied as prepared"
    result = dataplane.applied[0]
    assert result is px.last
    assert result.health_check_ports == {"default/lb": svc.health_check_node_port}
    assert result.local_ready == {"default/lb": 2}
    assert health.node_eligible, "the snapshot's node-a is eligible"
    assert services._ports == {"default/lb": svc.health_check_node_port}
    assert services._counts == {"default/lb": 2}
    assert list(result.plans) == [30001]


def test_a_failing_dataplane_still_feeds_healthz_and_keeps_the_update_pending() -> None:
    health = ProxyHealth()
    services = ServiceHealthServer(health)
    px = proxier(dataplane=Recorder(fail=True), services=services, health=health)
    svc = lb_service("lb", hc_port=free_port(), node_port=30001)
    with pytest.raises(OSError, match="dataplane broke"):
        px.sync(snap([svc], [eps_slice(svc, [ep("10.1.0.1", "node-a")])]))
    assert services._counts == {"default/lb": 1}
    assert health.node_eligible


async def test_health_checks_prepared_or_not_serve_the_same_counts() -> None:
    svc = lb_service("lb", hc_port=free_port(), node_port=30001)
    state = snap([svc], [eps_slice(svc, [ep("10.1.0.1", "node-a"), ep("10.1.0.2", "node-a")])])
    other = snap([svc], [eps_slice(svc, [ep("10.1.0.1", "node-a")])], generation=2)
    for prepare_with in (state, other, None):
        server = ServiceHealthServer(ProxyHealth())
        server.start()
        px = proxier(services=server)
        if prepare_with is not None:
            px.prepare(prepare_with)
        try:
            px.sync(state)
            assert server.local_endpoints("default/lb") == 2, prepare_with
            assert px._prepared.peek(prepare_with or state) is None
        finally:
            await server.stop()


def test_no_local_endpoints_gauge_counts_clusterips_that_drop_for_itp_local() -> None:
    """iTP=Local with endpoints only elsewhere: its ClusterIP drops, counted as internal."""
    svc = dataclasses.replace(
        lb_service("db", node_port=30005, policy="Cluster"),
        cluster_ip="10.96.0.10", internal_traffic_policy="Local",
    )
    state = snap([svc], [eps_slice(svc, [ep("10.1.0.2", "node-b")])])
    Proxier(SyncConfig("node-a", vips=True), clock=FakeClock(T0)).sync(state)
    assert sample(DROPPING, traffic_policy="internal", ip_family="IPv4") == 1
    assert sample(DROPPING, traffic_policy="external", ip_family="IPv4") == 0
    Proxier(SyncConfig("node-a", vips=True), clock=FakeClock(T0)).sync(
        snap([svc], [eps_slice(svc, [ep("10.1.0.1", "node-a")])], generation=2)
    )
    assert sample(DROPPING, traffic_policy="internal", ip_family="IPv4") == 0


def _dual_state(node_ips: tuple[str, ...], generation: int = 1,  # type: ignore[no-untyped-def]
                v6_node: str = "node-a"):
    """A PreferDualStack eTP=Local LB service: one IPv4 endpoint on node-a, two IPv6 ones
    on ``v6_node``; node-a has ``node_ips``."""
    from proxy.k8s import parse_state
    from tests.support.objects import endpoint_slice, node, service, state_yaml

    return parse_state(state_yaml(
        node("node-a", *node_ips),
        service("web", 30080, type="LoadBalancer", etp="Local", hc_port=32000,
                cluster_ip="10.96.0.1", clusterIPs=["10.96.0.1", "fd00:96::1"],
                ipFamilies=["IPv4", "IPv6"], ipFamilyPolicy="PreferDualStack"),
        endpoint_slice("web", ("10.1.0.1", "node-a"), name="web-4"),
        endpoint_slice("web", ("fd00:1::1", v6_node), ("fd00:1::2", v6_node), name="web-6",
                       address_type="IPv6"),
    ), generation)


class FakeServices:
    def __init__(self) -> None:
        self.hosts: tuple[str, ...] = ()
        self.counts: tuple[object, object] = ({}, None)

    def sync_services(self, ports: object, hosts: object) -> None:
        self.hosts = tuple(hosts)  # type: ignore[arg-type]

    def sync_endpoints(self, local_ready: object, local_ready6: object = None) -> None:
        self.counts = (local_ready, local_ready6)


def test_each_family_dataplane_gets_its_own_result_and_healthz_both() -> None:
    """kube-proxy's MetaProxier: IPv4 and IPv6 dataplanes, one sync, healthz fed both."""
    four, six, services = Recorder(), Recorder(), FakeServices()
    health = ProxyHealth(timeout=60)
    turned: list[bool] = []
    px = proxier(dataplane=four, dataplane6=six, services=services, health=health,
                 healthz_ipv6=turned.append)
    snapshot = _dual_state(("10.0.0.1", "fd00::a"))
    px.prepare(snapshot)
    px.sync(snapshot)
    assert [r.family for r in four.prepared + four.applied] == [4, 4]
    assert [r.family for r in six.prepared + six.applied] == [6, 6]
    assert six.applied[0] is six.prepared[0]  # prepared once, off the loop
    [v6] = six.applied
    assert v6.listen_hosts == ("::",) and v6.node_ips == ("fd00::a",)
    assert {e.ip for p in v6.plans.values() for e in p.cluster} == {"fd00:1::1", "fd00:1::2"}
    assert {e.ip for p in four.applied[0].plans.values() for e in p.cluster} == {"10.1.0.1"}
    assert services.hosts == ("0.0.0.0", "::")
    assert services.counts == ({"default/web": 1}, {"default/web": 2})
    assert health.families == ("IPv4", "IPv6") and turned == [True]

    # The node loses its IPv6 address: the IPv6 dataplane is emptied, healthz told.
    px.sync(_dual_state(("10.0.0.1",), 2))
    assert six.applied[-1].family == 6 and six.applied[-1].plans == {}
    assert six.applied[-1].listen_hosts == ()
    assert services.hosts == ("0.0.0.0",) and services.counts[1] is None
    assert health.families == ("IPv4",) and turned == [True, False]


def test_sync_metrics_carry_each_family_it_programmed() -> None:
    """``ip_family`` as kube-proxy's proxiers set it: IPv6 series while the node has IPv6.

    node-a's IPv6 endpoints are elsewhere (node-b), its IPv4 one here: only
    the IPv6 family drops eTP=Local traffic. When the node loses IPv6 its
    IPv6 gauge goes to 0 rather than freezing, and its sync count stops.
    """
    def state(ips: tuple[str, ...], generation: int):  # type: ignore[no-untyped-def]
        return _dual_state(ips, generation, v6_node="node-b")

    runs = "kubeproxy_sync_proxy_rules_duration_seconds_count"
    v4_runs, v6_runs = sample(runs, ip_family="IPv4"), sample(runs, ip_family="IPv6")
    px = proxier()
    px.sync(state(("10.0.0.1", "fd00::a"), 1))
    assert sample(runs, ip_family="IPv4") == v4_runs + 1
    assert sample(runs, ip_family="IPv6") == v6_runs + 1
    assert sample(DROPPING, traffic_policy="external", ip_family="IPv4") == 0
    assert sample(DROPPING, traffic_policy="external", ip_family="IPv6") == 1
    px.sync(state(("10.0.0.1",), 2))
    assert sample(runs, ip_family="IPv4") == v4_runs + 2
    assert sample(runs, ip_family="IPv6") == v6_runs + 1
    assert sample(DROPPING, traffic_policy="external", ip_family="IPv6") == 0
