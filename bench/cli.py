"""``kpx bench``: kpx against direct, the kernel, HAProxy, naive asyncio and socat, in one run.

Owns: the ``kpx bench`` flags and their meaning (``build_config``), checking
and, unless ``--no-install``, apt-installing the load generators it needs,
and turning SIGTERM and Ctrl-C into the runner's cleanup path.

Never: measure or create anything itself: ``bench.runner.Bench`` does, and
removes it all again.

Flags choose what runs; ``--quick`` is a complete but short run (one run per
cell, short durations, local path only, 20 endpoint changes) meant to finish
in under three minutes; the default is the full run the lead measures with
(three runs per cell, both paths, 100 endpoint changes). The ``udp``
workload runs only when named (``--workloads udp``, or a list with it): the
default run stays what it was before UDP, and so does the default contender
list, to which udp adds socat (UDP only) when it runs.

``--families`` (issue 14) picks the address families of the data-path runs,
as a comma list like ``--paths``: ``4`` (the default: exactly the run there
always was), ``6``, or ``4,6`` (each contender's IPv6 start right after its
IPv4 one, and the IPv6/IPv4 ratio table). Over IPv6 only rr and cps run,
on the NodePort paths; asking for nothing that can run over the families
given (``--families 6 --workloads mem``) is an error, not an empty run.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import FrameType

from bench.contenders import CONTENDER_ORDER, UDP_ONLY, default_contenders
from bench.control import ControlSettings
from bench.results import DEFAULT_WORKLOADS, FAMILIES, IPV6_PATHS, IPV6_WORKLOADS, WORKLOADS
from bench.runner import Bench, Config
from bench.scale import CONTENDERS as SCALE_CONTENDERS
from bench.scale import run_cli as run_scale
from bench.workloads import Settings

RESULTS_DIR = Path(__file__).resolve().parent / "results"
PATHS = ("local", "cross")
"""The default paths; ``--paths`` also takes ``clusterip``."""
ALL_PATHS = (*PATHS, "clusterip")
TOOLS = {"ip": "iproute2", "nft": "nftables", "haproxy": "haproxy", "wrk": "wrk",
         "iperf3": "iperf3", "sysctl": "procps"}
UDP_TOOLS = {"socat": "socat"}
"""Installed when the udp workload runs with socat, but never required: without it the
socat contender is reported unavailable and everything else runs."""


def _csv(allowed: tuple[str, ...]):  # type: ignore[no-untyped-def]
    def parse(text: str) -> list[str]:
        items = [x.strip() for x in text.split(",") if x.strip()]
        bad = [x for x in items if x not in allowed]
        if bad:
            raise argparse.ArgumentTypeError(f"unknown {bad}; choose from {','.join(allowed)}")
        return items
    return parse


class ConfigError(ValueError):
    """Flags that contradict each other; the message names the flags."""


def _families(text: str) -> list[int]:
    items = [x.strip().lower().removeprefix("ipv") for x in text.split(",") if x.strip()]
    bad = [x for x in items if x not in {str(f) for f in FAMILIES}]
    if bad or not items:
        raise argparse.ArgumentTypeError(
            f"unknown {bad or text!r}; choose from {','.join(map(str, FAMILIES))}")
    return sorted({int(x) for x in items})


def _sizes(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true",
                        help="short complete run: 1 run per cell, local path, < 3 minutes "
                             "(with --scale: 300 connections per point, < 5 minutes)")
    parser.add_argument("--scale", action="store_true",
                        help="kube-proxy's iptables and nftables rule layouts against kpx at "
                             "1,000-30,000 services (bench/README.md); the other flags but "
                             "--quick, --out, --kpx, --keep-logs and --scale-* are ignored")
    parser.add_argument("--scale-sizes", type=_sizes, metavar="N,N",
                        help="service counts for --scale (default 1000,5000,10000,30000)")
    parser.add_argument("--scale-contenders", type=_csv(SCALE_CONTENDERS), metavar="LIST",
                        help=f"comma list of {','.join(SCALE_CONTENDERS)} (default: all)")
    parser.add_argument("--scale-connections", type=int, metavar="N",
                        help="fresh connections per latency point (default 2000, quick 300)")
    parser.add_argument("--duration", type=float, metavar="S",
                        help="seconds per bulk/rr/cps run (default 5/10/10, quick 2/3/3); "
                             "udp runs as long as rr")
    parser.add_argument("--workloads", type=_csv(WORKLOADS), metavar="LIST",
                        help=f"comma list of {','.join(WORKLOADS)} (default: "
                             f"{','.join(DEFAULT_WORKLOADS)}; udp only when named)")
    parser.add_argument("--contenders", type=_csv(CONTENDER_ORDER), metavar="LIST",
                        help=f"comma list of {','.join(CONTENDER_ORDER)} (default: all, "
                             f"{','.join(UDP_ONLY)} only with the udp workload)")
    parser.add_argument("--runs", type=int, metavar="N",
                        help="runs per contender and workload (default 3, quick 1)")
    parser.add_argument("--paths", type=_csv(ALL_PATHS), metavar="LIST",
                        help="local (endpoint on node1), cross (endpoint behind node2, SNAT), "
                             "clusterip (a pod on node1 dials the service's ClusterIP, "
                             "endpoint behind node2); default local,cross, quick local")
    parser.add_argument("--families", type=_families, metavar="LIST",
                        help="address families of the data-path runs: comma list of 4,6 "
                             "(default 4). 6 runs rr, cps and connect over IPv6 on the "
                             "NodePort paths (local, cross) and, with 4,6, reports each kpx "
                             "ratio over IPv6 against the same over IPv4 (issue 14)")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR, metavar="DIR",
                        help=f"where the JSON and PNGs go (default {RESULTS_DIR})")
    parser.add_argument("--pause", type=float, metavar="S",
                        help="pause before each run, for TIME_WAIT (default 3, quick 1)")
    parser.add_argument("--connects", type=int, metavar="N",
                        help="fresh connections the connect workload times, one at a time "
                             "with a 2 ms pause (default 2000, quick 500)")
    parser.add_argument("--mem-connections", type=int, default=10000, metavar="N",
                        help="idle connections for mem (default 10000, capped by RLIMIT_NOFILE)")
    parser.add_argument("--control-sizes", type=_sizes, default=[1000, 10000], metavar="N,N",
                        help="service counts for control apply/idle (default 1000,10000)")
    parser.add_argument("--stall-services", type=int, default=50000, metavar="N",
                        help="services in the state whose apply the stall probes time "
                             "(default 50000, of which at most 10000 NodePorts; 0 skips)")
    parser.add_argument("--changes", type=int, metavar="N",
                        help="endpoint changes for convergence (default 100, quick 20)")
    parser.add_argument("--idle-seconds", type=float, metavar="S",
                        help="idle CPU sampling window (default 5, quick 2)")
    parser.add_argument("--bulk-tool", choices=("exact", "iperf3"), default="exact",
                        help="exact: bench.bulk, bytes verified exactly (default); iperf3: "
                             "its JSON, receiver may miss up to 64 MiB still in flight")
    parser.add_argument("--etp", choices=("Cluster", "Local"), default="Cluster",
                        help="externalTrafficPolicy of the service kpx serves (default "
                             "Cluster; Local drops traffic on the cross path by design)")
    parser.add_argument("--kpx", default=None, metavar="PATH",
                        help="the kpx executable (default: the one beside this Python)")
    parser.add_argument("--keep-logs", action="store_true",
                        help="keep process logs and state files even when nothing failed")
    parser.add_argument("--no-install", action="store_true",
                        help="do not apt-get install missing tools (haproxy, wrk, iperf3, nft; "
                             "socat for udp)")


def parse(argv: list[str]) -> argparse.Namespace:
    """``kpx bench``'s arguments parsed on their own, as the CLI would (tools, tests)."""
    parser = argparse.ArgumentParser(prog="kpx bench")
    configure(parser)
    return parser.parse_args(argv)


