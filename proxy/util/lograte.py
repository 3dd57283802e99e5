"""Rate-limited logging: the first of each kind in full, the rest counted, then summarised.

Owns: one window per key (a key is a cause and a service, e.g.
``("connect", "Connection refused", "default/web:http")``). The first event
of a key opens a window and is logged in full; later events of that key in
the same window are only counted (one dict lookup, one clock read, an int
increment and two stores: no formatting). When the window ends, one line
says what was held back: the latest such event in full, followed by
``… and 4,812 more like this in the last 10 s``. A window ends lazily, on
the key's next event, and on ``flush``, which the owner calls from a timer
so a burst that stops still gets its summary (``next_due`` says when).

Why: a dataplane logs per connection. Unlimited, a refusing endpoint costs
three lines per failed connection, and one busy client turns that into
megabytes per second (docs/PERFORMANCE.md, "Log volume"). Per key, this
writes at most two lines per window, however many events there are; memory
is bounded by ``max_keys`` (further keys share one overflow window until
windows end).

Never: write a control character taken from its input. Every written line
is rendered here and has C0/C1 controls, DEL and Unicode line/paragraph
separators escaped (``\\n`` stays two characters), so a string that came
from a client or a file cannot forge a second log line.

Not thread-safe: one owner, on one event loop.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Hashable
from typing import Any

WINDOW = 10.0
"""Seconds per window: at most two lines per key per window."""
MAX_KEYS = 1024
"""Windows open at once; beyond this, new keys share one overflow window."""

OVERFLOW: tuple[str] = ("(too many kinds of message at once)",)
"""The key every new key maps to while ``max_keys`` windows are open."""

_ESCAPES = {c: f"\\x{c:02x}" for c in (*range(0x20), *range(0x7F, 0xA0))}
_ESCAPES.update({0x09: "\\t", 0x0A: "\\n", 0x0D: "\\r", 0x2028: "\\u2028", 0x2029: "\\u2029"})


def one_line(text: str) -> str:
    """``text`` with every character that could end or rewrite a log line escaped.

    ``str.isprintable`` is False for all of them (and for a few harmless
    ones, which ``translate`` then leaves as they are), so the common case
    costs one C-level scan.
    """
    if text.isprintable():
        return text
    return text.translate(_ESCAPES)


def span(seconds: float) -> str:
    """``10 s``, ``2.5 s``, ``0.125 s``: how long a summary covers."""
    return f"{max(seconds, 0.0):.3g} s"


class _Window:
    """One key's open window: when it opened, how many were held back, the latest."""

    __slots__ = ("args", "level", "msg", "start", "suppressed")

    def __init__(self, start: float, level: int) -> None:
        self.start = start
        self.level = level
        self.suppressed = 0
        self.msg = ""
        self.args: tuple[Any, ...] = ()


class RateLimitedLog:
    """A logger's front: ``log(level, key, msg, *args)`` writes or counts.

    ``clock`` is any monotonic clock in seconds (the forwarder passes its
    event loop's ``time``; tests pass a fake).
    """

    def __init__(
        self,
        logger: logging.Logger,
        window: float = WINDOW,
        max_keys: int = MAX_KEYS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if window <= 0 or max_keys < 1:
            raise ValueError("window must be > 0 and max_keys >= 1")
        self.logger = logger
        self.window = window
        self.max_keys = max_keys
        self.clock = clock
        self._open: dict[Hashable, _Window] = {}

    def __len__(self) -> int:
        """Windows open now (the overflow window included)."""
        return len(self._open)

    def warning(self, key: Hashable, msg: str, *args: Any, exc_info: Any = None) -> bool:
        return self.log(logging.WARNING, key, msg, *args, exc_info=exc_info)

    def log(self, level: int, key: Hashable, msg: str, *args: Any, exc_info: Any = None) -> bool:
        """Log ``msg % args`` if it is the first of ``key`` in its window, else count it.

        Returns True if a line was written (the first of a new window), which
        is when the caller should make sure a ``flush`` is coming.
        """
        opened = self._open
        w = opened.get(key)
        if w is not None:
            now = self.clock()
            if now - w.start < self.window:
                w.suppressed += 1
                w.msg = msg
                w.args = args
                return False
            self._close(key, w, now)  # the window ended: summary first, then this one
        elif len(opened) >= self.max_keys:
            now = self.clock()
            self.flush(now)
            if len(opened) >= self.max_keys:
                key = OVERFLOW
                w = opened.get(key)
                if w is not None:
                    # Still open (flush closed every ended window).
                    w.suppressed += 1
                    w.msg = msg
                    w.args = args
                    return False
        else:
            now = self.clock()
        opened[key] = _Window(now, level)
        self._write(level, msg, args, exc_info)
        return True

    def flush(self, now: float | None = None, *, force: bool = False) -> float | None:
        """Close every window that ended (every window if ``force``) and summarise it.

        Returns when the next open window ends, or None if none is open:
        what the owner's timer should wait for.
        """
        if now is None:
            now = self.clock()
        window = self.window
        due: float | None = None
        for key, w in list(self._open.items()):
            end = w.start + window
            if force or end <= now:
                self._close(key, w, now)
            elif due is None or end < due:
                due = end
        return due

    def _close(self, key: Hashable, w: _Window, now: float) -> None:
        del self._open[key]
        n = w.suppressed
        if not n:
            return
        latest = self._render(w.msg, w.args)
        if n == 1:
            self._emit(w.level, latest)
            return
        others = "of other kinds" if key is OVERFLOW else "like this"
        self._emit(w.level, f"{latest} … and {n - 1:,} more {others} in the last "
                            f"{span(min(now - w.start, self.window))}")

    def _write(self, level: int, msg: str, args: tuple[Any, ...], exc_info: Any) -> None:
        if self.logger.isEnabledFor(level):
            self.logger.log(level, "%s", self._render(msg, args), exc_info=exc_info)

    def _emit(self, level: int, line: str) -> None:
        if self.logger.isEnabledFor(level):
            self.logger.log(level, "%s", line)

    @staticmethod
    def _render(msg: str, args: tuple[Any, ...]) -> str:
        try:
            text = msg % args if args else msg
        except (TypeError, ValueError):  # a bad format must not cost the event
            text = f"{msg} {args!r}"
        return one_line(text)
