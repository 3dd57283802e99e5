"""kpx's multi-node lab: network namespaces, echo pods, an endpoints controller.

Owns: the package's short names, ``from lab import Lab, LabSpec``, the API
tests and demos use (``Lab``, ``LabError``, ``NoReply``, ``wait_until`` from
``lab.cluster``; ``LabSpec``, ``LabSpecError``, ``PodSpec`` from ``lab.spec``).

Never: import anything when the package itself is imported.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lab.cluster import Lab, LabError, NoReply, wait_until
    from lab.spec import LabSpec, LabSpecError, PodSpec

__all__ = ["Lab", "LabError", "LabSpec", "LabSpecError", "NoReply", "PodSpec", "wait_until"]


# Lazy on purpose: every process the lab starts imports this package first
# (``python -m lab.echo`` once per pod, ``python -m lab.loadbalancer``), and
# ``lab.cluster`` would double each one's start-up with YAML and every lab module.
def __getattr__(name: str) -> Any:
    if name in ("LabSpec", "LabSpecError", "PodSpec"):
        from lab import spec

        return getattr(spec, name)
    if name in ("Lab", "LabError", "NoReply", "wait_until"):
        from lab import cluster

        return getattr(cluster, name)
    raise AttributeError(f"module 'lab' has no attribute {name!r}")
