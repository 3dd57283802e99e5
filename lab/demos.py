"""``kpx demo``: the stories every kube-proxy user eventually learns, shown live.

Owns: the demo scenarios (local-drop, healthcheck, source-ip, internal-local,
proxy-protocol, tcp-healthcheck), their
narration, and the structured record of what each one measured.

Never: print a fact it did not just measure, or leave a lab behind. Every
node name, client IP, elapsed time and probe verdict in the output comes from
a request or a status read made during the run; a claim the narration makes
is checked against those measurements, and a claim that did not hold is
printed in red and makes the command exit non-zero. Each demo builds its own
lab (its own namespace prefix) and tears it down in a ``finally``, unless
``--keep`` asks to leave it for exploration.

Each demo is a plain function returning a dict of measured facts (plus
``claims``: ``[{"claim", "held"}]`` and ``ok``), so tests assert the very same
numbers a person sees.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, TextIO

from lab import loadbalancer as lbm
from lab.common import poll
from lab.topology import LB_NODE_IP

DEFAULT_PREFIX = "kdemo"
REQUEST_TIMEOUT = 1.5
"""Long enough for any answer on one machine, short enough that a dropped SYN
(first retransmit after 1 s) is unmistakably a time-out and not a slow reply."""

PROBE = {"interval": 0.5, "timeout": 0.5, "healthyThreshold": 1, "unhealthyThreshold": 2}
"""Fast probes so a demo shows an LB converging in about a second."""

NODE_PORT = 30080
CLUSTER_NODE_PORT = 30081
HC_PORT = 32080


# ---------------------------------------------------------------- narration


class Narrator:
    """Writes the account; ANSI colour only on a terminal and without NO_COLOR."""

    CODES: ClassVar[dict[str, str]] = {
        "bold": "1", "dim": "2", "red": "31", "green": "32", "yellow": "33",
        "blue": "34", "magenta": "35", "cyan": "36",
    }

    def __init__(self, out: TextIO | None = None, color: bool | None = None) -> None:
        self.out = out or sys.stdout
        if color is None:
            color = "NO_COLOR" not in os.environ and hasattr(self.out, "isatty") and (
                self.out.isatty()
            )
        self.color = color

    def c(self, text: object, *styles: str) -> str:
        if not self.color or not styles:
            return str(text)
        codes = ";".join(self.CODES[s] for s in styles)
        return f"\033[{codes}m{text}\033[0m"

    def line(self, text: str = "") -> None:
        print(text, file=self.out, flush=True)

    def title(self, text: str) -> None:
        self.line()
        self.line(self.c(f"━━ {text} ", "bold", "magenta") + self.c("━" * max(0, 60 - len(text)),
                                                                   "magenta"))

    def explain(self, text: str) -> None:
        """The concept, wrapped for a terminal and set off in dim italics-free text."""
        import textwrap

        for i, para in enumerate(text.strip().split("\n\n")):
            if i:
                self.line(self.c("  │", "blue"))
            for ln in textwrap.wrap(" ".join(para.split()), width=78):
                self.line(self.c("  │ ", "blue") + ln)
        self.line()

    def step(self, text: str) -> None:
        self.line(self.c("▸ ", "cyan", "bold") + text)

    def detail(self, text: str) -> None:
        self.line("    " + text)

    def claim(self, text: str, held: bool) -> None:
        mark = self.c("✔", "green", "bold") if held else self.c("✘ did not hold:", "red", "bold")
        self.line(f"  {mark} {text}")


@dataclass
class Attempt:
    """One measured connection: what happened and how long it took."""

    outcome: str  # "answered" | "timeout" | "no reply" | "refused" | "reset" | "error: ..."
    elapsed: float
    reply: dict[str, Any] | None = None

    @property
    def pod(self) -> str | None:
        return (self.reply or {}).get("pod")

    @property
    def node(self) -> str | None:
        return (self.reply or {}).get("node")

    @property
    def peer_ip(self) -> str | None:
        """The source address the pod saw (``peer`` is ``ip:port``)."""
        peer = (self.reply or {}).get("peer")
        return str(peer).rsplit(":", 1)[0] if peer else None

    def as_dict(self) -> dict[str, Any]:
        return {"outcome": self.outcome, "elapsed": round(self.elapsed, 3), "pod": self.pod,
                "node": self.node, "peer_ip": self.peer_ip}


def attempt(lab: Any, src: str, ip: str, port: int, timeout: float = REQUEST_TIMEOUT) -> Attempt:
    """Open one connection from namespace *src* and record the outcome, never raising."""
    from lab.probes import _read_line, family_of

    start = time.monotonic()
    connected = False
    try:
        # lab.request's timeout is per operation: a connection that was accepted and then
        # never answered would also end in TimeoutError, and read as a dropped SYN.
        with lab.socket(src, family_of(ip)) as s:
            s.settimeout(timeout)
            s.connect((ip, port))
            connected = True
            s.sendall(b"WHO\n")
            reply = json.loads(_read_line(s))
    except TimeoutError:
        return Attempt("no reply" if connected else "timeout", time.monotonic() - start)
    except ConnectionRefusedError:
        return Attempt("refused", time.monotonic() - start)
    except ConnectionResetError:
        return Attempt("reset", time.monotonic() - start)
    except OSError as e:
        return Attempt(f"error: {e}", time.monotonic() - start)
    return Attempt("answered", time.monotonic() - start, dict(reply))


def http_get(
    lab: Any, src: str, ip: str, port: int, path: str = "/healthz", timeout: float = REQUEST_TIMEOUT
) -> tuple[int | None, str, str]:
    """GET from inside *src*: (status or None, body, what happened).

    Uses the lab's own socket helper rather than curl so it measures exactly
    one TCP connection and needs nothing installed in the namespaces.
    """
    with lab.socket(src) as sock:
        sock.settimeout(timeout)
        try:
            sock.connect((ip, port))
            sock.sendall(f"GET {path} HTTP/1.1\r\nHost: {ip}:{port}\r\nConnection: close\r\n\r\n"
                         .encode())
            data = b""
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline and len(data) < 1 << 16:
                chunk = sock.recv(4096)
                if not chunk:
                    break
                data += chunk
        except TimeoutError:
            return None, "", "timeout"
        except ConnectionRefusedError:
            return None, "", "refused"
        except ConnectionResetError:
            return None, "", "reset"
        except OSError as e:
            return None, "", f"error: {e}"
    if not data:
        return None, "", "closed without a reply"
    head, _, body = data.partition(b"\r\n\r\n")
    parts = head.split(b" ", 2)
    if len(parts) < 2 or not parts[1].isdigit():
        return None, "", "not HTTP"
    return int(parts[1]), body.decode(errors="replace"), f"HTTP {int(parts[1])}"


def wait_node_ports(lab: Any, timeout: float = 5.0) -> list[str]:
    """Wait until every node's proxy listens on every nodePort of the lab.

    ``Lab.up`` returns once each ``kpx node`` answers its healthz port, which
    opens a moment *before* the state file is applied; a request sent in that
    moment is refused and would be reported as a (false) measurement. A
    node's own ``127.0.0.1:nodePort`` opens together with its node-IP
    listener and accepts even under eTP=Local (node-originated traffic), so a
    TCP connect to it from inside the node is an exact readiness signal.
    Returns the ``node:port`` pairs still closed at the deadline.
    """
    ports = sorted({p for key in lab.services if (p := lab.node_port(key))})
    pending = [(n, p) for n in _node_names(lab) for p in ports]
    deadline = time.monotonic() + timeout
    while pending and time.monotonic() < deadline:
        still = []
        for node, port in pending:
            with lab.socket(node) as sock:
                sock.settimeout(0.5)
                try:
                    sock.connect(("127.0.0.1", port))
                except OSError:
                    still.append((node, port))
        pending = still
        if pending:
            time.sleep(0.05)
    return [f"{n}:{p}" for n, p in pending]


def lb_view(run_dir: Path) -> dict[str, dict[str, Any]]:
    """The LB's per-node verdicts, keyed by node name."""
    return {n["name"]: n for n in lbm.status(run_dir)}


