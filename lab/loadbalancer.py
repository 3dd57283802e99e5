"""The lab's external load balancer: what a cloud L4 LB does, in its own namespace.

Owns: the ``loadBalancer`` section of a lab file (its defaults and meaning),
health-checking every node, choosing which nodes get new connections, the
nftables table ``ip kpx_lb`` inside the lab's ``<prefix>-lb`` namespace
(passthrough mode), the asyncio TCP proxy and its PROXY protocol header
(proxy mode), and the probe-state file ``<run_dir>/lb-status.json`` that
``kpx lab status`` prints.

Never: touch any namespace but the LB's own (the daemon runs inside it via
``ip netns exec`` and every ``nft`` call inherits that namespace), send
traffic anywhere but the lab's node addresses, or decide anything about
Kubernetes semantics. The LB knows nodes, ports and probe answers, exactly
as much as a cloud LB knows; whether a node *should* answer is kpx's job.

Theory of operation:

- One daemon per lab: ``python -m lab.loadbalancer --config <run_dir>/lb.json``,
  started by ``start(lab)`` in the LB namespace in its own session, so it
  outlives ``kpx lab up``. ``LoadBalancerHandle.stop()`` (called by lab
  teardown) ends it by pid.
- One probe task per node, sequential, so a node never has two probes in
  flight: probe, record, sleep out the rest of the interval. A result moves
  the node's state only through the pure ``observe()``: ``initial`` becomes
  ``healthy`` after ``healthyThreshold`` consecutive passes and ``unhealthy``
  after ``unhealthyThreshold`` consecutive failures, and a decided node flips
  only after that many contrary results in a row, as GCP/AWS health checks
  count them.
- The serving set is the healthy nodes, in spec order. If no node is healthy
  the LB **fails open** to every node, as GCP's passthrough NLB and AWS's NLB
  do: sending traffic to possibly broken backends beats blackholing a whole
  service because its health check is misconfigured. ``failOpen`` in the
  status file says when that is happening.
- passthrough: a DNAT to ``numgen inc mod N map {i : nodeIP . nodePort}``. The
  client's IP reaches the node, and since nodes route the client network back
  via the LB, conntrack un-DNATs the replies. When the serving set changes the
  rule is flushed and re-added in one ``nft -f -`` transaction, so no packet
  ever sees a half-written rule. ``numgen inc`` is a per-rule counter that
  advances once per new connection (nat chains only see a connection's first
  packet), which is what makes the round-robin deterministic. Per-node named
  counters in the nat postrouting chain count the client connections each
  node got: only those whose conntrack original destination is the front, so
  the LB's own probes (which a TCP check on the nodePort sends to exactly
  ``nodeIP:nodePort``) are never counted.
- proxy: an asyncio server on the front address that dials nodeIP:nodePort
  from the LB (the node sees 10.77.0.2), optionally prefixed with a PROXY v1
  or v2 header, and relays both directions with half-close.
- ``lb-status.json`` is replaced atomically whenever a verdict, a probe's
  answer or the serving set changes; ``ready`` turns true once every node
  has left ``initial``, which is what ``start()`` waits for.
- ``kpx lab apply`` calls ``on_apply(lab)``: a changed nodePort,
  healthCheckNodePort or section is written to ``lb.json`` and the daemon
  reloads on SIGHUP, keeping its pid and (probe unchanged) its verdicts.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import errno
import ipaddress
import json
import logging
import os
import re
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

log = logging.getLogger("kpx.lb")

Mode = Literal["passthrough", "proxy"]
ProxyProtocol = Literal["none", "v1", "v2"]
ProbeType = Literal["http", "tcp"]
HealthState = Literal["initial", "healthy", "unhealthy"]

FRONT_IP = "10.79.0.1"
"""The LB's client-side address in the lab topology (the lab owns the address itself)."""

NFT_TABLE = "kpx_lb"
CONFIG_NAME = "lb.json"
STATUS_NAME = "lb-status.json"
LOG_NAME = "lb.log"

PROXY_HEALTH_PORT = 10256
"""kube-proxy's node /healthz: what GCP and AWS probe when a service has no
healthCheckNodePort (eTP=Cluster), so it is the fallback here too."""

DEFAULTS: dict[str, Any] = {
    "mode": "passthrough",
    "proxyProtocol": "none",
    "port": 80,
    "connectTimeout": 2.0,
    "probe": {
        "type": "http",
        "port": "healthCheckNodePort",
        "path": "/healthz",
        "interval": 1.0,
        "timeout": 1.0,
        "healthyThreshold": 1,
        "unhealthyThreshold": 2,
    },
}
"""The meaning of an omitted field. Thresholds follow the seed stories' cloud
defaults scaled down for a lab: one pass to join, two failures to leave."""

