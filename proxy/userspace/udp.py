"""UDP service ports: datagrams in, flows decided and pinned, replies from the address dialled.

Owns: the UDP half of the dataplane. One socket per UDP NodePort address
(``UdpFront``), and one for every UDP VIP port (the eBPF ``sk_lookup``
program steers them to it, as it does TCP: ``proxy.userspace.sklookup``).
Each datagram is matched to its flow (``proxy.core.flows``): the first one
of a flow is decided (``decision.decide``: Cluster or Local, affinity, the
terminating fallback, the node's and pods' short-circuits) and gets an
upstream socket connected to the endpoint; later ones follow it. Replies
read on that socket go back to the client **from the address and port it
sent to**:

- NodePort: the front socket (bound to the nodePort) sends with
  ``IP_PKTINFO`` naming the local address the datagram arrived on
  (``IP_ORIGDSTADDR``), so a wildcard socket on a node with two addresses
  answers from the one the client used;
- VIP: a socket bound to ``VIP:port`` (made on the port's first flow, gone
  with the port) sends the reply. It never receives: the steering takes the
  VIP's datagrams before the kernel's own lookup would find it, and a
  drop-everything socket filter covers the moment it does not.

Verdicts, as kube-proxy's rules give them for UDP:

- no endpoint anywhere: no front socket at all, so the kernel answers ICMP
  port unreachable (a VIP: the nft guard's ``reject``);
- eTP=Local, nothing here, an external client: the datagram is discarded,
  with no ICMP (a VIP: the guard drops it);
- Forward: SNAT (an unbound upstream socket: the node's address) or the
  client's own address (``IP_TRANSPARENT``, with the return path of
  ``proxy.userspace.transparent``, which marks UDP as it marks TCP).

No stale flows: a flow whose plan changed is checked against the new one
(``decision.still_eligible``) on its next datagram, and re-decided when its
endpoint is gone, not ready, or no longer a candidate. An endpoint that
answers ICMP port unreachable (``ECONNREFUSED`` on the upstream socket)
ends the flow at once. Idle flows expire after conntrack's UDP timeouts,
and a full table evicts the flow idle the longest.

IPv6: the same, on ``AF_INET6`` sockets (``IPV6_V6ONLY``) with the IPv6
options (``IPV6_RECVORIGDSTADDR``, ``IPV6_PKTINFO``, ``IPV6_TRANSPARENT``);
the IPv6 dataplane's sockets and flows are its own. A datagram to ``::1``
is dropped: IPv6 has no localhost NodePorts (iptables mode's ``! -d ::1``).

Never: block, allocate per datagram beyond the datagram itself, log per
datagram (``Forwarder.warn`` rate-limits), or send a datagram to an endpoint
a plan in force would not choose.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import logging
import socket
import struct
import time
from dataclasses import dataclass
from typing import NamedTuple

from proxy import metrics
from proxy.core.balancer import Balancer
from proxy.core.decision import Drop, Forward, PlanKey, PortPlan, decide, still_eligible
from proxy.core.flows import Flow, FlowKey, FlowTable
from proxy.userspace import synfilter
from proxy.userspace.forwarder import Forwarder
from proxy.userspace.transparent import IP_TRANSPARENT

log = logging.getLogger(__name__)

IP_PKTINFO = 8
IP_RECVORIGDSTADDR = 20
IP_ORIGDSTADDR = 20
IPV6_PKTINFO = 50
IPV6_RECVORIGDSTADDR = 74
IPV6_ORIGDSTADDR = 74
IPV6_TRANSPARENT = 75
IPV6_CHECKSUM = 7
"""A raw IPv6 socket's option: the offset of the checksum the kernel fills in."""
IPV6_LOOPBACK = "::1"
DATAGRAM_MAX = 65535
BATCH = 64
"""Datagrams read per socket per wake-up: fair to every other socket on the loop."""
_CMSG_SPACE = socket.CMSG_SPACE(28)
"""Room for a ``sockaddr_in6`` (IPv6's ``IPV6_ORIGDSTADDR``), which holds IPv4's too."""
_DROP_ALL = [(0x06, 0, 0, 0)]
"""A classic BPF program of one instruction, ``ret #0``: every datagram dropped."""
METRICS_FLUSH_INTERVAL = 1.0