def lb_serving(lab: Any) -> list[str]:
    return list(lbm.read_status(lab.run_dir).get("serving") or [])


class Claims:
    """Collects (claim, held) pairs and narrates each as it is judged."""

    def __init__(self, say: Narrator) -> None:
        self.say = say
        self.items: list[dict[str, Any]] = []

    def check(self, text: str, held: bool) -> bool:
        self.items.append({"claim": text, "held": bool(held)})
        self.say.claim(text, bool(held))
        return bool(held)

    @property
    def ok(self) -> bool:
        return all(c["held"] for c in self.items)


# ---------------------------------------------------------------- lab plumbing


def _service(name: str, policy: str, node_port: int, kind: str = "NodePort",
             hc_port: int | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "type": kind,
        "externalTrafficPolicy": policy,
        "selector": {"app": "web"},
        "ports": [{"name": "http", "port": 80, "targetPort": 8080, "nodePort": node_port}],
    }
    if hc_port:
        spec["healthCheckNodePort"] = hc_port
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": {"name": name, "namespace": "default"}, "spec": spec}


def _pod(node: str = "node1") -> dict[str, Any]:
    return {"name": "web-1", "node": node, "labels": {"app": "web"}, "port": 8080}


@contextlib.contextmanager
def demo_lab(spec: dict[str, Any], prefix: str, run_dir: Path | None, keep: bool,
             say: Narrator) -> Iterator[Any]:
    """Build a lab for one demo; always tear it down unless *keep*."""
    from lab import Lab, LabSpec
    from lab.cluster import default_run_dir

    own_dir = run_dir is None
    # The lab CLI finds a lab by name in the default run directory, so a kept
    # demo lab is reachable with `kpx lab status --name <prefix>`.
    directory = default_run_dir(prefix) if run_dir is None else Path(run_dir)
    lab = Lab(LabSpec.load(spec), prefix=prefix, run_dir=directory, start_proxies=True)
    start = time.monotonic()
    try:
        lab.up()
        closed = wait_node_ports(lab)
        if closed:
            raise RuntimeError(f"proxies not listening after 5 s: {', '.join(closed)}")
        say.step(f"lab {say.c(prefix, 'bold')} is up ({len(lab.nodes)} nodes, "
                 f"{time.monotonic() - start:.1f}s); client is {say.c(lab.client_ip, 'bold')}")
        yield lab
    finally:
        if keep:
            say.line(say.c(f"  lab {prefix} left up (--keep): kpx lab status --name {prefix}; "
                           f"remove it with kpx lab down --name {prefix}", "dim"))
        else:
            lab.down()
            if own_dir:
                shutil.rmtree(directory, ignore_errors=True)


def _ip_of(lab: Any, ip: str | None) -> str:
    """Name an address the way a person reading the demo needs it named."""
    if ip is None:
        return "?"
    if ip == lab.client_ip:
        return f"{ip} (the client)"
    for node in _node_names(lab):
        if lab.node_ip(node) == ip:
            return f"{ip} ({node})"
    if ip == LB_NODE_IP:
        return f"{ip} (the LB)"
    return ip


