"""The state-file source: watch a path, parse it, publish good snapshots.

Owns: turning a YAML file on disk into ``Snapshot``s on a ``StateHub``, and
the ``kpx check`` command.

Never: apply anything itself, or publish a state that failed to parse. A bad
file is logged problem by problem and the last good state stays in force.

Watching the *path*, not the inode: writers usually replace the file
atomically (write a sibling, rename it over), so an inotify watch on the file
itself would go deaf after the first update. kpx watches the directory for
events naming the file, and polls ``stat`` as a safety net (for filesystems
without inotify, and for anything the events miss). Every trigger funnels
into one debounced ``load``; content that did not change is not republished.

Convergence is the point of a live source: a ``StateParser`` keeps the last
stream's decoded documents, so an edit to one endpoint of a 10,000-service
file re-decodes one document, and the unchanged objects in the new snapshot
are the very same ones as before (readers can reuse their plans by
identity). "Did the content change" is a bytes comparison with the last
content, not a digest: a memcmp of a 16 MiB state costs ~1 ms, a blake2b ~20.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import ctypes.util
import errno
import logging
import os
import struct
import sys
import time
from pathlib import Path

from proxy import metrics
from proxy.k8s import StateError, StateParser
from proxy.state import StateHub

log = logging.getLogger(__name__)

_IN_MODIFY = 0x00000002
_IN_CLOSE_WRITE = 0x00000008
_IN_MOVED_TO = 0x00000080
_IN_CREATE = 0x00000100
_IN_DELETE = 0x00000200
_IN_NONBLOCK = 0o4000
_IN_CLOEXEC = 0o2000000
_EVENT_HEADER = struct.Struct("iIII")

DEBOUNCE_SECONDS = 0.01
"""Coalesces the burst of IN_MODIFY events an in-place write produces."""


class _DirectoryWatch:
    """A minimal inotify watch on one directory, read from the event loop."""

    def __init__(self, directory: Path) -> None:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fd = libc.inotify_init1(_IN_NONBLOCK | _IN_CLOEXEC)
        if fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1 failed")
        mask = _IN_MODIFY | _IN_CLOSE_WRITE | _IN_MOVED_TO | _IN_CREATE | _IN_DELETE
        if libc.inotify_add_watch(fd, os.fsencode(directory), mask) < 0:
            err = ctypes.get_errno()
            os.close(fd)
            raise OSError(err, f"inotify_add_watch({directory}) failed")
        self.fd = fd

    def names(self) -> set[str]:
        """Drain pending events and return the file names they mention."""
        names: set[str] = set()
        while True:
            try:
                buf = os.read(self.fd, 65536)
            except BlockingIOError:
                return names
            offset = 0
            while offset < len(buf):
                _wd, _mask, _cookie, length = _EVENT_HEADER.unpack_from(buf, offset)
                offset += _EVENT_HEADER.size
                raw = buf[offset : offset + length].rstrip(b"\0")
                offset += length
                names.add(os.fsdecode(raw))

    def close(self) -> None:
        os.close(self.fd)


class StateFileSource:
    """Feeds a ``StateHub`` from a YAML state file, live."""

    def __init__(self, path: Path | str, hub: StateHub, interval: float = 0.5) -> None:
        self.path = Path(path)
        self.hub = hub
        self.interval = interval
        self.generation = 0
        self.parser = StateParser()
        self._published: bytes | None = None
        """The content of the last good file (what the hub holds)."""
        self._stat_key: tuple[int, ...] | None = None
        self._refused: bytes | None = None
        """The content of the last bad file, so it is logged once."""
        self._missing_logged = False
        self._watch: _DirectoryWatch | None = None
        self._pending: asyncio.TimerHandle | None = None
        self._stopped = asyncio.Event()

    def load(self, force: bool = False) -> bool:
        """Read and parse the file now; publish it if it is good and new.

        Returns True when the hub holds this file's current content afterwards.
        """
        start = time.perf_counter()
        try:
            before = os.stat(self.path)
            data = self.path.read_bytes()
            after = os.stat(self.path)
        except FileNotFoundError:
            if not self._missing_logged:
                log.warning("state file %s does not exist; keeping the last good state", self.path)
                self._missing_logged = True
            return False
        except OSError as e:
            log.error("cannot read state file %s: %s; keeping the last good state", self.path, e)
            return False
        self._missing_logged = False
        self._stat_key = _stat_key(after)
        if _stat_key(before) != self._stat_key:
            # Written to while we read it: a later event or poll sees the rest.
            return False
        if data == self._published and not force:
            return True
        try:
            text = data.decode("utf-8", errors="replace")
            snapshot = self.parser.parse(text, self.generation + 1)
        except StateError as err:
            if data != self._refused:
                self._refused = data
                metrics.STATE_RELOAD_ERRORS.inc()
                log.error(
                    "state file %s refused (%d problem%s); the last good state stays in force:"
                    "\n  %s",
                    self.path,
                    len(err.problems),
                    "" if len(err.problems) == 1 else "s",
                    "\n  ".join(err.problems),
                )
            return False
        self.generation += 1
        self._published = data
        self._refused = None
        metrics.SYNC_LAST_QUEUED_TIMESTAMP.set_to_current_time()
        log.info(
            "state file %s: generation %d (%d nodes, %d services, %d endpoint slices), "
            "read and parsed in %.0f ms",
            self.path,
            snapshot.generation,
            len(snapshot.nodes),
            len(snapshot.services),
            len(snapshot.slices),
            (time.perf_counter() - start) * 1000,
        )
        log.debug("state file %s: %s", self.path, self.parser.last)
        self.hub.publish(snapshot)
        return True

    def reload(self) -> None:
        """SIGHUP: re-read even if nothing seems to have changed."""
        log.info("reloading %s on request", self.path)
        self.load(force=True)

    def _schedule(self) -> None:
        if self._pending is None:
            loop = asyncio.get_running_loop()
            self._pending = loop.call_later(DEBOUNCE_SECONDS, self._fire)

    def _fire(self) -> None:
        self._pending = None
        try:
            self.load()
        except Exception:
            log.exception("unexpected error loading %s", self.path)

    def _on_events(self) -> None:
        assert self._watch is not None
        if self.path.name in self._watch.names():
            self._schedule()

    async def run(self) -> None:
        """Load once, then follow the file until ``stop``."""
        loop = asyncio.get_running_loop()
        self.load()
        try:
            self._watch = _DirectoryWatch(self.path.parent)
            loop.add_reader(self._watch.fd, self._on_events)
        except OSError as e:
            log.warning("no inotify for %s (%s); polling every %.1fs", self.path, e, self.interval)
        try:
            while not self._stopped.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stopped.wait(), self.interval)
                try:
                    key = _stat_key(os.stat(self.path))
                except OSError:
                    key = None
                if key != self._stat_key:
                    self._schedule()
        finally:
            if self._watch is not None:
                loop.remove_reader(self._watch.fd)
                self._watch.close()
                self._watch = None
            if self._pending is not None:
                self._pending.cancel()

    def stop(self) -> None:
        self._stopped.set()


def _stat_key(st: os.stat_result) -> tuple[int, ...]:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


# ``kpx check PATH``


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("path", type=Path, help="state file: Node, Service and EndpointSlice YAML")


def run(args: argparse.Namespace) -> int:
    from proxy.k8s import parse_state

    try:
        text = args.path.read_text(encoding="utf-8")
    except OSError as e:
        print(f"{args.path}: {e.strerror or e}", file=sys.stderr)
        return 2 if e.errno == errno.ENOENT else 1
    try:
        snap = parse_state(text)
    except StateError as err:
        for problem in err.problems:
            print(f"{args.path}: {problem}", file=sys.stderr)
        print(f"{args.path}: {len(err.problems)} problem(s); file refused", file=sys.stderr)
        return 1
    proxied = [s for s in snap.services if s.type in ("NodePort", "LoadBalancer")]
    print(
        f"{args.path}: ok: {len(snap.nodes)} nodes, {len(snap.services)} services "
        f"({len(proxied)} with NodePorts), {len(snap.slices)} endpoint slices"
    )
    return 0
