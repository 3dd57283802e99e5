"""Client-IP preservation: IP_TRANSPARENT upstream sockets and their return path.

Owns: the routing that lets an upstream socket bound to the *client's*
address receive the backend's replies, in the namespace kpx runs in, the socket
options of such a socket, and the closing of the TIME_WAIT sockets such
sockets leave once kpx no longer relays (``close_time_wait_legs``).

- nft table ``inet kpx_tproxy``: in prerouting at mangle priority, packets
  that belong to a transparent socket get the ``<mark>`` bit OR-ed in;
- ``ip rule add fwmark <mark>/<mark> lookup <table> pref <pref>`` and
  ``ip route add local 0.0.0.0/0 dev lo table <table>``: marked packets are
  delivered locally instead of being forwarded to the (non-local) client IP.

IPv6 has the same: ``ip -6 rule`` with the same mark, preference and table
number (the families' rule lists and tables are separate) and ``local ::/0
dev lo``; the ``inet`` nft table already marks both families. The IPv6
dataplane installs its family's (``RoutingConfig.family``); the table is
shared, so whichever family's part is missing, ``ensure`` rewrites it.

This is the kernel's TPROXY recipe (Documentation/networking/tproxy.rst,
kpx decision 4). It only works toward endpoints on this node, whose replies
route back through it; that is why cross-node hops SNAT.

The routing is the namespace's, not the process's: a successor started
while its predecessor drains shares it. So ``install`` only adds what is
missing (no delete-then-add window), ``remove`` runs only when no other kpx
is present (``proxy.lifecycle.ownership``), and ``ReturnPathGuard`` puts back, every
sync period, whatever something outside kpx deleted.

Never: touch any namespace other than the current one, or anything that is
not ours (the table, rule and route are matched exactly when removed), or
remove routing while another kpx process in the namespace is alive. A
failure at start (no CAP_NET_ADMIN, no ``nft``, no ``nft_socket``) is one
warning and a fallback to SNAT for everything; it never stops the dataplane.

Why subprocesses and not pyroute2: the dataplane runs inside a uvloop event
loop, and pyroute2 0.9's synchronous ``IPRoute`` drives its own asyncio loop
(``run_until_complete`` refuses to run inside a running loop) while its
netlink endpoint cannot be created on uvloop at all ("cannot open a UDP
handle, invalid family 16"). ``ip`` and ``nft`` are required system tools
anyway; they run at start, at exit, and once per sync period as the loop's
own subprocesses (the guard's check: no thread, the loop never waits).
"""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import os
import shutil
import socket
import struct
import subprocess
from collections.abc import Collection, Generator
from dataclasses import dataclass
from typing import NamedTuple, TypeVar, cast

from healthz.proxy_health import ProxyHealth
from proxy import metrics
from proxy.lifecycle.ownership import BASE_NAME, live_pids, routing_lock, routing_lock_async
from proxy.util import nlmsg, spawn
from proxy.util.nlmsg import (
    NLM_F_ACK,
    NLM_F_DUMP,
    NLM_F_REQUEST,
    NLMSG_DONE,
    NLMSG_ERROR,
    NLMSGHDR,
)

log = logging.getLogger(__name__)

T = TypeVar("T")

IP_TRANSPARENT = 19
IP_BIND_ADDRESS_NO_PORT = 24
IPV6_TRANSPARENT = 75

DEFAULT_MARK = 0x2000
"""One bit, OR-ed into the mark and matched under a mask, so kpx shares the mark
with others: kube-proxy owns 0x4000/0x8000, Calico the high 16 bits, Cilium
the 0x0F00 nibble."""
DEFAULT_TABLE = 7078
DEFAULT_RULE_PREF = 7078
"""After the ``local`` rule (0), before ``main`` (32766)."""
NFT_TABLE = "kpx_tproxy"

_TIMEOUT = 5.0


@dataclass(frozen=True, slots=True)
class RoutingConfig:
    """Where the return path lives; every value is overridable (future flags)."""

    mark: int = DEFAULT_MARK
    table: int = DEFAULT_TABLE
    rule_pref: int = DEFAULT_RULE_PREF
    nft_table: str = NFT_TABLE
    family: int = 4
    """Whose rule and route: ``ip -4`` or ``ip -6`` (the nft table is ``inet``: both)."""

    @property
    def ip_flag(self) -> str:
        return f"-{self.family}"

    @property
    def everywhere(self) -> str:
        return "0.0.0.0/0" if self.family == 4 else "::/0"


