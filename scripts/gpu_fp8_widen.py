"""The W8A16 skinny GEMM's e4m3 -> 16-bit weight widening, variant against variant, at the Llama 3.1 8B shapes.

    PYTHONPATH=. python scripts/gpu_fp8_widen.py OUTDIR [--budget-s 90] [--ms 1,4,16] [--layers qkv,o,gate_up,down]
                                                       [--variants baseline,cvt_f16,...]

Why: spanllm.kernels.skinny_gemm streams an FP8 weight (float8_e4m3fn [N, K], one fp32 scale per row) and widens
each tile in registers with `w.to(bf16)`. On an H100 that reached ~60% of HBM bandwidth (14.1 us for the 8B's
25 MB qkv weight at M=1) where bf16 F.linear reaches ~80%. Triton 3.x on sm_90 lowers e4m3 -> bf16 as
`cvt.rn.f16x2.e4m3x2` (two elements) followed by one `cvt.bf16.f16` per element (PTX has no e4m3x2 -> bf16x2
cvt before sm_100; third_party/nvidia/lib/TritonNVIDIAGPUToLLVM/ElementwiseOpToLLVM.cpp, Fp8E4M3Nv_to_Bf16):
1.5 conversion-pipe instructions (F2FP, F2F: 16 per clock per SM on sm_90) per weight byte, which caps an SM at
~10.7 weight bytes per clock against an HBM share of ~13-15 bytes per clock (3.35 TB/s / 132 SMs / 1.7-2.0 GHz),
before any imperfect overlap. The variants below widen with fewer conversions or none.

Variants (all but `baseline` are one kernel of this file, `_w8a16_kernel`: the production kernel's structure, tiling,
split-K and in-kernel split merge, copied; only the widening differs, chosen by the constexpr WIDEN, each widening its
own @triton.jit helper). W is passed as int8 bytes (a view), so every variant loads the same thing.
- baseline: production `skinny_linear(x, w, weight_scale=scale)`.
- cvt_bf16: the copy, widening as production does (bitcast to e4m3, .to(bf16)): the control. Its M is not
  specialized (do_not_specialize, to compile each config once for all M); a gap to `baseline` is the copy's, not the
  widening's.
- cvt_f16: .to(fp16): one cvt.rn.f16x2.e4m3x2 per two weights (Hopper's native conversion), the x tile cast
  bf16 -> fp16 inside the loop, fp16 MMA with fp32 accumulation. Every e4m3 value is exact in fp16 (normal range);
  x is exact where |x| is in fp16's normal range [2^-14, 65504] (bf16 activations beyond 65504 would overflow).
- cvt_f16_xpre: cvt_f16 with x cast to fp16 before the launch, outside the timed graph (in the engine the cast
  would be fused into the kernel that writes x: RMSNorm, SiLU-mul); measures what the in-loop x cast costs.
- bits_bf16_mul: vLLM Marlin's FP8 dequantization (csrc/quantization/marlin/dequant.h, dequant<nv_bfloat162,
  kFE4M3fn>): the e4m3 byte's sign to bit 15 and its 7 exponent+mantissa bits to bits 10..4 of a bf16, i.e. the
  value times 2^-120 (e4m3 exponent bias 7, bf16 bias 127), with integer ops (here: sign-extend to int16, << 4,
  & 0x87F0), then times 2^120 in bf16. The product is exact: every e4m3 value, denormals (which land on bf16
  subnormals) included, is representable in bf16 and PTX's bf16 multiply keeps subnormals (no .ftz for bf16).
  This is the numerically safe way to fix the bias. (Written in Triton, the shift/mask costs ~3 integer
  instructions per weight and, on Triton 3.6, the multiply stops the widening from being hoisted into the MMA
  operand registers: an extra shared-memory round trip. The asm_ variants do the same arithmetic on packed words.)
- bits_bf16_fold: the same bits without the multiply; the 2^120 goes into the per-row scale (Marlin's skip_flop path
  with vLLM's fp8_fused_exponent_bias_into_scales). NOT numerically safe in bf16, which is why it is measured, not
  proposed: every product x * w reaches the fp32 accumulator 2^120 too small, so |x * w| < 2^-6 lands below fp32's
  smallest normal 2^-126 (e4m3 denormal weights always, any weight times a small activation) and the tensor cores
  may flush or truncate it; the bf16 tile itself holds e4m3 denormals as bf16 subnormals, which the MMA may flush.
  The `codes` check below (all 254 finite codes, x = 1 and x = 2^-20) shows what this GPU does.
- bits_f16_fold_xpre: the fp16 analogue (sign to bit 15, 7 bits to bits 13..7: value * 2^-8, e4m3 denormals on
  fp16 subnormals), 2^8 folded into the scale, x cast to fp16 before the launch. The fold is harmless here: 2^-8
  keeps every product far inside fp32's normal range; only fp16-subnormal weights (e4m3 denormals) depend on the
  MMA keeping fp16 subnormals (expected of NVIDIA tensor cores; the codes check verifies it).
- asm_bf16_mul: the bits_bf16_mul arithmetic as inline PTX on packed registers, 4 weights per asm: two
  `prmt` (bytes to sign-extended 16-bit halves), two `shl`, two `and`, two `mul.rn.bf16x2` by 2^120 (the same shape
  as Triton's own sm_90 E5M2 -> bf16 conversion, which multiplies by 2^112). 2 instructions per weight, none on the
  conversion pipe. Needs sm_90 (bf16x2 multiply); not runnable by Triton's interpreter.
- asm_bf16_fold: the same without the multiply, 2^120 in the scale (1.5 instructions per weight; the fold's caveats
  as bits_bf16_fold).

Checks, on the GPU, before anything is timed:
- per (layer, M, variant): max |y - ref| / max |ref| against the fp32 reference x.float() @ (w.float() * scale).T on
  realistic data (x ~ randn bf16, W = randn * 0.02 quantized per row with scale amax / 448,
  spanllm.layers.fp8.quantize_weight); a variant above TOL is reported as failed and not timed. Also recorded:
  whether its output is bit-identical to the baseline's (the exact variants should be: same products, same order).
- once per variant, `codes`: W holding all 254 finite e4m3 codes (denormals, +-448, -0) against one-hot x rows of
  amplitude 1 and 2^-20, per-row scale 1: y must equal the decoded code times the amplitude exactly; mismatches are
  counted and listed (informational: this is where a fold variant's flushing shows).

Timing: for each (layer, M) the same weights and x for every variant; a CUDA graph of >= 20 calls cycling over
enough distinct weights to be 3x the L2 cache (every call streams its weight from HBM, as a decode step walking the
layers does), 3 warm replays, then --replays timed replays with CUDA events; microseconds per call = replay time /
calls, median over replays. Bandwidth = FP8 weight bytes (N * K) / time; `copy_GBps` is a device-to-device copy's
(read + write) bandwidth on the same GPU, the practical ceiling. The baseline is timed again at the end of each
(layer, M) group (`baseline_again`) to show drift.

Budget: no new measurement starts once the elapsed time plus the longest measurement so far would pass
--budget-s; what is left is recorded as skipped. Order: M = 1 for every layer first, then M = 4, then M = 16.
Compiling is most of the time (~0.5 s per variant and launch config: ~60 kernels for all variants, layers and Ms, 6
launch configs); the measurements themselves take well under a second each. A full run should take 1-2 minutes on a
fresh machine; if the budget cuts it, raise --budget-s or narrow --variants / --ms.

Writes OUTDIR/fp8_widen.json (machine, versions, settings, every replay time, bandwidths, errors, the codes check,
and per compiled kernel its registers, spills and its K loop's SASS instruction mix, disassembled with Triton's
bundled cuobjdump) after every measurement, OUTDIR/ptx/<variant>.ptx (the first kernel of each variant), and prints a
table and a summary (geometric-mean speedup over the baseline per variant). Exits non-zero with one line when there is
no CUDA GPU or no Triton.

--static needs no GPU: it compiles every variant for sm_<--arch> (default 90) at the layers' launch configs with
Triton's bundled ptxas and prints each K loop's instruction mix per weight, conversion-pipe instructions (F2F, F2FP)
apart; writes OUTDIR/fp8_widen_static.json. On Triton 3.6 / sm_90, per weight: cvt_bf16 1.5 conversions (one
F2FP.F16.E4M3.UNPACK_B per two weights, one F2F.BF16.F16 per weight), cvt_f16_xpre 0.5, cvt_f16 1.0-1.5 (the x tile
cast adds F2FPs every trip), every bit-trick and PTX variant 0; bits_bf16_mul alone is not hoisted into the MMA
operand registers (an extra shared-memory round trip).
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import re
import statistics
import sys
import time
from typing import NamedTuple

import torch

if __package__ in (None, "") and __name__ == "__main__":  # `python scripts/gpu_fp8_widen.py` without PYTHONPATH=.
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from spanllm.kernels import skinny_gemm as sg  # noqa: E402

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU torch wheel comes without Triton
    triton = None
    tl = None

LAYERS = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}  # (N, K), 8B TP1
MS = (1, 4, 16)
TOL = 2e-2  # max |y - ref| / max |ref|: bf16 output rounding is ~4e-3; far above means a wrong kernel

# The bit patterns (constants shared by the Triton helpers, the inline PTX and the CPU tests' emulation of the PTX).
BF16_BITS_MASK = 0x87F0  # sign-extended e4m3 byte << 4: sign at bit 15, exponent+mantissa at bits 10..4
BF16_BITS_SHIFT = 4
BF16_BIAS_FIX = 2.0**120  # bf16 bits above = value * 2^-120 (exponent bias 127 vs 7)
BF16_2_120 = 0x7B80  # 2^120 as a bf16 bit pattern: exponent 127 + 120 = 247, mantissa 0
F16_BITS_MASK = 0xBF80  # sign-extended e4m3 byte << 7: sign at bit 15, exponent+mantissa at bits 13..7
F16_BITS_SHIFT = 7
F16_BIAS_FIX = 2.0**8  # fp16 bits above = value * 2^-8 (exponent bias 15 vs 7)
# prmt selectors, 4 bytes e0..e3 in -> [sext(e1) e1 sext(e0) e0] and [sext(e3) e3 sext(e2) e2]: selector nibble i
# picks result byte i, index 0-3 from the input, 8 + index replicates that byte's sign bit (PTX ISA, prmt).
PRMT_LO = 0x9180
PRMT_HI = 0xB3A2


def _i16(v: int) -> int:
    """A 16-bit pattern as the int16 constant Triton's integer ops take."""
    return v - 0x10000 if v >= 0x8000 else v


