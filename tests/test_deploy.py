"""deploy/ and the Dockerfile, checked offline: no cluster and no Docker engine here.

Every manifest is validated against the Kubernetes OpenAPI schemas of the
newest release kubernetes-validate ships (strict: an unknown field fails),
and what matters about it is checked against kpx itself: the RBAC is exactly
what kpx's list+watch reads, the DaemonSet's args parse with ``kpx node``'s
own argument parser (the downward API's node name lands in
``--hostname-override``), the probes hit the ports those flags bind, and the
kubeconfig it mounts loads with kpx's loader.
"""

from __future__ import annotations

import argparse
import re
import shlex
import tomllib
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from kubernetes_validate.utils import latest_version
from packaging.version import Version

from proxy.commands import node as node_command
from proxy.sources.kubeconfig import SERVICE_ACCOUNT_DIR, KubeConfig

ROOT = Path(__file__).resolve().parent.parent
MANIFEST = ROOT / "deploy" / "kpx.yaml"
K8S_VERSION = latest_version()
"""The newest Kubernetes release whose schemas kubernetes-validate ships."""


def documents() -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(MANIFEST.read_text()) if d]


def one(kind: str) -> dict[str, Any]:
    (doc,) = [d for d in documents() if d["kind"] == kind]
    return doc


def daemonset_pod() -> dict[str, Any]:
    return one("DaemonSet")["spec"]["template"]["spec"]


def container() -> dict[str, Any]:
    (c,) = daemonset_pod()["containers"]
    return c


def test_schemas_are_a_current_release() -> None:
    assert Version(K8S_VERSION) >= Version("1.33"), K8S_VERSION


@pytest.mark.parametrize("doc", documents(), ids=lambda d: f"{d['kind']}/{d['metadata']['name']}")
def test_manifest_validates_against_the_openapi_schema(doc: dict[str, Any]) -> None:
    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_the_validator_catches_a_bad_field() -> None:
    """The check above can fail: an unknown field and a wrong type are refused."""
    ds = one("DaemonSet")
    ds["spec"]["template"]["spec"]["hostNetwork"] = "yes"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(ds, K8S_VERSION, strict=True)
    ds = one("DaemonSet")
    ds["spec"]["updateStrategy"]["rollingUpdate"]["maxSurgeX"] = 1
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(ds, K8S_VERSION, strict=True)


def test_rbac_is_exactly_list_and_watch_on_what_kpx_reads() -> None:
    role = one("ClusterRole")
    granted = {
        (group, resource, verb)
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }
    assert granted == {
        (group, resource, verb)
        for group, resource in (("", "nodes"), ("", "services"),
                                ("discovery.k8s.io", "endpointslices"))
        for verb in ("list", "watch")
    }
    assert all(set(rule) == {"apiGroups", "resources", "verbs"} for rule in role["rules"])
    binding = one("ClusterRoleBinding")
    sa = one("ServiceAccount")
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io",
                                  "kind": "ClusterRole", "name": role["metadata"]["name"]}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa["metadata"]["name"],
                                    "namespace": sa["metadata"]["namespace"]}]
    assert daemonset_pod()["serviceAccountName"] == sa["metadata"]["name"]


def test_kpx_watches_only_what_the_role_grants() -> None:
    """The other side of the RBAC: the paths kpx's source requests are those three."""
    from proxy.sources.hub import StateHub
    from proxy.sources.kubeapi import KubeAPISource

    source = KubeAPISource(KubeConfig("http://127.0.0.1:1"), StateHub(), "n")
    assert sorted(k.path for k in source._kinds) == [
        "/api/v1/nodes", "/api/v1/services", "/apis/discovery.k8s.io/v1/endpointslices",
    ]


def test_daemonset_is_what_kube_proxy_s_is() -> None:
    ds = one("DaemonSet")
    pod = daemonset_pod()
    assert pod["hostNetwork"] is True
    assert pod["priorityClassName"] == "system-node-critical"
    assert pod["tolerations"] == [{"operator": "Exists"}], "every taint"
    assert ds["spec"]["updateStrategy"] == {
        "type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
    }
    # The handover needs both kpx processes in one pid namespace (see the manifest).
    assert pod["hostPID"] is True
    assert container()["resources"]["requests"].keys() == {"cpu", "memory"}
    assert "limits" not in container()["resources"]
    selector = ds["spec"]["selector"]["matchLabels"]
    assert selector.items() <= ds["spec"]["template"]["metadata"]["labels"].items()


def test_privileged_is_explained_and_the_capabilities_named() -> None:
    sc = container()["securityContext"]
    assert sc == {"privileged": True}
    text = MANIFEST.read_text()
    comment = text[text.index("securityContext:"):text.index("privileged: true")]
    for reason in ("/proc/sys", "read-only", "NET_ADMIN", "BPF", "NET_RAW"):
        assert reason in comment, reason


def parsed_args() -> argparse.Namespace:
    """The container's command line as the kubelet expands it, through kpx's parser."""
    c = container()
    assert c["command"] == ["kpx", "node"]
    config = one("ConfigMap")["data"]
    values: dict[str, str] = {}
    for env in c["env"]:
        ref = env["valueFrom"]
        if "fieldRef" in ref:
            assert ref["fieldRef"]["fieldPath"] == "spec.nodeName"
            values[env["name"]] = "worker-7"
        else:
            key = ref["configMapKeyRef"]
            assert key["name"] == one("ConfigMap")["metadata"]["name"]
            values[env["name"]] = config[key["key"]]
    args = [re.sub(r"\$\((\w+)\)", lambda m: values[m.group(1)], a) for a in c["args"]]
    # No abbreviations: each flag must be spelled as kpx names it (its contract).
    parser = argparse.ArgumentParser(prog="kpx node", exit_on_error=False, allow_abbrev=False)
    node_command.configure(parser)
    return parser.parse_args(args)


