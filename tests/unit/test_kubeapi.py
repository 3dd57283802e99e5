"""The Kubernetes API source against a fake API server on 127.0.0.1.

What matters is what a node sees when the API misbehaves: every path of
list+watch (410 Gone, dropped and ended watches, ERROR events, bookmarks,
failing requests) must end in the same state a fresh list would give, and a
state kpx refuses must leave the last good one in force. The fake is in
``tests/support/apiserver.py``; these tests only drive it and watch the hub.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import os
import socket
import ssl
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from lab.common import eventually as lab_eventually
from proxy import metrics
from proxy.core.changes import Changes
from proxy.core.model import Snapshot
from proxy.sources.hub import StateHub
from proxy.sources.kubeapi import (
    PROXY_LABEL_SELECTOR,
    APIError,
    KubeAPISource,
    _Backoff,
)
from proxy.sources.kubeconfig import KubeConfig, KubeConfigError
from proxy.util.background import LOOP_SWITCH_INTERVAL, WORKER_NICE
from tests.support.apiserver import FakeAPIServer, status
from tests.support.objects import endpoint_slice, node, service
from tests.support.pki import make_pki

NODE = "node-a"
NODE_IP = "192.168.0.2"
FAST: dict[str, Any] = {"min_sync_period": 0.005, "backoff_initial": 0.005, "backoff_max": 0.02}


MANAGED = {"managedFields": [{"manager": "kubectl", "operation": "Apply"}]}
"""Metadata kubectl apply leaves on an object; kpx must not cache it."""
eventually = partial(lab_eventually, timeout=2.0, interval=0.005)
"""``await eventually(check)``: ``lab.common.eventually`` with this file's pace."""


def addresses(snapshot: Snapshot, key: str) -> list[str]:
    svc = snapshot.service(key)
    assert svc is not None, key
    return [ep.address for s in snapshot.slices_for(svc) for ep in s.endpoints]


@dataclass
class Running:
    hub: StateHub
    source: KubeAPISource
    task: asyncio.Task[None]
    seen: list[Snapshot]

    @property
    def last(self) -> Snapshot:
        assert self.seen, "nothing published yet"
        return self.seen[-1]

    async def published(self, count: int) -> Snapshot:
        await eventually(lambda: len(self.seen) >= count)
        return self.seen[count - 1]


@pytest.fixture
async def api() -> AsyncIterator[FakeAPIServer]:
    server = FakeAPIServer()
    await server.start()
    server.put(node(NODE, NODE_IP))
    server.put(service("web", 30080, meta=MANAGED))
    server.put(endpoint_slice("web", "10.0.0.1"))
    yield server
    await server.close()


Start = Callable[..., Awaitable[Running]]


@pytest.fixture
async def start(api: FakeAPIServer) -> AsyncIterator[Start]:
    runs: list[Running] = []

    async def go(config: KubeConfig | None = None, **options: Any) -> Running:
        hub = StateHub()
        seen: list[Snapshot] = []
        hub.subscribe(seen.append)
        source = KubeAPISource(config or KubeConfig(api.url), hub, NODE, **{**FAST, **options})
        run = Running(hub, source, asyncio.create_task(source.run()), seen)
        runs.append(run)
        return run

    yield go
    for run in runs:
        run.source.stop()
        await asyncio.wait_for(run.task, 2)


# -- list, watch, publish ----------------------------------------------------------------


async def test_initial_list_publishes_the_state(api: FakeAPIServer, start: Start) -> None:
    api.put(service("headless", 30090, labels={"service.kubernetes.io/headless": ""}))
    api.put(service("other-proxy", 30091,
                    labels={"service.kubernetes.io/service-proxy-name": "x"}))
    api.put(node("node-b", "192.168.0.3"))
    before = metrics.REGISTRY.get_sample_value(
        "kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds", {"ip_family": "IPv4"}
    )
    run = await start()
    assert await run.source.wait_synced(2)
    snap = run.last
    assert snap.generation == 1
    assert [n.name for n in snap.nodes] == [NODE]
    assert snap.nodes[0].internal_ips == ("192.168.0.2",)
    assert [s.key for s in snap.services] == ["default/web"]
    assert snap.services[0].ports[0].node_port == 30080
    assert addresses(snap, "default/web") == ["10.0.0.1"]
    assert run.hub.snapshot is snap
    after = metrics.REGISTRY.get_sample_value(
        "kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds", {"ip_family": "IPv4"}
    )
    assert after is not None and after != before


