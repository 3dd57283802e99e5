"""Result-file format, ratio arithmetic and target evaluation (no network)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.results import (
    METRICS,
    SCHEMA,
    TARGETS,
    Cell,
    CellTable,
    Run,
    Summary,
    all_ratios,
    document,
    evaluate_targets,
    load,
    ratio,
    validate,
    write,
)

META = {
    "started": "2026-11-21T22:00:00+00:00", "finished": "2026-11-21T22:03:00+00:00",
    "config": {"runs": 3}, "machine": {"nproc": 2}, "sysctls": {"kb1-node1": {}},
    "topology": {}, "contenders": {"kpx": {"available": True, "reason": None}},
    "notes": [], "charts": [],
}


def ok(**metrics: float) -> Run:
    return Run(ok=True, metrics=metrics)


def table_with(**cells: list[Run]) -> CellTable:
    """``contender_workload=[runs]`` on path local."""
    t = CellTable()
    for key, runs in cells.items():
        contender, workload = key.replace("kpx_w2", "kpx-w2").rsplit("_", 1)
        for r in runs:
            t.cell("local", workload, contender).add(r)
    return t


def test_failed_run_never_carries_a_number() -> None:
    r = Run(ok=False, metrics={"req_per_s": 1e6}, error="wrk socket errors")
    assert r.metrics == {}
    assert Run(ok=False).error  # a reason is always there


def test_summary_min_median_max() -> None:
    s = Summary.of([3.0, 1.0, 2.0, 10.0])
    assert (s.min, s.median, s.max, s.n) == (1.0, 2.5, 10.0, 4)


def test_one_failed_run_fails_the_cell() -> None:
    c = Cell("local", "rr", "kpx")
    c.add(ok(req_per_s=10.0, p50_ms=1.0, p99_ms=2.0))
    assert c.status == "ok" and c.median("req_per_s") == 10.0
    c.add(Run.failed("wrk non-2xx/3xx responses: 3"))
    assert c.status == "failed"
    assert "non-2xx" in (c.reason or "")
    assert c.summary == {} and c.median("req_per_s") is None


def test_ratio_of_medians() -> None:
    t = table_with(kpx_cps=[ok(conn_per_s=v) for v in (9.0, 10.0, 11.0)],
                   haproxy_cps=[ok(conn_per_s=v) for v in (4.0, 5.0, 100.0)])
    r = ratio(t, "local", "conn_per_s", "kpx", "haproxy")
    assert r.value == pytest.approx(2.0) and r.reason is None
    assert r.name == "kpx/haproxy" and r.workload == "cps"


def test_ratio_with_failed_side_has_no_value() -> None:
    t = table_with(kpx_rr=[Run.failed("start: kpx exited rc=1")],
                   haproxy_rr=[ok(req_per_s=5.0, p50_ms=1.0, p99_ms=2.0)])
    r = ratio(t, "local", "req_per_s", "kpx", "haproxy")
    assert r.value is None
    assert "kpx rr failed" in (r.reason or "")


def test_ratio_with_missing_or_unavailable_side() -> None:
    t = table_with(kpx_rr=[ok(req_per_s=5.0, p50_ms=1.0, p99_ms=2.0)])
    assert "not measured" in (ratio(t, "local", "req_per_s", "kpx", "haproxy").reason or "")
    t.mark("local", "rr", "kpx-w2", "unavailable", "no --workers")
    r = ratio(t, "local", "req_per_s", "kpx-w2", "kpx")
    assert r.value is None and "unavailable" in (r.reason or "")


def test_ratio_with_zero_denominator() -> None:
    t = table_with(kpx_bulk=[ok(gbps=1.0)], haproxy_bulk=[ok(gbps=0.0)])
    assert ratio(t, "local", "gbps", "kpx", "haproxy").value is None


def test_all_ratios_cover_pairs_on_each_path() -> None:
    t = table_with(kpx_rr=[ok(req_per_s=8.0, p50_ms=1.0, p99_ms=3.0)],
                   haproxy_rr=[ok(req_per_s=4.0, p50_ms=2.0, p99_ms=2.0)],
                   kernel_rr=[ok(req_per_s=16.0, p50_ms=0.5, p99_ms=1.0)],
                   kpx_w2_rr=[ok(req_per_s=12.0, p50_ms=1.0, p99_ms=3.0)])
    by = {(r.name, r.metric): r.value for r in all_ratios(t)}
    assert by[("kpx/haproxy", "req_per_s")] == pytest.approx(2.0)
    assert by[("kpx/haproxy", "p99_ms")] == pytest.approx(1.5)
    assert by[("kpx/kernel", "req_per_s")] == pytest.approx(0.5)
    assert by[("kpx-w2/kpx", "req_per_s")] == pytest.approx(1.5)
    # bulk was not run by anyone on this path: no bulk ratios at all
    assert not any(m == "gbps" for _, m in by)


def test_the_floor_ratios_appear_only_where_the_floor_ran() -> None:
    """nfq-floor runs only when asked for: a default run's report gains no row of it."""
    t = CellTable()
    t.cell("local", "cps", "kernel").add(ok(conn_per_s=10.0))
    t.cell("local", "cps", "kpx-nfq").add(ok(conn_per_s=8.0, cps_cpu_us=60.0))
    assert not any("nfq-floor" in r.name for r in all_ratios(t))
    t.cell("local", "cps", "nfq-floor").add(ok(conn_per_s=9.5, cps_cpu_us=40.0))
    by = {(r.name, r.metric): r.value for r in all_ratios(t)}
    assert by[("nfq-floor/kernel", "conn_per_s")] == pytest.approx(0.95)
    assert by[("kpx-nfq/nfq-floor", "conn_per_s")] == pytest.approx(8.0 / 9.5)
    assert by[("kpx-nfq/nfq-floor", "cps_cpu_us")] == pytest.approx(1.5)
    assert not any("pyfloor" in r.name for r in all_ratios(t))
    t.cell("local", "connect", "nfq-floor").add(ok(connect_p50_us=150.0, connect_p99_us=300.0))
    t.cell("local", "connect", "kpx-nfq").add(ok(connect_p50_us=330.0, connect_p99_us=600.0))
    t.cell("local", "connect", "nfq-pyfloor").add(ok(connect_p50_us=250.0,
                                                     connect_p99_us=500.0))
    by = {(r.name, r.metric): r.value for r in all_ratios(t)}
    assert by[("nfq-pyfloor/nfq-floor", "connect_p99_us")] == pytest.approx(500 / 300)
    assert by[("kpx-nfq/nfq-pyfloor", "connect_p50_us")] == pytest.approx(330 / 250)
    assert ("kpx-nfq/nfq-pyfloor", "conn_per_s") not in by  # no cps cell of the Python floor


