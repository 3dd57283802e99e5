"""Kubernetes YAML -> the immutable model: the only door into a ``Snapshot``.

Owns: reading what ``kubectl get nodes,svc,endpointslices -A -o yaml`` prints
(multi-document streams, ``kind: List``, typed ``NodeList``/``ServiceList``/
``EndpointSliceList``, in any mix and order, or the same as JSON) into
``proxy.core.model`` objects, and every check kpx makes before it trusts a state;
``StateParser`` does it again for each new version of a state, re-reading
only the documents that changed. Also ``decode_state``, the one door from
bytes to text (not UTF-8: refused).

Never: hold state outside a ``StateParser``, touch sockets, or return half a
result. A parse either yields a whole Snapshot or raises ``StateError``; that
is what lets the state source keep serving the last good snapshot when
someone saves a broken file. Nor let any input crash the process (see
"Hostile input"), or put a line break or other unprintable character from a
state into a problem.

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
- Names are held to the API server's formats (``_NAME_RULES``): Service names
  are DNS-1035 labels, namespaces DNS-1123 labels, Node and EndpointSlice
  names and endpoint ``nodeName``s DNS-1123 subdomains; label keys and values
  (``kubernetes.io/service-name`` included, which links a slice to its
  Service) follow the label rules. kube-proxy never sees anything else, and a
  valid name holds nothing a log, a shell or nft could misread.

Hostile input (no state may crash kpx, or empty it by accident):

- Every problem is one printable line: input is quoted by ``_quote``, with
  control and other unprintable characters escaped as ``repr`` does, an
  object whose name is not plain is named quoted (``Service "default/a b"``),
  and ``StateError`` escapes whatever else slips through.
- Nesting is bounded before PyYAML composes anything (``_pyyaml``, the only
  door to its loader): its C extension recurses once per level with no limit,
  and against a libyaml without one (Debian's 0.2.5) ~100 KB of ``[`` or
  ``- - -`` overflow the C stack. More than ``_MAX_DEPTH`` levels of
  collections are refused. A cheap bound (``_could_nest_deeply``: bracket
  counts and line prefixes, in C) clears nearly every text; the rest are
  measured exactly by counting libyaml's events, which never recurse
  (``_too_deep``). The block subset reader declines what could reach the
  limit, so the same texts are refused in the same words on every road;
  ``json``'s own recursion limit turns deeper JSON into a decline too.
- A stream whose documents are all empty (an empty file, only comments or
  ``---``, a failed ``kubectl ... > state.yaml``) is refused (``NO_DOCUMENTS``):
  taking it would close every NodePort at once. An empty ``kind: List`` is the
  deliberate "no services".
- Speed matters (10k services must cost a fraction of a second on top of
  decoding): fields are plain dict lookups checked with ``type(v) is``, which
  is also what stops a YAML ``true`` passing as the integer 1, and a field
  path string is only built once a problem is found. A plain Service or
  IPv4 slice, nearly every object of a state, is judged by a shortcut
  (``_quick_service``, ``_quick_slice``) that only accepts what the full
  judge would accept without a problem, and builds the same objects; on
  anything else it steps aside, so every problem is still worded in one place.

Two passes, so that the first one can be cached:

1. *Judging* (``_judge``) reads one decoded document alone and yields a
   ``_Verdict``: its model objects and every problem that depends on that
   document only. Nothing in a verdict depends on where the document sits:
   a problem that names a position keeps it relative (``_Located``), and the
   nodePorts an object listens on are recorded as ``_Claim``s, not judged.
2. *Linking* (``_Linker``) runs the checks that span documents: duplicate
   names, nodePort clashes, slices whose service is missing. It keeps
   counts (how many verdicts have problems, which names and nodePorts
   repeat) and flat lists of the model objects, all updated in proportion
   to what changed, so a stream without problems becomes a Snapshot without
   looking at every object again. Only a stream with problems is replayed
   verdict by verdict (``_replay``), to report them in exactly the order,
   and with exactly the words, of a single pass.

Incremental parsing (``StateParser``), for a state that changes one document
at a time:

- The stream is cut into *chunks* at every line that is a document marker at
  column 0 (``---``, then only blanks or a comment). Such a line always starts
  a document: YAML forbids content lines that begin with ``---`` followed by a
  blank (spec 1.2 production [206] ``c-forbidden``); libyaml and PyYAML end
  every plain or block scalar there and reject a quoted one that spans it.
- A chunk's verdicts are kept with its exact text; only new or changed
  chunks are decoded, and unchanged ones keep the very same model objects,
  which is what lets ``decision.build_plans`` reuse their plans by identity.
  Finding the unchanged chunks costs two ``memcmp`` walks over the previous
  chunk list (from the front and from the back), so a typical edit never
  hashes or even copies the untouched text.
- Anything unusual is decoded as one whole stream instead: directives
  (``%``), document-end markers (``...``), line breaks other than LF and
  CRLF, a byte-order mark after the first byte.
- A syntax error is reported by the first chunk that has one. That chunk is
  decoded again together with the next marker line, so that PyYAML sees what
  it would see in the whole stream, and its line numbers are shifted to
  count from the top of the file.

Decoding, fastest first:

- JSON (``kubectl -o json``, text starting with ``{``) goes to ``json.loads``,
  ~20x faster than PyYAML. JSON is YAML, and hooks make the two agree where
  YAML 1.1 reads differently (``1e3`` and ``NaN`` are strings to PyYAML);
  text where they could still differ (tabs, surrogate escapes, characters
  YAML treats as line breaks) goes to PyYAML instead.
- The block-style subset that kubectl, ``yaml.safe_dump`` and the kpx tools
  print (``key: value`` lines, ``- `` items, single-line plain or quoted
  scalars, ``{}`` and ``[]``) is read by ``_read_subset``, about 10x faster than
  PyYAML with libyaml: most lines of a state repeat verbatim from object to
  object, so each distinct line is read once per parse, and documents that
  differ only in names and numbers have the same shape, which is compiled
  once into a program that builds them without a branch per line. Plain
  scalars are resolved and built by PyYAML's own resolver rules (joined into
  one regex per first character) and constructors, so ``yes``, ``0o17`` or
  ``2024-05-01`` mean exactly what they mean to PyYAML.
  Anything else (flow collections, multi-line scalars, anchors, tags,
  escapes, comments after a value, non-ASCII text) is declined and the
  chunk goes to PyYAML.
- PyYAML (libyaml's ``CSafeLoader`` when present) decodes the rest, and is
  the only one that ever reports a syntax error.
"""

from __future__ import annotations

import json
import re
from array import array
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from itertools import (
    accumulate,
    chain,
    compress,
    islice,
    pairwise,
    repeat,
    starmap,
    takewhile,
)
from operator import add, attrgetter, itemgetter, methodcaller, not_
from pathlib import Path
from typing import Any, Literal, NamedTuple, cast

import yaml
from yaml.nodes import ScalarNode

from proxy.core.model import (
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
from proxy.util.gcpause import gc_paused

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


class StateError(ValueError):
    """A state that kpx refuses to apply; ``problems`` lists every reason.

    Every problem is one line: whatever a message quotes from the state is
    escaped where it is quoted (``_quote``), and anything unprintable that
    still reaches a problem (a YAML error's text, a caller's message) is
    escaped here, so no state can forge a line in a log that prints them.
    """

    def __init__(self, problems: Iterable[str]) -> None:
        self.problems: list[str] = [p if p.isprintable() else _escape(p) for p in problems]
        super().__init__("\n".join(self.problems))

    def __str__(self) -> str:
        return "\n".join(self.problems)


def _escape(text: str) -> str:
    """``text`` with each unprintable character escaped as ``repr`` escapes it.

    ``\\n``, ``\\x1b``, ``\\u2028``: line breaks of every kind, terminal
    escapes and invisible format characters (bidi overrides) are what let
    text from a state pose as another log line, or hide in one.
    """
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() else repr(ch)[1:-1] for ch in text)


