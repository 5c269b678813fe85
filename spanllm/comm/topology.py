"""Topology: how the ranks of one process group map onto nodes.

Ranks are numbered node-major: rank r lives on node r // ranks_per_node with local rank
r % ranks_per_node. `ranks_per_node` normally comes from the launcher (LOCAL_WORLD_SIZE), but it
can be set smaller to form *virtual nodes* on one host: 2 GPUs as 2 nodes of 1 GPU runs the
inter-node code path of the hierarchical all-reduce on a single machine.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


class TopologyError(ValueError):
    """A world size / ranks-per-node combination that cannot be built."""


@dataclass(frozen=True)
class Topology:
    world_size: int
    ranks_per_node: int

    def __post_init__(self) -> None:
        if not isinstance(self.world_size, int) or self.world_size < 1:
            raise TopologyError(f"world_size={self.world_size!r} must be a positive integer")
        if not isinstance(self.ranks_per_node, int) or self.ranks_per_node < 1:
            raise TopologyError(
                f"ranks_per_node={self.ranks_per_node!r} must be a positive integer "
                f"(1 <= ranks_per_node <= world_size={self.world_size})"
            )
        if self.world_size % self.ranks_per_node:
            raise TopologyError(
                f"world_size={self.world_size} is not divisible by ranks_per_node={self.ranks_per_node}: "
                "every node must hold the same number of ranks; pick a ranks_per_node that divides "
                f"the world size (divisors: {_divisors(self.world_size)})"
            )

    @classmethod
    def from_env(cls, world_size: int, ranks_per_node: int | None = None) -> Topology:
        """Topology of a launched job: ranks_per_node from the argument, else LOCAL_WORLD_SIZE, else world_size."""
        if ranks_per_node is None:
            env = os.environ.get("LOCAL_WORLD_SIZE")
            try:
                ranks_per_node = int(env) if env else world_size
            except ValueError:
                raise TopologyError(
                    f"LOCAL_WORLD_SIZE={env!r} is not an integer; set it to the ranks per node "
                    "(the launcher does) or pass ranks_per_node explicitly"
                ) from None
            ranks_per_node = min(ranks_per_node, world_size)
        return cls(world_size, ranks_per_node)

    @property
    def num_nodes(self) -> int:
        return self.world_size // self.ranks_per_node

    def node_of(self, rank: int) -> int:
        self._check_rank(rank)
        return rank // self.ranks_per_node

    def local_rank(self, rank: int) -> int:
        self._check_rank(rank)
        return rank % self.ranks_per_node

    def rank_of(self, node: int, local_rank: int) -> int:
        if not (0 <= node < self.num_nodes and 0 <= local_rank < self.ranks_per_node):
            raise TopologyError(
                f"(node={node}, local_rank={local_rank}) is outside {self.num_nodes} nodes x "
                f"{self.ranks_per_node} ranks per node"
            )
        return node * self.ranks_per_node + local_rank

    def node_ranks(self, node: int) -> list[int]:
        """The ranks of one node, in local-rank order."""
        return [self.rank_of(node, i) for i in range(self.ranks_per_node)]

    def rail_ranks(self, local_rank: int) -> list[int]:
        """The ranks with this local rank on every node, in node order (the inter-node partners)."""
        return [self.rank_of(n, local_rank) for n in range(self.num_nodes)]

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise TopologyError(f"rank={rank} is outside the world of {self.world_size} ranks")

    def __str__(self) -> str:
        return f"{self.num_nodes}x{self.ranks_per_node}"


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
