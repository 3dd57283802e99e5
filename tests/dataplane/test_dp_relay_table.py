"""The relay's rule tables against the real relay, row by row.

``proxy.userspace.forwarder`` states its rules as data (``RELAY_RULES``,
``DIRECTION_RULES``) but branches instead of looking them up, so nothing
would notice if the code and the tables drifted apart. This file does:
every row has a scenario that drives a real ``Forwarder`` on a real loop
(both loops), with real sockets on loopback and the test holding both peers
(the client and the endpoint). A spy wraps every method the tables name
and, for each call, reads the phase (or direction state) before and after
it off the relay's fields, as ``RELAY_PHASES`` / ``DIRECTION_STATES``
define them, and tells which event the call was from what it did (its
result, whether it handed on to another ruled method, what it sent), never
from the phase it left behind. Every such record is checked against the
tables: an event the table lacks in that phase, another next phase or
another method fails. A row passes when its scenario drove it at least
once and the peers saw its action.

A row without a scenario fails, a scenario without a row fails, and so does
a relay caught in a state the tables do not name.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import select
import socket
import struct
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import pytest

from proxy.userspace import forwarder
from proxy.userspace.corefwd import NO_EXTENSIONS_ENV
from proxy.userspace.forwarder import (
    CONNECTING,
    DIRECTION_RULES,
    DIRECTION_STATES,
    LINKED,
    RELAY_PHASES,
    RELAY_RULES,
    Forwarder,
    Relay,
    Rule,
)
from tests.support.loops import one_port_forwarder, run_on

NODE_PORT = 30080
GOOD = "127.0.0.9"
"""An endpoint the test listens on (and accepts from)."""
BAD = "127.0.0.5"
"""An endpoint that refuses (nothing listens there), or hangs (``stuck``)."""
LINGER_RST = struct.pack("ii", 1, 0)

# -- observing the relay in the tables' terms ----------------------------------------



@pytest.fixture(autouse=True)
def python_relay(monkeypatch: pytest.MonkeyPatch) -> None:
    """The rows name the pure-Python relay's methods: it runs here, whatever is built
    (the compiled core is held to the same rules by the black-box tests, ``relay_kind``)."""
    monkeypatch.setenv(NO_EXTENSIONS_ENV, "1")

def relay_phase(fwd: Forwarder, relay: Relay) -> str:
    """``relay``'s phase as ``RELAY_PHASES`` defines it; "?" if its fields fit none."""
    cl, up = relay.client, relay.upstream
    if relay not in fwd.active:
        return "finished" if cl.closed and (up is None or up.closed) else "?"
    if relay.phase == CONNECTING:
        # The client is not watched at all until linked.
        watched = cl.mask or fwd._sides.get(cl.fd) is cl
        return "?" if watched else "connecting"
    if relay.phase == LINKED:
        return "linked" if up is not None else "?"
    return "?"


def direction_state(fwd: Forwarder, relay: Relay, a: Any, b: Any) -> str:
    """Direction ``a`` -> ``b`` as ``DIRECTION_STATES`` defines it.

    "finished" when the relay ended before the direction was done (a reset);
    "?" if the fields fit no state.
    """
    if a.eof:
        return "done" if b.shut or b.closed else "?"
    if relay not in fwd.active:
        return "finished"
    if b.out is not None:
        paused = not a.mask & select.EPOLLIN and b.mask & select.EPOLLOUT
        return "paused" if paused else "?"
    return "open" if a.mask & select.EPOLLIN else "?"


def both_done(fwd: Forwarder, relay: Relay) -> bool:
    cl, up = relay.client, relay.upstream
    return up is not None and all(
        direction_state(fwd, relay, a, b) == "done" for a, b in ((cl, up), (up, cl)))


# Which event of its table a call of each method was, told from what the call
# did (its result, whether it handed on to another ruled method, what it sent),
# not from the phase it left behind: that is what the rows are checked against.
# None: the call was no event of that method's (a guard, or handed on).
Call = dict[str, Any]
"""What the spy saw of one call: args, result, nested (calls of other ruled
methods inside it), depth (ruled calls it is inside of), out_before/out_after."""

