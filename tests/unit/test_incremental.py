"""Incremental parsing and planning give the answers of a whole parse, and only redo what changed.

The yardstick is ``k8s._parse_whole``: PyYAML decoding the whole stream at
once, then the same judging. ``StateParser`` (chunks, a cache, the block
subset reader, JSON) must give an equal Snapshot or the very same problems,
in the same order, for every stream; ``PlanCache`` must give the table an
uncached ``build_plans`` gives. Work is checked by counting what went
through a decoder (``StateParser.last``), never by timing.
"""

from __future__ import annotations

import json
import logging
import random
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from proxy import k8s
from proxy.core.decision import PlanCache, build_plans
from proxy.core.model import Endpoint, EndpointPort, EndpointSlice, Service, ServicePort, Snapshot
from proxy.k8s import StateError, StateParser, decode, parse_state, subset
from proxy.sources.hub import StateHub
from proxy.sources.statefile import StateFileSource

Outcome = Snapshot | list[str]

pytestmark = pytest.mark.usefixtures("yaml_reader")
"""Every test runs over both YAML readers: the fast subset reader, and PyYAML alone."""


def outcome(parse: Callable[[str, int], Snapshot], text: str, generation: int = 0) -> Outcome:
    try:
        return parse(text, generation)
    except StateError as err:
        return err.problems


def whole(text: str, generation: int = 0) -> Outcome:
    return outcome(k8s._parse_whole, text, generation)


def documents(items: list[dict[str, Any]]) -> list[str]:
    return [yaml.safe_dump(item, default_flow_style=False) for item in items]


def stream(docs: list[str], lead: str = "", marker: str = "---\n") -> str:
    return lead + "".join(marker + doc for doc in docs)


@pytest.fixture
def docs(make_state: Callable[[int, int, int], dict[str, Any]]) -> list[str]:
    """40 services with one slice each and 3 nodes, one object per document."""
    return documents(make_state(40, 3, 3)["items"])


def fresh(count: int) -> tuple[int, int]:
    """``ParseStats`` ``(subset, pyyaml)`` of a parse that decoded ``count`` chunks of the block
    subset: all by the fast reader, or all by PyYAML when that is off (``yaml_reader``)."""
    return (count, 0) if subset.FAST_YAML else (0, count)


def strictly_equal(a: object, b: object) -> bool:
    """``==`` that also tells ``True`` from ``1`` and ``1.0``, and minds key order."""
    if type(a) is not type(b):
        return False
    if type(a) is dict:
        assert isinstance(b, dict)
        return (
            list(map(type, a)) == list(map(type, b))
            and list(a) == list(b)
            and all(strictly_equal(a[k], b[k]) for k in a)
        )
    if type(a) is list:
        assert isinstance(b, list)
        return len(a) == len(b) and all(map(strictly_equal, a, b))
    if type(a) is float and a != a:
        return b != b
    return a == b


# -- the same answers ---------------------------------------------------------------------


def _flip(r: random.Random, docs: list[str]) -> None:
    i = r.randrange(len(docs))
    for old, new in (
        ("ready: true", "ready: false"),
        ("ready: false", "ready: true"),
        ("terminating: false", "terminating: true"),
        ("port: 8080", "port: 8081"),
    ):
        if old in docs[i]:
            docs[i] = docs[i].replace(old, new, 1)
            return


def _remove(r: random.Random, docs: list[str]) -> None:
    if len(docs) > 3:
        del docs[r.randrange(len(docs))]


def _move(r: random.Random, docs: list[str]) -> None:
    docs.insert(r.randrange(len(docs)), docs.pop(r.randrange(len(docs))))


def _duplicate(r: random.Random, docs: list[str]) -> None:
    docs.insert(r.randrange(len(docs) + 1), docs[r.randrange(len(docs))])


def _break_syntax(r: random.Random, docs: list[str]) -> None:
    i = r.randrange(len(docs))
    j = r.randrange(len(docs[i]) + 1)
    bad = r.choice(["{", "'", ": x: y", "\n  - ", "\t", '"', "[", "*alias", "!!binary x", "- "])
    docs[i] = docs[i][:j] + bad + docs[i][j:]


