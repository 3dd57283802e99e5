"""wrk and iperf3 parsers on outputs captured from the real tools (samples/)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.parsers import ParseError, duration_to_ms, parse_iperf3, parse_wrk

SAMPLES = Path(__file__).parent / "samples"


def sample(name: str) -> str:
    return (SAMPLES / name).read_text()


@pytest.mark.parametrize(("text", "ms"), [
    ("843.29us", 0.84329), ("3.72ms", 3.72), ("1.02s", 1020.0), ("2.00m", 120000.0),
    (" 75.00us ", 0.075),
])
def test_wrk_durations(text: str, ms: float) -> None:
    assert duration_to_ms(text) == pytest.approx(ms)


def test_wrk_duration_rejects_garbage() -> None:
    with pytest.raises(ParseError):
        duration_to_ms("fast")


def test_wrk_keepalive_run_is_clean() -> None:
    w = parse_wrk(sample("wrk_rr.txt"))
    assert w.requests > 0
    assert w.req_per_s > 0
    assert set(w.latency_ms) == {50, 75, 90, 99}
    assert w.latency_ms[50] <= w.latency_ms[99]
    assert w.socket_errors == 0 and w.non_2xx == 0
    assert w.problems() == []


def test_wrk_connection_close_run_is_clean() -> None:
    w = parse_wrk(sample("wrk_cps.txt"))
    assert w.requests == 15528
    assert w.req_per_s == pytest.approx(15390.44)
    assert w.latency_ms[99] == pytest.approx(4.74)
    assert w.seconds == pytest.approx(1.01)
    assert w.problems() == []


def test_wrk_non_2xx_is_a_problem() -> None:
    w = parse_wrk(sample("wrk_non2xx.txt"))
    assert w.non_2xx == w.requests == 109830
    assert any("non-2xx" in p for p in w.problems())


def test_wrk_socket_errors_are_a_problem() -> None:
    w = parse_wrk(sample("wrk_socket_errors.txt"))
    assert (w.connect_errors, w.read_errors, w.write_errors, w.timeouts) == (0, 4433, 31955, 0)
    probs = w.problems()
    assert any("no requests" in p for p in probs)
    assert any("read 4433" in p for p in probs)


def test_wrk_that_never_connected_is_unparseable() -> None:
    with pytest.raises(ParseError):
        parse_wrk(sample("wrk_connect_errors.txt"))


def test_iperf3_ok_sample() -> None:
    r = parse_iperf3(sample("iperf3_ok.json"))
    assert r.sent_bytes == 1801191424
    assert r.received_bytes == 1793196032
    assert r.gbps > 1
    # iperf3's receiver misses the in-flight tail, which is why bench.bulk exists.
    assert r.problems() != []
    assert r.problems(tail_allowance=8 << 20) == []
    assert r.problems(tail_allowance=1 << 20) != []


def test_iperf3_refused_sample() -> None:
    r = parse_iperf3(sample("iperf3_refused.json"))
    assert r.error and "refused" in r.error
    assert any("iperf3 error" in p for p in r.problems(64 << 20))


def test_iperf3_not_json() -> None:
    with pytest.raises(ParseError):
        parse_iperf3("iperf3: error - unable to connect")
