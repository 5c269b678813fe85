"""Fused elementwise kernels for the serving engine's forward on GPU (Triton): residual add + RMSNorm in one
pass, and SiLU(gate) * up in one pass. Each replaces 4-5 small kernels per call; a decode step of a
32-layer model runs 3 of these per layer, so the launches saved are ~300 per step.

Rounding matches the unfused code (spanllm.layers.norm.RMSNorm, HF Llama): the residual sum is rounded to
the model dtype before the norm reads it; the norm is computed in float32, rounded, then multiplied by the
weight (a product in float32 rounded once, as a bf16 x bf16 product is). Only the order of the mean's
float32 additions can differ from F.rms_norm's.

With quantize=True (the next GEMM is FP8 W8A8, spanllm.layers.fp8) both also quantize their output per token to
float8_e4m3fn and return an Fp8Activation (spanllm.kernels.fp8_quant) instead: the output in the model dtype is
never stored, and the quantization pass that would read it back is saved. The values equal those of the unfused
chain (the output rounded to the model dtype, then quantized) bit for bit.

The torch fallbacks (`*_reference`) are the same math; the model uses them on CPU.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU wheel: the references only
    triton = None

from spanllm.kernels import interpreter
from spanllm.kernels.fp8_quant import FP8_DTYPE, Fp8Activation
from spanllm.kernels.pdl import launch_options

if triton is not None:
    from spanllm.kernels.fp8_quant import fp8_quantize, fp8_scale
    from spanllm.kernels.pdl import wait_then_release

    @triton.jit
    def _add_rms_norm_kernel(
        x_ptr,
        res_ptr,
        w_ptr,
        out_ptr,
        res_out_ptr,
        scale_ptr,
        stride,
        stride_out,
        n_cols,
        eps,
        HAS_RES: tl.constexpr,
        QUANT: tl.constexpr,
        BLOCK: tl.constexpr,
        PDL: tl.constexpr,
    ):
        wait_then_release(PDL)
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        ok = cols < n_cols
        x = tl.load(x_ptr + row * stride + cols, mask=ok, other=0.0)
        if HAS_RES:
            x = x.to(tl.float32) + tl.load(res_ptr + row * stride + cols, mask=ok, other=0.0).to(tl.float32)
            x = x.to(res_out_ptr.dtype.element_ty)  # the new residual, rounded as the unfused add rounds it
            tl.store(res_out_ptr + row * stride + cols, x, mask=ok)
        xf = x.to(tl.float32)
        inv = tl.rsqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
        y = (xf * inv).to(res_out_ptr.dtype.element_ty).to(tl.float32)  # rounded to the model dtype (x's)
        w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        if QUANT:  # out is e4m3: the normed row rounded to the residual's dtype, then quantized per token
            v = (y * w).to(res_out_ptr.dtype.element_ty).to(tl.float32)
            scale = fp8_scale(tl.max(tl.abs(v), axis=0))  # masked columns are 0
            tl.store(out_ptr + row * stride_out + cols, fp8_quantize(v, scale).to(out_ptr.dtype.element_ty), mask=ok)
            tl.store(scale_ptr + row, scale)
        else:
            tl.store(out_ptr + row * stride_out + cols, (y * w).to(out_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def _silu_mul_values(row_ptr, cols, ok, n_cols):
        """SiLU(gate) * up at `cols` of one row [gate | up], in the input dtype (0 where not ok)."""
        g = tl.load(row_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        u = tl.load(row_ptr + n_cols + cols, mask=ok, other=0.0)
        act = (g / (1.0 + tl.exp(-g))).to(u.dtype)  # F.silu rounds to the input dtype, then the product
        return (act.to(tl.float32) * u.to(tl.float32)).to(u.dtype)

    @triton.jit
    def _silu_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, n_cols, BLOCK: tl.constexpr, PDL: tl.constexpr):
        wait_then_release(PDL)
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < n_cols
        tl.store(out_ptr + row * stride_o + cols, _silu_mul_values(x_ptr + row * stride_x, cols, ok, n_cols), mask=ok)

    @triton.jit
    def _silu_mul_quant_kernel(
        x_ptr, q_ptr, scale_ptr, stride_x, stride_q, n_cols, BLOCK: tl.constexpr, PDL: tl.constexpr
    ):
        """One program per row. A row of at most BLOCK columns in one pass (every load in flight at once, as the
        per-token quantization kernel); a wider one in two passes of BLOCK columns, the amax then the values (the
        second re-reads [gate | up], mostly from L2)."""
        wait_then_release(PDL)
        row = tl.program_id(0).to(tl.int64)  # rows x 2F may pass 2^31 elements
        src = x_ptr + row * stride_x
        dst = q_ptr + row * stride_q
        if n_cols <= BLOCK:
            cols = tl.arange(0, BLOCK)
            ok = cols < n_cols
            v = _silu_mul_values(src, cols, ok, n_cols).to(tl.float32)
            scale = fp8_scale(tl.max(tl.abs(v), axis=0))  # masked columns are 0
            tl.store(dst + cols, fp8_quantize(v, scale).to(q_ptr.dtype.element_ty), mask=ok)
        else:
            amax = tl.zeros([BLOCK], tl.float32)
            for c0 in range(0, n_cols, BLOCK):
                cols = c0 + tl.arange(0, BLOCK)
                amax = tl.maximum(amax, tl.abs(_silu_mul_values(src, cols, cols < n_cols, n_cols).to(tl.float32)))
            scale = fp8_scale(tl.max(amax, axis=0))
            for c0 in range(0, n_cols, BLOCK):
                cols = c0 + tl.arange(0, BLOCK)
                ok = cols < n_cols
                v = _silu_mul_values(src, cols, ok, n_cols).to(tl.float32)
                tl.store(dst + cols, fp8_quantize(v, scale).to(q_ptr.dtype.element_ty), mask=ok)
        tl.store(scale_ptr + row, scale)

    @triton.jit
    def _rope_cache_kernel(
        qkv_ptr,
        cos_ptr,
        sin_ptr,
        slot_ptr,
        q_ptr,
        k_ptr,
        v_ptr,
        stride_t,
        stride_c,
        stride_qt,
        stride_slot,
        HQ: tl.constexpr,
        HKV: tl.constexpr,
        D: tl.constexpr,
        HB: tl.constexpr,
        KV_FP8: tl.constexpr,
        PDL: tl.constexpr,
    ):
        wait_then_release(PDL)
        t = tl.program_id(0)
        hh = tl.program_id(1) * HB + tl.arange(0, HB)  # this program's heads: [0, HQ) queries, then keys, then values
        half = tl.arange(0, D // 2)
        ok = (hh < HQ + 2 * HKV)[:, None]
        src = qkv_ptr + t * stride_t + hh[:, None] * D + half[None, :]
        x1 = tl.load(src, mask=ok, other=0.0)
        x2 = tl.load(src + D // 2, mask=ok, other=0.0)
        c1 = tl.load(cos_ptr + t * stride_c + half).to(tl.float32)[None, :]
        c2 = tl.load(cos_ptr + t * stride_c + D // 2 + half).to(tl.float32)[None, :]
        s1 = tl.load(sin_ptr + t * stride_c + half).to(tl.float32)[None, :]
        s2 = tl.load(sin_ptr + t * stride_c + D // 2 + half).to(tl.float32)[None, :]
        dt = q_ptr.dtype.element_ty
        f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
        # x * cos + rotate_half(x) * sin, rounded after each op as the unfused torch code rounds. The launch turns FP
        # contraction off: with it, the compiler fused a product and the sum into one FMA (fma.rn.bf16 / .f32,
        # rounding once), and which product it fused depended on the rest of the kernel, so q differed in the last
        # bit between a model-dtype and an FP8 KV cache (found on an H100, tests/engine/test_gpu_paged.py).
        r1 = ((f1 * c1).to(dt).to(tl.float32) + (-f2 * s1).to(dt).to(tl.float32)).to(dt)
        r2 = ((f2 * c2).to(dt).to(tl.float32) + (f1 * s2).to(dt).to(tl.float32)).to(dt)
        slot = tl.load(slot_ptr + t).to(tl.int64)
        is_q = (hh < HQ)[:, None]
        is_k = ((hh >= HQ) & (hh < HQ + HKV))[:, None]
        is_v = ok & (hh >= HQ + HKV)[:, None]
        q_dst = q_ptr + t * stride_qt + hh[:, None] * D + half[None, :]
        k_dst = k_ptr + slot * stride_slot + (hh - HQ)[:, None] * D + half[None, :]
        v_dst = v_ptr + slot * stride_slot + (hh - HQ - HKV)[:, None] * D + half[None, :]
        tl.store(q_dst, r1, mask=is_q)
        tl.store(q_dst + D // 2, r2, mask=is_q)
        k1, k2, v1, v2 = r1, r2, x1, x2  # values are not rotated
        if KV_FP8:  # e4m3 with scale 1, saturated at +-448, rounded to nearest even: torch's .to(float8_e4m3fn)
            kd = k_ptr.dtype.element_ty
            k1 = tl.clamp(k1.to(tl.float32), -448.0, 448.0).to(kd)
            k2 = tl.clamp(k2.to(tl.float32), -448.0, 448.0).to(kd)
            v1 = tl.clamp(v1.to(tl.float32), -448.0, 448.0).to(kd)
            v2 = tl.clamp(v2.to(tl.float32), -448.0, 448.0).to(kd)
        tl.store(k_dst, k1, mask=is_k)
        tl.store(k_dst + D // 2, k2, mask=is_k)
        tl.store(v_dst, v1, mask=is_v)
        tl.store(v_dst + D // 2, v2, mask=is_v)


ROPE_HEADS = 16


def rope_and_cache(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    hq: int,
    hkv: int,
    d: int,
) -> torch.Tensor:
    """qkv [N, (hq + 2 hkv) d] -> rotated q [N, hq, d]; rotated k and v written to their cache slots (in the
    cache's dtype: the model's, or float8_e4m3fn). cos, sin [N, 1, d] (or [N, d]). One kernel for RoPE of q and k,
    and both cache writes."""
    n = qkv.shape[0]
    q = torch.empty(n, hq, d, device=qkv.device, dtype=qkv.dtype)
    cos2, sin2 = cos.reshape(n, d), sin.reshape(n, d)
    # Programs of ROPE_HEADS heads of one token (a [heads, d/2] tile: one program per head and token was
    # launch-bound, 0.8 TB/s on an 8192-token prefill).
    heads = hq + 2 * hkv
    _rope_cache_kernel[(n, triton.cdiv(heads, ROPE_HEADS))](
        qkv,
        cos2,
        sin2,
        slot_mapping,
        q,
        k_cache,
        v_cache,
        qkv.stride(0),
        cos2.stride(0),
        q.stride(0),
        hkv * d,
        HQ=hq,
        HKV=hkv,
        D=d,
        HB=ROPE_HEADS,
        KV_FP8=k_cache.dtype == FP8_DTYPE,
        num_warps=4,
        enable_fp_fusion=False,  # no mul + add into an FMA: each product rounds as written (see the kernel)
        **launch_options(qkv.device),
    )
    return q


def add_rms_norm_reference(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, quantize: bool = False
) -> tuple[torch.Tensor | Fp8Activation, torch.Tensor]:
    if residual is not None:
        x = x + residual
    y = F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)
    return (Fp8Activation.of(weight * y) if quantize else weight * y), x


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, quantize: bool = False
) -> tuple[torch.Tensor | Fp8Activation, torch.Tensor]:
    """(RMSNorm(x + residual) * weight, x + residual) for x [N, H] (residual None: norm of x, and x); with
    quantize, the norm as an Fp8Activation (module docstring)."""
    if not interpreter.runs_kernels(x):
        return add_rms_norm_reference(x, residual, weight, eps, quantize)
    x = x.contiguous()
    n, h = x.shape
    out = torch.empty(n, h, device=x.device, dtype=FP8_DTYPE if quantize else x.dtype)
    scale = torch.empty(n, 1, device=x.device, dtype=torch.float32) if quantize else out
    res_out = torch.empty_like(x) if residual is not None else x
    _add_rms_norm_kernel[(n,)](
        x,
        residual.contiguous() if residual is not None else x,
        weight,
        out,
        res_out,
        scale,
        x.stride(0),
        out.stride(0),
        h,
        eps,
        HAS_RES=residual is not None,
        QUANT=quantize,
        BLOCK=triton.next_power_of_2(h),
        num_warps=8 if h >= 4096 else 4,
        **launch_options(x.device),
    )
    return (Fp8Activation(out, scale, x.dtype) if quantize else out), res_out


def silu_mul_reference(gate_up: torch.Tensor, quantize: bool = False) -> torch.Tensor | Fp8Activation:
    gate, up = gate_up.chunk(2, dim=-1)
    out = F.silu(gate) * up
    return Fp8Activation.of(out) if quantize else out


# The quantizing SiLU kernel takes a row of up to this many columns in one pass (the 8B's 14,336 at TP = 1; the 70B's
# 28,672 in two): 16 warps hold 16,384 columns of gate and up in registers, as the per-token quantization kernel does.
SILU_QUANT_BLOCK = 16384


def silu_mul(gate_up: torch.Tensor, quantize: bool = False) -> torch.Tensor | Fp8Activation:
    """SiLU(gate) * up for gate_up [N, 2F] laid out [gate | up] -> [N, F]; with quantize, as an Fp8Activation
    (module docstring)."""
    if not interpreter.runs_kernels(gate_up):
        return silu_mul_reference(gate_up, quantize)
    n, f2 = gate_up.shape
    f = f2 // 2
    if gate_up.stride(1) != 1:
        gate_up = gate_up.contiguous()
    if quantize:
        q = torch.empty(n, f, device=gate_up.device, dtype=FP8_DTYPE)
        scale = torch.empty(n, 1, device=gate_up.device, dtype=torch.float32)
        if n:
            _silu_mul_quant_kernel[(n,)](
                gate_up,
                q,
                scale,
                gate_up.stride(0),
                q.stride(0),
                f,
                BLOCK=min(SILU_QUANT_BLOCK, triton.next_power_of_2(f)),
                num_warps=16 if f > 4096 else 4,
                **launch_options(gate_up.device),
            )
        return Fp8Activation(q, scale, gate_up.dtype)
    out = torch.empty(n, f, device=gate_up.device, dtype=gate_up.dtype)
    block = 1024
    _silu_mul_kernel[(n, triton.cdiv(f, block))](
        gate_up, out, gate_up.stride(0), out.stride(0), f, BLOCK=block, num_warps=4, **launch_options(gate_up.device)
    )
    return out