def _node_names(lab: Any) -> list[str]:
    return [n if isinstance(n, str) else str(n.name) for n in lab.nodes]


def _describe(say: Narrator, lab: Any, a: Attempt) -> str:
    if a.outcome == "answered":
        return (f"{say.c('answered', 'green')} by pod {say.c(a.pod, 'bold')} on {a.node} in "
                f"{a.elapsed * 1000:.0f} ms; the pod saw the connection come from "
                f"{say.c(_ip_of(lab, a.peer_ip), 'bold')}")
    colour = "yellow" if a.outcome == "timeout" else "red"
    what = "no answer" if a.outcome == "timeout" else a.outcome
    return f"{say.c(what, colour)} after {a.elapsed:.2f} s"


# ---------------------------------------------------------------- the demos


def local_drop(*, prefix: str = f"{DEFAULT_PREFIX}1", run_dir: Path | None = None,
               out: TextIO | None = None, keep: bool = False,
               timeout: float = REQUEST_TIMEOUT) -> dict[str, Any]:
    """NodePort + eTP=Local: nodes without a pod drop the SYN; localhost still works."""
    say = Narrator(out)
    claims = Claims(say)
    say.title("local-drop: externalTrafficPolicy=Local drops, it does not refuse")
    say.explain("""
        A NodePort service opens its port on every node. With externalTrafficPolicy: Local,
        kube-proxy sends external traffic only to pods on the node that received it, so the
        client IP never has to be rewritten; a node without such a pod silently drops the SYN,
        and the client sees a time-out, not a "connection refused".

        Traffic a node sends to itself (localhost:nodePort) counts as internal and gets
        Cluster semantics, so it still reaches a pod elsewhere. That is why "curl
        localhost:30080 works on the node" proves nothing about what an external client or
        a load balancer probing the NodePort will see.""")
    spec = {
        "nodes": 3, "pods": [_pod("node1")],
        "services": [_service("web", "Local", NODE_PORT)],
        "loadBalancer": {"service": "default/web", "mode": "passthrough",
                         "probe": {"type": "tcp", "port": "nodePort", **PROBE}},
    }
    facts: dict[str, Any] = {"demo": "local-drop", "nodes": {}}
    with demo_lab(spec, prefix, run_dir, keep, say) as lab:
        port = lab.node_port("default/web")
        say.step(f"pod web-1 runs on node1 only; service default/web is NodePort {port}, eTP=Local")
        say.detail(say.c("each request is one TCP connection from the client sending WHO; the "
                         "echo pod replies with its name, its node and the source address it "
                         "saw", "dim"))
        for node in _node_names(lab):
            ip = lab.node_ip(node)
            say.step(f"client {lab.client_ip} → {node} {ip}:{port}")
            a = attempt(lab, "client", ip, port, timeout)
            say.detail(_describe(say, lab, a))
            facts["nodes"][node] = a.as_dict()
        n1 = facts["nodes"]["node1"]
        claims.check("node1, which has the pod, answered, and the pod saw the client's own IP",
                     n1["outcome"] == "answered" and n1["peer_ip"] == lab.client_ip)
        for node in _node_names(lab)[1:]:
            r = facts["nodes"][node]
            dropped = r["outcome"] == "timeout" and r["elapsed"] >= timeout * 0.9
            claims.check(f"{node} dropped the SYN: a time-out after {r['elapsed']:.2f} s, "
                         "not a refusal", dropped)

        facts["localhost"] = {}
        podless = _node_names(lab)[1:]
        for other in podless:
            say.step(f"from inside {other}: 127.0.0.1:{port} (node-originated traffic)")
            a = attempt(lab, other, "127.0.0.1", port, timeout)
            say.detail(_describe(say, lab, a))
            facts["localhost"][other] = a.as_dict()
            claims.check(f"localhost:{port} on {other} works anyway: Cluster semantics, "
                         f"SNATed to {other}'s IP", a.outcome == "answered"
                         and a.pod == "web-1" and a.peer_ip == lab.node_ip(other))

        say.step("the LB health-checks each node with a TCP connect to the NodePort itself")
        expected = {n: n == "node1" for n in _node_names(lab)}

        def settled() -> bool:
            v = lb_view(lab.run_dir)
            return all(v.get(n, {}).get("healthy") == up for n, up in expected.items())

        poll(settled, 5.0)
        view = lb_view(lab.run_dir)
        for node, st in view.items():
            verdict = say.c("passing", "green") if st["healthy"] else say.c("failing", "red")
            say.detail(f"{node}: {verdict} — last probe: {st['result']} (since {st['since']})")
        facts["lb"] = {n: {"healthy": s["healthy"], "result": s["result"]} for n, s in view.items()}
        timed_out = [n for n, st in facts["lb"].items() if st["result"] == "timeout"]
        if timed_out:
            say.detail(say.c(
                f"why: the probe's SYN to {', '.join(timed_out)} meets the same silent drop as a "
                "client's, so the LB cannot tell \"no local pod\" from \"node dead\". The "
                "healthcheck demo shows the port that can.", "dim"))
        claims.check(f"the LB marks {' and '.join(podless)} down because their probes time "
                     "out, while localhost works on them", all(
                         not facts["lb"].get(n, {}).get("healthy", True)
                         and facts["lb"][n]["result"] == "timeout"
                         and facts["localhost"][n]["outcome"] == "answered" for n in podless))
        claims.check("the LB keeps node1", facts["lb"].get("node1", {}).get("healthy") is True)
    facts["claims"], facts["ok"] = claims.items, claims.ok
    return facts


