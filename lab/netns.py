"""Network-namespace primitives for the lab.

Owns: creating and removing named network namespaces (the ``ip netns``
convention: a bind mount under ``/run/netns``), entering one on the *calling
thread* only, creating sockets and netlink handles inside one, writing
sysctls inside one, running and spawning processes inside one, and finding
and killing every process that lives in one.

Never: change anything in the namespace the process started in (the host's
root namespace). Every helper that enters a namespace restores the thread's
original namespace before returning, and refuses to continue if it cannot:
a thread silently left inside a lab namespace would make every later call
act on the wrong network.

Why per-thread ``setns`` instead of ``ip netns exec`` or pyroute2's
``netns=``: both of those fork a process per operation, which is what made
naive labs take tens of seconds. ``setns(CLONE_NEWNET)`` only affects the
calling thread, a socket keeps the namespace it was created in for its whole
life, and ``/proc/sys/net`` shows the namespace of the thread that opens it.
So one thread can hop in, create what it needs (a netlink socket, a TCP
socket, a sysctl write) and hop out in microseconds.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import IO, Any

NETNS_RUN_DIR = Path("/run/netns")
CLONE_NEWNET = 0x40000000
_MS_BIND = 4096
_MS_REC = 16384
_MS_SHARED = 1 << 20
_MNT_DETACH = 2

_libc: ctypes.CDLL | None = None
_rundir_lock = threading.Lock()
_rundir_ready = False


class NetnsError(OSError):
    """A namespace operation failed; the message names the namespace."""


def _c() -> ctypes.CDLL:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    return _libc


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise NetnsError(err, f"{what}: {os.strerror(err)}")


def ns_path(name: str) -> Path:
    """Where ``ip netns`` keeps the bind mount for namespace *name*."""
    if not name or "/" in name or name in (".", ".."):
        raise ValueError(f"bad namespace name {name!r}")
    return NETNS_RUN_DIR / name


def exists(name: str) -> bool:
    return ns_path(name).exists()


def list_namespaces() -> list[str]:
    try:
        return sorted(os.listdir(NETNS_RUN_DIR))
    except FileNotFoundError:
        return []


def _ensure_rundir() -> None:
    """Make /run/netns a shared mount point, exactly as iproute2 does.

    Shared propagation is what lets a namespace bind-mounted by us be seen by
    processes in other mount namespaces (``ip netns exec`` makes one).
    """
    global _rundir_ready
    with _rundir_lock:
        if _rundir_ready:
            return
        NETNS_RUN_DIR.mkdir(parents=True, exist_ok=True)
        d = str(NETNS_RUN_DIR).encode()
        libc = _c()
        if libc.mount(b"", d, b"none", _MS_SHARED | _MS_REC, None) != 0:
            _check(libc.mount(d, d, b"none", _MS_BIND | _MS_REC, None), "bind /run/netns")
            _check(libc.mount(b"", d, b"none", _MS_SHARED | _MS_REC, None), "share /run/netns")
        _rundir_ready = True


def _setns(fd: int) -> None:
    _check(_c().setns(fd, CLONE_NEWNET), "setns")


@contextlib.contextmanager
def entered(name: str) -> Iterator[None]:
    """Run the body with the *calling thread* inside namespace *name*.

    Only this thread moves; other threads (an asyncio loop, pytest's timeout
    thread) are unaffected. On exit the thread goes back to where it was.
    """
    own = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    try:
        try:
            target = os.open(ns_path(name), os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            raise NetnsError(errno.ENOENT, f"network namespace {name!r} does not exist") from None
        try:
            _setns(target)
        finally:
            os.close(target)
        try:
            yield
        finally:
            try:
                _setns(own)
            except OSError as exc:  # pragma: no cover - would mean a broken kernel
                # Continuing here would run later code in a lab namespace.
                os.write(2, f"lab.netns: cannot restore namespace: {exc}\n".encode())
                os._exit(70)
    finally:
        os.close(own)


def create(name: str) -> None:
    """Create the named namespace without forking.

    The calling thread unshares into a fresh namespace, bind-mounts it under
    /run/netns (which keeps it alive), and goes straight back.
    """
    _ensure_rundir()
    path = ns_path(name)
    fd = os.open(path, os.O_RDONLY | os.O_CREAT | os.O_EXCL, 0)
    os.close(fd)
    own = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    try:
        libc = _c()
        try:
            _check(libc.unshare(CLONE_NEWNET), f"unshare for {name}")
        except OSError:
            path.unlink(missing_ok=True)
            raise
        try:
            rc = libc.mount(b"/proc/thread-self/ns/net", str(path).encode(), b"none", _MS_BIND,
                            None)
            err = ctypes.get_errno()
        finally:
            try:
                _setns(own)
            except OSError as exc:  # pragma: no cover
                os.write(2, f"lab.netns: cannot restore namespace: {exc}\n".encode())
                os._exit(70)
        if rc != 0:
            path.unlink(missing_ok=True)
            raise NetnsError(err, f"bind-mount namespace {name}: {os.strerror(err)}")
    finally:
        os.close(own)


def remove(name: str) -> bool:
    """Unmount and delete a named namespace. Returns False if it was absent.

    The kernel frees the namespace (and destroys its veths, which also removes
    their peers) once the last process and socket using it are gone.
    """
    path = ns_path(name)
    if not path.exists():
        return False
    _c().umount2(str(path).encode(), _MNT_DETACH)  # fails harmlessly if not mounted
    try:
        path.unlink()
    except FileNotFoundError:
        return False
    return True


def inode(name: str) -> tuple[int, int] | None:
    """(st_dev, st_ino) identifying the namespace, or None if absent."""
    try:
        st = os.stat(ns_path(name))
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino


def pids_in(names: Sequence[str]) -> dict[str, list[int]]:
    """Every process whose network namespace is one of *names*.

    This is how teardown finds processes even when the record of what was
    started is lost (a crashed ``kpx lab up``): it does not trust pids, it
    looks at where processes actually live.
    """
    wanted: dict[tuple[int, int], str] = {}
    for n in names:
        ident = inode(n)
        if ident is not None:
            wanted[ident] = n
    found: dict[str, list[int]] = {n: [] for n in names}
    if not wanted:
        return found
    me = os.getpid()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            st = os.stat(f"/proc/{entry}/ns/net")
        except OSError:
            continue
        name = wanted.get((st.st_dev, st.st_ino))
        if name is not None:
            found[name].append(int(entry))
    return found


def pid_alive(pid: int) -> bool:
    """True if *pid* exists and is not a zombie (a zombie no longer serves)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    state = stat.rsplit(b")", 1)[1].split()[0]
    return state not in (b"Z", b"X")


