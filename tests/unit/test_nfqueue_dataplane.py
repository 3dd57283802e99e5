"""nfqueue mode's pure parts: target numbering, what is queued, conntrack's settings.

Target indices are stable while an endpoint stays, retired one sync after
it leaves (SYNs decided just before must still find it), reused after
that, and bounded by the mark; a NodePort is queued on every address or on
``--nodeport-addresses`` only, a VIP port on its VIP, a port without
endpoints nowhere; conntrack's values follow kube-proxy's flags.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import socket
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from proxy.commands import node as node_command
from proxy.core.decision import build_plans
from proxy.core.model import EndpointPort, ServicePort
from proxy.core.sync import SyncConfig, SyncResult, compute_sync
from proxy.k8s import parse_state
from proxy.nfqueue import conntrack, netlink, rules
from proxy.nfqueue import dataplane as nfq_dataplane
from proxy.nfqueue.dataplane import NfqueueDataplane, Slots, Tables, Targets, served_for
from proxy.nfqueue.netlink import NF_ACCEPT, NF_DROP, Packet, Verdict
from tests.support import objects
from tests.support.model import endpoint, endpoint_slice, service, snapshot
from tests.support.objects import node, state_yaml

A, B, C = ("10.244.1.5", 8080), ("10.244.2.5", 8080), ("10.244.3.5", 8080)


def test_indices_are_stable_retired_a_sync_later_then_reused() -> None:
    t = Targets(max_index=10)
    first = t.assign({A, B})
    assert sorted(first.values()) == [A, B] and t.index == {A: 1, B: 2}
    second = t.assign({B, C})  # A leaves: still in the map for one more sync
    assert t.index == {B: 2, C: 3} and second[1] == A
    third = t.assign({B, C})
    assert 1 not in third  # retired now
    t.assign({B, C, ("10.244.4.5", 8080)})
    assert t.index[("10.244.4.5", 8080)] == 1  # its index is reused


def test_more_endpoints_than_the_mark_can_number_is_an_error() -> None:
    t = Targets(max_index=2)
    with pytest.raises(ValueError, match="at most 2 distinct endpoints"):
        t.assign({A, B, C})


def test_slots_are_numbered_per_frontend_so_the_node_may_hold_more_than_a_mark_numbers() -> None:
    """Two endpoints per frontend and a mark that numbers two: three frontends fit."""
    s = Slots(max_slot=2)
    np_, vip, udp = (None, "tcp", 30080), ("10.96.0.10", "tcp", 80), (None, "udp", 30080)
    got = s.assign({np_: {A, B}, vip: {A, C}, udp: {B, C}})
    assert got == {np_: {1: A, 2: B}, vip: {1: A, 2: C}, udp: {1: B, 2: C}}
    assert s.index(vip) == {A: 1, C: 2}
    # A frontend that goes keeps its slots in the maps for one more sync.
    assert s.assign({np_: {A, B}, udp: {B, C}})[vip] == {1: A, 2: C}
    assert vip not in s.assign({np_: {A, B}, udp: {B, C}}) and s.index(vip) == {}
    with pytest.raises(ValueError, match=r"NodePort 30080/tcp: more than 2 endpoints"):
        s.assign({np_: {A, B, C}})


def plans(*eps: tuple[str, int], node_port: int = 30080) -> dict[object, object]:
    svc = dataclasses.replace(service("web", node_port=node_port), cluster_ip="10.96.0.10")
    sl = endpoint_slice(svc, [endpoint(ip, "node-a") for ip, _ in eps])
    return build_plans(snapshot([svc], [sl]), "node-a", vips=True)  # type: ignore[return-value]


def test_what_is_queued() -> None:
    fe = (None, "tcp", 30080)
    served = served_for(plans(A), ("0.0.0.0",), {fe: {1: A}})  # type: ignore[arg-type]
    assert served.ports == {30080} and served.pairs == {("10.96.0.10", 80)}
    assert served.vips == {"10.96.0.10"} and served.targets == {fe: {1: A}}
    narrow = served_for(plans(A), ("192.0.2.1", "127.0.0.1"), {})  # type: ignore[arg-type]
    assert narrow.ports == set()
    assert narrow.pairs == {("192.0.2.1", 30080), ("127.0.0.1", 30080), ("10.96.0.10", 80)}
    empty = served_for(plans(), ("0.0.0.0",), {})  # type: ignore[arg-type]
    # No endpoint: nothing queued; the VIP stays known, so its SYNs are rejected.
    assert empty.ports == set() and empty.pairs == set() and empty.vips == {"10.96.0.10"}


def test_conntrack_values_follow_kube_proxys_flags(tmp_path: Path) -> None:
    s = conntrack.Settings()
    assert s.wanted_max(cpus=2) == 131072 and s.wanted_max(cpus=8) == 262144
    got = conntrack.wanted(conntrack.Settings(tcp_established=0, max_per_core=0), cpus=2)
    assert got == {"net/ipv4/conf/all/route_localnet": 1,
                   "net/netfilter/nf_conntrack_tcp_timeout_close_wait": 3600,
                   "net/netfilter/nf_conntrack_udp_timeout": 30,
                   "net/netfilter/nf_conntrack_udp_timeout_stream": 120}
    # Applied to a fake /proc/sys: written where different, nf_conntrack_max only raised.
    for key, value in {"net/ipv4/conf/all/route_localnet": 0,
                       "net/netfilter/nf_conntrack_tcp_timeout_established": 432000,
                       "net/netfilter/nf_conntrack_tcp_timeout_close_wait": 3600,
                       "net/netfilter/nf_conntrack_max": 10_000_000}.items():
        (tmp_path / key).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / key).write_text(f"{value}\n")
    done = conntrack.apply(conntrack.Settings(), root=tmp_path)
    assert done == {"net/ipv4/conf/all/route_localnet": 1,
                    "net/netfilter/nf_conntrack_tcp_timeout_established": 86400}
    assert (tmp_path / "net/netfilter/nf_conntrack_max").read_text() == "10000000\n"


def test_tcp_be_liberal_is_set_only_when_asked(tmp_path: Path) -> None:
    """``--conntrack-tcp-be-liberal`` as kube-proxy's: written to 1 when given; without
    it kpx neither sets the sysctl nor clears what someone else set."""
    key = "net/netfilter/nf_conntrack_tcp_be_liberal"
    parser = argparse.ArgumentParser()
    node_command.configure(parser)
    args = parser.parse_args(["--conntrack-tcp-be-liberal"])
    assert conntrack.wanted(conntrack.Settings.from_flags(args), cpus=2)[key] == 1
    default = parser.parse_args([])
    assert key not in conntrack.wanted(conntrack.Settings.from_flags(default), cpus=2)
    (tmp_path / key).parent.mkdir(parents=True)
    (tmp_path / key).write_text("0\n")
    assert key in conntrack.apply(conntrack.Settings(tcp_be_liberal=True), root=tmp_path)
    assert (tmp_path / key).read_text() == "1\n"
    assert key not in conntrack.apply(conntrack.Settings(), root=tmp_path)
    assert (tmp_path / key).read_text() == "1\n"


def test_a_udp_port_is_queued_in_the_udp_sets_only() -> None:
    svc = dataclasses.replace(service("dns", ports=(ServicePort("dns", "UDP", 53, 53, 30053),)),
                              cluster_ip="10.96.0.10")
    sl = endpoint_slice(svc, [endpoint("10.244.1.5")],
                        ports=[EndpointPort("dns", 53, "UDP")])
    tcp = build_plans(snapshot([svc], [sl]), "node-a", vips=True)
    udp = build_plans(snapshot([svc], [sl]), "node-a", vips=True, protocol="UDP")
    served = served_for(tcp, ("0.0.0.0",), {}, udp)  # type: ignore[arg-type]
    assert served.ports == set() and served.pairs == set()
    assert served.udp_ports == {30053} and served.udp_pairs == {("10.96.0.10", 53)}
    assert served.vips == {"10.96.0.10"}  # a UDP-only VIP still rejects what it does not serve


def test_conntrack_udp_timeouts_are_whole_seconds_rounded_up() -> None:
    got = conntrack.wanted(conntrack.Settings(udp=0.4, udp_stream=90.5), cpus=2)
    assert got["net/netfilter/nf_conntrack_udp_timeout"] == 1
    assert got["net/netfilter/nf_conntrack_udp_timeout_stream"] == 91
    kept = conntrack.wanted(conntrack.Settings(udp=0, udp_stream=0), cpus=2)
    assert not any("udp" in k for k in kept)  # 0 leaves them as they are


NODE = "192.0.2.1"


def udp_plans(*ips: str, node_port: int = 30053) -> dict[object, object]:
    svc = dataclasses.replace(
        service("dns", ports=(ServicePort("dns", "UDP", 53, 8053, node_port),)),
        cluster_ip="10.96.0.10")
    sl = endpoint_slice(svc, [endpoint(ip, "node-a") for ip in ips],
                        ports=[EndpointPort("dns", 8053, "UDP")])
    return build_plans(snapshot([svc], [sl]), "node-a", vips=True,  # type: ignore[return-value]
                       protocol="UDP")


def entry(dst: str, dport: int, reply_src: str) -> conntrack.UdpEntry:
    return conntrack.UdpEntry("10.0.0.9", 40000, dst, dport, reply_src)


def test_stale_udp_names_flows_pinned_to_what_is_no_longer_an_endpoint() -> None:
    """kube-proxy's CleanStaleEntries: by VIP:port, and by NodePort on this node's addresses."""
    table = udp_plans("10.244.1.5", "10.244.2.5")
    kept = [
        entry("10.96.0.10", 53, "10.244.1.5"),  # to a live endpoint
        entry(NODE, 30053, "10.244.2.5"),
        entry("10.96.0.10", 80, "10.244.9.9"),  # another port of the VIP: not ours
        entry("198.51.100.7", 30053, "198.51.100.7"),  # the port on someone else's address
        entry("10.96.0.11", 53, "10.244.9.9"),  # another VIP
    ]
    stale = [
        entry("10.96.0.10", 53, "10.244.9.9"),  # a deleted pod
        entry(NODE, 30053, NODE),  # answered by the node itself while there was no endpoint
        entry("127.0.0.1", 30053, "10.244.9.9"),  # the node's own, over localhost
    ]
    got = conntrack.stale_udp([*kept, *stale], table, {NODE})  # type: ignore[arg-type]
    assert got == stale


def test_a_udp_port_without_endpoints_keeps_its_flows() -> None:
    """Nothing better to move them to (kube-proxy skips such a service too)."""
    table = udp_plans()
    assert conntrack.serving(table) == ({}, {})  # type: ignore[arg-type]
    assert conntrack.stale_udp([entry(NODE, 30053, NODE)], table, {NODE}) == []  # type: ignore[arg-type]


# -- the reader: which table decides, and a batch that fails --------------------------


def syn(dport: int, src: str = "192.0.2.7", dst: str = "10.77.0.11") -> bytes:
    """An IPv4 header and the first 20 bytes of a TCP SYN: what the queue copies."""
    ip = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 40, 1, 0, 64, 6, 0,
                     socket.inet_aton(src), socket.inet_aton(dst))
    return ip + struct.pack("!HHIIBBHHH", 40000, dport, 1, 0, 5 << 4, 0x02, 65535, 0, 0)


class FakeQueue:
    """What the reader uses of a ``QueueSocket``: batches in (a pipe byte each), verdicts out.

    A batch stands for one datagram: ``read_batch`` reads up to ``max_reads`` of
    those waiting, and never blocks, as the socket's does: nothing waiting reads
    as no packets.
    """

    def __init__(self, batches: list[list[Packet]]) -> None:
        self.batches = batches
        self.sent: list[Verdict] = []
        self._r, self._w = os.pipe2(os.O_NONBLOCK)
        os.write(self._w, b"b" * len(batches))

    def fileno(self) -> int:
        return self._r

    def read_batch(self, max_reads: int = 64) -> list[Packet]:
        try:
            waiting = len(os.read(self._r, max_reads))
        except BlockingIOError:
            return []
        return [p for _ in range(waiting) for p in self.batches.pop(0)]

    def send_verdicts(self, verdicts: list[Verdict]) -> None:
        self.sent.extend(verdicts)

    def close(self) -> None:
        os.close(self._r)
        os.close(self._w)


@pytest.fixture
def dataplane() -> Iterator[NfqueueDataplane]:
    """A dataplane that never binds: only its reader's halves are driven, by hand."""
    loop = asyncio.new_event_loop()
    dp = NfqueueDataplane(loop=loop)
    dp.local_addresses = frozenset({"10.77.0.11"})
    yield dp
    loop.close()


