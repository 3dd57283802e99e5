"""Helpers for the lab tests (tests/lab): lab-file builders, proxy state, traffic probes.

Owns: ``service``/``lab_spec`` (lab-file dicts; ``service`` is
``tests.support.objects.service`` without the clusterIP and nodePort the lab
allocates), the two kinds of waiting the NodePort tests need: "every proxy
has applied the state file" (its log shows a newer generation,
``wait_applied``/``wait_log``) and "behaviour changed" (``poll_change``:
poll a probe, report how long after the state file was written the change
was first seen), and plain connects classified as ok/refused/timeout
(``connect_outcome``, ``timed_connects``, ``who``), or started at a steady pace
whatever the earlier ones do (``PacedConnects``). Raw SYNs and ``ss``
listings are ``tests.support.probes`` (pass ``lab.ns(name)``).

Never: sleep and hope. Every wait is a poll with a deadline; a deadline that
passes is a failure with the evidence (the proxies' logs) attached.
"""

from __future__ import annotations

import errno
import json
import os
import re
import selectors
import socket
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import pytest

from lab import Lab, netns
from lab.common import wait_until
from lab.probes import family_of
from tests.support import objects

CLIENT_IP = "10.79.0.100"
"""The external client (lab.topology.CLIENT_IP); asserted literally, as the issue states it."""
POD_PORT = 8080
GENERATION_RE = re.compile(r"state file \S+: generation (\d+) ")
NFQUEUE_IN_FORCE_RE = re.compile(r"nfqueue rules in force \(generation (\d+)\)")
NFQUEUE_MODE = "running in nfqueue mode"

Outcome = str
"""``ok``, ``refused``, ``timeout``, ``reset`` or ``error: ...``: what a connect attempt saw."""


# ------------------------------------------------------------------ lab files


def service(name: str = "web", etp: str | None = None, *, app: str | None = None,
            type: str = "NodePort", ports: list[dict[str, Any]] | None = None,
            **spec: Any) -> dict[str, Any]:
    """A v1 Service for a lab file selecting ``app=<app or name>``, one port 80 -> 8080.

    No clusterIP, nodePort, protocol or (unless ``etp``) policy: the lab's
    controller fills them in as the API server would.
    """
    if ports is not None:
        spec["ports"] = ports
    return objects.service(name, None, POD_PORT, type=type, etp=etp, cluster_ip=None,
                           selector={"app": app or name}, protocol=None, **spec)


def lab_spec(pods: Mapping[str, str], *services: dict[str, Any], nodes: int = 3,
             app: str = "web", extra_pods: Iterable[Mapping[str, Any]] = ()) -> dict[str, Any]:
    """A lab file: ``pods`` maps pod name -> node; every pod is labelled ``app=<app>``."""
    pod_list: list[dict[str, Any]] = [
        {"name": p, "node": n, "labels": {"app": app}, "port": POD_PORT}
        for p, n in pods.items()]
    pod_list += [dict(p) for p in extra_pods]
    return {"nodes": nodes, "pods": pod_list, "services": list(services)}


# ------------------------------------------------------------------ proxy state


def generation(lab: Lab, node: str) -> int:
    """The newest state-file generation node's ``kpx node`` has put in force (0: none yet).

    The relay puts a generation in force in the very callback that logs it
    was read. In nfqueue mode the rules are written after that, by ``nft``:
    there the generation counts once the dataplane logs it "in force".
    """
    text = lab.proxy_log(node)
    rx = NFQUEUE_IN_FORCE_RE if NFQUEUE_MODE in text else GENERATION_RE
    return max((int(g) for g in rx.findall(text)), default=0)


def generations(lab: Lab) -> dict[str, int]:
    return {n: generation(lab, n) for n in lab.nodes}


def logs(lab: Lab) -> str:
    """Every proxy's log, for failure messages."""
    return "\n".join(f"===== {n} =====\n{lab.proxy_log(n)[-4000:]}" for n in lab.nodes)


def wait_applied(lab: Lab, before: Mapping[str, int] | None = None,
                 timeout: float = 5.0) -> None:
    """Wait until every proxy has applied a generation newer than ``before``.

    The generation line is logged by the event-loop callback that then
    applies the snapshot, and connections are accepted on that same loop,
    so any connection accepted after the line appears sees the new state.
    Without ``before``: until each proxy has applied its first state.
    """
    before = before or {}

    def pending() -> list[str]:
        return [n for n in lab.nodes if generation(lab, n) <= before.get(n, 0)]

    try:
        wait_until(lambda: not pending(), timeout, 0.02)
    except TimeoutError:
        raise AssertionError(f"proxies on {pending()} did not apply a state newer than"
                             f" {dict(before)} within {timeout}s\n{logs(lab)}") from None


def wait_log(lab: Lab, node: str, pattern: str | re.Pattern[str], *, since: int = 0,
             timeout: float = 5.0) -> list[re.Match[str]]:
    """Wait until node's proxy log, from character ``since`` on, matches ``pattern``."""
    rx = re.compile(pattern) if isinstance(pattern, str) else pattern
    try:
        return wait_until(lambda: list(rx.finditer(lab.proxy_log(node)[since:])), timeout, 0.02)
    except TimeoutError:
        raise AssertionError(f"{node}'s proxy log never matched {rx.pattern!r} within"
                             f" {timeout}s\n{logs(lab)}") from None


