"""Smoke: every contender on a ~2-second workload gives a figure or a clear reason.

Needs root, network namespaces and the Debian tools (haproxy, wrk, nft).
No timing thresholds: only that each cell ends as a number or as a failure
with a reason, that the results file is well formed, and that every
namespace and process the harness created is gone afterwards.
"""

from __future__ import annotations

import io
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bench.contenders import CONTENDER_ORDER
from bench.control import ControlSettings
from bench.results import load, metrics_of
from bench.runner import Bench, Config
from bench.topology import list_namespaces
from bench.workloads import Settings

pytestmark = pytest.mark.lab

HERE = Path(__file__).resolve().parent


def require_lab() -> None:
    if os.geteuid() != 0:
        pytest.skip("bench smoke needs root (network namespaces)")
    missing = [t for t in ("ip", "nft", "haproxy", "wrk", "sysctl") if shutil.which(t) is None]
    if missing:
        pytest.skip(f"bench smoke needs {', '.join(missing)} (.ci/system-deps installs them)")


def kpx_executable() -> str:
    beside = Path(sys.executable).parent / "kpx"
    return str(beside) if beside.exists() else (shutil.which("kpx") or "kpx")


def fake_kpx(tmp_path: Path) -> str:
    """An executable named like kpx that runs tests/bench/fake_kpx.py."""
    exe = tmp_path / "fake-kpx"
    exe.write_text(f'#!/bin/sh\nexec {sys.executable} {HERE / "fake_kpx.py"} "$@"\n')
    exe.chmod(0o755)
    return str(exe)


def run_bench(cfg: Config) -> tuple[dict, object, str]:
    out = io.StringIO()
    bench = Bench(cfg, stream=out)
    prefix = bench.topo.prefix
    try:
        rc = bench.run()
    finally:
        leftover = [n for n in list_namespaces() if n.startswith(prefix)]
        assert leftover == [], f"namespaces left behind: {leftover}"
    assert rc == 0, out.getvalue()[-3000:]
    doc, table = load(bench.result_path)
    return doc, table, out.getvalue()


NO_PROCESS = {"direct", "kernel"}
"""Contenders that forward in the kernel: no process to measure CPU on."""


def check_cells(table, expected: list[tuple[str | None, str, str]], text: str) -> None:  # type: ignore[no-untyped-def]
    for path, workload, contender in expected:
        cell = table.get(path, workload, contender)
        assert cell is not None, f"no cell for {path} {workload} {contender}\n{text}"
        if cell.status == "ok":
            names = {m.name for m in metrics_of(workload)
                     if not (m.per_process and contender in NO_PROCESS)}
            assert names <= set(cell.summary), (cell.to_json(), names)
            for m in names:
                assert cell.summary[m].n == len(cell.runs) >= 1
        else:
            assert cell.status in ("failed", "unavailable", "n/a"), cell.status
            assert cell.reason and len(cell.reason) > 10, cell.to_json()


@pytest.mark.timeout(240)
def test_every_contender_gives_a_figure_or_a_reason(tmp_path: Path) -> None:
    require_lab()
    cfg = Config(
        quick=True, runs=1, paths=["local"], mem_paths=["local"],
        workloads=["bulk", "rr", "cps", "mem"], contenders=list(CONTENDER_ORDER),
        out=tmp_path, kpx=kpx_executable(),
        settings=Settings(durations={"bulk": 1.0, "rr": 1.0, "cps": 1.0}, pause=0.2,
                          mem_connections=200, mem_settle=0.2),
    )
    doc, table, text = run_bench(cfg)
    expected = [("local", w, c) for w in cfg.workloads for c in CONTENDER_ORDER]
    check_cells(table, expected, text)
    # The references must actually work, or no ratio means anything.
    for c in ("direct", "kernel", "haproxy", "naive"):
        for w in ("bulk", "rr", "cps"):
            cell = table.get("local", w, c)
            assert cell is not None and cell.status == "ok", (c, w, cell and cell.reason)
    for c in ("haproxy", "naive"):
        assert table.get("local", "mem", c).status == "ok"
    # Each run keeps the kernel counters that moved, per namespace: the client opened at
    # least one connection per request of a cps run (the client's own, not node1's).
    cps_run = table.get("local", "cps", "kernel").runs[0]
    opened = cps_run.detail["counters"]["client"]["Tcp.ActiveOpens"]
    assert opened >= cps_run.detail["requests"], cps_run.detail
    assert "Tcp.ActiveOpens" not in cps_run.detail["counters"].get("node1", {})
    floors = ["nfq-pyfloor",
              *(["nfq-floor", "relay-floor"] if shutil.which("cc") is not None else [])]
    for floor in floors:  # the NFQUEUE floors forward as kpx-nfq does, the relay's relays
        for w in ("bulk", "rr", "cps"):
            cell = table.get("local", w, floor)
            assert cell is not None and cell.status == "ok", (floor, w, cell and cell.reason)
    assert table.get("local", "mem", "kernel").status == "n/a"
    assert doc["complete"] is True
    assert doc["sysctls"] and all(
        s["net.ipv4.tcp_tw_reuse"] == "1" for s in doc["sysctls"].values())
    assert {t["key"] for t in doc["targets"]} >= {"bulk", "rr", "cps", "mem"}
    assert "== issue 5 targets ==" in text and "kpx/haproxy" in text


