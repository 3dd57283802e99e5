"""A small endpoints controller and API-server stand-in for the lab.

Owns, as pure functions:

- API-server defaulting and allocation for Services (``resolve_services``):
  type/protocol/targetPort/policy defaults, a ClusterIP (from the lab's
  service CIDR), nodePorts and the healthCheckNodePort, allocated
  deterministically and *kept across updates* exactly as the API server's
  ``patchAllocatedValues`` keeps them.
- The cloud controller's part: ``status.loadBalancer`` of LoadBalancer
  Services (``load_balancer_status``): the lab's LB front as the ingress IP
  of the service it fronts, with the ipMode the lab file asks for.
- What the EndpointSlice controller publishes for those Services and the
  lab's pods (``endpoint_slices``), field for field.
- Dual-stack (``dual_stack``): ``ipFamilyPolicy``/``ipFamilies`` resolved as
  the API server resolves them, one ClusterIP per family (IPv6 ones from
  ``lab.topology.SERVICE_CIDR6``), and one set of slices per family, named
  and labelled as the EndpointSlice controller names them (``addressType:
  IPv6`` slices carry the pods' IPv6 addresses).
- The v1 Node objects of the lab's nodes (``node_objects``) and the state
  document list every ``kpx node`` reads (``state_documents``).

Never: do I/O, read the clock or hold state. Times come in as arguments, so
tests can check a slice byte for byte. Writing the state file lives in
``lab.statefile``.

The EndpointSlice rules mirrored here (``k8s.io/endpointslice``, reconciler
and ``podToEndpoint``), because kpx's behaviour is only as right as its
input:

- every pod with an IP that matches the selector is published, terminating
  ones included (``ShouldPodBeInEndpoints(pod, true)``);
- ``serving`` is the pod's Ready condition, ``terminating`` is "has a
  deletionTimestamp", and ``ready = publishNotReadyAddresses or (serving and
  not terminating)``: a terminating pod is never ready unless the service
  publishes not-ready addresses;
- ports are the service ports with the targetPort resolved against the pod
  (a named targetPort the pod lacks drops that port for that pod); pods with
  the same resolved ports share slices, at most 100 endpoints per slice;
- a selector service with no matching pods still gets one empty
  (placeholder) slice, so consumers can tell "no endpoints" from "unknown";
- services without a selector, and ExternalName services, get no slices.
"""

from __future__ import annotations

import copy
import hashlib
import ipaddress
import json
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from lab.spec import (
    DEFAULT_SERVICE_CIDR,
    NODE_PORT_MAX,
    NODE_PORT_MIN,
    SERVICE_CIDR6,
    LabSpecError,
    service_key,
)

MAX_ENDPOINTS_PER_SLICE = 100
MANAGED_BY = "endpointslice-controller.k8s.io"
SERVICE_NAME_LABEL = "kubernetes.io/service-name"
TRIGGER_TIME_ANNOTATION = "endpoints.kubernetes.io/last-change-trigger-time"
SERVICE_CIDR = ipaddress.IPv4Network(DEFAULT_SERVICE_CIDR)
RESERVED_OFFSETS = 10
"""Allocation skips the service CIDR's first ten addresses (the network address,
``.1`` for ``kubernetes``, a few for static use) and its broadcast address."""
DEFAULT_AFFINITY_SECONDS = 10800
_UID_NAMESPACE = uuid.UUID("6f1c8c1e-5b1a-4f3e-9a4e-6b7061726b78")


@dataclass(frozen=True)
class PodState:
    """What the controller needs to know about a running lab pod."""

    name: str
    node: str
    ip: str
    labels: Mapping[str, str] = field(default_factory=dict)
    port: int = 8080
    port_name: str | None = None
    ready: bool = True
    terminating: bool = False
    namespace: str = "default"
    uid: str = ""
    ip6: str | None = None
    """Its IPv6 address in a dual-stack lab; None in an IPv4-only one."""

    def ip_of(self, family: str) -> str | None:
        """Its address of *family* (``IPv4`` or ``IPv6``), or None."""
        return self.ip if family == "IPv4" else self.ip6


@dataclass(frozen=True)
class NodeInfo:
    name: str
    ip: str
    pod_cidr: str
    """Its pod networks, comma-separated (a mirrored cluster's node may have several)."""
    fields: Mapping[str, Any] = field(default_factory=dict)
    """``cluster.nodeFields``: labels, taints, deletionTimestamp of a mirrored Node."""
    ip6: str | None = None
    """Its IPv6 InternalIP in a dual-stack lab."""
    pod_cidr6: str | None = None
    """Its IPv6 pod CIDR in a dual-stack lab (``spec.podCIDRs``' second entry)."""


