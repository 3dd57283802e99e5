"""What happens to each accepted connection: decide, connect upstream, relay.

Owns: the hot path. For every accepted client socket it applies the
*current* ``PortPlan`` of its NodePort (``decision.decide``), resets the
client for Drop/Reject, and for Forward connects to the endpoint (SNAT, or
IP_TRANSPARENT bound to the client's address), retrying other eligible
endpoints on failure, then relays bytes both ways until both sides are done.
It also holds every live connection, which is what draining counts.

Never: log or allocate per chunk (one shared read buffer; only the unsent
rest of a read is copied), touch Prometheus per connection (counts are
plain ints, flushed in batches: see ``PortMetrics``), read a client before
its upstream is connected, or hold more than one read per direction. Never
log a per-connection event except through ``Forwarder.warn``: rate-limited
per cause and service (``proxy.util.lograte``), so a refusing endpoint under
load writes two lines per ``LOG_WINDOW``, not three per connection.

Where the compiled relay core is built, ``proxy.userspace.corefwd.CoreForwarder``
relays instead: the same rules and the same decisions, its mechanics in C
(``_relaycore.c``). This class is the fallback (``KPX_NO_EXTENSIONS``), and the
reference the core's black-box tests hold it to.

The rules come first, as data: ``RELAY_RULES`` and ``DIRECTION_RULES``
right below the imports say, for each phase and event, what a relay does
and which phase it is in next. The code branches rather than looking them
up (a lookup per event would be paid by every chunk);
``tests/dataplane/test_dp_relay_table.py`` drives the real relay through
every row, so the tables and the code cannot drift apart silently.

Theory of operation
-------------------

Every proxied socket lives in one private epoll set (``Forwarder._ep``),
which the event loop watches as a single reader. Its events go to the
``_Side`` that owns the fd (``_Side.on_event``, the hot path), and from
there to its ``Relay`` for anything but a plain read-and-send:

1. *connecting*: our own non-blocking ``connect()`` on the upstream socket,
   registered ``EPOLLOUT | EPOLLONESHOT``; the client is a raw accepted
   socket that is not registered, hence not read. Every connect has the same
   timeout, so deadlines are in start order: one FIFO and one timer
   (``Forwarder._deadlines``) expire them all. A failure or a timeout
   re-decides (excluding what failed) and connects again, or resets the client.
2. *linked*: both sockets registered ``EPOLLIN`` (level-triggered). A read
   (``recv_into`` the shared buffer) is sent to the other socket at once.
   If the kernel takes only part of it, the rest is copied to that side's
   ``out`` and the reading side leaves the set until ``out`` is flushed
   (``EPOLLOUT``): one read in flight per direction, the kernel's socket
   buffers do the queueing, as in HAProxy's one buffer per direction.
3. *finished*: both sockets closed; the relay leaves ``Forwarder.active``.

Why not uvloop transports and a Protocol per side: transports are made
through coroutines (a Task, futures and context copies per connection),
and each makes syscalls of its own (O_NONBLOCK, TCP_NODELAY, getsockname,
getpeername, epoll_ctl; ``loop.add_writer`` alone makes several per
connect under libuv), while uvloop's ``sock_connect`` resolves even a
numeric address with ``getaddrinfo`` in its thread pool (uvloop 0.23). A
relay never parses: ``recv_into`` and ``send`` on an epoll set are all it
needs per event. Syscalls are saved where the kernel already answered: no
SO_ERROR read after a connect that epoll reports clean, no FIONBIO on
accepted sockets (``_DONTWAIT``). The CPU per connection of each design,
and the syscall counts, are in docs/PERFORMANCE.md, "Relay: transports
against one epoll set".

Relay rules (the TCP semantics a kernel DNAT would give):

- data is written to the other side as it arrives; a side is not read while
  the other has unsent data, so memory per connection is bounded by one read
  per direction (``READ_SIZE``), and a slow reader stalls its sender through
  the kernel's windows;
- EOF is half-close: EOF read on one socket becomes ``shutdown(SHUT_WR)`` on
  the other once its pending data is flushed; a socket done both ways (EOF
  read, FIN sent) is closed, and the relay ends when both are. A socket that
  already sent EOF gets its FIN from ``close()`` instead: one syscall fewer;
- an error on one side (RST, EPIPE, timeout) becomes an RST on the other
  (SO_LINGER 0, then close).

Level-triggered, so a read per socket per poll keeps busy connections
fair and nothing is lost by stopping early. A side with nothing to read or
write (half-closed, or paused) stays in the set for errors only
(``_ERRORS_ONLY``): an RST on it is passed on at once, as a kernel DNAT
would, instead of waiting for a read that may never come. Level-triggered
epoll reports EPOLLHUP whatever the mask, so one without an error (FIN both
ways on a paused side) takes it out of the set until it is read again.

Idle connections expire as kube-proxy's conntrack flags make them:
``--conntrack-tcp-timeout-established`` (no byte either way for that long)
and ``--conntrack-tcp-timeout-close-wait`` (idle that long after one side's
FIN); 0 turns either off. Expiry resets both sides. The hot path pays
nothing for it: the per-side byte counts it already keeps are the activity
signal. A timer sweeps every ``min(timeout / 4, SWEEP_MAX_INTERVAL)``; a
relay whose counts (and flush/EOF marker) have not moved since the sweep
that first saw them still is idle since then. So a connection expires no
earlier than its timeout after its last activity, and at most two sweep
intervals later (the activity may fall just after a sweep). Packets without
payload count too, as every packet refreshes a conntrack entry: a relay idle
for half its timeout has its sockets' received segments (TCP_INFO
``tcpi_segs_in``: keepalive probes, window probes) counted, and counted again
at the timeout, so a connection its peers keep alive is not reset. One more check
before a reset: data still in a socket's send queue (SIOCOUTQ) means the
kernel is still delivering to a slow reader, which conntrack would see as
packets, so that connection is not idle.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import ipaddress
import logging
import os
import select
import socket
import struct
import termios
import time
import weakref
from collections import deque
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any, NamedTuple

from proxy import metrics
from proxy.core.balancer import Balancer
from proxy.core.decision import Drop, Forward, PortPlan, decide
from proxy.defaults import TCP_TIMEOUT_CLOSE_WAIT, TCP_TIMEOUT_ESTABLISHED
from proxy.userspace.transparent import upstream_socket
from proxy.util.lograte import RateLimitedLog

log = logging.getLogger(__name__)

# -- the rules: phase x event -> action / next phase ---------------------------------

CONNECTING = 0
"""``Relay.phase`` while the upstream connect is in flight."""
LINKED = 1
"""``Relay.phase`` once both sockets relay."""

RELAY_PHASES: dict[str, str] = {
    "connecting": "Relay.phase == CONNECTING: the upstream socket is watched for one"
                  " EPOLLOUT; the client socket is not watched at all",
    "linked": "Relay.phase == LINKED: both sockets relay, each direction in one of"
              " DIRECTION_STATES",
    "finished": "out of Forwarder.active, both sockets closed (Relay.phase is left as it was)",
}
"""A relay's phases, and how each shows in its fields."""

