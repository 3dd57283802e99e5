"""The ``kpx`` command: one entry point, one module per subcommand.

Owns: dispatch only. Each subcommand lives in the module that implements it
and exposes ``configure(parser)`` and ``run(args) -> int``. Modules are
imported only when their command runs, so ``kpx node`` never pays for
pyroute2 or matplotlib.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

COMMANDS: dict[str, tuple[str, str]] = {
    "node": ("proxy.commands.node", "run the NodePort dataplane (and healthz) on this node"),
    "check": ("proxy.commands.check", "validate a state file and print every problem"),
    "healthz": ("proxy.commands.healthz", "run the healthz sidecar alone"),
    "snapshot": ("proxy.commands.snapshot",
                 "write a cluster's nodes, services and endpoint slices as a state file"),
    "lab": ("lab.cli", "build and drive a multi-node network-namespace lab"),
    "demo": ("lab.demos", "narrated demos: local-drop, healthcheck, source-ip"),
    "bench": ("bench.cli", "benchmark kpx against the kernel, HAProxy and naive Python"),
}


def _usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: kpx COMMAND [ARGS...]", "", "commands:"]
    lines += [f"  {name:<{width}}  {text}" for name, (_, text) in COMMANDS.items()]
    lines += ["", "kpx COMMAND --help shows a command's flags."]
    return "\n".join(lines)


def setup_logging(verbosity: int) -> None:
    level = logging.DEBUG if verbosity > 1 else logging.INFO if verbosity == 1 else logging.WARNING
    logging.basicConfig(
        level=level,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"kpx: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[name][0])
    parser = argparse.ArgumentParser(prog=f"kpx {name}", description=COMMANDS[name][1])
    parser.add_argument(
        "-v", "--verbose", action="count", default=1,
        help="more logging (-vv for debug); default is info",
    )
    parser.add_argument("-q", "--quiet", action="store_true", help="warnings and errors only")
    module.configure(parser)
    args = parser.parse_args(rest)
    setup_logging(0 if args.quiet else args.verbose)
    try:
        return int(module.run(args) or 0)
    except KeyboardInterrupt:
        return 130
