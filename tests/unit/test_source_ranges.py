"""``spec.loadBalancerSourceRanges``: read, decided and rendered as kube-proxy's firewall.

kube-proxy (``pkg/proxy/serviceport.go``, the iptables and nftables
proxiers) drops a new connection to a LoadBalancer's ingress IP from a
source outside the ranges of that family, only when the service has
endpoints, never on its NodePorts, ClusterIPs or externalIPs; when a range
holds the node's IP, the LB IPs pass as sources too (``allowFromNode``).
These tests hold the parser (valid, trimmed, per family, bad input as one
problem naming the field, ``kpx check``), ``decide`` and the userspace
mode's nft table (``dataplane.vip_rules``, ``vips.nft_script``) to that.
"""

from __future__ import annotations

import copy
import ipaddress
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from proxy.core.balancer import Balancer
from proxy.core.changes import Changes
from proxy.core.decision import Drop, Forward, PlanCache, PortPlan, Reject, build_plans, decide
from proxy.core.model import (
    Endpoint,
    EndpointPort,
    EndpointSlice,
    LoadBalancerIngress,
    Node,
    Service,
    ServicePort,
    Snapshot,
    TrafficPolicy,
)
from proxy.k8s import fields, parse_state
from proxy.userspace.dataplane import vip_rules
from proxy.userspace.vips import Firewall, firewall_sources, nft_script, rule_counters
from tests.support import objects
from tests.unit.test_k8s_vips import full_verdict, problems

net = ipaddress.ip_network

# -- the parser -----------------------------------------------------------------------


def lb_doc(ranges: object = None, *, type: str = "LoadBalancer", **spec: Any) -> dict[str, Any]:
    """A LoadBalancer Service as kubectl prints it, with these source ranges (None: absent)."""
    if ranges is not None:
        spec["loadBalancerSourceRanges"] = ranges
    return objects.service(type=type, selector={"app": "web"}, clusterIPs=["10.96.0.10"],
                           status={"loadBalancer": {"ingress": [{"ip": "203.0.113.7"}]}},
                           **spec)


def parsed(doc: dict[str, Any]) -> Service:
    (service,) = parse_state(objects.state_yaml(doc)).services
    return service


@pytest.mark.usefixtures("yaml_reader")
def test_ranges_are_trimmed_canonical_and_split_by_family() -> None:
    svc = parsed(lb_doc([" 10.0.0.0/8 ", "192.168.1.7/24", "2001:DB8:0::/32", "10.0.0.0/8"]))
    # Host bits dropped as Go's ParseCIDR does, IPv6 canonical, a repeat kept once.
    assert svc.load_balancer_source_ranges == (
        net("10.0.0.0/8"), net("192.168.1.0/24"), net("2001:db8::/32"))
    assert svc.source_ranges_of(4) == (net("10.0.0.0/8"), net("192.168.1.0/24"))
    assert svc.source_ranges_of(6) == (net("2001:db8::/32"),)
    assert parsed(lb_doc()).load_balancer_source_ranges == ()
    assert parsed(lb_doc([])).load_balancer_source_ranges == ()


@pytest.mark.usefixtures("yaml_reader")
def test_the_cloud_providers_annotation_is_not_read() -> None:
    doc = lb_doc(meta={"annotations": {
        "service.beta.kubernetes.io/load-balancer-source-ranges": "10.0.0.0/8"}})
    assert parsed(doc).load_balancer_source_ranges == ()
    (service,) = full_verdict(doc).services
    assert service.load_balancer_source_ranges == ()


@pytest.mark.usefixtures("yaml_reader")
@pytest.mark.parametrize("bad", ["10.0.0.0/33", "10.0.0.1", "example.com/8", "",
                                 "10.0.0.0/255.0.0.0", "fe80::1%eth0/64", "2001:db8::/129"])
def test_a_range_that_is_not_a_cidr_is_one_problem_naming_the_field(bad: str) -> None:
    assert problems(lb_doc(["10.0.0.0/8", bad])) == [
        f'Service default/web: spec.loadBalancerSourceRanges[1]: "{bad}" is not a valid CIDR'
        " (an address and a prefix length, such as 203.0.113.0/24 or 2001:db8::/64)"]


@pytest.mark.usefixtures("yaml_reader")
def test_a_range_of_the_wrong_type_and_ranges_on_another_type_are_refused() -> None:
    assert problems(lb_doc([8])) == [
        "Service default/web: spec.loadBalancerSourceRanges[0]: expected a string, got integer 8"]
    assert problems(lb_doc("10.0.0.0/8")) == [
        "Service default/web: spec.loadBalancerSourceRanges: expected a list, got string"
        ' "10.0.0.0/8"']
    # The API server forbids the field unless the type is LoadBalancer.
    assert problems(lb_doc(["10.0.0.0/8"], type="NodePort")) == [
        "Service default/web: spec.loadBalancerSourceRanges: may only be used when spec.type"
        ' is LoadBalancer, not "NodePort"']