def build_config(args: argparse.Namespace) -> Config:
    """Flags -> Config; quick and full differ only in defaults, explicit flags win."""
    q = bool(args.quick)
    durations = {"bulk": 2.0, "rr": 3.0, "cps": 3.0} if q else \
        {"bulk": 5.0, "rr": 10.0, "cps": 10.0}
    if args.duration:
        durations = dict.fromkeys(durations, float(args.duration))
    settings = Settings(
        durations=durations,
        pause=args.pause if args.pause is not None else (1.0 if q else 3.0),
        mem_connections=args.mem_connections,
        bulk_tool=args.bulk_tool,
        connect_count=max(1, args.connects) if args.connects else (500 if q else 2000),
    )
    control = ControlSettings(
        sizes=tuple(args.control_sizes),
        stall_services=max(0, args.stall_services),
        changes=args.changes if args.changes is not None else (20 if q else 100),
        idle_seconds=args.idle_seconds if args.idle_seconds is not None else (2.0 if q else 5.0),
    )
    families = getattr(args, "families", None) or [4]
    paths = args.paths or (["local"] if q else list(PATHS))
    workloads = args.workloads or list(DEFAULT_WORKLOADS)
    timed_by_wrk = [w for w in ("rr", "cps") if w in workloads]
    if args.duration and timed_by_wrk and args.duration != int(args.duration):
        wrk = ",".join(timed_by_wrk)
        raise ConfigError(f"--duration {args.duration:g}: wrk runs {wrk} for whole seconds; "
                          f"give a whole number, or drop {wrk} from --workloads")
    if 4 not in families:
        # IPv6 alone: only what runs over IPv6, and the defaults narrowed to it.
        if not args.workloads:
            workloads = list(IPV6_WORKLOADS)
        if not args.paths:
            paths = [p for p in paths if p in IPV6_PATHS]
        v4_only = [w for w in workloads if w not in IPV6_WORKLOADS]
        if v4_only:
            raise ConfigError(f"--families 6: {','.join(v4_only)} run over IPv4 only (IPv6 "
                              f"runs {','.join(IPV6_WORKLOADS)}); use --families 4,6 or drop "
                              f"them from --workloads")
        bad_paths = [p for p in paths if p not in IPV6_PATHS]
        if bad_paths:
            raise ConfigError(f"--families 6: the {','.join(bad_paths)} path runs over IPv4 "
                              f"only (IPv6 runs the NodePort paths "
                              f"{','.join(IPV6_PATHS)}); use --families 4,6")
    return Config(
        quick=q,
        runs=args.runs or (1 if q else 3),
        paths=paths,
        # RSS per connection does not depend on where the endpoint is: measure once.
        mem_paths=["local"] if "local" in paths else paths[:1],
        workloads=workloads,
        contenders=args.contenders or default_contenders(workloads),
        families=families,
        out=args.out,
        kpx=args.kpx or _default_kpx(),
        etp=args.etp,
        keep_logs=args.keep_logs,
        settings=settings,
        control=control,
    )


