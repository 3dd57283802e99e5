"""proxy.k8s: real kubectl YAML in, an immutable Snapshot or a list of precise problems out."""

from __future__ import annotations

import copy
import gc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from proxy.core.model import Endpoint, EndpointPort, Snapshot
from proxy.k8s import StateError, parse_file, parse_objects, parse_state
from tests.support import objects

FIXTURES = Path(__file__).parent / "fixtures"
KUBECTL_LIST = FIXTURES / "kubectl_list.yaml"

DELETE = object()
"""``patched`` value meaning "remove this field"."""

pytestmark = pytest.mark.usefixtures("yaml_reader")
"""Every test runs over both YAML readers: the fast subset reader, and PyYAML alone."""


# -- builders -----------------------------------------------------------------


def service(name: str = "web", namespace: str | None = "default", **spec: Any) -> dict[str, Any]:
    """A NodePort Service as kubectl prints it; ``spec`` keys override the defaults."""
    return objects.service(
        name, 30080, None, namespace=namespace, port_name="http", selector={"app": name},
        meta={"uid": f"uid-{name}", "resourceVersion": "1"}, status={"loadBalancer": {}},
        **spec,
    )


def endpoint_slice(
    name: str = "web-abc",
    service_name: str | None = "web",
    endpoints: list[dict[str, Any]] | None = None,
    ports: list[dict[str, Any]] | None = None,
    namespace: str = "default",
    address_type: str = "IPv4",
) -> dict[str, Any]:
    """A slice of ``service_name`` as the endpointslice controller writes it."""
    return objects.endpoint_slice(
        service_name,
        *(endpoints if endpoints is not None else [objects.endpoint("10.244.0.5", pod="")]),
        ports=ports if ports is not None else [objects.slice_port(8080, "http")],
        name=name,
        namespace=namespace,
        labels={"endpointslice.kubernetes.io/managed-by": "endpointslice-controller.k8s.io"},
        address_type=address_type,
    )


def node(name: str = "node-a", ip: str = "192.168.49.2") -> dict[str, Any]:
    """A Node with its pod CIDR, as a node of a real cluster has."""
    return {**objects.node(name, ip), "spec": {"podCIDR": "10.244.0.0/24"}}


def patched(obj: dict[str, Any], path: str, value: object) -> dict[str, Any]:
    """A deep copy of ``obj`` with ``a.b.0.c`` set to ``value`` (or removed with DELETE)."""
    out = copy.deepcopy(obj)
    *parents, last = path.split(".")
    target: Any = out
    for part in parents:
        target = target[int(part)] if isinstance(target, list) else target[part]
    key: Any = int(last) if isinstance(target, list) else last
    if value is DELETE:
        del target[key]
    else:
        target[key] = value
    return out


def as_list(*objs: dict[str, Any]) -> str:
    """What ``kubectl get ... -o yaml`` prints for several objects: one List."""
    doc = {
        "apiVersion": "v1",
        "kind": "List",
        "items": list(objs),
        "metadata": {"resourceVersion": ""},
    }
    return yaml.safe_dump(doc)


def as_documents(*objs: object) -> str:
    return yaml.safe_dump_all(objs)


def problems_of(text: str) -> list[str]:
    with pytest.raises(StateError) as info:
        parse_state(text)
    return info.value.problems


# -- realistic kubectl output ---------------------------------------------------


@pytest.fixture(scope="module")
def kubectl(yaml_reader: str) -> Snapshot:
    return parse_file(KUBECTL_LIST, generation=7)


def test_kubectl_list_nodes(kubectl: Snapshot) -> None:
    a, b = kubectl.nodes
    assert (a.name, a.internal_ips, a.external_ips) == (
        "node-a",
        ("192.168.49.2",),
        ("203.0.113.10",),
    )
    assert ("topology.kubernetes.io/zone", "zone-1") in a.labels
    assert a.eligible
    assert b.taint_keys == ("ToBeDeletedByClusterAutoscaler", "node.kubernetes.io/unschedulable")
    assert b.deletion_timestamp == "2024-05-02T11:00:00Z"
    assert not b.eligible


def test_kubectl_list_keeps_only_proxied_services(kubectl: Snapshot) -> None:
    # db is headless, legacy is ExternalName, mesh belongs to another proxy.
    assert [s.key for s in kubectl.services] == ["default/kubernetes", "shop/web", "shop/api"]


