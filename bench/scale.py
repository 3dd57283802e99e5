"""``kpx bench --scale``: kube-proxy's iptables and nftables layouts against kpx, at scale.

Owns: the scale topology (its own namespaces, ``ks<pid%1000>-*``), the
services every contender serves, the contenders (kube-proxy's rules loaded
with ``iptables-restore`` on either backend and with ``nft -f``, ``kpx node``
in each proxy mode, IPVS when the kernel has it), the measurements per
contender and service count, and the table, JSON and PNG they end in.

Never: touch the root namespace (links are made inside bench namespaces,
rules are loaded in ``node`` only), leave a namespace or a process behind
(``finally``), or give a number to a point whose checks failed.

Layout::

    client 10.91.1.2 -- 10.91.1.1 node 10.91.10.1 -- 10.91.10.2 pod0: local 10.128.0.0/16
                                       10.91.11.1 -- 10.91.11.2 pod1: local 10.129.0.0/16
                                       10.91.12.1 -- 10.91.12.2 pod2: local 10.130.0.0/16

Service i is NodePort ``20000 + i`` with ClusterIP ``10.96.0.0 + 10 + i``
port 80 and three endpoints, ``10.(128+j).(i>>8).(i&255):8080`` for j = 0,
1, 2 (node ``node``, so kpx keeps the client's address). Each pod namespace
makes its whole /16 local, so one backend per pod (``bench.scaleprobe``)
answers every endpoint address, and tells which one it was. The client
dials ClusterIPs: every contender serves them (kpx with one listener for
all), whereas a NodePort is one listening socket in kpx's userspace mode.

Per contender and service count N, in this order, with one check before any
figure: (1) *program*: all N services from nothing (``iptables-restore``,
``nft -f``; for kpx from the rename of the state file to its log line saying
that generation is in force); (2) *check*: the first, the last and 20
seeded random services answer from one of their own endpoints; (3)
*latency*: connect() time to services drawn from one seeded RNG (the same
list for every contender at N); (4) *rate*: fresh connections per second
to the last service (iptables walks KUBE-SERVICES in order); (5) *change*:
one endpoint of the last service moves (iptables-restore of a partial sync,
nft -f of its transaction, kpx's next generation in force), then that
service must answer from the new endpoint; (6) *memory*: the kernel's
Slab + VmallocUsed + Percpu growth over the load (machine-wide, so other
work on the machine moves it) and kpx's RSS.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TextIO

from bench import k8s_state
from bench import kube_rules as kr
from bench.control import percentile
from bench.procs import Proc, nofile_hard_limit, process_tree, rss_bytes
from bench.results import CellTable, Run, document, write
from bench.scaleprobe import answered_by
from bench.topology import CommandError, NsThread, sh
from lab.common import poll, write_atomic
from lab.netns import list_namespaces

NODE = "node"
NODE_IP = "10.91.1.1"
CLIENT_IP = "10.91.1.2"
PODS = 3
BACKEND_PORT = 8080
SERVICE_PORT = 80
FIRST_NODE_PORT = 20000
POD_CIDR = "10.128.0.0/14"
"""The pods' addresses (10.128-10.131/16): kube-proxy's local-traffic detector."""
SIZES = (1000, 5000, 10000, 30000)
CONTENDERS = ("iptables-nft", "iptables-legacy", "nftables", "ipvs", "kpx", "kpx-nfq")
CHECKED = 20
"""Random services checked for the right answer before any figure, besides the first and last."""
MEM_KEYS = ("Slab", "VmallocUsed", "Percpu")
GENERATION = re.compile(r"(service VIPs|nfqueue rules) in force \(generation (\d+)\)")
REFUSED = re.compile(r"[^\n]*(?:not put in force|cannot put \d+ service VIPs in force|"
                     r"Too many open files)[^\n]*")


# ---- the services --------------------------------------------------------------------------


def cluster_ip(i: int) -> str:
    n = i + 10
    return f"10.{96 + (n >> 16)}.{(n >> 8) & 255}.{n & 255}"


def endpoint_ip(i: int, j: int) -> str:
    return f"10.{128 + j}.{(i >> 8) & 255}.{i & 255}"


def moved_ip(i: int) -> str:
    """Where endpoint 2 of service i goes in the change: pod2's /16, above every service's."""
    return f"10.130.{250 + (i >> 14)}.{i & 255}" if i < 5 << 14 else f"10.130.255.{i & 255}"


def services(n: int, moved: int | None = None) -> list[kr.ServicePort]:
    """N NodePort services with a ClusterIP and 3 endpoints; ``moved``: that one's third moved."""
    if n > 60000:
        raise ValueError("at most 60,000 services (10.96.0.0/16 and the NodePort range)")
    out = []
    for i in range(n):
        eps = [kr.Endpoint(endpoint_ip(i, j), BACKEND_PORT, NODE) for j in range(PODS)]
        if i == moved:
            eps[2] = kr.Endpoint(moved_ip(i), BACKEND_PORT, NODE)
        out.append(kr.ServicePort("bench", f"svc-{i:05d}", "http", cluster_ip(i),
                                  SERVICE_PORT, node_port=FIRST_NODE_PORT + i,
                                  endpoints=tuple(eps)))
    return out


