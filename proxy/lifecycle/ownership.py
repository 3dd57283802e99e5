"""One ``kpx node`` per network namespace: ownership, presence and the routing lock.

Owns: four kinds of abstract UNIX socket names, which the kernel scopes to
the network namespace and frees when the last fd closes (exit, crash,
SIGKILL alike), so no lock file can go stale and no two namespaces collide:

- ``@kpx-node`` (the *owner* name): held by the instance that serves the
  namespace, from start until it stops accepting after SIGTERM (then the
  socket itself is passed to the successor, or closed). A second
  instance cannot bind it and fails fast, naming the owner's pid (read with
  ``SO_PEERCRED``: the owner socket listens, so a connect needs no answer;
  the owner's event loop accepts and closes them, ``attach``);
- ``@kpx-node.live.<pid>`` (a *presence* name): held for the process's
  whole life, drain included. Whoever exits last sees no other presence and
  may remove the shared return-path routing; anyone else leaves it alone;
- ``@kpx-node.handover.<pid>``: bound by an owner the moment it starts to
  stop, so a successor started "at once" takes over instead of failing as a
  mistaken second instance would. A single-process owner listens on it
  (``offer``): one successor connects, receives every NodePort listening
  socket (``proxy.lifecycle.handover``: fd passing; in nfqueue mode the
  queue's socket, to a successor that asks for it), accepts on them once it has
  applied its first state, says so, and then receives the owner socket
  itself, so the owner name is never free in between and the listeners never
  stop listening. Meanwhile the old owner keeps accepting; it answers any
  other asker ``BUSY`` (that one fails fast). The ``--workers`` supervisor
  only binds the name (``stopping``): a successor then waits, bounded, for
  the owner name as before;
- ``@kpx-node.routing``: a short mutex around every change to the routing,
  so "no other presence, remove" and "present, install" never interleave.

Never: touch routing, bind or watch a port itself (it passes on the sockets
the dataplane hands it, and closes received ones only when no dataplane got
them), or look at any other namespace (``/proc/net/unix`` lists the
abstract names of the reader's namespace).

Only a process whose owner is stopping offers anything: a mistaken second
instance finds no handover socket to ask, and fails fast.

The ``--workers N`` supervisor holds ownership for its workers: they inherit
its owner and presence sockets. Each worker releases its owner copy once its
own listeners are closed, the supervisor its copy at SIGTERM, so the name is
free exactly when nothing of the old instance listens any more; presence
lasts until the supervisor, the last of them, exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from proxy.lifecycle.handover import (
    BUSY,
    END,
    FREE,
    LISTENERS,
    MAX_FDS,
    OWNER,
    READY,
    WANT,
    FrameReader,
    HandoverError,
    HandoverTimeout,
    encode,
    peer_pid_uid,
    send_frame,
    send_frame_async,
)

log = logging.getLogger(__name__)

BASE_NAME = "kpx-node"
SUCCESSOR_WAIT = 10.0
"""How long a new instance waits for an owner that is already stopping."""
LOCK_WAIT = 10.0
"""How long a routing change waits for another process's change to finish."""
ASK_TIMEOUT = 2.0
"""How long either side of a handover waits for the other's next frame while transferring."""
OWNER_BACKLOG = 64

ListenerKey = tuple[str, int]
Listeners = Callable[[Mapping[str, Any]], list[tuple[ListenerKey, socket.socket]] | None]
"""What a stopping owner passes on, given the successor's WANT frame (``Offer.wait``)."""

_POLL = 0.02
_PROC_NET_UNIX = Path("/proc/net/unix")


class OwnershipError(RuntimeError):
    """Another kpx node serves this namespace; the message says which and what to do."""


