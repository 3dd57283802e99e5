"""``SkLookup`` on a kernel that charges BPF to RLIMIT_MEMLOCK (before Linux 5.11).

Such a kernel answers a map or program over the limit with EPERM; kpx then
raises the limit, as libbpf does, and builds everything again. This kernel
charges the memory cgroup instead, so ``bpf(2)`` is replaced by a fake that
refuses the program with EPERM while the limit is too low (after both maps
were made), and ``setrlimit`` by one that records; the fds the fake hands
out are real (``/dev/null``), so ``close`` is checked too. The real
construction is proved by the dataplane's VIP tests.
"""

from __future__ import annotations

import errno
import os
import resource
from collections.abc import Callable

import pytest

from proxy.userspace import sklookup
from proxy.userspace.sklookup import SkLookup

INF = resource.RLIM_INFINITY


class OldKernel:
    """``bpf(2)`` and the memlock limit of a 5.10 kernel, as far as SkLookup sees them."""

    def __init__(self, soft: int, hard: int, may_raise: Callable[[int], bool]) -> None:
        self.limits = (soft, hard)
        self.may_raise = may_raise
        """Whether a new hard limit is allowed (CAP_SYS_RESOURCE raises it at all)."""
        self.needed = INF
        """The soft limit at which the maps and the program fit."""
        self.fds: list[int] = []
        self.refused = 0

    def bpf(self, cmd: int, attr: bytes) -> int:
        # The two maps fit; the program (the third call) goes over a too-low limit,
        # so a refused attempt leaves fds behind for SkLookup to close.
        limited = self.limits[0] != INF and (self.needed == INF or self.limits[0] < self.needed)
        if limited and cmd == sklookup.BPF_PROG_LOAD:
            self.refused += 1
            raise OSError(errno.EPERM, f"bpf({cmd}): {os.strerror(errno.EPERM)}")
        fd = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
        self.fds.append(fd)
        return fd

    def getrlimit(self, what: int) -> tuple[int, int]:
        assert what == resource.RLIMIT_MEMLOCK
        return self.limits

    def setrlimit(self, what: int, limits: tuple[int, int]) -> None:
        assert what == resource.RLIMIT_MEMLOCK
        soft, hard = limits
        if hard != self.limits[1] and not self.may_raise(hard):
            raise ValueError("not allowed to raise the hard limit")
        self.limits = (soft, hard)

    def open_fds(self) -> list[int]:
        """The fds handed out that are still open (a closed number may be handed out again)."""
        out = []
        for fd in sorted(set(self.fds)):
            try:
                os.fstat(fd)
            except OSError:
                continue
            out.append(fd)
        return out


@pytest.fixture
def kernel(monkeypatch: pytest.MonkeyPatch) -> Callable[..., OldKernel]:
    def make(soft: int = 64 << 10, hard: int = 64 << 10,
             may_raise: Callable[[int], bool] = lambda _hard: True) -> OldKernel:
        k = OldKernel(soft, hard, may_raise)
        monkeypatch.setattr(sklookup, "_bpf", k.bpf)
        monkeypatch.setattr(sklookup.resource, "getrlimit", k.getrlimit)
        monkeypatch.setattr(sklookup.resource, "setrlimit", k.setrlimit)
        return k
    return make


@pytest.mark.parametrize("family", [4, 6])
def test_a_privileged_kpx_lifts_the_limit_and_builds(
        kernel: Callable[..., OldKernel], family: int) -> None:
    k = kernel()
    sk = SkLookup(family)
    try:
        assert k.limits == (INF, INF)
        assert k.refused == 1, "refused once, then built whole"
        # The refused attempt's maps were closed, not kept beside the new ones.
        assert k.open_fds() == sorted([sk.pairs_fd, sk.sockmap_fd, sk.prog_fd, sk.link_fd])
    finally:
        sk.close()
    assert k.open_fds() == []


def test_without_cap_sys_resource_the_soft_limit_goes_to_the_hard_one(
        kernel: Callable[..., OldKernel]) -> None:
    k = kernel(soft=64 << 10, hard=64 << 20, may_raise=lambda _hard: False)
    k.needed = 32 << 20
    sk = SkLookup(4)
    sk.close()
    assert k.limits == (64 << 20, 64 << 20)


def test_a_limit_that_cannot_be_raised_is_the_kernel_s_error_and_leaks_nothing(
        kernel: Callable[..., OldKernel]) -> None:
    k = kernel(soft=64 << 10, hard=64 << 10, may_raise=lambda _hard: False)
    with pytest.raises(OSError) as caught:
        SkLookup(4)
    assert caught.value.errno == errno.EPERM
    assert k.limits == (64 << 10, 64 << 10)
    assert k.open_fds() == []


def test_an_unlimited_process_is_not_retried(
        kernel: Callable[..., OldKernel], monkeypatch: pytest.MonkeyPatch) -> None:
    """EPERM with no memlock limit is a missing CAP_BPF: one attempt, the error as is."""
    k = kernel(soft=INF, hard=INF)

    def refuse(cmd: int, attr: bytes) -> int:
        k.refused += 1
        raise OSError(errno.EPERM, "no CAP_BPF")

    monkeypatch.setattr(sklookup, "_bpf", refuse)
    with pytest.raises(OSError, match="no CAP_BPF"):
        SkLookup(4)
    assert k.refused == 1
