"""``kpx check`` takes UDP service and slice ports, and names a protocol it does not know."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

STATE = """\
apiVersion: v1
kind: List
items:
- {apiVersion: v1, kind: Node, metadata: {name: node1},
   status: {addresses: [{type: InternalIP, address: 10.0.0.1}]}}
- apiVersion: v1
  kind: Service
  metadata: {name: dns, namespace: kube-system}
  spec:
    type: NodePort
    clusterIP: 10.96.0.10
    ports:
    - {name: dns, port: 53, targetPort: 53, protocol: PROTO, nodePort: 30053}
    - {name: dns-tcp, port: 53, targetPort: 53, protocol: TCP, nodePort: 30053}
- apiVersion: discovery.k8s.io/v1
  kind: EndpointSlice
  metadata: {name: dns-a, namespace: kube-system,
             labels: {kubernetes.io/service-name: dns}}
  addressType: IPv4
  endpoints: [{addresses: [10.244.1.5], nodeName: node1, conditions: {ready: true}}]
  ports: [{name: dns, port: 53, protocol: UDP}, {name: dns-tcp, port: 53, protocol: TCP}]
"""


def check(tmp_path: Path, protocol: str) -> subprocess.CompletedProcess[str]:
    state = tmp_path / "state.yaml"
    state.write_text(STATE.replace("PROTO", protocol))
    kpx = Path(sys.executable).with_name("kpx")
    return subprocess.run([str(kpx), "check", str(state)], capture_output=True, text=True,
                          timeout=60)


def test_a_udp_port_sharing_its_nodeport_with_tcp_is_accepted(tmp_path: Path) -> None:
    done = check(tmp_path, "UDP")
    assert done.returncode == 0, done.stderr
    assert "1 services (1 with NodePorts)" in done.stdout


def test_an_unknown_protocol_is_named(tmp_path: Path) -> None:
    done = check(tmp_path, "QUIC")
    assert done.returncode == 1
    assert "Service kube-system/dns: spec.ports[0].protocol" in done.stderr, done.stderr