def healthcheck(*, prefix: str = f"{DEFAULT_PREFIX}2", run_dir: Path | None = None,
                out: TextIO | None = None, keep: bool = False,
                timeout: float = REQUEST_TIMEOUT, requests: int = 6) -> dict[str, Any]:
    """healthCheckNodePort: 200 where a pod is, 503 elsewhere; the LB follows a moving pod."""
    say = Narrator(out)
    claims = Claims(say)
    say.title("healthcheck: the LB asks kube-proxy which nodes have the pod")
    say.explain("""
        A LoadBalancer service with externalTrafficPolicy: Local gets a healthCheckNodePort.
        kube-proxy answers it on every node: 200 with "localEndpoints": n on nodes that run
        ready pods of the service, 503 with 0 elsewhere. Cloud load balancers probe that port
        with HTTP GET /healthz, so only nodes that can serve locally get traffic, and the
        client IP survives because there is no second hop.

        When the pod moves, the answers flip and the LB follows, after its unhealthy and
        healthy thresholds: a probe must fail twice in a row before a node leaves.""")
    spec = {
        "nodes": 3, "pods": [_pod("node1")],
        "services": [_service("web", "Local", NODE_PORT, "LoadBalancer", HC_PORT)],
        "loadBalancer": {"service": "default/web", "mode": "passthrough", "port": 80,
                         "probe": {"type": "http", "port": "healthCheckNodePort",
                                   "path": "/healthz", **PROBE}},
    }
    facts: dict[str, Any] = {"demo": "healthcheck", "health": {}}
    with demo_lab(spec, prefix, run_dir, keep, say) as lab:
        hc = lab.hc_port("default/web")
        names = _node_names(lab)
        say.step(f"GET /healthz on each node's healthCheckNodePort {hc}")
        for node in names:
            code, body, what = http_get(lab, "client", lab.node_ip(node), hc, "/healthz", timeout)
            local = _local_endpoints(body)
            colour = "green" if code == 200 else "red"
            say.detail(f"{node}: {say.c(what, colour)}, \"localEndpoints\": {local}")
            facts["health"][node] = {"status": code, "localEndpoints": local}
        claims.check('node1 answers 200 with "localEndpoints": 1',
                     facts["health"]["node1"] == {"status": 200, "localEndpoints": 1})
        claims.check("node2 and node3 answer 503 with 0", all(
            facts["health"][n] == {"status": 503, "localEndpoints": 0} for n in names[1:]))

        poll(lambda: lb_serving(lab) == ["node1"], 5.0)
        view = lb_view(lab.run_dir)
        say.step(f"the LB probes HTTP GET :{hc}/healthz every {PROBE['interval']} s:")
        for node, st in view.items():
            verdict = say.c("in rotation", "green") if st["healthy"] else say.c("out", "red")
            say.detail(f"{node}: {verdict} — last probe {st['result']}")
        facts["lb_before"] = lb_serving(lab)
        say.detail(say.c("why: an HTTP probe reads the status code, and kube-proxy answers 503 "
                         "where localEndpoints is 0", "dim"))
        claims.check("the LB keeps only node1", facts["lb_before"] == ["node1"])

        facts["before"] = _through_lb(say, lab, requests, timeout)
        claims.check(f"all {requests} requests through the LB succeeded, on node1, with the "
                     "client IP intact", all(
                         r["outcome"] == "answered" and r["node"] == "node1"
                         and r["peer_ip"] == lab.client_ip for r in facts["before"]))

        say.step(f"moving pod web-1 from node1 to {names[1]} ...")
        start = time.monotonic()
        lab.move_pod("web-1", names[1])
        poll(lambda: http_get(lab, "client", lab.node_ip(names[1]), hc, "/healthz",
                                  timeout)[0] == 200, 10.0)
        hc_flip = time.monotonic() - start
        poll(lambda: lb_serving(lab) == [names[1]], 15.0)
        shifted = time.monotonic() - start
        facts["lb_after"] = lb_serving(lab)
        facts["hc_flip_seconds"] = round(hc_flip, 3)
        facts["shift_seconds"] = round(shifted, 3)
        view = lb_view(lab.run_dir)
        say.detail(f"{names[1]}'s health check answered 200 after {hc_flip:.2f} s")
        say.detail(f"the LB's rotation became {facts['lb_after']} after {shifted:.2f} s")
        for node, st in view.items():
            verdict = say.c("in rotation", "green") if st["healthy"] else say.c("out", "red")
            say.detail(f"{node}: {verdict} — last probe {st['result']} (since {st['since']})")
        claims.check(f"the LB shifted to {names[1]} alone", facts["lb_after"] == [names[1]])
        facts["after"] = _through_lb(say, lab, requests, timeout)
        claims.check(f"all {requests} requests now land on {names[1]}", all(
            r["outcome"] == "answered" and r["node"] == names[1] for r in facts["after"]))
    facts["claims"], facts["ok"] = claims.items, claims.ok
    return facts


def _local_endpoints(body: str) -> int | None:
    import json

    try:
        return int(json.loads(body)["localEndpoints"])
    except (ValueError, KeyError, TypeError):
        return None


def _through_lb(say: Narrator, lab: Any, n: int, timeout: float) -> list[dict[str, Any]]:
    front = lbm.read_status(lab.run_dir).get("front", f"{lbm.FRONT_IP}:80")
    ip, port = front.rsplit(":", 1)
    say.step(f"{n} new connections from the client to the LB at {front}")
    results = []
    for _ in range(n):
        a = attempt(lab, "client", ip, int(port), timeout)
        results.append(a.as_dict())
    answered = [r for r in results if r["outcome"] == "answered"]
    by_node: dict[str, int] = {}
    for r in answered:
        by_node[r["node"]] = by_node.get(r["node"], 0) + 1
    seen = sorted({r["peer_ip"] for r in answered})
    spread = ", ".join(f"{node} ×{count}" for node, count in sorted(by_node.items()))
    say.detail(f"{len(answered)}/{n} answered; by node: {spread or 'none'}; the pod saw "
               f"{', '.join(_ip_of(lab, s) for s in seen) or 'nothing'}")
    return results


