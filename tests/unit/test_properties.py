"""Properties of the pure core over random endpoint sets, from raw YAML objects to decisions.

States are generated as the decoded YAML kubectl would print (conditions
true, false, null or absent; nodes here, elsewhere or unnamed; duplicates
across slices) and go through ``parse_objects``, so nil resolution, slice
merging, categorization and the decision are checked together.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.core.balancer import Balancer
from proxy.core.decision import Drop, Forward, PortPlan, Reject, build_plans, decide
from proxy.core.endpoints import EndpointInfo, service_port_endpoints
from proxy.core.model import Snapshot
from proxy.k8s import parse_objects

HERE = "node-a"
NODE_IPS = frozenset({"192.168.49.2"})
POD_CIDRS = [ipaddress.ip_network("10.244.0.0/16")]
CLIENTS = {
    "external": "198.51.100.20",
    "node": "192.168.49.2",
    "loopback": "127.0.0.1",
    "pod": "10.244.9.9",
}
IPS = [f"10.244.{n}.{i}" for n in range(2) for i in range(1, 5)]
ABSENT = object()

conditions_value = st.sampled_from([True, False, None, ABSENT])


@st.composite
def raw_endpoint(draw: st.DrawFn) -> dict[str, Any]:
    ep: dict[str, Any] = {"addresses": [draw(st.sampled_from(IPS))]}
    node = draw(st.sampled_from([HERE, "node-b", "node-c", None]))
    if node is not None:
        ep["nodeName"] = node
    if draw(st.booleans()):
        conditions = {}
        for key in ("ready", "serving", "terminating"):
            value = draw(conditions_value)
            if value is not ABSENT:
                conditions[key] = value
        ep["conditions"] = conditions
    return ep


@dataclass(frozen=True)
class State:
    snapshot: Snapshot
    raw: list[dict[str, Any]]
    """Every raw endpoint of the service's port, in stream order."""
    policy: str

    @property
    def plan(self) -> PortPlan:
        return build_plans(self.snapshot, HERE)[30080]

    def endpoints(self) -> tuple[EndpointInfo, ...]:
        svc = self.snapshot.services[0]
        return service_port_endpoints(self.snapshot, svc, svc.ports[0], HERE)


@st.composite
def states(draw: st.DrawFn) -> State:
    policy = draw(st.sampled_from(["Cluster", "Local"]))
    slices = draw(st.lists(st.lists(raw_endpoint(), max_size=6), min_size=1, max_size=3))
    items: list[dict[str, Any]] = [
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": "web", "namespace": "default"},
            "spec": {
                "type": "LoadBalancer" if policy == "Local" else "NodePort",
                "externalTrafficPolicy": policy,
                "ports": [{"name": "http", "port": 80, "nodePort": 30080}],
            },
        }
    ]
    for i, endpoints in enumerate(slices):
        items.append(
            {
                "apiVersion": "discovery.k8s.io/v1",
                "kind": "EndpointSlice",
                "addressType": "IPv4",
                "metadata": {"name": f"web-{i}", "labels": {"kubernetes.io/service-name": "web"}},
                "endpoints": endpoints,
                "ports": [{"name": "http", "port": 8080}, {"name": "metrics", "port": 9090}],
            }
        )
    snapshot = parse_objects([{"kind": "List", "items": items}])
    return State(snapshot, [ep for eps in slices for ep in eps], policy)


def resolve(raw: dict[str, Any]) -> tuple[bool, bool, bool]:
    """kube-proxy's nil rule, written out independently of the parser."""
    c = raw.get("conditions", {})
    ready = c.get("ready")
    serving = c.get("serving")
    terminating = c.get("terminating")
    return (ready is not False, serving is not False, terminating is True)


def usable(e: EndpointInfo) -> bool:
    return e.ready or (e.serving and e.terminating)


# -- resolution and merging -------------------------------------------------------------


@given(states())
def test_merged_endpoints_follow_the_raw_objects(state: State) -> None:
    eps = state.endpoints()
    assert len({e.addr for e in eps}) == len(eps)
    assert {e.ip for e in eps} == {r["addresses"][0] for r in state.raw}
    assert all(e.port == 8080 for e in eps)  # the "metrics" port never leaks in
    for e in eps:
        copies = [r for r in state.raw if r["addresses"][0] == e.ip]
        non_terminating = [r for r in copies if not resolve(r)[2]]
        # The non-terminating copy wins; a terminating one only when it is all there is.
        kept = non_terminating or copies
        assert (e.ready, e.serving, e.terminating) in {resolve(r) for r in kept}
        assert e.is_local == (e.node_name == HERE)


# -- categorization ----------------------------------------------------------------------


