"""One decoded document -> its verdict: every check of its fields, and its model objects.

Owns: the first of the two passes, *judging* (``_judge``): the API server's
name formats (``_NAME_RULES``); reading fields, with a problem recorded for
each bad one (``_Fields``); the full judge (``_Judge``) and its shortcuts for
plain objects (``_quick_service``, ``_quick_slice``); and the verdicts it
hands to the second pass, ``link`` (``_Verdict``, ``_Object``, ``_Located``,
``_Claim``). Also the labels and the annotation kpx reads
(``SERVICE_NAME_LABEL``, ``HEADLESS_LABEL``, ...).

Never: look past the one document it judges, or depend on where that
document sits; the checks that span documents are ``link``'s.

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
  ``headless`` labels) and FQDN slices. Their metadata is still checked,
  because names are what duplicates and slice links are judged by.
- A Service's addresses (``spec.clusterIP``/``clusterIPs``, ``spec.externalIPs``,
  ``status.loadBalancer.ingress[]``) are held to the API server's rules
  (``_cluster_ip``, ``_external_ips``, ``_ingress``), and kept in both
  families: each family's plans take their own (``Service.serves``,
  ``Service.cluster_ip_of``), as kube-proxy's per-family proxiers do. IPv6
  addresses are kept in their canonical text, the form sockets report.
  ``spec.loadBalancerSourceRanges`` likewise (``_source_ranges``): CIDRs of
  both families, as networks, split per family only where plans are built.
- Endpoint conditions resolve here, once, exactly as in EndpointSliceCache:
  nil ready and nil serving mean true, nil terminating means false.
- Names are held to the API server's formats (``_NAME_RULES``): Service names
  are DNS-1035 labels, namespaces DNS-1123 labels, Node and EndpointSlice
  names and endpoint ``nodeName``s DNS-1123 subdomains; label keys and values
  (``kubernetes.io/service-name`` included, which links a slice to its
  Service) follow the label rules. kube-proxy never sees anything else, and a
  valid name holds nothing a log, a shell or nft could misread.
- Speed matters (10k services must cost a fraction of a second on top of
  decoding): fields are plain dict lookups checked with ``type(v) is``, which
  is also what stops a YAML ``true`` passing as the integer 1, and a field
  path string is only built once a problem is found. A plain Service or
  IPv4 slice, nearly every object of a state, is judged by a shortcut
  (``_quick_service``, ``_quick_slice``) that only accepts what the full
  judge would accept without a problem, and builds the same objects; on
  anything else it steps aside, so every problem is still worded in one place.

Judging is the first of two passes, so that it can be cached (``stream``):
*judging* (``_judge``) reads one decoded document alone and yields a
``_Verdict``: its model objects and every problem that depends on that
document only. Nothing in a verdict depends on where the document sits:
a problem that names a position keeps it relative (``_Located``), and the
nodePorts an object listens on are recorded as ``_Claim``s, not judged.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from ipaddress import IPv6Address, ip_network
from typing import Any, NamedTuple, cast

from proxy.core.model import (
    DEFAULT_AFFINITY_SECONDS,
    Endpoint,
    EndpointPort,
    EndpointSlice,
    IPFamily,
    IPFamilyPolicy,
    IPMode,
    LoadBalancerIngress,
    Network,
    Node,
    Service,
    ServicePort,
    ServiceType,
    SessionAffinity,
    TrafficPolicy,
)
from proxy.k8s.problems import _quote

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
_IP_MODES = ("VIP", "Proxy")
_IP_FAMILIES = ("IPv4", "IPv6")
_IP_FAMILY_POLICIES = ("SingleStack", "PreferDualStack", "RequireDualStack")
_FAMILY_OF = {"IPv4": 4, "IPv6": 6}
_IPV4_ONLY = ["IPv4"]
"""``spec.ipFamilies`` of a single-stack IPv4 Service, as the quick judge compares it."""
_IPV4_FAMILY: tuple[IPFamily, ...] = ("IPv4",)
"""``status.loadBalancer.ingress[].ipMode`` (KEP-1860); absent means VIP."""

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
_ipv4 = _IPV4.fullmatch
"""Bound once: the quick judge calls it for every Service's clusterIP."""

_SPECIAL_IPV4 = ("0.", "127.", "169.254.", "224.0.0.")
"""Prefixes of the ranges ``_special_ip`` refuses for externalIPs (and then some:
all of 0.0.0.0/8), for the quick judge, which only has to step aside for them."""


def _ip_family(value: str) -> int:
    """4 or 6 for a valid IP address, 0 for anything else.

    The API server's strict form (``IsValidIP`` once KEP-4858 made it strict):
    IPv4 as a dotted quad without leading zeros (``010.0.0.1`` is ambiguous),
    IPv6 as ``ipaddress`` reads it, but with no zone (``%eth0``) and not
    IPv4-mapped (``::ffff:10.0.0.1``, an IPv4 address in disguise).
    """
    if _IPV4.fullmatch(value):
        return 4
    if ":" not in value or "%" in value:
        return 0
    try:
        address = IPv6Address(value)
    except ValueError:
        return 0
    return 0 if address.ipv4_mapped is not None else 6


def _special_ip(value: str, family: int) -> str | None:
    """Why ``value`` (valid, of ``family``) may not be an external IP, or None.

    The API server's ``ValidateNonSpecialIP`` for ``spec.externalIPs``, in its
    words: these addresses mean this host or its link, never a service, and
    capturing one (127.0.0.1:80, the 169.254.169.254 metadata server) would
    break the node's own traffic.
    """
    if family == 4:
        unspecified = value == "0.0.0.0"
        loopback = value.startswith("127.")
        link_local = value.startswith("169.254.")
        link_multicast = value.startswith("224.0.0.")
    else:
        address = IPv6Address(value)
        unspecified = address.is_unspecified
        loopback = address.is_loopback
        link_local = address.is_link_local
        packed = address.packed
        link_multicast = packed[0] == 0xFF and packed[1] & 0x0F == 0x02
    if unspecified:
        return "may not be unspecified"
    if loopback:
        return "may not be in the loopback range (127.0.0.0/8, ::1/128)"
    if link_local:
        return "may not be in the link-local range (169.254.0.0/16, fe80::/10)"
    if link_multicast:
        return "may not be in the link-local multicast range (224.0.0.0/24, ff02::/10)"
    return None


# Names and labels, as the API server validates them (k8s.io/apimachinery
# pkg/util/validation). kube-proxy only ever sees objects that passed these
# checks, so a state that fails one was not written by an API server; and a
# name that passes can hold no space, quote, ``;``, ``$``, backquote or line
# break, so names print safely everywhere kpx prints them (logs, /metrics,
# health check bodies). Each length limit is a lookahead, so a huge name
# fails in one step and every check is one regex call.

