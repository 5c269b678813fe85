"""FP8 (`--quantization fp8`, spanllm.layers.fp8): the quantization itself, the CPU path's GEMM rule, the engine
with FP8 weights, the flag's checks; on a GPU, the FP8 kernels against the CPU path.

Exactness on CPU: an FP8 model at <= 64 rows per GEMM is the unquantized model with every decoder linear's weight
replaced by q * scale (the dequantized values): greedy tokens equal bit for bit. Above 64 rows x is quantized per
token too; that is checked against an explicit computation.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from spanllm.engine.config import EngineConfig
from spanllm.engine.llm import LLM
from spanllm.engine.sampler import SamplingParams
from spanllm.kernels import skinny_gemm
from spanllm.kernels.fp8_quant import (
    FP8_MAX,
    MIN_SCALE,
    Fp8Activation,
    quantize_per_token,
    quantize_per_token_reference,
)
from spanllm.layers import fp8
from spanllm.layers.linear import _Linear

CPU = torch.device("cpu")


def test_quantize_weight_per_channel():
    w = torch.tensor([[1.0, -2.0, 0.5, 4.0], [0.0, 0.0, 0.0, 0.0], [-448.0, 3.0, 1.0, 2.0]])
    q, scale = fp8.quantize_weight(w)
    assert q.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32
    four_over_448 = torch.tensor(4.0, dtype=torch.float32) / FP8_MAX
    assert scale.tolist() == [four_over_448.item(), 1.0, 1.0]  # amax / 448; an all-zero row keeps scale 1
    assert q[0].float().abs().max().item() == FP8_MAX  # the row's largest value maps to 448 exactly
    assert q[1].float().tolist() == [0.0, 0.0, 0.0, 0.0]
    assert q[2].float().tolist() == [-448.0, 3.0, 1.0, 2.0]  # already e4m3 values, scale 1: exact
    # every value within e4m3's rounding (3 mantissa bits: half an ulp is 2^-4 relative)
    back = fp8.dequantize_weight(q, scale, torch.float32)
    assert ((back - w).abs() <= w.abs() * 2.0**-4 + 1e-7).all()


def test_quantize_per_token_reference():
    x = torch.tensor([[1.0, -7.0, 2.0], [0.0, 0.0, 0.0], [448.0, 224.0, -112.0]])
    q, s = quantize_per_token_reference(x)
    assert s.shape == (3, 1)
    assert s[:, 0].tolist() == [torch.tensor(7.0 / 448.0).item(), MIN_SCALE_F32, 1.0]
    assert q[1].float().tolist() == [0.0, 0.0, 0.0]
    assert q[2].float().tolist() == [448.0, 224.0, -112.0]
    assert q[0].float()[1].item() == -448.0


MIN_SCALE_F32 = torch.tensor(MIN_SCALE, dtype=torch.float32).item()


def test_cpu_gemm_rule_w8a16_then_w8a8(monkeypatch):
    # The table measured W8A16 faster for this shape at 32 rows, slower at 64; nothing at 128.
    table = {(32, 48, 96, 1): (9.0, 10.0), (64, 48, 96, 1): (12.0, 11.0)}
    monkeypatch.setattr(skinny_gemm, "measured_table", lambda: ({}, table))
    skinny_gemm.fp8_weight_only.cache_clear()
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 96, generator=g)
    q, scale = fp8.quantize_weight(w)
    wd = fp8.dequantize_weight(q, scale, torch.float32)
    for rows in (1, 16, 17, 32):  # W8A16: x as it is
        x = torch.randn(rows, 96, generator=g)
        assert torch.equal(fp8.fp8_linear(x, q, scale, wd), F.linear(x, wd))
    for rows in (33, 64, 65, 128, 200):  # W8A8: x through its per-token quantization first
        x = torch.randn(rows, 96, generator=g)
        xq, xs = quantize_per_token_reference(x)
        assert torch.equal(fp8.fp8_linear(x, q, scale, wd), F.linear(xq.float() * xs, wd))
    assert not fp8.uses_activation_quant(16, 4096, 4096)  # <= 16 rows: W8A16 whatever the table says
    assert fp8.uses_activation_quant(17, 4096, 4096)  # a shape the table never measured: W8A8 past 16 rows
    assert fp8.uses_activation_quant(129, 48, 96)
    skinny_gemm.fp8_weight_only.cache_clear()
    x3 = torch.randn(2, 3, 96, generator=g)  # leading dims are rows: 6 of them
    assert torch.equal(fp8.fp8_linear(x3, q, scale, wd), F.linear(x3, wd))
    with pytest.raises(RuntimeError, match="needs the dequantized weight"):
        fp8.fp8_linear(x3, q, scale, None)


def _linears(llm):
    return [m for m in llm.model.modules() if isinstance(m, _Linear)]


def test_engine_fp8_equals_the_model_with_dequantized_weights():
    """Greedy tokens of the FP8 engine (prefill in chunks of <= 16 tokens, decode: every GEMM W8A16) equal the
    unquantized engine's whose decoder linears were given q * scale by hand; the embedding and LM head untouched."""
    prompts = [[1, 5, 17, 42, 8, 90, 3, 61] * 5, [1, 7, 7, 20]]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    engine = dict(dtype=torch.float32, max_num_seqs=8, max_num_batched_tokens=16)
    quant = LLM("tiny", EngineConfig(quantization="fp8", **engine), device=CPU)
    plain = LLM("tiny", EngineConfig(**engine), device=CPU)
    try:
        layers = _linears(quant)
        assert len(layers) == 4 * quant.config.num_layers
        for a, b in zip(layers, _linears(plain), strict=True):
            assert a.weight.dtype == torch.float8_e4m3fn and a.weight_scale.shape == (a.weight.shape[0],)
            with torch.no_grad():
                b.weight.copy_(fp8.dequantize_weight(a.weight, a.weight_scale, torch.float32))
        assert quant.model.lm_head.weight.dtype == torch.float32
        assert torch.equal(quant.model.lm_head.weight, plain.model.lm_head.weight)
        got = [list(o.output_ids) for o in quant.generate(prompts, params)]
        want = [list(o.output_ids) for o in plain.generate(prompts, params)]
        assert got == want
        assert "weights fp8 e4m3 per-channel, quantized at load (dequantized on CPU)" in quant.describe()
        assert "weights torch.float32" in plain.describe()
    finally:
        quant.close()
        plain.close()


