"""``proxy.nfqueue.ctnetlink`` against a real conntrack table, with pyroute2 as the reference.

In a namespace of its own: a nat rule DNATs ``127.0.0.1:30080`` to a local
listener on 8080 (and turns conntrack on), then UDP flows over IPv4 and IPv6,
a DNATed TCP connection and an ICMP echo fill the table. The dump must read
every entry as pyroute2 decodes it, and the kernel's filters (protocol,
status) must leave out what they name; ``delete`` removes the entry it names
(and counts none for one that is not there). ``conntrack.dnat_toward``, the
NAT keeper's look, counts the DNATed connection while it is open and not after.
"""

from __future__ import annotations

import socket
import subprocess
from typing import Any

import pytest

from proxy.nfqueue import conntrack, ctnetlink
from proxy.nfqueue.rules import Frontends
from tests.support.netns import fresh_netns, in_netns

pytestmark = pytest.mark.skipif(
    subprocess.run(["id", "-u"], capture_output=True, text=True).stdout.strip() != "0",
    reason="needs root (a network namespace)")

RULES = """
table ip t {
  chain out { type nat hook output priority -100; tcp dport 30080 dnat to 127.0.0.1:8080; }
}
table ip6 t {
  chain out { type nat hook output priority -100; ct status dnat; }
}
"""
FLOWS = 300


def reference(family: int) -> list[tuple[Any, ...]]:
    """Every entry of ``family`` as pyroute2 decodes it, in ``CtEntry``'s field order."""
    from pyroute2 import Conntrack

    af = socket.AF_INET6 if family == 6 else socket.AF_INET
    ct = Conntrack(nfgen_family=af)
    try:
        return sorted(
            (r.tuple_orig.proto, r.tuple_orig.saddr, r.tuple_orig.sport or 0, r.tuple_orig.daddr,
             r.tuple_orig.dport or 0, r.tuple_reply.saddr, r.status,
             getattr(r.protoinfo, "state", None) if r.tuple_orig.proto == conntrack.TCP else None)
            for r in ct.dump_entries())
    finally:
        ct.close()


def fill_and_read() -> dict[str, Any]:
    """In the namespace: make the entries, then read them every way the test checks."""
    out: dict[str, Any] = {}
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    for i in range(FLOWS):
        udp.sendto(b"x", ("127.0.0.1", 1024 + i))
    udp6 = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
    udp6.sendto(b"x", ("::1", 999))
    icmp = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)
    icmp.sendto(b"\x08\x00\xf7\xfe\x00\x01\x00\x00", ("127.0.0.1", 0))  # echo request
    listener = socket.create_server(("127.0.0.1", 8080))
    client = socket.create_connection(("127.0.0.1", 30080), timeout=2)
    server, _ = listener.accept()
    fronts = Frontends(ports=frozenset({("tcp", 30080)}))
    out["v4"] = sorted(ctnetlink.dump(4))
    out["v4 reference"] = reference(4)
    out["v6"] = sorted(ctnetlink.dump(6))
    out["v6 reference"] = reference(6)
    out["udp"] = ctnetlink.dump(4, proto=conntrack.UDP)
    out["dnat"] = ctnetlink.dump(4, status=conntrack.IPS_DST_NAT,
                                 status_mask=conntrack.IPS_DST_NAT)
    gone = out["udp"][0]
    out["deleted"] = ctnetlink.delete(4, [
        (conntrack.UDP, gone.src, gone.sport, gone.dst, gone.dport),
        (conntrack.UDP, "127.0.0.1", 9, "127.0.0.1", 9)])  # none such: ENOENT, not counted
    out["udp after"] = ctnetlink.dump(4, proto=conntrack.UDP)
    out["gone"] = gone
    out["open"] = conntrack.dnat_toward(fronts, 4)
    client.close()  # the client closes first: its side goes to TIME_WAIT
    server.recv(1)
    server.close()
    out["closed"] = conntrack.dnat_toward(fronts, 4)
    for s in (udp, udp6, icmp, listener):
        s.close()
    return out


def test_a_dump_reads_what_pyroute2_reads_and_the_kernel_filters() -> None:
    with fresh_netns("ct") as ns:
        subprocess.run(["ip", "netns", "exec", ns, "nft", "-f", "-"], input=RULES, text=True,
                       check=True)
        got = in_netns(ns, fill_and_read)
    v4 = [tuple(e) for e in got["v4"]]
    assert v4 == got["v4 reference"]
    assert len(v4) >= FLOWS + 2  # the UDP flows, the TCP connection, the echo
    assert {e[0] for e in v4} >= {conntrack.TCP, conntrack.UDP, socket.IPPROTO_ICMP}
    assert [tuple(e) for e in got["v6"]] == got["v6 reference"]
    assert [(e.proto, e.dst, e.dport) for e in got["v6"]] == [(conntrack.UDP, "::1", 999)]
    assert len(got["udp"]) == FLOWS and {e.proto for e in got["udp"]} == {conntrack.UDP}
    (dnat,) = got["dnat"]
    assert (dnat.proto, dnat.dst, dnat.dport, dnat.reply_src) == (
        conntrack.TCP, "127.0.0.1", 30080, "127.0.0.1")
    assert dnat.status & conntrack.IPS_DST_NAT and dnat.tcp_state == 3  # ESTABLISHED
    assert (got["open"], got["closed"]) == (1, 0)
    assert got["deleted"] == 1
    assert len(got["udp after"]) == FLOWS - 1 and got["gone"] not in got["udp after"]
