"""The forwarder's port table is built by ``prepare`` (the source's thread), not on the loop.

Why (issue "Robustness", point 5): 10,000 new PortStates held the loop at
each big publish. ``apply`` uses the prepared table only if it was
made from the table still in force; either way the result is the same:
unchanged plans keep their PortState, a service port keeps its balancer and
counters, and balancers of gone service ports are dropped.
No listener is opened here (``_swap_plans`` only), so no namespace is needed.
"""

from __future__ import annotations

import asyncio

from bench import k8s_state
from proxy.core.decision import PortPlan
from proxy.core.model import Snapshot
from proxy.k8s import StateParser, parse_state
from proxy.proxier import Proxier
from proxy.userspace.dataplane import Dataplane, _PortTable
from tests.support.loops import run_on
from tests.support.wiring import sync_config

NODE = "n1"


def state(n: int, endpoint: str, generation: int, parser: StateParser | None = None) -> Snapshot:
    """``n`` services with one endpoint each; through ``parser``, it says what changed."""
    eps = (k8s_state.Ep(endpoint, NODE),)
    text = k8s_state.render([(NODE, "127.0.0.2")],
                            k8s_state.many_services(n, 20000, eps, 8080))
    return parse_state(text, generation) if parser is None else parser.parse(text, generation)


def prepared_table(px: Proxier, snapshot: Snapshot) -> tuple[dict[int, PortPlan], _PortTable]:
    """What the worker thread's half of a sync made of ``snapshot``: its plans and port table."""
    dp = px.dataplane
    assert isinstance(dp, Dataplane)
    px.prepare(snapshot)
    ahead = px._prepared.take(snapshot)
    assert ahead is not None
    made = dp._prepared.take(ahead.result)
    assert made is not None
    return ahead.result.plans, made[1]


def swap(px: Proxier, snapshot: Snapshot, prepared: bool) -> None:
    """What ``apply`` does to the table, with or without ``prepare`` first."""
    dp = px.dataplane
    assert isinstance(dp, Dataplane)
    if prepared:
        plans, table = prepared_table(px, snapshot)
    else:
        plans, table = px._compute(snapshot).plans, None
    dp._swap_plans(plans, table)


async def same_table_either_way() -> None:
    loop = asyncio.get_running_loop()
    tables = []
    for prepared in (True, False):
        dp = Dataplane(loop=loop)
        px = Proxier(sync_config(NODE), dataplane=dp)
        try:
            parser = StateParser()
            swap(px, state(5, "10.0.0.1", 1, parser), prepared)
            first = dict(dp.forwarder.ports)
            balancers = dict(dp._balancers)
            second = state(3, "10.0.0.2", 2, parser)
            swap(px, second, prepared)  # every plan changed, 2 ports gone
            ports = dp.forwarder.ports
            assert sorted(ports) == [20000, 20001, 20002]
            for port, st in ports.items():
                assert st is not first[port] and st.plan is dp.plans()[port]
                assert st.balancer is first[port].balancer  # affinity survives the reload
                assert st.metrics is first[port].metrics
            assert set(dp._balancers) == {st.plan.key for st in ports.values()}
            assert all(dp._balancers[k] is balancers[k] for k in dp._balancers)
            before = dict(ports)
            # The same state again: the parser says nothing changed, so every
            # plan is kept (PlanCache), and so is every PortState.
            swap(px, state(3, "10.0.0.2", 3, parser), prepared)
            assert all(dp.forwarder.ports[p] is before[p] for p in before)
            tables.append({p: (st.plan.key, st.plan.port) for p, st in dp.forwarder.ports.items()})
        finally:
            dp.close()
    assert tables[0] == tables[1]


async def stale_prepared_table_is_made_again() -> None:
    dp = Dataplane(loop=asyncio.get_running_loop())
    px = Proxier(sync_config(NODE), dataplane=dp)
    try:
        one, two = state(4, "10.0.0.1", 1), state(4, "10.0.0.2", 2)
        plans, stale = prepared_table(px, two)
        swap(px, one, prepared=False)  # the table in force changed since ``prepare``
        kept = {st.plan.key: st.balancer for st in dp.forwarder.ports.values()}
        dp._swap_plans(plans, stale)
        assert dp.plans() == plans
        for st in dp.forwarder.ports.values():
            assert st.plan is plans[st.plan.port.node_port]
            assert st.balancer is kept[st.plan.key] is dp._balancers[st.plan.key]
    finally:
        dp.close()


def test_prepared_and_loop_built_tables_are_the_same(loop_kind: str) -> None:
    run_on(loop_kind, same_table_either_way)


def test_a_table_prepared_from_an_older_table_is_not_used(loop_kind: str) -> None:
    run_on(loop_kind, stale_prepared_table_is_made_again)
