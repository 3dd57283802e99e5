"""The one Prometheus registry of a kpx process, served at ``/metrics``.

Owns: ``REGISTRY``. The proxier's metrics (``proxy.metrics``) and healthz's
own register on it; ``healthz.metrics.MetricsServer`` serves it.

Never: define a metric. This module sits below every other one in healthz
so that each can register its series without importing the others.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, disable_created_metrics

# kube-proxy exposes no ``*_created`` series; scrapers written for it should
# see the same families from kpx.
disable_created_metrics()

REGISTRY = CollectorRegistry(auto_describe=True)
