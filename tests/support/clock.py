"""A settable clock, for code that takes ``clock=`` (``time.time`` or ``time.monotonic``)."""

from __future__ import annotations


class FakeClock:
    """Returns ``now``; a test moves it with ``advance`` or by setting ``now``."""

    def __init__(self, now: float = 1_800_000_000.25) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds
