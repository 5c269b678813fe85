"""AttentionMetadata: what one forward's attention layers share, built once per step by the backend.

A step's tokens are packed: decode tokens first (one per sequence), then prefill chunks (a run of consecutive
positions of one sequence, attending causally to everything before them in its cache: its earlier chunks, a
cached prefix, or what a preempted sequence had generated). Each backend extends this with what its kernels
need (spanllm.attention.reference, spanllm.attention.triton); the fields here are the common plan.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """Tensors on the model's device."""

    cos: torch.Tensor  # [N, 1, d] (broadcast over heads)
    sin: torch.Tensor  # [N, 1, d]
    slot_mapping: torch.Tensor  # [N] int64: where each token's K/V go
    num_decode: int  # tokens [0, num_decode) are decodes, one per sequence
    decode_block_tables: torch.Tensor | None  # [num_decode, W] int32
    decode_context_lens: torch.Tensor | None  # [num_decode] int32: cached tokens, this one included
    prefill_cu_q: torch.Tensor | None = None  # [P+1] int32: chunk starts within the prefill tokens
    prefill_context_lens: torch.Tensor | None = None  # [P] int32: tokens in cache after this chunk
    prefill_block_tables: torch.Tensor | None = None  # [P, W] int32