def test_quantization_refused_when_unknown_and_layers_quantized_once():
    with pytest.raises(ValueError, match=r"quantization='int4' is not supported; use None .* \('fp8',\)"):
        EngineConfig(quantization="int4")
    layer = _Linear.__new__(_Linear)
    torch.nn.Module.__init__(layer)
    layer.weight = torch.nn.Parameter(torch.ones(16, 32), requires_grad=False)
    layer.weight_scale = None
    layer.weight_dequantized = None
    layer.quantize_fp8_()
    with pytest.raises(RuntimeError, match="FP8 already"):
        layer.quantize_fp8_()
    layer.weight, layer.weight_scale = torch.nn.Parameter(torch.ones(24, 32), requires_grad=False), None
    with pytest.raises(
        ValueError, match=r"is \[24, 32\]; FP8 GEMMs \(torch._scaled_mm\) need both sizes multiples of 16"
    ):
        layer.quantize_fp8_()


def test_every_command_that_builds_a_model_takes_quantization():
    import importlib

    from spanllm import cli

    with_model = []
    for words, module, _ in cli.COMMANDS:
        parser = cli.build_parser(words, importlib.import_module(module))
        options = parser._option_string_actions
        if "--model" in options and "--dtype" in options:  # the model-building flags (engine_args)
            with_model.append(words)
            assert options["--quantization"].choices == ("fp8",) and options["--quantization"].default is None
    assert {"generate", "serve", "bench batch", "bench study", "bench throughput"} <= set(with_model)
    parser = cli.build_parser("generate", importlib.import_module("spanllm.commands.generate"))
    assert parser.parse_args(["--model", "tiny", "--quantization", "fp8"]).quantization == "fp8"
    with pytest.raises(SystemExit):
        parser.parse_args(["--model", "tiny", "--quantization", "int8"])


