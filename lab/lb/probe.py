"""The load balancer's health checks: one TCP connect or HTTP GET against one node.

Owns: sending a probe and reducing its answer to (passed, what was seen),
bounded by the probe's timeout.

Never: decide what a result means for the node (``lab.lb.rules.observe``
does) or retry: one call is one probe, as a cloud health check counts them.
"""

from __future__ import annotations

import asyncio
import contextlib

from lab.lb.config import Probe
from lab.lb.rules import describe_error


async def _probe_body(probe: Probe, ip: str) -> tuple[bool, str]:
    reader, writer = await asyncio.open_connection(ip, probe.port)
    try:
        if probe.type == "tcp":
            return True, "connected"
        host = f"[{ip}]" if ":" in ip else ip
        writer.write(
            f"GET {probe.path} HTTP/1.1\r\nHost: {host}:{probe.port}\r\n"
            "User-Agent: kpx-lab-lb/1\r\nConnection: close\r\n\r\n".encode("ascii")
        )
        await writer.drain()
        line = await reader.readline()
        parts = line.split()
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/") or not parts[1].isdigit():
            return False, "closed without an answer" if not line else "not HTTP"
        code = int(parts[1])
        return code == 200, f"HTTP {code}"
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


async def probe_once(probe: Probe, ip: str) -> tuple[bool, str]:
    """One health check against one node: (passed, what was seen).

    The whole exchange, connect included, is bounded by ``probe.timeout``:
    cloud checks count a slow answer as a failure just like no answer. Only
    HTTP 200 passes (as GCP's and the kube-proxy e2e helper's checks), so a
    503 from a healthCheckNodePort is a failure even though the port is open.
    """
    try:
        async with asyncio.timeout(probe.timeout):
            return await _probe_body(probe, ip)
    except (OSError, TimeoutError, EOFError, asyncio.IncompleteReadError) as e:
        return False, describe_error(e)