_DNS1123_LABEL = r"[a-z0-9](?:[-a-z0-9]*[a-z0-9])?"
_DNS1035_LABEL = r"[a-z](?:[-a-z0-9]*[a-z0-9])?"
_DNS1123_SUBDOMAIN = rf"{_DNS1123_LABEL}(?:\.{_DNS1123_LABEL})*"
_QUALIFIED_NAME = r"[A-Za-z0-9](?:[-A-Za-z0-9_.]*[A-Za-z0-9])?"

_LABEL_RULE = "at most 63 characters: letters, digits, '-', '_' and '.', "
_LABEL_RULE += "beginning and ending with a letter or digit"


class _NameRule(NamedTuple):
    """One of the API server's name formats: a ``fullmatch`` and what it asks for."""

    match: Callable[[str], object]
    rule: str

    def problem(self, value: str, what: str) -> str:
        return f"{_quote(value)} is not a valid {what}: {self.rule}"


_DNS1123_LABEL_RULE = _NameRule(
    re.compile(rf"(?!.{{64}}){_DNS1123_LABEL}").fullmatch,
    "a DNS-1123 label is at most 63 characters: lower-case letters, digits and '-', "
    "beginning and ending with a letter or digit",
)
_DNS1035_LABEL_RULE = _NameRule(
    re.compile(rf"(?!.{{64}}){_DNS1035_LABEL}").fullmatch,
    "a DNS-1035 label is at most 63 characters: lower-case letters, digits and '-', "
    "beginning with a letter and ending with a letter or digit",
)
_DNS1123_SUBDOMAIN_RULE = _NameRule(
    re.compile(rf"(?!.{{254}}){_DNS1123_SUBDOMAIN}").fullmatch,
    "a DNS-1123 subdomain is at most 253 characters: lower-case letters, digits, '-' and "
    "'.', each '.'-separated part beginning and ending with a letter or digit",
)
_LABEL_KEY_RULE = _NameRule(
    re.compile(rf"(?:(?![^/]{{254}}){_DNS1123_SUBDOMAIN}/)?(?!.{{64}}){_QUALIFIED_NAME}").fullmatch,
    f"an optional DNS-1123 subdomain and '/', then a name of {_LABEL_RULE}",
)
_LABEL_VALUE_RULE = _NameRule(
    re.compile(rf"(?!.{{64}})(?:{_QUALIFIED_NAME})?").fullmatch,
    f"empty, or {_LABEL_RULE}",
)

_NAME_RULES = {
    "Service": _DNS1035_LABEL_RULE,
    "EndpointSlice": _DNS1123_SUBDOMAIN_RULE,
    "Node": _DNS1123_SUBDOMAIN_RULE,
}
"""``metadata.name`` by kind: ValidateServiceName, ValidateEndpointSliceName, ValidateNodeName."""

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


def _shown(key: str) -> str:
    """An object's ``ns/name`` as a problem names it: bare when it is a plain name, else
    quoted (``Service "default/web\\nCRITICAL"``), so the label itself cannot break a line."""
    if key.isprintable() and " " not in key and '"' not in key and "\\" not in key:
        return key
    return _quote(key)


def _number(value: int | float) -> str:
    """A number for a problem; an int too long to print (over 4300 digits raises) by size."""
    if type(value) is int and value.bit_length() > 64:
        return f"{'-' if value < 0 else ''}{value.bit_length()}-bit number"
    return repr(value)


def _describe(value: object) -> str:
    """``string "80"``, ``integer 7``, ``list``: what a wrong value was, briefly."""
    name = _TYPE_NAMES.get(type(value), type(value).__name__)
    if type(value) is str:
        shown = value if len(value) <= 40 else value[:37] + "..."
        return f"{name} {_quote(shown)}"
    if type(value) is bool:
        return f"{name} {str(value).lower()}"
    if type(value) in (int, float):
        return f"{name} {_number(value)}"  # type: ignore[arg-type]
    return name


def _a(type_name: str) -> str:
    return f"an {type_name}" if type_name[0] in "aeiou" else f"a {type_name}"


# -- verdicts: what one document says, wherever it sits --------------------------
#
# Plain NamedTuples: immutable like the model, and several times cheaper to
# build than frozen dataclasses, which matters at 20,000 documents.


class _Located(NamedTuple):
    """A problem that names its object by position: ``{head}document {n}{rel}{tail}``.

    The document number is only known once the stream is linked, and a
    cached verdict must stay valid when documents before it come and go.
    """

    head: str
    rel: str
    """Where inside its document, ``""`` or ``" items[3]"``."""
    tail: str

    def text(self, number: int) -> str:
        return f"{self.head}document {number}{self.rel}{self.tail}"


_PROTOCOL_CODES = {protocol: code for code, protocol in enumerate(_PROTOCOLS)}


class _Claim(NamedTuple):
    """An object listens on ``port/protocol``; clashes are judged when linking."""

    port: int
    protocol: str
    label: str
    path: str

    @property
    def code(self) -> int:
        """``port/protocol`` as one int: a set of them is built on every parse."""
        return self.port << 2 | _PROTOCOL_CODES[self.protocol]


_Problem = str | _Located | _Claim
"""What ``_Fields`` records: a finished problem, a positional one, or a claim."""


class _Object(NamedTuple):
    """One named Node, Service or EndpointSlice, judged on its own."""

    kind: str
    key: str
    """``name`` or ``ns/name``."""
    ident: str
    """``kind/key``: what duplicates are judged by (a string hashes once, a tuple every time)."""
    rel: str
    early: tuple[str, ...]
    """Problems found before its name is claimed (a bad namespace type)."""
    body: tuple[str | _Claim, ...]
    """Problems and nodePort claims after the name, in the order they were found."""
    value: Node | Service | EndpointSlice | None
    """The model object; None if broken, ignored or not IPv4."""


class _Verdict(NamedTuple):
    """One decoded document, judged: replayable entries and fast-path summaries."""

    entries: tuple[_Located | _Object, ...]
    clean: bool
    """No problem of its own; only cross-document checks can still fail it."""
    idents: tuple[str, ...]
    claims: tuple[int, ...]
    """``_Claim.code`` of every claim."""
    nodes: tuple[Node, ...]
    services: tuple[Service, ...]
    slices: tuple[EndpointSlice, ...]


