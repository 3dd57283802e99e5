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
WILDCARD6 = "::"
LOCALHOST = "127.0.0.1"


def parse_nodeport_addresses(text: str) -> list[Network]:
    """``"10.0.0.0/8, 127.0.0.1"`` -> networks; a plain IP is its /32. Raises ``ValueError``."""
    return [ipaddress.ip_network(c.strip(), strict=False) for c in text.split(",") if c.strip()]


def nodeport_addresses(
    node_ips: Iterable[str], cidrs: Iterable[Network] | None, bind_localhost: bool = True,
    family: int = 4,
) -> tuple[str, ...]:
    """The addresses of ``family`` to listen on, as kube-proxy's iptables mode accepts NodePorts.

    Each family's proxier reads only the CIDRs of its own family
    (``NewNodePortAddresses``): with none of them, every local address of
    the family serves NodePorts (``-m addrtype --dst-type LOCAL``, 127.0.0.1
    included), and so does a CIDR of length 0. One wildcard socket per port
    says exactly that, and costs one fd instead of one per address, which is
    what lets 10,000 services fit a 20,000-fd limit. It also follows
    addresses that come and go without a sync: nothing to rebind. With other
    CIDRs, only the node IPs (and 127.0.0.1) inside them, in that order.
    ``bind_localhost=False`` (no loopback NodePorts) cannot be said with a
    wildcard, so it lists the node IPs.

    IPv6 never serves ``::1``: iptables mode has no IPv6 localhost NodePorts
    (there is no ``route_localnet`` for IPv6). Its wildcard is ``::``, and
    the dataplane's IPv6 wildcard sockets turn ``::1`` away.
    """
    nets = [n for n in cidrs or () if n.version == family]
    everywhere = not nets or any(n.prefixlen == 0 for n in nets)
    candidates = list(dict.fromkeys(node_ips))
    if family == 6:
        if everywhere:
            return (WILDCARD6,)
    else:
        if bind_localhost and everywhere:
            return (WILDCARD,)
        if bind_localhost and LOCALHOST not in candidates:
            candidates.append(LOCALHOST)
        if everywhere:
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


def parse_bind_address(value: str | None, default_port: int) -> tuple[str, int] | None:
    """``"ip:port"``, ``"[v6]:port"``, ``"ip"`` or ``":port"`` -> ``(host, port)``.

    Empty means disabled, as with kube-proxy's bind-address flags. Raises
    ValueError, worded for the flag's error line, for anything else.
    """
    if value is None or not value.strip():
        return None
    value = value.strip()
    host, port_text = value, ""
    if value.startswith("["):
        end = value.find("]")
        if end < 0:
            raise ValueError(f"{value!r}: no closing ']'")
        host, rest = value[1:end], value[end + 1 :]
        if rest:
            if not rest.startswith(":"):
                raise ValueError(f"{value!r}: expected ':PORT' after ']'")
            port_text = rest[1:]
    elif value.count(":") == 1:
        host, _, port_text = value.partition(":")
    port = default_port
    if port_text:
        if not port_text.isdigit():
            raise ValueError(f"{value!r}: port {port_text!r} is not a number")
        port = int(port_text)
    host = host or "0.0.0.0"
    try:
        ipaddress.ip_address(host)
    except ValueError:
        raise ValueError(f"{value!r}: {host!r} is not an IP address") from None
    if not 0 <= port <= 65535:
        raise ValueError(f"port {port} out of range in {value!r}")
    return host, port
