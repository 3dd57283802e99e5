"""nfqueue mode across restarts: established flows keep flowing, new SYNs are decided again.

kpx fails closed by default: while no process reads the queue, the kernel
drops queued SYNs and the client retransmits. A rolling restart hands the
queue over: the old process decides SYNs until the new one is ready, then
gives the queue back and the new one binds it at once, so no SYN waits for
a retransmit. A SIGKILL leaves the rules behind, and the next kpx puts
exactly one copy of each back. Every established connection is conntrack's
throughout.
"""

from __future__ import annotations

import os
import signal
import socket
import time
from collections.abc import Callable

import pytest

from lab import Lab, netns
from lab.common import wait_until
from tests.support.backends import echoes
from tests.support.labkit import PacedConnects, lab_spec, peer_ip, service, wait_applied, who

pytestmark = [pytest.mark.lab, pytest.mark.serial]

LabFactory = Callable[..., Lab]
NODE = "node2"
NFQ = ["--proxy-mode", "nfqueue"]


def echo_conn(lab: Lab, ip: str, port: int) -> socket.socket:
    s = netns.socket_in(lab.ns("client"), socket.AF_INET, socket.SOCK_STREAM)
    s.settimeout(3.0)
    s.connect((ip, port))
    s.sendall(b"ECHO\n")
    return s


ONE_COPY = (2, 1, 2, 1)
"""Each family's two xt rules (PREROUTING, OUTPUT) and one ``kpx_nfq`` table."""


def kpx_rules(lab: Lab) -> tuple[int, int, int, int]:
    """(kpx's iptables rules, ``ip kpx_nfq`` tables, its ip6tables rules, ``ip6 kpx_nfq``
    tables) in NODE's namespace: nfqueue mode installs both families' whatever the node has."""
    tables = lab.run(NODE, ["nft", "list", "tables"]).stdout.splitlines()
    out: list[int] = []
    for tool, family in (("iptables", "ip"), ("ip6tables", "ip6")):
        save = lab.run(NODE, [f"{tool}-save", "-t", "mangle"]).stdout
        out += [sum("kpx-nfqueue" in line for line in save.splitlines()),
                tables.count(f"table {family} kpx_nfq")]
    return out[0], out[1], out[2], out[3]


def test_a_restart_keeps_established_flows_and_decides_new_syns(
        lab_factory: LabFactory) -> None:
    lab = lab_factory(lab_spec({"web-1": "node1"}, service("web", "Cluster")),
                      extra_proxy_args=NFQ)
    wait_applied(lab)
    port = lab.node_port("default/web")
    ip = lab.node_ip(NODE)
    held = echo_conn(lab, ip, port)
    try:
        assert echoes(held, b"before" * 1000)
        old, new = lab.restart_proxy(NODE)
        wait_until(lambda: not netns.pid_alive(old), 15, what="the old kpx node to exit")
        assert echoes(held, b"during" * 1000), "an established flow broke across the restart"
        # New SYNs are decided by the new process (a SYN dropped in the gap is retried).
        wait_until(lambda: lab.proxy_log(NODE).count("nfqueue rules in force") >= 2, 15,
                   what="the new kpx node's rules in force")
        reply, _ = who(lab, "client", ip, port, timeout=5.0)
        assert reply["pod"] == "web-1"
        assert echoes(held, b"after" * 1000)
        assert kpx_rules(lab) == ONE_COPY

        # SIGKILL: nothing is removed; the next kpx finds the leftovers and keeps one copy.
        os.kill(new, signal.SIGKILL)
        wait_until(lambda: not netns.pid_alive(new), 5, what="the killed kpx node to go")
        assert kpx_rules(lab) == ONE_COPY, "a SIGKILL must leave the rules as they were"
        assert echoes(held, b"orphaned" * 1000), "conntrack forwards with no kpx at all"
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):  # fail-closed: queued SYNs are dropped
            who(lab, "client", ip, port, timeout=1.0)
        assert time.monotonic() - t0 >= 0.9
        lab._start_proxy(NODE)  # as a DaemonSet restarts a killed pod; no old one to stop
        reply, _ = who(lab, "client", ip, port, timeout=5.0)
        assert reply["pod"] == "web-1"
        assert kpx_rules(lab) == ONE_COPY, "a restart after SIGKILL must leave one copy"
    finally:
        held.close()