_QUOTE_ESCAPES = {'"': '\\"', "\\": "\\\\"}


def _quote(text: str) -> str:
    """``text`` from a state, double-quoted for a problem, escaped so that it stays one line.

    Plain text (nearly all of it) is only wrapped in quotes; a quote or a
    backslash inside is escaped too, so the quoted form is unambiguous.
    """
    if text.isprintable() and '"' not in text and "\\" not in text:
        return f'"{text}"'
    return '"' + "".join(_QUOTE_ESCAPES.get(ch) or _escape(ch) for ch in text) + '"'


def _shown(key: str) -> str:
    """An object's ``ns/name`` as a problem names it: bare when it is a plain name, else
    quoted (``Service "default/web\\nCRITICAL"``), so the label itself cannot break a line."""
    if key.isprintable() and " " not in key and '"' not in key and "\\" not in key:
        return key
    return _quote(key)


def _describe(value: object) -> str:
    """``string "80"``, ``integer 7``, ``list``: what a wrong value was, briefly."""
    name = _TYPE_NAMES.get(type(value), type(value).__name__)
    if type(value) is str:
        shown = value if len(value) <= 40 else value[:37] + "..."
        return f"{name} {_quote(shown)}"
    if type(value) is bool:
        return f"{name} {str(value).lower()}"
    if type(value) in (int, float):
        return f"{name} {value!r}"
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


