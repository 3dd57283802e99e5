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
from itertools import compress
from operator import is_, is_not

from proxy.core.balancer import Balancer
from proxy.core.endpoints import EndpointInfo, categorize_endpoints, service_port_endpoints
from proxy.core.model import EndpointSlice, Service, ServicePort, Snapshot

LOOPBACK = ipaddress.ip_network("127.0.0.0/8")


@dataclass(frozen=True, slots=True)
class Forward:
    """Connect to ``endpoint``; ``why`` is the rule that chose the candidates.

    The full ``reason`` is spelled out only when asked for (logs, tools):
    building it for every connection cost about 1 µs of the hot path.
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


def proxied_services(snapshot: Snapshot) -> Iterable[Service]:
    """Services whose NodePorts kpx serves; parse has already dropped ignored ones."""
    return (s for s in snapshot.services if s.type in ("NodePort", "LoadBalancer"))


_Entry = tuple[Service, tuple[EndpointSlice, ...], tuple[PortPlan, ...]]
"""A service, the slices its plans were built from, and those plans."""


class PlanCache:
    """Last sync's plans per service, so ``build_plans`` rebuilds only what changed.

    A service's plans are a pure function of the Service, the slices the
    snapshot holds for it, the node name and ``masquerade_all``. When a
    service's Service object is the very same one as last time (``is``:
    ``proxy.k8s.StateParser`` hands out the same immutable objects for every
    document that did not change) and its slices compare equal (a tuple
    compare, which tries ``is`` first), its last PortPlans are reused as
    they are. Reuse is safe because every PortPlan is frozen and holds only
    immutable values, and it lets a caller diff two tables by identity:
    ``new[port] is old[port]`` means nothing changed for that port.

    When the services are the very same objects in the same order and only
    slices changed (an endpoint came, went or changed condition), the
    changed slices are found by comparing the two snapshots' slice tuples
    position by position, in C, and only their services are looked at; the
    table keeps its order because no service or port moved.

    Pure bookkeeping, no I/O. One cache per table being maintained (a
    dataplane, a healthz sidecar); a different node name or
    ``masquerade_all`` starts it afresh. ``built`` and ``reused`` count
    services in the last ``build_plans`` call.
    """

    __slots__ = (
        "_entries",
        "_inputs",
        "_plans",
        "_services",
        "_slices",
        "_unique_keys",
        "built",
        "reused",
    )

    def __init__(self) -> None:
        self._reset(None)
        self.reused = 0
        self.built = 0

    def _reset(self, inputs: tuple[str, bool] | None) -> None:
        self._inputs = inputs
        self._entries: dict[str, _Entry] = {}
        self._services: tuple[Service, ...] = ()
        self._slices: tuple[EndpointSlice, ...] = ()
        self._plans: dict[int, PortPlan] = {}
        self._unique_keys = False

    def _remember(
        self, snapshot: Snapshot, plans: dict[int, PortPlan], built: int
    ) -> dict[int, PortPlan]:
        """Keep this call's inputs and table; the caller gets a copy it may change."""
        self._services, self._slices, self._plans = snapshot.services, snapshot.slices, plans
        self.built = built
        self.reused = len(self._entries) - built
        return dict(plans)

    def _slices_changed_for(self, snapshot: Snapshot) -> set[str] | None:
        """Keys of the services whose slices changed, if nothing else did; else None."""
        services, slices = snapshot.services, snapshot.slices
        if (
            not self._unique_keys  # Then a key does not name one service.
            or len(services) != len(self._services)
            or not all(map(is_, services, self._services))
            or len(slices) != len(self._slices)
        ):
            return None
        keys: set[str] = set()
        for i in compress(range(len(slices)), map(is_not, slices, self._slices)):
            keys.add(slices[i].service_key)
            keys.add(self._slices[i].service_key)
        return keys


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
    """The whole node's decision table, keyed by nodePort (TCP only).

    With a ``cache``, services whose inputs did not change since the last
    call with that cache keep their PortPlan objects (see ``PlanCache``);
    the table is equal, and in the same order, either way.
    """
    plans: dict[int, PortPlan] = {}
    if cache is None:
        for svc in proxied_services(snapshot):
            for plan in _service_plans(snapshot, node_name, svc, masquerade_all):
                plans[plan.port.node_port] = plan
        return plans

    if cache._inputs != (node_name, masquerade_all):
        cache._reset((node_name, masquerade_all))
    last = cache._entries
    built = 0

    changed = cache._slices_changed_for(snapshot)
    if changed is not None:
        plans = dict(cache._plans)
        for key in changed:
            service = snapshot.service(key)
            entry = last.get(key)
            if entry is None or service is None:
                continue  # Not a proxied service (or its slice's service is gone).
            slices = snapshot.slices_for(service)
            if entry[1] == slices:
                continue
            entry = (service, slices,
                     _service_plans(snapshot, node_name, service, masquerade_all))
            last[key] = entry
            built += 1
            for plan in entry[2]:
                plans[plan.port.node_port] = plan
        return cache._remember(snapshot, plans, built)

    entries: dict[str, _Entry] = {}
    for svc in proxied_services(snapshot):
        slices = snapshot.slices_for(svc)
        entry = last.get(svc.key)
        if entry is None or entry[0] is not svc or entry[1] != slices:
            entry = (svc, slices, _service_plans(snapshot, node_name, svc, masquerade_all))
            built += 1
        entries[svc.key] = entry
        for plan in entry[2]:
            plans[plan.port.node_port] = plan
    cache._entries = entries
    cache._unique_keys = len({svc.key for svc in snapshot.services}) == len(snapshot.services)
    return cache._remember(snapshot, plans, built)


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
