"""A stand-in for ``kpx node`` that lets the harness's kpx paths be tested on their own.

Why: ``kpx node`` is developed concurrently; the bench must prove its own
kpx plumbing (state file rendering, start-up wait, apply timing, endpoint
convergence, idle CPU) independently of whether the real dataplane works
today. This reads the same state file with ``proxy.k8s.parse_state``, opens
one listener per NodePort on the node's InternalIP, forwards each new
connection to the first ready endpoint, and polls the file every 20 ms.
It is a test double, not a contender: slow and simple on purpose.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
import time

from bench.naive_proxy import handle as relay
from proxy.k8s import StateError, parse_state


class Fake:
    def __init__(self, state: str, node: str) -> None:
        self.state = state
        self.node = node
        self.routes: dict[int, tuple[str, int]] = {}
        self.servers: dict[int, asyncio.AbstractServer] = {}
        self.key: tuple[int, int, int] | None = None

    async def handle(self, port: int, cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        up = self.routes.get(port)
        if up is None:
            cw.transport.abort()
            return
        await relay(cr, cw, up)

    async def sync(self) -> None:
        st = os.stat(self.state)
        key = (st.st_ino, st.st_mtime_ns, st.st_size)
        if key == self.key:
            return
        self.key = key
        t0 = time.perf_counter()
        with open(self.state, encoding="utf-8") as f:
            try:
                snap = parse_state(f.read())
            except StateError as e:
                print(f"bad state: {e.problems[:3]}", file=sys.stderr, flush=True)
                return
        node = snap.node(self.node)
        ip = node.internal_ips[0] if node and node.internal_ips else "0.0.0.0"
        routes: dict[int, tuple[str, int]] = {}
        for svc in snap.services:
            for p in svc.ports:
                if not p.node_port:
                    continue
                for sl in snap.slices_for(svc):
                    eps = [e for e in sl.endpoints if e.ready]
                    sp = next((x for x in sl.ports if x.name == p.name), None)
                    if eps and sp:
                        routes[p.node_port] = (eps[0].address, sp.port)
                        break
        self.routes = routes
        for port in [p for p in self.servers if p not in routes]:
            self.servers.pop(port).close()
        for port in routes:
            if port not in self.servers:
                self.servers[port] = await asyncio.start_server(
                    lambda r, w, port=port: self.handle(port, r, w), ip, port,
                    reuse_address=True, backlog=1024)
        print(f"fake kpx synced {len(routes)} NodePorts in "
              f"{(time.perf_counter() - t0) * 1000:.1f} ms", file=sys.stderr, flush=True)

    async def healthz(self, bind: str) -> None:
        """A bare ``/healthz`` (200 once a state is loaded), for the stall workload's probes."""

        async def answer(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            with contextlib.suppress(OSError, asyncio.IncompleteReadError):
                await r.readuntil(b"\r\n\r\n")
                w.write(b"HTTP/1.0 200 OK\r\nContent-Length: 3\r\n\r\nok\n")
                await w.drain()
            w.close()

        host, _, port = bind.rpartition(":")
        await asyncio.start_server(answer, host, int(port), reuse_address=True)

    async def run(self, healthz: str | None = None) -> None:
        if healthz:
            await self.healthz(healthz)
        while True:
            with contextlib.suppress(FileNotFoundError):
                await self.sync()
            await asyncio.sleep(0.02)


def main() -> int:
    ap = argparse.ArgumentParser(prog="kpx")
    sub = ap.add_subparsers(dest="cmd", required=True)
    n = sub.add_parser("node")
    n.add_argument("--hostname-override", required=True)
    n.add_argument("--state", required=True)
    n.add_argument("--no-healthz", action="store_true")
    n.add_argument("--healthz-bind-address", default=None)
    n.add_argument("--metrics-bind-address", default=None)
    a = ap.parse_args()
    asyncio.run(Fake(a.state, a.hostname_override).run(a.healthz_bind_address))
    return 0


if __name__ == "__main__":
    sys.exit(main())
