"""Run one Dataplane in its own process, as ``kpx node`` would, for the tests.

Started by ``tests.support.driver.Driver`` as ``python -m
tests.support.driver_process`` from the repository root.

Reads Kubernetes YAML through ``proxy.k8s.parse_state``, re-applies whenever
the file changes (polled every 50 ms), and writes a JSON status file after
every apply: generation, listeners, whether transparent mode is active.
SIGTERM runs the real shutdown sequence: stop_accepting, drain, close.

``--hog-fds`` opens /dev/null until EMFILE after start (the EMFILE test);
a "FREE" line on stdin closes them again.

Refuses ``--transparent`` unless it runs in a ``kd*`` namespace: the
return-path routing must only ever be installed in a namespace a test made.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import resource
import signal
import sys
from pathlib import Path

import uvloop

from lab.common import write_atomic
from proxy.k8s import StateError, parse_state
from proxy.proxier import Proxier
from proxy.userspace.dataplane import Dataplane
from proxy.userspace.vips import LocalVIPs
from tests.support.wiring import sync_config


def in_test_netns() -> bool:
    """True if this process runs in a ``kd*`` namespace made by the tests."""
    me = os.stat("/proc/self/ns/net")
    run = Path("/run/netns")
    return any(
        (st := os.stat(p)).st_ino == me.st_ino and st.st_dev == me.st_dev
        for p in (run.glob("kd*") if run.is_dir() else ())
    )


def write_status(path: Path, dp: Dataplane, extra: dict[str, object],
                 dp6: Dataplane | None = None) -> None:
    # EMFILE while the fds are hogged: the next round writes it.
    six: dict[str, object] = {} if dp6 is None else {
        "listeners6": dp6.listeners(), "transparent6": dp6.transparent_active,
        "active6": dp6.active_connections(),
    }
    with contextlib.suppress(OSError):
        write_atomic(path, json.dumps({
            "generation": dp.generation,
            "listeners": dp.listeners(),
            "transparent": dp.transparent_active,
            "active": dp.active_connections(),
            **six,
            **extra,
        }))


async def main(args: argparse.Namespace) -> int:
    loop = asyncio.get_running_loop()
    state = Path(args.state)
    status = Path(args.status)
    def dataplane(family: int) -> Dataplane:
        """One family's dataplane, as ``kpx node`` runs one per family (--vips: its VIPs too)."""
        return Dataplane(
            loop=loop,
            transparent=args.transparent,
            connect_timeout=args.connect_timeout,
            max_connections=args.max_connections,
            retry_interval=args.retry_interval,
            family=family,
            local_vips=LocalVIPs(family=family) if args.vips else None,
            cluster_cidrs=args.cluster_cidr,
        )

    dp = dataplane(4)
    dp6 = dataplane(6) if args.ipv6 else None  # --ipv6: the IPv6 family's beside it
    config = dataclasses.replace(sync_config(args.node, args.nodeport_cidrs), vips=args.vips)
    proxier = Proxier(config, dataplane=dp, dataplane6=dp6)
    extra: dict[str, object] = {"pid": os.getpid()}
    hog: list[int] = []

    def hog_fds() -> None:
        # After the first apply: the listeners exist, then nothing is left.
        try:
            while len(hog) < 100000:
                hog.append(os.open("/dev/null", os.O_RDONLY))
        except OSError:
            pass
        extra["hogged"] = len(hog)
        # Writing the status needs one fd: lend it, then take it back.
        os.close(hog.pop())
        write_status(status, dp, extra, dp6)
        hog.append(os.open("/dev/null", os.O_RDONLY))

    def on_stdin() -> None:
        line = sys.stdin.readline()
        if line.strip() == "FREE":
            for fd in hog:
                os.close(fd)
            hog.clear()
            extra["hogged"] = 0
            write_status(status, dp, extra, dp6)

    if args.hog_fds:
        loop.add_reader(sys.stdin.fileno(), on_stdin)

    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, stop.set)

    last = b""
    generation = 0
    while not stop.is_set():
        try:
            text = state.read_bytes()
        except OSError:
            text = last
        if text != last:
            last = text
            generation += 1
            try:
                proxier.sync(parse_state(text.decode(), generation))
            except StateError as exc:
                logging.error("state refused: %s", exc)
            # The status's generation then means its VIPs are in force too.
            for plane in (dp, dp6):
                if plane is not None:
                    await plane.vips_synced()
        if args.hog_fds and generation == 1 and "hogged" not in extra:
            hog_fds()
        write_status(status, dp, extra, dp6)
        try:
            async with asyncio.timeout(0.05):
                await stop.wait()
        except TimeoutError:
            pass

    await dp.stop_accepting()
    if dp6 is not None:
        await dp6.stop_accepting()
    extra["drain_reset"] = await dp.drain(args.grace)
    if dp6 is not None:
        extra["drain_reset6"] = await dp6.drain(args.grace)
        dp6.close()
    dp.close()
    write_status(status, dp, {**extra, "stopped": True}, dp6)
    return 0


def cli() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--node", required=True)
    p.add_argument("--state", required=True)
    p.add_argument("--status", required=True)
    p.add_argument("--transparent", action="store_true")
    p.add_argument("--ipv6", action="store_true", help="an IPv6 dataplane too (dual-stack)")
    p.add_argument("--vips", action="store_true", help="serve service VIPs (both families)")
    p.add_argument("--cluster-cidr", nargs="*", default=[], help="pod CIDRs, both families")
    p.add_argument("--connect-timeout", type=float, default=2.0)
    p.add_argument("--grace", type=float, default=2.0)
    p.add_argument("--nodeport-cidrs", nargs="*", default=[])
    p.add_argument("--max-connections", type=int, default=None)
    p.add_argument("--retry-interval", type=float, default=0.3)
    p.add_argument("--rlimit-nofile", type=int, default=0)
    p.add_argument("--hog-fds", action="store_true")
    p.add_argument("--loop", choices=("uvloop", "asyncio"), default="uvloop")
    args = p.parse_args()
    logging.basicConfig(
        level=logging.INFO, stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if args.transparent and not in_test_netns():
        print("refusing --transparent outside a kd* test namespace", file=sys.stderr)
        return 2
    if args.rlimit_nofile:
        _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (args.rlimit_nofile, hard))
    if args.loop == "uvloop":
        return uvloop.run(main(args))
    return asyncio.run(main(args))


if __name__ == "__main__":
    raise SystemExit(cli())
