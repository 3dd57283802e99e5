"""kube-proxy's own rule layouts, written as kube-proxy writes them: iptables-restore and nft input.

Owns: turning service ports (with their endpoints) into the exact text
kube-proxy's iptables proxier hands ``iptables-restore`` and its nftables
proxier hands ``nft -f``, for a full sync and for a partial sync after one
service's endpoints changed, plus the chain-name hashing both use.

Never: run anything. The scale bench loads the text into a namespace; the
fixture tests (``tests/bench/fixtures/kube_proxy``) compare it line for line
with kube-proxy's own expected dumps from its ``proxier_test.go`` files.

Followed from kubernetes/kubernetes (the exact files are named in
``tests/bench/fixtures/kube_proxy/SOURCES.md``):

- ``pkg/proxy/iptables/proxier.go``: ``syncProxyRules``,
  ``writeServiceToEndpointRules``, ``portProtoHash`` and
  ``servicePortEndpointChainName``, ``iptablesJumpChains``;
- ``pkg/proxy/nftables/proxier.go``: ``setupNFTables``, ``syncProxyRules``,
  ``writeServiceToEndpointRules``, ``hashAndTruncate``; the base chains follow
  the newer layout pinned by ``TestOverallNFTablesRules`` (``filter-*-pre-dnat``
  at priority -110 and the filter chains at 0).

What is reproduced, and what is not (the bench's services need none of the
latter, and a fixture service that does is left out of its comparison, with
why, in the test): ClusterIP, NodePort, externalIPs and LoadBalancer IPs,
external and internal traffic policy, no-endpoint REJECT/DROP,
healthCheckNodePort, large-cluster mode (over 1,000 endpoints: no comments
on KUBE-SEP and KUBE-SVC to KUBE-SEP rules), localhost NodePorts with their
nfacct rule. Not: session affinity, loadBalancerSourceRanges, topology hints,
terminating-endpoint fallback, IPv6.

Theory of operation: every function is a pure map from (services, node
config) to text; kube-proxy iterates a Go map, so its service order is
random and its tests compare sorted; here services come out in input order.
"""

from __future__ import annotations

import base64
import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

LARGE_CLUSTER_ENDPOINTS = 1000
"""kube-proxy's ``largeClusterEndpointsThreshold``: above it, iptables rules lose comments."""
LOCALHOST_NP_NFACCT = "localhost_nps_accepted_pkts"
INVALID_NFACCT = "ct_state_invalid_dropped_pkts"
NFT_TABLE = "kube-proxy"


# ---- input --------------------------------------------------------------------------


@dataclass(frozen=True)
class Endpoint:
    """One endpoint of a service port: what ``BaseEndpointInfo`` holds that matters here."""

    ip: str
    port: int
    node: str | None = None
    ready: bool = True

    def __str__(self) -> str:
        return f"{self.ip}:{self.port}"


@dataclass(frozen=True)
class ServicePort:
    """One port of one Service with its endpoints (kube-proxy's ``servicePortInfo``)."""

    namespace: str
    name: str
    port_name: str
    cluster_ip: str
    port: int
    protocol: str = "TCP"
    node_port: int = 0
    external_ips: tuple[str, ...] = ()
    lb_ips: tuple[str, ...] = ()
    etp_local: bool = False
    """externalTrafficPolicy: Local (only meaningful when externally accessible)."""
    itp_local: bool = False
    health_check_node_port: int = 0
    endpoints: tuple[Endpoint, ...] = ()

    @property
    def name_string(self) -> str:
        """``ServicePortName.String()``: ``ns/name:port`` (``ns/name`` for an unnamed port)."""
        suffix = f":{self.port_name}" if self.port_name else ""
        return f"{self.namespace}/{self.name}{suffix}"

    @property
    def proto(self) -> str:
        return self.protocol.lower()

    @property
    def externally_accessible(self) -> bool:
        return bool(self.node_port or self.external_ips or self.lb_ips)

    @property
    def external_policy_local(self) -> bool:
        return self.etp_local and self.externally_accessible

    @property
    def uses_cluster_endpoints(self) -> bool:
        return not self.itp_local or (self.externally_accessible and not self.external_policy_local)

    @property
    def uses_local_endpoints(self) -> bool:
        return self.itp_local or self.external_policy_local


