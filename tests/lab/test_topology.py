"""The lab itself: its network, its echo pods, its endpoints controller, its cleanup.

Pure tests (controller, spec, state file) run anywhere; the rest are marked
``lab`` and need root. None of them needs ``kpx node``: they prove the lab is
a faithful stage before any proxy stands on it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from lab import Lab, LabSpec, LabSpecError, netns, topology
from lab.cluster import LAB_JSON, teardown_by_name
from lab.common import wait_until
from lab.controller import (
    TRIGGER_TIME_ANNOTATION,
    NodeInfo,
    PodState,
    endpoint_slices,
    resolve_services,
    slice_fingerprints,
    stamp_trigger_times,
    state_documents,
)
from lab.statefile import render, write_atomic
from tests.support.labkit import service as svc

log = logging.getLogger(__name__)

MiB = 1 << 20


def pod(name: str, node: str = "node1", ip: str = "10.244.1.11", **kw: Any) -> PodState:
    kw.setdefault("labels", {"app": "web"})
    return PodState(name=name, node=node, ip=ip, uid=f"uid-{name}", **kw)


def conditions(slices: list[dict[str, Any]]) -> dict[str, dict[str, bool]]:
    return {ep["targetRef"]["name"]: ep["conditions"] for s in slices for ep in s["endpoints"]}


# --------------------------------------------------------------------- controller


class TestEndpointSlices:
    def test_ready_pod(self) -> None:
        services = resolve_services([svc()])
        [s] = endpoint_slices(services, [pod("web-1")])
        assert s["apiVersion"] == "discovery.k8s.io/v1" and s["kind"] == "EndpointSlice"
        assert s["metadata"]["labels"]["kubernetes.io/service-name"] == "web"
        assert s["metadata"]["labels"]["endpointslice.kubernetes.io/managed-by"] == \
            "endpointslice-controller.k8s.io"
        assert s["metadata"]["ownerReferences"][0]["kind"] == "Service"
        assert s["addressType"] == "IPv4"
        [ep] = s["endpoints"]
        assert ep["addresses"] == ["10.244.1.11"]
        assert ep["nodeName"] == "node1"
        assert ep["targetRef"] == {"kind": "Pod", "namespace": "default", "name": "web-1",
                                   "uid": "uid-web-1"}
        assert ep["conditions"] == {"ready": True, "serving": True, "terminating": False}
        assert s["ports"] == [{"name": "", "port": 8080, "protocol": "TCP"}]

    def test_conditions_table(self) -> None:
        """podToEndpoint: serving = Ready, ready = publishNotReady or (serving, not terminating)."""
        pods = [pod("ready"), pod("unready", ready=False),
                pod("term", terminating=True), pod("term-unready", ready=False, terminating=True)]
        got = conditions(endpoint_slices(resolve_services([svc()]), pods))
        assert got == {
            "ready": {"ready": True, "serving": True, "terminating": False},
            "unready": {"ready": False, "serving": False, "terminating": False},
            "term": {"ready": False, "serving": True, "terminating": True},
            "term-unready": {"ready": False, "serving": False, "terminating": True},
        }
        pnra = resolve_services([svc(publishNotReadyAddresses=True)])
        got = conditions(endpoint_slices(pnra, pods))
        assert all(c["ready"] for c in got.values())
        assert got["term"] == {"ready": True, "serving": True, "terminating": True}
        assert got["unready"]["serving"] is False

    def test_selection(self) -> None:
        pods = [pod("a"), pod("b", labels={"app": "other"}),
                pod("c", namespace="prod"), pod("d", labels={"app": "web", "x": "y"})]
        names = set(conditions(endpoint_slices(resolve_services([svc()]), pods)))
        assert names == {"a", "d"}

    def test_placeholder_and_no_selector(self) -> None:
        no_selector = svc("bare")
        del no_selector["spec"]["selector"]
        external = {"apiVersion": "v1", "kind": "Service",
                    "metadata": {"name": "ext", "namespace": "default"},
                    "spec": {"type": "ExternalName", "externalName": "example.com"}}
        slices = endpoint_slices(resolve_services([svc(), no_selector, external]), [])
        assert [s["metadata"]["labels"]["kubernetes.io/service-name"] for s in slices] == ["web"]
        assert slices[0]["endpoints"] == [] and slices[0]["ports"] == []

    def test_named_target_port(self) -> None:
        services = resolve_services([svc(ports=[{"name": "http", "port": 80,
                                                 "targetPort": "web"}])])
        pods = [pod("named", port=9000, port_name="web"), pod("other", port=8080)]
        [s] = endpoint_slices(services, pods)
        assert s["ports"] == [{"name": "http", "port": 9000, "protocol": "TCP"}]
        assert [e["targetRef"]["name"] for e in s["endpoints"]] == ["named"]

    def test_pods_with_different_ports_get_different_slices(self) -> None:
        services = resolve_services([svc(ports=[{"name": "http", "port": 80,
                                                 "targetPort": "web"}])])
        pods = [pod("a", port=9000, port_name="web"), pod("b", port=9001, port_name="web")]
        slices = endpoint_slices(services, pods)
        assert sorted(s["ports"][0]["port"] for s in slices) == [9000, 9001]
        assert len({s["metadata"]["name"] for s in slices}) == 2

    def test_hundred_endpoints_per_slice(self) -> None:
        pods = [pod(f"p{i}", ip=f"10.244.1.{i}") for i in range(1, 151)]
        slices = endpoint_slices(resolve_services([svc()]), pods)
        assert sorted(len(s["endpoints"]) for s in slices) == [50, 100]

    def test_trigger_time(self) -> None:
        services = resolve_services([svc()])
        first = endpoint_slices(services, [pod("a")])
        fp1 = slice_fingerprints(first)
        t1 = stamp_trigger_times({}, {}, fp1, 1_700_000_000.25)
        assert t1 == {"default/web": "2023-11-14T22:13:20.250000Z"}
        # No change: the time stays. A change: it moves.
        assert stamp_trigger_times(fp1, t1, fp1, 1_700_000_100.0) == t1
        fp2 = slice_fingerprints(endpoint_slices(services, [pod("a", ready=False)]))
        assert stamp_trigger_times(fp1, t1, fp2, 1_700_000_100.0)["default/web"].startswith(
            "2023-11-14T22:15:00")
        [s] = endpoint_slices(services, [pod("a")], t1)
        assert s["metadata"]["annotations"][TRIGGER_TIME_ANNOTATION] == t1["default/web"]


class TestServiceResolution:
    def test_defaults(self) -> None:
        [s] = resolve_services([svc(type="LoadBalancer")])
        spec = s["spec"]
        assert spec["externalTrafficPolicy"] == "Cluster"
        assert spec["ports"][0]["protocol"] == "TCP"
        assert 30000 <= spec["ports"][0]["nodePort"] <= 32767
        assert "healthCheckNodePort" not in spec
        assert spec["clusterIP"].startswith("10.96.")
        assert s["metadata"]["uid"]

    def test_allocation_is_deterministic_and_distinct(self) -> None:
        services = [svc(f"s{i}", type="LoadBalancer", etp="Local") for i in range(30)]
        a = resolve_services(services)
        b = resolve_services(list(reversed(services)))
        assert a == b
        ports = [p["nodePort"] for s in a for p in s["spec"]["ports"]]
        ports += [s["spec"]["healthCheckNodePort"] for s in a]
        assert len(ports) == len(set(ports)) == 60
        assert all(30000 <= p <= 32767 for p in ports)

    def test_explicit_ports_are_kept_and_avoided(self) -> None:
        explicit = svc("a", type="NodePort", ports=[{"port": 80, "nodePort": 30080}])
        [a, b] = resolve_services([explicit, svc("b", type="NodePort")])
        assert a["spec"]["ports"][0]["nodePort"] == 30080
        assert b["spec"]["ports"][0]["nodePort"] != 30080

    def test_allocations_survive_updates(self) -> None:
        """patchAllocatedValues: an update that omits them keeps nodePorts (by name) and hc."""
        first = resolve_services([svc(type="LoadBalancer", etp="Local",
                                      ports=[{"name": "http", "port": 80}])])
        prev = {"default/web": first[0]}
        # A new service sorting first would take the port by hash if it were free.
        edited = svc(type="LoadBalancer", etp="Local", ports=[{"name": "http", "port": 81}])
        again = resolve_services([edited, svc("aaa", type="NodePort")], prev)
        web = next(s for s in again if s["metadata"]["name"] == "web")
        assert web["spec"]["ports"][0]["nodePort"] == first[0]["spec"]["ports"][0]["nodePort"]
        assert web["spec"]["healthCheckNodePort"] == first[0]["spec"]["healthCheckNodePort"]
        assert web["spec"]["clusterIP"] == first[0]["spec"]["clusterIP"]
        # Local -> Cluster drops the health check port; -> ClusterIP drops nodePorts.
        [cl] = resolve_services([svc(type="LoadBalancer", etp="Cluster")], prev)
        assert "healthCheckNodePort" not in cl["spec"]
        [cip] = resolve_services([svc(type="ClusterIP")], prev)
        assert "nodePort" not in cip["spec"]["ports"][0]

    def test_no_node_ports_when_lb_opts_out(self) -> None:
        [s] = resolve_services([svc(type="LoadBalancer", allocateLoadBalancerNodePorts=False)])
        assert "nodePort" not in s["spec"]["ports"][0]


def test_state_documents_parse_with_kpx() -> None:
    """What the lab writes is what kpx node reads: parse it with kpx's own parser."""
    k8s = pytest.importorskip("proxy.k8s")
    services = resolve_services([svc(type="LoadBalancer", etp="Local")])
    pods = [pod("a"), pod("b", node="node2", ip="10.244.2.11", terminating=True)]
    fps = slice_fingerprints(endpoint_slices(services, pods))
    slices = endpoint_slices(services, pods, stamp_trigger_times({}, {}, fps, time.time()))
    nodes = [NodeInfo("node1", "10.77.0.11", "10.244.1.0/24"),
             NodeInfo("node2", "10.77.0.12", "10.244.2.0/24")]
    snap = k8s.parse_state(render(state_documents(nodes, services, slices)))
    assert [n.internal_ips for n in snap.nodes] == [("10.77.0.11",), ("10.77.0.12",)]
    [service] = snap.services
    assert service.external_traffic_policy == "Local" and service.health_check_node_port
    [sl] = snap.slices
    assert {e.address: (e.ready, e.serving, e.terminating) for e in sl.endpoints} == {
        "10.244.1.11": (True, True, False), "10.244.2.11": (False, True, True)}
    assert sl.trigger_time is not None and abs(sl.trigger_time - time.time()) < 60