async def test_requests_carry_kube_proxy_selectors(api: FakeAPIServer, start: Start) -> None:
    api.token = "s3cret"
    run = await start(KubeConfig(api.url, token="s3cret"))
    await run.published(1)
    await eventually(lambda: all(api.of(kind, watch=True) for kind in api.objects))

    (node_list,) = api.of("Node", watch=False)
    assert node_list.query["fieldSelector"] == f"metadata.name={NODE}"
    assert "labelSelector" not in node_list.query
    for kind in ("Service", "EndpointSlice"):
        (listed,) = api.of(kind, watch=False)
        # kube-proxy's one informer factory, with requirements sorted by key.
        assert listed.query["labelSelector"] == PROXY_LABEL_SELECTOR
        assert PROXY_LABEL_SELECTOR == (
            "!service.kubernetes.io/headless,!service.kubernetes.io/service-proxy-name"
        )
        assert "fieldSelector" not in listed.query
    for req in api.requests:
        assert req.headers["Authorization"] == "Bearer s3cret"
        assert req.headers["Accept"] == "application/json"
        if not req.watch:
            assert req.query["resourceVersion"] == "0"  # The watch cache first.
            assert req.query["limit"] == "500"
    for kind in api.objects:
        (watch,) = api.of(kind, watch=True)
        (listed,) = api.of(kind, watch=False)
        assert watch.query["watch"] == "1"
        assert watch.query["allowWatchBookmarks"] == "true"
        assert watch.query["resourceVersion"] == str(api.rv)  # The list's.
        assert 300 <= int(watch.query["timeoutSeconds"]) <= 600
        selector = "fieldSelector" if kind == "Node" else "labelSelector"
        assert watch.query[selector] == listed.query[selector]


async def test_watch_events_publish_new_states(api: FakeAPIServer, start: Start) -> None:
    run = await start()
    await run.published(1)

    api.put(service("api", 30081))
    api.put(endpoint_slice("api", "10.0.1.1", "10.0.1.2"))
    await eventually(lambda: len(run.last.slices) == 2)
    assert addresses(run.last, "default/api") == ["10.0.1.1", "10.0.1.2"]

    api.put(endpoint_slice("web", "10.0.0.1", "10.0.0.9"))  # MODIFIED
    await eventually(lambda: addresses(run.last, "default/web") == ["10.0.0.1", "10.0.0.9"])

    api.delete("Service", "api", "default")
    api.delete("EndpointSlice", "api-abc", "default")
    await eventually(lambda: run.last.service("default/api") is None and len(run.last.slices) == 1)
    generations = [s.generation for s in run.seen]
    assert generations == sorted(set(generations)), "one generation per published state"


async def test_unrelated_changes_publish_nothing(api: FakeAPIServer, start: Start) -> None:
    """A Node heartbeat or a Service's status changes nothing kpx reads: no new state.
    A real change is published with exactly the service it concerns as changed."""
    api.put(service("api", 30081))
    api.put(endpoint_slice("api", "10.0.1.1"))
    run = await start()
    first = await run.published(1)

    beat = node(NODE, NODE_IP)
    beat["status"]["conditions"][0]["lastHeartbeatTime"] = "t1"
    api.put(beat)
    status = service("web", 30080)
    status["status"] = {"loadBalancer": {"ingress": [{"ip": "203.0.113.7"}]}}
    api.put(status)
    api.put(endpoint_slice("api", "10.0.1.1", "10.0.1.2"))  # The one real change.

    second = await run.published(2)
    await asyncio.sleep(0.05)
    assert len(run.seen) == 2
    assert first.changes.services is None, "the first state is all new"
    assert second.changes == Changes(
        since=first.generation, services=frozenset({"default/api"}), nodes=False
    )
    assert second.nodes == first.nodes
    assert second.service("default/web") == first.service("default/web")
    assert addresses(second, "default/api") == ["10.0.1.1", "10.0.1.2"]


async def test_a_refused_state_hands_its_changes_to_the_next_good_one(
    api: FakeAPIServer, start: Start
) -> None:
    """Changes of a state that is never published are not lost: the next one carries them."""
    run = await start()
    first = await run.published(1)
    api.put(endpoint_slice("web", "10.0.0.1", "10.0.0.7"))
    api.put(service("clash", 30080))  # The nodePort of default/web: refused.
    await eventually(lambda: run.source._refused is not None)
    api.delete("Service", "clash", "default")
    second = await run.published(2)
    assert second.changes.since == first.generation
    assert second.changes.services == frozenset({"default/web"})
    assert addresses(second, "default/web") == ["10.0.0.1", "10.0.0.7"]


async def test_managed_fields_are_not_cached(api: FakeAPIServer, start: Start) -> None:
    run = await start()
    await run.published(1)
    cached = run.source._kinds[1].objects["default/web"]
    assert "managedFields" not in cached["metadata"]
    assert (cached["kind"], cached["apiVersion"]) == ("Service", "v1")