def test_a_port_the_table_in_force_lacks_is_decided_by_the_table_being_written(
        dataplane: NfqueueDataplane) -> None:
    """nft committed the new port, so the SYN was queued: the swap has not happened yet."""
    dp = dataplane
    dp._tables = Tables(dp._tabulate({}, ("0.0.0.0",), {}))
    dp._pending = Tables(dp._tabulate(plans(A), ("0.0.0.0",), {}))  # type: ignore[arg-type]
    q = FakeQueue([])
    dp._answer(q, [Packet(1, 0, syn(30080)), Packet(2, 0, syn(30099))],  # type: ignore[arg-type]
               dp._tables)
    lay = dp.cfg.layout
    assert q.sent[0] == Verdict(1, NF_ACCEPT, lay.forward(1))  # A's slot in the new table
    assert q.sent[1] == Verdict(2, NF_ACCEPT, lay.reject)  # in neither table: refused
    assert dp.decided == {"forward": 1, "drop": 0, "reject": 0, "unknown": 1}


class SwapDuringRead(FakeQueue):
    """A batch read while the loop's ``_put`` puts the new tables in force: the reads
    release the GIL, and ``_put`` ends with ``self._tables, self._pending = new, None``."""

    def __init__(self, dp: NfqueueDataplane, batches: list[list[Packet]],
                 new: Tables) -> None:
        super().__init__(batches)
        self.dp, self.new = dp, new

    def read_batch(self, max_reads: int = 64) -> list[Packet]:
        got = super().read_batch(max_reads)
        self.dp._tables, self.dp._pending = self.new, None
        return got


