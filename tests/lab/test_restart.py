"""One kpx per node namespace, restarts that hand over, and a return path that heals itself.

Issue "Robustness", points 2 and 3, on a real lab node:

- a second ``kpx node`` (one process or ``--workers 2``) in a node's
  namespace exits at once with a message naming the one that serves, and
  leaves it whole: routing unchanged, client IPs still preserved;
- a restart (SIGTERM the old one, start the new one at once, as an operator
  does) under ``Connection: close`` load fails no connection at all (one
  process: the listening sockets move to the new one), or none once the new
  process listens (``--workers 2``, which binds anew); client IPs survive the
  old one's exit, and ``ip rule``, ``nft list ruleset`` and every route are
  the same before and after;
- SIGTERM with no successor keeps accepting for ``--handover-wait``, then
  refuses, and exits;
- the nft table, the fwmark rule or the local route deleted from outside
  comes back within about one sync period, and the repair is counted.

Every ``ip``/``nft`` here runs inside the lab's node namespace.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest

from lab import netns
from lab.common import wait_until
from tests.support.labkit import connect_outcome

pytestmark = [pytest.mark.lab, pytest.mark.serial]

NODE = "node1"


def routing(lab: Any, node: str = NODE) -> dict[str, str]:
    """Everything kpx's return path is made of, as the node shows it.

    IPv4 rules and routes: the kernel adds IPv6 link-local routes a moment
    after the lab is up (DAD), which has nothing to do with kpx (IPv4 only).
    """
    # Tables as a set: one deleted and restored is listed last. The VIP
    # table's counters count what it turned away.
    ruleset = lab.run(node, ["nft", "list", "ruleset"], check=True).stdout
    ruleset = re.sub(r"counter packets \d+ bytes \d+", "counter", ruleset)
    tables = sorted("table " + t for t in ruleset.split("table ") if t.strip())
    return {
        "ip rule": lab.run(node, ["ip", "-4", "rule"], check=True).stdout,
        "nft list ruleset": "".join(tables),
        "ip route show table all": lab.run(node, ["ip", "-4", "route", "show", "table", "all"],
                                           check=True).stdout,
    }


def peer_ip(lab: Any, node: str = NODE) -> str:
    reply = lab.request("client", lab.node_ip(node), lab.node_port("default/web"), mode="HTTP")
    return str(reply["peer"]).rsplit(":", 1)[0]


def second_instance(lab: Any, node: str = NODE) -> tuple[Any, float]:
    """Run the node's very ``kpx node`` command line again in its namespace."""
    t0 = time.monotonic()
    res = lab.run(node, lab.proxy_argv(node), timeout=15)
    return res, time.monotonic() - t0


def test_second_instance_fails_fast_and_leaves_the_first_whole(
    lab_factory: Callable[..., Any], one_pod_spec: Callable[..., dict[str, Any]],
) -> None:
    lab = lab_factory(one_pod_spec(nodes=2))
    first = lab.proxy_pid(NODE)
    assert peer_ip(lab) == lab.client_ip
    before = routing(lab)
    assert "kpx_tproxy" in before["nft list ruleset"]

    res, took = second_instance(lab)
    assert res.returncode == 1, res.stderr[-2000:]
    assert took < 8.0
    assert f"another kpx node (pid {first}) already serves this network namespace" in res.stderr
    assert f"kill -TERM {first}" in res.stderr

    assert lab.proxy_alive(NODE)
    assert routing(lab) == before
    assert peer_ip(lab) == lab.client_ip
    assert lab.http_get("client", lab.node_ip(NODE), lab.hc_port("default/web"),
                        "/")[0] == 200


def test_second_instance_with_workers_fails_fast(
    lab_factory: Callable[..., Any], one_pod_spec: Callable[..., dict[str, Any]],
) -> None:
    lab = lab_factory(one_pod_spec(nodes=2), extra_proxy_args=("--workers", "2"))
    supervisor = lab.proxy_pid(NODE)
    port = lab.node_port("default/web")
    workers = {int(p) for p in lab.run(NODE, ["pgrep", "-P", str(supervisor)]).stdout.split()}
    assert len(workers) == 2
    assert lab.listener_pids(NODE, port) == workers
    before = routing(lab)

    res, took = second_instance(lab)
    assert res.returncode == 1, res.stderr[-2000:]
    assert took < 8.0
    assert f"another kpx node (pid {supervisor})" in res.stderr
    # It never joined the first one's SO_REUSEPORT group, nor touched the routing.
    assert lab.listener_pids(NODE, port) == workers
    assert routing(lab) == before
    assert peer_ip(lab) == lab.client_ip


