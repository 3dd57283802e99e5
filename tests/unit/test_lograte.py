"""proxy.util.lograte: the first of each (cause, service) in full, the rest summarised.

A fake clock drives the windows, so every case is exact and instant.
"""

from __future__ import annotations

import logging

import pytest

from proxy.util.lograte import OVERFLOW, RateLimitedLog, one_line
from tests.support.clock import FakeClock


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(1000.0)


class Lines:
    """What a file handler would hold: one entry per written record."""

    def __init__(self, caplog: pytest.LogCaptureFixture) -> None:
        self.caplog = caplog

    def __call__(self) -> list[str]:
        return [r.getMessage() for r in self.caplog.records]


@pytest.fixture
def lines(caplog: pytest.LogCaptureFixture) -> Lines:
    caplog.set_level(logging.DEBUG, logger="test.lograte")
    return Lines(caplog)


def limiter(clock: FakeClock, **kw: object) -> RateLimitedLog:
    return RateLimitedLog(logging.getLogger("test.lograte"), clock=clock, **kw)  # type: ignore[arg-type]


def test_first_in_full_then_counted_then_one_summary(clock: FakeClock, lines: Lines) -> None:
    rl = limiter(clock)
    key = ("connect", "Connection refused", "default/web")
    written = [rl.warning(key, "%s: connect to %s failed", "default/web", f"10.0.0.{i}")
               for i in range(5000)]
    assert written == [True] + [False] * 4999
    assert lines() == ["default/web: connect to 10.0.0.0 failed"]
    clock.now += 9.99
    assert rl.flush() == pytest.approx(1010.0)  # not over yet: when it will be
    assert len(lines()) == 1
    clock.now += 0.01
    assert rl.flush() is None
    assert lines() == [
        "default/web: connect to 10.0.0.0 failed",
        "default/web: connect to 10.0.0.4999 failed … and 4,998 more like this in the last 10 s",
    ]
    assert len(rl) == 0


def test_window_ends_lazily_on_the_next_event(clock: FakeClock, lines: Lines) -> None:
    rl = limiter(clock)
    for _ in range(3):
        rl.warning("k", "boom")
    clock.now += 10.0
    assert rl.warning("k", "boom again")  # no flush call: the next event closes the window
    assert lines() == ["boom", "boom … and 1 more like this in the last 10 s", "boom again"]


def test_a_single_held_back_event_is_written_as_itself(clock: FakeClock, lines: Lines) -> None:
    rl = limiter(clock)
    rl.warning("k", "first")
    rl.warning("k", "second")
    clock.now += 11
    rl.flush()
    assert lines() == ["first", "second"]


def test_keys_are_independent_per_cause_and_service(clock: FakeClock, lines: Lines) -> None:
    rl = limiter(clock)
    for svc in ("a/x", "b/y"):
        for cause in ("refused", "timed out"):
            for _ in range(10):
                rl.warning((cause, svc), "%s: %s", svc, cause)
    assert sorted(lines()) == ["a/x: refused", "a/x: timed out", "b/y: refused", "b/y: timed out"]
    rl.flush(force=True)
    assert len(lines()) == 8
    assert all("… and 8 more like this" in m for m in lines()[4:])


def test_quiet_window_closes_without_a_summary(clock: FakeClock, lines: Lines) -> None:
    rl = limiter(clock)
    rl.warning("k", "once")
    clock.now += 10
    assert rl.flush() is None
    assert lines() == ["once"]
    assert len(rl) == 0


def test_forced_flush_says_how_long_it_covered(clock: FakeClock, lines: Lines) -> None:
    rl = limiter(clock)
    for _ in range(4):
        rl.warning("k", "x")
    clock.now += 2.5
    rl.flush(force=True)
    assert lines()[-1] == "x … and 2 more like this in the last 2.5 s"


def test_keys_are_bounded_and_the_rest_share_one_overflow_window(
    clock: FakeClock, lines: Lines
) -> None:
    rl = limiter(clock, max_keys=4)
    for i in range(1000):
        rl.warning(("cause", f"svc{i}"), "svc%d failed", i)
    assert len(rl) == 5  # four keys and the overflow window
    assert OVERFLOW in rl._open
    assert lines() == [f"svc{i} failed" for i in range(5)]
    rl.flush(force=True)
    assert lines()[-1] == "svc999 failed … and 994 more of other kinds in the last 0 s"
    # Ended windows make room again before anything overflows.
    clock.now += 10
    rl.warning("new", "fresh")
    assert lines()[-1] == "fresh" and len(rl) == 1


def test_the_level_of_the_first_is_kept(clock: FakeClock, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="test.lograte")
    rl = limiter(clock)
    rl.log(logging.ERROR, "k", "bad")
    rl.log(logging.ERROR, "k", "bad")
    rl.log(logging.ERROR, "k", "bad")
    rl.flush(force=True)
    assert [r.levelno for r in caplog.records] == [logging.ERROR, logging.ERROR]


def test_no_line_can_be_forged_from_input(clock: FakeClock, lines: Lines) -> None:
    rl = limiter(clock)
    evil = "x\nCRITICAL forged line\r\x1b[2J\u2028\x85"
    rl.warning("k", "client said %s", evil)
    rl.warning("k", "client said %s", evil)
    rl.warning("k", "client said %s", evil)
    rl.flush(force=True)
    assert len(lines()) == 2
    for m in lines():
        assert m.splitlines() == [m], m
        assert "\\nCRITICAL forged line\\r\\x1b[2J\\u2028\\x85" in m


def test_one_line_leaves_printable_text_alone() -> None:
    text = "default/web: 10.0.0.1:80 ünïcödé → fine"
    assert one_line(text) is text
    assert one_line("tab\there") == "tab\\there"


def test_a_bad_format_costs_nothing_but_its_looks(clock: FakeClock, lines: Lines) -> None:
    rl = limiter(clock)
    rl.warning("k", "%d items", "not a number")
    assert lines() == ["%d items ('not a number',)"]


def test_the_hot_path_of_a_held_back_event_does_not_format(clock: FakeClock) -> None:
    class Exploding:
        def __str__(self) -> str:
            raise AssertionError("formatted a suppressed event")

    rl = limiter(clock)
    rl.warning("k", "%s", "fine")
    for _ in range(100):
        rl.warning("k", "%s", Exploding())  # counted only
    rl._open["k"].args = ("replaced",)  # the summary would format the latest
    rl.flush(force=True)


def test_invalid_settings_are_refused() -> None:
    with pytest.raises(ValueError):
        RateLimitedLog(logging.getLogger("x"), window=0)
    with pytest.raises(ValueError):
        RateLimitedLog(logging.getLogger("x"), max_keys=0)
