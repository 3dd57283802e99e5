"""The bench's own network-namespace topology: client, two nodes, two pods.

Owns: creating and removing the namespaces, veth links, addresses, routes and
per-namespace sysctls that every contender runs over, plus the small helpers
to run a command or a Python callable *inside* one of those namespaces.

Never: touch the root namespace. Links are created inside a bench namespace
(``ip -n NS link add ... peer ... netns OTHER``), sysctls are written through
``ip netns exec``, and everything is removed by ``Topology.destroy`` which the
runner calls from a ``finally``. It builds its own topology rather than
``lab/``'s (different goals: a benchmark must control every knob that moves
its numbers and record it) and shares only plumbing with it: listing
namespaces comes from ``lab.netns``.

Layout (all /24s, addresses are private to these namespaces)::

    client 10.90.1.2 --- 10.90.1.1 node1 10.90.2.1 --- 10.90.2.2 pod1 (+10.90.2.3)
                                     10.90.3.1
                                        |
                                     10.90.3.2 node2 10.90.4.1 --- 10.90.4.2 pod2

Pods use their node as default gateway, which is what a CNI does and what the
transparent (client-IP keeping) path to a local endpoint needs. node2 routes
the client subnet back via node1, so "direct" works on both paths.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import os
import re
import socket
import struct
import subprocess
import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TypeVar

from lab.netns import list_namespaces

T = TypeVar("T")

CLONE_NEWNET = 0x40000000
NETNS_DIR = "/var/run/netns"

ROLES = ("client", "node1", "pod1", "node2", "pod2")

CLIENT_IP = "10.90.1.2"
NODE1_IP = "10.90.1.1"  # node1's InternalIP: where NodePorts are reached
NODE1_POD_GW = "10.90.2.1"
POD1_IP = "10.90.2.2"
POD1_ALT_IP = "10.90.2.3"  # second backend on pod1, for endpoint-change convergence
NODE1_LINK_IP = "10.90.3.1"
NODE2_IP = "10.90.3.2"
NODE2_POD_GW = "10.90.4.1"
POD2_IP = "10.90.4.2"
SERVICE_VIP = "10.96.0.10"
"""The bench service's ClusterIP (``k8s_state.cluster_ip(0)``: it is rendered first)."""

CLIENT_IP6 = "fd00:90:1::2"
NODE1_IP6 = "fd00:90:1::1"  # node1's IPv6 InternalIP: where IPv6 NodePorts are reached
NODE1_POD_GW6 = "fd00:90:2::1"
POD1_IP6 = "fd00:90:2::2"
POD1_ALT_IP6 = "fd00:90:2::3"
NODE1_LINK_IP6 = "fd00:90:3::1"
NODE2_IP6 = "fd00:90:3::2"
NODE2_POD_GW6 = "fd00:90:4::1"
POD2_IP6 = "fd00:90:4::2"
SERVICE_VIP6 = "fd00:96::a"
"""The bench service's IPv6 ClusterIP in the dual-stack state of an IPv6 run (the
clusterip path is not run over IPv6: only the NodePort paths are)."""

# Node ephemeral ports stay above every port a proxy listens on (bench ports
# 30000-31999, control NodePorts 20000-29999), so an upstream connect can never
# take a port a listener is about to bind.
NODE_PORT_RANGE = "32768 65535"
WIDE_PORT_RANGE = "1024 65535"
CONNTRACK_TIME_WAIT = "5"


