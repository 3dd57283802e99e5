"""The dataplane in real network namespaces: DROP, REJECT, client IP, routing.

Topology (tests.support.netns.Topology): client -- node -- {pod1, pod2}. The
Dataplane runs in the node namespace (tests.support.driver, ``--transparent``), so the transparent
return path is installed there and only there. pod1 is this node's endpoint
(``nodeName: n1``); pod2 plays an endpoint on another node (``n2``), so
reaching it must SNAT. Every namespace is removed at module teardown.
"""

from __future__ import annotations

import shutil
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from lab.common import wait_until
from tests.support.driver import Driver
from tests.support.netns import Topology, connect_in, sh, topology
from tests.support.objects import endpoint_slice, node, service
from tests.support.probes import ss_drops, ss_listening, syn_probe

pytestmark = pytest.mark.lab

NODE = "n1"
T = Topology
BACKEND_PORT = 8080


@pytest.fixture(scope="module")
def topo() -> Iterator[Topology]:
    if shutil.which("ip") is None or shutil.which("nft") is None:
        pytest.skip("needs iproute2 and nftables")
    try:
        with topology() as t:
            t.backend(t.pod1, "pod1", BACKEND_PORT)
            t.backend(t.pod2, "pod2", BACKEND_PORT)
            yield t
    except PermissionError:
        pytest.skip("needs root (network namespaces)")


@pytest.fixture
def driver(topo: Topology, tmp_path: Path) -> Iterator[Driver]:
    drv = Driver(tmp_path, NODE, "--transparent", "--connect-timeout", "0.5",
                 netns=topo.node)
    try:
        yield drv
    finally:
        drv.stop()


def svc(name: str, node_port: int, etp: str = "Cluster", *, remote: bool = False) -> list[dict]:
    """Service ``name`` with one endpoint: pod1 on this node, or (``remote``) pod2 on n2."""
    pod = (T.POD2_IP, "n2") if remote else (T.POD1_IP, NODE)
    return [service(name, node_port, BACKEND_PORT, etp=etp),
            endpoint_slice(name, pod, port=BACKEND_PORT)]


def peer(ns: str, addr: tuple[str, int], timeout: float = 3.0) -> tuple[str, str]:
    """(pod name, the peer IP the pod saw) through ``addr``."""
    with connect_in(ns, addr, timeout) as s:
        s.sendall(b"PEER\n")
        name, seen = s.recv(200).decode().split()
        return name, seen.rsplit(":", 1)[0]


def routing_state(ns: str) -> dict[str, bool]:
    return {
        "nft": sh("ip", "netns", "exec", ns, "nft", "list", "table", "inet", "kpx_tproxy",
                  check=False).returncode == 0,
        "rule": "fwmark 0x2000/0x2000 lookup 7078" in sh("ip", "-n", ns, "rule").stdout,
        "route": "local" in sh("ip", "-n", ns, "route", "show", "table", "7078").stdout,
    }


def test_drop_reject_serve_on_the_wire(topo: Topology, driver: Driver) -> None:
    drop, reject, serve = 30080, 30081, 30082
    driver.start(
        node(NODE, T.NODE_IP),
        *svc("drop", drop, etp="Local", remote=True),  # eTP=Local, nothing here: DROP
        service("none", reject, BACKEND_PORT),  # no endpoints at all: REJECT
        *svc("serve", serve, etp="Local"),
    )
    # One wildcard socket per NodePort; the dropping one carries the filter.
    assert set(driver.listeners()) == {("0.0.0.0", drop, "dropping"), ("0.0.0.0", serve, "serving")}
    assert ss_listening(reject, topo.node) == []  # REJECT: no LISTEN socket at all

    # On the wire, from outside: no answer at all / RST at once / SYN-ACK.
    assert syn_probe(topo.client, (T.NODE_IP, drop), (T.NODE_IP, reject),
                     (T.NODE_IP, serve)) == ["none", "rst", "synack"]
    assert ss_drops(drop, topo.node) >= 1
    with pytest.raises(TimeoutError):
        connect_in(topo.client, (T.NODE_IP, drop), timeout=1.2)
    t0 = time.monotonic()
    with pytest.raises(ConnectionRefusedError):
        connect_in(topo.client, (T.NODE_IP, reject))
    assert time.monotonic() - t0 < 0.5

    # The node's own address passes the filter and gets Cluster endpoints, SNATed.
    assert peer(topo.node, (T.NODE_IP, drop)) == ("pod2", T.NODE_POD2_IP)
    assert peer(topo.node, ("127.0.0.1", drop)) == ("pod2", T.NODE_POD2_IP)
    # External client to the local endpoint: its own IP is preserved.
    assert peer(topo.client, (T.NODE_IP, serve)) == ("pod1", T.CLIENT_IP)

    # A local endpoint appears: the filter comes off, no listener restart.
    driver.update(node(NODE, T.NODE_IP), *svc("drop", drop, etp="Local"))
    assert ("0.0.0.0", drop, "serving") in driver.listeners()
    assert peer(topo.client, (T.NODE_IP, drop)) == ("pod1", T.CLIENT_IP)
    assert ss_listening(serve, topo.node) == []  # "serve" left the state


