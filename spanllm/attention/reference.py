"""The reference backend ("torch"): gather each sequence's keys from its blocks (an FP8 cache widened to the
query's dtype), then SDPA (decodes in one padded batch, prefill chunks one at a time). Short and obvious on purpose:
it runs anywhere (the CPU tests' oracle), and the Triton kernels are checked against it."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from spanllm.attention.backend import AttentionBackend, HostToDevice, write_kv
from spanllm.attention.metadata import AttentionMetadata
from spanllm.layers.rope import apply_rotary


@dataclass
class ReferenceMetadata(AttentionMetadata):
    decode_ctx_host: list[int] | None = None  # the loops below run over host lists
    prefill_q_lens_host: list[int] | None = None
    prefill_ctx_host: list[int] | None = None


def gather(cache: torch.Tensor, block_table: torch.Tensor, n: int) -> torch.Tensor:
    """The first n tokens of one sequence: [n, hkv, d]."""
    bs = cache.shape[1]
    blocks = block_table[: -(-n // bs)].long()
    return cache[blocks].reshape(-1, cache.shape[2], cache.shape[3])[:n]


def reference_decode(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor, context_lens: list[int]
) -> torch.Tensor:
    """q [B, hq, d] -> [B, hq, d]; sequence i attends to its first context_lens[i] cached tokens. One SDPA for the
    whole batch: each sequence's blocks gathered into [B, hkv, n_max, d], the keys past its context masked out."""
    b, hq, d = q.shape
    bs, hkv = k_cache.shape[1], k_cache.shape[2]
    n_max = max(context_lens)
    blocks = block_tables[:, : -(-n_max // bs)].long()  # [B, nb]: past a sequence's own blocks, block 0 (masked)
    k = k_cache[blocks].reshape(b, -1, hkv, d)[:, :n_max].transpose(1, 2).to(q.dtype)  # [B, hkv, n_max, d]
    v = v_cache[blocks].reshape(b, -1, hkv, d)[:, :n_max].transpose(1, 2).to(q.dtype)
    lens = torch.tensor(context_lens, device=q.device)
    keep = torch.arange(n_max, device=q.device)[None, :] < lens[:, None]  # [B, n_max]
    qg = q.reshape(b, hkv, hq // hkv, d)  # the g query heads of each KV head as g query rows
    return F.scaled_dot_product_attention(qg, k, v, attn_mask=keep[:, None, None, :]).reshape(b, hq, d)


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
    hq = q.shape[1]
    hkv = k_cache.shape[2]
    out = torch.empty_like(q)
    start = 0
    for j, (t, n) in enumerate(zip(q_lens, context_lens)):
        k = gather(k_cache, block_tables[j], n).to(q.dtype).transpose(0, 1).repeat_interleave(hq // hkv, dim=0)
        v = gather(v_cache, block_tables[j], n).to(q.dtype).transpose(0, 1).repeat_interleave(hq // hkv, dim=0)
        qj = q[start : start + t].transpose(0, 1)  # [hq, t, d]
        qpos = torch.arange(n - t, n, device=q.device)
        mask = torch.arange(n, device=q.device)[None, :] <= qpos[:, None]  # [t, n]
        out[start : start + t] = F.scaled_dot_product_attention(qj, k, v, attn_mask=mask).transpose(0, 1)
        start += t
    return out


def reference_attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: ReferenceMetadata):
    """q [N, hq, d] against the cache, which already holds this step's K/V -> [N, hq, d]."""
    nd = meta.num_decode
    out = torch.empty_like(q)
    if nd:
        out[:nd] = reference_decode(q[:nd], k_cache, v_cache, meta.decode_block_tables, meta.decode_ctx_host)
    if nd < q.shape[0]:
        out[nd:] = reference_prefill(
            q[nd:], k_cache, v_cache, meta.prefill_block_tables, meta.prefill_q_lens_host, meta.prefill_ctx_host
        )
    return out


class ReferenceBackend(AttentionBackend):
    name = "torch"

    def build_metadata(
        self,
        num_decode: int,
        q_lens: np.ndarray,
        context_lens: np.ndarray,
        block_tables: np.ndarray,
        cos: torch.Tensor,
        sin: torch.Tensor,
        slot_mapping: torch.Tensor,
        h2d: HostToDevice,
    ) -> ReferenceMetadata:
        nd = num_decode
        tables = h2d(block_tables)
        ctx = h2d(context_lens)
        meta = ReferenceMetadata(
            cos, sin, slot_mapping, nd, tables[:nd], ctx[:nd], decode_ctx_host=context_lens[:nd].tolist()
        )
        if nd < len(q_lens):
            meta.prefill_block_tables = tables[nd:]
            meta.prefill_context_lens = ctx[nd:]
            meta.prefill_q_lens_host = q_lens[nd:].tolist()
            meta.prefill_ctx_host = context_lens[nd:].tolist()
        return meta

    def forward(
        self, qk: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: ReferenceMetadata
    ) -> torch.Tensor:
        n = qk.shape[0]
        hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        qk = apply_rotary(qk.view(n, hq + hkv, d), meta.cos, meta.sin)
        q, k = qk[:, :hq], qk[:, hq:]
        write_kv(k_cache, v_cache, k, v.view(n, hkv, d), meta.slot_mapping)
        return reference_attend(q, k_cache, v_cache, meta).reshape(n, hq * d)
