"""The UDP dataplane in a namespace of its own: NodePorts and a ClusterIP, flows, no stale flow.

A UDP service port (sharing its number with a TCP one) is served on the
node's two addresses and on its ClusterIP. Checked for real, with sockets:
replies come from exactly the address and port the client sent to (two node
addresses, and the VIP); datagram boundaries are kept; a flow sticks to its
endpoint, is re-picked on its next datagram when that endpoint goes, and
expires after the (short, for the test) idle timeout; no endpoint at all
gives the client ICMP port unreachable (ECONNREFUSED) on the NodePort and
on the VIP; and closing leaves no UDP socket behind.
"""

from __future__ import annotations

import asyncio
import dataclasses
import socket
from typing import Any

import pytest

from proxy.core.model import EndpointPort, Node, ServicePort
from proxy.core.sync import SyncConfig
from proxy.proxier import Proxier
from proxy.userspace.dataplane import Dataplane
from proxy.userspace.vips import LocalVIPs
from tests.support.loops import run_on
from tests.support.model import endpoint, endpoint_slice, service, snapshot
from tests.support.netns import in_fresh_netns, prefix, sh

NODE = "node-a"
NODE_IPS = ("192.0.2.1", "192.0.2.9")
VIP = "10.96.0.53"
NODE_PORT = 30053
BACKENDS = {"ep5": ("127.0.0.5", 5353), "ep6": ("127.0.0.6", 5353)}


def state(*names: str, generation: int = 1, **svc_kw: Any) -> Any:
    svc = service("dns", type="NodePort", ports=(
        ServicePort("dns-tcp", "TCP", 53, 5353, NODE_PORT),
        ServicePort("dns", "UDP", 53, 5353, NODE_PORT)))
    svc = dataclasses.replace(svc, cluster_ip=VIP, **svc_kw)
    sl = endpoint_slice(svc, [endpoint(BACKENDS[n][0], NODE) for n in names],
                        ports=(EndpointPort("dns-tcp", 5353), EndpointPort("dns", 5353, "UDP")))
    return snapshot([svc], [sl], nodes=(Node(NODE, internal_ips=NODE_IPS),),
                    generation=generation)


class Collect(asyncio.DatagramProtocol):
    """A client socket: every datagram it gets, with the address it came from."""

    def __init__(self) -> None:
        self.got: asyncio.Queue[tuple[bytes, tuple[str, int]]] = asyncio.Queue()
        self.transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        self.got.put_nowait((data, addr))

    async def ask(self, data: bytes, to: tuple[str, int], timeout: float = 1.0
                  ) -> tuple[bytes, tuple[str, int]]:
        assert self.transport is not None
        self.transport.sendto(data, to)
        return await asyncio.wait_for(self.got.get(), timeout)


class Echo(asyncio.DatagramProtocol):
    def __init__(self, name: str) -> None:
        self.name = name.encode()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport: asyncio.DatagramTransport = transport  # type: ignore[assignment]

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        self.transport.sendto(self.name + b":" + data, addr)


async def client() -> Collect:
    loop = asyncio.get_running_loop()
    _, proto = await loop.create_datagram_endpoint(Collect, local_addr=("127.0.0.1", 0))
    return proto