def _bind(name: str, listen: bool = False) -> socket.socket:
    """A socket bound to the abstract ``name``; OSError(EADDRINUSE) if it is taken."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_NONBLOCK)
    try:
        s.bind("\0" + name)
        if listen:
            s.listen(64)
    except BaseException:
        s.close()
        raise
    return s


def abstract_names(prefix: str, path: Path = _PROC_NET_UNIX) -> set[str]:
    """Abstract socket names in this namespace that start with ``prefix`` (no ``@``)."""
    out: set[str] = set()
    try:
        lines = path.read_text(errors="replace").splitlines()[1:]
    except OSError:
        return out
    for line in lines:
        fields = line.split()
        if len(fields) >= 8 and fields[7].startswith("@" + prefix):
            out.add(fields[7][1:])
    return out


def live_pids(base: str = BASE_NAME, path: Path = _PROC_NET_UNIX) -> set[int]:
    """Pids of every kpx node present in this namespace (serving or draining)."""
    prefix = f"{base}.live."
    pids: set[int] = set()
    for name in abstract_names(prefix, path):
        with contextlib.suppress(ValueError):
            pids.add(int(name[len(prefix):]))
    return pids


def owner_pid(base: str = BASE_NAME) -> int | None:
    """The pid that holds the owner name, or None if nobody does (or it cannot be told)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_NONBLOCK)
    try:
        s.connect("\0" + base)
        return peer_pid_uid(s)[0] or None
    except OSError:
        return None
    finally:
        s.close()


def _stopping(base: str, pid: int | None) -> bool:
    """Is the owner *pid* handing over? (Its pid named in a handover name.)

    True too when no owner answered: the name is being freed right now (or
    the owner cannot be asked), so another try is worth it, within the wait.
    """
    return pid is None or f"{base}.handover.{pid}" in abstract_names(f"{base}.handover.")


@contextlib.contextmanager
def routing_lock(base: str = BASE_NAME, timeout: float = LOCK_WAIT) -> Iterator[bool]:
    """Hold the namespace's routing mutex; yields False if it could not be had in time.

    A holder that dies frees it at once (the kernel closes its fd), so the
    timeout only guards against a live process stuck in ``ip``/``nft``; the
    change then goes ahead, as it would have without kpx's help.
    """
    deadline = time.monotonic() + timeout
    while (sock := _try_routing_lock(base)) is None and time.monotonic() < deadline:
        time.sleep(_POLL)
    with _holding(sock, timeout):
        yield sock is not None


@contextlib.asynccontextmanager
async def routing_lock_async(
    base: str = BASE_NAME, timeout: float = LOCK_WAIT
) -> AsyncIterator[bool]:
    """``routing_lock`` for the event loop: waits without blocking it."""
    deadline = time.monotonic() + timeout
    while (sock := _try_routing_lock(base)) is None and time.monotonic() < deadline:
        await asyncio.sleep(_POLL)
    with _holding(sock, timeout):
        yield sock is not None


def _try_routing_lock(base: str) -> socket.socket | None:
    """The routing mutex's socket, or None while another process holds it."""
    try:
        return _bind(f"{base}.routing")
    except OSError as exc:
        if exc.errno != errno.EADDRINUSE:
            raise
    return None


@contextlib.contextmanager
def _holding(sock: socket.socket | None, timeout: float) -> Iterator[None]:
    if sock is None:
        log.warning("routing lock still held after %.0fs; going ahead", timeout)
    try:
        yield
    finally:
        if sock is not None:
            sock.close()


