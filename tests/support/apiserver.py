"""A fake Kubernetes API server for the API source's tests, on 127.0.0.1 only.

Owns: just enough of the API server's list and watch protocol for Nodes,
Services and EndpointSlices to drive ``proxy.sources.kubeapi`` through every path
it has: paginated lists, streaming watches (one JSON event per line),
resourceVersions, label and field selectors, compaction (410 Gone, as an
ERROR event or as an HTTP status), BOOKMARKs, ERROR events, injected HTTP
failures and dropped connections, and a record of every request.

Never: listen anywhere but loopback on an ephemeral port, or keep a
connection open after ``close``.

The test controls the world with ``put``/``delete``/``bookmark``/
``error_event``/``compact``/``end_watches``/``drop_watches``/``fail``;
every change gets the next resourceVersion, as in etcd, and is replayed to
watches that start from an older one.
"""

from __future__ import annotations

import asyncio
import json
import ssl
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

PATHS = {
    "/api/v1/nodes": ("Node", "v1", False),
    "/api/v1/services": ("Service", "v1", True),
    "/apis/discovery.k8s.io/v1/endpointslices": ("EndpointSlice", "discovery.k8s.io/v1", True),
}
KINDS = {kind: path for path, (kind, _, _) in PATHS.items()}

_END = object()
"""Queued to a watch: finish the response cleanly (a server-side timeout)."""
_DROP = object()
"""Queued to a watch: cut the connection mid-stream."""


@dataclass
class Request:
    kind: str
    watch: bool
    query: dict[str, str]
    headers: dict[str, str]
    peer: str | None = None
    """The client certificate's common name, over TLS."""


@dataclass(eq=False)
class _Watcher:
    kind: str
    query: dict[str, str]
    queue: asyncio.Queue[object] = field(default_factory=asyncio.Queue)


def status(code: int, reason: str, message: str) -> dict[str, Any]:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }


def _key(obj: dict[str, Any]) -> str:
    meta = obj["metadata"]
    return f"{meta.get('namespace', '')}/{meta['name']}"


def matches(obj: dict[str, Any], query: dict[str, str]) -> bool:
    """The subset of label and field selectors kube-proxy's informers send."""
    meta = obj.get("metadata") or {}
    labels = meta.get("labels") or {}
    for term in filter(None, query.get("labelSelector", "").split(",")):
        if term.startswith("!"):
            if term[1:] in labels:
                return False
        elif "!=" in term:
            key, value = term.split("!=", 1)
            if labels.get(key) == value:
                return False
        elif "=" in term:
            key, value = term.split("=", 1)
            if labels.get(key) != value.lstrip("="):
                return False
        elif term not in labels:
            return False
    for term in filter(None, query.get("fieldSelector", "").split(",")):
        key, value = term.split("=", 1)
        if key != "metadata.name" or meta.get("name") != value:
            return False
    return True


