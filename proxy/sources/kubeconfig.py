"""Reaching the API server: where it is and how kpx proves who it is.

Owns: ``KubeConfig``, resolved the way kube-proxy resolves it: in-cluster
(the pod's service account), a kubeconfig file, or ``--master``, with every
credential a kubeconfig holds: client certificates, tokens and token files,
exec plugins (``ExecPlugin``), ``tls-server-name``, ``proxy-url``,
``insecure-skip-tls-verify``. kubernetes_asyncio reads the file and runs the
plugins; the library is imported only when a kubeconfig is read.

Never: talk to the API server (``proxy.sources.kubeapi`` does). Why a
module of its own: ``kpx node`` checks its credentials before it claims its
network namespace, and a restart's successor must claim it quickly
(``proxy.commands.node``): this module imports no HTTP client.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import logging
import os
import ssl
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

log = logging.getLogger(__name__)

SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
"""Where the kubelet mounts a pod's service-account token and the cluster CA."""

TOKEN_REFRESH_SECONDS = 60.0
"""Bound service-account tokens rotate (about hourly); client-go re-reads the
token file once a minute, so kpx does too."""


class KubeConfigError(Exception):
    """The API server cannot be reached as configured; raised at startup only."""



# -- reaching the API server -------------------------------------------------------------


