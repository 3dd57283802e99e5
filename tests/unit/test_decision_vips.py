"""Service VIPs in the decision table: ClusterIPs follow iTP, external VIPs follow eTP.

Issue 11's semantics, asserted on the decision data: which plans a service
gets (its ClusterIP, its externalIPs, its VIP-mode LB ingress IPs, never a
Proxy-mode one), iTP=Local dropping for every client with no short-circuit,
the ClusterIP SNAT rule (a pod keeps its IP only on a hop to another node),
and external VIPs behaving exactly like the NodePort, kubernetes#131765
included (pod -> LB IP, eTP=Local, no local endpoint: still connects).
"""

from __future__ import annotations

import ipaddress

import pytest

from proxy.core.balancer import Balancer
from proxy.core.decision import Drop, Forward, PortPlan, Reject, build_plans, decide
from proxy.core.model import (
    Endpoint,
    EndpointPort,
    EndpointSlice,
    LoadBalancerIngress,
    Service,
    ServicePort,
    Snapshot,
    TrafficPolicy,
)

HERE, THERE = "node-a", "node-b"
NODE_IPS = frozenset({"192.168.49.2"})
CLUSTER_IP, EXTERNAL_IP, LB_IP, PROXY_LB_IP = "10.96.0.10", "192.0.2.50", "192.0.2.80", "192.0.2.81"
POD_CIDRS = [ipaddress.ip_network("10.244.0.0/16")]
POD_HERE, POD_THERE = "10.244.0.9", "10.244.1.9"
OUTSIDE = "198.51.100.20"
LOCAL_EP = Endpoint("10.244.0.5", HERE)
REMOTE_EP = Endpoint("10.244.1.5", THERE)


def snapshot(
    *endpoints: Endpoint, itp: TrafficPolicy = "Cluster", etp: TrafficPolicy = "Cluster"
) -> Snapshot:
    service = Service(
        namespace="default",
        name="web",
        type="LoadBalancer",
        ports=(ServicePort("http", "TCP", 80, 8080, 30080), ServicePort("dns", "UDP", 53, 53)),
        cluster_ip=CLUSTER_IP,
        external_traffic_policy=etp,
        internal_traffic_policy=itp,
        health_check_node_port=32000 if etp == "Local" else 0,
        external_ips=(EXTERNAL_IP,),
        ingress=(LoadBalancerIngress(LB_IP), LoadBalancerIngress(PROXY_LB_IP, "Proxy")),
    )
    sl = EndpointSlice("default", "web-a", "web", endpoints, (EndpointPort("http", 8080),))
    return Snapshot(services=(service,), slices=(sl,))


def plans(*endpoints: Endpoint, **policies: TrafficPolicy) -> dict[object, PortPlan]:
    return build_plans(snapshot(*endpoints, **policies), HERE, vips=True)  # type: ignore[return-value]


def go(plan: PortPlan, client: str) -> Forward | Drop | Reject:
    return decide(plan, client, NODE_IPS, Balancer(), 0.0, (), POD_CIDRS)


def test_a_service_gets_a_plan_per_address_kind_and_tcp_port_but_none_for_proxy_mode() -> None:
    table = plans(LOCAL_EP)
    assert list(table) == [30080, (CLUSTER_IP, 80), (EXTERNAL_IP, 80), (LB_IP, 80)]
    assert table[(CLUSTER_IP, 80)].internal
    assert not table[(EXTERNAL_IP, 80)].internal and not table[(LB_IP, 80)].internal
    assert all(key[0] != PROXY_LB_IP for key in table if isinstance(key, tuple))


def test_without_vips_a_service_has_its_nodeport_plan_only() -> None:
    """The dataplane serves VIPs only once it says so (``SyncConfig.vips``)."""
    assert list(build_plans(snapshot(LOCAL_EP), HERE)) == [30080]


def test_a_clusterip_only_service_gets_its_vip_plan() -> None:
    svc = Service("default", "db", "ClusterIP", (ServicePort("", "TCP", 5432, 5432),),
                  cluster_ip="10.96.0.20")
    sl = EndpointSlice("default", "db-a", "db", (LOCAL_EP,), (EndpointPort("", 5432),))
    assert list(build_plans(Snapshot(services=(svc,), slices=(sl,)), HERE, vips=True)) == [
        ("10.96.0.20", 5432)
    ]