DIRECTION_STATES: dict[str, str] = {
    "open": "a is watched for reads; b.out is empty",
    "paused": "b.out holds the rest of a read of a; a is not watched for reads,"
              " b is watched for writes",
    "done": "a read EOF (a.eof) and the FIN went on to b (b.shut, or b closed)",
}
"""While linked, each direction (``a`` read, its peer ``b`` written:
client -> endpoint and endpoint -> client) is in one of these states."""


class Rule(NamedTuple):
    """What a relay does on one event in one phase, and where that leaves it."""

    action: str
    then: str
    """The next phase (or direction state)."""
    by: str
    """The method that carries the rule out."""


RELAY_RULES: dict[tuple[str, str], Rule] = {
    # "connect failed": refused or unreachable at once (Relay.connect), an
    # error epoll reports (Relay.connect_ready) or the deadline passed
    # (Relay.connect_timed_out). Every failure re-decides without the
    # endpoints that failed for this connection.
    ("connecting", "connected"): Rule(
        "link the sides, watch both for reads, count it forwarded",
        "linked", "Relay.connect_ready"),
    ("connecting", "connect failed, another endpoint eligible"): Rule(
        "close the attempt, log it (rate-limited), connect to that endpoint",
        "connecting", "Relay._connect_failed"),
    ("connecting", "connect failed, no endpoint left"): Rule(
        "close the attempt, RST the client, count it rejected",
        "finished", "Relay._connect_failed"),
    ("connecting", "abort"): Rule(
        "close the attempt, RST the client",
        "finished", "Relay.abort"),
    # "abort": drain's deadline, Forwarder.close, or a bug in the relay
    # (Forwarder._poll catches it: it costs this connection only).
    ("linked", "both directions done"): Rule(
        "nothing more: each socket was closed when it was done both ways",
        "finished", "Relay._maybe_finish"),
    ("linked", "recv or send failed (RST, EPIPE, timeout)"): Rule(
        "RST both sockets",
        "finished", "Relay.reset"),
    ("linked", "idle past its conntrack timeout"): Rule(
        "RST both sockets, count and log it",
        "finished", "Relay.expire"),
    ("linked", "abort"): Rule(
        "RST both sockets",
        "finished", "Relay.abort"),
}
"""The relay as a whole. Not in it, on purpose: anything the client sends
while connecting (data, FIN, RST) waits in the kernel until linked."""

DIRECTION_RULES: dict[tuple[str, str], Rule] = {
    ("open", "read, b takes it all"): Rule(
        "sent straight from the shared buffer, nothing copied (the hot path)",
        "open", "_Side.on_event"),
    ("open", "read, b takes part or none"): Rule(
        "copy the rest to b.out, stop reading a, watch b for writes",
        "paused", "Relay.hold"),
    ("open", "EOF read"): Rule(
        "FIN to b: shutdown(SHUT_WR), or close() if b read EOF too;"
        " close a if it was sent a FIN already",
        "done", "Relay.eof"),
    ("paused", "b writable, takes all of b.out"): Rule(
        "watch a for reads again",
        "open", "Relay.flush"),
    ("paused", "b writable, takes part"): Rule(
        "keep the rest in b.out",
        "paused", "Relay.flush"),
}
"""One direction, while linked. Not in it, on purpose: a paused ``a`` is
not read, so its data, EOF or error waits until it is open again (EOF is
only ever read in ``open``, with nothing pending for ``b``); a direction
that is done stays done."""

# -- constants ------------------------------------------------------------------------

READ_SIZE = 256 * 1024
"""Bytes per read: large reads keep bulk transfers cheap; a relay holds at
most one unsent read per direction, copied out of the shared buffer."""
METRICS_FLUSH_INTERVAL = 1.0
"""Seconds between batches of counter updates to Prometheus (scrapes lag by at most this)."""
SWEEP_MAX_INTERVAL = 30.0
"""Longest wait between idle sweeps: how late past its timeout a connection may expire."""
LOG_WINDOW = 10.0
"""Seconds per rate-limit window of the per-connection warnings (``proxy.util.lograte``)."""
_TIMER_SLACK = 0.01
"""Loops may run a timer up to their clock resolution early: wake a little after a
window ends, so the tick finds it ended instead of rescheduling itself at once."""
STARVED_BACKOFF = 0.25
"""Seconds the listeners stay paused after an upstream socket could not be made for
want of fds or memory (``Forwarder.starve``)."""
_RESOURCE_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})

