"""Rotary position embedding with Llama 3.1 frequency scaling, in HF's rotate-half layout.

The cos/sin table is computed once in float32 for every position up to `max_positions` and indexed
by the positions of a batch, so a captured decode graph reads it like any other tensor.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch


class RopeScaling(Protocol):
    """Llama 3.1 frequency scaling ('llama3' rope_type; spanllm.model.config.RopeScaling holds the values)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """[head_dim/2] float32 inverse frequencies; with 'llama3' scaling, long wavelengths are stretched."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv
    ctx = scaling.original_max_position_embeddings
    low_wavelen = ctx / scaling.low_freq_factor  # longer than this: divide the frequency by `factor`
    high_wavelen = ctx / scaling.high_freq_factor  # shorter than this: keep it
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / scaling.factor, inv)
    # In between, blend linearly in ctx/wavelen between the scaled and the unscaled frequency.
    smooth = (ctx / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, blended, scaled)


class RotaryEmbedding:
    """cos/sin tables [max_positions, head_dim] on the device, in the model dtype."""

    def __init__(
        self,
        head_dim: int,
        theta: float,
        scaling: RopeScaling | None,
        max_positions: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        inv = inverse_frequencies(head_dim, theta, scaling)
        freqs = torch.arange(max_positions, dtype=torch.int64).float()[:, None] * inv[None, :]  # [P, d/2]
        emb = torch.cat([freqs, freqs], dim=-1)  # [P, d]
        self.cos = emb.cos().to(device=device, dtype=dtype)
        self.sin = emb.sin().to(device=device, dtype=dtype)
        self.max_positions = max_positions

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [B, T] -> cos, sin [B, 1, T, d] (broadcast over heads); packed positions [N] -> [N, 1, d]."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, H, T, d] rotated by the per-position angles in cos/sin [B, 1, T, d]."""
    return x * cos + _rotate_half(x) * sin
