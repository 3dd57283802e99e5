"""The state files the harness feeds ``kpx node``: real Kubernetes YAML.

Owns: rendering v1 Nodes, NodePort v1 Services (TCP and UDP ports) and
discovery.k8s.io/v1 EndpointSlices as ``kubectl get -o yaml`` would print
them (multi-document, block style), and for an IPv6 run (issue 14) what a
dual-stack cluster prints: Nodes with an InternalIP of each family, a
Service with ``ipFamilyPolicy``, ``ipFamilies`` and ``clusterIPs``, and an
EndpointSlice per family (``addressType: IPv6`` beside the IPv4 one). A
service without ``ip_families`` is rendered exactly as before. Writing them is
``lab.common.write_atomic`` (sibling, fsync, rename: how kpx's state source
expects a file to change), re-exported here.

Never: parse YAML or know what kpx does with it: the output is checked only
by kpx reading it, as a real cluster's would be.

Rendered from string templates rather than ``yaml.safe_dump``: the control
workload writes 10,000 services x 3 endpoints (20,000 documents) and then
rewrites a 1,000-service file 100 times, and the harness must not be the slow
part of a convergence measurement.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from lab.common import write_atomic as write_atomic  # re-exported for older callers

NAMESPACE = "bench"


@dataclass(frozen=True)
class Ep:
    """One endpoint: address and the node it runs on."""

    ip: str
    node: str


@dataclass(frozen=True)
class Port:
    """One service port: name, service port, target (endpoint) port, nodePort, protocol.

    The protocol is written on the Service port *and* on the EndpointSlice
    port: Kubernetes pairs the two by name and protocol, so a UDP service
    port whose slice port says TCP (or nothing, which means TCP) has no
    endpoints.
    """

    name: str
    port: int
    target: int
    node_port: int
    protocol: str = "TCP"


def node_doc(name: str, internal_ip: str, *more_internal_ips: str) -> str:
    """A Node; a dual-stack node lists an InternalIP per family (IPv4 first, as the
    kubelet does with ``--node-ip=v4,v6``)."""
    ips = "".join(f"  - type: InternalIP\n    address: {ip}\n"
                  for ip in (internal_ip, *more_internal_ips))
    return (
        "apiVersion: v1\n"
        "kind: Node\n"
        "metadata:\n"
        f"  name: {name}\n"
        "  labels:\n"
        f"    kubernetes.io/hostname: {name}\n"
        "status:\n"
        "  addresses:\n"
        f"{ips}"
        "  - type: Hostname\n"
        f"    address: {name}\n"
    )


def cluster_ip(index: int) -> str:
    """A unique ClusterIP in 10.96.0.0/12 for service number ``index``."""
    n = index + 10
    return f"10.{96 + (n >> 16)}.{(n >> 8) & 255}.{n & 255}"


AUTO = ""
"""``ServiceSpec.cluster_ip`` default: the render index's address (``cluster_ip(index)``)."""
CIP_BASE_INDEX = 20000
"""First ``cluster_ip`` index of ``many_services(..., cluster_ips=True)``: clear of the
render indexes (0 is the bench service, 10.96.0.10) of any state the bench writes."""


def service_doc(name: str, index: int, ports: Iterable[Port], etp: str = "Cluster",
                svc_type: str = "NodePort", cip: str | None = AUTO,
                ip_families: tuple[str, ...] = (), cluster_ips: tuple[str, ...] = ()) -> str:
    """A Service; ``svc_type="ClusterIP"`` has no nodePort and no traffic policy.

    ``cip``: AUTO is ``cluster_ip(index)``, None leaves ``spec.clusterIP`` out
    (a service kpx serves on its NodePorts only), anything else is the address.
    ``ip_families`` (``("IPv4", "IPv6")``...): written with ``ipFamilyPolicy``
    (PreferDualStack for two, SingleStack for one) and ``clusterIPs``, whose
    first entry is then ``clusterIP``, as the API server fills them in.
    """
    if cip == AUTO:
        cip = cluster_ip(index)
    lines = [
        "apiVersion: v1",
        "kind: Service",
        "metadata:",
        f"  name: {name}",
        f"  namespace: {NAMESPACE}",
        "spec:",
        f"  type: {svc_type}",
    ]
    if ip_families:
        if len(cluster_ips) != len(ip_families):
            raise ValueError(f"service {name}: {len(ip_families)} ipFamilies need as many "
                             f"clusterIPs, got {len(cluster_ips)}")
        policy = "PreferDualStack" if len(ip_families) > 1 else "SingleStack"
        lines.append(f"  clusterIP: {cluster_ips[0]}")
        lines.append("  clusterIPs:")
        lines += [f"  - {ip}" for ip in cluster_ips]
        lines.append(f"  ipFamilyPolicy: {policy}")
        lines.append("  ipFamilies:")
        lines += [f"  - {f}" for f in ip_families]
    elif cip is not None:
        lines.append(f"  clusterIP: {cip}")
    if svc_type != "ClusterIP":
        lines.append(f"  externalTrafficPolicy: {etp}")
    lines += ["  selector:", f"    app: {name}", "  ports:"]
    for p in ports:
        lines += [
            f"  - name: {p.name}",
            f"    protocol: {p.protocol}",
            f"    port: {p.port}",
            f"    targetPort: {p.target}",
        ]
        if svc_type != "ClusterIP":
            lines.append(f"    nodePort: {p.node_port}")
    return "\n".join(lines) + "\n"