# -- resourceVersions, expiry, reconnects ------------------------------------------------


async def test_bookmark_moves_the_resume_point(api: FakeAPIServer, start: Start) -> None:
    run = await start()
    await run.published(1)
    await eventually(lambda: api.watching("Service"))
    api.put(node(NODE, NODE_IP, zone="a"))  # Moves the global resourceVersion on.
    mark = api.bookmark("Service")
    await eventually(lambda: run.source._kinds[1].resource_version == str(mark))

    api.end_watches("Service")  # As its timeoutSeconds would.
    await eventually(lambda: len(api.of("Service", watch=True)) == 2)
    assert api.of("Service", watch=True)[1].query["resourceVersion"] == str(mark)
    assert len(api.of("Service", watch=False)) == 1


@pytest.mark.parametrize("as_http", [False, True], ids=["error-event", "http-status"])
async def test_gone_relists(api: FakeAPIServer, start: Start, as_http: bool) -> None:
    """Events lost to compaction can only be recovered by a list: here, a deletion."""
    api.put(service("api", 30081))
    api.put(endpoint_slice("api", "10.0.1.1"))
    run = await start()
    await run.published(1)
    await eventually(lambda: api.watching("Service"))
    assert run.last.service("default/api") is not None

    api.gone_as_http = as_http
    api.vanish("Service", "api", "default")
    api.compact("Service")
    api.end_watches("Service")

    await eventually(lambda: run.last.service("default/api") is None)
    lists = api.of("Service", watch=False)
    assert len(lists) == 2
    assert "resourceVersion" not in lists[1].query, "after 410, a quorum read"
    assert len(api.of("Node", watch=False)) == 1, "only the expired kind is re-listed"
    await eventually(lambda: len(api.of("Service", watch=True)) == 3)
    assert api.of("Service", watch=True)[2].query["resourceVersion"] == str(api.rv)


async def test_a_server_that_keeps_expiring_is_not_hammered(
    api: FakeAPIServer, start: Start
) -> None:
    """The first expiry re-lists at once; one that follows right after backs off."""
    api.compacted["Service"] = 10**9  # Every watch of services is answered 410.
    run = await start(backoff_initial=0.05, backoff_max=0.05)
    await run.published(1)
    await asyncio.sleep(0.25)
    lists = len(api.of("Service", watch=False))
    assert 2 <= lists <= 8, lists


def change_counts() -> tuple[float, ...]:
    return tuple(metrics.REGISTRY.get_sample_value(f"kubeproxy_sync_proxy_rules_{n}") or 0.0
                 for n in ("service_changes_total", "endpoint_changes_total",
                           "service_changes_pending", "endpoint_changes_pending"))


async def test_the_change_trackers_count_each_event_until_it_is_published(
    api: FakeAPIServer, start: Start
) -> None:
    """kube-proxy's change trackers: one count per Service or EndpointSlice event, pending
    until a sync takes it (here: until the state that holds it is published)."""
    run = await start()
    await run.published(1)
    services, slices, _, _ = change_counts()
    api.put(service("api", 30081))
    api.put(endpoint_slice("api", "10.0.1.1"))
    api.put(endpoint_slice("api", "10.0.1.2"))
    await eventually(lambda: run.last.service("default/api") is not None
                     and addresses(run.last, "default/api") == ["10.0.1.2"])
    assert change_counts() == (services + 1, slices + 2, 0, 0)


NO_PROGRESS = {
    "unknown type": {"type": "SOMETHING", "object": {}},
    "added without a name": {"type": "ADDED", "object": {"metadata": {}}},
    "bookmark at the same version": {"type": "BOOKMARK",
                                     "object": {"metadata": {"resourceVersion": "1"}}},
}
"""Watch events that move no resourceVersion: each is ignored, or changes nothing."""


@pytest.mark.parametrize("event", NO_PROGRESS.values(), ids=NO_PROGRESS.keys())
async def test_a_watch_that_ends_after_events_that_move_nothing_backs_off(
    api: FakeAPIServer, start: Start, event: dict[str, Any]
) -> None:
    """Progress is a resourceVersion that moved, not a line received: a server (or a proxy)
    that ends every watch after such an event is retried after the backoff, not at once."""
    run = await start(backoff_initial=0.05, backoff_max=0.05)
    await run.published(1)
    api.put(node(NODE, NODE_IP, zone="a"))  # the bookmark's "1" is behind every kind's
    api.canned_watch["Service"] = [event]
    api.end_watches("Service")
    before = len(api.of("Service", watch=True))
    await asyncio.sleep(0.3)
    watches = len(api.of("Service", watch=True)) - before
    assert 1 <= watches <= 0.3 / 0.05 + 2, watches


