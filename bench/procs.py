"""Background processes the harness starts, and only those, stopped by pid.

Owns: starting a long-running process (usually through ``ip netns exec``,
which execs, so the pid we hold *is* the program's pid), capturing its output
to a log file for failure reasons, raising its RLIMIT_NOFILE (10,000 proxied
connections need ~20,000 descriptors), measuring its RSS and CPU time, and
stopping it with SIGTERM then SIGKILL.

Never: signal anything it did not start. Each process gets its own session so
the group we signal is exactly the process and its own children (kpx
``--workers``), never a broad name match.
"""

from __future__ import annotations

import contextlib
import os
import re
import resource
import signal
import subprocess
from collections.abc import Sequence
from pathlib import Path

CLK_TCK = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")


def nofile_hard_limit() -> int:
    """The RLIMIT_NOFILE hard limit we can hand to children.

    Raising it needs CAP_SYS_RESOURCE, which containers often lack (this one
    stops at 20,000), so every descriptor budget is clamped to this value and
    the mem workload sizes its connection count from it.
    """
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    return 1 << 20 if hard == resource.RLIM_INFINITY else int(hard)


def raise_nofile(n: int) -> None:
    """preexec: give the child ``n`` descriptors, clamped to the hard limit."""
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard != resource.RLIM_INFINITY:
        n = min(n, hard)
    resource.setrlimit(resource.RLIMIT_NOFILE, (n, hard))


class Proc:
    """One background process with its log file."""

    def __init__(self, name: str, argv: Sequence[str], log_dir: Path,
                 nofile: int | None = None, env: dict[str, str] | None = None) -> None:
        self.name = name
        self.argv = list(argv)
        self.log_path = log_dir / f"{name}.log"
        self.nofile = nofile
        self.env = env
        self.popen: subprocess.Popen[bytes] | None = None

    def start(self) -> Proc:
        log = open(self.log_path, "ab")  # noqa: SIM115 - owned by the child
        try:
            n = self.nofile
            self.popen = subprocess.Popen(
                self.argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True, env=self.env,
                preexec_fn=(lambda: raise_nofile(n)) if n else None,
            )
        finally:
            log.close()
        return self

    @property
    def pid(self) -> int:
        assert self.popen is not None
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def returncode(self) -> int | None:
        return None if self.popen is None else self.popen.poll()

    def tail(self, lines: int = 12, limit: int = 1500) -> str:
        """The end of the process's output, for a failure reason."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        out = "\n".join(text.strip().splitlines()[-lines:])
        return out[-limit:]

    def why(self) -> str:
        """The most telling line of the output: a Python exception line if there is one.

        A traceback's last line names the error (``ModuleNotFoundError: ...``);
        otherwise the last non-empty line. The log path follows for the rest.
        """
        lines = [ln.strip() for ln in self.tail(60, 20000).splitlines() if ln.strip()]
        exc = [ln for ln in lines if re.match(r"^[\w.]+(Error|Exception|Exit)\b.*", ln)]
        pick = exc[-1] if exc else (lines[-1] if lines else "no output")
        return f"{pick[:300]} (log: {self.log_path})"

    def stop(self, timeout: float = 5.0) -> None:
        """SIGTERM our own process group, then SIGKILL if it lingers."""
        if self.popen is None:
            return
        p = self.popen
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGTERM)
            try:
                p.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(p.pid, signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(timeout=timeout)
        else:
            # The leader is gone; its workers may not be.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGKILL)

    def kill(self, timeout: float = 5.0) -> None:
        """SIGKILL our own process group, and reap the leader: nothing runs a cleanup."""
        if self.popen is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.popen.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout=timeout)

    def tree(self) -> list[int]:
        return process_tree(self.pid) if self.alive() else []


def process_tree(pid: int) -> list[int]:
    """pid and all its descendants (kpx ``--workers`` forks children)."""
    out = [pid]
    i = 0
    while i < len(out):
        p = out[i]
        i += 1
        with contextlib.suppress(OSError):
            for task in os.listdir(f"/proc/{p}/task"):
                with contextlib.suppress(OSError):
                    kids = Path(f"/proc/{p}/task/{task}/children").read_text().split()
                    out.extend(int(k) for k in kids if int(k) not in out)
    return out


def machine_jiffies() -> tuple[int, int]:
    """(busy, total) clock ticks of all CPUs since boot, from /proc/stat.

    Busy is everything but idle and iowait: softirq work done for the
    veth pairs counts, wherever it runs.
    """
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    total = sum(fields[:8])
    return total - idle, total


def rss_bytes(pids: Sequence[int]) -> int:
    """Summed resident set of ``pids`` (statm field 2, in pages)."""
    total = 0
    for p in pids:
        with contextlib.suppress(OSError):
            total += int(Path(f"/proc/{p}/statm").read_text().split()[1]) * PAGE
    return total


def cpu_times(pids: Sequence[int]) -> tuple[float, float]:
    """(utime, stime) of ``pids`` in seconds, from /proc/<pid>/stat: user and kernel."""
    user = kernel = 0
    for p in pids:
        with contextlib.suppress(OSError):
            stat = Path(f"/proc/{p}/stat").read_text()
            fields = stat[stat.rindex(")") + 2:].split()
            user += int(fields[11])
            kernel += int(fields[12])
    return user / CLK_TCK, kernel / CLK_TCK


def cpu_seconds(pids: Sequence[int]) -> float:
    """utime+stime of ``pids`` in seconds, from /proc/<pid>/stat."""
    return sum(cpu_times(pids))
