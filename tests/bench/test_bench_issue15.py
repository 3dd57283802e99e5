"""Issue 15 in the bench: the connect workload's client and figures, and the issue's
targets judged beside issue 5's (no network but loopback, no root)."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench import cli, report, scaleprobe
from bench.contenders import CONTENDER_ORDER, serves
from bench.results import (
    DEFAULT_WORKLOADS,
    ISSUE15_TARGETS,
    METRICS,
    TARGET_SECTIONS,
    TARGETS,
    CellTable,
    Run,
    TargetResult,
    difference,
    document,
    evaluate_all_targets,
    evaluate_targets,
    load,
    validate,
    write,
)
from bench.runner import Bench, Config
from bench.topology import read_tcp_table
from bench.workloads import WORKLOAD_FUNCS, Settings, connect_run

META = {
    "started": "2026-11-29T10:00:00+00:00", "finished": "2026-11-29T10:03:00+00:00",
    "config": {"runs": 1}, "machine": {"nproc": 2}, "sysctls": {}, "topology": {},
    "contenders": {}, "notes": [], "charts": [],
}


def ok(**metrics: float) -> Run:
    return Run(ok=True, metrics=metrics)


def rr(v: float) -> Run:
    return ok(req_per_s=v, p50_ms=1.0, p99_ms=2.0)


def connect_us(p50: float, p99: float) -> Run:
    return ok(connect_p50_us=p50, connect_p99_us=p99)


def issue15(table: CellTable) -> dict[tuple[str, str | None], TargetResult]:
    return {(r.key, r.path): r for r in evaluate_targets(table, ISSUE15_TARGETS)}


# ---- the connect workload: its metrics and its judgement ------------------------------


def test_connect_metrics_are_registered_in_microseconds_lower_is_better() -> None:
    for name, label in (("connect_p50_us", "p50"), ("connect_p99_us", "p99")):
        m = METRICS[name]
        assert (m.workload, m.unit, m.higher_is_better, m.short) == ("connect", "us", False,
                                                                     label)
        assert not m.per_process  # measured at the client: the kernel has a figure too
    assert "connect" in DEFAULT_WORKLOADS and WORKLOAD_FUNCS["connect"] is not None


def test_every_contender_that_serves_tcp_runs_connect() -> None:
    takes_part = {c for c in CONTENDER_ORDER if serves(c, "connect") is None}
    assert takes_part == {c for c in CONTENDER_ORDER if serves(c, "rr") is None}
    assert {"direct", "kernel", "haproxy", "naive", "kpx", "kpx-w2", "kpx-nfq"} <= takes_part
    assert "UDP only" in (serves("socat", "connect") or "")


def test_connect_figures_are_nearest_rank_microseconds() -> None:
    ms = [i / 1000 for i in range(1, 101)]  # 1..100 us, shuffled below
    ms = ms[::2] + ms[1::2]
    run = connect_run({"ms": ms, "errors": [], "error_count": 0}, 100, 0.002)
    assert run.ok, run.error
    assert run.metrics == {"connect_p50_us": pytest.approx(50.0),
                           "connect_p99_us": pytest.approx(99.0)}
    assert run.detail["max_us"] == pytest.approx(100.0)
    assert run.detail["min_us"] == pytest.approx(1.0)
    assert run.detail["connected"] == 100 and run.detail["pause_ms"] == 2.0


def test_one_connect_error_fails_the_run() -> None:
    run = connect_run({"ms": [0.1] * 99, "errors": ["10.90.1.1:30100: [Errno 111] refused"],
                       "error_count": 1}, 100, 0.002)
    assert not run.ok and run.metrics == {}
    assert run.error == "1 of 100 connects failed (first: 10.90.1.1:30100: [Errno 111] refused)"
    assert run.detail["errors"] == 1


def test_a_short_count_or_no_answer_fails_the_run() -> None:
    short = connect_run({"ms": [0.1] * 10, "errors": [], "error_count": 0}, 100, 0.002)
    assert not short.ok and short.error == "10 of 100 connects timed"
    for bad in (None, {"error": "x"}, {"ms": "fast"}):
        run = connect_run(bad, 100, 0.002)
        assert not run.ok and "printed no latency" in (run.error or "")


def test_the_connect_run_is_bounded_in_count_and_time() -> None:
    s = Settings()
    assert s.connect_count == 2000 and 0.001 <= s.connect_pause <= 0.002
    # 2,000 connects with their pauses fit the deadline with room, but the deadline is
    # finite even for a slow path.
    assert 2000 * (s.connect_pause + 0.0005) < s.connect_deadline() < 60.0


@pytest.fixture
def loopback_listener() -> Iterator[int]:
    """A listener nobody accepts from: the kernel completes each handshake from its
    backlog, so connect() returns as soon as the SYN-ACK is in."""
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.bind(("127.0.0.1", 0))
    srv.listen(1024)
    try:
        yield srv.getsockname()[1]
    finally:
        srv.close()


def test_connects_one_at_a_time_with_the_pause_and_leave_no_time_wait(
        loopback_listener: int) -> None:
    port = loopback_listener
    t0 = time.monotonic()
    got = scaleprobe.connect_times(["127.0.0.1"] * 40, port, 1.0, 10.0, pause_s=0.005)
    elapsed = time.monotonic() - t0
    assert got["error_count"] == 0 and len(got["ms"]) == 40
    assert all(0 < x < 1000 for x in got["ms"])
    assert elapsed >= 39 * 0.005  # a pause between every two connects
    # RST close: none of the 40 client sockets waits out TIME_WAIT.
    assert not [s for s in read_tcp_table() if s[1] == port and s[2] == "TIME_WAIT"]



def test_connects_over_ipv6_to_an_ipv6_address() -> None:
    """An IPv6 target (``--families 6``) is dialled over IPv6: an IPv4 socket could not
    even try, and every connect would count as an error."""
    if not socket.has_ipv6:
        pytest.skip("no IPv6 in this kernel")
    with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as srv:
        srv.bind(("::1", 0))
        srv.listen(64)
        got = scaleprobe.connect_times(["::1"] * 5, srv.getsockname()[1], 1.0, 10.0, 0.001)
    assert got["error_count"] == 0, got["errors"]
    assert len(got["ms"]) == 5 and all(0 < x < 1000 for x in got["ms"])

def test_the_job_carries_the_pause_and_the_deadline_stops_the_loop(
        loopback_listener: int) -> None:
    job = {"port": loopback_listener, "timeout": 1.0, "latency": ["127.0.0.1"] * 1000,
           "deadline": 0.2, "pause": 0.05}
    t0 = time.monotonic()
    lat = scaleprobe.run_job(job)["latency"]
    assert time.monotonic() - t0 < 2.0
    assert 1 <= len(lat["ms"]) < 20 and lat["error_count"] == 1
    assert lat["errors"][0].startswith("deadline of 0.2s reached after")
    run = connect_run(lat, 1000, 0.05)
    assert not run.ok and "1 of 1000 connects failed (first: deadline" in (run.error or "")


def test_a_refused_connect_is_counted_not_raised(unused_tcp_port: int) -> None:
    lat = scaleprobe.connect_times(["127.0.0.1"] * 3, unused_tcp_port, 1.0, 5.0, 0.001)
    assert lat["error_count"] == 3 and lat["ms"] == []
    assert not connect_run(lat, 3, 0.001).ok


def test_the_runner_plans_connect_for_every_tcp_contender() -> None:
    """Every TCP contender's connect run is counted and its time estimated (500
    connects 2 ms apart, the pause before the run, the client's start: ~3 s)."""
    cfg = Config(workloads=["connect"], paths=["local", "cross"], runs=2,
                 contenders=list(CONTENDER_ORDER),
                 settings=Settings(connect_count=500, pause=1.0))
    bench = Bench.__new__(Bench)  # planning reads only the config
    bench.cfg = cfg
    runs = 2 * 2 * 11  # paths x rounds x contenders that serve TCP (not socat)
    assert bench._planned_steps() == runs
    # The NFQUEUE floors serve IPv4 NodePorts only: not on the clusterip path.
    bench.cfg = Config(workloads=["connect"], paths=["clusterip"], runs=2,
                       contenders=list(CONTENDER_ORDER), settings=cfg.settings)
    assert bench._planned_steps() == 2 * 9
    bench.cfg = cfg
    starts = 2 * 2 * len(CONTENDER_ORDER) * 1.0
    per_run = (bench.estimate_seconds() - 10.0 - starts) / runs
    assert 2.5 < per_run < 4.0



