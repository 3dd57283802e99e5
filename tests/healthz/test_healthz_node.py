"""Node health (/healthz, /livez), the metrics port and the Sidecar, fed by the proxier."""

from __future__ import annotations

import argparse
import json
import socket

import pytest

from healthz.metrics import MetricsServer
from healthz.proxy_health import NodeHealthServer, ProxyHealth, rfc3339nano
from healthz.sidecar import Sidecar
from proxy.commands import node, wiring
from proxy.core.model import Node
from proxy.proxier import Proxier
from proxy.sources.hub import StateHub
from tests.support.health import (
    NODES,
    FakeClock,
    ep,
    eps_slice,
    eventually,
    free_port,
    get,
    http_raw,
    lb_service,
    refuses,
    snap,
    split_response,
)
from tests.support.wiring import sample, start_sidecar, sync_config

T0 = 1_800_000_000.25  # 2027-01-15T08:00:00.25Z


async def node_get(sidecar: Sidecar, path: str, method: str = "GET") -> tuple[bytes, bytes]:
    assert sidecar.healthz_address is not None
    return split_response(await http_raw(sidecar.healthz_address[1], get(path, method)))


def test_rfc3339nano_like_go() -> None:
    assert rfc3339nano(T0) == "2027-01-15T08:00:00.25Z"
    assert rfc3339nano(1_800_000_000.0) == "2027-01-15T08:00:00Z"
    assert rfc3339nano(0.123456789) == "1970-01-01T00:00:00.123456789Z"


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(T0)


@pytest.fixture
def hub(clock: FakeClock) -> StateHub:
    return StateHub(ProxyHealth(timeout=60.0, clock=clock))


async def test_healthz_and_livez_when_healthy(hub: StateHub, clock: FakeClock) -> None:
    sidecar = await start_sidecar(hub)
    try:
        hub.publish(snap())  # last update at T0
        clock.advance(10.5)  # now T0 + 10.5; nothing pending
        before = sample("kubeproxy_proxy_healthz_total", code="200")
        head, body = await node_get(sidecar, "/healthz")
        assert head == (
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
            b"X-Content-Type-Options: nosniff\r\nDate: DATE\r\n"
            b"Content-Length: " + str(len(body)).encode() + b"\r\nConnection: close\r\n"
        )
        # json.Marshal: no spaces, Go's field order; lastUpdated is "now" when healthy.
        assert body == (
            b'{"lastUpdated":"2027-01-15T08:00:10.75Z","currentTime":"2027-01-15T08:00:10.75Z",'
            b'"nodeEligible":true,"healthy":true,'
            b'"status":{"IPv4":{"lastUpdated":"2027-01-15T08:00:00.25Z","healthy":true}}}'
        )
        assert sample("kubeproxy_proxy_healthz_total", code="200") == before + 1

        before = sample("kubeproxy_proxy_livez_total", code="200")
        head, body = await node_get(sidecar, "/livez", "POST")
        assert head.startswith(b"HTTP/1.1 200 OK\r\n")
        assert json.loads(body) == {
            "lastUpdated": "2027-01-15T08:00:10.75Z",
            "currentTime": "2027-01-15T08:00:10.75Z",
            "healthy": True,
            "status": {"IPv4": {"lastUpdated": "2027-01-15T08:00:00.25Z", "healthy": True}},
        }
        assert sample("kubeproxy_proxy_livez_total", code="200") == before + 1
    finally:
        await sidecar.stop()


@pytest.mark.parametrize(
    "node",
    [
        Node("node-a", deletion_timestamp="2027-01-15T07:59:00Z"),
        Node("node-a", taint_keys=("ToBeDeletedByClusterAutoscaler",)),
        None,  # unknown node: not eligible, as in the newest kube-proxy
    ],
    ids=["deleting", "autoscaler-taint", "unknown"],
)
async def test_ineligible_node_fails_healthz_but_not_livez(
    hub: StateHub, node: Node | None
) -> None:
    sidecar = await start_sidecar(hub)
    try:
        hub.publish(snap(nodes=[node] if node else []))
        before = sample("kubeproxy_proxy_healthz_total", code="503")
        head, body = await node_get(sidecar, "/healthz")
        assert head.startswith(b"HTTP/1.1 503 Service Unavailable\r\n")
        doc = json.loads(body)
        assert doc["nodeEligible"] is False and doc["healthy"] is True
        # Not healthy as a whole, so lastUpdated is the real last update.
        assert doc["lastUpdated"] == rfc3339nano(T0)
        assert sample("kubeproxy_proxy_healthz_total", code="503") == before + 1

        head, body = await node_get(sidecar, "/livez")
        assert head.startswith(b"HTTP/1.1 200 OK\r\n")
        assert "nodeEligible" not in json.loads(body)
    finally:
        await sidecar.stop()


