"""Dual-stack in the pure core: each IP family gets what its own kube-proxy proxier would.

The parser keeps both families (``ipFamilies``, ``clusterIPs``, IPv6 slices,
canonical IPv6 text) and refuses inconsistent ones with the API server's
rules; ``compute_sync`` builds the IPv4 result and, on a node with an IPv6
address, the IPv6 one beside it: its own NodePort table, VIPs, endpoints
and local ready counts, never the other family's.
"""

from __future__ import annotations

from typing import Any

import pytest

from proxy.core.balancer import Balancer
from proxy.core.decision import Drop, Forward, decide, service_vips
from proxy.core.endpoints import EndpointInfo
from proxy.core.model import Node, Snapshot
from proxy.core.sync import SyncConfig, compute_sync, empty_result
from proxy.k8s import StateError, parse_state
from tests.support.objects import endpoint, endpoint_slice, node, service, state_yaml

pytestmark = pytest.mark.usefixtures("yaml_reader")

V4_IP, V6_IP = "10.96.0.10", "fd00:96::a"


def dual(**spec: Any) -> dict[str, Any]:
    """A PreferDualStack NodePort service, IPv4 primary, both ClusterIPs."""
    spec.setdefault("ipFamilyPolicy", "PreferDualStack")
    spec.setdefault("ipFamilies", ["IPv4", "IPv6"])
    spec.setdefault("clusterIPs", [V4_IP, V6_IP])
    return service(cluster_ip=spec.pop("cluster_ip", V4_IP), **spec)


def state(*objs: dict[str, Any]) -> Snapshot:
    return parse_state(state_yaml(*objs))


def problems(*objs: dict[str, Any]) -> list[str]:
    with pytest.raises(StateError) as err:
        state(*objs)
    return err.value.problems


def both_slices(v4_node: str = "node-a", v6_node: str = "node-a") -> list[dict[str, Any]]:
    return [
        endpoint_slice("web", endpoint("10.1.0.2", v4_node), name="web-v4"),
        endpoint_slice("web", endpoint("FD00:1::2", v6_node), name="web-v6",
                       address_type="IPv6"),
    ]


# -- parse -------------------------------------------------------------------------


def test_a_dual_stack_service_keeps_both_families_in_order() -> None:
    (svc,) = state(dual()).services
    assert svc.cluster_ip == V4_IP and svc.cluster_ips == (V4_IP, V6_IP)
    assert svc.ip_families == ("IPv4", "IPv6") and svc.ip_family_policy == "PreferDualStack"
    assert svc.serves(4) and svc.serves(6) and svc.cluster_ip_of(6) == V6_IP


def test_the_families_follow_the_cluster_ips() -> None:
    """An IPv6-primary service, an IPv6-only one, and one with no clusterIP at all."""
    (svc,) = state(dual(cluster_ip="FD00:96::A", clusterIPs=["FD00:96::A", V4_IP],
                        ipFamilies=["IPv6", "IPv4"])).services
    assert svc.cluster_ips == (V6_IP, V4_IP) and svc.ip_families == ("IPv6", "IPv4")
    assert svc.cluster_ip == V4_IP  # the IPv4 proxier's, wherever it sits
    (only6,) = state(service(cluster_ip=V6_IP, ipFamilies=["IPv6"])).services
    assert only6.ip_families == ("IPv6",) and not only6.serves(4) and only6.cluster_ip is None
    (none,) = state(service(cluster_ip=None)).services
    assert none.ip_families == ("IPv4",)
    (asked,) = state(service(cluster_ip=None, ipFamilies=["IPv6"])).services
    assert asked.ip_families == ("IPv6",)


@pytest.mark.parametrize(("spec", "problem"), [
    ({"ipFamilies": ["IPv6"]},
     'spec.ipFamilies[0]: "IPv6" does not match the family of spec.clusterIPs[0] (IPv4)'),
    ({"ipFamilies": ["IPv4", "IPv4"]},
     'spec.ipFamilies[1]: "IPv4" is listed twice: one entry per IP family'),
    ({"ipFamilies": ["IPv5"]}, 'spec.ipFamilies[0]: "IPv5" is not one of IPv4, IPv6'),
    ({"ipFamilyPolicy": "SingleStack"},
     'spec.ipFamilyPolicy: "SingleStack" allows one of spec.ipFamilies, not 2'),
    ({"ipFamilyPolicy": "Dual"},
     'spec.ipFamilyPolicy: "Dual" is not one of SingleStack, PreferDualStack, RequireDualStack'),
    ({"clusterIPs": [V4_IP, "10.96.0.11"]},
     'spec.clusterIPs[1]: "10.96.0.11" is a second IPv4 address: one per IP family'),
])  # fmt: skip
def test_inconsistent_families_are_refused_naming_the_field(
        spec: dict[str, Any], problem: str) -> None:
    assert problems(dual(**spec)) == [f"Service default/web: {problem}"]


def test_an_ipv6_slice_needs_ipv6_addresses() -> None:
    bad = endpoint_slice("web", endpoint("10.1.0.2"), name="web-v6", address_type="IPv6")
    assert problems(dual(), bad) == [
        'EndpointSlice default/web-v6: endpoints[0].addresses[0]: "10.1.0.2" is not an'
        " IPv6 address"]