@dataclass
class Attempt:
    started: float
    ok: bool
    peer: str = ""
    error: str = ""


class Load:
    """``Connection: close`` HTTP requests from the client, one after another, bounded."""

    def __init__(self, lab: Any, node: str, max_requests: int = 20000,
                 max_seconds: float = 40.0) -> None:
        self.lab, self.node = lab, node
        self.max_requests, self.max_seconds = max_requests, max_seconds
        self.attempts: list[Attempt] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        ip, port = self.lab.node_ip(self.node), self.lab.node_port("default/web")
        deadline = time.monotonic() + self.max_seconds
        while (not self._stop.is_set() and len(self.attempts) < self.max_requests
               and time.monotonic() < deadline):
            t = time.monotonic()
            try:
                reply = self.lab.request("client", ip, port, mode="HTTP", timeout=2.0)
                self.attempts.append(Attempt(t, True, str(reply["peer"]).rsplit(":", 1)[0]))
            except Exception as exc:  # every failure counts, whatever it is
                self.attempts.append(Attempt(t, False, error=repr(exc)))
                time.sleep(0.005)  # a refused connect returns at once: do not spin

    def ok_since(self, t: float) -> int:
        return sum(1 for a in list(self.attempts) if a.ok and a.started >= t)

    def __enter__(self) -> Load:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


def _keepalive_get(sock: Any) -> str:
    """One keep-alive ``GET /`` on an open connection: the peer the pod saw."""
    sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(4096)
        assert chunk, "connection closed before the answer"
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    m = re.search(rb"(?i)content-length:\s*(\d+)", head)
    assert m and head.startswith(b"HTTP/1.1 200"), head
    while len(body) < int(m.group(1)):
        body += sock.recv(4096)
    return str(re.search(rb'"peer": ?"([^"]+)"', body).group(1).decode()).rsplit(":", 1)[0]


def serving_pids(lab: Any, pid: int, port: int) -> set[int]:
    """The processes of the ``kpx node`` *pid* (itself or its workers) listening on *port*."""
    family = {pid} | {int(p) for p in lab.run(NODE, ["pgrep", "-P", str(pid)]).stdout.split()}
    return lab.listener_pids(NODE, port) & family


@pytest.mark.parametrize("workers", [1, 2])
def test_restart_under_load_hands_over_without_a_gap(
    lab_factory: Callable[..., Any], one_pod_spec: Callable[..., dict[str, Any]], workers: int,
) -> None:
    """One process: not one connection fails during the whole restart (the listening
    sockets move to the new process). ``--workers 2`` still closes and binds anew:
    none fails once the new one listens."""
    lab = lab_factory(one_pod_spec(nodes=2),
                      extra_proxy_args=("--shutdown-grace", "10s", "--workers", str(workers)))
    ip, port = lab.node_ip(NODE), lab.node_port("default/web")
    client = lab.client_ip
    assert peer_ip(lab) == client
    before = routing(lab)

    with lab.socket("client") as held, Load(lab, NODE) as load:
        # A connection the old process will still be relaying while it drains.
        held.settimeout(3.0)
        held.connect((ip, port))
        assert _keepalive_get(held) == client
        wait_until(lambda: load.ok_since(0) >= 20, 10, what="load running")

        old, new = lab.restart_proxy(NODE)
        restarted = time.monotonic()
        # Only the new one listens: the old one has stopped accepting (and,
        # with one process, closed its copies of the very same sockets).
        wait_until(lambda: serving_pids(lab, new, port)
                   and lab.listener_pids(NODE, port) == serving_pids(lab, new, port),
                   15, what="the new kpx node alone listening")
        up = time.monotonic()

        # The new one installed the return path without disturbing the old
        # one's connections: the draining relay still preserves the client IP.
        assert netns.pid_alive(old), "the old kpx node should still be draining"
        assert _keepalive_get(held) == client
        held.close()  # the old one's last connection: it exits now

        wait_until(lambda: not netns.pid_alive(old), 15, what="the old kpx node exiting")
        gone = time.monotonic()
        wait_until(lambda: load.ok_since(gone) >= 30, 15, what="load after the old one exited")

    attempts = list(load.attempts)
    since = restarted if workers == 1 else up
    failed = [a for a in attempts if a.started >= since and not a.ok]
    assert failed == [], (
        f"{len(failed)} of {sum(a.started >= since for a in attempts)} connections failed "
        f"{'during the restart' if workers == 1 else 'after the new kpx node was up'}: "
        f"{failed[:3]}")
    if workers == 1:
        assert not [a for a in attempts if not a.ok], "a connection failed before the restart"
        assert sum(restarted <= a.started < up for a in attempts) >= 5, \
            "too few connections during the handover to tell"
    after_exit = [a for a in attempts if a.started >= gone]
    assert after_exit and all(a.peer == client for a in after_exit), after_exit[:3]
    assert peer_ip(lab) == client

    assert routing(lab) == before
    log = lab.proxy_log(NODE)
    if workers == 1:
        assert f"handed this network namespace to kpx node pid {new}" in log
        assert "(socket taken over)" in log
    else:
        assert "a new kpx node may take over" in log
    assert f"left in place: kpx pid {new} in this namespace still uses it" in log
    assert lab.proxy_alive(NODE) and lab.proxy_pid(NODE) == new