def node_config() -> kr.NodeConfig:
    """kube-proxy's defaults on this node: NodePorts on the node IP (nftables' default,
    ``primary``) for nftables, every local address for iptables, as each mode defaults."""
    return kr.NodeConfig(NODE, NODE_IP, pod_cidr=POD_CIDR, random_fully=True,
                         service_cidrs=("10.96.0.0/16",))


def kpx_state(svcs: Sequence[kr.ServicePort]) -> str:
    """The same services as Kubernetes YAML for ``kpx node --state``."""
    specs = [k8s_state.ServiceSpec(
        s.name, (k8s_state.Port("http", s.port, BACKEND_PORT, s.node_port),),
        tuple(k8s_state.Ep(e.ip, NODE) for e in s.endpoints), cluster_ip=s.cluster_ip)
        for s in svcs]
    return k8s_state.render([(NODE, NODE_IP)], specs)


def spread(n: int, count: int, seed: int) -> list[int]:
    """The services the latency probe dials, in order: one seeded RNG per N, whoever runs."""
    rng = random.Random(f"{seed}-{n}")
    return [rng.randrange(n) for _ in range(count)]


def summarize_ms(values: list[float]) -> dict[str, float]:
    return {"lat_p50_ms": percentile(values, 50), "lat_p90_ms": percentile(values, 90),
            "lat_p99_ms": percentile(values, 99)}


def read_meminfo(text: str) -> dict[str, int]:
    out = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        if key in MEM_KEYS:
            out[key] = int(rest.split()[0])
    return out


def kernel_kib() -> int:
    """Slab + VmallocUsed + Percpu now (kB): where nf_tables objects and xt blobs live."""
    return sum(read_meminfo(Path("/proc/meminfo").read_text()).values())


def generations(log: str) -> list[int]:
    return [int(m.group(2)) for m in GENERATION.finditer(log)]


def refusal(log: str) -> str | None:
    """kpx's own words when it did not put a state in force (the last such line)."""
    found = [m.group(0).split(": ", 1)[-1] for m in REFUSED.finditer(log)]
    return found[-1][:300] if found else None


def ipvs_unavailable() -> str | None:
    """Why IPVS cannot be a contender here (None when it can)."""
    if Path("/proc/net/ip_vs").exists():
        return None
    why = ["no /proc/net/ip_vs (the ip_vs module is not loaded)"]
    release = os.uname().release
    if not Path(f"/lib/modules/{release}").exists():
        why.append(f"no /lib/modules/{release} to load it from")
    if sh(["sh", "-c", "command -v modprobe"], check=False).returncode != 0:
        why.append("no modprobe")
    return "; ".join(why)


# ---- the topology ----------------------------------------------------------------------------


