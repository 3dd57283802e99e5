"""``kpx lab up --from-state``: a cluster's kubectl dump replayed as a lab, checked on the wire.

The fixture is an EKS cluster (``tests/unit/fixtures/kubectl_eks.yaml``):
nodes named ``ip-10-0-N-M.ec2.internal`` in three subnets, pods in the nodes'
VPC subnets (no podCIDR), an NLB service with externalTrafficPolicy=Local
whose only ready pod is on the first node, a NodePort service with
externalTrafficPolicy=Cluster whose pod is on the second, and a third node
the cluster autoscaler is scaling down (tainted ToBeDeletedByClusterAutoscaler). The lab is built by
the ``kpx`` command, as a user builds it, and then probed from its client.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from lab import Lab, netns
from lab.common import wait_until
from lab.lb import control as lb_control
from tests.support.labkit import CLIENT_IP, connect_outcome, peer_ip, who

pytestmark = pytest.mark.lab

FIXTURE = Path(__file__).resolve().parents[1] / "unit" / "fixtures" / "kubectl_eks.yaml"
KPX = shutil.which("kpx", path=str(Path(sys.executable).parent)) or shutil.which("kpx")
N1, N2, N3 = (f"ip-10-0-{i}.ec2.internal" for i in ("1-23", "2-41", "3-17"))
IP = {N1: "10.0.1.23", N2: "10.0.2.41", N3: "10.0.3.17"}
WEB_NODE_PORT, WEB_HC_PORT, API_NODE_PORT = 31080, 32111, 30090


@pytest.fixture
def mirrored(lab_prefix: str, tmp_path: Path) -> Iterator[tuple[Lab, str]]:
    """The fixture's lab, up through ``kpx lab up --from-state``; its ``up`` output."""
    assert KPX, "the kpx console script is not installed next to this python"
    env = {**os.environ, "KPX_RUN_DIR": str(tmp_path), "NO_COLOR": "1"}
    try:
        up = subprocess.run([KPX, "lab", "up", "--name", lab_prefix, "--from-state",
                             str(FIXTURE)], capture_output=True, text=True, timeout=120, env=env)
        assert up.returncode == 0, f"stdout:\n{up.stdout}\nstderr:\n{up.stderr}"
        yield Lab.attach(tmp_path / lab_prefix), up.stdout
    finally:
        subprocess.run([KPX or "kpx", "lab", "down", "--name", lab_prefix], env=env,
                       capture_output=True, timeout=60)
        left = [n for n in netns.list_namespaces() if n.startswith(lab_prefix + "-")]
        assert not left, f"left behind: {left}"


def test_a_cluster_replayed_in_the_lab(mirrored: tuple[Lab, str]) -> None:
    lab, out = mirrored

    # What was left out is said, and the nodes are the cluster's, at its addresses.
    assert "mirroring 3 nodes, 6 pods, 5 services, the lab's LB in front of shop/web" in out
    assert "Service shop/db: headless (clusterIP None): kube-proxy does not proxy it" in out
    assert lab.nodes == [N1, N2, N3]
    assert {n: lab.node_ip(n) for n in lab.nodes} == IP
    assert lab.pod_ip("web-6d9f7c8b5-lq2vx") == "10.0.1.57"

    # kpx node reads the Services exactly as the cluster has them.
    given = {(o["metadata"]["namespace"], o["metadata"]["name"]): o["spec"]
             for o in yaml.safe_load(FIXTURE.read_text())["items"] if o["kind"] == "Service"}
    state = list(yaml.safe_load_all(lab.state_path.read_text()))
    served = {(o["metadata"]["namespace"], o["metadata"]["name"]): o["spec"]
              for o in state if o["kind"] == "Service"}
    assert served == {k: v for k, v in given.items() if k != ("shop", "db")}
    nodes = {o["metadata"]["name"]: o for o in state if o["kind"] == "Node"}
    assert {n: o["status"]["addresses"][0]["address"] for n, o in nodes.items()} == IP
    assert nodes[N3]["spec"]["taints"][0]["key"] == "ToBeDeletedByClusterAutoscaler"

    # The autoscaler is taking the third node away: its kpx says so on /healthz
    # (KEP-3836), as kube-proxy there does, so an eTP=Cluster LB drains it.
    health = {n: lab.http_get("client", IP[n], 10256, "/healthz")[0] for n in lab.nodes}
    assert health == {N1: 200, N2: 200, N3: 503}

    # eTP=Local: the node with the ready pod answers and the pod sees the client;
    # the others (none, or only a not-ready pod) drop the SYN and fail the health check.
    reply, _ = who(lab, "client", IP[N1], WEB_NODE_PORT)
    assert (reply["pod"], peer_ip(reply)) == ("web-6d9f7c8b5-lq2vx", CLIENT_IP)
    for node in (N2, N3):
        assert connect_outcome(lab, "client", IP[node], WEB_NODE_PORT, 1.0) == "timeout", node
    codes = {n: lab.http_get("client", IP[n], WEB_HC_PORT, "/")[0] for n in lab.nodes}
    assert codes == {N1: 200, N2: 503, N3: 503}

    # The lab's LB, in front of shop/web, sees the same verdicts and reaches the pod.
    def verdicts() -> dict[str, bool]:
        return {r["name"]: r["healthy"] for r in lb_control.status(lab.run_dir)}

    wait_until(lambda: verdicts() == {N1: True, N2: False, N3: False}, 10, 0.1,
               "the LB's verdicts: only the node with the ready pod is healthy")
    front, port = lab.lb_address()
    reply, _ = who(lab, "client", front, port)
    assert (reply["pod"], peer_ip(reply)) == ("web-6d9f7c8b5-lq2vx", CLIENT_IP)

    # eTP=Cluster: a node without the pod forwards to the other node's, SNATed to itself.
    reply, _ = who(lab, "client", IP[N1], API_NODE_PORT)
    assert (reply["pod"], reply["node"], peer_ip(reply)) == ("api-7b8c9d6f4-m3n5p", N2, IP[N1])

    # Pod to ClusterIP, across nodes in different subnets: addresses stay in the lab.
    reply, _ = who(lab, "web-6d9f7c8b5-lq2vx", "10.100.140.20", 80)
    assert (reply["pod"], peer_ip(reply)) == ("cart-5f6a7b8c9-k2j4h", "10.0.1.57")
