"""The bench's clusterip path and the apply-with-clusterIPs count (issue 11), no namespaces."""

from __future__ import annotations

import argparse
from pathlib import Path

from bench import cli, k8s_state
from bench.contenders import VIP_PORTS, HAProxy, Kernel, bench_state, client_role
from bench.topology import NODE1_IP, POD2_IP, SERVICE_VIP, Topology

EPS = (k8s_state.Ep("10.90.2.2", "node1"),)


def test_service_vip_is_the_first_rendered_clusterip() -> None:
    assert k8s_state.cluster_ip(0) == SERVICE_VIP
    text = bench_state("clusterip", 30400, 30401)
    assert f"clusterIP: {SERVICE_VIP}" in text and f"address: {NODE1_IP}" in text
    assert f"- {POD2_IP}" in text


def test_many_services_cluster_ip_modes() -> None:
    auto = k8s_state.render([], k8s_state.many_services(3, 20000, EPS, 8080))
    assert auto.count("clusterIP: ") == 3
    none = k8s_state.render([], k8s_state.many_services(3, 20000, EPS, 8080,
                                                         cluster_ips=False))
    assert "clusterIP" not in none and none.count("nodePort: ") == 3
    cips = k8s_state.many_cluster_ips(10000)
    assert len(set(cips)) == 10000 and all(c.startswith("10.96.") for c in cips)
    assert SERVICE_VIP not in cips
    given = k8s_state.render([], k8s_state.many_services(3, 20000, EPS, 8080,
                                                          cluster_ips=True))
    assert [ln.split(": ")[1] for ln in given.splitlines()
            if ln.startswith("  clusterIP:")] == cips[:3]


def test_clusterip_path_targets(tmp_path: Path) -> None:
    topo = Topology(prefix="kbtest-")
    k = Kernel(topo, tmp_path)
    k.path = "clusterip"
    t = k.target()
    assert (t.ip, t.http_port, t.bulk_port, t.iperf_port) == (SERVICE_VIP, *VIP_PORTS)
    assert f"ip daddr {SERVICE_VIP} tcp dport 80 dnat to {POD2_IP}:8080" in k.ruleset()
    h = HAProxy(topo, tmp_path)
    h.path = "clusterip"
    assert f"bind {SERVICE_VIP}:80" in h.config()
    assert client_role("clusterip") == "pod1" and client_role("local") == "client"
    k.path = "local"
    assert k.target().ip == NODE1_IP


def test_cli_accepts_clusterip_path() -> None:
    parser = argparse.ArgumentParser()
    cli.configure(parser)
    args = parser.parse_args(["--paths", "local,clusterip"])
    assert cli.build_config(args).paths == ["local", "clusterip"]
