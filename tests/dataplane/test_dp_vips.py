"""Service VIPs as kpx-owned ``local`` routes (issue 11), in network namespaces of their own.

Each test creates its namespaces (``kd<pid>-v*``), runs ``LocalVIPs`` inside
them from a thread that joined the namespace (``tests.support.netns.in_netns``:
its ``ip`` subprocesses and ``/proc/sys`` writes are the namespace's), and
removes them pass or fail. The "other kpx" of the sharing tests is a child
process started inside the namespace with ``ip netns exec``. Nothing here
touches the initial namespace.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import json
import logging
import os
import re
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from healthz.proxy_health import ProxyHealth
from healthz.registry import REGISTRY
from proxy.userspace.vips import (
    ARP_SYSCTL_DIR,
    VIP_PROTO,
    Firewall,
    Interception,
    LocalVIPs,
    VIPChanges,
    VIPGuard,
    VIPTarget,
    batch_script,
    parse_local_table,
    vip,
)
from tests.support.child import Child
from tests.support.loops import run_on
from tests.support.netns import REPO, connect_in, in_netns, prefix, sh, socket_in

pytestmark = pytest.mark.lab

A, B, C = "10.96.0.10", "10.96.0.11", "10.96.0.13"
FOREIGN = "10.96.0.12"
NODE_IP, POD_IP = "10.77.2.1", "10.77.2.2"

_n = itertools.count()


# -- namespaces and what is in them ------------------------------------------------------

@contextlib.contextmanager
def namespaces(*roles: str) -> Iterator[list[str]]:
    """Fresh namespaces (lo up), one per role; removed pass or fail."""
    if os.geteuid() != 0:
        pytest.skip("needs root (network namespaces)")
    n = next(_n)
    names = [f"{prefix()}v{n}{role}" for role in roles]
    try:
        for ns in names:
            sh("ip", "netns", "del", ns, check=False)  # a crashed run's leftover
            sh("ip", "netns", "add", ns)
            sh("ip", "-n", ns, "link", "set", "lo", "up")
        yield names
    finally:
        for ns in names:
            sh("ip", "netns", "del", ns, check=False)


@pytest.fixture
def ns() -> Iterator[str]:
    with namespaces("n") as (node,):
        yield node


def local_table(ns: str) -> str:
    return sh("ip", "-n", ns, "-4", "route", "show", "table", "local").stdout


def kpx_routes(ns: str) -> list[str]:
    """The kpx-owned lines of the local table, as ``ip`` prints them."""
    out = sh("ip", "-n", ns, "-4", "route", "show", "table", "local", "proto", str(VIP_PROTO))
    return sorted(line.strip() for line in out.stdout.splitlines() if line.strip())


def arp_sysctls(ns: str) -> dict[str, int]:
    def read() -> dict[str, int]:
        return {k: int((ARP_SYSCTL_DIR / k).read_text()) for k in ("arp_ignore", "arp_announce")}
    return in_netns(ns, read)


def set_sysctl(ns: str, key: str, value: int) -> None:
    in_netns(ns, (ARP_SYSCTL_DIR / key).write_text, f"{value}\n")


def listener(ns: str, addr: tuple[str, int]) -> socket.socket:
    s = socket_in(ns)
    try:
        s.bind(addr)
        s.listen(8)
    except BaseException:
        s.close()
        raise
    return s


@contextlib.contextmanager
def vips_in(ns: str) -> Iterator[LocalVIPs]:
    """A LocalVIPs for ``ns`` whose routes are removed at the end, pass or fail."""
    vips = LocalVIPs()
    try:
        yield vips
    finally:
        in_netns(ns, vips.remove_all)


class OtherKpx(Child):
    """Another kpx process in the namespace, driven line by line."""

    SCRIPT = """
import sys
from proxy.lifecycle.ownership import Ownership
from proxy.userspace.vips import LocalVIPs
vips, own = LocalVIPs(), None
print("ready", flush=True)
for line in sys.stdin:
    cmd, _, arg = line.strip().partition(" ")
    if cmd == "own":
        own = Ownership.acquire(successor_wait=0.0)
        out = True
    elif cmd == "sync":
        out = vips.sync(arg.split(",")).added
    elif cmd == "remove":
        out = vips.remove_all()
    print(repr(out), flush=True)
