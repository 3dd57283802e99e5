"""The results model: runs, cells, ratios, targets and the JSON file format.

Owns: everything that turns measured runs into what is reported, as pure
functions, so the arithmetic is unit-tested without a network:

- a *run* is one measurement; it either passed its own correctness checks
  and carries metrics, or failed and carries only the reason (a failed run is
  never given a number, so it cannot leak into a median);
- a *cell* is (path, workload, contender) with its runs; one failed run fails
  the whole cell, because a contender that sometimes errors is not "fast";
- a *ratio* divides two cells' medians and is ``None`` with a reason when
  either side is missing or failed;
- a *target* is one row of an issue's table (issue 5: kpx against HAProxy;
  issue 15: the nfqueue mode against the kernel, the relay against HAProxy),
  evaluated to met / missed / not measured, with the measured figure: a
  ratio of two contenders' medians, a difference of them (the time nfqueue
  adds over kernel DNAT), or one contender's own figure;
- a *family ratio* (issue 14) sets a ratio measured over IPv6 beside the
  same ratio over IPv4 in the same run: IPv6 cells are on their own paths
  (``local/ipv6`` beside ``local``, ``family_path``), so every ratio and
  target above works for them unchanged, and ``family_ratios`` divides the
  IPv6 ratio by the IPv4 one.

The file is versioned by ``SCHEMA``; ``validate`` checks a loaded document's
shape so a consumer (or the unit test's round trip) can rely on it.

Never: measure or print anything: runs come from ``bench.workloads`` and
``bench.control``, tables and charts are ``bench.report``'s.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

SCHEMA = "kpx-bench/1"

Status = Literal["ok", "failed", "n/a", "unavailable", "skipped"]


@dataclass(frozen=True)
class Metric:
    name: str
    workload: str
    unit: str
    higher_is_better: bool
    label: str
    short: str = ""
    """Prefix in a live row when a workload prints several figures (p50, p99)."""
    per_process: bool = False
    """Measured on the contender's processes: none for direct and kernel."""


METRICS: dict[str, Metric] = {
    m.name: m
    for m in (
        Metric("gbps", "bulk", "Gbit/s", True, "bulk throughput"),
        Metric("req_per_s", "rr", "req/s", True, "rr requests/s"),
        Metric("p50_ms", "rr", "ms", False, "rr p50 latency", "p50"),
        Metric("p99_ms", "rr", "ms", False, "rr p99 latency", "p99"),
        Metric("rr_cpu_us", "rr", "us", False, "proxy CPU per request", "cpu", True),
        Metric("rr_kernel_us", "rr", "us", False, "proxy kernel CPU per request", "kernel", True),
        Metric("conn_per_s", "cps", "conn/s", True, "new connections/s"),
        Metric("cps_cpu_us", "cps", "us", False, "proxy CPU per connection", "cpu", True),
        Metric("cps_kernel_us", "cps", "us", False, "proxy kernel CPU per connection", "kernel",
               True),
        Metric("connect_p50_us", "connect", "us", False, "connect() time p50, light load",
               "p50"),
        Metric("connect_p99_us", "connect", "us", False, "connect() time p99, light load",
               "p99"),
        Metric("kib_per_conn", "mem", "KiB", False, "RSS per idle proxied connection"),
        Metric("udp_per_s", "udp", "req/s", True, "udp request/response datagrams/s"),
        Metric("udp_p50_ms", "udp", "ms", False, "udp round trip p50", "p50"),
        Metric("udp_p99_ms", "udp", "ms", False, "udp round trip p99", "p99"),
        Metric("udp_cpu_us", "udp", "us", False, "proxy CPU per udp request", "cpu", True),
        Metric("udp_kernel_us", "udp", "us", False, "proxy kernel CPU per udp request",
               "kernel", True),
        Metric("apply_s", "apply", "s", False, "apply N services"),
        Metric("idle_cpu_pct", "idle", "% core", False, "idle CPU"),
        Metric("converge_p50_ms", "converge", "ms", False, "endpoint change p50", "p50"),
        Metric("converge_p99_ms", "converge", "ms", False, "endpoint change p99", "p99"),
        Metric("stall_conn_p50_ms", "stall", "ms", False,
               "new connection during big apply p50", "conn p50"),
        Metric("stall_conn_p99_ms", "stall", "ms", False,
               "new connection during big apply p99", "conn p99"),
        Metric("stall_conn_max_ms", "stall", "ms", False,
               "new connection during big apply max", "conn max"),
        Metric("stall_healthz_p50_ms", "stall", "ms", False,
               "/healthz during big apply p50", "healthz p50"),
        Metric("stall_healthz_p99_ms", "stall", "ms", False,
               "/healthz during big apply p99", "healthz p99"),
        Metric("stall_healthz_max_ms", "stall", "ms", False,
               "/healthz during big apply max", "healthz max"),
    )
}