@dataclass
class ScaleNet:
    """client, node and three pods; ``create`` builds, ``destroy`` removes (never raises)."""

    prefix: str
    created: list[str] = field(default_factory=list)
    _threads: dict[str, NsThread] = field(default_factory=dict)

    def ns(self, role: str) -> str:
        return f"{self.prefix}{role}"

    @property
    def roles(self) -> list[str]:
        return ["client", NODE, *(f"pod{j}" for j in range(PODS))]

    def ip(self, role: str, *args: str) -> None:
        sh(["ip", "-n", self.ns(role), *args])

    def run(self, role: str, argv: Sequence[str], input_text: str | None = None,
            timeout: float = 300.0, check: bool = False) -> subprocess.CompletedProcess[str]:
        return sh(["ip", "netns", "exec", self.ns(role), *argv], check=check, timeout=timeout,
                  input_text=input_text)

    def sysctl(self, role: str, values: dict[str, str]) -> None:
        self.run(role, ["sysctl", "-q", "-w", *(f"{k}={v}" for k, v in values.items())],
                 check=True)

    def create(self) -> None:
        clash = [self.ns(r) for r in self.roles if self.ns(r) in set(list_namespaces())]
        if clash:
            raise CommandError(f"namespaces {clash} already exist (a crashed run?)")
        for r in self.roles:
            sh(["ip", "netns", "add", self.ns(r)])
            self.created.append(self.ns(r))
            self.ip(r, "link", "set", "lo", "up")
        self.ip("client", "link", "add", "eth0", "type", "veth", "peer", "name", "c0",
                "netns", self.ns(NODE))
        self.ip("client", "addr", "add", f"{CLIENT_IP}/24", "dev", "eth0")
        self.ip(NODE, "addr", "add", f"{NODE_IP}/24", "dev", "c0")
        self.ip("client", "link", "set", "eth0", "up")
        self.ip(NODE, "link", "set", "c0", "up")
        self.ip("client", "route", "add", "default", "via", NODE_IP)
        for j in range(PODS):
            pod, gw, addr = f"pod{j}", f"10.91.{10 + j}.1", f"10.91.{10 + j}.2"
            self.ip(NODE, "link", "add", f"p{j}", "type", "veth", "peer", "name", "eth0",
                    "netns", self.ns(pod))
            self.ip(NODE, "addr", "add", f"{gw}/24", "dev", f"p{j}")
            self.ip(pod, "addr", "add", f"{addr}/24", "dev", "eth0")
            self.ip(NODE, "link", "set", f"p{j}", "up")
            self.ip(pod, "link", "set", "eth0", "up")
            self.ip(pod, "route", "add", "default", "via", gw)
            # The whole /16 is this pod's: one backend answers every endpoint in it.
            self.ip(pod, "route", "add", "local", f"10.{128 + j}.0.0/16", "dev", "lo")
            self.ip(NODE, "route", "add", f"10.{128 + j}.0.0/16", "via", addr)
        self.sysctl(NODE, {"net.ipv4.ip_forward": "1", "net.ipv4.conf.all.rp_filter": "0",
                           "net.ipv4.conf.default.rp_filter": "0",
                           "net.ipv4.ip_local_port_range": "50000 65535",
                           "net.ipv4.tcp_tw_reuse": "1", "net.core.somaxconn": "8192",
                           "net.ipv4.conf.all.route_localnet": "1"})
        for r in ("client", *(f"pod{j}" for j in range(PODS))):
            self.sysctl(r, {"net.ipv4.ip_local_port_range": "1024 65535",
                            "net.core.somaxconn": "8192", "net.ipv4.tcp_tw_reuse": "1"})

    def thread(self, role: str) -> NsThread:
        """A harness thread inside ``role``'s namespace (made once, closed by ``destroy``)."""
        if role not in self._threads:
            self._threads[role] = NsThread(self.ns(role))
        return self._threads[role]

    def reset_node(self) -> None:
        """No kube-proxy rules of any backend left in the node (between contenders)."""
        empty = "*filter\nCOMMIT\n*nat\nCOMMIT\n"
        for tool in ("iptables-legacy-restore", "iptables-nft-restore"):
            self.run(NODE, [tool], empty)
        self.run(NODE, ["nft", "flush", "ruleset"])
        self.run(NODE, ["conntrack", "-F"])

    def destroy(self) -> list[str]:
        problems = []
        for t in self._threads.values():
            t.close()
        self._threads.clear()
        for name in reversed(self.created):
            cp = sh(["ip", "netns", "del", name], check=False)
            if cp.returncode != 0 and name in list_namespaces():
                problems.append(f"ip netns del {name}: {cp.stderr.strip()}")
        self.created.clear()
        return problems


# ---- contenders --------------------------------------------------------------------------


class OverBudget(RuntimeError):
    """A programming step ran past the budget: larger N are not tried for that contender."""


class Contender:
    """Programs a node for N services; the figures are taken from outside by ``ScaleBench``."""

    name = ""
    description = ""

    def __init__(self, net: ScaleNet, log_dir: Path) -> None:
        self.net, self.log_dir = net, log_dir

    def unavailable(self) -> str | None:
        return None

    def program(self, svcs: list[kr.ServicePort]) -> float:
        """Seconds to put all services in force from an empty node; raises RuntimeError."""
        raise NotImplementedError

    def change(self, old: list[kr.ServicePort], new: list[kr.ServicePort]) -> float:
        """Seconds to put in force the last service's moved endpoint."""
        raise NotImplementedError

    def pids(self) -> list[int]:
        return []

    def stop(self) -> None:
        self.net.reset_node()

    budget = 900.0
    """Seconds one programming step may take before it is stopped (``ScaleConfig.budget``)."""

    def _timed(self, argv: list[str], text: str) -> float:
        t0 = time.monotonic()
        try:
            cp = self.net.run(NODE, argv, text, timeout=self.budget)
        except CommandError as e:
            raise OverBudget(f"{argv[0]} took longer than {self.budget:.0f}s") from e
        took = time.monotonic() - t0
        if cp.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} -> rc {cp.returncode}: "
                               f"{cp.stderr.strip()[:300]}")
        return took


