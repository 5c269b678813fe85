"""The paged prefill attention kernel alone on one GPU, in TFLOPS: a chunk of 8,192 queries (32 query / 8 KV heads
of 128, bf16, the engine's KV block size) against cached prefixes of 0 to 120k keys, for a sweep of
PrefillConfig tilings, beside torch SDPA's flash, cuDNN and memory-efficient backends on contiguous K/V of the
same shapes (bottom-right causal: query i of the chunk sees keys [0, prefix + i]).

    python scripts/gpu_prefill_attention.py OUTDIR [--quick]

Writes OUTDIR/prefill_attention.json (machine, versions, settings, every rep's time, each entry's correctness
check), OUTDIR/prefill_attention.png (TFLOPS vs prefix) and OUTDIR/best_prefill_config.json (the fastest tiling
that passed its check; scripts/gpu_long_context.py --prefill-config reads it). Every entry is first checked
against the exact answer (float32, one head at a time, no library kernel) at prefix CHECK_PREFIX: an entry whose
max abs error exceeds MAX_ABS_ERR is measured but cannot be the best. Each entry and shape catches its own
failure, records it and goes on; past the time budget the remaining ones are recorded as skipped.

Also measured: the engine's cascade prefill (spanllm.attention.cascade, --prefill-attention cudnn-cascade /
flash-cascade): the prefix K/V gathered from the paged pool, torch's cuDNN (or flash) attention of the chunk over
the prefix without a mask and over its own keys square-causal, merged by log-sum-exp; gather, both attentions
and the merge all inside the timed call.

Not measured: Triton's fused-attention tutorial kernel, which has no causal mask for a chunk after a prefix
(its causal case needs as many queries as keys).

FLOPs are counted exactly: 4 * head_dim per (query, key) pair per query head, pairs = q * prefix + q(q+1)/2.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback
from collections.abc import Callable

Q_LEN = 8192
PREFIXES = (0, 8192, 16384, 32768, 65536, 98304, 122880)
QUICK_PREFIXES = (0, 32768, 122880)
HQ, HKV, HEAD_DIM = 32, 8, 128
CHECK_PREFIX = 8192  # the shape every entry is checked on
MAX_ABS_ERR = 2e-2  # bf16 output of random-normal inputs: a right kernel is ~1e-3 off
TIME_BUDGET_S = 240.0


def causal_pairs(q_len: int, prefix: int) -> int:
    """(query, key) pairs a chunk of q_len queries after `prefix` cached keys attends: q * prefix + q(q+1)/2."""
    return q_len * prefix + q_len * (q_len + 1) // 2


def attention_flops(q_len: int, prefix: int, num_heads: int = HQ, head_dim: int = HEAD_DIM) -> int:
    """QK^T and PV: 2 multiply-adds of head_dim per pair and head."""
    return 4 * head_dim * causal_pairs(q_len, prefix) * num_heads


def tflops(flops: int, ms: float) -> float:
    return flops / (ms * 1e-3) / 1e12


def sweep_configs(quick: bool) -> list:
    """The tilings to try (the default first), for 32 / 8 heads in bf16."""
    from spanllm.kernels.prefill_config import PrefillConfig, prefill_config

    default = prefill_config(HQ // HKV, _bf16())
    rest = [
        PrefillConfig(block_q=32, block_n=128, num_warps=8, num_stages=2),
        PrefillConfig(block_q=32, block_n=64, num_warps=8, num_stages=4),
        PrefillConfig(block_q=32, block_n=64, num_warps=8, num_stages=3, lazy_rescale=True),
        PrefillConfig(block_q=32, block_n=32, num_warps=4, num_stages=4),
        PrefillConfig(block_q=16, block_n=64, num_warps=4, num_stages=3),  # the previous kernel's 64-row tiling
        PrefillConfig(block_q=16, block_n=128, num_warps=4, num_stages=2),
    ]
    return [default] + (rest[:2] if quick else rest)


def _bf16():
    import torch

    return torch.bfloat16


# --- the measurement (GPU) ----------------------------------------------------------------------------------


class Problem:
    """One paged pool holding the longest sequence (block ids shuffled), its table, and per shape the
    contiguous K/V that SDPA reads (the same values, expanded to the query heads)."""

    def __init__(self, max_prefix: int, block_size: int, device, seed: int = 0) -> None:
        import torch

        g = torch.Generator(device=device).manual_seed(seed)
        n_max = max_prefix + Q_LEN
        nblk = -(-n_max // block_size)
        dt = torch.bfloat16
        self.block_size = block_size
        self.k_cache = torch.randn(nblk + 1, block_size, HKV, HEAD_DIM, device=device, dtype=dt, generator=g)
        self.v_cache = torch.randn(nblk + 1, block_size, HKV, HEAD_DIM, device=device, dtype=dt, generator=g)
        ids = torch.randperm(nblk, device=device, generator=g).to(torch.int32) + 1
        self.tables = ids[None, :].contiguous()  # [1, nblk]
        self.q = torch.randn(Q_LEN, HQ, HEAD_DIM, device=device, dtype=dt, generator=g)
        self.cu_q = torch.tensor([0, Q_LEN], dtype=torch.int32, device=device)
        self.device = device

    def context_lens(self, prefix: int):
        import torch

        return torch.tensor([prefix + Q_LEN], dtype=torch.int32, device=self.device)

    def contiguous_kv(self, prefix: int):
        """K, V [1, HQ, n, d] (each KV head repeated for its query heads) and q [1, HQ, Q_LEN, d]."""
        n = prefix + Q_LEN
        blocks = self.tables[0, : -(-n // self.block_size)].long()

        def gather(cache):
            kv = cache[blocks].reshape(-1, HKV, HEAD_DIM)[:n]  # [n, hkv, d]
            return kv.transpose(0, 1).repeat_interleave(HQ // HKV, dim=0)[None].contiguous()

        return self.q.transpose(0, 1)[None].contiguous(), gather(self.k_cache), gather(self.v_cache)


def reference_output(problem: Problem, prefix: int):
    """The exact answer in float32, one head at a time (no library kernel): [Q_LEN, HQ, d]."""
    import torch

    q, k, v = problem.contiguous_kv(prefix)
    n = prefix + Q_LEN
    mask = torch.arange(n, device=q.device)[None, :] <= (prefix + torch.arange(Q_LEN, device=q.device))[:, None]
    out = torch.empty(Q_LEN, HQ, HEAD_DIM, device=q.device, dtype=torch.float32)
    for h in range(HQ):
        s = (q[0, h].float() @ k[0, h].float().T) / math.sqrt(HEAD_DIM)  # [Q_LEN, n]
        s.masked_fill_(~mask, float("-inf"))
        out[:, h] = torch.softmax(s, dim=-1) @ v[0, h].float()
    return out


def kernel_entry(problem: Problem, config) -> Callable:
    """make(prefix) -> (fn, to_thd): fn runs the paged kernel; to_thd(out) is its [Q_LEN, HQ, d] output."""
    import torch

    from spanllm.kernels import paged_attention as kt

    def make(prefix: int):
        cl = problem.context_lens(prefix)
        tiles = torch.tensor(
            kt.prefill_tiles([Q_LEN], HQ // HKV, context_lens=[prefix + Q_LEN], block_q=config.block_q),
            dtype=torch.int32,
            device=problem.device,
        )
        out = torch.empty_like(problem.q)
        p = problem

        def fn():
            return kt.prefill(p.q, p.k_cache, p.v_cache, p.tables, p.cu_q, cl, tiles, out=out, config=config)

        return fn, lambda o: o

    return make


def sdpa_entry(problem: Problem, backend: str) -> Callable:
    """SDPA on contiguous K/V. No prefix: is_causal. After a prefix: flash through its aten op, whose causal
    flag is bottom-right when keys outnumber queries (what causal_lower_right dispatches to); cuDNN and
    efficient with the bottom-right mask materialized as a boolean [q, n] (the backend restricted, so an
    unsupported case raises instead of falling back to the math kernel)."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    kinds = {
        "flash": SDPBackend.FLASH_ATTENTION,
        "cudnn": SDPBackend.CUDNN_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
    }

    def make(prefix: int):
        q, k, v = problem.contiguous_kv(prefix)
        n = prefix + Q_LEN
        if prefix == 0:

            def fn():
                with sdpa_kernel([kinds[backend]]):
                    return F.scaled_dot_product_attention(q, k, v, is_causal=True)

        elif backend == "flash":
            scale = 1.0 / math.sqrt(HEAD_DIM)

            def fn():
                return torch.ops.aten._scaled_dot_product_flash_attention(
                    q, k, v, 0.0, is_causal=True, return_debug_mask=False, scale=scale
                )[0]

        else:
            mask = torch.arange(n, device=q.device)[None, :] <= (prefix + torch.arange(Q_LEN, device=q.device))[:, None]

            def fn():
                with sdpa_kernel([kinds[backend]]):
                    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

        return fn, lambda o: o[0].transpose(0, 1)

    return make


