"""Open N idle TCP connections and hold them (``python -m bench.memclient``).

Owns: opening N connections with bounded handshakes in flight, reporting the
outcome as one JSON line, and holding them until told to stop.

Never: send a byte on a held connection, or run without a bound: N, the
in-flight window and the deadline are all given on the command line.

The mem workload runs this in the client namespace: it connects N times to
the contender's front port, with a bounded number of handshakes in flight so
no accept queue overflows, prints one JSON line with the outcome, then holds
every connection idle until its stdin says to stop (a line, or EOF), and
closes them all. Idle means no byte is ever sent: what is measured is what a
proxy spends per connection that is just open.
"""

from __future__ import annotations

import argparse
import errno
import json
import selectors
import socket
import sys
import time


def open_many(host: str, port: int, n: int, inflight: int, timeout: float
              ) -> tuple[list[socket.socket], int, str | None]:
    """Connect ``n`` sockets; returns (established, failed, first error)."""
    sel = selectors.DefaultSelector()
    done: list[socket.socket] = []
    failed = 0
    first_error: str | None = None
    started = 0
    pending = 0
    deadline = time.monotonic() + timeout
    while (started < n or pending) and time.monotonic() < deadline:
        while started < n and pending < inflight:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.setblocking(False)
            rc = s.connect_ex((host, port))
            started += 1
            if rc in (0, errno.EINPROGRESS):
                sel.register(s, selectors.EVENT_WRITE)
                pending += 1
            else:
                failed += 1
                first_error = first_error or f"connect: {errno.errorcode.get(rc, rc)}"
                s.close()
        for key, _ in sel.select(timeout=0.5):
            s = key.fileobj
            assert isinstance(s, socket.socket)
            sel.unregister(s)
            pending -= 1
            err = s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            if err:
                failed += 1
                first_error = first_error or f"connect: {errno.errorcode.get(err, err)}"
                s.close()
            else:
                done.append(s)
    for key in list(sel.get_map().values()):
        s = key.fileobj
        assert isinstance(s, socket.socket)
        failed += 1
        first_error = first_error or "connect: timed out"
        s.close()
    return done, failed + (n - started), first_error


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.memclient")
    ap.add_argument("--host", required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("-n", type=int, required=True)
    ap.add_argument("--inflight", type=int, default=200)
    ap.add_argument("--timeout", type=float, default=60.0)
    a = ap.parse_args(argv)
    t0 = time.monotonic()
    socks, failed, err = open_many(a.host, a.port, a.n, a.inflight, a.timeout)
    print(json.dumps({"opened": len(socks), "failed": failed, "error": err,
                      "seconds": round(time.monotonic() - t0, 3)}), flush=True)
    sys.stdin.readline()
    # A connection the proxy closed meanwhile reads as EOF: report it.
    closed_early = 0
    for s in socks:
        try:
            if s.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b"":
                closed_early += 1
        except BlockingIOError:
            pass
        except OSError:
            closed_early += 1
        s.close()
    print(json.dumps({"closed_early": closed_early}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