@pytest.mark.parametrize("ranges", [None, [], ["10.0.0.0/8"], ["bad"]])
def test_the_quick_judge_leaves_ranges_to_the_full_one(ranges: object) -> None:
    doc = lb_doc(ranges)
    assert repr(fields._judge(copy.deepcopy(doc))) == repr(full_verdict(doc))
    took_quick = fields._quick_service(copy.deepcopy(doc)) is not None
    assert took_quick is (not ranges)


def test_kpx_check_names_the_bad_range(tmp_path: Path) -> None:
    kpx = Path(sys.executable).with_name("kpx")
    state = tmp_path / "state.yaml"
    slice_ = objects.endpoint_slice("web", "10.244.0.5")
    state.write_text(objects.state_yaml(lb_doc(["10.0.0.0/8"]), slice_))
    ok = subprocess.run([kpx, "check", str(state)], capture_output=True, text=True,
                        env=dict(os.environ), timeout=60)
    assert ok.returncode == 0, ok.stderr
    state.write_text(objects.state_yaml(lb_doc(["10.0.0.0/8", "10.0.0.0/40"]), slice_))
    run = subprocess.run([kpx, "check", str(state)], capture_output=True, text=True,
                         env=dict(os.environ), timeout=60)
    assert run.returncode == 1
    assert run.stderr.splitlines() == [
        f'{state}: Service default/web: spec.loadBalancerSourceRanges[1]: "10.0.0.0/40" is not'
        " a valid CIDR (an address and a prefix length, such as 203.0.113.0/24 or"
        " 2001:db8::/64)",
        f"{state}: 1 problem(s); file refused",
    ]


# -- decide -----------------------------------------------------------------------------

HERE, THERE = "node-a", "node-b"
NODE_IP = "192.168.49.2"
NODE_IP6 = "fd00:49::2"
NODE_IPS = frozenset({NODE_IP, NODE_IP6})
CLUSTER_IP, EXTERNAL_IP, LB_IP, LB_IP2 = "10.96.0.10", "192.0.2.50", "192.0.2.80", "192.0.2.82"
PROXY_LB_IP = "192.0.2.81"
LB_IP6 = "2001:db8::80"
POD_CIDRS = [net("10.244.0.0/16")]
POD = "10.244.1.9"
ALLOWED = "198.51.100.20"
OUTSIDE = "203.0.113.5"
LOCAL_EP = Endpoint("10.244.0.5", HERE)
REMOTE_EP = Endpoint("10.244.1.5", THERE)
LOCAL_EP6 = Endpoint("fd00:244::5", HERE)


def snapshot(*endpoints: Endpoint, ranges: tuple[str, ...] = ("198.51.100.0/24",),
             etp: TrafficPolicy = "Cluster", node_ips: tuple[str, ...] = (NODE_IP, NODE_IP6),
             ) -> Snapshot:
    service = Service(
        namespace="default",
        name="web",
        type="LoadBalancer",
        ports=(ServicePort("http", "TCP", 80, 8080, 30080), ServicePort("dns", "UDP", 53, 53)),
        cluster_ip=CLUSTER_IP,
        external_traffic_policy=etp,
        health_check_node_port=32000 if etp == "Local" else 0,
        external_ips=(EXTERNAL_IP,),
        ingress=(LoadBalancerIngress(LB_IP), LoadBalancerIngress(PROXY_LB_IP, "Proxy"),
                 LoadBalancerIngress(LB_IP2), LoadBalancerIngress(LB_IP6)),
        cluster_ips=(CLUSTER_IP, "fd00:96::10"),
        ip_families=("IPv4", "IPv6"),
        ip_family_policy="RequireDualStack",
        load_balancer_source_ranges=tuple(net(r) for r in ranges),
    )
    v4 = tuple(e for e in endpoints if ":" not in e.address)
    v6 = tuple(e for e in endpoints if ":" in e.address)
    ports = (EndpointPort("http", 8080), EndpointPort("dns", 53, "UDP"))
    slices = (EndpointSlice("default", "web-a", "web", v4, ports),
              EndpointSlice("default", "web-b", "web", v6, ports, address_type="IPv6"))
    node = Node(HERE, internal_ips=node_ips)
    return Snapshot(nodes=(node,), services=(service,), slices=slices)


