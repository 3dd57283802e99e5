"""proxy.k8s reads a Service's VIPs: clusterIP(s), externalIPs and LoadBalancer ingress.

Every valid form lands in the model, of both families (hostname-only ingress
entries are valid and left out; tests/unit/test_dualstack_core.py has the
families); every malformed one is exactly one problem naming the
object and the field, as the API server would have refused it; the quick
judge (``_quick_service``) builds the very same verdict as the full one, or
steps aside; and ``kpx check`` refuses a bad ipMode with that one line.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path
from typing import Any
from unittest import mock

import pytest

from proxy.core.model import LoadBalancerIngress, Service
from proxy.k8s import StateError, fields, parse_state
from tests.support import objects

pytestmark = pytest.mark.usefixtures("yaml_reader")
"""Every test runs over both YAML readers: the fast subset reader, and PyYAML alone."""

CLUSTER_IP = "10.96.0.10"


def lb_service(
    *, type: str = "LoadBalancer", status: dict[str, Any] | None = None, **spec: Any
) -> dict[str, Any]:
    """A LoadBalancer Service (or ``type``) as kubectl prints it; ``spec`` keys override."""
    spec.setdefault("clusterIPs", [CLUSTER_IP])
    return objects.service(
        type=type, selector={"app": "web"}, status=status or {"loadBalancer": {}}, **spec
    )


def without(doc: dict[str, Any], *keys: str) -> dict[str, Any]:
    """``doc`` without these top-level or ``spec`` keys (absent, not null)."""
    for key in keys:
        doc.pop(key, None)
        doc["spec"].pop(key, None)
    return doc


def ingress(*entries: dict[str, Any]) -> dict[str, Any]:
    """A ``status`` with these ``loadBalancer.ingress`` entries."""
    return {"loadBalancer": {"ingress": list(entries)}}


def parsed(doc: dict[str, Any]) -> Service | None:
    """The one Service ``doc`` parses to (None: ignored), through YAML text."""
    snap = parse_state(objects.state_yaml(doc))
    assert len(snap.services) <= 1
    return snap.services[0] if snap.services else None


def problems(doc: dict[str, Any]) -> list[str]:
    with pytest.raises(StateError) as err:
        parse_state(objects.state_yaml(doc))
    return err.value.problems


def full_verdict(doc: object) -> fields._Verdict:
    """The verdict with the quick judges switched off."""
    with mock.patch.object(fields, "_quick_service", lambda doc: None):
        return fields._judge(doc)


def same_as_full_judge(doc: dict[str, Any]) -> None:
    """The quick judge gives the full judge's verdict, strictly (repr minds ``True`` vs ``1``)."""
    assert repr(fields._judge(copy.deepcopy(doc))) == repr(full_verdict(doc)), doc
    listed = {"kind": "List", "items": [doc]}
    assert repr(fields._judge(listed)) == repr(full_verdict(listed)), doc


# -- valid forms ---------------------------------------------------------------------


def test_ingress_ips_and_their_ip_modes() -> None:
    """VIP, Proxy and absent (VIP) are kept in order, IPv6 ones too (canonical); hostname-only
    and empty entries are valid and left out; an entry with both an ip and a hostname keeps
    its ip."""
    svc = parsed(lb_service(status=ingress(
        {"ip": "203.0.113.7", "ipMode": "VIP"},
        {"ip": "203.0.113.8", "ipMode": "Proxy"},
        {"ip": "203.0.113.9"},
        {"hostname": "lb.example.com"},
        {"ip": "2001:DB8::0:7", "ipMode": "VIP"},
        {"ip": "203.0.113.10", "hostname": "lb-2.example.com", "ports": [{"port": 80}]},
        {},
    )))
    assert svc is not None
    assert svc.ingress == (
        LoadBalancerIngress("203.0.113.7", "VIP"),
        LoadBalancerIngress("203.0.113.8", "Proxy"),
        LoadBalancerIngress("203.0.113.9", "VIP"),
        LoadBalancerIngress("2001:db8::7", "VIP"),
        LoadBalancerIngress("203.0.113.10", "VIP"),
    )


@pytest.mark.parametrize("status", [
    None, {}, {"loadBalancer": None}, {"loadBalancer": {}}, {"loadBalancer": {"ingress": None}},
    {"loadBalancer": {"ingress": []}}, ingress({"hostname": "lb.example.com"}),
])  # fmt: skip
def test_no_ingress_ip(status: dict[str, Any] | None) -> None:
    doc = lb_service()
    doc["status"] = status
    svc = parsed(doc)
    assert svc is not None and svc.ingress == ()