@dataclass(frozen=True)
class NodeConfig:
    """The proxier's settings that change its output."""

    node_name: str
    node_ip: str
    pod_cidr: str | None = "10.0.0.0/8"
    """``DetectLocalByCIDR``: None means no local-traffic detector (no masquerade rule)."""
    masquerade_mark: str = "0x4000"
    localhost_nodeports: bool = True
    nfacct: bool = False
    """Whether the nfacct counters exist (kube-proxy adds the nfacct matches only then)."""
    random_fully: bool = False
    """``iptables.HasRandomFully()``: ``--random-fully`` on the MASQUERADE rule."""
    conntrack_liberal: bool = False
    nodeport_addresses: tuple[str, ...] = ()
    """Empty: NodePorts on every local address (``MatchAll``); else these node IPs."""
    service_cidrs: tuple[str, ...] = ()
    """nftables only: traffic to an unallocated address in these is dropped."""


@dataclass(frozen=True)
class _Categorized:
    """``proxy.CategorizeEndpoints``'s four results (no topology, no terminating fallback)."""

    cluster: list[Endpoint]
    local: list[Endpoint]
    reachable: list[Endpoint]
    has_endpoints: bool


def categorize(svc: ServicePort, node_name: str) -> _Categorized:
    """Which endpoints each traffic policy uses, as ``CategorizeEndpoints`` decides.

    Endpoints come out sorted by ``ip:port`` as text: kube-proxy's
    endpoints map keeps them in that order, and the probabilities and the
    ``numgen`` indexes follow it.
    """
    ready = sorted((e for e in svc.endpoints if e.ready), key=str)
    cluster = ready if svc.uses_cluster_endpoints else []
    local = [e for e in ready if e.node == node_name] if svc.uses_local_endpoints else []
    reachable = sorted({*cluster, *local}, key=str)
    return _Categorized(cluster, local, reachable, bool(ready))


def total_endpoints(services: Iterable[ServicePort]) -> int:
    return sum(len(s.endpoints) for s in services)


# ---- names ----------------------------------------------------------------------------


def _b32(data: str) -> str:
    return base64.b32encode(hashlib.sha256(data.encode()).digest()).decode()


def port_proto_hash(name_string: str, protocol: str) -> str:
    """iptables ``portProtoHash``: base32(sha256(name + protocol))[:16]."""
    return _b32(name_string + protocol)[:16]


def ipt_chains(svc: ServicePort) -> dict[str, str]:
    """The service's KUBE-SVC/SVL/EXT/FW chain names (iptables)."""
    h = port_proto_hash(svc.name_string, svc.proto)
    return {"svc": f"KUBE-SVC-{h}", "svl": f"KUBE-SVL-{h}", "ext": f"KUBE-EXT-{h}",
            "fw": f"KUBE-FW-{h}"}


def ipt_sep(svc: ServicePort, ep: Endpoint) -> str:
    """iptables ``servicePortEndpointChainName``: sha256(name + protocol + ``ip:port``)."""
    return "KUBE-SEP-" + _b32(svc.name_string + svc.proto + str(ep))[:16]


def _hash_and_truncate(name: str) -> str:
    """nftables ``hashAndTruncate`` (the 240-character limit is never reached here)."""
    return f"{_b32(name)[:8]}-{name}"


def nft_base(svc: ServicePort) -> str:
    """``servicePortChainNameBase``: ``HASH-ns/name/proto/port``."""
    return _hash_and_truncate(f"{svc.namespace}/{svc.name}/{svc.proto}/{svc.port_name}")


def nft_endpoint_chain(svc: ServicePort, ep: Endpoint) -> str:
    base = _hash_and_truncate(
        f"{svc.namespace}/{svc.name}/{svc.proto}/{svc.port_name}__{ep.ip}/{ep.port}")
    return f"endpoint-{base}"


# ---- iptables -------------------------------------------------------------------------


def _q(text: str) -> str:
    """A comment as kube-proxy writes it: quoted only when it has a space."""
    return f'"{text}"' if " " in text else text


