"""The IPv6 family's userspace dataplane on the wire: every NodePort verdict over IPv6.

Topology (tests.support.netns.Topology, with ULA IPv6 addresses added here
beside the IPv4 ones): client -- node -- {pod1, pod2}. The driver runs an
IPv4 and an IPv6 Dataplane in the node namespace (``--ipv6``), as ``kpx
node`` does on a dual-stack node. pod1 is this node's endpoint, pod2 plays
one on another node, so reaching it must SNAT. A DROP is a connect that
times out while the listener's drop counter rises (the SYN filter of an
IPv6 socket); REJECT an RST at once; the client's IPv6 address kept is the
peer the pod saw. Every namespace is removed at module teardown.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.driver import Driver
from tests.support.netns import PY, Topology, connect_in, in_netns, sh, topology
from tests.support.objects import endpoint_slice, node, service
from tests.support.probes import ss_drops, ss_listening

pytestmark = pytest.mark.lab

NODE = "n1"
T = Topology
BACKEND_PORT = 8080
CLIENT6 = "fd77:1::2"
NODE6 = "fd77:1::1"
POD1_6 = "fd77:2::2"
POD2_6 = "fd77:3::2"
NODE_POD1_6 = "fd77:2::1"
NODE_POD2_6 = "fd77:3::1"
DEAD6 = "fd77:2::99"
"""On pod1's link, owned by nobody: a connect there times out (neighbour unreachable)."""


def _add6(t: Topology) -> None:
    """The IPv6 half of the topology: ULA addresses (``nodad``: usable at once), routes."""
    for ns, dev, addr in ((t.node, "c0", f"{NODE6}/64"), (t.client, "eth0", f"{CLIENT6}/64"),
                          (t.node, "p1", f"{NODE_POD1_6}/64"), (t.pod1, "eth0", f"{POD1_6}/64"),
                          (t.node, "p2", f"{NODE_POD2_6}/64"), (t.pod2, "eth0", f"{POD2_6}/64")):
        sh("ip", "-n", ns, "-6", "addr", "add", addr, "dev", dev, "nodad")
    sh("ip", "-n", t.client, "-6", "route", "add", "default", "via", NODE6)
    sh("ip", "-n", t.pod1, "-6", "route", "add", "default", "via", NODE_POD1_6)
    sh("ip", "-n", t.pod2, "-6", "route", "add", "default", "via", NODE_POD2_6)
    sh("ip", "netns", "exec", t.node, "sysctl", "-qw", "net.ipv6.conf.all.forwarding=1")
    # The veths' link-local addresses came up with duplicate address detection, which
    # keeps them "tentative" for about a second: neighbour discovery waits on them, so
    # a first connection in a fresh topology (a test alone, or first on its xdist
    # worker) was reset by the relay's connect timeout. Wait until none is left.
    deadline = time.monotonic() + 10.0
    for ns in (t.node, t.client, t.pod1, t.pod2):
        while sh("ip", "-n", ns, "-6", "-o", "addr", "show", "tentative").stdout.strip():
            assert time.monotonic() < deadline, f"{ns}: IPv6 addresses still tentative"
            time.sleep(0.05)


def _backend6(t: Topology, ns: str, name: str) -> None:
    p = t.popen(ns, PY, "-m", "tests.support.backends", "--addr", "::", "--port",
                str(BACKEND_PORT), "--name", name, stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL)
    assert p.stdout is not None
    assert p.stdout.readline().strip() == "READY"


@pytest.fixture(scope="module")
def topo() -> Iterator[Topology]:
    if shutil.which("ip") is None or shutil.which("nft") is None:
        pytest.skip("needs iproute2 and nftables")
    if not socket.has_ipv6:
        pytest.skip("needs IPv6")
    try:
        with topology() as t:
            _add6(t)
            _backend6(t, t.pod1, "pod1")
            _backend6(t, t.pod2, "pod2")
            yield t
    except PermissionError:
        pytest.skip("needs root (network namespaces)")


@pytest.fixture
def driver(topo: Topology, tmp_path: Path) -> Iterator[Driver]:
    drv = Driver(tmp_path, NODE, "--transparent", "--ipv6", "--connect-timeout", "0.5",
                 netns=topo.node)
    try:
        yield drv
    finally:
        drv.stop()


