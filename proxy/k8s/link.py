"""Verdicts -> a Snapshot: the checks that span documents, kept up to date chunk by chunk.

Owns: the second of the two passes, *linking* (``_Linker``, ``_link``,
``_replay``): duplicate names, nodePort clashes, slices whose service is
missing; and the refusal of a stream that holds nothing (``NO_DOCUMENTS``).

Never: judge a field (``fields`` did, document by document) or decode
anything; nor build a Snapshot from a stream that has a problem.

Theory of operation: slices are linked to services only after the whole
stream is read, since kubectl prints kinds in any order. A slice whose
service is absent or ignored is dropped silently, as kube-proxy does: slices
outlive their service for a moment on every delete.

Hostile input: a stream whose documents are all empty (an empty file, only
comments or ``---``, a failed ``kubectl ... > state.yaml``) is refused
(``NO_DOCUMENTS``): taking it would close every NodePort at once. An empty
``kind: List`` is the deliberate "no services".

Linking is the second of two passes (the first, judging, is ``fields``'s):
*linking* (``_Linker``) runs the checks that span documents: duplicate
names, nodePort clashes, slices whose service is missing. It keeps
counts (how many verdicts have problems, which names and nodePorts
repeat) and flat lists of the model objects, all updated in proportion
to what changed, so a stream without problems becomes a Snapshot without
looking at every object again. Only a stream with problems is replayed
verdict by verdict (``_replay``), to report them in exactly the order,
and with exactly the words, of a single pass.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Iterable, Iterator
from itertools import accumulate, chain, compress, islice, repeat
from operator import add, attrgetter
from typing import Any

from proxy.core.model import EndpointSlice, Node, Service, Snapshot
from proxy.k8s.fields import _EMPTY_DOCUMENT, _Located, _Verdict
from proxy.k8s.problems import StateError

_BATCH = 8192
"""Items per C call when a whole state's objects are listed, counted or freed (see
``stream._SCAN_PIECE``: one C call holds the GIL until it returns)."""


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
        # GIL ~20 ms (see ``stream._SCAN_PIECE``).
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
