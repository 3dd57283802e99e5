"""One listening socket and its accept loop: a NodePort's, or the service VIPs' one.

Owns: the socket bound to one ``(address, nodePort)`` (or the one that
every service VIP's connections are steered to, ``proxy.userspace.sklookup``): open (or adopt one
passed on by the kpx node this one takes over from), SYN filter on or off,
accept with back-off, pause and resume, close. Every accepted socket
goes, still raw, to the ``on_accept`` callback.

Never: decide anything about a connection, read from it, or keep it.
Closing a Listener leaves no LISTEN socket behind: it owns the only fd
(unless its socket was passed on to a successor, which then owns one too).

Why not ``loop.create_server(sock=...)``: read in uvloop 0.23's source and
checked by experiment:

- uvloop does not dup the passed fd. It closes it synchronously in
  ``Server.close()`` and ``detach()``es the Python socket, so that part is
  fine; but
- on EMFILE/ENFILE libuv's "emfile trick" accepts and immediately closes
  every pending connection (clients see connect-OK then EOF: the
  accept-then-close kube-proxy forbids), and on other accept errors uvloop
  silently closes the whole listener (``UVStreamServer._fatal_error``);
- ``pause_reading()`` in ``connection_made`` is ignored (uvloop starts
  reading right after it), so the client would be read before its upstream
  exists.

Our own loop (``add_reader`` + ``accept()``) leaves connections in the
kernel's accept queue while we back off (test_dp_listener's EMFILE test,
under both loops), and hands over a raw socket, which the forwarder relays
without any transport (forwarder.py says why). That is also why the C
accept path would not pay here even with EMFILE solved: it yields a uvloop
transport, and making a transport costs several times what this loop's
accept and socket object do (figures: docs/PERFORMANCE.md, "Listener:
accept path and one epoll set"). It accepts up to ``ACCEPT_BATCH``
connections per readiness callback, with ``_accept()`` and an explicit
family/type: ``socket.accept()`` converts both to enums per connection.

The listening socket carries TCP_NODELAY: accepted sockets inherit it,
which saves the relay one setsockopt per connection.

IPv6: an address with a colon makes an ``AF_INET6`` socket with
``IPV6_V6ONLY`` (``::`` is every local IPv6 address, never IPv4's too: the
IPv4 dataplane has its own ``0.0.0.0`` socket with its own plans). The
IPv6 wildcard never serves ``::1``, as iptables mode has no IPv6 localhost
NodePorts. In ``kpx node`` the ``ip6 kpx_vips`` guard refuses such a SYN
before it gets here (``proxy.userspace.vips``); a dataplane without that
guard (a library user, the test driver) still resets, at accept, a
connection from ``::1`` whose local address is ``::1``.
One ``getsockname`` for those only: every other connection's source says
it cannot be one (``::1`` is reached from ``::1``, unless a program binds
another local source on purpose, and then it is served).

A dataplane's listeners share one ``AcceptSet``: a private epoll set the
event loop watches as a single reader. ``loop.add_reader`` per listener
makes a uvloop handle and poll object for each, several times what an
``epoll.register`` costs, and a big state adds thousands of listeners at
once (same section of docs/PERFORMANCE.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import select
import socket
import struct
from collections.abc import Callable

from proxy.userspace import synfilter

log = logging.getLogger(__name__)

ACCEPT_BATCH = 64
"""Accepts per readiness callback: bounded so one busy port cannot starve the loop."""
BACKOFF_MIN = 0.05
BACKOFF_MAX = 1.0

RESOURCE_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})

OnAccept = Callable[[socket.socket, tuple[str, int], object], None]
"""``on_accept(sock, (client_ip, client_port, ...), node_port)``: IPv6 adds flow info and scope."""

IPV6_LOOPBACK = "::1"


def family_of(address: str) -> socket.AddressFamily:
    """The socket family an address text is of: IPv6 texts have a colon."""
    return socket.AF_INET6 if ":" in address else socket.AF_INET


class AcceptSet:
    """The listening sockets of one dataplane, in one epoll set the loop watches.

    Level-triggered, like ``add_reader``: a listener that left connections
    in its queue (``ACCEPT_BATCH``) is reported again on the next poll.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._ep: select.epoll | None = None
        self._callbacks: dict[int, Callable[[], None]] = {}

    def watch(self, fd: int, callback: Callable[[], None], listener: Listener | None = None
              ) -> None:
        """Call ``callback`` whenever ``fd`` is readable. Raises OSError.

        ``listener`` (whose socket ``fd`` is) is for a set that accepts itself
        (``proxy.userspace.corefwd.CoreAcceptSet``); this one calls back."""
        ep = self._ep
        if ep is None:
            ep = self._ep = select.epoll()
            self.loop.add_reader(ep.fileno(), self._poll)
        ep.register(fd, select.EPOLLIN)
        self._callbacks[fd] = callback

    def unwatch(self, fd: int) -> None:
        """Stop watching ``fd``; call before closing it."""
        if self._callbacks.pop(fd, None) is not None and self._ep is not None:
            self._ep.unregister(fd)

    def _poll(self) -> None:
        ep = self._ep
        if ep is None:
            return
        callbacks = self._callbacks
        for fd, _ in ep.poll(0):
            callback = callbacks.get(fd)  # None: unwatched earlier in this batch
            if callback is None:
                continue
            try:
                callback()
            except Exception:
                # One listener's bug must not starve the others of accepts.
                log.exception("accepting on fd %d failed", fd)

    def close(self) -> None:
        """Release the epoll set; every listener must be closed already. Idempotent."""
        self._callbacks.clear()
        if self._ep is not None:
            self.loop.remove_reader(self._ep.fileno())
            self._ep.close()
            self._ep = None


