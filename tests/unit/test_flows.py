"""UDP in the pure core: a UDP decision table beside the TCP one, flows, and no stale flow.

A Service's UDP ports get plans of their own (a port number may be TCP and
UDP at once); the flow table bounds itself, expires flows after conntrack's
two UDP timeouts and evicts the flow idle the longest; ``still_eligible``
says when a flow's endpoint is no longer one ``decide`` would pick from, so
the shell re-decides instead of black-holing (kubernetes#96174).
"""

from __future__ import annotations

import ipaddress

import pytest

from proxy.core.balancer import Balancer
from proxy.core.decision import Drop, Forward, PortPlan, Reject, build_plans, decide, still_eligible
from proxy.core.endpoints import EndpointInfo
from proxy.core.flows import Flow, FlowTable
from proxy.core.model import (
    Endpoint,
    EndpointPort,
    EndpointSlice,
    Service,
    ServicePort,
    Snapshot,
    TrafficPolicy,
)
from proxy.core.sync import SyncConfig, compute_sync

HERE, THERE = "node-a", "node-b"
NODE_IPS = frozenset({"192.168.49.2"})
POD_CIDRS = [ipaddress.ip_network("10.244.0.0/16")]
OUTSIDE = "198.51.100.20"
LOCAL_EP = Endpoint("10.244.0.5", HERE)
REMOTE_EP = Endpoint("10.244.1.5", THERE)


def snapshot(*endpoints: Endpoint, etp: TrafficPolicy = "Cluster", udp_slice: bool = True
             ) -> Snapshot:
    service = Service(
        namespace="kube-system", name="dns", type="NodePort",
        ports=(ServicePort("dns-tcp", "TCP", 53, 5353, 30053),
               ServicePort("dns", "UDP", 53, 5353, 30053)),
        cluster_ip="10.96.0.10", external_traffic_policy=etp,
        health_check_node_port=32000 if etp == "Local" else 0,
    )
    ports = (EndpointPort("dns-tcp", 5353), EndpointPort("dns", 5353, "UDP")) if udp_slice \
        else (EndpointPort("dns-tcp", 5353),)
    sl = EndpointSlice("kube-system", "dns-a", "dns", endpoints, ports)
    return Snapshot(services=(service,), slices=(sl,))


def udp_plan(*endpoints: Endpoint, etp: TrafficPolicy = "Cluster", vip: bool = False,
             udp_slice: bool = True) -> PortPlan:
    table = build_plans(snapshot(*endpoints, etp=etp, udp_slice=udp_slice), HERE, vips=True,
                        protocol="UDP")
    return table[("10.96.0.10", 53) if vip else 30053]


def test_tcp_and_udp_share_a_port_number_in_two_tables() -> None:
    snap = snapshot(LOCAL_EP)
    tcp = build_plans(snap, HERE, vips=True)
    udp = build_plans(snap, HERE, vips=True, protocol="UDP")
    assert list(tcp) == list(udp) == [30053, ("10.96.0.10", 53)]
    assert {p.port.protocol for p in tcp.values()} == {"TCP"}
    assert {p.port.protocol for p in udp.values()} == {"UDP"}
    result = compute_sync(snap, SyncConfig(HERE, vips=True))
    assert list(result.udp_plans) == [30053, ("10.96.0.10", 53)]
    assert result.vips == frozenset({"10.96.0.10"})


def test_udp_verdicts_are_tcps() -> None:
    assert isinstance(decide(udp_plan(), OUTSIDE, NODE_IPS, Balancer(), 0.0), Reject)
    # A slice without the UDP port gives the UDP port no endpoints, as for TCP.
    assert not udp_plan(LOCAL_EP, udp_slice=False).has_any
    local = udp_plan(REMOTE_EP, etp="Local")
    assert isinstance(decide(local, OUTSIDE, NODE_IPS, Balancer(), 0.0), Drop)
    node = decide(local, "192.168.49.2", NODE_IPS, Balancer(), 0.0)
    assert isinstance(node, Forward) and node.snat  # the node's own: Cluster, SNATed
    kept = decide(udp_plan(LOCAL_EP, etp="Local"), OUTSIDE, NODE_IPS, Balancer(), 0.0)
    assert isinstance(kept, Forward) and not kept.snat


def test_dropping_counts_a_udp_port_as_a_service_port_of_its_own() -> None:
    result = compute_sync(snapshot(REMOTE_EP, etp="Local"), SyncConfig(HERE))
    assert result.dropping == 2  # dns-tcp and dns


def ep(plan: PortPlan) -> EndpointInfo:
    return plan.cluster[0]


