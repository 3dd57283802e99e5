"""The relay core's own edges: which relay runs, and a failing decision.

Everything a relay does is held to the black-box tests of tests/dataplane, run
against both relays (``relay_kind``); these are the things only the compiled
core's shell has: the choice of relay, and what a Python exception inside one of
its once-per-poll calls costs.
"""

from __future__ import annotations

import asyncio
import logging
import socket

import pytest

from lab.common import eventually
from proxy.userspace import corefwd, forwarder
from tests.support.loops import NODE_IP, free_port, peer_name, run_on, serving, snap, web


def test_the_relay_is_the_core_unless_told_otherwise(monkeypatch: pytest.MonkeyPatch) -> None:
    """Built (CI builds it), the compiled core relays; ``KPX_NO_EXTENSIONS`` set, the
    pure-Python relay does; an empty value is unset (aiohttp's convention)."""
    kinds: list[type] = []

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        for value in (None, "1", ""):
            if value is None:
                monkeypatch.delenv(corefwd.NO_EXTENSIONS_ENV, raising=False)
            else:
                monkeypatch.setenv(corefwd.NO_EXTENSIONS_ENV, value)
            fwd = corefwd.make_forwarder(loop)
            kinds.append(type(fwd))
            fwd.close()

    run_on("uvloop", scenario)
    assert kinds == [corefwd.CoreForwarder, forwarder.Forwarder, corefwd.CoreForwarder]


def test_a_decision_that_raises_resets_its_clients_and_the_relay_goes_on(
        backends, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A bug in a decision (an exception out of ``core_decide``) resets the clients of
    that poll, is logged with its traceback, and costs nothing else: the next client
    is served."""
    monkeypatch.delenv(corefwd.NO_EXTENSIONS_ENV, raising=False)
    be = backends()
    np_ = free_port()
    broken = [True]
    real = corefwd.CoreForwarder.core_decide

    def decide_once_broken(self: corefwd.CoreForwarder, batch: list) -> list:
        if broken[0]:
            broken[0] = False
            raise RuntimeError("a bug in a decision")
        return real(self, batch)

    monkeypatch.setattr(corefwd.CoreForwarder, "core_decide", decide_once_broken)

    def reset_or_answer() -> str:
        try:  # the reset may come before the handshake is seen done, or the request sent
            with socket.create_connection((NODE_IP, np_), timeout=3) as s:
                s.sendall(b"PEER\n")
                return s.recv(100).decode().split()[0]
        except (ConnectionResetError, BrokenPipeError):
            return "reset"

    async def scenario() -> None:
        async with serving(snap(*web(np_, be.port))) as dp:
            assert isinstance(dp.forwarder, corefwd.CoreForwarder)
            assert await asyncio.to_thread(reset_or_answer) == "reset"
            assert await asyncio.to_thread(peer_name, np_) == "b"
            # The core counts a connection's end at its next poll, not when the client sees it.
            await eventually(lambda: dp.active_connections() == 0, 2,
                             what="every connection to end")

    with caplog.at_level(logging.WARNING, logger="proxy.userspace.corefwd"):
        run_on("uvloop", scenario)
    (record,) = [r for r in caplog.records if "relay core" in r.getMessage()]
    assert "core_decide failed" in record.getMessage()
    assert record.exc_info is not None and "a bug in a decision" in str(record.exc_info[1])
