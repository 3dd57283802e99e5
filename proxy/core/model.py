"""The immutable model of the Kubernetes objects kpx reads.

Owns: the typed, frozen form of v1 Node, v1 Service and discovery.k8s.io/v1
EndpointSlice, and the Snapshot that bundles one consistent version of them.

Never: parse YAML, touch a socket or import asyncio. Everything here is plain
data so that the rules in ``endpoints`` and ``decision`` stay pure functions
that tests can feed by hand.

Condition defaults are resolved at parse time exactly as kube-proxy's
EndpointSliceCache does (nil ready/serving means true, nil terminating means
false), so no reader ever has to remember the nil rule again.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Literal, TypeVar

from proxy.core.changes import EVERYTHING, Changes

TrafficPolicy = Literal["Cluster", "Local"]
ServiceType = Literal["ClusterIP", "NodePort", "LoadBalancer", "ExternalName"]
SessionAffinity = Literal["None", "ClientIP"]
IPMode = Literal["VIP", "Proxy"]
IPFamily = Literal["IPv4", "IPv6"]
IPFamilyPolicy = Literal["SingleStack", "PreferDualStack", "RequireDualStack"]
Network = ipaddress.IPv4Network | ipaddress.IPv6Network

FAMILY_NAMES: dict[int, IPFamily] = {4: "IPv4", 6: "IPv6"}
"""A family's number (4, 6, as ``ipaddress`` says) -> its Kubernetes name: an
``ipFamilies`` entry, and the ``addressType`` of its EndpointSlices."""

DEFAULT_AFFINITY_SECONDS = 10800
"""API-server default for sessionAffinityConfig.clientIP.timeoutSeconds."""

TAINT_TO_BE_DELETED = "ToBeDeletedByClusterAutoscaler"


@dataclass(frozen=True, slots=True)
class Node:
    """A v1 Node, reduced to what a proxy needs: its addresses and eligibility."""

    name: str
    internal_ips: tuple[str, ...] = ()
    external_ips: tuple[str, ...] = ()
    labels: tuple[tuple[str, str], ...] = ()
    taint_keys: tuple[str, ...] = ()
    deletion_timestamp: str | None = None

    @property
    def ips(self) -> tuple[str, ...]:
        """InternalIPs first, then ExternalIPs, without repeats, of both families."""
        return tuple(dict.fromkeys(self.internal_ips + self.external_ips))

    def ips_of(self, family: int) -> tuple[str, ...]:
        """``ips`` of one family (4 or 6): what that family's proxier calls the node's.

        IPv6 ones in their canonical text (``fd00::1``), the form a socket
        reports a peer in, so that comparing strings compares addresses.
        """
        out: dict[str, None] = {}
        for ip in self.ips:
            try:
                address = ipaddress.ip_address(ip)
            except ValueError:
                continue
            if address.version == family:
                out[str(address)] = None
        return tuple(out)

    @property
    def eligible(self) -> bool:
        """KEP-3836: a node being deleted should fail /healthz so LBs drain it."""
        return self.deletion_timestamp is None and TAINT_TO_BE_DELETED not in self.taint_keys


@dataclass(frozen=True, slots=True)
class ServicePort:
    """One ``spec.ports[]`` entry; ``node_port`` 0 means none was allocated."""

    name: str
    protocol: str
    port: int
    target_port: int | str
    node_port: int = 0


@dataclass(frozen=True, slots=True)
class LoadBalancerIngress:
    """One ``status.loadBalancer.ingress[]`` entry that has an ``ip`` (either family).

    ``ip_mode`` is KEP-1860's ``ipMode``: ``VIP`` (also when absent) means the
    proxy may capture the address itself, ``Proxy`` that traffic must reach the
    real load balancer. Hostname-only entries are not kept: kpx can only
    intercept an address.
    """

    ip: str
    ip_mode: IPMode = "VIP"


@dataclass(frozen=True, slots=True)
class Service:
    """A v1 Service with the API server's defaults already applied."""

    namespace: str
    name: str
    type: ServiceType
    ports: tuple[ServicePort, ...]
    cluster_ip: str | None = None
    external_traffic_policy: TrafficPolicy = "Cluster"
    internal_traffic_policy: TrafficPolicy = "Cluster"
    health_check_node_port: int = 0
    session_affinity: SessionAffinity = "None"
    affinity_timeout_seconds: int = DEFAULT_AFFINITY_SECONDS
    selector: tuple[tuple[str, str], ...] = ()
    labels: tuple[tuple[str, str], ...] = ()
    external_ips: tuple[str, ...] = ()
    publish_not_ready_addresses: bool = False
    ingress: tuple[LoadBalancerIngress, ...] = ()
    """A LoadBalancer's ``status.loadBalancer.ingress`` entries with an IP, in order (else ())."""
    cluster_ips: tuple[str, ...] = ()
    """``spec.clusterIPs``: one per family, the primary first (``cluster_ip`` is the IPv4 one)."""
    ip_families: tuple[IPFamily, ...] = ("IPv4",)
    """``spec.ipFamilies``: the families the service has, so the proxiers that serve it.

    kube-proxy's proxier of a family skips a service without a ClusterIP of
    that family (``GetClusterIPByFamily``); the parser derives this from
    ``clusterIPs`` when it can, else from ``ipFamilies``, else IPv4."""
    ip_family_policy: IPFamilyPolicy = "SingleStack"
    load_balancer_source_ranges: tuple[Network, ...] = ()
    """``spec.loadBalancerSourceRanges``: canonical networks of both families, in order.

    kube-proxy's firewall for the LB ingress IPs (``source_ranges_of``); the
    parser keeps them only on a LoadBalancer, the only type the API server
    lets have them."""
    key: str = field(init=False, repr=False, compare=False)
    """``namespace/name``: how kube-proxy and kpx name a service in logs.

    Derived, but stored: every index, plan and log line asks for it, and a
    slot read costs a tenth of formatting the string again.
    """

    def __post_init__(self) -> None:
        object.__setattr__(self, "key", f"{self.namespace}/{self.name}")

    def serves(self, family: int) -> bool:
        """Whether the proxier of ``family`` (4 or 6) serves this service at all."""
        return FAMILY_NAMES[family] in self.ip_families

    def cluster_ip_of(self, family: int) -> str | None:
        """The ClusterIP of ``family``, or None."""
        if family == 4:
            return self.cluster_ip
        return next((ip for ip in self.cluster_ips if ":" in ip), None)

    def source_ranges_of(self, family: int) -> tuple[Network, ...]:
        """The ``loadBalancerSourceRanges`` of ``family`` (4 or 6).

        Each family's proxier takes only its own (``MapCIDRsByIPFamily``): a
        dual-stack service with IPv4 ranges only is not filtered over IPv6.
        """
        return tuple(n for n in self.load_balancer_source_ranges if n.version == family)

    @property
    def externally_accessible(self) -> bool:
        return self.type in ("LoadBalancer", "NodePort") or (
            self.type == "ClusterIP" and bool(self.external_ips)
        )

    @property
    def external_policy_local(self) -> bool:
        return self.externally_accessible and self.external_traffic_policy == "Local"

    @property
    def needs_health_check(self) -> bool:
        """Only LoadBalancer + eTP=Local gets a healthCheckNodePort server."""
        return (
            self.type == "LoadBalancer"
            and self.external_policy_local
            and self.health_check_node_port != 0
        )


