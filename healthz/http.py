"""The HTTP shell every healthz listener shares: Go-shaped answers, guarded connections.

Owns:
- ``go_response``: an aiohttp response whose status line, header order and
  headers match what Go's ``net/http`` writes for the same handler (no
  ``Server`` header; handler headers, then ``Date``, ``Content-Length``).
- ``GuardedServer``: aiohttp's low-level ``web.Server`` with the two guards
  aiohttp lacks: a request-header deadline and a per-listener connection cap
  that evicts the least recently active connection instead of refusing.
- ``HttpListener``: one such server on a set of sockets that are bound and
  listening *synchronously*, so a caller learns about EADDRINUSE at once and a
  closed listener refuses connections as soon as ``close()`` returns.

Never: decide what a response says (the handlers in ``service_health``,
``proxy_health`` and ``metrics`` do), read the state, or let a slow client
hold a slot for longer than the header timeout.

Why these guards: the ports here are probed by cloud load balancers from the
network. A client that opens connections and sends nothing (slowloris) must
not stop the next probe from being answered; Go's server would simply keep
spawning goroutines, asyncio needs an explicit bound.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from collections import OrderedDict
from collections.abc import Callable, Sequence
from email.utils import formatdate
from typing import Any

from aiohttp import hdrs, web
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest
from aiohttp.web_response import StreamResponse
from prometheus_client import Counter

from healthz.registry import REGISTRY

log = logging.getLogger(__name__)

Handler = Callable[[BaseRequest], StreamResponse]
"""A synchronous handler: it answers from memory, so it never needs to await."""

DEFAULT_MAX_CONNECTIONS = 100
DEFAULT_HEADER_TIMEOUT = 5.0
BACKLOG = socket.SOMAXCONN

JSON_HEADERS = (("Content-Type", "application/json"), ("X-Content-Type-Options", "nosniff"))
TEXT_HEADERS = (
    ("Content-Type", "text/plain; charset=utf-8"),
    ("X-Content-Type-Options", "nosniff"),
)

CONNECTIONS_CLOSED = Counter(
    "kubeproxy_kpx_healthz_connections_closed",
    "healthz connections closed by kpx before a request completed: "
    "reason=limit (evicted at the per-listener cap) or header_timeout",
    ["reason"],
    registry=REGISTRY,
)


class GoResponse(web.Response):
    """A ``web.Response`` that sends no ``Server`` header, as Go's net/http sends none.

    aiohttp adds ``Server`` unconditionally while preparing headers, so the
    only place to take it out again is right after that step.
    """

    async def _prepare_headers(self) -> None:
        await super()._prepare_headers()
        self.headers.popall(hdrs.SERVER, None)


def go_response(status: int, headers: Sequence[tuple[str, str]], body: bytes) -> GoResponse:
    """The response Go writes for a handler that sets ``headers`` and writes ``body``.

    Go sorts the handler's headers, then appends ``Date`` and (for a small,
    finished body) ``Content-Length``; ``Connection`` comes last when needed,
    which aiohttp already does. Callers pass their headers sorted. HEAD keeps
    ``Content-Length`` and drops the body, exactly as Go does.
    """
    all_headers = [
        *headers,
        (hdrs.DATE, formatdate(usegmt=True)),
        (hdrs.CONTENT_LENGTH, str(len(body))),
    ]
    return GoResponse(status=status, body=body, headers=all_headers)


NOT_FOUND_BODY = b"404 page not found\n"


def go_not_found() -> GoResponse:
    """Go's ``http.NotFound``: what a ServeMux answers for an unregistered path."""
    return go_response(
        404,
        [("Content-Type", "text/plain; charset=utf-8"), ("X-Content-Type-Options", "nosniff")],
        NOT_FOUND_BODY,
    )


IPV4 = "IPv4"
IPV6 = "IPv6"