def _probability(n: int) -> str:
    return f"{1.0 / n:0.10f}"


@dataclass
class _Tables:
    filter_chains: list[str] = field(default_factory=list)
    filter_rules: list[str] = field(default_factory=list)
    nat_chains: list[str] = field(default_factory=list)
    nat_rules: list[str] = field(default_factory=list)

    def text(self) -> str:
        return "\n".join(["*filter", *self.filter_chains, *self.filter_rules, "COMMIT",
                          "*nat", *self.nat_chains, *self.nat_rules, "COMMIT"]) + "\n"


def iptables_restore(services: Sequence[ServicePort], cfg: NodeConfig,
                     changed: frozenset[str] | None = None) -> str:
    """The ``iptables-restore --noflush`` input of one ``syncProxyRules``.

    ``changed``: None is a full sync; otherwise a partial sync in which
    only the services whose ``name_string`` is in it get their KUBE-SVC,
    KUBE-EXT and KUBE-SEP chains rewritten (every other chain line and rule
    of the top-level chains is written every time, as kube-proxy does). A
    partial sync in large-cluster mode does not delete stale chains
    (kube-proxy does that at most once per sync period there).
    """
    t = _Tables()
    mark = cfg.masquerade_mark
    large = total_endpoints(services) > LARGE_CLUSTER_ENDPOINTS
    for c in ("KUBE-SERVICES", "KUBE-EXTERNAL-SERVICES", "KUBE-FORWARD", "KUBE-NODEPORTS",
              "KUBE-PROXY-FIREWALL"):
        t.filter_chains.append(f":{c} - [0:0]")
    for c in ("KUBE-SERVICES", "KUBE-NODEPORTS", "KUBE-POSTROUTING", "KUBE-MARK-MASQ"):
        t.nat_chains.append(f":{c} - [0:0]")
    t.nat_rules += [
        f"-A KUBE-POSTROUTING -m mark ! --mark {mark}/{mark} -j RETURN",
        f"-A KUBE-POSTROUTING -j MARK --xor-mark {mark}",
        '-A KUBE-POSTROUTING -m comment --comment "kubernetes service traffic requiring SNAT"'
        " -j MASQUERADE" + (" --random-fully" if cfg.random_fully else ""),
        f"-A KUBE-MARK-MASQ -j MARK --or-mark {mark}",
    ]
    if cfg.localhost_nodeports:
        t.filter_chains.append(":KUBE-FIREWALL - [0:0]")
        t.filter_rules.append(
            '-A KUBE-FIREWALL -m comment --comment "block incoming localnet connections"'
            " -d 127.0.0.0/8 ! -s 127.0.0.0/8 -m conntrack ! --ctstate RELATED,ESTABLISHED,DNAT"
            " -j DROP")
    for svc in services:
        write_all = changed is None or svc.name_string in changed
        _ipt_service(t, svc, cfg, large, write_all)
    if not cfg.nodeport_addresses:
        dest = "-m addrtype --dst-type LOCAL" + (
            "" if cfg.localhost_nodeports else " ! -d 127.0.0.0/8")
        t.nat_rules.append(
            '-A KUBE-SERVICES -m comment --comment "kubernetes service nodeports; NOTE: this must'
            f' be the last rule in this chain" {dest} -j KUBE-NODEPORTS')
    else:
        for ip in cfg.nodeport_addresses:
            t.nat_rules.append(
                '-A KUBE-SERVICES -m comment --comment "kubernetes service nodeports; NOTE: this'
                f' must be the last rule in this chain" -d {ip} -j KUBE-NODEPORTS')
    if not cfg.conntrack_liberal:
        acct = f" -m nfacct --nfacct-name {INVALID_NFACCT}" if cfg.nfacct else ""
        t.filter_rules.append(f"-A KUBE-FORWARD -m conntrack --ctstate INVALID{acct} -j DROP")
    t.filter_rules += [
        '-A KUBE-FORWARD -m comment --comment "kubernetes forwarding rules"'
        f" -m mark --mark {mark}/{mark} -j ACCEPT",
        '-A KUBE-FORWARD -m comment --comment "kubernetes forwarding conntrack rule"'
        " -m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT",
    ]
    return t.text()


