"""Service VIPs served by ``kpx node`` on real namespaces (issue 11, lab cases 1-8).

Each test builds a small lab through ``lab_factory`` (removed afterwards,
pass or fail): echo pods on node1/node2, services with the ClusterIP the lab
allocates, externalIPs routed to a node, an LB ingress with its ipMode.
Behaviour is observed from outside kpx: the echo pod's reply (``pod``,
``peer``), plain connects (ok/refused/timeout), scapy SYNs (a DROP is no
SYN-ACK and no RST), ``ip route show table local proto 107`` (kpx's VIP
routes), ``ss`` (listeners) and the LB's nft counters.

Every wait is a poll with a deadline (``wait_applied``, ``poll_change``,
``lab.common.wait_until``).
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from collections.abc import Callable
from typing import Any

import pytest

from lab import Lab
from lab.common import wait_until
from lab.lb.control import connection_counts
from tests.support.labkit import (
    CLIENT_IP,
    NFQUEUE_MODE,
    POD_PORT,
    connect_outcome,
    generations,
    in_every_proxy_mode,
    logs,
    over_both_families,
    peer_ip,
    poll_change,
    service,
    wait_applied,
)
from tests.support.probes import syn_answers, syn_probe

pytestmark = pytest.mark.lab

LabFactory = Callable[..., Lab]

VIP_PROTO = 107
NFT_TABLE = "kpx_vips"
NFQ_TABLE = "kpx_nfq"
DROP_WINDOW = 1.5
"""Seconds a dropped SYN must stay unanswered."""
CHANGE_LIMIT = 1.0
"""Issue 11: a live change applies to new connections within 1 second."""
EXT_LOCAL = "203.0.113.10"
"""An externalIP routed (client -> LB -> node) to node1, where the endpoint runs."""
EXT_REMOTE = "203.0.113.20"
"""An externalIP routed to node2, which has no endpoint."""


lab_factory = in_every_proxy_mode()


# ------------------------------------------------------------------ lab files


def pod(name: str, node: str, app: str) -> dict[str, Any]:
    return {"name": name, "node": node, "labels": {"app": app}, "port": POD_PORT}


def vip_spec(*services: dict[str, Any], lb: dict[str, Any] | None = None,
             routes: dict[str, str] | None = None) -> dict[str, Any]:
    """3 nodes; the backend web-1 on node1; client pods c1 on node1 and c2 on node2."""
    spec: dict[str, Any] = {
        "nodes": 3,
        "pods": [pod("web-1", "node1", "web"), pod("c1", "node1", "client"),
                 pod("c2", "node2", "client")],
        "services": list(services),
    }
    if routes:
        spec["cluster"] = {"externalIPRoutes": routes}
    if lb is not None:
        spec["loadBalancer"] = lb
    return spec


def cluster_ip_service(name: str = "web", itp: str = "Cluster", app: str = "web",
                       **spec: Any) -> dict[str, Any]:
    return service(name, app=app, type="ClusterIP", internalTrafficPolicy=itp, **spec)


def lb_service(etp: str = "Local") -> dict[str, Any]:
    return service("web", etp, type="LoadBalancer")


def lb_section(ip_mode: str) -> dict[str, Any]:
    return {"service": "default/web", "ipMode": ip_mode,
            "probe": {"type": "tcp", "port": "nodePort", "interval": 0.5, "timeout": 0.5}}


def up(lab_factory: LabFactory, spec: dict[str, Any], **kw: Any) -> Lab:
    """A lab whose every proxy has applied its first state.

    The lab tells each ``kpx node`` the pod network (``--cluster-cidr``), as
    kube-proxy is told: the pod-keeps-its-IP hop and the in-cluster LB IP
    rule depend on telling a pod source from an external one.
    """
    lab = lab_factory(spec, **kw)
    wait_applied(lab)
    wait_vips(lab)
    return lab


VIPS_RE = re.compile(r"(?:service VIPs|nfqueue rules) in force \(generation (\d+)\)")
"""What each mode logs once a generation's VIPs are served: the relay's routes and
steering, or nfqueue mode's table (which serves every port and VIP at once)."""


