"""The lab's network: addressing plan and the netlink work that builds it.

Owns: which namespace is called what, which address everything has, and
creating/destroying the links, addresses, routes and sysctls that make the
picture below true. All netlink work is done in-process through pyroute2
handles bound to each namespace (``lab.netns.iproute_in``), which is why a
3-node lab is wired in tens of milliseconds rather than seconds.

Never: create, move or configure anything in the root namespace. Each veth
is created *inside* a lab namespace with its peer placed directly into
another lab namespace, so no link ever exists outside the lab, even for an
instant. Never start processes either: that is ``lab.cluster``'s job.

::

      client 10.79.0.100 ── eth0 ─┐  default via 10.79.0.1; each externalIP via 10.79.0.1
                                  │ 10.79.0.0/24 (the "outside world")
                  eth1 10.79.0.1 ─┤ lb   (router between the client and the nodes;
                  eth0 10.77.0.2 ─┘       the external LB lives here)
                                  │  each externalIP/32 via its node (cluster.externalIPRoutes)
      sw: br0 ── n1, n2, ..., lb     10.77.0.0/24, the node network
                  │
      nodeI: eth0 10.77.0.(10+I)   ip_forward=1
             cbr0 10.244.I.1/24    the node's pod bridge
             routes: 10.244.J.0/24 via node J; 10.79.0.0/24 via 10.77.0.2;
                     the service CIDR (10.96.0.0/16) via 10.77.0.2
                  │
      pod:   eth0 10.244.I.(10+K)/24, default via 10.244.I.1

A lab that mirrors a cluster (``cluster.nodeIPs`` in the lab file, ``kpx
lab up --from-state``) keeps that cluster's addresses, which may lie in any
subnet, so the same fabric is wired with host routes instead of shared
subnets::

      lb:    eth0 10.77.0.2/24; each node's IP/32 dev eth0; each node's pod
             networks via that node
      node:  eth0 <InternalIP>/32; 10.77.0.2/32 and every other node's IP/32
             dev eth0 (on-link: the bridge is one L2 segment whatever the
             subnets); the client network and the service CIDR via 10.77.0.2;
             every other node's pod networks via that node
             cbr0 169.254.1.1/32, and each local pod's IP/32 dev cbr0
      pod:   eth0 <its IP>/32, 169.254.1.1 dev eth0, default via 169.254.1.1

A link-local gateway (what Calico does) works for any pod address, whether
the node has a podCIDR or the pods share the node's VPC subnet (EKS, AKS
with Azure CNI), and it takes no address a real pod could have. Only the
router's and the client's networks stay the lab's own (``INFRA_NETWORKS``).

Dual-stack (``kpx lab up --dual-stack``, ``cluster.dualStack: true``): the
same picture again in IPv6 ULA space (``fd00::/8``), beside the IPv4 one
on the same links::

      client fd00:79::100/64, default via fd00:79::1
      lb     eth1 fd00:79::1/64, eth0 fd00:77::2/64; fd00:244:0:I::/64 via node I
      nodeI  eth0 fd00:77::(10+I)/64 (hex digits that read as 10.77.0.(10+I));
             cbr0 fd00:244:0:I::1/64; fd00:244:0:J::/64 via node J;
             fd00:79::/64 and the IPv6 service CIDR via fd00:77::2
      pod    eth0 fd00:244:0:I::(10+K)/64, default via fd00:244:0:I::1

IPv6 forwarding is turned on in the router namespaces only (the lb and the
nodes: ``net.ipv6.conf.all.forwarding`` inside them). Every address is added
with ``nodad`` and the namespaces have ``accept_dad`` off (link-local
addresses included), so an address is usable the moment it exists: no
"tentative" window to sleep through. The bridges' multicast snooping is off,
so neighbour solicitations reach every port whether or not an MLD report
was seen. A lab with given addresses (``cluster.nodeIPs``) stays IPv4-only.

Service VIPs: a pod's default route already takes a ClusterIP (or an
externalIP, or the LB's ingress IP) to its node, where kpx takes it. A node
has no default route, so it gets one for the service CIDR, via the router,
as its default route would send it on a real node: the connect() then
leaves the socket layer, and whatever kpx installs on the node decides.
ExternalIPs are routed like a cloud router would route them: the client
sends them to the lb namespace, which sends each to one node; the node
accepts it only if kpx makes it local (until then the node has no route
and the lb namespace no default route, so nothing leaves the lab).

The client's address is outside the node subnet, so it is a genuinely
external client: every reply to it must be routed back through the lb
namespace, as on a real cluster behind a cloud LB. rp_filter is off
everywhere because transparent (client-IP-preserving) forwarding makes
asymmetric-looking paths.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import socket
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from lab import netns

log = logging.getLogger(__name__)

NODE_NET = "10.77.0.0/24"
NODE_PREFIXLEN = 24
LB_NODE_IP = "10.77.0.2"
CLIENT_NET = "10.79.0.0/24"
LB_CLIENT_IP = "10.79.0.1"
CLIENT_IP = "10.79.0.100"
POD_PREFIXLEN = 24
POD_NETWORK = "10.244.0.0/16"
"""Every node's pod CIDR (``pod_cidr``) lies in it."""
LAB_NETWORKS: dict[str, str] = {"node network": NODE_NET, "client network": CLIENT_NET,
                                "pod network": POD_NETWORK}
