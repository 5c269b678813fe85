"""Split-K on the host side, shared by the GEMMs that cut K into chunks and merge the chunks' fp32 partials in the
same launch (spanllm.kernels.skinny_gemm, spanllm.kernels.gemv): the chunk size, the number of non-empty chunks,
and the partials buffer with the arrival counters the tile's last program merges through
(spanllm.kernels.arrival_counters)."""

from __future__ import annotations

import torch

from spanllm.kernels.arrival_counters import arrival_counters


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def split_k_chunk(k: int, block_k: int, split_k: int) -> int:
    """The K range of one split: ceil(K / split_k) rounded up to a multiple of BLOCK_K."""
    return cdiv(cdiv(k, split_k), block_k) * block_k


def effective_split_k(k: int, block_k: int, split_k: int) -> int:
    """The number of non-empty chunks: rounding the chunk up to BLOCK_K can leave the last splits empty."""
    return cdiv(k, split_k_chunk(k, block_k, split_k))


def split_k_buffers(y: torch.Tensor, split: int, n_tiles: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 partials [split, M, N], the tiles' arrival counters) of a split-K launch writing y [M, N]; without a
    split, y twice (the kernel touches neither)."""
    if split == 1:
        return y, y
    m, n = y.shape
    return torch.empty((split, m, n), dtype=torch.float32, device=y.device), arrival_counters(y.device, n_tiles)
