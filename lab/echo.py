"""The pod server: says which pod answered and which peer address it saw.

Run as ``python -m lab.echo --name web-1 --node node1 --port 8080``.

Owns: one TCP server whose protocol is chosen by the client's first line,
and one UDP server on the same port number, so one process covers every lab
test (and the bench's UDP backend). TCP:

- an HTTP/1.x request line (``GET / HTTP/1.1``): HTTP with keep-alive.
  ``/clientip`` answers ``ip:port`` as text (as agnhost netexec does),
  ``/hostname`` the pod name, ``/echo?msg=x`` echoes *x*, anything else a
  JSON object ``{"pod", "node", "peer"}``. Works with curl.
- ``WHO\\n``: one JSON line ``{"pod", "node", "peer"}`` then close.
- ``ECHO\\n``: every following byte back until EOF, then a half-close.
  Flow-controlled (``drain``), so it sustains any volume in bounded memory.
- ``SINK\\n``: read to EOF, then one JSON line with ``bytes`` and ``sha256``.
  This is the half-close test: the reply can only arrive if the proxy
  forwarded the client's FIN *and* kept the other direction open.
- ``HOLD\\n``: one JSON line, then never read again. Data the client sends
  afterwards stays in the kernel's receive queue, so a SIGKILL of this
  process makes the kernel answer with RST (the reset-propagation test).

A PROXY protocol v1 or v2 header before the first line (sent by a proxying
load balancer) is parsed and its source reported as ``"proxy"``, while
``"peer"`` stays the TCP peer the kernel shows.

UDP: one reply datagram per request datagram, to the sender's address:

- empty, or starting with ``WHO``: one JSON object
  ``{"pod", "node", "peer": "ip:port", "proto": "udp"}``, where ``peer`` is
  the source address of the request as the kernel shows it (a SNATing proxy's
  address, or the client's when the path keeps it);
- starting with ``ECHO `` (with the space): the rest of the datagram, the
  bytes after that 5-byte prefix, verbatim, so a test checks payload
  integrity datagram by datagram;
- anything else: the datagram unchanged. A plain echo is what a bench or a
  DNS-like probe needs: it answers whatever it sends, at any size.

Both families: ``--bind`` may be given twice (``--bind 0.0.0.0 --bind ::``,
what a dual-stack lab's pods run), and each address gets its own TCP and
UDP sockets, the IPv6 ones ``IPV6_V6ONLY`` so the two never fight over the
port. ``peer`` has the same ``ip:port`` shape in both families
(``fd00:79::100:40312``: the address is everything before the last colon,
so a test's ``peer.rsplit(":", 1)[0]`` works for either).

Replies leave from the port the request came to. Their source address is
the route's choice, so a pod with several addresses bound to ``0.0.0.0``
may answer from another one than was asked (and a connected client drops
the reply): bind ``--bind`` to the one address in that case, as the bench
does. An ICMP error caused by an earlier reply (the client already gone) is
ignored: UDP has no connection to tear down.

Never: import anything but the standard library and uvloop (not the rest of
the lab, not pyroute2 or YAML): it runs once per pod, inside the pod's
namespace, and must start fast.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import ipaddress
import json
import signal
import socket
import struct
import sys
from typing import Any, cast
from urllib.parse import parse_qs, urlsplit

CHUNK = 256 * 1024
LINE_LIMIT = 64 * 1024
HOLD_SECONDS = 3600
PROXY_V2_SIG = b"\r\n\r\n\x00\r\nQUIT\n"
HTTP_METHODS = (b"GET", b"HEAD", b"POST", b"PUT", b"DELETE", b"OPTIONS", b"PATCH")


def _addr(sockaddr: Any) -> str:
    if not sockaddr:
        return ""
    return f"{sockaddr[0]}:{sockaddr[1]}"


class EchoServer:
    def __init__(self, pod: str, node: str) -> None:
        self.pod = pod
        self.node = node

    def identity(self, peer: str, proxy: str | None) -> dict[str, Any]:
        d: dict[str, Any] = {"pod": self.pod, "node": self.node, "peer": peer}
        if proxy:
            d["proxy"] = proxy
        return d

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = _addr(writer.get_extra_info("peername"))
        try:
            await self._dispatch(reader, writer, peer)
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError,
                ValueError):
            pass
        finally:
            with contextlib.suppress(Exception):
                writer.close()

    async def _dispatch(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                        peer: str) -> None:
        proxy = None
        line = await reader.readuntil(b"\n")
        if line.startswith(b"PROXY "):
            proxy = _parse_proxy_v1(line)
            line = await reader.readuntil(b"\n")
        elif line == b"\r\n":
            rest = await reader.readexactly(len(PROXY_V2_SIG) - 2)
            if line + rest != PROXY_V2_SIG:
                raise ValueError("not a PROXY v2 header")
            proxy = await _read_proxy_v2(reader)
            line = await reader.readuntil(b"\n")
        cmd = line.rstrip(b"\r\n")
        if cmd == b"WHO":
            await self._reply_line(writer, self.identity(peer, proxy))
        elif cmd == b"ECHO":
            await self._echo(reader, writer)
        elif cmd == b"SINK":
            await self._sink(reader, writer, peer, proxy)
        elif cmd == b"HOLD":
            await self._hold(writer, peer, proxy)
        elif cmd.split(b" ", 1)[0] in HTTP_METHODS and b" HTTP/1." in cmd:
            await self._http(reader, writer, peer, proxy, line)
        else:
            await self._reply_line(writer, {"error": "unknown request", "pod": self.pod})

    async def _reply_line(self, writer: asyncio.StreamWriter, obj: dict[str, Any]) -> None:
        writer.write(json.dumps(obj).encode() + b"\n")
        await writer.drain()

    async def _echo(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            data = await reader.read(CHUNK)
            if not data:
                break
            writer.write(data)
            await writer.drain()  # a slow client pauses us: bounded memory
        if writer.can_write_eof():
            writer.write_eof()
        await writer.drain()

    async def _sink(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, peer: str,
                    proxy: str | None) -> None:
        digest = hashlib.sha256()
        total = 0
        while True:
            data = await reader.read(CHUNK)
            if not data:
                break
            total += len(data)
            digest.update(data)
        reply = self.identity(peer, proxy)
        reply.update(bytes=total, sha256=digest.hexdigest())
        await self._reply_line(writer, reply)

    async def _hold(self, writer: asyncio.StreamWriter, peer: str, proxy: str | None) -> None:
        # Stop reading at the transport: later bytes stay in the kernel queue,
        # which is what turns our death into an RST rather than a FIN.
        writer.transport.pause_reading()
        await self._reply_line(writer, self.identity(peer, proxy))
        for _ in range(HOLD_SECONDS):
            if writer.transport.is_closing():
                return
            await asyncio.sleep(1)

    async def _http(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, peer: str,
                    proxy: str | None, line: bytes) -> None:
        while True:
            method, target, version = line.decode("latin-1").rstrip("\r\n").split(" ", 2)
            headers: dict[str, str] = {}
            while True:
                h = await reader.readuntil(b"\n")
                if h in (b"\r\n", b"\n"):
                    break
                k, _, v = h.decode("latin-1").partition(":")
                headers[k.strip().lower()] = v.strip()
            length = int(headers.get("content-length", "0") or 0)
            body = await reader.readexactly(length) if length else b""
            status, ctype, payload = self._route(method, target, peer, proxy, body)
            conn = headers.get("connection", "").lower()
            keep = (version == "HTTP/1.1" and conn != "close") or (
                version == "HTTP/1.0" and conn == "keep-alive")
            head = (f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\n"
                    f"Content-Length: {len(payload)}\r\n"
                    f"Connection: {'keep-alive' if keep else 'close'}\r\n\r\n").encode()
            writer.write(head if method == "HEAD" else head + payload)
            await writer.drain()
            if not keep:
                return
            try:
                line = await reader.readuntil(b"\n")
            except asyncio.IncompleteReadError:
                return

    def _route(self, method: str, target: str, peer: str, proxy: str | None,
               body: bytes) -> tuple[str, str, bytes]:
        url = urlsplit(target)
        if url.path == "/clientip":
            return "200 OK", "text/plain", peer.encode()
        if url.path == "/hostname":
            return "200 OK", "text/plain", self.pod.encode()
        if url.path == "/echo":
            msg = parse_qs(url.query).get("msg", [""])[0]
            return "200 OK", "text/plain", msg.encode() if method != "POST" else body
        reply = self.identity(peer, proxy)
        reply.update(method=method, path=url.path)
        return "200 OK", "application/json", json.dumps(reply).encode() + b"\n"


class EchoDatagrams(asyncio.DatagramProtocol):
    """The UDP side: one reply per datagram, computed by ``udp_reply``."""

    def __init__(self, server: EchoServer) -> None:
        self.server = server
        self.transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # Not an isinstance check: uvloop's UDPTransport does not subclass
        # asyncio.DatagramTransport, it only has its methods.
        self.transport = cast(asyncio.DatagramTransport, transport)

    def datagram_received(self, data: bytes, addr: Any) -> None:
        if self.transport is not None:
            self.transport.sendto(udp_reply(self.server, data, addr), addr)

    def error_received(self, exc: Exception) -> None:
        # ICMP port unreachable for an earlier reply: that client is gone, and
        # a UDP server has nothing to clean up for it.
        pass


def udp_reply(server: EchoServer, data: bytes, addr: Any) -> bytes:
    """The reply datagram to ``data`` from ``addr`` (see the module docstring)."""
    if not data or data.startswith(b"WHO"):
        reply = server.identity(_addr(addr), None)
        reply["proto"] = "udp"
        return json.dumps(reply).encode() + b"\n"
    if data.startswith(b"ECHO "):
        return data[5:]
    return data


def _parse_proxy_v1(line: bytes) -> str | None:
    # PROXY TCP4 <src> <dst> <sport> <dport>\r\n  |  PROXY UNKNOWN\r\n
    parts = line.decode("ascii").split()
    if len(parts) == 6 and parts[1] in ("TCP4", "TCP6"):
        ipaddress.ip_address(parts[2])
        return f"{parts[2]}:{int(parts[4])}"
    if len(parts) >= 2 and parts[1] == "UNKNOWN":
        return None
    raise ValueError("bad PROXY v1 header")


async def _read_proxy_v2(reader: asyncio.StreamReader) -> str | None:
    ver_cmd, fam, length = struct.unpack("!BBH", await reader.readexactly(4))
    data = await reader.readexactly(length)
    if ver_cmd >> 4 != 2:
        raise ValueError("bad PROXY v2 version")
    if ver_cmd & 0xF == 0:  # LOCAL: health check from the proxy itself
        return None
    if fam >> 4 == 1 and len(data) >= 12:
        src = socket.inet_ntop(socket.AF_INET, data[0:4])
        return f"{src}:{struct.unpack('!H', data[8:10])[0]}"
    if fam >> 4 == 2 and len(data) >= 36:
        src = socket.inet_ntop(socket.AF_INET6, data[0:16])
        return f"[{src}]:{struct.unpack('!H', data[32:34])[0]}"
    return None


def _bound(host: str, port: int, kind: int) -> socket.socket:
    """A socket of *kind* bound to host:port; an IPv6 one is IPV6_V6ONLY.

    Made here rather than by asyncio so that ``0.0.0.0`` and ``::`` can share
    a port number whatever the event loop's defaults for dual-stack sockets.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    s = socket.socket(family, kind)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        s.bind((host, port))
    except BaseException:
        s.close()
        raise
    s.setblocking(False)
    return s


