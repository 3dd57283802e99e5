"""healthCheckNodePort across a real 3-node lab: the seed scenario of issue 3.

A LoadBalancer service with externalTrafficPolicy=Local and one pod on node A.
Cloud LBs probe every node's healthCheckNodePort; only the node with a local
endpoint may answer 200, which is what takes the others out of rotation.
These tests read the answers the way an LB does: from outside, over HTTP.
"""

from __future__ import annotations

import copy
import json
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from lab.common import wait_until

pytestmark = pytest.mark.lab


def _probe(lab: Any, node: str, port: int) -> tuple[int, dict[str, Any]]:
    status, body = lab.http_get("client", lab.node_ip(node), port, "/healthz", timeout=2.0)
    return status, json.loads(body)


def test_hc_port_answers_200_only_on_the_node_with_the_pod_and_follows_moves(
    lab_factory: Callable[..., Any], one_pod_spec: Callable[..., dict[str, Any]]
) -> None:
    """200 + localEndpoints 1 on A, 503 + 0 on B and C; after a move, within 2 s, the reverse."""
    lab = lab_factory(one_pod_spec(etp="Local", node="node1"))
    hc = lab.hc_port("default/web")
    assert hc

    for node, code, count in (("node1", 200, 1), ("node2", 503, 0), ("node3", 503, 0)):
        status, body = _probe(lab, node, hc)
        assert (status, body["localEndpoints"]) == (code, count), node
        assert body["service"] == {"namespace": "default", "name": "web"}
        assert body["serviceProxyHealthy"] is True

    moved_at = time.monotonic()
    lab.move_pod("web-1", "node2")

    def moved() -> bool:
        return _probe(lab, "node1", hc)[0] == 503 and _probe(lab, "node2", hc)[0] == 200

    wait_until(moved, timeout=2.0, what="node1 503 and node2 200 after the move")
    assert time.monotonic() - moved_at < 2.0
    assert _probe(lab, "node2", hc)[1]["localEndpoints"] == 1
    assert _probe(lab, "node3", hc)[0] == 503


def test_hc_port_refuses_after_switching_to_cluster(
    lab_factory: Callable[..., Any], one_pod_spec: Callable[..., dict[str, Any]]
) -> None:
    """eTP=Cluster needs no health check: the port must refuse, like kube-proxy's e2e expects."""
    spec = one_pod_spec(etp="Local", node="node1")
    lab = lab_factory(spec)
    hc = lab.hc_port("default/web")
    assert _probe(lab, "node1", hc)[0] == 200

    svc = copy.deepcopy(lab.service("default/web"))
    svc["spec"]["externalTrafficPolicy"] = "Cluster"
    svc["spec"].pop("healthCheckNodePort", None)
    lab.update_service(svc)

    def refused_everywhere() -> bool:
        for node in lab.nodes:
            try:
                _probe(lab, node, hc)
            except ConnectionRefusedError:
                continue
            except ConnectionError:
                # A probe caught by the switch itself: the closing listener cuts the
                # connections it still holds (FIN before an answer, or RST from its
                # backlog). Neither is the refusal asked for, so keep polling.
                return False
            return False
        return True

    wait_until(refused_everywhere, timeout=2.0, what="hc port refused on every node")
    for node in lab.nodes:
        listening = lab.run(node, ["ss", "-ltnH", f"sport = :{hc}"]).stdout.strip()
        assert listening == "", f"{node} still listens on {hc}: {listening}"
    # The NodePort itself keeps serving, now from every node.
    port = lab.node_port("default/web")
    for node in lab.nodes:
        assert lab.request("client", lab.node_ip(node), port)["pod"] == "web-1"


def test_a_dual_stack_service_is_reached_over_both_families_and_checked_on_each(
    lab_factory: Callable[..., Any], one_pod_spec: Callable[..., dict[str, Any]]
) -> None:
    """Issue 14: a PreferDualStack LB service (eTP=Local, its pod on node1), both families at once.

    The LB's two fronts forward through node1, each keeping the client's
    address of its family, while the other family's requests are in flight.
    Each node's one healthCheckNodePort server answers over each family with
    that family's local endpoints: 200 on node1, 503 elsewhere. A second,
    IPv4-only service has no IPv6 endpoint anywhere, so node1 answers its
    check 200 over IPv4 and 503 over IPv6: the per-family answer kpx chose
    for kubernetes#114702 (README), which a union of the families would not give.
    """
    spec = one_pod_spec(etp="Local", node="node1", lb=True)
    only4 = copy.deepcopy(spec["services"][0])
    only4["metadata"]["name"] = "web4"
    only4["spec"]["ipFamilyPolicy"] = "SingleStack"
    spec["services"].append(only4)
    lab = lab_factory(spec, dual_stack=True)
    client = {4: str(lab.client_ip), 6: lab.client_ip(6)}

    def through_lb(family: int) -> list[str]:
        ip, port = lab.lb_address(family)
        return [lab.request("client", ip, port)["peer"].rsplit(":", 1)[0] for _ in range(10)]

    with ThreadPoolExecutor(max_workers=2) as pool:
        peers = dict(zip((4, 6), pool.map(through_lb, (4, 6)), strict=True))
    for family, seen in peers.items():
        assert seen == [client[family]] * 10, (family, seen)

    def check(node: str, key: str, family: int) -> tuple[int, int]:
        status, body = lab.http_get("client", lab.node_ip(node, family), lab.hc_port(key),
                                    "/healthz", timeout=2.0)
        return status, json.loads(body)["localEndpoints"]

    for family in (4, 6):
        assert check("node1", "default/web", family) == (200, 1), family
        for node in ("node2", "node3"):
            assert check(node, "default/web", family) == (503, 0), (node, family)
    assert check("node1", "default/web4", 4) == (200, 1)
    assert check("node1", "default/web4", 6) == (503, 0)
