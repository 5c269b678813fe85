"""The CUDA-core GEMV (spanllm.kernels.gemv) against the skinny GEMM and F.linear at one row, the 8B's shapes.

    PYTHONPATH=. python scripts/gpu_gemv.py OUTDIR [--budget-s 240] [--dtypes fp8,bf16] [--layers qkv,o,...]

Why: batch-1 FP8 decode runs at 1.44x its weight-copy bound on an H100 (results/h100/pdl/) against issue 30's
1.25x, and the W8A16 skinny GEMM, which stages W through shared memory for the tensor cores, streams the 8B's
16-25 MB layers at 52-65% of the copy bandwidth (results/h100/fp8/). The GEMV streams W into registers through
cp.async and multiplies on CUDA cores. This script finds its launch configs and says, shape by shape, whether it
is faster; its table is the format spanllm.kernels.gemv reads (SPANLLM_GEMV_TABLE, or committed beside the kernel).

Per dtype (fp8: e4m3 weights with per-row scales, quantized as the engine does; bf16) and layer (the 8B at TP 1;
bf16 also the LM head): stage 1 times each (BLOCK_N, BLOCK_K) tiling with 3 stages and a split-K that gives
every SM >= 4 programs; stage 2 varies stages, split and warps around the best two. Every config is checked
against the fp32 reference (max |y - ref| / max |ref| < TOL) and for bit-identical reruns before it is timed.
The skinny GEMM at the config it would run (`skinny_gemm.choose_config`: the measured table, else its heuristic)
and, for bf16, F.linear are timed on the same weights; the skinny GEMM again at the end of the layer (drift).

Timing: a CUDA graph of >= 20 calls over distinct weights filling >= 3x L2 (each call streams its weight from
HBM, as a decode step walking its layers does), microseconds per call, median over replays; GB/s = weight bytes
/ time, beside the device-to-device copy bandwidth measured in the same run. Budget: no measurement starts that
would end after --budget-s (the longest so far is the estimate); what is left is recorded as skipped.

Writes OUTDIR/gemv.json (machine, versions, settings, every row) after every measurement and OUTDIR/gemv_configs.json
(per shape: the best config, gemv_us, skinny_us, torch_us) at the end. Exits non-zero with one line without a
CUDA GPU or Triton.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

SCRIPTS = os.path.dirname(os.path.abspath(__file__))
if __package__ in (None, "") and __name__ == "__main__":  # `python scripts/gpu_gemv.py` without PYTHONPATH=.
    sys.path.insert(0, os.path.dirname(SCRIPTS))
sys.path.insert(0, SCRIPTS)  # the widening benchmark's shapes, data and checks (its sibling)

from gpu_fp8_widen import LAYERS, TOL, max_rel_err, quantized_weight  # noqa: E402

from spanllm.kernels import gemv as gv  # noqa: E402
from spanllm.kernels import skinny_gemm as sg  # noqa: E402

LM_HEAD = {"lm_head": (128256, 4096)}
TILINGS = [(2, 1024), (2, 2048), (4, 512), (4, 1024), (4, 2048), (8, 256), (8, 512), (8, 1024), (8, 2048), (16, 256),
           (16, 512), (16, 1024), (32, 256), (32, 512)]  # fmt: skip
MAX_ACC_PER_THREAD = 64  # fp32 accumulators a thread holds (BLOCK_N * BLOCK_K / threads): more spills


def warps_for(block_n: int, block_k: int) -> int:
    return 4 if block_n * block_k <= MAX_ACC_PER_THREAD * 32 * 4 else 8


def split_for(n: int, k: int, block_n: int, block_k: int, sms: int) -> int:
    """The smallest split-K (1, 2, 4, 8, 16) giving >= 4 programs per SM with chunks of >= 2 tiles, else the largest
    that keeps 2 tiles a chunk."""
    tiles = -(-n // block_n)
    best = 1
    for s in (1, 2, 4, 8, 16):
        if (k // block_k) < 2 * s:
            break
        best = s
        if tiles * s >= 4 * sms:
            return s
    return best


def stage1(n: int, k: int, sms: int) -> list[gv.GemvConfig]:
    return [
        gv.GemvConfig(bn, bk, split_for(n, k, bn, bk, sms), warps_for(bn, bk), 3) for bn, bk in TILINGS if k % bk == 0
    ]


def stage2(best: gv.GemvConfig, k: int) -> list[gv.GemvConfig]:
    """Around a config: 2 and 4 stages, half and double the split, the other warp count where it fits."""
    out = [best._replace(num_stages=s) for s in (2, 4)]
    for s in (best.split_k // 2, best.split_k * 2):
        if s >= 1 and (k // best.block_k) >= 2 * s:
            out.append(best._replace(split_k=s))
    other = 8 if best.num_warps == 4 else 4
    if best.block_n * best.block_k <= MAX_ACC_PER_THREAD * 32 * other:
        out.append(best._replace(num_warps=other))
    return out


def reference(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    wf = w.float() if scale is None else w.float() * scale[:, None]
    return x.float() @ wf.T


def make_weight(dtype: str, n: int, k: int, device, gen) -> tuple[torch.Tensor, torch.Tensor | None]:
    """W = randn * 0.02 in bf16, or quantized per row to FP8 as the engine does (gpu_fp8_widen.quantized_weight)."""
    if dtype == "fp8":
        return quantized_weight(n, k, device, gen)
    return (torch.randn(n, k, device=device, generator=gen) * 0.02).to(torch.bfloat16), None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("outdir")
    ap.add_argument("--budget-s", type=float, default=240.0, help="start no measurement that would end after this")
    ap.add_argument("--dtypes", default="fp8,bf16")
    ap.add_argument("--layers", default=",".join([*LAYERS, *LM_HEAD]), help="lm_head runs in bf16 only")
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--min-calls", type=int, default=20, help="calls per CUDA graph (at least)")
    args = ap.parse_args()
    if gv.triton is None:
        raise SystemExit("scripts/gpu_gemv.py: needs Triton (not installed)")
    unknown = [d for d in args.dtypes.split(",") if d not in ("fp8", "bf16")]
    if unknown:
        raise SystemExit(f"scripts/gpu_gemv.py: unknown --dtypes {unknown}; known: fp8, bf16")
    if not torch.cuda.is_available():
        raise SystemExit("scripts/gpu_gemv.py: needs a CUDA GPU; none found")
    run(args)


def run(args) -> None:
    from spanllm.commands.bench_gemm import copy_bandwidth
    from spanllm.measure.timing import graph_us_per_call

    t0 = time.monotonic()
    longest = 5.0  # a first guess at one measurement (a compile and a graph), before any was timed
    device = torch.device("cuda")
    props = torch.cuda.get_device_properties(0)
    sms = props.multi_processor_count
    l2 = getattr(props, "L2_cache_size", 50 << 20)
    os.makedirs(args.outdir, exist_ok=True)
    out_path = os.path.join(args.outdir, "gemv.json")
    try:
        from spanllm.measure.report import versions

        vers = versions()
    except Exception as e:  # noqa: BLE001 - versions are nice to have
        vers = {"torch": torch.__version__, "triton": gv.triton.__version__, "error": repr(e)}
    shapes = {**LAYERS, **LM_HEAD}
    doc = {
        "machine": {"gpu": torch.cuda.get_device_name(0), "sms": sms, "l2_MiB": round(l2 / 2**20, 1)},
        "versions": vers,
        "settings": {
            "budget_s": args.budget_s,
            "dtypes": args.dtypes.split(","),
            "layers": {name: shapes[name] for name in args.layers.split(",")},
            "replays": args.replays,
            "min_calls": args.min_calls,
            "tol": TOL,
            "timing": "CUDA graph of >= min_calls calls over >= 3x L2 of distinct weights, us per call, median",
            "skinny_gemm_table": sg.table_id(),
            "pdl": "off (kernels launched without it)",
        },
        "copy_GBps": round(copy_bandwidth(1.0)["TBps_read_plus_write"] * 1e3, 1),
        "rows": [],
    }
    print(f"{doc['machine']['gpu']}: device copy {doc['copy_GBps']:.0f} GB/s (read + write)", flush=True)

    def save() -> None:
        doc["seconds"] = round(time.monotonic() - t0, 1)
        with open(out_path, "w") as f:
            json.dump(doc, f, indent=1)

    def measure(row: dict, fn, count: int, calls: int, check) -> None:
        """Check (err, rerun equality) then time fn(i) in a graph; fills row."""
        nonlocal longest
        if time.monotonic() - t0 + longest > args.budget_s:
            row["skipped"] = "budget"
            return
        started = time.monotonic()
        try:
            y = fn(0)
            row["err"] = max_rel_err(y, check)
            row["rerun_equal"] = bool(torch.equal(y, fn(0)))
            if not row["err"] < TOL:
                row["failed"] = f"max rel error {row['err']:.3g} >= {TOL}"
            elif not row["rerun_equal"]:
                row["failed"] = "a rerun on the same inputs differed"
            else:
                us = graph_us_per_call(fn, calls, args.replays)
                row.update(us=[round(t, 3) for t in us], median_us=round(statistics.median(us), 3))
        except Exception as e:  # noqa: BLE001 - a compile failure or out-of-resources is a result
            row["failed"] = f"{type(e).__name__}: {e}"[:400]
        longest = max(longest, time.monotonic() - started)
        doc["rows"].append(row)
        save()

    gen = torch.Generator(device=device).manual_seed(0)
    table = []
    for dtype in args.dtypes.split(","):
        for layer in args.layers.split(","):
            if layer in LM_HEAD and dtype != "bf16":
                continue  # the FP8 engine keeps its LM head in bf16
            entry = run_layer(dtype, layer, shapes[layer], measure, doc["copy_GBps"], sms, l2, args.min_calls, gen)
            if entry is not None:
                table.append(entry)
                write_table(args.outdir, doc["machine"]["gpu"], table)  # after every layer: a timeout keeps them
            torch.cuda.empty_cache()
    doc["table"] = table
    save()
    print("wrote", out_path, flush=True)


def write_table(outdir: str, gpu: str, table: list[dict]) -> None:
    with open(os.path.join(outdir, "gemv_configs.json"), "w") as f:
        json.dump({"about": f"scripts/gpu_gemv.py on {gpu}", "entries": table}, f, indent=1)


def run_layer(dtype: str, layer: str, shape, measure, copy_gbps: float, sms: int, l2: int, min_calls: int, gen):
    """Every kernel at one (dtype, layer); the table entry (best GEMV config and the times beside it) or None."""
    n, k = shape
    eb = 1 if dtype == "fp8" else 2
    device = torch.device("cuda")
    count = max(4, math.ceil(3 * l2 / (n * k * eb)))
    weights = [make_weight(dtype, n, k, device, gen) for _ in range(count)]
    calls = count * math.ceil(min_calls / count)
    x = torch.randn(1, k, device=device, generator=gen).to(torch.bfloat16)
    ref = reference(x, *weights[0])
    base = {"dtype": dtype, "layer": layer, "n": n, "k": k}

    def timed(row: dict, fn) -> dict:
        measure(row, fn, count, calls, ref)
        if "median_us" in row:
            gbps = n * k * eb / row["median_us"] / 1e3
            row["GBps"] = round(gbps, 1)
            what = f"{row['median_us']:8.2f} us {gbps:6.0f} GB/s {100 * gbps / copy_gbps:4.0f}%"
        else:
            what = row.get("failed") or row.get("skipped", "")
        kernel = row["kernel"] + (" again" if row.get("again") else "")
        print(f"{dtype:4s} {layer:8s} {kernel:12s} {str(row.get('config', '')):24s} {what}", flush=True)
        return row

    skinny_cfg = tuple(sg.choose_config(1, n, k, sms, eb, x_bytes=2))

    def skinny(i: int) -> torch.Tensor:
        w, s = weights[i % count]
        return sg.skinny_linear(x, w, config=skinny_cfg, weight_scale=s)

    prod = timed({**base, "kernel": "skinny", "config": list(skinny_cfg)}, skinny)
    torch_row = None
    if dtype == "bf16":
        torch_row = timed({**base, "kernel": "torch"}, lambda i: F.linear(x, weights[i % count][0]))
    tried: dict[gv.GemvConfig, dict] = {}

    def try_config(cfg: gv.GemvConfig) -> None:
        if cfg not in tried:
            fn = lambda i: gv.gemv(x, weights[i % count][0], cfg, weights[i % count][1])  # noqa: E731
            tried[cfg] = timed({**base, "kernel": "gemv", "config": list(cfg)}, fn)

    for cfg in stage1(n, k, sms):
        try_config(cfg)
    for _, cfg in sorted((r["median_us"], c) for c, r in tried.items() if "median_us" in r)[:2]:
        for c2 in stage2(cfg, k):
            try_config(c2)
    timed({**base, "kernel": "skinny", "config": list(skinny_cfg), "again": True}, skinny)
    ranked = sorted((r["median_us"], c) for c, r in tried.items() if "median_us" in r)
    if not ranked or "median_us" not in prod:
        return None
    us, cfg = ranked[0]
    entry = {
        "n": n, "k": k, "elem_bytes": eb, "shape": f"8B {layer} (TP 1), {dtype}", "config": list(cfg),
        "gemv_us": us, "skinny_us": prod["median_us"], "skinny_config": list(skinny_cfg),
    }  # fmt: skip
    if torch_row is not None and "median_us" in torch_row:
        entry["torch_us"] = torch_row["median_us"]
    print(f"  best gemv {tuple(cfg)} {us:.2f} us vs skinny {prod['median_us']:.2f} us ({prod['median_us'] / us:.2f}x)")
    return entry


if __name__ == "__main__":
    main()