def test_a_port_put_in_force_while_its_syn_was_read_is_decided_by_the_tables_now_in_force(
        dataplane: NfqueueDataplane) -> None:
    """The reader's tables are those of the batch's start; when the swap lands during the
    batch's reads, neither they nor ``_pending`` (cleared) serve the new port: the tables
    in force do, and a refusal would reset a client of a served port."""
    dp = dataplane
    dp._tables = Tables(dp._tabulate({}, ("0.0.0.0",), {}))
    new = Tables(dp._tabulate(plans(A), ("0.0.0.0",), {}))  # type: ignore[arg-type]
    dp._pending = new  # nft has it: the port's SYNs are queued
    tables = dp._fresh(None)  # the reader's, at the top of its loop: the old ones
    q = SwapDuringRead(dp, [[Packet(1, 0, syn(30080)), Packet(2, 0, syn(30099))]], new)
    assert dp._take(q, tables, 1) == 2
    lay = dp.cfg.layout
    assert q.sent == [Verdict(1, NF_ACCEPT, lay.forward(1)),  # A's slot in force
                      Verdict(2, NF_ACCEPT, lay.reject)]  # still served by no table


def test_every_verdict_keeps_the_packets_own_mark_bits_outside_kpxs_mask(
        dataplane: NfqueueDataplane) -> None:
    """A mark verdict replaces the whole mark: the bits another program set (here 0x4001
    and kube-proxy's 0x8000, all outside kpx's mask) must come back as they were, on a
    forward, a refusal and a port neither table serves. kpx's own bits are its decision's."""
    dp = dataplane
    lay = dp.cfg.layout
    theirs = 0x0000_C001
    assert theirs & lay.mask == 0
    dp._tables = Tables(dp._tabulate(plans(A) | {  # type: ignore[operator]
        k: dataclasses.replace(v, cluster=(), local=(), has_any=False)
        for k, v in plans(A, node_port=30081).items()}, ("0.0.0.0",), {}))
    q = FakeQueue([])
    stale = theirs | lay.mask  # kpx's bits set by someone: replaced, not kept
    dp._answer(q, [Packet(1, stale, syn(30080)), Packet(2, stale, syn(30081)),  # type: ignore[arg-type]
                   Packet(3, stale, syn(30099))], dp._tables)
    assert q.sent == [Verdict(1, NF_ACCEPT, theirs | lay.forward(1)),  # forwarded
                      Verdict(2, NF_ACCEPT, theirs | lay.reject),  # no endpoints: refused
                      Verdict(3, NF_ACCEPT, theirs | lay.reject)]  # served by neither table
    q.close()


