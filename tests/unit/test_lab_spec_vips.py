"""The lab as the API server for service VIPs: ClusterIPs, externalIPs, LB ingress (pure).

The lab allocates ClusterIPs from ``cluster.serviceCIDR``, keeps them across
applies and restarts, never hands out one a lab file gave, and refuses what
the API server would refuse with a message naming the service and field. Its
LB controller writes ``status.loadBalancer.ingress`` with the ipMode the lab
file asks for. These tests need no root: spec, controller and state file only.
"""

from __future__ import annotations

import ipaddress
from typing import Any

import pytest
import yaml

from lab.controller import (
    NodeInfo,
    endpoint_slices,
    load_balancer_status,
    resolve_services,
    state_documents,
)
from lab.spec import LabSpec, LabSpecError
from lab.statefile import render
from tests.support.labkit import service as svc

LB_FRONT = "10.79.0.1"


def lab_file(*services: dict[str, Any], cluster: dict[str, Any] | None = None,
             lb: dict[str, Any] | None = None, nodes: int = 3) -> dict[str, Any]:
    d: dict[str, Any] = {"nodes": nodes, "services": list(services)}
    if cluster is not None:
        d["cluster"] = cluster
    if lb is not None:
        d["loadBalancer"] = lb
    return d


def problems(data: dict[str, Any]) -> list[str]:
    with pytest.raises(LabSpecError) as err:
        LabSpec.from_dict(data)
    return err.value.problems


def cluster_ips(services: list[dict[str, Any]]) -> dict[str, str]:
    return {s["metadata"]["name"]: s["spec"]["clusterIP"] for s in services}


def resolved(*services: dict[str, Any], previous: dict[str, Any] | None = None,
             cidr: str = "10.96.0.0/16") -> list[dict[str, Any]]:
    """What the lab writes for *services*: validated, defaulted, allocated."""
    spec = LabSpec.from_dict(lab_file(*services, cluster={"serviceCIDR": cidr}))
    return resolve_services(spec.services, previous, spec.service_cidr)


# --------------------------------------------------------------------- allocation


class TestAllocation:
    def test_every_service_gets_a_cluster_ip_from_the_default_cidr(self) -> None:
        services = resolved(*(svc(f"s{i}", type=t) for i, t in
                              enumerate(("ClusterIP", "NodePort", "LoadBalancer") * 10)))
        ips = list(cluster_ips(services).values())
        assert len(set(ips)) == 30
        cidr = ipaddress.ip_network("10.96.0.0/16")
        for s in services:
            ip = ipaddress.ip_address(s["spec"]["clusterIP"])
            assert ip in cidr and int(ip) - int(cidr.network_address) >= 10
            assert ip != cidr.broadcast_address
            assert s["spec"]["clusterIPs"] == [str(ip)]

    def test_the_default_lab_keeps_its_address(self) -> None:
        """Derived from the service key alone: the same on every machine and every run."""
        spec = LabSpec.default()
        [web] = resolve_services(spec.services, None, spec.service_cidr)
        assert web["spec"]["clusterIP"] == "10.96.209.100"

    def test_stable_across_order_restarts_and_applies(self) -> None:
        a, b, c = svc("a"), svc("b", type="NodePort"), svc("c", type="LoadBalancer")
        first = resolved(a, b, c)
        # A restart (`kpx lab down; kpx lab up`) resolves afresh: same file, same IPs.
        assert cluster_ips(resolved(c, b, a)) == cluster_ips(first)
        # An apply that adds a service keeps everyone's IP (previous round given).
        prev = {f"default/{s['metadata']['name']}": s for s in first}
        again = resolved(a, b, c, svc("d"), previous=prev)
        assert {k: v for k, v in cluster_ips(again).items() if k != "d"} == cluster_ips(first)
        assert cluster_ips(again)["d"] not in cluster_ips(first).values()
        # Editing a service (iTP here) does not move its VIP either.
        edited = resolved(svc("a", internalTrafficPolicy="Local"), b, c, previous=prev)
        assert cluster_ips(edited) == cluster_ips(first)

    def test_an_allocation_never_takes_a_given_address(self) -> None:
        hashed = cluster_ips(resolved(svc("b")))["b"]
        # "a" asks for exactly the address "b" would be allocated by its hash.
        ips = cluster_ips(resolved(svc("a", clusterIP=hashed), svc("b")))
        assert ips["a"] == hashed
        assert ips["b"] != hashed

    def test_given_addresses_are_kept_and_clusterips_alone_is_enough(self) -> None:
        services = resolved(svc("a", clusterIP="10.96.0.10"),
                            svc("b", clusterIPs=["10.96.0.11"]),
                            svc("c", clusterIP="10.96.0.12", clusterIPs=["10.96.0.12"]))
        assert cluster_ips(services) == {"a": "10.96.0.10", "b": "10.96.0.11",
                                         "c": "10.96.0.12"}
        assert [s["spec"]["clusterIPs"] for s in services] == [
            ["10.96.0.10"], ["10.96.0.11"], ["10.96.0.12"]]

    def test_a_given_address_held_by_another_service_is_refused_on_apply(self) -> None:
        first = resolved(svc("a"))
        prev = {"default/a": first[0]}
        taken = first[0]["spec"]["clusterIP"]
        with pytest.raises(LabSpecError) as err:
            resolved(svc("a"), svc("b", clusterIP=taken), previous=prev)
        assert err.value.problems == [
            f"Service default/b: spec.clusterIP: {taken} is already allocated to default/a"]
        # Once "a" is gone (deleted in the same apply), its address is free to give.
        [b] = resolved(svc("b", clusterIP=taken), previous=prev)
        assert b["spec"]["clusterIP"] == taken

    def test_a_custom_service_cidr(self) -> None:
        services = resolved(*(svc(f"s{i}") for i in range(5)), cidr="10.100.7.0/24")
        for ip in cluster_ips(services).values():
            assert ipaddress.ip_address(ip) in ipaddress.ip_network("10.100.7.0/24")

    def test_a_full_service_cidr_is_an_error_naming_the_service(self) -> None:
        # A /28 has 16 addresses: offsets 10..14 are allocatable, five services fit.
        assert len(resolved(*(svc(f"s{i}") for i in range(5)), cidr="10.96.0.0/28")) == 5
        with pytest.raises(LabSpecError) as err:
            resolved(*(svc(f"s{i}") for i in range(6)), cidr="10.96.0.0/28")
        [message] = err.value.problems
        assert message.endswith(": spec.clusterIP: no free address left in the service CIDR"
                                " 10.96.0.0/28 (cluster.serviceCIDR)")
        assert message.startswith("Service default/s")

    def test_headless_and_external_name_get_no_address(self) -> None:
        headless, ext = resolved(svc("a", type="ClusterIP", clusterIP="None"),
                                 svc("b", type="ExternalName", externalName="x.example",
                                     ports=[]))
        assert headless["spec"]["clusterIPs"] == ["None"]
        assert "clusterIP" not in ext["spec"] and "clusterIPs" not in ext["spec"]


