"""The userspace dataplane serving a ClusterIP: VIP made local, its port steered to kpx, iTP.

In a namespace of its own, with ``LocalVIPs`` making the VIP local and a
``Proxier`` whose config turns VIPs on: a connection to ``clusterIP:port``
reaches the endpoint through the one VIP listener, even with a node process
listening on ``0.0.0.0`` at that port; a port the service does not declare is
refused at once, even where a node process listens on it; iTP=Local with the
only endpoint on another node drops the SYN (no SYN-ACK, no RST: the connect
times out); deleting the service, and closing the dataplane, leave no kpx
route, rule or listener behind.
"""

from __future__ import annotations

import asyncio
import dataclasses
import subprocess

import pytest

from healthz.proxy_health import ProxyHealth
from proxy.core.model import ServicePort
from proxy.core.sync import SyncConfig
from proxy.proxier import Proxier
from proxy.userspace.dataplane import Dataplane
from proxy.userspace.vips import LISTEN_ADDRESS, NFT_TABLE, VIP_PROTO, LocalVIPs
from tests.support.loops import run_on
from tests.support.model import endpoint, endpoint_slice, service, snapshot
from tests.support.netns import in_fresh_netns, prefix

NODE = "node-a"
VIP = "10.96.0.10"
BACKEND = ("127.0.0.5", 8080)


def kpx_routes() -> list[str]:
    out = subprocess.run(["ip", "-4", "route", "show", "table", "local", "proto", str(VIP_PROTO)],
                         capture_output=True, text=True, check=True).stdout
    return [line for line in out.splitlines() if line.strip()]


def served_pairs() -> str:
    """The elements of the nft table's ``served`` set ("" when the table is gone)."""
    res = subprocess.run(["nft", "list", "set", "ip", NFT_TABLE, "served"],
                         capture_output=True, text=True, check=False)
    return res.stdout if res.returncode == 0 else ""


def conntrack_count() -> int | None:
    """Connections conntrack tracks in this thread's namespace (None: no conntrack at all)."""
    try:
        with open("/proc/sys/net/netfilter/nf_conntrack_count") as f:
            return int(f.read())
    except OSError:
        return None


def table_present() -> bool:
    return subprocess.run(["nft", "list", "table", "ip", NFT_TABLE],
                          capture_output=True, check=False).returncode == 0


def state(itp: str = "Cluster", ep_node: str = NODE, generation: int = 1, present: bool = True):
    svc = service("db", type="ClusterIP", ports=(ServicePort("", "TCP", 80, 8080),))
    svc = dataclasses.replace(svc, cluster_ip=VIP, internal_traffic_policy=itp)
    sl = endpoint_slice(svc, [endpoint(BACKEND[0], ep_node)])
    return snapshot([svc] if present else [], [sl] if present else [], generation=generation)


async def connect(port: int, timeout: float = 1.0) -> bytes:
    reader, writer = await asyncio.wait_for(asyncio.open_connection(VIP, port), timeout)
    try:
        writer.write(b"ping")
        await writer.drain()
        return await asyncio.wait_for(reader.read(100), timeout)
    finally:
        writer.close()