class _Fields:
    """Reads the fields of one object, recording a problem for each bad one.

    Getters never raise: a bad field yields a harmless default and marks the
    object ``ok = False``, so the rest of it is still checked and every
    problem is reported in one pass. ``prefix`` is the path of the mapping the
    field lives in (``"spec.ports[0]."``); the full path is only joined on
    failure. Until ``named``, problems are ``_Located`` (the object is known
    only by its position).
    """

    __slots__ = ("label", "named", "ok", "problems", "rel")

    def __init__(self, kind: str, rel: str, problems: list[_Problem]) -> None:
        self.label = f"{kind} <unnamed>"
        self.rel = rel
        self.named = False
        self.problems = problems
        self.ok = True

    def name(self, label: str) -> None:
        self.label = label
        self.named = True

    def fail(self, path: str, message: str) -> None:
        if self.named:
            self.problems.append(f"{self.label}: {path}: {message}")
        else:
            self.problems.append(_Located(f"{self.label} (", self.rel, f"): {path}: {message}"))
        self.ok = False

    def claim(self, port: int, protocol: str, path: str) -> None:
        """Record that this object listens on ``port/protocol``; ``_link`` judges clashes."""
        self.problems.append(_Claim(port, protocol, self.label, path))

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
                self.fail(prefix + key, f'{_quote(value)} is not one of {", ".join(choices)}')
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
            self.fail(prefix + key, f"{_number(value)} is out of range {low}-{high}")
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
            self.fail(prefix + key, f"{_number(value)} is out of range 1-65535")
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
                self.wrong_type(f"{prefix}{key}[{_quote(k)}]", "string", v)
        return value

    def labels(self, parent: dict[str, Any], key: str, prefix: str) -> dict[str, str]:
        """``metadata.labels``: a ``string_map`` whose keys and values the API server would take."""
        value = self.string_map(parent, key, prefix)
        for k, v in value.items():
            if type(k) is not str:
                continue  # Reported by ``string_map``.
            if not _LABEL_KEY_RULE.match(k):
                self.fail(f"{prefix}{key}[{_quote(k)}]", _LABEL_KEY_RULE.problem(k, "label key"))
            if type(v) is str and not _LABEL_VALUE_RULE.match(v):
                self.fail(
                    f"{prefix}{key}[{_quote(k)}]", _LABEL_VALUE_RULE.problem(v, "label value")
                )
        return value

    def string_list(self, parent: dict[str, Any], key: str, prefix: str) -> tuple[str, ...]:
        value = self.items(parent, key, prefix)
        for i, v in enumerate(value):
            if type(v) is not str:
                self.wrong_type(f"{prefix}{key}[{i}]", "string", v)
        return tuple(value)


_Interned = dict[tuple[object, ...], Any]
"""Endpoints by (address, node, ready, serving, terminating, pod) and slice ports by
(name, port, protocol): the lengths keep the two apart."""

_NO_STRINGS: dict[str, str] = {}
"""An absent mapping, for ``dict.get`` defaults; never written to."""
_NO_ITEMS: list[Any] = []
"""An absent list, for ``dict.get`` defaults; never written to."""


def _all_strings(mapping: dict[Any, Any]) -> bool:
    """Whether every key and value of ``mapping`` is a ``str``, as ``string_map`` wants."""
    for k, v in mapping.items():  # noqa: SIM110 - a loop is faster than all() on a genexpr.
        if type(k) is not str or type(v) is not str:
            return False
    return True


_GOOD_NAMESPACES: set[str] = set()
_GOOD_LABEL_KEYS: set[str] = set()
_GOOD_NODE_NAMES: set[str] = set()
"""Namespaces, label keys and node names known to be well-formed. A cluster has
few of each, and they repeat on every object (``app``,
``kubernetes.io/service-name``) and endpoint, so a set lookup replaces most
regex calls. Whether a string is
well-formed never changes, so sharing the sets between parses and threads is
safe; ``_MEMO_LIMIT`` bounds them against a state full of distinct ones."""
_MEMO_LIMIT = 4096


def _remember(known: set[str], text: str) -> None:
    if len(known) >= _MEMO_LIMIT:
        known.clear()
    known.add(text)


def _good_labels(labels: dict[Any, Any]) -> bool:
    """Whether every label is a string pair the API server would take (see ``_Fields.labels``).

    Label values (names, mostly) are checked by one regex call each; keys
    repeat, and are looked up in ``_GOOD_LABEL_KEYS`` first.
    """
    good_value = _LABEL_VALUE_RULE.match
    known_keys = _GOOD_LABEL_KEYS
    for k, v in labels.items():
        if type(k) is not str or type(v) is not str or not good_value(v):
            return False
        if k not in known_keys:
            if not _LABEL_KEY_RULE.match(k):
                return False
            _remember(known_keys, k)
    return True


def _good_node_name(name: str) -> bool:
    """``_DNS1123_SUBDOMAIN_RULE`` for an endpoint's ``nodeName``, through ``_GOOD_NODE_NAMES``."""
    if name in _GOOD_NODE_NAMES:
        return True
    if not _DNS1123_SUBDOMAIN_RULE.match(name):
        return False
    _remember(_GOOD_NODE_NAMES, name)
    return True


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
            fields.fail(path, f"{_quote(value)} is not an RFC 3339 time")
            return None
    if isinstance(value, datetime):
        if value.tzinfo is None:
            value = value.replace(tzinfo=UTC)
        return value.timestamp()
    fields.wrong_type(path, "RFC 3339 time string", value)
    return None


# -- a Service's addresses, as the API server validates them ---------------------
#
# pkg/apis/core/validation: ValidateService, validateServiceClusterIPsRelatedFields,
# ValidateNonSpecialIP and ValidateLoadBalancerStatus. Each malformed value is one
# problem. Both families are kept; IPv6 in canonical text (``_canonical``).


def _canonical(ip: str, family: int) -> str:
    """``ip`` as sockets and ``ipaddress`` print it: IPv6 compressed and lower case."""
    return ip if family == 4 else str(IPv6Address(ip))


def _headless(spec: dict[str, Any]) -> bool:
    """``clusterIP: None``, or no clusterIP and ``clusterIPs: [None, ...]``.

    The API server fills an empty clusterIP from ``clusterIPs[0]`` before it
    validates, so either field alone says it; kube-proxy never proxies these.
    """
    cluster_ip = spec.get("clusterIP")
    if cluster_ip == "None":
        return True
    if cluster_ip is None or cluster_ip == "":
        cluster_ips = spec.get("clusterIPs")
        return type(cluster_ips) is list and bool(cluster_ips) and cluster_ips[0] == "None"
    return False


