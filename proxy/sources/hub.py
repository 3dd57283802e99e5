"""One state, many readers: the snapshot hub and the proxy health it implies.

Owns: the current ``Snapshot`` of one kpx process and the fan-out of every new
snapshot to its readers (the dataplane, the healthz sidecar), plus
``ProxyHealth``, kube-proxy's ``QueuedUpdate``/``Updated`` bookkeeping that
``/healthz`` and ``serviceProxyHealthy`` report.

Never: parse files or open sockets. Sources (``proxy.sources.statefile``) call
``publish``; readers ``subscribe``.

Health follows ``pkg/proxy/healthcheck/proxy_health.go``: a snapshot that has
been queued but not applied for ``2 x sync period`` makes the proxy unhealthy;
applying it (``updated``) makes it healthy again. A *fault* (``set_fault``,
e.g. the transparent return path deleted and not restorable) makes it
unhealthy until cleared: the rules kube-proxy would have failed to apply.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Generic, TypeVar

from proxy.core.model import Snapshot
from proxy.util.gcpause import gc_paused

log = logging.getLogger(__name__)

Reader = Callable[[Snapshot], None]
T = TypeVar("T")


class Prepared(Generic[T]):
    """What a reader's preparer computed for one snapshot, handed to that reader once.

    ``put`` runs in the source's worker thread, ``take`` in the reader on the
    loop. A take for any other snapshot (something else was published, or
    nothing was prepared) gets None, and the reader computes it itself.
    """

    __slots__ = ("_item",)

    def __init__(self) -> None:
        self._item: tuple[Snapshot, T] | None = None

    def put(self, snapshot: Snapshot, value: T) -> None:
        self._item = (snapshot, value)

    def take(self, snapshot: Snapshot) -> T | None:
        value = self.peek(snapshot)
        self._item = None
        return value

    def peek(self, snapshot: Snapshot) -> T | None:
        """What ``take`` would give, left in place."""
        item = self._item
        return item[1] if item is not None and item[0] is snapshot else None


class ProxyHealth:
    """kube-proxy's proxier health: healthy unless an update is pending too long."""

    def __init__(self, timeout: float = 60.0, clock: Callable[[], float] = time.time) -> None:
        self.timeout = timeout
        self._clock = clock
        self.last_updated: float = clock()
        self.oldest_pending: float | None = None
        self.faults: dict[str, str] = {}
        """Known-broken dataplane parts (name -> why), e.g. a return path that
        cannot be restored: the rules are not in force, which is what an
        update that never applies means upstream, so health fails alike."""

    def queued(self) -> None:
        if self.oldest_pending is None:
            self.oldest_pending = self._clock()

    def updated(self) -> None:
        self.oldest_pending = None
        self.last_updated = self._clock()

    def set_fault(self, name: str, why: str) -> None:
        self.faults[name] = why

    def clear_fault(self, name: str) -> None:
        self.faults.pop(name, None)

    def healthy(self) -> bool:
        if self.faults:
            return False
        if self.oldest_pending is None:
            return True
        return self._clock() - self.oldest_pending < self.timeout

    def now(self) -> float:
        return self._clock()


class StateHub:
    """Holds the current snapshot and hands each new one to every reader.

    Readers are called synchronously, in subscription order, on the event
    loop thread. A reader that raises is logged and skipped: one broken
    reader must never leave the others on a stale state.

    Preparers (``add_preparer``) are the part of a reader's work that is pure
    and slow (``build_plans`` of 50,000 services: 70 ms). A source that
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