def source_ip(*, prefix: str = f"{DEFAULT_PREFIX}3", run_dir: Path | None = None,
              out: TextIO | None = None, keep: bool = False,
              timeout: float = REQUEST_TIMEOUT) -> dict[str, Any]:
    """Which client IP the pod sees: Cluster via another node, Cluster locally, Local."""
    say = Narrator(out)
    claims = Claims(say)
    say.title("source-ip: who does the pod think is calling?")
    say.explain("""
        With externalTrafficPolicy: Cluster any node accepts the connection and may forward it
        to a pod on another node. For the reply to come back through it, that node rewrites
        the source to its own IP (SNAT), so the pod loses the client IP. kube-proxy's iptables
        mode SNATs even when the pod is local; kpx, like Cilium, only SNATs the cross-node hop.

        externalTrafficPolicy: Local never makes that hop, so the client IP is always kept —
        at the price of needing a load balancer that sends traffic only to nodes with pods.""")
    spec = {
        "nodes": 3, "pods": [_pod("node1")],
        "services": [_service("web-cluster", "Cluster", CLUSTER_NODE_PORT),
                     _service("web-local", "Local", NODE_PORT)],
    }
    facts: dict[str, Any] = {"demo": "source-ip"}
    with demo_lab(spec, prefix, run_dir, keep, say) as lab:
        cluster = lab.node_port("default/web-cluster")
        local = lab.node_port("default/web-local")
        n1, n2 = lab.node_ip("node1"), lab.node_ip("node2")
        say.step(f"pod web-1 on node1; web-cluster (eTP=Cluster) on {cluster}, "
                 f"web-local (eTP=Local) on {local}; the same pod behind both")
        cases = [
            ("cluster_via_node2", f"eTP=Cluster via node2 {n2}:{cluster}", n2, cluster),
            ("cluster_via_node1", f"eTP=Cluster via node1 {n1}:{cluster}", n1, cluster),
            ("local_via_node1", f"eTP=Local via node1 {n1}:{local}", n1, local),
        ]
        for key, label, ip, port in cases:
            say.step(f"client {lab.client_ip} → {label}")
            a = attempt(lab, "client", ip, port, timeout)
            say.detail(_describe(say, lab, a))
            facts[key] = a.as_dict()
        claims.check("through node2 (a cross-node hop) the pod saw node2's IP, not the client's",
                     facts["cluster_via_node2"]["outcome"] == "answered"
                     and facts["cluster_via_node2"]["peer_ip"] == n2)
        claims.check("through node1 (no hop) the pod saw the client IP, even with eTP=Cluster",
                     facts["cluster_via_node1"]["peer_ip"] == lab.client_ip)
        claims.check("with eTP=Local the pod saw the client IP",
                     facts["local_via_node1"]["peer_ip"] == lab.client_ip)
    facts["claims"], facts["ok"] = claims.items, claims.ok
    return facts


VIPS_IN_FORCE = "service VIPs in force"


def _wait_vips_applied(lab: Any, node: str, before: int, timeout: float = 5.0) -> bool:
    """Until *node*'s kpx logs one more "service VIPs in force" than *before*."""
    return poll(lambda: lab.proxy_log(node).count(VIPS_IN_FORCE) > before, timeout)