def test_sigterm_without_a_successor_keeps_accepting_for_the_window_then_refuses(
    lab_factory: Callable[..., Any], one_pod_spec: Callable[..., dict[str, Any]],
) -> None:
    """Nobody takes over: accepting for ``--handover-wait`` (2s), then refused (not hung)."""
    lab = lab_factory(one_pod_spec(nodes=2))
    ip, port = lab.node_ip(NODE), lab.node_port("default/web")
    pid = lab.proxy_pid(NODE)
    assert peer_ip(lab) == lab.client_ip

    os.kill(pid, signal.SIGTERM)
    sent = time.monotonic()
    assert lab.request("client", ip, port, mode="HTTP", timeout=2.0)["pod"] == "web-1"
    served_at = time.monotonic()
    assert served_at - sent < 1.0, "accepting during the window, at once"

    def refused() -> bool:
        return connect_outcome(lab, "client", ip, port, 1.0) == "refused"

    wait_until(refused, 6, what="NodePort refused after the window")
    closed = time.monotonic() - sent
    assert 1.5 < closed < 4.5, f"listeners closed {closed:.2f}s after SIGTERM (window 2s)"
    wait_until(lambda: not netns.pid_alive(pid), 10, what="the kpx node exiting")
    for _ in range(3):  # refused at once, never left hanging
        assert connect_outcome(lab, "client", ip, port, 1.0) == "refused"
    log = lab.proxy_log(NODE)
    assert "accepting for up to 2.0s more while a new kpx node may take" in log
    assert "released this network namespace: a new kpx node may take over" in log
    assert f"kpx node {NODE} stopped" in log


def _repairs(lab: Any, part: str) -> float:
    status, body = lab.http_get(NODE, "127.0.0.1", lab.metrics_port, "/metrics")
    assert status == 200
    m = re.search(rf'^kubeproxy_kpx_return_path_repairs_total{{part="{part}"}} (\S+)$',
                  body.decode(), re.M)
    return float(m.group(1)) if m else 0.0


@pytest.mark.parametrize(
    ("part", "damage"),
    [
        ("nft_table", ["nft", "delete", "table", "inet", "kpx_tproxy"]),
        ("rule", ["ip", "-4", "rule", "del", "pref", "7078"]),
        ("route", ["ip", "-4", "route", "flush", "table", "7078"]),
    ],
)
def test_return_path_deleted_outside_kpx_is_restored(
    lab_factory: Callable[..., Any], one_pod_spec: Callable[..., dict[str, Any]],
    part: str, damage: list[str],
) -> None:
    lab = lab_factory(one_pod_spec(nodes=2), extra_proxy_args=("--sync-period", "1s"))
    assert peer_ip(lab) == lab.client_ip
    before = routing(lab)
    assert _repairs(lab, part) == 0.0

    lab.run(NODE, damage, check=True)
    assert routing(lab) != before
    try:
        wait_until(lambda: routing(lab) == before, 5, what=f"{part} restored")  # ~1 sync period
    except TimeoutError as exc:
        raise AssertionError(f"{exc}; log:\n{lab.proxy_log(NODE)[-3000:]}") from None
    wait_until(lambda: _repairs(lab, part) == 1.0, 3, what="the repair counted")
    assert f"transparent return path: {part} was missing (removed outside kpx); restored" \
        in lab.proxy_log(NODE)
    assert peer_ip(lab) == lab.client_ip
    assert lab.http_get(NODE, lab.node_ip(NODE), lab.healthz_port, "/healthz")[0] == 200
    # Checked and repaired every second, with a small state: still one thread.
    # A thread (an executor's, the loader's) would switch the process to glibc's
    # multi-threaded syscall paths for good (proxy.sources.statefile.INLINE_MAX_BYTES).
    pid = lab.proxy_pid(NODE)
    assert pid is not None
    assert os.listdir(f"/proc/{pid}/task") == [str(pid)]