def _asm_bf16(mul: bool) -> str:
    """4 e4m3 bytes ($2) -> 2 bf16x2 registers ($0: elements 0, 1; $1: elements 2, 3), value * 2^-120 (mul=False)
    or the exact value (mul=True)."""
    mask = f"0x{BF16_BITS_MASK:04X}{BF16_BITS_MASK:04X}"
    body = [
        "{",
        ".reg .b32 t0, t1, c;",
        f"prmt.b32 t0, $2, 0, 0x{PRMT_LO:04X};",
        f"prmt.b32 t1, $2, 0, 0x{PRMT_HI:04X};",
        f"shl.b32 t0, t0, {BF16_BITS_SHIFT};",
        f"shl.b32 t1, t1, {BF16_BITS_SHIFT};",
    ]
    if mul:
        body += [
            f"and.b32 t0, t0, {mask};",
            f"and.b32 t1, t1, {mask};",
            f"mov.b32 c, 0x{BF16_2_120:04X}{BF16_2_120:04X};",
            "mul.rn.bf16x2 $0, t0, c;",
            "mul.rn.bf16x2 $1, t1, c;",
        ]
    else:
        body += [f"and.b32 $0, t0, {mask};", f"and.b32 $1, t1, {mask};"]
    return "\n".join(body + ["}"])