async def test_an_event_then_gone_every_time_backs_off(
    api: FakeAPIServer, start: Start
) -> None:
    """An event before each 410 Gone is no reason to re-list at once again: only a watch
    that lasted resets the count of expiries."""
    run = await start(backoff_initial=0.05, backoff_max=0.05)
    await run.published(1)
    gone = {"type": "ERROR", "object": status(410, "Expired", "too old resource version")}
    api.canned_watch["Service"] = [NO_PROGRESS["bookmark at the same version"], gone]
    api.end_watches("Service")
    before = len(api.of("Service", watch=False))
    await asyncio.sleep(0.3)
    lists = len(api.of("Service", watch=False)) - before
    assert 1 <= lists <= 0.3 / 0.05 + 2, lists


async def test_dropped_watch_resumes_without_relisting(
    api: FakeAPIServer, start: Start, caplog: pytest.LogCaptureFixture
) -> None:
    run = await start()
    await run.published(1)
    await eventually(lambda: api.watching("EndpointSlice"))
    seen_rv = api.put(endpoint_slice("web", "10.0.0.1", "10.0.0.2"))
    await eventually(lambda: addresses(run.last, "default/web") == ["10.0.0.1", "10.0.0.2"])

    with caplog.at_level(logging.WARNING, logger="proxy.sources.kubeapi"):
        api.drop_watches("EndpointSlice")
        await eventually(lambda: len(api.of("EndpointSlice", watch=True)) == 2)
    api.put(endpoint_slice("web", "10.0.0.3"))
    await eventually(lambda: addresses(run.last, "default/web") == ["10.0.0.3"])

    assert api.of("EndpointSlice", watch=True)[1].query["resourceVersion"] == str(seen_rv)
    assert len(api.of("EndpointSlice", watch=False)) == 1
    assert any("watch of endpointslices failed" in r.getMessage() for r in caplog.records)


async def test_error_event_rewatches(api: FakeAPIServer, start: Start) -> None:
    run = await start()
    await run.published(1)
    await eventually(lambda: api.watching("Service"))
    api.error_event("Service", 500, "etcd is sad")
    await eventually(lambda: len(api.of("Service", watch=True)) == 2)
    assert len(api.of("Service", watch=False)) == 1
    api.put(service("api", 30081))
    await eventually(lambda: run.last.service("default/api") is not None)


async def test_instant_clean_close_backs_off(api: FakeAPIServer, start: Start) -> None:
    """A watch ending at once with no events is a failure, not a reason to spin."""
    run = await start(backoff_initial=0.05, backoff_max=0.05)
    await run.published(1)
    await eventually(lambda: api.watching("Node"))
    api.end_watches("Node")
    await eventually(lambda: len(api.of("Node", watch=True)) == 2)
    api.end_watches("Node")
    ended = time.monotonic()
    await eventually(lambda: len(api.of("Node", watch=True)) == 3)
    assert time.monotonic() - ended >= 0.045


async def test_api_errors_back_off_and_no_state_until_all_listed(
    api: FakeAPIServer, start: Start, caplog: pytest.LogCaptureFixture
) -> None:
    api.fail("EndpointSlice", False, 500, 503, 429, 403)
    api.fail("Service", True, 500)
    with caplog.at_level(logging.WARNING, logger="proxy.sources.kubeapi"):
        run = await start(backoff_initial=0.01)
        await eventually(lambda: len(api.of("EndpointSlice", watch=False)) >= 3)
        assert run.seen == [], "no state while the slices are not listed"
        snap = await run.published(1)
    assert addresses(snap, "default/web") == ["10.0.0.1"]
    assert len(api.of("EndpointSlice", watch=False)) == 5
    messages = [r.getMessage() for r in caplog.records]
    assert any("list of endpointslices failed: 503" in m for m in messages)
    forbidden = [r for r in caplog.records if "403" in r.getMessage()]
    assert forbidden and forbidden[0].levelno == logging.ERROR
    # The failed service watch is retried from the list's resourceVersion, not re-listed.
    await eventually(lambda: len(api.of("Service", watch=True)) == 2)
    assert len(api.of("Service", watch=False)) == 1


async def test_rotated_token_is_picked_up_after_401(
    api: FakeAPIServer, start: Start, tmp_path: Path
) -> None:
    token = tmp_path / "token"
    token.write_text("old")
    api.token = "new"
    run = await start(KubeConfig(api.url, token_file=token))
    await eventually(lambda: len(api.requests) >= 3)
    assert run.seen == []
    token.write_text("new")  # The kubelet rotated it.
    assert await run.source.wait_synced(2)
    assert api.requests[-1].headers["Authorization"] == "Bearer new"