# --------------------------------------------------------------------- spec


class TestSpec:
    def test_default(self) -> None:
        spec = LabSpec.default()
        assert spec.nodes == ("node1", "node2", "node3")
        [p] = spec.pods
        assert p.node == "node1"
        [s] = spec.services
        assert s["spec"]["type"] == "LoadBalancer"
        assert s["spec"]["externalTrafficPolicy"] == "Local"
        assert spec.load_balancer is not None and spec.lb_service_key == "default/web"
        assert LabSpec.from_dict(spec.to_dict()) == spec

    def test_every_problem_is_reported(self) -> None:
        bad = {
            "nodes": ["node1", "node1", "lb"],
            "pods": [{"name": "Web", "node": "node9", "port": 0, "labels": {"app": 1}}],
            "services": [{"apiVersion": "v1", "kind": "Service", "metadata": {"name": "web"},
                          "spec": {"type": "Cluster", "ports": [{"port": 80,
                                                                 "nodePort": 1}]}}],
            "loadBalancer": {"service": "nope", "mode": "magic"},
            "extra": 1,
        }
        with pytest.raises(LabSpecError) as err:
            LabSpec.load(bad)
        text = "\n".join(err.value.problems)
        for needle in ("extra: unknown", "nodes[1]: duplicate", "nodes[2]: 'lb' is reserved",
                       "pods[0] (Web).name", "pods[0] (Web).node: unknown node 'node9'",
                       "pods[0] (Web).port", "labels.app: label values must be strings",
                       "Service default/web: spec.type", "loadBalancer.service: no service",
                       "loadBalancer.mode"):
            assert needle in text, f"{needle!r} not in:\n{text}"

    def test_service_rules(self) -> None:
        def problems(spec: dict[str, Any]) -> str:
            with pytest.raises(LabSpecError) as err:
                LabSpec.load({"nodes": 1, "services": [
                    {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "s"},
                     "spec": spec}]})
            return "\n".join(err.value.problems)

        assert "healthCheckNodePort: only for type LoadBalancer" in problems(
            {"type": "NodePort", "ports": [{"port": 1}], "healthCheckNodePort": 30001})
        assert "nodePort: must be in 30000-32767" in problems(
            {"type": "NodePort", "ports": [{"port": 1, "nodePort": 80}]})
        assert "name: required" in problems({"ports": [{"port": 1}, {"port": 2}]})
        assert "externalTrafficPolicy: only for NodePort" in problems(
            {"externalTrafficPolicy": "Local", "ports": [{"port": 1}]})

    def test_duplicate_node_ports(self) -> None:
        two = [svc("a", ports=[{"port": 80, "nodePort": 30080}]),
               svc("b", ports=[{"port": 80, "nodePort": 30080}])]
        with pytest.raises(LabSpecError, match="30080/TCP already used"):
            LabSpec.load({"nodes": 1, "services": two})

    def test_yaml_file(self, tmp_path: Path) -> None:
        f = tmp_path / "lab.yaml"
        f.write_text("nodes: [a, b]\npods: [{name: p, node: b, labels: {app: x}}]\n")
        spec = LabSpec.load(f)
        assert spec.nodes == ("a", "b") and spec.pods[0].port == 8080
        f.write_text("nodes: [\n")
        with pytest.raises(LabSpecError, match="YAML syntax error"):
            LabSpec.load(f)


