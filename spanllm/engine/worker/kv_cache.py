"""PagedKVCache: per-layer K/V block tensors of one rank, and how many blocks fit in memory.

Each layer holds k, v [num_blocks, block_size, kv_heads_local, head_dim] in the model dtype, or in float8_e4m3fn
(EngineConfig.kv_cache_dtype="fp8": half the bytes per block). The pool
is sized the way vLLM sizes it: the engine may use `gpu_memory_utilization` of the GPU's memory in
all; what is left of that after the weights and a reserve for a step's activations (the largest step:
`max_num_batched_tokens` tokens, `max_num_seqs` rows of logits, and the logits every captured CUDA graph
keeps) becomes KV blocks. On CPU the pool gets
`cpu_kv_cache_bytes`. `num_kv_blocks` overrides both (tests use it to force preemption).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from spanllm.engine.core.block_manager import RESERVED_BLOCKS
from spanllm.errors import UsageError
from spanllm.kernels.shared_prefix_layout import MAX_PREFIX_SPLITS

GIB = 1 << 30


@dataclass(frozen=True)
class CacheSizing:
    num_blocks: int
    block_size: int
    bytes_per_block: int
    how: str  # what the size came from, printed at start

    @property
    def capacity_tokens(self) -> int:
        return (self.num_blocks - RESERVED_BLOCKS) * self.block_size

    dtype: torch.dtype | None = None  # the cache's element type, when known (named in describe)

    def describe(self) -> str:
        kind = f"{self.dtype}, " if self.dtype is not None else ""
        return (
            f"KV cache: {self.num_blocks - RESERVED_BLOCKS} blocks x {self.block_size} tokens = {self.capacity_tokens} tokens "  # noqa: E501
            f"({kind}{(self.num_blocks * self.bytes_per_block) / GIB:.2f} GiB; {self.how})"
        )


def bytes_per_block(num_layers: int, block_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    return 2 * num_layers * block_size * kv_heads * head_dim * dtype.itemsize


def activation_reserve_bytes(
    tokens: int, rows: int, hidden: int, qkv_local: int, ffn_local: int, vocab: int, dtype: torch.dtype
) -> int:
    """A step's transient memory, generously: per token the hidden state, residual, norm output, attention
    output, the qkv and the gate/up activations (twice, for SiLU's temporaries); logits in float32 for
    `rows` rows, three times (logits, probabilities, the sampling race); the shared-prefix decode attention's
    float32 partials (per row MAX_PREFIX_SPLITS x the query heads x (head_dim + 2), bounded by qkv_local); plus
    1 GiB for graphs and the allocator's slack."""
    per_token = (4 * hidden + 2 * qkv_local + 4 * ffn_local) * dtype.itemsize
    partials = rows * MAX_PREFIX_SPLITS * (qkv_local + 64) * 4
    return tokens * per_token + 3 * rows * vocab * 4 + partials + GIB


def size_pool(
    *,
    device: torch.device,
    per_block: int,
    block_size: int,
    gpu_memory_utilization: float,
    cpu_kv_cache_bytes: int,
    reserve_bytes: int,
    num_kv_blocks: int | None,
) -> CacheSizing:
    if num_kv_blocks is not None:
        # a pool that cannot fit this device at all (GPU: what is free now; CPU: its physical memory) is refused
        # here, with its size, rather than by the allocator
        if device.type == "cuda":
            room, where = torch.cuda.mem_get_info(device)[0], "free on this GPU"
        else:
            room, where = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "of memory on this machine"
        if num_kv_blocks * per_block > room:
            raise UsageError(
                f"num_kv_blocks={num_kv_blocks}: {num_kv_blocks * per_block / GIB:.1f} GiB of KV cache "
                f"({per_block / 2**20:.3g} MiB a block), more than the {room / GIB:.1f} GiB {where}; give at most "
                f"{room // per_block} blocks"
            )
        return CacheSizing(num_kv_blocks, block_size, per_block, "num_kv_blocks set")
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        used_by_us = torch.cuda.memory_allocated(device)
        budget = int(total * gpu_memory_utilization) - used_by_us - reserve_bytes
        budget = min(budget, free - reserve_bytes)  # never more than is free now (other processes)
        how = (
            f"gpu_memory_utilization {gpu_memory_utilization:.2f} of {total / GIB:.1f} GiB, weights and buffers "
            f"{used_by_us / GIB:.1f} GiB, activation reserve {reserve_bytes / GIB:.1f} GiB"
        )
    else:
        budget = cpu_kv_cache_bytes
        how = f"cpu_kv_cache_bytes {cpu_kv_cache_bytes / GIB:.2f} GiB"
    n = budget // per_block
    if n < 2:
        raise ValueError(
            f"no room for a KV cache: {budget / GIB:.2f} GiB left ({how}); raise "
            "gpu_memory_utilization, lower max_num_batched_tokens / max_num_seqs, or use more GPUs"
        )
    return CacheSizing(int(n), block_size, per_block, how)


class PagedKVCache:
    def __init__(
        self,
        layer_ids: list[int],
        num_blocks: int,
        block_size: int,
        kv_heads_local: int,
        head_dim: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        shape = (num_blocks, block_size, kv_heads_local, head_dim)
        self.num_blocks, self.block_size = num_blocks, block_size
        self.k = {i: torch.zeros(shape, device=device, dtype=dtype) for i in layer_ids}
        self.v = {i: torch.zeros(shape, device=device, dtype=dtype) for i in layer_ids}

    def layer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[layer_id], self.v[layer_id]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k.values(), *self.v.values()))
