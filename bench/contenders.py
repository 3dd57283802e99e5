"""The contenders: one way each to get a client's connection from node1 to a pod.

Owns: starting and stopping each contender in the node1 namespace, telling
the workloads which address to hit, and a functional probe before any
measurement (an HTTP GET must come back from the expected pod, otherwise the
contender fails with that reason instead of being measured on a broken path).

Never: run two contenders at once or leave one behind: each is started for
its own round and stopped by pid (and its nft table deleted) after it.

Every contender forwards the same two services to the same backends: "http"
(the HAProxy static 200 on :8080, for rr/cps/mem) and "bulk" (the exact
sender/receiver sink on :5202), and a UDP port to the pods' ``lab.echo`` on
:5353 (the udp workload) when it forwards UDP at all: HAProxy has no UDP,
so its udp cells are n/a, and socat, the userspace UDP peer, forwards only
UDP (its TCP cells are n/a). Each contender has its own front ports, so
nothing left over from one (TIME_WAIT, conntrack) can collide with the next.
Only one contender runs at a time: the kernel's nft table is loaded only for
its own runs, since a NAT table in node1 turns on conntrack for everything
crossing it and would tax the others.

Address families (issue 14): a contender runs one family at a time, set in
``family`` by the runner before ``start``. Over IPv6 the front is node1's
IPv6 address (``NODE1_IP6``) on the same ports, the backend the same pod's
IPv6 address: the kernel loads an ``ip6`` table of the same rules, HAProxy
and naive bind the IPv6 address, and kpx gets a dual-stack state
(``bench_state(..., family=6)``). Only the NodePort paths (local, cross)
run over IPv6.

Three contenders are diagnostics, run only when named: ``nfq-floor``, kpx-nfq's rules
answered by a minimal C reader (``NfqFloor``), the floor kpx-nfq is measured against, and
``nfq-pyfloor``, the same reader in Python (``NfqPyFloor``), the floor of a Python reader
(their cells off the IPv4 NodePort paths are n/a, ``serves_path``); and ``relay-floor``,
a minimal relay in C (``RelayFloor``), the floor kpx's relay is measured against.
"""

from __future__ import annotations

import json
import re
import shutil
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from bench import k8s_state
from bench.backends import BACKENDS, BULK_PORT, HTTP_PORT, IPERF_PORT, UDP_PORT, BackendSet
from bench.procs import Proc, nofile_hard_limit
from bench.topology import (
    NODE1_IP,
    NODE1_IP6,
    NODE2_IP,
    NODE2_IP6,
    POD1_IP,
    POD1_IP6,
    POD2_IP,
    POD2_IP6,
    SERVICE_VIP,
    SERVICE_VIP6,
    CommandError,
    Topology,
    host_port,
    listening_ports,
    sh,
    udp_bound_ports,
)
from lab.common import poll, write_atomic

NFT_TABLE = "kpxbench"
VIP_PORTS = (80, BULK_PORT, IPERF_PORT)
"""The bench service's ports on its ClusterIP (http, bulk, iperf3): the same for every
contender on the clusterip path, as a ClusterIP is one address for the whole cluster."""
VIP_UDP_PORT = 53
"""The bench service's UDP port (targetPort ``UDP_PORT``), kube-dns style."""
UDP_OFFSET = 4
"""A contender's UDP front port is ``port_base + 4`` (kpx's UDP nodePort): http +0,
bulk +1, control +2, iperf3 +3 are taken."""


def client_role(path: str) -> str:
    """Where the load comes from: a pod on node1 (pod1) dials a ClusterIP; an
    outside client dials a NodePort (or, for direct, the pod)."""
    return "pod1" if path == "clusterip" else "client"


class ContenderError(RuntimeError):
    """The contender could not be started or does not forward correctly."""


@dataclass(frozen=True)
class Target:
    ip: str
    http_port: int
    bulk_port: int
    iperf_port: int
    """Only for ``--bulk-tool iperf3`` (base + 3: kpx's base + 2 is the control workload's)."""
    udp_port: int = 0
    """The udp workload's port (base + 4, the VIP's 53, or the pod's 5353); 0: no UDP."""


def http_get(ip: str, port: int, timeout: float = 2.0) -> str:
    """One HTTP/1.0 GET on a fresh connection; returns the body (the backend's name)."""
    with socket.create_connection((ip, port), timeout=timeout) as s:
        s.sendall(b"GET / HTTP/1.0\r\nHost: bench\r\n\r\n")
        chunks = []
        while True:
            b = s.recv(4096)
            if not b:
                break
            chunks.append(b)
    raw = b"".join(chunks).decode("latin-1")
    head, _, body = raw.partition("\r\n\r\n")
    if not head.startswith("HTTP/1.") or " 200 " not in head.split("\r\n", 1)[0] + " ":
        raise OSError(f"unexpected response: {head.splitlines()[0] if head else raw[:60]!r}")
    return body.strip()