def test_kubectl_list_service_fields(kubectl: Snapshot) -> None:
    web = kubectl.service("shop/web")
    assert web is not None
    assert web.type == "NodePort"
    assert web.session_affinity == "ClientIP" and web.affinity_timeout_seconds == 125
    http, dns = web.ports
    assert (http.name, http.protocol, http.port, http.target_port, http.node_port) == (
        "http",
        "TCP",
        80,
        "http",
        30080,
    )
    assert (dns.protocol, dns.target_port, dns.node_port) == ("UDP", 5353, 30053)
    assert web.selector == (("app", "web"),)

    api = kubectl.service("shop/api")
    assert api is not None
    assert api.type == "LoadBalancer" and api.external_traffic_policy == "Local"
    assert api.health_check_node_port == 31999 and api.needs_health_check
    assert api.publish_not_ready_addresses and api.external_ips == ("198.51.100.7",)
    assert api.ports[0].name == "" and api.session_affinity == "None"

    default = kubectl.service("default/kubernetes")
    assert default is not None and default.cluster_ip == "10.96.0.1"
    assert default.ports[0].node_port == 0


def test_kubectl_list_slices(kubectl: Snapshot) -> None:
    # The headless service's slice and the orphan are gone; the IPv6 slice is
    # kept for the IPv6 family's plans.
    assert [s.name for s in kubectl.slices] == ["web-x7k2p", "api-2xq9d", "web-v6-abcde"]
    web = kubectl.slices[0]
    assert web.service_key == "shop/web"
    assert web.trigger_time == 1714647601.0
    assert web.endpoints == (
        Endpoint("10.244.0.5", "node-a", True, True, False, "web-7c5d8-abcde"),
        Endpoint("10.244.1.7", "node-b", False, True, True, "web-7c5d8-fghij"),
    )
    assert web.ports == (EndpointPort("http", 8080, "TCP"), EndpointPort("dns", 5353, "UDP"))
    api = kubectl.slices[1]
    # ``conditions: {}``: every condition nil, resolved as kube-proxy does.
    assert api.endpoints == (Endpoint("10.244.0.9", "node-a", True, True, False, "api-0"),)
    assert api.trigger_time is None


def test_generation_is_passed_through(kubectl: Snapshot) -> None:
    assert kubectl.generation == 7
    # An empty List: a deliberate state with nothing in it (an empty file is refused,
    # see tests/unit/test_hostile_input.py).
    empty = "apiVersion: v1\nkind: List\nitems: []\n"
    assert parse_state(empty).generation == 0
    assert parse_state(empty, generation=42) == Snapshot(generation=42)


def test_multi_document_stream_equals_list() -> None:
    items = yaml.safe_load(KUBECTL_LIST.read_text())["items"]
    as_stream = parse_state("---\n" + as_documents(*items) + "---\n# only a comment\n---\n")
    assert as_stream == parse_file(KUBECTL_LIST)


def test_mix_of_lists_typed_lists_and_single_objects() -> None:
    # The API's typed lists (kubectl get --raw) leave kind and apiVersion out of items.
    bare_service = service("api")
    del bare_service["kind"], bare_service["apiVersion"]
    bare_service["spec"]["ports"][0]["nodePort"] = 30081
    text = as_documents(
        {"apiVersion": "v1", "kind": "NodeList", "items": [node("node-a"), node("node-b")]},
        {"apiVersion": "v1", "kind": "ServiceList", "items": [bare_service], "metadata": {}},
        None,
        {"apiVersion": "v1", "kind": "List", "items": [service("web")]},
        endpoint_slice("api-1", "api"),
        {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSliceList", "items": None},
    )
    snap = parse_state(text)
    assert [n.name for n in snap.nodes] == ["node-a", "node-b"]
    assert [s.key for s in snap.services] == ["default/api", "default/web"]
    assert [s.name for s in snap.slices] == ["api-1"]


def test_other_kinds_and_foreign_api_versions_are_ignored() -> None:
    knative = {
        "apiVersion": "serving.knative.dev/v1",
        "kind": "Service",
        "metadata": {"name": "web"},
        "spec": {"template": {"spec": {"containers": [{"image": "x"}]}}},
    }
    text = as_documents(
        {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"}, "spec": 5},
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": None},
        {"apiVersion": "v1", "kind": "Endpoints", "metadata": {"name": "web"}},
        knative,
        service("web"),
    )
    assert [s.key for s in parse_state(text).services] == ["default/web"]


def test_unknown_fields_are_ignored() -> None:
    svc = service("web", futureField={"x": [1, 2]}, ipFamilyPolicy="SingleStack")
    svc["futureTopLevel"] = True
    assert parse_state(as_list(svc)).services[0].key == "default/web"


# -- defaults -------------------------------------------------------------------


def test_service_defaults_match_the_api_server() -> None:
    minimal = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "min"},
        "spec": {"ports": [{"port": 8080}]},
    }
    svc = parse_state(as_documents(minimal)).services[0]
    assert svc.namespace == "default" and svc.type == "ClusterIP"
    assert svc.external_traffic_policy == "Cluster" and svc.internal_traffic_policy == "Cluster"
    assert svc.session_affinity == "None" and svc.affinity_timeout_seconds == 10800
    assert svc.health_check_node_port == 0 and not svc.publish_not_ready_addresses
    port = svc.ports[0]
    assert (port.name, port.protocol, port.target_port, port.node_port) == ("", "TCP", 8080, 0)


