"""Round 13 audit of `spanllm plan` and spanllm.perf: each defect found, held fixed with its exact values."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import spanllm.commands.plan
from spanllm.cli import main
from spanllm.perf.hardware import PRESETS
from spanllm.perf.inference import Layout, Workload, estimate, memory_per_gpu
from spanllm.perf.model_shape import MODELS
from spanllm.perf.plan import (
    best,
    candidate_layouts,
    fewest_nodes_that_fit,
    fits_somewhere,
    largest_batch_that_fits,
    nodes_with_layouts,
    plan,
    tp_algos,
)
from spanllm.perf.quantization import BF16, FP8
from spanllm.perf.serving import EngineLimits, ServeLayout, ServeRequest, plan_serve

ROOT = Path(__file__).parents[2]
SAMPLE = "results/h200/inputs/sharegpt_llama3_seed0_n1000.json"
BIG = Workload(256, 4096, 4096)  # 8B on Perlmutter: fits on 4 and 8 nodes, not on 5-7


def _error(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    return err.removeprefix("spanllm: error: ")


@pytest.fixture
def no_pricing(monkeypatch):
    """A refused input must stop before any row is priced."""

    def fail(*args, **kwargs):
        pytest.fail("priced a refused input")

    monkeypatch.setattr(spanllm.commands.plan, "run_static", fail)
    monkeypatch.setattr(spanllm.commands.plan, "run_serve", fail)


# --- fewest nodes: fitting is not monotone in the node count ---------------------------------------------------


def test_fewest_nodes_that_fit_finds_the_fewest_where_fitting_is_not_monotone():
    """Doubling + bisection assumed memory per GPU only falls with more nodes. 8B on Perlmutter (4 x A100 40GB),
    batch 256, prompt 4096, decode 4096: 4 nodes (TP4 x PP4, m=4) fit, but 5, 6, 7 do not (no stage count divides
    256, so m=1 and the whole batch's prompt activations). From 3 nodes the doubling tried 6, 12, 24, ... (none a
    power of two) and said nothing fits anywhere: the CLI advised only 'a smaller model'."""
    m, c = MODELS["llama3.1-8b"], PRESETS["perlmutter"]
    fits = [n for n in range(1, 17) if fits_somewhere(m, c, n, BIG, True, BF16)]
    assert fits == [4, 8, 16]
    assert fewest_nodes_that_fit(m, c, 3, BIG, True, BF16, 4096) == 4  # was None
    assert fewest_nodes_that_fit(m, c, 5, BIG, True, BF16, 4096) == 8  # was None
    assert fewest_nodes_that_fit(m, c, 9, BIG, True, BF16, 4096) == 16  # was None
    assert fewest_nodes_that_fit(m, c, 9, BIG, True, BF16, 15) is None


def test_fits_somewhere_is_the_plans_fit():
    m, c, w = MODELS["llama3.1-405b"], PRESETS["dgx-h100"], Workload(16, 2048, 32)
    for nodes in (1, 2, 3):
        rows = plan(m, c, nodes, w, True, False, BF16)
        assert fits_somewhere(m, c, nodes, w, True, BF16) == any(r.fits for r in rows)
    assert [fits_somewhere(m, c, n, w, True, BF16) for n in (1, 2, 3)] == [False, True, True]


def test_largest_batch_that_fits_by_hand():
    """8B on 3 Perlmutter nodes, prompt 4096, decode 4096: TP4 x PP3 (11 layers a stage) at batch 117:
    weights 11 x 218,103,808 x 2 / 4 + 525,336,576 x 2 / 4 = 1,462,239,232 B; KV 117 x 8192 x 11 x (2 x 2 heads x 128
    x 2 B) = 10,796,138,496 B; activations 117 x 4096 rows x 2 B x (4 x 4096 + 3 x 14336 / 4) = 26,008,879,104 B:
    38.267 GB of 0.9 x 40 x 0.99 GiB = 38.268 GB. At 118 it is 38.582 GB."""
    m, c = MODELS["llama3.1-8b"], PRESETS["perlmutter"]
    mem = memory_per_gpu(m, Layout(4, 3), Workload(117, 4096, 4096), c)
    assert mem.weights_GB * 1e9 == pytest.approx(1_462_239_232)
    assert mem.kv_cache_GB * 1e9 == pytest.approx(10_796_138_496)
    assert mem.activations_GB * 1e9 == pytest.approx(26_008_879_104)
    assert mem.total_GB == pytest.approx(38.267256832) and mem.capacity_GB == pytest.approx(38.26815860736)
    assert mem.fits and not memory_per_gpu(m, Layout(4, 3), Workload(118, 4096, 4096), c).fits
    assert largest_batch_that_fits(m, c, 3, BIG, BF16) == 117
    # 405B on one node: its weights alone exceed 4 x 40 GB, so no batch helps
    assert largest_batch_that_fits(MODELS["llama3.1-405b"], c, 1, Workload(8, 128, 128), BF16) is None


def test_cli_how_to_fit_names_the_fewest_nodes_and_a_batch(capsys):
    argv = ["plan", "--model", "8b", "--cluster", "perlmutter", "--nodes", "3", "--batch", "256", "--prompt", "4096"]
    assert main([*argv, "--decode", "4096", "--no-ranges"]) == 1
    last = " ".join(capsys.readouterr().out.split()).rsplit("no layout fits in GPU memory: ", 1)[1]
    assert last == (
        "--nodes 4 (the fewest perlmutter nodes on which a layout fits); or --batch 117 or fewer sequences (fit on 3 "
        "node(s)); or a smaller model"
    )


# --- node counts that admit no layout ---------------------------------------------------------------------------


def test_nodes_with_layouts():
    m405, m8, c = MODELS["llama3.1-405b"], MODELS["llama3.1-8b"], PRESETS["perlmutter"]
    assert candidate_layouts(m405, c, 127, 16) == []  # 508 GPUs: TP 1, 2, 4 leave 508, 254, 127 > 126 stages
    assert nodes_with_layouts(m405, c, 127, 4096) == (126, 128)
    assert candidate_layouts(m8, c, 4096, 1) == []  # 16,384 GPUs > 32 heads x 32 layers
    assert nodes_with_layouts(m8, c, 4096, 4096) == (256, None)
    # walking the heads' divisors lists the same layouts as walking every integer up to the GPU count did
    for model, cluster, nodes, batch in [(m405, c, 8, 16), (m8, PRESETS["dgx-h100"], 3, 24), (m405, c, 126, 64)]:
        assert candidate_layouts(model, cluster, nodes, batch) == _every_integer_layouts(model, cluster, nodes, batch)
    assert [str(x) for x in candidate_layouts(m405, c, 8, 16)] == [
        "TP1 x PP32",
        "TP2 x PP16",
        "TP2 x PP16 (m=16)",
        "TP4 x PP8",
        "TP4 x PP8 (m=8)",
        "TP8 x PP4",
        "TP8 x PP4 (m=4)",
        "TP16 x PP2",
        "TP16 x PP2 (m=2)",
        "TP32",
    ]


def _every_integer_layouts(model, cluster, nodes, batch):
    """candidate_layouts as it was: every tp from 1 to the GPU count."""
    gpus, g, out = nodes * cluster.gpus_per_node, cluster.gpus_per_node, []
    for tp in range(1, gpus + 1):
        if gpus % tp or model.num_heads % tp or not (g % tp == 0 or tp % g == 0) or gpus // tp > model.num_layers:
            continue
        out += [Layout(tp, gpus // tp, m) for m in sorted({1, gpus // tp}) if batch % m == 0]
    return out


def test_cli_refuses_a_node_count_without_layouts(capsys, no_pricing):
    """Was: 'no layout of llama3.1-405b fits the rules on 127 x 4 GPUs' on stdout (also under --json -), exit 1."""
    assert _error(capsys, ["plan", "--nodes", "127"]) == (
        "--nodes 127: 127 x 4 = 508 GPUs admit no layout of llama3.1-405b: the TP degree must be one that shards it "
        "(1, 2, 4, 8, 16, 32, 64, 128) and divide a node's 4 GPUs or span whole nodes, and PP = GPUs / TP is at most "
        "its 126 layers; use --nodes 126 or --nodes 128"
    )
    err = _error(capsys, ["plan", "--model", "8b", "--nodes", "4096", "--batch", "1", "--prompt", "1", "--decode", "1"])
    assert err.startswith("--nodes 4096: 4096 x 4 = 16384 GPUs admit no layout of llama3.1-8b") and err.endswith(
        "use --nodes 256"
    )


# --- FP8 where the GPUs have none --------------------------------------------------------------------------------


@pytest.mark.parametrize("flag", ["--quantization", "--kv-cache-dtype"])
def test_cli_refuses_fp8_on_gpus_without_fp8(capsys, no_pricing, flag):
    """Was: priced (exit 0) on Perlmutter's A100s, where spanllm refuses FP8 (compute capability 8.0 < 8.9)."""
    assert PRESETS["perlmutter"].fp8_gemm_speedup == 1.0
    assert _error(capsys, ["plan", "--cluster", "perlmutter", flag, "fp8"]) == (
        f"{flag} fp8: cluster perlmutter's A100 40GB has no FP8 tensor cores (fp8_gemm_speedup 1), and spanllm "
        f"refuses FP8 below compute capability 8.9 (Ada, Hopper); drop {flag}, or give a cluster file with "
        "fp8_gemm_speedup > 1 for an FP8 GPU"
    )


