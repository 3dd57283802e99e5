"""What one snapshot means for this node: the one sync's pure half.

Owns: ``SyncConfig`` (what the node's flags say about the rules) and
``compute_sync``, which turns a ``Snapshot`` into a ``SyncResult``: the
TCP and UDP plans the dataplane serves, the addresses it listens on, the
healthCheckNodePorts and local ready endpoint counts that healthz serves,
the node's eligibility, and the figures the sync metrics report. kube-proxy
computes the same things inside each proxier's ``syncProxyRules`` before it
calls ``SyncServices``/``SyncEndpoints``; here they are computed once, as
data, and every consumer reads the same result.

Dual-stack is kube-proxy's MetaProxier, as data: the result is the IPv4
family's, and ``SyncResult.ipv6`` is the IPv6 family's own result, built by
the same code from the same snapshot, on a node that has an IPv6 address.
Each family's dataplane applies its own; healthz gets both.

Never: touch sockets, clocks, logging or metrics (``proxy.proxier`` runs the
sync and does those), or compute anything a consumer could not get from the
result: a second computation would be a second chance to disagree.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from proxy.core.addresses import Network, nodeport_addresses
from proxy.core.decision import PlanCache, PlanKey, PortPlan, build_plans
from proxy.core.endpoints import local_ready_counts
from proxy.core.model import Snapshot


@dataclass(frozen=True, slots=True)
class SyncConfig:
    """The node's own settings that the rules depend on (its flags)."""

    node_name: str
    masquerade_all: bool = False
    nodeport_cidrs: tuple[Network, ...] = ()
    """``--nodeport-addresses``; empty: every local address."""
    bind_localhost: bool = True
    """Whether NodePorts also listen on 127.0.0.1 (iptables mode's ``route_localnet``)."""
    vips: bool = False
    """Whether service VIPs (ClusterIPs, externalIPs, VIP-mode LB IPs) get plans.

    Off until the userspace dataplane serves them (issue 11, in progress)."""


@dataclass(frozen=True, slots=True, eq=False)
class SyncResult:
    """Everything one snapshot means for this node, for every consumer of the sync."""

    generation: int
    plans: dict[PlanKey, PortPlan]
    """The TCP decision table, by nodePort or (VIP, port). Unchanged services
    keep their PortPlan objects across syncs (``PlanCache``)."""
    node_known: bool
    """Whether the snapshot has this node's Node object."""
    node_ips: tuple[str, ...]
    """The node's addresses of ``family`` (none if it is unknown)."""
    node_eligible: bool
    """The Node exists and is neither being deleted nor marked for removal."""
    listen_hosts: tuple[str, ...]
    """Where the dataplane's NodePort listeners go (``0.0.0.0``, ``::``: every local address)."""
    vips: frozenset[str]
    """Every VIP a plan serves: what the node must treat as a local address."""
    health_hosts: tuple[str, ...]
    """Where healthCheckNodePorts listen: the same rule, loopback always included."""
    health_check_ports: Mapping[str, int]
    """``ns/name`` -> healthCheckNodePort, for every service that needs one."""
    local_ready: Mapping[str, int]
    """``ns/name`` -> unique local ready endpoint IPs of ``family``, for those services."""
    dropping: int
    """Service ports whose external traffic is dropped (eTP=Local, no local endpoint)."""
    dropping_internal: int
    """Service ports whose ClusterIP traffic is dropped (iTP=Local, no local endpoint)."""
    trigger_times: Mapping[tuple[str, str, str], float]
    """Every slice's ``last-change-trigger-time``, by (namespace, name, addressType)."""
    udp_plans: dict[PlanKey, PortPlan]
    """The UDP decision table, keyed as ``plans`` (a port number may be in both)."""
    family: int = 4
    """The IP family (4 or 6) whose plans, addresses and counts these are."""
    ipv6: SyncResult | None = None
    """The IPv6 family's result (``family`` 6), when the node has an IPv6 address.

    Only on the IPv4 result; None on a node without IPv6, whose IPv6
    dataplane then serves nothing (``empty_result``)."""


