"""Kubernetes YAML -> the immutable model: the only door into a ``Snapshot``.

Owns: reading what ``kubectl get nodes,svc,endpointslices -A -o yaml`` prints
(multi-document streams, ``kind: List``, typed ``NodeList``/``ServiceList``/
``EndpointSliceList``, in any mix and order) into ``proxy.model`` objects, and
every check kpx makes before it trusts a state.

Never: hold state, touch sockets, or return half a result. A parse either
yields a whole Snapshot or raises ``StateError``; that is what lets the state
source keep serving the last good snapshot when someone saves a broken file.

Theory of operation:

- Problems are collected, not raised one at a time: whoever fixes a state file
  wants every mistake at once. Each one names the object and the field path,
  ``Service default/web: spec.ports[0].nodePort: 70000 is out of range 1-65535``.
  An object whose name is unknown is named by where it sits in the stream,
  ``Service <unnamed> (document 2 items[3])``.
- What kube-proxy never looks at is dropped before its body is validated:
  kinds other than v1 Node, v1 Service and discovery.k8s.io/v1 EndpointSlice
  (so a Knative ``serving.knative.dev/v1`` Service is not mistaken for one),
  ignored services (headless, ExternalName, the ``service-proxy-name`` and
  ``headless`` labels) and non-IPv4 slices. Their metadata is still checked,
  because names are what duplicates and slice links are judged by.
- Slices are linked to services only after the whole stream is read, since
  kubectl prints kinds in any order. A slice whose service is absent or
  ignored is dropped silently, as kube-proxy does: slices outlive their
  service for a moment on every delete.
- Endpoint conditions resolve here, once, exactly as in EndpointSliceCache:
  nil ready and nil serving mean true, nil terminating means false.
- Speed matters (10k services must cost a fraction of a second on top of
  PyYAML): fields are plain dict lookups checked with ``type(v) is``, which is
  also what stops a YAML ``true`` passing as the integer 1, and a field path
  string is only built once a problem is found.
"""

from __future__ import annotations

import gc
import re
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, cast

import yaml

from proxy.model import (
    DEFAULT_AFFINITY_SECONDS,
    Endpoint,
    EndpointPort,
    EndpointSlice,
    Node,
    Service,
    ServicePort,
    ServiceType,
    SessionAffinity,
    Snapshot,
    TrafficPolicy,
)

_LOADER: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
"""libyaml's loader is ~10x faster than the pure-Python one; same safety."""

SERVICE_NAME_LABEL = "kubernetes.io/service-name"
SERVICE_PROXY_NAME_LABEL = "service.kubernetes.io/service-proxy-name"
HEADLESS_LABEL = "service.kubernetes.io/headless"
TRIGGER_TIME_ANNOTATION = "endpoints.kubernetes.io/last-change-trigger-time"

MAX_AFFINITY_SECONDS = 86400
"""``MaxClientIPServiceAffinitySeconds``: the API server rejects anything longer."""

_PROTOCOLS = ("TCP", "UDP", "SCTP")
_SERVICE_TYPES = ("ClusterIP", "NodePort", "LoadBalancer", "ExternalName")
_POLICIES = ("Cluster", "Local")
_AFFINITIES = ("None", "ClientIP")
_ADDRESS_TYPES = ("IPv4", "IPv6", "FQDN")

_API_VERSIONS = {"Node": "v1", "Service": "v1", "EndpointSlice": "discovery.k8s.io/v1"}
"""The kinds kpx reads, and the only apiVersion each is accepted under."""

_LIST_KINDS: dict[str, str | None] = {
    "List": None,
    "NodeList": "Node",
    "ServiceList": "Service",
    "EndpointSliceList": "EndpointSlice",
}
"""List kinds and the kind their items default to: the API's typed lists
(``kubectl get --raw``) leave ``kind`` out of every item."""

_OCTET = r"(?:25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
_IPV4 = re.compile(rf"{_OCTET}(?:\.{_OCTET}){{3}}")
"""Dotted quad without leading zeros; a regex is ~5x cheaper than ipaddress."""

