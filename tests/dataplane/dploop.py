"""In-process helpers for the dataplane tests (a unique name: importable from any test).

In-process tests run a Dataplane on loopback (127.0.0.0/8 is local in any
namespace, so nothing is routed and no firewall is touched), with
``transparent=False``, under both uvloop and the default asyncio loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import uvloop
from dpkit import state_yaml

from proxy.core.model import Snapshot
from proxy.k8s import parse_state
from proxy.userspace.dataplane import Dataplane

NODE = "n1"
NODE_IP = "127.0.0.2"
"""The in-process node's "node IP": a loopback alias, so it is always local."""


def free_port(addr: str = "127.0.0.1") -> int:
    s = socket.socket()
    try:
        s.bind((addr, 0))
        return s.getsockname()[1]
    finally:
        s.close()


def snap(*objs: dict[str, Any], generation: int = 1) -> Snapshot:
    return parse_state(state_yaml(*objs), generation)


def run_on(kind: str, fn: Callable[[], Awaitable[None]], timeout: float = 30.0) -> None:
    """Run ``fn()`` on a fresh uvloop or asyncio loop, bounded in time."""

    async def bounded() -> None:
        async with asyncio.timeout(timeout):
            await fn()

    if kind == "uvloop":
        uvloop.run(bounded())
    else:
        asyncio.run(bounded())


@contextlib.asynccontextmanager
async def serving(snapshot: Snapshot, **kwargs: Any) -> AsyncIterator[Dataplane]:
    """A Dataplane for ``NODE`` on the running loop, applied to ``snapshot``, always closed."""
    dp = Dataplane(NODE, loop=asyncio.get_running_loop(), **kwargs)
    try:
        dp.apply(snapshot)
        yield dp
    finally:
        dp.close()