_LINGER_RST = struct.pack("ii", 1, 0)
_OUTQ_BUF = struct.pack("i", 0)
_TCP_INFO_LEN = 144
"""Bytes of ``struct tcp_info`` up to and including ``tcpi_segs_in`` (offset 140)."""
_SOL_SOCKET = socket.SOL_SOCKET
_SO_ERROR = socket.SO_ERROR
_SHUT_WR = socket.SHUT_WR
_IN_PROGRESS = frozenset({0, errno.EINPROGRESS})
_EPOLLIN = select.EPOLLIN
_EPOLLOUT = select.EPOLLOUT
_EPOLLOUT_ONESHOT = select.EPOLLOUT | select.EPOLLONESHOT
_READABLE = select.EPOLLIN | select.EPOLLHUP | select.EPOLLERR
_WRITABLE = select.EPOLLOUT | select.EPOLLHUP | select.EPOLLERR
_FAILED = select.EPOLLERR | select.EPOLLHUP
_ERRORS_ONLY = select.EPOLLERR
"""The mask of a side in the set for nothing but an error (reported whatever the mask)."""
_RETRY = (BlockingIOError, InterruptedError)
_DONTWAIT = socket.MSG_DONTWAIT
"""Every recv and send is non-blocking by flag: accepted sockets stay in
blocking mode, which saves the FIONBIO ioctl per connection that
``setblocking(False)`` costs (upstream sockets are born non-blocking)."""


class PortMetrics:
    """The counters of one service port: plain ints, flushed to Prometheus in batches.

    Why not ``Counter.inc()`` per connection: each takes a lock and a few
    Python calls, and a connection touched six of them (cost: see
    docs/PERFORMANCE.md, "Relay: transports against one epoll set"). The hot
    path adds to ints instead and marks the port dirty once; ``flush`` adds
    the deltas to the labelled children at most once per
    ``METRICS_FLUSH_INTERVAL``, and at shutdown. The active-connections
    gauge is read live at scrape time (``set_function``), so it is never stale.
    """

    __slots__ = (
        "__weakref__", "_children", "accepted", "active", "bytes_to_client",
        "bytes_to_endpoint", "connect_failures", "dirty", "dropped", "forwarded_direct",
        "forwarded_snat", "key", "rejected",
    )

    COUNTERS = (
        "accepted", "forwarded_snat", "forwarded_direct", "dropped", "rejected",
        "connect_failures", "bytes_to_endpoint", "bytes_to_client",
    )

    def __init__(self, key: str) -> None:
        self.key = key
        self.accepted = self.forwarded_snat = self.forwarded_direct = 0
        self.dropped = self.rejected = self.connect_failures = 0
        self.bytes_to_endpoint = self.bytes_to_client = 0
        self.active = 0
        self.dirty = False
        # The labelled children are made on the first flush, i.e. only for
        # ports that saw a connection: nine per port made up front were most
        # of the time a big state took to apply (docs/PERFORMANCE.md, "Relay:
        # transports against one epoll set").
        self._children: tuple[Any, ...] = ()

    def ensure_children(self) -> None:
        if not self._children:
            self._children = self._make_children()

    def _make_children(self) -> tuple[Any, ...]:
        key = self.key
        # One gauge child per key, but one PortMetrics per key in each family's
        # dataplane (dual stack): the gauge is the sum of them all.
        group = _ACTIVE_BY_KEY.setdefault(key, weakref.WeakSet())
        group.add(self)
        metrics.ACTIVE_CONNECTIONS.labels(key).set_function(lambda: sum(m.active for m in group))
        return (
            metrics.CONNECTIONS_ACCEPTED.labels(key),
            metrics.CONNECTIONS_FORWARDED.labels(key, "true"),
            metrics.CONNECTIONS_FORWARDED.labels(key, "false"),
            metrics.CONNECTIONS_DROPPED.labels(key),
            metrics.CONNECTIONS_REJECTED.labels(key),
            metrics.UPSTREAM_CONNECT_FAILURES.labels(key),
            metrics.BYTES.labels(key, "to_endpoint"),
            metrics.BYTES.labels(key, "to_client"),
        )

    def flush(self) -> None:
        """Add what was counted since the last flush to the Prometheus children."""
        self.dirty = False
        self.ensure_children()
        for name, child in zip(self.COUNTERS, self._children, strict=True):
            n = getattr(self, name)
            if n:
                child.inc(n)
                setattr(self, name, 0)


_ACTIVE_BY_KEY: dict[str, weakref.WeakSet[PortMetrics]] = {}
"""Every PortMetrics of a service-port key (one per family's dataplane), for its gauge."""


@dataclass(frozen=True, slots=True)
class PortState:
    """What one NodePort's connections use; replaced as a whole on each sync.

    The balancer and metrics are shared across syncs for the same service
    port, so affinity survives reloads.
    """

    plan: PortPlan
    balancer: Balancer
    metrics: PortMetrics


def _describe(exc: BaseException) -> str:
    """"Connection refused", not "[Errno 111] Connection refused"."""
    if isinstance(exc, TimeoutError):
        return "timed out"
    errno_ = getattr(exc, "errno", None)
    return os.strerror(errno_) if errno_ else str(exc)


def _unsent(side: _Side) -> bool:
    """True if ``side`` holds data for its peer: ours (``out``) or the kernel's send queue.

    Called only by the idle sweep, and only for a relay about to expire: one
    ioctl (SIOCOUTQ: bytes sent but not yet acknowledged, or not yet sent).
    """
    if side.closed:
        return False
    if side.out is not None:
        return True
    try:
        queued = fcntl.ioctl(side.fd, termios.TIOCOUTQ, _OUTQ_BUF)
    except OSError:
        return False
    return struct.unpack("i", queued)[0] > 0


def _segs_in(side: _Side) -> int:
    """Segments ``side``'s socket received (keepalive probes included); 0 if unknown."""
    if side.closed:
        return 0
    try:
        info = side.sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_LEN)
    except OSError:
        return 0
    return struct.unpack_from("I", info, 140)[0] if len(info) >= _TCP_INFO_LEN else 0


