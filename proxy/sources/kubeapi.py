"""The Kubernetes API source: list and watch, cache, parse, publish good snapshots.

Owns: talking to the API server as a ``KubeConfig`` says
(``proxy.sources.kubeconfig``: where it is and every credential), one list+watch
per kind kube-proxy watches, an in-memory cache of the raw objects, and
turning that cache into ``Snapshot``s on a ``StateHub`` through
``proxy.k8s.parse_objects``: the very checks a state file goes through.

Never: write to the API server, apply anything itself, publish a state that
failed to parse, or let an API failure end the process. A refused state is
logged problem by problem and the last good state stays in force; a failed
request is retried with backoff and the last good state stays in force.

Theory of operation (client-go's reflector, cut down to what kpx needs):

- What is watched is what kube-proxy's informers watch: v1 Nodes with
  ``fieldSelector=metadata.name=<node>`` (only this node's addresses and
  labels matter), and v1 Services and discovery.k8s.io/v1 EndpointSlices
  with one label selector, ``!service.kubernetes.io/headless,
  !service.kubernetes.io/service-proxy-name``. kube-proxy builds both from one
  informer factory, and ``labels.Selector.String()`` sorts requirements by
  key, hence that exact string for both kinds.
- Each kind is listed (paginated), which yields the whole set and a
  resourceVersion, then watched from that resourceVersion. The list asks
  for resourceVersion ``0`` first (the API server's watch cache: cheap for
  it), the last one seen when a list is retried, and ``""`` (a quorum read)
  after 410 Gone: client-go's ``relistResourceVersion``.
- 410 Gone, as an HTTP status or as an ERROR event, means the server has
  compacted past our resourceVersion: events were lost, and only a re-list
  can tell which objects were deleted meanwhile. A watch that times out or
  drops resumes from the last resourceVersion seen (an event's, or a
  BOOKMARK's), so nothing is lost and nothing is re-listed.
- Failures back off as client-go's reflector does: 0.8 s doubling to 30 s,
  plus up to 100% jitter (so a restarted API server is not hit by every
  node at once), forgotten after 2 minutes without a failure. A watch that
  ends at once without a single event counts as a failure, or a proxy that
  cuts streams would make a hot loop.
- No state is built until all three kinds are listed, as kube-proxy waits
  for its informers to sync: a state with the Services but not yet their
  slices would close every NodePort it has.
- Changes are batched: the first one arms a timer (``min_sync_period``, this
  source's minSyncPeriod), later ones ride along. A sync never starts
  sooner than the last one took, so an event storm on 10,000 services costs
  at most about half a CPU instead of all of it.
- The build (``parse_objects``) runs in a worker thread: at 10,000 services
  it takes about a second, which on the event loop would stall every
  relayed connection. Cached objects are never mutated once cached, so the
  thread reads them without a lock.
- What changed is said, not inferred: each watch event names its object,
  so it goes to a ``ChangeTracker`` (``proxy.core.changes``) as the key of
  the Service it concerns (an EndpointSlice's is its
  ``kubernetes.io/service-name`` label, before and after the event); a list
  says "everything". Each published snapshot carries those keys, less the
  ones whose objects came out equal to the last published ones, so the
  proxier rebuilds exactly the services that changed. A batch that changed
  nothing kpx reads (a Node heartbeat, a Service's status) publishes
  nothing, and a refused state hands its keys back for the next build.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from proxy import metrics
from proxy.core.changes import Changes, ChangeTracker
from proxy.core.model import Snapshot, stamp_changes
from proxy.k8s import (
    HEADLESS_LABEL,
    SERVICE_NAME_LABEL,
    SERVICE_PROXY_NAME_LABEL,
    StateError,
    parse_objects,
)
from proxy.sources.hub import StateHub, prepare_off_loop
from proxy.sources.kubeconfig import CredentialError, KubeConfig, KubeConfigError
from proxy.util.background import OffLoop

log = logging.getLogger(__name__)

PROXY_LABEL_SELECTOR = f"!{HEADLESS_LABEL},!{SERVICE_PROXY_NAME_LABEL}"
"""kube-proxy's informer selector for Services and EndpointSlices, byte for byte."""