# --------------------------------------------------------------------- refusals


class TestRefusals:
    def test_cluster_ip_rules(self) -> None:
        assert problems(lab_file(
            svc("a", clusterIP="10.97.0.1"),
            svc("b", clusterIP="10.96.0.0"),
            svc("c", clusterIP="10.96.255.255"),
            svc("d", clusterIP="10.96.0.300"),
            svc("e", type="LoadBalancer", clusterIP="None"),
            svc("f", clusterIPs=["10.96.0.20", "fd00::20"]),
            svc("g", clusterIP="10.96.0.21", clusterIPs=["10.96.0.22"]),
        )) == [
            "Service default/a: spec.clusterIP: 10.97.0.1 is not in the service CIDR"
            " 10.96.0.0/16 (cluster.serviceCIDR)",
            "Service default/b: spec.clusterIP: 10.96.0.0 is the service CIDR's network address",
            "Service default/c: spec.clusterIP: 10.96.255.255 is the service CIDR's broadcast"
            " address",
            "Service default/d: spec.clusterIP: '10.96.0.300' is not an IPv4 address",
            "Service default/e: spec.clusterIP: None (headless) is only for ClusterIP services",
            "Service default/f: spec.clusterIPs: the lab is single-stack IPv4: at most one"
            " address",
            "Service default/g: spec.clusterIPs[0]: '10.96.0.22' must equal spec.clusterIP"
            " '10.96.0.21'",
        ]

    def test_a_duplicate_cluster_ip_names_both_services(self) -> None:
        assert problems(lab_file(svc("a", clusterIP="10.96.0.50"),
                                 svc("b", clusterIP="10.96.0.50"),
                                 svc("c", clusterIPs=["10.96.0.50"]))) == [
            "Service default/b: spec.clusterIP: 10.96.0.50 is already allocated to default/a",
            "Service default/c: spec.clusterIPs[0]: 10.96.0.50 is already allocated to"
            " default/a",
        ]

    def test_the_cidr_judges_given_addresses(self) -> None:
        ok = lab_file(svc("a", clusterIP="10.100.0.10"), cluster={"serviceCIDR": "10.100.0.0/16"})
        assert LabSpec.from_dict(ok).service_cidr == "10.100.0.0/16"
        assert problems(lab_file(svc("a", clusterIP="10.96.0.10"),
                                 cluster={"serviceCIDR": "10.100.0.0/16"})) == [
            "Service default/a: spec.clusterIP: 10.96.0.10 is not in the service CIDR"
            " 10.100.0.0/16 (cluster.serviceCIDR)"]

    @pytest.mark.parametrize(("cidr", "message"), [
        ("10.96.0.1/16", "'10.96.0.1/16' is not an IPv4 network (e.g. 10.96.0.0/16; host bits"
                         " must be zero)"),
        ("fd00::/108", "'fd00::/108' is not an IPv4 network (e.g. 10.96.0.0/16; host bits must"
                       " be zero)"),
        (16, "16 is not an IPv4 network (e.g. 10.96.0.0/16; host bits must be zero)"),
        ("10.0.0.0/8", "10.0.0.0/8 must be between /12 and /28"),
        ("10.96.0.0/30", "10.96.0.0/30 must be between /12 and /28"),
        ("10.77.0.0/16", "10.77.0.0/16 overlaps the lab's node network 10.77.0.0/24"),
        ("10.79.0.0/28", "10.79.0.0/28 overlaps the lab's client network 10.79.0.0/24"),
        ("10.244.128.0/20", "10.244.128.0/20 overlaps the lab's pod network 10.244.0.0/16"),
    ])
    def test_service_cidr_rules(self, cidr: Any, message: str) -> None:
        assert problems(lab_file(cluster={"serviceCIDR": cidr})) == [
            f"cluster.serviceCIDR: {message}"]

    def test_cluster_section_rules(self) -> None:
        assert problems(lab_file(
            svc("a", externalIPs=["203.0.113.10"]),
            cluster={"serviceCIDR": "10.96.0.0/16", "podCIDR": "x",
                     "externalIPRoutes": {"203.0.113.10": "node7", "nope": "node1",
                                          "203.0.113.99": "node2"}})) == [
            "cluster.podCIDR: unknown key (expected dualStack, externalIPRoutes, nodeFields,"
            " nodeIPs, podCIDRs, serviceCIDR)",
            "cluster.externalIPRoutes.203.0.113.10: unknown node 'node7' (nodes: node1, node2,"
            " node3)",
            "cluster.externalIPRoutes.nope: 'nope' is not an IPv4 address",
            "cluster.externalIPRoutes.203.0.113.99: no service lists this externalIP",
        ]
        assert problems({"cluster": ["10.96.0.0/16"]}) == [
            "cluster: must be a mapping (serviceCIDR, externalIPRoutes)"]

    def test_external_ip_rules(self) -> None:
        assert problems(lab_file(svc("a", externalIPs=[
            "203.0.113.10", "not-an-ip", "2001:db8::1", "127.0.0.1", "0.0.0.0", "224.0.0.5",
            "169.254.1.1", "10.77.0.11", "10.79.0.1", "10.244.1.11", "10.96.0.10",
            "203.0.113.10"]))) == [
            "Service default/a: spec.externalIPs[1]: 'not-an-ip' is not an IPv4 address",
            "Service default/a: spec.externalIPs[2]: '2001:db8::1' is not an IPv4 address",
            *(f"Service default/a: spec.externalIPs[{i}]: {ip} is not a unicast address the"
              " API server accepts"
              for i, ip in ((3, "127.0.0.1"), (4, "0.0.0.0"), (5, "224.0.0.5"),
                            (6, "169.254.1.1"))),
            *(f"Service default/a: spec.externalIPs[{i}]: {ip} is inside the lab's {what};"
              " pick an address outside the lab's networks (e.g. 203.0.113.10)"
              for i, ip, what in ((7, "10.77.0.11", "node network 10.77.0.0/24"),
                                  (8, "10.79.0.1", "client network 10.79.0.0/24"),
                                  (9, "10.244.1.11", "pod network 10.244.0.0/16"),
                                  (10, "10.96.0.10", "service CIDR 10.96.0.0/16"))),
            "Service default/a: spec.externalIPs[11]: duplicate externalIP 203.0.113.10",
        ]
        assert problems(lab_file(svc("a", externalIPs="203.0.113.10"))) == [
            "Service default/a: spec.externalIPs: must be a list of IPv4 addresses"]

    def test_ip_mode_and_status_rules(self) -> None:
        web = svc("web", type="LoadBalancer")
        assert problems(lab_file(web, lb={"service": "web", "ipMode": "vip"})) == [
            "loadBalancer.ipMode: must be VIP or Proxy, got 'vip'"]
        assert problems(lab_file(web, lb={"service": "web", "ipMode": None})) == [
            "loadBalancer.ipMode: must be VIP or Proxy, got None"]
        with_status = {**web, "status": {"loadBalancer": {"ingress": [{"ipMode": "Proxy"}]}}}
        assert problems(lab_file(with_status)) == [
            "Service default/web: status: written by the lab, not the lab file (the ingress"
            " ipMode is loadBalancer.ipMode)"]