def reset_socket(sock: socket.socket) -> None:
    """Close ``sock`` with an RST instead of a FIN."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RST)
    sock.close()


class _Side:
    """One socket of a relay, as the epoll set sees it.

    ``out`` is data read from the other side that this socket has not taken
    yet; ``eof``: its peer sent FIN (we read EOF); ``shut``: we sent it FIN.
    """

    __slots__ = ("closed", "eof", "fd", "fwd", "mask", "nbytes", "out", "peer", "relay", "shut",
                 "sock")

    def __init__(self, relay: Relay, sock: socket.socket) -> None:
        self.relay: Relay | None = relay
        self.fwd = relay.fwd
        self.sock = sock
        self.fd = sock.fileno()
        self.peer: _Side | None = None
        self.out: memoryview | None = None
        self.mask = 0
        self.nbytes = 0
        self.eof = False
        self.shut = False
        self.closed = False

    def on_event(self, events: int) -> None:
        """One epoll event of this socket: the hot path of every relay.

        A read that the other socket takes whole, the common case, stays in
        this one method (rule, direction self -> peer: open x read, b takes
        it all -> open); everything else goes to the relay.
        """
        relay = self.relay
        if relay is None:
            return
        if relay.phase == CONNECTING:
            if self is relay.upstream:
                relay.connect_ready(events)
            return
        if self.out is not None and events & _WRITABLE:
            relay.flush(self)
            if self.closed:
                return
        if not (self.mask & _EPOLLIN and events & _READABLE):
            if events & _FAILED and not self.mask & (_EPOLLIN | _EPOLLOUT) and not self.closed:
                relay.failed_idle(self)
            return
        fwd = self.fwd
        # One read per event: level-triggered epoll reports the socket again
        # if more is waiting, after every other ready socket had its turn.
        try:
            n = self.sock.recv_into(fwd.buf, 0, _DONTWAIT)
        except _RETRY:
            return
        except OSError as exc:
            relay.reset(self, exc)
            return
        if not n:
            relay.eof(self)
            return
        self.nbytes += n
        b = self.peer
        assert b is not None
        view = fwd.view[:n]
        if b.out is None:
            # Straight from the shared buffer: nothing is copied unless the
            # kernel leaves some of it (then ``hold`` copies just that).
            try:
                sent = b.sock.send(view, _DONTWAIT)
            except _RETRY:
                sent = 0
            except OSError as exc:
                relay.reset(b, exc)
                return
            if sent == n:
                return
            view = view[sent:]
        relay.hold(self, b, view)


class Relay:
    """One proxied connection, from accept until both sockets are closed.

    Its phases and what moves it between them: ``RELAY_PHASES`` and
    ``RELAY_RULES``; while linked, each direction follows ``DIRECTION_RULES``.
    Each method that carries out a rule names its row ("Rule: ...").

    ``mark`` and ``idle_since`` belong to the idle sweep (``Forwarder._sweep``):
    the byte counts it last saw (-1: activity the counts do not show, or not
    seen yet) and the sweep time they were first seen unchanged.
    """

    __slots__ = (
        "client", "client_addr", "counted", "endpoint", "failed", "fwd", "idle_since", "mark",
        "metrics", "node_port", "phase", "segs", "snat", "state", "upstream",
    )

    def __init__(
        self, fwd: Forwarder, state: PortState, csock: socket.socket,
        client_addr: tuple[str, int], node_port: object,
    ) -> None:
        self.fwd = fwd
        self.state = state
        self.metrics = state.metrics
        self.client = _Side(self, csock)
        self.upstream: _Side | None = None
        self.client_addr = client_addr
        self.node_port = node_port
        self.endpoint: tuple[str, int] = ("", 0)
        self.failed: list[tuple[str, int]] | None = None
        self.snat = True
        self.phase = CONNECTING
        self.mark = -1
        self.idle_since = 0.0
        self.segs = -1
        self.counted = (0, 0)
        """Bytes (from the client, from the endpoint) already added to ``metrics``."""

    # -- connecting --------------------------------------------------------------

    def connect(self, decision: Forward) -> None:
        """Start a non-blocking connect to ``decision``'s endpoint.

        A connect that fails at once (no free port, unreachable, EMFILE) moves
        on to the next eligible endpoint right here (``_connect_failed``).
        """
        fwd = self.fwd
        attempt: Forward | None = decision
        while attempt is not None:
            addr = attempt.endpoint.addr
            snat = attempt.snat or not fwd.transparent
            usock = None
            try:
                usock = upstream_socket(None if snat else self.client_addr[0], fwd.family)
                err = usock.connect_ex(addr)
                if err in _IN_PROGRESS:
                    up = _Side(self, usock)
                    fwd.watch_connect(up)
                    self.upstream = up
                    self.endpoint = addr
                    self.snat = snat
                    return
            except OSError as exc:  # EMFILE, or no fd left for the epoll set
                err = exc.errno or errno.EIO
                if err in _RESOURCE_ERRNOS:
                    # Ours ran out, not the endpoint: blame no endpoint, and
                    # leave the clients still queued there until fds are back
                    # (the listeners pause, as on an accept's EMFILE).
                    if usock is not None:
                        usock.close()
                    self._starved(exc)
                    return
            if usock is not None:
                usock.close()
            attempt = self._connect_failed(addr, snat, OSError(err, os.strerror(err)))

    def _starved(self, exc: OSError) -> None:
        """No upstream socket for want of fds or memory: reset this client, pause accepting."""
        fwd = self.fwd
        m = self.metrics
        m.rejected += 1
        fwd.touch(m)
        key = self.state.plan.key
        fwd.warn(("starved", key), "%s: client %s reset: no upstream socket (%s); pausing accepts",
                 key, self.client_str(), _describe(exc))
        fwd.starve()
        self.abort()

    def connect_ready(self, events: int) -> None:
        """The upstream connect finished: writable means connected, an error failed.

        SO_ERROR is read only when epoll reports an error: a connect that
        succeeded is plain EPOLLOUT, and skipping the getsockopt saves a
        syscall on every connection.

        Rule: connecting x connected -> linked (a failure: ``_connect_failed``).
        """
        up = self.upstream
        if up is None or self.phase != CONNECTING:
            return
        if events & _FAILED:
            err = up.sock.getsockopt(_SOL_SOCKET, _SO_ERROR)
            if err:
                self._drop_upstream()
                self._retry(OSError(err, os.strerror(err)))
                return
        self.phase = LINKED
        cl = self.client
        cl.peer, up.peer = up, cl
        m = self.metrics
        if self.snat:
            m.forwarded_snat += 1
        else:
            m.forwarded_direct += 1
        fwd = self.fwd
        fwd.set_mask(up, _EPOLLIN)
        fwd.add_side(cl, _EPOLLIN)
        if fwd._sweep_timer is None and fwd.sweep_interval:
            fwd.start_sweeping()

    def connect_timed_out(self) -> None:
        """Called by the Forwarder when this attempt's deadline passed."""
        if self.upstream is None or self.phase != CONNECTING:
            return
        self._drop_upstream()
        self._retry(TimeoutError())

    def _drop_upstream(self) -> None:
        up, self.upstream = self.upstream, None
        if up is not None:
            self.fwd.close_side(up)

    def _retry(self, exc: OSError) -> None:
        decision = self._connect_failed(self.endpoint, self.snat, exc)
        if decision is not None:
            self.connect(decision)

    def _connect_failed(
        self, addr: tuple[str, int], snat: bool, exc: OSError
    ) -> Forward | None:
        """Log and count one failed connect; the next decision, or None after RST.

        Rules: connecting x connect failed, another endpoint eligible ->
        connecting (the caller connects to it); ..., no endpoint left -> finished.
        """
        state = self.fwd.ports.get(self.node_port, self.state)
        plan = state.plan
        client_ip = self.client_addr[0]
        m = self.metrics
        m.connect_failures += 1
        fwd = self.fwd
        fwd.touch(m)
        why = _describe(exc)
        fwd.warn(
            ("connect", why, plan.key),
            "%s: connect to endpoint %s:%d for client %s:%d failed (%s%s)",
            plan.key, addr[0], addr[1], client_ip, self.client_addr[1], why,
            ", SNAT" if snat else "",
        )
        if self.failed is None:
            self.failed = []
        self.failed.append(addr)
        state.balancer.forget(client_ip)
        decision = decide(
            plan, client_ip, self.fwd.local_addresses, state.balancer, time.monotonic(),
            self.failed, self.fwd.cluster_cidrs,
        )
        if isinstance(decision, Forward):
            self.state = state
            return decision
        m.rejected += 1
        fwd.warn(("reset", type(decision).__name__, plan.key),
                 "%s: client %s:%d reset: %s", plan.key, client_ip, self.client_addr[1],
                 decision.reason)
        self.abort()
        return None

    # -- relaying ----------------------------------------------------------------

    def hold(self, a: _Side, b: _Side, rest: memoryview) -> None:
        """``b`` did not take all of ``a``'s read: keep the rest, pause ``a``.

        The rest is copied because the shared buffer is reused by the next
        read; ``a`` is read again once ``b`` has taken it all (``flush``).

        Rule (direction a -> b): open x read, b takes part or none -> paused.
        """
        fwd = self.fwd
        # Never overtake data already pending (not reached while ``a`` is
        # paused for ``b``; kept safe anyway).
        pending = b"" if b.out is None else bytes(b.out)
        b.out = memoryview(pending + bytes(rest))
        fwd.set_mask(a, a.mask & ~_EPOLLIN)
        fwd.set_mask(b, b.mask | _EPOLLOUT)

    def eof(self, a: _Side) -> None:
        """``a`` read EOF: a half-close, passed on once its peer has what is pending.

        Rule (direction a -> b): open x EOF read -> done. Nothing is pending
        for ``b`` then (a paused ``a`` is not read); the check stays anyway.
        """
        fwd = self.fwd
        b = a.peer
        assert b is not None
        a.eof = True
        self.mark = -1  # a FIN is activity: close-wait is counted from here
        if a.shut:
            fwd.close_side(a)  # done both ways (closing also leaves the set)
        else:
            fwd.set_mask(a, a.mask & ~_EPOLLIN)
        if b.out is None:
            self._send_fin(b)
        self._maybe_finish()

    def flush(self, b: _Side) -> None:
        """``b`` is writable: send what is pending for it.

        Rules (direction b.peer -> b): paused x b writable -> open when it
        takes all, paused when it takes part.
        """
        fwd = self.fwd
        out = b.out
        assert out is not None
        try:
            sent = b.sock.send(out, _DONTWAIT)
        except _RETRY:
            return
        except OSError as exc:
            self.reset(b, exc)
            return
        # Progress the byte counts do not show (they count reads): a slow
        # reader that takes a little at a time is not idle.
        self.mark = -1
        if sent < len(out):
            b.out = out[sent:]
            return
        b.out = None
        fwd.set_mask(b, b.mask & ~_EPOLLOUT)
        a = b.peer
        assert a is not None
        if a.eof:
            self._send_fin(b)
            self._maybe_finish()
        elif not a.closed:
            fwd.set_mask(a, a.mask | _EPOLLIN)  # take the next read from a

    def _send_fin(self, b: _Side) -> None:
        """Pass a half-close on to ``b`` (nothing is pending for it)."""
        if b.closed or b.shut:
            return
        if b.eof:
            # b's peer already finished sending: close() sends our FIN and
            # ends the socket in one syscall.
            self.fwd.close_side(b)
            return
        try:
            b.sock.shutdown(_SHUT_WR)
        except OSError as exc:
            self.reset(b, exc)
            return
        b.shut = True

    def failed_idle(self, side: _Side) -> None:
        """``side``, watched for errors only (half-closed or paused), was reported.

        An error (RST, timeout) resets both sides (``reset``); a hang-up
        without one takes it out of the set until it is read again.
        """
        err = side.sock.getsockopt(_SOL_SOCKET, _SO_ERROR)
        if err:
            self.reset(side, OSError(err, os.strerror(err)))
        else:
            self.fwd.unwatch(side)

    def reset(self, broken: _Side, exc: OSError) -> None:
        """``broken`` failed (RST, EPIPE, timeout): reset the other side too.

        Rule: linked x recv or send failed -> finished.
        """
        if log.isEnabledFor(logging.DEBUG):
            log.debug("%s: %s: %s side failed: %s", self.state.plan.key, self.client_str(),
                      "client" if broken is self.client else "endpoint", exc)
        self.abort()

    def expire(self, reason: str, idle: float) -> None:
        """Idle past its conntrack timeout: reset both sides, count and log it.

        Rule: linked x idle past its conntrack timeout -> finished.
        """
        key = self.metrics.key
        metrics.CONNECTIONS_EXPIRED.labels(key, reason).inc()
        self.fwd.warn(
            ("expired", reason, key),
            "%s: connection of client %s:%d to endpoint %s:%d idle for %.0f s: reset both"
            " sides (--conntrack-tcp-timeout-%s)",
            key, self.client_addr[0], self.client_addr[1], self.endpoint[0], self.endpoint[1],
            idle, reason.replace("_", "-"),
        )
        self.abort()

    def _maybe_finish(self) -> None:
        """Rule: linked x both directions done -> finished (once both sockets are closed)."""
        if self.client.closed and (self.upstream is None or self.upstream.closed):
            self._finish()

    def abort(self) -> None:
        """RST whatever is still open of this connection and finish it, in any phase.

        Rules: connecting x abort, linked x abort -> finished.
        """
        fwd = self.fwd
        if self.phase == CONNECTING:
            self._drop_upstream()  # never connected: a plain close
        for side in (self.client, self.upstream):
            if side is not None and not side.closed:
                fwd.close_side(side, rst=True)
        self._finish()

    def _finish(self) -> None:
        fwd = self.fwd
        active = fwd.active
        if self not in active:
            return  # already finished
        del active[self]
        m = self.metrics
        m.active -= 1
        self.count_bytes()
        fwd.touch(m)
        # Break the relay <-> side cycles: all of it is freed now, by
        # reference counting, instead of by a later cyclic GC pass.
        for side in (self.client, self.upstream):
            if side is not None:
                side.relay = side.peer = None
        fwd.connection_finished()

    def count_bytes(self) -> None:
        """Add the bytes read since the last count to ``metrics`` (no flush scheduled)."""
        c, u = self.client.nbytes, self.upstream.nbytes if self.upstream is not None else 0
        m = self.metrics
        m.bytes_to_endpoint += c - self.counted[0]
        m.bytes_to_client += u - self.counted[1]
        self.counted = (c, u)

    def buffered(self) -> int:
        """Bytes held for either side (read but not yet taken by the kernel)."""
        return max((len(s.out) for s in (self.client, self.upstream)
                    if s is not None and s.out is not None), default=0)

    def client_str(self) -> str:
        return f"{self.client_addr[0]}:{self.client_addr[1]}"