def wait_vips(lab: Lab, timeout: float = 5.0) -> None:
    """Wait until every proxy has put the VIPs of the generation it applied in force.

    ``kpx node`` writes a VIP change (routes, nft table) in the background
    after the apply, and logs when it is in force.
    """
    def pending() -> list[str]:
        return [n for n in lab.nodes
                if not VIPS_RE.search(lab.proxy_log(n))]

    try:
        wait_until(lambda: not pending(), timeout, 0.02)
    except TimeoutError:
        raise AssertionError(f"proxies on {pending()} did not put VIPs in force within"
                             f" {timeout}s\n{logs(lab)}") from None


# ------------------------------------------------------------------ observations


def nfqueue_mode(lab: Lab, node: str) -> bool:
    return NFQUEUE_MODE in lab.proxy_log(node)


def vip_routes(lab: Lab, node: str) -> list[str]:
    """The VIPs kpx intercepts in node's namespace.

    The relay makes each one local (``table local proto 107``); nfqueue mode
    routes nothing and knows them in its table's ``vips`` set instead.
    """
    if nfqueue_mode(lab, node):
        res = lab.run(node, ["nft", "-j", "list", "set", "ip", NFQ_TABLE, "vips"])
        if res.returncode != 0:
            return []
        sets = [o["set"] for o in json.loads(res.stdout)["nftables"] if "set" in o]
        return [str(e) for s in sets for e in s.get("elem", [])]
    out = lab.run(node, ["ip", "-4", "route", "show", "table", "local",
                         "proto", str(VIP_PROTO)]).stdout
    return [ln.split()[1] for ln in out.splitlines() if ln.strip()]


def vip_table(lab: Lab, node: str, family: int = 4) -> str:
    """kpx's nft table for VIPs of ``family`` in node's namespace, as ``nft list`` prints it
    ("" if absent)."""
    table = NFQ_TABLE if nfqueue_mode(lab, node) else NFT_TABLE
    res = lab.run(node, ["nft", "list", "table", "ip6" if family == 6 else "ip", table])
    return res.stdout if res.returncode == 0 else ""


def drop_all_count(listing: str) -> int:
    """Packets the table's ``@drop_all`` rule dropped (0 if it has none)."""
    for line in listing.splitlines():
        m = re.search(r"@drop_all counter packets (\d+)", line)
        if m:
            return int(m.group(1))
    return 0


def vip_rules(lab: Lab, node: str, ip: str, port: int) -> list[str]:
    """What kpx's nft table in node holds for ip:port (served or dropped set elements)."""
    family = 6 if ":" in ip else 4
    return [ln for ln in vip_table(lab, node, family).splitlines() if f"{ip} . {port}" in ln]


def node_addresses(lab: Lab, node: str, family: int = 4) -> set[str]:
    """Every address of ``family`` configured in node's namespace."""
    out = lab.run(node, ["ip", f"-{family}", "-o", "addr", "show"]).stdout
    return {ln.split()[3].split("/")[0] for ln in out.splitlines() if ln.strip()}


def answers(lab: Lab, src: str, ip: str, port: int = 80,
            pod_name: str = "web-1") -> Callable[[], bool]:
    def probe() -> bool:
        try:
            reply = lab.request(src, ip, port, timeout=0.25)
        except (OSError, ValueError):
            return False
        return reply.get("pod") == pod_name
    return probe


def drops(lab: Lab, src: str, ip: str, port: int = 80) -> Callable[[], bool]:
    return lambda: connect_outcome(lab, src, ip, port, 0.3) == "timeout"


