"""A scriptable TCP backend for the dataplane tests.

Each connection starts with one command line; the backend then behaves as told.
It runs in a thread (in-process tests on loopback) or as a script inside a pod
namespace (``python -m tests.support.backends --port P --name NAME``, from the
repository root).

Commands:
    PEER          reply "<name> <peer_ip>:<peer_port>" and close
    ECHO          echo everything until EOF, then half-close (shutdown SHUT_WR)
    SHA           read until EOF, reply "<sha256hex> <nbytes>", close
    SEND <n>      send n pattern bytes, then close
    RST           reply "ok", wait for one more byte, then close with an RST
    HOLD          read nothing; keep the connection open until the client goes
    QUIET         never send, never close: read (and drop) until EOF, then wait;
                  ends "reset" once the proxy resets it (the idle-expiry tests)
    DRIP <n>      send one line every 50 ms, n times, then close (drain tests)
    BURST <n>     send n pattern bytes without reading, then read until EOF,
                  reply "<bytes read>" and close (both directions congested)
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import socket
import socketserver
import struct
import threading
import time

PATTERN = bytes(range(256)) * 1024  # 256 KiB


def pattern_stream(n: int):
    """The SEND payload, chunk by chunk (also used by tests to check it)."""
    while n > 0:
        chunk = PATTERN[: min(n, len(PATTERN))]
        n -= len(chunk)
        yield chunk


class Handler(socketserver.BaseRequestHandler):
    server: Server

    def handle(self) -> None:
        s: socket.socket = self.request
        s.settimeout(30)
        line = b""
        while not line.endswith(b"\n"):
            b = s.recv(1)
            if not b:
                return
            line += b
            if len(line) > 200:
                return
        cmd, _, arg = line.decode().strip().partition(" ")
        self.server.seen.append((cmd, self.client_address))
        try:
            getattr(self, f"do_{cmd.lower()}")(s, arg)
        except ConnectionResetError:
            self.server.events.append((cmd, "reset"))
        except (ConnectionError, TimeoutError, OSError):
            self.server.events.append((cmd, "error"))
        else:
            self.server.events.append((cmd, "done"))

    def do_peer(self, s: socket.socket, arg: str) -> None:
        ip, port = s.getpeername()[:2]
        s.sendall(f"{self.server.name} {ip}:{port}\n".encode())

    def do_echo(self, s: socket.socket, arg: str) -> None:
        while True:
            data = s.recv(262144)
            if not data:
                break
            s.sendall(data)
        s.shutdown(socket.SHUT_WR)
        # Wait for the proxy to close its side, so the FIN is what it sees.
        s.recv(1)

    def do_burst(self, s: socket.socket, arg: str) -> None:
        for chunk in pattern_stream(int(arg)):
            s.sendall(chunk)
        n = 0
        while data := s.recv(262144):
            n += len(data)
        s.sendall(f"{n}\n".encode())

    def do_sha(self, s: socket.socket, arg: str) -> None:
        h = hashlib.sha256()
        n = 0
        while True:
            data = s.recv(262144)
            if not data:
                break
            h.update(data)
            n += len(data)
        s.sendall(f"{h.hexdigest()} {n}\n".encode())

    def do_send(self, s: socket.socket, arg: str) -> None:
        for chunk in pattern_stream(int(arg)):
            s.sendall(chunk)

    def do_rst(self, s: socket.socket, arg: str) -> None:
        s.sendall(b"ok\n")
        s.recv(1)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        # Close here: socketserver would shutdown(SHUT_WR) first, a FIN.
        s.close()

    def do_hold(self, s: socket.socket, arg: str) -> None:
        self.server.holding.set()
        while not self.server.stopping.is_set():
            time.sleep(0.05)

    def do_quiet(self, s: socket.socket, arg: str) -> None:
        s.settimeout(0.05)
        while not self.server.stopping.is_set():
            try:
                if not s.recv(65536):
                    break  # EOF: stay half-open (CLOSE_WAIT) and say nothing
            except TimeoutError:
                continue
        self.server.holding.set()
        # After EOF a reset shows only as the socket's pending error (EPIPE in
        # CLOSE_WAIT), which SO_ERROR reads.
        while not self.server.stopping.is_set():
            if s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
                raise ConnectionResetError("reset while half-closed")
            time.sleep(0.02)

    def do_drip(self, s: socket.socket, arg: str) -> None:
        for i in range(int(arg)):
            s.sendall(f"drip {i}\n".encode())
            time.sleep(0.05)


class Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128

    def __init__(self, addr: tuple[str, int], name: str) -> None:
        self.name = name
        self.seen: list[tuple[str, tuple[str, int]]] = []
        self.events: list[tuple[str, str]] = []
        """(command, how the session ended: done, reset or error)."""
        self.holding = threading.Event()
        self.stopping = threading.Event()
        # An IPv6 address serves IPv6 (the dual-stack dataplane tests).
        self.address_family = socket.AF_INET6 if ":" in addr[0] else socket.AF_INET
        super().__init__(addr, Handler)

    @property
    def port(self) -> int:
        return self.server_address[1]

    def stop(self) -> None:
        self.stopping.set()
        self.shutdown()
        self.server_close()


def echoes(s: socket.socket, data: bytes) -> bool:
    """Send ``data`` on a connection in ECHO mode (this backend's, or the lab pod's) and
    read it back: True if every byte came back as sent, False at an early EOF."""
    s.sendall(data)
    got = b""
    while len(got) < len(data):
        chunk = s.recv(65536)
        if not chunk:
            return False
        got += chunk
    return got == data


def start(addr: str = "127.0.0.1", port: int = 0, name: str = "backend") -> Server:
    """A backend serving in a daemon thread; ``stop()`` it when done."""
    srv = Server((addr, port), name)
    threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05},
                     daemon=True).start()
    return srv


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--addr", default="0.0.0.0")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--name", required=True)
    args = p.parse_args()
    srv = Server((args.addr, args.port), args.name)
    print("READY", flush=True)
    with contextlib.suppress(KeyboardInterrupt):
        srv.serve_forever(poll_interval=0.05)


if __name__ == "__main__":
    main()
