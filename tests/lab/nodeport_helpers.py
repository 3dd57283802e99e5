"""Helpers for the NodePort lab tests (tests/lab/test_nodeport.py).

Owns: lab-file builders, the probes those tests observe the dataplane with
(plain connects classified as ok/refused/timeout, a scapy SYN probe run
inside the client namespace, ``ss`` listener listings) and the two kinds of
waiting they need: "every proxy has applied the state file" (its log shows a
newer generation) and "behaviour changed" (poll a probe, report how long
after the state file was written the change was first seen).

Never: sleep and hope. Every wait is a poll with a deadline; a deadline that
passes is a failure with the evidence (the proxies' logs) attached.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from lab import Lab

CLIENT_IP = "10.79.0.100"
"""The external client (lab.topology.CLIENT_IP); asserted literally, as the issue states it."""
POD_PORT = 8080
GENERATION_RE = re.compile(r"state file \S+: generation (\d+) ")

Outcome = str
"""``ok``, ``refused``, ``timeout``, ``reset`` or ``error: ...``: what a connect attempt saw."""


# ------------------------------------------------------------------ lab files


def service(name: str = "web", etp: str = "Cluster", *, app: str = "web",
            type: str = "NodePort", **extra: Any) -> dict[str, Any]:
    """A v1 Service selecting ``app=<app>``, one named port 80 -> 8080."""
    spec: dict[str, Any] = {"type": type, "externalTrafficPolicy": etp,
                            "selector": {"app": app},
                            "ports": [{"name": "http", "port": 80, "targetPort": POD_PORT}],
                            **extra}
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": {"name": name, "namespace": "default"}, "spec": spec}


def lab_spec(pods: Mapping[str, str], *services: dict[str, Any], nodes: int = 3,
             app: str = "web", extra_pods: Iterable[Mapping[str, Any]] = ()) -> dict[str, Any]:
    """A lab file: ``pods`` maps pod name -> node; every pod is labelled ``app=<app>``."""
    pod_list: list[dict[str, Any]] = [
        {"name": p, "node": n, "labels": {"app": app}, "port": POD_PORT}
        for p, n in pods.items()]
    pod_list += [dict(p) for p in extra_pods]
    return {"nodes": nodes, "pods": pod_list, "services": list(services)}


# ------------------------------------------------------------------ proxy state


def generation(lab: Lab, node: str) -> int:
    """The newest state-file generation node's ``kpx node`` has logged (0: none yet)."""
    found = GENERATION_RE.findall(lab.proxy_log(node))
    return max((int(g) for g in found), default=0)


def generations(lab: Lab) -> dict[str, int]:
    return {n: generation(lab, n) for n in lab.nodes}


def logs(lab: Lab) -> str:
    """Every proxy's log, for failure messages."""
    return "\n".join(f"===== {n} =====\n{lab.proxy_log(n)[-4000:]}" for n in lab.nodes)


def wait_applied(lab: Lab, before: Mapping[str, int] | None = None,
                 timeout: float = 5.0) -> None:
    """Wait until every proxy has applied a generation newer than ``before``.

    The generation line is logged by the event-loop callback that then
    applies the snapshot, and connections are accepted on that same loop,
    so any connection accepted after the line appears sees the new state.
    Without ``before``: until each proxy has applied its first state.
    """
    before = before or {}
    deadline = time.monotonic() + timeout
    while True:
        pending = [n for n in lab.nodes if generation(lab, n) <= before.get(n, 0)]
        if not pending:
            return
        if time.monotonic() >= deadline:
            raise AssertionError(f"proxies on {pending} did not apply a state newer than"
                                 f" {dict(before)} within {timeout}s\n{logs(lab)}")
        time.sleep(0.02)


def wait_log(lab: Lab, node: str, pattern: str | re.Pattern[str], *, since: int = 0,
             timeout: float = 5.0) -> list[re.Match[str]]:
    """Wait until node's proxy log, from character ``since`` on, matches ``pattern``."""
    rx = re.compile(pattern) if isinstance(pattern, str) else pattern
    deadline = time.monotonic() + timeout
    while True:
        found = list(rx.finditer(lab.proxy_log(node)[since:]))
        if found:
            return found
        if time.monotonic() >= deadline:
            raise AssertionError(f"{node}'s proxy log never matched {rx.pattern!r} within"
                                 f" {timeout}s\n{logs(lab)}")
        time.sleep(0.02)


# ------------------------------------------------------------------ traffic


def peer_ip(reply: Mapping[str, Any]) -> str:
    """The address the pod saw as its TCP peer."""
    return str(reply["peer"]).rsplit(":", 1)[0]


def who(lab: Lab, src: str, ip: str, port: int,
        timeout: float = 2.0) -> tuple[dict[str, Any], tuple[str, int]]:
    """One WHO request: (the pod's reply, our local address)."""
    with lab.socket(src) as s:
        s.settimeout(timeout)
        s.connect((ip, port))
        local = s.getsockname()
        s.sendall(b"WHO\n")
        buf = b""
        while not buf.endswith(b"\n"):
            chunk = s.recv(4096)
            if not chunk:
                raise ConnectionError(f"EOF after {len(buf)} bytes from {ip}:{port}")
            buf += chunk
        return json.loads(buf), (local[0], local[1])