class Listener:
    """A listening socket on one address and NodePort.

    States: ``serving`` (accepting, no filter), ``dropping`` (accepting,
    external SYNs dropped in the kernel), ``paused`` (not accepting for a
    while: resource back-off or at capacity; the kernel keeps queueing),
    ``closed``.
    """

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        address: str,
        port: int,
        on_accept: OnAccept,
        admit: Callable[[], bool] = lambda: True,
        on_blocked: Callable[[Listener], None] = lambda _: None,
        backlog: int = 1024,
        reuse_port: bool = False,
        label: str = "",
        steer_workers: int = 0,
        accept_set: AcceptSet | None = None,
        steered: bool = False,
    ) -> None:
        self.loop = loop
        self._accept_set = accept_set
        """Where the socket is watched; None: on the loop itself (``add_reader``)."""
        self.address = address
        self.port = port
        self.steered = steered
        """The socket every service VIP's connections are steered to
        (``proxy.userspace.sklookup``): ``on_accept`` is told each one's own
        ``(VIP, port)``, its ``getsockname()``, instead of the nodePort."""
        self.label = label
        self._on_accept = on_accept
        self._admit = admit
        self._on_blocked = on_blocked
        self._backlog = backlog
        self._reuse_port = reuse_port
        self._steer = 0
        self._want_steer = steer_workers
        self._sock: socket.socket | None = None
        self._fd = -1
        self._reading = False
        self._filter: list[synfilter.Instruction] | None = None
        self._backoff = 0.0
        self._resume_handle: asyncio.TimerHandle | None = None
        self._errors_in_episode = 0
        self.family = family_of(address)
        self.refuse_loopback = self.family == socket.AF_INET6 and not steered and (
            address == "::")
        """The IPv6 wildcard: ``::1`` is never served (the module docstring)."""
        self.blocked = False
        """Paused because the dataplane is at its connection limit."""

    def __repr__(self) -> str:
        return f"<Listener {self.address}:{self.port} {self.state}>"

    @property
    def state(self) -> str:
        if self._sock is None:
            return "closed"
        if not self._reading:
            return "paused"
        return "dropping" if self._filter is not None else "serving"

    @property
    def dropping(self) -> bool:
        return self._filter is not None

    @property
    def sock(self) -> socket.socket | None:
        return self._sock

    def open(self, program: list[synfilter.Instruction] | None = None,
             adopt: socket.socket | None = None) -> None:
        """Bind, optionally filter, listen and start accepting. Raises OSError.

        The filter goes on before ``listen()`` so no external SYN can slip
        through in between.

        ``adopt``: a socket already listening on this address and port,
        passed on by the kpx node this one takes over from (``proxy.lifecycle.handover``):
        its accept queue carries on. Its filter is set to ``program`` or
        removed, whatever the old process had on it; on any OSError the
        caller still owns ``adopt``.
        """
        if adopt is not None:
            self._adopt(adopt, program)
            return
        # SOCK_NONBLOCK: non-blocking from birth, one syscall fewer per listener.
        s = socket.socket(self.family, socket.SOCK_STREAM | socket.SOCK_NONBLOCK)
        try:
            if self.family == socket.AF_INET6:
                s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if self._reuse_port:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            # Accepted sockets inherit TCP_NODELAY: a relay must not add
            # Nagle delays to what it forwards, and this saves a setsockopt
            # per connection.
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            s.bind((self.address, self.port))
            self.port = s.getsockname()[1]  # the kernel's pick for port 0
            if program is not None:
                synfilter.attach(s, program)
            s.listen(self._backlog)
        except BaseException:
            s.close()
            raise
        self._serve(s, program)

    def _adopt(self, s: socket.socket, program: list[synfilter.Instruction] | None) -> None:
        """Take over ``s``, an inherited listening socket for this address and port."""
        if (s.family != self.family or s.type != socket.SOCK_STREAM
                or not s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
                or s.getsockname()[:2] != (self.address, self.port)):
            raise OSError(errno.EINVAL, f"inherited socket is not listening on "
                                        f"{self.address}:{self.port}")
        s.setblocking(False)
        if program is None:
            synfilter.detach(s)  # the old process's filter, if it had one
        else:
            synfilter.attach(s, program)
        s.listen(self._backlog)  # this process's backlog; the queue itself stays
        self._serve(s, program)

    def _serve(self, s: socket.socket, program: list[synfilter.Instruction] | None) -> None:
        """``s`` listens (bound here or adopted): it is ours from now on; start accepting."""
        self._sock = s
        self._fd = s.fileno()
        self._filter = program
        self._start_reading()
        if self._want_steer:
            self.set_steering(self._want_steer)

    def set_steering(self, workers: int) -> None:
        """Steer by client IP over ``workers`` reuseport listeners (0: kernel hash).

        Set after ``listen()``, when the socket is in its reuseport group; the
        program belongs to the group, so every worker setting the same one is
        harmless. Raises OSError.
        """
        self._want_steer = workers
        if self._sock is None or workers == self._steer:
            return
        if workers > 1:
            synfilter.attach_reuseport(self._sock, synfilter.reuseport_steering_program(
                workers, 6 if self.family == socket.AF_INET6 else 4))
        else:
            synfilter.detach_reuseport(self._sock)
        self._steer = workers

    def set_filter(self, program: list[synfilter.Instruction] | None) -> None:
        """Attach, replace (``program``) or detach (None) the SYN filter. Raises OSError."""
        if self._sock is None or program == self._filter:
            return
        if program is None:
            synfilter.detach(self._sock)
        else:
            synfilter.attach(self._sock, program)
        self._filter = program

    def close(self) -> None:
        """Stop accepting and close the socket; the kernel RSTs queued connections."""
        self._cancel_resume()
        self._stop_reading()
        self.blocked = False
        if self._sock is not None:
            self._sock.close()
            self._sock = None
            self._fd = -1

    def resume(self) -> None:
        """Resume accepting after ``blocked`` (the dataplane has room again)."""
        if self.blocked:
            self.blocked = False
            self._start_reading()

    # -- the accept loop ------------------------------------------------------

    def _start_reading(self) -> None:
        if self._sock is not None and not self._reading:
            try:
                if self._accept_set is not None:
                    self._accept_set.watch(self._fd, self._on_readable, self)
                else:
                    self.loop.add_reader(self._fd, self._on_readable)
            except OSError as exc:  # no fd or memory for the epoll set
                # The socket keeps listening (the kernel queues clients):
                # back off and try again, like a failed accept.
                self.accept_failed(exc)
                return
            self._reading = True

    def _stop_reading(self) -> None:
        if self._reading:
            # Before close(): nothing may poll an fd once it is freed.
            if self._accept_set is not None:
                self._accept_set.unwatch(self._fd)
            else:
                self.loop.remove_reader(self._fd)
            self._reading = False

    def _cancel_resume(self) -> None:
        if self._resume_handle is not None:
            self._resume_handle.cancel()
            self._resume_handle = None

    def _on_readable(self) -> None:
        sock = self._sock
        if sock is None:
            return
        for _ in range(ACCEPT_BATCH):
            if not self._admit():
                self.block()
                return
            try:
                # _accept() and an explicit family/type below: socket.accept()
                # would convert self.family and self.type to enums each time.
                fd, addr = sock._accept()  # type: ignore[attr-defined]
            except (BlockingIOError, InterruptedError):
                break
            except ConnectionAbortedError:
                continue
            except OSError as exc:
                self.accept_failed(exc)
                return
            conn = socket.socket(self.family, socket.SOCK_STREAM, 0, fd)
            if self.refuse_loopback and addr[0] == IPV6_LOOPBACK and _to_loopback(conn):
                _reset(conn)
                continue
            # An IPv6 name is a 4-tuple: the plans know (VIP, port).
            self._on_accept(conn, addr, conn.getsockname()[:2] if self.steered else self.port)
        if self._backoff:
            self.accepting_again()

    def block(self) -> None:
        """At the connection limit: leave new clients in the kernel's accept queue
        (they wait, they are not refused) until the dataplane calls ``resume()``."""
        self._stop_reading()
        self.blocked = True
        self._on_blocked(self)

    @property
    def backing_off(self) -> bool:
        """Reading again after failed accepts, not yet past one that succeeded."""
        return bool(self._backoff)

    def accepting_again(self) -> None:
        """An accept succeeded after a back-off: the episode is over."""
        if self._backoff:
            if self._errors_in_episode > 1:
                log.info(
                    "%s:%d accepting again after %d resource errors",
                    self.address, self.port, self._errors_in_episode,
                )
            self._backoff = 0.0
            self._errors_in_episode = 0

    def accept_failed(self, exc: OSError) -> None:
        """An accept failed with ``exc``: back off (resource errors) or wait, then read again."""
        self._stop_reading()
        self._errors_in_episode += 1
        if exc.errno in RESOURCE_ERRNOS:
            # Spinning on a readable socket that cannot be accepted would burn
            # a core; pause with exponential back-off, log once per episode.
            self._backoff = min(BACKOFF_MAX, max(BACKOFF_MIN, self._backoff * 2))
            if self._errors_in_episode == 1:
                log.warning(
                    "%s:%d (%s) accept failed: %s; backing off (up to %.1fs between attempts)",
                    self.address, self.port, self.label, exc, BACKOFF_MAX,
                )
        else:
            self._backoff = BACKOFF_MAX
            log.error(
                "%s:%d (%s) unexpected accept error: %s; retrying in %.1fs",
                self.address, self.port, self.label, exc, self._backoff,
            )
        self._resume_handle = self.loop.call_later(self._backoff, self._resume_after_backoff)

    def _resume_after_backoff(self) -> None:
        self._resume_handle = None
        if not self.blocked:
            self._start_reading()


def _to_loopback(conn: socket.socket) -> bool:
    try:
        return bool(conn.getsockname()[0] == IPV6_LOOPBACK)
    except OSError:
        return True  # gone already: resetting it costs nothing


_LINGER_RST = struct.pack("ii", 1, 0)


def _reset(conn: socket.socket) -> None:
    """Close with an RST: a port nobody serves answers ``::1`` so."""
    with contextlib.suppress(OSError):
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RST)
    conn.close()