def _ipt_service(t: _Tables, svc: ServicePort, cfg: NodeConfig, large: bool,
                 write_all: bool) -> None:
    """One service port's part of ``syncProxyRules`` (the loop body), in its order."""
    p, name = svc.proto, svc.name_string
    ch = ipt_chains(svc)
    cat = categorize(svc, cfg.node_name)
    uses_cluster = bool(cat.cluster) and svc.uses_cluster_endpoints
    uses_local = bool(cat.local) and svc.uses_local_endpoints
    internal_chain = ch["svl"] if svc.itp_local else ch["svc"]
    has_internal = cat.has_endpoints and not (svc.itp_local and not cat.local)
    external_policy = ch["svl"] if svc.external_policy_local else ch["svc"]
    has_external = cat.has_endpoints and not (svc.external_policy_local and not cat.local)
    uses_ext = cat.has_endpoints and svc.externally_accessible
    if not cat.has_endpoints:
        int_target = ext_target = "REJECT"
        int_comment = ext_comment = f'"{name} has no endpoints"'
    else:
        int_target = ext_target = "DROP"
        int_comment = ext_comment = f'"{name} has no local endpoints"'
    match = f"-m {p} -p {p}"
    if has_internal:
        t.nat_rules.append(f'-A KUBE-SERVICES -m comment --comment "{name} cluster IP" {match}'
                           f" -d {svc.cluster_ip} --dport {svc.port} -j {internal_chain}")
    else:
        t.filter_rules.append(f"-A KUBE-SERVICES -m comment --comment {int_comment} {match}"
                              f" -d {svc.cluster_ip} --dport {svc.port} -j {int_target}")
    for ip in svc.external_ips:
        if cat.has_endpoints:
            t.nat_rules.append(f'-A KUBE-SERVICES -m comment --comment "{name} external IP"'
                               f" {match} -d {ip} --dport {svc.port} -j {ch['ext']}")
        if not has_external:
            t.filter_rules.append(f"-A KUBE-EXTERNAL-SERVICES -m comment --comment {ext_comment}"
                                  f" {match} -d {ip} --dport {svc.port} -j {ext_target}")
    for ip in svc.lb_ips:
        if cat.has_endpoints:
            t.nat_rules.append(f'-A KUBE-SERVICES -m comment --comment "{name} loadbalancer IP"'
                               f" {match} -d {ip} --dport {svc.port} -j {ch['ext']}")
    if not has_external:
        for ip in svc.lb_ips:
            t.filter_rules.append(f"-A KUBE-EXTERNAL-SERVICES -m comment --comment {ext_comment}"
                                  f" {match} -d {ip} --dport {svc.port} -j {ext_target}")
    if svc.node_port:
        if cat.has_endpoints:
            if cfg.localhost_nodeports and cfg.nfacct:
                t.nat_rules.append(
                    f"-A KUBE-NODEPORTS -m comment --comment {_q(name)} {match} -d 127.0.0.0/8"
                    f" --dport {svc.node_port} -m nfacct --nfacct-name {LOCALHOST_NP_NFACCT}"
                    f" -j {ch['ext']}")
            t.nat_rules.append(f"-A KUBE-NODEPORTS -m comment --comment {_q(name)} {match}"
                               f" --dport {svc.node_port} -j {ch['ext']}")
        if not has_external:
            t.filter_rules.append(
                f"-A KUBE-EXTERNAL-SERVICES -m comment --comment {ext_comment}"
                f" -m addrtype --dst-type LOCAL {match} --dport {svc.node_port} -j {ext_target}")
    if svc.health_check_node_port:
        t.filter_rules.append(
            f'-A KUBE-NODEPORTS -m comment --comment "{name} health check node port"'
            f" -m tcp -p tcp --dport {svc.health_check_node_port} -j ACCEPT")
    if not write_all:
        return
    if has_internal and cfg.pod_cidr:
        t.nat_rules.append(f'-A {internal_chain} -m comment --comment "{name} cluster IP" {match}'
                           f" -d {svc.cluster_ip} --dport {svc.port} ! -s {cfg.pod_cidr}"
                           " -j KUBE-MARK-MASQ")
    if uses_ext:
        ext = ch["ext"]
        t.nat_chains.append(f":{ext} - [0:0]")
        if not svc.external_policy_local:
            t.nat_rules.append(f'-A {ext} -m comment --comment "masquerade traffic for {name}'
                               ' external destinations" -j KUBE-MARK-MASQ')
        else:
            if cfg.pod_cidr:
                t.nat_rules.append(f'-A {ext} -m comment --comment "pod traffic for {name}'
                                   f' external destinations" -s {cfg.pod_cidr} -j {ch["svc"]}')
            t.nat_rules.append(f'-A {ext} -m comment --comment "masquerade LOCAL traffic for'
                               f' {name} external destinations" -m addrtype --src-type LOCAL'
                               " -j KUBE-MARK-MASQ")
            t.nat_rules.append(f'-A {ext} -m comment --comment "route LOCAL traffic for {name}'
                               f' external destinations" -m addrtype --src-type LOCAL'
                               f" -j {ch['svc']}")
        if has_external:
            t.nat_rules.append(f"-A {ext} -j {external_policy}")
    for used, chain, eps in ((uses_cluster, ch["svc"], cat.cluster),
                             (uses_local, ch["svl"], cat.local)):
        if not used:
            continue
        t.nat_chains.append(f":{chain} - [0:0]")
        for i, ep in enumerate(eps):
            comment = "" if large else f' -m comment --comment "{name} -> {ep}"'
            stat = "" if i == len(eps) - 1 else \
                f" -m statistic --mode random --probability {_probability(len(eps) - i)}"
            t.nat_rules.append(f"-A {chain}{comment}{stat} -j {ipt_sep(svc, ep)}")
    for ep in cat.reachable:
        sep = ipt_sep(svc, ep)
        t.nat_chains.append(f":{sep} - [0:0]")
        comment = "" if large else f" -m comment --comment {_q(name)}"
        t.nat_rules.append(f"-A {sep}{comment} -s {ep.ip} -j KUBE-MARK-MASQ")
        t.nat_rules.append(f"-A {sep}{comment} {match} -j DNAT --to-destination {ep}")


