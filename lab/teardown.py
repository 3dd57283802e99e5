"""Removing a lab while trusting nothing: not its record, not that its processes still run.

Owns: killing every process of a lab and removing every one of its
namespaces (``teardown``), by prefix alone when there is no usable record
(``sweep``), and clearing what an earlier lab with the same prefix left
behind before a new one is built (``teardown_previous``).

Never: kill a process outside the lab's namespaces that the record does not
name with a matching start time (a recycled pid is never killed), touch a
namespace not named ``<prefix>-*`` or recorded, or kill the calling process.
A prefix never contains ``-``, so ``<prefix>-`` matches one lab only.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Sequence
from pathlib import Path

from lab import netns
from lab.rundir import PREFIX_RE, LabError, ProcInfo, read_record, tracked_in

log = logging.getLogger("kpx.lab")


def teardown(prefix: str, namespaces: Sequence[str], tracked: Sequence[ProcInfo],
             grace: float) -> None:
    """Kill every lab process and remove every lab namespace, trusting nothing.

    Processes are found three ways: the record (checked against the pid's
    start time, so a recycled pid is never killed), and a scan of /proc for
    anything living in one of the lab's namespaces. Namespaces are the record
    plus every ``<prefix>-*`` under /run/netns.
    """
    names = sorted(set(namespaces) | {n for n in netns.list_namespaces()
                                      if n.startswith(prefix + "-")})
    pids = {p.pid for p in tracked if p.alive()}
    for _ in range(5):
        for found in netns.pids_in(names).values():
            pids.update(found)
        pids.discard(os.getpid())
        if not pids:
            break
        netns.kill_all(sorted(pids), grace=grace)
        pids = set()  # rescan: a process may have entered a namespace meanwhile
    for n in names:
        try:
            netns.remove(n)
        except OSError as exc:
            log.warning("could not remove namespace %s: %s", n, exc)
    left = [n for n in netns.list_namespaces() if n in names]
    if left:
        raise LabError(f"namespaces still present after teardown: {', '.join(left)}")


def sweep(prefix: str, grace: float = 2.0) -> None:
    """Remove every ``<prefix>-*`` namespace and every process living in one, no questions."""
    if not PREFIX_RE.match(prefix):
        raise ValueError(f"bad lab prefix {prefix!r}")
    teardown(prefix, [], [], grace)


def teardown_previous(prefix: str, run_dir: Path, grace: float) -> None:
    """Whatever an earlier lab with this prefix left: its lab.json and its namespaces."""
    tracked: list[ProcInfo] = []
    namespaces: list[str] = []
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError, LabError):
        old = read_record(run_dir)
        namespaces = list(old.get("namespaces", []))
        tracked = tracked_in(old)
    if tracked or namespaces or any(n.startswith(prefix + "-")
                                    for n in netns.list_namespaces()):
        log.info("lab %s: removing an earlier lab with this prefix", prefix)
        teardown(prefix, namespaces, tracked, grace)