def test_targets_met_missed_and_not_measured() -> None:
    t = table_with(
        kpx_rr=[ok(req_per_s=10.0, p50_ms=1.0, p99_ms=3.0)],
        haproxy_rr=[ok(req_per_s=10.0, p50_ms=1.0, p99_ms=2.0)],
        kpx_w2_rr=[ok(req_per_s=16.0, p50_ms=1.0, p99_ms=3.0)],
        kpx_mem=[ok(kib_per_conn=12.5)],
        kpx_cps=[Run.failed("wrk socket errors: connect 3")],
        haproxy_cps=[ok(conn_per_s=5.0)],
    )
    t.cell(None, "apply-10000", "kpx").add(ok(apply_s=1.4))
    res = {(r.key, r.path): r for r in evaluate_targets(t)}
    assert res[("rr", "local")].status == "met"  # exactly 1.0x counts
    assert res[("rr", "local")].measured == pytest.approx(1.0)
    assert res[("rr_p99", "local")].status == "met"  # 1.5x is the limit
    assert res[("workers", "local")].status == "missed"  # 1.6x < 1.7x
    assert res[("mem", "local")].status == "met" and res[("mem", "local")].unit == "KiB"
    assert res[("cps", "local")].status == "not measured"
    assert "failed" in (res[("cps", "local")].reason or "")
    assert res[("apply", None)].status == "missed"
    assert res[("apply", None)].measured == pytest.approx(1.4)
    assert res[("converge", None)].status == "not measured"
    assert res[("bulk", None)].status == "not measured"
    assert {k for k, _ in res} == {tg.key for tg in TARGETS}


def test_targets_follow_the_issue_table() -> None:
    got = {t.key: (t.metric, t.op, t.threshold, t.ref) for t in TARGETS}
    assert got == {
        "bulk": ("gbps", ">=", 1.0, "haproxy"),
        "rr": ("req_per_s", ">=", 1.0, "haproxy"),
        "rr_p99": ("p99_ms", "<=", 1.5, "haproxy"),
        "cps": ("conn_per_s", ">=", 1.0, "haproxy"),
        "mem": ("kib_per_conn", "<=", 16.0, None),
        "apply": ("apply_s", "<=", 1.0, None),
        "converge": ("converge_p99_ms", "<=", 100.0, None),
        "stall_conn": ("stall_conn_p99_ms", "<=", 50.0, None),
        "stall_healthz": ("stall_healthz_p99_ms", "<=", 50.0, None),
        "workers": ("req_per_s", ">=", 1.7, "kpx"),
        "apply_nfq": ("apply_s", "<=", 1.0, None),
        "converge_nfq": ("converge_p99_ms", "<=", 100.0, None),
        "stall_conn_nfq": ("stall_conn_p99_ms", "<=", 50.0, None),
        "stall_healthz_nfq": ("stall_healthz_p99_ms", "<=", 50.0, None),
    }
    subjects = {t.key: t.subject for t in TARGETS}
    assert subjects["apply"] == "kpx" and subjects["apply_nfq"] == "kpx-nfq"