def poll_change(lab: Lab, probe: Callable[[], bool], what: str, budget: float = 5.0) -> float:
    """Seconds from the state file's last write until ``probe`` first saw the new behaviour.

    The time is taken when the successful probe *started* (its SYN left
    then), and the write time is the file's mtime, which precedes the
    atomic rename: both err towards reporting a longer delay, never a
    shorter one. Fails if the behaviour has not changed within ``budget``.
    (A measurement, not just a wait: hence not ``lab.common.wait_until``.)
    """
    written = lab.state_path.stat().st_mtime
    deadline = time.monotonic() + budget
    while True:
        started = time.time()
        if probe():
            return started - written
        if time.monotonic() >= deadline:
            raise AssertionError(f"{what}: not seen within {budget}s of the state write\n"
                                 f"{logs(lab)}")
        time.sleep(0.01)


# ------------------------------------------------------------------ traffic


def peer_ip(reply: Mapping[str, Any]) -> str:
    """The address the pod saw as its TCP peer."""
    return str(reply["peer"]).rsplit(":", 1)[0]


def who(lab: Lab, src: str, ip: str, port: int,
        timeout: float = 2.0) -> tuple[dict[str, Any], tuple[str, int]]:
    """One WHO request: (the pod's reply, our local address)."""
    with lab.socket(src, family_of(ip)) as s:
        s.settimeout(timeout)
        s.connect((ip, port))
        local = s.getsockname()
        s.sendall(b"WHO\n")
        buf = b""
        while not buf.endswith(b"\n"):
            chunk = s.recv(4096)
            if not chunk:
                raise ConnectionError(f"EOF after {len(buf)} bytes from {ip}:{port}")
            buf += chunk
        return json.loads(buf), (local[0], local[1])


def connect_outcome(lab: Lab, src: str, ip: str, port: int, timeout: float) -> Outcome:
    """Try one TCP connect from ``src``; classify what happened."""
    with lab.socket(src, family_of(ip)) as s:
        s.settimeout(timeout)
        try:
            s.connect((ip, port))
        except ConnectionRefusedError:
            return "refused"
        except TimeoutError:
            return "timeout"
        except ConnectionResetError:
            return "reset"
        except OSError as exc:
            return f"error: {exc}"
        return "ok"


def timed_connects(lab: Lab, src: str, targets: Iterable[tuple[str, int]],
                   timeout: float) -> dict[tuple[str, int], tuple[Outcome, float]]:
    """Connect to every target at once (in threads): ``{target: (outcome, seconds)}``."""
    def one(target: tuple[str, int]) -> tuple[Outcome, float]:
        t0 = time.monotonic()
        outcome = connect_outcome(lab, src, target[0], target[1], timeout)
        return outcome, time.monotonic() - t0

    todo = list(targets)
    with ThreadPoolExecutor(max_workers=max(1, len(todo))) as pool:
        return dict(zip(todo, pool.map(one, todo), strict=True))


@dataclass(frozen=True)
class Connect:
    """One of ``PacedConnects``' connects: when it started, how long it took, and what it saw."""

    started: float
    took: float
    outcome: Outcome


class PacedConnects:
    """A connect() from ``src`` every ``every`` seconds, each in flight on its own; bounded.

    Unlike a loop of one connection after another, a SYN that goes
    unanswered holds up only its own connect (until its retransmit, a
    second later), so every moment of a change is sampled. Each connection
    is closed once it is up. Stops at ``stop``, ``max_count`` connects or
    ``max_seconds``, whichever comes first, and waits for those in flight
    (each at most ``timeout``).
    """

    def __init__(self, lab: Lab, src: str, ip: str, port: int, every: float = 0.005,
                 timeout: float = 3.0, max_count: int = 8000, max_seconds: float = 40.0) -> None:
        self.lab, self.src, self.to = lab, src, (ip, port)
        self.every, self.timeout = every, timeout
        self.max_count, self.max_seconds = max_count, max_seconds
        self.done: list[Connect] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="paced-connects", daemon=True)

    def _run(self) -> None:
        sel = selectors.DefaultSelector()
        started = 0
        deadline = next_at = time.monotonic()
        deadline += self.max_seconds
        try:
            while True:
                now = time.monotonic()
                starting = not self._stop.is_set() and started < self.max_count and now < deadline
                if not starting and not sel.get_map():
                    break
                if starting and now >= next_at:
                    s = netns.socket_in(self.lab.ns(self.src), family_of(self.to[0]))
                    s.setblocking(False)
                    s.connect_ex(self.to)
                    sel.register(s, selectors.EVENT_WRITE, now)
                    started += 1
                    next_at = max(next_at + self.every, now)
                wait = max(0.0, next_at - time.monotonic()) if starting else 0.05
                for key, _ in sel.select(wait):
                    self._finish(sel, key.fileobj, key.data, time.monotonic())  # type: ignore[arg-type]
                now = time.monotonic()
                for key in list(sel.get_map().values()):
                    if now - key.data >= self.timeout:
                        self._finish(sel, key.fileobj, key.data, now, "timeout")  # type: ignore[arg-type]
        finally:
            for key in list(sel.get_map().values()):
                key.fileobj.close()  # type: ignore[union-attr]
            sel.close()

    def _finish(self, sel: selectors.BaseSelector, s: socket.socket, started: float,
                now: float, outcome: Outcome | None = None) -> None:
        sel.unregister(s)
        if outcome is None:
            err = s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            outcome = {0: "ok", errno.ECONNREFUSED: "refused",
                       errno.ECONNRESET: "reset"}.get(err, f"error: {os.strerror(err)}")
        s.close()
        self.done.append(Connect(started, now - started, outcome))

    def since(self, t: float, ok: bool = True) -> list[Connect]:
        """The connects started at ``t`` or later (only those that got through, by default)."""
        return [c for c in list(self.done) if c.started >= t and (c.outcome == "ok" or not ok)]

    def __enter__(self) -> PacedConnects:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(self.timeout + 10)


