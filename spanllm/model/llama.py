"""Llama (3 / 3.1) for causal LM, tensor-parallel, and cut into pipeline stages.

One forward over packed tokens (vLLM's layout): a step's tokens from every scheduled sequence in one [N] row,
with the attention metadata saying which sequence each belongs to (spanllm.attention). The residual stream
travels beside the hidden state, and each norm first adds the previous sub-layer's output into it (one fused
kernel on GPU, spanllm.kernels.fused_ops).

A pipeline stage is this same class with the parts it does not run left as None (torchtitan's way): the
embedding lives on the first stage, the final norm and LM head on the last, and `layers` holds only the stage's
decoder layers, keyed by their original index so checkpoint names stay `model.layers.{i}.*` on every stage.
Between stages travel the last layer's output and the residual (vLLM's intermediate tensors).
"""

from __future__ import annotations

import torch
from torch import nn

from spanllm.attention.layer import Attention
from spanllm.attention.metadata import AttentionMetadata
from spanllm.kernels import pdl
from spanllm.kernels.fp8_quant import Fp8Activation
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
        # its input is the attention's output, which no kernel quantizes (FP8: fused_input)
        self.o_proj = RowParallelLinear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, tp, fused_input=False)
        self.attn = Attention(self.qkv_proj.num_heads_local, self.qkv_proj.num_kv_heads_local, cfg.head_dim)

    def forward(self, h: torch.Tensor | Fp8Activation, meta: AttentionMetadata, cache) -> torch.Tensor:
        qkv = self.qkv_proj(h)  # [N, hidden] -> [N, (hq + 2 hkv) d]
        qk, v = qkv.split([self.qkv_proj.q_size + self.qkv_proj.kv_size, self.qkv_proj.kv_size], dim=-1)
        return self.o_proj(self.attn(qk, v, meta, cache))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPContext) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, cfg.intermediate_size, tp)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, tp)

    def forward(self, x: torch.Tensor | Fp8Activation) -> torch.Tensor:  # [N, hidden]
        gate_up = self.gate_up_proj(x)
        # SiLU(gate) * up, one kernel on GPU, which quantizes its output when down runs W8A8 (FP8)
        return self.down_proj(silu_mul(gate_up, quantize=self.down_proj.quantizes_input(gate_up.shape[0])))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, tp: TPContext) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, tp)
        self.self_attn = LlamaAttention(cfg, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, tp)
        self.mlp = LlamaMLP(cfg, tp)

    def forward(
        self,
        h: torch.Tensor,
        residual: torch.Tensor | None,
        meta: AttentionMetadata,
        cache: tuple[torch.Tensor, torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """h: the previous sub-layer's output [N, hidden] (the embedding when residual is None). Returns
        (this layer's MLP output, the residual stream before it); the same sums and roundings as
        `residual = h + attn(norm(h)); out = residual + mlp(norm(residual))`."""
        # Each norm quantizes its output to FP8 itself when the GEMM it feeds runs W8A8 (spanllm.layers.fp8).
        norm, qkv = self.input_layernorm, self.self_attn.qkv_proj
        x, residual = add_rms_norm(h, residual, norm.weight, norm.eps, quantize=qkv.quantizes_input(h.shape[0]))
        h = self.self_attn(x, meta, cache)
        norm, gate_up = self.post_attention_layernorm, self.mlp.gate_up_proj
        x, residual = add_rms_norm(h, residual, norm.weight, norm.eps, quantize=gate_up.quantizes_input(h.shape[0]))
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPContext, layer_ids: range, first: bool, last: bool) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp) if first else None
        self.layers = nn.ModuleDict({str(i): LlamaDecoderLayer(cfg, i, tp) for i in layer_ids})
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, tp) if last else None


class LlamaForCausalLM(nn.Module):
    """One pipeline stage (the whole model when pp=1)."""

    def __init__(
        self,
        cfg: ModelConfig,
        tp: TPContext,
        layer_ids: range | None = None,
        first: bool = True,
        last: bool = True,
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
        self,
        x: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache,
        residual: torch.Tensor | None = None,
        logits_indices: torch.Tensor | None = None,
        logits_out: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """x: token ids [N] on the first stage; elsewhere the previous stage's hidden state [N, hidden], with
        its residual. The last stage returns logits [S, vocab] float32 of the rows logits_indices names (every
        row when None), written into logits_out when given; the other stages return (hidden, residual)."""
        # The engine's programmatic-dependent-launch setting for every Triton kernel of this forward, eager or
        # captured (spanllm.kernels.pdl)
        with pdl.launching(self.tp.pdl):
            return self._forward(x, meta, kv_cache, residual, logits_indices, logits_out)

    def _forward(self, x, meta, kv_cache, residual, logits_indices, logits_out):
        h = self.model.embed_tokens(x) if self.is_first else x  # [N, hidden]
        for layer in self.model.layers.values():
            h, residual = layer(h, residual, meta, kv_cache.layer(layer.layer_id))
        if not self.is_last:
            return h, residual
        if logits_indices is not None:
            h, residual = h[logits_indices], residual[logits_indices]  # [S, hidden]
        if h.shape[0] == 0:  # a step of partial prefill chunks samples nothing (same plan on every rank)
            return torch.empty(0, self.config.vocab_size, device=h.device, dtype=torch.float32)
        norm = self.model.norm
        h, _ = add_rms_norm(h, residual, norm.weight, norm.eps)
        return self.lm_head(h, out=logits_out)