def listeners6(drv: Driver) -> set[tuple[str, int, str]]:
    return {tuple(x) for x in drv.status().get("listeners6", [])}  # type: ignore[misc]


def n1() -> dict[str, Any]:
    """This node, with an IPv4 and an IPv6 InternalIP (a dual-stack Node)."""
    return node(NODE, T.NODE_IP, NODE6)


def svc6(name: str, node_port: int, *pods: tuple[str, str], etp: str = "Cluster",
         **kw: Any) -> list[dict[str, Any]]:
    """A single-stack IPv6 NodePort service with endpoints ``(ip, node)``, in an IPv6 slice."""
    return [service(name, node_port, BACKEND_PORT, etp=etp, cluster_ip=f"fd00:96::{node_port:x}",
                    clusterIPs=[f"fd00:96::{node_port:x}"], ipFamilies=["IPv6"],
                    ipFamilyPolicy="SingleStack", **kw),
            endpoint_slice(name, *pods, port=BACKEND_PORT, address_type="IPv6")]


LOCAL = (POD1_6, NODE)
REMOTE = (POD2_6, "n2")


def connect6(ns: str, addr: tuple[str, int], timeout: float = 2.0) -> socket.socket:
    """An IPv6 TCP connection from namespace ``ns``."""
    return connect_in(ns, addr, timeout)


def peer(ns: str, addr: tuple[str, int], timeout: float = 3.0) -> tuple[str, str]:
    """(pod name, the peer IP the pod saw) through ``addr``."""
    with connect6(ns, addr, timeout) as s:
        s.sendall(b"PEER\n")
        name, seen = s.recv(200).decode().split()
        return name, seen.rsplit(":", 1)[0]


def turned_away(ns: str, addr: tuple[str, int]) -> bool:
    """True if ``addr`` answers with an RST and never a byte of a backend.

    The wildcard socket's handshake completes in the kernel before kpx sees
    the connection, so the RST comes at accept: connect may succeed, the
    first read then fails.
    """
    try:
        s = connect6(ns, addr)
    except (ConnectionRefusedError, ConnectionResetError):
        return True
    with s:
        try:
            s.sendall(b"PEER\n")
            s.recv(200)  # a reply, or an EOF: served (or closed), not turned away
        except ConnectionResetError:
            return True
        return False


@pytest.mark.usefixtures("relay_kind")  # both relays: conftest.py
def test_drop_reject_serve_and_client_ip_over_ipv6(topo: Topology, driver: Driver) -> None:
    drop, reject, serve = 30180, 30181, 30182
    driver.start(
        n1(),
        *svc6("drop", drop, REMOTE, etp="Local"),  # eTP=Local, nothing here: DROP
        *svc6("none", reject),  # no endpoints at all: REJECT
        *svc6("serve", serve, LOCAL, etp="Local"),
    )
    # One IPv6 wildcard socket per NodePort, the dropping one filtered; IPv4 serves none.
    assert listeners6(driver) == {("::", drop, "dropping"), ("::", serve, "serving")}
    assert driver.listeners() == []
    assert driver.status()["transparent6"] is True
    assert ss_listening(reject, topo.node) == []

    # From outside: silence (the SYN filter ate it), RST at once, the client's own IP kept.
    before = ss_drops(drop, topo.node)
    with pytest.raises(TimeoutError):
        connect6(topo.client, (NODE6, drop), timeout=1.2)
    assert ss_drops(drop, topo.node) > before
    t0 = time.monotonic()
    with pytest.raises(ConnectionRefusedError):
        connect6(topo.client, (NODE6, reject))
    assert time.monotonic() - t0 < 0.5
    assert peer(topo.client, (NODE6, serve)) == ("pod1", CLIENT6)

    # The node's own IPv6 address passes the filter: Cluster semantics, SNATed across nodes.
    assert peer(topo.node, (NODE6, drop)) == ("pod2", NODE_POD2_6)
    # ::1 is never served (no IPv6 localhost NodePorts): reset, on either verdict.
    for port in (drop, serve):
        assert turned_away(topo.node, ("::1", port))

    # A local endpoint appears: the filter comes off in place.
    driver.update(n1(), *svc6("drop", drop, LOCAL, etp="Local"))
    assert ("::", drop, "serving") in listeners6(driver)
    assert peer(topo.client, (NODE6, drop)) == ("pod1", CLIENT6)


