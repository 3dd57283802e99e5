"""The harness's pure pieces: state files, flags, percentiles, tables and charts."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import pytest

from bench import cli, k8s_state, report, topology
from bench.contenders import bench_state
from bench.control import ControlSettings, percentile
from bench.results import CellTable, Run
from bench.workloads import MEM_FD_RESERVE, Settings


def parse(*argv: str) -> argparse.Namespace:
    return cli.parse(list(argv))


# ---- state files -------------------------------------------------------------------


def test_bench_state_is_valid_kubernetes_yaml() -> None:
    k8s = pytest.importorskip("proxy.k8s")
    snap = k8s.parse_state(bench_state("cross", 30400, 30401))
    assert {n.name for n in snap.nodes} == {"node1", "node2"}
    assert snap.node("node1").internal_ips == ("10.90.1.1",)
    (svc,) = snap.services
    assert svc.type == "NodePort" and svc.external_traffic_policy == "Cluster"
    assert {(p.name, p.node_port) for p in svc.ports} == {
        ("http", 30400), ("bulk", 30401), ("iperf", 30403)}
    (sl,) = snap.slices_for(svc)
    (ep,) = sl.endpoints
    assert (ep.address, ep.node_name, ep.ready) == ("10.90.4.2", "node2", True)
    assert {p.name for p in sl.ports} == {"http", "bulk", "iperf"}


def test_many_services_state() -> None:
    k8s = pytest.importorskip("proxy.k8s")
    eps = (k8s_state.Ep("10.90.2.2", "node1"), k8s_state.Ep("10.90.2.3", "node1"),
           k8s_state.Ep("10.90.4.2", "node2"))
    text = k8s_state.render([("node1", "10.90.1.1")],
                            k8s_state.many_services(300, 20000, eps, 8080))
    snap = k8s.parse_state(text)
    assert len(snap.services) == 300
    ports = sorted(p.node_port for s in snap.services for p in s.ports)
    assert ports == list(range(20000, 20300))
    assert len({s.cluster_ip for s in snap.services}) == 300
    assert all(len(sl.endpoints) == 3 for sl in snap.slices)


def test_cluster_ips_unique_for_ten_thousand() -> None:
    ips = {k8s_state.cluster_ip(i) for i in range(10001)}
    assert len(ips) == 10001
    assert all(ip.startswith("10.96.") or ip.startswith("10.97.") for ip in ips)


def test_write_atomic_replaces(tmp_path: Path) -> None:
    p = tmp_path / "state.yaml"
    k8s_state.write_atomic(p, "a")
    k8s_state.write_atomic(p, "b")
    assert p.read_text() == "b"
    assert [x.name for x in tmp_path.iterdir()] == ["state.yaml"]


# ---- flags -------------------------------------------------------------------------


def test_quick_defaults() -> None:
    cfg = cli.build_config(parse("--quick"))
    assert cfg.quick and cfg.runs == 1 and cfg.paths == ["local"]
    assert cfg.settings.durations == {"bulk": 2.0, "rr": 3.0, "cps": 3.0}
    assert cfg.control.changes == 20
    assert cfg.contenders == ["direct", "kernel", "haproxy", "naive", "kpx", "kpx-w2",
                              "kpx-nfq"]
    assert cfg.workloads == ["bulk", "rr", "cps", "connect", "mem", "control"]
    assert cfg.settings.connect_count == 500


def test_full_defaults_and_overrides(tmp_path: Path) -> None:
    cfg = cli.build_config(parse())
    assert cfg.runs == 3 and cfg.paths == ["local", "cross"] and cfg.mem_paths == ["local"]
    assert cfg.control.changes == 100 and cfg.control.sizes == (1000, 10000)
    assert cfg.settings.connect_count == 2000
    assert cli.build_config(parse("--quick", "--connects", "300")).settings.connect_count == 300
    cfg = cli.build_config(parse("--quick", "--duration", "7", "--runs", "2", "--paths",
                                 "cross", "--workloads", "rr,cps", "--contenders",
                                 "haproxy,kpx", "--out", str(tmp_path), "--changes", "0",
                                 "--control-sizes", "10,20"))
    assert cfg.settings.durations == {"bulk": 7.0, "rr": 7.0, "cps": 7.0}
    assert cfg.runs == 2 and cfg.paths == ["cross"] and cfg.mem_paths == ["cross"]
    assert cfg.workloads == ["rr", "cps"] and cfg.contenders == ["haproxy", "kpx"]
    assert cfg.out == tmp_path and cfg.control.changes == 0 and cfg.control.sizes == (10, 20)


def test_a_fraction_of_a_second_is_refused_where_wrk_times_the_run() -> None:
    """wrk takes whole seconds: 0.5 used to fail every rr and cps cell with wrk's usage."""
    with pytest.raises(cli.ConfigError, match=r"--duration 0.5: wrk runs rr,cps for whole"):
        cli.build_config(parse("--duration", "0.5"))
    with pytest.raises(cli.ConfigError, match=r"wrk runs cps for whole seconds"):
        cli.build_config(parse("--duration", "1.5", "--workloads", "bulk,cps"))
    cfg = cli.build_config(parse("--duration", "0.5", "--workloads", "bulk,mem"))
    assert cfg.settings.durations["bulk"] == 0.5


