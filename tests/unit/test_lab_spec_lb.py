"""The lab spec's load balancer settings are held to what the load balancer itself takes.

A value the LB refuses when it starts (a probe interval under ``MIN_SECONDS``, a port that
is no number) let ``kpx lab up`` build a whole lab only to tear it down, and ``kpx lab
apply`` record a config the running LB never took. A probe path goes into an HTTP request
line as is: ``/héalthz`` killed the LB at its first probe.
"""

from __future__ import annotations

from typing import Any

import pytest

from lab.lb.config import MIN_SECONDS
from lab.spec import LabSpec, LabSpecError
from tests.support.labkit import service


def spec(**lb: Any) -> dict[str, Any]:
    probe = {"type": "http", "port": "healthCheckNodePort", "path": "/healthz",
             "interval": 0.5, "timeout": 0.5, "healthyThreshold": 1, "unhealthyThreshold": 2}
    probe.update(lb.pop("probe", {}))
    return {"nodes": 2, "services": [service("web", type="LoadBalancer")],
            "loadBalancer": {"service": "default/web", "probe": probe, **lb}}


@pytest.mark.parametrize(("lb", "problem"), [
    ({"probe": {"path": "/héalthz"}}, "loadBalancer.probe.path: '/héalthz' must be printable"),
    ({"probe": {"path": "/a b"}}, "loadBalancer.probe.path: '/a b' must be printable"),
    ({"probe": {"path": "/x\r\nHost: evil"}}, "loadBalancer.probe.path:"),
    ({"probe": {"interval": 0.01}},
     f"loadBalancer.probe.interval: must be a number of seconds >= {MIN_SECONDS:g}"),
    ({"probe": {"timeout": 0}}, "loadBalancer.probe.timeout: must be a number of seconds"),
    ({"port": "x"}, "loadBalancer.port: must be a port number 1-65535, got 'x'"),
    ({"port": 70000}, "loadBalancer.port: must be a port number 1-65535, got 70000"),
    ({"connectTimeout": 0.001}, "loadBalancer.connectTimeout: must be a number of seconds"),
], ids=["unicode-path", "space", "crlf", "interval", "timeout", "port-text", "port-range",
        "connect-timeout"])
def test_a_load_balancer_setting_it_would_refuse_is_a_problem_naming_the_field(
        lb: dict[str, Any], problem: str) -> None:
    with pytest.raises(LabSpecError) as err:
        LabSpec.from_dict(spec(**lb))
    assert any(problem in p for p in err.value.problems), err.value.problems


def test_the_settings_it_takes_pass() -> None:
    LabSpec.from_dict(spec(port=8080, connectTimeout=MIN_SECONDS,
                           probe={"path": "/healthz?x=%C3%A9", "interval": MIN_SECONDS}))