PROXY_V2_SIGNATURE = b"\r\n\r\n\x00\r\nQUIT\n"


# ---------------------------------------------------------------- configuration


@dataclass(frozen=True, slots=True)
class Probe:
    """A resolved health check: every port is a number by now."""

    type: ProbeType
    port: int
    path: str
    interval: float
    timeout: float
    healthy_threshold: int
    unhealthy_threshold: int

    def describe(self) -> str:
        """How a person would name the check: ``HTTP GET :31234/healthz``."""
        if self.type == "http":
            return f"HTTP GET :{self.port}{self.path}"
        return f"TCP connect :{self.port}"


@dataclass(frozen=True, slots=True)
class Backend:
    name: str
    ip: str


@dataclass(frozen=True, slots=True)
class LBConfig:
    """Everything the daemon needs; written to ``lb.json`` by ``start()``."""

    service: str
    mode: Mode
    proxy_protocol: ProxyProtocol
    listen_ip: str
    port: int
    node_port: int
    probe: Probe
    backends: tuple[Backend, ...]
    status_path: str
    connect_timeout: float = 2.0

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str) -> LBConfig:
        raw = json.loads(text)
        raw["probe"] = Probe(**raw["probe"])
        raw["backends"] = tuple(Backend(**b) for b in raw["backends"])
        return cls(**raw)


def _merged(section: Mapping[str, Any] | None) -> dict[str, Any]:
    out = {k: v for k, v in DEFAULTS.items() if k != "probe"}
    out.update({k: v for k, v in (section or {}).items() if k != "probe"})
    if out.get("proxyProtocol") is None:  # the lab file spells "no header" as null
        out["proxyProtocol"] = "none"
    out["probe"] = {**DEFAULTS["probe"], **dict((section or {}).get("probe") or {})}
    return out


def resolve(
    section: Mapping[str, Any] | None,
    *,
    node_port: int,
    hc_port: int,
    backends: Sequence[Backend],
    status_path: str,
    listen_ip: str = FRONT_IP,
) -> LBConfig:
    """Apply defaults to a lab file's ``loadBalancer`` section and resolve its ports.

    Raises ``ValueError`` listing every problem at once, because whoever edits
    a lab file wants all of them. ``probe.port: healthCheckNodePort`` on a
    service without one (eTP=Cluster) means kube-proxy's node health
    ``:10256/healthz``, which is exactly what GCP and AWS fall back to.
    """
    s = _merged(section)
    p = s["probe"]
    problems: list[str] = []

    def number(where: str, value: object, *, lo: float, integer: bool = False) -> float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            problems.append(f"loadBalancer.{where}: {value!r} is not a number")
            return lo
        if integer and not isinstance(value, int):
            problems.append(f"loadBalancer.{where}: {value!r} is not an integer")
        if value < lo:
            problems.append(f"loadBalancer.{where}: {value!r} is below {lo}")
        return value

    if s["mode"] not in ("passthrough", "proxy"):
        problems.append(f"loadBalancer.mode: {s['mode']!r} is not passthrough or proxy")
    if s["proxyProtocol"] not in ("none", "v1", "v2"):
        problems.append(f"loadBalancer.proxyProtocol: {s['proxyProtocol']!r} is not none, v1 or v2")
    elif s["proxyProtocol"] != "none" and s["mode"] != "proxy":
        problems.append("loadBalancer.proxyProtocol: only proxy mode can send a PROXY header")
    port = int(number("port", s["port"], lo=1, integer=True))
    if port > 65535:
        problems.append(f"loadBalancer.port: {port} is above 65535")
    if p["type"] not in ("http", "tcp"):
        problems.append(f"loadBalancer.probe.type: {p['type']!r} is not http or tcp")
    path = str(p["path"])
    if p["type"] == "http" and not path.startswith("/"):
        problems.append(f"loadBalancer.probe.path: {path!r} does not start with /")

    raw_port = p["port"]
    if raw_port == "healthCheckNodePort":
        probe_port = hc_port or PROXY_HEALTH_PORT
    elif raw_port == "nodePort":
        probe_port = node_port
    elif isinstance(raw_port, int) and not isinstance(raw_port, bool) and 0 < raw_port < 65536:
        probe_port = raw_port
    else:
        problems.append(
            f"loadBalancer.probe.port: {raw_port!r} is not healthCheckNodePort, nodePort "
            "or a port number"
        )
        probe_port = 0
    interval = number("probe.interval", p["interval"], lo=0.05)
    timeout = number("probe.timeout", p["timeout"], lo=0.05)
    healthy = int(number("probe.healthyThreshold", p["healthyThreshold"], lo=1, integer=True))
    unhealthy = int(
        number("probe.unhealthyThreshold", p["unhealthyThreshold"], lo=1, integer=True)
    )
    connect_timeout = number("connectTimeout", s["connectTimeout"], lo=0.05)
    if not node_port:
        problems.append(f"loadBalancer.service: {s.get('service')!r} has no nodePort")
    if not backends:
        problems.append("loadBalancer: the lab has no nodes to balance over")
    if problems:
        raise ValueError("; ".join(problems))
    return LBConfig(
        service=str(s.get("service", "")),
        mode=s["mode"],
        proxy_protocol=s["proxyProtocol"],
        listen_ip=listen_ip,
        port=port,
        node_port=node_port,
        probe=Probe(
            type=p["type"],
            port=probe_port,
            path=path,
            interval=float(interval),
            timeout=float(timeout),
            healthy_threshold=healthy,
            unhealthy_threshold=unhealthy,
        ),
        backends=tuple(backends),
        status_path=status_path,
        connect_timeout=float(connect_timeout),
    )


