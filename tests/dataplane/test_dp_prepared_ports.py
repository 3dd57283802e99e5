"""The forwarder's port table is built by ``prepare`` (the source's thread), not on the loop.

Why (issue "Robustness", point 5): 10,000 new PortStates took 10 ms on the
loop at each big publish. ``apply`` uses the prepared table only if it was
made from the table still in force; either way the result is the same:
unchanged plans keep their PortState, a service port keeps its balancer and
counters, and balancers of gone service ports are dropped.
No listener is opened here (``_swap_plans`` only), so no namespace is needed.
"""

from __future__ import annotations

import asyncio

from dploop import run_on

from bench import k8s_state
from proxy.core.decision import build_plans
from proxy.core.model import Snapshot
from proxy.k8s import parse_state
from proxy.userspace.dataplane import Dataplane

NODE = "n1"


def state(n: int, endpoint: str, generation: int) -> Snapshot:
    eps = (k8s_state.Ep(endpoint, NODE),)
    text = k8s_state.render([(NODE, "127.0.0.2")],
                            k8s_state.many_services(n, 20000, eps, 8080))
    return parse_state(text, generation)


def swap(dp: Dataplane, snapshot: Snapshot, prepared: bool) -> None:
    """What ``apply`` does to the table, with or without ``prepare`` first."""
    if prepared:
        dp.prepare(snapshot)
        prepared = dp._prepared.take(snapshot)
        assert prepared is not None
        plans, _, table = prepared
    else:
        plans, table = build_plans(snapshot, NODE, cache=dp._plan_cache), None
    dp._swap_plans(plans, table)


async def same_table_either_way() -> None:
    loop = asyncio.get_running_loop()
    tables = []
    for prepared in (True, False):
        dp = Dataplane(NODE, loop=loop)
        try:
            swap(dp, state(5, "10.0.0.1", 1), prepared)
            first = dict(dp.forwarder.ports)
            balancers = dict(dp._balancers)
            second = state(3, "10.0.0.2", 2)
            swap(dp, second, prepared)  # every plan changed, 2 ports gone
            ports = dp.forwarder.ports
            assert sorted(ports) == [20000, 20001, 20002]
            for port, st in ports.items():
                assert st is not first[port] and st.plan is dp.plans()[port]
                assert st.balancer is first[port].balancer  # affinity survives the reload
                assert st.metrics is first[port].metrics
            assert set(dp._balancers) == {st.plan.key for st in ports.values()}
            assert all(dp._balancers[k] is balancers[k] for k in dp._balancers)
            before = dict(ports)
            swap(dp, second, prepared)  # same plans (PlanCache): same PortStates
            assert all(dp.forwarder.ports[p] is before[p] for p in before)
            tables.append({p: (st.plan.key, st.plan.port) for p, st in dp.forwarder.ports.items()})
        finally:
            dp.close()
    assert tables[0] == tables[1]


async def stale_prepared_table_is_made_again() -> None:
    dp = Dataplane(NODE, loop=asyncio.get_running_loop())
    try:
        one, two = state(4, "10.0.0.1", 1), state(4, "10.0.0.2", 2)
        dp.prepare(two)
        prepared = dp._prepared.take(two)
        assert prepared is not None
        plans, _, stale = prepared
        swap(dp, one, prepared=False)  # the table in force changed since ``prepare``
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