class Ownership:
    """This process's claim on its network namespace. ``acquire`` it before anything else."""

    def __init__(self, base: str, owner: socket.socket | None, presence: socket.socket,
                 claim: Claim | None = None) -> None:
        self.base = base
        self._owner: socket.socket | None = owner
        self._presence: socket.socket | None = presence
        self._handover: socket.socket | None = None
        self.pid = os.getpid()
        self._loop: asyncio.AbstractEventLoop | None = None
        self.claim = claim
        """A successor's pending handover: the listeners it received, the owner name to come."""

    @classmethod
    def acquire(cls, base: str = BASE_NAME, successor_wait: float = SUCCESSOR_WAIT,
                listeners: bool = True, standby: float = 0.0, queue: bool = False,
                mode: str | None = None) -> Ownership:
        """Take the owner name (or a stopping owner's handover), then announce presence.

        Owner first: a mistaken second instance must not even look present,
        or a real owner exiting at that moment would keep routing nobody
        needs. Raises ``OwnershipError`` when another instance serves here.
        When that one is stopping and offers a handover, this one takes it:
        with ``listeners``, it returns holding the old one's listening
        sockets (``claim``), and ``take_over`` completes the move of the
        owner name once this process serves; without, it waits until the old
        one has closed them and passed the owner name. When the owner offers
        nothing (the ``--workers`` supervisor, or an owner between its
        window's end and its exit), it waits up to ``successor_wait`` for the
        owner name.

        ``standby`` seconds (``--takeover-wait``): an owner that serves and is
        not stopping is waited for instead of refused, polling every
        ``STANDBY_POLL``, and taken over as soon as it starts to stop. That is
        a DaemonSet's surge pod: it starts beside the old pod (one network
        namespace, the node's), the old pod is deleted once the new one is
        ready, and its SIGTERM is the handover this process was waiting for.

        ``queue``: take an nfqueue socket over too (``--proxy-mode nfqueue``),
        among the listeners. Only a successor that asks is given one: any
        other would hold the queue bound and never read it. ``mode``
        (``--proxy-mode``) tells the old one which this one is: an
        nfqueue-mode owner goes on deciding SYNs for a userspace-mode
        successor until it serves, and hands it no socket.
        """
        standby_until = time.monotonic() + standby
        said = False
        while standby > 0:
            holder = owner_pid(base)
            if holder is None and not _taken(base):
                break  # free: claim it below
            if _stopping(base, holder) and holder is not None:
                break
            if time.monotonic() >= standby_until:
                raise OwnershipError(_conflict_message(base))
            if not said:
                said = True
                log.info("kpx node (pid %s) serves this network namespace; standing by to "
                         "take over when it stops (up to %.0fs)", holder, standby)
            time.sleep(STANDBY_POLL)
        deadline = time.monotonic() + successor_wait
        asked = False
        busy_until: float | None = None
        owner: socket.socket | None = None
        claim: Claim | None = None
        while True:
            try:
                owner = _bind(base, listen=True)
                break
            except OSError as exc:
                if exc.errno != errno.EADDRINUSE:
                    raise OwnershipError(f"cannot claim this network namespace: {exc}") from exc
            holder = owner_pid(base)
            if not _stopping(base, holder):
                raise OwnershipError(_conflict_message(base))
            if holder is not None and not asked:
                asked = True  # one try per start: a failed one falls back to waiting
                try:
                    got = _ask(base, holder, listeners, deadline, queue, mode)
                except _Busy as busy:
                    # Busy with a successor that may just have died: the owner
                    # notices at once, so ask again for a moment before failing.
                    now = time.monotonic()
                    busy_until = busy_until or now + BUSY_GRACE
                    if now >= busy_until:
                        raise OwnershipError(str(busy)) from None
                    asked = False
                    got = None
                if got is not None:
                    owner, claim = got
                    break
            if time.monotonic() >= deadline:
                raise OwnershipError(_conflict_message(base))
            time.sleep(_POLL)
        try:
            presence = _bind(f"{base}.live.{os.getpid()}")
        except OSError as exc:
            if owner is not None:
                owner.close()
            if claim is not None:
                claim.close()
            raise OwnershipError(f"cannot announce this process: {exc}") from exc
        return cls(base, owner, presence, claim)

    @property
    def owner(self) -> bool:
        return self._owner is not None

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Accept and close the connections ``owner_pid`` makes, on ``loop``.

        ``SO_PEERCRED`` needs no accept, but an unaccepted connection stays
        in the backlog; without this, enough failed second starts would fill
        it and later ones could no longer name this process.
        """
        if self._owner is not None and self._loop is None:
            self._loop = loop
            loop.add_reader(self._owner.fileno(), self._answer)

    def _answer(self) -> None:
        if self._owner is None:
            return
        with contextlib.suppress(OSError):
            conn, _ = self._owner.accept()
            conn.close()

    def release(self) -> None:
        """Give up the owner name (stop): a successor may take over from here on.

        Presence stays until ``close``: this process may still be draining
        connections that need the return path. A forked worker holds a copy
        of the owner socket and releases it at the same point of its own
        stop, so the name is free once the last worker has closed its ports.
        """
        if self._owner is not None:
            if self._loop is not None:
                with contextlib.suppress(Exception):  # the loop may be closed already
                    self._loop.remove_reader(self._owner.fileno())
                self._loop = None
            self._owner.close()
            self._owner = None

    def stopping(self) -> None:
        """Say "handing over": a successor started now waits instead of failing.

        Only the process that acquired says it (the pid in the name is the
        owner's, which is what ``SO_PEERCRED`` reports); it lasts until ``close``.
        The successor waits for the owner name: use ``offer`` to hand the
        listeners over too.
        """
        if self._handover is None and self._owner is not None and os.getpid() == self.pid:
            with contextlib.suppress(OSError):
                self._handover = _bind(f"{self.base}.handover.{self.pid}")

    def offer(self, loop: asyncio.AbstractEventLoop) -> Offer | None:
        """Say "handing over" and offer this process's listeners to one successor.

        None if this process cannot offer (not the owner, or the name could
        not be bound); ``stopping`` semantics hold either way.
        """
        if self._handover is not None or self._owner is None or os.getpid() != self.pid:
            return None
        try:
            sock = _bind(f"{self.base}.handover.{self.pid}", listen=True)
        except OSError as exc:
            log.warning("cannot offer a handover: %s", exc)
            return None
        self._handover = sock
        return Offer(self, sock, loop)

    async def take_over(self, ready: Awaitable[object]) -> bool:
        """A successor's end of the handover: READY once ``ready`` is done, then own.

        Returns True once this process holds the owner name (the old one
        passed it, or exited and so freed it); False if neither happened,
        which is logged: this process keeps serving on the listeners it holds.
        """
        claim, self.claim = self.claim, None
        if claim is None:
            return self.owner
        owner = await claim.complete(ready)
        if owner is None:
            # The old one is gone without passing the name: it is free, or
            # about to be (a crash frees it when the kernel closes the fd).
            deadline = time.monotonic() + SUCCESSOR_WAIT
            while owner is None:
                try:
                    owner = _bind(self.base, listen=True)
                except OSError as exc:
                    if exc.errno != errno.EADDRINUSE or time.monotonic() >= deadline:
                        log.error("could not take the owner name over from pid %d: %s; "
                                  "serving on without it", claim.from_pid, exc)
                        return False
                    await asyncio.sleep(_POLL)
        self._owner = owner
        return True

    def close(self) -> None:
        """Release everything (exit)."""
        self.release()
        if self.claim is not None:
            self.claim.close()
            self.claim = None
        for attr in ("_handover", "_presence"):
            s = getattr(self, attr)
            if s is not None:
                s.close()
                setattr(self, attr, None)


STANDBY_POLL = 0.1
"""How often a standing-by successor looks for its owner's handover name: well
inside the owner's ``--handover-wait``, and cheap (one connect, one read of
``/proc/net/unix``)."""


def _taken(base: str) -> bool:
    """Is the owner name bound (by a process this one cannot name, perhaps)?"""
    try:
        _bind(base).close()
    except OSError as exc:
        return exc.errno == errno.EADDRINUSE
    return False


BUSY_GRACE = 0.5
"""Seconds a successor keeps asking an owner that answers BUSY before it gives up.

