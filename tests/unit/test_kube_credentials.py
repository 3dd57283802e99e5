"""``--kubeconfig`` credentials end to end, against the fake API server on 127.0.0.1.

Every kind of credential a kubeconfig holds is tried on the wire: exec
plugins (a real script printing an ExecCredential, v1 and v1beta1, renewed
before it expires and re-run after a 401), client certificates from files
and from a plugin, token files, ``tls-server-name``,
``insecure-skip-tls-verify`` and ``proxy-url`` (a CONNECT proxy in the
test). A bad kubeconfig is an error that names the field, never a crash.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
import logging
import ssl
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from proxy.cli import main as kpx_main
from proxy.sources.hub import StateHub
from proxy.sources.kubeapi import KubeAPISource
from proxy.sources.kubeconfig import ExecPlugin, KubeConfig, KubeConfigError
from tests.support.apiserver import FakeAPIServer
from tests.support.objects import endpoint_slice, node, service
from tests.support.pki import make_pki

NODE = "node-a"
REPO = Path(__file__).resolve().parents[2]
FAST: dict[str, Any] = {"min_sync_period": 0.005, "backoff_initial": 0.005, "backoff_max": 0.02}

PLUGIN = """#!{python}
# A fake exec credential plugin: each run appends to RUNS and prints a new credential.
import datetime, json, os, sys, time
runs, lifetime, mode = sys.argv[1], float(sys.argv[2]), sys.argv[3]
info = json.loads(os.environ["KUBERNETES_EXEC_INFO"])
if mode == "fail":
    with open(runs + ".failed", "a") as f:
        f.write("failed\\n")
    sys.stderr.write("the identity provider said no\\n")
    sys.exit(3)
with open(runs, "a+") as f:
    f.seek(0)
    n = len(f.readlines()) + 1
    expires = int(time.time() + lifetime)
    f.write(json.dumps({{"n": n, "at": time.time(), "expires": expires,
                        "apiVersion": info["apiVersion"]}}) + "\\n")
stamp = datetime.datetime.fromtimestamp(expires, datetime.timezone.utc)
status = {{"expirationTimestamp": stamp.strftime("%Y-%m-%dT%H:%M:%SZ")}}
if mode == "cert":
    status["clientCertificateData"] = open(os.environ["CERT"]).read()
    status["clientKeyData"] = open(os.environ["KEY"]).read()
else:
    status["token"] = "tok-%d" % n
print(json.dumps({{"apiVersion": info["apiVersion"], "kind": "ExecCredential",
                  "status": status}}))
