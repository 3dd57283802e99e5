"""Bring a cluster into the lab: a state file's Nodes, Services and slices as a lab file.

Owns: reading a state file the way a person hands one over (``load_documents``:
``kubectl get nodes,svc,endpointslices -A -o yaml``'s ``kind: List``, ``kpx
snapshot``'s output, or multi-document YAML), and ``translate``, a pure
function from those objects to a lab file that mirrors the cluster:

- one node per Node, named as in the cluster, at its (first IPv4) InternalIP;
- one echo pod per endpoint address, on the endpoint's ``nodeName``, at that
  address, labelled with the selectors of every Service whose slices list it
  (so the lab's own EndpointSlice controller publishes it for exactly those);
- the Services as they are (``spec`` untouched but for an IPv6 family: a
  mirrored lab is IPv4 only, as ``lab.spec`` allows no ``dualStack`` beside a
  cluster's own addresses), the first LoadBalancer one behind the lab's LB;
- each node's pod networks: its ``spec.podCIDRs`` when it has them, plus a /32
  for every endpoint address outside them (VPC CNIs give pods addresses from
  the nodes' subnet), and a service CIDR just wide enough for the ClusterIPs.

Whatever cannot be mirrored is left out and said (``LeftOut``), never
silently: nodes and pods over the caps, endpoints without a ``nodeName`` or
on a node left out, terminating or hostNetwork endpoints, headless and
ExternalName services, IPv6. Malformed objects are errors naming the object
and the field (``MirrorError``).

Never: touch a namespace or the network (``kpx lab up --from-state`` hands
the result to ``lab.cluster``), or import kpx's own parser: the lab uses kpx
as a black box, so this reads the few fields it needs itself and leaves the
judgement of the Services to ``lab.spec``, which is the lab's API server.
"""

from __future__ import annotations

import copy
import ipaddress
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from lab.spec import MAX_NODE_NAME, MAX_NODES, MAX_PODS_PER_NODE, RESERVED_NAMES
from lab.topology import INFRA_NETWORKS, LAB_NETWORKS

DEFAULT_MAX_NODES = 20
DEFAULT_MAX_PODS = 500
HEADLESS_LABEL = "service.kubernetes.io/headless"
SERVICE_PROXY_NAME_LABEL = "service.kubernetes.io/service-proxy-name"
SERVICE_NAME_LABEL = "kubernetes.io/service-name"
NOISE_ANNOTATIONS = ("kubectl.kubernetes.io/last-applied-configuration",)
"""Annotations that only repeat the object (often its larger half)."""

_NODE_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_POD_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
MAX_POD_NAME = 40


class MirrorError(ValueError):
    """The state file cannot be read as a cluster; ``problems`` names object and field."""

    def __init__(self, problems: list[str], source: str = "state file") -> None:
        self.problems = list(problems)
        super().__init__(f"{source}: {len(problems)} problem(s):\n  " + "\n  ".join(problems))


@dataclass(frozen=True)
class LeftOut:
    """Something of the cluster the lab does not have, and why."""

    what: str
    """``Node name``, ``Pod ns/name (ip)``, ``Service ns/name``, ``EndpointSlice ns/name``..."""
    reason: str

    def __str__(self) -> str:
        return f"{self.what}: {self.reason}"


@dataclass(frozen=True)
class Mirror:
    """A lab file (``spec``, for ``lab.spec.LabSpec.from_dict``) and what it leaves out."""

    spec: dict[str, Any]
    left_out: tuple[LeftOut, ...] = ()

    def summary(self) -> str:
        s = self.spec
        lb = (s.get("loadBalancer") or {}).get("service")
        return (f"{len(s['nodes'])} nodes, {len(s['pods'])} pods, {len(s['services'])} services"
                + (f", the lab's LB in front of {lb}" if lb else ", no LoadBalancer service"))


# --- reading --------------------------------------------------------------------------