def _default_kpx() -> str:
    beside = Path(sys.executable).parent / "kpx"
    if beside.exists():
        return str(beside)
    return shutil.which("kpx") or "kpx"


def ensure_tools(install: bool, optional: dict[str, str] | None = None) -> list[str]:
    """Missing required tools after an optional apt-get install (the issue wants haproxy
    installed). ``optional`` tools are installed alongside but never reported missing."""
    tools = {**TOOLS, **(optional or {})}
    missing = [t for t in tools if shutil.which(t) is None]
    if missing and install and shutil.which("apt-get"):
        pkgs = sorted({tools[t] for t in missing})
        print(f"kpx bench: installing {' '.join(pkgs)} with apt-get", file=sys.stderr)
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        subprocess.run(["apt-get", "update", "-qq"], check=False, env=env)
        subprocess.run(["apt-get", "install", "-y", "-qq", "--no-install-recommends", *pkgs],
                       check=False, env=env)
    return [t for t in TOOLS if shutil.which(t) is None]


def run(args: argparse.Namespace) -> int:
    if os.geteuid() != 0:
        print("kpx bench: needs root (network namespaces, nftables)", file=sys.stderr)
        return 2
    if args.scale:
        missing = ensure_tools(not args.no_install, {"iptables": "iptables",
                                                     "conntrack": "conntrack"})
        if missing:
            print(f"kpx bench: missing tools: {', '.join(missing)}", file=sys.stderr)
            return 2
        return _with_signals(lambda: run_scale(
            args.quick, args.out, args.kpx or _default_kpx(), args.scale_sizes,
            args.scale_contenders, args.scale_connections, args.keep_logs))
    try:
        cfg = build_config(args)
    except ConfigError as e:
        print(f"kpx bench: {e}", file=sys.stderr)
        return 2
    optional = UDP_TOOLS if "udp" in cfg.workloads and "socat" in cfg.contenders else None
    missing = ensure_tools(not args.no_install, optional)
    if missing:
        print(f"kpx bench: missing tools: {', '.join(missing)}", file=sys.stderr)
        return 2

    return _with_signals(lambda: Bench(cfg).run())


def _with_signals(body: Callable[[], int]) -> int:
    """Run ``body`` with SIGTERM and Ctrl-C turned into the cleanup path."""

    def on_term(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    # SIGINT explicitly too: a shell that starts us in the background hands us
    # SIGINT ignored, and the cleanup promise must hold for Ctrl-C regardless.
    old_term = signal.signal(signal.SIGTERM, on_term)
    old_int = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        return body()
    finally:
        signal.signal(signal.SIGTERM, old_term)
        signal.signal(signal.SIGINT, old_int)
