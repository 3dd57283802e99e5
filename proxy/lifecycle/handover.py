"""The wire of a listener handover between two ``kpx node`` processes of one namespace.

Owns: the frames on a handover connection (an abstract UNIX stream socket,
``proxy.lifecycle.ownership`` names it) and passing file descriptors over it with
``SCM_RIGHTS``, at most ``MAX_FDS`` per ``sendmsg``, as HAProxy's seamless
reload (``expose-fd listeners``) and nginx's binary upgrade pass their
listening sockets: the socket itself moves, so its accept queue is never
dropped and there is no moment without a listener.

Never: decide when to hand over (``proxy.lifecycle.ownership``, ``proxy.commands.wiring``) or
touch a listener (``proxy.userspace.dataplane``). Received fds are returned raw; a
frame that does not parse, or descriptors the kernel had to truncate
(``MSG_CTRUNC``), abort the handover with ``HandoverError``, closing every
fd received so far: the caller falls back to binding its own sockets.

A frame is ``kind`` (one byte), a 4-byte big-endian length and that many
bytes of JSON. The descriptors sent with a frame ride on its first byte; a
stream socket may deliver them with an earlier ``recvmsg`` than the frame's
end, so the reader keeps one FIFO of fds and gives each frame its ``fds``
count from it, in order.

Exchange (successor S, stopping owner O, after S connected to O's handover name)::

    S: WANT {"listeners": true|false, "queue": true|false, "mode": "userspace"|"nfqueue"}
    O: LISTENERS {"keys": [[addr, port], ...]} + fds   (listeners only, batches)
    O: END {"count": n}
    S: READY {}              (S has applied its first state and accepts too)
    O: OWNER {} + owner fd   (O stopped accepting; the owner name moves to S)

``queue``: S takes an nfqueue socket too (``proxy.nfqueue``); only then
does O pass one, keyed ``("nfqueue", queue number)``. ``mode``: S's
``--proxy-mode`` (absent from an older kpx). An O in nfqueue mode passes a
userspace-mode S no socket (``END {"count": 0}``) and goes on deciding SYNs
until S is READY, which S says once it has removed O's queueing rules. It
answers any other ``WANT`` without ``queue`` ``FREE``: it gives the
namespace up at once, and S claims it once released (an older kpx would
hold the queue bound and never read it). ``BUSY`` (another successor is
taking over) and ``FREE`` (O already gave up the namespace: just claim it)
also answer a ``WANT`` that comes too late.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import json
import socket
import struct
import time
from collections import deque
from typing import Any

MAX_FDS = 250
"""Descriptors per ``sendmsg``: below the kernel's ``SCM_MAX_FD`` (253)."""
_RECV_FDS = 253
_HEADER = struct.Struct("!cI")
MAX_FRAME = 1 << 20
"""A frame's JSON is a batch of keys (~30 bytes each): anything larger is garbage."""

WANT = b"W"
LISTENERS = b"L"
END = b"E"
READY = b"R"
OWNER = b"O"
BUSY = b"B"
FREE = b"F"


class HandoverError(RuntimeError):
    """The handover connection broke or said something unexpected."""


class HandoverTimeout(HandoverError):
    """The peer is still there but did not answer in time."""


def encode(kind: bytes, payload: dict[str, Any] | None = None) -> bytes:
    body = json.dumps(payload or {}, separators=(",", ":")).encode()
    return _HEADER.pack(kind, len(body)) + body


def send_frame(sock: socket.socket, kind: bytes, payload: dict[str, Any] | None = None,
               fds: list[int] | None = None) -> None:
    """Send one frame (and ``fds`` on its first byte) on a *blocking* socket."""
    data = encode(kind, payload)
    anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
    sent = sock.sendmsg([data], anc)
    if sent < len(data):  # the descriptors went with the first part
        sock.sendall(data[sent:])


async def send_frame_async(sock: socket.socket, kind: bytes,
                           payload: dict[str, Any] | None = None,
                           fds: list[int] | None = None, timeout: float = 5.0) -> None:
    """``send_frame`` on a non-blocking socket without blocking the event loop."""
    loop = asyncio.get_running_loop()
    data = encode(kind, payload)
    anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
    deadline = loop.time() + timeout
    while data:
        try:
            sent = sock.sendmsg([data], anc)
        except (BlockingIOError, InterruptedError):
            await _ready(sock, write=True, timeout=deadline - loop.time())
            continue
        data, anc = data[sent:], []  # the descriptors went with the first byte


