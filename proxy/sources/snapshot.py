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
source's own machinery (``KubeAPISource._list``: the same requests, headers,
credentials, TLS and per-object preparation as ``kpx node`` uses), so a
snapshot sees the cluster exactly as kpx would; a failure is raised as
``SnapshotError`` with what the server said, for the command to print.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from typing import Any

import aiohttp
import yaml

from proxy.sources.hub import StateHub
from proxy.sources.kubeapi import (
    PAGE_SIZE,
    PROXY_LABEL_SELECTOR,
    APIError,
    KubeAPISource,
    KubeConfig,
    _StreamError,
)

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


class _Lister(KubeAPISource):
    """The API source's list machinery, without its cache-to-state sync."""

    def _changed(self) -> None:
        """A snapshot builds no state while it lists."""


async def take_snapshot(config: KubeConfig, page_size: int = PAGE_SIZE) -> list[dict[str, Any]]:
    """Every Node, and the Services and EndpointSlices kube-proxy watches, trimmed."""
    lister = _Lister(config, StateHub(), "", page_size=page_size)
    nodes, services, slices = lister._kinds
    nodes.selectors = {}  # all of them, not kube-proxy's own node
    services.selectors = slices.selectors = {"labelSelector": PROXY_LABEL_SELECTOR}
    ssl = lister._ssl if lister._ssl is not None else True
    headers = {"Accept": "application/json", "User-Agent": "kpx snapshot"}
    out: list[dict[str, Any]] = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=ssl),
                                     headers=headers) as session:
        lister._session = session
        for kind in lister._kinds:
            kind.list_from = ""  # a quorum read: the cluster now, not the watch cache
            try:
                await lister._list(kind)
            except APIError as e:
                hint = (" (the account needs list on nodes, services and"
                        " endpointslices.discovery.k8s.io)" if e.code in (401, 403) else "")
                raise SnapshotError(f"listing {kind.plural}: {e}{hint}") from None
            except (aiohttp.ClientError, TimeoutError, _StreamError) as e:
                text = str(e) or type(e).__name__
                raise SnapshotError(f"listing {kind.plural} from {config.server}: {text}"
                                    ) from None
            out += [trim(obj) for _, obj in sorted(kind.objects.items())]
    return out


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
