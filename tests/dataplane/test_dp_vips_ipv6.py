"""IPv6 service VIPs in the userspace dataplane, on the wire: ClusterIP, iTP, externalIP, UDP.

The topology of ``test_dp_ipv6`` (client -- node -- {pod1, pod2}, ULA IPv6
beside IPv4), with the driver's IPv4 and IPv6 dataplanes serving VIPs
(``--vips``), as ``kpx node`` does: each IPv6 VIP becomes a kpx ``local``
route (``proto 107``) in the node's IPv6 local table, the ``ip6 kpx_vips``
table guards it and the IPv6 ``sk_lookup`` program steers its ports to the
listener on ``::1``. pod1 is this node's endpoint, pod2 one on another node.
A drop is a connect that times out while the table's drop counter rises; a
port no service declares is reset at once. Stopping the driver must leave
no ``ip6`` table and no kpx IPv6 route. Every namespace is removed at module
teardown.
"""

from __future__ import annotations

import asyncio
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from healthz.proxy_health import ProxyHealth
from proxy.core.sync import empty_result
from proxy.userspace.dataplane import Dataplane
from proxy.userspace.sklookup import SkLookup
from proxy.userspace.vips import (
    NFT_TABLE,
    VIP_PROTO,
    Interception,
    LocalVIPs,
    VIPChanges,
    rule_counters,
)
from tests.dataplane.test_dp_ipv6 import (
    BACKEND_PORT,
    CLIENT6,
    LOCAL,
    NODE_POD1_6,
    NODE_POD2_6,
    POD1_6,
    REMOTE,
    UDP_ECHO,
    connect6,
    n1,
    peer,
    topo,
    udp6,
)
from tests.support.driver import Driver
from tests.support.loops import run_on
from tests.support.netns import PY, Topology, in_fresh_netns, in_netns, prefix, sh
from tests.support.objects import endpoint_slice, service

pytestmark = pytest.mark.lab

__all__ = ["topo"]  # the module's topology fixture, shared with test_dp_ipv6

VIP6 = "fd00:96::a"
PODS6 = ("fd77:2::/64", "fd77:3::/64")
"""``--cluster-cidr``: pod1's and pod2's links (the client's is outside)."""
EXT6 = "fd00:99::5"
"""An externalIP: the client reaches it through its default route, the node."""


@pytest.fixture
def driver(topo: Topology, tmp_path: Path) -> Iterator[Driver]:
    drv = Driver(tmp_path, "n1", "--transparent", "--ipv6", "--vips", "--connect-timeout", "0.5",
                 "--cluster-cidr", *PODS6, netns=topo.node)
    try:
        yield drv
    finally:
        drv.stop()


def svc6(name: str, vip: str, *pods: tuple[str, str], port: int = 80, protocol: str = "TCP",
         target: int = BACKEND_PORT, **spec: Any) -> list[dict[str, Any]]:
    """A single-stack IPv6 ClusterIP service ``vip:port`` with its IPv6 slice."""
    return [service(name, None, target, type="ClusterIP", cluster_ip=vip, clusterIPs=[vip],
                    ipFamilies=["IPv6"], ipFamilyPolicy="SingleStack", port=port,
                    protocol=protocol, **spec),
            endpoint_slice(name, *pods, port=target, protocol=protocol, address_type="IPv6")]


def kpx_routes6(ns: str) -> set[str]:
    """The IPv6 destinations of kpx's ``local`` routes in ``ns``."""
    out = sh("ip", "-n", ns, "-6", "-o", "route", "show", "table", "local", "proto",
             str(VIP_PROTO)).stdout
    return {line.split()[1] for line in out.splitlines() if line.strip()}


def table6(ns: str) -> str | None:
    """``nft list table ip6 kpx_vips`` in ``ns`` (None: no such table)."""
    res = subprocess.run(["ip", "netns", "exec", ns, "nft", "list", "table", "ip6", NFT_TABLE],
                         capture_output=True, text=True, check=False)
    return res.stdout if res.returncode == 0 else None


def dropped(ns: str, key: str) -> int:
    listing = table6(ns)
    assert listing is not None
    return rule_counters(listing).get(key, 0)


def times_out(ns: str, addr: tuple[str, int], timeout: float = 0.6) -> bool:
    """True if the SYN meets silence: neither a SYN-ACK nor an RST within ``timeout``."""
    try:
        connect6(ns, addr, timeout).close()
    except TimeoutError:
        return True
    return False


