"""Fixtures for lab tests: build labs with unique prefixes and always tear them down.

``lab_factory`` is meant for reuse by every suite that needs a lab::

    def test_something(lab_factory):
        lab = lab_factory(spec_dict, start_proxies=True)   # already up
        lab.request("client", lab.node_ip("node1"), lab.node_port("default/web"))

Each lab gets a prefix unique to this pytest process and test (``kl<pid>x<n>``),
so concurrent runs by other people, which use other prefixes, never collide,
and its run directory lives under the test's ``tmp_path``.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from lab import Lab, LabSpec
from lab import netns as lab_netns

_counter = itertools.count()
PREFIX_TAG = "kl"


def unique_prefix() -> str:
    """``kl<pid>x<n>``: at most 16 characters, no '-', unique per process and call."""
    return f"{PREFIX_TAG}{os.getpid()}x{next(_counter)}"


def own_namespaces() -> list[str]:
    """Namespaces made by labs of this pytest process."""
    mine = f"{PREFIX_TAG}{os.getpid()}x"
    return [n for n in lab_netns.list_namespaces() if n.startswith(mine)]


def require_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("lab tests need root (network namespaces)")
    if shutil.which("ip") is None:
        pytest.skip("lab tests need iproute2's ip")


@pytest.fixture
def lab_factory(tmp_path: Path) -> Iterator[Callable[..., Lab]]:
    """``make(spec, **kw) -> Lab``: a lab that is up now and torn down after the test.

    *spec* is a lab-file dict, a path or a LabSpec (None: the default lab);
    keyword arguments go to :class:`lab.Lab` (``start_proxies`` defaults to
    True there). Teardown runs pass or fail, and a lab whose ``up`` failed
    has already removed itself.
    """
    require_root()
    labs: list[Lab] = []

    def make(spec: Mapping[str, Any] | LabSpec | str | os.PathLike[str] | None = None,
             **kw: Any) -> Lab:
        prefix = kw.pop("prefix", None) or unique_prefix()
        run_dir = kw.pop("run_dir", None) or tmp_path / prefix
        lab = Lab(spec, prefix=prefix, run_dir=run_dir, **kw)
        labs.append(lab)
        lab.up()
        return lab

    try:
        yield make
    finally:
        for lab in reversed(labs):
            with contextlib.suppress(Exception):
                lab.down()


@pytest.fixture(scope="session", autouse=True)
def _sweep_own_namespaces() -> Iterator[None]:
    """Belt and braces: whatever a crashed test of this session left goes at the end."""
    yield
    if os.geteuid() != 0:
        return
    from lab.cluster import sweep

    for prefix in {n.split("-", 1)[0] for n in own_namespaces()}:
        sweep(prefix, grace=1.0)


def _one_pod_spec(etp: str = "Local", node: str = "node1", nodes: int = 3,
                  lb: bool = False) -> dict[str, Any]:
    """The classic lab: one LoadBalancer service and its single pod."""
    spec: dict[str, Any] = {
        "nodes": nodes,
        "pods": [{"name": "web-1", "node": node, "labels": {"app": "web"}, "port": 8080}],
        "services": [{
            "apiVersion": "v1", "kind": "Service",
            "metadata": {"name": "web", "namespace": "default"},
            "spec": {"type": "LoadBalancer", "externalTrafficPolicy": etp,
                     "selector": {"app": "web"},
                     "ports": [{"name": "http", "port": 80, "targetPort": 8080}]},
        }],
    }
    if lb:
        spec["loadBalancer"] = {"service": "default/web"}
    return spec


@pytest.fixture
def one_pod_spec() -> Callable[..., dict[str, Any]]:
    """``one_pod_spec(etp="Local", node="node1", nodes=3, lb=False)`` -> a lab-file dict."""
    return _one_pod_spec


@pytest.fixture
def family(request: pytest.FixtureRequest) -> int:
    """The IP family a verdict test runs over: 4, or 6 under ``labkit.over_both_families``."""
    return int(getattr(request, "param", 4))


@pytest.fixture
def lab_prefix() -> str:
    """A fresh unique lab prefix (for labs made without ``lab_factory``, e.g. by the CLI)."""
    require_root()
    return unique_prefix()