# --------------------------------------------------------------------- the spec's own form


class TestSpecFields:
    def test_defaults(self) -> None:
        spec = LabSpec.from_dict(lab_file(svc("web", type="LoadBalancer", externalIPs=[
            "203.0.113.10"]), lb={"service": "web"}))
        assert spec.service_cidr == "10.96.0.0/16"
        assert spec.lb_ip_mode == "VIP"
        assert spec.external_ip_node("203.0.113.10") == "node1"
        assert "cluster" not in spec.to_dict()

    def test_round_trip(self) -> None:
        spec = LabSpec.from_dict(lab_file(
            svc("web", type="LoadBalancer", externalIPs=["203.0.113.10", "198.51.100.7"]),
            cluster={"serviceCIDR": "10.100.0.0/20",
                     "externalIPRoutes": {"198.51.100.7": "node3"}},
            lb={"service": "web", "ipMode": "Proxy"}))
        assert spec.lb_ip_mode == "Proxy"
        assert spec.external_ip_node("198.51.100.7") == "node3"
        assert spec.external_ip_node("203.0.113.10") == "node1"
        assert spec.to_dict()["cluster"] == {"serviceCIDR": "10.100.0.0/20",
                                             "externalIPRoutes": {"198.51.100.7": "node3"}}
        assert LabSpec.from_dict(spec.to_dict()) == spec
        # A running lab's own edits may drop the service a route names (then unused).
        edited = spec.revalidated(services=())
        assert edited.external_ip_routes == {"198.51.100.7": "node3"}


