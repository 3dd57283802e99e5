"""UDP request/response load: N flows, each one request in flight (``python -m bench.udpclient``).

Owns: the ``udp`` workload's load generator and its statistics. Each flow is
its own connected UDP socket (its own source port, so its own conntrack
entry, socat child or proxy session), sends one datagram, waits for the
reply, checks it byte for byte, and only then sends the next: a closed loop,
as wrk's rr is for TCP. One JSON line on stdout says what happened.

Never: run unbounded or call a silent path fast. The load stops at
``--seconds`` or ``--max-requests``, whichever comes first; every request
gives up after ``--timeout`` (counted as lost, and the flow goes on with a
new request); a reply that is not byte for byte the request counts as
corrupt. A target that never answers ends the run after ``--warmup-timeout``
with an ``error`` in the JSON and exit code 1, never a hang.

Why one thread and a bare ``epoll`` rather than asyncio or threads: the
client must not be what limits a single-core relay. Per reply this loop does
one ``recv``, one comparison, one clock read and one ``send`` (about 5 us of
Python on this machine), where a DatagramProtocol adds a callback dispatch
and a transport layer per datagram, and threads would fight over the GIL.
Measured on loopback against an echo (bench/README.md): this client drives
about twice what the fastest single-core Python relay tried forwards.

Why a warm-up: the first datagram of a flow is where a proxy does its
per-flow work (socat forks a child, the kernel creates a conntrack entry, a
userspace proxy opens an upstream socket). Each flow first needs one
answered request (retried every ``--warmup-retry`` s, one new flow at a
time); the measured window starts when all have one. The rate is then request/response in steady
state; the warm-up's length and retries are reported beside it.

Payload: ``kpxb`` + flow (2 bytes) + sequence (4 bytes) + padding up to
``--size``. Never starting with ``WHO`` or ``ECHO `` keeps ``lab.echo`` on its
plain echo path; the sequence tells a late reply to a timed-out request
(ignored, counted) from a corrupt one.
"""

from __future__ import annotations

import argparse
import json
import select
import socket
import struct
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

TAG = b"kpxb"
HEADER = struct.Struct("!4sHI")
MIN_SIZE = HEADER.size
MAX_FLOWS = 1000
NS = 1_000_000_000


