"""Listener handover: a stopping kpx node passes its listening sockets, queues and all.

The old owner is a child process (``OLD`` below) that holds ownership and
listening sockets on loopback and never accepts, so whatever connects to
them stays queued in their backlogs; this test process is the successor.
Each test uses its own ownership base name, so it never meets a real kpx.
The dataplane tests run a Dataplane on loopback with inherited sockets.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from lab.common import wait_until
from proxy.lifecycle.ownership import Ownership, OwnershipError, live_pids, owner_pid
from proxy.proxier import Proxier
from proxy.userspace import synfilter
from proxy.userspace.dataplane import Dataplane
from tests.support.child import Child
from tests.support.loops import NODE, NODE_IP, free_port, peer_name, run_on, snap, web
from tests.support.wiring import sync_config

_n = itertools.count()

OLD = """
import asyncio, socket, sys
from proxy.commands.wiring import handed_on
from proxy.lifecycle.ownership import Ownership
base, count, window, ready = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4])
queue = sys.argv[5] == "queue"  # as nfqueue mode (handed_on), its sockets a queue's
own = Ownership.acquire(base)
socks = []
for _ in range(count):
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(16)
    socks.append(s)
print("ports", *[s.getsockname()[1] for s in socks], flush=True)

async def stop():
    loop = asyncio.get_running_loop()
    offer = own.offer(loop)
    while True:
        successor = await offer.wait(
            lambda want: handed_on(want, [(s.getsockname(), s) for s in socks]) if queue else
            [(s.getsockname(), s) for s in socks], window, ready)
        print("successor", successor.pid if successor else "none", flush=True)
        if successor is not None or sys.stdin.readline().strip() != "again":
            break
    for s in socks:
        s.close()
    if successor is not None:
        await successor.finish()
    else:
        own.release()
    print("released", flush=True)
    await loop.run_in_executor(None, sys.stdin.readline)  # "exit": still present until then
    offer.close()

assert sys.stdin.readline().strip() == "stop"
asyncio.run(stop())
own.close()
"""


@pytest.fixture
def base() -> str:
    return f"kpx-test-ho-{os.getpid()}-{next(_n)}"


class Old(Child):
    """The stopping owner, in a child process; ``say`` writes to its stdin."""

    def __init__(self, base: str, count: int = 1, window: float = 5.0,
                 ready: float = 5.0, queue: bool = False) -> None:
        super().__init__(OLD, base, str(count), str(window), str(ready),
                         "queue" if queue else "-")
        words = self.line().split()
        assert words[0] == "ports"
        self.ports = [int(p) for p in words[1:]]


@pytest.fixture
def old_factory(base: str) -> Iterator[type[Old]]:
    made: list[Old] = []

    class Made(Old):
        def __init__(self, *args: object, **kw: object) -> None:
            super().__init__(base, *args, **kw)  # type: ignore[arg-type]
            made.append(self)

    yield Made
    for o in made:
        o.stop()


def offering(base: str, pid: int) -> None:
    """Wait until ``pid`` offers its handover (the child binds it on "stop")."""
    path = f"{base}.handover.{pid}"

    def bound() -> bool:
        return any(line.split()[-1] == "@" + path
                   for line in Path("/proc/net/unix").read_text().splitlines()[1:]
                   if len(line.split()) >= 8)

    wait_until(bound, 5, 0.02, what="the handover offered")


def queued_client(port: int) -> socket.socket:
    """A connection that completes its handshake into the listener's accept queue."""
    c = socket.create_connection(("127.0.0.1", port), timeout=3)
    c.sendall(b"hello")
    return c


def test_listeners_and_their_queues_move_to_the_successor(
    base: str, old_factory: type[Old],
) -> None:
    # More than one sendmsg's worth (250) of descriptors.
    old = old_factory(count=300)
    queued = [queued_client(old.ports[i]) for i in (0, 150, 299)]
    try:
        old.say("stop")
        offering(base, old.proc.pid)
        own = Ownership.acquire(base, successor_wait=5.0)
        try:
            assert own.claim is not None and not own.owner
            got = own.claim.take_listeners()
            assert sorted(got) == sorted(("127.0.0.1", p) for p in old.ports)
            assert owner_pid(base) == old.proc.pid  # not ours until we serve

            async def take_over() -> bool:
                return await own.take_over(asyncio.sleep(0))

            assert asyncio.run(take_over())
            assert own.owner and owner_pid(base) == os.getpid()
            assert old.line() == f"successor {os.getpid()}"
            assert old.line() == "released"  # its copies are closed by now
            assert live_pids(base) == {old.proc.pid, os.getpid()}
            # The connections queued in the old one's backlog are ours to accept.
            for c, i in zip(queued, (0, 150, 299), strict=True):
                lis = got[("127.0.0.1", old.ports[i])]
                lis.settimeout(3)
                conn, addr = lis.accept()
                with conn:
                    assert addr == c.getsockname()
                    assert conn.recv(5) == b"hello"
            for s in got.values():
                s.close()
        finally:
            own.close()
        old.say("exit")
        assert old.proc.wait(5) == 0
    finally:
        for c in queued:
            c.close()