# --- the API server's part ---------------------------------------------------------


def _stable_uid(kind: str, key: str) -> str:
    return str(uuid.uuid5(_UID_NAMESPACE, f"{kind}/{key}"))


def _hash_int(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big")


def _needs_node_ports(spec: Mapping[str, Any]) -> bool:
    if spec.get("type") == "NodePort":
        return True
    return spec.get("type") == "LoadBalancer" and spec.get("allocateLoadBalancerNodePorts",
                                                            True) is not False


def _needs_hc_port(spec: Mapping[str, Any]) -> bool:
    return spec.get("type") == "LoadBalancer" and spec.get("externalTrafficPolicy") == "Local"


def default_service(obj: Mapping[str, Any], dual_stack: bool = False) -> dict[str, Any]:
    """Fill in what the API server defaults on create (no allocation).

    In a *dual_stack* lab a service that names neither ``ipFamilyPolicy`` nor
    ``ipFamilies`` gets ``PreferDualStack`` (see ``lab.spec``: the lab's choice).
    """
    svc = copy.deepcopy(dict(obj))
    meta = svc.setdefault("metadata", {})
    meta.setdefault("namespace", "default")
    spec = svc.setdefault("spec", {})
    spec.setdefault("type", "ClusterIP")
    spec.setdefault("sessionAffinity", "None")
    if spec["sessionAffinity"] == "ClientIP":
        cfg = spec.setdefault("sessionAffinityConfig", {}).setdefault("clientIP", {})
        cfg.setdefault("timeoutSeconds", DEFAULT_AFFINITY_SECONDS)
    if spec["type"] != "ExternalName":
        spec.setdefault("internalTrafficPolicy", "Cluster")
    if spec["type"] in ("NodePort", "LoadBalancer"):
        spec.setdefault("externalTrafficPolicy", "Cluster")
    if spec["type"] == "LoadBalancer":
        spec.setdefault("allocateLoadBalancerNodePorts", True)
    ports = []
    for p in spec.get("ports") or []:
        p = dict(p)
        p.setdefault("protocol", "TCP")
        p.setdefault("targetPort", p.get("port"))
        if not _needs_node_ports(spec):
            # Switching to ClusterIP drops nodePorts, as the API server does.
            p.pop("nodePort", None)
        ports.append(p)
    if "ports" in spec or ports:
        spec["ports"] = ports
    if not _needs_hc_port(spec):
        spec.pop("healthCheckNodePort", None)
    if (dual_stack and spec["type"] != "ExternalName" and "ipFamilyPolicy" not in spec
            and "ipFamilies" not in spec):
        spec["ipFamilyPolicy"] = "PreferDualStack"
    if spec["type"] == "ExternalName":
        spec.pop("clusterIPs", None)
    elif not spec.get("clusterIP") and spec.get("clusterIPs"):
        spec["clusterIP"] = spec["clusterIPs"][0]  # clusterIPs alone asks for its first
    svc.pop("status", None)  # status is not the API server's input; the lab writes it
    return svc


def resolve_services(services: Iterable[Mapping[str, Any]],
                     previous: Mapping[str, Mapping[str, Any]] | None = None,
                     service_cidr: str | ipaddress.IPv4Network = SERVICE_CIDR,
                     dual_stack: bool = False) -> list[dict[str, Any]]:
    """Defaults plus allocation: the Services as ``kubectl get -o yaml`` would show them.

    *previous* maps ``namespace/name`` to the resolved object of the last
    round. Values the user leaves out are taken from it (nodePorts matched by
    port name, the healthCheckNodePort, clusterIP, uid), so an apply that
    does not mention nodePorts never moves them: a moving nodePort would
    silently break every LB pointing at the old one. Fresh values are
    allocated from a hash of the service key, then the next free port (or
    address of *service_cidr*), so the same lab file always gets the same
    ports and ClusterIPs, across applies and across ``down``/``up``.

    Given values are claimed before anything is kept or allocated, so an
    allocation never takes one. A given clusterIP that another existing
    service holds (it was allocated to it earlier) is refused with
    ``LabSpecError``, as the API server refuses it: silently moving that
    service's VIP would break its clients. (``LabSpec`` has already refused
    given clusterIPs that are malformed, outside the CIDR, or given twice.)

    IP families (``_families``): ``ipFamilies`` as given, else the families of
    the given clusterIPs, else IPv4; a dual-stack policy in a *dual_stack* lab
    adds the other family. Each family gets its own ClusterIP (kept, given or
    allocated as above), ``clusterIPs`` lists them in ``ipFamilies`` order.
    """
    previous = previous or {}
    cidr = ipaddress.IPv4Network(service_cidr)
    cidr6 = ipaddress.IPv6Network(SERVICE_CIDR6)
    resolved = [default_service(s, dual_stack) for s in services]
    resolved.sort(key=service_key)
    problems: list[str] = []

    # Values the user gave, or that the previous round allocated, are taken.
    used_ports: set[int] = set()
    used_ips: set[str] = set()
    for svc in resolved:
        spec = svc["spec"]
        used_ports.update(p["nodePort"] for p in spec.get("ports", []) if p.get("nodePort"))
        if spec.get("healthCheckNodePort"):
            used_ports.add(spec["healthCheckNodePort"])
        if spec.get("clusterIP") not in (None, "", "None"):
            used_ips.add(spec["clusterIP"])
        used_ips.update(ip for ip in spec.get("clusterIPs") or [] if ip not in ("", "None"))

    # Who holds which address from earlier rounds, unless it now names its own.
    keys = {service_key(s): s for s in resolved}
    holders = {ip: key for key, old in previous.items()
               if key in keys and not keys[key]["spec"].get("clusterIP")
               and (ip := (old.get("spec") or {}).get("clusterIP")) not in (None, "", "None")}
    for key, svc in keys.items():
        ip = svc["spec"].get("clusterIP")
        if holders.get(ip, key) != key:
            problems.append(f"Service {key}: spec.clusterIP: {ip} is already allocated to"
                            f" {holders[ip]}")
    if problems:
        raise LabSpecError(problems, "apply")

    for svc in resolved:
        key = service_key(svc)
        spec = svc["spec"]
        old = previous.get(key)
        old_spec = (old or {}).get("spec", {})
        meta = svc["metadata"]
        meta.setdefault("uid", (old or {}).get("metadata", {}).get("uid")
                        or _stable_uid("Service", key))
        if _needs_node_ports(spec) and _needs_node_ports(old_spec):
            old_by_name = {p.get("name", ""): p.get("nodePort")
                           for p in old_spec.get("ports", [])}
            for p in spec["ports"]:
                np = old_by_name.get(p.get("name", ""))
                if not p.get("nodePort") and np and np not in used_ports:
                    p["nodePort"] = np
                    used_ports.add(np)
        if (_needs_hc_port(spec) and _needs_hc_port(old_spec)
                and not spec.get("healthCheckNodePort")):
            hc = old_spec.get("healthCheckNodePort")
            if hc and hc not in used_ports:
                spec["healthCheckNodePort"] = hc
                used_ports.add(hc)
        if spec["type"] != "ExternalName" and not spec.get("clusterIP"):
            ip = old_spec.get("clusterIP")
            if ip and ip != "None" and ip not in used_ips and ipaddress.ip_address(ip) in cidr:
                spec["clusterIP"] = ip
                used_ips.add(ip)
        if spec["type"] != "ExternalName" and spec.get("clusterIP") != "None":
            # A kept IPv6 ClusterIP, if this round still wants one and names none.
            given6 = [ip for ip in spec.get("clusterIPs") or [] if ":" in ip]
            old6 = [ip for ip in old_spec.get("clusterIPs") or [] if ":" in ip]
            if (not given6 and old6 and old6[0] not in used_ips
                    and ipaddress.ip_address(old6[0]) in cidr6):
                spec["_kept6"] = old6[0]
                used_ips.add(old6[0])

    for svc in resolved:
        key = service_key(svc)
        spec = svc["spec"]
        if _needs_node_ports(spec):
            for i, p in enumerate(spec["ports"]):
                if not p.get("nodePort"):
                    p["nodePort"] = _allocate_port(f"{key}/{p.get('name') or i}", used_ports)
        if _needs_hc_port(spec) and not spec.get("healthCheckNodePort"):
            spec["healthCheckNodePort"] = _allocate_port(f"{key}/healthCheckNodePort",
                                                         used_ports)
        if spec["type"] != "ExternalName":
            kept6 = spec.pop("_kept6", None)
            if spec.get("clusterIP") == "None":
                spec["clusterIPs"] = ["None"]
                continue
            families = _families(spec, dual_stack)
            given = {_family(ip): ip for ip in [spec.get("clusterIP"),
                                               *(spec.get("clusterIPs") or [])] if ip}
            if kept6 and "IPv6" not in given:
                given["IPv6"] = kept6
            ips: list[str] = []
            for fam in families:
                ip = given.get(fam)
                if ip is None:
                    where = cidr if fam == "IPv4" else cidr6
                    ip = _allocate_ip(key if fam == "IPv4" else f"{key}/IPv6", used_ips, where)
                    if ip is None:
                        problems.append(
                            f"Service {key}: spec.clusterIP: no free address left in the"
                            f" service CIDR {where} (cluster.serviceCIDR)" if fam == "IPv4" else
                            f"Service {key}: spec.clusterIPs[{len(ips)}]: no free address left"
                            f" in the lab's IPv6 service CIDR {where}")
                        break
                ips.append(ip)
            else:
                spec["clusterIP"] = ips[0]
                spec["clusterIPs"] = ips
                spec["ipFamilies"] = families
                spec.setdefault("ipFamilyPolicy", "SingleStack")
    if problems:
        raise LabSpecError(problems, "apply")
    return resolved


def _family(ip: str) -> str:
    return "IPv6" if ":" in ip else "IPv4"


def _families(spec: Mapping[str, Any], dual_stack: bool) -> list[str]:
    """``ipFamilies`` as the API server resolves it (``lab.spec`` validated the input).

    Given families stand; else the given clusterIPs' families; else IPv4 (the
    lab's primary family). A dual-stack policy in a dual-stack lab then adds
    the missing family; in an IPv4-only lab PreferDualStack stays single.
    """
    fams = list(spec.get("ipFamilies") or [])
    if not fams:
        fams = [_family(ip) for ip in spec.get("clusterIPs") or [spec.get("clusterIP") or ""]
                if ip] or ["IPv4"]
    if (dual_stack and len(fams) == 1
            and spec.get("ipFamilyPolicy") in ("PreferDualStack", "RequireDualStack")):
        fams.append("IPv6" if fams[0] == "IPv4" else "IPv4")
    return fams


def _allocate_port(seed: str, used: set[int]) -> int:
    span = NODE_PORT_MAX - NODE_PORT_MIN + 1
    start = _hash_int(seed) % span
    for i in range(span):
        port = NODE_PORT_MIN + (start + i) % span
        if port not in used:
            used.add(port)
            return port
    raise ValueError("the nodePort range 30000-32767 is exhausted")


def _allocate_ip(seed: str, used: set[str],
                 cidr: ipaddress.IPv4Network | ipaddress.IPv6Network = SERVICE_CIDR
                 ) -> str | None:
    """The first free address from the hash of *seed* on, in *cidr*; None when it is full."""
    base = int(cidr.network_address)
    span = cidr.num_addresses
    start = _hash_int(seed) % span
    for i in range(span):
        offset = (start + i) % span
        if offset < RESERVED_OFFSETS or offset == span - 1:
            continue
        ip = str(ipaddress.ip_address(base + offset))
        if ip not in used:
            used.add(ip)
            return ip
    return None


def load_balancer_status(services: Sequence[Mapping[str, Any]], fronted: str | None,
                         ingress_ip: str, ip_mode: str = "VIP") -> list[dict[str, Any]]:
    """*services* with ``status.loadBalancer`` as the lab's cloud controller writes it.

    The service the lab's LB fronts (*fronted*, ``namespace/name``) gets the
    LB's address as its one ingress, with *ip_mode* (``VIP``: proxies may
    short-circuit in-cluster traffic to it; ``Proxy``: they must let it go
    to the LB). Other LoadBalancer services stay pending (``loadBalancer:
    {}``, what ``kubectl`` shows as ``<pending>``), as on a cluster whose LB
    controller serves one service; other types get no status.
    """
    out = []
    for svc in services:
        svc = dict(svc)
        svc.pop("status", None)
        if svc["spec"].get("type") == "LoadBalancer":
            lb: dict[str, Any] = {}
            if service_key(svc) == fronted:
                lb["ingress"] = [{"ip": ingress_ip, "ipMode": ip_mode}]
            svc["status"] = {"loadBalancer": lb}
        out.append(svc)
    return out


# --- the EndpointSlice controller's part -------------------------------------------


def _selects(selector: Mapping[str, str], labels: Mapping[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def _resolve_ports(svc: Mapping[str, Any], pod: PodState) -> tuple[tuple[str, int, str], ...]:
    """``getEndpointPorts``: service ports with targetPort resolved against *pod*.

    A numeric targetPort is used as is (the pod need not declare it); a named
    one must match the pod's container port name, else that port is skipped
    for this pod, as ``podutil.FindPort`` makes the controller do.
    """
    out = []
    for p in svc["spec"].get("ports", []):
        tp = p.get("targetPort", p.get("port"))
        if isinstance(tp, str):
            if pod.port_name != tp:
                continue
            tp = pod.port
        out.append((p.get("name", ""), int(tp), p.get("protocol", "TCP")))
    return tuple(out)


def _endpoint(svc: Mapping[str, Any], pod: PodState, address: str) -> dict[str, Any]:
    serving = pod.ready
    terminating = pod.terminating
    publish = bool(svc["spec"].get("publishNotReadyAddresses", False))
    ready = publish or (serving and not terminating)
    return {
        "addresses": [address],
        "conditions": {"ready": ready, "serving": serving, "terminating": terminating},
        "nodeName": pod.node,
        "targetRef": {"kind": "Pod", "namespace": pod.namespace, "name": pod.name,
                      "uid": pod.uid or _stable_uid("Pod", f"{pod.namespace}/{pod.name}")},
    }


def _slice_name(svc_name: str, seed: str) -> str:
    """generateName ``<service>-`` plus 5 characters, here from a hash, not a RNG."""
    alphabet = "bcdfghjklmnpqrstvwxz2456789"  # the apiserver's generateName alphabet
    n = _hash_int(seed)
    suffix = ""
    for _ in range(5):
        n, r = divmod(n, len(alphabet))
        suffix += alphabet[r]
    return f"{svc_name[:57]}-{suffix}"


def endpoint_slices(services: Sequence[Mapping[str, Any]], pods: Sequence[PodState],
                    trigger_times: Mapping[str, str] | None = None) -> list[dict[str, Any]]:
    """The discovery.k8s.io/v1 EndpointSlices for resolved *services* and *pods*.

    *trigger_times* maps a service key to an RFC 3339 time for the
    ``last-change-trigger-time`` annotation (see ``stamp_trigger_times``).
    """
    trigger_times = trigger_times or {}
    out: list[dict[str, Any]] = []
    for svc in sorted(services, key=service_key):
        spec = svc["spec"]
        if spec.get("type") == "ExternalName" or not spec.get("selector"):
            continue
        meta = svc["metadata"]
        ns, name = meta["namespace"], meta["name"]
        key = f"{ns}/{name}"
        for family in spec.get("ipFamilies") or ["IPv4"]:
            groups: dict[tuple[tuple[str, int, str], ...], list[dict[str, Any]]] = {}
            for pod in sorted(pods, key=lambda p: (p.namespace, p.name)):
                address = pod.ip_of(family)
                if (address is None or pod.namespace != ns
                        or not _selects(spec["selector"], pod.labels)):
                    continue
                ports = _resolve_ports(svc, pod)
                if not ports and spec.get("ports"):
                    continue
                groups.setdefault(ports, []).append(_endpoint(svc, pod, address))
            if not groups:
                groups[()] = []  # the placeholder slice
            for ports, endpoints in sorted(groups.items()):
                chunks = [endpoints[i:i + MAX_ENDPOINTS_PER_SLICE]
                          for i in range(0, len(endpoints), MAX_ENDPOINTS_PER_SLICE)] or [[]]
                for n, chunk in enumerate(chunks):
                    out.append(_slice(svc, key, ports, chunk, n, trigger_times.get(key),
                                      family))
    return out


def _slice(svc: Mapping[str, Any], key: str, ports: tuple[tuple[str, int, str], ...],
           endpoints: list[dict[str, Any]], n: int, trigger: str | None,
           family: str = "IPv4") -> dict[str, Any]:
    """One slice of *family*: ``<service>-<5 chars>`` like an IPv4 one (a different seed)."""
    seed = f"{key}/{ports}/{n}" if family == "IPv4" else f"{key}/{family}/{ports}/{n}"
    meta = svc["metadata"]
    labels = dict(meta.get("labels") or {})
    labels[SERVICE_NAME_LABEL] = meta["name"]
    labels["endpointslice.kubernetes.io/managed-by"] = MANAGED_BY
    if svc["spec"].get("clusterIP") == "None":
        labels["service.kubernetes.io/headless"] = ""
    slice_meta: dict[str, Any] = {
        "name": _slice_name(meta["name"], seed),
        "namespace": meta["namespace"],
        "labels": labels,
        "ownerReferences": [{"apiVersion": "v1", "kind": "Service", "name": meta["name"],
                             "uid": meta.get("uid", ""), "controller": True,
                             "blockOwnerDeletion": True}],
    }
    if trigger:
        slice_meta["annotations"] = {TRIGGER_TIME_ANNOTATION: trigger}
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": slice_meta,
        "addressType": family,
        "endpoints": endpoints,
        "ports": [{"name": pname, "port": port, "protocol": proto}
                  for pname, port, proto in ports],
    }


def rfc3339(ts: float) -> str:
    """A UNIX time as the controller writes it (UTC, 'Z'), with microseconds."""
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def slice_fingerprints(slices: Sequence[Mapping[str, Any]]) -> dict[str, str]:
    """Per service key, a digest of its slices without the trigger-time annotation."""
    by_svc: dict[str, list[Any]] = {}
    for s in slices:
        meta = s["metadata"]
        key = f"{meta['namespace']}/{meta['labels'][SERVICE_NAME_LABEL]}"
        body = copy.deepcopy(dict(s))
        body["metadata"].pop("annotations", None)
        by_svc.setdefault(key, []).append(body)
    return {k: hashlib.sha256(json.dumps(v, sort_keys=True).encode()).hexdigest()
            for k, v in by_svc.items()}


def stamp_trigger_times(old_fingerprints: Mapping[str, str], old_times: Mapping[str, str],
                        new_fingerprints: Mapping[str, str], now: float) -> dict[str, str]:
    """Trigger times after a change: *now* for every service whose slices changed.

    The real controller stamps the time of the pod or service change that
    caused a slice update; the lab applies changes the moment they happen,
    so "now" at write time is that moment. Unchanged services keep theirs,
    which is what keeps kube-proxy's network-programming latency honest.
    """
    stamp = rfc3339(now)
    return {k: (old_times[k] if old_fingerprints.get(k) == fp and k in old_times else stamp)
            for k, fp in new_fingerprints.items()}


# --- nodes and the whole state -----------------------------------------------------


def node_objects(nodes: Sequence[NodeInfo]) -> list[dict[str, Any]]:
    """v1 Nodes as the kubelet registers them: InternalIP and Hostname addresses.

    A dual-stack node has two InternalIPs (IPv4 first, as ``--node-ip=v4,v6``
    registers them) and an IPv6 second entry in ``spec.podCIDRs``.

    A node's ``fields`` (a mirrored cluster's) add its labels, its taints and
    its deletionTimestamp: kpx reads them (a node being deleted fails /healthz).
    """
    out = []
    for n in nodes:
        labels = {"kubernetes.io/hostname": n.name, "kubernetes.io/os": "linux",
                  **(n.fields.get("labels") or {})}
        meta: dict[str, Any] = {"name": n.name, "uid": _stable_uid("Node", n.name),
                                "labels": labels}
        if n.fields.get("deletionTimestamp"):
            meta["deletionTimestamp"] = n.fields["deletionTimestamp"]
        cidrs = [c for c in n.pod_cidr.split(",") if c] + ([n.pod_cidr6] if n.pod_cidr6 else [])
        spec: dict[str, Any] = {"podCIDR": cidrs[0], "podCIDRs": cidrs} if cidrs else {}
        if n.fields.get("taints"):
            spec["taints"] = copy.deepcopy(list(n.fields["taints"]))
        out.append({
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": meta,
            "spec": spec,
            "status": {"addresses": [{"type": "InternalIP", "address": n.ip},
                                     *([{"type": "InternalIP", "address": n.ip6}]
                                       if n.ip6 else []),
                                     {"type": "Hostname", "address": n.name}]},
        })
    return out


def state_documents(nodes: Sequence[NodeInfo], services: Sequence[Mapping[str, Any]],
                    slices: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Everything ``kpx node`` reads, in the order a human expects to scan it."""
    svcs = [{"apiVersion": "v1", "kind": "Service", **{k: copy.deepcopy(v) for k, v in s.items()
                                                       if k not in ("apiVersion", "kind")}}
            for s in services]
    return [*node_objects(nodes), *svcs, *(copy.deepcopy(dict(s)) for s in slices)]