MIN_SYNC_PERIOD = 0.02
"""How long the first change of a batch waits for the rest of it."""

PAGE_SIZE = 500
"""client-go's reflector page size: big lists arrive in pieces, not one response."""

WATCH_TIMEOUT_SECONDS = (300, 600)
"""Each watch asks the server to end it after a random 5-10 min (client-go's
range), which spreads the re-watches of many nodes over time."""

WATCH_READ_SLACK = 30.0
"""A watch silent this long past its own timeout is a dead connection."""

REQUEST_TIMEOUT = aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=60)
"""For lists: no total limit (a large list on a slow link is fine), but a
server that stops sending for a minute is given up on."""

MAX_EVENT_BYTES = 16 << 20
"""One watch event may not be larger: etcd stores objects up to 1.5 MiB."""

SHORT_WATCH_SECONDS = 1.0
"""A watch that ends sooner than this without events is treated as a failure."""


class APIError(Exception):
    """The API server answered with a failure (an HTTP status or an ERROR event)."""

    def __init__(self, code: int, reason: str = "", message: str = "") -> None:
        self.code = code
        self.reason = reason
        self.message = message
        super().__init__(f"{code} {reason}: {message}" if reason or message else str(code))

    @property
    def expired(self) -> bool:
        """Our resourceVersion is unusable: only a fresh (quorum) list recovers.

        410 is compaction (or an expired ``continue`` token); 504 "Too large
        resource version" is a lagging API server behind a load balancer
        (client-go's ``isTooLargeResourceVersionError``).
        """
        return self.code == 410 or (
            self.code == 504 and "too large resource version" in self.message.lower()
        )

    @classmethod
    def from_status(cls, status: object, default_code: int) -> APIError:
        """From a ``kind: Status`` object, whatever shape it is in."""
        if type(status) is not dict:
            return cls(default_code, "", "no Status object")
        code = status.get("code")
        reason = status.get("reason")
        message = status.get("message")
        return cls(
            code if type(code) is int else default_code,
            reason if type(reason) is str else "",
            message if type(message) is str else "",
        )


class ListError(Exception):
    """A one-shot list (``KubeAPISource.list_once``) failed: which kind, and why."""

    def __init__(self, plural: str, cause: Exception) -> None:
        self.plural = plural
        self.cause = cause
        super().__init__(f"listing {plural}: {str(cause) or type(cause).__name__}")


class _StreamError(Exception):
    """A response kpx cannot read: undecodable, oversized, or cut short."""


# -- watching ----------------------------------------------------------------------------


