"""What changed since the last snapshot, said by the source that saw it change.

Owns: ``ChangeTracker``, kpx's form of kube-proxy's ``ServiceChangeTracker``
and ``EndpointsChangeTracker`` (``pkg/proxy/servicechangetracker.go``): a
source tells it which Services and which Services' EndpointSlices it saw
added, updated or deleted, and ``take`` hands the sum over as ``Changes``,
the set of changed service keys that kube-proxy's ``UpdateServiceMapResult``
calls ``UpdatedServices``. The source attaches them to the ``Snapshot`` it
publishes; the sync consumes them (``decision.build_plans`` rebuilds exactly
those services' plans).

Never: infer a change by comparing objects or their identities. The one
who knows what changed (a watch event, a re-read document) says so; a
source that cannot say calls ``everything``, and every reader then starts
afresh, which is always correct and only slower.

Invariants:

- ``Changes.since`` names the generation the changes are relative to. A
  reader that did not build from exactly that generation ignores the set
  and rebuilds everything: a skipped or refused snapshot can never make a
  reader miss a change.
- Until ``take``, changes accumulate. A source whose new state is refused
  does not take: the next good state's changes are then the union, relative
  to the last state published.
- A key in the set may not have changed at all (a document re-read to the
  same objects); a key that changed is always in it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Changes:
    """The service keys (``namespace/name``) whose Service or slices changed since ``since``."""

    since: int | None = None
    """Generation these changes are relative to; None: relative to nothing (rebuild all)."""
    services: frozenset[str] | None = None
    """Changed keys; None: anything may have changed."""
    nodes: bool = True
    """Whether any Node object may have changed."""

    def relative_to(self, generation: int | None) -> frozenset[str] | None:
        """The changed keys if they are relative to ``generation``, else None (rebuild all)."""
        if generation is None or self.since != generation:
            return None
        return self.services


EVERYTHING = Changes()
"""The changes of a snapshot nobody described: readers rebuild everything."""


class ChangeTracker:
    """Collects what a source saw change, until the next snapshot is published.

    Cheap and single-threaded: each call adds a key to a set. The caller
    serialises calls with ``take`` (the file source parses in one worker
    thread at a time, the API source records on its loop).
    """

    __slots__ = ("_all", "_nodes", "_services")

    def __init__(self) -> None:
        self._services: set[str] = set()
        self._all = True  # Nothing was published yet: the first state is all new.
        self._nodes = True

    def service(self, key: str) -> None:
        """A Service ``namespace/name`` was added, updated or deleted."""
        self._services.add(key)

    def slices_of(self, service_key: str) -> None:
        """An EndpointSlice of service ``service_key`` was added, updated or deleted."""
        self._services.add(service_key)

    def node(self) -> None:
        """A Node was added, updated or deleted."""
        self._nodes = True

    def everything(self) -> None:
        """Anything may have changed (a re-list, a whole re-read)."""
        self._all = True
        self._nodes = True

    def merge(self, changes: Changes) -> None:
        """Give back what ``take`` handed out: the state built from it was not published."""
        if changes.services is None:
            self.everything()
            return
        self._services |= changes.services
        self._nodes = self._nodes or changes.nodes

    @property
    def pending(self) -> bool:
        """Whether any change was recorded since the last ``take``."""
        return self._all or self._nodes or bool(self._services)

    def take(self, since: int | None) -> Changes:
        """The changes since generation ``since`` (the last one published); starts afresh."""
        changes = Changes(
            since=None if self._all else since,
            services=None if self._all else frozenset(self._services),
            nodes=self._nodes,
        )
        self._services = set()
        self._all = False
        self._nodes = False
        return changes
