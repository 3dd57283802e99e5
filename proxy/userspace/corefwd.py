"""The relay with its mechanics in C: ``CoreForwarder``, the ``Forwarder`` kpx runs when it can.

Owns: the decisions of the compiled relay core (``proxy.userspace._relaycore``,
built from ``_relaycore.c`` by ``pip install`` when a C compiler is there) and
what the dataplane sees of it. The core accepts on the listeners, connects,
relays, expires idle connections and resets; everything that is a decision or a
count stays here, in Python, called once per poll of the core, never per event:

- ``core_decide``: the accepted clients of one poll, each decided by
  ``proxy.core.decision.decide`` on the plan in force, as ``Forwarder.on_accept``
  decides them;
- ``core_failed``: connects that failed or timed out, each decided again without
  the endpoints that failed for it (``Relay._connect_failed``'s rules);
- ``core_finished``: connections that ended: the counts, and the expiry warnings;
- ``core_listener`` / ``core_starved``: a listener at the connection limit or
  failing to accept, and an upstream socket that could not be made.

Never: a rule of its own. What a connection may do, and what happens on each
event, is ``forwarder.py``'s (``RELAY_RULES``, ``DIRECTION_RULES``, the idle
rules of ``Forwarder._sweep``); the same black-box tests hold both relays to
them (``tests/dataplane``, parametrized by ``relay_kind``).

Which relay runs: this one when the extension imports and ``KPX_NO_EXTENSIONS``
is unset or empty (aiohttp's convention); else ``Forwarder``, the pure-Python
relay, which CI also runs. ``make_forwarder`` chooses, once per dataplane.

Why the same thread as the event loop, not a thread of its own: measured both
(docs/PERFORMANCE.md, "The relay core"); on its own thread every decision
waits for the GIL, and every count and log line would cross threads, for no
gain in throughput.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import time
from collections.abc import Callable
from typing import Any

from proxy import metrics
from proxy.core.decision import Drop, Forward, decide
from proxy.userspace.forwarder import Forwarder, PortMetrics, _describe
from proxy.userspace.listener import Listener

log = logging.getLogger(__name__)

try:
    from proxy.userspace import _relaycore
except ImportError:  # not built (no compiler at install): the Python relay serves
    _relaycore = None  # type: ignore[assignment]

NO_EXTENSIONS_ENV = "KPX_NO_EXTENSIONS"
"""Set (non-empty) to run the pure-Python relay even where the core is built."""

_EXPIRED = {3: "established", 4: "close_wait"}
"""The core's ``why`` of an idle expiry, as ``kubeproxy_kpx_connections_expired_total``
labels it."""


def core_available() -> bool:
    """The compiled core is built and not turned off by ``KPX_NO_EXTENSIONS``."""
    return _relaycore is not None and not os.environ.get(NO_EXTENSIONS_ENV)


_told: list[str] = []
"""Which relay this process was told it runs: said once, not per dataplane."""


def make_forwarder(loop: asyncio.AbstractEventLoop, **kwargs: Any) -> Forwarder:
    """The relay this process runs: the compiled core's when it can (``core_available``)."""
    kind = "core" if core_available() else "python"
    if kind not in _told:
        _told.append(kind)
        if kind == "core":
            log.info("relay: the compiled core (proxy/userspace/_relaycore.c)")
        else:
            log.info("relay: pure Python (%s)", f"{NO_EXTENSIONS_ENV} is set"
                     if _relaycore is not None else "the relay core is not built")
    return CoreForwarder(loop, **kwargs) if kind == "core" else Forwarder(loop, **kwargs)


class _Live:
    """``Forwarder.active`` for the core: what the dataplane counts (``len``)."""

    __slots__ = ("fwd",)

    def __init__(self, fwd: CoreForwarder) -> None:
        self.fwd = fwd

    def __len__(self) -> int:
        core = self.fwd._core
        return core.live if core is not None else 0