def nft_ruleset(cfg: RoutingConfig) -> str:
    """The nft transaction: create-or-replace the table in one atomic step.

    Declaring then deleting the table first makes a leftover from a crashed
    run disappear inside the same transaction, so there is no window without
    the rule and no "table exists" error.
    """
    return (
        f"table inet {cfg.nft_table}\n"
        f"delete table inet {cfg.nft_table}\n"
        f"table inet {cfg.nft_table} {{\n"
        f"  chain prerouting {{\n"
        f"    type filter hook prerouting priority mangle; policy accept;\n"
        f"    meta l4proto {{ tcp, udp }} socket transparent 1"
        f" meta mark set meta mark or {cfg.mark:#x}\n"
        f"  }}\n"
        f"}}\n"
    )


def _rule_args(cfg: RoutingConfig) -> list[str]:
    mark = f"{cfg.mark:#x}/{cfg.mark:#x}"
    return ["pref", str(cfg.rule_pref), "fwmark", mark, "lookup", str(cfg.table)]


class _Result(NamedTuple):
    """What one ``ip``/``nft`` run said."""

    returncode: int
    stdout: str
    stderr: str


Command = tuple[list[str], str | None]
"""argv and what to write to its stdin."""
Steps = Generator[Command, _Result, T]
"""A routing procedure written once, sans I/O: it yields the commands it needs
run and is sent their results. ``_drive`` runs them with ``subprocess`` (start,
exit, tests); ``_drive_async`` on the running loop with ``proxy.util.spawn``:
no thread (the guard's check, every sync period: see
``proxy.sources.statefile.INLINE_MAX_BYTES`` for why a thread costs every
connection) and no ``fork`` of a big process while the loop waits."""


def _run(argv: list[str], stdin: str | None = None) -> _Result:
    res = subprocess.run(
        argv, input=stdin, capture_output=True, text=True, timeout=_TIMEOUT, check=False
    )
    return _Result(res.returncode, res.stdout, res.stderr)


async def _run_async(argv: list[str], stdin: str | None = None) -> _Result:
    res = await spawn.run(argv, stdin, _TIMEOUT)
    return _Result(res.returncode, res.stdout, res.stderr)


def _drive(steps: Steps[T]) -> T:
    try:
        command = next(steps)
        while True:
            command = steps.send(_run(*command))
    except StopIteration as done:
        return cast(T, done.value)


async def _drive_async(steps: Steps[T]) -> T:
    try:
        command = next(steps)
        while True:
            command = steps.send(await _run_async(*command))
    except StopIteration as done:
        return cast(T, done.value)


def _checked(argv: list[str], stdin: str | None = None) -> Steps[None]:
    res = yield argv, stdin
    if res.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {res.stderr.strip() or f'exit {res.returncode}'}")


def transparent_capable(family: int = 4) -> OSError | None:
    """None if this process may set IP_TRANSPARENT (IPV6_TRANSPARENT), else the error it got."""
    try:
        s = socket.socket(socket.AF_INET if family == 4 else socket.AF_INET6, socket.SOCK_STREAM)
    except OSError as exc:  # no IPv6 in this kernel
        return exc
    try:
        if family == 4:
            s.setsockopt(socket.SOL_IP, IP_TRANSPARENT, 1)
        else:
            s.setsockopt(socket.IPPROTO_IPV6, IPV6_TRANSPARENT, 1)
    except OSError as exc:
        return exc
    finally:
        s.close()
    return None


PART_NFT = "nft_table"
PART_RULE = "rule"
PART_ROUTE = "route"
PARTS = (PART_NFT, PART_RULE, PART_ROUTE)
"""The pieces of the return path, as logs and the repair metric name them."""


def _nft_table_ok(listing: str, cfg: RoutingConfig) -> bool:
    """Does ``nft -j list table`` show our prerouting chain and its marking rule?

    Loose on purpose: another nft version may print the same rule with other
    detail, and a false "missing" would replace the table every sync period.
    """
    try:
        doc = json.loads(listing)
    except ValueError:
        return False
    items = doc.get("nftables", []) if isinstance(doc, dict) else []
    chains = {
        c["name"] for item in items if isinstance(c := item.get("chain"), dict)
        if c.get("hook") == "prerouting" and c.get("type") == "filter"
    }
    for item in items:
        rule = item.get("rule")
        if not isinstance(rule, dict) or rule.get("chain") not in chains:
            continue
        exprs = rule.get("expr", [])
        if not isinstance(exprs, list):
            continue
        marks = [json.dumps(e["mangle"]) for e in exprs if isinstance(e, dict) and "mangle" in e]
        if '"transparent"' in json.dumps(exprs) and any(str(cfg.mark) in m for m in marks):
            return True
    return False


