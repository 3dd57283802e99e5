"""The relay at its edges: an RST on a quiet side, keepalives, fds running out, the gauges.

A kernel DNAT passes an RST on whatever the other side is doing, keeps a connection
that only keepalive probes cross (conntrack counts every packet), and a proxy that runs
out of fds must not blame a healthy endpoint nor reset the clients still queued. Each
test drives a real ``Forwarder`` on the running loop over loopback: a stand-in NodePort
socket accepted by the test and handed to ``on_accept``, one endpoint; each test runs
against both relays (``relay_kind``), so they look at a relay only as the dataplane does
(``active``, ``linked()``, ``max_buffered()``).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import socket
import struct
import subprocess
import sys
from collections.abc import AsyncIterator
from typing import Any

import pytest

from proxy import metrics
from proxy.k8s import parse_state
from proxy.proxier import Proxier
from proxy.userspace.dataplane import Dataplane
from proxy.userspace.forwarder import Forwarder
from tests.support.backends import start
from tests.support.loops import NODE, free_port, one_port_forwarder
from tests.support.netns import REPO
from tests.support.objects import endpoint_slice, node, service, state_yaml
from tests.support.wiring import sync_config

NODE_PORT = 30080
ENDPOINT = "127.0.0.9"
LINGER_RST = struct.pack("ii", 1, 0)

pytestmark = pytest.mark.usefixtures("relay_kind")


class Rig:
    """A Forwarder, a stand-in NodePort and one endpoint's listening socket."""

    def __init__(self, fwd: Forwarder, backend: socket.socket) -> None:
        self.loop = asyncio.get_running_loop()
        self.fwd = fwd
        self.backend = backend
        self.nodeport = socket.create_server(("127.0.0.1", 0))
        self.socks = [self.nodeport]

    async def link(self) -> tuple[socket.socket, socket.socket]:
        """A client relayed to the endpoint (the rig's only connection): (client, the
        endpoint's side)."""
        c = socket.create_connection(self.nodeport.getsockname(), timeout=5)
        c.setblocking(False)
        self.socks.append(c)
        sock, addr = self.nodeport.accept()
        self.fwd.on_accept(sock, addr, NODE_PORT)
        async with asyncio.timeout(5):
            s, _ = await self.loop.sock_accept(self.backend)
            s.setblocking(False)
            self.socks.append(s)
            while self.fwd.linked() != 1:
                await asyncio.sleep(0.005)
        return c, s

    def abort(self, s: socket.socket) -> None:
        """Close ``s`` with an RST, as a killed process's socket."""
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, LINGER_RST)
        s.close()
        self.socks.remove(s)

    def live(self) -> bool:
        return len(self.fwd.active) == 1

    async def gone(self, timeout: float = 5.0) -> None:
        async with asyncio.timeout(timeout):
            while self.live():
                await asyncio.sleep(0.01)


@contextlib.asynccontextmanager
async def rig(**forwarder: Any) -> AsyncIterator[Rig]:
    backend = socket.socket()
    backend.bind((ENDPOINT, 0))
    backend.listen(64)
    backend.setblocking(False)
    fwd = one_port_forwarder(NODE_PORT, backend.getsockname()[1], ENDPOINT, **forwarder)
    r = Rig(fwd, backend)
    try:
        yield r
    finally:
        fwd.close()
        for s in r.socks:
            s.close()
        backend.close()


def reset_seen(s: socket.socket) -> bool:
    """Whether ``s`` was reset (an RST in CLOSE_WAIT shows as EPIPE)."""
    return s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) in (errno.ECONNRESET, errno.EPIPE)


@pytest.mark.parametrize("who", ["client", "endpoint"])
async def test_an_rst_after_a_half_close_is_passed_on(who: str) -> None:
    """The side that sent its FIN leaves nothing to read: it stays watched for errors, so
    its RST (its process killed) resets the other side at once, not after close-wait."""
    async with rig(tcp_timeout_established=0, tcp_timeout_close_wait=0) as r:
        c, s = await r.link()
        first, other = (c, s) if who == "client" else (s, c)
        first.shutdown(socket.SHUT_WR)
        async with asyncio.timeout(5):
            assert await r.loop.sock_recv(other, 100) == b""  # the FIN passed on
        r.abort(first)
        await r.gone()
        assert reset_seen(other)