"""


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def kubeconfig(path: Path, cluster: dict[str, Any], user: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1",
        "kind": "Config",
        "current-context": "c",
        "contexts": [{"name": "c", "context": {"cluster": "k", "user": "u"}}],
        "clusters": [{"name": "k", "cluster": cluster}],
        "users": [{"name": "u", "user": user}],
    }))
    return path


def plugin(tmp_path: Path, lifetime: float, mode: str = "token",
           api_version: str = "client.authentication.k8s.io/v1",
           env: dict[str, str] | None = None) -> dict[str, Any]:
    """A kubeconfig ``exec`` stanza running the fake plugin; its runs go to tmp/runs."""
    script = tmp_path / "kpx-fake-auth"
    script.write_text(PLUGIN.format(python=sys.executable))
    script.chmod(0o755)
    return {
        "apiVersion": api_version,
        "command": str(script),
        "args": [str(tmp_path / "runs"), str(lifetime), mode],
        "env": [{"name": k, "value": v} for k, v in (env or {}).items()],
        "interactiveMode": "Never",
    }


def runs(tmp_path: Path) -> list[dict[str, Any]]:
    path = tmp_path / "runs"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines()]


async def until(check: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


async def sync(config: KubeConfig, timeout: float = 3.0) -> tuple[StateHub, KubeAPISource,
                                                                    asyncio.Task[None]]:
    hub = StateHub()
    source = KubeAPISource(config, hub, NODE, **FAST)
    task = asyncio.create_task(source.run())
    await source.wait_synced(timeout)
    return hub, source, task


async def stop(source: KubeAPISource, task: asyncio.Task[None]) -> None:
    source.stop()
    await asyncio.wait_for(task, 3)


def populate(api: FakeAPIServer) -> None:
    api.put(node(NODE, "192.168.0.2"))
    api.put(service("web", 30080))
    api.put(endpoint_slice("web", "10.0.0.1"))


@pytest.fixture
async def api() -> AsyncIterator[FakeAPIServer]:
    server = FakeAPIServer()
    await server.start()
    populate(server)
    yield server
    await server.close()


def seen_tokens(api: FakeAPIServer) -> list[str | None]:
    out = []
    for r in api.requests:
        auth = r.headers.get("Authorization")
        out.append(auth.removeprefix("Bearer ") if auth else None)
    return out


# -- exec plugins --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "version", ["client.authentication.k8s.io/v1", "client.authentication.k8s.io/v1beta1"]
)
async def test_exec_plugin_token_is_renewed_before_it_expires(
    api: FakeAPIServer, tmp_path: Path, version: str
) -> None:
    """A 5-second credential: the plugin runs again before each one expires, and
    the server sees the new token; an expired token is never sent (it would 401).

    The plugin stamps whole seconds, so a credential lives 4-5 s and is renewed a
    fifth of that, 0.8-1 s, ahead: room for the plugin's own start on a loaded
    machine (a 3-second one left 0.4 s)."""
    def valid(token: str | None) -> bool:
        for run in runs(tmp_path):
            if token == f"tok-{run['n']}":
                return time.time() < run["expires"]
        return False

    api.check_token = valid
    path = kubeconfig(tmp_path / "config", {"server": api.url},
                      {"exec": plugin(tmp_path, 5.0, api_version=version)})
    config = KubeConfig.load(path)
    assert runs(tmp_path) == [], "the plugin runs at the first request, not at load"
    hub, source, task = await sync(config)
    try:
        assert hub.snapshot is not None
        # Keep requests coming (each ended watch is a new one) until two renewals.
        deadline = time.monotonic() + 20
        while len(runs(tmp_path)) < 3 and time.monotonic() < deadline:
            api.end_watches("Service")
            await asyncio.sleep(0.1)
        api.end_watches("Service")
        await until(lambda: seen_tokens(api)[-1] == f"tok-{len(runs(tmp_path))}")
    finally:
        await stop(source, task)
    done = runs(tmp_path)
    assert len(done) >= 3
    assert {r["apiVersion"] for r in done} == {version}
    for before, after in itertools.pairwise(done):
        assert after["at"] < before["expires"], "renewed only after it expired"
    assert api.unauthorized == []
    assert {"tok-1", "tok-2", "tok-3"} <= set(seen_tokens(api))


async def test_exec_plugin_is_rerun_after_a_401(api: FakeAPIServer, tmp_path: Path) -> None:
    """A credential the server revokes early is fetched again (client-go does the same)."""
    revoked: set[str | None] = set()
    api.check_token = lambda token: token is not None and token not in revoked
    path = kubeconfig(tmp_path / "config", {"server": api.url},
                      {"exec": plugin(tmp_path, 3600)})
    hub, source, task = await sync(KubeConfig.load(path))
    try:
        assert hub.snapshot is not None and len(runs(tmp_path)) == 1
        revoked.add("tok-1")
        api.end_watches("Service")
        await until(lambda: "tok-2" in seen_tokens(api))
    finally:
        await stop(source, task)
    assert api.unauthorized and set(api.unauthorized) == {"tok-1"}
    assert len(runs(tmp_path)) == 2, "one run per 401, not one per request"


async def test_failing_exec_plugin_is_logged_and_retried(
    api: FakeAPIServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Waited for, not timed: a plugin is a process, and a loaded machine starts one late.
    The first list of each of the three kinds runs it once; a fourth run is a retry."""
    path = kubeconfig(tmp_path / "config", {"server": api.url},
                      {"exec": plugin(tmp_path, 60, mode="fail")})
    failed = tmp_path / "runs.failed"
    hub, source, task = await sync(KubeConfig.load(path), timeout=0.3)
    try:
        await until(lambda: failed.exists() and len(failed.read_text().splitlines()) >= 4
                    and "process returned 3" in caplog.text, timeout=20)
        assert hub.snapshot is None and not task.done()
    finally:
        await stop(source, task)
    assert api.requests == [], "nothing is sent without a credential"
    assert "users[name=u]/user.exec: exec: process returned 3" in caplog.text
    assert "the identity provider said no" in caplog.text