"""

    def __init__(self, ns: str) -> None:
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        self.proc = subprocess.Popen(
            ["ip", "netns", "exec", ns, sys.executable, "-c", self.SCRIPT],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        assert self.line() == "ready"

    def do(self, cmd: str) -> str:
        self.say(cmd)
        return self.line()


# -- ARP on the wire -------------------------------------------------------------------

def arp_answered(ns: str, ifname: str, src_ip: str, target_ip: str, wait: float = 0.5) -> bool:
    """Does anyone answer "who has ``target_ip``?" broadcast on ``ifname`` of ``ns``?"""
    link = json.loads(sh("ip", "-n", ns, "-j", "link", "show", ifname).stdout)[0]
    mac = bytes.fromhex(link["address"].replace(":", ""))
    arp_type = 0x0806
    s = in_netns(ns, socket.socket, socket.AF_PACKET, socket.SOCK_RAW, socket.htons(arp_type))
    with s:
        s.bind((ifname, arp_type))
        request = (b"\xff" * 6 + mac + struct.pack("!H", arp_type)
                   + struct.pack("!HHBBH", 1, 0x0800, 6, 4, 1)
                   + mac + socket.inet_aton(src_ip) + b"\0" * 6 + socket.inet_aton(target_ip))
        s.send(request)
        deadline = time.monotonic() + wait
        while (left := deadline - time.monotonic()) > 0:
            s.settimeout(left)
            try:
                frame = s.recv(128)
            except TimeoutError:
                break
            op, sender = struct.unpack("!H", frame[20:22])[0], frame[28:32]
            if op == 2 and sender == socket.inet_aton(target_ip):
                return True
    return False


# -- the pure pieces --------------------------------------------------------------------

def test_listing_and_batch_text() -> None:
    # ``ip -N -o -4 route show table local``, as this kernel's iproute2 prints it.
    listing = "".join(line + "\n" for line in [
        f"2 {A} dev lo proto {VIP_PROTO} scope 254 ",
        f"2 {FOREIGN} dev lo proto 4 scope 254 ",
        f"2 10.96.0.20 dev lo proto {VIP_PROTO}7 scope 254 ",  # 1077: not ours
        "2 127.0.0.0/8 dev lo proto 2 scope 254 src 127.0.0.1 ",
        "3 127.255.255.255 dev lo proto 2 scope 253 src 127.0.0.1 ",
    ])
    table = parse_local_table(listing)
    assert table.ours == {A} and table.others == {FOREIGN, "10.96.0.20", "127.255.255.255"}
    # An address added after kpx made it a VIP: the kernel's route beside kpx's, both counted.
    both = parse_local_table(f"2 {A} dev lo proto {VIP_PROTO} scope 254 \n"
                             f"2 {A} dev eth0 proto 2 scope 254 src {A} \n")
    assert both.ours == {A} and both.others == {A}
    text = batch_script([B], [A]).splitlines()
    # Deletes name kpx's proto (the kernel matches it); adds never replace anyone's route.
    assert text == [f"route del local {A}/32 table local proto {VIP_PROTO}",
                    f"route add local {B}/32 dev lo table local proto {VIP_PROTO} scope host"]
    assert vip(" 10.96.0.10 ") == A
    for bad in ("fd00::1", "0.0.0.0", "127.0.0.5", "224.0.0.1", "255.255.255.255", "x"):
        with pytest.raises(ValueError):
            vip(bad)


# -- 1: local, bindable, undeclared ports refused -------------------------------------------

def test_synced_vips_are_local_bindable_and_refuse_undeclared_ports(ns: str) -> None:
    with vips_in(ns) as vips:
        # Before the route the VIP is not local: a plain bind fails.
        with pytest.raises(OSError) as err:
            listener(ns, (A, 80)).close()
        assert err.value.errno == errno.EADDRNOTAVAIL

        changes = in_netns(ns, vips.sync, {A, B})
        assert changes == VIPChanges(added=(A, B), arp=("arp_ignore", "arp_announce"))
        assert kpx_routes(ns) == [f"local {A} dev lo scope host", f"local {B} dev lo scope host"]
        assert sh("ip", "-n", ns, "addr", "show", "dev", "lo").stdout.count("inet ") == 1
        assert not in_netns(ns, vips.sync, {B, A}).changed  # idempotent

        with listener(ns, (A, 80)) as srv, connect_in(ns, (A, 80)) as client:
            conn, peer = srv.accept()
            conn.close()
            # A node process reaching a VIP has the VIP as its source, as with IPVS.
            assert client.getsockname()[0] == A and peer[0] == A
        t0 = time.monotonic()
        with pytest.raises(ConnectionRefusedError):
            connect_in(ns, (A, 81))  # no listener: the kernel's RST
        assert time.monotonic() - t0 < 0.5


def test_a_sync_that_meets_a_route_it_did_not_expect_lists_and_carries_on(ns: str) -> None:
    """Syncs after the first trust their own record; a failed batch line makes them look."""
    with vips_in(ns) as vips:
        in_netns(ns, vips.sync, {A})
        # Meanwhile someone else makes B local, and deletes our A.
        sh("ip", "-n", ns, "route", "add", "local", f"{B}/32", "dev", "lo", "table", "local")
        sh("ip", "-n", ns, "route", "del", "local", f"{A}/32", "table", "local")
        changes = in_netns(ns, vips.sync, {A, B, C})
        # A is back (its delete failed, so the table was listed), B left to its owner.
        assert changes.foreign == (B,) and C in changes.added
        assert kpx_routes(ns) == [f"local {A} dev lo scope host", f"local {C} dev lo scope host"]
        assert not in_netns(ns, vips.ensure).changed


# -- 2: reachable from another namespace, no ARP for it -----------------------------------

def test_vip_reachable_from_a_pod_and_never_answered_in_arp() -> None:
    with namespaces("n", "p") as (node, pod), vips_in(node) as vips:
        sh("ip", "-n", node, "link", "add", "p1", "type", "veth", "peer", "name", "eth0",
           "netns", pod)
        sh("ip", "-n", node, "addr", "add", f"{NODE_IP}/24", "dev", "p1")
        sh("ip", "-n", pod, "addr", "add", f"{POD_IP}/24", "dev", "eth0")
        sh("ip", "-n", node, "link", "set", "p1", "up")
        sh("ip", "-n", pod, "link", "set", "eth0", "up")
        sh("ip", "-n", pod, "route", "add", "10.96.0.0/16", "via", NODE_IP)

        in_netns(node, vips.sync, {A})
        assert arp_sysctls(node) == {"arp_ignore": 1, "arp_announce": 2}
        with listener(node, (A, 80)) as srv, connect_in(pod, (A, 80)) as _client:
            conn, peer = srv.accept()
            conn.close()
            assert peer[0] == POD_IP
        with pytest.raises(ConnectionRefusedError):
            connect_in(pod, (A, 81))
        # The node answers ARP for its address on the link, never for the VIP.
        assert arp_answered(pod, "eth0", POD_IP, NODE_IP)
        assert not arp_answered(pod, "eth0", POD_IP, A)


# -- 3: only kpx's routes change; removal restores the namespace exactly ------------------

@pytest.mark.parametrize("before", [{"arp_ignore": 0, "arp_announce": 0},
                                    {"arp_ignore": 2, "arp_announce": 1}],
                         ids=["defaults", "operator-values"])
def test_sync_and_remove_leave_everything_else_as_it_was(ns: str, before: dict[str, int]) -> None:
    sh("ip", "-n", ns, "route", "add", "local", f"{FOREIGN}/32", "dev", "lo", "table", "local",
       "proto", "static")
    for key, value in before.items():
        set_sysctl(ns, key, value)
    table_before = local_table(ns)
    vips = LocalVIPs()
    try:
        changes = in_netns(ns, vips.sync, {A, B, FOREIGN})
        assert changes.added == (A, B) and changes.foreign == (FOREIGN,)
        assert arp_sysctls(ns) == {"arp_ignore": max(1, before["arp_ignore"]), "arp_announce": 2}
        changes = in_netns(ns, vips.sync, {B})
        assert changes.removed == (A,) and changes.added == ()
        assert kpx_routes(ns) == [f"local {B} dev lo scope host"]
        assert f"local {FOREIGN} dev lo proto static scope host" in local_table(ns)
    finally:
        assert in_netns(ns, vips.remove_all) is True
    assert local_table(ns) == table_before
    assert arp_sysctls(ns) == before


# -- 4: another kpx in the namespace keeps everything ---------------------------------------

def test_remove_all_keeps_everything_while_another_kpx_is_present(ns: str) -> None:
    other = OtherKpx(ns)
    try:
        assert other.do("own") == "True"  # its presence name, as every kpx node holds
        vips = LocalVIPs()
        in_netns(ns, vips.sync, {A})
        assert in_netns(ns, vips.remove_all) is False
        assert kpx_routes(ns) == [f"local {A} dev lo scope host"]
        assert arp_sysctls(ns) == {"arp_ignore": 1, "arp_announce": 2}
    finally:
        other.stop()
    assert in_netns(ns, LocalVIPs().remove_all) is True  # the last one removes
    assert kpx_routes(ns) == []


def test_a_successor_carries_the_nodes_arp_values_and_removes_last(ns: str) -> None:
    table_before = local_table(ns)
    vips = LocalVIPs()
    other = OtherKpx(ns)
    try:
        in_netns(ns, vips.sync, {A})  # the predecessor
        assert other.do("own") == "True"
        # The successor finds arp_ignore=1 set by kpx, not by the node: it must
        # take the predecessor's originals.
        assert other.do(f"sync {A},{B}") == repr((B,))
        assert in_netns(ns, vips.remove_all) is False  # the predecessor exits first
        assert len(kpx_routes(ns)) == 2
        assert other.do("remove") == "True"
        assert local_table(ns) == table_before
        assert arp_sysctls(ns) == {"arp_ignore": 0, "arp_announce": 0}
    finally:
        other.stop()


# -- 5: ensure puts back what was deleted behind kpx's back -------------------------------

def test_ensure_restores_what_was_deleted_and_never_deletes(ns: str, loop_kind: str) -> None:
    with vips_in(ns) as vips:
        in_netns(ns, vips.sync, {A, B})
        assert not in_netns(ns, vips.ensure).changed

        sh("ip", "-n", ns, "route", "del", "local", f"{A}/32", "table", "local")
        set_sysctl(ns, "arp_ignore", 0)
        sh("ip", "-n", ns, "route", "add", "local", f"{C}/32", "dev", "lo", "table", "local",
           "proto", str(VIP_PROTO))  # a kpx route nobody wants (a predecessor's)
        repaired = in_netns(ns, vips.ensure)
        assert repaired == VIPChanges(added=(A,), arp=("arp_ignore",))
        assert len(kpx_routes(ns)) == 3 and arp_sysctls(ns)["arp_ignore"] == 1

        # The same on the event loop (the guard's way): the loop's own subprocesses.
        sh("ip", "-n", ns, "route", "del", "local", f"{B}/32", "table", "local")
        seen: list[VIPChanges] = []

        async def check() -> None:
            seen.append(await vips.ensure_async())
            seen.append(await vips.sync_async(VIPTarget.build({A, B}, None)))

        in_netns(ns, run_on, loop_kind, check, 10.0)
        assert seen == [VIPChanges(added=(B,)), VIPChanges(removed=(C,))]
        assert kpx_routes(ns) == [f"local {A} dev lo scope host", f"local {B} dev lo scope host"]


def _guard_table(ns: str) -> tuple[int, set[str], str]:
    """The guard chain's handle, the table's chains, and the ``served`` set's listing."""
    listing = sh("ip", "netns", "exec", ns, "nft", "-a", "list", "table", "ip", "kpx_vips").stdout
    handle = re.search(r"chain guard \{ # handle (\d+)", listing)
    assert handle, listing
    served = sh("ip", "netns", "exec", ns, "nft", "list", "set", "ip", "kpx_vips", "served").stdout
    return int(handle.group(1)), set(re.findall(r"chain (\w+) \{", listing)), served


