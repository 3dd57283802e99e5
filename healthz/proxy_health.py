"""The proxy's own health: ``ProxyHealth`` and its ``/healthz`` and ``/livez`` server.

Owns:
- ``ProxyHealth``: kube-proxy's ``ProxyHealthServer`` bookkeeping
  (``pkg/proxy/healthcheck/proxy_health.go``): ``queued``/``updated`` as
  snapshots are published and applied, faults (a dataplane part known to be
  broken), and the node's eligibility as the proxier last saw it
  (``sync_node``). Every health answer of the process reads this one object.
- ``NodeHealthServer``: kube-proxy's newest handlers on
  ``--healthz-bind-address`` (default ``0.0.0.0:10256``): ``/healthz``
  (proxy health *and* node eligibility) and ``/livez`` (proxy health only),
  JSON in ``json.Marshal`` form, Go's ``404 page not found`` for any other
  path.

Never: look at a snapshot or a Node. The proxier hands over plain data
(``sync_node(eligible)``); this module only keeps and reports it.

Health follows upstream exactly: 200 iff no update has been pending for the
health timeout (2 x sync period) and, for ``/healthz`` only, the Node exists
and is neither being deleted nor tainted ``ToBeDeletedByClusterAutoscaler``.
When healthy, the top-level ``lastUpdated`` is "now", as upstream keeps it for
compatibility with older releases; the per-family status keeps the real time.
A *fault* (``set_fault``, e.g. the transparent return path deleted and not
restorable) makes the proxy unhealthy until cleared: the rules kube-proxy
would have failed to apply.

Per family, as kube-proxy v1.33+ (one proxier per family): the proxy declares
the families it serves (``set_families``, IPv4 alone by default) and each gets
a ``status`` entry; ``queued``/``updated`` and faults may name one family
(a fault without one affects all), so a broken IPv6 dataplane shows as the
``IPv6`` entry unhealthy while ``IPv4`` stays healthy. The top-level
``healthy`` is true iff no served family is unhealthy, as upstream's
``Health()``; with IPv4 alone every byte is what it was before.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from typing import Any

from aiohttp.web_request import BaseRequest

from healthz.http import IPV4, IPV6, JSON_HEADERS, GoResponse, go_not_found, go_response
from healthz.metrics import HEALTHZ_TOTAL, LIVEZ_TOTAL


def rfc3339nano(ts: float) -> str:
    """A UNIX time as Go's ``time.Time`` marshals to JSON (RFC3339Nano, UTC).

    Go trims trailing zeros of the fraction and drops it entirely on a whole
    second, so ``...:05.1Z`` and ``...:05Z`` are both valid outputs.
    """
    # Split before scaling: ``ts * 1e9`` would round away the fraction's last
    # digits, while ``ts - floor(ts)`` is exact.
    secs = math.floor(ts)
    frac = round((ts - secs) * 1_000_000_000)
    if frac == 1_000_000_000:
        secs, frac = secs + 1, 0
    text = datetime.fromtimestamp(secs, tz=UTC).strftime("%Y-%m-%dT%H:%M:%S")
    if frac:
        text += "." + f"{frac:09d}".rstrip("0")
    return text + "Z"


FAMILIES = (IPV4, IPV6)
"""The IP families a proxier can serve, as kube-proxy's ``v1.IPFamily`` spells them."""


def family_name(family: str | int) -> str:
    """``"IPv4"``/``"IPv6"`` from itself or from ``4``/``6`` (``SyncResult.family``).

    ``ValueError`` naming the value for anything else, so a wiring mistake
    fails loudly at the call instead of reporting a family nobody serves.
    """
    if family in (4, IPV4):
        return IPV4
    if family in (6, IPV6):
        return IPV6
    raise ValueError(f"IP family {family!r}: must be 'IPv4' or 'IPv6' (or 4 or 6)")