# --- GPU: the FP8 kernels against the CPU path ----------------------------------------------------------------
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


@pytest.mark.gpu
@gpu
def test_gpu_quantize_per_token_equals_reference():
    g = torch.Generator(device="cuda").manual_seed(0)
    for m, k in [(1, 4096), (7, 14336), (300, 4096), (3, 100)]:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g) * 3
        x[0, :5] = 0
        q, s = quantize_per_token(x)
        rq, rs = quantize_per_token_reference(x)
        assert torch.equal(s, rs)
        assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8))
    z = torch.zeros(2, 64, device="cuda", dtype=torch.bfloat16)
    q, s = quantize_per_token(z)
    assert (s == MIN_SCALE_F32).all() and (q.float() == 0).all()


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("m", [1, 5, 16, 33, 64, 65, 128, 256, 1000])
def test_gpu_fp8_linear_matches_the_cpu_path(m):
    """The GPU's FP8 GEMM (W8A16 Triton or quantized x + torch._scaled_mm, by skinny_gemm.fp8_weight_only) against
    the CPU path on the same q, scale and x: within bf16 output rounding plus fp32 summation-order differences; and
    the W8A16 kernel itself at every row count it takes, whichever the dispatch picks."""
    g = torch.Generator(device="cuda").manual_seed(m)
    for n, k in [(6144, 4096), (4096, 14336), (1008, 1024)]:
        w = torch.randn(n, k, device="cuda", generator=g) / k**0.5
        q, scale = fp8.quantize_weight(w)
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g)
        y = fp8.fp8_linear(x, q, scale, None)
        assert y.dtype == torch.bfloat16 and y.shape == (m, n)
        ref = fp8.fp8_linear_reference(x.cpu().float(), fp8.dequantize_weight(q.cpu(), scale.cpu(), torch.float32))
        torch.testing.assert_close(y.float().cpu(), ref, rtol=1.6e-2, atol=1.6e-2 * ref.abs().max().item())
        if m <= skinny_gemm.FP8_MAX_M:
            w16 = skinny_gemm.skinny_linear(x, q, weight_scale=scale).float().cpu()
            exact = x.cpu().float() @ fp8.dequantize_weight(q.cpu(), scale.cpu(), torch.float32).T
            torch.testing.assert_close(w16, exact, rtol=1.6e-2, atol=1.6e-2 * exact.abs().max().item())