async def test_update_pending_too_long_fails_both(hub: StateHub, clock: FakeClock) -> None:
    sidecar = await start_sidecar(hub)
    try:
        hub.publish(snap())
        hub.health.queued()  # an update arrives and is never applied
        clock.advance(59.0)
        assert (await node_get(sidecar, "/healthz"))[0].startswith(b"HTTP/1.1 200 OK")
        clock.advance(1.0)
        for path in ("/healthz", "/livez"):
            head, body = await node_get(sidecar, path)
            assert head.startswith(b"HTTP/1.1 503 Service Unavailable\r\n")
            doc = json.loads(body)
            assert doc["healthy"] is False
            assert doc["status"]["IPv4"] == {"lastUpdated": rfc3339nano(T0), "healthy": False}
            assert doc["lastUpdated"] == rfc3339nano(T0)
            assert doc["currentTime"] == rfc3339nano(T0 + 60.0)
    finally:
        await sidecar.stop()


async def test_other_paths_get_gos_404(hub: StateHub) -> None:
    sidecar = await start_sidecar(hub)
    try:
        for path in ("/", "/healthz/", "/livez/x", "/metrics", "/HEALTHZ"):
            head, body = await node_get(sidecar, path)
            assert head == (
                b"HTTP/1.1 404 Not Found\r\nContent-Type: text/plain; charset=utf-8\r\n"
                b"X-Content-Type-Options: nosniff\r\nDate: DATE\r\nContent-Length: 19\r\n"
                b"Connection: close\r\n"
            ), path
            assert body == b"404 page not found\n"
    finally:
        await sidecar.stop()