def test_client_ip_affinity_without_config_defaults_to_10800() -> None:
    svc = parse_state(as_list(service(sessionAffinity="ClientIP"))).services[0]
    assert svc.session_affinity == "ClientIP" and svc.affinity_timeout_seconds == 10800


@pytest.mark.parametrize(
    ("conditions", "expected"),
    [
        (DELETE, (True, True, False)),
        ({}, (True, True, False)),
        ({"ready": None, "serving": None, "terminating": None}, (True, True, False)),
        ({"ready": False}, (False, True, False)),
        ({"ready": False, "terminating": True}, (False, True, True)),
        ({"ready": False, "serving": False, "terminating": True}, (False, False, True)),
        ({"serving": None, "terminating": True, "ready": False}, (False, True, True)),
    ],
    ids=[
        "absent",
        "empty",
        "all-null",
        "unready",
        "serving-terminating",
        "draining",
        "null-serving",
    ],
)
def test_nil_conditions_resolve_like_kube_proxy(
    conditions: object, expected: tuple[bool, bool, bool]
) -> None:
    sl = endpoint_slice()
    sl = patched(sl, "endpoints.0.conditions", conditions)
    ep = parse_state(as_list(service(), sl)).slices[0].endpoints[0]
    assert (ep.ready, ep.serving, ep.terminating) == expected


def test_slice_ports_without_name_or_number() -> None:
    sl = endpoint_slice(ports=[{"port": 8080}, {"name": "metrics"}, {"name": "zero", "port": 0}])
    assert parse_state(as_list(service(), sl)).slices[0].ports == (EndpointPort("", 8080, "TCP"),)


def test_endpoint_fields() -> None:
    sl = endpoint_slice(
        endpoints=[
            {"addresses": ["10.0.0.1", "10.0.0.99"], "targetRef": {"kind": "Pod", "name": "p1"}},
            {"addresses": ["10.0.0.2"], "nodeName": "", "targetRef": {"kind": "Node", "name": "n"}},
        ]
    )
    first, second = parse_state(as_list(service(), sl)).slices[0].endpoints
    assert (first.address, first.node_name, first.pod_name) == ("10.0.0.1", None, "p1")
    assert (second.node_name, second.pod_name) == (None, None)


def test_trigger_time_quoted_and_unquoted() -> None:
    quoted = patched(
        endpoint_slice(),
        "metadata.annotations",
        {"endpoints.kubernetes.io/last-change-trigger-time": "2024-05-01T10:00:00.25+02:00"},
    )
    assert parse_state(as_list(service(), quoted)).slices[0].trigger_time == 1714550400.25
    # A hand-written, unquoted time is a YAML timestamp, not a string.
    unquoted = as_list(service(), endpoint_slice()).replace(
        "metadata:\n    labels:",
        "metadata:\n    annotations:\n      endpoints.kubernetes.io/last-change-trigger-time: "
        "2024-05-01T10:00:00Z\n    labels:",
        1,
    )
    assert parse_state(unquoted).slices[0].trigger_time == 1714557600.0


# -- what is dropped silently -------------------------------------------------------