def arrival_family(request: BaseRequest) -> str:
    """``"IPv4"`` or ``"IPv6"``: the family of the address the request arrived on.

    Read from the connection's local address, so it is the family the client
    reached the node over. An IPv4 client of a dual-stack socket (``::`` with
    ``IPV6_V6ONLY`` off) shows as ``::ffff:a.b.c.d`` and counts as IPv4, as
    it is IPv4 on the wire. No address (a transport already gone) is IPv4.
    """
    transport = request.transport
    sockname = transport.get_extra_info("sockname") if transport is not None else None
    if not isinstance(sockname, tuple) or not sockname or ":" not in str(sockname[0]):
        return IPV4
    host = str(sockname[0]).partition("%")[0]
    try:
        addr = ipaddress.IPv6Address(host)
    except ValueError:
        return IPV6
    return IPV4 if addr.ipv4_mapped is not None else IPV6


class _Connection(RequestHandler):
    """aiohttp's per-connection protocol, answering parse errors the way Go does.

    Go answers a malformed request with a plain ``400 Bad Request`` and closes;
    it does not log it. aiohttp would log a traceback per bad request, which on
    a port open to the network is a log-flooding vector.
    """

    __slots__ = ()

    def handle_error(
        self,
        request: BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> StreamResponse:
        log.debug("bad request from %s: %s", request.remote, exc or message)
        if request.writer.output_size > 0:
            raise ConnectionError("response already started; cannot send an error")
        text = {400: "400 Bad Request", 504: "504 Gateway Timeout"}.get(
            status, "500 Internal Server Error"
        )
        resp = GoResponse(
            status=status if status in (400, 504) else 500,
            body=text.encode(),
            headers={
                "Content-Type": "text/plain; charset=utf-8",
                hdrs.CONNECTION: "close",
            },
        )
        resp.force_close()
        return resp


class GuardedServer(web.Server):
    """aiohttp's low-level server, bounded in time and in connections.

    Every connection must complete a request's headers within
    ``header_timeout`` of being accepted (or of its previous request), or it is
    closed: aiohttp itself has no request-header timeout. At most
    ``max_connections`` are kept; one more evicts the least recently active
    connection. Handlers answer instantly, so the least recently active one is
    the one that has been idle longest, and a fresh probe always gets a slot.

    Must be created on the running loop (aiohttp's ``Server`` binds to it).
    """

    def __init__(
        self,
        handler: Handler,
        *,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        header_timeout: float = DEFAULT_HEADER_TIMEOUT,
    ) -> None:
        self._connection_kwargs: dict[str, Any] = {
            "access_log": None,
            # aiohttp's own idle timer then agrees with ours.
            "keepalive_timeout": header_timeout,
            # A body the handler never reads is not worth waiting for.
            "lingering_time": 0,
        }
        super().__init__(self._dispatch, **self._connection_kwargs)
        self._guard_loop = asyncio.get_running_loop()
        self._answer = handler
        self.max_connections = max(1, max_connections)
        self.header_timeout = header_timeout
        self._deadlines: OrderedDict[RequestHandler, asyncio.TimerHandle] = OrderedDict()

    def __call__(self) -> RequestHandler:
        return _Connection(self, loop=self._guard_loop, **self._connection_kwargs)

    @property
    def open_connections(self) -> int:
        return len(self._deadlines)

    def connection_made(self, handler: RequestHandler, transport: asyncio.Transport) -> None:
        super().connection_made(handler, transport)
        while len(self._deadlines) >= self.max_connections:
            victim, timer = self._deadlines.popitem(last=False)
            timer.cancel()
            CONNECTIONS_CLOSED.labels(reason="limit").inc()
            victim.force_close()
        self._arm(handler)

    def connection_lost(self, handler: RequestHandler, exc: BaseException | None = None) -> None:
        super().connection_lost(handler, exc)
        timer = self._deadlines.pop(handler, None)
        if timer is not None:
            timer.cancel()

    def _arm(self, handler: RequestHandler) -> None:
        self._deadlines[handler] = self._guard_loop.call_later(
            self.header_timeout, self._expire, handler
        )

    def _expire(self, handler: RequestHandler) -> None:
        if self._deadlines.pop(handler, None) is not None:
            CONNECTIONS_CLOSED.labels(reason="header_timeout").inc()
            handler.force_close()

    async def _dispatch(self, request: BaseRequest) -> StreamResponse:
        proto = request.protocol
        timer = self._deadlines.pop(proto, None)
        if timer is not None:
            # A complete request: the connection earns a fresh deadline for the
            # next one and becomes the most recently active.
            timer.cancel()
            self._arm(proto)
        return self._answer(request)

    def close_connections(self) -> None:
        """Close every open connection now (the listener is going away)."""
        for handler, timer in list(self._deadlines.items()):
            timer.cancel()
            handler.force_close()
        self._deadlines.clear()


def bind_listen(host: str, port: int, v6only: bool | None = None) -> socket.socket:
    """A non-blocking TCP socket listening on ``host:port``, or ``OSError``.

    ``SO_REUSEADDR`` (as Go sets it) lets a port be re-bound while old
    connections sit in TIME_WAIT, but still fails while another socket is
    listening there, which is exactly the conflict that must be reported.

    ``v6only`` sets ``IPV6_V6ONLY`` on an IPv6 socket (ignored for IPv4):
    ``True`` when an IPv4 socket on the same port serves IPv4 (else ``::`` and
    ``0.0.0.0`` collide on one port, kubernetes#114702), ``False`` for one
    socket serving both families as Go's wildcard listeners do, ``None`` to
    keep the kernel's default (``net.ipv6.bindv6only``).
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6 and v6only is not None:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, int(v6only))
        sock.bind((host, port))
        sock.listen(BACKLOG)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


class HttpListener:
    """One ``GuardedServer`` listening on one or more addresses.

    ``open`` binds and listens synchronously: errors surface to the caller,
    and connections queue in the kernel until the loop starts accepting them
    a moment later. ``close`` takes effect synchronously once serving has
    started; if it is called before that, the socket is closed as soon as the
    pending start returns control, a loop iteration later.
    """

    def __init__(
        self,
        name: str,
        handler: Handler,
        *,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        header_timeout: float = DEFAULT_HEADER_TIMEOUT,
    ) -> None:
        self.name = name
        self._handler = handler
        self._max_connections = max_connections
        self._header_timeout = header_timeout
        self._server: GuardedServer | None = None
        self._pending: list[socket.socket] = []
        self._servers: list[asyncio.AbstractServer] = []
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self.addresses: list[tuple[str, int]] = []

    @property
    def server(self) -> GuardedServer | None:
        return self._server

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def settled(self) -> bool:
        """Closed, and no pending start still holds a socket."""
        return self._closed and (self._task is None or self._task.done())

    def open(self, endpoints: Sequence[tuple[str, int]], *, v6only: bool | None = None) -> None:
        """Bind and listen on every ``(host, port)``; all or nothing.

        ``v6only`` applies to the IPv6 endpoints (``bind_listen``).
        """
        loop = asyncio.get_running_loop()
        if self._task is not None:
            raise RuntimeError(f"{self.name}: already opened")
        socks: list[socket.socket] = []
        try:
            for host, port in endpoints:
                socks.append(bind_listen(host, port, v6only))
        except BaseException:
            for s in socks:
                s.close()
            raise
        self.addresses = [s.getsockname()[:2] for s in socks]
        self._server = GuardedServer(
            self._handler,
            max_connections=self._max_connections,
            header_timeout=self._header_timeout,
        )
        self._pending = socks
        self._task = loop.create_task(self._serve(), name=f"healthz-listen {self.name}")

    async def _serve(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._server is not None
        try:
            while self._pending and not self._closed:
                sock = self._pending[0]
                srv = await loop.create_server(self._server, sock=sock, backlog=BACKLOG)
                self._pending.pop(0)
                self._servers.append(srv)
        except Exception:
            log.exception("%s: could not start serving %s", self.name, self.addresses)
            self._closed = True
        if self._closed:
            self._close_now()

    def close(self) -> None:
        """Stop listening: the port refuses connections from now on (see class doc)."""
        if self._closed:
            return
        self._closed = True
        if self._task is None or self._task.done():
            self._close_now()

    def _close_now(self) -> None:
        for srv in self._servers:
            srv.close()
        for sock in self._pending:
            sock.close()
        self._servers.clear()
        self._pending.clear()
        if self._server is not None:
            self._server.close_connections()

    async def wait_closed(self) -> None:
        """Wait until a ``close()`` has fully taken effect (for tests and shutdown)."""
        if self._task is not None:
            await asyncio.shield(self._task)