def compute_sync(
    snapshot: Snapshot, config: SyncConfig, cache: PlanCache | None = None,
    udp_cache: PlanCache | None = None, cache6: PlanCache | None = None,
    udp_cache6: PlanCache | None = None,
) -> SyncResult:
    """What ``snapshot`` means for ``config.node_name``; the caches keep unchanged plans.

    The IPv4 family's result, with the IPv6 family's in ``ipv6`` when the
    node's Node object has an IPv6 address (``cache6`` and ``udp_cache6``
    keep its plans). A node without one pays nothing for IPv6.
    """
    node = snapshot.node(config.node_name)
    trigger_times = {
        (sl.namespace, sl.name, sl.address_type): sl.trigger_time
        for sl in snapshot.slices
        if sl.trigger_time is not None
    }
    health_check_ports = {
        s.key: s.health_check_node_port for s in snapshot.services if s.needs_health_check
    }
    ipv6 = None
    if node is not None and node.ips_of(6):
        ipv6 = _family_sync(snapshot, config, 6, cache6, udp_cache6, health_check_ports,
                            trigger_times)
    return _family_sync(snapshot, config, 4, cache, udp_cache, health_check_ports,
                        trigger_times, ipv6)


def _family_sync(
    snapshot: Snapshot, config: SyncConfig, family: int, cache: PlanCache | None,
    udp_cache: PlanCache | None, health_check_ports: Mapping[str, int],
    trigger_times: Mapping[tuple[str, str, str], float], ipv6: SyncResult | None = None,
) -> SyncResult:
    """One family's result: what its own proxier would compute."""
    node = snapshot.node(config.node_name)
    node_ips = () if node is None else node.ips_of(family)
    plans = build_plans(
        snapshot, config.node_name, config.masquerade_all, cache=cache, vips=config.vips,
        family=family,
    )
    udp_plans = build_plans(
        snapshot, config.node_name, config.masquerade_all, cache=udp_cache, vips=config.vips,
        protocol="UDP", family=family,
    )
    every = (*plans.values(), *udp_plans.values())
    listen_hosts = nodeport_addresses(
        node_ips, config.nodeport_cidrs, config.bind_localhost, family
    )
    health_hosts = (
        listen_hosts if config.bind_localhost
        else nodeport_addresses(node_ips, config.nodeport_cidrs, True, family)
    )
    return SyncResult(
        generation=snapshot.generation,
        plans=plans,
        node_known=node is not None,
        node_ips=node_ips,
        node_eligible=node is not None and node.eligible,
        listen_hosts=listen_hosts,
        vips=frozenset(plan.vip for plan in every if plan.vip is not None),
        health_hosts=health_hosts,
        health_check_ports=health_check_ports,
        local_ready=local_ready_counts(snapshot, config.node_name, family),
        # Per service port, as kube-proxy counts: its NodePort and its
        # external VIPs drop together (a UDP port and a TCP one are two).
        dropping=len({(plan.key, plan.port.protocol) for plan in every if plan.drop_external}),
        dropping_internal=len({(plan.key, plan.port.protocol) for plan in every
                               if plan.drop_all}),
        trigger_times=trigger_times,
        udp_plans=udp_plans,
        family=family,
        ipv6=ipv6,
    )


def empty_result(generation: int, family: int) -> SyncResult:
    """A family with nothing to serve: what its dataplane applies when the node lost it."""
    return SyncResult(
        generation=generation, plans={}, node_known=False, node_ips=(), node_eligible=False,
        listen_hosts=(), vips=frozenset(), health_hosts=(), health_check_ports={},
        local_ready={}, dropping=0, dropping_internal=0, trigger_times={}, udp_plans={},
        family=family,
    )