def test_the_reader_outlives_a_batch_it_cannot_decide_and_drops_that_batch(
        dataplane: NfqueueDataplane) -> None:
    dp = dataplane
    dp._tables = Tables(dp._tabulate(plans(A), ("0.0.0.0",), {}))  # type: ignore[arg-type]
    q = FakeQueue([[Packet(1, 0, syn(30080))], [Packet(2, 0, syn(30080))]])
    calls = 0
    answer = dp._answer

    def flaky(sock: Any, packets: list[Packet], table: Any) -> None:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("a planted bug")
        answer(sock, packets, table)

    dp._answer = flaky  # type: ignore[method-assign]
    dp._start_reader(q)  # type: ignore[arg-type]
    reader = dp._reader
    assert reader is not None
    deadline = time.monotonic() + 5
    while len(q.sent) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    dp._stop_reader()  # woken through its pipe, not by a time-out
    q.close()
    assert not reader.is_alive()
    assert q.sent == [Verdict(1, NF_DROP, None),
                      Verdict(2, NF_ACCEPT, dp.cfg.layout.forward(1))]


# -- the reader's batches: a busy node's SYNs gather, a lone SYN never waits ----------

class TimedQueue(FakeQueue):
    """A FakeQueue that notes when each verdict left (monotonic seconds)."""

    def __init__(self, batches: list[list[Packet]]) -> None:
        super().__init__(batches)
        self.sent_at: list[float] = []

    def send_verdicts(self, verdicts: list[Verdict]) -> None:
        super().send_verdicts(verdicts)
        self.sent_at.extend(time.monotonic() for _ in verdicts)