RELAY_EVENTS: dict[str, Callable[[Forwarder, Relay, Call], str | None]] = {
    "Relay.connect_ready": lambda fwd, relay, call: None if call["nested"] else "connected",
    "Relay._connect_failed": lambda fwd, relay, call: (
        "connect failed, no endpoint left" if call["result"] is None
        else "connect failed, another endpoint eligible"),
    "Relay.abort": lambda fwd, relay, call: None if call["depth"] else "abort",
    "Relay._maybe_finish": lambda fwd, relay, call: (
        "both directions done" if call["both_done"] else None),
    "Relay.reset": lambda fwd, relay, call: "recv or send failed (RST, EPIPE, timeout)",
    "Relay.expire": lambda fwd, relay, call: "idle past its conntrack timeout",
}

DIRECTION_EVENTS: dict[str, Callable[[Call], str | None]] = {
    "_Side.on_event": lambda call: (
        "read, b takes it all" if call["read"] and not call["nested"] else None),
    "Relay.hold": lambda call: "read, b takes part or none",
    "Relay.eof": lambda call: "EOF read",
    "Relay.flush": lambda call: (
        None if call["nested"]
        else "b writable, takes all of b.out" if call["out_after"] == 0
        else "b writable, takes part" if call["out_after"] < call["out_before"]
        else None),
}

ENDS: dict[str, Callable[..., tuple[Any, Any]]] = {
    "_Side.on_event": lambda side, *_: (side, side.peer),
    "Relay.hold": lambda relay, a, b, *_: (a, b),
    "Relay.eof": lambda relay, a: (a, a.peer),
    "Relay.flush": lambda relay, b: (b.peer, b),
}
"""For each method in DIRECTION_RULES: which direction (a, b) a call acts on."""


def _out(side: Any) -> int:
    return 0 if side.out is None else len(side.out)


class Spy:
    """Wraps every method the tables name and records each call that was an event.

    A record is (table, method, phase before, event, phase after); ``wrong``
    collects every record that contradicts the tables, ``unnamed`` every
    state they do not name.
    """

    def __init__(self, monkeypatch: pytest.MonkeyPatch, fwd: Forwarder) -> None:
        self.fwd = fwd
        self.seen: set[tuple[str, str, str, str, str]] = set()
        self.wrong: list[str] = []
        self.unnamed: list[tuple[str, ...]] = []
        self.calls = 0
        """Calls of ruled methods other than ``_Side.on_event`` so far."""
        self.depth = 0
        """Ruled calls (other than ``_Side.on_event``) under way."""
        for table, rules in (("relay", RELAY_RULES), ("direction", DIRECTION_RULES)):
            for by in sorted({rule.by for rule in rules.values()}):
                cls_name, name = by.split(".")
                cls = getattr(forwarder, cls_name)
                wrap = self._relay_call if table == "relay" else self._direction_call
                monkeypatch.setattr(cls, name, wrap(by, getattr(cls, name)))

    def note(self, table: str, by: str, before: str, event: str | None, after: str) -> None:
        if "?" in (before, after):
            self.unnamed.append((table, by, before, after))
        if event is None:
            return
        self.seen.add((table, by, before, event, after))
        rule = ROWS.get((table, before, event))
        if rule is None:
            self.wrong.append(f"{by}: {event!r} in {before!r} is no row of the {table} table")
        elif (rule.by, rule.then) != (by, after):
            self.wrong.append(f"{table}: {before} x {event} -> {after!r} by {by}; the table says"
                              f" {rule.then!r} by {rule.by}")

    def _relay_call(self, by: str, orig: Callable[..., Any]) -> Callable[..., Any]:
        event_of = RELAY_EVENTS[by]  # a new relay method needs its entry in RELAY_EVENTS

        def call(relay: Relay, *args: Any, **kwargs: Any) -> Any:
            before = relay_phase(self.fwd, relay)
            seen: Call = {"depth": self.depth, "both_done": both_done(self.fwd, relay)}
            calls = self.calls
            self.calls += 1
            self.depth += 1
            try:
                seen["result"] = orig(relay, *args, **kwargs)
                return seen["result"]
            finally:
                self.depth -= 1
                seen["nested"] = self.calls - calls - 1
                if "result" in seen:
                    self.note("relay", by, before, event_of(self.fwd, relay, seen),
                              relay_phase(self.fwd, relay))
        return call

    def _direction_call(self, by: str, orig: Callable[..., Any]) -> Callable[..., Any]:
        event_of = DIRECTION_EVENTS[by]  # and a new direction method its entries here
        ends = ENDS[by]
        hot = by == "_Side.on_event"

        def call(obj: Any, *args: Any, **kwargs: Any) -> Any:
            relay = obj.relay if hot else obj
            if hot and (relay is None or relay.phase != LINKED or relay not in self.fwd.active):
                return orig(obj, *args, **kwargs)  # connecting: no direction yet
            a, b = ends(obj, *args)
            before = direction_state(self.fwd, relay, a, b)
            calls, nbytes, out_before = self.calls, a.nbytes, _out(b)
            if not hot:
                self.calls += 1
                self.depth += 1
            finished = False
            try:
                result = orig(obj, *args, **kwargs)
                finished = True
                return result
            finally:
                if not hot:
                    self.depth -= 1
                if finished:
                    seen: Call = {
                        "nested": self.calls - calls - (0 if hot else 1),
                        "read": a.nbytes > nbytes, "out_before": out_before, "out_after": _out(b),
                    }
                    self.note("direction", by, before, event_of(seen),
                              direction_state(self.fwd, relay, a, b))
        return call