@dataclass(eq=False)
class KubeConfig:
    """Where the API server is and how kpx proves who it is.

    The secrets (``token``, client key) are left out of ``repr``, so a config
    can be logged. A ``token_file`` is re-read every minute, as client-go
    does, because service-account tokens rotate.
    """

    server: str
    origin: str = ""
    """How the config was found, for logs: ``in-cluster``, ``kubeconfig PATH (context C)``."""
    ca_file: Path | None = None
    ca_data: bytes | None = field(default=None, repr=False)
    client_cert_file: Path | None = None
    client_cert_data: bytes | None = field(default=None, repr=False)
    client_key_file: Path | None = None
    client_key_data: bytes | None = field(default=None, repr=False)
    token: str | None = field(default=None, repr=False)
    token_file: Path | None = None
    insecure_skip_tls_verify: bool = False
    tls_server_name: str | None = None
    proxy_url: str | None = None
    """``proxy-url``: an http(s) proxy every request goes through (CONNECT for https)."""
    exec_plugin: ExecPlugin | None = field(default=None, repr=False)
    """A kubeconfig ``exec`` user's plugin: the source of the token (or certificate)."""
    _file_token: str | None = field(default=None, init=False, repr=False)
    _file_token_read: float | None = field(default=None, init=False, repr=False)

    # -- finding it --------------------------------------------------------------------

    @classmethod
    def load(
        cls,
        kubeconfig: str | Path | None = None,
        master: str | None = None,
        *,
        env: Mapping[str, str] | None = None,
        secret_dir: Path = SERVICE_ACCOUNT_DIR,
    ) -> KubeConfig:
        """kube-proxy's rule: neither flag means in-cluster; else the kubeconfig,
        with ``--master`` overriding its server (or standing alone, unauthenticated)."""
        if kubeconfig:
            return cls.from_kubeconfig(kubeconfig, master=master)
        if master:
            return cls(server=_server_url(master), origin="--master")
        log.info("neither --kubeconfig nor --master given: using the in-cluster config")
        return cls.in_cluster(env=env, secret_dir=secret_dir)

    @classmethod
    def in_cluster(
        cls, env: Mapping[str, str] | None = None, secret_dir: Path = SERVICE_ACCOUNT_DIR
    ) -> KubeConfig:
        """client-go's ``InClusterConfig``: the service env vars and the mounted secret."""
        env = os.environ if env is None else env
        host = env.get("KUBERNETES_SERVICE_HOST", "")
        port = env.get("KUBERNETES_SERVICE_PORT", "")
        if not host or not port:
            raise KubeConfigError(
                "not running in a pod (KUBERNETES_SERVICE_HOST and KUBERNETES_SERVICE_PORT "
                "are not both set); pass --kubeconfig or --master"
            )
        token_file = secret_dir / "token"
        try:
            token = token_file.read_text(encoding="utf-8").strip()
        except OSError as e:
            raise KubeConfigError(f"in-cluster token {token_file}: {e.strerror or e}") from e
        if not token:
            raise KubeConfigError(f"in-cluster token {token_file} is empty")
        ca = secret_dir / "ca.crt"
        ca_file = ca if ca.is_file() else None
        if ca_file is None:
            # client-go logs and carries on with the system roots; so does kpx.
            log.warning("in-cluster CA %s is missing; trusting the system roots", ca)
        host = f"[{host}]" if ":" in host else host
        config = cls(
            server=f"https://{host}:{port}",
            origin=f"in-cluster, token from {token_file}",
            ca_file=ca_file,
            token=token,
            token_file=token_file,
        )
        config._file_token, config._file_token_read = token, time.monotonic()
        return config

    @classmethod
    def prepare(
        cls,
        kubeconfig: str | Path | None = None,
        master: str | None = None,
        *,
        env: Mapping[str, str] | None = None,
        secret_dir: Path = SERVICE_ACCOUNT_DIR,
    ) -> Callable[[], KubeConfig]:
        """``load`` in two steps: what needs no client library now, the rest when called.

        Now: the kubeconfig file read as a YAML mapping (or, without one,
        ``--master`` alone or the in-cluster config, whole). When called: its
        contexts, clusters and users walked (``from_kubeconfig``), which
        imports kubernetes_asyncio, and so its API client: about a second of
        CPU. ``kpx node`` checks its flags with the first step before it
        claims the namespace, and takes the second after: a restart's
        successor must ask for the listeners within ``--handover-wait``.
        """
        if kubeconfig:
            path = Path(kubeconfig)
            doc = read_kubeconfig(path)
            return lambda: cls.from_kubeconfig(path, master=master, doc=doc)
        config = cls.load(None, master, env=env, secret_dir=secret_dir)
        return lambda: config

    @classmethod
    def from_kubeconfig(
        cls, path: str | Path, master: str | None = None, context: str | None = None,
        doc: dict[str, Any] | None = None,
    ) -> KubeConfig:
        """The current context (or ``context``) of a kubeconfig file (``doc``: as
        ``read_kubeconfig`` read it already).

        The file is walked with kubernetes_asyncio's ``ConfigNode`` (contexts,
        clusters and users by name, each error naming the field it is about)
        and an ``exec`` user runs through its ``ExecProvider``; both are
        imported here, so a node fed by a state file never loads them.
        Certificate and key *data* stay in memory (the library's
        ``FileOrData`` would write them to temporary files that outlive a
        crash). Relative file paths count from the kubeconfig's directory, as
        in client-go. ``master`` replaces the cluster's server and, like a
        ``--server`` override in client-go, drops its ``tls-server-name``,
        which named the server being replaced.
        """
        from kubernetes_asyncio.config.config_exception import ConfigException
        from kubernetes_asyncio.config.kube_config import ConfigNode

        path = Path(path)
        where = f"kubeconfig {path}"
        if doc is None:
            doc = read_kubeconfig(path)
        root = ConfigNode("kubeconfig", doc, str(path))
        name = context or doc.get("current-context")
        cluster: Any = ConfigNode("cluster", {})
        user: Any = None
        try:
            if name:
                ctx = root["contexts"].get_with_name(name)["context"]
                cluster = root["clusters"].get_with_name(ctx["cluster"])["cluster"]
                user_name = ctx.safe_get("user")
                if user_name and root.safe_get("users"):
                    found = root["users"].get_with_name(user_name, safe=True)
                    user = found["user"] if found is not None else None
                    if user is not None and type(user.value) is not dict:
                        raise KubeConfigError(f"{where}: {user.name}: not a mapping")
            elif not master:
                raise KubeConfigError(f"{where}: no current-context")
            if type(cluster.value) is not dict:
                raise KubeConfigError(f"{where}: {cluster.name}: not a mapping")
            config = cls._from_nodes(where, path.parent, name, cluster, user, master)
        except ConfigException as e:
            raise KubeConfigError(f"{where}: {_without_prefix(str(e))}") from e
        except (AttributeError, KeyError, TypeError, ValueError) as e:
            # A list where a mapping belongs, and the like: still the file's fault.
            raise KubeConfigError(f"{where}: malformed ({type(e).__name__}: {e})") from e
        return config

    @classmethod
    def _from_nodes(
        cls, where: str, base: Path, name: str | None, cluster: Any, user: Any, master: str | None
    ) -> KubeConfig:
        """One context's cluster and user (``ConfigNode``s) as a ``KubeConfig``."""
        c, u = cluster.value, ({} if user is None else user.value)
        cname = cluster.name
        uname = "" if user is None else user.name
        server = master or c.get("server")
        if not server or type(server) is not str:
            raise KubeConfigError(f"{where}: {cname}: no server")
        proxy_url = c.get("proxy-url") or None
        if proxy_url is not None:
            proxy_url = _proxy_url(proxy_url, f"{where}: {cname}.proxy-url")
        insecure = c.get("insecure-skip-tls-verify", False)
        if type(insecure) is not bool:
            raise KubeConfigError(f"{where}: {cname}.insecure-skip-tls-verify: not a boolean")
        tls_name = c.get("tls-server-name") or None
        if tls_name is not None and type(tls_name) is not str:
            raise KubeConfigError(f"{where}: {cname}.tls-server-name: not a string")
        token = u.get("token") or None
        if token is not None and type(token) is not str:
            raise KubeConfigError(f"{where}: {uname}.token: not a string")
        config = cls(
            server=_server_url(server),
            origin=f"{where} (context {name})" if name else f"{where}, --master",
            ca_file=_path(c, "certificate-authority", base, f"{where}: {cname}"),
            ca_data=_data(c, "certificate-authority-data", f"{where}: {cname}"),
            client_cert_file=_path(u, "client-certificate", base, f"{where}: {uname}"),
            client_cert_data=_data(u, "client-certificate-data", f"{where}: {uname}"),
            client_key_file=_path(u, "client-key", base, f"{where}: {uname}"),
            client_key_data=_data(u, "client-key-data", f"{where}: {uname}"),
            token=token,
            token_file=_path(u, "tokenFile", base, f"{where}: {uname}"),
            insecure_skip_tls_verify=insecure,
            tls_server_name=None if master else tls_name,
            proxy_url=proxy_url,
        )
        if config.insecure_skip_tls_verify and (config.ca_file or config.ca_data):
            # client-go refuses this too: which of the two did the author mean?
            raise KubeConfigError(
                f"{where}: {cname}: certificate-authority and insecure-skip-tls-verify "
                "are exclusive"
            )
        has_cert = (config.client_cert_file or config.client_cert_data) is not None
        has_key = (config.client_key_file or config.client_key_data) is not None
        if has_cert != has_key:
            raise KubeConfigError(
                f"{where}: {uname}: a client certificate and its key come together"
            )
        if "username" in u or "password" in u:
            raise KubeConfigError(
                f"{where}: {uname}: basic auth was removed from Kubernetes in 1.19"
            )
        if "auth-provider" in u and not (token or config.token_file or has_cert):
            raise KubeConfigError(
                f"{where}: {uname}.auth-provider: the in-tree auth providers were removed "
                "from Kubernetes in 1.26; use an exec plugin (e.g. gke-gcloud-auth-plugin, "
                "kubelogin) or a token"
            )
        if "exec" in u:
            if token or config.token_file:
                # client-go sends a token the config already has and skips the plugin.
                log.warning("%s: %s has a token: its exec plugin is not run", where, uname)
            else:
                config.exec_plugin = ExecPlugin.from_node(user["exec"], f"{where}: {uname}.exec")
        return config

    # -- using it ----------------------------------------------------------------------

    def describe(self) -> str:
        return f"{self.server} ({self.origin})" if self.origin else self.server

    def ssl_context(self) -> ssl.SSLContext | None:
        """The TLS settings for an ``https`` server; None for plain ``http``.

        A CA, when given, is the only trust root (as in client-go); without
        one the system roots apply. Client certificate data (the
        kubeconfig's, or an exec plugin's) is written to a private temporary
        directory only for as long as OpenSSL takes to read it:
        ``load_cert_chain`` accepts nothing but file names.
        """
        if not self.server.startswith("https://"):
            return None
        try:
            ctx = ssl.create_default_context(
                cafile=None if self.ca_file is None else str(self.ca_file),
                cadata=None if self.ca_data is None else self.ca_data.decode("ascii", "replace"),
            )
        except (OSError, ssl.SSLError) as e:
            raise KubeConfigError(f"certificate authority ({self.origin}): {e}") from e
        if self.insecure_skip_tls_verify:
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
        cert_file, cert_data = self.client_cert_file, self.client_cert_data
        key_file, key_data = self.client_key_file, self.client_key_data
        exec_cred = self.exec_plugin.credential if self.exec_plugin is not None else None
        if exec_cred is not None and exec_cred.cert is not None:
            cert_file, cert_data, key_file, key_data = None, exec_cred.cert, None, exec_cred.key
        if (cert_file or cert_data) is not None:
            try:
                with tempfile.TemporaryDirectory(prefix="kpx-tls-") as tmp:
                    cert = _materialize(cert_file, cert_data, tmp, "crt")
                    key = _materialize(key_file, key_data, tmp, "key")
                    ctx.load_cert_chain(cert, key)
            except (OSError, ssl.SSLError) as e:
                raise KubeConfigError(f"client certificate ({self.origin}): {e}") from e
        return ctx

    def authorization(self, now: float | None = None) -> str | None:
        """The ``Authorization`` header value, re-reading ``token_file`` when stale.

        The last token read successfully wins over ``token``, as in
        client-go; an unreadable file keeps the token already in hand. An
        exec plugin's token is the one ``refresh`` fetched last.
        """
        token = self.token
        if self.token_file is not None:
            now = time.monotonic() if now is None else now
            read_at = self._file_token_read
            if read_at is None or now - read_at >= TOKEN_REFRESH_SECONDS:
                try:
                    fresh = self.token_file.read_text(encoding="utf-8").strip()
                except OSError as e:
                    log.warning("cannot re-read token file %s: %s", self.token_file, e)
                else:
                    self._file_token = fresh or self._file_token
                self._file_token_read = now
            token = self._file_token or token
        elif self.exec_plugin is not None and self.exec_plugin.credential is not None:
            token = self.exec_plugin.credential.token
        return f"Bearer {token}" if token else None

    async def refresh(self) -> bool:
        """Run the exec plugin if its credential is missing or due; True if it ran.

        Call before each request; ``authorization`` and ``ssl_context`` then
        answer with the fresh credential. Raises ``CredentialError`` when the
        plugin fails (the caller retries with backoff).
        """
        if self.exec_plugin is None:
            return False
        return await self.exec_plugin.refresh()

    def forget_token(self) -> None:
        """After a 401: the token file may hold a rotated token already, and a
        plugin's credential may have been revoked early (client-go re-runs it)."""
        self._file_token_read = None
        if self.exec_plugin is not None:
            self.exec_plugin.invalidate()