async def test_a_stop_as_the_plugin_finishes_is_never_lost() -> None:
    """A source's stop cancels a reflector that may be waiting for its plugin. Python
    3.11's ``asyncio.wait_for`` loses a cancel that comes in the loop turn its awaitable
    finishes, and a reflector that lost it went on listing with no session. Here the
    plugin finishes and the cancel comes 0, 1, 2, ... loop turns later: every cancel
    that finds the refresh still running must end it."""
    class Provider:
        def __init__(self, finished: asyncio.Future[dict[str, str]]) -> None:
            self.args = ["plugin"]
            self.finished = finished

        async def run(self) -> dict[str, str]:
            return await self.finished

    loop = asyncio.get_running_loop()
    issued: list[int] = []
    for turns in range(8):
        finished: asyncio.Future[dict[str, str]] = loop.create_future()
        plugin = ExecPlugin(Provider(finished), "users[name=u]/user.exec")
        task = asyncio.create_task(plugin.refresh())
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert not task.done()

        def cancel_after(n: int, task: asyncio.Task[bool] = task, turns: int = turns) -> None:
            if n:
                loop.call_soon(cancel_after, n - 1)
            elif task.cancel():
                issued.append(turns)

        finished.set_result({"token": "t"})
        cancel_after(turns)
        with contextlib.suppress(asyncio.CancelledError):
            await task
        if turns in issued:
            assert task.cancelled(), f"a cancel {turns} loop turns after the plugin finished"
    assert issued[:3] == [0, 1, 2], issued


# -- TLS -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_pki(tmp_path_factory.mktemp("pki"))


async def tls_api(pki: Path, cert: str = "server", client_auth: bool = True) -> FakeAPIServer:
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=str(pki / "ca.crt"))
    ctx.load_cert_chain(pki / f"{cert}.crt", pki / f"{cert}.key")
    ctx.verify_mode = ssl.CERT_REQUIRED if client_auth else ssl.CERT_NONE
    server = FakeAPIServer(ssl_context=ctx)
    await server.start()
    populate(server)
    return server


async def refused_by_tls(config: KubeConfig, caplog: pytest.LogCaptureFixture,
                         reason: str) -> None:
    """Run a source until it has tried the server and logged *reason*; then check that
    nothing got through: no snapshot, and no request reached the server's handlers.

    Waiting for the refusal itself, not for a fixed time, is what keeps this from
    passing on a loaded machine where the source had not yet tried at all.
    """
    with caplog.at_level(logging.WARNING, logger="proxy.sources.kubeapi"):
        hub = StateHub()
        source = KubeAPISource(config, hub, NODE, **FAST)
        task = asyncio.create_task(source.run())
        try:
            await until(lambda: "CERTIFICATE_VERIFY_FAILED" in caplog.text, 20)
        finally:
            await stop(source, task)
    assert reason in caplog.text, caplog.text[-2000:]
    assert hub.snapshot is None


async def test_client_certificate_files(pki: Path, tmp_path: Path) -> None:
    api = await tls_api(pki)
    try:
        path = kubeconfig(
            tmp_path / "config",
            {"server": api.url, "certificate-authority": str(pki / "ca.crt")},
            {"client-certificate": str(pki / "client.crt"), "client-key": str(pki / "client.key")},
        )
        hub, source, task = await sync(KubeConfig.load(path))
        await stop(source, task)
        assert hub.snapshot is not None
        assert {r.peer for r in api.requests} == {"kpx-client"}
    finally:
        await api.close()


async def test_exec_plugin_client_certificate(pki: Path, tmp_path: Path) -> None:
    api = await tls_api(pki)
    try:
        exec_ = plugin(tmp_path, 3600, mode="cert",
                       env={"CERT": str(pki / "client.crt"), "KEY": str(pki / "client.key")})
        path = kubeconfig(
            tmp_path / "config",
            {"server": api.url, "certificate-authority-data": b64((pki / "ca.crt").read_bytes())},
            {"exec": exec_},
        )
        hub, source, task = await sync(KubeConfig.load(path))
        await stop(source, task)
        assert hub.snapshot is not None
        assert {r.peer for r in api.requests} == {"kpx-client"}
        assert "Authorization" not in api.requests[0].headers
    finally:
        await api.close()


