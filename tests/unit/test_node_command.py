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


@pytest.mark.parametrize("mode_args", [
    ("--state", "{state}", "--no-healthz"),
    ("--state", "{state}", "--proxy-mode", "nfqueue"),
    ("--state", "{state}", "--workers", "2"),
    ("--master", "https://127.0.0.1:6443"),
], ids=["userspace", "nfqueue", "workers", "kubernetes-api"])
def test_the_claim_comes_before_the_dataplane_healthz_and_the_http_client_are_imported(
        tmp_path: Path, mode_args: tuple[str, ...]) -> None:
    argv = [a.format(state=tmp_path / "state.yaml") for a in mode_args]
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


def test_kpx_node_help_needs_none_of_them() -> None:
    """``kpx node --help`` (what a DaemonSet's manifest is checked with) stays quick too."""
    script = ("import json, sys\nfrom proxy import cli\ntry:\n    cli.main(['node', '--help'])\n"
              "except SystemExit:\n    pass\nprint(json.dumps(sorted(sys.modules)))\n")
    res = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert "--handover-wait" in res.stdout
    assert heavy_among(json.loads(res.stdout.splitlines()[-1])) == []
