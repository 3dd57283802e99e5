"""healthCheckNodePort servers: exact answers, and listeners that follow the state.

Every answer is compared byte for byte with what kube-proxy's Go server
writes (spec section 3a), over real sockets on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket

import aiohttp
import pytest
import uvloop

from healthz.proxy_health import ProxyHealth
from healthz.service_health import ServiceHealthServer, go_quote, render_body
from proxy.core.model import EndpointPort, ServicePort
from tests.support.health import (
    FakeClock,
    ep,
    eps_slice,
    eventually,
    free_port,
    get,
    http_raw,
    lb_service,
    listening_sockets,
    refuses,
    snap,
    split_response,
)
from tests.support.wiring import HealthChecks

EXAMPLE = (
    b'{\n\t"service": {\n\t\t"namespace": "default",\n\t\t"name": "python-lb"\n\t},'
    b'\n\t"localEndpoints": 1,\n\t"serviceProxyHealthy": true\n}'
)


def expected(count: int, healthy: bool = True, name: str = "python-lb", http: str = "1.1") -> bytes:
    body = render_body("default", name, count, healthy)
    status = b"200 OK" if count and healthy else b"503 Service Unavailable"
    conn = b"Connection: close\r\n" if http == "1.1" else b""
    return (
        b"HTTP/" + http.encode() + b" " + status + b"\r\n"
        b"Content-Type: application/json\r\n"
        b"X-Content-Type-Options: nosniff\r\n"
        b"X-Load-Balancing-Endpoint-Weight: " + str(count).encode() + b"\r\n"
        b"Date: DATE\r\n"
        b"Content-Length: " + str(len(body)).encode() + b"\r\n" + conn + b"\r\n" + body
    )


async def fetch(port: int, request: bytes | None = None) -> bytes:
    head, body = split_response(await http_raw(port, request or get()))
    return head + b"\r\n" + body


def local_endpoints_state(port: int, n_local: int, node: str = "node-a"):
    """``n_local`` ready pods on ``node`` (two ports each), plus noise that must not count."""
    svc = lb_service(
        hc_port=port,
        ports=(
            ServicePort("http", "TCP", 80, 8080, 30080),
            ServicePort("https", "TCP", 443, 8443, 30443),
        ),
    )
    local = [ep(f"10.1.0.{i}", node) for i in range(1, n_local + 1)]
    noise = [
        ep("10.2.0.1", "node-b"),  # remote
        ep("10.1.9.1", node, ready=False, serving=False),  # not ready
        ep("10.1.9.2", node, ready=False, serving=True, terminating=True),  # terminating
    ]
    slice_ports = (EndpointPort("http", 8080), EndpointPort("https", 8443))
    sl = eps_slice(svc, local + noise, ports=slice_ports)
    return snap([svc], [sl])


def test_body_is_kube_proxys_exact_bytes() -> None:
    assert render_body("default", "python-lb", 1, True) == EXAMPLE
    assert len(EXAMPLE) == 120
    # The spec's nmap capture of a real node: 127 bytes for this name.
    assert len(render_body("default", "wp-nginx-service", 1, True)) == 127
    assert render_body("ns", "n", 0, False).endswith(b'"serviceProxyHealthy": false\n}')


def test_go_quote_matches_strconv_quote() -> None:
    assert go_quote("python-lb") == '"python-lb"'
    assert go_quote('a"b\\c') == '"a\\"b\\\\c"'
    assert go_quote("tab\there\n") == '"tab\\there\\n"'
    assert go_quote("\x01\x7f") == '"\\x01\\x7f"'
    assert go_quote("é") == '"é"'  # printable non-ASCII stays, unlike json.dumps
    assert go_quote("\u200b") == '"\\u200b"'


@pytest.mark.parametrize("n_local", [0, 1, 3])
async def test_answer_bytes_for_local_endpoint_counts(n_local: int) -> None:
    port = free_port()
    hc = HealthChecks("node-a", ProxyHealth(), ["127.0.0.1"])
    hc.sync(local_endpoints_state(port, n_local))
    try:
        # Two ports per pod, a remote pod, a not-ready and a terminating local
        # one: only unique local ready IPs count.
        assert await fetch(port) == expected(n_local)
        assert hc.local_endpoints("default/python-lb") == n_local
    finally:
        await hc.stop()


async def test_the_120_byte_example_over_http_1_0() -> None:
    port = free_port()
    svc = lb_service(hc_port=port)
    state = snap([svc], [eps_slice(svc, [ep("10.1.0.1", "node-a"), ep("10.2.0.1", "node-b")])])
    hc = HealthChecks("node-a", ProxyHealth(), ["127.0.0.1"])
    hc.sync(state)
    try:
        raw = await fetch(port, b"GET /healthz HTTP/1.0\r\n\r\n")
        assert raw == expected(1, http="1.0")
        assert raw.endswith(b"\r\n\r\n" + EXAMPLE)
        assert b"Content-Length: 120\r\n" in raw
        assert b"Server:" not in raw and b"charset" not in raw
    finally:
        await hc.stop()


async def test_same_service_answers_per_node() -> None:
    """One pod on node A of three: A says 200 with 1, B and C say 503 with 0."""
    svc = lb_service(hc_port=0)
    ports = {name: free_port() for name in ("node-a", "node-b", "node-c")}
    servers = {}
    try:
        for node, port in ports.items():
            s = lb_service(hc_port=port)
            servers[node] = HealthChecks(node, ProxyHealth(), ["127.0.0.1"])
            servers[node].sync(snap([s], [eps_slice(svc, [ep("10.1.0.1", "node-a")])]))
        assert await fetch(ports["node-a"]) == expected(1)
        assert await fetch(ports["node-b"]) == expected(0)
        assert await fetch(ports["node-c"]) == expected(0)
    finally:
        for s in servers.values():
            await s.stop()


async def test_proxy_unhealthy_answers_503_with_the_count() -> None:
    port = free_port()
    clock = FakeClock()
    health = ProxyHealth(timeout=60.0, clock=clock)
    hc = HealthChecks("node-a", health, ["127.0.0.1"])
    hc.sync(local_endpoints_state(port, 2))
    try:
        health.queued()
        clock.advance(59.9)
        assert await fetch(port) == expected(2, healthy=True)  # pending, not late yet
        clock.advance(0.1)
        assert await fetch(port) == expected(2, healthy=False)
        health.updated()
        assert await fetch(port) == expected(2, healthy=True)
    finally:
        await hc.stop()


async def test_terminating_only_is_503_with_zero_while_still_listening() -> None:
    port = free_port()
    svc = lb_service(hc_port=port)
    draining = ep("10.1.0.1", "node-a", ready=False, serving=True, terminating=True)
    hc = HealthChecks("node-a", ProxyHealth(), ["127.0.0.1"])
    hc.sync(snap([svc], [eps_slice(svc, [draining, ep("10.2.0.1", "node-b")])]))
    try:
        assert "default/python-lb" in hc.serving()
        assert await fetch(port) == expected(0)
    finally:
        await hc.stop()


async def test_head_gets_headers_only() -> None:
    port = free_port()
    hc = HealthChecks("node-a", ProxyHealth(), ["127.0.0.1"])
    hc.sync(local_endpoints_state(port, 1))
    try:
        raw = await http_raw(port, get("/healthz", "HEAD"))
        head, body = split_response(raw)
        assert body == b""
        assert head + b"\r\n" == expected(1)[: -len(EXAMPLE)]
    finally:
        await hc.stop()


async def test_every_path_and_method_gets_the_same_answer() -> None:
    port = free_port()
    hc = HealthChecks("node-a", ProxyHealth(), ["127.0.0.1"])
    hc.sync(local_endpoints_state(port, 1))
    try:
        async with aiohttp.ClientSession() as session:
            for method in ("GET", "POST", "PUT", "DELETE", "OPTIONS", "PATCH", "PROPFIND"):
                for path in ("/", "/healthz", "/healthz/", "/no/such/path?x=1", "/%2e%2e/etc"):
                    async with session.request(
                        method, f"http://127.0.0.1:{port}{path}", data=b"ignored"
                    ) as resp:
                        assert resp.status == 200, (method, path)
                        assert await resp.read() == EXAMPLE
                        assert resp.headers["X-Load-Balancing-Endpoint-Weight"] == "1"
    finally:
        await hc.stop()


async def test_malformed_http_gets_400_and_the_listener_keeps_serving() -> None:
    port = free_port()
    hc = HealthChecks("node-a", ProxyHealth(), ["127.0.0.1"])
    hc.sync(local_endpoints_state(port, 1))
    try:
        for junk in (b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03\r\n\r\n", b"GET\r\n\r\n"):
            raw = await http_raw(port, junk)
            assert raw.split(b"\r\n", 1)[0].endswith(b" 400 Bad Request"), raw
            assert b"Content-Type: text/plain; charset=utf-8\r\n" in raw
            assert b"Connection: close\r\n" in raw
        assert await fetch(port) == expected(1)
    finally:
        await hc.stop()


async def test_counts_follow_snapshots_on_the_same_listener() -> None:
    port = free_port()
    hc = HealthChecks("node-a", ProxyHealth(), ["127.0.0.1"])
    svc = lb_service(hc_port=port)
    try:
        hc.sync(snap([svc], [eps_slice(svc, [ep("10.1.0.1", "node-a")])]))
        first = hc.serving()
        assert await fetch(port) == expected(1)
        # The pod moves to node B: this node now answers 503 at once.
        hc.sync(snap([svc], [eps_slice(svc, [ep("10.1.0.1", "node-b")])], generation=2))
        assert await fetch(port) == expected(0)
        # Slices vanish entirely: still listed, still 0.
        hc.sync(snap([svc], [], generation=3))
        assert await fetch(port) == expected(0)
        assert hc.serving() == first
    finally:
        await hc.stop()


async def assert_closed(port: int) -> None:
    assert refuses(port), f"port {port} still accepts connections"
    assert listening_sockets(port) == ""


async def test_listener_opens_moves_and_closes_with_the_state() -> None:
    p1, p2 = free_port(), free_port()
    hc = HealthChecks("node-a", ProxyHealth(), ["127.0.0.1"])
    svc = lb_service(hc_port=p1)
    endpoints = [ep("10.1.0.1", "node-a")]
    try:
        await assert_closed(p1)
        hc.sync(snap([svc], [eps_slice(svc, endpoints)]))
        assert listening_sockets(p1)
        assert await fetch(p1) == expected(1)

        moved = lb_service(hc_port=p2)
        hc.sync(snap([moved], [eps_slice(moved, endpoints)], generation=2))
        await assert_closed(p1)
        assert await fetch(p2) == expected(1)

        # Switch to Cluster: the port refuses, no LISTEN socket remains.
        cluster = lb_service(hc_port=p2, policy="Cluster")
        hc.sync(snap([cluster], [eps_slice(cluster, endpoints)], generation=3))
        await assert_closed(p2)
        assert hc.serving() == {}

        # Back to Local, then NodePort type, then hc port 0, then deleted.
        hc.sync(snap([moved], [eps_slice(moved, endpoints)], generation=4))
        assert await fetch(p2) == expected(1)
        for gen, gone in enumerate(
            (lb_service(hc_port=p2, type="NodePort"), lb_service(hc_port=0), None), start=5
        ):
            hc.sync(snap([moved], [], generation=gen))
            assert await fetch(p2) == expected(0)
            hc.sync(snap([gone] if gone else [], [], generation=gen))
            await assert_closed(p2)
    finally:
        await hc.stop()


async def test_closing_also_drops_open_keepalive_connections() -> None:
    port = free_port()
    hc = HealthChecks("node-a", ProxyHealth(), ["127.0.0.1"])
    svc = lb_service(hc_port=port)
    hc.sync(snap([svc], [eps_slice(svc, [ep("10.1.0.1", "node-a")])]))
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        await reader.readuntil(EXAMPLE)
        hc.sync(snap([], [], generation=2))
        async with asyncio.timeout(2):
            assert await reader.read() == b""
        await assert_closed(port)
    finally:
        writer.close()
        await hc.stop()


async def test_services_swapping_ports_in_one_snapshot() -> None:
    p1, p2 = free_port(), free_port()
    hc = HealthChecks("node-a", ProxyHealth(), ["127.0.0.1"])
    a, b = lb_service("svc-a", p1), lb_service("svc-b", p2)
    slices = [eps_slice(a, [ep("10.1.0.1", "node-a")])]
    try:
        hc.sync(snap([a, b], slices))
        assert await fetch(p1) == expected(1, name="svc-a")
        a2, b2 = lb_service("svc-a", p2), lb_service("svc-b", p1)
        hc.sync(snap([a2, b2], slices, generation=2))
        assert await fetch(p2) == expected(1, name="svc-a")
        assert await fetch(p1) == expected(0, name="svc-b")
        assert hc.failed() == {}
    finally:
        await hc.stop()


async def test_port_in_use_is_logged_retried_and_blocks_no_one(
    caplog: pytest.LogCaptureFixture,
) -> None:
    taken, free = free_port(), free_port()
    squatter = socket.socket()
    squatter.bind(("127.0.0.1", taken))
    squatter.listen()
    hc = HealthChecks("node-a", ProxyHealth(), ["127.0.0.1"], retry_interval=3600)
    a, b = lb_service("svc-a", taken), lb_service("svc-b", free)
    state = snap([a, b], [eps_slice(b, [ep("10.1.0.1", "node-a")])])
    try:
        with caplog.at_level(logging.ERROR, logger="healthz.service_health"):
            hc.sync(state)
        assert await fetch(free) == expected(1, name="svc-b")
        assert "default/svc-a" in hc.failed()
        assert "Address already in use" in hc.failed()["default/svc-a"]
        assert any("default/svc-a" in r.getMessage() and str(taken) in r.getMessage()
                   for r in caplog.records)

        # A second sync with the port still taken logs nothing new at ERROR.
        caplog.clear()
        with caplog.at_level(logging.ERROR, logger="healthz.service_health"):
            hc.sync(state)
        assert caplog.records == []

        squatter.close()
        hc.sync(state)  # the next sync retries
        assert await fetch(taken) == expected(0, name="svc-a")
        assert hc.failed() == {}
    finally:
        squatter.close()
        await hc.stop()


async def test_port_in_use_is_retried_periodically_without_a_new_snapshot() -> None:
    taken = free_port()
    squatter = socket.socket()
    squatter.bind(("127.0.0.1", taken))
    squatter.listen()
    hc = HealthChecks("node-a", ProxyHealth(), ["127.0.0.1"], retry_interval=0.05)
    try:
        hc.sync(snap([lb_service(hc_port=taken)]))
        assert hc.failed()
        squatter.close()
        await eventually(lambda: "default/python-lb" in hc.serving(), timeout=3)
        assert await fetch(taken) == expected(0)
    finally:
        squatter.close()
        await hc.stop()


def test_sync_never_raises_even_without_a_loop(caplog: pytest.LogCaptureFixture) -> None:
    hc = HealthChecks("node-a", ProxyHealth(), ["127.0.0.1"])
    with caplog.at_level(logging.ERROR):
        hc.sync(snap([lb_service(hc_port=free_port())]))
    assert hc.serving() == {}


async def test_services_and_counts_are_plain_data_and_nothing_binds_before_start() -> None:
    """kube-proxy's two calls: which services on which port, and each one's local count."""
    port = free_port()
    server = ServiceHealthServer(ProxyHealth())
    try:
        server.sync_services({"default/python-lb": port}, ["127.0.0.1"])
        server.sync_endpoints({"default/python-lb": 2, "default/unchecked": 5})
        assert server.serving() == {} and refuses(port), "a successor binds only once started"
        server.start()
        assert server.serving() == {"default/python-lb": [("127.0.0.1", port)]}
        assert await fetch(port) == expected(2)
        server.sync_endpoints({})  # a count is set in place: same listener, new answer
        assert await fetch(port) == expected(0)
        server.sync_services({}, ["127.0.0.1"])
        await server.wait_settled()
        assert refuses(port)
    finally:
        await server.stop()


async def test_cidr_nodeport_addresses_bind_only_matching_addresses() -> None:
    port = free_port()
    hc = HealthChecks("node-a", ProxyHealth(), [ipaddress.ip_network("127.0.0.0/8")])
    try:
        hc.sync(local_endpoints_state(port, 1))
        assert hc.serving() == {"default/python-lb": [("127.0.0.1", port)]}
        assert await fetch(port) == expected(1)
        assert refuses(port, "127.0.0.2")
    finally:
        await hc.stop()


def test_lifecycle_under_uvloop() -> None:
    """The CLI runs uvloop: closing must refuse at once there too."""

    async def scenario() -> None:
        port = free_port()
        hc = HealthChecks("node-a", ProxyHealth(), ["127.0.0.1"])
        svc = lb_service(hc_port=port)
        hc.sync(snap([svc], [eps_slice(svc, [ep("10.1.0.1", "node-a")])]))
        assert await fetch(port) == expected(1)
        hc.sync(snap([lb_service(hc_port=port, policy="Cluster")], generation=2))
        await assert_closed(port)
        await hc.stop()

    uvloop.run(scenario())


async def test_an_impossible_port_fails_only_its_own_service() -> None:
    good = free_port()
    hc = HealthChecks("node-a", ProxyHealth(), ["127.0.0.1"], retry_interval=3600)
    try:
        hc.sync(snap([lb_service("bad", 70000), lb_service("good", good)]))
        assert "default/bad" in hc.failed()
        assert await fetch(good) == expected(0, name="good")
    finally:
        await hc.stop()