WORKLOADS = ("bulk", "rr", "cps", "connect", "mem", "control", "udp")
"""Every workload ``--workloads`` accepts."""
DEFAULT_WORKLOADS = ("bulk", "rr", "cps", "connect", "mem", "control")
"""What runs without ``--workloads``: udp is asked for by name, so a default run
(and every script built on one) measures what it did before udp existed. connect
(issue 15) is in: issue 15's table is judged in one default run, and it costs about
5 s per contender per path and round. It runs after cps (its pause lets cps's
TIME_WAIT settle) and before mem, whose 10,000 connections are still closing after it."""
DATA_WORKLOADS = ("bulk", "rr", "cps", "connect", "mem", "udp")

FAMILIES = (4, 6)
"""``--families`` values: IPv4 and IPv6."""
IPV6_WORKLOADS = ("rr", "cps", "connect")
"""The workloads run over IPv6 as well (issue 14; connect, issue 15's light-load time,
too): the others stay IPv4-only."""
IPV6_PATHS = ("local", "cross")
"""The paths run over IPv6: the NodePort ones."""
IPV6_SUFFIX = "/ipv6"


def family_path(path: str, family: int) -> str:
    """The cells' path of ``path`` run over ``family``: ``local``, ``local/ipv6``."""
    return path if family == 4 else f"{path}{IPV6_SUFFIX}"


def split_family(path: str) -> tuple[str, int]:
    """``family_path``'s inverse: ``local/ipv6`` -> (``local``, 6)."""
    if path.endswith(IPV6_SUFFIX):
        return path[: -len(IPV6_SUFFIX)], 6
    return path, 4


def family(workload: str) -> str:
    """Control cells are named per size (``apply-10000``); metrics belong to the family."""
    return workload.split("-", 1)[0]


def metrics_of(workload: str) -> list[Metric]:
    return [m for m in METRICS.values() if m.workload == family(workload)]


@dataclass
class Run:
    """One measurement. ``metrics`` is empty unless ``ok``."""

    ok: bool
    metrics: dict[str, float] = field(default_factory=dict)
    error: str | None = None
    detail: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def failed(cls, error: str, **detail: Any) -> Run:
        return cls(ok=False, metrics={}, error=error, detail=detail)

    def __post_init__(self) -> None:
        if not self.ok:
            self.metrics = {}  # a failed run is never given a number
            if not self.error:
                self.error = "failed (no reason recorded)"


@dataclass
class Summary:
    min: float
    median: float
    max: float
    n: int

    @classmethod
    def of(cls, values: list[float]) -> Summary:
        return cls(min(values), statistics.median(values), max(values), len(values))


