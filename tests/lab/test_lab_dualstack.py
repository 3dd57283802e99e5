"""The dual-stack lab's own plumbing, proven on the wire (kpx is not needed).

Owns: what ``Lab(..., dual_stack=True)`` / ``kpx lab up --dual-stack`` builds:
IPv6 between pods across nodes, from the client to every node, the echo
pod's peer report, the state file kpx reads (parsed by ``proxy.k8s``), the
LB's IPv6 front (health checks and forwarding over IPv6), teardown, and the
lab file's IP-family validation.

Never: judge kpx's verdicts (other suites do, parametrized over the family):
every lab here runs without ``kpx node`` (``start_proxies=False``), so a
failure is the lab's own.
"""

from __future__ import annotations

import ipaddress
import socket
import sys
from collections.abc import Callable
from typing import Any

import pytest

from lab import Lab, LabSpec, LabSpecError
from lab.common import wait_until
from lab.lb import control as lb_control
from lab.probes import can_connect
from lab.spec import service_key

NO_KPX: dict[str, Any] = {"start_proxies": False, "start_lb": False}


def two_pod_spec() -> dict[str, Any]:
    """A pod on node1 and one on node2 behind one service that names no IP family."""
    return {
        "nodes": 3,
        "pods": [{"name": "a-1", "node": "node1", "labels": {"app": "a"}},
                 {"name": "a-2", "node": "node2", "labels": {"app": "a"}}],
        "services": [{"apiVersion": "v1", "kind": "Service",
                      "metadata": {"name": "a", "namespace": "default"},
                      "spec": {"type": "NodePort", "selector": {"app": "a"},
                               "ports": [{"port": 80, "targetPort": 8080}]}}],
    }


def peer_ip(reply: dict[str, Any]) -> str:
    return str(reply["peer"]).rsplit(":", 1)[0]


def test_pods_reach_each_other_over_ipv6_across_nodes(
        lab_factory: Callable[..., Lab]) -> None:
    lab = lab_factory(two_pod_spec(), dual_stack=True, **NO_KPX)
    assert lab.dual_stack
    a1, a2 = lab.pod_ip("a-1", 6), lab.pod_ip("a-2", 6)
    assert ipaddress.ip_address(a1) in ipaddress.ip_network("fd00::/8")
    assert ipaddress.ip_network(lab.pod_cidr("node2", 6)).overlaps(
        ipaddress.ip_network(f"{a2}/128"))
    # Both ways, pod to pod, and each side sees the other's own IPv6 address:
    # routed by the nodes (different IPv6 pod CIDRs), never NATed.
    assert peer_ip(lab.request("a-1", a2, 8080)) == a1
    back = lab.request("a-2", a1, 8080)
    assert back["pod"] == "a-1" and peer_ip(back) == a2
    # IPv4 is untouched beside it.
    assert peer_ip(lab.request("a-1", lab.pod_ip("a-2"), 8080)) == lab.pod_ip("a-1")


def test_client_reaches_every_node_over_ipv6_and_pods_see_its_address(
        lab_factory: Callable[..., Lab]) -> None:
    lab = lab_factory(None, dual_stack=True, **NO_KPX)  # the built-in lab, dual-stack
    client6 = lab.client_ip(6)
    assert lab.client_ip == "10.79.0.100" and lab.client_ip() == "10.79.0.100"
    for node in lab.nodes:
        ip6 = lab.node_ip(node, 6)
        # A listener in the node itself: the connect goes client -> lb -> node over IPv6.
        with lab.socket(node, family=socket.AF_INET6) as srv:
            srv.bind((ip6, 0))
            srv.listen(1)
            port = srv.getsockname()[1]
            with lab.socket("client", family=socket.AF_INET6) as c:
                c.settimeout(2)
                c.connect((ip6, port))
                conn, addr = srv.accept()
                conn.close()
            assert addr[0] == client6, (node, addr)
    # The echo pod reports the client's own IPv6 address as its peer (the lb routes,
    # no NAT), over the echo protocol and over HTTP with a bracketed Host.
    reply = lab.request("client", lab.pod_ip("web-1", 6), 8080)
    assert reply["pod"] == "web-1" and peer_ip(reply) == client6
    status, body = lab.http_get("client", lab.pod_ip("web-1", 6), 8080, "/clientip")
    assert status == 200 and body.decode().rsplit(":", 1)[0] == client6