def plans(*endpoints: Endpoint, family: int = 4, protocol: str = "TCP",
          **kw: Any) -> dict[object, PortPlan]:
    return build_plans(snapshot(*endpoints, **kw), HERE, vips=True,  # type: ignore[return-value]
                       protocol=protocol, family=family)


def go(plan: PortPlan, client: str) -> Forward | Drop | Reject:
    return decide(plan, client, NODE_IPS, Balancer(), 0.0, (), POD_CIDRS)


def firewalled(decision: object) -> bool:
    return isinstance(decision, Drop) and "loadBalancerSourceRanges" in decision.reason


@pytest.mark.parametrize("lb_ip", [LB_IP, LB_IP2])
def test_an_lb_ip_forwards_sources_in_range_and_drops_every_other(lb_ip: str) -> None:
    plan = plans(LOCAL_EP)[(lb_ip, 80)]
    assert plan.source_ranges == (net("198.51.100.0/24"),)
    assert isinstance(go(plan, ALLOWED), Forward)
    # Outside every range: dropped whoever it is, pods and the node included.
    for client in (OUTSIDE, POD, NODE_IP, LB_IP):
        decision = go(plan, client)
        assert firewalled(decision), (client, decision)
        assert decision.reason == f"default/web:http: {client} is outside loadBalancerSourceRanges"


def test_udp_lb_ports_are_firewalled_too() -> None:
    plan = plans(LOCAL_EP, protocol="UDP")[(LB_IP, 53)]
    assert isinstance(go(plan, ALLOWED), Forward) and firewalled(go(plan, OUTSIDE))


def test_nodeports_cluster_ips_and_external_ips_are_never_filtered() -> None:
    table = plans(LOCAL_EP)
    for key in (30080, (CLUSTER_IP, 80), (EXTERNAL_IP, 80)):
        assert table[key].source_ranges == (), key
        assert isinstance(go(table[key], OUTSIDE), Forward), key
    assert all(k[0] != PROXY_LB_IP for k in table if isinstance(k, tuple))


def test_without_endpoints_the_reject_stays() -> None:
    plan = plans()[(LB_IP, 80)]
    assert plan.source_ranges == ()
    assert isinstance(go(plan, OUTSIDE), Reject) and isinstance(go(plan, ALLOWED), Reject)


def test_the_firewall_comes_before_the_external_traffic_policy() -> None:
    plan = plans(REMOTE_EP, etp="Local")[(LB_IP, 80)]
    assert firewalled(go(plan, OUTSIDE))
    in_range = go(plan, ALLOWED)
    assert isinstance(in_range, Drop) and "eTP=Local" in in_range.reason
    # A pod in range still gets Cluster semantics (kubernetes#131765).
    pod_ok = plans(REMOTE_EP, etp="Local", ranges=("10.244.0.0/16",))[(LB_IP, 80)]
    assert isinstance(go(pod_ok, POD), Forward)


def test_allow_from_node_lets_the_lb_ips_through_when_a_range_holds_the_node() -> None:
    """kube-proxy: a node reaching its own LB VIP through a local route comes from the VIP."""
    plan = plans(LOCAL_EP, ranges=("198.51.100.0/24", "192.168.49.0/24"))[(LB_IP, 80)]
    assert plan.source_vips == (LB_IP, LB_IP2)
    for client in (LB_IP, LB_IP2, NODE_IP, ALLOWED):
        assert isinstance(go(plan, client), Forward), client
    assert firewalled(go(plan, OUTSIDE))
    # The node's IP is its first of the family, as kube-proxy's nodeIP.
    other = plans(LOCAL_EP, ranges=("10.1.0.0/16",), node_ips=(NODE_IP, "10.1.0.5"))
    assert other[(LB_IP, 80)].source_vips == () and firewalled(go(other[(LB_IP, 80)], LB_IP))


def test_each_family_takes_only_its_own_ranges() -> None:
    """IPv4 ranges only: the IPv6 LB IP is not filtered, as kube-proxy's IPv6 proxier."""
    plan6 = plans(LOCAL_EP6, family=6)[(LB_IP6, 80)]
    assert plan6.source_ranges == ()
    assert isinstance(go(plan6, "2001:db8:ffff::1"), Forward)
    both = plans(LOCAL_EP6, family=6, ranges=("198.51.100.0/24", "2001:db8:1::/48"))
    plan6 = both[(LB_IP6, 80)]
    assert plan6.source_ranges == (net("2001:db8:1::/48"),)
    assert isinstance(go(plan6, "2001:db8:1::9"), Forward)
    assert firewalled(go(plan6, "2001:db8:ffff::1"))
    # allowFromNode over IPv6: the node's IPv6 address is in a range.
    node6 = plans(LOCAL_EP6, family=6, ranges=("fd00:49::/64",))[(LB_IP6, 80)]
    assert node6.source_vips == (LB_IP6,) and isinstance(go(node6, LB_IP6), Forward)