@pytest.mark.timeout(180)
def test_control_plumbing_with_a_stand_in_kpx(tmp_path: Path) -> None:
    """apply / idle / converge / stall against fake_kpx.py, in both proxy modes: the
    harness side of control works for the relay's listeners and for kpx-nfq's nft sets."""
    require_lab()
    pytest.importorskip("proxy.k8s")
    cfg = Config(
        quick=True, runs=1, paths=["local"], workloads=["rr", "control"],
        contenders=["kpx", "kpx-nfq"], out=tmp_path, kpx=fake_kpx(tmp_path),
        settings=Settings(durations={"bulk": 1.0, "rr": 1.0, "cps": 1.0}, pause=0.1),
        # stall_timeout 3 s: the stand-in relay logs no "VIPs in force", so its
        # apply-cip cells fail once nothing moves for that long.
        control=ControlSettings(sizes=(20, 60), changes=5, conv_services=20,
                                idle_seconds=0.5, apply_timeout=30.0, stall_timeout=3.0,
                                stall_services=200, stall_node_ports=40, stall_tail=0.3),
    )
    doc, table, text = run_bench(cfg)
    for c in ("kpx", "kpx-nfq"):
        for w in ("apply-20", "apply-60", "idle-20", "idle-60", "converge", "stall-200"):
            cell = table.get(None, w, c)
            assert cell is not None and cell.status == "ok", (c, w, cell and cell.reason, text)
        conv = table.get(None, "converge", c)
        assert len(conv.runs[0].detail["samples_ms"]) == 5
        stall = table.get(None, "stall-200", c).runs[0]
        assert stall.detail["node_ports"] == 40 and stall.detail["cluster_ip_services"] == 160
        assert stall.detail["conn"]["probes"] > 10 and stall.detail["healthz"]["probes"] > 10
        assert {"stall_conn_p99_ms", "stall_healthz_p99_ms"} <= set(stall.metrics)
        assert table.get("local", "rr", c).status == "ok"
        apply = table.get(None, "apply-60", c).runs[0]
        assert apply.detail["polls"] >= 1 and apply.detail["answered_s"] >= apply.metrics["apply_s"]
    # kpx-nfq is timed on its nft sets: the stand-in's VIPs are in its vips set, and a
    # pod on node1 reaches the first and last through them.
    cip = table.get(None, "apply-cip-60", "kpx-nfq")
    assert cip.status == "ok" and cip.runs[0].detail["cluster_ips"] == 60, cip.to_json()
    assert table.get(None, "apply-cip-60", "kpx").status == "failed"  # the stand-in's limit
    assert table.get("local", "rr", "kpx-w2") is None
    assert not [n for n in doc["notes"] if "kpx-nfq" in n], doc["notes"]
    # The live counter plans every control row of both modes (apply-cip included).
    steps = [(int(k), int(t)) for k, t in re.findall(r"\[(\d+)/(\d+)\]", text)]
    assert steps and steps[-1][0] == steps[-1][1] and all(k <= t for k, t in steps), steps


def test_namespace_clash_aborts_cleanly_and_leaves_foreign_namespaces(tmp_path: Path) -> None:
    """A namespace with our name that we did not create is reported, never deleted."""
    require_lab()
    cfg = Config(quick=True, runs=1, paths=["local"], workloads=["rr"],
                 contenders=["direct"], out=tmp_path)
    out = io.StringIO()
    bench = Bench(cfg, stream=out)
    foreign = bench.topo.ns("node1")
    subprocess.run(["ip", "netns", "add", foreign], check=True)
    try:
        assert bench.run() == 1
        assert foreign in list_namespaces()
        mine = [n for n in list_namespaces() if n.startswith(bench.topo.prefix)]
        assert mine == [foreign]
        doc, _ = load(bench.result_path)
        assert doc["complete"] is False
        assert any("already exist" in n for n in doc["notes"])
    finally:
        subprocess.run(["ip", "netns", "del", foreign], check=False)


def require_socat() -> None:
    if shutil.which("socat") is None:
        pytest.skip("the udp smoke needs socat (.ci/system-deps installs it)")


