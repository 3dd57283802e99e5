"""Pausing the cyclic garbage collector while a state is built or applied.

Owns: ``gc_paused``, the one policy for when kpx holds the cyclic GC off.

Never: run a collection itself, or leave the GC off after the block: it
restores what it found, so nesting is safe.

Why at all: decoding and applying a 10,000-service state allocates millions
of acyclic objects (dicts, strings, frozen dataclasses, listener handles).
Each allocation burst triggers collections that walk every tracked object
again, the whole previous state included, burst after burst (figures:
docs/PERFORMANCE.md, "GC pauses"). Nothing built there forms a cycle, so
reference counting frees it all anyway.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

PROMOTE_AFTER = 100_000
"""Net new tracked objects above which ``gc_paused`` promotes them (an
incremental parse or a one-endpoint change makes hundreds)."""


@contextmanager
def gc_paused() -> Iterator[None]:
    """Hold the cyclic GC off for the block; restored only if it was on, so nesting is safe."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            if gc.get_count()[0] > PROMOTE_AFTER:
                # A big state (a first 10k-service state is ~400k tracked
                # objects) would be walked by the very next young collection,
                # and again by the middle one. What it built is
                # long-lived by nature: move it straight to the oldest
                # generation (freeze + unfreeze walk nothing). It stays
                # collectable; it is just never treated as young.
                gc.freeze()
                gc.unfreeze()
            gc.enable()