async def test_unreachable_server_never_crashes(start: Start) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    run = await start(KubeConfig(f"http://127.0.0.1:{port}"))
    assert not await run.source.wait_synced(0.1)
    assert not run.task.done()
    assert run.hub.snapshot is None


async def test_pagination(api: FakeAPIServer, start: Start) -> None:
    for i in range(5):
        api.put(service(f"s{i}", 30100 + i))
    run = await start(page_size=2)
    snap = await run.published(1)
    assert len(snap.services) == 6
    pages = api.of("Service", watch=False)
    assert [p.query.get("continue") for p in pages] == [None, "2", "4"]
    assert all(p.query["limit"] == "2" for p in pages)
    assert "resourceVersion" not in pages[1].query, "a continue token pins the version"


async def test_a_continue_token_that_comes_back_is_a_failed_list(
    api: FakeAPIServer, start: Start, caplog: pytest.LogCaptureFixture
) -> None:
    """A server that hands back the same continue token would be paged for ever, as fast
    as it answers. The list fails instead, and is retried after the backoff."""
    for i in range(5):
        api.put(service(f"s{i}", 30100 + i))
    api.stuck_continue["Service"] = "2"
    run = await start(page_size=2, backoff_initial=0.05, backoff_max=0.05)
    await eventually(lambda: len(api.of("Service", watch=False)) >= 6)
    await asyncio.sleep(0.3)
    lists = api.of("Service", watch=False)
    # Two pages an attempt, one attempt per backoff: not a request per loop turn.
    assert len(lists) <= 2 * (0.3 / 0.05 + 6), len(lists)
    assert run.seen == [], "nothing is published before every kind is listed"
    assert "services list: page 2 gave the continue token '2' again" in caplog.text
    del api.stuck_continue["Service"]
    snap = await run.published(1)
    assert len(snap.services) == 6


async def test_large_watch_event(api: FakeAPIServer, start: Start) -> None:
    """One slice bigger than aiohttp's 128 KiB line limit."""
    run = await start()
    await run.published(1)
    ips = [f"10.1.{i // 250}.{i % 250 + 1}" for i in range(1000)]
    big = endpoint_slice("web", *ips)
    for ep in big["endpoints"]:
        ep["targetRef"] = {"kind": "Pod", "name": "x" * 100, "namespace": "default"}
    api.put(big)
    await eventually(lambda: len(addresses(run.last, "default/web")) == 1000)


# -- refused states ------------------------------------------------------------------------


async def test_malformed_object_keeps_the_last_good_state(
    api: FakeAPIServer, start: Start, caplog: pytest.LogCaptureFixture
) -> None:
    run = await start()
    good = await run.published(1)
    errors = metrics.REGISTRY.get_sample_value("kubeproxy_kpx_state_reload_errors_total") or 0
    with caplog.at_level(logging.ERROR, logger="proxy.sources.kubeapi"):
        api.put(service("web", 70000))
        await eventually(lambda: any("refused" in r.getMessage() for r in caplog.records))
        api.put(service("api", 30081))  # Another batch: still refused, logged once.
        await asyncio.sleep(0.05)
    refusals = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert len(refusals) == 1
    assert "Service default/web: spec.ports[0].nodePort: " in refusals[0]
    assert "70000" in refusals[0]
    assert run.hub.snapshot is good and run.seen == [good]
    after = metrics.REGISTRY.get_sample_value("kubeproxy_kpx_state_reload_errors_total")
    assert after == errors + 1

    api.put(service("web", 30080))
    fixed = await run.published(2)
    assert fixed.generation == 2
    assert {s.key for s in fixed.services} == {"default/web", "default/api"}


async def test_reload_relists_and_republishes(api: FakeAPIServer, start: Start) -> None:
    run = await start()
    await run.published(1)
    await eventually(lambda: all(api.watching(kind) for kind in api.objects))
    run.source.reload()
    second = await run.published(2)
    assert second.generation == 2
    for kind in api.objects:
        lists = api.of(kind, watch=False)
        assert len(lists) == 2 and "resourceVersion" not in lists[1].query



