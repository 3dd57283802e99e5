"""Conntrack settings for ``--proxy-mode nfqueue``, as kube-proxy's iptables mode sets them.

Owns: the sysctls that decide how long conntrack keeps a DNATed connection
and how many it can hold, ``route_localnet``, and the deletion of UDP
flows pinned to an endpoint that is gone (``stale_udp``, each IP family's
flows against that family's plans), in the namespace kpx runs in.

In nfqueue mode the kernel forwards every established connection through
the NAT conntrack recorded at its SYN, so conntrack's limits are kpx's:

- ``nf_conntrack_tcp_timeout_established`` from ``--conntrack-tcp-timeout-established``
  (24h) and ``nf_conntrack_tcp_timeout_close_wait`` from
  ``--conntrack-tcp-timeout-close-wait`` (1h); 0 leaves a value as it is,
  as in kube-proxy;
- ``nf_conntrack_max``, raised (never lowered) to
  ``max(--conntrack-min, --conntrack-max-per-core x CPUs)`` (131072 and
  32768, kube-proxy's defaults). The kernel lets only the initial namespace
  write it: elsewhere it is read, and a table smaller than wanted is a
  warning. A full table drops new connections' SYNs (``nf_conntrack: table
  full``), so this is the sizing knob;
- TIME_WAIT: a closed connection's entry stays for conntrack's own
  ``nf_conntrack_tcp_timeout_time_wait`` (120 s), left as it is (kube-proxy
  does the same); it is what ``nf_conntrack_max`` must leave room for at
  a high connection rate (120 s x 10,000 conn/s = 1.2 M entries);
- ``nf_conntrack_udp_timeout`` and ``_stream`` from ``--conntrack-udp-timeout``
  (30 s) and ``--conntrack-udp-timeout-stream`` (120 s), in whole seconds
  (rounded up): how long a UDP flow stays pinned to its endpoint after its
  last datagram, as the relay's flow table keeps it in userspace mode;
- ``net.ipv4.conf.all.route_localnet=1``, so a SYN to ``127.0.0.1:nodePort``
  may be DNATed out of the node, as kube-proxy's iptables mode allows
  localhost NodePorts;
- ``nf_conntrack_tcp_be_liberal=1`` with ``--conntrack-tcp-be-liberal`` (off by
  default, as in kube-proxy): conntrack then marks no out-of-window segment of a
  tracked connection INVALID. An INVALID segment gets no NAT, so one sent to
  the NodePort meets the node's own stack, which answers it with a reset that
  kills the client's connection. kube-proxy's nftables mode offers this flag
  instead of iptables mode's rule dropping INVALID packets.

Never: lower a limit someone raised, or fail the start for a setting the
namespace cannot take (logged instead).
"""

from __future__ import annotations

import argparse
import logging
import math
import os
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from proxy.core.decision import PlanKey, PortPlan
from proxy.nfqueue.rules import Frontends

log = logging.getLogger(__name__)

PROC = Path("/proc/sys")
CONNTRACK_MIN = 131072
CONNTRACK_MAX_PER_CORE = 32768


@dataclass(frozen=True, slots=True)
class Settings:
    """What to set; 0 for a timeout leaves it as it is."""

    tcp_established: float = 86400.0
    tcp_close_wait: float = 3600.0
    udp: float = 30.0
    udp_stream: float = 120.0
    max_per_core: int = CONNTRACK_MAX_PER_CORE
    min: int = CONNTRACK_MIN
    tcp_be_liberal: bool = False

    @classmethod
    def from_flags(cls, args: argparse.Namespace) -> Settings:
        return cls(
            tcp_established=getattr(args, "conntrack_tcp_timeout_established", 86400.0),
            tcp_close_wait=getattr(args, "conntrack_tcp_timeout_close_wait", 3600.0),
            udp=getattr(args, "conntrack_udp_timeout", 30.0),
            udp_stream=getattr(args, "conntrack_udp_timeout_stream", 120.0),
            max_per_core=getattr(args, "conntrack_max_per_core", CONNTRACK_MAX_PER_CORE),
            min=getattr(args, "conntrack_min", CONNTRACK_MIN),
            tcp_be_liberal=getattr(args, "conntrack_tcp_be_liberal", False),
        )

    def wanted_max(self, cpus: int | None = None) -> int:
        """kube-proxy's ``getConntrackMax``: per-core times CPUs, at least ``min``; 0: leave."""
        if not self.max_per_core:
            return 0
        return max(self.min, self.max_per_core * (cpus or os.cpu_count() or 1))