class CredentialError(Exception):
    """An exec credential plugin failed or printed something kpx cannot use."""


EXEC_API_VERSIONS = ("client.authentication.k8s.io/v1", "client.authentication.k8s.io/v1beta1")
"""The ExecCredential versions a kubeconfig may ask for (v1alpha1 went in 1.24)."""

EXEC_REFRESH_MARGIN = 300.0
"""A plugin's credential is renewed this long before ``expirationTimestamp`` (the
margin kubernetes_asyncio keeps), or a fifth of its lifetime if that is shorter."""


EXEC_TIMEOUT = 60.0
"""A plugin that has not answered in a minute has failed (a browser login it cannot show)."""

EXEC_CANCEL_WAIT = 5.0
"""How long a stop waits for a plugin already running to finish."""


@dataclass(frozen=True)
class ExecCredential:
    """What one run of a plugin gave: a token, or a client certificate and key."""

    token: str | None = field(repr=False)
    cert: bytes | None = field(repr=False)
    key: bytes | None = field(repr=False)
    expires: float | None
    """``expirationTimestamp`` as a Unix time; None: good until a 401."""
    renew_at: float | None
    """When to run the plugin again, ahead of ``expires``."""


class ExecPlugin:
    """A kubeconfig ``exec`` user: kubernetes_asyncio's ``ExecProvider`` runs the
    command and checks its ExecCredential; this class decides when.

    kubernetes_asyncio re-runs a plugin on every call when the credential has
    no ``expirationTimestamp``, at every call once within 5 minutes of it
    (so a short-lived credential is fetched per request), and only when its
    caller polls. Here, as in client-go, a credential is kept until it is
    due (``EXEC_REFRESH_MARGIN`` ahead of its expiry, so no request ever
    carries an expired one) or until a 401 says it was revoked, and one run
    serves every request waiting on it.
    """

    def __init__(self, provider: Any, where: str, clock: Callable[[], float] = time.time) -> None:
        self.provider = provider
        self.where = where
        self.credential: ExecCredential | None = None
        self._clock = clock
        self._lock = asyncio.Lock()
        self.runs = 0

    @classmethod
    def from_node(cls, node: Any, where: str) -> ExecPlugin:
        from kubernetes_asyncio.config.config_exception import ConfigException
        from kubernetes_asyncio.config.exec_provider import ExecProvider

        if type(node.value) is not dict:
            raise KubeConfigError(f"{where}: not a mapping")
        version = node.value.get("apiVersion")
        if version not in EXEC_API_VERSIONS:
            raise KubeConfigError(
                f"{where}.apiVersion: {version!r} is not one of {', '.join(EXEC_API_VERSIONS)}"
            )
        args = node.value.get("args")
        if args is not None and (type(args) is not list or not all(type(a) is str for a in args)):
            raise KubeConfigError(f"{where}.args: not a list of strings")
        env = node.value.get("env")
        if env is not None and (type(env) is not list or not all(
            type(e) is dict and type(e.get("name")) is str and type(e.get("value")) is str
            for e in env
        )):
            raise KubeConfigError(f"{where}.env: not a list of {{name, value}} strings")
        try:
            provider = ExecProvider(node)
        except ConfigException as e:
            raise KubeConfigError(f"{where}: {_without_prefix(str(e))}") from e
        return cls(provider, where)

    def due(self, now: float | None = None) -> bool:
        cred = self.credential
        if cred is None:
            return True
        now = self._clock() if now is None else now
        return cred.renew_at is not None and now >= cred.renew_at

    def invalidate(self) -> None:
        self.credential = None

    async def refresh(self) -> bool:
        """Run the plugin if the credential is due (once, however many ask); True if it ran."""
        if not self.due():
            return False
        async with self._lock:
            if not self.due():  # another request ran it meanwhile
                return False
            self.credential = await self._run()
            return True

    async def _run(self) -> ExecCredential:
        from kubernetes_asyncio.config.config_exception import ConfigException

        self.runs += 1
        started = self._clock()
        run = asyncio.ensure_future(self.provider.run())
        try:
            async with asyncio.timeout(EXEC_TIMEOUT):
                status = await asyncio.shield(run)
        except (ConfigException, OSError) as e:
            raise CredentialError(f"{self.where}: {_without_prefix(str(e))}") from e
        except TimeoutError:
            raise CredentialError(
                f"{self.where}: the plugin gave no credential within {EXEC_TIMEOUT:.0f}s"
            ) from None
        except asyncio.CancelledError:
            # Stopping: let the plugin's process finish and be reaped (bounded),
            # rather than leave its pipes to a loop that is about to close.
            with contextlib.suppress(Exception, asyncio.CancelledError):
                async with asyncio.timeout(EXEC_CANCEL_WAIT):
                    await run
            raise
        if type(status) is not dict:
            raise CredentialError(f"{self.where}: the plugin's status is not a mapping")
        token = status.get("token") or None
        cert = status.get("clientCertificateData") or None
        key = status.get("clientKeyData") or None
        if token is None and cert is None:
            raise CredentialError(
                f"{self.where}: the plugin's status has neither token nor clientCertificateData"
            )
        if (cert is None) != (key is None):
            raise CredentialError(
                f"{self.where}: the plugin's clientCertificateData and clientKeyData come together"
            )
        expires = renew_at = None
        stamp = status.get("expirationTimestamp")
        if stamp:
            try:
                expires = _rfc3339(str(stamp))
            except ValueError as e:
                raise CredentialError(
                    f"{self.where}: the plugin's status.expirationTimestamp {stamp!r}: {e}"
                ) from e
            margin = min(EXEC_REFRESH_MARGIN, max(0.0, expires - started) / 5)
            renew_at = expires - margin
        log.info(
            "exec plugin %s gave a %s%s",
            self.provider.args[0],
            "token" if token is not None else "client certificate",
            f" valid until {stamp}" if stamp else " without expiry",
        )
        return ExecCredential(
            token=token if type(token) is str else None,
            cert=cert.encode() if type(cert) is str else None,
            key=key.encode() if type(key) is str else None,
            expires=expires,
            renew_at=renew_at,
        )


