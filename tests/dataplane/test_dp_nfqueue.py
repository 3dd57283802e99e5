"""Mode nfqueue end to end (issue 15): SYNs decided in Python, connections carried by conntrack.

The topology is ``tests.support.netns.Topology``: client -- node -- {pod1,
pod2}, each its own namespace, removed pass or fail. The node binds an
NFQUEUE socket and installs kpx's rules (``proxy.nfqueue.rules``) from a
thread that joined its namespace; a decision thread in the test answers each
queued SYN by its destination port (``POLICY``), bounded in time. Clients
dial the node's address from the client namespace, so their SYNs cross the
node's prerouting as NodePort traffic does. Nothing touches the initial
namespace.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import select
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from proxy.nfqueue import conntrack, netlink, rules
from proxy.nfqueue.netlink import Flow, QueueSocket, Verdict
from proxy.nfqueue.rules import MarkLayout, QueueConfig, Served
from tests.support import backends
from tests.support.netns import (
    Topology,
    connect_in,
    fresh_netns,
    in_fresh_netns,
    in_netns,
    sh,
    socket_in,
    topology,
)

pytestmark = pytest.mark.lab

NODE_IP = Topology.NODE_IP
CLIENT_IP = Topology.CLIENT_IP
POD1_IP = Topology.POD1_IP
BACKEND_PORT = 8080
FORWARD, FORWARD_SNAT, DROP, REJECT, TO_NODE = 30080, 30081, 30082, 30083, 30084
NODE_PORT = 8081
"""An endpoint on the node itself (a hostNetwork pod)."""
QUEUE = 77
CFG = QueueConfig(queue=QUEUE)
POD1, ON_NODE = 1, 2
"""Target indexes: pod1's echo server, and a listener on the node."""
SERVED = Served(ports=frozenset({FORWARD, FORWARD_SNAT, DROP, REJECT, TO_NODE}),
                targets={(None, "tcp", FORWARD): {POD1: (POD1_IP, BACKEND_PORT)},
                         (None, "tcp", FORWARD_SNAT): {POD1: (POD1_IP, BACKEND_PORT)},
                         (None, "tcp", TO_NODE): {ON_NODE: (NODE_IP, NODE_PORT)}})
"""NodePort frontends only: the VIP map misses for every SYN here, so each DNAT is the
NodePort map's (the rule after a missed lookup runs)."""


def policy(flow: Flow, layout: MarkLayout) -> int | None:
    """The test's decision: a mark to accept with, or None to drop."""
    return {
        FORWARD: layout.forward(POD1),
        FORWARD_SNAT: layout.forward(POD1, masquerade=True),
        REJECT: layout.reject,
        TO_NODE: layout.forward(ON_NODE),
    }.get(flow.dport)


@dataclass
class Decider:
    """A bounded decision loop on one queue socket, in a thread."""

    queue: QueueSocket
    layout: MarkLayout = field(default_factory=MarkLayout)
    decide: Callable[[Flow, MarkLayout], int | None] = policy
    limit: float = 60.0
    seen: list[Flow] = field(default_factory=list)
    batches: int = 0
    stop: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None

    def run(self) -> None:
        deadline = time.monotonic() + self.limit
        try:
            while not self.stop.is_set() and time.monotonic() < deadline:
                if not select.select([self.queue], [], [], 0.05)[0]:
                    continue
                verdicts: list[Verdict] = []
                for pkt in self.queue.read_batch():
                    f = netlink.flow(pkt.payload)
                    self.seen.append(f)
                    mark = self.decide(f, self.layout)
                    verdicts.append(netlink.drop(pkt.packet_id) if mark is None else
                                    netlink.accept(pkt.packet_id,
                                                   self.layout.verdict_mark(pkt.mark, mark)))
                self.queue.send_verdicts(verdicts)
                self.batches += 1
        except BaseException as exc:  # surfaced by the fixture
            self.error = exc


@dataclass
class Node:
    topo: Topology
    decider: Decider
    echo: backends.Server

    def dial(self, port: int, timeout: float = 2.0, ns: str | None = None) -> socket.socket:
        return connect_in(ns or self.topo.client, (NODE_IP, port), timeout)

    def node_sh(self, *argv: str) -> str:
        return sh("ip", "netns", "exec", self.topo.node, *argv).stdout