# --------------------------------------------------------------------- status and state file


def test_only_the_fronted_load_balancer_gets_the_ingress() -> None:
    services = resolved(svc("web", type="LoadBalancer"), svc("other", type="LoadBalancer"),
                        svc("plain"))
    out = {s["metadata"]["name"]: s for s in
           load_balancer_status(services, "default/web", LB_FRONT, "Proxy")}
    assert out["web"]["status"] == {"loadBalancer": {"ingress": [{"ip": LB_FRONT,
                                                                  "ipMode": "Proxy"}]}}
    assert out["other"]["status"] == {"loadBalancer": {}}, "pending: no LB for it"
    assert "status" not in out["plain"]
    # No loadBalancer section: every LoadBalancer service is pending.
    assert all(s.get("status", {}).get("loadBalancer") == {}
               for s in load_balancer_status(services, None, LB_FRONT)
               if s["spec"]["type"] == "LoadBalancer")


def test_the_state_file_carries_every_vip() -> None:
    """The Service documents kpx reads: clusterIP(s), externalIPs, ingress with its ipMode."""
    spec = LabSpec.from_dict(lab_file(
        svc("web", type="LoadBalancer", etp="Local", externalIPs=["203.0.113.10"],
            internalTrafficPolicy="Local"),
        svc("api", clusterIP="10.96.0.50"),
        lb={"service": "web", "ipMode": "Proxy"}))
    services = load_balancer_status(
        resolve_services(spec.services, None, spec.service_cidr), spec.lb_service_key,
        LB_FRONT, spec.lb_ip_mode)
    nodes = [NodeInfo("node1", "10.77.0.11", "10.244.1.0/24")]
    text = render(state_documents(nodes, services, endpoint_slices(services, [])))
    docs = {d["metadata"]["name"]: d for d in yaml.safe_load_all(text) if d["kind"] == "Service"}
    web, api = docs["web"], docs["api"]
    assert web["spec"]["clusterIP"] == "10.96.209.100"
    assert web["spec"]["clusterIPs"] == ["10.96.209.100"]
    assert web["spec"]["externalIPs"] == ["203.0.113.10"]
    assert web["spec"]["internalTrafficPolicy"] == "Local"
    assert web["status"] == {"loadBalancer": {"ingress": [{"ip": LB_FRONT, "ipMode": "Proxy"}]}}
    assert (api["spec"]["clusterIP"], api["spec"]["clusterIPs"]) == ("10.96.0.50",
                                                                     ["10.96.0.50"])
    assert "status" not in api

    # And kpx accepts it as it is (its own parser).
    k8s = pytest.importorskip("proxy.k8s")
    snap = k8s.parse_state(text)
    by_name = {s.name: s for s in snap.services}
    assert by_name["web"].cluster_ip == "10.96.209.100"
    assert tuple(by_name["web"].external_ips) == ("203.0.113.10",)
