"""``lab.mirror``: a cluster's state file as a lab file (pure; no namespace is made).

The kubectl-style fixtures in ``fixtures/`` are real-shaped dumps: an EKS
cluster (long node names, pods in the nodes' VPC subnets, no podCIDR) and a
kubeadm one (podCIDRs, a terminating endpoint, IPv6, ExternalName, another
proxy's service). Synthetic clusters from ``tests.support.objects`` check the
caps, the left-out report and the errors.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from lab.controller import PodState, endpoint_slices, resolve_services
from lab.mirror import MirrorError, flatten, load_documents, translate
from lab.spec import LabSpec, LabSpecError
from proxy.k8s import parse_state
from tests.support.objects import endpoint, endpoint_slice, node, service

FIXTURES = Path(__file__).parent / "fixtures"
EKS = FIXTURES / "kubectl_eks.yaml"
KUBEADM = FIXTURES / "kubectl_list.yaml"
N1, N2, N3 = (f"ip-10-0-{i}.ec2.internal" for i in ("1-23", "2-41", "3-17"))


def left(mirror: Any) -> list[str]:
    return [str(x) for x in mirror.left_out]


def pods(spec: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {p["ip"]: p for p in spec["pods"]}


# ----------------------------------------------------------- the kubectl-style fixtures


def test_kubectl_eks_fixture_is_a_state_file_kpx_accepts() -> None:
    snap = parse_state(EKS.read_text())
    assert {n.name for n in snap.nodes} == {N1, N2, N3}
    keys = {f"{s.namespace}/{s.name}" for s in snap.services}
    assert keys == {"default/kubernetes", "kube-system/kube-dns", "shop/web", "shop/api",
                    "shop/cart"}  # the headless shop/db is not proxied
    web = snap.service("shop/web")
    assert web is not None
    assert (web.type, web.external_traffic_policy, web.health_check_node_port) == (
        "LoadBalancer", "Local", 32111)


def test_eks_nodes_keep_their_names_and_internal_ips() -> None:
    spec = translate(load_documents(EKS)).spec
    assert spec["nodes"] == [N1, N2, N3]
    assert spec["cluster"]["nodeIPs"] == {N1: "10.0.1.23", N2: "10.0.2.41", N3: "10.0.3.17"}
    # No podCIDR on EKS: each node routes exactly the addresses of its pods.
    assert {n: sorted(c) for n, c in spec["cluster"]["podCIDRs"].items()} == {
        N1: ["10.0.1.101/32", "10.0.1.57/32"], N2: ["10.0.2.88/32"],
        N3: ["10.0.3.140/32", "10.0.3.62/32", "10.0.3.77/32"]}
    assert spec["cluster"]["serviceCIDR"] == "10.100.0.0/16"
    # What kpx reads of a Node besides its address: its labels, and that the
    # autoscaler is scaling the third one down (its /healthz must fail).
    fields = spec["cluster"]["nodeFields"]
    assert fields[N1]["labels"]["topology.kubernetes.io/zone"] == "us-east-1a"
    assert fields[N3]["taints"] == [{"key": "ToBeDeletedByClusterAutoscaler",
                                     "effect": "NoSchedule"}]
    assert "taints" not in fields[N1] and "deletionTimestamp" not in fields[N1]
    kubeadm = translate(load_documents(KUBEADM)).spec["cluster"]["nodeFields"]
    assert kubeadm["node-b"]["deletionTimestamp"] == "2024-05-02T11:00:00Z"


def test_eks_one_pod_per_endpoint_address_on_its_node() -> None:
    got = pods(translate(load_documents(EKS)).spec)
    assert {ip: (p["name"], p["node"], p.get("namespace", "default"), p["port"],
                 p.get("portName"), p.get("ready", True), p["labels"])
            for ip, p in got.items()} == {
        "10.0.1.57": ("web-6d9f7c8b5-lq2vx", N1, "shop", 8080, "http", True, {"app": "web"}),
        "10.0.3.62": ("web-6d9f7c8b5-zt8rn", N3, "shop", 8080, "http", False, {"app": "web"}),
        "10.0.1.101": ("coredns-54d6f577c6-7xk2p", N1, "kube-system", 53, None, True,
                       {"k8s-app": "kube-dns"}),
        "10.0.3.140": ("coredns-54d6f577c6-q9w4m", N3, "kube-system", 53, None, True,
                       {"k8s-app": "kube-dns"}),
        "10.0.2.88": ("api-7b8c9d6f4-m3n5p", N2, "shop", 9090, None, True, {"app": "api"}),
        "10.0.3.77": ("cart-5f6a7b8c9-k2j4h", N3, "shop", 8080, None, True, {"app": "cart"}),
    }


def test_eks_services_are_kept_as_they_are_and_the_lb_fronts_the_first_lb_service() -> None:
    mirror = translate(load_documents(EKS))
    spec = mirror.spec
    given = {f"{o['metadata']['namespace']}/{o['metadata']['name']}": o
             for o in yaml.safe_load(EKS.read_text())["items"] if o["kind"] == "Service"}
    mine = {f"{s['metadata']['namespace']}/{s['metadata']['name']}": s
            for s in spec["services"]}
    assert set(mine) == set(given) - {"shop/db"}
    for key, svc in mine.items():
        assert svc["spec"] == given[key]["spec"], key
        assert "status" not in svc  # the lab writes status (its LB's ingress)
        assert "managedFields" not in svc["metadata"]
    assert mine["shop/web"]["metadata"]["annotations"] == {
        "service.beta.kubernetes.io/aws-load-balancer-type": "nlb"}
    assert spec["loadBalancer"] == {"service": "shop/web"}
    assert left(mirror) == [
        "Service shop/db: headless (clusterIP None): kube-proxy does not proxy it",
        "Service default/kubernetes: no selector: its endpoints are hand-made, and the lab's"
        " endpoints come from selectors; it has none in the lab",
        "Service shop/web: status.loadBalancer.ingress"
        " a5d4c3b21f0e4d9c-0123456789.elb.us-east-1.amazonaws.com: the lab's LB front stands"
        " in for it",
    ]


def test_the_lab_publishes_the_clusters_endpoints() -> None:
    """The lab's own EndpointSlice controller, fed the mirrored pods, says what the cluster said."""
    spec = LabSpec.from_dict(translate(load_documents(EKS)).spec)
    services = resolve_services(spec.services, None, spec.service_cidr)
    states = [PodState(p.name, p.node, p.ip or "", p.labels, p.port, p.port_name, p.ready,
                       namespace=p.namespace) for p in spec.pods]
    lab = {(s["metadata"]["namespace"], s["metadata"]["labels"]["kubernetes.io/service-name"],
            e["addresses"][0], e["nodeName"], e["conditions"]["ready"],
            tuple((p["name"], p["port"]) for p in s["ports"]))
           for s in endpoint_slices(services, states) for e in s["endpoints"]}
    cluster = {(o["metadata"]["namespace"], o["metadata"]["labels"]["kubernetes.io/service-name"],
                e["addresses"][0], e["nodeName"], e["conditions"]["ready"],
                tuple(sorted((p["name"], p["port"]) for p in o["ports"])))
               for o in yaml.safe_load(EKS.read_text())["items"]
               if o["kind"] == "EndpointSlice" and "nodeName" in o["endpoints"][0]
               and "service.kubernetes.io/headless" not in o["metadata"]["labels"]
               for e in o["endpoints"]}
    lab = {(*x[:5], tuple(sorted(x[5]))) for x in lab}
    assert lab == cluster


