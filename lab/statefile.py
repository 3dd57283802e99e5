"""Writing the shared state file every lab ``kpx node`` reads.

Owns: rendering state documents as multi-document YAML, replacing the file
atomically (with ``lab.common.write_atomic``, re-exported here), and
``StatePublisher``: one lab's state file together with what each new
version must remember of the last (every slice's fingerprint and trigger
time, as the EndpointSlice controller keeps them).

Never: write the file in place: a proxy polling the path must only ever see
the old complete file or the new complete one (``lab.common`` explains why
that means a sibling temp file, fsync and ``os.replace``).
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

import yaml

from lab.common import write_atomic
from lab.controller import (
    NodeInfo,
    PodState,
    endpoint_slices,
    slice_fingerprints,
    stamp_trigger_times,
    state_documents,
)

__all__ = ["StatePublisher", "render", "write_atomic", "write_state"]


def render(documents: Sequence[Mapping[str, Any]]) -> str:
    return yaml.safe_dump_all([dict(d) for d in documents], sort_keys=False,
                              default_flow_style=False, explicit_start=True)


def write_state(path: str | os.PathLike[str], documents: Sequence[Mapping[str, Any]]) -> None:
    write_atomic(path, render(documents))


class StatePublisher:
    """One lab's state file, written from its nodes, services and pods.

    ``fingerprints`` and ``triggers`` (per service: a digest of its slices,
    the time they last changed) carry across writes, and through ``lab.json``
    across processes, so a service whose slices did not change keeps its
    ``last-change-trigger-time`` annotation.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = path
        self.triggers: dict[str, str] = {}
        self.fingerprints: dict[str, str] = {}

    def publish(self, nodes: Sequence[NodeInfo], services: Sequence[Mapping[str, Any]],
                pods: Sequence[PodState]) -> None:
        fps = slice_fingerprints(endpoint_slices(services, pods))
        self.triggers = stamp_trigger_times(self.fingerprints, self.triggers, fps, time.time())
        self.fingerprints = fps
        slices = endpoint_slices(services, pods, self.triggers)
        write_state(self.path, state_documents(nodes, services, slices))
