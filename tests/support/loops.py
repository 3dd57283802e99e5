"""In-process helpers for the dataplane tests: a Dataplane on the running loop.

In-process tests run a Dataplane on loopback (127.0.0.0/8 is local in any
namespace, so nothing is routed and no firewall is touched), with
``transparent=False``, under both uvloop and the default asyncio loop.

Owns: ``NODE``/``NODE_IP``, ``web`` (the one-service state most of these
tests serve), ``snap`` (objects -> Snapshot through kpx's parser),
``run_on`` (a fresh uvloop or asyncio loop), ``serving`` (a Dataplane
applied and always closed) and ``peer_name`` (who answers through a port).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import uvloop

from proxy.core.balancer import Balancer
from proxy.core.decision import build_plans
from proxy.core.model import Snapshot
from proxy.k8s import parse_state
from proxy.proxier import Proxier
from proxy.userspace.corefwd import make_forwarder
from proxy.userspace.dataplane import Dataplane
from proxy.userspace.forwarder import Forwarder, PortMetrics, PortState
from tests.support.netns import free_port as free_port
from tests.support.objects import endpoint, endpoint_slice, node, service, state_yaml
from tests.support.wiring import sync_config

NODE = "n1"
NODE_IP = "127.0.0.2"
"""The in-process node's "node IP": a loopback alias, so it is always local."""


def web(node_port: int, port: int, *ips: str, etp: str | None = None,
        affinity: int | None = None, ready: bool = True, ep_node: str = NODE,
        node_ips: tuple[str, ...] = (NODE_IP,)) -> tuple[dict[str, Any], ...]:
    """Node ``NODE`` and NodePort ``default/web`` -> ``port`` on each of ``ips`` (127.0.0.1).

    ``affinity``: ClientIP affinity timeout; ``ready=False``: the endpoints are
    neither ready nor serving (nor terminating).
    """
    conditions = {} if ready else {"ready": False, "serving": False, "terminating": False}
    return (
        node(NODE, *node_ips),
        service("web", node_port, port, etp=etp, affinity_seconds=affinity),
        endpoint_slice("web", *(endpoint(ip, ep_node, **conditions)
                                for ip in ips or ("127.0.0.1",)), port=port),
    )


def peer_name(port: int, addr: str = NODE_IP, timeout: float = 3.0) -> str:
    """The name of the backend that answers a PEER through ``addr:port``."""
    with socket.create_connection((addr, port), timeout=timeout) as s:
        s.sendall(b"PEER\n")
        return s.recv(100).decode().split()[0]


def snap(*objs: dict[str, Any], generation: int = 1) -> Snapshot:
    return parse_state(state_yaml(*objs), generation)


def one_port_forwarder(node_port: int, port: int, *ips: str, **kwargs: Any) -> Forwarder:
    """A Forwarder on the running loop whose one NodePort forwards to ``ips`` at ``port``
    (no listener: a test accepts and hands sockets to ``on_accept``); the relay this
    process runs (``make_forwarder``: see the ``relay_kind`` fixture)."""
    state = snap(node(NODE, NODE_IP), service("web", node_port, port),
                 endpoint_slice("web", *((ip, NODE) for ip in ips), port=port))
    plan = build_plans(state, NODE)[node_port]
    fwd = make_forwarder(asyncio.get_running_loop(), **kwargs)
    fwd.ports = {node_port: PortState(plan, Balancer(), PortMetrics(plan.key))}
    return fwd


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
async def syncing(
    snapshot: Snapshot, nodeport_cidrs: list[str] | None = None, **kwargs: Any
) -> AsyncIterator[Proxier]:
    """A proxier for ``NODE`` with a Dataplane on the running loop, synced to ``snapshot``.

    The dataplane (``.dataplane``) is always closed on the way out.
    """
    dp = Dataplane(loop=asyncio.get_running_loop(), **kwargs)
    px = Proxier(sync_config(NODE, nodeport_cidrs), dataplane=dp)
    try:
        px.sync(snapshot)
        yield px
    finally:
        dp.close()


@contextlib.asynccontextmanager
async def serving(
    snapshot: Snapshot, nodeport_cidrs: list[str] | None = None, **kwargs: Any
) -> AsyncIterator[Dataplane]:
    """A Dataplane for ``NODE`` on the running loop, synced to ``snapshot``, always closed."""
    async with syncing(snapshot, nodeport_cidrs, **kwargs) as px:
        assert isinstance(px.dataplane, Dataplane)
        yield px.dataplane
