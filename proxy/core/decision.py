"""What happens to one new connection: FORWARD, DROP or REJECT.

Owns: the per-service-port decision table (``PortPlan``), rebuilt once per
state change like kube-proxy's sync, and ``decide``, which applies it to one
client. A decision is data: it carries a human-readable reason so the
dataplane can log exactly why, and tests can assert on it.

Never: touch sockets, clocks or logging. Time comes in as an argument and the
only mutable thing a decision touches is the ``Balancer`` it is handed.

The rules, in order (kube-proxy semantics section 1g, with the kpx decisions):

1. No usable endpoint anywhere -> ``Reject`` (the listener is closed, RST).
2. Traffic from the node itself (one of its addresses, or 127.0.0.0/8), and
   pod traffic when cluster CIDRs are configured -> Cluster endpoints.
   Node traffic is SNATed always; pod traffic only on cross-node hops.
3. eTP=Local, external client -> local endpoints only, client IP kept;
   none here -> ``Drop`` (the SYN is silently discarded).
4. eTP=Cluster -> Cluster endpoints, SNAT only when the endpoint is on
   another node (or always, with ``--masquerade-all``).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field

from proxy.core.balancer import Balancer
from proxy.core.endpoints import EndpointInfo, categorize_endpoints, service_port_endpoints
from proxy.core.model import Service, ServicePort, Snapshot

LOOPBACK = ipaddress.ip_network("127.0.0.0/8")


@dataclass(frozen=True, slots=True)
class Forward:
    """Connect to ``endpoint``; ``why`` is the rule that chose the candidates.

    The full ``reason`` is spelled out only when asked for (logs, tools):
    a string built for every connection is paid on the hot path (see
    docs/PERFORMANCE.md, "Figures moved out of docstrings").
    """

    endpoint: EndpointInfo
    snat: bool
    why: str = ""

    @property
    def reason(self) -> str:
        return f"{self.why} -> {self.endpoint}{' (SNAT)' if self.snat else ''}"


@dataclass(frozen=True, slots=True)
class Drop:
    reason: str


@dataclass(frozen=True, slots=True)
class Reject:
    reason: str


Decision = Forward | Drop | Reject


@dataclass(frozen=True, slots=True)
class PortPlan:
    """Everything the hot path needs for one NodePort, computed once per sync."""

    service: Service
    port: ServicePort
    cluster: tuple[EndpointInfo, ...]
    local: tuple[EndpointInfo, ...]
    has_any: bool
    masquerade_all: bool = False
    remote_count: int = field(default=0)
    # Read by every connection, or by every sync for every port: derived
    # from the Service once, when the plan is built.
    key: str = field(init=False)
    """``ns/name:port`` (or ``ns/name`` for an unnamed port), kube-proxy's svcPortName."""
    policy_local: bool = field(init=False)
    affinity_seconds: float | None = field(init=False)
    """Seconds of ClientIP affinity; None without affinity."""

    def __post_init__(self) -> None:
        svc, name = self.service, self.port.name
        setattr_ = object.__setattr__
        setattr_(self, "key", f"{svc.key}:{name}" if name else svc.key)
        setattr_(self, "policy_local", svc.external_policy_local)
        setattr_(
            self, "affinity_seconds",
            float(svc.affinity_timeout_seconds) if svc.session_affinity == "ClientIP" else None,
        )

    @property
    def node_port(self) -> int:
        return self.port.node_port

    @property
    def listen(self) -> bool:
        """False means REJECT: hold no listening socket at all."""
        return self.has_any

    @property
    def drop_external(self) -> bool:
        """True means external SYNs are dropped (eTP=Local, nothing here)."""
        return self.has_any and self.policy_local and not self.local


def build_plan(
    snapshot: Snapshot,
    node_name: str,
    service: Service,
    port: ServicePort,
    masquerade_all: bool = False,
) -> PortPlan:
    eps = service_port_endpoints(snapshot, service, port, node_name)
    cat = categorize_endpoints(eps, service)
    return PortPlan(
        service=service,
        port=port,
        cluster=cat.cluster,
        local=cat.local,
        has_any=cat.has_any,
        masquerade_all=masquerade_all,
        remote_count=sum(1 for e in cat.cluster if not e.is_local),
    )