# ---------------------------------------------------------------- pure logic


@dataclass(frozen=True, slots=True)
class Health:
    """One node's probe state. ``passes``/``fails`` are the current streaks."""

    state: HealthState = "initial"
    passes: int = 0
    fails: int = 0

    @property
    def healthy(self) -> bool:
        return self.state == "healthy"


def observe(h: Health, ok: bool, healthy_threshold: int, unhealthy_threshold: int) -> Health:
    """Fold one probe result into a node's state (pure: the daemon and tests share it).

    Only *consecutive* results count: one pass resets the failure streak and
    vice versa, so a flapping node never crosses a threshold of 2. A node
    leaves ``initial`` on whichever threshold it reaches first.
    """
    passes, fails = (h.passes + 1, 0) if ok else (0, h.fails + 1)
    state = h.state
    if ok and state != "healthy" and passes >= healthy_threshold:
        state = "healthy"
    elif not ok and state != "unhealthy" and fails >= unhealthy_threshold:
        state = "unhealthy"
    return Health(state, passes, fails)


def serving(
    backends: Sequence[Backend], health: Mapping[str, Health]
) -> tuple[list[Backend], bool]:
    """The nodes that get new connections, and whether that is the fail-open set.

    Healthy nodes in spec order; if there are none, every node (fail open, as
    GCP and AWS network LBs do), flagged so status and demos can say so.
    """
    up = [b for b in backends if health.get(b.name, Health()).healthy]
    if up:
        return up, False
    return list(backends), True


def proxy_header(version: ProxyProtocol, src: tuple[str, int], dst: tuple[str, int]) -> bytes:
    """The PROXY protocol header announcing ``src`` (the client) and ``dst`` (the LB front).

    v1 is the text line of haproxy's proxy-protocol.txt section 2.1; v2 is the
    binary form (section 2.2): the 12-byte signature, version 2 + PROXY
    command (0x21), TCP over IPv4 (0x11), then a 12-byte address block. IPv6
    addresses get the TCP6 / 0x21-family forms.
    """
    if version == "none":
        return b""
    s_ip, d_ip = ipaddress.ip_address(src[0]), ipaddress.ip_address(dst[0])
    v6 = s_ip.version == 6 or d_ip.version == 6
    if v6:
        s_ip, d_ip = (
            ipaddress.IPv6Address(f"::ffff:{a}") if a.version == 4 else a for a in (s_ip, d_ip)
        )
    if version == "v1":
        family = "TCP6" if v6 else "TCP4"
        return f"PROXY {family} {s_ip} {d_ip} {src[1]} {dst[1]}\r\n".encode("ascii")
    if version == "v2":
        addresses = s_ip.packed + d_ip.packed + struct.pack("!HH", src[1], dst[1])
        fam = 0x21 if v6 else 0x11
        return PROXY_V2_SIGNATURE + struct.pack("!BBH", 0x21, fam, len(addresses)) + addresses
    raise ValueError(f"unknown PROXY protocol version {version!r}")


def counter_name(node: str) -> str:
    """An nft object name for a node's counter (nft names are identifiers)."""
    return "n_" + re.sub(r"[^A-Za-z0-9_]", "_", node)


def nft_dnat_rule(cfg: LBConfig, targets: Sequence[Backend]) -> str:
    """The one passthrough rule: round-robin DNAT of the front over ``targets``."""
    elements = ", ".join(f"{i} : {b.ip} . {cfg.node_port}" for i, b in enumerate(targets))
    return (
        f"add rule ip {NFT_TABLE} prerouting ip daddr {cfg.listen_ip} tcp dport {cfg.port} "
        f"dnat ip to numgen inc mod {len(targets)} map {{ {elements} }}"
    )