def test_cli_does_not_suggest_fp8_on_gpus_without_fp8(capsys):
    """405B in bf16 on 4 Perlmutter nodes: FP8 weights would fit the model's memory, but the A100 cannot run them."""
    m, c, w = MODELS["llama3.1-405b"], PRESETS["perlmutter"], Workload(8, 128, 1024)
    assert fits_somewhere(m, c, 4, w, True, FP8)
    argv = ["plan", "--cluster", "perlmutter", "--nodes", "4", "--batch", "8", "--prompt", "128", "--decode", "1024"]
    assert main([*argv, "--no-ranges"]) == 1
    last = " ".join(capsys.readouterr().out.split()).rsplit("no layout fits in GPU memory: ", 1)[1]
    assert last == "--nodes 6 (the fewest perlmutter nodes on which a layout fits); or a smaller model"


# --- serving flags -----------------------------------------------------------------------------------------------

SERVE = ["plan", "--serve", "--model", "8b", "--cluster", "h200x2", "--nodes", "1"]


@pytest.mark.parametrize(
    "extra, expected",
    [
        # was a numpy ValueError traceback (exit 1)
        (
            ["--lengths", "8:8", "--request-rate", "1", "--seed", "-1"],
            "--seed -1: must be an integer in [0, 4294967295]; numpy's RandomState draws the arrivals",
        ),
        (
            ["--lengths", "8:8", "--request-rate", "1", "--seed", str(2**32)],
            "--seed 4294967296: must be an integer in [0, 4294967295]; numpy's RandomState draws the arrivals",
        ),
        # was silently ignored: every request arrives at t=0
        (
            ["--lengths", "8:8", "--burstiness", "0.5"],
            "--burstiness 0.5: shapes the arrival gaps, but at --request-rate inf (the default) every request arrives "
            "at t=0; give --request-rate R, or drop --burstiness",
        ),
        # was silently ignored: the file's 1,000 requests ran
        (
            ["--samples-file", SAMPLE, "--num-requests", "5"],
            f"--num-requests 5: counts the requests of --lengths; --samples-file '{SAMPLE}' brings its own requests; "
            "drop --num-requests (or use --lengths P:O)",
        ),
        # was exit 0 with every TTFT and TPOT 0.0 ms (arrivals 1e300 s apart swallow the step times)
        (
            ["--lengths", "8:8", "--request-rate", "1e-300"],
            "--request-rate 1e-300: must be > 0 requests per second and at least 0.0001 (one every 10,000 s; slower, "
            "the replay's clock loses the step times), or inf (all at once)",
        ),
    ],
)
def test_cli_serve_refuses(capsys, no_pricing, extra, expected):
    assert _error(capsys, [*SERVE, *extra]) == expected