class FakeAPIServer:
    def __init__(self, ssl_context: ssl.SSLContext | None = None, token: str | None = None):
        self.ssl_context = ssl_context
        self.token = token
        """When set, requests without ``Authorization: Bearer <token>`` get 401."""
        self.check_token: Callable[[str | None], bool] | None = None
        """When set, it judges each request's bearer token (None: no header); False is a 401."""
        self.unauthorized: list[str | None] = []
        """The tokens answered 401, in order."""
        self.rv = 100
        self.objects: dict[str, dict[str, dict[str, Any]]] = {kind: {} for kind in KINDS}
        self.history: dict[str, list[tuple[int, dict[str, Any]]]] = {k: [] for k in KINDS}
        self.compacted: dict[str, int] = dict.fromkeys(KINDS, 0)
        self.gone_as_http = False
        """410 Gone as an HTTP status instead of an ERROR event in a 200 stream."""
        self.requests: list[Request] = []
        self.failures: dict[tuple[str, bool], list[int]] = {}
        self.stuck_continue: dict[str, str] = {}
        """Per kind: a continue token every page of a list gives, however far it got."""
        self.canned_watch: dict[str, list[dict[str, Any]]] = {}
        """Per kind: the events every watch answers with, before it ends at once."""
        self._watchers: set[_Watcher] = set()
        self._runner: web.AppRunner | None = None
        self.url = ""

    # -- lifecycle ------------------------------------------------------------------------

    async def start(self) -> str:
        app = web.Application()
        for path in PATHS:
            app.router.add_get(path, self._handle)
        self._runner = web.AppRunner(app, shutdown_timeout=0.5, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0, ssl_context=self.ssl_context)
        await site.start()
        port = self._runner.addresses[0][1]
        self.url = f"{'https' if self.ssl_context else 'http'}://127.0.0.1:{port}"
        return self.url

    async def close(self) -> None:
        for watcher in list(self._watchers):
            watcher.queue.put_nowait(_END)
        if self._runner is not None:
            await self._runner.cleanup()

    # -- the world ------------------------------------------------------------------------

    def put(self, obj: dict[str, Any]) -> int:
        """Create or replace an object (ADDED or MODIFIED); returns its resourceVersion."""
        kind = obj["kind"]
        self.rv += 1
        obj = json.loads(json.dumps(obj))
        obj["metadata"]["resourceVersion"] = str(self.rv)
        key = _key(obj)
        what = "MODIFIED" if key in self.objects[kind] else "ADDED"
        self.objects[kind][key] = obj
        self._event(kind, {"type": what, "object": obj})
        return self.rv

    def delete(self, kind: str, name: str, namespace: str = "") -> int:
        self.rv += 1
        obj = self.objects[kind].pop(f"{namespace}/{name}")
        obj = {**obj, "metadata": {**obj["metadata"], "resourceVersion": str(self.rv)}}
        self._event(kind, {"type": "DELETED", "object": obj})
        return self.rv

    def vanish(self, kind: str, name: str, namespace: str = "") -> None:
        """Delete an object behind every watch's back, as events lost to compaction are."""
        self.rv += 1
        del self.objects[kind][f"{namespace}/{name}"]

    def bookmark(self, kind: str) -> int:
        """A BOOKMARK at the current resourceVersion (other kinds may have moved it)."""
        self.rv += 1
        _, api_version, _ = PATHS[KINDS[kind]]
        obj = {
            "kind": kind,
            "apiVersion": api_version,
            "metadata": {"resourceVersion": str(self.rv)},
        }
        self._broadcast(kind, {"type": "BOOKMARK", "object": obj})
        return self.rv

    def error_event(self, kind: str, code: int, message: str) -> None:
        self._broadcast(kind, {"type": "ERROR", "object": status(code, "Error", message)})

    def compact(self, kind: str) -> None:
        """Forget the history: a watch from an older resourceVersion gets 410 Gone."""
        self.compacted[kind] = self.rv
        self.history[kind].clear()

    def end_watches(self, kind: str) -> None:
        """End every watch of ``kind`` cleanly, as its timeoutSeconds would."""
        for watcher in [w for w in self._watchers if w.kind == kind]:
            watcher.queue.put_nowait(_END)

    def drop_watches(self, kind: str) -> None:
        """Cut every watch of ``kind`` mid-stream."""
        for watcher in [w for w in self._watchers if w.kind == kind]:
            watcher.queue.put_nowait(_DROP)

    def fail(self, kind: str, watch: bool, *codes: int) -> None:
        """Answer the next requests of this kind (list or watch) with these HTTP codes."""
        self.failures.setdefault((kind, watch), []).extend(codes)

    def watching(self, kind: str) -> int:
        return sum(w.kind == kind for w in self._watchers)

    def of(self, kind: str, watch: bool | None = None) -> list[Request]:
        return [r for r in self.requests if r.kind == kind and watch in (None, r.watch)]

    def _event(self, kind: str, event: dict[str, Any]) -> None:
        self.history[kind].append((self.rv, event))
        self._broadcast(kind, event)

    def _broadcast(self, kind: str, event: dict[str, Any]) -> None:
        for watcher in self._watchers:
            if watcher.kind == kind and (
                event["type"] in ("BOOKMARK", "ERROR") or matches(event["object"], watcher.query)
            ):
                watcher.queue.put_nowait(event)

    # -- HTTP -----------------------------------------------------------------------------

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        kind = PATHS[request.path][0]
        query = dict(request.query)
        watch = query.get("watch") in ("1", "true")
        peer = None
        cert = request.transport.get_extra_info("peercert") if request.transport else None
        if cert:
            peer = dict(pair[0] for pair in cert["subject"]).get("commonName")
        self.requests.append(Request(kind, watch, query, dict(request.headers), peer))
        auth = request.headers.get("Authorization")
        bearer = auth.removeprefix("Bearer ") if auth and auth.startswith("Bearer ") else None
        if (self.token and auth != f"Bearer {self.token}") or (
            self.check_token is not None and not self.check_token(bearer)
        ):
            self.unauthorized.append(bearer)
            return web.json_response(status(401, "Unauthorized", "Unauthorized"), status=401)
        pending = self.failures.get((kind, watch))
        if pending:
            code = pending.pop(0)
            return web.json_response(status(code, "Injected", f"injected {code}"), status=code)
        return await (self._watch(request, kind, query) if watch else self._list(kind, query))

    async def _list(self, kind: str, query: dict[str, str]) -> web.Response:
        path = KINDS[kind]
        items = [
            {k: v for k, v in obj.items() if k not in ("kind", "apiVersion")}
            for _, obj in sorted(self.objects[kind].items())
            if matches(obj, query)
        ]
        limit = int(query.get("limit", "0") or 0)
        start = int(query.get("continue", "0") or 0)
        page = items[start : start + limit] if limit else items[start:]
        meta: dict[str, Any] = {"resourceVersion": str(self.rv)}
        if limit and start + limit < len(items):
            meta["continue"] = str(start + limit)
        if kind in self.stuck_continue:
            meta["continue"] = self.stuck_continue[kind]
        _, api_version, _ = PATHS[path]
        body = {"kind": f"{kind}List", "apiVersion": api_version, "metadata": meta, "items": page}
        return web.json_response(body)

    async def _watch(
        self, request: web.Request, kind: str, query: dict[str, str]
    ) -> web.StreamResponse:
        since = int(query.get("resourceVersion") or 0)
        if since < self.compacted[kind]:
            gone = status(410, "Expired", f"too old resource version: {since}")
            if self.gone_as_http:
                return web.json_response(gone, status=410)
            resp = web.StreamResponse(headers={"Content-Type": "application/json"})
            await resp.prepare(request)
            await resp.write(json.dumps({"type": "ERROR", "object": gone}).encode() + b"\n")
            return resp
        if kind in self.canned_watch:
            lines = b"".join(json.dumps(e).encode() + b"\n" for e in self.canned_watch[kind])
            return web.Response(body=lines, content_type="application/json")
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        watcher = _Watcher(kind, query)
        for rv, event in self.history[kind]:
            if rv > since and matches(event["object"], query):
                watcher.queue.put_nowait(event)
        self._watchers.add(watcher)
        try:
            while True:
                event = await watcher.queue.get()
                if event is _END:
                    break
                if event is _DROP:
                    assert request.transport is not None
                    request.transport.abort()
                    break
                await resp.write(json.dumps(event).encode() + b"\n")
        except ConnectionResetError:
            pass
        finally:
            self._watchers.discard(watcher)
        return resp