def base_sysctls(role: str) -> dict[str, str]:
    """The sysctls every bench namespace gets, recorded in the results.

    TIME_WAIT handling is the point (peers-and-ecosystem.md §2.2 pitfall 1):
    with the backend closing first, reusing source ports into TIME_WAIT
    sockets collapsed connection rates from 7k to 0.5k conn/s. A small
    ``tcp_max_tw_buckets``, ``tcp_tw_reuse=1`` and a wide port range keep
    that limit visible and constant instead of silently capping results.
    Backlogs are raised so 10,000-connection bursts are not dropped at accept.
    """
    node = role.startswith("node")
    s = {
        "net.ipv4.tcp_max_tw_buckets": "512",
        "net.ipv4.tcp_tw_reuse": "1",
        "net.ipv4.ip_local_port_range": NODE_PORT_RANGE if node else WIDE_PORT_RANGE,
        "net.core.somaxconn": "8192",
        "net.ipv4.tcp_max_syn_backlog": "8192",
    }
    if node:
        s["net.ipv4.ip_forward"] = "1"
        # Strict reverse-path filtering would drop the transparent path's
        # replies (source = client IP on the pod-side link); CNIs turn it off.
        s["net.ipv4.conf.all.rp_filter"] = "0"
        s["net.ipv4.conf.default.rp_filter"] = "0"
        # Contenders must not leave traps for each other. kpx's upstream
        # sockets keep the client's address, so the ones it closed first sit
        # in TIME_WAIT in node1 as client:port <-> pod:8080 for 60 s. With
        # early demux on, node1 hands a *forwarded* packet matching one (the
        # pod's SYN-ACK to the direct contender's client) to that socket
        # instead of routing it: measured, direct's cps after a kpx mem run
        # fell from 17k to 5.7k conn/s, the machine 30% busy, waiting on SYN
        # retransmits. Without early demux, locally delivered packets take a
        # route lookup instead (every proxy alike) and forwarding is untouched.
        s["net.ipv4.tcp_early_demux"] = "0"
    return s


def ipv6_sysctls(role: str) -> dict[str, str]:
    """What an IPv6-capable bench namespace adds to ``base_sysctls``.

    IPv6 TCP shares the ``net.ipv4.tcp_*`` and ``ip_local_port_range``
    settings above (and early demux), so only forwarding is new: on in the
    nodes, which route between client, pods and each other. IPv6 has no
    rp_filter. ``disable_ipv6=0`` is written so a host that turns IPv6 off by
    default fails here, clearly, rather than at the first address.
    """
    s = {"net.ipv6.conf.all.disable_ipv6": "0", "net.ipv6.conf.default.disable_ipv6": "0"}
    if role.startswith("node"):
        s["net.ipv6.conf.all.forwarding"] = "1"
    return s


def host_port(ip: str, port: int) -> str:
    """``ip:port``, with an IPv6 address in brackets (URLs, HAProxy, naive's specs)."""
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


def ip_family(ip: str) -> int:
    """4 or 6: which family an address (as the bench writes them) belongs to."""
    return 6 if ":" in ip else 4


class CommandError(RuntimeError):
    """A setup command failed; carries the command and its stderr."""


def sh(cmd: Sequence[str], *, check: bool = True, timeout: float = 30.0,
       input_text: str | None = None) -> subprocess.CompletedProcess[str]:
    """Run a short command, capturing output; raise CommandError with stderr on failure."""
    try:
        cp = subprocess.run(
            list(cmd), capture_output=True, text=True, timeout=timeout, input=input_text,
            check=False,
        )
    except subprocess.TimeoutExpired as e:
        raise CommandError(f"timed out after {timeout}s: {' '.join(cmd)}") from e
    if check and cp.returncode != 0:
        raise CommandError(f"{' '.join(cmd)} -> rc {cp.returncode}: {cp.stderr.strip()}")
    return cp


def _setns(path: str) -> None:
    """Move the *calling thread* into the network namespace at ``path``.

    setns(2) with CLONE_NEWNET is per thread, so a dedicated worker thread can
    live in a bench namespace while the rest of the harness stays in root.
    """
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns({path}): {os.strerror(err)}")
    finally:
        os.close(fd)


class NsThread:
    """A single worker thread living in one namespace.

    Used for things that must be cheap and in-namespace inside timing loops:
    creating probe sockets (a socket belongs to the netns it was created in,
    whichever thread later uses it) and reading ``/proc/thread-self/net/tcp``.
    """

    def __init__(self, ns: str) -> None:
        self.ns = ns
        self._pool = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix=f"ns-{ns}",
            initializer=_setns, initargs=(os.path.join(NETNS_DIR, ns),),
        )

    def call(self, fn: Callable[..., T], *args: object, timeout: float = 30.0) -> T:
        return self._pool.submit(fn, *args).result(timeout=timeout)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


