"""Where a lab lives and what it records: its run directory, ``lab.json``, its lock.

Owns: naming (``PREFIX_RE``, ``default_run_dir``), the records of what a lab
made (``ProcInfo`` for a process, ``PodRecord`` for a pod, both stored in
``<run_dir>/lab.json``), reading that record back (``read_record``,
``tracked_in``), removing it (``remove_record``), and the run directory's
lock (``RunDirLock``) that serializes every process driving one lab, and
``LabError``, what the lab raises when it cannot do what was asked.

Never: create namespaces or start processes. A record only describes; the
lab (``lab.cluster``) writes it before it acts, so a crash leaves enough
behind for ``lab.teardown`` to clean up.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import threading
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from lab import netns
from lab.controller import PodState
from lab.spec import PodSpec

DEFAULT_NAME = "kpx"
DEFAULT_RUN_BASE = "/run/kpx"
RUN_DIR_ENV = "KPX_RUN_DIR"
LAB_JSON = "lab.json"
STATE_FILE = "state.yaml"
PREFIX_RE = re.compile(r"^[a-z][a-z0-9]{0,15}$")
"""A lab name/prefix: no '-', so ``<prefix>-`` names this lab's namespaces only."""


class LabError(RuntimeError):
    """The lab could not do what was asked; the message says what and where to look."""


def default_run_dir(name: str = DEFAULT_NAME) -> Path:
    """``$KPX_RUN_DIR/<name>``, default ``/run/kpx/<name>``."""
    return Path(os.environ.get(RUN_DIR_ENV) or DEFAULT_RUN_BASE) / name


@dataclass
class ProcInfo:
    """A process the lab started: enough to find, check and kill it later."""

    pid: int
    start: int | None
    ns: str
    role: str
    log: str
    argv: list[str] = field(default_factory=list)

    def alive(self) -> bool:
        return netns.pid_alive(self.pid) and netns.pid_start_time(self.pid) == self.start


@dataclass
class PodRecord:
    """A pod that exists right now (including while terminating)."""

    spec: PodSpec
    ip: str
    slot: int
    uid: str
    terminating: bool = False
    delete_at: float | None = None
    proc: ProcInfo | None = None
    ip6: str | None = None
    """Its IPv6 address in a dual-stack lab."""

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["spec"] = self.spec.to_dict()
        return d

    def to_state(self) -> PodState:
        """The pod as the endpoints controller sees it."""
        s = self.spec
        return PodState(name=s.name, node=s.node, ip=self.ip, labels=s.labels, port=s.port,
                        port_name=s.port_name, ready=s.ready, terminating=self.terminating,
                        namespace=s.namespace, uid=self.uid, ip6=self.ip6)

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> PodRecord:
        spec = PodSpec.from_dict(d["spec"])
        proc = ProcInfo(**d["proc"]) if d.get("proc") else None
        return cls(spec=spec, ip=d["ip"], slot=d["slot"], uid=d["uid"],
                   terminating=d.get("terminating", False), delete_at=d.get("delete_at"),
                   proc=proc, ip6=d.get("ip6"))


def read_record(run_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """The ``lab.json`` in *run_dir*; LabError saying what to do if it is missing or corrupt."""
    path = Path(run_dir) / LAB_JSON
    try:
        data: dict[str, Any] = json.loads(path.read_text())
    except FileNotFoundError:
        raise LabError(f"no lab at {run_dir} (no {LAB_JSON}); run `kpx lab up`") from None
    except json.JSONDecodeError as exc:
        raise LabError(f"{path} is corrupt ({exc}); `kpx lab down` still cleans up") from None
    return data


def tracked_in(record: Mapping[str, Any]) -> list[ProcInfo]:
    """Every process a ``lab.json`` record names: proxies, pods, then the extra ones."""
    tracked = [ProcInfo(**d["proxy"]) for d in record.get("nodes", {}).values()
               if d.get("proxy")]
    tracked += [ProcInfo(**d["proc"]) for d in record.get("pods", {}).values() if d.get("proc")]
    return tracked + [ProcInfo(**d) for d in record.get("extra_processes", [])]


def remove_record(run_dir: Path) -> None:
    """Remove ``lab.json`` and the state file: what says a lab exists in *run_dir*."""
    for name in (LAB_JSON, STATE_FILE):
        with contextlib.suppress(FileNotFoundError):
            (run_dir / name).unlink()


class RunDirLock:
    """A re-entrant lock that also excludes other processes (flock on the run dir).

    flock locks belong to an open file, so a nested acquire in the same
    thread must not open the file again: it would deadlock against itself.
    """

    def __init__(self, path: Path) -> None:
        self._path = path
        self._rlock = threading.RLock()
        self._depth = 0
        self._fd: int | None = None

    def __enter__(self) -> None:
        self._rlock.acquire()
        if self._depth == 0:
            try:
                self._path.parent.mkdir(parents=True, exist_ok=True)
                fd = os.open(self._path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
                fcntl.flock(fd, fcntl.LOCK_EX)
                self._fd = fd
            except BaseException:
                self._rlock.release()
                raise
        self._depth += 1

    def __exit__(self, *exc: object) -> None:
        self._depth -= 1
        if self._depth == 0 and self._fd is not None:
            os.close(self._fd)
            self._fd = None
        self._rlock.release()
