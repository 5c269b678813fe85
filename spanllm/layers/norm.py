"""RMSNorm (HF Llama's rounding)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from spanllm.layers.tp import TPContext


class RMSNorm(nn.Module):
    """x / rms(x) * w, computed in float32 and cast back (as HF Llama does)."""

    def __init__(self, hidden: int, eps: float, tp: TPContext) -> None:
        super().__init__()
        self.eps = eps
        self.weight = tp.empty(hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., hidden]
        # F.rms_norm (x * rsqrt(mean(x^2) + eps), fused on recent CUDA builds) replaces five elementwise
        # kernels per norm; the weight is applied after the cast back, as HF does.
        x32 = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * x32.to(x.dtype)
