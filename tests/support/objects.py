"""Kubernetes objects as plain dicts, shaped the way ``kubectl get -o yaml`` prints them.

The one set of builders every test uses to write kpx's input (a state file,
a fake API server's objects, a lab file's services). Each returns a fresh
dict, so a test may patch it freely; every default can be overridden, and a
field given as ``None`` is left out (to test the parser's own defaults).

- ``node(name="node-a", *ips, **labels)``: a Node with InternalIP addresses,
  the ``kubernetes.io/hostname`` label and a Ready condition.
- ``service(name="web", node_port=30080, target_port=8080, *, type=,
  etp=, hc_port=, cluster_ip=, port=, port_name=, protocol=, ports=,
  selector=, affinity_seconds=, session_affinity=, labels=, meta=,
  status=, namespace=, **spec)``: a one-port NodePort Service (or
  LoadBalancer, ClusterIP, ...); ``spec`` keys are set last and win.
- ``service_port(port=80, target_port=8080, node_port=30080, *, name=,
  protocol=)``: one entry of ``spec.ports``.
- ``endpoint(ip, node="node-a", *, ready=True, serving=None,
  terminating=None, pod=None, **fields)``: one entry of an EndpointSlice's
  ``endpoints``; conditions left at ``None`` are not printed (nil).
- ``endpoint_slice(service="web", *endpoints, port=8080, port_name="",
  protocol="TCP", ports=None, name=None, namespace=, labels=,
  address_type=)``: an EndpointSlice; each endpoint is an IP string (ready,
  on node-a), an ``(ip, node)`` tuple or an ``endpoint()`` dict.
- ``slice_port(port=8080, name="", protocol="TCP")``: one entry of its ``ports``.
- ``kubectl_list(*objects)``: the ``kind: List`` dict kubectl prints.
- ``state_yaml(*objects, as_list=False)``: YAML text, a multi-document
  stream or (``as_list=True``) one ``kind: List``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import yaml

NODE = "node-a"
"""The node name builders default to."""
SERVICE_NAME_LABEL = "kubernetes.io/service-name"

__all__ = [
    "NODE",
    "endpoint",
    "endpoint_slice",
    "kubectl_list",
    "node",
    "service",
    "service_port",
    "slice_port",
    "state_yaml",
]

Obj = dict[str, Any]


class _Default:
    """The default of a parameter whose ``None`` means "leave the field out"."""

    def __repr__(self) -> str:
        return "DEFAULT"


DEFAULT: Any = _Default()


def _metadata(name: str, namespace: str | None, labels: Mapping[str, str] | None,
              meta: Mapping[str, Any] | None) -> Obj:
    out: Obj = {"name": name}
    if namespace is not None:
        out["namespace"] = namespace
    if labels is not None:
        out["labels"] = dict(labels)
    out.update(meta or {})
    return out


def node(name: str = NODE, *ips: str, **labels: str) -> Obj:
    """A Node: one InternalIP per ``ips`` (none given: no addresses), labels as given."""
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name, **labels}},
        "status": {
            "addresses": [{"type": "InternalIP", "address": ip} for ip in ips],
            "conditions": [{"type": "Ready", "status": "True", "lastHeartbeatTime": "t0"}],
        },
    }


def service_port(port: int = 80, target_port: int | str | None = 8080,
                 node_port: int | None = 30080, *, name: str | None = "",
                 protocol: str | None = "TCP") -> Obj:
    """One ``spec.ports`` entry; an empty or ``None`` name/protocol is not printed."""
    out: Obj = {}
    if name:
        out["name"] = name
    out["port"] = port
    if protocol is not None:
        out["protocol"] = protocol
    if target_port is not None:
        out["targetPort"] = target_port
    if node_port is not None:
        out["nodePort"] = node_port
    return out


def service(
    name: str = "web",
    node_port: int | None = 30080,
    target_port: int | str | None = 8080,
    *,
    namespace: str | None = "default",
    type: str = "NodePort",
    etp: str | None = None,
    hc_port: int | None = None,
    cluster_ip: str | None = "10.96.0.10",
    port: int = 80,
    port_name: str | None = "",
    protocol: str | None = "TCP",
    ports: list[Obj] | None = DEFAULT,
    selector: Mapping[str, str] | None = None,
    affinity_seconds: int | None = None,
    session_affinity: str | None = None,
    labels: Mapping[str, str] | None = None,
    meta: Mapping[str, Any] | None = None,
    status: Mapping[str, Any] | None = None,
    **spec: Any,
) -> Obj:
    """A Service with one port ``port -> target_port`` on ``node_port`` (or ``ports``).

    ``etp`` is ``spec.externalTrafficPolicy``, ``hc_port`` its
    ``healthCheckNodePort``; ``affinity_seconds`` makes it ClientIP affinity
    with that timeout. ``meta`` adds metadata fields (uid, managedFields...),
    ``status`` is the object's status. ``ports=None``: no ``spec.ports``.
    """
    body: Obj = {"type": type}
    if cluster_ip is not None:
        body["clusterIP"] = cluster_ip
    if selector is not None:
        body["selector"] = dict(selector)
    if etp is not None:
        body["externalTrafficPolicy"] = etp
    if hc_port is not None:
        body["healthCheckNodePort"] = hc_port
    if ports is DEFAULT:
        ports = [service_port(port, target_port, node_port, name=port_name, protocol=protocol)]
    if ports is not None:
        body["ports"] = ports
    if affinity_seconds is not None:
        body["sessionAffinity"] = session_affinity or "ClientIP"
        body["sessionAffinityConfig"] = {"clientIP": {"timeoutSeconds": affinity_seconds}}
    elif session_affinity is not None:
        body["sessionAffinity"] = session_affinity
    body.update(spec)
    out: Obj = {"apiVersion": "v1", "kind": "Service",
                "metadata": _metadata(name, namespace, labels, meta), "spec": body}
    if status is not None:
        out["status"] = dict(status)
    return out


def endpoint(ip: str, node: str | None = NODE, *, ready: bool | None = True,
             serving: bool | None = None, terminating: bool | None = None,
             pod: str | None = None, **fields: Any) -> Obj:
    """One endpoint; ``pod`` names its targetRef (default ``pod-<ip>``, ``""`` for none)."""
    out: Obj = {"addresses": [ip]}
    conditions = {k: v for k, v in
                  (("ready", ready), ("serving", serving), ("terminating", terminating))
                  if v is not None}
    out["conditions"] = conditions
    if node is not None:
        out["nodeName"] = node
    if pod != "":
        out["targetRef"] = {"kind": "Pod", "name": pod or f"pod-{ip}"}
    out.update(fields)
    return out


def slice_port(port: int = 8080, name: str = "", protocol: str | None = "TCP") -> Obj:
    out: Obj = {"name": name, "port": port}
    if protocol is not None:
        out["protocol"] = protocol
    return out


def endpoint_slice(
    service: str | None = "web",
    *endpoints: str | tuple[str, str | None] | Obj,
    port: int = 8080,
    port_name: str = "",
    protocol: str | None = "TCP",
    ports: list[Obj] | None = DEFAULT,
    name: str | None = None,
    namespace: str = "default",
    labels: Mapping[str, str] | None = None,
    address_type: str = "IPv4",
) -> Obj:
    """An EndpointSlice of ``service`` (``None``: no service-name label; give ``name``).

    Endpoints: ``"10.0.0.1"`` (ready, on node-a), ``("10.0.0.1", "node-b")``
    or an ``endpoint(...)`` dict. The name defaults to ``<service>-abc``;
    ``ports`` replaces the one port ``port_name``/``port`` (``None``: no ports).
    """
    all_labels = {SERVICE_NAME_LABEL: service} if service is not None else {}
    all_labels.update(labels or {})
    if name is None:
        assert service is not None, "a slice without a service needs a name"
        name = f"{service}-abc"
    eps = [e if isinstance(e, dict) else endpoint(e) if isinstance(e, str) else endpoint(*e)
           for e in endpoints]
    out: Obj = {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {"name": name, "namespace": namespace, "labels": all_labels},
        "addressType": address_type,
        "endpoints": eps,
    }
    if ports is DEFAULT:
        ports = [slice_port(port, port_name, protocol)]
    if ports is not None:
        out["ports"] = ports
    return out


def kubectl_list(*objects: Obj) -> Obj:
    """What ``kubectl get ... -o yaml`` prints for several objects: one List."""
    return {"apiVersion": "v1", "kind": "List", "items": list(objects),
            "metadata": {"resourceVersion": ""}}


def state_yaml(*objects: Obj, as_list: bool = False) -> str:
    """YAML text: one document per object, or one ``kind: List`` with ``as_list``."""
    if as_list:
        return yaml.safe_dump(kubectl_list(*objects), sort_keys=False)
    return yaml.safe_dump_all(objects, sort_keys=False)