@pytest.mark.parametrize(
    "ignored",
    [
        service("skip", clusterIP="None", ports=[{"port": 1, "nodePort": 30080}]),
        service("skip", type="ExternalName", externalName="x.example.com", ports=None),
        patched(
            service("skip"), "metadata.labels", {"service.kubernetes.io/service-proxy-name": "x"}
        ),
        patched(service("skip"), "metadata.labels", {"service.kubernetes.io/headless": ""}),
    ],
    ids=["headless", "ExternalName", "service-proxy-name", "headless-label"],
)
def test_ignored_services_and_their_slices_are_dropped(ignored: dict[str, Any]) -> None:
    # Their bodies are never judged, and a nodePort they hold clashes with nothing.
    ignored = patched(ignored, "spec.sessionAffinity", "Sometimes")
    snap = parse_state(as_list(ignored, endpoint_slice("skip-1", "skip"), service("web")))
    assert [s.key for s in snap.services] == ["default/web"]
    assert snap.slices == ()


def test_orphan_slices_are_dropped_and_order_does_not_matter() -> None:
    snap = parse_state(
        as_list(
            endpoint_slice("web-1", "web"),  # before its service
            endpoint_slice("gone-1", "gone"),  # service deleted a moment ago
            endpoint_slice("web-2", "web", namespace="other"),  # same name, other namespace
            service("web"),
        )
    )
    assert [s.name for s in snap.slices] == ["web-1"]


def test_fqdn_slices_are_dropped_unchecked() -> None:
    sl = endpoint_slice(address_type="FQDN", endpoints=[{"addresses": ["fd00::1"]}])
    assert parse_state(as_list(service(), sl)).slices == ()


def test_ipv6_slices_are_kept_with_canonical_addresses() -> None:
    sl = endpoint_slice(address_type="IPv6", endpoints=[{"addresses": ["FD00:0::0001"]}])
    (kept,) = parse_state(as_list(service(), sl)).slices
    assert kept.address_type == "IPv6" and kept.endpoints[0].address == "fd00::1"


def test_address_type_defaults_to_ipv4() -> None:
    sl = patched(endpoint_slice(), "addressType", DELETE)
    assert parse_state(as_list(service(), sl)).slices[0].address_type == "IPv4"


def test_same_node_port_on_other_protocol_is_fine() -> None:
    ports = [
        {"name": "tcp", "port": 80, "protocol": "TCP", "nodePort": 30080},
        {"name": "udp", "port": 80, "protocol": "UDP", "nodePort": 30080},
    ]
    assert len(parse_state(as_list(service(ports=ports))).services[0].ports) == 2


# -- malformed input: one precise problem per defect ----------------------------------

SVC = service()
SLICE = endpoint_slice()
NODE = node()