class CoreAcceptSet:
    """The dataplane's listeners, accepted on by the core (``AcceptSet``'s interface)."""

    def __init__(self, fwd: CoreForwarder) -> None:
        self.fwd = fwd
        self._slots: dict[int, int] = {}

    def watch(self, fd: int, callback: Callable[[], None], listener: Listener | None = None
              ) -> None:
        """Accept on ``fd`` in the core, for ``listener``. Raises OSError."""
        assert listener is not None, "the core accepts itself: it needs the listener"
        flags = 0
        if listener.steered:
            flags |= _relaycore.LIS_STEERED
        if listener.refuse_loopback:
            flags |= _relaycore.LIS_REFUSE_LOOPBACK
        if listener.backing_off:
            flags |= _relaycore.LIS_BACKOFF
        self._slots[fd] = self.fwd.core().add_listener(fd, listener, flags)

    def unwatch(self, fd: int) -> None:
        """Stop accepting on ``fd``; call before closing it."""
        slot = self._slots.pop(fd, None)
        if slot is not None and self.fwd._core is not None:
            self.fwd._core.remove_listener(slot)

    def close(self) -> None:
        """Every listener must be closed already (the core is the forwarder's)."""
        self._slots.clear()


class CoreForwarder(Forwarder):
    """``Forwarder`` with its mechanics in ``_relaycore.Core`` (module doc)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, **kwargs: Any) -> None:
        super().__init__(loop, **kwargs)
        self.active = _Live(self)  # type: ignore[assignment]
        self._core: Any = None
        """Made on first use, so a Forwarder that never forwards holds no fd."""

    def core(self) -> Any:
        core = self._core
        if core is None:
            core = self._core = _relaycore.Core(
                self, self.connect_timeout, self.tcp_timeout_established,
                self.tcp_timeout_close_wait, self.sweep_interval, self.max_connections)
            self.loop.add_reader(core.fileno(), core.poll)
        return core

    def accept_set(self) -> CoreAcceptSet:
        return CoreAcceptSet(self)

    # -- decisions ---------------------------------------------------------------

    def _answer(self, key: object, ip: str, port: int, now: float) -> tuple[Any, ...] | None:
        """Decide one accepted client of ``key``'s plan: the core's answer (module doc)."""
        state = self.ports.get(key)
        if state is None:
            return None  # the listener is being closed by this very sync
        m = state.metrics
        m.accepted += 1
        if not m.dirty:
            self.touch(m)
        decision = decide(state.plan, ip, self.local_addresses, state.balancer, now, (),
                          self.cluster_cidrs)
        if type(decision) is Forward:
            m.active += 1
            addr = decision.endpoint.addr
            bind = None if decision.snat or not self.transparent else ip
            return (addr[0], addr[1], bind, key, m)
        # Drop reaches here only in the race where the SYN passed before the
        # filter went on; the handshake is done, so an RST is the nearest
        # thing to silence. Reject: no endpoint at all.
        if isinstance(decision, Drop):
            m.dropped += 1
        else:
            m.rejected += 1
        if log.isEnabledFor(logging.DEBUG):
            log.debug("%s: %s:%d reset: %s", state.plan.key, ip, port, decision.reason)
        return None

    def core_decide(self, batch: list[tuple[Any, str, int, str | None, int]]
                    ) -> list[tuple[Any, ...] | None]:
        """The clients one poll accepted: ``(listener, ip, port, local_ip, local_port)``."""
        now = time.monotonic()
        answer = self._answer
        return [
            None if lis is None
            else answer((lip, lport) if lip is not None else lis.port, ip, port, now)
            for lis, ip, port, lip, lport in batch
        ]

    def on_accept(self, csock: Any, addr: tuple[str, int], node_port: object) -> None:
        """A client accepted in Python (a listener outside the core, tests): the same
        decision, then the core relays it."""
        answer = self._answer(node_port, addr[0], addr[1], time.monotonic())
        self.core().take(csock.detach(), addr[0], addr[1], answer)

    def core_failed(self, batch: list[tuple[Any, ...]]) -> list[tuple[Any, Any]]:
        """Connects that failed: each decided again without what failed for it."""
        out: list[tuple[Any, Any]] = []
        now = time.monotonic()
        for key, m, failed, cip, cport, eip, eport, err, snat in batch:
            m.connect_failures += 1
            self.touch(m)
            why = _describe(TimeoutError() if err == errno.ETIMEDOUT
                            else OSError(err, os.strerror(err)))
            state = self.ports.get(key)
            plan_key = m.key
            self.warn(("connect", why, plan_key),
                      "%s: connect to endpoint %s:%d for client %s:%d failed (%s%s)",
                      plan_key, eip, eport, cip, cport, why, ", SNAT" if snat else "")
            if failed is None:
                failed = []
            failed.append((eip, eport))
            decision = None
            if state is not None:
                state.balancer.forget(cip)
                decision = decide(state.plan, cip, self.local_addresses, state.balancer, now,
                                  failed, self.cluster_cidrs)
            if isinstance(decision, Forward):
                addr = decision.endpoint.addr
                bind = None if decision.snat or not self.transparent else cip
                out.append((failed, (addr[0], addr[1], bind, key, m)))
                continue
            m.rejected += 1
            reason = decision.reason if decision is not None else "service port removed"
            self.warn(("reset", type(decision).__name__, plan_key),
                      "%s: client %s:%d reset: %s", plan_key, cip, cport, reason)
            out.append((failed, None))
        return out

    def core_finished(self, batch: list[tuple[Any, ...]]) -> None:
        """Connections that ended: ``(metrics, bytes_to_endpoint, bytes_to_client, why,
        client_ip, client_port, endpoint_ip, endpoint_port, idle)``."""
        touch = self.touch
        for m, up, down, why, cip, cport, eip, eport, idle in batch:
            m.active -= 1
            m.bytes_to_endpoint += up
            m.bytes_to_client += down
            if not m.dirty:
                touch(m)
            reason = _EXPIRED.get(why)
            if reason is not None:
                key = m.key
                metrics.CONNECTIONS_EXPIRED.labels(key, reason).inc()
                self.warn(
                    ("expired", reason, key),
                    "%s: connection of client %s:%d to endpoint %s:%d idle for %.0f s: reset"
                    " both sides (--conntrack-tcp-timeout-%s)",
                    key, cip, cport, eip, eport, idle, reason.replace("_", "-"),
                )
        self.connection_finished()

    def core_listener(self, listener: Listener, err: int) -> None:
        """0: at capacity (block it); -1: accepting again after a back-off; else an errno."""
        if err == 0:
            listener.block()
        elif err < 0:
            listener.accepting_again()
        else:
            listener.accept_failed(OSError(err, os.strerror(err)))

    def core_starved(self, m: PortMetrics, err: int) -> None:
        """No upstream socket for want of fds or memory: the client was reset."""
        m.rejected += 1
        self.touch(m)
        self.warn(("starved", m.key), "%s: a client was reset: no upstream socket (%s);"
                  " pausing accepts", m.key, os.strerror(err))
        self.starve()

    def core_error(self, what: str, exc: BaseException | None) -> None:
        """A call of the core's into Python raised (a bug): its connections were reset,
        the relay goes on. Logged with the traceback, rate-limited per call."""
        self.warn(("relay core", what), "relay core: %s failed; the connections it"
                  " concerned were reset", what, exc_info=exc)

    # -- admission and lifecycle -----------------------------------------------------

    def starve(self) -> None:
        super().starve()
        if self._core is not None:
            self._core.accepting = False

    def _unstarve(self) -> None:
        if self._core is not None:
            self._core.accepting = True  # a failed probe starves again (``starve``)
        super()._unstarve()

    def abort_all(self) -> int:
        """RST every live connection; returns how many there were."""
        n = self._core.abort_all() if self._core is not None else 0
        self.flush_metrics()
        return int(n)

    def linked(self) -> int:
        return int(self._core.linked) if self._core is not None else 0

    def connecting(self) -> int:
        return int(self._core.connecting) if self._core is not None else 0

    @property
    def sweeping(self) -> bool:
        return bool(self._core is not None and self._core.sweeping)

    def max_buffered(self) -> int:
        return int(self._core.max_buffered()) if self._core is not None else 0

    def close(self) -> None:
        """RST every live connection and release the core. Idempotent."""
        self.abort_all()
        for timer in (self._log_timer, self._starve_timer, self._flush_timer):
            if timer is not None:
                timer.cancel()
        self._log_timer = self._starve_timer = self._flush_timer = None
        self.flush_metrics()
        self.logs.flush(force=True)
        core, self._core = self._core, None
        if core is not None:
            self.loop.remove_reader(core.fileno())
            core.close()