"""The lab's own address space: no service CIDR or externalIP may overlap it."""
GIVEN_POD_GATEWAY = "169.254.1.1"
"""Every pod's gateway in a lab with given addresses: on the node's cbr0, on-link in the pod."""
INFRA_NETWORKS: dict[str, str] = {"node network": NODE_NET, "client network": CLIENT_NET,
                                  "link-local network": "169.254.0.0/16"}
"""What a lab with given addresses still keeps for itself: the router's and the
client's networks, and the link-local range of its pods' gateway."""
EXTERNAL_IP_PROTO = 177
"""The route protocol number that marks the lab's externalIP routes, so a later
``sync_external_ip_routes`` finds (and removes) exactly its own."""

BASE_SYSCTLS: dict[str, str | int] = {
    "net.ipv4.conf.all.rp_filter": 0,
    "net.ipv4.conf.default.rp_filter": 0,
}
ROUTER_SYSCTLS: dict[str, str | int] = {**BASE_SYSCTLS, "net.ipv4.ip_forward": 1}

# --- IPv6 (dual-stack labs only) ---------------------------------------------------
NODE_NET6 = "fd00:77::/64"
LB_NODE_IP6 = "fd00:77::2"
CLIENT_NET6 = "fd00:79::/64"
LB_CLIENT_IP6 = "fd00:79::1"
CLIENT_IP6 = "fd00:79::100"
PREFIXLEN6 = 64
POD_NETWORK6 = "fd00:244::/48"
"""Every node's IPv6 pod CIDR (``pod_cidr6``) lies in it."""
SERVICE_CIDR6 = "fd00:10:96::/112"
"""Where IPv6 ClusterIPs come from (kind's default IPv6 service range)."""
LAB_NETWORKS6: dict[str, str] = {"IPv6 node network": NODE_NET6,
                                 "IPv6 client network": CLIENT_NET6,
                                 "IPv6 pod network": POD_NETWORK6}
"""The lab's own IPv6 address space: no IPv6 service address may overlap it."""
IFA_F_NODAD = 0x02
"""``ip addr add ... nodad``: the address skips duplicate address detection."""
DAD_SYSCTLS: dict[str, str | int] = {
    "net.ipv6.conf.all.accept_dad": 0,
    "net.ipv6.conf.default.accept_dad": 0,
}
"""Set before any link exists, so even link-local addresses are never tentative."""
ROUTER_SYSCTLS6: dict[str, str | int] = {**DAD_SYSCTLS, "net.ipv6.conf.all.forwarding": 1}


def node_ip6(index: int) -> str:
    """Node *index* (1-based) lives at fd00:77::(10+index) (hex, read like its IPv4 one)."""
    return f"fd00:77::{10 + index}"


def pod_cidr6(index: int) -> str:
    return f"fd00:244:0:{index}::/64"


def pod_gateway6(index: int) -> str:
    return f"fd00:244:0:{index}::1"


def pod_ip6(node_index: int, slot: int) -> str:
    """Pod *slot* of node *node_index*: fd00:244:0:node::(10+slot), read like its IPv4 one.

    Decimal digits used as hex groups (node 1's pod 1 is fd00:244:0:1::11),
    so an address says which node and slot it is at a glance."""
    return f"fd00:244:0:{node_index}::{10 + slot}"