IPT_JUMPS: tuple[tuple[str, str, str, str, str], ...] = (
    ("filter", "KUBE-EXTERNAL-SERVICES", "INPUT",
     "kubernetes externally-visible service portals", "-m conntrack --ctstate NEW"),
    ("filter", "KUBE-EXTERNAL-SERVICES", "FORWARD",
     "kubernetes externally-visible service portals", "-m conntrack --ctstate NEW"),
    ("filter", "KUBE-NODEPORTS", "INPUT", "kubernetes health check service ports", ""),
    ("filter", "KUBE-SERVICES", "FORWARD", "kubernetes service portals",
     "-m conntrack --ctstate NEW"),
    ("filter", "KUBE-SERVICES", "OUTPUT", "kubernetes service portals",
     "-m conntrack --ctstate NEW"),
    ("filter", "KUBE-FORWARD", "FORWARD", "kubernetes forwarding rules", ""),
    ("filter", "KUBE-PROXY-FIREWALL", "INPUT", "kubernetes load balancer firewall",
     "-m conntrack --ctstate NEW"),
    ("filter", "KUBE-PROXY-FIREWALL", "OUTPUT", "kubernetes load balancer firewall",
     "-m conntrack --ctstate NEW"),
    ("filter", "KUBE-PROXY-FIREWALL", "FORWARD", "kubernetes load balancer firewall",
     "-m conntrack --ctstate NEW"),
    ("nat", "KUBE-SERVICES", "OUTPUT", "kubernetes service portals", ""),
    ("nat", "KUBE-SERVICES", "PREROUTING", "kubernetes service portals", ""),
    ("nat", "KUBE-POSTROUTING", "POSTROUTING", "kubernetes postrouting rules", ""),
    ("filter", "KUBE-FIREWALL", "INPUT", "", ""),
    ("filter", "KUBE-FIREWALL", "OUTPUT", "", ""),
)
"""``iptablesJumpChains`` + ``iptablesKubeletJumpChains``: (table, chain, from, comment, extra)."""