# -- the common case, quickly ---------------------------------------------------
#
# ``_quick_*`` accept only objects that the full judges below would accept
# without a single problem, and build equal model objects and the same
# claims for them, with plain lookups and no ``_Fields`` calls. Anything
# else (any problem, a null where a default applies, an ignored service,
# session affinity, a non-IPv4 slice) makes them return None, and the full
# judge decides, so every message still comes from one place.


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
    publish = get("publishNotReadyAddresses", False)
    raw_ports = get("ports")
    if not (
        type(svc_type) is str
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
        and (not external_ips or all(type(ip) is str for ip in external_ips))
        and (cluster_ip is None or (type(cluster_ip) is str and cluster_ip != "None"))
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
    # Positional arguments, in field order: a third cheaper than keywords for 14 fields.
    service = Service(
        namespace,
        name,
        svc_type,
        tuple(ports),
        cluster_ip,
        etp,
        itp,
        hc_port,
        "None",  # session_affinity
        DEFAULT_AFFINITY_SECONDS,
        tuple(selector.items()),
        tuple(labels.items()),
        tuple(external_ips),
        publish,
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
            or spec.get("clusterIP") == "None"
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
        if address_type != "IPv4":
            # kpx proxies IPv4 only, like a single-stack IPv4 kube-proxy.
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
                fields.fail(prefix + "addresses[0]", f"{_quote(address)} is not an IPv4 address")

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
hold anything" is an identity test (``_EmptyState``)."""


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


NO_DOCUMENTS = (
    "no documents: the state holds nothing but blank lines, comments or empty documents, "
    "which is what a failed `kubectl get ... > state.yaml` leaves behind; to run with no "
    "services on purpose, write an empty List (apiVersion: v1, kind: List, items: [])"
)
"""Why an empty state is refused. Taking it would close every NodePort and health
check port of the node at once, for what is nearly always a failed write."""


def _refuse_if_empty(snapshot: Snapshot, verdicts: Callable[[], Iterable[_Verdict]]) -> Snapshot:
    """``snapshot``, unless no document of its stream held anything (``NO_DOCUMENTS``).

    A snapshot with any object is passed at once; only an empty one looks at
    ``verdicts()``, for a document that was not empty: a List, even with no
    items, or an object of a kind kpx ignores, is a deliberate state.
    """
    if snapshot.nodes or snapshot.services or snapshot.slices:
        return snapshot
    if any(verdict is not _EMPTY_DOCUMENT for verdict in verdicts()):
        return snapshot
    raise StateError([NO_DOCUMENTS])


# -- linking: the checks that span documents ------------------------------------------

_IDENTS = attrgetter("idents")
_CLAIMS = attrgetter("claims")
_SERVICES = attrgetter("services")
_SLICES = attrgetter("slices")
_CLEAN = attrgetter("clean")
_KEY = attrgetter("key")
_SERVICE_KEY = attrgetter("service_key")

# What each tally counts, over a list of verdicts; all in C (map and chain).


def _idents(verdicts: list[_Verdict]) -> Iterator[str]:
    return chain.from_iterable(map(_IDENTS, verdicts))


def _claims(verdicts: list[_Verdict]) -> Iterator[int]:
    return chain.from_iterable(map(_CLAIMS, verdicts))


def _service_keys(verdicts: list[_Verdict]) -> Iterator[str]:
    return map(_KEY, chain.from_iterable(map(_SERVICES, verdicts)))


def _slice_keys(verdicts: list[_Verdict]) -> Iterator[str]:
    return map(_SERVICE_KEY, chain.from_iterable(map(_SLICES, verdicts)))


class _Tally:
    """How often each value occurs, and how many values occur more than once.

    Kept up to date as chunks come and go, so that "no duplicate anywhere"
    costs nothing per parse instead of a set over every name in the state.
    """

    __slots__ = ("counts", "repeated")

    def __init__(self) -> None:
        self.counts: dict[object, int] = {}
        self.repeated = 0

    def add(self, values: Iterable[object]) -> None:
        # ``_BATCH`` at a time: 100,000 names in one ``dict.fromkeys`` hold the
        # GIL ~20 ms (see ``_SCAN_PIECE``).
        values = iter(values)
        while batch := list(islice(values, _BATCH)):
            self._add(batch)

    def _add(self, values: list[object]) -> None:
        counts = self.counts
        fresh = dict.fromkeys(values, 1)
        if len(fresh) == len(values) and counts.keys().isdisjoint(fresh):
            # All new and none twice, as in any state without duplicates: in C.
            if counts:
                counts.update(fresh)
            else:
                self.counts = fresh
            return
        for value in values:
            count = counts.get(value, 0) + 1
            counts[value] = count
            if count == 2:
                self.repeated += 1

    def remove(self, values: Iterable[object]) -> None:
        counts = self.counts
        for value in values:
            count = counts[value] - 1
            if count:
                counts[value] = count
                if count == 1:
                    self.repeated -= 1
            else:
                del counts[value]


class _Column:
    """One kind of model object from every chunk, flat and in stream order.

    ``starts[i]`` counts the objects before chunk ``i`` (plus a final entry,
    the total), so a run of chunks is replaced in place: a list slice
    assignment moves pointers and never touches the untouched objects.
    """

    __slots__ = ("items", "starts", "take")

    def __init__(self, take: Callable[[_Verdict], tuple[Any, ...]]) -> None:
        self.items: list[Any] = []
        self.starts = array("q", [0])
        self.take = take

    def replace(self, first: int, stop: int, chunks: list[tuple[_Verdict, ...]]) -> None:
        """Chunks ``first:stop`` become ``chunks``."""
        groups: list[tuple[Any, ...]] = []
        new: list[Any] = []
        for i in range(0, len(chunks), _BATCH):  # ``_BATCH`` chunks per C call
            batch = chunks[i : i + _BATCH]
            verdicts = list(chain.from_iterable(batch))
            if len(verdicts) == len(batch):
                # A chunk holds one document or none; here each holds one.
                part: list[tuple[Any, ...]] = list(map(self.take, verdicts))
            else:
                part = [tuple(chain.from_iterable(map(self.take, vs))) for vs in batch]
            groups += part
            new += chain.from_iterable(part)
        low, high = self.starts[first], self.starts[stop]
        self.items[low:high] = new
        delta = len(new) - (high - low)
        tail = self.starts[stop + 1 :]
        if delta:
            tail = array("q", map(add, tail, repeat(delta)))
        self.starts[first + 1 :] = array("q", accumulate(map(len, groups), initial=low))[1:] + tail


class _Linker:
    """The verdicts of a stream, chunk by chunk, and what links them into a Snapshot.

    ``replace`` swaps a run of chunks and updates, in proportion to what
    changed, everything ``snapshot`` needs to prove a clean stream: how many
    verdicts have problems of their own, whether any (kind, name) or
    (nodePort, protocol) repeats, and the flat lists of nodes, services and
    slices. Only a stream with problems is replayed in full (``_replay``),
    to report them in the order and words of a single pass.
    """

    def __init__(self) -> None:
        self.chunks: list[tuple[_Verdict, ...]] = []
        self.unclean = 0
        self.idents = _Tally()
        self.claims = _Tally()
        # The keys of the accepted services, and the service keys of the
        # slices: an orphan slice is one whose key is not a service's.
        self.service_keys = _Tally()
        self.slice_keys = _Tally()
        self.nodes = _Column(attrgetter("nodes"))
        self.services = _Column(attrgetter("services"))
        self.slices = _Column(attrgetter("slices"))

    def replace(self, first: int, stop: int, chunks: list[tuple[_Verdict, ...]]) -> None:
        """Chunks ``first:stop`` become ``chunks``."""
        removed = list(chain.from_iterable(self.chunks[first:stop]))
        added = list(chain.from_iterable(chunks))
        self.unclean += (len(added) - sum(map(_CLEAN, added))) - (
            len(removed) - sum(map(_CLEAN, removed))
        )
        for tally, values in (
            (self.idents, _idents),
            (self.claims, _claims),
            (self.service_keys, _service_keys),
            (self.slice_keys, _slice_keys),
        ):
            tally.remove(values(removed))
            tally.add(values(added))
        for column in (self.nodes, self.services, self.slices):
            column.replace(first, stop, chunks)
        self.chunks[first:stop] = chunks

    def snapshot(self, generation: int) -> Snapshot:
        if self.unclean or self.idents.repeated or self.claims.repeated:
            return _replay(list(chain.from_iterable(self.chunks)), generation)
        slices = self.slices.items
        if not self.slice_keys.counts.keys() <= self.service_keys.counts.keys():
            # An orphan slice (service gone, ignored, or not yet written) is
            # not a problem: kube-proxy drops it too and it reappears with
            # its service.
            slices = list(
                compress(
                    slices, map(self.service_keys.counts.__contains__, map(_SERVICE_KEY, slices))
                )
            )
        return Snapshot(
            nodes=tuple(self.nodes.items),
            services=tuple(self.services.items),
            slices=tuple(slices),
            generation=generation,
        )


def _link(verdicts: Iterable[_Verdict], generation: int) -> Snapshot:
    """One Snapshot from the verdicts of a whole stream, in stream order."""
    linker = _Linker()
    linker.replace(0, 0, [(verdict,) for verdict in verdicts])
    return linker.snapshot(generation)


def _replay(verdicts: list[_Verdict], generation: int) -> Snapshot:
    """``_link`` the slow way: every entry in order, reporting as it goes."""
    problems: list[str] = []
    seen: dict[str, str] = {}
    """``kind/key`` -> where it was first seen, for duplicates."""
    owners: dict[tuple[int, str], str] = {}
    """(port, protocol) -> ``Service ns/name field.path`` that holds it."""
    nodes: list[Node] = []
    services: dict[str, Service] = {}
    slices: list[EndpointSlice] = []
    for number, verdict in enumerate(verdicts, 1):
        for entry in verdict.entries:
            if type(entry) is _Located:
                problems.append(entry.text(number))
                continue
            problems.extend(entry.early)
            kind, key = entry.kind, entry.key
            where = f"document {number}{entry.rel}"
            first = seen.get(entry.ident)
            if first is not None:
                problems.append(
                    f"{kind} {key}: metadata.name: duplicate {kind} (in {first} and {where})"
                )
                continue
            seen[entry.ident] = where
            for item in entry.body:
                if type(item) is str:
                    problems.append(item)
                    continue
                claimed = (item.port, item.protocol)
                owner = owners.get(claimed)
                if owner is None:
                    owners[claimed] = f"{item.label} {item.path}"
                else:
                    problems.append(
                        f"{item.label}: {item.path}: "
                        f"{item.port}/{item.protocol} is also used by {owner}"
                    )
            value = entry.value
            if type(value) is Service:
                services[key] = value
            elif type(value) is EndpointSlice:
                slices.append(value)
            elif type(value) is Node:
                nodes.append(value)
    if problems:
        raise StateError(problems)
    return Snapshot(
        nodes=tuple(nodes),
        services=tuple(services.values()),
        slices=tuple(sl for sl in slices if sl.service_key in services),
        generation=generation,
    )


# -- decoding ---------------------------------------------------------------------------


def _mark(mark: Any, line_offset: int) -> str:
    return f"line {mark.line + 1 + line_offset}, column {mark.column + 1}"


def _yaml_error_detail(err: yaml.MarkedYAMLError, line_offset: int = 0) -> str:
    """``line 27, column 28: did not find expected key (while parsing ... at line 25, ...)``.

    ``line_offset`` counts the lines above the text PyYAML was given, so a
    chunk's error names its line in the whole file.
    """
    mark = err.problem_mark or err.context_mark
    detail = (
        f"{_mark(mark, line_offset) if mark else 'an unknown place'}: {err.problem or err.context}"
    )
    if err.problem and err.context:
        detail += f" ({err.context}"
        context_mark = err.context_mark
        if context_mark and (
            mark is None or (context_mark.line, context_mark.column) != (mark.line, mark.column)
        ):
            detail += f" that starts at {_mark(context_mark, line_offset)}"
        detail += ")"
    return detail


def _yaml_problem(err: yaml.YAMLError, line_offset: int = 0) -> StateError:
    if isinstance(err, yaml.MarkedYAMLError):
        return StateError([f"YAML syntax error at {_yaml_error_detail(err, line_offset)}"])
    return StateError([f"YAML error: {err}"])


# Nesting. PyYAML's C extension builds each collection by a C call inside its
# parent's (``CParser._compose_node``), with no limit of its own: against a
# libyaml without one (Debian's 0.2.5, which distro PyYAML links) ~100 KB of
# ``[`` or of ``- - - `` overflow the C stack and the process dies of SIGSEGV,
# taking every listener with it. libyaml's *events*, though, come from a loop
# with a heap stack, and are safe at any depth. So every text is measured
# before PyYAML builds it, and refused past ``_MAX_DEPTH``.

_MAX_DEPTH = 100
"""Collections nested in collections, at most. kubectl's output for Nodes, Services and
EndpointSlices nests under 30 deep (managedFields included), and no Kubernetes object
comes near 100; while 100 is far below where any decoder kpx uses gets into trouble:
libyaml's composer overflows an 8 MiB stack at ~30,000 levels, the pure-Python
loader reaches Python's recursion limit at ~300 and ``json`` at ~1,000."""

_SHALLOW_INDENT = 20
_SHALLOW_OPENERS = _MAX_DEPTH // 2 - _SHALLOW_INDENT - 1
"""The cheap test (``_could_nest_deeply``) passes a text with at most this many ``[``
and ``{`` and no line that starts with ``_SHALLOW_INDENT`` indentation or
indicator characters: such a text cannot nest past ``_MAX_DEPTH`` (see there)."""
_DEEP_LINE = re.compile(rf"(?:\A|[\n\r\x85\u2028\u2029])\ufeff?[-?: \t]{{{_SHALLOW_INDENT}}}")
_COLLECTION_EVENTS: dict[type, int] = {
    yaml.MappingStartEvent: 1,
    yaml.SequenceStartEvent: 1,
    yaml.MappingEndEvent: -1,
    yaml.SequenceEndEvent: -1,
}


def _could_nest_deeply(text: str) -> bool:
    """False when ``text`` certainly nests at most ``_MAX_DEPTH`` collections deep.

    A bound that costs a few scans in C, so that the exact measure
    (``_too_deep``) only runs for the rare text it cannot vouch for. Flow
    collections nest at most two per ``[`` or ``{`` (a ``[a: b]`` pair is a
    mapping of its own). A block collection starts at a column where a key,
    ``-``, ``?`` or ``:`` stands, and only behind the indentation and
    indicators that begin its line (an optional byte-order mark aside); the
    columns of the block collections open at once increase strictly, and
    each may hold one more sequence at its own column (``key:`` then ``- a``).
    So with at most ``_SHALLOW_OPENERS`` brackets and every line's leading
    run of spaces, tabs, ``-``, ``?`` and ``:`` shorter than
    ``_SHALLOW_INDENT``, the depth is at most
    ``2 * _SHALLOW_OPENERS + 2 * (_SHALLOW_INDENT + 1) <= _MAX_DEPTH``.
    """
    return (
        text.count("[") + text.count("{") > _SHALLOW_OPENERS
        or _DEEP_LINE.search(text) is not None
    )


def _too_deep(text: str) -> Any:
    """Where ``text`` first nests deeper than ``_MAX_DEPTH``, as a YAML mark, or None.

    Counts libyaml's collection events, which cost about a tenth of what
    building the documents does and never recurse; it stops at the first
    event past the limit. A syntax error ends the count quietly: PyYAML
    then stops at that same error, no deeper than the count got.
    """
    loader = _LOADER(text)
    try:
        depth = 0
        steps = _COLLECTION_EVENTS
        while loader.check_event():
            event = loader.get_event()
            depth += steps.get(type(event), 0)
            if depth > _MAX_DEPTH:
                return event.start_mark
    except yaml.YAMLError:
        pass
    finally:
        loader.dispose()
    return None


def _pyyaml(text: str, line_offset: Callable[[], int] = int) -> list[object]:
    """Every document of ``text``, by PyYAML, unless it nests deeper than ``_MAX_DEPTH``.

    The one door to PyYAML's loader. ``StateError`` if too deep (``line_offset()``
    counts the lines above ``text``, only then); ``yaml.YAMLError`` for the rest.
    """
    if _could_nest_deeply(text):
        mark = _too_deep(text)
        if mark is not None:
            raise StateError(
                [
                    f"YAML nested too deep at {_mark(mark, line_offset())}: more than "
                    f"{_MAX_DEPTH} levels of collections, where no Kubernetes object comes "
                    "near; refused before decoding, so that no YAML parser can run out of stack"
                ]
            )
    try:
        return list(yaml.load_all(text, Loader=_LOADER))
    except RecursionError:
        # Only the pure-Python loader recurses in Python; ``_MAX_DEPTH`` keeps it
        # far from the limit, unless the caller's own stack is already deep.
        raise StateError(["YAML nested too deep to decode"]) from None


def _load_all(text: str) -> list[object]:
    try:
        return _pyyaml(text)
    except yaml.YAMLError as err:
        raise _yaml_problem(err) from err


# Plain scalars, as PyYAML reads them.

_SCALARS: Any = _LOADER("")
"""A loader over nothing, used only for PyYAML's resolver and scalar constructors."""
_STR_TAG = "tag:yaml.org,2002:str"
_PLAIN_CONSTRUCTORS = {
    tag: _SCALARS.yaml_constructors[tag]
    for tag in (
        "tag:yaml.org,2002:null",
        "tag:yaml.org,2002:bool",
        "tag:yaml.org,2002:int",
        "tag:yaml.org,2002:float",
        "tag:yaml.org,2002:timestamp",
    )
}
"""Tags whose value is a pure function of the scalar's text (merge keys and
``=`` are not; the readers below decline those and leave them to PyYAML)."""

_DECLINE: Any = object()
"""A reader's answer for "not mine, ask PyYAML"."""
_MISSING: Any = object()
"""Not in a memo (whose values may be None or ``_DECLINE``)."""


_RESOLVE_ALL = None in _SCALARS.yaml_implicit_resolvers or bool(_SCALARS.yaml_path_resolvers)


def _one_rule(
    rules: list[tuple[str, re.Pattern[str]]],
) -> tuple[re.Pattern[str], dict[int | None, str]]:
    """PyYAML's rules for one first character as one regex, and the tag of each group.

    ``resolve`` tries the rules in order and takes the first that matches;
    an alternation of them does the same in one call. Each rule sits in a
    group of its own, which closes after any group inside it, so
    ``lastindex`` names the rule that matched. Rules it cannot join safely
    (different flags, a verbose ``#``) are left to ``resolve``.
    """
    flags = {regexp.flags for _, regexp in rules}
    if len(flags) != 1 or any("#" in regexp.pattern for _, regexp in rules):
        raise ValueError("rules that cannot be joined")
    parts: list[str] = []
    tags: dict[int | None, str] = {}
    group = 1
    for tag, regexp in rules:
        parts.append(f"({regexp.pattern})")
        tags[group] = tag
        group += 1 + regexp.groups
    return re.compile("|".join(parts), flags.pop()), tags


def _joined_rules() -> dict[str, tuple[re.Pattern[str], dict[int | None, str]] | None]:
    joined: dict[str, tuple[re.Pattern[str], dict[int | None, str]] | None] = {}
    for first, rules in _SCALARS.yaml_implicit_resolvers.items():
        if first:
            try:
                joined[first] = _one_rule(rules)
            except (ValueError, re.error):
                joined[first] = None
    return joined


_RULES = _joined_rules()
"""``_one_rule`` by first character; None where ``resolve`` must decide."""


def _plain(text: str) -> object:
    """What PyYAML makes of an untagged plain scalar, or ``_DECLINE``."""
    if text and not _RESOLVE_ALL:
        rule = _RULES.get(text[0], _MISSING)
        if rule is _MISSING:
            return text  # Half of a state's names: no resolver to ask.
        if rule is not None:
            match = rule[0].match(text)
            tag = _STR_TAG if match is None else rule[1][match.lastindex]
        else:
            tag = _SCALARS.resolve(ScalarNode, text, (True, False))
    else:
        tag = _SCALARS.resolve(ScalarNode, text, (True, False))
    if tag == _STR_TAG:
        return text
    construct = _PLAIN_CONSTRUCTORS.get(tag)
    if construct is None:
        return _DECLINE
    return construct(_SCALARS, ScalarNode(tag, text))


# JSON.


def _json_number(text: str) -> object:
    """A JSON number (or ``NaN``/``Infinity``) as the same text is to PyYAML.

    YAML 1.1 wants a dot in a float and a sign in its exponent, so PyYAML
    reads ``1e3`` and ``NaN`` as strings; so must kpx, whatever the format.
    """
    value = _plain(text)
    if value is _DECLINE:
        raise ValueError(f"{text} is not a YAML scalar")
    return value


_JSON = json.JSONDecoder(parse_float=_json_number, parse_constant=_json_number)
_JSON_START = re.compile(r"[ \n\r]*\{")
_JSON_ODD = re.compile("[\x7f-\x9f\u2028\u2029\ud800-\udfff\ufffe\uffff]")
"""Characters YAML refuses (or takes for line breaks) that JSON lets through."""
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
"""JSON joins escaped surrogate pairs; libyaml refuses them."""


def _json_document(text: str) -> object:
    """``text`` as one JSON document, or ``_DECLINE`` if YAML must decide.

    JSON is YAML, so this is only a faster road to PyYAML's answer. It is
    declined where the two could differ: tabs (libyaml takes them as flow
    whitespace, PyYAML refuses them), ``_JSON_ODD`` characters, surrogate
    escapes, and anything ``json`` refuses (comments, YAML syntax, errors:
    PyYAML reports those). Known gaps: a key longer than 1024 characters,
    which YAML cannot read as an implicit key, and the API server never
    writes; and nesting: ``json`` is safe at any depth (past ~1,000 levels
    it raises RecursionError, and the text goes on to ``_pyyaml``, which
    refuses it), so JSON between ``_MAX_DEPTH`` and that is decoded here
    although ``_pyyaml`` would refuse it. Measuring every JSON state for it
    would cost more than decoding it; the judges read only known fields, at
    fixed depths, so what lies deeper is never looked at.
    """
    if not _JSON_START.match(text) or "\t" in text or "\x7f" in text:
        return _DECLINE
    if not text.isascii() and _JSON_ODD.search(text):
        return _DECLINE
    if "\\u" in text and _SURROGATE_ESCAPE.search(text):
        return _DECLINE
    try:
        return _JSON.decode(text)
    except (ValueError, RecursionError):
        return _DECLINE


# The block-style subset.

_SUBSET_UNSAFE = re.compile(r"[^\n -~]")
"""Anything but LF and printable ASCII: tabs, CR, control and non-ASCII characters."""
_PLAIN_FIRST = r"(?:[A-Za-z0-9_./~+(\\$^]|-(?=[A-Za-z0-9_.]))"
_PLAIN_WORD = r"[^:\n ]*(?::[^: \n][^:\n ]*)*"
"""No space, and a ``:`` only before another character (``a:b``, not ``a:``)."""
_PLAIN_KEY = _PLAIN_FIRST + _PLAIN_WORD
_PLAIN_VALUE = rf"{_PLAIN_FIRST}{_PLAIN_WORD}(?: +[^ \n#:]{_PLAIN_WORD})*"
"""A one-line plain scalar: no indicator first, no ``: `` or `` #`` inside, no ``:`` last."""
_QUOTED = r"'[^'\n]*(?:''[^'\n]*)*'|\"[^\"\\\n]*\""
"""Single-quoted, or double-quoted without escapes."""
_VALUE = rf"{_PLAIN_VALUE}|{_QUOTED}|\{{\}}|\[\]"
_SUBSET_LINE = re.compile(rf"( *)(- +)?(?:({_PLAIN_KEY}|{_QUOTED}):(?: +({_VALUE}))?|({_VALUE})) *")
"""One content line: indent, ``- ``, and ``key:``, ``key: value`` or ``value``."""
_SIMPLE_LINE = re.compile(r"( *)([A-Za-z][-A-Za-z0-9_./]*): ([A-Za-z0-9][-A-Za-z0-9_.]*)")
"""The commonest line, ``  key: value`` with a plain word for each, three times cheaper
to match. Its lines are ``_SUBSET_LINE`` lines, read into the same groups."""
_MAX_KEY = 1000
"""libyaml and PyYAML refuse an implicit key longer than 1024 characters."""

# What a line reads as, where it is not a plain value: ``{}`` and ``[]`` (a new
# container each time they are used), ``key:`` (whatever block follows), an
# item line that has no key.
_NEW_MAPPING: Any = object()
_NEW_SEQUENCE: Any = object()
_OPEN: Any = object()
_NO_KEY: Any = object()

_Line = tuple[int, int, int, object, object]
"""A line, read: its shape (see ``_read_line``), indent, width of its ``- `` (0 if none),
key (``_NO_KEY`` for an item that is a scalar) and value."""
_SKIP_LINE: _Line = (-1, 0, 0, None, None)
"""A blank or comment line."""
_DECLINE_LINE: _Line = (-2, 0, 0, None, None)
"""A line outside the subset."""


def _scalar(text: str) -> object:
    """What a ``_VALUE`` means: a string, a resolved plain scalar, or a ``_NEW_*`` marker."""
    first = text[0]
    if first == "'":
        return text[1:-1].replace("''", "'")
    if first == '"':
        return text[1:-1]
    if first == "{":
        return _NEW_MAPPING
    if first == "[":
        return _NEW_SEQUENCE
    return _plain(text)


def _read_line(line: str, scalars: dict[str, object]) -> _Line:
    """One line of the subset, read; ``_SKIP_LINE`` for blanks and comments, ``_DECLINE_LINE``
    if it is not in the subset.

    ``scalars`` remembers what each key and value text means: keys (``name``,
    ``nodePort``) repeat on thousands of distinct lines, and PyYAML's resolver
    is most of a line's cost. Every answer is immutable, so sharing one is safe.

    The first item of a reading is the line's *shape*: all of it that
    ``_build`` looks at besides the key and value, as one int. Lines of equal
    shapes build the same containers in the same places, so a document's
    shapes decide its structure (``_compile``). The int is exact: no ``str``
    is longer than ``sys.maxsize`` < 2**64, so the indent never reaches the
    dash's bits.
    """
    match = _SIMPLE_LINE.fullmatch(line)  # Printable ASCII only, like the subset.
    if match is not None:
        # What the general case below does for this form, with what cannot
        # happen left out: plain words, so ``_plain`` directly; no dash; a
        # value that starts with a letter or digit is never a ``_NEW_*``.
        indent_text, key, key_value = match.groups()
        name = scalars.get(key, _MISSING)
        if name is _MISSING:
            name = scalars[key] = _plain(key)
        value = scalars.get(key_value, _MISSING)
        if value is _MISSING:
            value = scalars[key_value] = _plain(key_value)
        if type(name) is not str or value is _DECLINE or len(key) > _MAX_KEY:
            return _DECLINE_LINE
        indent = len(indent_text)
        return indent << 3, indent, 0, name, value
    if not (line.isascii() and line.isprintable()):
        return _DECLINE_LINE  # ``_SUBSET_UNSAFE``, faster: a line holds no LF.
    match = _SUBSET_LINE.fullmatch(line)
    if match is None:
        content = line.lstrip(" ")
        return _SKIP_LINE if not content or content[0] == "#" else _DECLINE_LINE
    indent_text, dash_text, key, key_value, item = match.groups()
    indent = len(indent_text)
    dash = len(dash_text) if dash_text else 0
    if key is None:
        if not dash:
            return _DECLINE_LINE  # A scalar on a line of its own continues a multi-line one.
        name = _NO_KEY
        value = scalars.get(item, _MISSING)
        if value is _MISSING:
            value = scalars[item] = _scalar(item)
    else:
        if len(key) > _MAX_KEY:
            return _DECLINE_LINE
        name = scalars.get(key, _MISSING)
        if name is _MISSING:
            name = scalars[key] = _scalar(key)
        if type(name) is not str:
            return _DECLINE_LINE  # ``1:``, ``true:``, ``<<:``: PyYAML builds those.
        if key_value is None:
            value = _OPEN
        else:
            value = scalars.get(key_value, _MISSING)
            if value is _MISSING:
                value = scalars[key_value] = _scalar(key_value)
    if value is _DECLINE:
        return _DECLINE_LINE
    kind = (
        1 if value is _OPEN else 2 if value is _NEW_MAPPING else 3 if value is _NEW_SEQUENCE else 0
    )
    shape = (dash << 64 | indent) << 3 | (name is _NO_KEY) << 2 | kind
    return shape, indent, dash, name, value


_MAX_SUBSET_STACK = _MAX_DEPTH - 2
"""Blocks around the one being filled, at most: with it and a ``{}`` or ``[]`` inside,
a document ``_build`` reads stays within ``_MAX_DEPTH``. Deeper ones are declined,
and PyYAML's door (``_pyyaml``) measures and refuses them, in its own words."""


def _build(reads: list[_Line]) -> Any:
    """The root mapping that the lines of one document spell, None if they hold no
    content, or ``_DECLINE``.

    The block being filled is ``(column, container, is_sequence)`` in
    locals, the blocks around it on ``stack`` (``_MAX_SUBSET_STACK`` at most).
    ``pending`` is a ``key:`` whose value is whatever block the next line
    opens, or null if none.
    """
    stack: list[tuple[int, Any, bool]] = []
    column, block, in_sequence = 0, cast(Any, None), False
    root: Any = None
    pending: object = None
    for shape, indent, dash, key, value in reads:
        if shape < 0:
            if shape == -1:
                continue  # _SKIP_LINE
            return _DECLINE
        if value is _NEW_MAPPING:
            value = {}
        elif value is _NEW_SEQUENCE:
            value = []
        if block is None:
            if dash or key is _NO_KEY or indent:
                return _DECLINE  # Only a mapping at column 0 can be a Kubernetes object.
            root = block = {}
        else:
            if pending is not None:
                if (indent >= column) if dash else (indent > column):
                    if len(stack) >= _MAX_SUBSET_STACK:
                        return _DECLINE
                    opened: Any = [] if dash else {}
                    block[pending] = opened
                    stack.append((column, block, in_sequence))
                    column, block, in_sequence = indent, opened, bool(dash)
                pending = None
            # Close the blocks this line is not part of: deeper ones, and a
            # sequence at its own column when the line is not an item.
            while column > indent or (in_sequence and column == indent and not dash):
                if not stack:
                    return _DECLINE
                column, block, in_sequence = stack.pop()
            if column != indent:
                return _DECLINE
            if dash:
                if not in_sequence:
                    return _DECLINE
                if key is _NO_KEY:
                    block.append(value)
                    continue
                if len(stack) >= _MAX_SUBSET_STACK:
                    return _DECLINE
                opened = {}
                block.append(opened)
                stack.append((column, block, in_sequence))
                column, block, in_sequence = indent + dash, opened, False
            elif in_sequence or key is _NO_KEY:
                return _DECLINE
        if value is _OPEN:
            block[key] = None
            pending = key
        else:
            block[key] = value
    return root


class _Slot:
    """A name in ``_compile``'s program: ``k3`` and ``v3`` hold the key and value of line 3."""

    __slots__ = ("source",)

    def __init__(self, source: str) -> None:
        self.source = source


class _TooDeep(Exception):
    """Nesting Python's compiler might refuse; such a shape stays with ``_build``."""


_MAX_COMPILED_DEPTH = 50
"""CPython's parser gives up at 200 nested brackets; no Kubernetes object nears 50."""
_MAX_COMPILED_LINES = 5000
"""Beyond this a document is rarely repeated, and its program would be slow to compile."""


def _source(node: object, depth: int) -> str:
    """The Python expression that builds ``node``, a tree of ``_Slot`` leaves."""
    if type(node) is _Slot:
        return node.source
    if node is None:
        return "None"
    if depth > _MAX_COMPILED_DEPTH:
        raise _TooDeep
    if type(node) is dict:
        entries = (f"{_source(k, depth)}: {_source(v, depth + 1)}" for k, v in node.items())
        return "{" + ", ".join(entries) + "}"
    return "[" + ", ".join(_source(v, depth + 1) for v in cast(list[object], node)) + "]"


def _compile(reads: list[_Line]) -> Callable[[list[_Line]], Any]:
    """``_build`` for every document of the same shapes as ``reads``, as one expression.

    ``_build`` runs once on stand-ins (``_Slot``) for the keys and values; the
    tree it returns, written out as nested dict and list displays, builds the
    same containers in C with no per-line branches; the readings come in by
    one unpacking of the whole list, cheaper than subscripts. Duplicate keys
    behave as in ``_build``: a display stores its entries in order, exactly
    like ``block[key] = value`` (first position, last value). The source
    holds only brackets and generated names, never text from the document.
    """
    stand_ins = [
        read
        if read[0] < 0
        else (
            read[0],
            read[1],
            read[2],
            read[3] if read[3] is _NO_KEY else _Slot(f"k{i}"),
            read[4]
            if read[4] is _OPEN or read[4] is _NEW_MAPPING or read[4] is _NEW_SEQUENCE
            else _Slot(f"v{i}"),
        )
        for i, read in enumerate(reads)
    ]
    tree = _build(stand_ins)
    if tree is _DECLINE or len(reads) > _MAX_COMPILED_LINES:
        return _build
    unpack = ", ".join(
        "_" if read[0] < 0 else f"(_, _, _, k{i}, v{i})" for i, read in enumerate(reads)
    )
    namespace: dict[str, Any] = {}
    try:
        exec(f"def build(r):\n    {unpack}, = r\n    return {_source(tree, 0)}\n", namespace)
    except (_TooDeep, SyntaxError, RecursionError, MemoryError):
        return _build
    return cast(Callable[[list[_Line]], Any], namespace["build"])


_COMPILE_AFTER = 100
"""Sightings of a document shape that ``_build`` reads before it is compiled.

Compiling a 25-line document costs about 90 readings by ``_build`` and saves
three quarters of each later one, so it pays back after about 120; waiting
for 100 first means a shape never costs much more than twice what ``_build``
alone would have (rent, then buy), and one seen once (a ``kind: List``) costs
nothing extra."""
_SHAPE = itemgetter(0)


def _read_subset(
    chunk: str,
    lines: dict[str, _Line],
    scalars: dict[str, object] | None = None,
    shapes: dict[tuple[int, ...], Any] | None = None,
) -> list[object] | None:
    """The documents of ``chunk`` if it is in the block-style subset, else None.

    The subset is what YAML printers emit for Kubernetes objects: a root
    mapping at column 0; ``key: value`` and ``key:`` lines; ``- `` items at
    or beyond their key's column; single-line scalars, ``{}`` and ``[]``;
    blank and comment lines. Every line must fit (``_SUBSET_LINE``) and sit
    at a column that opens, continues or closes a block exactly as YAML's
    indentation rules say (``_build``); whatever does not is declined, never
    guessed, so an error is always PyYAML's to report.

    ``lines`` caches each line's reading by its text: in a state most lines
    repeat verbatim from one object to the next (``    protocol: TCP``), so
    most of them cost one dict lookup instead of a regex and a resolver.
    ``scalars`` does the same for keys and values (see ``_read_line``). A
    character outside the subset (``_SUBSET_UNSAFE``) is caught line by line
    too, so only new lines are ever scanned for one.

    ``shapes`` counts the documents of each shape, the tuple of their lines'
    shapes (see ``_read_line``): thousands of Services print alike, apart
    from names and numbers. A shape seen ``_COMPILE_AFTER`` times is compiled
    (``_compile``) and its program builds every later document of that shape.
    Without ``scalars`` and ``shapes`` the call shares neither.
    """
    texts = chunk.split("\n")
    marked = chunk.startswith("---") and chunk[3:4] in ("", " ", "\n")
    if marked:
        rest = texts[0][3:].lstrip(" ")
        if rest and (rest[0] != "#" or _SUBSET_UNSAFE.search(rest)):
            return None  # Content on the marker line, or a comment the subset cannot hold.
        del texts[0]
    # No ``cast`` here or below: it is a call, and this runs for every document.
    reads: list[Any] = list(map(lines.get, texts))
    if not all(reads):  # A reading is a non-empty tuple: some line is new.
        if scalars is None:
            scalars = {}
        for i in compress(range(len(reads)), map(not_, reads)):
            text = texts[i]
            read = lines.get(text)  # It may repeat within the chunk.
            if read is None:
                read = lines[text] = _read_line(text, scalars)
            reads[i] = read
    if shapes is None:
        root = _build(reads)
    else:
        shape = tuple(map(_SHAPE, reads))
        program = shapes.get(shape, 0)
        if type(program) is int:
            if program + 1 < _COMPILE_AFTER:
                shapes[shape] = program + 1
                root = _build(reads)
            else:
                program = shapes[shape] = _compile(reads)
                root = program(reads)
        else:
            root = program(reads)
    if root is _DECLINE:
        return None
    if marked:
        return [root]  # A marker starts a document, empty or not.
    return [] if root is None else [root]


class _Memo(NamedTuple):
    """What the new chunks of one parse share: the subset reader's memos (see
    ``_read_subset``) and the judge's (see ``_quick_slice``)."""

    lines: dict[str, _Line]
    scalars: dict[str, object]
    shapes: dict[tuple[int, ...], Any]
    interned: _Interned


# Chunks.

_MARKER = re.compile(r"\n(?=---(?:[ \t\r\n]|\Z))")
"""The line break before a document marker line."""
_END = methodcaller("end")
_UNUSUAL_BREAK = re.compile("[\x85\u2028\u2029]")
_NON_PRINTABLE = re.compile("[^\t\n\r -~\x85\xa0-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")
"""What YAML's reader refuses, anywhere in a stream."""


# Scans of a whole state in pieces. A parse runs in a worker thread beside the
# event loop that forwards traffic, and one C call holds the GIL until it
# returns: a ``str.find`` or a regex scan over a 41 MB state is one 20-40 ms
# call, and the loop waits it out at every socket call of a new connection.
# Piece by piece, the same answers cost the same time in ~1 ms calls.

_SCAN_PIECE = 1 << 20
"""Characters per C call when a whole state is scanned."""
_BATCH = 8192
"""Items per C call when a whole state's objects are listed, counted or freed."""


def _find(text: str, sub: str, start: int, end: int) -> int:
    """``text.find(sub, start, end)``, for a non-empty ``sub``, ``_SCAN_PIECE`` at a time."""
    reach = len(sub) - 1  # Pieces overlap so an occurrence across a seam is found.
    for a in range(start, end, _SCAN_PIECE):
        i = text.find(sub, a, min(a + _SCAN_PIECE + reach, end))
        if i >= 0:
            return i
    return -1


def _marker_ends(text: str, start: int, end: int) -> list[int]:
    """``[m.end() for m in _MARKER.finditer(text, start, end)]``, ``_SCAN_PIECE`` at a time.

    A match is one line break and looks at most 4 characters past it, so a
    scan of one piece that runs 4 characters into the next finds each match
    that starts in the piece exactly as the whole scan does (``\\Z`` can only
    hold at ``end`` itself); a match it finds in those 4 characters belongs to
    the next piece (at most one fits there).
    """
    ends: list[int] = []
    for a in range(start, end, _SCAN_PIECE):
        b = a + _SCAN_PIECE
        found = list(map(_END, _MARKER.finditer(text, a, min(b + 4, end))))
        if found and found[-1] > b:
            found.pop()
        ends += found
    return ends


def _starts_with_marker(chunk: str) -> bool:
    return chunk.startswith("---") and chunk[3:4] in ("", " ", "\t", "\r", "\n")


def _marker_at(text: str, i: int) -> bool:
    """Whether a document marker line starts at ``text[i]``."""
    return (i == 0 or text[i - 1] == "\n") and _starts_with_marker(text[i : i + 4])


def _split(text: str, start: int, end: int) -> list[tuple[int, str]]:
    """``text[start:end]`` cut before each marker line, as (offset, chunk) pairs.

    ``start`` and ``end`` must themselves be chunk boundaries.
    """
    # A match is the line break itself, so its end is where the marker line starts.
    cuts = [start, *_marker_ends(text, start, end), end]
    return [(a, text[a:b]) for a, b in pairwise(cuts) if a < b]


def _unusual(chunk: str, first: bool) -> bool:
    """Whether ``chunk`` holds something the split into chunks cannot vouch for.

    Lines that start with ``...`` or ``%`` may end a document or carry a
    directive for the next; a lone CR, NEL, LS or PS is a line break to YAML
    but not to the split; a byte-order mark is only harmless as the stream's
    first character. Each is rare enough to simply decode the whole stream.
    """
    if "\n..." in chunk or "\n%" in chunk or (first and chunk.startswith(("...", "%"))):
        return True
    if "\r" in chunk and chunk.count("\r") != chunk.count("\r\n"):
        return True
    return not chunk.isascii() and (
        "\ufeff" in (chunk[1:] if first else chunk) or _UNUSUAL_BREAK.search(chunk) is not None
    )


def _usual(text: str, start: int, end: int) -> bool:
    """Whether no chunk of ``text[start:end]`` can be ``_unusual``, in a few scans of it all.

    Every pattern ``_unusual`` looks for lies inside one chunk (a chunk ends
    with the line break before a marker), so a run without any has no
    unusual chunk. False only means "ask each chunk": a non-ASCII text
    (``isascii`` is a flag, free to read) or a CR anywhere is left to it.
    """
    return (
        text.isascii()
        and _find(text, "\n...", start, end) < 0
        and _find(text, "\n%", start, end) < 0
        and _find(text, "\r", start, end) < 0
        and not (start == 0 and text.startswith(("...", "%")))
    )


_FREE_AT_ONCE = 1 << 16
"""Entries a dict or list may hold and still be freed in one C call; see ``_let_go``."""


def _let_go(items: dict[Any, Any] | list[Any]) -> None:
    """Empty ``items`` ``_BATCH`` entries per C call, if it holds over ``_FREE_AT_ONCE``.

    The memos (``_Memo``) and chunk list of a 50,000-service parse hold
    500,000 entries; freed at once, when ``_update`` returned, they held the
    GIL 25 ms. Popped in batches they cost a third more, so the smaller ones
    of a 10,000-service state are left to be freed whole.
    """
    if len(items) <= _FREE_AT_ONCE:
        return
    if isinstance(items, list):
        while items:
            del items[-_BATCH:]
        return
    while items:
        deque(starmap(items.popitem, repeat((), min(_BATCH, len(items)))), maxlen=0)


class _Whole(Exception):
    """The stream must be decoded as a whole (see ``_unusual``)."""


def _chunk_error(text: str, start: int, end: int) -> StateError:
    """The syntax error the whole stream reports for the broken chunk ``text[start:end]``.

    PyYAML stops at the first error in stream order, and every chunk before
    this one decoded cleanly. The chunk is decoded again together with the
    next marker line, so a scalar that the marker cuts off fails as it does
    in the whole stream ("unexpected document indicator", not "unexpected
    end of stream"), and line numbers are shifted to the whole file. A
    character YAML's reader refuses anywhere would be reported first by a
    whole-stream read, so that case is left to one.
    """
    if _NON_PRINTABLE.search(text):
        raise _Whole
    stop = text.find("\n", end)
    try:
        piece = text[start : len(text) if stop < 0 else stop + 1]
        _pyyaml(piece, lambda: text.count("\n", 0, start))
    except yaml.MarkedYAMLError as err:
        return _yaml_problem(err, text.count("\n", 0, start))
    except yaml.YAMLError:
        pass
    raise _Whole


# -- the entry points ---------------------------------------------------------------------


@dataclass(slots=True)
class ParseStats:
    """What one ``StateParser.parse`` did: tests count decodes instead of timing them.

    Chunks hold one document each, except a leading one that holds only
    comments. In ``whole`` mode ``pyyaml`` counts documents.
    """

    mode: Literal["chunks", "whole", "json"] = "chunks"
    chunks: int = 0
    """Chunks in the stream."""
    reused: int = 0
    """Chunks whose verdicts came from the cache, model objects and all."""
    subset: int = 0
    """Chunks decoded by the block-subset reader."""
    pyyaml: int = 0
    """Chunks (or documents) decoded by PyYAML."""


class StateParser:
    """Parses successive versions of one state, decoding only what changed.

    Same answers as ``parse_state`` (which is a fresh StateParser per call),
    same problems in the same order; the module docstring explains how.

    It keeps the chunks of the last stream it could cut into chunks and
    decode to the end (a syntax error leaves them alone): about 1x the text,
    plus the verdicts whose model objects the published snapshot holds
    anyway. That is the whole cache, so it is bounded by one state. Not
    thread-safe; one per source.
    """

    def __init__(self) -> None:
        self.last = ParseStats()
        self._forget()

    def _forget(self) -> None:
        self._texts: list[str] = []
        self._starts = array("q", [0])
        """Where each chunk starts in the last stream, and its length at the end."""
        self._linker = _Linker()

    def parse(self, text: str, generation: int = 0) -> Snapshot:
        """Parse ``text``; raises ``StateError`` exactly as ``parse_state`` would."""
        stats = self.last = ParseStats()
        with gc_paused():
            doc = _json_document(text)
            if doc is not _DECLINE:
                stats.mode = "json"
                self._forget()  # A JSON state has no chunks to keep.
                return _link([_judge(doc)], generation)
            try:
                self._update(text, stats)
            except _Whole:
                stats.mode = "whole"
                docs = _load_all(text)
                stats.pyyaml = len(docs)
                verdicts = list(map(_judge, docs, repeat({})))
                return _refuse_if_empty(_link(verdicts, generation), lambda: verdicts)
            chunks = self._linker.chunks
            return _refuse_if_empty(
                self._linker.snapshot(generation), lambda: chain.from_iterable(chunks)
            )

    def _update(self, text: str, stats: ParseStats) -> None:
        """Bring the chunks, their verdicts and the linker up to ``text``.

        The chunks that did not change are found by comparing last time's,
        in C, with the text at the same offset from the front, then at the
        same distance from the back (memcmp, no copy, no hash); one edit
        leaves one chunk in between. What lies in between is split afresh and
        looked up by text among last time's chunks in between (a document
        that moved), and only what is still unknown is decoded. Nothing is
        kept until every new chunk has decoded.
        """
        texts, starts = self._texts, self._starts
        count, n = len(texts), len(text)
        delta = n - starts[count]
        same = text.startswith

        prefix = len(list(takewhile(bool, map(same, texts, starts))))
        pos = starts[prefix]
        if prefix and not (pos == n or _marker_at(text, pos)):
            # The last one grew: the text after it is no longer a new chunk.
            prefix -= 1
            pos = starts[prefix]

        ends = map(add, reversed(starts[:count]), repeat(delta))
        suffix = min(len(list(takewhile(bool, map(same, reversed(texts), ends)))), count - prefix)
        while suffix:
            # The first of them must start a chunk, after the ones in front.
            index = count - suffix
            start = starts[index] + delta
            if start >= pos and (
                start == 0 or (text[start - 1] == "\n" and (index or _starts_with_marker(texts[0])))
            ):
                break
            suffix -= 1
        first, stop = prefix, count - suffix
        end = starts[stop] + delta

        known = dict(zip(texts[first:stop], self._linker.chunks[first:stop], strict=True))
        memo = _Memo({}, {}, {}, {})
        usual = _usual(text, pos, end)
        middle = _split(text, pos, end)
        verdicts: list[tuple[_Verdict, ...]] = []
        for start, chunk in middle:
            verdict = known.get(chunk) if known else None
            if verdict is None:
                verdict = self._decode(text, start, chunk, memo, stats, usual)
            else:
                stats.reused += 1
            verdicts.append(verdict)

        self._linker.replace(first, stop, verdicts)
        texts[first:stop] = [chunk for _, chunk in middle]
        tail = starts[stop:]
        if delta:
            tail = array("q", map(add, tail, repeat(delta)))
        starts[first:] = array("q", [start for start, _ in middle]) + tail
        stats.reused += first + suffix
        stats.chunks = len(texts)
        for items in (*memo, middle):
            _let_go(items)

    @staticmethod
    def _decode(
        text: str, start: int, chunk: str, memo: _Memo, stats: ParseStats, usual: bool
    ) -> tuple[_Verdict, ...]:
        """Decode and judge one new chunk, which starts at ``text[start]``.

        ``usual`` says ``_usual`` vouched for every chunk around it already.
        """
        if not usual and _unusual(chunk, start == 0):
            raise _Whole
        docs = _read_subset(chunk, memo.lines, memo.scalars, memo.shapes)
        if docs is not None:
            # The subset reader never reads a marker chunk as other than one
            # document, nor a leading chunk as more than one.
            stats.subset += 1
            return (_judge(docs[0], memo.interned),) if docs else ()
        stats.pyyaml += 1
        try:
            docs = _pyyaml(chunk, lambda: text.count("\n", 0, start))
        except yaml.MarkedYAMLError:
            raise _chunk_error(text, start, start + len(chunk)) from None
        except yaml.YAMLError:
            raise _Whole from None
        # A marker chunk is one document; a leading chunk is one or none.
        if len(docs) != 1 if _starts_with_marker(chunk) else len(docs) > 1:
            raise _Whole
        return tuple(map(_judge, docs, repeat(memo.interned)))


def parse_objects(documents: Iterable[object], generation: int = 0) -> Snapshot:
    """Build a Snapshot from already-decoded YAML/JSON documents.

    Each document is an object, a List, or None (an empty document). This is
    ``parse_state`` minus the decoding, for sources that decode themselves
    (JSON from an API server, tests).
    """
    with gc_paused():
        return _link(map(_judge, documents, repeat({})), generation)


def parse_state(text: str, generation: int = 0) -> Snapshot:
    """Parse a YAML (or JSON) stream of Nodes, Services and EndpointSlices into a Snapshot.

    Raises ``StateError`` listing every problem found; see the module
    docstring for what is checked and what is silently dropped. Stateless:
    a source that parses new versions of one state should keep a
    ``StateParser`` instead.
    """
    return StateParser().parse(text, generation)


def _parse_whole(text: str, generation: int = 0) -> Snapshot:
    """``parse_state`` the plain way: PyYAML decodes the whole stream at once.

    What ``StateParser`` falls back to, and what the tests hold it to.
    """
    with gc_paused():
        verdicts = list(map(_judge, _load_all(text)))
        return _refuse_if_empty(_link(verdicts, generation), lambda: verdicts)


def decode_state(data: bytes) -> str:
    """A state's bytes as text, or ``StateError`` if they are not UTF-8.

    The API server only ever stores UTF-8, so a file that is not is refused
    whole, as any other bad file is; every reader of state bytes (``kpx
    node``'s source, ``kpx check``) decodes through here, so they agree.
    """
    # One C call (18 ms for 41 MB, holding the GIL): decoding in pieces was
    # tried, but joining them costs as much, nearly all of it page faults
    # on the new string's memory.
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise StateError([f"not UTF-8 text ({err.reason} at byte {err.start})"]) from None


def parse_file(path: str | Path, generation: int = 0) -> Snapshot:
    """``parse_state`` of a UTF-8 file. ``OSError`` is left to the caller."""
    return parse_state(decode_state(Path(path).read_bytes()), generation)
