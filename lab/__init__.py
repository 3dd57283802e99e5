"""kpx's multi-node lab: network namespaces, echo pods, an endpoints controller.

``from lab import Lab, LabSpec`` is the API tests and demos use. The names
are resolved lazily so that ``python -m lab.echo`` (started once per pod)
never pays for pyroute2 and YAML.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lab.cluster import Lab, LabError, NoReply, wait_until
    from lab.spec import LabSpec, LabSpecError, PodSpec

__all__ = ["Lab", "LabError", "LabSpec", "LabSpecError", "NoReply", "PodSpec", "wait_until"]

_HOMES = {
    "Lab": "lab.cluster", "LabError": "lab.cluster", "NoReply": "lab.cluster",
    "wait_until": "lab.cluster", "LabSpec": "lab.spec", "LabSpecError": "lab.spec",
    "PodSpec": "lab.spec",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'lab' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(home), name)