def internal_local(*, prefix: str = f"{DEFAULT_PREFIX}4", run_dir: Path | None = None,
                   out: TextIO | None = None, keep: bool = False,
                   timeout: float = REQUEST_TIMEOUT) -> dict[str, Any]:
    """ClusterIP + iTP=Local: pods on a node without an endpoint time out; no node escape."""
    say = Narrator(out)
    claims = Claims(say)
    say.title("internal-local: internalTrafficPolicy=Local drops in-cluster traffic too")
    say.explain("""
        A Service's ClusterIP is what pods use to reach it. internalTrafficPolicy: Local
        tells kube-proxy to send that in-cluster traffic only to endpoints on the caller's own
        node. A node without one drops the SYN: the caller sees a time-out, not a refusal.

        Unlike a NodePort with externalTrafficPolicy: Local, there is no escape for traffic
        the node sends itself: a host-network process on that node is dropped as well
        (kube-proxy's e2e "should respect internalTrafficPolicy=Local Pod and Node, to
        Pod (hostNetwork: true)"). So "curl localhost:nodePort works on the node" says
        nothing about what a pod calling the ClusterIP will see.""")
    svc = _service("web", "Local", NODE_PORT)
    svc["spec"]["internalTrafficPolicy"] = "Cluster"
    client = {"labels": {"app": "client"}, "port": 8080}
    spec = {"nodes": 2,
            "pods": [_pod("node1"), {"name": "c1", "node": "node1", **client},
                     {"name": "c2", "node": "node2", **client}],
            "services": [svc]}
    facts: dict[str, Any] = {"demo": "internal-local"}
    with demo_lab(spec, prefix, run_dir, keep, say) as lab:
        cip, port = lab.cluster_ip("default/web"), lab.node_port("default/web")
        poll(lambda: all(VIPS_IN_FORCE in lab.proxy_log(n) for n in _node_names(lab)), 5.0)
        say.step(f"pod web-1 runs on node1; service default/web has ClusterIP {cip}:80 "
                 f"(and NodePort {port}, eTP=Local)")

        def call(src: str, what: str, ip: str = cip, to: int = 80) -> dict[str, Any]:
            say.step(f"{what}: {src} → {ip}:{to}")
            a = attempt(lab, src, ip, to, timeout)
            say.detail(_describe(say, lab, a))
            return a.as_dict()

        facts["cluster_from_c2"] = call("c2", "iTP=Cluster, a pod on node2")
        claims.check("with iTP=Cluster, the pod on node2 reaches web-1 on node1",
                     facts["cluster_from_c2"]["outcome"] == "answered")

        seen = lab.proxy_log("node2").count(VIPS_IN_FORCE)
        svc["spec"]["internalTrafficPolicy"] = "Local"
        lab.update_service(svc)
        applied = _wait_vips_applied(lab, "node2", seen)
        say.step("kpx lab apply: internalTrafficPolicy Cluster → Local"
                 + ("" if applied else say.c(" (node2 did not confirm it)", "red")))
        facts["local_from_c2"] = call("c2", "iTP=Local, a pod on node2 (no endpoint there)")
        r = facts["local_from_c2"]
        claims.check(f"the same call from node2's pod is dropped: a time-out after "
                     f"{r['elapsed']:.2f} s, not a refusal",
                     applied and r["outcome"] == "timeout" and r["elapsed"] >= timeout * 0.9)
        facts["local_from_c1"] = call("c1", "iTP=Local, a pod on node1 (the endpoint's node)")
        claims.check("from a pod on node1 it still works",
                     facts["local_from_c1"]["outcome"] == "answered"
                     and facts["local_from_c1"]["pod"] == "web-1")
        facts["local_from_node2"] = call("node2", "iTP=Local, node2 itself (host network)")
        r = facts["local_from_node2"]
        claims.check("node2's own process is dropped too: no Cluster escape for iTP",
                     r["outcome"] == "timeout" and r["elapsed"] >= timeout * 0.9)
        facts["nodeport_localhost_node2"] = call(
            "node2", "for contrast, the NodePort (eTP=Local) from node2 itself",
            "127.0.0.1", port)
        r = facts["nodeport_localhost_node2"]
        claims.check(f"localhost:{port} on node2 works: node traffic gets Cluster semantics "
                     "for NodePorts, not for iTP", r["outcome"] == "answered"
                     and r["pod"] == "web-1")
    facts["claims"], facts["ok"] = claims.items, claims.ok
    return facts


def _per_node(lab: Any, n: int, timeout: float) -> list[dict[str, Any]]:
    """``n`` client connections through the LB, each with the node the LB sent it to.

    The LB's own per-node counters, read around each connection, name the
    node even when the connection times out (a dropped SYN answers nothing).
    """
    front = lbm.read_status(lab.run_dir).get("front", f"{lbm.FRONT_IP}:80")
    ip, port = front.rsplit(":", 1)
    results = []
    for _ in range(n):
        before = lbm.connection_counts(lab)
        a = attempt(lab, "client", ip, int(port), timeout).as_dict()
        after = lbm.connection_counts(lab)
        sent = [node for node, c in after.items() if c > before.get(node, 0)]
        a["sent_to"] = sent[0] if len(sent) == 1 else None
        results.append(a)
    return results


def _tally(say: Narrator, results: list[dict[str, Any]], names: list[str]) -> dict[str, Any]:
    """Attempts, successes and time-outs per node the LB chose, narrated as a table."""
    table: dict[str, dict[str, int]] = {
        n: {"attempts": 0, "answered": 0, "timeouts": 0} for n in names}
    for r in results:
        row = table.setdefault(str(r["sent_to"]), {"attempts": 0, "answered": 0, "timeouts": 0})
        row["attempts"] += 1
        row["answered"] += r["outcome"] == "answered"
        row["timeouts"] += r["outcome"] == "timeout"
    say.detail(f"{'node':8}{'attempts':>10}{'answered':>10}{'timeouts':>10}")
    for node, row in table.items():
        say.detail(f"{node:8}{row['attempts']:>10}{row['answered']:>10}{row['timeouts']:>10}")
    return table