def _ask(s: socket.socket, line: str) -> str:
    s.sendall(line.encode() + b"\n")
    out = b""
    deadline = time.monotonic() + 5
    while not out.endswith(b"\n") and time.monotonic() < deadline:
        chunk = s.recv(4096)
        if not chunk:
            break
        out += chunk
    return out.decode().strip()


@contextlib.contextmanager
def nfqueue_node(cfg: QueueConfig = CFG, served: Served = SERVED,
                 **decider: Any) -> Iterator[Node]:
    """The topology with the queue bound and kpx's rules in the node, a decider answering."""
    if os.geteuid() != 0:
        pytest.skip("needs root (network namespaces)")
    with topology() as topo:
        echo = in_netns(topo.pod1, backends.start, POD1_IP, BACKEND_PORT, "pod1")
        q = in_netns(topo.node, QueueSocket, cfg.queue)
        d = Decider(q, cfg.layout, **decider)
        t = threading.Thread(target=d.run, daemon=True)
        try:
            t.start()
            assert in_netns(topo.node, rules.install, cfg, served, "xt") == "xt"
            yield Node(topo, d, echo)
        finally:
            d.stop.set()
            t.join(5)
            q.close()
            echo.stop()
        assert d.error is None, d.error


# -- the three verdicts ---------------------------------------------------------------------

def test_forward_reaches_the_endpoint_by_dnat_and_keeps_the_client_ip() -> None:
    with nfqueue_node() as node, node.dial(FORWARD) as s:
        peer = _ask(s, "PEER")
    assert peer.startswith(f"pod1 {CLIENT_IP}:"), peer
    assert [(f.src, f.dst, f.dport) for f in node.decider.seen] == [
        (CLIENT_IP, NODE_IP, FORWARD)]


def test_forward_with_the_masquerade_bit_reaches_the_endpoint_from_the_node() -> None:
    with nfqueue_node() as node, node.dial(FORWARD_SNAT) as s:
        peer = _ask(s, "PEER")
    assert peer.startswith("pod1 10.77.2.1:"), peer  # the node's address toward pod1


def test_drop_gets_no_answer_so_the_connect_times_out() -> None:
    with nfqueue_node() as node:
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            node.dial(DROP, timeout=0.5)
        assert time.monotonic() - t0 >= 0.45
    assert node.decider.seen and {f.dport for f in node.decider.seen} == {DROP}


def _listen_in(ns: str, port: int) -> socket.socket:
    def make() -> socket.socket:
        s = socket.socket()
        s.bind(("0.0.0.0", port))
        s.listen(8)
        return s
    return in_netns(ns, make)


def test_reject_refuses_at_once_even_where_the_node_listens() -> None:
    """The reset is kpx's rule: a node socket on the port would have accepted."""
    with nfqueue_node() as node, _listen_in(node.topo.node, REJECT):
        t0 = time.monotonic()
        with pytest.raises(ConnectionRefusedError):
            node.dial(REJECT, timeout=2.0)
        assert time.monotonic() - t0 < 0.5
    assert [f.dport for f in node.decider.seen] == [REJECT]


def test_the_kernel_drops_what_overflows_the_socket_and_the_reader_carries_on() -> None:
    """ENOBUFS: counted, logged, and the packets that did arrive are still answered."""
    if os.geteuid() != 0:
        pytest.skip("needs root (network namespaces)")
    with topology() as topo:
        q = in_netns(topo.node, lambda: QueueSocket(QUEUE, rcvbuf=1))  # the kernel's minimum
        try:
            in_netns(topo.node, rules.install, CFG, SERVED, "xt")
            clients = [socket_in(topo.client) for _ in range(60)]
            try:
                for c in clients:
                    c.setblocking(False)
                    with contextlib.suppress(BlockingIOError):
                        c.connect((NODE_IP, DROP))
                time.sleep(0.3)
                got = q.read_batch()
                q.send_verdicts([netlink.drop(p.packet_id) for p in got])
            finally:
                for c in clients:
                    c.close()
            assert q.enobufs >= 1
            assert 0 < len(got) < 60
            assert q.verdict_errors == 0
        finally:
            q.close()


