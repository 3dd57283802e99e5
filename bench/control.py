"""The control-plane workload (kpx only): apply time, convergence, idle CPU.

Why measured from outside: the brief runs ``kpx node --no-healthz``, so there
is no /metrics to read, and what a user waits for is the effect, not a log
line. So:

- **apply**: from the moment a state with N NodePort services (x 3 endpoints)
  is renamed into place until node1 has a listener on every one of the N
  ports, polled from ``/proc/thread-self/net/tcp`` of a thread inside node1
  (no subprocess per poll). The previous state has none of them, so this is
  a full apply of N services. A GET through the first and last new port
  must then reach a real endpoint. kpx's own log line about the sync, if it
  prints one, is recorded beside the figure for cross-checking.
- **converge**: a 1,000-service state plus a ``conv`` service whose single
  endpoint moves between two backends (pod1-a <-> pod1-b); after each rename,
  fresh connections are made until one reaches the new backend. A random
  pause (seeded, recorded) separates changes so the probe cannot phase-lock
  with any polling period inside kpx. A probe that fails outright is a
  correctness failure: moving an endpoint must never refuse a connection.
- **idle**: utime+stime of the kpx process tree over a few idle seconds with
  N services loaded, in percent of one core (clock-tick resolution: 10 ms of
  CPU, i.e. 0.2% over 5 s).
"""

from __future__ import annotations

import random
import re
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from bench import k8s_state
from bench.backends import HTTP_PORT
from bench.contenders import ContenderError, Kpx, bench_state, http_get
from bench.procs import cpu_seconds, nofile_hard_limit, wait_until
from bench.results import Run
from bench.topology import NODE1_IP, POD1_ALT_IP, POD1_IP, POD2_IP, listening_ports

CONV_NODE_PORT = 30402
CONV_NAMES = ("pod1-a", "pod1-b")
SYNC_LOG = re.compile(r"generation \d+|\bsync\w* .*\d|\bappl\w* .*\d", re.I)
"""kpx's own account of a state load, recorded beside the externally timed apply."""


@dataclass
class ControlSettings:
    sizes: tuple[int, ...] = (1000, 10000)
    changes: int = 100
    conv_services: int = 1000
    idle_seconds: float = 5.0
    first_port: int = 20000
    apply_timeout: float = 120.0
    stall_timeout: float = 30.0
    change_timeout: float = 10.0
    seed: int = 5
    pause_range: tuple[float, float] = (0.05, 0.25)
    endpoints: tuple[tuple[str, str], ...] = field(default_factory=lambda: (
        (POD1_IP, "node1"), (POD1_ALT_IP, "node1"), (POD2_IP, "node2")))


