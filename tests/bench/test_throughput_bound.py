"""scripts/throughput_bound.py over spanllm.perf: the scheduler's step plan replayed without a model
(serving.replay_steps), and the roofline cost of a step (roofline), on requests small enough to plan by hand."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from spanllm.model.config import resolve_model
from spanllm.perf.quantization import BF16
from spanllm.perf.roofline import model_costs, schedule_free, step_costs
from spanllm.perf.serving import EngineLimits, replay_steps
from spanllm.perf.step_cost import Step

ROOT = Path(__file__).resolve().parents[2]


def test_replay_follows_the_scheduler_step_by_step():
    # (prompt 20, output 3) and (prompt 5, output 1); 16 tokens a step, 2 sequences, blocks of 4:
    # 1: the first 16 prompt tokens of request 0 (no sample); 2: its last 4 + request 1's 5 (both sample;
    # request 1 is done); 3, 4: request 0 decodes at contexts 21 and 22 and ends with its third token.
    steps = replay_steps(
        [(20, 3), (5, 1)], EngineLimits(max_num_seqs=2, max_num_batched_tokens=16, num_blocks=64, block_size=4)
    )
    assert [(s.decodes, s.decode_ctx, s.chunks, s.sampling) for s in steps] == [
        (0, 0, ((0, 16),), 0),
        (0, 0, ((16, 4), (0, 5)), 2),
        (1, 21, (), 1),
        (1, 22, (), 1),
    ]


def test_step_cost_is_the_roofline_of_its_work():
    cfg = resolve_model("llama3.1-8b")
    layer = cfg.num_layers * (
        cfg.hidden_size * (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
        + cfg.num_heads * cfg.head_dim * cfg.hidden_size
        + 3 * cfg.hidden_size * cfg.intermediate_size
    )
    head = cfg.hidden_size * cfg.vocab_size
    weights = 2 * (layer + head)
    assert weights == 15_009_316_864  # the 8B's layers and LM head in bf16 (the embedding is read one row a token)
    bw, fl = 4e12, 800e12
    # one decode at context 1000: weight-bound, plus its K/V read
    c = step_costs([Step(1, 1000, (), 1)], cfg, bw, fl)
    kv = 1000 * 2 * 2 * cfg.num_kv_heads * cfg.head_dim * cfg.num_layers
    assert c["sequential_s"] == weights / bw + kv / bw
    assert c["overlapped_s"] == (weights + kv) / bw
    # an FP8 KV cache reads one byte an element: half the K/V bytes, the weights unchanged
    c8 = step_costs([Step(1, 1000, (), 1)], cfg, bw, fl, BF16.with_fp8_kv_cache())
    assert c8["decode_attention_s"] == kv / 2 / bw and c8["weights_or_gemm_s"] == weights / bw
    # a 4096-token prompt from scratch: compute-bound GEMMs plus causal attention FLOPs
    c = step_costs([Step(0, 0, ((0, 4096),), 1)], cfg, bw, fl)
    gemm = 2 * layer * 4096 + 2 * head
    attn = 4 * cfg.num_heads * cfg.head_dim * cfg.num_layers * (4096 * 4097 // 2)
    assert gemm / fl > weights / bw
    assert c["sequential_s"] == gemm / fl + attn / fl
    assert c["overlapped_s"] == (gemm + attn) / fl


def test_schedule_free_bound_is_below_every_replayed_schedule():
    cfg = resolve_model("llama3.1-8b")
    lengths = [(300, 2), (50, 40), (900, 7), (20, 120)]
    free = schedule_free(lengths, cfg, 750.0, 4.28)
    assert free["min_steps"] == 120
    for order in (lengths, sorted(lengths, key=lambda r: -r[1])):
        for n, budget in ((1, 64), (2, 256), (4, 8192)):
            steps = replay_steps(order, EngineLimits(n, budget, num_blocks=4096, block_size=16))
            c = step_costs(steps, cfg, 4.28e12, 750e12)
            assert len(steps) >= free["min_steps"]
            assert free["sequential_s"] <= c["sequential_s"] + 1e-3 and free["overlapped_s"] <= c["overlapped_s"] + 1e-3
            # the attention work is the same whatever the plan (no preemption here): the replay's sums agree
            m = model_costs(cfg)
            kv = m["kv_bytes_per_token"] * sum((o - 1) * p + (o - 1) * o // 2 for p, o in lengths)
            assert sum(s.decode_ctx for s in steps) * m["kv_bytes_per_token"] == kv


def test_the_script_reproduces_its_committed_row(tmp_path):
    out = tmp_path / "bound.json"
    cmd = [
        sys.executable,
        "scripts/throughput_bound.py",
        "--samples-file",
        "results/h200/inputs/sharegpt_llama3_seed0_n1000.json",
        "--max-num-seqs",
        "256",
        "--rates",
        "750:4.28",
        "--orders",
        "fcfs",
        "--json",
        str(out),
    ]
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    new = json.loads(out.read_text())
    old = json.loads((ROOT / "results/h200/engine_speed/throughput_bound.json").read_text())
    row = next(r for r in old["rows"] if (r["order"], r["max_num_seqs"], r["tflops"]) == ("fcfs", 256, 750.0))
    assert new["rows"] == [row] and new["schedule_free"][0] == old["schedule_free"][0]