def assert_dropped(lab: Lab, src: str, ip: str, port: int = 80,
                   control: tuple[str, int] | None = None, iface: str = "eth0") -> None:
    """A raw SYN from src to ip:port gets no SYN-ACK, no RST, no ICMP; a connect times out.

    ``control``: a target that must answer SYN-ACK in the same capture, proving
    the capture itself sees answers.
    """
    targets = [(ip, port)] + ([control] if control else [])
    tcp, icmp = syn_answers(lab.ns(src), targets, window=DROP_WINDOW, iface=iface)
    if control:
        assert "SA" in tcp[f"{control[0]}:{control[1]}"], f"capture saw no SYN-ACK: {tcp}"
    assert tcp[f"{ip}:{port}"] == [], f"{src} -> {ip}:{port} answered: {tcp}\n{logs(lab)}"
    assert icmp == [], icmp
    t0 = time.monotonic()
    outcome = connect_outcome(lab, src, ip, port, DROP_WINDOW)
    assert outcome == "timeout", f"{src} -> {ip}:{port}: {outcome} (want timeout)"
    assert time.monotonic() - t0 >= DROP_WINDOW * 0.9


def assert_refused_at_once(lab: Lab, src: str, ip: str, port: int) -> None:
    t0 = time.monotonic()
    with lab.socket(src) as s, pytest.raises(ConnectionRefusedError):
        s.settimeout(3.0)
        s.connect((ip, port))
    assert time.monotonic() - t0 < 0.5, f"{ip}:{port}: refusal must be immediate"


# ------------------------------------------------------------------ 1. pod -> ClusterIP


@over_both_families
def test_a_pod_on_a_node_without_the_endpoint_reaches_a_cluster_policy_cluster_ip(
        lab_factory: LabFactory) -> None:
    lab = up(lab_factory, vip_spec(cluster_ip_service(itp="Cluster")))
    cip = lab.cluster_ip("default/web")
    assert cip.startswith("fd00:10:96:" if ":" in lab.client_ip else "10.96.")
    for _ in range(3):
        reply = lab.request("c2", cip, 80)
        assert reply["pod"] == "web-1"


@over_both_families
def test_a_pod_on_a_node_without_the_endpoint_is_dropped_by_a_local_policy_cluster_ip(
        lab_factory: LabFactory) -> None:
    """iTP=Local, c2 on node2, the only endpoint on node1: the SYN is silently dropped.

    The control in the same capture is a Cluster-policy service on the same pod.
    """
    lab = up(lab_factory, vip_spec(cluster_ip_service("web", itp="Local"),
                                   cluster_ip_service("open", itp="Cluster")))
    assert_dropped(lab, "c2", lab.cluster_ip("default/web"), 80,
                   control=(lab.cluster_ip("default/open"), 80))


def test_a_pod_on_the_endpoints_node_reaches_a_local_policy_cluster_ip(
        lab_factory: LabFactory) -> None:
    lab = up(lab_factory, vip_spec(cluster_ip_service(itp="Local")))
    cip = lab.cluster_ip("default/web")
    for _ in range(3):
        assert lab.request("c1", cip, 80)["pod"] == "web-1"


# ------------------------------------------------------------------ 2. node -> ClusterIP


def test_a_node_process_is_dropped_by_a_local_policy_cluster_ip_without_a_local_endpoint(
        lab_factory: LabFactory) -> None:
    lab = up(lab_factory, vip_spec(cluster_ip_service("web", itp="Local"),
                                   cluster_ip_service("open", itp="Cluster")))
    cip, open_ip = lab.cluster_ip("default/web"), lab.cluster_ip("default/open")
    assert lab.request("node2", open_ip, 80)["pod"] == "web-1"
    # The VIP is local to node2, so there is no wire to sniff: the proof of a
    # DROP is a connect that times out (no RST) while kpx's drop rule on
    # node2 counts the SYN it ate.
    assert vip_rules(lab, "node2", cip, 80), "node2's table does not know the VIP"
    family = 6 if ":" in cip else 4
    eaten = dropped(lab, "node2", family)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError):
        lab.request("node2", cip, 80, timeout=DROP_WINDOW)
    assert time.monotonic() - t0 >= DROP_WINDOW * 0.9
    # nfqueue mode flushes its counts every second.
    wait_until(lambda: dropped(lab, "node2", family) > eaten, 3.0,
               what="kpx dropping the SYN")