@dataclass
class Topology:
    """Five namespaces named ``<prefix><role>``; ``create`` builds, ``destroy`` removes."""

    prefix: str
    ipv6: bool = False
    """Also give every namespace its IPv6 (ULA) addresses and routes (see the module)."""
    sysctls: dict[str, dict[str, str]] = field(default_factory=dict)
    created: list[str] = field(default_factory=list)
    _threads: dict[str, NsThread] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @classmethod
    def for_this_process(cls, ipv6: bool = False) -> Topology:
        """The prefix the brief mandates: ``kb<pid%1000>-``."""
        return cls(prefix=f"kb{os.getpid() % 1000}-", ipv6=ipv6)

    def ns(self, role: str) -> str:
        return f"{self.prefix}{role}"

    @property
    def namespaces(self) -> list[str]:
        return [self.ns(r) for r in ROLES]

    # ---- commands in namespaces -------------------------------------------------

    def ip(self, role: str, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return sh(["ip", "-n", self.ns(role), *args], check=check)

    def exec_argv(self, role: str, argv: Iterable[str]) -> list[str]:
        """argv that runs ``argv`` inside the role's namespace (ip netns exec execs, same pid)."""
        return ["ip", "netns", "exec", self.ns(role), *argv]

    def run(self, role: str, argv: Sequence[str], *, check: bool = True,
            timeout: float = 30.0, input_text: str | None = None,
            ) -> subprocess.CompletedProcess[str]:
        return sh(self.exec_argv(role, argv), check=check, timeout=timeout,
                  input_text=input_text)

    def thread(self, role: str) -> NsThread:
        with self._lock:
            t = self._threads.get(role)
            if t is None:
                t = self._threads[role] = NsThread(self.ns(role))
            return t

    # ---- build / tear down ------------------------------------------------------

    def _veth(self, a: str, a_dev: str, b: str, b_dev: str) -> None:
        # Created inside namespace a, peer moved straight into b: never in root.
        self.ip(a, "link", "add", a_dev, "type", "veth", "peer", "name", b_dev,
                "netns", self.ns(b))

    def _addr(self, role: str, dev: str, cidr: str) -> None:
        self.ip(role, "addr", "add", cidr, "dev", dev)

    def set_sysctls(self, role: str, values: dict[str, str]) -> None:
        args = [f"{k}={v}" for k, v in values.items()]
        self.run(role, ["sysctl", "-q", "-w", *args])
        self.sysctls.setdefault(self.ns(role), {}).update(values)

    def create(self) -> None:
        """Build everything; on any error the caller's ``finally`` runs ``destroy``."""
        existing = set(list_namespaces())
        clash = [n for n in self.namespaces if n in existing]
        if clash:
            raise CommandError(
                f"namespaces {clash} already exist (a crashed earlier run with the same "
                f"pid%1000?); remove them with `ip netns del` after checking they are stale"
            )
        for role in ROLES:
            sh(["ip", "netns", "add", self.ns(role)])
            self.created.append(self.ns(role))
            self.ip(role, "link", "set", "lo", "up")
        self._veth("client", "eth0", "node1", "c0")
        self._veth("node1", "p0", "pod1", "eth0")
        self._veth("node1", "n2", "node2", "n1")
        self._veth("node2", "p0", "pod2", "eth0")
        for role, dev, cidr in (
            ("client", "eth0", f"{CLIENT_IP}/24"),
            ("node1", "c0", f"{NODE1_IP}/24"),
            ("node1", "p0", f"{NODE1_POD_GW}/24"),
            ("pod1", "eth0", f"{POD1_IP}/24"),
            ("pod1", "eth0", f"{POD1_ALT_IP}/24"),
            ("node1", "n2", f"{NODE1_LINK_IP}/24"),
            ("node2", "n1", f"{NODE2_IP}/24"),
            ("node2", "p0", f"{NODE2_POD_GW}/24"),
            ("pod2", "eth0", f"{POD2_IP}/24"),
        ):
            self._addr(role, dev, cidr)
        for role, dev in (("client", "eth0"), ("node1", "c0"), ("node1", "p0"),
                          ("node1", "n2"), ("node2", "n1"), ("node2", "p0"),
                          ("pod1", "eth0"), ("pod2", "eth0")):
            self.ip(role, "link", "set", dev, "up")
        for role in ROLES:
            self.set_sysctls(role, base_sysctls(role))
        self.conntrack_sysctls()
        # rp_filter is also per device; the devices existed before "default" was set.
        for role, devs in (("node1", ("c0", "p0", "n2")), ("node2", ("n1", "p0"))):
            self.set_sysctls(role, {f"net.ipv4.conf.{d}.rp_filter": "0" for d in devs})
        self.ip("client", "route", "add", "default", "via", NODE1_IP)
        self.ip("pod1", "route", "add", "default", "via", NODE1_POD_GW)
        self.ip("pod2", "route", "add", "default", "via", NODE2_POD_GW)
        self.ip("node1", "route", "add", "10.90.4.0/24", "via", NODE2_IP)
        self.ip("node2", "route", "add", "10.90.1.0/24", "via", NODE1_LINK_IP)
        self.ip("node2", "route", "add", "10.90.2.0/24", "via", NODE1_LINK_IP)
        if self.ipv6:
            self.create_ipv6()

    def create_ipv6(self) -> None:
        """The IPv6 twin of every address and route ``create`` made (links already up)."""
        for role in ROLES:
            self.set_sysctls(role, ipv6_sysctls(role))
        for role, dev, ip in (
            ("client", "eth0", CLIENT_IP6),
            ("node1", "c0", NODE1_IP6),
            ("node1", "p0", NODE1_POD_GW6),
            ("pod1", "eth0", POD1_IP6),
            ("pod1", "eth0", POD1_ALT_IP6),
            ("node1", "n2", NODE1_LINK_IP6),
            ("node2", "n1", NODE2_IP6),
            ("node2", "p0", NODE2_POD_GW6),
            ("pod2", "eth0", POD2_IP6),
        ):
            self.ip(role, "-6", "addr", "add", f"{ip}/64", "dev", dev, "nodad")
        self.ip("client", "-6", "route", "add", "default", "via", NODE1_IP6)
        self.ip("pod1", "-6", "route", "add", "default", "via", NODE1_POD_GW6)
        self.ip("pod2", "-6", "route", "add", "default", "via", NODE2_POD_GW6)
        self.ip("node1", "-6", "route", "add", "fd00:90:4::/64", "via", NODE2_IP6)
        self.ip("node2", "-6", "route", "add", "fd00:90:1::/64", "via", NODE1_LINK_IP6)
        self.ip("node2", "-6", "route", "add", "fd00:90:2::/64", "via", NODE1_LINK_IP6)

    def conntrack_sysctls(self) -> None:
        """Keep the kernel contender's conntrack table from filling during cps.

        Every proxied cps connection leaves a conntrack entry in TIME_WAIT for
        120 s by default; at 30-40k conn/s that passes nf_conntrack_max (262,144
        here, a global limit counted per namespace) within seconds and the
        kernel starts dropping SYNs. 5 s keeps the steady-state count near
        rate x 5 s. Only node1 NATs. The key exists only once nf_conntrack is
        loaded, so the kernel contender calls this again after loading its
        table; the cps run records the count it sees either way.
        """
        key = "net.netfilter.nf_conntrack_tcp_timeout_time_wait"
        probe = self.run("node1", ["sysctl", "-n", key], check=False)
        if probe.returncode == 0:
            self.set_sysctls("node1", {key: CONNTRACK_TIME_WAIT})

    def _rule_families(self) -> tuple[tuple[str, ...], ...]:
        """``ip`` argument prefixes for policy rules: IPv4, and IPv6 when it is set up
        (a transparent IPv6 proxy adds an ``ip -6`` rule, as the IPv4 one does)."""
        return ((), ("-6",)) if self.ipv6 else ((),)

    def node1_residue(self) -> list[str]:
        """nft tables and policy rules left in node1 (by a contender that did not clean up).

        Contenders run one at a time on the same node; a leftover NAT or
        mangle table would tax whoever runs next, so the runner checks after
        each contender and resets node1 if anything is left.
        """
        out = []
        tables = self.run("node1", ["nft", "list", "tables"], check=False).stdout
        out += [f"nft {t.strip()}" for t in tables.splitlines() if t.strip()]
        for fam in self._rule_families():
            rules = self.ip("node1", *fam, "rule", "show", check=False).stdout
            for line in rules.splitlines():
                pref = line.split(":", 1)[0].strip()
                if pref not in ("0", "32766", "32767"):
                    out.append(f"ip {' '.join((*fam, 'rule'))} {line.strip()}")
        return out

    def reset_node1(self) -> None:
        """Remove every nft table and non-default policy rule in node1 (ours alone)."""
        self.run("node1", ["nft", "flush", "ruleset"], check=False)
        for fam in self._rule_families():
            rules = self.ip("node1", *fam, "rule", "show", check=False).stdout
            for line in rules.splitlines():
                pref = line.split(":", 1)[0].strip()
                if pref.isdigit() and pref not in ("0", "32766", "32767"):
                    self.ip("node1", *fam, "rule", "del", "pref", pref, check=False)

    def check_reachability(self, port: int, dsts: Iterable[str] | None = None,
                           timeout: float = 3.0) -> None:
        """Fail early and clearly if the routed paths do not work (TCP, no ping needed):
        both pods, and their IPv6 addresses too when the topology has them."""
        if dsts is None:
            dsts = (POD1_IP, POD2_IP, *((POD1_IP6, POD2_IP6) if self.ipv6 else ()))

        def probe(dst: str) -> str | None:
            try:
                with socket.create_connection((dst, port), timeout=timeout):
                    return None
            except OSError as e:
                return f"client cannot reach {dst}:{port}: {e}"

        for dst in dsts:
            err = self.thread("client").call(probe, dst)
            if err:
                raise CommandError(err)

    def destroy(self) -> list[str]:
        """Remove every namespace this object created; returns problems (never raises)."""
        problems: list[str] = []
        for t in self._threads.values():
            t.close()
        self._threads.clear()
        for name in reversed(self.created):
            with contextlib.suppress(Exception):
                cp = sh(["ip", "netns", "del", name], check=False)
                if cp.returncode != 0 and name in list_namespaces():
                    problems.append(f"ip netns del {name}: {cp.stderr.strip()}")
        self.created.clear()
        return problems

    def describe(self) -> dict[str, object]:
        """The topology as recorded in the results file."""
        ipv6 = {"ipv6": {"client": CLIENT_IP6, "node1": NODE1_IP6, "pod1": POD1_IP6,
                         "pod1_alt": POD1_ALT_IP6, "node2": NODE2_IP6, "pod2": POD2_IP6,
                         "paths": "local and cross, as IPv4 (ULA /64s, nodad)"}
                } if self.ipv6 else {}
        return {
            **ipv6,
            "namespaces": self.namespaces,
            "client": CLIENT_IP,
            "node1": NODE1_IP,
            "pod1": POD1_IP,
            "pod1_alt": POD1_ALT_IP,
            "node2": NODE2_IP,
            "pod2": POD2_IP,
            "links": "veth, MTU 1500, created inside the bench namespaces",
            "paths": {
                "local": "client -> node1 -> pod1 (endpoint on node1)",
                "cross": "client -> node1 -> node2 -> pod2 (endpoint on node2, SNAT)",
                "clusterip": f"pod1 -> {SERVICE_VIP} in node1 -> node2 -> pod2 (a pod on "
                             f"node1 dials the ClusterIP; endpoint on node2)",
            },
        }


TCP_STATES = {
    "01": "ESTABLISHED", "02": "SYN_SENT", "03": "SYN_RECV", "04": "FIN_WAIT1",
    "05": "FIN_WAIT2", "06": "TIME_WAIT", "07": "CLOSE", "08": "CLOSE_WAIT",
    "09": "LAST_ACK", "0A": "LISTEN", "0B": "CLOSING",
}


def read_tcp_table() -> list[tuple[int, int, str]]:
    """(local port, remote port, state) of every TCP socket, IPv4 and IPv6, in the calling
    thread's netns.

    Run through ``NsThread.call``; ``/proc/thread-self`` resolves to the
    namespace of the thread, not of the process. IPv6 sockets are in
    ``tcp6`` (absent when the kernel has no IPv6): an IPv6 run's TIME_WAIT
    and backend connections are counted like an IPv4 run's.
    """
    out: list[tuple[int, int, str]] = []
    for name in ("tcp", "tcp6"):
        try:
            f = open(f"/proc/thread-self/net/{name}", encoding="ascii")  # noqa: SIM115
        except FileNotFoundError:
            if name == "tcp":
                raise
            continue
        with f:
            next(f, None)
            for line in f:
                parts = line.split(None, 4)
                if len(parts) < 4:
                    continue
                lport = int(parts[1].rsplit(":", 1)[1], 16)
                rport = int(parts[2].rsplit(":", 1)[1], 16)
                out.append((lport, rport, TCP_STATES.get(parts[3], parts[3])))
    return out


_LISTEN_RE = re.compile(rb"^\s*\d+: [0-9A-F]{8}:([0-9A-F]{4}) [0-9A-F]{8}:[0-9A-F]{4} 0A ", re.M)
_LISTEN6_RE = re.compile(rb"^\s*\d+: [0-9A-F]{32}:([0-9A-F]{4}) [0-9A-F]{32}:[0-9A-F]{4} 0A ",
                         re.M)

# sock_diag (linux/sock_diag.h, linux/inet_diag.h, linux/netlink.h).
_NETLINK_SOCK_DIAG = 4
_SOCK_DIAG_BY_FAMILY = 20
_NLM_F_REQUEST_DUMP = 0x301
_NLMSG_ERROR = 2
_NLMSG_DONE = 3
_TCP_LISTEN = 10
_NLMSG_HDR = struct.Struct("=IHHII")
_DIAG_REQ = struct.Struct("=BBBxI48x")  # inet_diag_req_v2, with an all-zero inet_diag_sockid
_SPORT = _NLMSG_HDR.size + 4  # inet_diag_msg: family, state, timer, retrans, then sport (BE)


def listening_ports(family: int = 4) -> set[int]:
    """Ports with an IPv4 listener (``family=6``: an IPv6 one) in the calling thread's netns.

    Asked of the kernel with one sock_diag dump of LISTEN sockets only: the
    control workload polls this while kpx opens 10,000+ listeners, so the
    poll must cost little next to what it measures, and come round often
    (the apply figure overshoots by up to one poll). With 10,000 listeners
    it takes about 16 ms, against 40 ms for formatting and scanning
    ``/proc/net/tcp`` (the fallback, for a kernel without inet_diag) and a
    second for pyroute2's ``DiagSocket``, which decodes every attribute.
    """
    try:
        return _diag_listening_ports(family)
    except OSError:
        return _proc_listening_ports(family)


def _proc_listening_ports(family: int = 4) -> set[int]:
    name, pattern = ("tcp6", _LISTEN6_RE) if family == 6 else ("tcp", _LISTEN_RE)
    with open(f"/proc/thread-self/net/{name}", "rb") as f:
        data = f.read()
    return {int(m, 16) for m in pattern.findall(data)}


def _diag_listening_ports(family: int = 4) -> set[int]:
    # Made per call: a socket belongs to the netns of the thread that made it.
    af = socket.AF_INET6 if family == 6 else socket.AF_INET
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, _NETLINK_SOCK_DIAG) as nl:
        req = _DIAG_REQ.pack(af, socket.IPPROTO_TCP, 0, 1 << _TCP_LISTEN)
        nl.send(_NLMSG_HDR.pack(_NLMSG_HDR.size + len(req), _SOCK_DIAG_BY_FAMILY,
                                _NLM_F_REQUEST_DUMP, 1, 0) + req)
        ports: set[int] = set()
        while True:
            data = nl.recv(1 << 20)
            if not data:
                raise OSError("sock_diag: the dump ended without NLMSG_DONE")
            off, end = 0, len(data)
            while off < end:
                length, kind = struct.unpack_from("=IH", data, off)
                if kind == _NLMSG_DONE:
                    return ports
                if kind == _NLMSG_ERROR or length < _SPORT + 2:
                    raise OSError("sock_diag: the kernel refused the dump")
                ports.add(int.from_bytes(data[off + _SPORT:off + _SPORT + 2], "big"))
                off += (length + 3) & ~3