async def test_the_state_is_built_and_its_plans_made_off_the_loop(api: FakeAPIServer) -> None:
    """As for a state file: the API's state is built, and the readers' plans made (the
    hub's preparers), in a niced worker thread with the loop first for the GIL; the
    loop only publishes. A cluster of 50,000 services takes seconds to build, and the
    loop forwards meanwhile."""
    hub = StateHub()
    events: list[tuple[str, int, float, int]] = []

    def record(what: str) -> Callable[[Snapshot], None]:
        def call(snapshot: Snapshot) -> None:
            events.append((what, threading.get_ident(), sys.getswitchinterval(),
                           os.getpriority(os.PRIO_PROCESS, threading.get_native_id())))
        return call

    hub.add_preparer(record("prepare"))
    hub.subscribe(record("publish"))
    source = KubeAPISource(KubeConfig(api.url), hub, NODE, **FAST)
    task = asyncio.create_task(source.run())
    try:
        assert await source.wait_synced(5)
        api.put(service("second", 30081))
        await eventually(lambda: len(events) == 4)
    finally:
        source.stop()
        await asyncio.wait_for(task, 2)
    loop_thread = threading.get_ident()
    assert [e[0] for e in events] == ["prepare", "publish"] * 2
    for what, thread, interval, nice in events:
        if what == "prepare":
            assert thread != loop_thread, "the plans were made on the loop"
            assert interval == pytest.approx(LOOP_SWITCH_INTERVAL) and nice == WORKER_NICE
        else:
            assert thread == loop_thread


class DeafWatch:
    """A watch that, cancelled, does what Python 3.11's ``asyncio.wait_for`` does when
    the thing it waits for finishes in the loop turn the cancel comes in: the cancel is
    lost and the inner outcome (here a dropped connection) comes out instead.

    ``active`` counts the watches in progress. ``stop`` stops the source and says
    whether it ended on its own; if not, it lets the watches hear cancels again and
    cancels every task that ever watched, so a regression fails instead of hanging.
    """

    def __init__(self) -> None:
        self.active = 0
        self.hearing = False
        self.watchers: set[asyncio.Task[Any]] = set()

    async def __call__(self, kind: object) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.watchers.add(task)
        self.active += 1
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            if self.hearing:
                raise
            raise aiohttp.ClientConnectionError("the watch ended as it was cancelled") from None
        finally:
            self.active -= 1

    async def stop(self, source: KubeAPISource, task: asyncio.Task[None]) -> bool:
        source.stop()
        done, _ = await asyncio.wait({task}, timeout=2)
        if not done:
            self.hearing = True
            for t in self.watchers:
                t.cancel()
            await asyncio.wait({task, *self.watchers}, timeout=2)
        return bool(done)


async def deaf_source(api: FakeAPIServer) -> tuple[KubeAPISource, DeafWatch, list[Snapshot],
                                                   asyncio.Task[None]]:
    hub = StateHub()
    seen: list[Snapshot] = []
    hub.subscribe(seen.append)
    source = KubeAPISource(KubeConfig(api.url), hub, NODE, **FAST)
    deaf = DeafWatch()
    source._watch = deaf  # type: ignore[method-assign]
    return source, deaf, seen, asyncio.create_task(source.run())


async def test_stop_ends_a_reflector_that_swallowed_its_cancel(
    api: FakeAPIServer, caplog: pytest.LogCaptureFixture
) -> None:
    source, deaf, seen, task = await deaf_source(api)
    try:
        await eventually(lambda: deaf.active == 3 and len(seen) == 1)
    finally:
        # Without the check, each reflector logs the drop, backs off and watches again,
        # waiting there for a cancel that already came: stop would never return.
        assert await deaf.stop(source, task), "stop did not end the reflectors"
    assert deaf.active == 0
    assert "unexpected error" not in caplog.text


async def test_reload_leaves_one_reflector_per_kind_when_a_cancel_is_swallowed(
    api: FakeAPIServer,
) -> None:
    source, deaf, seen, task = await deaf_source(api)
    try:
        await eventually(lambda: deaf.active == 3 and len(seen) == 1)
        replaced = list(source._tasks.values())
        source.reload()
        # The replaced reflectors saw their watch "drop"; they must end, not watch
        # again beside their successors: one watch per kind, not two.
        await eventually(lambda: len(seen) == 2 and deaf.active == 3
                         and all(t.done() for t in replaced))
        assert not any(t.done() for t in source._tasks.values())
    finally:
        assert await deaf.stop(source, task), "stop did not end the reflectors"


# -- KubeConfig -------------------------------------------------------------------------


def b64(data: bytes | str) -> str:
    return base64.b64encode(data.encode() if isinstance(data, str) else data).decode()


def write_kubeconfig(path: Path, doc: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(doc))
    return path


def kubeconfig_doc(**user: Any) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "current-context": "prod",
        "contexts": [
            {"name": "dev", "context": {"cluster": "dev", "user": "dev"}},
            {"name": "prod", "context": {"cluster": "prod", "user": "proxy"}},
        ],
        "clusters": [
            {"name": "dev", "cluster": {"server": "https://dev.example:6443"}},
            {
                "name": "prod",
                "cluster": {
                    "server": "https://10.0.0.1:6443/",
                    "certificate-authority-data": b64("CA PEM"),
                    "tls-server-name": "kubernetes.default",
                },
            },
        ],
        "users": [
            {"name": "dev", "user": {"token": "dev-token"}},
            {"name": "proxy", "user": user or {"token": "prod-token"}},
        ],
    }


