"""The NFQUEUE floors (``nfq-floor``, ``nfq-pyfloor``) bind their queue for sure.

The bench starts a floor right after SIGKILLing kpx-nfq. A floor that sent its bind
and never read the kernel's answer ran on, unbound, whenever the queue was still
someone else's: every SYN of the run then went unanswered, and the bench could only
say "no answer after 30s". Each floor now asks for the answer, retries while another
socket holds the queue, and says "bound" only once the queue is its own.

Run in a namespace of its own (a queue's number is per namespace), with a holder
process that binds the queue first, as kpx-nfq's socket would.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.contenders import FLOOR_SOURCE, PYFLOOR_SOURCE
from tests.support.netns import fresh_netns

QUEUE = 7

HOLDER = f"""
import socket, sys, time
sys.path.insert(0, {str(PYFLOOR_SOURCE.parent)!r})
import nfqpyfloor
s = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 12)
s.bind((0, 0))
nfqpyfloor.configure(s, {QUEUE})
print("held", flush=True)
time.sleep(float(sys.argv[1]))
"""


@pytest.fixture
def netns() -> Iterator[str]:
    if os.geteuid() != 0:
        pytest.skip("needs root (a network namespace)")
    with fresh_netns("nfqfloor") as name:
        yield name


def floors(tmp_path: Path) -> list[list[str]]:
    """The readers to try: the Python floor, and the C one where there is a compiler."""
    readers = [[sys.executable, str(PYFLOOR_SOURCE)]]
    if shutil.which("cc") is not None:
        binary = tmp_path / "nfqfloor"
        subprocess.run(["cc", "-O2", "-o", str(binary), str(FLOOR_SOURCE)], check=True,
                       timeout=60)
        readers.append([str(binary)])
    return readers


def first_line(proc: subprocess.Popen[str], timeout: float) -> tuple[str, float]:
    """The first line ``proc`` writes to stderr, and when (monotonic)."""
    assert proc.stderr is not None
    os.set_blocking(proc.stderr.fileno(), False)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if line:
            return line.strip(), time.monotonic()
        if proc.poll() is not None:
            return (proc.stderr.read() or f"exited {proc.returncode}").strip(), time.monotonic()
        time.sleep(0.01)
    raise AssertionError(f"no line in {timeout}s")


def test_a_floor_binds_once_the_queue_is_free_and_not_before(
        netns: str, tmp_path: Path) -> None:
    for reader in floors(tmp_path):
        holder = subprocess.Popen(["ip", "netns", "exec", netns, sys.executable, "-c", HOLDER,
                                   "0.6"], stdout=subprocess.PIPE, text=True)
        floor = None
        try:
            assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
            held = time.monotonic()
            floor = subprocess.Popen(["ip", "netns", "exec", netns, *reader, str(QUEUE),
                                      "0xff", "80=1"], stderr=subprocess.PIPE, text=True)
            line, at = first_line(floor, 10)
            assert line == f"{Path(reader[-1]).stem}: queue {QUEUE} bound, 1 port(s)", line
            # Not while the holder had the queue: it sleeps 0.6 s after binding.
            assert at - held >= 0.55, f"{reader[-1]} said bound {at - held:.2f}s after the hold"
            holder.wait(5)
            assert floor.poll() is None, "the floor must go on reading"
        finally:
            holder.kill()
            holder.wait()
            if floor is not None:
                floor.kill()
                floor.wait()
