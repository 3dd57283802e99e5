"""The running lab: a multi-node cluster substitute made of network namespaces.

Owns: the life of one lab (``up``/``down``, ``attach``), converging it on a
new spec (``apply``: pods, services and their externalIP routes), its
services (with the LB controller's ``status.loadBalancer``), the ``lab.json``
record (``_save``/``_load``), and ``Lab``, the Python API tests and the CLI
drive a lab with::

    with Lab(LabSpec.default(), prefix="kt1", run_dir=tmp_path) as lab:
        lab.request("client", lab.node_ip("node1"), lab.node_port("default/web"))

The work is done by one module per role, which ``Lab`` holds or inherits:
``lab.topology`` builds namespaces, links and addresses; ``lab.pods`` is
one pod's life (``Lab`` is ``Pods``); ``lab.processes`` runs and tracks the
echo servers and ``kpx node``s (``Lab.procs``);
``lab.statefile`` writes the state file (``Lab.state_file``);
``lab.probes`` is the traffic the lab sends (``Lab`` is a ``Traffic``);
``lab.rundir`` names and records things; ``lab.teardown`` removes a lab;
``lab.lb.control`` runs the load balancer. Their public names that tests
import from here (``LabError``, ``NoReply``, ``wait_until``, ``sweep``...)
are re-exported.

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

Dual-stack (``Lab(..., dual_stack=True)``, ``cluster.dualStack: true``,
``kpx lab up --dual-stack``): every address query takes a *family*, 4 (the
default, so every IPv4 test reads as before) or 6: ``node_ip(node, 6)``,
``pod_ip(pod, 6)``, ``client_ip(6)``, ``lb_ip(6)``, ``lb_front_ip(6)``,
``lb_address(6)``; ``dual_stack`` says which kind of lab this is, and asking
an IPv4-only lab for an IPv6 address is a ``ValueError`` that says so.
``client_ip``, ``lb_ip`` and ``lb_front_ip`` are properties that were plain
strings before dual-stack; they still are (``lab.client_ip == "10.79.0.100"``)
and can also be called with a family (``lab.client_ip(6)``). ``socket``,
``request``, ``http_get`` and ``probe_http`` pick the family from the address
they are given, and bracket an IPv6 one in the ``Host`` header.

Load balancer: if the lab file has a ``loadBalancer`` section, ``up`` calls
``lab.lb.control.start(lab)`` after everything else is ready (its pid is
recorded and killed on ``down``, after ``stop()``), ``apply`` calls its
``on_apply(lab)``, ``status`` includes its per-node verdicts, and
``lb_address`` is its front.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import signal
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from lab import netns, topology
from lab.common import wait_until, write_atomic
from lab.controller import NodeInfo, load_balancer_status, resolve_services
from lab.lb import control as lb_control
from lab.pods import Pods, needs_recreate
from lab.probes import NoReply, Traffic, can_connect, http_ok
from lab.processes import Processes, Readiness, proxy_argv, proxy_healthz_port, read_text
from lab.rundir import (
    DEFAULT_NAME,
    LAB_JSON,
    PREFIX_RE,
    RUN_DIR_ENV,
    STATE_FILE,
    LabError,
    PodRecord,
    ProcInfo,
    RunDirLock,
    default_run_dir,
    read_record,
    remove_record,
)
from lab.spec import LabSpec, service_key, service_ref
from lab.statefile import StatePublisher
from lab.teardown import sweep, teardown, teardown_previous

log = logging.getLogger("kpx.lab")

HEALTHZ_PORT = 10256
METRICS_PORT = 10249


class FamilyAddress(str):
    """An IPv4 address that also answers for its family: ``addr(6)`` is the IPv6 one.

    What ``Lab.client_ip``, ``lb_ip`` and ``lb_front_ip`` return: these were
    plain string properties before dual-stack, so the value stays a ``str``
    (equal to the IPv4 address, usable in f-strings and JSON) while
    ``lab.client_ip(6)`` reads like the other ``family=`` queries.
    """

    ip6: str | None

    def __new__(cls, ip4: str, ip6: str | None, what: str) -> FamilyAddress:
        obj = super().__new__(cls, ip4)
        obj.ip6 = ip6
        obj.what = what
        return obj

    what: str

    def __call__(self, family: int = 4) -> str:
        return _pick(str(self), self.ip6, family, self.what)

    def __reduce__(self) -> tuple[type[str], tuple[str]]:
        """Copied or pickled, it is the plain IPv4 string (YAML and JSON see only that)."""
        return str, (str(self),)


def _pick(ip4: str, ip6: str | None, family: int, what: str) -> str:
    """*what*'s address of *family*; a ValueError naming it when there is none."""
    if family == 4:
        return ip4
    if family != 6:
        raise ValueError(f"family must be 4 or 6, got {family!r}")
    if ip6 is None:
        raise ValueError(f"{what} has no IPv6 address: this lab is IPv4-only (bring it up"
                         " with --dual-stack, or Lab(..., dual_stack=True))")
    return ip6