@functools.lru_cache(maxsize=1024)
def pktinfo(source: str) -> bytes:
    """``struct in_pktinfo`` asking the kernel to send from ``source`` (``ipi_spec_dst``).

    Cached: every reply needs one, and a node has few addresses.
    """
    if ":" in source:  # struct in6_pktinfo: the address, then the interface (any)
        return struct.pack("=16si", socket.inet_pton(socket.AF_INET6, source), 0)
    return struct.pack("=i4s4s", 0, socket.inet_aton(source), b"\0\0\0\0")


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def orig_dst(ancdata: list[tuple[int, int, bytes]]) -> tuple[str, int] | None:
    """The address and port a datagram was sent to, from ``IP(V6)_ORIGDSTADDR``."""
    for level, kind, data in ancdata:
        if level == socket.SOL_IP and kind == IP_ORIGDSTADDR and len(data) >= 8:
            port = int.from_bytes(data[2:4], "big")
            return socket.inet_ntoa(data[4:8]), port
        if level == socket.IPPROTO_IPV6 and kind == IPV6_ORIGDSTADDR and len(data) >= 24:
            port = int.from_bytes(data[2:4], "big")
            return socket.inet_ntop(socket.AF_INET6, data[8:24]), port
    return None


@dataclass(slots=True)
class UdpCounts:
    """UDP totals as plain ints, added to Prometheus once a second (like ``PortMetrics``)."""

    created: int = 0
    expired: int = 0
    evicted: int = 0
    repicked: int = 0
    dropped: int = 0
    rejected: int = 0
    datagrams_to_endpoint: int = 0
    datagrams_to_client: int = 0
    bytes_to_endpoint: int = 0
    bytes_to_client: int = 0

    def flush(self) -> None:
        for name, counter, labels in (
            ("created", metrics.UDP_FLOWS_CREATED, ()),
            ("expired", metrics.UDP_FLOWS_EXPIRED, ()),
            ("evicted", metrics.UDP_FLOWS_EVICTED, ()),
            ("repicked", metrics.UDP_FLOWS_REPICKED, ()),
            ("dropped", metrics.UDP_DATAGRAMS_DROPPED, ("dropped",)),
            ("rejected", metrics.UDP_DATAGRAMS_DROPPED, ("rejected",)),
            ("datagrams_to_endpoint", metrics.UDP_DATAGRAMS, ("to_endpoint",)),
            ("datagrams_to_client", metrics.UDP_DATAGRAMS, ("to_client",)),
            ("bytes_to_endpoint", metrics.UDP_BYTES, ("to_endpoint",)),
            ("bytes_to_client", metrics.UDP_BYTES, ("to_client",)),
        ):
            n = getattr(self, name)
            if n:
                (counter.labels(*labels) if labels else counter).inc(n)
                setattr(self, name, 0)


class Upstream(NamedTuple):
    """A flow's own socket, connected to its endpoint, and the front it came in on
    (which says how a reply goes back: ``IP_PKTINFO`` on it, or a VIP's reply socket)."""

    sock: socket.socket
    front: UdpFront


@dataclass(frozen=True, slots=True)
class UdpPort:
    """What one UDP plan's datagrams use; replaced on each sync, the balancer kept."""

    plan: PortPlan
    balancer: Balancer


class UdpFront:
    """One receiving socket: a NodePort's (on one address) or the VIPs' steered one."""

    def __init__(self, owner: UdpForwarder, host: str, port: int, table_key: PlanKey | None,
                 label: str) -> None:
        self.owner = owner
        self.host = host
        self.port = port
        self.table_key = table_key
        """The NodePort this socket serves; None for the VIP socket (keyed per datagram)."""
        self.label = label
        self.sock: socket.socket | None = None

    def open(self, reuse_port: bool = False) -> None:
        six = ":" in self.host
        s = socket.socket(_family(self.host), socket.SOCK_DGRAM | socket.SOCK_NONBLOCK)
        try:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if reuse_port:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            if six:
                s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                s.setsockopt(socket.IPPROTO_IPV6, IPV6_RECVORIGDSTADDR, 1)
            else:
                s.setsockopt(socket.SOL_IP, IP_RECVORIGDSTADDR, 1)
            s.bind((self.host, self.port))
        except BaseException:
            s.close()
            raise
        self.sock = s
        self.port = s.getsockname()[1]
        self.owner.loop.add_reader(s.fileno(), self._readable)

    def close(self) -> None:
        s, self.sock = self.sock, None
        if s is not None:
            with contextlib.suppress(Exception):
                self.owner.loop.remove_reader(s.fileno())
            s.close()

    def _readable(self) -> None:
        s = self.sock
        if s is None:
            return
        owner = self.owner
        for _ in range(BATCH):
            try:
                data, anc, _flags, addr = s.recvmsg(DATAGRAM_MAX, _CMSG_SPACE)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # an ICMP error queued for this socket: not ours to keep
                owner.warn(("udp-recv", self.label), "UDP %s %s:%d: receive failed: %s",
                           self.label, self.host, self.port, exc)
                return
            dst = orig_dst(anc) or (self.host, self.port)
            if dst[0] == IPV6_LOOPBACK:  # never served, as TCP's (``listener``): dropped
                owner.counts.rejected += 1
                continue
            owner.on_datagram(self, data, addr, dst)

    def send_reply(self, data: bytes, client: tuple[str, int], source: str) -> None:
        """Send ``data`` to ``client`` from ``source`` (and this socket's port)."""
        s = self.sock
        if s is None:
            return
        if ":" in source:
            s.sendmsg([data], [(socket.IPPROTO_IPV6, IPV6_PKTINFO, pktinfo(source))], 0, client)
        else:
            s.sendmsg([data], [(socket.SOL_IP, IP_PKTINFO, pktinfo(source))], 0, client)


