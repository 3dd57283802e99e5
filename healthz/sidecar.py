"""The healthz sidecar: every health and metrics listener of one node.

Owns: wiring and ports. It holds the per-service health checks
(``services``, a ``ServiceHealthServer``), the node health server and the
metrics mux, all reading the one ``ProxyHealth`` it is given, and opens the
node-health and metrics ports, retrying them in the background if they are
taken.

Never: read a snapshot or compute anything about services: the proxier's
sync hands ``services`` and ``ProxyHealth`` plain data (``proxy.proxier``).
Nor let a failing listener stop the others: kube-proxy keeps running when
its healthz port is busy, and so does kpx.

``kpx node`` runs a ``Sidecar`` beside its dataplane; ``kpx healthz``
(``proxy.commands.healthz``) runs one alone, fed by the same sync with no
dataplane.

IPv6: kube-proxy's ``0.0.0.0:10256`` is a Go wildcard listener, which takes
both families. kpx's default stays an IPv4 socket; a node that serves IPv6
turns on ``serve_healthz_ipv6`` and gets a second socket, ``[::]`` on the same
port with ``IPV6_V6ONLY``. A second socket rather than one ``[::]`` socket
for both: it can be added when the Node's IPv6 address shows up in a later
sync without the IPv4 port refusing for a moment, and a kernel without IPv6
cannot take the IPv4 port down with it.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from collections.abc import Mapping
from typing import Any

from healthz.http import DEFAULT_HEADER_TIMEOUT, DEFAULT_MAX_CONNECTIONS, Handler, HttpListener
from healthz.metrics import PROXY_MODE, MetricsServer
from healthz.proxy_health import NodeHealthServer, ProxyHealth
from healthz.service_health import ServiceHealthServer

log = logging.getLogger(__name__)

HEALTHZ_PORT = 10256
HEALTHZ6 = "healthz6"
"""The listener name of the IPv6 ``/healthz`` socket (``serve_healthz_ipv6``)."""
METRICS_PORT = 10249


class Sidecar:
    """All healthz listeners of one node, answering from ``health`` and the syncs."""

    def __init__(
        self,
        health: ProxyHealth,
        healthz_bind: tuple[str, int] | None = ("0.0.0.0", HEALTHZ_PORT),
        metrics_bind: tuple[str, int] | None = ("127.0.0.1", METRICS_PORT),
        *,
        proxy_mode: str = PROXY_MODE,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        header_timeout: float = DEFAULT_HEADER_TIMEOUT,
        retry_interval: float = 5.0,
        healthz_ipv6: bool = False,
        configz: Mapping[str, Any] | None = None,
    ) -> None:
        self.health = health
        self.healthz_bind = healthz_bind
        """Where ``/healthz`` listens; None: nowhere. The command line parsed it
        (``--healthz-bind-address``), before the process claimed its namespace."""
        self.metrics_bind = metrics_bind
        self.max_connections = max_connections
        self.header_timeout = header_timeout
        self.retry_interval = retry_interval
        self.services = ServiceHealthServer(
            health,
            max_connections=max_connections,
            header_timeout=header_timeout,
            retry_interval=retry_interval,
        )
        self.node_health = NodeHealthServer(health)
        self.metrics = MetricsServer(proxy_mode=proxy_mode, configz=configz)
        self._listeners: dict[str, HttpListener] = {}
        self._retries: dict[str, asyncio.Task[None]] = {}
        self._closing: list[HttpListener] = []
        self._healthz_ipv6 = healthz_ipv6
        self._started = False
        self._stopped = False

    @classmethod
    def from_flags(
        cls,
        health: ProxyHealth,
        args: argparse.Namespace,
        configz: Mapping[str, Any] | None = None,
    ) -> Sidecar:
        """The sidecar as ``kpx node`` and ``kpx healthz`` configure it from their flags.

        ``configz``: what ``/configz`` serves (``MetricsServer``), built by
        the caller, which knows what its flags mean.
        """
        return cls(
            health,
            healthz_bind=args.healthz_bind_address,
            metrics_bind=args.metrics_bind_address,
            retry_interval=min(5.0, args.sync_period),
            proxy_mode=getattr(args, "proxy_mode", PROXY_MODE),
            configz=configz,
        )

    @property
    def healthz_address(self) -> tuple[str, int] | None:
        """Where ``/healthz`` is actually listening (resolves port 0), if it is."""
        return self._bound("healthz")

    @property
    def healthz_address6(self) -> tuple[str, int] | None:
        """Where the IPv6 ``/healthz`` socket of ``serve_healthz_ipv6`` listens, if it does."""
        return self._bound(HEALTHZ6)

    @property
    def metrics_address(self) -> tuple[str, int] | None:
        return self._bound("metrics")

    def serve_healthz_ipv6(self, on: bool) -> None:
        """Also answer ``/healthz`` and ``/livez`` over IPv6 (``[::]``, same port), or stop.

        For a node that serves IPv6, whose load balancers may probe its IPv6
        address (module doc). Only a wildcard ``--healthz-bind-address``
        (``0.0.0.0``) grows an IPv6 socket: a specific address is the
        operator's choice, and ``[::]`` already follows the kernel's
        ``bindv6only``. Before ``start`` this only records the wish. Call on
        the loop; a busy port is retried in the background as the others are.
        """
        if self._stopped or on == self._healthz_ipv6:
            return
        self._healthz_ipv6 = on
        if not self._started:
            return
        if on:
            self._start_healthz6()
        else:
            self._close(HEALTHZ6)

    def _healthz6_bind(self) -> tuple[str, int] | None:
        if self.healthz_bind is None:
            return None
        host, port = self.healthz_bind
        if host != "0.0.0.0":
            log.info("healthz bound to %s only: not adding an IPv6 socket", host)
            return None
        if port == 0:  # the IPv4 socket's port, so both families share one
            port = (self.healthz_address or (host, 0))[1]
        return "::", port

    def _start_healthz6(self) -> None:
        bind = self._healthz6_bind()
        if bind is not None:
            self._open_or_retry(HEALTHZ6, bind, self.node_health.answer)

    def _open_or_retry(self, name: str, bind: tuple[str, int], handler: Handler) -> None:
        if not self._open(name, bind, handler, quiet=False):
            self._retries[name] = asyncio.create_task(
                self._retry_open(name, bind, handler), name=f"retry {name}"
            )

    def _close(self, name: str) -> None:
        task = self._retries.pop(name, None)
        if task is not None:
            task.cancel()
        listener = self._listeners.pop(name, None)
        self._closing = [lst for lst in self._closing if not lst.settled]
        if listener is not None:
            listener.close()
            self._closing.append(listener)
            log.info("stopped serving %s", name)

    def _bound(self, name: str) -> tuple[str, int] | None:
        listener = self._listeners.get(name)
        if listener is None or not listener.addresses:
            return None
        return listener.addresses[0]

    async def start(self) -> None:
        """Open the node ports (or schedule their retry) and the health checks synced so far."""
        if self._started:
            raise RuntimeError("Sidecar already started")
        self._started = True
        for name, bind, handler in (
            ("healthz", self.healthz_bind, self.node_health.answer),
            ("metrics", self.metrics_bind, self.metrics.answer),
        ):
            if bind is None:
                log.info("%s server disabled", name)
                continue
            self._open_or_retry(name, bind, handler)
        if self._healthz_ipv6:
            self._start_healthz6()
        self.services.start()

    def _open(self, name: str, bind: tuple[str, int], handler: Handler, quiet: bool) -> bool:
        listener = HttpListener(
            name,
            handler,
            max_connections=self.max_connections,
            header_timeout=self.header_timeout,
        )
        try:
            # Only the added IPv6 healthz socket is V6ONLY (it shares the port
            # with 0.0.0.0); a configured [::] keeps the kernel's default.
            listener.open([bind], v6only=True if name == HEALTHZ6 else None)
        except OSError as exc:
            log.log(
                logging.DEBUG if quiet else logging.ERROR,
                "cannot serve %s on %s:%d: %s; retrying every %gs",
                name, bind[0], bind[1], exc, self.retry_interval,
            )
            return False
        self._listeners[name] = listener
        log.info("serving %s on %s:%d", name, *listener.addresses[0])
        return True

    async def _retry_open(self, name: str, bind: tuple[str, int], handler: Handler) -> None:
        while not self._stopped:
            await asyncio.sleep(self.retry_interval)
            if not self._stopped and self._open(name, bind, handler, quiet=True):
                self._retries.pop(name, None)
                return

    async def stop(self) -> None:
        """Close every listener; afterwards every port of this sidecar refuses."""
        self._stopped = True
        retries = list(self._retries.values())
        for task in retries:
            task.cancel()
        await asyncio.gather(*retries, return_exceptions=True)
        self._retries.clear()
        for listener in self._listeners.values():
            listener.close()
        await self.services.stop()
        for listener in [*self._listeners.values(), *self._closing]:
            await listener.wait_closed()
        self._listeners.clear()
        self._closing.clear()
