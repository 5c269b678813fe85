"""The tuning table: measured best algorithm (and nvrar launch parameters) per topology, dtype and size.

Written by `spanllm tune`, read by `auto` and `nvrar`. Lookup takes the smallest measured size that is
>= the message (a message is treated like the next measured size up), else the largest measured one.
"""

from __future__ import annotations

import json
import re
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
            if not tables:
                raise ValueError(f"tuning table list {path!r} names no file; pass PATH or PATH1,PATH2")
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
        if not isinstance(doc["entries"], list):
            raise ValueError(
                f"{path!r}: 'entries' is a {type(doc['entries']).__name__}, not a list of tuning entries; "
                "regenerate the table with `spanllm tune`"
            )
        entries = []
        for i, e in enumerate(doc["entries"]):
            try:
                entry = TuningEntry(**e)
            except TypeError as err:
                raise ValueError(
                    f"{path!r}: entry {i} ({e!r}) is not a tuning entry ({err}); "
                    "regenerate the table with `spanllm tune`"
                ) from None
            problem = _entry_problem(entry)
            if problem is not None:
                raise ValueError(
                    f"{path!r}: entry {i}: {problem}; fix that entry or regenerate the table with `spanllm tune`"
                )
            entries.append(entry)
        return cls(entries, meta)


_TOPOLOGY_RE = re.compile(r"[1-9][0-9]*x[1-9][0-9]*")


def _entry_problem(e: TuningEntry) -> str | None:
    """Why a loaded entry could never be used (a value no lookup or backend accepts), else None. A table
    entry that is silently never matched, or names a backend that does not exist, would hide that the
    table is not being used."""
    from spanllm.comm.registry import ALGORITHMS  # registry imports the backends; keep this module light

    if not isinstance(e.topology, str) or not _TOPOLOGY_RE.fullmatch(e.topology):
        return f"topology={e.topology!r} is not NODESxRANKS_PER_NODE (e.g. '1x8', '2x4')"
    if e.dtype not in DTYPE_NAMES.values():
        return f"dtype={e.dtype!r} is not one of {sorted(DTYPE_NAMES.values())}"
    if not isinstance(e.size, int) or isinstance(e.size, bool) or e.size < 0:
        return f"size={e.size!r} must be a byte count (an integer >= 0)"
    if not isinstance(e.best, str) or e.best not in ALGORITHMS or e.best == "auto":
        known = ", ".join(n for n in ALGORITHMS if n != "auto")
        return f"best={e.best!r} is not a registered algorithm (one of {known})"
    if e.nvrar_launch is not None:
        from spanllm.comm.nvrar.allreduce import LaunchParams

        try:
            LaunchParams(**e.nvrar_launch)
        except (TypeError, ValueError) as err:
            return f"nvrar_launch={e.nvrar_launch!r} is not valid nvrar launch parameters ({err})"
    if not isinstance(e.times_us, dict):
        return f"times_us={e.times_us!r} must be a mapping algorithm -> microseconds"
    return None
