"""A state's text -> a Snapshot, again and again: ``StateParser`` re-decodes only what changed.

Owns: ``StateParser`` and all it keeps between parses: the stream cut into
chunks (``_split``), each chunk's text and verdicts, the ``_Linker`` over
them, and a ``ChangeTracker`` that tells readers which services changed
(``Snapshot.changes``); which road each text or chunk is decoded by (JSON,
the subset reader, PyYAML, or the whole stream at once); the scans of a whole
state done in pieces (``_find``, ``_marker_ends``, ``_let_go``); and
``ParseStats``, what one parse did.

Never: keep anything of a stream it could not decode to the end, or more
than one state's worth; nor report a change it cannot vouch for (when in
doubt, everything changed).

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

What changed (``Snapshot.changes``, see ``proxy.core.changes``): the parser
says it from what it did, never by comparing objects. When a parse decodes
only some chunks, every Service in the verdicts of a chunk that left the
stream or came into it (new, changed or moved) is reported by its key, every
EndpointSlice by its service's key, and any Node as "nodes changed". A
verdict holds what the judge accepted, so a Service that turns headless (or
broken) is reported by the verdict it leaves, and one that turns back by the
verdict it arrives in. When a parse cannot tell (the first one, a JSON state,
a stream decoded whole, or the first chunked parse after one of those,
whose cached chunks are older than what was published) it reports
everything. A successful parse takes the changes, relative to the
generation of the last successful one; a refused parse leaves them to
accumulate, so the next good parse reports both.
"""

from __future__ import annotations

import re
from array import array
from collections import deque
from dataclasses import dataclass
from itertools import chain, pairwise, repeat, starmap, takewhile
from operator import add, methodcaller
from typing import Any, Literal, NamedTuple

import yaml

from proxy.core.changes import ChangeTracker
from proxy.core.model import Snapshot, stamp_changes
from proxy.k8s import subset
from proxy.k8s.decode import (
    _DECLINE,
    _json_document,
    _load_all,
    _pyyaml,
    _yaml_problem,
)
from proxy.k8s.fields import _Interned, _judge, _Verdict
from proxy.k8s.link import _BATCH, _link, _Linker, _refuse_if_empty
from proxy.k8s.problems import StateError
from proxy.k8s.subset import _Line, _read_subset
from proxy.util.gcpause import gc_paused


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
# Items per C call when a whole state's objects are listed, counted or freed: ``_BATCH``,
# from ``link``, which counts them in batches too.


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
    500,000 entries; freed at once, they hold the GIL long enough to stall
    the loop. Popping in batches costs more in all, so the smaller ones of a
    10,000-service state are left to be freed whole (figures in
    docs/PERFORMANCE.md).
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


def _record(
    changes: ChangeTracker, old: list[tuple[_Verdict, ...]], new: list[tuple[_Verdict, ...]]
) -> None:
    """Tell ``changes`` of every object in the chunks that ``new`` replaces ``old`` with.

    A chunk found again by its text (unchanged, or moved) keeps its very
    verdicts, so it is in both lists by identity and changed nothing, as
    long as such chunks kept their order: had they moved past each other,
    the slices of one service could come in another order, and every object
    in both lists is reported instead.
    """
    old = [chunk for chunk in old if chunk]  # ``()``, a chunk of comments, is one object.
    new = [chunk for chunk in new if chunk]
    kept = set(map(id, old)).intersection(map(id, new))
    if kept and [id(c) for c in old if id(c) in kept] == [id(c) for c in new if id(c) in kept]:
        old = [chunk for chunk in old if id(chunk) not in kept]
        new = [chunk for chunk in new if id(chunk) not in kept]
    for verdict in chain.from_iterable(chain(old, new)):
        for service in verdict.services:
            changes.service(service.key)
        for endpoint_slice in verdict.slices:
            changes.slices_of(endpoint_slice.service_key)
        if verdict.nodes:
            changes.node()


# -- the parser ---------------------------------------------------------------------------


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

    Each snapshot it returns says what changed since the one it returned
    before (``Snapshot.changes``; the module docstring says how it knows).
    """

    def __init__(self) -> None:
        self.last = ParseStats()
        self._changes = ChangeTracker()
        self._published: int | None = None
        """The generation of the last snapshot returned: what the next one's changes
        are relative to."""
        self._behind = False
        """The chunks are older than the last snapshot returned (a whole-stream parse
        came since): their changes alone would miss some."""
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
                self._changes.everything()
                return self._publish(_link([_judge(doc)], generation))
            try:
                self._update(text, stats)
            except _Whole:
                stats.mode = "whole"
                self._changes.everything()
                self._behind = True
                docs = _load_all(text)
                stats.pyyaml = len(docs)
                verdicts = list(map(_judge, docs, repeat({})))
                return self._publish(
                    _refuse_if_empty(_link(verdicts, generation), lambda: verdicts)
                )
            chunks = self._linker.chunks
            return self._publish(
                _refuse_if_empty(
                    self._linker.snapshot(generation), lambda: chain.from_iterable(chunks)
                )
            )

    def _publish(self, snapshot: Snapshot) -> Snapshot:
        """``snapshot``, carrying the changes since the last one returned, which it now is.

        Only a parse that succeeds gets here, so a refused one leaves its
        changes to the next. The snapshot is no one else's yet, so the changes
        are set in place (``stamp_changes``).
        """
        stamp_changes(snapshot, self._changes.take(since=self._published))
        self._published = snapshot.generation
        return snapshot

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

        if count and not self._behind:
            _record(self._changes, self._linker.chunks[first:stop], verdicts)
        else:
            # Nothing to compare with (the first parse, or one after a JSON
            # state), or chunks older than the last snapshot returned.
            self._changes.everything()
            self._behind = False
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
        docs = (
            _read_subset(chunk, memo.lines, memo.scalars, memo.shapes) if subset.FAST_YAML else None
        )
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