ASM_BF16_MUL = _asm_bf16(True)
ASM_BF16_FOLD = _asm_bf16(False)

# WIDEN modes of _w8a16_kernel
CVT_BF16, CVT_F16, BITS_BF16_MUL, BITS_BF16_FOLD, BITS_F16_FOLD, ASM_BF16_MUL_MODE, ASM_BF16_FOLD_MODE = range(7)


class Variant(NamedTuple):
    name: str
    widen: int | None  # WIDEN mode; None: the production skinny_linear
    x_fp16: bool  # x cast to fp16 before the launch (outside the timed graph)
    scale_factor: float  # the per-row scale passed is scale * this (an exponent bias folded in)
    interpretable: bool  # runs under TRITON_INTERPRET=1 (no inline asm)
    exact: bool  # same products as the baseline (bit-identical output for x in fp16's normal range)
    what: str


VARIANTS = [
    Variant("baseline", None, False, 1.0, True, True, "production skinny_linear: w.to(bf16)"),
    Variant("cvt_bf16", CVT_BF16, False, 1.0, True, True, "this file's copy, w.to(bf16) (control)"),
    Variant("cvt_f16", CVT_F16, False, 1.0, True, True, "w.to(fp16), x tile cast to fp16 in the loop, fp16 MMA"),
    Variant("cvt_f16_xpre", CVT_F16, True, 1.0, True, True, "w.to(fp16), x cast to fp16 before the launch"),
    Variant("bits_bf16_mul", BITS_BF16_MUL, False, 1.0, True, True, "int ops -> bf16 bits (w*2^-120), *2^120 in bf16"),
    Variant(
        "bits_bf16_fold", BITS_BF16_FOLD, False, BF16_BIAS_FIX, True, False, "int ops -> bf16 bits, 2^120 in scale"
    ),
    Variant(
        "bits_f16_fold_xpre",
        BITS_F16_FOLD,
        True,
        F16_BIAS_FIX,
        True,
        True,
        "int ops -> fp16 bits, 2^8 in scale, x fp16",
    ),
    Variant("asm_bf16_mul", ASM_BF16_MUL_MODE, False, 1.0, False, True, "PTX prmt/shl/and + mul.rn.bf16x2 2^120"),
    Variant(
        "asm_bf16_fold", ASM_BF16_FOLD_MODE, False, BF16_BIAS_FIX, False, False, "PTX prmt/shl/and, 2^120 in scale"
    ),
]
VARIANT_BY_NAME = {v.name: v for v in VARIANTS}

