"""--nodeport-addresses, read in one place: where NodePorts and health checks listen."""

from __future__ import annotations

import ipaddress
import re

import pytest

from proxy.core.addresses import nodeport_addresses, parse_bind_address, parse_nodeport_addresses
from proxy.core.addresses import nodeport_addresses as listen_addresses
from proxy.core.model import Node


def test_listen_addresses_follow_nodeport_cidrs() -> None:
    nets = lambda *c: [ipaddress.ip_network(x) for x in c]  # noqa: E731
    ips = ["10.0.0.5", "192.168.9.9"]
    # No CIDRs: every local address, as --dst-type LOCAL; one socket per port.
    assert listen_addresses(ips, None, True) == ("0.0.0.0",)
    assert listen_addresses((), None, True) == ("0.0.0.0",)
    assert listen_addresses(ips, [], True) == ("0.0.0.0",)
    # Without loopback NodePorts a wildcard would say too much: per node IP.
    assert listen_addresses(ips, None, False) == ("10.0.0.5", "192.168.9.9")
    # CIDRs: one socket per node IP (and 127.0.0.1) inside them.
    assert listen_addresses(ips, nets("10.0.0.0/8"), True) == ("10.0.0.5",)
    assert listen_addresses(ips, nets("127.0.0.0/8", "192.168.0.0/16"), True) == (
        "192.168.9.9", "127.0.0.1")
    # Each family reads only its own CIDRs (NewNodePortAddresses): none of
    # IPv4's is every IPv4 address.
    assert listen_addresses(ips, nets("fd00::/8"), True) == ("0.0.0.0",)
    assert listen_addresses(ips, nets("fd00::/8", "10.0.0.0/8"), True) == ("10.0.0.5",)


def test_ipv6_listen_addresses_never_include_loopback() -> None:
    """The IPv6 proxier: ``::`` or its node IPs in its CIDRs; ``::1`` never (iptables mode)."""
    nets = lambda *c: [ipaddress.ip_network(x) for x in c]  # noqa: E731
    ips = ["fd00:a::5", "2001:db8::9"]
    assert listen_addresses(ips, None, True, family=6) == ("::",)
    assert listen_addresses(ips, None, False, family=6) == ("::",)
    assert listen_addresses(ips, nets("10.0.0.0/8"), True, family=6) == ("::",)
    assert listen_addresses(ips, nets("::/0"), True, family=6) == ("::",)
    assert listen_addresses(ips, nets("fd00::/8"), True, family=6) == ("fd00:a::5",)
    assert listen_addresses(ips, nets("::1/128", "2001:db8::/32"), True, family=6) == (
        "2001:db8::9",)


def test_nodeport_addresses_for_health_checks() -> None:
    """--nodeport-addresses, as the health checks take it (loopback always a candidate)."""
    node = Node("node-a", internal_ips=("192.0.2.1",), external_ips=("198.51.100.1",))
    ips = node.ips

    def hosts(*cidrs: object) -> tuple[str, ...]:
        return nodeport_addresses(ips, parse_nodeport_addresses(",".join(map(str, cidrs))))

    assert nodeport_addresses(ips, None) == ("0.0.0.0",)
    assert hosts() == ("0.0.0.0",)
    assert hosts("0.0.0.0/0") == ("0.0.0.0",)
    assert hosts("192.0.2.0/24") == ("192.0.2.1",)
    assert hosts(
        ipaddress.ip_network("192.0.2.0/24"), ipaddress.ip_network("127.0.0.0/8")
    ) == ("192.0.2.1", "127.0.0.1")
    assert hosts("10.0.0.0/8") == ()
    assert hosts("127.0.0.1", "127.0.0.1") == ("127.0.0.1",)
    with pytest.raises(ValueError):
        parse_nodeport_addresses("not-an-ip")
    with pytest.raises(ValueError):
        parse_nodeport_addresses("10.0.0.0/33")


def test_parse_bind_address() -> None:
    assert parse_bind_address("0.0.0.0:10256", 1) == ("0.0.0.0", 10256)
    assert parse_bind_address("127.0.0.1", 10249) == ("127.0.0.1", 10249)
    assert parse_bind_address(":8080", 1) == ("0.0.0.0", 8080)
    assert parse_bind_address("[::1]:9", 1) == ("::1", 9)
    assert parse_bind_address("[::1]", 7) == ("::1", 7)
    assert parse_bind_address("", 1) is None


@pytest.mark.parametrize(("text", "why"), [
    ("nohost:1", "'nohost' is not an IP address"),
    ("1.2.3:abc", "port 'abc' is not a number"),
    ("999.1.1.1:80", "'999.1.1.1' is not an IP address"),
    ("[::1", "no closing ']'"),
    ("[::1]x", "expected ':PORT' after ']'"),
    ("0.0.0.0:70000", "port 70000 out of range"),
    ("0.0.0.0:-1", "port '-1' is not a number"),
])
def test_a_malformed_bind_address_says_what_is_wrong(text: str, why: str) -> None:
    with pytest.raises(ValueError, match=re.escape(why)):
        parse_bind_address(text, 1)
