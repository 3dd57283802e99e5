"""Listeners: reconcile to the plans, REJECT by absence, back-off, capacity.

In-process on loopback, except the EMFILE test, which runs the Dataplane in a
child process (tests/support/driver_process.py) whose fds are exhausted on purpose.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from pathlib import Path

import pytest

from lab.common import wait_until
from proxy.k8s import StateParser
from proxy.proxier import Proxier
from proxy.userspace.dataplane import Dataplane
from proxy.userspace.listener import Listener
from tests.support.driver import Driver
from tests.support.loops import (
    NODE,
    NODE_IP,
    free_port,
    peer_name,
    run_on,
    snap,
    syncing,
    web,
)
from tests.support.netns import cpu_seconds
from tests.support.objects import endpoint_slice, node, service, state_yaml
from tests.support.probes import ss_listening
from tests.support.wiring import sync_config

pytestmark = pytest.mark.usefixtures("relay_kind")  # both relays: conftest.py


def test_reconcile_open_move_close_leaves_no_listen_socket(loop_kind: str, backends) -> None:
    be = backends()
    a, b = free_port(), free_port()

    async def scenario() -> None:
        async with syncing(snap(*web(a, be.port))) as px:
            dp = px.dataplane
            assert isinstance(dp, Dataplane)
            # One wildcard socket serves the node IP and 127.0.0.1 alike.
            assert dp.listeners() == [("0.0.0.0", a, "serving")]
            (line,) = ss_listening(a)
            assert f"0.0.0.0:{a} " in line
            assert await asyncio.to_thread(peer_name, a) == "b"
            assert await asyncio.to_thread(peer_name, a, "127.0.0.1") == "b"

            px.sync(snap(*web(b, be.port), generation=2))  # the nodePort moved
            assert ss_listening(a) == []
            assert len(ss_listening(b)) == 1
            assert await asyncio.to_thread(peer_name, b, "127.0.0.1") == "b"

            px.sync(snap(node(NODE, NODE_IP), generation=3))  # service deleted
            assert dp.listeners() == []
            assert ss_listening(a) == [] and ss_listening(b) == []
            with pytest.raises(ConnectionRefusedError):
                await asyncio.to_thread(peer_name, b)
        assert ss_listening(b) == []

    run_on(loop_kind, scenario)


def test_no_usable_endpoint_means_no_listener_and_econnrefused(backends) -> None:
    be = backends()
    np_ = free_port()

    async def scenario() -> None:
        async with syncing(snap(*web(np_, be.port, ready=False))) as px:  # unready, not serving
            dp = px.dataplane
            assert isinstance(dp, Dataplane)
            assert dp.listeners() == []
            assert ss_listening(np_) == []
            t0 = time.monotonic()
            with pytest.raises(ConnectionRefusedError):
                await asyncio.to_thread(peer_name, np_)
            assert time.monotonic() - t0 < 0.5, "REJECT is immediate, not a timeout"
            px.sync(snap(*web(np_, be.port), generation=2))
            assert await asyncio.to_thread(peer_name, np_) == "b"

    run_on("uvloop", scenario)


def test_nodeport_addresses_restrict_listeners(backends) -> None:
    be = backends()
    np_ = free_port()

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        for cidrs, expected in [
            (None, [("0.0.0.0", np_, "serving")]),
            (["127.0.0.2/32"], [(NODE_IP, np_, "serving")]),
            (["10.0.0.0/8"], []),
            (["127.0.0.0/8"], [("127.0.0.1", np_, "serving"), (NODE_IP, np_, "serving")]),
        ]:
            dp = Dataplane(loop=loop)
            px = Proxier(sync_config(NODE, cidrs), dataplane=dp)
            try:
                px.sync(snap(*web(np_, be.port)))
                assert dp.listeners() == expected, cidrs
                assert len(ss_listening(np_)) == len(expected), cidrs
            finally:
                dp.close()

    run_on("uvloop", scenario)


def test_unassigned_node_ip_is_logged_once_and_retried(backends, caplog) -> None:
    be = backends()
    np_ = free_port()
    caplog.set_level(logging.INFO, logger="proxy.userspace.dataplane")
    absent = "192.0.2.77"  # TEST-NET-1: never assigned here; bind() fails, nothing is sent

    async def scenario() -> None:
        # The wildcard listener does not care which node IPs are assigned.
        dp = Dataplane(loop=asyncio.get_running_loop(), retry_interval=0.05)
        px = Proxier(sync_config(NODE), dataplane=dp)
        try:
            px.sync(snap(*web(np_, be.port, node_ips=(NODE_IP, absent))))
            assert dp.listeners() == [("0.0.0.0", np_, "serving")]
        finally:
            dp.close()
        # Per-address listeners (--nodeport-addresses) bind each node IP.
        dp = Dataplane(loop=asyncio.get_running_loop(), retry_interval=0.05)
        px = Proxier(sync_config(NODE, ["127.0.0.0/8", "192.0.2.0/24"]), dataplane=dp)
        try:
            px.sync(snap(*web(np_, be.port, node_ips=(NODE_IP, absent))))
            await asyncio.sleep(0.3)  # several retries
            assert dp.listeners() == [
                ("127.0.0.1", np_, "serving"),
                (NODE_IP, np_, "serving"),
                (absent, np_, "error: Cannot assign requested address"),
            ]
            assert await asyncio.to_thread(peer_name, np_) == "b"
        finally:
            dp.close()

    run_on("uvloop", scenario)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    assert "default/web" in warnings[0] and f"{absent}:{np_}" in warnings[0]
    assert "retrying" in warnings[0]


def test_drop_state_on_the_wildcard_listener(backends) -> None:
    be = backends()
    np_ = free_port()

    async def scenario() -> None:
        dp = Dataplane(loop=asyncio.get_running_loop())
        px = Proxier(sync_config(NODE), dataplane=dp)
        try:
            # eTP=Local, the only endpoint on another node: DROP external.
            px.sync(snap(*web(np_, be.port, etp="Local", ep_node="n2")))
            assert dp.listeners() == [("0.0.0.0", np_, "dropping")]
            # The node's own address and loopback sources pass the filter on
            # the same socket and get Cluster semantics.
            assert await asyncio.to_thread(peer_name, np_, NODE_IP) == "b"
            assert await asyncio.to_thread(peer_name, np_, "127.0.0.1") == "b"
            px.sync(snap(*web(np_, be.port, etp="Local"), generation=2))
            assert dp.listeners() == [("0.0.0.0", np_, "serving")]
        finally:
            dp.close()

    run_on("uvloop", scenario)


def test_drop_state_on_node_ips_never_on_localhost_with_cidrs(backends) -> None:
    be = backends()
    np_ = free_port()

    async def scenario() -> None:
        dp = Dataplane(loop=asyncio.get_running_loop())
        px = Proxier(sync_config(NODE, ["127.0.0.0/8"]), dataplane=dp)
        try:
            px.sync(snap(*web(np_, be.port, etp="Local", ep_node="n2")))
            assert dp.listeners() == [("127.0.0.1", np_, "serving"), (NODE_IP, np_, "dropping")]
            assert await asyncio.to_thread(peer_name, np_, NODE_IP) == "b"
            assert await asyncio.to_thread(peer_name, np_, "127.0.0.1") == "b"
            px.sync(snap(*web(np_, be.port, etp="Local"), generation=2))
            assert dp.listeners() == [("127.0.0.1", np_, "serving"), (NODE_IP, np_, "serving")]
        finally:
            dp.close()

    run_on("uvloop", scenario)


def test_capacity_limit_queues_clients_instead_of_refusing(loop_kind: str, backends) -> None:
    be = backends()
    np_ = free_port()

    def drip() -> int:
        with socket.create_connection((NODE_IP, np_), timeout=5) as s:
            s.sendall(b"DRIP 8\n")
            n = 0
            while data := s.recv(4096):
                n += data.count(b"drip")
            return n

    def third() -> tuple[str, float]:
        t0 = time.monotonic()
        with socket.create_connection((NODE_IP, np_), timeout=5) as s:
            s.sendall(b"PEER\n")
            return s.recv(100).decode().split()[0], time.monotonic() - t0

    async def scenario() -> None:
        dp = Dataplane(loop=asyncio.get_running_loop(), max_connections=2)
        px = Proxier(sync_config(NODE), dataplane=dp)
        try:
            px.sync(snap(*web(np_, be.port)))
            drips = [asyncio.ensure_future(asyncio.to_thread(drip)) for _ in range(2)]
            for _ in range(100):
                if dp.active_connections() == 2:
                    break
                await asyncio.sleep(0.01)
            t = asyncio.ensure_future(asyncio.to_thread(third))
            await asyncio.sleep(0.15)
            assert not t.done()
            assert ("0.0.0.0", np_, "paused") in dp.listeners()
            assert [await d for d in drips] == [8, 8]
            name, waited = await t
            assert name == "b" and waited >= 0.2
            for _ in range(100):  # resumed once the last relay has ended
                if ("0.0.0.0", np_, "serving") in dp.listeners():
                    break
                await asyncio.sleep(0.01)
            assert ("0.0.0.0", np_, "serving") in dp.listeners()
        finally:
            dp.close()

    run_on(loop_kind, scenario)


def test_listener_close_removes_the_socket() -> None:
    async def scenario() -> None:
        port = free_port()
        lis = Listener(asyncio.get_running_loop(), "127.0.0.1", port, lambda *a: None)
        lis.open()
        assert lis.state == "serving" and len(ss_listening(port)) == 1
        lis.close()
        lis.close()
        assert lis.state == "closed" and ss_listening(port) == []

    run_on("uvloop", scenario)


def test_accepted_sockets_inherit_nodelay() -> None:
    """The relay counts on it: no Nagle delay added, no setsockopt per connection."""
    got: list[socket.socket] = []

    async def scenario() -> None:
        port = free_port()
        lis = Listener(asyncio.get_running_loop(), "127.0.0.1", port,
                       lambda sock, addr, node_port: got.append(sock))
        lis.open()
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=2):
                for _ in range(100):
                    if got:
                        break
                    await asyncio.sleep(0.01)
        finally:
            lis.close()

    run_on("uvloop", scenario)
    assert len(got) == 1
    try:
        assert got[0].getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1
    finally:
        got[0].close()


@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
def test_emfile_backs_off_without_spinning_then_recovers(tmp_path: Path, backends, loop) -> None:
    be = backends()
    np_ = free_port()
    drv = Driver(tmp_path, NODE, "--hog-fds", "--loop", loop, "--max-connections", "0",
                 stdin=True)
    clients: list[socket.socket] = []
    try:
        drv.start(*web(np_, be.port))
        st = wait_until(lambda: drv.status().get("hogged"), 5.0, 0.02, what="fds hogged")
        assert st > 0
        # The kernel completes these handshakes; the dataplane cannot accept.
        for _ in range(3):
            s = socket.create_connection(("127.0.0.1", np_), timeout=2)
            s.sendall(b"PEER\n")
            s.settimeout(0.3)
            clients.append(s)
        for s in clients:
            # Neither served, nor accepted-then-closed (EOF), nor reset.
            with pytest.raises(TimeoutError):
                s.recv(100)
        pid = drv.status()["pid"]
        c0 = cpu_seconds(pid)
        time.sleep(1.0)
        assert cpu_seconds(pid) - c0 < 0.3, "accept errors must not spin"

        drv.send("FREE")
        for s in clients:
            s.settimeout(5)
            assert s.recv(100).decode().split()[0] == "b"
    finally:
        for s in clients:
            s.close()
        drv.stop()
    logs = drv.logs()
    episodes = logs.count("accept failed")
    assert 1 <= episodes <= 2, logs  # once per listener that hit it, not per attempt
    assert "Too many open files" in logs and "backing off" in logs


@pytest.mark.parametrize("loop_kind", ["uvloop", "asyncio"])
def test_accept_set_serves_many_listeners_and_forgets_closed_ones(loop_kind: str) -> None:
    """One epoll set for every listener: each accepts its own clients; a closed one
    leaves the set, and the others keep accepting."""
    from proxy.userspace.listener import AcceptSet

    got: dict[int, int] = {}

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        accept_set = AcceptSet(loop)
        ports = [free_port() for _ in range(3)]

        def on_accept(sock: socket.socket, addr: tuple[str, int], node_port: int) -> None:
            got[node_port] = got.get(node_port, 0) + 1
            sock.close()

        listeners = [Listener(loop, "127.0.0.1", p, on_accept, accept_set=accept_set)
                     for p in ports]
        for lis in listeners:
            lis.open()

        async def dial(port: int, n: int) -> None:
            want = got.get(port, 0) + n
            for _ in range(n):
                socket.create_connection(("127.0.0.1", port), timeout=2).close()
            for _ in range(300):
                if got.get(port, 0) >= want:
                    return
                await asyncio.sleep(0.01)

        try:
            for i, p in enumerate(ports):
                await dial(p, i + 1)
            assert got == {ports[0]: 1, ports[1]: 2, ports[2]: 3}
            listeners[1].close()
            with pytest.raises(ConnectionRefusedError):
                socket.create_connection(("127.0.0.1", ports[1]), timeout=2)
            await dial(ports[2], 2)
            assert got == {ports[0]: 1, ports[1]: 2, ports[2]: 5}
        finally:
            for lis in listeners:
                lis.close()
            accept_set.close()

    run_on(loop_kind, scenario)


def test_a_sync_keeps_the_port_state_of_every_unchanged_plan() -> None:
    """One endpoint change rebuilds that port's table only; its balancer carries over."""
    a_port, b_port = free_port(), free_port()
    parser = StateParser()  # keeps unchanged objects, as a state source does

    def state(b_endpoint: str, generation: int):  # type: ignore[no-untyped-def]
        return parser.parse(state_yaml(
            node(NODE, NODE_IP),
            service("a", a_port, 9), endpoint_slice("a", ("127.0.0.1", NODE), port=9),
            service("b", b_port, 9), endpoint_slice("b", (b_endpoint, NODE), port=9),
        ), generation)

    async def scenario() -> None:
        async with syncing(state("127.0.0.1", 1)) as px:
            dp = px.dataplane
            assert isinstance(dp, Dataplane)
            before = dict(dp.forwarder.ports)
            px.sync(state("127.0.0.3", 2))
            after = dp.forwarder.ports
            assert after[a_port] is before[a_port]
            assert after[b_port] is not before[b_port]
            assert after[b_port].plan.cluster[0].addr == ("127.0.0.3", 9)
            assert after[b_port].balancer is before[b_port].balancer
            assert after[b_port].metrics is before[b_port].metrics

    run_on("uvloop", scenario)
