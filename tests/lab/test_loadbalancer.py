"""The lab's external load balancer: pure rules, the proxy on loopback, and the lab scenarios.

The first half needs no privileges: threshold logic, fail-open, PROXY header
bytes, config defaults, nft scripts, probes and the proxy relay against raw
TCP servers on 127.0.0.1. The ``lab``-marked half drives real namespaces and
``kpx node`` and asserts the three stories of issue 4 exactly.
"""

from __future__ import annotations

import asyncio
import errno
import struct
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from lab import loadbalancer as lbm
from lab import netns as lab_netns
from lab.cluster import NoReply
from lab.common import poll
from lab.demos import wait_node_ports
from lab.loadbalancer import Backend, Health, LBConfig, Probe, observe

# ---------------------------------------------------------------- thresholds


def fold(results: str, healthy: int, unhealthy: int, start: Health | None = None) -> list[str]:
    """Feed a string of ``+``/``-`` probe results; return the state after each."""
    h = start or Health()
    states = []
    for ch in results:
        h = observe(h, ch == "+", healthy, unhealthy)
        states.append(h.state)
    return states


def test_initial_node_joins_after_healthy_threshold_passes() -> None:
    assert fold("+++", 3, 2) == ["initial", "initial", "healthy"]
    assert fold("+", 1, 2) == ["healthy"]


def test_initial_node_is_decided_unhealthy_after_unhealthy_threshold_failures() -> None:
    assert fold("--", 1, 2) == ["initial", "unhealthy"]


def test_only_consecutive_results_count() -> None:
    # A flapping node never crosses a threshold of 2 in either direction.
    assert fold("+-+-+-", 2, 2) == ["initial"] * 6
    healthy = Health("healthy", 5, 0)
    assert fold("-+-+", 1, 2, healthy) == ["healthy"] * 4
    assert fold("--", 1, 2, healthy) == ["healthy", "unhealthy"]


def test_recovery_needs_healthy_threshold_in_a_row() -> None:
    down = Health("unhealthy", 0, 4)
    assert fold("+-++", 2, 2, down) == ["unhealthy", "unhealthy", "unhealthy", "healthy"]


def test_streaks_are_tracked() -> None:
    h = observe(observe(Health(), True, 1, 2), True, 1, 2)
    assert (h.passes, h.fails, h.healthy) == (2, 0, True)
    h = observe(h, False, 1, 2)
    assert (h.passes, h.fails, h.healthy) == (0, 1, True)


NODES = tuple(Backend(f"node{i}", f"10.77.0.{10 + i}") for i in (1, 2, 3))


def test_serving_set_is_the_healthy_nodes_in_spec_order() -> None:
    health = {"node3": Health("healthy"), "node1": Health("healthy"), "node2": Health("unhealthy")}
    assert lbm.serving(NODES, health) == ([NODES[0], NODES[2]], False)


def test_no_healthy_node_fails_open_to_all() -> None:
    assert lbm.serving(NODES, {}) == (list(NODES), True)
    all_down = {b.name: Health("unhealthy") for b in NODES}
    assert lbm.serving(NODES, all_down) == (list(NODES), True)


# ---------------------------------------------------------------- PROXY protocol


def test_proxy_v1_header_bytes() -> None:
    header = lbm.proxy_header("v1", ("10.79.0.100", 51234), ("10.79.0.1", 80))
    assert header == b"PROXY TCP4 10.79.0.100 10.79.0.1 51234 80\r\n"


def test_proxy_v2_header_bytes() -> None:
    header = lbm.proxy_header("v2", ("10.79.0.100", 51234), ("10.79.0.1", 80))
    assert header == (
        b"\x0d\x0a\x0d\x0a\x00\x0d\x0a\x51\x55\x49\x54\x0a"  # the 12-byte signature
        b"\x21"  # version 2, command PROXY
        b"\x11"  # AF_INET, STREAM
        b"\x00\x0c"  # 12 bytes of addresses follow
        b"\x0a\x4f\x00\x64"  # 10.79.0.100
        b"\x0a\x4f\x00\x01"  # 10.79.0.1
        b"\xc8\x22"  # 51234
        b"\x00\x50"  # 80
    )
    assert len(header) == 28