def test_a_second_instance_of_a_serving_owner_gets_nothing(
    base: str, old_factory: type[Old],
) -> None:
    old = old_factory()
    t0 = time.monotonic()
    with pytest.raises(OwnershipError, match=f"pid {old.proc.pid}"):
        Ownership.acquire(base, successor_wait=5.0)
    assert time.monotonic() - t0 < 0.5
    # Nothing to ask: no handover socket until the owner is told to stop.
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s, \
            pytest.raises(ConnectionRefusedError):
        s.connect(f"\0{base}.handover.{old.proc.pid}")
    assert live_pids(base) == {old.proc.pid}


def test_a_third_instance_during_a_handover_fails_fast(
    base: str, old_factory: type[Old],
) -> None:
    old = old_factory(count=2)
    old.say("stop")
    offering(base, old.proc.pid)
    own = Ownership.acquire(base, successor_wait=5.0)
    try:
        assert own.claim is not None
        t0 = time.monotonic()
        with pytest.raises(OwnershipError, match="already taking this network namespace over"):
            Ownership.acquire(base, successor_wait=5.0)
        assert time.monotonic() - t0 < 1.0
    finally:
        own.close()


def test_a_successor_that_dies_before_serving_leaves_the_old_one_accepting(
    base: str, old_factory: type[Old],
) -> None:
    old = old_factory(count=1, window=5.0)
    port = old.ports[0]
    old.say("stop")
    offering(base, old.proc.pid)
    first = Ownership.acquire(base, successor_wait=5.0)
    assert first.claim is not None
    first.close()  # gone before saying READY: the old one keeps its listeners
    with queued_client(port):  # still listening, still queueing
        second = Ownership.acquire(base, successor_wait=5.0)
        try:
            assert second.claim is not None
            got = second.claim.take_listeners()
            assert list(got) == [("127.0.0.1", port)]
            assert asyncio.run(second.take_over(asyncio.sleep(0)))
            assert old.line() == f"successor {os.getpid()}"
            got[("127.0.0.1", port)].settimeout(3)
            conn, _ = got[("127.0.0.1", port)].accept()
            conn.close()
            got[("127.0.0.1", port)].close()
        finally:
            second.close()


def test_no_successor_in_the_window_then_a_late_one_claims_the_released_name(
    base: str, old_factory: type[Old],
) -> None:
    old = old_factory(count=1, window=0.2)
    old.say("stop")
    assert old.line() == "successor none"
    old.say("done")
    assert old.line() == "released"
    # Present (draining) but no longer the owner: a new one just takes the name.
    own = Ownership.acquire(base, successor_wait=2.0)
    try:
        assert own.owner and own.claim is None
        assert live_pids(base) == {old.proc.pid, os.getpid()}
    finally:
        own.close()


def test_an_owner_passes_its_queue_only_to_a_successor_that_asks_for_it(
    base: str, old_factory: type[Old],
) -> None:
    """nfqueue mode passes the queue's socket: a successor that binds a queue of its own (a
    relay, an older kpx) would hold it bound and never read it. Such a one is told FREE,
    and the owner gives the namespace up at once instead of at the window's end."""
    old = old_factory(count=1, window=30.0, queue=True)
    old.say("stop")
    old.say("done")  # read once it has declined: then it releases the name
    offering(base, old.proc.pid)
    t0 = time.monotonic()
    own = Ownership.acquire(base, successor_wait=10.0)
    try:
        assert own.owner and own.claim is None, "no sockets: it waited for the name"
        assert time.monotonic() - t0 < 5.0, "the owner gave up at once, not after 30 s"
        assert old.line() == "successor none"
        assert old.line() == "released"
    finally:
        own.close()
    old.say("exit")
    assert old.proc.wait(5) == 0

    again = old_factory(count=1, window=30.0, queue=True)
    again.say("stop")
    offering(base, again.proc.pid)
    own = Ownership.acquire(base, successor_wait=10.0, queue=True)
    try:
        assert own.claim is not None
        assert list(own.claim.take_listeners()) == [("127.0.0.1", again.ports[0])]
    finally:
        own.close()


def test_an_nfqueue_mode_owner_serves_until_a_userspace_mode_successor_is_ready(
    base: str, old_factory: type[Old],
) -> None:
    """A relay successor binds its own listeners and removes the queueing rules before it
    says READY: the owner passes it nothing, and decides SYNs until then (it used to give
    the namespace up at once, and SYNs queued to nobody until the relay had started)."""
    old = old_factory(count=1, window=30.0, queue=True)
    old.say("stop")
    offering(base, old.proc.pid)
    own = Ownership.acquire(base, successor_wait=10.0, mode="userspace")
    try:
        assert own.claim is not None and not own.owner, "a handover, not the name"
        assert own.claim.take_listeners() == {}
        assert owner_pid(base) == old.proc.pid, "the owner still serves until READY"

        async def take_over() -> bool:
            return await own.take_over(asyncio.sleep(0))

        assert asyncio.run(take_over())
        assert old.line() == f"successor {os.getpid()}"
        assert old.line() == "released"
        assert own.owner and owner_pid(base) == os.getpid()
    finally:
        own.close()
    old.say("exit")
    assert old.proc.wait(5) == 0