def test_a_node_process_goes_through_output_and_is_decided_too() -> None:
    with nfqueue_node() as node:
        with node.dial(FORWARD, ns=node.topo.node) as s:
            peer = _ask(s, "PEER")
        with pytest.raises(ConnectionRefusedError):
            node.dial(REJECT, ns=node.topo.node)
    assert peer.startswith(f"pod1 {NODE_IP}:"), peer
    assert [f.dport for f in node.decider.seen] == [FORWARD, REJECT]


def test_an_endpoint_on_the_node_is_decided_once_for_a_node_process() -> None:
    """The DNATed SYN loops back through prerouting with the verdict's mark still on it:
    the marking chain clears the stale bit, so it is not queued (and dropped) a second time."""
    with (nfqueue_node() as node, _listen_in(node.topo.node, NODE_PORT) as srv,
          node.dial(TO_NODE, ns=node.topo.node)):
        srv.settimeout(2)
        conn, peer = srv.accept()
        conn.close()
    assert [f.dport for f in node.decider.seen] == [TO_NODE]
    assert peer[0] == NODE_IP


def test_a_connection_whose_packets_carry_the_queued_bit_is_never_queued() -> None:
    """Someone else's mark with the layout's queued bit (SO_MARK here; a MARK or CONNMARK
    rule alike) is cleared from every packet before the marking chain returns: the xt rule
    queues on that bit alone, and a mid-stream segment that reached the reader would be
    decided as a new connection (dropped here, refused by kpx)."""
    def marked() -> socket.socket:
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_MARK, CFG.layout.queued)
        s.settimeout(2)
        s.connect((POD1_IP, BACKEND_PORT))
        return s

    with nfqueue_node() as node, in_netns(node.topo.node, marked) as s:
        assert _ask(s, "PEER").startswith("pod1 10.77.2.1:")  # the node, toward pod1
    assert node.decider.seen == []


