"""``kpx node``: its flags, their checks, and the claim on the network namespace.

Owns: the flags (named as kube-proxy names them), every check of them, the
open-file limit, and ``Ownership.acquire``. The claimed namespace then goes to
``proxy.commands.wiring``, which serves it.

Never: import the dataplane, the sources, healthz, the HTTP client or the
metrics registry before the claim. A restart is SIGTERM to the old kpx node
and a new one started at once. The old one keeps accepting for
``--handover-wait`` while it waits for the new one to ask for its listeners,
and the asking is ``Ownership.acquire``, here. Importing all of kpx takes most
of a second of CPU; on a busy node the successor asked after the old one had
given up, and new connections were refused until it bound its own
(docs/PERFORMANCE.md, "A restart's successor asks sooner"). So this module
imports only what checking the flags and claiming need, and a flag default
that a module below uses too comes from ``proxy.defaults``.
``tests/unit/test_node_command.py`` holds it to that.

Flags are checked before the claim: a successor with bad flags must never
take the listeners. A ``--kubeconfig`` is read before it too; its contexts
and credentials are worked out after, since that imports the Kubernetes
client library (``KubeConfig.prepare``). A successor whose kubeconfig turns
out wrong then exits before it says READY, and its predecessor, which
accepts until then, goes on accepting.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import math
import os
import resource
import socket
from collections.abc import Callable
from pathlib import Path

from proxy.core.addresses import parse_bind_address, parse_nodeport_addresses
from proxy.core.flows import UDP_TIMEOUT, UDP_TIMEOUT_STREAM
from proxy.defaults import (
    DEFAULT_BATCH_WAIT,
    DEFAULT_MAX_BYTES,
    MAX_BATCH_WAIT,
    TCP_TIMEOUT_CLOSE_WAIT,
    TCP_TIMEOUT_ESTABLISHED,
    UDP_FLOW_LIMIT,
)
from proxy.lifecycle.ownership import Ownership, OwnershipError
from proxy.nfqueue import conntrack
from proxy.nfqueue.rules import DEFAULT_QUEUE
from proxy.sources.kubeconfig import KubeConfig, KubeConfigError

log = logging.getLogger(__name__)

HANDOVER_WAIT = 2.0
"""``--handover-wait``: long enough for a successor started with the SIGTERM to
reach its handover request (a Python start and this module's imports: docs/PERFORMANCE.md,
"A restart's successor asks sooner"); short, because a stop with no successor keeps
accepting that long before it drains."""


def parse_duration(text: str) -> float:
    """Go-style durations as kube-proxy flags take them: ``30s``, ``1m``, ``500ms``, ``100us``,
    ``2``. The longer suffixes are tried first: ``100us`` also ends in ``s``."""
    units = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
    seconds = None
    for suffix in ("ns", "us", "µs", "ms", "s", "m", "h"):
        if text.endswith(suffix):
            seconds = float(text[: -len(suffix)]) * units[suffix]
            break
    if seconds is None:
        seconds = float(text)
    if not math.isfinite(seconds):  # "nan", "inf": no duration, and nan passes every check
        raise ValueError(f"{text!r}: not a finite duration")
    return seconds


PROXY_MODES = ("userspace", "nfqueue")
"""``--proxy-mode``: kube-proxy's flag name; userspace is the relay, nfqueue SYN-time decisions."""


def parse_timeout(text: str) -> float:
    """A duration that may be 0 (off, as kube-proxy's "leave as is") but not negative."""
    seconds = parse_duration(text)
    if seconds < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: must be >= 0 (0 turns it off)")
    return seconds


parse_timeout.__name__ = "duration"  # argparse names the type: "invalid duration value"


def parse_positive(text: str) -> float:
    """A duration above 0: a UDP flow that expires at once would re-pick every datagram."""
    seconds = parse_duration(text)
    if seconds <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: must be > 0")
    return seconds


parse_positive.__name__ = "duration"


def parse_flow_limit(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: not a whole number") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: must be at least 1")
    return n


parse_flow_limit.__name__ = "count"