def test_serve_more_replicas_than_requests():
    """Was: ServePlanError traceback ('no requests') for TP1 x 8 replicas with 3 requests. Now the 5 idle replicas
    stay idle: 3 replicas each serve one 10:10 request, so 3x the output rate of one replica with one request."""
    m, c = MODELS["llama3.1-8b"], PRESETS["dgx-h100"]
    reqs = [ServeRequest(10, 10)] * 3
    (eight,) = plan_serve(m, c, 8, reqs, EngineLimits(), ranges=False, layouts=[ServeLayout(1, 1, 8)])
    (one,) = plan_serve(m, c, 1, reqs[:1], EngineLimits(), ranges=False, layouts=[ServeLayout(1, 1, 1)])
    assert eight.fits and eight.nominal["steps"] == one.nominal["steps"] == 10  # 1 prefill + 9 decode steps
    assert eight.nominal["output_tok_s"] == pytest.approx(3 * one.nominal["output_tok_s"], rel=1e-12)
    assert eight.nominal["tpot_p99_ms"] == one.nominal["tpot_p99_ms"]


# --- docs/perf_model.md: the FP8 section's prose numbers --------------------------------------------------------


def _e2e_s(cluster: str, workload: Workload, quant, nodes: int) -> str:
    b = best(plan(MODELS["llama3.1-405b"], PRESETS[cluster], nodes, workload, True, True, quant))
    return f"{b.estimate.e2e_ms / 1e3:.1f} s [{b.e2e_range.low / 1e3:.1f}-{b.e2e_range.high / 1e3:.1f}]"


