"""The lab's side of the load balancer: start, reconfigure, stop and read the daemon.

Owns: resolving the LB for a running lab (``config_for``), writing
``<run_dir>/lb.json`` and starting the daemon in the lab's LB namespace
(``start``, which waits for its first verdicts), telling it about a
``kpx lab apply`` (``on_apply``: new config + SIGHUP), ending it by pid
(``LoadBalancerHandle``, ``stop_pid``), and reading what it reports: the
status file (``read_status``, ``status``) and the nft counters
(``connection_counts``).

Never: probe or forward anything itself (the daemon does), or run inside
the LB namespace: everything here runs in the process that drives the lab
and reaches the namespace only through ``ip netns exec`` / ``lab.run``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lab.common import write_atomic
from lab.lb import nft
from lab.lb.config import Backend, LBConfig, resolve
from lab.processes import PROJECT_ROOT, child_env
from lab.topology import POD_NETWORK

log = logging.getLogger("kpx.lb")

CONFIG_NAME = "lb.json"

STATUS_NAME = "lb-status.json"

LOG_NAME = "lb.log"


@dataclass(slots=True)
class LoadBalancerHandle:
    """What lab teardown holds: the daemon's pid, its config and how to end it."""

    pid: int
    config: LBConfig
    namespace: str
    run_dir: Path

    def alive(self) -> bool:
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return _not_zombie(self.pid)

    def wait_ready(self, timeout: float) -> dict[str, Any]:
        """Block until every node has a decided probe state (or raise).

        Deterministic tests and demos need this: before the first decisions
        the LB fails open to every node.
        """
        deadline = time.monotonic() + timeout
        doc: dict[str, Any] = {}
        while time.monotonic() < deadline:
            if not self.alive():
                log_path = self.run_dir / "logs" / LOG_NAME
                raise RuntimeError(f"the load balancer (pid {self.pid}) exited; see {log_path}")
            doc = read_status(self.run_dir)
            if doc.get("pid") == self.pid and doc.get("error"):
                # e.g. nft missing: the probes would run but no packet would be forwarded.
                raise RuntimeError(f"the load balancer cannot forward: {doc['error']}")
            if doc.get("ready") and doc.get("pid") == self.pid:
                return doc
            time.sleep(0.05)
        raise TimeoutError(f"the load balancer was not ready within {timeout:.1f}s: {doc}")

    def stop(self, timeout: float = 5.0) -> None:
        """SIGTERM the daemon's process group, then SIGKILL; idempotent."""
        stop_pid(self.pid, timeout)


def _not_zombie(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[0] != "Z"


def stop_pid(pid: int, timeout: float = 5.0) -> None:
    """End an LB daemon by pid (also usable by ``kpx lab down`` after a crash).

    It was started with ``start_new_session``, so its pid is its process
    group: the ``ip netns exec`` wrapper execs python, nothing else is in it.
    """
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, sig)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)
            if not _not_zombie(pid):
                return
            time.sleep(0.05)


def _section(lab: Any) -> Mapping[str, Any] | None:
    """The lab file's ``loadBalancer`` mapping, however the spec object carries it."""
    spec = getattr(lab, "spec", None)
    for name in ("load_balancer", "loadBalancer", "loadbalancer", "lb"):
        value = getattr(spec, name, None)
        if value is not None:
            if dataclasses.is_dataclass(value) and not isinstance(value, type):
                value = dataclasses.asdict(value)
            return value if isinstance(value, Mapping) else None
    raw = getattr(spec, "raw", None)
    if isinstance(raw, Mapping):
        return raw.get("loadBalancer")
    return None


def _node_names(lab: Any) -> list[str]:
    return [n if isinstance(n, str) else str(n.name) for n in lab.nodes]


def config_for(lab: Any, section: Mapping[str, Any] | None = None) -> LBConfig:
    """Resolve the LB for a running lab: its nodes, the service's ports, the section."""
    section = _section(lab) if section is None else section
    if not section:
        raise ValueError("the lab has no loadBalancer section")
    service = str(section.get("service") or "")
    if not service:
        raise ValueError("loadBalancer.service: which service does it front? (ns/name)")
    dual = bool(getattr(lab, "dual_stack", False))
    backends = [Backend(name, str(lab.node_ip(name)), str(lab.node_ip(name, 6)) if dual else "")
                for name in _node_names(lab)]
    return resolve(
        section,
        node_port=int(lab.node_port(service) or 0),
        hc_port=int(lab.hc_port(service) or 0),
        backends=backends,
        status_path=str(Path(lab.run_dir) / STATUS_NAME),
        masquerade_from=tuple(getattr(lab, "pod_networks", (POD_NETWORK,))),
        listen_ip6=str(lab.lb_front_ip(6)) if dual else "",
        masquerade_from6=tuple(getattr(lab, "pod_networks6", ())) if dual else (),
    )


