"""``kpx check PATH``: validate a state file and print every problem.

Owns: the ``check`` command, its flags and its exit codes (0 good, 1 refused,
2 missing).

Never: read the file any other way than ``kpx node`` does. It goes through
``proxy.sources.statefile.read_state`` (regular files only, ``--state-max-bytes``) and
``proxy.k8s.decode_state``, so ``kpx check`` accepts exactly what the source
would publish: a FIFO or ``/dev/zero`` at the path is refused here too,
instead of hanging or filling memory.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from proxy.commands.node import add_max_bytes_flag
from proxy.k8s import StateError, decode_state, parse_state
from proxy.sources.statefile import StateReadError, StateUnstable, read_state


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("path", type=Path, help="state file: Node, Service and EndpointSlice YAML")
    add_max_bytes_flag(parser)


def run(args: argparse.Namespace) -> int:
    try:
        data, _key = read_state(args.path, args.state_max_bytes)
    except FileNotFoundError as e:
        print(f"{args.path}: {e.strerror or e}", file=sys.stderr)
        return 2
    except (StateReadError, StateUnstable) as e:
        print(f"{e}", file=sys.stderr)
        return 1
    try:
        snap = parse_state(decode_state(data))
    except StateError as err:
        for problem in err.problems:
            print(f"{args.path}: {problem}", file=sys.stderr)
        print(f"{args.path}: {len(err.problems)} problem(s); file refused", file=sys.stderr)
        return 1
    proxied = [s for s in snap.services if s.type in ("NodePort", "LoadBalancer")]
    print(
        f"{args.path}: ok: {len(snap.nodes)} nodes, {len(snap.services)} services "
        f"({len(proxied)} with NodePorts), {len(snap.slices)} endpoint slices"
    )
    return 0
