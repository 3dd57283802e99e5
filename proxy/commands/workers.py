"""``kpx node --workers N``: several processes sharing the NodePorts.

Owns: forking the workers, passing signals on, restarting a worker that
dies, and the namespace-wide return-path routing that all workers share
(installed once here, so no worker's exit can remove it under the others;
worker 0 runs the sync-period guard that restores it, next to the health it
reports to). The namespace claim (``proxy.lifecycle.ownership``) is taken by
``kpx node`` before this runs: the workers inherit it, a second instance
fails before it could join their SO_REUSEPORT group, and SIGTERM hands the
namespace over once the workers' listeners are closed. The service VIPs'
ARP settings are set here too (``LocalVIPs.install``), their originals held
until every worker is gone, and the VIP listener's port reserved, so every
worker binds the same one into its reuseport group and the nft table they
each write steers to all of them. Unlike one process,
N workers pass no listening sockets on (each worker's sockets belong to its
reuseport group; a successor's would have to join it): a restart refuses
connections from the workers' close until the new instance listens, and a
``--workers`` successor of a single process asks it to close at once
(``Ownership.acquire(listeners=False)``) instead of waiting out its window.

Never: proxy a connection itself. Each worker is a complete ``kpx node``
(its own state source, plans and balancers) on SO_REUSEPORT listeners; the
kernel spreads connections over them. For ClientIP-affinity services the
listeners carry a reuseport program that picks the worker by client IP
(``synfilter.reuseport_steering_program``), so affinity holds across workers.
Only worker 0 runs the healthz sidecar, so its ports are bound once.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import socket
import time
from collections.abc import Callable

from proxy.lifecycle.ownership import Ownership
from proxy.userspace.transparent import RoutingConfig, TransparentRouting
from proxy.userspace.vips import LISTEN_ADDRESS, LocalVIPs

log = logging.getLogger(__name__)

RESTART_BACKOFF = 1.0
"""Seconds between restarts of a crashing worker, so a crash loop cannot spin."""


def supervise(args: argparse.Namespace, run_worker: Callable[[argparse.Namespace], int]) -> int:
    """Run ``args.workers`` forked workers until SIGTERM/SIGINT; exit 0 when all stopped."""
    ownership: Ownership | None = getattr(args, "ownership", None)
    routing: TransparentRouting | None = None
    routing6: TransparentRouting | None = None
    if not args.no_transparent:
        routing = TransparentRouting()
        if not routing.install():
            args.no_transparent = True
            routing = None
        else:
            # The IPv6 family's rule and route, for the workers' IPv6 dataplanes;
            # without them those SNAT (each worker checks IPV6_TRANSPARENT only).
            routing6 = TransparentRouting(RoutingConfig(family=6))
            if not routing6.install():
                args.no_transparent6 = True
                routing6 = None
    local_vips = LocalVIPs()
    try:
        local_vips.install()
    except (OSError, RuntimeError) as exc:
        log.warning("service VIPs: cannot set the ARP settings for the workers: %s", exc)
    # Bound, never listening: no connection lands on it, and the port stays
    # free for the workers' reuseport group only.
    reserved = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    reserved.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    reserved.bind((LISTEN_ADDRESS, 0))
    args.vip_port = reserved.getsockname()[1]
    children: dict[int, int] = {}
    stopping = False

    def spawn(index: int) -> None:
        pid = os.fork()
        if pid == 0:  # the worker
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                signal.signal(sig, signal.SIG_DFL)
            code = 1
            try:
                args.worker_index = index
                code = run_worker(args)
            except BaseException:
                log.exception("worker %d crashed", index)
            finally:
                os._exit(code)
        children[pid] = index
        log.info("worker %d started (pid %d)", index, pid)

    def forward(signum: int, _frame: object) -> None:
        nonlocal stopping
        if signum in (signal.SIGTERM, signal.SIGINT):
            stopping = True
            if ownership is not None:
                # The workers hold their own copies of the owner socket until
                # their listeners are closed; the name is free when they are.
                ownership.stopping()
                ownership.release()
        for pid in list(children):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM if signum == signal.SIGINT else signum)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, forward)
    try:
        for i in range(args.workers):
            spawn(i)
        while children:
            try:
                pid, status = os.wait()
            except ChildProcessError:
                break
            except InterruptedError:
                continue
            index = children.pop(pid, None)
            if index is None:
                continue
            code = os.waitstatus_to_exitcode(status)
            if stopping:
                log.info("worker %d (pid %d) exited with %d", index, pid, code)
                continue
            log.error("worker %d (pid %d) died with %d; restarting", index, pid, code)
            time.sleep(RESTART_BACKOFF)
            if not stopping:
                spawn(index)
    finally:
        for pid in list(children):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        reserved.close()
        try:
            local_vips.remove_all()
        except (OSError, RuntimeError) as exc:
            log.error("service VIPs: cannot remove them: %s", exc)
        if routing6 is not None:
            routing6.remove()
        if routing is not None:
            routing.remove()
    return 0