def udp_bound_ports() -> set[int]:
    """Local ports of every IPv4 UDP socket in the calling thread's netns.

    UDP has no LISTEN state: a bound socket is a server. Read from
    ``/proc/thread-self/net/udp`` (a handful of sockets here, so no sock_diag).
    """
    ports: set[int] = set()
    with open("/proc/thread-self/net/udp", encoding="ascii") as f:
        next(f, None)
        for line in f:
            parts = line.split(None, 2)
            if len(parts) >= 2:
                ports.add(int(parts[1].rsplit(":", 1)[1], 16))
    return ports


def count_states() -> dict[str, int]:
    """Counts of TCP socket states in the calling thread's netns (for TIME_WAIT visibility)."""
    counts: dict[str, int] = {}
    for _, _, st in read_tcp_table():
        counts[st] = counts.get(st, 0) + 1
    return counts


DROP_COUNTERS: dict[str, tuple[str, ...]] = {
    "Tcp": ("ActiveOpens", "PassiveOpens", "AttemptFails", "EstabResets", "OutRsts"),
    "TcpExt": ("ListenOverflows", "ListenDrops", "TCPAbortOnData", "TCPAbortOnClose",
               "TCPAbortOnTimeout", "TCPTimeWaitOverflow", "PAWSActive", "PAWSEstab"),
    "conntrack": ("invalid", "insert_failed", "drop", "early_drop", "clashres"),
    "nfqueue": ("queue_dropped", "user_dropped"),
}
"""What ``read_counters`` keeps: the kernel's reasons a connection was refused, reset or
lost (per namespace), and two openings counts that show the reading is of the right one.
An NFQUEUE's drops are SYNs lost before any reader saw them: the queue was full
(``queue_dropped``) or the reader's socket buffer was (``user_dropped``)."""


