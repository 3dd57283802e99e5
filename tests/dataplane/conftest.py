"""Fixtures for the dataplane tests.

In-process tests (see tests/support/loops.py) get both event loops and thread
backends; tests that need other namespaces use ``tests.support.netns.Topology``
and are marked ``lab``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from proxy.userspace import corefwd
from tests.support.backends import Server, start

RELAYS_ON_LOOPS = [("uvloop", "core"), ("uvloop", "python"), ("asyncio", "python")]
"""Both loops, both relays, but the core on uvloop only: it is one reader of the loop's
(``add_reader``), the same on both, while the Python relay's callbacks are the loop's."""


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """``loop_kind`` and ``relay_kind`` as a test asks for them (``RELAYS_ON_LOOPS``)."""
    own = {name.strip() for mark in metafunc.definition.iter_markers("parametrize")
           for name in (mark.args[0].split(",") if isinstance(mark.args[0], str)
                        else mark.args[0])}
    loop = "loop_kind" in metafunc.fixturenames and "loop_kind" not in own
    relay = "relay_kind" in metafunc.fixturenames
    if loop and relay:
        metafunc.parametrize(("loop_kind", "relay_kind"), RELAYS_ON_LOOPS, indirect=True)
    elif loop:
        metafunc.parametrize("loop_kind", ["uvloop", "asyncio"], indirect=True)
    elif relay:
        metafunc.parametrize("relay_kind", ["core", "python"], indirect=True)


@pytest.fixture
def loop_kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def relay_kind(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each relay in turn: the compiled core's (``proxy.userspace.corefwd``) and the
    pure-Python one it falls back to (``KPX_NO_EXTENSIONS``), in this process and in the
    kpx processes a test starts. The core must be built here (``pip install -e .``)."""
    if request.param == "python":
        monkeypatch.setenv(corefwd.NO_EXTENSIONS_ENV, "1")
    else:
        monkeypatch.delenv(corefwd.NO_EXTENSIONS_ENV, raising=False)
        assert corefwd.core_available(), "the relay core is not built (pip install -e .)"
    return str(request.param)


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