class IptablesMode(Contender):
    """kube-proxy's iptables mode: its jump rules once, then one restore per sync."""

    def __init__(self, net: ScaleNet, log_dir: Path, backend: str) -> None:
        super().__init__(net, log_dir)
        self.backend = backend
        self.name = f"iptables-{backend}"
        self.description = (f"kube-proxy iptables mode rules, iptables-{backend}-restore "
                            f"--noflush (iptables {backend} backend)")
        self.tool = f"iptables-{backend}-restore"

    def unavailable(self) -> str | None:
        if sh(["sh", "-c", f"command -v {self.tool}"], check=False).returncode != 0:
            return f"{self.tool} is not installed (apt-get install iptables)"
        probe = self.net.run(NODE, [self.tool, "--noflush"], kr.iptables_jumps())
        self.net.reset_node()
        if probe.returncode != 0:
            return f"{self.tool} fails in a namespace: {probe.stderr.strip()[:200]}"
        return None

    def program(self, svcs: list[kr.ServicePort]) -> float:
        self._timed([self.tool, "--noflush"], kr.iptables_jumps())
        return self._timed([self.tool, "--noflush"], kr.iptables_restore(svcs, node_config()))

    def change(self, old: list[kr.ServicePort], new: list[kr.ServicePort]) -> float:
        text = kr.iptables_restore(new, node_config(), changed=frozenset({new[-1].name_string}))
        return self._timed([self.tool, "--noflush"], text)


class NftablesMode(Contender):
    name = "nftables"
    description = "kube-proxy nftables mode ruleset (table ip kube-proxy), nft -f"

    def unavailable(self) -> str | None:
        if sh(["sh", "-c", "command -v nft"], check=False).returncode != 0:
            return "nft is not installed (apt-get install nftables)"
        return None

    def program(self, svcs: list[kr.ServicePort]) -> float:
        cfg = replace(node_config(), nodeport_addresses=(NODE_IP,))
        return self._timed(["nft", "-f", "-"], kr.nft_full(svcs, cfg))

    def change(self, old: list[kr.ServicePort], new: list[kr.ServicePort]) -> float:
        cfg = replace(node_config(), nodeport_addresses=(NODE_IP,))
        return self._timed(["nft", "-f", "-"], kr.nft_partial(old[-1], new[-1], cfg))


class Ipvs(Contender):
    name = "ipvs"
    description = "kube-proxy IPVS mode (needs the ip_vs kernel module)"

    def unavailable(self) -> str | None:
        why = ipvs_unavailable()
        return f"not available: {why}" if why else \
            "ip_vs is present, but the IPVS layout is not written yet"


