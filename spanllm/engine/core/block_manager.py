"""BlockManager: the KV cache as a pool of fixed-size blocks, handed to sequences as they grow.

Block ids index the PagedKVCache tensors. Block 0 is reserved (padded rows of a captured decode graph
write there), so sequences get ids 1 .. num_blocks - 1. A sequence's `block_table` lists its blocks
in position order; position p lives in block_table[p // block_size].

Invariant (checked by `check`, and by the tests after every request has finished or been aborted):
every block is either on the free list with reference count 0, or referenced by exactly as many
sequences as its count says. Counts exist for sharing (a prefix cache would raise them); without one
every used block has count 1.
"""

from __future__ import annotations

from collections import deque

from spanllm.engine.core.sequence import Sequence

RESERVED_BLOCKS = 1  # block 0


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks <= RESERVED_BLOCKS:
            raise ValueError(
                f"num_blocks={num_blocks}: the pool needs more than {RESERVED_BLOCKS} block(s) "
                "(block 0 is reserved); give the KV cache more memory"
            )
        if block_size < 1:
            raise ValueError(f"block_size={block_size} must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_counts = [0] * num_blocks
        self.free_ids: deque[int] = deque(range(RESERVED_BLOCKS, num_blocks))

    @property
    def num_usable(self) -> int:
        return self.num_blocks - RESERVED_BLOCKS

    @property
    def num_free(self) -> int:
        return len(self.free_ids)

    @property
    def usage(self) -> float:
        """Fraction of usable blocks in use (vLLM's kv_cache_usage_perc)."""
        return 1.0 - self.num_free / self.num_usable

    @property
    def capacity_tokens(self) -> int:
        return self.num_usable * self.block_size

    def blocks_for(self, num_positions: int) -> int:
        return -(-num_positions // self.block_size)

    def blocks_to_grow(self, seq: Sequence, num_positions: int) -> int:
        """Blocks seq still needs so that positions [0, num_positions) have a slot."""
        return max(0, self.blocks_for(num_positions) - len(seq.block_table))

    def can_grow(self, seq: Sequence, num_positions: int) -> bool:
        return self.blocks_to_grow(seq, num_positions) <= self.num_free

    def grow(self, seq: Sequence, num_positions: int) -> None:
        """Append blocks to seq's table until positions [0, num_positions) fit (callers check can_grow)."""
        need = self.blocks_to_grow(seq, num_positions)
        if need > self.num_free:
            raise RuntimeError(
                f"{seq.request_id}: needs {need} blocks, {self.num_free} free (scheduler bug: "
                "it must check can_grow first)"
            )
        for _ in range(need):
            b = self.free_ids.popleft()
            self.ref_counts[b] = 1
            seq.block_table.append(b)

    def free(self, seq: Sequence) -> None:
        """Drop seq's references; blocks nobody references go back to the free list."""
        for b in seq.block_table:
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                self.free_ids.append(b)
        seq.block_table = []

    def check(self, live: list[Sequence] = ()) -> None:
        """Raise if the accounting is off: counts must equal the references held by `live` sequences."""
        refs = [0] * self.num_blocks
        for s in live:
            for b in s.block_table:
                refs[b] += 1
        if refs != self.ref_counts:
            bad = [b for b in range(self.num_blocks) if refs[b] != self.ref_counts[b]][:5]
            raise AssertionError(f"block reference counts disagree with the live sequences at blocks {bad}")
        free = set(self.free_ids)
        if len(free) != len(self.free_ids) or any(self.ref_counts[b] for b in free):
            raise AssertionError("free list holds a duplicate or a referenced block")
        if len(free) + sum(1 for c in self.ref_counts[RESERVED_BLOCKS:] if c) != self.num_usable:
            raise AssertionError("a block is neither free nor referenced (leaked)")
