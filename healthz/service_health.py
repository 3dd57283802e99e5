"""Per-service ``healthCheckNodePort`` servers: kube-proxy's ``service_health.go``.

Owns: one HTTP listener per Service that needs a health check, opened, moved
and closed as the proxier's syncs say, and the answer each one gives: byte
for byte what kube-proxy writes, on every path and for every method.

Its whole input is two calls of plain data, as kube-proxy's
``ServiceHealthServer`` has: ``sync_services({"ns/name": port}, hosts)``
(which services need a health check, on which port and addresses) and
``sync_endpoints({"ns/name": local ready count}, {IPv6 counts})``. The
proxier computes both from each snapshot, once (``proxy.core.sync``).

Both IP families, one server (kubernetes#114702): upstream runs one health
server per family's proxier and both bind the same ``healthCheckNodePort``,
so one loses with "address already in use". Here one server per service
listens on the hosts of both families (an IPv6 socket sets ``IPV6_V6ONLY``,
so ``::`` and ``0.0.0.0`` share the port), and a request is answered with the
``localEndpoints`` and proxy health of the family it *arrived on*: an IPv6
load balancer's check must say whether IPv6 traffic to this node would be
forwarded. A union would answer 200 to an IPv6 check on a node with only
IPv4 endpoints, whose IPv6 traffic is dropped.

Never: look at a snapshot or decide which services need a check or how many
endpoints are local; raise out of a sync (one service's bad port must not
stop the others or the dataplane); block the loop on I/O; or keep a listener
for a service that no longer needs one: a closed health port must *refuse*,
which is how e2e and load balancers tell "turned off" from "unhealthy".

Answer rules (spec section 3a): status 200 iff the service has local ready
endpoints and the proxy is healthy, else 503; ``localEndpoints`` counts unique
local *ready* IPs per Service, so a node whose pods are only terminating
answers 503 while its dataplane still forwards to them.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from aiohttp.web_request import BaseRequest
from prometheus_client import Gauge

from healthz.http import (
    DEFAULT_HEADER_TIMEOUT,
    DEFAULT_MAX_CONNECTIONS,
    IPV4,
    IPV6,
    GoResponse,
    HttpListener,
    arrival_family,
    go_response,
)
from healthz.proxy_health import ProxyHealth, family_name
from healthz.registry import REGISTRY

log = logging.getLogger(__name__)

HEALTHCHECK_LISTENERS = Gauge(
    "kubeproxy_kpx_healthcheck_services",
    "Services with a healthCheckNodePort, by listener state (serving or bind_failed)",
    ["state"],
    registry=REGISTRY,
)

ALL_ADDRESSES = "0.0.0.0"
ALL_ADDRESSES6 = "::"
"""Every local IPv6 address: a host ``sync_services`` may be given beside ``0.0.0.0``."""

_GO_ESCAPES = {
    "\a": "\\a", "\b": "\\b", "\f": "\\f", "\n": "\\n",
    "\r": "\\r", "\t": "\\t", "\v": "\\v", '"': '\\"', "\\": "\\\\",
}


def go_quote(text: str) -> str:
    """Go's ``%q`` (``strconv.Quote``) of a string.

    Unlike JSON it keeps printable non-ASCII as is and writes other control
    characters as ``\\xHH``; for Kubernetes names (DNS labels) both agree.
    """
    out = ['"']
    for ch in text:
        esc = _GO_ESCAPES.get(ch)
        if esc is not None:
            out.append(esc)
        elif ch.isprintable():
            out.append(ch)
        elif ord(ch) < 0x80:
            out.append(f"\\x{ord(ch):02x}")
        elif ord(ch) < 0x10000:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(f"\\U{ord(ch):08x}")
    out.append('"')
    return "".join(out)


def render_body(namespace: str, name: str, count: int, healthy: bool) -> bytes:
    """kube-proxy's dedented, tab-indented body, with no trailing newline."""
    return (
        "{\n"
        '\t"service": {\n'
        f'\t\t"namespace": {go_quote(namespace)},\n'
        f'\t\t"name": {go_quote(name)}\n'
        "\t},\n"
        f'\t"localEndpoints": {count},\n'
        f'\t"serviceProxyHealthy": {"true" if healthy else "false"}\n'
        "}"
    ).encode()


