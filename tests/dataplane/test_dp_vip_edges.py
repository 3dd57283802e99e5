"""VIPs at their edges: a node address used as a VIP, and overlapping cluster CIDRs.

Each scenario runs a real ``Dataplane`` in a namespace of its own (``lo`` holds the
node's address), with TCP echo servers for the endpoint and a node process.

- A node address made an externalIP, or written as an LB ingress IP (k3s's ServiceLB
  does so, ipMode VIP), is local through a route kpx does not own: kpx steers the
  service's own ports there, and must leave every other port of the node alone (SSH,
  the kubelet, the NodePorts, VXLAN), where kube-proxy rejects undeclared ports only on
  ClusterIPs. The same once the address is added *after* kpx made it a VIP (kpx's own
  route came first): the guard's every-period check sees the address's route and gives
  the node its other ports back, and takes them again when the address goes.
- ``--cluster-cidr`` entries that overlap (10.0.0.0/8 with 10.244.0.0/16) are merged
  before they become an nft interval set, which refuses overlaps: the VIP guard's table
  is written, not left out while the VIP routes are in.
"""

from __future__ import annotations

import asyncio
import dataclasses
import socket
import time
from typing import Any

import pytest

from healthz.proxy_health import ProxyHealth
from proxy.core.model import LoadBalancerIngress, Node, ServicePort
from proxy.core.sync import SyncConfig
from proxy.proxier import Proxier
from proxy.userspace.dataplane import Dataplane
from proxy.userspace.vips import LocalVIPs, VIPGuard
from tests.support.loops import run_on
from tests.support.model import endpoint, endpoint_slice, service, snapshot
from tests.support.netns import in_fresh_netns, prefix, sh

pytestmark = pytest.mark.lab

NODE = "node-a"
NODE_IP = "10.77.9.1"
VIP = "10.96.0.10"
BACKEND = ("127.0.0.5", 8080)
NODE_PORT = 30080


def state(external: str | None = None) -> Any:
    """One service, port 80 -> BACKEND, NodePort 30080; its externalIP or its LB ingress
    IP (``external`` "ip" or "lb") the node's own address."""
    svc = service("web", type="NodePort", ports=(ServicePort("", "TCP", 80, 8080, NODE_PORT),))
    svc = dataclasses.replace(svc, cluster_ip=VIP)
    if external == "ip":
        svc = dataclasses.replace(svc, external_ips=(NODE_IP,))
    elif external == "lb":
        svc = dataclasses.replace(svc, type="LoadBalancer",
                                  ingress=(LoadBalancerIngress(NODE_IP, "VIP"),))
    return snapshot([svc], [endpoint_slice(svc, [endpoint(BACKEND[0], NODE)])],
                    nodes=(Node(NODE, internal_ips=(NODE_IP,)),))


async def ask(addr: str, port: int) -> str:
    """What a TCP client of ``addr:port`` gets: the server's answer, or "refused"."""
    try:
        async with asyncio.timeout(2):
            r, w = await asyncio.open_connection(addr, port)
            w.write(b"ping")
            data = await r.read(100)
            w.close()
    except ConnectionRefusedError:
        return "refused"
    return data.decode()


