"""Programmatic dependent launch on a Hopper GPU (spanllm.kernels.pdl) at the shapes where it can go wrong: a chain
of the forward's kernels, each reading the one before it, with split-K GEMMs and split decode attention (arrival
counters written by one launch and reset for the next), the FP8 activation quantization fused into its producers,
a cuBLAS GEMM (no PDL) in the middle, and more rows than SMs. In a CUDA graph replayed on changing inputs, and
eagerly, the outputs with PDL on equal those with PDL off bit for bit, and every counter is back at zero."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _inputs(dev):
    from spanllm.layers import fp8

    g = torch.Generator(device="cuda").manual_seed(0)

    def rnd(*shape, scale=1.0, dtype=torch.bfloat16):
        return (torch.randn(*shape, device=dev, generator=g) * scale).to(dtype)

    t = {
        "x": rnd(4, 14336),
        "res": rnd(4, 14336),
        "norm_w": rnd(14336, scale=0.1) + 1,
        "w_down": rnd(4096, 14336, scale=0.01),  # bf16 skinny GEMM, split-K forced
        "x_big": rnd(300, 5120),  # W8A8 rows, a hidden that is not a power of two
        "res_big": rnd(300, 5120),
        "norm_w_big": rnd(5120, scale=0.1) + 1,
        "gu_big": rnd(300, 2 * 3584, scale=3),  # an 8B TP = 4 shard's SiLU input
    }
    t["w_qkv"] = fp8.quantize_weight(rnd(6144, 4096, scale=0.02))  # FP8 W8A16, split-K forced
    t["w_o"] = fp8.quantize_weight(rnd(4096, 4096, scale=0.02))  # FP8 W8A8 via cuBLAS (no PDL)
    t["w_big"] = fp8.quantize_weight(rnd(1024, 5120, scale=0.02))
    t["w_down_big"] = fp8.quantize_weight(rnd(1024, 3584, scale=0.02))
    # a KV pool holding 4 sequences of 1000, 600, 64 and 1 keys (8 heads of 128, blocks of 16)
    ctx = [1000, 600, 64, 1]
    blocks = sum(-(-c // 16) for c in ctx) + 1
    t["kc"], t["vc"] = rnd(blocks, 16, 8, 128), rnd(blocks, 16, 8, 128)
    tables = torch.zeros(4, 63, dtype=torch.int32, device=dev)
    perm = torch.randperm(blocks - 1, generator=torch.Generator().manual_seed(1)).to(dev, torch.int32) + 1
    i = 0
    for r, c in enumerate(ctx):
        nb = -(-c // 16)
        tables[r, :nb] = perm[i : i + nb]
        i += nb
    t["tables"], t["ctx"] = tables, torch.tensor(ctx, dtype=torch.int32, device=dev)
    return t


def _chain(t: dict) -> list[torch.Tensor]:
    from spanllm.kernels import paged_attention
    from spanllm.kernels.fused_ops import add_rms_norm, silu_mul
    from spanllm.kernels.skinny_gemm import skinny_linear
    from spanllm.layers import fp8

    h, r = add_rms_norm(t["x"], t["res"], t["norm_w"], 1e-5)
    y = skinny_linear(h, t["w_down"], config=(64, 256, 4, 4, 3))  # 4 splits: the last to arrive sums
    z = skinny_linear(y, t["w_qkv"][0], config=(64, 256, 2, 4, 3), weight_scale=t["w_qkv"][1])
    q = z[:, :4096].reshape(4, 32, 128).contiguous()
    o = paged_attention.decode(q, t["kc"], t["vc"], t["tables"], t["ctx"], 8)  # 8 splits, merged in-kernel
    a = silu_mul(torch.cat([o.reshape(4, 4096), y], dim=1), quantize=True)
    u = fp8.fp8_linear(a, *t["w_o"], None)  # cuBLAS between PDL kernels
    n2, _ = add_rms_norm(u, y, t["norm_w"][:4096], 1e-5, quantize=True)
    big, rb = add_rms_norm(t["x_big"], t["res_big"], t["norm_w_big"], 1e-5, quantize=True)  # 300 programs
    v = fp8.fp8_linear(big, *t["w_big"], None)
    s = silu_mul(t["gu_big"], quantize=True)
    w = fp8.fp8_linear(s, *t["w_down_big"], None)
    return [h, r, y, z, o, a.q.view(torch.uint8), a.scale, u, n2.q.view(torch.uint8), n2.scale, rb, v, w]


@pytest.mark.parametrize("prefetch", [0, 16 << 20], ids=["no-prefetch", "prefetch-16MiB"])
def test_pdl_chain_equals_no_pdl_bit_for_bit_eager_and_in_graphs(monkeypatch, prefetch):
    """With the skinny GEMM's weight prefetch off (the default) and on (SPANLLM_SKINNY_PREFETCH_BYTES)."""
    from spanllm.cuda_graph import capture_graph
    from spanllm.kernels import arrival_counters, pdl
    from spanllm.kernels.skinny_gemm import PREFETCH_ENV

    monkeypatch.setenv(PREFETCH_ENV, str(prefetch))

    dev = torch.device("cuda", torch.cuda.current_device())
    if not pdl.supported(dev):
        pytest.skip("programmatic dependent launch needs compute capability >= 9.0")
    t = _inputs(dev)
    want = [x.clone() for x in _chain(t)]  # PDL off (no scope)
    with pdl.launching(True):
        got = _chain(t)
        outs: list[list[torch.Tensor]] = []
        graph = capture_graph(lambda: outs.append(_chain(t)), dev, warmup=1)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    for step in range(4):
        # new inputs in place, the reference without PDL, then the PDL graph's replay
        for name in ("x", "res", "x_big", "gu_big"):
            t[name].copy_(torch.roll(t[name], shifts=step + 1, dims=1))
        t["ctx"].copy_(torch.tensor([1000 - 7 * step, 600 + 5 * step, 64, 1 + step], dtype=torch.int32))
        want = [x.clone() for x in _chain(t)]
        graph.replay()
        torch.cuda.synchronize()
        for a, b in zip(outs[-1], want, strict=True):
            assert torch.equal(a, b)
    assert arrival_counters.all_zero(dev)
