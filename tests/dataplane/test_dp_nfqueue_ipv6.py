"""Mode nfqueue over IPv6 (issue 14): a real ``kpx node --proxy-mode nfqueue`` on the wire.

The topology is ``tests.support.netns.Topology`` (client -- node -- {pod1,
pod2}, each its own namespace, removed pass or fail) with a ULA IPv6 address
beside every IPv4 one (``add_ipv6``) and IPv6 forwarding on in the node. kpx
runs in the node's namespace from a state file, as the lab runs it; its Node
has both families, so the sync hands the dataplane an IPv6 result too. The
pods answer ``PEER`` with the address they see, over both families.

pod1 is an endpoint on this node (``NODE``), pod2 one that the slices place
on another node (``OTHER``), so that a Cluster-policy connection to it is
masqueraded as a cross-node hop is, while one to pod1 keeps the client's
address. Nothing touches the initial namespace.
"""

from __future__ import annotations

import contextlib
import json
import re
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from lab.common import wait_until
from proxy.nfqueue import netlink, rules
from proxy.nfqueue.netlink import Flow, QueueSocket
from proxy.nfqueue.rules import MarkLayout, QueueConfig, Served
from tests.support import backends
from tests.support.driver import write_state
from tests.support.netns import Topology, in_netns, sh, stop_process, topology
from tests.support.objects import endpoint_slice, node, service

pytestmark = pytest.mark.lab

NODE, OTHER = "n1", "n2"
T = Topology
NODE6, CLIENT6 = "fd00:77:1::1", "fd00:77:1::2"
NODE6_POD1, POD1_6 = "fd00:77:2::1", "fd00:77:2::2"
NODE6_POD2, POD2_6 = "fd00:77:3::1", "fd00:77:3::2"
BACKEND, UDP_BACKEND = 8080, 5353
WEB, FAR, LOCAL, DNS = 30480, 30481, 30482, 30490
"""NodePorts: Cluster to pod1 (here), Cluster to pod2 (elsewhere: SNAT), Local with no
local endpoint (DROP), and a UDP one."""
VIP6_FAR, VIP6_EMPTY = "fd00:96::11", "fd00:96::12"
QUEUE = 79
HEALTHZ, METRICS = 31356, 31349


def add_ipv6(topo: Topology) -> None:
    """A ULA address beside each IPv4 one, routes via the node, forwarding on there."""
    links = [(topo.node, "c0", f"{NODE6}/64"), (topo.client, "eth0", f"{CLIENT6}/64"),
             (topo.node, "p1", f"{NODE6_POD1}/64"), (topo.pod1, "eth0", f"{POD1_6}/64"),
             (topo.node, "p2", f"{NODE6_POD2}/64"), (topo.pod2, "eth0", f"{POD2_6}/64")]
    for ns, dev, addr in links:
        sh("ip", "-n", ns, "addr", "add", addr, "dev", dev, "nodad")
    for ns, via in ((topo.client, NODE6), (topo.pod1, NODE6_POD1), (topo.pod2, NODE6_POD2)):
        sh("ip", "-n", ns, "-6", "route", "add", "default", "via", via)
    sh("ip", "netns", "exec", topo.node, "sysctl", "-qw", "net.ipv6.conf.all.forwarding=1")

    # Ready once no address is tentative (the link-locals' duplicate address detection):
    # until then the node's neighbour solicitation for a pod went unanswered, and a test's
    # first SYN waited for its retransmission a second later (or timed out).
    def settled() -> bool:
        return not any(sh("ip", "-n", ns, "-6", "addr", "show", "tentative").stdout.strip()
                       for ns in topo.all)

    wait_until(settled, 10, 0.05, what="IPv6 duplicate address detection to end")


def start6(name: str) -> backends.Server:
    """The tests' TCP backend, on ``[::]``: it answers both families."""
    return backends.start("::", BACKEND, name)


@dataclass
class UdpEcho:
    """Answers each datagram on ``[::]:5353`` with ``<name> <source address>``; bounded."""

    sock: socket.socket
    name: str
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        deadline = time.monotonic() + 300
        while not self.stop.is_set() and time.monotonic() < deadline:
            if not select.select([self.sock], [], [], 0.05)[0]:
                continue
            data, addr = self.sock.recvfrom(2048)
            self.sock.sendto(f"{self.name} {addr[0]} ".encode() + data, addr)


