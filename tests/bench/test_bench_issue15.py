"""Issue 15 in the bench: the connect workload's client and figures (no network but
loopback, no root)."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import pytest

from bench import scaleprobe
from bench.contenders import CONTENDER_ORDER, serves
from bench.results import DEFAULT_WORKLOADS, METRICS
from bench.runner import Bench, Config
from bench.topology import read_tcp_table
from bench.workloads import WORKLOAD_FUNCS, Settings, connect_run

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
    runs = 2 * 2 * 7  # paths x rounds x contenders that serve TCP (not socat)
    assert bench._planned_steps() == runs
    starts = 2 * 2 * len(CONTENDER_ORDER) * 1.0
    per_run = (bench.estimate_seconds() - 10.0 - starts) / runs
    assert 2.5 < per_run < 4.0