if triton is not None:
    _ASM_BF16_MUL = tl.constexpr(ASM_BF16_MUL)
    _ASM_BF16_FOLD = tl.constexpr(ASM_BF16_FOLD)
    _BF16_MASK = tl.constexpr(_i16(BF16_BITS_MASK))
    _BF16_SHIFT = tl.constexpr(BF16_BITS_SHIFT)
    _BF16_2_120 = tl.constexpr(BF16_2_120)
    _F16_MASK = tl.constexpr(_i16(F16_BITS_MASK))
    _F16_SHIFT = tl.constexpr(F16_BITS_SHIFT)

    # Fixing the exponent bias of the bf16 bit trick (value * 2^-120): multiply the tile by 2^120 in bf16 (exact, and
    # the accumulator sees the true products), or fold 2^120 into the row scale (one instruction fewer per pair of
    # weights, Marlin's choice). The fold is not safe in bf16: the MMA then accumulates x * w * 2^-120, so every
    # product with |x * w| < 2^-6 is an fp32 subnormal (and e4m3 denormal weights are bf16 subnormal operands) that
    # the tensor cores may flush; the fp16 trick's 2^-8 keeps every product normal, so its fold is safe.

    @triton.jit
    def _widen_cvt_bf16(w):
        """int8 bytes -> e4m3 -> bf16: what production's w.to(x.dtype) compiles to."""
        return w.to(tl.float8e4nv, bitcast=True).to(tl.bfloat16)

    @triton.jit
    def _widen_cvt_f16(w):
        """int8 bytes -> e4m3 -> fp16 (cvt.rn.f16x2.e4m3x2 on sm_89+)."""
        return w.to(tl.float8e4nv, bitcast=True).to(tl.float16)

    @triton.jit
    def _widen_bits_bf16(w):
        """int8 bytes -> bf16 holding value * 2^-120: sign-extend, shift the 7 exponent+mantissa bits under bf16's
        exponent's low 4 bits and mantissa's top 3, keep the sign at bit 15. Exact for every finite code."""
        return ((w.to(tl.int16) << _BF16_SHIFT) & _BF16_MASK).to(tl.bfloat16, bitcast=True)

    @triton.jit
    def _times_2_120(w):
        """bf16 * 2^120 in bf16 (exact: w holds an e4m3 value * 2^-120; bf16 subnormals are kept)."""
        two_120 = tl.full(w.shape, _BF16_2_120, tl.int16).to(tl.bfloat16, bitcast=True)
        return w * two_120

    @triton.jit
    def _widen_bits_f16(w):
        """int8 bytes -> fp16 holding value * 2^-8 (e4m3 denormals on fp16 subnormals)."""
        return ((w.to(tl.int16) << _F16_SHIFT) & _F16_MASK).to(tl.float16, bitcast=True)

    @triton.jit
    def _widen_asm_bf16_mul(w):
        return tl.inline_asm_elementwise(
            _ASM_BF16_MUL, "=r,=r,r", [w], dtype=tl.bfloat16, is_pure=True, pack=4
        )  # 4 bytes per asm: 2 prmt, 2 shl, 2 and, 2 mul.rn.bf16x2

    @triton.jit
    def _widen_asm_bf16_fold(w):
        return tl.inline_asm_elementwise(_ASM_BF16_FOLD, "=r,=r,r", [w], dtype=tl.bfloat16, is_pure=True, pack=4)

    @triton.jit
    def _widen(w, WIDEN: tl.constexpr):
        if WIDEN == 0:
            out = _widen_cvt_bf16(w)
        elif WIDEN == 1:
            out = _widen_cvt_f16(w)
        elif WIDEN == 2:
            out = _times_2_120(_widen_bits_bf16(w))
        elif WIDEN == 3:
            out = _widen_bits_bf16(w)
        elif WIDEN == 4:
            out = _widen_bits_f16(w)
        elif WIDEN == 5:
            out = _widen_asm_bf16_mul(w)
        else:
            out = _widen_asm_bf16_fold(w)
        return out

    @triton.jit(do_not_specialize=["M"])
    def _w8a16_kernel(
        x_ptr,
        w_ptr,
        y_ptr,
        ws_ptr,
        cnt_ptr,
        scale_ptr,
        M,
        N,
        K,
        k_chunk,
        stride_xm,
        stride_wn,
        stride_ym,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        SPLIT_K: tl.constexpr,
        EVEN_K: tl.constexpr,
        WIDEN: tl.constexpr,
        NUM_STAGES: tl.constexpr,
    ):
        """spanllm.kernels.skinny_gemm._skinny_gemm_kernel with HAS_SCALE (W int8 bytes of e4m3 [N, K], x bf16 or
        fp16 [M, K], y [M, N] = scale[n] * sum_k x[m, k] * w[n, k]), the widening chosen by WIDEN (`_widen`)."""
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        offs_m = tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rows = offs_n % N  # rows past N wrap onto valid rows (loaded, never stored): unmasked W loads
        offs_k = tl.arange(0, BLOCK_K)
        k_start = pid_k * k_chunk
        k_end = tl.minimum(k_start + k_chunk, K)
        w_ptrs = w_ptr + rows.to(tl.int64)[:, None] * stride_wn + (k_start + offs_k)[None, :]
        x_ptrs = x_ptr + offs_m[:, None] * stride_xm + (k_start + offs_k)[None, :]
        m_mask = offs_m[:, None] < M
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in tl.range(k_start, k_end, BLOCK_K, num_stages=NUM_STAGES):
            if EVEN_K:
                w = tl.load(w_ptrs, eviction_policy="evict_first")
                xt = tl.load(x_ptrs, mask=m_mask, other=0.0, eviction_policy="evict_last")
            else:
                k_mask = (k + offs_k) < K
                w = tl.load(w_ptrs, mask=k_mask[None, :], other=0, eviction_policy="evict_first")
                xt = tl.load(x_ptrs, mask=m_mask & k_mask[None, :], other=0.0, eviction_policy="evict_last")
            w = _widen(w, WIDEN)
            if WIDEN == 1 or WIDEN == 4:
                xt = xt.to(tl.float16)  # no-op when x is already fp16
            acc = tl.dot(xt, tl.trans(w), acc)
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
        out_mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
        y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
        row_scale = tl.load(scale_ptr + rows)[None, :]
        if SPLIT_K == 1:
            tl.store(y_ptrs, (acc * row_scale).to(y_ptr.dtype.element_ty), mask=out_mask)
        else:
            tile = offs_m[:, None] * N + offs_n[None, :]
            tl.store(ws_ptr + pid_k * M * N + tile, acc, mask=out_mask)
            tl.debug_barrier()
            arrived = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel")
            if arrived == SPLIT_K - 1:
                total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                for s in tl.static_range(SPLIT_K):
                    total += tl.load(ws_ptr + s * M * N + tile, mask=out_mask, other=0.0, cache_modifier=".cg")
                tl.store(y_ptrs, (total * row_scale).to(y_ptr.dtype.element_ty), mask=out_mask)
                tl.atomic_xchg(cnt_ptr + pid_n, 0)


class Prepared(NamedTuple):
    """One weight as every variant takes it."""

    q: torch.Tensor  # float8_e4m3fn [N, K] (baseline)
    q_i8: torch.Tensor  # the same bytes as int8 (the variants)
    scale: torch.Tensor  # float32 [N]
    scales: dict  # scale_factor -> scale * scale_factor (the folds, computed once as at weight load)


def prepare(q: torch.Tensor, scale: torch.Tensor) -> Prepared:
    factors = {v.scale_factor for v in VARIANTS}
    return Prepared(q, q.view(torch.int8), scale, {f: (scale * f).contiguous() for f in factors})


