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


def state(*names: str, generation: int = 1) -> Any:
    svc = service("dns", type="NodePort", ports=(
        ServicePort("dns-tcp", "TCP", 53, 5353, NODE_PORT),
        ServicePort("dns", "UDP", 53, 5353, NODE_PORT)))
    svc = dataclasses.replace(svc, cluster_ip=VIP)
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
