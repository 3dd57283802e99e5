"""The running lab: a multi-node cluster substitute made of network namespaces.

Owns: the life of one lab (``up``/``down``), its processes (one echo server
per pod, one ``kpx node`` per node, and anything the load balancer spawns),
its pods' placement and addresses, the shared state file (through
``lab.controller`` and ``lab.statefile``), the run directory and its
``lab.json`` record, and the Python API tests drive it with::

    with Lab(LabSpec.default(), prefix="kt1", run_dir=tmp_path) as lab:
        lab.request("client", lab.node_ip("node1"), lab.node_port("default/web"))

Never: touch the root namespace (see ``lab.netns``/``lab.topology``), send
traffic anywhere but addresses inside the lab, or leave anything behind.
Teardown does not trust its own records alone: it also kills every process
that lives in a namespace named ``<prefix>-*`` and removes those namespaces,
so ``down`` works after a crash, a SIGKILLed pytest, or a corrupt lab.json.
A prefix never contains ``-``, so ``<prefix>-`` matches this lab only.

One ``Lab`` object owns a lab it brought up; ``Lab.attach(run_dir)`` gives a
second process (every ``kpx lab`` command after ``up``) the same API on it.
Mutations take a flock on the run directory and re-read ``lab.json``, so
the CLI is stateless between invocations and concurrent commands serialize.

Load balancer hook: if the lab file has a ``loadBalancer`` section and the
module ``lab.loadbalancer`` exists, ``up`` calls its ``start(lab)`` (whatever
it returns with a ``pid`` is recorded and killed on ``down``; an object with
``stop()`` is stopped first). ``status(run_dir)`` feeds ``kpx lab status``
and ``config_for(lab)`` (``.listen_ip``, ``.port``) feeds ``lb_address``.
Each of these is optional and looked up lazily; a missing module is fine.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import importlib
import importlib.util
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

from lab import netns, topology
from lab.controller import (
    NodeInfo,
    PodState,
    endpoint_slices,
    resolve_services,
    slice_fingerprints,
    stamp_trigger_times,
    state_documents,
)
from lab.loadbalancer import describe_error
from lab.spec import LabSpec, PodSpec, service_key, service_ref
from lab.statefile import write_atomic, write_state

log = logging.getLogger("kpx.lab")

DEFAULT_NAME = "kpx"
DEFAULT_RUN_BASE = "/run/kpx"
RUN_DIR_ENV = "KPX_RUN_DIR"
HEALTHZ_PORT = 10256
METRICS_PORT = 10249
LAB_JSON = "lab.json"
STATE_FILE = "state.yaml"
PREFIX_RE = re.compile(r"^[a-z][a-z0-9]{0,15}$")
"""A lab name/prefix: no '-', so ``<prefix>-`` names this lab's namespaces only."""

T = TypeVar("T")


class LabError(RuntimeError):
    """The lab could not do what was asked; the message says what and where to look."""


class NoReply(ConnectionError, EOFError):
    """The peer closed the connection (FIN) before sending a complete reply.

    An EOFError too, so ``describe_error`` names it as the load balancer's
    probes name the same thing: "closed without an answer".
    """


def default_run_dir(name: str = DEFAULT_NAME) -> Path:
    """``$KPX_RUN_DIR/<name>``, default ``/run/kpx/<name>``."""
    return Path(os.environ.get(RUN_DIR_ENV) or DEFAULT_RUN_BASE) / name


