"""Node-level answers: ``/healthz`` and ``/livez``, the metrics port, and the sync gauges.

Owns:
- ``NodeHealthServer``: kube-proxy's newest ``proxy_health.go`` on
  ``--healthz-bind-address`` (default ``0.0.0.0:10256``): ``/healthz`` (proxy
  health *and* node eligibility) and ``/livez`` (proxy health only), JSON in
  ``json.Marshal`` form, Go's ``404 page not found`` for any other path.
- ``MetricsServer``: ``/metrics``, ``/proxyMode`` and ``/healthz`` on
  ``--metrics-bind-address`` (default ``127.0.0.1:10249``).
- ``SyncMetrics``: the per-snapshot gauges the dataplane does not set,
  ``..._no_local_endpoints_total`` and ``network_programming_duration``.

Never: change ``ProxyHealth`` (the hub marks updates; this only reports),
observe the sync duration (the dataplane does; counting it here would double
it), or define metrics ``proxy.metrics`` already has.

Health follows upstream exactly: 200 iff no update has been pending for the
health timeout (2 x sync period) and, for ``/healthz`` only, the Node exists
and is neither being deleted nor tainted ``ToBeDeletedByClusterAutoscaler``.
When healthy, the top-level ``lastUpdated`` is "now", as upstream keeps it for
compatibility with older releases; the per-family status keeps the real time.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any, NamedTuple

from aiohttp.web_request import BaseRequest
from prometheus_client.exposition import choose_encoder

from healthz.http import GoResponse, go_not_found, go_response
from proxy.core.decision import PlanCache, build_plans
from proxy.core.model import Node, Snapshot
from proxy.metrics import (
    HEALTHZ_TOTAL,
    LIVEZ_TOTAL,
    NETWORK_PROGRAMMING_DURATION,
    NO_LOCAL_ENDPOINTS,
    REGISTRY,
)
from proxy.sources.hub import Prepared, ProxyHealth

log = logging.getLogger(__name__)

PROXY_MODE = "userspace"

_JSON_HEADERS = (("Content-Type", "application/json"), ("X-Content-Type-Options", "nosniff"))
_TEXT_HEADERS = (
    ("Content-Type", "text/plain; charset=utf-8"),
    ("X-Content-Type-Options", "nosniff"),
)


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


class NodeHealthServer:
    """Answers ``/healthz`` and ``/livez`` from the shared ``ProxyHealth`` and the Node.

    The Node comes from the latest snapshot; an unknown node is not eligible,
    as in the newest kube-proxy (which reads it from its NodeManager).
    """

    def __init__(self, health: ProxyHealth, node_name: str) -> None:
        self.health = health
        self.node_name = node_name
        self._node: Node | None = None

    def sync(self, snapshot: Snapshot) -> None:
        self._node = snapshot.node(self.node_name)

    @property
    def node_eligible(self) -> bool:
        return self._node is not None and self._node.eligible

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
        ok = proxy_healthy and (not with_node or self.node_eligible)
        doc: dict[str, Any] = {
            "lastUpdated": rfc3339nano(health.now() if ok else last),
            "currentTime": rfc3339nano(now),
        }
        if with_node:
            doc["nodeEligible"] = self.node_eligible
        doc["healthy"] = proxy_healthy
        doc["status"] = {"IPv4": {"lastUpdated": rfc3339nano(last), "healthy": proxy_healthy}}
        return ok, doc

    def _respond(self, with_node: bool) -> GoResponse:
        ok, doc = self.document(with_node)
        code = 200 if ok else 503
        counter = HEALTHZ_TOTAL if with_node else LIVEZ_TOTAL
        counter.labels(code=str(code)).inc()
        body = json.dumps(doc, separators=(",", ":")).encode()
        return go_response(code, _JSON_HEADERS, body)


class MetricsServer:
    """kube-proxy's metrics mux: ``/metrics``, ``/proxyMode`` and a plain ``/healthz``.

    ``/metrics`` negotiates the exposition format from ``Accept`` the way
    prometheus-client's own handler does (text 0.0.4 by default, OpenMetrics
    when asked), which is also what Go's promhttp does.
    """

    def __init__(self, registry: Any = REGISTRY, proxy_mode: str = PROXY_MODE) -> None:
        self.registry = registry
        self.proxy_mode = proxy_mode

    def answer(self, request: BaseRequest) -> GoResponse:
        path = request.path
        if path == "/metrics":
            encoder, content_type = choose_encoder(request.headers.get("Accept", ""))
            return go_response(200, [("Content-Type", content_type)], encoder(self.registry))
        if path == "/proxyMode":
            return go_response(200, _TEXT_HEADERS, self.proxy_mode.encode())
        if path == "/healthz":
            return go_response(200, _TEXT_HEADERS, b"ok")
        return go_not_found()


class _Measure(NamedTuple):
    """What one snapshot means for ``SyncMetrics``' gauges."""

    dropping: int
    """Plans that drop external traffic (no local endpoint)."""
    triggers: dict[tuple[str, str], float]
    """Every slice's ``last-change-trigger-time``, by (namespace, name)."""
    new_triggers: list[float]
    """The trigger times to observe: after start-up, and not seen before."""


