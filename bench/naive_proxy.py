"""The obvious Python baseline: an asyncio Streams copy loop, default event loop.

Owns: the naive contender's relay, one asyncio Streams copy loop per
direction, for each ``LISTEN=UPSTREAM`` pair given on the command line, and
a DatagramProtocol relay for each ``udp:LISTEN=UPSTREAM`` pair.

Never: use anything kpx uses to be fast (uvloop, Protocols for TCP, splice,
batched datagram I/O): it would stop being the baseline.

This is what someone writes in ten minutes, so it shows how far kpx's design
(Protocols, uvloop, splice, precomputed tables) moves Python. It is naive in
speed only, not in correctness: it relays half-close (write_eof) and closes
both sides when both directions are done or either fails, because a version
that leaks half-closed pairs runs out of descriptors and crashes
(peers-and-ecosystem.md §2.2 pitfall 3) and would make the baseline unfair.

UDP (``udp:`` before a pair) is the same ten minutes with asyncio's
DatagramProtocol: one upstream socket per client address (so replies find
their way back and the backend sees one peer per flow, as with a conntrack
entry), datagrams queued while that socket is being made, and sessions idle
for ``UDP_IDLE`` seconds closed so sockets stay bounded. Naive, again, in
speed only: a datagram per callback, no batching, default loop. (asyncio has
no Streams API for UDP: a DatagramProtocol is what anyone writes.)

Usage: python -m bench.naive_proxy [udp:]LISTEN_IP:PORT=UPSTREAM_IP:PORT [...]
"""

from __future__ import annotations

import asyncio
import sys
import time
from typing import Any

UDP_IDLE = 30.0
UDP_QUEUE = 64
"""Datagrams held per new session while its upstream socket is made; more are dropped."""


async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except OSError:
        writer.transport.abort()


async def handle(cr: asyncio.StreamReader, cw: asyncio.StreamWriter, up: tuple[str, int]) -> None:
    try:
        ur, uw = await asyncio.open_connection(*up)
    except OSError:
        cw.transport.abort()
        return
    await asyncio.gather(pipe(cr, uw), pipe(ur, cw))
    uw.close()
    cw.close()


class UdpUpstream(asyncio.DatagramProtocol):
    """One client's upstream socket: replies go back to that client via the listener."""

    def __init__(self, front: UdpFront, client: tuple[str, int]) -> None:
        self.front = front
        self.client = client
        self.transport: Any = None
        self.queue: list[bytes] = []
        self.used = time.monotonic()

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        for data in self.queue:
            transport.sendto(data)
        self.queue.clear()

    def datagram_received(self, data: bytes, addr: Any) -> None:
        self.used = time.monotonic()
        if self.front.transport is not None:
            self.front.transport.sendto(data, self.client)

    def error_received(self, exc: Exception) -> None:
        pass  # ICMP from the backend: UDP loses the datagram, the client retries

    def send(self, data: bytes) -> None:
        self.used = time.monotonic()
        if self.transport is not None:
            self.transport.sendto(data)
        elif len(self.queue) < UDP_QUEUE:
            self.queue.append(data)


class UdpFront(asyncio.DatagramProtocol):
    """The listening socket: a session (upstream socket) per client address."""

    def __init__(self, up: tuple[str, int]) -> None:
        self.up = up
        self.transport: Any = None
        self.sessions: dict[tuple[str, int], UdpUpstream] = {}
        self.opening: set[asyncio.Task[None]] = set()

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def datagram_received(self, data: bytes, addr: Any) -> None:
        s = self.sessions.get(addr)
        if s is None:
            s = self.sessions[addr] = UdpUpstream(self, addr)
            task = asyncio.get_running_loop().create_task(self._open(s))
            self.opening.add(task)
            task.add_done_callback(self.opening.discard)
        s.send(data)

    async def _open(self, s: UdpUpstream) -> None:
        try:
            await asyncio.get_running_loop().create_datagram_endpoint(
                lambda: s, remote_addr=self.up)
        except OSError:
            self.sessions.pop(s.client, None)

    async def expire(self) -> None:
        """Close sessions idle for UDP_IDLE seconds: sockets stay bounded."""
        while True:
            await asyncio.sleep(UDP_IDLE / 3)
            cutoff = time.monotonic() - UDP_IDLE
            for addr, s in list(self.sessions.items()):
                if s.used < cutoff and s.transport is not None:
                    s.transport.close()
                    del self.sessions[addr]


def _addr(text: str) -> tuple[str, int]:
    """``ip:port`` or ``[ipv6]:port`` (an IPv6 run's fronts and backends)."""
    host, port = text.rsplit(":", 1)
    return host.removeprefix("[").removesuffix("]"), int(port)


async def main(specs: list[str]) -> None:
    servers = []
    tasks = []
    loop = asyncio.get_running_loop()
    for spec in specs:
        udp = spec.startswith("udp:")
        listen, up = (_addr(x) for x in spec.removeprefix("udp:").split("="))
        if udp:
            front = UdpFront(up)
            await loop.create_datagram_endpoint(lambda front=front: front, local_addr=listen)
            tasks.append(front.expire())
            continue
        servers.append(await asyncio.start_server(
            lambda r, w, up=up: handle(r, w, up), *listen, backlog=4096, reuse_address=True))
    print("naive proxy ready", flush=True)
    await asyncio.gather(*(s.serve_forever() for s in servers), *tasks)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1:]))
