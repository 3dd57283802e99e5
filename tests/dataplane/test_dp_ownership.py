"""Ownership: one kpx node per namespace, a handover on SIGTERM, presence until exit.

The names are abstract UNIX sockets; each test uses its own base name, so it
never meets a real kpx (nor another test run) and touches no routing. The
"other instance" is a child process that holds ownership and obeys commands
on stdin.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import threading
import time
from collections.abc import Iterator

import pytest

from proxy.lifecycle.ownership import Ownership, OwnershipError, live_pids, owner_pid, routing_lock
from tests.support.child import Child

_n = itertools.count()

HOLDER = """
import sys
from proxy.lifecycle.ownership import Ownership
own = Ownership.acquire(sys.argv[1])
print("ready", flush=True)
for line in sys.stdin:
    cmd = line.strip()
    if cmd == "stopping":
        own.stopping()
    elif cmd == "release":
        own.release()
    elif cmd == "close":
        own.close()
    print("done", flush=True)
"""


@pytest.fixture
def base() -> str:
    return f"kpx-test-{os.getpid()}-{next(_n)}"


class Holder(Child):
    def __init__(self, base: str) -> None:
        super().__init__(HOLDER, base)
        assert self.line() == "ready"

    def do(self, cmd: str) -> None:
        self.say(cmd)
        assert self.line() == "done"


@pytest.fixture
def holder(base: str) -> Iterator[Holder]:
    h = Holder(base)
    try:
        yield h
    finally:
        h.stop()


def test_second_instance_fails_fast_naming_the_owner(base: str, holder: Holder) -> None:
    assert owner_pid(base) == holder.proc.pid
    assert live_pids(base) == {holder.proc.pid}
    t0 = time.monotonic()
    with pytest.raises(OwnershipError) as err:
        Ownership.acquire(base)
    assert time.monotonic() - t0 < 0.5
    assert f"(pid {holder.proc.pid}) already serves this network namespace" in str(err.value)
    assert f"kill -TERM {holder.proc.pid}" in str(err.value)
    # The failed attempt left no presence behind.
    assert live_pids(base) == {holder.proc.pid}


def test_a_stopping_owner_hands_over_and_stays_present(base: str, holder: Holder) -> None:
    holder.do("stopping")
    # Released a moment later, as kpx does once its listeners are closed.
    timer = threading.Timer(0.3, holder.do, ("release",))
    timer.start()
    t0 = time.monotonic()
    own = Ownership.acquire(base, successor_wait=5.0)
    try:
        assert 0.2 < time.monotonic() - t0 < 3.0
        timer.join()
        assert owner_pid(base) == os.getpid()
        # The old one drains: still present, so nobody removes the shared routing.
        assert live_pids(base) == {holder.proc.pid, os.getpid()}
        holder.do("close")
        assert live_pids(base) == {os.getpid()}
    finally:
        own.close()
    assert live_pids(base) == set() and owner_pid(base) is None


def test_standby_waits_for_a_serving_owner_and_takes_over_when_it_stops(
    base: str, holder: Holder
) -> None:
    """``--takeover-wait``: a DaemonSet's surge pod starts while the old one serves;
    it waits (no exit, no error) and takes over once the old one is told to stop."""
    def stop_later() -> None:
        time.sleep(0.6)  # the old pod serves on meanwhile
        holder.do("stopping")
        time.sleep(0.2)
        holder.do("release")

    timer = threading.Thread(target=stop_later)
    timer.start()
    t0 = time.monotonic()
    own = Ownership.acquire(base, successor_wait=5.0, standby=10.0)
    try:
        waited = time.monotonic() - t0
        timer.join()
        assert 0.7 < waited < 3.0, waited
        assert owner_pid(base) == os.getpid()
    finally:
        own.close()


def test_standby_gives_up_after_its_wait(base: str, holder: Holder) -> None:
    t0 = time.monotonic()
    with pytest.raises(OwnershipError, match="already serves this network namespace"):
        Ownership.acquire(base, standby=0.4)
    assert 0.4 <= time.monotonic() - t0 < 1.5
    assert owner_pid(base) == holder.proc.pid and live_pids(base) == {holder.proc.pid}


def test_a_killed_owner_frees_everything_at_once(base: str, holder: Holder) -> None:
    os.kill(holder.proc.pid, signal.SIGKILL)
    holder.proc.wait(timeout=5)
    own = Ownership.acquire(base, successor_wait=0.0)
    try:
        assert live_pids(base) == {os.getpid()}
    finally:
        own.close()


def test_routing_lock_excludes_across_threads(base: str) -> None:
    inside = 0
    most = 0
    guard = threading.Lock()

    def work() -> None:
        nonlocal inside, most
        for _ in range(5):
            with routing_lock(base, timeout=5.0) as held:
                assert held
                with guard:
                    inside += 1
                    most = max(most, inside)
                time.sleep(0.005)
                with guard:
                    inside -= 1

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert most == 1


async def test_an_attached_owner_can_be_asked_any_number_of_times(base: str) -> None:
    # More asks than the owner socket's backlog (64): each must be accepted and closed.
    own = Ownership.acquire(base)
    own.attach(asyncio.get_running_loop())
    try:
        for _ in range(100):
            assert await asyncio.to_thread(owner_pid, base) == os.getpid()
    finally:
        own.close()
    assert owner_pid(base) is None
