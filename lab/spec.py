"""The lab file: what a lab is made of, validated before anything is built.

Owns: parsing and validating the lab YAML (or an equivalent dict) into an
immutable :class:`LabSpec`, and the built-in default lab.

Never: touch a namespace, a socket or a process, or fill in values the API
server would (nodePorts, defaults): that is the endpoints controller's job
(``lab.controller``). Validation reports *every* problem at once, each naming
its place in the file, because a lab file is edited by hand and one
error-per-run is a miserable loop.

Lab file format
===============

.. code-block:: yaml

    nodes: 3                  # a count (names node1..nodeN) or a list of names
    cluster:                  # optional cluster-wide settings
      serviceCIDR: 10.96.0.0/16   # ClusterIPs are allocated from it (IPv4, /12 to /28)
      dualStack: false            # true: every node, pod, the client and the LB also get
                                  # an IPv6 address (fd00::/8); IPv6 ClusterIPs come from
                                  # fd00:10:96::/112 (what `kpx lab up --dual-stack` sets)
      externalIPRoutes:           # which node the router (the lb namespace) sends each
        203.0.113.10: node2       # externalIP to; an externalIP not listed goes to the
                                  # first node
      nodeIPs:                    # optional: every node's own address (a lab that mirrors
        node1: 192.168.49.2       # a cluster, ``kpx lab up --from-state``); all or none
      podCIDRs:                   # with nodeIPs: the networks each node routes to its pods
        node1: [10.244.0.0/24]    # (its spec.podCIDRs, or /32s of the pods it hosts)
      nodeFields:                 # optional: what a node's v1 Node object also carries
        node1:                    # (kpx reads them: zone labels, and a node being deleted
          labels: {topology.kubernetes.io/zone: zone-a}   # fails its /healthz, KEP-3836)
          taints: [{key: ToBeDeletedByClusterAutoscaler, effect: NoSchedule}]
          deletionTimestamp: "2024-05-02T11:00:00Z"
    pods:
      - name: web-1           # unique; also names the pod's network namespace
        node: node1           # one of the nodes
        labels: {app: web}    # matched by Service selectors (string values)
        port: 8080            # the echo server's container port (default 8080)
        portName: http        # optional: containerPort name, for named targetPorts
        ready: true           # optional, default true (false = failing readiness)
        namespace: default    # optional Kubernetes namespace, default "default"
        image: echo           # optional: echo (default, lab.echo) | nginx (Debian's nginx,
                              # answering JSON with the client address it believes)
        proxyProtocol: false  # nginx only: listen with proxy_protocol, trusting the LB
        ip: 10.244.0.5        # only with cluster.nodeIPs, and then required: the pod's
                              # address, inside its node's podCIDRs
    services:                 # real v1 Service objects, as kubectl would accept them
      - apiVersion: v1
        kind: Service
        metadata: {name: web, namespace: default}
        spec:
          type: LoadBalancer
          externalTrafficPolicy: Local
          selector: {app: web}
          ports: [{port: 80, targetPort: 8080, nodePort: 30080}]
          healthCheckNodePort: 32080      # optional: allocated when omitted
          clusterIP: 10.96.0.50           # optional: allocated from cluster.serviceCIDR
          externalIPs: [203.0.113.10]     # optional: routed by the lab to a node
          ipFamilyPolicy: PreferDualStack # optional: SingleStack | PreferDualStack |
                                          # RequireDualStack (dual-stack labs only)
          ipFamilies: [IPv4, IPv6]        # optional: [IPv6] is single-stack IPv6
          clusterIPs: [10.96.0.51, "fd00:10:96::51"]   # optional, one per family
    loadBalancer:             # optional; an external L4 LB in front of the nodes
      service: default/web    # "namespace/name" or "name" (namespace default)
      mode: passthrough       # passthrough (client IP reaches the node) | proxy
      ipMode: VIP             # the ingress ipMode the LB reports: VIP (default) | Proxy
      proxyProtocol: none     # proxy mode only: none | v1 | v2 (null means none)
      probe:
        type: http            # http | tcp
        port: healthCheckNodePort   # healthCheckNodePort | nodePort | a number; a service
                                    # without an hc port is probed on kube-proxy's :10256
        path: /healthz        # http only
        interval: 1           # seconds between probes
        timeout: 1            # seconds per probe
        healthyThreshold: 1   # consecutive passes to become healthy
        unhealthyThreshold: 2 # consecutive failures to become unhealthy

The LB itself (and the meaning of any further ``loadBalancer`` keys, such as
its front ``port``) belongs to ``lab.loadbalancer``.

Node names are DNS subdomains as Kubernetes names nodes (``ip-10-0-1-23.ec2.internal``
is fine: a node's name only ever names a namespace and a log file, never an
interface). With ``cluster.nodeIPs`` the lab takes the addresses it is given
instead of its own plan (``lab.topology`` explains the wiring); they may be
anywhere in IPv4 except the lab's own node and client networks, and must not
overlap each other or the service CIDR.

nodePorts, healthCheckNodePort and clusterIP may be omitted: the lab allocates
them deterministically, as the API server would, and keeps them across
``kpx lab apply``. Unknown keys in ``loadBalancer`` are kept untouched, so
the load balancer can grow options without this module changing.

IP families: in an IPv4-only lab every service is single-stack IPv4, and a
service that asks for IPv6 (``ipFamilies``, ``RequireDualStack``, an IPv6
clusterIP) is refused, naming the service and the field. In a dual-stack
lab a service that names neither ``ipFamilyPolicy`` nor ``ipFamilies`` gets
``PreferDualStack`` (IPv4 first): the lab's choice, so that any lab file
(and the built-in one) becomes dual-stack with ``--dual-stack`` alone. Say
``ipFamilyPolicy: SingleStack`` for an IPv4-only service, ``ipFamilies:
[IPv6]`` for an IPv6-only one. ExternalIPs stay IPv4.

The lab plays the API server, so what it would refuse is refused here, one
message per problem: a clusterIP that is not an IPv4 address, lies outside
``cluster.serviceCIDR`` (or is its network or broadcast address), or is
given to two services; ``None`` (headless) on a NodePort or LoadBalancer
service; an externalIP that is not a plain unicast IPv4 address or lies
inside one of the lab's own networks (it would be routed as that network).
A Service's ``status`` is the lab's to write (the fronted LoadBalancer
service gets ``status.loadBalancer.ingress: [{ip: <the LB front>, ipMode}]``,
from ``loadBalancer.ipMode``), so a lab file that sets one is refused rather
than silently overruled.
"""

from __future__ import annotations

import copy
import ipaddress
import os
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from lab.lb.config import MIN_SECONDS, PROBE_PATH
from lab.topology import INFRA_NETWORKS, LAB_NETWORKS, SERVICE_CIDR6

MAX_NODES = 50
MAX_PODS_PER_NODE = 200
NODE_PORT_MIN, NODE_PORT_MAX = 30000, 32767
RESERVED_NAMES = frozenset({"sw", "lb", "client"})
"""Namespace suffixes the lab itself uses; no node or pod may take them."""
DEFAULT_SERVICE_CIDR = "10.96.0.0/16"
SERVICE_CIDR_PREFIXES = (12, 28)
"""The API server refuses a service range larger than /12; below /28 the lab's
allocator (which keeps the first ten addresses for static use) has no room."""

_DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_DNS1123_SUBDOMAIN = re.compile(
    r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
MAX_NODE_NAME = 200
"""Kubernetes allows 253; a namespace is named ``<prefix>-<node>``, and a file
name (which a named network namespace is) has at most 255 bytes."""
_DNS1035_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_IANA_SVC_NAME = re.compile(r"^(?=.*[a-z])[a-z0-9]([a-z0-9-]*[a-z0-9])?$")
_LABEL_KEY = re.compile(
    r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")
_LABEL_VALUE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?$")

SERVICE_TYPES = ("ClusterIP", "NodePort", "LoadBalancer", "ExternalName")
LB_MODES = ("passthrough", "proxy")
IP_FAMILY_POLICIES = ("SingleStack", "PreferDualStack", "RequireDualStack")
IP_FAMILIES = ("IPv4", "IPv6")
DUAL_STACK_HINT = "cluster.dualStack: true, or kpx lab up --dual-stack"
PROBE_TYPES = ("http", "tcp")
IP_MODES = ("VIP", "Proxy")
POD_IMAGES = ("echo", "nginx")
PROBE_DEFAULTS: dict[str, Any] = {
    "type": "http", "port": "healthCheckNodePort", "path": "/healthz", "interval": 1,
    "timeout": 1, "healthyThreshold": 1, "unhealthyThreshold": 2,
}


class LabSpecError(ValueError):
    """A lab file is invalid. ``problems`` holds one message per problem."""

    def __init__(self, problems: list[str], source: str = "lab spec") -> None:
        self.problems = list(problems)
        self.source = source
        super().__init__(f"{source}: {len(problems)} problem(s):\n  " + "\n  ".join(problems))


@dataclass(frozen=True)
class PodSpec:
    """One pod: an echo server in its own namespace behind *node*."""

    name: str
    node: str
    labels: Mapping[str, str] = field(default_factory=dict)
    port: int = 8080
    ready: bool = True
    namespace: str = "default"
    port_name: str | None = None
    image: str = "echo"
    """What the pod runs: ``echo`` (``lab.echo``) or ``nginx`` (``lab.nginx``)."""
    proxy_protocol: bool = False
    """nginx only: expect a PROXY header and believe it when the LB sent it."""
    ip: str | None = None
    """The pod's address, given (a mirrored cluster's); None: the lab's plan picks it."""

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"name": self.name, "node": self.node, "labels": dict(self.labels),
                             "port": self.port}
        if self.image != "echo":
            d["image"] = self.image
        if self.proxy_protocol:
            d["proxyProtocol"] = True
        if not self.ready:
            d["ready"] = False
        if self.namespace != "default":
            d["namespace"] = self.namespace
        if self.port_name:
            d["portName"] = self.port_name
        if self.ip:
            d["ip"] = self.ip
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> PodSpec:
        """The inverse of ``to_dict``, for records the lab wrote itself (not validated)."""
        return cls(name=d["name"], node=d["node"], labels=dict(d.get("labels", {})),
                   port=d.get("port", 8080), ready=d.get("ready", True),
                   namespace=d.get("namespace", "default"), port_name=d.get("portName"),
                   image=d.get("image", "echo"), proxy_protocol=d.get("proxyProtocol", False),
                   ip=d.get("ip"))


@dataclass(frozen=True)
class LabSpec:
    """A validated lab: node names, pods, raw v1 Services, optional LB section.

    Services stay plain dicts (deep-copied): they are real Kubernetes objects
    and the controller fills in what the API server would.
    """

    nodes: tuple[str, ...]
    pods: tuple[PodSpec, ...] = ()
    services: tuple[dict[str, Any], ...] = ()
    load_balancer: dict[str, Any] | None = None
    service_cidr: str = DEFAULT_SERVICE_CIDR
    """``cluster.serviceCIDR``: where ClusterIPs come from (normalized, e.g. 10.96.0.0/16)."""
    external_ip_routes: Mapping[str, str] = field(default_factory=dict)
    """``cluster.externalIPRoutes``: externalIP -> node the router sends it to."""
    node_ips: Mapping[str, str] = field(default_factory=dict)
    """``cluster.nodeIPs``: node -> its given address; empty: the lab's own plan."""
    pod_cidrs: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    """``cluster.podCIDRs``: node -> the networks routed to its pods (with nodeIPs)."""
    node_fields: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    """``cluster.nodeFields``: node -> labels/taints/deletionTimestamp for its Node object."""
    dual_stack: bool = False
    """``cluster.dualStack``: everything also gets an IPv6 address (``lab.topology``)."""

    # --- construction -------------------------------------------------------

    @classmethod
    def load(cls, src: str | os.PathLike[str] | Mapping[str, Any] | LabSpec) -> LabSpec:
        """From a path to a YAML file, a dict with the file's structure, or a LabSpec."""
        if isinstance(src, LabSpec):
            return src
        if isinstance(src, Mapping):
            return cls.from_dict(src)
        path = Path(src)
        try:
            text = path.read_text()
        except OSError as exc:
            raise LabSpecError([f"cannot read: {exc.strerror}"], str(path)) from None
        return cls.from_yaml(text, str(path))

    @classmethod
    def from_yaml(cls, text: str, source: str = "lab spec") -> LabSpec:
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise LabSpecError([f"YAML syntax error: {exc}"], source) from None
        if not isinstance(data, Mapping):
            raise LabSpecError(["the file must be a mapping with nodes/pods/services"], source)
        return cls.from_dict(data, source)

    @classmethod
    def default(cls, dual_stack: bool = False) -> LabSpec:
        """The built-in lab: 3 nodes, one LoadBalancer eTP=Local service, its pod on node1.

        *dual_stack*: the same lab dual-stack; its service (which names no IP
        family) becomes ``PreferDualStack``, so it answers on both families.
        """
        text = resources.files("lab").joinpath("default.yaml").read_text()
        spec = cls.from_yaml(text, "lab/default.yaml")
        return spec.with_dual_stack() if dual_stack else spec

    def with_dual_stack(self) -> LabSpec:
        """This lab, dual-stack (``kpx lab up --dual-stack``, ``Lab(..., dual_stack=True)``)."""
        if self.dual_stack:
            return self
        raw = self.to_dict()
        raw.setdefault("cluster", {})["dualStack"] = True
        return LabSpec.from_dict(raw, "--dual-stack", check_lb_service=False)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], source: str = "lab spec",
                  check_lb_service: bool = True) -> LabSpec:
        """Validate a lab file's structure; ``check_lb_service`` also checks references.

        With ``check_lb_service`` false (a running lab's own edits, which may
        delete a service first), ``loadBalancer.service`` and
        ``cluster.externalIPRoutes`` may name something no service has.
        """
        problems: list[str] = []
        unknown = set(data) - {"nodes", "pods", "services", "loadBalancer", "cluster"}
        problems += [f"{k}: unknown top-level key (expected nodes, cluster, pods, services,"
                     " loadBalancer)" for k in sorted(map(str, unknown))]
        nodes = _parse_nodes(data.get("nodes", 3), problems)
        cidr, routes = _parse_cluster(data.get("cluster"), nodes, problems)
        node_ips, pod_cidrs = _parse_addresses(data.get("cluster"), nodes, cidr, problems)
        dual_stack = _parse_dual_stack(data.get("cluster"), bool(node_ips), problems)
        node_fields = _parse_node_fields(data.get("cluster"), nodes, problems)
        pods = _parse_pods(data.get("pods") or [], nodes, problems)
        _check_pod_ips(pods, node_ips, pod_cidrs, problems)
        services = _parse_services(data.get("services") or [], problems, cidr, dual_stack)
        lb = _parse_lb(data.get("loadBalancer"), services, problems, check_lb_service)
        if check_lb_service:
            listed = {ip for svc in services for ip in svc["spec"].get("externalIPs") or []}
            problems += [f"cluster.externalIPRoutes.{ip}: no service lists this externalIP"
                         for ip in routes if ip not in listed]
        if problems:
            raise LabSpecError(problems, source)
        return cls(tuple(nodes), tuple(pods), tuple(services), lb,
                   str(cidr) if cidr else DEFAULT_SERVICE_CIDR, routes, node_ips, pod_cidrs,
                   node_fields, dual_stack)

    @classmethod
    def from_record(cls, data: Mapping[str, Any], source: str = "lab spec"
                    ) -> tuple[LabSpec, tuple[str, ...]]:
        """A running lab's recorded spec, for a command that only reads it; and what it refused.

        The ``loadBalancer`` section is the part whose bounds follow the load
        balancer's own (``MIN_SECONDS``, ``PROBE_PATH``), so a record written
        by a kpx that took looser values, or edited by hand, may hold one this
        kpx refuses. If the section is all that is refused, the spec comes back
        without it, with the problems naming each refused field; any other
        problem raises as ``from_dict`` does. References are not checked
        (``check_lb_service=False``), as for every recorded spec.
        """
        try:
            return cls.from_dict(data, source, check_lb_service=False), ()
        except LabSpecError as exc:
            if not all(p.split(":", 1)[0].split(".", 1)[0] == "loadBalancer"
                       for p in exc.problems):
                raise
            refused = tuple(exc.problems)
        rest = {k: v for k, v in data.items() if k != "loadBalancer"}
        return cls.from_dict(rest, source, check_lb_service=False), refused

    def to_dict(self) -> dict[str, Any]:
        """The lab-file form; ``LabSpec.from_dict(spec.to_dict()) == spec``."""
        d: dict[str, Any] = {
            "nodes": list(self.nodes),
            "pods": [p.to_dict() for p in self.pods],
            "services": copy.deepcopy(list(self.services)),
        }
        if self.load_balancer is not None:
            d["loadBalancer"] = copy.deepcopy(self.load_balancer)
        cluster: dict[str, Any] = {}
        if self.service_cidr != DEFAULT_SERVICE_CIDR:
            cluster["serviceCIDR"] = self.service_cidr
        if self.dual_stack:
            cluster["dualStack"] = True
        if self.external_ip_routes:
            cluster["externalIPRoutes"] = dict(self.external_ip_routes)
        if self.node_ips:
            cluster["nodeIPs"] = dict(self.node_ips)
            cluster["podCIDRs"] = {n: list(c) for n, c in self.pod_cidrs.items()}
        if self.node_fields:
            cluster["nodeFields"] = copy.deepcopy({n: dict(f) for n, f in self.node_fields.items()})
        if cluster:
            d["cluster"] = cluster
        return d

    def revalidated(self, **changes: Any) -> LabSpec:
        """A copy with *changes*, validated again (the LB may lose its service)."""
        new = replace(self, **changes)
        return LabSpec.from_dict(new.to_dict(), check_lb_service=False)

    # --- queries --------------------------------------------------------------

    def pod(self, name: str) -> PodSpec | None:
        return next((p for p in self.pods if p.name == name), None)

    @property
    def lb_service_key(self) -> str | None:
        if not self.load_balancer:
            return None
        return service_ref(self.load_balancer["service"])

    @property
    def lb_ip_mode(self) -> str:
        """``loadBalancer.ipMode``: what the LB reports in its ingress (``VIP`` unless set)."""
        return str((self.load_balancer or {}).get("ipMode") or "VIP")

    def external_ip_node(self, ip: str) -> str:
        """The node the router sends externalIP *ip* to (``cluster.externalIPRoutes``)."""
        return self.external_ip_routes.get(ip) or self.nodes[0]


