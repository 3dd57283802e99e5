"""Network namespaces for the dataplane tests: a small topology, sockets inside it.

Namespaces are named ``kd<pid%1000>-*``; every link is created inside them
(``ip -n``), never in the initial namespace, and ``Topology.destroy`` removes
them all. Sockets "inside" a namespace are created by a short-lived thread
that ``setns``-es itself, so the test process never changes namespace.

Owns: ``sh``, ``prefix``, ``in_netns``, ``fresh_netns``, ``in_fresh_netns``,
``socket_in``, ``connect_in``, ``Topology``/``topology()`` (client -- node --
{pod1, pod2}),
``stop_process``, the per-process readings ``cpu_seconds``/``rss_bytes``
and ``free_port`` (a port nobody listens on, in this namespace).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent.parent
PY = sys.executable
CLONE_NEWNET = 0x40000000


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


@contextlib.contextmanager
def fresh_netns(tag: str) -> Iterator[str]:
    """A new namespace (``prefix()`` and ``tag``) with ``lo`` up, removed after, pass or fail."""
    ns = f"{prefix()}{tag}"
    subprocess.run(["ip", "netns", "add", ns], check=True, capture_output=True)
    try:
        subprocess.run(["ip", "-n", ns, "link", "set", "lo", "up"], check=True)
        yield ns
    finally:
        subprocess.run(["ip", "netns", "del", ns], check=False, capture_output=True)


def in_fresh_netns(tag: str, fn, *args):
    """Run ``fn(*args)`` (``in_netns``) in a new namespace with ``lo`` up, removed after."""
    with fresh_netns(tag) as ns:
        return in_netns(ns, fn, *args)


def socket_in(ns: str, family: int = socket.AF_INET) -> socket.socket:
    return in_netns(ns, socket.socket, family, socket.SOCK_STREAM)


def connect_in(ns: str, addr: tuple[str, int], timeout: float = 2.0) -> socket.socket:
    """A TCP connection from namespace ``ns``, of the family ``addr`` is in."""
    s = socket_in(ns, socket.AF_INET6 if ":" in addr[0] else socket.AF_INET)
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
        """A ``tests.support.backends`` server in ``ns``, started as a script."""
        p = self.popen(ns, PY, "-m", "tests.support.backends", "--port", str(port),
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


@contextlib.contextmanager
def topology() -> Iterator[Topology]:
    topo = Topology().create()
    try:
        yield topo
    finally:
        topo.destroy()


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


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def free_port(addr: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now (the kernel's pick)."""
    with socket.socket() as s:
        s.bind((addr, 0))
        return int(s.getsockname()[1])