_TYPE_NAMES = {
    bool: "boolean",
    int: "integer",
    float: "number",
    str: "string",
    list: "list",
    dict: "mapping",
    type(None): "null",
    datetime: "timestamp",
}


class StateError(ValueError):
    """A state that kpx refuses to apply; ``problems`` lists every reason."""

    def __init__(self, problems: Iterable[str]) -> None:
        self.problems: list[str] = list(problems)
        super().__init__("\n".join(self.problems))

    def __str__(self) -> str:
        return "\n".join(self.problems)


def _describe(value: object) -> str:
    """``string "80"``, ``integer 7``, ``list``: what a wrong value was, briefly."""
    name = _TYPE_NAMES.get(type(value), type(value).__name__)
    if type(value) is str:
        shown = value if len(value) <= 40 else value[:37] + "..."
        return f'{name} "{shown}"'
    if type(value) is bool:
        return f"{name} {str(value).lower()}"
    if type(value) in (int, float):
        return f"{name} {value!r}"
    return name


def _a(type_name: str) -> str:
    return f"an {type_name}" if type_name[0] in "aeiou" else f"a {type_name}"


class _Fields:
    """Reads the fields of one object, recording a problem for each bad one.

    Getters never raise: a bad field yields a harmless default and marks the
    object ``ok = False``, so the rest of it is still checked and every
    problem is reported in one pass. ``prefix`` is the path of the mapping the
    field lives in (``"spec.ports[0]."``); the full path is only joined on
    failure.
    """

    __slots__ = ("label", "ok", "problems")

    def __init__(self, label: str, problems: list[str]) -> None:
        self.label = label
        self.problems = problems
        self.ok = True

    def fail(self, path: str, message: str) -> None:
        self.problems.append(f"{self.label}: {path}: {message}")
        self.ok = False

    def wrong_type(self, path: str, expected: str, value: object) -> None:
        self.fail(path, f"expected {_a(expected)}, got {_describe(value)}")

    def mapping(
        self, parent: dict[str, Any], key: str, prefix: str, required: bool = False
    ) -> dict[str, Any]:
        value = parent.get(key)
        if type(value) is dict:
            return value
        if value is None:
            if required:
                self.fail(prefix + key, "required")
        else:
            self.wrong_type(prefix + key, "mapping", value)
        return {}

    def items(self, parent: dict[str, Any], key: str, prefix: str) -> list[Any]:
        """A list field; absent or null is an empty list, as in Go."""
        value = parent.get(key)
        if type(value) is list:
            return value
        if value is not None:
            self.wrong_type(prefix + key, "list", value)
        return []

    def string(
        self,
        parent: dict[str, Any],
        key: str,
        prefix: str,
        default: str = "",
        required: bool = False,
        choices: tuple[str, ...] = (),
    ) -> str:
        value = parent.get(key)
        if type(value) is str:
            if choices and value not in choices:
                self.fail(prefix + key, f'"{value}" is not one of {", ".join(choices)}')
                return default
            if required and not value:
                self.fail(prefix + key, "required")
            return value
        if value is None:
            if required:
                self.fail(prefix + key, "required")
        else:
            self.wrong_type(prefix + key, "string", value)
        return default

    def optional_string(self, parent: dict[str, Any], key: str, prefix: str) -> str | None:
        value = parent.get(key)
        if value is None or type(value) is str:
            return value
        self.wrong_type(prefix + key, "string", value)
        return None

    def boolean(self, parent: dict[str, Any], key: str, prefix: str, default: bool) -> bool:
        value = parent.get(key)
        if type(value) is bool:
            return value
        if value is not None:
            self.wrong_type(prefix + key, "boolean", value)
        return default

    def integer(
        self, parent: dict[str, Any], key: str, prefix: str, default: int, low: int, high: int
    ) -> int:
        value = parent.get(key)
        if type(value) is int:
            if low <= value <= high:
                return value
            self.fail(prefix + key, f"{value} is out of range {low}-{high}")
        elif value is not None:
            self.wrong_type(prefix + key, "integer", value)
        return default

    def port(self, parent: dict[str, Any], key: str, prefix: str, required: bool = False) -> int:
        """A TCP/UDP port number; 0 (or absent) means unset unless required."""
        value = parent.get(key)
        if type(value) is int and (0 < value < 65536 or (value == 0 and not required)):
            return value
        if value is None:
            if required:
                self.fail(prefix + key, "required")
        elif type(value) is int:
            self.fail(prefix + key, f"{value} is out of range 1-65535")
        else:
            self.wrong_type(prefix + key, "integer", value)
        return 0

    def string_map(self, parent: dict[str, Any], key: str, prefix: str) -> dict[str, str]:
        """Labels, annotations, selectors: string keys to string values.

        YAML turns an unquoted ``version: 1`` into an int and ``on`` into a
        bool; the API would refuse both, so they are reported, not coerced.
        """
        value = self.mapping(parent, key, prefix)
        for k, v in value.items():
            if type(k) is not str:
                self.wrong_type(f"{prefix}{key}", "string key", k)
            elif type(v) is not str:
                self.wrong_type(f'{prefix}{key}["{k}"]', "string", v)
        return value

    def string_list(self, parent: dict[str, Any], key: str, prefix: str) -> tuple[str, ...]:
        value = self.items(parent, key, prefix)
        for i, v in enumerate(value):
            if type(v) is not str:
                self.wrong_type(f"{prefix}{key}[{i}]", "string", v)
        return tuple(value)