def test_kubeadm_fixture_pod_cidrs_and_what_is_left_out() -> None:
    mirror = translate(load_documents(KUBEADM))
    spec = mirror.spec
    assert spec["cluster"]["podCIDRs"] == {"node-a": ["10.244.0.0/24"],
                                           "node-b": ["10.244.1.0/24"]}
    assert set(pods(spec)) == {"10.244.0.5", "10.244.0.9"}
    text = "\n".join(left(mirror))
    assert "Pod shop/web-7c5d8-fghij (10.244.1.7): terminating" in text
    assert "Service shop/legacy: ExternalName" in text
    assert "Service shop/mesh: labelled service.kubernetes.io/service-proxy-name" in text
    assert "EndpointSlice shop/web-v6-abcde: addressType IPv6" in text
    assert "Service shop/db: headless" in text
    assert "1 object(s) of kind Pod: kube-proxy does not watch this kind" in text
    LabSpec.from_dict(spec)


def test_the_translated_lab_file_round_trips() -> None:
    spec = LabSpec.from_dict(translate(load_documents(EKS)).spec)
    assert LabSpec.from_dict(spec.to_dict()) == spec
    assert spec.pod("web-6d9f7c8b5-lq2vx") is not None
    assert spec.node_ips[N1] == "10.0.1.23"