async def test_tls_server_name(
    pki: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The server's certificate names apiserver.kpx.test, not 127.0.0.1: only
    ``tls-server-name`` makes it verify."""
    api = await tls_api(pki, cert="named", client_auth=False)
    api.token = "t"
    try:
        cluster = {"server": api.url, "certificate-authority": str(pki / "ca.crt")}
        wrong = KubeConfig.load(kubeconfig(tmp_path / "wrong", cluster, {"token": "t"}))
        await refused_by_tls(wrong, caplog, "certificate is not valid for '127.0.0.1'")
        assert api.requests == [], "verified against 127.0.0.1"
        cluster["tls-server-name"] = "apiserver.kpx.test"
        right = KubeConfig.load(kubeconfig(tmp_path / "right", cluster, {"token": "t"}))
        hub, source, task = await sync(right)
        await stop(source, task)
        assert hub.snapshot is not None
    finally:
        await api.close()


async def test_insecure_skip_tls_verify(
    pki: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """No CA at all: the default trust store refuses the test CA; skipping verification works."""
    api = await tls_api(pki, client_auth=False)
    try:
        verified = KubeConfig.load(kubeconfig(tmp_path / "v", {"server": api.url}, {}))
        await refused_by_tls(verified, caplog, "self-signed certificate in certificate chain")
        assert api.requests == []
        skip = {"server": api.url, "insecure-skip-tls-verify": True}
        hub, source, task = await sync(KubeConfig.load(kubeconfig(tmp_path / "s", skip, {})))
        await stop(source, task)
        assert hub.snapshot is not None
    finally:
        await api.close()


async def test_token_file(api: FakeAPIServer, tmp_path: Path) -> None:
    (tmp_path / "token").write_text("from-file\n")
    api.token = "from-file"
    path = kubeconfig(tmp_path / "config", {"server": api.url}, {"tokenFile": "token"})
    hub, source, task = await sync(KubeConfig.load(path))
    await stop(source, task)
    assert hub.snapshot is not None and api.unauthorized == []


# -- proxy-url -----------------------------------------------------------------------------


class ConnectProxy:
    """An HTTP CONNECT proxy on 127.0.0.1 that records each tunnel's target."""

    def __init__(self) -> None:
        self.targets: list[str] = []
        self.server: asyncio.Server | None = None
        self.url = ""

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        method, target, _ = head.split(b"\r\n", 1)[0].decode().split(" ", 2)
        if method != "CONNECT":
            writer.write(b"HTTP/1.1 405 Method Not Allowed\r\n\r\n")
            writer.close()
            return
        self.targets.append(target)
        host, port = target.rsplit(":", 1)
        up_reader, up_writer = await asyncio.open_connection(host, int(port))
        writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            try:
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            except (ConnectionError, asyncio.CancelledError):
                pass
            finally:
                dst.close()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()


async def test_proxy_url_carries_every_request(pki: Path, tmp_path: Path) -> None:
    api = await tls_api(pki, client_auth=False)
    proxy = ConnectProxy()
    await proxy.start()
    try:
        cluster = {"server": api.url, "certificate-authority": str(pki / "ca.crt"),
                   "proxy-url": proxy.url}
        config = KubeConfig.load(kubeconfig(tmp_path / "config", cluster, {}))
        assert config.proxy_url == proxy.url
        hub, source, task = await sync(config)
        await stop(source, task)
        assert hub.snapshot is not None
        target = api.url.removeprefix("https://")
        assert proxy.targets and set(proxy.targets) == {target}
        assert len(proxy.targets) >= 3, "lists and watches of all three kinds"
    finally:
        await proxy.close()
        await api.close()


# -- bad kubeconfigs -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("cluster", "user", "message"),
    [
        ({}, {"exec": {"apiVersion": "client.authentication.k8s.io/v1"}},
         r"users\[name=u\]/user.exec: exec: malformed request. missing key 'command'"),
        ({}, {"exec": {"apiVersion": "client.authentication.k8s.io/v1alpha1", "command": "x"}},
         r"users\[name=u\]/user.exec.apiVersion: 'client.authentication.k8s.io/v1alpha1'"),
        ({}, {"exec": {"apiVersion": "client.authentication.k8s.io/v1", "command": "x",
                       "args": "not-a-list"}},
         r"users\[name=u\]/user.exec.args: not a list of strings"),
        ({"proxy-url": "socks5://127.0.0.1:1080"}, {},
         r"clusters\[name=k\]/cluster.proxy-url: 'socks5://127.0.0.1:1080'.*not socks5"),
        ({"insecure-skip-tls-verify": "yes"}, {},
         r"clusters\[name=k\]/cluster.insecure-skip-tls-verify: not a boolean"),
        ({}, {"token": ["a"]}, r"users\[name=u\]/user.token: not a string"),
        ({}, {"client-key-data": "!!"}, r"users\[name=u\]/user: a client certificate and its key"),
        ({}, {"auth-provider": {"name": "gcp"}}, r"user.auth-provider: the in-tree auth providers"),
    ],
)
def test_bad_kubeconfig_names_the_field(
    tmp_path: Path, cluster: dict[str, Any], user: dict[str, Any], message: str
) -> None:
    path = kubeconfig(tmp_path / "config", {"server": "https://127.0.0.1:6443", **cluster}, user)
    with pytest.raises(KubeConfigError, match=message):
        KubeConfig.load(path)


