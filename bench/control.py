"""The control-plane workload (kpx only, both proxy modes): apply time, convergence, idle CPU.

Owns: the apply, converge, idle and stall measurements of one kpx against
its own state file, and the checks that make each run count (every port
in force, the moved endpoint reached, no probe refused).

Never: read kpx's internals (no ``/metrics``, no import of ``proxy``): only
what a user sees from outside, the kernel's state (listeners, or kpx's nft
set) and the answers.

Why measured from outside: the brief runs ``kpx node --no-healthz``, so there
is no /metrics to read, and what a user waits for is the effect, not a log
line. So:

- **apply**: from the moment a state with N NodePort services (x 3 endpoints)
  is renamed into place until all N ports are in force in node1's kernel:
  for the relay (``kpx``), a listener on every one of them, polled with a
  sock_diag dump from a thread inside node1 (no subprocess per poll); for
  ``kpx-nfq``, which has no listeners, every one of them in kpx's nft set
  of queued ports (``nft -j list set ip kpx_nfq ports``, run from that
  thread: what ``nft`` shows is what the kernel queues). The previous state
  has none of them, so this is a full apply of N services. A GET through
  the first and last new port must then reach a real endpoint. kpx's own
  log line about the sync, if it prints one, is recorded beside the figure
  for cross-checking.
- **converge**: a 1,000-service state plus a ``conv`` service whose single
  endpoint moves between two backends (pod1-a <-> pod1-b); after each rename,
  fresh connections are made until one reaches the new backend. A random
  pause (seeded, recorded) separates changes so the probe cannot phase-lock
  with any polling period inside kpx. A probe that fails outright is a
  correctness failure: moving an endpoint must never refuse a connection.
- **idle**: utime+stime of the kpx process tree over a few idle seconds with
  N services loaded, in percent of one core (clock-tick resolution: 10 ms of
  CPU, i.e. 0.2% over 5 s).
- **stall**: while kpx (healthz on, node1's IP) applies a 50,000-service state,
  a fresh connection through an existing NodePort and a fresh ``/healthz``
  request start every 10 ms from the client, open loop (``bench.prober``
  says why); their latencies give p50/p99/max, target p99 <= 50 ms. Of the
  50,000 services, 10,000 are NodePorts and the rest ClusterIP (with slices,
  so parsed and linked like the others): 50,000 listeners need 50,000 fds
  and the hard RLIMIT_NOFILE here is 20,000 (and 50,000 nodePorts do not fit
  a port range anyway). A probe that errors fails the run; one that times out
  counts at the timeout. kpx-nfq gets the very same state (same clamp, same
  10,000 NodePorts), so the two modes' figures compare, though it needs no
  descriptor per NodePort.
"""

from __future__ import annotations

import json
import random
import re
import statistics
import subprocess
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from bench import k8s_state
from bench.backends import HTTP_PORT
from bench.contenders import ContenderError, Kpx, bench_state, http_get
from bench.prober import ProbeProcess, ProbeSeries, ProbeTarget, probe_open_loop
from bench.procs import cpu_seconds, nofile_hard_limit
from bench.results import Run
from bench.topology import (
    NODE1_IP,
    POD1_ALT_IP,
    POD1_IP,
    POD2_IP,
    listening_ports,
)
from lab.common import poll, write_atomic

