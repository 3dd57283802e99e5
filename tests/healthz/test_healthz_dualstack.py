"""Dual-stack health (issue 14): one healthCheckNodePort server for both families,
per-family ``/healthz`` and ``/livez``, and the node health port over IPv6.

Over real sockets, in process: loopback (127.0.0.1 and ::1) in the root
namespace, and wildcard listeners (``0.0.0.0``/``::``) only inside a fresh
network namespace, so no port is opened on the machine's own interfaces.
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Awaitable, Callable
from typing import TypeVar

import pytest

from healthz.http import HttpListener, arrival_family, go_response
from healthz.proxy_health import NodeHealthServer, ProxyHealth, family_name, rfc3339nano
from healthz.service_health import ALL_ADDRESSES, ALL_ADDRESSES6, ServiceHealthServer
from healthz.sidecar import Sidecar
from tests.healthz.test_healthz_service import expected
from tests.support.health import (
    FakeClock,
    eventually,
    get,
    http_raw,
    refuses,
    split_response,
)
from tests.support.netns import in_fresh_netns

T0 = 1_800_000_000.25  # 2027-01-15T08:00:00.25Z
SVC = "default/python-lb"
R = TypeVar("R")


def free_port_both() -> int:
    """A port free on both 127.0.0.1 and ::1 right now."""
    for _ in range(20):
        with socket.socket(socket.AF_INET6) as s6:
            s6.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            s6.bind(("::1", 0))
            port = int(s6.getsockname()[1])
            with socket.socket() as s4:
                try:
                    s4.bind(("127.0.0.1", port))
                except OSError:
                    continue
                return port
    raise RuntimeError("no port free on both loopback addresses")


async def fetch(port: int, host: str, path: str = "/healthz") -> bytes:
    head, body = split_response(await http_raw(port, get(path), host=host))
    return head + b"\r\n" + body


def in_netns(tag: str, test: Callable[[], Awaitable[R]]) -> R:
    """Run the coroutine ``test()`` on its own loop inside a fresh namespace (lo up)."""
    return in_fresh_netns(tag, lambda: asyncio.run(test()))


async def started(
    hosts: list[str], health: ProxyHealth | None = None
) -> tuple[ServiceHealthServer, int]:
    server = ServiceHealthServer(health or ProxyHealth())
    port = free_port_both()
    server.sync_services({SVC: port}, hosts)
    server.start()
    assert server.failed() == {}, server.failed()
    return server, port


# -- healthCheckNodePort: one server, each family answered with its own count --


async def test_ipv4_only_endpoints_answer_200_over_ipv4_and_503_over_ipv6() -> None:
    server, port = await started(["127.0.0.1", "::1"])
    try:
        server.sync_endpoints({SVC: 2}, {})
        assert await fetch(port, "127.0.0.1") == expected(2)
        assert await fetch(port, "::1") == expected(0)
        assert server.local_endpoints(SVC) == 2
        assert server.local_endpoints(SVC, "IPv6") == 0
    finally:
        await server.stop()


async def test_ipv6_only_endpoints_answer_503_over_ipv4_and_200_over_ipv6() -> None:
    server, port = await started(["127.0.0.1", "::1"])
    try:
        server.sync_endpoints({}, {SVC: 3})
        assert await fetch(port, "127.0.0.1") == expected(0)
        assert await fetch(port, "::1") == expected(3)
        # Both families local: each still answers with its own count.
        server.sync_endpoints({SVC: 1}, {SVC: 4})
        assert await fetch(port, "127.0.0.1") == expected(1)
        assert await fetch(port, "::1") == expected(4)
    finally:
        await server.stop()


async def test_no_ipv6_counts_means_zero_over_ipv6_and_ipv4_as_before() -> None:
    """``local_ready6=None`` (a node without IPv6): IPv6 checks get 0, IPv4 is unchanged."""
    server, port = await started(["127.0.0.1", "::1"])
    try:
        server.sync_endpoints({SVC: 2}, {SVC: 5})
        assert await fetch(port, "::1") == expected(5)
        server.sync_endpoints({SVC: 2})  # the one-argument call of IPv4-only callers
        assert await fetch(port, "127.0.0.1") == expected(2)
        assert await fetch(port, "::1") == expected(0)
    finally:
        await server.stop()


async def test_counts_synced_before_the_check_exists_are_kept_per_family() -> None:
    server = ServiceHealthServer(ProxyHealth())
    server.sync_endpoints({SVC: 1}, {SVC: 2})
    port = free_port_both()
    server.sync_services({SVC: port}, ["127.0.0.1", "::1"])
    server.start()
    try:
        assert await fetch(port, "127.0.0.1") == expected(1)
        assert await fetch(port, "::1") == expected(2)
    finally:
        await server.stop()


def test_both_wildcards_share_one_port_kubernetes_114702() -> None:
    """``0.0.0.0`` and ``::`` on one port, one server: neither family loses the bind."""

    async def run() -> None:
        server, port = await started([ALL_ADDRESSES, ALL_ADDRESSES6])
        try:
            assert sorted(server.serving()[SVC]) == [("0.0.0.0", port), ("::", port)]
            server.sync_endpoints({SVC: 1}, {SVC: 0})
            assert await fetch(port, "127.0.0.1") == expected(1)
            assert await fetch(port, "::1") == expected(0)
            server.sync_endpoints({SVC: 0}, {SVC: 2})
            assert await fetch(port, "127.0.0.1") == expected(0)
            assert await fetch(port, "::1") == expected(2)
        finally:
            await server.stop()
        assert refuses(port) and refuses(port, "::1")

    in_netns("hc46", run)


async def test_a_faulted_family_answers_its_checks_unhealthy_and_the_other_not() -> None:
    health = ProxyHealth()
    health.set_families(("IPv4", "IPv6"))
    server, port = await started(["127.0.0.1", "::1"], health)
    try:
        server.sync_endpoints({SVC: 1}, {SVC: 1})
        health.set_fault("return-path", "ip -6 rule add: Permission denied", family="IPv6")
        assert await fetch(port, "127.0.0.1") == expected(1)
        assert await fetch(port, "::1") == expected(1, healthy=False)
        health.clear_fault("return-path", family="IPv6")
        assert await fetch(port, "::1") == expected(1)
        health.set_fault("ruleset", "nft: no such table")  # no family: both
        assert await fetch(port, "127.0.0.1") == expected(1, healthy=False)
        assert await fetch(port, "::1") == expected(1, healthy=False)
    finally:
        await server.stop()


# -- /healthz and /livez: a status entry per family ----------------------------


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(T0)


def doc(health: ProxyHealth, with_node: bool = True) -> tuple[bool, dict[str, object]]:
    return NodeHealthServer(health).document(with_node)


def test_ipv4_only_document_is_unchanged(clock: FakeClock) -> None:
    """The IPv4-only bytes of before dual-stack, also after IPv6 came and went."""
    health = ProxyHealth(clock=clock)
    health.sync_node(True)
    clock.advance(10.5)
    before = json.dumps(doc(health)[1], separators=(",", ":"))
    assert before == (
        '{"lastUpdated":"2027-01-15T08:00:10.75Z","currentTime":"2027-01-15T08:00:10.75Z",'
        '"nodeEligible":true,"healthy":true,'
        '"status":{"IPv4":{"lastUpdated":"2027-01-15T08:00:00.25Z","healthy":true}}}'
    )
    health.set_families(("IPv4", "IPv6"))
    health.set_fault("x", "broken", family="IPv6")
    health.set_families(("IPv4",))
    assert json.dumps(doc(health)[1], separators=(",", ":")) == before


def test_one_family_faulted_fails_healthz_and_livez_with_its_entry_false(
    clock: FakeClock,
) -> None:
    health = ProxyHealth(clock=clock)
    health.sync_node(True)
    health.set_families(("IPv4", "IPv6"))
    clock.advance(1.0)
    health.updated("IPv6")
    ok, body = doc(health)
    assert ok and body["status"] == {
        "IPv4": {"lastUpdated": rfc3339nano(T0), "healthy": True},
        "IPv6": {"lastUpdated": rfc3339nano(T0 + 1), "healthy": True},
    }
    health.set_fault("sklookup", "bpf: link gone", family="IPv6")
    for with_node in (True, False):
        ok, body = doc(health, with_node)
        assert not ok and body["healthy"] is False
        assert body["status"] == {
            "IPv4": {"lastUpdated": rfc3339nano(T0), "healthy": True},
            "IPv6": {"lastUpdated": rfc3339nano(T0 + 1), "healthy": False},
        }
        # Unhealthy: the top-level lastUpdated is the newest family's real one.
        assert body["lastUpdated"] == rfc3339nano(T0 + 1)
    assert health.healthy("IPv4") and not health.healthy("IPv6") and not health.healthy()
    health.clear_fault("sklookup", family="IPv6")
    assert doc(health)[0]


def test_one_family_pending_too_long_is_that_family_unhealthy(clock: FakeClock) -> None:
    health = ProxyHealth(timeout=60.0, clock=clock)
    health.sync_node(True)
    health.set_families(("IPv4", "IPv6"))
    health.queued()  # both families have a change queued
    health.updated("IPv4")  # only IPv4's dataplane applies it
    clock.advance(59.0)
    assert doc(health)[0]
    clock.advance(1.0)
    ok, body = doc(health, with_node=False)
    assert not ok
    assert body["status"] == {
        "IPv4": {"lastUpdated": rfc3339nano(T0), "healthy": True},
        "IPv6": {"lastUpdated": rfc3339nano(T0), "healthy": False},
    }
    health.updated("IPv6")
    assert doc(health)[0]


def test_an_unscoped_fault_fails_every_family_entry(clock: FakeClock) -> None:
    health = ProxyHealth(clock=clock)
    health.set_families((4, 6))
    health.set_fault("return-path", "ip rule add: Permission denied")
    ok, body = doc(health, with_node=False)
    assert not ok
    assert {f: e["healthy"] for f, e in body["status"].items()} == {  # type: ignore[union-attr]
        "IPv4": False,
        "IPv6": False,
    }
    assert health.fault("return-path") == "ip rule add: Permission denied"
    assert health.fault("return-path", "IPv6") is None


def test_family_names_and_bad_input() -> None:
    assert family_name(4) == family_name("IPv4") == "IPv4"
    assert family_name(6) == family_name("IPv6") == "IPv6"
    health = ProxyHealth()
    with pytest.raises(ValueError, match="IP family 'ipv6'"):
        health.set_fault("x", "why", family="ipv6")
    with pytest.raises(ValueError, match="at least one"):
        health.set_families(())
    with pytest.raises(ValueError, match="IP family 5"):
        health.set_families((4, 5))
    assert health.families == ("IPv4",)
    health.set_families(("IPv6", "IPv6"))
    assert health.families == ("IPv6",)


# -- the node health port over IPv6 ---------------------------------------------


def test_node_health_ipv6_socket_is_off_by_default_and_switchable() -> None:
    async def run() -> None:
        health = ProxyHealth()
        health.sync_node(True)
        sidecar = Sidecar(health, healthz_bind=("0.0.0.0", 0), metrics_bind=None)
        await sidecar.start()
        try:
            assert sidecar.healthz_address is not None
            port = sidecar.healthz_address[1]
            assert (await fetch(port, "127.0.0.1")).startswith(b"HTTP/1.1 200 OK")
            assert refuses(port, "::1") and sidecar.healthz_address6 is None

            sidecar.serve_healthz_ipv6(True)
            assert sidecar.healthz_address6 == ("::", port)
            head, _, body = (await fetch(port, "::1", "/livez")).partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 200 OK") and json.loads(body)["healthy"] is True
            health.set_families(("IPv4", "IPv6"))
            health.set_fault("x", "broken", family="IPv6")
            for host in ("127.0.0.1", "::1"):  # one answer, whichever family asks
                raw = await fetch(port, host)
                assert raw.startswith(b"HTTP/1.1 503 Service Unavailable")
                assert json.loads(raw.partition(b"\r\n\r\n")[2])["status"]["IPv6"] == {
                    "lastUpdated": rfc3339nano(health.family_last_updated("IPv6")),
                    "healthy": False,
                }

            sidecar.serve_healthz_ipv6(False)
            await eventually(lambda: refuses(port, "::1"))
            assert (await fetch(port, "127.0.0.1")).startswith(b"HTTP/1.1 503")
        finally:
            await sidecar.stop()
        assert refuses(port) and refuses(port, "::1")

    in_netns("nh6", run)


def test_node_health_ipv6_asked_for_before_start() -> None:
    async def run() -> None:
        health = ProxyHealth()
        health.sync_node(True)
        sidecar = Sidecar(health, healthz_bind=("0.0.0.0", 0), metrics_bind=None, healthz_ipv6=True)
        await sidecar.start()
        try:
            assert sidecar.healthz_address is not None
            port = sidecar.healthz_address[1]
            assert sidecar.healthz_address6 == ("::", port)
            assert (await fetch(port, "::1")).startswith(b"HTTP/1.1 200 OK")
            assert (await fetch(port, "127.0.0.1")).startswith(b"HTTP/1.1 200 OK")
        finally:
            await sidecar.stop()

    in_netns("nh6s", run)


async def test_node_health_ipv6_needs_the_wildcard_bind() -> None:
    """A specific ``--healthz-bind-address`` is the operator's choice: no IPv6 socket added."""
    sidecar = Sidecar(ProxyHealth(), healthz_bind=("127.0.0.1", 0), metrics_bind=None)
    await sidecar.start()
    try:
        sidecar.serve_healthz_ipv6(True)
        assert sidecar.healthz_address6 is None
    finally:
        await sidecar.stop()


def test_arrival_family_of_a_dual_stack_socket_is_the_wire_family() -> None:
    """An IPv4 client of ``[::]`` with V6ONLY off arrives as ``::ffff:a.b.c.d``: still IPv4."""

    async def run() -> None:
        listener = HttpListener(
            "family", lambda request: go_response(200, [], arrival_family(request).encode())
        )
        listener.open([("::", 0)], v6only=False)
        port = listener.addresses[0][1]
        try:
            for host, family in (("127.0.0.1", b"IPv4"), ("::1", b"IPv6")):
                _, body = split_response(await http_raw(port, get("/"), host=host))
                assert body == family, host
        finally:
            listener.close()
            await listener.wait_closed()

    in_netns("af46", run)
