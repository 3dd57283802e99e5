"""Open-loop latency probes: a fresh connection every ``interval``, whatever the last one did.

Owns: timing new TCP connections that each send one HTTP request and wait for
the response headers, on a fixed schedule, from one thread (``selectors``,
non-blocking sockets), for the control workload's stall measurement.

Never: wait for one probe before starting the next. A closed-loop prober
(connect, wait, connect again) records *one* sample for a 3 s stall and then
hundreds of fast ones, so its p99 hides exactly what it is meant to show
(coordinated omission). Here every probe's latency runs from its *scheduled*
start, so a stall of S seconds yields about S / interval samples spread from
S down to 0, as the clients of a stalled proxy would see it.

Run it as its own process (``python -m bench.prober``, in the client's
namespace; ``ProbeProcess``): a thread of the harness would share the
harness's GIL with the listener-count poll and the 40 MB state write, and
measure the harness's own pauses as kpx's.

Bounded: at most ``max_seconds / interval`` probes per target, at most
``max_inflight`` sockets open at once (a probe that cannot start because of it
is counted as ``skipped``), and each probe gives up after ``timeout`` (it then
counts as a timeout at ``timeout`` seconds: a lower bound, never dropped).
"""

from __future__ import annotations

import argparse
import errno
import json
import selectors
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class ProbeTarget:
    """Where one probe series goes and what it sends (an HTTP request)."""

    name: str
    ip: str
    port: int
    request: bytes = b"GET / HTTP/1.0\r\nHost: bench\r\n\r\n"


@dataclass
class ProbeSeries:
    """What one target's probes measured: latencies of the answered ones, and the rest."""

    latencies_ms: list[float] = field(default_factory=list)
    due_s: list[float] = field(default_factory=list)
    """When each answered (or timed out) probe was due, in seconds from the prober's start."""
    timeouts: int = 0
    errors: list[str] = field(default_factory=list)
    skipped: int = 0
    bad_status: int = 0

    @property
    def sent(self) -> int:
        return len(self.latencies_ms) + self.timeouts + len(self.errors) + self.bad_status


@dataclass
class _Probe:
    target: ProbeTarget
    due: float
    sock: socket.socket
    sent: bool = False
    buf: bytes = b""


def _status_ok(head: bytes) -> bool:
    first = head.split(b"\r\n", 1)[0]
    return first.startswith(b"HTTP/1.") and b" 200 " in first + b" "


