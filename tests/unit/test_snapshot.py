"""``kpx snapshot`` against the fake API server: what it lists, what it writes, how it fails.

The command runs as a real process (``python -m proxy snapshot``) against
``tests.support.apiserver`` serving the kubectl-style fixture, so the flags,
the exit codes, the messages and the file are what a user gets.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from lab.mirror import load_documents, translate
from proxy.k8s import parse_objects, parse_state
from proxy.sources.kubeapi import PROXY_LABEL_SELECTOR
from proxy.sources.snapshot import trim
from tests.support.apiserver import FakeAPIServer

FIXTURE = Path(__file__).parent / "fixtures" / "kubectl_eks.yaml"
REPO = Path(__file__).resolve().parents[2]


def last_line(text: str) -> str:
    """The command's own verdict: what comes before it is the API source's info log."""
    return text.strip().splitlines()[-1]


def fixture_items() -> list[dict[str, Any]]:
    return list(yaml.safe_load(FIXTURE.read_text())["items"])


@pytest.fixture
async def api() -> AsyncIterator[FakeAPIServer]:
    server = FakeAPIServer()
    await server.start()
    for obj in fixture_items():
        server.put(obj)
    yield server
    await server.close()


async def kpx(*argv: str) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "proxy", *argv, cwd=REPO,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def test_snapshot_writes_what_kube_proxy_watches(api: FakeAPIServer, tmp_path: Path
                                                       ) -> None:
    out = tmp_path / "state.yaml"
    rc, _, err = await kpx("snapshot", "--master", api.url, "-o", str(out), "--page-size", "2")
    assert rc == 0, err
    assert "3 nodes, 6 services (5 proxied), 5 endpoint slices" in err
    doc = yaml.safe_load(out.read_text())
    assert doc["kind"] == "List"
    got = {(o["kind"], o["metadata"].get("namespace", ""), o["metadata"]["name"])
           for o in doc["items"]}
    # Every node (not one: a snapshot is of the cluster). The headless db's slice is
    # not there: kube-proxy's label selector keeps it out. The db Service itself
    # carries no such label (the API server labels only slices), so it is listed,
    # as kube-proxy lists it, and kpx's parser passes it over, as kube-proxy does.
    assert got == {
        ("Node", "", "ip-10-0-1-23.ec2.internal"), ("Node", "", "ip-10-0-2-41.ec2.internal"),
        ("Node", "", "ip-10-0-3-17.ec2.internal"),
        ("Service", "default", "kubernetes"), ("Service", "kube-system", "kube-dns"),
        ("Service", "shop", "web"), ("Service", "shop", "api"), ("Service", "shop", "cart"),
        ("Service", "shop", "db"),
        ("EndpointSlice", "default", "kubernetes"),
        ("EndpointSlice", "kube-system", "kube-dns-8mzqp"),
        ("EndpointSlice", "shop", "web-x7f2k"), ("EndpointSlice", "shop", "api-4hq9s"),
        ("EndpointSlice", "shop", "cart-p8r2w")}
    # kube-proxy's selectors, byte for byte, on services and slices; none on nodes.
    lists = [r for r in api.requests if not r.watch]
    assert all(r.query.get("labelSelector") == PROXY_LABEL_SELECTOR
               for r in lists if r.kind != "Node")
    assert all("fieldSelector" not in r.query and "labelSelector" not in r.query
               for r in lists if r.kind == "Node")
    assert not [r for r in api.requests if r.watch]
    # Paginated: 3 nodes in pages of 2 are two requests, the second with the token.
    node_lists = [r for r in lists if r.kind == "Node"]
    assert [r.query.get("continue") for r in node_lists] == [None, "2"]
    assert all(r.query["limit"] == "2" for r in lists)
    # What kpx reads is what the cluster has: the same services and slices.
    mine = parse_state(out.read_text())
    theirs = parse_objects(fixture_items())
    assert sorted(mine.services, key=repr) == sorted(theirs.services, key=repr)
    assert sorted(mine.slices, key=repr) == sorted(theirs.slices, key=repr)
    assert sorted(mine.nodes, key=repr) == sorted(theirs.nodes, key=repr)


async def test_snapshot_is_a_state_file_kpx_accepts(api: FakeAPIServer, tmp_path: Path) -> None:
    out = tmp_path / "state.yaml"
    rc, _, err = await kpx("snapshot", "--master", api.url, "-o", str(out))
    assert rc == 0, err
    rc, stdout, err = await kpx("check", str(out))
    assert rc == 0, err
    assert "3 nodes, 5 services (2 with NodePorts), 5 endpoint slices" in stdout
    # ... and the lab reads it as it reads kubectl's: the same nodes, pods and services.
    assert _lab_view(translate(load_documents(out)).spec) == _lab_view(
        translate(load_documents(FIXTURE)).spec)


def _lab_view(spec: dict[str, Any]) -> tuple[Any, ...]:
    return (sorted(spec["nodes"]), spec["cluster"]["nodeIPs"],
            sorted((p["name"], p["node"], p["ip"], p["port"]) for p in spec["pods"]),
            sorted((s["metadata"]["namespace"], s["metadata"]["name"], yaml.safe_dump(s["spec"]))
                   for s in spec["services"]),
            spec.get("loadBalancer"))


async def test_snapshot_to_stdout(api: FakeAPIServer) -> None:
    rc, stdout, err = await kpx("snapshot", "--master", api.url)
    assert rc == 0, err
    assert parse_state(stdout).services


async def test_snapshot_strips_noise_but_keeps_what_kpx_reads(api: FakeAPIServer) -> None:
    rc, stdout, err = await kpx("snapshot", "--master", api.url)
    assert rc == 0, err
    assert "managedFields" not in stdout
    assert "last-applied-configuration" not in stdout
    assert "heartbeat" not in stdout.lower() and "nodeInfo" not in stdout
    items = {o["metadata"]["name"]: o for o in yaml.safe_load(stdout)["items"]}
    web = items["web"]
    assert web["metadata"]["annotations"] == {
        "service.beta.kubernetes.io/aws-load-balancer-type": "nlb"}
    assert web["spec"]["healthCheckNodePort"] == 32111
    assert web["status"]["loadBalancer"]["ingress"][0]["hostname"].endswith("amazonaws.com")
    node = items["ip-10-0-1-23.ec2.internal"]
    assert list(node["status"]) == ["addresses"]
    assert node["metadata"]["labels"]["topology.kubernetes.io/zone"] == "us-east-1a"


def test_trim_keeps_a_node_being_deleted() -> None:
    obj = {"kind": "Node", "apiVersion": "v1",
           "metadata": {"name": "n", "deletionTimestamp": "2024-05-02T11:00:00Z",
                        "managedFields": [{}], "creationTimestamp": "x",
                        "annotations": {"kubectl.kubernetes.io/last-applied-configuration": "{}"}},
           "spec": {"taints": [{"key": "ToBeDeletedByClusterAutoscaler", "effect": "NoSchedule"}]},
           "status": {"addresses": [], "images": [{}], "conditions": []}}
    assert trim(obj) == {"apiVersion": "v1", "kind": "Node",
                         "metadata": {"name": "n", "deletionTimestamp": "2024-05-02T11:00:00Z"},
                         "spec": obj["spec"], "status": {"addresses": []}}


async def test_forbidden_is_one_clear_line(api: FakeAPIServer, tmp_path: Path) -> None:
    api.fail("Service", False, 403)
    out = tmp_path / "state.yaml"
    rc, stdout, err = await kpx("snapshot", "--master", api.url, "-o", str(out))
    assert rc == 1
    assert last_line(err).startswith("kpx snapshot: listing services: 403")
    assert "endpointslices.discovery.k8s.io" in err
    assert "Traceback" not in err and not stdout
    assert not out.exists()


async def test_unreachable_server_is_one_clear_line(tmp_path: Path) -> None:
    # A port nothing listens on: bind one, learn it, close it.
    server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    server.close()
    await server.wait_closed()
    rc, _, err = await kpx("snapshot", "--master", f"http://127.0.0.1:{port}",
                           "-o", str(tmp_path / "s.yaml"))
    assert rc == 1
    assert err.startswith(f"kpx snapshot: listing nodes from http://127.0.0.1:{port}:")
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1  # nothing was listed


async def test_bad_kubeconfig_is_one_clear_line(tmp_path: Path) -> None:
    bad = tmp_path / "config"
    bad.write_text("apiVersion: v1\nkind: Config\nclusters: []\n")
    rc, _, err = await kpx("snapshot", "--kubeconfig", str(bad))
    assert rc == 1
    assert last_line(err).startswith("kpx snapshot: ") and "Traceback" not in err


async def test_kubectl_style_fixture_passes_kpx_check() -> None:
    """``kubectl get nodes,svc,endpointslices -A -o yaml`` keeps working as a state file."""
    rc, stdout, err = await kpx("check", str(FIXTURE))
    assert rc == 0, err
    assert stdout.endswith("ok: 3 nodes, 5 services (2 with NodePorts), 5 endpoint slices\n")
