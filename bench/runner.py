"""One bench invocation: topology up, every contender x workload, results out, topology down.

Owns: the order of work below, the machine description recorded with the
results, the progress display, and the promise that everything a run
creates is removed again.

Never: measure a workload itself (``bench.workloads``, ``bench.control``) or
leave a namespace or process behind, whatever ends the run.

Order of work, and why:

- paths outermost (local, then cross): each path needs its own kpx state and
  backend, and a reader compares contenders within a path;
- then *rounds*: round 1 runs every contender through every workload, then
  round 2, and so on. Interleaving means slow drift of a shared machine
  (other tenants, thermal) spreads over all contenders instead of landing on
  whichever ran last, which is what keeps the ratios honest;
- then, with ``--families 4,6``, each contender's IPv4 start and then its
  IPv6 start (rr and cps, on the NodePort paths): the two families of one
  contender run back to back within a round, so the IPv6/IPv4 ratio of
  ratios compares figures taken minutes, not a whole run, apart. IPv6 cells
  are on their own path (``local/ipv6``);
- each contender is started fresh for its round and stopped after it, so
  only the one being measured is running (and kpx's mem figure starts from
  a fresh process);
- a pause before every measured run lets TIME_WAIT and conntrack settle;
- control last, kpx only: each proxy mode (``kpx``, then ``kpx-nfq``) when asked for.

Everything created is removed in ``finally`` (processes by pid, then the
namespaces), also on Ctrl-C or SIGTERM, and a partial results file is written
with ``"complete": false``.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import importlib.metadata
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO

from bench import report
from bench.backends import Backends
from bench.contenders import (
    Contender,
    ContenderError,
    Kpx,
    control_contenders,
    default_contenders,
    make_contenders,
    serves,
)
from bench.control import ControlSettings, run_control
from bench.procs import cpu_times, machine_jiffies, nofile_hard_limit
from bench.results import (
    DEFAULT_WORKLOADS,
    IPV6_PATHS,
    IPV6_WORKLOADS,
    TARGET_SECTIONS,
    CellTable,
    Run,
    all_ratios,
    document,
    evaluate_targets,
    family_path,
    family_ratios,
    write,
)
from bench.topology import Topology
from bench.workloads import WORKLOAD_FUNCS, Settings


@dataclass
class Config:
    quick: bool = False
    runs: int = 3
    paths: list[str] = field(default_factory=lambda: ["local", "cross"])
    mem_paths: list[str] = field(default_factory=lambda: ["local"])
    workloads: list[str] = field(default_factory=lambda: list(DEFAULT_WORKLOADS))
    contenders: list[str] = field(
        default_factory=lambda: default_contenders(list(DEFAULT_WORKLOADS)))
    """The CLI's defaults: both kpx modes among them (issue 15 judges kpx-nfq)."""
    families: list[int] = field(default_factory=lambda: [4])
    """Address families of the data-path runs: IPv6 runs ``IPV6_WORKLOADS`` on
    ``IPV6_PATHS``; everything else (and control) is IPv4."""
    out: Path = Path("bench/results")
    kpx: str = "kpx"
    etp: str = "Cluster"
    """externalTrafficPolicy of the bench service kpx serves (Local needs the local path)."""
    keep_logs: bool = False
    settings: Settings = field(default_factory=Settings)
    control: ControlSettings = field(default_factory=ControlSettings)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["out"] = str(self.out)
        return d


@dataclass
class CpuUsage:
    """What one run cost in CPU: the contender's own, and the whole machine's.

    Why beside every throughput figure: on 2 shared cores the load generator,
    the backend and the proxy compete, so a rate alone cannot tell a slower
    proxy from a saturated machine. CPU per request or connection is the
    proxy's own cost, and the machine's busy share says whether anything was
    left for it (a second worker cannot help when it is near 100%).

    The kernel's share of it is kept apart (``*_kernel_us``): a proxy that
    terminates both connections pays the kernel for each, and that part is a
    floor no user-space speed-up removes (docs/PERFORMANCE.md, "The relay against
    HAProxy on cps").
    """

    contender: Contender
    user0: float
    kernel0: float
    busy0: int
    total0: int

    @classmethod
    def start(cls, c: Contender) -> CpuUsage:
        busy, total = machine_jiffies()
        return cls(c, *cpu_times(c.pids()), busy, total)

    def finish(self, workload: str, run: Run) -> None:
        c = self.contender
        busy, total = machine_jiffies()
        if total > self.total0:
            run.detail["machine_busy_pct"] = round(
                100 * (busy - self.busy0) / (total - self.total0), 1)
        if not c.has_process or not run.ok:
            return
        user, kernel = cpu_times(c.pids())
        user, kernel = user - self.user0, kernel - self.kernel0
        cpu = user + kernel
        run.detail["proxy_cpu_s"] = round(cpu, 2)
        run.detail["proxy_kernel_s"] = round(kernel, 2)
        requests = run.detail.get("requests")
        if workload in ("rr", "cps", "udp") and requests:
            run.metrics[f"{workload}_cpu_us"] = round(cpu / requests * 1e6, 1)
            run.metrics[f"{workload}_kernel_us"] = round(kernel / requests * 1e6, 1)