def parse_snmp(text: str, keep: dict[str, tuple[str, ...]] = DROP_COUNTERS) -> dict[str, int]:
    """``Group.Name -> value`` from ``/proc/net/snmp`` or ``netstat``: each group is a header
    line of names followed by a line of values, both starting with ``Group:``."""
    out: dict[str, int] = {}
    lines = text.splitlines()
    for head, vals in itertools.pairwise(lines):
        group, _, names = head.partition(":")
        wanted = keep.get(group)
        if not wanted or not vals.startswith(group + ":"):
            continue
        for name, value in zip(names.split(), vals.partition(":")[2].split(), strict=False):
            if name in wanted:
                out[f"{group}.{name}"] = int(value)
    return out


def parse_conntrack_stat(text: str, keep: tuple[str, ...] = DROP_COUNTERS["conntrack"]
                         ) -> dict[str, int]:
    """``conntrack.name -> sum over CPUs`` from ``/proc/net/stat/nf_conntrack``: a header of
    names, then one line of hex values per CPU (``entries`` is the same on every line, and
    not a counter)."""
    lines = text.split("\n")
    names = lines[0].split()
    out = dict.fromkeys((f"conntrack.{n}" for n in keep if n in names), 0)
    for line in lines[1:]:
        for name, value in zip(names, line.split(), strict=False):
            if name in keep:
                out[f"conntrack.{name}"] += int(value, 16)
    return out