@dataclass
class Cell:
    path: str | None
    workload: str
    contender: str
    status: Status = "ok"
    reason: str | None = None
    runs: list[Run] = field(default_factory=list)

    def add(self, run: Run) -> None:
        self.runs.append(run)
        self.refresh()

    def refresh(self) -> None:
        """A single failed run fails the cell (and its reason is the first failure)."""
        if self.status in ("n/a", "unavailable", "skipped"):
            return
        bad = [r for r in self.runs if not r.ok]
        if bad:
            self.status = "failed"
            self.reason = bad[0].error if len(bad) == 1 else (
                f"{len(bad)} of {len(self.runs)} runs failed; first: {bad[0].error}")
        else:
            self.status = "ok"
            self.reason = None

    @property
    def summary(self) -> dict[str, Summary]:
        """Per metric min/median/max over the runs; empty unless the cell is ok."""
        if self.status != "ok" or not self.runs:
            return {}
        names = {k for r in self.runs for k in r.metrics}
        return {
            k: Summary.of([r.metrics[k] for r in self.runs if k in r.metrics])
            for k in sorted(names)
        }

    def median(self, metric: str) -> float | None:
        s = self.summary.get(metric)
        return None if s is None else s.median

    def to_json(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "workload": self.workload,
            "contender": self.contender,
            "status": self.status,
            "reason": self.reason,
            "runs": [asdict(r) for r in self.runs],
            "summary": {k: asdict(v) for k, v in self.summary.items()},
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Cell:
        c = cls(path=d["path"], workload=d["workload"], contender=d["contender"],
                status=d["status"], reason=d["reason"])
        c.runs = [Run(ok=r["ok"], metrics=dict(r["metrics"]), error=r["error"],
                      detail=dict(r["detail"])) for r in d["runs"]]
        return c


class CellTable:
    """All cells of one bench run, addressed by (path, workload, contender)."""

    def __init__(self, cells: list[Cell] | None = None) -> None:
        self._cells: dict[tuple[str | None, str, str], Cell] = {}
        for c in cells or []:
            self._cells[(c.path, c.workload, c.contender)] = c

    def cell(self, path: str | None, workload: str, contender: str) -> Cell:
        key = (path, workload, contender)
        if key not in self._cells:
            self._cells[key] = Cell(path, workload, contender)
        return self._cells[key]

    def get(self, path: str | None, workload: str, contender: str) -> Cell | None:
        return self._cells.get((path, workload, contender))

    def mark(self, path: str | None, workload: str, contender: str, status: Status,
             reason: str) -> Cell:
        c = self.cell(path, workload, contender)
        c.status, c.reason = status, reason
        return c

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(self._cells.values())

    def __len__(self) -> int:
        return len(self._cells)

    def paths(self) -> list[str | None]:
        return list(dict.fromkeys(c.path for c in self))


# ---- ratios ------------------------------------------------------------------------


@dataclass
class Ratio:
    name: str
    """``kpx/haproxy`` etc."""
    path: str | None
    workload: str
    metric: str
    numerator: str
    denominator: str
    value: float | None
    reason: str | None = None


def medians(table: CellTable, path: str | None, metric: str, num: str, den: str
            ) -> tuple[float, float] | str:
    """Both sides' medians of ``metric`` on ``path``, or why there is no pair: a side
    not measured or not ok (the first such side is named), or a cell with no figure."""
    workload = METRICS[metric].workload
    for who in (num, den):
        c = table.get(path, workload, who)
        if c is None:
            return f"{who} {workload} not measured"
        if c.status != "ok":
            return f"{who} {workload} {c.status}: {c.reason}"
    n = table.cell(path, workload, num).median(metric)
    d = table.cell(path, workload, den).median(metric)
    if n is None or d is None:
        return f"no {metric} figure"
    return n, d


def ratio(table: CellTable, path: str | None, metric: str, num: str, den: str) -> Ratio:
    """median(num) / median(den); ``None`` with the reason when either side has no figure."""
    r = Ratio(f"{num}/{den}", path, METRICS[metric].workload, metric, num, den, None)
    pair = medians(table, path, metric, num, den)
    if isinstance(pair, str):
        r.reason = pair
    elif pair[1] == 0:
        r.reason = f"{den} {metric} is zero"
    else:
        r.value = pair[0] / pair[1]
    return r


def difference(table: CellTable, path: str | None, metric: str, num: str, den: str
               ) -> tuple[float | None, str | None]:
    """median(num) - median(den), in the metric's unit, or ``None`` and the reason.

    For a cost both sides pay where only the excess is the subject's: the time
    kpx-nfq adds to connect() is its connect() time minus kernel DNAT's over the
    same path in the same run (the wire, the backend and the client's own
    syscall are in both). Negative when the subject was quicker.
    """
    pair = medians(table, path, metric, num, den)
    if isinstance(pair, str):
        return None, pair
    return pair[0] - pair[1], None


RATIO_PAIRS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("kpx", "haproxy", ("gbps", "req_per_s", "p50_ms", "p99_ms", "conn_per_s",
                        "rr_cpu_us", "cps_cpu_us", "kib_per_conn")),
    ("kpx", "kernel", ("gbps", "req_per_s", "p50_ms", "p99_ms", "conn_per_s")),
    ("kpx-w2", "kpx", ("req_per_s", "p99_ms", "conn_per_s", "udp_per_s")),
    # udp: HAProxy has no UDP; the kernel and the userspace UDP peers are the baselines.
    ("kpx", "kernel", ("udp_per_s", "udp_p50_ms", "udp_p99_ms")),
    ("kpx", "socat", ("udp_per_s", "udp_p50_ms", "udp_p99_ms", "udp_cpu_us")),
    ("kpx", "naive", ("udp_per_s", "udp_p99_ms", "udp_cpu_us")),
)


