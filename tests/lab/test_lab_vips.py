"""Service VIPs on a running lab: the objects and routes kpx needs, not the traffic.

The lab allocates the ClusterIP and writes it, the externalIPs and the LB
ingress (with its ipMode) into the state file every ``kpx node`` reads;
``kpx lab status`` shows them; ``kpx lab apply`` changes ipMode and
internalTrafficPolicy live (the file is replaced, the proxies read a new
generation) and moves the externalIP routes. Whether a connection to a VIP
is answered is the dataplane's business and is tested there.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from lab import Lab
from tests.support.labkit import generations, service, wait_applied

pytestmark = pytest.mark.lab

KPX = shutil.which("kpx", path=str(Path(sys.executable).parent)) or shutil.which("kpx")
LB_FRONT = "10.79.0.1"
ROUTER_NODE_SIDE = "10.77.0.2"


def vip_lab(ip_mode: str = "VIP", itp: str = "Cluster",
            external_ips: tuple[str, ...] = ("203.0.113.10", "203.0.113.20"),
            routes: dict[str, str] | None = None) -> dict[str, Any]:
    """A LoadBalancer service with externalIPs in front of one pod, and a plain ClusterIP one."""
    return {
        "nodes": 3,
        "cluster": {"externalIPRoutes": routes if routes is not None
                    else {"203.0.113.20": "node2"}},
        "pods": [{"name": "web-1", "node": "node1", "labels": {"app": "web"}, "port": 8080}],
        "services": [
            service("web", "Cluster", type="LoadBalancer", externalIPs=list(external_ips),
                    internalTrafficPolicy=itp),
            service("api", app="web", type="ClusterIP", clusterIP="10.96.0.50"),
        ],
        "loadBalancer": {"service": "default/web", "ipMode": ip_mode,
                         "probe": {"type": "tcp", "port": "nodePort", "interval": 0.5,
                                   "timeout": 0.5}},
    }


def kpx_lab(lab: Lab, *args: str) -> subprocess.CompletedProcess[str]:
    """``kpx lab CMD --name <prefix> ...`` on *lab*, as a user runs it."""
    assert KPX, "the kpx console script is not installed next to this python"
    env = {**os.environ, "KPX_RUN_DIR": str(lab.run_dir.parent), "NO_COLOR": "1"}
    proc = subprocess.run([KPX, "lab", args[0], "--name", lab.prefix, *args[1:]],
                          capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 0, f"kpx lab {' '.join(args)}: {proc.stdout}\n{proc.stderr}"
    return proc


def state_services(lab: Lab) -> dict[str, dict[str, Any]]:
    """The Service documents of the state file the proxies read."""
    return {d["metadata"]["name"]: d for d in yaml.safe_load_all(lab.state_path.read_text())
            if d and d["kind"] == "Service"}


def route_via(lab: Lab, src: str, ip: str) -> str:
    """The next hop *src* uses for *ip* (``ip route get``)."""
    words = lab.run(src, ["ip", "-4", "route", "get", ip]).stdout.split()
    return words[words.index("via") + 1] if "via" in words else "direct"


def test_vips_in_the_state_file_the_status_and_the_routes(lab_factory: Callable[..., Lab],
                                                         tmp_path: Path) -> None:
    lab = lab_factory(vip_lab())
    assert lab.run_dir.parent == tmp_path, "kpx_lab() finds the lab through KPX_RUN_DIR"

    # The state file every kpx node reads: the allocated ClusterIP, the given one,
    # the externalIPs and the LB ingress with its ipMode.
    web, api = state_services(lab)["web"], state_services(lab)["api"]
    cluster_ip = web["spec"]["clusterIP"]
    assert cluster_ip == lab.cluster_ip("default/web") == "10.96.209.100"
    assert web["spec"]["clusterIPs"] == [cluster_ip]
    assert api["spec"]["clusterIP"] == "10.96.0.50" and api["spec"]["clusterIPs"] == [
        "10.96.0.50"]
    assert web["spec"]["externalIPs"] == ["203.0.113.10", "203.0.113.20"]
    assert web["status"]["loadBalancer"]["ingress"] == [{"ip": LB_FRONT, "ipMode": "VIP"}]

    # kpx lab status lists them (table and JSON).
    text = kpx_lab(lab, "status").stdout
    for needle in (cluster_ip, "10.96.0.50", "203.0.113.10 -> node1", "203.0.113.20 -> node2",
                   f"{LB_FRONT} (VIP)"):
        assert needle in text, f"{needle!r} missing from kpx lab status:\n{text}"
    st = {s["key"]: s for s in json.loads(kpx_lab(lab, "status", "--json").stdout)["services"]}
    assert st["default/web"]["clusterIP"] == cluster_ip
    assert st["default/web"]["ingress"] == [{"ip": LB_FRONT, "ipMode": "VIP"}]
    assert st["default/web"]["externalIPs"] == [{"ip": "203.0.113.10", "node": "node1"},
                                                {"ip": "203.0.113.20", "node": "node2"}]

    # Routes: the client sends each externalIP to the router, the router to its node;
    # pods send the service CIDR towards their node, where kpx has made the
    # ClusterIP local (its own route, proto 107); the rest of the service CIDR
    # goes towards the node's gateway.
    for ip, node in (("203.0.113.10", "node1"), ("203.0.113.20", "node2")):
        assert route_via(lab, "client", ip) == LB_FRONT
        assert route_via(lab, "lb", ip) == lab.node_ip(node)
    assert route_via(lab, "web-1", cluster_ip) == "10.244.1.1"
    for node in lab.nodes:
        local = lab.run(node, ["ip", "-4", "route", "show", "table", "local", "proto", "107"])
        assert f"local {cluster_ip} " in local.stdout
        assert route_via(lab, node, "10.96.255.250") == ROUTER_NODE_SIDE

    # kpx lab apply: ipMode -> Proxy, iTP -> Local, one externalIP dropped and the other
    # routed to node3. The file is replaced and every proxy reads the new generation.
    before = generations(lab)
    changed = tmp_path / "changed.yaml"
    changed.write_text(yaml.safe_dump(vip_lab("Proxy", "Local", ("203.0.113.20",),
                                              {"203.0.113.20": "node3"})))
    out = kpx_lab(lab, "apply", str(changed)).stdout
    assert "services default/web" in out
    wait_applied(lab, before)
    web = state_services(lab)["web"]
    assert web["status"]["loadBalancer"]["ingress"] == [{"ip": LB_FRONT, "ipMode": "Proxy"}]
    assert web["spec"]["internalTrafficPolicy"] == "Local"
    assert web["spec"]["clusterIP"] == cluster_ip, "an apply never moves a ClusterIP"
    assert web["spec"]["externalIPs"] == ["203.0.113.20"]
    assert f"{LB_FRONT} (Proxy)" in kpx_lab(lab, "status").stdout
    assert route_via(lab, "lb", "203.0.113.20") == lab.node_ip("node3")
    lab_routes = lab.run("lb", ["ip", "-4", "route", "show", "proto", "177"]).stdout
    assert "203.0.113.10" not in lab_routes, lab_routes
    assert "203.0.113.10" not in lab.run("client", ["ip", "-4", "route", "show",
                                                    "proto", "177"]).stdout

    # A read-edit-write of the Service (status included) is accepted, as by the API server.
    svc = lab.service("default/web")
    svc["spec"]["internalTrafficPolicy"] = "Cluster"
    lab.update_service(svc)
    assert state_services(lab)["web"]["spec"]["internalTrafficPolicy"] == "Cluster"
    assert lab.ingress("default/web") == [{"ip": LB_FRONT, "ipMode": "Proxy"}]


def test_a_refused_apply_changes_nothing(lab_factory: Callable[..., Lab]) -> None:
    """A clusterIP another service holds is refused before any pod or route changes."""
    lab = lab_factory(vip_lab(), start_proxies=False, start_lb=False)
    state = lab.state_path.read_text()
    taken = lab.cluster_ip("default/web")
    bad = vip_lab()
    bad["pods"] = []
    bad["services"].append(service("new", type="ClusterIP", clusterIP=taken))
    with pytest.raises(ValueError, match=f"Service default/new: spec.clusterIP: {taken} is"
                                         " already allocated to default/web"):
        lab.apply(bad)
    assert lab.pods == ["web-1"]
    assert lab.state_path.read_text() == state