def return_path6(ns: str) -> dict[str, bool]:
    return {
        "nft": sh("ip", "netns", "exec", ns, "nft", "list", "table", "inet", "kpx_tproxy",
                  check=False).returncode == 0,
        "rule": "fwmark 0x2000/0x2000 lookup 7078" in sh("ip", "-n", ns, "-6", "rule").stdout,
        "route": "local default dev lo" in sh("ip", "-n", ns, "-6", "route", "show", "table",
                                              "7078", check=False).stdout,
    }


@pytest.mark.usefixtures("relay_kind")  # both relays: conftest.py
def test_cluster_snat_retry_affinity_and_return_path(topo: Topology, driver: Driver) -> None:
    local, remote, retry, sticky = 30190, 30191, 30192, 30193
    driver.start(
        n1(),
        *svc6("local", local, LOCAL),
        *svc6("remote", remote, REMOTE),
        *svc6("retry", retry, (DEAD6, NODE), LOCAL),
        *svc6("sticky", sticky, LOCAL, REMOTE, affinity_seconds=60),
    )
    assert return_path6(topo.node) == {"nft": True, "rule": True, "route": True}
    assert peer(topo.client, (NODE6, local)) == ("pod1", CLIENT6)  # client IP kept
    assert peer(topo.client, (NODE6, remote)) == ("pod2", NODE_POD2_6)  # cross-node: SNAT
    # Node-originated traffic always SNATs, even to a local endpoint.
    assert peer(topo.node, (NODE6, local)) == ("pod1", NODE_POD1_6)
    # A dead endpoint costs a connect timeout, then the next one serves: never a failure.
    assert {peer(topo.client, (NODE6, retry))[0] for _ in range(6)} == {"pod1"}
    # ClientIP affinity: one client keeps its endpoint.
    assert len({peer(topo.client, (NODE6, sticky))[0] for _ in range(8)}) == 1

    assert driver.stop() == 0
    assert return_path6(topo.node) == {"nft": False, "rule": False, "route": False}


@pytest.mark.usefixtures("relay_kind")  # both relays: conftest.py
def test_half_close_over_ipv6(topo: Topology, driver: Driver) -> None:
    np_ = 30195
    driver.start(n1(), *svc6("echo", np_, LOCAL))
    with connect6(topo.client, (NODE6, np_)) as s:
        s.sendall(b"ECHO\nhello over six")
        s.shutdown(socket.SHUT_WR)  # our FIN: the echo half-closes back after the data
        got = b""
        while chunk := s.recv(4096):
            got += chunk
    assert got.endswith(b"hello over six")


@pytest.mark.usefixtures("relay_kind")  # both relays: conftest.py
def test_dual_stack_service_answers_each_family_with_its_own_endpoints(
    topo: Topology, driver: Driver
) -> None:
    np_ = 30196
    driver.start(
        n1(),
        service("dual", np_, BACKEND_PORT, cluster_ip="10.96.1.1",
                clusterIPs=["10.96.1.1", "fd00:96::1"], ipFamilies=["IPv4", "IPv6"],
                ipFamilyPolicy="PreferDualStack"),
        # IPv4: pod2 only; IPv6: pod1 only. Each family forwards to its own.
        endpoint_slice("dual", (T.POD2_IP, "n2"), port=BACKEND_PORT, name="dual-v4"),
        endpoint_slice("dual", LOCAL, port=BACKEND_PORT, name="dual-v6", address_type="IPv6"),
    )
    assert driver.listeners() == [("0.0.0.0", np_, "serving")]
    assert listeners6(driver) == {("::", np_, "serving")}
    assert peer(topo.client, (NODE6, np_)) == ("pod1", CLIENT6)
    with connect_in(topo.client, (T.NODE_IP, np_), 3) as s:
        s.sendall(b"PEER\n")
        assert s.recv(200).decode().split()[0] == "pod2"  # IPv4 reached its own endpoint