FLOOR_PAIRS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("nfq-floor", "kernel", ("conn_per_s", "connect_p99_us")),
    ("kpx-nfq", "nfq-floor", ("conn_per_s", "cps_cpu_us", "connect_p99_us")),
    ("nfq-pyfloor", "nfq-floor", ("conn_per_s", "connect_p50_us", "connect_p99_us")),
    ("kpx-nfq", "nfq-pyfloor", ("conn_per_s", "connect_p50_us", "connect_p99_us")),
    ("relay-floor", "haproxy", ("req_per_s", "conn_per_s", "rr_cpu_us", "cps_cpu_us",
                                "cps_kernel_us")),
    ("kpx", "relay-floor", ("req_per_s", "conn_per_s", "rr_cpu_us", "cps_cpu_us",
                            "cps_kernel_us")),
    ("kpx", "kpx-py", ("gbps", "req_per_s", "conn_per_s", "rr_cpu_us", "cps_cpu_us")),
)
"""The NFQUEUE floor against kernel DNAT (what the queue costs), the Python floor against
it (what a Python reader costs), and kpx-nfq against each (what kpx's Python, and what
kpx's reader beyond the least a Python one does, costs); the relay floor against HAProxy
(what terminating both connections costs here, beyond HAProxy's own generality) and the
relay against it (what kpx's Python costs the relay); kpx against its pure-Python relay
(what the compiled relay core gains). Printed only where both sides ran,
since the floors run only when asked for by name."""


def all_ratios(table: CellTable) -> list[Ratio]:
    """Every ratio the report prints, for every path where either side was measured (both,
    for ``FLOOR_PAIRS``)."""
    out = []
    for path in table.paths():
        if path is None:
            continue
        for pairs, both in ((RATIO_PAIRS, False), (FLOOR_PAIRS, True)):
            for num, den, metrics in pairs:
                for m in metrics:
                    wl = METRICS[m].workload
                    sides = (table.get(path, wl, num) is not None,
                             table.get(path, wl, den) is not None)
                    if not (all(sides) if both else any(sides)):
                        continue
                    out.append(ratio(table, path, m, num, den))
    return out


# ---- IPv6 against IPv4 (issue 14) ---------------------------------------------------

FAMILY_TOLERANCE = 0.10
"""Issue 14: kpx's IPv6 ratios must be within 10% of its IPv4 ratios, same run."""
RATES = ("req_per_s", "conn_per_s")
CPU_PER_UNIT = ("rr_cpu_us", "cps_cpu_us")
FAMILY_PAIRS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("kpx", "haproxy", RATES + CPU_PER_UNIT),
    ("kpx", "kernel", RATES),
    ("kpx-nfq", "haproxy", RATES),
    ("kpx-nfq", "kernel", RATES),
)
"""The rates of rr and cps (each workload's own figure) against both references, and, for
the relay against HAProxy, the proxy's CPU per request and per connection: on 2 shared
cores a rate moves with whatever else the machine does, the CPU a proxy spends per unit
much less, so that pair says whether a rate's miss is kpx's or the machine's. (kpx-nfq
spends next to no CPU per request: the kernel forwards.) Latency percentiles are in the
per-path ratio table (``local/ipv6`` beside ``local``) but not judged here: a p99 over a
few seconds moves more than 10% between two runs of the same family."""