class Forwarder:
    """Accepted sockets in, relays out; the dataplane swaps ``ports`` on each sync."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        connect_timeout: float = 2.0,
        transparent: bool = False,
        max_connections: int = 0,
        tcp_timeout_established: float = TCP_TIMEOUT_ESTABLISHED,
        tcp_timeout_close_wait: float = TCP_TIMEOUT_CLOSE_WAIT,
        family: int = 4,
    ) -> None:
        if tcp_timeout_established < 0 or tcp_timeout_close_wait < 0:
            raise ValueError("conntrack TCP timeouts must be >= 0 (0 turns one off)")
        self.loop = loop
        self.family = family
        """The IP family of every socket here (4 or 6): one Forwarder per family's dataplane."""
        self.connect_timeout = connect_timeout
        self.tcp_timeout_established = tcp_timeout_established
        """Idle seconds before an established connection is reset; 0: never."""
        self.tcp_timeout_close_wait = tcp_timeout_close_wait
        """Idle seconds after a FIN before a half-closed one is reset; 0: the
        established timeout applies to it instead."""
        enabled = [t for t in (tcp_timeout_established, tcp_timeout_close_wait) if t]
        self.sweep_interval = min(min(enabled) / 4, SWEEP_MAX_INTERVAL) if enabled else 0.0
        """Seconds between idle sweeps; 0 when both timeouts are off."""
        self._sweep_timer: asyncio.TimerHandle | None = None
        self.logs = RateLimitedLog(log, window=LOG_WINDOW, clock=loop.time)
        """Every per-connection warning goes through here (``warn``)."""
        self._log_timer: asyncio.TimerHandle | None = None
        self.transparent = transparent
        """True only while the return-path routing is installed."""
        self.max_connections = max_connections
        """0 means unlimited."""
        self.ports: dict[object, PortState] = {}
        """By plan key: a nodePort, or ``(vip, port)`` (``proxy.core.decision.PlanKey``)."""
        self.local_addresses: Collection[str] = frozenset()
        self.cluster_cidrs: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...] = ()
        """Pod CIDRs: their NodePort traffic gets Cluster semantics (detect-local)."""
        self.active: dict[Relay, None] = {}
        """Every live relay, in accept order: what draining counts and aborts."""
        self._idle: asyncio.Event | None = None
        self.on_room: Callable[[], None] | None = None
        """Called when a connection ends and there is room below the limit."""
        # The epoll set and what its fds belong to; made on first use, so a
        # Forwarder that never forwards holds no fd.
        self._ep: select.epoll | None = None
        self._sides: dict[int, _Side] = {}
        self._closed_in_batch: set[int] = set()
        self._polling = False
        self.buf = bytearray(READ_SIZE)
        self.view = memoryview(self.buf)
        # Connect attempts in start order: (deadline, relay, its upstream side).
        self._deadlines: deque[tuple[float, Relay, _Side]] = deque()
        self._deadline_timer: asyncio.TimerHandle | None = None
        self._dirty: list[PortMetrics] = []
        self._flush_timer: asyncio.TimerHandle | None = None
        self._starve_timer: asyncio.TimerHandle | None = None

    def has_capacity(self) -> bool:
        if self._starve_timer is not None:
            return False  # out of fds a moment ago: clients wait in the accept queues
        return not self.max_connections or len(self.active) < self.max_connections

    def starve(self) -> None:
        """Refuse admission until a client and its upstream socket fit again (no fd for
        an upstream socket): probed every ``STARVED_BACKOFF`` seconds."""
        if self._starve_timer is None:
            self._starve_timer = self.loop.call_later(STARVED_BACKOFF, self._unstarve)

    def _unstarve(self) -> None:
        self._starve_timer = None
        try:  # room for an accepted socket and its upstream one?
            with socket.socket(), socket.socket():
                pass
        except OSError:
            self.starve()  # not yet: the clients keep waiting in the queues
            return
        if self.on_room is not None and self.has_capacity():
            self.on_room()

    def on_accept(self, csock: socket.socket, addr: tuple[str, int], node_port: object) -> None:
        state = self.ports.get(node_port)
        if state is None:
            # The listener is being closed by this very sync.
            reset_socket(csock)
            return
        m = state.metrics
        m.accepted += 1
        if not m.dirty:
            self.touch(m)
        decision = decide(
            state.plan, addr[0], self.local_addresses, state.balancer, time.monotonic(),
            (), self.cluster_cidrs,
        )
        if type(decision) is Forward:
            relay = Relay(self, state, csock, addr, node_port)
            self.active[relay] = None
            m.active += 1
            relay.connect(decision)
            return
        # Drop reaches here only in the race where the SYN passed before the
        # filter went on; the handshake is done, so an RST is the nearest
        # thing to silence. Reject: no endpoint at all.
        if isinstance(decision, Drop):
            m.dropped += 1
        else:
            m.rejected += 1
        if log.isEnabledFor(logging.DEBUG):
            log.debug("%s: %s:%d reset: %s", state.plan.key, addr[0], addr[1], decision.reason)
        reset_socket(csock)

    # -- the epoll set -----------------------------------------------------------

    def _epoll(self) -> select.epoll:
        ep = self._ep
        if ep is None:
            ep = self._ep = select.epoll()
            self.loop.add_reader(ep.fileno(), self._poll)
        return ep

    def _poll(self) -> None:
        ep = self._ep
        if ep is None:
            return
        sides = self._sides
        closed = self._closed_in_batch
        self._polling = True
        try:
            for fd, events in ep.poll(0):
                # An fd closed earlier in this batch may already be a new
                # socket's: its stale event must not reach the new owner.
                if closed and fd in closed:
                    continue
                side = sides.get(fd)
                if side is None:
                    continue
                try:
                    side.on_event(events)
                except Exception:
                    # A bug or an epoll_ctl failure (ENOMEM) must cost this
                    # connection, not the rest of the batch.
                    relay = side.relay
                    if relay is not None:
                        key = relay.state.plan.key
                        self.warn(("relay failed", key), "%s: relay for %s failed", key,
                                  relay.client_str(), exc_info=True)
                        relay.abort()
        finally:
            self._polling = False
            closed.clear()

    def set_mask(self, side: _Side, mask: int) -> None:
        """Watch ``side`` for ``mask`` (0: for errors only, see the module docstring)."""
        old = side.mask
        mask = mask or _ERRORS_ONLY
        if mask == old or side.closed:
            return
        ep = self._ep
        assert ep is not None
        if not old:
            ep.register(side.fd, mask)
        else:
            ep.modify(side.fd, mask)
        side.mask = mask

    def unwatch(self, side: _Side) -> None:
        """Take ``side`` out of the set (its mask 0) until a ``set_mask`` puts it back."""
        if side.mask and not side.closed:
            assert self._ep is not None
            self._ep.unregister(side.fd)
            side.mask = 0

    def add_side(self, side: _Side, mask: int) -> None:
        """Put ``side`` in the set, watched for ``mask``."""
        self._sides[side.fd] = side
        self.set_mask(side, mask)

    def close_side(self, side: _Side, rst: bool = False) -> None:
        """Close ``side``'s socket (with an RST if ``rst``); closing leaves the set."""
        if side.closed:
            return
        side.closed = True
        side.out = None
        fd = side.fd
        if self._sides.get(fd) is side:
            del self._sides[fd]
        if self._polling:
            self._closed_in_batch.add(fd)
        if rst:
            reset_socket(side.sock)
        else:
            side.sock.close()

    def watch_connect(self, up: _Side) -> None:
        """Report ``up``'s connect to its relay when done, or time it out.

        Raises OSError if the epoll set cannot be made (EMFILE).
        """
        ep = self._epoll()
        ep.register(up.fd, _EPOLLOUT_ONESHOT)
        up.mask = _EPOLLOUT_ONESHOT
        self._sides[up.fd] = up
        q = self._deadlines
        # Retire finished attempts at the head as we go, so the queue holds
        # about as many entries as there are connects in flight.
        while q and (q[0][1].phase != CONNECTING or q[0][1].upstream is not q[0][2]):
            q.popleft()
        relay = up.relay
        assert relay is not None  # a side is made by its relay
        q.append((self.loop.time() + self.connect_timeout, relay, up))
        if self._deadline_timer is None:
            self._deadline_timer = self.loop.call_at(q[0][0], self._expire_connects)

    def _expire_connects(self) -> None:
        self._deadline_timer = None
        q = self._deadlines
        now = self.loop.time()
        while q:
            deadline, relay, up = q[0]
            if relay.upstream is not up or relay.phase != CONNECTING:
                q.popleft()  # connected, failed or aborted meanwhile
            elif deadline <= now:
                q.popleft()
                relay.connect_timed_out()  # may append a retry at the tail
            else:
                break
        if q:
            self._deadline_timer = self.loop.call_at(q[0][0], self._expire_connects)

    # -- idle expiry -------------------------------------------------------------

    def start_sweeping(self) -> None:
        """Sweep for idle connections from now on, while any is live."""
        if self._sweep_timer is None and self.sweep_interval:
            self._sweep_timer = self.loop.call_later(self.sweep_interval, self._sweep)

    def _sweep(self) -> None:
        """Reset the connections idle past their conntrack timeout.

        Idle means: neither side's byte count moved and no flush or EOF
        happened (``Relay.mark``) since the sweep that first saw them so.
        Half-closed (a FIN either way) uses the close-wait timeout when it
        is set, as conntrack's CLOSE_WAIT state does; else the established one.
        """
        self._sweep_timer = None
        now = self.loop.time()
        established = self.tcp_timeout_established
        close_wait = self.tcp_timeout_close_wait
        expired: list[tuple[Relay, str]] = []
        for relay in self.active:
            up = relay.upstream
            if relay.phase != LINKED or up is None:
                continue  # connecting: the connect timeout covers it
            cl = relay.client
            mark = cl.nbytes + up.nbytes
            if mark != relay.mark:
                relay.mark = mark
                relay.idle_since = now
                relay.segs = -1
                # A live connection's bytes reach the counters sweep by sweep,
                # not only when it ends.
                relay.count_bytes()
                self.touch(relay.metrics)
                continue
            if close_wait and (cl.eof or up.eof or cl.shut or up.shut):
                limit, reason = close_wait, "close_wait"
            else:
                limit, reason = established, "established"
            if not limit or now - relay.idle_since < limit / 2:
                continue
            # No payload for half the timeout: from here on, packets without any
            # (keepalive probes) count too, as conntrack counts every packet. Two
            # readings of the received segments per idle period, not one a sweep:
            # one halfway, then one at the timeout.
            if relay.segs < 0:
                relay.segs = _segs_in(cl) + _segs_in(up)
                continue
            if now - relay.idle_since >= limit:
                segs = _segs_in(cl) + _segs_in(up)
                if segs != relay.segs:
                    relay.segs = segs
                    relay.idle_since = now
                    continue
                if _unsent(cl) or _unsent(up):
                    # Still delivering what it was given (a slow or zero-window
                    # reader): segments, probes and ACKs flow, which conntrack
                    # counts as activity; a peer that is gone fails by TCP's
                    # own retransmission timeout instead.
                    relay.idle_since = now
                    continue
                expired.append((relay, reason))
        for relay, reason in expired:
            relay.expire(reason, now - relay.idle_since)
        if self.active:
            self.start_sweeping()

    # -- logging -----------------------------------------------------------------

    def warn(self, key: tuple[str, ...], msg: str, *args: Any, exc_info: Any = None) -> None:
        """Log a per-connection warning, rate-limited per ``key`` (cause, service).

        The first of a key in ``LOG_WINDOW`` is written in full; the rest are
        counted and summarised when the window ends (a timer makes sure it does).
        """
        if self.logs.warning(key, msg, *args, exc_info=exc_info) and self._log_timer is None:
            self._log_timer = self.loop.call_later(LOG_WINDOW + _TIMER_SLACK, self._log_tick)

    def _log_tick(self) -> None:
        """Write the summaries of ended windows; come back when the next one ends."""
        self._log_timer = None
        due = self.logs.flush()
        if due is not None:
            self._log_timer = self.loop.call_at(due + _TIMER_SLACK, self._log_tick)

    # -- metrics -----------------------------------------------------------------

    def touch(self, m: PortMetrics) -> None:
        """``m`` has counts to flush; schedule a flush if none is pending."""
        if not m.dirty:
            m.dirty = True
            self._dirty.append(m)
            m.ensure_children()  # first traffic: the live gauge exists from now on
        if self._flush_timer is None:
            self._flush_timer = self.loop.call_later(METRICS_FLUSH_INTERVAL, self.flush_metrics)

    def flush_metrics(self) -> None:
        """Push every pending count to Prometheus now."""
        if self._flush_timer is not None:
            self._flush_timer.cancel()
            self._flush_timer = None
        dirty, self._dirty = self._dirty, []
        for m in dirty:
            m.flush()

    # -- lifecycle ---------------------------------------------------------------

    def connection_finished(self) -> None:
        if self.on_room is not None and self.has_capacity():
            self.on_room()
        if not self.active and self._idle is not None:
            self._idle.set()

    async def wait_idle(self, timeout: float) -> bool:
        """Wait until no connection is left, up to ``timeout``; True if none is."""
        if not self.active:
            return True
        self._idle = asyncio.Event()
        try:
            async with asyncio.timeout(timeout):
                await self._idle.wait()
        except TimeoutError:
            return not self.active
        finally:
            self._idle = None
        return True

    def linked(self) -> int:
        """Connections relaying: connected upstream, not yet finished."""
        return sum(1 for relay in self.active if relay.phase == LINKED)

    def connecting(self) -> int:
        """Connect attempts waiting for their answer or their deadline."""
        return len(self._deadlines)

    @property
    def sweeping(self) -> bool:
        """An idle sweep is scheduled (only while some connection is live)."""
        return self._sweep_timer is not None

    def max_buffered(self) -> int:
        """The most bytes any one connection holds for a side that has not taken them
        (the memory a slow reader costs: one read per direction at most)."""
        return max((relay.buffered() for relay in self.active), default=0)

    def abort_all(self) -> int:
        """RST every live connection; returns how many there were."""
        relays = list(self.active)
        for r in relays:
            r.abort()
        self.flush_metrics()
        return len(relays)

    def close(self) -> None:
        """RST every live connection and release the epoll set. Idempotent."""
        self.abort_all()
        for timer in (self._deadline_timer, self._sweep_timer, self._log_timer,
                      self._starve_timer):
            if timer is not None:
                timer.cancel()
        self._deadline_timer = self._sweep_timer = self._log_timer = None
        self._starve_timer = None
        self.logs.flush(force=True)  # what was held back is still said
        self._deadlines.clear()
        self._sides.clear()
        if self._ep is not None:
            self.loop.remove_reader(self._ep.fileno())
            self._ep.close()
            self._ep = None