MALFORMED = [
    # Each: the YAML, then the one problem it must produce.
    pytest.param(
        as_documents(SVC, ["a", "list"]),
        "document 2: expected a mapping (a Kubernetes object or List), got list",
        id="not-a-mapping",
    ),
    pytest.param(
        "just text\n",
        'document 1: expected a mapping (a Kubernetes object or List), got string "just text"',
        id="scalar-doc",
    ),
    pytest.param(
        as_documents({"metadata": {"name": "x"}}),
        "document 1: kind: required",
        id="no-kind",
    ),
    pytest.param(
        as_documents({"kind": "List", "items": [SVC, 7]}),
        "document 1 items[1]: expected a mapping (a Kubernetes object or List), got integer 7",
        id="list-item",
    ),
    pytest.param(
        as_documents({"kind": "List", "items": {"a": 1}}),
        "document 1 (List): items: expected a list, got mapping",
        id="list-items-type",
    ),
    pytest.param(
        as_list(patched(SVC, "metadata.name", DELETE)),
        "Service <unnamed> (document 1 items[0]): metadata.name: required",
        id="svc-no-name",
    ),
    pytest.param(
        as_list(patched(SVC, "metadata", DELETE)),
        "Service <unnamed> (document 1 items[0]): metadata: required",
        id="svc-no-metadata",
    ),
    pytest.param(
        as_list(patched(SVC, "spec", DELETE)),
        "Service default/web: spec: required",
        id="svc-no-spec",
    ),
    pytest.param(
        as_list(patched(SVC, "spec.ports", DELETE)),
        "Service default/web: spec.ports: required",
        id="svc-no-ports",
    ),
    pytest.param(
        as_list(patched(SVC, "spec", {})),
        "Service default/web: spec.ports: required",
        id="svc-empty-spec",
    ),
    pytest.param(
        as_list(patched(SVC, "spec.ports", [])),
        "Service default/web: spec.ports: required",
        id="svc-empty-ports",
    ),
    pytest.param(
        as_list(patched(SVC, "spec.ports.0.port", DELETE)),
        "Service default/web: spec.ports[0].port: required",
        id="port-missing",
    ),
    pytest.param(
        as_list(patched(SVC, "spec.ports.0.port", "80")),
        'Service default/web: spec.ports[0].port: expected an integer, got string "80"',
        id="port-string",
    ),
    pytest.param(
        as_list(patched(SVC, "spec.ports.0.port", True)),
        "Service default/web: spec.ports[0].port: expected an integer, got boolean true",
        id="port-bool",
    ),
    pytest.param(
        as_list(patched(SVC, "spec.ports.0.port", 65536)),
        "Service default/web: spec.ports[0].port: 65536 is out of range 1-65535",
        id="port-range",
    ),
    pytest.param(
        as_list(patched(SVC, "spec.ports.0.nodePort", 70000)),
        "Service default/web: spec.ports[0].nodePort: 70000 is out of range 1-65535",
        id="nodeport-range",
    ),
    pytest.param(
        as_list(patched(SVC, "spec.ports.0.nodePort", -1)),
        "Service default/web: spec.ports[0].nodePort: -1 is out of range 1-65535",
        id="nodeport-negative",
    ),
    pytest.param(
        as_list(patched(SVC, "spec.ports.0.targetPort", 0)),
        "Service default/web: spec.ports[0].targetPort: 0 is out of range 1-65535",
        id="targetport-range",
    ),
    pytest.param(
        as_list(patched(SVC, "spec.ports.0.targetPort", [80])),
        "Service default/web: spec.ports[0].targetPort: expected an integer, got list",
        id="targetport-type",
    ),
    pytest.param(
        as_list(patched(SVC, "spec.ports.0", 80)),
        "Service default/web: spec.ports[0]: expected a mapping, got integer 80",
        id="port-not-mapping",
    ),
    pytest.param(
        as_list(patched(SVC, "spec.ports.0.protocol", "tcp")),
        'Service default/web: spec.ports[0].protocol: "tcp" is not one of TCP, UDP, SCTP',
        id="protocol",
    ),
    pytest.param(
        as_list(patched(SVC, "spec.ports", [{"name": "a", "port": 1}, {"name": "a", "port": 2}])),
        'Service default/web: spec.ports[1].name: duplicate port name "a" (also spec.ports[0])',
        id="port-name-dup",
    ),
    pytest.param(
        as_list(patched(SVC, "spec.healthCheckNodePort", 65536)),
        "Service default/web: spec.healthCheckNodePort: 65536 is out of range 1-65535",
        id="hc-range",
    ),
    pytest.param(
        as_list(patched(SVC, "spec.type", "NodePorts")),
        'Service default/web: spec.type: "NodePorts" is not one of ClusterIP, '
        "NodePort, LoadBalancer, ExternalName",
        id="type",
    ),
    pytest.param(
        as_list(patched(SVC, "spec.externalTrafficPolicy", "Global")),
        'Service default/web: spec.externalTrafficPolicy: "Global" is not one of Cluster, Local',
        id="etp-global",
    ),
    pytest.param(
        as_list(patched(SVC, "spec.internalTrafficPolicy", "local")),
        'Service default/web: spec.internalTrafficPolicy: "local" is not one of Cluster, Local',
        id="itp",
    ),
    pytest.param(
        as_list(patched(SVC, "spec.sessionAffinity", "Cookie")),
        'Service default/web: spec.sessionAffinity: "Cookie" is not one of None, ClientIP',
        id="affinity",
    ),
    pytest.param(
        as_list(
            service(
                sessionAffinity="ClientIP",
                sessionAffinityConfig={"clientIP": {"timeoutSeconds": 0}},
            )
        ),
        "Service default/web: spec.sessionAffinityConfig.clientIP.timeoutSeconds: 0 is "
        "out of range 1-86400",
        id="affinity-zero",
    ),
    pytest.param(
        as_list(
            service(
                sessionAffinity="ClientIP",
                sessionAffinityConfig={"clientIP": {"timeoutSeconds": 86401}},
            )
        ),
        "Service default/web: spec.sessionAffinityConfig.clientIP.timeoutSeconds: "
        "86401 is out of range 1-86400",
        id="affinity-long",
    ),
    pytest.param(
        as_list(service(sessionAffinity="ClientIP", sessionAffinityConfig={"clientIP": "10800"})),
        "Service default/web: spec.sessionAffinityConfig.clientIP: expected a mapping, "
        'got string "10800"',
        id="affinity-config-type",
    ),
    pytest.param(
        as_list(patched(SVC, "metadata.labels", {"version": 1})),
        'Service default/web: metadata.labels["version"]: expected a string, got integer 1',
        id="label-int",
    ),
    pytest.param(
        as_list(patched(SVC, "spec.selector", {"on": True})),
        'Service default/web: spec.selector["on"]: expected a string, got boolean true',
        id="selector-bool",
    ),
    pytest.param(
        as_list(patched(SVC, "spec.externalIPs", "1.2.3.4")),
        'Service default/web: spec.externalIPs: expected a list, got string "1.2.3.4"',
        id="external-ips",
    ),
    pytest.param(
        as_list(patched(SVC, "spec.publishNotReadyAddresses", "yes")),
        'Service default/web: spec.publishNotReadyAddresses: expected a boolean, got string "yes"',
        id="publish-not-ready",
    ),
    pytest.param(
        as_list(patched(SVC, "metadata.namespace", 5)),
        "Service default/web: metadata.namespace: expected a string, got integer 5",
        id="namespace-type",
    ),
    pytest.param(
        as_list(SVC, endpoint_slice(service_name=None)),
        'EndpointSlice default/web-abc: metadata.labels["kubernetes.io/service-name"]: required',
        id="slice-no-service-label",
    ),
    pytest.param(
        as_list(SVC, patched(SLICE, "endpoints.0.addresses", DELETE)),
        "EndpointSlice default/web-abc: endpoints[0].addresses: required",
        id="slice-no-addresses",
    ),
    pytest.param(
        as_list(SVC, patched(SLICE, "endpoints.0.addresses", [])),
        "EndpointSlice default/web-abc: endpoints[0].addresses: required",
        id="slice-empty-addresses",
    ),
    pytest.param(
        as_list(SVC, patched(SLICE, "endpoints.0.addresses", "10.0.0.1")),
        "EndpointSlice default/web-abc: endpoints[0].addresses: expected a list, got "
        'string "10.0.0.1"',
        id="slice-address-type",
    ),
    pytest.param(
        as_list(SVC, patched(SLICE, "endpoints.0.addresses", ["10.0.0.256"])),
        'EndpointSlice default/web-abc: endpoints[0].addresses[0]: "10.0.0.256" is not '
        "an IPv4 address",
        id="slice-not-ipv4",
    ),
    pytest.param(
        as_list(SVC, patched(SLICE, "endpoints.0.addresses", ["10.0.0.01"])),
        'EndpointSlice default/web-abc: endpoints[0].addresses[0]: "10.0.0.01" is not '
        "an IPv4 address",
        id="slice-leading-zero",
    ),
    pytest.param(
        as_list(SVC, patched(SLICE, "endpoints.0.conditions.ready", "true")),
        "EndpointSlice default/web-abc: endpoints[0].conditions.ready: expected a "
        'boolean, got string "true"',
        id="slice-ready-type",
    ),
    pytest.param(
        as_list(SVC, patched(SLICE, "endpoints.0.conditions", [True])),
        "EndpointSlice default/web-abc: endpoints[0].conditions: expected a mapping, got list",
        id="slice-conditions-type",
    ),
    pytest.param(
        as_list(SVC, patched(SLICE, "endpoints.0", "10.0.0.1")),
        'EndpointSlice default/web-abc: endpoints[0]: expected a mapping, got string "10.0.0.1"',
        id="slice-endpoint-type",
    ),
    pytest.param(
        as_list(SVC, patched(SLICE, "endpoints.0.nodeName", 7)),
        "EndpointSlice default/web-abc: endpoints[0].nodeName: expected a string, got integer 7",
        id="slice-node-name-type",
    ),
    pytest.param(
        as_list(SVC, patched(SLICE, "ports.0.port", 99999)),
        "EndpointSlice default/web-abc: ports[0].port: 99999 is out of range 1-65535",
        id="slice-port-range",
    ),
    pytest.param(
        as_list(SVC, patched(SLICE, "ports.0.protocol", "HTTP")),
        'EndpointSlice default/web-abc: ports[0].protocol: "HTTP" is not one of TCP, UDP, SCTP',
        id="slice-port-protocol",
    ),
    pytest.param(
        as_list(SVC, patched(SLICE, "addressType", "IPv5")),
        'EndpointSlice default/web-abc: addressType: "IPv5" is not one of IPv4, IPv6, FQDN',
        id="slice-address-type-value",
    ),
    pytest.param(
        as_list(
            SVC,
            patched(
                SLICE,
                "metadata.annotations",
                {"endpoints.kubernetes.io/last-change-trigger-time": "yesterday"},
            ),
        ),
        "EndpointSlice default/web-abc: "
        'metadata.annotations["endpoints.kubernetes.io/last-change-trigger-time"]: '
        '"yesterday" is not an RFC 3339 time',
        id="slice-trigger-time",
    ),
    pytest.param(
        as_list(patched(NODE, "metadata.name", "")),
        "Node <unnamed> (document 1 items[0]): metadata.name: required",
        id="node-no-name",
    ),
    pytest.param(
        as_list(patched(NODE, "status.addresses.0.type", DELETE)),
        "Node node-a: status.addresses[0].type: required",
        id="node-address-type",
    ),
    pytest.param(
        as_list(patched(NODE, "spec.taints", {"key": "x"})),
        "Node node-a: spec.taints: expected a list, got mapping",
        id="node-taints",
    ),
    pytest.param(
        as_list(patched(NODE, "spec.taints", [{"effect": "NoSchedule"}])),
        "Node node-a: spec.taints[0].key: required",
        id="node-taint-key",
    ),
    pytest.param(
        as_list(SVC, patched(SVC, "spec.ports.0.nodePort", 30081)),
        "Service default/web: metadata.name: duplicate Service (in document 1 items[0] "
        "and document 1 items[1])",
        id="dup-service",
    ),
    pytest.param(
        as_documents(NODE, NODE),
        "Node node-a: metadata.name: duplicate Node (in document 1 and document 2)",
        id="dup-node",
    ),
    pytest.param(
        as_list(SVC, SLICE, SLICE),
        "EndpointSlice default/web-abc: metadata.name: duplicate EndpointSlice (in "
        "document 1 items[1] and document 1 items[2])",
        id="dup-slice",
    ),
    pytest.param(
        as_list(SVC, service("api")),
        "Service default/api: spec.ports[0].nodePort: 30080/TCP is also used by "
        "Service default/web spec.ports[0].nodePort",
        id="dup-nodeport",
    ),
    pytest.param(
        as_list(
            patched(
                SVC,
                "spec.ports",
                [
                    {"name": "a", "port": 1, "nodePort": 30001},
                    {"name": "b", "port": 2, "nodePort": 30001},
                ],
            )
        ),
        "Service default/web: spec.ports[1].nodePort: 30001/TCP is also used by "
        "Service default/web spec.ports[0].nodePort",
        id="dup-nodeport-one-service",
    ),
    pytest.param(
        as_list(
            SVC,
            service(
                "lb",
                type="LoadBalancer",
                externalTrafficPolicy="Local",
                healthCheckNodePort=30080,
                ports=[{"port": 80, "nodePort": 30090}],
            ),
        ),
        "Service default/lb: spec.healthCheckNodePort: 30080/TCP is also used by "
        "Service default/web spec.ports[0].nodePort",
        id="dup-hc-port",
    ),
    pytest.param(
        "kind: Service\nmetadata: {name: web\nspec: {}\n",
        "YAML syntax error at line 3, column 5: did not find expected ',' or '}' "
        "(while parsing a flow mapping that starts at line 2, column 11)",
        id="yaml-syntax",
    ),
    pytest.param(
        "kind: Service\nmetadata:\n\tname: web\n",
        "YAML syntax error at line 3, column 1: found character that cannot start any "
        "token (while scanning for the next token)",
        id="yaml-tab",
    ),
]


