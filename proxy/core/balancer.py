"""Endpoint choice for one service port: round-robin plus ClientIP affinity.

Owns: the only mutable state the decision core has, the round-robin cursor
and the affinity records of one service port. It survives state reloads (the
dataplane keeps one Balancer per service port) so sticky clients stay sticky
while unrelated services change.

Never: read a clock. ``now`` comes from the caller, which is what makes the
affinity timeout testable without sleeping.

Affinity follows kube-proxy: keyed on the client IP only, the timer restarts
on every new connection, and a record whose endpoint is gone, no longer
eligible or just failed is replaced by a fresh pick.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from proxy.core.endpoints import EndpointInfo

_REAP_EVERY = 1024
"""Sweep expired affinity records after this many picks, bounding memory."""


class Balancer:
    """Round-robin cursor plus ClientIP affinity records for one service port."""

    __slots__ = ("_cursor", "_picks", "_sticky")

    def __init__(self) -> None:
        self._cursor = 0
        self._sticky: dict[str, tuple[tuple[str, int], float]] = {}
        self._picks = 0

    def pick(
        self,
        candidates: Sequence[EndpointInfo],
        client_ip: str,
        now: float,
        affinity_seconds: float | None = None,
        exclude: Collection[tuple[str, int]] = (),
    ) -> EndpointInfo | None:
        """Choose an endpoint for a new connection, or None if all are excluded."""
        if exclude:
            candidates = [c for c in candidates if c.addr not in exclude]
        if not candidates:
            return None
        if affinity_seconds is None:
            # Affinity was switched off: forget every record, as kube-proxy's
            # rules vanish, so switching it back on starts afresh.
            if self._sticky:
                self._sticky.clear()
            return self._next(candidates)

        self._picks += 1
        if self._picks % _REAP_EVERY == 0:
            self.reap(now, affinity_seconds)
        record = self._sticky.get(client_ip)
        if record is not None:
            addr, last = record
            if now - last < affinity_seconds:
                for c in candidates:
                    if c.addr == addr:
                        self._sticky[client_ip] = (addr, now)
                        return c
        chosen = self._next(candidates)
        self._sticky[client_ip] = (chosen.addr, now)
        return chosen

    def _next(self, candidates: Sequence[EndpointInfo]) -> EndpointInfo:
        i = self._cursor % len(candidates)
        self._cursor = i + 1
        return candidates[i]

    def forget(self, client_ip: str) -> None:
        """Drop a client's record, e.g. after its endpoint failed to connect."""
        self._sticky.pop(client_ip, None)

    def reap(self, now: float, affinity_seconds: float) -> None:
        """Remove expired records so idle clients do not pin memory forever."""
        self._sticky = {
            k: v for k, v in self._sticky.items() if now - v[1] < affinity_seconds
        }

    def sticky_target(self, client_ip: str) -> tuple[str, int] | None:
        record = self._sticky.get(client_ip)
        return record[0] if record else None
