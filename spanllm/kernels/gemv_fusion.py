"""What the one-row GEMV (spanllm.kernels.gemv) does besides the product, so that the small kernels around it at
batch 1 need no launch of their own.

Batch-1 decode is a stream over the weights, and every kernel between two GEMVs costs its latency, not its bytes:
the residual add + RMSNorm before qkv and gate_up and SiLU(gate) * up before down are 3 launches a layer of
1.5-2.2 us each on an H100, ~190 us of a 3.44 ms FP8 step (results/h100/gemv/). Two fusions, each on where
SPANLLM_GEMV_FUSE names it (a comma list; empty, the default: neither, the kernels of spanllm.kernels.fused_ops run).
Both were measured slower on an H100 (results/h100/gemv/fusion/): batch-1 FP8 decode 3.44 ms without, 3.46 with
"silu", 3.74 with both.

- "silu": gate_up's GEMV ends with SiLU(gate) * up. Each program owns some features' gate and up rows, so the
  product is computed once per feature in its epilogue, rounded exactly as the unfused chain rounds it (gate_up's
  output in the model dtype, then fused_ops.silu_mul): the same x for down, bit for bit.
- "norm": qkv's and gate_up's GEMVs take their input as a `NormedRow(h, residual, weight, eps, residual_out)` and
  compute RMSNorm(h + residual) * weight as they load it. The residual sum is rounded to the model dtype as
  fused_ops.add_rms_norm rounds it and written to `residual_out` by the GEMV (the programs of its first column of
  output tiles, each its own K chunk), so `residual_out` holds h + residual only once the consumer has run. Every
  program reads the whole row and accumulates its sum of squares in the same loop as the product, then applies
  1 / rms to the sum: x = (h + residual) * weight stays fp32, never rounded to the model dtype, so y differs from
  the unfused chain's by that rounding. The work is repeated by every program (the GEMV's hundreds), unlike the
  epilogue's.

A consumer that cannot take a NormedRow raises (`_Linear.gemm`): the residual would never be written.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

ENV = "SPANLLM_GEMV_FUSE"
FUSIONS = ("silu", "norm")
DEFAULT = ""


def fuses(what: str) -> bool:
    """Whether the one-row GEMV does `what` ("silu" or "norm"), by SPANLLM_GEMV_FUSE (default DEFAULT)."""
    value = os.environ.get(ENV, DEFAULT)
    names = [v for v in value.split(",") if v]
    bad = [v for v in names if v not in FUSIONS]
    if bad:
        raise ValueError(f"{ENV}={value!r}: unknown {bad}; a comma list of {', '.join(FUSIONS)}, or empty for neither")
    return what in names


@dataclass(frozen=True)
class NormedRow:
    """RMSNorm(h + residual) * weight for one row, computed by the GEMV that reads it. h [1, K] is the previous
    sub-layer's output (the embedding at the first layer, where residual is None and residual_out is h)."""

    h: torch.Tensor
    residual: torch.Tensor | None
    weight: torch.Tensor
    eps: float
    residual_out: torch.Tensor

    @staticmethod
    def of(h: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float) -> NormedRow:
        """The norm of h + residual, with a new tensor for the residual sum (h itself when residual is None)."""
        return NormedRow(h, residual, weight, eps, h if residual is None else torch.empty_like(h))

    def reference(self) -> torch.Tensor:
        """The row the GEMV multiplies, in fp32 (tests): (h + residual) * weight / rms, unrounded."""
        h = self.h if self.residual is None else self.h + self.residual  # rounded, as the residual stream is
        inv = torch.rsqrt(h.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return h.float() * self.weight.float() * inv