@dataclass
class FamilyRatio:
    """One ratio (``kpx/haproxy`` rr req/s on ``local``) over IPv4 and IPv6, and their
    quotient, judged against ``FAMILY_TOLERANCE``."""

    path: str
    """The base path (``local``): IPv4 cells on it, IPv6 ones on ``local/ipv6``."""
    name: str
    workload: str
    metric: str
    ipv4: float | None
    ipv6: float | None
    value: float | None
    """ipv6 / ipv4: 1.0 when kpx stands against its reference alike in both families."""
    status: Literal["met", "better", "missed", "not measured"]
    """``met`` within the tolerance; ``better`` past it in kpx's favour (the
    reference paid more for IPv6 than kpx did); ``missed`` past it against kpx."""
    reason: str | None = None


def family_ratio(table: CellTable, path: str, metric: str, num: str, den: str,
                 tolerance: float = FAMILY_TOLERANCE) -> FamilyRatio:
    """``num/den`` on ``path`` over IPv6 divided by the same over IPv4.

    Within ``tolerance`` either way is ``met``. Past it, the direction is
    told apart rather than folded into one "missed": a quotient in kpx's
    favour (a rate ratio above 1, a CPU-per-unit ratio below 1) is
    ``better``, because it means the reference lost more over IPv6 than kpx
    did (HAProxy spends 15-19% more CPU per connection over IPv6 here, kpx
    none), which no change to kpx could or should undo. Only a quotient
    against kpx, IPv6 standing it in worse stead, is ``missed``.
    """
    r4 = ratio(table, path, metric, num, den)
    r6 = ratio(table, family_path(path, 6), metric, num, den)
    out = FamilyRatio(path, r4.name, r4.workload, metric, r4.value, r6.value, None,
                      "not measured")
    if r4.value is None or r6.value is None:
        out.reason = "; ".join(f"{fam}: {r.reason}" for fam, r in (("IPv4", r4), ("IPv6", r6))
                               if r.value is None)
        return out
    if r4.value == 0:
        out.reason = f"IPv4 {r4.name} is zero"
        return out
    out.value = q = r6.value / r4.value
    if abs(q - 1.0) <= tolerance + 1e-12:
        out.status = "met"
    else:
        out.status = "better" if (q > 1.0) == METRICS[metric].higher_is_better else "missed"
    return out


def family_ratios(table: CellTable) -> list[FamilyRatio]:
    """Every ``FAMILY_PAIRS`` pair and metric on every path that ran over IPv6,
    where its subject (kpx, kpx-nfq) ran in either family: a contender not asked
    for gets no rows."""
    out = []
    for p in table.paths():
        if p is None or split_family(p)[1] != 6:
            continue
        base = split_family(p)[0]
        for num, den, metrics in FAMILY_PAIRS:
            for m in metrics:
                wl = METRICS[m].workload
                if not any(table.get(q, wl, num) is not None for q in (base, p)):
                    continue
                out.append(family_ratio(table, base, m, num, den))
    return out


# ---- targets -----------------------------------------------------------------------


@dataclass(frozen=True)
class Target:
    """One row of an issue's table. ``ref`` set -> compared with ``ref`` (a ratio, or a
    difference when ``compare`` says so), else absolute."""

    key: str
    """Unique over every issue's rows (issue 15's start ``nfq_`` or ``relay_``)."""
    label: str
    goal: str
    metric: str
    op: Literal[">=", "<="]
    threshold: float
    subject: str = "kpx"
    ref: str | None = None
    workload: str | None = None
    """The cell's workload when it is not the metric's family (``apply-10000``)."""
    compare: Literal["ratio", "difference"] = "ratio"
    """With ``ref``: ``ratio`` judges subject/ref (unit ``x``); ``difference`` judges
    subject - ref in the metric's unit, the excess of a cost both sides pay."""
    paths: tuple[str, ...] | None = None
    """Only these base paths (and their IPv6 twins); None: every path it ran on."""
    issue: int = 5

    @property
    def cell_workload(self) -> str:
        return self.workload or METRICS[self.metric].workload