def load_documents(path: str | Path) -> list[Any]:
    """The objects of a state file: every document, each ``*List``'s items in its place."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise MirrorError([f"cannot read: {exc.strerror or exc}"], str(path)) from None
    except UnicodeDecodeError:
        raise MirrorError(["not a text file"], str(path)) from None
    try:
        docs = [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError as exc:
        raise MirrorError([f"YAML syntax error: {exc}"], str(path)) from None
    return flatten(docs, str(path))


def flatten(docs: Iterable[Any], source: str = "state file") -> list[Any]:
    out: list[Any] = []
    for i, d in enumerate(docs):
        kind = d.get("kind") if isinstance(d, Mapping) else None
        if isinstance(kind, str) and kind.endswith("List") and "items" in d:
            items = d.get("items") or []
            if not isinstance(items, list):
                raise MirrorError([f"document {i + 1} ({kind}): items: must be a list"], source)
            out += items
        else:
            out.append(d)
    return out


# --- translating ------------------------------------------------------------------------


@dataclass
class _Node:
    name: str
    ip: str
    cidrs: list[ipaddress.IPv4Network]
    fields: dict[str, Any] = field(default_factory=dict)
    """What kpx reads of the Node besides its address (``cluster.nodeFields``)."""


@dataclass
class _Endpoint:
    ip: str
    service: str
    namespace: str
    node: str | None
    ready: bool
    terminating: bool
    pod: str | None
    ports: list[Mapping[str, Any]]


@dataclass
class _Pod:
    ip: str
    node: str
    namespace: str
    labels: dict[str, str] = field(default_factory=dict)
    name: str | None = None
    ready: bool = True
    port: int = 8080
    port_name: str | None = None
    port_set: bool = False
    """Whether a service has chosen the pod's one port yet."""


class _Reader:
    """Field access that records a problem naming the object and the field."""

    def __init__(self) -> None:
        self.problems: list[str] = []

    def mapping(self, obj: Mapping[str, Any], key: str, where: str) -> Mapping[str, Any]:
        v = obj.get(key)
        if v is None:
            return {}
        if not isinstance(v, Mapping):
            self.problems.append(f"{where}: {key}: must be a mapping, got {type(v).__name__}")
            return {}
        return v

    def listing(self, obj: Mapping[str, Any], key: str, where: str) -> list[Any]:
        v = obj.get(key)
        if v is None:
            return []
        if not isinstance(v, list):
            self.problems.append(f"{where}: {key}: must be a list, got {type(v).__name__}")
            return []
        return v


def translate(documents: Sequence[Any], max_nodes: int = DEFAULT_MAX_NODES,
              max_pods: int = DEFAULT_MAX_PODS, source: str = "state file") -> Mirror:
    """A lab file mirroring *documents* (Nodes, Services, EndpointSlices), capped.

    At most *max_nodes* nodes (in the file's order) and *max_pods* pods (the
    LB-fronted service's endpoints first, then the file's order); everything
    else is in ``left_out``. Raises ``MirrorError`` for malformed objects.
    """
    if not 1 <= max_nodes <= MAX_NODES:
        raise MirrorError([f"the node cap must be 1-{MAX_NODES}, got {max_nodes}"], source)
    if max_pods < 0:
        raise MirrorError([f"the pod cap must be 0 or more, got {max_pods}"], source)
    r = _Reader()
    left: list[LeftOut] = []
    raw_nodes, raw_services, raw_slices = _classify(documents, r, left)
    nodes = _nodes(raw_nodes, max_nodes, r, left)
    services = _services(raw_services, r, left)
    endpoints = _endpoints(raw_slices, services, r, left)
    if r.problems:
        raise MirrorError(r.problems, source)
    fronted = next((k for k, s in services.items() if s["spec"].get("type") == "LoadBalancer"
                    and any(p.get("nodePort") for p in s["spec"].get("ports") or [])), None)
    if fronted is None and any(s["spec"].get("type") == "LoadBalancer"
                               for s in services.values()):
        left.append(LeftOut("loadBalancer", "no LoadBalancer service has a nodePort for the"
                            " lab's LB to send to"))
    pods = _pods(endpoints, nodes, services, fronted, max_pods, left)
    _status_notes(services, fronted, left)
    spec: dict[str, Any] = {
        "nodes": [n.name for n in nodes.values()],
        "cluster": {
            "nodeIPs": {n.name: n.ip for n in nodes.values()},
            "podCIDRs": _pod_routes(nodes, pods),
            "nodeFields": {n.name: n.fields for n in nodes.values() if n.fields},
        },
        "pods": [_pod_entry(p) for p in pods],
        "services": [{k: v for k, v in s.items() if k != "status"} for s in services.values()],
    }
    cidr = _service_cidr([s["spec"].get("clusterIP") for s in services.values()], source)
    if cidr:
        spec["cluster"]["serviceCIDR"] = cidr
    if fronted:
        spec["loadBalancer"] = {"service": fronted}
    return Mirror(spec, tuple(left))