def service_key(obj: Mapping[str, Any]) -> str:
    meta = obj.get("metadata") or {}
    return f"{meta.get('namespace') or 'default'}/{meta.get('name')}"


def service_ref(ref: str) -> str:
    """``name`` or ``namespace/name`` -> ``namespace/name``."""
    return ref if "/" in ref else f"default/{ref}"


# --- validation helpers ----------------------------------------------------------


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _parse_nodes(raw: Any, problems: list[str]) -> list[str]:
    if _is_int(raw):
        if not 1 <= raw <= MAX_NODES:
            problems.append(f"nodes: must be between 1 and {MAX_NODES}, got {raw}")
            return []
        return [f"node{i}" for i in range(1, raw + 1)]
    if not isinstance(raw, list) or not raw:
        problems.append("nodes: must be a count or a non-empty list of names")
        return []
    if len(raw) > MAX_NODES:
        problems.append(f"nodes: at most {MAX_NODES} nodes")
    names: list[str] = []
    for i, n in enumerate(raw):
        where = f"nodes[{i}]"
        if not isinstance(n, str) or not _DNS1123_SUBDOMAIN.match(n) or len(n) > MAX_NODE_NAME:
            problems.append(f"{where}: {n!r} is not a valid node name (a lowercase DNS"
                            f" subdomain of at most {MAX_NODE_NAME} characters)")
        elif n in RESERVED_NAMES:
            problems.append(f"{where}: {n!r} is reserved for the lab's own namespaces")
        elif n in names:
            problems.append(f"{where}: duplicate node name {n!r}")
        else:
            names.append(n)
    return names


def _labels(raw: Any, where: str, problems: list[str]) -> dict[str, str]:
    if raw is None:
        return {}
    if not isinstance(raw, Mapping):
        problems.append(f"{where}: must be a mapping of label key to string value")
        return {}
    out: dict[str, str] = {}
    for k, v in raw.items():
        if not isinstance(k, str) or not _LABEL_KEY.match(k):
            problems.append(f"{where}.{k}: invalid label key")
        elif not isinstance(v, str):
            problems.append(f"{where}.{k}: label values must be strings (quote {v!r})")
        elif len(v) > 63 or not _LABEL_VALUE.match(v):
            problems.append(f"{where}.{k}: invalid label value {v!r}")
        else:
            out[k] = v
    return out