def probe_open_loop(targets: list[ProbeTarget], interval: float, stop: threading.Event,
                    max_seconds: float, timeout: float = 10.0, max_inflight: int = 512,
                    ) -> dict[str, ProbeSeries]:
    """Probe every target every ``interval`` s until ``stop`` is set or ``max_seconds`` pass.

    Call it in a thread that lives in the client's namespace (sockets belong
    to the namespace they are created in). After the last probe is started it
    waits up to ``timeout`` for the ones still in flight.
    """
    out = {t.name: ProbeSeries() for t in targets}
    sel = selectors.DefaultSelector()
    inflight: dict[int, _Probe] = {}
    start = time.monotonic()
    next_due = start
    max_probes = int(max_seconds / interval) + 1
    started = 0

    def finish(p: _Probe, now: float, error: str | None = None, ok: bool = True) -> None:
        series = out[p.target.name]
        if error is not None:
            series.errors.append(error)
        elif not ok:
            series.bad_status += 1
        else:
            series.latencies_ms.append((now - p.due) * 1000.0)
            series.due_s.append(p.due - start)
        sel.unregister(p.sock)
        del inflight[p.sock.fileno()]
        p.sock.close()

    try:
        while True:
            now = time.monotonic()
            scheduling = (not stop.is_set() and now - start < max_seconds
                          and started < max_probes)
            while scheduling and next_due <= now:
                for t in targets:
                    if len(inflight) >= max_inflight:
                        out[t.name].skipped += 1
                        continue
                    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                    s.setblocking(False)
                    rc = s.connect_ex((t.ip, t.port))
                    p = _Probe(t, next_due, s)
                    inflight[s.fileno()] = p
                    sel.register(s, selectors.EVENT_WRITE, p)
                    if rc not in (0, errno.EINPROGRESS):
                        finish(p, now, f"connect: {errno.errorcode.get(rc, rc)}")
                started += 1
                next_due += interval
            if not scheduling and not inflight:
                break
            for p in [p for p in inflight.values() if now - p.due >= timeout]:
                out[p.target.name].timeouts += 1
                out[p.target.name].latencies_ms.append(timeout * 1000.0)
                out[p.target.name].due_s.append(p.due - start)
                sel.unregister(p.sock)
                del inflight[p.sock.fileno()]
                p.sock.close()
            if not scheduling and not inflight:
                break
            wait = max(0.0, next_due - time.monotonic()) if scheduling else 0.05
            for key, _ev in sel.select(min(wait, 0.05) if inflight else wait):
                p = key.data
                now = time.monotonic()
                try:
                    if not p.sent:
                        err = p.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                        if err:
                            finish(p, now, f"connect: {errno.errorcode.get(err, err)}")
                            continue
                        p.sock.send(p.target.request)
                        p.sent = True
                        sel.modify(p.sock, selectors.EVENT_READ, p)
                        continue
                    chunk = p.sock.recv(4096)
                except OSError as e:
                    finish(p, now, f"{type(e).__name__}: {e.strerror or e}")
                    continue
                p.buf += chunk
                if b"\r\n\r\n" in p.buf:
                    finish(p, now, ok=_status_ok(p.buf))
                elif not chunk:
                    finish(p, now, "closed before a response")
    finally:
        for p in list(inflight.values()):
            p.sock.close()
        sel.close()
    return out


class ProbeProcess:
    """``probe_open_loop`` in a child process: started with ``argv_prefix`` (an ``ip netns
    exec`` wrapper), stopped by closing its stdin, its series read back as JSON."""

    def __init__(self, argv_prefix: Sequence[str], targets: list[ProbeTarget], interval: float,
                 max_seconds: float, timeout: float) -> None:
        argv = [*argv_prefix, sys.executable, "-m", "bench.prober",
                "--interval", str(interval), "--max-seconds", str(max_seconds),
                "--timeout", str(timeout)]
        for t in targets:
            argv += ["--target", json.dumps({"name": t.name, "ip": t.ip, "port": t.port,
                                             "request": t.request.decode("latin-1")})]
        self.timeout = timeout
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE)

    def finish(self) -> dict[str, ProbeSeries]:
        """Stop scheduling probes, wait for those in flight, return every series."""
        try:
            out, err = self.proc.communicate(input=b"stop\n", timeout=self.timeout + 30.0)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.communicate()
            raise RuntimeError("prober did not finish") from None
        if self.proc.returncode != 0:
            raise RuntimeError(f"prober failed rc={self.proc.returncode}: "
                               f"{err.decode(errors='replace')[-300:]}")
        return {k: ProbeSeries(**v) for k, v in json.loads(out).items()}

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.communicate()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.prober")
    ap.add_argument("--interval", type=float, required=True)
    ap.add_argument("--max-seconds", type=float, required=True)
    ap.add_argument("--timeout", type=float, default=10.0)
    ap.add_argument("--target", action="append", default=[], help="JSON name/ip/port/request")
    a = ap.parse_args(argv)
    targets = [ProbeTarget(d["name"], d["ip"], int(d["port"]), d["request"].encode("latin-1"))
               for d in map(json.loads, a.target)]
    stop = threading.Event()

    def wait_stdin() -> None:
        sys.stdin.buffer.readline()  # any line, or EOF: stop scheduling
        stop.set()

    threading.Thread(target=wait_stdin, daemon=True).start()
    series = probe_open_loop(targets, a.interval, stop, a.max_seconds, a.timeout)
    json.dump({k: asdict(v) for k, v in series.items()}, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