def dropped(lab: Lab, node: str, family: int = 4) -> int:
    """SYNs node's kpx dropped for default/web: its nft rule's count (the relay), or its
    ``kubeproxy_kpx_connections_dropped_total`` (nfqueue mode drops by verdict)."""
    if not nfqueue_mode(lab, node):
        return drop_all_count(vip_table(lab, node, family))
    assert lab.metrics_port is not None
    status, raw = lab.http_get(node, "127.0.0.1", lab.metrics_port, "/metrics")
    body = raw.decode(errors="replace")
    assert status == 200, body
    m = re.search(r'kubeproxy_kpx_connections_dropped_total\{service_port="default/web"\}'
                  r" (\d+(?:\.\d+)?)", body)
    return int(float(m.group(1))) if m else 0


# ------------------------------------------------------------------ 3. refused


def test_a_cluster_ip_port_nobody_declares_is_refused_at_once(lab_factory: LabFactory) -> None:
    lab = up(lab_factory, vip_spec(cluster_ip_service()))
    cip = lab.cluster_ip("default/web")
    assert lab.request("c2", cip, 80)["pod"] == "web-1"
    for src in ("c2", "c1", "node2"):
        assert_refused_at_once(lab, src, cip, 81)
    assert syn_probe(lab.ns("c2"), (cip, 81), (cip, 80)) == ["rst", "synack"]


def test_a_cluster_ip_service_without_endpoints_is_refused_at_once(
        lab_factory: LabFactory) -> None:
    lab = up(lab_factory, vip_spec(cluster_ip_service(), cluster_ip_service("empty",
                                                                            app="nothing")))
    cip = lab.cluster_ip("default/empty")
    for src in ("c2", "c1", "node1"):
        assert_refused_at_once(lab, src, cip, 80)
    for node in lab.nodes:
        assert vip_rules(lab, node, cip, 80) == [], f"{node} steers {cip}:80"


# ------------------------------------------------------------------ 4. source addresses


def test_a_cross_node_cluster_ip_hop_keeps_the_source_pods_ip(lab_factory: LabFactory) -> None:
    lab = up(lab_factory, vip_spec(cluster_ip_service()))
    reply = lab.request("c2", lab.cluster_ip("default/web"), 80)
    assert reply["pod"] == "web-1"
    assert peer_ip(reply) == lab.pod_ip("c2"), f"the backend saw {reply['peer']}"


def test_a_pod_reaching_itself_through_its_service_sees_a_node_address(
        lab_factory: LabFactory) -> None:
    lab = up(lab_factory, vip_spec(cluster_ip_service()))
    reply = lab.request("web-1", lab.cluster_ip("default/web"), 80)
    assert reply["pod"] == "web-1"
    seen = peer_ip(reply)
    assert seen != lab.pod_ip("web-1"), "hairpin must not show the pod its own IP"
    mine = node_addresses(lab, "node1", 6 if ":" in seen else 4)
    assert seen in mine, f"hairpin peer {seen} is not an address of node1 {mine}"


# ------------------------------------------------------------------ 5. externalIPs


def test_an_external_ip_with_local_policy_keeps_the_client_ip_and_a_podless_node_drops(
        lab_factory: LabFactory) -> None:
    svc = service("web", "Local", externalIPs=[EXT_LOCAL, EXT_REMOTE])
    lab = up(lab_factory, vip_spec(svc, routes={EXT_LOCAL: "node1", EXT_REMOTE: "node2"}))
    reply = lab.request("client", EXT_LOCAL, 80)
    assert reply["pod"] == "web-1"
    assert peer_ip(reply) == CLIENT_IP, f"the pod saw {reply['peer']}"
    assert_dropped(lab, "client", EXT_REMOTE, 80, control=(EXT_LOCAL, 80))


