"""Prometheus metrics of one kpx process, named as kube-proxy names them.

Owns: the metric objects, registered on one ``REGISTRY`` that the healthz
sidecar's ``/metrics`` serves. kube-proxy's own names are used where the
meaning carries over; kpx's dataplane counters use ``kubeproxy_kpx_*`` so
they sit beside them without pretending to be upstream metrics.

The sync metrics carry kube-proxy's ``ip_family`` label (``IPv4``,
``IPv6``), as its per-family proxiers set them since the dual-stack work
of v1.33: one sync of kpx programs both families, and each family's series
says what that family got.

Never: be updated per chunk of data. The forwarder counts bytes per
connection and adds them once, when the connection ends.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from healthz.registry import REGISTRY

SYNC_DURATION = Histogram(
    "kubeproxy_sync_proxy_rules_duration_seconds",
    "SyncProxyRules latency in seconds",
    ["ip_family"],
    buckets=[0.001 * 2**i for i in range(15)],
    registry=REGISTRY,
)
SYNC_LAST_TIMESTAMP = Gauge(
    "kubeproxy_sync_proxy_rules_last_timestamp_seconds",
    "The last time proxy rules were successfully synced",
    ["ip_family"],
    registry=REGISTRY,
)
SYNC_LAST_QUEUED_TIMESTAMP = Gauge(
    "kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds",
    "The last time a sync of proxy rules was queued",
    ["ip_family"],
    registry=REGISTRY,
)
NETWORK_PROGRAMMING_DURATION = Histogram(
    "kubeproxy_network_programming_duration_seconds",
    "In Cluster Network Programming Latency in seconds",
    # kube-proxy's metrics.MergeBuckets starts from a 0 bucket (make([]float64, 1)).
    buckets=[0, 0.25, 0.5, *range(1, 60), *range(60, 120, 5), *range(120, 301, 30)],
    labelnames=["ip_family"],
    registry=REGISTRY,
)
NO_LOCAL_ENDPOINTS = Gauge(
    "kubeproxy_sync_proxy_rules_no_local_endpoints_total",
    "Number of services with a Local traffic policy and no endpoints",
    ["traffic_policy", "ip_family"],
    registry=REGISTRY,
)
# kube-proxy's change trackers (ServiceChangeTracker, EndpointsChangeTracker):
# one count per Service / EndpointSlice event, and the events not yet synced.
ENDPOINT_CHANGES_PENDING = Gauge(
    "kubeproxy_sync_proxy_rules_endpoint_changes_pending",
    "Pending proxy rules Endpoint changes",
    registry=REGISTRY,
)
ENDPOINT_CHANGES_TOTAL = Counter(
    "kubeproxy_sync_proxy_rules_endpoint_changes",
    "Cumulative proxy rules Endpoint changes",
    registry=REGISTRY,
)
SERVICE_CHANGES_PENDING = Gauge(
    "kubeproxy_sync_proxy_rules_service_changes_pending",
    "Pending proxy rules Service changes",
    registry=REGISTRY,
)
SERVICE_CHANGES_TOTAL = Counter(
    "kubeproxy_sync_proxy_rules_service_changes",
    "Cumulative proxy rules Service changes",
    registry=REGISTRY,
)
# IPv4 is always served: its series exist from the start, zero until the first
# sync, as the unlabelled ones did before dual-stack. IPv6's appear with IPv6.
SYNC_DURATION.labels(ip_family="IPv4")
SYNC_LAST_TIMESTAMP.labels(ip_family="IPv4")
SYNC_LAST_QUEUED_TIMESTAMP.labels(ip_family="IPv4")
NETWORK_PROGRAMMING_DURATION.labels(ip_family="IPv4")
for _policy in ("external", "internal"):
    NO_LOCAL_ENDPOINTS.labels(traffic_policy=_policy, ip_family="IPv4")

STATE_RELOAD_ERRORS = Counter(
    "kubeproxy_kpx_state_reload_errors",
    "State reloads refused because the input was malformed",
    registry=REGISTRY,
)

# Dataplane counters, per service port (``ns/name:port``).
CONNECTIONS_ACCEPTED = Counter(
    "kubeproxy_kpx_connections_accepted",
    "Connections accepted on a NodePort",
    ["service_port"],
    registry=REGISTRY,
)
CONNECTIONS_FORWARDED = Counter(
    "kubeproxy_kpx_connections_forwarded",
    "Connections relayed to an endpoint",
    ["service_port", "snat"],
    registry=REGISTRY,
)
CONNECTIONS_DROPPED = Counter(
    "kubeproxy_kpx_connections_dropped",
    "Connections dropped for eTP=Local with no local endpoint"
    " (SYNs the kernel drops are counted by the listener)",
    ["service_port"],
    registry=REGISTRY,
)
CONNECTIONS_REJECTED = Counter(
    "kubeproxy_kpx_connections_rejected",
    "Connections reset because no endpoint could take them",
    ["service_port"],
    registry=REGISTRY,
)
UPSTREAM_CONNECT_FAILURES = Counter(
    "kubeproxy_kpx_upstream_connect_failures",
    "Failed connects to an endpoint (each retry counts)",
    ["service_port"],
    registry=REGISTRY,
)
BYTES = Counter(
    "kubeproxy_kpx_bytes",
    "Bytes relayed, by direction (to_endpoint or to_client)",
    ["service_port", "direction"],
    registry=REGISTRY,
)
ACTIVE_CONNECTIONS = Gauge(
    "kubeproxy_kpx_active_connections",
    "Proxied connections currently open",
    ["service_port"],
    registry=REGISTRY,
)
LISTENERS = Gauge(
    "kubeproxy_kpx_listeners",
    "NodePort listening sockets, by state (serving or dropping)",
    ["state"],
    registry=REGISTRY,
)
CONNECTIONS_EXPIRED = Counter(
    "kubeproxy_kpx_connections_expired",
    "Connections reset for being idle past --conntrack-tcp-timeout-established"
    " (reason established) or, half-closed, --conntrack-tcp-timeout-close-wait"
    " (reason close_wait)",
    ["service_port", "reason"],
    registry=REGISTRY,
)

# Return path (client-IP preservation) self-repair, per sync period.
RETURN_PATH_REPAIRS = Counter(
    "kubeproxy_kpx_return_path_repairs",
    "Return-path parts (nft_table, rule, route) found missing and restored",
    ["part"],
    registry=REGISTRY,
)
RETURN_PATH_REPAIR_FAILURES = Counter(
    "kubeproxy_kpx_return_path_repair_failures",
    "Sync-period checks that could not restore the return path (health fails meanwhile)",
    registry=REGISTRY,
)
SERVICE_VIPS = Gauge(
    "kubeproxy_kpx_service_vips",
    "Service VIPs (clusterIPs, externalIPs, VIP-mode LB IPs) local to the node, last put in force",
    registry=REGISTRY,
)
SERVICE_VIP_PORTS = Gauge(
    "kubeproxy_kpx_service_vip_ports",
    "VIP:port pairs the node's nft table steers to kpx, as last put in force",
    registry=REGISTRY,
)
VIP_REPAIRS = Counter(
    "kubeproxy_kpx_vip_repairs",
    "Service VIP parts (route, rules, arp) found missing or changed outside kpx and restored",
    ["part"],
    registry=REGISTRY,
)

# UDP flows (kpx's own table; kube-proxy leaves UDP to conntrack and has no
# equivalents).
UDP_FLOWS_ACTIVE = Gauge(
    "kubeproxy_kpx_udp_flows_active",
    "UDP flows (client address and port to a service port) pinned to an endpoint now",
    registry=REGISTRY,
)
UDP_FLOWS_CREATED = Counter(
    "kubeproxy_kpx_udp_flows_created",
    "UDP flows whose first datagram was decided and forwarded",
    registry=REGISTRY,
)
UDP_FLOWS_EXPIRED = Counter(
    "kubeproxy_kpx_udp_flows_expired",
    "UDP flows ended for being idle past --conntrack-udp-timeout (never answered) or"
    " --conntrack-udp-timeout-stream (answered)",
    registry=REGISTRY,
)
UDP_FLOWS_EVICTED = Counter(
    "kubeproxy_kpx_udp_flows_evicted",
    "UDP flows ended to make room in a full table (--udp-flow-limit): the one idle longest",
    registry=REGISTRY,
)
UDP_FLOWS_REPICKED = Counter(
    "kubeproxy_kpx_udp_flows_repicked",
    "UDP flows whose endpoint stopped being a candidate (gone, not ready, no longer"
    " chosen), re-decided on their next datagram instead of going stale",
    registry=REGISTRY,
)
UDP_DATAGRAMS = Counter(
    "kubeproxy_kpx_udp_datagrams",
    "UDP datagrams forwarded, by direction (to_endpoint, to_client)",
    ["direction"],
    registry=REGISTRY,
)
UDP_BYTES = Counter(
    "kubeproxy_kpx_udp_bytes",
    "UDP payload bytes forwarded, by direction (to_endpoint, to_client)",
    ["direction"],
    registry=REGISTRY,
)
UDP_DATAGRAMS_DROPPED = Counter(
    "kubeproxy_kpx_udp_datagrams_dropped",
    "UDP datagrams not forwarded, by reason: dropped (eTP=Local with no local endpoint, or"
    " a full socket buffer) or rejected (no endpoint)",
    ["reason"],
    registry=REGISTRY,
)