def udp_who(ip: str, port: int, timeout: float = 5.0, every: float = 0.25) -> dict[str, Any]:
    """``WHO`` to ``lab.echo`` over UDP, resent every ``every`` s until ``timeout``.

    Resent because a datagram may be lost while a proxy sets its flow up (or
    is still applying its state); bounded by ``timeout``. Raises OSError with
    what was seen: an ICMP port unreachable (nothing bound there) reads
    differently from silence (something swallowed the datagram).
    """
    refused = 0
    deadline = time.monotonic() + timeout
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((ip, port))
        while (left := deadline - time.monotonic()) > 0:
            try:
                s.send(b"WHO")
                s.settimeout(min(every, left))
                data = s.recv(65535)
            except ConnectionRefusedError:
                refused += 1
                time.sleep(min(every, max(0.0, deadline - time.monotonic())))
                continue
            except TimeoutError:
                continue
            try:
                reply = json.loads(data)
            except ValueError:
                raise OSError(f"UDP {ip}:{port} answered {data[:60]!r}, not lab.echo's WHO "
                              f"JSON") from None
            if not isinstance(reply, dict):
                raise OSError(f"UDP {ip}:{port} answered {data[:60]!r}")
            return reply
    why = (f"ICMP port unreachable {refused} times: nothing is bound there" if refused
           else "no reply and no ICMP error: the datagrams were dropped on the way")
    raise OSError(f"no UDP reply from {ip}:{port} within {timeout:g}s ({why})")


class Contender:
    """Base: a way through node1. Subclasses set the class attributes below."""

    name = ""
    description = ""
    proxied = True
    """False for direct: no NodePort, the client dials the pod."""
    has_process = True
    """Whether there is a process whose RSS the mem workload can measure."""
    tcp = True
    """Forwards the TCP services (bulk, rr, cps, mem)."""
    udp = True
    """Forwards the UDP service (the udp workload)."""
    no_udp = ""
    """Why not, when ``udp`` is False (the udp cell's n/a reason)."""
    port_base = 0
    terminates_tcp = True
    """Whether the client's TCP connection ends in a proxy process on node1 (False: the
    kernel forwards it, and node1 sends no segment of its own for it)."""

    @classmethod
    def serves(cls, workload: str) -> str | None:
        """None when this contender takes part in ``workload``, else why not (an n/a cell)."""
        if workload == "udp":
            return None if cls.udp else cls.no_udp or f"{cls.name} forwards no UDP"
        if not cls.tcp:
            return f"{cls.name} forwards UDP only"
        if workload == "mem" and not cls.has_process:
            return "no proxy process: forwarding happens in the kernel"
        return None

    @classmethod
    def serves_path(cls, path: str, family: int) -> str | None:
        """None when this contender takes part on ``path`` over ``family``, else why not
        (its cells there are n/a)."""
        return None

    def __init__(self, topo: Topology, log_dir: Path) -> None:
        self.topo = topo
        self.log_dir = log_dir
        self.path = "local"
        self.family = 4
        """The address family of this start (4 or 6); the runner sets it before ``start``."""

    def unavailable(self) -> str | None:
        """Why this contender cannot run at all on this machine (checked once)."""
        return None

    def target(self) -> Target:
        return self.target_of(self.family)

    def target_of(self, family: int) -> Target:
        """Where the client dials over ``family``: node1's address of that family on the
        contender's ports (the clusterip path is IPv4 only)."""
        if self.path == "clusterip":
            return Target(SERVICE_VIP, *VIP_PORTS, udp_port=VIP_UDP_PORT)
        return Target(NODE1_IP6 if family == 6 else NODE1_IP, self.port_base,
                      self.port_base + 1, self.port_base + 3,
                      udp_port=self.port_base + UDP_OFFSET)

    def backend_ip(self) -> str:
        """The path's backend address in this start's family."""
        return self.backend().ip(self.family)

    @property
    def client_role(self) -> str:
        return client_role(self.path)

    def backend(self) -> BackendSet:
        return BACKENDS[self.path]

    def start(self, path: str) -> None:
        self.path = path

    def stop(self) -> None:
        """Idempotent; never raises."""

    def pids(self) -> list[int]:
        return []

    def alive_problem(self) -> str | None:
        """Set when the contender's process died (a crash is a failure reason)."""
        return None

    def verify(self) -> None:
        """An HTTP GET through the contender must reach the expected pod (for a
        UDP-only contender, a UDP ``WHO``; the udp workload asks every contender
        its own ``WHO`` first, so a proxy without UDP fails that cell alone)."""
        if not self.tcp:
            self.verify_udp()
            return
        t = self.target()
        want = self.backend().name
        last = ""
        for _ in range(3):
            try:
                got = self.topo.thread(self.client_role).call(http_get, t.ip, t.http_port)
            except OSError as e:
                last = f"GET http://{host_port(t.ip, t.http_port)}/ failed: {e}"
                continue
            if got == want:
                return
            last = f"GET http://{host_port(t.ip, t.http_port)}/ reached {got!r}, expected {want!r}"
        dead = self.alive_problem()
        raise ContenderError(dead or last)

    def verify_udp(self, timeout: float = 5.0) -> dict[str, Any]:
        """A UDP ``WHO`` through the contender must reach the expected pod; returns its reply."""
        t = self.target()
        want = self.backend().name
        try:
            reply = self.topo.thread(self.client_role).call(udp_who, t.ip, t.udp_port, timeout,
                                                            timeout=timeout + 10)
        except OSError as e:
            raise ContenderError(self.alive_problem() or str(e)) from e
        if reply.get("pod") != want:
            raise ContenderError(f"UDP WHO to {t.ip}:{t.udp_port} reached "
                                 f"{reply.get('pod')!r}, expected {want!r}")
        return reply

    def wait_udp_bound(self, proc: Proc, ports: set[int], timeout: float) -> None:
        """Until node1 has UDP sockets on ``ports``; a dead process fails at once."""
        ok = poll(lambda: not proc.alive()
                  or ports <= self.topo.thread("node1").call(udp_bound_ports), timeout, 0.05)
        if not proc.alive():
            raise ContenderError(
                f"{self.name} exited rc={proc.returncode()} during start-up: {proc.why()}")
        if not ok:
            raise ContenderError(f"{self.name} not bound to UDP {sorted(ports)} after "
                                 f"{timeout:.0f}s: {proc.why()}")

    def wait_listening(self, proc: Proc | None, ports: set[int], timeout: float,
                       family: int | None = None) -> None:
        """Until node1 has listeners on ``ports`` (of ``family``, default this start's);
        a dead process fails at once with its log."""
        fam = self.family if family is None else family

        def ready() -> bool:
            if proc is not None and not proc.alive():
                return True
            return ports <= self.topo.thread("node1").call(listening_ports, fam)

        ok = poll(ready, timeout, 0.05)
        if proc is not None and not proc.alive():
            raise ContenderError(
                f"{self.name} exited rc={proc.returncode()} during start-up: {proc.why()}"
            )
        if not ok:
            tail = f": {proc.why()}" if proc is not None else ""
            what = "IPv6 " if fam == 6 else ""
            raise ContenderError(
                f"{self.name} not listening on {what}{sorted(ports)} after {timeout:.0f}s{tail}"
            )