def tcp_healthcheck(*, prefix: str = f"{DEFAULT_PREFIX}6", run_dir: Path | None = None,
                    out: TextIO | None = None, keep: bool = False,
                    timeout: float = REQUEST_TIMEOUT, requests: int = 9) -> dict[str, Any]:
    """A TCP probe of the healthCheckNodePort keeps every node; an HTTP probe fixes it."""
    say = Narrator(out)
    claims = Claims(say)
    say.title("tcp-healthcheck: a TCP probe on the healthCheckNodePort is a grave mistake")
    say.explain("""
        kube-proxy answers the healthCheckNodePort on every node: 200 where the service has
        a local endpoint, 503 where it has none. The 503 is an HTTP answer, so the port
        accepts TCP connections on every node.

        A load balancer configured to probe that port with a TCP connect therefore sees
        every node healthy and keeps sending clients to nodes without a pod, where
        externalTrafficPolicy: Local drops their SYNs: those connections time out. Probing
        with HTTP GET /healthz reads the status code and takes those nodes out.""")
    probe = {"type": "tcp", "port": "healthCheckNodePort", **PROBE}
    spec = {
        "nodes": 3, "pods": [_pod("node1")],
        "services": [_service("web", "Local", NODE_PORT, "LoadBalancer", HC_PORT)],
        "loadBalancer": {"service": "default/web", "mode": "passthrough", "port": 80,
                         "probe": probe},
    }
    facts: dict[str, Any] = {"demo": "tcp-healthcheck"}
    with demo_lab(spec, prefix, run_dir, keep, say) as lab:
        names = _node_names(lab)
        hc = lab.hc_port("default/web")
        poll(lambda: lb_serving(lab) == names, 5.0)
        say.step(f"the LB probes each node with a TCP connect to healthCheckNodePort {hc}:")
        for node, st in lb_view(lab.run_dir).items():
            verdict = say.c("in rotation", "green") if st["healthy"] else say.c("out", "red")
            say.detail(f"{node}: {verdict} — last probe {st['result']}")
        facts["lb_tcp"] = lb_serving(lab)
        claims.check("every node passes the TCP probe, node2 and node3 included",
                     facts["lb_tcp"] == names)
        say.step(f"{requests} new connections from the client to the LB")
        facts["tcp"] = _tally(say, _per_node(lab, requests, timeout), names)
        tcp = facts["tcp"]
        timeouts = sum(row["timeouts"] for row in tcp.values())
        claims.check(f"{timeouts} of {requests} connections timed out, every one sent to a "
                     "node without the pod", timeouts > 0 and tcp["node1"]["timeouts"] == 0
                     and all(tcp[n]["timeouts"] == tcp[n]["attempts"] > 0 for n in names[1:]))

        say.step("kpx lab apply: the LB's probe becomes HTTP GET /healthz")
        raw = lab.spec.to_dict()
        raw["loadBalancer"]["probe"] = {**probe, "type": "http", "path": "/healthz"}
        start = time.monotonic()
        lab.apply(raw)
        poll(lambda: lb_serving(lab) == ["node1"], 10.0)
        facts["shift_seconds"] = round(time.monotonic() - start, 3)
        facts["lb_http"] = lb_serving(lab)
        for node, st in lb_view(lab.run_dir).items():
            verdict = say.c("in rotation", "green") if st["healthy"] else say.c("out", "red")
            say.detail(f"{node}: {verdict} — last probe {st['result']}")
        claims.check(f"the HTTP probe keeps node1 alone: node2 and node3 answer 503 "
                     f"(rotation settled {facts['shift_seconds']:.2f} s after the change)",
                     facts["lb_http"] == ["node1"])
        say.step(f"{requests} new connections again")
        facts["http"] = _tally(say, _per_node(lab, requests, timeout), names)
        http = facts["http"]
        claims.check(f"all {requests} connections succeed, all on node1",
                     http["node1"]["answered"] == requests)
    facts["claims"], facts["ok"] = claims.items, claims.ok
    return facts


def _ingress_call(say: Narrator, lab: Any, src: str, timeout: float) -> dict[str, Any]:
    """GET / from *src* to the LB's front: what nginx answered (or what it did instead)."""
    front = lbm.read_status(lab.run_dir).get("front", f"{lbm.FRONT_IP}:80")
    ip, port = front.rsplit(":", 1)
    say.step(f"{src} → http://{ip}:{port}/ (the LB's address)")
    code, body, what = http_get(lab, src, ip, int(port), "/", timeout)
    reply: dict[str, Any] = {}
    with contextlib.suppress(ValueError):
        reply = json.loads(body) if code == 200 else {}
    if code == 200 and reply:
        peer = str(reply.get("peer", "")).rsplit(":", 1)[0]
        proxy = str(reply.get("proxy", "")).rsplit(":", 1)[0]
        say.detail(f"{say.c('HTTP 200', 'green')} from {reply.get('server')} pod "
                   f"{say.c(reply.get('pod'), 'bold')}: TCP peer {_ip_of(lab, peer)}, PROXY "
                   f"header source {_ip_of(lab, proxy or None)}; nginx believes the client is "
                   f"{say.c(_ip_of(lab, reply.get('clientIP')), 'bold')}")
    else:
        say.detail(say.c(what, "red"))
    return {"status": code, "outcome": what, "client_ip": reply.get("clientIP"),
            "proxy_ip": str(reply.get("proxy", "")).rsplit(":", 1)[0] or None,
            "peer_ip": str(reply.get("peer", "")).rsplit(":", 1)[0] or None}


def _last_nginx_error(lab: Any, pod: str, before: int) -> str | None:
    """The first ``[error]`` nginx logged after byte *before* of its log, on one line."""
    text = lab.pod_log(pod)[before:]
    at = text.find("[error]")
    if at < 0:
        return None
    return " ".join(text[at:].split(" while ", 1)[0].split())[:160]