@dataclass(eq=False)
class _HealthCheck:
    """The live state of one service's health-check server."""

    namespace: str
    name: str
    port: int
    hosts: tuple[str, ...]
    health: ProxyHealth
    count: int = 0
    """Local ready endpoints of the IPv4 family."""
    count6: int = 0
    """Local ready endpoints of the IPv6 family (0 on a node without IPv6)."""
    listener: HttpListener | None = None
    error: str | None = field(default=None)

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"

    def answer(self, request: BaseRequest) -> GoResponse:
        """Every path, every method: the same answer (kube-proxy has no mux here).

        The count and health are those of the family the request arrived
        on (module doc): each family's proxier answers for itself.
        """
        family = arrival_family(request)
        count = self.count6 if family == IPV6 else self.count
        healthy = self.health.healthy(family)
        return go_response(
            200 if count > 0 and healthy else 503,
            [
                ("Content-Type", "application/json"),
                ("X-Content-Type-Options", "nosniff"),
                ("X-Load-Balancing-Endpoint-Weight", str(count)),
            ],
            render_body(self.namespace, self.name, count, healthy),
        )

    def close(self) -> None:
        if self.listener is not None:
            self.listener.close()
            self.listener = None


class ServiceHealthServer:
    """All healthCheckNodePort listeners of one node, kept to the proxier's last sync.

    The syncs are synchronous, as the proxier's sync is: binding and closing
    happen before ``sync_services`` returns, so the port set always matches
    the last sync. Before ``start`` nothing is bound (a successor's health
    ports wait until the kpx node it takes over from has closed its own);
    ``start`` binds what the syncs asked for so far. A port that cannot be
    bound is logged with its service and retried on the next sync and every
    ``retry_interval`` seconds meanwhile; the other services are unaffected.
    """

    def __init__(
        self,
        health: ProxyHealth,
        *,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        header_timeout: float = DEFAULT_HEADER_TIMEOUT,
        retry_interval: float = 5.0,
    ) -> None:
        self.health = health
        self.max_connections = max_connections
        self.header_timeout = header_timeout
        self.retry_interval = retry_interval
        self._checks: dict[str, _HealthCheck] = {}
        self._ports: dict[str, int] = {}
        self._hosts: tuple[str, ...] = (ALL_ADDRESSES,)
        self._counts: Mapping[str, int] = {}
        self._counts6: Mapping[str, int] = {}
        self._retry: asyncio.TimerHandle | None = None
        self._closing: list[HttpListener] = []
        self._started = False
        self._stopped = False

    # -- what tests and the sidecar can ask ---------------------------------

    def serving(self) -> dict[str, list[tuple[str, int]]]:
        """``ns/name`` -> bound addresses, for every service currently listening."""
        return {
            key: list(c.listener.addresses)
            for key, c in self._checks.items()
            if c.listener is not None
        }

    def failed(self) -> dict[str, str]:
        """``ns/name`` -> last bind error, for services waiting for a retry."""
        return {key: c.error for key, c in self._checks.items() if c.error is not None}

    def local_endpoints(self, key: str, family: str = IPV4) -> int | None:
        """The count ``key``'s check answers ``family`` with, or ``None`` without a check."""
        check = self._checks.get(key)
        if check is None:
            return None
        return check.count6 if family_name(family) == IPV6 else check.count

    # -- the two syncs -------------------------------------------------------

    def sync_services(self, ports: Mapping[str, int], hosts: Sequence[str]) -> None:
        """Serve health checks for exactly ``ports`` (``ns/name`` -> port) on ``hosts``.

        kube-proxy's ``SyncServices``. ``hosts`` are the addresses
        ``--nodeport-addresses`` selects, of both families: ``0.0.0.0`` for
        every IPv4 address, ``::`` for every IPv6 one, or specific addresses.
        Each service's one server listens on all of them. Never raises.
        """
        if self._stopped:
            return
        self._ports = dict(ports)
        self._hosts = tuple(hosts)
        if not self._started:
            return
        try:
            self._reconcile()
        except Exception:
            log.exception("healthcheck sync of %d services failed", len(self._ports))

    def sync_endpoints(
        self, local_ready: Mapping[str, int], local_ready6: Mapping[str, int] | None = None
    ) -> None:
        """Set each service's local ready endpoint counts (``ns/name`` -> count), per family.

        kube-proxy's ``SyncEndpoints``: counts of services without a health
        check are kept for when one is asked for, and a service missing here
        counts 0. ``local_ready`` answers requests that arrive over IPv4,
        ``local_ready6`` those over IPv6; ``None`` (a node without IPv6)
        answers them 0, since this node forwards no IPv6 traffic.
        """
        self._counts = local_ready
        self._counts6 = local_ready6 if local_ready6 is not None else {}
        for key, check in self._checks.items():
            check.count = local_ready.get(key, 0)
            check.count6 = self._counts6.get(key, 0)

    def start(self) -> None:
        """Begin serving: bind what the syncs so far asked for. Call on the loop."""
        if self._started or self._stopped:
            return
        self._started = True
        self._reconcile()

    # -- reconciliation ------------------------------------------------------

    def _reconcile(self) -> None:
        wanted, hosts = self._ports, self._hosts
        # Close first, so a port handed from one service to another in the
        # same sync is free by the time the new owner binds it.
        for key, check in list(self._checks.items()):
            port = wanted.get(key)
            if port != check.port or hosts != check.hosts:
                if check.listener is not None:
                    log.info("service %s: closing health check on port %d", key, check.port)
                    self._closing.append(check.listener)
                check.close()
                del self._checks[key]

        for key, port in wanted.items():
            check = self._checks.get(key)
            if check is None:
                namespace, _, name = key.partition("/")
                check = _HealthCheck(
                    namespace=namespace,
                    name=name,
                    port=port,
                    hosts=hosts,
                    health=self.health,
                    count=self._counts.get(key, 0),
                    count6=self._counts6.get(key, 0),
                )
                self._checks[key] = check
            if check.listener is not None and check.listener.closed:
                # It gave up on its own (serving failed to start): start over.
                check.listener = None
            if check.listener is None:
                self._open(check)

        self._closing = [lst for lst in self._closing if not lst.settled]
        failed = sum(1 for c in self._checks.values() if c.listener is None)
        HEALTHCHECK_LISTENERS.labels(state="serving").set(len(self._checks) - failed)
        HEALTHCHECK_LISTENERS.labels(state="bind_failed").set(failed)
        if failed:
            self._schedule_retry()

    def _open(self, check: _HealthCheck) -> None:
        if not check.hosts:
            self._failed(check, "no node address matches --nodeport-addresses")
            return
        listener = HttpListener(
            f"healthcheck {check.key}",
            check.answer,
            max_connections=self.max_connections,
            header_timeout=self.header_timeout,
        )
        try:
            # V6ONLY: an IPv6 wildcard must not also claim the IPv4 port
            # that 0.0.0.0 takes in the same call (kubernetes#114702).
            listener.open([(host, check.port) for host in check.hosts], v6only=True)
        except OSError as exc:
            self._failed(check, f"{exc.strerror or exc} (errno {exc.errno})")
            return
        except Exception as exc:  # e.g. a port out of range: this service only
            self._failed(check, f"{type(exc).__name__}: {exc}")
            return
        if check.error is not None:
            log.info("service %s: health check port %d is free again", check.key, check.port)
        check.listener = listener
        check.error = None
        log.info(
            "service %s: serving health checks on %s",
            check.key,
            ", ".join(f"{h}:{p}" for h, p in listener.addresses),
        )

    def _failed(self, check: _HealthCheck, error: str) -> None:
        # Loud once per distinct error, quiet on every retry that fails the same way.
        level = logging.DEBUG if check.error == error else logging.ERROR
        log.log(
            level,
            "service %s: cannot serve health checks on port %d: %s; will retry",
            check.key,
            check.port,
            error,
        )
        check.error = error

    def _schedule_retry(self) -> None:
        if self._retry is not None or self._stopped:
            return
        loop = asyncio.get_running_loop()
        self._retry = loop.call_later(self.retry_interval, self._retry_now)

    def _retry_now(self) -> None:
        self._retry = None
        if not self._stopped:
            self.sync_services(self._ports, self._hosts)

    async def stop(self) -> None:
        """Close every listener and wait until none is left."""
        self._stopped = True
        if self._retry is not None:
            self._retry.cancel()
            self._retry = None
        for check in self._checks.values():
            if check.listener is not None:
                self._closing.append(check.listener)
            check.close()
        self._checks.clear()
        HEALTHCHECK_LISTENERS.labels(state="serving").set(0)
        HEALTHCHECK_LISTENERS.labels(state="bind_failed").set(0)
        await self.wait_settled()

    async def wait_settled(self) -> None:
        """Wait until listeners closed by past syncs have fully let go of their sockets."""
        closing, self._closing = self._closing, []
        for lst in closing:
            await lst.wait_closed()