# --------------------------------------------------------------------- state file


def test_state_file_is_replaced_atomically(tmp_path: Path) -> None:
    """A reader polling the path only ever sees a complete old or new file."""
    path = tmp_path / "state.yaml"
    versions = [("a" * 200_000 + "\n"), ("b" * 300_000 + "\n")]
    write_atomic(path, versions[0])
    seen: set[str] = set()
    stop = threading.Event()

    def reader() -> None:
        while not stop.is_set():
            seen.add(path.read_text())

    t = threading.Thread(target=reader)
    with open(path) as held:  # the first version, held open: its inode cannot be reused
        t.start()
        try:
            for i in range(1, 61):
                write_atomic(path, versions[i % 2])
        finally:
            stop.set()
            t.join()
        assert held.read() == versions[0], "replaced by rename, never rewritten in place"
        assert os.fstat(held.fileno()).st_ino != path.stat().st_ino
    assert seen <= set(versions)
    assert path.read_text() == versions[0]
    assert [p.name for p in tmp_path.iterdir()] == ["state.yaml"], "no temp files left"


# --------------------------------------------------------------------- the live lab


def _listen(lab: Lab, where: str, ip: str, port: int = 0) -> socket.socket:
    s = netns.socket_in(lab.ns(where))
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((ip, port))
    s.listen(8)
    s.settimeout(5)
    return s


