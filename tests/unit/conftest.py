"""Shared pieces of the pure-core unit tests: a Hypothesis profile and a state generator.

Everything under tests/unit runs without sockets, namespaces or privileges.
The Hypothesis profile is deterministic (``derandomize``) so a failure seen in
CI is the failure seen on a laptop; set ``HYPOTHESIS_PROFILE=kpx-explore`` to
search with fresh randomness and more examples.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, settings

from proxy.k8s import subset

settings.register_profile(
    "kpx-unit",
    derandomize=True,
    deadline=None,
    max_examples=150,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("kpx-explore", deadline=None, max_examples=2000)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "kpx-unit"))


def _node_ip(i: int) -> str:
    return f"192.168.{i // 250}.{i % 250 + 2}"


def _pod_ip(s: int, e: int) -> str:
    n = s * 16 + e
    return f"10.{(n >> 16) & 255}.{(n >> 8) & 255}.{n & 255}"


def generate_state(n_services: int, endpoints_per_service: int, nodes: int) -> dict[str, Any]:
    """A ``kind: List`` as kubectl would print it: nodes, NodePort services, one slice each.

    Service ``i`` is ``ns-{i % 10}/svc-{i}`` with nodePort ``30000 + i``
    (so at most 35535 services); every third one is eTP=Local LoadBalancer
    with a health-check port from 2000 up. Endpoint ``e`` of a service
    lives on node ``(i + e) % nodes``.
    """
    assert n_services <= 35535 and endpoints_per_service <= 16
    items: list[dict[str, Any]] = []
    for n in range(nodes):
        items.append(
            {
                "apiVersion": "v1",
                "kind": "Node",
                "metadata": {
                    "name": f"node-{n}",
                    "labels": {"kubernetes.io/hostname": f"node-{n}"},
                    "resourceVersion": str(1000 + n),
                    "uid": f"00000000-0000-4000-8000-{n:012d}",
                },
                "spec": {"podCIDR": f"10.244.{n}.0/24"},
                "status": {
                    "addresses": [
                        {"address": _node_ip(n), "type": "InternalIP"},
                        {"address": f"node-{n}", "type": "Hostname"},
                    ],
                    "conditions": [{"status": "True", "type": "Ready"}],
                },
            }
        )
    for i in range(n_services):
        ns, name = f"ns-{i % 10}", f"svc-{i}"
        local = i % 3 == 0
        spec: dict[str, Any] = {
            "clusterIP": f"10.96.{i >> 8 & 255}.{i & 255}",
            "clusterIPs": [f"10.96.{i >> 8 & 255}.{i & 255}"],
            "externalTrafficPolicy": "Local" if local else "Cluster",
            "internalTrafficPolicy": "Cluster",
            "ipFamilies": ["IPv4"],
            "ipFamilyPolicy": "SingleStack",
            "ports": [
                {
                    "name": "http",
                    "nodePort": 30000 + i,
                    "port": 80,
                    "protocol": "TCP",
                    "targetPort": 8080,
                }
            ],
            "selector": {"app": name},
            "sessionAffinity": "None",
            "type": "LoadBalancer" if local else "NodePort",
        }
        if local:
            spec["healthCheckNodePort"] = 2000 + i // 3
        items.append(
            {
                "apiVersion": "v1",
                "kind": "Service",
                "metadata": {
                    "name": name,
                    "namespace": ns,
                    "labels": {"app": name},
                    "resourceVersion": str(5000 + i),
                    "uid": f"11111111-0000-4000-8000-{i:012d}",
                },
                "spec": spec,
                "status": {"loadBalancer": {}},
            }
        )
        items.append(
            {
                "apiVersion": "discovery.k8s.io/v1",
                "kind": "EndpointSlice",
                "addressType": "IPv4",
                "endpoints": [
                    {
                        "addresses": [_pod_ip(i, e)],
                        "conditions": {"ready": True, "serving": True, "terminating": False},
                        "nodeName": f"node-{(i + e) % nodes}",
                        "targetRef": {"kind": "Pod", "name": f"{name}-{e}", "namespace": ns},
                    }
                    for e in range(endpoints_per_service)
                ],
                "metadata": {
                    "name": f"{name}-abcde",
                    "namespace": ns,
                    "generateName": f"{name}-",
                    "labels": {
                        "endpointslice.kubernetes.io/managed-by": "endpointslice-controller.k8s.io",
                        "kubernetes.io/service-name": name,
                    },
                    "annotations": {
                        "endpoints.kubernetes.io/last-change-trigger-time": "2024-05-01T10:00:00Z"
                    },
                    "resourceVersion": str(90000 + i),
                },
                "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
            }
        )
    return {"apiVersion": "v1", "kind": "List", "items": items, "metadata": {"resourceVersion": ""}}


def generate_state_yaml(n_services: int, endpoints_per_service: int, nodes: int) -> str:
    """``generate_state`` printed as kubectl prints YAML (block style, sorted keys)."""
    import yaml

    dumper = getattr(yaml, "CSafeDumper", yaml.SafeDumper)
    return yaml.dump(
        generate_state(n_services, endpoints_per_service, nodes),
        Dumper=dumper,
        default_flow_style=False,
    )


@pytest.fixture(scope="session")
def make_state() -> Callable[[int, int, int], dict[str, Any]]:
    """``generate_state`` as a fixture, since test modules cannot import conftest."""
    return generate_state


@pytest.fixture(scope="session")
def make_state_yaml() -> Callable[[int, int, int], str]:
    return generate_state_yaml


@pytest.fixture(scope="module", params=["fast", "pyyaml"])
def yaml_reader(request: pytest.FixtureRequest) -> str:
    """Runs a module's tests once per YAML reader: the fast subset reader first (the
    default), then PyYAML for every chunk (``KPX_NO_FAST_YAML``). Answers must not differ."""
    was = subset.use_fast_yaml(request.param == "fast")
    request.addfinalizer(lambda: subset.use_fast_yaml(was))
    return str(request.param)
