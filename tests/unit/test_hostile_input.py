"""Hostile state files: no input may crash kpx, empty it by accident, or forge a log line.

Three defects of the "Robustness" issue, each held here:

- Deep nesting (point 1). PyYAML's C extension composes each collection by a
  C call inside its parent's, without a limit; linked against a libyaml that
  has none either (Debian's 0.2.5, which the distro's python3-yaml uses),
  ~100 KB of ``[`` or ``- - -`` overflow the C stack and the process dies of
  SIGSEGV. ``proxy.k8s`` measures the nesting before PyYAML composes anything
  and refuses more than ``_MAX_DEPTH`` levels. The PyYAML wheel in the venv
  bundles a libyaml that stops at 1,000 levels by itself, so the tests that
  must *crash* without the guard run ``kpx check`` against the distro's
  PyYAML when this machine has one (``unbounded_pyyaml``), and the in-process
  tests use PyYAML's pure-Python loader, which has no limit either.
- An empty file (point 6) is refused; an empty ``kind: List`` is accepted.
- Names (point 9) are held to the API server's formats, and every problem
  is one printable line whatever the input holds.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import yaml

from proxy import k8s
from proxy.k8s import StateError, StateParser, decode, decode_state, fields, parse_file, parse_state

REPO = Path(__file__).resolve().parents[2]
HOSTILE_SIZE = 100_000
"""About the size of the file that crashed ``kpx node`` in the issue."""

pytestmark = pytest.mark.usefixtures("yaml_reader")
"""Every test runs over both YAML readers: the fast subset reader, and PyYAML alone."""

# -- helpers -----------------------------------------------------------------------------------


def problems(text: str, parse: Callable[[str], Any] = parse_state) -> list[str]:
    with pytest.raises(StateError) as info:
        parse(text)
    return info.value.problems


def first_too_deep(text: str) -> str:
    """``line L, column C`` of the first collection past ``_MAX_DEPTH``, by PyYAML's
    pure-Python parser: where the problem must point."""
    depth = 0
    for event in yaml.parse(text, Loader=yaml.SafeLoader):
        if isinstance(event, yaml.CollectionStartEvent):
            depth += 1
            if depth > decode._MAX_DEPTH:
                mark = event.start_mark
                return f"line {mark.line + 1}, column {mark.column + 1}"
        elif isinstance(event, yaml.CollectionEndEvent):
            depth -= 1
    raise AssertionError("not too deep")


def depth_of(text: str) -> int:
    """How deep PyYAML's events nest ``text``: the exact measure, by another road."""
    depth = deepest = 0
    for event in yaml.parse(text, Loader=yaml.SafeLoader):
        if isinstance(event, yaml.CollectionStartEvent):
            depth += 1
            deepest = max(deepest, depth)
        elif isinstance(event, yaml.CollectionEndEvent):
            depth -= 1
    return deepest


SERVICE = {
    "apiVersion": "v1",
    "kind": "Service",
    "metadata": {"name": "web", "namespace": "default", "labels": {"app": "web"}},
    "spec": {
        "type": "NodePort",
        "ports": [{"name": "http", "port": 80, "targetPort": 8080, "nodePort": 30080}],
    },
}
SLICE = {
    "apiVersion": "discovery.k8s.io/v1",
    "kind": "EndpointSlice",
    "metadata": {
        "name": "web-abc",
        "namespace": "default",
        "labels": {"kubernetes.io/service-name": "web"},
    },
    "addressType": "IPv4",
    "endpoints": [{"addresses": ["10.0.0.1"], "nodeName": "node-a"}],
    "ports": [{"name": "http", "port": 8080}],
}
NODE = {
    "apiVersion": "v1",
    "kind": "Node",
    "metadata": {"name": "node-a", "labels": {"kubernetes.io/hostname": "node-a"}},
    "status": {"addresses": [{"type": "InternalIP", "address": "192.168.0.2"}]},
}
GOOD = yaml.safe_dump_all([NODE, SERVICE, SLICE], sort_keys=False)


# -- point 1: nesting --------------------------------------------------------------------------