def test_kubeconfig_structure_errors_name_the_field(tmp_path: Path) -> None:
    path = tmp_path / "config"
    path.write_text(yaml.safe_dump({"current-context": "c", "contexts": [{"name": "c"}]}))
    with pytest.raises(KubeConfigError, match=r"Expected key context in kubeconfig/contexts"):
        KubeConfig.load(path)
    path.write_text(yaml.safe_dump({"current-context": "c", "contexts": {"c": 1}}))
    with pytest.raises(KubeConfigError, match="Expected kubeconfig/contexts to be a list"):
        KubeConfig.load(path)
    path.write_bytes(b"\xff\xfe")
    with pytest.raises(KubeConfigError, match="not YAML"):
        KubeConfig.load(path)


def test_kpx_node_with_a_bad_kubeconfig_exits_2(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = kubeconfig(tmp_path / "config", {"server": "https://127.0.0.1:6443"},
                      {"exec": {"apiVersion": "client.authentication.k8s.io/v1"}})
    assert kpx_main(["node", "--kubeconfig", str(path), "--hostname-override", NODE]) == 2
    assert "missing key 'command'" in caplog.text


# -- kpx snapshot --kubeconfig, and the library only on demand ------------------------------


async def test_snapshot_with_an_exec_plugin_kubeconfig(api: FakeAPIServer, tmp_path: Path) -> None:
    """``kpx snapshot --kubeconfig K -o state.yaml`` as an EKS user runs it: the
    kubeconfig's exec plugin gives the token every list carries, once."""
    api.check_token = lambda token: token == "tok-1"
    path = kubeconfig(tmp_path / "config", {"server": api.url},
                      {"exec": plugin(tmp_path, 3600)})
    out = tmp_path / "state.yaml"
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "proxy", "snapshot", "--kubeconfig", str(path), "-o", str(out),
        cwd=REPO, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    _, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()
    doc = yaml.safe_load(out.read_text())
    assert doc["kind"] == "List"
    assert sorted((o["kind"], o["metadata"]["name"]) for o in doc["items"]) == [
        ("EndpointSlice", "web-abc"), ("Node", NODE), ("Service", "web")]
    assert len(runs(tmp_path)) == 1
    assert api.requests and set(seen_tokens(api)) == {"tok-1"} and api.unauthorized == []


def test_kubernetes_asyncio_is_imported_only_for_the_api_source(tmp_path: Path) -> None:
    """A node fed by a state file (or given --master) never loads the library;
    reading a kubeconfig does."""
    path = kubeconfig(tmp_path / "config", {"server": "https://127.0.0.1:6443"},
                      {"token": "t"})
    script = (
        "import sys\n"
        "import proxy.cli, proxy.commands.node, proxy.commands.snapshot, proxy.commands.check\n"
        "import proxy.sources.kubeapi, proxy.sources.snapshot, proxy.sources.statefile\n"
        "import proxy.proxier\n"
        "from proxy.sources.kubeconfig import KubeConfig\n"
        "KubeConfig.load(None, 'https://127.0.0.1:6443')\n"
        "before = sorted(m for m in sys.modules if m.startswith('kubernetes_asyncio'))\n"
        f"KubeConfig.load({str(path)!r})\n"
        "after = any(m.startswith('kubernetes_asyncio') for m in sys.modules)\n"
        "print(before, after)\n"
    )
    res = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["[]", "True"]