@settings(max_examples=400)
@given(states())
def test_categorization_invariants(state: State) -> None:
    eps = state.endpoints()
    plan = state.plan
    ready = tuple(e for e in eps if e.ready)
    serving_terminating = tuple(e for e in eps if e.serving and e.terminating)

    assert set(plan.cluster) <= {e for e in eps if usable(e)}
    # Any ready endpoint anywhere means exactly the ready ones; else the fallback.
    assert plan.cluster == (ready or serving_terminating)
    assert plan.has_any == bool(plan.cluster) == any(usable(e) for e in eps)

    assert all(e.is_local for e in plan.local)
    if state.policy == "Local":
        local_ready = tuple(e for e in ready if e.is_local)
        local_st = tuple(e for e in serving_terminating if e.is_local)
        assert plan.local == (local_ready or local_st)
        assert set(plan.local) <= set(plan.cluster) | set(local_st)
    else:
        assert plan.local == ()
    assert plan.remote_count == sum(not e.is_local for e in plan.cluster)
    assert plan.listen == plan.has_any
    assert plan.drop_external == (plan.has_any and state.policy == "Local" and not plan.local)


# -- decisions --------------------------------------------------------------------------------


@settings(max_examples=400)
@given(states(), st.sampled_from(sorted(CLIENTS)), st.booleans(), st.integers(0, 5))
def test_decision_invariants(state: State, kind: str, masquerade_all: bool, warmup: int) -> None:
    plan = build_plans(state.snapshot, HERE, masquerade_all)[30080]
    balancer = Balancer()
    for _ in range(warmup):  # start the round-robin cursor anywhere
        decide(plan, CLIENTS["pod"], NODE_IPS, balancer, 0.0, (), POD_CIDRS)
    decision = decide(plan, CLIENTS[kind], NODE_IPS, balancer, 1.0, (), POD_CIDRS)
    external = kind == "external"
    local_policy = state.policy == "Local"

    # Reject iff nothing usable anywhere (there are no exclusions here).
    assert isinstance(decision, Reject) == (not plan.has_any)
    # Drop iff eTP=Local, an external client, something elsewhere and nothing here.
    should_drop = local_policy and external and plan.has_any and not plan.local
    assert isinstance(decision, Drop) == should_drop
    if not isinstance(decision, Forward):
        return

    applicable = plan.local if local_policy and external else plan.cluster
    assert decision.endpoint in applicable
    ep = decision.endpoint
    if kind in ("node", "loopback") or not ep.is_local:
        # The node's own traffic always; anything else on a cross-node hop.
        assert decision.snat
    elif external and not masquerade_all:
        assert not decision.snat
    if local_policy and external:
        assert not decision.snat  # the client IP is the point of eTP=Local


@given(states(), st.sampled_from(sorted(CLIENTS)), st.data())
def test_retries_never_repeat_an_endpoint(state: State, kind: str, data: st.DataObject) -> None:
    plan = state.plan
    failed: set[tuple[str, int]] = set()
    balancer = Balancer()
    affinity = data.draw(st.sampled_from([None, 10.0]))
    for _ in range(len(plan.cluster) + 1):
        ep = balancer.pick(
            plan.local if state.policy == "Local" and kind == "external" else plan.cluster,
            CLIENTS[kind],
            0.0,
            affinity,
            failed,
        )
        if ep is None:
            break
        assert ep.addr not in failed
        failed.add(ep.addr)
    # Every candidate is tried once before giving up.
    candidates = plan.local if state.policy == "Local" and kind == "external" else plan.cluster
    assert failed == {e.addr for e in candidates}


# -- the balancer on its own ---------------------------------------------------------------------


def endpoints(n: int) -> tuple[EndpointInfo, ...]:
    return tuple(EndpointInfo(f"10.0.{i // 250}.{i % 250}", 80, None, False) for i in range(n))


@given(st.integers(1, 40), st.integers(0, 100), st.lists(st.sampled_from(list(CLIENTS.values()))))
def test_round_robin_visits_each_candidate_once_per_n_picks(
    n: int, warmup: int, clients: list[str]
) -> None:
    candidates = endpoints(n)
    balancer = Balancer()
    for i in range(warmup):
        balancer.pick(endpoints(1 + i % 7), "203.0.113.1", 0.0)
    for _round in range(2):
        picks = [balancer.pick(candidates, c, 0.0) for c in (clients * n + ["x"] * n)[:n]]
        assert sorted(p.addr for p in picks if p) == sorted(e.addr for e in candidates)


@given(
    st.integers(1, 5),
    st.lists(
        st.tuples(st.sampled_from(["a", "b", "c"]), st.floats(0, 20), st.integers(0, 4)),
        max_size=40,
    ),
)
def test_affinity_matches_a_reference_model(n: int, events: list[tuple[str, float, int]]) -> None:
    """Sticky iff the client's last pick was < timeout ago and its target is still a candidate."""
    timeout = 10.0
    everyone = endpoints(5)
    balancer = Balancer()
    model: dict[str, tuple[tuple[str, int], float]] = {}
    now = 0.0
    for client, gap, drop in events:
        now += gap
        candidates = tuple(e for i, e in enumerate(everyone[:n]) if i != drop) or everyone[:1]
        ep = balancer.pick(candidates, client, now, timeout)
        assert ep is not None and ep in candidates
        record = model.get(client)
        if record and now - record[1] < timeout and record[0] in {c.addr for c in candidates}:
            assert ep.addr == record[0]
        model[client] = (ep.addr, now)