def _invalidate(r: random.Random, docs: list[str]) -> None:
    i = r.randrange(len(docs))
    for old, new in (
        ("nodePort: 3", "nodePort: 7"),
        ("name: svc", "name: 7\n  x: svc"),
        ("kind: Service", "kind: 5"),
        ("metadata:", "metadata: 5\nx:"),
        ("addresses:\n", "addresses: []\n  x:\n"),
    ):
        if old in docs[i]:
            docs[i] = docs[i].replace(old, new, 1)
            return


def _insert_odd(r: random.Random, docs: list[str]) -> None:
    docs.insert(
        r.randrange(len(docs) + 1),
        r.choice(["", "# a comment\n", "{}\n", "[1, 2]\n", "text\n", "kind: ConfigMap\n"]),
    )


def _unusual(r: random.Random, docs: list[str]) -> None:
    i = r.randrange(len(docs))
    docs[i] = r.choice(
        [
            docs[i].replace("\n", "\r\n"),
            docs[i] + "...\n",
            "%YAML 1.1\n---\n" + docs[i],
            docs[i].replace("\n", "\r", 1),
            docs[i].replace("\n", "\u2028", 1),
            docs[i] + "\x01",
            docs[i].replace("name: ", "name: é", 1),
            docs[i].replace("name: ", "name: \ufeff", 1),
        ]
    )


BENIGN = [_flip, _flip, _flip, _remove, _move]
BROKEN = [_duplicate, _break_syntax, _invalidate, _insert_odd, _unusual]


@pytest.mark.parametrize("seed", range(4))
def test_random_edits_give_what_a_whole_parse_gives(
    make_state: Callable[[int, int, int], dict[str, Any]], seed: int
) -> None:
    """Good edits persist; broken ones (errors, fallbacks) come and go, as a user's would."""
    r = random.Random(seed)
    parser = StateParser()
    base = documents(make_state(r.randrange(6, 20), 2, 3)["items"])
    modes = set()
    for step in range(60):
        if r.random() < 0.6:
            r.choice(BENIGN)(r, base)
            docs = list(base)
        else:
            docs = list(base)
            for _ in range(r.randrange(1, 3)):
                r.choice(BROKEN)(r, docs)
        text = stream(
            docs,
            lead=r.choice(["", "# header\n", "\n"]),
            marker=r.choice(["---\n", "--- \n", "--- # next\n"]),
        ) + r.choice(["", "---\n"])
        got = outcome(parser.parse, text, step)
        assert got == whole(text, step), f"step {step}: {parser.last}"
        assert got == outcome(parse_state, text, step)
        modes.add((parser.last.mode, type(got) is Snapshot))
    assert {("chunks", True), ("chunks", False)} <= modes


def test_generation_and_empty_streams() -> None:
    parser = StateParser()
    for text in ("", "\n", "# nothing\n", "---\n", "---\n---\n# c\n", "---"):
        # Nothing in any document (an empty file, a failed write) is refused, by both roads.
        assert outcome(parser.parse, text, 3) == [k8s.NO_DOCUMENTS] == whole(text, 3)
    for text in ("kind: List\nitems: []\n", "---\nkind: List\n---\n", "# c\n---\nkind: List\n"):
        assert parser.parse(text, 3) == Snapshot(generation=3) == whole(text, 3)


# -- only what changed is decoded, and the rest keeps its objects --------------------------


def test_one_changed_document_is_the_only_one_decoded(docs: list[str]) -> None:
    parser = StateParser()
    before = parser.parse(stream(docs), 1)
    assert parser.last.chunks == len(docs)
    assert (parser.last.subset, parser.last.pyyaml) == fresh(len(docs))

    edited = docs.index(next(d for d in docs if "svc-7-" in d))
    docs[edited] = docs[edited].replace("ready: true", "ready: false", 1)
    after = parser.parse(stream(docs), 2)

    assert (parser.last.subset, parser.last.pyyaml) == fresh(1)
    assert parser.last.reused == len(docs) - 1
    assert after == whole(stream(docs), 2)
    changed = [sl for sl, old in zip(after.slices, before.slices, strict=True) if sl is not old]
    assert [sl.name for sl in changed] == ["svc-7-abcde"]
    assert changed[0].endpoints[0].ready is False
    assert all(a is b for a, b in zip(after.services, before.services, strict=True))
    assert all(a is b for a, b in zip(after.nodes, before.nodes, strict=True))


