"""What happens to each accepted connection: decide, connect upstream, relay.

Owns: the hot path. For every accepted client socket it applies the
*current* ``PortPlan`` of its NodePort (``decision.decide``), resets the
client for Drop/Reject, and for Forward connects to the endpoint (SNAT, or
IP_TRANSPARENT bound to the client's address), retrying other eligible
endpoints on failure, then relays bytes both ways until both sides are done.
It also holds every live connection, which is what draining counts.

Never: log or allocate per chunk, touch metrics per chunk (bytes are counted
in ints and added once at close), read a client before its upstream is
connected, or hold more than a bounded amount of data per connection.

Relay rules (the TCP semantics a kernel DNAT would give):

- data is written to the other side as it arrives; when a side's write
  buffer passes ``HIGH_WATER`` its *peer* stops reading until it drains
  below ``LOW_WATER`` (pause_writing/resume_writing), so memory per
  connection stays bounded by roughly HIGH_WATER plus one read per direction;
- EOF is half-close: ``eof_received`` becomes ``write_eof()`` (shutdown
  SHUT_WR) on the other side, and the pair is closed once both directions
  have seen EOF and flushed; a half-closed pair is never left behind;
- an error on one side (RST, EPIPE, timeout) becomes an RST on the other
  (SO_LINGER 0, then abort).

Why every live connection is held in ``Forwarder.active``: uvloop 0.23 keeps
no reference to a transport that is neither reading nor writing (both
directions at EOF), so an unclosed pair referenced only by its own
protocol/transport cycle gets collected by the cyclic GC while its libuv
handle is still open, and a later callback frees it twice ("double free or
corruption", the crash the peers doc saw with a half-close leak; verified:
the same leak with the references kept merely hits EMFILE).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import os
import socket
import struct
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass

from proxy import metrics
from proxy.balancer import Balancer
from proxy.decision import Drop, Forward, PortPlan, Reject, decide
from proxy.transparent import upstream_socket

log = logging.getLogger(__name__)

HIGH_WATER = 64 * 1024
LOW_WATER = 16 * 1024
_LINGER_RST = struct.pack("ii", 1, 0)


class PortMetrics:
    """The labelled metric children of one service port, looked up once."""

    __slots__ = (
        "accepted", "active", "bytes_to_client", "bytes_to_endpoint", "connect_failures",
        "dropped", "forwarded_direct", "forwarded_snat", "rejected",
    )

    def __init__(self, key: str) -> None:
        self.accepted = metrics.CONNECTIONS_ACCEPTED.labels(key)
        self.forwarded_snat = metrics.CONNECTIONS_FORWARDED.labels(key, "true")
        self.forwarded_direct = metrics.CONNECTIONS_FORWARDED.labels(key, "false")
        self.dropped = metrics.CONNECTIONS_DROPPED.labels(key)
        self.rejected = metrics.CONNECTIONS_REJECTED.labels(key)
        self.connect_failures = metrics.UPSTREAM_CONNECT_FAILURES.labels(key)
        self.bytes_to_endpoint = metrics.BYTES.labels(key, "to_endpoint")
        self.bytes_to_client = metrics.BYTES.labels(key, "to_client")
        self.active = metrics.ACTIVE_CONNECTIONS.labels(key)


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
    """"Connection refused", not sock_connect's "Connect call failed (...)"."""
    if isinstance(exc, TimeoutError):
        return "timed out"
    errno_ = getattr(exc, "errno", None)
    return os.strerror(errno_) if errno_ else str(exc)