def _classify(documents: Sequence[Any], r: _Reader, left: list[LeftOut]
              ) -> tuple[list[tuple[str, Mapping[str, Any]]], ...]:
    """Nodes, Services, EndpointSlices, each with its name; other kinds are counted out."""
    out: dict[str, list[tuple[str, Mapping[str, Any]]]] = {
        "Node": [], "Service": [], "EndpointSlice": []}
    others: dict[str, int] = {}
    for i, d in enumerate(documents):
        if not isinstance(d, Mapping):
            r.problems.append(f"object {i + 1}: must be a mapping (a Kubernetes object)")
            continue
        kind = d.get("kind")
        if kind not in out:
            others[str(kind)] = others.get(str(kind), 0) + 1
            continue
        meta = r.mapping(d, "metadata", f"{kind} #{i + 1}")
        name = meta.get("name")
        if not isinstance(name, str) or not name:
            r.problems.append(f"{kind} #{i + 1}: metadata.name: required")
            continue
        if kind != "Node":
            ns = meta.get("namespace", "default")
            if not isinstance(ns, str) or not ns:
                r.problems.append(f"{kind} {name}: metadata.namespace: must be a name")
                continue
            name = f"{ns}/{name}"
        out[kind].append((name, d))
    left += [LeftOut(f"{n} object(s) of kind {k}", "kube-proxy does not watch this kind")
             for k, n in sorted(others.items())]
    return out["Node"], out["Service"], out["EndpointSlice"]


def _ipv4(text: Any) -> ipaddress.IPv4Address | None:
    try:
        ip = ipaddress.ip_address(text) if isinstance(text, str) else None
    except ValueError:
        return None
    return ip if isinstance(ip, ipaddress.IPv4Address) else None


def _inside(addr: ipaddress.IPv4Address | ipaddress.IPv4Network,
            networks: Mapping[str, str]) -> str | None:
    for what, text in networks.items():
        net = ipaddress.ip_network(text)
        if (addr.overlaps(net) if isinstance(addr, ipaddress.IPv4Network) else addr in net):
            return f"{what} {net}"
    return None


def _nodes(raw: list[tuple[str, Mapping[str, Any]]], cap: int, r: _Reader,
           left: list[LeftOut]) -> dict[str, _Node]:
    nodes: dict[str, _Node] = {}
    ips: dict[str, str] = {}
    for name, obj in raw:
        where = f"Node {name}"
        status = r.mapping(obj, "status", where)
        spec = r.mapping(obj, "spec", where)
        found = None
        for j, a in enumerate(r.listing(status, "addresses", f"{where}: status")):
            if not isinstance(a, Mapping):
                r.problems.append(f"{where}: status.addresses[{j}]: must be a mapping")
            elif a.get("type") == "InternalIP" and found is None:
                found = _ipv4(a.get("address"))
        cidrs: list[ipaddress.IPv4Network] = []
        given = r.listing(spec, "podCIDRs", f"{where}: spec") or (
            [spec["podCIDR"]] if spec.get("podCIDR") else [])
        for j, text in enumerate(given):
            try:
                net = ipaddress.ip_network(text) if isinstance(text, str) else None
            except ValueError:
                net = None
            if net is None:
                r.problems.append(f"{where}: spec.podCIDRs[{j}]: {text!r} is not a network"
                                  " (host bits must be zero)")
            elif isinstance(net, ipaddress.IPv4Network):
                cidrs.append(net)
        if not _NODE_NAME.match(name) or len(name) > MAX_NODE_NAME:
            left.append(LeftOut(where, f"its name is not a DNS subdomain of at most"
                                       f" {MAX_NODE_NAME} characters"))
        elif name in RESERVED_NAMES:
            left.append(LeftOut(where, "its name is one the lab uses for itself"))
        elif found is None:
            left.append(LeftOut(where, "no IPv4 InternalIP in status.addresses"))
        elif clash := _inside(found, INFRA_NETWORKS):
            left.append(LeftOut(where, f"InternalIP {found} is inside the lab's {clash}"))
        elif str(found) in ips:
            left.append(LeftOut(where, f"InternalIP {found} is also node {ips[str(found)]}'s"))
        elif len(nodes) >= cap:
            left.append(LeftOut(where, f"over the cap of {cap} nodes (--max-nodes)"))
        else:
            ips[str(found)] = name
            nodes[name] = _Node(name, str(found), cidrs, _node_fields(obj))
    _usable_cidrs(nodes, left)
    return nodes


