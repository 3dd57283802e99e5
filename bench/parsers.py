"""Parsers for the load generators' output: wrk's text report, iperf3's JSON.

Owns: turning wrk's report and iperf3's JSON into the figures and the error
counters a run is judged by (``WrkResult``, ``parse_iperf3``).

Never: run a load generator or decide pass/fail: ``bench.workloads`` does.

Pure functions over strings so they are unit-tested on captured samples
(tests/bench/samples). They extract the counters that decide correctness as
well as the figures: a wrk run with any socket error or non-2xx response is a
failed run, whatever its rate.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

_UNITS_TO_MS = {"us": 1e-3, "ms": 1.0, "s": 1000.0, "m": 60000.0, "h": 3600000.0}


class ParseError(ValueError):
    """The tool's output did not have the expected shape."""


def duration_to_ms(text: str) -> float:
    """wrk prints latencies like ``843.29us``, ``3.72ms``, ``1.02s``, ``2.00m``."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(us|ms|s|m|h)\s*", text)
    if not m:
        raise ParseError(f"not a wrk duration: {text!r}")
    return float(m.group(1)) * _UNITS_TO_MS[m.group(2)]


@dataclass
class WrkResult:
    requests: int
    seconds: float
    req_per_s: float
    latency_ms: dict[int, float] = field(default_factory=dict)
    """Percentile (50, 75, 90, 99) -> ms; present only with ``--latency``."""
    connect_errors: int = 0
    read_errors: int = 0
    write_errors: int = 0
    timeouts: int = 0
    non_2xx: int = 0

    @property
    def socket_errors(self) -> int:
        return self.connect_errors + self.read_errors + self.write_errors + self.timeouts

    def problems(self) -> list[str]:
        """Why this run must not count; empty when it is clean."""
        out = []
        if self.requests <= 0:
            out.append("wrk completed no requests")
        if self.socket_errors:
            out.append(
                f"wrk socket errors: connect {self.connect_errors}, read {self.read_errors}, "
                f"write {self.write_errors}, timeout {self.timeouts}"
            )
        if self.non_2xx:
            out.append(f"wrk non-2xx/3xx responses: {self.non_2xx}")
        return out


def parse_wrk(text: str) -> WrkResult:
    """Parse wrk 4.x stdout (``--latency`` optional)."""
    m = re.search(r"^\s*(\d+) requests in ([0-9.]+)(us|ms|s|m|h)", text, re.M)
    if not m:
        raise ParseError("wrk output has no 'N requests in T' line")
    requests = int(m.group(1))
    seconds = duration_to_ms(m.group(2) + m.group(3)) / 1000.0
    r = re.search(r"^Requests/sec:\s*([0-9.]+)", text, re.M)
    if not r:
        raise ParseError("wrk output has no Requests/sec line")
    res = WrkResult(requests=requests, seconds=seconds, req_per_s=float(r.group(1)))
    dist = text.split("Latency Distribution", 1)
    if len(dist) == 2:
        for pm in re.finditer(r"^\s*(\d+)%\s+([0-9.]+\s*(?:us|ms|s|m|h))\s*$", dist[1], re.M):
            res.latency_ms[int(pm.group(1))] = duration_to_ms(pm.group(2))
    e = re.search(
        r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", text
    )
    if e:
        res.connect_errors, res.read_errors, res.write_errors, res.timeouts = (
            int(x) for x in e.groups()
        )
    n = re.search(r"Non-2xx or 3xx responses:\s*(\d+)", text)
    if n:
        res.non_2xx = int(n.group(1))
    return res


@dataclass
class IperfResult:
    sent_bytes: int
    received_bytes: int
    seconds: float
    gbps: float
    """Receiver-side rate, Gbit/s."""
    error: str | None = None

    def problems(self, tail_allowance: int = 0) -> list[str]:
        """Why this run must not count.

        iperf3's receiver stops counting when the sender announces the end of
        the test, so bytes still in flight (socket buffers, a proxy's
        buffers) are missing from ``sum_received``: 0.3% direct and ~2% (27
        MB) through HAProxy on a 2 s run here. ``tail_allowance`` (bytes)
        admits that shortfall explicitly; the bench's own sender/receiver
        (``bench.bulk``) is exact and is the default.
        """
        out = []
        if self.error:
            out.append(f"iperf3 error: {self.error}")
        if self.sent_bytes <= 0:
            out.append("iperf3 sent nothing")
        elif self.received_bytes > self.sent_bytes:
            out.append(f"iperf3 received {self.received_bytes} > sent {self.sent_bytes}")
        elif self.received_bytes < self.sent_bytes - tail_allowance:
            out.append(
                f"iperf3 bytes received {self.received_bytes} != sent {self.sent_bytes}"
                + (f" (beyond the {tail_allowance} B in-flight allowance)"
                   if tail_allowance else "")
            )
        return out


def parse_iperf3(text: str) -> IperfResult:
    """Parse ``iperf3 -J`` client output (one stream)."""
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise ParseError(f"iperf3 output is not JSON: {e}") from e
    err = doc.get("error")
    end = doc.get("end") or {}
    sent = end.get("sum_sent") or {}
    recv = end.get("sum_received") or {}
    if not sent or not recv:
        if err:
            return IperfResult(0, 0, 0.0, 0.0, error=str(err))
        raise ParseError("iperf3 JSON has no end.sum_sent/sum_received")
    return IperfResult(
        sent_bytes=int(sent.get("bytes", 0)),
        received_bytes=int(recv.get("bytes", 0)),
        seconds=float(recv.get("seconds", 0.0)),
        gbps=float(recv.get("bits_per_second", 0.0)) / 1e9,
        error=str(err) if err else None,
    )