# -- the dataplane adopts inherited sockets -------------------------------------------


def _filter_len(sock: socket.socket) -> int:
    """Instructions in the socket's classic BPF filter (0: none)."""
    return len(sock.getsockopt(socket.SOL_SOCKET, 26, 1024))  # SO_GET_FILTER


def _listening(port: int, program: list[synfilter.Instruction] | None) -> socket.socket:
    """A wildcard listener as an old kpx node leaves it (maybe with its SYN filter)."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", port))
    if program is not None:
        synfilter.attach(s, program)
    s.listen(16)
    return s


@pytest.mark.usefixtures("relay_kind")  # both relays: conftest.py
def test_dataplane_adopts_inherited_listeners_and_their_queues(backends) -> None:
    be = backends()
    np_, unwanted = free_port(), free_port()
    # The old one was dropping external SYNs on this port; the new plan serves.
    inherited = _listening(np_, synfilter.syn_drop_program((NODE_IP,)))
    other = _listening(unwanted, None)
    early = socket.create_connection((NODE_IP, np_), timeout=3)  # queued before adoption
    inherited_fd = inherited.fileno()

    async def scenario() -> None:
        dp = Dataplane(loop=asyncio.get_running_loop(), inherited={
            ("0.0.0.0", np_): inherited, ("0.0.0.0", unwanted): other})
        px = Proxier(sync_config(NODE), dataplane=dp)
        try:
            assert not dp.synced.is_set()
            px.sync(snap(*web(np_, be.port)))
            await asyncio.wait_for(dp.synced.wait(), 5)
            assert dp.listeners() == [("0.0.0.0", np_, "serving")]
            [(key, sock)] = dp.listening_sockets()
            assert key == ("0.0.0.0", np_) and sock is inherited  # adopted, not bound anew
            assert sock.fileno() == inherited_fd
            assert _filter_len(sock) == 0  # the old one's filter is gone
            assert other.fileno() == -1  # not wanted: closed after the first sync

            def queued_peer() -> str:
                early.sendall(b"PEER\n")
                return early.recv(100).decode().split()[0]

            assert await asyncio.to_thread(queued_peer) == "b"
            with pytest.raises(ConnectionRefusedError):
                await asyncio.to_thread(socket.create_connection, (NODE_IP, unwanted), 2)

            # eTP=Local, no local endpoint: the adopted socket takes the filter.
            px.sync(snap(*web(np_, be.port, etp="Local", ep_node="n2"), generation=2))
            assert dp.listeners() == [("0.0.0.0", np_, "dropping")]
            assert _filter_len(sock) > 0
        finally:
            dp.close()
            early.close()

    run_on("uvloop", scenario)


@pytest.mark.usefixtures("relay_kind")  # both relays: conftest.py
def test_dataplane_sets_its_own_filter_on_an_inherited_unfiltered_socket(backends) -> None:
    be = backends()
    np_ = free_port()
    inherited = _listening(np_, None)

    async def scenario() -> None:
        dp = Dataplane(loop=asyncio.get_running_loop(),
                       inherited={("0.0.0.0", np_): inherited})
        px = Proxier(sync_config(NODE), dataplane=dp)
        try:
            px.sync(snap(*web(np_, be.port, etp="Local", ep_node="n2")))
            assert dp.listeners() == [("0.0.0.0", np_, "dropping")]
            assert _filter_len(inherited) > 0
        finally:
            dp.close()
        assert inherited.fileno() == -1

    run_on("asyncio", scenario)


@pytest.mark.usefixtures("relay_kind")  # both relays: conftest.py
def test_an_inherited_socket_for_another_address_is_closed_and_bound_anew(backends) -> None:
    """A socket whose name is not its key is never served as that key."""
    be = backends()
    np_ = free_port()
    wrong = socket.socket()
    wrong.bind(("127.0.0.1", 0))
    wrong.listen(4)

    async def scenario() -> None:
        dp = Dataplane(loop=asyncio.get_running_loop(),
                       inherited={("0.0.0.0", np_): wrong})
        px = Proxier(sync_config(NODE), dataplane=dp)
        try:
            px.sync(snap(*web(np_, be.port)))
            assert dp.listeners() == [("0.0.0.0", np_, "serving")]
            [(_, sock)] = dp.listening_sockets()
            assert sock is not wrong and wrong.fileno() == -1
            assert await asyncio.to_thread(peer_name, np_) == "b"
        finally:
            dp.close()

    run_on("asyncio", scenario)