def test_the_same_text_again_decodes_nothing(docs: list[str]) -> None:
    parser = StateParser()
    first = parser.parse(stream(docs))
    again = parser.parse(stream(docs))
    assert (parser.last.subset, parser.last.pyyaml, parser.last.reused) == (0, 0, len(docs))
    assert all(a is b for a, b in zip(again.slices, first.slices, strict=True))


def test_moved_and_duplicated_documents_are_found_by_their_text(docs: list[str]) -> None:
    parser = StateParser()
    first = parser.parse(stream(docs))
    docs.reverse()
    moved = parser.parse(stream(docs))
    assert (parser.last.subset, parser.last.pyyaml) == (0, 0)
    assert moved == whole(stream(docs))
    assert {id(s) for s in moved.services} == {id(s) for s in first.services}


def test_inserting_and_removing_documents_shifts_nothing_else(docs: list[str]) -> None:
    parser = StateParser()
    parser.parse(stream(docs))
    extra = docs[5].replace("svc-", "extra-").replace("nodePort: 3", "nodePort: 4")
    # Each edit is one document away from the one before: inserted, removed, inserted.
    for edited, decoded in (
        ([*docs[:10], extra, *docs[10:]], 1),
        (docs[:10] + docs[11:], 0),
        ([extra, *docs[:10], *docs[11:]], 1),
        ([*docs[:10], *docs[11:], docs[10]], 1),
    ):
        assert parser.parse(stream(edited)) == whole(stream(edited))
        assert parser.last.subset + parser.last.pyyaml == decoded


def test_documents_outside_the_subset_go_to_pyyaml(docs: list[str]) -> None:
    parser = StateParser()
    parser.parse(stream(docs))
    # A flow mapping: valid YAML that the subset reader declines.
    docs[4] = docs[4].replace("metadata:\n", "metadata:\n  annotations: {note: flow}\n")
    assert parser.parse(stream(docs)) == whole(stream(docs))
    assert (parser.last.subset, parser.last.pyyaml) == (0, 1)


def test_kubectl_style_documents_need_no_pyyaml(
    make_state: Callable[[int, int, int], dict[str, Any]],
) -> None:
    """What kubectl, ``yaml.safe_dump`` and the bench templates print stays on the fast path
    (with it off, all of it goes to PyYAML)."""
    items = make_state(30, 3, 4)["items"]
    bench_style = (
        "apiVersion: v1\nkind: Service\nmetadata:\n  name: web\n  namespace: bench\n"
        "spec:\n  type: NodePort\n  clusterIP: 10.96.0.10\n  externalTrafficPolicy: Cluster\n"
        "  selector:\n    app: web\n  ports:\n  - name: http\n    protocol: TCP\n    port: 80\n"
        "    targetPort: 8080\n    nodePort: 20000\n"
    )
    texts = [
        stream(documents(items)),
        yaml.safe_dump_all(items, sort_keys=False),
        yaml.safe_dump({"apiVersion": "v1", "kind": "List", "items": items}),
        "---\n" + bench_style,
    ]
    for text in texts:
        parser = StateParser()
        assert parser.parse(text) == whole(text)
        assert (parser.last.subset, parser.last.pyyaml) == fresh(parser.last.chunks)


# -- errors ---------------------------------------------------------------------------------


def test_a_syntax_error_names_its_line_in_the_whole_file(docs: list[str]) -> None:
    parser = StateParser()
    good = stream(docs)
    parser.parse(good)
    broken = docs[30].replace("  name: svc-", "  name: {svc-", 1)
    text = stream([*docs[:30], broken, *docs[31:]])

    problems = outcome(parser.parse, text)
    assert problems == whole(text)
    assert isinstance(problems, list) and len(problems) == 1
    assert problems[0].startswith("YAML syntax error at line ")
    line = int(re.search(r"line (\d+)", problems[0]).group(1))  # type: ignore[union-attr]
    assert line > len(stream(docs[:30]).splitlines())  # Counted from the top of the file.

    # The broken text left the cache alone: the good text again decodes nothing.
    assert parser.parse(good) == whole(good)
    assert (parser.last.subset, parser.last.pyyaml) == (0, 0)


def test_a_quoted_scalar_cut_by_a_marker_fails_as_in_the_whole_stream() -> None:
    text = "kind: Node\nmetadata:\n  name: 'a\n---\nb'\n"
    problems = outcome(StateParser().parse, text)
    assert problems == whole(text)
    assert "found unexpected document indicator" in problems[0]


