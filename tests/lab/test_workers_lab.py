"""``kpx node --workers 2`` in a real lab: SO_REUSEPORT workers, affinity steered by client IP.

Each worker keeps its own affinity table. Without steering the kernel hashes
the 4-tuple, so one client's connections reach both workers and stickiness
breaks; the reuseport program that picks the worker by source IP is what
keeps ClientIP affinity whole.
"""

from __future__ import annotations

import copy
import os
import re
import signal
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest

from lab.common import wait_until
from tests.support.labkit import FamilyLab, over_both_families

pytestmark = [pytest.mark.lab, pytest.mark.serial]


def _three_pods(affinity: bool) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "nodes": 2,
        "pods": [
            {"name": f"web-{i}", "node": "node1", "labels": {"app": "web"}, "port": 8080}
            for i in (1, 2, 3)
        ],
        "services": [{
            "apiVersion": "v1", "kind": "Service",
            "metadata": {"name": "web", "namespace": "default"},
            "spec": {"type": "NodePort", "externalTrafficPolicy": "Cluster",
                     "selector": {"app": "web"},
                     "ports": [{"name": "http", "port": 80, "targetPort": 8080}]},
        }],
    }
    if affinity:
        spec["services"][0]["spec"]["sessionAffinity"] = "ClientIP"
    return spec


def _worker_pids(lab: Any, node: str) -> list[int]:
    supervisor = lab.proxy_pid(node)
    out = lab.run(node, ["pgrep", "-P", str(supervisor)]).stdout.split()
    return [int(p) for p in out]


@over_both_families
def test_affinity_holds_across_workers_and_plain_traffic_spreads(
    lab_factory: Callable[..., Any], family: int,
) -> None:
    """Over IPv6 too: the workers' IPv6 listeners are steered by the IPv6 source."""
    lab = lab_factory(_three_pods(affinity=True), extra_proxy_args=("--workers", "2"),
                      dual_stack=family == 6)
    if family == 6:
        lab = FamilyLab(lab, 6)
    assert len(_worker_pids(lab, "node1")) == 2
    ip, port = lab.node_ip("node1"), lab.node_port("default/web")

    # Each worker has its own round-robin cursor. One connection from the
    # node itself moves exactly one worker's cursor, so the two workers would
    # pick different pods for the client: only steering by client IP keeps
    # all of the client's connections on one worker, hence on one pod.
    lab.request("node1", "127.0.0.1" if family == 4 else lab.node_ip("node1"), port)
    pods = Counter(lab.request("client", ip, port)["pod"] for _ in range(15))
    assert len(pods) == 1, f"affinity broke across workers: {dict(pods)}"

    svc = copy.deepcopy(lab.service("default/web"))
    svc["spec"]["sessionAffinity"] = "None"
    svc["spec"].pop("sessionAffinityConfig", None)
    lab.update_service(svc)

    def spread() -> Counter[str]:
        return Counter(lab.request("client", ip, port)["pod"] for _ in range(15))

    seen: Counter[str] = Counter()
    for _ in range(20):  # bounded: the state change lands within a second
        seen = spread()
        if len(seen) >= 2:
            break
    assert len(seen) >= 2, f"no spread without affinity: {dict(seen)}"
    assert lab.request("node1", "127.0.0.1", port)["pod"].startswith("web-")


def test_workers_share_the_vip_listener_keep_affinity_and_clean_up(
    lab_factory: Callable[..., Any],
) -> None:
    """Both workers serve the ClusterIP through one reuseport port; the last one out cleans up.

    As for the NodePort above, one connection from another client first moves
    one worker's cursor: without steering by client IP, node2's connections
    would reach both workers and so more than one pod.
    """
    spec = _three_pods(affinity=True)
    spec["pods"].append({"name": "c2", "node": "node2", "labels": {"app": "client"},
                         "port": 8080})
    lab = lab_factory(spec, extra_proxy_args=("--workers", "2"))
    cip = lab.cluster_ip("default/web")
    wait_until(lambda: "service VIPs in force" in lab.proxy_log("node2"), 5.0)
    workers = _worker_pids(lab, "node2")
    assert len(workers) == 2
    listening = lab.run("node2", ["ss", "-Hltnp"]).stdout
    ports: dict[int, set[int]] = {}
    for ln in listening.splitlines():
        pids = {int(p) for p in re.findall(r"pid=(\d+)", ln)}
        if pids & set(workers) and ln.split()[3].startswith("0.0.0.0:"):
            ports.setdefault(int(ln.split()[3].rsplit(":", 1)[1]), set()).update(pids)
    vip_port = [p for p, pids in ports.items() if pids == set(workers)]
    assert vip_port, f"no port both workers listen on: {listening}"

    lab.request("c2", cip, 80)
    pods = Counter(lab.request("node2", cip, 80)["pod"] for _ in range(15))
    assert len(pods) == 1, f"affinity broke across workers: {dict(pods)}"

    pid = lab.proxy_pid("node2")
    os.kill(pid, signal.SIGINT)
    try:
        wait_until(lambda: not lab.proxy_alive("node2"), 10.0)
    finally:
        lab.procs.reap(pid)
    routes = lab.run("node2", ["ip", "-4", "route", "show", "table", "local", "proto", "107"])
    assert routes.stdout.strip() == "", routes.stdout
    assert lab.run("node2", ["nft", "list", "table", "ip", "kpx_vips"]).returncode != 0
