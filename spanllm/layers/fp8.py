"""FP8 linear layers (`--quantization fp8`, vLLM's dynamic FP8): weights quantized at load, activations per token.

Weights: every column- and row-parallel linear of the decoder layers (qkv, o, gate_up, down) becomes
float8_e4m3fn [N, K] with one float32 scale per output channel, scale[n] = max_k |W[n, k]| / 448, computed
on the rank's own shard (a row-parallel shard's channel max is over its own input columns). The embedding, the
norms and the LM head stay in the model dtype (the LM head is 1 of the 8B's 8 GB in FP8, and the logits' quality
is the sampler's). A weight-only FP8 model reads about half the bytes of a bf16 one per decode step.

The GEMM, by the number of rows M of x (the same rule on every device, so the CPU path computes what the GPU runs):
- M <= 16 (decode), and up to 128 rows where the measured table (skinny_gemm.fp8_weight_only) found it faster for
  the shape: W8A16. x stays in the model dtype, W is widened in registers, the channel scale applied to the fp32
  sums (spanllm.kernels.skinny_gemm with weight_scale): the halved bytes are the whole gain at these sizes, and no
  activation-quantization pass is paid.
- otherwise (prefill chunks, big decode batches): W8A8. x quantized per token (spanllm.kernels.fp8_quant), then
  an FP8 tensor-core GEMM with row-wise scales, fp32 accumulation, output in the model dtype: spanllm's Triton
  kernel (spanllm.kernels.fp8_gemm, W as the MMA's wide operand) at decode sizes where its measured table found it
  faster, torch._scaled_mm everywhere else. Where the W8A8 table also measured W8A16 at the same shape and rows
  (17-128), that run's times decide between the two (`uses_activation_quant`), with the separate quantization
  pass counted where it is paid (below FUSED_QUANT_MIN_ROWS). Where
  x comes from a residual add + RMSNorm (qkv, gate_up) or from SiLU(gate) * up (down), that kernel can quantize
  its own output (an Fp8Activation, asked for by `_Linear.quantizes_input`) so that no separate pass runs: from
  FUSED_QUANT_MIN_ROWS rows, the crossover `scripts/gpu_fused_quant.py` measures (one program per row: below some
  M the separate kernels' wider grids win). Measured on an H100 the fused chain is faster at every M from 32 up, by
  5-15% per GEMM chain (results/h100/fp8/fused_quant): from 32 rows. Neither chain equals torch's bit for bit in
  every row: in about one row in a thousand the Triton norm kernel's row (fused or not) is off torch's float32
  norm by a few bf16 roundings, and then a few of that row's bytes by one e4m3 step (the GPU test bounds that).
On CPU (and wherever the GPU kernels are missing) the same two computations run in torch: W dequantized once
at quantization time (`dequantized`), x quantized and dequantized per token above the threshold. The GPU path
is checked against it (tests/engine/test_fp8.py, its GPU tests).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from spanllm.kernels import fp8_gemm, interpreter
from spanllm.kernels.fp8_quant import (
    FP8_DTYPE,
    FP8_MAX,
    Fp8Activation,
    quantize_per_token,
    quantize_per_token_reference,
)
from spanllm.kernels.skinny_gemm import FP8_ALWAYS_WEIGHT_ONLY_M, FP8_MAX_M, fp8_weight_only

QUANTIZATIONS = ("fp8",)  # EngineConfig.quantization: None (the model dtype) or one of these
FP8_SHAPE_MULTIPLE = 16  # torch._scaled_mm needs N and K of W multiples of 16 (checked at quantization, any device)
MIN_FP8_CAPABILITY = (8, 9)  # FP8 tensor cores: Ada (8.9) and Hopper (9.0) on


def quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W [N, K] -> (q float8_e4m3fn [N, K], scale float32 [N]) with W ~= q * scale[:, None], per output channel.
    An all-zero row gets scale 1 (its q is 0)."""
    if w.dim() != 2:
        raise ValueError(f"quantize_weight: W must be 2-D [N, K], got shape {tuple(w.shape)}")
    wf = w.float()
    amax = wf.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (wf / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale.contiguous()


def dequantize_weight(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """q * scale[:, None] in `dtype` (the CPU path's weight; the GPU path's reference)."""
    return (q.float() * scale[:, None]).to(dtype)


# Rows from which the kernel producing a W8A8 GEMM's input quantizes it itself (module docstring); None: never.
# 32: the smallest M measured, where the fused chain already wins (results/h100/fp8/fused_quant/fused_quant.json).
FUSED_QUANT_MIN_ROWS: int | None = 32


def uses_activation_quant(rows: int, n: int, k: int, fused_input: bool = True) -> bool:
    """Whether a GEMM of `rows` rows with W [n, k] quantizes x (W8A8) or keeps it (W8A16). Up to 16 rows W8A16,
    past 128 W8A8; in between the W8A8 table's entry where it timed W8A16 beside both W8A8 GEMMs in one run, else
    the skinny GEMM's table (fp8_weight_only). W8A8's cost includes the separate quantization pass unless the
    kernel producing x quantizes it (fused_input: the layer's producer can, i.e. not o_proj, whose input is the
    attention's output) at the bucket's top row count, so that every row count of a table bucket (and of the CUDA
    graph bucket that pads it) gets the same answer."""
    if FP8_ALWAYS_WEIGHT_ONLY_M < rows <= FP8_MAX_M:
        times = fp8_gemm.times(rows, n, k)
        if times is not None and times.w8a16_us is not None:
            w8a8 = min(times.kernel_us, times.scaled_mm_us)
            top = fp8_gemm.m_bucket(rows)
            if not fused_input or FUSED_QUANT_MIN_ROWS is None or top < FUSED_QUANT_MIN_ROWS:
                w8a8 += times.quant_us
            return w8a8 < times.w8a16_us
    return not fp8_weight_only(rows, n, k)


def producer_quantizes(rows: int, n: int, k: int) -> bool:
    """Whether the kernel that produces this W8A8 GEMM's input (norm, SiLU) quantizes it (FUSED_QUANT_MIN_ROWS)."""
    return FUSED_QUANT_MIN_ROWS is not None and rows >= FUSED_QUANT_MIN_ROWS and uses_activation_quant(rows, n, k)


def describe_dispatch() -> str:
    """The rule in words, for the engine's description line."""
    fused = (
        "x quantized by a separate pass"
        if FUSED_QUANT_MIN_ROWS is None
        else f"x quantized by the norm / SiLU kernel that produces it from {FUSED_QUANT_MIN_ROWS} rows"
    )
    return (
        f"<= {FP8_ALWAYS_WEIGHT_ONLY_M} rows W8A16, up to {FP8_MAX_M} where the measured tables say W8A16 is faster, "
        f"else W8A8 ({fused}; {fp8_gemm.describe()})"
    )


def fp8_linear_reference(x: torch.Tensor, weight_dequantized: torch.Tensor, fused_input: bool = True) -> torch.Tensor:
    """The CPU path: x @ W^T with W already dequantized (in x's dtype), x quantized per token above the
    W8A16 rows (fake quantization: the values the GPU's FP8 GEMM sees). fused_input: as uses_activation_quant."""
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    if uses_activation_quant(x2.shape[0], *weight_dequantized.shape, fused_input):
        q, s = quantize_per_token_reference(x2)
        x2 = (q.float() * s).to(x.dtype)
    return F.linear(x2, weight_dequantized).reshape(*lead, weight_dequantized.shape[0])


def w8a8_gemm(
    q: torch.Tensor, scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """(q * scale) @ (weight * weight_scale[:, None])^T on FP8 tensor cores: the Triton kernel where its table
    measured it faster for this shape and rows (fp8_gemm.takes), else torch._scaled_mm with row-wise scales."""
    if fp8_gemm.takes(q.shape[0], *weight.shape) and interpreter.runs_kernels(q):
        return fp8_gemm.w8a8_linear(q, scale, weight, weight_scale, out_dtype)
    return torch._scaled_mm(q, weight.t(), scale_a=scale, scale_b=weight_scale.view(1, -1), out_dtype=out_dtype)


def scaled_mm_linear(x2: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """W8A8 on FP8 tensor cores: x2 [M, K] quantized per token, then the W8A8 GEMM (w8a8_gemm)."""
    q, s = quantize_per_token(x2)
    return w8a8_gemm(q, s, weight, weight_scale, x2.dtype)


def fp8_linear(
    x: torch.Tensor | Fp8Activation,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_dequantized: torch.Tensor | None,
    fused_input: bool = True,
) -> torch.Tensor:
    """y = x @ (weight * weight_scale[:, None])^T in x's dtype, by the rule in the module docstring. An
    Fp8Activation x (quantized by the kernel that produced it) always runs W8A8. fused_input: whether this layer's
    input may come quantized by its producer (uses_activation_quant)."""
    if isinstance(x, Fp8Activation):
        if x.q.dim() != 2 or x.q.shape[1] != weight.shape[1]:
            raise ValueError(f"fp8_linear: an Fp8Activation must be [M, K={weight.shape[1]}], got {tuple(x.q.shape)}")
        if not x.q.is_cuda:
            if weight_dequantized is None:
                raise RuntimeError("fp8_linear on CPU needs the dequantized weight (Fp8 quantize_ keeps it on CPU)")
            return F.linear(x.dequantized(), weight_dequantized)
        return w8a8_gemm(x.q, x.scale, weight, weight_scale, x.dtype)
    if not x.is_cuda:
        if weight_dequantized is None:
            raise RuntimeError("fp8_linear on CPU needs the dequantized weight (Fp8 quantize_ keeps it on CPU)")
        return fp8_linear_reference(x, weight_dequantized, fused_input)
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    if uses_activation_quant(x2.shape[0], *weight.shape, fused_input):
        y = scaled_mm_linear(x2, weight, weight_scale)
    else:
        y = torch.ops.spanllm.fp8_weight_linear(x2, weight, weight_scale)
    return y.reshape(*lead, weight.shape[0])


def check_fp8_device(device: torch.device, checkpoint: bool = False) -> None:
    """Refuse FP8 on a GPU without FP8 tensor cores (before any weight is read). checkpoint: the weights are FP8
    in the checkpoint itself (its quantization_config), so the fix is another checkpoint, not a flag."""
    if device.type != "cuda":
        return
    cap = torch.cuda.get_device_capability(device)
    if cap < MIN_FP8_CAPABILITY:
        fix = (
            "This checkpoint is FP8 by its config.json's quantization_config: load its bf16 original instead"
            if checkpoint
            else "Run without --quantization"
        )
        raise ValueError(
            f"quantization='fp8' needs FP8 tensor cores (compute capability >= 8.9: Ada, Hopper); "
            f"{torch.cuda.get_device_name(device)} has {cap[0]}.{cap[1]}. {fix}"
        )
