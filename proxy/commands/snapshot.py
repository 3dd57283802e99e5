"""``kpx snapshot``: write the cluster's Nodes, Services and EndpointSlices as a state file.

Owns: the command line (``--kubeconfig``, ``--master`` as ``kpx node`` takes
them, ``-o``, ``--timeout``), checking the result the way ``kpx check``
would before anything is written, writing it atomically (or to stdout), and
the exit codes: 0 written, 1 the cluster could not be listed or its state is
one kpx refuses, 2 bad flags.

Never: print a traceback for a failure the user can fix (an unreachable
server, a 403, a bad kubeconfig): one line says what failed and why. The
listing itself is ``proxy.sources.snapshot``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
from collections.abc import Awaitable
from pathlib import Path
from typing import TypeVar

from proxy.k8s import StateError, parse_objects
from proxy.sources.kubeapi import PAGE_SIZE
from proxy.sources.kubeconfig import KubeConfig, KubeConfigError
from proxy.sources.snapshot import SnapshotError, render, take_snapshot

_T = TypeVar("_T")


def configure(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "List the Nodes (all of them) and the Services and EndpointSlices kube-proxy watches"
        " (its label selector: no headless services, no other proxy's), and write them as a"
        " state file for kpx check, kpx node --state and kpx lab up --from-state.")
    parser.add_argument(
        "--kubeconfig", type=Path, default=None, metavar="PATH",
        help="kubeconfig for the API server (default: the in-cluster service account)")
    parser.add_argument(
        "--master", default=None, metavar="URL",
        help="API server address; overrides the kubeconfig's server")
    parser.add_argument("-o", "--output", type=Path, default=None, metavar="FILE",
                        help="write the state file here (default: standard output)")
    parser.add_argument("--timeout", type=float, default=60.0, metavar="SECONDS",
                        help="give up on the API server after this long (default 60)")
    parser.add_argument("--page-size", type=int, default=PAGE_SIZE, metavar="N",
                        help=f"objects per list page (default {PAGE_SIZE}, as client-go)")


async def _bounded(work: Awaitable[_T], timeout: float) -> _T:
    async with asyncio.timeout(timeout):
        return await work


def run(args: argparse.Namespace) -> int:
    if args.timeout <= 0 or args.page_size < 1:
        print("kpx snapshot: --timeout and --page-size must be positive", file=sys.stderr)
        return 2
    try:
        config = KubeConfig.load(args.kubeconfig, args.master)
        objects = asyncio.run(_bounded(take_snapshot(config, args.page_size), args.timeout))
    except (KubeConfigError, SnapshotError) as e:
        print(f"kpx snapshot: {e}", file=sys.stderr)
        return 1
    except TimeoutError:
        print(f"kpx snapshot: no complete answer from the API server within {args.timeout:g}s",
              file=sys.stderr)
        return 1
    try:
        snap = parse_objects(objects)
    except StateError as err:
        for problem in err.problems:
            print(f"kpx snapshot: {problem}", file=sys.stderr)
        print(f"kpx snapshot: kpx would refuse this state ({len(err.problems)} problem(s));"
              " nothing written", file=sys.stderr)
        return 1
    text = render(objects)
    where = "standard output"
    if args.output is None:
        sys.stdout.write(text)
        sys.stdout.flush()
    else:
        try:
            _write_atomic(args.output, text)
        except OSError as e:
            print(f"kpx snapshot: {args.output}: {e.strerror or e}", file=sys.stderr)
            return 1
        where = str(args.output)
    kinds = [o.get("kind") for o in objects]
    print(f"kpx snapshot: {kinds.count('Node')} nodes, {kinds.count('Service')} services"
          f" ({len(snap.services)} proxied), {kinds.count('EndpointSlice')} endpoint slices"
          f" from {config.server} to {where}", file=sys.stderr)
    return 0


def _write_atomic(path: Path, text: str) -> None:
    """A reader (a ``kpx node --state`` polling the path) sees the old file or the new one."""
    fd, tmp = tempfile.mkstemp(dir=path.parent or ".", prefix=f".{path.name}.")
    try:
        os.fchmod(fd, 0o644)  # mkstemp's 0600 would hide it from a non-root reader
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