# ----------------------------------------------------------- caps and the left-out report


def cluster(n_nodes: int = 3, per_node: int = 2) -> list[dict[str, Any]]:
    """Nodes n1..nN at 192.168.0.N with podCIDR 10.1.N.0/24; an LB service with
    ``per_node`` pods on every node, and one ClusterIP service (first in the file)."""
    objs: list[dict[str, Any]] = []
    for i in range(1, n_nodes + 1):
        n = node(f"n{i}", f"192.168.0.{i}")
        n["spec"] = {"podCIDR": f"10.1.{i}.0/24"}
        objs.append(n)
    objs.append(service("other", None, 8080, type="ClusterIP", cluster_ip="10.96.0.20",
                        selector={"app": "other"}))
    objs.append(service("web", 30080, 8080, type="LoadBalancer", etp="Local", hc_port=32000,
                        cluster_ip="10.96.0.10", selector={"app": "web"}))
    objs.append(endpoint_slice("other", endpoint("10.1.1.99", "n1", pod="other-1"),
                               name="other-abc"))
    objs.append(endpoint_slice("web", *(endpoint(f"10.1.{i}.{10 + k}", f"n{i}",
                                                 pod=f"web-{i}-{k}")
                                        for i in range(1, n_nodes + 1)
                                        for k in range(per_node))))
    return objs


def test_node_cap_leaves_out_the_nodes_and_their_pods() -> None:
    mirror = translate(cluster(), max_nodes=2)
    assert mirror.spec["nodes"] == ["n1", "n2"]
    assert {p["node"] for p in mirror.spec["pods"]} == {"n1", "n2"}
    assert left(mirror) == [
        "Node n3: over the cap of 2 nodes (--max-nodes)",
        "Pod default/web-3-0 (10.1.3.10): on node n3, which is not in the lab",
        "Pod default/web-3-1 (10.1.3.11): on node n3, which is not in the lab",
    ]
    LabSpec.from_dict(mirror.spec)


def test_pod_cap_keeps_the_lb_services_pods_first() -> None:
    mirror = translate(cluster(), max_pods=3)
    assert [p["name"] for p in mirror.spec["pods"]] == ["web-1-0", "web-1-1", "web-2-0"]
    assert left(mirror) == [
        f"Pod default/{name} ({ip}): over the cap of 3 pods (--max-pods)"
        for name, ip in [("web-2-1", "10.1.2.11"), ("web-3-0", "10.1.3.10"),
                         ("web-3-1", "10.1.3.11"), ("other-1", "10.1.1.99")]]
    assert mirror.summary() == ("3 nodes, 3 pods, 2 services, the lab's LB in front of"
                                " default/web")


def test_endpoints_the_lab_cannot_host_are_said() -> None:
    objs = cluster(2, 0)
    objs.append(endpoint_slice("web", endpoint("10.1.1.50", None, pod="nowhere"),
                               endpoint("192.168.0.2", "n2", pod="hostnet"),
                               endpoint("10.1.2.60", "n1", pod="liar"),
                               endpoint("10.1.1.61", "ghost", pod="gone"),
                               name="web-def"))
    mirror = translate(objs)
    assert mirror.spec["pods"] == [{"name": "other-1", "node": "n1", "ip": "10.1.1.99",
                                    "labels": {"app": "other"}, "port": 8080}]
    assert left(mirror) == [
        "Pod default/nowhere (10.1.1.50): no nodeName: no node to put it on",
        "Pod default/hostnet (192.168.0.2): node n2's own address (a hostNetwork pod): a lab"
        " pod has a namespace and an address of its own",
        "Pod default/liar (10.1.2.60): inside node n2's podCIDR, but its nodeName is n1",
        "Pod default/gone (10.1.1.61): on node ghost, which is not in the lab",
    ]