def percentiles(values: Sequence[float], ps: Sequence[float]) -> dict[float, float]:
    """Nearest-rank percentiles (each p in 0-100) with a single sort.

    Nearest rank returns an observed value, as wrk and ``bench.control``'s
    ``percentile`` do (same definition, so udp's p99 reads like rr's).
    """
    if not values:
        raise ValueError("no values")
    ordered = sorted(values)
    n = len(ordered)
    return {p: ordered[max(0, min(n - 1, int(-(-p * n // 100)) - 1))] for p in ps}


@dataclass
class FlowStats:
    """What one run measured; ``summary`` turns it into the JSON line (pure, unit-tested)."""

    flows: int
    size: int
    latencies_ns: list[int] = field(default_factory=list)
    """Measured-window round trips, one per answered request."""
    seconds: float = 0.0
    """The measured window: from the first measured send to the last counted reply."""
    sent: int = 0
    lost: int = 0
    """Requests with no reply within the timeout (the flow then sends a new one)."""
    late: int = 0
    """Replies to an earlier, timed-out request of the same flow (ignored)."""
    corrupt: int = 0
    """Replies that are neither the current request nor an earlier one of the flow."""
    refused: int = 0
    """ICMP port unreachable seen on a flow's socket (ECONNREFUSED): nothing listens."""
    warmup_s: float = 0.0
    warmup_retries: int = 0
    warmup_refused: int = 0
    flows_unanswered: int = 0
    """Flows that got no reply during the warm-up (the run is then an error)."""
    per_flow: list[int] = field(default_factory=list)
    """Answered requests per flow in the measured window (a starved flow shows here)."""
    error: str | None = None

    def summary(self) -> dict[str, Any]:
        """Rates and latency percentiles (ms) plus every counter, JSON-ready."""
        out: dict[str, Any] = {
            "flows": self.flows, "size": self.size, "seconds": round(self.seconds, 4),
            "sent": self.sent, "replies": len(self.latencies_ns), "lost": self.lost,
            "late": self.late, "corrupt": self.corrupt, "refused": self.refused,
            "warmup_s": round(self.warmup_s, 4), "warmup_retries": self.warmup_retries,
            "warmup_refused": self.warmup_refused,
            "flows_unanswered": self.flows_unanswered, "error": self.error,
        }
        if self.per_flow:
            out["per_flow_min"] = min(self.per_flow)
            out["per_flow_max"] = max(self.per_flow)
        n = len(self.latencies_ns)
        out["rate"] = n / self.seconds if self.seconds > 0 else 0.0
        if n:
            q = percentiles(self.latencies_ns, (50, 90, 99, 99.9, 100))
            out["latency_ms"] = {str(k).removesuffix(".0"): v / 1e6 for k, v in q.items()}
            out["mean_ms"] = sum(self.latencies_ns) / n / 1e6
        else:
            out["latency_ms"] = {}
        return out

    def problems(self, max_loss: float) -> list[str]:
        """Why this run is not clean: no reply, corruption, or loss above ``max_loss``."""
        out = []
        if self.error:
            out.append(self.error)
        if self.corrupt:
            out.append(f"{self.corrupt} corrupt replies (not the request's bytes)")
        asked = self.sent
        if asked and self.lost > max_loss * asked:
            out.append(f"{self.lost} of {asked} requests unanswered within the timeout "
                       f"({100 * self.lost / asked:.2f}% > {100 * max_loss:g}% allowed)")
        if not self.error and not self.latencies_ns:
            out.append("no reply in the measured window")
        if self.per_flow and min(self.per_flow) == 0 and not self.error:
            out.append(f"{self.per_flow.count(0)} flows got no reply in the measured window")
        return out


def payload(flow: int, seq: int, size: int) -> bytes:
    """The request datagram of ``flow``'s ``seq``-th request, ``size`` bytes."""
    head = HEADER.pack(TAG, flow, seq & 0xFFFFFFFF)
    return head + b"." * (size - len(head))


def classify(reply: bytes, current: bytes) -> str:
    """``ok`` (the current request echoed), ``late`` (an earlier one of this flow) or
    ``corrupt`` (anything else)."""
    if reply == current:
        return "ok"
    if len(reply) == len(current) and len(reply) >= MIN_SIZE:
        tag, flow, seq = HEADER.unpack_from(reply)
        ctag, cflow, cseq = HEADER.unpack_from(current)
        if (tag, flow) == (ctag, cflow) and seq < cseq and reply[MIN_SIZE:] == current[MIN_SIZE:]:
            return "late"
    return "corrupt"


class Load:
    """The flows and the epoll loop that drives them."""

    def __init__(self, host: str, port: int, flows: int, size: int, timeout: float) -> None:
        if not 1 <= flows <= MAX_FLOWS:
            raise ValueError(f"flows must be 1-{MAX_FLOWS}")
        if size < MIN_SIZE or size > 65507:
            raise ValueError(f"size must be {MIN_SIZE}-65507 bytes")
        self.size = size
        self.timeout_ns = int(timeout * NS)
        self.socks: list[socket.socket] = []
        self.ep = select.epoll()
        self.by_fd: dict[int, int] = {}
        for i in range(flows):
            s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            s.setblocking(False)
            # Connected: send/recv without an address per call, and the kernel
            # drops datagrams from any other source, as a real client's stack does.
            s.connect((host, port))
            self.socks.append(s)
            self.by_fd[s.fileno()] = i
            self.ep.register(s.fileno(), select.EPOLLIN)
        self.seq = [0] * flows
        self.current = [b""] * flows
        self.sent_at = [0] * flows
        self.stats = FlowStats(flows=flows, size=size)

    def close(self) -> None:
        self.ep.close()
        for s in self.socks:
            s.close()

    def _send(self, i: int, now: int) -> None:
        self.seq[i] += 1
        data = payload(i, self.seq[i], self.size)
        self.current[i] = data
        self.sent_at[i] = now
        try:
            self.socks[i].send(data)
        except ConnectionRefusedError:
            self.stats.refused += 1  # the ICMP error of an earlier send: retried on timeout
        except BlockingIOError:
            pass  # a full send buffer with one datagram in flight: counted lost on timeout

    def _recv(self, i: int) -> bytes | None:
        try:
            return self.socks[i].recv(65535)
        except BlockingIOError:
            return None
        except ConnectionRefusedError:
            self.stats.refused += 1
            return None

    def warmup(self, deadline_s: float, retry_s: float, parallel: int = 1) -> bool:
        """Until every flow has had one answer; False (and ``stats.error``) at the deadline.

        At most ``parallel`` flows are new at a time. socat's fork per flow
        loses the datagrams that reach its listening socket while it hands
        that socket to a child (and forwards some of them on the child's flow),
        so 50 flows starting at once leave most unanswered; one new flow at a
        time costs the others nothing (a conntrack entry or a session is
        microseconds) and makes the warm-up the same for every contender.
        """
        st = self.stats
        t0 = time.perf_counter_ns()
        end = t0 + int(deadline_s * NS)
        retry = int(retry_s * NS)
        todo = list(range(len(self.socks)))[::-1]
        waiting: set[int] = set()
        while todo or waiting:
            while todo and len(waiting) < parallel:
                i = todo.pop()
                waiting.add(i)
                self._send(i, time.perf_counter_ns())
            now = time.perf_counter_ns()
            if now >= end:
                break
            for fd, _ in self.ep.poll(min(retry, end - now) / NS):
                i = self.by_fd[fd]
                while (data := self._recv(i)) is not None:
                    if data == self.current[i]:
                        waiting.discard(i)
            now = time.perf_counter_ns()
            for i in list(waiting):
                if now - self.sent_at[i] >= retry:
                    st.warmup_retries += 1
                    self._send(i, now)
        st.warmup_s = (time.perf_counter_ns() - t0) / NS
        st.flows_unanswered = len(waiting) + len(todo)
        st.warmup_refused, st.refused = st.refused, 0
        if st.flows_unanswered:
            why = (f"ICMP port unreachable {st.warmup_refused} times: nothing listens there"
                   if st.warmup_refused else "no reply and no ICMP error: dropped on the way")
            st.error = (f"{st.flows_unanswered} of {len(self.socks)} flows got no reply within "
                        f"{deadline_s:g}s ({why})")
            return False
        return True

    def run(self, seconds: float, max_requests: int) -> None:
        """The measured window: closed loop per flow, bounded by time and count."""
        st = self.stats
        lat = st.latencies_ns
        per_flow = st.per_flow = [0] * len(self.socks)
        clock = time.perf_counter_ns
        timeout = self.timeout_ns
        t0 = last = clock()
        end = t0 + int(seconds * NS)
        active = set(range(len(self.socks)))
        for i in active:
            self._send(i, clock())
        sent = len(active)
        next_sweep = t0 + timeout // 4
        poll = self.ep.poll
        by_fd, current, sent_at, socks = self.by_fd, self.current, self.sent_at, self.socks
        while active:
            now = clock()
            # Past the end only the last replies are awaited: block until one comes or
            # the next sweep, never spin.
            wait = (min(end, next_sweep) if now < end else next_sweep) - now
            for fd, _ in poll(max(wait, 0) / NS):
                i = by_fd[fd]
                try:
                    data = socks[i].recv(65535)
                except BlockingIOError:
                    continue
                except ConnectionRefusedError:
                    st.refused += 1
                    continue
                now = clock()
                if data != current[i]:
                    kind = classify(data, current[i])
                    if kind == "late":
                        st.late += 1
                    else:
                        st.corrupt += 1
                    continue
                if i not in active:
                    continue
                lat.append(now - sent_at[i])
                per_flow[i] += 1
                last = now
                if now >= end or sent >= max_requests:
                    active.discard(i)
                    continue
                self._send(i, now)
                sent += 1
            now = clock()
            if now >= next_sweep:
                next_sweep = now + timeout // 4
                for i in list(active):
                    if now - sent_at[i] >= timeout:
                        st.lost += 1
                        if now >= end or sent >= max_requests:
                            active.discard(i)
                        else:
                            self._send(i, now)
                            sent += 1
            if now >= end + timeout:  # the last requests had their full timeout
                st.lost += len(active)
                break
        st.sent = sent
        st.seconds = (last - t0) / NS


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.udpclient",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--host", required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--flows", type=int, default=50)
    ap.add_argument("--size", type=int, default=64, help="bytes per request (default 64)")
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--max-requests", type=int, default=5_000_000)
    ap.add_argument("--timeout", type=float, default=1.0, help="per request (default 1 s)")
    ap.add_argument("--warmup-timeout", type=float, default=3.0)
    ap.add_argument("--warmup-retry", type=float, default=0.2)
    ap.add_argument("--warmup-parallel", type=int, default=1,
                    help="flows in their first request at once (default 1)")
    ap.add_argument("--max-loss", type=float, default=0.001,
                    help="share of requests that may go unanswered (default 0.001)")
    ap.add_argument("--samples", action="store_true",
                    help="include every latency (ns) in the JSON (tests)")
    args = ap.parse_args(argv)
    try:
        load = Load(args.host, args.port, args.flows, args.size, args.timeout)
    except (ValueError, OSError) as e:
        err = f"{type(e).__name__}: {e}"
        print(json.dumps({"error": err, "problems": [err]}), flush=True)
        return 2
    try:
        if load.warmup(args.warmup_timeout, args.warmup_retry, args.warmup_parallel):
            load.run(args.seconds, args.max_requests)
    finally:
        load.close()
    st = load.stats
    out = st.summary()
    out["problems"] = st.problems(args.max_loss)
    if args.samples:
        out["samples_ns"] = st.latencies_ns
    print(json.dumps(out), flush=True)
    return 1 if out["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
