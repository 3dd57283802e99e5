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

from proxy.balancer import Balancer
from proxy.endpoints import EndpointInfo, categorize_endpoints, service_port_endpoints
from proxy.model import Service, ServicePort, Snapshot

LOOPBACK = ipaddress.ip_network("127.0.0.0/8")


@dataclass(frozen=True, slots=True)
class Forward:
    endpoint: EndpointInfo
    snat: bool
    reason: str = ""


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

    @property
    def key(self) -> str:
        """``ns/name:port`` (or ``ns/name`` for an unnamed port), kube-proxy's svcPortName."""
        if self.port.name:
            return f"{self.service.key}:{self.port.name}"
        return self.service.key

    @property
    def node_port(self) -> int:
        return self.port.node_port

    @property
    def policy_local(self) -> bool:
        return self.service.external_policy_local

    @property
    def listen(self) -> bool:
        """False means REJECT: hold no listening socket at all."""
        return self.has_any

    @property
    def drop_external(self) -> bool:
        """True means external SYNs are dropped (eTP=Local, nothing here)."""
        return self.has_any and self.policy_local and not self.local

    @property
    def affinity_seconds(self) -> float | None:
        if self.service.session_affinity == "ClientIP":
            return float(self.service.affinity_timeout_seconds)
        return None


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


def build_plans(
    snapshot: Snapshot, node_name: str, masquerade_all: bool = False
) -> dict[int, PortPlan]:
    """The whole node's decision table, keyed by nodePort (TCP only)."""
    plans: dict[int, PortPlan] = {}
    for svc in proxied_services(snapshot):
        for p in svc.ports:
            if p.node_port and p.protocol == "TCP":
                plans[p.node_port] = build_plan(snapshot, node_name, svc, p, masquerade_all)
    return plans


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
    return Forward(ep, snat, f"{why} -> {ep}{' (SNAT)' if snat else ''}")


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
