"""The relay floor (``relay-floor``, ``bench/relayfloor.c``) relays as a relay must.

A floor that lost a half-close, a byte or an error would be quick for the wrong reason,
and every ratio against it would lie. Each test runs the floor in a namespace of its
own, between a client and a backend on its loopback.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import socket
import struct
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from bench.contenders import RELAY_FLOOR_SOURCE
from tests.support.netns import connect_in, fresh_netns, socket_in

FRONT, BACKEND, REFUSED = 9000, 9001, 9002
"""The floor's two fronts: one to a backend, one to a port nobody listens on."""


@pytest.fixture
def binary(tmp_path: Path) -> Path:
    if shutil.which("cc") is None:
        pytest.skip("no C compiler (cc) to build relayfloor.c")
    out = tmp_path / "relayfloor"
    subprocess.run(["cc", "-O2", "-o", str(out), str(RELAY_FLOOR_SOURCE)], check=True,
                   timeout=60)
    return out


@pytest.fixture
def netns() -> Iterator[str]:
    if os.geteuid() != 0:
        pytest.skip("needs root (a network namespace)")
    with fresh_netns("relayfloor") as name:
        yield name


def serve(ns: str, handle: Callable[[socket.socket], None]) -> socket.socket:
    """A backend on 127.0.0.1:BACKEND in ``ns``: ``handle`` each connection in a thread."""
    ls = socket_in(ns)
    ls.bind(("127.0.0.1", BACKEND))
    ls.listen(64)

    def accept() -> None:
        while True:
            try:
                conn, _ = ls.accept()
            except OSError:
                return  # closed: the test is over
            threading.Thread(target=handle, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    return ls


def digest_then_close(conn: socket.socket) -> None:
    """Read to EOF, answer the SHA-256 and length of what came, close: a half-close test."""
    with conn:
        h, n = hashlib.sha256(), 0
        while chunk := conn.recv(1 << 20):
            h.update(chunk)
            n += len(chunk)
        conn.sendall(f"{h.hexdigest()} {n}".encode())


@pytest.fixture
def floor(binary: Path, netns: str) -> Iterator[subprocess.Popen[str]]:
    proc = subprocess.Popen(
        ["ip", "netns", "exec", netns, str(binary), f"127.0.0.1:{FRONT}=127.0.0.1:{BACKEND}",
         f"127.0.0.1:{REFUSED}=127.0.0.1:{REFUSED + 1}"], stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr is not None
        assert proc.stderr.readline().strip() == "relayfloor: 2 listeners"
        yield proc
    finally:
        proc.kill()
        proc.wait()


def read_all(s: socket.socket) -> bytes:
    out = bytearray()
    while chunk := s.recv(1 << 16):
        out += chunk
    return bytes(out)


def send_and_shut(s: socket.socket, data: bytes) -> None:
    s.sendall(data)
    s.shutdown(socket.SHUT_WR)


def test_bytes_both_ways_and_the_half_close(netns: str, floor: subprocess.Popen[str]) -> None:
    """The backend answers only after the client's FIN: the FIN must pass, every byte in
    order, and the backend's close must end the client's read."""
    backend = serve(netns, digest_then_close)
    try:
        for size in (0, 1, 16384, 16385, 4 << 20):
            data = os.urandom(size)
            with connect_in(netns, ("127.0.0.1", FRONT)) as s:
                s.settimeout(10)
                sender = threading.Thread(target=send_and_shut, args=(s, data))
                sender.start()
                got = read_all(s)
                sender.join()
            assert got == f"{hashlib.sha256(data).hexdigest()} {size}".encode(), size
    finally:
        backend.close()


def test_the_backend_speaks_first(netns: str, floor: subprocess.Popen[str]) -> None:
    """A greeting sent at accept reaches a client that has sent nothing."""
    def greet(conn: socket.socket) -> None:
        with conn:
            conn.sendall(b"220 hello\r\n")
            conn.recv(1)

    backend = serve(netns, greet)
    try:
        with connect_in(netns, ("127.0.0.1", FRONT)) as s:
            s.settimeout(5)
            assert s.recv(64) == b"220 hello\r\n"
    finally:
        backend.close()


def reset(netns: str, port: int, send: bytes = b"") -> bool:
    """Whether a client of ``port`` is reset: at its connect (the RST can come before
    Python has read the connect's outcome) or at its first read."""
    try:
        with connect_in(netns, ("127.0.0.1", port), timeout=5) as s:
            s.sendall(send)
            s.recv(1)
    except ConnectionResetError:
        return True
    return False


def test_errors_become_resets(netns: str, floor: subprocess.Popen[str]) -> None:
    """A refused connect, and a backend's RST mid-stream, reset the client."""
    assert reset(netns, REFUSED)

    def abort(conn: socket.socket) -> None:
        conn.recv(1)
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        conn.close()

    backend = serve(netns, abort)
    try:
        assert reset(netns, FRONT, b"x")
    finally:
        backend.close()


def test_no_descriptor_outlives_its_connection(netns: str,
                                               floor: subprocess.Popen[str]) -> None:
    backend = serve(netns, digest_then_close)
    fds = Path(f"/proc/{floor.pid}/fd")
    try:
        # ip netns exec execs the floor: the pid is the floor's own.
        before = len(os.listdir(fds))
        for _ in range(50):
            with connect_in(netns, ("127.0.0.1", FRONT)) as s:
                s.settimeout(5)
                s.sendall(b"ping")
                s.shutdown(socket.SHUT_WR)
                assert read_all(s).endswith(b" 4")
        deadline = time.monotonic() + 5
        while len(os.listdir(fds)) != before and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(os.listdir(fds)) == before
    finally:
        backend.close()
