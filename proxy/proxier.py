"""The proxier: the one sync that turns each snapshot into the dataplane's plans and healthz's data.

Owns: the sync loop's body, as kube-proxy's ``syncProxyRules`` is. For each
published snapshot it computes, once (``proxy.core.sync.compute_sync``, in the
source's worker thread when the source offers it), everything the snapshot
means for this node, then hands it out as plain data:

- the plans and listen addresses to the dataplane (``Dataplane.apply``), when
  there is one (``kpx healthz`` runs the same sync with none); on a
  dual-stack node, as kube-proxy's MetaProxier, the IPv6 family's own result
  to the IPv6 dataplane (``dataplane6``): ``SyncResult.ipv6``, or
  ``empty_result`` when the node has no IPv6 address (it then serves none);
- both families' health check hosts and local ready counts to healthz, the
  families served to ``ProxyHealth.set_families``, and whether the node's
  own ``/healthz`` answers over IPv6 too (``healthz_ipv6``);
- the healthCheckNodePorts and local ready counts to healthz
  (``sync_services``, ``sync_endpoints``), and the node's eligibility to
  ``ProxyHealth`` (``sync_node``), as the proxier feeds ``healthcheck``
  upstream;
- kube-proxy's sync metrics: the sync duration and last-sync time, the
  services whose Local policy drops traffic, and the network programming
  latency of every new slice change.

Also the ``PlanCache`` that keeps the plans of unchanged services across
syncs, and the lock that lets its worker-thread half and its loop half share
that cache.

Never: parse state, open sockets or serve HTTP. Nor let one consumer's
failure stop the others: each is logged and skipped, and the hub then keeps
the proxy unhealthy until a sync goes through.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import NamedTuple, Protocol

from healthz.proxy_health import ProxyHealth
from proxy import metrics
from proxy.core.decision import PlanCache
from proxy.core.model import FAMILY_NAMES, Snapshot
from proxy.core.sync import SyncConfig, SyncResult, compute_sync, empty_result
from proxy.sources.hub import StateHub
from proxy.util.prepared import Prepared

log = logging.getLogger(__name__)

SLOW_SYNC = 0.1
"""Seconds above which a sync is logged at info (every one is at debug)."""


class Backend(Protocol):
    """A dataplane the sync programs: the userspace relay today (``proxy.userspace``)."""

    def prepare(self, sync: SyncResult) -> None: ...
    def apply(self, sync: SyncResult) -> None: ...


class ServiceHealth(Protocol):
    """kube-proxy's ``ServiceHealthServer`` surface (``healthz.service_health``)."""

    def sync_services(self, ports: Mapping[str, int], hosts: Sequence[str]) -> None: ...
    def sync_endpoints(self, local_ready: Mapping[str, int],
                       local_ready6: Mapping[str, int] | None = None) -> None: ...


class _Prepared(NamedTuple):
    """The pure half of one sync, done ahead in a worker thread."""

    result: SyncResult
    result6: SyncResult
    """What the IPv6 dataplane applies: ``result.ipv6`` or the empty IPv6 result."""
    seen: Mapping[tuple[str, str, str], float]
    """The trigger times ``new_triggers`` was found against."""
    new_triggers: list[tuple[float, str]]