@pytest.mark.timeout(180)
def test_udp_gives_rates_and_a_proxy_without_udp_fails_clearly(tmp_path: Path) -> None:
    """udp for 1 s: direct, kernel and both userspace peers give non-zero rates;
    HAProxy is n/a (never started); a kpx without UDP (the stand-in) fails the udp
    cell with the reason, in bounded time, while its TCP cell still measures."""
    require_lab()
    require_socat()
    pytest.importorskip("proxy.k8s")
    cfg = Config(
        quick=True, runs=1, paths=["local"], workloads=["rr", "udp"],
        contenders=["direct", "kernel", "haproxy", "naive", "socat", "kpx"],
        out=tmp_path, kpx=fake_kpx(tmp_path),
        settings=Settings(durations={"bulk": 1.0, "rr": 1.0, "cps": 1.0, "udp": 1.0},
                          pause=0.2),
    )
    doc, table, text = run_bench(cfg)
    for c in ("direct", "kernel", "naive", "socat"):
        cell = table.get("local", "udp", c)
        assert cell is not None and cell.status == "ok", (c, cell and cell.reason, text[-2000:])
        assert cell.summary["udp_per_s"].median > 0
        assert 0 < cell.summary["udp_p50_ms"].median <= cell.summary["udp_p99_ms"].median
        run = cell.runs[0]
        assert run.detail["corrupt"] == 0 and run.detail["flows"] == 50
        assert run.detail["who"]["pod"] == "pod1-a" and run.detail["who"]["proto"] == "udp"
    assert "udp_cpu_us" in table.get("local", "udp", "socat").summary
    # The kernel DNATs and masquerades; direct keeps the client's address.
    assert table.get("local", "udp", "direct").runs[0].detail["who"]["peer"].startswith(
        "10.90.1.2:")
    haproxy = table.get("local", "udp", "haproxy")
    assert haproxy.status == "n/a" and "no UDP" in haproxy.reason
    assert table.get("local", "rr", "socat").status == "n/a"
    kpx = table.get("local", "udp", "kpx")
    assert kpx.status == "failed", kpx.to_json()
    assert "no UDP reply from 10.90.1.1:30404" in kpx.reason
    assert "ICMP port unreachable" in kpx.reason
    assert kpx.runs[0].detail["wall_s"] < 15
    assert table.get("local", "rr", "kpx").status == "ok"
    assert any(r["name"] == "kpx/socat" and r["metric"] == "udp_per_s" for r in doc["ratios"])
    assert "udp request/response datagrams/s" in text


@pytest.mark.timeout(120)
def test_udp_with_the_real_kpx_gives_a_figure_or_a_reason(tmp_path: Path) -> None:
    """kpx's UDP dataplane is young: whatever it does, the cell ends as a number or
    as a failure with a reason, and the bench cleans up."""
    require_lab()
    cfg = Config(
        quick=True, runs=1, paths=["local"], workloads=["udp"], contenders=["kernel", "kpx"],
        out=tmp_path, kpx=kpx_executable(),
        settings=Settings(durations={"udp": 1.0}, pause=0.2),
    )
    _doc, table, text = run_bench(cfg)
    check_cells(table, [("local", "udp", "kernel"), ("local", "udp", "kpx")], text)
    assert table.get("local", "udp", "kernel").status == "ok"


@pytest.mark.timeout(150)
def test_connect_times_fresh_connections_and_issue15_judges_them(tmp_path: Path) -> None:
    """connect for 300 connects (2 ms apart) through the kernel and the real kpx-nfq:
    every connect made and timed, the figures in microseconds, and issue 15's table
    printed after issue 5's, its connect row the two p99s' difference (or a reason)."""
    require_lab()
    cfg = Config(
        quick=True, runs=1, paths=["local"], workloads=["connect"],
        contenders=["kernel", "kpx-nfq"], out=tmp_path, kpx=kpx_executable(),
        settings=Settings(pause=0.2, connect_count=300),
    )
    doc, table, text = run_bench(cfg)
    check_cells(table, [("local", "connect", "kernel"), ("local", "connect", "kpx-nfq")], text)
    kernel = table.get("local", "connect", "kernel")
    assert kernel.status == "ok", (kernel.reason, text[-2000:])
    run = kernel.runs[0]
    assert run.detail["connected"] == 300 and run.detail["errors"] == 0
    assert run.detail["pause_ms"] == 2.0
    assert 0 < run.metrics["connect_p50_us"] <= run.metrics["connect_p99_us"] \
        <= run.detail["max_us"]
    # 300 connects 2 ms apart: at least 0.6 s, and well inside the run's deadline.
    assert 0.6 <= run.detail["wall_s"] < cfg.settings.connect_deadline()
    assert text.index("== issue 5 targets ==") < text.index("== issue 15 targets ==")
    rows = {t["key"]: t for t in doc["targets"] if t["issue"] == 15}
    added = rows["nfq_connect_added"]
    nfq = table.get("local", "connect", "kpx-nfq")
    if nfq.status == "ok":
        assert added["unit"] == "us" and added["status"] in ("met", "missed")
        assert added["measured"] == pytest.approx(
            nfq.summary["connect_p99_us"].median - kernel.summary["connect_p99_us"].median)
    else:
        assert added["status"] == "not measured" and "kpx-nfq connect" in added["reason"]
    assert rows["relay_rr_haproxy"]["reason"] == "the cross path was not run"
