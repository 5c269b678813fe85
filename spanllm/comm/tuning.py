"""The tuning table: measured best algorithm (and nvrar launch parameters) per topology, dtype and size.

Written by `spanllm tune`, read by `auto` and `nvrar`. Lookup takes the smallest measured size that is
>= the message (a message is treated like the next measured size up), else the largest measured one.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

import torch

from spanllm.comm.topology import Topology
from spanllm.dtypes import DTYPE_NAMES
from spanllm.output_files import write_json


@dataclass(frozen=True)
class TuningEntry:
    topology: str  # "NODESxRANKS_PER_NODE"
    dtype: str  # nccl-tests dtype name
    size: int  # bytes
    best: str  # registered algorithm name
    nvrar_launch: dict | None = None  # best nvrar LaunchParams at this size, as a dict
    times_us: dict[str, float] = field(default_factory=dict)  # every candidate measured


@dataclass
class TuningTable:
    entries: list[TuningEntry]
    meta: dict = field(default_factory=dict)

    def lookup(self, nbytes: int, dtype: torch.dtype, topology: Topology) -> TuningEntry | None:
        mine = sorted(
            (e for e in self.entries if e.topology == str(topology) and e.dtype == DTYPE_NAMES.get(dtype)),
            key=lambda e: e.size,
        )
        if not mine:
            return None
        for e in mine:
            if e.size >= nbytes:
                return e
        return mine[-1]

    def nvrar_launch(self, nbytes: int, dtype: torch.dtype, topology: Topology):
        e = self.lookup(nbytes, dtype, topology)
        if e is None or e.nvrar_launch is None:
            return None
        from spanllm.comm.nvrar.allreduce import LaunchParams

        return LaunchParams(**e.nvrar_launch)

    def save(self, path: str, flag: str = "--out") -> None:
        doc = {"kind": "tuning", **self.meta, "entries": [asdict(e) for e in self.entries]}
        write_json(flag, path, doc, indent=1)

    @classmethod
    def load(cls, path: str) -> TuningTable:
        """One table, or several comma-separated ones (e.g. one per topology) merged."""
        if "," in path:
            tables = [cls.load(p) for p in path.split(",") if p]
            return cls([e for t in tables for e in t.entries], tables[0].meta)
        try:
            with open(path) as f:
                doc = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(
                f"cannot read tuning table {path!r}: {e}; write one with `spanllm tune --out {path}`"
            ) from e
        if not isinstance(doc, dict) or doc.get("kind") != "tuning" or "entries" not in doc:
            kind = doc.get("kind") if isinstance(doc, dict) else type(doc).__name__
            raise ValueError(f"{path!r} is not a tuning table (kind={kind!r}); write one with `spanllm tune`")
        meta = {k: v for k, v in doc.items() if k not in ("kind", "entries")}
        entries = []
        for i, e in enumerate(doc["entries"]):
            try:
                entries.append(TuningEntry(**e))
            except TypeError as err:
                raise ValueError(
                    f"{path!r}: entry {i} ({e!r}) is not a tuning entry ({err}); "
                    "regenerate the table with `spanllm tune`"
                ) from None
        return cls(entries, meta)
