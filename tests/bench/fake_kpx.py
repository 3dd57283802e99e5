"""A stand-in for ``kpx node`` that lets the harness's kpx paths be tested on their own.

Why: ``kpx node`` is developed concurrently; the bench must prove its own
kpx plumbing (state file rendering, start-up wait, apply timing, endpoint
convergence, idle CPU) independently of whether the real dataplane works
today. This reads the same state file with ``proxy.k8s.parse_state``, opens
one listener per NodePort on the node's InternalIP, forwards each new
connection to the first ready endpoint, and polls the file every 20 ms.
It is a test double, not a contender: slow and simple on purpose.

``--proxy-mode nfqueue`` stands in for kpx's other mode as the bench sees it
from outside: no listener, but kpx's nft table ``ip kpx_nfq`` with the set
``ports`` (the NodePorts) and ``vips`` (the clusterIPs) that ``bench.control``
reads, here with plain nft DNAT maps to the first ready endpoint instead of a
queue. The table is written whole once and changed in place after that, in
one transaction each, as kpx and kube-proxy do (``NftTable``). It is deleted
at SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time

from bench.naive_proxy import handle as relay
from proxy.k8s import StateError, parse_state
from proxy.util.nfttable import NftTable, elements

NFQ_TABLE = "kpx_nfq"


Routes = dict[int, tuple[str, int]]
VIPs = dict[tuple[str, int], tuple[str, int]]


def nfq_table(routes: Routes, vips: VIPs) -> NftTable:
    """kpx_nfq's table: the sets the bench reads and DNAT maps that act on them."""
    return NftTable.render("ip", NFQ_TABLE, [
        ("set", "ports", "type inet_service;", elements(str(p) for p in sorted(routes))),
        ("set", "vips", "type ipv4_addr;", elements(sorted({a for a, _ in vips}))),
        ("map", "np", "type inet_service : ipv4_addr . inet_service;",
         elements(f"{p} : {a} . {ap}" for p, (a, ap) in sorted(routes.items()))),
        ("map", "vip", "type ipv4_addr . inet_service : ipv4_addr . inet_service;",
         elements(f"{v} . {vp} : {a} . {ap}" for (v, vp), (a, ap) in sorted(vips.items()))),
        ("chain", "pre", "type nat hook prerouting priority dstnat; policy accept;",
         "    tcp dport @ports fib daddr type local dnat ip to tcp dport map @np\n"
         "    ip daddr @vips dnat ip to ip daddr . tcp dport map @vip\n"),
        ("chain", "post", "type nat hook postrouting priority srcnat; policy accept;",
         "    ct status dnat masquerade\n"),
    ])


class Fake:
    def __init__(self, state: str, node: str, mode: str = "userspace") -> None:
        self.state = state
        self.node = node
        self.mode = mode
        self.routes: dict[int, tuple[str, int]] = {}
        self.servers: dict[int, asyncio.AbstractServer] = {}
        self.key: tuple[int, int, int] | None = None
        self.written = False
        """nfqueue: the table is there, written by this process (a change need not replace it)."""

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
        routes: Routes = {}
        vips: VIPs = {}
        for svc in snap.services:
            for p in svc.ports:
                if not p.node_port and not svc.cluster_ip:
                    continue
                for sl in snap.slices_for(svc):
                    eps = [e for e in sl.endpoints if e.ready]
                    sp = next((x for x in sl.ports if x.name == p.name), None)
                    if eps and sp:
                        if p.node_port:
                            routes[p.node_port] = (eps[0].address, sp.port)
                        if svc.cluster_ip:
                            vips[(svc.cluster_ip, p.port)] = (eps[0].address, sp.port)
                        break
        if self.mode == "nfqueue":
            # Not check=True: a SIGTERM to the process group may kill nft mid-write;
            # the fake must still get to its cleanup.
            # Whole once, then in place: a nat table replaced whole now and then lets a
            # SYN through undecided (proxy.util.nfttable).
            table = nfq_table(routes, vips)
            script = table.in_place(table.names) if self.written else table.anew()
            cp = subprocess.run(["nft", "-f", "-"], input=script, text=True,
                                capture_output=True, check=False)
            if cp.returncode != 0:
                print(f"nft -f: {cp.stderr.strip()}", file=sys.stderr, flush=True)
                self.key = None  # try again on the next poll, whole
                self.written = False
                return
            self.written = True
            print(f"fake kpx (nfqueue) synced {len(routes)} NodePorts, {len(vips)} VIP ports "
                  f"in {(time.perf_counter() - t0) * 1000:.1f} ms", file=sys.stderr, flush=True)
            return
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
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        try:
            while not stop.is_set():
                with contextlib.suppress(FileNotFoundError):
                    await self.sync()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), 0.02)
        finally:
            if self.mode == "nfqueue":
                self.remove()

    def remove(self) -> None:
        """Delete kpx_nfq's table (a killed nft may have been mid-write: whatever is there)."""
        for _ in range(3):
            if subprocess.run(["nft", "-f", "-"], check=False, text=True,
                              input=f"table ip {NFQ_TABLE}\ndelete table ip {NFQ_TABLE}\n"
                              ).returncode == 0:
                return


def main() -> int:
    ap = argparse.ArgumentParser(prog="kpx")
    sub = ap.add_subparsers(dest="cmd", required=True)
    n = sub.add_parser("node")
    n.add_argument("--hostname-override", required=True)
    n.add_argument("--state", required=True)
    n.add_argument("--no-healthz", action="store_true")
    n.add_argument("--healthz-bind-address", default=None)
    n.add_argument("--metrics-bind-address", default=None)
    n.add_argument("--proxy-mode", choices=("userspace", "nfqueue"), default="userspace")
    a = ap.parse_args()
    asyncio.run(Fake(a.state, a.hostname_override, a.proxy_mode).run(a.healthz_bind_address))
    return 0


if __name__ == "__main__":
    sys.exit(main())
