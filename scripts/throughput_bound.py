"""How fast can the offline ShareGPT run be on one GPU, at best? A roofline of the engine's own schedule.

    python3 scripts/throughput_bound.py --samples-file results/h200/inputs/sharegpt_llama3_seed0_n1000.json \
        [--max-num-seqs 192,256,512 --max-num-batched-tokens 8192 --rates 750:4.28,989:4.8]
        [--orders fcfs,longest-first] [--json OUT]

The step plan of an offline run depends on the request lengths and the scheduler only (ignore_eos: every
request runs to its output length; no kernel speed enters it), so this script replays spanllm's Scheduler and
BlockManager on the saved requests with no model: each step's decodes, their context lengths, and the prefill
chunks. The replay is synchronous; the engine's default async scheduling holds a finishing sequence's slot one
step longer, so the GPU run takes a step or so more (1,722 against the replay's 1,721 at 256 sequences). Each step then gets a cost that no implementation running it can beat on a GPU with the given
copy bandwidth and matmul rate (both measured on the H200: results/h200/engine_speed/README.md):
- weights: every step reads the layers and the LM head once (bf16);
- GEMM FLOPs: 2 x parameters per token through the layers, plus the LM head for the rows that sample;
- decode attention: each decode reads its context's K and V (memory-bound);
- prefill attention FLOPs (causal: each query against its context).

Two totals: `sequential` = sum over steps of max(weight read, GEMM FLOPs) + attention (kernels one after
another, as spanllm and vLLM run a step), and `overlapped` = sum over steps of max(all bytes / bandwidth,
all FLOPs / rate): even a step that overlapped attention with the GEMMs perfectly is no faster. The
sweep over max_num_seqs shows what the schedule itself costs: the run cannot take fewer steps than its
longest request's output length, and each step reads the weights. `longest-first` replays the requests sorted
by output length (longest first; not FCFS: it needs every output length in advance). `schedule_free` is the
bound of no plan at all: max(longest output x weight read, all GEMM FLOPs / rate) + all attention (the work
spread perfectly over the fewest possible steps), and its overlapped form.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys

from spanllm.bench.sample_file import load_samples
from spanllm.engine.core.block_manager import BlockManager
from spanllm.engine.core.scheduler import Scheduler, SchedulerConfig
from spanllm.engine.core.sequence import Sequence, SequenceStatus
from spanllm.engine.sampler import SamplingParams
from spanllm.model.config import resolve_model


def replay(
    lengths: list[tuple[int, int]], max_num_seqs: int, max_tokens: int, num_blocks: int, block_size: int
) -> list[dict]:
    """The scheduler's step plan for requests (prompt_len, output_len), all arriving at once, synchronous."""
    # Lengths only (every token id 0): no token content to share, so the prefix cache stays off.
    blocks = BlockManager(num_blocks, block_size, enable_prefix_caching=False)
    sched = Scheduler(SchedulerConfig(max_num_seqs, max_tokens, 1 << 20), blocks)
    for i, (p, o) in enumerate(lengths):
        sched.add(Sequence(str(i), [0] * p, SamplingParams(max_tokens=o, ignore_eos=True)))
    steps = []
    while sched.has_work():
        batch = sched.schedule()
        if not batch:
            raise RuntimeError("the scheduler planned an empty step with work left (pool too small?)")
        dec_ctx = [s.num_computed + 1 for s, _ in batch.entries[: batch.num_decode]]
        chunks = [(s.num_computed, n) for s, n in batch.entries[batch.num_decode :]]
        sampling = 0
        for s, n in batch.entries:
            s.num_computed += n
            if s.num_computed == s.num_tokens:
                sampling += 1
                s.output_ids.append(0)
                if s.num_output >= s.params.max_tokens:
                    sched.finish(s)
                    s.status = SequenceStatus.FINISHED
        steps.append(
            {
                "decodes": len(dec_ctx),
                "decode_ctx": sum(dec_ctx),
                "chunks": chunks,
                "sampling": sampling,
                "preempted": len(batch.preempted),
            }
        )
    return steps