def _parse_cluster(raw: Any, nodes: list[str], problems: list[str]
                   ) -> tuple[ipaddress.IPv4Network | None, dict[str, str]]:
    """``cluster``: the service CIDR (None when invalid) and the externalIP routes."""
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        problems.append("cluster: must be a mapping (serviceCIDR, externalIPRoutes)")
        return None, {}
    allowed = ("dualStack", "externalIPRoutes", "nodeFields", "nodeIPs", "podCIDRs",
               "serviceCIDR")
    problems += [f"cluster.{k}: unknown key (expected {', '.join(allowed)})"
                 for k in sorted(set(map(str, raw)) - set(allowed))]
    cidr = _parse_service_cidr(raw.get("serviceCIDR", DEFAULT_SERVICE_CIDR), problems)
    routes: dict[str, str] = {}
    raw_routes = raw.get("externalIPRoutes") or {}
    if not isinstance(raw_routes, Mapping):
        problems.append("cluster.externalIPRoutes: must be a mapping of externalIP to node name")
        return cidr, routes
    for ip, node in raw_routes.items():
        where = f"cluster.externalIPRoutes.{ip}"
        if not isinstance(ip, str) or _ipv4(ip) is None:
            problems.append(f"{where}: {ip!r} is not an IPv4 address")
        elif node not in nodes:
            problems.append(_unknown_node(where, node, nodes))
        else:
            routes[str(_ipv4(ip))] = node
    return cidr, routes


def _parse_dual_stack(raw: Any, given: bool, problems: list[str]) -> bool:
    """``cluster.dualStack``: a boolean, and only for the lab's own addressing plan."""
    value = raw.get("dualStack", False) if isinstance(raw, Mapping) else False
    if not isinstance(value, bool):
        problems.append(f"cluster.dualStack: must be true or false, got {value!r}")
        return False
    if value and given:
        problems.append("cluster.dualStack: not with cluster.nodeIPs (a mirrored cluster's"
                        " addresses are IPv4; the dual-stack plan is the lab's own)")
        return False
    return value


def _unknown_node(where: str, node: object, nodes: list[str]) -> str:
    return f"{where}: unknown node {node!r} (nodes: {', '.join(nodes)})"


def _per_node(raw: Mapping[Any, Any], nodes: list[str], section: str, problems: list[str]
              ) -> Iterator[tuple[str, Any, str]]:
    """``(node, value, where)`` of each per-node entry; an unknown node is a problem."""
    for node, value in raw.items():
        where = f"{section}.{node}"
        if node in nodes:
            yield node, value, where
        else:
            problems.append(_unknown_node(where, node, nodes))


def _parse_addresses(raw: Any, nodes: list[str], cidr: ipaddress.IPv4Network | None,
                     problems: list[str]) -> tuple[dict[str, str], dict[str, tuple[str, ...]]]:
    """``cluster.nodeIPs`` and ``cluster.podCIDRs``: given addresses, all or none.

    They are what a mirrored cluster had, so they may lie anywhere in IPv4
    except where the lab itself lives (its node and client networks: the
    router's and the client's addresses) and the service CIDR; and each must
    mean one place: no address twice, no pod network overlapping another or
    holding a node's address (routing would have two answers).
    """
    raw = raw if isinstance(raw, Mapping) else {}
    raw_ips, raw_cidrs = raw.get("nodeIPs"), raw.get("podCIDRs")
    if raw_ips is None:
        if raw_cidrs is not None:
            problems.append("cluster.podCIDRs: only with cluster.nodeIPs (the lab's own plan"
                            " gives each node 10.244.<n>.0/24)")
        return {}, {}
    if not isinstance(raw_ips, Mapping):
        problems.append("cluster.nodeIPs: must be a mapping of node name to IPv4 address")
        return {}, {}
    reserved = [(what, ipaddress.ip_network(net)) for what, net in INFRA_NETWORKS.items()]
    if cidr is not None:
        reserved.append(("service CIDR", cidr))
    node_ips: dict[str, str] = {}
    owner: dict[ipaddress.IPv4Address, str] = {}
    for node, ip in raw_ips.items():
        where = f"cluster.nodeIPs.{node}"
        addr = _ipv4(ip) if isinstance(ip, str) else None
        if node not in nodes:
            problems.append(_unknown_node(where, node, nodes))
        elif addr is None:
            problems.append(f"{where}: {ip!r} is not an IPv4 address")
        elif clash := _reserved(addr, reserved):
            problems.append(f"{where}: {ip} is inside the lab's {clash}")
        elif addr in owner:
            problems.append(f"{where}: {ip} is also node {owner[addr]}'s address")
        else:
            owner[addr] = node
            node_ips[node] = str(addr)
    problems += [f"cluster.nodeIPs: node {n} has no address (give every node one, or none)"
                 for n in nodes if n not in raw_ips]
    pod_cidrs: dict[str, tuple[str, ...]] = {n: () for n in nodes}
    if raw_cidrs is not None and not isinstance(raw_cidrs, Mapping):
        problems.append("cluster.podCIDRs: must be a mapping of node name to a list of networks")
        raw_cidrs = None
    taken: list[tuple[ipaddress.IPv4Network, str]] = []
    for node, nets, where in _per_node(raw_cidrs or {}, nodes, "cluster.podCIDRs", problems):
        if not isinstance(nets, list):
            problems.append(f"{where}: must be a list of IPv4 networks")
            continue
        ok: list[str] = []
        for j, text in enumerate(nets):
            try:
                net = ipaddress.ip_network(text) if isinstance(text, str) else None
            except ValueError:
                net = None
            if not isinstance(net, ipaddress.IPv4Network):
                problems.append(f"{where}[{j}]: {text!r} is not an IPv4 network (host bits zero)")
            elif clash := next((f"{w} {n}" for w, n in reserved if net.overlaps(n)), None):
                problems.append(f"{where}[{j}]: {net} overlaps the lab's {clash}")
            elif other := next((o for n, o in taken if net.overlaps(n)), None):
                problems.append(f"{where}[{j}]: {net} overlaps a pod network of node {other}")
            elif inside := next((n for a, n in owner.items() if a in net), None):
                problems.append(f"{where}[{j}]: {net} holds node {inside}'s address")
            else:
                taken.append((net, node))
                ok.append(str(net))
        pod_cidrs[node] = tuple(ok)
    return node_ips, pod_cidrs


NODE_FIELDS = ("deletionTimestamp", "labels", "taints")
TAINT_EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")


def _parse_node_fields(raw: Any, nodes: list[str], problems: list[str]
                       ) -> dict[str, dict[str, Any]]:
    """``cluster.nodeFields``: the parts of a Node object kpx reads besides its address."""
    raw = (raw.get("nodeFields") if isinstance(raw, Mapping) else None) or {}
    if not isinstance(raw, Mapping):
        problems.append("cluster.nodeFields: must be a mapping of node name to fields")
        return {}
    out: dict[str, dict[str, Any]] = {}
    for node, fields, where in _per_node(raw, nodes, "cluster.nodeFields", problems):
        if not isinstance(fields, Mapping):
            problems.append(f"{where}: must be a mapping ({', '.join(NODE_FIELDS)})")
            continue
        before = len(problems)
        problems += [f"{where}.{k}: unknown key (expected {', '.join(NODE_FIELDS)})"
                     for k in sorted(set(map(str, fields)) - set(NODE_FIELDS))]
        _labels(fields.get("labels"), f"{where}.labels", problems)
        taints = fields.get("taints") or []
        if not isinstance(taints, list):
            problems.append(f"{where}.taints: must be a list of {{key, effect}}")
            taints = []
        for j, t in enumerate(taints):
            if (not isinstance(t, Mapping) or not isinstance(t.get("key"), str)
                    or not _LABEL_KEY.match(t["key"]) or t.get("effect") not in TAINT_EFFECTS):
                problems.append(f"{where}.taints[{j}]: needs a key (a label key) and an effect"
                                f" ({', '.join(TAINT_EFFECTS)})")
        stamp = fields.get("deletionTimestamp")
        if stamp is not None and not isinstance(stamp, str):
            problems.append(f"{where}.deletionTimestamp: must be an RFC 3339 time string")
        if len(problems) == before:
            out[node] = copy.deepcopy(dict(fields))
    return out