def test_kubeconfig_current_context_token_and_ca_data(tmp_path: Path) -> None:
    path = write_kubeconfig(tmp_path / "config", kubeconfig_doc())
    config = KubeConfig.from_kubeconfig(path)
    assert config.server == "https://10.0.0.1:6443"
    assert config.ca_data == b"CA PEM"
    assert config.tls_server_name == "kubernetes.default"
    assert config.authorization() == "Bearer prod-token"
    assert "prod-token" not in repr(config)
    assert "context prod" in config.describe()
    dev = KubeConfig.from_kubeconfig(path, context="dev")
    assert dev.server == "https://dev.example:6443" and dev.authorization() == "Bearer dev-token"


def test_kubeconfig_files_are_relative_to_it(tmp_path: Path) -> None:
    doc = kubeconfig_doc(
        **{"client-certificate": "pki/proxy.crt", "client-key": "/abs/proxy.key"},
    )
    doc["clusters"][1]["cluster"] = {"server": "https://k:6443", "certificate-authority": "ca.crt"}
    config = KubeConfig.from_kubeconfig(write_kubeconfig(tmp_path / "config", doc))
    assert config.ca_file == tmp_path / "ca.crt"
    assert config.client_cert_file == tmp_path / "pki/proxy.crt"
    assert config.client_key_file == Path("/abs/proxy.key")
    assert config.authorization() is None


def test_master_overrides_the_kubeconfig_server(tmp_path: Path) -> None:
    path = write_kubeconfig(tmp_path / "config", kubeconfig_doc())
    config = KubeConfig.load(path, master="https://lb.example:443")
    assert config.server == "https://lb.example:443"
    assert config.tls_server_name is None, "it named the server that was replaced"
    assert config.ca_data == b"CA PEM" and config.authorization() == "Bearer prod-token"
    alone = KubeConfig.load(None, master="http://127.0.0.1:8080")
    assert alone.server == "http://127.0.0.1:8080" and alone.authorization() is None
    assert alone.ssl_context() is None
    assert KubeConfig.load(None, master="10.0.0.1:6443").server == "https://10.0.0.1:6443"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda d: d.pop("current-context"), "no current-context"),
        (
            lambda d: d.update({"current-context": "nope"}),
            "Expected object with name nope in kubeconfig/contexts list",
        ),
        (
            lambda d: d["users"][1].update(user={"exec": {"command": "aws"}}),
            r"users\[name=proxy\]/user.exec.apiVersion: None is not one of",
        ),
        (
            lambda d: d["users"][1].update(user={"client-certificate-data": b64("x")}),
            "come together",
        ),
        (lambda d: d["users"][1].update(user={"username": "a", "password": "b"}), "basic auth"),
        (
            lambda d: d["clusters"][1]["cluster"].update({"insecure-skip-tls-verify": True}),
            "exclusive",
        ),
        (lambda d: d["clusters"][1]["cluster"].pop("server"), "no server"),
    ],
)
def test_kubeconfig_errors(
    tmp_path: Path, change: Callable[[dict[str, Any]], object], message: str
) -> None:
    doc = kubeconfig_doc()
    change(doc)
    with pytest.raises(KubeConfigError, match=message):
        KubeConfig.from_kubeconfig(write_kubeconfig(tmp_path / "config", doc))
    with pytest.raises(KubeConfigError, match="No such file"):
        KubeConfig.from_kubeconfig(tmp_path / "missing")


def test_insecure_skip_tls_verify(tmp_path: Path) -> None:
    doc = kubeconfig_doc()
    doc["clusters"][1]["cluster"] = {"server": "https://k:6443", "insecure-skip-tls-verify": True}
    ctx = KubeConfig.from_kubeconfig(write_kubeconfig(tmp_path / "config", doc)).ssl_context()
    assert ctx is not None and ctx.verify_mode == ssl.CERT_NONE and not ctx.check_hostname


def service_account(tmp_path: Path, token: str = "sa-token", ca: bool = True) -> Path:
    secret = tmp_path / "serviceaccount"
    secret.mkdir()
    (secret / "token").write_text(token + "\n")
    if ca:
        (secret / "ca.crt").write_text("CA")
    return secret