def run_variant(v: Variant, x: torch.Tensor, w: Prepared, config: tuple | None = None, x16: torch.Tensor | None = None):
    """y [M, N] bf16 for x [M, K] (bf16) and one prepared weight; `x16`: x already in fp16 (x_fp16 variants).
    config: (BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages), else the production choice for the shape.
    Returns (y, the compiled kernel or None)."""
    if v.widen is None:
        return sg.skinny_linear(x, w.q, config=config, weight_scale=w.scale), None
    m, k = x.shape
    n = w.q.shape[0]
    cfg = sg._check_config(config) if config is not None else production_config(m, n, k, x.device)
    xin = (x16 if x16 is not None else x.to(torch.float16)) if v.x_fp16 else x
    split = sg.effective_split_k(k, cfg.block_k, cfg.split_k)
    chunk = sg.split_k_chunk(k, cfg.block_k, split)
    n_tiles = triton.cdiv(n, cfg.block_n)
    y = torch.empty((m, n), dtype=torch.bfloat16, device=x.device)
    ws, counters = sg.split_k_buffers(y, split, n_tiles)
    compiled = _w8a16_kernel[(n_tiles, split)](
        xin,
        w.q_i8,
        y,
        ws,
        counters,
        w.scales[v.scale_factor],
        m,
        n,
        k,
        chunk,
        xin.stride(0),
        w.q_i8.stride(0),
        n,
        BLOCK_M=sg.block_m_for(m),
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        SPLIT_K=split,
        EVEN_K=(k % cfg.block_k == 0),
        WIDEN=v.widen,
        NUM_STAGES=cfg.num_stages,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return y, compiled


def production_config(m: int, n: int, k: int, device: torch.device) -> sg.SkinnyConfig:
    """The launch config skinny_linear picks for FP8 weights (the measured table, else its heuristic)."""
    return sg.choose_config(m, n, k, sg.num_sms_of(device), 1, x_bytes=2)


def reference(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x.float() @ (q.float() * scale[:, None]).T


def max_rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def finite_codes() -> torch.Tensor:
    """The 256 e4m3 bit patterns as uint8 with the two NaNs (0x7F, 0xFF) replaced by +0 and -0: 254 finite codes."""
    c = torch.arange(256, dtype=torch.int32)
    c[0x7F] = 0x00
    c[0xFF] = 0x80
    return c.to(torch.uint8)


def codes_case(k: int, amplitude: float, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x [16, k] bf16, q [256, k] e4m3, scale ones [256], expected y [16, 256] fp32): column m < 16 of W holds the
    codes (n + 16 m) mod 256 over rows n (every finite code in every column), x row m is `amplitude` at column m,
    so y[m, n] = decode(W[n, m]) * amplitude exactly (a power of two amplitude keeps it exact in bf16)."""
    codes = finite_codes()
    q = torch.zeros(256, k, dtype=torch.uint8)
    for m in range(16):
        q[:, m] = codes[(torch.arange(256) + 16 * m) % 256]
    q = q.view(torch.float8_e4m3fn).to(device)
    x = torch.zeros(16, k, dtype=torch.bfloat16, device=device)
    x[torch.arange(16), torch.arange(16)] = amplitude
    expect = q[:, :16].float().T * amplitude
    return x, q, torch.ones(256, device=device), expect


def quantized_weight(n: int, k: int, device, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """W = randn * 0.02 (bf16) quantized per row: scale = amax / 448 (spanllm.layers.fp8.quantize_weight)."""
    from spanllm.layers.fp8 import quantize_weight

    w = (torch.randn(n, k, device=device, generator=generator) * 0.02).to(torch.bfloat16)
    return quantize_weight(w)


def cuobjdump_path() -> str | None:
    """Triton's bundled cuobjdump (disassembles a cubin on any machine), or None."""
    if triton is None:
        return None
    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    return path if os.path.exists(path) else None


_SASS_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);")


def sass_loop_mix(sass: str) -> dict | None:
    """The K loop of a disassembled kernel: the shortest backward-branch range holding an HMMA; its instruction
    count, opcode families (the mnemonic before the first '.') and the conversion-pipe instructions (F2F, F2FP:
    16 per clock per SM on sm_90, a quarter of the integer / FMA pipes). Static counts, one loop trip."""
    ins = []
    for line in sass.splitlines():
        mt = _SASS_LINE.search(line)
        if mt:
            toks = mt.group(2).split()
            if toks and toks[0].startswith("@"):
                toks = toks[1:]
            if toks:
                ins.append((int(mt.group(1), 16), toks[0], toks[-1]))
    best = None
    for addr, op, last in ins:
        if op != "BRA":
            continue
        try:
            target = int(last, 16)
        except ValueError:
            continue
        if target >= addr:
            continue
        body = [o for a, o, _ in ins if target <= a <= addr]
        if any(o.startswith("HMMA") for o in body) and (best is None or len(body) < len(best)):
            best = body
    if best is None:
        return None
    fam = collections.Counter(o.split(".")[0] for o in best)
    return {
        "instructions": len(best),
        "conversions": fam["F2F"] + fam["F2FP"] + fam["I2F"] + fam["F2I"],
        "ops": dict(fam.most_common()),
    }


def kernel_loop_mix(cubin: bytes) -> dict | None:
    """sass_loop_mix of a compiled kernel's cubin (None without cuobjdump)."""
    tool = cuobjdump_path()
    if tool is None or not cubin:
        return None
    import subprocess
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True, timeout=60)
    return sass_loop_mix(out.stdout) if out.returncode == 0 else None