# -- the rig: a Forwarder, a stand-in NodePort listener, an endpoint ---------------


class Rig:
    def __init__(self, fwd: Forwarder, spy: Spy, backend: socket.socket | None) -> None:
        self.loop = asyncio.get_running_loop()
        self.fwd = fwd
        self.spy = spy
        self.backend = backend
        self.nodeport = socket.create_server(("127.0.0.1", 0))
        self.socks: list[socket.socket] = [self.nodeport]

    def accept(self) -> tuple[socket.socket, Relay | None]:
        """A new client, handed to the forwarder as the listener would; its relay, if live."""
        c = socket.create_connection(self.nodeport.getsockname(), timeout=5)
        c.setblocking(False)
        self.socks.append(c)
        sock, addr = self.nodeport.accept()
        n = len(self.fwd.active)
        self.fwd.on_accept(sock, addr, NODE_PORT)
        relay = list(self.fwd.active)[-1] if len(self.fwd.active) > n else None
        return c, relay

    async def endpoint(self) -> socket.socket:
        """The endpoint's side of the next upstream connection."""
        assert self.backend is not None
        async with asyncio.timeout(5):
            s, _ = await self.loop.sock_accept(self.backend)
        s.setblocking(False)
        self.socks.append(s)
        return s

    async def link(self) -> tuple[socket.socket, socket.socket, Relay]:
        c, relay = self.accept()
        assert relay is not None
        s = await self.endpoint()
        await until(lambda: relay.phase == LINKED, "linked")
        return c, s, relay

    async def recv(self, s: socket.socket, n: int) -> bytes:
        buf = b""
        async with asyncio.timeout(5):
            while len(buf) < n:
                data = await self.loop.sock_recv(s, n - len(buf))
                if not data:
                    break
                buf += data
        return buf

    async def outcome(self, s: socket.socket, timeout: float = 5) -> str:
        """What the peer holding ``s`` sees next: "eof", "reset" or the data."""
        try:
            async with asyncio.timeout(timeout):
                data = await self.loop.sock_recv(s, 65536)
        except ConnectionResetError:
            return "reset"
        return "eof" if not data else f"data {data[:20]!r}"


async def until(pred: Callable[[], bool], what: str, timeout: float = 5) -> None:
    async with asyncio.timeout(timeout):
        while not pred():
            await asyncio.sleep(0.005)
    assert pred(), what


def _listener(addr: str, port: int = 0, rcvbuf: int = 0) -> socket.socket:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if rcvbuf:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)  # inherited by accepted
    s.bind((addr, port))
    s.listen(64)
    s.setblocking(False)
    return s


@contextlib.contextmanager
def _stuck(addr: str) -> Iterator[tuple[int, socket.socket]]:
    """A port on ``addr`` whose connects hang: its accept queue is full, SYNs are dropped."""
    lis = socket.socket()
    lis.bind((addr, 0))
    lis.listen(0)
    filler = socket.create_connection(lis.getsockname(), timeout=2)
    try:
        yield lis.getsockname()[1], lis
    finally:
        filler.close()
        lis.close()


