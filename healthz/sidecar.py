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
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import logging

from healthz.http import DEFAULT_HEADER_TIMEOUT, DEFAULT_MAX_CONNECTIONS, Handler, HttpListener
from healthz.metrics import PROXY_MODE, MetricsServer
from healthz.proxy_health import NodeHealthServer, ProxyHealth
from healthz.service_health import ServiceHealthServer

log = logging.getLogger(__name__)

HEALTHZ_PORT = 10256
METRICS_PORT = 10249


def parse_bind_address(value: str | None, default_port: int) -> tuple[str, int] | None:
    """``"ip:port"``, ``"[v6]:port"``, ``"ip"`` or ``":port"`` -> ``(host, port)``.

    Empty means disabled, as with kube-proxy's bind-address flags.
    """
    if value is None or not value.strip():
        return None
    value = value.strip()
    host, port = value, default_port
    if value.startswith("["):
        end = value.index("]")
        host, rest = value[1:end], value[end + 1 :]
        if rest:
            port = int(rest.removeprefix(":"))
    elif value.count(":") == 1:
        host, _, port_text = value.partition(":")
        port = int(port_text)
    host = host or "0.0.0.0"
    ipaddress.ip_address(host)
    if not 0 <= port <= 65535:
        raise ValueError(f"port {port} out of range in {value!r}")
    return host, port


class Sidecar:
    """All healthz listeners of one node, answering from ``health`` and the syncs."""

    def __init__(
        self,
        health: ProxyHealth,
        healthz_bind: str | None = f"0.0.0.0:{HEALTHZ_PORT}",
        metrics_bind: str | None = f"127.0.0.1:{METRICS_PORT}",
        *,
        proxy_mode: str = PROXY_MODE,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        header_timeout: float = DEFAULT_HEADER_TIMEOUT,
        retry_interval: float = 5.0,
    ) -> None:
        self.health = health
        self.healthz_bind = parse_bind_address(healthz_bind, HEALTHZ_PORT)
        self.metrics_bind = parse_bind_address(metrics_bind, METRICS_PORT)
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
        self.metrics = MetricsServer(proxy_mode=proxy_mode)
        self._listeners: dict[str, HttpListener] = {}
        self._retries: list[asyncio.Task[None]] = []
        self._started = False
        self._stopped = False

    @classmethod
    def from_flags(cls, health: ProxyHealth, args: argparse.Namespace) -> Sidecar:
        """The sidecar as ``kpx node`` and ``kpx healthz`` configure it from their flags."""
        return cls(
            health,
            healthz_bind=args.healthz_bind_address,
            metrics_bind=args.metrics_bind_address,
            retry_interval=min(5.0, args.sync_period),
            proxy_mode=getattr(args, "proxy_mode", PROXY_MODE),
        )

    @property
    def healthz_address(self) -> tuple[str, int] | None:
        """Where ``/healthz`` is actually listening (resolves port 0), if it is."""
        return self._bound("healthz")

    @property
    def metrics_address(self) -> tuple[str, int] | None:
        return self._bound("metrics")

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
            if not self._open(name, bind, handler, quiet=False):
                self._retries.append(
                    asyncio.create_task(self._retry_open(name, bind, handler), name=f"retry {name}")
                )
        self.services.start()

    def _open(self, name: str, bind: tuple[str, int], handler: Handler, quiet: bool) -> bool:
        listener = HttpListener(
            name,
            handler,
            max_connections=self.max_connections,
            header_timeout=self.header_timeout,
        )
        try:
            listener.open([bind])
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
                return

    async def stop(self) -> None:
        """Close every listener; afterwards every port of this sidecar refuses."""
        self._stopped = True
        for task in self._retries:
            task.cancel()
        await asyncio.gather(*self._retries, return_exceptions=True)
        self._retries.clear()
        for listener in self._listeners.values():
            listener.close()
        await self.services.stop()
        for listener in self._listeners.values():
            await listener.wait_closed()
        self._listeners.clear()