def _reserved(addr: ipaddress.IPv4Address,
              reserved: list[tuple[str, ipaddress.IPv4Network]]) -> str | None:
    return next((f"{what} {net}" for what, net in reserved if addr in net), None)


def _check_pod_ips(pods: list[PodSpec], node_ips: Mapping[str, str],
                   pod_cidrs: Mapping[str, tuple[str, ...]], problems: list[str]) -> None:
    """Given pod addresses: all or none (with nodeIPs), each in its node's podCIDRs, once."""
    seen: dict[str, str] = {}
    for i, p in enumerate(pods):
        where = f"pods[{i}] ({p.name}).ip"
        if not node_ips:
            if p.ip is not None:
                problems.append(f"{where}: only in a lab with cluster.nodeIPs (else the lab's"
                                " plan addresses pods)")
            continue
        if p.ip is None:
            problems.append(f"{where}: required in a lab with cluster.nodeIPs")
            continue
        addr = ipaddress.ip_address(p.ip)
        nets = pod_cidrs.get(p.node, ())
        if not any(addr in ipaddress.ip_network(n) for n in nets):
            problems.append(f"{where}: {p.ip} is not in node {p.node}'s cluster.podCIDRs"
                            f" ({', '.join(nets) or 'none'})")
        elif p.ip in seen:
            problems.append(f"{where}: {p.ip} is also pod {seen[p.ip]}'s address")
        seen.setdefault(p.ip, p.name)


def _parse_service_cidr(raw: Any, problems: list[str]) -> ipaddress.IPv4Network | None:
    where = "cluster.serviceCIDR"
    try:
        cidr = ipaddress.ip_network(raw) if isinstance(raw, str) else None
    except ValueError:
        cidr = None
    if not isinstance(cidr, ipaddress.IPv4Network):
        problems.append(f"{where}: {raw!r} is not an IPv4 network (e.g. {DEFAULT_SERVICE_CIDR};"
                        " host bits must be zero)")
        return None
    lo, hi = SERVICE_CIDR_PREFIXES
    if not lo <= cidr.prefixlen <= hi:
        problems.append(f"{where}: {cidr} must be between /{lo} and /{hi}")
        return None
    for what, net in LAB_NETWORKS.items():
        if cidr.overlaps(ipaddress.ip_network(net)):
            problems.append(f"{where}: {cidr} overlaps the lab's {what} {net}")
            return None
    return cidr


def _ipv4(text: str) -> ipaddress.IPv4Address | None:
    """A dotted-quad IPv4 address, or None (no IPv6, no leading zeros, as the API server)."""
    try:
        ip = ipaddress.ip_address(text)
    except ValueError:
        return None
    return ip if isinstance(ip, ipaddress.IPv4Address) else None


def _parse_pods(raw: Any, nodes: list[str], problems: list[str]) -> list[PodSpec]:
    if not isinstance(raw, list):
        problems.append("pods: must be a list")
        return []
    pods: list[PodSpec] = []
    seen: set[str] = set()
    per_node: dict[str, int] = {}
    allowed = {"name", "node", "labels", "port", "ready", "namespace", "portName", "image",
               "proxyProtocol", "ip"}
    for i, p in enumerate(raw):
        where = f"pods[{i}]"
        if not isinstance(p, Mapping):
            problems.append(f"{where}: must be a mapping")
            continue
        name = p.get("name")
        if isinstance(name, str):
            where = f"pods[{i}] ({name})"
        for k in sorted(set(map(str, p)) - allowed):
            problems.append(f"{where}.{k}: unknown key (expected {', '.join(sorted(allowed))})")
        before = len(problems)
        if not isinstance(name, str) or not _DNS1123_LABEL.match(name) or len(name) > 40:
            problems.append(f"{where}.name: {name!r} is not a valid pod name (lowercase DNS label"
                            ", at most 40 characters)")
        elif name in RESERVED_NAMES or name in nodes:
            problems.append(f"{where}.name: {name!r} is taken by a node or the lab itself")
        elif name in seen:
            problems.append(f"{where}.name: duplicate pod name {name!r}")
        node = p.get("node")
        if node not in nodes:
            problems.append(_unknown_node(f"{where}.node", node, nodes))
        else:
            per_node[node] = per_node.get(node, 0) + 1
            if per_node[node] > MAX_PODS_PER_NODE:
                problems.append(f"{where}.node: more than {MAX_PODS_PER_NODE} pods on {node}")
        port = p.get("port", 8080)
        if not _is_int(port) or not 1 <= port <= 65535:
            problems.append(f"{where}.port: must be a port number 1-65535, got {port!r}")
        ready = p.get("ready", True)
        if not isinstance(ready, bool):
            problems.append(f"{where}.ready: must be true or false")
        ns = p.get("namespace", "default")
        if not isinstance(ns, str) or not _DNS1123_LABEL.match(ns):
            problems.append(f"{where}.namespace: {ns!r} is not a valid namespace name")
        port_name = p.get("portName")
        if port_name is not None and (not isinstance(port_name, str)
                                      or not _IANA_SVC_NAME.match(port_name)
                                      or len(port_name) > 15):
            problems.append(f"{where}.portName: {port_name!r} is not a valid port name")
        image = p.get("image", "echo")
        if image not in POD_IMAGES:
            problems.append(f"{where}.image: {image!r} is not one of {', '.join(POD_IMAGES)}")
        proxy_protocol = p.get("proxyProtocol", False)
        if not isinstance(proxy_protocol, bool):
            problems.append(f"{where}.proxyProtocol: must be true or false")
        elif proxy_protocol and image != "nginx":
            problems.append(f"{where}.proxyProtocol: only an nginx pod takes it (the echo pod"
                            " reads a PROXY header whenever one arrives)")
        labels = _labels(p.get("labels"), f"{where}.labels", problems)
        ip = p.get("ip")
        if ip is not None and (not isinstance(ip, str) or _ipv4(ip) is None):
            problems.append(f"{where}.ip: {ip!r} is not an IPv4 address")
        if len(problems) == before:
            seen.add(name)
            pods.append(PodSpec(name=name, node=node, labels=labels, port=port, ready=ready,
                                namespace=ns, port_name=port_name, image=image,
                                proxy_protocol=proxy_protocol,
                                ip=str(_ipv4(ip)) if ip is not None else None))
    return pods


