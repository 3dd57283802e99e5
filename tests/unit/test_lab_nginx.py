"""The lab's nginx pod: its lab-file fields, its record, and the config nginx really accepts.

``image: nginx`` and ``proxyProtocol`` are validated like every other pod
field (errors name the pod and field), survive the lab's own record (an
attached ``kpx lab apply`` must not see a changed pod and recreate it), and
render a config that Debian's nginx checks clean with ``nginx -t``.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from lab import nginx
from lab.pods import needs_recreate
from lab.rundir import PodRecord
from lab.spec import LabSpec, LabSpecError

POD = {"name": "ingress", "node": "node1", "labels": {"app": "ingress"}, "port": 8080}


def spec_with(**pod: object) -> LabSpec:
    return LabSpec.from_dict({"nodes": 1, "pods": [{**POD, **pod}]})


def test_an_nginx_pod_with_proxy_protocol_is_accepted_and_round_trips() -> None:
    spec = spec_with(image="nginx", proxyProtocol=True)
    pod = spec.pods[0]
    assert (pod.image, pod.proxy_protocol) == ("nginx", True)
    assert LabSpec.from_dict(spec.to_dict()) == spec
    assert spec_with().pods[0].image == "echo"
    assert "image" not in spec_with().to_dict()["pods"][0]


@pytest.mark.parametrize(("fields", "message"), [
    ({"image": "httpd"}, "pods[0] (ingress).image: 'httpd' is not one of echo, nginx"),
    ({"image": "nginx", "proxyProtocol": "yes"}, "pods[0] (ingress).proxyProtocol: must be"),
    ({"proxyProtocol": True}, "pods[0] (ingress).proxyProtocol: only an nginx pod"),
])
def test_bad_image_fields_are_refused_naming_the_pod_and_field(
        fields: dict[str, object], message: str) -> None:
    with pytest.raises(LabSpecError) as err:
        spec_with(**fields)
    assert any(p.startswith(message) for p in err.value.problems), err.value.problems


def test_the_lab_record_keeps_the_image_so_apply_does_not_recreate_the_pod() -> None:
    pod = spec_with(image="nginx", proxyProtocol=True).pods[0]
    rec = PodRecord(spec=pod, ip="10.244.1.11", slot=1, uid="u")
    back = PodRecord.from_json(rec.to_json())
    assert back.spec == pod
    assert not needs_recreate(back.spec, pod)
    assert needs_recreate(pod, spec_with(image="nginx").pods[0])  # a new process is needed


def test_the_config_trusts_only_the_lb_and_reads_the_header(tmp_path: Path) -> None:
    text = nginx.nginx_conf("ingress", "node1", 8080, True, tmp_path)
    assert "listen 8080 proxy_protocol;" in text
    assert "set_real_ip_from 10.77.0.2;" in text
    assert "real_ip_header proxy_protocol;" in text
    assert "$proxy_protocol_addr" in text and "$realip_remote_addr" in text
    plain = nginx.nginx_conf("web", "node2", 9090, False, tmp_path)
    assert "listen 9090;" in plain and "proxy_protocol" not in plain.replace(
        '"proxy": ""', "")
    assert "real_ip_header" not in plain


@pytest.mark.parametrize("proxy_protocol", [True, False])
def test_nginx_accepts_the_generated_config(tmp_path: Path, proxy_protocol: bool) -> None:
    """``nginx -t``: the real parser, not a look-alike (nginx comes with system-deps)."""
    binary = shutil.which("nginx") or "/usr/sbin/nginx"
    if not Path(binary).exists():
        pytest.fail("nginx is missing: run `bash .ci/system-deps` (make setup does)")
    conf, workdir = nginx.write_conf("ingress", "node1", 8080, proxy_protocol, tmp_path)
    done = subprocess.run([*nginx.nginx_argv(conf, workdir), "-t"], capture_output=True,
                          text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    assert "syntax is ok" in done.stderr