def wanted(settings: Settings, cpus: int | None = None) -> dict[str, int]:
    """The sysctl values to make sure of, by path under /proc/sys (pure)."""
    out: dict[str, int] = {"net/ipv4/conf/all/route_localnet": 1}
    if settings.tcp_established:
        out["net/netfilter/nf_conntrack_tcp_timeout_established"] = int(settings.tcp_established)
    if settings.tcp_close_wait:
        out["net/netfilter/nf_conntrack_tcp_timeout_close_wait"] = int(settings.tcp_close_wait)
    for key, seconds in (("udp_timeout", settings.udp), ("udp_timeout_stream",
                                                           settings.udp_stream)):
        if seconds:
            out[f"net/netfilter/nf_conntrack_{key}"] = max(1, math.ceil(seconds))
    if settings.wanted_max(cpus):
        out["net/netfilter/nf_conntrack_max"] = settings.wanted_max(cpus)
    if settings.tcp_be_liberal:
        out["net/netfilter/nf_conntrack_tcp_be_liberal"] = 1
    return out


def apply(settings: Settings, root: Path = PROC) -> dict[str, int]:
    """Set what ``wanted`` says, where it is not already so; returns what was written.

    ``nf_conntrack_max`` is only ever raised. A value the namespace cannot
    write is logged, never raised.
    """
    done: dict[str, int] = {}
    for key, value in wanted(settings).items():
        path = root / key
        try:
            current = int(path.read_text().split()[0])
        except (OSError, ValueError, IndexError) as exc:
            log.warning("conntrack: cannot read %s: %s", key.replace("/", "."), exc)
            continue
        if current == value or (key.endswith("nf_conntrack_max") and current >= value):
            continue
        try:
            path.write_text(f"{value}\n")
        except OSError as exc:
            level = logging.INFO if key.endswith("nf_conntrack_max") else logging.WARNING
            log.log(level, "conntrack: %s stays %d (wanted %d): %s", key.replace("/", "."),
                    current, value, exc.strerror or exc)
            continue
        done[key] = value
    if done:
        log.info("conntrack: set %s", ", ".join(f"{k.rsplit('/', 1)[1]}={v}"
                                                for k, v in done.items()))
    return done


# -- stale UDP flows ----------------------------------------------------------------------

TCP = 6
UDP = 17


class UdpEntry(NamedTuple):
    """What ``stale_udp`` reads of one conntrack entry, and what deleting it needs."""

    src: str
    sport: int
    dst: str
    dport: int
    reply_src: str
    """The reply direction's source: the endpoint a DNATed flow went to."""


Serving = tuple[dict[tuple[str, int], frozenset[str]], dict[int, frozenset[str]]]
"""What ``serving`` returns: endpoint IPs by ``(vip, port)`` and by nodePort."""


def serving(udp_plans: Mapping[PlanKey, PortPlan]) -> Serving:
    """The endpoint IPs each UDP frontend may keep flows to: by ``(vip, port)`` and by nodePort.

    A plan without endpoints is left out, as kube-proxy leaves it: its
    flows are rejected or dropped, and nothing better exists to move them to.
    """
    by_vip: dict[tuple[str, int], frozenset[str]] = {}
    by_node_port: dict[int, frozenset[str]] = {}
    for plan in udp_plans.values():
        ips = frozenset(ep.ip for eps in (plan.cluster, plan.local) for ep in eps)
        if not ips:
            continue
        if plan.vip is None:
            by_node_port[plan.port.node_port] = ips
        else:
            by_vip[(plan.vip, plan.port.port)] = ips
    return by_vip, by_node_port


def stale_udp(entries: Iterable[UdpEntry], udp_plans: Mapping[PlanKey, PortPlan],
              local_addresses: Collection[str]) -> list[UdpEntry]:
    """The UDP flows conntrack pins to something other than an endpoint still served (pure).

    kube-proxy's ``conntrack.CleanStaleEntries`` (pkg/proxy/conntrack/cleanup.go):
    an entry to a service ``VIP:port``, or to a NodePort, whose reply
    source is not one of that port's endpoints. Left alone, such a flow
    keeps going where it went (a deleted pod, or the node's own stack,
    which answered ICMP while the port had no endpoint) for as long as its
    client keeps sending, since every datagram refreshes it. Deleted, its
    next datagram is a new flow and is decided again.

    Two narrowings: a NodePort entry counts only when it was addressed to
    this node (one of ``local_addresses`` or 127.0.0.0/8), where kube-proxy
    matches the port on any address; and the endpoints are the ones kpx
    would still pick (``plan.cluster`` and ``plan.local``), the set the
    userspace mode's flows are held to (``decision.still_eligible``), where
    kube-proxy keeps flows to serving-terminating endpoints as well.
    """
    return _stale(entries, serving(udp_plans), local_addresses)