def _handover_in_netns() -> None:
    """In a fresh namespace: an IPv6 dataplane adopts a predecessor's ``::`` listener."""
    import asyncio

    from proxy.k8s import parse_state
    from proxy.proxier import Proxier
    from proxy.userspace import synfilter
    from proxy.userspace.dataplane import Dataplane
    from tests.support.backends import start
    from tests.support.objects import state_yaml
    from tests.support.wiring import sync_config

    addr = "fd77:9::1"
    sh("ip", "-6", "addr", "add", f"{addr}/128", "dev", "lo", "nodad")  # this thread's netns
    be = start(addr, 0, "b")
    np_ = 30197
    old = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
    old.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
    old.bind(("::", np_))
    synfilter.attach(old, synfilter.syn_drop_program((addr,), family=6))
    old.listen(16)
    early = socket.create_connection((addr, np_), timeout=3)  # queued before adoption
    state = state_yaml(node(NODE, "10.9.9.9", addr),
                       *svc6("web", np_, (addr, NODE)))
    state = state.replace(f"port: {BACKEND_PORT}", f"port: {be.port}")

    async def scenario() -> None:
        dp6 = Dataplane(loop=asyncio.get_running_loop(), family=6,
                        inherited={("::", np_): old})
        px = Proxier(sync_config(NODE), dataplane6=dp6)
        try:
            px.sync(parse_state(state, 1))
            await asyncio.wait_for(dp6.synced.wait(), 5)
            assert dp6.listeners() == [("::", np_, "serving")]
            [(key, sock)] = dp6.listening_sockets()
            assert key == ("::", np_) and sock is old  # adopted, not bound anew
            assert len(sock.getsockopt(socket.SOL_SOCKET, 26, 1024)) == 0  # filter off

            def queued_peer() -> str:
                early.sendall(b"PEER\n")
                return early.recv(100).decode().split()[0]

            assert await asyncio.to_thread(queued_peer) == "b"
        finally:
            dp6.close()
            early.close()
            be.stop()

    asyncio.run(scenario())


def test_ipv6_listeners_are_handed_over() -> None:
    from tests.support.netns import in_fresh_netns

    in_fresh_netns("h6", _handover_in_netns)


UDP_ECHO = """
import socket, sys
s = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
s.bind(("::", int(sys.argv[1])))
print("READY", flush=True)
while True:
    data, peer = s.recvfrom(2048)
    s.sendto(sys.argv[2].encode() + b" " + peer[0].encode(), peer)
"""


def udp6(ns: str, addr: tuple[str, int], timeout: float = 1.5) -> str | None:
    """One datagram to ``addr`` from ``ns``: the reply's text, or None (silence)."""
    def ask() -> str | None:
        with socket.socket(socket.AF_INET6, socket.SOCK_DGRAM) as s:
            s.settimeout(timeout)
            s.sendto(b"WHO", addr)
            try:
                return s.recv(2048).decode()
            except TimeoutError:
                return None
    return in_netns(ns, ask)


def test_udp_nodeport_over_ipv6(topo: Topology, driver: Driver) -> None:
    port = 8081
    p = topo.popen(topo.pod1, PY, "-c", UDP_ECHO, str(port), "pod1", stdout=subprocess.PIPE)
    assert p.stdout is not None and p.stdout.readline().strip() == "READY"
    np_ = 30198
    udp = [service("dns6", np_, port, protocol="UDP", cluster_ip="fd00:96::53",
                   clusterIPs=["fd00:96::53"], ipFamilies=["IPv6"], ipFamilyPolicy="SingleStack"),
           endpoint_slice("dns6", LOCAL, port=port, protocol="UDP", address_type="IPv6")]
    driver.start(n1(), *udp)
    assert udp6(topo.client, (NODE6, np_)) == f"pod1 {CLIENT6}"  # the client's IP kept
    assert udp6(topo.node, (NODE6, np_)) == f"pod1 {NODE_POD1_6}"  # the node's: SNAT
    assert udp6(topo.node, ("::1", np_)) is None  # ::1 is never served
    driver.update(n1(), udp[0])  # no endpoint left: the socket goes, the port is closed
    assert udp6(topo.client, (NODE6, np_)) is None