def _parse_services(raw: Any, problems: list[str],
                    cidr: ipaddress.IPv4Network | None = None,
                    dual_stack: bool = False) -> list[dict[str, Any]]:
    """Validate each Service, then what only the set can break (names, ports, clusterIPs)."""
    if not isinstance(raw, list):
        problems.append("services: must be a list of v1 Service objects")
        return []
    out: list[dict[str, Any]] = []
    keys: set[str] = set()
    node_ports: dict[tuple[int, str], str] = {}
    cluster_ips: dict[str, str] = {}
    for i, obj in enumerate(raw):
        before = len(problems)
        _validate_service(obj, i, problems, cidr, dual_stack)
        if len(problems) != before:
            continue
        key = service_key(obj)
        where = f"Service {key}"
        if key in keys:
            problems.append(f"{where}: duplicate service")
            continue
        keys.add(key)
        spec = obj.get("spec") or {}
        for j, port in enumerate(spec.get("ports") or []):
            np = port.get("nodePort")
            if np:
                proto = port.get("protocol", "TCP")
                other = node_ports.get((np, proto))
                if other:
                    problems.append(f"{where}: spec.ports[{j}].nodePort: {np}/{proto} already used"
                                    f" by {other}")
                node_ports[(np, proto)] = f"{key} port {j}"
        hc = spec.get("healthCheckNodePort")
        if hc:
            other = node_ports.get((hc, "TCP"))
            if other:
                problems.append(f"{where}: spec.healthCheckNodePort: {hc} already used by {other}")
            node_ports[(hc, "TCP")] = f"{key} healthCheckNodePort"
        for fname, ip in _given_cluster_ips(spec):
            if ip == "None":
                continue
            other = cluster_ips.get(ip)
            if other:
                problems.append(f"{where}: spec.{fname}: {ip} is already allocated to {other}")
            cluster_ips.setdefault(ip, key)
        out.append(copy.deepcopy(dict(obj)))
    return out


def _given_cluster_ips(spec: Mapping[str, Any]) -> list[tuple[str, str]]:
    """``(field, address)`` of every clusterIP a lab file asks for, in clusterIPs order."""
    out: list[tuple[str, str]] = []
    first = _given_cluster_ip(spec)
    if first is not None:
        out.append(("clusterIP" if spec.get("clusterIP") else "clusterIPs[0]", first))
    ips = spec.get("clusterIPs")
    if isinstance(ips, list):
        out += [(f"clusterIPs[{k}]", ip) for k, ip in enumerate(ips)
                if k > 0 and isinstance(ip, str) and ip]
    return out


def _given_cluster_ip(spec: Mapping[str, Any]) -> str | None:
    """The clusterIP a lab file asks for (``clusterIP``, else ``clusterIPs[0]``), or None."""
    ip = spec.get("clusterIP")
    if not ip:
        ips = spec.get("clusterIPs")
        ip = ips[0] if isinstance(ips, list) and ips else None
    return ip if isinstance(ip, str) and ip else None


def _validate_service(obj: Any, i: int, problems: list[str],
                      cidr: ipaddress.IPv4Network | None = None,
                      dual_stack: bool = False) -> None:
    """The subset of API-server validation that matters to a proxy."""
    if not isinstance(obj, Mapping):
        problems.append(f"services[{i}]: must be a v1 Service mapping")
        return
    meta = obj.get("metadata")
    name = meta.get("name") if isinstance(meta, Mapping) else None
    where = f"Service {service_key(obj)}" if isinstance(name, str) else f"services[{i}]"
    if obj.get("apiVersion") != "v1" or obj.get("kind") != "Service":
        problems.append(f"{where}: apiVersion/kind must be v1/Service")
    if not isinstance(meta, Mapping):
        problems.append(f"{where}: metadata: required")
        return
    if not isinstance(name, str) or not _DNS1035_LABEL.match(name) or len(name) > 63:
        problems.append(f"{where}: metadata.name: {name!r} is not a valid service name")
    ns = meta.get("namespace", "default")
    if not isinstance(ns, str) or not _DNS1123_LABEL.match(ns):
        problems.append(f"{where}: metadata.namespace: {ns!r} is not a valid namespace")
    _labels(meta.get("labels"), f"{where}: metadata.labels", problems)
    spec = obj.get("spec")
    if not isinstance(spec, Mapping):
        problems.append(f"{where}: spec: required")
        return
    stype = spec.get("type", "ClusterIP")
    if stype not in SERVICE_TYPES:
        problems.append(f"{where}: spec.type: must be one of {', '.join(SERVICE_TYPES)}")
    has_node_ports = stype in ("NodePort", "LoadBalancer")
    _labels(spec.get("selector"), f"{where}: spec.selector", problems)
    ports = spec.get("ports")
    if ports is None:
        ports = []
    if not isinstance(ports, list):
        problems.append(f"{where}: spec.ports: must be a list")
        ports = []
    if not ports and stype != "ExternalName" and spec.get("clusterIP") != "None":
        problems.append(f"{where}: spec.ports: at least one port is required")
    names: set[str] = set()
    seen_ports: set[tuple[int, str]] = set()
    for j, port in enumerate(ports):
        pw = f"{where}: spec.ports[{j}]"
        if not isinstance(port, Mapping):
            problems.append(f"{pw}: must be a mapping")
            continue
        pname = port.get("name", "")
        if len(ports) > 1 and not pname:
            problems.append(f"{pw}.name: required when a service has more than one port")
        if pname and (not isinstance(pname, str) or not _DNS1123_LABEL.match(pname)):
            problems.append(f"{pw}.name: {pname!r} is not a valid port name")
        elif pname in names:
            problems.append(f"{pw}.name: duplicate port name {pname!r}")
        names.add(pname)
        num = port.get("port")
        if not _is_int(num) or not 1 <= num <= 65535:
            problems.append(f"{pw}.port: must be a port number 1-65535, got {num!r}")
        proto = port.get("protocol", "TCP")
        if proto not in ("TCP", "UDP", "SCTP"):
            problems.append(f"{pw}.protocol: must be TCP, UDP or SCTP")
        if (num, proto) in seen_ports:
            problems.append(f"{pw}: duplicate port {num}/{proto}")
        seen_ports.add((num, proto))
        tp = port.get("targetPort")
        if tp is not None:
            if _is_int(tp):
                if not 1 <= tp <= 65535:
                    problems.append(f"{pw}.targetPort: must be 1-65535, got {tp}")
            elif not isinstance(tp, str) or not _IANA_SVC_NAME.match(tp) or len(tp) > 15:
                problems.append(f"{pw}.targetPort: {tp!r} is neither a number nor a port name")
        np = port.get("nodePort")
        if np is not None and np != 0:
            if not has_node_ports:
                problems.append(f"{pw}.nodePort: only NodePort and LoadBalancer services have"
                                " nodePorts")
            elif not _is_int(np) or not NODE_PORT_MIN <= np <= NODE_PORT_MAX:
                problems.append(f"{pw}.nodePort: must be in {NODE_PORT_MIN}-{NODE_PORT_MAX},"
                                f" got {np!r}")
    etp = spec.get("externalTrafficPolicy")
    if etp is not None:
        if etp not in ("Cluster", "Local"):
            problems.append(f"{where}: spec.externalTrafficPolicy: must be Cluster or Local")
        elif not has_node_ports and not spec.get("externalIPs"):
            problems.append(f"{where}: spec.externalTrafficPolicy: only for NodePort and"
                            " LoadBalancer services")
    itp = spec.get("internalTrafficPolicy")
    if itp is not None and itp not in ("Cluster", "Local"):
        problems.append(f"{where}: spec.internalTrafficPolicy: must be Cluster or Local")
    hc = spec.get("healthCheckNodePort")
    if hc is not None and hc != 0:
        if stype != "LoadBalancer" or etp != "Local":
            problems.append(f"{where}: spec.healthCheckNodePort: only for type LoadBalancer with"
                            " externalTrafficPolicy Local")
        elif not _is_int(hc) or not NODE_PORT_MIN <= hc <= NODE_PORT_MAX:
            problems.append(f"{where}: spec.healthCheckNodePort: must be in"
                            f" {NODE_PORT_MIN}-{NODE_PORT_MAX}, got {hc!r}")
    affinity = spec.get("sessionAffinity", "None")
    if affinity not in ("None", "ClientIP"):
        problems.append(f"{where}: spec.sessionAffinity: must be None or ClientIP")
    cfg = spec.get("sessionAffinityConfig")
    if cfg is not None:
        timeout = (cfg.get("clientIP") or {}).get("timeoutSeconds") if isinstance(
            cfg, Mapping) else None
        if affinity != "ClientIP":
            problems.append(f"{where}: spec.sessionAffinityConfig: only with sessionAffinity"
                            " ClientIP")
        elif timeout is not None and (not _is_int(timeout) or not 1 <= timeout <= 86400):
            problems.append(f"{where}: spec.sessionAffinityConfig.clientIP.timeoutSeconds:"
                            " must be 1-86400")
    pnra = spec.get("publishNotReadyAddresses")
    if pnra is not None and not isinstance(pnra, bool):
        problems.append(f"{where}: spec.publishNotReadyAddresses: must be true or false")
    albnp = spec.get("allocateLoadBalancerNodePorts")
    if albnp is not None and not isinstance(albnp, bool):
        problems.append(f"{where}: spec.allocateLoadBalancerNodePorts: must be true or false")
    _validate_cluster_ip(spec, stype, where, cidr, problems, dual_stack)
    _validate_families(spec, stype, where, dual_stack, problems)
    _validate_external_ips(spec.get("externalIPs"), stype, where, cidr, problems)
    if "status" in obj:
        problems.append(f"{where}: status: written by the lab, not the lab file (the"
                        " ingress ipMode is loadBalancer.ipMode)")