def iptables_jumps() -> str:
    """The rules kube-proxy ensures with ``iptables -I`` (outside the restore), as restore input.

    Each is prepended, so the last one listed ends up first, as with
    kube-proxy's ``EnsureRule(Prepend, ...)`` calls in list order.
    """
    out: list[str] = []
    for table in ("filter", "nat"):
        out.append(f"*{table}")
        jumps = [j for j in IPT_JUMPS if j[0] == table]
        out += [f":{c} - [0:0]" for c in dict.fromkeys(j[1] for j in jumps)]
        for _, chain, src, comment, extra in jumps:
            parts = [f"-I {src}", extra, f'-m comment --comment "{comment}"' if comment else "",
                     f"-j {chain}"]
            out.append(" ".join(x for x in parts if x))
        out.append("COMMIT")
    return "\n".join(out) + "\n"


# ---- nftables -------------------------------------------------------------------------


def _nft(cmd: str) -> str:
    return cmd.replace("@T", f"ip {NFT_TABLE}")


def nft_base_rules(cfg: NodeConfig) -> list[str]:
    """``setupNFTables``: the table, its sets and maps, base and top-level chains."""
    m = cfg.masquerade_mark
    lines = [
        'add table @T { comment "rules for kube-proxy" ; }',
        'add set @T cluster-ips { type ipv4_addr ; comment "Active ClusterIPs" ; }',
        'add set @T nodeport-ips { type ipv4_addr ; comment "IPs that accept NodePort traffic" ; }',
        "add map @T firewall-ips { type ipv4_addr . inet_proto . inet_service : verdict ;"
        ' comment "destinations that are subject to LoadBalancerSourceRanges" ; }',
        "add map @T no-endpoint-nodeports { type inet_proto . inet_service : verdict ;"
        ' comment "vmap to drop or reject packets to service nodeports with no endpoints" ; }',
        "add map @T no-endpoint-services { type ipv4_addr . inet_proto . inet_service : verdict ;"
        ' comment "vmap to drop or reject packets to services with no endpoints" ; }',
        "add map @T service-ips { type ipv4_addr . inet_proto . inet_service : verdict ;"
        ' comment "ClusterIP, ExternalIP and LoadBalancer IP traffic" ; }',
        "add map @T service-nodeports { type inet_proto . inet_service : verdict ;"
        ' comment "NodePort traffic" ; }',
        "add chain @T cluster-ips-check",
        "add chain @T filter-prerouting-pre-dnat { type filter hook prerouting priority -110 ; }",
        "add chain @T filter-output-pre-dnat { type filter hook output priority -110 ; }",
        "add chain @T filter-forward { type filter hook forward priority 0 ; }",
        "add chain @T filter-input { type filter hook input priority 0 ; }",
        "add chain @T filter-output { type filter hook output priority 0 ; }",
        "add chain @T firewall-check",
        "add chain @T mark-for-masquerade",
        "add chain @T masquerading",
        "add chain @T nat-output { type nat hook output priority -100 ; }",
        "add chain @T nat-postrouting { type nat hook postrouting priority 100 ; }",
        "add chain @T nat-prerouting { type nat hook prerouting priority -100 ; }",
        "add chain @T nodeport-endpoints-check",
        'add chain @T reject-chain { comment "helper for @no-endpoint-services /'
        ' @no-endpoint-nodeports" ; }',
        "add chain @T services",
        "add chain @T service-endpoints-check",
        "add rule @T cluster-ips-check ip daddr @cluster-ips reject comment"
        ' "Reject traffic to invalid ports of ClusterIPs"',
    ]
    if cfg.service_cidrs:
        lines.append(f"add rule @T cluster-ips-check ip daddr {{ {', '.join(cfg.service_cidrs)} }}"
                     ' drop comment "Drop traffic to unallocated ClusterIPs"')
    lines += [
        "add rule @T filter-prerouting-pre-dnat ct state new jump firewall-check",
        "add rule @T filter-forward ct state new jump service-endpoints-check",
        "add rule @T filter-forward ct state new jump cluster-ips-check",
        "add rule @T filter-input ct state new jump nodeport-endpoints-check",
        "add rule @T filter-input ct state new jump service-endpoints-check",
        "add rule @T filter-output ct state new jump service-endpoints-check",
        "add rule @T filter-output-pre-dnat ct state new jump firewall-check",
        "add rule @T filter-output ct state new jump cluster-ips-check",
        "add rule @T firewall-check ip daddr . meta l4proto . th dport vmap @firewall-ips",
        f"add rule @T mark-for-masquerade mark set mark or {m}",
        f"add rule @T masquerading mark and {m} == 0 return",
        f"add rule @T masquerading mark set mark xor {m}",
        "add rule @T masquerading masquerade fully-random",
        "add rule @T nat-output jump services",
        "add rule @T nat-postrouting jump masquerading",
        "add rule @T nat-prerouting jump services",
    ]
    if cfg.nodeport_addresses:
        lines.append("add rule @T nodeport-endpoints-check ip daddr @nodeport-ips meta l4proto"
                     " . th dport vmap @no-endpoint-nodeports")
    else:
        lines.append("add rule @T nodeport-endpoints-check ip daddr != 127.0.0.0/8 meta l4proto"
                     " . th dport vmap @no-endpoint-nodeports")
    lines += [
        "add rule @T reject-chain reject",
        "add rule @T services ip daddr . meta l4proto . th dport vmap @service-ips",
    ]
    if cfg.nodeport_addresses:
        lines.append("add rule @T services ip daddr @nodeport-ips meta l4proto . th dport vmap"
                     " @service-nodeports")
        lines += [f"add element @T nodeport-ips {{ {ip} }}" for ip in cfg.nodeport_addresses]
    else:
        lines.append("add rule @T services fib daddr type local ip daddr != 127.0.0.0/8"
                     " meta l4proto . th dport vmap @service-nodeports")
    lines.append("add rule @T service-endpoints-check ip daddr . meta l4proto . th dport vmap"
                 " @no-endpoint-services")
    return [_nft(x) for x in lines]


