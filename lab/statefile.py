"""Writing the shared state file every lab ``kpx node`` reads.

Owns: rendering state documents as multi-document YAML and replacing the
file atomically.

Never: write the file in place. A proxy polling the path must only ever see
the old complete file or the new complete file; a half-written one would be
refused (kpx keeps the last good state), but it would also log errors and
delay convergence. So: write a sibling temp file, fsync, ``os.replace``.
This is also what kubelet and editors do, and what issue 2 requires kpx to
pick up (it watches the path, not the inode).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml


def render(documents: Sequence[Mapping[str, Any]]) -> str:
    return yaml.safe_dump_all([dict(d) for d in documents], sort_keys=False,
                              default_flow_style=False, explicit_start=True)


def write_atomic(path: str | os.PathLike[str], text: str) -> None:
    """Replace *path* with *text* so readers never see a partial file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def write_state(path: str | os.PathLike[str], documents: Sequence[Mapping[str, Any]]) -> None:
    write_atomic(path, render(documents))