def _rules_matching(listing: str, cfg: RoutingConfig) -> int:
    """How many rules in ``ip -j -4 rule show pref N`` are exactly ours."""
    count = 0
    for rule in json.loads(listing or "[]"):
        try:
            ours = (int(rule.get("fwmark", "0"), 16) == cfg.mark
                    and int(rule.get("fwmask", "0xffffffff"), 16) == cfg.mark
                    and str(rule.get("table")) == str(cfg.table))
        except (TypeError, ValueError):
            ours = False
        count += ours
    return count


def _route_ok(listing: str) -> bool:
    return any(
        r.get("type") == "local" and r.get("dst") in ("default", "0.0.0.0/0", "::/0")
        and r.get("dev") == "lo"
        for r in json.loads(listing or "[]")
    )


class TransparentRouting:
    """The return-path routing of one kpx process, shared with any other kpx in the namespace.

    ``install`` returns whether client-IP preservation is available; when it
    is not, the dataplane SNATs every connection. It adds only what is
    missing (``ensure``), so a successor installing while its predecessor
    drains never opens a window without the rule. ``remove`` leaves
    everything in place while another kpx process is present (``proxy.lifecycle.ownership``):
    whoever exits last cleans up. Every change holds the namespace's routing lock.
    """

    def __init__(self, cfg: RoutingConfig | None = None, base: str = BASE_NAME) -> None:
        self.cfg = cfg or RoutingConfig()
        self.base = base
        self.active = False
        self._rule_copies = 0

    @property
    def _option(self) -> str:
        return "IP_TRANSPARENT" if self.cfg.family == 4 else "IPV6_TRANSPARENT"

    def install(self) -> bool:
        try:
            exc = transparent_capable(self.cfg.family)
            if exc is not None:
                raise RuntimeError(f"setsockopt({self._option}): {exc}")
            for tool in ("nft", "ip"):
                if shutil.which(tool) is None:
                    raise RuntimeError(f"{tool}: not found")
            added = self.ensure()
        except (OSError, RuntimeError, ValueError, subprocess.SubprocessError) as exc:
            log.warning(
                "client IP preservation unavailable, every IPv%d connection will be SNATed: %s",
                self.cfg.family, exc,
            )
            self._remove_if_alone()
            self.active = False
            return False
        self.active = True
        log.info(
            "IPv%d transparent return path %s: nft table inet %s, fwmark %#x/%#x -> table %d "
            "(pref %d)", self.cfg.family, "installed" if added == list(PARTS) else
            f"in place (added: {', '.join(added) or 'nothing'})", self.cfg.nft_table,
            self.cfg.mark, self.cfg.mark, self.cfg.table, self.cfg.rule_pref,
        )
        return True

    def missing(self) -> list[str]:
        """The parts of the return path that are not (exactly) installed right now."""
        return _drive(self._missing_steps())

    def ensure(self) -> list[str]:
        """Add whatever part is missing, nothing else; return what was missing.

        Never deletes a part first: the nft table is (re)written by one
        atomic transaction, the rule is only added, the route is replaced in
        place. Raises RuntimeError if a part is still missing afterwards.
        Blocking (subprocesses): for start and exit; the loop uses ``ensure_async``.
        """
        with routing_lock(self.base):
            return _drive(self._ensure_steps())

    async def ensure_async(self) -> list[str]:
        """``ensure`` on the running loop: its subprocesses are the loop's, no thread."""
        async with routing_lock_async(self.base):
            return await _drive_async(self._ensure_steps())

    def _missing_steps(self) -> Steps[list[str]]:
        out: list[str] = []
        res = yield ["nft", "-j", "list", "table", "inet", self.cfg.nft_table], None
        if res.returncode != 0 and "No such file" not in res.stderr:
            raise RuntimeError(f"nft list table: {res.stderr.strip() or res.returncode}")
        if res.returncode != 0 or not _nft_table_ok(res.stdout, self.cfg):
            out.append(PART_NFT)
        res = yield ["ip", "-j", self.cfg.ip_flag, "rule", "show", "pref",
                         str(self.cfg.rule_pref)], None
        if res.returncode != 0:
            raise RuntimeError(f"ip rule show: {res.stderr.strip() or res.returncode}")
        self._rule_copies = _rules_matching(res.stdout, self.cfg)
        if self._rule_copies == 0:
            out.append(PART_RULE)
        res = yield ["ip", "-j", self.cfg.ip_flag, "route", "show", "table",
                     str(self.cfg.table)], None
        # An emptied table stops existing: "FIB table does not exist" is "missing".
        if res.returncode != 0 or not _route_ok(res.stdout):
            out.append(PART_ROUTE)
        return out

    def _ensure_steps(self) -> Steps[list[str]]:
        missing = yield from self._missing_steps()
        if PART_NFT in missing:
            yield from _checked(["nft", "-f", "-"], nft_ruleset(self.cfg))
        if PART_RULE in missing:
            yield from _checked(["ip", self.cfg.ip_flag, "rule", "add", *_rule_args(self.cfg)])
        if PART_ROUTE in missing:
            yield from _checked(["ip", self.cfg.ip_flag, "route", "replace", "local",
                                 self.cfg.everywhere, "dev", "lo", "table", str(self.cfg.table)])
        if self._rule_copies > 1:
            yield from self._drop_duplicate_rules()
        still = (yield from self._missing_steps()) if missing else []
        if still:
            raise RuntimeError(f"still missing after adding it: {', '.join(still)}")
        return missing

    def remove(self) -> None:
        if not self.active:
            return
        self.active = False
        if self._remove_if_alone():
            log.info("transparent return path removed")

    async def remove_left_behind(self) -> bool:
        """Remove a return path that another kpx left, unless one is present; True if removed.

        For nfqueue mode, which keeps the client IP by plain DNAT and installs
        none: a relay restarted into it leaves its return path while it drains
        (its successor is present), and the last one out is then the
        nfqueue-mode process. Only what is exactly kpx's is removed, as at a
        relay's own exit. The look is the loop's own subprocesses; the removal,
        under the routing lock, is a thread's.
        """
        missing = await _drive_async(self._missing_steps())
        if set(missing) == set(PARTS):
            return False
        return await asyncio.to_thread(self._remove_if_alone)

    def _remove_if_alone(self) -> bool:
        """Remove the routing unless another kpx in this namespace is present; True if removed."""
        with routing_lock(self.base):
            others = sorted(live_pids(self.base) - {os.getpid()})
            if others:
                log.info("transparent return path left in place: kpx pid %s in this namespace"
                         " still uses it", ", ".join(map(str, others)))
                return False
            self._cleanup()
        return True

    def _drop_duplicate_rules(self) -> Steps[None]:
        """A crash loop of an older kpx may have left copies; delete all but one.

        Each ``ip rule del`` removes one copy, so at least one stays throughout.
        """
        for _ in range(16):
            res = yield ["ip", "-j", self.cfg.ip_flag, "rule", "show", "pref",
                         str(self.cfg.rule_pref)], None
            if res.returncode != 0 or _rules_matching(res.stdout, self.cfg) <= 1:
                return
            yield ["ip", self.cfg.ip_flag, "rule", "del", *_rule_args(self.cfg)], None

    def _remove_rules(self) -> None:
        # Exact match on pref, mark and table: never delete someone else's rule.
        # Bounded: a crash loop could have left a few duplicates.
        for _ in range(16):
            if _run(["ip", self.cfg.ip_flag, "rule", "del",
                     *_rule_args(self.cfg)]).returncode != 0:
                return

    def _cleanup(self) -> None:
        """Best effort removal of everything ``install`` may have created.

        Quiet: after a failed install, the one warning has already been given.
        """
        try:
            if shutil.which("nft") is not None:
                _run(["nft", "delete", "table", "inet", self.cfg.nft_table])
            if shutil.which("ip") is not None:
                self._remove_rules()
                _run(["ip", self.cfg.ip_flag, "route", "flush", "table", str(self.cfg.table)])
        except (OSError, subprocess.SubprocessError) as exc:
            log.debug("transparent routing cleanup: %s", exc)