class Display:
    """Live output: a row per finished run, and a progress line redrawn in place on a tty."""

    def __init__(self, total: int, stream: TextIO | None = None) -> None:
        self.stream = stream or sys.stdout
        self.tty = self.stream.isatty()
        self.total = max(1, total)
        self.done = 0
        self.t0 = time.monotonic()
        self.status = ""

    def _progress(self) -> str:
        el = time.monotonic() - self.t0
        eta = (el / self.done * (self.total - self.done)) if self.done else 0.0
        eta_s = f" eta {eta:4.0f}s" if self.done else ""
        return f"[{self.done}/{self.total} {el:4.0f}s{eta_s}] {self.status}"

    def _clear(self) -> None:
        if self.tty:
            self.stream.write("\r\x1b[K")

    def _draw(self) -> None:
        if self.tty:
            self.stream.write("\r\x1b[K" + self._progress()[: shutil.get_terminal_size().columns
                                                            - 1])
            self.stream.flush()

    def step(self, text: str) -> None:
        self.status = text
        self._draw()

    def line(self, text: str) -> None:
        self._clear()
        self.stream.write(text + "\n")
        self._draw()
        self.stream.flush()

    def advance(self, text: str) -> None:
        self.done += 1
        prefix = "" if self.tty else f"[{self.done}/{self.total}] "
        self.line(prefix + text)

    def finish(self) -> None:
        self._clear()
        self.stream.flush()