def node_ip(index: int) -> str:
    """Node *index* (1-based) lives at 10.77.0.(10+index)."""
    return f"10.77.0.{10 + index}"


def pod_cidr(index: int) -> str:
    return f"10.244.{index}.0/24"


def pod_gateway(index: int) -> str:
    return f"10.244.{index}.1"


def pod_ip(node_index: int, slot: int) -> str:
    """Pod *slot* (1-based) of node *node_index*: 10.244.node.(10+slot)."""
    return f"10.244.{node_index}.{10 + slot}"


def pod_host_ifname(slot: int) -> str:
    """The node-side end of a pod's veth; unique per node because slots are."""
    return f"veth{slot}"


@dataclass(frozen=True)
class Plan:
    """Names and addresses of a lab, derived from its prefix and node list.

    With ``node_ips`` (a mirrored cluster's addresses, all nodes or none) the
    nodes have those, their pods the ones they are given, and ``pod_cidrs``
    says which networks each node routes to its pods.
    """

    prefix: str
    nodes: tuple[str, ...]
    node_ips: Mapping[str, str] = field(default_factory=dict)
    pod_cidrs: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    dual_stack: bool = False
    """Every node, pod, the client and the lb also get an IPv6 address (the lab's plan only)."""

    @property
    def given(self) -> bool:
        """Whether addresses are given (a mirrored cluster) rather than the lab's plan."""
        return bool(self.node_ips)

    def pod_networks_of(self, node: str) -> tuple[str, ...]:
        """The networks routed to *node*'s pods."""
        if self.given:
            return tuple(self.pod_cidrs.get(node, ()))
        return (pod_cidr(self.node_index(node)),)

    @property
    def pod_networks(self) -> tuple[str, ...]:
        """Every node's pod networks, merged: kpx's ``--cluster-cidr``, the LB's masquerade."""
        if not self.given:
            return (POD_NETWORK,)
        nets = [ipaddress.ip_network(n) for node in self.nodes for n in self.pod_networks_of(node)]
        return tuple(str(n) for n in ipaddress.collapse_addresses(nets))  # type: ignore[arg-type]

    @property
    def sw(self) -> str:
        return f"{self.prefix}-sw"

    @property
    def lb(self) -> str:
        return f"{self.prefix}-lb"

    @property
    def client(self) -> str:
        return f"{self.prefix}-client"

    def node_ns(self, node: str) -> str:
        return f"{self.prefix}-{node}"

    def pod_ns(self, pod: str) -> str:
        return f"{self.prefix}-{pod}"

    def node_index(self, node: str) -> int:
        return self.nodes.index(node) + 1

    def node_ip(self, node: str) -> str:
        if self.given:
            return self.node_ips[node]
        return node_ip(self.node_index(node))

    def pod_ip6(self, node: str, slot: int) -> str | None:
        """The IPv6 address of the pod in *slot* of *node*; None in an IPv4-only lab."""
        return pod_ip6(self.node_index(node), slot) if self.dual_stack else None

    def node_ip6(self, node: str) -> str | None:
        """*node*'s IPv6 address; None in an IPv4-only lab."""
        return node_ip6(self.node_index(node)) if self.dual_stack else None

    def pod_networks6_of(self, node: str) -> tuple[str, ...]:
        """The IPv6 networks routed to *node*'s pods (none in an IPv4-only lab)."""
        return (pod_cidr6(self.node_index(node)),) if self.dual_stack else ()

    @property
    def pod_networks6(self) -> tuple[str, ...]:
        """Every node's IPv6 pod networks, merged (empty in an IPv4-only lab)."""
        return (POD_NETWORK6,) if self.dual_stack else ()

    def infra_namespaces(self) -> list[str]:
        return [self.sw, self.lb, self.client, *(self.node_ns(n) for n in self.nodes)]


@contextlib.contextmanager
def _handles(names: Sequence[str]) -> Iterator[dict[str, Any]]:
    hs: dict[str, Any] = {}
    try:
        for n in names:
            hs[n] = netns.iproute_in(n)
        yield hs
    finally:
        for h in hs.values():
            with contextlib.suppress(Exception):
                h.close()