def _node_fields(obj: Mapping[str, Any]) -> dict[str, Any]:
    """Labels, taints (key and effect) and deletionTimestamp: kpx reads them."""
    meta, spec = obj.get("metadata") or {}, obj.get("spec") or {}
    out: dict[str, Any] = {}
    labels = meta.get("labels")
    if isinstance(labels, Mapping) and labels:
        out["labels"] = {str(k): str(v) for k, v in labels.items()}
    taints = [{"key": t["key"], "effect": t["effect"]} for t in spec.get("taints") or []
              if isinstance(t, Mapping) and "key" in t and "effect" in t]
    if taints:
        out["taints"] = taints
    if meta.get("deletionTimestamp"):
        out["deletionTimestamp"] = str(meta["deletionTimestamp"])
    return out


def _usable_cidrs(nodes: Mapping[str, _Node], left: list[LeftOut]) -> None:
    """Drop pod CIDRs that would route wrong: into the lab, onto a node, onto another's."""
    taken: list[tuple[ipaddress.IPv4Network, str]] = []
    node_ips = {ipaddress.IPv4Address(n.ip): n.name for n in nodes.values()}
    for node in nodes.values():
        keep = []
        for net in node.cidrs:
            why = None
            if clash := _inside(net, INFRA_NETWORKS):
                why = f"overlaps the lab's {clash}"
            elif holder := next((n for a, n in node_ips.items() if a in net), None):
                why = f"holds node {holder}'s address"
            elif other := next((o for t, o in taken if t.overlaps(net)), None):
                why = f"overlaps node {other}'s"
            if why:
                left.append(LeftOut(f"Node {node.name}", f"spec.podCIDR {net} {why}; its pods"
                                    " are routed one by one instead"))
            else:
                taken.append((net, node.name))
                keep.append(net)
        node.cidrs = keep