def test_a_restart_hands_the_queue_over_so_no_syn_waits_for_a_retransmit(
        lab_factory: LabFactory) -> None:
    """A connect every 5 ms across a restart: each one's SYN is answered by the old process
    or the new one. A SYN dropped while nobody held the queue would make its connect take
    a second (the client's retransmit); the old process freed the queue before the new one
    had started, 0.6-0.9 s of such SYNs."""
    lab = lab_factory(lab_spec({"web-1": "node1"}, service("web", "Cluster")),
                      extra_proxy_args=NFQ)
    wait_applied(lab)
    ip, port = lab.node_ip(NODE), lab.node_port("default/web")
    with PacedConnects(lab, "client", ip, port, every=0.005) as load:
        wait_until(lambda: len(load.since(0)) >= 20, 10, what="connects before the restart")
        old, new = lab.restart_proxy(NODE)
        restarted = time.monotonic()
        wait_until(lambda: not netns.pid_alive(old), 15, what="the old kpx node to exit")
        gone = time.monotonic()
        wait_until(lambda: len(load.since(gone)) >= 20, 10, what="connects after it exited")
    during = [c for c in load.done if restarted <= c.started < gone]
    assert len(during) >= 20, f"only {len(during)} connects during the handover"
    failed = [c for c in load.done if c.outcome != "ok"]
    assert not failed, f"{len(failed)} of {len(load.done)} connects failed: {failed[:3]}"
    slow = [c for c in load.done if c.took >= 0.9]
    assert not slow, (f"{len(slow)} of {len(load.done)} connects waited for a retransmitted "
                      f"SYN, from {slow[0].started - restarted:+.3f}s to "
                      f"{slow[-1].started - restarted:+.3f}s after the restart")
    log = lab.proxy_log(NODE)
    assert f"handed this network namespace to kpx node pid {new}" in log
    assert "nfqueue: another kpx is present; its rules stay" in log
    assert kpx_rules(lab) == ONE_COPY


def keepers(lab: Lab) -> set[str]:
    """NODE's NAT keepers' families (``ip``, ``ip6``: ``kpx_nfq_keep``)."""
    tables = lab.run(NODE, ["nft", "list", "tables"]).stdout.splitlines()
    return {fam for fam in ("ip", "ip6") if f"table {fam} kpx_nfq_keep" in tables}


def test_a_restart_into_userspace_mode_removes_the_queueing_rules(
        lab_factory: LabFactory) -> None:
    """As kube-proxy cleans up its other modes' rules at start. The old process sees its
    successor present and leaves its rules, which would queue every SYN to a queue that no
    process reads: the relay's listeners would never see one.

    The relay removes them before it says READY, and the old process decides SYNs until
    then: no connect waits for a retransmit (one did, for up to a second, when the old
    process gave the namespace up at once). A connection they DNATed goes on: the table
    becomes a NAT keeper, without which the node stopped tracking it and reset it; the
    keeper goes once that connection has closed."""
    lab = lab_factory(lab_spec({"web-1": "node1"}, service("web", "Cluster")),
                      extra_proxy_args=NFQ)
    wait_applied(lab)
    ip, port = lab.node_ip(NODE), lab.node_port("default/web")
    assert who(lab, "client", ip, port)[0]["pod"] == "web-1"
    assert kpx_rules(lab) == ONE_COPY
    held = echo_conn(lab, ip, port)  # DNATed by nfqueue mode's rules
    try:
        assert echoes(held, b"before" * 1000)
        lab.extra_proxy_args = ()  # the relay, kpx's default
        with PacedConnects(lab, "client", ip, port, every=0.005, max_count=800) as load:
            wait_until(lambda: len(load.since(0)) >= 20, 10, what="connects before the restart")
            old, new = lab.restart_proxy(NODE)
            wait_until(lambda: not netns.pid_alive(old), 15,
                       what="the nfqueue-mode kpx node to exit")
            gone = time.monotonic()
            wait_until(lambda: len(load.since(gone)) >= 20, 10, what="connects after it exited")
        failed = [c for c in load.done if c.outcome != "ok"]
        assert not failed, f"{len(failed)} of {len(load.done)} connects failed: {failed[:3]}"
        slow = [c for c in load.done if c.took >= 0.9]
        assert not slow, f"{len(slow)} connects waited for a retransmitted SYN: {slow[:3]}"
        assert kpx_rules(lab) == (0, 0, 0, 0)
        # By the relay, not by the old process (which leaves them to a successor present).
        # The line comes once the removal returns, a moment after the rules are gone.
        wait_until(lambda: "removed the rules an nfqueue-mode kpx left here"
                   in lab.proxy_log(NODE), 5, what="the relay's log of the removal")
        assert f"serving on the listeners of kpx node pid {old}" in lab.proxy_log(NODE)
        reply, _ = who(lab, "client", ip, port, timeout=5.0)
        assert reply["pod"] == "web-1"
        assert lab.listener_pids(NODE, port) == {new}, "the relay serves the NodePort"
        assert echoes(held, b"after" * 1000), "a DNATed connection broke at the switch"
        assert "ip" in keepers(lab), "the IPv4 keeper, while a connection it keeps is open"
    finally:
        held.close()
    wait_until(lambda: not keepers(lab), 15, what="the NAT keepers removed")


