"""The passthrough load balancer's nftables tables ``ip kpx_lb`` and ``ip6 kpx_lb``.

Owns: the ruleset text (the round-robin DNAT of the front over the serving
set and the per-node connection counters), swapping the DNAT rule in one
transaction, running ``nft -f -``, and reading the counters back.

One table per family, each from its own config (``LBConfig.family``; the
IPv6 one is ``LBConfig.for_ipv6()``): ``ip kpx_lb`` for the IPv4 front,
``ip6 kpx_lb`` for the IPv6 front of a dual-stack lab. Same rules, IPv6
spelling (``ip6 daddr``, ``dnat ip6 to``, ``ct original ip6 daddr``).

Never: run ``nft`` in a namespace of its choosing: ``run`` inherits the
caller's, which is the LB namespace for the daemon; the lab reads counters
through ``lab.run("lb", ...)`` (``lab.lb.control.connection_counts``).
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
from collections.abc import Sequence

from lab.lb.config import Backend, LBConfig

NFT_TABLE = "kpx_lb"


def counter_name(node: str) -> str:
    """An nft object name for a node's counter (nft names are identifiers)."""
    return "n_" + re.sub(r"[^A-Za-z0-9_]", "_", node)


def _fam(cfg: LBConfig) -> str:
    """The nft family (and address match keyword) of *cfg*'s front: ``ip`` or ``ip6``."""
    return "ip6" if cfg.family == 6 else "ip"


def nft_dnat_rule(cfg: LBConfig, targets: Sequence[Backend]) -> str:
    """The one passthrough rule: round-robin DNAT of the front over ``targets``."""
    elements = ", ".join(f"{i} : {b.ip} . {cfg.node_port}" for i, b in enumerate(targets))
    f = _fam(cfg)
    return (
        f"add rule {f} {NFT_TABLE} prerouting {f} daddr {cfg.listen_ip} tcp dport {cfg.port} "
        f"dnat {f} to numgen inc mod {len(targets)} map {{ {elements} }}"
    )


def nft_front_match(cfg: LBConfig) -> str:
    """Matches a connection that was opened to the LB's front (before the DNAT).

    ``proto-dst`` needs a layer-4 context, so it goes after a ``tcp`` match.
    """
    return f"ct original {_fam(cfg)} daddr {cfg.listen_ip} ct original proto-dst {cfg.port}"


def nft_ruleset(cfg: LBConfig, targets: Sequence[Backend]) -> str:
    """The whole table, replacing any previous one in the same transaction.

    ``table`` + ``delete table`` first makes it idempotent (a restarted daemon
    or a crashed one's leftovers). The postrouting counters are per node and
    only see each connection's first packet, so they count connections.

    They count only connections a client made to the *front* (conntrack's
    original destination is ``listen_ip:port``): the LB's own health checks
    leave this namespace through the same postrouting hook, and a TCP check
    on the nodePort (``probe.port: nodePort``) goes to exactly
    ``nodeIP:nodePort``, so matching the post-DNAT address alone would count
    every probe as a connection the node "got".

    Clients in ``cfg.masquerade_from`` (pods) are SNATed to the LB after
    being counted, so the node's reply comes back through it.
    """
    f = _fam(cfg)
    counters = "\n".join(f"  counter {counter_name(b.name)} {{ }}" for b in cfg.backends)
    counted = "\n".join(
        f"    {f} daddr {b.ip} tcp dport {cfg.node_port} {nft_front_match(cfg)} "
        f"counter name \"{counter_name(b.name)}\""
        for b in cfg.backends
    )
    masquerade = "".join(
        f"    {f} saddr {cidr} meta l4proto tcp {nft_front_match(cfg)} masquerade\n"
        for cidr in cfg.masquerade_from)
    return (
        f"table {f} {NFT_TABLE}\n"
        f"delete table {f} {NFT_TABLE}\n"
        f"table {f} {NFT_TABLE} {{\n"
        f"{counters}\n"
        "  chain prerouting {\n"
        "    type nat hook prerouting priority dstnat; policy accept;\n"
        "  }\n"
        "  chain postrouting {\n"
        "    type nat hook postrouting priority srcnat; policy accept;\n"
        f"{counted}\n"
        f"{masquerade}"
        "  }\n"
        "}\n" + nft_dnat_rule(cfg, targets) + "\n"
    )


def nft_update(cfg: LBConfig, targets: Sequence[Backend]) -> str:
    """Swap the DNAT rule for a new serving set: flush + add, one transaction."""
    return f"flush chain {_fam(cfg)} {NFT_TABLE} prerouting\n{nft_dnat_rule(cfg, targets)}\n"


async def run(script: str) -> None:
    """Apply *script* with ``nft -f -`` (one transaction); RuntimeError if nft refuses it."""
    proc = await asyncio.create_subprocess_exec(
        "nft", "-f", "-",
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    _out, err = await proc.communicate(script.encode())
    if proc.returncode != 0:
        raise RuntimeError(f"nft failed ({proc.returncode}): {err.decode().strip()}")


def delete_table(family: int = 4) -> str:
    """The script that removes *family*'s table, and succeeds whether or not it exists."""
    f = "ip6" if family == 6 else "ip"
    return f"table {f} {NFT_TABLE}\ndelete table {f} {NFT_TABLE}\n"


def counters(listing: str, nodes: Sequence[str]) -> dict[str, int]:
    """Per node, the connections counted, from ``nft -j list counters table ip kpx_lb``."""
    by_counter = {
        o["counter"]["name"]: int(o["counter"]["packets"])
        for o in json.loads(listing).get("nftables", [])
        if "counter" in o
    }
    return {name: by_counter.get(counter_name(name), 0) for name in nodes}
