"""The proxy's own health: ``ProxyHealth`` and its ``/healthz`` and ``/livez`` server.

Owns:
- ``ProxyHealth``: kube-proxy's ``ProxyHealthServer`` bookkeeping
  (``pkg/proxy/healthcheck/proxy_health.go``): ``queued``/``updated`` as
  snapshots are published and applied, faults (a dataplane part known to be
  broken), and the node's eligibility as the proxier last saw it
  (``sync_node``). Every health answer of the process reads this one object.
- ``NodeHealthServer``: kube-proxy's newest handlers on
  ``--healthz-bind-address`` (default ``0.0.0.0:10256``): ``/healthz``
  (proxy health *and* node eligibility) and ``/livez`` (proxy health only),
  JSON in ``json.Marshal`` form, Go's ``404 page not found`` for any other
  path.

Never: look at a snapshot or a Node. The proxier hands over plain data
(``sync_node(eligible)``); this module only keeps and reports it.

Health follows upstream exactly: 200 iff no update has been pending for the
health timeout (2 x sync period) and, for ``/healthz`` only, the Node exists
and is neither being deleted nor tainted ``ToBeDeletedByClusterAutoscaler``.
When healthy, the top-level ``lastUpdated`` is "now", as upstream keeps it for
compatibility with older releases; the per-family status keeps the real time.
A *fault* (``set_fault``, e.g. the transparent return path deleted and not
restorable) makes the proxy unhealthy until cleared: the rules kube-proxy
would have failed to apply.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from aiohttp.web_request import BaseRequest

from healthz.http import JSON_HEADERS, GoResponse, go_not_found, go_response
from healthz.metrics import HEALTHZ_TOTAL, LIVEZ_TOTAL


def rfc3339nano(ts: float) -> str:
    """A UNIX time as Go's ``time.Time`` marshals to JSON (RFC3339Nano, UTC).

    Go trims trailing zeros of the fraction and drops it entirely on a whole
    second, so ``...:05.1Z`` and ``...:05Z`` are both valid outputs.
    """
    # Split before scaling: ``ts * 1e9`` would round away the fraction's last
    # digits, while ``ts - floor(ts)`` is exact.
    secs = math.floor(ts)
    frac = round((ts - secs) * 1_000_000_000)
    if frac == 1_000_000_000:
        secs, frac = secs + 1, 0
    text = datetime.fromtimestamp(secs, tz=UTC).strftime("%Y-%m-%dT%H:%M:%S")
    if frac:
        text += "." + f"{frac:09d}".rstrip("0")
    return text + "Z"


class ProxyHealth:
    """kube-proxy's proxier health: healthy unless an update is pending too long.

    The node is not eligible until the proxier says otherwise: an unknown
    node is not eligible, as in the newest kube-proxy (which reads it from
    its NodeManager).
    """

    def __init__(self, timeout: float = 60.0, clock: Callable[[], float] = time.time) -> None:
        self.timeout = timeout
        self._clock = clock
        self.last_updated: float = clock()
        self.oldest_pending: float | None = None
        self.node_eligible = False
        """Whether the Node exists and is neither deleted nor marked for removal."""
        self.faults: dict[str, str] = {}
        """Known-broken dataplane parts (name -> why), e.g. a return path that
        cannot be restored: the rules are not in force, which is what an
        update that never applies means upstream, so health fails alike."""

    def queued(self) -> None:
        if self.oldest_pending is None:
            self.oldest_pending = self._clock()

    def updated(self) -> None:
        self.oldest_pending = None
        self.last_updated = self._clock()

    def sync_node(self, eligible: bool) -> None:
        """kube-proxy's ``SyncNode``: the proxier's view of this node, as data."""
        self.node_eligible = eligible

    def set_fault(self, name: str, why: str) -> None:
        self.faults[name] = why

    def clear_fault(self, name: str) -> None:
        self.faults.pop(name, None)

    def healthy(self) -> bool:
        if self.faults:
            return False
        if self.oldest_pending is None:
            return True
        return self._clock() - self.oldest_pending < self.timeout

    def now(self) -> float:
        return self._clock()


class NodeHealthServer:
    """Answers ``/healthz`` and ``/livez`` from the shared ``ProxyHealth``."""

    def __init__(self, health: ProxyHealth) -> None:
        self.health = health

    def answer(self, request: BaseRequest) -> GoResponse:
        """A ``ServeMux`` with exactly two routes; any method is accepted."""
        path = request.path
        if path == "/healthz":
            return self._respond(with_node=True)
        if path == "/livez":
            return self._respond(with_node=False)
        return go_not_found()

    def document(self, with_node: bool) -> tuple[bool, dict[str, Any]]:
        """``(answer 200?, ProxyHealth JSON object)``, field order as Go marshals it."""
        health = self.health
        proxy_healthy = health.healthy()
        now = health.now()
        last = health.last_updated
        eligible = health.node_eligible
        ok = proxy_healthy and (not with_node or eligible)
        doc: dict[str, Any] = {
            "lastUpdated": rfc3339nano(health.now() if ok else last),
            "currentTime": rfc3339nano(now),
        }
        if with_node:
            doc["nodeEligible"] = eligible
        doc["healthy"] = proxy_healthy
        doc["status"] = {"IPv4": {"lastUpdated": rfc3339nano(last), "healthy": proxy_healthy}}
        return ok, doc

    def _respond(self, with_node: bool) -> GoResponse:
        ok, doc = self.document(with_node)
        code = 200 if ok else 503
        counter = HEALTHZ_TOTAL if with_node else LIVEZ_TOTAL
        counter.labels(code=str(code)).inc()
        body = json.dumps(doc, separators=(",", ":")).encode()
        return go_response(code, JSON_HEADERS, body)
