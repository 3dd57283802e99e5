"""Where NodePorts and health checks listen: ``--nodeport-addresses``, read in one place.

Owns: ``nodeport_addresses``, kube-proxy's interpretation of
``--nodeport-addresses`` for this node, and ``parse_nodeport_addresses``, the
flag's parser. The dataplane's listeners and the healthCheckNodePorts both
come from it (through ``proxy.core.sync``), so they can never disagree.

Never: look at interfaces or sockets. The node's addresses come from its
Node object, and 127.0.0.1 stands for loopback.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable

Network = ipaddress.IPv4Network | ipaddress.IPv6Network

WILDCARD = "0.0.0.0"
LOCALHOST = "127.0.0.1"


def parse_nodeport_addresses(text: str) -> list[Network]:
    """``"10.0.0.0/8, 127.0.0.1"`` -> networks; a plain IP is its /32. Raises ``ValueError``."""
    return [ipaddress.ip_network(c.strip(), strict=False) for c in text.split(",") if c.strip()]


def nodeport_addresses(
    node_ips: Iterable[str], cidrs: Iterable[Network] | None, bind_localhost: bool = True
) -> tuple[str, ...]:
    """The addresses to listen on, as kube-proxy's iptables mode accepts NodePorts.

    Without CIDRs every local address serves NodePorts (``-m addrtype
    --dst-type LOCAL``, 127.0.0.1 included): one wildcard socket per port
    says exactly that, and costs one fd instead of one per address, which is
    what lets 10,000 services fit a 20,000-fd limit. It also follows
    addresses that come and go without a sync: nothing to rebind. An IPv4
    CIDR of length 0 matches every local address too, so it means the same.
    With other CIDRs, only the node IPs (and 127.0.0.1) inside them, in that
    order. ``bind_localhost=False`` (no loopback NodePorts) cannot be said
    with a wildcard, so it lists the node IPs.
    """
    nets = list(cidrs or ())
    if bind_localhost and (
        not nets or any(n.prefixlen == 0 and n.version == 4 for n in nets)
    ):
        return (WILDCARD,)
    candidates = list(dict.fromkeys(node_ips))
    if bind_localhost and LOCALHOST not in candidates:
        candidates.append(LOCALHOST)
    if not nets:
        return tuple(candidates)
    out = []
    for a in candidates:
        try:
            ip = ipaddress.ip_address(a)
        except ValueError:
            continue
        if any(ip.version == n.version and ip in n for n in nets):
            out.append(a)
    return tuple(out)
