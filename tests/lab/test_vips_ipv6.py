"""IPv6 service VIPs served by ``kpx node`` in a dual-stack lab (issue 14, "VIPs").

A dual-stack lab (``lab_factory(spec, dual_stack=True)``): the service is
``PreferDualStack``, so the lab's controller gives it an IPv6 ClusterIP
beside the IPv4 one (``lab.status()``). Pods reach the IPv6 ClusterIP from
the endpoint's node and from another node, a pod keeps its IPv6 address on
the cross-node hop as it does over IPv4 (ClusterIPSNAT), a port the service
does not declare is reset, and each node holds kpx's IPv6 ``local`` route
for it; a restart leaves one copy, a stop none; the same with ``--workers
2``. The lab is removed afterwards, pass or fail.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable

import pytest

from lab import Lab
from lab.common import wait_until
from lab.netns import pid_alive
from tests.lab.test_vips import VIP_PROTO, answers, cluster_ip_service, vip_spec
from tests.support.labkit import logs, peer_ip, wait_applied

pytestmark = pytest.mark.lab


def vip_routes6(lab: Lab, node: str) -> list[str]:
    out = lab.run(node, ["ip", "-6", "route", "show", "table", "local",
                         "proto", str(VIP_PROTO)]).stdout
    return [ln.split()[1] for ln in out.splitlines() if ln.strip()]


@pytest.mark.parametrize("workers", [1, 2])
def test_pods_reach_the_ipv6_clusterip_of_a_dual_stack_service(
        lab_factory: Callable[..., Lab], workers: int) -> None:
    """With ``--workers 2`` too: the workers share the ``::1`` port the supervisor reserved."""
    lab = lab_factory(vip_spec(cluster_ip_service(ipFamilyPolicy="PreferDualStack")),
                      dual_stack=True, extra_proxy_args=("--workers", str(workers)))
    wait_applied(lab)
    (svc,) = [s for s in lab.status()["services"] if s["key"] == "default/web"]
    vip4 = svc["clusterIP"]
    (vip6,) = [ip for ip in svc["clusterIPs"] if ":" in ip]
    try:
        wait_until(answers(lab, "c2", vip6), 5.0, 0.05)
    except TimeoutError:
        raise AssertionError(f"{vip6}:80 not served from c2\n{logs(lab)}") from None
    for node in lab.nodes:
        assert vip6 in vip_routes6(lab, node), node
    reply = lab.request("c2", vip6, 80)  # web-1 is on node1, c2 on node2
    assert reply["pod"] == "web-1"
    assert peer_ip(reply).strip("[]") == lab.pod_ip("c2", family=6)
    assert lab.request("c1", vip6, 80)["pod"] == "web-1"  # from the endpoint's own node
    assert lab.request("c2", vip4, 80)["pod"] == "web-1"  # and the IPv4 one still
    with pytest.raises(ConnectionRefusedError):  # a port the service does not declare
        lab.request("c2", vip6, 81, timeout=1.0)
    # A restart leaves one copy, and the IPv6 VIP served throughout; a stop removes it all.
    old, _new = lab.restart_proxy("node1")
    wait_until(lambda: not pid_alive(old), 15.0, 0.05)
    # (--workers restart with a short refusal window: node.py says why)
    wait_until(answers(lab, "c1", vip6), 5.0, 0.05)
    assert vip_routes6(lab, "node1") == [vip6]
    os.kill(lab.proxy_pid("node1"), signal.SIGTERM)
    wait_until(lambda: not lab.proxy_alive("node1"), 15.0, 0.05)
    assert vip_routes6(lab, "node1") == []
    assert lab.run("node1", ["nft", "list", "table", "ip6", "kpx_vips"]).returncode != 0