def pid_start_time(pid: int) -> int | None:
    """Kernel start time of *pid* (clock ticks since boot): guards against pid reuse."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    return int(stat.rsplit(b")", 1)[1].split()[19])


def kill_all(pids: Sequence[int], grace: float = 3.0) -> None:
    """SIGTERM every pid, wait up to *grace* seconds, then SIGKILL survivors."""
    live = [p for p in pids if pid_alive(p)]
    for p in live:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while live and time.monotonic() < deadline:
        _reap(live)
        live = [p for p in live if pid_alive(p)]
        if live:
            time.sleep(0.02)
    for p in live:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGKILL)
    deadline = time.monotonic() + 2.0
    while live and time.monotonic() < deadline:
        _reap(live)
        live = [p for p in live if pid_alive(p)]
        if live:
            time.sleep(0.01)


def _reap(pids: Sequence[int]) -> None:
    """Collect our own exited children so they stop looking alive as zombies."""
    for p in pids:
        with contextlib.suppress(ChildProcessError, OSError):
            os.waitpid(p, os.WNOHANG)


# --- doing things inside a namespace ---------------------------------------


def socket_in(ns: str, family: int = socket.AF_INET, type: int = socket.SOCK_STREAM,
              proto: int = 0) -> socket.socket:
    """A socket that lives in namespace *ns*, created from this process."""
    with entered(ns):
        return socket.socket(family, type, proto)


def iproute_in(ns: str) -> Any:
    """A pyroute2 ``IPRoute`` whose netlink socket lives in namespace *ns*.

    pyroute2 0.9 opens its netlink socket synchronously in the constructor, on
    the calling thread, so constructing it while entered binds it to *ns*
    without pyroute2's fork-per-socket ``netns=`` path.
    """
    from pyroute2 import IPRoute

    with entered(ns):
        return IPRoute()


def sysctl_in(ns: str, values: dict[str, str | int]) -> None:
    """Write sysctls (dotted names, ``net.*`` only) inside namespace *ns*.

    /proc/sys/net resolves against the namespace of the thread that opens the
    file, so the open must happen while entered. Anything outside ``net.`` is
    refused: it would be a host-wide setting.
    """
    with entered(ns):
        for key, value in values.items():
            if not key.startswith("net."):
                raise ValueError(f"refusing non-namespaced sysctl {key}")
            path = "/proc/sys/" + key.replace(".", "/")
            with open(path, "w") as f:
                f.write(f"{value}\n")


def sysctl_get(ns: str, key: str) -> str:
    with entered(ns), open("/proc/sys/" + key.replace(".", "/")) as f:
        return f.read().strip()


def exec_argv(ns: str, argv: Sequence[str]) -> list[str]:
    """The argv that runs *argv* inside *ns* (``ip netns exec`` execs, it does not fork)."""
    ns_path(ns)  # validates the name
    return ["ip", "netns", "exec", ns, *argv]


def run_in(ns: str, argv: Sequence[str], *, timeout: float | None = 10.0, check: bool = False,
           **kw: Any) -> subprocess.CompletedProcess[str]:
    """Run a command inside *ns* and capture its output as text."""
    kw.setdefault("capture_output", True)
    kw.setdefault("text", True)
    return subprocess.run(exec_argv(ns, argv), timeout=timeout, check=check, **kw)


def popen_in(ns: str, argv: Sequence[str], log_path: str | os.PathLike[str] | None = None,
             *, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    """Start a long-lived process inside *ns*, detached from our session.

    ``start_new_session`` means a Ctrl-C on the CLI or the end of the CLI
    process does not take lab processes with it; teardown kills them
    explicitly. Output goes to *log_path* (appended) so every lab process has
    a log someone can read.
    """
    out: IO[bytes] | int
    if log_path is not None:
        Path(log_path).parent.mkdir(parents=True, exist_ok=True)
        out = open(log_path, "ab")  # noqa: SIM115 - handed to the child, closed below
    else:
        out = subprocess.DEVNULL
    try:
        return subprocess.Popen(
            exec_argv(ns, argv), stdin=subprocess.DEVNULL, stdout=out,
            stderr=subprocess.STDOUT, start_new_session=True, env=env, close_fds=True,
        )
    finally:
        if not isinstance(out, int):
            out.close()