def _pairs(mapping: dict[str, str]) -> tuple[tuple[str, str], ...]:
    return tuple(mapping.items())


def _timestamp(fields: _Fields, value: object, path: str) -> float | None:
    """An RFC 3339 time as a UNIX time. Unquoted YAML times arrive as datetimes."""
    if value is None:
        return None
    if type(value) is str:
        try:
            value = datetime.fromisoformat(value)
        except ValueError:
            fields.fail(path, f'"{value}" is not an RFC 3339 time')
            return None
    if isinstance(value, datetime):
        if value.tzinfo is None:
            value = value.replace(tzinfo=UTC)
        return value.timestamp()
    fields.wrong_type(path, "RFC 3339 time string", value)
    return None


class _Parser:
    """One pass over a stream of decoded documents; ``finish`` links and judges."""

    def __init__(self) -> None:
        self.problems: list[str] = []
        self.nodes: list[Node] = []
        self.services: dict[str, Service] = {}
        self.ignored: set[str] = set()
        self.slices: list[EndpointSlice] = []
        self.seen: dict[tuple[str, str], str] = {}
        """(kind, name or ns/name) -> where it was first seen, for duplicates."""
        self.node_ports: dict[tuple[int, str], str] = {}
        """(port, protocol) -> ``Service ns/name field.path`` that holds it."""

    # -- the stream -------------------------------------------------------

    def document(self, doc: object, where: str) -> None:
        if doc is None:
            return
        self.item(doc, where, None)

    def item(self, doc: object, where: str, default_kind: str | None) -> None:
        if type(doc) is not dict:
            self.problems.append(
                f"{where}: expected a mapping (a Kubernetes object or List), got {_describe(doc)}"
            )
            return
        kind = doc.get("kind", default_kind)
        if type(kind) is not str or not kind:
            detail = "required" if kind is None else f"expected a string, got {_describe(kind)}"
            self.problems.append(f"{where}: kind: {detail}")
            return
        if kind in _LIST_KINDS:
            items = doc.get("items")
            if items is None:
                return
            if type(items) is not list:
                self.problems.append(
                    f"{where} ({kind}): items: expected a list, got {_describe(items)}"
                )
                return
            item_kind = _LIST_KINDS[kind]
            for i, item in enumerate(items):
                self.item(item, f"{where} items[{i}]", item_kind)
            return
        api_version = _API_VERSIONS.get(kind)
        if api_version is None or doc.get("apiVersion", api_version) != api_version:
            return  # Not an object kpx reads (Pod, ConfigMap, a CRD that reuses a name...).
        fields = _Fields(f"{kind} <unnamed> ({where})", self.problems)
        if kind == "Service":
            self.service(fields, doc, where)
        elif kind == "EndpointSlice":
            self.endpoint_slice(fields, doc, where)
        else:
            self.node(fields, doc, where)

    def metadata(
        self, fields: _Fields, doc: dict[str, Any], kind: str, where: str, namespaced: bool
    ) -> tuple[str, dict[str, Any]] | None:
        """Name the object (``ns/name`` or ``name``) and claim that name.

        Returns None for an object that must not go further: nameless, or a
        second object of the same kind and name (reported against both places).
        """
        meta = fields.mapping(doc, "metadata", "", required=True)
        if not fields.ok:
            return None  # Already reported; "metadata.name: required" would say it twice.
        name = fields.string(meta, "name", "metadata.", required=True)
        if not name:
            return None
        key = name
        if namespaced:
            namespace = meta.get("namespace")
            key = f"{namespace if namespace and type(namespace) is str else 'default'}/{name}"
        fields.label = f"{kind} {key}"
        if namespaced:
            fields.string(meta, "namespace", "metadata.")  # Only to report a wrong type.
        first = self.seen.get((kind, key))
        if first is not None:
            fields.fail("metadata.name", f"duplicate {kind} (in {first} and {where})")
            return None
        self.seen[(kind, key)] = where
        return key, meta

    def node(self, fields: _Fields, doc: dict[str, Any], where: str) -> None:
        named = self.metadata(fields, doc, "Node", where, namespaced=False)
        if named is None:
            return
        name, meta = named
        labels = fields.string_map(meta, "labels", "metadata.")
        deletion = meta.get("deletionTimestamp")
        if isinstance(deletion, datetime):
            deletion = deletion.isoformat()
        elif deletion is not None and type(deletion) is not str:
            fields.wrong_type("metadata.deletionTimestamp", "string", deletion)
            deletion = None

        spec = fields.mapping(doc, "spec", "")
        taint_keys: list[str] = []
        for i, taint in enumerate(fields.items(spec, "taints", "spec.")):
            if type(taint) is not dict:
                fields.wrong_type(f"spec.taints[{i}]", "mapping", taint)
                continue
            taint_keys.append(fields.string(taint, "key", f"spec.taints[{i}].", required=True))

        status = fields.mapping(doc, "status", "")
        internal: list[str] = []
        external: list[str] = []
        for i, addr in enumerate(fields.items(status, "addresses", "status.")):
            if type(addr) is not dict:
                fields.wrong_type(f"status.addresses[{i}]", "mapping", addr)
                continue
            prefix = f"status.addresses[{i}]."
            addr_type = fields.string(addr, "type", prefix, required=True)
            address = fields.string(addr, "address", prefix, required=True)
            if addr_type == "InternalIP":
                internal.append(address)
            elif addr_type == "ExternalIP":
                external.append(address)
        if fields.ok:
            self.nodes.append(
                Node(
                    name=name,
                    internal_ips=tuple(internal),
                    external_ips=tuple(external),
                    labels=_pairs(labels),
                    taint_keys=tuple(taint_keys),
                    deletion_timestamp=deletion,
                )
            )

    def service(self, fields: _Fields, doc: dict[str, Any], where: str) -> None:
        named = self.metadata(fields, doc, "Service", where, namespaced=True)
        if named is None:
            return
        key, meta = named
        labels = fields.string_map(meta, "labels", "metadata.")
        spec = fields.mapping(doc, "spec", "", required=True)
        if (
            SERVICE_PROXY_NAME_LABEL in labels
            or HEADLESS_LABEL in labels
            or spec.get("type") == "ExternalName"
            or spec.get("clusterIP") == "None"
        ):
            # kube-proxy's informer never even sees these; neither does kpx.
            self.ignored.add(key)
            return

        svc_type = fields.string(spec, "type", "spec.", "ClusterIP", choices=_SERVICE_TYPES)
        etp = fields.string(spec, "externalTrafficPolicy", "spec.", "Cluster", choices=_POLICIES)
        itp = fields.string(spec, "internalTrafficPolicy", "spec.", "Cluster", choices=_POLICIES)
        hc_port = fields.port(spec, "healthCheckNodePort", "spec.")
        affinity = fields.string(spec, "sessionAffinity", "spec.", "None", choices=_AFFINITIES)
        timeout = DEFAULT_AFFINITY_SECONDS
        if affinity == "ClientIP":
            config = fields.mapping(spec, "sessionAffinityConfig", "spec.")
            client_ip = fields.mapping(config, "clientIP", "spec.sessionAffinityConfig.")
            timeout = fields.integer(
                client_ip,
                "timeoutSeconds",
                "spec.sessionAffinityConfig.clientIP.",
                DEFAULT_AFFINITY_SECONDS,
                1,
                MAX_AFFINITY_SECONDS,
            )
        selector = fields.string_map(spec, "selector", "spec.")
        external_ips = fields.string_list(spec, "externalIPs", "spec.")
        cluster_ip = fields.optional_string(spec, "clusterIP", "spec.")
        publish = fields.boolean(spec, "publishNotReadyAddresses", "spec.", False)

        raw_ports = fields.items(spec, "ports", "spec.")
        if type(doc.get("spec")) is dict and spec.get("ports") in (None, []):
            fields.fail("spec.ports", "required")
        ports: list[ServicePort] = []
        port_names: dict[str, int] = {}
        for i, raw in enumerate(raw_ports):
            prefix = f"spec.ports[{i}]."
            if type(raw) is not dict:
                fields.wrong_type(f"spec.ports[{i}]", "mapping", raw)
                continue
            name = fields.string(raw, "name", prefix)
            if name in port_names:
                fields.fail(
                    prefix + "name",
                    f'duplicate port name "{name}" (also spec.ports[{port_names[name]}])',
                )
            port_names.setdefault(name, i)
            protocol = fields.string(raw, "protocol", prefix, "TCP", choices=_PROTOCOLS)
            port = fields.port(raw, "port", prefix, required=True)
            target: int | str = port
            raw_target = raw.get("targetPort")
            if type(raw_target) is str and raw_target:
                target = raw_target
            elif raw_target is not None:
                target = fields.port(raw, "targetPort", prefix, required=True) or port
            node_port = fields.port(raw, "nodePort", prefix)
            if node_port:
                self.claim_node_port(fields, node_port, protocol, prefix + "nodePort")
            ports.append(ServicePort(name, protocol, port, target, node_port))

        service = Service(
            namespace=key.partition("/")[0],
            name=key.partition("/")[2],
            type=cast(ServiceType, svc_type),
            ports=tuple(ports),
            cluster_ip=cluster_ip,
            external_traffic_policy=cast(TrafficPolicy, etp),
            internal_traffic_policy=cast(TrafficPolicy, itp),
            health_check_node_port=hc_port,
            session_affinity=cast(SessionAffinity, affinity),
            affinity_timeout_seconds=timeout,
            selector=_pairs(selector),
            labels=_pairs(labels),
            external_ips=external_ips,
            publish_not_ready_addresses=publish,
        )
        if service.needs_health_check:
            # The healthz sidecar listens on it over TCP, beside the NodePorts.
            self.claim_node_port(fields, hc_port, "TCP", "spec.healthCheckNodePort")
        if fields.ok:
            self.services[key] = service

    def claim_node_port(self, fields: _Fields, port: int, protocol: str, path: str) -> None:
        """Record who listens on ``port/protocol``; a second claim is a problem.

        The API server allocates node ports cluster-wide, so a clash means the
        state was not written by one; kpx could serve only one of the two.
        """
        first = self.node_ports.get((port, protocol))
        if first is not None:
            fields.fail(path, f"{port}/{protocol} is also used by {first}")
        else:
            self.node_ports[(port, protocol)] = f"{fields.label} {path}"

    def endpoint_slice(self, fields: _Fields, doc: dict[str, Any], where: str) -> None:
        named = self.metadata(fields, doc, "EndpointSlice", where, namespaced=True)
        if named is None:
            return
        key, meta = named
        address_type = fields.string(
            doc, "addressType", "", "IPv4", required=False, choices=_ADDRESS_TYPES
        )
        if address_type != "IPv4":
            return  # kpx proxies IPv4 only, like a single-stack IPv4 kube-proxy.
        labels = fields.string_map(meta, "labels", "metadata.")
        service_name = labels.get(SERVICE_NAME_LABEL)
        if not service_name:
            fields.fail(f'metadata.labels["{SERVICE_NAME_LABEL}"]', "required")
        annotations = fields.mapping(meta, "annotations", "metadata.")
        trigger_time = _timestamp(
            fields,
            annotations.get(TRIGGER_TIME_ANNOTATION),
            f'metadata.annotations["{TRIGGER_TIME_ANNOTATION}"]',
        )

        endpoints: list[Endpoint] = []
        for i, raw in enumerate(fields.items(doc, "endpoints", "")):
            endpoint = self.endpoint(fields, raw, f"endpoints[{i}]")
            if endpoint is not None:
                endpoints.append(endpoint)

        ports: list[EndpointPort] = []
        for i, raw in enumerate(fields.items(doc, "ports", "")):
            if type(raw) is not dict:
                fields.wrong_type(f"ports[{i}]", "mapping", raw)
                continue
            prefix = f"ports[{i}]."
            name = fields.string(raw, "name", prefix)
            protocol = fields.string(raw, "protocol", prefix, "TCP", choices=_PROTOCOLS)
            # A port without a number is skipped, as EndpointSliceCache does.
            port = fields.port(raw, "port", prefix)
            if port:
                ports.append(EndpointPort(name, port, protocol))

        if fields.ok:
            namespace, _, name = key.partition("/")
            self.slices.append(
                EndpointSlice(
                    namespace=namespace,
                    name=name,
                    service_name=service_name,
                    endpoints=tuple(endpoints),
                    ports=tuple(ports),
                    address_type=address_type,
                    trigger_time=trigger_time,
                )
            )

    def endpoint(self, fields: _Fields, raw: object, path: str) -> Endpoint | None:
        """One endpoint: its first address, resolved conditions and locality."""
        if type(raw) is not dict:
            fields.wrong_type(path, "mapping", raw)
            return None
        prefix = path + "."
        addresses = raw.get("addresses")
        address = ""
        if type(addresses) is not list:
            if addresses is None:
                fields.fail(prefix + "addresses", "required")
            else:
                fields.wrong_type(prefix + "addresses", "list", addresses)
        elif not addresses:
            fields.fail(prefix + "addresses", "required")
        else:
            # kube-proxy uses only the first address; the API allows exactly one.
            address = addresses[0]
            if type(address) is not str:
                fields.wrong_type(prefix + "addresses[0]", "string", address)
            elif not _IPV4.fullmatch(address):
                fields.fail(prefix + "addresses[0]", f'"{address}" is not an IPv4 address')

        conditions = raw.get("conditions")
        ready = serving = True
        terminating = False
        if type(conditions) is dict:
            ready = conditions.get("ready", True)
            serving = conditions.get("serving", True)
            terminating = conditions.get("terminating", False)
            if not (type(ready) is type(serving) is type(terminating) is bool):
                # Rare path: an explicit null (same as absent) or a wrong type.
                cprefix = prefix + "conditions."
                ready = fields.boolean(conditions, "ready", cprefix, True)
                serving = fields.boolean(conditions, "serving", cprefix, True)
                terminating = fields.boolean(conditions, "terminating", cprefix, False)
        elif conditions is not None:
            fields.wrong_type(prefix + "conditions", "mapping", conditions)

        node_name = fields.optional_string(raw, "nodeName", prefix)
        pod_name = None
        target_ref = raw.get("targetRef")
        if target_ref is not None:
            if type(target_ref) is dict:
                if target_ref.get("kind") == "Pod":
                    pod_name = fields.optional_string(target_ref, "name", prefix + "targetRef.")
            else:
                fields.wrong_type(prefix + "targetRef", "mapping", target_ref)
        return Endpoint(address, node_name or None, ready, serving, terminating, pod_name)

    # -- the verdict ------------------------------------------------------

    def finish(self, generation: int) -> Snapshot:
        if self.problems:
            raise StateError(self.problems)
        services = self.services
        return Snapshot(
            nodes=tuple(self.nodes),
            services=tuple(services.values()),
            # An orphan slice (service gone, ignored, or not yet written) is
            # not a problem: kube-proxy drops it too and it reappears with
            # its service.
            slices=tuple(s for s in self.slices if s.service_key in services),
            generation=generation,
        )


