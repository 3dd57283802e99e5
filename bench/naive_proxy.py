"""The obvious Python baseline: an asyncio Streams copy loop, default event loop.

Owns: the naive contender's relay, one asyncio Streams copy loop per
direction, for each ``LISTEN=UPSTREAM`` pair given on the command line.

Never: use anything kpx uses to be fast (uvloop, Protocols, splice): it
would stop being the baseline.

This is what someone writes in ten minutes, so it shows how far kpx's design
(Protocols, uvloop, splice, precomputed tables) moves Python. It is naive in
speed only, not in correctness: it relays half-close (write_eof) and closes
both sides when both directions are done or either fails, because a version
that leaks half-closed pairs runs out of descriptors and crashes
(peers-and-ecosystem.md §2.2 pitfall 3) and would make the baseline unfair.

Usage: python -m bench.naive_proxy LISTEN_IP:PORT=UPSTREAM_IP:PORT [...]
"""

import asyncio
import sys


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


def _addr(text: str) -> tuple[str, int]:
    host, port = text.rsplit(":", 1)
    return host, int(port)


async def main(specs: list[str]) -> None:
    servers = []
    for spec in specs:
        listen, up = (_addr(x) for x in spec.split("="))
        servers.append(await asyncio.start_server(
            lambda r, w, up=up: handle(r, w, up), *listen, backlog=4096, reuse_address=True))
    print("naive proxy ready", flush=True)
    await asyncio.gather(*(s.serve_forever() for s in servers))


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1:]))