def test_pods_outside_the_pod_cidr_get_a_host_route() -> None:
    objs = cluster(1, 0)
    objs.append(endpoint_slice("web", endpoint("172.16.5.5", "n1", pod="vpc"), name="web-x"))
    spec = translate(objs).spec
    assert spec["cluster"]["podCIDRs"] == {"n1": ["10.1.1.0/24", "172.16.5.5/32"]}
    LabSpec.from_dict(spec)


def test_a_pod_behind_two_services_gets_both_selectors_and_one_port() -> None:
    objs = cluster(1, 0)
    objs.append(service("metrics", None, 9100, type="ClusterIP", cluster_ip="10.96.0.30",
                        selector={"tier": "web"}))
    objs.append(endpoint_slice("web", endpoint("10.1.1.5", "n1", pod="both"), name="web-x"))
    objs.append(endpoint_slice("metrics", endpoint("10.1.1.5", "n1", pod="both"), port=9100,
                               name="metrics-x"))
    mirror = translate(objs)
    both = pods(mirror.spec)["10.1.1.5"]
    assert both["labels"] == {"app": "web", "tier": "web"} and both["port"] == 8080
    assert ("Pod default/both (10.1.1.5): port 9100 for Service default/metrics: a lab pod"
            " listens on one port, 8080") in left(mirror)


def test_dual_stack_keeps_the_ipv4_family_and_says_so() -> None:
    objs = cluster(1, 0)
    objs[2]["spec"].update(clusterIPs=["10.96.0.10", "fd00::10"], ipFamilies=["IPv4", "IPv6"],
                           ipFamilyPolicy="PreferDualStack")
    mirror = translate(objs)
    web = next(s for s in mirror.spec["services"] if s["metadata"]["name"] == "web")
    assert web["spec"]["clusterIPs"] == ["10.96.0.10"]
    assert web["spec"]["ipFamilyPolicy"] == "SingleStack"
    assert ("Service default/web: its IPv6 family (clusterIPs fd00::10): a mirrored lab is"
            " IPv4 only; it keeps the IPv4 one") in left(mirror)


def test_nodes_the_lab_cannot_have() -> None:
    objs = [node("ok", "192.168.0.1"), node("no-ip"), node("lb", "192.168.0.3"),
            node("clash", "10.79.0.9"), node("twin", "192.168.0.1"),
            node("Upper", "192.168.0.6"), *cluster(0, 0)[0:2]]
    mirror = translate(objs)
    assert mirror.spec["nodes"] == ["ok"]
    assert left(mirror) == [
        "Node no-ip: no IPv4 InternalIP in status.addresses",
        "Node lb: its name is one the lab uses for itself",
        "Node clash: InternalIP 10.79.0.9 is inside the lab's client network 10.79.0.0/24",
        "Node twin: InternalIP 192.168.0.1 is also node ok's",
        "Node Upper: its name is not a DNS subdomain of at most 200 characters",
    ]


# ----------------------------------------------------------- bad input


@pytest.mark.parametrize(("mutate", "problem"), [
    (lambda o: o[1].__setitem__("spec", ["x"]), "Service default/other: spec: must be a mapping"),
    (lambda o: o[3]["endpoints"][0].__setitem__("addresses", ["10.1.1.999"]),
     "EndpointSlice default/other-abc: endpoints[0].addresses[0]: '10.1.1.999' is not an IPv4"
     " address"),
    (lambda o: o[3]["endpoints"][0].__setitem__("addresses", "10.1.1.9"),
     "EndpointSlice default/other-abc: endpoints[0].addresses: must be a non-empty list"),
    (lambda o: o[0]["status"].__setitem__("addresses", "192.168.0.1"),
     "Node n1: status: addresses: must be a list, got str"),
    (lambda o: o[0]["spec"].__setitem__("podCIDR", "10.1.1.1/24"),
     "Node n1: spec.podCIDRs[0]: '10.1.1.1/24' is not a network"),
    (lambda o: o[2]["metadata"].pop("name"), "Service #3: metadata.name: required"),
    (lambda o: o.append("text"), "object 6: must be a mapping"),
])
def test_bad_input_names_the_object_and_the_field(mutate: Any, problem: str) -> None:
    objs = cluster(1, 0)
    mutate(objs)
    with pytest.raises(MirrorError) as err:
        translate(objs)
    assert any(p.startswith(problem) for p in err.value.problems), err.value.problems