def test_proxy_v6_headers() -> None:
    assert lbm.proxy_header("v1", ("::1", 1), ("::2", 2)) == b"PROXY TCP6 ::1 ::2 1 2\r\n"
    v2 = lbm.proxy_header("v2", ("::1", 1), ("::2", 2))
    assert v2[12:16] == b"\x21\x21\x00\x24" and len(v2) == 16 + 36


def test_no_proxy_header() -> None:
    assert lbm.proxy_header("none", ("1.2.3.4", 1), ("5.6.7.8", 2)) == b""


# ---------------------------------------------------------------- configuration


def resolve(section: dict[str, Any] | None, hc_port: int = 31999) -> LBConfig:
    return lbm.resolve(
        section, node_port=30080, hc_port=hc_port, backends=NODES, status_path="/tmp/x.json"
    )


def test_defaults_probe_the_health_check_node_port() -> None:
    cfg = resolve({"service": "default/web"})
    assert (cfg.mode, cfg.proxy_protocol, cfg.listen_ip, cfg.port) == (
        "passthrough", "none", "10.79.0.1", 80,
    )
    assert cfg.probe == Probe("http", 31999, "/healthz", 1.0, 1.0, 1, 2)
    assert cfg.probe.describe() == "HTTP GET :31999/healthz"


def test_probe_port_names_resolve() -> None:
    assert resolve({"probe": TCP_NODEPORT}).probe.port == 30080
    assert resolve({"probe": {"port": 10256}}).probe.port == 10256
    # eTP=Cluster has no healthCheckNodePort: fall back to kube-proxy's node health.
    cfg = resolve({"probe": {"port": "healthCheckNodePort"}}, hc_port=0)
    assert (cfg.probe.port, cfg.probe.path) == (10256, "/healthz")


def test_bad_sections_list_every_problem() -> None:
    with pytest.raises(ValueError) as e:
        resolve({
            "mode": "dsr", "port": 0, "proxyProtocol": "v3",
            "probe": {"type": "icmp", "port": "x", "interval": 0, "healthyThreshold": 0},
        })
    text = str(e.value)
    for field in ("mode", "port", "proxyProtocol", "probe.type", "probe.port", "probe.interval",
                  "probe.healthyThreshold"):
        assert f"loadBalancer.{field}:" in text


def test_proxy_protocol_needs_proxy_mode() -> None:
    with pytest.raises(ValueError, match="only proxy mode"):
        resolve({"mode": "passthrough", "proxyProtocol": "v1"})
    assert resolve({"mode": "proxy", "proxyProtocol": "v2"}).proxy_protocol == "v2"


def test_config_round_trips_through_json() -> None:
    cfg = resolve({"mode": "proxy", "proxyProtocol": "v1", "probe": {"interval": 0.25}})
    assert LBConfig.from_json(cfg.to_json()) == cfg


# ---------------------------------------------------------------- nftables scripts


def test_ruleset_replaces_the_table_in_one_script() -> None:
    cfg = resolve({})
    script = lbm.nft_ruleset(cfg, [NODES[0], NODES[2]])
    assert script.startswith("table ip kpx_lb\ndelete table ip kpx_lb\n")
    assert (
        "add rule ip kpx_lb prerouting ip daddr 10.79.0.1 tcp dport 80 dnat ip to numgen inc "
        "mod 2 map { 0 : 10.77.0.11 . 30080, 1 : 10.77.0.13 . 30080 }"
    ) in script
    for b in NODES:  # a counter for every node, serving or not...
        assert (
            f"ip daddr {b.ip} tcp dport 30080 "
            # ...counting only connections made to the front: the LB's own probes
            # (a TCP check on the nodePort goes to exactly nodeIP:nodePort) never count.
            "ct original ip daddr 10.79.0.1 ct original proto-dst 80 "
            f'counter name "n_{b.name}"'
        ) in script


def test_update_swaps_only_the_dnat_rule() -> None:
    script = lbm.nft_update(resolve({}), NODES)
    lines = script.splitlines()
    assert lines[0] == "flush chain ip kpx_lb prerouting"
    assert len(lines) == 2 and "mod 3 map" in lines[1]