def _cluster_ip(
    fields: _Fields, spec: dict[str, Any]
) -> tuple[str | None, tuple[str, ...], tuple[int, ...]]:
    """The service's IPv4 cluster IP (or None), all of them, and their families.

    The rules (ValidateService, validateServiceClusterIPsRelatedFields):
    ``clusterIP`` is an IP address, ``"None"`` (headless, which never gets
    here) or empty/absent (none). ``clusterIPs``, when given, holds at most two
    IP addresses, one per family, the first equal to ``clusterIP`` when that is
    set (an empty clusterIP takes ``clusterIPs[0]``, as the API server's
    normalization does); ``"None"`` only ever stands alone, as a headless one.

    Each family's proxier serves the one of its family wherever it sits
    (``GetClusterIPByFamily``); the families say which proxiers serve the
    service at all (``_ip_families``).
    """
    cluster_ip = fields.optional_string(spec, "clusterIP", "spec.") or ""
    family = _ip_family(cluster_ip) if cluster_ip else 0
    if cluster_ip and not family:
        fields.fail("spec.clusterIP", f"{_quote(cluster_ip)} is not a valid IP address")
    cluster_ips = fields.string_list(spec, "clusterIPs", "spec.")
    if not cluster_ips:
        if not family:
            return None, (), ()
        return (cluster_ip if family == 4 else None), (_canonical(cluster_ip, family),), (family,)
    if len(cluster_ips) > 2:
        fields.fail(
            "spec.clusterIPs",
            f"{len(cluster_ips)} values, but at most 2 are allowed (one per IP family)",
        )
        return None, (), ()
    ipv4 = None
    families: list[int] = []
    kept: list[str] = []
    for i, ip in enumerate(cluster_ips):
        if type(ip) is not str:
            continue  # Reported by ``string_list``.
        path = f"spec.clusterIPs[{i}]"
        if i == 0 and cluster_ip:
            if ip != cluster_ip:
                mismatch = f"{_quote(ip)} does not match spec.clusterIP {_quote(cluster_ip)}"
                fields.fail(path, mismatch)
                continue
            ip_family = family  # Judged (and any problem reported) as spec.clusterIP.
            if not ip_family:
                continue
        elif ip == "None":
            fields.fail(path, '"None" must be the first and only value')
            continue
        else:
            ip_family = _ip_family(ip)
            if not ip_family:
                fields.fail(path, f"{_quote(ip)} is not a valid IP address")
                continue
            if ip_family in families:
                fields.fail(
                    path, f"{_quote(ip)} is a second IPv{ip_family} address: one per IP family"
                )
                continue
        families.append(ip_family)
        kept.append(_canonical(ip, ip_family))
        if ip_family == 4 and ipv4 is None:
            ipv4 = ip
    return ipv4, tuple(kept), tuple(families)


def _ip_families(
    fields: _Fields, spec: dict[str, Any], cluster_families: tuple[int, ...]
) -> tuple[tuple[IPFamily, ...], IPFamilyPolicy]:
    """``spec.ipFamilies`` and ``spec.ipFamilyPolicy``, checked against the clusterIPs.

    The rules (ValidateService's ``validateIPFamilies``): each family is IPv4
    or IPv6, at most two and not the same one twice; ``ipFamilies[i]`` is the
    family of ``clusterIPs[i]``; ``SingleStack`` has one family. The API
    server fills both fields, so a stored Service always has them; a state
    written by hand may leave them out, and then the clusterIPs decide, or
    IPv4, the default of a single-stack cluster.

    What the service is served on: the families of its clusterIPs when it
    has any (a family's proxier skips a service without a ClusterIP of its
    family), else ``ipFamilies``.
    """
    policy = fields.string(
        spec, "ipFamilyPolicy", "spec.", "SingleStack", choices=_IP_FAMILY_POLICIES
    )
    named: list[IPFamily] = []
    for i, raw in enumerate(fields.string_list(spec, "ipFamilies", "spec.")):
        if type(raw) is not str:
            continue  # Reported by ``string_list``.
        path = f"spec.ipFamilies[{i}]"
        if raw not in _IP_FAMILIES:
            fields.fail(path, f"{_quote(raw)} is not one of {', '.join(_IP_FAMILIES)}")
        elif raw in named:
            fields.fail(path, f"{_quote(raw)} is listed twice: one entry per IP family")
        elif len(named) == 2:
            fields.fail(path, "at most 2 are allowed (one per IP family)")
        else:
            if i < len(cluster_families) and _FAMILY_OF[raw] != cluster_families[i]:
                fields.fail(path, f"{_quote(raw)} does not match the family of"
                                  f" spec.clusterIPs[{i}] (IPv{cluster_families[i]})")
            named.append(cast(IPFamily, raw))
    if spec.get("ipFamilyPolicy") == "SingleStack" and len(named) > 1:
        fields.fail("spec.ipFamilyPolicy", '"SingleStack" allows one of spec.ipFamilies,'
                                           f" not {len(named)}")
    if cluster_families:
        families = tuple(cast(IPFamily, f"IPv{f}") for f in cluster_families)
    else:
        families = tuple(named) or ("IPv4",)
    return families, cast(IPFamilyPolicy, policy)


def _external_ips(fields: _Fields, spec: dict[str, Any]) -> tuple[str, ...]:
    """``spec.externalIPs``, of both families; each must be a valid IP and not a special one.

    The rules (ValidateService): every entry ``IsValidIP`` and passes
    ``ValidateNonSpecialIP`` (``_special_ip``).
    """
    out: list[str] = []
    for i, ip in enumerate(fields.string_list(spec, "externalIPs", "spec.")):
        if type(ip) is not str:
            continue  # Reported by ``string_list``.
        family = _ip_family(ip)
        special = _special_ip(ip, family) if family else "is not a valid IP address"
        if special:
            fields.fail(f"spec.externalIPs[{i}]", f"{_quote(ip)} {special}")
        else:
            out.append(_canonical(ip, family))
    return tuple(out)


def _ingress(fields: _Fields, doc: dict[str, Any]) -> tuple[LoadBalancerIngress, ...]:
    """``status.loadBalancer.ingress``: the entries with an ``ip``, and their ipMode.

    The rules (ValidateLoadBalancerStatus): an entry has an ``ip``, a
    ``hostname``, both or neither; ``ip`` is an IP address; ``hostname`` a
    DNS-1123 subdomain that is not an IP address; ``ipMode`` is VIP or Proxy
    (absent: VIP, the API server's default) and is forbidden without ``ip``.
    A hostname-only entry is valid and ignored: kpx can only intercept an IP.

    Judged whatever the type, as the API server does, but only a LoadBalancer
    keeps them (``service``): the API server clears the status of a service
    that stops being one, so on any other type they could only be stale.
    """
    status = fields.mapping(doc, "status", "")
    balancer = fields.mapping(status, "loadBalancer", "status.")
    out: list[LoadBalancerIngress] = []
    for i, raw in enumerate(fields.items(balancer, "ingress", "status.loadBalancer.")):
        path = f"status.loadBalancer.ingress[{i}]"
        if type(raw) is not dict:
            fields.wrong_type(path, "mapping", raw)
            continue
        prefix = path + "."
        ip = fields.string(raw, "ip", prefix)
        family = _ip_family(ip) if ip else 0
        if ip and not family:
            fields.fail(prefix + "ip", f"{_quote(ip)} is not a valid IP address")
        hostname = fields.string(raw, "hostname", prefix)
        if hostname:
            if not _DNS1123_SUBDOMAIN_RULE.match(hostname):
                problem = _DNS1123_SUBDOMAIN_RULE.problem(hostname, "hostname")
                fields.fail(prefix + "hostname", problem)
            elif _ip_family(hostname):
                fields.fail(
                    prefix + "hostname",
                    f"{_quote(hostname)} is not a valid hostname: a DNS name, not an IP address",
                )
        mode = "VIP"
        if raw.get("ipMode") is not None:
            mode = fields.string(raw, "ipMode", prefix, "", choices=_IP_MODES)
            raw_ip = raw.get("ip")
            if mode and (raw_ip is None or (type(raw_ip) is str and not raw_ip)):
                fields.fail(prefix + "ipMode", f"{_quote(mode)} may not be set without an ip")
        if family and mode:
            out.append(LoadBalancerIngress(_canonical(ip, family), cast(IPMode, mode)))
    return tuple(out)


