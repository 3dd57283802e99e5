"""``proxy.util.spawn.run``: a child run on the loop, without the loop's fork-based spawn."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time

import pytest

from proxy.util import spawn
from tests.support.loops import run_on

LOOPS = ["uvloop", "asyncio"]


def open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize("loop_kind", LOOPS)
def test_stdin_stdout_stderr_and_exit_status(loop_kind: str) -> None:
    big = "".join(f"line {i}\n" for i in range(200_000))  # far more than a pipe holds
    got: list[spawn.Result] = []
    code = ("import sys; d = sys.stdin.read(); sys.stdout.write(d); "
            "sys.stderr.write('n=%d' % d.count(chr(10))); sys.exit(3)")

    fds: list[set[str]] = []

    async def main() -> None:
        fds.append(open_fds())
        got.append(await spawn.run([sys.executable, "-c", code], big))
        got.append(await spawn.run(["true"]))
        fds.append(open_fds())

    run_on(loop_kind, main)
    assert got[0] == spawn.Result(3, big, "n=200000")
    assert got[1] == spawn.Result(0, "", "")
    assert fds[0] == fds[1]


@pytest.mark.parametrize("loop_kind", LOOPS)
def test_a_child_that_stops_reading_stdin_is_not_a_hang(loop_kind: str) -> None:
    got: list[spawn.Result] = []

    async def main() -> None:
        got.append(await spawn.run(["sh", "-c", "echo early; exit 1"], "x" * 4_000_000))

    run_on(loop_kind, main)
    assert got == [spawn.Result(1, "early\n", "")]


@pytest.mark.parametrize("loop_kind", LOOPS)
def test_timeout_kills_and_reaps_and_the_loop_keeps_running(loop_kind: str) -> None:
    ticks: list[float] = []
    errors: list[BaseException] = []

    async def ticker() -> None:
        while True:
            ticks.append(time.monotonic())
            await asyncio.sleep(0.01)

    fds: list[set[str]] = []

    async def main() -> None:
        t = asyncio.create_task(ticker())
        fds.append(open_fds())
        try:
            await spawn.run(["sleep", "5"], None, timeout=0.3)
        except subprocess.TimeoutExpired as exc:
            errors.append(exc)
        finally:
            t.cancel()
        fds.append(open_fds())

    t0 = time.monotonic()
    run_on(loop_kind, main)
    assert time.monotonic() - t0 < 2.0
    assert len(errors) == 1 and len(ticks) >= 10  # the loop ran while it waited
    assert fds[0] == fds[1]
    # The child was reaped: no zombie of ours is left.
    zombies = [p for p in os.listdir("/proc") if p.isdigit() and _zombie_child(int(p))]
    assert zombies == []


def _zombie_child(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return False
    return fields[0] == "Z" and int(fields[1]) == os.getpid()


def test_a_child_runs_niced_not_idle() -> None:
    """Below the loop, but not below every task on the node: a SCHED_IDLE child, as
    kpx's once were, got next to no CPU on a node whose pods kept it busy (this
    file's echo test ran into its timeout beside two busy loops; docs/PERFORMANCE.md).
    The child reads its own policy once its stdin ends, which ``run`` writes only
    after setting it."""
    code = ("import os, sys; sys.stdin.read(); "
            "print(os.sched_getscheduler(0), os.getpriority(os.PRIO_PROCESS, 0))")
    got: list[spawn.Result] = []

    async def main() -> None:
        got.append(await spawn.run([sys.executable, "-c", code], "x"))

    run_on("uvloop", main)
    policy, nice = map(int, got[0].stdout.split())
    assert (policy, nice) == (os.SCHED_OTHER, spawn.WORKER_NICE), got