class _Backoff:
    """client-go's reflector backoff: doubling to ``cap``, plus up to 100% jitter,
    forgotten after ``reset_after`` seconds without a failure. Never more than 2 x cap."""

    def __init__(
        self,
        initial: float,
        cap: float,
        reset_after: float = 120.0,
        rng: Callable[[], float] = random.random,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.initial = initial
        self.cap = cap
        self.reset_after = reset_after
        self._rng = rng
        self._clock = clock
        self._attempt = 0
        self._last: float | None = None

    def next(self) -> float:
        now = self._clock()
        if self._last is not None and now - self._last > self.reset_after:
            self._attempt = 0
        self._last = now
        base = min(self.cap, self.initial * 2**self._attempt)
        if base < self.cap:
            self._attempt += 1
        return base * (1.0 + self._rng())


@dataclass(eq=False)
class _Kind:
    """One reflector's worth of state: what to ask for and what came back."""

    kind: str
    api_version: str
    path: str
    namespaced: bool
    selectors: dict[str, str]
    objects: dict[str, dict[str, Any]] = field(default_factory=dict)
    """``ns/name`` (or ``name``) -> the object as decoded; replaced, never mutated."""
    resource_version: str = ""
    """The newest resourceVersion seen: where the next watch starts."""
    list_from: str | None = "0"
    """None while list+watch is current; else the resourceVersion the next list asks for."""
    synced: bool = False
    """Listed at least once."""
    expiries: int = 0
    """Watches expired since the last that lasted (``SHORT_WATCH_SECONDS``): the first
    re-lists at once, the rest back off. An event does not reset it: a server that sends
    one and then 410 Gone, every time, would be re-listed in a hot loop."""

    @property
    def plural(self) -> str:
        return self.path.rsplit("/", 1)[1]


async def _lines(stream: aiohttp.StreamReader, limit: int) -> AsyncIterator[bytes]:
    """The newline-separated events of a watch stream, however long each one is.

    aiohttp's own ``readline`` refuses lines over 128 KiB, and one
    EndpointSlice with a thousand endpoints is bigger than that.
    """
    pending = bytearray()
    async for chunk in stream.iter_any():
        start = 0
        while (end := chunk.find(b"\n", start)) >= 0:
            if pending:
                pending += chunk[start:end]
                yield bytes(pending)
                pending.clear()
            else:
                yield chunk[start:end]
            start = end + 1
        pending += chunk[start:]
        if len(pending) > limit:
            raise _StreamError(f"a watch event is larger than {limit} bytes")
    if pending.strip():
        yield bytes(pending)


class KubeAPISource:
    """Feeds a ``StateHub`` from the Kubernetes API, live.

    ``run`` until ``stop``; ``reload`` re-lists everything (SIGHUP);
    ``wait_synced`` lets a caller hold back until the first state is in.
    """

    def __init__(
        self,
        config: KubeConfig,
        hub: StateHub,
        node_name: str,
        *,
        min_sync_period: float = MIN_SYNC_PERIOD,
        backoff_initial: float = 0.8,
        backoff_max: float = 30.0,
        watch_timeout: tuple[int, int] = WATCH_TIMEOUT_SECONDS,
        page_size: int = PAGE_SIZE,
    ) -> None:
        self.config = config
        self.hub = hub
        self.node_name = node_name
        self.min_sync_period = min_sync_period
        self.backoff_initial = backoff_initial
        self.backoff_max = backoff_max
        self.watch_timeout = watch_timeout
        self.page_size = page_size
        self.generation = 0
        self._ssl = config.ssl_context()  # Fails here, at startup, not in a retry loop.
        self._kinds = (
            _Kind(
                "Node",
                "v1",
                "/api/v1/nodes",
                False,
                {"fieldSelector": f"metadata.name={node_name}"},
            ),
            _Kind(
                "Service", "v1", "/api/v1/services", True, {"labelSelector": PROXY_LABEL_SELECTOR}
            ),
            _Kind(
                "EndpointSlice",
                "discovery.k8s.io/v1",
                "/apis/discovery.k8s.io/v1/endpointslices",
                True,
                {"labelSelector": PROXY_LABEL_SELECTOR},
            ),
        )
        self._session: aiohttp.ClientSession | None = None
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._stopped = asyncio.Event()
        self._first = asyncio.Event()
        self._timer: asyncio.TimerHandle | None = None
        self._build: asyncio.Task[None] | None = None
        self._dirty = False
        self._force = False
        self._last_build_seconds = 0.0
        self._off_loop = OffLoop("kube-api")
        self._published: Snapshot | None = None
        self._tracker = ChangeTracker()
        self._refused: tuple[str, ...] | None = None
        """The problems of the last refused state, so that each set is logged once."""

    # -- lifecycle ------------------------------------------------------------------------

    def _client(self, user_agent: str) -> aiohttp.ClientSession:
        """The session every request of this source goes through (TLS set per request)."""
        connector = aiohttp.TCPConnector(ssl=self._ssl if self._ssl is not None else True)
        headers = {"Accept": "application/json", "User-Agent": user_agent}
        return aiohttp.ClientSession(connector=connector, headers=headers)

    async def list_once(self, *, all_nodes: bool = False, user_agent: str = "kpx"
                        ) -> dict[str, list[dict[str, Any]]]:
        """One quorum list of each kind, paginated, no watch and no state: ``kpx snapshot``.

        The same requests, credentials and per-object preparation as ``run``,
        so what comes back is what kpx would see. ``all_nodes`` lists every
        Node, not this node's only. Returns plural -> objects in key order;
        raises ``ListError`` naming the kind that failed.
        """
        if all_nodes:
            self._kinds[0].selectors = {}
        out: dict[str, list[dict[str, Any]]] = {}
        async with self._client(user_agent) as session:
            self._session = session
            try:
                for kind in self._kinds:
                    kind.list_from = ""  # a quorum read: the cluster now, not a watch cache
                    try:
                        await self._list(kind)
                    except (APIError, CredentialError, aiohttp.ClientError, TimeoutError,
                            _StreamError) as e:
                        raise ListError(kind.plural, e) from e
                    out[kind.plural] = [obj for _, obj in sorted(kind.objects.items())]
            finally:
                self._session = None
        return out

    async def run(self) -> None:
        """List and watch until ``stop``; API failures are retried, never raised."""
        log.info("Kubernetes API source: %s, node %s", self.config.describe(), self.node_name)
        async with self._client(f"kpx (node {self.node_name})") as session:
            self._session = session
            for kind in self._kinds:
                self._start(kind)
            try:
                await self._stopped.wait()
            finally:
                self._session = None
                if self._timer is not None:
                    self._timer.cancel()
                    self._timer = None
                pending = [*self._tasks.values(), *([self._build] if self._build else [])]
                for task in pending:
                    task.cancel()
                await asyncio.gather(*pending, return_exceptions=True)
                self._tasks.clear()
                self._off_loop.close()

    def stop(self) -> None:
        self._stopped.set()

    def reload(self) -> None:
        """SIGHUP: re-list every kind from scratch and publish even if nothing changed."""
        log.info("re-listing nodes, services and endpoint slices on request")
        self._force = True
        if self._session is None:
            return
        for kind in self._kinds:
            kind.list_from = ""
            self._tasks[kind.kind].cancel()
            self._start(kind)

    async def wait_synced(self, timeout: float | None = None) -> bool:
        """Wait for the first good state to be published; False after ``timeout``."""
        try:
            async with asyncio.timeout(timeout):
                await self._first.wait()
        except TimeoutError:
            unlisted = [k.plural for k in self._kinds if not k.synced]
            log.warning(
                "no state from %s after %.0fs (%s); starting anyway",
                self.config.server,
                timeout,
                f"not listed yet: {', '.join(unlisted)}" if unlisted else "the state was refused",
            )
            return False
        return True

    def _start(self, kind: _Kind) -> None:
        self._tasks[kind.kind] = asyncio.create_task(
            self._reflect(kind), name=f"kubeapi-{kind.plural}"
        )

    # -- one reflector per kind -----------------------------------------------------------

    def _serving(self, kind: _Kind, task: asyncio.Task[None] | None) -> bool:
        """Whether ``task`` is still ``kind``'s reflector: not once ``run`` has let its
        session go (``stop``), nor once ``reload`` has started another in its place.

        Asked every turn rather than trusting cancellation alone: a library that
        swallows a cancel (Python 3.11's ``asyncio.wait_for`` does, when what it
        waits for finishes in the loop turn the cancel comes in) would otherwise
        leave a reflector that lists with no session, in a tight loop, and a
        ``stop`` that never returns.
        """
        return self._session is not None and self._tasks.get(kind.kind) is task

    async def _reflect(self, kind: _Kind) -> None:
        """List when needed, watch, and start over after anything short of ``stop``."""
        backoff = _Backoff(self.backoff_initial, self.backoff_max)
        me = asyncio.current_task()
        while self._serving(kind, me):
            listing = kind.list_from is not None
            try:
                if listing:
                    await self._list(kind)
                    listing = False
                await self._watch(kind)
                continue
            except APIError as err:
                if err.expired:
                    kind.list_from = ""
                    if not listing:
                        log.info(
                            "watch of %s expired at resourceVersion %s (%s); re-listing",
                            kind.plural,
                            kind.resource_version,
                            err,
                        )
                        kind.expiries += 1
                        if kind.expiries == 1:
                            continue  # At once the first time; a server that insists waits.
                if err.code == 401:
                    self.config.forget_token()
                delay = backoff.next()
                # 401/403 need a person (RBAC, a revoked token); the rest usually heal.
                level = logging.ERROR if err.code in (401, 403) else logging.WARNING
                log.log(
                    level,
                    "%s of %s failed: %s; retrying in %.1fs",
                    "list" if listing else "watch",
                    kind.plural,
                    err,
                    delay,
                )
            except CredentialError as err:
                delay = backoff.next()
                log.error(
                    "%s of %s: no credentials: %s; retrying in %.1fs",
                    "list" if listing else "watch",
                    kind.plural,
                    err,
                    delay,
                )
            except (aiohttp.ClientError, TimeoutError, _StreamError) as err:
                delay = backoff.next()
                log.warning(
                    "%s of %s failed: %s; retrying in %.1fs from resourceVersion %s",
                    "list" if listing else "watch",
                    kind.plural,
                    f"{type(err).__name__}: {err}" if str(err) else type(err).__name__,
                    delay,
                    kind.list_from if listing else kind.resource_version,
                )
            except Exception:
                delay = backoff.next()
                log.exception(
                    "unexpected error in the %s of %s; retrying in %.1fs",
                    "list" if listing else "watch",
                    kind.plural,
                    delay,
                )
            await asyncio.sleep(delay)

    async def _list(self, kind: _Kind) -> None:
        """A full, paginated list; replaces the cache of this kind only once complete."""
        assert kind.list_from is not None
        objects: dict[str, dict[str, Any]] = {}
        token: str | None = None
        tokens: set[str] = set()
        pages = skipped = 0
        while True:
            params = {**kind.selectors, "limit": str(self.page_size)}
            if token:
                params["continue"] = token  # The token pins the resourceVersion.
            elif kind.list_from:
                params["resourceVersion"] = kind.list_from
            body = await self._get_json(kind.path, params)
            items = body.get("items") or []
            if type(items) is not list:
                raise _StreamError(f"{kind.plural} list: items is not a list")
            for raw in items:
                entry = self._prepare(kind, raw)
                if entry is None:
                    skipped += 1
                else:
                    objects[entry[0]] = entry[1]
            meta = body.get("metadata")
            meta = meta if type(meta) is dict else {}
            pages += 1
            token = meta.get("continue") or None
            if token is None:
                break
            # A token that comes back (a broken server or aggregator) would page for
            # ever, as fast as the server answers: this list failed, and is retried
            # after the backoff like any other failure.
            if type(token) is not str or token in tokens:
                raise _StreamError(
                    f"{kind.plural} list: page {pages} gave the continue token {token!r}"
                    f"{' again' if type(token) is str else ', which is not a string'}"
                )
            tokens.add(token)
        version = meta.get("resourceVersion")
        if type(version) is not str or not version:
            raise _StreamError(f"{kind.plural} list has no metadata.resourceVersion")
        kind.objects = objects
        self._tracker.everything()  # A list replaces what was known of this kind.
        kind.resource_version = version
        kind.list_from = None
        log.info(
            "listed %d %s at resourceVersion %s%s%s",
            len(objects),
            kind.plural,
            version,
            f" ({pages} pages)" if pages > 1 else "",
            f"; {skipped} without metadata.name ignored" if skipped else "",
        )
        if kind.kind == "Node" and not objects:
            log.warning(
                "node %r does not exist in the API; its addresses stay unknown until it does "
                "(is --hostname-override right?)",
                self.node_name,
            )
        kind.synced = True
        self._changed()

    async def _watch(self, kind: _Kind) -> None:
        """Follow one watch until the server ends it; raises on anything abnormal."""
        assert self._session is not None
        seconds = random.randint(*self.watch_timeout)
        params = {
            **kind.selectors,
            "watch": "1",
            "resourceVersion": kind.resource_version,
            "allowWatchBookmarks": "true",
            "timeoutSeconds": str(seconds),
        }
        timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=10, sock_read=seconds + WATCH_READ_SLACK
        )
        log.debug("watching %s from resourceVersion %s", kind.plural, kind.resource_version)
        started = time.monotonic()
        events = 0
        from_version = kind.resource_version
        async with self._session.get(
            self._url(kind.path),
            params=params,
            timeout=timeout,
            **await self._options(),
        ) as resp:
            await self._check(resp)
            async for line in _lines(resp.content, MAX_EVENT_BYTES):
                if not line.strip():
                    continue
                try:
                    event = json.loads(line)
                except ValueError as e:
                    raise _StreamError(f"undecodable watch event: {e}") from e
                events += 1
                if time.monotonic() - started >= SHORT_WATCH_SECONDS:
                    kind.expiries = 0  # A watch that lasted: its expiry re-lists at once.
                self._apply(kind, event)
        elapsed = time.monotonic() - started
        # Progress is a resourceVersion that moved, not a line: an event that is ignored
        # (an unknown type, no name) or a BOOKMARK at the same version moves nothing, and a
        # server or proxy that ends every watch after one would be watched in a hot loop.
        if elapsed < SHORT_WATCH_SECONDS and kind.resource_version == from_version:
            raise _StreamError(f"the watch closed at once after {events} events, none of"
                               " them progress")
        log.debug(
            "watch of %s ended after %.0fs and %d events; resuming at resourceVersion %s",
            kind.plural,
            elapsed,
            events,
            kind.resource_version,
        )

    def _apply(self, kind: _Kind, event: object) -> None:
        """One watch event into the cache (or an APIError out of an ERROR event)."""
        if type(event) is not dict:
            raise _StreamError(f"a watch event of {kind.plural} is not a JSON object")
        what = event.get("type")
        obj = event.get("object")
        if what == "ERROR":
            raise APIError.from_status(obj, 500)
        meta = obj.get("metadata") if type(obj) is dict else None
        version = meta.get("resourceVersion") if type(meta) is dict else None
        if what in ("ADDED", "MODIFIED", "DELETED"):
            entry = self._prepare(kind, obj)
            if entry is None:
                log.warning("%s %s event without metadata.name ignored", kind.kind, what)
            else:
                key, value = entry
                if what == "DELETED":
                    old = kind.objects.pop(key, None)
                else:
                    old = kind.objects.get(key)
                    kind.objects[key] = value
                self._record(kind, key, old, value)
                log.debug("%s %s %s", what, kind.kind, key)
                self._changed()
        elif what != "BOOKMARK":
            log.warning("unknown watch event type %r for %s ignored", what, kind.plural)
            return
        if type(version) is str and version:
            kind.resource_version = version

    def _record(
        self, kind: _Kind, key: str, old: dict[str, Any] | None, new: dict[str, Any]
    ) -> None:
        """Tell the change tracker which service (or node) an event concerns."""
        if kind.kind == "Node":
            self._tracker.node()
        elif kind.kind == "Service":
            self._tracker.service(key)
            metrics.SERVICE_CHANGES_TOTAL.inc()
            metrics.SERVICE_CHANGES_PENDING.inc()
        else:
            metrics.ENDPOINT_CHANGES_TOTAL.inc()
            metrics.ENDPOINT_CHANGES_PENDING.inc()
            namespace = key.partition("/")[0]
            for obj in (old, new):
                service = _service_name(obj)
                if service is not None:
                    self._tracker.slices_of(f"{namespace}/{service}")

    @staticmethod
    def _prepare(kind: _Kind, raw: object) -> tuple[str, dict[str, Any]] | None:
        """Key an object and make it a document ``parse_objects`` accepts.

        List items carry no ``kind``/``apiVersion``; the path they came from
        says what they are. ``managedFields`` is dropped as kube-proxy's
        informers drop it: it is often half of an object, and kpx never
        reads it.
        """
        if type(raw) is not dict:
            return None
        meta = raw.get("metadata")
        if type(meta) is not dict:
            return None
        name = meta.get("name")
        if type(name) is not str or not name:
            return None
        meta.pop("managedFields", None)
        raw["kind"] = kind.kind
        raw["apiVersion"] = kind.api_version
        if kind.namespaced:
            namespace = meta.get("namespace")
            return f"{namespace if type(namespace) is str else ''}/{name}", raw
        return name, raw

    # -- HTTP -----------------------------------------------------------------------------

    def _url(self, path: str) -> str:
        return self.config.server + path

    async def _options(self) -> dict[str, Any]:
        """What every request carries: credentials (an exec plugin run first if
        due), the TLS context, ``tls-server-name`` and ``proxy-url``."""
        if await self.config.refresh() and self._ssl is not None:
            plugin = self.config.exec_plugin
            if plugin is not None and plugin.credential and plugin.credential.cert:
                try:  # the plugin gave a new client certificate
                    self._ssl = self.config.ssl_context()
                except KubeConfigError as e:
                    raise CredentialError(str(e)) from e
        auth = self.config.authorization()
        options: dict[str, Any] = {"headers": {"Authorization": auth} if auth else {}}
        if self._ssl is not None:
            options["ssl"] = self._ssl
            if self.config.tls_server_name:
                options["server_hostname"] = self.config.tls_server_name
        if self.config.proxy_url:
            options["proxy"] = self.config.proxy_url
        return options

    async def _get_json(self, path: str, params: dict[str, str]) -> dict[str, Any]:
        assert self._session is not None
        async with self._session.get(
            self._url(path),
            params=params,
            timeout=REQUEST_TIMEOUT,
            **await self._options(),
        ) as resp:
            await self._check(resp)
            body = await resp.read()
        try:
            data = json.loads(body)
        except ValueError as e:
            raise _StreamError(f"undecodable response from {path}: {e}") from e
        if type(data) is not dict:
            raise _StreamError(f"the response from {path} is not a JSON object")
        return data

    @staticmethod
    async def _check(resp: aiohttp.ClientResponse) -> None:
        """Anything but 200 becomes an APIError carrying the server's own Status."""
        if resp.status == 200:
            return
        body = await resp.read()
        try:
            status = json.loads(body)
        except ValueError:
            text = body[:200].decode("utf-8", "replace").strip()
            raise APIError(resp.status, resp.reason or "", text) from None
        raise APIError.from_status(status, resp.status)

    # -- cache -> snapshot ----------------------------------------------------------------

    def _changed(self) -> None:
        """Something in the cache changed: make sure a sync is on its way."""
        self._dirty = True
        if self._timer is not None or self._build is not None or self._stopped.is_set():
            return
        if not all(kind.synced for kind in self._kinds):
            return
        delay = max(self.min_sync_period, self._last_build_seconds)
        self._timer = asyncio.get_running_loop().call_later(delay, self._start_sync)

    def _start_sync(self) -> None:
        self._timer = None
        self._build = asyncio.create_task(self._sync(), name="kubeapi-sync")

    async def _sync(self) -> None:
        """Parse the whole cache and publish it if good and different.

        The build, and the readers' plans for what will be published, run in
        a niced worker thread with the loop first for the GIL, as the state
        file's parse does (``prepare_off_loop``, ``proxy.util.background``):
        a cluster of 50,000 services takes seconds to build, and the loop
        forwards meanwhile.
        """
        self._dirty = False
        documents = [obj for kind in self._kinds for obj in kind.objects.values()]
        changes = self._tracker.take(since=self.generation if self._published else None)
        started = time.perf_counter()
        try:
            snapshot, changed = await self._off_loop.call(
                self._build_off_loop, documents, changes, self._force
            )
        except StateError as err:
            self._tracker.merge(changes)
            self._refuse(err)
        except Exception:
            self._tracker.merge(changes)
            log.exception("building a state from the API failed; the last good state stays")
        else:
            self._publish(snapshot, changed)
        finally:
            self._last_build_seconds = time.perf_counter() - started
            self._build = None
            if self._dirty:
                self._changed()

    def _build_off_loop(self, documents: list[object], changes: Changes,
                        force: bool) -> tuple[Snapshot, bool]:
        """``_build``, then, for a snapshot that will be published, its slow half
        (in the worker thread; reads only what ``_sync`` does not change meanwhile)."""
        snapshot, changed = _build(documents, self.generation + 1, self._published, changes)
        if changed or force:
            prepare_off_loop(self.hub, snapshot, len(documents))
        return snapshot, changed

    def _refuse(self, err: StateError) -> None:
        problems = tuple(err.problems)
        if problems == self._refused:
            log.debug("the API state is still refused (%d problems)", len(problems))
            return
        self._refused = problems
        metrics.STATE_RELOAD_ERRORS.inc()
        log.error(
            "state from %s refused (%d problem%s); the last good state stays in force:\n  %s",
            self.config.server,
            len(problems),
            "" if len(problems) == 1 else "s",
            "\n  ".join(problems),
        )

    def _publish(self, snapshot: Snapshot, changed: bool) -> None:
        if self._stopped.is_set():
            return
        if self._refused is not None:
            log.info("the state from %s is good again", self.config.server)
            self._refused = None
        if not changed and not self._force:
            log.debug("API changes leave the state as it was; nothing to publish")
            return
        self._force = False
        self.generation = snapshot.generation
        self._published = snapshot
        log.info(
            "API state: generation %d (%d nodes, %d services, %d endpoint slices)",
            snapshot.generation,
            len(snapshot.nodes),
            len(snapshot.services),
            len(snapshot.slices),
        )
        self.hub.publish(snapshot)
        metrics.SERVICE_CHANGES_PENDING.set(0)
        metrics.ENDPOINT_CHANGES_PENDING.set(0)
        self._first.set()


