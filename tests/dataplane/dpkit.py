"""Helpers for the dataplane tests: state YAML, namespaces, drivers, probes.

Namespaces are named ``kd<pid%1000>-*``; every link is created inside them
(``ip -n``), never in the initial namespace, and ``Topology.destroy`` removes
them all. Sockets "inside" a namespace are created by a short-lived thread
that ``setns``-es itself, so the test process never changes namespace.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
PY = sys.executable
CLONE_NEWNET = 0x40000000

# -- state YAML ------------------------------------------------------------------


def node(name: str, *ips: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1", "kind": "Node", "metadata": {"name": name},
        "status": {"addresses": [{"type": "InternalIP", "address": ip} for ip in ips]},
    }


def service(
    name: str, node_port: int, target_port: int, *, etp: str = "Cluster",
    affinity_seconds: int | None = None, namespace: str = "default",
) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "type": "NodePort", "clusterIP": "10.96.0.10", "externalTrafficPolicy": etp,
        "ports": [{"port": 80, "protocol": "TCP", "targetPort": target_port,
                   "nodePort": node_port}],
        "sessionAffinity": "None",
    }
    if affinity_seconds is not None:
        spec["sessionAffinity"] = "ClientIP"
        spec["sessionAffinityConfig"] = {"clientIP": {"timeoutSeconds": affinity_seconds}}
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": {"name": name, "namespace": namespace}, "spec": spec}


def endpoint_slice(
    svc: str, port: int, endpoints: list[tuple[str, str]], *, namespace: str = "default",
    name: str | None = None, terminating: bool = False, ready: bool = True,
) -> dict[str, Any]:
    """``endpoints`` is a list of (ip, nodeName)."""
    if terminating:
        conditions = {"ready": False, "serving": True, "terminating": True}
    elif not ready:
        conditions = {"ready": False, "serving": False, "terminating": False}
    else:
        conditions = {"ready": True}
    return {
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": name or f"{svc}-abc", "namespace": namespace,
                     "labels": {"kubernetes.io/service-name": svc}},
        "addressType": "IPv4",
        "ports": [{"name": "", "port": port, "protocol": "TCP"}],
        "endpoints": [
            {"addresses": [ip], "nodeName": n, "conditions": conditions,
             "targetRef": {"kind": "Pod", "name": f"pod-{ip}"}}
            for ip, n in endpoints
        ],
    }


def state_yaml(*objs: dict[str, Any]) -> str:
    return yaml.safe_dump_all(objs, sort_keys=False)


def write_state(path: Path, *objs: dict[str, Any]) -> None:
    """Atomic replace, as kubelet and editors do."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(state_yaml(*objs))
    tmp.rename(path)


# -- waiting ---------------------------------------------------------------------


