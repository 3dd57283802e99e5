"""Helpers of the compose-lab tests: kpx-compose calls and what the client container sees.

Owns: the one way these tests call ``compose/kpx-compose`` (engine, project,
namespace and state copy in the environment), the client's curl with the
exit codes that tell a time-out from a refusal, the editor-style rewrite of
the state file, and the sweep of a project's containers, networks, volumes
and podman namespace.

Never: edits the committed ``compose/state``; names a container, network or
volume that is not labelled with the session's project.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
KPX_COMPOSE = ROOT / "compose" / "kpx-compose"
LB_URL = "http://10.79.0.1/"
CLIENT_IP = "10.79.0.100"


def _json_or_none(res: subprocess.CompletedProcess[str]) -> dict[str, Any] | None:
    """A command's JSON output; None when it failed or printed something else (not up yet)."""
    if res.returncode != 0:
        return None
    try:
        return json.loads(res.stdout)
    except json.JSONDecodeError:
        return None


@dataclass(frozen=True)
class ComposeEnv:
    """What every call of kpx-compose for this test session shares."""

    engine: str
    project: str
    netns: str
    state_dir: Path

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "KPX_COMPOSE_ENGINE": self.engine,
                "KPX_COMPOSE_NETNS": self.netns, "KPX_STATE_DIR": str(self.state_dir)}

    def compose(self, *args: str, timeout: float = 120.0,
                check: bool = True) -> subprocess.CompletedProcess[str]:
        argv = [str(KPX_COMPOSE), "-f", str(ROOT / "docker-compose.yml"), "-p", self.project,
                *args]
        return subprocess.run(argv, env=self.env, capture_output=True, text=True,
                              timeout=timeout, check=check)

    def engine_cmd(self, *args: str, timeout: float = 120.0
                   ) -> subprocess.CompletedProcess[str]:
        """The engine itself (`podman ...` in the lab's store and namespace, or `docker ...`)."""
        argv = ([str(KPX_COMPOSE), "--podman", *args] if self.engine == "podman"
                else ["docker", *args])
        return subprocess.run(argv, env=self.env, capture_output=True, text=True,
                              timeout=timeout, check=False)

    def leftovers(self) -> dict[str, list[str]]:
        """Containers, networks and volumes labelled with this project."""
        label = f"label=com.docker.compose.project={self.project}"
        found: dict[str, list[str]] = {}
        for kind, args in (("containers", ["ps", "-a", "--format", "{{.Names}}"]),
                           ("networks", ["network", "ls", "--format", "{{.Name}}"]),
                           ("volumes", ["volume", "ls", "--format", "{{.Name}}"])):
            res = self.engine_cmd(*args[:2], "--filter", label, *args[2:])
            assert res.returncode == 0, f"{args}: {res.stderr}"
            found[kind] = res.stdout.split()
        return found

    def sweep(self) -> None:
        """Remove whatever of this project is left, then podman's namespace."""
        left = self.leftovers()
        if left["containers"]:
            self.engine_cmd("rm", "-f", "-t", "0", *left["containers"])
        if left["networks"]:
            self.engine_cmd("network", "rm", "-f", *left["networks"])
        if left["volumes"]:
            self.engine_cmd("volume", "rm", "-f", *left["volumes"])
        if self.engine == "podman":
            subprocess.run([str(KPX_COMPOSE), "--release"], env=self.env, check=True,
                           capture_output=True, text=True, timeout=60)


@dataclass(frozen=True)
class Lab:
    """The running compose lab, seen from its containers."""

    env: ComposeEnv

    def container(self, service: str) -> str:
        """The id of *service*'s container, by the labels both engines' compose set."""
        res = self.env.engine_cmd(
            "ps", "-q", "--filter", f"label=com.docker.compose.project={self.env.project}",
            "--filter", f"label=com.docker.compose.service={service}")
        ids = res.stdout.split()
        assert res.returncode == 0 and len(ids) == 1, f"{service}: {ids} {res.stderr}"
        return ids[0]

    def exec(self, service: str, *argv: str, timeout: float = 30.0
             ) -> subprocess.CompletedProcess[str]:
        # The engine's exec, not compose's: the same thing without a compose
        # file to parse each time (~0.2 s instead of ~1.8 s a call here).
        return self.env.engine_cmd("exec", self.container(service), *argv, timeout=timeout)

    def curl(self, url: str, *opts: str, max_time: float = 3.0
             ) -> subprocess.CompletedProcess[str]:
        """curl from the client: its exit code tells a time-out (28) from a refusal (7)."""
        return self.exec("client", "curl", "-sS", "-m", str(max_time), *opts, url,
                         timeout=max_time + 30)

    def who(self) -> dict[str, Any] | None:
        """The echo pod's answer through the LB, or None when none came."""
        return _json_or_none(self.curl(LB_URL))

    def status(self, url: str) -> tuple[int, str]:
        res = self.curl(url, "-o", "/dev/stderr", "-w", "%{http_code}")
        assert res.returncode == 0, f"curl {url}: rc {res.returncode}: {res.stderr}"
        return int(res.stdout), res.stderr

    def state_file(self) -> Path:
        return self.env.state_dir / "state.yaml"

    def write_state(self, text: str) -> None:
        """Replace the state file the way an editor saves: a new file renamed over it."""
        tmp = self.env.state_dir / ".state.yaml.new"
        tmp.write_text(text)
        os.replace(tmp, self.state_file())

    def lb_status(self) -> dict[str, Any] | None:
        """The LB's status file (lab/lb/daemon.py), None until it exists."""
        return _json_or_none(self.exec("lb", "cat", "/tmp/lb-status.json"))

    def serving(self) -> list[str] | None:
        """The nodes the LB sends to now, None while it fails open or has not probed them all."""
        status = self.lb_status()
        if not status or not status.get("ready") or status.get("failOpen"):
            return None
        return list(status["serving"])

    def settled_on(self, node: str, pod: str) -> bool:
        """The LB serves through *node* alone and the answer comes from *pod*."""
        return self.serving() == [node] and (self.who() or {}).get("pod") == pod

    def wait_for(self, node: str, pod: str, timeout: float) -> float:
        """Seconds until :meth:`settled_on` holds (bounded by *timeout*)."""
        start = time.monotonic()
        while time.monotonic() - start < timeout:
            if self.settled_on(node, pod):
                return time.monotonic() - start
            time.sleep(0.25)
        raise AssertionError(f"the LB did not settle on {node}/{pod} within {timeout} s "
                             f"(serving {self.serving()}, answer {self.who()})")