def test_ingress_of_a_service_that_is_not_a_load_balancer_is_judged_but_not_kept() -> None:
    """The API server clears the status of a service that stops being a LoadBalancer:
    any ingress left on another type is stale, yet still held to the rules."""
    doc = lb_service(type="NodePort", status=ingress({"ip": "203.0.113.7", "ipMode": "VIP"}))
    svc = parsed(doc)
    assert svc is not None and svc.ingress == ()
    doc["status"] = ingress({"ip": "203.0.113.7", "ipMode": "Bogus"})
    assert problems(doc) == [
        'Service default/web: status.loadBalancer.ingress[0].ipMode: "Bogus" is not one of '
        "VIP, Proxy"
    ]


def test_external_ips_keep_both_families_in_order() -> None:
    svc = parsed(lb_service(externalIPs=["198.51.100.7", "2001:db8::1", "198.51.100.8"]))
    assert svc is not None and svc.external_ips == ("198.51.100.7", "2001:db8::1", "198.51.100.8")
    svc = parsed(lb_service(type="ClusterIP", node_port=None, externalIPs=["2001:db8::1"]))
    assert svc is not None and svc.external_ips == ("2001:db8::1",)
    assert svc.externally_accessible


@pytest.mark.parametrize(("spec", "expected"), [
    ({"cluster_ip": CLUSTER_IP, "clusterIPs": [CLUSTER_IP]}, CLUSTER_IP),
    ({"cluster_ip": CLUSTER_IP, "clusterIPs": []}, CLUSTER_IP),
    ({"cluster_ip": CLUSTER_IP, "clusterIPs": None}, CLUSTER_IP),
    ({"cluster_ip": CLUSTER_IP, "clusterIPs": [CLUSTER_IP, "fd00::10"]}, CLUSTER_IP),
    # IPv6 primary: the IPv4 proxier takes the IPv4 one (GetClusterIPByFamily).
    ({"cluster_ip": "fd00::10", "clusterIPs": ["fd00::10", CLUSTER_IP]}, CLUSTER_IP),
    ({"cluster_ip": "fd00::10", "clusterIPs": ["fd00::10"]}, None),
    ({"cluster_ip": "fd00::10", "clusterIPs": None}, None),
    # No clusterIP: the API server would have filled it from clusterIPs[0].
    ({"cluster_ip": None, "clusterIPs": [CLUSTER_IP]}, CLUSTER_IP),
    ({"cluster_ip": "", "clusterIPs": [CLUSTER_IP]}, CLUSTER_IP),
    ({"cluster_ip": "", "clusterIPs": None}, None),
    ({"cluster_ip": None, "clusterIPs": None}, None),
    ({"cluster_ip": "", "clusterIPs": []}, None),
])  # fmt: skip
def test_cluster_ip_forms(spec: dict[str, Any], expected: str | None) -> None:
    svc = parsed(lb_service(**spec))
    assert svc is not None and svc.cluster_ip == expected


@pytest.mark.parametrize("spec", [
    {"cluster_ip": "None"},
    {"cluster_ip": "None", "clusterIPs": ["None"]},
    {"cluster_ip": None, "clusterIPs": ["None"]},
    {"cluster_ip": "", "clusterIPs": ["None"]},
    # Headless services are never judged further, as before: kube-proxy never sees them.
    {"cluster_ip": "None", "externalIPs": ["bogus"], "clusterIPs": ["None", "x"]},
])  # fmt: skip
def test_headless_services_are_still_ignored(spec: dict[str, Any]) -> None:
    doc = lb_service(status=ingress({"ipMode": "Bogus"}), **spec)
    assert parsed(doc) is None


def test_internal_traffic_policy() -> None:
    svc = parsed(lb_service(internalTrafficPolicy="Local"))
    assert svc is not None and svc.internal_traffic_policy == "Local"


# -- malformed forms: one problem each -----------------------------------------------

