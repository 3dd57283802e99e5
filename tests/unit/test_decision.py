"""proxy.core.decision: every rule of the module docstring, asserted on the decision data."""

from __future__ import annotations

import ipaddress

import pytest

from proxy.core.balancer import Balancer
from proxy.core.decision import (
    Drop,
    Forward,
    PortPlan,
    Reject,
    build_plans,
    decide,
    decide_in_snapshot,
)
from proxy.core.model import (
    Endpoint,
    EndpointPort,
    EndpointSlice,
    Service,
    ServicePort,
    SessionAffinity,
    Snapshot,
    TrafficPolicy,
)

HERE = "node-a"
THERE = "node-b"
NODE_IPS = frozenset({"192.168.49.2", "203.0.113.10"})
CLIENT = "198.51.100.20"
"""An external client: not a node address, not loopback, not in a cluster CIDR."""
POD_CIDRS = [ipaddress.ip_network("10.244.0.0/16")]

LOCAL_EP = Endpoint("10.244.0.5", HERE)
REMOTE_EP = Endpoint("10.244.1.5", THERE)
REMOTE_EP2 = Endpoint("10.244.1.6", THERE)


def snapshot(
    *endpoints: Endpoint,
    policy: TrafficPolicy = "Cluster",
    affinity: SessionAffinity = "None",
    port_name: str = "http",
) -> Snapshot:
    service = Service(
        namespace="default",
        name="web",
        type="LoadBalancer" if policy == "Local" else "NodePort",
        ports=(ServicePort(port_name, "TCP", 80, 8080, 30080),),
        external_traffic_policy=policy,
        health_check_node_port=32000 if policy == "Local" else 0,
        session_affinity=affinity,
        affinity_timeout_seconds=125,
    )
    sl = EndpointSlice("default", "web-a", "web", endpoints, (EndpointPort(port_name, 8080),))
    return Snapshot(services=(service,), slices=(sl,))


def plan(*endpoints: Endpoint, masquerade_all: bool = False, **kw: object) -> PortPlan:
    return build_plans(snapshot(*endpoints, **kw), HERE, masquerade_all)[30080]  # type: ignore[arg-type]


def run(
    p: PortPlan,
    client: str = CLIENT,
    balancer: Balancer | None = None,
    exclude: tuple[tuple[str, int], ...] = (),
    cidrs: list[ipaddress.IPv4Network | ipaddress.IPv6Network] | None = None,
    now: float = 0.0,
) -> Forward | Drop | Reject:
    return decide(p, client, NODE_IPS, balancer or Balancer(), now, exclude, cidrs or [])


def forwarded(decision: Forward | Drop | Reject) -> tuple[str, bool]:
    assert isinstance(decision, Forward), decision
    return decision.endpoint.ip, decision.snat


# -- rule 1: nothing usable anywhere -> REJECT ---------------------------------


@pytest.mark.parametrize("policy", ["Cluster", "Local"])
@pytest.mark.parametrize("client", [CLIENT, "127.0.0.1", "192.168.49.2", "10.244.3.3"])
def test_reject_when_there_are_no_endpoints(policy: TrafficPolicy, client: str) -> None:
    p = plan(policy=policy)
    assert not p.listen and not p.drop_external
    assert run(p, client, cidrs=POD_CIDRS) == Reject("default/web:http has no endpoints")


def test_reject_when_only_unusable_endpoints_exist() -> None:
    unready = Endpoint("10.244.0.5", HERE, ready=False, serving=False)
    draining = Endpoint("10.244.1.5", THERE, ready=False, serving=False, terminating=True)
    p = plan(unready, draining, policy="Local")
    assert not p.listen
    assert isinstance(run(p), Reject)


# -- rule 3: eTP=Local, external client ----------------------------------------------


def test_local_external_with_local_endpoint_keeps_the_client_ip() -> None:
    decision = run(plan(LOCAL_EP, REMOTE_EP, policy="Local"))
    assert forwarded(decision) == (LOCAL_EP.address, False)
    assert isinstance(decision, Forward) and "eTP=Local, external client" in decision.reason


def test_local_external_never_goes_to_a_remote_endpoint() -> None:
    p = plan(LOCAL_EP, REMOTE_EP, REMOTE_EP2, policy="Local")
    balancer = Balancer()
    assert {forwarded(run(p, balancer=balancer)) for _ in range(6)} == {(LOCAL_EP.address, False)}


