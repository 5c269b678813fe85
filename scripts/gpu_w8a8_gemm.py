"""Sweep the Triton W8A8 GEMM (spanllm.kernels.fp8_gemm) at decode batch sizes against torch._scaled_mm and W8A16.

    PYTHONPATH=. python scripts/gpu_w8a8_gemm.py OUTDIR [--models 8b] [--ms 64,32,128,256] [--budget-s 200]

For every layer shape of the models and every M (the top of a table bucket: 32, 64, 128, 256), on x already
quantized per token (as the engine's norm / SiLU kernels hand it over from 32 rows):
- scaled_mm: torch._scaled_mm with row-wise scales (what the engine ran for every W8A8 GEMM before this kernel);
- the kernel's launch configs: stage 1 BLOCK_N x BLOCK_K x SPLIT_K at 4 warps and the most stages that fit, stage
  2 warps x stages around the best two; each checked against the fp32 reference of the same quantized operands
  before it is timed;
- w8a16: the engine's W8A16 kernel on bf16 x (spanllm.kernels.skinny_gemm with its committed table), up to 128
  rows, so the W8A16-or-W8A8 rule compares times of one run;
- quant: the separate per-token quantization pass (paid below spanllm.layers.fp8.FUSED_QUANT_MIN_ROWS).
Each a CUDA graph over enough distinct weights to be 3x the L2 cache, replayed, microseconds per GEMM.

Writes OUTDIR/w8a8_sweep.json (machine, versions, every timing) and OUTDIR/fp8_gemm_configs.json (the table
spanllm.kernels.fp8_gemm reads: commit it there, or point SPANLLM_FP8_GEMM_TABLE at it) after every shape.
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

from spanllm.kernels import fp8_gemm
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
SMEM_LIMIT = 227 * 1024  # H100 / H200 shared memory per block
MAX_STAGES = 6


def candidates(k: int, block_m: int, top: list[tuple] = ()) -> list[tuple]:
    """Stage 1 (no top): BLOCK_N x BLOCK_K x SPLIT_K, 4 warps, the most stages that fit; stage 2: warps x stages
    around `top`. SPLIT_K as it launches (effective_split_k); pipelines over shared memory left out."""
    out = []

    def add(bn, bk, split, warps, stages):
        cfg = (bn, block_m, bk, sg.effective_split_k(k, bk, split), warps, stages)
        if (bn + block_m) * bk * stages <= SMEM_LIMIT and cfg not in out:
            out.append(cfg)

    if not top:
        for bn, bk, split in itertools.product((64, 128), (128, 256), (1, 2, 4, 8)):
            add(bn, bk, split, 4, min(4, SMEM_LIMIT // ((bn + block_m) * bk)))
    else:
        for bn, _, bk, split, *_ in top:
            for warps, stages in itertools.product((4, 8), (3, 4, 6)):
                add(bn, bk, split, warps, stages)
    return out


def sweep_shape(model: str, layer: str, n: int, k: int, m: int, l2: int, deadline: float) -> dict:
    count = max(4, math.ceil(3 * l2 / (n * k)))
    gen = torch.Generator(device="cuda").manual_seed(n + k + m)
    wq = [fp8.quantize_weight(torch.randn(n, k, device="cuda", generator=gen) / math.sqrt(k)) for _ in range(count)]
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
    xq, xs = quantize_per_token(x)
    ref = (xq.float() * xs) @ (wq[0][0].float() * wq[0][1][:, None]).t()
    row = {"model": model, "layer": layer, "n": n, "k": k, "m": m, "weights_in_graph": count, "configs": []}

    def timed(fn):
        us = graph_us_per_call(fn, count, 15)
        return {"median_us": statistics.median(us), "us": us}

    row["scaled_mm"] = timed(
        lambda i: torch._scaled_mm(xq, wq[i][0].t(), scale_a=xs, scale_b=wq[i][1].view(1, -1), out_dtype=x.dtype)
    )
    row["quant"] = timed(lambda i: quantize_per_token(x))
    if m <= sg.FP8_MAX_M:
        row["w8a16"] = timed(lambda i: sg.skinny_linear(x, wq[i][0], weight_scale=wq[i][1]))

    def run(cfg):
        try:
            y = fp8_gemm.w8a8_linear(xq, xs, wq[0][0], wq[0][1], x.dtype, config=cfg).float()
            err = ((y - ref).abs().max() / ref.abs().max()).item()
            if not err < 4e-3:  # bf16 rounding (2^-9 of a value) + fp32 sums promoted every 128 products: ~2e-3
                row["configs"].append({"config": list(cfg), "failed": f"max rel error {err:.3g}"})
                return
            t = timed(lambda i: fp8_gemm.w8a8_linear(xq, xs, wq[i][0], wq[i][1], x.dtype, config=cfg))
            row["configs"].append({"config": list(cfg), "err": err, **t})
        except Exception as e:  # noqa: BLE001 - out of resources, compile failure: record it, go on
            row["configs"].append({"config": list(cfg), "failed": f"{type(e).__name__}: {e}"[:300]})

    block_m = min(fp8_gemm.MAX_BLOCK_M, fp8_gemm.m_bucket(m))
    for cfg in candidates(k, block_m):
        if time.time() > deadline:
            break
        run(cfg)
    ok = sorted((c for c in row["configs"] if "median_us" in c), key=lambda c: c["median_us"])
    for cfg in candidates(k, block_m, [tuple(c["config"]) for c in ok[:2]]):
        if time.time() > deadline:
            break
        if all(c["config"] != list(cfg) for c in row["configs"]):
            run(cfg)
    ok = sorted((c for c in row["configs"] if "median_us" in c), key=lambda c: c["median_us"])
    row["best"] = ok[0] if ok else None
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("outdir")
    ap.add_argument("--models", default="8b")
    ap.add_argument("--ms", default="64,32,128,256", help="row counts (table bucket tops), in the order run")
    ap.add_argument("--budget-s", type=float, default=200.0, help="stop starting new configs after this")
    args = ap.parse_args()
    try:
        ms = [int(v) for v in args.ms.split(",")]
    except ValueError:
        raise SystemExit(f"--ms {args.ms}: row counts separated by commas, e.g. 64,32,128,256") from None
    for m in ms:
        if fp8_gemm.m_bucket(m) != m or m > fp8_gemm.MAX_M:
            raise SystemExit(f"--ms {m}: each must be a table bucket top (16, 32, ... {fp8_gemm.MAX_M})")
    unknown = set(args.models.split(",")) - set(SHAPES)
    if unknown:
        raise SystemExit(f"--models {','.join(sorted(unknown))}: unknown; choose from {','.join(SHAPES)}")
    if not torch.cuda.is_available():
        raise SystemExit("scripts/gpu_w8a8_gemm.py needs a CUDA GPU with FP8 tensor cores (compute capability 8.9+)")
    os.makedirs(args.outdir, exist_ok=True)
    props = torch.cuda.get_device_properties(0)
    l2 = getattr(props, "L2_cache_size", 50 << 20)
    doc = {
        "machine": {"gpu": props.name, "sms": props.multi_processor_count, "memory_GiB": props.total_memory / 2**30},
        "versions": versions(),
        "settings": {
            "models": args.models,
            "ms": ms,
            "skinny_gemm_table": sg.table_id(),
            "timing": "CUDA graph over >= 3x L2 of distinct weights, 15 replays, us per GEMM; x quantized beforehand",
        },
        "rows": [],
    }
    t0 = time.time()
    deadline = t0 + args.budget_s
    entries = []
    for m in ms:  # every shape at the first M before the next
        for model in args.models.split(","):
            for layer, (n, k) in SHAPES[model].items():
                if time.time() > deadline:
                    print(f"budget spent: skipping {model} {layer} M={m}", flush=True)
                    continue
                row = sweep_shape(model, layer, n, k, m, l2, deadline)
                doc["rows"].append(row)
                torch.cuda.empty_cache()
                best = row["best"]
                w16 = row.get("w8a16", {}).get("median_us")
                print(
                    f"{model:8s} {layer:8s} M={m:4d} scaled_mm {row['scaled_mm']['median_us']:7.1f}  triton "
                    f"{best['median_us'] if best else float('nan'):7.1f} {best['config'] if best else '-'}  w8a16 "
                    f"{w16 if w16 is not None else float('nan'):7.1f}  quant {row['quant']['median_us']:5.1f} us "
                    f"({len(row['configs'])} configs)",
                    flush=True,
                )
                if best is not None:
                    entry = {
                        "m_bucket": m,
                        "n": n,
                        "k": k,
                        "config": best["config"],
                        "kernel_us": round(best["median_us"], 2),
                        "scaled_mm_us": round(row["scaled_mm"]["median_us"], 2),
                        "quant_us": round(row["quant"]["median_us"], 2),
                    }
                    if w16 is not None:
                        entry["w8a16_us"] = round(w16, 2)
                    entries.append(entry)
                doc["seconds"] = time.time() - t0
                with open(os.path.join(args.outdir, "w8a8_sweep.json"), "w") as f:
                    json.dump(doc, f, indent=1)
                with open(os.path.join(args.outdir, "fp8_gemm_configs.json"), "w") as f:
                    json.dump({"machine": doc["machine"]["gpu"], "entries": entries}, f, indent=1)
    print("wrote", os.path.join(args.outdir, "w8a8_sweep.json"), "and fp8_gemm_configs.json", flush=True)


if __name__ == "__main__":
    main()