def _version(argv: list[str]) -> str | None:
    try:
        cp = subprocess.run(argv, capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    text = (cp.stdout or cp.stderr).strip().splitlines()
    return text[0].strip() if text else None


def _pkg(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def machine_info() -> dict[str, Any]:
    """What the numbers were measured on: absolute figures drift between machines."""
    cpu = None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    repo = Path(__file__).resolve().parent.parent
    commit = _version(["git", "-C", str(repo), "rev-parse", "--short", "HEAD"])
    dirty = _version(["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"])
    return {
        "cpu_model": cpu,
        "nproc": os.cpu_count(),
        "affinity": sorted(os.sched_getaffinity(0)),
        "cpu_pinning": "none: client, proxy and backend share all CPUs",
        "kernel": platform.release(),
        "python": platform.python_version(),
        "uvloop": _pkg("uvloop"),
        "kpx": _pkg("kpx"),
        "kpx_commit": f"{commit}{'+dirty' if dirty else ''}" if commit else None,
        "matplotlib": _pkg("matplotlib"),
        "haproxy": _version(["haproxy", "-v"]),
        "wrk": _version(["wrk", "-v"]),
        "iperf3": _version(["iperf3", "-v"]),
        "nft": _version(["nft", "-v"]),
        "iproute2": _version(["ip", "-V"]),
        "loadavg_start": Path("/proc/loadavg").read_text().split()[:3],
        "mem_total_kib": _meminfo("MemTotal"),
        "rlimit_nofile_hard": nofile_hard_limit(),
    }


def _meminfo(key: str) -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


@contextlib.contextmanager
def _signals_ignored() -> Iterator[None]:
    """A second Ctrl-C must not abort the cleanup that the first one started."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


class Bench:
    def __init__(self, cfg: Config, stream: TextIO | None = None) -> None:
        self.cfg = cfg
        self.stream = stream or sys.stdout
        self.table = CellTable()
        self.notes: list[str] = []
        self.charts: list[str] = []
        self.started = dt.datetime.now(dt.UTC)
        self.stamp = self.started.strftime("%Y%m%d-%H%M%S")
        self.topo = Topology.for_this_process(ipv6=6 in cfg.families)
        self.log_dir = Path(tempfile.mkdtemp(prefix=f"kpx-bench-{self.stamp}-"))
        self.machine = machine_info()
        self.availability: dict[str, dict[str, Any]] = {}
        self.display = Display(self._planned_steps(), self.stream)
        self.result_path = cfg.out / f"{self.stamp}.json"

    # ---- planning ----------------------------------------------------------------

    def data_workloads(self) -> list[str]:
        return [w for w in self.cfg.workloads if w in WORKLOAD_FUNCS]

    def families_of(self, path: str) -> list[int]:
        """The families ``path`` runs over (IPv6 only on the NodePort paths)."""
        return [f for f in self.cfg.families if f == 4 or path in IPV6_PATHS]

    def workloads_of(self, path: str, family: int) -> list[str]:
        """The data workloads of ``path`` over ``family``, in run order."""
        return [w for w in self.data_workloads()
                if (w != "mem" or path in self.cfg.mem_paths)
                and (family == 4 or w in IPV6_WORKLOADS)]

    def _planned_steps(self, available: set[str] | None = None) -> int:
        """Measured runs still to come (rows the live table will print)."""
        names = [c for c in self.cfg.contenders if available is None or c in available]
        n = 0
        for path in self.cfg.paths:
            for fam in self.families_of(path):
                for w in self.workloads_of(path, fam):
                    n += self.cfg.runs * sum(1 for c in names if serves(c, w, path, fam) is None)
        if "control" in self.cfg.workloads:
            cs = self.cfg.control
            n += self.cfg.runs * len(control_contenders(names)) * (
                (3 if cs.cluster_ips else 2) * len(cs.sizes) + (1 if cs.changes > 0 else 0)
                + (1 if cs.stall_services > 0 else 0))
        return n

    def estimate_seconds(self) -> float:
        """A rough duration, printed up front so nobody wonders whether it hangs."""
        s = self.cfg.settings
        per_run = {w: s.durations.get(w, 0.0) + s.pause + 0.7 for w in ("bulk", "rr", "cps")}
        per_run["mem"] = 7.0
        # connect: the client's start-up, then each connect (~0.2 ms) and its pause.
        per_run["connect"] = s.connect_count * (s.connect_pause + 0.0003) + s.pause + 0.7
        per_run["udp"] = s.duration("udp") + s.pause + 1.5  # + the WHO probe and warm-up
        total = 0.0
        for path in self.cfg.paths:
            for fam in self.families_of(path):
                for w in self.workloads_of(path, fam):
                    k = sum(1 for c in self.cfg.contenders if serves(c, w, path, fam) is None)
                    total += self.cfg.runs * k * per_run[w]
                total += self.cfg.runs * len(self.cfg.contenders) * 1.0  # start/stop
        if "control" in self.cfg.workloads:
            cs = self.cfg.control
            total += self.cfg.runs * len(control_contenders(self.cfg.contenders)) * (
                len(cs.sizes) * (cs.idle_seconds + 6.0) + cs.changes * 0.5 + 3.0
                + (15.0 if cs.stall_services > 0 else 0.0))
        return total + 10.0

    # ---- results -----------------------------------------------------------------

    def meta(self, complete: bool) -> dict[str, Any]:
        m = dict(self.machine)
        m["loadavg_end"] = Path("/proc/loadavg").read_text().split()[:3]
        return {
            "started": self.started.isoformat(timespec="seconds"),
            "finished": dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
            if complete else None,
            "argv": sys.argv,
            "config": self.cfg.to_json(),
            "machine": m,
            "sysctls": self.topo.sysctls,
            "topology": self.topo.describe(),
            "contenders": self.availability,
            "notes": self.notes,
            "charts": self.charts,
            "logs": str(self.log_dir),
        }

    def save(self, complete: bool) -> None:
        self.cfg.out.mkdir(parents=True, exist_ok=True)
        write(self.result_path, document(self.table, meta=self.meta(complete),
                                         complete=complete))

    # ---- running -----------------------------------------------------------------

    def record(self, path: str | None, workload: str, c: str, index: int, run: Run) -> None:
        self.table.cell(path, workload, c).add(run)
        self.display.advance(report.run_line(path, workload, c, index, self.cfg.runs, run.ok,
                                             run.metrics, run.error))

    def run(self) -> int:
        d = self.display
        out = self.stream
        interrupted = False
        aborted: str | None = None
        contenders: list[Contender] = []
        udp = "udp" in self.data_workloads()
        backends = Backends(self.topo, self.log_dir, udp=udp, ipv6=self.topo.ipv6)
        try:
            fams = "" if self.cfg.families == [4] else \
                f"families {','.join(f'IPv{f}' for f in self.cfg.families)}, "
            out.write(f"kpx bench: {'quick' if self.cfg.quick else 'full'} run, "
                      f"{self.cfg.runs} run(s) per cell, paths {','.join(self.cfg.paths)}, "
                      f"{fams}"
                      f"about {self.estimate_seconds() / 60:.0f} min; "
                      f"namespaces {self.topo.prefix}*, logs {self.log_dir}\n")
            d.step("building namespaces")
            self.topo.create()
            d.step("starting backends")
            backends.start()
            backends.wait_ready()
            self.topo.check_reachability(8080)
            contenders = make_contenders(self.cfg.contenders, self.topo, self.log_dir,
                                         self.cfg.kpx, self.cfg.etp, udp=udp)
            for c in contenders:
                d.step(f"checking {c.name}")
                why = c.unavailable()
                self.availability[c.name] = {"available": why is None, "reason": why,
                                             "description": c.description}
                if why:
                    d.line(f"{c.name}: unavailable: {why}")
            d.total = max(1, self._planned_steps(
                {n for n, a in self.availability.items() if a["available"]}))
            self.save(False)
            for path in self.cfg.paths:
                self.run_path(path, contenders)
            if "control" in self.cfg.workloads:
                self.run_control(contenders)
        except KeyboardInterrupt:
            interrupted = True
            self.notes.append("interrupted (Ctrl-C / SIGTERM): results are partial")
        except Exception as e:
            # Setup failed (namespace clash, backend would not start...) or a bug:
            # still clean up and write what was measured, then say why.
            aborted = f"aborted: {type(e).__name__}: {e}"
            self.notes.append(aborted)
            traceback.print_exc(file=sys.stderr)
        finally:
            with _signals_ignored():
                d.step("cleaning up")
                for c in contenders:
                    c.stop()
                backends.stop()
                problems = self.topo.destroy()
                d.finish()
            if problems:
                self.notes.append("cleanup problems: " + "; ".join(problems))
                out.write("cleanup problems:\n  " + "\n  ".join(problems) + "\n")
        self.finish(complete=not interrupted and aborted is None)
        if interrupted:
            return 130
        return 1 if aborted else 0

    def run_path(self, path: str, contenders: list[Contender]) -> None:
        cfg = self.cfg
        families = self.families_of(path)
        # The workloads each contender takes part in, per family.
        mine: dict[tuple[str, int], list[str]] = {}
        for c in contenders:
            avail = self.availability[c.name]
            for fam in families:
                cell_path = family_path(path, fam)
                mine[c.name, fam] = []
                for w in self.workloads_of(path, fam):
                    why_not = c.serves(w) or c.serves_path(path, fam)
                    if not avail["available"]:
                        self.table.mark(cell_path, w, c.name, "unavailable", avail["reason"])
                    elif why_not:
                        self.table.mark(cell_path, w, c.name, "n/a", why_not)
                    else:
                        mine[c.name, fam].append(w)
        for rnd in range(cfg.runs):
            for c in contenders:
                for fam in families:
                    # Not started at all when none of its workloads runs (haproxy for udp alone).
                    if not self.availability[c.name]["available"] or not mine[c.name, fam]:
                        continue
                    c.family = fam
                    try:
                        self.run_contender(path, fam, rnd, c, mine[c.name, fam])
                    finally:
                        c.family = 4

    def run_contender(self, path: str, fam: int, rnd: int, c: Contender,
                      workloads: list[str]) -> None:
        """One start of ``c`` over ``fam``: its ``workloads``, then stop and check node1."""
        cfg = self.cfg
        cell_path = family_path(path, fam)
        where = f"{cell_path}: round {rnd + 1}/{cfg.runs}"
        self.display.step(f"{where}: starting {c.name}")
        try:
            c.start(path)
            c.verify()
        except ContenderError as e:
            c.stop()
            self.check_residue(c.name)
            for w in workloads:
                self.record(cell_path, w, c.name, rnd, Run.failed(f"start: {e}"))
            return
        try:
            for w in workloads:
                self.display.step(f"{where}: {c.name} {w} (pause {cfg.settings.pause:g}s)")
                time.sleep(cfg.settings.pause)
                t0 = time.monotonic()
                usage = CpuUsage.start(c)
                run = WORKLOAD_FUNCS[w](self.topo, c, cfg.settings)
                usage.finish(w, run)
                run.detail["wall_s"] = round(time.monotonic() - t0, 2)
                capped = run.detail.get("capped")
                if capped and f"mem: {capped}" not in self.notes:
                    self.notes.append(f"mem: {capped}")
                self.record(cell_path, w, c.name, rnd, run)
        finally:
            c.stop()
            self.check_residue(c.name)
        self.save(False)

    def check_residue(self, name: str) -> None:
        """Leave node1 as the next contender expects it, and say so if we had to."""
        left = self.topo.node1_residue()
        if left:
            note = f"{name} left {'; '.join(left)} in node1 after stopping; removed"
            if note not in self.notes:
                self.notes.append(note)
                self.display.line(f"note: {note}")
            self.topo.reset_node1()

    def run_control(self, contenders: list[Contender]) -> None:
        """The control workloads for each proxy mode asked for: kpx, then kpx-nfq."""
        by_name = {c.name: c for c in contenders}
        for name in control_contenders(list(by_name)):
            kpx = by_name[name]
            assert isinstance(kpx, Kpx)
            self._run_control(kpx)

    def _run_control(self, kpx: Kpx) -> None:
        cs = self.cfg.control
        name = kpx.name
        names = [f"apply-{n}" for n in cs.sizes] + [f"idle-{n}" for n in cs.sizes]
        names += ["converge"] if cs.changes else []
        names += [f"stall-{cs.stall_services}"] if cs.stall_services > 0 else []
        if not self.availability[name]["available"]:
            for w in names:
                self.table.mark(None, w, name, "unavailable", self.availability[name]["reason"])
            return

        def on_run(workload: str, index: int, run: Run) -> None:
            self.table.cell(None, workload, name).add(run)
            runs = self.cfg.runs
            self.display.advance(report.run_line(None, workload, name, index, runs, run.ok,
                                                 run.metrics, run.error))

        run_control(kpx, cs, self.cfg.runs, self.display.step, on_run)
        self.check_residue(f"{name} (control)")
        self.save(False)

    def finish(self, complete: bool) -> None:
        out = self.stream
        files, note = ([], None)
        if len(self.table):
            try:
                files, note = report.charts(self.table, self.cfg.out, self.stamp)
            except Exception as e:  # a chart must never lose the numbers
                note = f"charts failed: {type(e).__name__}: {e}"
        self.charts = files
        if note:
            self.notes.append(note)
        failed = any(c.status == "failed" for c in self.table)
        if not failed and not self.cfg.keep_logs:
            shutil.rmtree(self.log_dir, ignore_errors=True)
            logs = "removed (no failures; --keep-logs keeps them)"
        else:
            logs = str(self.log_dir)
        self.save(complete)
        doc_ratios = all_ratios(self.table)
        out.write("\n== results (median over runs, min-max) ==\n")
        out.write(report.summary_table(self.table) + "\n")
        out.write("\n== ratios (medians) ==\n")
        out.write(report.ratio_table(doc_ratios) + "\n")
        for issue, targets in TARGET_SECTIONS:
            out.write(f"\n== issue {issue} targets ==\n")
            out.write(report.target_table(evaluate_targets(self.table, targets)) + "\n")
        fam_rows = family_ratios(self.table)
        if fam_rows:
            out.write("\n== IPv6 against IPv4, same run (issue 14: kpx's IPv6 ratios within "
                      "10% of its IPv4 ones) ==\n")
            out.write(report.family_table(fam_rows) + "\n")
        out.write("\n")
        for n in self.notes:
            out.write(f"note: {n}\n")
        out.write(f"results: {self.result_path}\n")
        for f in files:
            out.write(f"chart:   {f}\n")
        out.write(f"logs:    {logs}\n")
        out.flush()
