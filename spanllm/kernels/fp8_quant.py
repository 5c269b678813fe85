"""Dynamic per-token FP8 quantization of activations (Triton), the input side of the W8A8 GEMM.

For each row x[m, :]: scale[m] = max(|x[m, :]|) / 448 (448 = the largest finite float8_e4m3fn), and
q[m, k] = x[m, k] / scale[m] rounded to e4m3 (round to nearest even, saturating at +-448). The GEMM then
computes (q_x @ q_w^T) * scale_x[m] * scale_w[n] in fp32 (torch._scaled_mm with row-wise scales).

One program per row: the row's amax and its quantization in one pass over registers (a row of the 8B's
widest input, 14,336 values, is 56 KiB in fp32: 8 warps hold it). The torch composition (abs, amax, div,
clamp, cast) launches five kernels and reads the row three times.

A row of zeros gets scale = MIN_SCALE (not 0): its q is 0 and no division by zero happens.

The kernels that produce a W8A8 GEMM's input (residual add + RMSNorm, SiLU(gate) * up: spanllm.kernels.fused_ops)
can quantize it themselves, with `fp8_scale` and `fp8_quantize` below, and hand the GEMM an `Fp8Activation`: the
activation is then never written in the model dtype and read back. Their result equals this kernel's on the
rounded output bit for bit.

Triton's interpreter rounds float32 -> float8 differently from the GPU (2026-12: 1.95 -> 1.0), so the casts are
checked on the GPU only (tests/engine/test_fp8.py); `quantize_per_token_reference` is the CPU path and the GPU's
reference.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU torch wheel comes without Triton
    triton = None

from typing import NamedTuple

from spanllm.kernels import interpreter
from spanllm.kernels.pdl import launch_options

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
MIN_SCALE = 1.0 / (FP8_MAX * 512.0)  # the scale of an all-zero row (vLLM's floor for dynamic scales)


class Fp8Activation(NamedTuple):
    """An activation quantized per token by the kernel that produced it: x ~= q * scale, with `dtype` the model's
    (what the GEMM's output is). q float8_e4m3fn [M, K], scale float32 [M, 1]."""

    q: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    def dequantized(self) -> torch.Tensor:
        """q * scale in `dtype`: the values the FP8 GEMM sees (the CPU path computes with these)."""
        return (self.q.float() * self.scale).to(self.dtype)

    @staticmethod
    def of(x: torch.Tensor) -> Fp8Activation:
        """x quantized per token by the reference (the CPU path of the fused kernels)."""
        return Fp8Activation(*quantize_per_token_reference(x), x.dtype)


def quantize_per_token_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q float8_e4m3fn [M, K], scale float32 [M, 1]) with x ~= q * scale; torch ops, any device."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True)
    # A tensor divisor, not the Python scalar: torch on CUDA divides by a scalar as a multiply by its reciprocal,
    # which differs from IEEE division (the kernel's div_rn) in the last bit for some values.
    scale = (amax / torch.full_like(amax, FP8_MAX)).clamp(min=MIN_SCALE)
    q = (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


if triton is not None:
    from spanllm.kernels.pdl import wait_then_release

    # div_rn: IEEE division, as torch's (Triton's `/` on fp32 may compile to an approximate divide), so that scale
    # and q equal the reference bit for bit; the cast that follows (.to(float8e4nv)) rounds to nearest even.
    @triton.jit
    def fp8_scale(amax):
        """The per-token scale of a row whose largest |value| is amax (fp32): amax / 448, at least MIN_SCALE."""
        return tl.maximum(tl.math.div_rn(amax, tl.full([], 448.0, tl.float32)), 1.0 / (448.0 * 512.0))

    @triton.jit
    def fp8_quantize(v, scale):
        """v (fp32) / scale, saturated at +-448: cast the result to e4m3 to store it."""
        return tl.clamp(tl.math.div_rn(v, tl.zeros_like(v) + scale), -448.0, 448.0)

    @triton.jit
    def _quantize_per_token_kernel(
        x_ptr, q_ptr, scale_ptr, stride_x, stride_q, n_cols, BLOCK: tl.constexpr, PDL: tl.constexpr
    ):
        wait_then_release(PDL)
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        ok = cols < n_cols
        x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
        scale = fp8_scale(tl.max(tl.abs(x), axis=0))
        tl.store(q_ptr + row * stride_q + cols, fp8_quantize(x, scale).to(q_ptr.dtype.element_ty), mask=ok)
        tl.store(scale_ptr + row, scale)


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (bf16 / fp16 / fp32, last dim contiguous) -> (q [M, K] e4m3, scale [M, 1] fp32); the Triton
    kernel on CUDA tensors, the reference elsewhere. Graph-safe (allocations only)."""
    if x.dim() != 2:
        raise ValueError(f"quantize_per_token: x must be 2-D [M, K], got shape {tuple(x.shape)}")
    if not interpreter.runs_kernels(x):
        return quantize_per_token_reference(x)
    if x.stride(1) != 1:
        x = x.contiguous()
    m, k = x.shape
    q = torch.empty((m, k), dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m == 0:
        return q, scale
    block = triton.next_power_of_2(k)
    _quantize_per_token_kernel[(m,)](
        x,
        q,
        scale,
        x.stride(0),
        q.stride(0),
        k,
        BLOCK=block,
        num_warps=8 if block >= 4096 else 4,
        **launch_options(x.device),
    )
    return q, scale
