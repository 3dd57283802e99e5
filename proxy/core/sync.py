"""What one snapshot means for this node: the one sync's pure half.

Owns: ``SyncConfig`` (what the node's flags say about the rules) and
``compute_sync``, which turns a ``Snapshot`` into a ``SyncResult``: the
TCP and UDP plans the dataplane serves, the addresses it listens on, the
healthCheckNodePorts and local ready endpoint counts that healthz serves,
the node's eligibility, and the figures the sync metrics report. kube-proxy
computes the same things inside each proxier's ``syncProxyRules`` before it
calls ``SyncServices``/``SyncEndpoints``; here they are computed once, as
data, and every consumer reads the same result.

Never: touch sockets, clocks, logging or metrics (``proxy.proxier`` runs the
sync and does those), or compute anything a consumer could not get from the
result: a second computation would be a second chance to disagree.
"""

from __future__ import annotations

import ipaddress
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
    """The node's IPv4 addresses (none if it is unknown)."""
    node_eligible: bool
    """The Node exists and is neither being deleted nor marked for removal."""
    listen_hosts: tuple[str, ...]
    """Where the dataplane's NodePort listeners go (``0.0.0.0``: every local address)."""
    vips: frozenset[str]
    """Every VIP a plan serves: what the node must treat as a local address."""
    health_hosts: tuple[str, ...]
    """Where healthCheckNodePorts listen: the same rule, loopback always included."""
    health_check_ports: Mapping[str, int]
    """``ns/name`` -> healthCheckNodePort, for every service that needs one."""
    local_ready: Mapping[str, int]
    """``ns/name`` -> unique local ready endpoint IPs, for those services."""
    dropping: int
    """Service ports whose external traffic is dropped (eTP=Local, no local endpoint)."""
    dropping_internal: int
    """Service ports whose ClusterIP traffic is dropped (iTP=Local, no local endpoint)."""
    trigger_times: Mapping[tuple[str, str], float]
    """Every slice's ``last-change-trigger-time``, by (namespace, name)."""
    udp_plans: dict[PlanKey, PortPlan]
    """The UDP decision table, keyed as ``plans`` (a port number may be in both)."""


def _is_ipv4(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).version == 4
    except ValueError:
        return False


def compute_sync(
    snapshot: Snapshot, config: SyncConfig, cache: PlanCache | None = None,
    udp_cache: PlanCache | None = None,
) -> SyncResult:
    """What ``snapshot`` means for ``config.node_name``; the caches keep unchanged plans."""
    node = snapshot.node(config.node_name)
    node_ips = () if node is None else tuple(ip for ip in node.ips if _is_ipv4(ip))
    plans = build_plans(
        snapshot, config.node_name, config.masquerade_all, cache=cache, vips=config.vips
    )
    udp_plans = build_plans(
        snapshot, config.node_name, config.masquerade_all, cache=udp_cache, vips=config.vips,
        protocol="UDP",
    )
    every = (*plans.values(), *udp_plans.values())
    listen_hosts = nodeport_addresses(node_ips, config.nodeport_cidrs, config.bind_localhost)
    health_hosts = (
        listen_hosts if config.bind_localhost
        else nodeport_addresses(node_ips, config.nodeport_cidrs, True)
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
        health_check_ports={
            s.key: s.health_check_node_port for s in snapshot.services if s.needs_health_check
        },
        local_ready=local_ready_counts(snapshot, config.node_name),
        # Per service port, as kube-proxy counts: its NodePort and its
        # external VIPs drop together (a UDP port and a TCP one are two).
        dropping=len({(plan.key, plan.port.protocol) for plan in every if plan.drop_external}),
        dropping_internal=len({(plan.key, plan.port.protocol) for plan in every
                               if plan.drop_all}),
        trigger_times={
            (sl.namespace, sl.name): sl.trigger_time
            for sl in snapshot.slices
            if sl.trigger_time is not None
        },
        udp_plans=udp_plans,
    )