def wait_until(predicate: Callable[[], T], timeout: float, interval: float = 0.05,
               what: str = "condition") -> T:
    """Poll *predicate* until it returns something truthy; TimeoutError at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise TimeoutError(f"timed out after {timeout:.1f}s waiting for {what}")
        time.sleep(interval)


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

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["spec"] = self.spec.to_dict()
        return d

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> PodRecord:
        s = d["spec"]
        spec = PodSpec(name=s["name"], node=s["node"], labels=dict(s.get("labels", {})),
                       port=s.get("port", 8080), ready=s.get("ready", True),
                       namespace=s.get("namespace", "default"), port_name=s.get("portName"))
        proc = ProcInfo(**d["proc"]) if d.get("proc") else None
        return cls(spec=spec, ip=d["ip"], slot=d["slot"], uid=d["uid"],
                   terminating=d.get("terminating", False), delete_at=d.get("delete_at"),
                   proc=proc)


class _RunDirLock:
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


class Lab:
    """A multi-node kube-proxy lab in network namespaces. See the module docstring."""

    def __init__(
        self,
        spec: LabSpec | Mapping[str, Any] | str | os.PathLike[str] | None = None,
        prefix: str = DEFAULT_NAME,
        run_dir: str | os.PathLike[str] | None = None,
        start_proxies: bool = True,
        extra_proxy_args: Sequence[str] = (),
        *,
        healthz_port: int | None = HEALTHZ_PORT,
        metrics_port: int | None = METRICS_PORT,
        wait_proxies: bool = True,
        ready_timeout: float = 10.0,
        stop_grace: float = 2.0,
        start_lb: bool = True,
    ) -> None:
        if not PREFIX_RE.match(prefix):
            raise ValueError(f"lab prefix {prefix!r} must be a lowercase letter then up to 15"
                             " lowercase letters or digits (no '-')")
        self.spec: LabSpec = LabSpec.default() if spec is None else LabSpec.load(spec)
        self.prefix = prefix
        self.run_dir = Path(run_dir) if run_dir is not None else default_run_dir(prefix)
        self.start_proxies = start_proxies
        self.extra_proxy_args = tuple(extra_proxy_args)
        self.healthz_port = healthz_port
        self.metrics_port = metrics_port
        self.wait_proxies = wait_proxies
        self.ready_timeout = ready_timeout
        self.stop_grace = stop_grace
        self.start_lb = start_lb
        self.plan = topology.Plan(prefix, self.spec.nodes)
        self.up_seconds: float | None = None
        self.lb_handle: Any = None

        self._lock = _RunDirLock(self.run_dir / ".lock")
        self._attached = False
        self._pods: dict[str, PodRecord] = {}
        self._services: list[dict[str, Any]] = []
        self._proxies: dict[str, ProcInfo] = {}
        self._extra: list[ProcInfo] = []
        self._namespaces: list[str] = []
        self._triggers: dict[str, str] = {}
        self._fingerprints: dict[str, str] = {}
        self._popen: dict[int, subprocess.Popen[bytes]] = {}
        self._timers: dict[str, threading.Timer] = {}
        self._status = "new"

    # ------------------------------------------------------------------ lifecycle

    def __enter__(self) -> Lab:
        self.up()
        return self

    def __exit__(self, *exc: object) -> None:
        self.down()

    def up(self) -> Lab:
        """Build the namespaces, start pods and proxies, write the state file.

        An earlier lab with the same prefix (a crashed run) is torn down first.
        On any failure everything is torn down again before the error propagates.
        """
        t0 = time.monotonic()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "logs").mkdir(exist_ok=True)
        with self._lock:
            self._teardown_previous()
            self._namespaces = self.plan.infra_namespaces()
            self._status = "creating"
            self._save()
            try:
                topology.build_fabric(self.plan)
                for p in self.spec.pods:
                    self._create_pod_ns(p)
                self._services = resolve_services(self.spec.services)
                self._write_state()
                t_net = time.monotonic()
                for rec in self._pods.values():
                    self._start_echo(rec)
                if self.start_proxies:
                    for node in self.spec.nodes:
                        self._start_proxy(node)
                self._save()
                self._wait_ready(list(self._pods.values()), list(self._proxies))
                t_procs = time.monotonic()
                self._status = "up"
                self._save()
                if self.start_lb and self.spec.load_balancer is not None:
                    self._start_lb()
                log.debug("lab %s: network %.2fs, processes %.2fs, load balancer %.2fs",
                          self.prefix, t_net - t0, t_procs - t_net, time.monotonic() - t_procs)
            except BaseException:
                log.error("lab %s: up failed, tearing down", self.prefix)
                self.down()
                raise
        self.up_seconds = time.monotonic() - t0
        log.info("lab %s up in %.2fs (%d nodes, %d pods)", self.prefix, self.up_seconds,
                 len(self.spec.nodes), len(self._pods))
        return self

    def down(self) -> None:
        """Remove every process and namespace of this lab, even half-built ones."""
        with self._lock:
            for t in self._timers.values():
                t.cancel()
            self._timers.clear()
            self._stop_lb()
            tracked = self._tracked_procs()
            self._interrupt_proxies()
            _teardown(self.prefix, self._namespaces, tracked, self.stop_grace)
            for p in self._popen.values():
                with contextlib.suppress(Exception):
                    p.wait(timeout=0.1)
            self._popen.clear()
            self._pods.clear()
            self._proxies.clear()
            self._extra.clear()
            self._namespaces = []
            self._status = "down"
            for name in (LAB_JSON, STATE_FILE):
                with contextlib.suppress(FileNotFoundError):
                    (self.run_dir / name).unlink()

    @classmethod
    def attach(cls, run_dir: str | os.PathLike[str]) -> Lab:
        """The lab recorded in *run_dir*/lab.json, for a process that did not start it."""
        path = Path(run_dir) / LAB_JSON
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise LabError(f"no lab at {run_dir} (no {LAB_JSON}); run `kpx lab up`") from None
        except json.JSONDecodeError as exc:
            raise LabError(f"{path} is corrupt ({exc}); `kpx lab down` still cleans up") from None
        opts = data.get("options", {})
        lab = cls(LabSpec.from_dict(data["spec"], check_lb_service=False), data["prefix"],
                  run_dir, opts.get("start_proxies", True), opts.get("extra_proxy_args", ()),
                  healthz_port=opts.get("healthz_port", HEALTHZ_PORT),
                  metrics_port=opts.get("metrics_port", METRICS_PORT),
                  stop_grace=opts.get("stop_grace", 2.0))
        lab._attached = True
        lab._load(data)
        return lab

    # ------------------------------------------------------------------ queries

    @property
    def nodes(self) -> list[str]:
        return list(self.spec.nodes)

    @property
    def pods(self) -> list[str]:
        """Names of pods that exist now, terminating ones included."""
        return list(self._pods)

    @property
    def client_ip(self) -> str:
        return topology.CLIENT_IP

    @property
    def lb_ip(self) -> str:
        """The LB namespace's address on the node network (what nodes see in proxy mode)."""
        return topology.LB_NODE_IP

    @property
    def lb_front_ip(self) -> str:
        """The LB namespace's address on the client network."""
        return topology.LB_CLIENT_IP

    @property
    def state_path(self) -> Path:
        return self.run_dir / STATE_FILE

    @property
    def logs_dir(self) -> Path:
        return self.run_dir / "logs"

    def node_ip(self, node: str) -> str:
        if node not in self.spec.nodes:
            raise KeyError(f"no node {node!r} (nodes: {', '.join(self.spec.nodes)})")
        return self.plan.node_ip(node)

    def pod_ip(self, name: str) -> str:
        return self._pod(name).ip

    def pod_node(self, name: str) -> str:
        return self._pod(name).spec.node

    def pod_pid(self, name: str) -> int | None:
        proc = self._pod(name).proc
        return proc.pid if proc else None

    def proxy_pid(self, node: str) -> int | None:
        proc = self._proxies.get(node)
        return proc.pid if proc else None

    def proxy_alive(self, node: str) -> bool:
        proc = self._proxies.get(node)
        return bool(proc and proc.alive())

    def listener_pids(self, node: str, port: int) -> set[int]:
        """Pids of the processes holding a TCP socket that listens on *port* in *node*.

        How a restart test tells "the new kpx node is up": its own pid
        listens on the NodePort, not the old one's.
        """
        out = self.run(node, ["ss", "-Hltnp", f"sport = :{port}"]).stdout
        return {int(m) for m in re.findall(r"pid=(\d+)", out)}

    def pod_terminating(self, name: str) -> bool:
        return self._pod(name).terminating

    def pod_info(self, name: str) -> dict[str, Any]:
        """A pod as the lab sees it: spec fields plus ip, uid, terminating, process."""
        r = self._pod(name)
        return {**r.spec.to_dict(), "ready": r.spec.ready, "namespace": r.spec.namespace,
                "ip": r.ip, "uid": r.uid, "terminating": r.terminating,
                "deleteAt": r.delete_at, "pid": r.proc.pid if r.proc else None,
                "alive": bool(r.proc and r.proc.alive())}

    def ns(self, name: str) -> str:
        """The namespace of a node, a pod, or one of ``client``, ``lb``, ``sw``."""
        if name == "client":
            return self.plan.client
        if name == "lb":
            return self.plan.lb
        if name == "sw":
            return self.plan.sw
        if name in self.spec.nodes:
            return self.plan.node_ns(name)
        if name in self._pods:
            return self.plan.pod_ns(name)
        raise KeyError(f"no node or pod {name!r} in lab {self.prefix} (nodes: "
                       f"{', '.join(self.spec.nodes)}; pods: {', '.join(self._pods) or '-'})")

    @property
    def services(self) -> list[str]:
        return [service_key(s) for s in self._services]

    def service(self, key: str) -> dict[str, Any]:
        """The Service as the API server would return it (defaults and allocations in)."""
        key = service_ref(key)
        for s in self._services:
            if service_key(s) == key:
                return json.loads(json.dumps(s))
        raise KeyError(f"no service {key} (services: {', '.join(self.services) or '-'})")

    def node_port(self, key: str, port_name_or_index: str | int = 0) -> int:
        """nodePort of a service port (by name or index); 0 if the service has none."""
        ports = self.service(key)["spec"].get("ports", [])
        if isinstance(port_name_or_index, int):
            port = ports[port_name_or_index]
        else:
            port = next((p for p in ports if p.get("name") == port_name_or_index), None)
            if port is None:
                raise KeyError(f"service {key} has no port named {port_name_or_index!r}")
        return int(port.get("nodePort", 0))

    def hc_port(self, key: str) -> int:
        """healthCheckNodePort of a service; 0 if it has none (not LoadBalancer+Local)."""
        return int(self.service(key)["spec"].get("healthCheckNodePort", 0))

    def lb_address(self) -> tuple[str, int]:
        """Where a client reaches the LB-fronted service.

        The LB's front if ``lab.loadbalancer`` can say; else a node's
        ip:nodePort, preferring a node with a ready local endpoint so it also
        answers under externalTrafficPolicy=Local.
        """
        mod = _lb_module()
        if self.spec.load_balancer is not None and mod is not None and hasattr(mod,
                                                                               "config_for"):
            with contextlib.suppress(Exception):
                cfg = mod.config_for(self)
                return str(cfg.listen_ip), int(cfg.port)
        key = self.spec.lb_service_key
        if key is None or key not in self.services:
            key = next((k for k in self.services if self.node_port(k)), None)
        if key is None:
            raise LabError("no service with a nodePort in this lab")
        selector = self.service(key)["spec"].get("selector") or {}
        ns = key.split("/", 1)[0]
        node = next((r.spec.node for r in list(self._pods.values())
                     if r.spec.namespace == ns and r.spec.ready and not r.terminating
                     and selector and all(r.spec.labels.get(k) == v
                                          for k, v in selector.items())),
                    self.spec.nodes[0])
        return self.node_ip(node), self.node_port(key)

    def proxy_log(self, node: str) -> str:
        return _read_text(self.logs_dir / f"{node}.log")

    def pod_log(self, name: str) -> str:
        return _read_text(self.logs_dir / f"pod-{name}.log")

    # ------------------------------------------------------------------ traffic

    @contextlib.contextmanager
    def socket(self, src: str, family: int = socket.AF_INET,
               type: int = socket.SOCK_STREAM) -> Iterator[socket.socket]:
        """A socket created inside *src*'s namespace, closed on exit."""
        s = netns.socket_in(self.ns(src), family, type)
        try:
            yield s
        finally:
            s.close()

    def request(self, src: str, ip: str, port: int, mode: str = "WHO", payload: bytes = b"",
                timeout: float = 2.0) -> dict[str, Any]:
        """One connection from *src* to ip:port speaking the echo protocol; the reply.

        *mode*: ``WHO`` (default), ``HTTP`` (GET /), ``SINK`` (sends *payload*,
        half-closes, returns the server's byte count and sha256), ``ECHO``
        (sends *payload*, half-closes, returns ``{"bytes", "sha256", "data"}``
        of what came back) or ``HOLD``. Socket errors propagate unchanged:
        ConnectionRefusedError (RST to the SYN), TimeoutError (no answer
        within *timeout*, per operation), ConnectionResetError; a clean close
        without a complete reply raises :class:`NoReply`.
        """
        mode = mode.upper()
        with self.socket(src) as s:
            s.settimeout(timeout)
            s.connect((ip, port))
            if mode in ("WHO", "HOLD"):
                s.sendall(mode.encode() + b"\n" + payload)
                return json.loads(_read_line(s))
            if mode == "HTTP":
                s.sendall(f"GET / HTTP/1.1\r\nHost: {ip}:{port}\r\nConnection: close\r\n\r\n"
                          .encode())
                return _parse_http(_read_all(s))[1]
            if mode in ("SINK", "ECHO"):
                return _send_and_collect(s, mode, payload)
            raise ValueError(f"unknown mode {mode!r} (WHO, HTTP, SINK, ECHO, HOLD)")

    def http_get(self, src: str, ip: str, port: int, path: str = "/",
                 timeout: float = 2.0) -> tuple[int, bytes]:
        """A plain HTTP/1.1 GET from inside *src*: (status code, body)."""
        with self.socket(src) as s:
            s.settimeout(timeout)
            s.connect((ip, port))
            s.sendall(f"GET {path} HTTP/1.1\r\nHost: {ip}:{port}\r\nConnection: close\r\n\r\n"
                      .encode())
            status, body = _parse_http(_read_all(s), raw=True)
            return status, body

    def run(self, src: str, argv: Sequence[str], timeout: float = 10.0,
            **kw: Any) -> subprocess.CompletedProcess[str]:
        """Run a command inside *src*'s namespace (``ip netns exec``); output captured."""
        return netns.run_in(self.ns(src), argv, timeout=timeout, **kw)

    def spawn(self, src: str, argv: Sequence[str], role: str) -> int:
        """Start a long-lived process in *src*'s namespace that ``down`` will kill.

        For the load balancer and demos: the process is recorded in lab.json,
        logs to ``logs/<role>.log``, and is detached from the caller's session.
        """
        with self._mutating():
            info = self._spawn(self.ns(src), list(argv), role, self.logs_dir / f"{role}.log")
            self._extra.append(info)
            return info.pid

    # ------------------------------------------------------------------ changes

    def apply(self, spec: LabSpec | Mapping[str, Any] | str | os.PathLike[str]) -> dict[str, list[
            str]]:
        """Converge the running lab on *spec*; returns what changed, by kind.

        Pods: new ones start, vanished ones stop at once (use ``delete_pod``
        for a graceful exit), a pod whose node, port or namespace changed is
        deleted and created anew (a new IP and uid, as a rescheduled pod
        gets), label and readiness changes are applied in place. Services are
        replaced wholesale, keeping allocated nodePorts as the API server
        does. Nodes cannot change on a running lab.
        """
        with self._mutating():
            new = self._accept(spec)
            if tuple(new.nodes) != tuple(self.spec.nodes):
                raise LabError("apply cannot change the nodes of a running lab; run"
                               " `kpx lab up` with the new file instead")
            changes: dict[str, list[str]] = {"created": [], "deleted": [], "moved": [],
                                             "updated": [], "services": []}
            want = {p.name: p for p in new.pods}
            starting: list[PodRecord] = []
            doomed: list[PodRecord] = []
            for name, rec in list(self._pods.items()):
                target = want.get(name)
                if target is None:
                    if not rec.terminating:
                        doomed.append(self._pods.pop(name))
                        changes["deleted"].append(name)
                elif rec.terminating or _needs_recreate(rec.spec, target):
                    doomed.append(self._pods.pop(name))
                    changes["moved" if rec.spec.node != target.node else "updated"].append(name)
            if doomed:
                # Endpoints go first, then the pods: proxies stop choosing them before
                # they vanish, as with a real pod deletion.
                self._write_state()
                for rec in doomed:
                    self._destroy_record(rec)
            for name, target in want.items():
                if name in self._pods:
                    rec = self._pods[name]
                    if rec.spec != target:
                        rec.spec = target
                        changes["updated"].append(name)
                    continue
                rec = self._create_pod_ns(target)
                self._start_echo(rec)
                starting.append(rec)
                if name not in changes["moved"] and name not in changes["updated"]:
                    changes["created"].append(name)
            old = {service_key(s): s for s in self._services}
            self._services = resolve_services(new.services, old)
            now = {service_key(s): s for s in self._services}
            changes["services"] = sorted(k for k in old.keys() | now.keys()
                                         if old.get(k) != now.get(k))
            self.spec = new
            self._wait_ready(starting, [])
            self._write_state()
            self._save()
            self._lb_hook("apply")
            return changes

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

    def update_service(self, service: Mapping[str, Any]) -> None:
        """Create or replace one Service (by namespace/name)."""
        key = service_key(service)
        with self._mutating():
            others = [s for s in self.spec.services if service_key(s) != key]
            raw = self.spec.to_dict()
            raw["services"] = [*others, dict(service)]
            self.apply(raw)

    def delete_service(self, key: str) -> None:
        key = service_ref(key)
        with self._mutating():
            self.service(key)
            raw = self.spec.to_dict()
            raw["services"] = [s for s in self.spec.services if service_key(s) != key]
            self.apply(raw)

    def restart_proxy(self, node: str) -> tuple[int, int]:
        """Restart *node*'s ``kpx node`` as an operator does; returns (old pid, new pid).

        SIGTERM to the old process and the new one started at once: the old
        one keeps accepting while the new one takes its listening sockets and
        then the namespace over (``proxy.lifecycle.ownership``), then drains. Nothing
        here waits for the new one to be ready; the old one stays recorded
        (``down`` still kills it if it is still draining) until it exits.
        """
        with self._mutating():
            old = self._proxies[node]
            if not old.alive():
                raise LabError(f"kpx node on {node} (pid {old.pid}) is not running")
            os.kill(old.pid, signal.SIGTERM)
            self._start_proxy(node)
            self._extra.append(replace(old, role=f"{old.role} (draining)"))
            self._save()
            return old.pid, self._proxies[node].pid

    def _interrupt_proxies(self) -> None:
        """SIGINT every ``kpx node``: stop now, without waiting for a successor.

        SIGTERM would keep each accepting for its ``--handover-wait`` first,
        in case a new one takes over; nothing will in a teardown.
        """
        procs = [*self._proxies.values(),
                 *(p for p in self._extra if p.role.startswith("proxy/"))]
        for p in procs:
            if p.alive():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGINT)

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
        """SIGKILL the pod's echo process (its endpoint stays published, as until a probe fails)."""
        proc = self._pod(name).proc
        if proc and proc.alive():
            os.kill(proc.pid, signal.SIGKILL)
            self._reap(proc.pid)
            wait_until(lambda: not proc.alive(), 2.0, 0.01, f"pod {name}'s process to die")

    # ------------------------------------------------------------------ status

    def status(self, probe_timeout: float = 1.0) -> dict[str, Any]:
        """Live state, measured now: proxies, their health, listeners, localEndpoints."""
        hc_services = [(k, self.hc_port(k)) for k in self.services if self.hc_port(k)]
        nodes = []
        for node in self.spec.nodes:
            ip = self.node_ip(node)
            entry: dict[str, Any] = {"name": node, "ip": ip, "ns": self.ns(node),
                                     "pod_cidr": topology.pod_cidr(self.plan.node_index(node))}
            proc = self._proxies.get(node)
            entry["proxy"] = {"pid": proc.pid if proc else None,
                              "alive": bool(proc and proc.alive())}
            if self.healthz_port:
                entry["healthz"] = self._probe_http(node, ip, self.healthz_port, "/healthz",
                                                    probe_timeout)
            ss = self.run(node, ["ss", "-ltnH"], timeout=5)
            entry["listen"] = sorted({line.split()[3] for line in ss.stdout.splitlines()
                                      if len(line.split()) >= 4})
            entry["services"] = {k: self._probe_http(node, ip, hc, "/", probe_timeout) | {
                "hcPort": hc} for k, hc in hc_services}
            nodes.append(entry)
        pods = [{"name": r.spec.name, "node": r.spec.node, "ip": r.ip, "port": r.spec.port,
                 "ready": r.spec.ready, "terminating": r.terminating,
                 "deleteIn": round(r.delete_at - time.time(), 1) if r.delete_at else None,
                 "alive": bool(r.proc and r.proc.alive()),
                 "labels": dict(r.spec.labels)} for r in list(self._pods.values())]
        services = []
        for s in self._services:
            spec = s["spec"]
            services.append({"key": service_key(s), "type": spec["type"],
                             "externalTrafficPolicy": spec.get("externalTrafficPolicy"),
                             "ports": [{"name": p.get("name", ""), "port": p["port"],
                                        "targetPort": p.get("targetPort"),
                                        "nodePort": p.get("nodePort", 0)}
                                       for p in spec.get("ports", [])],
                             "healthCheckNodePort": spec.get("healthCheckNodePort", 0)})
        return {"name": self.prefix, "run_dir": str(self.run_dir),
                "state": str(self.state_path), "client_ip": self.client_ip, "nodes": nodes,
                "pods": pods, "services": services, "loadBalancer": self._lb_status()}

    def _probe_http(self, node: str, ip: str, port: int, path: str,
                    timeout: float) -> dict[str, Any]:
        try:
            code, body = self.http_get(node, ip, port, path, timeout)
        except (OSError, ValueError) as exc:
            return {"error": describe_error(exc)}
        out: dict[str, Any] = {"status": code}
        try:
            out["body"] = json.loads(body)
        except ValueError:
            out["body"] = body.decode(errors="replace").strip()
        if isinstance(out["body"], dict) and "localEndpoints" in out["body"]:
            out["localEndpoints"] = out["body"]["localEndpoints"]
        return out

    # ------------------------------------------------------------------ internals

    @contextlib.contextmanager
    def _mutating(self) -> Iterator[None]:
        """Serialize changes, starting from what lab.json says now.

        The record is re-read under the lock because another process (a
        ``kpx lab`` command, a ``--no-wait`` deletion finisher) may have
        changed the lab since this object last looked; whoever owns the lab,
        the last writer never works from a stale picture.
        """
        with self._lock:
            if self._status not in ("new", "creating", "down"):
                path = self.run_dir / LAB_JSON
                try:
                    self._load(json.loads(path.read_text()))
                except FileNotFoundError:
                    raise LabError(f"the lab in {self.run_dir} is gone") from None
                self._finish_due()
            yield

    def _accept(self, spec: LabSpec | Mapping[str, Any] | str | os.PathLike[str]) -> LabSpec:
        """Validate a new spec, first dropping fields an update clears implicitly.

        The API server's ``dropTypeDependentFields``: when an update turns a
        service into one that needs no nodePorts or healthCheckNodePort and the
        object still carries the old allocated values unchanged (it was read,
        edited and written back), those values are dropped instead of rejected.
        """
        if isinstance(spec, LabSpec):
            return spec
        if not isinstance(spec, Mapping):
            spec = LabSpec.load(spec).to_dict()
        raw = json.loads(json.dumps(dict(spec)))
        old = {service_key(s): s for s in self._services}
        for svc in raw.get("services") or []:
            prev = old.get(service_key(svc)) if isinstance(svc, dict) else None
            if prev is None or not isinstance(svc.get("spec"), dict):
                continue
            sp, op = svc["spec"], prev["spec"]
            new_type = sp.get("type", "ClusterIP")
            if new_type not in ("NodePort", "LoadBalancer"):
                old_nps = {p.get("nodePort") for p in op.get("ports", [])}
                for p in sp.get("ports") or []:
                    if isinstance(p, dict) and p.get("nodePort") in old_nps:
                        p.pop("nodePort")
            if (sp.get("healthCheckNodePort")
                    and sp.get("healthCheckNodePort") == op.get("healthCheckNodePort")
                    and (new_type != "LoadBalancer"
                         or sp.get("externalTrafficPolicy", "Cluster") != "Local")):
                sp.pop("healthCheckNodePort")
        return LabSpec.from_dict(raw, "apply", check_lb_service=False)

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
        ip = topology.add_pod(self.plan, spec.name, spec.node, slot)
        rec = PodRecord(spec=spec, ip=ip, slot=slot, uid=str(uuid.uuid4()))
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
            self._reap(rec.proc.pid)
        topology.remove_pod(self.plan, name, rec.spec.node, rec.slot)
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

    def _child_env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["PYTHONUNBUFFERED"] = "1"
        # Children must import this very checkout, whatever their cwd.
        root = str(Path(__file__).resolve().parent.parent)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
        return env

    def _spawn(self, ns: str, argv: list[str], role: str, log_path: Path) -> ProcInfo:
        with open(log_path, "ab") as f:
            f.write(f"--- {time.strftime('%H:%M:%S')} lab: starting {' '.join(argv)}\n"
                    .encode())
        p = netns.popen_in(ns, argv, log_path, env=self._child_env())
        self._popen[p.pid] = p
        return ProcInfo(pid=p.pid, start=netns.pid_start_time(p.pid), ns=ns, role=role,
                        log=str(log_path), argv=argv)

    def _start_echo(self, rec: PodRecord) -> None:
        argv = [sys.executable, "-m", "lab.echo", "--name", rec.spec.name, "--node",
                rec.spec.node, "--port", str(rec.spec.port)]
        rec.proc = self._spawn(self.plan.pod_ns(rec.spec.name), argv, f"pod/{rec.spec.name}",
                               self.logs_dir / f"pod-{rec.spec.name}.log")

    def proxy_argv(self, node: str) -> list[str]:
        """The ``kpx node`` command line the lab runs on *node*."""
        argv = [sys.executable, "-m", "proxy", "node", "--hostname-override", node,
                "--state", str(self.state_path)]
        extra = list(self.extra_proxy_args)
        if self.healthz_port and "--healthz-bind-address" not in extra:
            argv += ["--healthz-bind-address", f"0.0.0.0:{self.healthz_port}"]
        if self.metrics_port and "--metrics-bind-address" not in extra:
            argv += ["--metrics-bind-address", f"127.0.0.1:{self.metrics_port}"]
        return argv + extra

    def _start_proxy(self, node: str) -> None:
        self._proxies[node] = self._spawn(self.plan.node_ns(node), self.proxy_argv(node),
                                          f"proxy/{node}", self.logs_dir / f"{node}.log")

    def _wait_ready(self, pods: Sequence[PodRecord], proxies: Sequence[str]) -> None:
        """Wait, in parallel and bounded, for echo servers and proxies to be ready.

        A pod is ready when its port accepts. A proxy is ready when its
        ``/healthz`` answers 200: that needs its Node object, so it has read
        the state file, which is also when it opens its NodePorts (a healthz
        port merely *listening* comes earlier and made the first request of
        a test race the proxy). An echo server that never listens is an error
        (tests would fail obscurely); a slow proxy only a warning, because
        tests poll for the behaviour they need anyway. A process that exits
        is an error, with the tail of its log in the message.
        """
        waits: list[tuple[str, ProcInfo, Callable[[], bool], bool]] = []
        for rec in pods:
            assert rec.proc is not None
            ns, ip, port = self.plan.pod_ns(rec.spec.name), rec.ip, rec.spec.port
            waits.append((f"pod {rec.spec.name} (port {port})", rec.proc,
                          functools.partial(_can_connect, ns, ip, port), True))
        hz = self._proxy_healthz_port()
        if self.wait_proxies and hz:
            for node in proxies:
                ns, ip = self.plan.node_ns(node), self.node_ip(node)
                waits.append((f"kpx node on {node} (/healthz on {hz})", self._proxies[node],
                              functools.partial(_http_ok, ns, ip, hz, "/healthz"), False))
        deadline = time.monotonic() + self.ready_timeout
        pending = list(waits)
        while pending:
            still = []
            for w in pending:
                what, proc, ready, _hard = w
                if not proc.alive():
                    self._reap(proc.pid)
                    raise LabError(f"{what} exited during start-up; {proc.log}:\n"
                                   + _tail(proc.log))
                if not ready():
                    still.append(w)
            pending = still
            if not pending:
                break
            if time.monotonic() >= deadline:
                hard = [w for w in pending if w[3]]
                if hard:
                    raise LabError(f"{hard[0][0]} not ready after {self.ready_timeout:.0f}s;"
                                   f" {hard[0][1].log}:\n" + _tail(hard[0][1].log))
                log.warning("lab %s: not ready after %.0fs: %s", self.prefix,
                            self.ready_timeout, ", ".join(w[0] for w in pending))
                break
            time.sleep(0.02)

    def _proxy_healthz_port(self) -> int | None:
        extra = list(self.extra_proxy_args)
        if "--no-healthz" in extra:
            return None
        if "--healthz-bind-address" in extra:
            i = extra.index("--healthz-bind-address")
            with contextlib.suppress(IndexError, ValueError):
                return int(extra[i + 1].rsplit(":", 1)[1])
            return None
        return self.healthz_port

    def _reap(self, pid: int) -> None:
        """Collect a child we started, so it does not linger as a zombie."""
        p = self._popen.pop(pid, None)
        if p is not None:
            with contextlib.suppress(Exception):
                p.wait(timeout=1)

    def _node_infos(self) -> list[NodeInfo]:
        return [NodeInfo(n, self.node_ip(n), topology.pod_cidr(self.plan.node_index(n)))
                for n in self.spec.nodes]

    def _write_state(self) -> None:
        pods = [PodState(name=r.spec.name, node=r.spec.node, ip=r.ip, labels=r.spec.labels,
                         port=r.spec.port, port_name=r.spec.port_name, ready=r.spec.ready,
                         terminating=r.terminating, namespace=r.spec.namespace, uid=r.uid)
                for r in self._pods.values()]
        fps = slice_fingerprints(endpoint_slices(self._services, pods))
        self._triggers = stamp_trigger_times(self._fingerprints, self._triggers, fps, time.time())
        self._fingerprints = fps
        slices = endpoint_slices(self._services, pods, self._triggers)
        write_state(self.state_path, state_documents(self._node_infos(), self._services, slices))

    def _tracked_procs(self) -> list[ProcInfo]:
        procs = [r.proc for r in self._pods.values() if r.proc]
        return [*procs, *self._proxies.values(), *self._extra]

    def _save(self) -> None:
        data = {
            "version": 1,
            "prefix": self.prefix,
            "status": self._status,
            "run_dir": str(self.run_dir),
            "state_path": str(self.state_path),
            "pid": os.getpid(),
            "updated": time.time(),
            "client_ip": self.client_ip,
            "options": {"start_proxies": self.start_proxies,
                        "extra_proxy_args": list(self.extra_proxy_args),
                        "healthz_port": self.healthz_port, "metrics_port": self.metrics_port,
                        "stop_grace": self.stop_grace},
            "spec": self.spec.to_dict(),
            "namespaces": self._namespaces,
            "nodes": {n: {"ns": self.plan.node_ns(n), "ip": self.node_ip(n),
                          "pod_cidr": topology.pod_cidr(self.plan.node_index(n)),
                          "proxy": asdict(self._proxies[n]) if n in self._proxies else None}
                      for n in self.spec.nodes},
            "pods": {n: r.to_json() for n, r in self._pods.items()},
            "services": self._services,
            "extra_processes": [asdict(p) for p in self._extra],
            "triggers": self._triggers,
            "fingerprints": self._fingerprints,
        }
        write_atomic(self.run_dir / LAB_JSON, json.dumps(data, indent=1) + "\n")

    def _load(self, data: Mapping[str, Any]) -> None:
        self.spec = LabSpec.from_dict(data["spec"], check_lb_service=False)
        self.plan = topology.Plan(self.prefix, self.spec.nodes)
        self._status = data.get("status", "up")
        self._namespaces = list(data.get("namespaces", []))
        self._pods = {n: PodRecord.from_json(d) for n, d in data.get("pods", {}).items()}
        self._services = list(data.get("services", []))
        self._proxies = {n: ProcInfo(**d["proxy"]) for n, d in data.get("nodes", {}).items()
                         if d.get("proxy")}
        self._extra = [ProcInfo(**d) for d in data.get("extra_processes", [])]
        self._triggers = dict(data.get("triggers", {}))
        self._fingerprints = dict(data.get("fingerprints", {}))

    def _teardown_previous(self) -> None:
        """Whatever an earlier lab with this prefix left: its lab.json and its namespaces."""
        tracked: list[ProcInfo] = []
        namespaces: list[str] = []
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            old = json.loads((self.run_dir / LAB_JSON).read_text())
            namespaces = list(old.get("namespaces", []))
            for d in old.get("nodes", {}).values():
                if d.get("proxy"):
                    tracked.append(ProcInfo(**d["proxy"]))
            for d in old.get("pods", {}).values():
                if d.get("proc"):
                    tracked.append(ProcInfo(**d["proc"]))
            tracked += [ProcInfo(**d) for d in old.get("extra_processes", [])]
        if tracked or namespaces or any(n.startswith(self.prefix + "-")
                                        for n in netns.list_namespaces()):
            log.info("lab %s: removing an earlier lab with this prefix", self.prefix)
            _teardown(self.prefix, namespaces, tracked, self.stop_grace)

    # ------------------------------------------------------------------ LB hook

    def _start_lb(self) -> None:
        mod = _lb_module()
        if mod is None or not hasattr(mod, "start"):
            log.info("lab %s: has a loadBalancer section but lab.loadbalancer is not"
                     " available; no LB started", self.prefix)
            return
        handle = mod.start(self)
        self.lb_handle = handle
        pid = getattr(handle, "pid", None)
        if isinstance(pid, int):
            self._extra.append(ProcInfo(pid=pid, start=netns.pid_start_time(pid),
                                        ns=self.plan.lb, role="lb",
                                        log=str(self.logs_dir / "lb.log")))
            self._save()

    def _stop_lb(self) -> None:
        handle, self.lb_handle = self.lb_handle, None
        if handle is not None and hasattr(handle, "stop"):
            try:
                handle.stop()
            except Exception:
                log.exception("lab %s: stopping the load balancer failed", self.prefix)

    def _lb_hook(self, event: str) -> None:
        """Tell the LB module about a change, if it wants to know (``on_apply(lab)``)."""
        mod = _lb_module()
        fn = getattr(mod, f"on_{event}", None) if mod is not None else None
        if fn is not None and self.spec.load_balancer is not None:
            try:
                fn(self)
            except Exception:
                log.exception("lab %s: load balancer hook on_%s failed", self.prefix, event)

    def _lb_status(self) -> Any:
        """HOOK (lab.loadbalancer): per-node probe results for ``kpx lab status``.

        None when the lab has no LB section, or the module provides no status.
        """
        if self.spec.load_balancer is None:
            return None
        mod = _lb_module()
        fn = getattr(mod, "status", None) if mod is not None else None
        if fn is None:
            return None
        try:
            return fn(self.run_dir)
        except Exception as exc:
            return {"error": f"{type(exc).__name__}: {exc}"}