_CIDR = re.compile(r"[0-9A-Fa-f.:]+/[0-9]{1,3}")
"""An address and a decimal prefix length, as Go's ``ParseCIDR`` reads them: no bare
address, netmask or zone, which ``ipaddress.ip_network`` would also take."""


def _cidr(text: str) -> Network | None:
    """The network ``text`` names as Go's ``ParseCIDR`` reads it, or None."""
    if not _CIDR.fullmatch(text):
        return None
    try:
        return ip_network(text, strict=False)
    except ValueError:
        return None


def _source_ranges(fields: _Fields, spec: dict[str, Any], svc_type: str) -> tuple[Network, ...]:
    """``spec.loadBalancerSourceRanges``: canonical networks of both families, in order.

    The rules (ValidateService): each entry, space-trimmed ("a historical
    accident around transition from the annotation value"), is a CIDR; host
    bits may be set (``10.0.0.1/8`` is ``10.0.0.0/8``, as Go's ``ParseCIDR``
    makes it); and the field is forbidden unless the type is LoadBalancer.
    The ``service.beta.kubernetes.io/load-balancer-source-ranges``
    annotation is the cloud provider's, never kube-proxy's: not read.
    """
    raw = fields.string_list(spec, "loadBalancerSourceRanges", "spec.")
    if raw and svc_type != "LoadBalancer":
        fields.fail("spec.loadBalancerSourceRanges",
                    f"may only be used when spec.type is LoadBalancer, not {_quote(svc_type)}")
    out: list[Network] = []
    for i, value in enumerate(raw):
        if type(value) is not str:
            continue  # Reported by ``string_list``.
        text = value.strip()
        network = _cidr(text)
        if network is None:
            fields.fail(f"spec.loadBalancerSourceRanges[{i}]",
                        f"{_quote(value)} is not a valid CIDR (an address and a prefix"
                        f" length, such as 203.0.113.0/24 or 2001:db8::/64)")
        else:
            out.append(network)
    return tuple(dict.fromkeys(out))


# -- the common case, quickly ---------------------------------------------------
#
# ``_quick_*`` accept only objects that the full judges below would accept
# without a single problem, and build equal model objects and the same
# claims for them, with plain lookups and no ``_Fields`` calls. Anything
# else (any problem, a null where a default applies, an ignored service,
# session affinity, source ranges, a non-IPv4 slice; an IPv6 or special address, clusterIPs
# other than ``[clusterIP]``, an ingress hostname) makes them return None, and
# the full judge decides, so every message still comes from one place.


def _quick_name(
    doc: dict[str, Any], good_name: Callable[[str], object]
) -> tuple[str, str, dict[str, Any]] | None:
    """Namespace, name and labels of a well-formed namespaced object, else None.

    ``good_name`` is the ``fullmatch`` of the kind's name format (``_NAME_RULES``).
    """
    meta = doc.get("metadata")
    if type(meta) is not dict:
        return None
    name = meta.get("name")
    namespace = meta.get("namespace")
    labels = meta.get("labels")
    if type(name) is not str or not name:
        return None
    if type(namespace) is not str:
        if namespace is not None:
            return None
        namespace = "default"
    elif not namespace:
        namespace = "default"
    elif namespace not in _GOOD_NAMESPACES:
        if not _DNS1123_LABEL_RULE.match(namespace):
            return None
        _remember(_GOOD_NAMESPACES, namespace)
    if not good_name(name):
        return None
    if labels is None:
        labels = {}
    elif type(labels) is not dict or not _good_labels(labels):
        return None
    return namespace, name, labels


def _plain_external_ip(ip: object) -> bool:
    """An IPv4 address outside ``_SPECIAL_IPV4``, which ``_external_ips`` keeps as it is."""
    return type(ip) is str and _IPV4.fullmatch(ip) is not None and not ip.startswith(_SPECIAL_IPV4)


_NO_INGRESS: tuple[LoadBalancerIngress, ...] = ()
_NO_BALANCER = {"loadBalancer": {}}
"""The status kubectl prints for most services: equal to it, ``_quick_ingress`` is ()."""


def _quick_ingress(status: object) -> tuple[LoadBalancerIngress, ...] | None:
    """``_ingress`` for a status whose ingress entries are all a plain IPv4 ``ip`` and a
    valid (or no) ``ipMode``, with no hostname; None for anything else."""
    if status is None:
        return _NO_INGRESS
    if type(status) is not dict:
        return None
    balancer = status.get("loadBalancer")
    if balancer is None:
        return _NO_INGRESS
    if type(balancer) is not dict:
        return None
    raw_ingress = balancer.get("ingress")
    if raw_ingress is None:
        return _NO_INGRESS
    if type(raw_ingress) is not list:
        return None
    out: list[LoadBalancerIngress] = []
    for raw in raw_ingress:
        if type(raw) is not dict or "hostname" in raw:
            return None
        ip = raw.get("ip")
        mode = raw.get("ipMode", "VIP")
        if not (
            type(ip) is str and _IPV4.fullmatch(ip) and type(mode) is str and mode in _IP_MODES
        ):
            return None
        out.append(LoadBalancerIngress(ip, mode))
    return tuple(out)