class Kpx(Contender):
    """``kpx node`` fed the same services as Kubernetes YAML; timed from its own log."""

    name = "kpx"
    description = "kpx node (userspace relay, the default proxy mode)"
    extra: tuple[str, ...] = ()

    def __init__(self, net: ScaleNet, log_dir: Path, kpx: str, timeout: float) -> None:
        super().__init__(net, log_dir)
        self.kpx, self.timeout = kpx, timeout
        self.state = log_dir / f"state-{self.name}.yaml"
        self.proc: Proc | None = None

    def unavailable(self) -> str | None:
        cp = sh([self.kpx, "node", "--help"], check=False, timeout=60)
        if cp.returncode != 0:
            return f"`kpx node --help` failed rc={cp.returncode}"
        if self.extra and self.extra[-1] not in cp.stdout:
            return f"`kpx node --help` shows no {' '.join(self.extra)}"
        return None

    def _log(self) -> str:
        return self.proc.log_path.read_text(errors="replace") if self.proc else ""

    def _wait_generation(self, after: int, t0: float) -> float:
        """Seconds from ``t0`` until kpx logs a generation newer than ``after`` in force."""
        deadline = t0 + min(self.timeout, self.budget)
        while time.monotonic() < deadline:
            log = self._log()
            gens = generations(log)
            if gens and gens[-1] > after:
                return time.monotonic() - t0
            if self.proc is not None and not self.proc.alive():
                raise RuntimeError(f"kpx exited rc={self.proc.returncode()}: {self.proc.why()}")
            why = refusal(log[-20000:])
            if why and time.monotonic() - t0 > 1.0:
                raise RuntimeError(f"kpx logged: {why}")
            time.sleep(0.005)
        why = refusal(self._log())
        if why:
            raise RuntimeError(f"kpx logged: {why}")
        raise OverBudget(f"no newer generation in force within "
                         f"{min(self.timeout, self.budget):.0f}s")

    def program(self, svcs: list[kr.ServicePort]) -> float:
        """Started on the first service alone; then the rename of the full state is timed."""
        write_atomic(self.state, kpx_state(svcs[:1]))
        argv = [self.kpx, "node", "--hostname-override", NODE, "--state", str(self.state),
                "--no-healthz", *self.extra]
        self.proc = Proc(f"{self.name}-{len(svcs)}", ["ip", "netns", "exec", self.net.ns(NODE),
                                                       *argv],
                         self.log_dir, nofile=nofile_hard_limit()).start()
        self._wait_generation(0, time.monotonic())
        last = generations(self._log())[-1]
        text = kpx_state(svcs).encode()
        t0 = time.monotonic()
        write_atomic(self.state, text)
        return self._wait_generation(last, t0)

    def change(self, old: list[kr.ServicePort], new: list[kr.ServicePort]) -> float:
        """Until the first fresh connection answers from the moved endpoint.

        In the userspace mode an endpoint change is only new plans in memory:
        kpx logs nothing when they are in force (its "service VIPs in force"
        line comes when VIPs change), so, as the control workload's
        convergence does, connections are made from the client (a harness
        thread in its namespace, about 0.2 ms each) until one reaches it.
        """
        text = kpx_state(new).encode()
        svc = new[-1]
        want = svc.endpoints[2].ip
        reached = self.net.thread("client")
        t0 = time.monotonic()
        write_atomic(self.state, text)
        deadline = t0 + self.timeout
        while time.monotonic() < deadline:
            try:
                got = reached.call(answered_by, svc.cluster_ip, SERVICE_PORT, 1.0)
            except OSError as e:
                raise RuntimeError(f"a connection failed while the endpoint moved: {e}") from e
            if got == want:
                return time.monotonic() - t0
            if self.proc is not None and not self.proc.alive():
                raise RuntimeError(f"kpx exited rc={self.proc.returncode()}: {self.proc.why()}")
        raise RuntimeError(f"{svc.cluster_ip} never answered from {want} within "
                           f"{self.timeout:.0f}s")

    def pids(self) -> list[int]:
        return process_tree(self.proc.pid) if self.proc and self.proc.alive() else []

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()
        super().stop()


class KpxNfqueue(Kpx):
    name = "kpx-nfq"
    description = "kpx node --proxy-mode nfqueue (SYN decided in Python, conntrack forwards)"
    extra = ("--proxy-mode", "nfqueue")

    def change(self, old: list[kr.ServicePort], new: list[kr.ServicePort]) -> float:
        """Until kpx logs the new generation's nft table in force (it logs every sync)."""
        last = generations(self._log())[-1]
        text = kpx_state(new).encode()
        t0 = time.monotonic()
        write_atomic(self.state, text)
        return self._wait_generation(last, t0)


# ---- the run -------------------------------------------------------------------------------


@dataclass
class ScaleConfig:
    sizes: tuple[int, ...] = SIZES
    contenders: tuple[str, ...] = CONTENDERS
    connections: int = 2000
    rate_seconds: float = 3.0
    seed: int = 16
    quick: bool = False
    out: Path = Path("bench/results")
    kpx: str = "kpx"
    kpx_timeout: float = 120.0
    budget: float = 900.0
    """Seconds one programming step may take; past it the contender skips larger N."""
    keep_logs: bool = False


def machine() -> dict[str, Any]:
    def ver(argv: list[str]) -> str | None:
        cp = sh(argv, check=False)
        return (cp.stdout or cp.stderr).strip().splitlines()[0] if cp.returncode == 0 else None

    return {"kernel": os.uname().release, "nproc": os.cpu_count(),
            "iptables": ver(["iptables", "--version"]), "nft": ver(["nft", "--version"]),
            "loadavg_start": Path("/proc/loadavg").read_text().split()[:3],
            "rlimit_nofile_hard": nofile_hard_limit()}


