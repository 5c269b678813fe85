"""The paged decode kernel's launch shape (keys per tile, warps, pipeline stages) by KV-cache dtype, on one GPU.

An FP8 cache holds half the bytes of a bf16 one per key: at the same tile size every load in flight carries half
as much, so a kernel bound by bytes in flight reads an FP8 cache well below the copy bandwidth (issue 30's FP8
ShareGPT profile: the decode kernel at ~55% of it). This sweep times spanllm.kernels.paged_attention.decode for
each launch shape at decode batches of the serving workloads (8B: 32 query / 8 KV heads of 128, block size 16,
shuffled blocks), checks each against the default shape's output, and reports GB/s of K/V read and the best shape
per dtype (geometric mean over the batches): what DECODE_LAUNCH should say. A graph's calls rotate over copies of
the pool where one copy would fit the L2 cache (the first run, results/h100/decode_launch/, did not: its 1 x 8,192
case was read from L2).

--widen fp16,bf16 times both widenings of an FP8 cache (paged_attention.decode_widens_to_f16) at each launch shape;
--launches, --dtypes and --shapes narrow the sweep. --min-tiles times each launch at several least key tiles per
split (paged_attention.MIN_TILES_PER_SPLIT): at batch 1 and a short context the kernel is latency, not bytes (the
H100's batch-1 FP8 profile: 7.5 us a layer at 256 keys, 1 MB of K/V), and how the 256 keys are split among programs
(one tile each and a merge, or all of them in one program) decides it.

    python3 scripts/gpu_decode_launch.py OUTDIR [--budget-s 150] [--dtypes fp8,bf16] [--launches 128x4x2,64x4x3]
        [--widen fp16,bf16] [--shapes 1x256,1x1024] [--min-tiles 1,2,4]

Writes OUTDIR/decode_launch.json (machine, versions, settings, every timing).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

HQ, HKV, D, BS = 32, 8, 128, 16
SHAPES = [(256, 256), (256, 512), (256, 1024), (64, 2048), (16, 4096), (1, 8192)]  # (batch, context)
LAUNCHES = list(itertools.product((32, 64, 128), (4, 8), (2, 3, 4)))
DTYPES = {"fp8": torch.float8_e4m3fn, "bf16": torch.bfloat16}


def make(batch: int, ctx: int, dtype: torch.dtype, dev):
    g = torch.Generator(device=dev).manual_seed(batch * 7 + ctx)
    per = -(-ctx // BS)
    blocks = batch * per + 1
    kc = torch.randn(blocks, BS, HKV, D, device=dev, generator=g).to(dtype)
    vc = torch.randn(blocks, BS, HKV, D, device=dev, generator=g).to(dtype)
    ids = (torch.randperm(blocks - 1, device=dev, generator=g) + 1).to(torch.int32)
    tables = ids[: batch * per].view(batch, per).contiguous()
    cl = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
    q = torch.randn(batch, HQ, D, device=dev, generator=g, dtype=torch.bfloat16)
    return q, kc, vc, tables, cl


def _int_tuples(text: str, n: int) -> list[tuple[int, ...]]:
    """'1x256,16x4096' -> [(1, 256), (16, 4096)] for n = 2; [] where an item is not n integers joined by x."""
    try:
        items = [tuple(int(v) for v in x.split("x")) for x in text.split(",")]
    except ValueError:
        return []
    return items if all(len(x) == n for x in items) else []


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("outdir")
    ap.add_argument("--budget-s", type=float, default=150.0)
    ap.add_argument("--dtypes", default="fp8,bf16", help="KV-cache dtypes, from fp8,bf16")
    ap.add_argument("--launches", default=None, help="keys x warps x stages list, e.g. 128x4x2,64x4x3 (default: all)")
    ap.add_argument(
        "--widen", default=None, help="an FP8 cache's widenings to time, from fp16,bf16 (default: the default)"
    )
    ap.add_argument("--shapes", default=None, help="batch x context list, e.g. 1x256,1x1024 (default: the serving set)")
    ap.add_argument(
        "--min-tiles",
        default=None,
        help="least key tiles per split to time, e.g. 1,2,4 (default: the kernel's default)",
    )
    args = ap.parse_args()
    dtypes = [DTYPES.get(x) for x in args.dtypes.split(",")]
    if None in dtypes:
        sys.exit(f"--dtypes {args.dtypes!r}: a comma list of {', '.join(DTYPES)}")
    launches = _int_tuples(args.launches, 3) if args.launches else LAUNCHES
    if not launches or any(x not in LAUNCHES for x in launches):
        sys.exit(f"--launches {args.launches!r}: keys x warps x stages from {sorted(set(LAUNCHES))[:3]}...")
    shapes = _int_tuples(args.shapes, 2) if args.shapes else SHAPES
    if not shapes or any(min(x) < 1 for x in shapes):
        sys.exit(f"--shapes {args.shapes!r}: a comma list of batch x context, each >= 1, e.g. 1x256,16x4096")
    min_tiles = [None] if args.min_tiles is None else [x[0] for x in _int_tuples(args.min_tiles, 1)]
    if not min_tiles or any(x is not None and x < 1 for x in min_tiles):
        sys.exit(f"--min-tiles {args.min_tiles!r}: a comma list of integers >= 1")
    widens = [None] if args.widen is None else args.widen.split(",")
    if any(w not in (None, "fp16", "bf16") for w in widens):
        sys.exit(f"--widen {args.widen!r}: a comma list of fp16, bf16")
    if not torch.cuda.is_available():
        sys.exit(f"{os.path.basename(__file__)}: needs a CUDA GPU (run it on the device machine)")
    os.makedirs(args.outdir, exist_ok=True)
    from spanllm.commands.bench_throughput import machine_info
    from spanllm.kernels import paged_attention as kt
    from spanllm.measure.timing import graph_us_per_call

    dev = torch.device("cuda")
    t_end = time.monotonic() + args.budget_s
    result = {
        "machine": machine_info(dev),
        "settings": {
            "hq": HQ,
            "hkv": HKV,
            "head_dim": D,
            "block_size": BS,
            "shapes": shapes,
            "min_tiles": min_tiles,
            "launches": launches,
            "widen": widens,
        },
        "default_launch": {str(k): v for k, v in kt.DECODE_LAUNCH.items()},
        "default_min_tiles": kt.MIN_TILES_PER_SPLIT,
        "rows": [],
        "skipped": [],
    }
    path = os.path.join(args.outdir, "decode_launch.json")
    for dtype, widen in [(d, w) for d in dtypes for w in (widens if d == torch.float8_e4m3fn else [None])]:
        for batch, ctx in shapes:
            q, kc, vc, tables, cl = make(batch, ctx, dtype, dev)
            splits = kt.num_splits_for(batch, HKV, dev)
            want = kt.decode(q, kc, vc, tables, cl, splits)
            kv_bytes = 2 * batch * ctx * HKV * D * kc.element_size()
            # K/V that fit the L2 cache would be read from it on every call after the first: the calls of a graph
            # rotate over enough copies of the pool to hold >= 3x the H100's 50 MB
            copies = [(q, kc, vc, tables, cl)]
            while len(copies) * kv_bytes < 150e6 and len(copies) < 16:
                copies.append((q, kc.clone(), vc.clone(), tables, cl))
            for (bn, warps, stages), mt in itertools.product(launches, min_tiles):
                key = {"dtype": str(dtype), "batch": batch, "context": ctx, "block_n": bn, "warps": warps}
                key["stages"] = stages
                key["min_tiles"] = mt or kt.MIN_TILES_PER_SPLIT
                key["widen"] = widen or ("fp16" if kt.decode_widens_to_f16(q.dtype, kc.dtype) else "none")
                if time.monotonic() > t_end:
                    result["skipped"].append(key)
                    continue

                def call(i, copies=copies, splits=splits, bn=bn, warps=warps, stages=stages, widen=widen, mt=mt):
                    # call i of a graph reads pool copy i mod copies
                    inputs = copies[i % len(copies)]
                    return kt.decode(*inputs, splits, mt, block_n=bn, num_warps=warps, num_stages=stages, widen=widen)

                try:
                    err = float((call(0).float() - want.float()).abs().max())
                    us = graph_us_per_call(call, calls=max(20, len(copies)), replays=5)
                except Exception as e:  # noqa: BLE001 - a shape that does not compile is recorded, not fatal
                    result["rows"].append({**key, "error": f"{type(e).__name__}: {str(e)[:200]}"})
                    continue
                med = statistics.median(us)
                result["rows"].append(
                    {
                        **key,
                        "splits": splits,
                        "pool_copies": len(copies),
                        "max_abs_diff": err,
                        "us": [round(x, 2) for x in us],
                        "us_median": round(med, 2),
                        "kv_gb_per_s": round(kv_bytes / med / 1e3, 1),
                    }
                )
            best = min(
                (
                    r
                    for r in result["rows"]
                    if r.get("batch") == batch
                    and r.get("context") == ctx
                    and r["dtype"] == str(dtype)
                    and r["widen"] == key["widen"]
                    and "us_median" in r
                ),
                key=lambda r: r["us_median"],
                default=None,
            )
            if best:
                print(
                    f"{dtype} (widen {best['widen']}) b{batch} ctx{ctx}: best {best['block_n']}x{best['warps']}w "
                    f"x{best['stages']}s min_tiles {best['min_tiles']} "
                    f"{best['us_median']} us, {best['kv_gb_per_s']} GB/s",
                    flush=True,
                )
            with open(path, "w") as f:
                json.dump(result, f, indent=1)
    # the best launch per dtype (and widening): geometric mean of its time relative to each shape's best (over every
    # launch and widening of that dtype), over every shape
    summary = {}
    for dtype, widen in sorted({(r["dtype"], r["widen"]) for r in result["rows"]}):
        ok = [r for r in result["rows"] if r["dtype"] == dtype and "us_median" in r and r["max_abs_diff"] < 2e-2]
        rows = [r for r in ok if r["widen"] == widen]
        best_of = {}
        for r in ok:
            k = (r["batch"], r["context"])
            best_of[k] = min(best_of.get(k, math.inf), r["us_median"])
        by_launch = {}
        for r in rows:
            by_launch.setdefault((r["block_n"], r["warps"], r["stages"], r["min_tiles"]), []).append(
                r["us_median"] / best_of[(r["batch"], r["context"])]
            )
        full = {k: v for k, v in by_launch.items() if len(v) == len(best_of)}
        ranked = sorted(full.items(), key=lambda kv: math.exp(statistics.fmean(map(math.log, kv[1]))))
        summary[f"{dtype} widen {widen}"] = [
            {
                "launch": list(k[:3]),
                "min_tiles": k[3],
                "geomean_vs_best": round(math.exp(statistics.fmean(map(math.log, v))), 3),
            }
            for k, v in ranked[:5]
        ]
        print(dtype, "widen", widen, summary[f"{dtype} widen {widen}"][:3], flush=True)
    result["summary"] = summary
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
