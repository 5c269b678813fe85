"""The forward's Triton kernels compiled for Hopper (sm_90) with the GPU backend's compiler and ptxas, on a machine
without a GPU (tests/kernels/hopper_compile.py): every variant this engine launches that no CPU test can compile,
the ones a GPU has not run yet first (programmatic dependent launch and the weight prefetch, the FP8 activation
quantization fused into the norm and SiLU kernels, the FP8 KV cache in every attention kernel). Each case runs the
kernels' own wrappers with launches caught, then compiles each caught launch to a cubin."""

from __future__ import annotations

import pytest
import torch
from hopper_compile import available, capture, compile_launch

pytestmark = pytest.mark.skipif(available() is not None, reason=str(available()))

BF16, FP8 = torch.bfloat16, torch.float8_e4m3fn


def _compiled(launches, expect: int) -> list:
    assert len(launches) == expect, [fn.__name__ for fn, *_ in launches]
    out = []
    for fn, args, kwargs in launches:
        k = compile_launch(fn, args, kwargs)
        assert k.asm["cubin"], fn.__name__
        out.append((fn.__name__, k))
    return out


@pytest.mark.parametrize("pdl_on", [False, True], ids=["no-pdl", "pdl"])
def test_fused_ops(monkeypatch, pdl_on):
    from spanllm.kernels import fused_ops as fo
    from spanllm.kernels.fp8_quant import quantize_per_token

    x, res, w = torch.zeros(300, 4096, dtype=BF16), torch.zeros(300, 4096, dtype=BF16), torch.ones(4096, dtype=BF16)
    qkv = torch.zeros(300, 6144, dtype=BF16)
    cos = sin = torch.zeros(300, 1, 128, dtype=BF16)
    slots = torch.zeros(300, dtype=torch.int64)
    with capture(monkeypatch, pdl_on) as launches:
        fo.add_rms_norm(x, res, w, 1e-5)
        fo.add_rms_norm(x, None, w, 1e-5, quantize=True)
        fo.add_rms_norm(x, res, w, 1e-5, quantize=True)
        fo.silu_mul(torch.zeros(300, 2 * 14336, dtype=BF16))
        fo.silu_mul(torch.zeros(300, 2 * 14336, dtype=BF16), quantize=True)  # one pass, 16 warps
        fo.silu_mul(torch.zeros(17, 2 * 28672, dtype=BF16), quantize=True)  # two passes (70B at TP 1)
        fo.silu_mul(torch.zeros(17, 2 * 3584, dtype=BF16), quantize=True)  # an 8B TP 4 shard
        for kv in (BF16, FP8):
            kc, vc = torch.zeros(64, 16, 8, 128, dtype=kv), torch.zeros(64, 16, 8, 128, dtype=kv)
            fo.rope_and_cache(qkv[:, :5120], cos, sin, slots, kc, vc, 32, 8, 128)
        quantize_per_token(x)
    kernels = _compiled(launches, 10)
    if pdl_on:  # the launch attribute reached the compiled kernel, and its PTX waits on the grid dependency
        for name, k in kernels:
            assert k.metadata.launch_pdl and "griddepcontrol.wait" in k.asm["ptx"], name


@pytest.mark.parametrize(
    "pdl_on,prefetch", [(False, 0), (True, 0), (True, 16 << 20)], ids=["no-pdl", "pdl", "pdl-prefetch"]
)
def test_skinny_gemm(monkeypatch, pdl_on, prefetch):
    """PDL off, PDL on (the default on Hopper, without the weight prefetch), PDL on with a prefetch budget; one row of
    the 8B's qkv runs the CUDA-core GEMV (its committed table), in bf16 and FP8."""
    from spanllm.kernels import gemv
    from spanllm.kernels import skinny_gemm as sg
    from spanllm.layers import fp8

    monkeypatch.setenv(sg.PREFETCH_ENV, str(prefetch))
    x = torch.zeros(1, 4096, dtype=BF16)
    w = torch.zeros(6144, 4096, dtype=BF16)
    q, scale = fp8.quantize_weight(torch.zeros(6144, 4096))
    assert gemv.takes(6144, 4096, 2) and gemv.takes(6144, 4096, 1)
    with capture(monkeypatch, pdl_on) as launches:
        sg.skinny_linear(x, w)  # one row: the GEMV
        sg.skinny_linear(x, w, config=(64, 256, 4, 4, 3))  # split-K: the last program sums
        sg.skinny_linear(x, q, weight_scale=scale)  # FP8, one row: the GEMV
        sg.skinny_linear(torch.zeros(2, 4096, dtype=BF16), q, weight_scale=scale)  # FP8 W8A16, 2 rows
        sg.skinny_linear(torch.zeros(64, 4096, dtype=BF16), q, weight_scale=scale)  # BLOCK_M 64
    kernels = _compiled(launches, 5)
    assert [name for name, _ in kernels] == ["_gemv_kernel", "_skinny_gemm_kernel", "_gemv_kernel"] + [
        "_skinny_gemm_kernel"
    ] * 2
    for (name, k), (_, _, kwargs) in zip(kernels, launches, strict=True):
        if name == "_skinny_gemm_kernel":
            assert kwargs["PREFETCH"] == (pdl_on and prefetch > 0)  # the prefetch rides on PDL only
        assert ("prefetch.global.L2" in k.asm["ptx"]) == (pdl_on and prefetch > 0 and name != "_gemv_kernel"), name
        assert ("griddepcontrol.wait" in k.asm["ptx"]) == pdl_on, name


