"""Endpoint resolution and categorization: kube-proxy's ``topology.go`` in Python.

Owns: turning a Service port plus its EndpointSlices into the endpoint lists a
proxy may use (``categorize_endpoints``), and the per-Service count of local
ready endpoints that the healthCheckNodePort server reports.

Never: do I/O, hold state between calls, or know about sockets. Every function
here is a pure function of immutable inputs.

Rules (KEP-1669, ``CategorizeEndpoints``):

- Locality is ``endpoint.nodeName == this node``; IPs are never compared.
- Cluster endpoints are all ready endpoints; only when *no* endpoint is ready
  anywhere do serving-and-terminating endpoints stand in for them.
- Local endpoints are local ready endpoints, else local serving-and-terminating
  ones. That fallback is decided on its own, even while ready endpoints exist
  on other nodes: a draining node keeps serving its own clients.
- ``has_any`` says whether a usable endpoint exists anywhere. It is the line
  between REJECT (nothing anywhere) and DROP (nothing here).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import NamedTuple

from proxy.core.model import FAMILY_NAMES, Endpoint, Service, ServicePort, Snapshot


class EndpointInfo(NamedTuple):
    """A usable ``ip:port`` of one service port, with its conditions resolved.

    A NamedTuple rather than a frozen dataclass like the model: a sync makes
    one per endpoint of every service port (30,000 for 10,000 services), and
    a frozen dataclass's ``__init__`` (one ``object.__setattr__`` per field)
    costs three times as much. Just as immutable.
    """

    ip: str
    port: int
    node_name: str | None
    is_local: bool
    ready: bool = True
    serving: bool = True
    terminating: bool = False
    pod_name: str | None = None

    @property
    def addr(self) -> tuple[str, int]:
        return (self.ip, self.port)

    def __str__(self) -> str:
        """``ip:port``, or ``[ip]:port`` for IPv6, as Go's ``net.JoinHostPort`` writes it."""
        if ":" in self.ip:
            return f"[{self.ip}]:{self.port}"
        return f"{self.ip}:{self.port}"


@dataclass(frozen=True, slots=True)
class Categorized:
    """What ``CategorizeEndpoints`` returns for one service port.

    ``cluster`` is what eTP=Cluster (and node-originated traffic) may use;
    ``local`` is what eTP=Local may use for external clients; ``has_any`` is
    true when some usable endpoint exists anywhere in the cluster.
    """

    cluster: tuple[EndpointInfo, ...]
    local: tuple[EndpointInfo, ...]
    has_any: bool


def _is_serving_terminating(ep: EndpointInfo) -> bool:
    return ep.serving and ep.terminating


def _filter(
    eps: Iterable[EndpointInfo], pred: Callable[[EndpointInfo], bool]
) -> tuple[EndpointInfo, ...]:
    return tuple(filter(pred, eps))


def service_port_endpoints(
    snapshot: Snapshot, service: Service, port: ServicePort, node_name: str, family: int = 4
) -> tuple[EndpointInfo, ...]:
    """All endpoints of one service port in one IP family, deduplicated by ``ip:port``.

    Only the slices of ``family``'s address type count: each family's
    proxier reads its own (kube-proxy's EndpointSliceCache is per family).

    A slice port matches the service port by name (both empty for a
    single-port service) and protocol. When slices disagree about one
    ``ip:port`` the non-terminating copy wins, as in EndpointSliceCache.
    """
    found: dict[tuple[str, int], EndpointInfo] = {}
    address_type = FAMILY_NAMES[family]
    for sl in snapshot.slices_for(service):
        if sl.address_type != address_type:
            continue
        for sp in sl.ports:
            if sp.name != port.name or sp.protocol != port.protocol or sp.port == 0:
                continue
            for ep in sl.endpoints:
                key = (ep.address, sp.port)
                if ep.terminating and key in found:
                    continue
                found[key] = EndpointInfo(
                    ep.address,
                    sp.port,
                    ep.node_name,
                    bool(node_name) and ep.node_name == node_name,
                    ep.ready,
                    ep.serving,
                    ep.terminating,
                    ep.pod_name,
                )
    # Sorted so that round-robin order does not depend on slice order.
    return tuple(map(found.__getitem__, sorted(found)))


def categorize_endpoints(
    endpoints: Iterable[EndpointInfo], service: Service
) -> Categorized:
    """Split endpoints into the Cluster and Local sets, as kube-proxy does.

    Cluster endpoints are always found: eTP=Cluster and iTP=Cluster use them,
    and node- and pod-originated traffic to an external address (NodePort,
    externalIP, LB IP) short-circuits to them even under eTP=Local. Local
    endpoints are found iff some policy of the service is Local (eTP for its
    external addresses, iTP for its ClusterIP).
    """
    eps = tuple(endpoints)
    cluster = _filter(eps, lambda e: e.ready)
    if not cluster:
        # No ready endpoint anywhere: only then may terminating ones serve.
        cluster = _filter(eps, _is_serving_terminating)
    has_any = bool(cluster)
    if not (service.external_policy_local or service.internal_traffic_policy == "Local"):
        return Categorized(cluster=cluster, local=(), has_any=has_any)

    local = _filter(eps, lambda e: e.is_local and e.ready)
    if not local:
        local = _filter(eps, lambda e: e.is_local and _is_serving_terminating(e))
    # If any ready endpoint exists, ``cluster`` already holds it; if only
    # terminating ones exist, ``cluster`` fell back to them. Either way
    # ``has_any`` is already right and needs no second pass.
    return Categorized(cluster=cluster, local=local, has_any=has_any)


def local_ready_counts(
    snapshot: Snapshot, node_name: str, family: int = 4
) -> Mapping[str, int]:
    """Unique local *ready* endpoint IPs of ``family`` per Service (all ports merged).

    This is the ``localEndpoints`` of the healthCheckNodePort answer.
    Terminating endpoints may still carry traffic but never count here, so a
    node that is only draining fails its health check and the LB moves on.
    Every health-checked service is present, with 0 when it has nothing here.
    """
    counts: dict[str, int] = {}
    address_type = FAMILY_NAMES[family]
    for svc in snapshot.services:
        if not svc.needs_health_check:
            continue
        # kube-proxy counts from its deduplicated per-port endpoint map, so a
        # duplicate ip:port is judged by the copy that map keeps (the
        # non-terminating one), and an endpoint under no usable port is absent.
        by_port: dict[tuple[str, str], dict[tuple[str, int], Endpoint]] = {}
        for sl in snapshot.slices_for(svc):
            if sl.address_type != address_type:
                continue
            for sp in sl.ports:
                if sp.port == 0:
                    continue
                kept = by_port.setdefault((sp.name, sp.protocol), {})
                for ep in sl.endpoints:
                    key = (ep.address, sp.port)
                    if key not in kept or not ep.terminating:
                        kept[key] = ep
        ips = {
            ep.address
            for kept in by_port.values()
            for ep in kept.values()
            if ep.ready and node_name and ep.node_name == node_name
        }
        counts[svc.key] = len(ips)
    return counts
