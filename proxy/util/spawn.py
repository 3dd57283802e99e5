"""Run a short command from the event loop without the loop's own subprocess spawn.

Owns: one child process per call: started with ``subprocess.Popen`` (which
spawns with ``vfork``), its pipes and its exit (a pidfd) watched by the
running loop, its stdin written and its output gathered as the pipes allow.

Never: start a thread, block the loop on the child, or leave a zombie,
an fd or a watcher behind (timeout and cancellation included).

Why not ``asyncio.create_subprocess_exec``: on uvloop it is libuv's
``uv_spawn``, which ``fork()``s, and a fork copies the page tables of the
whole process while the loop waits. kpx holding 50,000 services spends
about 20 ms in each spawn (docs/PERFORMANCE.md, "Service VIPs"), and a VIP
change or a guard check runs several ``ip``/``nft`` commands: every
connection and health probe waits that long. ``Popen``'s ``vfork`` costs
under 1 ms however big the process is. Linux only (``os.pidfd_open``, 5.3+).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
from typing import NamedTuple

from proxy.util.background import WORKER_NICE

CHUNK = 1 << 16


class Result(NamedTuple):
    returncode: int
    stdout: str
    stderr: str


# Every child runs at the background workers' nice value (``WORKER_NICE``): an ``nft``
# or ``ip -batch`` of 50,000 lines burns a few hundred ms of CPU, which the relay's
# loop (and its state parser) should win on a small node. Not SCHED_IDLE, as it once
# was: that yields to every task on the node, so where pods kept the CPUs busy a child
# got next to none of them and a rule change ran into its timeout.


async def run(argv: list[str], stdin: str | None = None, timeout: float = 10.0) -> Result:
    """Run ``argv`` to completion on the running loop; text in, text out.

    Raises ``subprocess.TimeoutExpired`` (the child killed and reaped) after
    ``timeout`` seconds, and OSError if it cannot be started.
    """
    loop = asyncio.get_running_loop()
    proc = subprocess.Popen(
        argv, stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    # Here and not in the child (a preexec_fn would make Popen fork): within
    # microseconds of its start, before it has done any real work.
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, proc.pid, WORKER_NICE)
    assert proc.stdout is not None and proc.stderr is not None
    pidfd = os.pidfd_open(proc.pid)
    done: asyncio.Future[None] = loop.create_future()
    out_fd, err_fd = proc.stdout.fileno(), proc.stderr.fileno()
    out: dict[int, list[bytes]] = {out_fd: [], err_fd: []}
    reading = set(out)
    exited = False
    data = memoryview((stdin or "").encode())
    sent = 0
    stdin_fd = proc.stdin.fileno() if proc.stdin is not None else -1

    def finish_if_done() -> None:
        if exited and not reading and not done.done():
            done.set_result(None)

    def on_read(fd: int) -> None:
        try:
            chunk = os.read(fd, CHUNK)
        except BlockingIOError:
            return
        if chunk:
            out[fd].append(chunk)
            return
        loop.remove_reader(fd)
        reading.discard(fd)
        finish_if_done()

    def close_stdin() -> None:
        nonlocal stdin_fd
        if stdin_fd >= 0:
            loop.remove_writer(stdin_fd)
            assert proc.stdin is not None
            proc.stdin.close()
            stdin_fd = -1

    def on_write() -> None:
        nonlocal sent
        try:
            sent += os.write(stdin_fd, data[sent:sent + CHUNK])
        except BlockingIOError:
            return
        except OSError:  # EPIPE: it stopped reading; its exit status will say why
            close_stdin()
            return
        if sent >= len(data):
            close_stdin()

    def on_exit() -> None:
        nonlocal exited
        loop.remove_reader(pidfd)
        exited = True
        finish_if_done()

    try:
        for fd in out:
            os.set_blocking(fd, False)
            loop.add_reader(fd, on_read, fd)
        if stdin_fd >= 0:
            os.set_blocking(stdin_fd, False)
            if data:
                loop.add_writer(stdin_fd, on_write)
            else:
                close_stdin()
        loop.add_reader(pidfd, on_exit)
        try:
            async with asyncio.timeout(timeout):
                await done
        except TimeoutError:
            proc.kill()
            raise subprocess.TimeoutExpired(argv, timeout) from None
    finally:
        close_stdin()
        for fd in reading:
            loop.remove_reader(fd)
        if not exited:
            loop.remove_reader(pidfd)
        os.close(pidfd)
        proc.stdout.close()
        proc.stderr.close()
        if not exited:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
        proc.wait()  # exited (or killed just now): no zombie, and it does not block for long
    return Result(proc.returncode, b"".join(out[out_fd]).decode(errors="replace"),
                  b"".join(out[err_fd]).decode(errors="replace"))
