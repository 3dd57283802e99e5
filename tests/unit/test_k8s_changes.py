"""``StateParser`` says what changed (``Snapshot.changes``), from what it re-decoded.

Issue 10, point 4: a parse that re-decodes some chunks reports the service
keys of every Service and EndpointSlice in the chunks that left the stream or
came into it, and whether a Node did; a parse that cannot tell reports
everything. A refused parse takes nothing, so the next good one reports its
changes too, relative to the last good generation. The yardstick is the
snapshots themselves: whatever differs between two good parses must be in
the set (the set may hold more: see ``proxy.core.changes``).
"""

from __future__ import annotations

import contextlib
import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from proxy.core.changes import EVERYTHING, Changes
from proxy.core.model import Snapshot
from proxy.k8s import StateError, StateParser, parse_file, parse_objects, parse_state

pytestmark = pytest.mark.usefixtures("yaml_reader")
"""Every test runs over both YAML readers: the fast subset reader, and PyYAML alone."""

NOTHING = frozenset[str]()


def documents(items: list[dict[str, Any]]) -> list[str]:
    return [yaml.safe_dump(item, default_flow_style=False) for item in items]


def stream(docs: list[str]) -> str:
    return "".join("---\n" + doc for doc in docs)


@pytest.fixture
def docs(make_state: Callable[[int, int, int], dict[str, Any]]) -> list[str]:
    """3 nodes, then 12 services ``ns-{i % 10}/svc-{i}``, each followed by its one slice."""
    return documents(make_state(12, 2, 3)["items"])


def where(docs: list[str], kind: str, name: str) -> int:
    return next(i for i, d in enumerate(docs) if f"kind: {kind}\n" in d and f"name: {name}\n" in d)


def changes(docs: list[str], generation: int, parser: StateParser) -> Changes:
    return parser.parse(stream(docs), generation).changes


# -- what one parse reports ---------------------------------------------------------------


def test_the_first_parse_reports_everything(docs: list[str]) -> None:
    assert StateParser().parse(stream(docs), 1).changes is EVERYTHING


def test_an_edit_of_one_slice_reports_exactly_its_service(docs: list[str]) -> None:
    parser = StateParser()
    parser.parse(stream(docs), 1)
    i = where(docs, "EndpointSlice", "svc-7-abcde")
    docs[i] = docs[i].replace("ready: true", "ready: false", 1)
    assert changes(docs, 2, parser) == Changes(1, frozenset({"ns-7/svc-7"}), nodes=False)


def test_the_same_text_again_reports_nothing(docs: list[str]) -> None:
    parser = StateParser()
    parser.parse(stream(docs), 1)
    assert changes(docs, 2, parser) == Changes(since=1, services=NOTHING, nodes=False)


def test_added_and_removed_documents_report_their_keys(docs: list[str]) -> None:
    parser = StateParser()
    parser.parse(stream(docs), 1)
    service = docs[where(docs, "Service", "svc-4")]
    extra = service.replace("svc-4", "svc-99").replace("nodePort: 30004", "nodePort: 31099")
    assert changes([*docs, extra], 2, parser) == Changes(1, frozenset({"ns-4/svc-99"}), False)
    assert changes(docs, 3, parser) == Changes(2, frozenset({"ns-4/svc-99"}), False)

    docs = [d for d in docs if "svc-5\n" not in d and "svc-5-" not in d]  # Service and slice.
    assert changes(docs, 4, parser) == Changes(3, frozenset({"ns-5/svc-5"}), False)
    del docs[where(docs, "Node", "node-1")]
    assert changes(docs, 5, parser) == Changes(4, NOTHING, True)


def test_a_service_that_turns_headless_is_reported(docs: list[str]) -> None:
    """An ignored Service is in no verdict's services: its key comes from the chunk it left."""
    parser = StateParser()
    parser.parse(stream(docs), 1)
    i = where(docs, "Service", "svc-4")
    plain = docs[i]
    docs[i] = plain.replace("clusterIP: 10.96.0.4", "clusterIP: None")
    snap = parser.parse(stream(docs), 2)
    assert snap.service("ns-4/svc-4") is None
    assert snap.changes == Changes(1, frozenset({"ns-4/svc-4"}), False)
    docs[i] = plain
    assert changes(docs, 3, parser) == Changes(2, frozenset({"ns-4/svc-4"}), False)


