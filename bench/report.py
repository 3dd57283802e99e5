"""Human-facing output: the terminal tables and the PNG charts.

Owns: formatting a ``CellTable`` (median with min-max over runs, or the
failure reason in place of any number), the ratio and target tables, and one
bar chart per workload. matplotlib is an optional extra (``.[bench]``): when
it is missing, charts are skipped with a note and everything else still works.

Never: compute a figure: medians, ratios and verdicts come from
``bench.results``, so what is printed is what the results file holds.
"""

from __future__ import annotations

import math
from pathlib import Path

from bench.results import (
    FAMILY_TOLERANCE,
    METRICS,
    CellTable,
    FamilyRatio,
    Ratio,
    TargetResult,
    family,
    metrics_of,
)

CONTENDER_ORDER = ("direct", "kernel", "haproxy", "naive", "socat", "kpx", "kpx-w2")


def fmt(value: float | None, unit: str = "") -> str:
    """Three significant figures, thousands separated; '-' for None."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    a = abs(value)
    if a >= 1000:
        return f"{value:,.0f}"
    if a >= 100:
        return f"{value:.0f}"
    if a >= 10:
        return f"{value:.1f}"
    if a >= 1:
        return f"{value:.2f}"
    return f"{value:.3g}"


def _order(name: str) -> tuple[int, str]:
    return (CONTENDER_ORDER.index(name) if name in CONTENDER_ORDER else 99, name)


def _path_order(table: CellTable, path: str | None) -> tuple[int, int]:
    """Paths in the order they ran (local before cross); control (None) last."""
    paths = [p for p in table.paths() if p is not None]
    return (1, 0) if path is None else (0, paths.index(path) if path in paths else 99)


def _wl_order(w: str) -> tuple[int, str]:
    fams = ("bulk", "rr", "cps", "connect", "mem", "udp", "apply", "idle", "converge",
            "stall")
    f = family(w)
    size = w.split("-", 1)[1] if "-" in w else ""
    return (fams.index(f) if f in fams else 99, size.zfill(9))


def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    line = "  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True))
    out = [line, "  ".join("-" * w for w in widths)]
    out += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    return "\n".join(out)


def run_line(path: str | None, workload: str, contender: str, index: int, total: int,
             ok: bool, metrics: dict[str, float], error: str | None) -> str:
    """One live row, printed as each run finishes."""
    where = f"{path or '-':<5} {workload:<11} {contender:<7} run {index + 1}/{total}"
    if not ok:
        return f"{where}  FAILED: {error}"
    parts = [
        (f"{METRICS[k].short} " if METRICS[k].short else "") + f"{fmt(v)} {METRICS[k].unit}"
        if k in METRICS else f"{k}={fmt(v)}"
        for k, v in metrics.items()
    ]
    return f"{where}  " + "  ".join(parts)


def summary_table(table: CellTable, width: int = 70) -> str:
    """Median (min-max) per cell and metric; status and reason for the rest."""
    rows: list[list[str]] = []
    cells = sorted(table, key=lambda c: (_path_order(table, c.path), _wl_order(c.workload),
                                         _order(c.contender)))
    for c in cells:
        if c.status != "ok":
            reason = (c.reason or "").replace("\n", " ")
            if len(reason) > width:
                reason = reason[: width - 3] + "..."
            rows.append([c.path or "-", c.workload, c.contender, c.status.upper(), "", "",
                         "", str(len(c.runs)), reason])
            continue
        for m in metrics_of(c.workload):
            s = c.summary.get(m.name)
            if s is None:
                continue
            rows.append([c.path or "-", c.workload, c.contender, m.label, fmt(s.median),
                         f"{fmt(s.min)}-{fmt(s.max)}", m.unit, str(s.n), ""])
    return _table(rows, ["path", "workload", "contender", "metric", "median", "min-max",
                         "unit", "n", "note"])


def ratio_table(ratios: list[Ratio]) -> str:
    rows = []
    for r in ratios:
        better = METRICS[r.metric].higher_is_better
        value = f"{r.value:.2f}x" if r.value is not None else "-"
        rows.append([r.path or "-", r.name, METRICS[r.metric].label,
                     value, "higher is better" if better else "lower is better",
                     (r.reason or "")[:70]])
    return _table(rows, ["path", "ratio", "metric", "value", "", "why no value"])


def target_table(targets: list[TargetResult]) -> str:
    rows = []
    for t in targets:
        if t.measured is None:
            measured = "-"
        elif t.unit == "x":
            measured = f"{t.measured:.2f}x"
        else:
            measured = f"{fmt(t.measured)} {t.unit}"
        rows.append([t.label, t.path or "-", t.goal, measured, t.status.upper(),
                     (t.reason or "")[:70]])
    return _table(rows, ["target", "path", "goal", "measured", "status", "note"])


def family_table(rows: list[FamilyRatio]) -> str:
    """kpx's ratios over IPv4 and IPv6 side by side, and IPv6/IPv4 (issue 14's target)."""
    out = []
    for r in rows:
        ratio = f"{r.value:.2f}" if r.value is not None else "-"
        out.append([r.path, r.name, METRICS[r.metric].label,
                    f"{r.ipv4:.2f}x" if r.ipv4 is not None else "-",
                    f"{r.ipv6:.2f}x" if r.ipv6 is not None else "-",
                    ratio, r.status.upper(), (r.reason or "")[:70]])
    return _table(out, ["path", "ratio", "metric", "IPv4", "IPv6", "IPv6/IPv4",
                        f"within {FAMILY_TOLERANCE:.0%}", "why no value"])


# ---- charts ------------------------------------------------------------------------


def charts(table: CellTable, out_dir: Path, stem: str) -> tuple[list[str], str | None]:
    """One PNG per workload family; returns (files, note when skipped)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return [], "matplotlib is not installed (pip install '.[bench]'): charts skipped"

    files: list[str] = []
    fams = sorted({family(c.workload) for c in table}, key=_wl_order)
    for fam in fams:
        cells = [c for c in table if family(c.workload) == fam]
        metrics = [m for m in METRICS.values() if m.workload == fam]
        fig, axes = plt.subplots(1, len(metrics), figsize=(5.5 * len(metrics), 4.2),
                                 squeeze=False)
        groups = sorted({(c.path, c.workload) for c in cells},
                        key=lambda g: (_path_order(table, g[0]), _wl_order(g[1])))
        names = sorted({c.contender for c in cells}, key=_order)
        if len(names) > 1:
            # Contenders on the x axis, one bar series per path.
            xlabels = names
            series = [(g[0] or g[1], [(i, table.get(g[0], g[1], n)) for i, n in enumerate(names)])
                      for g in groups]
        else:
            # One contender (control: kpx): the sizes / paths go on the x axis.
            xlabels = [g[0] if g[0] and len({p for p, _ in groups}) > 1 else g[1]
                       for g in groups]
            series = [(names[0], [(i, table.get(g[0], g[1], names[0]))
                                  for i, g in enumerate(groups)])]
        for ax, m in zip(axes[0], metrics, strict=True):
            width = 0.8 / max(1, len(series))
            drawn = False
            for si, (label, points) in enumerate(series):
                xs, ys, lo, hi = [], [], [], []
                for xi, c in points:
                    x = xi + (si - (len(series) - 1) / 2) * width
                    s = c.summary.get(m.name) if c is not None else None
                    if s is None:
                        if c is not None:
                            ax.text(x, 0, f" {c.status}", rotation=90, ha="center",
                                    va="bottom", fontsize=8, color="firebrick")
                        continue
                    xs.append(x)
                    ys.append(s.median)
                    lo.append(s.median - s.min)
                    hi.append(s.max - s.median)
                if xs:
                    ax.bar(xs, ys, width=width, yerr=[lo, hi], capsize=3,
                           label=label, color=f"C{si}")
                    drawn = True
            ax.set_xlim(-0.6, len(xlabels) - 0.4)
            if not drawn:
                ax.set_ylim(0, 1)
            ax.set_xticks(range(len(xlabels)))
            ax.set_xticklabels(xlabels, rotation=20)
            arrow = "higher is better" if m.higher_is_better else "lower is better"
            ax.set_title(f"{m.label} ({m.unit}), {arrow}", fontsize=10)
            ax.grid(axis="y", alpha=0.3)
            if len(series) > 1 and drawn:
                ax.legend(fontsize=8)
        fig.suptitle(f"kpx bench: {fam} (median, whiskers = min-max)")
        fig.tight_layout()
        path = out_dir / f"{stem}-{fam}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        files.append(str(path))
    return files, None