def _spec_two_nodes() -> dict[str, Any]:
    return {
        "nodes": 3,
        "pods": [
            {"name": "web-1", "node": "node1", "labels": {"app": "web"}, "port": 8080},
            {"name": "web-2", "node": "node2", "labels": {"app": "web"}, "port": 8080},
        ],
        "services": [svc(type="LoadBalancer", etp="Local",
                         ports=[{"name": "http", "port": 80, "targetPort": 8080}])],
    }


@pytest.mark.lab
def test_up_is_fast_and_complete(lab_factory: Callable[..., Lab],
                                 one_pod_spec: Callable[..., dict[str, Any]],
                                 record_property: Callable[[str, object], None]) -> None:
    t0 = time.monotonic()
    lab = lab_factory(one_pod_spec(), start_proxies=False)
    elapsed = time.monotonic() - t0
    log.warning("lab up (3 nodes, 1 pod, no proxies): %.2fs (Lab.up_seconds %.2fs)", elapsed,
                lab.up_seconds)
    record_property("lab_up_seconds", round(elapsed, 3))
    assert elapsed < 10, f"up took {elapsed:.1f}s"
    expected = {lab.ns(n) for n in ("sw", "lb", "client", "node1", "node2", "node3", "web-1")}
    assert expected <= set(netns.list_namespaces())
    assert lab.nodes == ["node1", "node2", "node3"]
    assert [lab.node_ip(n) for n in lab.nodes] == ["10.77.0.11", "10.77.0.12", "10.77.0.13"]
    assert lab.pod_ip("web-1") == "10.244.1.11" and lab.client_ip == "10.79.0.100"
    for n in lab.nodes:
        assert netns.sysctl_get(lab.ns(n), "net.ipv4.ip_forward") == "1"
        assert netns.sysctl_get(lab.ns(n), "net.ipv4.conf.all.rp_filter") == "0"
        addrs = lab.run(n, ["ip", "-o", "-4", "addr"]).stdout
        assert "127.0.0.1/8" in addrs and f"{lab.node_ip(n)}/24" in addrs
        assert lab.run(n, ["ip", "-o", "link", "show", "lo", "up"]).stdout
    assert netns.sysctl_get(lab.ns("lb"), "net.ipv4.ip_forward") == "1"
    # The state file: Nodes with InternalIPs, the Service with allocations, the slice.
    docs = list(yaml.safe_load_all(lab.state_path.read_text()))
    kinds = [d["kind"] for d in docs]
    assert kinds == ["Node"] * 3 + ["Service", "EndpointSlice"]
    assert docs[0]["status"]["addresses"][0] == {"type": "InternalIP", "address": "10.77.0.11"}
    assert lab.node_port("default/web") == docs[3]["spec"]["ports"][0]["nodePort"]
    assert lab.hc_port("default/web") == docs[3]["spec"]["healthCheckNodePort"]
    assert json.loads((lab.run_dir / LAB_JSON).read_text())["status"] == "up"