async def scenario() -> None:
    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"pong:" + await reader.read(100))
        await writer.drain()
        writer.close()

    backend = await asyncio.start_server(echo, *BACKEND)
    # A node process on 0.0.0.0 at the service port and at an undeclared one:
    # neither may see a connection to the VIP.
    async def squat(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"squatter")
        writer.close()

    squatters = [await asyncio.start_server(squat, "0.0.0.0", p) for p in (80, 81)]
    health = ProxyHealth()
    dp = Dataplane(loop=asyncio.get_running_loop(), local_vips=LocalVIPs(base=f"@{prefix()}vip"),
                   health=health)
    px = Proxier(SyncConfig(NODE, vips=True), dataplane=dp)
    # /healthz is bad until the first VIPs are in force: a probe that trusts it may dial them.
    assert Dataplane.VIP_FAULT in health.faults
    try:
        px.sync(state())
        await dp.vips_synced()
        assert health.faults == {}
        assert len(kpx_routes()) == 1 and VIP in kpx_routes()[0]
        assert f"{VIP} . 80" in served_pairs()
        vip_listener = [(a, p) for a, p, st in dp.listeners() if st == "serving"]
        assert len(vip_listener) == 1 and vip_listener[0][0] == LISTEN_ADDRESS, dp.listeners()
        assert await connect(80) == b"pong:ping"
        with pytest.raises(ConnectionRefusedError):  # a port nobody declares
            await connect(81)
        # Dialling the VIP listener itself reaches no service: reset, not served.
        with pytest.raises((ConnectionResetError, asyncio.IncompleteReadError)):
            reader, writer = await asyncio.open_connection(*vip_listener[0])
            try:
                await asyncio.wait_for(reader.readexactly(1), 1.0)
            finally:
                writer.close()
        # Steering needs no connection tracking: none was switched on here.
        assert conntrack_count() in (None, 0)

        px.sync(state(itp="Local", ep_node="node-b", generation=2))
        await dp.vips_synced()
        with pytest.raises(TimeoutError):  # dropped: no SYN-ACK, and no RST either
            await connect(80, timeout=0.5)

        px.sync(state(itp="Local", generation=3))  # the endpoint is here again
        await dp.vips_synced()
        assert await connect(80) == b"pong:ping"

        px.sync(state(present=False, generation=4))
        await dp.vips_synced()
        assert kpx_routes() == []
        assert VIP not in served_pairs()
        with pytest.raises(OSError):
            await connect(80)
        px.sync(state(generation=5))
        await dp.vips_synced()
        assert await connect(80) == b"pong:ping"
    finally:
        dp.close()
        backend.close()
        for s in squatters:
            s.close()
    assert kpx_routes() == []
    assert not table_present()


async def order_scenario() -> None:
    dp = Dataplane(loop=asyncio.get_running_loop(), local_vips=LocalVIPs(base=f"@{prefix()}vip"))
    px = Proxier(SyncConfig(NODE, vips=True), dataplane=dp)
    assert dp.local_vips is not None and dp._sk is not None
    sk, real = dp._sk, dp.local_vips.sync_async
    steered_during: list[set[tuple[str, int]]] = []

    async def spy(target):  # type: ignore[no-untyped-def]
        steered_during.append(set(sk.served))
        await real(target)

    dp.local_vips.sync_async = spy  # type: ignore[method-assign]
    try:
        px.sync(state())
        await dp.vips_synced()
        px.sync(state(present=False, generation=2))
        await dp.vips_synced()
    finally:
        dp.close()
    assert steered_during == [{(VIP, 80)}, {(VIP, 80)}]
    assert sk.served == set()


def test_steering_covers_every_local_route_while_routes_change() -> None:
    """A VIP's port is steered before its route appears and until after it is gone.

    In between, a SYN to a local VIP without steering would meet no socket
    and be reset: a service deleted (or an LB switched to ipMode: Proxy)
    would refuse connections instead of letting them leave for the LB.
    """
    in_fresh_netns("vipord", run_on, "uvloop", order_scenario, 30.0)


@pytest.mark.parametrize("loop_kind", ["uvloop", "asyncio"])
def test_a_clusterip_is_served_dropped_and_removed(loop_kind: str) -> None:
    in_fresh_netns("vipdp", run_on, loop_kind, scenario, 30.0)


async def successor_scenario() -> None:
    """A successor adopts the VIP listener passed on to it: same port, nothing refused."""
    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"pong:" + await reader.read(100))
        await writer.drain()
        writer.close()

    backend = await asyncio.start_server(echo, *BACKEND)
    loop = asyncio.get_running_loop()
    base = f"@{prefix()}vip"
    old = Dataplane(loop=loop, local_vips=LocalVIPs(base=base))
    new: Dataplane | None = None
    try:
        Proxier(SyncConfig(NODE, vips=True), dataplane=old).sync(state())
        await old.vips_synced()
        (port,) = [p for a, p, _ in old.listeners() if a == LISTEN_ADDRESS]
        # What a handover passes: copies of the old one's listening sockets.
        passed = {key: sock.dup() for key, sock in old.listening_sockets()}
        new = Dataplane(loop=loop, local_vips=LocalVIPs(base=base), inherited=passed)
        Proxier(SyncConfig(NODE, vips=True), dataplane=new).sync(state())
        await new.vips_synced()
        await old.stop_accepting()
        assert [p for a, p, _ in new.listeners() if a == LISTEN_ADDRESS] == [port]
        assert await connect(80) == b"pong:ping"
    finally:
        old.close()
        if new is not None:
            new.close()
        backend.close()
    assert kpx_routes() == [] and not table_present()


def test_a_successor_takes_the_vip_listener_over() -> None:
    in_fresh_netns("vipho", run_on, "uvloop", successor_scenario, 30.0)
