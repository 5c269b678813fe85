"""FP8 against bf16 GEMM time at the Llama 3.1 8B (TP=1) and 70B (TP=2, TP=8) layer shapes, M = 1 ... 8192, on one GPU.

    PYTHONPATH=. python scripts/gpu_fp8_gemm.py OUTDIR [--models 8b,70b-tp2] [--ms 1,2,...]
    PYTHONPATH=. python scripts/gpu_fp8_gemm.py OUTDIR --sweep [--models 8b] [--sweep-ms 1,64,32,128,16]

--sweep: the W8A16 kernel's launch configs at the decode row counts (BLOCK_N x BLOCK_K x SPLIT_K at the
heuristic's warps / stages, then warps x stages around the best three), each checked against the dequantized
reference, beside W8A8 and bf16 F.linear at the same M; writes OUTDIR/fp8_sweep.json (every timing) and
OUTDIR/skinny_gemm_configs.json: the committed table with this run's FP8 entries (config, skinny_us, w8a8_us) added,
the format spanllm.kernels.skinny_gemm reads (commit it there, or point SPANLLM_SKINNY_GEMM_TABLE at it).

Methods, each a CUDA graph applying the GEMM to enough distinct weights to be 3x the L2 cache (every weight comes
from HBM, as in a step that walks the layers), replayed and timed with CUDA events, microseconds per GEMM:
- bf16: F.linear (cuBLAS) on bf16 weights; bf16_skinny: spanllm's skinny kernel (M <= 16)
- fp8_w8a16: spanllm's skinny kernel on FP8 weights with channel scales (M <= 64; x stays bf16)
- fp8_w8a8: per-token quantization of x (spanllm.kernels.fp8_quant) + torch._scaled_mm with row-wise scales,
  i.e. what the engine runs above 64 rows; fp8_scaled_mm_only: _scaled_mm on pre-quantized x (the GEMM alone)
- fp8_engine: spanllm.layers.fp8.fp8_linear, the engine's dispatch (spanllm.layers.fp8.describe_dispatch)
Writes OUTDIR/fp8_gemm.json (machine, versions, settings, raw per-replay times) as it goes.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import statistics
import time

import torch
import torch.nn.functional as F

from spanllm.kernels import skinny_gemm as sg
from spanllm.kernels.fp8_quant import quantize_per_token
from spanllm.layers import fp8
from spanllm.measure.report import versions
from spanllm.measure.timing import graph_us_per_call

SHAPES = {  # (N, K) per GPU
    "8b": {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)},
    "70b-tp2": {"qkv": (5120, 8192), "o": (8192, 4096), "gate_up": (28672, 8192), "down": (8192, 14336)},
    "70b-tp8": {"qkv": (1280, 8192), "o": (8192, 1024), "gate_up": (7168, 8192), "down": (8192, 3584)},
}
MS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192]


def time_graph(fn, count: int, replays: int = 15) -> list[float]:
    """Per-replay microseconds per call of a CUDA graph running fn(i) for i in range(count)."""
    return graph_us_per_call(fn, count, replays)


def bench_shape(model: str, layer: str, n: int, k: int, ms: list[int], l2: int, doc: dict, out: str) -> None:
    """Every method at every M for one (N, K); appends rows to doc and rewrites `out` after each."""
    count = max(4, math.ceil(3 * l2 / (n * k)))  # fp8 bytes >= 3x L2 (the bf16 set is twice as large)
    gen = torch.Generator(device="cuda").manual_seed(n + k)
    wb = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) / math.sqrt(k) for _ in range(count)]
    wq = [fp8.quantize_weight(w) for w in wb]
    for m in ms:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
        xq, xs = quantize_per_token(x)
        row = {"model": model, "layer": layer, "n": n, "k": k, "m": m, "weights_in_graph": count}
        methods = {
            "bf16": lambda i, x=x: F.linear(x, wb[i]),
            "fp8_engine": lambda i, x=x: fp8.fp8_linear(x, wq[i][0], wq[i][1], None),
        }
        if m <= sg.MAX_M:
            methods["bf16_skinny"] = lambda i, x=x: sg.skinny_linear(x, wb[i])
        row["fp8_engine_runs"] = "w8a8" if fp8.uses_activation_quant(m, n, k) else "w8a16"
        if m <= sg.FP8_MAX_M:
            methods["fp8_w8a16"] = lambda i, x=x: sg.skinny_linear(x, wq[i][0], weight_scale=wq[i][1])
        if m >= 16:
            methods["fp8_w8a8"] = lambda i, x=x: fp8.scaled_mm_linear(x, wq[i][0], wq[i][1])
            methods["fp8_scaled_mm_only"] = lambda i, xq=xq, xs=xs: torch._scaled_mm(
                xq, wq[i][0].t(), scale_a=xs, scale_b=wq[i][1].view(1, -1), out_dtype=torch.bfloat16
            )
        for name, fn in methods.items():
            try:
                us = time_graph(fn, count)
                row[name] = {"median_us": statistics.median(us), "us": us}
            except Exception as e:  # noqa: BLE001 - record and go on: one failing method must not end the run
                row[name] = {"error": f"{type(e).__name__}: {e}"[:300]}
        # the engine's dispatch against the dequantized reference (x quantized too above 64 rows), on weight 0
        wd = fp8.dequantize_weight(wq[0][0], wq[0][1], torch.float32)
        ref = F.linear(xq.float() * xs if fp8.uses_activation_quant(m, n, k) else x.float(), wd)
        y = fp8.fp8_linear(x, wq[0][0], wq[0][1], None).float()
        row["fp8_engine_max_err_rel"] = ((y - ref).abs().max() / ref.abs().max()).item()
        doc["rows"].append(row)
        b = row["bf16"].get("median_us", float("nan"))
        e = row["fp8_engine"].get("median_us", float("nan"))
        print(f"{model:8s} {layer:8s} M={m:5d} bf16 {b:8.1f} us  fp8 {e:8.1f} us  x{b / e:5.2f}", flush=True)
        with open(out, "w") as f:
            json.dump(doc, f, indent=1)


SMEM_LIMIT = 227 * 1024  # H100 / H200 shared memory per block


def sweep_candidates(k: int, block_m: int, stage: int, top: list[tuple] = ()) -> list[tuple]:
    """Stage 1: BLOCK_N x BLOCK_K x SPLIT_K at the heuristic's warps / stages; stage 2: warps x stages around
    `top`. Configs whose W + x pipeline exceeds shared memory are left out; SPLIT_K as it launches."""
    out = []

    def add(bn, bk, split, warps, stages):
        cfg = (bn, bk, sg.effective_split_k(k, bk, split), warps, stages)
        if (bn + 2 * block_m) * bk * stages <= SMEM_LIMIT and cfg not in out:
            out.append(cfg)

    if stage == 1:
        for bn, bk, split in itertools.product((32, 64, 128), (128, 256, 512), (1, 2, 4, 8)):
            add(bn, bk, split, *sg.launch_for_tile(bn, bk, 1, block_m, x_bytes=2))
    else:
        for bn, bk, split, *_ in top:
            for warps, stages in itertools.product((4, 8), (2, 3, 4, 5, 6)):
                add(bn, bk, split, warps, stages)
    return out


def sweep_shape(model, layer, n, k, m, l2, deadline, rows: list) -> dict | None:
    """One (shape, M): bf16, W8A8 and every W8A16 candidate; returns the table entry (None if nothing ran)."""
    count = max(4, math.ceil(3 * l2 / (n * k)))
    gen = torch.Generator(device="cuda").manual_seed(n + k + m)
    wb = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) / math.sqrt(k) for _ in range(count)]
    wq = [fp8.quantize_weight(w) for w in wb]
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
    ref = F.linear(x.float(), fp8.dequantize_weight(wq[0][0], wq[0][1], torch.float32))
    row = {"model": model, "layer": layer, "n": n, "k": k, "m": m, "weights_in_graph": count, "configs": []}
    row["bf16_us"] = statistics.median(time_graph(lambda i: F.linear(x, wb[i]), count))
    wb.clear()
    row["w8a8_us"] = statistics.median(time_graph(lambda i: fp8.scaled_mm_linear(x, wq[i][0], wq[i][1]), count))

    def run(cfg):
        try:
            y = sg.skinny_linear(x, wq[0][0], config=cfg, weight_scale=wq[0][1]).float()
            err = ((y - ref).abs().max() / ref.abs().max()).item()
            if not err < 2e-2:  # bf16 output rounding is ~4e-3: anything far above is a wrong kernel
                row["configs"].append({"config": list(cfg), "failed": f"max rel error {err:.3g}"})
                return
            us = time_graph(lambda i: sg.skinny_linear(x, wq[i][0], config=cfg, weight_scale=wq[i][1]), count)
            row["configs"].append({"config": list(cfg), "median_us": statistics.median(us), "us": us, "err": err})
        except Exception as e:  # noqa: BLE001 - out of resources, compile failure: record, go on
            row["configs"].append({"config": list(cfg), "failed": f"{type(e).__name__}: {e}"[:300]})

    bm = sg.block_m_for(m)
    for cfg in sweep_candidates(k, bm, 1):
        if time.time() > deadline:
            break
        run(cfg)
    ok = sorted((c for c in row["configs"] if "median_us" in c), key=lambda c: c["median_us"])
    for cfg in sweep_candidates(k, bm, 2, [tuple(c["config"]) for c in ok[:3]]):
        if time.time() > deadline:
            break
        if all(c["config"] != list(cfg) for c in row["configs"]):
            run(cfg)
    rows.append(row)
    ok = sorted((c for c in row["configs"] if "median_us" in c), key=lambda c: c["median_us"])
    print(
        f"{model:8s} {layer:8s} M={m:4d} bf16 {row['bf16_us']:7.1f} w8a8 {row['w8a8_us']:7.1f} "
        f"w8a16 best {ok[0]['median_us'] if ok else float('nan'):7.1f} us {ok[0]['config'] if ok else '-'} "
        f"({len(row['configs'])} configs)",
        flush=True,
    )
    if not ok:
        return None
    return {
        "m_bucket": sg.m_bucket(m),
        "n": n,
        "k": k,
        "elem_bytes": 1,
        "config": ok[0]["config"],
        "skinny_us": round(ok[0]["median_us"], 2),
        "w8a8_us": round(row["w8a8_us"], 2),
        "bf16_us": round(row["bf16_us"], 2),
    }


def run_sweep(args, doc: dict, l2: int) -> None:
    t0 = time.time()
    deadline = t0 + args.deadline_s
    doc["settings"]["sweep_ms"] = args.sweep_ms
    doc["rows"] = []
    entries = []
    sweep_out = os.path.join(args.outdir, "fp8_sweep.json")
    table_out = os.path.join(args.outdir, "skinny_gemm_configs.json")
    with open(sg._TABLE_FILE) as f:
        table = json.load(f)
    for m in [int(v) for v in args.sweep_ms.split(",")]:  # every shape at the first M before the next M
        for model in args.models.split(","):
            for layer, (n, k) in SHAPES[model].items():
                if time.time() > deadline:
                    print(f"deadline: skipping {model} {layer} M={m}", flush=True)
                    continue
                entry = sweep_shape(model, layer, n, k, m, l2, deadline, doc["rows"])
                torch.cuda.empty_cache()
                if entry is not None:
                    entries.append(entry)
                new_keys = {(e["m_bucket"], e["n"], e["k"], 1) for e in entries}
                kept = [e for e in table["entries"] if (e["m_bucket"], e["n"], e["k"], e["elem_bytes"]) not in new_keys]
                with open(table_out, "w") as f:
                    json.dump({**table, "entries": kept + entries}, f, indent=1)
                doc["seconds"] = time.time() - t0
                with open(sweep_out, "w") as f:
                    json.dump(doc, f, indent=1)
    print("wrote", sweep_out, "and", table_out, flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("outdir")
    ap.add_argument("--models", default="8b,70b-tp2,70b-tp8")
    ap.add_argument("--ms", default=",".join(map(str, MS)))
    ap.add_argument("--deadline-s", type=float, default=240.0, help="stop starting new shapes after this")
    ap.add_argument("--sweep", action="store_true", help="sweep the W8A16 launch configs (module docstring)")
    ap.add_argument("--sweep-ms", default="1,64,32,128,16", help="row counts of the sweep, in the order run")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("scripts/gpu_fp8_gemm.py needs a CUDA GPU (FP8 tensor cores: compute capability 8.9+)")
    os.makedirs(args.outdir, exist_ok=True)
    out = os.path.join(args.outdir, "fp8_gemm.json")
    props = torch.cuda.get_device_properties(0)
    doc = {
        "machine": {"gpu": props.name, "sms": props.multi_processor_count, "memory_GiB": props.total_memory / 2**30},
        "versions": versions(),
        "settings": {
            "dtype": "bfloat16",
            "fp8": "float8_e4m3fn, weights per output channel, activations per token (row-wise _scaled_mm)",
            "fp8_dispatch": fp8.describe_dispatch(),
            "skinny_gemm_table": sg.table_id(),
            "timing": "CUDA graph over >= 3x L2 of distinct weights, 15 replays, us per GEMM",
        },
        "rows": [],
    }
    l2 = getattr(props, "L2_cache_size", 60 << 20)
    if args.sweep:
        run_sweep(args, doc, l2)
        return
    t0 = time.time()
    ms = [int(v) for v in args.ms.split(",")]
    for model in args.models.split(","):
        for layer, (n, k) in SHAPES[model].items():
            if time.time() - t0 > args.deadline_s:
                print(f"deadline: skipping {model} {layer}", flush=True)
                continue
            bench_shape(model, layer, n, k, ms, l2, doc, out)
            torch.cuda.empty_cache()
    doc["seconds"] = time.time() - t0
    with open(out, "w") as f:
        json.dump(doc, f, indent=1)
    print("wrote", out)


if __name__ == "__main__":
    main()
