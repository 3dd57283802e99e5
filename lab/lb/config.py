"""The load balancer's configuration: a lab file's ``loadBalancer`` section, resolved.

Owns: the section's defaults and meaning (``DEFAULTS``), validating it and
resolving its ports against a service (``resolve``), and ``LBConfig``, the
resolved form the daemon reads from ``lb.json``.

Never: do I/O or look at a running lab: ports and backends come in as
arguments (``lab.lb.control.config_for`` reads them off a lab).
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

Mode = Literal["passthrough", "proxy"]

ProxyProtocol = Literal["none", "v1", "v2"]

ProbeType = Literal["http", "tcp"]

FRONT_IP = "10.79.0.1"
"""The LB's client-side address in the lab topology (the lab owns the address itself)."""

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
    ip6: str = ""
    """The node's IPv6 address in a dual-stack lab ("" otherwise)."""


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
    masquerade_from: tuple[str, ...] = ()
    """Passthrough: clients in these CIDRs (the pod network) are SNATed to the LB.

    A pod that dials the front (an ipMode Proxy LB IP is not intercepted on
    its node) would otherwise get the node's reply straight over the pod
    routes, from ``nodeIP:nodePort`` instead of the front, and reset it: a
    load balancer that backends can reach hairpins this way."""

    listen_ip6: str = ""
    """The IPv6 front (a dual-stack lab's): probes and forwarding to the nodes' IPv6
    addresses, as a second, independent LB for that family. "" in an IPv4-only lab."""
    masquerade_from6: tuple[str, ...] = ()
    """``masquerade_from`` for the IPv6 front (the pods' IPv6 networks)."""
    family: int = 4
    """Which family this config serves: 4, or 6 for the view ``for_ipv6`` gives."""

    def for_ipv6(self) -> LBConfig | None:
        """The IPv6 front's own config: the same service, ports and probe over IPv6.

        The daemon runs it as a second load balancer beside the IPv4 one, so
        each family has its own verdicts and serving set, as a cloud LB's IPv6
        frontend health-checks the backends' IPv6 addresses on its own.
        None when there is no IPv6 front (or no node has an IPv6 address).
        """
        backends = tuple(Backend(b.name, b.ip6) for b in self.backends if b.ip6)
        if self.family != 4 or not self.listen_ip6 or not backends:
            return None
        return dataclasses.replace(self, listen_ip=self.listen_ip6, backends=backends,
                                   masquerade_from=self.masquerade_from6, listen_ip6="",
                                   masquerade_from6=(), family=6)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str) -> LBConfig:
        raw = json.loads(text)
        raw["probe"] = Probe(**raw["probe"])
        raw["backends"] = tuple(Backend(**b) for b in raw["backends"])
        raw["masquerade_from"] = tuple(raw.get("masquerade_from", ()))
        raw["masquerade_from6"] = tuple(raw.get("masquerade_from6", ()))
        return cls(**raw)


def _merged(section: Mapping[str, Any] | None) -> dict[str, Any]:
    out = {k: v for k, v in DEFAULTS.items() if k != "probe"}
    out.update({k: v for k, v in (section or {}).items() if k != "probe"})
    if out.get("proxyProtocol") is None:  # the lab file spells "no header" as null
        out["proxyProtocol"] = "none"
    out["probe"] = {**DEFAULTS["probe"], **dict((section or {}).get("probe") or {})}
    return out


MIN_SECONDS = 0.05
"""The shortest probe interval, probe timeout and connect timeout the LB takes."""
PROBE_PATH = re.compile(r"/[!-~]*")
"""An HTTP probe path as it goes into the request line: ASCII, no spaces, no control
bytes (anything else is percent-encoded)."""


def resolve(
    section: Mapping[str, Any] | None,
    *,
    node_port: int,
    hc_port: int,
    backends: Sequence[Backend],
    status_path: str,
    listen_ip: str = FRONT_IP,
    masquerade_from: Sequence[str] = (),
    listen_ip6: str = "",
    masquerade_from6: Sequence[str] = (),
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
    elif p["type"] == "http" and not PROBE_PATH.fullmatch(path):
        problems.append(f"loadBalancer.probe.path: {path!r} is not printable ASCII without"
                        " spaces")

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
    interval = number("probe.interval", p["interval"], lo=MIN_SECONDS)
    timeout = number("probe.timeout", p["timeout"], lo=MIN_SECONDS)
    healthy = int(number("probe.healthyThreshold", p["healthyThreshold"], lo=1, integer=True))
    unhealthy = int(
        number("probe.unhealthyThreshold", p["unhealthyThreshold"], lo=1, integer=True)
    )
    connect_timeout = number("connectTimeout", s["connectTimeout"], lo=MIN_SECONDS)
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
        masquerade_from=tuple(masquerade_from),
        listen_ip6=listen_ip6,
        masquerade_from6=tuple(masquerade_from6),
        status_path=status_path,
        connect_timeout=float(connect_timeout),
    )