def test_state_file_has_both_families_for_kpx(lab_factory: Callable[..., Lab]) -> None:
    import yaml

    from proxy import k8s

    lab = lab_factory(None, dual_stack=True, **NO_KPX)
    docs = list(yaml.safe_load_all(lab.state_path.read_text()))
    nodes = {d["metadata"]["name"]: d for d in docs if d.get("kind") == "Node"}
    for name in lab.nodes:
        addrs = [a["address"] for a in nodes[name]["status"]["addresses"]
                 if a["type"] == "InternalIP"]
        assert addrs == [lab.node_ip(name), lab.node_ip(name, 6)]
        assert nodes[name]["spec"]["podCIDRs"] == [lab.pod_cidr(name), lab.pod_cidr(name, 6)]
    [svc] = [d for d in docs if d.get("kind") == "Service"]
    spec = svc["spec"]
    assert spec["ipFamilyPolicy"] == "PreferDualStack"
    assert spec["ipFamilies"] == ["IPv4", "IPv6"]
    v4, v6 = spec["clusterIPs"]
    assert spec["clusterIP"] == v4
    assert ipaddress.ip_address(v4) in ipaddress.ip_network(lab.spec.service_cidr)
    assert ipaddress.ip_address(v6) in ipaddress.ip_network("fd00:10:96::/112")
    slices = {d["addressType"]: d for d in docs if d.get("kind") == "EndpointSlice"}
    assert set(slices) == {"IPv4", "IPv6"}
    for fam, family in (("IPv4", 4), ("IPv6", 6)):
        s = slices[fam]
        assert s["metadata"]["labels"]["kubernetes.io/service-name"] == "web"
        assert s["metadata"]["name"].startswith("web-")
        assert [e["addresses"] for e in s["endpoints"]] == [[lab.pod_ip("web-1", family)]]
    assert slices["IPv4"]["metadata"]["name"] != slices["IPv6"]["metadata"]["name"]
    # kpx's own parser reads the file: both InternalIPs of each node, both ClusterIPs,
    # and the IPv6 slice with the pod's IPv6 address.
    snap = k8s.parse_file(lab.state_path)
    for n in snap.nodes:
        assert n.ips_of(4) == (lab.node_ip(n.name),)
        assert n.ips_of(6) == (lab.node_ip(n.name, 6),)
    [service] = snap.services
    assert tuple(service.cluster_ips) == (v4, v6)
    assert tuple(service.ip_families) == ("IPv4", "IPv6")
    by_type = {sl.address_type: sl for sl in snap.slices}
    assert [e.address for e in by_type["IPv6"].endpoints] == [lab.pod_ip("web-1", 6)]
    assert [e.address for e in by_type["IPv4"].endpoints] == [lab.pod_ip("web-1")]


def test_the_lb_checks_and_forwards_ipv6(lab_factory: Callable[..., Lab]) -> None:
    """The LB's IPv6 front: probes each node's IPv6 hc port, forwards to its IPv6 nodePort.

    No kpx: an echo server in node1 stands in for whatever serves there, on
    IPv6 only (so only the IPv6 half can pass), for both the health check
    (any path answers 200) and the nodePort. node2 and node3 serve nothing.
    """
    spec = LabSpec.default(dual_stack=True).to_dict()
    lab = lab_factory(spec, start_proxies=False, start_lb=False)
    hc, np = lab.hc_port("default/web"), lab.node_port("default/web")
    for port in (hc, np):
        lab.spawn("node1", [sys.executable, "-m", "lab.echo", "--name", f"stand-in-{port}",
                            "--node", "node1", "--bind", "::", "--port", str(port)],
                  f"standin{port}")
    for port in (hc, np):
        wait_until(lambda p=port: can_connect(lab.ns("node1"), lab.node_ip("node1", 6), p),
                   5.0, what=f"the stand-in on node1 [::]:{port}")
    lab._start_lb()
    six = {r["name"]: r for r in lb_control.status(lab.run_dir, 6)}
    four = {r["name"]: r for r in lb_control.status(lab.run_dir, 4)}
    assert {n: r["ip"] for n, r in six.items()} == {n: lab.node_ip(n, 6) for n in lab.nodes}
    assert six["node1"]["healthy"] and six["node1"]["result"] == "HTTP 200"
    assert not six["node2"]["healthy"] and not six["node3"]["healthy"]
    assert not any(r["healthy"] for r in four.values())  # nothing serves IPv4 there
    front, port = lab.lb_address(6)
    assert front == lab.lb_front_ip(6) == "fd00:79::1"
    before = lb_control.connection_counts(lab, 6)
    for _ in range(3):
        reply = lab.request("client", front, port)
        assert reply["node"] == "node1" and peer_ip(reply) == lab.client_ip(6)
    after = lb_control.connection_counts(lab, 6)
    assert after["node1"] - before["node1"] == 3


