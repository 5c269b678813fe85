"""Weight bytes per parameter (spanllm.perf.quantization) in the memory fit, the step costs and `spanllm plan`."""

import json
from dataclasses import replace
from pathlib import Path

import pytest

from spanllm.cli import main
from spanllm.perf.hardware import FP8_GEMM_SPEEDUP, FP8_GEMM_SPEEDUP_RANGE, PRESETS
from spanllm.perf.inference import Layout, Workload, estimate, layer_gemm_us, memory_per_gpu
from spanllm.perf.model_shape import get_model
from spanllm.perf.plan import best, plan
from spanllm.perf.quantization import BF16, FP8, W8A16_MAX_ROWS, QuantizationError, gemm_speedup, get_quantization

DECODE_HEAVY = Workload(16, 128, 512)


@pytest.mark.parametrize(
    "name, bf16, fp8",
    [
        # layers x (q, k, v, o, gate, up, down) at 2 / 1 byte + embedding and LM head (vocab x hidden) at 2 bytes
        ("llama3.1-8b", 16_059_990_016, 9_080_668_160),  # 32 x 218,103,808 + 2 x 525,336,576
        ("llama3.1-70b", 141_104_775_168, 72_653_733_888),  # 80 x 855,638,016 + 2 x 1,050,673,152
        ("llama3.1-405b", 811_698_487_296, 410_051_936_256),  # 126 x 3,187,671,040 + 2 x 2,101,346,304
    ],
)
def test_weight_bytes(name, bf16, fp8):
    m = get_model(name)
    assert BF16.weight_bytes(m) == bf16 and FP8.weight_bytes(m) == fp8
    # the bf16 embedding and LM head are what keeps FP8 above half
    assert FP8.weight_bytes(m) - BF16.weight_bytes(m) / 2 == 2 * m.vocab_size * m.hidden_size


def test_get_quantization():
    assert get_quantization(None) is BF16 and get_quantization("fp8") is FP8
    with pytest.raises(QuantizationError, match="'int4' is not modelled"):
        get_quantization("int4")


def test_405b_memory_per_gpu_on_one_node():
    m, layout = get_model("405b"), Layout(8, 1)
    h200, h100 = PRESETS["dgx-h200"], PRESETS["dgx-h100"]
    bf16, fp8 = memory_per_gpu(m, layout, DECODE_HEAVY, h200), memory_per_gpu(m, layout, DECODE_HEAVY, h200, FP8)
    assert bf16.weights_GB == pytest.approx(811.698487296 / 8) and fp8.weights_GB == pytest.approx(410.051936256 / 8)
    assert bf16.kv_cache_GB == fp8.kv_cache_GB and bf16.activations_GB == fp8.activations_GB  # both stay bf16
    # an H200 holds 139.8 GiB (what torch reports), 90% usable: 135.1 GB; an H100 79.18 GiB: 76.5 GB
    assert bf16.capacity_GB == pytest.approx(0.9 * 139.8 * 2**30 / 1e9) == pytest.approx(135.1, abs=0.05)
    assert memory_per_gpu(m, layout, DECODE_HEAVY, h100).capacity_GB == pytest.approx(76.5, abs=0.05)
    # bf16 fits one H200 node; one H100 node holds only FP8
    assert bf16.fits and fp8.fits and bf16.total_GB == pytest.approx(102.5, abs=0.05)
    assert not memory_per_gpu(m, layout, DECODE_HEAVY, h100).fits
    assert memory_per_gpu(m, layout, DECODE_HEAVY, h100, FP8).fits
    # prefill-heavy batch 64 (activations of 131k prompt rows): bf16 TP8 still fits an H200, at 132.5 of 135.1 GB
    big = memory_per_gpu(m, layout, Workload(64, 2048, 32), h200)
    assert big.fits and big.total_GB == pytest.approx(132.5, abs=0.05)
    assert not memory_per_gpu(m, layout, Workload(80, 2048, 32), h200).fits


