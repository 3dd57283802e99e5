"""docker-compose.yml, checked structurally (no engine needed; tests/compose/ runs it for real).

What a structural check can promise: the file parses, every node is a
container running ``kpx node`` for its own name against the shared state file
with NET_ADMIN, pods, the client and the LB are there, every network a
service joins is declared and every fixed address sits inside its subnet,
the addresses agree with the state file and the LB config, every file the
compose file or its Dockerfile references exists in the repository, and the
image's base is python:3.11-slim unless the engine's side says otherwise.
These fail fast and say which field is wrong; whether an engine runs the lab
is tests/compose/'s job.
"""

from __future__ import annotations

import ipaddress
import os
import re
import shlex
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from lab.loadbalancer import LBConfig
from proxy.k8s import parse_state

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = ROOT / "docker-compose.yml"
NODES = ("node1", "node2", "node3")


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    data = yaml.safe_load(COMPOSE.read_text())  # also resolves the x-* anchors and << merges
    assert isinstance(data, dict)
    return data


@pytest.fixture(scope="module")
def services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return compose["services"]


def _argv(service: dict[str, Any]) -> list[str]:
    cmd = service["command"]
    return shlex.split(cmd) if isinstance(cmd, str) else [str(a) for a in cmd]


def _flag(argv: list[str], name: str) -> str:
    assert name in argv, f"{name} missing from {argv}"
    return argv[argv.index(name) + 1]


def _defaults(text: str) -> str:
    """``${VAR:-default}`` as Compose reads it with VAR unset."""
    return re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", text)


def _mount(volume: str | dict[str, Any]) -> tuple[str, str]:
    if isinstance(volume, dict):
        return _defaults(volume["source"]), volume["target"]
    source, target = _defaults(volume).split(":")[:2]
    return source, target


def _host_path(volume: str | dict[str, Any]) -> str | None:
    source = _mount(volume)[0]
    return source if source and source.startswith(".") else None


def _addresses(service: dict[str, Any]) -> dict[str, str]:
    nets = service.get("networks") or {}
    return {name: (cfg or {}).get("ipv4_address") for name, cfg in nets.items()}


def test_the_expected_services_exist(services: dict[str, Any]) -> None:
    assert set(NODES) <= set(services)
    assert {"client", "lb", "web-1"} <= set(services)


@pytest.mark.parametrize("node", NODES)
def test_each_node_runs_kpx_node_for_itself(services: dict[str, Any], node: str) -> None:
    svc = services[node]
    argv = _argv(svc)
    assert argv[:2] == ["kpx", "node"]
    assert _flag(argv, "--hostname-override") == node
    assert _flag(argv, "--state") == "/state/state.yaml"
    assert "NET_ADMIN" in svc["cap_add"]
    # The state file reaches the container through a mounted directory.
    assert ("./compose/state", "/state") in [_mount(v) for v in svc["volumes"]]
    assert svc["sysctls"]["net.ipv4.ip_forward"] == "1"


def test_every_network_is_declared_and_addresses_fit(compose: dict[str, Any]) -> None:
    declared = compose["networks"]
    seen: dict[str, str] = {}
    for name, svc in compose["services"].items():
        for net, addr in _addresses(svc).items():
            assert net in declared, f"{name} joins undeclared network {net}"
            assert addr, f"{name} has no fixed address on {net}"
            subnet = ipaddress.ip_network(declared[net]["ipam"]["config"][0]["subnet"])
            gateway = ipaddress.ip_address(declared[net]["ipam"]["config"][0]["gateway"])
            assert ipaddress.ip_address(addr) in subnet, f"{name}: {addr} not in {subnet}"
            assert ipaddress.ip_address(addr) != gateway, f"{name}: {addr} is {net}'s gateway"
            assert addr not in seen, f"{addr} used by {seen.get(addr)} and {name}"
            seen[addr] = name


def test_addresses_agree_with_the_state_file(services: dict[str, Any]) -> None:
    snapshot = parse_state((ROOT / "compose/state/state.yaml").read_text())
    node_ips = {n.name: n.internal_ips[0] for n in snapshot.nodes}
    assert set(node_ips) == set(NODES)
    for node, ip in node_ips.items():
        assert _addresses(services[node])["nodes"] == ip
    pod_ips = {
        name: addr for name, svc in services.items()
        for net, addr in _addresses(svc).items() if net.startswith("pods-") and name not in NODES
    }
    for s in snapshot.slices:
        for ep in s.endpoints:
            pod = next(name for name, addr in pod_ips.items() if addr == ep.address)
            # The endpoint's nodeName is the node whose pod network the pod sits on.
            assert f"pods-{ep.node_name}" in _addresses(services[pod])
            assert _flag(_argv(services[pod]), "--node") == ep.node_name