def test_a_config_made_in_code_runs_what_the_cli_runs_by_default() -> None:
    """``Config()`` is what ``kpx bench`` alone runs: both kpx modes, so issue 15's
    kpx-nfq rows are measured, not NOT MEASURED, by a harness built in code."""
    made, default = Config(), cli.build_config(cli.parse([]))
    assert (made.workloads, made.contenders) == (default.workloads, default.contenders)
    assert {"kpx", "kpx-nfq"} <= set(made.contenders)

# ---- issue 15's targets ---------------------------------------------------------------


def nfq_table(nfq_cps: float, nfq_rr: float, nfq_gbps: float, nfq_p99: float) -> CellTable:
    """kernel, haproxy and kpx-nfq on local, every figure issue 15 judges kpx-nfq by."""
    t = CellTable()
    for who, cps, req, gbps, p99 in (("kernel", 10000.0, 50000.0, 10.0, 300.0),
                                     ("haproxy", 6000.0, 40000.0, 5.0, 280.0),
                                     ("kpx-nfq", nfq_cps, nfq_rr, nfq_gbps, nfq_p99)):
        t.cell("local", "cps", who).add(ok(conn_per_s=cps))
        t.cell("local", "rr", who).add(rr(req))
        t.cell("local", "bulk", who).add(ok(gbps=gbps))
        t.cell("local", "connect", who).add(connect_us(p99 / 3, p99))
    return t


