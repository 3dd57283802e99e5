"""A real ``kpx node`` fed hostile state files keeps running and keeps the last good state.

The "Robustness" issue's crash: ~100 KB of ``[`` in the state file killed
``kpx node`` with SIGSEGV inside PyYAML's C extension (libyaml without a
nesting limit), closing every NodePort and health port, again on every
restart. Here ``kpx node`` runs as the lab runs it (``lab/cluster.py``
``proxy_argv``: ``--hostname-override``, ``--state``, healthz and metrics
addresses) in the node namespace of a ``tests.support.netns.Topology``, serves one NodePort
service with an endpoint in pod1, and then gets deeply nested flow and block
YAML and an empty file. After each it must be alive, have logged the refusal,
and still serve the NodePort and ``/healthz`` from the client namespace.

It runs twice: with the venv's PyYAML (whose bundled libyaml stops at 1,000
levels by itself) and, where this machine has one, with the distro's
python3-yaml (libyaml 0.2.5, no limit: the build that crashed).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from lab.common import wait_until, write_atomic
from tests.support.driver import write_state
from tests.support.netns import PY, Topology, connect_in, stop_process, topology
from tests.support.objects import endpoint_slice, node, service

pytestmark = pytest.mark.lab

NODE = "n1"
T = Topology
BACKEND_PORT = 8080
NODE_PORT = 30481
HEALTHZ_PORT = 31256
METRICS_PORT = 31249
GUARD = "more than 100 levels of collections"
DISTRO_PYYAML = Path("/usr/lib/python3/dist-packages")

HOSTILE = [
    # (what, content, what the refusal must say with the venv's PyYAML, and with the distro's)
    ("flow", "[" * 100_000, ("exceeded maximum nesting depth", GUARD), GUARD),
    ("block", "- " * 50_000 + "x\n", ("exceeded maximum nesting depth", GUARD), GUARD),
    ("empty", "", ("no documents",), "no documents"),
]


@pytest.fixture(scope="module")
def topo() -> Iterator[Topology]:
    if shutil.which("ip") is None:
        pytest.skip("needs iproute2")
    try:
        with topology() as t:
            t.backend(t.pod1, "pod1", BACKEND_PORT)
            yield t
    except PermissionError:
        pytest.skip("needs root (network namespaces)")


def _distro_pyyaml(site: Path) -> str | None:
    """A PYTHONPATH entry holding only the distro's PyYAML, if this Python imports it."""
    if not (DISTRO_PYYAML / "yaml" / "__init__.py").exists():
        return None
    site.mkdir(parents=True, exist_ok=True)
    for name in ("yaml", "_yaml"):
        if (DISTRO_PYYAML / name).exists() and not (site / name).exists():
            (site / name).symlink_to(DISTRO_PYYAML / name)
    probe = subprocess.run(
        [PY, "-c", "import yaml, sys; sys.exit(0 if yaml.__with_libyaml__ else 1)"],
        env={**os.environ, "PYTHONPATH": str(site)}, capture_output=True, timeout=60,
        check=False,
    )
    return str(site) if probe.returncode == 0 else None


@pytest.fixture(params=["venv", "distro"])
def pyyaml_env(request: pytest.FixtureRequest, tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if request.param == "distro":
        path = _distro_pyyaml(tmp_path / "site")
        if path is None:
            pytest.skip("no distro PyYAML with libyaml for this Python")
        env["PYTHONPATH"] = path
    return env


def peer_name(ns: str) -> str:
    """The pod that answers a PEER through the NodePort, seen from ``ns``."""
    with connect_in(ns, (T.NODE_IP, NODE_PORT), timeout=2.0) as s:
        s.sendall(b"PEER\n")
        return s.recv(200).decode().split()[0]


def healthz_status(ns: str) -> str:
    with connect_in(ns, (T.NODE_IP, HEALTHZ_PORT), timeout=2.0) as s:
        s.sendall(b"GET /healthz HTTP/1.0\r\nHost: kpx\r\n\r\n")
        return s.recv(200).decode(errors="replace").split("\r\n", 1)[0]


def _serves(ns: str) -> bool:
    try:
        return peer_name(ns) == "pod1" and " 200 " in healthz_status(ns) + " "
    except OSError:
        return False


def test_kpx_node_survives_hostile_state_files(
    topo: Topology, tmp_path: Path, pyyaml_env: dict[str, str]
) -> None:
    state = tmp_path / "state.yaml"
    log_path = tmp_path / "kpx.log"
    write_state(
        state,
        node(NODE, T.NODE_IP),
        service("web", NODE_PORT, BACKEND_PORT),
        endpoint_slice("web", (T.POD1_IP, NODE), port=BACKEND_PORT),
    )
    argv = [sys.executable, "-m", "proxy", "node", "--hostname-override", NODE,
            "--state", str(state), "--healthz-bind-address", f"0.0.0.0:{HEALTHZ_PORT}",
            "--metrics-bind-address", f"127.0.0.1:{METRICS_PORT}"]
    distro = "PYTHONPATH" in pyyaml_env
    with open(log_path, "w") as log:
        proc = topo.popen(topo.node, *argv, stdout=log, stderr=subprocess.STDOUT,
                          env=pyyaml_env)
    try:

        def alive() -> None:
            assert proc.poll() is None, (
                f"kpx node exited with {proc.returncode} (-11: SIGSEGV):\n"
                f"{log_path.read_text()[-3000:]}"
            )

        def serving() -> bool:
            alive()
            return _serves(topo.client)

        wait_until(serving, 20, 0.02, what="the NodePort and /healthz of the good state")
        for what, content, venv_says, distro_says in HOSTILE:
            refusals = log_path.read_text().count(" refused (")
            write_atomic(state, content)

            def refused(before: int = refusals) -> bool:
                alive()
                return log_path.read_text().count(" refused (") > before

            wait_until(refused, 30, 0.02, what=f"the {what} state to be refused")
            alive()
            said = log_path.read_text().split(" refused (")[-1]
            expected = (distro_says,) if distro else venv_says
            assert any(e in said for e in expected), f"{what}: {said[:500]}"
            assert peer_name(topo.client) == "pod1", f"{what}: the NodePort stopped serving"
            assert " 200 " in healthz_status(topo.client) + " ", f"{what}: /healthz"
    finally:
        rc = stop_process(proc, signal.SIGTERM)
    assert rc == 0, f"kpx node exited with {rc} on SIGTERM:\n{log_path.read_text()[-3000:]}"
