"""A big sync binds its listeners in slices, yielding to the loop between them.

Why (issue "Robustness", point 5): binding 10,000 listeners in one piece held
the loop for ~150 ms, and every new connection and health probe with it.
Runs in a namespace of its own (thousands of wildcard listeners must not
meet anyone else's ports), removed pass or fail.
"""

from __future__ import annotations

import asyncio

from bench import k8s_state
from lab.common import eventually
from proxy.core.model import Snapshot
from proxy.k8s import parse_state
from proxy.proxier import Proxier
from proxy.userspace.dataplane import RECONCILE_BATCH, RECONCILE_SLICE, Dataplane
from tests.support.loops import run_on
from tests.support.netns import in_fresh_netns
from tests.support.wiring import sync_config

NODE = "n1"
FIRST = 20000


def big(n: int, generation: int) -> Snapshot:
    eps = (k8s_state.Ep("127.0.0.1", NODE),)
    text = k8s_state.render([(NODE, "127.0.0.2")],
                            k8s_state.many_services(n, FIRST, eps, 8080))
    return parse_state(text, generation)


def ports(dp: Dataplane) -> set[int]:
    return {p for _a, p, state in dp.listeners() if not state.startswith("error")}


async def slices_then_supersede() -> None:
    n = 6 * RECONCILE_BATCH
    first, second = big(n, 1), big(n // 3, 2)
    dp = Dataplane(loop=asyncio.get_running_loop())
    px = Proxier(sync_config(NODE), dataplane=dp)
    try:
        px.prepare(first)  # as the source's worker thread does
        ahead = px._prepared.peek(first)
        assert ahead is not None and dp._prepared.peek(ahead.result) is not None
        px.sync(first)
        assert all(dp.plans()[p] is plan for p, plan in ahead.result.plans.items())
        # apply returned after one slice; the loop runs something before the rest.
        assert dp.reconciling() and len(ports(dp)) <= RECONCILE_BATCH
        seen: list[int] = []
        asyncio.get_running_loop().call_soon(lambda: seen.append(len(ports(dp))))
        await asyncio.sleep(0)
        assert seen and seen[0] < n, "the loop waited for the whole reconciliation"
        # A newer sync mid-way supersedes the rest: it ends exactly at its own table.
        px.sync(second)
        await eventually(lambda: not dp.reconciling(), 20, 0.001,
                         what="the reconciliation to end")
        assert ports(dp) == set(range(FIRST, FIRST + n // 3))
    finally:
        dp.close()


async def later_slices_keep_to_their_budget() -> None:
    """After the first slice (``RECONCILE_BATCH`` steps, inside ``apply``), a slice ends
    once ``RECONCILE_SLICE`` has passed, however few steps it took: on a slow machine a
    full batch was 10 ms of the loop. The clock is stepped: 1 ms a reading."""
    n = 3 * RECONCILE_BATCH
    dp = Dataplane(loop=asyncio.get_running_loop())
    px = Proxier(sync_config(NODE), dataplane=dp)
    now = [0.0]

    def clock() -> float:
        now[0] += 0.001
        return now[0]

    dp.clock = clock
    try:
        px.sync(big(n, 1))
        # A whole batch of steps: the first only reaches the first listener's turn.
        assert len(ports(dp)) == RECONCILE_BATCH - 1, "the first slice is a whole batch"
        sizes: list[int] = []
        while dp.reconciling():
            before = len(ports(dp))
            await asyncio.sleep(0)
            sizes.append(len(ports(dp)) - before)
        assert len(ports(dp)) == n
        # The deadline is read before the first step and after each: 2 ms is two steps.
        assert max(sizes) <= RECONCILE_SLICE / 0.001 + 1, sizes
    finally:
        dp.close()


def test_later_slices_keep_to_their_time_budget(loop_kind: str) -> None:
    in_fresh_netns("budget", run_on, loop_kind, later_slices_keep_to_their_budget, 60.0)


def test_big_sync_yields_between_slices_and_a_newer_one_wins(loop_kind: str) -> None:
    in_fresh_netns("slices", run_on, loop_kind, slices_then_supersede, 60.0)
