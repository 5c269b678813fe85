"""Paged attention: K/V live in fixed-size blocks of a shared pool; a sequence reaches its tokens
through its block table.

Cache layout, per layer: k, v [num_blocks, block_size, kv_heads, head_dim]. Token position p of a
sequence is slot `block_table[p // block_size] * block_size + p % block_size`; a step writes its new
K/V at the slots the runner computed (`slot_mapping`), then attends. Block 0 is never handed to a
sequence: padded rows of a captured decode graph write there and read only it.

A step's tokens are packed, decode tokens first (one per sequence), then prefill chunks (a run of
consecutive positions of one sequence, attending causally to everything before them in its cache:
its earlier chunks, or what a preempted sequence had generated). Two kernels therefore:
- decode: one query per sequence against its `context_len` cached keys (split over the context when
  the batch alone cannot fill the GPU; the last split to finish merges the partial results);
- prefill: a chunk of `q_len` queries at positions [context_len - q_len, context_len).

Backends: "torch" is the reference (gather the sequence's keys, then SDPA, one sequence at a time): it
runs anywhere and the tests compare against it; "triton" (spanllm.kernels.paged_attention) is
the GPU path. `resolve_backend` picks triton on CUDA with Triton present; asking for triton where it
cannot run is an error, never a silent fallback.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

try:  # the GPU kernels (Triton); the CPU wheel has the reference only
    from spanllm.kernels import paged_attention as kernels
except ImportError:
    kernels = None

BACKENDS = ("auto", "torch", "triton")


@dataclass
class PagedMetadata:
    """One forward of the serving engine, shared by every layer. Tensors on the model's device."""

    cos: torch.Tensor  # [N, 1, d] (broadcast over heads)
    sin: torch.Tensor  # [N, 1, d]
    slot_mapping: torch.Tensor  # [N] int64: where each token's K/V go
    num_decode: int  # tokens [0, num_decode) are decodes, one per sequence
    decode_block_tables: torch.Tensor | None  # [num_decode (or decode_rows), W] int32
    decode_context_lens: torch.Tensor | None  # [num_decode (or decode_rows)] int32: cached tokens incl. this one
    prefill_cu_q: torch.Tensor | None = None  # [P+1] int32: chunk starts within the prefill tokens
    prefill_context_lens: torch.Tensor | None = None  # [P] int32: tokens in cache after this chunk
    prefill_block_tables: torch.Tensor | None = None  # [P, W] int32
    prefill_tiles: torch.Tensor | None = None  # [T, 2] int32 (chunk index, first query) per query tile (triton)
    prefill_q_lens_host: list[int] | None = None  # reference path: chunk lengths
    prefill_ctx_host: list[int] | None = None
    decode_ctx_host: list[int] | None = None
    logits_indices: torch.Tensor | None = None  # [S] rows of the packed tokens whose logits are wanted
    backend: str = "torch"
    num_splits: int = 1  # decode: context splits per (sequence, KV head); fixed per captured bucket
    # Mixed-step graphs (triton): the decode kernel runs over rows [0, decode_rows), whose decode_context_lens
    # are a decode's context or 0 (not a decode: the kernel skips the row), and the prefill kernel over the
    # tiles of the other chunks; 0: not such a graph.
    decode_rows: int = 0
    logits_out: torch.Tensor | None = None  # [S, vocab] float32 the LM head writes into (graphs share one)
    paged: bool = True  # (AttentionMetadata, the static path's, has paged=False)


def resolve_backend(name: str, device: torch.device) -> str:
    if name not in BACKENDS:
        raise ValueError(f"attention_backend={name!r} must be one of {BACKENDS}")
    has_triton = kernels is not None
    if name == "auto":
        return "triton" if device.type == "cuda" and has_triton else "torch"
    if name == "triton" and (device.type != "cuda" or not has_triton):
        raise ValueError(
            f"attention_backend='triton' needs a CUDA device and Triton; this rank has {device} and "
            f"Triton {'installed' if has_triton else 'missing'}. Use attention_backend='torch' (the "
            "reference) here"
        )
    return name


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """k, v [N, hkv, d] into their slots (k_cache viewed as [num_blocks * block_size, hkv, d])."""
    nb, bs, h, d = k_cache.shape
    k_cache.view(nb * bs, h, d).index_copy_(0, slot_mapping, k)
    v_cache.view(nb * bs, h, d).index_copy_(0, slot_mapping, v)