CONV_PORT_OFFSET = 2
"""The ``conv`` service's NodePort is the contender's base + 2 (kpx: 30402, kpx-nfq: 30602):
each mode its own front port, as every contender has (``bench.contenders``)."""
CONV_NAMES = ("pod1-a", "pod1-b")
HEALTHZ_PORT = 10256
STALL_FD_RESERVE = 4000
"""Descriptors kept free beside the stall state's listeners: probe relays (2 each)."""
VIPS_LOG = re.compile(r"service VIPs in force \(generation \d+\): (\d+) VIPs")
SYNC_LOG = re.compile(r"generation \d+|\bsync\w* .*\d|\bappl\w* .*\d", re.I)
"""kpx's own account of a state load, recorded beside the externally timed apply."""
NFQ_TABLE = "kpx_nfq"
"""kpx's nft table in ``--proxy-mode nfqueue`` (``proxy.nfqueue.rules.NFT_TABLE``: the
bench may not import ``proxy``, so it names it itself; tests/bench check that both agree)."""
NFQ_PORTS_SET = "ports"
"""Its set of TCP ports queued on every local address: the NodePorts in force."""
NFQ_VIPS_SET = "vips"
"""Its set of service VIPs (a SYN to one of them is queued or reset, never routed on)."""
NFQ_POLL_COST_FACTOR = 2.0
"""kpx-nfq's apply poll sleeps at least this many times what the last ``nft`` listing took:
listing 10,000 ports costs ``nft`` about 18 ms of CPU here, which polled back to back
would take most of a core from the two kpx runs on (the relay's sock_diag dump stays
in-process, and keeps its fixed 10 ms). So the harness takes at most a third of a core,
and the figure overshoots by at most about three listings."""


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
    cluster_ips: bool = True
    """Also apply each size with every service having a clusterIP (``apply-cip-N``)."""
    stall_services: int = 50000
    """0 skips the stall workload."""
    stall_node_ports: int = 10000
    """How many of ``stall_services`` are NodePorts (one listener fd each)."""
    stall_interval: float = 0.01
    stall_tail: float = 1.0
    """Probing goes on this long after the last listener is up."""
    stall_probe_timeout: float = 10.0
    endpoints: tuple[tuple[str, str], ...] = field(default_factory=lambda: (
        (POD1_IP, "node1"), (POD1_ALT_IP, "node1"), (POD2_IP, "node2")))


def nft_set_elements(listing: str) -> list[Any]:
    """The elements of the one set in ``nft -j list set`` output (an empty set: []).

    An element with a timeout, counter or comment comes as ``{"elem": {"val": v, ...}}``;
    its value is returned. ValueError when the text is not such a listing.
    """
    try:
        doc = json.loads(listing)
    except ValueError as e:
        raise ValueError(f"nft -j listing is not JSON: {e}") from None
    items = doc.get("nftables") if isinstance(doc, dict) else None
    if not isinstance(items, list):
        raise ValueError("nft -j listing has no \"nftables\" array")
    sets = [o["set"] for o in items if isinstance(o, dict) and isinstance(o.get("set"), dict)]
    if len(sets) != 1:
        raise ValueError(f"nft -j listing holds {len(sets)} sets, expected 1")
    elems = sets[0].get("elem", [])
    if not isinstance(elems, list):
        raise ValueError(f"set {sets[0].get('name')!r}: \"elem\" is not a list")
    return [e["elem"].get("val") if isinstance(e, dict) and isinstance(e.get("elem"), dict)
            else e for e in elems]


def nft_ports_in(elements: Iterable[Any], lo: int, hi: int) -> int:
    """How many ports in ``[lo, hi)`` the elements of a port set hold.

    Ports come as numbers, or as ``{"range": [a, b]}`` in a set with intervals
    (both ends included); ValueError names any other element.
    """
    count = 0
    for e in elements:
        if isinstance(e, int) and not isinstance(e, bool):
            count += lo <= e < hi
        elif (isinstance(e, dict) and isinstance(e.get("range"), list) and len(e["range"]) == 2
              and all(isinstance(x, int) and not isinstance(x, bool) for x in e["range"])):
            a, b = e["range"]
            count += max(0, min(b + 1, hi) - max(a, lo))
        else:
            raise ValueError(f"port set element {e!r}: not a port or a port range")
    return count


def nft_addresses_of(elements: Iterable[Any], want: Iterable[str]) -> int:
    """How many of the addresses ``want`` an address set's elements hold."""
    have = set()
    for e in elements:
        if not isinstance(e, str):
            raise ValueError(f"address set element {e!r}: not an address")
        have.add(e)
    return len(have & set(want))


def nft_list_set(table: str, name: str) -> list[Any]:
    """``nft -j list set ip TABLE NAME`` in the calling thread's netns; [] if not there.

    Run from a thread living in node1 (``NsThread``): the child inherits that
    thread's namespace. The table or set being absent (kpx not started yet, or
    gone) reads as empty; any other failure is an OSError with nft's words.
    """
    cp = subprocess.run(["nft", "-j", "list", "set", "ip", table, name],
                        capture_output=True, text=True, timeout=30.0, check=False)
    if cp.returncode != 0:
        if "No such file or directory" in cp.stderr:
            return []
        raise OSError(f"nft -j list set ip {table} {name} -> rc {cp.returncode}: "
                      f"{cp.stderr.strip()[-300:]}")
    try:
        return nft_set_elements(cp.stdout)
    except ValueError as e:
        raise OSError(f"nft -j list set ip {table} {name}: {e}") from None