# ------------------------------------------------------------------ 6. pod -> LB IP


def test_a_pod_reaches_a_local_policy_lb_ip_from_a_node_without_an_endpoint(
        lab_factory: LabFactory) -> None:
    """kubernetes#131765: in-cluster traffic to a VIP-mode LB IP is not dropped by eTP=Local."""
    lab = up(lab_factory, vip_spec(lb_service("Local"), lb=lb_section("VIP")))
    (ingress,) = lab.ingress("default/web")
    assert ingress["ipMode"] == "VIP"
    assert ingress["ip"] in vip_routes(lab, "node2")
    reply = lab.request("c2", ingress["ip"], 80)
    assert reply["pod"] == "web-1"
    # A pod on the endpoint's own node is SNATed to that node: unSNATed, the
    # endpoint would answer it over the pod bridge, past kpx's relay (a reset).
    reply = lab.request("c1", ingress["ip"], 80)
    assert reply["pod"] == "web-1"
    assert peer_ip(reply) in node_addresses(lab, "node1"), f"the pod saw {reply['peer']}"


# ------------------------------------------------------------------ 7. ipMode Proxy


def test_a_proxy_mode_lb_ip_is_not_intercepted_and_the_syn_reaches_the_lb(
        lab_factory: LabFactory) -> None:
    """No kpx route for the LB IP on any node; c2's connection goes through the LB and back.

    The LB DNATs its front to a node's nodePort and counts per node in
    postrouting: a pod's connection that kpx intercepted would never reach it.
    """
    lab = up(lab_factory, vip_spec(lb_service("Local"), lb=lb_section("Proxy")))
    (ingress,) = lab.ingress("default/web")
    assert ingress["ipMode"] == "Proxy"
    lb_ip = ingress["ip"]
    cip = lab.cluster_ip("default/web")
    for node in lab.nodes:
        routes = vip_routes(lab, node)
        assert cip in routes, f"{node} serves no VIP at all: {routes}"
        assert lb_ip not in routes, f"{node} intercepts the Proxy-mode LB IP: {routes}"
    before = sum(connection_counts(lab).values())
    # The whole round trip: the LB SNATs a pod client, so the reply comes back through it.
    assert lab.request("c2", lb_ip, 80)["pod"] == "web-1"
    wait_until(lambda: sum(connection_counts(lab).values()) > before, 3.0)


# ------------------------------------------------------------------ 8. live changes


@pytest.mark.serial
def test_flipping_the_internal_traffic_policy_applies_within_a_second(
        lab_factory: LabFactory) -> None:
    spec = vip_spec(cluster_ip_service(itp="Local"))
    lab = up(lab_factory, spec)
    cip = lab.cluster_ip("default/web")
    assert connect_outcome(lab, "c2", cip, 80, 0.5) == "timeout"

    lab.update_service(cluster_ip_service(itp="Cluster"))
    assert lab.cluster_ip("default/web") == cip
    took = poll_change(lab, answers(lab, "c2", cip), "c2 answered after Local->Cluster")
    assert took < CHANGE_LIMIT, f"Local->Cluster took {took:.2f}s"

    lab.update_service(cluster_ip_service(itp="Local"))
    took = poll_change(lab, drops(lab, "c2", cip), "c2 dropped after Cluster->Local")
    assert took < CHANGE_LIMIT, f"Cluster->Local took {took:.2f}s"
    assert connect_outcome(lab, "c2", cip, 80, DROP_WINDOW) == "timeout"
    assert lab.request("c1", cip, 80)["pod"] == "web-1"