def test_errors_in_a_changed_document_refuse_the_whole_file(docs: list[str]) -> None:
    parser = StateParser()
    parser.parse(stream(docs))
    svc = next(i for i, d in enumerate(docs) if "name: svc-3\n" in d and "kind: Service" in d)
    docs[svc] = docs[svc].replace("port: 80\n", "port: 80000\n", 1)
    with pytest.raises(StateError) as info:
        parser.parse(stream(docs))
    assert info.value.problems == whole(stream(docs))
    assert info.value.problems == [
        "Service ns-3/svc-3: spec.ports[0].port: 80000 is out of range 1-65535"
    ]
    docs[svc] = docs[svc].replace("port: 80000\n", "port: 80\n", 1)
    assert parser.parse(stream(docs)) == whole(stream(docs))
    assert (parser.last.subset, parser.last.pyyaml) == fresh(1)


def test_problems_name_documents_where_they_are_now() -> None:
    """A cached verdict is reused when its document moves, but its problem is renumbered."""
    node = "apiVersion: v1\nkind: Node\nmetadata:\n  name: node-{}\n"
    nameless = "apiVersion: v1\nkind: Service\nmetadata: {}\nspec: {}\n"
    parser = StateParser()
    docs = [node.format(1), nameless, node.format(2)]
    assert outcome(parser.parse, stream(docs)) == [
        "Service <unnamed> (document 2): metadata.name: required"
    ]
    docs.insert(0, node.format(0))
    assert outcome(parser.parse, stream(docs)) == [
        "Service <unnamed> (document 3): metadata.name: required"
    ]
    assert parser.last.reused == 3


def test_checks_across_documents_are_rerun(docs: list[str]) -> None:
    parser = StateParser()
    parser.parse(stream(docs))
    svc = next(i for i, d in enumerate(docs) if "name: svc-3\n" in d and "kind: Service" in d)
    clash = docs[svc].replace("name: svc-3\n", "name: svc-3b\n").replace("/svc-3\n", "/svc-3b\n")
    for text in (
        stream([*docs, docs[svc]]),  # The same Service twice.
        stream([*docs, clash]),  # Another Service on svc-3's nodePort.
    ):
        problems = outcome(parser.parse, text)
        assert problems == whole(text)
        assert isinstance(problems, list)
    assert outcome(parser.parse, stream([*docs, docs[svc]]))[0] == (
        f"Service ns-3/svc-3: metadata.name: duplicate Service "
        f"(in document {svc + 1} and document {len(docs) + 1})"
    )


def test_a_slice_links_to_a_service_that_arrives_later(docs: list[str]) -> None:
    parser = StateParser()
    svc = next(i for i, d in enumerate(docs) if "name: svc-3\n" in d and "kind: Service" in d)
    without = parser.parse(stream(docs[:svc] + docs[svc + 1 :]))
    assert "ns-3/svc-3" not in {sl.service_key for sl in without.slices}
    with_it = parser.parse(stream(docs))
    assert with_it == whole(stream(docs))
    assert (parser.last.subset, parser.last.pyyaml) == fresh(1)
    assert "ns-3/svc-3" in {sl.service_key for sl in with_it.slices}


# -- where the stream is cut --------------------------------------------------------------


@pytest.mark.parametrize(
    "text",
    [
        # A marker-like line inside a block scalar or a quoted scalar, indented.
        "kind: Node\nmetadata:\n  name: a\n  annotations:\n    note: |\n      ---\n      x\n",
        "kind: Node\nmetadata:\n  name: a\n  annotations:\n    note: 'one\n      ---\n      two'\n",
        "kind: Node\nmetadata:\n  name: a\n  annotations:\n    note: one\n      --- two\n",
        # Not markers: more dashes, or text right after them.
        "kind: Node\nmetadata:\n  name: a\n----\n",
        "kind: Node\nmetadata:\n  name: a\n---x\n",
    ],
)
def test_marker_lines_inside_content_do_not_cut(text: str) -> None:
    parser = StateParser()
    assert outcome(parser.parse, text) == whole(text)
    if parser.last.chunks:
        assert parser.last.chunks == 1


