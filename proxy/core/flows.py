"""UDP flows: which endpoint each client's datagrams go to, and for how long.

Owns: ``FlowTable``, kpx's own connection tracking for UDP. A flow is the
client's address and port plus the address and port it sent to (the
service port). Its first datagram is decided (``decision.decide``); later
ones follow the same endpoint until the flow is idle for longer than
conntrack's UDP timeouts: ``unreplied`` (30 s, kube-proxy's
``--conntrack-udp-timeout``) while no reply has come back, ``replied``
(120 s, ``--conntrack-udp-timeout-stream``) once one has.

The table is bounded. A new flow in a full table evicts the flow idle the
longest, and says so (the shell closes its socket and counts it): it never
fails open, and never refuses the new flow for an old one.

Why its own table rather than conntrack: kube-proxy's UDP entries outlive
the endpoint they point at, and traffic black-holes until something
flushes them (kubernetes#96174, #125979, #122740). Here a flow is checked
against the plan in force whenever that plan changed (``still_eligible``),
so a flow to an endpoint that went away is re-decided on its next datagram.

Never: touch sockets or clocks. Time comes in as ``now``; what a flow holds
for the shell (its upstream socket) is opaque here, typed ``T``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Generic, TypeVar

from proxy.core.decision import PortPlan
from proxy.core.endpoints import EndpointInfo

T = TypeVar("T")

UDP_TIMEOUT = 30.0
"""conntrack's ``nf_conntrack_udp_timeout``: a flow that never saw a reply."""
UDP_TIMEOUT_STREAM = 120.0
"""conntrack's ``nf_conntrack_udp_timeout_stream``: a flow that saw one."""

FlowKey = tuple[str, int, str, int]
"""(client IP, client port, the local IP it sent to, the port it sent to)."""


@dataclass(slots=True, eq=False)
class Flow(Generic[T]):
    """One client's datagrams to one service port, pinned to one endpoint."""

    key: FlowKey
    plan: PortPlan
    """The plan the endpoint was chosen under: when the plan in force is
    another object, the choice is checked again (``still_eligible``)."""
    endpoint: EndpointInfo
    snat: bool
    last: float
    """When the last datagram, either way, passed."""
    replied: bool = False
    upstream: T | None = None

    @property
    def client(self) -> tuple[str, int]:
        return self.key[0], self.key[1]

    @property
    def local(self) -> tuple[str, int]:
        return self.key[2], self.key[3]


class FlowTable(Generic[T]):
    """Every live flow, bounded, each expiring after conntrack's idle timeouts.

    Two least-recently-used orders, one per timeout, so the oldest flow of
    each is at its front and expiry reads only flows that are due.
    """

    __slots__ = ("_replied", "_unreplied", "limit", "timeout", "timeout_stream")

    def __init__(self, limit: int = 4096, timeout: float = UDP_TIMEOUT,
                 timeout_stream: float = UDP_TIMEOUT_STREAM) -> None:
        if limit < 1:
            raise ValueError(f"a flow table holds at least one flow, not {limit}")
        self.limit = limit
        self.timeout = timeout
        self.timeout_stream = timeout_stream
        self._unreplied: OrderedDict[FlowKey, Flow[T]] = OrderedDict()
        self._replied: OrderedDict[FlowKey, Flow[T]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._unreplied) + len(self._replied)

    def __iter__(self) -> Iterator[Flow[T]]:
        yield from list(self._unreplied.values())
        yield from list(self._replied.values())

    def get(self, key: FlowKey, now: float) -> Flow[T] | None:
        """The live flow for ``key``; None if there is none or it has just expired.

        An expired flow found here stays in the table for ``expire`` to hand
        to the shell (its socket must be closed), but is never used again.
        """
        flow = self._unreplied.get(key) or self._replied.get(key)
        if flow is None or now - flow.last >= self._timeout_of(flow):
            return None
        return flow

    def add(self, flow: Flow[T]) -> list[Flow[T]]:
        """Put ``flow`` in; returns the flows it displaced (an old one, or the evicted).

        The returned flows are out of the table; their sockets are the
        shell's to close.
        """
        out: list[Flow[T]] = []
        old = self.remove(flow.key)
        if old is not None:
            out.append(old)
        if len(self) >= self.limit:
            victim = self._oldest()
            if victim is not None:
                self.remove(victim.key)
                out.append(victim)
        (self._replied if flow.replied else self._unreplied)[flow.key] = flow
        return out

    def touch(self, flow: Flow[T], now: float, reply: bool = False) -> None:
        """A datagram passed: ``flow`` becomes the most recent; a reply makes it a stream."""
        flow.last = now
        if reply and not flow.replied:
            flow.replied = True
            self._unreplied.pop(flow.key, None)
            self._replied[flow.key] = flow
            return
        order = self._replied if flow.replied else self._unreplied
        if flow.key in order:
            order.move_to_end(flow.key)

    def remove(self, key: FlowKey) -> Flow[T] | None:
        return self._unreplied.pop(key, None) or self._replied.pop(key, None)

    def expire(self, now: float) -> list[Flow[T]]:
        """Take out every flow idle past its timeout; returns them (oldest first per order)."""
        out: list[Flow[T]] = []
        for order, timeout in ((self._unreplied, self.timeout),
                               (self._replied, self.timeout_stream)):
            while order:
                key, flow = next(iter(order.items()))
                if now - flow.last < timeout:
                    break
                del order[key]
                out.append(flow)
        return out

    def next_expiry(self) -> float | None:
        """When the next flow falls due (None: the table is empty)."""
        due = [f.last + t for order, t in ((self._unreplied, self.timeout),
                                           (self._replied, self.timeout_stream))
               if order for f in (next(iter(order.values())),)]
        return min(due) if due else None

    def _timeout_of(self, flow: Flow[T]) -> float:
        return self.timeout_stream if flow.replied else self.timeout

    def _oldest(self) -> Flow[T] | None:
        """The flow idle the longest, of either order."""
        fronts = [next(iter(order.values())) for order in (self._unreplied, self._replied)
                  if order]
        return min(fronts, key=lambda f: f.last) if fronts else None