BUSY means another successor is taking over; if that one has just died, the
owner is offering again within milliseconds, so a short grace turns that
race into a takeover while a real third instance still fails in well under
a second."""


class _Busy(OwnershipError):
    """The owner answered BUSY: another successor is taking over."""


class _Declined(Exception):
    """A stopping owner told its successor FREE: it cannot take this owner's sockets over."""


def _ask(base: str, holder: int, listeners: bool, deadline: float, queue: bool = False,
         mode: str | None = None) -> tuple[socket.socket | None, Claim | None] | None:
    """Ask the stopping owner ``holder`` for its handover (``Ownership.acquire``).

    Returns ``(owner socket, None)`` when the owner name was passed at once
    (``listeners`` False), ``(None, claim)`` with the listeners received, or
    None when the owner offers nothing (then wait for the name). Raises
    ``OwnershipError`` when another successor is already taking over.
    """
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.settimeout(ASK_TIMEOUT)
        conn.connect(f"\0{base}.handover.{holder}")
        pid, _uid = peer_pid_uid(conn)
    except OSError:  # only the name (no offer), or gone already
        conn.close()
        return None
    reader = FrameReader(conn)
    received: dict[ListenerKey, socket.socket] = {}
    if pid != holder:  # not the owner's own handover socket: ask nobody else
        reader.close()
        return None
    try:
        # An owner busy with another successor answers BUSY as it accepts and
        # hangs up, maybe before our request is through: its answer is still
        # there to read.
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            want: dict[str, object] = {"listeners": listeners, "queue": queue}
            if mode is not None:
                want["mode"] = mode
            send_frame(conn, WANT, want)
        wait = max(deadline - time.monotonic(), ASK_TIMEOUT)
        kind, msg = reader.read(wait)
        if kind == BUSY:
            raise _Busy(
                f"another kpx node is already taking this network namespace over from pid "
                f"{holder}; this one exits. {_conflict_message(base)}")
        if kind == FREE:
            reader.close()
            return None
        while kind == LISTENERS:
            keys = msg.get("keys")
            if not isinstance(keys, list) or len(keys) > MAX_FDS:
                raise HandoverError("bad listener batch")
            for key, fd in zip(keys, reader.take_fds(len(keys)), strict=True):
                sock = socket.socket(fileno=fd)
                if not (isinstance(key, list) and len(key) == 2 and isinstance(key[0], str)
                        and isinstance(key[1], int)) or (key[0], key[1]) in received:
                    sock.close()
                    raise HandoverError(f"bad listener key {key!r}")
                received[(key[0], key[1])] = sock
            kind, msg = reader.read(ASK_TIMEOUT)
        if kind == END:
            if msg.get("count") != len(received):
                raise HandoverError(f"{len(received)} listeners received, "
                                    f"{msg.get('count')} sent")
            conn.setblocking(False)
            log.info("taking over from kpx node pid %d: received %d listening socket(s)",
                     holder, len(received))
            return None, Claim(reader, holder, received)
        if kind == OWNER:
            owner = socket.socket(fileno=reader.take_fds(1)[0])
            owner.listen(OWNER_BACKLOG)  # SO_PEERCRED names the process that listened last
            reader.close()
            for sock in received.values():
                sock.close()
            log.info("took this network namespace over from kpx node pid %d", holder)
            return owner, None
        raise HandoverError(f"unexpected frame {kind!r}")
    except HandoverError as exc:
        log.warning("handover from kpx node pid %d failed: %s; waiting for it to release "
                    "the namespace instead", holder, exc)
    except BaseException:
        for sock in received.values():
            sock.close()
        reader.close()
        raise
    for sock in received.values():
        sock.close()
    reader.close()
    return None