def test_bad_files(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("items: [\n")
    with pytest.raises(MirrorError, match="YAML syntax error"):
        load_documents(bad)
    with pytest.raises(MirrorError, match="cannot read"):
        load_documents(tmp_path / "missing.yaml")
    with pytest.raises(MirrorError, match="items: must be a list"):
        flatten([{"kind": "List", "items": "x"}])
    with pytest.raises(MirrorError, match="node cap"):
        translate([], max_nodes=0)


def test_multi_document_files_read_like_lists(tmp_path: Path) -> None:
    path = tmp_path / "state.yaml"
    path.write_text(yaml.safe_dump_all(cluster(2, 1)))
    assert translate(load_documents(path)).spec == translate(cluster(2, 1)).spec


# ----------------------------------------------------------- the lab file's given addresses


def given(**cluster_keys: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "nodes": ["a.example", "b"],
        "cluster": {"nodeIPs": {"a.example": "192.168.1.1", "b": "172.20.0.2"},
                    "podCIDRs": {"a.example": ["10.1.0.0/24"], "b": ["10.2.0.5/32"]}},
        "pods": [{"name": "p", "node": "b", "ip": "10.2.0.5"}],
    }
    spec["cluster"].update(cluster_keys)
    return spec


def test_node_fields_are_judged() -> None:
    spec = given(nodeFields={"b": {"taints": [{"key": "x"}], "color": "red"}, "c": {}})
    with pytest.raises(LabSpecError) as err:
        LabSpec.from_dict(spec)
    assert err.value.problems == [
        "cluster.nodeFields.b.color: unknown key (expected deletionTimestamp, labels, taints)",
        "cluster.nodeFields.b.taints[0]: needs a key (a label key) and an effect (NoSchedule,"
        " PreferNoSchedule, NoExecute)",
        "cluster.nodeFields.c: unknown node 'c' (nodes: a.example, b)",
    ]


def test_given_addresses_are_accepted() -> None:
    spec = LabSpec.from_dict(given())
    assert spec.nodes == ("a.example", "b")
    assert spec.pods[0].ip == "10.2.0.5"
    assert spec.pod_cidrs == {"a.example": ("10.1.0.0/24",), "b": ("10.2.0.5/32",)}


@pytest.mark.parametrize(("change", "problem"), [
    ({"nodeIPs": {"a.example": "192.168.1.1"}}, "cluster.nodeIPs: node b has no address"),
    ({"nodeIPs": {"a.example": "10.79.0.5", "b": "172.20.0.2"}},
     "cluster.nodeIPs.a.example: 10.79.0.5 is inside the lab's client network"),
    ({"nodeIPs": {"a.example": "172.20.0.2", "b": "172.20.0.2"}},
     "cluster.nodeIPs.b: 172.20.0.2 is also node a.example's address"),
    ({"podCIDRs": {"a.example": ["10.1.0.0/16"], "b": ["10.1.2.0/24"]}},
     "cluster.podCIDRs.b[0]: 10.1.2.0/24 overlaps a pod network of node a.example"),
    ({"podCIDRs": {"a.example": ["172.20.0.0/24"]}},
     "cluster.podCIDRs.a.example[0]: 172.20.0.0/24 holds node b's address"),
    ({"podCIDRs": {"a.example": ["10.1.0.0/24"], "b": ["10.3.0.0/24"]}},
     "pods[0] (p).ip: 10.2.0.5 is not in node b's cluster.podCIDRs (10.3.0.0/24)"),
])
def test_given_addresses_are_judged(change: dict[str, Any], problem: str) -> None:
    with pytest.raises(LabSpecError) as err:
        LabSpec.from_dict(given(**change))
    assert any(p.startswith(problem) for p in err.value.problems), err.value.problems


def test_pod_ips_only_with_node_ips() -> None:
    with pytest.raises(LabSpecError, match=r"pods\[0\] \(p\)\.ip: only in a lab with"):
        LabSpec.from_dict({"nodes": 1, "pods": [{"name": "p", "node": "node1",
                                                 "ip": "10.244.1.5"}]})
    spec = given()
    del spec["pods"][0]["ip"]
    with pytest.raises(LabSpecError, match=r"pods\[0\] \(p\)\.ip: required"):
        LabSpec.from_dict(spec)
