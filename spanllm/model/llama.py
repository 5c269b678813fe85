"""Llama (3 / 3.1) for causal LM, tensor-parallel, and cut into pipeline stages.

A pipeline stage is this same class with the parts it does not run left as None (torchtitan's way):
the embedding lives on the first stage, the final norm and LM head on the last, and `layers` holds
only the stage's decoder layers, keyed by their original index so checkpoint names stay
`model.layers.{i}.*` on every stage.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from spanllm.attention.layer import Attention, AttentionMetadata
from spanllm.engine.static.kv_cache import KVCache
from spanllm.kernels.fused_ops import add_rms_norm, silu_mul
from spanllm.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from spanllm.layers.norm import RMSNorm
from spanllm.layers.tp import TPContext
from spanllm.layers.vocab import ParallelLMHead, VocabParallelEmbedding
from spanllm.model.config import ModelConfig


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPContext) -> None:
        super().__init__()
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, tp)
        self.o_proj = RowParallelLinear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, tp)
        self.attn = Attention(self.qkv_proj.num_heads_local, self.qkv_proj.num_kv_heads_local, cfg.head_dim, tp.timers)

    def forward(self, h: torch.Tensor, meta: AttentionMetadata, cache) -> torch.Tensor:  # [B, T, hidden]
        qkv = self.qkv_proj(h)  # [B, T, (hq + 2 hkv) d]
        qk, v = qkv.split([self.qkv_proj.q_size + self.qkv_proj.kv_size, self.qkv_proj.kv_size], dim=-1)
        return self.o_proj(self.attn(qk, v, meta, cache))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPContext) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, cfg.intermediate_size, tp)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, T, hidden]
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # 2 x [B, T, ffn/tp]
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, tp: TPContext) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, tp)
        self.self_attn = LlamaAttention(cfg, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, tp)
        self.mlp = LlamaMLP(cfg, tp)

        self.compiled_block = None  # set by ModelRunner for compile_scope="layer" (see block)

    def forward(self, h: torch.Tensor, meta: AttentionMetadata, kv_cache: KVCache) -> torch.Tensor:
        cache = kv_cache.layer(self.layer_id, meta.slot_start, h.shape[0])
        if meta.compiled:  # set only when every layer has its compiled block (ModelRunner)
            return self.compiled_block(h, meta, cache)
        return self.block(h, meta, cache)

    def forward_paged(
        self, h: torch.Tensor, residual: torch.Tensor | None, meta, cache: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The serving engine's layer on packed tokens [N, hidden], vLLM's layout: the residual stream travels
        beside h, and each norm first adds the previous sub-layer's output into it (one fused kernel on GPU,
        spanllm.kernels.fused_ops; the same sums and roundings as `block`). Returns (sub-layer output, residual)."""
        x, residual = add_rms_norm(h, residual, self.input_layernorm.weight, self.input_layernorm.eps)
        h = self.self_attn(x, meta, cache)
        x, residual = add_rms_norm(h, residual, self.post_attention_layernorm.weight, self.post_attention_layernorm.eps)
        mlp = self.mlp
        return mlp.down_proj(silu_mul(mlp.gate_up_proj(x))), residual

    def block(self, h: torch.Tensor, meta: AttentionMetadata, cache: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """The layer's compute on its cache views. Nothing here depends on which layer this is (the cache
        views come in as arguments, the weights are the module's), so torch.compile of this method compiles
        once for every layer of the model: parameters are graph inputs, not constants."""
        h = h + self.self_attn(self.input_layernorm(h), meta, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPContext, layer_ids: range, first: bool, last: bool) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp) if first else None
        self.layers = nn.ModuleDict({str(i): LlamaDecoderLayer(cfg, i, tp) for i in layer_ids})
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, tp) if last else None


class LlamaForCausalLM(nn.Module):
    """One pipeline stage (the whole model when pp=1). `forward` takes token ids on the first stage and
    hidden states elsewhere; it returns logits [B, vocab] (float32) on the last stage, hidden states
    [B, T, hidden] elsewhere."""

    def __init__(
        self, cfg: ModelConfig, tp: TPContext, layer_ids: range | None = None, first: bool = True, last: bool = True
    ) -> None:
        super().__init__()
        self.config = cfg
        self.tp = tp
        self.layer_ids = range(cfg.num_layers) if layer_ids is None else layer_ids
        self.is_first, self.is_last = first, last
        self.model = LlamaModel(cfg, tp, self.layer_ids, first, last)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, tp) if last else None
        if cfg.tie_word_embeddings and first and last:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self, x: torch.Tensor, meta: AttentionMetadata, kv_cache: KVCache, last_index: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x: ids [B, T] (first stage) or hidden [B, T, hidden]. last_index [B]: the position whose logits
        are wanted (prefill: length - 1; None in decode, where T = 1)."""
        if meta.paged:
            return self._forward_paged(x, meta, kv_cache)
        h = self.model.embed_tokens(x) if self.is_first else x  # [B, T, hidden]
        for layer in self.model.layers.values():
            self.tp.timers.layer_begin()  # breakdown pass only: keeps the GPU behind the host (timers.py)
            h = layer(h, meta, kv_cache)
        if not self.is_last:
            return h
        if last_index is None:
            h = h[:, -1]  # [B, hidden]
        else:
            h = h[torch.arange(h.shape[0], device=h.device), last_index]  # [B, hidden]
        return self.lm_head(self.model.norm(h))  # [B, vocab] float32

    def _forward_paged(self, ids: torch.Tensor, meta, kv_cache) -> torch.Tensor:
        """Serving engine (pp = 1): packed ids [N] -> logits [S, vocab] float32 of the rows meta.logits_indices
        names (every row when None)."""
        h, residual = self.model.embed_tokens(ids), None  # [N, hidden]
        for layer in self.model.layers.values():
            h, residual = layer.forward_paged(h, residual, meta, kv_cache.layer(layer.layer_id))
        if meta.logits_indices is not None:
            h, residual = h[meta.logits_indices], residual[meta.logits_indices]  # [S, hidden]
        if h.shape[0] == 0:  # a step of partial prefill chunks samples nothing (same plan on every rank)
            return torch.empty(0, self.config.vocab_size, device=h.device, dtype=torch.float32)
        norm = self.model.norm
        h, _ = add_rms_norm(h, residual, norm.weight, norm.eps)
        return self.lm_head(h, out=meta.logits_out)