class ProxyHealth:
    """kube-proxy's proxier health: healthy unless an update is pending too long.

    Kept per IP family, as upstream's ``lastUpdatedMap`` and
    ``oldestPendingQueuedMap`` are (one proxier per family there): a dual-stack
    node reports an ``IPv4`` and an ``IPv6`` entry, and the proxy is healthy
    only when no family it serves is unhealthy. kpx serves IPv4 alone until
    ``set_families`` says otherwise, so an IPv4-only node's answers are
    exactly what they were before dual-stack.

    The node is not eligible until the proxier says otherwise: an unknown
    node is not eligible, as in the newest kube-proxy (which reads it from
    its NodeManager).
    """

    def __init__(self, timeout: float = 60.0, clock: Callable[[], float] = time.time) -> None:
        self.timeout = timeout
        self._clock = clock
        self._families: tuple[str, ...] = (IPV4,)
        self._last_updated: dict[str, float] = {IPV4: clock()}
        self._pending: dict[str, float] = {}
        self.node_eligible = False
        """Whether the Node exists and is neither deleted nor marked for removal."""
        self.faults: dict[str, str] = {}
        """Known-broken dataplane parts of every family (name -> why), e.g. a
        return path that cannot be restored: the rules are not in force, which
        is what an update that never applies means upstream, so health fails
        alike. Family-scoped faults are in ``family_faults``."""
        self.family_faults: dict[str, dict[str, str]] = {f: {} for f in FAMILIES}
        """Faults of one family's dataplane (family -> name -> why): they make
        that family's status unhealthy, and so the proxy, but not the other
        family's entry nor its healthCheckNodePort answers."""

    # -- families -------------------------------------------------------------

    @property
    def families(self) -> tuple[str, ...]:
        """The families this proxy serves, in the order declared."""
        return self._families

    def set_families(self, families: Sequence[str | int]) -> None:
        """Declare the IP families this node's proxy serves (``("IPv4", "IPv6")``).

        A family newly served starts healthy with ``lastUpdated`` now, as a
        kube-proxy proxier is "healthy while it's starting up"; one no longer
        served loses its status entry and its faults stop counting (they stay
        with whoever set them, to clear). ``ValueError`` for an empty list or
        an unknown family.
        """
        wanted: list[str] = []
        for family in families:
            name = family_name(family)
            if name not in wanted:
                wanted.append(name)
        if not wanted:
            raise ValueError("IP families: at least one of 'IPv4' and 'IPv6' must be served")
        now = self._clock()
        for name in wanted:
            self._last_updated.setdefault(name, now)
        for name in FAMILIES:
            if name not in wanted:
                self._last_updated.pop(name, None)
                self._pending.pop(name, None)
        self._families = tuple(wanted)

    def _which(self, family: str | int | None) -> tuple[str, ...]:
        return self._families if family is None else (family_name(family),)

    # -- updates ----------------------------------------------------------------

    def queued(self, family: str | int | None = None) -> None:
        """kube-proxy's ``QueuedUpdate``: a change awaits; ``None`` means every served family."""
        now = self._clock()
        for name in self._which(family):
            self._pending.setdefault(name, now)

    def updated(self, family: str | int | None = None) -> None:
        """kube-proxy's ``Updated``: the change is in force; ``None`` means every served family."""
        now = self._clock()
        for name in self._which(family):
            self._pending.pop(name, None)
            self._last_updated[name] = now

    @property
    def last_updated(self) -> float:
        """The newest served family's last update, upstream's top-level ``lastUpdated``."""
        return max(self.family_last_updated(f) for f in self._families)

    @property
    def oldest_pending(self) -> float | None:
        """The oldest update still pending in any served family, if one is."""
        pending = [self._pending[f] for f in self._families if f in self._pending]
        return min(pending) if pending else None

    def family_last_updated(self, family: str | int) -> float:
        """A served family's last update (its status entry's ``lastUpdated``)."""
        name = family_name(family)
        if name not in self._last_updated:
            raise ValueError(f"IP family {name}: not served (served: {', '.join(self._families)})")
        return self._last_updated[name]

    def sync_node(self, eligible: bool) -> None:
        """kube-proxy's ``SyncNode``: the proxier's view of this node, as data."""
        self.node_eligible = eligible

    # -- faults -------------------------------------------------------------------

    def set_fault(self, name: str, why: str, family: str | int | None = None) -> None:
        """Mark a dataplane part broken: of ``family`` only, or of every family (``None``)."""
        if family is None:
            self.faults[name] = why
        else:
            self.family_faults[family_name(family)][name] = why

    def clear_fault(self, name: str, family: str | int | None = None) -> None:
        """Undo ``set_fault`` with the same ``name`` and ``family``."""
        if family is None:
            self.faults.pop(name, None)
        else:
            self.family_faults[family_name(family)].pop(name, None)

    def fault(self, name: str, family: str | int | None = None) -> str | None:
        """Why ``name`` (of ``family``, or unscoped) is broken, or ``None``."""
        if family is None:
            return self.faults.get(name)
        return self.family_faults[family_name(family)].get(name)

    # -- health -------------------------------------------------------------------

    def _family_healthy(self, name: str) -> bool:
        if self.family_faults[name]:
            return False
        pending = self._pending.get(name)
        return pending is None or self._clock() - pending < self.timeout

    def healthy(self, family: str | int | None = None) -> bool:
        """Overall (``None``): no served family unhealthy. Else that family's entry.

        A family this proxy does not serve has no entry of its own: it gets
        the overall answer.
        """
        if self.faults:
            return False
        if family is not None:
            name = family_name(family)
            if name in self._families:
                return self._family_healthy(name)
        return all(self._family_healthy(f) for f in self._families)

    def now(self) -> float:
        return self._clock()


class NodeHealthServer:
    """Answers ``/healthz`` and ``/livez`` from the shared ``ProxyHealth``."""

    def __init__(self, health: ProxyHealth) -> None:
        self.health = health

    def answer(self, request: BaseRequest) -> GoResponse:
        """A ``ServeMux`` with exactly two routes; any method is accepted."""
        path = request.path
        if path == "/healthz":
            return self._respond(with_node=True)
        if path == "/livez":
            return self._respond(with_node=False)
        return go_not_found()

    def document(self, with_node: bool) -> tuple[bool, dict[str, Any]]:
        """``(answer 200?, ProxyHealth JSON object)``, field order as Go marshals it."""
        health = self.health
        proxy_healthy = health.healthy()
        now = health.now()
        last = health.last_updated
        eligible = health.node_eligible
        ok = proxy_healthy and (not with_node or eligible)
        doc: dict[str, Any] = {
            "lastUpdated": rfc3339nano(health.now() if ok else last),
            "currentTime": rfc3339nano(now),
        }
        if with_node:
            doc["nodeEligible"] = eligible
        doc["healthy"] = proxy_healthy
        # json.Marshal writes a map's keys sorted: "IPv4" before "IPv6".
        doc["status"] = {
            family: {
                "lastUpdated": rfc3339nano(health.family_last_updated(family)),
                "healthy": health.healthy(family),
            }
            for family in sorted(health.families)
        }
        return ok, doc

    def _respond(self, with_node: bool) -> GoResponse:
        ok, doc = self.document(with_node)
        code = 200 if ok else 503
        counter = HEALTHZ_TOTAL if with_node else LIVEZ_TOTAL
        counter.labels(code=str(code)).inc()
        body = json.dumps(doc, separators=(",", ":")).encode()
        return go_response(code, JSON_HEADERS, body)