def nft_front_match(cfg: LBConfig) -> str:
    """Matches a connection that was opened to the LB's front (before the DNAT).

    ``proto-dst`` needs a layer-4 context, so it goes after a ``tcp`` match.
    """
    return f"ct original ip daddr {cfg.listen_ip} ct original proto-dst {cfg.port}"


def nft_ruleset(cfg: LBConfig, targets: Sequence[Backend]) -> str:
    """The whole table, replacing any previous one in the same transaction.

    ``table`` + ``delete table`` first makes it idempotent (a restarted daemon
    or a crashed one's leftovers). The postrouting counters are per node and
    only see each connection's first packet, so they count connections.

    They count only connections a client made to the *front* (conntrack's
    original destination is ``listen_ip:port``): the LB's own health checks
    leave this namespace through the same postrouting hook, and a TCP check
    on the nodePort (``probe.port: nodePort``) goes to exactly
    ``nodeIP:nodePort``, so matching the post-DNAT address alone would count
    every probe as a connection the node "got".
    """
    counters = "\n".join(f"  counter {counter_name(b.name)} {{ }}" for b in cfg.backends)
    counted = "\n".join(
        f"    ip daddr {b.ip} tcp dport {cfg.node_port} {nft_front_match(cfg)} "
        f"counter name \"{counter_name(b.name)}\""
        for b in cfg.backends
    )
    return (
        f"table ip {NFT_TABLE}\n"
        f"delete table ip {NFT_TABLE}\n"
        f"table ip {NFT_TABLE} {{\n"
        f"{counters}\n"
        "  chain prerouting {\n"
        "    type nat hook prerouting priority dstnat; policy accept;\n"
        "  }\n"
        "  chain postrouting {\n"
        "    type nat hook postrouting priority srcnat; policy accept;\n"
        f"{counted}\n"
        "  }\n"
        "}\n" + nft_dnat_rule(cfg, targets) + "\n"
    )


def nft_update(cfg: LBConfig, targets: Sequence[Backend]) -> str:
    """Swap the DNAT rule for a new serving set: flush + add, one transaction."""
    return f"flush chain ip {NFT_TABLE} prerouting\n{nft_dnat_rule(cfg, targets)}\n"


def now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


# ---------------------------------------------------------------- probes


def describe_error(exc: BaseException) -> str:
    """A probe failure as a cloud console would show it: timeout, refused, reset...

    The one namer of failed probes: the load balancer's health checks and
    ``kpx lab``'s own healthz probes use the same words.
    """
    if isinstance(exc, TimeoutError):
        return "timeout"
    if isinstance(exc, ConnectionRefusedError):
        return "refused"
    if isinstance(exc, ConnectionResetError):
        return "reset"
    if isinstance(exc, OSError) and exc.errno in (errno.EHOSTUNREACH, errno.ENETUNREACH):
        return "unreachable"
    if isinstance(exc, asyncio.IncompleteReadError | EOFError):
        return "closed without an answer"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror.lower()
    return f"error: {type(exc).__name__}: {exc}"


async def _probe_body(probe: Probe, ip: str) -> tuple[bool, str]:
    reader, writer = await asyncio.open_connection(ip, probe.port)
    try:
        if probe.type == "tcp":
            return True, "connected"
        writer.write(
            f"GET {probe.path} HTTP/1.1\r\nHost: {ip}:{probe.port}\r\n"
            "User-Agent: kpx-lab-lb/1\r\nConnection: close\r\n\r\n".encode("ascii")
        )
        await writer.drain()
        line = await reader.readline()
        parts = line.split()
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/") or not parts[1].isdigit():
            return False, "closed without an answer" if not line else "not HTTP"
        code = int(parts[1])
        return code == 200, f"HTTP {code}"
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


async def probe_once(probe: Probe, ip: str) -> tuple[bool, str]:
    """One health check against one node: (passed, what was seen).

    The whole exchange, connect included, is bounded by ``probe.timeout``:
    cloud checks count a slow answer as a failure just like no answer. Only
    HTTP 200 passes (as GCP's and the kube-proxy e2e helper's checks), so a
    503 from a healthCheckNodePort is a failure even though the port is open.
    """
    try:
        return await asyncio.wait_for(_probe_body(probe, ip), probe.timeout)
    except (OSError, TimeoutError, EOFError, asyncio.IncompleteReadError) as e:
        return False, describe_error(e)


# ---------------------------------------------------------------- the daemon


