"""Traffic the lab sends from inside its namespaces: connects, echo requests, HTTP GETs.

Owns: the client side of every probe the lab makes: ``Traffic``, the
methods ``Lab`` offers tests and the CLI (``socket``, ``request``,
``http_get``, ``run``, ``listener_pids``, ``probe_http``), and the
readiness checks ``can_connect`` and ``http_ok`` the lab polls while it
starts. ``NoReply`` is how a connection that closed without a complete
reply surfaces.

Both families: every probe takes the address family from the address it is
given (``family_of``), so ``lab.request("client", lab.node_ip("node1", 6),
port)`` speaks IPv6 with no other change, and an IPv6 address is bracketed
where HTTP wants it (``host_port``: ``[fd00:77::11]:30080``).

Never: send traffic anywhere but the addresses the caller names (always
lab addresses), or create a socket outside a lab namespace: every socket is
made by ``lab.netns.socket_in`` in the namespace of the named source.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
import socket
import subprocess
import threading
from collections.abc import Iterator, Sequence
from typing import Any

from lab import netns
from lab.lb.rules import describe_error


def family_of(ip: str) -> int:
    """``AF_INET6`` for an IPv6 address (it has a colon), else ``AF_INET``."""
    return socket.AF_INET6 if ":" in ip else socket.AF_INET


def host_port(ip: str, port: int) -> str:
    """``ip:port`` as a URL or a ``Host`` header spells it (IPv6 in brackets)."""
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


class NoReply(ConnectionError, EOFError):
    """The peer closed the connection (FIN) before sending a complete reply.

    An EOFError too, so ``describe_error`` names it as the load balancer's
    probes name the same thing: "closed without an answer".
    """


class Traffic:
    """The lab's client-side methods; the host class says where a name lives (``ns``)."""

    def ns(self, name: str) -> str:
        raise NotImplementedError

    @contextlib.contextmanager
    def socket(self, src: str, family: int = socket.AF_INET,
               type: int = socket.SOCK_STREAM) -> Iterator[socket.socket]:
        """A socket created inside *src*'s namespace, closed on exit."""
        s = netns.socket_in(self.ns(src), family, type)
        try:
            yield s
        finally:
            s.close()

    def request(self, src: str, ip: str, port: int, mode: str = "WHO", payload: bytes = b"",
                timeout: float = 2.0) -> dict[str, Any]:
        """One connection from *src* to ip:port speaking the echo protocol; the reply.

        *mode*: ``WHO`` (default), ``HTTP`` (GET /), ``SINK`` (sends *payload*,
        half-closes, returns the server's byte count and sha256), ``ECHO``
        (sends *payload*, half-closes, returns ``{"bytes", "sha256", "data"}``
        of what came back) or ``HOLD``. Socket errors propagate unchanged:
        ConnectionRefusedError (RST to the SYN), TimeoutError (no answer
        within *timeout*, per operation), ConnectionResetError; a clean close
        without a complete reply raises :class:`NoReply`.
        """
        mode = mode.upper()
        with self.socket(src, family_of(ip)) as s:
            s.settimeout(timeout)
            s.connect((ip, port))
            if mode in ("WHO", "HOLD"):
                s.sendall(mode.encode() + b"\n" + payload)
                return json.loads(_read_line(s))
            if mode == "HTTP":
                s.sendall(f"GET / HTTP/1.1\r\nHost: {host_port(ip, port)}\r\n"
                          "Connection: close\r\n\r\n".encode())
                return _parse_http(_read_all(s))[1]
            if mode in ("SINK", "ECHO"):
                return _send_and_collect(s, mode, payload)
            raise ValueError(f"unknown mode {mode!r} (WHO, HTTP, SINK, ECHO, HOLD)")

    def http_get(self, src: str, ip: str, port: int, path: str = "/",
                 timeout: float = 2.0) -> tuple[int, bytes]:
        """A plain HTTP/1.1 GET from inside *src*: (status code, body)."""
        with self.socket(src, family_of(ip)) as s:
            s.settimeout(timeout)
            s.connect((ip, port))
            s.sendall(f"GET {path} HTTP/1.1\r\nHost: {host_port(ip, port)}\r\n"
                      "Connection: close\r\n\r\n".encode())
            status, body = _parse_http(_read_all(s), raw=True)
            return status, body

    def probe_http(self, src: str, ip: str, port: int, path: str,
                   timeout: float) -> dict[str, Any]:
        """GET *path* from inside *src* as ``kpx lab status`` shows it: status, body, or error."""
        try:
            code, body = self.http_get(src, ip, port, path, timeout)
        except (OSError, ValueError) as exc:
            return {"error": describe_error(exc)}
        out: dict[str, Any] = {"status": code}
        try:
            out["body"] = json.loads(body)
        except ValueError:
            out["body"] = body.decode(errors="replace").strip()
        if isinstance(out["body"], dict) and "localEndpoints" in out["body"]:
            out["localEndpoints"] = out["body"]["localEndpoints"]
        return out

    def run(self, src: str, argv: Sequence[str], timeout: float = 10.0,
            **kw: Any) -> subprocess.CompletedProcess[str]:
        """Run a command inside *src*'s namespace (``ip netns exec``); output captured."""
        return netns.run_in(self.ns(src), argv, timeout=timeout, **kw)

    def listener_pids(self, node: str, port: int) -> set[int]:
        """Pids of the processes holding a TCP socket that listens on *port* in *node*.

        How a restart test tells "the new kpx node is up": its own pid
        listens on the NodePort, not the old one's.
        """
        out = self.run(node, ["ss", "-Hltnp", f"sport = :{port}"]).stdout
        return {int(m) for m in re.findall(r"pid=(\d+)", out)}