def run_reader(dp: NfqueueDataplane, q: TimedQueue, want: int, timeout: float) -> None:
    """Start the reader on ``q``, wait (at most ``timeout``) for ``want`` verdicts, stop it."""
    dp._tables = Tables(dp._tabulate(plans(A), ("0.0.0.0",), {}))  # type: ignore[arg-type]
    dp._start_reader(q)  # type: ignore[arg-type]
    deadline = time.monotonic() + timeout
    while len(q.sent) < want and time.monotonic() < deadline:
        time.sleep(0.01)
    dp._stop_reader()
    q.close()


def test_after_syns_that_came_together_the_reader_lets_the_next_ones_gather(
        dataplane: NfqueueDataplane) -> None:
    """Two SYNs in one read mean a busy node: the next batch is read batch_wait later,
    though it was waiting already (each batch's pipe byte is written up front)."""
    dp = dataplane
    dp.batch_wait = 0.3
    q = TimedQueue([[Packet(1, 0, syn(30080)), Packet(2, 0, syn(30080))],
                    [Packet(3, 0, syn(30080))]])
    run_reader(dp, q, 3, timeout=10)
    assert [v.packet_id for v in q.sent] == [1, 2, 3]
    assert q.sent_at[2] - q.sent_at[1] >= 0.3


class OneAtATimeQueue(TimedQueue):
    """The one-at-a-time client of an idle node: each SYN comes once the reader, its last
    verdict sent, has found the queue empty (it goes back to sleep), not before."""

    def __init__(self, batches: list[list[Packet]]) -> None:
        super().__init__(batches)
        os.read(self._r, len(batches) - 1)  # only the first is waiting

    def read_batch(self, max_reads: int = 64) -> list[Packet]:
        got = super().read_batch(max_reads)
        if not got and self.batches:
            os.write(self._w, b"b")
        return got


def test_a_lone_syn_never_makes_the_next_one_wait(dataplane: NfqueueDataplane) -> None:
    """No wait after a batch of one. Were there one, the second SYN would be answered
    30 s later, past the 10 s this test allows."""
    dp = dataplane
    dp.batch_wait = 30.0
    q = OneAtATimeQueue([[Packet(1, 0, syn(30080))], [Packet(2, 0, syn(30080))],
                         [Packet(3, 0, syn(30080))]])
    run_reader(dp, q, 3, timeout=10)
    assert [v.packet_id for v in q.sent] == [1, 2, 3]
    assert q.sent_at[2] - q.sent_at[0] < 10