@pytest.mark.parametrize(("text", "expected"), MALFORMED)
def test_each_defect_gives_one_precise_problem(text: str, expected: str) -> None:
    assert problems_of(text) == [expected]


def test_every_problem_is_collected() -> None:
    text = as_list(
        patched(SVC, "spec.ports.0.nodePort", 70000),
        patched(service("api"), "spec.externalTrafficPolicy", "Global"),
        patched(SLICE, "endpoints.0.addresses", []),
        patched(NODE, "metadata.name", DELETE),
        patched(service("db", ports=[{"port": 5432, "nodePort": 30001}]), "spec.type", "Headless"),
        service("db2", ports=[{"port": 5432, "nodePort": 30001}]),
    )
    problems = problems_of(text)
    assert problems == [
        "Service default/web: spec.ports[0].nodePort: 70000 is out of range 1-65535",
        'Service default/api: spec.externalTrafficPolicy: "Global" is not one of Cluster, Local',
        "EndpointSlice default/web-abc: endpoints[0].addresses: required",
        "Node <unnamed> (document 1 items[3]): metadata.name: required",
        'Service default/db: spec.type: "Headless" is not one of '
        "ClusterIP, NodePort, LoadBalancer, ExternalName",
        "Service default/db2: spec.ports[0].nodePort: 30001/TCP is also used by "
        "Service default/db spec.ports[0].nodePort",
    ]
    with pytest.raises(StateError) as info:
        parse_state(text)
    assert str(info.value) == "\n".join(problems)