@pytest.mark.parametrize("client", [POD_THERE, "192.168.49.2", CLUSTER_IP, OUTSIDE])
def test_itp_local_with_nothing_here_drops_every_client_node_included(client: str) -> None:
    plan = plans(REMOTE_EP, itp="Local")[(CLUSTER_IP, 80)]
    assert plan.drop_all and not plan.drop_external
    decision = go(plan, client)
    assert isinstance(decision, Drop) and "iTP=Local" in decision.reason


def test_itp_local_uses_local_endpoints_only() -> None:
    decision = go(plans(LOCAL_EP, REMOTE_EP, itp="Local")[(CLUSTER_IP, 80)], POD_THERE)
    assert isinstance(decision, Forward) and decision.endpoint.ip == LOCAL_EP.address


def test_itp_cluster_reaches_any_endpoint_and_no_endpoint_rejects() -> None:
    assert isinstance(go(plans(REMOTE_EP)[(CLUSTER_IP, 80)], POD_HERE), Forward)
    assert isinstance(go(plans()[(CLUSTER_IP, 80)], POD_HERE), Reject)
    assert not plans()[(CLUSTER_IP, 80)].listen


@pytest.mark.parametrize(
    ("client", "endpoint", "snat"),
    [
        (POD_HERE, REMOTE_EP, False),  # pod -> another node: the backend sees the pod
        (POD_HERE, LOCAL_EP, True),  # same node: the reply would bypass kpx
        (LOCAL_EP.address, LOCAL_EP, True),  # hairpin: the pod reaches itself
        ("192.168.49.2", REMOTE_EP, True),  # the node's own traffic
        (CLUSTER_IP, REMOTE_EP, True),  # the node, sourced from the VIP itself
        (OUTSIDE, REMOTE_EP, True),  # outside the cluster CIDRs: IfNotLocal
    ],
)
def test_clusterip_snat_rule(client: str, endpoint: Endpoint, snat: bool) -> None:
    decision = go(plans(endpoint)[(CLUSTER_IP, 80)], client)
    assert isinstance(decision, Forward) and decision.snat is snat


def test_masquerade_all_snats_every_clusterip_hop() -> None:
    table = build_plans(snapshot(REMOTE_EP), HERE, masquerade_all=True, vips=True)
    decision = go(table[(CLUSTER_IP, 80)], POD_HERE)
    assert isinstance(decision, Forward) and decision.snat


@pytest.mark.parametrize("vip", [EXTERNAL_IP, LB_IP])
def test_external_vips_follow_etp_like_the_nodeport(vip: str) -> None:
    table = plans(REMOTE_EP, etp="Local")
    plan, node_port = table[(vip, 80)], table[30080]
    assert plan.drop_external and not plan.drop_all
    for client in (OUTSIDE, POD_HERE, "192.168.49.2"):
        assert type(go(plan, client)) is type(go(node_port, client)), client
    assert isinstance(go(plan, OUTSIDE), Drop)


def test_pod_to_lb_ip_with_etp_local_and_no_local_endpoint_connects() -> None:
    """kubernetes#131765: the nftables-mode regression kpx must not have."""
    decision = go(plans(REMOTE_EP, etp="Local")[(LB_IP, 80)], POD_HERE)
    assert isinstance(decision, Forward) and decision.endpoint.ip == REMOTE_EP.address


def test_external_client_keeps_its_ip_on_a_local_endpoint_of_an_external_ip() -> None:
    decision = go(plans(LOCAL_EP, etp="Local")[(EXTERNAL_IP, 80)], OUTSIDE)
    assert isinstance(decision, Forward) and not decision.snat


@pytest.mark.parametrize("ip", ["127.0.0.1", "169.254.169.254", "0.0.0.0", "224.0.0.1"])
def test_a_load_balancer_status_never_captures_loopback_or_link_local(ip: str) -> None:
    svc = Service("default", "web", "LoadBalancer", (ServicePort("", "TCP", 80, 8080, 30080),),
                  ingress=(LoadBalancerIngress(ip),))
    assert list(build_plans(Snapshot(services=(svc,)), HERE, vips=True)) == [30080]

