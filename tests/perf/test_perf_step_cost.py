"""The serving step cost: hand-computed pieces, and the H200 constants refitted from the committed trace."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from spanllm.perf.hardware import PRESETS
from spanllm.perf.model_shape import get_model
from spanllm.perf.step_cost import (
    H200_STEP_COST,
    H200_TRACE,
    Step,
    StepCost,
    StepCostError,
    StepPricer,
    fit_step_cost,
    trace_steps,
)

ROOT = Path(__file__).resolve().parents[2]


def test_one_decode_is_its_weight_read_plus_its_kv_read_plus_the_overheads(round_cluster):
    m = get_model("8b")
    cost = StepCost(1.0, 1.0, 1.0, layer_us=10.0, elem_ns=1.0, sample_us=5.0, host_us=100.0)
    p = StepPricer(m, round_cluster, cost)  # 100 TFLOP/s, 1000 GB/s
    parts = p.parts_s(Step(1, 1000, (), 1))
    weights = 2 * (32 * 218_103_808 + 128256 * 4096)  # layers + LM head, bf16
    assert parts["weights_or_gemm"] == pytest.approx(weights / 1e12)
    assert parts["attention"] == pytest.approx(1000 * 32 * 2 * 8 * 128 * 2 / 1e12)
    assert parts["overhead"] == pytest.approx((32 * 10.0 + 1 * 32 * 4096 * 1.0 / 1e3 + 5.0 + 100.0) / 1e6)
    assert parts["allreduce"] == parts["pp_transfer"] == 0.0
    # TP=2 on a node of 2: half the weights, two all-reduces a layer
    p2 = StepPricer(m, PRESETS["h200x2"], H200_STEP_COST, tp=2)
    two = p2.parts_s(Step(64, 64 * 500, (), 64))
    one = StepPricer(m, PRESETS["h200x2"], H200_STEP_COST).parts_s(Step(64, 64 * 500, (), 64))
    assert two["weights_or_gemm"] == pytest.approx(one["weights_or_gemm"] / 2) and two["allreduce"] > 0


def test_a_prompt_chunk_is_priced_with_its_causal_pairs():
    s = Step(0, 0, ((100, 50), (0, 8)), 2)
    assert s.tokens == 58 and s.seqs == 2 and s.prefill_pairs == 50 * 100 + 50 * 51 // 2 + 8 * 9 // 2


def test_the_h200_constants_are_the_fit_of_the_committed_trace():
    rows = trace_steps(json.loads((ROOT / H200_TRACE).read_text()))
    assert len(rows) == 1722
    cost, rms = fit_step_cost(rows, get_model("8b"), PRESETS["h200x2"])
    for name in ("layer_us", "elem_ns", "sample_us", "host_us"):
        assert getattr(cost, name) == pytest.approx(getattr(H200_STEP_COST, name), rel=0.01), name
    assert rms < 0.05
    p = StepPricer(get_model("8b"), PRESETS["h200x2"], H200_STEP_COST)
    gpu = sum(p.step_s(r.as_step()) - H200_STEP_COST.host_us / 1e6 for r in rows)
    assert gpu == pytest.approx(sum(r.gpu_forward_s for r in rows), rel=0.01)


def test_bad_costs_and_traces_are_refused():
    with pytest.raises(StepCostError, match=r"gemm_efficiency=1.5 must lie in \(0, 1\]"):
        replace(H200_STEP_COST, gemm_efficiency=1.5)
    with pytest.raises(StepCostError, match="layer_us=-1"):
        replace(H200_STEP_COST, layer_us=-1.0)
    with pytest.raises(StepCostError, match="not a profile trace"):
        trace_steps({"trace": {"columns": ["seqs"], "rows": [[1]]}})
    with pytest.raises(StepCostError, match="tp=3: must divide the 32 heads"):
        StepPricer(get_model("8b"), PRESETS["dgx-h100"], tp=3)