S = "Service default/web: "
BAD_SPECS: list[tuple[dict[str, Any], str]] = [
    ({"cluster_ip": "10.96.0.300", "clusterIPs": None},
     'spec.clusterIP: "10.96.0.300" is not a valid IP address'),
    ({"cluster_ip": "010.96.0.1", "clusterIPs": None},
     'spec.clusterIP: "010.96.0.1" is not a valid IP address'),
    ({"cluster_ip": "fe80::1%eth0", "clusterIPs": None},
     'spec.clusterIP: "fe80::1%eth0" is not a valid IP address'),
    ({"cluster_ip": "::ffff:10.96.0.1", "clusterIPs": None},
     'spec.clusterIP: "::ffff:10.96.0.1" is not a valid IP address'),
    ({"cluster_ip": "10.96.0.300", "clusterIPs": ["10.96.0.300"]},
     'spec.clusterIP: "10.96.0.300" is not a valid IP address'),
    ({"clusterIP": 7, "clusterIPs": None}, "spec.clusterIP: expected a string, got integer 7"),
    ({"clusterIPs": ["10.96.0.11"]},
     'spec.clusterIPs[0]: "10.96.0.11" does not match spec.clusterIP "10.96.0.10"'),
    ({"clusterIPs": "10.96.0.10"}, 'spec.clusterIPs: expected a list, got string "10.96.0.10"'),
    ({"clusterIPs": [CLUSTER_IP, 7]}, "spec.clusterIPs[1]: expected a string, got integer 7"),
    ({"clusterIPs": [CLUSTER_IP, "bogus"]},
     'spec.clusterIPs[1]: "bogus" is not a valid IP address'),
    ({"clusterIPs": [CLUSTER_IP, "None"]},
     'spec.clusterIPs[1]: "None" must be the first and only value'),
    ({"clusterIPs": [CLUSTER_IP, "10.96.0.11"]},
     'spec.clusterIPs[1]: "10.96.0.11" is a second IPv4 address: one per IP family'),
    ({"clusterIPs": [CLUSTER_IP, "fd00::1", "fd00::2"]},
     "spec.clusterIPs: 3 values, but at most 2 are allowed (one per IP family)"),
    ({"cluster_ip": None, "clusterIPs": ["x"]},
     'spec.clusterIPs[0]: "x" is not a valid IP address'),
    ({"externalIPs": ["1.2.3.4", "10.0.0.300"]},
     'spec.externalIPs[1]: "10.0.0.300" is not a valid IP address'),
    ({"externalIPs": [""]}, 'spec.externalIPs[0]: "" is not a valid IP address'),
    ({"externalIPs": [" 1.2.3.4"]}, 'spec.externalIPs[0]: " 1.2.3.4" is not a valid IP address'),
    ({"externalIPs": [7]}, "spec.externalIPs[0]: expected a string, got integer 7"),
    ({"externalIPs": ["0.0.0.0"]}, 'spec.externalIPs[0]: "0.0.0.0" may not be unspecified'),
    ({"externalIPs": ["127.0.0.1"]},
     'spec.externalIPs[0]: "127.0.0.1" may not be in the loopback range (127.0.0.0/8, ::1/128)'),
    ({"externalIPs": ["::1"]},
     'spec.externalIPs[0]: "::1" may not be in the loopback range (127.0.0.0/8, ::1/128)'),
    ({"externalIPs": ["169.254.169.254"]}, 'spec.externalIPs[0]: "169.254.169.254" may not be '
     "in the link-local range (169.254.0.0/16, fe80::/10)"),
    ({"externalIPs": ["224.0.0.5"]}, 'spec.externalIPs[0]: "224.0.0.5" may not be '
     "in the link-local multicast range (224.0.0.0/24, ff02::/10)"),
    ({"externalIPs": ["ff02::1"]}, 'spec.externalIPs[0]: "ff02::1" may not be '
     "in the link-local multicast range (224.0.0.0/24, ff02::/10)"),
]  # fmt: skip

ING = "status.loadBalancer.ingress[0]."
BAD_STATUSES: list[tuple[object, str]] = [
    ("up", 'status: expected a mapping, got string "up"'),
    ({"loadBalancer": []}, "status.loadBalancer: expected a mapping, got list"),
    ({"loadBalancer": {"ingress": {}}},
     "status.loadBalancer.ingress: expected a list, got mapping"),
    (ingress("203.0.113.7"),  # type: ignore[arg-type]
     'status.loadBalancer.ingress[0]: expected a mapping, got string "203.0.113.7"'),
    (ingress({"ip": "203.0.113.300"}), ING + 'ip: "203.0.113.300" is not a valid IP address'),
    (ingress({"ip": 7}), ING + "ip: expected a string, got integer 7"),
    (ingress({"ip": "203.0.113.7", "ipMode": "Bogus"}),
     ING + 'ipMode: "Bogus" is not one of VIP, Proxy'),
    (ingress({"ip": "203.0.113.7", "ipMode": "vip"}),
     ING + 'ipMode: "vip" is not one of VIP, Proxy'),
    (ingress({"ip": "203.0.113.7", "ipMode": 1}), ING + "ipMode: expected a string, got integer 1"),
    (ingress({"ipMode": "Bogus"}), ING + 'ipMode: "Bogus" is not one of VIP, Proxy'),
    (ingress({"ipMode": "Proxy"}), ING + 'ipMode: "Proxy" may not be set without an ip'),
    (ingress({"ip": "", "ipMode": "VIP"}), ING + 'ipMode: "VIP" may not be set without an ip'),
    (ingress({"hostname": "lb.example.com", "ipMode": "VIP"}),
     ING + 'ipMode: "VIP" may not be set without an ip'),
    (ingress({"hostname": "203.0.113.7"}),
     ING + 'hostname: "203.0.113.7" is not a valid hostname: a DNS name, not an IP address'),
    (ingress({"hostname": "LB_1"}), ING + 'hostname: "LB_1" is not a valid hostname: a DNS-1123 '
     "subdomain is at most 253 characters: lower-case letters, digits, '-' and '.', each "
     "'.'-separated part beginning and ending with a letter or digit"),
]  # fmt: skip