def test_ipv6_clusterip_served_dropped_rejected_and_removed(topo: Topology,
                                                            driver: Driver) -> None:
    driver.start(n1(), *svc6("web6", VIP6, LOCAL))
    assert kpx_routes6(topo.node) == {VIP6}
    listing = table6(topo.node)
    assert listing is not None and f"{VIP6} . 80" in listing
    vip_listener = [x for x in driver.status()["listeners6"] if x[0] == "::1"]
    assert [x[2] for x in vip_listener] == ["serving"], driver.status()["listeners6"]
    # Cluster: from outside (not a pod: SNAT, as ClusterIPSNAT), from a pod, from the node.
    assert peer(topo.client, (VIP6, 80)) == ("pod1", NODE_POD1_6)
    assert peer(topo.pod2, (VIP6, 80))[0] == "pod1"
    assert peer(topo.node, (VIP6, 80))[0] == "pod1"
    with pytest.raises(ConnectionRefusedError):  # a port the service does not declare
        connect6(topo.client, (VIP6, 81))

    # The only endpoint on another node: a pod keeps its IP on that hop (ClusterIPSNAT).
    driver.update(n1(), *svc6("web6", VIP6, REMOTE))
    assert peer(topo.pod1, (VIP6, 80)) == ("pod2", POD1_6)
    assert peer(topo.client, (VIP6, 80)) == ("pod2", NODE_POD2_6)

    # iTP=Local, the only endpoint on another node: every SYN dropped, silently.
    driver.update(n1(), *svc6("web6", VIP6, REMOTE, internalTrafficPolicy="Local"))
    before = dropped(topo.node, "drop_all")  # each sync writes the table afresh
    assert times_out(topo.client, (VIP6, 80))
    assert times_out(topo.pod1, (VIP6, 80))
    assert dropped(topo.node, "drop_all") >= before + 2

    driver.update(n1(), *svc6("web6", VIP6, LOCAL, internalTrafficPolicy="Local"))
    assert peer(topo.client, (VIP6, 80))[0] == "pod1"

    driver.update(n1())  # the service is gone: so is its route, and its port is not served
    assert kpx_routes6(topo.node) == set()
    with pytest.raises(OSError):
        connect6(topo.client, (VIP6, 80), 1.0).close()

    driver.update(n1(), *svc6("web6", VIP6, LOCAL))
    assert peer(topo.client, (VIP6, 80))[0] == "pod1"
    assert driver.stop() == 0
    assert kpx_routes6(topo.node) == set()
    assert table6(topo.node) is None


def test_ipv6_external_ip_cluster_and_local(topo: Topology, driver: Driver) -> None:
    driver.start(n1(), *svc6("ext6", VIP6, LOCAL, externalIPs=[EXT6]))
    assert kpx_routes6(topo.node) == {VIP6, EXT6}
    assert peer(topo.client, (EXT6, 80)) == ("pod1", CLIENT6)

    # eTP=Local with the only endpoint elsewhere: outside clients dropped, while the
    # node itself still gets Cluster semantics (to pod2, SNAT to its own address).
    driver.update(n1(), *svc6("ext6", VIP6, REMOTE, externalIPs=[EXT6],
                              externalTrafficPolicy="Local"))
    before = dropped(topo.node, "drop_external")
    assert times_out(topo.client, (EXT6, 80))
    assert dropped(topo.node, "drop_external") >= before + 1
    assert peer(topo.node, (EXT6, 80))[0] == "pod2"
    assert peer(topo.pod1, (EXT6, 80))[0] == "pod2"  # and so do pods (--cluster-cidr)
    # The ClusterIP of the same service is internal traffic: eTP does not apply.
    assert peer(topo.client, (VIP6, 80))[0] == "pod2"

    driver.update(n1(), *svc6("ext6", VIP6, LOCAL, REMOTE, externalIPs=[EXT6],
                              externalTrafficPolicy="Local"))
    assert {peer(topo.client, (EXT6, 80)) for _ in range(6)} == {("pod1", CLIENT6)}


