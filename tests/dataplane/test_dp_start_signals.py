"""A stop or a re-read that comes while ``kpx node`` starts is handled, never its default.

``kpx node`` installs its transparent return path (an nft table, a fwmark rule and its
route table) when it makes its dataplane, then waits for its first state: up to
``--sync-period`` from an API server that does not answer. SIGTERM in that window ended
the process by the signal's default action, before any cleanup, and left all of it
behind; SIGHUP (the documented "read the state again") did the same. Each test runs a
real ``kpx node`` in a namespace of its own, pointed at an API server that refuses.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator

import pytest

from lab.common import wait_until
from tests.support.netns import REPO, fresh_netns, sh, stop_process

pytestmark = pytest.mark.lab


@pytest.fixture
def netns() -> Iterator[str]:
    if os.geteuid() != 0:
        pytest.skip("needs root (a network namespace)")
    with fresh_netns("startsig") as name:
        yield name


def return_path(ns: str) -> list[str]:
    """What kpx's return path leaves in ``ns``: its fwmark rules and its nft table."""
    rules = [ln for ln in sh("ip", "-n", ns, "rule").stdout.splitlines() if "fwmark" in ln]
    tables = sh("ip", "netns", "exec", ns, "nft", "list", "tables").stdout
    return rules + [ln for ln in tables.splitlines() if "kpx" in ln]


def starting(ns: str) -> subprocess.Popen[str]:
    """``kpx node`` waiting for a first state that cannot come, its return path in."""
    p = subprocess.Popen(
        ["ip", "netns", "exec", ns, sys.executable, "-m", "proxy", "node",
         "--hostname-override", "n1", "--master", "http://127.0.0.1:1", "--no-healthz"],
        cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: return_path(ns) or p.poll() is not None, 30,
                   what="kpx node to install its return path")
    except BaseException:
        stop_process(p, signal.SIGKILL)
        raise
    assert p.poll() is None, p.communicate()[1]
    return p


@pytest.mark.parametrize("first", [None, signal.SIGHUP], ids=["sigterm", "sighup-then-sigterm"])
def test_a_signal_while_waiting_for_the_first_state_is_handled_and_cleans_up(
        netns: str, first: signal.Signals | None) -> None:
    p = starting(netns)
    try:
        if first is not None:
            p.send_signal(first)  # a re-read, remembered for when the source runs
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=20)
    finally:
        stop_process(p, signal.SIGKILL)
    assert p.returncode == 0, err
    assert "stopped while waiting for the first state" in err
    assert return_path(netns) == []