def test_unknown_names_are_rejected() -> None:
    with pytest.raises(SystemExit):
        parse("--contenders", "envoy")
    with pytest.raises(SystemExit):
        parse("--workloads", "rr,latency")


def test_config_is_json_serialisable() -> None:
    import json

    json.dumps(cli.build_config(parse("--quick")).to_json())


# ---- small arithmetic --------------------------------------------------------------


def test_percentile_nearest_rank() -> None:
    xs = [float(i) for i in range(1, 101)]
    assert percentile(xs, 50) == 50.0
    assert percentile(xs, 99) == 99.0
    assert percentile(xs, 100) == 100.0
    assert percentile([5.0], 99) == 5.0
    assert percentile([3.0, 1.0, 2.0], 99) == 3.0
    with pytest.raises(ValueError):
        percentile([], 50)


def test_mem_connections_capped_by_descriptor_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("bench.workloads.nofile_hard_limit", lambda: 20000)
    n, note = Settings(mem_connections=10000).mem_n()
    assert n == (20000 - MEM_FD_RESERVE) // 2 and note and "RLIMIT_NOFILE" in note
    monkeypatch.setattr("bench.workloads.nofile_hard_limit", lambda: 1 << 20)
    assert Settings(mem_connections=10000).mem_n() == (10000, None)


def test_control_settings_defaults_match_issue() -> None:
    cs = ControlSettings()
    assert cs.sizes == (1000, 10000) and cs.changes == 100 and len(cs.endpoints) == 3


# ---- reporting ---------------------------------------------------------------------


def sample_table() -> CellTable:
    t = CellTable()
    t.cell("local", "rr", "haproxy").add(Run(True, {"req_per_s": 50000.0, "p50_ms": 0.8,
                                                    "p99_ms": 1.9}))
    t.cell("local", "rr", "kpx").add(Run.failed("start: kpx exited rc=1: ImportError"))
    t.mark("local", "mem", "kernel", "n/a", "no proxy process")
    t.cell(None, "apply-10000", "kpx").add(Run(True, {"apply_s": 0.5}))
    return t


def test_summary_table_shows_reasons_not_numbers() -> None:
    text = report.summary_table(sample_table())
    assert "50,000" in text and "FAILED" in text and "ImportError" in text
    assert "N/A" in text and "apply-10000" in text
    # control (path None) sorts after the data paths
    assert text.index("apply-10000") > text.index("rr")


def test_run_line_labels_percentiles() -> None:
    line = report.run_line("local", "rr", "kpx", 0, 3, True,
                           {"req_per_s": 1234.5, "p50_ms": 0.5, "p99_ms": 2.0}, None)
    assert "1,234 req/s" in line and "p50 0.5 ms" in line and "p99 2.00 ms" in line
    assert "run 1/3" in line
    bad = report.run_line("local", "rr", "kpx", 1, 3, False, {}, "wrk socket errors")
    assert "FAILED: wrk socket errors" in bad


