"""``kpx node --workers 2`` in a real lab: SO_REUSEPORT workers, affinity steered by client IP.

Each worker keeps its own affinity table. Without steering the kernel hashes
the 4-tuple, so one client's connections reach both workers and stickiness
breaks; the reuseport program that picks the worker by source IP is what
keeps ClientIP affinity whole.
"""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest

pytestmark = pytest.mark.lab


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


def test_affinity_holds_across_workers_and_plain_traffic_spreads(
    lab_factory: Callable[..., Any],
) -> None:
    lab = lab_factory(_three_pods(affinity=True), extra_proxy_args=("--workers", "2"))
    assert len(_worker_pids(lab, "node1")) == 2
    ip, port = lab.node_ip("node1"), lab.node_port("default/web")

    # Each worker has its own round-robin cursor. One connection from the
    # node itself moves exactly one worker's cursor, so the two workers would
    # pick different pods for the client: only steering by client IP keeps
    # all of the client's connections on one worker, hence on one pod.
    lab.request("node1", "127.0.0.1", port)
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
