"""proxy.core.endpoints: kube-proxy's CategorizeEndpoints, slice merging and the health-check count.

The categorization table follows ``pkg/proxy/topology_test.go``
(TestCategorizeEndpoints), minus topology hints and internalTrafficPolicy,
which only matter for ClusterIP traffic that kpx does not proxy.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import pytest

from proxy.core.endpoints import (
    EndpointInfo,
    categorize_endpoints,
    local_ready_counts,
    service_port_endpoints,
)
from proxy.core.model import (
    Endpoint,
    EndpointPort,
    EndpointSlice,
    Service,
    ServicePort,
    Snapshot,
    TrafficPolicy,
)
from tests.support import model
from tests.support.model import endpoint as ep

HERE = "node-a"
THERE = "node-b"

svc = partial(model.service, port_name="http")
"""A ``default/web`` Service; ports here are named "http", to test matching by name."""
slice_ = partial(model.endpoint_slice, port_name="http")


@dataclass(frozen=True)
class E:
    """One row endpoint: compact on purpose, so the table reads like topology_test.go."""

    ip: str
    local: bool = False
    ready: bool = True
    serving: bool = True
    terminating: bool = False

    def info(self) -> EndpointInfo:
        return EndpointInfo(
            ip=self.ip,
            port=8080,
            node_name=HERE if self.local else THERE,
            is_local=self.local,
            ready=self.ready,
            serving=self.serving,
            terminating=self.terminating,
        )


def serving_terminating(ip: str, local: bool = False) -> E:
    return E(ip, local=local, ready=False, serving=True, terminating=True)


def draining(ip: str, local: bool = False) -> E:
    """Terminating and no longer serving: never used."""
    return E(ip, local=local, ready=False, serving=False, terminating=True)


def unready(ip: str, local: bool = False) -> E:
    """Not ready, not terminating (a failing readiness probe): never used."""
    return E(ip, local=local, ready=False, serving=False, terminating=False)


CATEGORIZE = [
    # (id, policy, endpoints, cluster, local, has_any)
    (
        "cluster: all ready endpoints",
        "Cluster",
        [E("10.0.0.1", local=True), E("10.0.0.2")],
        {"10.0.0.1", "10.0.0.2"},
        set(),
        True,
    ),
    (
        "cluster: endpoints not ready",
        "Cluster",
        [unready("10.0.0.0"), unready("10.0.0.1", local=True)],
        set(),
        set(),
        False,
    ),
    (
        "cluster: some endpoints ready",
        "Cluster",
        [unready("10.0.0.0"), E("10.0.0.1")],
        {"10.0.0.1"},
        set(),
        True,
    ),
    (
        "cluster: all endpoints terminating, fall back to serving-terminating",
        "Cluster",
        [serving_terminating("10.0.0.0", local=True), serving_terminating("10.0.0.1")],
        {"10.0.0.0", "10.0.0.1"},
        set(),
        True,
    ),
    (
        "cluster: one ready endpoint anywhere disables the terminating fallback",
        "Cluster",
        [serving_terminating("10.0.0.0", local=True), E("10.0.0.1")],
        {"10.0.0.1"},
        set(),
        True,
    ),
    (
        "cluster: terminating and not serving is never used",
        "Cluster",
        [draining("10.0.0.0"), draining("10.0.0.1", local=True)],
        set(),
        set(),
        False,
    ),
    (
        "cluster: fallback skips non-serving terminating and unready",
        "Cluster",
        [draining("10.0.0.0"), serving_terminating("10.0.0.1"), unready("10.0.0.2")],
        {"10.0.0.1"},
        set(),
        True,
    ),
    (
        "local: topology-free, local ready endpoints",
        "Local",
        [E("10.1.2.3", local=True), E("10.1.2.4"), E("10.1.2.5", local=True)],
        {"10.1.2.3", "10.1.2.4", "10.1.2.5"},
        {"10.1.2.3", "10.1.2.5"},
        True,
    ),
    (
        "local: all endpoints remote",
        "Local",
        [E("10.0.0.0"), E("10.0.0.1")],
        {"10.0.0.0", "10.0.0.1"},
        set(),
        True,
    ),
    (
        "local: all endpoints remote and terminating",
        "Local",
        [serving_terminating("10.0.0.0"), serving_terminating("10.0.0.1")],
        {"10.0.0.0", "10.0.0.1"},
        set(),
        True,
    ),
    (
        "local: with terminating endpoints (iTP Cluster, eTP Local)",
        "Local",
        [
            unready("10.0.0.0", local=True),
            E("10.0.0.1", local=True),
            serving_terminating("10.0.0.2", local=True),
            serving_terminating("10.0.0.3"),
            E("10.0.0.4"),
        ],
        {"10.0.0.1", "10.0.0.4"},
        {"10.0.0.1"},
        True,
    ),
    (
        "local: falls back to local serving-terminating even while remote ready exist",
        "Local",
        [serving_terminating("10.0.0.1", local=True), E("10.0.0.2"), draining("10.0.0.3", True)],
        {"10.0.0.2"},
        {"10.0.0.1"},
        True,
    ),
    (
        "local: only local terminating endpoints",
        "Local",
        [serving_terminating("10.0.0.0", local=True), draining("10.0.0.1", local=True)],
        {"10.0.0.0"},
        {"10.0.0.0"},
        True,
    ),
    (
        "local: local unready is never used, remote ready is not local",
        "Local",
        [unready("10.0.0.0", local=True), E("10.0.0.1")],
        {"10.0.0.1"},
        set(),
        True,
    ),
    (
        "local: nothing usable anywhere",
        "Local",
        [unready("10.0.0.0", local=True), draining("10.0.0.1", local=True), unready("10.0.0.2")],
        set(),
        set(),
        False,
    ),
    ("no endpoints at all", "Cluster", [], set(), set(), False),
    ("no endpoints at all, local", "Local", [], set(), set(), False),
]


@pytest.mark.parametrize(
    ("policy", "endpoints", "cluster", "local", "has_any"),
    [pytest.param(*row[1:], id=row[0]) for row in CATEGORIZE],
)
def test_categorize_endpoints(
    policy: TrafficPolicy,
    endpoints: list[E],
    cluster: set[str],
    local: set[str],
    has_any: bool,
) -> None:
    got = categorize_endpoints([e.info() for e in endpoints], svc(policy=policy))
    assert {e.ip for e in got.cluster} == cluster
    assert {e.ip for e in got.local} == local
    assert got.has_any is has_any


def test_categorize_keeps_input_order() -> None:
    eps = [E(f"10.0.0.{i}", local=i % 2 == 0).info() for i in (5, 1, 4, 2)]
    got = categorize_endpoints(eps, svc(policy="Local"))
    assert [e.ip for e in got.cluster] == ["10.0.0.5", "10.0.0.1", "10.0.0.4", "10.0.0.2"]
    assert [e.ip for e in got.local] == ["10.0.0.4", "10.0.0.2"]


def test_local_policy_needs_an_externally_accessible_service() -> None:
    # eTP only means something for externally reachable services (ExternalPolicyLocal).
    cluster_ip = svc(policy="Local", type="ClusterIP")
    got = categorize_endpoints([E("10.0.0.1", local=True).info()], cluster_ip)
    assert got.local == () and len(got.cluster) == 1


# -- service_port_endpoints: slices -> endpoints of one service port -----------------


def port_endpoints(service: Service, *slices: EndpointSlice, port: int = 0) -> list[str]:
    snap = Snapshot(services=(service,), slices=slices)
    got = service_port_endpoints(snap, service, service.ports[port], HERE)
    return [f"{e}{'(t)' if e.terminating else ''}" for e in got]


@pytest.mark.parametrize("terminating_first", [True, False])
def test_duplicate_ip_port_prefers_the_non_terminating_copy(terminating_first: bool) -> None:
    old = slice_(name="a", endpoints=(ep("10.0.0.1", ready=False, terminating=True),))
    new = slice_(name="b", endpoints=(ep("10.0.0.1"),))
    slices = (old, new) if terminating_first else (new, old)
    assert port_endpoints(svc(), *slices) == ["10.0.0.1:8080"]


def test_duplicate_terminating_copies_stay_one_endpoint() -> None:
    a = slice_(name="a", endpoints=(ep("10.0.0.1", ready=False, terminating=True),))
    b = slice_(name="b", endpoints=(ep("10.0.0.1", ready=False, terminating=True),))
    assert port_endpoints(svc(), a, b) == ["10.0.0.1:8080(t)"]


def test_same_ip_on_two_ports_is_two_endpoints() -> None:
    s = slice_(name="a", endpoints=(ep("10.0.0.1"),))
    t = slice_(name="b", endpoints=(ep("10.0.0.1"),), ports=(EndpointPort("http", 8081),))
    assert port_endpoints(svc(), s, t) == ["10.0.0.1:8080", "10.0.0.1:8081"]


def test_ports_match_by_name_and_protocol() -> None:
    service = svc(
        ports=(
            ServicePort("dns", "TCP", 53, 5353, 30053),
            ServicePort("dns-udp", "UDP", 53, 5353, 30054),
        )
    )
    s = slice_(
        name="a",
        endpoints=(ep("10.0.0.1"),),
        ports=(
            EndpointPort("dns", 5353, "UDP"),  # right name, wrong protocol
            EndpointPort("dns-udp", 5354, "UDP"),
            EndpointPort("metrics", 9090, "TCP"),  # wrong name
            EndpointPort("dns", 5355, "TCP"),
        ),
    )
    assert port_endpoints(service, s, port=0) == ["10.0.0.1:5355"]
    assert port_endpoints(service, s, port=1) == ["10.0.0.1:5354"]


def test_unnamed_service_port_matches_unnamed_slice_port_only() -> None:
    service = svc(ports=(ServicePort("", "TCP", 80, 80, 30080),))
    s = slice_(name="a", endpoints=(ep("10.0.0.1"),),
               ports=(EndpointPort("http", 81), EndpointPort("", 82)))
    assert port_endpoints(service, s) == ["10.0.0.1:82"]


def test_port_zero_is_ignored() -> None:
    s = slice_(name="a", endpoints=(ep("10.0.0.1"),), ports=(EndpointPort("http", 0),))
    assert port_endpoints(svc(), s) == []


def test_slices_of_other_services_do_not_leak_in() -> None:
    mine = slice_(name="a", endpoints=(ep("10.0.0.1"),))
    other = slice_(name="b", endpoints=(ep("10.0.0.2"),), service="api")
    assert port_endpoints(svc(), mine, other) == ["10.0.0.1:8080"]


def test_merged_endpoints_are_sorted_for_a_stable_round_robin() -> None:
    a = slice_(name="a", endpoints=(ep("10.0.0.9"), ep("10.0.0.10")))
    b = slice_(name="b", endpoints=(ep("10.0.0.2"),))
    assert port_endpoints(svc(), a, b) == port_endpoints(svc(), b, a)


def test_locality_is_by_node_name_only() -> None:
    service = svc()
    s = slice_(name="a",
               endpoints=(ep("10.0.0.1", HERE), ep("10.0.0.2", THERE), ep("10.0.0.3", None)))
    snap = Snapshot(services=(service,), slices=(s,))
    got = service_port_endpoints(snap, service, service.ports[0], HERE)
    assert {e.ip: e.is_local for e in got} == {
        "10.0.0.1": True,
        "10.0.0.2": False,
        "10.0.0.3": False,
    }
    # A proxy that does not know its own node name has no local endpoints.
    nameless = service_port_endpoints(snap, service, service.ports[0], "")
    assert not any(e.is_local for e in nameless)


def test_conditions_and_pod_name_are_carried_over() -> None:
    service = svc()
    endpoint = Endpoint("10.0.0.1", HERE, ready=False, serving=True, terminating=True, pod_name="p")
    snap = Snapshot(services=(service,), slices=(slice_(name="a", endpoints=(endpoint,)),))
    (got,) = service_port_endpoints(snap, service, service.ports[0], HERE)
    assert (got.ready, got.serving, got.terminating, got.pod_name) == (False, True, True, "p")
    assert got.addr == ("10.0.0.1", 8080) and got.node_name == HERE


# -- local_ready_counts: the healthCheckNodePort's localEndpoints ---------------------

LB_LOCAL = svc(policy="Local", name="lb", type="LoadBalancer", hc_port=32000)


def counts(*slices: EndpointSlice, services: tuple[Service, ...] = (LB_LOCAL,)) -> dict[str, int]:
    return dict(local_ready_counts(Snapshot(services=services, slices=slices), HERE))


def test_count_is_unique_local_ready_ips_across_ports() -> None:
    # 10.0.0.1:8080 and 10.0.0.1:8443 are one pod: it counts once (kube-proxy: per IP).
    http = slice_(name="a", endpoints=(ep("10.0.0.1"), ep("10.0.0.2")), service="lb")
    https = slice_(name="b", endpoints=(ep("10.0.0.1"),), ports=(EndpointPort("https", 8443),),
                   service="lb")
    assert counts(http, https) == {"default/lb": 2}


def test_count_ignores_terminating_unready_and_remote() -> None:
    s = slice_(
        name="a",
        endpoints=(
            ep("10.0.0.1"),
            ep("10.0.0.2", ready=False, serving=True, terminating=True),
            ep("10.0.0.3", ready=False, serving=False),
            ep("10.0.0.4", THERE),
            ep("10.0.0.5", None),
        ),
        service="lb",
    )
    assert counts(s) == {"default/lb": 1}


def test_only_terminating_local_endpoints_count_zero() -> None:
    # e2e "should fail health check node port if there are only terminating endpoints".
    s = slice_(name="a", endpoints=(ep("10.0.0.1", ready=False, terminating=True),), service="lb")
    assert counts(s) == {"default/lb": 0}


def test_duplicate_is_judged_by_the_copy_kube_proxy_keeps() -> None:
    # Slice "a" still lists the pod as ready-but-terminating, slice "b" as
    # not ready and not terminating; the endpoints map keeps the latter.
    a = slice_(name="a", endpoints=(ep("10.0.0.1", ready=True, terminating=True),), service="lb")
    b = slice_(name="b", endpoints=(ep("10.0.0.1", ready=False),), service="lb")
    assert counts(a, b) == {"default/lb": 0}
    assert counts(b, a) == {"default/lb": 0}


def test_endpoints_without_a_usable_port_do_not_count() -> None:
    portless = slice_(name="a", endpoints=(ep("10.0.0.1"),), ports=(), service="lb")
    zero = slice_(name="b", endpoints=(ep("10.0.0.2"),), ports=(EndpointPort("", 0),), service="lb")
    assert counts(portless, zero) == {"default/lb": 0}


def test_only_load_balancer_local_services_with_a_port_are_listed() -> None:
    services = (
        LB_LOCAL,
        svc(policy="Local", name="np-local", type="NodePort", hc_port=32001),
        svc(policy="Cluster", name="lb-cluster", type="LoadBalancer", hc_port=32002),
        svc(policy="Local", name="lb-no-port", type="LoadBalancer", hc_port=0),
    )
    slices = tuple(slice_(name=s.name, endpoints=(ep("10.0.0.1"),), service=s.name)
                   for s in services)
    assert counts(*slices, services=services) == {"default/lb": 1}


def test_health_checked_service_without_slices_counts_zero() -> None:
    assert counts() == {"default/lb": 0}
    other = svc(policy="Local", name="other", type="LoadBalancer", hc_port=32003)
    mine = slice_(name="a", endpoints=(ep("10.0.0.1"),), service="lb")
    assert counts(mine, services=(LB_LOCAL, other)) == {"default/lb": 1, "default/other": 0}


def test_nameless_node_has_no_local_endpoints() -> None:
    snap = Snapshot(
        services=(LB_LOCAL,),
        slices=(slice_(name="a", endpoints=(ep("10.0.0.1", None),), service="lb"),),
    )
    assert dict(local_ready_counts(snap, "")) == {"default/lb": 0}