@pytest.mark.parametrize(
    "marker", ["---\n", "--- \n", "---\t\n", "--- # comment\n", "---   #\n", "---\r\n"]
)
def test_every_marker_line_cuts(marker: str) -> None:
    node = "apiVersion: v1\nkind: Node\nmetadata:\n  name: node-{}\n"
    text = node.format(0) + marker + node.format(1) + marker + node.format(2)
    parser = StateParser()
    assert outcome(parser.parse, text) == whole(text)
    assert parser.last.mode == "chunks" and parser.last.chunks == 3


@pytest.mark.parametrize(
    "text",
    [
        "kind: Node\nmetadata: {name: a}\n...\n---\nkind: Node\nmetadata: {name: b}\n",
        "%YAML 1.1\n---\nkind: Node\nmetadata: {name: a}\n",
        "%TAG !k! tag:example.com,2000:\n---\nkind: Node\nmetadata: {name: a}\n",
        "kind: Node\rmetadata: {name: a}\r---\rkind: Node\rmetadata: {name: b}\r",
        "kind: Node\nmetadata: {name: a}\x85---\nkind: Node\nmetadata: {name: b}\n",
        "kind: Node\nmetadata: {name: a}\u2028---\nkind: Node\nmetadata: {name: b}\n",
        "kind: Node\nmetadata: {name: a}\n---\n\ufeffkind: Node\nmetadata: {name: b}\n",
        "kind: Node\nmetadata: {name: a}\n---\nkind: Node\nmetadata: {name: \x01b}\n",
    ],
    ids=["document-end", "yaml-directive", "tag-directive", "cr", "nel", "ls", "bom", "control"],
)
def test_unusual_streams_are_decoded_whole(text: str) -> None:
    parser = StateParser()
    assert outcome(parser.parse, text) == whole(text)
    assert parser.last.mode == "whole"


def test_a_leading_byte_order_mark_is_fine() -> None:
    text = "\ufeffkind: Node\nmetadata: {name: a}\n---\nkind: Node\nmetadata: {name: b}\n"
    parser = StateParser()
    assert outcome(parser.parse, text) == whole(text)
    assert parser.last.mode == "chunks"


def test_a_syntax_error_after_an_unreadable_character_is_reported_as_pyyaml_would() -> None:
    text = "kind: Node\nmetadata: {name: 'a}\n---\nkind: Node\nmetadata: {name: \x01}\n"
    assert outcome(StateParser().parse, text) == whole(text)


# -- JSON ---------------------------------------------------------------------------------


@pytest.mark.parametrize("indent", [None, 2])
def test_kubectl_json_is_read_as_json(
    make_state: Callable[[int, int, int], dict[str, Any]], indent: int | None
) -> None:
    state = make_state(30, 3, 4)
    parser = StateParser()
    snap = parser.parse(json.dumps(state, indent=indent), 5)
    assert parser.last.mode == "json"
    assert snap == whole(yaml.safe_dump(state), 5)


@pytest.mark.parametrize(
    "number", ["1e3", "1.5E+4", "1.5e3", "-0", "2.0", "NaN", "-Infinity", "12345678901234567890"]
)
def test_json_numbers_mean_what_they_mean_to_pyyaml(number: str) -> None:
    text = (
        '{"kind": "List", "items": [{"apiVersion": "v1", "kind": "Service", '
        '"metadata": {"name": "web"}, "spec": {"type": "NodePort", '
        f'"ports": [{{"port": {number}, "nodePort": 30080}}]}}}}]}}'
    )
    parser = StateParser()
    assert outcome(parser.parse, text) == whole(text)
    assert parser.last.mode == "json"


@pytest.mark.parametrize(
    "text",
    [
        '{"kind":\t"List", "items": []}',
        '{"kind": "Node", "metadata": {"name": "\\ud83d\\ude00"}}',
        '{"kind": "Node", "metadata": {"name": "a\u2028b"}}',
        '{"kind": "Node", "metadata": {"name": "a\x7fb"}}',
        '{"kind": "List", "items": [],}',
        "{kind: List, items: []}",
        '{"kind": "List", "items": []}\n# end\n',
        '{"kind": "List", "items": [}',
    ],
    ids=["tab", "surrogates", "line-separator", "delete", "comma", "yaml-flow", "comment", "bad"],
)
def test_json_lookalikes_are_judged_by_pyyaml(text: str) -> None:
    parser = StateParser()
    assert outcome(parser.parse, text) == whole(text)
    assert parser.last.mode != "json"


# -- the block-subset reader --------------------------------------------------------------