PROXIED_TYPES = ("NodePort", "LoadBalancer")
"""Service types whose NodePorts kpx serves."""


def proxied_services(snapshot: Snapshot) -> Iterable[Service]:
    """Services whose NodePorts kpx serves; parse has already dropped ignored ones."""
    return (s for s in snapshot.services if s.type in PROXIED_TYPES)


class PlanCache:
    """Last sync's plans per service, so ``build_plans`` rebuilds only what the source says changed.

    A service's plans are a pure function of the Service, the slices the
    snapshot holds for it, the node name and ``masquerade_all``. The source
    that made the snapshot says which services' Service or slices changed
    (``snapshot.changes``, see ``proxy.core.changes``), relative to an
    earlier generation. When that generation is the one this cache last
    built from, only those services' plans are rebuilt; every other
    PortPlan is handed back as the very same object. Otherwise (the first
    build, changes relative to something else, nobody said what changed, a
    different node name or ``masquerade_all``) everything is built afresh.

    Reuse is safe because every PortPlan is frozen and holds only immutable
    values, and it lets a caller diff two tables by identity: ``new[port] is
    old[port]`` means nothing changed for that port.

    Pure bookkeeping, no I/O. One cache per table being maintained (one per
    proxier). ``built`` and ``reused`` count services in the last
    ``build_plans`` call.
    """

    __slots__ = ("_generation", "_inputs", "_plans_of", "_table", "built", "reused")

    def __init__(self) -> None:
        self._inputs: tuple[str, bool] | None = None
        self._generation: int | None = None
        self._plans_of: dict[str, tuple[PortPlan, ...]] = {}
        """Service key -> its plans, for every proxied service of the last build."""
        self._table: dict[int, PortPlan] = {}
        self.reused = 0
        self.built = 0

    def changed_since_last(
        self, snapshot: Snapshot, node_name: str, masquerade_all: bool
    ) -> frozenset[str] | None:
        """The service keys to rebuild for ``snapshot``, or None to rebuild all."""
        if self._inputs != (node_name, masquerade_all):
            return None
        return snapshot.changes.relative_to(self._generation)


def _service_plans(
    snapshot: Snapshot, node_name: str, service: Service, masquerade_all: bool
) -> tuple[PortPlan, ...]:
    return tuple(
        build_plan(snapshot, node_name, service, port, masquerade_all)
        for port in service.ports
        if port.node_port and port.protocol == "TCP"
    )


def build_plans(
    snapshot: Snapshot,
    node_name: str,
    masquerade_all: bool = False,
    cache: PlanCache | None = None,
) -> dict[int, PortPlan]:
    """The whole node's decision table, keyed by nodePort (TCP only), in service order.

    With a ``cache``, only the services ``snapshot.changes`` names are
    rebuilt when it can (see ``PlanCache``); the table is equal, and in the
    same order, either way.
    """
    changed = None if cache is None else cache.changed_since_last(
        snapshot, node_name, masquerade_all
    )
    if changed is None:
        services = list(proxied_services(snapshot))
        every = [_service_plans(snapshot, node_name, svc, masquerade_all) for svc in services]
        plans_of = dict(zip([svc.key for svc in services], every, strict=True))
        # From the list, not ``plans_of``: a hand-made snapshot may hold two
        # services under one key, and both serve.
        table = {plan.port.node_port: plan for plans in every for plan in plans}
        built = len(every)
    else:
        assert cache is not None
        plans_of, table, built = cache._plans_of, dict(cache._table), 0
        moved = False
        for key in changed:
            old = plans_of.pop(key, ())
            service = snapshot.service(key)
            plans: tuple[PortPlan, ...] = ()
            if service is not None and service.type in PROXIED_TYPES:
                plans_of[key] = plans = _service_plans(snapshot, node_name, service, masquerade_all)
                built += 1
            if [p.port.node_port for p in old] != [p.port.node_port for p in plans]:
                moved = True
            elif not moved:
                for plan in plans:  # same ports: each keeps its place in the table
                    table[plan.port.node_port] = plan
        if moved:
            # A port came, went or passed between services: one pass in
            # service order, every unchanged plan reused as it is.
            table = {
                plan.port.node_port: plan
                for svc in proxied_services(snapshot)
                for plan in plans_of[svc.key]
            }
    if cache is None:
        return table
    cache._inputs = (node_name, masquerade_all)
    cache._generation = snapshot.generation
    cache._plans_of, cache._table = plans_of, table
    cache.built, cache.reused = built, len(plans_of) - built
    return dict(table)


