"""The healthz library wired the way kpx wires it, for tests that drive it with snapshots.

healthz takes plain data (``sync_services``, ``sync_endpoints``,
``ProxyHealth.sync_node``); the proxier's one sync computes that data from a
snapshot. These helpers put the real ``Proxier`` in between, so a test that
publishes or syncs a snapshot exercises exactly the path ``kpx node`` and
``kpx healthz`` take.

- ``start_sidecar(hub, node, nodeport_addresses=..., **sidecar_kw)``: a started
  ``Sidecar`` on ephemeral 127.0.0.1 ports, fed by a proxier following ``hub``.
- ``HealthChecks(node, health, nodeport_addresses)``: a started
  ``ServiceHealthServer`` whose ``sync(snapshot)`` is the proxier's sync.
- ``sample(name, **labels)``: a series' value in the process's registry (0 if absent).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from healthz.proxy_health import ProxyHealth
from healthz.registry import REGISTRY
from healthz.service_health import ServiceHealthServer
from healthz.sidecar import Sidecar
from proxy.core.addresses import parse_nodeport_addresses
from proxy.core.model import Snapshot
from proxy.core.sync import SyncConfig
from proxy.proxier import Proxier
from proxy.sources.hub import StateHub


def sample(name: str, **labels: str) -> float:
    """The value of one series in the registry ``/metrics`` serves; 0 if it has none yet."""
    return REGISTRY.get_sample_value(name, labels) or 0.0


def sync_config(node: str, nodeport_addresses: Sequence[object] | None = None) -> SyncConfig:
    """The proxier's settings for ``node``; addresses (IPs, CIDRs) as the flag takes them."""
    text = ",".join(map(str, nodeport_addresses or ()))
    return SyncConfig(node_name=node, nodeport_cidrs=tuple(parse_nodeport_addresses(text)))


async def start_sidecar(
    hub: StateHub,
    node: str = "node-a",
    *,
    nodeport_addresses: Sequence[object] | None = None,
    **kw: Any,
) -> Sidecar:
    """A started sidecar on ephemeral loopback ports, kept in step with ``hub``."""
    kw.setdefault("healthz_bind", ("127.0.0.1", 0))
    kw.setdefault("metrics_bind", ("127.0.0.1", 0))
    sidecar = Sidecar(hub.health, **kw)
    Proxier(
        sync_config(node, nodeport_addresses), services=sidecar.services, health=hub.health
    ).attach(hub)
    await sidecar.start()
    return sidecar


class HealthChecks:
    """A started ``ServiceHealthServer`` fed snapshot by snapshot through the proxier's sync."""

    def __init__(
        self,
        node: str,
        health: ProxyHealth,
        nodeport_addresses: Sequence[object] | None = None,
        **kw: Any,
    ) -> None:
        self.server = ServiceHealthServer(health, **kw)
        self.proxier = Proxier(
            sync_config(node, nodeport_addresses), services=self.server, health=health
        )
        self.server.start()

    def sync(self, snapshot: Snapshot) -> None:
        self.proxier.sync(snapshot)

    def serving(self) -> dict[str, list[tuple[str, int]]]:
        return self.server.serving()

    def failed(self) -> dict[str, str]:
        return self.server.failed()

    def local_endpoints(self, key: str) -> int | None:
        return self.server.local_endpoints(key)

    async def stop(self) -> None:
        await self.server.stop()

    async def wait_settled(self) -> None:
        await self.server.wait_settled()