def test_syns_waiting_behind_a_lone_one_are_answered_at_once_then_the_next_ones_gather(
        dataplane: NfqueueDataplane) -> None:
    """An idle reader answers its first SYN before it reads on; the ones found waiting
    behind it are answered in the same wake-up (none waits out a batch), and mean a busy
    node: what comes after them waits ``batch_wait``."""
    dp = dataplane
    # Far longer than any stall of a loaded machine, so "at once" and "waited" cannot mix.
    dp.batch_wait = 1.0
    q = TimedQueue([[Packet(1, 0, syn(30080))], [Packet(2, 0, syn(30080))],
                    [Packet(3, 0, syn(30080))]])
    sent_first = q.send_verdicts
    order: list[str] = []

    def noting(verdicts: list[Verdict]) -> None:
        order.append("verdict")
        sent_first(verdicts)

    read = q.read_batch

    def reading(max_reads: int = 64) -> list[Packet]:
        order.append(f"read {max_reads}")
        return read(max_reads)

    q.send_verdicts, q.read_batch = noting, reading  # type: ignore[method-assign]
    q.batches.append([Packet(4, 0, syn(30080))])  # comes later: no pipe byte yet
    dp._tables = Tables(dp._tabulate(plans(A), ("0.0.0.0",), {}))  # type: ignore[arg-type]
    dp._start_reader(q)  # type: ignore[arg-type]
    deadline = time.monotonic() + 5
    while len(q.sent) < 2 and time.monotonic() < deadline:
        time.sleep(0.001)
    os.write(q._w, b"b")
    while len(q.sent) < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    dp._stop_reader()
    q.close()
    assert [v.packet_id for v in q.sent] == [1, 2, 3, 4]
    assert order[:2] == ["read 1", "verdict"]  # the lone SYN's verdict before the next read
    assert q.sent_at[2] - q.sent_at[0] < 1.0  # 2 and 3 came with it: answered at once
    assert q.sent_at[3] - q.sent_at[2] >= 1.0  # a busy node now: 4 waited to gather


def test_a_reader_woken_to_stop_still_answers_what_is_queued(
        dataplane: NfqueueDataplane) -> None:
    """A restart's old process answers every SYN queued when it stops: closing the socket
    would drop them, and their clients would retransmit a second later. The reader is
    asleep in its batch wait when the last SYN comes and the stop is asked for, so it sees
    both at once."""
    dp = dataplane
    dp.batch_wait = 2.0
    q = FakeQueue([[Packet(1, 0, syn(30080)), Packet(2, 0, syn(30080))]])
    dp._tables = Tables(dp._tabulate(plans(A), ("0.0.0.0",), {}))  # type: ignore[arg-type]
    dp._start_reader(q)  # type: ignore[arg-type]
    deadline = time.monotonic() + 5
    while len(q.sent) < 2 and time.monotonic() < deadline:
        time.sleep(0.001)
    q.batches.append([Packet(3, 0, syn(30080))])  # queued while it waits out the batch
    os.write(q._w, b"b")
    dp._stop_reader()
    q.close()
    assert [v.packet_id for v in q.sent] == [1, 2, 3]
    assert q.sent[2] == Verdict(3, NF_ACCEPT, dp.cfg.layout.forward(1))