def is_node_source(client_ip: str, local_addresses: Collection[str]) -> bool:
    """Traffic from the node itself: any of its addresses, or 127.0.0.0/8."""
    return client_ip in local_addresses or client_ip.startswith("127.")


def _in_any(ip: str, nets: Collection[ipaddress.IPv4Network | ipaddress.IPv6Network]) -> bool:
    if not nets:
        return False
    try:
        addr = ipaddress.ip_address(ip)
    except ValueError:
        return False
    return any(addr in n for n in nets)


def decide(
    plan: PortPlan,
    client_ip: str,
    local_addresses: Collection[str],
    balancer: Balancer,
    now: float,
    exclude: Collection[tuple[str, int]] = (),
    cluster_cidrs: Collection[ipaddress.IPv4Network | ipaddress.IPv6Network] = (),
) -> Decision:
    """Decide one new connection from ``client_ip`` to ``plan``'s NodePort.

    ``exclude`` lists endpoints that already failed for this connection, so a
    retry picks another one; ``balancer`` holds round-robin and ClientIP
    affinity state for this service port.
    """
    if not plan.has_any:
        return Reject(f"{plan.key} has no endpoints")

    node_source = is_node_source(client_ip, local_addresses)
    pod_source = not node_source and _in_any(client_ip, cluster_cidrs)
    if plan.policy_local and not node_source and not pod_source:
        candidates = plan.local
        if not candidates:
            return Drop(
                f"{plan.key} eTP=Local has no local endpoints "
                f"({plan.remote_count} elsewhere)"
            )
        why = "eTP=Local, external client"
    else:
        candidates = plan.cluster
        why = (
            "node-originated" if node_source
            else "pod-originated" if pod_source
            else "eTP=Cluster"
        )

    ep = balancer.pick(candidates, client_ip, now, plan.affinity_seconds, exclude)
    if ep is None:
        return Reject(f"{plan.key}: every eligible endpoint failed for {client_ip}")
    # The node's own traffic always SNATs (iptables marks --src-type LOCAL for
    # masquerade). Otherwise only a cross-node hop must, because its reply
    # would not come back through this node (kpx decision 3);
    # --masquerade-all restores "always" for eTP=Cluster, never for eTP=Local
    # external clients, whose source IP is the point of the policy.
    snat = node_source or (plan.masquerade_all and not plan.policy_local) or not ep.is_local
    return Forward(ep, snat, why)


def decide_in_snapshot(
    snapshot: Snapshot,
    node_name: str,
    service_key: str,
    port_name: str,
    client_ip: str,
    local_addresses: Collection[str],
    balancer: Balancer | None = None,
    now: float = 0.0,
    masquerade_all: bool = False,
) -> Decision:
    """Convenience form of ``decide`` over a whole snapshot, for tests and tools."""
    svc = snapshot.service(service_key)
    if svc is None:
        return Reject(f"{service_key} does not exist")
    port = next((p for p in svc.ports if p.name == port_name), None)
    if port is None:
        return Reject(f"{service_key} has no port {port_name!r}")
    plan = build_plan(snapshot, node_name, svc, port, masquerade_all)
    return decide(plan, client_ip, local_addresses, balancer or Balancer(), now)
