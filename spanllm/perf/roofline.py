"""How fast can an offline run be on one GPU, at best? The roofline of each step the scheduler plans.

Each step of a replayed plan (spanllm.perf.serving.replay_steps) gets the cost no implementation running it can
beat on a GPU with copy bandwidth `bw` (bytes/s) and matmul rate `flops` (FLOP/s):
- weights: every step reads the layers and the LM head once (bf16; in FP8 the layers' linear weights are one
  byte a parameter and the LM head stays bf16, spanllm.perf.quantization);
- GEMM FLOPs: 2 x parameters per token through the layers, plus the LM head for the rows that sample; in FP8 the
  layers' GEMMs of a step with more than 16 rows run at `fp8_speedup` x the rate (FP8 tensor cores), the LM
  head and smaller steps (W8A16) at the bf16 rate;
- decode attention: each decode reads its context's K and V (memory-bound);
- prefill attention FLOPs (causal: each query against its context).

Two totals: `sequential` = sum over steps of max(weight read, GEMM FLOPs) + attention (kernels one after
another, as spanllm and vLLM run a step), and `overlapped` = sum over steps of max(all bytes / bandwidth,
all FLOPs / rate). `schedule_free` is the bound of no plan at all: max(longest output x weight read, all GEMM
FLOPs / rate) + all attention (the work spread perfectly over the fewest possible steps), and its overlapped
form. spanllm.perf.step_cost prices the same steps with the engine's measured efficiencies and overheads.
"""

from __future__ import annotations

from collections.abc import Sequence

from spanllm.model.config import ModelConfig
from spanllm.perf.model_shape import DTYPE_BYTES, embedding_params, kv_bytes_per_token_layer, layer_params
from spanllm.perf.quantization import BF16, Quantization, gemm_speedup
from spanllm.perf.step_cost import Step


def model_costs(cfg: ModelConfig, quant: Quantization = BF16) -> dict:
    """Per-model constants of the roofline: parameters of the layers and the LM head, bytes read per step,
    K/V bytes per cached token, attention FLOPs per (query, key) pair."""
    layers, head = cfg.num_layers * layer_params(cfg), embedding_params(cfg)
    return {
        "layer_params": layers,
        "head_params": head,
        # the embedding is read one row a token
        "weight_bytes": cfg.num_layers * quant.layer_weight_bytes(cfg) + quant.head_weight_bytes(cfg),
        "kv_bytes_per_token": kv_bytes_per_token_layer(cfg, cfg.num_kv_heads)
        * cfg.num_layers
        * quant.kv_element_bytes
        / DTYPE_BYTES,
        "attn_flops_per_key": 4 * cfg.num_heads * cfg.head_dim * cfg.num_layers,  # QK^T and PV
    }


def step_costs(
    steps: Sequence[Step], cfg: ModelConfig, bw: float, flops: float, quant: Quantization = BF16, fp8_speedup=1.0
) -> dict:
    """`flops`: the bf16 GEMM rate; `fp8_speedup`: FP8's over it, for the layers' GEMMs (module docstring)."""
    m = model_costs(cfg, quant)
    seq_total = ovl_total = 0.0
    parts = {"weights_or_gemm_s": 0.0, "decode_attention_s": 0.0, "prefill_attention_s": 0.0}
    for s in steps:
        sp = gemm_speedup(quant, s.tokens, fp8_speedup)
        gemm_s = (2 * m["layer_params"] * s.tokens / sp + 2 * m["head_params"] * s.sampling) / flops
        kv = m["kv_bytes_per_token"] * s.decode_ctx
        pf = m["attn_flops_per_key"] * s.prefill_pairs
        w = max(m["weight_bytes"] / bw, gemm_s)
        seq_total += w + kv / bw + pf / flops
        ovl_total += max((m["weight_bytes"] + kv) / bw, gemm_s + pf / flops)
        parts["weights_or_gemm_s"] += w
        parts["decode_attention_s"] += kv / bw
        parts["prefill_attention_s"] += pf / flops
    return {"sequential_s": seq_total, "overlapped_s": ovl_total, **parts}


def schedule_free(
    lengths: Sequence[tuple[int, int]],
    cfg: ModelConfig,
    tflops: float,
    tbs: float,
    quant: Quantization = BF16,
    fp8_speedup: float = 1.0,
) -> dict:
    """The bound of no particular plan: at least max(output lengths) steps, each reading the weights, plus all
    the requests' GEMM FLOPs and attention, which no plan changes (without preemption). In FP8 every layer GEMM
    is taken at the FP8 rate (the bound of a plan whose steps are all large)."""
    m = model_costs(cfg, quant)
    sp = fp8_speedup if quant.fp8_gemm else 1.0
    bw, fl = tbs * 1e12, tflops * 1e12
    tokens = sum(p + o - 1 for p, o in lengths)  # the prompt, then every output token but the last, run once each
    sampled = sum(o for _, o in lengths)
    gemm = 2 * m["layer_params"] * tokens / sp + 2 * m["head_params"] * sampled  # bf16-rate FLOPs
    # decode j = 1 .. o-1 of a request attends to p + j keys; its prompt's queries causally to p(p+1)/2 pairs
    kv = m["kv_bytes_per_token"] * sum((o - 1) * p + (o - 1) * o // 2 for p, o in lengths)
    pf = m["attn_flops_per_key"] * sum(p * (p + 1) // 2 for p, _ in lengths)
    steps = max(o for _, o in lengths)
    seq = max(steps * m["weight_bytes"] / bw, gemm / fl) + kv / bw + pf / fl
    ovl = max((steps * m["weight_bytes"] + kv) / bw, (gemm + pf) / fl)
    return {
        "tflops": tflops,
        "bandwidth_tbs": tbs,
        "min_steps": steps,
        "sequential_s": round(seq, 3),
        "overlapped_s": round(ovl, 3),
        "sequential_tok_s": round(sampled / seq),
        "overlapped_tok_s": round(sampled / ovl),
    }


def bound_row(
    steps: Sequence[Step],
    cfg: ModelConfig,
    max_num_seqs: int,
    tflops: float,
    tbs: float,
    out_tokens: int,
    quant: Quantization = BF16,
    fp8_speedup: float = 1.0,
):
    c = step_costs(steps, cfg, tbs * 1e12, tflops * 1e12, quant, fp8_speedup)
    return {
        "max_num_seqs": max_num_seqs,
        "tflops": tflops,
        "bandwidth_tbs": tbs,
        "steps": len(steps),
        "steps_with_64_or_fewer_seqs": sum(1 for s in steps if s.seqs <= 64),
        "preemptions": sum(s.preempted for s in steps),
        **{k: round(v, 3) for k, v in c.items()},
        "sequential_tok_s": round(out_tokens / c["sequential_s"]),
        "overlapped_tok_s": round(out_tokens / c["overlapped_s"]),
    }
