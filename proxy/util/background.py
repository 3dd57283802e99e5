"""Work a worker thread does for the event loop, without making the loop wait for the GIL.

Owns: the policy for CPU-bound Python that runs beside the loop (a state
parse, a sync's walk over every plan): ``background_executor``, one worker
thread niced below the loop's, ``loop_first``, the GIL switch interval
held short while such work runs, and ``OffLoop``, the two together.

Never: decide what runs in the background, or touch the interval outside a
``loop_first`` block (it restores what it found; nesting counts).

Why: the loop (and nfqueue's reader) drop the GIL around every syscall, and
take it back only when the thread holding it yields: after the switch
interval, 5 ms by default. A new connection or a /healthz answer makes a
dozen such calls, so beside a busy worker it waits a dozen intervals (and
more on a busy machine: docs/PERFORMANCE.md, "State file"). 0.2 ms bounds
each wait; the worker pays a little, and only while the loop wants the GIL.
The worker's nice value settles the same contest for a core.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

LOOP_SWITCH_INTERVAL = 0.0002
"""``sys.setswitchinterval`` while background work runs (the default is 5 ms)."""

WORKER_NICE = 10
"""A background thread's nice value (Linux sets it per thread): when the loop
and the worker want the same core, the loop gets it."""

_users = 0
_saved = 0.0


def _lower_priority() -> None:
    """Executor initializer: nice this thread only (``setpriority`` on its tid)."""
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WORKER_NICE)


def background_executor(name: str) -> ThreadPoolExecutor:
    """One niced worker thread, for work the loop hands off and awaits."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix=name,
                              initializer=_lower_priority)


@contextlib.contextmanager
def loop_first() -> Iterator[None]:
    """Hold the GIL switch interval at ``LOOP_SWITCH_INTERVAL`` (nests; loop thread only)."""
    global _users, _saved
    if _users == 0:
        _saved = sys.getswitchinterval()
        sys.setswitchinterval(min(_saved, LOOP_SWITCH_INTERVAL))
    _users += 1
    try:
        yield
    finally:
        _users -= 1
        if _users == 0:
            sys.setswitchinterval(_saved)


_T = TypeVar("_T")


class OffLoop:
    """One ``background_executor`` thread, made on first use, that the loop hands work
    to and awaits, with itself first for the GIL meanwhile (``loop_first``).

    What each source and dataplane that works off the loop needs; calls run one at a
    time, in order. ``close`` drops the thread without waiting for a call in progress.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._executor: ThreadPoolExecutor | None = None

    async def call(self, fn: Callable[..., _T], *args: object) -> _T:
        if self._executor is None:
            self._executor = background_executor(self.name)
        with loop_first():
            return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None