def test_default_lab_stays_ipv4_only(lab_factory: Callable[..., Lab]) -> None:
    lab = lab_factory(None, **NO_KPX)
    assert not lab.dual_stack
    with pytest.raises(ValueError, match="IPv4-only"):
        lab.node_ip("node1", 6)
    with pytest.raises(ValueError, match="IPv4-only"):
        lab.client_ip(6)
    with pytest.raises(ValueError, match="IPv4-only"):
        lab.pod_ip("web-1", 6)
    addrs = lab.run("node1", ["ip", "-6", "-o", "addr", "show", "scope", "global"]).stdout
    assert addrs.strip() == ""
    spec = lab.service("default/web")["spec"]
    assert spec["ipFamilies"] == ["IPv4"] and spec["ipFamilyPolicy"] == "SingleStack"


def test_no_address_is_tentative_once_up(lab_factory: Callable[..., Lab]) -> None:
    """nodad and accept_dad=0: an IPv6 address is usable the moment ``up`` returns.

    With duplicate address detection the kernel keeps a new address
    "tentative" for about a second (unusable as a source), which a lab that
    starts in a fraction of that would race.
    """
    lab = lab_factory(two_pod_spec(), dual_stack=True, **NO_KPX)
    for name in ["client", "lb", *lab.nodes, *lab.pods]:
        out = lab.run(name, ["ip", "-6", "-o", "addr", "show", "tentative"]).stdout
        assert out.strip() == "", (name, out)
        assert lab.run(name, ["ip", "-6", "-o", "addr", "show", "scope", "global"]).stdout


def test_teardown_leaves_no_namespace(lab_factory: Callable[..., Lab]) -> None:
    from lab import netns

    lab = lab_factory(two_pod_spec(), dual_stack=True, **NO_KPX)
    mine = [n for n in netns.list_namespaces() if n.startswith(lab.prefix + "-")]
    assert len(mine) == 3 + 3 + 2  # sw, lb, client, three nodes, two pods
    lab.down()
    assert [n for n in netns.list_namespaces() if n.startswith(lab.prefix + "-")] == []


def test_apply_keeps_the_lab_dual_stack_and_its_ipv6_cluster_ip(
        lab_factory: Callable[..., Lab]) -> None:
    lab = lab_factory(two_pod_spec(), dual_stack=True, **NO_KPX)
    before = lab.service("default/a")["spec"]["clusterIPs"]
    raw = two_pod_spec()  # says nothing about dualStack: the running lab's families stay
    raw["pods"].append({"name": "a-3", "node": "node3", "labels": {"app": "a"}})
    lab.apply(raw)
    assert lab.dual_stack and lab.service("default/a")["spec"]["clusterIPs"] == before
    assert peer_ip(lab.request("a-3", lab.pod_ip("a-1", 6), 8080)) == lab.pod_ip("a-3", 6)


# --- the lab file's IP families (no namespaces) ----------------------------------------


def _svc(name: str, **spec: Any) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name},
            "spec": {"selector": {"app": name}, "ports": [{"port": 80}], **spec}}


def _problems(*services: dict[str, Any], dual: bool) -> list[str]:
    raw: dict[str, Any] = {"nodes": 1, "services": list(services)}
    if dual:
        raw["cluster"] = {"dualStack": True}
    with pytest.raises(LabSpecError) as err:
        LabSpec.from_dict(raw)
    return err.value.problems


def test_ipv6_in_an_ipv4_lab_is_refused_naming_service_and_field() -> None:
    assert _problems(
        _svc("a", ipFamilies=["IPv6"]),
        _svc("b", ipFamilyPolicy="RequireDualStack"),
        _svc("c", clusterIP="fd00:10:96::20"),
        dual=False,
    ) == [
        "Service default/a: spec.ipFamilies: IPv6 needs a dual-stack lab (cluster.dualStack:"
        " true, or kpx lab up --dual-stack)",
        "Service default/b: spec.ipFamilyPolicy: RequireDualStack needs a dual-stack lab"
        " (cluster.dualStack: true, or kpx lab up --dual-stack)",
        "Service default/c: spec.clusterIP: fd00:10:96::20 is IPv6, and this lab is IPv4-only"
        " (cluster.dualStack: true, or kpx lab up --dual-stack)",
    ]