CONTROL_TARGETS: tuple[Target, ...] = (
    Target("apply", "apply 10,000 services", "<= 1 s", "apply_s", "<=", 1.0,
           workload="apply-10000"),
    Target("converge", "endpoint-change convergence p99", "<= 100 ms", "converge_p99_ms",
           "<=", 100.0),
    Target("stall_conn", "new connection p99 during a 50,000-service apply", "<= 50 ms",
           "stall_conn_p99_ms", "<=", 50.0, workload="stall-50000"),
    Target("stall_healthz", "/healthz p99 during a 50,000-service apply", "<= 50 ms",
           "stall_healthz_p99_ms", "<=", 50.0, workload="stall-50000"),
)
"""The control plane's goals: kpx's whichever its proxy mode, so they are also
judged for kpx-nfq (the same rows, keys ``*_nfq``, after the relay's)."""
TARGETS: tuple[Target, ...] = (
    Target("bulk", "bulk Gbit/s", ">= 1.0x haproxy", "gbps", ">=", 1.0, ref="haproxy"),
    Target("rr", "rr req/s (one worker)", ">= 1.0x haproxy", "req_per_s", ">=", 1.0,
           ref="haproxy"),
    Target("rr_p99", "rr p99 latency", "<= 1.5x haproxy's", "p99_ms", "<=", 1.5,
           ref="haproxy"),
    Target("cps", "cps", ">= 1.0x haproxy", "conn_per_s", ">=", 1.0, ref="haproxy"),
    Target("mem", "memory per idle proxied connection", "<= 16 KiB", "kib_per_conn", "<=",
           16.0),
    *CONTROL_TARGETS,
    Target("workers", "--workers 2 rr", ">= 1.7x one worker", "req_per_s", ">=", 1.7,
           subject="kpx-w2", ref="kpx"),
    *(replace(t, key=f"{t.key}_nfq", label=f"kpx-nfq: {t.label}", subject="kpx-nfq")
      for t in CONTROL_TARGETS),
)
"""Issue 5's table: kpx's userspace relay against HAProxy, and its control plane."""

NFQ_CONNECT_ADDED_US = 200.0
"""Issue 15: kpx-nfq may add at most this to a connect()'s p99 at light load."""
ISSUE15_TARGETS: tuple[Target, ...] = (
    Target("nfq_cps_kernel", "kpx-nfq cps", ">= 0.9x kernel", "conn_per_s", ">=", 0.9,
           subject="kpx-nfq", ref="kernel", issue=15),
    Target("nfq_cps_haproxy", "kpx-nfq cps", ">= 1.3x haproxy", "conn_per_s", ">=", 1.3,
           subject="kpx-nfq", ref="haproxy", issue=15),
    Target("nfq_rr_kernel", "kpx-nfq rr req/s", ">= 0.9x kernel", "req_per_s", ">=", 0.9,
           subject="kpx-nfq", ref="kernel", issue=15),
    Target("nfq_bulk_kernel", "kpx-nfq bulk Gbit/s", ">= 0.9x kernel", "gbps", ">=", 0.9,
           subject="kpx-nfq", ref="kernel", issue=15),
    Target("nfq_connect_added", "kpx-nfq connect() p99 added over kernel, light load",
           f"<= {NFQ_CONNECT_ADDED_US:.0f} us",
           "connect_p99_us", "<=", NFQ_CONNECT_ADDED_US, subject="kpx-nfq", ref="kernel",
           compare="difference", issue=15),
    Target("relay_rr_haproxy", "kpx (userspace) rr req/s", ">= 1.0x haproxy", "req_per_s",
           ">=", 1.0, ref="haproxy", paths=("cross",), issue=15),
    Target("relay_cps_haproxy", "kpx (userspace) cps", ">= 1.0x haproxy", "conn_per_s",
           ">=", 1.0, ref="haproxy", paths=("cross",), issue=15),
    Target("relay_bulk_haproxy", "kpx (userspace) bulk Gbit/s", ">= 1.2x haproxy", "gbps",
           ">=", 1.2, ref="haproxy", issue=15),
)
"""Issue 15's table, judged in the same run as issue 5's: the nfqueue mode against
kernel DNAT (and HAProxy for cps), the relay against HAProxy. The relay's rr and cps
rows are for the cross path only, as the issue states them (issue 5 judges them on
every path); the connect row is the one difference target."""
_ALL_TARGETS = TARGETS + ISSUE15_TARGETS
TARGET_SECTIONS: tuple[tuple[int, tuple[Target, ...]], ...] = tuple(
    (issue, tuple(t for t in _ALL_TARGETS if t.issue == issue))
    for issue in dict.fromkeys(t.issue for t in _ALL_TARGETS))
