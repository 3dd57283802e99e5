"""``loadBalancerSourceRanges`` in the userspace mode: dropped at the SYN, in the kernel.

The relay only sees a connection once its handshake is done, so kube-proxy's
firewall (a new connection to an LB ingress IP from outside the ranges is
dropped: no SYN-ACK, no RST) has to be the VIP table's: ``ip kpx_vips``'s
``firewall`` map and its ``fw_<n>`` chains. In a namespace of its own, a
real ``Dataplane`` and ``Proxier`` serve a LoadBalancer's ingress IP; the
clients are the namespace's own sockets bound to addresses on ``lo`` (the
node's own SYNs pass prerouting too, so the table judges them by their
source): one in the ranges is served, one outside times out while the
firewall chain counts the SYN and the backend sees nothing. A connection
that gets past the table anyway (its chain flushed behind kpx's back) is
reset by the relay's own ``decide``, never forwarded. ``allowFromNode``: the
node reaching its LB IP comes from that IP, served only when a range holds
the node's address. IPv6: the same table in ``ip6 kpx_vips``, through
``LocalVIPs(family=6)``, for TCP and UDP. Namespaces are removed pass or fail.
"""

from __future__ import annotations

import asyncio
import dataclasses
import ipaddress
import socket
import subprocess

import pytest

from proxy.core.model import LoadBalancerIngress, ServicePort
from proxy.core.sync import SyncConfig
from proxy.proxier import Proxier
from proxy.userspace.dataplane import Dataplane
from proxy.userspace.vips import (
    NFT_TABLE,
    Firewall,
    Interception,
    LocalVIPs,
    firewall_sources,
    rule_counters,
)
from tests.support.loops import run_on
from tests.support.model import NODES, endpoint, endpoint_slice, service, snapshot
from tests.support.netns import in_fresh_netns, prefix

pytestmark = pytest.mark.lab

NODE = "node-a"
NODE_IP = NODES[0].internal_ips[0]
LB_IP = "203.0.113.80"
IN_RANGE, OUTSIDE = "198.51.100.20", "100.64.0.5"
BACKEND = ("127.0.0.5", 8080)
DROP_WINDOW = 0.6


def state(ranges: tuple[str, ...], generation: int):  # type: ignore[no-untyped-def]
    svc = service("web", type="LoadBalancer", ports=(ServicePort("", "TCP", 80, 8080, 30080),))
    svc = dataclasses.replace(
        svc, cluster_ip="10.96.0.10", ingress=(LoadBalancerIngress(LB_IP),),
        load_balancer_source_ranges=tuple(ipaddress.ip_network(r) for r in ranges))
    return snapshot([svc], [endpoint_slice(svc, [endpoint(BACKEND[0], NODE)])],
                    generation=generation)


def firewall_drops(family: str = "ip") -> int:
    out = subprocess.run(["nft", "list", "table", family, NFT_TABLE], capture_output=True,
                         text=True, check=True).stdout
    return rule_counters(out).get("firewall", 0)


async def request(source: str | None, dst: str = LB_IP, timeout: float = 1.0) -> bytes:
    """One request to ``dst``:80 from ``source`` (None: the kernel's choice); the reply."""
    local = None if source is None else (source, 0)
    reader, writer = await asyncio.wait_for(
        asyncio.open_connection(dst, 80, local_addr=local), timeout)
    try:
        writer.write(b"ping")
        await writer.drain()
        return await asyncio.wait_for(reader.read(100), timeout)
    finally:
        writer.close()