class Claim:
    """A successor's pending handover: the listeners received, the owner name to come."""

    def __init__(self, reader: FrameReader, from_pid: int,
                 listeners: dict[ListenerKey, socket.socket]) -> None:
        self._reader = reader
        self.from_pid = from_pid
        self._listeners = listeners

    def take_listeners(self) -> dict[ListenerKey, socket.socket]:
        """The listening sockets received, by (address, port); the caller owns them now."""
        out, self._listeners = self._listeners, {}
        return out

    async def complete(self, ready: Awaitable[object]) -> socket.socket | None:
        """Say READY once ``ready`` is done; return the owner socket the old one passes.

        The old one keeps accepting until READY, so nothing waits on an
        un-watched queue while this process loads its state; if it gives up
        waiting first (its ``--shutdown-grace``), it passes the owner name
        anyway and this process accepts once ``ready``. None if the old one
        went away without passing it.
        """
        reader = self._reader
        waiting = asyncio.ensure_future(ready)
        owner_frame = asyncio.ensure_future(reader.read_async(None))
        try:
            done, _ = await asyncio.wait({waiting, owner_frame},
                                         return_when=asyncio.FIRST_COMPLETED)
            if waiting in done and not owner_frame.done():
                with contextlib.suppress(OSError):
                    await send_frame_async(reader.sock, READY)
                    log.info("serving on the listeners of kpx node pid %d; told it to stop "
                             "accepting", self.from_pid)
            kind, _ = await owner_frame
            if kind != OWNER:
                raise HandoverError(f"unexpected frame {kind!r}")
            owner = socket.socket(fileno=reader.take_fds(1)[0])
            owner.listen(OWNER_BACKLOG)  # SO_PEERCRED names the process that listened last
            log.info("took this network namespace over from kpx node pid %d", self.from_pid)
            return owner
        except (HandoverError, OSError) as exc:
            log.warning("kpx node pid %d went away during the handover: %s", self.from_pid, exc)
            return None
        finally:
            owner_frame.cancel()
            waiting.cancel()
            self.close()

    def close(self) -> None:
        for sock in self._listeners.values():
            sock.close()
        self._listeners = {}
        self._reader.close()