"""Each issue's rows, in print order: one "== issue N targets ==" table each. The
numbers come from the rows (``Target.issue``), so a row cannot land under another
issue's heading."""


@dataclass
class TargetResult:
    key: str
    label: str
    goal: str
    path: str | None
    status: Literal["met", "missed", "not measured"]
    measured: float | None
    """The ratio for ratio targets, the difference or the value (in ``unit``) otherwise."""
    unit: str
    reason: str | None = None
    issue: int = 5
    """Which issue's table the row is from (absent from files written before issue 15:
    read it as 5)."""


def _target_paths(table: CellTable, t: Target) -> list[str | None]:
    """Where ``t`` is judged: every path its workload ran on (control: None); for a
    target of named paths, those of them that ran, else the named ones (not measured)."""
    wl = t.cell_workload
    ran = [p for p in table.paths() if any(c.workload == wl and c.path == p for c in table)]
    if t.paths is None:
        return ran or [None]
    mine: list[str | None] = [p for p in ran
                              if p is not None and split_family(p)[0] in t.paths]
    return mine or list(t.paths)


def _measure(table: CellTable, t: Target, path: str | None
             ) -> tuple[float | None, str | None, str]:
    """``t``'s figure on ``path``: (value, why none, unit)."""
    wl = t.cell_workload
    unit = "x" if t.ref is not None and t.compare == "ratio" else METRICS[t.metric].unit
    if t.paths is not None and path not in table.paths():
        return None, f"the {path} path was not run", unit
    if t.ref is not None and t.compare == "ratio":
        r = ratio(table, path, t.metric, t.subject, t.ref)
        return r.value, r.reason, unit
    if t.ref is not None:
        value, reason = difference(table, path, t.metric, t.subject, t.ref)
        return value, reason, unit
    c = table.get(path, wl, t.subject)
    if c is None:
        return None, f"{t.subject} {wl} not measured", unit
    if c.status != "ok":
        return None, f"{t.subject} {wl} {c.status}: {c.reason}", unit
    value = c.median(t.metric)
    return value, None if value is not None else f"no {t.metric} figure", unit


def evaluate_targets(table: CellTable, targets: tuple[Target, ...] = TARGETS
                     ) -> list[TargetResult]:
    """Each of ``targets`` (issue 5's by default) on each path where its workload ran
    (control has no path; a target of named paths is judged on those alone)."""
    out: list[TargetResult] = []
    for t in targets:
        for path in _target_paths(table, t):
            measured, reason, unit = _measure(table, t, path)
            if measured is None:
                status: Literal["met", "missed", "not measured"] = "not measured"
            elif t.op == ">=":
                status = "met" if measured >= t.threshold else "missed"
            else:
                status = "met" if measured <= t.threshold else "missed"
            out.append(TargetResult(t.key, t.label, t.goal, path, status, measured, unit,
                                    reason, t.issue))
    return out


def evaluate_all_targets(table: CellTable) -> list[TargetResult]:
    """Every issue's rows, issue 5's then issue 15's (each row says its ``issue``)."""
    return [r for _, targets in TARGET_SECTIONS for r in evaluate_targets(table, targets)]


# ---- the file ----------------------------------------------------------------------


def document(table: CellTable, *, meta: dict[str, Any], complete: bool) -> dict[str, Any]:
    """The whole results file as a JSON-able dict."""
    return {
        "schema": SCHEMA,
        "complete": complete,
        **meta,
        "metrics": {k: asdict(v) for k, v in METRICS.items()},
        "cells": [c.to_json() for c in table],
        "ratios": [asdict(r) for r in all_ratios(table)],
        "targets": [asdict(t) for t in evaluate_all_targets(table)],
        "family_ratios": [asdict(f) for f in family_ratios(table)],
    }


def write(path: Path, doc: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=2, sort_keys=False) + "\n")
    tmp.replace(path)


def load(path: Path) -> tuple[dict[str, Any], CellTable]:
    doc = json.loads(path.read_text())
    problems = validate(doc)
    if problems:
        raise ValueError(f"{path}: " + "; ".join(problems))
    return doc, CellTable([Cell.from_json(c) for c in doc["cells"]])