def _service_name(obj: dict[str, Any] | None) -> str | None:
    """An EndpointSlice's ``kubernetes.io/service-name`` label, if it has one."""
    meta = obj.get("metadata") if obj is not None else None
    labels = meta.get("labels") if type(meta) is dict else None
    name = labels.get(SERVICE_NAME_LABEL) if type(labels) is dict else None
    return name if type(name) is str else None


def _build(
    documents: Iterable[object], generation: int, last: Snapshot | None, changes: Changes
) -> tuple[Snapshot, bool]:
    """``parse_objects``, with ``changes`` narrowed to what really differs; True if anything does.

    A key the tracker named whose Service and slices came out equal to the
    last published ones (a status update, a label kpx does not read) is
    dropped from the changes. Runs in a worker thread: it touches nothing
    but its arguments, and a Snapshot is immutable.
    """
    snapshot = parse_objects(documents, generation)
    if last is None:
        return snapshot, True
    if changes.services is None:  # the snapshot says "everything" already
        return snapshot, (
            snapshot.nodes != last.nodes
            or snapshot.services != last.services
            or snapshot.slices != last.slices
        )
    keys = frozenset(
        key for key in changes.services
        if snapshot.service(key) != last.service(key)
        or snapshot.slices_of(key) != last.slices_of(key)
    )
    nodes = changes.nodes and snapshot.nodes != last.nodes
    stamp_changes(snapshot, Changes(since=changes.since, services=keys, nodes=nodes))
    return snapshot, nodes or bool(keys)
