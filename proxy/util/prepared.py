"""A hand-over slot for work done ahead in a worker thread: ``Prepared``.

Owns: the one-item memo between a preparer (run in a state source's worker
thread, ahead of a publish) and the reader that consumes its result on the
event loop (``proxy.proxier``, ``proxy.userspace.dataplane``).

Never: compute anything, or hand a result to any input but the one it was
prepared for.
"""

from __future__ import annotations

from typing import Generic, TypeVar

T = TypeVar("T")


class Prepared(Generic[T]):
    """What a preparer computed for one input (a snapshot, a sync), handed over once.

    ``put`` runs in the source's worker thread, ``take`` in the reader on the
    loop. A take for any other input (something else was published, or
    nothing was prepared) gets None, and the reader computes it itself. The
    input is matched by identity: it is immutable, and equal inputs from two
    publishes are still two publishes.
    """

    __slots__ = ("_item",)

    def __init__(self) -> None:
        self._item: tuple[object, T] | None = None

    def put(self, key: object, value: T) -> None:
        self._item = (key, value)

    def take(self, key: object) -> T | None:
        value = self.peek(key)
        self._item = None
        return value

    def peek(self, key: object) -> T | None:
        """What ``take`` would give, left in place."""
        item = self._item
        return item[1] if item is not None and item[0] is key else None
