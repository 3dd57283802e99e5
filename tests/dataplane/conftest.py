"""Fixtures for the dataplane tests.

In-process tests (see dploop.py) get both event loops and thread backends;
tests that need other namespaces use ``dpkit.Topology`` and are marked ``lab``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import dp_backend
import pytest


@pytest.fixture(params=["uvloop", "asyncio"])
def loop_kind(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def backends() -> Iterator[Callable[..., dp_backend.Server]]:
    """Start scriptable backends in threads; all are stopped at teardown."""
    started: list[dp_backend.Server] = []

    def start(addr: str = "127.0.0.1", port: int = 0, name: str = "b") -> dp_backend.Server:
        srv = dp_backend.start(addr, port, name)
        started.append(srv)
        return srv

    yield start
    for srv in started:
        srv.stop()