async def test_an_rst_from_a_paused_client_reaches_a_stuck_endpoint() -> None:
    """The client's data waits for an endpoint that does not read (the client is paused,
    out of the set for reads); the client aborts: the endpoint is reset at once. Idle
    expiry would never end it: data is still queued for the endpoint."""
    async with rig(tcp_timeout_established=0, tcp_timeout_close_wait=0) as r:
        c, s = await r.link()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        blob = b"x" * 65536
        for _ in range(400):  # until the client can send no more
            try:
                c.send(blob)
            except BlockingIOError:
                if r.fwd.max_buffered():
                    break
            await asyncio.sleep(0.01)
        assert r.fwd.max_buffered(), "not paused"
        r.abort(c)
        await r.gone()
        assert reset_seen(s)


async def test_keepalive_probes_keep_an_idle_connection_established() -> None:
    """conntrack refreshes an entry on every packet, keepalive probes included: a
    connection they cross is not idle, though no byte of data moves."""
    async with rig(tcp_timeout_established=3.0, tcp_timeout_close_wait=0) as r:
        c, s = await r.link()
        c.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, 1)
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 1)
        await r.loop.sock_sendall(c, b"hello")
        async with asyncio.timeout(5):
            assert await r.loop.sock_recv(s, 100) == b"hello"
        # Past the timeout and two sweep intervals (0.75 s each) after the last byte, by
        # a margin: it was reset after at most 4.5 s. A probe each second meanwhile.
        await asyncio.sleep(5.5)
        assert r.live()
        c.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 0)  # truly idle from now
        await r.gone()


async def test_a_live_connections_bytes_are_counted_as_it_goes() -> None:
    """``kubeproxy_kpx_bytes_total`` moves with a long connection, sweep by sweep, not in
    one step when it ends."""
    def counted() -> float:
        return metrics.REGISTRY.get_sample_value(
            "kubeproxy_kpx_bytes_total",
            {"service_port": "default/web", "direction": "to_endpoint"}) or 0.0

    before = counted()
    async with rig(tcp_timeout_established=1.0, tcp_timeout_close_wait=0) as r:
        c, s = await r.link()
        payload = b"x" * (1 << 20)
        async with asyncio.timeout(10):
            send = r.loop.create_task(r.loop.sock_sendall(c, payload))
            got = 0
            while got < len(payload):
                got += len(await r.loop.sock_recv(s, 1 << 16))
            await send
        async with asyncio.timeout(5):  # a sweep (every 0.25 s) and a flush (1 s)
            while counted() - before < len(payload):
                await r.loop.sock_sendall(c, b"k")  # busy, never idle
                await r.loop.sock_recv(s, 10)
                await asyncio.sleep(0.1)
        assert r.live()