def test_ipv6_udp_vip(topo: Topology, driver: Driver) -> None:
    port = 8082
    p = topo.popen(topo.pod1, PY, "-c", UDP_ECHO, str(port), "pod1", stdout=subprocess.PIPE)
    assert p.stdout is not None and p.stdout.readline().strip() == "READY"
    dns = svc6("dns6", VIP6, LOCAL, port=53, protocol="UDP", target=port)
    driver.start(n1(), *dns)
    listing = table6(topo.node)
    assert listing is not None and f"{VIP6} . 53" in listing
    assert udp6(topo.client, (VIP6, 53)) == f"pod1 {NODE_POD1_6}"
    assert udp6(topo.pod2, (VIP6, 53)) == f"pod1 {NODE_POD1_6}"  # a local endpoint: SNAT
    assert udp6(topo.node, (VIP6, 53)) == f"pod1 {NODE_POD1_6}"  # the node's own: SNAT
    # An undeclared UDP port on the VIP: ICMPv6 port unreachable, counted.
    before = dropped(topo.node, "udp_reject")
    assert udp6(topo.client, (VIP6, 54), 0.5) is None
    assert dropped(topo.node, "udp_reject") >= before + 1
    driver.update(n1(), dns[0])  # no endpoint left: rejected, not served
    before = dropped(topo.node, "udp_reject")
    assert udp6(topo.client, (VIP6, 53), 0.5) is None
    assert dropped(topo.node, "udp_reject") >= before + 1


def test_the_node_never_answers_neighbour_solicitations_for_an_ipv6_vip(
        topo: Topology, driver: Driver) -> None:
    """A VIP is a route, not an address: the client's NS for it on the link goes unanswered.

    The client is told the VIP is on its link (an on-link route): it must
    resolve it by NDP and, with nobody claiming it, the connect fails,
    while the same VIP through the node as router is served.
    """
    driver.start(n1(), *svc6("web6", VIP6, LOCAL))
    assert peer(topo.client, (VIP6, 80))[0] == "pod1"
    sh("ip", "-n", topo.client, "-6", "route", "add", f"{VIP6}/128", "dev", "eth0")
    try:
        started = time.monotonic()
        with pytest.raises(OSError):  # EHOSTUNREACH once NDP gives up, or the timeout
            connect6(topo.client, (VIP6, 80), 5.0).close()
        assert time.monotonic() - started > 0.5  # not an RST: nobody answered
        neigh = sh("ip", "-n", topo.client, "-6", "neigh", "show", VIP6).stdout
        assert "lladdr" not in neigh, neigh
    finally:
        sh("ip", "-n", topo.client, "-6", "route", "del", f"{VIP6}/128", "dev", "eth0",
           check=False)
        sh("ip", "-n", topo.client, "-6", "neigh", "flush", "dev", "eth0", check=False)


def test_the_ipv6_program_steers_to_ipv6_sockets_only() -> None:
    """Each family's program steers only to a socket of its family (the kernel would refuse)."""
    def check() -> None:
        sk = SkLookup(family=6)
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s, \
                    pytest.raises(ValueError, match="IPv6"):
                sk.steer_to(s)
        finally:
            sk.close()

    in_fresh_netns("sk6", check)


def _owned_rechecked_removed() -> None:
    base = f"@{prefix()}v6own"

    def routes6() -> list[str]:
        out = sh("ip", "-6", "-o", "route", "show", "table", "local", "proto",
                 str(VIP_PROTO)).stdout
        return [line.split()[1] for line in out.splitlines() if line.strip()]

    def has_table(family: str) -> bool:
        return sh("nft", "list", "table", family, NFT_TABLE, check=False).returncode == 0

    v4, v6 = LocalVIPs(base=base), LocalVIPs(base=base, family=6)
    rules = Interception(served=frozenset({(VIP6, 80)}), passed=PODS6)
    try:
        with pytest.raises(ValueError, match="IPv4 address where IPv6"):
            v6.sync({"10.96.0.10"}, rules)
        with pytest.raises(ValueError, match="not usable"):
            v6.sync({"fe80::1"}, rules)
        with pytest.raises(ValueError, match="IPv6 address where IPv4"):
            v4.sync({VIP6})
        v4.sync({"10.96.0.10"}, Interception())
        assert v6.sync({VIP6, EXT6.upper()}, rules).added == tuple(sorted((VIP6, EXT6)))
        assert sorted(routes6()) == sorted((VIP6, EXT6)) and has_table("ip6")
        # A restart's successor finds them and adds nothing: one copy of each.
        again = LocalVIPs(base=base, family=6)
        assert again.sync({VIP6, EXT6}, rules).added == ()
        again.close()
        assert sorted(routes6()) == sorted((VIP6, EXT6))
        # Removed outside kpx: the next check puts back exactly what went.
        sh("ip", "-6", "route", "del", "local", f"{EXT6}/128", "table", "local")
        sh("nft", "delete", "table", "ip6", NFT_TABLE)
        assert v6.ensure() == VIPChanges(added=(EXT6,), rules=True)
        assert sorted(routes6()) == sorted((VIP6, EXT6)) and has_table("ip6")
        # Not kpx's: a route with another proto is left alone, and never deleted.
        sh("ip", "-6", "route", "add", "local", "fd00:96::f/128", "dev", "lo", "table", "local")
        v6.sync({VIP6}, rules)
        assert routes6() == [VIP6]
        assert v6.remove_all()
        assert routes6() == [] and not has_table("ip6")
        assert "fd00:96::f" in sh("ip", "-6", "route", "show", "table", "local").stdout
        assert has_table("ip") and "10.96.0.10" in sh("ip", "-4", "route", "show", "table",
                                                      "local", "proto", str(VIP_PROTO)).stdout
    finally:
        v6.close()
        v4.remove_all()