def test_a_slice_that_moves_to_another_service_reports_both(docs: list[str]) -> None:
    parser = StateParser()
    parser.parse(stream(docs), 1)
    i = where(docs, "EndpointSlice", "svc-2-abcde")
    docs[i] = docs[i].replace("service-name: svc-2", "service-name: svc-12", 1)
    assert changes(docs, 2, parser).services == {"ns-2/svc-2", "ns-2/svc-12"}


def test_far_apart_edits_report_only_what_they_touched(docs: list[str]) -> None:
    """Everything between two edits is re-read by its text and keeps its objects: unreported."""
    parser = StateParser()
    parser.parse(stream(docs), 1)
    docs[0] = docs[0].replace("address: 192.168.", "address: 192.169.", 1)
    docs[-1] = docs[-1].replace("ready: true", "ready: false", 1)
    assert changes(docs, 2, parser) == Changes(1, frozenset({"ns-1/svc-11"}), True)


def test_slices_of_one_service_that_swap_places_are_reported(docs: list[str]) -> None:
    """Nothing in them changed, but ``slices_for`` now gives them in the other order."""
    i = where(docs, "EndpointSlice", "svc-2-abcde")
    other = docs[i].replace("svc-2-abcde", "svc-2-fghij").replace("- 10.", "- 11.")
    docs.append(other)
    parser = StateParser()
    before = parser.parse(stream(docs), 1)
    docs.insert(i, docs.pop())
    after = parser.parse(stream(docs), 2)
    web = after.service("ns-2/svc-2")
    assert web is not None and after.slices_for(web) == before.slices_for(web)[::-1]
    assert "ns-2/svc-2" in (after.changes.services or ())


# -- refused parses, and parses that cannot tell -------------------------------------------


def test_a_refused_parse_carries_its_changes_to_the_next_good_one(docs: list[str]) -> None:
    parser = StateParser()
    parser.parse(stream(docs), 1)
    edited = where(docs, "EndpointSlice", "svc-3-abcde")
    docs[edited] = docs[edited].replace("ready: true", "ready: false", 1)
    broken = where(docs, "Service", "svc-5")
    good = docs[broken]
    docs[broken] = good.replace("port: 80\n", "port: 80000\n", 1)
    with pytest.raises(StateError):
        parser.parse(stream(docs), 2)
    syntax = [*docs[:6], docs[6] + "  x: [\n", *docs[7:]]
    with pytest.raises(StateError):
        parser.parse(stream(syntax), 2)  # Decoded nothing: the cache is left alone.
    docs[broken] = good
    assert changes(docs, 2, parser) == Changes(
        since=1, services=frozenset({"ns-3/svc-3", "ns-5/svc-5"}), nodes=False
    )


def test_a_whole_stream_decode_reports_everything_and_so_does_the_next_parse(
    docs: list[str],
) -> None:
    """After a whole-stream parse the cached chunks are older than what was returned:
    comparing with them alone would miss what that parse changed."""
    parser = StateParser()
    parser.parse(stream(docs), 1)
    i = where(docs, "EndpointSlice", "svc-3-abcde")
    unusual = list(docs)
    unusual[i] = docs[i].replace("ready: true", "ready: false", 1) + "...\n"
    snap = parser.parse(stream(unusual), 2)
    assert parser.last.mode == "whole"
    assert snap.changes == Changes(None, None, True)
    assert changes(docs, 3, parser) == Changes(None, None, True)
    assert changes(docs, 4, parser) == Changes(3, NOTHING, False)


def test_json_reports_everything_and_so_does_the_next_yaml(docs: list[str]) -> None:
    parser = StateParser()
    parser.parse(stream(docs), 1)
    items = [yaml.safe_load(d) for d in docs]
    assert parser.parse(json.dumps({"kind": "List", "items": items}), 2).changes.services is None
    assert changes(docs[:-2], 3, parser) == Changes(None, None, True)


