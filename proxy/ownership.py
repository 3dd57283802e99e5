"""One ``kpx node`` per network namespace: ownership, presence and the routing lock.

Owns: four kinds of abstract UNIX socket names, which the kernel scopes to
the network namespace and frees when the last fd closes (exit, crash,
SIGKILL alike), so no lock file can go stale and no two namespaces collide:

- ``@kpx-node`` (the *owner* name): held by the instance that serves the
  namespace, from start until it is told to stop (SIGTERM). A second
  instance cannot bind it and fails fast, naming the owner's pid (read with
  ``SO_PEERCRED``: the owner socket listens, so a connect needs no answer;
  the owner's event loop accepts and closes them, ``attach``);
- ``@kpx-node.live.<pid>`` (a *presence* name): held for the process's
  whole life, drain included. Whoever exits last sees no other presence and
  may remove the shared return-path routing; anyone else leaves it alone;
- ``@kpx-node.handover.<pid>``: bound by an owner the moment it starts to
  stop, so a successor started "at once" waits (bounded) for the owner name
  instead of failing as a mistaken second instance would;
- ``@kpx-node.routing``: a short mutex around every change to the routing,
  so "no other presence, remove" and "present, install" never interleave.

Never: touch routing or ports itself, or look at any other namespace
(``/proc/net/unix`` lists the abstract names of the reader's namespace).

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
import struct
import time
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger(__name__)

BASE_NAME = "kpx-node"
HANDOVER_WAIT = 10.0
"""How long a new instance waits for an owner that is already stopping."""
LOCK_WAIT = 10.0
"""How long a routing change waits for another process's change to finish."""

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
        raw = s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        pid, _uid, _gid = struct.unpack("3i", raw)
        return pid or None
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
    sock: socket.socket | None = None
    while True:
        try:
            sock = _bind(f"{base}.routing")
            break
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                raise
            if time.monotonic() >= deadline:
                log.warning("routing lock still held after %.0fs; going ahead", timeout)
                break
            time.sleep(_POLL)
    try:
        yield sock is not None
    finally:
        if sock is not None:
            sock.close()


class Ownership:
    """This process's claim on its network namespace. ``acquire`` it before anything else."""

    def __init__(self, base: str, owner: socket.socket, presence: socket.socket) -> None:
        self.base = base
        self._owner: socket.socket | None = owner
        self._presence: socket.socket | None = presence
        self._handover: socket.socket | None = None
        self.pid = os.getpid()
        self._loop: asyncio.AbstractEventLoop | None = None

    @classmethod
    def acquire(cls, base: str = BASE_NAME, handover_wait: float = HANDOVER_WAIT) -> Ownership:
        """Take the owner name, then announce this process's presence.

        Owner first: a mistaken second instance must not even look present,
        or a real owner exiting at that moment would keep routing nobody
        needs. Raises ``OwnershipError`` when another instance serves here;
        when that one is already stopping, waits up to ``handover_wait`` for it.
        """
        deadline = time.monotonic() + handover_wait
        holder: int | None = None
        while True:
            try:
                owner = _bind(base, listen=True)
                break
            except OSError as exc:
                if exc.errno != errno.EADDRINUSE:
                    raise OwnershipError(f"cannot claim this network namespace: {exc}") from exc
                # Ask who owns once per wait, not per poll: each ask is a
                # connection the owner has to accept.
                holder = holder or owner_pid(base)
                if _stopping(base, holder) and time.monotonic() < deadline:
                    time.sleep(_POLL)
                    continue
                raise OwnershipError(_conflict_message(base)) from None
        try:
            presence = _bind(f"{base}.live.{os.getpid()}")
        except OSError as exc:
            owner.close()
            raise OwnershipError(f"cannot announce this process: {exc}") from exc
        return cls(base, owner, presence)

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
        """
        if self._handover is None and self._owner is not None and os.getpid() == self.pid:
            with contextlib.suppress(OSError):
                self._handover = _bind(f"{self.base}.handover.{self.pid}")

    def close(self) -> None:
        """Release everything (exit)."""
        self.release()
        for attr in ("_handover", "_presence"):
            s = getattr(self, attr)
            if s is not None:
                s.close()
                setattr(self, attr, None)


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