# ---------------------------------------------------------------------- helpers


def _lb_module() -> Any:
    if importlib.util.find_spec("lab.loadbalancer") is None:
        return None
    return importlib.import_module("lab.loadbalancer")


def _needs_recreate(old: PodSpec, new: PodSpec) -> bool:
    return (old.node, old.port, old.namespace, old.port_name) != (
        new.node, new.port, new.namespace, new.port_name)


def _teardown(prefix: str, namespaces: Sequence[str], tracked: Sequence[ProcInfo],
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
    _teardown(prefix, [], [], grace)


def teardown_by_name(prefix: str, run_dir: Path | None = None, grace: float = 2.0) -> list[str]:
    """``kpx lab down``: remove a lab from its record, or by prefix if the record is bad.

    Returns the namespaces that existed before.
    """
    if not PREFIX_RE.match(prefix):
        raise ValueError(f"bad lab prefix {prefix!r}")
    run_dir = run_dir or default_run_dir(prefix)
    before = [n for n in netns.list_namespaces() if n.startswith(prefix + "-")]
    try:
        lab = Lab.attach(run_dir)
    except (LabError, KeyError, TypeError, ValueError) as exc:
        log.info("lab %s: %s; sweeping by prefix", prefix, exc)
        lock = _RunDirLock(run_dir / ".lock")
        with lock:
            _teardown(prefix, [], [], grace)
            for name in (LAB_JSON, STATE_FILE):
                with contextlib.suppress(FileNotFoundError):
                    (run_dir / name).unlink()
    else:
        if lab.prefix != prefix:
            log.warning("lab.json in %s names prefix %s; removing that too", run_dir,
                        lab.prefix)
            _teardown(prefix, [], [], grace)
        lab.down()
    return before


def _can_connect(ns: str, ip: str, port: int) -> bool:
    try:
        s = netns.socket_in(ns)
    except OSError:
        return False
    try:
        s.settimeout(0.2)
        s.connect((ip, port))
        return True
    except OSError:
        return False
    finally:
        s.close()


def _http_ok(ns: str, ip: str, port: int, path: str) -> bool:
    """True if GET *path* inside *ns* answers 200 (an HTTP/1.0 request: one read to EOF)."""
    try:
        s = netns.socket_in(ns)
    except OSError:
        return False
    try:
        s.settimeout(0.5)
        s.connect((ip, port))
        s.sendall(f"GET {path} HTTP/1.0\r\nHost: {ip}:{port}\r\n\r\n".encode())
        return _read_all(s).startswith((b"HTTP/1.0 200", b"HTTP/1.1 200"))
    except OSError:
        return False
    finally:
        s.close()


def _read_text(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except FileNotFoundError:
        return ""


def _tail(path: str | Path, lines: int = 20) -> str:
    return "\n".join(_read_text(Path(path)).splitlines()[-lines:])


def _read_line(s: socket.socket, limit: int = 1 << 20) -> bytes:
    buf = bytearray()
    while b"\n" not in buf:
        chunk = s.recv(65536)
        if not chunk:
            raise NoReply(f"connection closed after {len(buf)} bytes without a full line")
        buf += chunk
        if len(buf) > limit:
            raise ValueError("reply line too long")
    return bytes(buf[:buf.index(b"\n") + 1])


def _read_all(s: socket.socket) -> bytes:
    chunks = []
    while True:
        chunk = s.recv(1 << 16)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)


def _parse_http(data: bytes, raw: bool = False) -> tuple[int, Any]:
    """(status, JSON body) of a complete HTTP response; (status, bytes) if *raw*."""
    head, sep, body = data.partition(b"\r\n\r\n")
    if not sep:
        raise NoReply(f"incomplete HTTP response ({len(data)} bytes)")
    status = int(head.split(b" ", 2)[1])
    return (status, body) if raw else (status, json.loads(body))


def _send_and_collect(s: socket.socket, mode: str, payload: bytes) -> dict[str, Any]:
    """Send concurrently with receiving: a big ECHO would deadlock otherwise."""
    import hashlib

    errors: list[BaseException] = []

    def sender() -> None:
        try:
            s.sendall(mode.encode() + b"\n")
            view = memoryview(payload)
            for i in range(0, len(view), 1 << 20):
                s.sendall(view[i:i + (1 << 20)])
            s.shutdown(socket.SHUT_WR)
        except BaseException as exc:  # re-raised in the caller's thread
            errors.append(exc)

    t = threading.Thread(target=sender, daemon=True)
    t.start()
    try:
        if mode == "SINK":
            reply: dict[str, Any] = json.loads(_read_line(s))
        else:
            data = _read_all(s)
            reply = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest(),
                     "data": data}
    finally:
        t.join(timeout=5)
    if errors:
        raise errors[0]
    return reply


__all__ = ["Lab", "LabError", "NoReply", "default_run_dir", "sweep", "teardown_by_name",
           "wait_until"]