class Steps:
    """What the dataplane did to the kernel, in order: a fake queue socket and rules."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, dp: NfqueueDataplane) -> None:
        self.done: list[str] = []
        self.failing = False
        """Every install fails (as nft would with the rules refused)."""
        steps = self
        monkeypatch.setattr(nfq_dataplane, "PUT_RETRY", 0.01)

        class Bound:
            def __init__(self, queue: int, **_: Any) -> None:
                steps.done.append("bind")

            def close(self) -> None:
                steps.done.append("unbind")

        def choose(queue: int) -> str:
            self.done.append("probe")
            return "xt"

        def table_objects(table: str, family: int) -> None:
            self.done.append(f"list IPv{family}")

        def write_tables(cfg: Any, served: Any, mechanism: Any, objects: Any) -> None:
            assert mechanism == "xt", "probed once, before"
            assert sorted(served) == sorted(objects) == sorted(dp.families)
            self.done.append("write")
            if self.failing:
                raise RuntimeError("nft -f: Could not process rule: Device or resource busy")

        def queue_syns(cfg: Any, mechanism: Any, family: int) -> None:
            self.done.append(f"queue IPv{family}")

        monkeypatch.setattr(netlink, "QueueSocket", Bound)
        monkeypatch.setattr(rules, "choose_mechanism", choose)
        monkeypatch.setattr(rules, "table_objects", table_objects)
        monkeypatch.setattr(rules, "write_tables", write_tables)
        monkeypatch.setattr(rules, "queue_syns", queue_syns)
        def start_reader(sock: Any) -> None:
            self.done.append("read")
            dp._reader = threading.Thread(target=lambda: None)  # stands for it: never joined

        monkeypatch.setattr(dp, "_start_reader", start_reader)


def nfq_sync() -> SyncResult:
    snap = parse_state(state_yaml(node("node-a", "10.77.1.1"), objects.service(),
                                  objects.endpoint_slice("web",
                                                         objects.endpoint("10.1.0.2", "node-a"))))
    return compute_sync(snap, SyncConfig(node_name="node-a"))


def lists(dp: NfqueueDataplane) -> list[str]:
    return [f"list IPv{f}" for f in dp.families]


def queues(dp: NfqueueDataplane) -> list[str]:
    return [f"queue IPv{f}" for f in dp.families]


def test_the_queue_is_read_once_the_first_tables_are_written_and_before_anything_else(
        monkeypatch: pytest.MonkeyPatch, dataplane: NfqueueDataplane) -> None:
    """A SYN queued by rules left from before (a SIGKILLed kpx's: their slots may name other
    endpoints) waits in the kernel until this process's tables are written: both families'
    in one transaction, looked at before the bind. The queueing rules wait for the reader:
    nothing they queue would be read sooner."""
    dp = dataplane
    steps = Steps(monkeypatch, dp)
    dp.apply(nfq_sync())
    dp.loop.run_until_complete(asyncio.wait_for(dp.applied(), 10))
    assert steps.done == ["probe", *lists(dp), "bind", "write", "read", *queues(dp)]
    assert dp.generation_in_force == dp.generation
    dp.apply(nfq_sync())  # the next write is a change: nothing is listed or queued again
    dp.loop.run_until_complete(asyncio.wait_for(dp.applied(), 10))
    assert steps.done == ["probe", *lists(dp), "bind", "write", "read", *queues(dp)]


def test_a_successor_works_out_its_tables_then_binds_and_writes_only_when_told(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Its predecessor decides SYNs and holds the queue until this one is ``prepared``; then
    the old one lets go, and ``proceed`` binds the queue, writes the tables and reads."""
    loop = asyncio.new_event_loop()
    dp = NfqueueDataplane(loop=loop, successor=True)
    steps = Steps(monkeypatch, dp)
    try:
        dp.apply(nfq_sync())
        loop.run_until_complete(asyncio.wait_for(dp.prepared.wait(), 10))
        assert steps.done == ["probe", *lists(dp)], "nothing of the kernel's is changed"
        assert dp.generation_in_force == -1
        dp.proceed()
        loop.run_until_complete(asyncio.wait_for(dp.applied(), 10))
        assert steps.done == ["probe", *lists(dp), "bind", "write", "read", *queues(dp)]
    finally:
        loop.close()


def run_until(loop: asyncio.AbstractEventLoop, done: Any, timeout: float = 10) -> None:
    """Run ``loop`` until ``done()`` holds (a test failure after ``timeout``)."""
    async def wait() -> None:
        while not done():
            await asyncio.sleep(0.005)
    loop.run_until_complete(asyncio.wait_for(wait(), timeout))


def test_a_queue_whose_first_tables_fail_is_read_and_every_syn_refused_until_they_go_in(
        monkeypatch: pytest.MonkeyPatch, dataplane: NfqueueDataplane) -> None:
    """Left unread, the SYNs that rules from before queue (a predecessor's, a SIGKILLed
    kpx's) would each wait until the queue is full, then be dropped: every client would time
    out. Read with no tables, each is refused (``_answer``: no plan is a reject). Not at the
    first failure: one busy nft costs the waiting SYNs a second, not a refusal."""
    dp = dataplane
    steps = Steps(monkeypatch, dp)
    steps.failing = True
    dp.apply(nfq_sync())
    run_until(dp.loop, lambda: "read" in steps.done)
    assert steps.done == ["probe", *lists(dp), "bind", "write", *lists(dp), "write", "read"]
    assert dp.generation_in_force == -1
    assert dp._tables == Tables(), "nothing to decide by: every SYN is refused"
    steps.failing = False
    dp.loop.run_until_complete(asyncio.wait_for(dp.applied(), 10))
    assert dp.generation_in_force == dp.generation
    assert steps.done.count("read") == 1, "the reader already reading takes the new tables"


