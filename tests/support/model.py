"""``proxy.core.model`` objects built by hand, for tests that must not depend on the parser.

The model-object twins of ``tests.support.objects`` (which builds the YAML
dicts kpx parses). Defaults match ``objects``: service ``default/web``, one
unnamed TCP port 80 -> 8080 on NodePort 30080, endpoints on node-a.

- ``service(name="web", policy="Cluster", *, type="NodePort", hc_port=0,
  node_port=30080, port_name="", ports=None, namespace="default")``
- ``endpoint(address, node="node-a", *, ready=True, serving=True,
  terminating=False, pod_name=None)``
- ``endpoint_slice(service="web", endpoints=(), *, name=None, port_name="",
  ports=None, namespace="default", trigger_time=None)``: ``service`` is a
  name or a ``Service`` (then its namespace is used); the name defaults to
  ``<service>-abcde``.
- ``snapshot(services=(), slices=(), nodes=NODES, generation=1)``; ``NODES``
  is three nodes, node-a/b/c on 192.0.2.1-3.
"""

from __future__ import annotations

from collections.abc import Iterable

from proxy.core.model import (
    Endpoint,
    EndpointPort,
    EndpointSlice,
    Node,
    Service,
    ServicePort,
    Snapshot,
    TrafficPolicy,
)

__all__ = ["NODES", "endpoint", "endpoint_slice", "service", "snapshot"]

NODES = (
    Node("node-a", internal_ips=("192.0.2.1",)),
    Node("node-b", internal_ips=("192.0.2.2",)),
    Node("node-c", internal_ips=("192.0.2.3",)),
)


def service(
    name: str = "web",
    policy: TrafficPolicy = "Cluster",
    *,
    type: str = "NodePort",
    hc_port: int = 0,
    node_port: int = 30080,
    port_name: str = "",
    ports: Iterable[ServicePort] | None = None,
    namespace: str = "default",
) -> Service:
    """A Service with ``ports`` or one TCP port ``port_name`` 80 -> 8080 on ``node_port``."""
    return Service(
        namespace=namespace,
        name=name,
        type=type,  # type: ignore[arg-type]
        ports=tuple(ports) if ports is not None
        else (ServicePort(port_name, "TCP", 80, 8080, node_port),),
        external_traffic_policy=policy,
        health_check_node_port=hc_port,
    )


def endpoint(
    address: str,
    node: str | None = "node-a",
    *,
    ready: bool = True,
    serving: bool = True,
    terminating: bool = False,
    pod_name: str | None = None,
) -> Endpoint:
    return Endpoint(address, node, ready=ready, serving=serving, terminating=terminating,
                    pod_name=pod_name)


def endpoint_slice(
    service: Service | str = "web",
    endpoints: Iterable[Endpoint] = (),
    *,
    name: str | None = None,
    port_name: str = "",
    ports: Iterable[EndpointPort] | None = None,
    namespace: str = "default",
    trigger_time: float | None = None,
) -> EndpointSlice:
    """A slice of ``service`` with ``ports`` or one port ``port_name`` 8080."""
    if isinstance(service, Service):
        namespace, service = service.namespace, service.name
    return EndpointSlice(
        namespace=namespace,
        name=name or f"{service}-abcde",
        service_name=service,
        endpoints=tuple(endpoints),
        ports=tuple(ports) if ports is not None else (EndpointPort(port_name, 8080),),
        trigger_time=trigger_time,
    )


def snapshot(
    services: Iterable[Service] = (),
    slices: Iterable[EndpointSlice] = (),
    nodes: Iterable[Node] = NODES,
    generation: int = 1,
) -> Snapshot:
    return Snapshot(
        nodes=tuple(nodes), services=tuple(services), slices=tuple(slices), generation=generation
    )