class SyncMetrics:
    """The gauges that describe what each applied snapshot means for this node.

    ``no_local_endpoints_total{traffic_policy="external"}`` counts service
    ports with eTP=Local that have endpoints elsewhere but none here (their
    external traffic is dropped), exactly the plans the dataplane drops for.
    ``internal`` is always 0: kpx serves no ClusterIPs, so internal policy
    never drops.

    ``network_programming_duration`` is observed once per new
    ``last-change-trigger-time`` of a slice, and, as kube-proxy's tracker
    does, only for triggers after this process started: older ones measure
    our start-up, not the network.
    """

    def __init__(self, node_name: str, clock: Callable[[], float] = time.time) -> None:
        self.node_name = node_name
        self._clock = clock
        self._started = clock()
        self._triggers: dict[tuple[str, str], float] = {}
        self._plans = PlanCache()
        self._prepared: Prepared[tuple[dict[tuple[str, str], float], _Measure]] = Prepared()
        """``_measure`` of one snapshot against the trigger times then known, from ``prepare``."""

    def prepare(self, snapshot: Snapshot) -> None:
        """What ``sync`` needs of ``snapshot``, found now (a hub preparer's thread).

        Building the plans (70 ms cold for 10,000 NodePorts) and reading every
        slice for its trigger time (50,000 here) would otherwise run on the
        loop that answers /healthz; ``sync`` of this snapshot only sets gauges.
        """
        last = self._triggers
        self._prepared.put(snapshot, (last, self._measure(snapshot, last)))

    def _measure(self, snapshot: Snapshot, last: dict[tuple[str, str], float]) -> _Measure:
        """What ``snapshot`` means for the gauges, given the trigger times seen ``last``."""
        plans = build_plans(snapshot, self.node_name, cache=self._plans)
        dropping = sum(1 for plan in plans.values() if plan.drop_external)
        triggers: dict[tuple[str, str], float] = {}
        new: list[float] = []
        for sl in snapshot.slices:
            if sl.trigger_time is None:
                continue
            key = (sl.namespace, sl.name)
            triggers[key] = sl.trigger_time
            if sl.trigger_time > self._started and last.get(key) != sl.trigger_time:
                new.append(sl.trigger_time)
        return _Measure(dropping, triggers, new)

    def sync(self, snapshot: Snapshot) -> None:
        try:
            prepared = self._prepared.take(snapshot)
            if prepared is not None and prepared[0] is self._triggers:
                measure = prepared[1]
            else:
                measure = self._measure(snapshot, self._triggers)
            NO_LOCAL_ENDPOINTS.labels(traffic_policy="external").set(measure.dropping)
            NO_LOCAL_ENDPOINTS.labels(traffic_policy="internal").set(0)

            now = self._clock()
            for trigger in measure.new_triggers:
                NETWORK_PROGRAMMING_DURATION.observe(max(0.0, now - trigger))
            self._triggers = measure.triggers
        except Exception:
            log.exception("sync metrics for generation %d failed", snapshot.generation)