def connect_outcome(lab: Lab, src: str, ip: str, port: int, timeout: float) -> Outcome:
    """Try one TCP connect from ``src``; classify what happened."""
    with lab.socket(src) as s:
        s.settimeout(timeout)
        try:
            s.connect((ip, port))
        except ConnectionRefusedError:
            return "refused"
        except TimeoutError:
            return "timeout"
        except ConnectionResetError:
            return "reset"
        except OSError as exc:
            return f"error: {exc}"
        return "ok"


def timed_connects(lab: Lab, src: str, targets: Iterable[tuple[str, int]],
                   timeout: float) -> dict[tuple[str, int], tuple[Outcome, float]]:
    """Connect to every target at once (in threads): ``{target: (outcome, seconds)}``."""
    def one(target: tuple[str, int]) -> tuple[Outcome, float]:
        t0 = time.monotonic()
        outcome = connect_outcome(lab, src, target[0], target[1], timeout)
        return outcome, time.monotonic() - t0

    todo = list(targets)
    with ThreadPoolExecutor(max_workers=max(1, len(todo))) as pool:
        return dict(zip(todo, pool.map(one, todo), strict=True))


def listening_ports(lab: Lab, node: str) -> list[str]:
    """``addr:port`` of every TCP LISTEN socket in node's namespace (``ss -ltnH``)."""
    out = lab.run(node, ["ss", "-ltnH"], timeout=10, check=True).stdout
    return [line.split()[3] for line in out.splitlines() if len(line.split()) >= 4]


def listeners_on(lab: Lab, node: str, port: int) -> list[str]:
    return [a for a in listening_ports(lab, node) if a.rsplit(":", 1)[-1] == str(port)]


def poll_change(lab: Lab, probe: Callable[[], bool], what: str, budget: float = 5.0) -> float:
    """Seconds from the state file's last write until ``probe`` first saw the new behaviour.

    The time is taken when the successful probe *started* (its SYN left
    then), and the write time is the file's mtime, which precedes the
    atomic rename: both err towards reporting a longer delay, never a
    shorter one. Fails if the behaviour has not changed within ``budget``.
    """
    written = lab.state_path.stat().st_mtime
    deadline = time.monotonic() + budget
    while True:
        started = time.time()
        if probe():
            return started - written
        if time.monotonic() >= deadline:
            raise AssertionError(f"{what}: not seen within {budget}s of the state write\n"
                                 f"{logs(lab)}")
        time.sleep(0.01)


# ------------------------------------------------------------------ scapy


SYN_PROBE = r"""
import json, random, sys, threading, time
from scapy.all import ICMP, IP, TCP, AsyncSniffer, conf
from scapy.supersocket import L3RawSocket

conf.verb = 0
targets = [tuple(t) for t in json.loads(sys.argv[1])]
window, iface = float(sys.argv[2]), sys.argv[3]
# Source ports below the ephemeral range: no real socket of ours can own them.
sports = random.sample(range(20000, 30000), len(targets))
want = {(ip, port, sp): f"{ip}:{port}" for (ip, port), sp in zip(targets, sports)}
ips = {ip for ip, _ in targets}
seen = {f"{ip}:{port}": [] for ip, port in targets}
icmp = []

def keep(p):
    if IP not in p or p[IP].src not in ips:
        return False  # our own SYNs, and the kernel's RST to any SYN-ACK, are ignored
    if TCP in p:
        return (p[IP].src, p[TCP].sport, p[TCP].dport) in want
    return ICMP in p

started = threading.Event()
sniffer = AsyncSniffer(iface=iface, store=True, lfilter=keep, started_callback=started.set)
sniffer.start()
if not started.wait(10):
    sys.exit("sniffer did not start")
raw = L3RawSocket()
try:
    for (ip, port, sp) in want:
        raw.send(IP(dst=ip) / TCP(sport=sp, dport=port, flags="S",
                                  seq=random.getrandbits(32)))
finally:
    raw.close()
time.sleep(window)  # the observation window: silence is the thing measured
sniffer.stop()
for p in sniffer.results or []:
    if TCP in p:
        seen[want[(p[IP].src, p[TCP].sport, p[TCP].dport)]].append(str(p[TCP].flags))
    else:
        icmp.append(f"{p[IP].src} {p[ICMP].type}/{p[ICMP].code}")
print(json.dumps({"tcp": seen, "icmp": icmp}))
"""


def syn_probe(lab: Lab, targets: Iterable[tuple[str, int]],
              window: float = 1.5) -> tuple[dict[str, list[str]], list[str]]:
    """Send one raw SYN per target from the client namespace and sniff ``window`` seconds.

    Runs scapy in a subprocess inside the client namespace (its interface
    there is ``eth0``). Returns ``({"ip:port": [tcp flags of each answer]},
    [icmp messages from the targets])``.
    """
    argv = [sys.executable, "-c", SYN_PROBE, json.dumps([list(t) for t in targets]),
            str(window), "eth0"]
    try:
        done = lab.run("client", argv, timeout=30 + window)
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"scapy probe hung: {exc}") from exc
    if done.returncode != 0:
        raise AssertionError(f"scapy probe failed ({done.returncode}):\n{done.stderr}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    return result["tcp"], result["icmp"]