def _dial(ns: str, ip: str, port: int, timeout: float) -> socket.socket | None:
    """A socket in *ns* connected to ip:port within *timeout*, or None."""
    try:
        s = netns.socket_in(ns, family_of(ip))
    except OSError:
        return None
    try:
        s.settimeout(timeout)
        s.connect((ip, port))
    except OSError:
        s.close()
        return None
    return s


def can_connect(ns: str, ip: str, port: int) -> bool:
    """True if ip:port accepts a TCP connection made inside *ns*."""
    s = _dial(ns, ip, port, 0.2)
    if s is None:
        return False
    s.close()
    return True


def http_ok(ns: str, ip: str, port: int, path: str) -> bool:
    """True if GET *path* inside *ns* answers 200 (an HTTP/1.0 request: one read to EOF)."""
    s = _dial(ns, ip, port, 0.5)
    if s is None:
        return False
    try:
        s.sendall(f"GET {path} HTTP/1.0\r\nHost: {host_port(ip, port)}\r\n\r\n".encode())
        return _read_all(s).startswith((b"HTTP/1.0 200", b"HTTP/1.1 200"))
    except OSError:
        return False
    finally:
        s.close()


def _read_line(s: socket.socket, limit: int = 1 << 20) -> bytes:
    buf = bytearray()
    while b"\n" not in buf:
        chunk = s.recv(65536)
        if not chunk:
            raise NoReply(f"connection closed after {len(buf)} bytes without a full line")
        buf += chunk
        if len(buf) > limit:
            raise ValueError("reply line too long")
    return bytes(buf[:buf.index(b"\n") + 1])


def _read_all(s: socket.socket) -> bytes:
    chunks = []
    while True:
        chunk = s.recv(1 << 16)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)


def _parse_http(data: bytes, raw: bool = False) -> tuple[int, Any]:
    """(status, JSON body) of a complete HTTP response; (status, bytes) if *raw*."""
    head, sep, body = data.partition(b"\r\n\r\n")
    if not sep:
        raise NoReply(f"incomplete HTTP response ({len(data)} bytes)")
    status = int(head.split(b" ", 2)[1])
    return (status, body) if raw else (status, json.loads(body))


def _send_and_collect(s: socket.socket, mode: str, payload: bytes) -> dict[str, Any]:
    """Send concurrently with receiving: a big ECHO would deadlock otherwise."""
    errors: list[BaseException] = []

    def sender() -> None:
        try:
            s.sendall(mode.encode() + b"\n")
            view = memoryview(payload)
            for i in range(0, len(view), 1 << 20):
                s.sendall(view[i:i + (1 << 20)])
            s.shutdown(socket.SHUT_WR)
        except BaseException as exc:  # re-raised in the caller's thread
            errors.append(exc)

    t = threading.Thread(target=sender, daemon=True)
    t.start()
    try:
        if mode == "SINK":
            reply: dict[str, Any] = json.loads(_read_line(s))
        else:
            data = _read_all(s)
            reply = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest(),
                     "data": data}
    finally:
        t.join(timeout=5)
    if errors:
        raise errors[0]
    return reply