def test_a_flow_stays_eligible_until_its_endpoint_goes() -> None:
    before = udp_plan(LOCAL_EP, REMOTE_EP)
    target = next(e for e in before.cluster if e.ip == REMOTE_EP.address)
    assert still_eligible(udp_plan(REMOTE_EP), target, OUTSIDE, NODE_IPS)
    assert not still_eligible(udp_plan(LOCAL_EP), target, OUTSIDE, NODE_IPS)  # gone
    not_ready = Endpoint(REMOTE_EP.address, THERE, ready=False, serving=False)
    assert not still_eligible(udp_plan(LOCAL_EP, not_ready), target, OUTSIDE, NODE_IPS)
    # Terminating but serving: the fallback only while nothing ready exists.
    terminating = Endpoint(REMOTE_EP.address, THERE, ready=False, serving=True, terminating=True)
    assert still_eligible(udp_plan(terminating), target, OUTSIDE, NODE_IPS)
    assert not still_eligible(udp_plan(LOCAL_EP, terminating), target, OUTSIDE, NODE_IPS)
    # eTP turned Local with the endpoint elsewhere: external clients lose it, the node not.
    local = udp_plan(LOCAL_EP, REMOTE_EP, etp="Local")
    assert not still_eligible(local, target, OUTSIDE, NODE_IPS)
    assert still_eligible(local, target, "192.168.49.2", NODE_IPS)
    assert still_eligible(local, target, "10.244.3.3", NODE_IPS, POD_CIDRS)


def flow(key_port: int, last: float, plan: PortPlan) -> Flow[str]:
    return Flow((OUTSIDE, key_port, "192.168.49.2", 30053), plan, ep(plan), False, last,
                upstream=f"sock{key_port}")


def test_flows_expire_after_conntracks_two_timeouts() -> None:
    plan = udp_plan(LOCAL_EP)
    table: FlowTable[str] = FlowTable(limit=10, timeout=30, timeout_stream=120)
    quiet, chatty = flow(1, 0.0, plan), flow(2, 0.0, plan)
    table.add(quiet)
    table.add(chatty)
    table.touch(chatty, 1.0, reply=True)
    assert table.next_expiry() == 30.0
    assert table.get(quiet.key, 29.9) is quiet
    assert table.get(quiet.key, 30.0) is None  # due: never used again
    assert table.expire(30.0) == [quiet]
    assert table.get(chatty.key, 120.9) is chatty
    assert table.expire(120.9) == []
    assert table.expire(121.0) == [chatty]
    assert len(table) == 0 and table.next_expiry() is None


def test_a_full_table_evicts_the_flow_idle_the_longest_never_the_new_one() -> None:
    plan = udp_plan(LOCAL_EP)
    table: FlowTable[str] = FlowTable(limit=2)
    a, b, c = flow(1, 0.0, plan), flow(2, 1.0, plan), flow(3, 2.0, plan)
    table.add(a)
    table.add(b)
    table.touch(a, 1.5, reply=True)  # a was used after b: b is now the oldest idle
    assert table.add(c) == [b]
    assert {f.key[1] for f in table} == {1, 3}
    assert table.get(c.key, 2.0) is c
    again = flow(3, 3.0, plan)
    assert table.add(again) == [c]  # the same key replaced: the old socket comes back
    with pytest.raises(ValueError):
        FlowTable(limit=0)


def test_udp_vip_ports_get_their_own_guard_sets() -> None:
    """vip_rules sorts UDP plans into the UDP sets; the guard's counters tell them apart."""
    from proxy.userspace.dataplane import vip_rules
    from proxy.userspace.vips import nft_script, rule_counters

    snap = snapshot(REMOTE_EP)
    tcp = build_plans(snap, HERE, vips=True)
    udp = build_plans(snap, HERE, vips=True, protocol="UDP")
    rules, _ = vip_rules(tcp, ("10.244.0.0/16",), udp)
    assert rules.served == rules.udp_served == frozenset({("10.96.0.10", 53)})
    local = snapshot(REMOTE_EP, etp="Local")  # the ClusterIP follows iTP: still served
    rules, _ = vip_rules({}, (), build_plans(local, HERE, vips=True, protocol="UDP"))
    assert rules.udp_served == frozenset({("10.96.0.10", 53)}) and not rules.served
    script = nft_script({"10.96.0.10"}, rules)
    assert "set udp_served { type ipv4_addr . inet_service; elements = { 10.96.0.10 . 53 }; }" \
        in script
    listing = """table ip kpx_vips {
        chain udp_guard {
                ip daddr . udp dport @udp_drop_all counter packets 4 bytes 0 drop
                counter packets 7 bytes 60 reject
        }
        chain guard {
                ip daddr . tcp dport @drop_all counter packets 1 bytes 0 drop
                meta l4proto tcp counter packets 2 bytes 0 reject with tcp reset
        }
}"""
    assert rule_counters(listing) == {"udp_drop_all": 4, "udp_reject": 7, "drop_all": 1,
                                      "reject": 2}