@pytest.mark.serial
def test_flipping_the_ip_mode_applies_within_a_second(lab_factory: LabFactory) -> None:
    spec = vip_spec(lb_service("Cluster"), lb=lb_section("VIP"))
    lab = up(lab_factory, spec)
    (ingress,) = lab.ingress("default/web")
    lb_ip = ingress["ip"]
    assert lb_ip in vip_routes(lab, "node2")

    def routed(want: bool) -> Callable[[], bool]:
        return lambda: all((lb_ip in vip_routes(lab, n)) == want for n in lab.nodes)

    before = generations(lab)
    lab.apply(vip_spec(lb_service("Cluster"), lb=lb_section("Proxy")))
    assert lab.ingress("default/web") == [{"ip": lb_ip, "ipMode": "Proxy"}]
    took = poll_change(lab, routed(False), "LB IP route gone after VIP->Proxy")
    assert took < CHANGE_LIMIT, f"VIP->Proxy took {took:.2f}s"
    wait_applied(lab, before)
    for node in lab.nodes:
        assert vip_rules(lab, node, lb_ip, 80) == [], f"{node} still steers {lb_ip}"

    lab.apply(vip_spec(lb_service("Cluster"), lb=lb_section("VIP")))
    took = poll_change(lab, routed(True), "LB IP route back after Proxy->VIP")
    assert took < CHANGE_LIMIT, f"Proxy->VIP took {took:.2f}s"
    took = poll_change(lab, answers(lab, "c2", lb_ip), "c2 reaching the LB IP via kpx")
    assert took < CHANGE_LIMIT, f"Proxy->VIP traffic took {took:.2f}s"


@pytest.mark.serial
def test_deleting_a_service_removes_its_vip_routes_and_listeners_within_a_second(
        lab_factory: LabFactory) -> None:
    svc = service("web", "Cluster", externalIPs=[EXT_LOCAL])
    lab = up(lab_factory, vip_spec(svc, cluster_ip_service("keep"),
                                   routes={EXT_LOCAL: "node1"}))
    cip, keep = lab.cluster_ip("default/web"), lab.cluster_ip("default/keep")
    vips = {cip, EXT_LOCAL}
    for node in lab.nodes:
        assert vips <= set(vip_routes(lab, node)), f"{node}: {vip_routes(lab, node)}"
    assert lab.request("c2", cip, 80)["pod"] == "web-1"

    lab.delete_service("default/web")
    took = poll_change(
        lab, lambda: connect_outcome(lab, "c2", cip, 80, 0.3) != "ok",
        "the deleted ClusterIP no longer answering")
    assert took < CHANGE_LIMIT, f"delete took {took:.2f}s"

    def clean() -> bool:
        return all(not (vips & set(vip_routes(lab, n)))
                   and not any(vip_rules(lab, n, ip, 80) for ip in vips)
                   for n in lab.nodes)

    took = poll_change(lab, clean, "no VIP route or listener left after delete")
    assert took < CHANGE_LIMIT, f"delete cleanup took {took:.2f}s"
    for node in lab.nodes:
        assert keep in vip_routes(lab, node), "the other service's VIP must stay"
    assert lab.request("c2", keep, 80)["pod"] == "web-1"


def test_a_kpx_that_exits_leaves_no_vip_route_in_its_node(lab_factory: LabFactory) -> None:
    lab = up(lab_factory, vip_spec(cluster_ip_service()))
    cip = lab.cluster_ip("default/web")
    assert cip in vip_routes(lab, "node2")
    pid = lab.proxy_pid("node2")
    assert pid is not None
    os.kill(pid, signal.SIGINT)  # as a teardown stops it: no successor expected
    try:
        wait_until(lambda: not lab.proxy_alive("node2"), 10.0)
    finally:
        lab.procs.reap(pid)
    assert vip_routes(lab, "node2") == [], f"kpx left routes behind\n{lab.proxy_log('node2')}"
    assert vip_table(lab, "node2") == "", "kpx left its nft table behind"
    assert cip in vip_routes(lab, "node1"), "the other nodes' kpx keep serving"