def _nft_service(svc: ServicePort, cfg: NodeConfig, chains: bool = True,
                 elements: bool = True) -> list[str]:
    """One service port's chains, rules and map elements (``syncProxyRules``'s loop body).

    ``chains``/``elements`` pick the parts: a partial sync rewrites the
    chains of a changed service; its elements only when they change.
    """
    p, name = svc.proto, svc.name_string
    base = nft_base(svc)
    svc_chain, local_chain, ext_chain = f"service-{base}", f"local-{base}", f"external-{base}"
    cat = categorize(svc, cfg.node_name)
    uses_cluster = bool(cat.cluster) and svc.uses_cluster_endpoints
    uses_local = bool(cat.local) and svc.uses_local_endpoints
    internal_chain = local_chain if svc.itp_local else svc_chain
    has_internal = cat.has_endpoints and not (svc.itp_local and not cat.local)
    external_policy = local_chain if svc.external_policy_local else svc_chain
    has_external = cat.has_endpoints and not (svc.external_policy_local and not cat.local)
    uses_ext = cat.has_endpoints and svc.externally_accessible
    verdict = "goto reject-chain" if not cat.has_endpoints else "drop"
    out: list[str] = []
    el: list[str] = []
    el.append(f"add element @T cluster-ips {{ {svc.cluster_ip} }}")
    if has_internal:
        el.append(f"add element @T service-ips {{ {svc.cluster_ip} . {p} . {svc.port} :"
                  f" goto {internal_chain} }}")
    else:
        el.append(f"add element @T no-endpoint-services {{ {svc.cluster_ip} . {p} . {svc.port}"
                  f' comment "{name}" : {verdict} }}')
    for ip in (*svc.external_ips, *svc.lb_ips):
        if cat.has_endpoints:
            el.append(f"add element @T service-ips {{ {ip} . {p} . {svc.port} :"
                      f" goto {ext_chain} }}")
        if not has_external:
            el.append(f"add element @T no-endpoint-services {{ {ip} . {p} . {svc.port}"
                      f' comment "{name}" : {verdict} }}')
    if svc.node_port:
        if cat.has_endpoints:
            el.append(f"add element @T service-nodeports {{ {p} . {svc.node_port} :"
                      f" goto {ext_chain} }}")
        if not has_external:
            el.append(f"add element @T no-endpoint-nodeports {{ {p} . {svc.node_port}"
                      f' comment "{name}" : {verdict} }}')

    # Every chain is declared before any rule: nft resolves a jump or goto
    # when it reads it, so the target must already be in the batch.
    for ep in cat.reachable:
        out.append(f"add chain @T {nft_endpoint_chain(svc, ep)}")
    for used, c in ((uses_cluster, svc_chain), (uses_local, local_chain), (uses_ext, ext_chain)):
        if used:
            out.append(f"add chain @T {c}")
    if has_internal and cfg.pod_cidr:
        # No "tcp dport": the newer layout of the test fixture (SOURCES.md) dropped it.
        out.append(f"add rule @T {internal_chain} ip daddr {svc.cluster_ip}"
                   f" ip saddr != {cfg.pod_cidr} jump mark-for-masquerade")
    if uses_ext:
        if not svc.external_policy_local:
            out.append(f"add rule @T {ext_chain} jump mark-for-masquerade")
        else:
            if cfg.pod_cidr:
                out.append(f"add rule @T {ext_chain} ip saddr {cfg.pod_cidr} goto {svc_chain}"
                           ' comment "short-circuit pod traffic"')
            out.append(f"add rule @T {ext_chain} fib saddr type local jump mark-for-masquerade"
                       ' comment "masquerade local traffic"')
            out.append(f"add rule @T {ext_chain} fib saddr type local goto {svc_chain}"
                       ' comment "short-circuit local traffic"')
        if has_external:
            out.append(f"add rule @T {ext_chain} goto {external_policy}")
    for used, c, eps in ((uses_cluster, svc_chain, cat.cluster),
                         (uses_local, local_chain, cat.local)):
        if used:
            vmap = " , ".join(f"{i} : goto {nft_endpoint_chain(svc, ep)}"
                              for i, ep in enumerate(eps))
            out.append(f"add rule @T {c} numgen random mod {len(eps)} vmap {{ {vmap} }}")
    for ep in cat.reachable:
        epc = nft_endpoint_chain(svc, ep)
        out.append(f"add rule @T {epc} ip saddr {ep.ip} jump mark-for-masquerade")
        out.append(f"add rule @T {epc} meta l4proto {p} dnat to {ep}")
    parts = (out if chains else []) + (el if elements else [])
    return [_nft(x) for x in parts]