def test_local_external_with_nothing_here_drops_and_says_how_many_are_elsewhere() -> None:
    p = plan(REMOTE_EP, REMOTE_EP2, policy="Local")
    assert p.listen and p.drop_external
    decision = run(p)
    assert isinstance(decision, Drop)
    assert decision.reason == "default/web:http eTP=Local has no local endpoints (2 elsewhere)"


def test_local_external_uses_a_local_terminating_endpoint_while_remote_ones_are_ready() -> None:
    # e2e "should fallback to local terminating endpoints ... externalTrafficPolicy=Local".
    terminating = Endpoint("10.244.0.5", HERE, ready=False, serving=True, terminating=True)
    p = plan(terminating, REMOTE_EP, policy="Local")
    assert not p.drop_external
    assert forwarded(run(p)) == (terminating.address, False)


# -- rule 2: node- and pod-originated traffic -----------------------------------------


@pytest.mark.parametrize("client", ["192.168.49.2", "203.0.113.10", "127.0.0.1", "127.9.8.7"])
def test_local_from_the_node_itself_gets_cluster_endpoints_with_snat(client: str) -> None:
    p = plan(REMOTE_EP, policy="Local")
    decision = run(p, client)
    assert forwarded(decision) == (REMOTE_EP.address, True)
    assert isinstance(decision, Forward) and decision.reason.startswith("node-originated")


def test_node_traffic_is_snated_even_to_a_local_endpoint() -> None:
    for policy in ("Cluster", "Local"):
        assert forwarded(run(plan(LOCAL_EP, policy=policy), "127.0.0.1")) == (
            LOCAL_EP.address,
            True,
        )


@pytest.mark.parametrize("policy", ["Cluster", "Local"])
def test_pod_traffic_gets_cluster_endpoints_and_is_snated_to_a_local_one_too(
        policy: str) -> None:
    # A local endpoint would answer a pod on this node over the pod bridge, past kpx.
    p = plan(LOCAL_EP, REMOTE_EP, policy=policy)
    balancer = Balancer()
    seen = {forwarded(run(p, "10.244.7.7", balancer, cidrs=POD_CIDRS)) for _ in range(4)}
    assert seen == {(LOCAL_EP.address, True), (REMOTE_EP.address, True)}
    # An external client to the same local endpoint keeps its IP under eTP=Cluster too.
    assert forwarded(run(plan(LOCAL_EP))) == (LOCAL_EP.address, False)


def test_pod_traffic_is_not_dropped_when_nothing_is_here() -> None:
    p = plan(REMOTE_EP, policy="Local")
    decision = run(p, "10.244.7.7", cidrs=POD_CIDRS)
    assert forwarded(decision) == (REMOTE_EP.address, True)
    assert isinstance(decision, Forward) and decision.reason.startswith("pod-originated")
    # Without cluster CIDRs the same source is just an external client.
    assert isinstance(run(p, "10.244.7.7"), Drop)


def test_source_outside_the_cluster_cidrs_is_external() -> None:
    assert isinstance(run(plan(REMOTE_EP, policy="Local"), "10.245.0.1", cidrs=POD_CIDRS), Drop)


# -- rule 4: eTP=Cluster --------------------------------------------------------------


def test_cluster_snats_only_cross_node_hops() -> None:
    p = plan(LOCAL_EP, REMOTE_EP)
    balancer = Balancer()
    seen = [forwarded(run(p, balancer=balancer)) for _ in range(4)]
    assert sorted(set(seen)) == [(LOCAL_EP.address, False), (REMOTE_EP.address, True)]


def test_cluster_reason_names_the_endpoint_and_snat() -> None:
    decision = run(plan(REMOTE_EP))
    assert isinstance(decision, Forward)
    assert decision.reason == "eTP=Cluster -> 10.244.1.5:8080 (SNAT)"
    local = run(plan(LOCAL_EP))
    assert isinstance(local, Forward) and local.reason == "eTP=Cluster -> 10.244.0.5:8080"


def test_masquerade_all_always_snats_cluster_traffic() -> None:
    p = plan(LOCAL_EP, REMOTE_EP, masquerade_all=True)
    balancer = Balancer()
    assert {forwarded(run(p, balancer=balancer))[1] for _ in range(4)} == {True}


def test_masquerade_all_keeps_the_client_ip_for_local_external_traffic() -> None:
    p = plan(LOCAL_EP, REMOTE_EP, policy="Local", masquerade_all=True)
    assert forwarded(run(p)) == (LOCAL_EP.address, False)


# -- retries after a failed connect -----------------------------------------------------


