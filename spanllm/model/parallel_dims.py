"""ParallelDims(tp, pp): the layout of a world of ranks as pipeline stages of tensor-parallel groups.

Ranks are node-major (`spanllm.comm.Topology`), and the layout keeps tensor parallelism inside a node
and the pipeline across nodes: rank = stage * tp + tp_rank, so a TP group is `tp` consecutive ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from spanllm.comm.topology import Topology
from spanllm.model.config import ModelConfig


class ParallelLayoutError(ValueError):
    """A (tp, pp) layout that cannot run this model on this world."""


@dataclass(frozen=True)
class ParallelDims:
    tp: int
    pp: int
    world_size: int

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "world_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ParallelLayoutError(f"{name}={v!r} must be a positive integer")
        if self.tp * self.pp != self.world_size:
            raise ParallelLayoutError(
                f"tp={self.tp} x pp={self.pp} = {self.tp * self.pp} ranks, but the world has {self.world_size}; "
                f"choose factors whose product is {self.world_size} (e.g. tp={self.world_size} pp=1)"
            )

    @classmethod
    def tp_only(cls, world_size: int) -> ParallelDims:
        return cls(tp=world_size, pp=1, world_size=world_size)

    def validate_for(self, cfg: ModelConfig) -> None:
        """Raise if this layout cannot shard `cfg` (head counts, layer count)."""
        check_tp_for_model(self.tp, cfg)
        if self.pp > cfg.num_layers:
            raise ParallelLayoutError(
                f"pp={self.pp} exceeds the {cfg.num_layers} layers of {cfg.label}: every pipeline stage needs at "
                f"least one layer; use pp <= {cfg.num_layers}"
            )

    def validate_for_topology(self, topology: Topology) -> None:
        """TP groups are consecutive ranks: they must tile nodes (tp | ranks_per_node) or whole nodes."""
        rpn = topology.ranks_per_node
        if rpn % self.tp and self.tp % rpn:
            raise ParallelLayoutError(
                f"tp={self.tp} neither divides nor is a multiple of ranks_per_node={rpn}: a TP group would straddle "
                "a node boundary unevenly; pick tp that divides the ranks of a node or spans whole nodes"
            )

    # --- rank arithmetic ---------------------------------------------------------------------------------
    def stage_of(self, rank: int) -> int:
        return rank // self.tp

    def tp_rank_of(self, rank: int) -> int:
        return rank % self.tp

    def rank_of(self, stage: int, tp_rank: int) -> int:
        return stage * self.tp + tp_rank

    def tp_group_ranks(self, stage: int) -> list[int]:
        return [self.rank_of(stage, i) for i in range(self.tp)]

    def tp_topology(self, topology: Topology) -> Topology:
        """The topology of one TP group: its ranks per node inside the world's node layout."""
        self.validate_for_topology(topology)
        return Topology(self.tp, min(self.tp, topology.ranks_per_node))

    def __str__(self) -> str:
        return f"TP={self.tp} x PP={self.pp}"


def tp_degrees_for(cfg: ModelConfig) -> list[int]:
    """Every TP degree that can shard `cfg` (check_tp_for_model's rule), up to the query heads."""
    return cfg.tp_degrees()


def check_tp_for_model(tp: int, cfg: ModelConfig) -> None:
    """The standard rule: tp divides the query heads; KV heads are split (tp | kv) or replicated (kv | tp)."""
    works = f"TP degrees that work for {cfg.label}: {', '.join(map(str, tp_degrees_for(cfg)))}"
    if cfg.num_heads % tp:
        raise ParallelLayoutError(
            f"tp={tp} does not divide num_heads={cfg.num_heads} of {cfg.label} (each rank owns whole query "
            f"heads); {works}"
        )
    kv = cfg.num_kv_heads
    if kv % tp and tp % kv:
        raise ParallelLayoutError(
            f"tp={tp} and num_kv_heads={kv} of {cfg.label}: tp must divide the KV heads (each rank owns some) or "
            f"be a multiple of them (each KV head replicated on tp/kv ranks); {works}"
        )
    if cfg.intermediate_size % tp:
        raise ParallelLayoutError(
            f"tp={tp} does not divide intermediate_size={cfg.intermediate_size} of {cfg.label}; {works}"
        )


def stage_layers(num_layers: int, pp: int, stage: int) -> range:
    """Balanced contiguous split: the first `num_layers % pp` stages hold one extra layer (the last stage
    also runs the LM head, so it is the one that should be lighter)."""
    base, extra = divmod(num_layers, pp)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (1 if stage < extra else 0))


@dataclass
class ParallelGroups:
    """The process groups of one rank. Built collectively: every rank creates every group in the same order."""

    dims: ParallelDims
    rank: int
    tp_group: dist.ProcessGroup | None

    @property
    def stage(self) -> int:
        return self.dims.stage_of(self.rank)

    @property
    def tp_rank(self) -> int:
        return self.dims.tp_rank_of(self.rank)

    @property
    def is_first_stage(self) -> bool:
        return self.stage == 0

    @property
    def is_last_stage(self) -> bool:
        return self.stage == self.dims.pp - 1

    @property
    def prev_rank(self) -> int | None:
        return None if self.is_first_stage else self.dims.rank_of(self.stage - 1, self.tp_rank)

    @property
    def next_rank(self) -> int | None:
        return None if self.is_last_stage else self.dims.rank_of(self.stage + 1, self.tp_rank)

    @property
    def first_stage_peer(self) -> int:
        return self.dims.rank_of(0, self.tp_rank)

    @property
    def last_stage_peer(self) -> int:
        return self.dims.rank_of(self.dims.pp - 1, self.tp_rank)


def build_groups(dims: ParallelDims, rank: int) -> ParallelGroups:
    """Create the TP groups (collective over the world). With pp=1 the TP group is the world group."""
    if dims.world_size != dist.get_world_size():
        raise ParallelLayoutError(f"{dims} describes {dims.world_size} ranks but the job has {dist.get_world_size()}")
    if dims.pp == 1:
        return ParallelGroups(dims, rank, dist.group.WORLD)
    mine = None
    for stage in range(dims.pp):
        g = dist.new_group(dims.tp_group_ranks(stage))
        if stage == dims.stage_of(rank):
            mine = g
    return ParallelGroups(dims, rank, mine)