def _validate_cluster_ip(spec: Mapping[str, Any], stype: Any, where: str,
                         cidr: ipaddress.IPv4Network | None, problems: list[str],
                         dual_stack: bool = False) -> None:
    """``clusterIP``/``clusterIPs`` as the API server judges them: one address per family.

    An IPv4 address must lie in ``cluster.serviceCIDR``, an IPv6 one (dual-stack
    labs only) in ``SERVICE_CIDR6``; neither may be its range's network address
    (nor, for IPv4, the broadcast address).
    """
    ip, ips = spec.get("clusterIP"), spec.get("clusterIPs")
    if ip is not None and not isinstance(ip, str):
        problems.append(f"{where}: spec.clusterIP: must be a string, got {ip!r}")
        return
    if ips is not None:
        if not isinstance(ips, list) or not all(isinstance(x, str) for x in ips):
            problems.append(f"{where}: spec.clusterIPs: must be a list of strings")
            return
        if len(ips) > 1 and not dual_stack:
            problems.append(f"{where}: spec.clusterIPs: the lab is single-stack IPv4: at most"
                            " one address")
            return
        if len(ips) > 2:
            problems.append(f"{where}: spec.clusterIPs: at most two addresses (one per family)")
            return
        if ip and ips and ips[0] != ip:
            problems.append(f"{where}: spec.clusterIPs[0]: {ips[0]!r} must equal spec.clusterIP"
                            f" {ip!r}")
            return
    given = _given_cluster_ips(spec)
    if not given:
        return
    if stype == "ExternalName":
        problems.append(f"{where}: spec.{given[0][0]}: must be empty for ExternalName services")
        return
    if given[0][1] == "None":
        if stype in ("NodePort", "LoadBalancer"):
            problems.append(f"{where}: spec.{given[0][0]}: None (headless) is only for ClusterIP"
                            " services")
        if len(given) > 1:
            problems.append(f"{where}: spec.clusterIPs: a headless service has only None")
        return
    cidr6 = ipaddress.IPv6Network(SERVICE_CIDR6)
    versions: list[int] = []
    for field_name, text in given:
        fw = f"{where}: spec.{field_name}"
        addr = _ip(text)
        if addr is None:
            problems.append(f"{fw}: {text!r} is not an {'IP' if dual_stack else 'IPv4'} address")
            continue
        versions.append(addr.version)
        if addr.version == 6:
            if not dual_stack:
                problems.append(f"{fw}: {text} is IPv6, and this lab is IPv4-only"
                                f" ({DUAL_STACK_HINT})")
            elif addr not in cidr6:
                problems.append(f"{fw}: {text} is not in the lab's IPv6 service CIDR {cidr6}")
            elif addr == cidr6.network_address:
                problems.append(f"{fw}: {text} is the IPv6 service CIDR's network address")
        elif cidr is not None:
            if addr not in cidr:
                problems.append(f"{fw}: {text} is not in the service CIDR {cidr}"
                                " (cluster.serviceCIDR)")
            elif addr in (cidr.network_address, cidr.broadcast_address):
                problems.append(f"{fw}: {text} is the service CIDR's"
                                f" {'network' if addr == cidr.network_address else 'broadcast'}"
                                " address")
    if len(versions) == 2 and versions[0] == versions[1]:
        problems.append(f"{where}: spec.clusterIPs: two addresses must be of different families"
                        " (one IPv4, one IPv6)")