class Lab(Traffic, Pods):
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
        dual_stack: bool = False,
    ) -> None:
        """*dual_stack*: make *spec* dual-stack (``LabSpec.with_dual_stack``); a spec
        with ``cluster.dualStack: true`` already is."""
        if not PREFIX_RE.match(prefix):
            raise ValueError(f"lab prefix {prefix!r} must be a lowercase letter then up to 15"
                             " lowercase letters or digits (no '-')")
        self.spec: LabSpec = LabSpec.default() if spec is None else LabSpec.load(spec)
        if dual_stack:
            self.spec = self.spec.with_dual_stack()
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
        self.plan = _plan(prefix, self.spec)
        self.up_seconds: float | None = None
        self.lb_handle: lb_control.LoadBalancerHandle | None = None

        self.procs = Processes(self.logs_dir)
        self.state_file = StatePublisher(self.state_path)

        self._lock = RunDirLock(self.run_dir / ".lock")
        self._attached = False
        self._lenient = False
        self.refused: tuple[str, ...] = ()
        """What of the recorded spec this kpx refuses and left out (``LabSpec.from_record``):
        only a lab attached ``lenient``, which never changes the lab."""
        self._pods: dict[str, PodRecord] = {}
        self._services: list[dict[str, Any]] = []
        self._namespaces: list[str] = []
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
            teardown_previous(self.prefix, self.run_dir, self.stop_grace)
            self._namespaces = self.plan.infra_namespaces()
            self._status = "creating"
            self._save()
            try:
                topology.build_fabric(self.plan, self.spec.service_cidr)
                for p in self.spec.pods:
                    self._create_pod_ns(p)
                self._services = self._resolve(self.spec)
                self._route_external_ips()
                self._write_state()
                t_net = time.monotonic()
                for rec in self._pods.values():
                    self.procs.start_pod(rec, self.plan.pod_ns(rec.spec.name))
                if self.start_proxies:
                    for node in self.spec.nodes:
                        self._start_proxy(node)
                self._save()
                self._wait_ready(list(self._pods.values()), list(self.procs.proxies))
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
            tracked = self.procs.tracked(self._pods.values())
            self.procs.interrupt_proxies()
            teardown(self.prefix, self._namespaces, tracked, self.stop_grace)
            self.procs.forget()
            self._pods.clear()
            self._namespaces = []
            self._status = "down"
            remove_record(self.run_dir)

    @classmethod
    def attach(cls, run_dir: str | os.PathLike[str], *, lenient: bool = False) -> Lab:
        """The lab recorded in *run_dir*/lab.json, for a process that did not start it.

        *lenient*: for a command that only reads the lab's topology, names and
        addresses (``status``, ``exec``). A recorded ``loadBalancer`` section
        this kpx refuses is left out and named in ``refused``, instead of
        failing; such a lab cannot be changed (``LabError``), only removed.
        """
        data = read_record(run_dir)
        opts = data.get("options", {})
        spec, _ = _recorded_spec(data, lenient)
        lab = cls(spec, data["prefix"],
                  run_dir, opts.get("start_proxies", True), opts.get("extra_proxy_args", ()),
                  healthz_port=opts.get("healthz_port", HEALTHZ_PORT),
                  metrics_port=opts.get("metrics_port", METRICS_PORT),
                  stop_grace=opts.get("stop_grace", 2.0))
        lab._attached = True
        lab._lenient = lenient
        lab._load(data)
        return lab

    # ------------------------------------------------------------------ queries

    @property
    def nodes(self) -> list[str]:
        return list(self.spec.nodes)

    @property
    def dual_stack(self) -> bool:
        """Whether everything in this lab also has an IPv6 address."""
        return self.spec.dual_stack

    def _v6(self, ip6: str) -> str | None:
        return ip6 if self.spec.dual_stack else None

    @property
    def client_ip(self) -> FamilyAddress:
        """The client's address; ``client_ip(6)`` its IPv6 one (see ``FamilyAddress``)."""
        return FamilyAddress(topology.CLIENT_IP, self._v6(topology.CLIENT_IP6), "the client")

    @property
    def lb_ip(self) -> FamilyAddress:
        """The LB namespace's address on the node network (what nodes see in proxy mode)."""
        return FamilyAddress(topology.LB_NODE_IP, self._v6(topology.LB_NODE_IP6), "the lb")

    @property
    def lb_front_ip(self) -> FamilyAddress:
        """The LB namespace's address on the client network."""
        return FamilyAddress(topology.LB_CLIENT_IP, self._v6(topology.LB_CLIENT_IP6),
                             "the lb's front")

    @property
    def state_path(self) -> Path:
        return self.run_dir / STATE_FILE

    @property
    def logs_dir(self) -> Path:
        return self.run_dir / "logs"

    def node_ip(self, node: str, family: int = 4) -> str:
        """*node*'s InternalIP of *family* (4 or 6; 6 only in a dual-stack lab)."""
        if node not in self.spec.nodes:
            raise KeyError(f"no node {node!r} (nodes: {', '.join(self.spec.nodes)})")
        return _pick(self.plan.node_ip(node), self.plan.node_ip6(node), family, f"node {node}")

    def pod_cidr(self, node: str, family: int = 4) -> str:
        """The networks routed to *node*'s pods, comma-separated (one unless given)."""
        nets = self.plan.pod_networks_of(node) if family == 4 else self.plan.pod_networks6_of(node)
        return ",".join(nets) or "-"

    @property
    def pod_networks(self) -> tuple[str, ...]:
        """All pods' IPv4 networks (the LB masquerades them)."""
        return self.plan.pod_networks

    @property
    def pod_networks6(self) -> tuple[str, ...]:
        """All pods' IPv6 networks; empty in an IPv4-only lab."""
        return self.plan.pod_networks6

    def proxy_pid(self, node: str) -> int | None:
        proc = self.procs.proxies.get(node)
        return proc.pid if proc else None

    def proxy_alive(self, node: str) -> bool:
        proc = self.procs.proxies.get(node)
        return bool(proc and proc.alive())

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

    @property
    def localhost(self) -> str:
        """The loopback address a node reaches its own NodePorts on: IPv4's (IPv6's ``::1``
        serves none, as in iptables mode)."""
        return "127.0.0.1"

    def cluster_ip(self, key: str, family: int = 4) -> str:
        """The service's ClusterIP of ``family`` (allocated from ``cluster.serviceCIDR``, or
        the IPv6 service range, unless given); "" if it has none of that family."""
        spec = self.service(key)["spec"]
        ips = [str(ip) for ip in spec.get("clusterIPs") or [spec.get("clusterIP") or ""] if ip]
        return next((ip for ip in ips if (":" in ip) == (family == 6)), "")

    def external_ips(self, key: str) -> list[str]:
        return list(self.service(key)["spec"].get("externalIPs") or [])

    def ingress(self, key: str) -> list[dict[str, Any]]:
        """``status.loadBalancer.ingress`` of a service: ``[{ip, ipMode}]``, or [] (pending)."""
        return list(((self.service(key).get("status") or {}).get("loadBalancer") or {})
                    .get("ingress") or [])

    def lb_address(self, family: int = 4) -> tuple[str, int]:
        """Where a client reaches the LB-fronted service (over *family*).

        The LB's front if the lab has a working ``loadBalancer`` section; else a node's
        ip:nodePort, preferring a node with a ready local endpoint so it also
        answers under externalTrafficPolicy=Local.
        """
        if self.spec.load_balancer is not None:
            with contextlib.suppress(Exception):
                cfg = lb_control.config_for(self)
                front = cfg.listen_ip if family == 4 else cfg.listen_ip6
                if front:
                    return str(front), int(cfg.port)
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
        return self.node_ip(node, family), self.node_port(key)

    def proxy_log(self, node: str) -> str:
        return read_text(self.logs_dir / f"{node}.log")

    # ------------------------------------------------------------------ processes

    def spawn(self, src: str, argv: Sequence[str], role: str) -> int:
        """Start a long-lived process in *src*'s namespace that ``down`` will kill.

        For the load balancer and demos: the process is recorded in lab.json,
        logs to ``logs/<role>.log``, and is detached from the caller's session.
        """
        with self._mutating():
            info = self.procs.spawn(self.ns(src), list(argv), role, self.logs_dir / f"{role}.log")
            self.procs.extra.append(info)
            return info.pid

    # ------------------------------------------------------------------ changes

    def apply(self, spec: LabSpec | Mapping[str, Any] | str | os.PathLike[str]) -> dict[str, list[
            str]]:
        """Converge the running lab on *spec*; returns what changed, by kind.

        Pods: new ones start, vanished ones stop at once (use ``delete_pod``
        for a graceful exit), a pod whose node, port or namespace changed is
        deleted and created anew (a new IP and uid, as a rescheduled pod
        gets), label and readiness changes are applied in place. Services are
        replaced wholesale, keeping allocated nodePorts and ClusterIPs as the
        API server does; their ``status.loadBalancer`` follows
        ``loadBalancer.ipMode``, and the externalIP routes follow their
        externalIPs. Every change reaches the proxies the one way they read
        the cluster: the state file, replaced atomically. Nodes and the
        service CIDR cannot change on a running lab.
        """
        with self._mutating():
            new = self._accept(spec)
            if tuple(new.nodes) != tuple(self.spec.nodes):
                raise LabError("apply cannot change the nodes of a running lab; run"
                               " `kpx lab up` with the new file instead")
            if new.dual_stack != self.spec.dual_stack:
                raise LabError(f"apply cannot change cluster.dualStack of a running lab"
                               f" ({self.spec.dual_stack} -> {new.dual_stack}); run"
                               " `kpx lab up` with the new file instead")
            if new.service_cidr != self.spec.service_cidr:
                raise LabError(f"apply cannot change cluster.serviceCIDR of a running lab"
                               f" ({self.spec.service_cidr} -> {new.service_cidr}); run"
                               " `kpx lab up` with the new file instead")
            old = {service_key(s): s for s in self._services}
            # Before any pod changes: a refused service leaves the lab as it was.
            services = self._resolve(new, old)
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
                elif rec.terminating or needs_recreate(rec.spec, target):
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
                self.procs.start_pod(rec, self.plan.pod_ns(rec.spec.name))
                starting.append(rec)
                if name not in changes["moved"] and name not in changes["updated"]:
                    changes["created"].append(name)
            self._services = services
            now = {service_key(s): s for s in self._services}
            changes["services"] = sorted(k for k in old.keys() | now.keys()
                                         if old.get(k) != now.get(k))
            self.spec = new
            self._route_external_ips()
            self._wait_ready(starting, [])
            self._write_state()
            self._save()
            self._lb_on_apply()
            return changes

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
            old = self.procs.proxies[node]
            if not old.alive():
                raise LabError(f"kpx node on {node} (pid {old.pid}) is not running")
            os.kill(old.pid, signal.SIGTERM)
            self._start_proxy(node)
            self.procs.extra.append(replace(old, role=f"{old.role} (draining)"))
            self._save()
            return old.pid, self.procs.proxies[node].pid

    # ------------------------------------------------------------------ status

    def status(self, probe_timeout: float = 1.0) -> dict[str, Any]:
        """Live state, measured now: proxies, their health, listeners, localEndpoints."""
        hc_services = [(k, self.hc_port(k)) for k in self.services if self.hc_port(k)]
        nodes = []
        for node in self.spec.nodes:
            ip = self.node_ip(node)
            entry: dict[str, Any] = {"name": node, "ip": ip, "ns": self.ns(node),
                                     "pod_cidr": self.pod_cidr(node)}
            if self.dual_stack:
                entry["ip6"] = self.node_ip(node, 6)
                entry["pod_cidr6"] = self.pod_cidr(node, 6)
            proc = self.procs.proxies.get(node)
            entry["proxy"] = {"pid": proc.pid if proc else None,
                              "alive": bool(proc and proc.alive())}
            if self.healthz_port:
                entry["healthz"] = self.probe_http(node, ip, self.healthz_port, "/healthz",
                                                    probe_timeout)
            ss = self.run(node, ["ss", "-ltnH"], timeout=5)
            entry["listen"] = sorted({line.split()[3] for line in ss.stdout.splitlines()
                                      if len(line.split()) >= 4})
            entry["services"] = {k: self.probe_http(node, ip, hc, "/", probe_timeout) | {
                "hcPort": hc} for k, hc in hc_services}
            nodes.append(entry)
        pods = [{"name": r.spec.name, "node": r.spec.node, "ip": r.ip, "ip6": r.ip6,
                 "port": r.spec.port,
                 "ready": r.spec.ready, "terminating": r.terminating,
                 "deleteIn": round(r.delete_at - time.time(), 1) if r.delete_at else None,
                 "alive": bool(r.proc and r.proc.alive()),
                 "labels": dict(r.spec.labels)} for r in list(self._pods.values())]
        services = []
        for s in self._services:
            spec = s["spec"]
            services.append({"key": service_key(s), "type": spec["type"],
                             "externalTrafficPolicy": spec.get("externalTrafficPolicy"),
                             "internalTrafficPolicy": spec.get("internalTrafficPolicy"),
                             "ports": [{"name": p.get("name", ""), "port": p["port"],
                                        "targetPort": p.get("targetPort"),
                                        "nodePort": p.get("nodePort", 0)}
                                       for p in spec.get("ports", [])],
                             "healthCheckNodePort": spec.get("healthCheckNodePort", 0),
                             "clusterIP": spec.get("clusterIP"),
                             "clusterIPs": list(spec.get("clusterIPs") or []),
                             "ipFamilies": list(spec.get("ipFamilies") or []),
                             "ipFamilyPolicy": spec.get("ipFamilyPolicy"),
                             "externalIPs": [{"ip": ip, "node": self.spec.external_ip_node(ip)}
                                             for ip in spec.get("externalIPs") or []],
                             "ingress": self.ingress(service_key(s))})
        return {"name": self.prefix, "run_dir": str(self.run_dir), "dualStack": self.dual_stack,
                "state": str(self.state_path), "client_ip": str(self.client_ip),
                "client_ip6": topology.CLIENT_IP6 if self.dual_stack else None, "nodes": nodes,
                "pods": pods, "services": services, "refused": list(self.refused),
                "loadBalancer": self._lb_status(),
                "loadBalancer6": self._lb_status(6) if self.dual_stack else None}

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
                if self.refused:  # a save would drop the section it left out
                    raise LabError(f"{LAB_JSON} holds settings this kpx refuses"
                                   f" ({'; '.join(self.refused)}); `kpx lab down` removes it")
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
        cluster = raw.get("cluster")
        if self.spec.dual_stack and (cluster is None or (isinstance(cluster, dict)
                                                         and "dualStack" not in cluster)):
            # A file that does not say keeps the running lab's families (a test's
            # one-pod dict applied to a lab brought up with dual_stack=True).
            raw["cluster"] = {**(cluster or {}), "dualStack": True}
        old = {service_key(s): s for s in self._services}
        for svc in raw.get("services") or []:
            if isinstance(svc, dict):
                svc.pop("status", None)  # an update ignores status, as the API server does
            prev = old.get(service_key(svc)) if isinstance(svc, dict) else None
            if prev is None or not isinstance(svc.get("spec"), dict):
                continue
            sp, op = svc["spec"], prev["spec"]
            new_type = sp.get("type", "ClusterIP")
            if new_type not in ("NodePort", "LoadBalancer"):
                old_nps = {p.get("nodePort") for p in op.get("ports", [])}
                for p in sp.get("ports") or []:
                    if isinstance(p, dict) and p.get("nodePort") and p["nodePort"] in old_nps:
                        p.pop("nodePort")
            if (sp.get("healthCheckNodePort")
                    and sp.get("healthCheckNodePort") == op.get("healthCheckNodePort")
                    and (new_type != "LoadBalancer"
                         or sp.get("externalTrafficPolicy", "Cluster") != "Local")):
                sp.pop("healthCheckNodePort")
        return LabSpec.from_dict(raw, "apply", check_lb_service=False)

    def proxy_argv(self, node: str) -> list[str]:
        """The ``kpx node`` command line the lab runs on *node*."""
        return proxy_argv(node, self.state_path, self.extra_proxy_args, self.healthz_port,
                          self.metrics_port, (*self.plan.pod_networks, *self.plan.pod_networks6))

    def _start_proxy(self, node: str) -> None:
        self.procs.start_proxy(node, self.plan.node_ns(node), self.proxy_argv(node))

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
        waits: list[Readiness] = []
        for rec in pods:
            assert rec.proc is not None
            ns, ip, port = self.plan.pod_ns(rec.spec.name), rec.ip, rec.spec.port
            waits.append(Readiness(f"pod {rec.spec.name} (port {port})", rec.proc,
                                   functools.partial(can_connect, ns, ip, port), True))
            if rec.ip6 and rec.spec.image == "echo":
                waits.append(Readiness(f"pod {rec.spec.name} (port {port}, IPv6)", rec.proc,
                                       functools.partial(can_connect, ns, rec.ip6, port), True))
        hz = proxy_healthz_port(self.extra_proxy_args, self.healthz_port)
        if self.wait_proxies and hz:
            for node in proxies:
                ns, ip = self.plan.node_ns(node), self.node_ip(node)
                waits.append(Readiness(f"kpx node on {node} (/healthz on {hz})",
                                       self.procs.proxies[node],
                                       functools.partial(http_ok, ns, ip, hz, "/healthz"),
                                       False))
        self.procs.wait_ready(waits, self.ready_timeout, self.prefix)

    def _node_infos(self) -> list[NodeInfo]:
        return [NodeInfo(n, self.node_ip(n), ",".join(self.plan.pod_networks_of(n)),
                         self.spec.node_fields.get(n, {}), self.plan.node_ip6(n),
                         ",".join(self.plan.pod_networks6_of(n)) or None)
                for n in self.spec.nodes]

    def _resolve(self, spec: LabSpec,
                 previous: Mapping[str, Mapping[str, Any]] | None = None) -> list[dict[str, Any]]:
        """*spec*'s Services as the API server and the LB controller leave them."""
        services = resolve_services(spec.services, previous, spec.service_cidr, spec.dual_stack)
        fronted = spec.lb_service_key if spec.load_balancer is not None else None
        return load_balancer_status(services, fronted, str(self.lb_front_ip), spec.lb_ip_mode)

    def _route_external_ips(self) -> None:
        """Route every service's externalIPs from the client and the lb to their node."""
        ips = {ip for s in self._services for ip in s["spec"].get("externalIPs") or []}
        topology.sync_external_ip_routes(self.plan, {ip: self.spec.external_ip_node(ip)
                                                     for ip in sorted(ips)})

    def _write_state(self) -> None:
        self.state_file.publish(self._node_infos(), self._services,
                                [r.to_state() for r in self._pods.values()])

    def _save(self) -> None:
        data = {
            "version": 1,
            "prefix": self.prefix,
            "status": self._status,
            "run_dir": str(self.run_dir),
            "state_path": str(self.state_path),
            "pid": os.getpid(),
            "updated": time.time(),
            "client_ip": str(self.client_ip),
            "options": {"start_proxies": self.start_proxies,
                        "extra_proxy_args": list(self.extra_proxy_args),
                        "healthz_port": self.healthz_port, "metrics_port": self.metrics_port,
                        "stop_grace": self.stop_grace},
            "spec": self.spec.to_dict(),
            "namespaces": self._namespaces,
            "nodes": {n: {"ns": self.plan.node_ns(n), "ip": self.node_ip(n),
                          "ip6": self.plan.node_ip6(n), "pod_cidr": self.pod_cidr(n),
                          "proxy": asdict(proxy) if (proxy := self.procs.proxies.get(n)) else None}
                      for n in self.spec.nodes},
            "pods": {n: r.to_json() for n, r in self._pods.items()},
            "services": self._services,
            "extra_processes": [asdict(p) for p in self.procs.extra],
            "triggers": self.state_file.triggers,
            "fingerprints": self.state_file.fingerprints,
        }
        write_atomic(self.run_dir / LAB_JSON, json.dumps(data, indent=1) + "\n")

    def _load(self, data: Mapping[str, Any]) -> None:
        self.spec, self.refused = _recorded_spec(data, self._lenient)
        self.plan = _plan(self.prefix, self.spec)
        self._status = data.get("status", "up")
        self._namespaces = list(data.get("namespaces", []))
        self._pods = {n: PodRecord.from_json(d) for n, d in data.get("pods", {}).items()}
        self._services = list(data.get("services", []))
        self.procs.proxies = {n: ProcInfo(**d["proxy"])
                              for n, d in data.get("nodes", {}).items() if d.get("proxy")}
        self.procs.extra = [ProcInfo(**d) for d in data.get("extra_processes", [])]
        self.state_file.triggers = dict(data.get("triggers", {}))
        self.state_file.fingerprints = dict(data.get("fingerprints", {}))

    # ------------------------------------------------------------------ load balancer

    def _start_lb(self) -> None:
        handle = lb_control.start(self)
        self.lb_handle = handle
        self.procs.extra.append(ProcInfo(pid=handle.pid, start=netns.pid_start_time(handle.pid),
                                         ns=self.plan.lb, role="lb",
                                         log=str(self.logs_dir / "lb.log")))
        self._save()

    def _stop_lb(self) -> None:
        handle, self.lb_handle = self.lb_handle, None
        if handle is not None:
            try:
                handle.stop()
            except Exception:
                log.exception("lab %s: stopping the load balancer failed", self.prefix)

    def _lb_on_apply(self) -> None:
        """Tell the LB about an applied change (new ports, nodes or section)."""
        if self.spec.load_balancer is not None:
            try:
                lb_control.on_apply(self)
            except Exception:
                log.exception("lab %s: load balancer hook on_apply failed", self.prefix)

    def _lb_status(self, family: int = 4) -> Any:
        """Per-node probe results for ``kpx lab status``; None when the lab has no LB."""
        if self.spec.load_balancer is None:
            return None
        try:
            return lb_control.status(self.run_dir, family)
        except Exception as exc:
            return {"error": f"{type(exc).__name__}: {exc}"}