HOSTILE = {
    "flow-sequences": "[" * HOSTILE_SIZE,
    "flow-sequences-lines": "[\n" * (HOSTILE_SIZE // 2),
    "flow-mappings": "{" * HOSTILE_SIZE,
    "flow-mixed": "[{" * (HOSTILE_SIZE // 2),
    "flow-pairs": "[a: " * (HOSTILE_SIZE // 4),
    "json-objects": '{"a": ' * (HOSTILE_SIZE // 6),
    "block-sequences": "- " * (HOSTILE_SIZE // 2) + "x\n",
    "block-keys": "? " * (HOSTILE_SIZE // 2) + "x\n",
    "block-after-a-document": GOOD + "---\n" + "- " * (HOSTILE_SIZE // 2) + "x\n",
    "block-indented": "".join(" " * i + "a:\n" for i in range(440)),
    "block-indented-items": "".join(" " * i + "-\n" for i in range(440)),
}
"""Each nests far past ``_MAX_DEPTH``; the last two are read by the block subset
reader, not PyYAML, which must decline them so that they are measured."""


@pytest.fixture
def unbounded_loader() -> Iterator[None]:
    """PyYAML's pure-Python loader in place of libyaml's: no nesting limit, and a
    recursive composer that would fail (RecursionError) if the guard let a text through."""
    with mock.patch.object(decode, "_LOADER", yaml.SafeLoader):
        yield


GUARD = f"more than {decode._MAX_DEPTH} levels of collections"


@pytest.mark.parametrize("text", HOSTILE.values(), ids=HOSTILE.keys())
def test_deep_nesting_is_refused_before_decoding(text: str, unbounded_loader: None) -> None:
    for parse in (parse_state, k8s._parse_whole):
        [problem] = problems(text, parse)
        assert problem.startswith("YAML nested too deep at line "), problem
        assert GUARD in problem


@pytest.mark.parametrize("text", HOSTILE.values(), ids=HOSTILE.keys())
def test_deep_nesting_is_refused_with_the_real_loader(text: str) -> None:
    """With libyaml (whichever this machine has), a plain StateError: never a crash,
    never another exception. The wheel's libyaml may name its own limit first."""
    [problem] = problems(text)
    assert GUARD in problem or "exceeded maximum nesting depth" in problem, problem


def test_the_guard_runs_before_the_loader(unbounded_loader: None) -> None:
    """The loader never sees a text that nests too deep: the guard refuses it first."""
    seen: list[str] = []
    real = yaml.load_all

    def spy(stream: str, Loader: Any) -> Any:
        seen.append(stream)
        return real(stream, Loader=Loader)

    with mock.patch.object(yaml, "load_all", spy):
        for text in HOSTILE.values():
            with pytest.raises(StateError):
                parse_state(text)
    assert all(depth_of(s) <= decode._MAX_DEPTH for s in seen), "a deep text reached the loader"


def test_a_parser_keeps_working_after_a_deep_state(unbounded_loader: None) -> None:
    parser = StateParser()
    good = parser.parse(GOOD, 1)
    for text in HOSTILE.values():
        with pytest.raises(StateError):
            parser.parse(text, 2)
    assert parser.parse(GOOD, 3) == dataclasses.replace(good, generation=3)


def _nested_state(depth: int, flow: bool) -> str:
    """``GOOD`` plus an unknown field on the Service that brings it to ``depth`` levels.

    The root mapping is level 1 and ``x`` opens level 2; ``flow`` writes the
    rest as ``[[...]]`` (read by PyYAML), else as indented mappings (read by
    the block subset reader).
    """
    if flow:
        field = "x: " + "[" * (depth - 1) + "]" * (depth - 1) + "\n"
    else:
        field = "x:\n" + "".join(" " * (i + 1) + "a:\n" for i in range(depth - 3))
        field += " " * (depth - 2) + "b: {}\n"
    service = yaml.safe_dump(SERVICE, sort_keys=False)
    return yaml.safe_dump_all([NODE, SLICE], sort_keys=False) + "---\n" + service + field


@pytest.mark.parametrize("flow", [True, False], ids=["flow", "block"])
def test_the_limit_is_exact_and_the_same_on_every_road(flow: bool) -> None:
    limit = decode._MAX_DEPTH
    at_limit = _nested_state(limit, flow)
    assert depth_of(at_limit) == limit
    snap = parse_state(at_limit)
    assert [s.name for s in snap.services] == ["web"]
    assert k8s._parse_whole(at_limit) == snap
    over = _nested_state(limit + 1, flow)
    assert depth_of(over) == limit + 1
    assert problems(over) == problems(over, k8s._parse_whole)
    [problem] = problems(over)
    assert problem.startswith(f"YAML nested too deep at {first_too_deep(over)}: {GUARD}")


def test_deep_json_becomes_a_state_error() -> None:
    """``json`` raises RecursionError on deep nesting: that text goes on to PyYAML's door,
    which refuses it; no RecursionError (or anything else) escapes."""
    text = '{"kind": "List", "items": ' + "[" * 5000 + "]" * 5000 + "}"
    with pytest.raises(RecursionError):
        json.loads(text)
    [problem] = problems(text)
    assert GUARD in problem or "exceeded maximum nesting depth" in problem
    with mock.patch.object(decode, "_LOADER", yaml.SafeLoader):
        [problem] = problems(text)
        assert problem.startswith(f"YAML nested too deep at {first_too_deep(text)}: {GUARD}")


def test_the_cheap_bound_holds_on_its_worst_cases() -> None:
    """Texts the cheap test passes (``_could_nest_deeply`` False) as deep as the bound
    allows stay within ``_MAX_DEPTH``: the bound the docstring argues, measured."""
    prefix = decode._SHALLOW_INDENT - 1
    openers = decode._SHALLOW_OPENERS
    flow = "[a: " * openers + "b" + "]" * openers
    worst = [
        # Indentation, then compact indicators, then flow pairs, all at their maxima.
        "".join(" " * i + "a:\n" for i in range(prefix - 3)) + " " * (prefix - 4) + "- - " + flow,
        "".join(" " * i + "k:\n" + " " * i + "-\n" for i in range(prefix)) + " " * prefix + flow,
        "- " * (prefix // 2) + flow,
        "\ufeff" + "? " * (prefix // 2) + flow,
    ]
    for text in worst:
        assert not decode._could_nest_deeply(text), text[:80]
        assert depth_of(text) <= decode._MAX_DEPTH
    # One step past either threshold and the exact measure takes over.
    assert decode._could_nest_deeply("[" * (openers + 1))
    assert decode._could_nest_deeply("a: b\n" + " " * decode._SHALLOW_INDENT + "c: d\n")
    assert decode._could_nest_deeply("a: b\r\ufeff" + "- " * (decode._SHALLOW_INDENT // 2) + "x")


def test_big_states_never_pay_for_the_exact_measure(
    make_state: Callable[[int, int, int], dict[str, Any]],
    make_state_yaml: Callable[[int, int, int], str],
    yaml_reader: str,
) -> None:
    """The exact measure costs a tenth of a PyYAML decode; ordinary states skip it
    (the subset reader and ``json`` never need it, PyYAML's chunks pass the cheap test)."""
    items = make_state(300, 3, 5)["items"]
    texts = [
        json.dumps(make_state(300, 3, 5)),
        "---\n".join(yaml.safe_dump(item, default_flow_style=True) for item in items),
    ]
    if yaml_reader == "fast":
        # One block-style List: with the fast reader off, PyYAML reads it whole, and
        # its 300 ``{}`` are more brackets than the cheap test clears.
        texts.append(make_state_yaml(300, 3, 5))
    calls = 0
    real = decode._too_deep

    def counted(text: str) -> Any:
        nonlocal calls
        calls += 1
        return real(text)

    with mock.patch.object(decode, "_too_deep", counted):
        for text in texts:
            assert len(parse_state(text).services) == 300
    assert calls == 0


# -- point 1, for real: kpx check against a libyaml without a nesting limit ---------------------

DISTRO_PYYAML = Path("/usr/lib/python3/dist-packages")


def _pyyaml_path(tmp: Path) -> str | None:
    """A PYTHONPATH entry that holds only the distro's PyYAML, if this Python can import it."""
    if not (DISTRO_PYYAML / "yaml" / "__init__.py").exists():
        return None
    tmp.mkdir(exist_ok=True)
    for name in ("yaml", "_yaml"):
        if (DISTRO_PYYAML / name).exists() and not (tmp / name).exists():
            (tmp / name).symlink_to(DISTRO_PYYAML / name)
    probe = subprocess.run(
        [sys.executable, "-c", "import yaml, sys; sys.exit(0 if yaml.__with_libyaml__ else 1)"],
        env={**os.environ, "PYTHONPATH": str(tmp)}, capture_output=True, timeout=60, check=False,
    )
    return str(tmp) if probe.returncode == 0 else None


@pytest.fixture(scope="module", params=["venv", "distro"])
def pyyaml_env(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, str]:
    """The environment for a ``kpx`` child: the venv's PyYAML, or the distro's (libyaml
    0.2.5, no nesting limit: the build that crashed), skipped where there is none."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if request.param == "distro":
        path = _pyyaml_path(tmp_path_factory.mktemp("pyyaml") / "site")
        if path is None:
            pytest.skip("no distro PyYAML with libyaml for this Python")
        env["PYTHONPATH"] = path
    return env


def kpx_check(path: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "proxy", "check", str(path)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120, check=False,
    )


@pytest.mark.parametrize(
    "name", ["flow-sequences", "flow-mappings", "block-sequences", "block-keys", "json-objects"]
)
def test_kpx_check_survives_deep_nesting(
    name: str, pyyaml_env: dict[str, str], tmp_path: Path, yaml_reader: str
) -> None:
    path = tmp_path / "state.yaml"
    path.write_text(HOSTILE[name])
    # The child picks its reader from the environment, as any kpx does.
    res = kpx_check(path, {**pyyaml_env, "KPX_NO_FAST_YAML": str(int(yaml_reader == "pyyaml"))})
    assert res.returncode == 1, f"exit {res.returncode} (-11 is SIGSEGV)\n{res.stderr[-2000:]}"
    assert "Traceback" not in res.stderr
    lines = res.stderr.splitlines()
    assert lines[-1].startswith(f"{path}: 1 problem") and "refused" in lines[-1]
    assert GUARD in lines[0] or "exceeded maximum nesting depth" in lines[0], lines[0]
    if "PYTHONPATH" in pyyaml_env:
        # libyaml 0.2.5 has no limit of its own: only kpx's guard stands in the way.
        assert GUARD in lines[0]


def test_kpx_check_refuses_invalid_utf8(tmp_path: Path) -> None:
    path = tmp_path / "state.yaml"
    path.write_bytes(GOOD.encode().replace(b"name: web\n", b"name: w\xffb\n", 1))
    res = kpx_check(path, dict(os.environ))
    assert res.returncode == 1
    assert "Traceback" not in res.stderr
    assert res.stderr.splitlines()[0] == (
        f"{path}: not UTF-8 text (invalid start byte at byte {GOOD.encode().index(b'web') + 1})"
    )


def test_decode_state_is_the_one_door_for_bytes() -> None:
    assert decode_state(GOOD.encode()) == GOOD
    with pytest.raises(StateError) as info:
        decode_state(b"kind: Service\n\xc3\x28")
    assert info.value.problems == ["not UTF-8 text (invalid continuation byte at byte 14)"]


# -- point 6: no documents ---------------------------------------------------------------------

EMPTY = ["", "\n", "   \n\n", "# kubectl failed\n", "---\n", "---\n---\n# c\n", "null\n", "~"]


@pytest.mark.parametrize("text", EMPTY, ids=repr)
def test_a_state_with_no_documents_is_refused(text: str, tmp_path: Path) -> None:
    assert problems(text) == [k8s.NO_DOCUMENTS]
    assert problems(text, k8s._parse_whole) == [k8s.NO_DOCUMENTS]
    path = tmp_path / "state.yaml"
    path.write_text(text)
    assert problems(path, parse_file) == [k8s.NO_DOCUMENTS]  # type: ignore[arg-type]
    assert "kind: List" in k8s.NO_DOCUMENTS and "items: []" in k8s.NO_DOCUMENTS


@pytest.mark.parametrize(
    "text",
    [
        "apiVersion: v1\nkind: List\nitems: []\n",
        "apiVersion: v1\nkind: List\nmetadata:\n  resourceVersion: ''\n",
        '{"apiVersion": "v1", "kind": "List", "items": []}',
        "# nothing to proxy\n---\nkind: ServiceList\nitems:\n",
        "kind: ConfigMap\nmetadata:\n  name: not-for-kpx\n",
    ],
    ids=["list", "list-without-items", "json-list", "typed-list", "other-kind"],
)
def test_a_document_with_nothing_for_kpx_is_a_deliberate_empty_state(text: str) -> None:
    assert parse_state(text, 5) == k8s._parse_whole(text, 5)
    snap = parse_state(text, 5)
    assert (snap.nodes, snap.services, snap.slices, snap.generation) == ((), (), (), 5)


def test_truncating_a_file_keeps_the_parser_usable() -> None:
    parser = StateParser()
    before = parser.parse(GOOD, 1)
    assert len(before.services) == 1
    with pytest.raises(StateError):
        parser.parse("", 2)
    assert len(parser.parse(GOOD, 3).services) == 1


# -- point 9: names and escaping ---------------------------------------------------------------


def _with(obj: dict[str, Any], path: str, value: object) -> dict[str, Any]:
    out = copy.deepcopy(obj)
    *parents, last = path.split(".")
    target: Any = out
    for step in parents:
        target = target[int(step)] if step.isdigit() else target[step]
    target[int(last) if last.isdigit() else last] = value
    return out


FORGED = "web\n2024-05-01 10:00:00 CRITICAL kpx: all NodePorts compromised"
DNS1035 = fields._DNS1035_LABEL_RULE.rule
DNS1123 = fields._DNS1123_LABEL_RULE.rule
SUBDOMAIN = fields._DNS1123_SUBDOMAIN_RULE.rule
LABEL_KEY = fields._LABEL_KEY_RULE.rule
LABEL_VALUE = fields._LABEL_VALUE_RULE.rule

BAD_NAMES = [
    pytest.param(
        _with(SERVICE, "metadata.name", FORGED),
        'Service "default/web\\n2024-05-01 10:00:00 CRITICAL kpx: all NodePorts compromised": '
        'metadata.name: "web\\n2024-05-01 10:00:00 CRITICAL kpx: all NodePorts compromised" '
        f"is not a valid Service name: {DNS1035}",
        id="service-newline",
    ),
    pytest.param(
        _with(SERVICE, "metadata.name", "web;rm -rf /"),
        'Service "default/web;rm -rf /": metadata.name: "web;rm -rf /" is not a valid '
        f"Service name: {DNS1035}",
        id="service-semicolon",
    ),
    pytest.param(
        _with(SERVICE, "metadata.name", "$(reboot)"),
        f'Service default/$(reboot): metadata.name: "$(reboot)" is not a valid Service name: '
        f"{DNS1035}",
        id="service-subshell",
    ),
    pytest.param(
        _with(SERVICE, "metadata.name", "`id`"),
        f'Service default/`id`: metadata.name: "`id`" is not a valid Service name: {DNS1035}',
        id="service-backquote",
    ),
    pytest.param(
        _with(SERVICE, "metadata.name", 'a"; flush ruleset; "'),
        'Service "default/a\\"; flush ruleset; \\"": metadata.name: '
        f'"a\\"; flush ruleset; \\"" is not a valid Service name: {DNS1035}',
        id="service-nft",
    ),
    pytest.param(
        _with(SERVICE, "metadata.name", "1web"),
        f'Service default/1web: metadata.name: "1web" is not a valid Service name: {DNS1035}',
        id="service-digit-first",
    ),
    pytest.param(
        _with(SERVICE, "metadata.name", "w" * 64),
        f"Service default/{'w' * 64}: metadata.name: \"{'w' * 64}\" is not a valid Service "
        f"name: {DNS1035}",
        id="service-too-long",
    ),
    pytest.param(
        _with(SERVICE, "metadata.namespace", "Prod_1"),
        f'Service Prod_1/web: metadata.namespace: "Prod_1" is not a valid namespace: {DNS1123}',
        id="namespace",
    ),
    pytest.param(
        _with(SERVICE, "metadata.labels", {"app": "web\x1b[2J"}),
        'Service default/web: metadata.labels["app"]: "web\\x1b[2J" is not a valid label '
        f"value: {LABEL_VALUE}",
        id="label-value-escape",
    ),
    pytest.param(
        _with(SERVICE, "metadata.labels", {"bad key": "x"}),
        f'Service default/web: metadata.labels["bad key"]: "bad key" is not a valid label '
        f"key: {LABEL_KEY}",
        id="label-key",
    ),
    pytest.param(
        _with(NODE, "metadata.name", "Node_A"),
        f'Node Node_A: metadata.name: "Node_A" is not a valid Node name: {SUBDOMAIN}',
        id="node-name",
    ),
    pytest.param(
        _with(NODE, "metadata.labels", {"kubernetes.io/hostname": "a\u2028b"}),
        'Node node-a: metadata.labels["kubernetes.io/hostname"]: "a\\u2028b" is not a '
        f"valid label value: {LABEL_VALUE}",
        id="node-label-line-separator",
    ),
    pytest.param(
        _with(SLICE, "metadata.name", "web..abc"),
        'EndpointSlice default/web..abc: metadata.name: "web..abc" is not a valid '
        f"EndpointSlice name: {SUBDOMAIN}",
        id="slice-name",
    ),
    pytest.param(
        _with(SLICE, "metadata.labels", {"kubernetes.io/service-name": "web\nx"}),
        'EndpointSlice default/web-abc: metadata.labels["kubernetes.io/service-name"]: '
        f'"web\\nx" is not a valid label value: {LABEL_VALUE}',
        id="slice-service-name",
    ),
    pytest.param(
        _with(SLICE, "endpoints.0.nodeName", "node-a\r\nCRITICAL"),
        'EndpointSlice default/web-abc: endpoints[0].nodeName: "node-a\\r\\nCRITICAL" is '
        f"not a valid node name: {SUBDOMAIN}",
        id="endpoint-node-name",
    ),
]


@pytest.mark.parametrize(("obj", "expected"), BAD_NAMES)
def test_names_are_held_to_the_api_servers_formats(obj: dict[str, Any], expected: str) -> None:
    objs = [o for o in (NODE, SERVICE, SLICE) if o["kind"] != obj["kind"]] + [obj]
    text = yaml.safe_dump_all(objs, sort_keys=False)
    assert problems(text) == [expected]
    assert problems(text, k8s._parse_whole) == [expected]
    assert problems(json.dumps({"kind": "List", "items": objs})) == [expected]


@pytest.mark.parametrize(("obj", "expected"), BAD_NAMES)
def test_the_quick_judges_refuse_what_the_full_judge_refuses(
    obj: dict[str, Any], expected: str
) -> None:
    with (
        mock.patch.object(fields, "_quick_service", lambda doc: None),
        mock.patch.object(fields, "_quick_slice", lambda doc, interned: None),
    ):
        full = fields._judge(obj)
    assert fields._judge(obj) == full
    assert not full.clean


@pytest.mark.parametrize(("obj", "expected"), BAD_NAMES)
def test_every_problem_is_one_printable_line(obj: dict[str, Any], expected: str) -> None:
    text = yaml.safe_dump_all([obj], sort_keys=False)
    with pytest.raises(StateError) as info:
        parse_state(text)
    assert all(p.isprintable() for p in info.value.problems)
    assert str(info.value).splitlines() == info.value.problems


def test_names_the_api_server_accepts_are_accepted() -> None:
    service = _with(SERVICE, "metadata.name", "w" + "-9" * 31)
    service = _with(service, "metadata.namespace", "kube-system")
    service = _with(service, "metadata.labels", {
        "app.kubernetes.io/name": "Web_App.v1", "empty": "", "x": "y" * 63, "A_b.C-d": "0",
    })
    node = _with(NODE, "metadata.name", "ip-10-0-0-1.eu-west-1.compute.internal")
    slice_ = _with(SLICE, "metadata.name", "w" + "-9" * 31 + "-abc.x")
    slice_ = _with(slice_, "metadata.namespace", "kube-system")
    slice_ = _with(slice_, "metadata.labels", {k8s.SERVICE_NAME_LABEL: "w" + "-9" * 31})
    slice_ = _with(slice_, "endpoints.0.nodeName", "ip-10-0-0-1.eu-west-1.compute.internal")
    snap = parse_state(yaml.safe_dump_all([node, service, slice_]))
    assert [s.key for s in snap.services] == ["kube-system/w" + "-9" * 31]
    assert [sl.name for sl in snap.slices] == ["w" + "-9" * 31 + "-abc.x"]
    assert snap.slices[0].endpoints[0].node_name == node["metadata"]["name"]


def test_problems_quote_input_escaped() -> None:
    bad = _with(SERVICE, "spec.type", "NodePort\nCRITICAL")
    assert problems(yaml.safe_dump(bad)) == [
        'Service default/web: spec.type: "NodePort\\nCRITICAL" is not one of ClusterIP, '
        "NodePort, LoadBalancer, ExternalName"
    ]
    bad = _with(SERVICE, "spec.ports.0.port", 'a"b\\c\x00')
    assert problems(yaml.safe_dump(bad)) == [
        'Service default/web: spec.ports[0].port: expected an integer, got string "a\\"b\\\\c\\x00"'
    ]


def test_state_error_escapes_whatever_reaches_it() -> None:
    err = StateError(["line one\nCRITICAL forged", "tab\there", "fine"])
    assert err.problems == ["line one\\nCRITICAL forged", "tab\\there", "fine"]
    assert str(err).splitlines() == err.problems


# -- values PyYAML's constructors cannot build -------------------------------------------

UNBUILDABLE = {
    "impossible date": "2020-13-45",
    "Feb 30": "2020-02-30T10:00:00Z",
    "zone offset out of range": "2001-12-14t21:59:43.10-99:99",
    "5000-digit int": "1" * 5000,
    "!!int on text": "!!int 'zz'",
    "!!float on text": "!!float 'zz'",
    "!!bool on text": "!!bool 'zz'",
    "!!timestamp on text": "!!timestamp 'xx'",
}
"""Plain scalars that PyYAML's resolver takes for a date or a number (or that a tag makes
one) and its constructor then fails to build, with a ValueError, KeyError or the like
rather than a YAML error."""


def with_label(value: str) -> str:
    """A good state and a second Service that carries ``value`` as a label's value."""
    other = ("apiVersion: v1\nkind: Service\nmetadata:\n  name: other\n  namespace: default\n"
             f"  labels:\n    app: {value}\nspec:\n  clusterIP: 10.96.0.99\n  ports:\n"
             "  - port: 80\n    protocol: TCP\n    targetPort: 8080\n")
    return yaml.safe_dump_all([NODE, SERVICE, SLICE]) + "---\n" + other


@pytest.mark.parametrize("value", UNBUILDABLE.values(), ids=UNBUILDABLE.keys())
def test_a_value_yaml_cannot_build_is_a_problem_at_its_line(value: str) -> None:
    found = problems(with_label(value))
    line = with_label(value).split("\n").index(f"    app: {value}") + 1
    assert len(found) == 1, found
    assert found[0].startswith(f"YAML value error at line {line}, column "), found
    assert "cannot read" in found[0], found
    assert len(found[0]) < 400, "a huge value is shown cut short"


@pytest.mark.parametrize(("value", "bits"), [("0b" + "1" * 15000, 15000),
                                             ("1" + ":59" * 2600, 15359)],
                         ids=["binary", "sexagesimal"])
def test_a_number_too_long_to_print_is_named_by_its_size(value: str, bits: int) -> None:
    """Python prints no int of over 4,300 digits; a base-2 or base-60 one is built anyway."""
    assert problems(with_label(value)) == [
        f'Service default/other: metadata.labels["app"]: expected a string, got integer'
        f" {bits}-bit number"]
    port = yaml.safe_dump(SERVICE).replace("port: 80\n", f"port: {value}\n", 1)
    assert problems(port) == [
        f"Service default/web: spec.ports[0].port: {bits}-bit number is out of range 1-65535"]
