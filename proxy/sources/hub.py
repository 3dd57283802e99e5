"""One state, many readers: the snapshot hub between the sources and the proxier.

Owns: the current ``Snapshot`` of one kpx process, the fan-out of every new
snapshot to its readers (in kpx, the proxier's one sync) and to its
preparers (the same sync's pure half, run in the source's worker thread),
and the moment a snapshot counts as queued and as applied: it marks
``ProxyHealth`` (``queued`` on publish, ``updated`` once every reader took
it) and sets ``kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds``.

Never: parse files, open sockets or compute anything from a snapshot.
Sources (``proxy.sources.statefile``, ``proxy.sources.kubeapi``) call
``publish``; readers ``subscribe``.

Health follows ``pkg/proxy/healthcheck/proxy_health.go``: a snapshot that has
been queued but not applied for ``2 x sync period`` makes the proxy unhealthy;
applying it (``updated``) makes it healthy again.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable

from healthz.proxy_health import ProxyHealth
from proxy import metrics
from proxy.core.model import Snapshot
from proxy.util.gcpause import gc_paused

log = logging.getLogger(__name__)

Reader = Callable[[Snapshot], None]

FREEZE_AFTER_DOCUMENTS = 5000
"""Freshly built documents above which a new state is moved to the GC's permanent
generation (``gc.freeze``) as soon as it is built; see ``prepare_off_loop``."""


class StateHub:
    """Holds the current snapshot and hands each new one to every reader.

    Readers are called synchronously, in subscription order, on the event
    loop thread. A reader that raises is logged and skipped: one broken
    reader must never leave the others on a stale state.

    Preparers (``add_preparer``) are the part of a reader's work that is pure
    and slow (the plans of 50,000 services). A source that
    builds snapshots in a worker thread calls ``prepare`` there, before
    ``publish``, so the readers find their caches warm and the loop, which
    forwards traffic, is not held. A source that does not call it loses
    nothing but that head start.
    """

    def __init__(self, health: ProxyHealth | None = None) -> None:
        self.snapshot: Snapshot | None = None
        self.health = health or ProxyHealth()
        self._readers: list[Reader] = []
        self._preparers: list[Reader] = []

    def add_preparer(self, preparer: Reader) -> None:
        self._preparers.append(preparer)

    def remove_preparer(self, preparer: Reader) -> None:
        if preparer in self._preparers:
            self._preparers.remove(preparer)

    def prepare(self, snapshot: Snapshot) -> None:
        """Run every preparer on ``snapshot`` in the calling (worker) thread; never raises.

        The caller publishes ``snapshot`` next and calls neither method
        concurrently with ``publish``: preparers may share caches with readers.
        """
        for preparer in list(self._preparers):
            _call("preparer", preparer, snapshot)

    def subscribe(self, reader: Reader) -> None:
        self._readers.append(reader)
        if self.snapshot is not None:
            self._deliver(reader, self.snapshot)

    def unsubscribe(self, reader: Reader) -> None:
        if reader in self._readers:
            self._readers.remove(reader)

    def publish(self, snapshot: Snapshot) -> None:
        self.snapshot = snapshot
        self.health.queued()
        for family in self.health.families:  # kube-proxy: one series per family's proxier
            metrics.SYNC_LAST_QUEUED_TIMESTAMP.labels(ip_family=family).set_to_current_time()
        ok = True
        # Applying a big state allocates as much as parsing it (plans,
        # balancers, listeners): the same GC pause holds (proxy.util.gcpause).
        with gc_paused():
            for reader in list(self._readers):
                ok &= self._deliver(reader, snapshot)
        if ok:
            self.health.updated()

    def _deliver(self, reader: Reader, snapshot: Snapshot) -> bool:
        return _call("reader", reader, snapshot)


def prepare_off_loop(hub: StateHub, snapshot: Snapshot, fresh: int) -> None:
    """A new snapshot's slow half, in the source's worker thread, before the loop
    publishes it: every source of a big state does this, or the loop that forwards
    stalls on it.

    - ``fresh`` (the documents built anew for it) above ``FREEZE_AFTER_DOCUMENTS``:
      the state is frozen out of the cyclic GC at once. After a 50,000-service
      build the heap holds ~2 M new tracked objects, and the first full collection
      that follows (triggered by any allocation, in any thread) walks them all
      *holding the GIL* (docs/PERFORMANCE.md, "State file"): the loop stalls as if
      it built the state itself. Frozen objects are never walked. A state is acyclic
      (``proxy.util.gcpause``), so reference counting still frees it when it is
      replaced; garbage *cycles* alive at this instant wait for the next unfreeze
      (``gc_paused`` does one after each big build) instead of the next collection.
    - The hub's preparers (the readers' plans), with the GC held off as for the
      build: a collection walking the new plans holds the GIL too
      (docs/PERFORMANCE.md, "GIL holds during a 50,000-service apply").
    """
    big = fresh > FREEZE_AFTER_DOCUMENTS
    if big:
        gc.freeze()
    with gc_paused():
        hub.prepare(snapshot)
    if big:
        gc.freeze()


def _call(role: str, fn: Reader, snapshot: Snapshot) -> bool:
    """``fn(snapshot)``; False (logged with its name) if it raised: one broken
    reader or preparer must never keep the snapshot from the others."""
    try:
        fn(snapshot)
    except Exception:
        log.exception(
            "state %s %s failed on generation %d",
            role, getattr(fn, "__qualname__", fn), snapshot.generation,
        )
        return False
    return True
