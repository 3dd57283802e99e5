"""The lab's pods: where they run, their addresses and echo servers, and how they end.

Owns: ``Pods``, the part of ``Lab`` that deals with one pod at a time: its
queries (``pod_ip``, ``pod_info``...), the changes tests make to a pod
(``add_pod``, ``move_pod``, ``set_pod_ready``, ``remove_pod``, ``kill_pod``),
graceful deletion (``delete_pod``: terminating for its grace period, then
gone, finished by a timer, by ``finish_deletions`` or by the next change),
and creating and unplugging a pod's namespace (slot, address, veth through
``lab.topology``; processes through ``lab.processes``).

Never: write the state file or ``lab.json`` itself, or change a record
outside ``Lab._mutating``. A pod change goes through ``Lab.apply`` (a
deletion through ``Lab._write_state`` and ``Lab._save``), which orders it as
a cluster does: endpoints are withdrawn before the pod's process goes away.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
import uuid
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from lab import netns, topology
from lab.common import wait_until
from lab.processes import Processes, read_text
from lab.rundir import LabError, PodRecord, RunDirLock
from lab.spec import LabSpec, PodSpec

log = logging.getLogger("kpx.lab")


class Pods:
    """Pod methods of ``Lab``; what they need of it is declared here and provided there."""

    spec: LabSpec
    plan: topology.Plan
    prefix: str
    procs: Processes
    _pods: dict[str, PodRecord]
    _timers: dict[str, threading.Timer]
    _namespaces: list[str]
    _lock: RunDirLock
    _status: str
    _attached: bool

    @property
    def logs_dir(self) -> Path:
        raise NotImplementedError

    def _mutating(self) -> contextlib.AbstractContextManager[None]:
        raise NotImplementedError

    def _save(self) -> None:
        raise NotImplementedError

    def _write_state(self) -> None:
        raise NotImplementedError

    def apply(self, spec: LabSpec | Mapping[str, Any]) -> dict[str, list[str]]:
        raise NotImplementedError

    @property
    def pods(self) -> list[str]:
        """Names of pods that exist now, terminating ones included."""
        return list(self._pods)

    def pod_ip(self, name: str, family: int = 4) -> str:
        """Pod *name*'s address of *family* (4 or 6; 6 only in a dual-stack lab)."""
        rec = self._pod(name)
        if family == 4:
            return rec.ip
        if family == 6 and rec.ip6:
            return rec.ip6
        raise ValueError(f"pod {name} has no IPv{family} address"
                         + (" (this lab is IPv4-only; see --dual-stack)" if family == 6 else ""))

    def pod_node(self, name: str) -> str:
        return self._pod(name).spec.node

    def pod_pid(self, name: str) -> int | None:
        proc = self._pod(name).proc
        return proc.pid if proc else None

    def pod_terminating(self, name: str) -> bool:
        return self._pod(name).terminating

    def pod_info(self, name: str) -> dict[str, Any]:
        """A pod as the lab sees it: spec fields plus ip, uid, terminating, process."""
        r = self._pod(name)
        return {**r.spec.to_dict(), "ready": r.spec.ready, "namespace": r.spec.namespace,
                "ip": r.ip, "ip6": r.ip6, "uid": r.uid, "terminating": r.terminating,
                "deleteAt": r.delete_at, "pid": r.proc.pid if r.proc else None,
                "alive": bool(r.proc and r.proc.alive())}

    def pod_log(self, name: str) -> str:
        return read_text(self.logs_dir / f"pod-{name}.log")

    def add_pod(self, name: str, node: str, labels: Mapping[str, str] | None = None,
                port: int = 8080, *, ready: bool = True, namespace: str = "default",
                port_name: str | None = None) -> str:
        """Start a new pod; returns its IP."""
        pod = PodSpec(name, node, dict(labels or {}), port, ready, namespace, port_name)
        with self._mutating():
            if name in self._pods:
                raise LabError(f"pod {name} already exists")
            self.apply(self.spec.revalidated(pods=(*self.spec.pods, pod)))
            return self.pod_ip(name)

    def remove_pod(self, name: str) -> None:
        """Delete a pod at once (no terminating phase)."""
        with self._mutating():
            rec = self._pod(name)
            if rec.terminating:
                self._destroy_pod(name)
                self._write_state()
                self._save()
                return
            self.apply(self.spec.revalidated(pods=tuple(p for p in self.spec.pods
                                                        if p.name != name)))

    def move_pod(self, name: str, node: str) -> str:
        """Reschedule a pod onto *node* (delete + create); returns its new IP."""
        with self._mutating():
            self._live_spec(name)
            self.apply(self.spec.revalidated(pods=tuple(
                replace(p, node=node) if p.name == name else p for p in self.spec.pods)))
            return self.pod_ip(name)

    def set_pod_ready(self, name: str, ready: bool) -> None:
        """Flip the pod's Ready condition (a readiness probe starting or stopping to pass)."""
        with self._mutating():
            self._live_spec(name)
            self.apply(self.spec.revalidated(pods=tuple(
                replace(p, ready=ready) if p.name == name else p for p in self.spec.pods)))

    def delete_pod(self, name: str, grace: float = 30.0) -> None:
        """Delete a pod gracefully: terminating for *grace* seconds, then gone.

        While terminating its endpoint is ready=false, serving=<its readiness>,
        terminating=true, and the echo server keeps answering, as a pod in its
        grace period does. Returns at once; ``wait_pod_gone`` waits for the end.
        A second delete can only shorten the grace period, as in Kubernetes.
        """
        with self._mutating():
            rec = self._pod(name)
            if grace <= 0:
                self.remove_pod(name)
                return
            deadline = time.time() + grace
            if rec.delete_at is not None:
                deadline = min(deadline, rec.delete_at)
            rec.terminating = True
            rec.delete_at = deadline
            self.spec = self.spec.revalidated(pods=tuple(p for p in self.spec.pods
                                                         if p.name != name))
            self._write_state()
            self._save()
            if not self._attached:
                self._arm_timer(rec)

    def finish_deletions(self) -> list[str]:
        """Remove terminating pods whose grace period is over; returns their names."""
        with self._mutating():
            return self._finish_due()

    def wait_pod_gone(self, name: str, timeout: float | None = None) -> None:
        """Block until pod *name* no longer exists (default: its grace period + 5 s).

        Each poll re-reads lab.json and finishes overdue deletions itself, so
        this also works for a pod another process deleted, or in a process
        that has no timer (``Lab.attach``), and returns only once the state
        file no longer lists the pod.
        """
        rec = self._pods.get(name)
        if timeout is None:
            left = (rec.delete_at - time.time()) if rec and rec.delete_at else 0.0
            timeout = max(left, 0.0) + 5.0

        def gone() -> bool:
            with contextlib.suppress(LabError):
                self.finish_deletions()
            return name not in self._pods

        wait_until(gone, timeout, what=f"pod {name} to be gone")

    def kill_pod(self, name: str) -> None:
        """SIGKILL the pod's processes (its endpoint stays published, as until a probe fails).

        Every process in the pod's namespace goes, as with a container's: an
        nginx pod's workers would otherwise keep serving without their master.
        """
        proc = self._pod(name).proc
        ns = self.plan.pod_ns(name)
        for pid in netns.pids_in([ns])[ns]:
            if not proc or pid != proc.pid:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        if proc and proc.alive():
            os.kill(proc.pid, signal.SIGKILL)
            self.procs.reap(proc.pid)
            wait_until(lambda: not proc.alive(), 2.0, 0.01, f"pod {name}'s process to die")

    def _pod(self, name: str) -> PodRecord:
        try:
            return self._pods[name]
        except KeyError:
            raise KeyError(f"no pod {name!r} (pods: {', '.join(self._pods) or '-'})") from None

    def _live_spec(self, name: str) -> PodSpec:
        spec = self.spec.pod(name)
        if spec is None:
            rec = self._pod(name)
            raise LabError(f"pod {name} is terminating" if rec.terminating else
                           f"pod {name} is not in the lab spec")
        return spec

    def _create_pod_ns(self, spec: PodSpec) -> PodRecord:
        used = {r.slot for r in self._pods.values() if r.spec.node == spec.node}
        slot = next(k for k in range(1, 245) if k not in used)
        ns = self.plan.pod_ns(spec.name)
        if ns not in self._namespaces:
            self._namespaces.append(ns)
        self._save()  # record the namespace before it exists: a crash here still cleans up
        ip = topology.add_pod(self.plan, spec.name, spec.node, slot, spec.ip)
        rec = PodRecord(spec=spec, ip=ip, slot=slot, uid=str(uuid.uuid4()),
                        ip6=self.plan.pod_ip6(spec.node, slot))
        self._pods[spec.name] = rec
        return rec

    def _destroy_pod(self, name: str) -> None:
        self._destroy_record(self._pods.pop(name))

    def _destroy_record(self, rec: PodRecord) -> None:
        """Stop a pod's processes and unplug its namespace (already out of ``_pods``)."""
        name = rec.spec.name
        timer = self._timers.pop(name, None)
        if timer:
            timer.cancel()
        ns = self.plan.pod_ns(name)
        pids = netns.pids_in([ns])[ns]
        if rec.proc and rec.proc.alive():
            pids.append(rec.proc.pid)
        netns.kill_all(sorted(set(pids)), grace=0.5)
        if rec.proc:
            self.procs.reap(rec.proc.pid)
        topology.remove_pod(self.plan, name, rec.spec.node, rec.slot, rec.spec.ip)
        if ns in self._namespaces:
            self._namespaces.remove(ns)

    def _finish_due(self) -> list[str]:
        now = time.time()
        due = [n for n, r in self._pods.items() if r.terminating and r.delete_at is not None
               and r.delete_at <= now]
        for n in due:
            self._destroy_pod(n)
        if due:
            self._write_state()
            self._save()
        return due

    def _arm_timer(self, rec: PodRecord) -> None:
        old = self._timers.pop(rec.spec.name, None)
        if old:
            old.cancel()
        delay = max(0.0, (rec.delete_at or 0) - time.time())
        uid = rec.uid

        def fire() -> None:
            with self._lock:
                cur = self._pods.get(rec.spec.name)
                if cur is None or cur.uid != uid or self._status == "down":
                    return
                try:
                    self._finish_due()
                except Exception:  # a timer thread has nobody to raise to
                    log.exception("lab %s: finishing deletion of %s failed", self.prefix,
                                  rec.spec.name)

        t = threading.Timer(delay + 0.001, fire)
        t.daemon = True
        self._timers[rec.spec.name] = t
        t.start()


def needs_recreate(old: PodSpec, new: PodSpec) -> bool:
    """Whether a pod changed in a way only a new pod (new IP, new uid) can show."""
    return (old.node, old.port, old.namespace, old.port_name, old.image, old.proxy_protocol,
            old.ip) != (new.node, new.port, new.namespace, new.port_name, new.image,
                        new.proxy_protocol, new.ip)