class InForce(Protocol):
    """What a kpx mode has in force in node1's kernel, seen from outside."""

    what: str
    """How a NodePort in force is described in failure messages."""
    cost_factor: float
    """A poll sleeps at least this many times what the last poll took (0: a fixed interval)."""

    def node_ports(self, lo: int, hi: int) -> int:
        """NodePorts in ``[lo, hi)`` in force."""
        ...

    def vips(self, want: frozenset[str]) -> int:
        """Service VIPs in force (at least those of ``want``, when that many)."""
        ...


class Listeners:
    """The relay (``--proxy-mode userspace``): a NodePort is in force once it listens."""

    what = "listening"
    cost_factor = 0.0

    def __init__(self, ctl: Control) -> None:
        self.ctl = ctl

    def node_ports(self, lo: int, hi: int) -> int:
        ports = self.ctl.topo.thread("node1").call(listening_ports)
        return sum(1 for p in ports if lo <= p < hi)

    def vips(self, want: frozenset[str]) -> int:
        """What kpx last logged in force: its VIPs share one listener, and routes and the
        nft table are written in the background, so its log is what says they are."""
        return self.ctl.vips_in_force()


class NfqueueSets:
    """``--proxy-mode nfqueue``: no listener; a NodePort is in force once it is in kpx's
    nft set of queued ports (the SYN is then queued, decided and DNATed), a VIP once
    it is in its set of VIPs."""

    what = f"in nft set ip {NFQ_TABLE} {NFQ_PORTS_SET}"
    cost_factor = NFQ_POLL_COST_FACTOR

    def __init__(self, ctl: Control) -> None:
        self.ctl = ctl

    def node_ports(self, lo: int, hi: int) -> int:
        elems = self.ctl.topo.thread("node1").call(nft_list_set, NFQ_TABLE, NFQ_PORTS_SET)
        try:
            return nft_ports_in(elems, lo, hi)
        except ValueError as e:  # fails the cell, never the whole bench
            raise OSError(f"nft set ip {NFQ_TABLE} {NFQ_PORTS_SET}: {e}") from None

    def vips(self, want: frozenset[str]) -> int:
        elems = self.ctl.topo.thread("node1").call(nft_list_set, NFQ_TABLE, NFQ_VIPS_SET)
        try:
            return nft_addresses_of(elems, want)
        except ValueError as e:
            raise OSError(f"nft set ip {NFQ_TABLE} {NFQ_VIPS_SET}: {e}") from None


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
        self.conv_port = kpx.port_base + CONV_PORT_OFFSET
        self.eps = tuple(k8s_state.Ep(ip, n) for ip, n in cs.endpoints)
        self.view: InForce = NfqueueSets(self) if kpx.proxy_mode == "nfqueue" else Listeners(self)
        self.polls: list[float] = []
        """Seconds each in-force poll of the current wait took."""

    # ---- state rendering ---------------------------------------------------------

    def state(self, n: int, conv: str | None = None, cluster_ips: bool = False) -> str:
        """The bench service + ``n`` NodePort services (each with a clusterIP if asked)."""
        extra = k8s_state.many_services(n, self.cs.first_port, self.eps, HTTP_PORT,
                                        cluster_ips=cluster_ips)
        if conv is not None:
            ip = POD1_IP if conv == "pod1-a" else POD1_ALT_IP
            extra.append(k8s_state.ServiceSpec(
                "conv", (k8s_state.Port("http", 80, HTTP_PORT, self.conv_port),),
                (k8s_state.Ep(ip, "node1"),)))
        return bench_state("local", *self.base_ports, extra=extra)

    def write(self, text: str) -> float:
        write_atomic(self.kpx.state_path, text)
        return time.monotonic()

    # ---- observations ------------------------------------------------------------

    def in_force(self, n: int) -> int:
        """How many of the N NodePorts node1's kernel has in force (listening, or in the set)."""
        return self.view.node_ports(self.cs.first_port, self.cs.first_port + n)

    def vips_in_force(self) -> int:
        """How many VIPs kpx last reported in force (routes and nft table written), from its log."""
        text = self.kpx.proc.tail(400, 60000) if self.kpx.proc else ""
        found = VIPS_LOG.findall(text)
        return int(found[-1]) if found else 0

    def _dead(self) -> str | None:
        return self.kpx.alive_problem()

    def _last_sync_line(self) -> str | None:
        lines = [ln for ln in self.kpx.proc.tail(40, 8000).splitlines()
                 if SYNC_LOG.search(ln)] if self.kpx.proc else []
        return lines[-1][-300:] if lines else None

    # ---- measurements ------------------------------------------------------------

    def wait_count(self, n: int, done: Callable[[int], bool], interval: float,
                   vips: frozenset[str] = frozenset()) -> tuple[bool, int]:
        """Poll the in-force count until ``done(count)``, kpx dies, or progress stalls.

        ``vips``: also until at least that many VIPs are in force (asked only
        once the ports are done). Each poll is then followed by a pause of
        ``interval``, or ``view.cost_factor`` times what the poll took if more.

        A stall (no change for ``stall_timeout``) ends the wait early: kpx
        that hit EMFILE, say, would otherwise burn the whole apply timeout.
        OSError when the kernel's state cannot be read (``nft`` failing).
        """
        deadline = time.monotonic() + self.cs.apply_timeout
        last, last_change = -1, time.monotonic()
        self.polls = []
        while True:
            p0 = time.monotonic()
            count = self.in_force(n)
            finished = done(count) and (not vips or self.view.vips(vips) >= len(vips))
            now = time.monotonic()
            self.polls.append(now - p0)
            if finished:
                return True, count
            if count != last:
                last, last_change = count, now
            stalled = now - last_change
            if self._dead() or now >= deadline or stalled >= self.cs.stall_timeout:
                return False, count
            # Stuck on EMFILE will not recover: no need to sit out the stall timeout.
            if stalled >= 5.0 and self._log_hint():
                return False, count
            time.sleep(max(interval, self.view.cost_factor * self.polls[-1]))

    def _poll_detail(self) -> dict[str, Any]:
        """How the last wait polled: count and mean cost (the figure's resolution)."""
        p = self.polls
        return {"polls": len(p), "poll_ms_mean": round(1000 * sum(p) / len(p), 3) if p else None}

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
        try:
            ok, count = self.wait_count(n, lambda c: c == 0, 0.05)
        except OSError as e:
            return str(e)
        if self._dead():
            return self._dead()
        if not ok:
            return (f"{count} of {n} services still {self.view.what} after removing them"
                    f"{self._log_hint()}")
        return None

    def apply(self, n: int, cluster_ips: bool = False) -> Run:
        """Apply N NodePort services; with ``cluster_ips`` each also has a clusterIP.

        Done when every NodePort is in force and, with clusterIPs, every VIP:
        for the relay, when kpx reports them in force (routes and nft table
        written: its "service VIPs in force" line, polled with the
        listeners; the VIPs share one listener, so N services with
        clusterIPs still need N + 1 descriptors); for kpx-nfq, when every
        one is in its nft set of VIPs.
        """
        err = self.clear(n)
        if err:
            return Run.failed(f"before apply: {err}")
        cips = k8s_state.many_cluster_ips(n) if cluster_ips else []
        text = self.state(n, cluster_ips=cluster_ips)
        time.sleep(0.3)
        t0 = self.write(text)
        interval = 0.01
        detail: dict[str, Any] = {"services": n, "endpoints_per_service": len(self.eps),
                                  "node_ports": n, "cluster_ips": len(cips),
                                  "nofile_hard_limit": nofile_hard_limit(),
                                  "poll_interval_s": interval,
                                  "state_bytes": len(text.encode())}
        try:
            ok, count = self.wait_count(n, lambda c: c >= n, interval, frozenset(cips))
            elapsed = time.monotonic() - t0
            detail.update(self._poll_detail())
            if self._dead():
                return Run.failed(str(self._dead()), **detail)
            if not ok:
                return Run.failed(f"only {count} of {n} NodePorts {self.view.what}, "
                                  f"{self.view.vips(frozenset(cips))} VIPs in force after "
                                  f"{elapsed:.0f}s{self._log_hint()}", **detail)
        except OSError as e:
            return Run.failed(f"reading what is in force: {e}", **detail)
        vips = frozenset(cips)
        node_ports = n
        names = {"pod1-a", "pod1-b", "pod2"}
        checks = [(NODE1_IP, self.cs.first_port),
                  (NODE1_IP, self.cs.first_port + node_ports - 1)]
        if cips:
            # From a pod on node1, as a ClusterIP is meant to be reached.
            checks += [(cips[0], 80), (cips[-1], 80)]
        for ip, port in checks:
            role = "pod1" if ip in vips else "client"
            try:
                got = self.topo.thread(role).call(http_get, ip, port)
            except OSError as e:
                # kpx-nfq: refused with every port already in its set is kpx's own
                # window (a SYN decided before its table holds the new plans), not ours.
                late = (time.monotonic() - t0 - elapsed) * 1000
                return Run.failed(f"GET through new {ip}:{port} failed {late:.0f} ms after "
                                  f"all {n} NodePorts were {self.view.what}: {e}", **detail)
            if got not in names:
                return Run.failed(f"{ip}:{port} answered {got!r}", **detail)
        # When the checks' GETs had all answered: after apply_s by the checks' own time.
        detail["answered_s"] = round(time.monotonic() - t0, 3)
        detail["kpx_log"] = self._last_sync_line()
        return Run(ok=True, metrics={"apply_s": elapsed}, detail=detail)

    def idle(self, n: int) -> Run:
        """CPU of kpx over ``idle_seconds`` with ``n`` services loaded and no traffic."""
        try:
            loaded = self.in_force(n)
        except OSError as e:
            return Run.failed(f"reading what is in force: {e}")
        if loaded < n:
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
        return self.topo.thread("client").call(http_get, NODE1_IP, self.conv_port, 1.0)

    def converge(self, progress: Callable[[int, int], None] | None = None) -> Run:
        n = self.cs.conv_services
        rng = random.Random(self.cs.seed)
        texts = {name: self.state(n, name) for name in CONV_NAMES}
        self.write(texts["pod1-a"])
        ready = poll(lambda: self._try_probe() == "pod1-a", self.cs.apply_timeout, 0.05)
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

    def stall_state(self) -> tuple[str, int]:
        """The stall workload's state and its NodePort count (clamped to the fd budget)."""
        n = self.cs.stall_services
        node_ports = max(0, min(self.cs.stall_node_ports, n,
                                nofile_hard_limit() - STALL_FD_RESERVE))
        extra = k8s_state.many_services(node_ports, self.cs.first_port, self.eps, HTTP_PORT)
        extra += k8s_state.cluster_ip_services(n - node_ports, self.eps, HTTP_PORT)
        return bench_state("local", *self.base_ports, extra=extra), node_ports

    def stall(self) -> Run:
        """New-connection and /healthz latency while a big state is applied."""
        cs = self.cs
        targets = [ProbeTarget("conn", NODE1_IP, self.base_ports[0]),
                   ProbeTarget("healthz", NODE1_IP, HEALTHZ_PORT,
                               b"GET /healthz HTTP/1.0\r\nHost: bench\r\n\r\n")]
        ready = poll(lambda: self._answers(targets), 10.0, 0.05)
        if not ready:
            return Run.failed(self._dead() or "NodePort or /healthz never answered before "
                              "the apply")
        text, node_ports = self.stall_state()
        detail: dict[str, Any] = {
            "services": cs.stall_services, "node_ports": node_ports,
            "cluster_ip_services": cs.stall_services - node_ports,
            "state_bytes": len(text.encode()), "probe_interval_s": cs.stall_interval,
            "nofile_hard_limit": nofile_hard_limit()}
        data = text.encode()  # encoded now: not while the probes run
        prober = ProbeProcess(self.topo.exec_argv("client", []), targets, cs.stall_interval,
                              cs.apply_timeout + cs.stall_tail, cs.stall_probe_timeout)
        try:
            # 0.3 s of probes before the write: the baseline the stall stands out from.
            if poll(lambda: prober.proc.poll() is not None, 0.3, 0.05):
                return Run.failed(f"prober exited early: {prober.finish()}", **detail)
            t0 = time.monotonic()
            write_atomic(self.kpx.state_path, data)
            # A slow poll: each one dumps up to 10,000 sockets (or set elements), CPU
            # the two cores kpx runs on would otherwise lose to the harness (apply_s
            # is a by-product).
            try:
                ok, count = self.wait_count(node_ports, lambda c: c >= node_ports, 0.25)
            except OSError as e:
                ok, count = False, -1
                detail["poll_error"] = str(e)
            detail["apply_s"] = round(time.monotonic() - t0, 3)
            if ok:
                time.sleep(cs.stall_tail)
            series = prober.finish()
        finally:
            prober.kill()
        for name, ser in series.items():
            detail[name] = _series_detail(ser)
        detail["kpx_log"] = self._last_sync_line()
        if self._dead():
            return Run.failed(str(self._dead()), **detail)
        if "poll_error" in detail:
            return Run.failed(f"reading what is in force: {detail['poll_error']}", **detail)
        if not ok:
            return Run.failed(f"only {count} of {node_ports} NodePorts {self.view.what} after "
                              f"{detail['apply_s']:.0f}s{self._log_hint()}", **detail)
        metrics: dict[str, float] = {}
        for name, ser in series.items():
            if ser.errors or ser.bad_status:
                first = ser.errors[0] if ser.errors else "a non-200 answer"
                return Run.failed(f"{name} probes: {len(ser.errors)} errors, {ser.bad_status} "
                                  f"non-200 during the apply (first: {first})", **detail)
            if not ser.latencies_ms:
                return Run.failed(f"{name} probes: no sample", **detail)
            metrics[f"stall_{name}_p50_ms"] = statistics.median(ser.latencies_ms)
            metrics[f"stall_{name}_p99_ms"] = percentile(ser.latencies_ms, 99)
            metrics[f"stall_{name}_max_ms"] = max(ser.latencies_ms)
        return Run(ok=True, metrics=metrics, detail=detail)

    def _answers(self, targets: list[ProbeTarget]) -> bool:
        """Every target answers one probe with a 200 (kpx is up, healthz included)."""
        got = self.topo.thread("client").call(
            probe_open_loop, targets, 1.0, threading.Event(), 0.5, 2.0)
        return all(s.latencies_ms and not s.errors and not s.bad_status
                   for s in got.values())

    def _try_probe(self) -> str | None:
        try:
            return self._probe()
        except OSError:
            return None




