"""``kpx healthz``: the healthz sidecar alone, as its own process.

Owns: the process shell of the sidecar form: flags (the same node flags as
``kpx node``), its own ``StateHub`` fed by its own source, the proxier's
one sync with no dataplane feeding a ``Sidecar``, the uvloop event loop, and
a clean exit 0 on SIGTERM/SIGINT.

Never: proxy traffic. In this form the health answers describe the state
as this process read it; ``kpx node`` runs the same sync and ``Sidecar``
beside its dataplane instead, which is the form that can never disagree with
the dataplane.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal

from healthz.proxy_health import ProxyHealth
from healthz.sidecar import Sidecar
from proxy.commands.node import add_node_flags, source_config
from proxy.commands.wiring import make_source, run_on_uvloop, start_source, sync_config
from proxy.proxier import Proxier
from proxy.sources.hub import StateHub
from proxy.sources.kubeconfig import KubeConfigError

log = logging.getLogger(__name__)


def configure(parser: argparse.ArgumentParser) -> None:
    add_node_flags(parser)


async def serve(args: argparse.Namespace) -> int:
    """Run until SIGTERM or SIGINT, then close every port and return 0."""
    loop = asyncio.get_running_loop()
    hub = StateHub(ProxyHealth(timeout=2 * args.sync_period))
    sidecar = Sidecar.from_flags(hub.health, args)
    try:
        api = source_config(args)
        source = make_source(args, hub, None if api is None else api())
    except KubeConfigError as e:
        log.error("%s", e)
        return 2
    proxier = Proxier(sync_config(args), services=sidecar.services, health=hub.health)
    proxier.attach(hub)
    await sidecar.start()

    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGHUP, source.reload)

    log.info("kpx healthz %s starting (state from %s)", args.hostname_override,
             args.state or "the Kubernetes API")
    watcher = await start_source(source, args.sync_period)
    stopper = asyncio.create_task(stop.wait(), name="stop-signal")
    await asyncio.wait({watcher, stopper}, return_when=asyncio.FIRST_COMPLETED)
    if watcher.done() and not watcher.cancelled() and watcher.exception() is not None:
        log.error("state source died", exc_info=watcher.exception())

    source.stop()
    proxier.detach(hub)
    await sidecar.stop()
    for task in (watcher, stopper):
        task.cancel()
    await asyncio.gather(watcher, stopper, return_exceptions=True)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        loop.remove_signal_handler(sig)
    log.info("kpx healthz %s stopped", args.hostname_override)
    return 0


def run(args: argparse.Namespace) -> int:
    return run_on_uvloop(serve(args))