def test_charts_written_per_workload(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    files, note = report.charts(sample_table(), tmp_path, "x")
    assert note is None
    assert sorted(Path(f).name for f in files) == ["x-apply.png", "x-mem.png", "x-rr.png"]
    assert all(Path(f).stat().st_size > 1000 for f in files)


def test_charts_skipped_without_matplotlib(tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    files, note = report.charts(sample_table(), tmp_path, "x")
    assert files == [] and note and "matplotlib" in note
    assert list(tmp_path.iterdir()) == []


# ---- CPU accounting ----------------------------------------------------------------


class _Busy:
    """A contender stand-in whose process is this test: it burns CPU on demand."""

    has_process = True

    def pids(self) -> list[int]:
        import os

        return [os.getpid()]


def _burn(seconds: float) -> None:
    import time

    end = time.process_time() + seconds
    while time.process_time() < end:
        pass


def test_cpu_per_request_is_the_contenders_cpu_over_requests() -> None:
    from bench.runner import CpuUsage

    usage = CpuUsage.start(_Busy())  # type: ignore[arg-type]
    _burn(0.3)
    run = Run(ok=True, metrics={"req_per_s": 1.0}, detail={"requests": 1000})
    usage.finish("rr", run)
    # 0.3 s of CPU over 1,000 requests is 300 us each (clock ticks are 10 ms).
    assert 250 <= run.metrics["rr_cpu_us"] <= 400
    assert 0 < run.detail["machine_busy_pct"] <= 100
    assert run.detail["proxy_cpu_s"] >= 0.25


def _burn_in_user(seconds: float) -> None:
    """User time: arithmetic, the clock read (a syscall) only every 100,000 steps."""
    import time

    end = time.process_time() + seconds
    x = 0
    while time.process_time() < end:
        for i in range(100_000):
            x ^= i


def _burn_in_kernel(seconds: float) -> None:
    """System time: the kernel zero-fills a buffer on every read of /dev/zero."""
    import time

    buf = bytearray(1 << 20)
    end = time.process_time() + seconds
    with open("/dev/zero", "rb", buffering=0) as zero:
        while time.process_time() < end:
            zero.readinto(buf)


@pytest.mark.parametrize(("burn", "in_kernel"), [(_burn_in_user, False), (_burn_in_kernel, True)],
                         ids=["user", "kernel"])
def test_the_kernel_share_of_the_cpu_is_its_system_time(burn: Any, in_kernel: bool) -> None:
    from bench.runner import CpuUsage

    usage = CpuUsage.start(_Busy())  # type: ignore[arg-type]
    burn(0.3)
    run = Run(ok=True, metrics={"conn_per_s": 1.0}, detail={"requests": 1000})
    usage.finish("cps", run)
    cpu, kernel = run.metrics["cps_cpu_us"], run.metrics["cps_kernel_us"]
    assert 250 <= cpu <= 400  # as above: 0.3 s over 1,000 connections
    if in_kernel:
        assert kernel >= 0.6 * cpu, run.metrics
    else:
        assert kernel <= 0.2 * cpu, run.metrics
    assert run.detail["proxy_kernel_s"] == pytest.approx(kernel * 1000 / 1e6, abs=0.01)


def test_cpu_is_not_claimed_for_failed_runs_or_kernel_contenders() -> None:
    from bench.runner import CpuUsage

    failed = Run.failed("wrk: 3 read errors", requests=1000)
    CpuUsage.start(_Busy()).finish("cps", failed)  # type: ignore[arg-type]
    assert "cps_cpu_us" not in failed.metrics

    class _Kernel(_Busy):
        has_process = False

    run = Run(ok=True, metrics={"conn_per_s": 1.0}, detail={"requests": 1000})
    usage = CpuUsage.start(_Kernel())  # type: ignore[arg-type]
    _burn(0.05)  # the machine's share needs at least one clock tick to pass
    usage.finish("cps", run)
    assert "cps_cpu_us" not in run.metrics and "machine_busy_pct" in run.detail


SNMP = """\
Ip: Forwarding DefaultTTL InReceives
Ip: 1 64 120
Icmp: InMsgs InErrors
Icmp: 3 0
IcmpMsg: InType3 OutType3
IcmpMsg: 3 3
Tcp: RtoAlgorithm ActiveOpens PassiveOpens AttemptFails EstabResets CurrEstab OutRsts
Tcp: 1 10 7 2 1 4 5
Udp: InDatagrams NoPorts
Udp: 9 1
"""

CONNTRACK_STAT = """\
entries  clashres found new invalid ignore delete chainlength insert insert_failed drop \
early_drop icmp_error  expect_new expect_create expect_delete search_restart
0000002a  00000000 00000000 00000000 00000003 00000000 00000000 00000000 00000000 00000001 \
00000000 00000000 00000000  00000000 00000000 00000000 00000000
0000002a  00000001 00000000 00000000 0000000a 00000000 00000000 00000000 00000000 00000000 \
00000000 00000002 00000000  00000000 00000000 00000000 00000000
"""


def test_snmp_counters_are_read_by_their_header() -> None:
    """Only the kept counters of the kept groups, each value under its own header's name
    (a values line never read as a header, a group never mixed with the next)."""
    assert topology.parse_snmp(SNMP) == {
        "Tcp.ActiveOpens": 10, "Tcp.PassiveOpens": 7, "Tcp.AttemptFails": 2,
        "Tcp.EstabResets": 1, "Tcp.OutRsts": 5,
    }


def test_conntrack_stats_are_summed_over_cpus() -> None:
    assert topology.parse_conntrack_stat(CONNTRACK_STAT) == {
        "conntrack.invalid": 13, "conntrack.insert_failed": 1, "conntrack.drop": 0,
        "conntrack.early_drop": 2, "conntrack.clashres": 1,
    }


def test_nfqueue_drops_are_summed_over_queues() -> None:
    text = (" 7078  25445     0 2   128     3     1    25260  1\n"
            " 7079  25446     2 2   128     0     4      911  1\n")
    assert topology.parse_nfqueue(text) == {"nfqueue.queue_dropped": 3,
                                            "nfqueue.user_dropped": 5}
    assert topology.parse_nfqueue("") == {"nfqueue.queue_dropped": 0,
                                          "nfqueue.user_dropped": 0}
    assert "nfqueue.user_dropped" in topology.LOSS_SIGNS


def test_a_failed_runs_losses_name_the_namespace_and_the_counter() -> None:
    before = {"client": {"Tcp.OutRsts": 5, "TcpExt.ListenDrops": 0},
              "node1": {"Tcp.OutRsts": 0, "conntrack.invalid": 3},
              "pod1": {"TcpExt.ListenDrops": 1}}
    after = {"client": {"Tcp.OutRsts": 55, "TcpExt.ListenDrops": 0},
             "node1": {"Tcp.OutRsts": 1, "conntrack.invalid": 4},
             "pod1": {"TcpExt.ListenDrops": 3}}
    moved = topology.counter_deltas(before, after)
    assert moved == {"client": {"Tcp.OutRsts": 50},
                     "node1": {"Tcp.OutRsts": 1, "conntrack.invalid": 1},
                     "pod1": {"TcpExt.ListenDrops": 2}}
    # The client's resets are wrk's own, at the end of every run: never a loss.
    assert topology.explain_losses(moved, forwarder="node1") == (
        "node1 Tcp.OutRsts +1, node1 conntrack.invalid +1, pod1 TcpExt.ListenDrops +2")
    # A proxy on node1 ends connections itself: its resets are not evidence either.
    assert topology.explain_losses(moved) == (
        "node1 conntrack.invalid +1, pod1 TcpExt.ListenDrops +2")