def refused(to: tuple[str, int]) -> bool:
    """Whether a connected UDP socket sending to ``to`` gets ICMP port unreachable."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.settimeout(1.0)
    try:
        s.connect(to)
        s.send(b"anyone?")
        s.recv(100)
    except ConnectionRefusedError:
        return True
    except TimeoutError:
        return False
    finally:
        s.close()
    return False


async def scenario() -> None:
    for ip in NODE_IPS:
        sh("ip", "addr", "add", f"{ip}/32", "dev", "lo")
    loop = asyncio.get_running_loop()
    servers = [await loop.create_datagram_endpoint(lambda n=n: Echo(n), local_addr=addr)
               for n, addr in BACKENDS.items()]
    dp = Dataplane(loop=loop, local_vips=LocalVIPs(base=f"@{prefix()}udp"),
                   udp_timeout=0.4, udp_timeout_stream=0.8)
    px = Proxier(SyncConfig(NODE, vips=True), dataplane=dp)
    try:
        px.sync(state("ep5"))
        await dp.vips_synced()
        assert (NODE_PORT in {p for _, p, _ in dp.listeners()}
                and ("0.0.0.0", NODE_PORT, "serving") in dp.udp_sockets())  # TCP and UDP

        c = await client()
        for ip in NODE_IPS:  # replies from exactly the address the client used
            assert await c.ask(b"q", (ip, NODE_PORT)) == (b"ep5:q", (ip, NODE_PORT))
        assert await c.ask(b"v", (VIP, 53)) == (b"ep5:v", (VIP, 53))

        # Boundaries: three datagrams, three replies of their own sizes, in order.
        assert c.transport is not None
        for size in (1, 1400, 7):
            c.transport.sendto(b"x" * size, (NODE_IPS[0], NODE_PORT))
        sizes = [len((await asyncio.wait_for(c.got.get(), 1.0))[0]) - 4 for _ in range(3)]
        assert sizes == [1, 1400, 7]

        # The endpoint is replaced: the same flow's next datagram goes to the new one.
        px.sync(state("ep6", generation=2))
        assert await c.ask(b"after", (NODE_IPS[0], NODE_PORT)) == (
            b"ep6:after", (NODE_IPS[0], NODE_PORT))
        assert await c.ask(b"after", (VIP, 53)) == (b"ep6:after", (VIP, 53))

        # Idle past the stream timeout: the flows expire and their sockets go.
        assert len(dp.udp.flows) == 3  # one per address the client sent to
        await asyncio.sleep(1.0)
        assert len(dp.udp.flows) == 0

        # No endpoint anywhere: ICMP port unreachable, from the kernel and the guard.
        px.sync(state(generation=3))
        await dp.vips_synced()
        assert dp.udp_sockets() == [("127.0.0.107", dp.udp_sockets()[0][1], "serving")]
        # (Blocking calls on the loop's thread: it is the namespace's, and the
        # kernel answers these, not the loop.)
        assert refused((NODE_IPS[0], NODE_PORT))
        assert refused((VIP, 53))
    finally:
        dp.close()
        for transport, _ in servers:
            transport.close()
    out = sh("ss", "-Hnua").stdout
    assert f":{NODE_PORT}" not in out and "127.0.0.107" not in out, out


@pytest.mark.parametrize("loop_kind", ["uvloop", "asyncio"])
def test_udp_nodeports_and_a_clusterip(loop_kind: str) -> None:
    in_fresh_netns("udpdp", run_on, loop_kind, scenario, 30.0)


# -- a node's own client, an endpoint that goes on sending, affinity across syncs --------


class Pusher(Echo):
    """Echoes, then goes on sending to whoever asked first: one datagram every 50 ms, 4 s
    at most (a streaming server, or a terminating pod still emitting)."""

    task: asyncio.Task[None] | None = None

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        super().datagram_received(data, addr)
        if self.task is None:
            self.task = asyncio.get_running_loop().create_task(self.push(addr))

    async def push(self, addr: tuple[str, int]) -> None:
        for i in range(80):
            await asyncio.sleep(0.05)
            self.transport.sendto(self.name + b":push%d" % i, addr)


async def serving(make: Any = Echo, **dp_kw: Any) -> tuple[Dataplane, Proxier, list[Any]]:
    sh("ip", "addr", "add", f"{NODE_IPS[0]}/32", "dev", "lo")
    loop = asyncio.get_running_loop()
    servers = [await loop.create_datagram_endpoint(lambda n=n: make(n), local_addr=addr)
               for n, addr in BACKENDS.items()]
    dp = Dataplane(loop=loop, local_vips=LocalVIPs(base=f"@{prefix()}udp"), **dp_kw)
    return dp, Proxier(SyncConfig(NODE, vips=True), dataplane=dp), servers


def close(dp: Dataplane, servers: list[Any]) -> None:
    dp.close()
    for transport, proto in servers:
        if getattr(proto, "task", None) is not None:
            proto.task.cancel()
        transport.close()


async def node_client() -> None:
    """An unbound socket on the node sends from the VIP itself (a ``local`` route has no
    ``src``): kpx's answer goes VIP:53 -> VIP:<its port>, and the VIP guard, which judges
    every datagram to a VIP, must let kpx's own answers through."""
    dp, px, servers = await serving()
    try:
        px.sync(state("ep5"))
        await dp.vips_synced()
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.settimeout(1.0)
        try:
            s.connect((VIP, 53))
            assert s.getsockname()[0] == VIP
            s.send(b"dig")
            # (Blocking on the loop's thread: kpx answers from its worker, and the
            # loop has nothing else to do in this namespace but wait with it.)
            assert await asyncio.to_thread(s.recv, 100) == b"ep5:dig"
        finally:
            s.close()
    finally:
        close(dp, servers)