def _stale(entries: Iterable[UdpEntry], wanted: Serving,
           local_addresses: Collection[str]) -> list[UdpEntry]:
    by_vip, by_node_port = wanted
    if not by_vip and not by_node_port:
        return []
    out: list[UdpEntry] = []
    for e in entries:
        ips = by_vip.get((e.dst, e.dport))
        if ips is None and e.dport in by_node_port and (
                e.dst in local_addresses or e.dst.startswith("127.")):
            ips = by_node_port[e.dport]
        if ips is not None and e.reply_src not in ips:
            out.append(e)
    return out


def clean_stale_udp(wanted: Serving, local_addresses: Collection[str], family: int = 4) -> int:
    """Delete the entries of ``family`` (4 or 6) that ``stale_udp`` names for ``wanted``
    (``serving``'s answer for that family's plans) from this namespace's conntrack; returns
    how many.

    Only that family's entries are read: the other family's flows to the
    same nodePort go to the other family's endpoints, and would all look
    stale here. Blocking (``ctnetlink``: a dump, then a delete per stale
    entry): run it off the event loop. An entry that expired meanwhile is
    not an error.
    """
    if wanted == ({}, {}):
        return 0
    from proxy.nfqueue import ctnetlink  # here: the flags' users (``apply``) need no netlink

    entries = [UdpEntry(e.src, e.sport, e.dst, e.dport, e.reply_src)
               for e in ctnetlink.dump(family, proto=UDP) if e.proto == UDP and e.reply_src]
    stale = _stale(entries, wanted, local_addresses)
    if not stale:
        return 0
    return ctnetlink.delete(family, [(UDP, e.src, e.sport, e.dst, e.dport) for e in stale])


IPS_DST_NAT = 1 << 5
"""``ctinfo``'s status bit for a connection whose destination was translated."""
TCP_TIME_WAIT = 7
TCP_CLOSE = 8


class NatEntry(NamedTuple):
    """What ``still_translated`` reads of one conntrack entry."""

    proto: int
    dst: str
    dport: int
    status: int
    tcp_state: int | None = None
    """conntrack's TCP state (``TCP_CONNTRACK_*``); None for UDP."""


def still_translated(entries: Iterable[NatEntry], fronts: Frontends) -> int:
    """How many of ``entries`` are connections DNATed to one of ``fronts`` that still need it
    (pure): a TCP one not yet closed (TIME_WAIT and CLOSE are), or a UDP flow conntrack
    still pins.

    A NodePort frontend matches its port on any address, as its rule did.
    """
    ports = {(TCP if p == "tcp" else UDP, port) for p, port in fronts.ports}
    pairs = {(TCP if p == "tcp" else UDP, a, port) for p, a, port in fronts.pairs}
    n = 0
    for e in entries:
        if not e.status & IPS_DST_NAT or e.tcp_state in (TCP_TIME_WAIT, TCP_CLOSE):
            continue
        if (e.proto, e.dport) in ports or (e.proto, e.dst, e.dport) in pairs:
            n += 1
    return n


def dnat_toward(fronts: Frontends, family: int = 4) -> int:
    """``still_translated`` over this namespace's conntrack entries of ``family``: what a NAT
    keeper (``rules.keep_nat``) waits out. The kernel sends only DNATed TCP and UDP
    entries (``ctnetlink.dump``'s filters, where it has them). Blocking: run it off the
    event loop."""
    if not fronts.ports and not fronts.pairs:
        return 0
    from proxy.nfqueue import ctnetlink

    entries = [NatEntry(e.proto, e.dst, e.dport, e.status,
                        e.tcp_state if e.proto == TCP else None)
               for proto in (TCP, UDP)
               for e in ctnetlink.dump(family, proto=proto, status=IPS_DST_NAT,
                                       status_mask=IPS_DST_NAT)]
    return still_translated(entries, fronts)
