"""The demos run for real, and what they measured is asserted, not what they printed.

Each demo function returns the facts it measured (which node answered, which
IP the pod saw, what each probe said, how long things took); these tests hold
those facts to the Kubernetes behaviour the narration claims, and check that
each demo's ``claims`` all held and that its lab is gone afterwards.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from lab import demos
from lab import netns as lab_netns

TIMEOUT = 1.5
CLIENT = "10.79.0.100"
NODE_IPS = {"node1": "10.77.0.11", "node2": "10.77.0.12", "node3": "10.77.0.13"}


def run_demo(name: str, prefix: str, tmp_path: Path) -> tuple[dict[str, Any], str]:
    out = io.StringIO()
    facts = demos.DEMOS[name](prefix=prefix, run_dir=tmp_path / name, out=out, timeout=TIMEOUT)
    assert not [n for n in lab_netns.list_namespaces() if n.startswith(f"{prefix}-")]
    return facts, out.getvalue()


def assert_all_claims_held(facts: dict[str, Any]) -> None:
    failed = [c["claim"] for c in facts["claims"] if not c["held"]]
    assert not failed and facts["ok"], failed
    assert facts["claims"], "a demo must make claims"


# ---------------------------------------------------------------- narration (no lab)


class FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_colour_only_on_a_terminal_without_no_color(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NO_COLOR", raising=False)
    assert demos.Narrator(FakeTTY()).color is True
    assert demos.Narrator(io.StringIO()).color is False
    monkeypatch.setenv("NO_COLOR", "1")
    assert demos.Narrator(FakeTTY()).color is False


def test_claims_are_recorded_and_a_failed_one_is_flagged() -> None:
    out = io.StringIO()
    claims = demos.Claims(demos.Narrator(out, color=False))
    claims.check("held", True)
    claims.check("broken", False)
    assert claims.items == [{"claim": "held", "held": True}, {"claim": "broken", "held": False}]
    assert not claims.ok
    assert "✘ did not hold: broken" in out.getvalue()


def test_attempt_outcome_names_the_peer_ip() -> None:
    a = demos.Attempt("answered", 0.01, {"pod": "web-1", "node": "node1", "peer": "10.79.0.100:4"})
    assert a.as_dict() == {"outcome": "answered", "elapsed": 0.01, "pod": "web-1",
                           "node": "node1", "peer_ip": "10.79.0.100"}


# ---------------------------------------------------------------- the demos (lab)


@pytest.mark.lab
def test_local_drop(lab_prefix: str, tmp_path: Path) -> None:
    facts, text = run_demo("local-drop", lab_prefix, tmp_path)
    nodes = facts["nodes"]
    assert nodes["node1"]["outcome"] == "answered"
    assert (nodes["node1"]["pod"], nodes["node1"]["peer_ip"]) == ("web-1", CLIENT)
    for node in ("node2", "node3"):
        assert nodes[node]["outcome"] == "timeout"  # dropped, not refused
        assert nodes[node]["elapsed"] >= TIMEOUT * 0.9
    # localhost:nodePort on the podless nodes reaches the pod on node1, SNATed to that node.
    for node in ("node2", "node3"):
        local = facts["localhost"][node]
        assert (local["outcome"], local["pod"], local["node"]) == ("answered", "web-1", "node1")
        assert local["peer_ip"] == NODE_IPS[node]
    assert facts["lb"] == {"node1": {"healthy": True, "result": "connected"},
                           "node2": {"healthy": False, "result": "timeout"},
                           "node3": {"healthy": False, "result": "timeout"}}
    assert_all_claims_held(facts)
    assert "externalTrafficPolicy" in text and "\033[" not in text


@pytest.mark.lab
def test_healthcheck(lab_prefix: str, tmp_path: Path) -> None:
    facts, _text = run_demo("healthcheck", lab_prefix, tmp_path)
    assert facts["health"] == {"node1": {"status": 200, "localEndpoints": 1},
                               "node2": {"status": 503, "localEndpoints": 0},
                               "node3": {"status": 503, "localEndpoints": 0}}
    assert facts["lb_before"] == ["node1"]
    assert all(r["outcome"] == "answered" and r["node"] == "node1" and r["peer_ip"] == CLIENT
               for r in facts["before"])
    assert facts["lb_after"] == ["node2"]
    assert all(r["outcome"] == "answered" and r["node"] == "node2" and r["peer_ip"] == CLIENT
               for r in facts["after"])
    # The shift is bounded by the lab's convergence plus two failed 0.5 s probes.
    assert 0 < facts["hc_flip_seconds"] <= facts["shift_seconds"] < 10
    assert_all_claims_held(facts)


@pytest.mark.lab
def test_source_ip(lab_prefix: str, tmp_path: Path) -> None:
    facts, _text = run_demo("source-ip", lab_prefix, tmp_path)
    assert facts["cluster_via_node2"]["peer_ip"] == NODE_IPS["node2"]  # SNAT on the hop
    assert facts["cluster_via_node1"]["peer_ip"] == CLIENT  # no hop, no SNAT
    assert facts["local_via_node1"]["peer_ip"] == CLIENT
    for key in ("cluster_via_node2", "cluster_via_node1", "local_via_node1"):
        assert (facts[key]["outcome"], facts[key]["pod"]) == ("answered", "web-1")
    assert_all_claims_held(facts)


@pytest.mark.lab
def test_internal_local(lab_prefix: str, tmp_path: Path) -> None:
    facts, _text = run_demo("internal-local", lab_prefix, tmp_path)
    assert facts["cluster_from_c2"]["outcome"] == "answered"
    for key in ("local_from_c2", "local_from_node2"):  # dropped: a full time-out
        assert facts[key]["outcome"] == "timeout" and facts[key]["elapsed"] >= TIMEOUT * 0.9
    assert (facts["local_from_c1"]["outcome"], facts["local_from_c1"]["pod"]) == (
        "answered", "web-1")
    assert facts["nodeport_localhost_node2"]["peer_ip"] == NODE_IPS["node2"]  # SNATed
    assert_all_claims_held(facts)


@pytest.mark.lab
def test_proxy_protocol(lab_prefix: str, tmp_path: Path) -> None:
    facts, _text = run_demo("proxy-protocol", lab_prefix, tmp_path)
    ext, vip, proxy = facts["external"], facts["vip"], facts["proxy"]
    # Through the proxying LB: nginx's TCP peer is the LB, the header names the client.
    assert (ext["status"], ext["peer_ip"], ext["proxy_ip"], ext["client_ip"]) == (
        200, "10.77.0.2", CLIENT, CLIENT)
    # ipMode VIP: kpx hands the pod's connection to nginx directly, with no header.
    assert vip["status"] is None and vip["outcome"] == "closed without a reply"
    assert "broken header" in vip["nginx_error"]
    # ipMode Proxy: the pod's call leaves for the LB and comes back with its own IP.
    assert proxy["status"] == 200 and proxy["peer_ip"] == "10.77.0.2"
    assert proxy["proxy_ip"] == proxy["client_ip"] and proxy["client_ip"].startswith("10.244.2.")
    assert_all_claims_held(facts)


@pytest.mark.lab
def test_tcp_healthcheck(lab_prefix: str, tmp_path: Path) -> None:
    facts, _text = run_demo("tcp-healthcheck", lab_prefix, tmp_path)
    assert facts["lb_tcp"] == ["node1", "node2", "node3"]
    tcp, http = facts["tcp"], facts["http"]
    assert tcp["node1"]["timeouts"] == 0 and tcp["node1"]["answered"] == tcp["node1"]["attempts"]
    for node in ("node2", "node3"):  # round robin: each podless node got its share, all lost
        assert tcp[node]["attempts"] > 0 and tcp[node]["timeouts"] == tcp[node]["attempts"]
    assert facts["lb_http"] == ["node1"]
    assert http["node1"]["answered"] == sum(row["attempts"] for row in http.values())
    assert_all_claims_held(facts)


@pytest.mark.lab
def test_kpx_demo_command(lab_prefix: str) -> None:
    """The CLI as a user runs it: exit 0, narration without colour when piped, no leftovers."""
    kpx = Path(sys.executable).with_name("kpx")
    env = {**os.environ, "NO_COLOR": "1"}
    proc = subprocess.run(
        [str(kpx), "demo", "source-ip", "--prefix", lab_prefix], capture_output=True,
        text=True, timeout=120, env=env, stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "PASS  source-ip" in proc.stdout
    assert "\033[" not in proc.stdout
    assert not [n for n in lab_netns.list_namespaces() if n.startswith(lab_prefix)]