def _validate_families(spec: Mapping[str, Any], stype: Any, where: str, dual_stack: bool,
                       problems: list[str]) -> None:
    """``ipFamilyPolicy`` and ``ipFamilies``, and that ``clusterIPs`` agree with them."""
    policy, families = spec.get("ipFamilyPolicy"), spec.get("ipFamilies")
    if stype == "ExternalName":
        for name, value in (("ipFamilyPolicy", policy), ("ipFamilies", families)):
            if value is not None:
                problems.append(f"{where}: spec.{name}: not for ExternalName services")
        return
    if policy is not None and policy not in IP_FAMILY_POLICIES:
        problems.append(f"{where}: spec.ipFamilyPolicy: must be one of"
                        f" {', '.join(IP_FAMILY_POLICIES)}, got {policy!r}")
        return
    if policy == "RequireDualStack" and not dual_stack:
        problems.append(f"{where}: spec.ipFamilyPolicy: RequireDualStack needs a dual-stack lab"
                        f" ({DUAL_STACK_HINT})")
    fams: list[str] = []
    if families is not None:
        if (not isinstance(families, list) or not 1 <= len(families) <= 2
                or not all(f in IP_FAMILIES for f in families)):
            problems.append(f"{where}: spec.ipFamilies: must be one or two of IPv4, IPv6,"
                            f" got {families!r}")
            return
        if len(set(families)) != len(families):
            problems.append(f"{where}: spec.ipFamilies: {families[0]} is listed twice")
            return
        fams = list(families)
        if "IPv6" in fams and not dual_stack:
            problems.append(f"{where}: spec.ipFamilies: IPv6 needs a dual-stack lab"
                            f" ({DUAL_STACK_HINT})")
        if len(fams) == 2 and policy in (None, "SingleStack"):
            problems.append(f"{where}: spec.ipFamilyPolicy: two ipFamilies need PreferDualStack"
                            f" or RequireDualStack, not {policy or 'the default SingleStack'}")
    given = [ip for _, ip in _given_cluster_ips(spec) if ip != "None"]
    versions = [a.version for ip in given if (a := _ip(ip)) is not None]
    if len(versions) == 2 and policy == "SingleStack":
        problems.append(f"{where}: spec.clusterIPs: two addresses need PreferDualStack or"
                        " RequireDualStack, not SingleStack")
    for k, (fam, version) in enumerate(zip(fams, versions, strict=False)):
        if fam != f"IPv{version}":
            problems.append(f"{where}: spec.clusterIPs[{k}]: {given[k]} is not {fam}, the"
                            f" family spec.ipFamilies[{k}] names")


def _ip(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(text)
    except ValueError:
        return None


def _validate_external_ips(raw: Any, stype: Any, where: str,
                           cidr: ipaddress.IPv4Network | None, problems: list[str]) -> None:
    """``externalIPs``: plain unicast IPv4 addresses the lab can route to a node."""
    if raw is None:
        return
    if not isinstance(raw, list):
        problems.append(f"{where}: spec.externalIPs: must be a list of IPv4 addresses")
        return
    if raw and stype == "ExternalName":
        problems.append(f"{where}: spec.externalIPs: not for ExternalName services")
    seen: set[str] = set()
    for j, ip in enumerate(raw):
        fw = f"{where}: spec.externalIPs[{j}]"
        addr = _ipv4(ip) if isinstance(ip, str) else None
        if addr is None:
            problems.append(f"{fw}: {ip!r} is not an IPv4 address")
            continue
        if (addr.is_unspecified or addr.is_loopback or addr.is_link_local or addr.is_multicast
                or addr == ipaddress.IPv4Address("255.255.255.255")):
            problems.append(f"{fw}: {ip} is not a unicast address the API server accepts")
            continue
        inside = [(what, net) for what, net in LAB_NETWORKS.items()
                  if addr in ipaddress.ip_network(net)]
        if cidr is not None and addr in cidr:
            inside.append(("service CIDR", str(cidr)))
        if inside:
            what, net = inside[0]
            problems.append(f"{fw}: {ip} is inside the lab's {what} {net}; pick an address"
                            " outside the lab's networks (e.g. 203.0.113.10)")
        elif ip in seen:
            problems.append(f"{fw}: duplicate externalIP {ip}")
        seen.add(ip)


def _parse_lb(raw: Any, services: list[dict[str, Any]], problems: list[str],
              check_service: bool) -> dict[str, Any] | None:
    if raw is None:
        return None
    if not isinstance(raw, Mapping):
        problems.append("loadBalancer: must be a mapping")
        return None
    lb = copy.deepcopy(dict(raw))
    ref = lb.get("service")
    if not isinstance(ref, str) or not ref:
        problems.append("loadBalancer.service: required (\"namespace/name\" or \"name\")")
        return None
    key = service_ref(ref)
    lb["service"] = key
    svc = next((s for s in services if service_key(s) == key), None)
    if check_service and svc is None:
        problems.append(f"loadBalancer.service: no service {key} in this lab")
    lb.setdefault("mode", "passthrough")
    if lb["mode"] not in LB_MODES:
        problems.append(f"loadBalancer.mode: must be one of {', '.join(LB_MODES)}")
    if "ipMode" in lb and lb["ipMode"] not in IP_MODES:
        problems.append(f"loadBalancer.ipMode: must be VIP or Proxy, got {lb['ipMode']!r}")
    pp = lb.get("proxyProtocol")
    if pp is not None and pp != "none":
        if pp not in ("v1", "v2"):
            problems.append("loadBalancer.proxyProtocol: must be none, v1, v2 or null")
        elif lb["mode"] != "proxy":
            problems.append("loadBalancer.proxyProtocol: only proxy mode can send a PROXY"
                            " header")
    probe_raw = lb.get("probe") or {}
    if not isinstance(probe_raw, Mapping):
        problems.append("loadBalancer.probe: must be a mapping")
        probe_raw = {}
    probe = {**PROBE_DEFAULTS, **probe_raw}
    if probe["type"] not in PROBE_TYPES:
        problems.append(f"loadBalancer.probe.type: must be one of {', '.join(PROBE_TYPES)}")
    port = probe["port"]
    if port not in ("healthCheckNodePort", "nodePort") and not (
            _is_int(port) and 1 <= port <= 65535):
        problems.append("loadBalancer.probe.port: healthCheckNodePort, nodePort or a number")
    if svc is not None and (svc.get("spec") or {}).get("type") not in ("LoadBalancer",
                                                                        "NodePort"):
        problems.append(f"loadBalancer.service: {key} must be of type LoadBalancer or NodePort")
    if not isinstance(probe["path"], str) or not probe["path"].startswith("/"):
        problems.append("loadBalancer.probe.path: must start with /")
    elif not PROBE_PATH.fullmatch(probe["path"]):
        # It goes into an HTTP request line as is: ASCII, no spaces, no control bytes.
        problems.append(f"loadBalancer.probe.path: {probe['path']!r} must be printable ASCII"
                        " without spaces (percent-encode anything else)")
    # The same bounds the load balancer's resolve() enforces when it starts: a value it
    # would refuse must not pass here, or ``up`` builds a whole lab only to tear it down
    # and ``apply`` records a config the running LB never takes.
    for k in ("interval", "timeout"):
        v = probe[k]
        if isinstance(v, bool) or not isinstance(v, int | float) or v < MIN_SECONDS:
            problems.append(f"loadBalancer.probe.{k}: must be a number of seconds"
                            f" >= {MIN_SECONDS:g}")
    if "port" in lb and not (_is_int(lb["port"]) and 1 <= lb["port"] <= 65535):
        problems.append(f"loadBalancer.port: must be a port number 1-65535, got {lb['port']!r}")
    ct = lb.get("connectTimeout", 2.0)
    if isinstance(ct, bool) or not isinstance(ct, int | float) or ct < MIN_SECONDS:
        problems.append(f"loadBalancer.connectTimeout: must be a number of seconds"
                        f" >= {MIN_SECONDS:g}, got {ct!r}")
    for k in ("healthyThreshold", "unhealthyThreshold"):
        if not _is_int(probe[k]) or probe[k] < 1:
            problems.append(f"loadBalancer.probe.{k}: must be an integer >= 1")
    lb["probe"] = probe
    return lb
