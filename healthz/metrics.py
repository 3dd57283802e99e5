"""The ``/metrics`` registry and kube-proxy's metrics mux (``--metrics-bind-address``).

Owns: the counters of the health answers themselves (``kubeproxy_proxy_healthz``,
``kubeproxy_proxy_livez``); and ``MetricsServer``: ``/metrics``,
``/proxyMode`` and a plain ``/healthz``.

Never: import the proxier. Metrics flow in one direction: the proxier
imports ``healthz.registry`` and sets its own series on it; healthz serves them.
"""

from __future__ import annotations

from typing import Any

from aiohttp.web_request import BaseRequest
from prometheus_client import Counter, ProcessCollector
from prometheus_client.exposition import choose_encoder

from healthz.http import TEXT_HEADERS, GoResponse, go_not_found, go_response
from healthz.registry import REGISTRY

HEALTHZ_TOTAL = Counter(
    "kubeproxy_proxy_healthz",
    "Cumulative proxy healthz HTTP status",
    ["code"],
    registry=REGISTRY,
)
LIVEZ_TOTAL = Counter(
    "kubeproxy_proxy_livez",
    "Cumulative proxy livez HTTP status",
    ["code"],
    registry=REGISTRY,
)

# kube-proxy's registry (component-base legacyregistry) always carries the
# process collector: process_cpu_seconds_total, process_resident_memory_bytes,
# process_open_fds, process_start_time_seconds... that kube-proxy dashboards
# and alerts read for job="kube-proxy".
ProcessCollector(registry=REGISTRY)

PROXY_MODE = "userspace"
"""What ``/proxyMode`` says unless told otherwise: kube-proxy's name for a relay."""


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
            return go_response(200, TEXT_HEADERS, self.proxy_mode.encode())
        if path in ("/healthz", "/healthz/ping"):
            # k8s.io/apiserver healthz.InstallHandler: /healthz plus one path per
            # check, and kube-proxy installs the default "ping" check.
            return go_response(200, TEXT_HEADERS, b"ok")
        return go_not_found()
