"""The processes a lab runs: one server (echo or nginx) per pod, one ``kpx node`` per node, extras.

Owns: starting a process inside a namespace with its log file
(``<run_dir>/logs``) and this checkout on its path, the records of what is
running (``Processes.proxies``, ``Processes.extra``; pods carry their own),
the ``kpx node`` command line, waiting for processes to become ready,
collecting exited children, and stopping every ``kpx node`` at once on
teardown (SIGINT).

Never: kill by name or by anything but a recorded pid, or decide what runs
where: the lab (``lab.cluster``) says which namespace and argv, and
``lab.teardown`` does the killing that trusts no record.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from lab import netns, nginx
from lab.rundir import LabError, PodRecord, ProcInfo
from lab.topology import POD_NETWORK

log = logging.getLogger("kpx.lab")

PROJECT_ROOT = Path(__file__).resolve().parent.parent
"""The checkout this lab runs from; children import it, whatever their cwd."""


@dataclass(frozen=True, slots=True)
class Readiness:
    """A process to wait for: its name, the process, its check, whether a miss is fatal."""

    what: str
    proc: ProcInfo
    ready: Callable[[], bool]
    hard: bool


class Processes:
    """What one lab has running, and the ``Popen`` handles that let it reap its children."""

    def __init__(self, logs_dir: Path) -> None:
        self.logs_dir = logs_dir
        self.proxies: dict[str, ProcInfo] = {}
        self.extra: list[ProcInfo] = []
        self._popen: dict[int, subprocess.Popen[bytes]] = {}

    def spawn(self, ns: str, argv: list[str], role: str, log_path: Path) -> ProcInfo:
        with open(log_path, "ab") as f:
            f.write(f"--- {time.strftime('%H:%M:%S')} lab: starting {' '.join(argv)}\n"
                    .encode())
        p = netns.popen_in(ns, argv, log_path, env=child_env())
        self._popen[p.pid] = p
        return ProcInfo(pid=p.pid, start=netns.pid_start_time(p.pid), ns=ns, role=role,
                        log=str(log_path), argv=argv)

    def start_pod(self, rec: PodRecord, ns: str) -> None:
        """Start pod *rec*'s server in *ns* (echo or nginx); its process lands in ``rec.proc``."""
        spec = rec.spec
        if spec.image == "nginx":
            nginx.ensure_installed()
            conf, workdir = nginx.write_conf(spec.name, spec.node, spec.port,
                                             spec.proxy_protocol, self.logs_dir.parent / "pods")
            argv = nginx.nginx_argv(conf, workdir)
        else:
            argv = [sys.executable, "-m", "lab.echo", "--name", spec.name, "--node",
                    spec.node, "--port", str(spec.port)]
            if rec.ip6:  # a dual-stack pod answers on both families
                argv += ["--bind", "0.0.0.0", "--bind", "::"]
        rec.proc = self.spawn(ns, argv, f"pod/{rec.spec.name}",
                              self.logs_dir / f"pod-{rec.spec.name}.log")

    def start_proxy(self, node: str, ns: str, argv: list[str]) -> None:
        self.proxies[node] = self.spawn(ns, argv, f"proxy/{node}", self.logs_dir / f"{node}.log")

    def tracked(self, pods: Iterable[PodRecord]) -> list[ProcInfo]:
        """Every recorded process: the pods' (given), the proxies, the extra ones."""
        return [*(r.proc for r in pods if r.proc), *self.proxies.values(), *self.extra]

    def interrupt_proxies(self) -> None:
        """SIGINT every ``kpx node``: stop now, without waiting for a successor.

        SIGTERM would keep each accepting for its ``--handover-wait`` first,
        in case a new one takes over; nothing will in a teardown.
        """
        procs = [*self.proxies.values(),
                 *(p for p in self.extra if p.role.startswith("proxy/"))]
        for p in procs:
            if p.alive():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGINT)

    def wait_ready(self, waits: Sequence[Readiness], timeout: float, lab_name: str) -> None:
        """Poll every check until it passes: bounded, all in parallel.

        A process that exits is an error, with the tail of its log in the
        message. At the deadline, a hard check still failing is an error too;
        soft ones are only logged.
        """
        deadline = time.monotonic() + timeout
        pending = list(waits)
        while pending:
            still = []
            for w in pending:
                if not w.proc.alive():
                    self.reap(w.proc.pid)
                    raise LabError(f"{w.what} exited during start-up; {w.proc.log}:\n"
                                   + tail(w.proc.log))
                if not w.ready():
                    still.append(w)
            pending = still
            if not pending:
                break
            if time.monotonic() >= deadline:
                hard = [w for w in pending if w.hard]
                if hard:
                    raise LabError(f"{hard[0].what} not ready after {timeout:.0f}s;"
                                   f" {hard[0].proc.log}:\n" + tail(hard[0].proc.log))
                log.warning("lab %s: not ready after %.0fs: %s", lab_name, timeout,
                            ", ".join(w.what for w in pending))
                break
            time.sleep(0.02)

    def reap(self, pid: int) -> None:
        """Collect a child we started, so it does not linger as a zombie."""
        p = self._popen.pop(pid, None)
        if p is not None:
            with contextlib.suppress(Exception):
                p.wait(timeout=1)

    def forget(self) -> None:
        """Reap what can be reaped and drop every record (after a teardown killed them)."""
        for p in self._popen.values():
            with contextlib.suppress(Exception):
                p.wait(timeout=0.1)
        self._popen.clear()
        self.proxies.clear()
        self.extra.clear()


def child_env() -> dict[str, str]:
    """The environment of every process the lab starts: this checkout first on the path."""
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PROJECT_ROOT), env.get("PYTHONPATH")]))
    return env


def proxy_argv(node: str, state_path: Path, extra_args: Sequence[str],
               healthz_port: int | None, metrics_port: int | None,
               cluster_cidrs: Sequence[str] = (POD_NETWORK,)) -> list[str]:
    """The ``kpx node`` command line the lab runs on *node*."""
    argv = [sys.executable, "-m", "proxy", "node", "--hostname-override", node,
            "--state", str(state_path)]
    extra = list(extra_args)
    if healthz_port and "--healthz-bind-address" not in extra:
        argv += ["--healthz-bind-address", f"0.0.0.0:{healthz_port}"]
    if metrics_port and "--metrics-bind-address" not in extra:
        argv += ["--metrics-bind-address", f"127.0.0.1:{metrics_port}"]
    if "--cluster-cidr" not in extra and cluster_cidrs:
        # As kube-proxy is given it: pod traffic gets Cluster semantics, and a
        # pod keeps its IP on a ClusterIP hop to another node.
        argv += ["--cluster-cidr", ",".join(cluster_cidrs)]
    return argv + extra


def proxy_healthz_port(extra_args: Sequence[str], healthz_port: int | None) -> int | None:
    """The port a ``kpx node`` with these arguments serves /healthz on, if any."""
    extra = list(extra_args)
    if "--no-healthz" in extra:
        return None
    if "--healthz-bind-address" in extra:
        i = extra.index("--healthz-bind-address")
        with contextlib.suppress(IndexError, ValueError):
            return int(extra[i + 1].rsplit(":", 1)[1])
        return None
    return healthz_port


def read_text(path: Path) -> str:
    """A log file's text; empty if the process never wrote one."""
    try:
        return path.read_text(errors="replace")
    except FileNotFoundError:
        return ""


def tail(path: str | Path, lines: int = 20) -> str:
    return "\n".join(read_text(Path(path)).splitlines()[-lines:])