def _quick_service(doc: dict[str, Any]) -> tuple[Service, list[_Claim]] | None:
    """``service`` for a plain Service (see above): it and its claims, or None."""
    named = _quick_name(doc, _DNS1035_LABEL_RULE.match)
    spec = doc.get("spec")
    if named is None or type(spec) is not dict:
        return None
    namespace, name, labels = named
    get = spec.get
    svc_type = get("type", "ClusterIP")
    etp = get("externalTrafficPolicy", "Cluster")
    itp = get("internalTrafficPolicy", "Cluster")
    hc_port = get("healthCheckNodePort", 0)
    affinity = get("sessionAffinity", "None")
    selector = get("selector", _NO_STRINGS)
    external_ips = get("externalIPs", _NO_ITEMS)
    cluster_ip = get("clusterIP")
    cluster_ips = get("clusterIPs", _NO_ITEMS)
    families = get("ipFamilies", _IPV4_ONLY)
    family_policy = get("ipFamilyPolicy", "SingleStack")
    publish = get("publishNotReadyAddresses", False)
    raw_ports = get("ports")
    source_ranges = get("loadBalancerSourceRanges")
    if not (
        # Source ranges are rare: the full judge reads them (``_source_ranges``).
        (source_ranges is None or source_ranges == _NO_ITEMS)
        and type(svc_type) is str
        and svc_type in _SERVICE_TYPES
        and svc_type != "ExternalName"
        and type(etp) is str
        and etp in _POLICIES
        and type(itp) is str
        and itp in _POLICIES
        and type(hc_port) is int
        and 0 <= hc_port < 65536
        and type(affinity) is str
        and affinity == "None"
        and type(selector) is dict
        and _all_strings(selector)
        and type(external_ips) is list
        and (not external_ips or all(map(_plain_external_ip, external_ips)))
        # An IPv4 clusterIP (or none), and clusterIPs that only repeat it.
        and (
            cluster_ip is None
            or (type(cluster_ip) is str and (not cluster_ip or _ipv4(cluster_ip) is not None))
        )
        and type(cluster_ips) is list
        and (
            not cluster_ips
            or (
                len(cluster_ips) == 1
                and type(cluster_ips[0]) is str
                and cluster_ips[0] == cluster_ip
                and cluster_ip
            )
        )
        # IPv4 only (what ``_ip_families`` makes of no fields at all, too).
        and families == _IPV4_ONLY
        and type(family_policy) is str
        and family_policy in _IP_FAMILY_POLICIES
        and type(publish) is bool
        and type(raw_ports) is list
        and raw_ports
        and SERVICE_PROXY_NAME_LABEL not in labels
        and HEADLESS_LABEL not in labels
    ):
        return None
    key = f"{namespace}/{name}"
    label = f"Service {key}"
    claims: list[_Claim] = []
    ports: list[ServicePort] = []
    port_names: set[str] = set()
    for i, raw in enumerate(raw_ports):
        if type(raw) is not dict:
            return None
        pget = raw.get
        port_name = pget("name", "")
        protocol = pget("protocol", "TCP")
        port = pget("port")
        target = pget("targetPort", port)
        node_port = pget("nodePort", 0)
        if not (
            type(port_name) is str
            and port_name not in port_names
            and type(protocol) is str
            and protocol in _PROTOCOLS
            and type(port) is int
            and 0 < port < 65536
            and ((type(target) is str and target) or (type(target) is int and 0 < target < 65536))
            and type(node_port) is int
            and 0 <= node_port < 65536
        ):
            return None
        port_names.add(port_name)
        if node_port:
            claims.append(_Claim(node_port, protocol, label, f"spec.ports[{i}].nodePort"))
        ports.append(ServicePort(port_name, protocol, port, target, node_port))
    status = doc.get("status")
    ingress = _NO_INGRESS
    if status is not None and status != _NO_BALANCER:
        ingress = _quick_ingress(status)
        if ingress is None:
            return None
        if svc_type != "LoadBalancer":
            ingress = _NO_INGRESS  # Judged all the same, as ``service`` does.
    # Positional arguments, in field order: a third cheaper than keywords for 18 fields.
    service = Service(
        namespace,
        name,
        svc_type,
        tuple(ports),
        cluster_ip or None,
        etp,
        itp,
        hc_port,
        "None",  # session_affinity
        DEFAULT_AFFINITY_SECONDS,
        tuple(selector.items()),
        tuple(labels.items()),
        tuple(external_ips),
        publish,
        ingress,
        (cluster_ip,) if cluster_ip else (),
        _IPV4_FAMILY,
        family_policy,
    )
    if service.needs_health_check:
        claims.append(_Claim(hc_port, "TCP", label, "spec.healthCheckNodePort"))
    return service, claims


def _quick_slice(doc: dict[str, Any], interned: _Interned) -> EndpointSlice | None:
    """``endpoint_slice`` for a plain IPv4 slice (see above), or None.

    Its endpoints and ports come from ``interned`` when an equal one was
    built before: the same pods back many slices' worth of lines, and a
    frozen model object is safe to share. A key is only looked up once its
    fields' types are checked, so ``1`` never finds what ``True`` built.
    """
    named = _quick_name(doc, _DNS1123_SUBDOMAIN_RULE.match)
    if named is None:
        return None
    namespace, name, labels = named
    address_type = doc.get("addressType", "IPv4")
    service_name = labels.get(SERVICE_NAME_LABEL)
    meta: dict[str, Any] = doc["metadata"]
    annotations = meta.get("annotations", _NO_STRINGS)
    raw_endpoints = doc.get("endpoints", _NO_ITEMS)
    raw_ports = doc.get("ports", _NO_ITEMS)
    if not (
        type(address_type) is str
        and address_type == "IPv4"
        and service_name
        and type(annotations) is dict
        and type(raw_endpoints) is list
        and type(raw_ports) is list
    ):
        return None
    trigger_time = None
    trigger = annotations.get(TRIGGER_TIME_ANNOTATION)
    if trigger is not None:
        if type(trigger) is not str:
            return None
        try:
            when = datetime.fromisoformat(trigger)
        except ValueError:
            return None
        if when.tzinfo is None:
            when = when.replace(tzinfo=UTC)
        trigger_time = when.timestamp()

    endpoints: list[Endpoint] = []
    for raw in raw_endpoints:
        if type(raw) is not dict:
            return None
        eget = raw.get
        addresses = eget("addresses")
        conditions = eget("conditions", _NO_STRINGS)
        node_name = eget("nodeName")
        target_ref = eget("targetRef")
        if type(addresses) is not list or not addresses or type(conditions) is not dict:
            return None
        address = addresses[0]
        cget = conditions.get
        ready = cget("ready", True)
        serving = cget("serving", True)
        terminating = cget("terminating", False)
        if not (
            type(address) is str
            and type(ready) is type(serving) is type(terminating) is bool
            and (node_name is None or type(node_name) is str)
        ):
            return None
        pod_name = None
        if target_ref is not None:
            if type(target_ref) is not dict:
                return None
            if target_ref.get("kind") == "Pod":
                pod_name = target_ref.get("name")
                if pod_name is not None and type(pod_name) is not str:
                    return None
        key = (address, node_name, ready, serving, terminating, pod_name)
        endpoint = interned.get(key)
        if endpoint is None:
            if not _IPV4.fullmatch(address) or (node_name and not _good_node_name(node_name)):
                return None
            endpoint = interned[key] = Endpoint(
                address, node_name or None, ready, serving, terminating, pod_name
            )
        endpoints.append(endpoint)

    ports: list[EndpointPort] = []
    for raw in raw_ports:
        if type(raw) is not dict:
            return None
        pget = raw.get
        port_name = pget("name", "")
        protocol = pget("protocol", "TCP")
        port = pget("port", 0)
        if not (
            type(port_name) is str
            and type(protocol) is str
            and protocol in _PROTOCOLS
            and type(port) is int
            and 0 <= port < 65536
        ):
            return None
        if port:
            # A port without a number is skipped, as EndpointSliceCache does.
            key = (port_name, port, protocol)
            endpoint_port = interned.get(key)
            if endpoint_port is None:
                endpoint_port = interned[key] = EndpointPort(port_name, port, protocol)
            ports.append(endpoint_port)

    # Positional arguments, in field order (see ``_quick_service``).
    return EndpointSlice(
        namespace, name, service_name, tuple(endpoints), tuple(ports), "IPv4", trigger_time
    )