class FrameReader:
    """Frames, and the descriptors sent with them, from one stream socket."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._buf = b""
        self._fds: deque[int] = deque()
        self.eof = False

    def _feed(self) -> None:
        """One ``recvmsg``: may raise BlockingIOError on a non-blocking socket."""
        data, anc, flags, _ = self.sock.recvmsg(65536, socket.CMSG_SPACE(_RECV_FDS * 4))
        for level, kind, raw in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds = array.array("i")
                fds.frombytes(raw[: len(raw) - len(raw) % fds.itemsize])
                self._fds.extend(fds)
        if flags & socket.MSG_CTRUNC:
            raise HandoverError("descriptors truncated in transit")
        if not data:
            self.eof = True
        self._buf += data

    def _frame(self) -> tuple[bytes, dict[str, Any]] | None:
        if len(self._buf) < _HEADER.size:
            return None
        kind, size = _HEADER.unpack_from(self._buf)
        if size > MAX_FRAME:
            raise HandoverError(f"oversized frame ({size} bytes)")
        end = _HEADER.size + size
        if len(self._buf) < end:
            return None
        try:
            payload = json.loads(self._buf[_HEADER.size:end])
        except ValueError as exc:
            raise HandoverError(f"bad frame: {exc}") from None
        if not isinstance(payload, dict):
            raise HandoverError("bad frame: not an object")
        self._buf = self._buf[end:]
        return kind, payload

    def take_fds(self, n: int) -> list[int]:
        """The next ``n`` descriptors received, in the order they were sent."""
        if n > len(self._fds):
            raise HandoverError(f"{n} descriptors announced, {len(self._fds)} received")
        return [self._fds.popleft() for _ in range(n)]

    def read(self, timeout: float) -> tuple[bytes, dict[str, Any]]:
        """The next frame, on a blocking socket. Raises HandoverError (EOF, timeout too)."""
        deadline = time.monotonic() + timeout
        while (frame := self._frame()) is None:
            if self.eof:
                raise HandoverError("connection closed")
            left = deadline - time.monotonic()
            if left <= 0:
                raise HandoverTimeout(f"no answer in {timeout:.1f}s")
            self.sock.settimeout(left)
            try:
                self._feed()
            except TimeoutError:
                raise HandoverTimeout(f"no answer in {timeout:.1f}s") from None
            except OSError as exc:
                raise HandoverError(str(exc)) from exc
        return frame

    async def read_async(self, timeout: float | None) -> tuple[bytes, dict[str, Any]]:
        """The next frame, on a non-blocking socket. Raises HandoverError (EOF, timeout too)."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while (frame := self._frame()) is None:
            if self.eof:
                raise HandoverError("connection closed")
            try:
                self._feed()
            except (BlockingIOError, InterruptedError):
                left = None if deadline is None else deadline - loop.time()
                try:
                    await _ready(self.sock, write=False, timeout=left)
                except TimeoutError:
                    raise HandoverTimeout(f"no answer in {timeout:.1f}s") from None
            except OSError as exc:
                raise HandoverError(str(exc)) from exc
        return frame

    def close(self) -> None:
        """Close every descriptor received and not taken, and the socket."""
        while self._fds:
            with contextlib.suppress(OSError):
                socket.close(self._fds.popleft())
        self.sock.close()


async def _ready(sock: socket.socket, write: bool, timeout: float | None) -> None:
    """Wait until ``sock`` is readable (or writable); TimeoutError after ``timeout``."""
    if timeout is not None and timeout <= 0:
        raise TimeoutError
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[None] = loop.create_future()
    fd = sock.fileno()

    def wake() -> None:
        if not fut.done():
            fut.set_result(None)

    (loop.add_writer if write else loop.add_reader)(fd, wake)
    try:
        async with asyncio.timeout(timeout):
            await fut
    finally:
        (loop.remove_writer if write else loop.remove_reader)(fd)


def peer_pid_uid(sock: socket.socket) -> tuple[int, int]:
    """``(pid, uid)`` of the peer of a connected UNIX socket (``SO_PEERCRED``)."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, _gid = struct.unpack("3i", raw)
    return pid, uid