def test_fp8_section_prose_is_the_models_output():
    """The bullets quoting the table in seconds: 'bf16 on two nodes' decode-heavy b16 on an H200 said [8.6-10.5]
    (10,557 ms: 10.6) and FP8 on one node decode-heavy b64 on an H200 said [12.5-17.9] (18,025 ms: 18.0)."""
    doc = " ".join((ROOT / "docs" / "perf_model.md").read_text().split())
    b16, b64 = Workload(16, 128, 512), Workload(64, 128, 512)
    h200_16 = (_e2e_s("dgx-h200", b16, FP8, 1), _e2e_s("dgx-h200", b16, BF16, 2))
    h100_16 = (_e2e_s("dgx-h100", b16, FP8, 1), _e2e_s("dgx-h100", b16, BF16, 2))
    h200_64 = (_e2e_s("dgx-h200", b64, FP8, 1), _e2e_s("dgx-h200", b64, BF16, 2))
    h100_64 = (_e2e_s("dgx-h100", b64, FP8, 1), _e2e_s("dgx-h100", b64, BF16, 2))
    assert h200_16 == ("9.9 s [9.3-12.0]", "9.1 s [8.6-10.6]") and h200_64[0] == "13.5 s [12.5-18.0]"
    assert f"H200: {h200_16[0]} in FP8 on one node against {h200_16[1]} in bf16 on two" in doc
    assert f"H100: {h100_16[0]} against {h100_16[1]}" in doc
    assert f"{h200_64[0]} against {h200_64[1]}" in doc
    assert f"H100: {h100_64[0]} against {h100_64[1]}, not settled" in doc
    # 8 x H200 hold 1,081 GB usable; bf16 405B TP8: 101.5 GB of weights, 102.5 GB a GPU at decode-heavy batch 16
    mem = memory_per_gpu(MODELS["llama3.1-405b"], Layout(8), b16, PRESETS["dgx-h200"])
    assert f"{8 * mem.capacity_GB:,.0f}" == "1,081" and "8 x H200 hold 1,081 GB usable" in doc
    assert f"{mem.weights_GB:.1f} GB of weights, {mem.total_GB:.1f} GB per GPU" in doc
    assert re.search(r"FP8 fits \(52-74 GB per GPU\)", doc)


# --- properties ---------------------------------------------------------------------------------------------------

_SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)


@_SETTINGS
@given(
    cluster=st.sampled_from(["perlmutter", "vista", "dgx-h100", "dgx-h200"]),
    model=st.sampled_from(list(MODELS)),
    batch=st.sampled_from([1, 3, 16, 64, 100, 256, 1024]),
    prompt=st.sampled_from([128, 2048, 8192, 65536]),
    decode=st.sampled_from([32, 512, 4096]),
    start=st.integers(1, 40),
)
def test_fewest_nodes_that_fit_is_the_first_fitting_count(cluster, model, batch, prompt, decode, start):
    m, c, w = MODELS[model], PRESETS[cluster], Workload(batch, prompt, decode)
    if fits_somewhere(m, c, start, w, True, BF16):
        return
    truth = next((n for n in range(start + 1, 301) if fits_somewhere(m, c, n, w, True, BF16)), None)
    assert fewest_nodes_that_fit(m, c, start, w, True, BF16, 300) == truth