def _services(raw: list[tuple[str, Mapping[str, Any]]], r: _Reader,
              left: list[LeftOut]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for key, obj in raw:
        where = f"Service {key}"
        meta = r.mapping(obj, "metadata", where)
        labels = r.mapping(meta, "labels", f"{where}: metadata")
        spec = r.mapping(obj, "spec", where)
        if obj.get("spec") is None:
            r.problems.append(f"{where}: spec: required")
        if not spec:
            continue
        stype = spec.get("type", "ClusterIP")
        if HEADLESS_LABEL in labels or SERVICE_PROXY_NAME_LABEL in labels:
            label = HEADLESS_LABEL if HEADLESS_LABEL in labels else SERVICE_PROXY_NAME_LABEL
            left.append(LeftOut(where, f"labelled {label}: kube-proxy does not watch it"))
            continue
        if stype == "ExternalName":
            left.append(LeftOut(where, "ExternalName: a DNS alias, nothing to proxy"))
            continue
        if spec.get("clusterIP") == "None":
            left.append(LeftOut(where, "headless (clusterIP None): kube-proxy does not proxy it"))
            continue
        spec = copy.deepcopy(dict(spec))
        ips = spec.get("clusterIPs") or ([spec["clusterIP"]] if spec.get("clusterIP") else [])
        if not isinstance(ips, list):
            r.problems.append(f"{where}: spec.clusterIPs: must be a list of addresses")
            continue
        v4 = [ip for ip in ips if _ipv4(ip)]
        if ips and not v4:
            left.append(LeftOut(where, f"IPv6 only (clusterIPs {', '.join(map(str, ips))}):"
                                " a mirrored lab is IPv4"))
            continue
        if len(v4) != len(ips):
            left.append(LeftOut(where, "its IPv6 family (clusterIPs "
                                f"{', '.join(str(i) for i in ips if i not in v4)}): a mirrored"
                                " lab is IPv4 only; it keeps the IPv4 one"))
            spec.update(clusterIP=v4[0], clusterIPs=v4[:1], ipFamilies=["IPv4"],
                        ipFamilyPolicy="SingleStack")
        external = spec.get("externalIPs")
        if isinstance(external, list):
            keep = []
            for ip in external:
                addr = _ipv4(ip)
                clash = _inside(addr, {**LAB_NETWORKS, **INFRA_NETWORKS}) if addr else None
                if addr is None or clash:
                    left.append(LeftOut(where, f"externalIP {ip}: " + (
                        f"inside the lab's {clash}" if clash else "not IPv4")))
                else:
                    keep.append(ip)
            spec["externalIPs"] = keep
            if not keep:
                del spec["externalIPs"]
        new_meta: dict[str, Any] = {"name": meta["name"],
                                    "namespace": meta.get("namespace", "default")}
        if labels:
            new_meta["labels"] = dict(labels)
        notes = {k: v for k, v in r.mapping(meta, "annotations", f"{where}: metadata").items()
                 if k not in NOISE_ANNOTATIONS}
        if notes:
            new_meta["annotations"] = notes
        svc = {"apiVersion": "v1", "kind": "Service", "metadata": new_meta, "spec": spec}
        status = obj.get("status")
        if isinstance(status, Mapping):
            svc["status"] = copy.deepcopy(dict(status))
        out[key] = svc
    return out


def _endpoints(raw: list[tuple[str, Mapping[str, Any]]], services: Mapping[str, Any],
               r: _Reader, left: list[LeftOut]) -> list[_Endpoint]:
    out: list[_Endpoint] = []
    for key, obj in raw:
        where = f"EndpointSlice {key}"
        meta = r.mapping(obj, "metadata", where)
        labels = r.mapping(meta, "labels", f"{where}: metadata")
        if HEADLESS_LABEL in labels or SERVICE_PROXY_NAME_LABEL in labels:
            continue  # its service is out for the same label, and said so
        ns = key.split("/", 1)[0]
        svc_name = labels.get(SERVICE_NAME_LABEL)
        if not isinstance(svc_name, str) or not svc_name:
            left.append(LeftOut(where, f"no {SERVICE_NAME_LABEL} label: it serves no Service"))
            continue
        svc_key = f"{ns}/{svc_name}"
        endpoints = r.listing(obj, "endpoints", where)
        ports = [p for p in r.listing(obj, "ports", where) if isinstance(p, Mapping)]
        if svc_key not in services:
            continue  # the Service was left out (and said), or was never there
        if obj.get("addressType", "IPv4") != "IPv4":
            left.append(LeftOut(where, f"addressType {obj.get('addressType')}: a mirrored"
                                " lab is IPv4 only"))
            continue
        for j, ep in enumerate(endpoints):
            ew = f"{where}: endpoints[{j}]"
            if not isinstance(ep, Mapping):
                r.problems.append(f"{ew}: must be a mapping")
                continue
            addrs = ep.get("addresses")
            if not isinstance(addrs, list) or not addrs:
                r.problems.append(f"{ew}.addresses: must be a non-empty list of addresses")
                continue
            ip = _ipv4(addrs[0])
            if ip is None:
                r.problems.append(f"{ew}.addresses[0]: {addrs[0]!r} is not an IPv4 address")
                continue
            cond = r.mapping(ep, "conditions", ew)
            ref = r.mapping(ep, "targetRef", ew)
            node = ep.get("nodeName")
            if node is not None and not isinstance(node, str):
                r.problems.append(f"{ew}.nodeName: must be a string")
                continue
            pod = ref.get("name") if ref.get("kind", "Pod") == "Pod" else None
            out.append(_Endpoint(
                ip=str(ip), service=svc_key, namespace=ns, node=node,
                ready=cond.get("ready") is not False, terminating=cond.get("terminating") is True,
                pod=pod if isinstance(pod, str) else None, ports=ports))
    return out


def _pods(endpoints: list[_Endpoint], nodes: Mapping[str, _Node],
          services: Mapping[str, Mapping[str, Any]], fronted: str | None, cap: int,
          left: list[LeftOut]) -> list[_Pod]:
    """One pod per endpoint address, in priority order, each on its endpoint's node."""
    by_ip: dict[str, list[_Endpoint]] = {}
    for ep in sorted(endpoints, key=lambda e: e.service != fronted):  # stable: file order
        by_ip.setdefault(ep.ip, []).append(ep)
    node_ips = {n.ip: n.name for n in nodes.values()}
    cidr_owner = [(net, n.name) for n in nodes.values() for net in n.cidrs]
    no_selector = sorted({ep.service for ep in endpoints
                          if not services[ep.service]["spec"].get("selector")})
    left += [LeftOut(f"Service {k}", "no selector: its endpoints are hand-made, and the lab's"
                     " endpoints come from selectors; it has none in the lab")
             for k in no_selector]
    pods: list[_Pod] = []
    taken_names = set(nodes) | set(RESERVED_NAMES)
    per_node: dict[str, int] = {}
    for ip, eps in by_ip.items():
        first = eps[0]
        what = f"Pod {first.namespace}/{first.pod} ({ip})" if first.pod else f"endpoint {ip}"
        eps = [e for e in eps if e.service not in no_selector]
        if not eps:
            continue
        owner = next((n for net, n in cidr_owner if ipaddress.IPv4Address(ip) in net), None)
        why = None
        if first.node is None:
            why = "no nodeName: no node to put it on"
        elif first.node not in nodes:
            why = f"on node {first.node}, which is not in the lab"
        elif first.terminating:
            why = "terminating: the lab starts pods, not pods already on their way out"
        elif ip in node_ips:
            why = (f"node {node_ips[ip]}'s own address (a hostNetwork pod): a lab pod has a"
                   " namespace and an address of its own")
        elif clash := _inside(ipaddress.IPv4Address(ip), INFRA_NETWORKS):
            why = f"inside the lab's {clash}"
        elif owner is not None and owner != first.node:
            why = f"inside node {owner}'s podCIDR, but its nodeName is {first.node}"
        elif len(pods) >= cap:
            why = f"over the cap of {cap} pods (--max-pods)"
        elif per_node.get(first.node, 0) >= MAX_PODS_PER_NODE:
            why = f"over the lab's {MAX_PODS_PER_NODE} pods on node {first.node}"
        if why:
            left.append(LeftOut(what, why))
            continue
        assert first.node is not None
        pod = _Pod(ip=ip, node=first.node, namespace=first.namespace, ready=first.ready)
        for ep in eps:
            _join(pod, ep, services[ep.service], what, left)
        pod.name = _pod_name(first.pod, ip, taken_names)
        taken_names.add(pod.name)
        per_node[pod.node] = per_node.get(pod.node, 0) + 1
        pods.append(pod)
    return pods


def _join(pod: _Pod, ep: _Endpoint, svc: Mapping[str, Any], what: str,
          left: list[LeftOut]) -> None:
    """Make *pod* one of *svc*'s endpoints: its selector as labels, its port as the pod's."""
    if ep.namespace != pod.namespace:
        left.append(LeftOut(what, f"also listed by Service {ep.service} of another namespace;"
                            " the lab's pod is in one"))
        return
    selector = svc["spec"].get("selector") or {}
    clash = [k for k, v in selector.items() if pod.labels.get(k, v) != v]
    if clash:
        left.append(LeftOut(what, f"as an endpoint of Service {ep.service}: its selector"
                            f" disagrees with another's on {', '.join(clash)}"))
        return
    pod.labels.update({str(k): str(v) for k, v in selector.items()})
    tcp = [p for p in ep.ports if p.get("protocol", "TCP") == "TCP"] or ep.ports
    if not tcp:
        return
    port = tcp[0]
    number = port.get("port")
    if not isinstance(number, int):
        return
    target = next((p.get("targetPort") for p in svc["spec"].get("ports") or []
                   if p.get("name", "") == port.get("name", "")), None)
    name = target if isinstance(target, str) else None
    if not pod.port_set:
        pod.port, pod.port_name, pod.port_set = number, name, True
    elif (number, name) != (pod.port, pod.port_name) and not (name is None
                                                               and number == pod.port):
        left.append(LeftOut(what, f"port {number}{f' ({name})' if name else ''} for Service"
                            f" {ep.service}: a lab pod listens on one port, {pod.port}"))


def _pod_name(name: str | None, ip: str, taken: set[str]) -> str:
    """The pod's own name when the lab can take it, else ``ep-10-244-1-7``."""
    if name and _POD_NAME.match(name) and len(name) <= MAX_POD_NAME and name not in taken:
        return name
    base = "ep-" + ip.replace(".", "-")
    candidate, n = base, 1
    while candidate in taken:
        n += 1
        candidate = f"{base}-{n}"
    return candidate


def _pod_entry(p: _Pod) -> dict[str, Any]:
    d: dict[str, Any] = {"name": p.name, "node": p.node, "ip": p.ip, "labels": p.labels,
                         "port": p.port}
    if p.namespace != "default":
        d["namespace"] = p.namespace
    if p.port_name:
        d["portName"] = p.port_name
    if not p.ready:
        d["ready"] = False
    return d


def _pod_routes(nodes: Mapping[str, _Node], pods: list[_Pod]) -> dict[str, list[str]]:
    """Each node's podCIDRs, plus a /32 for each of its pods outside them."""
    routes = {n.name: [str(c) for c in n.cidrs] for n in nodes.values()}
    for p in pods:
        addr = ipaddress.IPv4Address(p.ip)
        if not any(addr in c for c in nodes[p.node].cidrs):
            routes[p.node].append(f"{p.ip}/32")
    return routes


def _service_cidr(ips: Iterable[Any], source: str) -> str | None:
    """The smallest network (/28 at most) holding every ClusterIP, none at its edges."""
    addrs = {a for ip in ips if (a := _ipv4(ip)) is not None}
    if not addrs:
        return None
    lo, hi = int(min(addrs)), int(max(addrs))
    prefix = min(28, 32 - (lo ^ hi).bit_length())
    net = ipaddress.IPv4Network((lo, prefix), strict=False)
    while net.prefixlen > 12 and (net.network_address in addrs
                                  or net.broadcast_address in addrs):
        net = net.supernet()
    if net.prefixlen < 12 or net.network_address in addrs or net.broadcast_address in addrs:
        raise MirrorError([f"the Services' clusterIPs span {net}: wider than any service CIDR"
                           " (/12 at most)"], source)
    return str(net)


def _status_notes(services: Mapping[str, Mapping[str, Any]], fronted: str | None,
                  left: list[LeftOut]) -> None:
    """Say whose LB ingress the lab replaces or leaves pending (the lab has one LB)."""
    for key, svc in services.items():
        ingress = ((svc.get("status") or {}).get("loadBalancer") or {}).get("ingress") or []
        addrs = ", ".join(str(i.get("ip") or i.get("hostname")) for i in ingress
                          if isinstance(i, Mapping))
        if not addrs:
            continue
        left.append(LeftOut(f"Service {key}", f"status.loadBalancer.ingress {addrs}: "
                            + ("the lab's LB front stands in for it" if key == fronted else
                               "left pending (the lab's one LB fronts " + (fronted or "nothing")
                               + ")")))
