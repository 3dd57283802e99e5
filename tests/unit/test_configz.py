"""``/configz``'s content: ``kpx node``'s flags as kube-proxy's registered configuration.

kube-proxy registers its internal ``KubeProxyConfiguration``: Go field names,
no ``kind``/``apiVersion``, ``null`` for nil, ``metav1.Duration`` as Go prints
it (``proxy.commands.configz``). These hold the builder to that shape and to
the flags kpx was started with.
"""

from __future__ import annotations

import argparse

import pytest

from healthz.metrics import go_json
from proxy.commands import node
from proxy.commands.configz import CONFIGZ_NAME, go_duration, kube_proxy_configuration


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    node.configure(parser)
    return parser.parse_args(["--hostname-override", "node-a", *argv])


@pytest.mark.parametrize(("seconds", "text"), [
    (86400, "24h0m0s"), (3600, "1h0m0s"), (120, "2m0s"), (30, "30s"), (90.5, "1m30.5s"),
    (1.5, "1.5s"), (0.5, "500ms"), (0.0001, "100µs"), (1.5e-6, "1.5µs"), (3e-9, "3ns"),
    (0, "0s"), (-90, "-1m30s"), (900, "15m0s"), (3661.25, "1h1m1.25s"),
])
def test_durations_print_as_go_prints_them(seconds: float, text: str) -> None:
    assert go_duration(seconds) == text


def test_defaults_in_the_internal_types_field_order() -> None:
    config = kube_proxy_configuration(parse())
    assert CONFIGZ_NAME == "kubeproxy.config.k8s.io"
    assert "kind" not in config and "apiVersion" not in config  # internal: TypeMeta cleared
    assert list(config) == [
        "Linux", "FeatureGates", "ClientConnection", "HostnameOverride",
        "HealthzBindAddress", "MetricsBindAddress", "BindAddressHardFail", "EnableProfiling",
        "ShowHiddenMetricsForVersion", "Mode", "DetectLocalMode", "DetectLocal",
        "NodePortAddresses", "SyncPeriod",
    ]
    assert config["Linux"] == {
        "Conntrack": {
            # The relay leaves nf_conntrack_max and be_liberal as they are.
            "MaxPerCore": 0, "Min": None,
            "TCPEstablishedTimeout": "24h0m0s", "TCPCloseWaitTimeout": "1h0m0s",
            "TCPBeLiberal": False, "UDPTimeout": "30s", "UDPStreamTimeout": "2m0s",
        },
        "MasqueradeAll": False,
        "OOMScoreAdj": None,
    }
    assert config["HostnameOverride"] == "node-a"
    assert config["HealthzBindAddress"] == "0.0.0.0:10256"
    assert config["MetricsBindAddress"] == "127.0.0.1:10249"
    assert config["Mode"] == "userspace"
    assert config["ClientConnection"] == {"Kubeconfig": ""}
    assert config["DetectLocal"] == {"ClusterCIDRs": None}  # a nil slice: null
    assert config["NodePortAddresses"] is None
    assert config["SyncPeriod"] == "30s"


def test_the_flags_kpx_was_started_with() -> None:
    config = kube_proxy_configuration(parse(
        "--conntrack-tcp-timeout-established", "90m", "--conntrack-tcp-timeout-close-wait", "0",
        "--conntrack-udp-timeout", "45s", "--conntrack-udp-timeout-stream", "3m",
        "--masquerade-all", "--cluster-cidr", "10.244.0.0/16,fd00:10:244::/56",
        "--nodeport-addresses", "192.0.2.0/24", "--sync-period", "1m",
        "--healthz-bind-address", "[::]:20256", "--metrics-bind-address", "",
        "--kubeconfig", "/etc/kpx/kubeconfig",
    ))
    conntrack = config["Linux"]["Conntrack"]
    assert conntrack["TCPEstablishedTimeout"] == "1h30m0s"
    assert conntrack["TCPCloseWaitTimeout"] == "0s"
    assert (conntrack["UDPTimeout"], conntrack["UDPStreamTimeout"]) == ("45s", "3m0s")
    assert config["Linux"]["MasqueradeAll"] is True
    assert config["DetectLocalMode"] == "ClusterCIDR"
    assert config["DetectLocal"] == {"ClusterCIDRs": ["10.244.0.0/16", "fd00:10:244::/56"]}
    assert config["NodePortAddresses"] == ["192.0.2.0/24"]
    assert config["SyncPeriod"] == "1m0s"
    assert config["HealthzBindAddress"] == "[::]:20256"
    assert config["MetricsBindAddress"] == ""  # off, as kube-proxy spells it
    assert config["ClientConnection"] == {"Kubeconfig": "/etc/kpx/kubeconfig"}


def test_nfqueue_mode_sizes_conntrack_and_says_so() -> None:
    config = kube_proxy_configuration(parse(
        "--proxy-mode", "nfqueue", "--conntrack-max-per-core", "65536",
        "--conntrack-min", "262144", "--conntrack-tcp-be-liberal",
    ))
    assert config["Mode"] == "nfqueue"
    conntrack = config["Linux"]["Conntrack"]
    assert (conntrack["MaxPerCore"], conntrack["Min"], conntrack["TCPBeLiberal"]) == (
        65536, 262144, True)


def test_no_healthz_serves_no_port() -> None:
    config = kube_proxy_configuration(parse("--no-healthz"))
    assert config["HealthzBindAddress"] == config["MetricsBindAddress"] == ""


def test_serialized_as_go_marshals_it() -> None:
    body = go_json({CONFIGZ_NAME: kube_proxy_configuration(parse(
        "--hostname-override", "<node&µ>"))})
    assert body.startswith(b'{"kubeproxy.config.k8s.io":{"Linux":{"Conntrack":{"MaxPerCore":0,'
                           b'"Min":null,"TCPEstablishedTimeout":"24h0m0s",')
    assert '"HostnameOverride":"\\u003cnode\\u0026µ\\u003e"'.encode() in body
    assert not body.endswith(b"\n")