async def servers() -> list[asyncio.Server]:
    async def echo(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        w.write(b"pong:" + await r.read(100))
        await w.drain()
        w.close()

    async def sshd(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        w.write(b"sshd")
        await w.drain()
        w.close()

    # Node processes on every address: what a VIP's undeclared port must not reach.
    return [await asyncio.start_server(echo, *BACKEND),
            await asyncio.start_server(sshd, "0.0.0.0", 2222),
            await asyncio.start_server(sshd, "0.0.0.0", 81)]


def datagram_reaches_the_node() -> bool:
    """A node daemon on UDP 8472 (VXLAN, say) gets a datagram sent to the node's address."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as rx, \
            socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as tx:
        rx.bind(("0.0.0.0", 8472))
        rx.settimeout(1.0)
        tx.sendto(b"vxlan", (NODE_IP, 8472))
        try:
            return rx.recv(100) == b"vxlan"
        except TimeoutError:
            return False


def node_address_as(external: str) -> Any:
    async def scenario() -> None:
        sh("ip", "addr", "add", f"{NODE_IP}/24", "dev", "lo")
        running = await servers()
        dp = Dataplane(loop=asyncio.get_running_loop(),
                       local_vips=LocalVIPs(base=f"@{prefix()}vipedge"))
        try:
            Proxier(SyncConfig(NODE, vips=True), dataplane=dp).sync(state(external))
            await dp.vips_synced()
            assert await ask(NODE_IP, 80) == "pong:ping"  # the service's own port
            assert await ask(NODE_IP, 2222) == "sshd"  # the node's, untouched
            assert await ask(NODE_IP, 81) == "sshd"
            assert await ask(NODE_IP, NODE_PORT) == "pong:ping"
            assert await ask(VIP, 81) == "refused"  # a ClusterIP's undeclared port still is
            assert await asyncio.to_thread(datagram_reaches_the_node)
        finally:
            dp.close()
            for s in running:
                s.close()
    return scenario


@pytest.mark.parametrize("external", ["ip", "lb"], ids=["externalIP", "lb-ingress-ip"])
def test_a_node_address_used_as_a_vip_keeps_the_nodes_other_ports(external: str) -> None:
    in_fresh_netns("vipedge", run_on, "uvloop", node_address_as(external), 30.0)


async def eventually(addr: str, port: int, answer: str, within: float = 10.0) -> None:
    """Poll ``ask`` until it gives ``answer``; fail with the last one past ``within``."""
    deadline = time.monotonic() + within
    while (got := await ask(addr, port)) != answer:
        assert time.monotonic() < deadline, f"{addr}:{port} still gives {got!r}, not {answer!r}"
        await asyncio.sleep(0.05)


async def node_address_added_later() -> None:
    running = await servers()
    dp = Dataplane(loop=asyncio.get_running_loop(),
                   local_vips=LocalVIPs(base=f"@{prefix()}vipedge"))
    assert dp.local_vips is not None
    guard = asyncio.create_task(VIPGuard(dp.local_vips, ProxyHealth(), period=0.1).run())
    try:
        Proxier(SyncConfig(NODE, vips=True), dataplane=dp).sync(state("ip"))
        await dp.vips_synced()
        # Not yet a node address: a VIP like a ClusterIP, its undeclared ports refused.
        assert await ask(NODE_IP, 2222) == "refused"

        sh("ip", "addr", "add", f"{NODE_IP}/24", "dev", "lo")
        await eventually(NODE_IP, 2222, "sshd")  # no VIP change: the guard's check saw it
        assert await ask(NODE_IP, 81) == "sshd"
        assert await ask(NODE_IP, 80) == "pong:ping"  # the service's own port
        assert await ask(VIP, 81) == "refused"
        assert await asyncio.to_thread(datagram_reaches_the_node)

        # The address goes: kpx's route kept the VIP local, and its other ports are refused.
        sh("ip", "addr", "del", f"{NODE_IP}/24", "dev", "lo")
        await eventually(NODE_IP, 2222, "refused")
        assert await ask(NODE_IP, 80) == "pong:ping"
    finally:
        guard.cancel()
        dp.close()
        for s in running:
            s.close()


def test_a_node_address_added_after_it_became_a_vip_gets_its_other_ports_back() -> None:
    in_fresh_netns("vipaddr", run_on, "uvloop", node_address_added_later, 30.0)


async def overlapping_cluster_cidrs() -> None:
    running = await servers()
    dp = Dataplane(loop=asyncio.get_running_loop(),
                   local_vips=LocalVIPs(base=f"@{prefix()}vipedge"),
                   cluster_cidrs=["10.0.0.0/8", "10.244.0.0/16", "10.0.0.0/8"])
    try:
        Proxier(SyncConfig(NODE, vips=True), dataplane=dp).sync(state())
        async with asyncio.timeout(10):
            await dp.vips_synced()
        assert sh("nft", "list", "table", "ip", "kpx_vips", check=False).returncode == 0
        assert await ask(VIP, 80) == "pong:ping"
        assert await ask(VIP, 81) == "refused"  # not the node process behind it
    finally:
        dp.close()
        for s in running:
            s.close()


def test_overlapping_cluster_cidrs_still_give_the_vip_guard() -> None:
    in_fresh_netns("vipcidr", run_on, "uvloop", overlapping_cluster_cidrs, 30.0)
