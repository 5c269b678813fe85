"""FP8 activation quantization fused into the kernels that produce a W8A8 GEMM's input (spanllm.kernels.fused_ops
quantize=True, spanllm.layers.fp8): residual add + RMSNorm before qkv and gate_up, SiLU(gate) * up before down.

- On from fp8.FUSED_QUANT_MIN_ROWS rows (32: an H100 measured the fused chain faster from there); the tests set it.
- On CPU, the model with the fused path equals the model with every norm and SiLU output left in the model dtype
  and quantized by the GEMM itself, bit for bit, and the fused path is taken exactly where the rule says.
- Under Triton's interpreter (a child pytest, as test_paged_kernels_interpreter.py), the fused kernels equal the
  unfused chain (the kernel's output in the model dtype, then the per-token quantization kernel) bit for bit:
  the interpreter's float8 rounding differs from the GPU's, but both sides use the same one. On a GPU the same
  equality, and against the torch reference (tests/engine/test_fp8.py).
"""

from __future__ import annotations

import os

import pytest
import torch
from triton_interpreter import interpreted_module, run_child_suite

from spanllm.engine.config import EngineConfig
from spanllm.engine.llm import LLM
from spanllm.engine.sampler import SamplingParams
from spanllm.kernels import fp8_gemm
from spanllm.kernels.fp8_quant import Fp8Activation, quantize_per_token_reference
from spanllm.layers import fp8
from spanllm.layers.linear import _Linear

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
CPU = torch.device("cpu")
REAL_GEMM = _Linear.gemm


def test_fp8_activation_dequantizes_as_the_gemm_sees_it():
    x = torch.tensor([[1.0, -7.0, 2.0], [0.0, 0.0, 0.0]], dtype=torch.bfloat16)
    a = Fp8Activation.of(x)
    q, s = quantize_per_token_reference(x)
    assert torch.equal(a.q.view(torch.uint8), q.view(torch.uint8)) and torch.equal(a.scale, s)
    assert a.dtype == torch.bfloat16 and a.shape == (2, 3)
    assert torch.equal(a.dequantized(), (q.float() * s).to(torch.bfloat16))


def test_on_from_the_measured_rows_and_named_in_the_description(monkeypatch):
    assert fp8.FUSED_QUANT_MIN_ROWS == 32  # results/h100/fp8/fused_quant/fused_quant.json: faster from M = 32
    assert "x quantized by the norm / SiLU kernel that produces it from 32 rows" in fp8.describe_dispatch()
    gate_up = (28672, 4096)  # W8A8 from 17 rows in the committed tables
    assert fp8.producer_quantizes(10_000, 4096, 4096) and fp8.producer_quantizes(32, *gate_up)
    assert not fp8.producer_quantizes(31, *gate_up)  # W8A8 below the crossover: the separate pass
    assert not fp8.producer_quantizes(16, *gate_up)  # W8A16: no activation quantization at all
    # 4096 x 4096 at 32 rows: the W8A8 table (spanllm/kernels/fp8_gemm_configs.json) timed its Triton kernel at 10.84 us
    # and W8A16 at 13.45 us in one run, so W8A8 runs there (the skinny GEMM's own table alone said W8A16)
    assert fp8_gemm.times(32, 4096, 4096).w8a16_us == 13.45 and fp8.producer_quantizes(32, 4096, 4096)
    monkeypatch.setattr(fp8, "FUSED_QUANT_MIN_ROWS", None)
    assert "x quantized by a separate pass" in fp8.describe_dispatch()
    assert not fp8.producer_quantizes(10_000, 4096, 4096)


def _generate(monkeypatch, fused: bool, spy: list):
    """Greedy tokens and logits of the tiny FP8 model (prefill steps of up to 64 rows: W8A8 past 16 rows) with the
    fused quantization on or forced off; spy collects (layer, rows, quantized input?) of every GEMM."""

    def gemm(self, x):
        spy.append((self.weight.shape, x.shape[0], isinstance(x, Fp8Activation)))
        return REAL_GEMM(self, x)

    monkeypatch.setattr(_Linear, "gemm", gemm)
    monkeypatch.setattr(fp8, "FUSED_QUANT_MIN_ROWS", 17 if fused else None)
    llm = LLM(
        "tiny",
        EngineConfig(dtype=torch.float32, quantization="fp8", max_num_seqs=4, max_num_batched_tokens=64),
        device=CPU,
    )
    try:
        prompts = [[1, 5, 17, 42, 8, 90, 3, 61] * 5, [1, 7, 7, 20] * 3, [2, 9] * 8]
        out = llm.generate_batch(prompts, SamplingParams(max_tokens=6, ignore_eos=True), keep_logits=True)
        return out.token_ids, out.logits
    finally:
        llm.close()