@pytest.mark.lab
def test_client_reaches_nodes_through_the_lb_router(lab_factory: Callable[..., Lab],
                                                    one_pod_spec: Callable[..., Any]) -> None:
    """No NAT anywhere: the node sees the external client's own address."""
    lab = lab_factory(one_pod_spec(), start_proxies=False, start_lb=False)
    for node in lab.nodes:
        with _listen(lab, node, lab.node_ip(node)) as srv:
            port = srv.getsockname()[1]
            with lab.socket("client") as c:
                c.settimeout(3)
                c.connect((lab.node_ip(node), port))
                conn, peer = srv.accept()
                conn.close()
            assert peer[0] == lab.client_ip
    # The route really is through the lb namespace: its forwarding counter moved.
    trace = lab.run("client", ["ip", "route", "get", lab.node_ip("node2")]).stdout
    assert "via 10.79.0.1" in trace
    back = lab.run("node2", ["ip", "route", "get", lab.client_ip]).stdout
    assert "via 10.77.0.2" in back


@pytest.mark.lab
def test_pods_reach_each_other_across_nodes(lab_factory: Callable[..., Lab]) -> None:
    lab = lab_factory(_spec_two_nodes(), start_proxies=False)
    assert lab.pod_ip("web-2") == "10.244.2.11"
    reply = lab.request("web-1", lab.pod_ip("web-2"), 8080)
    assert reply["pod"] == "web-2" and reply["node"] == "node2"
    assert reply["peer"].split(":")[0] == lab.pod_ip("web-1"), "pod-to-pod is not NATed"
    # A node reaches a remote pod through the pod-CIDR route (source: its own IP).
    reply = lab.request("node3", lab.pod_ip("web-1"), 8080)
    assert reply["pod"] == "web-1" and reply["peer"].startswith("10.77.0.13:")