class ReturnPathGuard:
    """Every sync period, put back what is missing of the return path, as kube-proxy re-syncs.

    Anything outside kpx (an operator, another agent flushing rules) may
    delete the nft table, the rule or the route; without them every
    client-IP-preserving connection times out while the health checks still
    answer 200. The guard restores the missing parts, logs each repair and
    counts it (``kubeproxy_kpx_return_path_repairs_total{part}``); while a
    repair fails, ``ProxyHealth`` carries a fault, so ``/healthz``, ``/livez``
    and every healthCheckNodePort answer 503 and load balancers move away.

    Only the namespace's owner runs one; it is cancelled at SIGTERM. The
    subprocesses are the loop's own (``ensure_async``): no thread, nothing blocks.
    """

    FAULT = "return-path"

    def __init__(self, routing: TransparentRouting, health: ProxyHealth, period: float) -> None:
        self.routing = routing
        self.health = health
        self.period = period
        self.family: str | None = "IPv6" if routing.cfg.family == 6 else None
        """The IPv6 return path's fault is IPv6's only (``ProxyHealth`` family faults):
        its IPv4 traffic still flows; the IPv4 one stays unscoped, as before dual-stack."""

    async def check(self) -> list[str]:
        """One round: returns the parts that were missing and are now back."""
        try:
            restored = await self.routing.ensure_async()
        except Exception as exc:  # any failure means: cannot vouch for the return path
            metrics.RETURN_PATH_REPAIR_FAILURES.inc()
            why = str(exc) or type(exc).__name__
            if self.health.fault(self.FAULT, self.family) != why:
                log.error("IPv%d transparent return path broken and not restorable: %s;"
                          " client-IP preserving connections fail, so health fails until it"
                          " is back", self.routing.cfg.family, why)
            self.health.set_fault(self.FAULT, why, self.family)
            return []
        for part in restored:
            metrics.RETURN_PATH_REPAIRS.labels(part=part).inc()
        if restored:
            log.warning("transparent return path: %s was missing (removed outside kpx);"
                        " restored", ", ".join(restored))
        if self.health.fault(self.FAULT, self.family) is not None:
            log.info("transparent return path restored; healthy again")
            self.health.clear_fault(self.FAULT, self.family)
        return restored

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.period)
            await self.check()


