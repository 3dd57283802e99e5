"""One list of what kube-proxy watches, written down: the cluster as a state file.

Owns: ``take_snapshot``: every Node (kube-proxy's informer lists only its own,
but a snapshot is of the cluster, and ``kpx lab up --from-state`` needs them
all), and the Services and EndpointSlices kube-proxy's label selector lets
through (``PROXY_LABEL_SELECTOR``: no headless, no other service proxy's),
each listed once, paginated, as a quorum read; ``trim``, which keeps what a
reader of a state file uses and drops the noise (``managedFields``, the
last-applied annotation, a Node's images and heartbeats); and ``render``, the
``kind: List`` that ``kubectl get -o yaml`` prints, which ``kpx check``,
``kpx node --state`` and the lab all read.

Never: watch, retry, or write to the API server. The lists go through the API
source's own machinery (``KubeAPISource.list_once``: the same requests, headers,
credentials, TLS and per-object preparation as ``kpx node`` uses), so a
snapshot sees the cluster exactly as kpx would; a failure is raised as
``SnapshotError`` with what the server said, for the command to print.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from typing import Any

import yaml

from proxy.sources.hub import StateHub
from proxy.sources.kubeapi import PAGE_SIZE, APIError, KubeAPISource, ListError
from proxy.sources.kubeconfig import KubeConfig

NOISE_ANNOTATIONS = frozenset({"kubectl.kubernetes.io/last-applied-configuration"})
"""An annotation that repeats the whole object as it was last applied."""
NOISE_METADATA = frozenset({"managedFields", "creationTimestamp", "generation", "selfLink",
                            "ownerReferences", "finalizers", "generateName"})
"""Bookkeeping no proxy reads; ``deletionTimestamp`` stays (a Node being deleted
fails kube-proxy's health check)."""
NODE_STATUS_KEPT = ("addresses",)
"""A Node's status is mostly heartbeats and images; kpx reads its addresses."""

__all__ = ["SnapshotError", "render", "take_snapshot", "trim"]


class SnapshotError(Exception):
    """The cluster could not be listed; the message says which list and why."""


async def take_snapshot(config: KubeConfig, page_size: int = PAGE_SIZE) -> list[dict[str, Any]]:
    """Every Node, and the Services and EndpointSlices kube-proxy watches, trimmed."""
    source = KubeAPISource(config, StateHub(), "", page_size=page_size)
    try:
        lists = await source.list_once(all_nodes=True, user_agent="kpx snapshot")
    except ListError as e:
        if isinstance(e.cause, APIError):
            hint = (" (the account needs list on nodes, services and"
                    " endpointslices.discovery.k8s.io)" if e.cause.code in (401, 403) else "")
            raise SnapshotError(f"{e}{hint}") from None
        text = str(e.cause) or type(e.cause).__name__
        raise SnapshotError(f"listing {e.plural} from {config.server}: {text}") from None
    return [trim(obj) for objects in lists.values() for obj in objects]


def trim(obj: Mapping[str, Any]) -> dict[str, Any]:
    """*obj* without what no reader of a state file needs; ``kind`` and ``apiVersion`` first."""
    src = copy.deepcopy(dict(obj))
    out: dict[str, Any] = {"apiVersion": src.pop("apiVersion", None), "kind": src.pop("kind", None)}
    meta = src.pop("metadata", None) or {}
    for key in NOISE_METADATA:
        meta.pop(key, None)
    notes = {k: v for k, v in (meta.get("annotations") or {}).items()
             if k not in NOISE_ANNOTATIONS}
    if notes:
        meta["annotations"] = notes
    else:
        meta.pop("annotations", None)
    out["metadata"] = meta
    if out["kind"] == "Node" and isinstance(src.get("status"), dict):
        src["status"] = {k: v for k, v in src["status"].items() if k in NODE_STATUS_KEPT}
    out.update(src)
    return out


def render(objects: Iterable[Mapping[str, Any]]) -> str:
    """A ``kind: List``, as ``kubectl get nodes,svc,endpointslices -A -o yaml`` prints one."""
    doc = {"apiVersion": "v1", "kind": "List", "metadata": {"resourceVersion": ""},
           "items": [dict(o) for o in objects]}
    return yaml.safe_dump(doc, sort_keys=False, default_flow_style=False)
