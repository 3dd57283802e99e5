"""A Dataplane in its own process, driven through a state file: the test side.

``Driver`` starts ``python -m tests.support.driver_process`` (optionally in a
network namespace), writes Kubernetes YAML to its state file atomically and
waits for the JSON status file to report each new generation.
"""

from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path
from typing import Any

from lab.common import wait_until
from lab.common import write_atomic as _write_atomic
from tests.support.netns import PY, REPO, stop_process
from tests.support.objects import state_yaml


def write_state(path: Path, *objs: dict[str, Any]) -> None:
    """Replace the state file atomically, as kubelet and editors do."""
    _write_atomic(path, state_yaml(*objs))


class Driver:
    """A Dataplane in its own process (``tests/support/driver_process.py``)."""

    def __init__(self, workdir: Path, node_name: str, *args: str,
                 netns: str | None = None, stdin: bool = False,
                 env: dict[str, str] | None = None) -> None:
        self.state = workdir / "state.yaml"
        self.status_path = workdir / "status.json"
        self.log_path = workdir / "driver.log"
        self.node_name = node_name
        self.args = list(args)
        self.netns = netns
        self.stdin = stdin
        self.env = env
        self.proc: subprocess.Popen[str] | None = None
        self.generation = 0

    def start(self, *objs: dict[str, Any]) -> Driver:
        write_state(self.state, *objs)
        self.status_path.unlink(missing_ok=True)
        argv = [PY, "-m", "tests.support.driver_process", "--node", self.node_name,
                "--state", str(self.state), "--status", str(self.status_path), *self.args]
        if self.netns:
            argv = ["ip", "netns", "exec", self.netns, *argv]
        self._log = open(self.log_path, "a")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            argv, cwd=REPO, text=True, stdout=self._log, stderr=self._log,
            stdin=subprocess.PIPE if self.stdin else subprocess.DEVNULL, env=self.env,
        )
        self.generation = 1
        self.wait_generation(1)
        return self

    def status(self) -> dict[str, Any]:
        try:
            return json.loads(self.status_path.read_text())
        except (OSError, ValueError):
            return {}

    def wait_generation(self, gen: int, timeout: float = 10.0) -> dict[str, Any]:
        def ready() -> dict[str, Any] | None:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise AssertionError(f"driver exited {self.proc.returncode}:\n{self.logs()}")
            st = self.status()
            return st if st.get("generation", 0) >= gen else None
        return wait_until(ready, timeout, 0.02, what=f"driver generation {gen}")

    def update(self, *objs: dict[str, Any]) -> dict[str, Any]:
        write_state(self.state, *objs)
        self.generation += 1
        return self.wait_generation(self.generation)

    def listeners(self) -> list[tuple[str, int, str]]:
        return [tuple(x) for x in self.status().get("listeners", [])]  # type: ignore[misc]

    def send(self, line: str) -> None:
        assert self.proc is not None and self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def logs(self) -> str:
        try:
            return self.log_path.read_text()
        except OSError:
            return ""

    def stop(self, sig: int = signal.SIGTERM) -> int:
        rc = stop_process(self.proc, sig) if self.proc is not None else 0
        if getattr(self, "_log", None) is not None:
            self._log.close()
            self._log = None
        return rc