def test_args_parse_with_kpx_node_s_own_parser() -> None:
    args = parsed_args()
    assert args.hostname_override == "worker-7", "the downward API's spec.nodeName"
    assert args.metrics_bind_address == ("127.0.0.1", 10249)
    assert args.healthz_bind_address == ("0.0.0.0", 10256)
    assert [str(c) for c in args.cluster_cidr] == ["10.244.0.0/16"]
    assert args.takeover_wait >= 60, "a surge pod must outwait the old pod's deletion"
    assert args.state is None, "the API source"
    grace = daemonset_pod()["terminationGracePeriodSeconds"]
    assert args.shutdown_grace + args.handover_wait < grace


def test_probes_hit_the_healthz_port_kpx_binds() -> None:
    port = parsed_args().healthz_bind_address[1]
    c = container()
    assert c["livenessProbe"]["httpGet"] == {"path": "/livez", "port": port}
    assert c["readinessProbe"]["httpGet"] == {"path": "/healthz", "port": port}
    assert [p["containerPort"] for p in c["ports"]] == [port]


def test_mounted_kubeconfig_loads_with_kpx(tmp_path: Path) -> None:
    args = parsed_args()
    mounts = {m["name"]: m for m in container()["volumeMounts"]}
    volumes = {v["name"]: v for v in daemonset_pod()["volumes"]}
    config_mount = next(
        m for m in mounts.values() if args.kubeconfig.parent == Path(m["mountPath"])
    )
    assert volumes[config_mount["name"]]["configMap"]["name"] == "kpx"
    text = one("ConfigMap")["data"][args.kubeconfig.name]
    (tmp_path / "kubeconfig.conf").write_text(text)
    config = KubeConfig.load(tmp_path / "kubeconfig.conf")
    assert config.server.startswith("https://")
    assert config.token_file == SERVICE_ACCOUNT_DIR / "token", "re-read each minute"
    assert config.ca_file == SERVICE_ACCOUNT_DIR / "ca.crt"
    assert daemonset_pod().get("automountServiceAccountToken", True)
    # The xtables lock is the node's, shared with every iptables user there.
    assert volumes[mounts["xtables-lock"]["name"]]["hostPath"] == {
        "path": "/run/xtables.lock", "type": "FileOrCreate",
    }
    assert mounts["xtables-lock"]["mountPath"] == "/run/xtables.lock"


def test_kind_config_has_no_kube_proxy() -> None:
    kind = yaml.safe_load((ROOT / "deploy" / "kind.yaml").read_text())
    assert kind["apiVersion"] == "kind.x-k8s.io/v1alpha4" and kind["kind"] == "Cluster"
    assert kind["networking"]["kubeProxyMode"] == "none"
    server = yaml.safe_load(one("ConfigMap")["data"]["kubeconfig.conf"])
    assert server["clusters"][0]["cluster"]["server"] == f"https://{kind['name']}-control-plane:6443"


# -- Dockerfile ----------------------------------------------------------------------------


def dockerfile() -> list[list[str]]:
    """Instructions, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", (ROOT / "Dockerfile").read_text())
    return [shlex.split(line) for line in text.splitlines()
            if line.strip() and not line.lstrip().startswith("#")]


def test_dockerfile_builds_from_a_slim_python_base() -> None:
    lines = dockerfile()
    assert lines[0] == ["ARG", "BASE=python:3.11-slim"]
    assert lines[1] == ["FROM", "${BASE}"]
    requires = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    assert requires == ">=3.11", "BASE's Python must satisfy pyproject's requires-python"
    runs = " ".join(" ".join(line[1:]) for line in lines if line[0] == "RUN")
    for package in ("nftables", "iproute2", "iptables"):
        assert re.search(rf"apt-get install [^&]*\b{package}\b", runs), package
    assert "pip install --no-cache-dir ." in runs
    entry = next(line for line in lines if line[0] == "ENTRYPOINT")
    assert " ".join(entry[1:]).strip("[]\"") == "kpx"
    assert container()["command"][0] == "kpx"
    assert container()["image"] == "kpx:0.1.0"


def test_dockerfile_copies_what_the_package_needs() -> None:
    copies = [line[1:] for line in dockerfile() if line[0] == "COPY"]
    sources = [s for *srcs, _dst in copies for s in srcs]
    for src in sources:
        assert (ROOT / src).exists(), src
    ignored = {line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")}
    assert not ignored & set(sources), "a COPY source the .dockerignore drops"
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = pyproject["tool"]["setuptools"]["packages"]["find"]["include"]
    copied = {Path(s).name for s in sources}
    assert {p.rstrip("*") for p in packages} <= copied, "every package setuptools looks for"
    assert {"pyproject.toml", pyproject["project"]["readme"]} <= copied
    # The relay core is built in the image, with a compiler that leaves it again.
    assert "setup.py" in copied
    runs = " ".join(" ".join(line[1:]) for line in dockerfile() if line[0] == "RUN")
    assert re.search(r"apt-get install [^&]*\bgcc\b.*pip install.*apt-get purge", runs)
