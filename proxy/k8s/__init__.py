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
someone saves a broken file. Nor let any input crash the process, or empty
it by accident (see "Hostile input" in ``problems``, ``decode`` and
``link``), or put a line break or other unprintable character from a state
into a problem.

One concern per module, each importing only the ones listed before it; each
opens with its part of the theory of operation:

- ``problems``: ``StateError``, and the escaping that keeps every problem one line.
- ``decode``: PyYAML's one door (nesting measured first), JSON, plain scalars.
- ``subset``: the fast reader of the block-style YAML that kubectl prints,
  and its off switch, the environment variable ``KPX_NO_FAST_YAML``.
- ``fields``: judging one decoded document: every field check, its model objects.
- ``link``: linking the verdicts of a stream: duplicates, nodePort clashes, orphans.
- ``stream``: ``StateParser``: chunks, the parse cache, and what changed.
- here: the entry points, and the names the rest of kpx imports.

A state is read in two passes, so that the first one can be cached: judging
each document alone (``fields``), then linking them (``link``).
"""

from __future__ import annotations

from collections.abc import Iterable
from itertools import repeat
from pathlib import Path

from proxy.core.model import Snapshot
from proxy.k8s.decode import _load_all
from proxy.k8s.fields import (
    HEADLESS_LABEL,
    MAX_AFFINITY_SECONDS,
    SERVICE_NAME_LABEL,
    SERVICE_PROXY_NAME_LABEL,
    TRIGGER_TIME_ANNOTATION,
    _judge,
)
from proxy.k8s.link import NO_DOCUMENTS, _link, _refuse_if_empty
from proxy.k8s.problems import StateError
from proxy.k8s.stream import ParseStats, StateParser
from proxy.util.gcpause import gc_paused

__all__ = [
    "HEADLESS_LABEL",
    "MAX_AFFINITY_SECONDS",
    "NO_DOCUMENTS",
    "SERVICE_NAME_LABEL",
    "SERVICE_PROXY_NAME_LABEL",
    "TRIGGER_TIME_ANNOTATION",
    "ParseStats",
    "StateError",
    "StateParser",
    "decode_state",
    "parse_file",
    "parse_objects",
    "parse_state",
]


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

    Raises ``StateError`` listing every problem found; see ``fields``'s
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
    # One C call, holding the GIL for the whole state: decoding in pieces
    # would not help, since joining them costs as much (page faults on the
    # new string's memory; docs/PERFORMANCE.md has the figures).
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise StateError([f"not UTF-8 text ({err.reason} at byte {err.start})"]) from None


def parse_file(path: str | Path, generation: int = 0) -> Snapshot:
    """``parse_state`` of a UTF-8 file. ``OSError`` is left to the caller."""
    return parse_state(decode_state(Path(path).read_bytes()), generation)