def compile_static(v: Variant, cfg: tuple, arch: int = 90):
    """Compile a variant's kernel for sm_<arch> without a GPU (Triton's ASTSource; x bf16 or fp16, W int8,
    pointers and N, K, strides 16-divisible as at the 8B shapes, M unspecialized, BLOCK_M 16, EVEN_K)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    cfg = sg._check_config(cfg)
    fn = _w8a16_kernel
    names = list(fn.arg_names)
    ptrs = {
        "x_ptr": "*fp16" if v.x_fp16 else "*bf16",
        "w_ptr": "*i8",
        "y_ptr": "*bf16",
        "ws_ptr": "*fp32",
        "cnt_ptr": "*i32",
        "scale_ptr": "*fp32",
    }
    const = {
        "BLOCK_M": 16,
        "BLOCK_N": cfg.block_n,
        "BLOCK_K": cfg.block_k,
        "SPLIT_K": cfg.split_k,
        "EVEN_K": True,
        "WIDEN": v.widen,
        "NUM_STAGES": cfg.num_stages,
    }
    sig = {n: ptrs.get(n, "constexpr" if n in const else "i32") for n in names}
    aligned = [*ptrs, "N", "K", "k_chunk", "stride_xm", "stride_wn", "stride_ym"]
    src = ASTSource(
        fn=fn,
        signature=sig,
        constexprs={(names.index(n),): val for n, val in const.items()},
        attrs={(names.index(n),): [["tt.divisibility", 16]] for n in aligned},
    )
    return triton.compile(
        src, target=GPUTarget("cuda", arch, 32), options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    )


def static_report(args) -> None:
    """--static: every variant's K loop (SASS instruction mix) at the layers' production configs, compiled for
    sm_<arch> on this machine (no GPU needed); writes OUTDIR/fp8_widen_static.json."""
    if triton is None:
        raise SystemExit("scripts/gpu_fp8_widen.py: needs Triton (not installed)")
    configs = []
    for m in [int(v) for v in args.ms.split(",")]:
        for layer in args.layers.split(","):
            cfg = tuple(production_config(m, *LAYERS[layer], torch.device("cpu")))
            if cfg not in configs:
                configs.append(cfg)
    doc = {"arch": args.arch, "triton": triton.__version__, "configs": configs, "loops": {}}
    print(
        f"sm_{args.arch}, triton {triton.__version__}: K loop per config (BLOCK_N, BLOCK_K, SPLIT_K, warps, stages),"
        " one trip; conv = F2F/F2FP (conversion pipe)"
    )
    for v in VARIANTS[1:]:
        for cfg in configs:
            key = f"{v.name} {list(cfg)}"
            try:
                k = compile_static(v, cfg, args.arch)
                mix = kernel_loop_mix(k.asm.get("cubin", b""))
                doc["loops"][key] = {"shared_bytes": k.metadata.shared, "loop": mix}
                w = cfg[0] * cfg[1]  # weights per loop trip per program
                top = ", ".join(f"{o} {c}" for o, c in list(mix["ops"].items())[:7]) if mix else "?"
                per = ""
                if mix:  # per weight: loop instructions x 32 threads x warps / weights of one trip
                    threads = 32 * cfg[3]
                    ins, conv = mix["instructions"] * threads / w, mix["conversions"] * threads / w
                    per = f"{ins:5.2f} instr/weight, conv {conv:4.2f}"
                print(f"  {v.name:20s} {str(list(cfg)):22s} {per}  smem {k.metadata.shared // 1024:3d} KiB  {top}")
            except Exception as e:  # noqa: BLE001 - report and go on
                doc["loops"][key] = {"failed": f"{type(e).__name__}: {e}"[:400]}
                print(f"  {v.name:20s} {str(list(cfg)):22s} failed: {type(e).__name__}: {str(e)[:200]}")
    os.makedirs(args.outdir, exist_ok=True)
    out = os.path.join(args.outdir, "fp8_widen_static.json")
    with open(out, "w") as f:
        json.dump(doc, f, indent=1)
    print("wrote", out)


# -------------------------------------------------------------------------------------------------- GPU driver


def time_graph(fn, count: int, calls: int, replays: int) -> list[float]:
    """Per-replay microseconds per call of a CUDA graph running fn(i % count) for i in range(calls)."""
    from spanllm.measure.timing import graph_us_per_call

    return graph_us_per_call(lambda i: fn(i % count), calls, replays)


def copy_bandwidth_gbps(gib: float = 1.0, reps: int = 10) -> float:
    """Device-to-device copy bandwidth (bytes read + written per second): `spanllm bench gemm`'s measurement."""
    from spanllm.commands.bench_gemm import copy_bandwidth

    return copy_bandwidth(gib, reps)["TBps_read_plus_write"] * 1e3


class Budget:
    def __init__(self, seconds: float):
        self.t0 = time.monotonic()
        self.seconds = seconds
        self.longest = 0.0

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def allows(self) -> bool:
        return self.elapsed() + self.longest < self.seconds

    def step(self, started: float) -> None:
        self.longest = max(self.longest, time.monotonic() - started)


