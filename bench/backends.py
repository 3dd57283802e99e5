"""The backends every contender forwards to: HTTP, the exact bulk sink and iperf3 per pod.

Owns: the backends' configuration, starting them in the pod namespaces (an
HAProxy per HTTP address, a ``bench.bulk`` sink and an iperf3 server per pod,
and, when the ``udp`` workload runs, a ``lab.echo`` per pod for UDP),
waiting until they listen, checking they are still up, and stopping them.

Never: run a backend outside a pod namespace or stop anything it did not
start: every process is a ``bench.procs.Proc`` and is stopped by its pid.

Why HAProxy as the HTTP backend: nginx is not installed here, and HAProxy's
``http-request return`` answers a static 200 from C with no file I/O, so the
backend is never the Python side of the comparison. It runs single-threaded
so it does not steal both cores from the contender being measured. The body
names the backend ("pod1-a", "pod1-b", "pod2"), which is how the convergence
probe knows which endpoint a connection reached.

Timeouts are long so the 10,000 idle connections of the mem workload stay
open while RSS is sampled; ``maxconn`` is high enough for them.

Why ``lab.echo`` as the UDP backend: it echoes any datagram that is not a
``WHO``/``ECHO`` command unchanged and answers ``WHO`` with its name, which
is both the udp load's server and its functional probe. It is Python (one
uvloop process, about 5 us per datagram), so on the direct and kernel paths
it shares the ceiling with the client; a proxy in the middle costs far more.
It is bound to one address of its pod (pod1 has two, and a reply sent from
the other would be dropped by the client's connected socket), and runs only
when ``udp`` does, so the TCP workloads' pods are exactly as before.

With ``ipv6`` (an IPv6 run, issue 14) the same HTTP backends also answer on
the pods' IPv6 addresses, under the same names: one HAProxy per pod with a
bind per address, so a backend is the same process whichever family reaches
it. The bulk sink, iperf3 and the UDP echo stay IPv4: IPv6 runs cover rr and
cps only.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from bench.procs import Proc, nofile_hard_limit
from bench.topology import (
    POD1_ALT_IP,
    POD1_ALT_IP6,
    POD1_IP,
    POD1_IP6,
    POD2_IP,
    POD2_IP6,
    Topology,
    host_port,
    listening_ports,
    read_tcp_table,
    udp_bound_ports,
)
from lab.common import poll

HTTP_PORT = 8080
IPERF_PORT = 5201
BULK_PORT = 5202
UDP_PORT = 5353
"""The UDP echo's port in each pod: the bench service's UDP targetPort."""
BACKEND_MAXCONN = 19000


@dataclass(frozen=True)
class BackendSet:
    """Addresses of the pod backends; ``http`` is what rr/cps/mem hit on each path."""

    http_ip: str
    name: str
    http_ip6: str | None = None
    """The same backend's IPv6 address (answering with the same name)."""

    def ip(self, family: int = 4) -> str:
        """The backend's address in ``family``; raises ValueError when it has none."""
        if family == 4:
            return self.http_ip
        if self.http_ip6 is None:
            raise ValueError(f"backend {self.name} has no IPv6 address")
        return self.http_ip6


BACKENDS = {
    "local": BackendSet(POD1_IP, "pod1-a", POD1_IP6),
    "cross": BackendSet(POD2_IP, "pod2", POD2_IP6),
    "clusterip": BackendSet(POD2_IP, "pod2"),  # the ClusterIP's endpoint is on node2
}
ALT_LOCAL = BackendSet(POD1_ALT_IP, "pod1-b", POD1_ALT_IP6)


def haproxy_http_config(binds: list[tuple[str, str]]) -> str:
    """An HAProxy config answering ``200 <name>`` on each (ip, name).

    One frontend per name, with a bind per address (an IPv6 one in brackets):
    a backend reached over IPv4 or IPv6 is the same frontend, named the same.
    """
    lines = [
        "global",
        "    nbthread 1",
        f"    maxconn {BACKEND_MAXCONN}",
        # A server that never connects out needs one fd per connection, but
        # HAProxy budgets two; pin ulimit-n to what we can get (a warning only).
        f"    ulimit-n {nofile_hard_limit()}",
        "    no strict-limits",
        "defaults",
        "    mode http",
        "    timeout connect 5s",
        "    timeout client 10m",
        "    timeout server 10m",
        "    timeout http-request 10m",
        "    timeout http-keep-alive 10m",
        f"    maxconn {BACKEND_MAXCONN}",
    ]
    by_name: dict[str, list[str]] = {}
    for ip, name in binds:
        by_name.setdefault(name, []).append(ip)
    for name, ips in by_name.items():
        lines.append(f"frontend web_{name.replace('-', '_')}")
        lines += [f"    bind {host_port(ip, HTTP_PORT)}" for ip in ips]
        lines.append(
            f'    http-request return status 200 content-type text/plain string "{name}\\n"')
    return "\n".join(lines) + "\n"