@dataclass(slots=True)
class NodeStatus:
    """What the LB knows about one node: its verdict, the last probe's answer, and when.

    ``since`` moves only when the verdict changes (what a cloud console shows
    as "healthy since"); ``checked`` on every probe.
    """

    backend: Backend
    health: Health = field(default_factory=Health)
    result: str = "pending"
    since: str = field(default_factory=now_iso)
    checked: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.backend.name,
            "ip": self.backend.ip,
            "healthy": self.health.healthy,
            "state": self.health.state,
            "result": self.result,
            "since": self.since,
            "checked": self.checked,
            "passes": self.health.passes,
            "fails": self.health.fails,
        }


class LoadBalancer:
    """The running LB: probe tasks, the serving set, and one of the two dataplanes."""

    def __init__(self, cfg: LBConfig, carry: Mapping[str, NodeStatus] | None = None) -> None:
        """*carry*: the previous incarnation's node states (a SIGHUP reload).

        A node keeps its verdict across a reload if its address and the probe
        are unchanged, so reconfiguring never re-opens the fail-open window
        of a cold start.
        """
        self.cfg = cfg
        self.nodes = {b.name: NodeStatus(b) for b in cfg.backends}
        for name, old in (carry or {}).items():
            if name in self.nodes and old.backend == self.nodes[name].backend:
                self.nodes[name] = dataclasses.replace(old)
        self.targets, self.fail_open = serving(
            cfg.backends, {n: st.health for n, st in self.nodes.items()}
        )
        self._rr = 0
        self._server: asyncio.Server | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._relays: set[asyncio.Task[None]] = set()
        self._nft_lock = asyncio.Lock()
        self.error: str | None = None
        self.started = now_iso()

    @property
    def front_address(self) -> tuple[str, int]:
        """Where proxy mode actually listens (tests run it on port 0 on loopback)."""
        if self._server is not None and self._server.sockets:
            host, port = self._server.sockets[0].getsockname()[:2]
            return str(host), int(port)
        return self.cfg.listen_ip, self.cfg.port

    # -- status file

    def status_doc(self) -> dict[str, Any]:
        cfg = self.cfg
        return {
            "pid": os.getpid(),
            "running": True,
            "started": self.started,
            "updated": now_iso(),
            "service": cfg.service,
            "mode": cfg.mode,
            "proxyProtocol": cfg.proxy_protocol,
            "front": f"{cfg.listen_ip}:{cfg.port}",
            "nodePort": cfg.node_port,
            "probe": cfg.probe.describe(),
            "ready": all(n.health.state != "initial" for n in self.nodes.values()),
            "serving": [b.name for b in self.targets],
            "failOpen": self.fail_open,
            "error": self.error,
            "nodes": [n.as_dict() for n in self.nodes.values()],
        }

    def write_status(self, running: bool = True) -> None:
        """Atomically replace the status file: a reader never sees half a JSON."""
        doc = self.status_doc()
        doc["running"] = running
        _write_atomic(Path(self.cfg.status_path), json.dumps(doc, indent=2) + "\n")

    # -- dataplanes

    async def _nft(self, script: str) -> None:
        proc = await asyncio.create_subprocess_exec(
            "nft", "-f", "-",
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        )
        _out, err = await proc.communicate(script.encode())
        if proc.returncode != 0:
            raise RuntimeError(f"nft failed ({proc.returncode}): {err.decode().strip()}")

    async def _apply_targets(self, first: bool = False) -> None:
        names = ", ".join(b.name for b in self.targets)
        why = " (fail open: no node passes)" if self.fail_open else ""
        log.info("serving set: %s%s", names, why)
        if self.cfg.mode != "passthrough":
            return
        script = (nft_ruleset if first else nft_update)(self.cfg, self.targets)
        async with self._nft_lock:
            try:
                await self._nft(script)
                self.error = None
            except (RuntimeError, OSError) as e:
                self.error = str(e)
                log.error("%s", e)

    def pick(self) -> Backend:
        """Proxy mode's round-robin over the current serving set."""
        targets = self.targets
        backend = targets[self._rr % len(targets)]
        self._rr += 1
        return backend

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One proxied connection: dial the next node, announce the client, relay.

        No retry on another node when the dial fails: a proxying cloud LB
        would, but then a dropped SYN on a podless node (the thing these labs
        exist to show) would be hidden behind a slow success. The client gets
        an RST instead, once ``connectTimeout`` has passed (or at once on a
        refusal).
        """
        backend = self.pick()
        peer = writer.get_extra_info("peername")
        front = writer.get_extra_info("sockname")
        try:
            up_reader, up_writer = await asyncio.wait_for(
                asyncio.open_connection(backend.ip, self.cfg.node_port), self.cfg.connect_timeout
            )
        except (OSError, TimeoutError) as e:
            log.info("%s:%s -> %s: %s", peer[0], peer[1], backend.name, describe_error(e))
            _reset(writer)
            return
        header = proxy_header(self.cfg.proxy_protocol, peer[:2], front[:2])
        if header:
            up_writer.write(header)
        await asyncio.gather(_pump(reader, up_writer), _pump(up_reader, writer))
        for w in (writer, up_writer):
            w.close()

    def _track(self, task: asyncio.Task[None]) -> None:
        self._relays.add(task)
        task.add_done_callback(self._relays.discard)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._track(task)
        try:
            await self._handle(reader, writer)
        except Exception:  # one broken relay must never take the LB down
            log.exception("relay failed")
            _reset(writer)

    # -- probing

    async def _probe_loop(self, node: NodeStatus, changed: asyncio.Event) -> None:
        probe = self.cfg.probe
        while True:
            started = time.monotonic()
            ok, text = await probe_once(probe, node.backend.ip)
            before = node.health
            node.health = observe(
                before, ok, probe.healthy_threshold, probe.unhealthy_threshold
            )
            node.checked = now_iso()
            if node.health.state != before.state:
                node.since = node.checked
                log.info(
                    "%s %s: %s -> %s (%s)",
                    node.backend.name, node.backend.ip, before.state, node.health.state, text,
                )
                changed.set()
            elif text != node.result:
                changed.set()
            node.result = text
            await asyncio.sleep(max(0.0, started + probe.interval - time.monotonic()))

    async def run(self, stop: asyncio.Event, reload: asyncio.Event | None = None) -> None:
        """Probe and serve until *stop* (final: the table goes) or *reload* is set.

        On a reload the nft table stays in place: the next incarnation's first
        ruleset replaces it in one transaction, so no packet sees a gap.
        """
        cfg = self.cfg
        log.info(
            "LB for %s: %s on %s:%s -> nodes:%s, probe %s every %.2fs (timeout %.2fs, "
            "healthy %d, unhealthy %d)",
            cfg.service, cfg.mode, cfg.listen_ip, cfg.port, cfg.node_port,
            cfg.probe.describe(), cfg.probe.interval, cfg.probe.timeout,
            cfg.probe.healthy_threshold, cfg.probe.unhealthy_threshold,
        )
        await self._apply_targets(first=True)
        if cfg.mode == "proxy":
            self._server = await asyncio.start_server(
                self._accept, cfg.listen_ip, cfg.port, reuse_address=True
            )
        self.write_status()
        changed = asyncio.Event()
        self._tasks = [
            asyncio.create_task(self._probe_loop(n, changed), name=f"probe-{n.backend.name}")
            for n in self.nodes.values()
        ]
        reload = reload or asyncio.Event()
        stoppers = {asyncio.create_task(stop.wait()), asyncio.create_task(reload.wait())}
        try:
            while not stop.is_set() and not reload.is_set():
                waiter = asyncio.create_task(changed.wait())
                await asyncio.wait(
                    {waiter, *stoppers, *self._tasks}, return_when=asyncio.FIRST_COMPLETED
                )
                waiter.cancel()
                for t in self._tasks:
                    if t.done() and not t.cancelled() and t.exception() is not None:
                        raise t.exception()  # type: ignore[misc]
                if changed.is_set():
                    changed.clear()
                    targets, fail_open = serving(
                        cfg.backends, {n: s.health for n, s in self.nodes.items()}
                    )
                    if targets != self.targets:
                        self.targets, self.fail_open = targets, fail_open
                        await self._apply_targets()
                    elif fail_open != self.fail_open:
                        # Same nodes, different reason (e.g. the last healthy node left
                        # and fail-open restored everyone): no rule change, so the
                        # round-robin position is kept.
                        self.fail_open = fail_open
                        log.info("fail open: %s", fail_open)
                    self.write_status()
        finally:
            for t in stoppers:
                t.cancel()
            await self.close(final=stop.is_set() or not reload.is_set())

    async def close(self, final: bool = True) -> None:
        """Stop probing and accepting; *final* also ends relays and removes the table."""
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._server is not None:
            self._server.close()
        if not final:
            return  # established proxy relays finish on their own
        for t in list(self._relays):
            t.cancel()
        if self.cfg.mode == "passthrough":
            with contextlib.suppress(RuntimeError, OSError):
                await self._nft(f"table ip {NFT_TABLE}\ndelete table ip {NFT_TABLE}\n")
        with contextlib.suppress(OSError):
            self.write_status(running=False)


def _reset(writer: asyncio.StreamWriter) -> None:
    """Abort with RST (SO_LINGER 0): the client learns at once that nothing is behind."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Copy one direction until EOF, then pass the EOF on (half-close, not close).

    HTTP/1.0 clients and ``WHO`` style protocols send their request, shut
    down their write side and still expect the answer; closing both ways at
    the first EOF (as kube-proxy's old userspace proxy did) would cut it off.
    """
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except (OSError, RuntimeError):
        writer.transport.abort()


async def serve(config_path: Path) -> int:
    """The daemon: run, and on SIGHUP re-read *config_path* and carry on with it.

    A config that fails to load is logged and the running one stays, so a
    bad edit never takes the LB down.
    """
    loop = asyncio.get_running_loop()
    stop, reload = asyncio.Event(), asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGHUP, reload.set)
    cfg = LBConfig.from_json(config_path.read_text())
    carry: dict[str, NodeStatus] | None = None
    while True:
        lb = LoadBalancer(cfg, carry)
        await lb.run(stop, reload)
        if stop.is_set():
            break
        reload.clear()
        try:
            new = LBConfig.from_json(config_path.read_text())
        except (OSError, ValueError, TypeError, KeyError) as e:
            log.error("reload: cannot read %s (%s); keeping the running config", config_path, e)
            new = cfg
        # The resolved probe names its port, so a check on the nodePort changes
        # with it; a new nodePort alone keeps every verdict (no fail-open window).
        same_probe = new.probe == cfg.probe
        log.info("reload: %s", "config unchanged" if new == cfg else "new config")
        carry, cfg = (lb.nodes if same_probe else None), new
    log.info("stopped")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m lab.loadbalancer",
        description="the kpx lab's external L4 load balancer (runs inside the LB namespace)",
    )
    parser.add_argument("--config", type=Path, required=True, help="lb.json written by start()")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s lb: %(message)s", stream=sys.stderr
    )
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a declared dependency
        return asyncio.run(serve(args.config))
    return uvloop.run(serve(args.config))


# ---------------------------------------------------------------- the lab's side


@dataclass(slots=True)
class LoadBalancerHandle:
    """What lab teardown holds: the daemon's pid, its config and how to end it."""

    pid: int
    config: LBConfig
    namespace: str
    run_dir: Path

    def alive(self) -> bool:
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return _not_zombie(self.pid)

    def wait_ready(self, timeout: float) -> dict[str, Any]:
        """Block until every node has a decided probe state (or raise).

        Deterministic tests and demos need this: before the first decisions
        the LB fails open to every node.
        """
        deadline = time.monotonic() + timeout
        doc: dict[str, Any] = {}
        while time.monotonic() < deadline:
            if not self.alive():
                log_path = self.run_dir / "logs" / LOG_NAME
                raise RuntimeError(f"the load balancer (pid {self.pid}) exited; see {log_path}")
            doc = read_status(self.run_dir)
            if doc.get("pid") == self.pid and doc.get("error"):
                # e.g. nft missing: the probes would run but no packet would be forwarded.
                raise RuntimeError(f"the load balancer cannot forward: {doc['error']}")
            if doc.get("ready") and doc.get("pid") == self.pid:
                return doc
            time.sleep(0.05)
        raise TimeoutError(f"the load balancer was not ready within {timeout:.1f}s: {doc}")

    def stop(self, timeout: float = 5.0) -> None:
        """SIGTERM the daemon's process group, then SIGKILL; idempotent."""
        stop_pid(self.pid, timeout)


def _not_zombie(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[0] != "Z"


def stop_pid(pid: int, timeout: float = 5.0) -> None:
    """End an LB daemon by pid (also usable by ``kpx lab down`` after a crash).

    It was started with ``start_new_session``, so its pid is its process
    group: the ``ip netns exec`` wrapper execs python, nothing else is in it.
    """
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, sig)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)
            if not _not_zombie(pid):
                return
            time.sleep(0.05)


