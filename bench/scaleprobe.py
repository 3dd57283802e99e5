"""The scale bench's two processes: the endpoint backend and the client that times connects.

Owns: ``backend`` (in a pod namespace: accept on 0.0.0.0:PORT, send the
address the connection was made to, close), and ``client`` (in the client
namespace: read one job as JSON on stdin, print one result as JSON): check
that each given service answers from one of its own endpoints, time fresh
connect() calls to a given list of service addresses (one at a time, with an
optional pause between them: the data-path bench's ``connect`` workload
dials one address this way at light load), and count connections per second
to one address.

Never: decide what to measure: the targets, their order and the bounds come
from ``bench.scale``; and never run unbounded: every loop has a count and a
deadline.

Why processes of their own: the harness times kpx's apply from its log
while these run; as harness threads they would share its GIL and time its
pauses as the contender's. Why a banner with the local address: a pod
namespace makes a whole /16 local (``ip route add local``), so one backend
answers every endpoint address in it, and the address it reports is the
endpoint the contender chose, which the check compares with the service's.
"""

from __future__ import annotations

import json
import socket
import struct
import sys
import threading
import time
from typing import Any

LINGER_RST = struct.pack("ii", 1, 0)
"""Close with RST: thousands of probe connections leave no TIME_WAIT in the client."""


def serve(port: int) -> None:
    """Accept forever (the harness stops us by pid); a few threads so one slow close never
    holds the accept queue."""
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("0.0.0.0", port))
    srv.listen(8192)

    def loop() -> None:
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                continue
            try:
                conn.sendall(f"ok {conn.getsockname()[0]}\n".encode())
            except OSError:
                pass
            finally:
                conn.close()

    for _ in range(3):
        threading.Thread(target=loop, daemon=True).start()
    print("listening", flush=True)
    threading.Event().wait()


def answered_by(ip: str, port: int, timeout: float) -> str:
    """The endpoint address one fresh connection to ``ip:port`` reached (the banner)."""
    with socket.create_connection((ip, port), timeout=timeout) as s:
        data = b""
        while not data.endswith(b"\n") and len(data) < 64:
            chunk = s.recv(64)
            if not chunk:
                break
            data += chunk
    text = data.decode(errors="replace").strip()
    if not text.startswith("ok "):
        raise OSError(f"{ip}:{port} answered {text!r}")
    return text[3:]


def check(targets: list[dict[str, Any]], port: int, timeout: float) -> list[str]:
    """Problems: each target ``{"ip", "endpoints"}`` must answer from one of its endpoints."""
    problems = []
    for t in targets:
        try:
            got = answered_by(t["ip"], port, timeout)
        except OSError as e:
            problems.append(f"{t['ip']}:{port}: {e}")
            continue
        if got not in t["endpoints"]:
            problems.append(f"{t['ip']}:{port} answered from {got}, not one of "
                            f"{t['endpoints']}")
    return problems


def connect_times(ips: list[str], port: int, timeout: float, deadline_s: float,
                  pause_s: float = 0.0) -> dict[str, Any]:
    """connect() time of a fresh connection to each address in turn (IPv4 or IPv6), in ms.

    One connection at a time, RST-closed, then ``pause_s`` of nothing before
    the next: with a pause, each SYN meets an idle path (no queue of earlier
    handshakes, no backlog of closes), so the figure is what a connection
    costs, not what a busy proxy makes it wait. The clock runs around
    connect() alone (socket creation and close are outside it), and a miss of
    the deadline is an error, so a short list never passes for a full one.
    """
    out: list[float] = []
    errors: list[str] = []
    end = time.monotonic() + deadline_s
    for i, ip in enumerate(ips):
        if time.monotonic() > end:
            errors.append(f"deadline of {deadline_s:g}s reached after {len(out)} connections")
            break
        if pause_s > 0 and i:
            time.sleep(pause_s)
        s = socket.socket(socket.AF_INET6 if ":" in ip else socket.AF_INET, socket.SOCK_STREAM)
        s.settimeout(timeout)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, LINGER_RST)
        try:
            t0 = time.perf_counter()
            s.connect((ip, port))
            out.append((time.perf_counter() - t0) * 1000.0)
        except OSError as e:
            errors.append(f"{ip}:{port}: {e}")
        finally:
            s.close()
    return {"ms": out, "errors": errors[:5], "error_count": len(errors)}


def connection_rate(ip: str, port: int, seconds: float, max_count: int,
                    timeout: float) -> dict[str, Any]:
    """Fresh connections per second to one address, connect then RST-close, one at a time."""
    n = errors = 0
    first: str | None = None
    t0 = time.monotonic()
    end = t0 + seconds
    while time.monotonic() < end and n < max_count:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.settimeout(timeout)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, LINGER_RST)
        try:
            s.connect((ip, port))
            n += 1
        except OSError as e:
            errors += 1
            first = first or str(e)
        finally:
            s.close()
    return {"count": n, "seconds": time.monotonic() - t0, "errors": errors, "first_error": first}


def run_job(job: dict[str, Any]) -> dict[str, Any]:
    port, timeout = int(job["port"]), float(job.get("timeout", 2.0))
    out: dict[str, Any] = {}
    if "check" in job:
        out["check"] = check(job["check"], port, timeout)
    if "latency" in job:
        out["latency"] = connect_times(job["latency"], port, timeout,
                                       float(job.get("deadline", 120.0)),
                                       float(job.get("pause", 0.0)))
    if "rate" in job:
        r = job["rate"]
        out["rate"] = connection_rate(r["ip"], port, float(r["seconds"]), int(r["max"]),
                                      timeout)
    return out


def main(argv: list[str]) -> int:
    if argv[:1] == ["backend"]:
        serve(int(argv[1]))
        return 0
    if argv[:1] == ["client"]:
        print(json.dumps(run_job(json.load(sys.stdin))))
        return 0
    print("usage: python -m bench.scaleprobe backend PORT | client < job.json", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