@pytest.mark.lab
def test_echo_modes(lab_factory: Callable[..., Lab],
                    one_pod_spec: Callable[..., Any]) -> None:
    lab = lab_factory(one_pod_spec(), start_proxies=False, start_lb=False)
    ip = lab.pod_ip("web-1")
    who = lab.request("node2", ip, 8080)
    assert who["pod"] == "web-1" and who["peer"].startswith("10.77.0.12:")
    http = lab.request("node2", ip, 8080, mode="HTTP")
    assert http["pod"] == "web-1" and http["path"] == "/"

    payload = os.urandom(4 * MiB)
    digest = hashlib.sha256(payload).hexdigest()
    sink = lab.request("node2", ip, 8080, mode="SINK", payload=payload, timeout=10)
    assert sink["bytes"] == len(payload) and sink["sha256"] == digest
    echo = lab.request("node2", ip, 8080, mode="ECHO", payload=payload, timeout=10)
    assert echo["bytes"] == len(payload) and echo["sha256"] == digest

    # curl works: agnhost-style /clientip and keep-alive (two requests, one connection).
    out = lab.run("node3", ["curl", "-s", "-m", "3", f"http://{ip}:8080/clientip",
                            f"http://{ip}:8080/hostname"])
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("10.77.0.13:") and out.stdout.endswith("web-1")
    assert out.stdout[len("10.77.0.13:"):-len("web-1")].isdigit()
    head = lab.run("node3", ["curl", "-sI", "-m", "3", f"http://{ip}:8080/"]).stdout
    assert "HTTP/1.1 200" in head and "Content-Length:" in head


@pytest.mark.lab
def test_echo_http_keepalive_and_proxy_headers(lab_factory: Callable[..., Lab],
                                               one_pod_spec: Callable[..., Any]) -> None:
    lab = lab_factory(one_pod_spec(), start_proxies=False, start_lb=False)
    ip = lab.pod_ip("web-1")
    with lab.socket("node1") as s:
        s.settimeout(3)
        s.connect((ip, 8080))
        for _ in range(2):
            s.sendall(b"GET /clientip HTTP/1.1\r\nHost: x\r\n\r\n")
            head = b""
            while b"\r\n\r\n" not in head:
                head += s.recv(4096)
            length = int(head.split(b"Content-Length: ")[1].split(b"\r\n")[0])
            body = head.split(b"\r\n\r\n", 1)[1]
            while len(body) < length:
                body += s.recv(4096)
            assert body.decode() == f"10.244.1.1:{s.getsockname()[1]}"
    v1 = b"PROXY TCP4 10.79.0.100 10.79.0.1 40000 80\r\nWHO\n"
    sig = b"\r\n\r\n\x00\r\nQUIT\n"
    v2 = sig + struct.pack("!BBH", 0x21, 0x11, 12) + socket.inet_aton("10.79.0.100") + \
        socket.inet_aton("10.79.0.1") + struct.pack("!HH", 40001, 80) + b"WHO\n"
    for raw, want in ((v1, "10.79.0.100:40000"), (v2, "10.79.0.100:40001")):
        with lab.socket("node1") as s:
            s.settimeout(3)
            s.connect((ip, 8080))
            s.sendall(raw)
            reply = json.loads(s.makefile("rb").readline())
            assert reply["proxy"] == want and reply["peer"].startswith("10.244.1.1:")


@pytest.mark.lab
def test_killed_pod_with_unread_data_resets(lab_factory: Callable[..., Lab],
                                            one_pod_spec: Callable[..., Any]) -> None:
    """HOLD leaves client bytes unread, so SIGKILL makes the kernel send RST, not FIN."""
    lab = lab_factory(one_pod_spec(), start_proxies=False, start_lb=False)
    with lab.socket("node2") as s:
        s.settimeout(3)
        s.connect((lab.pod_ip("web-1"), 8080))
        s.sendall(b"HOLD\n")
        assert json.loads(s.makefile("rb").readline())["pod"] == "web-1"
        s.sendall(b"x" * 1000)

        def unread() -> bool:  # the bytes sit in the pod socket's receive queue
            out = lab.run("web-1", ["ss", "-tnH", "state", "established"]).stdout
            return any(line.split()[0] == "1000" for line in out.splitlines())

        wait_until(unread, 3, what="1000 unread bytes at the pod")
        lab.kill_pod("web-1")
        with pytest.raises(ConnectionResetError):
            while s.recv(4096):
                pass
    assert not lab.pod_info("web-1")["alive"]


