"""The state-file source: watch a path, read it safely, parse it off the loop, publish.

Owns: turning a YAML file on disk into ``Snapshot``s on a ``StateHub``, and
``read_state``, the one way kpx reads state bytes (``kpx node``, ``kpx
healthz`` and ``kpx check`` all go through it).

Never: apply anything itself, publish a state that failed to parse or that
changed while it was read, parse on the event loop, or block the loop on the
path. A bad file is logged problem by problem (once per distinct problem)
and the last good state stays in force.

Reading (``read_state``): only a regular file, no larger than
``--state-max-bytes``. The path is opened ``O_NONBLOCK`` (a FIFO there cannot
block the open) and ``fstat``-ed; a FIFO, device, directory or socket is
refused by name, without a byte read (``/dev/zero`` would grow memory
without bound, a FIFO would block the thread forever), and a file over the
limit is refused from its size. At most ``limit + 1`` bytes are ever read, so
a file that grows while it is read cannot exhaust memory either.

Watching the *path*, not the inode: writers should replace the file
atomically (write a sibling, rename it over), so an inotify watch on the file
itself would go deaf after the first update. kpx watches the directory for
events naming the file, and polls ``stat`` as a safety net (for filesystems
without inotify, and for anything the events miss). Every trigger funnels
into one debounced, serialized load; content that did not change is not
republished.

Half-written files: a writer that writes in place has sent IN_MODIFY but not
yet IN_CLOSE_WRITE. kpx waits for the close (or an IN_MOVED_TO, the atomic
rename) before it reads; a writer that keeps the file open and quiet for
``SETTLE_SECONDS`` is read anyway (it may never close: ``exec 3>state``).
Without inotify, a change is read once ``stat`` has been unchanged for
``SETTLE_SECONDS``. Either way the read itself must be *stable*: the
``fstat`` before and after it and the path's ``stat`` after it must agree
(device, inode, size, mtime, ctime), or it is read again.

Off the loop: reading and parsing a 50,000-service state takes seconds. They
run in a worker thread (as ``proxy.sources.kubeapi`` builds its snapshots); only
``hub.publish`` runs on the loop. One load at a time, so the ``StateParser``
is used by one thread at a time.

Convergence is the point of a live source: a ``StateParser`` keeps the last
stream's decoded documents, so an edit to one endpoint of a 10,000-service
file re-decodes one document, and the unchanged objects in the new snapshot
are the very same ones as before (readers can reuse their plans by
identity). "Did the content change" is a bytes comparison with the last
content, not a digest: a memcmp is an order of magnitude cheaper than
hashing the same bytes (docs/PERFORMANCE.md, "State file").
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import stat
import struct
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from proxy import metrics
from proxy.core.model import Snapshot
from proxy.defaults import DEFAULT_MAX_BYTES
from proxy.k8s import StateError, StateParser, decode_state
from proxy.sources.hub import StateHub, prepare_off_loop
from proxy.util.background import OffLoop

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
"""Coalesces the burst of events one write produces."""

SETTLE_SECONDS = 3.0
"""How long a file written in place may stay open and quiet before it is read
anyway, and (without inotify) how long ``stat`` must stay unchanged. Longer
than any pause of a writer that streams a state out (the adversarial writer
paused 1.5 s between documents); short beside the 60 s an update may wait
before health turns bad. Writers that rename atomically never wait for it."""

STABLE_READ_ATTEMPTS = 3
"""Reads of a file that keeps changing while read, before waiting for the next event."""

INLINE_MAX_BYTES = 64 << 10
"""States up to this size (about 45 services) are read and parsed on the loop: ~2 ms.