def test_issue15_rows_follow_the_issue_table() -> None:
    got = {t.key: (t.subject, t.metric, t.op, t.threshold, t.ref, t.compare, t.paths)
           for t in ISSUE15_TARGETS}
    assert got == {
        "nfq_cps_kernel": ("kpx-nfq", "conn_per_s", ">=", 0.9, "kernel", "ratio", None),
        "nfq_cps_haproxy": ("kpx-nfq", "conn_per_s", ">=", 1.3, "haproxy", "ratio", None),
        "nfq_rr_kernel": ("kpx-nfq", "req_per_s", ">=", 0.9, "kernel", "ratio", None),
        "nfq_bulk_kernel": ("kpx-nfq", "gbps", ">=", 0.9, "kernel", "ratio", None),
        "nfq_connect_added": ("kpx-nfq", "connect_p99_us", "<=", 200.0, "kernel",
                              "difference", None),
        "relay_rr_haproxy": ("kpx", "req_per_s", ">=", 1.0, "haproxy", "ratio", ("cross",)),
        "relay_cps_haproxy": ("kpx", "conn_per_s", ">=", 1.0, "haproxy", "ratio", ("cross",)),
        "relay_bulk_haproxy": ("kpx", "gbps", ">=", 1.2, "haproxy", "ratio", None),
    }
    assert all(t.issue == 15 for t in ISSUE15_TARGETS) and all(t.issue == 5 for t in TARGETS)
    keys = [t.key for _, ts in TARGET_SECTIONS for t in ts]
    assert len(keys) == len(set(keys))  # a key names one row whichever issue it is from
    assert [n for n, _ in TARGET_SECTIONS] == [5, 15]