def reset_socket(sock: socket.socket) -> None:
    """Close ``sock`` with an RST instead of a FIN."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RST)
    sock.close()


def reset_transport(transport: asyncio.BaseTransport) -> None:
    """Abort ``transport`` with an RST: its peer must see a reset, not an EOF."""
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RST)
    transport.abort()  # type: ignore[attr-defined]


class _Side(asyncio.Protocol):
    """One socket of a relayed pair: what it reads goes to ``peer``."""

    __slots__ = ("eof", "exc", "lost", "nbytes", "peer", "pending", "relay", "transport")

    def __init__(self, relay: Relay) -> None:
        self.relay = relay
        self.transport: asyncio.Transport | None = None
        self.peer: asyncio.Transport | None = None
        self.pending: list[bytes] | None = None
        self.nbytes = 0
        self.eof = False
        self.lost = False
        self.exc: Exception | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        transport.set_write_buffer_limits(HIGH_WATER, LOW_WATER)  # type: ignore[attr-defined]

    def data_received(self, data: bytes) -> None:
        self.nbytes += len(data)
        peer = self.peer
        if peer is not None:
            peer.write(data)
            return
        # The other transport does not exist yet (a server-first endpoint, or
        # uvloop reading right after connection_made): keep what arrived and
        # stop reading until link().
        if self.pending is None:
            self.pending = []
        self.pending.append(data)
        self.transport.pause_reading()  # type: ignore[union-attr]

    def eof_received(self) -> bool:
        self.eof = True
        if self.peer is not None:
            self.relay.half_closed(self)
        return True  # keep our write side open: this is a half-close

    def pause_writing(self) -> None:
        # Our write buffer is full: stop reading from the other socket.
        other = self.relay.other(self)
        if not other.eof and other.transport is not None:
            other.transport.pause_reading()

    def resume_writing(self) -> None:
        other = self.relay.other(self)
        # Never resume a side that saw EOF: it would deliver EOF again.
        if not other.eof and other.transport is not None:
            other.transport.resume_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self.exc = exc
        self.relay.side_lost(self)

    def link(self, peer: asyncio.Transport) -> None:
        self.peer = peer
        if self.pending:
            for chunk in self.pending:
                peer.write(chunk)
            self.pending = None
        if self.eof:
            self.relay.half_closed(self)
        elif self.transport is not None and not self.transport.is_closing():
            self.transport.resume_reading()


class Relay:
    """One proxied connection, from accept until both sockets are closed.

    Phases: *connecting* (``task`` runs; the client is a raw socket that is
    not read), *linked* (two transports relaying), *finished* (removed from
    ``Forwarder.active``). Aborting works in every phase.
    """

    __slots__ = (
        "aborted", "client", "client_addr", "csock", "endpoint", "fwd", "linked",
        "metrics", "node_port", "snat", "state", "task", "upstream",
    )

    def __init__(
        self, fwd: Forwarder, state: PortState, csock: socket.socket,
        client_addr: tuple[str, int], node_port: int,
    ) -> None:
        self.fwd = fwd
        self.state = state
        self.metrics = state.metrics
        self.csock: socket.socket | None = csock
        self.client_addr = client_addr
        self.node_port = node_port
        self.client = _Side(self)
        self.upstream = _Side(self)
        self.task: asyncio.Task[None] | None = None
        self.endpoint = ""
        self.snat = True
        self.linked = False
        self.aborted = False

    def other(self, side: _Side) -> _Side:
        return self.upstream if side is self.client else self.client

    # -- connecting --------------------------------------------------------------

    async def run(self, decision: Forward) -> None:
        try:
            await self._setup(decision)
        except asyncio.CancelledError:
            self._abort()  # drain deadline or shutdown while connecting
            raise
        except OSError as exc:
            # The client or endpoint vanished between connect and transport setup.
            log.debug("%s: setting up %s -> %s failed: %s",
                      self.state.plan.key, self._client_str(), self.endpoint, exc)
            self._abort()
        except Exception:
            log.exception("%s: relay setup for %s failed", self.state.plan.key, self._client_str())
            self._abort()
        finally:
            self.task = None
        if not self.linked and not self.aborted:
            self._abort()

    async def _setup(self, decision: Forward) -> None:
        fwd = self.fwd
        loop = fwd.loop
        client_ip = self.client_addr[0]
        failed: list[tuple[str, int]] = []
        factory = self._upstream_protocol
        while True:
            ep = decision.endpoint
            snat = decision.snat or not fwd.transparent
            usock = None
            # A fresh protocol per attempt: a connect cancelled by the timeout
            # may still deliver connection_lost to the previous one.
            self.upstream = _Side(self)
            try:
                async with asyncio.timeout(fwd.connect_timeout):
                    if snat:
                        # An ordinary connect from the node: one await, and
                        # the loop makes the socket. Measured 15-40% more
                        # connections/s on uvloop than sock_connect followed
                        # by create_connection(sock=).
                        await loop.create_connection(factory, ep.ip, ep.port)
                    else:
                        usock = upstream_socket(client_ip)
                        await loop.sock_connect(usock, ep.addr)
                        await loop.create_connection(factory, sock=usock)
                        usock = None  # the transport owns it now
                break
            except (OSError, TimeoutError) as exc:
                if usock is not None:
                    usock.close()
                self._drop_upstream()
                next_decision = self._connect_failed(ep.addr, str(ep), snat, exc, failed)
                if next_decision is None:
                    return
                decision = next_decision
            except BaseException:
                if usock is not None:
                    usock.close()
                self._drop_upstream()
                raise
        self.endpoint = str(decision.endpoint)
        self.snat = snat
        csock, self.csock = self.csock, None
        assert csock is not None
        try:
            await loop.connect_accepted_socket(lambda: self.client, sock=csock)
        except BaseException:
            if csock.fileno() != -1:
                reset_socket(csock)
            raise
        (self.metrics.forwarded_snat if snat else self.metrics.forwarded_direct).inc()
        up, cl = self.upstream, self.client
        if self.aborted:
            return
        if up.lost or cl.lost:
            # One side went away while the other transport was being made:
            # pass on how it ended (RST or FIN) to the survivor.
            gone, survivor = (up, cl) if up.lost else (cl, up)
            self.linked = True
            if survivor.transport is not None and not survivor.lost:
                self._pass_on(gone, survivor)
            self._maybe_finish()
            return
        self.linked = True
        cl.link(up.transport)  # type: ignore[arg-type]
        up.link(cl.transport)  # type: ignore[arg-type]

    def _upstream_protocol(self) -> _Side:
        return self.upstream

    def _drop_upstream(self) -> None:
        """Close a half-made upstream transport (the connect timed out mid-way)."""
        t = self.upstream.transport
        if t is not None and not t.is_closing():
            t.abort()  # type: ignore[attr-defined]

    def _connect_failed(
        self, addr: tuple[str, int], ep: str, snat: bool, exc: BaseException,
        failed: list[tuple[str, int]],
    ) -> Forward | None:
        """Log and count one failed connect; the next decision, or None after RST."""
        state = self.fwd.ports.get(self.node_port, self.state)
        plan = state.plan
        client_ip = self.client_addr[0]
        why = _describe(exc)
        self.metrics.connect_failures.inc()
        log.warning(
            "%s: connect to endpoint %s for client %s failed (%s%s)",
            plan.key, ep, self._client_str(), why, ", SNAT" if snat else "",
        )
        failed.append(addr)
        state.balancer.forget(client_ip)
        decision = decide(
            plan, client_ip, self.fwd.local_addresses, state.balancer, time.monotonic(),
            failed, self.fwd.cluster_cidrs,
        )
        if isinstance(decision, Forward):
            self.state = state
            return decision
        self.metrics.rejected.inc()
        log.warning("%s: client %s reset: %s", plan.key, self._client_str(), decision.reason)
        self._abort()
        return None

    # -- relaying ----------------------------------------------------------------

    def half_closed(self, side: _Side) -> None:
        """``side`` read EOF: pass it on, and close once both directions are done."""
        other = self.other(side)
        peer = side.peer
        if peer is None:
            return
        if not other.lost and not peer.is_closing():
            peer.write_eof()
        if other.eof:
            # Both directions have seen EOF. close() flushes what is still
            # buffered and then closes: nothing half-closed is left behind.
            for s in (self.client, self.upstream):
                if s.transport is not None and not s.transport.is_closing():
                    s.transport.close()

    def side_lost(self, side: _Side) -> None:
        if side is not self.client and side is not self.upstream:
            return  # an abandoned connect attempt closing late
        other = self.other(side)
        if self.linked and other.transport is not None and not other.lost:
            self._pass_on(side, other)
        self._maybe_finish()

    @staticmethod
    def _pass_on(gone: _Side, survivor: _Side) -> None:
        t = survivor.transport
        assert t is not None
        if t.is_closing():
            return
        if gone.exc is None:
            t.close()  # a clean close: FIN after what is buffered
        else:
            reset_transport(t)  # RST in, RST out

    def _maybe_finish(self) -> None:
        if self.task is not None and not self.linked:
            return  # run() is still setting up and will decide
        if any(s.transport is not None and not s.lost for s in (self.client, self.upstream)):
            return  # a connection_lost is still to come
        self._finish()

    def _abort(self) -> None:
        """RST whatever exists of this connection; finish once it is all closed."""
        self.aborted = True
        if self.csock is not None:
            reset_socket(self.csock)
            self.csock = None
        for s in (self.client, self.upstream):
            if s.transport is not None and not s.lost and not s.transport.is_closing():
                reset_transport(s.transport)
        self.linked = True  # nothing more to set up: let connection_lost finish it
        self._maybe_finish()

    def abort(self) -> None:
        """Shutdown path: reset the connection, whatever phase it is in."""
        if self.task is not None:
            # The task resets what it has made when it sees the cancellation;
            # the raw client socket is reset now, in case the loop never
            # runs again (process exit).
            self.task.cancel()
            if self.csock is not None:
                reset_socket(self.csock)
                self.csock = None
        else:
            self._abort()

    def _finish(self) -> None:
        active = self.fwd.active
        if self not in active:
            return  # already finished
        del active[self]
        m = self.metrics
        m.active.dec()
        if self.client.nbytes:
            m.bytes_to_endpoint.inc(self.client.nbytes)
        if self.upstream.nbytes:
            m.bytes_to_client.inc(self.upstream.nbytes)
        self.fwd.connection_finished()

    def _client_str(self) -> str:
        return f"{self.client_addr[0]}:{self.client_addr[1]}"


class Forwarder:
    """Accepted sockets in, relays out; the dataplane swaps ``ports`` on each sync."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        connect_timeout: float = 2.0,
        transparent: bool = False,
        max_connections: int = 0,
    ) -> None:
        self.loop = loop
        self.connect_timeout = connect_timeout
        self.transparent = transparent
        """True only while the return-path routing is installed."""
        self.max_connections = max_connections
        """0 means unlimited."""
        self.ports: dict[int, PortState] = {}
        self.local_addresses: Collection[str] = frozenset()
        self.cluster_cidrs: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...] = ()
        """Pod CIDRs: their NodePort traffic gets Cluster semantics (detect-local)."""
        # A dict used as an ordered set: the strong references that keep
        # live uvloop transports from being garbage collected (see above).
        self.active: dict[Relay, None] = {}
        self._idle: asyncio.Event | None = None
        self.on_room: Callable[[], None] | None = None
        """Called when a connection ends and there is room below the limit."""

    def has_capacity(self) -> bool:
        return not self.max_connections or len(self.active) < self.max_connections

    def on_accept(self, csock: socket.socket, addr: tuple[str, int], node_port: int) -> None:
        state = self.ports.get(node_port)
        if state is None:
            # The listener is being closed by this very sync.
            reset_socket(csock)
            return
        m = state.metrics
        m.accepted.inc()
        client_ip = addr[0]
        decision = decide(
            state.plan, client_ip, self.local_addresses, state.balancer, time.monotonic(),
            (), self.cluster_cidrs,
        )
        if isinstance(decision, Forward):
            relay = Relay(self, state, csock, addr, node_port)
            self.active[relay] = None
            m.active.inc()
            relay.task = self.loop.create_task(relay.run(decision))
            return
        # Drop reaches here only in the race where the SYN passed before the
        # filter went on; the handshake is done, so an RST is the nearest
        # thing to silence. Reject: no endpoint at all.
        if isinstance(decision, Drop):
            m.dropped.inc()
        else:
            assert isinstance(decision, Reject)
            m.rejected.inc()
        if log.isEnabledFor(logging.DEBUG):
            log.debug("%s: %s:%d reset: %s", state.plan.key, addr[0], addr[1], decision.reason)
        reset_socket(csock)

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

    def abort_all(self) -> int:
        """RST every live connection; returns how many there were."""
        relays = list(self.active)
        for r in relays:
            r.abort()
        # Settle the books now: a process that is exiting never runs the
        # pending connection_lost callbacks. The loop itself still references
        # aborted transports until they are closed, so nothing is collected
        # early, and a later _finish() is a no-op.
        for r in relays:
            r._finish()
        return len(relays)