def test_fused_quantization_changes_nothing_and_runs_where_the_rule_says(monkeypatch):
    """With the crossover at 17 rows (the smallest W8A8 GEMM)."""
    fused_spy, plain_spy = [], []
    tokens, logits = _generate(monkeypatch, True, fused_spy)
    tokens2, logits2 = _generate(monkeypatch, False, plain_spy)
    assert tokens == tokens2 and torch.equal(logits, logits2)
    # Prefill steps (past 16 rows): qkv, gate_up and down take an Fp8Activation from the kernel before them, o (fed
    # by the attention) quantizes its input itself. Decode steps (<= 16 rows: W8A16) never quantize.
    layers = 4  # the tiny preset's
    prefill = [quantized for _, rows, quantized in fused_spy if rows > 16]
    assert prefill and len(prefill) % (4 * layers) == 0
    assert prefill == [True, False, True, True] * (len(prefill) // 4)
    decode = [quantized for _, rows, quantized in fused_spy if rows <= 16]
    assert decode and not any(decode)
    assert not any(q for _, _, q in plain_spy)


def test_a_bf16_layer_refuses_a_quantized_input():
    llm = LLM("tiny", EngineConfig(dtype=torch.float32, max_num_seqs=2, max_num_batched_tokens=64), device=CPU)
    layer = next(iter(llm.model.model.layers.values())).self_attn.qkv_proj
    assert not layer.quantizes_input(1000)
    with pytest.raises(TypeError, match="an Fp8Activation reached a linear layer whose weight is not FP8"):
        layer.gemm(Fp8Activation.of(torch.ones(2, layer.weight.shape[1])))


# --- the kernels under Triton's interpreter: fused == unfused, bit for bit -------------------------------------


@pytest.fixture
def ops(monkeypatch):
    interpreted_module(monkeypatch, "spanllm.kernels.fp8_quant")
    return interpreted_module(monkeypatch, "spanllm.kernels.fused_ops")


def _same_fp8(a: Fp8Activation, q: torch.Tensor, s: torch.Tensor) -> None:
    assert a.q.dtype == torch.float8_e4m3fn and a.scale.shape == s.shape
    assert torch.equal(a.q.view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(a.scale, s)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("h", [100, 256])
@pytest.mark.parametrize("with_residual", [True, False])
def test_norm_quant_kernel_equals_norm_then_quantize(ops, h, with_residual, dtype):
    from spanllm.kernels.fp8_quant import quantize_per_token

    g = torch.Generator().manual_seed(h)
    x = (torch.randn(5, h, generator=g) * 3).to(dtype)
    x[2] = 0.0  # a row of zeros (scale MIN_SCALE) when there is no residual
    res = torch.randn(5, h, generator=g).to(dtype) if with_residual else None
    w = torch.randn(h, generator=g).to(dtype)
    fused, res_fused = ops.add_rms_norm(x, res, w, 1e-5, quantize=True)
    plain, res_plain = ops.add_rms_norm(x, res, w, 1e-5)
    assert torch.equal(res_fused, res_plain)
    _same_fp8(fused, *quantize_per_token(plain))
    assert fused.dtype == dtype
    # and the unfused kernel is the torch reference (the rounding the fused one reproduces)
    ref, _ = ops.add_rms_norm_reference(x, res, w, 1e-5)
    tol = 1e-6 if dtype == torch.float32 else 2e-2  # bf16: a few of its ulps (the interpreter's exp, sums)
    torch.testing.assert_close(plain, ref, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# one pass (f <= the block); two passes of 1024 columns over 3000 (the third tile masked), as a 70B row takes
@pytest.mark.parametrize("f,block", [(100, None), (3000, None), (3000, 1024)])
def test_silu_quant_kernel_equals_silu_then_quantize(ops, monkeypatch, f, block, dtype):
    from spanllm.kernels.fp8_quant import quantize_per_token

    if block is not None:
        monkeypatch.setattr(ops, "SILU_QUANT_BLOCK", block)
    g = torch.Generator().manual_seed(f)
    gate_up = (torch.randn(4, 2 * f, generator=g) * 4).to(dtype)
    gate_up[1] = 0.0
    fused = ops.silu_mul(gate_up, quantize=True)
    plain = ops.silu_mul(gate_up)
    _same_fp8(fused, *quantize_per_token(plain))
    tol = 1e-6 if dtype == torch.float32 else 2e-2  # bf16: a few of its ulps (the interpreter's exp, sums)
    torch.testing.assert_close(plain, ops.silu_mul_reference(gate_up), rtol=tol, atol=tol)
    assert ops.silu_mul(gate_up[:0], quantize=True).q.shape == (0, f)


INTERPRETER_TESTS = 2 * 2 * 2 + 3 * 2


def test_interpreter_suite():
    """This file's kernel cases again in a child pytest with TRITON_INTERPRET=1: every one must pass there."""
    if INTERPRETED:
        pytest.skip("this is the child")
    pytest.importorskip("triton")
    run_child_suite(__file__, INTERPRETER_TESTS, "kernel_equals")