def test_nfq_rows_met_at_their_thresholds() -> None:
    # cps 9,000 = 0.9x kernel and 1.5x haproxy; rr 0.9x; bulk 0.9x; +200 us exactly.
    res = issue15(nfq_table(9000.0, 45000.0, 9.0, 500.0))
    for key in ("nfq_cps_kernel", "nfq_cps_haproxy", "nfq_rr_kernel", "nfq_bulk_kernel",
                "nfq_connect_added"):
        assert res[(key, "local")].status == "met", res[(key, "local")]
    assert res[("nfq_cps_kernel", "local")].measured == pytest.approx(0.9)
    assert res[("nfq_cps_haproxy", "local")].measured == pytest.approx(1.5)
    assert res[("nfq_cps_kernel", "local")].unit == "x"


def test_nfq_rows_missed_below_their_thresholds() -> None:
    # cps 7,000 = 0.7x kernel, 1.17x haproxy; rr 0.8x; bulk 0.5x; +201 us.
    res = issue15(nfq_table(7000.0, 40000.0, 5.0, 501.0))
    for key in ("nfq_cps_kernel", "nfq_cps_haproxy", "nfq_rr_kernel", "nfq_bulk_kernel",
                "nfq_connect_added"):
        assert res[(key, "local")].status == "missed", res[(key, "local")]
    assert res[("nfq_cps_haproxy", "local")].measured == pytest.approx(7000 / 6000)


def test_connect_added_is_nfq_minus_kernel_in_microseconds() -> None:
    t = nfq_table(9000.0, 45000.0, 9.0, 385.5)
    row = issue15(t)[("nfq_connect_added", "local")]
    assert row.measured == pytest.approx(85.5) and row.unit == "us" and row.status == "met"
    assert difference(t, "local", "connect_p99_us", "kpx-nfq", "kernel") == (
        pytest.approx(85.5), None)
    # Quicker than the kernel (noise at light load) is a negative figure, and met.
    quick = issue15(nfq_table(9000.0, 45000.0, 9.0, 250.0))[("nfq_connect_added", "local")]
    assert quick.measured == pytest.approx(-50.0) and quick.status == "met"
    # Medians, as every other figure: one slow run of three does not decide it.
    t = nfq_table(9000.0, 45000.0, 9.0, 400.0)
    t.cell("local", "connect", "kpx-nfq").add(connect_us(100.0, 9000.0))
    t.cell("local", "connect", "kpx-nfq").add(connect_us(100.0, 420.0))
    assert issue15(t)[("nfq_connect_added", "local")].measured == pytest.approx(120.0)


def test_connect_added_without_the_kernel_is_not_measured() -> None:
    t = nfq_table(9000.0, 45000.0, 9.0, 385.0)
    t.mark("local", "connect", "kernel", "failed", "3 of 2000 connects failed")
    row = issue15(t)[("nfq_connect_added", "local")]
    assert row.status == "not measured" and row.measured is None
    assert row.reason == "kernel connect failed: 3 of 2000 connects failed"
    t = CellTable()
    t.cell("local", "connect", "kpx-nfq").add(connect_us(100.0, 300.0))
    row = issue15(t)[("nfq_connect_added", "local")]
    assert row.status == "not measured" and row.reason == "kernel connect not measured"


def test_issue15_rows_not_run_say_not_measured_with_the_reason() -> None:
    t = CellTable()
    t.cell("local", "rr", "kpx").add(rr(10.0))
    t.cell("local", "rr", "haproxy").add(rr(10.0))
    t.mark("local", "rr", "kpx-nfq", "unavailable", "`kpx node --help` shows no nfqueue")
    res = issue15(t)
    assert {k for k, _ in res} == {tg.key for tg in ISSUE15_TARGETS}
    assert all(r.status == "not measured" and r.reason for r in res.values())
    assert "unavailable: `kpx node --help` shows no nfqueue" in (
        res[("nfq_rr_kernel", "local")].reason or "")
    assert res[("nfq_connect_added", None)].reason == "kpx-nfq connect not measured"
    # The relay's rr and cps rows are the cross path's: local's figures do not count.
    assert res[("relay_rr_haproxy", "cross")].reason == "the cross path was not run"
    assert ("relay_rr_haproxy", "local") not in res