def test_only_the_syn_is_queued_while_the_bytes_flow_in_the_kernel() -> None:
    conns, size = 6, 1 << 20
    payload = bytes(range(256)) * (size // 256)
    with nfqueue_node() as node:
        for _ in range(conns):
            with node.dial(FORWARD, timeout=5) as s:
                s.sendall(b"ECHO\n")
                got = 0
                sent = 0
                deadline = time.monotonic() + 10
                while got < size and time.monotonic() < deadline:
                    if sent < size:
                        sent += s.send(payload[sent:sent + 65536])
                    with contextlib.suppress(TimeoutError):
                        s.settimeout(0.01 if sent < size else 2)
                        got += len(s.recv(1 << 18))
                    s.settimeout(5)
                assert got == size
    assert len(node.decider.seen) == conns
    assert all(f.dport == FORWARD and f.proto == socket.IPPROTO_TCP for f in node.decider.seen)


def test_an_unknown_target_index_is_not_dnated() -> None:
    """A FORWARD mark whose slot the map lacks is delivered to the node, where nothing listens."""
    with nfqueue_node(decide=lambda f, lay: lay.forward(9)) as node, pytest.raises(
            ConnectionRefusedError):
        node.dial(FORWARD)


# -- fail-closed and fail-open ---------------------------------------------------------------

@pytest.mark.parametrize("bypass", [False, True])
def test_without_a_queue_reader_syns_drop_unless_bypass(bypass: bool) -> None:
    """Fail-closed by default: no reader, no connection (the client retransmits)."""
    if os.geteuid() != 0:
        pytest.skip("needs root (network namespaces)")
    cfg = QueueConfig(queue=QUEUE, bypass=bypass)
    with topology() as topo:
        in_netns(topo.node, rules.install, cfg, SERVED, "xt")
        if bypass:  # let through without a mark: no DNAT, the node itself resets
            with pytest.raises(ConnectionRefusedError):
                connect_in(topo.client, (NODE_IP, FORWARD), 0.5)
        else:
            with pytest.raises(TimeoutError):
                connect_in(topo.client, (NODE_IP, FORWARD), 0.5)


def test_a_successor_takes_over_a_queue_with_many_packets_waiting() -> None:
    """A restart's successor adopts the predecessor's socket with everything queued meanwhile.

    The kernel acks each config request after the packets already in the socket; the
    successor reads them (keeping them for its first batch) until its ack comes, however
    many there are, within the config deadline: giving up earlier closed the socket and
    dropped every one of them.
    """
    if os.geteuid() != 0:
        pytest.skip("needs root (a network namespace)")
    waiting = 300
    with fresh_netns("nfqadopt") as ns:
        old = in_netns(ns, QueueSocket, QUEUE)
        new = None
        try:
            sh("ip", "netns", "exec", ns, "iptables", "-w", "5", "-t", "mangle", "-A", "OUTPUT",
               "-p", "udp", "--dport", "9999", "-j", "NFQUEUE", "--queue-num", str(QUEUE))

            def send() -> None:
                for _ in range(waiting):  # each from a port of its own: a new flow
                    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as one:
                        one.sendto(b"x", ("127.0.0.1", 9999))

            in_netns(ns, send)
            new = in_netns(ns, lambda: QueueSocket(QUEUE, adopt=old.socket))
            got: list[netlink.Packet] = []
            deadline = time.monotonic() + 5
            while len(got) < waiting and time.monotonic() < deadline:
                batch = new.read_batch()
                new.send_verdicts([netlink.drop(p.packet_id) for p in batch])
                got += batch
            assert len(got) == waiting
        finally:
            if new is not None:
                new.close()
            old.close()


# -- install and remove ------------------------------------------------------------------------

def _kpx_lines(node: Node) -> list[str]:
    return [ln for ln in node.node_sh("iptables-save", "-t", "mangle").splitlines()
            if rules.COMMENT in ln or "NFQUEUE" in ln]


def test_install_again_leaves_one_copy_and_remove_leaves_nothing() -> None:
    with nfqueue_node() as node:
        ns = node.topo.node
        # A killed kpx's leftovers: its table and rules, one of them for another queue.
        in_netns(ns, rules.install, CFG, SERVED, "xt")
        old = QueueConfig(queue=QUEUE + 1)
        sh("ip", "netns", "exec", ns, *rules.iptables_argv("-A", rules.iptables_rules(old)[0]))
        in_netns(ns, rules.install, CFG, SERVED, "xt")
        lines = _kpx_lines(node)
        assert lines == [f"-A {' '.join(r)}" for r in rules.iptables_rules(CFG)]
        assert node.node_sh("nft", "list", "tables").count(f"table ip {CFG.table}") == 1
        with node.dial(FORWARD) as s:  # still serving
            assert _ask(s, "PEER").startswith("pod1 ")

        assert in_netns(ns, rules.remove, CFG) == 2
        assert _kpx_lines(node) == []
        ruleset = node.node_sh("nft", "list", "ruleset")
        assert CFG.table not in ruleset and "queue" not in ruleset
        assert "table ip mangle" not in ruleset  # iptables-nft's, emptied: gone too
        assert in_netns(ns, rules.remove, CFG) == 0  # idempotent
        # With no rules nothing is queued: the SYN goes to the node, which resets it.
        with pytest.raises(ConnectionRefusedError):
            node.dial(FORWARD)


def test_a_relays_nat_keeper_keeps_dnated_connections_until_an_nfqueue_write_takes_over(
) -> None:
    """``keep_nat`` (a relay's start): nothing is queued any more, but a connection already
    DNATed goes on, since the keeper holds conntrack on (without it the node stopped
    tracking the connection and reset its next segment). The first write of an
    nfqueue-mode kpx removes the keeper in its own transaction."""
    with nfqueue_node() as node, node.dial(FORWARD) as s:
        ns = node.topo.node
        s.sendall(b"ECHO\n")
        assert backends.echoes(s, b"before" * 100)
        assert in_netns(ns, rules.keep_nat, CFG) == 2
        tables = node.node_sh("nft", "list", "tables").splitlines()
        assert "table ip kpx_nfq_keep" in tables and f"table ip {CFG.table}" not in tables
        assert in_netns(ns, rules.kept, 4) == rules.Frontends(
            frozenset(("tcp", p) for p in SERVED.ports), frozenset())
        assert backends.echoes(s, b"kept" * 100), "the DNATed connection broke"
        with pytest.raises(ConnectionRefusedError):  # not queued: the node itself resets it
            node.dial(FORWARD, timeout=2.0)
        in_netns(ns, rules.write_tables, CFG, {4: SERVED}, "xt", {4: None})
        tables = node.node_sh("nft", "list", "tables").splitlines()
        assert "table ip kpx_nfq_keep" not in tables and f"table ip {CFG.table}" in tables
        assert backends.echoes(s, b"after" * 100)


def test_a_mangle_table_with_anyone_elses_rule_stays() -> None:
    with nfqueue_node() as node:
        ns = node.topo.node
        in_netns(ns, rules.install, CFG, SERVED, "xt")
        theirs = ["PREROUTING", "-p", "udp", "--dport", "9", "-j", "ACCEPT"]
        sh("ip", "netns", "exec", ns, *rules.iptables_argv("-A", theirs))
        in_netns(ns, rules.remove, CFG)
        assert _kpx_lines(node) == []
        assert "--dport 9 -j ACCEPT" in node.node_sh("iptables-save", "-t", "mangle")


def test_only_an_empty_accepting_mangle_table_counts_as_empty() -> None:
    def listing(*items: dict[str, Any]) -> str:
        return json.dumps({"nftables": [{"metainfo": {}}, {"table": {"name": "mangle"}},
                                        *items]})
    chain = {"chain": {"name": "PREROUTING", "policy": "accept"}}
    assert rules.mangle_is_empty(listing(chain))
    assert not rules.mangle_is_empty(listing({"chain": {"name": "X", "policy": "drop"}}))
    assert not rules.mangle_is_empty(listing(chain, {"rule": {"chain": "PREROUTING"}}))
    assert not rules.mangle_is_empty(listing(chain, {"set": {"name": "s"}}))
    assert not rules.mangle_is_empty("not json")


def _kernel_has_nft_queue() -> bool | None:
    """What the kernel's own config says (None: it does not say)."""
    try:
        with gzip.open("/proc/config.gz", "rt") as f:
            config = f.read()
    except OSError:
        return None
    return "CONFIG_NFT_QUEUE=y" in config or "CONFIG_NFT_QUEUE=m" in config


def test_the_nft_queue_probe_agrees_with_the_kernel_and_leaves_nothing() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root (network namespaces)")

    def probe() -> tuple[bool, str]:
        supported = rules.nft_queue_supported(QUEUE)
        return supported, sh("nft", "list", "ruleset").stdout

    supported, ruleset = in_fresh_netns("nfqprobe", probe)
    known = _kernel_has_nft_queue()
    if known is not None:
        assert supported == known
    assert ruleset.strip() == ""


def test_install_picks_the_mechanism_the_probe_finds_and_logs_it(
        caplog: pytest.LogCaptureFixture) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root (network namespaces)")
    caplog.set_level("INFO", logger="proxy.nfqueue.rules")

    def install_and_list() -> tuple[str, bool, str, str]:
        supported = rules.nft_queue_supported(QUEUE)
        used = rules.install(CFG, SERVED)
        return (used, supported, sh("iptables-save", "-t", "mangle").stdout,
                sh("nft", "list", "table", "ip", CFG.table).stdout)

    used, supported, save, table = in_fresh_netns("nfqpick", install_and_list)
    assert used == ("nft" if supported else "xt")
    assert (rules.COMMENT in save) == (used == "xt")
    assert (f"queue num {QUEUE}" in table) == (used == "nft")
    assert any("queueing SYNs with" in r.getMessage() for r in caplog.records)


# -- pure pieces: the mark layout and the rendering -----------------------------------------

def test_what_an_nfqueue_mode_kpx_left_behind_is_told_from_the_listings() -> None:
    """Its table of either family, or any rule with its comment (whatever the queue)."""
    save = ("*mangle\n:PREROUTING ACCEPT [0:0]\n-A PREROUTING -m mark --mark 0x1000/0x1000"
            f' -m comment --comment {rules.COMMENT} -j NFQUEUE --queue-num 99\nCOMMIT\n')
    others = "table inet kpx_tproxy\ntable ip kpx_vips\ntable ip kpx_nfq_probe\n"
    assert not rules.left_behind(others, ["*mangle\nCOMMIT\n"])
    assert rules.left_behind(others + f"table ip6 {CFG.table}\n", [])
    assert rules.left_behind("", ["*mangle\nCOMMIT\n", save])
    assert rules.save_argv(6) == ["ip6tables-save", "-t", "mangle"]


def test_the_default_layout_stays_clear_of_kube_proxy_and_the_userspace_mode() -> None:
    lay = MarkLayout()
    assert lay.mask == 0xFFFF1000 and lay.mask & 0xE000 == 0
    assert lay.shift == 16 and lay.max_index == 0x7FFE
    assert lay.forward(1) == 0x00011000
    assert lay.forward(0x7FFE, masquerade=True) == 0xFFFE1000
    assert lay.reject == 0x7FFF1000
    for bad in (0, lay.max_index + 1):
        with pytest.raises(ValueError):
            lay.forward(bad)


def test_a_verdict_keeps_every_bit_outside_the_layout() -> None:
    lay = MarkLayout()
    theirs = 0x4000 | 0x2000 | 0x0F00 | 0x1  # kube-proxy, userspace kpx, Cilium, someone
    # The queued bit the marking rule set, and stale target bits, are replaced.
    assert lay.verdict_mark(theirs | 0x1000 | 0x00050000, lay.forward(2)) == theirs | 0x00021000


@pytest.mark.parametrize("kw", [
    {"queued": 0x4000}, {"queued": 0x3000}, {"target": 0x00F0F000}, {"masquerade": 0x2000},
    {"target": 0x00011000}, {"target": 0x10000},
])
def test_a_layout_that_collides_or_cannot_hold_an_index_is_refused(kw: dict[str, int]) -> None:
    with pytest.raises(ValueError):
        MarkLayout(**kw)


def test_the_script_is_one_atomic_replacement_and_validates_first() -> None:
    script = rules.nft_script(CFG, SERVED)
    assert script.startswith(f"table ip {CFG.table}\ndelete table ip {CFG.table}\n")
    assert "elements = { 30080, 30081, 30082, 30083, 30084 }" in script
    assert "0x00010000 . tcp . 30080 : 10.77.2.2 . 8080" in script
    assert "queue" not in script
    assert f"queue num {QUEUE} bypass" in rules.nft_script(
        QueueConfig(queue=QUEUE, bypass=True), SERVED, "nft")
    for bad in (Served(ports=frozenset({0})), Served(pairs=frozenset({("10.1.1", 80)})),
                Served(targets={(None, "tcp", 80): {0: ("10.0.0.1", 80)}}),
                Served(targets={(None, "sctp", 80): {1: ("10.0.0.1", 80)}}),
                Served(targets={("10.96.0", "tcp", 80): {1: ("10.0.0.1", 80)}})):
        with pytest.raises(ValueError):
            rules.nft_script(CFG, bad)


# -- changes element by element ----------------------------------------------------------------

OLD = Served(ports=frozenset({30080, 30081}), pairs=frozenset({("10.96.0.10", 80)}),
             vips=frozenset({"10.96.0.10"}),
             targets={(None, "tcp", 30080): {1: ("10.244.1.5", 8080), 2: ("10.244.2.5", 8080)},
                      ("10.96.0.10", "tcp", 80): {1: ("10.244.1.5", 8080)}})
NEW = Served(ports=frozenset({30080, 30082}), pairs=frozenset({("10.96.0.10", 80)}),
             vips=frozenset({"10.96.0.10"}), udp_ports=frozenset({30053}),
             targets={(None, "tcp", 30080): {1: ("10.244.1.5", 8080), 2: ("10.244.3.5", 8080)},
                      (None, "udp", 30053): {1: ("10.244.1.5", 53)},
                      ("10.96.0.10", "tcp", 80): {1: ("10.244.1.5", 8080)}})


def nft_listing(*scripts: str) -> str:
    """Run each nft script here (a fresh namespace's thread), then list kpx's IPv4 table."""
    for script in scripts:
        res = subprocess.run(["nft", "-f", "-"], input=script, text=True,
                             capture_output=True, check=False)
        assert res.returncode == 0, res.stderr
    return sh("nft", "list", "table", "ip", CFG.table).stdout


def test_a_change_is_written_as_its_elements_and_ends_where_the_whole_table_would() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root (network namespaces)")
    lay = CFG.layout
    delta = rules.update_script(CFG.table, OLD, NEW, lay)
    assert rules.update_script(CFG.table, NEW, NEW, lay) == ""
    # Only what changed: a port each way, the UDP port, the moved endpoint (out, then in).
    assert "30081" in delta and "30082" in delta and "30053" in delta
    assert "10.244.3.5" in delta and "10.244.1.5 . 8080" not in delta
    assert delta.index("delete element") < delta.index("add element")

    stepped = in_fresh_netns("nfqdelta1", nft_listing, rules.nft_script(CFG, OLD), delta)
    whole = in_fresh_netns("nfqdelta2", nft_listing, rules.nft_script(CFG, NEW))
    assert stepped == whole


def test_a_whole_write_in_place_ends_where_a_replacement_would() -> None:
    """Flushed and filled again, from OLD to NEW: the same table as NEW written afresh. A
    table that holds anything else is replaced (``write_table``)."""
    if os.geteuid() != 0:
        pytest.skip("needs root (network namespaces)")

    def foreign_then_write() -> tuple[frozenset[tuple[str, str]] | None, str]:
        nft_listing(rules.nft_script(CFG, OLD), f"add chain ip {CFG.table} someone_elses\n")
        before = rules.table_objects(CFG.table)
        rules.write_table(CFG, NEW, "xt")
        return before, sh("nft", "list", "table", "ip", CFG.table).stdout

    in_place = in_fresh_netns("nfqwhole1", nft_listing, rules.nft_script(CFG, OLD),
                              rules.nft_script(CFG, NEW, in_place=True))
    whole = in_fresh_netns("nfqwhole2", nft_listing, rules.nft_script(CFG, NEW))
    assert in_place == whole
    assert in_fresh_netns("nfqwhole3", rules.table_objects, CFG.table, 4) is None
    before, replaced = in_fresh_netns("nfqwhole4", foreign_then_write)
    assert before == rules.OBJECTS | {("chain", "someone_elses")}
    assert replaced == whole


NEW6 = Served(ports=frozenset({30080}),
              targets={(None, "tcp", 30080): {1: ("fd00:244:1::5", 8080)}})


def both_tables(*scripts: str) -> str:
    """Run each nft script here, then list kpx's IPv4 and IPv6 tables."""
    nft_listing(*scripts)
    return "".join(sh("nft", "list", "table", fam, CFG.table).stdout for fam in ("ip", "ip6"))


def test_a_first_write_puts_both_families_in_one_transaction_where_each_afresh_would_end(
        ) -> None:
    """A restart's successor writes both tables while the queue it took over is unread: one
    ``nft`` run, each table in place if the look before said so (IPv4 here), else replaced
    (IPv6, absent). When the look is stale and nft refuses (a set of another type where
    kpx's was), each is written on its own, and replaced."""
    if os.geteuid() != 0:
        pytest.skip("needs root (network namespaces)")
    afresh = in_fresh_netns("nfqboth1", both_tables, rules.nft_script(CFG, NEW),
                            rules.nft_script(CFG, NEW6, family=6))

    def handle() -> int:
        """The IPv4 table's handle: kept in place, new when the table is replaced."""
        listed = json.loads(sh("nft", "-j", "list", "table", "ip", CFG.table).stdout)
        return next(o["table"]["handle"] for o in listed["nftables"] if "table" in o)

    def look_then_write(tamper: str) -> tuple[dict[int, object], bool, str]:
        nft_listing(rules.nft_script(CFG, OLD))
        objects = {f: rules.table_objects(CFG.table, f) for f in (4, 6)}
        if tamper:
            nft_listing(tamper)
        before = handle()
        rules.write_tables(CFG, {4: NEW, 6: NEW6}, "xt", objects)
        return objects, handle() == before, both_tables()

    objects, kept, written = in_fresh_netns("nfqboth2", look_then_write, "")
    assert objects == {4: rules.OBJECTS, 6: None}
    assert kept, "written in place"
    assert written == afresh
    retyped = (f"delete table ip {CFG.table}\nadd table ip {CFG.table}\n"
               f"add set ip {CFG.table} ports {{ type ipv4_addr; }}\n")
    objects, kept, written = in_fresh_netns("nfqboth3", look_then_write, retyped)
    assert objects == {4: rules.OBJECTS, 6: None}
    assert not kept, "refused in place, then replaced"
    assert written == afresh


@pytest.mark.parametrize("in_place", [True, False])
def test_a_whole_write_in_place_keeps_the_syns_waiting_in_the_queue(in_place: bool) -> None:
    """A SYN waits, unanswered, while the table is written whole. In place, its verdict
    then finds it and the connect completes at once. A replacement unregisters hooks, and
    the kernel drops every queued packet with them: the verdict is refused, and the client
    would retransmit a second later."""
    if os.geteuid() != 0:
        pytest.skip("needs root (network namespaces)")
    with topology() as topo:
        echo = in_netns(topo.pod1, backends.start, POD1_IP, BACKEND_PORT, "pod1")
        q = in_netns(topo.node, QueueSocket, CFG.queue)
        client = socket_in(topo.client)
        try:
            in_netns(topo.node, rules.install, CFG, SERVED, "xt")
            client.setblocking(False)
            client.connect_ex((NODE_IP, FORWARD))
            assert select.select([q], [], [], 2.0)[0], "the SYN was not queued"
            (syn,) = q.read_batch()
            res = subprocess.run(["ip", "netns", "exec", topo.node, "nft", "-f", "-"],
                                 input=rules.nft_script(CFG, SERVED, in_place=in_place),
                                 text=True, capture_output=True, check=False)
            assert res.returncode == 0, res.stderr
            q.send_verdicts([netlink.accept(syn.packet_id,
                                            CFG.layout.verdict_mark(syn.mark,
                                                                    CFG.layout.forward(POD1)))])
            connected = select.select([], [client], [], 0.5)[1] and not client.getsockopt(
                socket.SOL_SOCKET, socket.SO_ERROR)
            if select.select([q], [], [], 0.2)[0]:
                q.read_batch()  # the kernel's answer to a refused verdict, if any
            assert (bool(connected), q.verdict_errors) == ((True, 0) if in_place else (False, 1))
        finally:
            client.close()
            q.close()
            echo.stop()


def test_a_change_to_a_table_that_is_not_as_written_is_refused_whole() -> None:
    """Someone deleted a map element: the delta fails and changes nothing (kpx then writes
    the whole table)."""
    if os.geteuid() != 0:
        pytest.skip("needs root (network namespaces)")
    delta = rules.update_script(CFG.table, OLD, NEW, CFG.layout)

    def tamper_then_apply() -> tuple[int, str, str]:
        subprocess.run(["nft", "-f", "-"], input=rules.nft_script(CFG, OLD), text=True,
                       check=True)
        sh("nft", "delete", "element", "ip", CFG.table, "np_targets",
           "{ 0x00020000 . tcp . 30080 }")
        before = sh("nft", "list", "table", "ip", CFG.table).stdout
        res = subprocess.run(["nft", "-f", "-"], input=delta, text=True, capture_output=True,
                             check=False)
        return res.returncode, before, sh("nft", "list", "table", "ip", CFG.table).stdout

    rc, before, after = in_fresh_netns("nfqdelta3", tamper_then_apply)
    assert rc != 0 and before == after


def test_tcp_be_liberal_is_written_in_kpxs_namespace_only() -> None:
    """``--conntrack-tcp-be-liberal``'s sysctl is per namespace: kpx writes it where it
    runs, and the namespace it was started from keeps its own value."""
    if os.geteuid() != 0:
        pytest.skip("needs root (network namespaces)")
    key = "net/netfilter/nf_conntrack_tcp_be_liberal"
    outside = Path("/proc/sys", key).read_text()

    def apply_then_read() -> tuple[dict[str, int], str]:
        # A rule that tracks connections loads conntrack, and with it the sysctl, as
        # kpx's own rules do before it sets them.
        subprocess.run(["nft", "-f", "-"], check=True, text=True, input=(
            "table ip kpx_ct_test {\n chain c {\n type filter hook prerouting priority 0\n"
            " ct state new accept\n }\n}\n"))
        done = conntrack.apply(conntrack.Settings(tcp_be_liberal=True))
        return done, Path("/proc/sys", key).read_text()

    done, inside = in_fresh_netns("nfqliberal", apply_then_read)
    assert done[key] == 1 and inside == "1\n"
    assert Path("/proc/sys", key).read_text() == outside