def _idx(ipr: Any, ifname: str) -> int:
    found = ipr.link_lookup(ifname=ifname)
    if not found:
        raise RuntimeError(f"interface {ifname} not found")
    return int(found[0])


def _veth(ipr: Any, ifname: str, peer_ns: str, peer_ifname: str) -> None:
    """A veth whose near end is *ifname* here and whose far end is born in *peer_ns*."""
    fd = os.open(netns.ns_path(peer_ns), os.O_RDONLY | os.O_CLOEXEC)
    try:
        ipr.link("add", ifname=ifname, kind="veth",
                 peer={"ifname": peer_ifname, "net_ns_fd": fd})
    finally:
        os.close(fd)


def _up(ipr: Any, ifname: str, **kw: Any) -> int:
    idx = _idx(ipr, ifname)
    ipr.link("set", index=idx, state="up", **kw)
    return idx


def _addr6(ipr: Any, ifname: str, address: str, prefixlen: int = PREFIXLEN6) -> None:
    """An IPv6 address added ``nodad``: usable at once, never tentative."""
    ipr.addr("add", index=_idx(ipr, ifname), address=address, prefixlen=prefixlen,
             flags=IFA_F_NODAD)


def build_fabric(plan: Plan, service_cidr: str = "10.96.0.0/16",
                 service_cidr6: str = SERVICE_CIDR6) -> None:
    """Create every infrastructure namespace and wire it (not the pods).

    The namespaces must not exist yet. On failure the caller tears down by
    prefix, so nothing here needs its own rollback.
    """
    for ns in plan.infra_namespaces():
        netns.create(ns)
    for ns in plan.infra_namespaces():
        router = ns != plan.sw and ns != plan.client
        sysctls = ROUTER_SYSCTLS if router else BASE_SYSCTLS
        if plan.dual_stack:
            sysctls = {**sysctls, **(ROUTER_SYSCTLS6 if router else DAD_SYSCTLS)}
        netns.sysctl_in(ns, sysctls)

    with _handles(plan.infra_namespaces()) as h:
        for ipr in h.values():
            _up(ipr, "lo")
        sw = h[plan.sw]
        sw.link("add", ifname="br0", kind="bridge", br_stp_state=0, br_forward_delay=0,
                **_bridge_extra(plan))
        br = _up(sw, "br0")

        # lb: one leg on the node network, one on the client network.
        lb, client = h[plan.lb], h[plan.client]
        _veth(lb, "eth0", plan.sw, "lb")
        _up(sw, "lb", master=br)
        lb.addr("add", index=_idx(lb, "eth0"), address=LB_NODE_IP, prefixlen=NODE_PREFIXLEN)
        _up(lb, "eth0")
        _veth(lb, "eth1", plan.client, "eth0")
        lb.addr("add", index=_idx(lb, "eth1"), address=LB_CLIENT_IP, prefixlen=24)
        _up(lb, "eth1")
        client.addr("add", index=_idx(client, "eth0"), address=CLIENT_IP, prefixlen=24)
        _up(client, "eth0")
        client.route("add", dst="0.0.0.0/0", gateway=LB_CLIENT_IP)
        if plan.given:
            _wire_given_nodes(plan, h, br, service_cidr)
            return
        # The LB answers pods that dial it (a Proxy-mode LB IP, a proxy-mode
        # LB's own connections back): each node's pod CIDR via that node.
        for i, _ in enumerate(plan.nodes, start=1):
            lb.route("add", dst=pod_cidr(i), gateway=node_ip(i))

        for i, node in enumerate(plan.nodes, start=1):
            ipr = h[plan.node_ns(node)]
            _veth(ipr, "eth0", plan.sw, f"n{i}")
            _up(sw, f"n{i}", master=br)
            ipr.addr("add", index=_idx(ipr, "eth0"), address=node_ip(i),
                     prefixlen=NODE_PREFIXLEN)
            _up(ipr, "eth0")
            ipr.link("add", ifname="cbr0", kind="bridge", br_stp_state=0, br_forward_delay=0,
                     **_bridge_extra(plan))
            ipr.addr("add", index=_idx(ipr, "cbr0"), address=pod_gateway(i),
                     prefixlen=POD_PREFIXLEN)
            _up(ipr, "cbr0")
            ipr.route("add", dst=CLIENT_NET, gateway=LB_NODE_IP)
            ipr.route("add", dst=service_cidr, gateway=LB_NODE_IP)
            for j, _ in enumerate(plan.nodes, start=1):
                if j != i:
                    ipr.route("add", dst=pod_cidr(j), gateway=node_ip(j))
        if plan.dual_stack:
            _wire_ipv6(plan, h, service_cidr6)