async def test_the_active_gauge_of_a_dual_stack_service_counts_both_families() -> None:
    """One gauge child per service port, one PortMetrics per family's dataplane: the
    gauge is their sum, not the count of whichever family made its child last."""
    be4, be6 = start("127.0.0.1", 0, "b4"), start("::1", 0, "b6")
    np_ = free_port()
    state = state_yaml(
        node(NODE, "127.0.0.2", "::1"),
        service("web", np_, be4.port, clusterIPs=["10.96.0.10", "fd00:96::10"],
                ipFamilies=["IPv4", "IPv6"], ipFamilyPolicy="RequireDualStack"),
        endpoint_slice("web", ("127.0.0.1", NODE), port=be4.port, name="web-v4"),
        endpoint_slice("web", ("::1", NODE), port=be6.port, name="web-v6",
                       address_type="IPv6"))
    loop = asyncio.get_running_loop()
    dp4 = Dataplane(loop=loop, transparent=False)
    dp6 = Dataplane(loop=loop, transparent=False, family=6)
    px = Proxier(sync_config(NODE, ["127.0.0.2/32", "::1/128"]), dataplane=dp4, dataplane6=dp6)
    held: list[socket.socket] = []

    def connect() -> None:
        for addr in ("127.0.0.2", "127.0.0.2", "127.0.0.2", "::1"):
            s = socket.create_connection((addr, np_), timeout=3)
            held.append(s)
            s.sendall(b"PEER\n")
            s.recv(100)

    try:
        px.sync(parse_state(state, 1))
        async with asyncio.timeout(5):
            await dp4.synced.wait()
            await dp6.synced.wait()
        await asyncio.to_thread(connect)
        assert (dp4.active_connections(), dp6.active_connections()) == (3, 1)
        assert metrics.REGISTRY.get_sample_value(
            "kubeproxy_kpx_active_connections", {"service_port": "default/web"}) == 4
    finally:
        for s in held:
            s.close()
        dp4.close()
        dp6.close()
        be4.stop()
        be6.stop()


STARVED = """
import asyncio, os, resource, socket, sys
from proxy import metrics
from proxy.proxier import Proxier
from proxy.userspace.dataplane import Dataplane
from tests.support.backends import start
from tests.support.loops import NODE_IP, free_port, snap, web
from tests.support.wiring import sync_config

CLIENTS = '''
import socket, sys, time
time.sleep(1.0)  # until the proxy is out of fds
out = []
for _ in range(5):
    try:
        s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=3)
        s.settimeout(1.5)
        s.sendall(b"PEER\\\\n")
        out.append("data" if s.recv(100) else "eof")
        s.close()
    except (ConnectionResetError, BrokenPipeError):
        out.append("reset")
    except TimeoutError:
        out.append("waiting")
print(",".join(out))
'''

async def main():
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    be = start("127.0.0.1", 0, "b")
    np_ = free_port()
    dp = Dataplane(loop=asyncio.get_running_loop(), transparent=False)
    Proxier(sync_config("n1"), dataplane=dp).sync(snap(*web(np_, be.port, "127.0.0.1")))
    await asyncio.wait_for(dp.synced.wait(), 5)
    first = socket.create_connection((NODE_IP, np_), timeout=3)  # the relay's epoll set
    first.sendall(b"PEER\\n")
    await asyncio.to_thread(first.recv, 100)
    clients = await asyncio.create_subprocess_exec(
        sys.executable, "-c", CLIENTS, NODE_IP, str(np_), stdout=asyncio.subprocess.PIPE)
    hog = []
    try:  # every fd but one: the next accept takes it, its upstream socket gets none
        while True:
            hog.append(os.open("/dev/null", os.O_RDONLY))
    except OSError:
        os.close(hog.pop())
    await asyncio.sleep(4.0)  # out of fds while the clients try
    for fd in hog:
        os.close(fd)
    out, _ = await clients.communicate()
    dp.forwarder.flush_metrics()
    fails = metrics.REGISTRY.get_sample_value(
        "kubeproxy_kpx_upstream_connect_failures_total", {"service_port": "default/web"})
    print(out.decode().strip(), fails or 0.0)
    first.close()
    dp.close()
    be.stop()

asyncio.run(main())
"""


def test_no_fd_for_an_upstream_socket_blames_no_endpoint_and_pauses_accepting() -> None:
    """The accept took the last fd, so the upstream socket gets none: that is kpx's
    shortage, not the endpoint's. One client is reset; the rest wait in the accept queue
    (as after an accept's own EMFILE) and are served once fds are back."""
    res = subprocess.run([sys.executable, "-c", STARVED], cwd=REPO, capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    outcomes, fails = res.stdout.split()
    assert float(fails) == 0, res.stdout
    assert outcomes.split(",").count("reset") <= 1, res.stdout
    assert outcomes.split(",")[-1] == "data", res.stdout
