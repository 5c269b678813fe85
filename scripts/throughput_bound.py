"""How fast can the offline ShareGPT run be on one GPU, at best? A roofline of the engine's own schedule.

    python3 scripts/throughput_bound.py --samples-file results/h200/inputs/sharegpt_llama3_seed0_n1000.json \
        [--max-num-seqs 192,256,512 --max-num-batched-tokens 8192 --rates 750:4.28,989:4.8]
        [--orders fcfs,longest-first] [--quantization fp8] [--kv-cache-dtype fp8] [--json OUT]

A thin command over the library: spanllm.perf.serving.replay_steps replays spanllm's Scheduler and BlockManager
on the saved requests with no model (ignore_eos: the plan depends on the lengths only); spanllm.perf.roofline
gives each step the cost no implementation can beat at the given copy bandwidth and matmul rate (the module
docstring says how), sums them `sequential` and `overlapped`, and adds the schedule-free bound. The replay is
synchronous; the engine's async scheduling takes a step or so more (1,722 against 1,721 at 256 sequences).
`longest-first` replays the requests sorted by output length (not FCFS: it needs every output length in
advance). `spanllm plan --serve` prices the same plan with the engine's measured efficiencies instead.
`--quantization fp8`: the FP8 roofline of the same schedule: layer weights one byte a parameter (the LM head
bf16), the layers' GEMMs of steps above 16 rows at the H200 preset's fp8_gemm_speedup x the bf16 rate given.
`--kv-cache-dtype fp8`: K and V one byte an element (decode attention reads half), and the default pool twice the
blocks (the same memory).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys

from spanllm.bench.sample_file import load_samples
from spanllm.model.config import resolve_model
from spanllm.perf.hardware import PRESETS
from spanllm.perf.quantization import get_quantization
from spanllm.perf.roofline import bound_row, model_costs, schedule_free
from spanllm.perf.serving import EngineLimits, replay_steps


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples-file", required=True)
    p.add_argument("--model", default="llama3.1-8b")
    p.add_argument("--max-num-seqs", default="128,192,256,384,512,1024", help="comma list: one replay each")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument(
        "--num-blocks",
        type=int,
        default=None,
        help="KV pool (default: the H200 run's 55326 x 16 tokens; twice that with --kv-cache-dtype fp8)",
    )
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
    p.add_argument("--quantization", default=None, metavar="fp8", help="fp8: the FP8 roofline (default: bf16)")
    p.add_argument("--kv-cache-dtype", choices=("auto", "fp8"), default="auto", help="fp8: one byte a K/V element")
    p.add_argument("--json")
    a = p.parse_args()
    if a.quantization not in (None, "fp8"):
        raise SystemExit(f"--quantization {a.quantization!r}: only fp8 is modelled; leave it out for bf16")
    quant = get_quantization(a.quantization)
    if a.kv_cache_dtype == "fp8":
        quant = quant.with_fp8_kv_cache()
    if a.num_blocks is None:
        a.num_blocks = 55326 * (2 if a.kv_cache_dtype == "fp8" else 1)
    fp8_speedup = PRESETS["h200x2"].fp8_gemm_speedup
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
        steps = replay_steps(reqs, EngineLimits(n, a.max_num_batched_tokens, a.num_blocks, a.block_size))
        for tflops, tbs in rates:
            rows.append({"order": order, **bound_row(steps, cfg, n, tflops, tbs, out_tokens, quant, fp8_speedup)})
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
            "quantization": quant.name,
            "kv_cache_dtype": a.kv_cache_dtype,
            "fp8_gemm_speedup": fp8_speedup if quant.fp8_gemm else None,
        },
        "weight_bytes": model_costs(cfg, quant)["weight_bytes"],
        "rows": rows,
        "schedule_free": [schedule_free(lengths, cfg, t, b, quant, fp8_speedup) for t, b in rates],
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