def test_quick_and_full_judges_agree_on_a_kubectl_single_stack_service() -> None:
    """What kubectl prints for every IPv4 service takes the shortcut and means IPv4 only."""
    svc = service(ipFamilies=["IPv4"], ipFamilyPolicy="SingleStack", clusterIPs=[V4_IP])
    (parsed,) = state(svc).services
    assert parsed.ip_families == ("IPv4",) and parsed.cluster_ips == (V4_IP,)
    (slow,) = state(dict(svc, spec=dict(svc["spec"], sessionAffinity="None",
                                        ipFamilies=["IPv4"]), extra=1)).services
    assert slow == parsed


# -- one result per family ---------------------------------------------------------------


def test_each_family_gets_its_own_plans_endpoints_and_vips() -> None:
    snap = state(node("node-a", "10.0.0.1", "fd00::1"),
                 dual(externalIPs=["203.0.113.9", "2001:db8::9"]), *both_slices())
    v4 = compute_sync(snap, SyncConfig("node-a", vips=True))
    v6 = v4.ipv6
    assert v6 is not None and v6.family == 6 and v4.family == 4 and v6.ipv6 is None
    assert v4.node_ips == ("10.0.0.1",) and v6.node_ips == ("fd00::1",)
    assert v4.listen_hosts == ("0.0.0.0",) and v6.listen_hosts == ("::",)
    assert set(v4.plans) == {30080, (V4_IP, 80), ("203.0.113.9", 80)}
    assert set(v6.plans) == {30080, (V6_IP, 80), ("2001:db8::9", 80)}
    assert [e.ip for e in v4.plans[30080].cluster] == ["10.1.0.2"]
    assert [e.ip for e in v6.plans[30080].cluster] == ["fd00:1::2"]
    assert v4.vips == {V4_IP, "203.0.113.9"} and v6.vips == {V6_IP, "2001:db8::9"}


def test_a_node_without_ipv6_pays_nothing_for_it() -> None:
    snap = state(node("node-a", "10.0.0.1"), dual(), *both_slices())
    assert compute_sync(snap, SyncConfig("node-a")).ipv6 is None
    empty = empty_result(7, 6)
    assert empty.family == 6 and empty.plans == {} and empty.listen_hosts == ()


def test_a_single_stack_service_is_in_one_family_only() -> None:
    only6 = service("six", 30081, cluster_ip=V6_IP, ipFamilies=["IPv6"])
    slice6 = endpoint_slice("six", endpoint("fd00:1::3"), name="six-v6", address_type="IPv6")
    snap = state(node("node-a", "10.0.0.1", "fd00::1"), service(), only6, slice6,
                 endpoint_slice("web", "10.1.0.2"))
    v4 = compute_sync(snap, SyncConfig("node-a", vips=True))
    assert v4.ipv6 is not None
    assert set(v4.plans) == {30080, ("10.96.0.10", 80)}
    assert set(v4.ipv6.plans) == {30081, (V6_IP, 80)}


def test_local_ready_counts_and_drops_are_per_family() -> None:
    """eTP=Local: the pod's IPv4 address is here, its IPv6 one elsewhere. Each family's
    health check says what that family would do: 1 and serve, 0 and drop."""
    lb = dual(type="LoadBalancer", etp="Local", hc_port=32000)
    snap = state(node("node-a", "10.0.0.1", "fd00::1"), lb,
                 *both_slices(v4_node="node-a", v6_node="node-b"))
    v4 = compute_sync(snap, SyncConfig("node-a"))
    assert v4.ipv6 is not None
    assert v4.local_ready == {"default/web": 1} and v4.ipv6.local_ready == {"default/web": 0}
    assert v4.health_check_ports == v4.ipv6.health_check_ports == {"default/web": 32000}
    assert v4.dropping == 0 and v4.ipv6.dropping == 1
    verdict = decide(v4.ipv6.plans[30080], "2001:db8::77", v4.ipv6.node_ips, Balancer(), 0.0)
    assert isinstance(verdict, Drop)


def test_the_node_itself_over_ipv6_gets_cluster_endpoints() -> None:
    """eTP=Local, nothing here: an outside client is dropped, ::1 and the node's own
    IPv6 address are node-originated and forwarded (SNAT)."""
    snap = state(node("node-a", "10.0.0.1", "fd00::1"), dual(etp="Local"),
                 *both_slices(v6_node="node-b"))
    v6 = compute_sync(snap, SyncConfig("node-a")).ipv6
    assert v6 is not None
    plan = v6.plans[30080]
    for source in ("::1", "fd00::1"):
        verdict = decide(plan, source, v6.node_ips, Balancer(), 0.0)
        assert isinstance(verdict, Forward) and verdict.snat and verdict.endpoint.ip == "fd00:1::2"


def test_ipv6_vips_leave_loopback_link_local_and_multicast_alone() -> None:
    lb = dual(type="LoadBalancer", status={"loadBalancer": {"ingress": [
        {"ip": "2001:db8::5"}, {"ip": "fe80::5"}, {"ip": "ff05::5"}, {"ip": "::1"}]}})
    (svc,) = state(lb).services
    assert service_vips(svc, 6) == ((V6_IP, True), ("2001:db8::5", False))
    assert service_vips(svc, 4) == ((V4_IP, True),)


def test_ipv6_endpoints_print_bracketed_and_nodes_list_canonical_ips() -> None:
    assert str(EndpointInfo("fd00:1::2", 8080, None, False)) == "[fd00:1::2]:8080"
    assert str(EndpointInfo("10.1.0.2", 8080, None, False)) == "10.1.0.2:8080"
    n = Node("n", internal_ips=("10.0.0.1", "FD00:0::1", "not-an-ip"), external_ips=("fd00::1",))
    assert n.ips_of(4) == ("10.0.0.1",) and n.ips_of(6) == ("fd00::1",)