def _section(lab: Any) -> Mapping[str, Any] | None:
    """The lab file's ``loadBalancer`` mapping, however the spec object carries it."""
    spec = getattr(lab, "spec", None)
    for name in ("load_balancer", "loadBalancer", "loadbalancer", "lb"):
        value = getattr(spec, name, None)
        if value is not None:
            if dataclasses.is_dataclass(value) and not isinstance(value, type):
                value = dataclasses.asdict(value)
            return value if isinstance(value, Mapping) else None
    raw = getattr(spec, "raw", None)
    if isinstance(raw, Mapping):
        return raw.get("loadBalancer")
    return None


def _node_names(lab: Any) -> list[str]:
    return [n if isinstance(n, str) else str(n.name) for n in lab.nodes]


def config_for(lab: Any, section: Mapping[str, Any] | None = None) -> LBConfig:
    """Resolve the LB for a running lab: its nodes, the service's ports, the section."""
    section = _section(lab) if section is None else section
    if not section:
        raise ValueError("the lab has no loadBalancer section")
    service = str(section.get("service") or "")
    if not service:
        raise ValueError("loadBalancer.service: which service does it front? (ns/name)")
    backends = [Backend(name, str(lab.node_ip(name))) for name in _node_names(lab)]
    return resolve(
        section,
        node_port=int(lab.node_port(service) or 0),
        hc_port=int(lab.hc_port(service) or 0),
        backends=backends,
        status_path=str(Path(lab.run_dir) / STATUS_NAME),
    )


