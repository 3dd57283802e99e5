"""docker-compose.yml brought up on a real engine: the namespace lab's promises, in containers.

Each test looks from the client container (10.79.0.100, routed via the LB),
as a user of the lab would with ``kpx-compose exec client curl ...``:
node1 serves the LoadBalancer through the LB and keeps the client's IP,
the healthCheckNodePort tells the LB which node has the endpoint, nodes
without one drop a direct NodePort connection, and moving the endpoint in
the state file moves the LB's traffic.

The lab is one per session (conftest.py); the test that edits the state
file puts it back afterwards.
"""

from __future__ import annotations

import json

import pytest

from tests.compose.composekit import CLIENT_IP, Lab

pytestmark = pytest.mark.compose

NODE_IPS = {"node1": "10.77.0.11", "node2": "10.77.0.12", "node3": "10.77.0.13"}
NODE_PORT = 30080
CLUSTER_NODE_PORT = 30081
HEALTH_PORT = 32080
CURL_TIMED_OUT = 28
CURL_REFUSED = 7


def test_node1_answers_through_the_lb_and_the_pod_sees_the_client(compose_lab: Lab) -> None:
    # The LB's probes of the healthCheckNodePort found node1 alone healthy.
    assert compose_lab.serving() == ["node1"], compose_lab.lb_status()
    for _ in range(5):  # every answer, not just one: the LB's only healthy node is node1
        got = compose_lab.who()
        assert got is not None, "no answer through the LB"
        assert (got["pod"], got["node"]) == ("web-1", "node1")
        # eTP=Local and the LB's passthrough DNAT: no SNAT anywhere on the way.
        assert got["peer"].rsplit(":", 1)[0] == CLIENT_IP


@pytest.mark.parametrize(("node", "code", "local"),
                         [("node1", 200, 1), ("node2", 503, 0), ("node3", 503, 0)])
def test_health_check_node_port_answers_per_node(compose_lab: Lab, node: str, code: int,
                                                 local: int) -> None:
    status, body = compose_lab.status(f"http://{NODE_IPS[node]}:{HEALTH_PORT}/healthz")
    assert status == code, body
    health = json.loads(body)
    assert health["localEndpoints"] == local
    assert health["service"] == {"namespace": "default", "name": "web"}


@pytest.mark.parametrize("node", ["node2", "node3"])
def test_nodes_without_the_endpoint_drop_the_node_port(compose_lab: Lab, node: str) -> None:
    ip = NODE_IPS[node]
    # The node is reachable: a closed port refuses at once...
    refused = compose_lab.curl(f"http://{ip}:{NODE_PORT + 919}/", max_time=3)
    assert refused.returncode == CURL_REFUSED, refused.stderr
    # ...while the NodePort of an eTP=Local service with no local endpoint is
    # dropped (kube-proxy's behaviour): a time-out, not a refusal.
    dropped = compose_lab.curl(f"http://{ip}:{NODE_PORT}/", max_time=3)
    assert dropped.returncode == CURL_TIMED_OUT, (dropped.returncode, dropped.stderr)
    # node1, which has the endpoint, answers on the same port.
    direct = compose_lab.curl(f"http://{NODE_IPS['node1']}:{NODE_PORT}/")
    assert direct.returncode == 0, direct.stderr
    assert json.loads(direct.stdout)["pod"] == "web-1"



@pytest.mark.parametrize("node", ["node2", "node3"])
def test_cluster_node_port_via_a_node_without_the_endpoint_is_snated(compose_lab: Lab,
                                                                     node: str) -> None:
    # default/web-cluster (eTP=Cluster, NodePort 30081) through a node that
    # has no endpoint: forwarded to web-1 on node1, SNATed to that node's IP
    # (the hop back must return through it), not dropped as eTP=Local is.
    res = compose_lab.curl(f"http://{NODE_IPS[node]}:{CLUSTER_NODE_PORT}/")
    assert res.returncode == 0, (res.returncode, res.stderr)
    got = json.loads(res.stdout)
    assert (got["pod"], got["node"]) == ("web-1", "node1")
    assert got["peer"].rsplit(":", 1)[0] == NODE_IPS[node]


def test_localhost_node_port_is_served_on_a_node_without_the_endpoint(compose_lab: Lab) -> None:
    # Traffic from the node itself gets Cluster semantics even for eTP=Local
    # (kube-proxy's rule): node2 reaches web-1 on 127.0.0.1:30080, which it
    # drops for the client.
    res = compose_lab.exec("node2", "curl", "-sS", "-m", "3", f"http://127.0.0.1:{NODE_PORT}/")
    assert res.returncode == 0, (res.returncode, res.stderr)
    assert json.loads(res.stdout)["pod"] == "web-1"

def test_the_lb_follows_the_endpoint_to_web_2(compose_lab: Lab, restore_state: str) -> None:
    moved = (restore_state
             .replace("addresses: [10.244.1.10]", "addresses: [10.244.2.10]")
             .replace("nodeName: node1", "nodeName: node2")
             .replace("name: web-1}", "name: web-2}"))
    assert moved.count("10.244.2.10") == 2, "both EndpointSlices move"
    compose_lab.write_state(moved)
    # Nodes reload within a second; the LB marks node1 down after 2 failed
    # probes 1 s apart and node2 up after 1 pass: a few seconds in all.
    took = compose_lab.wait_for("node2", "web-2", timeout=15.0)
    assert took < 10.0, f"the LB took {took:.1f} s to follow"
    got = compose_lab.who()
    assert got is not None
    assert (got["pod"], got["node"]) == ("web-2", "node2")
    assert got["peer"].rsplit(":", 1)[0] == CLIENT_IP
    status, _ = compose_lab.status(f"http://{NODE_IPS['node1']}:{HEALTH_PORT}/healthz")
    assert status == 503
    status, _ = compose_lab.status(f"http://{NODE_IPS['node2']}:{HEALTH_PORT}/healthz")
    assert status == 200