def read_kubeconfig(path: Path) -> dict[str, Any]:
    """A kubeconfig file as YAML: a mapping, or KubeConfigError naming the file."""
    where = f"kubeconfig {path}"
    try:
        doc = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise KubeConfigError(f"{where}: {e.strerror or e}") from e
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise KubeConfigError(f"{where}: not YAML: {e}") from e
    if type(doc) is not dict:
        raise KubeConfigError(f"{where}: expected a mapping")
    return doc


def _rfc3339(text: str) -> float:
    """An RFC 3339 time (``2024-05-01T10:00:00Z``) as a Unix time."""
    from datetime import datetime

    stamp = datetime.fromisoformat(text.replace("Z", "+00:00").replace("z", "+00:00"))
    if stamp.tzinfo is None:
        raise ValueError("no time zone")
    return stamp.timestamp()


def _without_prefix(message: str) -> str:
    """kubernetes_asyncio's messages say "Invalid kube-config file." first; kpx names the file."""
    return message.removeprefix("Invalid kube-config file. ")


def _proxy_url(value: object, where: str) -> str:
    """A ``proxy-url`` aiohttp can use: http or https (client-go also takes socks5)."""
    if type(value) is not str:
        raise KubeConfigError(f"{where}: not a string")
    scheme = value.partition("://")[0].lower()
    if scheme not in ("http", "https"):
        raise KubeConfigError(
            f"{where}: {value!r}: kpx speaks to http and https proxies only"
            + (" (not socks5)" if scheme.startswith("socks") else "")
        )
    return value


def _server_url(server: str) -> str:
    """``host:port`` as ``--master`` may give it means https, as in client-go."""
    server = server.rstrip("/")
    return server if "://" in server else f"https://{server}"


def _path(section: dict[str, Any], key: str, base: Path, where: str) -> Path | None:
    value = section.get(key)
    if not value:
        return None
    if type(value) is not str:
        raise KubeConfigError(f"{where}.{key}: not a string")
    return base / Path(value).expanduser()


def _data(section: dict[str, Any], key: str, where: str) -> bytes | None:
    value = section.get(key)
    if not value:
        return None
    try:
        return base64.b64decode(str(value), validate=False)
    except (binascii.Error, ValueError) as e:
        raise KubeConfigError(f"{where}.{key}: not base64 ({e})") from e


def _materialize(file: Path | None, data: bytes | None, tmp: str, suffix: str) -> str:
    if data is None:
        assert file is not None
        return str(file)
    target = os.path.join(tmp, f"client.{suffix}")
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    return target


