"""Sampler: greedy, or temperature + top-p, identical on every rank that samples.

Every TP rank of the last stage holds bitwise-identical logits (they were all-gathered), and each
seeds its generator the same way, so each draws the same token without a broadcast. Sampling uses
the exponential-race trick (argmax of p / E, E ~ Exp(1)), which needs no host sync.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    max_tokens: int = 16
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0 (0 = greedy)")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens} must be >= 1")


class Sampler:
    def __init__(self, device: torch.device, seed: int) -> None:
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def __call__(self, logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
        """logits [B, vocab] float32 -> token ids [B] int64."""
        if params.temperature == 0.0:
            return logits.argmax(dim=-1)
        probs = torch.softmax(logits / params.temperature, dim=-1)
        if params.top_p < 1.0:
            sorted_p, order = probs.sort(dim=-1, descending=True)
            # Drop a token when the tokens ranked above it already hold top_p of the mass.
            drop = (sorted_p.cumsum(dim=-1) - sorted_p) > params.top_p
            sorted_p = sorted_p.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
        race = torch.empty_like(probs).exponential_(1.0, generator=self.generator)
        return (probs / race).argmax(dim=-1)