async def scenario() -> None:
    for address in (IN_RANGE, OUTSIDE):
        subprocess.run(["ip", "addr", "add", f"{address}/32", "dev", "lo"], check=True)
    seen: list[str] = []

    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen.append(writer.get_extra_info("peername")[0])
        writer.write(b"pong:" + await reader.read(100))
        await writer.drain()
        writer.close()

    backend = await asyncio.start_server(echo, *BACKEND)
    dp = Dataplane(loop=asyncio.get_running_loop(), local_vips=LocalVIPs(base=f"@{prefix()}fw"))
    px = Proxier(SyncConfig(NODE, vips=True), dataplane=dp)
    try:
        px.sync(state(("198.51.100.0/24",), 1))
        await dp.vips_synced()
        assert await request(IN_RANGE) == b"pong:ping"
        served = len(seen)

        # Outside the ranges: no SYN-ACK and no RST (the connect times out), the
        # kernel's firewall chain counts the SYN, and the relay never sees it.
        before = firewall_drops()
        with pytest.raises(TimeoutError):
            await request(OUTSIDE, timeout=DROP_WINDOW)
        assert firewall_drops() > before
        # The node reaching its LB IP comes from the LB IP: not in a range, dropped.
        with pytest.raises(TimeoutError):
            await request(None, timeout=DROP_WINDOW)
        assert len(seen) == served
        # The ClusterIP of the same service is never filtered.
        assert await request(OUTSIDE, "10.96.0.10") == b"pong:ping"
        served = len(seen)

        # A SYN that got past the table (its chain emptied behind kpx's back):
        # the relay's decide drops it too, and the handshake done, resets it.
        subprocess.run(["nft", "flush", "chain", "ip", NFT_TABLE, "fw_0"], check=True)
        # ECONNRESET, not ECONNREFUSED: the handshake was done when the reset came
        # (on loopback, often before the connect returned).
        with pytest.raises(ConnectionResetError):
            await request(OUTSIDE)
        assert len(seen) == served

        # A range holding the node's address lets its LB IP through (allowFromNode),
        # and the next sync writes the whole table again.
        px.sync(state(("198.51.100.0/24", f"{NODE_IP}/32"), 2))
        await dp.vips_synced()
        assert await request(None) == b"pong:ping"
        with pytest.raises(TimeoutError):
            await request(OUTSIDE, timeout=DROP_WINDOW)

        # Ranges that take the client in: served, live.
        px.sync(state(("100.64.0.0/10",), 3))
        await dp.vips_synced()
        assert await request(OUTSIDE) == b"pong:ping"
        with pytest.raises(TimeoutError):
            await request(IN_RANGE, timeout=DROP_WINDOW)
    finally:
        dp.close()
        backend.close()
    assert subprocess.run(["nft", "list", "table", "ip", NFT_TABLE],
                          capture_output=True, check=False).returncode != 0


def test_an_out_of_range_syn_is_dropped_in_the_kernel_and_an_in_range_one_served() -> None:
    in_fresh_netns("fwdp", run_on, "uvloop", scenario, 30.0)


LB6 = "2001:db8:96::80"
IN6, OUT6 = "2001:db8:1::20", "2001:db8:2::20"


def _ipv6() -> None:
    for address in (IN6, OUT6):
        subprocess.run(["ip", "addr", "add", f"{address}/128", "dev", "lo", "nodad"],
                       check=True)
    vips = LocalVIPs(base=f"@{prefix()}fw6", family=6)
    firewall = Firewall("default/web", firewall_sources([ipaddress.ip_network("2001:db8:1::/48")]),
                        frozenset({(LB6, "tcp", 80), (LB6, "udp", 53)}))
    srv = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
    udp = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
    try:
        vips.sync({LB6}, Interception(served=frozenset({(LB6, 80)}),
                                      udp_served=frozenset({(LB6, 53)}), firewalls=(firewall,)))
        srv.bind(("::", 80))
        srv.listen(8)
        udp.bind(("::", 53))
        udp.settimeout(DROP_WINDOW)

        def datagram(source: str) -> bytes:
            with socket.socket(socket.AF_INET6, socket.SOCK_DGRAM) as c:
                c.bind((source, 0))
                c.sendto(source.encode(), (LB6, 53))
                return udp.recvfrom(100)[0]

        def connect(source: str) -> None:
            with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as c:
                c.settimeout(DROP_WINDOW)
                c.bind((source, 0))
                c.connect((LB6, 80))
                srv.accept()[0].close()

        connect(IN6)
        before = firewall_drops("ip6")
        with pytest.raises(TimeoutError):
            connect(OUT6)
        assert firewall_drops("ip6") > before
        # UDP: every datagram from outside is dropped before it is steered.
        assert datagram(IN6) == IN6.encode()
        before = firewall_drops("ip6")
        with pytest.raises(TimeoutError):
            datagram(OUT6)
        assert firewall_drops("ip6") > before
    finally:
        udp.close()
        srv.close()
        vips.remove_all()


def test_ipv6_out_of_range_syns_and_datagrams_are_dropped_in_the_kernel() -> None:
    in_fresh_netns("fwdp6", _ipv6)