def test_problems_in_one_object_are_all_reported() -> None:
    bad = patched(SVC, "spec.ports.0.nodePort", 0.5)
    bad = patched(bad, "spec.ports.0.port", None)
    bad = patched(bad, "spec.sessionAffinity", 1)
    assert problems_of(as_list(bad)) == [
        "Service default/web: spec.sessionAffinity: expected a string, got integer 1",
        "Service default/web: spec.ports[0].port: required",
        "Service default/web: spec.ports[0].nodePort: expected an integer, got number 0.5",
    ]


def test_state_error_is_a_value_error_with_problems() -> None:
    err = StateError(["a: b: c", "d: e: f"])
    assert isinstance(err, ValueError)
    assert err.problems == ["a: b: c", "d: e: f"]
    assert str(err) == "a: b: c\nd: e: f"


def test_parse_file_rejects_non_utf8(tmp_path: Path) -> None:
    path = tmp_path / "state.yaml"
    path.write_bytes(b"kind: Service\nmetadata: {name: \xff}\n")
    with pytest.raises(StateError, match=r"not UTF-8 text \(invalid start byte at byte 31\)"):
        parse_file(path)


def test_parse_file_leaves_os_errors_to_the_caller(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        parse_file(tmp_path / "missing.yaml")


# -- generated states and speed --------------------------------------------------------


def test_generated_yaml_round_trips(
    make_state: Callable[[int, int, int], dict[str, Any]],
    make_state_yaml: Callable[[int, int, int], str],
) -> None:
    from_text = parse_state(make_state_yaml(60, 3, 4))
    assert from_text == parse_objects([make_state(60, 3, 4)])
    assert (len(from_text.nodes), len(from_text.services), len(from_text.slices)) == (4, 60, 60)
    assert sum(s.needs_health_check for s in from_text.services) == 20


def test_gc_state_is_restored() -> None:
    assert gc.isenabled()
    parse_state(as_list(SVC))
    assert gc.isenabled()
    with pytest.raises(StateError):
        parse_state(as_list(patched(SVC, "spec", DELETE)))
    assert gc.isenabled()
    gc.disable()
    try:
        parse_state(as_list(SVC))
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_ten_thousand_services_convert_whole(
    make_state: Callable[[int, int, int], dict[str, Any]],
) -> None:
    """10k services x 3 endpoints, already decoded: every one comes through. How fast is
    the bench's to say (``kpx bench --workloads control``, ``apply-10000``): a CPU-time
    bound here went red on a loaded CI machine (1.002 s against 1.0)."""
    snap = parse_objects([make_state(10_000, 3, 50)])
    assert len(snap.services) == 10_000 and len(snap.slices) == 10_000
    assert sum(len(s.endpoints) for s in snap.slices) == 30_000