def start(
    lab: Any, section: Mapping[str, Any] | None = None, ready_timeout: float | None = None
) -> LoadBalancerHandle:
    """Start the LB daemon inside the lab's LB namespace and wait for its first verdicts.

    ``section`` overrides the lab file's (demos and tests use it to try other
    probes on the same lab). A previous daemon's status file is removed first
    so readiness is judged on this one's probes.
    """
    cfg = config_for(lab, section)
    run_dir = Path(lab.run_dir)
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    config_path = run_dir / CONFIG_NAME
    write_atomic(config_path, cfg.to_json() + "\n")
    with contextlib.suppress(FileNotFoundError):
        (run_dir / STATUS_NAME).unlink()
    namespace = str(lab.ns("lb"))
    with open(run_dir / "logs" / LOG_NAME, "ab") as logf:
        proc = subprocess.Popen(
            ["ip", "netns", "exec", namespace, sys.executable, "-m", "lab.loadbalancer",
             "--config", str(config_path)],
            stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT,
            start_new_session=True, env=child_env(), cwd=PROJECT_ROOT,
        )
    handle = LoadBalancerHandle(proc.pid, cfg, namespace, run_dir)
    p = cfg.probe
    rounds = max(p.healthy_threshold, p.unhealthy_threshold) + 1
    budget = 5.0 + rounds * max(p.interval, p.timeout)
    if ready_timeout is not None:
        budget = ready_timeout
    try:
        handle.wait_ready(budget)
    except BaseException:
        handle.stop()
        raise
    return handle


def on_apply(lab: Any) -> None:
    """Lab hook after ``kpx lab apply``: follow changed ports, nodes or LB section.

    A service switched to another nodePort or healthCheckNodePort (or an
    edited ``loadBalancer`` section) would otherwise leave the LB probing and
    forwarding to stale ports. The new config is written and the daemon told
    with SIGHUP; it keeps its pid (which the lab has recorded) and, when the
    probe is unchanged, each node's verdict.
    """
    doc = read_status(lab.run_dir)
    pid = doc.get("pid")
    if not doc.get("running") or not isinstance(pid, int) or not _not_zombie(pid):
        log.warning("lab apply: no running load balancer to reconfigure")
        return
    try:
        cfg = config_for(lab)
    except ValueError as e:
        log.error("lab apply: load balancer keeps its old config: %s", e)
        return
    path = Path(lab.run_dir) / CONFIG_NAME
    with contextlib.suppress(OSError, ValueError, TypeError, KeyError):
        if LBConfig.from_json(path.read_text()) == cfg:
            return
    write_atomic(path, cfg.to_json() + "\n")
    os.kill(pid, signal.SIGHUP)
    log.info("lab apply: load balancer (pid %d) reconfigured", pid)


def read_status(run_dir: Path | str) -> dict[str, Any]:
    """The LB's whole status document, or ``{}`` when there is none (yet)."""
    try:
        return json.loads((Path(run_dir) / STATUS_NAME).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def status(run_dir: Path | str, family: int = 4) -> list[dict[str, Any]]:
    """Per node: name, ip, healthy, state, result ("HTTP 503", "timeout"...), since.

    *family* 6: the IPv6 front's probes of the nodes' IPv6 addresses. Empty
    when no LB runs for this run directory (or it has no IPv6 front).
    """
    doc = read_status(run_dir)
    if not doc.get("running"):
        return []
    if family == 6:
        doc = doc.get("ipv6") or {}
    return list(doc.get("nodes", []))


def connection_counts(lab: Any, family: int = 4) -> dict[str, int]:
    """How many connections the passthrough LB sent to each node (nft counters).

    Read inside the LB namespace through ``lab.run``; tests and demos diff it
    around a request to learn which node the LB chose for it. *family* 6:
    the IPv6 front's (``ip6 kpx_lb``).
    """
    table_family = "ip6" if family == 6 else "ip"
    proc = lab.run("lb", ["nft", "-j", "list", "counters", "table", table_family,
                          nft.NFT_TABLE])
    if proc.returncode != 0:
        return {}
    out = proc.stdout if isinstance(proc.stdout, str) else proc.stdout.decode()
    return nft.counters(out, _node_names(lab))
