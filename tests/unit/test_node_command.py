"""``kpx node`` claims its network namespace before it imports the rest of kpx.

A restart is SIGTERM to the old process and a new one started at once. The
old one keeps accepting for ``--handover-wait`` while it waits for the new one
to ask for its listeners, and the asking is ``Ownership.acquire``. On a busy
node, importing the dataplane, healthz and the HTTP client first took longer
than that window, and connections were refused (docs/PERFORMANCE.md, "A
restart's successor asks sooner").

Each test runs the real ``kpx`` entry point in a fresh interpreter, with the
claim replaced by one that prints every module imported so far and then
refuses, so nothing in the namespace is touched.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

HEAVY = (
    "aiohttp", "uvloop", "prometheus_client", "pyroute2", "kubernetes_asyncio", "healthz",
    "proxy.userspace", "proxy.nfqueue.dataplane", "proxy.nfqueue.netlink", "proxy.proxier",
    "proxy.sources.kubeapi", "proxy.sources.statefile", "proxy.sources.hub", "proxy.k8s",
    "proxy.metrics", "proxy.commands.wiring", "proxy.commands.workers",
)
"""What serving needs and claiming does not: the modules (and packages) that took the time."""

CLAIM_RECORDER = """
import json, sys
from proxy import cli
from proxy.lifecycle.ownership import Ownership, OwnershipError

def claim(*args, **kwargs):
    print(json.dumps(sorted(sys.modules)))
    raise OwnershipError("refused by the test")

Ownership.acquire = claim
sys.exit(cli.main(sys.argv[1:]))
"""


def claimed_with(*argv: str) -> tuple[int, list[str], str]:
    """Run ``kpx ARGV`` up to its claim: (exit status, modules imported by then, stderr)."""
    res = subprocess.run([sys.executable, "-c", CLAIM_RECORDER, *argv], cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    lines = res.stdout.splitlines()
    return res.returncode, json.loads(lines[-1]) if lines else [], res.stderr


def heavy_among(modules: list[str]) -> list[str]:
    return [m for m in modules if any(m == h or m.startswith(h + ".") for h in HEAVY)]


def write_kubeconfig(path: Path, current: str = "kpx", user: dict[str, object] | None = None
                     ) -> Path:
    """A kubeconfig as kpx's DaemonSet mounts one (deploy/kpx.yaml): one context."""
    doc = {"apiVersion": "v1", "kind": "Config", "current-context": current,
           "clusters": [{"name": "c", "cluster": {"server": "https://127.0.0.1:6443"}}],
           "users": [{"name": "u", "user": user or {"token": "t0ken"}}],
           "contexts": [{"name": "kpx", "context": {"cluster": "c", "user": "u"}}]}
    path.write_text(json.dumps(doc), encoding="utf-8")
    return path


EXEC_USER = {"exec": {"apiVersion": "client.authentication.k8s.io/v1", "command": "true",
                      "interactiveMode": "Never"}}


@pytest.mark.parametrize("mode_args", [
    ("--state", "{state}", "--no-healthz"),
    ("--state", "{state}", "--proxy-mode", "nfqueue"),
    ("--state", "{state}", "--workers", "2"),
    ("--master", "https://127.0.0.1:6443"),
    ("--kubeconfig", "{kubeconfig}"),
    ("--kubeconfig", "{exec_kubeconfig}"),
], ids=["userspace", "nfqueue", "workers", "kubernetes-api", "kubeconfig", "kubeconfig-exec"])
def test_the_claim_comes_before_the_dataplane_healthz_and_the_http_client_are_imported(
        tmp_path: Path, mode_args: tuple[str, ...]) -> None:
    """A kubeconfig too (kpx's DaemonSet runs with one, as kubeadm's kube-proxy does):
    walking it needs the Kubernetes client library, which took about a second to import."""
    names = {"state": tmp_path / "state.yaml",
             "kubeconfig": write_kubeconfig(tmp_path / "token.conf"),
             "exec_kubeconfig": write_kubeconfig(tmp_path / "exec.conf", user=EXEC_USER)}
    argv = [a.format(**names) for a in mode_args]
    code, modules, stderr = claimed_with("node", "--hostname-override", "node1", *argv)
    assert code == 1 and "refused by the test" in stderr, stderr
    assert "proxy.commands.node" in modules  # the claim was reached through kpx node
    assert heavy_among(modules) == []