def test_a_change_rewrites_the_guard_in_place_and_a_table_not_kpxs_anew(
    ns: str, caplog: pytest.LogCaptureFixture
) -> None:
    """After the first write, a sync changes the table in place: the guard's base chain (so
    its hook) stays, a firewall chain no longer wanted goes; replacing the table would
    let a SYN slip between the two now and then. A table nft will not change so is
    written anew, with a warning."""
    fw = Firewall("ns/lb", ("10.0.0.0/8",), frozenset({(A, "tcp", 80)}))
    fw2 = Firewall("ns/lb2", ("10.1.0.0/16",), frozenset({(B, "tcp", 80)}))
    first = Interception(served=frozenset({(A, 80), (B, 80)}), firewalls=(fw, fw2))
    then = Interception(served=frozenset({(B, 80)}), firewalls=(fw2,))
    with vips_in(ns) as vips:
        in_netns(ns, vips.sync, {A, B}, first)
        handle, chains, served = _guard_table(ns)
        assert {"fw_0", "fw_1"} <= chains and f"{A} . 80" in served

        in_netns(ns, vips.sync, {A, B}, then)
        after, chains, served = _guard_table(ns)
        assert after == handle
        assert "fw_1" not in chains and f"{A} . 80" not in served and f"{B} . 80" in served
        fw_0 = sh("ip", "netns", "exec", ns, "nft", "list", "chain", "ip", "kpx_vips",
                  "fw_0").stdout
        assert "10.1.0.0/16" in fw_0 and "10.0.0.0/8" not in fw_0
        # The way back, a firewall chain more: in place too.
        in_netns(ns, vips.sync, {A, B}, first)
        assert _guard_table(ns)[:2] == (handle, chains | {"fw_1"})

        # Someone else's table of the same name, with a set of another type.
        sh("ip", "netns", "exec", ns, "nft", "delete", "table", "ip", "kpx_vips")
        sh("ip", "netns", "exec", ns, "nft", "add", "table", "ip", "kpx_vips")
        sh("ip", "netns", "exec", ns, "nft", "add", "set", "ip", "kpx_vips", "vips",
           "{ type inet_service; }")
        with caplog.at_level(logging.WARNING, logger="proxy.userspace.vips"):
            in_netns(ns, vips.sync, {A, B}, then)
        assert "is not as kpx left it" in caplog.text
        _, chains, served = _guard_table(ns)
        assert "guard" in chains and f"{B} . 80" in served
        assert "ipv4_addr" in sh("ip", "netns", "exec", ns, "nft", "list", "set", "ip",
                                 "kpx_vips", "vips").stdout