def test_counter_names_are_identifiers() -> None:
    assert lbm.counter_name("worker-1.a") == "n_worker_1_a"


# ---------------------------------------------------------------- probes and proxy on loopback


async def _server(handler: Any) -> tuple[asyncio.Server, int]:
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


def _probe(kind: str, port: int, timeout: float = 0.3) -> Probe:
    return Probe(kind, port, "/healthz", 0.1, timeout, 1, 2)  # type: ignore[arg-type]


async def test_http_probe_passes_only_on_200() -> None:
    async def answer(code: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 %d X\r\nContent-Length: 0\r\n\r\n" % code)
        await writer.drain()
        writer.close()

    ok_server, ok_port = await _server(lambda r, w: answer(200, r, w))
    bad_server, bad_port = await _server(lambda r, w: answer(503, r, w))
    async with ok_server, bad_server:
        assert await lbm.probe_once(_probe("http", ok_port), "127.0.0.1") == (True, "HTTP 200")
        assert await lbm.probe_once(_probe("http", bad_port), "127.0.0.1") == (False, "HTTP 503")
        # A TCP check only sees an open port: the 503 is never read.
        assert await lbm.probe_once(_probe("tcp", bad_port), "127.0.0.1") == (True, "connected")


async def test_probe_failures_are_named() -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()  # accept and never answer

    server, port = await _server(silent)
    async with server:
        assert await lbm.probe_once(_probe("http", port, 0.2), "127.0.0.1") == (False, "timeout")
    # The server is closed now: nothing listens on that port.
    assert await lbm.probe_once(_probe("tcp", port), "127.0.0.1") == (False, "refused")


@pytest.mark.parametrize(("exc", "name"), [
    (TimeoutError(), "timeout"),
    (ConnectionRefusedError(errno.ECONNREFUSED, "Connection refused"), "refused"),
    (ConnectionResetError(errno.ECONNRESET, "Connection reset by peer"), "reset"),
    (OSError(errno.EHOSTUNREACH, "No route to host"), "unreachable"),
    (asyncio.IncompleteReadError(b"", 10), "closed without an answer"),
    (NoReply("peer closed before the reply"), "closed without an answer"),
    (OSError(errno.EMFILE, "Too many open files"), "too many open files"),
    (ValueError("bad status line"), "error: ValueError: bad status line"),
])
def test_one_namer_for_every_probe_failure(exc: BaseException, name: str) -> None:
    # The LB's health checks and ``kpx lab``'s healthz probes (NoReply) share it.
    assert lbm.describe_error(exc) == name


class RawBackend:
    """A raw TCP server that records every byte a connection sent until EOF."""

    def __init__(self) -> None:
        self.received: list[bytes] = []

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        data = await reader.read()  # until the client's half-close reaches us
        if not data:  # the LB's TCP health check: connect, then close
            writer.close()
            return
        self.received.append(data)
        writer.write(b"reply after half-close")
        await writer.drain()
        writer.close()


@pytest.fixture
async def proxy_lb(tmp_path: Path, request: pytest.FixtureRequest) -> AsyncIterator[Any]:
    backend = RawBackend()
    server, port = await _server(backend.handle)
    cfg = LBConfig(
        service="default/raw", mode="proxy", proxy_protocol=request.param,
        listen_ip="127.0.0.1", port=0, node_port=port,
        probe=_probe("tcp", port), backends=(Backend("node1", "127.0.0.1"),),
        status_path=str(tmp_path / "lb-status.json"),
    )
    lb = lbm.LoadBalancer(cfg)
    stop = asyncio.Event()
    task = asyncio.create_task(lb.run(stop))
    try:
        async with asyncio.timeout(3):
            while not lbm.read_status(tmp_path).get("ready"):
                await asyncio.sleep(0.02)
        yield lb, backend
    finally:
        stop.set()
        await asyncio.wait_for(task, 3)
        server.close()
        await server.wait_closed()


async def _exchange(lb: lbm.LoadBalancer) -> tuple[bytes, tuple[str, int]]:
    host, port = lb.front_address
    reader, writer = await asyncio.open_connection(host, port)
    me = writer.get_extra_info("sockname")[:2]
    writer.write(b"hello")
    writer.write_eof()  # half-close: the answer must still come back
    async with asyncio.timeout(3):
        reply = await reader.read()
    writer.close()
    return reply, me


@pytest.mark.parametrize("proxy_lb", ["none"], indirect=True)
async def test_proxy_relays_with_half_close(proxy_lb: Any) -> None:
    lb, backend = proxy_lb
    reply, _me = await _exchange(lb)
    assert reply == b"reply after half-close"
    assert backend.received == [b"hello"]


@pytest.mark.parametrize("proxy_lb", ["v1"], indirect=True)
async def test_proxy_sends_proxy_v1_header(proxy_lb: Any) -> None:
    lb, backend = proxy_lb
    reply, (cip, cport) = await _exchange(lb)
    _, lport = lb.front_address
    assert reply == b"reply after half-close"
    header = b"PROXY TCP4 %s 127.0.0.1 %d %d\r\n" % (cip.encode(), cport, lport)
    assert backend.received == [header + b"hello"]


@pytest.mark.parametrize("proxy_lb", ["v2"], indirect=True)
async def test_proxy_sends_proxy_v2_header(proxy_lb: Any) -> None:
    lb, backend = proxy_lb
    reply, (_cip, cport) = await _exchange(lb)
    _, lport = lb.front_address
    (data,) = backend.received
    assert data[:16] == lbm.PROXY_V2_SIGNATURE + b"\x21\x11\x00\x0c"
    assert data[16:28] == bytes([127, 0, 0, 1, 127, 0, 0, 1]) + struct.pack("!HH", cport, lport)
    assert data[28:] == b"hello"
    assert reply == b"reply after half-close"


@pytest.mark.parametrize("proxy_lb", ["none"], indirect=True)
async def test_status_file_reports_probe_results(proxy_lb: Any) -> None:
    lb, _backend = proxy_lb
    (node,) = lbm.status(Path(lb.cfg.status_path).parent)
    assert node["name"] == "node1" and node["healthy"] is True
    assert node["result"] == "connected" and node["state"] == "healthy"
    assert node["since"].endswith("Z")


# ---------------------------------------------------------------- the lab scenarios (issue 4)

CLIENT_TIMEOUT = 1.5
HTTP_HC = {"type": "http", "port": "healthCheckNodePort", "path": "/healthz"}
TCP_HC = {"type": "tcp", "port": "healthCheckNodePort"}
TCP_NODEPORT = {"type": "tcp", "port": "nodePort"}
FAST_PROBE = {"interval": 0.3, "timeout": 0.5, "healthyThreshold": 1, "unhealthyThreshold": 2}


def lb_lab_spec(one_pod_spec: Any, probe: dict[str, Any], **lb: Any) -> dict[str, Any]:
    """The seed scenario: LoadBalancer eTP=Local, one pod on node1 of 3, an LB in front."""
    spec = one_pod_spec(lb=True)
    spec["loadBalancer"].update({"mode": "passthrough", **lb, "probe": {**FAST_PROBE, **probe}})
    return spec


def lb_lab(lab_factory: Any, spec: dict[str, Any]) -> Any:
    """A lab that is up, with every node's proxy listening on its nodePorts."""
    lab = lab_factory(spec)
    assert wait_node_ports(lab) == []
    return lab


def wait_status(lab: Any, key: str, expected: Any, timeout: float = 5.0) -> dict[str, Any]:
    """Poll the LB's status until its *key* is *expected*; the last status document read."""
    last: dict[str, Any] = {}

    def reached() -> bool:
        last["doc"] = lbm.read_status(lab.run_dir)
        return last["doc"].get(key) == expected

    poll(reached, timeout)
    return last["doc"]


def wait_serving(lab: Any, expected: list[str], timeout: float = 5.0) -> dict[str, Any]:
    """Poll the LB's status until its rotation is *expected*; return the status document."""
    doc = wait_status(lab, "serving", expected, timeout)
    assert doc.get("serving") == expected, doc
    return doc


def verdicts(doc: dict[str, Any]) -> dict[str, tuple[bool, str]]:
    """``{node: (healthy, last check result)}`` from an LB status document."""
    return {n["name"]: (n["healthy"], n["result"]) for n in doc["nodes"]}


def routed(lab: Any, src: str = "client") -> tuple[str, dict[str, Any] | str]:
    """One request through the LB front: (node the LB chose, reply or error name).

    The LB's per-node nft counters are read around the request, so the test
    knows where the LB sent a connection even when that node never answers.
    """
    before = lbm.connection_counts(lab)
    ip, port = lab.lb_address()
    try:
        outcome: dict[str, Any] | str = lab.request(src, ip, port, timeout=CLIENT_TIMEOUT)
    except OSError as e:  # TimeoutError, ConnectionRefusedError, ConnectionResetError
        outcome = type(e).__name__
    after = lbm.connection_counts(lab)
    chosen = [n for n in after if after[n] != before.get(n)]
    assert len(chosen) == 1, (before, after)
    return chosen[0], outcome


@pytest.mark.lab
def test_http_checks_on_hc_port_send_traffic_only_to_the_node_with_the_pod(
    lab_factory: Any, one_pod_spec: Any
) -> None:
    lab = lb_lab(lab_factory, lb_lab_spec(one_pod_spec, HTTP_HC))
    doc = wait_serving(lab, ["node1"])
    assert verdicts(doc) == {"node1": (True, "HTTP 200"), "node2": (False, "HTTP 503"),
                             "node3": (False, "HTTP 503")}
    assert doc["failOpen"] is False
    outcomes = [routed(lab) for _ in range(6)]
    # Every client request succeeds, and all of them went to node1.
    assert [node for node, _ in outcomes] == ["node1"] * 6
    for _node, reply in outcomes:
        assert isinstance(reply, dict), reply
        assert (reply["pod"], reply["node"]) == ("web-1", "node1")
    assert [n["name"] for n in lbm.status(lab.run_dir)] == ["node1", "node2", "node3"]


@pytest.mark.lab
def test_passthrough_lets_the_pod_see_the_client_ip(lab_factory: Any, one_pod_spec: Any) -> None:
    lab = lb_lab(lab_factory, lb_lab_spec(one_pod_spec, HTTP_HC))
    wait_serving(lab, ["node1"])
    ip, port = lab.lb_address()
    assert (ip, port) == ("10.79.0.1", 80)
    reply = lab.request("client", ip, port, timeout=CLIENT_TIMEOUT)
    assert reply["peer"].rsplit(":", 1)[0] == lab.client_ip == "10.79.0.100"


@pytest.mark.lab
def test_tcp_checks_on_hc_port_pass_every_node_and_podless_nodes_time_out(
    lab_factory: Any, one_pod_spec: Any
) -> None:
    """The seed misconfiguration: the hc port is always open, so the 503 is never read."""
    lab = lb_lab(lab_factory, lb_lab_spec(one_pod_spec, TCP_HC))
    doc = wait_serving(lab, ["node1", "node2", "node3"])
    assert verdicts(doc) == {f"node{i}": (True, "connected") for i in (1, 2, 3)}
    outcomes = [routed(lab) for _ in range(6)]
    chosen = [node for node, _ in outcomes]
    # Round-robin over the three passing nodes: each gets every third connection.
    assert sorted(chosen) == ["node1", "node1", "node2", "node2", "node3", "node3"]
    assert chosen[:3] == chosen[3:]
    for node, outcome in outcomes:
        if node == "node1":
            assert isinstance(outcome, dict) and outcome["node"] == "node1", outcome
        else:
            assert outcome == "TimeoutError", (node, outcome)  # dropped SYN: not refused


@pytest.mark.lab
def test_nodeport_checks_fail_podless_nodes_by_timeout_but_localhost_works(
    lab_factory: Any, one_pod_spec: Any
) -> None:
    lab = lb_lab(lab_factory, lb_lab_spec(one_pod_spec, TCP_NODEPORT))
    doc = wait_serving(lab, ["node1"])
    assert verdicts(doc) == {"node1": (True, "connected"), "node2": (False, "timeout"),
                             "node3": (False, "timeout")}
    # The LB's counters count client connections only: its TCP checks go to
    # exactly nodeIP:nodePort, yet several probe rounds move no counter.
    p = FAST_PROBE
    idle = lbm.connection_counts(lab)
    time.sleep(3 * max(p["interval"], p["timeout"]))
    assert lbm.connection_counts(lab) == idle
    port = lab.node_port("default/web")
    probe = (
        "import asyncio, sys; from lab.loadbalancer import Probe, probe_once; "
        f"print(asyncio.run(probe_once(Probe('tcp', {port}, '/', 1, 1.0, 1, 1), '127.0.0.1')))"
    )
    for node in ("node2", "node3"):
        # The very probe the LB runs succeeds from inside the node, against localhost...
        proc = lab.run(node, [sys.executable, "-c", probe], timeout=10)
        assert proc.stdout.strip() == "(True, 'connected')", proc.stderr
        # ...and localhost:nodePort reaches the pod on node1 (Cluster semantics).
        reply = lab.request(node, "127.0.0.1", port, timeout=CLIENT_TIMEOUT)
        assert (reply["pod"], reply["node"]) == ("web-1", "node1")
    assert [routed(lab)[0] for _ in range(3)] == ["node1"] * 3


@pytest.mark.lab
@pytest.mark.parametrize("header", [None, "v1", "v2"])
def test_proxy_mode_node_sees_the_lb_ip(
    lab_factory: Any, one_pod_spec: Any, header: str | None
) -> None:
    lab = lb_lab(lab_factory, lb_lab_spec(
        one_pod_spec, HTTP_HC,
        mode="proxy", proxyProtocol=header,
    ))
    wait_serving(lab, ["node1"])
    ip, port = lab.lb_address()
    for _ in range(3):
        reply = lab.request("client", ip, port, timeout=CLIENT_TIMEOUT)
        assert (reply["pod"], reply["node"]) == ("web-1", "node1")
        assert reply["peer"].rsplit(":", 1)[0] == "10.77.0.2"  # the LB, not the client
        if header is None:
            assert "proxy" not in reply
        else:  # the echo pod parses the PROXY header: the client survives in it
            assert reply["proxy"].rsplit(":", 1)[0] == lab.client_ip


@pytest.mark.lab
def test_lb_follows_a_moved_pod_and_a_changed_node_port(
    lab_factory: Any, one_pod_spec: Any
) -> None:
    lab = lb_lab(lab_factory, lb_lab_spec(one_pod_spec, HTTP_HC))
    wait_serving(lab, ["node1"])
    pid = lbm.read_status(lab.run_dir)["pid"]
    lab.move_pod("web-1", "node2")
    wait_serving(lab, ["node2"], timeout=10)
    assert routed(lab)[0] == "node2"

    svc = lab.service("default/web")
    svc["spec"]["ports"][0]["nodePort"] = 30999
    lab.update_service(svc)  # on_apply: new config, SIGHUP, same daemon
    doc = wait_status(lab, "nodePort", 30999, timeout=10)
    # The probe (HTTP on the hc port) did not change, so the verdicts carried over:
    # the reloaded LB's very first status already serves node2 alone, never failing open.
    assert (doc["pid"], doc["nodePort"], doc["serving"], doc["failOpen"]) == (
        pid, 30999, ["node2"], False,
    ), doc
    node, reply = routed(lab)
    assert node == "node2" and isinstance(reply, dict) and reply["node"] == "node2"


@pytest.mark.lab
def test_lab_down_stops_the_lb_and_removes_its_namespace(
    lab_factory: Any, one_pod_spec: Any
) -> None:
    lab = lb_lab(lab_factory, lb_lab_spec(one_pod_spec, HTTP_HC))
    handle = lab.lb_handle
    assert handle is not None and handle.alive()
    ns = lab.ns("lb")
    lab.down()
    assert not handle.alive()
    assert ns not in lab_netns.list_namespaces()