def _gather(cache: torch.Tensor, block_table: torch.Tensor, n: int) -> torch.Tensor:
    """The first n tokens of one sequence: [n, hkv, d]."""
    bs = cache.shape[1]
    blocks = block_table[: -(-n // bs)].long()
    return cache[blocks].reshape(-1, cache.shape[2], cache.shape[3])[:n]


def reference_decode(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor, context_lens: list[int]
) -> torch.Tensor:
    """q [B, hq, d] -> [B, hq, d]; sequence i attends to its first context_lens[i] cached tokens."""
    hq, d = q.shape[1], q.shape[2]
    hkv = k_cache.shape[2]
    out = torch.empty_like(q)
    for i, n in enumerate(context_lens):
        k = _gather(k_cache, block_tables[i], n).transpose(0, 1)  # [hkv, n, d]
        v = _gather(v_cache, block_tables[i], n).transpose(0, 1)
        qi = q[i].reshape(hkv, hq // hkv, d)  # the g query heads of each KV head as g query rows
        out[i] = F.scaled_dot_product_attention(qi, k, v).reshape(hq, d)
    return out


def reference_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    q_lens: list[int],
    context_lens: list[int],
) -> torch.Tensor:
    """q [sum(q_lens), hq, d] -> same shape. Chunk j's queries sit at positions
    [context_lens[j] - q_lens[j], context_lens[j]) and attend causally to the cache up to their own."""
    hq, d = q.shape[1], q.shape[2]
    hkv = k_cache.shape[2]
    out = torch.empty_like(q)
    start = 0
    for j, (t, n) in enumerate(zip(q_lens, context_lens)):
        k = _gather(k_cache, block_tables[j], n).transpose(0, 1).repeat_interleave(hq // hkv, dim=0)  # [hq, n, d]
        v = _gather(v_cache, block_tables[j], n).transpose(0, 1).repeat_interleave(hq // hkv, dim=0)
        qj = q[start : start + t].transpose(0, 1)  # [hq, t, d]
        qpos = torch.arange(n - t, n, device=q.device)
        mask = torch.arange(n, device=q.device)[None, :] <= qpos[:, None]  # [t, n]
        out[start : start + t] = F.scaled_dot_product_attention(qj, k, v, attn_mask=mask).transpose(0, 1)
        start += t
    return out


def paged_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: PagedMetadata
) -> torch.Tensor:
    """q [N, hq, d], k, v [N, hkv, d] (rotated) -> [N, hq, d]: write the step's K/V, then attend."""
    write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
    return attend(q, k_cache, v_cache, meta)


def attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: PagedMetadata) -> torch.Tensor:
    """q [N, hq, d] against the cache, which already holds this step's K/V -> [N, hq, d]."""
    nd = meta.num_decode
    if meta.backend == "triton":
        if nd == q.shape[0]:
            return kernels.decode(
                q, k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens, meta.num_splits
            )
        if meta.decode_rows:  # a mixed-step graph: each kernel writes only its own rows of one output
            out = torch.empty_like(q)
            r = meta.decode_rows
            kernels.decode(
                q[:r],
                k_cache,
                v_cache,
                meta.decode_block_tables,
                meta.decode_context_lens,
                meta.num_splits,
                out=out[:r],
            )
            return kernels.prefill(
                q,
                k_cache,
                v_cache,
                meta.prefill_block_tables,
                meta.prefill_cu_q,
                meta.prefill_context_lens,
                meta.prefill_tiles,
                out=out,
            )
        if nd == 0:  # prefill chunks only (or a mixed-step graph that runs decodes as one-query chunks)
            return kernels.prefill(
                q,
                k_cache,
                v_cache,
                meta.prefill_block_tables,
                meta.prefill_cu_q,
                meta.prefill_context_lens,
                meta.prefill_tiles,
            )
        out = torch.empty_like(q)
        if nd:
            out[:nd] = kernels.decode(
                q[:nd], k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens, meta.num_splits
            )
        out[nd:] = kernels.prefill(
            q[nd:],
            k_cache,
            v_cache,
            meta.prefill_block_tables,
            meta.prefill_cu_q,
            meta.prefill_context_lens,
            meta.prefill_tiles,
        )
        return out
    out = torch.empty_like(q)
    if nd:
        out[:nd] = reference_decode(q[:nd], k_cache, v_cache, meta.decode_block_tables, meta.decode_ctx_host)
    if nd < q.shape[0]:
        out[nd:] = reference_prefill(
            q[nd:], k_cache, v_cache, meta.prefill_block_tables, meta.prefill_q_lens_host, meta.prefill_ctx_host
        )
    return out