def test_layer_gemm_decode_reads_half_the_bytes_prefill_runs_at_the_fp8_rate():
    m, c = get_model("8b"), PRESETS["h200x2"]
    # decode (16 rows, W8A16): weight-bound, the time follows the bytes (activations are bf16 in both); FP8's
    # bytes stream at 0.82 of bf16's rate (FP8_READ_W8A16), 0.70 past 16 rows (FP8_READ_W8A8)
    d_bf16, d_fp8 = layer_gemm_us(m, 16, 1, c), layer_gemm_us(m, 16, 1, c, quant=FP8)
    acts = 16 * 2 * (4096 + (4096 + 2 * 1024) + 4096 + 4096 + 4096 + 2 * 14336 + 14336 + 4096)
    bw = c.hbm_GBps * 1e3 * c.hbm_efficiency
    assert c.fp8_read_w8a16 == 0.82 and c.fp8_read_w8a8 == 0.70
    assert d_bf16 == pytest.approx((218_103_808 * 2 + acts) / bw)
    assert d_fp8 == pytest.approx((218_103_808 / 0.82 + acts) / bw)
    acts32 = acts * 2
    assert layer_gemm_us(m, 32, 1, c, quant=FP8) == pytest.approx((218_103_808 / 0.70 + acts32) / bw)
    ideal = replace(c, fp8_read_w8a16=1.0, fp8_read_w8a8=1.0, ranges={})  # FP8 streaming as fast as bf16
    assert layer_gemm_us(m, 16, 1, ideal, quant=FP8) == pytest.approx((218_103_808 + acts) / bw)
    # prefill (8192 rows): compute-bound, 1.55x the rate (FP8_GEMM_SPEEDUP, measured on an H100)
    p_bf16, p_fp8 = layer_gemm_us(m, 8192, 1, c), layer_gemm_us(m, 8192, 1, c, quant=FP8)
    assert c.fp8_gemm_speedup == FP8_GEMM_SPEEDUP == 1.55 and p_bf16 / p_fp8 == pytest.approx(1.55)
    no_fp8_cores = replace(c, fp8_gemm_speedup=1.0, ranges={})  # weight-only FP8 (an A100)
    assert layer_gemm_us(m, 8192, 1, no_fp8_cores, quant=FP8) == pytest.approx(p_bf16)


def test_fp8_estimate_and_plan_405b():
    m, c = get_model("405b"), PRESETS["dgx-h200"]
    b, f = (estimate(m, c, Layout(8, 1), DECODE_HEAVY, "nccl", quant=q) for q in (BF16, FP8))
    assert f.tpot_ms < b.tpot_ms and f.ttft_ms < b.ttft_ms
    h100 = PRESETS["dgx-h100"]
    assert best(plan(m, h100, 1, DECODE_HEAVY, ranges=False)) is None  # bf16 fits no layout of one H100 node
    row = best(plan(m, h100, 1, DECODE_HEAVY, ranges=False, quant=FP8))
    assert row is not None and row.layout.gpus == 8


