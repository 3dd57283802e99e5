"""Client-IP preservation: IP_TRANSPARENT upstream sockets and their return path.

Owns: the routing that lets an upstream socket bound to the *client's*
address receive the backend's replies, in the namespace kpx runs in, and the
socket options of such a socket.

- nft table ``inet kpx_tproxy``: in prerouting at mangle priority, packets
  that belong to a transparent socket get the ``<mark>`` bit OR-ed in;
- ``ip rule add fwmark <mark>/<mark> lookup <table> pref <pref>`` and
  ``ip route add local 0.0.0.0/0 dev lo table <table>``: marked packets are
  delivered locally instead of being forwarded to the (non-local) client IP.

This is the kernel's TPROXY recipe (Documentation/networking/tproxy.rst,
kpx decision 4). It only works toward endpoints on this node, whose replies
route back through it; that is why cross-node hops SNAT.

Never: touch any namespace other than the current one, or anything that is
not ours (the table, rule and route are matched exactly when removed). A
failure at any step (no CAP_NET_ADMIN, no ``nft``, no ``nft_socket``) is one
warning and a fallback to SNAT for everything; it never stops the dataplane.

Why subprocesses and not pyroute2: the dataplane runs inside a uvloop event
loop, and pyroute2 0.9's synchronous ``IPRoute`` drives its own asyncio loop
(``run_until_complete`` refuses to run inside a running loop) while its
netlink endpoint cannot be created on uvloop at all ("cannot open a UDP
handle, invalid family 16"). ``ip`` and ``nft`` are required system tools
anyway, and this runs once at start and once at exit.
"""

from __future__ import annotations

import logging
import shutil
import socket
import subprocess
from dataclasses import dataclass

log = logging.getLogger(__name__)

IP_TRANSPARENT = 19
IP_BIND_ADDRESS_NO_PORT = 24

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
        f"    meta l4proto tcp socket transparent 1 meta mark set meta mark or {cfg.mark:#x}\n"
        f"  }}\n"
        f"}}\n"
    )


def _rule_args(cfg: RoutingConfig) -> list[str]:
    mark = f"{cfg.mark:#x}/{cfg.mark:#x}"
    return ["pref", str(cfg.rule_pref), "fwmark", mark, "lookup", str(cfg.table)]


def _run(argv: list[str], stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        argv, input=stdin, capture_output=True, text=True, timeout=_TIMEOUT, check=False
    )


def _check(argv: list[str], stdin: str | None = None) -> None:
    res = _run(argv, stdin)
    if res.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {res.stderr.strip() or f'exit {res.returncode}'}")


def transparent_capable() -> OSError | None:
    """None if this process may set IP_TRANSPARENT, else the error it got."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.setsockopt(socket.SOL_IP, IP_TRANSPARENT, 1)
    except OSError as exc:
        return exc
    finally:
        s.close()
    return None


class TransparentRouting:
    """The return-path routing of one kpx process, installed and removed once.

    ``install`` returns whether client-IP preservation is available; when it
    is not, the dataplane SNATs every connection.
    """

    def __init__(self, cfg: RoutingConfig | None = None) -> None:
        self.cfg = cfg or RoutingConfig()
        self.active = False

    def install(self) -> bool:
        try:
            exc = transparent_capable()
            if exc is not None:
                raise RuntimeError(f"setsockopt(IP_TRANSPARENT): {exc}")
            for tool in ("nft", "ip"):
                if shutil.which(tool) is None:
                    raise RuntimeError(f"{tool}: not found")
            _check(["nft", "-f", "-"], nft_ruleset(self.cfg))
            self._remove_rules()
            _check(["ip", "-4", "rule", "add", *_rule_args(self.cfg)])
            _check(
                ["ip", "-4", "route", "replace", "local", "0.0.0.0/0", "dev", "lo",
                 "table", str(self.cfg.table)]
            )
        except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
            log.warning(
                "client IP preservation unavailable, every connection will be SNATed: %s", exc
            )
            self._cleanup()
            self.active = False
            return False
        self.active = True
        log.info(
            "transparent return path installed: nft table inet %s, fwmark %#x/%#x -> table %d "
            "(pref %d)", self.cfg.nft_table, self.cfg.mark, self.cfg.mark, self.cfg.table,
            self.cfg.rule_pref,
        )
        return True

    def remove(self) -> None:
        if not self.active:
            return
        self.active = False
        self._cleanup()
        log.info("transparent return path removed")

    def _remove_rules(self) -> None:
        # Exact match on pref, mark and table: never delete someone else's rule.
        # Bounded: a crash loop could have left a few duplicates.
        for _ in range(16):
            if _run(["ip", "-4", "rule", "del", *_rule_args(self.cfg)]).returncode != 0:
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
                _run(["ip", "-4", "route", "flush", "table", str(self.cfg.table)])
        except (OSError, subprocess.SubprocessError) as exc:
            log.debug("transparent routing cleanup: %s", exc)


def upstream_socket(client_ip: str | None) -> socket.socket:
    """A non-blocking upstream socket; bound to ``client_ip`` when given.

    ``IP_BIND_ADDRESS_NO_PORT`` defers the source port choice to connect(),
    so the port space is per 4-tuple and not per client IP: one busy client
    behind eTP=Local would otherwise exhaust ~28k ports, TIME_WAIT included.
    """
    # SOCK_NONBLOCK: non-blocking from birth, one syscall fewer than setblocking().
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM | socket.SOCK_NONBLOCK)
    try:
        # A relay must not add Nagle delays to what it forwards.
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if client_ip is not None:
            s.setsockopt(socket.SOL_IP, IP_TRANSPARENT, 1)
            s.setsockopt(socket.SOL_IP, IP_BIND_ADDRESS_NO_PORT, 1)
            s.bind((client_ip, 0))
    except BaseException:
        s.close()
        raise
    return s
