"""Plumbing the lab, the benchmark and their tests share: atomic writes and polling.

Owns: ``write_atomic`` (replace a file so readers never see a partial one)
and the bounded polls ``wait_until`` (raises at the deadline), ``poll``
(returns a bool) and ``eventually`` (the asyncio twin of ``wait_until``).
Listing network namespaces lives in ``lab.netns.list_namespaces``.

Never: import ``proxy`` or ``healthz`` (lab and bench are black-box users
of the ``kpx`` command), or import anything heavier than the standard
library: ``python -m lab.echo`` and the load balancer daemon import this.

Why ``write_atomic`` writes the way it does: a file is never written in
place. A proxy polling the path must only ever see the old complete file or
the new complete file; a half-written one would be refused (kpx keeps the
last good state), but it would also log errors and delay convergence. So:
write a sibling temp file, fsync, ``os.replace``. This is also what kubelet
and editors do, and what issue 2 requires kpx to pick up (it watches the
path, not the inode).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")

__all__ = ["eventually", "interrupt_on_termination", "poll", "wait_until", "write_atomic"]


def write_atomic(path: str | os.PathLike[str], data: str | bytes) -> None:
    """Replace *path* with *data* (text is UTF-8) so readers never see a partial file.

    The parent directory is created if missing; the file ends up mode 0644.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    raw = data.encode() if isinstance(data, str) else data
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(raw)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


class _Pacer:
    """The deadline of one poll: the pause before the next try, or TimeoutError."""

    def __init__(self, timeout: float, interval: float, what: str) -> None:
        self.deadline = time.monotonic() + timeout
        self.timeout, self.interval, self.what = timeout, interval, what

    def pause(self) -> float:
        if time.monotonic() >= self.deadline:
            raise TimeoutError(f"timed out after {self.timeout}s waiting for {self.what}")
        return self.interval


def wait_until(predicate: Callable[[], T], timeout: float, interval: float = 0.05,
               what: str = "condition") -> T:
    """Poll *predicate* until it returns something truthy and return that value.

    Raises ``TimeoutError`` naming *what* once *timeout* seconds have passed;
    the predicate is always tried at least once, and once more at the deadline.
    """
    pacer = _Pacer(timeout, interval, what)
    while not (value := predicate()):
        time.sleep(pacer.pause())
    return value


def poll(predicate: Callable[[], object], timeout: float, interval: float = 0.05) -> bool:
    """``wait_until`` for callers that want a verdict instead of an exception."""
    try:
        wait_until(predicate, timeout, interval)
    except TimeoutError:
        return False
    return True


async def eventually(predicate: Callable[[], T], timeout: float, interval: float = 0.02,
                     what: str = "condition") -> T:
    """The asyncio twin of ``wait_until``: sleeps with ``asyncio.sleep`` between tries."""
    pacer = _Pacer(timeout, interval, what)
    while not (value := predicate()):
        await asyncio.sleep(pacer.pause())
    return value


def interrupt_on_termination() -> None:
    """Make SIGTERM and SIGHUP raise KeyboardInterrupt, as Ctrl-C does.

    ``kpx lab up`` and ``kpx demo`` clean up half-built labs in ``except
    BaseException``/``finally``; Python's default SIGTERM action ends the
    process without running either, leaving namespaces and processes behind.
    Only the first signal interrupts: a second one must not cut the cleanup short.
    """
    def _raise(signum: int, frame: object) -> None:
        for s in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(s, signal.SIG_IGN)
        raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _raise)