class Direct(Contender):
    name = "direct"
    description = "client -> pod, routed through the nodes, no proxy (the topology's ceiling)"
    proxied = False
    has_process = False
    terminates_tcp = False

    def target_of(self, family: int) -> Target:
        return Target(self.backend().ip(family), HTTP_PORT, BULK_PORT, IPERF_PORT, UDP_PORT)


class Kernel(Contender):
    name = "kernel"
    description = "nftables DNAT + masquerade in node1 (what kube-proxy's nftables mode does)"
    has_process = False
    terminates_tcp = False
    port_base = 30100

    def ruleset(self) -> str:
        """DNAT of the front address (node1's IP, or the ClusterIP) + masquerade.

        Over IPv6 the same rules go in a table of family ``ip6`` (``ip6
        daddr``, the pod's address in brackets), as kube-proxy's nftables
        mode keeps an ``ip6 kube-proxy`` table beside ``ip kube-proxy``.

        The UDP rule is the TCP one with ``udp``: conntrack keeps a UDP flow
        by its 4-tuple, so each of the udp workload's flows is DNATed once and
        its replies are un-NATed on the way back, as kube-proxy does for DNS.

        On the clusterip path the same rules are keyed on the VIP (DNAT in
        prerouting, before routing: no local address needed), masquerade kept
        as on the NodePort paths.
        """
        b = self.backend_ip()
        t = self.target()
        fam, match = self.nft_family(), "ip6 daddr" if self.family == 6 else "ip daddr"
        return (
            f"table {fam} {NFT_TABLE} {{\n"
            "  chain pre {\n"
            "    type nat hook prerouting priority dstnat; policy accept;\n"
            f"    {match} {t.ip} tcp dport {t.http_port} dnat to {host_port(b, HTTP_PORT)}\n"
            f"    {match} {t.ip} tcp dport {t.bulk_port} dnat to {host_port(b, BULK_PORT)}\n"
            f"    {match} {t.ip} tcp dport {t.iperf_port} dnat to {host_port(b, IPERF_PORT)}\n"
            f"    {match} {t.ip} udp dport {t.udp_port} dnat to {host_port(b, UDP_PORT)}\n"
            "  }\n"
            "  chain post {\n"
            "    type nat hook postrouting priority srcnat; policy accept;\n"
            "    ct status dnat masquerade\n"
            "  }\n"
            "}\n"
        )

    def nft_family(self) -> str:
        return "ip6" if self.family == 6 else "ip"

    def start(self, path: str) -> None:
        super().start(path)
        self._loaded = self.nft_family()
        try:
            self.topo.run("node1", ["nft", "-f", "-"], input_text=self.ruleset())
        except CommandError as e:
            raise ContenderError(f"nft: {e}") from e
        self.topo.conntrack_sysctls()

    _loaded = "ip"
    """The nft family of the table the last ``start`` loaded (what ``stop`` deletes)."""

    def stop(self) -> None:
        self.topo.run("node1", ["nft", "delete", "table", self._loaded, NFT_TABLE], check=False)


class ProcessContender(Contender):
    """A contender that is one userspace process (and its children) in node1."""

    def __init__(self, topo: Topology, log_dir: Path) -> None:
        super().__init__(topo, log_dir)
        self.proc: Proc | None = None
        self._vip_route = False

    def add_vip_route(self) -> None:
        """On the clusterip path, make the VIP local to node1 so the proxy can bind it
        (what kpx does for itself: a ``local`` route on lo)."""
        if self.path != "clusterip":
            return
        try:
            self.topo.ip("node1", "route", "replace", "local", f"{SERVICE_VIP}/32", "dev", "lo",
                         "table", "local")
        except CommandError as e:
            raise ContenderError(f"local route for {SERVICE_VIP}: {e}") from e
        self._vip_route = True

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()
            self.proc = None
        if self._vip_route:
            self.topo.ip("node1", "route", "del", "local", f"{SERVICE_VIP}/32", "dev", "lo",
                         "table", "local", check=False)
            self._vip_route = False

    def pids(self) -> list[int]:
        return self.proc.tree() if self.proc else []

    def alive_problem(self) -> str | None:
        if self.proc is not None and not self.proc.alive():
            return f"{self.name} died rc={self.proc.returncode()}: {self.proc.why()}"
        return None