def _bridge_extra(plan: Plan) -> dict[str, Any]:
    """A dual-stack lab's bridges flood multicast (neighbour solicitations) to every port."""
    return {"br_mcast_snooping": 0} if plan.dual_stack else {}


def _wire_ipv6(plan: Plan, h: Mapping[str, Any], service_cidr6: str) -> None:
    """The IPv6 half of a dual-stack fabric, on the links the IPv4 half made (see above)."""
    lb, client = h[plan.lb], h[plan.client]
    _addr6(lb, "eth0", LB_NODE_IP6)
    _addr6(lb, "eth1", LB_CLIENT_IP6)
    _addr6(client, "eth0", CLIENT_IP6)
    client.route("add", dst="::/0", gateway=LB_CLIENT_IP6)
    for i, node in enumerate(plan.nodes, start=1):
        lb.route("add", dst=pod_cidr6(i), gateway=node_ip6(i))
        ipr = h[plan.node_ns(node)]
        _addr6(ipr, "eth0", node_ip6(i))
        _addr6(ipr, "cbr0", pod_gateway6(i))
        ipr.route("add", dst=CLIENT_NET6, gateway=LB_NODE_IP6)
        ipr.route("add", dst=service_cidr6, gateway=LB_NODE_IP6)
        for j, _ in enumerate(plan.nodes, start=1):
            if j != i:
                ipr.route("add", dst=pod_cidr6(j), gateway=node_ip6(j))


def _wire_given_nodes(plan: Plan, h: Mapping[str, Any], br: int, service_cidr: str) -> None:
    """The nodes of a lab with given addresses: host routes on one L2 segment (see above)."""
    sw, lb = h[plan.sw], h[plan.lb]
    lb_eth0 = _idx(lb, "eth0")
    for node in plan.nodes:
        lb.route("add", dst=f"{plan.node_ip(node)}/32", oif=lb_eth0, scope=253)
        for net in plan.pod_networks_of(node):
            lb.route("add", dst=net, gateway=plan.node_ip(node))
    for i, node in enumerate(plan.nodes, start=1):
        ipr = h[plan.node_ns(node)]
        _veth(ipr, "eth0", plan.sw, f"n{i}")  # switch ports by index: IFNAMSIZ is 15
        _up(sw, f"n{i}", master=br)
        eth0 = _idx(ipr, "eth0")
        ipr.addr("add", index=eth0, address=plan.node_ip(node), prefixlen=32)
        _up(ipr, "eth0")
        ipr.link("add", ifname="cbr0", kind="bridge", br_stp_state=0, br_forward_delay=0)
        ipr.addr("add", index=_idx(ipr, "cbr0"), address=GIVEN_POD_GATEWAY, prefixlen=32)
        _up(ipr, "cbr0")
        for peer in (LB_NODE_IP, *(plan.node_ip(n) for n in plan.nodes if n != node)):
            ipr.route("add", dst=f"{peer}/32", oif=eth0, scope=253)
        ipr.route("add", dst=CLIENT_NET, gateway=LB_NODE_IP)
        ipr.route("add", dst=service_cidr, gateway=LB_NODE_IP)
        for other in plan.nodes:
            if other != node:
                for net in plan.pod_networks_of(other):
                    ipr.route("add", dst=net, gateway=plan.node_ip(other))