def test_in_cluster_from_env_and_secret_dir(tmp_path: Path) -> None:
    secret = service_account(tmp_path)
    env = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443"}
    config = KubeConfig.in_cluster(env=env, secret_dir=secret)
    assert config.server == "https://10.96.0.1:443"
    assert config.ca_file == secret / "ca.crt"
    assert config.authorization() == "Bearer sa-token"
    assert config.origin.startswith("in-cluster")
    v6 = {"KUBERNETES_SERVICE_HOST": "fd00::1", "KUBERNETES_SERVICE_PORT": "443"}
    assert KubeConfig.in_cluster(env=v6, secret_dir=secret).server == "https://[fd00::1]:443"
    # Neither flag: kube-proxy falls back to in-cluster.
    assert KubeConfig.load(env=env, secret_dir=secret).server == "https://10.96.0.1:443"


def test_in_cluster_errors(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    env = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443"}
    with pytest.raises(KubeConfigError, match="not running in a pod"):
        KubeConfig.in_cluster(env={}, secret_dir=tmp_path)
    with pytest.raises(KubeConfigError, match="token"):
        KubeConfig.in_cluster(env=env, secret_dir=tmp_path)
    secret = service_account(tmp_path, ca=False)
    with caplog.at_level(logging.WARNING):
        assert KubeConfig.in_cluster(env=env, secret_dir=secret).ca_file is None
    assert "system roots" in caplog.text


def test_token_file_is_reread_every_minute(tmp_path: Path) -> None:
    secret = service_account(tmp_path, token="one")
    env = {"KUBERNETES_SERVICE_HOST": "h", "KUBERNETES_SERVICE_PORT": "1"}
    config = KubeConfig.in_cluster(env=env, secret_dir=secret)
    now = time.monotonic()
    (secret / "token").write_text("two")
    assert config.authorization(now + 30) == "Bearer one"
    assert config.authorization(now + 61) == "Bearer two"
    (secret / "token").write_text("three")
    config.forget_token()  # As after a 401.
    assert config.authorization(now + 62) == "Bearer three"
    (secret / "token").unlink()
    assert config.authorization(now + 200) == "Bearer three", "keep the token in hand"


def test_backoff_is_bounded_jittered_and_forgotten() -> None:
    clock = [0.0]
    low = _Backoff(0.8, 30.0, rng=lambda: 0.0, clock=lambda: clock[0])
    assert [low.next() for _ in range(8)] == [0.8, 1.6, 3.2, 6.4, 12.8, 25.6, 30.0, 30.0]
    clock[0] = 121.0
    assert low.next() == 0.8, "forgotten after two calm minutes"
    high = _Backoff(0.8, 30.0, rng=lambda: 0.999)
    assert max(high.next() for _ in range(20)) < 60.0


def test_api_error_expiry() -> None:
    assert APIError(410).expired
    assert APIError(504, "Timeout", "Too large resource version: 5, current: 3").expired
    assert not APIError(504, "Timeout", "etcd timeout").expired
    err = APIError.from_status({"code": 410, "reason": "Expired", "message": "too old"}, 500)
    assert (err.code, err.reason, err.message) == (410, "Expired", "too old")
    assert APIError.from_status(None, 500).code == 500


# -- TLS, end to end ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_pki(tmp_path_factory.mktemp("pki"))


async def test_tls_with_client_certificate_data(
    pki: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=str(pki / "ca.crt"))
    server_ctx.load_cert_chain(pki / "server.crt", pki / "server.key")
    server_ctx.verify_mode = ssl.CERT_REQUIRED
    api = FakeAPIServer(ssl_context=server_ctx)
    await api.start()
    api.put(node(NODE, NODE_IP))
    try:
        doc = kubeconfig_doc(
            **{
                "client-certificate-data": b64((pki / "client.crt").read_bytes()),
                "client-key-data": b64((pki / "client.key").read_bytes()),
            }
        )
        doc["clusters"][1]["cluster"] = {
            "server": api.url,
            "certificate-authority-data": b64((pki / "ca.crt").read_bytes()),
        }
        config = KubeConfig.from_kubeconfig(write_kubeconfig(tmp_path / "config", doc))
        hub = StateHub()
        source = KubeAPISource(config, hub, NODE, **FAST)
        task = asyncio.create_task(source.run())
        try:
            assert await source.wait_synced(2)
        finally:
            source.stop()
            await asyncio.wait_for(task, 2)
        assert hub.snapshot is not None and hub.snapshot.nodes[0].name == NODE
        assert {r.peer for r in api.requests} == {"kpx-client"}
        assert not list(scratch.iterdir()), "the client key was left on disk"
    finally:
        await api.close()


def test_bad_client_key_fails_at_startup(pki: Path, tmp_path: Path) -> None:
    config = KubeConfig(
        "https://127.0.0.1:1",
        client_cert_data=(pki / "client.crt").read_bytes(),
        client_key_data=b"not a key",
    )
    with pytest.raises(KubeConfigError, match="client certificate"):
        KubeAPISource(config, StateHub(), NODE)