@_SETTINGS
@given(
    cluster=st.sampled_from(["perlmutter", "vista", "dgx-h100", "dgx-h200", "h200x2"]),
    model=st.sampled_from(list(MODELS)),
    nodes=st.integers(1, 8),
    batch=st.integers(1, 64),
    prompt=st.integers(1, 4096),
    decode=st.integers(1, 1024),
    field=st.sampled_from(["hbm_GBps", "nic_GBps_per_gpu", "nvlink_GBps", "bf16_TFLOPs"]),
    factor=st.floats(1.01, 4.0),
    graphs=st.booleans(),
    data=st.data(),
)
def test_more_bandwidth_or_flops_never_predicts_slower(
    cluster, model, nodes, batch, prompt, decode, field, factor, graphs, data
):
    m, c = MODELS[model], PRESETS[cluster]
    nodes = nodes if c.has_network else 1
    layouts = candidate_layouts(m, c, nodes, batch)
    if not layouts or getattr(c, field) == 0:
        return
    layout = data.draw(st.sampled_from(layouts))
    algo = data.draw(st.sampled_from(tp_algos(layout, c)))
    algo = "nccl" if algo == "none" else algo
    quant = data.draw(st.sampled_from([BF16, FP8] if c.fp8_gemm_speedup > 1 else [BF16]))
    w = Workload(batch, prompt, decode)
    faster = replace(c, **{field: getattr(c, field) * factor})
    a = estimate(m, c, layout, w, algo, graphs, "nccl", quant)
    b = estimate(m, faster, layout, w, algo, graphs, "nccl", quant)
    for k in ("ttft_ms", "tpot_ms", "e2e_ms"):
        assert getattr(b, k) <= getattr(a, k) * (1 + 1e-12), (k, getattr(a, k), getattr(b, k))


@_SETTINGS
@given(
    cluster=st.sampled_from(["dgx-h100", "dgx-h200", "vista"]),
    model=st.sampled_from(list(MODELS)),
    nodes=st.integers(1, 4),
    batch=st.integers(1, 128),
    prompt=st.integers(1, 8192),
    decode=st.integers(1, 2048),
)
def test_fp8_never_takes_more_memory_and_the_best_row_fits(cluster, model, nodes, batch, prompt, decode):
    m, c, w = MODELS[model], PRESETS[cluster], Workload(batch, prompt, decode)
    for layout in candidate_layouts(m, c, nodes, batch):
        bf16, fp8 = memory_per_gpu(m, layout, w, c, BF16), memory_per_gpu(m, layout, w, c, FP8)
        assert fp8.weights_GB < bf16.weights_GB and fp8.total_GB < bf16.total_GB
    for quant in (BF16, FP8):
        rows = plan(m, c, nodes, w, True, False, quant)
        b = best(rows)
        assert (b is None) == (not any(r.fits for r in rows)) and (b is None or b.fits)


def test_candidate_layouts_take_only_tp_degrees_the_engine_can_shard():
    """A TP degree must divide the query heads and divide or be a multiple of the KV heads, and divide the MLP width
    (spanllm.model.parallel_dims.check_tp_for_model); the planner listed every divisor of the heads. 12 heads over 4
    KV heads on one 12-GPU node: 3 and 6 divide the heads and tile the node, but neither divides 4 nor is a multiple
    of it (the engine refuses them); 12 is a multiple of 4 (each KV head on 3 ranks)."""
    import dataclasses

    from spanllm.perf.hardware import PRESETS
    from spanllm.perf.model_shape import get_model
    from spanllm.perf.plan import candidate_layouts

    base = get_model("8b")
    model = dataclasses.replace(base, num_heads=12, num_kv_heads=4, intermediate_size=12 * 1024)
    cluster = dataclasses.replace(PRESETS["dgx-h100"], gpus_per_node=12)
    assert sorted({layout.tp for layout in candidate_layouts(model, cluster, 1, 1)}) == [1, 2, 4, 12]
    odd_mlp = dataclasses.replace(model, intermediate_size=12 * 1024 + 2)  # divisible by 2, not by 3, 4 or 12
    assert sorted({layout.tp for layout in candidate_layouts(odd_mlp, cluster, 1, 1)}) == [1, 2]