def test_ipv6_vips_are_owned_rechecked_and_removed() -> None:
    """``LocalVIPs(family=6)``: its routes and ``ip6`` table only; put back; one copy; gone."""
    in_fresh_netns("v6own", _owned_rechecked_removed)


def lb6(ip_mode: str) -> list[dict[str, Any]]:
    """An IPv6 LoadBalancer service whose ingress IP ``LB6`` has ``ip_mode``."""
    return [service("lb6", 30190, BACKEND_PORT, type="LoadBalancer", cluster_ip=VIP6,
                    clusterIPs=[VIP6], ipFamilies=["IPv6"], ipFamilyPolicy="SingleStack",
                    status={"loadBalancer": {"ingress": [{"ip": LB6, "ipMode": ip_mode}]}}),
            endpoint_slice("lb6", LOCAL, port=BACKEND_PORT, address_type="IPv6")]


LB6 = "fd00:79::10"


def test_ipv6_lb_ingress_ip_served_in_vip_mode_only(topo: Topology, driver: Driver) -> None:
    driver.start(n1(), *lb6("VIP"))
    assert kpx_routes6(topo.node) == {VIP6, LB6}
    assert peer(topo.client, (LB6, 80)) == ("pod1", CLIENT6)  # eTP=Cluster, a local hop
    driver.update(n1(), *lb6("Proxy"))  # in-cluster traffic to it goes out to the real LB
    assert kpx_routes6(topo.node) == {VIP6}
    table = table6(topo.node)
    assert table is not None and LB6 not in table


async def _fault_is_ipv6s() -> None:
    health = ProxyHealth()
    dp = Dataplane(loop=asyncio.get_running_loop(), family=6, health=health,
                   local_vips=LocalVIPs(base=f"@{prefix()}v6f", family=6))
    try:
        # Until its first VIPs are in force: IPv6's fault, not IPv4's nor everyone's.
        assert health.fault(Dataplane.VIP_FAULT, "IPv6") is not None
        assert health.fault(Dataplane.VIP_FAULT, "IPv4") is None
        assert health.fault(Dataplane.VIP_FAULT) is None
        dp.apply(empty_result(1, 6))
        await dp.vips_synced()
        assert health.fault(Dataplane.VIP_FAULT, "IPv6") is None
        assert [(a, st) for a, _p, st in dp.listeners()] == [("::1", "serving")]
    finally:
        dp.close()


def test_the_ipv6_vips_health_fault_is_ipv6s_only() -> None:
    in_fresh_netns("v6f", run_on, "uvloop", _fault_is_ipv6s, 30.0)


def test_ipv6_udp_vip_answers_when_a_node_process_holds_its_port(
        topo: Topology, driver: Driver) -> None:
    """A node process on UDP [::]:53 keeps kpx from binding [VIP]:53 to answer from: it
    answers through a raw socket instead, the UDP checksum the kernel's (IPV6_CHECKSUM)."""
    port = 8083
    p = topo.popen(topo.pod1, PY, "-c", UDP_ECHO, str(port), "pod1", stdout=subprocess.PIPE)
    assert p.stdout is not None and p.stdout.readline().strip() == "READY"

    def hold() -> socket.socket:
        s = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
        s.bind(("::", 53))
        return s

    holder = in_netns(topo.node, hold)
    try:
        driver.start(n1(), *svc6("dns6", VIP6, LOCAL, port=53, protocol="UDP", target=port))
        assert udp6(topo.client, (VIP6, 53)) == f"pod1 {NODE_POD1_6}"
    finally:
        holder.close()