def parse_nfqueue(text: str) -> dict[str, int]:
    """``nfqueue.*_dropped``, summed over the bound queues, from
    ``/proc/net/netfilter/nfnetlink_queue`` (one line per queue: number, peer port id,
    queued now, copy mode, copy range, queue_dropped, user_dropped, last packet id, 1)."""
    keys = [f"nfqueue.{n}" for n in DROP_COUNTERS["nfqueue"]]  # fields 5 and 6
    out = dict.fromkeys(keys, 0)
    for line in text.splitlines():
        fields = line.split()
        if len(fields) >= 7:
            for key, value in zip(keys, fields[5:7], strict=True):
                out[key] += int(value)
    return out


def read_counters() -> dict[str, int]:
    """``DROP_COUNTERS`` of the calling thread's netns (``NsThread.call``; see
    ``read_tcp_table`` for why ``thread-self``). No conntrack figures where the
    namespace has never loaded it, no NFQUEUE ones where nothing ever bound a queue."""
    out: dict[str, int] = {}
    for name in ("snmp", "netstat"):
        with open(f"/proc/thread-self/net/{name}", encoding="ascii") as f:
            out.update(parse_snmp(f.read()))
    with (contextlib.suppress(FileNotFoundError),
          open("/proc/thread-self/net/stat/nf_conntrack", encoding="ascii") as f):
        out.update(parse_conntrack_stat(f.read()))
    with (contextlib.suppress(FileNotFoundError),
          open("/proc/thread-self/net/netfilter/nfnetlink_queue", encoding="ascii") as f):
        out.update(parse_nfqueue(f.read()))
    return out