_TOP: dict[str, type | tuple[type, ...]] = {
    "schema": str, "complete": bool, "started": str, "finished": (str, type(None)),
    "config": dict, "machine": dict, "sysctls": dict, "topology": dict,
    "contenders": dict, "cells": list, "ratios": list, "targets": list, "notes": list,
    "charts": list,
}
_CELL: dict[str, type | tuple[type, ...]] = {
    "path": (str, type(None)), "workload": str, "contender": str, "status": str,
    "reason": (str, type(None)), "runs": list, "summary": dict,
}
_RUN: dict[str, type | tuple[type, ...]] = {
    "ok": bool, "metrics": dict, "error": (str, type(None)), "detail": dict,
}
_NUM = (int, float)


def _check(obj: Any, spec: dict[str, type | tuple[type, ...]], where: str) -> list[str]:
    if not isinstance(obj, dict):
        return [f"{where}: not an object"]
    out = []
    for k, typ in spec.items():
        if k not in obj:
            out.append(f"{where}.{k}: missing")
        elif not isinstance(obj[k], types := typ if isinstance(typ, tuple) else (typ,)) or (
            isinstance(obj[k], bool) and bool not in types
        ):
            out.append(f"{where}.{k}: {type(obj[k]).__name__} is not {typ}")
    return out


def validate(doc: Any) -> list[str]:
    """Every shape problem of a results document; empty when it is well formed."""
    out = _check(doc, _TOP, "$")
    if out:
        return out
    if doc["schema"] != SCHEMA:
        out.append(f"$.schema: {doc['schema']!r} is not {SCHEMA!r}")
    for i, c in enumerate(doc["cells"]):
        w = f"$.cells[{i}]"
        probs = _check(c, _CELL, w)
        out += probs
        if probs:
            continue
        if c["status"] not in ("ok", "failed", "n/a", "unavailable", "skipped"):
            out.append(f"{w}.status: {c['status']!r}")
        if c["status"] != "ok" and not c["reason"]:
            out.append(f"{w}: status {c['status']} without a reason")
        for j, r in enumerate(c["runs"]):
            out += _check(r, _RUN, f"{w}.runs[{j}]")
            if isinstance(r, dict) and isinstance(r.get("metrics"), dict):
                if not r.get("ok") and r["metrics"]:
                    out.append(f"{w}.runs[{j}]: a failed run has numbers")
                for k, v in r["metrics"].items():
                    if not isinstance(v, _NUM) or isinstance(v, bool):
                        out.append(f"{w}.runs[{j}].metrics.{k}: not a number")
        for k, s in c["summary"].items():
            if not isinstance(s, dict) or set(s) != {"min", "median", "max", "n"}:
                out.append(f"{w}.summary.{k}: needs min/median/max/n")
        if c["status"] != "ok" and c["summary"]:
            out.append(f"{w}: a {c['status']} cell has a summary")
    for i, r in enumerate(doc["ratios"]):
        if not isinstance(r, dict) or not {"name", "path", "metric", "value", "reason"} <= set(r):
            out.append(f"$.ratios[{i}]: malformed")
        elif r["value"] is None and not r["reason"]:
            out.append(f"$.ratios[{i}]: no value and no reason")
    for i, t in enumerate(doc["targets"]):
        if not isinstance(t, dict) or t.get("status") not in ("met", "missed", "not measured"):
            out.append(f"$.targets[{i}]: malformed")
        # Absent from files written before issue 15 (their rows are all issue 5's).
        elif "issue" in t and (not isinstance(t["issue"], int) or isinstance(t["issue"], bool)):
            out.append(f"$.targets[{i}].issue: {t['issue']!r} is not an issue number")
    # Absent from files written before issue 14; when present, well formed.
    for i, f in enumerate(doc.get("family_ratios", [])):
        if not isinstance(f, dict) or f.get("status") not in ("met", "better", "missed",
                                                               "not measured"):
            out.append(f"$.family_ratios[{i}]: malformed")
        elif f["value"] is None and not f.get("reason"):
            out.append(f"$.family_ratios[{i}]: no value and no reason")
    return out