def test_client_ip_kept_for_local_endpoints_snat_for_remote(topo: Topology,
                                                            driver: Driver) -> None:
    local, remote = 30090, 30091
    driver.start(node(NODE, T.NODE_IP), *svc("a", local), *svc("b", remote, remote=True))
    assert driver.status()["transparent"] is True
    assert routing_state(topo.node) == {"nft": True, "rule": True, "route": True}
    assert peer(topo.client, (T.NODE_IP, local)) == ("pod1", T.CLIENT_IP)
    assert peer(topo.client, (T.NODE_IP, remote)) == ("pod2", T.NODE_POD2_IP)
    # Node-originated traffic always SNATs, even to a local endpoint.
    assert peer(topo.node, (T.NODE_IP, local)) == ("pod1", "10.77.2.1")

    assert driver.stop() == 0
    assert routing_state(topo.node) == {"nft": False, "rule": False, "route": False}


def test_leftover_routing_is_replaced_then_removed(topo: Topology, tmp_path: Path) -> None:
    np_ = 30095
    state = (node(NODE, T.NODE_IP), *svc("a", np_))
    first = Driver(tmp_path / "1", NODE, "--transparent", netns=topo.node)
    (tmp_path / "1").mkdir()
    try:
        first.start(*state)
    finally:
        first.stop(signal.SIGKILL)  # a crash: nothing cleaned up
    assert routing_state(topo.node) == {"nft": True, "rule": True, "route": True}

    second = Driver(tmp_path / "2", NODE, "--transparent", netns=topo.node)
    (tmp_path / "2").mkdir()
    try:
        second.start(*state)
        assert second.status()["transparent"] is True
        rules = [ln for ln in sh("ip", "-n", topo.node, "rule").stdout.splitlines()
                 if "0x2000/0x2000" in ln]
        assert len(rules) == 1, rules
        assert peer(topo.client, (T.NODE_IP, np_)) == ("pod1", T.CLIENT_IP)
    finally:
        assert second.stop() == 0
    assert routing_state(topo.node) == {"nft": False, "rule": False, "route": False}


def test_no_nft_means_one_warning_and_snat(topo: Topology, tmp_path: Path) -> None:
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "ip").symlink_to(shutil.which("ip"))  # ip but no nft
    np_ = 30096
    drv = Driver(tmp_path, NODE, "--transparent", netns=topo.node, env={"PATH": str(bindir)})
    try:
        drv.start(node(NODE, T.NODE_IP), *svc("a", np_))
        assert drv.status()["transparent"] is False
        assert peer(topo.client, (T.NODE_IP, np_)) == ("pod1", "10.77.2.1")
    finally:
        assert drv.stop() == 0
    warnings = [ln for ln in drv.logs().splitlines() if " WARNING " in ln]
    assert len(warnings) == 1 and "SNAT" in warnings[0] and "nft" in warnings[0], warnings
    assert routing_state(topo.node) == {"nft": False, "rule": False, "route": False}


def test_unassigned_node_ip_is_retried_until_it_appears(topo: Topology, tmp_path: Path) -> None:
    """Per-address listeners (--nodeport-addresses) retry an address not yet assigned."""
    np_ = 30097
    late = "10.77.1.50"
    drv = Driver(tmp_path, NODE, "--transparent", "--nodeport-cidrs", "10.77.1.0/24",
                 netns=topo.node)
    try:
        drv.start(node(NODE, T.NODE_IP, late), *svc("a", np_))
        assert (late, np_, "error: Cannot assign requested address") in drv.listeners()
        assert (T.NODE_IP, np_, "serving") in drv.listeners()
        sh("ip", "-n", topo.node, "addr", "add", f"{late}/24", "dev", "c0")
        try:
            wait_until(lambda: (late, np_, "serving") in drv.listeners(), 3, 0.02,
                       what="the late address to be served")
            assert peer(topo.client, (late, np_)) == ("pod1", T.CLIENT_IP)
        finally:
            sh("ip", "-n", topo.node, "addr", "del", f"{late}/24", "dev", "c0", check=False)
    finally:
        drv.stop()