async def test_metrics_port(hub: StateHub) -> None:
    sidecar = await start_sidecar(hub)
    assert sidecar.metrics_address is not None
    port = sidecar.metrics_address[1]
    try:
        await node_get(sidecar, "/healthz")  # so the healthz counter has a sample
        head, body = split_response(await http_raw(port, get("/metrics")))
        assert head.startswith(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4")
        text = body.decode()
        for name in (
            "kubeproxy_sync_proxy_rules_duration_seconds_bucket",
            "kubeproxy_sync_proxy_rules_last_timestamp_seconds",
            "kubeproxy_network_programming_duration_seconds_bucket",
            'kubeproxy_sync_proxy_rules_no_local_endpoints_total{ip_family="IPv4",traffic_policy="external"}',
            "kubeproxy_proxy_healthz_total{",
            "kubeproxy_kpx_connections_accepted_total",
            "kubeproxy_kpx_healthz_connections_closed_total",
            # kube-proxy's: per family, a 0 bucket, the change trackers, the process.
            'kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds{ip_family="IPv4"}',
            'kubeproxy_network_programming_duration_seconds_bucket{ip_family="IPv4",le="0.0"}',
            "kubeproxy_sync_proxy_rules_endpoint_changes_total",
            "kubeproxy_sync_proxy_rules_endpoint_changes_pending",
            "kubeproxy_sync_proxy_rules_service_changes_total",
            "kubeproxy_sync_proxy_rules_service_changes_pending",
            "process_cpu_seconds_total",
            "process_resident_memory_bytes",
            "process_open_fds",
            "process_start_time_seconds",
        ):
            assert name in text, name

        head, body = split_response(await http_raw(port, get("/proxyMode")))
        assert head.startswith(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/plain; charset=utf-8\r\n"
            b"X-Content-Type-Options: nosniff\r\n"
        )
        assert body == b"userspace"
        for path in ("/healthz", "/healthz/ping"):  # the apiserver healthz mux, "ping" check
            head, body = split_response(await http_raw(port, get(path)))
            assert head.startswith(b"HTTP/1.1 200 OK\r\n") and body == b"ok"
        head, body = split_response(await http_raw(port, get("/nope")))
        assert head.startswith(b"HTTP/1.1 404 Not Found\r\n") and body == b"404 page not found\n"
    finally:
        await sidecar.stop()


async def test_configz_on_the_metrics_port_says_the_flags_kpx_node_runs_with(
    hub: StateHub,
) -> None:
    """component-base configz's handler: JSON by registered name, any method, no 404.

    kube-proxy registers its internal configuration (Go field names, no
    kind/apiVersion); the values are the flags, here non-default ones.
    """
    parser = argparse.ArgumentParser()
    node.configure(parser)
    args = parser.parse_args([
        "--hostname-override", "node-a", "--conntrack-tcp-timeout-established", "12h",
        "--masquerade-all", "--healthz-bind-address", "127.0.0.1:0",
        "--metrics-bind-address", "127.0.0.1:0",
    ])
    sidecar = wiring.node_sidecar(hub, args)
    await sidecar.start()
    assert sidecar.metrics_address is not None
    port = sidecar.metrics_address[1]
    try:
        for method in ("GET", "POST", "PUT"):  # configz never looks at the method
            head, body = split_response(await http_raw(port, get("/configz", method)))
            assert head == (
                b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                b"X-Content-Type-Options: nosniff\r\nDate: DATE\r\n"
                + f"Content-Length: {len(body)}\r\nConnection: close\r\n".encode()
            ), method
            doc = json.loads(body)
            assert list(doc) == ["kubeproxy.config.k8s.io"]
            config = doc["kubeproxy.config.k8s.io"]
            assert "kind" not in config and "apiVersion" not in config
            assert config["Linux"]["Conntrack"]["TCPEstablishedTimeout"] == "12h0m0s"
            assert config["Linux"]["Conntrack"]["TCPCloseWaitTimeout"] == "1h0m0s"
            assert config["Linux"]["MasqueradeAll"] is True
            assert config["HostnameOverride"] == "node-a"
            assert config["MetricsBindAddress"] == "127.0.0.1:0"  # the flag, as given
            assert config["Mode"] == "userspace"
        head, body = split_response(await http_raw(port, get("/configz", "HEAD")))
        assert head.startswith(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n")
        assert body == b""
    finally:
        await sidecar.stop()


async def test_no_configz_where_nothing_is_registered(hub: StateHub) -> None:
    """``kpx healthz`` registers no configuration: its metrics port has no ``/configz``."""
    sidecar = await start_sidecar(hub)
    assert sidecar.metrics_address is not None
    try:
        head, body = split_response(await http_raw(sidecar.metrics_address[1], get("/configz")))
        assert head.startswith(b"HTTP/1.1 404 Not Found\r\n")
        assert body == b"404 page not found\n"
    finally:
        await sidecar.stop()


async def test_sidecar_follows_the_hub_and_stop_closes_everything(hub: StateHub) -> None:
    hc_port = free_port()
    sidecar = await start_sidecar(hub, nodeport_addresses=["127.0.0.1"])
    healthz = sidecar.healthz_address
    metrics = sidecar.metrics_address
    assert healthz and metrics
    try:
        svc = lb_service(hc_port=hc_port)
        hub.publish(snap([svc], [eps_slice(svc, [ep("10.1.0.1", "node-a")])]))
        raw = await http_raw(hc_port, get())
        assert raw.startswith(b"HTTP/1.1 200 OK\r\n") and b'"localEndpoints": 1' in raw
        hub.publish(snap([svc], [eps_slice(svc, [ep("10.1.0.1", "node-b")])], generation=2))
        raw = await http_raw(hc_port, get())
        assert raw.startswith(b"HTTP/1.1 503 ") and b'"localEndpoints": 0' in raw
        assert hub.health.healthy()
    finally:
        await sidecar.stop()
    for port in (hc_port, healthz[1], metrics[1]):
        assert refuses(port)
    # A stopped sidecar ignores later snapshots (the hub cannot unsubscribe).
    hub.publish(snap([lb_service(hc_port=hc_port)], generation=3))
    assert refuses(hc_port)


async def test_sidecar_retries_a_busy_healthz_port(hub: StateHub) -> None:
    port = free_port()
    squatter = socket.socket()
    squatter.bind(("127.0.0.1", port))
    squatter.listen()
    sidecar = await start_sidecar(
        hub, healthz_bind=("127.0.0.1", port), metrics_bind=None, retry_interval=0.05
    )
    try:
        assert sidecar.healthz_address is None and sidecar.metrics_address is None
        hub.publish(snap(nodes=NODES))
        squatter.close()
        await eventually(lambda: sidecar.healthz_address is not None, timeout=3)
        head, _ = await node_get(sidecar, "/healthz")
        assert head.startswith(b"HTTP/1.1 200 OK")
    finally:
        squatter.close()
        await sidecar.stop()


def test_node_health_document_without_a_server() -> None:
    clock = FakeClock(T0)
    health = ProxyHealth(clock=clock)
    server = NodeHealthServer(health)
    ok, doc = server.document(with_node=True)
    assert not ok and doc["nodeEligible"] is False  # no snapshot yet: node unknown
    Proxier(sync_config("node-a"), health=health).sync(snap())
    ok, doc = server.document(with_node=True)
    assert ok and list(doc) == ["lastUpdated", "currentTime", "nodeEligible", "healthy", "status"]
    assert MetricsServer().proxy_mode == "userspace"