TRICKY = [
    "a", "yes", "No", "on", "OFF", "y", "true", "TRUE", "null", "~", "", " ", "0", "-1", "+1",
    "0o17", "017", "0x1F", "0b101", "1_000", "1:20", "190:20:30", "1.5", ".5", "1.", "1e3",
    "1.0e+3", ".inf", "-.inf", ".nan", "2024-05-01", "2024-05-01T10:00:00Z",
    "2001-12-14 21:59:43.10 -5", "=", "<<", "a: b", "a:b", "a #b", "a#b", "#a", "- a", "-a",
    "-", "---", "...", "'q'", '"q"', "it's", 'say "hi"', "a  b", " lead", "trail ", "x:", ":x",
    "?x", "@x", "%x", "&x", "*x", "!x", "|", ">", "{}", "[]", "{a: 1}", "a,b", "http://x:80/y",
    "10.0.0.1", "\\", "é", "a\tb", "a\nb",
]  # fmt: skip
KEYS = ["a", "kind", "kubernetes.io/service-name", "f:spec", ".", "yes", "1", "~", "a b", "-a"]

scalars = st.sampled_from(TRICKY) | st.integers() | st.booleans() | st.none() | st.floats()
trees = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(KEYS), inner),
    max_leaves=10,
)


@given(
    tree=st.dictionaries(st.sampled_from(KEYS), trees, min_size=1, max_size=4),
    flow=st.sampled_from([False, None]),
    indent=st.sampled_from([2, 4]),
    width=st.sampled_from([20, 80]),
    edit=st.tuples(st.integers(0, 10**6), st.sampled_from(["", " ", "  ", "\n", "- ", ":", "#"])),
)
def test_the_subset_reader_agrees_with_pyyaml_or_declines(
    tree: dict[str, Any], flow: bool | None, indent: int, width: int, edit: tuple[int, str]
) -> None:
    text = yaml.safe_dump(tree, default_flow_style=flow, indent=indent, width=width)
    at, insert = edit
    at %= len(text) + 1
    text = text[:at] + insert + text[at:]
    try:
        expected: list[object] | None = list(yaml.load_all(text, Loader=decode._LOADER))
    except (yaml.YAMLError, ValueError):
        expected = None
    got = subset._read_subset(text, {})
    if got is not None:
        assert expected is not None and strictly_equal(got, expected), text


def test_the_subset_reader_on_tricky_scalars() -> None:
    for value in TRICKY:
        for shape in ("key: {}\n", "key:\n- {}\n", "{}: x\n", "- {}\n", "a:\n  {}: {}\n"):
            text = shape.format(value, value)
            try:
                expected: list[object] | None = list(yaml.load_all(text, Loader=decode._LOADER))
            except yaml.YAMLError:
                expected = None
            got = subset._read_subset(text, {})
            assert got is None or (expected is not None and strictly_equal(got, expected)), text


# -- plans ----------------------------------------------------------------------------------


def test_plan_cache_gives_the_uncached_table_across_edits(
    make_state: Callable[[int, int, int], dict[str, Any]],
) -> None:
    r = random.Random(7)
    docs = documents(make_state(30, 3, 3)["items"])
    parser, cache = StateParser(), PlanCache()
    for _ in range(40):
        r.choice([_flip, _flip, _move, _remove])(r, docs)
        snap = parser.parse(stream(docs))
        for node in ("node-0", "node-1"):
            cached = build_plans(snap, node, masquerade_all=False, cache=cache)
            plain = build_plans(snap, node, masquerade_all=False)
            assert cached == plain and list(cached) == list(plain)


def test_plan_cache_reuses_plans_of_unchanged_services(docs: list[str]) -> None:
    parser, cache = StateParser(), PlanCache()
    first = build_plans(parser.parse(stream(docs)), "node-1", cache=cache)
    assert cache.built == len(first)
    edited = docs.index(next(d for d in docs if "svc-7-" in d))
    docs[edited] = docs[edited].replace("ready: true", "ready: false", 1)
    second = build_plans(parser.parse(stream(docs)), "node-1", cache=cache)
    assert (cache.built, cache.reused) == (1, len(first) - 1)
    assert [port for port in second if second[port] is not first[port]] == [30007]
    assert second[30007] != first[30007]


