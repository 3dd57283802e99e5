"""The topology's in-namespace probes, in a namespace of their own.

``listening_ports`` is what the control workload's apply figure is timed
by, so it must see exactly the listeners of the namespace its thread is in:
not connected sockets, not the root namespace's, and the same set as the
``/proc/net/tcp`` reading it replaced.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
from collections.abc import Iterator

import pytest

from bench import topology
from bench.topology import NsThread, listening_ports

pytestmark = pytest.mark.lab


@pytest.fixture
def ns_thread() -> Iterator[NsThread]:
    if os.geteuid() != 0:
        pytest.skip("needs root (network namespaces)")
    name = f"kbt{os.getpid() % 100000}-probe"
    subprocess.run(["ip", "netns", "add", name], check=True)
    thread = NsThread(name)
    try:
        subprocess.run(["ip", "-n", name, "link", "set", "lo", "up"], check=True)
        yield thread
    finally:
        thread.close()
        subprocess.run(["ip", "netns", "del", name], check=False)


def _sockets(listen_ports: list[int]) -> tuple[list[socket.socket], int]:
    """Listeners on ``listen_ports`` plus one established pair; the pair's client port."""
    socks = []
    for port in listen_ports:
        s = socket.socket()
        s.bind(("127.0.0.1", port))
        s.listen(4)
        socks.append(s)
    client = socket.create_connection(("127.0.0.1", listen_ports[0]))
    server, _ = socks[0].accept()
    socks += [client, server]
    return socks, client.getsockname()[1]


def test_listening_ports_is_exactly_this_namespaces_listeners(ns_thread: NsThread) -> None:
    ports = [20001, 20002, 41234]
    assert ns_thread.call(listening_ports) == set()
    socks, client_port = ns_thread.call(_sockets, ports)
    try:
        seen = ns_thread.call(listening_ports)
        assert seen == set(ports)
        assert client_port not in seen
        assert ns_thread.call(topology._proc_listening_ports) == seen
        for s in socks[1:3]:
            s.close()
        assert ns_thread.call(listening_ports) == {20001}
    finally:
        for s in socks:
            s.close()


def test_listening_ports_reads_a_dump_larger_than_one_message(ns_thread: NsThread) -> None:
    # About 100 bytes per socket: 1,200 listeners need several recv()s' worth
    # of netlink messages, so the multi-part dump is walked to NLMSG_DONE.
    ports = list(range(30000, 31200))
    socks, _ = ns_thread.call(_sockets, ports)
    try:
        assert ns_thread.call(listening_ports) == set(ports)
    finally:
        for s in socks:
            s.close()


def test_kpx_nfqueue_sets_read_from_a_thread_in_the_namespace(ns_thread: NsThread) -> None:
    """What the control workload times kpx-nfq's apply by: ``nft -j list set`` run from
    the namespace's thread sees that namespace's kpx_nfq table, as kpx renders it."""
    rules = pytest.importorskip("proxy.nfqueue.rules")
    if shutil.which("nft") is None:
        pytest.skip("needs nft")
    from bench.control import (
        NFQ_PORTS_SET,
        NFQ_TABLE,
        NFQ_VIPS_SET,
        nft_addresses_of,
        nft_list_set,
        nft_ports_in,
    )

    assert ns_thread.call(nft_list_set, NFQ_TABLE, NFQ_PORTS_SET) == []  # no table yet
    vips = {f"10.96.0.{i}" for i in range(1, 6)}
    served = rules.Served(ports=frozenset(range(20000, 21500)), vips=frozenset(vips))
    subprocess.run(["ip", "netns", "exec", ns_thread.ns, "nft", "-f", "-"], check=True,
                   text=True, input=rules.nft_script(rules.QueueConfig(), served, "xt"))
    ports = ns_thread.call(nft_list_set, NFQ_TABLE, NFQ_PORTS_SET)
    assert nft_ports_in(ports, 20000, 21500) == 1500
    assert nft_ports_in(ports, 20000, 20010) == 10
    got = ns_thread.call(nft_list_set, NFQ_TABLE, NFQ_VIPS_SET)
    assert nft_addresses_of(got, vips | {"10.96.0.9"}) == 5
    # Absent reads as empty (kpx not started, or gone); any other failure is an error.
    with pytest.raises(OSError, match=r"list set ip kpx_nfq ports!.*syntax error"):
        ns_thread.call(nft_list_set, NFQ_TABLE, "ports!")


def _refused_connect() -> None:
    """A connect to a port nobody listens on: this namespace's kernel answers the SYN
    with a reset."""
    with socket.socket() as s:
        s.settimeout(5)
        with pytest.raises(ConnectionRefusedError):
            s.connect(("127.0.0.1", 9))


def test_read_counters_are_this_namespaces_own(ns_thread: NsThread) -> None:
    """One refused connect in a fresh namespace moves exactly its own counters by one:
    the reading is of the thread's namespace, where nothing else runs."""
    before = {"ns": ns_thread.call(topology.read_counters)}
    ns_thread.call(_refused_connect)
    after = {"ns": ns_thread.call(topology.read_counters)}
    moved = topology.counter_deltas(before, after)
    assert moved == {"ns": {"Tcp.ActiveOpens": 1, "Tcp.AttemptFails": 1, "Tcp.OutRsts": 1}}
    # On a forwarding node that reset is a lost connection; on a proxy's, or a client's,
    # a reset is what ends a run's open connections, and says nothing.
    assert topology.explain_losses(moved, forwarder="ns") == (
        "ns Tcp.AttemptFails +1, ns Tcp.OutRsts +1")
    assert topology.explain_losses(moved) == ""
