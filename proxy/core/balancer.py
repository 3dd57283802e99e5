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

from collections import OrderedDict
from collections.abc import Collection, Sequence

from proxy.core.endpoints import EndpointInfo

_REAP_EVERY = 1024
"""Sweep expired affinity records after this many picks, bounding memory."""
MAX_STICKY = 65536
"""Affinity records kept per service port at most; past it the least recently used goes,
as kube-proxy's nftables mode bounds its affinity sets (65535 elements). A UDP client's
source costs it nothing to vary, so without a bound its records would pin memory for the
whole affinity timeout."""


class Balancer:
    """Round-robin cursor plus ClientIP affinity records for one service port.

    The records are kept in the order of their last use, oldest first (an
    ``OrderedDict``: moving one to the end, and dropping the oldest, are O(1)),
    so both the bound and the reaping of expired records touch only the front.
    """

    __slots__ = ("_cursor", "_picks", "_sticky")

    def __init__(self) -> None:
        self._cursor = 0
        self._sticky: OrderedDict[str, tuple[tuple[str, int], float]] = OrderedDict()
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
        sticky = self._sticky
        record = sticky.get(client_ip)
        if record is not None:
            addr, last = record
            if now - last < affinity_seconds:
                for c in candidates:
                    if c.addr == addr:
                        sticky[client_ip] = (addr, now)
                        sticky.move_to_end(client_ip)
                        return c
        chosen = self._next(candidates)
        sticky[client_ip] = (chosen.addr, now)
        if record is not None:
            sticky.move_to_end(client_ip)
        elif len(sticky) > MAX_STICKY:
            sticky.popitem(last=False)
        return chosen

    def _next(self, candidates: Sequence[EndpointInfo]) -> EndpointInfo:
        i = self._cursor % len(candidates)
        self._cursor = i + 1
        return candidates[i]

    def forget(self, client_ip: str) -> None:
        """Drop a client's record, e.g. after its endpoint failed to connect."""
        self._sticky.pop(client_ip, None)

    def reap(self, now: float, affinity_seconds: float) -> None:
        """Remove expired records so idle clients do not pin memory forever.

        The oldest use comes first, so only the expired records are visited
        (``now`` never goes back: the callers read a monotonic clock).
        """
        sticky = self._sticky
        while sticky:
            client_ip, (_, last) = next(iter(sticky.items()))
            if now - last < affinity_seconds:
                break
            del sticky[client_ip]

    def sticky_target(self, client_ip: str) -> tuple[str, int] | None:
        record = self._sticky.get(client_ip)
        return record[0] if record else None