def nft_full(services: Sequence[ServicePort], cfg: NodeConfig) -> str:
    """The whole table as ``nft -f`` input: what a full sync leaves in the kernel.

    Written in the form kube-proxy's tests dump it (``knftables.Fake.Dump``),
    which ``nft -f`` reads as it is; kube-proxy's own first transaction adds
    flushes of chains and maps that do not exist yet, which change nothing.
    """
    lines = nft_base_rules(cfg)
    for svc in services:
        lines += _nft_service(svc, cfg)
    return "\n".join(lines) + "\n"


def nft_partial(old: ServicePort, new: ServicePort, cfg: NodeConfig) -> str:
    """The transaction of a partial sync after ``old``'s endpoints became ``new``'s.

    As ``syncProxyRules`` with ``tryPartialSync``: the changed service's
    chains are added and flushed (``ensureChain``) and their rules written
    again; a map element is deleted and re-added only when its value
    changed (none does for an endpoint swap: the chains keep their names);
    endpoint chains no longer used are flushed now and deleted a second
    later (``staleChains``), which is left out here.
    """
    lines: list[str] = []
    new_chains = _nft_service(new, cfg, elements=False)
    for line in new_chains:
        if line.startswith(f"add chain ip {NFT_TABLE} "):
            lines += [line, line.replace("add chain", "flush chain", 1)]
    lines += [x for x in new_chains if not x.startswith("add chain")]
    cat_old = categorize(old, cfg.node_name)
    cat_new = categorize(new, cfg.node_name)
    for ep in set(cat_old.reachable) - set(cat_new.reachable):
        lines.append(_nft(f"flush chain @T {nft_endpoint_chain(old, ep)}"))
    return "\n".join(lines) + "\n"
