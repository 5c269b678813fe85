"""Attention over the KV cache: RoPE, cache write, scaled dot-product attention (SDPA).

Prefill (a right-padded batch starting at position 0) attends causally to its own keys; padding sits
after each sequence's last token, so causal masking alone keeps real queries off padded keys. Decode
(one token per sequence at its own position) writes its key/value at that position and attends to
cache positions <= it; positions between a prompt's end and the padded prompt length hold padding
keys until decode overwrites them, and the mask never exposes them before that.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from spanllm.attention.paged import attend, paged_attention
from spanllm.engine.timers import Timers
from spanllm.kernels.fused_ops import rope_and_cache
from spanllm.layers.rope import apply_rotary


@dataclass
class AttentionMetadata:
    """One forward pass of one (micro-)batch, shared by every layer."""

    is_prefill: bool
    slot_start: int  # the batch occupies cache slots [slot_start, slot_start + B)
    positions: torch.Tensor  # [B, T] int64; decode: T = 1, the position being written
    cos: torch.Tensor  # [B, 1, T, d]
    sin: torch.Tensor  # [B, 1, T, d]
    decode_mask: torch.Tensor | None = None  # [B, 1, 1, kv_len] additive (0 / -inf, model dtype), decode only
    kv_len: int = 0  # cache positions decode attends over (max_seq_len inside a CUDA graph)
    rows: torch.Tensor | None = None  # [B] arange, decode only (built once per forward, not per layer)
    compiled: bool = False  # decode through each layer's compiled block (EngineConfig.compile_scope="layer")
    paged: bool = False  # the serving engine's PagedMetadata says True


class Attention(nn.Module):
    def __init__(self, num_heads_local: int, num_kv_heads_local: int, head_dim: int, timers: Timers) -> None:
        super().__init__()
        self.num_heads = num_heads_local
        self.num_kv_heads = num_kv_heads_local
        self.head_dim = head_dim
        self.timers = timers

    def forward(
        self, qk: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata, cache: tuple[torch.Tensor, torch.Tensor]
    ) -> torch.Tensor:
        """qk [B, T, (hq+hkv)*d] (queries then keys, as the fused projection lays them out), v [B, T, hkv*d],
        cache views [B, hkv, S, d] -> [B, T, hq*d]. Queries and keys are rotated together (one set of
        RoPE kernels per layer, not two)."""
        if meta.paged:
            return self._paged(qk, v, meta, cache)
        with self.timers.region("attention"):
            b, t, _ = qk.shape
            qk = qk.view(b, t, self.num_heads + self.num_kv_heads, self.head_dim).transpose(1, 2)  # [B, hq+hkv, T, d]
            qk = apply_rotary(qk, meta.cos, meta.sin)
            q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]  # [B, hq, T, d], [B, hkv, T, d]
            v = v.view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
            k_cache, v_cache = cache
            if meta.is_prefill:
                k_cache[:, :, :t] = k
                v_cache[:, :, :t] = v
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            else:
                rows = meta.rows if meta.rows is not None else torch.arange(b, device=q.device)
                pos = meta.positions[:, 0]
                k_cache[rows, :, pos] = k[:, :, 0]  # [B, hkv, d] at each sequence's own position
                v_cache[rows, :, pos] = v[:, :, 0]
                # GQA as plain multi-head attention: the g = hq/hkv query heads of one KV head become g
                # query rows of that head ([B, hkv, g, d]), so the masked fused kernels apply (enable_gqa
                # with a mask would fall back to the math kernel on GPU).
                group = self.num_heads // self.num_kv_heads
                out = F.scaled_dot_product_attention(
                    q.reshape(b, self.num_kv_heads, group, self.head_dim),
                    k_cache[:, :, : meta.kv_len],
                    v_cache[:, :, : meta.kv_len],
                    attn_mask=meta.decode_mask,
                )  # [B, hkv, g, d]
                out = out.reshape(b, self.num_heads, 1, self.head_dim)  # [B, hq, 1, d]
            return out.transpose(1, 2).reshape(b, t, self.num_heads * self.head_dim)

    def _paged(self, qk: torch.Tensor, v: torch.Tensor, meta, cache: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """The serving engine's packed tokens: qk [N, (hq+hkv)*d], v [N, hkv*d] (views of one qkv row), cache
        (k, v) blocks of this layer -> [N, hq*d] (spanllm.attention.paged). With the Triton backend,
        RoPE and both cache writes are one fused kernel (spanllm.kernels.fused_ops.rope_and_cache)."""
        with self.timers.region("attention"):
            n = qk.shape[0]
            hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
            if (
                meta.backend == "triton"
                and qk.stride(0) == v.stride(0)
                and v.data_ptr() == qk.data_ptr() + qk.shape[1] * qk.element_size()
            ):
                q = rope_and_cache(qk, meta.cos, meta.sin, meta.slot_mapping, cache[0], cache[1], hq, hkv, d)
                out = attend(q, cache[0], cache[1], meta)
            else:
                qk = apply_rotary(qk.view(n, hq + hkv, d), meta.cos, meta.sin)
                q, k = qk[:, :hq], qk[:, hq:]
                out = paged_attention(q, k, v.view(n, hkv, d), cache[0], cache[1], meta)
            return out.reshape(n, hq * d)