def slice_doc(service: str, endpoints: Iterable[Ep], ports: Iterable[Port],
              address_type: str = "IPv4") -> str:
    """An EndpointSlice; the endpoint controller keeps one per family (``IPv6``: named
    ``<service>-ipv6``, beside the IPv4 ``<service>-abcde``)."""
    suffix = "ipv6" if address_type == "IPv6" else "abcde"
    lines = [
        "apiVersion: discovery.k8s.io/v1",
        "kind: EndpointSlice",
        "metadata:",
        f"  name: {service}-{suffix}",
        f"  namespace: {NAMESPACE}",
        "  labels:",
        f"    kubernetes.io/service-name: {service}",
        f"addressType: {address_type}",
        "endpoints:",
    ]
    for e in endpoints:
        lines += [
            "- addresses:",
            f"  - {e.ip}",
            "  conditions:",
            "    ready: true",
            "    serving: true",
            "    terminating: false",
            f"  nodeName: {e.node}",
        ]
    lines.append("ports:")
    for p in ports:
        lines += [f"- name: {p.name}", f"  protocol: {p.protocol}", f"  port: {p.target}"]
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class ServiceSpec:
    name: str
    ports: tuple[Port, ...]
    endpoints: tuple[Ep, ...]
    etp: str = "Cluster"
    type: str = "NodePort"
    cluster_ip: str | None = AUTO
    """AUTO: ``cluster_ip(render index)``; None: no clusterIP; else this address."""
    ip_families: tuple[str, ...] = ()
    """Empty: no ``ipFamilies`` written (IPv4, as before dual-stack). Else the families,
    primary first, each with its address in ``cluster_ips``."""
    cluster_ips: tuple[str, ...] = ()
    endpoints6: tuple[Ep, ...] = ()
    """The IPv6 slice's endpoints (rendered when ``ip_families`` has IPv6)."""


def render(nodes: Iterable[tuple[str, ...]], services: Iterable[ServiceSpec]) -> str:
    """A whole state: nodes (name, InternalIP, [its IPv6 InternalIP]) then each service
    with its slice (and its IPv6 slice for a service with IPv6 in ``ip_families``)."""
    docs = [node_doc(*n) for n in nodes]
    for i, s in enumerate(services):
        docs.append(service_doc(s.name, i, s.ports, s.etp, s.type, s.cluster_ip,
                                s.ip_families, s.cluster_ips))
        if s.ip_families != ("IPv6",):
            docs.append(slice_doc(s.name, s.endpoints, s.ports))
        if "IPv6" in s.ip_families:
            docs.append(slice_doc(s.name, s.endpoints6, s.ports, "IPv6"))
    return "---\n".join(docs)


def many_services(count: int, first_node_port: int, endpoints: tuple[Ep, ...],
                  target: int, cluster_ips: bool | None = None) -> list[ServiceSpec]:
    """``count`` one-port NodePort services on consecutive nodePorts (control workload).

    ``cluster_ips``: None gives each the clusterIP of its render index (AUTO);
    False none (kpx serves their NodePorts only); True service i gets
    ``many_cluster_ips(count)[i]``, addresses the caller knows in advance.
    """
    cips: list[str | None]
    if cluster_ips is None:
        cips = [AUTO] * count
    elif cluster_ips:
        cips = list(many_cluster_ips(count))
    else:
        cips = [None] * count
    return [
        ServiceSpec(
            name=f"svc-{i:05d}",
            ports=(Port("http", 80, target, first_node_port + i),),
            endpoints=endpoints,
            cluster_ip=cips[i],
        )
        for i in range(count)
    ]


def many_cluster_ips(count: int) -> list[str]:
    """The clusterIPs ``many_services(count, ..., cluster_ips=True)`` gives, in order."""
    if CIP_BASE_INDEX + count + 10 > 1 << 16:
        raise ValueError(f"{count} clusterIPs do not fit 10.96.0.0/16 from index "
                         f"{CIP_BASE_INDEX}")
    return [cluster_ip(CIP_BASE_INDEX + i) for i in range(count)]


def cluster_ip_services(count: int, endpoints: tuple[Ep, ...], target: int,
                        prefix: str = "cip") -> list[ServiceSpec]:
    """``count`` one-port ClusterIP services with their slices: parsed, never listened on.

    The stall workload's 50,000-service state is mostly these: a NodePort
    needs a listener (one fd) and a unique port, and neither 50,000 fds (the
    RLIMIT_NOFILE hard limit here is 20,000) nor 50,000 ports in a NodePort
    range exist, whereas a big cluster's services are mostly ClusterIP.
    """
    return [
        ServiceSpec(name=f"{prefix}-{i:05d}", ports=(Port("http", 80, target, 0),),
                    endpoints=endpoints, type="ClusterIP")
        for i in range(count)
    ]
