"""Which algorithm runs a call: a pure function over plain values, testable anywhere.

`select(nbytes, dtype, topology, device_type, candidates, table)` returns a `Choice`: the tuning
table's measured best where it has one and that backend can run the call; otherwise the default rule:
nvrar on GPUs while the message fits its buffer, NCCL above it (and for anything nvrar cannot run);
gloo on CPUs. The reason for the choice travels with it, so fallbacks are never silent.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from spanllm.comm.base import Capability
from spanllm.comm.topology import Topology
from spanllm.comm.torch_dist import default_backend
from spanllm.comm.tuning import TuningTable


@dataclass(frozen=True)
class Candidate:
    name: str
    capability: Capability
    max_bytes: int | None = None

    def reason_against(self, nbytes: int, dtype: torch.dtype, topology: Topology, device_type: str) -> str | None:
        return self.capability.unsupported_reason(
            nbytes=nbytes, dtype=dtype, topology=topology, device_type=device_type, max_bytes=self.max_bytes
        )


@dataclass(frozen=True)
class Choice:
    algorithm: str
    reason: str


# nvrar while the message fits its buffer, else the group's own collective (spanllm.comm.torch_dist).
DEFAULT_ORDER = {"cuda": ("nvrar", default_backend("cuda")), "cpu": (default_backend("cpu"), "ref_hier")}


def select(
    nbytes: int,
    dtype: torch.dtype,
    topology: Topology,
    device_type: str,
    candidates: list[Candidate],
    table: TuningTable | None = None,
) -> Choice:
    by_name = {c.name: c for c in candidates}
    notes = []
    if table is not None:
        entry = table.lookup(nbytes, dtype, topology)
        if entry is not None:
            c = by_name.get(entry.best)
            why = (
                "not available in this communicator"
                if c is None
                else c.reason_against(nbytes, dtype, topology, device_type)
            )
            if why is None:
                return Choice(entry.best, f"tuning table: best at {entry.size} bytes")
            notes.append(f"table's {entry.best} unusable ({why})")
        else:
            notes.append(f"no table entry for {topology}/{dtype}")
    for name in DEFAULT_ORDER.get(device_type, ()):
        c = by_name.get(name)
        if c is None:
            continue
        why = c.reason_against(nbytes, dtype, topology, device_type)
        if why is None:
            return Choice(name, "; ".join(notes + [f"default rule: {name}"]))
        notes.append(f"{name}: {why}")
    for c in candidates:
        if c.reason_against(nbytes, dtype, topology, device_type) is None:
            return Choice(c.name, "; ".join(notes + [f"first candidate that runs: {c.name}"]))
    raise ValueError(
        f"no all-reduce candidate can run {nbytes} bytes of {dtype} on {topology} ({device_type}): " + "; ".join(notes)
    )