class _Judge:
    """Judges one decoded document alone; ``verdict`` hands back what it found."""

    __slots__ = (
        "claims",
        "clean",
        "entries",
        "idents",
        "interned",
        "nodes",
        "services",
        "slices",
    )

    def __init__(self, interned: _Interned) -> None:
        self.interned = interned
        self.entries: list[_Located | _Object] = []
        self.clean = True
        self.idents: list[str] = []
        self.claims: list[int] = []
        self.nodes: list[Node] = []
        self.services: list[Service] = []
        self.slices: list[EndpointSlice] = []

    def verdict(self) -> _Verdict:
        return _Verdict(
            entries=tuple(self.entries),
            clean=self.clean,
            idents=tuple(self.idents),
            claims=tuple(self.claims),
            nodes=tuple(self.nodes),
            services=tuple(self.services),
            slices=tuple(self.slices),
        )

    def locate(self, rel: str, tail: str) -> None:
        """A problem with the document itself (or a List item), named by position."""
        self.entries.append(_Located("", rel, tail))
        self.clean = False

    def done(
        self,
        kind: str,
        key: str,
        rel: str,
        early: tuple[str, ...],
        problems: Sequence[_Problem],
        value: Node | Service | EndpointSlice | None,
    ) -> None:
        """Record a named object; ``problems`` holds only strings and claims by now."""
        body = cast("tuple[str | _Claim, ...]", tuple(problems))
        ident = f"{kind}/{key}"
        self.entries.append(_Object(kind, key, ident, rel, early, body, value))
        self.idents.append(ident)
        for item in body:
            if type(item) is _Claim:
                self.claims.append(item.code)
            else:
                self.clean = False
        if early:
            self.clean = False

    # -- the document -------------------------------------------------------

    def item(self, doc: object, rel: str, default_kind: str | None) -> None:
        if type(doc) is not dict:
            self.locate(
                rel, f": expected a mapping (a Kubernetes object or List), got {_describe(doc)}"
            )
            return
        kind = doc.get("kind", default_kind)
        if type(kind) is not str or not kind:
            detail = "required" if kind is None else f"expected a string, got {_describe(kind)}"
            self.locate(rel, f": kind: {detail}")
            return
        if kind in _LIST_KINDS:
            items = doc.get("items")
            if items is None:
                return
            if type(items) is not list:
                self.locate(rel, f" ({kind}): items: expected a list, got {_describe(items)}")
                return
            item_kind = _LIST_KINDS[kind]
            for i, item in enumerate(items):
                self.item(item, f"{rel} items[{i}]", item_kind)
            return
        api_version = _API_VERSIONS.get(kind)
        if api_version is None or doc.get("apiVersion", api_version) != api_version:
            return  # Not an object kpx reads (Pod, ConfigMap, a CRD that reuses a name...).
        if kind == "Service":
            quick = _quick_service(doc)
            if quick is None:
                self.service(_Fields(kind, rel, []), doc)
            else:
                self.services.append(quick[0])
                self.done(kind, quick[0].key, rel, (), quick[1], quick[0])
        elif kind == "EndpointSlice":
            value = _quick_slice(doc, self.interned)
            if value is None:
                self.endpoint_slice(_Fields(kind, rel, []), doc)
            else:
                self.slices.append(value)
                self.done(kind, f"{value.namespace}/{value.name}", rel, (), [], value)
        else:
            self.node(_Fields(kind, rel, []), doc)

    def metadata(
        self, fields: _Fields, doc: dict[str, Any], kind: str, namespaced: bool
    ) -> tuple[str, dict[str, Any], tuple[str, ...]] | None:
        """Name the object (``ns/name`` or ``name``).

        Returns None for a nameless object, whose (positional) problems are
        then already recorded; otherwise the key, the metadata mapping and
        the problems found so far, which ``_link`` reports before it judges
        whether the name is a duplicate.
        """
        meta = fields.mapping(doc, "metadata", "", required=True)
        name = fields.string(meta, "name", "metadata.", required=True) if fields.ok else ""
        if not name:
            # "metadata: required" is enough; "metadata.name: required" would say it twice.
            self.entries.extend(cast("list[_Located]", fields.problems))
            self.clean = False
            return None
        key = name
        namespace = meta.get("namespace") if namespaced else None
        if namespaced:
            key = f"{namespace if namespace and type(namespace) is str else 'default'}/{name}"
        fields.name(f"{kind} {_shown(key)}")
        if namespaced:
            fields.string(meta, "namespace", "metadata.")  # Only to report a wrong type.
            if namespace and type(namespace) is str and not _DNS1123_LABEL_RULE.match(namespace):
                problem = _DNS1123_LABEL_RULE.problem(namespace, "namespace")
                fields.fail("metadata.namespace", problem)
        rule = _NAME_RULES[kind]
        if not rule.match(name):
            fields.fail("metadata.name", rule.problem(name, f"{kind} name"))
        early = cast("tuple[str, ...]", tuple(fields.problems))
        fields.problems.clear()
        return key, meta, early

    def node(self, fields: _Fields, doc: dict[str, Any]) -> None:
        named = self.metadata(fields, doc, "Node", namespaced=False)
        if named is None:
            return
        name, meta, early = named
        labels = fields.labels(meta, "labels", "metadata.")
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
        value = None
        if fields.ok:
            value = Node(
                name=name,
                internal_ips=tuple(internal),
                external_ips=tuple(external),
                labels=_pairs(labels),
                taint_keys=tuple(taint_keys),
                deletion_timestamp=deletion,
            )
            self.nodes.append(value)
        self.done("Node", name, fields.rel, early, fields.problems, value)

    def service(self, fields: _Fields, doc: dict[str, Any]) -> None:
        named = self.metadata(fields, doc, "Service", namespaced=True)
        if named is None:
            return
        key, meta, early = named
        labels = fields.labels(meta, "labels", "metadata.")
        spec = fields.mapping(doc, "spec", "", required=True)
        if (
            SERVICE_PROXY_NAME_LABEL in labels
            or HEADLESS_LABEL in labels
            or spec.get("type") == "ExternalName"
            or _headless(spec)
        ):
            # kube-proxy's informer never even sees these; neither does kpx.
            self.done("Service", key, fields.rel, early, fields.problems, None)
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
        external_ips = _external_ips(fields, spec)
        cluster_ip, cluster_ips, cluster_families = _cluster_ip(fields, spec)
        ip_families, ip_family_policy = _ip_families(fields, spec, cluster_families)
        publish = fields.boolean(spec, "publishNotReadyAddresses", "spec.", False)
        source_ranges = _source_ranges(fields, spec, svc_type)

        ingress = _ingress(fields, doc)
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
                    f"duplicate port name {_quote(name)} (also spec.ports[{port_names[name]}])",
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
                # The API server allocates node ports cluster-wide, so a clash
                # means the state was not written by one; kpx could serve only
                # one of the two. ``_link`` judges it.
                fields.claim(node_port, protocol, prefix + "nodePort")
            ports.append(ServicePort(name, protocol, port, target, node_port))

        namespace, _, name = key.partition("/")
        service = Service(
            namespace=namespace,
            name=name,
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
            ingress=ingress if svc_type == "LoadBalancer" else (),
            cluster_ips=cluster_ips,
            ip_families=ip_families,
            ip_family_policy=ip_family_policy,
            load_balancer_source_ranges=source_ranges,
        )
        if service.needs_health_check:
            # The healthz sidecar listens on it over TCP, beside the NodePorts.
            fields.claim(hc_port, "TCP", "spec.healthCheckNodePort")
        value = None
        if fields.ok:
            value = service
            self.services.append(service)
        self.done("Service", key, fields.rel, early, fields.problems, value)

    def endpoint_slice(self, fields: _Fields, doc: dict[str, Any]) -> None:
        named = self.metadata(fields, doc, "EndpointSlice", namespaced=True)
        if named is None:
            return
        key, meta, early = named
        address_type = fields.string(
            doc, "addressType", "", "IPv4", required=False, choices=_ADDRESS_TYPES
        )
        if address_type == "FQDN":
            # Deprecated, and never proxied by kube-proxy: no address to forward to.
            self.done("EndpointSlice", key, fields.rel, early, fields.problems, None)
            return
        # The service-name label links the slice to its Service; as a label
        # value it is checked by ``labels``, like every other label.
        labels = fields.labels(meta, "labels", "metadata.")
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
        family = _FAMILY_OF[address_type]
        for i, raw in enumerate(fields.items(doc, "endpoints", "")):
            endpoint = self.endpoint(fields, raw, f"endpoints[{i}]", family)
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

        value = None
        if fields.ok:
            namespace, _, name = key.partition("/")
            value = EndpointSlice(
                namespace=namespace,
                name=name,
                service_name=cast(str, service_name),
                endpoints=tuple(endpoints),
                ports=tuple(ports),
                address_type=address_type,
                trigger_time=trigger_time,
            )
            self.slices.append(value)
        self.done("EndpointSlice", key, fields.rel, early, fields.problems, value)

    def endpoint(
        self, fields: _Fields, raw: object, path: str, family: int = 4
    ) -> Endpoint | None:
        """One endpoint: its first address (of the slice's ``family``), conditions, locality."""
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
            elif family == 4 and not _IPV4.fullmatch(address):
                fields.fail(prefix + "addresses[0]", f"{_quote(address)} is not an IPv4 address")
            elif family == 6:
                if _ip_family(address) != 6:
                    fields.fail(prefix + "addresses[0]",
                                f"{_quote(address)} is not an IPv6 address")
                else:
                    address = _canonical(address, 6)

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
        if node_name and not _DNS1123_SUBDOMAIN_RULE.match(node_name):
            problem = _DNS1123_SUBDOMAIN_RULE.problem(node_name, "node name")
            fields.fail(prefix + "nodeName", problem)
        pod_name = None
        target_ref = raw.get("targetRef")
        if target_ref is not None:
            if type(target_ref) is dict:
                if target_ref.get("kind") == "Pod":
                    pod_name = fields.optional_string(target_ref, "name", prefix + "targetRef.")
            else:
                fields.wrong_type(prefix + "targetRef", "mapping", target_ref)
        return Endpoint(address, node_name or None, ready, serving, terminating, pod_name)