# ------------------------------------------------------------------ 9. loadBalancerSourceRanges


def firewall_drops(lab: Lab, node: str) -> int:
    """New connections node's kpx dropped for default/web: the userspace table's firewall
    chain count, or nfqueue mode's dropped-connection metric (it drops by verdict)."""
    if nfqueue_mode(lab, node):
        return dropped(lab, node)
    m = re.search(r'saddr != .* counter packets (\d+) .*comment "default/web"',
                  vip_table(lab, node))
    return int(m.group(1)) if m else 0


@pytest.mark.serial
def test_lb_source_ranges_drop_a_source_outside_them_until_an_apply_takes_it_in(
        lab_factory: LabFactory) -> None:
    """kube-proxy's firewall on the LB ingress IP, its NodePort and ClusterIP left open.

    The lab's LB DNATs its front (the ingress IP) to a nodePort, so what
    reaches a node with the LB IP as destination, as from an L2/BGP balancer,
    is in-cluster traffic kpx intercepts: pod c2, on node2 (the endpoint is on
    node1), is the source the ranges judge. Outside them its SYN times out,
    dropped by kpx (a counter rises), while the same service's ClusterIP
    serves it and the external client, through the LB, reaches the nodePort,
    which no range filters, its own IP kept (eTP=Local). An apply that takes
    the pod network in serves c2 within a second; a bad range then is
    refused and those ranges stay in force. (c2's address is not what
    the backend sees: a pod gets Cluster semantics on an external VIP, and
    kpx SNATs that hop to another node, ``proxy.core.decision``.)
    """
    def spec(ranges: list[str]) -> dict[str, Any]:
        svc = service("web", "Local", type="LoadBalancer", loadBalancerSourceRanges=ranges)
        return {"nodes": 2, "pods": [pod("web-1", "node1", "web"), pod("c2", "node2", "client")],
                "services": [svc], "loadBalancer": lb_section("VIP")}

    lab = up(lab_factory, spec(["192.0.2.0/24"]))
    (ingress,) = lab.ingress("default/web")
    lb_ip = ingress["ip"]
    assert lab.request("c2", lab.cluster_ip("default/web"), 80)["pod"] == "web-1"
    eaten = firewall_drops(lab, "node2")
    t0 = time.monotonic()
    assert connect_outcome(lab, "c2", lb_ip, 80, DROP_WINDOW) == "timeout"
    assert time.monotonic() - t0 >= DROP_WINDOW * 0.9
    wait_until(lambda: firewall_drops(lab, "node2") > eaten, 3.0,
               what="kpx dropping the SYN from outside the ranges")
    wait_until(answers(lab, "client", lb_ip), 5.0, what="the client served through the LB")
    assert peer_ip(lab.request("client", lb_ip, 80)) == CLIENT_IP

    before = generations(lab)
    lab.apply(spec(["10.244.0.0/16"]))
    took = poll_change(lab, answers(lab, "c2", lb_ip), "c2 served once the ranges hold it")
    assert took < CHANGE_LIMIT, f"the new ranges took {took:.2f}s"
    wait_applied(lab, before)
    assert connect_outcome(lab, "c2", lb_ip, 80, DROP_WINDOW) == "ok"
    assert peer_ip(lab.request("client", lb_ip, 80)) == CLIENT_IP

    # A range that is not a CIDR: the state is refused, naming the field, and
    # the last good ranges stay in force.
    lab.apply(spec(["10.244.0.0/16", "10.244.0.0/99"]))
    wait_until(lambda: 'spec.loadBalancerSourceRanges[1]: "10.244.0.0/99" is not a valid CIDR'
               in lab.proxy_log("node1"), 3.0, what="kpx refusing the bad range")
    assert connect_outcome(lab, "c2", lb_ip, 80, DROP_WINDOW) == "ok"