def model_costs(cfg) -> dict:
    """Per-model constants of the roofline: parameters of the layers and the LM head, bytes read per step,
    K/V bytes per cached token, attention FLOPs per (query, key) pair."""
    layer_params = cfg.num_layers * (
        cfg.hidden_size * (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
        + cfg.num_heads * cfg.head_dim * cfg.hidden_size
        + 3 * cfg.hidden_size * cfg.intermediate_size
    )
    head_params = cfg.hidden_size * cfg.vocab_size
    return {
        "layer_params": layer_params,
        "head_params": head_params,
        "weight_bytes": 2 * (layer_params + head_params),  # bf16; the embedding is read one row a token
        "kv_bytes_per_token": 2 * 2 * cfg.num_kv_heads * cfg.head_dim * cfg.num_layers,  # K and V, bf16
        "attn_flops_per_key": 4 * cfg.num_heads * cfg.head_dim * cfg.num_layers,
    }  # QK^T and PV


def step_costs(steps: list[dict], cfg, bw: float, flops: float) -> dict:
    m = model_costs(cfg)
    seq_total = ovl_total = 0.0
    parts = {"weights_or_gemm_s": 0.0, "decode_attention_s": 0.0, "prefill_attention_s": 0.0}
    for s in steps:
        tokens = s["decodes"] + sum(n for _, n in s["chunks"])
        gemm = 2 * m["layer_params"] * tokens + 2 * m["head_params"] * s["sampling"]
        kv = m["kv_bytes_per_token"] * s["decode_ctx"]
        # causal prefill: query at position p sees p + 1 keys
        pf = m["attn_flops_per_key"] * sum(n * c0 + n * (n + 1) // 2 for c0, n in s["chunks"])
        w = max(m["weight_bytes"] / bw, gemm / flops)
        seq_total += w + kv / bw + pf / flops
        ovl_total += max((m["weight_bytes"] + kv) / bw, (gemm + pf) / flops)
        parts["weights_or_gemm_s"] += w
        parts["decode_attention_s"] += kv / bw
        parts["prefill_attention_s"] += pf / flops
    return {"sequential_s": seq_total, "overlapped_s": ovl_total, **parts}


def schedule_free(lengths: list[tuple[int, int]], cfg, tflops: float, tbs: float) -> dict:
    """The bound of no particular plan: at least max(output lengths) steps, each reading the weights, plus all
    the requests' GEMM FLOPs and attention, which no plan changes (without preemption)."""
    m = model_costs(cfg)
    bw, fl = tbs * 1e12, tflops * 1e12
    tokens = sum(p + o - 1 for p, o in lengths)  # the prompt, then every output token but the last, run once each
    sampled = sum(o for _, o in lengths)
    gemm = 2 * m["layer_params"] * tokens + 2 * m["head_params"] * sampled
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


def bound_row(steps: list[dict], cfg, max_num_seqs: int, tflops: float, tbs: float, out_tokens: int) -> dict:
    c = step_costs(steps, cfg, tbs * 1e12, tflops * 1e12)
    return {
        "max_num_seqs": max_num_seqs,
        "tflops": tflops,
        "bandwidth_tbs": tbs,
        "steps": len(steps),
        "steps_with_64_or_fewer_seqs": sum(1 for s in steps if s["decodes"] + len(s["chunks"]) <= 64),
        "preemptions": sum(s["preempted"] for s in steps),
        **{k: round(v, 3) for k, v in c.items()},
        "sequential_tok_s": round(out_tokens / c["sequential_s"]),
        "overlapped_tok_s": round(out_tokens / c["overlapped_s"]),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples-file", required=True)
    p.add_argument("--model", default="llama3.1-8b")
    p.add_argument("--max-num-seqs", default="128,192,256,384,512,1024", help="comma list: one replay each")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--num-blocks", type=int, default=55326, help="KV pool (the H200 run's: 55326 x 16 tokens)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument(
        "--rates",
        default="750:4.28,850:4.28,989:4.8",
        help="comma list of TFLOPS:TB/s pairs, one bound each: bf16 GEMM rate and copy bandwidth. H200 "
        "measured: ~750 TFLOPS (the 8192-token prefill's GEMMs) and 4.26-4.28 TB/s (copy); 989:4.8 is "
        "the spec sheet's dense bf16 peak and HBM bandwidth",
    )
    p.add_argument(
        "--orders",
        default="fcfs,longest-first",
        help="comma list: fcfs (the samples' order: the engine's) and/or longest-first (sorted by output length)",
    )
    p.add_argument("--json")
    a = p.parse_args()
    orders = [v for v in a.orders.split(",") if v]
    if not orders or any(o not in ("fcfs", "longest-first") for o in orders):
        raise SystemExit(f"--orders {a.orders!r}: expected fcfs and/or longest-first")
    try:
        rates = [(float(t), float(b)) for t, b in (v.split(":") for v in a.rates.split(",") if v)]
    except ValueError:
        rates = []
    if not rates or any(t <= 0 or b <= 0 for t, b in rates):
        raise SystemExit(f"--rates {a.rates!r}: expected positive TFLOPS:TB/s pairs, e.g. 750:4.28,989:4.8")
    try:
        seq_counts = [int(v) for v in a.max_num_seqs.split(",") if v]
    except ValueError:
        seq_counts = []
    if not seq_counts or min(seq_counts) < 1:
        raise SystemExit(f"--max-num-seqs {a.max_num_seqs!r}: expected positive integers, e.g. 192,256")
    cfg = resolve_model(a.model)
    try:
        samples = load_samples(a.samples_file)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    lengths = [(r.prompt_len, r.output_len) for r in samples]
    out_tokens = sum(o for _, o in lengths)
    rows = []
    for order, n in itertools.product(orders, seq_counts):
        reqs = lengths if order == "fcfs" else sorted(lengths, key=lambda r: -r[1])
        steps = replay(reqs, n, a.max_num_batched_tokens, a.num_blocks, a.block_size)
        for tflops, tbs in rates:
            rows.append({"order": order, **bound_row(steps, cfg, n, tflops, tbs, out_tokens)})
            r = rows[-1]
            print(
                f"{order}, {tflops:g} TFLOPS, {tbs:g} TB/s, max_num_seqs {n:5d}: {r['steps']} steps "
                f"({r['steps_with_64_or_fewer_seqs']} with <= 64 sequences); bound {r['sequential_s']:.2f} s "
                f"sequential = {r['sequential_tok_s']} output tok/s, {r['overlapped_s']:.2f} s overlapped = "
                f"{r['overlapped_tok_s']} tok/s (weights/GEMM {r['weights_or_gemm_s']:.2f} s, decode attention "
                f"{r['decode_attention_s']:.2f} s, prefill attention {r['prefill_attention_s']:.2f} s)",
                flush=True,
            )
    result = {
        "describe": __doc__.strip().splitlines()[0],
        "samples_file": a.samples_file,
        "model": a.model,
        "requests": len(lengths),
        "prompt_tokens": sum(pl for pl, _ in lengths),
        "output_tokens": out_tokens,
        "longest_output": max(o for _, o in lengths),
        "settings": {
            "max_num_batched_tokens": a.max_num_batched_tokens,
            "num_blocks": a.num_blocks,
            "block_size": a.block_size,
            "rates": a.rates,
        },
        "weight_bytes": model_costs(cfg)["weight_bytes"],
        "rows": rows,
        "schedule_free": [schedule_free(lengths, cfg, t, b) for t, b in rates],
    }
    for f in result["schedule_free"]:
        print(
            f"schedule-free, {f['tflops']:g} TFLOPS, {f['bandwidth_tbs']:g} TB/s: >= {f['min_steps']} steps; bound "
            f"{f['sequential_s']:.2f} s sequential = {f['sequential_tok_s']} output tok/s, {f['overlapped_s']:.2f} s "
            f"overlapped = {f['overlapped_tok_s']} tok/s",
            flush=True,
        )
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