def parse_cidrs(text: str) -> list[ipaddress.IPv4Network | ipaddress.IPv6Network]:
    try:
        return parse_nodeport_addresses(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e


def bind_address_flag(default_port: int) -> Callable[[str], tuple[str, int] | None]:
    """An argparse type for ``--*-bind-address``: ``(host, port)``, or None (empty:
    off). Parsed here, before the claim: a malformed one used to end ``kpx node`` with a
    traceback once it had installed its return path, and left that behind."""
    def parse(text: str) -> tuple[str, int] | None:
        try:
            return parse_bind_address(text, default_port)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    parse.__name__ = "IP:PORT"
    return parse


def add_max_bytes_flag(parser: argparse.ArgumentParser) -> None:
    """``--state-max-bytes``, shared by ``kpx node``, ``kpx healthz`` and ``kpx check``."""
    parser.add_argument(
        "--state-max-bytes", type=int, default=DEFAULT_MAX_BYTES, metavar="BYTES",
        help="refuse a state file larger than this (default 128 MiB; 30,000 NodePort"
        " services x 3 endpoints are 26 MB of kubectl-style YAML, 52 MB as a kind: List)",
    )


def add_node_flags(parser: argparse.ArgumentParser) -> None:
    """Flags shared by ``kpx node`` and ``kpx healthz``."""
    parser.add_argument(
        "--hostname-override",
        default=socket.gethostname(),
        help="this node's name: endpoints with this nodeName are local (default: hostname)",
    )
    parser.add_argument(
        "--state", type=Path, default=None,
        help="YAML file of v1 Node, v1 Service and discovery.k8s.io/v1 EndpointSlice objects"
        " (default: watch them in the Kubernetes API)",
    )
    parser.add_argument(
        "--kubeconfig", type=Path, default=None, metavar="PATH",
        help="kubeconfig for the API server (default: the in-cluster service account)",
    )
    parser.add_argument(
        "--master", default=None, metavar="URL",
        help="API server address; overrides the kubeconfig's server",
    )
    parser.add_argument(
        "--nodeport-addresses", type=parse_cidrs, default=[], metavar="CIDR,...",
        help="serve NodePorts only on node addresses inside these CIDRs (default: all)",
    )
    parser.add_argument(
        "--healthz-bind-address", default="0.0.0.0:10256", type=bind_address_flag(10256),
        metavar="IP:PORT",
        help="node /healthz and /livez (default 0.0.0.0:10256)",
    )
    parser.add_argument(
        "--metrics-bind-address", default="127.0.0.1:10249", type=bind_address_flag(10249),
        metavar="IP:PORT",
        help="/metrics, /proxyMode and (kpx node) /configz (default 127.0.0.1:10249)",
    )
    parser.add_argument(
        "--sync-period", type=parse_positive, default=30.0, metavar="DURATION",
        help="health turns bad when an update waits longer than twice this (default 30s)",
    )
    add_max_bytes_flag(parser)


def configure(parser: argparse.ArgumentParser) -> None:
    add_node_flags(parser)
    parser.add_argument(
        "--masquerade-all", action="store_true",
        help="SNAT every eTP=Cluster hop, also to endpoints on this node (iptables mode)",
    )
    parser.add_argument(
        "--cluster-cidr", type=parse_cidrs, default=[], metavar="CIDR,...",
        help="pod CIDRs: their NodePort traffic gets Cluster semantics, like detect-local-mode",
    )
    parser.add_argument("--no-healthz", action="store_true", help="do not run the healthz sidecar")
    parser.add_argument(
        "--no-transparent", action="store_true",
        help="never preserve the client IP (SNAT everything); no routing is installed",
    )
    parser.add_argument(
        "--shutdown-grace", type=parse_duration, default=10.0, metavar="DURATION",
        help="how long SIGTERM lets established connections drain (default 10s)",
    )
    parser.add_argument(
        "--handover-wait", type=parse_duration, default=HANDOVER_WAIT, metavar="DURATION",
        help="how long SIGTERM keeps the NodePorts accepting while waiting for a new kpx node"
        " to take them over; at most --shutdown-grace, 0: stop at once (default 2s)",
    )
    parser.add_argument(
        "--takeover-wait", type=parse_timeout, default=0.0, metavar="DURATION",
        help="when another kpx node serves this namespace, wait this long for it to stop and"
        " take its listeners over, instead of exiting at once (a DaemonSet's surge pod;"
        " default 0)",
    )
    parser.add_argument(
        "--proxy-mode", choices=PROXY_MODES, default="userspace",
        help="userspace: relay every connection (default); nfqueue: decide each SYN in"
        " Python, let conntrack DNAT forward the rest in the kernel",
    )
    parser.add_argument(
        "--conntrack-max-per-core", type=int, default=conntrack.CONNTRACK_MAX_PER_CORE,
        metavar="N", help="nfqueue mode: conntrack entries per CPU to make room for; 0 leaves"
        f" nf_conntrack_max as it is (default {conntrack.CONNTRACK_MAX_PER_CORE})",
    )
    parser.add_argument(
        "--conntrack-min", type=int, default=conntrack.CONNTRACK_MIN, metavar="N",
        help=f"nfqueue mode: at least this many conntrack entries (default"
        f" {conntrack.CONNTRACK_MIN})",
    )
    parser.add_argument(
        "--conntrack-tcp-be-liberal", action="store_true",
        help="nfqueue mode: set nf_conntrack_tcp_be_liberal=1, so that conntrack marks no"
        " out-of-window segment of a DNATed connection INVALID (such a segment misses its"
        " NAT and the node resets the connection); left as it is by default",
    )
    parser.add_argument(
        "--queue-num", type=int, default=DEFAULT_QUEUE, metavar="N",
        help=f"nfqueue mode: the NFQUEUE number SYNs are queued to (default {DEFAULT_QUEUE})",
    )
    parser.add_argument(
        "--queue-bypass", action="store_true",
        help="nfqueue mode: fail open (while no kpx reads the queue, SYNs pass undecided,"
        " hence un-DNATed) instead of the default fail-closed (they are dropped and retried)",
    )
    parser.add_argument(
        "--queue-batch-wait", type=parse_timeout, default=DEFAULT_BATCH_WAIT,
        metavar="DURATION",
        help="nfqueue mode: after SYNs came several at once (a busy node), let the next ones"
        " gather this long before reading them, so one wake-up decides a batch; a lone SYN"
        " never waits; 0: never wait (default 100us)",
    )
    parser.add_argument(
        "--workers", type=int, default=1, metavar="N",
        help="worker processes sharing the NodePorts via SO_REUSEPORT (default 1)",
    )
    parser.add_argument(
        "--connect-timeout", type=parse_positive, default=2.0, metavar="DURATION",
        help="upstream connect timeout per endpoint before trying another (default 2s)",
    )

    parser.add_argument(
        "--conntrack-tcp-timeout-established", type=parse_timeout,
        default=TCP_TIMEOUT_ESTABLISHED, metavar="DURATION",
        help="reset a connection idle (no byte either way) this long; 0: never (default 24h)",
    )
    parser.add_argument(
        "--conntrack-tcp-timeout-close-wait", type=parse_timeout,
        default=TCP_TIMEOUT_CLOSE_WAIT, metavar="DURATION",
        help="reset a half-closed connection (one side sent FIN) idle this long;"
        " 0: the established timeout applies (default 1h)",
    )
    parser.add_argument(
        "--conntrack-udp-timeout", type=parse_positive, default=UDP_TIMEOUT,
        metavar="DURATION",
        help="end a UDP flow that never got a reply after this long idle (default 30s)",
    )
    parser.add_argument(
        "--conntrack-udp-timeout-stream", type=parse_positive, default=UDP_TIMEOUT_STREAM,
        metavar="DURATION",
        help="end a UDP flow that got replies after this long idle (default 2m)",
    )
    parser.add_argument(
        "--udp-flow-limit", type=parse_flow_limit, default=UDP_FLOW_LIMIT, metavar="N",
        help="UDP flows held at once; a new one in a full table evicts the flow idle"
        f" the longest (default {UDP_FLOW_LIMIT}; each holds a socket)",
    )


def source_config(args: argparse.Namespace) -> Callable[[], KubeConfig] | None:
    """Where the state comes from, checked: None for ``--state``, else how to reach the API
    (``KubeConfig.prepare``: call it for the ``KubeConfig``).

    Raises ``KubeConfigError`` for flags that exclude each other or a
    kubeconfig that cannot be read; calling the answer raises it for one
    whose contexts or credentials are wrong. ``kpx node`` checks before the
    claim and calls after: walking a kubeconfig imports the Kubernetes client
    library, which took a restart's successor about a second before it could
    ask for the listeners.
    """
    if args.state is not None:
        if args.kubeconfig is not None or args.master is not None:
            raise KubeConfigError("--state excludes --kubeconfig and --master")
        return None
    return KubeConfig.prepare(args.kubeconfig, args.master)


def flag_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with ``kpx node``'s other flags (``source_config`` checks the
    source's), as its error line; None when nothing is."""
    if args.workers < 1:
        return f"--workers {args.workers}: must be at least 1"
    if args.proxy_mode == "nfqueue" and args.workers > 1:
        return "--workers: nfqueue mode decides SYNs in one process (one queue); use --workers 1"
    if not 0 <= args.queue_num <= 0xFFFF:
        return f"--queue-num {args.queue_num}: must be 0-65535"
    if args.queue_batch_wait > MAX_BATCH_WAIT:
        return (f"--queue-batch-wait {args.queue_batch_wait:g}s: at most"
                f" {MAX_BATCH_WAIT * 1000:g}ms (each gathered SYN waits this long)")
    return None


def raise_nofile_limit() -> None:
    """Every proxied connection holds two fds: take the hard limit, as kube-proxy's
    userspace mode did, instead of failing at the soft default of 1024."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (OSError, ValueError) as e:
            log.warning("cannot raise the open-file limit from %d to %d: %s", soft, hard, e)
    presize_fd_table()


FD_TABLE_PRESIZE_MAX = 65536
"""Fds the table is grown to at start, at most: 512 KiB of kernel memory per process."""


def presize_fd_table(limit: int | None = None) -> int:
    """Grow this process's fd table to the open-file limit now, while it has one thread.

    The kernel doubles a process's fd table when an fd lands past its end;
    in a process with several threads (the state loader's, for a big state)
    each doubling waits for an RCU grace period, 10-15 ms in which the
    thread that opened the fd, here the event loop binding listeners, is
    stuck. Placing one fd at the top once, single-threaded, makes the table
    its final size up front; every later open is a plain slot fill. Returns
    the size reached (0 if it could not be done, which only costs those stalls).
    """
    if limit is None:
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        limit = soft if soft != resource.RLIM_INFINITY else FD_TABLE_PRESIZE_MAX
    top = min(limit, FD_TABLE_PRESIZE_MAX) - 1
    if top < 3:
        return 0
    try:
        os.fstat(top)
    except OSError:
        pass  # free, as expected: fill it for a moment
    else:
        return top + 1  # in use (inherited?): the table is that big already; never clobber it
    try:
        fd = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return 0
    try:
        os.dup2(fd, top, inheritable=False)
        os.close(top)
    except OSError as e:
        log.debug("cannot presize the fd table to %d: %s", top + 1, e)
        return 0
    finally:
        os.close(fd)
    return top + 1


def run(args: argparse.Namespace) -> int:
    """Check the flags, claim the network namespace, then serve (one process or N workers).

    The claim comes before any port or routing is touched: a second
    ``kpx node`` here exits at once (status 1) naming the one that serves,
    instead of retrying its ports forever and deleting the routing the other
    one needs when it exits (``proxy.lifecycle.ownership``). When the one that serves
    is stopping (SIGTERM), this one takes over from it instead: it receives
    its listening sockets here and ``wiring.serve`` adopts them.
    """
    raise_nofile_limit()
    try:  # every flag is checked before anything touches the namespace
        source = source_config(args)
    except KubeConfigError as e:
        log.error("%s", e)
        return 2
    problem = flag_problem(args)
    if problem is not None:
        log.error("%s", problem)
        return 2
    try:
        # One process takes the old one's listening sockets over; --workers
        # cannot share them, so they wait for the owner name (and bind anew).
        ownership = Ownership.acquire(listeners=args.workers <= 1, standby=args.takeover_wait,
                                      queue=args.proxy_mode == "nfqueue",
                                      mode=args.proxy_mode)
    except OwnershipError as e:
        log.error("%s", e)
        return 1
    args.ownership = ownership
    try:
        try:  # a kubeconfig's contexts and credentials: the Kubernetes client library
            config = None if source is None else source()
        except KubeConfigError as e:
            log.error("%s", e)
            return 2
        # Only now the rest of kpx: the module docstring says why.
        from proxy.commands import wiring

        return wiring.serve_claimed(args, config)
    finally:
        ownership.close()