def test_wildcard_listener_serves_an_address_added_later(topo: Topology,
                                                         driver: Driver) -> None:
    """Without --nodeport-addresses every local address serves, even a new one."""
    np_ = 30104
    late = "10.77.1.51"
    driver.start(node(NODE, T.NODE_IP), *svc("a", np_))
    assert driver.listeners() == [("0.0.0.0", np_, "serving")]
    sh("ip", "-n", topo.node, "addr", "add", f"{late}/24", "dev", "c0")
    try:
        assert peer(topo.client, (late, np_)) == ("pod1", T.CLIENT_IP)
        assert peer(topo.client, (T.NODE_IP, np_)) == ("pod1", T.CLIENT_IP)
    finally:
        sh("ip", "-n", topo.node, "addr", "del", f"{late}/24", "dev", "c0", check=False)


def test_connect_timeout_tries_the_next_endpoint(topo: Topology, driver: Driver) -> None:
    np_ = 30098
    blackhole = "10.77.2.99"  # no such host: ARP never answers, connect hangs
    driver.start(
        node(NODE, T.NODE_IP),
        service("a", np_, BACKEND_PORT),
        endpoint_slice("a", (T.POD1_IP, NODE), (blackhole, NODE), port=BACKEND_PORT),
    )
    for _ in range(3):  # round-robin reaches the black hole at least once
        assert peer(topo.client, (T.NODE_IP, np_), timeout=4) == ("pod1", T.CLIENT_IP)
    logs = driver.logs()
    assert f"connect to endpoint {blackhole}:{BACKEND_PORT} for client {T.CLIENT_IP}:" in logs
    assert "timed out" in logs


def test_killed_backend_resets_the_client(topo: Topology, driver: Driver) -> None:
    np_ = 30099
    victim = topo.backend(topo.pod1, "victim", 8081)
    driver.start(
        node(NODE, T.NODE_IP),
        service("v", np_, 8081),
        endpoint_slice("v", (T.POD1_IP, NODE), port=8081),
    )
    with connect_in(topo.client, (T.NODE_IP, np_), timeout=3) as s:
        s.sendall(b"ECHO\nhello")
        assert s.recv(5) == b"hello"
        victim.send_signal(signal.SIGKILL)
        victim.wait(5)
        # The dead backend's kernel sent a FIN (nothing was unread); what the
        # client sends next draws an RST from it, and that RST must reach the
        # client as a reset, not as a quiet EOF.
        outcome = None
        s.settimeout(0.3)
        deadline = time.monotonic() + 3
        while outcome is None and time.monotonic() < deadline:
            try:
                s.sendall(b"more")
                s.recv(100)
            except (ConnectionResetError, BrokenPipeError) as exc:
                outcome = type(exc).__name__
            except TimeoutError:
                pass
        # BrokenPipe only follows an RST already received: both mean reset.
        assert outcome in ("ConnectionResetError", "BrokenPipeError")


def test_sigterm_drains_then_exits_cleanly(topo: Topology, driver: Driver) -> None:
    np_ = 30100
    driver.start(node(NODE, T.NODE_IP), *svc("a", np_))
    with connect_in(topo.client, (T.NODE_IP, np_), timeout=5) as s:
        s.sendall(b"DRIP 10\n")
        assert s.recv(100).startswith(b"drip 0")
        assert driver.proc is not None
        driver.proc.send_signal(signal.SIGTERM)
        wait_until(lambda: ss_listening(np_, topo.node) == [], 3, 0.02, what="listeners closed")
        with pytest.raises(ConnectionRefusedError):
            connect_in(topo.client, (T.NODE_IP, np_))
        rest = b""
        while data := s.recv(4096):
            rest += data
        assert rest.count(b"drip") == 9  # the live connection finished intact
    assert driver.proc.wait(5) == 0
    assert driver.status().get("drain_reset") == 0
    assert routing_state(topo.node) == {"nft": False, "rule": False, "route": False}


def test_backend_sees_no_node_ip_leak_for_many_connections(topo: Topology,
                                                           driver: Driver) -> None:
    """IP_BIND_ADDRESS_NO_PORT: many transparent connections from one client IP."""
    np_ = 30101
    driver.start(node(NODE, T.NODE_IP), *svc("a", np_))
    seen = set()
    for _ in range(50):
        with connect_in(topo.client, (T.NODE_IP, np_)) as s:
            s.sendall(b"PEER\n")
            seen.add(s.recv(200).decode().split()[1].rsplit(":", 1)[0])
    assert seen == {T.CLIENT_IP}
    assert wait_until(lambda: driver.status().get("active") == 0, 3, 0.02,
                      what="relays to finish")


def test_socket_filter_is_per_listener(topo: Topology, driver: Driver) -> None:
    """A dropping NodePort must not affect a serving one on the same address."""
    a, b = 30102, 30103
    driver.start(node(NODE, T.NODE_IP), *svc("a", a, etp="Local", remote=True), *svc("b", b))
    with pytest.raises(TimeoutError):
        connect_in(topo.client, (T.NODE_IP, a), timeout=1.0)
    assert peer(topo.client, (T.NODE_IP, b)) == ("pod1", T.CLIENT_IP)