@contextmanager
def _gc_paused() -> Iterator[None]:
    """Pause the cyclic GC while a state is built.

    Decoding 10k services allocates millions of acyclic dicts and strings;
    each allocation burst triggers a full-generation collection that walks
    all of them again, which more than doubles the cost of PyYAML and of
    this module. Nothing built here forms a cycle, so reference counting
    frees it all anyway. Restored only if it was on, so nesting is safe.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def parse_objects(documents: Iterable[object], generation: int = 0) -> Snapshot:
    """Build a Snapshot from already-decoded YAML/JSON documents.

    Each document is an object, a List, or None (an empty document). This is
    ``parse_state`` minus the YAML decoding, for sources that decode
    themselves (JSON from an API server, tests).
    """
    with _gc_paused():
        parser = _Parser()
        for i, doc in enumerate(documents, 1):
            parser.document(doc, f"document {i}")
        return parser.finish(generation)


def _mark(mark: Any) -> str:
    return f"line {mark.line + 1}, column {mark.column + 1}"


def _yaml_error_detail(err: yaml.MarkedYAMLError) -> str:
    """``line 27, column 28: did not find expected key (while parsing ... at line 25, ...)``."""
    mark = err.problem_mark or err.context_mark
    detail = f"{_mark(mark) if mark else 'an unknown place'}: {err.problem or err.context}"
    if err.problem and err.context:
        detail += f" ({err.context}"
        context_mark = err.context_mark
        if context_mark and (
            mark is None or (context_mark.line, context_mark.column) != (mark.line, mark.column)
        ):
            detail += f" that starts at {_mark(context_mark)}"
        detail += ")"
    return detail


def _load_all(text: str) -> list[object]:
    try:
        return list(yaml.load_all(text, Loader=_LOADER))
    except yaml.MarkedYAMLError as err:
        raise StateError([f"YAML syntax error at {_yaml_error_detail(err)}"]) from err
    except yaml.YAMLError as err:
        raise StateError([f"YAML error: {err}"]) from err


def parse_state(text: str, generation: int = 0) -> Snapshot:
    """Parse a YAML stream of Nodes, Services and EndpointSlices into a Snapshot.

    Raises ``StateError`` listing every problem found; see the module
    docstring for what is checked and what is silently dropped.
    """
    with _gc_paused():
        return parse_objects(_load_all(text), generation)


def parse_file(path: str | Path, generation: int = 0) -> Snapshot:
    """``parse_state`` of a UTF-8 file. ``OSError`` is left to the caller."""
    data = Path(path).read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise StateError([f"{path}: not UTF-8 text ({err.reason} at byte {err.start})"]) from err
    return parse_state(text, generation)