class _RawReply:
    """Sends from ``VIP:port`` without binding it: a raw UDP socket, the header written here."""

    def __init__(self, local: tuple[str, int]) -> None:
        six = ":" in local[0]
        s = socket.socket(_family(local[0]), socket.SOCK_RAW | socket.SOCK_NONBLOCK,
                          socket.IPPROTO_UDP)
        try:
            synfilter.attach(s, _DROP_ALL)  # a raw UDP socket would see every datagram
            if six:
                s.setsockopt(socket.IPPROTO_IPV6, IPV6_CHECKSUM, 6)  # the kernel sums it
                s.setsockopt(socket.IPPROTO_IPV6, IPV6_TRANSPARENT, 1)
            else:
                s.setsockopt(socket.SOL_IP, IP_TRANSPARENT, 1)
            s.bind((local[0], 0))
        except BaseException:
            s.close()
            raise
        self.sock = s
        self.port = local[1]

    def sendto(self, data: bytes, client: tuple[str, int]) -> None:
        # IPv4: checksum 0 (none); IPv6: filled in by the kernel (IPV6_CHECKSUM).
        head = struct.pack("!HHHH", self.port, client[1], 8 + len(data), 0)
        self.sock.sendto(head + data, (client[0], 0))

    def close(self) -> None:
        self.sock.close()


