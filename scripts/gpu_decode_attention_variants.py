"""The paged decode attention kernel's variants on one GPU, Llama 3.1 8B heads (32 query, 8 KV heads of 128,
bf16, blocks of 16 tokens): microseconds per call for each (batch, context) and each variant of
spanllm.kernels.paged_attention.decode's keyword knobs (block ids one tile ahead or not, Triton's
num_stages for the key loop) and minimum key tiles per split. (Its first run, 2026-12-02, also compared a
two-pass merge, since removed: results/h200/engine_speed/call8_attention/.) Every variant's output is checked
against the gather + SDPA reference before it is timed.

Timing: `--calls` back-to-back kernels in one CUDA graph (as a step's layers run them: launch gaps included,
no host cost), the median of `--replays` replays.

    python3 scripts/gpu_decode_attention_variants.py --json results/h200/engine_speed/<call>/decode_attention_variants.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch-sizes", default="1,8,32,128")
    ap.add_argument("--context-lens", default="128,256,384,512,1024,2048,4096")
    ap.add_argument("--min-tiles", default="1,2,4")
    ap.add_argument("--stages", default="1,2,3")
    ap.add_argument("--calls", type=int, default=100)
    ap.add_argument("--replays", type=int, default=5)
    ap.add_argument("--json", required=True)
    return ap.parse_args()


def main() -> int:
    args = parse()
    if not torch.cuda.is_available():
        raise SystemExit("gpu_decode_attention_variants.py times CUDA kernels: run it on the GPU machine")
    from spanllm.attention import paged as pa
    from spanllm.commands.bench_attention import random_decode_inputs
    from spanllm.commands.bench_throughput import machine_info
    from spanllm.cuda_graph import capture_graph
    from spanllm.kernels import arrival_counters
    from spanllm.kernels import paged_attention as kt

    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    hq, hkv, d, bs, dtype = 32, 8, 128, 16, torch.bfloat16
    variants = [
        dict(prefetch=p, num_stages=s)
        for p, s in itertools.product((False, True), [int(v) for v in args.stages.split(",")])
    ]
    defaults = dict(num_stages=kt.DECODE_NUM_STAGES, min_tiles=kt.MIN_TILES_PER_SPLIT)
    rows = []
    for b in [int(v) for v in args.batch_sizes.split(",")]:
        splits = kt.num_splits_for(b, hkv, dev)
        for n in [int(v) for v in args.context_lens.split(",")]:
            q, kc, vc, tables, cl = random_decode_inputs(b, n, hq, hkv, d, bs, dtype, dev)  # bench attention's
            ref = pa.reference_decode(q.float(), kc.float(), vc.float(), tables, [n] * b)
            cell = []
            for v, mt in itertools.product(variants, [int(x) for x in args.min_tiles.split(",")]):
                call = lambda: kt.decode(q, kc, vc, tables, cl, splits, mt, **v)  # noqa: E731
                err = float((call().float() - ref).abs().max())
                if err > 2e-2:
                    raise SystemExit(
                        f"variant {v} min_tiles={mt} at batch {b}, context {n}: max|diff| {err} vs the reference"
                    )
                graph = capture_graph(lambda: [call() for _ in range(args.calls)], dev, warmup=1)
                times = []
                for _ in range(args.replays):
                    a, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    a.record()
                    graph.replay()
                    e.record()
                    e.synchronize()
                    times.append(1e3 * a.elapsed_time(e) / args.calls)
                del graph
                row = {
                    "batch": b,
                    "context": n,
                    "splits": splits,
                    "min_tiles": mt,
                    **v,
                    "us_per_call": statistics.median(times),
                    "us_per_call_replays": times,
                    "max_abs_diff": err,
                }
                rows.append(row)
                cell.append(row)
            if not arrival_counters.all_zero(dev):
                raise SystemExit(f"arrival counters not all zero after batch {b}, context {n}")
            best = min(cell, key=lambda r: r["us_per_call"])
            prefetch = kt.prefetch_block_ids(b * hkv * splits, dev)  # what decode() picks by itself
            dflt = next(r for r in cell if r["prefetch"] == prefetch and all(r[k] == defaults[k] for k in defaults))
            print(
                f"B={b:4d} ctx={n:5d} splits={splits:2d}  defaults (prefetch={prefetch}) {dflt['us_per_call']:6.2f} us  "
                f"best {best['us_per_call']:6.2f} us (prefetch={best['prefetch']} stages={best['num_stages']} "
                f"min_tiles={best['min_tiles']})",
                flush=True,
            )
            del kc, vc
            torch.cuda.empty_cache()
    out = {
        "machine": machine_info(dev),
        "settings": {
            **vars(args),
            "heads": hq,
            "kv_heads": hkv,
            "head_dim": d,
            "block_size": bs,
            "dtype": str(dtype),
            "defaults": defaults,
            "prefetch_max_programs": kt.PREFETCH_WAVES * kt.num_sms_of(dev),
        },
        "rows": rows,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
