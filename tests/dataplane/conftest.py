"""Fixtures for the dataplane tests.

In-process tests (see tests/support/loops.py) get both event loops and thread
backends; tests that need other namespaces use ``tests.support.netns.Topology``
and are marked ``lab``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from tests.support.backends import Server, start


@pytest.fixture(params=["uvloop", "asyncio"])
def loop_kind(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def backends() -> Iterator[Callable[..., Server]]:
    """Start scriptable backends in threads; all are stopped at teardown."""
    started: list[Server] = []

    def start_one(addr: str = "127.0.0.1", port: int = 0, name: str = "b") -> Server:
        srv = start(addr, port, name)
        started.append(srv)
        return srv

    yield start_one
    for srv in started:
        srv.stop()
