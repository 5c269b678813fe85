"""PrefillConfig: the tiling of the paged prefill attention kernel (spanllm.kernels.paged_attention.prefill),
and its default as a pure function of the GQA group and the dtype. No Triton import: EngineConfig carries one.

A program owns block_q consecutive queries of one chunk times the `group` query heads that share one KV head:
rows = block_q * group rows of the score tile (e.g. 32 queries x 4 heads = 128), against block_n keys per
iteration of its key loop. The host's tile list (prefill_tiles) and the kernel must use the same block_q.
"""

from __future__ import annotations

import json
from dataclasses import MISSING, asdict, dataclass, fields

import torch

DEFAULT_ROWS = 128  # (query, head) rows per program: one warpgroup-sized MMA tile on Hopper
MIN_ROWS = 16  # tl.dot needs at least 16 rows
NUM_WARPS = (1, 2, 4, 8, 16)


def _power_of_two(x: int) -> bool:
    return isinstance(x, int) and x >= 1 and x & (x - 1) == 0


@dataclass(frozen=True)
class PrefillConfig:
    block_q: int  # queries per program (times the group: its rows)
    block_n: int  # keys per iteration of the key loops
    num_warps: int
    num_stages: int  # Triton's software pipelining depth of the key loops
    # Skip the running sums' rescale while no row's maximum grew by more than RESCALE_THRESHOLD (log2 units);
    # exact: see the kernel.
    lazy_rescale: bool = False

    def __post_init__(self) -> None:
        for name in ("block_q", "block_n"):
            if not _power_of_two(getattr(self, name)):
                raise ValueError(f"PrefillConfig.{name}={getattr(self, name)!r} must be a power of two")
        if self.block_n < 16:
            raise ValueError(f"PrefillConfig.block_n={self.block_n} must be >= 16 (tl.dot's smallest tile)")
        if self.num_warps not in NUM_WARPS:
            raise ValueError(f"PrefillConfig.num_warps={self.num_warps!r} must be one of {NUM_WARPS}")
        if not isinstance(self.num_stages, int) or not 1 <= self.num_stages <= 8:
            raise ValueError(f"PrefillConfig.num_stages={self.num_stages!r} must be an integer in [1, 8]")
        if not isinstance(self.lazy_rescale, bool):
            raise ValueError(f"PrefillConfig.lazy_rescale={self.lazy_rescale!r} must be a bool")

    def rows(self, group: int) -> int:
        return self.block_q * group

    def check_group(self, group: int) -> None:
        """The kernel's tile is rows(group) x head_dim: a power of two of at least MIN_ROWS rows."""
        rows = self.rows(group)
        if not _power_of_two(rows) or rows < MIN_ROWS:
            raise ValueError(
                f"prefill tiles of {rows} rows (block_q {self.block_q} x {group} query heads per KV head) must be "
                f"a power of two >= {MIN_ROWS}; the Triton prefill kernel needs query heads per KV head in 1, 2, 4, "
                f"8, 16, ... and block_q >= {MIN_ROWS} / group"
            )

    def label(self) -> str:
        lazy = " lazy" if self.lazy_rescale else ""
        return f"q{self.block_q}xn{self.block_n} w{self.num_warps} s{self.num_stages}{lazy}"

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> PrefillConfig:
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"unknown PrefillConfig fields {unknown}; known: {sorted(names)}")
        missing = sorted(f.name for f in fields(cls) if f.default is MISSING and f.name not in d)
        if missing:
            raise ValueError(f"PrefillConfig fields {missing} are missing; known: {sorted(names)}")
        return cls(**d)


def prefill_block_q(group: int) -> int:
    """Queries per tile: DEFAULT_ROWS rows of (query, head), at least one query (the same for every dtype, so a
    mixed-step graph's tile buffer does not depend on it)."""
    return max(1, DEFAULT_ROWS // group)


def prefill_config(group: int, dtype: torch.dtype) -> PrefillConfig:
    """The default tiling: 128 rows; 16-bit K/V tiles of 64 keys, three stages deep; float32 (tests, not a
    serving dtype) half the keys and two stages, so its tiles fit in shared memory."""
    if dtype == torch.float32:
        return PrefillConfig(block_q=prefill_block_q(group), block_n=32, num_warps=8, num_stages=2)
    return PrefillConfig(block_q=prefill_block_q(group), block_n=64, num_warps=8, num_stages=3)


def load_prefill_config(path: str) -> PrefillConfig:
    """A PrefillConfig from a JSON file: its fields at the top level, or under "config" (the file
    scripts/gpu_prefill_attention.py writes as best_prefill_config.json)."""
    try:
        with open(path) as f:
            d = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: {e}") from None
    if not isinstance(d, dict):
        raise ValueError(f"{path}: expected a JSON object with PrefillConfig fields, got {type(d).__name__}")
    return PrefillConfig.from_dict(d.get("config", d))
