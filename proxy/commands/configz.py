"""What ``/configz`` says about ``kpx node``: its flags in kube-proxy's configuration shape.

Owns: ``kube_proxy_configuration(args)``, a pure function from the parsed
flags to the object kube-proxy registers with ``configz``, as plain data the
metrics server serializes (``healthz.metrics.MetricsServer(configz=)``);
``go_duration``, Go's ``time.Duration.String``.

Never: put a value here that kpx does not act on. A field kpx has no flag
for, and no behaviour of, is left out rather than filled with kube-proxy's
default: a reader of ``/configz`` believes what it says.

What kube-proxy serves (cmd/kube-proxy/app/server.go ``newProxyServer``):
``configz.New("kubeproxy.config.k8s.io").Set(config)``, where ``config`` is
the *internal* ``pkg/proxy/apis/config.KubeProxyConfiguration``, not the
v1alpha1 type its config file is written in (kubernetes#137426 calls that a
bug; no release has changed it). Three things follow, and kpx matches them:

- The internal type has no json tags, so Go's encoding/json names each field
  after the Go field: ``HostnameOverride``, ``Linux.Conntrack.MaxPerCore``,
  not v1alpha1's ``hostnameOverride``, ``conntrack.maxPerCore``. Nested types
  from versioned packages keep their tags (``Logging``'s ``format``), and kpx
  serves none of those.
- Decoding into the internal version clears ``TypeMeta`` (apimachinery's
  ``setTargetKind``), and its tags say ``omitempty``: no ``kind``, no
  ``apiVersion``.
- Fields come in struct order (pkg/proxy/apis/config/types.go, 1.31 onwards:
  conntrack and masqueradeAll under ``Linux``); a nil pointer or a nil slice
  is ``null``; a ``metav1.Duration`` is its ``String()``, ``"24h0m0s"``.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

CONFIGZ_NAME = "kubeproxy.config.k8s.io"
"""The name kube-proxy registers its configuration under (``kubeproxyconfig.GroupName``)."""

DETECT_LOCAL_CLUSTER_CIDR = "ClusterCIDR"
"""kube-proxy's ``LocalModeClusterCIDR``: traffic from ``--cluster-cidr`` is the node's own
pods', which is what kpx does with those CIDRs (Cluster semantics for pod sources)."""


def go_duration(seconds: float) -> str:
    """Go's ``time.Duration.String``: ``"24h0m0s"``, ``"2m0s"``, ``"1.5s"``, ``"100µs"``, ``"0s"``.

    Below a second the largest unit that keeps the integer part non-zero;
    from a second on, hours and minutes only once they are non-zero (and
    minutes always after hours), seconds always, with the fraction's
    trailing zeros dropped. Worked in whole nanoseconds, as Go stores it.
    """
    ns = round(seconds * 1e9)
    sign, ns = ("-", -ns) if ns < 0 else ("", ns)
    if ns == 0:
        return "0s"
    if ns < 1_000_000_000:
        for unit, digits in (("ns", 0), ("µs", 3), ("ms", 6)):
            if ns < 1000 * 10**digits:
                return sign + _fixed(ns, digits) + unit
    minutes, rest = divmod(ns, 60 * 10**9)
    hours, minutes = divmod(minutes, 60)
    text = _fixed(rest, 9) + "s"
    if hours:
        return f"{sign}{hours}h{minutes}m{text}"
    if minutes:
        return f"{sign}{minutes}m{text}"
    return sign + text


def _fixed(value: int, digits: int) -> str:
    """``value / 10**digits`` with no trailing zeros in the fraction (Go's ``fmtFrac``)."""
    whole, frac = divmod(value, 10**digits)
    fraction = f"{frac:0{digits}d}".rstrip("0") if digits else ""
    return f"{whole}.{fraction}" if fraction else str(whole)


def bind_address(bind: tuple[str, int] | None) -> str:
    """A ``--*-bind-address`` as kube-proxy keeps it: ``IP:port``, ``[IPv6]:port``; off: ``""``."""
    if bind is None:
        return ""
    host, port = bind
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def cidrs(networks: Sequence[object] | None) -> list[str] | None:
    """A CIDR list flag as the Go ``[]string`` it would be: unset is a nil slice, ``null``."""
    return [str(net) for net in networks] if networks else None


def kube_proxy_configuration(args: argparse.Namespace) -> dict[str, Any]:
    """kube-proxy's registered ``KubeProxyConfiguration`` for ``kpx node`` started with ``args``.

    Every value is one kpx acts on (module doc). The conntrack table's size
    and ``tcpBeLiberal`` are set in nfqueue mode only: the relay leaves them
    as they are, which kube-proxy spells ``MaxPerCore: 0`` and no ``Min``.
    The timeouts hold in both modes: the relay expires idle connections and
    UDP flows by them, nfqueue mode writes them to conntrack's sysctls.
    """
    nfqueue = args.proxy_mode == "nfqueue"
    healthz = not args.no_healthz
    return {
        "Linux": {
            "Conntrack": {
                "MaxPerCore": args.conntrack_max_per_core if nfqueue else 0,
                "Min": args.conntrack_min if nfqueue else None,
                "TCPEstablishedTimeout": go_duration(args.conntrack_tcp_timeout_established),
                "TCPCloseWaitTimeout": go_duration(args.conntrack_tcp_timeout_close_wait),
                "TCPBeLiberal": args.conntrack_tcp_be_liberal if nfqueue else False,
                "UDPTimeout": go_duration(args.conntrack_udp_timeout),
                "UDPStreamTimeout": go_duration(args.conntrack_udp_timeout_stream),
            },
            "MasqueradeAll": args.masquerade_all,
            # kpx leaves its OOM score as it is: kube-proxy's nil, not its -999.
            "OOMScoreAdj": None,
        },
        "FeatureGates": {},
        "ClientConnection": {
            # --state reads no API at all; without --kubeconfig, the in-cluster account.
            "Kubeconfig": str(args.kubeconfig) if args.kubeconfig is not None else "",
        },
        "HostnameOverride": args.hostname_override,
        # --no-healthz serves neither port: kube-proxy's empty address, "off".
        "HealthzBindAddress": bind_address(args.healthz_bind_address) if healthz else "",
        "MetricsBindAddress": bind_address(args.metrics_bind_address) if healthz else "",
        # A busy health or metrics port is retried in the background, never fatal.
        "BindAddressHardFail": False,
        "EnableProfiling": False,
        "ShowHiddenMetricsForVersion": "",
        "Mode": args.proxy_mode,
        "DetectLocalMode": DETECT_LOCAL_CLUSTER_CIDR,
        "DetectLocal": {"ClusterCIDRs": cidrs(args.cluster_cidr)},
        "NodePortAddresses": cidrs(args.nodeport_addresses),
        # What health is judged by (an update waiting over twice this), as kube-proxy's is.
        "SyncPeriod": go_duration(args.sync_period),
    }