@contextlib.asynccontextmanager
async def rig(
    monkeypatch: pytest.MonkeyPatch, *endpoints: str, stuck: bool = False,
    rcvbuf: int = 0, **fwd_kwargs: Any,
) -> AsyncIterator[Rig]:
    """A Forwarder whose one NodePort forwards to ``endpoints`` (``GOOD`` and/or ``BAD``)."""
    with contextlib.ExitStack() as stack:
        port = 0
        if stuck:
            port, _ = stack.enter_context(_stuck(BAD))
        backend = None
        if GOOD in endpoints:
            backend = _listener(GOOD, port, rcvbuf)
            stack.callback(backend.close)
            port = backend.getsockname()[1]
        if not port:
            probe = _listener(BAD)  # a free port: nothing listens there afterwards
            port = probe.getsockname()[1]
            probe.close()
        fwd = one_port_forwarder(NODE_PORT, port, *endpoints, **fwd_kwargs)
        r = Rig(fwd, Spy(monkeypatch, fwd), backend)
        try:
            yield r
        finally:
            fwd.close()
            for s in r.socks:
                s.close()


# -- one scenario (or more) per row ----------------------------------------------------

Scenario = Callable[[pytest.MonkeyPatch], Awaitable[Spy]]


async def link_talk_half_close(mp: pytest.MonkeyPatch) -> Spy:
    """connected; a read taken whole both ways; EOF each way; both done."""
    async with rig(mp, GOOD) as r:
        c, s, relay = await r.link()
        await r.loop.sock_sendall(c, b"ping")
        assert await r.recv(s, 4) == b"ping"
        c.shutdown(socket.SHUT_WR)
        assert await r.outcome(s) == "eof", "the client's FIN goes on to the endpoint"
        # Half-closed one way, the other still relays.
        await r.loop.sock_sendall(s, b"late")
        assert await r.recv(c, 4) == b"late"
        s.close()
        assert await r.outcome(c) == "eof", "the endpoint's FIN goes on to the client"
        await until(lambda: relay not in r.fwd.active, "finished")
        return r.spy


async def backpressure(mp: pytest.MonkeyPatch) -> Spy:
    """A slow path to the endpoint, which reads late: pause, partial flushes, resume."""
    async with rig(mp, GOOD, rcvbuf=4096) as r:
        c, s, relay = await r.link()
        up = relay.upstream
        assert up is not None
        # A small send buffer toward the endpoint (as on a slow path), so that
        # a flush of up to READ_SIZE is taken in parts.
        up.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 16384)
        block = os.urandom((1 << 20) + 7)  # not a multiple of any read size
        sent, want = 0, hashlib.sha256()

        # The kernel's buffers on the way (autotuned) take megabytes first.
        async with asyncio.timeout(10):
            while up.out is None:
                try:
                    k = c.send(block[sent % len(block):])
                except BlockingIOError:
                    await asyncio.sleep(0.001)
                    continue
                want.update(block[sent % len(block):][:k])
                sent += k
                await asyncio.sleep(0)
        n, got = 0, hashlib.sha256()
        async with asyncio.timeout(20):
            while n < sent:
                data = await r.loop.sock_recv(s, 65536)
                assert data, "EOF before everything arrived"
                n += len(data)
                got.update(data)
        assert n == sent and got.digest() == want.digest(), "nothing lost, nothing reordered"
        return r.spy


async def _retry(mp: pytest.MonkeyPatch, **rig_kwargs: Any) -> Spy:
    """Two connections: round-robin meets BAD within two, and each one ends at GOOD."""
    async with rig(mp, BAD, GOOD, **rig_kwargs) as r:
        for _ in range(2):
            c, s, relay = await r.link()
            await r.loop.sock_sendall(c, b"x")
            assert await r.recv(s, 1) == b"x"
            relay.abort()
        return r.spy


async def retry_refused(mp: pytest.MonkeyPatch) -> Spy:
    """BAD refuses: the connection moves on to GOOD."""
    return await _retry(mp)


async def retry_timed_out(mp: pytest.MonkeyPatch) -> Spy:
    """BAD hangs past the connect timeout: the connection moves on to GOOD."""
    return await _retry(mp, stuck=True, connect_timeout=0.2)


async def none_left(mp: pytest.MonkeyPatch) -> Spy:
    async with rig(mp, BAD) as r:
        c, _ = r.accept()
        assert await r.outcome(c) == "reset"
        await until(lambda: not r.fwd.active, "finished")
        return r.spy


