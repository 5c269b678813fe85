"""What the cascade prefill (spanllm.attention.cascade) pays beside its two attentions, on one GPU:

1. cuDNN's first call at a new shape: torch builds a cuDNN graph and execution plan per (queries, keys, causal,
   strides) and caches it; a long prompt's chunks meet shapes a server has not seen. For each shape the cascade
   runs on a 36k and a 111k prompt (chunk 16,384; 32 query / 8 KV heads of 128, bf16; the cascade's layouts, GQA
   in the causal part), the first call's time and the median of the next calls (CUDA-event timed, synchronized).
   (Its first run, results/h100/long_context/call_f/, timed the causal part with K/V repeated to 32 heads.)
2. Whether torch's cuDNN attention takes fewer KV heads than query heads (GQA) directly: if it does, the chunk's
   own K/V need not be repeated per query head. Checked against the repeated call (max abs difference).
3. The merge of the two parts: spanllm.kernels.cascade_merge's kernel against the same math in torch
   (merge_into_reference), us per call at c = 3,634 and 16,384 rows.

    python3 scripts/gpu_cascade_probe.py OUTDIR

Writes OUTDIR/cascade_probe.json (machine, versions, settings, raw times).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

HQ, HKV, D = 32, 8, 128
G = HQ // HKV


def event_ms(fn) -> float:
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    a.record()
    fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b)


def wall_ms(fn) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) * 1e3


def plan_costs(dev) -> list[dict]:
    from spanllm.attention.cascade import cudnn_attention

    rows = []
    # (label, query rows, keys, causal, heads): the causal part per query head; the prefix part GQA-folded
    shapes = []
    for n in (36402, 111352):
        c, start = 16384, 0
        while start < n:
            q = min(c, n - start)
            shapes.append((f"{n}: causal q={q}", q, q, True, HQ))
            if start:
                shapes.append((f"{n}: prefix q={q} keys={start}", G * q, start, False, HKV))
            start += q
    seen = set()
    for label, lq, lk, causal, h in shapes:
        key = (lq, lk, causal, h)
        if key in seen:
            rows.append({"shape": label, "seen_before": True})
            continue
        seen.add(key)
        first, later = first_and_later(cudnn_attention, lq, lk, causal, h, dev)
        rows.append(
            {
                "shape": label,
                "q_rows": lq,
                "keys": lk,
                "causal": causal,
                "heads": h,
                "first_call_wall_ms": round(first, 3),
                "later_ms": [round(x, 3) for x in later],
                "first_minus_median_ms": round(first - statistics.median(later), 3),
            }
        )
        print(rows[-1], flush=True)
    return rows


def first_and_later(attention, lq: int, lk: int, causal: bool, h: int, dev) -> tuple[float, list[float]]:
    """The first call's wall time at this shape (the plan build included) and 3 later calls' event times, ms. The
    layouts are the cascade's (cuDNN's plans are keyed by strides too): the causal part's q a [1, 32, lq, d] view of
    the step's [lq, 32, d] rows, its K/V [1, 8, lk, d] views of a gathered [lk, 8, d] (GQA); the prefix part's
    folded q contiguous [1, 8, 4 lq, d], its K/V views of a gather [lk + lq / 4, 8, d] that also holds the chunk."""
    if causal:
        q = torch.randn(lq, HQ, D, device=dev, dtype=torch.bfloat16).transpose(0, 1)[None]
        k, v = (torch.randn(lk, HKV, D, device=dev, dtype=torch.bfloat16).transpose(0, 1)[None] for _ in range(2))
    else:
        q = torch.randn(1, h, lq, D, device=dev, dtype=torch.bfloat16)
        c = lq // G
        k, v = (
            torch.randn(lk + c, HKV, D, device=dev, dtype=torch.bfloat16)[:lk].transpose(0, 1)[None] for _ in range(2)
        )
    first = wall_ms(lambda: attention(q, k, v, causal))
    return first, [event_ms(lambda: attention(q, k, v, causal)) for _ in range(3)]


def gqa_probe(dev) -> dict:
    from spanllm.attention.cascade import cudnn_attention

    c = 2048
    q = torch.randn(1, HQ, c, D, device=dev, dtype=torch.bfloat16)
    k = torch.randn(1, HKV, c, D, device=dev, dtype=torch.bfloat16)
    v = torch.randn(1, HKV, c, D, device=dev, dtype=torch.bfloat16)
    want, want_lse = cudnn_attention(q, k.repeat_interleave(G, 1), v.repeat_interleave(G, 1), True)
    try:
        got, lse = cudnn_attention(q, k, v, True)
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 - the probe's answer
        return {"accepted": False, "error": f"{type(e).__name__}: {str(e)[:300]}"}
    return {
        "accepted": True,
        "max_abs_diff_out": float((got.float() - want.float()).abs().max()),
        "max_abs_diff_lse": float((lse - want_lse).abs().max()),
    }


def merge_times(dev) -> list[dict]:
    from spanllm.kernels.cascade_merge import merge_into, merge_into_reference

    rows = []
    for c in (3634, 16384):
        o1 = torch.randn(HKV, G * c, D, device=dev, dtype=torch.bfloat16)
        lse1 = torch.randn(HKV, G * c, device=dev) + 5
        o2 = torch.randn(c, HQ, D, device=dev, dtype=torch.bfloat16).transpose(0, 1)  # a view, as cuDNN's output
        lse2 = torch.randn(HQ, c, device=dev) + 5
        out = torch.empty(c, HQ, D, device=dev, dtype=torch.bfloat16)
        want = torch.empty_like(out)
        merge_into_reference(want, o1, lse1, o2, lse2)
        merge_into(out, o1, lse1, o2, lse2)
        diff = float((out.float() - want.float()).abs().max())
        t = {}
        args = (out, o1, lse1, o2, lse2)
        for name, fn in (("kernel", merge_into), ("torch", merge_into_reference)):
            for _ in range(3):
                fn(*args)
            t[name] = sorted(event_ms(lambda fn=fn, args=args: fn(*args)) * 1e3 for _ in range(20))
        rows.append(
            {
                "rows": c,
                "max_abs_diff_kernel_vs_torch": diff,
                "kernel_us_median": round(statistics.median(t["kernel"]), 1),
                "torch_us_median": round(statistics.median(t["torch"]), 1),
                "kernel_us": [round(x, 1) for x in t["kernel"]],
                "torch_us": [round(x, 1) for x in t["torch"]],
            }
        )
        print(rows[-1]["rows"], rows[-1]["kernel_us_median"], rows[-1]["torch_us_median"], diff, flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("outdir")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit(f"{os.path.basename(__file__)}: needs a CUDA GPU (run it on the device machine)")
    os.makedirs(args.outdir, exist_ok=True)
    from spanllm.commands.bench_throughput import machine_info

    dev = torch.device("cuda")
    result = {"machine": machine_info(dev), "settings": {"hq": HQ, "hkv": HKV, "head_dim": D, "chunk": 16384}}
    for name, fn in (("merge", merge_times), ("gqa", gqa_probe), ("plans", plan_costs)):
        try:
            result[name] = fn(dev)
        except Exception:  # noqa: BLE001 - recorded, the next part still runs
            result[name] = {"error": traceback.format_exc()[-2000:]}
            print(result[name]["error"], flush=True)
        with open(os.path.join(args.outdir, "cascade_probe.json"), "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