def test_a_successor_whose_tables_cannot_be_worked_out_reads_the_queue_once_it_is_its_own(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """It never says READY, so its predecessor decides SYNs until its grace runs out and
    then passes the queue anyway (``proceed``): from then on this one must answer them."""
    loop = asyncio.new_event_loop()
    dp = NfqueueDataplane(loop=loop, successor=True)
    steps = Steps(monkeypatch, dp)

    def too_many(*_: object) -> Tables:
        raise ValueError("NodePort 30080/tcp: more than 32766 endpoints")

    monkeypatch.setattr(dp, "_tabulate", too_many)
    try:
        dp.apply(nfq_sync())
        loop.run_until_complete(asyncio.sleep(0.2))  # a dozen failed attempts
        assert steps.done == ["probe"], "the predecessor still holds the queue"
        assert not dp.prepared.is_set()
        dp.proceed()
        run_until(loop, lambda: "read" in steps.done)
        assert steps.done == ["probe", "bind", "read"]
    finally:
        assert dp._task is not None
        dp._task.cancel()
        loop.run_until_complete(asyncio.gather(dp._task, return_exceptions=True))
        loop.close()


# -- the NAT keeper a relay leaves (rules.keep_nat) ----------------------------------------

LISTED = ('{"nftables": [{"metainfo": {"version": "1.0.6"}},'
          ' {"table": {"family": "ip", "name": "kpx_nfq"}},'
          ' {"set": {"family": "ip", "name": "ports", "type": "inet_service", "elem": [30080]}},'
          ' {"set": {"family": "ip", "name": "pairs", "type": ["ipv4_addr", "inet_service"],'
          '  "elem": [{"concat": ["10.96.0.10", 80]}]}},'
          ' {"set": {"family": "ip", "name": "udp_ports", "type": "inet_service",'
          '  "elem": [30053]}},'
          ' {"set": {"family": "ip", "name": "vips", "type": "ipv4_addr",'
          '  "elem": ["10.96.0.10"]}}]}')


def test_a_keeper_knows_what_the_table_it_replaced_served() -> None:
    fronts = rules.frontends(LISTED)
    assert fronts == rules.Frontends(frozenset({("tcp", 30080), ("udp", 30053)}),
                                     frozenset({("tcp", "10.96.0.10", 80)}))
    script = rules.keep_script(fronts, 4)
    # Its own, fresh; then the old table goes, in the same transaction.
    assert script.startswith("table ip kpx_nfq_keep\ndelete table ip kpx_nfq_keep\n")
    assert script.endswith("table ip kpx_nfq\ndelete table ip kpx_nfq\n")
    assert "type nat hook prerouting priority -100; policy accept;\n    ct status dnat\n" in script
    assert "set ports { type inet_service; elements = { 30080 }; }" in script
    assert "set pairs { type ipv4_addr . inet_service; elements = { 10.96.0.10 . 80 }; }" in script
    assert "set udp_ports { type inet_service; elements = { 30053 }; }" in script
    # What a keeper lists reads back as the same frontends.
    assert rules.frontends(LISTED.replace('"kpx_nfq"', '"kpx_nfq_keep"')) == fronts
    assert rules.frontends("not json") is None
    with pytest.raises(ValueError, match="not an IPv6 address"):
        rules.keep_script(fronts, 6)


def test_a_keeper_waits_for_open_dnated_connections_to_its_frontends_only() -> None:
    fronts = rules.Frontends(frozenset({("tcp", 30080), ("udp", 30053)}),
                             frozenset({("tcp", "10.96.0.10", 80)}))
    dnat, tcp, udp = conntrack.IPS_DST_NAT, conntrack.TCP, conntrack.UDP
    established, time_wait, close = 3, conntrack.TCP_TIME_WAIT, conntrack.TCP_CLOSE
    e = conntrack.NatEntry
    assert conntrack.still_translated([
        e(tcp, "10.77.0.11", 30080, dnat, established),   # a NodePort's, open
        e(udp, "10.77.0.11", 30053, dnat),                # a UDP flow conntrack pins
        e(tcp, "10.96.0.10", 80, dnat | 0x8, established),  # a VIP's
    ], fronts) == 3
    assert conntrack.still_translated([
        e(tcp, "10.77.0.11", 30080, dnat, time_wait),     # closed
        e(tcp, "10.77.0.11", 30080, dnat, close),
        e(tcp, "10.77.0.11", 30080, 0, established),      # not DNATed: the relay's own
        e(tcp, "10.77.0.11", 30081, dnat, established),   # another port
        e(tcp, "10.96.0.11", 80, dnat, established),      # another VIP
        e(udp, "10.77.0.11", 30080, dnat),                # the port, over the other protocol
    ], fronts) == 0