async def serve(pod: str, node: str, hosts: list[str] | str, port: int) -> None:
    server = EchoServer(pod, node)
    loop = asyncio.get_running_loop()
    hosts = [hosts] if isinstance(hosts, str) else hosts
    servers: list[asyncio.Server] = []
    udps: list[asyncio.BaseTransport] = []
    for host in hosts:
        servers.append(await asyncio.start_server(
            server.handle, sock=_bound(host, port, socket.SOCK_STREAM), limit=LINE_LIMIT,
            backlog=1024))
        # The same port number for UDP: a Service port and its targetPort are
        # numbers, and kube-dns style services carry 53/TCP and 53/UDP together.
        udp, _ = await loop.create_datagram_endpoint(
            lambda: EchoDatagrams(server), sock=_bound(host, port, socket.SOCK_DGRAM))
        udps.append(udp)
    where = ", ".join(f"[{h}]:{port}" if ":" in h else f"{h}:{port}" for h in hosts)
    print(f"echo: pod {pod} on {node} listening on {where} (tcp, udp)", flush=True)
    stop = loop.create_future()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda: stop.done() or stop.set_result(None))
    try:
        await stop
    finally:
        for srv in servers:
            srv.close()
        for udp in udps:
            udp.close()
    print("echo: stopped", flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m lab.echo", description=__doc__.split("\n")[0])
    ap.add_argument("--name", required=True, help="pod name to report")
    ap.add_argument("--node", default="", help="node name to report")
    ap.add_argument("--port", type=int, default=8080)
    ap.add_argument("--bind", action="append", default=[],
                    help="address to listen on (repeatable: 0.0.0.0 and :: for both families;"
                         " default 0.0.0.0)")
    args = ap.parse_args(argv)
    args.bind = args.bind or ["0.0.0.0"]
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency; fall back anyway
        asyncio.run(serve(args.name, args.node, args.bind, args.port))
    else:
        uvloop.run(serve(args.name, args.node, args.bind, args.port))
    return 0


if __name__ == "__main__":
    sys.exit(main())