def return_path(lab: Lab) -> tuple[bool, int, int]:
    """NODE's relay return path: (the ``inet kpx_tproxy`` table, its IPv4 fwmark rules, its
    IPv4 ``local`` routes in table 7078)."""
    tables = lab.run(NODE, ["nft", "list", "tables"]).stdout.splitlines()
    rules = lab.run(NODE, ["ip", "-4", "rule", "show", "pref", "7078"]).stdout
    routes = lab.run(NODE, ["ip", "-4", "route", "show", "table", "7078"]).stdout
    return ("table inet kpx_tproxy" in tables, len(rules.splitlines()),
            sum(line.startswith("local") for line in routes.splitlines()))


def test_a_restart_into_nfqueue_mode_removes_the_relays_return_path_once_the_relay_is_gone(
        lab_factory: LabFactory) -> None:
    """The relay keeps the client IP with transparent sockets and a return path; nfqueue mode
    needs none (plain DNAT). The old relay leaves it while it drains, as its successor is
    present; a connection it still relays needs it until then. The last one out is the
    nfqueue-mode process, so it removes it once the relay has gone."""
    lab = lab_factory(lab_spec({"web-1": NODE}, service("web", "Local")))
    wait_applied(lab)
    ip, port = lab.node_ip(NODE), lab.node_port("default/web")
    assert return_path(lab) == (True, 1, 1)
    held = echo_conn(lab, ip, port)  # the relay's, with the client's IP toward the pod
    try:
        assert echoes(held, b"before" * 1000)
        lab.extra_proxy_args = tuple(NFQ)
        old, _ = lab.restart_proxy(NODE)
        wait_until(lambda: "nfqueue rules in force" in lab.proxy_log(NODE), 15,
                   what="the nfqueue-mode kpx node's rules in force")
        reply, local = who(lab, "client", ip, port, timeout=5.0)
        assert (reply["pod"], peer_ip(reply)) == ("web-1", local[0]), "the client IP is kept"
        time.sleep(2.5)  # more than two looks for the relay to have gone
        assert netns.pid_alive(old), "the relay drains the connection it holds"
        assert return_path(lab) == (True, 1, 1), "removed under a connection still relayed"
        assert echoes(held, b"draining" * 1000)
    finally:
        held.close()
    wait_until(lambda: not netns.pid_alive(old), 15, what="the relay to finish draining")
    wait_until(lambda: return_path(lab) == (False, 0, 0), 10, what="the return path removed")
    # By the nfqueue-mode process; its line comes once the removal returns.
    wait_until(lambda: "removed the IPv4 client-IP return path a userspace-mode kpx left"
               in lab.proxy_log(NODE), 5, what="the nfqueue-mode kpx node's log of the removal")
    reply, local = who(lab, "client", ip, port, timeout=5.0)
    assert (reply["pod"], peer_ip(reply)) == ("web-1", local[0])
    assert kpx_rules(lab) == ONE_COPY


def time_wait_legs(lab: Lab) -> int:
    """NODE's TIME_WAIT sockets with the client's address as their own: the relay's."""
    listing = lab.run(NODE, ["ss", "-Htan", "state", "time-wait", "src",
                             lab.client_ip]).stdout
    return len(listing.splitlines())


def port_range(lab: Lab, where: str, low: int, high: int) -> None:
    lab.run(where, ["sysctl", "-qw", f"net.ipv4.ip_local_port_range={low} {high}"])