def wait_for(pred, timeout: float = 5.0, interval: float = 0.02, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


# -- namespaces --------------------------------------------------------------------


def sh(*argv: str, check: bool = True, timeout: float = 10) -> subprocess.CompletedProcess[str]:
    res = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    if check and res.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {res.stderr.strip()}")
    return res


def prefix() -> str:
    return f"kd{os.getpid() % 1000}-"


_libc = ctypes.CDLL(None, use_errno=True)


def in_netns(ns: str, fn, *args):
    """Run ``fn(*args)`` in a thread that has joined namespace ``ns``."""
    out: dict[str, Any] = {}

    def work() -> None:
        try:
            fd = os.open(f"/run/netns/{ns}", os.O_RDONLY)
            try:
                if _libc.setns(fd, CLONE_NEWNET) != 0:
                    raise OSError(ctypes.get_errno(), "setns")
            finally:
                os.close(fd)
            out["v"] = fn(*args)
        except BaseException as exc:  # handed to the caller
            out["e"] = exc

    t = threading.Thread(target=work)
    t.start()
    t.join()
    if "e" in out:
        raise out["e"]
    return out["v"]


def socket_in(ns: str) -> socket.socket:
    return in_netns(ns, socket.socket, socket.AF_INET, socket.SOCK_STREAM)


def connect_in(ns: str, addr: tuple[str, int], timeout: float = 2.0) -> socket.socket:
    s = socket_in(ns)
    s.settimeout(timeout)
    try:
        s.connect(addr)
    except BaseException:
        s.close()
        raise
    return s


class Topology:
    """client -- node -- {pod1, pod2}; the node routes between them.

    client 10.77.1.2/24 (default via the node), node 10.77.1.1 / 10.77.2.1 /
    10.77.3.1, pod1 10.77.2.2/24 and pod2 10.77.3.2/24 (default via the node).
    """

    CLIENT_IP = "10.77.1.2"
    NODE_IP = "10.77.1.1"
    POD1_IP = "10.77.2.2"
    POD2_IP = "10.77.3.2"
    NODE_POD2_IP = "10.77.3.1"

    def __init__(self) -> None:
        p = prefix()
        self.client, self.node, self.pod1, self.pod2 = (p + "c", p + "n", p + "p1", p + "p2")
        self.all = [self.client, self.node, self.pod1, self.pod2]
        self.procs: list[subprocess.Popen[str]] = []

    def create(self) -> Topology:
        self.destroy()  # a leftover of a crashed run with the same pid
        try:
            for ns in self.all:
                sh("ip", "netns", "add", ns)
                sh("ip", "-n", ns, "link", "set", "lo", "up")
            self._veth(self.node, "c0", self.client, "10.77.1.1/24", "10.77.1.2/24")
            self._veth(self.node, "p1", self.pod1, "10.77.2.1/24", "10.77.2.2/24")
            self._veth(self.node, "p2", self.pod2, "10.77.3.1/24", "10.77.3.2/24")
            sh("ip", "-n", self.client, "route", "add", "default", "via", "10.77.1.1")
            sh("ip", "-n", self.pod1, "route", "add", "default", "via", "10.77.2.1")
            sh("ip", "-n", self.pod2, "route", "add", "default", "via", "10.77.3.1")
            sh("ip", "netns", "exec", self.node, "sysctl", "-qw", "net.ipv4.ip_forward=1")
        except BaseException:
            self.destroy()
            raise
        return self

    def _veth(self, ns_a: str, name_a: str, ns_b: str, ip_a: str, ip_b: str) -> None:
        # Both ends are born inside the namespaces: nothing touches the root one.
        sh("ip", "-n", ns_a, "link", "add", name_a, "type", "veth",
           "peer", "name", "eth0", "netns", ns_b)
        sh("ip", "-n", ns_a, "addr", "add", ip_a, "dev", name_a)
        sh("ip", "-n", ns_b, "addr", "add", ip_b, "dev", "eth0")
        sh("ip", "-n", ns_a, "link", "set", name_a, "up")
        sh("ip", "-n", ns_b, "link", "set", "eth0", "up")

    def popen(self, ns: str, *argv: str, **kw: Any) -> subprocess.Popen[str]:
        p = subprocess.Popen(
            ["ip", "netns", "exec", ns, *argv], cwd=REPO, text=True, **kw
        )
        self.procs.append(p)
        return p

    def backend(self, ns: str, name: str, port: int = 8080) -> subprocess.Popen[str]:
        p = self.popen(ns, PY, str(HERE / "dp_backend.py"), "--port", str(port),
                       "--name", name, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        assert p.stdout is not None
        assert p.stdout.readline().strip() == "READY"
        return p

    def destroy(self) -> None:
        for p in self.procs:
            stop_process(p)
        self.procs.clear()
        for ns in self.all:
            if Path(f"/run/netns/{ns}").exists():
                sh("ip", "netns", "del", ns, check=False)


def stop_process(p: subprocess.Popen[Any], sig: int = signal.SIGTERM, timeout: float = 5) -> int:
    """Stop a child we started (by its own pid) and reap it."""
    if p.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            p.send_signal(sig)
        try:
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(5)
    return p.returncode


# -- the driver --------------------------------------------------------------------


class Driver:
    """A Dataplane in its own process (``dp_driver.py``), optionally in a namespace."""

    def __init__(self, workdir: Path, node_name: str, *args: str,
                 netns: str | None = None, stdin: bool = False,
                 env: dict[str, str] | None = None) -> None:
        self.state = workdir / "state.yaml"
        self.status_path = workdir / "status.json"
        self.log_path = workdir / "driver.log"
        self.node_name = node_name
        self.args = list(args)
        self.netns = netns
        self.stdin = stdin
        self.env = env
        self.proc: subprocess.Popen[str] | None = None
        self.generation = 0

    def start(self, *objs: dict[str, Any]) -> Driver:
        write_state(self.state, *objs)
        self.status_path.unlink(missing_ok=True)
        argv = [PY, str(HERE / "dp_driver.py"), "--node", self.node_name,
                "--state", str(self.state), "--status", str(self.status_path), *self.args]
        if self.netns:
            argv = ["ip", "netns", "exec", self.netns, *argv]
        self._log = open(self.log_path, "a")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            argv, cwd=REPO, text=True, stdout=self._log, stderr=self._log,
            stdin=subprocess.PIPE if self.stdin else subprocess.DEVNULL, env=self.env,
        )
        self.generation = 1
        self.wait_generation(1)
        return self

    def status(self) -> dict[str, Any]:
        try:
            return json.loads(self.status_path.read_text())
        except (OSError, ValueError):
            return {}

    def wait_generation(self, gen: int, timeout: float = 10.0) -> dict[str, Any]:
        def ready() -> dict[str, Any] | None:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise AssertionError(f"driver exited {self.proc.returncode}:\n{self.logs()}")
            st = self.status()
            return st if st.get("generation", 0) >= gen else None
        return wait_for(ready, timeout, what=f"driver generation {gen}")

    def update(self, *objs: dict[str, Any]) -> dict[str, Any]:
        write_state(self.state, *objs)
        self.generation += 1
        return self.wait_generation(self.generation)

    def listeners(self) -> list[tuple[str, int, str]]:
        return [tuple(x) for x in self.status().get("listeners", [])]  # type: ignore[misc]

    def send(self, line: str) -> None:
        assert self.proc is not None and self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def logs(self) -> str:
        try:
            return self.log_path.read_text()
        except OSError:
            return ""

    def stop(self, sig: int = signal.SIGTERM) -> int:
        rc = stop_process(self.proc, sig) if self.proc is not None else 0
        if getattr(self, "_log", None) is not None:
            self._log.close()
            self._log = None
        return rc


# -- observing the kernel ----------------------------------------------------------


def ss_listening(port: int, netns: str | None = None) -> list[str]:
    argv = ["ss", "-ltnH", f"sport = :{port}"]
    if netns:
        argv = ["ip", "netns", "exec", netns, *argv]
    return [ln for ln in sh(*argv).stdout.splitlines() if ln.strip()]


def syn_probe(netns: str, *targets: tuple[str, int], timeout: float = 1.0) -> list[str]:
    """Send one pure SYN per target with scapy from ``netns``: synack, rst or none."""
    res = sh("ip", "netns", "exec", netns, PY, str(HERE / "dp_probe.py"), str(timeout),
             *(f"{d}:{p}" for d, p in targets), timeout=60)
    return res.stdout.split()


def ss_drops(port: int, netns: str) -> int:
    """The listener's socket drop counter (``d`` in ``ss -m``): SYNs the filter ate."""
    out = sh("ip", "netns", "exec", netns, "ss", "-ltnmH", f"sport = :{port}").stdout
    return sum(int(d) for d in re.findall(r"\bd(\d+)\)", out))  # every address


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


@contextlib.contextmanager
def topology() -> Iterator[Topology]:
    topo = Topology().create()
    try:
        yield topo
    finally:
        topo.destroy()
