"""The ``/metrics`` registry and kube-proxy's metrics mux (``--metrics-bind-address``).

Owns: the counters of the health answers themselves (``kubeproxy_proxy_healthz``,
``kubeproxy_proxy_livez``); and ``MetricsServer``: ``/metrics``,
``/proxyMode``, ``/configz`` and a plain ``/healthz``.

Never: import the proxier. Metrics flow in one direction: the proxier
imports ``healthz.registry`` and sets its own series on it; healthz serves them.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from aiohttp.web_request import BaseRequest
from prometheus_client import Counter, ProcessCollector
from prometheus_client.exposition import choose_encoder

from healthz.http import JSON_HEADERS, TEXT_HEADERS, GoResponse, go_not_found, go_response
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


# Go's encoding/json escapes these inside strings, so that JSON is safe in HTML;
# outside strings JSON has none of them, so replacing them everywhere is exact.
_GO_JSON_ESCAPES = {"<": "\\u003c", ">": "\\u003e", "&": "\\u0026",
                    "\u2028": "\\u2028", "\u2029": "\\u2029"}


def go_json(value: Any) -> bytes:
    """``json.Marshal(value)`` as Go writes it: compact, UTF-8, HTML-escaped, no newline.

    A dict is written in its own order: a Go struct is a dict in field order,
    a Go map one in sorted key order.
    """
    text = json.dumps(value, separators=(",", ":"), ensure_ascii=False)
    return text.translate(str.maketrans(_GO_JSON_ESCAPES)).encode()


class MetricsServer:
    """kube-proxy's metrics mux: ``/metrics``, ``/proxyMode``, ``/configz``, a plain ``/healthz``.

    ``/metrics`` negotiates the exposition format from ``Accept`` the way
    prometheus-client's own handler does (text 0.0.4 by default, OpenMetrics
    when asked), which is also what Go's promhttp does.

    ``configz``: the configurations component-base's ``configz`` would hold,
    by registered name, as plain data (the caller builds them; for kpx node,
    ``proxy.commands.configz``). ``/configz`` is configz's handler: one JSON
    object of them all, to every method, since it never looks at the
    method. None: no ``/configz`` (kpx healthz registers nothing).
    """

    def __init__(
        self,
        registry: Any = REGISTRY,
        proxy_mode: str = PROXY_MODE,
        configz: Mapping[str, Any] | None = None,
    ) -> None:
        self.registry = registry
        self.proxy_mode = proxy_mode
        # Set once at start and never changed: marshalled once, not per request.
        self.configz = None if configz is None else go_json(dict(sorted(configz.items())))

    def answer(self, request: BaseRequest) -> GoResponse:
        path = request.path
        if path == "/metrics":
            encoder, content_type = choose_encoder(request.headers.get("Accept", ""))
            return go_response(200, [("Content-Type", content_type)], encoder(self.registry))
        if path == "/proxyMode":
            return go_response(200, TEXT_HEADERS, self.proxy_mode.encode())
        if path == "/configz" and self.configz is not None:
            return go_response(200, JSON_HEADERS, self.configz)
        if path in ("/healthz", "/healthz/ping"):
            # k8s.io/apiserver healthz.InstallHandler: /healthz plus one path per
            # check, and kube-proxy installs the default "ping" check.
            return go_response(200, TEXT_HEADERS, b"ok")
        return go_not_found()