def test_a_node_client_whose_source_is_the_vip_gets_its_answer() -> None:
    in_fresh_netns("udpnode", run_on, "uvloop", node_client, 30.0)


async def removed_endpoint_pushing() -> None:
    """kube-proxy deletes a removed UDP endpoint's conntrack entries: what it sends after is
    not un-NATed to the client. So here: once the endpoint leaves the plan in force, what
    it still sends is not forwarded, and its flow ends, however often it sends."""
    dp, px, servers = await serving(Pusher, udp_timeout=0.4, udp_timeout_stream=0.8)
    try:
        px.sync(state("ep5"))
        await dp.vips_synced()
        c = await client()
        assert (await c.ask(b"hi", (NODE_IPS[0], NODE_PORT)))[0] == b"ep5:hi"
        await asyncio.sleep(0.2)  # ep5 pushes
        px.sync(state("ep6", generation=2))  # ep5 goes; the client stays silent
        await asyncio.sleep(0.1)  # what was on its way already
        while not c.got.empty():
            c.got.get_nowait()
        await asyncio.sleep(1.0)  # 20 pushes more, over the stream timeout
        assert c.got.empty(), c.got.get_nowait()
        assert not dp.udp.flows
    finally:
        close(dp, servers)


def test_a_removed_endpoint_that_goes_on_sending_reaches_the_client_no_more() -> None:
    in_fresh_netns("udppush", run_on, "uvloop", removed_endpoint_pushing, 30.0)


async def affinity_across_syncs() -> None:
    """ClientIP affinity outlives a flow (10800 s against 0.3 s here) and a sync that
    changes nothing of the service: the NodePort and the VIP share one balancer."""
    dp, px, servers = await serving(udp_timeout=0.3, udp_timeout_stream=0.3)
    affinity = {"session_affinity": "ClientIP", "affinity_timeout_seconds": 10800}

    async def endpoint_for(src: str, to: tuple[str, int]) -> bytes:
        _, c = await asyncio.get_running_loop().create_datagram_endpoint(
            Collect, local_addr=(src, 40000))
        try:
            return (await c.ask(b"q", to))[0].split(b":")[0]
        finally:
            assert c.transport is not None
            c.transport.close()

    nodeport, vip = (NODE_IPS[0], NODE_PORT), (VIP, 53)
    try:
        px.sync(state("ep5", "ep6", **affinity))
        await dp.vips_synced()
        first = [await endpoint_for("127.0.0.11", nodeport), await endpoint_for("127.0.0.12", vip)]
        for i, to in enumerate((nodeport, nodeport, vip, vip)):  # move the cursors on
            await endpoint_for(f"127.0.0.{20 + i}", to)
        px.sync(state("ep5", "ep6", generation=2, **affinity))
        assert len({id(p.balancer) for p in dp.udp.ports.values()}) == 1
        await asyncio.sleep(0.6)
        assert not dp.udp.flows
        assert [await endpoint_for("127.0.0.11", nodeport),
                await endpoint_for("127.0.0.12", vip)] == first
    finally:
        close(dp, servers)


def test_udp_affinity_outlives_its_flows_and_an_unrelated_sync() -> None:
    in_fresh_netns("udpaff", run_on, "uvloop", affinity_across_syncs, 30.0)


async def wildcard_holder() -> None:
    """A node process holds UDP 0.0.0.0:53 (a host-network DNS cache, without
    SO_REUSEADDR): sk_lookup still steers the VIP's datagrams to kpx, and kpx's answers
    must still leave from VIP:53, which it cannot bind then."""
    dp, px, servers = await serving()
    daemon = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        daemon.bind(("0.0.0.0", 53))
        px.sync(state("ep5"))
        await dp.vips_synced()
        c = await client()
        for size in (1, 1400):
            data = b"q" * size
            assert await c.ask(data, (VIP, 53)) == (b"ep5:" + data, (VIP, 53))
    finally:
        daemon.close()
        close(dp, servers)


def test_the_vip_answers_when_a_node_process_holds_its_port_on_every_address() -> None:
    in_fresh_netns("udpwild", run_on, "uvloop", wildcard_holder, 30.0)
