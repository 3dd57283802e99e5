"""The lab spec's load balancer settings are held to what the load balancer itself takes.

A value the LB refuses when it starts (a probe interval under ``MIN_SECONDS``, a port that
is no number) let ``kpx lab up`` build a whole lab only to tear it down, and ``kpx lab
apply`` record a config the running LB never took. A probe path goes into an HTTP request
line as is: ``/héalthz`` killed the LB at its first probe.

A record a running lab left (``lab.json``) with a value now refused, written before the
spec took those bounds or edited since, is still opened by the commands that only read
its topology (``kpx lab status``, ``kpx lab exec``), without its LB section, saying so.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import pytest

from lab import cli
from lab.cluster import LAB_JSON, Lab
from lab.lb.config import MIN_SECONDS
from lab.rundir import RUN_DIR_ENV, LabError
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


# -- a record an older (or edited) lab.json left behind ------------------------------------

def test_a_record_refused_only_in_its_lb_section_opens_without_it_naming_each_field() -> None:
    recorded = spec(port="x", probe={"interval": 0.01})
    opened, refused = LabSpec.from_record(recorded)
    assert opened.nodes == ("node1", "node2") and opened.load_balancer is None
    assert [p.split(":", 1)[0] for p in refused] == ["loadBalancer.probe.interval",
                                                      "loadBalancer.port"]
    assert LabSpec.from_record(spec()) == (LabSpec.from_dict(spec()), ())
    with pytest.raises(LabSpecError) as err:  # anything else refused is still an error,
        LabSpec.from_record({**recorded, "nodes": 0})
    assert any(p.startswith("loadBalancer.port:") for p in err.value.problems)  # all named


def test_exec_opens_a_record_holding_a_refused_lb_value_and_says_what_it_left_out(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``kpx lab exec`` needs only the lab's namespaces: a probe interval this kpx refuses
    in the record (written before the spec took the LB's bounds) must not stop it."""
    (tmp_path / "kt").mkdir()
    (tmp_path / "kt" / LAB_JSON).write_text(json.dumps(
        {"prefix": "kt", "status": "up", "spec": spec(probe={"interval": 0.01})}))
    monkeypatch.setenv(RUN_DIR_ENV, str(tmp_path))
    ran: list[list[str]] = []
    monkeypatch.setattr(os, "execvp", lambda _file, argv: ran.append(argv))

    args = argparse.Namespace(lab_command="exec", name="kt", target="node1", cmd=["true"])
    assert cli._exec(args) == 127  # what follows an execvp that did not replace the process
    opened = Lab.attach(tmp_path / "kt", lenient=True)
    assert ran == [["ip", "netns", "exec", opened.ns("node1"), "true"]]
    err = capsys.readouterr().err
    assert "refused" in err and "loadBalancer.probe.interval" in err
    # Opened without its LB section, it is never written back: that would drop the section.
    with pytest.raises(LabError, match=r"loadBalancer\.probe\.interval"):
        opened.delete_service("default/web")