def udp_echo(ns: str, name: str) -> UdpEcho:
    def make() -> socket.socket:
        s = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
        s.bind(("::", UDP_BACKEND))
        return s
    echo = UdpEcho(in_netns(ns, make), name)
    threading.Thread(target=echo.run, daemon=True).start()
    return echo


def dual(name: str, node_port: int, cluster_ips: tuple[str, str], **kw: Any) -> dict[str, Any]:
    kw.setdefault("target_port", BACKEND)
    return service(name, node_port, cluster_ip=cluster_ips[0],
                   ipFamilyPolicy="PreferDualStack", ipFamilies=["IPv4", "IPv6"],
                   clusterIPs=list(cluster_ips), **kw)


def state_objects() -> list[dict[str, Any]]:
    v6 = {"address_type": "IPv6"}
    return [
        node(NODE, T.NODE_IP, NODE6),
        dual("web", WEB, ("10.96.0.10", "fd00:96::10")),
        endpoint_slice("web", (T.POD1_IP, NODE), name="web-v4"),
        endpoint_slice("web", (POD1_6, NODE), name="web-v6", **v6),
        # IPv6 only: its one endpoint is on another node.
        service("far", FAR, BACKEND, cluster_ip=VIP6_FAR, ipFamilyPolicy="SingleStack",
                ipFamilies=["IPv6"], clusterIPs=[VIP6_FAR]),
        endpoint_slice("far", (POD2_6, OTHER), name="far-v6", **v6),
        dual("local", LOCAL, ("10.96.0.13", "fd00:96::13"), etp="Local"),
        endpoint_slice("local", (T.POD2_IP, OTHER), name="local-v4"),
        endpoint_slice("local", (POD2_6, OTHER), name="local-v6", **v6),
        # A ClusterIP with no endpoints: its ports are refused.
        service("empty", None, BACKEND, type="ClusterIP", cluster_ip=VIP6_EMPTY,
                ipFamilyPolicy="SingleStack", ipFamilies=["IPv6"], clusterIPs=[VIP6_EMPTY]),
        dual("dns", DNS, ("10.96.0.53", "fd00:96::53"), port=53, protocol="UDP",
             target_port=UDP_BACKEND),
        endpoint_slice("dns", (T.POD1_IP, NODE), (T.POD2_IP, NODE), name="dns-v4",
                       port=UDP_BACKEND, protocol="UDP"),
        endpoint_slice("dns", (POD1_6, NODE), (POD2_6, NODE), name="dns-v6",
                       port=UDP_BACKEND, protocol="UDP", **v6),
    ]


@dataclass
class Kpx:
    """The ``kpx node`` under test, in the node's namespace; ``start`` another after a kill."""

    topo: Topology
    workdir: Path
    proc: subprocess.Popen[str] | None = None
    starts: int = 0

    @property
    def log(self) -> Path:
        return self.workdir / f"kpx-{self.starts}.log"

    def start(self) -> None:
        self.starts += 1
        argv = [sys.executable, "-m", "proxy", "node", "--proxy-mode", "nfqueue",
                "--hostname-override", NODE, "--state", str(self.workdir / "state.yaml"),
                "--queue-num", str(QUEUE), "--cluster-cidr", "10.244.0.0/16,fd00:244::/56",
                "--healthz-bind-address", f"0.0.0.0:{HEALTHZ}",
                "--metrics-bind-address", f"127.0.0.1:{METRICS}"]
        with open(self.log, "w") as out:
            self.proc = self.topo.popen(self.topo.node, *argv, stdout=out,
                                        stderr=subprocess.STDOUT)

        def in_force() -> bool:
            assert self.proc is not None and self.proc.poll() is None, (
                f"kpx node exited:\n{self.log.read_text()[-3000:]}")
            return "nfqueue rules in force" in self.log.read_text()

        wait_until(in_force, 30, 0.05, what="kpx's nfqueue rules in force")

    def stop(self, sig: int = signal.SIGTERM) -> int:
        assert self.proc is not None
        rc = stop_process(self.proc, sig)
        self.proc = None
        return rc