@pytest.mark.lab
def test_apply_moves_adds_and_deletes(lab_factory: Callable[..., Lab]) -> None:
    lab = lab_factory(_spec_two_nodes(), start_proxies=False)
    node_port = lab.node_port("default/web")
    old_uid = lab.pod_info("web-1")["uid"]
    spec = _spec_two_nodes()
    spec["pods"][0]["node"] = "node3"                      # move web-1
    spec["pods"].pop(1)                                    # delete web-2
    spec["pods"].append({"name": "api-1", "node": "node2", "labels": {"app": "api"},
                         "port": 9090})                    # add api-1
    changes = lab.apply(spec)
    assert changes["moved"] == ["web-1"] and changes["deleted"] == ["web-2"]
    assert changes["created"] == ["api-1"]
    assert lab.pod_node("web-1") == "node3" and lab.pod_ip("web-1") == "10.244.3.11"
    assert lab.pod_info("web-1")["uid"] != old_uid
    assert "web-2" not in lab.pods
    assert lab.plan.pod_ns("web-2") not in netns.list_namespaces()
    assert lab.request("node1", lab.pod_ip("web-1"), 8080)["node"] == "node3"
    assert lab.request("node1", lab.pod_ip("api-1"), 9090)["pod"] == "api-1"
    assert lab.node_port("default/web") == node_port, "nodePort kept across apply"
    docs = list(yaml.safe_load_all(lab.state_path.read_text()))
    [sl] = [d for d in docs if d["kind"] == "EndpointSlice"]
    assert [(e["targetRef"]["name"], e["nodeName"]) for e in sl["endpoints"]] == [
        ("web-1", "node3")]
    # Moving back and forth reuses slots cleanly (the old veth is gone at once).
    for node in ("node1", "node3", "node1"):
        lab.move_pod("web-1", node)
        assert lab.request("node2", lab.pod_ip("web-1"), 8080)["node"] == node


@pytest.mark.lab
def test_graceful_delete_and_readiness(lab_factory: Callable[..., Lab],
                                       one_pod_spec: Callable[..., Any]) -> None:
    lab = lab_factory(one_pod_spec(), start_proxies=False, start_lb=False)

    def state() -> dict[str, Any]:
        docs = yaml.safe_load_all(lab.state_path.read_text())
        [sl] = [d for d in docs if d["kind"] == "EndpointSlice"]
        return {e["targetRef"]["name"]: e["conditions"] for e in sl["endpoints"]}

    lab.set_pod_ready("web-1", False)
    assert state() == {"web-1": {"ready": False, "serving": False, "terminating": False}}
    lab.set_pod_ready("web-1", True)
    assert state()["web-1"]["ready"] is True

    t0 = time.monotonic()
    lab.delete_pod("web-1", grace=1.5)
    assert time.monotonic() - t0 < 1.0, "delete_pod must not block"
    assert state() == {"web-1": {"ready": False, "serving": True, "terminating": True}}
    assert lab.request("node2", lab.pod_ip("web-1"), 8080)["pod"] == "web-1", \
        "a terminating pod still serves"
    lab.wait_pod_gone("web-1", timeout=10)
    assert time.monotonic() - t0 >= 1.4
    assert state() == {}
    assert lab.plan.pod_ns("web-1") not in netns.list_namespaces()


@pytest.mark.lab
def test_services_edit_and_delete(lab_factory: Callable[..., Lab],
                                  one_pod_spec: Callable[..., Any]) -> None:
    lab = lab_factory(one_pod_spec(), start_proxies=False, start_lb=False)
    hc = lab.hc_port("default/web")
    assert hc
    edited = lab.service("default/web")
    edited["spec"]["externalTrafficPolicy"] = "Cluster"    # read, edit, write back
    lab.update_service(edited)
    assert lab.hc_port("default/web") == 0, "Local -> Cluster drops the hc port"
    lab.update_service(svc("api", type="NodePort"))
    assert lab.node_port("default/api")
    lab.delete_service("default/web")
    kinds = [(d["kind"], d["metadata"]["name"])
             for d in yaml.safe_load_all(lab.state_path.read_text())]
    assert ("Service", "web") not in kinds and ("Service", "api") in kinds