def test_a_restart_from_a_busy_relay_into_nfqueue_mode_loses_no_connect(
        lab_factory: LabFactory) -> None:
    """Two ways a switch from the relay lost connects.

    At the switch, some were refused: the new process said READY before its
    rules were in force, and the relay closed its listeners then. After it,
    for a minute, most timed out: each relay connection that had closed left
    a TIME_WAIT socket on the node with the client's address and port, and a
    DNATed connection reusing that port had its SYN-ACK taken by it (early
    demux; the kernel never forwards a packet that found a socket). Small
    port ranges make every port the client uses afterwards one such."""
    lab = lab_factory(lab_spec({"web-1": NODE}, service("web", "Cluster")))
    wait_applied(lab)
    ip, port = lab.node_ip(NODE), lab.node_port("default/web")
    port_range(lab, NODE, 50000, 50063)  # the relay's connections to the pod
    port_range(lab, "client", 40000, 40999)
    with PacedConnects(lab, "client", ip, port, every=0.01, max_count=56) as relayed:
        wait_until(lambda: len(relayed.done) >= 56, 20, what="56 connects through the relay")
    assert [c.outcome for c in relayed.done] == ["ok"] * 56
    wait_until(lambda: time_wait_legs(lab) >= 50, 10, what="the relay's TIME_WAIT sockets")
    port_range(lab, NODE, 50000, 50999)  # room for the relay's connections until the switch

    lab.extra_proxy_args = tuple(NFQ)
    with PacedConnects(lab, "client", ip, port, every=0.005, max_count=800) as load:
        wait_until(lambda: len(load.since(0)) >= 20, 10, what="connects before the restart")
        old, _ = lab.restart_proxy(NODE)
        wait_until(lambda: not netns.pid_alive(old), 15, what="the relay to exit")
        gone = time.monotonic()
        wait_until(lambda: len(load.since(gone)) >= 20, 10, what="connects after it exited")
    failed = [c for c in load.done if c.outcome != "ok"]
    assert not failed, f"{len(failed)} of {len(load.done)} connects failed: {failed[:3]}"
    # Once the relay has gone, the last of what it left goes (the return path last).
    wait_until(lambda: "removed the IPv4 client-IP return path" in lab.proxy_log(NODE), 10,
               what="the relay's leftovers removed")

    port_range(lab, "client", 50000, 50063)  # every port a relay connection left in TIME_WAIT
    with PacedConnects(lab, "client", ip, port, every=0.02, max_count=40) as after:
        wait_until(lambda: len(after.done) >= 40, 30, what="40 connects after the switch")
    failed = [c for c in after.done if c.outcome != "ok"]
    assert not failed, f"{len(failed)} of 40 connects failed: {failed[:3]}"
    reply, local = who(lab, "client", ip, port, timeout=3.0)
    assert (reply["pod"], peer_ip(reply)) == ("web-1", local[0]), "the client IP is kept"
    assert time_wait_legs(lab) == 0


def test_a_sync_writes_only_what_changed_and_repairs_a_table_someone_touched(
        lab_factory: LabFactory) -> None:
    """Each sync is an element-by-element change of kpx's table; when the table is not what
    kpx wrote (an element deleted by hand), the change is refused and the whole table goes
    back in, so the service works again at the next sync."""
    lab = lab_factory(lab_spec({"web-1": "node1"}, service("web", "Cluster")),
                      extra_proxy_args=NFQ)
    wait_applied(lab)
    port = lab.node_port("default/web")
    ip = lab.node_ip(NODE)
    assert who(lab, "client", ip, port)[0]["pod"] == "web-1"
    # Tamper: the NodePort's only DNAT target goes; SYNs then meet the node itself.
    lab.run(NODE, ["nft", "flush", "map", "ip", "kpx_nfq", "np_targets"])
    with pytest.raises(ConnectionRefusedError):
        who(lab, "client", ip, port)
    # The pod moves: kpx's change deletes the element that is already gone, and is refused.
    lab.move_pod("web-1", "node3")
    wait_until(lambda: "writing it whole" in lab.proxy_log(NODE), 10,
               what="kpx noticing its table was touched")
    assert "not as kpx left it" in lab.proxy_log(NODE)

    def served_from_node3() -> bool:
        try:
            return who(lab, "client", ip, port)[0]["node"] == "node3"
        except OSError:  # the whole table is going in right after the log line
            return False

    wait_until(served_from_node3, 10, what="the moved pod served through the rewritten table")
