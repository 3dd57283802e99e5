"""kube-proxy's NodePort semantics, proven on real namespaces (issue 2, lab cases 1-10).

Each test builds a small lab (3 nodes, echo pods, one ``kpx node`` per node
fed by the shared state file) through ``lab_factory``, which removes every
namespace afterwards, pass or fail. Behaviour is observed from the outside:
the pod's reply says which pod answered and which peer address it saw; a
plain connect says ok/refused/timeout; scapy in the client namespace says
whether a SYN got a SYN-ACK, an RST, or nothing; ``ss`` says what listens.

Waiting is always a poll with a deadline: "the proxies applied the change"
is their log showing a newer state generation, and "behaviour changed
within 1 s" is timed from the state file's mtime to the first probe that
saw it.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import re
import socket
import time
from collections.abc import Callable
from functools import cache
from typing import Any

import pytest
import yaml

from lab import Lab, netns
from lab.common import wait_until, write_atomic
from lab.statefile import render
from tests.support.labkit import (
    CLIENT_IP,
    POD_PORT,
    connect_outcome,
    generations,
    in_every_proxy_mode,
    lab_spec,
    logs,
    mode_of,
    over_both_families,
    peer_ip,
    poll_change,
    service,
    timed_connects,
    wait_applied,
    wait_log,
    who,
)
from tests.support.probes import ss_listening, syn_answers

LabFactory = Callable[..., Lab]
SpecFactory = Callable[..., dict[str, Any]]

MiB = 1 << 20
DROP_WINDOW = 1.5
"""Seconds a dropped SYN must stay unanswered (scapy sniff, plain connect timeout)."""
CHANGE_LIMIT = 1.0
"""Issue 2: a state-file change applies to new connections within 1 second."""


lab_factory = in_every_proxy_mode()


def up(lab_factory: LabFactory, spec: dict[str, Any], **kw: Any) -> Lab:
    """A lab whose every proxy has applied its first state."""
    lab = lab_factory(spec, **kw)
    wait_applied(lab)
    return lab


@cache
def payload_64mib() -> bytes:
    return os.urandom(64 * MiB)


# ------------------------------------------------------------------ 1. eTP=Cluster


@pytest.mark.lab
@over_both_families
def test_cluster_policy_every_node_answers_and_only_cross_node_hops_snat(
        lab_factory: LabFactory, one_pod_spec: SpecFactory) -> None:
    """eTP=Cluster: every node's nodeIP:nodePort reaches the one pod on node1.

    Cross-node hops are SNATed (the pod sees the forwarding node's IP); the
    same-node hop keeps the client IP (kpx decision 3, Cilium-style).
    """
    lab = up(lab_factory, one_pod_spec(etp="Cluster", node="node1"))
    port = lab.node_port("default/web")
    for node in lab.nodes:
        reply, _ = who(lab, "client", lab.node_ip(node), port)
        assert reply["pod"] == "web-1", node
        expected = lab.client_ip if node == "node1" else lab.node_ip(node)
        assert peer_ip(reply) == expected, f"through {node} the pod saw {reply['peer']}"


# ------------------------------------------------------------------ 2. eTP=Local


@pytest.mark.lab
@over_both_families
def test_local_policy_preserves_client_ip_and_podless_nodes_drop(
        lab_factory: LabFactory, one_pod_spec: SpecFactory) -> None:
    """eTP=Local: the pod's node answers with the client IP kept; other nodes DROP.

    DROP (kube-proxy 1b, kpx decision 1) is silence: a SYN gets neither
    SYN-ACK nor RST, so the client's connect times out rather than being
    refused. The SYN-ACK scapy sees from node1 in the same capture shows
    the capture itself works.
    """
    lab = up(lab_factory, one_pod_spec(etp="Local", node="node1"))
    port = lab.node_port("default/web")
    reply, _ = who(lab, "client", lab.node_ip("node1"), port)
    assert reply["pod"] == "web-1"
    assert peer_ip(reply) == lab.client_ip

    targets = {n: (lab.node_ip(n), port) for n in lab.nodes}
    tcp, icmp = syn_answers(lab.ns("client"), targets.values(), window=DROP_WINDOW)
    answered = {n: tcp[f"{ip}:{p}"] for n, (ip, p) in targets.items()}
    assert "SA" in answered["node1"], f"no SYN-ACK from node1: {answered}"
    assert answered["node2"] == [] and answered["node3"] == [], \
        f"dropping nodes answered the SYN: {answered}\n{logs(lab)}"
    assert icmp == []

    outcomes = timed_connects(lab, "client", [targets["node2"], targets["node3"]], DROP_WINDOW)
    for target, (outcome, seconds) in outcomes.items():
        assert outcome == "timeout", f"{target}: {outcome} after {seconds:.2f}s (want timeout)"
        assert seconds >= DROP_WINDOW * 0.9
    with lab.socket("client") as s, pytest.raises(TimeoutError):
        s.settimeout(DROP_WINDOW)
        s.connect(targets["node2"])


# ------------------------------------------------------------------ 3. no endpoints


@pytest.mark.lab
@over_both_families
def test_service_without_usable_endpoints_is_refused_at_once(lab_factory: LabFactory) -> None:
    """No usable endpoint anywhere: REJECT, i.e. RST to the SYN and ECONNREFUSED at once.

    Two such services: one selecting no pod, one whose only pod is not
    ready. kpx decision 2: there is no LISTEN socket at all (never
    accept-then-close), on any node or on 127.0.0.1.
    """
    unready = {"name": "lonely-1", "node": "node2", "labels": {"app": "lonely"},
               "port": POD_PORT, "ready": False}
    lab = up(lab_factory, lab_spec({"web-1": "node1"}, service("web"),
                                    service("empty", app="nothing"),
                                    service("lonely", app="lonely"), extra_pods=[unready]))
    good = lab.node_port("default/web")
    rejecting = [lab.node_port("default/empty"), lab.node_port("default/lonely")]

    for node in lab.nodes:
        for port in rejecting:
            assert ss_listening(port, lab.ns(node)) == [], f"{node} listens on {port}"
            t0 = time.monotonic()
            with lab.socket("client") as s, pytest.raises(ConnectionRefusedError):
                s.settimeout(3.0)
                s.connect((lab.node_ip(node), port))
            assert time.monotonic() - t0 < 0.5, "refusal must be immediate"
            assert connect_outcome(lab, node, lab.localhost, port, 1.0) == "refused"

    targets = [(lab.node_ip(n), p) for n in lab.nodes for p in rejecting]
    tcp, _ = syn_answers(lab.ns("client"), [*targets, (lab.node_ip("node1"), good)],
                         window=1.0)
    assert "SA" in tcp[f"{lab.node_ip('node1')}:{good}"], f"capture saw no SYN-ACK: {tcp}"
    for ip, port in targets:
        assert tcp[f"{ip}:{port}"] == ["RA"], f"{ip}:{port} answered {tcp[f'{ip}:{port}']}"


# ------------------------------------------------------------------ 4. localhost


@pytest.mark.lab
@over_both_families
def test_localhost_nodeport_works_on_a_node_without_local_endpoints(
        lab_factory: LabFactory, one_pod_spec: SpecFactory, family: int) -> None:
    """eTP=Local, no pod on node2: node2 reaching its own NodePort gets Cluster semantics.

    127.0.0.1:nodePort and node2's own IP both reach the pod on node1,
    SNATed to node2's address (kube-proxy 1d, kpx decision 5), while the
    external client is still dropped there: the "works from the node,
    fails its external check" seed scenario.

    Over IPv6, node2's own address does the same, and ``::1`` is refused at
    once: iptables mode serves no IPv6 localhost NodePort (README).
    """
    lab = up(lab_factory, one_pod_spec(etp="Local", node="node1"))
    port = lab.node_port("default/web")
    node2 = lab.node_ip("node2")
    for dst in ("127.0.0.1", node2):
        reply = lab.request("node2", dst, port)
        assert reply["pod"] == "web-1", dst
        assert peer_ip(reply) == lab.node_ip("node2", 4 if dst == "127.0.0.1" else family), \
            f"via {dst} the pod saw {reply['peer']}"
    assert connect_outcome(lab, "client", node2, port, 1.0) == "timeout"
    if family == 6:
        t0 = time.monotonic()
        assert connect_outcome(lab, "node2", "::1", port, 1.0) == "refused"
        assert time.monotonic() - t0 < 0.5, "::1 must be refused at the SYN"


# ------------------------------------------------------------------ 5. terminating


def slice_conditions(lab: Lab, pod: str) -> dict[str, bool]:
    """The EndpointSlice conditions the state file publishes for ``pod``."""
    for doc in yaml.safe_load_all(lab.state_path.read_text()):
        if doc and doc.get("kind") == "EndpointSlice":
            for ep in doc.get("endpoints") or []:
                if (ep.get("targetRef") or {}).get("name") == pod:
                    return dict(ep.get("conditions") or {})
    raise AssertionError(f"no endpoint for {pod} in the state file")


TERMINATING = {"ready": False, "serving": True, "terminating": True}


@pytest.mark.lab
def test_cluster_falls_back_to_a_terminating_endpoint(
        lab_factory: LabFactory, one_pod_spec: SpecFactory) -> None:
    """eTP=Cluster: with no ready endpoint left, serving-terminating ones are used.

    CategorizeEndpoints' fallback: the deleted pod (in its grace period) is
    still reached through every node instead of the service being rejected.
    """
    lab = up(lab_factory, one_pod_spec(etp="Cluster", node="node1"))
    port = lab.node_port("default/web")
    before = generations(lab)
    lab.delete_pod("web-1", grace=120)
    wait_applied(lab, before)
    assert lab.pod_terminating("web-1")
    assert slice_conditions(lab, "web-1") == TERMINATING
    for node in ("node2", "node3", "node1"):
        reply, _ = who(lab, "client", lab.node_ip(node), port)
        assert reply["pod"] == "web-1", node
    reply, _ = who(lab, "client", lab.node_ip("node2"), port)
    assert peer_ip(reply) == lab.node_ip("node2")


@pytest.mark.lab
def test_local_prefers_a_local_terminating_endpoint_over_remote_ready_ones(
        lab_factory: LabFactory, one_pod_spec: SpecFactory) -> None:
    """eTP=Local: a node whose only local pod is terminating keeps serving with it.

    The local fallback applies even though a ready pod exists on node2:
    external traffic must not leave the node (client IP kept), so node1 uses
    its terminating pod rather than dropping.
    """
    spec = one_pod_spec(etp="Local", node="node1")
    spec["pods"].append({"name": "web-2", "node": "node2", "labels": {"app": "web"},
                         "port": POD_PORT})
    lab = up(lab_factory, spec)
    port = lab.node_port("default/web")
    before = generations(lab)
    lab.delete_pod("web-1", grace=120)
    wait_applied(lab, before)
    assert slice_conditions(lab, "web-1") == TERMINATING
    for _ in range(4):
        reply, _ = who(lab, "client", lab.node_ip("node1"), port)
        assert reply["pod"] == "web-1"
        assert peer_ip(reply) == CLIENT_IP
    reply, _ = who(lab, "client", lab.node_ip("node2"), port)
    assert reply["pod"] == "web-2"


# ------------------------------------------------------------------ 6. affinity


AFFINITY_TIMEOUT = 2


@pytest.mark.lab
def test_client_ip_affinity_sticks_expires_and_switches_off(lab_factory: LabFactory) -> None:
    """sessionAffinity=ClientIP pins a client to one pod until timeoutSeconds of idleness.

    As the conformance tests: 15 connections land on one pod. Once the
    affinity timeout has passed with no new connection, the next one is
    re-picked; round-robin has moved its cursor on, so a different pod
    answers. Switching the same service's affinity off spreads the client
    over the pods again.
    """
    affinity = {"sessionAffinity": "ClientIP",
                "sessionAffinityConfig": {"clientIP": {"timeoutSeconds": AFFINITY_TIMEOUT}}}
    lab = up(lab_factory, lab_spec({"web-1": "node1", "web-2": "node2", "web-3": "node3"},
                                   service("web", **affinity)))
    ip = lab.node_ip("node1")
    port = lab.node_port("default/web")

    pods = []
    for _ in range(15):
        reply, _ = who(lab, "client", ip, port)
        pods.append(reply["pod"])
    last = time.monotonic()
    assert len(set(pods)) == 1, f"affinity broken: {pods}"
    pinned = pods[0]

    repicked = []
    for _ in range(3):  # bounded: each round waits out the timeout once
        expired_at = last + AFFINITY_TIMEOUT + 0.2
        while (now := time.monotonic()) < expired_at:
            time.sleep(expired_at - now)
        reply, _ = who(lab, "client", ip, port)
        last = time.monotonic()
        repicked.append(reply["pod"])
        if reply["pod"] != pinned:
            break
    assert repicked[-1] != pinned, f"no re-pick after the timeout: pinned {pinned}, got {repicked}"

    before = generations(lab)
    lab.update_service(service("web"))
    wait_applied(lab, before)
    assert lab.node_port("default/web") == port
    spread = [who(lab, "client", ip, port)[0]["pod"] for _ in range(15)]
    assert len(set(spread)) >= 2, f"no spreading with affinity off: {spread}"


# ------------------------------------------------------------------ 7. live changes


@pytest.mark.serial
@pytest.mark.lab
@over_both_families
def test_state_file_changes_apply_within_a_second_and_delete_leaves_no_listener(
        lab_factory: LabFactory, one_pod_spec: SpecFactory) -> None:
    """Edits to the watched state file reach new connections within 1 s, without restart.

    Adding a pod opens a dropping node; flipping Local->Cluster opens a
    podless node, Cluster->Local drops it again; deleting the service
    closes every listener (``ss`` shows no LISTEN socket, connects are
    refused), as the "should release NodePorts on delete" e2e test wants.
    """
    spec = one_pod_spec(etp="Local", node="node1")
    lab = up(lab_factory, spec)
    port = lab.node_port("default/web")
    ip = {n: lab.node_ip(n) for n in lab.nodes}
    assert connect_outcome(lab, "client", ip["node2"], port, 0.3) == "timeout"
    assert connect_outcome(lab, "client", ip["node3"], port, 0.3) == "timeout"

    def answers(node: str, pod: str | None = None) -> Callable[[], bool]:
        def probe() -> bool:
            try:
                reply, _ = who(lab, "client", ip[node], port, timeout=0.25)
            except OSError:
                return False
            return pod is None or reply["pod"] == pod
        return probe

    def drops(node: str) -> Callable[[], bool]:
        return lambda: connect_outcome(lab, "client", ip[node], port, 0.3) == "timeout"

    def refused(node: str) -> Callable[[], bool]:
        return lambda: connect_outcome(lab, "client", ip[node], port, 0.3) == "refused"

    timings: dict[str, float] = {}

    lab.add_pod("web-2", "node2", {"app": "web"})
    timings["add pod"] = poll_change(lab, answers("node2", "web-2"), "node2 answering")
    reply, _ = who(lab, "client", ip["node2"], port)
    assert (reply["pod"], peer_ip(reply)) == ("web-2", lab.client_ip)

    svc = copy.deepcopy(spec["services"][0])
    svc["spec"]["externalTrafficPolicy"] = "Cluster"
    lab.update_service(svc)
    assert lab.node_port("default/web") == port
    timings["Local->Cluster"] = poll_change(lab, answers("node3"), "node3 answering")
    reply, _ = who(lab, "client", ip["node3"], port)
    assert peer_ip(reply) == ip["node3"]

    svc["spec"]["externalTrafficPolicy"] = "Local"
    lab.update_service(svc)
    timings["Cluster->Local"] = poll_change(lab, drops("node3"), "node3 dropping")
    # A short timeout could mistake a slow answer for a drop: confirm with a long one.
    assert connect_outcome(lab, "client", ip["node3"], port, DROP_WINDOW) == "timeout"
    reply, _ = who(lab, "client", ip["node1"], port)
    assert peer_ip(reply) == lab.client_ip

    lab.delete_service("default/web")
    timings["delete"] = poll_change(lab, refused("node1"), "node1 refusing")

    print(f"state change -> behaviour change: {timings}")
    slow = {k: round(v, 3) for k, v in timings.items() if v >= CHANGE_LIMIT}
    assert not slow, f"changes slower than {CHANGE_LIMIT}s: {slow} (all: {timings})\n{logs(lab)}"
    for node in lab.nodes:
        assert ss_listening(port, lab.ns(node)) == [], f"{node} still listens on {port}"
        assert connect_outcome(lab, "client", ip[node], port, 1.0) == "refused", node
        assert connect_outcome(lab, node, lab.localhost, port, 1.0) == "refused", node


# ------------------------------------------------------------------ 8. half-close, volume


def read_to_eof(s: socket.socket) -> bytes:
    chunks = []
    while chunk := s.recv(1 << 16):
        chunks.append(chunk)
    return b"".join(chunks)


@pytest.mark.lab
@over_both_families
@pytest.mark.parametrize("via", ["node1", "node2"], ids=["transparent-same-node",
                                                         "snat-cross-node"])
def test_half_close_and_64mib_pass_intact(
        lab_factory: LabFactory, one_pod_spec: SpecFactory, via: str) -> None:
    """Relaying is byte-exact and propagates half-close (shutdown(SHUT_WR)) both ways.

    SINK: the client sends 64 MiB, shuts its write side, and can only get
    the pod's byte count and sha256 if the proxy forwarded the FIN while
    keeping the reverse direction open. ECHO: 64 MiB come back intact and
    the pod's own half-close ends the stream. Through node1 the relay is
    transparent (the pod sees the client), through node2 it is SNAT.
    """
    lab = up(lab_factory, one_pod_spec(etp="Cluster", node="node1"))
    port = lab.node_port("default/web")
    ip = lab.node_ip(via)
    expected_peer = lab.client_ip if via == "node1" else ip
    data = payload_64mib()
    digest = hashlib.sha256(data).hexdigest()

    with lab.socket("client") as s:
        s.settimeout(15)
        s.connect((ip, port))
        s.sendall(b"SINK\n")
        s.sendall(data)
        s.shutdown(socket.SHUT_WR)
        raw = read_to_eof(s)
    assert raw.endswith(b"\n") and raw.count(b"\n") == 1, raw[:200]
    reply = json.loads(raw)
    assert (reply["pod"], peer_ip(reply)) == ("web-1", expected_peer)
    assert (reply["bytes"], reply["sha256"]) == (len(data), digest)

    echoed = lab.request("client", ip, port, "ECHO", data, timeout=15)
    assert echoed["bytes"] == len(data)
    assert echoed["sha256"] == digest


# ------------------------------------------------------------------ 9. failures


def hold(lab: Lab, ip: str, port: int) -> socket.socket:
    """A connection the pod answered once and now never reads (HOLD), with data queued."""
    s = netns.socket_in(lab.ns("client"))
    try:
        s.settimeout(5)
        s.connect((ip, port))
        s.sendall(b"HOLD\n")
        buf = b""
        while not buf.endswith(b"\n"):
            chunk = s.recv(4096)
            assert chunk, "EOF before the HOLD reply"
            buf += chunk
        assert json.loads(buf)["pod"] == "web-1"
        # Sent only after the reply: the pod has stopped reading, so these
        # bytes stay in its kernel receive queue and its death is an RST.
        s.sendall(b"x" * 16384)
    except BaseException:
        s.close()
        raise
    return s


def unread_queues(lab: Lab, pod: str) -> int:
    """How many of the pod's established connections have unread bytes (Recv-Q > 0)."""
    out = lab.run(pod, ["ss", "-tnH", "state", "established", f"( sport = :{POD_PORT} )"],
                  timeout=10, check=True).stdout
    return sum(1 for line in out.splitlines() if line.split() and int(line.split()[0]) > 0)


@pytest.mark.lab
def test_killed_backend_resets_the_client(
        lab_factory: LabFactory, one_pod_spec: SpecFactory) -> None:
    """A backend that dies mid-connection RSTs the proxy, and the proxy RSTs the client.

    An RST is passed on as an RST (not turned into a clean EOF), on both the
    transparent (node1) and the SNAT (node2) relay.
    """
    lab = up(lab_factory, one_pod_spec(etp="Cluster", node="node1"))
    port = lab.node_port("default/web")
    socks = {via: hold(lab, lab.node_ip(via), port) for via in ("node1", "node2")}
    try:
        wait_until(lambda: unread_queues(lab, "web-1") >= 2, 5, 0.02,
                   what="the held bytes to reach the pod")
        lab.kill_pod("web-1")
        for via, s in socks.items():
            s.settimeout(3.0)
            t0 = time.monotonic()
            with pytest.raises(ConnectionResetError):
                while True:
                    assert s.recv(4096) != b"", f"via {via}: clean EOF instead of a reset"
            assert time.monotonic() - t0 < 3.0
    finally:
        for s in socks.values():
            s.close()


@pytest.mark.lab
def test_refused_backend_is_retried_on_another_endpoint(lab_factory: LabFactory) -> None:
    """A connect failure tries another eligible endpoint (kpx decision 7) and is logged.

    web-1's server is killed, so its port refuses while its endpoint stays
    published. Every request still succeeds, on web-2, and each proxy logs
    the failure naming the service, the endpoint and the client.

    nfqueue mode cannot pass this, by design: the SYN is DNATed to the
    endpoint kpx chose and nothing relays, so the endpoint's RST reaches the
    client, as in kube-proxy's iptables and nftables modes. There the test
    asserts that instead: round robin alternates, every other connect is
    refused at once, the rest reach web-2.
    """
    lab = up(lab_factory, lab_spec({"web-1": "node1", "web-2": "node2"}, service("web")))
    port = lab.node_port("default/web")
    dead = f"{lab.pod_ip('web-1')}:{POD_PORT}"
    lab.kill_pod("web-1")
    assert connect_outcome(lab, "node1", lab.pod_ip("web-1"), POD_PORT, 1.0) == "refused"
    if mode_of(lab_factory) == "nfqueue":
        outcomes = [connect_outcome(lab, "client", lab.node_ip("node1"), port, 1.0)
                    for _ in range(6)]
        assert sorted(outcomes) == ["ok"] * 3 + ["refused"] * 3, outcomes
        return

    marks = {n: len(lab.proxy_log(n)) for n in lab.nodes}
    clients: dict[str, set[int]] = {"node1": set(), "node3": set()}
    for _ in range(4):
        for via in clients:
            reply, local = who(lab, "client", lab.node_ip(via), port)
            assert reply["pod"] == "web-2", via
            clients[via].add(local[1])

    for via, ports in clients.items():
        rx = re.compile(rf"default/web(:http)?: connect to endpoint {re.escape(dead)} for client "
                        rf"{re.escape(CLIENT_IP)}:(\d+) failed \(Connection refused")
        found = wait_log(lab, via, rx, since=marks[via])
        logged = {int(m.group(2)) for m in found}
        assert logged <= ports, f"{via} logged clients {logged}, ours were {ports}"


# ------------------------------------------------------------------ 10. malformed state


@pytest.mark.serial
@pytest.mark.lab
def test_malformed_state_is_refused_with_a_clear_message_and_the_last_good_state_serves(
        lab_factory: LabFactory, one_pod_spec: SpecFactory) -> None:
    """A bad state file is refused whole, each problem named by object and field.

    The previous state (eTP=Local: node1 answers with the client IP, node2
    drops) stays in force through each bad write, although every bad file
    also flips the service to Cluster. Writing the fixed file applies it.
    """
    lab = up(lab_factory, one_pod_spec(etp="Local", node="node1"))
    port = lab.node_port("default/web")
    ip1, ip2 = lab.node_ip("node1"), lab.node_ip("node2")
    docs = [d for d in yaml.safe_load_all(lab.state_path.read_text()) if d]
    for d in docs:
        if d["kind"] == "Service":
            d["spec"]["externalTrafficPolicy"] = "Cluster"
            d["spec"].pop("healthCheckNodePort", None)
    fixed = render(docs)

    def broken(edit: Callable[[list[dict[str, Any]]], None]) -> str:
        bad = copy.deepcopy(docs)
        edit(bad)
        return render(bad)

    def kind(ds: list[dict[str, Any]], k: str) -> dict[str, Any]:
        return next(d for d in ds if d["kind"] == k)

    def port_out_of_range(ds: list[dict[str, Any]]) -> None:
        kind(ds, "Service")["spec"]["ports"][0]["port"] = 70000

    def no_addresses(ds: list[dict[str, Any]]) -> None:
        del kind(ds, "EndpointSlice")["endpoints"][0]["addresses"]

    def duplicate_node_port(ds: list[dict[str, Any]]) -> None:
        twin = copy.deepcopy(kind(ds, "Service"))
        twin["metadata"]["name"] = "twin"
        ds.append(twin)

    slice_name = kind(docs, "EndpointSlice")["metadata"]["name"]
    cases = [
        (broken(port_out_of_range), r"Service default/web: spec\.ports\[0\]\.port: .*70000"),
        (broken(no_addresses),
         rf"EndpointSlice default/{re.escape(slice_name)}: endpoints\[0\]\.addresses: "),
        (broken(duplicate_node_port),
         rf"Service default/twin: spec\.ports\[0\]\.nodePort: .*{port}"),
        (fixed + "---\nkind: [unclosed\n", r"YAML syntax error at line \d+"),
    ]
    for text, message in cases:
        marks = {n: len(lab.proxy_log(n)) for n in lab.nodes}
        before = generations(lab)
        write_atomic(lab.state_path, text)
        for node in lab.nodes:
            wait_log(lab, node, r"state file \S+ refused \(\d+ problems?\)", since=marks[node])
            wait_log(lab, node, message, since=marks[node])
        assert generations(lab) == before, f"a bad file was applied ({message})"
        reply, _ = who(lab, "client", ip1, port)
        assert (reply["pod"], peer_ip(reply)) == ("web-1", CLIENT_IP), message
        assert connect_outcome(lab, "client", ip2, port, 0.5) == "timeout", message

    write_atomic(lab.state_path, fixed)

    def node2_answers() -> bool:
        try:
            who(lab, "client", ip2, port, timeout=0.25)
        except OSError:
            return False
        return True

    elapsed = poll_change(lab, node2_answers, "node2 answering after the fix")
    assert elapsed < CHANGE_LIMIT, f"the fixed file took {elapsed:.2f}s"
    reply, _ = who(lab, "client", ip2, port)
    assert (reply["pod"], peer_ip(reply)) == ("web-1", ip2)


# ------------------------------------------------------------------ 11. modes


@pytest.mark.lab
def test_the_proxy_mode_in_use_is_reported(lab_factory: LabFactory,
                                           one_pod_spec: SpecFactory) -> None:
    """``/proxyMode`` on the metrics port says which dataplane serves (kube-proxy's endpoint)."""
    lab = up(lab_factory, one_pod_spec(etp="Cluster", node="node1"))
    assert lab.metrics_port is not None
    status, body = lab.http_get("node1", "127.0.0.1", lab.metrics_port, "/proxyMode")
    assert (status, body.decode()) == (200, mode_of(lab_factory))
