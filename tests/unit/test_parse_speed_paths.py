"""The parser's fast paths give exactly what its plain paths give.

``proxy.k8s`` reads and judges the common case by shortcuts: compiled
programs for document shapes it has seen before (``_compile``), and quick
judges for plain Services and slices (``_quick_service``, ``_quick_slice``)
that leave anything unusual to the full judge. The other tests hold the
parser to PyYAML and to its own answers; these hold each shortcut to the
road it skips, strictly (``True`` is not ``1``, key order counts), on
documents that are mostly fine and a little broken.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import re
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from proxy import k8s
from proxy.k8s import decode, fields, subset

# -- strict equality ---------------------------------------------------------------------


def strict(a: object, b: object) -> bool:
    """``==`` that minds types all the way down (``True`` is not ``1``) and key order."""
    if type(a) is not type(b):
        return False
    if isinstance(a, tuple | list):
        assert isinstance(b, tuple | list)
        return len(a) == len(b) and all(map(strict, a, b))
    if type(a) is dict:
        assert isinstance(b, dict)
        return list(a) == list(b) and all(map(strict, a.values(), b.values()))
    if dataclasses.is_dataclass(a):
        return all(strict(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a))
    if type(a) is float and a != a:
        return b != b
    return a == b


# -- the subset reader: compiled shapes ------------------------------------------------------

SCALARS = [
    "a", "yes", "on", "~", "", "0", "-1", "0o17", "0x1F", "1_000", "1:20", "1.5", ".inf",
    "2024-05-01", "2024-05-01T10:00:00Z", "=", "<<", "a: b", "a #b", "#a", "- a", "'q'",
    "it's", "10.0.0.1", "svc-00001", "{}", "[]", 7, -3, 0, 1.25, True, False, None,
]  # fmt: skip
KEYS = ["a", "kind", "name", "kubernetes.io/service-name", "f:spec", "yes", "1", "a b", "-a"]

scalars = st.sampled_from(SCALARS)
trees = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(KEYS), inner),
    max_leaves=12,
)


def _relabel(tree: object, values: list[object]) -> object:
    """``tree`` with every scalar leaf replaced by the next of ``values`` (cycled)."""
    if type(tree) is dict:
        return {k: _relabel(v, values) for k, v in tree.items()}
    if type(tree) is list:
        return [_relabel(v, values) for v in tree]
    value = values.pop(0)
    values.append(value)
    return value


def _pyyaml(text: str) -> list[object] | None:
    try:
        return list(yaml.load_all(text, Loader=decode._LOADER))
    except (yaml.YAMLError, ValueError):
        return None


def _read_often(texts: list[str]) -> list[list[object] | None]:
    """Each text read by one set of memos, after the first was read until its shape compiled."""
    lines: dict[str, Any] = {}
    scalars: dict[str, object] = {}
    shapes: dict[tuple[int, ...], Any] = {}
    for _ in range(subset._COMPILE_AFTER + 1):
        subset._read_subset(texts[0], lines, scalars, shapes)
    return [subset._read_subset(text, lines, scalars, shapes) for text in texts]


@given(
    tree=st.dictionaries(st.sampled_from(KEYS), trees, min_size=1, max_size=4),
    values=st.lists(scalars, min_size=1, max_size=8),
    indent=st.sampled_from([2, 4]),
    marker=st.booleans(),
)
def test_compiled_shapes_read_what_pyyaml_reads(
    tree: dict[str, Any], values: list[object], indent: int, marker: bool
) -> None:
    prefix = "---\n" if marker else ""
    first = prefix + yaml.safe_dump(tree, default_flow_style=False, indent=indent)
    other = prefix + yaml.safe_dump(_relabel(tree, values), default_flow_style=False, indent=indent)
    for text, got in zip((first, other), _read_often([first, other]), strict=True):
        if got is not None:
            expected = _pyyaml(text)
            assert expected is not None and strict(got, expected), text
    # The interpreter and the compiled program agree on the very same text.
    assert strict(_read_often([first])[0], subset._read_subset(first, {}))


@pytest.mark.parametrize(
    "texts",
    [
        # Duplicate keys: first position, last value, whatever the block.
        ["a: 1\nb: 2\na: 3\n", "a: x\nb: y\na: z\n", "b: 1\na: 2\nb: 3\n"],
        ["a:\n  x: 1\nb: 2\na: 3\n", "a:\n  y: 1\nb: 2\nb: 3\n", "k:\n  k: 1\nk: 2\n"],
        ["a: 1\na:\n  x: 1\n", "a: 1\nb:\n  x: 1\n", "b: 1\nb:\n  b: 2\n"],
        ["a:\n- x: 1\n  x: 2\n- 3\n", "a:\n- y: 1\n  z: 2\n- 3\n", "a:\n- a: {}\n  a: []\n- 3\n"],
        # Empty containers are new each time; blank and comment lines count as shapes.
        ["a: {}\nb: []\n", "a: []\nb: {}\n", "a: {}\nb: {}\n", "a: {}\n\nb: []\n"],
        ["# c\na:\n\n  b: 1\n", "# d\na:\n\n  c: 2\n", "#\nb:\n\n  b: x\n"],
        # A key whose block never comes is null; a marker with a comment.
        ["--- # x\na:\nb: 1\n", "--- # y\nc:\nd: 2\n", "---\na:\nb: 1\n"],
        # Declined shapes stay declined.
        ["a: 1\n b: 2\n", "c: 3\n d: 4\n"],
        ["- a\n- b\n", "- c\n- d\n"],
    ],
)
def test_compiled_shapes_on_tricky_streams(texts: list[str]) -> None:
    for text, got in zip(texts, _read_often(texts), strict=True):
        expected = _pyyaml(text)
        assert got is None or (expected is not None and strict(got, expected)), text
        assert strict(got, subset._read_subset(text, {})), text


def test_compiled_programs_build_new_containers_every_time() -> None:
    """The judge may keep what it is given: no two documents may share a ``{}``."""
    text = "a: {}\nb: {}\nc: []\nd:\n- {}\n"
    first, second = _read_often([text, text])
    assert first is not None and second is not None
    one, two = first[0], second[0]
    assert strict(one, two)
    containers = [one["a"], one["b"], one["c"], one["d"], one["d"][0]]
    containers += [two["a"], two["b"], two["c"], two["d"], two["d"][0]]
    assert len({id(c) for c in containers}) == len(containers)


@pytest.mark.parametrize(
    "text",
    ["a: b\tc\n", "a: b\x7f\n", "a: \xe9\n", "# \xe9\na: 1\n", "a: 1\r\n", "--- # \xe9\na: 1\n"],
)
def test_characters_outside_the_subset_are_declined(text: str) -> None:
    """Tabs, CR, DEL and non-ASCII text go to PyYAML, even where the reader would agree."""
    assert subset._read_subset(text, {}) is None
    assert _read_often([text]) == [None]


def test_joined_resolver_rules_name_the_rule_that_matched() -> None:
    """``_one_rule`` numbers rules past the groups inside earlier ones (PyYAML's have none)."""
    rules = [
        ("a", re.compile(r"(x)(y)?z$")),
        ("b", re.compile(r"x(y)+$")),
        ("c", re.compile(r"x(?:q|(r))")),
        ("d", re.compile(r"x.*")),
    ]
    pattern, tags = decode._one_rule(rules)
    for text in ["xz", "xyz", "xy", "xyy", "xq", "xr", "xs", "q", ""]:
        match = pattern.match(text)
        expected = next((tag for tag, regexp in rules if regexp.match(text)), None)
        assert (None if match is None else tags[match.lastindex]) == expected, text


def test_deep_documents_are_not_compiled() -> None:
    depth = subset._MAX_COMPILED_DEPTH + 5
    text = "".join(f"{'  ' * i}k{i}:\n" for i in range(depth)) + f"{'  ' * depth}v: 1\n"
    assert strict(_read_often([text])[0], _pyyaml(text))


# -- what ``_compile`` writes --------------------------------------------------------------

_TARGET = r"(?:_|\(_, _, _, k\d+, v\d+\))"
_PROGRAM = re.compile(
    rf"def build\(r\):\n    {_TARGET}(?:, {_TARGET})*, = r\n"
    r"    return [{}\[\]:, kv0-9]*(?:None[{}\[\]:, kv0-9]*)*\n"
)
"""The only sources ``_compile`` may write: see ``proxy.k8s.subset``'s docstring."""


def _programs(monkeypatch: pytest.MonkeyPatch, texts: list[str]) -> list[str]:
    """The sources ``_compile`` writes while ``_read_often`` reads ``texts``."""
    sources: list[str] = []

    def spy(source: str, namespace: dict[str, Any]) -> None:
        sources.append(source)
        exec(source, namespace)

    monkeypatch.setattr(subset, "exec", spy, raising=False)
    for text, got in zip(texts, _read_often(texts), strict=True):
        assert got is not None and strict(got, _pyyaml(text)), text
    return sources


def test_the_docstring_shows_what_compile_writes(monkeypatch: pytest.MonkeyPatch) -> None:
    text = (
        "kind: Service\nmetadata:\n  name: web\n  labels: {}\nspec:\n  ports:\n"
        "  - port: 80\n    protocol: TCP\n  - 8080\n"
    )
    [source] = _programs(monkeypatch, [text])
    returned = "return {k0: v0, k1: {k2: v2, k3: {}}, k4: {k5: [{k6: v6, k7: v7}, v8]}}"
    unpack = ", ".join(f"(_, _, _, k{i}, v{i})" for i in range(9))
    assert source == f"def build(r):\n    {unpack}, _, = r\n    {returned}\n"
    assert returned in (subset.__doc__ or "") and _PROGRAM.fullmatch(source)


def test_no_text_of_a_document_reaches_a_program(monkeypatch: pytest.MonkeyPatch) -> None:
    """Keys and values that would be code, or names of the program, if they were pasted
    into it: each program is only generated names and brackets, and reads them as data."""
    hostile = [
        "__import__('os').system('id')", "'); import os #", '"}]: v0, **{"x', "k0", "v1",
        "r", "_", "build", "None", "exec(r)", "a)(b", "lambda: 0",
    ]  # fmt: skip
    texts = []
    for word in hostile:
        quoted = "'" + word.replace("'", "''") + "'"
        texts.append(
            f"{quoted}: {quoted}\nk0:\n  {quoted}:\n  - {quoted}\n  - {quoted}: {quoted}\n"
            f"v1: {{}}\nr: []\n"
        )
    sources = _programs(monkeypatch, texts)
    assert len(sources) == 1  # One shape: compiled once, then reused for every word.
    assert _PROGRAM.fullmatch(sources[0]), sources[0]
    # Names alike (``k0``, ``r``, ``None``) are the program's own, as ``_PROGRAM`` says.
    assert not any(word in sources[0] for word in hostile if not word.isidentifier())


_READER_PROBE = """
from proxy.k8s import StateParser, subset
parser = StateParser()
parser.parse("kind: Node\\nmetadata:\\n  name: a\\n---\\nkind: Node\\nmetadata:\\n  name: b\\n")
print(subset.FAST_YAML, parser.last.subset, parser.last.pyyaml)
"""


@pytest.mark.parametrize(
    ("value", "expected"),
    [(None, "True 2 0"), ("", "True 2 0"), ("0", "True 2 0"), ("1", "False 0 2")],
)
def test_kpx_no_fast_yaml_sends_every_chunk_to_pyyaml(value: str | None, expected: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "KPX_NO_FAST_YAML"}
    if value is not None:
        env["KPX_NO_FAST_YAML"] = value
    child = subprocess.run(
        [sys.executable, "-c", _READER_PROBE],
        cwd=Path(__file__).resolve().parents[2], env=env, capture_output=True, text=True,
        timeout=60, check=True,
    )  # fmt: skip
    assert child.stdout.split("\n")[0] == expected


def test_use_fast_yaml_switches_the_reader_and_says_what_it_was() -> None:
    text = "kind: Node\nmetadata:\n  name: a\n"
    was = subset.use_fast_yaml(False)
    try:
        parser = k8s.StateParser()
        off = parser.parse(text)
        assert (parser.last.subset, parser.last.pyyaml) == (0, 1)
        assert subset.use_fast_yaml(True) is False
        on = k8s.StateParser().parse(text)
        assert strict(on, off)
    finally:
        subset.use_fast_yaml(was)


# -- the quick judges ----------------------------------------------------------------------

SERVICE: dict[str, Any] = {
    "apiVersion": "v1",
    "kind": "Service",
    "metadata": {"name": "web", "namespace": "shop", "labels": {"app": "web"}},
    "spec": {
        "type": "NodePort",
        "clusterIP": "10.96.0.10",
        "externalTrafficPolicy": "Cluster",
        "selector": {"app": "web"},
        "ports": [
            {"name": "http", "protocol": "TCP", "port": 80, "targetPort": 8080, "nodePort": 30080},
            {"name": "dns", "protocol": "UDP", "port": 53, "targetPort": "dns", "nodePort": 30053},
        ],
    },
}
SLICE: dict[str, Any] = {
    "apiVersion": "discovery.k8s.io/v1",
    "kind": "EndpointSlice",
    "metadata": {
        "name": "web-abcde",
        "namespace": "shop",
        "labels": {"kubernetes.io/service-name": "web"},
        "annotations": {k8s.TRIGGER_TIME_ANNOTATION: "2024-05-01T10:00:00Z"},
    },
    "addressType": "IPv4",
    "endpoints": [
        {
            "addresses": ["10.1.0.2"],
            "conditions": {"ready": True, "serving": True, "terminating": False},
            "nodeName": "node-1",
            "targetRef": {"kind": "Pod", "name": "web-1"},
        },
        {"addresses": ["10.1.0.3"], "nodeName": "node-2"},
    ],
    "ports": [{"name": "http", "protocol": "TCP", "port": 8080}, {"name": "dns", "port": 53}],
}

SERVICE_PATHS = [
    ("apiVersion",), ("kind",), ("metadata",), ("metadata", "name"), ("metadata", "namespace"),
    ("metadata", "labels"), ("metadata", "labels", "app"),
    ("metadata", "labels", k8s.HEADLESS_LABEL), ("spec",), ("spec", "type"),
    ("spec", "clusterIP"), ("spec", "externalTrafficPolicy"), ("spec", "internalTrafficPolicy"),
    ("spec", "healthCheckNodePort"), ("spec", "sessionAffinity"),
    ("spec", "sessionAffinityConfig"), ("spec", "selector"), ("spec", "selector", "app"),
    ("spec", "externalIPs"), ("spec", "publishNotReadyAddresses"), ("spec", "ports"),
    ("spec", "ports", 0), ("spec", "ports", 0, "name"), ("spec", "ports", 1, "name"),
    ("spec", "ports", 0, "protocol"), ("spec", "ports", 0, "port"),
    ("spec", "ports", 1, "targetPort"), ("spec", "ports", 0, "targetPort"),
    ("spec", "ports", 0, "nodePort"), ("spec", "ports", 1, "nodePort"),
]  # fmt: skip
SLICE_PATHS = [
    ("metadata", "name"), ("metadata", "namespace"), ("metadata", "labels"),
    ("metadata", "labels", "kubernetes.io/service-name"), ("metadata", "annotations"),
    ("metadata", "annotations", k8s.TRIGGER_TIME_ANNOTATION), ("addressType",),
    ("endpoints",), ("endpoints", 0), ("endpoints", 0, "addresses"),
    ("endpoints", 0, "addresses", 0), ("endpoints", 1, "addresses", 0),
    ("endpoints", 0, "conditions"), ("endpoints", 0, "conditions", "ready"),
    ("endpoints", 0, "conditions", "serving"), ("endpoints", 1, "conditions"),
    ("endpoints", 0, "conditions", "terminating"), ("endpoints", 0, "nodeName"),
    ("endpoints", 1, "nodeName"), ("endpoints", 0, "targetRef"),
    ("endpoints", 0, "targetRef", "kind"), ("endpoints", 0, "targetRef", "name"),
    ("ports",), ("ports", 0), ("ports", 0, "name"), ("ports", 1, "name"),
    ("ports", 0, "protocol"), ("ports", 0, "port"), ("ports", 1, "port"),
]  # fmt: skip


class Text(str):
    """A ``str`` that is not exactly one: the judge must refuse it as the API would."""


DELETE = object()
VALUES = [
    DELETE, None, "", "x", "web", "None", "ClientIP", "ExternalName", "LoadBalancer", "NodePort",
    "ClusterIP", "Local", "Cluster", "TCP", "UDP", "SCTP", "tcp", "IPv4", "IPv6", "FQDN", "Pod",
    "http", "10.1.0.9", "10.1.0.09", "2024-05-01T10:00:00", "2024-05-01 10:00:00+02:00",
    "tomorrow", datetime(2024, 5, 1, tzinfo=UTC), 0, 1, -1, 53, 80, 30080, 65535, 65536,
    True, False, 1.5, [], {}, ["10.1.0.9"], [1], {"a": "b"}, {"a": 1}, {1: "a"},
    {"ready": None}, {"ready": 1}, {"kind": "Pod", "name": 7},
    {"name": "http", "port": 80}, Text("web"), Text("TCP"), Text("None"), Text("IPv4"),
]  # fmt: skip


def _mutate(doc: dict[str, Any], path: tuple[object, ...], value: object) -> None:
    parent: Any = doc
    for step in path[:-1]:
        try:
            parent = parent[step]
        except (KeyError, IndexError, TypeError):
            return
    last = path[-1]
    if type(parent) is dict:
        if value is DELETE:
            parent.pop(last, None)
        else:
            parent[last] = copy.deepcopy(value)
    elif type(parent) is list and type(last) is int and last < len(parent):
        if value is DELETE:
            del parent[last]
        else:
            parent[last] = copy.deepcopy(value)


def _full_verdict(doc: object) -> fields._Verdict:
    """The verdict with the quick judges switched off."""
    with (
        mock.patch.object(fields, "_quick_service", lambda doc: None),
        mock.patch.object(fields, "_quick_slice", lambda doc, interned: None),
    ):
        return fields._judge(doc)


def _check(doc: object) -> None:
    full = _full_verdict(doc)
    assert strict(fields._judge(doc), full), doc
    assert strict(fields._judge(doc, {}), full), doc
    # Interned objects from an earlier, equal-looking document must not leak in.
    interned: fields._Interned = {}
    fields._judge(SLICE, interned)
    assert strict(fields._judge(doc, interned), full), doc
    # The same inside a List, where the quick judges run for items.
    listed = {"kind": "List", "items": [doc, SLICE]}
    assert strict(fields._judge(listed), _full_verdict(listed)), doc


@pytest.mark.parametrize(("base", "paths"), [(SERVICE, SERVICE_PATHS), (SLICE, SLICE_PATHS)])
def test_every_single_edit(base: dict[str, Any], paths: list[tuple[object, ...]]) -> None:
    """Each field set to each value (or removed) on its own: every way to be a little off."""
    for path in paths:
        for value in VALUES:
            doc = copy.deepcopy(base)
            _mutate(doc, path, value)
            _check(doc)


mutations = st.lists(st.tuples(st.integers(0, 10**6), st.sampled_from(VALUES)), max_size=3)


@pytest.mark.parametrize(("base", "paths"), [(SERVICE, SERVICE_PATHS), (SLICE, SLICE_PATHS)],
                         ids=["service", "slice"])
@given(edits=mutations)
def test_quick_judge_is_the_full_judge(
    base: dict[str, Any], paths: list[tuple[object, ...]], edits: list[tuple[int, object]]
) -> None:
    doc = copy.deepcopy(base)
    for at, value in edits:
        _mutate(doc, paths[at % len(paths)], value)
    _check(doc)


def test_the_plain_documents_take_the_quick_paths() -> None:
    """The fixtures above are plain: the tests would prove nothing if they fell back."""
    assert fields._quick_service(SERVICE) is not None
    assert fields._quick_slice(SLICE, {}) is not None
    _check(SERVICE)
    _check(SLICE)


def test_quick_paths_on_a_generated_state(make_state: Any) -> None:
    for item in make_state(40, 3, 3)["items"]:
        _check(item)