def test_lb_config_matches_the_cluster(services: dict[str, Any]) -> None:
    cfg = LBConfig.from_json((ROOT / "compose/lb.json").read_text())
    snapshot = parse_state((ROOT / "compose/state/state.yaml").read_text())
    svc = next(s for s in snapshot.services if f"{s.namespace}/{s.name}" == cfg.service)
    assert cfg.node_port == svc.ports[0].node_port
    assert cfg.probe.port == svc.health_check_node_port
    assert {b.name: b.ip for b in cfg.backends} == {
        n.name: n.internal_ips[0] for n in snapshot.nodes
    }
    lb = services["lb"]
    assert _argv(lb)[:3] == ["python", "-m", "lab.loadbalancer"]
    assert _addresses(lb)["clients"] == cfg.listen_ip
    assert "NET_ADMIN" in lb["cap_add"]  # nftables DNAT in passthrough mode
    # Passthrough keeps the client IP only if nodes route the client network back via the LB.
    lb_ip = _addresses(lb)["nodes"]
    for node in NODES:
        assert f"10.79.0.0/24 via {lb_ip}" in services[node]["environment"]["KPX_ROUTES"]
    assert services["client"]["environment"]["KPX_DEFAULT_VIA"] == cfg.listen_ip


def test_pods_run_the_echo_server_and_route_via_their_node(services: dict[str, Any]) -> None:
    for name, svc in services.items():
        argv = _argv(svc)
        if argv[:3] != ["python", "-m", "lab.echo"]:
            continue
        assert _flag(argv, "--name") == name
        node = _flag(argv, "--node")
        assert svc["environment"]["KPX_DEFAULT_VIA"] == _addresses(services[node])[f"pods-{node}"]


def test_referenced_files_exist(compose: dict[str, Any]) -> None:
    for name, svc in compose["services"].items():
        build = svc.get("build")
        if build:
            context = ROOT / build["context"]
            assert context.is_dir(), f"{name}: build context {context}"
            assert (context / build.get("dockerfile", "Dockerfile")).is_file()
        for vol in svc.get("volumes") or []:
            path = _host_path(vol)
            if path:
                assert (ROOT / path).exists(), f"{name}: volume source {path} missing"
    config = _flag(_argv(compose["services"]["lb"]), "--config")
    mounted = {t: src for src, t in map(_mount, compose["services"]["lb"]["volumes"])}
    assert (ROOT / mounted[config]).is_file()


def test_dockerfile_copies_only_what_exists() -> None:
    dockerfile = (ROOT / "compose/Dockerfile").read_text()
    sources = []
    for line in dockerfile.splitlines():
        m = re.match(r"\s*COPY\s+(.+)", line)
        if m:
            *src, _dest = m.group(1).split()
            sources += src
    assert sources, "the Dockerfile copies nothing"
    for src in sources:
        assert (ROOT / src).exists(), f"COPY source {src} missing"
    entry = ROOT / "compose/entrypoint.sh"
    assert entry.stat().st_mode & 0o111, "entrypoint.sh must be executable"


def test_the_base_is_python_slim_unless_the_engine_side_says_otherwise(
        services: dict[str, Any]) -> None:
    dockerfile = (ROOT / "compose/Dockerfile").read_text()
    assert re.search(r"^ARG BASE=python:3\.11-slim$", dockerfile, re.M)
    assert re.search(r"^FROM \$\{BASE\}$", dockerfile, re.M)
    for name, svc in services.items():
        assert _defaults(svc["build"]["args"]["BASE"]) == "python:3.11-slim", name
    # compose/kpx-compose hands podman its locally built base through this variable.
    assert "export KPX_BASE=${KPX_BASE:-$BASE_IMAGE}" in (ROOT / "compose/kpx-compose").read_text()


def test_readme_names_every_engine_test() -> None:
    """The README's "what was tested" list is the tests' own list, no more, no less."""
    readme = (ROOT / "compose/README.md").read_text()
    tests = re.findall(r"^def (test_\w+)", (ROOT / "tests/compose/test_compose_lab.py").read_text(),
                       re.M)
    assert tests
    for name in tests:
        assert f"`{name}`" in readme, f"compose/README.md does not list {name}"
    listed = set(re.findall(r"`(test_\w+)`", readme))
    assert listed <= set(tests), f"README lists tests that do not exist: {listed - set(tests)}"


def _fake_docker(bin_dir: Path, *, compose: bool, daemon: bool) -> None:
    """A ``docker`` CLI whose compose plugin and daemon answer as told."""
    script = bin_dir / "docker"
    script.write_text(
        "#!/bin/sh\n"
        f'[ "$1" = compose ] && exit {0 if compose else 1}\n'
        f'[ "$1" = info ] && exit {0 if daemon else 1}\n'
        "exit 2\n")
    script.chmod(0o755)
    (bin_dir / "podman").write_text("#!/bin/sh\nexit 0\n")
    (bin_dir / "podman").chmod(0o755)


@pytest.mark.parametrize(("compose_ok", "daemon_ok", "want"), [
    (True, True, "docker"),
    (True, False, "podman"),   # the client and plugin without an engine behind them
    (False, True, "podman"),
])
def test_the_engine_is_docker_only_when_its_compose_and_daemon_answer(
        tmp_path: Path, compose_ok: bool, daemon_ok: bool, want: str) -> None:
    _fake_docker(tmp_path, compose=compose_ok, daemon=daemon_ok)
    env = {**os.environ, "PATH": f"{tmp_path}:/usr/bin:/bin"}
    env.pop("KPX_COMPOSE_ENGINE", None)
    got = subprocess.run([str(ROOT / "compose" / "kpx-compose"), "--engine"], env=env,
                         capture_output=True, text=True, timeout=30)
    assert (got.returncode, got.stdout.strip()) == (0, want), got.stderr
