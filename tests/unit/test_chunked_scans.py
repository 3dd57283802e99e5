"""Whole-state scans done in pieces give the whole scan's answers.

Why pieces (issue "Robustness", point 5): a parse runs in a thread beside the
loop that forwards traffic, and one C call over a 41 MB state held the GIL
20-40 ms. These tests shrink the pieces to a few characters, so every seam
case (a match across a seam, at a seam, near the end) is hit by small texts.
"""

from __future__ import annotations

import random
import re

import pytest

from bench import k8s_state
from proxy.k8s import StateError, StateParser, link, parse_state, stream


def _pieces(monkeypatch: pytest.MonkeyPatch, scan: int, batch: int, free_at_once: int) -> None:
    monkeypatch.setattr(stream, "_SCAN_PIECE", scan)
    for module in (link, stream):  # ``stream`` uses ``link``'s, under the same name.
        monkeypatch.setattr(module, "_BATCH", batch)
    monkeypatch.setattr(stream, "_FREE_AT_ONCE", free_at_once)


@pytest.fixture
def tiny_pieces(monkeypatch: pytest.MonkeyPatch) -> None:
    _pieces(monkeypatch, scan=5, batch=3, free_at_once=4)


TEXTS = [
    "",
    "\n",
    "---",
    "\n---",
    "\n---\n",
    "a: 1\n---\nb: 2\n--- \nc: 3\n---\t\n---x\n----\n---",
    "\n---\n---\n---\n---\n---\n...\n%YAML\n\r\n\n...",
    "kind: List\n...\n...\n%TAG\n% \n\n---\r\n---",
]


def _random_texts(count: int) -> list[str]:
    rng = random.Random(5)
    alphabet = ["\n", "-", "---", ".", "...", "%", "\r", " ", "\t", "a", "\n---\n"]
    return ["".join(rng.choice(alphabet) for _ in range(rng.randrange(60))) for _ in range(count)]


@pytest.mark.usefixtures("tiny_pieces")
@pytest.mark.parametrize("sub", ["\n...", "\n%", "\r", "---", "a"])
def test_find_in_pieces_is_str_find(sub: str) -> None:
    for text in TEXTS + _random_texts(200):
        for start in range(0, len(text) + 2, 3):
            for end in (len(text), len(text) - 1, start + 7, start):
                assert stream._find(text, sub, start, end) == text.find(sub, start, end), (
                    text, start, end)


@pytest.mark.usefixtures("tiny_pieces")
def test_marker_ends_in_pieces_are_finditer_over_the_whole() -> None:
    marker = re.compile(r"\n(?=---(?:[ \t\r\n]|\Z))")
    for text in TEXTS + _random_texts(300):
        for start in range(0, len(text) + 1, 2):
            for end in {len(text), max(start, len(text) - 2), min(len(text), start + 6)}:
                whole = [m.end() for m in marker.finditer(text, start, end)]
                assert stream._marker_ends(text, start, end) == whole, (text, start, end)


@pytest.mark.usefixtures("tiny_pieces")
def test_tally_in_batches_counts_as_one_pass() -> None:
    tally = link._Tally()
    tally.add(["a", "b", "c", "d"])  # all new: the fast path, in two batches
    assert tally.counts == {"a": 1, "b": 1, "c": 1, "d": 1} and tally.repeated == 0
    tally.add(["e", "a", "f", "a", "g", "h", "h"])
    assert tally.counts == {"a": 3, "b": 1, "c": 1, "d": 1, "e": 1, "f": 1, "g": 1, "h": 2}
    assert tally.repeated == 2
    tally.remove(["a", "a", "h"])
    assert tally.repeated == 0


@pytest.mark.usefixtures("tiny_pieces")
def test_let_go_empties_only_big_containers() -> None:
    small, big = {1: 1, 2: 2}, {i: str(i) for i in range(11)}
    small_list, big_list = [1, 2, 3], list(range(10))
    for items in (small, big, small_list, big_list):
        stream._let_go(items)
    assert small == {1: 1, 2: 2} and small_list == [1, 2, 3]
    assert big == {} and big_list == []


def _state(n: int) -> str:
    eps = (k8s_state.Ep("10.0.0.1", "n1"), k8s_state.Ep("10.0.0.2", "n2"))
    services = k8s_state.many_services(n, 30000, eps, 8080)
    services += k8s_state.cluster_ip_services(n, eps, 8080)
    return k8s_state.render([("n1", "10.1.0.1")], services)


def _outcome(text: str) -> object:
    try:
        return parse_state(text, 1)
    except StateError as err:
        return err.problems


def test_a_parse_in_tiny_pieces_is_the_same_parse(monkeypatch: pytest.MonkeyPatch) -> None:
    good = _state(7)
    twice = good + "---\n" + good.split("---\n", 2)[2]  # duplicates: every tally's slow path
    odd = good.replace("\n---\n", "\n...\n---\n", 1)  # read whole
    texts = [good, twice, odd, good + "---\nkind: [\n"]
    expected = [_outcome(text) for text in texts]
    parser = StateParser()
    expected_incremental = [_outcome_with(parser, text) for text in (good, twice, good)]

    _pieces(monkeypatch, scan=7, batch=2, free_at_once=3)
    assert [_outcome(text) for text in texts] == expected
    parser = StateParser()
    assert [_outcome_with(parser, text) for text in (good, twice, good)] == expected_incremental


def _outcome_with(parser: StateParser, text: str) -> object:
    try:
        return parser.parse(text, 1)
    except StateError as err:
        return err.problems