def cascade_entry(problem: Problem, attention: str) -> Callable:
    """The engine's cascade prefill (attention: a key of spanllm.attention.cascade.CASCADE_ATTENTION) on the
    paged pool at the engine's rounded shapes: make(prefix) -> (fn, to_thd); fn gathers, attends (two parts) and
    merges."""
    from spanllm.attention.cascade import CASCADE_ATTENTION, CASCADE_SHAPE_BUCKET, cascade_prefill

    attn, bucket = CASCADE_ATTENTION[attention], CASCADE_SHAPE_BUCKET[attention]  # the engine's rounding

    def make(prefix: int):
        p = problem

        def fn():
            return cascade_prefill(p.q, p.k_cache, p.v_cache, p.tables[0], prefix, attn, bucket=bucket)

        return fn, lambda o: o

    return make


def cuda_timer(fn: Callable, warmup: int, reps: int) -> list[float]:
    """Each rep's milliseconds from CUDA events (after warmup calls)."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return times


# --- the sweep (pure given its callables: tested on CPU with fakes) -------------------------------------------


def run_sweep(
    entries: dict[str, dict],
    prefixes: tuple[int, ...],
    timer: Callable,
    reference: Callable | None,
    *,
    warmup: int,
    reps: int,
    deadline: float,
    log=print,
) -> dict:
    """entries: name -> {"make": make(prefix) -> (fn, to_thd), "kind": "kernel"|"sdpa"|"cascade", "config":
    dict|None}.
    reference: the [Q_LEN, HQ, d] output every entry is checked against at CHECK_PREFIX (None: no check).
    Returns name -> {kind, config, check: {max_abs_err, ok} | {error}, rows: [{prefix, times_ms, median_ms,
    tflops} | {prefix, error} | {prefix, skipped}]}."""
    out = {}
    for name, e in entries.items():
        res = {"kind": e["kind"], "config": e.get("config"), "rows": []}
        out[name] = res
        if time.monotonic() > deadline:
            res["check"] = {"skipped": "time budget"}
            continue
        try:
            if reference is None:
                res["check"] = {"skipped": "no reference"}
            else:
                fn, to_thd = e["make"](CHECK_PREFIX)
                err = float((to_thd(fn()).float() - reference.float()).abs().max().item())
                res["check"] = {"prefix": CHECK_PREFIX, "max_abs_err": err, "ok": bool(err <= MAX_ABS_ERR)}
                log(f"{name}: check at prefix {CHECK_PREFIX}: max abs err {err:.3e}")
        except Exception as exc:  # noqa: BLE001 (recorded, the sweep goes on)
            res["check"] = {"error": _err(exc)}
            log(f"{name}: check failed: {_err(exc)}")
            continue
        for prefix in prefixes:
            if time.monotonic() > deadline:
                res["rows"].append({"prefix": prefix, "skipped": "time budget"})
                continue
            try:
                fn, _ = e["make"](prefix)
                times = timer(fn, warmup, reps)
                med = sorted(times)[len(times) // 2]
                row = {
                    "prefix": prefix,
                    "times_ms": times,
                    "median_ms": med,
                    "tflops": tflops(attention_flops(Q_LEN, prefix), med),
                }
                log(f"{name}: prefix {prefix}: {med:.3f} ms, {row['tflops']:.1f} TFLOPS")
            except Exception as exc:  # noqa: BLE001
                row = {"prefix": prefix, "error": _err(exc)}
                log(f"{name}: prefix {prefix} failed: {_err(exc)}")
            res["rows"].append(row)
            _free()
    return out


def best_kernel(results: dict) -> tuple[str, dict] | None:
    """The kernel entry that passed its check, measured every prefix, and has the least total median time."""
    best = None
    for name, r in results.items():
        if r["kind"] != "kernel" or not r.get("check", {}).get("ok"):
            continue
        if not r["rows"] or any("median_ms" not in row for row in r["rows"]):
            continue
        total = sum(row["median_ms"] for row in r["rows"])
        if best is None or total < best[0]:
            best = (total, name, r)
    return None if best is None else (best[1], best[2])


def write_outputs(outdir: str, doc: dict, log=print) -> None:
    """prefill_attention.json, best_prefill_config.json (when a tiling qualified) and the PNG (when matplotlib
    imports; a plotting failure is recorded in the JSON, not raised)."""
    os.makedirs(outdir, exist_ok=True)
    results = doc.get("results", {})
    best = best_kernel(results)
    if best is not None:
        name, r = best
        doc["best"] = {"name": name, "config": r["config"]}
        summary = {
            "config": r["config"],
            "name": name,
            "source": "scripts/gpu_prefill_attention.py",
            "device": doc.get("machine", {}).get("device_name"),
            "tflops_by_prefix": {str(row["prefix"]): row["tflops"] for row in r["rows"]},
        }
        with open(os.path.join(outdir, "best_prefill_config.json"), "w") as f:
            json.dump(summary, f, indent=1)
        log(f"best tiling: {name} -> {os.path.join(outdir, 'best_prefill_config.json')}")
    else:
        doc["best"] = None
        log("no tiling passed its check and measured every prefix: no best_prefill_config.json")
    try:
        _plot(results, os.path.join(outdir, "prefill_attention.png"), doc.get("machine", {}).get("device_name"))
    except Exception as exc:  # noqa: BLE001
        doc.setdefault("errors", []).append({"stage": "plot", "error": _err(exc)})
    with open(os.path.join(outdir, "prefill_attention.json"), "w") as f:
        json.dump(doc, f, indent=1)


def _plot(results: dict, path: str, device: str | None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for name, r in results.items():
        pts = [(row["prefix"] / 1024, row["tflops"]) for row in r["rows"] if "tflops" in row]
        if pts:
            style = "-o" if r["kind"] == "kernel" else "--s"
            ax.plot(*zip(*pts), style, label=name, markersize=4)
    ax.set_xlabel("cached prefix (k keys), chunk of 8192 queries")
    ax.set_ylabel("TFLOPS (causal pairs x 4 x head_dim x heads)")
    ax.set_title(f"prefill attention, 32q/8kv heads x 128, bf16 ({device or 'unknown device'})")
    ax.grid(alpha=0.3)
    if ax.lines:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _err(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc)[:500]}"


def _free() -> None:
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except Exception:  # noqa: BLE001
        pass


def machine_info() -> dict:
    """spanllm.measure.report's host and versions, and the GPU's name (device_name)."""
    import torch

    from spanllm.measure import report

    info = {**report.machine_info(), "versions": report.versions()}
    if torch.cuda.is_available():
        info["device_name"] = torch.cuda.get_device_name()
    return info


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("outdir")
    ap.add_argument("--quick", action="store_true", help="3 prefixes, 3 tilings, 3 reps")
    ap.add_argument("--reps", type=int, default=None, help="timed reps per shape (default 7; quick 3)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--budget-s", type=float, default=TIME_BUDGET_S, help="stop starting new measurements after")
    ap.add_argument("--no-sdpa", action="store_true", help="the kernel's tilings only (no SDPA, no cascade)")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    t0 = time.monotonic()
    deadline = t0 + args.budget_s
    prefixes = QUICK_PREFIXES if args.quick else PREFIXES
    reps = args.reps or (3 if args.quick else 7)
    doc: dict = {"machine": machine_info(), "errors": []}
    from spanllm.engine.config import EngineConfig

    block_size = EngineConfig().block_size
    doc["settings"] = {
        "q_len": Q_LEN,
        "prefixes": list(prefixes),
        "num_heads": HQ,
        "num_kv_heads": HKV,
        "head_dim": HEAD_DIM,
        "dtype": "bfloat16",
        "kv_block_size": block_size,
        "reps": reps,
        "warmup": args.warmup,
        "check_prefix": CHECK_PREFIX,
        "max_abs_err": MAX_ABS_ERR,
        "flops": "4 * head_dim * heads * (q * prefix + q(q+1)/2)",
        "sdpa_kv": "contiguous, each KV head repeated for its 4 query heads",
        "cascade": "gather of the paged prefix + chunk K/V, prefix part unmasked (GQA: the 4 query heads of a KV "
        "head as 4x the query rows, no K/V copy), chunk part square causal (chunk K/V repeated per query head), "
        "LSE merge in float32; all timed",
        "tutorial_kernel": "not measured: no causal mask for queries after a prefix",
    }
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    problem = Problem(max(prefixes + (CHECK_PREFIX,)), block_size, dev)
    entries: dict[str, dict] = {}
    for cfg in sweep_configs(args.quick):
        entries[f"paged {cfg.label()}"] = {
            "make": kernel_entry(problem, cfg),
            "kind": "kernel",
            "config": cfg.to_dict(),
        }
    if not args.no_sdpa:
        for b in ("flash", "cudnn", "efficient"):
            entries[f"sdpa {b}"] = {"make": sdpa_entry(problem, b), "kind": "sdpa", "config": None}
        for a in ("cudnn-cascade", "flash-cascade"):
            entries[a] = {"make": cascade_entry(problem, a), "kind": "cascade", "config": None}
    reference = None
    try:
        reference = reference_output(problem, CHECK_PREFIX)
        doc["settings"]["reference"] = f"float32 softmax(QK^T)V per head at prefix {CHECK_PREFIX}"
    except Exception as exc:  # noqa: BLE001
        doc["errors"].append({"stage": "reference", "error": _err(exc), "trace": traceback.format_exc()[-2000:]})
        print(f"reference failed ({_err(exc)}): no check, so no tiling can be chosen as best", flush=True)
    try:
        doc["results"] = run_sweep(
            entries,
            prefixes,
            cuda_timer,
            reference,
            warmup=args.warmup,
            reps=reps,
            deadline=deadline,
            log=lambda s: print(s, flush=True),
        )
    except Exception as exc:  # noqa: BLE001
        doc["errors"].append({"stage": "sweep", "error": _err(exc), "trace": traceback.format_exc()[-2000:]})
        doc.setdefault("results", {})
    doc["elapsed_s"] = round(time.monotonic() - t0, 1)
    write_outputs(args.outdir, doc)
    print(f"wrote {args.outdir}/prefill_attention.json in {doc['elapsed_s']} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