def upstream_socket(client_ip: str | None, family: int = 4) -> socket.socket:
    """A non-blocking upstream socket of ``family``; bound to ``client_ip`` when given.

    ``IP_BIND_ADDRESS_NO_PORT`` defers the source port choice to connect(),
    so the port space is per 4-tuple and not per client IP: one busy client
    behind eTP=Local would otherwise exhaust ~28k ports, TIME_WAIT included.
    """
    # SOCK_NONBLOCK: non-blocking from birth, one syscall fewer than setblocking().
    s = socket.socket(socket.AF_INET if family == 4 else socket.AF_INET6,
                      socket.SOCK_STREAM | socket.SOCK_NONBLOCK)
    try:
        # A relay must not add Nagle delays to what it forwards.
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if client_ip is not None:
            if family == 4:
                s.setsockopt(socket.SOL_IP, IP_TRANSPARENT, 1)
            else:
                s.setsockopt(socket.IPPROTO_IPV6, IPV6_TRANSPARENT, 1)
            s.setsockopt(socket.SOL_IP, IP_BIND_ADDRESS_NO_PORT, 1)
            s.bind((client_ip, 0))
    except BaseException:
        s.close()
        raise
    return s


NETLINK_SOCK_DIAG = 4
SOCK_DIAG_BY_FAMILY = 20
SOCK_DESTROY = 21
TCP_TIME_WAIT = 6
_DIAG_REQ = struct.Struct("=BBBxI48s")
"""``inet_diag_req_v2``: family, protocol, extensions, states, and the socket's id."""
_DIAG_MSG = struct.Struct("=BBxx48s")
"""The start of ``inet_diag_msg``: family, state, timer, retransmits, the socket's id."""
_SOCKID = struct.Struct("!HH16s16s")
"""The start of ``inet_diag_sockid``: ports, then addresses (IPv4: the first 4 bytes)."""


