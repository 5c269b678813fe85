"""The attention layer of a decoder layer: hands the fused projection's q/k and v to the runner's backend
(RoPE, KV-cache write, attention over the paged cache). The backend is chosen once, when the runner binds it
(`bind_backend`); nothing here dispatches on names."""

from __future__ import annotations

import torch
from torch import nn

from spanllm.attention.backend import AttentionBackend
from spanllm.attention.metadata import AttentionMetadata


class Attention(nn.Module):
    def __init__(self, num_heads_local: int, num_kv_heads_local: int, head_dim: int) -> None:
        super().__init__()
        self.num_heads = num_heads_local
        self.num_kv_heads = num_kv_heads_local
        self.head_dim = head_dim
        self.backend: AttentionBackend | None = None

    def forward(
        self, qk: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata, cache: tuple[torch.Tensor, torch.Tensor]
    ) -> torch.Tensor:
        """qk [N, (hq+hkv)*d], v [N, hkv*d] (views of one qkv row), cache (k, v) blocks of this layer ->
        [N, hq*d]."""
        return self.backend.forward(qk, v, cache[0], cache[1], meta)


def bind_backend(model: nn.Module, backend: AttentionBackend) -> None:
    """Every attention layer of `model` runs `backend` (the runner calls this once)."""
    for m in model.modules():
        if isinstance(m, Attention):
            m.backend = backend