class ScaleBench:
    def __init__(self, cfg: ScaleConfig, stream: TextIO | None = None) -> None:
        self.cfg = cfg
        self.out = stream or sys.stdout
        self.table = CellTable()
        self.notes: list[str] = []
        self.started = dt.datetime.now(dt.UTC)
        self.stamp = self.started.strftime("%Y%m%d-%H%M%S")
        self.net = ScaleNet(prefix=f"ks{os.getpid() % 1000}-")
        self.log_dir = Path(tempfile.mkdtemp(prefix=f"kpx-scale-{self.stamp}-"))
        self.availability: dict[str, dict[str, Any]] = {}
        self.result_path = cfg.out / f"{self.stamp}-scale.json"
        self.machine = machine()

    def make(self, name: str) -> Contender:
        if name.startswith("iptables-"):
            return IptablesMode(self.net, self.log_dir, name.split("-", 1)[1])
        if name == "nftables":
            return NftablesMode(self.net, self.log_dir)
        if name == "ipvs":
            return Ipvs(self.net, self.log_dir)
        cls = KpxNfqueue if name == "kpx-nfq" else Kpx
        return cls(self.net, self.log_dir, self.cfg.kpx, self.cfg.kpx_timeout)

    def contender(self, name: str) -> Contender:
        c = self.make(name)
        c.budget = self.cfg.budget
        return c

    def client(self, job: dict[str, Any], timeout: float) -> dict[str, Any]:
        cp = self.net.run("client", [sys.executable, "-m", "bench.scaleprobe", "client"],
                          json.dumps(job), timeout=timeout)
        if cp.returncode != 0:
            raise RuntimeError(f"client probe rc={cp.returncode}: {cp.stderr.strip()[-300:]}")
        return dict(json.loads(cp.stdout))

    def point(self, c: Contender, n: int) -> Run:
        """Every figure of one contender at N services, or the first reason there is none."""
        svcs = services(n)
        moved = services(n, moved=n - 1)
        detail: dict[str, Any] = {"services": n, "endpoints": 3 * n}
        mem0 = kernel_kib()
        try:
            program_s = c.program(svcs)
        except OverBudget:
            raise
        except RuntimeError as e:
            return Run.failed(f"program: {e}", **detail)
        mem1 = kernel_kib()
        rng = random.Random(f"{self.cfg.seed}-check-{n}")
        picks = sorted({0, n - 1, *(rng.randrange(n) for _ in range(CHECKED))})
        check = [{"ip": s.cluster_ip, "endpoints": [e.ip for e in s.endpoints]}
                 for s in (svcs[i] for i in picks)]
        targets = [svcs[i].cluster_ip for i in spread(n, self.cfg.connections, self.cfg.seed)]
        got = self.client({"port": SERVICE_PORT, "check": check, "latency": targets,
                           "deadline": 240.0,
                           "rate": {"ip": svcs[-1].cluster_ip, "seconds": self.cfg.rate_seconds,
                                    "max": 500000}}, timeout=300.0)
        if got["check"]:
            return Run.failed(f"{len(got['check'])} of {len(check)} checked services answered "
                              f"wrong (first: {got['check'][0]})", **detail)
        lat = got["latency"]
        if lat["error_count"] or not lat["ms"]:
            return Run.failed(f"{lat['error_count']} of {len(targets)} connections failed "
                              f"(first: {(lat['errors'] or ['none'])[0]})", **detail)
        rate = got["rate"]
        if rate["errors"]:
            return Run.failed(f"rate: {rate['errors']} connections failed (first: "
                              f"{rate['first_error']})", **detail)
        rss = rss_bytes(c.pids())
        try:
            change_s = c.change(svcs, moved)
        except RuntimeError as e:
            return Run.failed(f"change: {e}", **detail)
        want = moved[-1].endpoints[2].ip
        seen = self.client({"port": SERVICE_PORT, "check": [
            {"ip": moved[-1].cluster_ip, "endpoints": [e.ip for e in moved[-1].endpoints]}
            for _ in range(30)]}, timeout=60.0)["check"]
        if seen:
            return Run.failed(f"after the change: {seen[0]}", **detail)
        metrics = {**summarize_ms(lat["ms"]),
                   "cps": rate["count"] / max(rate["seconds"], 1e-9),
                   "program_s": program_s, "change_s": change_s,
                   "kernel_mem_mib": (mem1 - mem0) / 1024.0}
        if rss:
            metrics["rss_mib"] = rss / (1 << 20)
        detail.update(connections=len(lat["ms"]), checked=len(check), moved_to=want,
                      rate_connections=rate["count"], kernel_kib_before=mem0,
                      kernel_kib_after=mem1,
                      kernel_mem_note="Slab+VmallocUsed+Percpu growth, machine-wide")
        return Run(ok=True, metrics=metrics, detail=detail)

    def run(self) -> int:
        cfg = self.cfg
        t_start = time.monotonic()
        aborted = None
        self.out.write(f"kpx bench --scale: {','.join(map(str, cfg.sizes))} services x 3 "
                       f"endpoints, {cfg.connections} connections per point; namespaces "
                       f"{self.net.prefix}*, logs {self.log_dir}\n")
        backends: list[Proc] = []
        try:
            self.net.create()
            for j in range(PODS):
                backends.append(Proc(f"backend{j}", ["ip", "netns", "exec",
                                                     self.net.ns(f"pod{j}"), sys.executable,
                                                     "-m", "bench.scaleprobe", "backend",
                                                     str(BACKEND_PORT)],
                                     self.log_dir).start())
            if not poll(lambda: all("listening" in b.tail() for b in backends), 10.0):
                raise RuntimeError("backends did not start: "
                                   + "; ".join(b.why() for b in backends))
            contenders = [self.contender(n) for n in cfg.contenders]
            for c in contenders:
                why = c.unavailable()
                self.availability[c.name] = {"available": why is None, "reason": why,
                                             "description": c.description}
                if why:
                    self.out.write(f"{c.name}: {why}\n")
                    for n in cfg.sizes:
                        self.table.mark(None, f"scale-{n}", c.name, "unavailable", why)
            over: dict[str, str] = {}
            for n in cfg.sizes:
                for c in contenders:
                    if not self.availability[c.name]["available"]:
                        continue
                    if c.name in over:
                        self.table.mark(None, f"scale-{n}", c.name, "skipped", over[c.name])
                        self.out.write(f"{n:>6} {c.name:<16} SKIPPED: {over[c.name]}\n")
                        continue
                    t0 = time.monotonic()
                    try:
                        run = self.point(c, n)
                    except OverBudget as e:
                        why = (f"programming {n:,} services: {e} (the budget per step"
                               f"{', --quick' if cfg.quick else ''})")
                        run = Run.failed(why, services=n)
                        over[c.name] = f"not tried: {why}"
                    finally:
                        c.stop()
                    run.detail["wall_s"] = round(time.monotonic() - t0, 2)
                    self.table.cell(None, f"scale-{n}", c.name).add(run)
                    self.out.write(line(n, c.name, run) + "\n")
                    self.out.flush()
                    self.save(False)
        except KeyboardInterrupt:
            aborted = "interrupted (Ctrl-C / SIGTERM): results are partial"
        except Exception as e:
            aborted = f"aborted: {type(e).__name__}: {e}"
        finally:
            for b in backends:
                b.stop()
            problems = self.net.destroy()
            if problems:
                self.notes.append("cleanup problems: " + "; ".join(problems))
        if aborted:
            self.notes.append(aborted)
        self.notes.append(f"wall time {time.monotonic() - t_start:.0f}s")
        chart, why = latency_chart(self.table, cfg.sizes, cfg.out / f"{self.stamp}-scale.png")
        if why:
            self.notes.append(why)
        self.chart = chart
        self.save(aborted is None)
        self.out.write("\n" + summary(self.table, cfg.sizes) + "\n")
        for note in self.notes:
            self.out.write(f"note: {note}\n")
        self.out.write(f"results: {self.result_path}\n")
        if chart:
            self.out.write(f"chart:   {chart}\n")
        failed = any(c.status == "failed" for c in self.table)
        if not failed and not cfg.keep_logs:
            shutil.rmtree(self.log_dir, ignore_errors=True)
        return 1 if aborted else 0

    chart: str | None = None

    def save(self, complete: bool) -> None:
        self.cfg.out.mkdir(parents=True, exist_ok=True)
        meta = {"started": self.started.isoformat(timespec="seconds"),
                "finished": dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
                if complete else None,
                "argv": sys.argv, "kind": "scale",
                "config": {**{k: (str(v) if isinstance(v, Path) else v)
                              for k, v in self.cfg.__dict__.items()}},
                "machine": self.machine, "sysctls": {},
                "topology": {"namespaces": [self.net.ns(r) for r in self.net.roles],
                             "layout": __doc__.split("Layout::", 1)[1].split("Service i", 1)[0]
                             .strip() if __doc__ else ""},
                "contenders": self.availability, "notes": self.notes,
                "charts": [self.chart] if self.chart else [], "logs": str(self.log_dir)}
        doc = document(self.table, meta=meta, complete=complete)
        doc["ratios"], doc["targets"] = [], []  # issue 5's ratios and targets are not asked here
        write(self.result_path, doc)