The first thread a process starts switches glibc to its multi-threaded paths
for good (cancellable syscall wrappers, malloc locks), and every relayed
connection pays for them from then on, thread joined or not
(docs/PERFORMANCE.md, "Threads and the relay"). A lab or bench node never
needs the loader thread; a big state pays that cost, and would stall the
loop for seconds without the thread."""


_FILE_KINDS: tuple[tuple[Callable[[int], bool], str], ...] = (
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISSOCK, "a socket"),
)


class StateReadError(Exception):
    """The path cannot be read as a state file; the message names the path and why."""


class StateUnstable(Exception):
    """The file kept changing while it was read: a writer is still at it."""


def _what(mode: int) -> str:
    return next((name for test, name in _FILE_KINDS if test(mode)), "not a regular file")


def _check(path: Path, st: os.stat_result, max_bytes: int) -> None:
    if not stat.S_ISREG(st.st_mode):
        raise StateReadError(
            f"{path} is {_what(st.st_mode)}, not a regular file; only regular files are read"
        )
    if st.st_size > max_bytes:
        raise StateReadError(
            f"{path} is {st.st_size} bytes, over the {max_bytes}-byte limit (--state-max-bytes)"
        )


def stat_key(st: os.stat_result) -> tuple[int, ...]:
    """What identifies one version of a file: a rename, a write or a truncate changes it."""
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def read_state(
    path: Path | str, max_bytes: int = DEFAULT_MAX_BYTES
) -> tuple[bytes, tuple[int, ...]]:
    """The bytes of the regular file at ``path`` and the ``stat_key`` they were read at.

    Raises ``FileNotFoundError``, ``StateReadError`` (not a regular file, too
    big, grew past the limit, any other ``OSError``) or ``StateUnstable``
    (changed during each of ``STABLE_READ_ATTEMPTS`` reads). Never blocks on
    the path and never holds more than ``max_bytes + 1`` bytes of it.
    """
    path = Path(path)
    for _ in range(STABLE_READ_ATTEMPTS):
        try:
            # A stat first: a device is refused without being opened at all
            # (opening some has effects); the fstat below is what counts.
            _check(path, os.stat(path), max_bytes)
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
            try:
                before = os.fstat(fd)
                _check(path, before, max_bytes)
                chunks: list[bytes] = []
                total = 0
                while total <= max_bytes:
                    # One read of the whole file (and one byte more, to see EOF).
                    want = min(max(before.st_size + 1 - total, 1 << 16), max_bytes + 1 - total)
                    chunk = os.read(fd, want)
                    if not chunk:
                        break
                    chunks.append(chunk)
                    total += len(chunk)
                if total > max_bytes:
                    raise StateReadError(
                        f"{path} grew past the {max_bytes}-byte limit while it was read"
                        " (--state-max-bytes)"
                    )
                after = os.fstat(fd)
            finally:
                os.close(fd)
            now = os.stat(path)
        except (FileNotFoundError, StateReadError):
            raise
        except OSError as e:
            raise StateReadError(f"cannot read {path}: {e.strerror or e}") from e
        key = stat_key(after)
        if stat_key(before) == key == stat_key(now):
            return b"".join(chunks), key
    raise StateUnstable(f"{path} changed while it was read, {STABLE_READ_ATTEMPTS} times")


@dataclass
class _Outcome:
    """What one read-and-parse found, handed from the worker thread to the loop."""

    kind: str
    """missing, error, unstable, same, refused or parsed."""
    key: tuple[int, ...] | None = None
    data: bytes | None = None
    message: str = ""
    problems: tuple[str, ...] = ()
    snapshot: Snapshot | None = None
    seconds: float = 0.0


class _DirectoryWatch:
    """A minimal inotify watch on one directory, read from the event loop."""

    def __init__(self, directory: Path) -> None:
        # The process's own symbols, libc's among them: find_library("c")
        # would run ``ldconfig -p`` at every start to name the same library.
        libc = ctypes.CDLL(None, use_errno=True)
        fd = libc.inotify_init1(_IN_NONBLOCK | _IN_CLOEXEC)
        if fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1 failed")
        mask = _IN_MODIFY | _IN_CLOSE_WRITE | _IN_MOVED_TO | _IN_CREATE | _IN_DELETE
        if libc.inotify_add_watch(fd, os.fsencode(directory), mask) < 0:
            err = ctypes.get_errno()
            os.close(fd)
            raise OSError(err, f"inotify_add_watch({directory}) failed")
        self.fd = fd

    def events(self) -> list[tuple[int, str]]:
        """Drain pending events: ``(mask, file name)`` in the order they happened."""
        out: list[tuple[int, str]] = []
        while True:
            try:
                buf = os.read(self.fd, 65536)
            except BlockingIOError:
                return out
            offset = 0
            while offset < len(buf):
                _wd, mask, _cookie, length = _EVENT_HEADER.unpack_from(buf, offset)
                offset += _EVENT_HEADER.size
                raw = buf[offset : offset + length].rstrip(b"\0")
                offset += length
                out.append((mask, os.fsdecode(raw)))

    def close(self) -> None:
        os.close(self.fd)


class StateFileSource:
    """Feeds a ``StateHub`` from a YAML state file, live."""

    def __init__(
        self,
        path: Path | str,
        hub: StateHub,
        interval: float = 0.5,
        max_bytes: int = DEFAULT_MAX_BYTES,
        settle: float = SETTLE_SECONDS,
    ) -> None:
        self.path = Path(path)
        self.hub = hub
        self.interval = interval
        self.max_bytes = max_bytes
        self.settle = settle
        self.inline_max_bytes = INLINE_MAX_BYTES
        """Files up to this size are parsed on the loop (0: always in the thread)."""
        self.generation = 0
        self.parser = StateParser()
        self._parse_lock = threading.Lock()
        """The parser is not thread-safe: one read-and-parse at a time, whoever calls."""
        self._published: bytes | None = None
        """The content of the last good file (what the hub holds)."""
        self._stat_key: tuple[int, ...] | None = None
        """The version of the file last read (good or not): the poll reloads on a change."""
        self._refused: bytes | None = None
        """The content of the last bad file, so it is logged once."""
        self._read_error: str | None = None
        """The last unreadable-file message, so each distinct one is logged once."""
        self._missing_logged = False
        self._watch: _DirectoryWatch | None = None
        self._pending: asyncio.TimerHandle | None = None
        self._writing_since: float | None = None
        """Monotonic time of the last IN_MODIFY not yet followed by IN_CLOSE_WRITE."""
        self._settle_handle: asyncio.TimerHandle | None = None
        self._poll_key: tuple[int, ...] | None = None
        self._poll_since = 0.0
        self._wanted = False
        self._force = False
        self._loader: asyncio.Task[None] | None = None
        self._off_loop = OffLoop("state-file")
        """The loader's own thread (niced), not the loop's default pool."""
        self._stopped = asyncio.Event()

    # -- loading -------------------------------------------------------------------

    def load(self, force: bool = False) -> bool:
        """Read, parse and publish now, on the calling thread (start-up and tests).

        On a running loop use ``load_async``, which calls this for small files.
        Returns True when the hub holds this file's current content afterwards.
        """
        return self._finish(self._read_and_parse(force))

    async def load_async(self, force: bool = False) -> bool:
        """``load`` with the reading and parsing in a worker thread; publishes on the loop.

        A file of at most ``INLINE_MAX_BYTES`` is read and parsed on the loop
        instead: it costs about what one listener-reconcile slice does, and it
        keeps a small state's process single-threaded for good (see there).
        """
        try:
            small = os.stat(self.path).st_size <= self.inline_max_bytes
        except OSError:
            small = True  # read_state words the error, at no cost
        if small:
            return self.load(force)
        outcome = await self._off_loop.call(self._read_and_parse, force)
        return self._finish(outcome)

    def _read_and_parse(self, force: bool) -> _Outcome:
        """The part that may take seconds: any thread, never touches the hub or the logs."""
        with self._parse_lock:
            start = time.perf_counter()
            try:
                data, key = read_state(self.path, self.max_bytes)
            except FileNotFoundError:
                return _Outcome("missing")
            except StateUnstable as e:
                return _Outcome("unstable", message=str(e))
            except StateReadError as e:
                with contextlib.suppress(OSError):
                    return _Outcome("error", key=stat_key(os.stat(self.path)), message=str(e))
                return _Outcome("error", message=str(e))
            if data == self._published and not force:
                return _Outcome("same", key=key)
            try:
                snapshot = self.parser.parse(decode_state(data), self.generation + 1)
            except StateError as err:
                return _Outcome("refused", key=key, data=data, problems=tuple(err.problems))
            except Exception as err:
                # A bug in the parser: the state is refused (once per content, as any
                # refusal), never a crash or a traceback at every poll. Where it broke
                # goes with it, for the bug report.
                frame = traceback.extract_tb(err.__traceback__)[-1]
                return _Outcome("refused", key=key, data=data, problems=(
                    f"kpx could not parse this state (a bug in kpx, please report it):"
                    f" {type(err).__name__}: {err} at {Path(frame.filename).name}:"
                    f"{frame.lineno}",))
            prepare_off_loop(self.hub, snapshot, self._fresh_documents(snapshot))
            return _Outcome("parsed", key=key, data=data, snapshot=snapshot,
                            seconds=time.perf_counter() - start)

    def _fresh_documents(self, snapshot: Snapshot) -> int:
        """Documents the last parse decoded anew (an incremental parse reuses the rest)."""
        last = self.parser.last
        return last.subset + last.pyyaml if last.mode == "chunks" else (
            len(snapshot.services) + len(snapshot.slices))

    def _finish(self, out: _Outcome) -> bool:
        """Log, count and publish what ``_read_and_parse`` found (on the loop's thread)."""
        if out.kind == "missing":
            self._stat_key = None
            if not self._missing_logged:
                log.warning("state file %s does not exist; keeping the last good state", self.path)
                self._missing_logged = True
            return False
        self._missing_logged = False
        if out.kind == "unstable":
            # A later event or poll sees the rest; the key forces that poll.
            self._stat_key = None
            log.debug("%s; waiting for the writer", out.message)
            return False
        self._stat_key = out.key
        if out.kind == "error":
            if out.message != self._read_error:
                self._read_error = out.message
                metrics.STATE_RELOAD_ERRORS.inc()
                log.error("state file refused: %s; the last good state stays in force",
                          out.message)
            return False
        self._read_error = None
        if out.kind == "same":
            return True
        assert out.data is not None
        if out.kind == "refused":
            if out.data != self._refused:
                self._refused = out.data
                metrics.STATE_RELOAD_ERRORS.inc()
                log.error(
                    "state file %s refused (%d problem%s); the last good state stays in force:"
                    "\n  %s",
                    self.path,
                    len(out.problems),
                    "" if len(out.problems) == 1 else "s",
                    "\n  ".join(out.problems),
                )
            return False
        snapshot = out.snapshot
        assert snapshot is not None
        self.generation = snapshot.generation
        self._published = out.data
        self._refused = None
        log.info(
            "state file %s: generation %d (%d nodes, %d services, %d endpoint slices), "
            "read and parsed in %.0f ms",
            self.path,
            snapshot.generation,
            len(snapshot.nodes),
            len(snapshot.services),
            len(snapshot.slices),
            out.seconds * 1000,
        )
        log.debug("state file %s: %s", self.path, self.parser.last)
        self.hub.publish(snapshot)
        return True

    def reload(self) -> None:
        """SIGHUP: re-read even if nothing seems to have changed."""
        log.info("reloading %s on request", self.path)
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            self.load(force=True)
            return
        self._request(force=True)

    # -- triggers ------------------------------------------------------------------

    def _request(self, force: bool = False) -> None:
        """Ask for a load; loads run one at a time, and a request during one runs after it."""
        self._wanted = True
        self._force |= force
        if self._loader is None or self._loader.done():
            self._loader = asyncio.get_running_loop().create_task(
                self._drain(), name="state-file-load"
            )

    async def _drain(self) -> None:
        while self._wanted and not self._stopped.is_set():
            force, self._wanted, self._force = self._force, False, False
            try:
                await self.load_async(force)
            except Exception:
                log.exception("unexpected error loading %s", self.path)

    def _schedule(self) -> None:
        if self._pending is None:
            loop = asyncio.get_running_loop()
            self._pending = loop.call_later(DEBOUNCE_SECONDS, self._fire)

    def _fire(self) -> None:
        self._pending = None
        if self._writing_since is None:
            self._request()

    def _on_events(self) -> None:
        """Follow the writer: IN_MODIFY opens a write, IN_CLOSE_WRITE / IN_MOVED_TO end it."""
        assert self._watch is not None
        touched = False
        for mask, name in self._watch.events():
            if name != self.path.name:
                continue
            touched = True
            if mask & (_IN_CLOSE_WRITE | _IN_MOVED_TO | _IN_DELETE):
                self._writing_since = None
            elif mask & (_IN_MODIFY | _IN_CREATE):
                self._writing_since = time.monotonic()
        if not touched:
            return
        if self._writing_since is None:
            if self._settle_handle is not None:
                self._settle_handle.cancel()
                self._settle_handle = None
            self._schedule()
        elif self._settle_handle is None:
            self._settle_handle = asyncio.get_running_loop().call_later(
                self.settle, self._settle_check
            )

    def _settle_check(self) -> None:
        """A writer holds the file open: read it once it has been quiet for ``settle``."""
        self._settle_handle = None
        if self._watch is not None:
            self._on_events()
        since = self._writing_since
        if since is None:
            return
        quiet = time.monotonic() - since
        if quiet < self.settle:
            self._settle_handle = asyncio.get_running_loop().call_later(
                self.settle - quiet, self._settle_check
            )
            return
        log.info("state file %s is still open for writing but quiet for %.1fs; reading it",
                 self.path, quiet)
        self._writing_since = None
        self._schedule()

    def _poll(self) -> None:
        """The safety net: a ``stat`` change nobody announced (or no inotify at all)."""
        if self._watch is not None:
            self._on_events()  # Events first: a write in progress is not a change yet.
        try:
            key: tuple[int, ...] | None = stat_key(os.stat(self.path))
        except OSError:
            key = None
        if key == self._stat_key:
            self._poll_key = None
            return
        if self._watch is not None:
            if self._writing_since is None:
                self._schedule()
            return
        # No inotify: nothing says a write is over, so wait until stat stops changing.
        now = time.monotonic()
        if key != self._poll_key:
            self._poll_key, self._poll_since = key, now
        elif now - self._poll_since >= self.settle:
            self._poll_key = None
            self._schedule()

    async def run(self) -> None:
        """Load once, then follow the file until ``stop``."""
        loop = asyncio.get_running_loop()
        try:
            self._watch = _DirectoryWatch(self.path.parent)
            loop.add_reader(self._watch.fd, self._on_events)
        except OSError as e:
            log.warning("no inotify for %s (%s); polling every %.1fs, reading a change once "
                        "it has been still for %.1fs", self.path, e, self.interval, self.settle)
        try:
            await self.load_async()
            while not self._stopped.is_set():
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.interval):
                        await self._stopped.wait()
                if not self._stopped.is_set():
                    self._poll()
        finally:
            if self._watch is not None:
                loop.remove_reader(self._watch.fd)
                self._watch.close()
                self._watch = None
            for handle in (self._pending, self._settle_handle):
                if handle is not None:
                    handle.cancel()
            self._pending = self._settle_handle = None
            if self._loader is not None:
                self._loader.cancel()
            self._off_loop.close()

    def stop(self) -> None:
        self._stopped.set()