class Backends:
    """Start/stop the pod backends for the whole bench run."""

    def __init__(self, topo: Topology, log_dir: Path, udp: bool = False,
                 ipv6: bool = False) -> None:
        self.topo = topo
        self.log_dir = log_dir
        self.udp = udp
        """Also start the UDP echo (only when the udp workload runs)."""
        self.ipv6 = ipv6
        """The HTTP backends also answer on the pods' IPv6 addresses (an IPv6 run)."""
        self.procs: dict[str, Proc] = {}

    def binds(self) -> dict[str, list[tuple[str, str]]]:
        """Per pod, the (address, name) pairs its HTTP backend answers on; the pod's
        first IPv4 address is its bulk, iperf3 and UDP address."""
        out = {"pod1": [(POD1_IP, "pod1-a"), (POD1_ALT_IP, "pod1-b")],
               "pod2": [(POD2_IP, "pod2")]}
        if self.ipv6:
            out["pod1"] += [(POD1_IP6, "pod1-a"), (POD1_ALT_IP6, "pod1-b")]
            out["pod2"] += [(POD2_IP6, "pod2")]
        return out

    def start(self) -> None:
        for role, binds in self.binds().items():
            if self.udp:
                ip, name = binds[0]
                self.procs[f"udp-{role}"] = Proc(
                    f"backend-udp-{role}",
                    self.topo.exec_argv(role, [sys.executable, "-m", "lab.echo", "--name", name,
                                               "--node", role.replace("pod", "node"),
                                               "--bind", ip, "--port", str(UDP_PORT)]),
                    self.log_dir,
                ).start()
            cfg = self.log_dir / f"backend-{role}.cfg"
            cfg.write_text(haproxy_http_config(binds))
            self.procs[f"http-{role}"] = Proc(
                f"backend-http-{role}",
                self.topo.exec_argv(role, ["haproxy", "-db", "-f", str(cfg)]),
                self.log_dir, nofile=nofile_hard_limit(),
            ).start()
            ip = binds[0][0]
            self.procs[f"iperf-{role}"] = Proc(
                f"backend-iperf-{role}",
                self.topo.exec_argv(role, ["iperf3", "-s", "-B", ip, "-p", str(IPERF_PORT)]),
                self.log_dir,
            ).start()
            self.procs[f"bulk-{role}"] = Proc(
                f"backend-bulk-{role}",
                self.topo.exec_argv(role, [sys.executable, "-m", "bench.bulk", "sink",
                                           "--bind", ip, "--port", str(BULK_PORT)]),
                self.log_dir,
            ).start()

    def wait_ready(self, timeout: float = 10.0) -> None:
        """Block until both pods listen on the HTTP, bulk and iperf3 ports (and UDP), or raise."""
        for role in ("pod1", "pod2"):
            def listening(role: str = role) -> bool:
                table = self.topo.thread(role).call(read_tcp_table)
                ports = {lp for lp, _, st in table if st == "LISTEN"}
                if self.udp and UDP_PORT not in self.topo.thread(role).call(udp_bound_ports):
                    return False
                if self.ipv6 and HTTP_PORT not in self.topo.thread(role).call(
                        listening_ports, 6):
                    return False
                return {HTTP_PORT, IPERF_PORT, BULK_PORT} <= ports
            if not poll(listening, timeout, 0.05):
                raise RuntimeError(f"backends in {role} not listening: {self.check()}")

    def http_pid(self, path: str) -> int:
        return self.procs["http-pod1" if path == "local" else "http-pod2"].pid

    def check(self) -> list[str]:
        """Problems with the backends (dead processes), each with its log tail."""
        return [
            f"{p.name} exited rc={p.returncode()}: {p.tail(5)}"
            for p in self.procs.values() if not p.alive()
        ]

    def stop(self) -> None:
        for p in self.procs.values():
            p.stop()
