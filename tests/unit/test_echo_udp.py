"""lab.echo's UDP side: WHO, ECHO and plain echo, on the TCP server's port number.

The server runs as the lab runs it (``python -m lab.echo`` in a subprocess),
on 127.0.0.1 and a port free for both TCP and UDP, so the test exercises the
real entry point, the real loop (uvloop) and the one-process-two-protocols
claim. Loopback only, a handful of datagrams, every receive bounded by a
timeout; the subprocess is stopped in a ``finally``-backed fixture.
"""

from __future__ import annotations

import json
import os
import select
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HOST = "127.0.0.1"
START_TIMEOUT = 2.0
RECV_TIMEOUT = 1.0


def _free_port() -> int:
    """A port number free for TCP and UDP on 127.0.0.1 right now (the server binds both)."""
    for _ in range(20):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as t:
            t.bind((HOST, 0))
            port = t.getsockname()[1]
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as u:
                try:
                    u.bind((HOST, port))
                except OSError:
                    continue
                return port
    raise RuntimeError("no port free for both TCP and UDP")


def _start(port: int) -> subprocess.Popen[bytes]:
    """``python -m lab.echo`` on *port*, once it printed its listening line."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "lab.echo", "--name", "web-1", "--node", "node1",
         "--port", str(port), "--bind", HOST],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    deadline = time.monotonic() + START_TIMEOUT
    seen = b""
    while b"listening on" not in seen and (left := deadline - time.monotonic()) > 0:
        if select.select([fd], [], [], left)[0]:
            chunk = os.read(fd, 4096)
            if not chunk:  # exited (port taken?): its output says why
                break
            seen += chunk
    if b"listening on" in seen:
        return proc
    proc.kill()
    proc.wait(timeout=5)
    raise RuntimeError(f"lab.echo did not start on {port}: {seen[-500:]!r}")


@pytest.fixture
def echo() -> Iterator[int]:
    """The port of a running ``lab.echo``; retried once if another process took the port."""
    try:
        proc = _start(_free_port())
    except RuntimeError:
        proc = _start(_free_port())
    port = int(proc.args[proc.args.index("--port") + 1])  # type: ignore[union-attr]
    try:
        yield port
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=3)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=3)


def _ask(port: int, payload: bytes) -> tuple[bytes, tuple[str, int]]:
    """One request datagram and its reply, from a fresh socket."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.settimeout(RECV_TIMEOUT)
        s.bind((HOST, 0))
        s.sendto(payload, (HOST, port))
        data, src = s.recvfrom(65535)
        assert src == (HOST, port), "the reply must come from the port that was asked"
        return data, s.getsockname()


@pytest.mark.timeout(10)
def test_who_names_pod_node_and_the_peer_it_saw(echo: int) -> None:
    data, me = _ask(echo, b"WHO")
    reply = json.loads(data)
    assert reply == {"pod": "web-1", "node": "node1", "peer": f"{me[0]}:{me[1]}",
                     "proto": "udp"}
    empty, me2 = _ask(echo, b"")
    assert json.loads(empty)["peer"] == f"{me2[0]}:{me2[1]}"


@pytest.mark.timeout(10)
def test_echo_prefix_returns_the_rest_verbatim(echo: int) -> None:
    payload = os.urandom(1400)
    data, _ = _ask(echo, b"ECHO " + payload)
    assert data == payload
    # Several datagrams on one socket: each reply is its own request's payload.
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.settimeout(RECV_TIMEOUT)
        s.connect((HOST, echo))
        for i in range(5):
            chunk = os.urandom(100 + i)
            s.send(b"ECHO " + chunk)
            assert s.recv(65535) == chunk


@pytest.mark.timeout(10)
def test_anything_else_is_echoed_unchanged(echo: int) -> None:
    for payload in (b"kpxb" + os.urandom(60), b"ECHO", b"\x00\x01 WHO"):
        data, _ = _ask(echo, payload)
        assert data == payload


@pytest.mark.timeout(10)
def test_tcp_still_answers_on_the_same_port(echo: int) -> None:
    with socket.create_connection((HOST, echo), timeout=RECV_TIMEOUT) as s:
        s.sendall(b"WHO\n")
        line = s.makefile("rb").readline()
    reply = json.loads(line)
    assert reply["pod"] == "web-1" and reply["node"] == "node1"
    assert "proto" not in reply  # the TCP reply keeps its old shape