def proxy_protocol(*, prefix: str = f"{DEFAULT_PREFIX}5", run_dir: Path | None = None,
                   out: TextIO | None = None, keep: bool = False,
                   timeout: float = REQUEST_TIMEOUT) -> dict[str, Any]:
    """PROXY protocol through a proxying LB: the client IP, the hairpin, and ipMode: Proxy."""
    say = Narrator(out)
    claims = Claims(say)
    say.title("proxy-protocol: the client IP through a proxying LB, and the in-cluster hairpin")
    say.explain("""
        A load balancer that proxies (rather than passes packets through) opens its own
        connection to the node, so the pod sees the LB's address. PROXY protocol fixes that:
        the LB sends a header naming the real client first, and the ingress (nginx here,
        listen ... proxy_protocol, trusting only the LB) takes the client from it.

        Inside the cluster, kube-proxy knows the LB's IP from the Service's status and, with
        the default ipMode: VIP, short-circuits a pod's connection to it straight to the
        ingress pod. That connection never passes the LB, so it carries no PROXY header,
        and nginx, which now requires one, refuses it. ipMode: Proxy (Kubernetes 1.30+)
        tells kube-proxy to leave the LB's IP alone: the call goes out to the LB and comes
        back with the header, like everyone else's.""")
    svc = _service("ingress", "Local", NODE_PORT, "LoadBalancer", HC_PORT)
    svc["spec"]["selector"] = {"app": "ingress"}
    spec = {
        "nodes": 2,
        "pods": [{"name": "ingress", "node": "node1", "labels": {"app": "ingress"},
                  "port": 8080, "image": "nginx", "proxyProtocol": True},
                 {"name": "c2", "node": "node2", "labels": {"app": "client"}, "port": 8080}],
        "services": [svc],
        "loadBalancer": {"service": "default/ingress", "mode": "proxy", "proxyProtocol": "v2",
                         "port": 80, "ipMode": "VIP", "probe": {"type": "http", **PROBE}},
    }
    facts: dict[str, Any] = {"demo": "proxy-protocol"}
    with demo_lab(spec, prefix, run_dir, keep, say) as lab:
        poll(lambda: lb_serving(lab) == ["node1"], 5.0)
        poll(lambda: all(VIPS_IN_FORCE in lab.proxy_log(n) for n in _node_names(lab)), 5.0)
        c2 = lab.pod_ip("c2")
        say.step(f"nginx pod {say.c('ingress', 'bold')} runs on node1 (eTP=Local); the LB "
                 f"proxies to the nodes and sends PROXY v2; pod c2 ({c2}) runs on node2")

        facts["external"] = r = _ingress_call(say, lab, "client", timeout)
        claims.check("an external client's request reaches nginx with the client's own IP "
                     "in the PROXY header, and nginx believes it",
                     r["status"] == 200 and r["client_ip"] == lab.client_ip
                     and r["proxy_ip"] == lab.client_ip)

        mark = len(lab.pod_log("ingress"))
        facts["vip"] = r = _ingress_call(say, lab, "c2", timeout)
        r["nginx_error"] = _last_nginx_error(lab, "ingress", mark)
        if r["nginx_error"]:
            say.detail(f"nginx's log: {say.c(r['nginx_error'], 'dim')}")
        claims.check(f"with ipMode: VIP, pod c2's call never reaches the LB: nginx gets no PROXY "
                     f"header and refuses it ({r['outcome']})",
                     r["status"] is None and r["outcome"] != "timeout"
                     and "broken header" in (r["nginx_error"] or ""))

        seen = lab.proxy_log("node2").count(VIPS_IN_FORCE)
        raw = lab.spec.to_dict()
        raw["loadBalancer"]["ipMode"] = "Proxy"
        lab.apply(raw)
        applied = _wait_vips_applied(lab, "node2", seen)
        ingress = lab.service("default/ingress")["status"]["loadBalancer"]["ingress"]
        say.step(f"kpx lab apply: status.loadBalancer.ingress is now {ingress}"
                 + ("" if applied else say.c(" (node2 did not confirm it)", "red")))
        facts["proxy"] = r = _ingress_call(say, lab, "c2", timeout)
        claims.check("with ipMode: Proxy, the same call goes through the LB and nginx sees "
                     "pod c2's IP in the PROXY header",
                     applied and r["status"] == 200 and r["proxy_ip"] == c2
                     and r["client_ip"] == c2 and r["peer_ip"] == LB_NODE_IP)
    facts["claims"], facts["ok"] = claims.items, claims.ok
    return facts


DEMOS: dict[str, Callable[..., dict[str, Any]]] = {
    "local-drop": local_drop,
    "healthcheck": healthcheck,
    "source-ip": source_ip,
    "internal-local": internal_local,
    "proxy-protocol": proxy_protocol,
    "tcp-healthcheck": tcp_healthcheck,
}


# ---------------------------------------------------------------- the command


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("demo", nargs="?", default="all", choices=[*DEMOS, "all"],
                        help="which demo to run (default: all)")
    parser.add_argument("--keep", action="store_true",
                        help="leave each demo's lab up afterwards (remove with kpx lab down)")
    parser.add_argument("--prefix", default=DEFAULT_PREFIX,
                        help=f"namespace prefix; demos append 1, 2, 3 (default {DEFAULT_PREFIX})")
    parser.add_argument("--timeout", type=float, default=REQUEST_TIMEOUT,
                        help=f"client connect/answer timeout in seconds ({REQUEST_TIMEOUT})")


def run(args: argparse.Namespace) -> int:
    if getattr(args, "verbose", 1) <= 1:
        # The narration is the output; the lab's own progress lines would interleave.
        logging.getLogger("kpx.lab").setLevel(logging.WARNING)
        logging.getLogger("kpx.lb").setLevel(logging.WARNING)
    from lab.common import interrupt_on_termination

    interrupt_on_termination()
    say = Narrator()
    chosen = list(DEMOS) if args.demo == "all" else [args.demo]
    results: list[tuple[str, bool]] = []
    for i, name in enumerate(DEMOS, start=1):
        if name not in chosen:
            continue
        try:
            facts = DEMOS[name](prefix=f"{args.prefix}{i}", keep=args.keep, timeout=args.timeout)
            results.append((name, bool(facts["ok"])))
        except Exception as e:  # a broken lab is a failed demo, not a traceback wall
            say.line(say.c(f"  {name} could not run: {type(e).__name__}: {e}", "red", "bold"))
            results.append((name, False))
    say.line()
    for name, ok in results:
        say.line(f"  {say.c('PASS', 'green', 'bold') if ok else say.c('FAIL', 'red', 'bold')}  "
                 f"{name}")
    return 0 if all(ok for _, ok in results) else 1