def codes_check(v: Variant, device, config: tuple) -> dict:
    """All finite codes through the variant's kernel, x amplitude 1 and 2^-20 (`codes_case`)."""
    out = {}
    k = 4096  # K of the qkv / o / gate_up layers: the same compiled kernel as the layers' runs with `config`
    for label, amp in (("x1", 1.0), ("x2^-20", 2.0**-20)):
        x, q, scale, expect = codes_case(k, amp, device)
        y, _ = run_variant(v, x, prepare(q, scale), config=config)
        y = y.float()
        bad = (y != expect).nonzero().tolist()
        codes = finite_codes()
        examples = []
        for m, n in bad[:12]:
            code = int(codes[(n + 16 * m) % 256])
            examples.append({"code": f"0x{code:02X}", "expect": expect[m, n].item(), "got": y[m, n].item()})
        out[label] = {"mismatches": len(bad), "of": y.numel(), "examples": examples}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("outdir")
    ap.add_argument("--budget-s", type=float, default=90.0, help="start no measurement that would end after this")
    ap.add_argument("--ms", default=",".join(map(str, MS)))
    ap.add_argument("--layers", default=",".join(LAYERS))
    ap.add_argument("--variants", default=",".join(v.name for v in VARIANTS))
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--min-calls", type=int, default=20, help="calls per CUDA graph (at least)")
    ap.add_argument("--static", action="store_true", help="no GPU: compile for --arch, print each K loop's SASS mix")
    ap.add_argument("--arch", type=int, default=90, help="--static: the sm_ version to compile for")
    args = ap.parse_args()
    if args.static:
        static_report(args)
        return
    if triton is None:
        raise SystemExit("scripts/gpu_fp8_widen.py: needs Triton (not installed)")
    if not torch.cuda.is_available():
        raise SystemExit(
            "scripts/gpu_fp8_widen.py: needs a CUDA GPU (e4m3 weights, compute capability 8.9+); none found"
        )
    if torch.cuda.get_device_capability() < (8, 9):
        raise SystemExit(f"scripts/gpu_fp8_widen.py: {torch.cuda.get_device_name()} has no e4m3 support (need sm_89+)")
    unknown = [n for n in args.variants.split(",") if n not in VARIANT_BY_NAME]
    if unknown:
        raise SystemExit(f"scripts/gpu_fp8_widen.py: unknown variants {unknown}; known: {list(VARIANT_BY_NAME)}")
    names = ["baseline"] + [n for n in args.variants.split(",") if n != "baseline"]
    variants = [VARIANT_BY_NAME[n] for n in names]
    run_gpu(args, variants)