@pytest.fixture(scope="module")
def kpx(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Kpx]:
    workdir = tmp_path_factory.mktemp("nfq6")
    write_state(workdir / "state.yaml", *state_objects())
    try:
        with topology() as topo:
            add_ipv6(topo)
            servers = [in_netns(topo.pod1, start6, "pod1"), in_netns(topo.pod2, start6, "pod2")]
            echoes = [udp_echo(topo.pod1, "pod1"), udp_echo(topo.pod2, "pod2")]
            k = Kpx(topo, workdir)
            try:
                k.start()
                yield k
            finally:
                if k.proc is not None:
                    k.stop()
                for e in echoes:
                    e.stop.set()
                for srv in servers:
                    srv.stop()
    except PermissionError:
        pytest.skip("needs root (network namespaces)")


def dial6(ns: str, addr: str, port: int, timeout: float = 2.0) -> socket.socket:
    s = in_netns(ns, socket.socket, socket.AF_INET6, socket.SOCK_STREAM)
    s.settimeout(timeout)
    try:
        s.connect((addr, port))
    except BaseException:
        s.close()
        raise
    return s


def peer(ns: str, addr: str, port: int) -> str:
    """What the endpoint reached through ``addr:port`` says: ``<pod> <client ip>:<port>``."""
    with dial6(ns, addr, port) as s:
        s.sendall(b"PEER\n")
        return s.recv(200).decode().strip()


# -- the verdicts over IPv6 -----------------------------------------------------------------

def test_cluster_forward_reaches_the_local_endpoint_and_keeps_the_client_ipv6(kpx: Kpx) -> None:
    said = peer(kpx.topo.client, NODE6, WEB)
    assert said.startswith(f"pod1 {CLIENT6}:"), said
    # The IPv4 family is still served, by the same process, from the same queue (pod1's
    # socket is on [::]: it sees an IPv4 client as v4-mapped).
    v4 = in_netns(kpx.topo.client, _peer4, T.NODE_IP, WEB)
    assert v4.startswith(f"pod1 ::ffff:{T.CLIENT_IP}:"), v4


def _peer4(addr: str, port: int) -> str:
    with socket.create_connection((addr, port), 2) as s:
        s.sendall(b"PEER\n")
        return s.recv(200).decode().strip()


def test_a_cross_node_endpoint_is_masqueraded_to_the_nodes_ipv6(kpx: Kpx) -> None:
    said = peer(kpx.topo.client, NODE6, FAR)
    assert said.startswith(f"pod2 {NODE6_POD2}:"), said


def test_an_ipv6_cluster_ip_is_dnated_too(kpx: Kpx) -> None:
    said = peer(kpx.topo.client, VIP6_FAR, 80)
    assert said.startswith("pod2 "), said


def test_local_policy_without_a_local_endpoint_drops_the_ipv6_syn(kpx: Kpx) -> None:
    t0 = time.monotonic()
    with pytest.raises(TimeoutError):
        dial6(kpx.topo.client, NODE6, LOCAL, timeout=0.5)
    assert time.monotonic() - t0 >= 0.45


def test_a_cluster_ip_port_without_endpoints_is_refused_at_once(kpx: Kpx) -> None:
    """The ip6 table's reset: without it the SYN is routed on, and the node has no route."""
    for addr, port in ((VIP6_EMPTY, 80), (VIP6_FAR, 81)):
        t0 = time.monotonic()
        with pytest.raises(ConnectionRefusedError):
            dial6(kpx.topo.client, addr, port)
        assert time.monotonic() - t0 < 0.5


def test_ipv6_localhost_is_never_a_nodeport_while_ipv4_localhost_is(kpx: Kpx) -> None:
    with pytest.raises(ConnectionRefusedError):
        dial6(kpx.topo.node, "::1", WEB)
    said = in_netns(kpx.topo.node, _peer4, "127.0.0.1", WEB)
    assert said.startswith("pod1 "), said


def test_a_node_process_reaching_its_own_ipv6_nodeport_goes_through_output(kpx: Kpx) -> None:
    """Queued from the output hook, decided as node-originated (masqueraded), DNATed there."""
    said = peer(kpx.topo.node, NODE6, WEB)
    assert said.startswith(f"pod1 {NODE6_POD1}:"), said