def test_family_rules_in_a_dual_stack_lab() -> None:
    assert _problems(
        _svc("a", ipFamilyPolicy="DualStackPlease"),
        _svc("b", ipFamilies=["IPv4", "IPv4"], ipFamilyPolicy="PreferDualStack"),
        _svc("c", ipFamilies=["IPv4", "IPv6"]),
        _svc("d", clusterIPs=["10.96.0.20", "10.96.0.21"], ipFamilyPolicy="PreferDualStack"),
        _svc("e", clusterIPs=["10.96.0.22", "fd00:10:96::22"], ipFamilyPolicy="SingleStack"),
        _svc("f", ipFamilies=["IPv6", "IPv4"], ipFamilyPolicy="RequireDualStack",
             clusterIPs=["10.96.0.23", "fd00:10:96::23"]),
        _svc("g", clusterIPs=["10.96.0.24", "fd00:99::1"], ipFamilyPolicy="PreferDualStack"),
        _svc("h", type="ExternalName", externalName="x.example", ipFamilies=["IPv4"]),
        dual=True,
    ) == [
        "Service default/a: spec.ipFamilyPolicy: must be one of SingleStack, PreferDualStack,"
        " RequireDualStack, got 'DualStackPlease'",
        "Service default/b: spec.ipFamilies: IPv4 is listed twice",
        "Service default/c: spec.ipFamilyPolicy: two ipFamilies need PreferDualStack or"
        " RequireDualStack, not the default SingleStack",
        "Service default/d: spec.clusterIPs: two addresses must be of different families"
        " (one IPv4, one IPv6)",
        "Service default/e: spec.clusterIPs: two addresses need PreferDualStack or"
        " RequireDualStack, not SingleStack",
        "Service default/f: spec.clusterIPs[0]: 10.96.0.23 is not IPv6, the family"
        " spec.ipFamilies[0] names",
        "Service default/f: spec.clusterIPs[1]: fd00:10:96::23 is not IPv4, the family"
        " spec.ipFamilies[1] names",
        "Service default/g: spec.clusterIPs[1]: fd00:99::1 is not in the lab's IPv6 service"
        " CIDR fd00:10:96::/112",
        "Service default/h: spec.ipFamilies: not for ExternalName services",
    ]


def test_dual_stack_flag_is_checked() -> None:
    with pytest.raises(LabSpecError) as err:
        LabSpec.from_dict({"nodes": 1, "cluster": {"dualStack": "yes"}})
    assert err.value.problems == ["cluster.dualStack: must be true or false, got 'yes'"]
    with pytest.raises(LabSpecError) as err:
        LabSpec.from_dict({"nodes": ["n1"], "cluster": {"dualStack": True,
                                                        "nodeIPs": {"n1": "192.168.49.2"}}})
    assert err.value.problems == [
        "cluster.dualStack: not with cluster.nodeIPs (a mirrored cluster's addresses are"
        " IPv4; the dual-stack plan is the lab's own)"]


def test_families_resolve_as_the_api_server_does() -> None:
    from lab.controller import resolve_services

    spec = LabSpec.from_dict({"nodes": 1, "cluster": {"dualStack": True}, "services": [
        _svc("plain"), _svc("single", ipFamilyPolicy="SingleStack"),
        _svc("six", ipFamilies=["IPv6"]),
        _svc("given", ipFamilyPolicy="PreferDualStack", clusterIPs=["fd00:10:96::77"]),
    ]})
    out = {service_key(s): s["spec"] for s in resolve_services(
        spec.services, None, spec.service_cidr, spec.dual_stack)}
    assert out["default/plain"]["ipFamilyPolicy"] == "PreferDualStack"
    assert out["default/plain"]["ipFamilies"] == ["IPv4", "IPv6"]
    assert out["default/single"]["ipFamilies"] == ["IPv4"]
    assert len(out["default/single"]["clusterIPs"]) == 1
    assert out["default/six"]["ipFamilies"] == ["IPv6"]
    assert ":" in out["default/six"]["clusterIP"]
    assert out["default/six"]["ipFamilyPolicy"] == "SingleStack"
    assert out["default/given"]["ipFamilies"] == ["IPv6", "IPv4"]
    assert out["default/given"]["clusterIPs"][0] == "fd00:10:96::77"
    assert "." in out["default/given"]["clusterIPs"][1]