def _series_detail(ser: ProbeSeries) -> dict[str, Any]:
    lat = ser.latencies_ms
    return {"probes": ser.sent, "timeouts": ser.timeouts, "errors": len(ser.errors),
            "first_errors": ser.errors[:3], "bad_status": ser.bad_status,
            "skipped": ser.skipped,
            "p50_ms": round(statistics.median(lat), 3) if lat else None,
            "p99_ms": round(percentile(lat, 99), 3) if lat else None,
            "max_ms": round(max(lat), 3) if lat else None,
            "over_50ms": sum(1 for x in lat if x > 50.0),
            "slow_due_s": [round(d, 3) for d, x in zip(ser.due_s, lat, strict=True)
                           if x > 50.0][:50]}
    """When (seconds after probing began, the write ~0.3 s later) the slow probes were due."""


def run_control(kpx: Kpx, cs: ControlSettings, runs: int,
                on_step: Callable[[str], None], on_run: Callable[[str, int, Run], None],
                ) -> None:
    """All control runs for ``runs`` rounds, each handed to ``on_run(workload, round, run)``.

    Each round: a fresh kpx applies every size (and idles with it loaded),
    then another fresh kpx runs the convergence series, so a failed
    10,000-service apply (EMFILE, say) cannot spoil the convergence figure.
    """
    workloads = [w for n in cs.sizes for w in (f"apply-{n}", f"idle-{n}")]
    workloads += [f"apply-cip-{n}" for n in cs.sizes if cs.cluster_ips]
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
                    if cs.cluster_ips:
                        on_step(f"control round {r + 1}/{runs}: apply {n} services with "
                                f"clusterIPs")
                        on_run(f"apply-cip-{n}", r, ctl.apply(n, cluster_ips=True))
            finally:
                kpx.stop()
        if cs.stall_services > 0:
            on_step(f"control round {r + 1}/{runs}: probing during a "
                    f"{cs.stall_services}-service apply")
            on_run(f"stall-{cs.stall_services}", r, _stall_round(kpx, cs))
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


def _stall_round(kpx: Kpx, cs: ControlSettings) -> Run:
    """A fresh kpx with its healthz sidecar on node1's IP, through one stall run."""
    kpx.healthz_bind = f"{NODE1_IP}:{HEALTHZ_PORT}"
    try:
        kpx.start("local")
    except ContenderError as e:
        kpx.stop()
        return Run.failed(f"start: {e}")
    else:
        return Control(kpx, cs).stall()
    finally:
        kpx.stop()
        kpx.healthz_bind = None