def test_control_targets_are_judged_per_proxy_mode() -> None:
    """kpx-nfq's control cells meet or miss the same goals as the relay's, each its own row."""
    t = CellTable()
    t.cell(None, "apply-10000", "kpx").add(ok(apply_s=0.6))
    t.cell(None, "apply-10000", "kpx-nfq").add(ok(apply_s=1.4))
    t.cell(None, "converge", "kpx-nfq").add(ok(converge_p50_ms=5.0, converge_p99_ms=9.0))
    res = {r.key: r for r in evaluate_targets(t)}
    assert res["apply"].status == "met" and res["apply"].measured == pytest.approx(0.6)
    assert res["apply_nfq"].status == "missed" and res["apply_nfq"].measured == pytest.approx(1.4)
    assert res["converge_nfq"].status == "met" and res["converge"].status == "not measured"
    assert res["stall_conn_nfq"].reason == "kpx-nfq stall-50000 not measured"
    assert res["apply_nfq"].label.startswith("kpx-nfq: ")


def full_table() -> CellTable:
    t = table_with(
        kpx_rr=[ok(req_per_s=v, p50_ms=1.0, p99_ms=2.0) for v in (1.0, 2.0, 3.0)],
        haproxy_rr=[ok(req_per_s=2.0, p50_ms=1.0, p99_ms=2.0)],
        kpx_bulk=[Run.failed("bytes received 10 != sent 11", bytes_sent=11)],
    )
    t.mark("local", "mem", "kernel", "n/a", "no proxy process")
    t.cell(None, "converge", "kpx").add(ok(converge_p50_ms=20.0, converge_p99_ms=60.0))
    return t


def test_document_round_trip(tmp_path: Path) -> None:
    doc = document(full_table(), meta=META, complete=True)
    assert validate(doc) == []
    path = tmp_path / "r.json"
    write(path, doc)
    again, table = load(path)
    assert again == json.loads(json.dumps(doc))
    assert again["schema"] == SCHEMA
    assert document(table, meta=META, complete=True) == again
    cell = table.get("local", "rr", "kpx")
    assert cell is not None and cell.summary["req_per_s"].median == 2.0
    bulk = table.get("local", "bulk", "kpx")
    assert bulk is not None and bulk.status == "failed" and bulk.summary == {}


def test_document_shapes() -> None:
    doc = document(full_table(), meta=META, complete=False)
    for key in ("schema", "complete", "machine", "sysctls", "config", "cells", "ratios",
                "targets", "metrics"):
        assert key in doc
    assert set(doc["metrics"]) == set(METRICS)
    cell = next(c for c in doc["cells"] if c["workload"] == "rr")
    assert set(cell["summary"]["req_per_s"]) == {"min", "median", "max", "n"}
    assert all(isinstance(r["ok"], bool) for c in doc["cells"] for r in c["runs"])
    assert json.loads(json.dumps(doc)) == doc  # pure JSON types


@pytest.mark.parametrize(("mutate", "needle"), [
    (lambda d: d.pop("machine"), "$.machine: missing"),
    (lambda d: d.update(schema="kpx-bench/0"), "$.schema"),
    (lambda d: d.update(complete="yes"), "$.complete"),
    (lambda d: d["cells"][0]["runs"][0].update(ok=False), "a failed run has numbers"),
    (lambda d: d["cells"][0]["runs"][0]["metrics"].update(req_per_s="fast"), "not a number"),
    (lambda d: d["cells"][0].update(status="weird"), "status"),
    (lambda d: d["cells"][0].update(status="failed", reason=None), "without a reason"),
    (lambda d: d["cells"][0]["summary"]["req_per_s"].pop("n"), "min/median/max/n"),
    (lambda d: d["ratios"].append({"name": "x"}), "$.ratios"),
    (lambda d: d["targets"].append({"status": "meh"}), "$.targets"),
])
def test_validate_catches(mutate, needle: str) -> None:  # type: ignore[no-untyped-def]
    doc = json.loads(json.dumps(document(full_table(), meta=META, complete=True)))
    doc["cells"].sort(key=lambda c: c["workload"] != "rr")
    mutate(doc)
    problems = validate(doc)
    assert any(needle in p for p in problems), problems