@pytest.mark.parametrize("pdl_on", [False, True], ids=["no-pdl", "pdl"])
def test_w8a8_gemm(monkeypatch, tmp_path, pdl_on):
    """The Triton W8A8 GEMM as the engine launches it (spanllm.layers.fp8.w8a8_gemm with a table that makes it take
    the 8B's down projection at 17-64 rows): rows not a multiple of 16, two M tiles, split-K; FP8 wgmma in each."""
    import json

    from spanllm.kernels import fp8_gemm
    from spanllm.layers import fp8

    cfg = {"m_bucket": 64, "n": 4096, "k": 14336, "config": [64, 64, 128, 4, 4, 4], "kernel_us": 1.0}
    cfg |= {"scaled_mm_us": 2.0, "quant_us": 1.0, "w8a16_us": 3.0}
    (tmp_path / "t.json").write_text(json.dumps({"entries": [cfg]}))
    monkeypatch.setenv(fp8_gemm.TABLE_ENV, str(tmp_path / "t.json"))
    fp8_gemm.measured_table.cache_clear()
    try:
        w, ws = torch.zeros(4096, 14336, dtype=FP8), torch.ones(4096)
        with capture(monkeypatch, pdl_on) as launches:
            for m in (40, 64):  # the table's config (bucket 64), rows past M wrapped
                fp8.w8a8_gemm(torch.zeros(m, 14336, dtype=FP8), torch.ones(m, 1), w, ws, BF16)
            fp8_gemm.w8a8_linear(
                torch.zeros(200, 4096, dtype=FP8), torch.ones(200, 1), w[:, :4096].contiguous(), ws, BF16
            )
        kernels = _compiled(launches, 3)
    finally:
        fp8_gemm.measured_table.cache_clear()
    assert [kw["SPLIT_K"] for _, _, kw in launches] == [4, 4, 2] and launches[2][2]["BLOCK_M"] == 128
    for name, k in kernels:
        assert "wgmma.mma_async.sync.aligned" in k.asm["ptx"] and ".e4m3.e4m3" in k.asm["ptx"], name
        assert ("griddepcontrol.wait" in k.asm["ptx"]) == pdl_on, name


@pytest.mark.parametrize("kv", [BF16, FP8], ids=["bf16-cache", "fp8-cache"])
def test_attention_kernels(monkeypatch, kv):
    from spanllm.kernels import paged_attention as pa

    q = torch.zeros(4, 32, 128, dtype=BF16)
    kc, vc = torch.zeros(65, 16, 8, 128, dtype=kv), torch.zeros(65, 16, 8, 128, dtype=kv)
    tables = torch.zeros(4, 16, dtype=torch.int32)
    ctx = torch.full((4,), 250, dtype=torch.int32)
    shared = pa.SharedPrefixTensors(
        torch.zeros(1, 4, dtype=torch.int32),
        torch.zeros(3, 5, dtype=torch.int32),
        torch.zeros(4, dtype=torch.int32),
        torch.zeros(4, dtype=torch.int32),
    )
    qp = torch.zeros(96, 32, 128, dtype=BF16)
    tiles = torch.zeros(6, 2, dtype=torch.int32)
    cu_q = torch.tensor([0, 96], dtype=torch.int32)
    with capture(monkeypatch, True) as launches:
        pa.decode(q, kc, vc, tables, ctx, 1, prefetch=True)
        pa.decode(q, kc, vc, tables, ctx, 8, prefetch=False)  # split, merged in-kernel
        pa.decode(q, kc, vc, tables, ctx, 8, shared=shared)  # stage 1 + stage 2 with the prefix fold
        pa.prefill(qp, kc, vc, tables[:1], cu_q, ctx[:1], tiles)
        if kv == FP8:
            for widen in ("fp16", "bf16"):
                pa.decode(q, kc, vc, tables, ctx, 1, prefetch=False, widen=widen)
    compiled = _compiled(launches, 7 if kv == FP8 else 5)
    decodes = [k.asm["ptx"] for name, k in compiled if name == "_decode_kernel"]
    assert len(decodes) == (5 if kv == FP8 else 3)
    f16 = [kv == FP8 and pa.FP8_DECODE_WIDEN == "fp16"] * 3 + [True, False]
    for ptx, widen_f16 in zip(decodes, f16, strict=False):
        # bf16 queries: an FP8 cache widened to fp16 takes one cvt per two values and fp16 MMAs; widened to bf16, it
        # goes through fp16 and one more conversion per value; a bf16 cache is read as it is
        assert ("cvt.rn.f16x2.e4m3x2" in ptx) == (kv == FP8)
        assert ("cvt.bf16.f16" in ptx) == (kv == FP8 and not widen_f16)
        assert ("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32" in ptx) == widen_f16
        assert ("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in ptx) == (not widen_f16)