def start(
    lab: Any, section: Mapping[str, Any] | None = None, ready_timeout: float | None = None
) -> LoadBalancerHandle:
    """Start the LB daemon inside the lab's LB namespace and wait for its first verdicts.

    ``section`` overrides the lab file's (demos and tests use it to try other
    probes on the same lab). A previous daemon's status file is removed first
    so readiness is judged on this one's probes.
    """
    cfg = config_for(lab, section)
    run_dir = Path(lab.run_dir)
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    config_path = run_dir / CONFIG_NAME
    _write_atomic(config_path, cfg.to_json() + "\n")
    with contextlib.suppress(FileNotFoundError):
        (run_dir / STATUS_NAME).unlink()
    namespace = str(lab.ns("lb"))
    env = dict(os.environ)
    project_root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [project_root, env.get("PYTHONPATH")]))
    with open(run_dir / "logs" / LOG_NAME, "ab") as logf:
        proc = subprocess.Popen(
            ["ip", "netns", "exec", namespace, sys.executable, "-m", "lab.loadbalancer",
             "--config", str(config_path)],
            stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT,
            start_new_session=True, env=env, cwd=project_root,
        )
    handle = LoadBalancerHandle(proc.pid, cfg, namespace, run_dir)
    p = cfg.probe
    rounds = max(p.healthy_threshold, p.unhealthy_threshold) + 1
    budget = 5.0 + rounds * max(p.interval, p.timeout)
    if ready_timeout is not None:
        budget = ready_timeout
    try:
        handle.wait_ready(budget)
    except BaseException:
        handle.stop()
        raise
    return handle


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def on_apply(lab: Any) -> None:
    """Lab hook after ``kpx lab apply``: follow changed ports, nodes or LB section.

    A service switched to another nodePort or healthCheckNodePort (or an
    edited ``loadBalancer`` section) would otherwise leave the LB probing and
    forwarding to stale ports. The new config is written and the daemon told
    with SIGHUP; it keeps its pid (which the lab has recorded) and, when the
    probe is unchanged, each node's verdict.
    """
    doc = read_status(lab.run_dir)
    pid = doc.get("pid")
    if not doc.get("running") or not isinstance(pid, int) or not _not_zombie(pid):
        log.warning("lab apply: no running load balancer to reconfigure")
        return
    try:
        cfg = config_for(lab)
    except ValueError as e:
        log.error("lab apply: load balancer keeps its old config: %s", e)
        return
    path = Path(lab.run_dir) / CONFIG_NAME
    with contextlib.suppress(OSError, ValueError, TypeError, KeyError):
        if LBConfig.from_json(path.read_text()) == cfg:
            return
    _write_atomic(path, cfg.to_json() + "\n")
    os.kill(pid, signal.SIGHUP)
    log.info("lab apply: load balancer (pid %d) reconfigured", pid)