class UdpForwarder:
    """Every UDP front socket, flow and upstream socket of one kpx process."""

    def __init__(self, loop: asyncio.AbstractEventLoop, tcp: Forwarder,
                 flows: FlowTable[Upstream]) -> None:
        self.loop = loop
        self.tcp = tcp
        """The TCP forwarder: the node's addresses, the pod CIDRs, whether the
        return path is in, and the rate-limited log are its, kept current by the
        dataplane, and the same for UDP."""
        self.warn = tcp.warn
        self.flows = flows
        self.ports: dict[PlanKey, UdpPort] = {}
        """By plan key, the served UDP plans (a plan without endpoints has no entry)."""
        self.counts = UdpCounts()
        self._reply_socks: dict[tuple[str, int], socket.socket | _RawReply] = {}
        self._expiry: asyncio.TimerHandle | None = None
        self._flush: asyncio.TimerHandle | None = None
        metrics.UDP_FLOWS_ACTIVE.set_function(lambda: len(self.flows))

    # -- the table -----------------------------------------------------------

    def swap(self, plans: dict[PlanKey, PortPlan]) -> None:
        """Put a sync's UDP plans in force; balancers of surviving ports are kept.

        Flows are checked on their next datagram (``still_eligible``), so a
        sync walks them only when a port went away: its flows are ended. The
        VIP reply sockets of ports no longer served are closed.
        """
        old = self.ports
        balancers = {p.plan.key: p.balancer for p in old.values()}
        ports: dict[PlanKey, UdpPort] = {}
        for key, plan in plans.items():
            if plan.listen:  # one balancer per service port, its NodePort and VIPs alike
                balancer = balancers.get(plan.key)
                if balancer is None:
                    balancer = balancers[plan.key] = Balancer()
                ports[key] = UdpPort(plan, balancer)
        self.ports = ports
        if old.keys() - self.ports.keys():  # only then can a flow have lost its port
            for f in [f for f in self.flows if f.plan.table_key not in self.ports]:
                self._end(f)
        for key in [k for k in self._reply_socks if k not in self.ports]:
            self._reply_socks.pop(key).close()

    def plans(self) -> dict[PlanKey, PortPlan]:
        return {key: port.plan for key, port in self.ports.items()}

    # -- datagrams ---------------------------------------------------------------

    def on_datagram(self, front: UdpFront, data: bytes, client: tuple[str, int],
                    dst: tuple[str, int]) -> None:
        key = front.table_key if front.table_key is not None else dst
        port = self.ports.get(key)
        if port is None:  # closing by this very sync, or a VIP port not served
            self.counts.rejected += 1
            self._dirty()
            return
        now = time.monotonic()
        fkey: FlowKey = (client[0], client[1], dst[0], dst[1])
        flow = self.flows.get(fkey, now)
        plan = port.plan
        if flow is not None and flow.plan is not plan and not self._follow(flow, plan):
            flow = None
        if flow is None:
            flow = self._new_flow(front, port, fkey, now)
            if flow is None:
                return
        up = flow.upstream
        assert up is not None
        try:
            up.sock.send(data)
        except (BlockingIOError, InterruptedError):
            self.counts.dropped += 1  # a full socket buffer: UDP's answer is loss
        except OSError as exc:
            # ECONNREFUSED: the endpoint answered an earlier datagram with
            # ICMP port unreachable. The flow ends; the next datagram re-decides.
            self.warn(("udp-send", plan.key), "UDP %s: %s:%d -> %s: %s", plan.key, client[0],
                      client[1], flow.endpoint, exc.strerror or exc)
            self._end(flow)
            return
        self.flows.touch(flow, now)
        c = self.counts
        c.datagrams_to_endpoint += 1
        c.bytes_to_endpoint += len(data)
        self._dirty()

    def _new_flow(self, front: UdpFront, port: UdpPort, fkey: FlowKey, now: float
                  ) -> Flow[Upstream] | None:
        client_ip = fkey[0]
        decision = decide(port.plan, client_ip, self.tcp.local_addresses, port.balancer, now,
                          (), self.tcp.cluster_cidrs)
        if type(decision) is not Forward:
            # Drop: silence, as the iptables rule's DROP. Reject reaches here only
            # in the moment before the socket closes; ICMP then comes from the kernel.
            if isinstance(decision, Drop):
                self.counts.dropped += 1
            else:
                self.counts.rejected += 1
            self._dirty()
            if log.isEnabledFor(logging.DEBUG):
                log.debug("UDP %s:%d -> %s:%d: %s", *fkey, decision.reason)
            return None
        snat = decision.snat or not self.tcp.transparent
        try:
            up = Upstream(self._upstream(None if snat else client_ip, decision.endpoint.addr),
                          front)
        except OSError as exc:
            self.warn(("udp-upstream", port.plan.key), "UDP %s: no socket to %s for %s: %s",
                      port.plan.key, decision.endpoint, client_ip, exc.strerror or exc)
            return None
        flow: Flow[Upstream] = Flow(fkey, port.plan, decision.endpoint, snat, now, upstream=up)
        for old in self.flows.add(flow):
            if old.key != fkey:
                self.counts.evicted += 1
            self._close(old)
        self.loop.add_reader(up.sock.fileno(), self._reply, flow)
        self.counts.created += 1
        self._arm_expiry()
        return flow

    @staticmethod
    def _upstream(client_ip: str | None, endpoint: tuple[str, int]) -> socket.socket:
        six = ":" in endpoint[0]
        s = socket.socket(socket.AF_INET6 if six else socket.AF_INET,
                          socket.SOCK_DGRAM | socket.SOCK_NONBLOCK)
        try:
            if client_ip is not None:
                if six:
                    s.setsockopt(socket.IPPROTO_IPV6, IPV6_TRANSPARENT, 1)
                else:
                    s.setsockopt(socket.SOL_IP, IP_TRANSPARENT, 1)
                s.bind((client_ip, 0))
            s.connect(endpoint)
        except BaseException:
            s.close()
            raise
        return s

    def _reply(self, flow: Flow[Upstream]) -> None:
        """The endpoint answered: each datagram back to the client, from where it dialled."""
        up = flow.upstream
        if up is None:
            return
        sock, front = up
        client, local = flow.client, flow.local
        # What the endpoint sends is judged as the client's datagrams are: once it
        # has left the plan in force (removed, not ready, no longer a candidate), it
        # is not forwarded, and the flow ends.
        port = self.ports.get(flow.plan.table_key)
        if port is None:  # (a sync that drops a port ends its flows: kept safe anyway)
            self.counts.repicked += 1
            self._end(flow)
            self._dirty()
            return
        if port.plan is not flow.plan and not self._follow(flow, port.plan):
            self._dirty()
            return
        vip_reply = front.table_key is None
        c = self.counts
        for _ in range(BATCH):
            try:
                data = sock.recv(DATAGRAM_MAX)
            except (BlockingIOError, InterruptedError):
                break
            except OSError as exc:  # ICMP from the endpoint: this flow is over
                self.warn(("udp-reply", flow.plan.key), "UDP %s: %s answered %s; the flow to it"
                          " ends", flow.plan.key, flow.endpoint, exc.strerror or exc)
                if exc.errno in (errno.ECONNREFUSED, errno.EHOSTUNREACH, errno.ENETUNREACH):
                    self._end(flow)
                return
            try:
                if vip_reply:
                    self._reply_socket(local).sendto(data, client)
                else:
                    front.send_reply(data, client, local[0])
            except OSError as exc:
                self.warn(("udp-to-client", flow.plan.key), "UDP %s: reply to %s:%d failed: %s",
                          flow.plan.key, client[0], client[1], exc.strerror or exc)
                continue
            c.datagrams_to_client += 1
            c.bytes_to_client += len(data)
            self.flows.touch(flow, time.monotonic(), reply=True)
        self._dirty()

    def _follow(self, flow: Flow, plan: PortPlan) -> bool:
        """Whether ``flow`` goes on under ``plan``, the one now in force for its port
        (then adopted); if its endpoint is no longer eligible, the flow ends."""
        if still_eligible(plan, flow.endpoint, flow.client[0], self.tcp.local_addresses,
                          self.tcp.cluster_cidrs):
            flow.plan = plan
            return True
        self.counts.repicked += 1
        self._end(flow)
        return False

    def _reply_socket(self, local: tuple[str, int]) -> socket.socket | _RawReply:
        """The socket that answers from ``VIP:port``; bound on first use, never reading.

        A node process holding the port on the wildcard address (without
        SO_REUSEADDR) makes that bind fail: a raw socket then writes the UDP
        header itself, with ``VIP:port`` as its source.
        """
        s = self._reply_socks.get(local)
        if s is None:
            six = ":" in local[0]
            s = socket.socket(_family(local[0]), socket.SOCK_DGRAM | socket.SOCK_NONBLOCK)
            try:
                synfilter.attach(s, _DROP_ALL)
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                # Bind even before the route.
                if six:
                    s.setsockopt(socket.IPPROTO_IPV6, IPV6_TRANSPARENT, 1)
                else:
                    s.setsockopt(socket.SOL_IP, IP_TRANSPARENT, 1)
                s.bind(local)
            except OSError as exc:
                s.close()
                if exc.errno != errno.EADDRINUSE:
                    raise
                s = _RawReply(local)
            except BaseException:
                s.close()
                raise
            self._reply_socks[local] = s
        return s

    # -- ending flows ----------------------------------------------------------------

    def _end(self, flow: Flow[Upstream]) -> None:
        self.flows.remove(flow.key)
        self._close(flow)

    def _close(self, flow: Flow[Upstream]) -> None:
        up, flow.upstream = flow.upstream, None
        if up is not None:
            with contextlib.suppress(Exception):
                self.loop.remove_reader(up.sock.fileno())
            up.sock.close()

    def _arm_expiry(self) -> None:
        if self._expiry is not None:
            return
        due = self.flows.next_expiry()
        if due is None:
            return
        delay = max(0.0, due - time.monotonic()) + 0.01
        self._expiry = self.loop.call_later(delay, self._expire)

    def _expire(self) -> None:
        self._expiry = None
        gone = self.flows.expire(time.monotonic())
        for flow in gone:
            self._close(flow)
        if gone:
            self.counts.expired += len(gone)
            self._dirty()
        self._arm_expiry()

    def _dirty(self) -> None:
        if self._flush is None:
            self._flush = self.loop.call_later(METRICS_FLUSH_INTERVAL, self.flush_metrics)

    def flush_metrics(self) -> None:
        self._flush = None
        self.counts.flush()

    def close(self) -> None:
        """End every flow and close every socket this forwarder made (fronts are the caller's)."""
        for flow in list(self.flows):
            self._end(flow)
        for s in self._reply_socks.values():
            s.close()
        self._reply_socks.clear()
        for handle in (self._expiry, self._flush):
            if handle is not None:
                handle.cancel()
        self._expiry = None
        self.flush_metrics()