class Proxier:
    """Runs the one sync of one node: a hub reader, and a preparer for its pure half."""

    def __init__(
        self,
        config: SyncConfig,
        *,
        dataplane: Backend | None = None,
        dataplane6: Backend | None = None,
        services: ServiceHealth | None = None,
        health: ProxyHealth | None = None,
        healthz_ipv6: Callable[[bool], None] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.config = config
        self.dataplane = dataplane
        self.dataplane6 = dataplane6
        """The IPv6 family's dataplane; None: IPv6 is not forwarded at all."""
        self._healthz_ipv6 = healthz_ipv6
        """Turns the node /healthz's IPv6 socket on or off (``Sidecar.serve_healthz_ipv6``)."""
        self._ipv6_served: bool | None = None
        self.services = services
        self.health = health
        self._clock = clock
        self._started = clock()
        self._cache = PlanCache()
        self._udp_cache = PlanCache()
        self._cache6 = PlanCache()
        self._udp_cache6 = PlanCache()
        self._lock = threading.Lock()
        """``prepare`` (a worker thread) and ``sync`` (the loop) share the cache."""
        self._prepared: Prepared[_Prepared] = Prepared()
        self._triggers: Mapping[tuple[str, str, str], float] = {}
        """Trigger times already observed, by slice: each is observed once."""
        self._warned_no_node = False
        self._ipv6_synced = False
        """Whether the last sync programmed IPv6 (its metric series exist)."""
        self.last: SyncResult | None = None
        """The result of the last sync."""

    # -- wiring ---------------------------------------------------------------

    def attach(self, hub: StateHub) -> None:
        """Follow ``hub``: its preparer computes, its reader hands out."""
        hub.add_preparer(self.prepare)
        hub.subscribe(self.sync)

    def detach(self, hub: StateHub) -> None:
        hub.unsubscribe(self.sync)
        hub.remove_preparer(self.prepare)

    # -- the sync ---------------------------------------------------------------

    def _compute(self, snapshot: Snapshot) -> SyncResult:
        with self._lock:
            return compute_sync(snapshot, self.config, self._cache, self._udp_cache,
                                self._cache6, self._udp_cache6)

    @staticmethod
    def _ipv6_of(result: SyncResult) -> SyncResult:
        """What the IPv6 dataplane applies for ``result``: its IPv6 result, or nothing."""
        return result.ipv6 or empty_result(result.generation, 6)

    def prepare(self, snapshot: Snapshot) -> None:
        """The pure half, in the caller's (a source's worker) thread, ahead of ``sync``.

        Building the plans of 10,000 NodePorts, counting local endpoints and
        reading every slice's trigger time would otherwise hold the loop
        that forwards traffic and answers health checks.
        """
        result = self._compute(snapshot)
        result6 = self._ipv6_of(result)
        if self.dataplane is not None:
            self.dataplane.prepare(result)
        if self.dataplane6 is not None:
            self.dataplane6.prepare(result6)
        seen = self._triggers
        self._prepared.put(snapshot, _Prepared(result, result6, seen,
                                               self._new_triggers(result, seen)))

    def sync(self, snapshot: Snapshot) -> None:
        """Put ``snapshot`` in force: dataplane, healthz and metrics, in that order.

        Raises if the dataplane failed, so the hub keeps the update pending
        (health fails after the timeout, as an update that never applies does
        upstream). The health checks are fed either way: a dataplane puts the
        plans in force first, so what failed is a part of the sync, and the
        counts describe the plans it decides by (kube-proxy, whose restore is
        all or nothing, feeds them only after a success). The metrics say
        synced, as kube-proxy's do, only for a family whose dataplane took it.
        """
        started = time.perf_counter()
        prepared = self._prepared.take(snapshot)
        if prepared is not None and prepared.seen is self._triggers:
            result, result6 = prepared.result, prepared.result6
            new_triggers = prepared.new_triggers
        else:
            if prepared is not None:
                result, result6 = prepared.result, prepared.result6
            else:
                result = self._compute(snapshot)
                result6 = self._ipv6_of(result)
            new_triggers = self._new_triggers(result, self._triggers)
        self.last = result
        self._note_node(result)
        failure: Exception | None = None
        failed: set[int] = set()
        for dataplane, family_result in ((self.dataplane, result), (self.dataplane6, result6)):
            if dataplane is None:
                continue
            try:
                dataplane.apply(family_result)
            except Exception as exc:  # the others still get this sync
                failure = failure or exc
                failed.add(family_result.family)
        self._note_families(result)
        if self.health is not None:
            self.health.sync_node(result.node_eligible)
        if self.services is not None:
            six = result.ipv6
            try:
                self.services.sync_services(
                    result.health_check_ports,
                    result.health_hosts + (six.health_hosts if six is not None else ()))
                self.services.sync_endpoints(result.local_ready,
                                             six.local_ready if six is not None else None)
            except Exception:
                log.exception("health checks of generation %d failed", result.generation)
        self._observe(result, new_triggers, time.perf_counter() - started, failed)
        if failure is not None:
            raise failure

    def _note_families(self, result: SyncResult) -> None:
        """The families this node serves, to healthz: IPv6 while its Node has an IPv6 address.

        Only with an IPv6 dataplane: a proxy that forwards no IPv6 must not
        claim an IPv6 status, nor answer IPv6 health probes.
        """
        six = result.ipv6 is not None and (self.dataplane6 is not None or self.dataplane is None)
        if six == self._ipv6_served:
            return
        was, self._ipv6_served = self._ipv6_served, six
        if self.health is not None:
            self.health.set_families(("IPv4", "IPv6") if six else ("IPv4",))
        if self._healthz_ipv6 is not None:
            try:
                self._healthz_ipv6(six)
            except Exception:
                log.exception("cannot turn the IPv6 /healthz socket %s", "on" if six else "off")
        if six or was:
            log.info("serving %s", "IPv4 and IPv6" if six else "IPv4 only: the node has no"
                     " IPv6 address")

    def _note_node(self, result: SyncResult) -> None:
        if result.node_known:
            self._warned_no_node = False
        elif not self._warned_no_node:
            log.warning(
                "node %r is not in the state (generation %d): its addresses are unknown, "
                "so only 127.0.0.0/8 counts as node-originated%s",
                self.config.node_name, result.generation,
                "" if not self.config.nodeport_cidrs and self.config.bind_localhost
                else "; listening on 127.0.0.1 only, where the CIDRs allow it",
            )
            self._warned_no_node = True

    def _new_triggers(
        self, result: SyncResult, seen: Mapping[tuple[str, str, str], float]
    ) -> list[tuple[float, str]]:
        """The trigger times to observe: after start-up, and not seen before.

        As kube-proxy's tracker does, a trigger from before this process
        started is not observed: it would measure our start-up, not the network.
        """
        started = self._started
        return [
            (trigger, key[2]) for key, trigger in result.trigger_times.items()
            if trigger > started and seen.get(key) != trigger
        ]

    def _observe(self, result: SyncResult, new_triggers: list[tuple[float, str]],
                 elapsed: float, failed: Collection[int] = ()) -> None:
        """kube-proxy's sync metrics for this sync.

        The duration counts every attempt; the last-sync timestamp, the
        no-local-endpoints gauges and the network programming latency only a
        family whose rules went in ("the last time proxy rules were
        *successfully* synced").
        """
        now = self._clock()
        families = [result] if result.ipv6 is None else [result, result.ipv6]
        for family in families:
            name = FAMILY_NAMES[family.family]
            metrics.SYNC_DURATION.labels(ip_family=name).observe(elapsed)
            if family.family in failed:
                continue
            metrics.SYNC_LAST_TIMESTAMP.labels(ip_family=name).set(now)
            metrics.NO_LOCAL_ENDPOINTS.labels(traffic_policy="external", ip_family=name).set(
                family.dropping)
            metrics.NO_LOCAL_ENDPOINTS.labels(traffic_policy="internal", ip_family=name).set(
                family.dropping_internal)
        if result.ipv6 is None and self._ipv6_synced:
            # The node lost IPv6: its gauges say so, rather than freeze at their last values.
            for policy in ("external", "internal"):
                metrics.NO_LOCAL_ENDPOINTS.labels(traffic_policy=policy, ip_family="IPv6").set(0)
        self._ipv6_synced = result.ipv6 is not None
        log.log(logging.INFO if elapsed >= SLOW_SYNC else logging.DEBUG,
                "generation %d applied in %.0f ms", result.generation, elapsed * 1000)
        if failed:
            return  # not programmed yet: observed when a sync puts them in force
        for trigger, family in new_triggers:  # the slice's addressType: IPv4 or IPv6
            metrics.NETWORK_PROGRAMMING_DURATION.labels(ip_family=family).observe(
                max(0.0, now - trigger))
        self._triggers = result.trigger_times
