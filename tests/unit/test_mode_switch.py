"""What an nfqueue-mode kpx does after a relay: the TIME_WAIT sweep runs on the sync's worker, and
its failure is said once."""

from __future__ import annotations

import asyncio
import errno
import logging
from typing import Any

import pytest

from proxy.commands import wiring


class _Plane:
    families = (4, 6)
    synced = asyncio.Event()

    def tcp_endpoints(self, family: int) -> frozenset[tuple[str, int]]:
        return frozenset({("10.244.1.11", 8080)})

    def __init__(self) -> None:
        self.ran: list[Any] = []

    async def off_loop(self, fn: Any, *args: object) -> Any:
        """The dataplane's worker: every pyroute2 call of the process goes through it."""
        self.ran.append(fn)
        return fn(*args)


def test_a_kernel_that_cannot_close_the_relays_sockets_is_told_once_and_logged_once(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    asked: list[int] = []

    def refuse(family: int, endpoints: Any) -> int:
        asked.append(family)
        if family == 6:
            return 0
        raise OSError(errno.EOPNOTSUPP, "sock_diag destroy: Operation not supported")

    looks = iter([{1}, {1}, {1}, set()])  # the relay drains for three looks, then is gone
    monkeypatch.setattr(wiring, "close_time_wait_legs", refuse)
    monkeypatch.setattr(wiring, "live_pids", lambda: next(looks))
    monkeypatch.setattr(wiring, "LEFTOVER_POLL", 0.0)
    monkeypatch.setattr(wiring.TransparentRouting, "remove_left_behind",
                        lambda self: asyncio.sleep(0, result=False))

    plane = _Plane()

    async def go() -> None:
        plane.synced = asyncio.Event()
        plane.synced.set()
        await wiring.remove_relay_leftovers(plane)  # type: ignore[arg-type]

    with caplog.at_level(logging.ERROR):
        asyncio.run(go())
    assert asked == [4, 6, 6, 6, 6], "IPv4 is not asked again once refused"
    # On the sync's worker, where conntrack's pyroute2 calls run too: two threads
    # importing pyroute2 at once made a sync's stale-UDP cleanup fail.
    assert plane.ran == [refuse] * 5
    errors = [r for r in caplog.records if "TIME_WAIT" in r.getMessage()]
    assert len(errors) == 1 and "IPv4" in errors[0].getMessage()