@pytest.mark.parametrize(("spec", "problem"), BAD_SPECS)
def test_a_malformed_spec_address_is_one_problem(spec: dict[str, Any], problem: str) -> None:
    assert problems(lb_service(**spec)) == [S + problem]


@pytest.mark.parametrize(("status", "problem"), BAD_STATUSES)
def test_a_malformed_ingress_is_one_problem(status: object, problem: str) -> None:
    doc = lb_service()
    doc["status"] = status
    assert problems(doc) == [S + problem]


# -- the quick judge -----------------------------------------------------------------

PLAIN = [
    lb_service(),
    lb_service(status=ingress({"ip": "203.0.113.7", "ipMode": "VIP"})),
    lb_service(status=ingress({"ip": "203.0.113.7", "ipMode": "Proxy"}, {"ip": "203.0.113.8"})),
    lb_service(externalIPs=["198.51.100.7", "198.51.100.8"]),
    without(lb_service(cluster_ip=None), "clusterIPs", "status"),
    lb_service(cluster_ip="", clusterIPs=[]),
    lb_service(type="NodePort", status=ingress({"ip": "203.0.113.7", "ipMode": "VIP"})),
]


@pytest.mark.parametrize("doc", PLAIN)
def test_plain_forms_take_the_quick_path(doc: dict[str, Any]) -> None:
    """What kubectl prints for a Service with VIPs is judged by the shortcut."""
    assert fields._quick_service(doc) is not None
    same_as_full_judge(doc)


def _docs() -> list[dict[str, Any]]:
    out = list(PLAIN)
    for spec, _ in BAD_SPECS:
        out.append(lb_service(**spec))
    for status, _ in BAD_STATUSES:
        out.append({**lb_service(), "status": status})
    out.append(lb_service(status=ingress(
        {"hostname": "lb.example.com"}, {"ip": "2001:db8::7"},
        {"ip": "203.0.113.9", "hostname": "a.b"},
    )))
    out.append(lb_service(status=ingress({"ip": "203.0.113.9", "ipMode": None})))
    out.append(lb_service(externalIPs=["2001:db8::1", "0.1.2.3", "127.0.0.1"]))
    out.append(lb_service(cluster_ip="fd00::10", clusterIPs=["fd00::10", CLUSTER_IP]))
    out.append(lb_service(cluster_ip=None, clusterIPs=[CLUSTER_IP]))
    out.append(lb_service(cluster_ip=None, clusterIPs=["None"]))
    out.append(lb_service(clusterIPs=[CLUSTER_IP, "fd00::10"]))
    return out


@pytest.mark.parametrize("doc", _docs())
def test_the_quick_judge_is_the_full_judge(doc: dict[str, Any]) -> None:
    same_as_full_judge(doc)


# -- kpx check -----------------------------------------------------------------------


def test_kpx_check_refuses_a_bad_ip_mode(tmp_path: Path, yaml_reader: str) -> None:
    """One clear line naming the object and the field, and a non-zero exit."""
    kpx = Path(sys.executable).with_name("kpx")
    env = {**os.environ, "KPX_NO_FAST_YAML": "1" if yaml_reader == "pyyaml" else ""}
    state = tmp_path / "state.yaml"
    good = lb_service(status=ingress({"ip": "203.0.113.7", "ipMode": "Proxy"}))
    state.write_text(objects.state_yaml(good, objects.endpoint_slice("web", "10.244.0.5")))
    ok = subprocess.run([kpx, "check", str(state)], capture_output=True, text=True, env=env,
                        timeout=60)
    assert ok.returncode == 0, ok.stderr

    bad = lb_service(status=ingress({"ip": "203.0.113.7", "ipMode": "Bogus"}))
    state.write_text(objects.state_yaml(bad, objects.endpoint_slice("web", "10.244.0.5")))
    run = subprocess.run([kpx, "check", str(state)], capture_output=True, text=True, env=env,
                         timeout=60)
    assert run.returncode == 1
    assert run.stderr.splitlines() == [
        f'{state}: Service default/web: status.loadBalancer.ingress[0].ipMode: "Bogus" is not '
        "one of VIP, Proxy",
        f"{state}: 1 problem(s); file refused",
    ]