_new: Any = tuple.__new__
"""A NamedTuple from a tuple of all its fields in order, skipping the Python-level
``__new__`` that named arguments need: twice as fast, for two per document."""


_EMPTY_DOCUMENT = _Verdict((), True, (), (), (), (), ())
"""The verdict on every empty document (None): one object, so that "did any document
hold anything" is an identity test (``link._refuse_if_empty``)."""


def _judge(doc: object, interned: _Interned | None = None) -> _Verdict:
    """The verdict on one decoded document (None, an empty document, has no objects).

    ``interned`` (see ``_quick_slice``) may be shared by the documents of one parse.

    A plain Service or slice on its own, most documents of a state, gets its
    verdict built here directly, exactly as ``_Judge`` would build it.
    """
    if type(doc) is dict:
        kind = doc.get("kind")
        api_version = _API_VERSIONS.get(kind) if type(kind) is str else None
        if api_version is not None and doc.get("apiVersion", api_version) == api_version:
            if kind == "Service":
                quick = _quick_service(doc)
                if quick is not None:
                    service, claims = quick
                    ident = f"Service/{service.key}"
                    entry = _new(
                        _Object, (kind, service.key, ident, "", (), tuple(claims), service)
                    )
                    codes = tuple([claim.code for claim in claims])
                    return _new(_Verdict, ((entry,), True, (ident,), codes, (), (service,), ()))
            elif kind == "EndpointSlice":
                value = _quick_slice(doc, {} if interned is None else interned)
                if value is not None:
                    key = f"{value.namespace}/{value.name}"
                    ident = f"EndpointSlice/{key}"
                    entry = _new(_Object, (kind, key, ident, "", (), (), value))
                    return _new(_Verdict, ((entry,), True, (ident,), (), (), (), (value,)))
    if doc is None:
        return _EMPTY_DOCUMENT
    judge = _Judge({} if interned is None else interned)
    judge.item(doc, "", None)
    return judge.verdict()