def run_gpu(args, variants: list[Variant]) -> None:
    ms = [int(v) for v in args.ms.split(",")]
    layers = args.layers.split(",")
    budget = Budget(args.budget_s)
    device = torch.device("cuda")
    os.makedirs(os.path.join(args.outdir, "ptx"), exist_ok=True)
    out_path = os.path.join(args.outdir, "fp8_widen.json")
    props = torch.cuda.get_device_properties(0)
    l2 = getattr(props, "L2_cache_size", 50 << 20)
    try:
        from spanllm.measure.report import versions

        vers = versions()
    except Exception as e:  # noqa: BLE001 - versions are nice to have
        vers = {"torch": torch.__version__, "triton": triton.__version__, "error": repr(e)}
    doc = {
        "machine": {
            "gpu": torch.cuda.get_device_name(0),
            "capability": list(torch.cuda.get_device_capability(0)),
            "sms": props.multi_processor_count,
            "memory_GiB": round(props.total_memory / 2**30, 1),
            "l2_MiB": round(l2 / 2**20, 1),
        },
        "versions": vers,
        "settings": {
            "budget_s": args.budget_s,
            "ms": ms,
            "layers": {name: LAYERS[name] for name in layers},
            "replays": args.replays,
            "min_calls": args.min_calls,
            "tol": TOL,
            "x": "randn bf16",
            "w": "randn * 0.02 bf16, quantized per row (scale = amax / 448) to float8_e4m3fn",
            "timing": "CUDA graph of >= min_calls calls over >= 3x L2 of distinct weights, us per call, median",
            "skinny_gemm_table": sg.table_id(),
        },
        "variants": {v.name: v._asdict() for v in variants},
        "copy_GBps": None,
        "codes": {},
        "kernels": {},  # "variant [config]": the K loop's SASS instruction mix (sass_loop_mix), registers, spills
        "rows": [],
    }

    def save() -> None:
        doc["seconds"] = round(budget.elapsed(), 1)
        with open(out_path, "w") as f:
            json.dump(doc, f, indent=1)

    def record_kernel(v: Variant, cfg, compiled) -> None:
        key = f"{v.name} {list(cfg)}"
        if compiled is None or key in doc["kernels"]:
            return
        try:
            doc["kernels"][key] = {
                "n_regs": getattr(compiled, "n_regs", None),
                "n_spills": getattr(compiled, "n_spills", None),
                "shared_bytes": getattr(compiled.metadata, "shared", None),
                "loop": kernel_loop_mix(compiled.asm.get("cubin", b"")),
            }
            ptx_file = os.path.join(args.outdir, "ptx", f"{v.name}.ptx")
            if not os.path.exists(ptx_file):
                with open(ptx_file, "w") as f:
                    f.write(compiled.asm.get("ptx", ""))
        except Exception as e:  # noqa: BLE001 - diagnostics only
            doc["kernels"][key] = {"error": repr(e)[:300]}

    doc["copy_GBps"] = round(copy_bandwidth_gbps(), 1)
    print(
        f"{doc['machine']['gpu']}, torch {torch.__version__}, triton {triton.__version__}; "
        f"device copy {doc['copy_GBps']:.0f} GB/s (read + write)",
        flush=True,
    )

    # Every variant through all finite codes first (this compiles each variant's qkv M=1 config on the way).
    qkv_cfg = tuple(production_config(1, *LAYERS["qkv"], device))
    for v in variants:
        if not budget.allows():
            doc["codes"][v.name] = {"skipped": "budget"}
            continue
        started = time.monotonic()
        try:
            doc["codes"][v.name] = codes_check(v, device, qkv_cfg)
        except Exception as e:  # noqa: BLE001 - a compile failure of one variant must not end the run
            doc["codes"][v.name] = {"failed": f"{type(e).__name__}: {e}"[:400]}
        budget.step(started)
        c = doc["codes"][v.name]
        detail = "  ".join(f"{lab}: {r['mismatches']} mismatches" for lab, r in c.items()) if "x1" in c else str(c)
        print(f"codes {v.name:20s} {detail}", flush=True)
    save()

    weights: dict[str, tuple[list[Prepared], int]] = {}
    gen = torch.Generator(device=device).manual_seed(0)
    print(
        f"{'layer':8s} {'M':>3s} {'variant':20s} {'us':>8s} {'GB/s':>7s} {'%copy':>6s} {'speedup':>7s} {'err':>9s} "
        "identical",
        flush=True,
    )
    again = VARIANT_BY_NAME["baseline"]._replace(name="baseline_again")
    for m in ms:
        for layer in layers:
            n, k = LAYERS[layer]
            row = {"layer": layer, "n": n, "k": k, "m": m, "variants": {}}
            doc["rows"].append(row)
            if not budget.allows():
                row["skipped"] = "budget"
                print(f"{layer:8s} {m:3d} skipped (budget)", flush=True)
                continue
            if layer not in weights:
                count = max(4, math.ceil(3 * l2 / (n * k)))
                weights[layer] = ([prepare(*quantized_weight(n, k, device, gen)) for _ in range(count)], count)
            ws, count = weights[layer]
            calls = count * math.ceil(args.min_calls / count)
            cfg = production_config(m, n, k, device)
            row.update(config=list(cfg), weights_in_graph=count, calls_per_graph=calls, weight_bytes=n * k)
            x = torch.randn(m, k, device=device, generator=gen).to(torch.bfloat16)
            x16 = x.to(torch.float16)
            ref = reference(x, ws[0].q, ws[0].scale)
            y_base = None
            for v in variants + [again]:
                if v is again and "median_us" not in row["variants"].get("baseline", {}):
                    continue
                if not budget.allows():
                    row["variants"][v.name] = {"skipped": "budget"}
                    continue
                started = time.monotonic()
                r = row["variants"][v.name] = {}
                try:
                    y, compiled = run_variant(v, x, ws[0], x16=x16)
                    record_kernel(v, cfg, compiled)
                    r["err"] = max_rel_err(y, ref)
                    if y_base is None:
                        y_base = y
                    r["identical_to_baseline"] = bool(torch.equal(y, y_base))
                    if not r["err"] < TOL:
                        r["failed"] = f"max rel error {r['err']:.3g} >= {TOL}"
                    else:
                        fn = lambda i, v=v, x=x, ws=ws, x16=x16: run_variant(v, x, ws[i], x16=x16)
                        us = time_graph(fn, count, calls, args.replays)
                        med = statistics.median(us)
                        r.update(us=[round(t, 3) for t in us], median_us=round(med, 3))
                        r["GBps"] = round(n * k / med / 1e3, 1)
                except Exception as e:  # noqa: BLE001 - compile failure, out of resources: record, go on
                    r["failed"] = f"{type(e).__name__}: {e}"[:400]
                budget.step(started)
                print(table_line(layer, m, v.name, r, row, doc["copy_GBps"]), flush=True)
                save()
            skipped = [name for name, r in row["variants"].items() if "skipped" in r]
            if skipped:
                print(f"{layer:8s} {m:3d} skipped (budget): {', '.join(skipped)}", flush=True)
            torch.cuda.empty_cache()
    save()
    print_summary(doc)
    print("wrote", out_path, flush=True)


def table_line(layer: str, m: int, name: str, r: dict, row: dict, copy_gbps: float) -> str:
    head = f"{layer:8s} {m:3d} {name:20s}"
    if "median_us" not in r:
        return f"{head} {r.get('failed') or r.get('skipped') or '?'}"
    base = row["variants"].get("baseline", {}).get("median_us")
    speed = f"{base / r['median_us']:6.2f}x" if base else "      -"
    pct = 100 * r["GBps"] / copy_gbps if copy_gbps else float("nan")
    ident = "yes" if r.get("identical_to_baseline") else "no"
    return f"{head} {r['median_us']:8.2f} {r['GBps']:7.0f} {pct:5.0f}% {speed} {r['err']:9.2e} {ident}"


def print_summary(doc: dict) -> None:
    """Per variant: geometric mean speedup over the baseline across the (layer, M) it completed."""
    print("\nsummary: speedup over baseline (geometric mean over the completed layer x M), codes mismatches")
    names = list(doc["variants"])
    for name in names:
        ratios = []
        for row in doc["rows"]:
            base = row["variants"].get("baseline", {}).get("median_us")
            t = row["variants"].get(name, {}).get("median_us")
            if base and t:
                ratios.append(base / t)
        gm = math.exp(sum(map(math.log, ratios)) / len(ratios)) if ratios else float("nan")
        c = doc["codes"].get(name, {})
        codes = ", ".join(f"{k} {c[k]['mismatches']}" for k in ("x1", "x2^-20") if k in c) or str(c)[:60]
        print(f"  {name:20s} x{gm:5.2f} over {len(ratios):2d}   codes: {codes}")


if __name__ == "__main__":
    main()
