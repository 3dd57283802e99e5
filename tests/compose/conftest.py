"""The compose lab, up for real on this machine's engine, driven by pytest-docker.

Owns: pytest-docker's up/down (module-scoped) around kpx's compose file with
``compose/kpx-compose`` (the engine picker: podman-compose here, in a network
namespace of its own; ``docker compose`` where Docker is installed), one
project per pytest process, a copy of ``compose/state`` the tests may edit,
and the sweep that leaves no container, network, volume or namespace of the
project behind, pass or fail (pytest-docker skips its ``down`` when ``up``
itself failed; the sweep does not).

Never: edits the committed ``compose/state``; touches the root network
namespace (podman's bridges and firewall live in ``kpx-compose-<pid>``); uses
a container, network or volume that is not this project's.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import subprocess
from collections.abc import Iterator

import pytest
from pytest_docker.plugin import Services, get_docker_services

from tests.compose.composekit import KPX_COMPOSE, ROOT, ComposeEnv, Lab


def _require_engine() -> str:
    if os.geteuid() != 0:
        pytest.skip("the compose lab needs root (podman rootful, network namespaces)")
    res = subprocess.run([str(KPX_COMPOSE), "--engine"], capture_output=True, text=True,
                         check=False)
    # No engine is a failure, not a skip: .ci/system-deps installs podman.
    assert res.returncode == 0, res.stderr
    return res.stdout.strip()


@pytest.fixture(scope="module")
def compose_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ComposeEnv]:
    engine = _require_engine()
    state_dir = tmp_path_factory.mktemp("compose-state")
    shutil.copytree(ROOT / "compose" / "state", state_dir, dirs_exist_ok=True)
    env = ComposeEnv(engine=engine, project=f"kpxtest{os.getpid()}",
                     netns=f"kpx-compose-{os.getpid()}", state_dir=state_dir)
    try:
        yield env
    finally:
        # After pytest-docker's `down` (compose_services depends on this fixture).
        env.sweep()


@pytest.fixture(scope="module")
def compose_services(compose_env: ComposeEnv) -> Iterator[Services]:
    """pytest-docker's up/down around the module, with kpx-compose as the compose command.

    Module scope, not pytest-docker's default session: the lab's seven
    containers go as soon as its tests are done instead of idling through
    the rest of the suite.
    """
    # pytest-docker runs the command through a shell, appending -f/-p and a subcommand.
    env = " ".join(f"{k}={shlex.quote(v)}" for k, v in compose_env.env.items()
                   if k.startswith("KPX_"))
    with get_docker_services(
        f"{env} {shlex.quote(str(KPX_COMPOSE))}",
        str(ROOT / "docker-compose.yml"),
        compose_env.project,
        ["build node1", "up -d"],  # one build (every service shares the image), then the lab
        ["down -v -t 1"],
    ) as services:
        yield services


@pytest.fixture(scope="module")
def compose_lab(compose_env: ComposeEnv, compose_services: Services) -> Lab:
    """The lab once the LB has probed every node (passes and failures both count).

    Until then it fails open (every node gets traffic), so an answer alone
    would not tell that the lab has settled; which nodes it then serves
    through is for the tests to check.
    """
    lab = Lab(compose_env)
    compose_services.wait_until_responsive(
        check=lambda: (lab.lb_status() or {}).get("ready") is True, timeout=60.0, pause=0.5)
    return lab


@pytest.fixture
def restore_state(compose_lab: Lab) -> Iterator[str]:
    """The state file's text now; written back (and the LB back on web-1) after the test."""
    original = compose_lab.state_file().read_text()
    try:
        yield original
    finally:
        with contextlib.suppress(Exception):
            compose_lab.write_state(original)
            compose_lab.wait_for("node1", "web-1", timeout=30.0)