def counter_deltas(before: dict[str, dict[str, int]], after: dict[str, dict[str, int]]
                   ) -> dict[str, dict[str, int]]:
    """Per role, the counters that moved between two ``read_counters`` rounds."""
    out: dict[str, dict[str, int]] = {}
    for role, now in after.items():
        was = before.get(role, {})
        moved = {k: v - was[k] for k, v in now.items() if k in was and v != was[k]}
        if moved:
            out[role] = moved
    return out


LOSS_SIGNS = frozenset({
    "TcpExt.ListenOverflows", "TcpExt.ListenDrops", "TcpExt.PAWSActive", "TcpExt.PAWSEstab",
    *(f"conntrack.{n}" for n in DROP_COUNTERS["conntrack"]),
    *(f"nfqueue.{n}" for n in DROP_COUNTERS["nfqueue"]),
})
"""Counters that move only when a connection is lost, in any namespace. Resets are not
among them: wrk aborts its open connections when a run ends (the client's ``OutRsts``
and ``TCPAbortOnData`` move by about its connection count in every clean run), and the
backend answers their late segments with more."""


FORWARDER_SIGNS = frozenset({"Tcp.OutRsts", "Tcp.AttemptFails", "Tcp.EstabResets"})


def explain_losses(deltas: dict[str, dict[str, int]], forwarder: str | None = None) -> str:
    """The counters of ``counter_deltas`` that say where connections were lost, in one line
    (``""`` if none moved): ``LOSS_SIGNS`` anywhere, and on *forwarder* (a node whose
    kernel forwards the connections, never ending them) any reset or failed attempt: there
    one means a packet missed its NAT and met the node's own stack. What a failed run's
    reason adds, so that one reset in thousands names the namespace and the kernel's
    reason."""
    parts = [f"{role} {name} +{n}" for role, moved in deltas.items()
             for name, n in moved.items()
             if n > 0 and (name in LOSS_SIGNS or (role == forwarder and name in FORWARDER_SIGNS))]
    return ", ".join(parts)