def percentile(values: list[float], p: float) -> float:
    """Nearest-rank percentile (p in 0-100): an observed value, as latency reports use."""
    if not values:
        raise ValueError("no values")
    ordered = sorted(values)
    k = max(0, min(len(ordered) - 1, int(-(-p * len(ordered) // 100)) - 1))
    return ordered[k]


class Control:
    """Drives one kpx process through the control measurements."""

    def __init__(self, kpx: Kpx, cs: ControlSettings) -> None:
        self.kpx = kpx
        self.cs = cs
        self.topo = kpx.topo
        t = kpx.target()
        self.base_ports = (t.http_port, t.bulk_port)
        self.eps = tuple(k8s_state.Ep(ip, n) for ip, n in cs.endpoints)

    # ---- state rendering ---------------------------------------------------------

    def state(self, n: int, conv: str | None = None) -> str:
        extra = k8s_state.many_services(n, self.cs.first_port, self.eps, HTTP_PORT)
        if conv is not None:
            ip = POD1_IP if conv == "pod1-a" else POD1_ALT_IP
            extra.append(k8s_state.ServiceSpec(
                "conv", (k8s_state.Port("http", 80, HTTP_PORT, CONV_NODE_PORT),),
                (k8s_state.Ep(ip, "node1"),)))
        return bench_state("local", *self.base_ports, extra=extra)

    def write(self, text: str) -> float:
        k8s_state.write_atomic(self.kpx.state_path, text)
        return time.monotonic()

    # ---- observations ------------------------------------------------------------

    def listening_in_range(self, n: int) -> int:
        lo, hi = self.cs.first_port, self.cs.first_port + n
        ports = self.topo.thread("node1").call(listening_ports)
        return sum(1 for p in ports if lo <= p < hi)

    def _dead(self) -> str | None:
        return self.kpx.alive_problem()

    def _last_sync_line(self) -> str | None:
        lines = [ln for ln in self.kpx.proc.tail(40, 8000).splitlines()
                 if SYNC_LOG.search(ln)] if self.kpx.proc else []
        return lines[-1][-300:] if lines else None

    # ---- measurements ------------------------------------------------------------

    def wait_count(self, n: int, done: Callable[[int], bool], poll: float
                   ) -> tuple[bool, int]:
        """Poll the listener count until ``done(count)``, kpx dies, or progress stalls.

        A stall (no change for ``stall_timeout``) ends the wait early: kpx
        that hit EMFILE, say, would otherwise burn the whole apply timeout.
        """
        deadline = time.monotonic() + self.cs.apply_timeout
        last, last_change = -1, time.monotonic()
        while True:
            count = self.listening_in_range(n)
            now = time.monotonic()
            if done(count):
                return True, count
            if count != last:
                last, last_change = count, now
            stalled = now - last_change
            if self._dead() or now >= deadline or stalled >= self.cs.stall_timeout:
                return False, count
            # Stuck on EMFILE will not recover: no need to sit out the stall timeout.
            if stalled >= 5.0 and self._log_hint():
                return False, count
            time.sleep(poll)

    def _log_hint(self) -> str:
        """Why kpx may be stuck, from its log: EMFILE is the one seen here."""
        if self.kpx.proc is None:
            return ""
        text = self.kpx.proc.tail(50, 20000)
        if "Too many open files" in text:
            return (f" (kpx log: EMFILE, Too many open files; RLIMIT_NOFILE hard limit is "
                    f"{nofile_hard_limit()})")
        return ""

    def clear(self, n: int) -> str | None:
        """Back to the small state; the N ports must close (so the next apply is full)."""
        self.write(self.state(0))
        ok, count = self.wait_count(n, lambda c: c == 0, 0.05)
        if self._dead():
            return self._dead()
        if not ok:
            return (f"{count} of {n} services still listening after removing them"
                    f"{self._log_hint()}")
        return None

    def apply(self, n: int) -> Run:
        err = self.clear(n)
        if err:
            return Run.failed(f"before apply: {err}")
        text = self.state(n)
        time.sleep(0.3)
        t0 = self.write(text)
        poll = 0.01
        ok, count = self.wait_count(n, lambda c: c >= n, poll)
        elapsed = time.monotonic() - t0
        detail: dict[str, Any] = {"services": n, "endpoints_per_service": len(self.eps),
                                  "poll_interval_s": poll,
                                  "state_bytes": len(text.encode())}
        if self._dead():
            return Run.failed(str(self._dead()), **detail)
        if not ok:
            return Run.failed(f"only {count} of {n} NodePorts listening after "
                              f"{elapsed:.0f}s{self._log_hint()}", **detail)
        names = {"pod1-a", "pod1-b", "pod2"}
        for port in (self.cs.first_port, self.cs.first_port + n - 1):
            try:
                got = self.topo.thread("client").call(http_get, NODE1_IP, port)
            except OSError as e:
                return Run.failed(f"GET through new NodePort {port} failed: {e}", **detail)
            if got not in names:
                return Run.failed(f"NodePort {port} answered {got!r}", **detail)
        detail["kpx_log"] = self._last_sync_line()
        return Run(ok=True, metrics={"apply_s": elapsed}, detail=detail)

    def idle(self, n: int) -> Run:
        """CPU of kpx over ``idle_seconds`` with ``n`` services loaded and no traffic."""
        if self.listening_in_range(n) < n:
            return Run.failed(f"{n} services are not loaded")
        time.sleep(1.0)
        pids = self.kpx.pids()
        c0, t0 = cpu_seconds(pids), time.monotonic()
        time.sleep(self.cs.idle_seconds)
        c1, t1 = cpu_seconds(self.kpx.pids()), time.monotonic()
        if self._dead():
            return Run.failed(str(self._dead()))
        return Run(ok=True, metrics={"idle_cpu_pct": 100.0 * (c1 - c0) / (t1 - t0)},
                   detail={"services": n, "seconds": round(t1 - t0, 3),
                           "cpu_seconds": round(c1 - c0, 4)})

    def _probe(self) -> str:
        return self.topo.thread("client").call(http_get, NODE1_IP, CONV_NODE_PORT, 1.0)

    def converge(self, progress: Callable[[int, int], None] | None = None) -> Run:
        n = self.cs.conv_services
        rng = random.Random(self.cs.seed)
        texts = {name: self.state(n, name) for name in CONV_NAMES}
        self.write(texts["pod1-a"])
        ready = wait_until(lambda: self._try_probe() == "pod1-a", self.cs.apply_timeout, 0.05)
        detail: dict[str, Any] = {"services": n + 1, "changes": self.cs.changes,
                                  "seed": self.cs.seed, "pause_range_s": self.cs.pause_range}
        if not ready:
            return Run.failed(self._dead() or "conv service never reached pod1-a", **detail)
        samples: list[float] = []
        probe_errors: list[str] = []
        probes = 0
        current = "pod1-a"
        for i in range(self.cs.changes):
            time.sleep(rng.uniform(*self.cs.pause_range))
            want = "pod1-b" if current == "pod1-a" else "pod1-a"
            t0 = self.write(texts[want])
            deadline = t0 + self.cs.change_timeout
            got = None
            while time.monotonic() < deadline:
                probes += 1
                try:
                    got = self._probe()
                except OSError as e:
                    probe_errors.append(f"change {i}: {e}")
                    time.sleep(0.005)
                    continue
                if got == want:
                    break
            if got != want:
                return Run.failed(
                    self._dead() or f"change {i}: still {got!r} {self.cs.change_timeout:.0f}s "
                    f"after moving the endpoint to {want}", samples_ms=samples, **detail)
            samples.append((time.monotonic() - t0) * 1000.0)
            current = want
            if progress:
                progress(i + 1, self.cs.changes)
        detail.update(samples_ms=[round(x, 3) for x in samples], probes=probes,
                      probe_errors=len(probe_errors))
        if probe_errors:
            return Run.failed(f"{len(probe_errors)} probe connections failed while the "
                              f"endpoint moved (first: {probe_errors[0]})", **detail)
        return Run(ok=True, metrics={
            "converge_p50_ms": statistics.median(samples),
            "converge_p99_ms": percentile(samples, 99),
        }, detail=detail)

    def _try_probe(self) -> str | None:
        try:
            return self._probe()
        except OSError:
            return None


def run_control(kpx: Kpx, cs: ControlSettings, runs: int,
                on_step: Callable[[str], None], on_run: Callable[[str, int, Run], None],
                ) -> None:
    """All control runs for ``runs`` rounds, each handed to ``on_run(workload, round, run)``.

    Each round: a fresh kpx applies every size (and idles with it loaded),
    then another fresh kpx runs the convergence series, so a failed
    10,000-service apply (EMFILE, say) cannot spoil the convergence figure.
    """
    workloads = [w for n in cs.sizes for w in (f"apply-{n}", f"idle-{n}")]
    for r in range(runs):
        on_step(f"control round {r + 1}/{runs}: starting kpx")
        try:
            kpx.start("local")
        except ContenderError as e:
            kpx.stop()
            for w in workloads:
                on_run(w, r, Run.failed(f"start: {e}"))
        else:
            try:
                ctl = Control(kpx, cs)
                for n in cs.sizes:
                    on_step(f"control round {r + 1}/{runs}: apply {n} services")
                    run = ctl.apply(n)
                    on_run(f"apply-{n}", r, run)
                    on_step(f"control round {r + 1}/{runs}: idle CPU with {n} services")
                    on_run(f"idle-{n}", r,
                           ctl.idle(n) if run.ok else Run.failed(f"apply {n} failed"))
            finally:
                kpx.stop()
        if cs.changes <= 0:
            continue
        on_step(f"control round {r + 1}/{runs}: starting kpx for convergence")
        try:
            kpx.start("local")
        except ContenderError as e:
            kpx.stop()
            on_run("converge", r, Run.failed(f"start: {e}"))
            continue
        try:
            def prog(i: int, total: int, r: int = r) -> None:
                on_step(f"control round {r + 1}/{runs}: endpoint change {i}/{total}")

            on_run("converge", r, Control(kpx, cs).converge(prog))
        finally:
            kpx.stop()