def test_a_new_node_ip_rebuilds_allow_from_node() -> None:
    cache = PlanCache()
    ranges = ("192.168.49.0/24",)
    first = build_plans(snapshot(LOCAL_EP, ranges=ranges), HERE, cache=cache, vips=True)
    assert first[(LB_IP, 80)].source_vips == (LB_IP, LB_IP2)
    moved = snapshot(LOCAL_EP, ranges=ranges, node_ips=("10.9.0.2",))
    object.__setattr__(moved, "generation", 1)
    object.__setattr__(moved, "changes", Changes(since=0, services=frozenset(), nodes=True))
    second = build_plans(moved, HERE, cache=cache, vips=True)
    assert second[(LB_IP, 80)].source_vips == ()


# -- the userspace mode's nft table -----------------------------------------------------


def test_vip_rules_put_each_firewalled_lb_port_in_its_services_firewall() -> None:
    ranges = ("198.51.100.0/24", "198.51.100.128/25", "192.168.49.0/24")
    rules, _ = vip_rules(plans(LOCAL_EP, ranges=ranges), (),
                         plans(LOCAL_EP, ranges=ranges, protocol="UDP"))
    assert rules.firewalls == (Firewall(
        "default/web",
        # Overlaps merged (nft refuses them in one set); the LB IPs by allowFromNode.
        ("192.0.2.80/32", "192.0.2.82/32", "192.168.49.0/24", "198.51.100.0/24"),
        frozenset({(LB_IP, "tcp", 80), (LB_IP2, "tcp", 80), (LB_IP, "udp", 53),
                   (LB_IP2, "udp", 53)})),)
    # No endpoints, or no ranges: no firewall at all.
    assert vip_rules(plans(), (), plans(protocol="UDP"))[0].firewalls == ()
    assert vip_rules(plans(LOCAL_EP, ranges=()))[0].firewalls == ()


def test_the_table_checks_the_firewall_before_any_other_rule() -> None:
    rules, _ = vip_rules(plans(LOCAL_EP), (), plans(LOCAL_EP, protocol="UDP"))
    script = nft_script({CLUSTER_IP, EXTERNAL_IP, LB_IP, LB_IP2}, rules)
    lines = [ln.strip() for ln in script.splitlines()]
    assert ('ip saddr != { 198.51.100.0/24 } counter drop comment "default/web"') in lines
    assert (f"map firewall {{ type ipv4_addr . inet_proto . inet_service : verdict; elements ="
            f" {{ {LB_IP} . tcp . 80 : jump fw_0, {LB_IP} . udp . 53 : jump fw_0,"
            f" {LB_IP2} . tcp . 80 : jump fw_0, {LB_IP2} . udp . 53 : jump fw_0 }}; }}") in lines
    guard = lines[lines.index("chain guard {"):]
    syn = guard.index("tcp flags & (syn | ack) != syn return")
    assert guard[syn + 1] == "ip daddr . meta l4proto . tcp dport vmap @firewall"
    udp = lines[lines.index("chain udp_guard {") + 1]
    assert udp == "ip daddr . meta l4proto . udp dport vmap @firewall"

    rules6, _ = vip_rules(plans(LOCAL_EP6, family=6, ranges=("2001:db8:1::/48",)), family=6)
    script6 = nft_script({LB_IP6}, rules6, family=6)
    assert "ip6 saddr != { 2001:db8:1::/48 } counter drop" in script6
    assert f"{LB_IP6} . tcp . 80 : jump fw_0" in script6


def test_firewall_sources_and_counters() -> None:
    assert firewall_sources([net("10.0.0.0/8"), net("10.1.0.0/16")], ["10.2.0.1", "11.0.0.1"]
                            ) == ("10.0.0.0/8", "11.0.0.1/32")
    listing = """table ip kpx_vips {
	chain fw_0 {
		ip saddr != { 198.51.100.0/24 } counter packets 3 bytes 180 drop comment "default/web"
	}
	chain fw_1 {
		ip saddr != { 10.0.0.0/8 } counter packets 2 bytes 120 drop comment "default/db"
	}
	chain guard {
		ip daddr . tcp dport @drop_all counter packets 1 bytes 60 drop
	}
}"""
    assert rule_counters(listing) == {"firewall": 5, "drop_all": 1}