class Offer:
    """A stopping owner's offer of its listeners to one successor (``Ownership.offer``).

    The connection that comes first is served; any other is answered
    ``BUSY`` (it fails fast), or ``FREE`` once this process has given up
    waiting (it claims the released owner name itself). Only askers of this
    process's own uid (or root) are answered at all.
    """

    def __init__(self, ownership: Ownership, sock: socket.socket,
                 loop: asyncio.AbstractEventLoop) -> None:
        self._ownership = ownership
        self._sock = sock
        self._loop = loop
        self._state = "offering"
        """offering (waiting for a successor), busy (serving one), handed, closed."""
        self.declined = False
        """A successor came that could not take over (``wait``): it waits for the owner name."""
        self._waiter: asyncio.Future[socket.socket] | None = None
        loop.add_reader(sock.fileno(), self._on_connect)

    def _on_connect(self) -> None:
        for _ in range(16):
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            try:
                _pid, uid = peer_pid_uid(conn)
            except OSError:
                conn.close()
                continue
            if uid not in (0, os.getuid()):
                conn.close()
                continue
            waiter = self._waiter
            if self._state == "offering" and waiter is not None and not waiter.done():
                self._state = "busy"
                conn.setblocking(False)
                waiter.set_result(conn)
                continue
            # "offering" without a waiter: the window has just closed.
            answer = BUSY if self._state in ("busy", "handed") else FREE
            with contextlib.suppress(OSError):  # a few bytes into an empty buffer
                conn.setblocking(False)
                conn.send(encode(answer))
            conn.close()

    async def wait(self, listeners: Listeners, window: float, ready_timeout: float
                   ) -> Successor | None:
        """Keep serving until a successor has taken the listeners, or ``window`` passes.

        ``listeners(want)``: the sockets to pass to a successor whose WANT
        frame says ``want`` (``{"listeners": ..., "queue": ..., "mode": ...}``), or None
        if this process cannot hand over to such a one (an nfqueue socket
        to a successor that did not ask for it: it would hold the queue
        bound and never read it). That one is told FREE, to wait for the
        owner name, and this returns None at once: the caller stops and
        releases the name, as without a successor.

        Returns the successor once it said READY (or took the listeners and
        did not say READY within ``ready_timeout``: it holds them, so it
        will serve them once it can); None when nobody came in ``window``,
        or everyone who came went away again. The caller then stops
        accepting and passes the owner name (``Successor.finish``).
        """
        deadline = self._loop.time() + window
        while True:
            self._waiter = self._loop.create_future()
            try:
                async with asyncio.timeout_at(deadline):
                    conn = await self._waiter
            except TimeoutError:
                self._state = "closed"
                return None
            finally:
                self._waiter = None
            try:
                successor = await self._serve(conn, listeners, ready_timeout)
            except _Declined:
                self._state = "closed"
                self.declined = True
                return None
            if successor is not None:
                self._state = "handed"
                return successor
            self._state = "offering"

    async def _serve(self, conn: socket.socket, listeners: Listeners, ready_timeout: float
                     ) -> Successor | None:
        reader = FrameReader(conn)
        pid = -1
        try:
            pid, _uid = peer_pid_uid(conn)
            kind, msg = await reader.read_async(ASK_TIMEOUT)
            if kind != WANT:
                raise HandoverError(f"unexpected frame {kind!r}")
            if msg.get("listeners"):
                socks = listeners(msg)
                if socks is None:
                    log.info("kpx node pid %d cannot take this one's sockets over; told it to "
                             "wait for the namespace, which this one gives up now", pid)
                    with contextlib.suppress(OSError):
                        await send_frame_async(conn, FREE, None, None, ASK_TIMEOUT)
                    reader.close()
                    raise _Declined
                for i in range(0, len(socks), MAX_FDS):
                    batch = socks[i:i + MAX_FDS]
                    await send_frame_async(conn, LISTENERS, {"keys": [list(k) for k, _ in batch]},
                                           [s.fileno() for _, s in batch], ASK_TIMEOUT)
                await send_frame_async(conn, END, {"count": len(socks)}, None, ASK_TIMEOUT)
                log.info("passed %d listening socket(s) to kpx node pid %d; accepting until "
                         "it serves them too (up to %.1fs)", len(socks), pid, ready_timeout)
                try:
                    kind, _ = await reader.read_async(ready_timeout)
                except HandoverTimeout:
                    log.warning("kpx node pid %d took the listeners but is not serving after "
                                "%.1fs; it keeps them queued, this one stops accepting",
                                pid, ready_timeout)
                    return Successor(self._ownership, reader, pid)
                if kind != READY:
                    raise HandoverError(f"unexpected frame {kind!r}")
            return Successor(self._ownership, reader, pid)
        except (HandoverError, OSError) as exc:
            log.warning("handover to kpx node pid %d failed: %s; still accepting", pid, exc)
            reader.close()
            return None

    def close(self) -> None:
        """Stop answering (the handover name stays bound until ``Ownership.close``)."""
        self._state = "closed"
        with contextlib.suppress(Exception):  # the loop may be closed already
            self._loop.remove_reader(self._sock.fileno())


