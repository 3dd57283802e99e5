"""The load balancer daemon: ``python -m lab.loadbalancer --config <run_dir>/lb.json``.

Owns: the process inside the LB namespace: one probe task per node, the
serving set and its dataplane (the nft table in passthrough mode, an asyncio
TCP relay with an optional PROXY header in proxy mode), the status file
``lb-status.json``, and reloading ``lb.json`` on SIGHUP.

A dual-stack lab's LB (``listen_ip6`` set) is two load balancers in one
process: the IPv4 one owns the IPv6 one (``LoadBalancer.v6``, built from
``LBConfig.for_ipv6``), which probes the nodes' IPv6 addresses on the same
ports, keeps its own verdicts and serving set, and forwards its own front
(the ``ip6 kpx_lb`` table, or a second relay). One status file holds both:
the IPv6 side under ``"ipv6"``; ``ready`` waits for both.

Never: pick its namespace (it runs where it is started: the LB namespace,
through ``ip netns exec``, or a test's loopback) or read anything of the lab
but its own config: the lab side (``lab.lb.control``) starts it, tells it
to reload and reads its status file.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import signal
import socket
import struct
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from lab.common import write_atomic
from lab.lb import nft
from lab.lb.config import Backend, LBConfig
from lab.lb.probe import probe_once
from lab.lb.rules import Health, describe_error, observe, proxy_header, serving

log = logging.getLogger("kpx.lb")


def now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


@dataclass(slots=True)
class NodeStatus:
    """What the LB knows about one node: its verdict, the last probe's answer, and when.

    ``since`` moves only when the verdict changes (what a cloud console shows
    as "healthy since"); ``checked`` on every probe.
    """

    backend: Backend
    health: Health = field(default_factory=Health)
    result: str = "pending"
    since: str = field(default_factory=now_iso)
    checked: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.backend.name,
            "ip": self.backend.ip,
            "healthy": self.health.healthy,
            "state": self.health.state,
            "result": self.result,
            "since": self.since,
            "checked": self.checked,
            "passes": self.health.passes,
            "fails": self.health.fails,
        }


class LoadBalancer:
    """The running LB: probe tasks, the serving set, and one of the two dataplanes."""

    def __init__(self, cfg: LBConfig, carry: Mapping[str, NodeStatus] | None = None,
                 carry6: Mapping[str, NodeStatus] | None = None,
                 parent: LoadBalancer | None = None) -> None:
        """*carry*: the previous incarnation's node states (a SIGHUP reload);
        *carry6* its IPv6 side's; *parent*: the IPv4 LB that owns this IPv6 one.

        A node keeps its verdict across a reload if its address and the probe
        are unchanged, so reconfiguring never re-opens the fail-open window
        of a cold start.
        """
        self.cfg = cfg
        self.nodes = {b.name: NodeStatus(b) for b in cfg.backends}
        for name, old in (carry or {}).items():
            if name in self.nodes and old.backend == self.nodes[name].backend:
                self.nodes[name] = dataclasses.replace(old)
        self.targets, self.fail_open = serving(
            cfg.backends, {n: st.health for n, st in self.nodes.items()}
        )
        self._rr = 0
        self._server: asyncio.Server | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._relays: set[asyncio.Task[None]] = set()
        self._nft_lock = asyncio.Lock()
        self.error: str | None = None
        self.started = now_iso()
        self.parent = parent
        cfg6 = cfg.for_ipv6()
        self.v6 = LoadBalancer(cfg6, carry6, parent=self) if cfg6 is not None else None

    @property
    def front_address(self) -> tuple[str, int]:
        """Where proxy mode actually listens (tests run it on port 0 on loopback)."""
        if self._server is not None and self._server.sockets:
            host, port = self._server.sockets[0].getsockname()[:2]
            return str(host), int(port)
        return self.cfg.listen_ip, self.cfg.port

    # -- status file

    def status_doc(self) -> dict[str, Any]:
        cfg = self.cfg
        host = f"[{cfg.listen_ip}]" if cfg.family == 6 else cfg.listen_ip
        front = f"{host}:{cfg.port}"
        doc = {
            "pid": os.getpid(),
            "running": True,
            "started": self.started,
            "updated": now_iso(),
            "service": cfg.service,
            "mode": cfg.mode,
            "proxyProtocol": cfg.proxy_protocol,
            "front": front,
            "nodePort": cfg.node_port,
            "probe": cfg.probe.describe(),
            "ready": all(n.health.state != "initial" for n in self.nodes.values()),
            "serving": [b.name for b in self.targets],
            "failOpen": self.fail_open,
            "error": self.error,
            "nodes": [n.as_dict() for n in self.nodes.values()],
        }
        if self.v6 is not None:
            six = self.v6.status_doc()
            doc["ipv6"] = {k: six[k] for k in ("front", "ready", "serving", "failOpen", "error",
                                               "nodes")}
            doc["ready"] = doc["ready"] and six["ready"]
            doc["error"] = doc["error"] or six["error"]
        return doc

    def write_status(self, running: bool = True) -> None:
        """Atomically replace the status file: a reader never sees half a JSON.

        The IPv6 side has no file of its own: its owner writes both families.
        """
        if self.parent is not None:
            self.parent.write_status(running)
            return
        doc = self.status_doc()
        doc["running"] = running
        write_atomic(self.cfg.status_path, json.dumps(doc, indent=2) + "\n")

    # -- dataplanes

    async def _apply_targets(self, first: bool = False) -> None:
        names = ", ".join(b.name for b in self.targets)
        why = " (fail open: no node passes)" if self.fail_open else ""
        log.info("serving set: %s%s", names, why)
        if self.cfg.mode != "passthrough":
            return
        script = (nft.nft_ruleset if first else nft.nft_update)(self.cfg, self.targets)
        async with self._nft_lock:
            try:
                await nft.run(script)
                self.error = None
            except (RuntimeError, OSError) as e:
                self.error = str(e)
                log.error("%s", e)

    def pick(self) -> Backend:
        """Proxy mode's round-robin over the current serving set."""
        targets = self.targets
        backend = targets[self._rr % len(targets)]
        self._rr += 1
        return backend

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One proxied connection: dial the next node, announce the client, relay.

        No retry on another node when the dial fails: a proxying cloud LB
        would, but then a dropped SYN on a podless node (the thing these labs
        exist to show) would be hidden behind a slow success. The client gets
        an RST instead, once ``connectTimeout`` has passed (or at once on a
        refusal).
        """
        backend = self.pick()
        peer = writer.get_extra_info("peername")
        front = writer.get_extra_info("sockname")
        try:
            async with asyncio.timeout(self.cfg.connect_timeout):
                up_reader, up_writer = await asyncio.open_connection(
                    backend.ip, self.cfg.node_port)
        except (OSError, TimeoutError) as e:
            log.info("%s:%s -> %s: %s", peer[0], peer[1], backend.name, describe_error(e))
            _reset(writer)
            return
        header = proxy_header(self.cfg.proxy_protocol, peer[:2], front[:2])
        if header:
            up_writer.write(header)
        await asyncio.gather(_pump(reader, up_writer), _pump(up_reader, writer))
        for w in (writer, up_writer):
            w.close()

    def _track(self, task: asyncio.Task[None]) -> None:
        self._relays.add(task)
        task.add_done_callback(self._relays.discard)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._track(task)
        try:
            await self._handle(reader, writer)
        except Exception:  # one broken relay must never take the LB down
            log.exception("relay failed")
            _reset(writer)

    # -- probing

    async def _probe_loop(self, node: NodeStatus, changed: asyncio.Event) -> None:
        probe = self.cfg.probe
        while True:
            started = time.monotonic()
            ok, text = await probe_once(probe, node.backend.ip)
            before = node.health
            node.health = observe(
                before, ok, probe.healthy_threshold, probe.unhealthy_threshold
            )
            node.checked = now_iso()
            if node.health.state != before.state:
                node.since = node.checked
                log.info(
                    "%s %s: %s -> %s (%s)",
                    node.backend.name, node.backend.ip, before.state, node.health.state, text,
                )
                changed.set()
            elif text != node.result:
                changed.set()
            node.result = text
            await asyncio.sleep(max(0.0, started + probe.interval - time.monotonic()))

    async def run(self, stop: asyncio.Event, reload: asyncio.Event | None = None) -> None:
        """Probe and serve until *stop* (final: the table goes) or *reload* is set.

        On a reload the nft table stays in place: the next incarnation's first
        ruleset replaces it in one transaction, so no packet sees a gap.
        """
        cfg = self.cfg
        log.info(
            "LB for %s: %s on %s:%s -> nodes:%s, probe %s every %.2fs (timeout %.2fs, "
            "healthy %d, unhealthy %d)",
            cfg.service, cfg.mode, cfg.listen_ip, cfg.port, cfg.node_port,
            cfg.probe.describe(), cfg.probe.interval, cfg.probe.timeout,
            cfg.probe.healthy_threshold, cfg.probe.unhealthy_threshold,
        )
        await self._apply_targets(first=True)
        if cfg.mode == "proxy":
            self._server = await asyncio.start_server(
                self._accept, cfg.listen_ip, cfg.port, reuse_address=True
            )
        self.write_status()
        changed = asyncio.Event()
        self._tasks = [
            asyncio.create_task(self._probe_loop(n, changed), name=f"probe-{n.backend.name}")
            for n in self.nodes.values()
        ]
        reload = reload or asyncio.Event()
        stoppers = {asyncio.create_task(stop.wait()), asyncio.create_task(reload.wait())}
        side = [asyncio.create_task(self.v6.run(stop, reload), name="ipv6")] if self.v6 else []
        try:
            while not stop.is_set() and not reload.is_set():
                waiter = asyncio.create_task(changed.wait())
                await asyncio.wait(
                    {waiter, *stoppers, *self._tasks, *side}, return_when=asyncio.FIRST_COMPLETED
                )
                waiter.cancel()
                for t in [*self._tasks, *side]:
                    if t.done() and not t.cancelled() and t.exception() is not None:
                        raise t.exception()  # type: ignore[misc]
                if changed.is_set():
                    changed.clear()
                    targets, fail_open = serving(
                        cfg.backends, {n: s.health for n, s in self.nodes.items()}
                    )
                    if targets != self.targets:
                        self.targets, self.fail_open = targets, fail_open
                        await self._apply_targets()
                    elif fail_open != self.fail_open:
                        # Same nodes, different reason (e.g. the last healthy node left
                        # and fail-open restored everyone): no rule change, so the
                        # round-robin position is kept.
                        self.fail_open = fail_open
                        log.info("fail open: %s", fail_open)
                    self.write_status()
        finally:
            for t in stoppers:
                t.cancel()
            if side and not side[0].done():
                side[0].cancel()
            await asyncio.gather(*side, return_exceptions=True)
            await self.close(final=stop.is_set() or not reload.is_set())

    async def close(self, final: bool = True) -> None:
        """Stop probing and accepting; *final* also ends relays and removes the table."""
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._server is not None:
            self._server.close()
        if not final:
            return  # established proxy relays finish on their own
        for t in list(self._relays):
            t.cancel()
        if self.cfg.mode == "passthrough":
            with contextlib.suppress(RuntimeError, OSError):
                await nft.run(nft.delete_table(self.cfg.family))
        if self.parent is None:
            with contextlib.suppress(OSError):
                self.write_status(running=False)


def _reset(writer: asyncio.StreamWriter) -> None:
    """Abort with RST (SO_LINGER 0): the client learns at once that nothing is behind."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Copy one direction until EOF, then pass the EOF on (half-close, not close).

    HTTP/1.0 clients and ``WHO`` style protocols send their request, shut
    down their write side and still expect the answer; closing both ways at
    the first EOF (as kube-proxy's old userspace proxy did) would cut it off.
    """
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except (OSError, RuntimeError):
        writer.transport.abort()


async def serve(config_path: Path) -> int:
    """The daemon: run, and on SIGHUP re-read *config_path* and carry on with it.

    A config that fails to load is logged and the running one stays, so a
    bad edit never takes the LB down.
    """
    loop = asyncio.get_running_loop()
    stop, reload = asyncio.Event(), asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGHUP, reload.set)
    cfg = LBConfig.from_json(config_path.read_text())
    carry: dict[str, NodeStatus] | None = None
    carry6: dict[str, NodeStatus] | None = None
    while True:
        lb = LoadBalancer(cfg, carry, carry6)
        await lb.run(stop, reload)
        if stop.is_set():
            break
        reload.clear()
        try:
            new = LBConfig.from_json(config_path.read_text())
        except (OSError, ValueError, TypeError, KeyError) as e:
            log.error("reload: cannot read %s (%s); keeping the running config", config_path, e)
            new = cfg
        # The resolved probe names its port, so a check on the nodePort changes
        # with it; a new nodePort alone keeps every verdict (no fail-open window).
        same_probe = new.probe == cfg.probe
        log.info("reload: %s", "config unchanged" if new == cfg else "new config")
        carry, cfg = (lb.nodes if same_probe else None), new
        carry6 = lb.v6.nodes if same_probe and lb.v6 is not None else None
    log.info("stopped")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m lab.loadbalancer",
        description="the kpx lab's external L4 load balancer (runs inside the LB namespace)",
    )
    parser.add_argument("--config", type=Path, required=True, help="lb.json written by start()")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s lb: %(message)s", stream=sys.stderr
    )
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a declared dependency
        return asyncio.run(serve(args.config))
    return uvloop.run(serve(args.config))