@pytest.mark.gpu
@gpu
def test_gpu_fp8_linear_in_a_cuda_graph():
    from spanllm.cuda_graph import capture_graph

    dev = torch.device("cuda", torch.cuda.current_device())
    g = torch.Generator(device="cuda").manual_seed(1)
    q, scale = fp8.quantize_weight(torch.randn(4096, 14336, device=dev, generator=g) / 100)
    for m in (8, 300):
        x = torch.randn(m, 14336, device=dev, dtype=torch.bfloat16, generator=g)
        eager = fp8.fp8_linear(x, q, scale, None)
        outs: list[torch.Tensor] = []
        graph = capture_graph(lambda: outs.append(fp8.fp8_linear(x, q, scale, None)), dev, warmup=1)  # noqa: B023
        for _ in range(5):
            outs[-1].zero_()
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(outs[-1], eager)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("m", [1, 17, 300, 4100])
def test_gpu_fused_activation_quantization_equals_the_unfused_chain(m):
    """add_rms_norm / silu_mul with quantize=True (the W8A8 GEMM's input quantized by the kernel that produces it)
    and the unfused chain (the kernel's output in bf16, then quantize_per_token), both against torch's chain (float32
    norm / SiLU rounded to bf16, then the reference quantization): the 8B's widths (hidden 4096, ffn 14336), a TP = 4
    shard's ffn (3584), the 70B's (28,672: two passes), and widths that leave a masked tail. Scales equal torch's
    everywhere and bytes almost everywhere; in about one row in a thousand the Triton norm's row (fused or not) is
    a few bf16 roundings off torch's (results/h100/fp8/fused_quant/README.md), so a few of its bytes are one e4m3
    step off: at most 1% of the rows, 1% of such a row's bytes, one step each."""
    from spanllm.kernels.fused_ops import add_rms_norm, add_rms_norm_reference, silu_mul, silu_mul_reference

    g = torch.Generator(device="cuda").manual_seed(m)
    for h in (4096, 5120, 100):
        x = torch.randn(m, h, device="cuda", dtype=torch.bfloat16, generator=g)
        res = torch.randn(m, h, device="cuda", dtype=torch.bfloat16, generator=g)
        w = torch.rand(h, device="cuda", dtype=torch.bfloat16, generator=g) + 0.5
        for r in (res, None):
            want, res_want = add_rms_norm_reference(x, r, w, 1e-5, quantize=True)
            fused, res_fused = add_rms_norm(x, r, w, 1e-5, quantize=True)
            plain, res_plain = add_rms_norm(x, r, w, 1e-5)
            assert torch.equal(res_fused, res_want) and torch.equal(res_plain, res_want)
            assert fused.dtype == torch.bfloat16
            src, _ = add_rms_norm_reference(x, r, w, 1e-5)  # torch's bf16 row, for the failure message
            _within_one_step_in_rare_rows(fused, want, src, f"norm h={h} fused")
            _within_one_step_in_rare_rows(Fp8Activation(*quantize_per_token(plain), x.dtype), want, src, f"norm h={h}")
    for f in (14336, 3584, 28672, 3000):
        if f == 28672 and m > 300:
            continue  # the widest at 4,100 rows: 470 MB of input for no new path
        gate_up = torch.randn(m, 2 * f, device="cuda", dtype=torch.bfloat16, generator=g) * 3
        want, src = silu_mul_reference(gate_up, quantize=True), silu_mul_reference(gate_up)
        _within_one_step_in_rare_rows(silu_mul(gate_up, quantize=True), want, src, f"silu f={f} fused")
        plain = Fp8Activation(*quantize_per_token(silu_mul(gate_up)), want.dtype)
        _within_one_step_in_rare_rows(plain, want, src, f"silu f={f}")


def _within_one_step_in_rare_rows(got, want, src: torch.Tensor, what: str) -> None:
    """got and want (Fp8Activation; src: torch's output in bf16, which want quantizes) have equal scales, no NaN,
    and differ in at most 1% of the rows (at least one), in at most 1% of such a row's bytes (at least one), each
    by one e4m3 step of the same sign."""
    m, k = want.q.shape
    assert torch.equal(got.scale, want.scale), what
    assert not got.q.float().isnan().any(), what  # 0x7F / 0xFF: one code past 448, NaN in e4m3fn
    a, b = got.q.view(torch.uint8).int(), want.q.view(torch.uint8).int()
    bad = a != b
    rows = bad.any(dim=1)
    detail = f"{what}: " + _fp8_mismatches(got.q, want.q, src, want.scale)
    assert int(rows.sum()) <= max(1, m // 100), detail
    assert int(bad.sum(dim=1).max()) <= max(1, k // 100), detail
    assert ((a - b).abs()[bad] == 1).all() and ((a ^ b)[bad] & 0x80 == 0).all(), detail  # adjacent codes, same sign


def _fp8_mismatches(got: torch.Tensor, want: torch.Tensor, src: torch.Tensor, scale: torch.Tensor) -> str:
    """Where two e4m3 tensors differ: count, and the first few entries with the source value, its scale and the
    quotient in float32 (torch's division), so that a GPU failure says which rounding differs."""
    bad = (got.view(torch.uint8) != want.view(torch.uint8)).nonzero().tolist()
    lines = [f"{len(bad)} of {got.numel()} bytes differ"]
    for r, c in bad[:6]:
        v, sc = src[r, c].float().item(), scale[r, 0].item()
        lines.append(
            f"[{r}, {c}] src {v!r} scale {sc!r} src/scale {torch.tensor(v) / torch.tensor(sc)!r}: "
            f"got 0x{int(got.view(torch.uint8)[r, c]):02X} ({got[r, c].float().item()}) "
            f"want 0x{int(want.view(torch.uint8)[r, c]):02X} ({want[r, c].float().item()})"
        )
    return "\n".join(lines)