def close_time_wait_legs(family: int, endpoints: Collection[tuple[str, int]]) -> int:
    """Close the TIME_WAIT sockets that the relay's client-IP connections left toward
    ``endpoints`` (``(address, port)`` of ``family``); returns how many were asked to close.

    Why: a relay connection to an endpoint is bound to the client's own
    address, so once it closes, its TIME_WAIT socket holds that client's
    address and port toward the endpoint for 60 s. A kpx restarted into
    nfqueue mode DNATs the same clients' new connections to the same
    endpoints, and their source ports come from the same ephemeral range:
    any that meets such a socket has its SYN-ACK taken by it (TCP's early
    demux finds the socket, and the kernel never forwards a packet that has
    one), so the client times out. Right after a busy relay, that was most
    of them, for a minute.

    Which: TCP sockets in TIME_WAIT whose peer is one of ``endpoints`` and
    whose own address is not one of this namespace's (only a transparent
    socket can have one). Nothing else is touched: a TIME_WAIT socket holds
    no data, and its connection is over.

    How: sock_diag spoken with ``struct`` (``_time_wait_legs``), each socket
    destroyed by the id the dump gave it. Not pyroute2's ``DiagSocket``: it
    decodes every socket of the dump into objects, about 0.1 ms each here,
    and this runs once a second while a relay drains, over the node's own
    TIME_WAIT sockets too. Blocking: run it off the event loop
    (``NfqueueDataplane.off_loop``). OSError when the kernel cannot close
    sockets this way (no ``CONFIG_INET_DIAG_DESTROY``).
    """
    if not endpoints:
        return 0
    af = socket.AF_INET if family == 4 else socket.AF_INET6
    size = 4 if family == 4 else 16
    wanted = {(socket.inet_pton(af, address), port) for address, port in endpoints}
    local: dict[bytes, bool] = {}
    closed = 0
    with _diag_socket() as sock:
        for sockid in _time_wait_legs(sock, af):
            _, dport, own, peer = _SOCKID.unpack_from(sockid)
            if (peer[:size], dport) not in wanted:
                continue
            if own not in local:
                local[own] = _is_local(socket.inet_ntop(af, own[:size]), af)
            if local[own]:
                continue
            destroy = _DIAG_REQ.pack(af, socket.IPPROTO_TCP, 0, 1 << TCP_TIME_WAIT, sockid)
            if closed == 0:
                # The first is acknowledged: a kernel without sock_diag's destroy
                # (CONFIG_INET_DIAG_DESTROY) refuses it, and that is an error to report,
                # not a count. The rest are not: one that expired meanwhile is the
                # kernel's ENOENT, left unread.
                code = _request(sock, SOCK_DESTROY, destroy, ack=True)
                if code == errno.ENOENT:
                    continue
                if code:
                    raise OSError(code, f"sock_diag destroy: {os.strerror(code)}")
            else:
                _request(sock, SOCK_DESTROY, destroy, ack=False)
            closed += 1
    return closed


def _diag_socket() -> socket.socket:
    """A NETLINK_SOCK_DIAG socket, bound, with a bound on every wait."""
    sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC,
                         NETLINK_SOCK_DIAG)
    sock.bind((0, 0))
    sock.settimeout(10)
    return sock


def _request(sock: socket.socket, kind: int, body: bytes, ack: bool) -> int:
    """Send one request; with ``ack``, wait for the kernel's answer: 0, or its errno."""
    sock.send(nlmsg.header(len(body), kind, NLM_F_REQUEST | (NLM_F_ACK if ack else 0)) + body)
    if not ack:
        return 0
    answer = sock.recv(4096)
    if NLMSGHDR.unpack_from(answer)[1] != NLMSG_ERROR:
        return 0
    return nlmsg.error_code(answer)


def _time_wait_legs(sock: socket.socket, af: int) -> list[bytes]:
    """The ids (``inet_diag_sockid``, as the kernel gave them) of this namespace's TCP
    sockets of ``af`` in TIME_WAIT: the kernel filters by state, this reads the rest."""
    dump = _DIAG_REQ.pack(af, socket.IPPROTO_TCP, 0, 1 << TCP_TIME_WAIT, b"\0" * 48)
    sock.send(nlmsg.header(len(dump), SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST | NLM_F_DUMP, 1) + dump)
    buf = bytearray(1 << 17)
    ids: list[bytes] = []
    while True:
        n = sock.recv_into(buf)
        off = 0
        while off + NLMSGHDR.size <= n:
            length, mtype = NLMSGHDR.unpack_from(buf, off)[:2]
            if length < NLMSGHDR.size or off + length > n:
                break
            if mtype == NLMSG_DONE:
                return ids
            if mtype == NLMSG_ERROR:
                code = nlmsg.error_code(buf, off)
                raise OSError(code, f"sock_diag dump: {os.strerror(code)}")
            if mtype == SOCK_DIAG_BY_FAMILY and length >= NLMSGHDR.size + _DIAG_MSG.size:
                fam, state, sockid = _DIAG_MSG.unpack_from(buf, off + NLMSGHDR.size)
                if fam == af and state == TCP_TIME_WAIT:
                    ids.append(sockid)
            off += (length + 3) & ~3


def _is_local(address: str, af: int) -> bool:
    """Whether ``address`` is this namespace's: a plain socket may bind it."""
    with socket.socket(af, socket.SOCK_DGRAM) as s:
        try:
            s.bind((address, 0))
        except OSError:
            return False
    return True

