"""The data-path workloads: bulk, rr, cps, connect, mem, udp. Each returns one checked ``Run``.

Owns: driving the load generators in the client namespace against one
contender's target, and deciding whether the run is clean:

- bulk: the exact sender/receiver (``bench.bulk``) must report bytes received
  == bytes sent (or iperf3 within its documented in-flight allowance);
- rr / cps: wrk must report zero socket errors and zero non-2xx responses;
- connect: every one of the N fresh connections must be established (no
  error, no deadline reached), each timed alone at light load;
- mem: every one of the N connections must reach the backend, and none may be
  closed by the proxy while idle;
- udp: a UDP ``WHO`` through the contender must come back from the expected
  pod (else the run fails with what was seen: ICMP port unreachable, or
  silence), then ``bench.udpclient`` must see no corrupt reply, every flow
  answered, and at most ``udp_max_loss`` of its requests unanswered.

Every load is bounded: wrk and the bulk sender by duration, the mem and
connect clients by connection count and a deadline, the udp client by
duration and a request count, and each subprocess by a timeout.
TIME_WAIT is recorded around cps runs (per namespace) so its handling is
visible in the results rather than silently capping them.

Never: start a contender or a backend (``bench.runner`` hands them in), or
judge a run by its speed: a run is clean or failed by its own checks alone.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from bench.backends import HTTP_PORT
from bench.contenders import Contender, ContenderError, Kernel
from bench.parsers import ParseError, parse_iperf3, parse_wrk
from bench.procs import nofile_hard_limit, raise_nofile, rss_bytes
from bench.results import Run
from bench.topology import (
    CommandError,
    Topology,
    count_states,
    counter_deltas,
    explain_losses,
    host_port,
    read_counters,
    read_tcp_table,
    sh,
)
from bench.udpclient import percentiles
from lab.common import poll

MEM_FD_RESERVE = 300
"""Descriptors a proxy needs besides its two per connection (listeners, epoll, logs)."""


@dataclass
class Settings:
    """Everything that shapes a data-path run; recorded verbatim in the results."""

    durations: dict[str, float] = field(
        default_factory=lambda: {"bulk": 5.0, "rr": 10.0, "cps": 10.0})
    pause: float = 3.0
    rr_connections: int = 50
    cps_connections: int = 50
    wrk_threads: int = 1
    wrk_timeout: str = "2s"
    mem_connections: int = 10000
    mem_settle: float = 1.0
    bulk_tool: str = "exact"
    iperf3_tail_allowance: int = 64 << 20
    """Bytes iperf3's receiver may miss at the end: what fits in a proxied path's buffers."""
    udp_flows: int = 50
    """Concurrent UDP flows, each its own socket and one request in flight (as rr's 50)."""
    udp_size: int = 64
    """Bytes per request datagram (and per reply: the backend echoes)."""
    udp_timeout: float = 1.0
    """Seconds a request waits for its reply before it counts as lost."""
    udp_max_requests: int = 5_000_000
    """The udp run's count bound, beside its duration (5 M: 10 s at 500k/s)."""
    udp_max_loss: float = 0.001
    """Share of requests that may go unanswered. A UDP proxy may drop a datagram (the
    protocol above retries); more than 1 in 1,000 with one request in flight per flow
    is a broken path, not a slow one."""
    udp_warmup_timeout: float = 5.0
    """Seconds for every flow's first answered request (flows start one at a time)."""
    connect_count: int = 2000
    """Fresh connections the connect workload times (its count bound): p99 is then the
    20th slowest, not one outlier."""
    connect_pause: float = 0.002
    """Seconds of nothing between two connects: each SYN finds the path idle (light
    load); 2,000 connects then take about 4.5 s."""
    connect_timeout: float = 2.0
    """Seconds one connect() may take before it counts as an error (one lost SYN is
    retransmitted after 1 s and still made: it shows in the tail, not as an error)."""

    def connect_deadline(self) -> float:
        """The connect run's time bound: its pauses plus 5 ms per connect, plus 10 s."""
        return 10.0 + self.connect_count * (self.connect_pause + 0.005)

    def duration(self, workload: str) -> float:
        """Seconds of a run; udp has rr's length unless given its own (same kind of
        closed-loop request/response, and ``--duration`` and the quick/full
        defaults then cover it without a key of its own)."""
        if workload == "udp" and "udp" not in self.durations:
            return self.durations["rr"]
        return self.durations[workload]

    def mem_n(self) -> tuple[int, str | None]:
        """Connections for the mem workload, capped by what a proxy can open.

        Each proxied connection costs the proxy two descriptors, and without
        CAP_SYS_RESOURCE nobody here may exceed the inherited hard limit.
        """
        cap = (nofile_hard_limit() - MEM_FD_RESERVE) // 2
        if self.mem_connections <= cap:
            return self.mem_connections, None
        return cap, (
            f"{self.mem_connections} requested, {cap} used: RLIMIT_NOFILE hard limit is "
            f"{nofile_hard_limit()} (no CAP_SYS_RESOURCE to raise it) and each proxied "
            f"connection needs 2 descriptors in the proxy"
        )


def _client(topo: Topology, c: Contender, argv: list[str], timeout: float,
            input_text: str | None = None) -> subprocess.CompletedProcess[str]:
    """Run the load generator where the path's client is (a pod on node1 for clusterip)."""
    return sh(topo.exec_argv(c.client_role, argv), check=False, timeout=timeout,
              input_text=input_text)


def _client_json(topo: Topology, c: Contender, argv: list[str], timeout: float, what: str,
                 input_text: str | None = None) -> dict[str, Any] | Run:
    """``_client`` for bench's own clients, which end with one JSON line: that line, or the
    failed Run naming ``what`` and the output's tail."""
    try:
        cp = _client(topo, c, argv, timeout, input_text)
    except CommandError as e:
        return Run.failed(f"{what}: {e}")
    try:
        return dict(json.loads(cp.stdout.strip().splitlines()[-1]))
    except (IndexError, ValueError, TypeError):
        return Run.failed(f"{what} rc={cp.returncode}: {(cp.stderr or cp.stdout)[-300:]}")


def _socket_states(topo: Topology, roles: tuple[str, ...]) -> dict[str, dict[str, int]]:
    """TCP socket counts by state, per role: one read of each namespace's table."""
    return {r: topo.thread(r).call(count_states) for r in roles}


def _time_wait(states: dict[str, dict[str, int]]) -> dict[str, int]:
    return {r: counts.get("TIME_WAIT", 0) for r, counts in states.items()}


_NOT_CLOSING = frozenset({"LISTEN", "ESTABLISHED", "TIME_WAIT"})


def _closing(states: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    """Sockets per role still closing (any state but LISTEN, ESTABLISHED, TIME_WAIT).

    A new connection whose 4-tuple meets one of these is answered with an ACK,
    not a SYN-ACK, and waits a SYN retransmission (1 s): a few of them collapse
    a connection rate the way TIME_WAIT collisions do.
    """
    return {r: {st: n for st, n in counts.items() if st not in _NOT_CLOSING}
            for r, counts in states.items()}


def _node1_sysctl_int(topo: Topology, key: str) -> int | None:
    cp = topo.run("node1", ["sysctl", "-n", key], check=False)
    try:
        return int(cp.stdout.strip())
    except ValueError:
        return None


def _conntrack_count(topo: Topology) -> int | None:
    return _node1_sysctl_int(topo, "net.netfilter.nf_conntrack_count")


def _conntrack_max(topo: Topology) -> int | None:
    return _node1_sysctl_int(topo, "net.netfilter.nf_conntrack_max")


def bulk(topo: Topology, c: Contender, s: Settings) -> Run:
    t = c.target()
    secs = s.durations["bulk"]
    if s.bulk_tool == "iperf3":
        return _bulk_iperf3(topo, c, s)
    out = _client_json(topo, c, [sys.executable, "-m", "bench.bulk", "source", "--host", t.ip,
                                 "--port", str(t.bulk_port), "--seconds", str(secs)],
                       secs + 90, "bulk sender")
    if isinstance(out, Run):
        return out
    detail = {"bytes_sent": out.get("sent"), "bytes_received": out.get("received"),
              "seconds": out.get("seconds"), "tool": "bench.bulk (1 MiB sendall/recv_into)"}
    if out.get("error"):
        return Run.failed(f"bulk: {out['error']}", **detail)
    if out["received"] != out["sent"]:
        return Run.failed(f"bytes received {out['received']} != sent {out['sent']}", **detail)
    return Run(ok=True, metrics={"gbps": float(out["gbps"])}, detail=detail)


def _bulk_iperf3(topo: Topology, c: Contender, s: Settings) -> Run:
    t = c.target()
    secs = s.durations["bulk"]
    try:
        cp = _client(topo, c, ["iperf3", "-c", t.ip, "-p", str(t.iperf_port), "-t", f"{secs:g}",
                            "-J"], secs + 60)
        r = parse_iperf3(cp.stdout)
    except (CommandError, ParseError) as e:
        return Run.failed(f"iperf3: {e}")
    detail = {"bytes_sent": r.sent_bytes, "bytes_received": r.received_bytes,
              "tool": "iperf3", "tail_allowance_bytes": s.iperf3_tail_allowance}
    problems = r.problems(s.iperf3_tail_allowance)
    if problems:
        return Run.failed("; ".join(problems), **detail)
    return Run(ok=True, metrics={"gbps": r.gbps}, detail=detail)


def _backend_role(c: Contender) -> str:
    """The backend's namespace: the pod on node1 (local path) or on node2."""
    return "pod1" if c.path == "local" else "pod2"


def _roles(c: Contender) -> tuple[str, ...]:
    """The namespaces a data-path run crosses: the client's, node1's and the backend's."""
    return tuple(dict.fromkeys((c.client_role, "node1", _backend_role(c))))


def _counters(topo: Topology, roles: tuple[str, ...]) -> dict[str, dict[str, int]]:
    return {r: topo.thread(r).call(read_counters) for r in roles}


def _wrk(topo: Topology, c: Contender, s: Settings, workload: str) -> Run:
    """One wrk run; its detail keeps the kernel counters that moved in each namespace
    (``counters``), and a run failed by socket errors says which of them did."""
    t = c.target()
    roles = _roles(c)
    before = _counters(topo, roles)
    secs = s.durations[workload]
    conns = s.rr_connections if workload == "rr" else s.cps_connections
    argv = ["wrk", f"-t{s.wrk_threads}", f"-c{conns}", f"-d{secs:g}s", "--latency",
            "--timeout", s.wrk_timeout]
    if workload == "cps":
        argv += ["-H", "Connection: close"]
    argv.append(f"http://{host_port(t.ip, t.http_port)}/")
    try:
        cp = _client(topo, c, argv, secs + 60)
    except CommandError as e:
        return Run.failed(f"wrk: {e}")
    try:
        w = parse_wrk(cp.stdout)
    except ParseError as e:
        return Run.failed(f"wrk rc={cp.returncode}: {e}: {(cp.stderr or cp.stdout)[-300:]}")
    detail: dict[str, Any] = {
        "requests": w.requests, "seconds": w.seconds, "connections": conns,
        "latency_ms": {str(k): v for k, v in w.latency_ms.items()},
        "socket_errors": {"connect": w.connect_errors, "read": w.read_errors,
                          "write": w.write_errors, "timeout": w.timeouts},
        "non_2xx": w.non_2xx,
        "counters": counter_deltas(before, _counters(topo, roles)),
    }
    problems = w.problems()
    if w.socket_errors:
        losses = explain_losses(detail["counters"], None if c.terminates_tcp else "node1")
        problems.append(f"during the run: {losses}" if losses
                        else "no kernel counter of a lost connection moved")
    dead = c.alive_problem()
    if dead:
        problems.append(dead)
    if problems:
        return Run.failed("; ".join(problems), **detail)
    if workload == "rr":
        if 50 not in w.latency_ms or 99 not in w.latency_ms:
            return Run.failed("wrk printed no latency distribution", **detail)
        return Run(ok=True, metrics={"req_per_s": w.req_per_s, "p50_ms": w.latency_ms[50],
                                     "p99_ms": w.latency_ms[99]}, detail=detail)
    return Run(ok=True, metrics={"conn_per_s": w.req_per_s}, detail=detail)


def rr(topo: Topology, c: Contender, s: Settings) -> Run:
    return _wrk(topo, c, s, "rr")


def cps(topo: Topology, c: Contender, s: Settings) -> Run:
    """New connection per request; TIME_WAIT per namespace recorded before and after."""
    roles = _roles(c)
    before = _socket_states(topo, roles)
    run = _wrk(topo, c, s, "cps")
    run.detail["time_wait_before"] = _time_wait(before)
    run.detail["closing_before"] = _closing(before)
    run.detail["time_wait_after"] = _time_wait(_socket_states(topo, roles))
    if isinstance(c, Kernel):
        count, limit = _conntrack_count(topo), _conntrack_max(topo)
        run.detail["conntrack_count_after"] = count
        run.detail["conntrack_max"] = limit
        if run.ok and count and limit and count >= 0.95 * limit:
            return Run.failed(f"conntrack table full ({count}/{limit}): new connections were "
                              f"dropped", **run.detail)
    return run


def _backend_established(topo: Topology, c: Contender) -> int:
    table = topo.thread(_backend_role(c)).call(read_tcp_table)
    return sum(1 for lp, _, st in table if lp == HTTP_PORT and st == "ESTABLISHED")


def mem(topo: Topology, c: Contender, s: Settings) -> Run:
    """RSS growth of the proxy per idle proxied connection, at N concurrent connections."""
    n, cap_note = s.mem_n()
    pids = c.pids()
    if not pids:
        return Run.failed("no proxy process to measure")
    t = c.target()
    base_backend = _backend_established(topo, c)
    time.sleep(0.2)
    rss0 = rss_bytes(c.pids())
    proc = subprocess.Popen(
        topo.exec_argv(c.client_role, [sys.executable, "-m", "bench.memclient", "--host", t.ip,
                                  "--port", str(t.http_port), "-n", str(n)]),
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=lambda: raise_nofile(nofile_hard_limit()),
    )
    detail: dict[str, Any] = {"connections": n, "rss_before": rss0}
    if cap_note:
        detail["capped"] = cap_note
    try:
        assert proc.stdout is not None and proc.stdin is not None
        line = proc.stdout.readline()
        try:
            opened = json.loads(line)
        except json.JSONDecodeError:
            return Run.failed(f"mem client: {line.strip() or proc.stderr.read()[-300:]}",
                              **detail)
        detail["client"] = opened
        if opened["opened"] != n:
            return Run.failed(f"only {opened['opened']} of {n} connections opened "
                              f"({opened['failed']} failed: {opened['error']})", **detail)
        reached = poll(lambda: _backend_established(topo, c) - base_backend >= n,
                             30.0, 0.2)
        at_backend = _backend_established(topo, c) - base_backend
        detail["at_backend"] = at_backend
        if not reached:
            return Run.failed(f"only {at_backend} of {n} connections reached the backend",
                              **detail)
        time.sleep(s.mem_settle)
        samples = []
        for _ in range(3):
            samples.append(rss_bytes(c.pids()))
            time.sleep(0.2)
        rss1 = sorted(samples)[1]
        detail["rss_after"] = rss1
        dead = c.alive_problem()
        proc.stdin.write("stop\n")
        proc.stdin.flush()
        tail = proc.stdout.readline()
        try:
            closed_early = json.loads(tail).get("closed_early", 0)
        except json.JSONDecodeError:
            closed_early = None
        detail["closed_early"] = closed_early
        if dead:
            return Run.failed(dead, **detail)
        if closed_early:
            return Run.failed(f"{closed_early} idle connections were closed by the proxy",
                              **detail)
        return Run(ok=True, metrics={"kib_per_conn": (rss1 - rss0) / n / 1024.0},
                   detail=detail)
    finally:
        if proc.poll() is None:
            try:
                proc.communicate(input="stop\n", timeout=30)
            except (subprocess.TimeoutExpired, ValueError, OSError):
                proc.kill()
                proc.wait(timeout=10)
        # Let the proxy tear the pairs down before anyone measures anything else.
        poll(lambda: _backend_established(topo, c) <= base_backend + 10, 20.0, 0.2)


def udp(topo: Topology, c: Contender, s: Settings) -> Run:
    """UDP request/response: datagrams per second and round-trip p50/p99 over ``udp_flows``.

    First a ``WHO`` through the contender (from the path's client): a proxy
    that does not forward UDP fails here with the reason, after at most 5 s,
    instead of the load timing out flow by flow.
    """
    t = c.target()
    if not t.udp_port:
        return Run.failed(f"{c.name} has no UDP port")
    try:
        who = c.verify_udp()
    except ContenderError as e:
        return Run.failed(f"UDP probe: {e}")
    secs = s.duration("udp")
    argv = [sys.executable, "-m", "bench.udpclient", "--host", t.ip, "--port", str(t.udp_port),
            "--flows", str(s.udp_flows), "--size", str(s.udp_size), "--seconds", f"{secs:g}",
            "--max-requests", str(s.udp_max_requests), "--timeout", f"{s.udp_timeout:g}",
            "--warmup-timeout", f"{s.udp_warmup_timeout:g}", "--max-loss", f"{s.udp_max_loss:g}"]
    out = _client_json(topo, c, argv, secs + s.udp_warmup_timeout + s.udp_timeout + 60,
                       "udp client")
    if isinstance(out, Run):
        return out
    detail: dict[str, Any] = {k: v for k, v in out.items() if k != "samples_ns"}
    detail["requests"] = out.get("replies", 0)
    detail["who"] = who
    detail["tool"] = "bench.udpclient (epoll, connected sockets, closed loop per flow)"
    # The client judges its own run (``FlowStats.problems``, unit-tested).
    problems = [f"udp client: {x}" for x in out.get("problems", [out.get("error")]) if x]
    lat = out.get("latency_ms") or {}
    if not problems and ("50" not in lat or "99" not in lat):
        problems.append("udp client printed no latency distribution")
    dead = c.alive_problem()
    if dead:
        problems.append(dead)
    if problems:
        return Run.failed("; ".join(problems), **detail)
    return Run(ok=True, metrics={"udp_per_s": float(out["rate"]), "udp_p50_ms": lat["50"],
                                 "udp_p99_ms": lat["99"]}, detail=detail)


def connect_run(latency: Any, n: int, pause_s: float) -> Run:
    """Judge ``bench.scaleprobe``'s ``latency`` answer for ``n`` connects (pure).

    Any connect error fails the run (as a wrk socket error fails cps): a
    percentile over the connections that happened to succeed would flatter a
    proxy that drops some. So does a short count (the client's deadline). The
    figures are nearest-rank percentiles in microseconds, an observed value each.
    """
    detail: dict[str, Any] = {
        "connections": n, "pause_ms": round(pause_s * 1000, 3),
        "tool": "bench.scaleprobe connect_times (one at a time, pause, RST close)"}
    if not isinstance(latency, dict) or not isinstance(latency.get("ms"), list):
        return Run.failed(f"connect client printed no latency: {str(latency)[:200]}", **detail)
    us = [float(x) * 1000.0 for x in latency["ms"]]
    errors = int(latency.get("error_count", 0))
    detail["connected"], detail["errors"] = len(us), errors
    if errors:
        first = (latency.get("errors") or ["?"])[0]
        return Run.failed(f"{errors} of {n} connects failed (first: {first})", **detail)
    if len(us) != n or not us:
        return Run.failed(f"{len(us)} of {n} connects timed", **detail)
    q = percentiles(us, (50, 90, 99, 100))
    detail.update(min_us=round(min(us), 1), p90_us=round(q[90], 1), max_us=round(q[100], 1))
    return Run(ok=True, metrics={"connect_p50_us": round(q[50], 1),
                                 "connect_p99_us": round(q[99], 1)}, detail=detail)


def connect(topo: Topology, c: Contender, s: Settings) -> Run:
    """Time added to connect() at light load: fresh connections to the cps target, one
    at a time, ``connect_pause`` apart, each RST-closed (no TIME_WAIT piles up).

    A process of its own in the client namespace (``bench.scaleprobe``, as the
    scale bench's latency points), not a harness thread: the harness's GIL
    would time its own pauses as the contender's.
    """
    t = c.target()
    n = s.connect_count
    job = {"port": t.http_port, "timeout": s.connect_timeout, "latency": [t.ip] * n,
           "deadline": s.connect_deadline(), "pause": s.connect_pause}
    out = _client_json(topo, c, [sys.executable, "-m", "bench.scaleprobe", "client"],
                       s.connect_deadline() + 30, "connect client", json.dumps(job))
    if isinstance(out, Run):
        return out
    run = connect_run(out.get("latency"), n, s.connect_pause)
    dead = c.alive_problem()
    if dead:
        return Run.failed(dead, **run.detail)
    return run


WORKLOAD_FUNCS = {"bulk": bulk, "rr": rr, "cps": cps, "connect": connect, "mem": mem,
                  "udp": udp}