async def abort_connecting(mp: pytest.MonkeyPatch) -> Spy:
    async with rig(mp, GOOD) as r:
        c, relay = r.accept()
        assert relay is not None and relay.phase == CONNECTING  # the loop has not run yet
        assert r.fwd.abort_all() == 1
        assert await r.outcome(c) == "reset"
        return r.spy


async def endpoint_resets(mp: pytest.MonkeyPatch) -> Spy:
    async with rig(mp, GOOD) as r:
        c, s, _ = await r.link()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, LINGER_RST)
        s.close()
        assert await r.outcome(c) == "reset"
        return r.spy


async def idle(mp: pytest.MonkeyPatch) -> Spy:
    async with rig(mp, GOOD, tcp_timeout_established=0.2, tcp_timeout_close_wait=0) as r:
        c, s, _ = await r.link()
        await r.loop.sock_sendall(c, b"x")
        assert await r.recv(s, 1) == b"x"
        assert await r.outcome(c) == "reset"
        assert await r.outcome(s) == "reset"
        return r.spy


async def abort_linked(mp: pytest.MonkeyPatch) -> Spy:
    async with rig(mp, GOOD) as r:
        c, s, _ = await r.link()
        assert r.fwd.abort_all() == 1
        assert await r.outcome(c) == "reset"
        assert await r.outcome(s) == "reset"
        return r.spy


SCENARIOS: dict[tuple[str, str, str], tuple[Scenario, ...]] = {
    ("relay", "connecting", "connected"): (link_talk_half_close,),
    ("relay", "connecting", "connect failed, another endpoint eligible"):
        (retry_refused, retry_timed_out),
    ("relay", "connecting", "connect failed, no endpoint left"): (none_left,),
    ("relay", "connecting", "abort"): (abort_connecting,),
    ("relay", "linked", "both directions done"): (link_talk_half_close,),
    ("relay", "linked", "recv or send failed (RST, EPIPE, timeout)"): (endpoint_resets,),
    ("relay", "linked", "idle past its conntrack timeout"): (idle,),
    ("relay", "linked", "abort"): (abort_linked,),
    ("direction", "open", "read, b takes it all"): (link_talk_half_close,),
    ("direction", "open", "read, b takes part or none"): (backpressure,),
    ("direction", "open", "EOF read"): (link_talk_half_close,),
    ("direction", "paused", "b writable, takes all of b.out"): (backpressure,),
    ("direction", "paused", "b writable, takes part"): (backpressure,),
}
"""Every row of both tables -> the scenarios that drive the relay through it."""

ROWS: dict[tuple[str, str, str], Rule] = {
    **{("relay", *key): rule for key, rule in RELAY_RULES.items()},
    **{("direction", *key): rule for key, rule in DIRECTION_RULES.items()},
}


def test_every_row_has_a_scenario_and_every_scenario_a_row() -> None:
    assert sorted(SCENARIOS) == sorted(ROWS)


def test_the_tables_name_only_defined_phases_and_real_methods() -> None:
    for key, rule in RELAY_RULES.items():
        assert {key[0], rule.then} <= set(RELAY_PHASES), key
    for key, rule in DIRECTION_RULES.items():
        assert {key[0], rule.then} <= set(DIRECTION_STATES), key
    for rule in ROWS.values():
        cls_name, name = rule.by.split(".")
        assert callable(getattr(getattr(forwarder, cls_name), name)), rule.by


@pytest.mark.parametrize(
    ("row", "scenario"),
    [(row, scenario) for row, scenarios in SCENARIOS.items() for scenario in scenarios],
    ids=lambda v: " x ".join(v) if isinstance(v, tuple) else v.__name__,
)
def test_the_relay_follows_the_row(
    loop_kind: str, monkeypatch: pytest.MonkeyPatch, row: tuple[str, str, str],
    scenario: Scenario,
) -> None:
    table, phase, event = row
    rule = ROWS[row]
    spies: list[Spy] = []

    async def main() -> None:
        spies.append(await scenario(monkeypatch))

    run_on(loop_kind, main)
    spy = spies[0]
    assert not spy.unnamed, f"states the tables do not name: {sorted(set(spy.unnamed))}"
    assert not spy.wrong, "\n".join(sorted(set(spy.wrong)))
    seen = sorted(s for s in spy.seen if s[1] == rule.by)
    assert (table, rule.by, phase, event, rule.then) in spy.seen, (
        f"the scenario never drove {phase} x {event}; {rule.by} did: {seen}")