def test_cli_quantization(tmp_path, capsys):
    argv = ["plan", "--model", "405b", "--cluster", "dgx-h100", "--nodes", "1", "--batch", "16", "--prompt", "128"]
    out = tmp_path / "plan.json"
    assert main([*argv, "--decode", "512", "--no-ranges", "--quantization", "fp8", "--json", str(out)]) == 0
    assert '"quantization": "fp8"' in out.read_text()
    capsys.readouterr()
    assert main([*argv, "--quantization", "int4"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--quantization 'int4': only fp8 is modelled" in err and len(err.splitlines()) == 1


def test_fp8_roofline_of_a_step():
    from spanllm.perf.roofline import model_costs, step_costs
    from spanllm.perf.step_cost import Step

    cfg = get_model("8b")
    layers, head = 32 * 218_103_808, 525_336_576
    assert model_costs(cfg, FP8)["weight_bytes"] == layers + 2 * head == 8_029_995_008  # LM head bf16
    bw, fl = 4e12, 800e12
    # one decode: weight-bound, about half of bf16's 15.0 GB
    c = step_costs([Step(1, 1000, (), 1)], cfg, bw, fl, FP8, 1.7)
    kv = 1000 * 2 * 2 * 8 * 128 * 32
    assert c["sequential_s"] == pytest.approx((layers + 2 * head) / bw + kv / bw)
    # a 4096-token prompt: the layers' GEMMs at 1.7x the rate, the LM head at bf16's
    c = step_costs([Step(0, 0, ((0, 4096),), 1)], cfg, bw, fl, FP8, 1.7)
    attn = 4 * 32 * 128 * 32 * (4096 * 4097 // 2)
    assert c["sequential_s"] == pytest.approx((2 * layers * 4096 / 1.7 + 2 * head) / fl + attn / fl)


def test_fp8_kv_cache_halves_the_cache_and_the_decode_reads():
    from spanllm.perf.inference import decode_attention_us

    m, c, layout = get_model("405b"), PRESETS["dgx-h200"], Layout(8, 1)
    kv8 = FP8.with_fp8_kv_cache()
    assert kv8.name == "fp8, fp8 KV cache" and kv8.linear_weight_bytes == 1 and kv8.kv_element_bytes == 1
    a, b = memory_per_gpu(m, layout, DECODE_HEAVY, c, FP8), memory_per_gpu(m, layout, DECODE_HEAVY, c, kv8)
    assert b.kv_cache_GB == pytest.approx(a.kv_cache_GB / 2) and b.weights_GB == a.weights_GB
    # 126 layers x 16 sequences x 640 positions x 2 (K, V) x 1 KV head x 128 per GPU at TP 8, bytes
    assert a.kv_cache_GB == pytest.approx(126 * 16 * 640 * 2 * 128 * 2 / 1e9)
    scan = 640 * c.engine.attn_position_ns / 1e3  # the serial scan cost does not depend on the bytes
    full, half = (decode_attention_us(m, 16, 640, 8, c, q) - scan for q in (BF16, BF16.with_fp8_kv_cache()))
    assert half == pytest.approx(full / 2)
    f, f8 = (estimate(m, c, layout, DECODE_HEAVY, "nccl", quant=q) for q in (FP8, kv8))
    assert f8.tpot_ms < f.tpot_ms


def test_cli_kv_cache_dtype(tmp_path, capsys):
    argv = ["plan", "--model", "405b", "--cluster", "dgx-h200", "--nodes", "1", "--batch", "16", "--prompt", "128"]
    out = tmp_path / "plan.json"
    assert main([*argv, "--no-ranges", "--quantization", "fp8", "--kv-cache-dtype", "fp8", "--json", str(out)]) == 0
    assert '"quantization": "fp8, fp8 KV cache"' in out.read_text()
    capsys.readouterr()
    assert main([*argv, "--serve", "--lengths", "100:10", "--kv-cache-dtype", "fp8"]) == 2
    assert "--kv-cache-dtype fp8 prices the static batch" in capsys.readouterr().err


def test_the_model_prices_w8a16_up_to_the_rows_the_engine_always_runs_it():
    from spanllm.kernels.skinny_gemm import FP8_ALWAYS_WEIGHT_ONLY_M

    assert W8A16_MAX_ROWS == FP8_ALWAYS_WEIGHT_ONLY_M == 16
    c = PRESETS["dgx-h200"]
    assert gemm_speedup(FP8, 16, c.fp8_gemm_speedup) == 1.0 and gemm_speedup(FP8, 17, c.fp8_gemm_speedup) == 1.55
    assert gemm_speedup(BF16, 8192, c.fp8_gemm_speedup) == 1.0


def test_fp8_gemm_speedup_is_the_committed_h100_measurement():
    """The constant and its range come from results/h100/fp8/fp8_gemm.json: the 8B's four layer GEMMs summed, bf16
    F.linear over FP8 as the engine runs it (quantization fused into the norm / SiLU kernels for qkv, gate_up and
    down, a pass of its own for o), at M = 256 ... 8,192."""
    doc = json.loads((Path(__file__).parents[2] / "results/h100/fp8/fp8_gemm.json").read_text())
    by_m = {}
    for r in doc["rows"]:
        if r["model"] == "8b" and r["m"] >= 256:
            by_m.setdefault(r["m"], {})[r["layer"]] = r
    ratios = []
    for m, layers in sorted(by_m.items()):
        assert sorted(layers) == ["down", "gate_up", "o", "qkv"], m
        bf16 = sum(r["bf16"]["median_us"] for r in layers.values())
        fp8 = sum(r["fp8_w8a8" if name == "o" else "fp8_scaled_mm_only"]["median_us"] for name, r in layers.items())
        ratios.append(bf16 / fp8)
    assert sorted(by_m) == [256, 512, 1024, 2048, 4096, 8192]
    low, high = FP8_GEMM_SPEEDUP_RANGE
    assert min(ratios) == pytest.approx(1.505, abs=5e-4) and max(ratios) == pytest.approx(1.683, abs=5e-4)
    assert low <= min(ratios) and max(ratios) <= high
    assert round(sorted(ratios)[2], 2) <= FP8_GEMM_SPEEDUP <= round(sorted(ratios)[3], 2)  # the middle


def _weight_read_ratios(path: str, model: str, rows: range) -> list[float]:
    """FP8 (the engine's dispatch) over bf16 weight-streaming rate, the four layer GEMMs summed, at each M in rows."""
    doc = json.loads((Path(__file__).parents[2] / path).read_text())
    by_m: dict[int, list[float]] = {}
    for r in doc["rows"]:
        if r["model"] == model and r["m"] in rows:
            acc = by_m.setdefault(r["m"], [0.0, 0.0])
            acc[0] += r["bf16"]["median_us"]
            acc[1] += r["fp8_engine"]["median_us"]
    # bf16 reads 2 bytes a weight in bf16_us, FP8 1 byte in fp8_us: rate ratio = (1 / fp8_us) / (2 / bf16_us)
    return [bf16 / (2 * fp8) for _, (bf16, fp8) in sorted(by_m.items())]


F8B, F70B = "results/h100/fp8/fp8_gemm.json", "results/h100/fp8/gemm70b/fp8_gemm.json"


def test_fp8_weight_read_factors_are_the_committed_h100_measurements():
    """FP8_READ_W8A16 / W8A8 and their ranges from results/h100/fp8/fp8_gemm.json (8B) and gemm70b/fp8_gemm.json
    (70B at TP 2 and 8): the middle of the 8B's and 70B TP 2's ratios, and ranges that hold every shape's."""
    from spanllm.perf.hardware import FP8_READ_W8A8, FP8_READ_W8A8_RANGE, FP8_READ_W8A16, FP8_READ_W8A16_RANGE

    few, many = range(1, 17), range(32, 257)
    w8a16 = {k: _weight_read_ratios(f, k, few) for f, k in [(F8B, "8b"), (F70B, "70b-tp2"), (F70B, "70b-tp8")]}
    w8a8 = {k: _weight_read_ratios(f, k, many) for f, k in [(F8B, "8b"), (F70B, "70b-tp2"), (F70B, "70b-tp8")]}
    assert [len(v) for v in w8a16.values()] == [5, 5, 5] and [len(v) for v in w8a8.values()] == [4, 4, 4]
    assert (round(min(w8a16["8b"]), 2), round(max(w8a16["8b"]), 2)) == (0.79, 0.85)
    assert (round(min(w8a8["8b"]), 2), round(max(w8a8["8b"]), 2)) == (0.66, 0.73)
    assert (round(min(w8a8["70b-tp8"]), 2), round(max(w8a8["70b-tp8"]), 2)) == (0.46, 0.55)
    for got, nominal, (low, high) in [
        (w8a16, FP8_READ_W8A16, FP8_READ_W8A16_RANGE),
        (w8a8, FP8_READ_W8A8, FP8_READ_W8A8_RANGE),
    ]:
        everything = [x for v in got.values() for x in v]
        assert low <= round(min(everything), 2) and round(max(everything), 2) <= high
        main = sorted(got["8b"] + got["70b-tp2"])
        assert main[len(main) // 2 - 1] - 0.01 <= nominal <= main[len(main) // 2] + 0.01  # the middle