def test_parsers_without_a_past_report_everything(docs: list[str], tmp_path: Path) -> None:
    path = tmp_path / "state.yaml"
    path.write_text(stream(docs))
    assert parse_objects([yaml.safe_load(docs[0])]).changes is EVERYTHING
    assert parse_state(stream(docs)).changes is EVERYTHING
    assert parse_file(path).changes is EVERYTHING
    assert parse_state(json.dumps(yaml.safe_load(docs[0]))).changes is EVERYTHING


# -- whatever differs is reported -------------------------------------------------------------


def _edit(r: random.Random, docs: list[str]) -> list[str]:
    """One random edit, good or bad, of a copy of ``docs``."""
    docs = list(docs)
    i = r.randrange(len(docs))
    doc = docs[i]
    edits: list[Callable[[], None]] = [
        lambda: docs.__setitem__(i, doc.replace("ready: true", "ready: false", 1)),
        lambda: docs.__setitem__(i, doc.replace("ready: false", "ready: true", 1)),
        lambda: docs.__setitem__(i, doc.replace("port: 8080", "port: 8081", 1)),
        lambda: docs.__setitem__(i, doc.replace("Local", "Cluster", 1)),
        lambda: docs.__setitem__(i, doc.replace("clusterIP: 10.", "clusterIP: None\n  x: 10.")),
        lambda: docs.__setitem__(i, doc.replace("service-name: svc-", "service-name: svc-1", 1)),
        lambda: docs.__setitem__(i, doc.replace("  name: svc-", "  name: svc-2", 1)),
        lambda: docs.__setitem__(i, doc.replace("address: 192.168.", "address: 192.169.", 1)),
        lambda: docs.__setitem__(i, doc.replace("IPv4", "IPv6", 1)),
        lambda: docs.pop(i),
        lambda: docs.insert(r.randrange(len(docs) + 1), docs.pop(i)),
        lambda: docs.insert(r.randrange(len(docs) + 1), doc),  # A duplicate: refused.
        lambda: docs.__setitem__(i, doc + "  bad: [\n"),  # A syntax error: refused.
        lambda: docs.__setitem__(i, doc + "...\n"),  # Decoded whole.
    ]
    r.choice(edits)()
    return docs


def _slices(snap: Snapshot, key: str) -> tuple[object, ...]:
    return tuple(sl for sl in snap.slices if sl.service_key == key)


def _differ(old: Snapshot, new: Snapshot) -> set[str]:
    """The service keys whose Service or slices differ between ``old`` and ``new``."""
    keys = {s.key for s in (*old.services, *new.services)}
    keys |= {sl.service_key for sl in (*old.slices, *new.slices)}
    return {
        k
        for k in keys
        if old.service(k) != new.service(k) or _slices(old, k) != _slices(new, k)
    }


_BASE: list[str] = []
"""The documents every example starts from, printed once (``yaml.safe_dump`` is slow)."""
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


@given(seed=st.integers(0, 2**32 - 1), steps=st.integers(1, 12), as_json=st.integers(0, 30))
def test_whatever_differs_between_good_parses_is_reported(
    make_state: Callable[[int, int, int], dict[str, Any]], seed: int, steps: int, as_json: int
) -> None:
    r = random.Random(seed)
    if not _BASE:
        _BASE.extend(documents(make_state(8, 2, 3)["items"]))
        # Two slices for some services, so that moving documents can reorder a service's slices.
        _BASE.extend(d.replace("-abcde", "-fghij").replace("- 10.", "- 11.") for d in _BASE[4:10:2])
    base = list(_BASE)
    parser = StateParser()
    last = parser.parse(stream(base), 0)
    for step in range(1, steps + 1):
        if r.random() < 0.7:
            base = _edit(r, base)  # Kept, if it parses.
            text = stream(base)
        else:
            text = stream(_edit(r, _edit(r, base)))  # Tried once, then dropped.
        if step == as_json:
            with contextlib.suppress(yaml.YAMLError):
                items = list(yaml.load_all(text, Loader=_LOADER))
                text = json.dumps({"kind": "List", "items": items})
        try:
            snap = parser.parse(text, step)
        except StateError:
            continue
        got = snap.changes
        if got.services is None:
            assert got.since is None and got.nodes
        else:
            assert got.since == last.generation
            assert _differ(last, snap) <= got.services, (step, parser.last)
            if last.nodes != snap.nodes:
                assert got.nodes
        last = snap