@pytest.mark.lab
def test_down_removes_everything(lab_factory: Callable[..., Lab], tmp_path: Path,
                                 one_pod_spec: Callable[..., Any]) -> None:
    root_links = set(os.listdir("/sys/class/net"))
    lab = lab_factory(one_pod_spec(), start_proxies=False)
    pids = [lab.pod_info("web-1")["pid"]]
    namespaces = [n for n in netns.list_namespaces() if n.startswith(lab.prefix + "-")]
    assert len(namespaces) == 7
    lab.down()
    assert not [n for n in netns.list_namespaces() if n.startswith(lab.prefix + "-")]
    assert not any(netns.pid_alive(p) for p in pids)
    assert not (lab.run_dir / LAB_JSON).exists()
    leaked = set(os.listdir("/sys/class/net")) - root_links
    assert not {n for n in leaked if n.startswith(("veth", "n1", "cbr", "br0", "lb"))}


@pytest.mark.lab
def test_cleanup_after_a_crash(lab_prefix: str, tmp_path: Path,
                               one_pod_spec: Callable[..., Any]) -> None:
    """A lab whose owner died and whose record is corrupt is still removed completely."""
    run_dir = tmp_path / "run"
    lab = Lab(one_pod_spec(), prefix=lab_prefix, run_dir=run_dir, start_proxies=False)
    try:
        lab.up()
        pid = lab.pod_info("web-1")["pid"]
        # An unrecorded process in a lab namespace, as a crash between spawn and save leaves.
        stray = netns.popen_in(lab.ns("node2"), ["sleep", "300"])
        wait_until(lambda: stray.pid in netns.pids_in([lab.ns("node2")])[lab.ns("node2")], 5,
                   what="the stray process to enter node2")
        (run_dir / LAB_JSON).write_text("{ corrupt")
        teardown_by_name(lab_prefix, run_dir)
        assert not [n for n in netns.list_namespaces() if n.startswith(lab_prefix + "-")]
        assert not netns.pid_alive(pid)
        stray.wait(timeout=5)
        # A new lab with the same prefix over leftovers: up() clears them first.
        lab2 = Lab(one_pod_spec(), prefix=lab_prefix, run_dir=run_dir, start_proxies=False,
                   start_lb=False)
        netns.create(f"{lab_prefix}-node1")
        with lab2:
            assert lab2.request("node2", lab2.pod_ip("web-1"), 8080)["pod"] == "web-1"
    finally:
        teardown_by_name(lab_prefix, run_dir)
    assert not [n for n in netns.list_namespaces() if n.startswith(lab_prefix + "-")]


@pytest.mark.lab
def test_attach_sees_and_changes_the_same_lab(lab_factory: Callable[..., Lab],
                                              one_pod_spec: Callable[..., Any]) -> None:
    lab = lab_factory(one_pod_spec(), start_proxies=False, start_lb=False)
    other = Lab.attach(lab.run_dir)
    assert other.pod_ip("web-1") == lab.pod_ip("web-1")
    assert other.node_port("default/web") == lab.node_port("default/web")
    other.add_pod("web-2", "node2", {"app": "web"})
    assert other.request("node1", other.pod_ip("web-2"), 8080)["pod"] == "web-2"
    assert "web-2" in Lab.attach(lab.run_dir).pods
    # The owner's down() sweeps what the attached copy created too.
    lab.down()
    assert not [n for n in netns.list_namespaces() if n.startswith(lab.prefix + "-")]


def test_topology_plan_names_fit_interfaces() -> None:
    plan = topology.Plan("kl4194304x99", tuple(f"node{i}" for i in range(1, 51)))
    assert plan.node_ns("node7") == "kl4194304x99-node7"
    assert max(len(topology.pod_host_ifname(k)) for k in range(1, 245)) <= 15
    assert topology.pod_ip(3, 2) == "10.244.3.12" and topology.node_ip(50) == "10.77.0.60"


def test_wait_until() -> None:
    box = {"n": 0}

    def bump() -> bool:
        box["n"] += 1
        return box["n"] >= 3

    assert wait_until(bump, 1.0, 0.001)
    with pytest.raises(TimeoutError, match="nothing"):
        wait_until(lambda: False, 0.05, 0.01, "nothing")