def read_status(run_dir: Path | str) -> dict[str, Any]:
    """The LB's whole status document, or ``{}`` when there is none (yet)."""
    try:
        return json.loads((Path(run_dir) / STATUS_NAME).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def status(run_dir: Path | str) -> list[dict[str, Any]]:
    """Per node: name, ip, healthy, state, result ("HTTP 503", "timeout"...), since.

    Empty when no LB runs for this run directory.
    """
    doc = read_status(run_dir)
    if not doc.get("running"):
        return []
    return list(doc.get("nodes", []))


def connection_counts(lab: Any) -> dict[str, int]:
    """How many connections the passthrough LB sent to each node (nft counters).

    Read inside the LB namespace through ``lab.run``; tests and demos diff it
    around a request to learn which node the LB chose for it.
    """
    proc = lab.run("lb", ["nft", "-j", "list", "counters", "table", "ip", NFT_TABLE])
    if proc.returncode != 0:
        return {}
    out = proc.stdout if isinstance(proc.stdout, str) else proc.stdout.decode()
    by_counter = {
        o["counter"]["name"]: int(o["counter"]["packets"])
        for o in json.loads(out).get("nftables", [])
        if "counter" in o
    }
    return {name: by_counter.get(counter_name(name), 0) for name in _node_names(lab)}


if __name__ == "__main__":
    sys.exit(main())
