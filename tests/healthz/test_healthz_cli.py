"""``kpx healthz`` as a separate process: state file in, answers out, clean SIGTERM.

This is the one healthz test that goes through the YAML parser, because the
state file is the whole interface of the sidecar form.
"""

from __future__ import annotations

import http.client
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from lab.common import wait_until, write_atomic
from tests.support.health import free_port, refuses

STATE = """\
apiVersion: v1
kind: Node
metadata: {{name: node-a}}
status:
  addresses: [{{type: InternalIP, address: 192.0.2.1}}]
---
apiVersion: v1
kind: Service
metadata: {{name: python-lb, namespace: default}}
spec:
  type: LoadBalancer
  externalTrafficPolicy: {policy}
  healthCheckNodePort: {hc_port}
  ports: [{{port: 80, targetPort: 8080, nodePort: 30080, protocol: TCP}}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: python-lb-abc
  namespace: default
  labels: {{kubernetes.io/service-name: python-lb}}
addressType: IPv4
endpoints:
- addresses: [10.1.0.1]
  nodeName: {pod_node}
  conditions: {{ready: true}}
ports: [{{port: 8080, protocol: TCP}}]
"""


def probe(port: int) -> tuple[int, bytes] | None:
    """``(status, body)`` of one GET, or None if the port refuses."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
    try:
        conn.request("GET", "/healthz")
        resp = conn.getresponse()
        return resp.status, resp.read()
    except ConnectionRefusedError:
        return None
    finally:
        conn.close()


def wait_for(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    wait_until(predicate, timeout, 0.02, what)


def write_state(path: Path, **fields: object) -> None:
    """Replace the file atomically, as kubectl-driven writers do."""
    write_atomic(path, STATE.format(**fields))


@pytest.fixture
def sidecar_process(
    tmp_path: Path,
) -> Iterator[tuple[subprocess.Popen[bytes], Path, dict[str, int]]]:
    ports = {"hc": free_port(), "healthz": free_port(), "metrics": free_port()}
    state = tmp_path / "state.yaml"
    write_state(state, policy="Local", hc_port=ports["hc"], pod_node="node-a")
    proc = subprocess.Popen(
        [
            sys.executable, "-m", "proxy", "healthz",
            "--hostname-override", "node-a",
            "--state", str(state),
            "--healthz-bind-address", f"127.0.0.1:{ports['healthz']}",
            "--metrics-bind-address", f"127.0.0.1:{ports['metrics']}",
            "--nodeport-addresses", "127.0.0.0/8",
            "--sync-period", "30s",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        yield proc, state, ports
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


def test_kpx_healthz_follows_the_state_file_and_exits_cleanly(sidecar_process) -> None:
    proc, state, ports = sidecar_process
    wait_for(lambda: probe(ports["hc"]) is not None, 10, "the health-check port")
    status, body = probe(ports["hc"])  # type: ignore[misc]
    assert status == 200 and b'"localEndpoints": 1' in body
    assert probe(ports["healthz"])[0] == 200  # type: ignore[index]

    # The pod moves to another node: within 2 s this node answers 503.
    write_state(state, policy="Local", hc_port=ports["hc"], pod_node="node-b")
    moved = (503, body.replace(b'"localEndpoints": 1', b'"localEndpoints": 0'))
    wait_for(lambda: probe(ports["hc"]) == moved, 2, "503 after the move")

    # Switch to Cluster: the health-check port refuses.
    write_state(state, policy="Cluster", hc_port=ports["hc"], pod_node="node-b")
    wait_for(lambda: refuses(ports["hc"]), 2, "the health-check port to refuse")

    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=10)
    assert proc.returncode == 0, out.decode(errors="replace")
    for port in ports.values():
        assert refuses(port)