def sync_external_ip_routes(plan: Plan, routes: Mapping[str, str]) -> None:
    """Route each externalIP (``routes``: ip -> node name) from the client and the lb.

    The client sends it to the lb namespace (its router), the lb to the
    node. Only routes marked ``EXTERNAL_IP_PROTO`` are touched: those no
    longer wanted are deleted, changed ones replaced, so a ``kpx lab apply``
    converges without any record of what the last one installed.
    """
    want = {
        plan.client: {ip: LB_CLIENT_IP for ip in routes},
        plan.lb: {ip: plan.node_ip(node) for ip, node in routes.items()},
    }
    with _handles(list(want)) as h:
        for ns, wanted in want.items():
            ipr = h[ns]
            have = {r.get_attr("RTA_DST"): r.get_attr("RTA_GATEWAY")
                    for r in ipr.get_routes(family=socket.AF_INET, table=254)
                    if r["proto"] == EXTERNAL_IP_PROTO}
            for ip in have.keys() - wanted.keys():
                ipr.route("del", dst=f"{ip}/32", proto=EXTERNAL_IP_PROTO)
            for ip, gateway in wanted.items():
                if have.get(ip) != gateway:
                    ipr.route("replace", dst=f"{ip}/32", gateway=gateway,
                              proto=EXTERNAL_IP_PROTO)


def add_pod(plan: Plan, pod: str, node: str, slot: int, given_ip: str | None = None) -> str:
    """Create pod *pod*'s namespace behind *node* in *slot*; returns its IP.

    *given_ip* (a lab with given addresses) is the pod's address: a /32 with
    the link-local gateway, and a host route to it on the node's cbr0. In a
    dual-stack lab the pod also gets ``pod_ip6(node, slot)`` and an IPv6
    default route via its node's cbr0 (``plan.pod_ip6`` gives the address).
    """
    i = plan.node_index(node)
    ns = plan.pod_ns(pod)
    ip = given_ip or pod_ip(i, slot)
    netns.create(ns)
    try:
        netns.sysctl_in(ns, {**BASE_SYSCTLS, **DAD_SYSCTLS} if plan.dual_stack else BASE_SYSCTLS)
        with _handles([plan.node_ns(node), ns]) as h:
            host, pipr = h[plan.node_ns(node)], h[ns]
            hif = pod_host_ifname(slot)
            if host.link_lookup(ifname=hif):  # a leftover from a failed removal
                host.link("del", index=_idx(host, hif))
            _veth(host, hif, ns, "eth0")
            port = _up(host, hif, master=_idx(host, "cbr0"))
            # Hairpin, as kubelet's --hairpin-mode=hairpin-veth sets it: a pod's
            # packet to its own Service, DNATed back to itself by the kernel
            # (nfqueue mode; iptables mode alike), leaves the bridge by the
            # port it came in on. (IFLA_BRPORT_MODE is pyroute2's ``mode``.)
            host.brport("set", index=port, mode=1)
            _up(pipr, "lo")
            if given_ip:
                eth0 = _idx(pipr, "eth0")
                pipr.addr("add", index=eth0, address=ip, prefixlen=32)
                _up(pipr, "eth0")
                pipr.route("add", dst=f"{GIVEN_POD_GATEWAY}/32", oif=eth0, scope=253)
                pipr.route("add", dst="0.0.0.0/0", gateway=GIVEN_POD_GATEWAY)
                host.route("replace", dst=f"{ip}/32", oif=_idx(host, "cbr0"), scope=253)
            else:
                pipr.addr("add", index=_idx(pipr, "eth0"), address=ip,
                          prefixlen=POD_PREFIXLEN)
                _up(pipr, "eth0")
                pipr.route("add", dst="0.0.0.0/0", gateway=pod_gateway(i))
                if plan.dual_stack:
                    _addr6(pipr, "eth0", pod_ip6(i, slot))
                    pipr.route("add", dst="::/0", gateway=pod_gateway6(i))
    except BaseException:
        netns.remove(ns)
        raise
    return ip


def remove_pod(plan: Plan, pod: str, node: str, slot: int, given_ip: str | None = None) -> None:
    """Unplug and delete pod *pod*'s namespace (its processes must be gone).

    The node-side veth is deleted explicitly: namespace destruction is
    asynchronous in the kernel, and a pod re-created at once in the same slot
    would otherwise collide with the dying veth's name.
    """
    with contextlib.suppress(netns.NetnsError, OSError), _handles([plan.node_ns(node)]) as h:
        host = h[plan.node_ns(node)]
        found = host.link_lookup(ifname=pod_host_ifname(slot))
        if found:
            host.link("del", index=found[0])
        if given_ip:  # its host route stays on cbr0 otherwise
            with contextlib.suppress(Exception):
                host.route("del", dst=f"{given_ip}/32")
    netns.remove(plan.pod_ns(pod))