def test_excluded_endpoint_is_skipped() -> None:
    p = plan(LOCAL_EP, REMOTE_EP)
    for failed, expected in ((LOCAL_EP, REMOTE_EP), (REMOTE_EP, LOCAL_EP)):
        for _ in range(3):
            decision = run(p, exclude=((failed.address, 8080),))
            assert forwarded(decision)[0] == expected.address


def test_all_excluded_is_reject_naming_the_client() -> None:
    p = plan(LOCAL_EP, REMOTE_EP)
    decision = run(p, exclude=((LOCAL_EP.address, 8080), (REMOTE_EP.address, 8080)))
    assert decision == Reject(f"default/web:http: every eligible endpoint failed for {CLIENT}")


def test_local_external_retry_never_falls_back_to_remote() -> None:
    p = plan(LOCAL_EP, REMOTE_EP, policy="Local")
    assert isinstance(run(p, exclude=((LOCAL_EP.address, 8080),)), Reject)


def test_excluded_sticky_endpoint_is_replaced() -> None:
    p = plan(LOCAL_EP, REMOTE_EP, affinity="ClientIP")
    balancer = Balancer()
    first = forwarded(run(p, balancer=balancer))[0]
    retry = forwarded(run(p, balancer=balancer, exclude=((first, 8080),)))[0]
    assert retry != first
    # The retry's choice is the new sticky target.
    assert forwarded(run(p, balancer=balancer, now=1.0))[0] == retry


# -- affinity through decide ---------------------------------------------------------------


def test_client_ip_affinity_holds_for_15_connections() -> None:
    p = plan(LOCAL_EP, REMOTE_EP, REMOTE_EP2, affinity="ClientIP")
    assert p.affinity_seconds == 125.0
    balancer = Balancer()
    picks = {forwarded(run(p, balancer=balancer, now=float(t)))[0] for t in range(15)}
    assert len(picks) == 1
    other = {forwarded(run(p, "198.51.100.21", balancer, now=20.0))[0]}
    assert other != picks  # round-robin moved on for a new client


# -- PortPlan and build_plans --------------------------------------------------------------


def test_port_plan_properties() -> None:
    p = plan(LOCAL_EP, REMOTE_EP, policy="Local")
    assert (p.key, p.node_port, p.affinity_seconds) == ("default/web:http", 30080, None)
    assert p.listen and not p.drop_external and p.remote_count == 1
    assert [e.ip for e in p.cluster] == [LOCAL_EP.address, REMOTE_EP.address]
    assert [e.ip for e in p.local] == [LOCAL_EP.address]
    assert plan(LOCAL_EP, port_name="").key == "default/web"
    assert plan(LOCAL_EP).local == ()  # eTP=Cluster never needs the local set


def test_build_plans_covers_tcp_node_ports_of_nodeport_and_lb_services() -> None:
    def service(name: str, type_: str, *ports: ServicePort, **kw: object) -> Service:
        return Service("default", name, type_, ports, **kw)  # type: ignore[arg-type]

    services = (
        service("np", "NodePort", ServicePort("a", "TCP", 80, 80, 30001)),
        service(
            "lb",
            "LoadBalancer",
            ServicePort("a", "TCP", 80, 80, 30002),
            ServicePort("b", "UDP", 53, 53, 30003),
        ),
        service("no-alloc", "LoadBalancer", ServicePort("a", "TCP", 80, 80, 0)),
        service("cip", "ClusterIP", ServicePort("a", "TCP", 80, 80, 0), external_ips=("1.2.3.4",)),
    )
    plans = build_plans(Snapshot(services=services), HERE)
    assert sorted(plans) == [30001, 30002]
    assert plans[30002].key == "default/lb:a" and not plans[30002].listen


# -- decide_in_snapshot -----------------------------------------------------------------------


def test_decide_in_snapshot() -> None:
    snap = snapshot(REMOTE_EP, policy="Local")
    decision = decide_in_snapshot(snap, HERE, "default/web", "http", CLIENT, NODE_IPS)
    assert isinstance(decision, Drop)
    assert decide_in_snapshot(snap, HERE, "default/nope", "http", CLIENT, NODE_IPS) == Reject(
        "default/nope does not exist"
    )
    assert decide_in_snapshot(snap, HERE, "default/web", "grpc", CLIENT, NODE_IPS) == Reject(
        "default/web has no port 'grpc'"
    )
    on_other_node = decide_in_snapshot(snap, THERE, "default/web", "http", CLIENT, NODE_IPS)
    assert forwarded(on_other_node) == (REMOTE_EP.address, False)