@dataclass(frozen=True, slots=True)
class Endpoint:
    """One endpoint of a slice. Only the first address counts, as in kube-proxy."""

    address: str
    node_name: str | None = None
    ready: bool = True
    serving: bool = True
    terminating: bool = False
    pod_name: str | None = None


@dataclass(frozen=True, slots=True)
class EndpointPort:
    """A slice port; it serves the service port with the same name and protocol."""

    name: str
    port: int
    protocol: str = "TCP"


@dataclass(frozen=True, slots=True)
class EndpointSlice:
    """A discovery.k8s.io/v1 EndpointSlice, linked by ``service_name`` (its label)."""

    namespace: str
    name: str
    service_name: str
    endpoints: tuple[Endpoint, ...]
    ports: tuple[EndpointPort, ...]
    address_type: str = "IPv4"
    trigger_time: float | None = None
    """``endpoints.kubernetes.io/last-change-trigger-time`` as a UNIX time, if set."""
    service_key: str = field(init=False, repr=False, compare=False)
    """``namespace/service_name``: the ``Service.key`` this slice belongs to (stored too)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "service_key", f"{self.namespace}/{self.service_name}")


@dataclass(frozen=True, slots=True)
class Snapshot:
    """One consistent version of the world, shared by every reader.

    The dataplane and the healthz sidecar both reconcile against the same
    Snapshot object, which is what guarantees they never disagree.
    Slices whose Service is absent are already dropped by the parser.
    """

    nodes: tuple[Node, ...] = ()
    services: tuple[Service, ...] = ()
    slices: tuple[EndpointSlice, ...] = ()
    generation: int = 0
    changes: Changes = field(default=EVERYTHING, compare=False)
    """What changed since an earlier generation, as the source saw it (``proxy.core.changes``)."""
    _slices_by_service: dict[str, tuple[EndpointSlice, ...]] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )
    _services_by_key: dict[str, Service] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )
    _nodes_by_name: dict[str, Node] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        # Indexed once per snapshot so lookups stay O(1) with 10k services
        # (a state change rebuilds a snapshot, so this is on the convergence
        # path too); the first of any repeated name wins, as a linear scan would.
        slices = self.slices
        # Most services have one slice: try that in C, group in Python if not.
        index = dict(zip(map(_SLICE_SERVICE_KEY, slices), zip(slices), strict=True))
        if len(index) != len(slices):
            index = {}
            get = index.get
            for s in slices:
                key = s.service_key
                index[key] = (*get(key, ()), s)
        object.__setattr__(self, "_slices_by_service", index)
        object.__setattr__(self, "_services_by_key", _first_by(self.services, _SERVICE_KEY))
        object.__setattr__(self, "_nodes_by_name", _first_by(self.nodes, _NODE_NAME))

    def node(self, name: str) -> Node | None:
        return self._nodes_by_name.get(name)

    def service(self, key: str) -> Service | None:
        """The service called ``namespace/name``, if the snapshot has it."""
        return self._services_by_key.get(key)

    def slices_for(self, service: Service) -> tuple[EndpointSlice, ...]:
        return self._slices_by_service.get(service.key, ())

    def slices_of(self, key: str) -> tuple[EndpointSlice, ...]:
        """The slices of the service called ``namespace/name``, in stream order."""
        return self._slices_by_service.get(key, ())


def stamp_changes(snapshot: Snapshot, changes: Changes) -> Snapshot:
    """``snapshot`` carrying ``changes``, set in place; returns it.

    Only for a snapshot its source has just built and no one else holds yet:
    ``dataclasses.replace`` would index every service and slice again.
    """
    if changes != snapshot.changes:
        object.__setattr__(snapshot, "changes", changes)
    return snapshot


_T = TypeVar("_T")
_SERVICE_KEY: Callable[[Service], str] = attrgetter("key")
_SLICE_SERVICE_KEY: Callable[[EndpointSlice], str] = attrgetter("service_key")
_NODE_NAME: Callable[[Node], str] = attrgetter("name")


def _first_by(items: Sequence[_T], key: Callable[[_T], str]) -> dict[str, _T]:
    """``{key(item): item}`` keeping the first item of each key, built in C."""
    backwards = items[::-1]
    return dict(zip(map(key, backwards), backwards, strict=True))