class HAProxy(ProcessContender):
    name = "haproxy"
    description = "HAProxy TCP mode, nbthread 1, default buffers"
    port_base = 30200
    udp = False
    no_udp = "HAProxy has no UDP proxying (socat and naive are the userspace UDP peers)"

    def unavailable(self) -> str | None:
        if sh(["sh", "-c", "command -v haproxy"], check=False).returncode != 0:
            return "haproxy is not installed (apt-get install haproxy; .ci/system-deps does it)"
        return None

    def config(self) -> str:
        b = self.backend_ip()
        t = self.target()
        hard = nofile_hard_limit()
        maxconn = max(1000, (hard - 200) // 2)
        return "\n".join([
            "global",
            "    nbthread 1",
            f"    maxconn {maxconn}",
            f"    ulimit-n {hard}",
            "    no strict-limits",
            "defaults",
            "    mode tcp",
            f"    maxconn {maxconn}",
            "    timeout connect 5s",
            "    timeout client 10m",
            "    timeout server 10m",
            "frontend fe_http",
            f"    bind {host_port(t.ip, t.http_port)}",
            "    default_backend be_http",
            "backend be_http",
            f"    server pod {host_port(b, HTTP_PORT)}",
            "frontend fe_bulk",
            f"    bind {host_port(t.ip, t.bulk_port)}",
            "    default_backend be_bulk",
            "backend be_bulk",
            f"    server pod {host_port(b, BULK_PORT)}",
            "frontend fe_iperf",
            f"    bind {host_port(t.ip, t.iperf_port)}",
            "    default_backend be_iperf",
            "backend be_iperf",
            f"    server pod {host_port(b, IPERF_PORT)}",
        ]) + "\n"

    def start(self, path: str) -> None:
        super().start(path)
        cfg = self.log_dir / f"haproxy-{path}.cfg"
        cfg.write_text(self.config())
        self.add_vip_route()
        self.proc = Proc(f"haproxy-{path}",
                         self.topo.exec_argv("node1", ["haproxy", "-db", "-f", str(cfg)]),
                         self.log_dir, nofile=nofile_hard_limit()).start()
        t = self.target()
        self.wait_listening(self.proc, {t.http_port, t.bulk_port}, 10.0)


class Naive(ProcessContender):
    name = "naive"
    description = ("asyncio Streams copy loop, default event loop; UDP: a DatagramProtocol "
                   "relay, one upstream socket per client (bench/naive_proxy.py)")
    port_base = 30300

    def start(self, path: str) -> None:
        super().start(path)
        b = self.backend_ip()
        t = self.target()
        specs = [f"{host_port(t.ip, t.http_port)}={host_port(b, HTTP_PORT)}",
                 f"{host_port(t.ip, t.bulk_port)}={host_port(b, BULK_PORT)}",
                 f"{host_port(t.ip, t.iperf_port)}={host_port(b, IPERF_PORT)}",
                 f"udp:{host_port(t.ip, t.udp_port)}={host_port(b, UDP_PORT)}"]
        if self.family == 6:
            specs.pop()  # the udp workload is IPv4 only: no UDP front to wait for
        self.add_vip_route()
        self.proc = Proc(f"naive-{path}",
                         self.topo.exec_argv("node1", [sys.executable, "-m", "bench.naive_proxy",
                                                       *specs]),
                         self.log_dir, nofile=nofile_hard_limit()).start()
        self.wait_listening(self.proc, {t.http_port, t.bulk_port}, 15.0)
        if self.family == 4:
            self.wait_udp_bound(self.proc, {t.udp_port}, 5.0)


class Socat(ProcessContender):
    """socat ``UDP4-LISTEN,fork``: the userspace UDP peer HAProxy cannot be.

    Why socat: it is what an operator reaches for to relay UDP, it is C, and
    its fork per flow is the textbook naive design (each flow a process with
    its own connected sockets; the per-datagram work is then one blocking
    read and write in C). What it costs is the fork at a flow's first
    datagram, which the udp client's warm-up keeps out of the steady-state
    rate, and a process per flow, which 50 flows on 2 cores feel. ``-T 30``
    ends a child idle for 30 s, so children stay bounded between runs.
    """

    name = "socat"
    description = "socat UDP4-LISTEN,fork,reuseaddr -> UDP4 (a process per flow), UDP only"
    port_base = 30600
    tcp = False

    def unavailable(self) -> str | None:
        if sh(["sh", "-c", "command -v socat"], check=False).returncode != 0:
            return "socat is not installed (apt-get install socat; .ci/system-deps does it)"
        return None

    def argv(self) -> list[str]:
        t = self.target()
        b = self.backend().http_ip
        return ["socat", "-T", "30",
                f"UDP4-LISTEN:{t.udp_port},bind={t.ip},fork,reuseaddr",
                f"UDP4:{b}:{UDP_PORT}"]

    def start(self, path: str) -> None:
        super().start(path)
        self.add_vip_route()
        self.proc = Proc(f"socat-{path}", self.topo.exec_argv("node1", self.argv()),
                         self.log_dir).start()
        self.wait_udp_bound(self.proc, {self.target().udp_port}, 10.0)


def bench_state(path: str, http_node_port: int, bulk_node_port: int,
                extra: list[k8s_state.ServiceSpec] | None = None, etp: str = "Cluster",
                iperf_node_port: int | None = None, udp_node_port: int | None = None,
                family: int = 4) -> str:
    """The kpx state for one path: the bench service plus ``extra`` services.

    Ports: http (80 -> 8080), bulk (5202) and iperf3 (5201; nodePort defaults
    to ``http_node_port + 3``, the contender's iperf front port), and with
    ``udp_node_port`` a UDP port ``echo-udp`` (53 -> 5353), kube-dns style: a
    mixed-protocol service, the slice port carrying ``protocol: UDP`` too.

    ``family=6`` (an IPv6 run): the cluster is dual-stack. Both Nodes carry
    their IPv6 InternalIP after the IPv4 one, the bench service is
    ``ipFamilyPolicy: PreferDualStack`` with ``ipFamilies: [IPv4, IPv6]`` and
    both ClusterIPs, and its endpoint has an ``addressType: IPv6`` slice
    beside the IPv4 one: the same service reached on node1's IPv6 address.
    Dual-stack rather than IPv6-only so that one start proves kpx took the
    state (its IPv4 NodePorts listen) before its IPv6 ones are judged, and
    because that is the service a dual-stack cluster's users have.
    """
    if family == 6 and path == "clusterip":
        raise ValueError("the clusterip path is not run over IPv6: only local and cross")
    local = path == "local"
    ep = k8s_state.Ep(POD1_IP, "node1") if local else k8s_state.Ep(POD2_IP, "node2")
    http, bulk, iperf = VIP_PORTS
    udp = (k8s_state.Port("echo-udp", VIP_UDP_PORT, UDP_PORT, udp_node_port, "UDP"),) \
        if udp_node_port else ()
    svc = k8s_state.ServiceSpec(
        name="bench",
        ports=(k8s_state.Port("http", http, HTTP_PORT, http_node_port),
               k8s_state.Port("bulk", bulk, BULK_PORT, bulk_node_port),
               k8s_state.Port("iperf", iperf, IPERF_PORT,
                              iperf_node_port or http_node_port + 3), *udp),
        endpoints=(ep,),
        etp=etp,
        cluster_ip=SERVICE_VIP,
    )
    if family == 6:
        svc = replace(svc, ip_families=("IPv4", "IPv6"), cluster_ips=(SERVICE_VIP, SERVICE_VIP6),
                      endpoints6=(k8s_state.Ep(POD1_IP6 if local else POD2_IP6, ep.node),))
        nodes = [("node1", NODE1_IP, NODE1_IP6), ("node2", NODE2_IP, NODE2_IP6)]
    else:
        nodes = [("node1", NODE1_IP), ("node2", NODE2_IP)]
    return k8s_state.render(nodes, [svc, *(extra or [])])


class Kpx(ProcessContender):
    """``kpx node`` fed a state file, in its default configuration (+ ``--workers``)."""

    name = "kpx"
    description = "kpx node, default configuration (one worker)"
    port_base = 30400
    workers = 0
    start_timeout = 30.0
    proxy_mode = "userspace"
    """``kpx node --proxy-mode``: what the control workloads see in force (listeners or
    kpx's nft set, ``bench.control``)."""

    def __init__(self, topo: Topology, log_dir: Path, kpx: str, etp: str = "Cluster",
                 udp_service: bool = False) -> None:
        super().__init__(topo, log_dir)
        self.kpx = kpx
        self.etp = etp
        self.udp_service = udp_service
        """Give the bench service its UDP port (only when the udp workload runs, so
        the TCP workloads measure the same kpx state as before UDP existed)."""
        self.state_path = log_dir / f"state-{self.name}.yaml"
        self._help: str | None = None

    def node_help(self) -> str:
        """``kpx node --help``, cached; raises ContenderError with why it failed."""
        if self._help is None:
            cp = sh([self.kpx, "node", "--help"], check=False, timeout=60)
            if cp.returncode != 0:
                err = (cp.stderr or cp.stdout).strip().splitlines()
                raise ContenderError(
                    f"`kpx node --help` failed rc={cp.returncode}: "
                    f"{err[-1] if err else 'no output'}"
                )
            self._help = cp.stdout
        return self._help

    def unavailable(self) -> str | None:
        try:
            text = self.node_help()
        except ContenderError as e:
            return str(e)
        missing = [f for f in ("--state", "--hostname-override", "--no-healthz")
                   if f not in text]
        if missing:
            return f"`kpx node` lacks {', '.join(missing)}"
        if self.workers and not re.search(r"--workers\b", text):
            return "not available: `kpx node --help` shows no --workers"
        return None

    healthz_bind: str | None = None
    """``IP:PORT`` to run kpx's healthz sidecar on (the control stall workload probes
    ``/healthz``); None runs ``--no-healthz``, as every other workload does."""

    def argv(self) -> list[str]:
        argv = [self.kpx, "node", "--hostname-override", "node1",
                "--state", str(self.state_path)]
        if self.healthz_bind:
            argv += ["--healthz-bind-address", self.healthz_bind,
                     "--metrics-bind-address", "127.0.0.1:10249"]
        else:
            argv.append("--no-healthz")
        if self.workers:
            argv += ["--workers", str(self.workers)]
        return argv

    def launch(self, path: str, state: str | None) -> Proc:
        """Write the state (``state``, or the bench's own for ``path``) and start ``kpx node``.

        NodePorts are the contender's own ports on every path; the ClusterIP's
        ports (VIP_PORTS) are what the clusterip path's target dials.
        """
        udp_node_port = self.port_base + UDP_OFFSET if self.udp_service else None
        write_atomic(self.state_path,
                     state or bench_state(path, self.port_base, self.port_base + 1,
                                          etp=self.etp, udp_node_port=udp_node_port,
                                          family=self.family))
        self.proc = Proc(f"{self.name}-{path}", self.topo.exec_argv("node1", self.argv()),
                         self.log_dir, nofile=nofile_hard_limit()).start()
        return self.proc

    ipv6_grace = 10.0
    """Seconds an IPv6 start waits for kpx's IPv6 front once its IPv4 one is up: both
    come from the same sync of the same dual-stack state."""

    def start(self, path: str, state: str | None = None) -> None:
        super().start(path)
        t = self.target()
        proc = self.launch(path, state)
        if self.family == 6:
            # The IPv4 listeners say kpx has taken the state; then its IPv6 ones.
            self.wait_listening(proc, {t.http_port, t.bulk_port}, self.start_timeout, family=4)
            self.wait_ipv6(proc, lambda: self.wait_listening(
                proc, {t.http_port, t.bulk_port}, self.ipv6_grace))
            return
        if path != "clusterip":
            self.wait_listening(proc, {t.http_port, t.bulk_port}, self.start_timeout)
            return
        # kpx listens on its NodePorts, but not on the VIP: ready once a GET
        # through the VIP answers (the routes and rules are put in force after
        # the first sync, in the background).
        self.wait_listening(proc, {self.port_base, self.port_base + 1}, self.start_timeout)
        self.wait_answering(proc)

    def wait_ipv6(self, proc: Proc, wait: Callable[[], None]) -> None:
        """``wait`` for the IPv6 front of a kpx that has already served the state's IPv4
        one; its failure says what an IPv6 cell needs to say (kpx does not serve IPv6,
        as before issue 14), and comes within ``ipv6_grace`` rather than a hang."""
        try:
            wait()
        except ContenderError as e:
            t = self.target_of(6)
            raise ContenderError(
                f"{self.name} serves the dual-stack bench service on node1's IPv4 address "
                f"but not on its IPv6 address {host_port(t.ip, t.http_port)} within "
                f"{self.ipv6_grace:g}s (does this kpx serve IPv6 NodePorts? issue 14): {e}"
            ) from e

    def wait_answering(self, proc: Proc, family: int | None = None,
                       timeout: float | None = None) -> None:
        """Until a GET through the target (of ``family``, default this start's) answers:
        for rules put in force after a sync."""
        t = self.target_of(self.family if family is None else family)
        timeout = self.start_timeout if timeout is None else timeout

        def answers() -> bool:
            if not proc.alive():
                return True
            try:
                self.topo.thread(self.client_role).call(http_get, t.ip, t.http_port, 0.5)
            except OSError:
                return False
            return True

        if not poll(answers, timeout, 0.05) or not proc.alive():
            raise ContenderError(f"{self.name}: no answer through "
                                 f"{host_port(t.ip, t.http_port)} after {timeout:g}s: "
                                 f"{proc.why()}")


class KpxWorkers(Kpx):
    name = "kpx-w2"
    description = "kpx node --workers 2 (SO_REUSEPORT workers)"
    port_base = 30500
    workers = 2

    @classmethod
    def serves(cls, workload: str) -> str | None:
        if workload == "control":
            return ("the control workloads run once per proxy mode, on kpx and kpx-nfq "
                    "(one worker each)")
        return super().serves(workload)


class KpxPython(Kpx):
    """``kpx node`` on its pure-Python relay (``KPX_NO_EXTENSIONS=1``): what the compiled
    relay core gains, in the same run. Asked for by name."""

    name = "kpx-py"
    description = "kpx node on the pure-Python relay (KPX_NO_EXTENSIONS=1)"
    port_base = 31000

    @classmethod
    def serves(cls, workload: str) -> str | None:
        if workload == "control":
            return "the control workloads run on kpx (the relay does not change them)"
        return super().serves(workload)

    def argv(self) -> list[str]:
        return ["env", "KPX_NO_EXTENSIONS=1", *super().argv()]


class KpxNfqueue(Kpx):
    """``kpx node --proxy-mode nfqueue``: Python decides each SYN, conntrack DNAT the rest."""

    name = "kpx-nfq"
    description = "kpx node --proxy-mode nfqueue (SYN decided in Python, kernel forwards)"
    port_base = 30600
    terminates_tcp = False
    proxy_mode = "nfqueue"

    @classmethod
    def serves(cls, workload: str) -> str | None:
        if workload == "mem":
            return "no proxied connection in the process: conntrack holds them"
        return super().serves(workload)

    def unavailable(self) -> str | None:
        why = super().unavailable()
        if why is None and "nfqueue" not in self.node_help():
            return "not available: `kpx node --help` shows no --proxy-mode nfqueue"
        return why

    def argv(self) -> list[str]:
        return [*super().argv(), "--proxy-mode", "nfqueue"]

    def start(self, path: str, state: str | None = None) -> None:
        # Nothing listens in this mode: ready once a GET through the target answers
        # (over IPv6: once one through the IPv4 front has, then one through the IPv6 one).
        ProcessContender.start(self, path)
        proc = self.launch(path, state)
        if self.family == 6:
            self.wait_answering(proc, family=4)
            self.wait_ipv6(proc, lambda: self.wait_answering(proc, timeout=self.ipv6_grace))
            return
        self.wait_answering(proc)


NFQ_QUEUED, NFQ_MASQUERADE, NFQ_MASK = 0x1000, 0x8000_0000, 0xFFFF_1000
"""kpx-nfq's marks, as its README documents them ("Marks"): queued, SNAT, and every bit
of its layout (queued, the endpoint's index, SNAT)."""
NFQ_QUEUE = 7078
"""``kpx node --queue-num``'s default: the queue kpx-nfq's rules send SYNs to."""
FLOOR_SOURCE = Path(__file__).with_name("nfqfloor.c")


def build_c(source: Path, log_dir: Path) -> Path:
    """``source`` (a diagnostic floor in C) compiled into ``log_dir``, once per run."""
    binary = log_dir / source.stem
    if not binary.exists():
        cp = sh(["cc", "-O2", "-o", str(binary), str(source)], check=False, timeout=60)
        if cp.returncode != 0:
            raise ContenderError(f"cc {source.name}: {cp.stderr.strip()[-300:]}")
    return binary


class NfqFloor(KpxNfqueue):
    """kpx-nfq's own rules, with every SYN answered by a minimal C reader (``nfqfloor.c``).

    The floor of any NFQUEUE design on this machine: kpx-nfq starts as usual (its table,
    DNAT maps and queueing rules go in) and, once it answers, is SIGKILLed, which leaves
    them in place; then ``nfqfloor`` binds the queue and answers each SYN with the mark of
    one of the port's endpoints (round robin; SNAT on the cross path, as kpx decides for an
    endpoint on another node). So in the same run, kpx-nfq's gap to kernel DNAT splits
    into the queue's (this one's gap) and kpx's Python's (kpx-nfq's gap to this one).
    IPv4 NodePorts only (the local and cross paths); asked for by name, never by default.
    """

    name = "nfq-floor"
    description = ("kpx-nfq's rules, every SYN answered by a minimal C reader: the NFQUEUE "
                   "floor")
    port_base = 30700

    @classmethod
    def serves(cls, workload: str) -> str | None:
        if workload == "udp":
            return "answers TCP SYNs only: the floor of kpx-nfq's connection setup"
        return super().serves(workload)

    def unavailable(self) -> str | None:
        if shutil.which("cc") is None:
            return f"not available: no C compiler (cc) to build {FLOOR_SOURCE.name}"
        return super().unavailable()

    def build(self) -> Path:
        return build_c(FLOOR_SOURCE, self.log_dir)

    def marks(self, path: str) -> dict[int, list[int]]:
        """Each TCP port's FORWARD marks, from kpx-nfq's NodePort DNAT map in node1."""
        listed = self.topo.run("node1", ["nft", "-j", "list", "map", "ip", "kpx_nfq",
                                         "np_targets"], check=False)
        snat = NFQ_MASQUERADE if path == "cross" else 0
        out: dict[int, list[int]] = {}
        try:
            for item in json.loads(listed.stdout or "{}").get("nftables", []):
                for elem in (item.get("map") or {}).get("elem", []):
                    index, proto, port = elem[0]["concat"]
                    if proto == "tcp":
                        out.setdefault(port, []).append(index | NFQ_QUEUED | snat)
        except (KeyError, TypeError, ValueError) as e:
            raise ContenderError(f"kpx-nfq's np_targets map: {e}: {listed.stdout[:200]}"
                                 f"{listed.stderr[:200]}") from e
        if not out:
            raise ContenderError(f"kpx-nfq's np_targets map has no TCP element:"
                                 f" {listed.stdout[:200]}{listed.stderr[:200]}")
        return out

    @classmethod
    def serves_path(cls, path: str, family: int) -> str | None:
        if family != 4 or path not in ("local", "cross"):
            return "answers IPv4 NodePort SYNs only (the local and cross paths)"
        return None

    def reader(self) -> list[str]:
        """The command that answers the queue in kpx-nfq's place, before its arguments."""
        return [str(self.build())]

    def start(self, path: str, state: str | None = None) -> None:
        reader = self.reader()
        super().start(path, state)  # kpx-nfq, until it answers: its rules are in
        kpx, marks = self.proc, self.marks(path)
        assert kpx is not None
        kpx.kill()
        argv = [*reader, str(NFQ_QUEUE), hex(NFQ_MASK),
                *(f"{port}={','.join(map(hex, m))}" for port, m in sorted(marks.items()))]
        self.proc = Proc(f"{self.name}-{path}", self.topo.exec_argv("node1", argv),
                         self.log_dir).start()
        self.wait_answering(self.proc)

    def stop(self) -> None:
        super().stop()
        self.topo.reset_node1()  # kpx-nfq's rules, which its SIGKILL left for the floor


PYFLOOR_SOURCE = Path(__file__).with_name("nfqpyfloor.py")


class NfqPyFloor(NfqFloor):
    """``nfq-floor`` with its reader in Python (``nfqpyfloor.py``): the floor of a Python
    NFQUEUE reader on this machine.

    The same rules, marks and batches as the C floor, in one Python thread that does
    nothing else. Its gap to the C floor is what the interpreter costs (woken cold, per
    SYN); kpx-nfq's gap to it is what kpx's reader adds (its parsing, plans and
    ``decide``). Run by the interpreter kpx runs on. Asked for by name, never by default.
    """

    name = "nfq-pyfloor"
    description = ("kpx-nfq's rules, every SYN answered by a minimal Python reader: the floor "
                   "of a Python reader")
    port_base = 30800

    def unavailable(self) -> str | None:
        return KpxNfqueue.unavailable(self)  # no compiler needed

    def reader(self) -> list[str]:
        return [sys.executable, str(PYFLOOR_SOURCE)]


RELAY_FLOOR_SOURCE = Path(__file__).with_name("relayfloor.c")


class RelayFloor(ProcessContender):
    """A minimal relay in C (``relayfloor.c``): the floor of a relay that terminates both
    TCP connections on this machine.

    One thread, one epoll set, no decision, no timeout: accept, connect to the pod, bytes
    both ways, half-close and RST passed on, with the fewest syscalls a relay can make. So
    in the same run the relay's gap to HAProxy (issue 15's cps and rr, cross path) splits
    into what terminating both connections costs here (this one's gap to HAProxy) and what
    kpx's Python costs on top (kpx's gap to this one). TCP only; asked for by name, never
    by default.
    """

    name = "relay-floor"
    description = ("a minimal relay in C, one thread, no decision: the floor of a relay that "
                   "terminates both connections")
    port_base = 30900
    udp = False
    no_udp = "a TCP relay only: the floor of the relay's TCP connections"

    def unavailable(self) -> str | None:
        if shutil.which("cc") is None:
            return f"not available: no C compiler (cc) to build {RELAY_FLOOR_SOURCE.name}"
        return None

    def build(self) -> Path:
        return build_c(RELAY_FLOOR_SOURCE, self.log_dir)

    def start(self, path: str) -> None:
        super().start(path)
        binary = self.build()
        b = self.backend_ip()
        t = self.target()
        specs = [f"{host_port(t.ip, port)}={host_port(b, to)}"
                 for port, to in ((t.http_port, HTTP_PORT), (t.bulk_port, BULK_PORT),
                                  (t.iperf_port, IPERF_PORT))]
        self.add_vip_route()
        self.proc = Proc(f"{self.name}-{path}",
                         self.topo.exec_argv("node1", [str(binary), *specs]),
                         self.log_dir, nofile=nofile_hard_limit()).start()
        self.wait_listening(self.proc, {t.http_port, t.bulk_port}, 10.0)


CONTENDER_ORDER = ("direct", "kernel", "haproxy", "naive", "socat", "kpx", "kpx-py", "kpx-w2",
                   "kpx-nfq", "nfq-floor", "nfq-pyfloor", "relay-floor")
"""Every contender, in run and report order."""
UDP_ONLY = ("socat",)
"""Contenders that take part only in the udp workload: in the default list only
when udp runs, so the default TCP run is the same as before they existed."""
BY_NAME_ONLY = ("kpx-py", "nfq-floor", "nfq-pyfloor", "relay-floor")
"""Diagnostic contenders, run only when ``--contenders`` names them."""
CLASSES: dict[str, type[Contender]] = {
    "direct": Direct, "kernel": Kernel, "haproxy": HAProxy, "naive": Naive, "socat": Socat,
    "kpx": Kpx, "kpx-py": KpxPython,
    "kpx-w2": KpxWorkers, "kpx-nfq": KpxNfqueue, "nfq-floor": NfqFloor,
    "nfq-pyfloor": NfqPyFloor, "relay-floor": RelayFloor,
}


def default_contenders(workloads: list[str]) -> list[str]:
    """Every contender, but the UDP-only ones only when the udp workload runs, and the
    diagnostic ones never."""
    return [c for c in CONTENDER_ORDER
            if c not in BY_NAME_ONLY and (c not in UDP_ONLY or "udp" in workloads)]


def serves(name: str, workload: str, path: str | None = None, family: int = 4) -> str | None:
    """None when contender ``name`` takes part in ``workload`` (on ``path`` over ``family``,
    when given); else the n/a reason."""
    cls = CLASSES[name]
    return cls.serves(workload) or (None if path is None else cls.serves_path(path, family))


def control_contenders(names: list[str]) -> list[str]:
    """Of ``names``, the kpx contenders the control workloads run for, in run order:
    one per proxy mode (kpx, kpx-nfq), each that ``serves("control")``."""
    return [n for n in CONTENDER_ORDER if n in names and issubclass(CLASSES[n], Kpx)
            and CLASSES[n].serves("control") is None]


def make_contenders(names: list[str], topo: Topology, log_dir: Path,
                    kpx: str, etp: str = "Cluster", udp: bool = False) -> list[Contender]:
    """The named contenders; ``udp``: the udp workload runs (kpx's state gets a UDP port)."""
    table: dict[str, Contender] = {
        "direct": Direct(topo, log_dir),
        "kernel": Kernel(topo, log_dir),
        "haproxy": HAProxy(topo, log_dir),
        "naive": Naive(topo, log_dir),
        "socat": Socat(topo, log_dir),
        "kpx": Kpx(topo, log_dir, kpx, etp, udp_service=udp),
        "kpx-py": KpxPython(topo, log_dir, kpx, etp, udp_service=udp),
        "kpx-w2": KpxWorkers(topo, log_dir, kpx, etp, udp_service=udp),
        "kpx-nfq": KpxNfqueue(topo, log_dir, kpx, etp, udp_service=udp),
        "nfq-floor": NfqFloor(topo, log_dir, kpx, etp, udp_service=udp),
        "nfq-pyfloor": NfqPyFloor(topo, log_dir, kpx, etp, udp_service=udp),
        "relay-floor": RelayFloor(topo, log_dir),
    }
    return [table[n] for n in names]
