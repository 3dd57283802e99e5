"""The lab's external load balancer, by its historical name: ``lab.lb``'s public names.

Owns: the entry point ``python -m lab.loadbalancer --config <run_dir>/lb.json``
(the daemon, as started by ``lab.lb.control.start`` and docker-compose) and
the import path ``lab.loadbalancer`` that the CLI, demos and tests use. Each
name lives in the ``lab.lb`` module of its role; that package's docstring
is the load balancer's theory of operation.

Never: define anything itself. A change to the LB belongs in ``lab.lb``.
"""

from __future__ import annotations

import sys

from lab.lb.config import (
    DEFAULTS,
    FRONT_IP,
    PROXY_HEALTH_PORT,
    Backend,
    LBConfig,
    Mode,
    Probe,
    ProbeType,
    ProxyProtocol,
    resolve,
)
from lab.lb.control import (
    CONFIG_NAME,
    LOG_NAME,
    STATUS_NAME,
    LoadBalancerHandle,
    config_for,
    connection_counts,
    on_apply,
    read_status,
    start,
    status,
    stop_pid,
)
from lab.lb.daemon import LoadBalancer, NodeStatus, main, now_iso, serve
from lab.lb.nft import (
    NFT_TABLE,
    counter_name,
    nft_dnat_rule,
    nft_front_match,
    nft_ruleset,
    nft_update,
)
from lab.lb.probe import probe_once
from lab.lb.rules import (
    PROXY_V2_SIGNATURE,
    Health,
    HealthState,
    describe_error,
    observe,
    proxy_header,
    serving,
)

__all__ = [
    "CONFIG_NAME", "DEFAULTS", "FRONT_IP", "LOG_NAME", "NFT_TABLE", "PROXY_HEALTH_PORT",
    "PROXY_V2_SIGNATURE", "STATUS_NAME", "Backend", "Health", "HealthState", "LBConfig",
    "LoadBalancer", "LoadBalancerHandle", "Mode", "NodeStatus", "Probe", "ProbeType",
    "ProxyProtocol", "config_for", "connection_counts", "counter_name", "describe_error",
    "main", "nft_dnat_rule", "nft_front_match", "nft_ruleset", "nft_update", "now_iso",
    "observe", "on_apply", "probe_once", "proxy_header", "read_status", "resolve", "serve",
    "serving", "start", "status", "stop_pid",
]

if __name__ == "__main__":
    sys.exit(main())
