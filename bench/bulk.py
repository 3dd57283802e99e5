"""An exact one-stream bulk sender/receiver (``python -m bench.bulk sink|source``).

Owns: both ends of one exact bulk stream and the JSON line that reports it.

Never: know about namespaces, contenders or results: it is started inside a
namespace by ``bench.backends`` (sink) and ``bench.workloads`` (source), and
only speaks TCP.

Why not only iperf3: iperf3's receiver stops counting when the sender says
the test is over, so the bytes still in flight are missing from its report
(0-0.3% short here). That makes "bytes received == bytes sent" unverifiable,
and would hide a proxy that loses the tail of a stream on half-close. Here
the source sends for a fixed time, half-closes (``shutdown(SHUT_WR)``), and
the sink counts until EOF and answers with the exact count over the same
connection, which therefore also checks that the proxy relays a half-close
in each direction.

Speed: both sides move 1 MiB per system call from preallocated buffers, so
the Python cost is a few microseconds per MiB and the kernel copy dominates,
as it does for iperf3.
"""

from __future__ import annotations

import argparse
import json
import socket
import struct
import sys
import threading
import time

CHUNK = 1 << 20
REPLY = struct.Struct("!Q")


def _serve_one(conn: socket.socket) -> None:
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    n = 0
    try:
        conn.settimeout(120.0)
        while True:
            k = conn.recv_into(view)
            if not k:
                break
            n += k
        conn.sendall(REPLY.pack(n))
    except OSError:
        pass
    finally:
        conn.close()


def sink(bind: str, port: int) -> int:
    """Accept forever; one thread per stream (the bench runs one at a time)."""
    ls = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    ls.bind((bind, port))
    ls.listen(128)
    print(f"bulk sink listening on {bind}:{port}", flush=True)
    while True:
        conn, _ = ls.accept()
        threading.Thread(target=_serve_one, args=(conn,), daemon=True).start()


def source(host: str, port: int, seconds: float, max_bytes: int) -> dict[str, object]:
    """Send for ``seconds`` (or ``max_bytes``), half-close, read the sink's count."""
    data = memoryview(bytes(CHUNK))
    s = socket.create_connection((host, port), timeout=10.0)
    s.settimeout(60.0)
    sent = 0
    t0 = time.monotonic()
    deadline = t0 + seconds
    try:
        while sent < max_bytes and time.monotonic() < deadline:
            s.sendall(data)
            sent += CHUNK
        s.shutdown(socket.SHUT_WR)
        reply = b""
        while len(reply) < REPLY.size:
            chunk = s.recv(REPLY.size - len(reply))
            if not chunk:
                break
            reply += chunk
        elapsed = time.monotonic() - t0
    finally:
        s.close()
    if len(reply) != REPLY.size:
        return {"sent": sent, "received": None, "seconds": elapsed,
                "error": f"no byte count from the sink (got {len(reply)} of 8 bytes)"}
    received = REPLY.unpack(reply)[0]
    return {"sent": sent, "received": received, "seconds": elapsed,
            "gbps": received * 8 / elapsed / 1e9 if elapsed > 0 else 0.0, "error": None}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.bulk")
    sub = ap.add_subparsers(dest="mode", required=True)
    s = sub.add_parser("sink")
    s.add_argument("--bind", default="0.0.0.0")
    s.add_argument("--port", type=int, required=True)
    c = sub.add_parser("source")
    c.add_argument("--host", required=True)
    c.add_argument("--port", type=int, required=True)
    c.add_argument("--seconds", type=float, default=2.0)
    c.add_argument("--max-bytes", type=int, default=1 << 40)
    a = ap.parse_args(argv)
    if a.mode == "sink":
        return sink(a.bind, a.port)
    try:
        out = source(a.host, a.port, a.seconds, a.max_bytes)
    except OSError as e:
        out = {"sent": 0, "received": None, "seconds": 0.0, "error": f"{type(e).__name__}: {e}"}
    print(json.dumps(out))
    return 0 if out.get("error") is None else 1


if __name__ == "__main__":
    sys.exit(main())