def test_everything_stays_in_its_namespace(ns: str) -> None:
    """The thread-scoped view: a LocalVIPs run in ``ns`` never sees the test's own namespace."""
    assert Path("/proc/thread-self/net/unix").exists()
    with vips_in(ns) as vips:
        in_netns(ns, vips.sync, {A})
        assert A not in sh("ip", "-4", "route", "show", "table", "local").stdout


def test_the_guard_restores_counts_and_turns_health_bad_while_it_cannot(
    ns: str, loop_kind: str
) -> None:
    """``VIPGuard``: a repair is counted; a failed check is a health fault until one works."""
    health = ProxyHealth()
    with vips_in(ns) as vips:
        in_netns(ns, vips.sync, {A})
        guard = VIPGuard(vips, health, period=3600)
        before = REGISTRY.get_sample_value("kubeproxy_kpx_vip_repairs_total", {"part": "route"})
        sh("ip", "-n", ns, "route", "del", "local", f"{A}/32", "table", "local")
        seen: list[VIPChanges] = []

        async def check() -> None:
            seen.append(await guard.check())

        in_netns(ns, run_on, loop_kind, check, 10.0)
        assert seen == [VIPChanges(added=(A,))] and health.healthy()
        after = REGISTRY.get_sample_value("kubeproxy_kpx_vip_repairs_total", {"part": "route"})
        assert (after or 0) == (before or 0) + 1

        async def broken() -> VIPChanges:
            raise OSError("ip: not found")

        guard.vips = type("Broken", (), {"ensure_async": staticmethod(broken)})()  # type: ignore[assignment]
        in_netns(ns, run_on, loop_kind, check, 10.0)
        assert not health.healthy() and "ip: not found" in health.faults[VIPGuard.FAULT]
        guard.vips = vips
        in_netns(ns, run_on, loop_kind, check, 10.0)
        assert health.healthy()