def _metric(name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{METRICS}/metrics", timeout=2) as r:
        text = r.read().decode()
    m = re.search(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def test_a_udp_flow_over_ipv6_is_decided_once_and_stays_on_its_endpoint(kpx: Kpx) -> None:
    def flows() -> float:
        return in_netns(kpx.topo.node, _metric, "kubeproxy_kpx_udp_flows_created_total")

    before = flows()
    s = in_netns(kpx.topo.client, socket.socket, socket.AF_INET6, socket.SOCK_DGRAM)
    with s:
        s.settimeout(2)
        s.connect((NODE6, DNS))
        answers = []
        for i in range(8):
            s.send(f"q{i}".encode())
            answers.append(s.recv(200).decode())
    pods = {a.split()[0] for a in answers}
    assert len(pods) == 1, answers
    assert all(a.split()[1] == CLIENT6 for a in answers), answers
    assert [a.split()[2] for a in answers] == [f"q{i}" for i in range(8)]
    wait_until(lambda: flows() >= before + 1, 5, 0.1, what="the flow to be counted")
    time.sleep(1.2)  # one more metrics flush: a second decision would show by now
    assert flows() == before + 1


def test_an_ipv6_udp_flow_to_an_endpoint_that_went_is_deleted_and_decided_again(
        kpx: Kpx) -> None:
    """kpx deletes the IPv6 conntrack entry pinned to the endpoint that left (ctnetlink,
    AF_INET6), and only that one: an IPv4 flow to the same nodePort, whose endpoints did not
    change, is not judged by the IPv6 endpoints."""
    topo = kpx.topo
    s6 = in_netns(topo.client, socket.socket, socket.AF_INET6, socket.SOCK_DGRAM)
    s4 = in_netns(topo.client, socket.socket, socket.AF_INET, socket.SOCK_DGRAM)
    with s6, s4:
        for s, addr in ((s6, NODE6), (s4, T.NODE_IP)):
            s.settimeout(2)
            s.connect((addr, DNS))

        def ask(s: socket.socket, what: bytes) -> str:
            s.send(what)
            return s.recv(200).decode().split()[0]

        went6, went4 = ask(s6, b"a"), ask(s4, b"a")
        stays6 = {"pod1": POD2_6, "pod2": POD1_6}[went6]
        objs = state_objects()
        for o in objs:
            if o["metadata"]["name"] == "dns-v6":
                o["endpoints"] = [e for e in o["endpoints"] if e["addresses"] == [stays6]]
        in_force = kpx.log.read_text().count("nfqueue rules in force")
        try:
            write_state(kpx.workdir / "state.yaml", *objs)
            wait_until(lambda: "deleted 1 UDP conntrack entry" in kpx.log.read_text(), 10,
                       0.05, what="the stale IPv6 flow to be deleted")
            assert ask(s6, b"b") != went6
            assert ask(s4, b"b") == went4
            assert "UDP conntrack entries" not in kpx.log.read_text()  # never two
        finally:
            write_state(kpx.workdir / "state.yaml", *state_objects())
            wait_until(lambda: kpx.log.read_text().count("nfqueue rules in force")
                       >= in_force + 2, 10, 0.05, what="the first state back in force")


def test_the_node_healthz_answers_over_ipv6_with_both_families_status(kpx: Kpx) -> None:
    """nfqueue mode is the node's IPv6 dataplane too: the proxier reports IPv6 and turns the
    node's /healthz IPv6 socket on."""
    def get() -> str:
        with dial6(kpx.topo.client, NODE6, HEALTHZ) as s:
            s.sendall(b"GET /healthz HTTP/1.0\r\nHost: kpx\r\n\r\n")
            out = b""
            while chunk := s.recv(4096):
                out += chunk
        return out.decode()
    reply = get()
    assert reply.startswith("HTTP/1.0 200") or reply.startswith("HTTP/1.1 200"), reply
    status = json.loads(reply.split("\r\n\r\n", 1)[1])["status"]
    assert sorted(status) == ["IPv4", "IPv6"] and all(v["healthy"] for v in status.values())


# -- the rules: ip6tables and the ip6 table, installed once, removed at exit ----------------

def kpx_rules(topo: Topology) -> dict[str, int]:
    """Copies of kpx's rules per family in the node's namespace: xt rules and nft tables."""
    def count(*argv: str) -> int:
        out = sh("ip", "netns", "exec", topo.node, *argv).stdout
        return sum(rules.COMMENT in ln for ln in out.splitlines())
    tables = sh("ip", "netns", "exec", topo.node, "nft", "list", "tables").stdout.splitlines()
    return {"iptables": count("iptables-save", "-t", "mangle"),
            "ip6tables": count("ip6tables-save", "-t", "mangle"),
            "ip": tables.count(f"table ip {rules.NFT_TABLE}"),
            "ip6": tables.count(f"table ip6 {rules.NFT_TABLE}")}


def test_sigkill_and_restart_leave_one_copy_of_each_rule_and_sigterm_none(kpx: Kpx) -> None:
    one = {"iptables": 2, "ip6tables": 2, "ip": 1, "ip6": 1}
    if "queueing SYNs with nft's queue expression" in kpx.log.read_text():
        one.update(iptables=0, ip6tables=0)  # a kernel with nft's queue: no xt rules
    assert kpx_rules(kpx.topo) == one
    kpx.stop(signal.SIGKILL)
    assert kpx_rules(kpx.topo) == one  # left behind by the kill
    kpx.start()
    assert kpx_rules(kpx.topo) == one
    assert peer(kpx.topo.client, NODE6, WEB).startswith(f"pod1 {CLIENT6}:")
    assert kpx.stop(signal.SIGTERM) == 0
    assert kpx_rules(kpx.topo) == dict.fromkeys(one, 0)
    ruleset = sh("ip", "netns", "exec", kpx.topo.node, "nft", "list", "ruleset").stdout
    assert "queue" not in ruleset and "table ip6 mangle" not in ruleset


# -- the REJECT mark, on its own: an ip6 table and a hand-made verdict ------------------------

def test_the_reject_mark_answers_an_ipv6_syn_with_a_reset_where_the_node_listens() -> None:
    """A REJECT verdict is the ip6 table's ``reject with tcp reset`` (``decide`` gives one
    only when every endpoint failed, which nfqueue mode does not track), so the verdict is
    made by hand here, as ``test_dp_nfqueue`` does for IPv4."""
    cfg = QueueConfig(queue=QUEUE + 1)
    lay = MarkLayout()
    port = 30499
    with contextlib.ExitStack() as stack:
        try:
            topo = stack.enter_context(topology())
        except PermissionError:
            pytest.skip("needs root (network namespaces)")
        add_ipv6(topo)
        q = in_netns(topo.node, QueueSocket, cfg.queue)
        stack.callback(q.close)
        seen: list[Flow] = []
        stop = threading.Event()

        def answer() -> None:
            deadline = time.monotonic() + 30
            while not stop.is_set() and time.monotonic() < deadline:
                if not select.select([q], [], [], 0.05)[0]:
                    continue
                got = q.read_batch()
                seen.extend(netlink.flow(p.payload) for p in got)
                q.send_verdicts([netlink.accept(p.packet_id, lay.verdict_mark(p.mark, lay.reject))
                                 for p in got])

        t = threading.Thread(target=answer, daemon=True)
        t.start()
        stack.callback(t.join, 5)  # the socket closes only once the thread is out of it
        stack.callback(stop.set)
        for family in rules.FAMILIES:
            in_netns(topo.node, rules.install, cfg, Served(ports=frozenset({port})), "xt", family)
        stack.callback(in_netns, topo.node, rules.remove, cfg)

        def listen() -> socket.socket:
            s = socket.socket(socket.AF_INET6)
            s.bind(("::", port))
            s.listen(4)
            return s
        stack.enter_context(in_netns(topo.node, listen))
        t0 = time.monotonic()
        with pytest.raises(ConnectionRefusedError):
            dial6(topo.client, NODE6, port)
        assert time.monotonic() - t0 < 0.5
    assert [(f.src, f.dst, f.dport, f.family) for f in seen] == [(CLIENT6, NODE6, port, 6)]