PROXY_MODES = ("userspace", "nfqueue")
"""Every verdict test runs against both dataplanes (issue 15): the relay, and SYNs decided
in Python with conntrack forwarding the rest."""

FAMILIES = (4, 6)
"""The verdict tests run over IPv4, and over IPv6 in a dual-stack lab (issue 14)."""


class FamilyLab:
    """A lab seen through one IP family: its addresses and sockets default to that family.

    What lets a verdict test written for IPv4 run unchanged over IPv6: in a
    dual-stack lab, ``FamilyLab(lab, 6).node_ip("node1")`` is node1's IPv6
    address, ``client_ip`` the client's, and ``socket("client")`` an
    ``AF_INET6`` socket. Everything else is the lab's own.
    """

    def __init__(self, lab: Lab, family: int) -> None:
        self.lab = lab
        self.family = family

    def __getattr__(self, name: str) -> Any:
        return getattr(self.lab, name)

    def node_ip(self, node: str, family: int | None = None) -> str:
        return self.lab.node_ip(node, family or self.family)

    def pod_ip(self, pod: str, family: int | None = None) -> str:
        return self.lab.pod_ip(pod, family or self.family)

    def cluster_ip(self, key: str, family: int | None = None) -> str:
        return self.lab.cluster_ip(key, family or self.family)

    @property
    def client_ip(self) -> str:
        return str(self.lab.client_ip(self.family))

    @property
    def lb_ip(self) -> str:
        return str(self.lab.lb_ip(self.family))

    @property
    def localhost(self) -> str:
        """This family's loopback address: over IPv6 ``::1``, which is never a NodePort
        (iptables mode), so the verdict tests expect it refused."""
        return "::1" if self.family == 6 else self.lab.localhost

    def socket(self, src: str, family: int | None = None,
               type: int = socket.SOCK_STREAM) -> Any:
        default = socket.AF_INET6 if self.family == 6 else socket.AF_INET
        return self.lab.socket(src, family or default, type)


over_both_families = pytest.mark.parametrize(
    "family", FAMILIES, indirect=True, ids=[f"ipv{f}" for f in FAMILIES])
"""A verdict test's mark: run it over IPv4, and over IPv6 in a dual-stack lab.

The ``family`` fixture (tests/lab/conftest.py) is 4 for unmarked tests, so
they keep their single-stack labs and their ids."""


def in_every_proxy_mode() -> Any:
    """A module's ``lab_factory`` override: each of its tests once per proxy mode.

    ``lab_factory = in_every_proxy_mode()`` in a test module; the factory it
    gives adds ``--proxy-mode <mode>`` to every ``kpx node`` and says which
    (``mode_of``). A test marked ``over_both_families`` also runs over IPv6:
    its lab is dual-stack and it sees the lab through ``FamilyLab``.
    """
    @pytest.fixture(params=PROXY_MODES)
    def lab_factory(request: pytest.FixtureRequest, lab_factory: Callable[..., Lab],
                    family: int) -> Callable[..., Any]:
        mode: str = request.param

        def make(spec: Any = None, **kw: Any) -> Any:
            args = [*kw.pop("extra_proxy_args", ()), "--proxy-mode", mode]
            if family == 6:
                return FamilyLab(lab_factory(spec, extra_proxy_args=args, dual_stack=True,
                                             **kw), 6)
            return lab_factory(spec, extra_proxy_args=args, **kw)

        make.mode = mode  # type: ignore[attr-defined]
        make.family = family  # type: ignore[attr-defined]
        return make

    return lab_factory


def mode_of(lab_factory: Callable[..., Lab]) -> str:
    return str(getattr(lab_factory, "mode", "userspace"))


def family_of_factory(lab_factory: Callable[..., Any]) -> int:
    """The IP family (4 or 6) a ``lab_factory`` from ``in_every_proxy_mode`` tests."""
    return int(getattr(lab_factory, "family", 4))