# ---- output --------------------------------------------------------------------------------

COLUMNS = (("lat_p50_ms", "p50 ms", 3), ("lat_p90_ms", "p90 ms", 3), ("lat_p99_ms", "p99 ms", 3),
           ("cps", "conn/s", 0), ("program_s", "program s", 3), ("change_s", "change s", 3),
           ("kernel_mem_mib", "kernel MiB", 1), ("rss_mib", "RSS MiB", 1))


def line(n: int, name: str, run: Run) -> str:
    if not run.ok:
        return f"{n:>6} {name:<16} FAILED: {run.error}"
    parts = [f"{label} {run.metrics[k]:.{d}f}" for k, label, d in COLUMNS if k in run.metrics]
    return f"{n:>6} {name:<16} " + "  ".join(parts)


def summary(table: CellTable, sizes: Sequence[int]) -> str:
    """One row per contender and N: every figure, or the status and why."""
    header = ["services", "contender", *(label for _, label, _ in COLUMNS)]
    rows = []
    for n in sizes:
        for c in sorted((c for c in table if c.workload == f"scale-{n}"),
                        key=lambda c: CONTENDERS.index(c.contender)
                        if c.contender in CONTENDERS else 99):
            if c.status != "ok":
                rows.append([f"{n:,}", c.contender, f"{c.status.upper()}: {c.reason or ''}"[:100]])
                continue
            rows.append([f"{n:,}", c.contender, *(
                f"{c.median(k):,.{d}f}" if c.median(k) is not None else "-"
                for k, _, d in COLUMNS)])
    full = [header, *(r for r in rows if len(r) == len(header))]
    widths = [max(len(r[i]) for r in full) for i in range(len(header))]
    out = ["  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True))]
    for r in rows:
        if len(r) == len(header):
            out.append("  ".join(x.ljust(w) for x, w in zip(r, widths, strict=True)).rstrip())
        else:
            out.append("  ".join(r))
    return "\n".join(out)


def latency_chart(table: CellTable, sizes: Sequence[int], path: Path,
                  ) -> tuple[str | None, str | None]:
    """Latency against service count: a colour per contender, p50 solid, p99 dashed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None, "matplotlib is not installed (pip install '.[bench]'): chart skipped"
    fig, ax = plt.subplots(figsize=(8, 5))
    names = [n for n in CONTENDERS if any(c.contender == n for c in table)]
    drawn = False
    for i, name in enumerate(names):
        for metric, style, label in (("lat_p50_ms", "-", "p50"), ("lat_p99_ms", "--", "p99")):
            xs, ys = [], []
            for n in sizes:
                cell = table.get(None, f"scale-{n}", name)
                v = cell.median(metric) if cell is not None else None
                if v is not None:
                    xs.append(n)
                    ys.append(v)
            if xs:
                ax.plot(xs, ys, style, marker="o", color=f"C{i}", label=f"{name} {label}")
                drawn = True
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xticks(list(sizes))
    ax.set_xticklabels([f"{n:,}" for n in sizes])
    ax.set_xlabel("services (3 endpoints each)")
    ax.set_ylabel("connect() time to a random ClusterIP, ms")
    ax.set_title("first-packet latency against service count (p50 solid, p99 dashed)")
    ax.grid(alpha=0.3, which="both")
    if drawn:
        ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return str(path), None


def run_cli(quick: bool, out: Path, kpx: str, sizes: list[int] | None,
            contenders: list[str] | None, connections: int | None,
            keep_logs: bool, on_start: Callable[[], None] | None = None) -> int:
    """``kpx bench --scale`` with the flags already parsed (``bench.cli``)."""
    cfg = ScaleConfig(sizes=tuple(sizes or SIZES),
                      contenders=tuple(contenders or CONTENDERS),
                      connections=connections or (300 if quick else 2000),
                      rate_seconds=1.0 if quick else 3.0, quick=quick, out=out, kpx=kpx,
                      kpx_timeout=45.0 if quick else 120.0, budget=30.0 if quick else 900.0,
                      keep_logs=keep_logs)
    if on_start:
        on_start()
    return ScaleBench(cfg).run()