def test_bad_flags_are_refused_before_the_claim(tmp_path: Path) -> None:
    """Checking the flags early must not skip a check: no claim, status 2, the reason."""
    code, modules, stderr = claimed_with(
        "node", "--state", str(tmp_path / "state.yaml"), "--master", "https://127.0.0.1:6443")
    assert (code, modules) == (2, [])
    assert "--state excludes --kubeconfig and --master" in stderr


@pytest.mark.parametrize(("flags", "why"), [
    (("--healthz-bind-address", "1.2.3:abc"),
     "argument --healthz-bind-address: '1.2.3:abc': port 'abc' is not a number"),
    (("--metrics-bind-address", "[::1"), "argument --metrics-bind-address: '[::1': no closing"),
    (("--connect-timeout", "0"), "argument --connect-timeout: '0': must be > 0"),
    (("--sync-period=-1s",), "argument --sync-period: '-1s': must be > 0"),
    (("--sync-period", "nan"), "argument --sync-period"),
    (("--conntrack-tcp-timeout-established", "inf"), "--conntrack-tcp-timeout-established"),
    (("--workers", "0"), "--workers 0: must be at least 1"),
])
def test_a_flag_value_that_cannot_work_is_refused_before_the_claim(
        tmp_path: Path, flags: tuple[str, ...], why: str) -> None:
    """Each of these crashed after the claim (a traceback, the return path left behind),
    broke every connection (a connect timeout of 0), spun (a sync period of 0), or was
    quietly taken for another value (--workers 0)."""
    code, modules, stderr = claimed_with(
        "node", "--hostname-override", "node1", "--state", str(tmp_path / "s.yaml"), *flags)
    assert (code, modules) == (2, []), stderr
    assert why in stderr, stderr


CLAIM_GRANTED = """
import json, sys
from proxy import cli
from proxy.lifecycle.ownership import Ownership

class Claimed:
    def close(self):
        print("released", flush=True)

def claim(*args, **kwargs):
    print("claimed", flush=True)
    return Claimed()

Ownership.acquire = claim
sys.exit(cli.main(sys.argv[1:]))
"""


def test_a_kubeconfig_read_before_the_claim_is_walked_after_it(tmp_path: Path) -> None:
    """One that is not YAML is refused before the claim; one whose current context does not
    exist is refused after it (its contexts need the client library), still with status 2
    and the reason, and the claim is given back."""
    bad = tmp_path / "bad.conf"
    bad.write_text("{ not yaml", encoding="utf-8")
    code, modules, stderr = claimed_with("node", "--kubeconfig", str(bad))
    assert (code, modules) == (2, [])
    assert f"kubeconfig {bad}: not YAML" in stderr
    wrong = write_kubeconfig(tmp_path / "wrong.conf", current="nowhere")
    res = subprocess.run([sys.executable, "-c", CLAIM_GRANTED, "node", "--kubeconfig",
                          str(wrong)], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert res.returncode == 2, res.stderr
    assert res.stdout.split() == ["claimed", "released"]
    assert f"kubeconfig {wrong}" in res.stderr and "nowhere" in res.stderr


def test_kpx_node_help_needs_none_of_them() -> None:
    """``kpx node --help`` (what a DaemonSet's manifest is checked with) stays quick too."""
    script = ("import json, sys\nfrom proxy import cli\ntry:\n    cli.main(['node', '--help'])\n"
              "except SystemExit:\n    pass\nprint(json.dumps(sorted(sys.modules)))\n")
    res = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert "--handover-wait" in res.stdout
    assert heavy_among(json.loads(res.stdout.splitlines()[-1])) == []
