"""A throwaway certificate authority for TLS tests, made with the ``openssl`` command.

Owns: one CA and three certificates it signs, in a directory: ``server``
(for 127.0.0.1), ``named`` (for the DNS name ``NAMED_HOST`` only, so a client
must be told that name: ``tls-server-name``) and ``client`` (client auth).
Elliptic-curve keys, valid for a day: nothing here outlives the test run.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

NAMED_HOST = "apiserver.kpx.test"


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


def make_pki(d: Path) -> Path:
    """Write ``ca``, ``server``, ``named`` and ``client`` (``.crt`` and ``.key``) into ``d``."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is needed to make test certificates")
    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-days", "1")
    _openssl("req", "-x509", *ec, "-subj", "/CN=kpx-test-ca",
             "-keyout", str(d / "ca.key"), "-out", str(d / "ca.crt"))  # fmt: skip
    for name, ext in (
        ("server", "subjectAltName=IP:127.0.0.1"),
        ("named", f"subjectAltName=DNS:{NAMED_HOST}"),
        ("client", "extendedKeyUsage=clientAuth"),
    ):
        _openssl("req", "-x509", *ec, "-subj", f"/CN=kpx-{name}",
                 "-CA", str(d / "ca.crt"), "-CAkey", str(d / "ca.key"),
                 "-addext", "basicConstraints=critical,CA:FALSE", "-addext", ext,
                 "-keyout", str(d / f"{name}.key"), "-out", str(d / f"{name}.crt"))  # fmt: skip
    return d