def test_relay_rows_rr_and_cps_on_cross_only_bulk_everywhere() -> None:
    t = CellTable()
    for path, kpx_rr, kpx_cps, kpx_gbps in (("local", 5.0, 5.0, 6.0), ("cross", 10.0, 9.0, 5.9)):
        t.cell(path, "rr", "kpx").add(rr(kpx_rr))
        t.cell(path, "rr", "haproxy").add(rr(10.0))
        t.cell(path, "cps", "kpx").add(ok(conn_per_s=kpx_cps))
        t.cell(path, "cps", "haproxy").add(ok(conn_per_s=10.0))
        t.cell(path, "bulk", "kpx").add(ok(gbps=kpx_gbps))
        t.cell(path, "bulk", "haproxy").add(ok(gbps=5.0))
    res = issue15(t)
    assert res[("relay_rr_haproxy", "cross")].status == "met"  # exactly 1.0x counts
    assert res[("relay_cps_haproxy", "cross")].status == "missed"  # 0.9x
    assert not [k for k in res if k[0].startswith("relay_r") and k[1] == "local"]
    assert res[("relay_bulk_haproxy", "local")].status == "met"  # 1.2x exactly
    assert res[("relay_bulk_haproxy", "cross")].status == "missed"  # 1.18x
    # An IPv6 twin of the cross path is the cross path too.
    t.cell("cross/ipv6", "rr", "kpx").add(rr(12.0))
    t.cell("cross/ipv6", "rr", "haproxy").add(rr(10.0))
    assert issue15(t)[("relay_rr_haproxy", "cross/ipv6")].status == "met"


def test_issue5_rows_are_unchanged_by_issue15() -> None:
    t = nfq_table(9000.0, 45000.0, 9.0, 385.0)
    assert {r.key for r in evaluate_targets(t)} == {tg.key for tg in TARGETS}
    rows = evaluate_all_targets(t)
    assert [r.issue for r in rows] == sorted(r.issue for r in rows)  # 5's, then 15's
    assert {r.key for r in rows if r.issue == 15} == {tg.key for tg in ISSUE15_TARGETS}


# ---- the file and the print -----------------------------------------------------------


def test_the_document_tells_each_rows_issue_and_round_trips(tmp_path: Path) -> None:
    doc = document(nfq_table(9000.0, 45000.0, 9.0, 385.0), meta=META, complete=True)
    assert validate(doc) == []
    by_key = {t["key"]: t for t in doc["targets"]}
    assert by_key["cps"]["issue"] == 5 and by_key["nfq_cps_kernel"]["issue"] == 15
    added = by_key["nfq_connect_added"]
    assert added["path"] == "local" and added["unit"] == "us"
    assert added["measured"] == pytest.approx(85.0)
    path = tmp_path / "r.json"
    write(path, doc)
    again, _ = load(path)
    assert again == json.loads(json.dumps(doc))


def test_a_file_from_before_issue15_still_validates() -> None:
    doc = json.loads(json.dumps(document(nfq_table(9000.0, 45000.0, 9.0, 385.0), meta=META,
                                         complete=True)))
    doc["targets"] = [t for t in doc["targets"] if t.pop("issue") == 5]
    assert validate(doc) == []
    doc["targets"][0]["issue"] = "fifteen"
    assert any("$.targets[0].issue" in p for p in validate(doc))


def test_the_target_table_prints_the_difference_with_its_unit() -> None:
    rows = evaluate_targets(nfq_table(9000.0, 45000.0, 9.0, 385.5), ISSUE15_TARGETS)
    text = report.target_table(rows)
    line = next(x for x in text.splitlines() if "connect() p99 added" in x)
    assert "<= 200 us" in line and "85.5 us" in line and "MET" in line
    assert "0.90x" in next(x for x in text.splitlines() if ">= 0.9x kernel" in x)