def _recorded_spec(data: Mapping[str, Any], lenient: bool) -> tuple[LabSpec, tuple[str, ...]]:
    """The spec in a ``lab.json`` record, and what of it was refused (``Lab.attach``)."""
    if lenient:
        return LabSpec.from_record(data["spec"], f"{LAB_JSON} spec")
    return LabSpec.from_dict(data["spec"], check_lb_service=False), ()


def _plan(prefix: str, spec: LabSpec) -> topology.Plan:
    return topology.Plan(prefix, spec.nodes, spec.node_ips, spec.pod_cidrs, spec.dual_stack)


# ---------------------------------------------------------------------- by name


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
        with RunDirLock(run_dir / ".lock"):
            teardown(prefix, [], [], grace)
            remove_record(run_dir)
    else:
        if lab.prefix != prefix:
            log.warning("lab.json in %s names prefix %s; removing that too", run_dir,
                        lab.prefix)
            teardown(prefix, [], [], grace)
        lab.down()
    return before


__all__ = ["DEFAULT_NAME", "HEALTHZ_PORT", "LAB_JSON", "METRICS_PORT", "PREFIX_RE", "RUN_DIR_ENV",
           "STATE_FILE", "Lab", "LabError", "NoReply", "default_run_dir", "sweep",
           "teardown_by_name", "wait_until"]