class Successor:
    """The process that took this one's listeners; ``finish`` passes the owner name."""

    def __init__(self, ownership: Ownership, reader: FrameReader, pid: int) -> None:
        self._ownership = ownership
        self._reader = reader
        self.pid = pid

    async def finish(self) -> None:
        """Pass the owner socket (after this process stopped accepting), then release it.

        Passing the socket, not freeing the name, leaves no moment in which a
        third instance could take it.
        """
        owner = self._ownership._owner
        if owner is not None:
            try:
                await send_frame_async(self._reader.sock, OWNER, None, [owner.fileno()],
                                       ASK_TIMEOUT)
            except OSError as exc:
                log.warning("could not pass the owner name to kpx node pid %d: %s; "
                            "releasing it", self.pid, exc)
        self._ownership.release()
        self._reader.close()


def _conflict_message(base: str) -> str:
    pid = owner_pid(base)
    others = sorted(live_pids(base) - {os.getpid()})
    who = f"pid {pid}" if pid else (
        f"pid {', '.join(map(str, others))}" if others else "another process")
    return (
        f"another kpx node ({who}) already serves this network namespace; two would fight "
        f"over its NodePorts and its return-path routing, so this one exits. To restart kpx, "
        f"send the running one SIGTERM (kill -TERM {pid or '<pid>'}) and start the new one: "
        f"the old one stops accepting and hands the namespace over at once, then drains."
    )