def test_plan_cache_starts_afresh_for_another_node_or_masquerade(docs: list[str]) -> None:
    parser, cache = StateParser(), PlanCache()
    first = build_plans(parser.parse(stream(docs), 1), "node-1", cache=cache)
    snap = parser.parse(stream(docs), 2)  # the same text: nothing changed
    assert snap.changes.services == frozenset()
    assert build_plans(snap, "node-1", cache=cache) == first and cache.built == 0
    for node, masquerade in (("node-2", False), ("node-2", True)):
        assert build_plans(snap, node, masquerade, cache=cache) == build_plans(
            snap, node, masquerade
        )
        assert cache.built == len(first)


def test_plan_cache_rebuilds_everything_for_changes_relative_to_another_generation(
    docs: list[str],
) -> None:
    """Changes count only from the generation the cache last built: else it starts afresh."""
    parser, cache = StateParser(), PlanCache()
    build_plans(parser.parse(stream(docs), 1), "node-1", cache=cache)
    edited = docs.index(next(d for d in docs if "svc-7-" in d))
    docs[edited] = docs[edited].replace("ready: true", "ready: false", 1)
    skipped = parser.parse(stream(docs), 2)  # never built from
    docs[edited] = docs[edited].replace("ready: false", "ready: true", 1)
    third = parser.parse(stream(docs), 3)
    assert third.changes.since == skipped.generation
    assert build_plans(third, "node-1", cache=cache) == build_plans(third, "node-1")
    assert cache.built == cache.built + cache.reused, "all rebuilt, none taken on trust"


def test_plan_cache_when_services_change_too(docs: list[str]) -> None:
    """A service added or removed takes the per-service path; the rest is still reused."""
    parser, cache = StateParser(), PlanCache()
    first = build_plans(parser.parse(stream(docs), 1), "node-1", cache=cache)
    svc = next(i for i, d in enumerate(docs) if "name: svc-3\n" in d and "kind: Service" in d)
    second = build_plans(
        parser.parse(stream(docs[:svc] + docs[svc + 1 :]), 2), "node-1", cache=cache
    )
    assert 30003 not in second and cache.built == 0
    assert all(second[port] is first[port] for port in second)


def test_plan_cache_with_snapshots_the_parser_never_makes() -> None:
    """Two services under one key, and a caller that changes the table it got."""
    web = [
        Service("ns", "web", "NodePort", (ServicePort("http", "TCP", 80, 8080, port),))
        for port in (30080, 30081)
    ]

    def slice_(ready: bool) -> EndpointSlice:
        endpoint = Endpoint("10.0.0.1", "node-1", ready)
        return EndpointSlice("ns", "web-1", "web", (endpoint,), (EndpointPort("http", 8080),))

    cache = PlanCache()
    for ready in (True, False, True, True):
        snap = Snapshot(services=tuple(web), slices=(slice_(ready),))
        got = build_plans(snap, "node-1", cache=cache)
        assert got == build_plans(snap, "node-1") and list(got) == [30080, 30081]
        got.clear()


# -- the state file source ----------------------------------------------------------------


def test_state_file_source_reuses_objects_and_refuses_bad_files(
    tmp_path: Path, docs: list[str], caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "state.yaml"
    hub = StateHub()
    source = StateFileSource(path, hub)
    path.write_text(stream(docs))
    assert source.load()
    first = hub.snapshot
    assert first is not None and first.generation == 1

    assert source.load() and hub.snapshot is first  # Unchanged: not republished.

    edited = docs.index(next(d for d in docs if "svc-7-" in d))
    docs[edited] = docs[edited].replace("ready: true", "ready: false", 1)
    path.write_text(stream(docs))
    assert source.load()
    second = hub.snapshot
    assert second is not None and second.generation == 2
    assert all(a is b for a, b in zip(second.services, first.services, strict=True))
    assert (source.parser.last.subset, source.parser.last.pyyaml) == fresh(1)

    path.write_text(stream(docs) + "---\nkind: Service\nmetadata: {}\n")
    with caplog.at_level(logging.ERROR, logger="proxy.sources.statefile"):
        assert not source.load()
        assert not source.load()
    assert hub.snapshot is second
    assert len([r for r in caplog.records if "refused" in r.getMessage()]) == 1

    path.write_text(stream(docs))
    assert source.load() and hub.snapshot is second  # Back to what the hub holds.
    source.reload()
    assert hub.snapshot is not None and hub.snapshot.generation == 3
