"""The FP8 decode GEMV (W8A16 at M = 1 ... 16) four ways: how W reaches the tensor cores, and which MMA operand it is.

    PYTHONPATH=. python scripts/gpu_fp8_tma.py OUTDIR [--budget-s 100] [--ms 1] [--layers qkv,o,gate_up,down]
    PYTHONPATH=. python scripts/gpu_fp8_tma.py OUTDIR --static      # no GPU: compile for sm_90, registers and spills

Why: the production W8A16 kernel (spanllm.kernels.skinny_gemm with weight_scale) streams FP8 weights at ~62-65% of
the copy bandwidth on an H100 (results/h100/fp8/widen/: 13.7 us for the 8B's 25 MB qkv weight at M = 1), which keeps
batch-1 FP8 decode at 1.50x its weight-copy bound against issue 30's 1.25x. Cheaper widening bought 5%
(results/h100/fp8/widen/), so the kernel is latency-bound: too few bytes in flight per SM. Compiled for sm_90 it uses
255 registers and spills (results/cpu_sm90_compile/), so an SM holds two of its 4-warp programs. Two changes, each on
its own and together:
- TMA: W and x tiles are loaded through Hopper tensor descriptors (host-made, passed by value as kernel parameters,
  graph-safe) by the copy engine into shared memory; the program keeps no [BLOCK_N, BLOCK_K] address tensors
  (51-77 registers in the compile study), so more programs and more stages fit on an SM. Out-of-range rows (N tail,
  x's rows >= M) and columns (K tail) are filled with zeros by the copy engine: no masks, no modulo.
- W as the A operand (`wx`): production computes acc[16, BN] = x[16, BK] @ widen(W)[BN, BK]^T, so the widened W is
  the MMA's B operand, which Hopper's wgmma reads from shared memory: the widened tile is written back to shared
  memory every iteration. Swapped, acc^T[BN, 16] = widen(W) @ x^T, W is the A operand, which wgmma takes from
  registers: the widening feeds the tensor cores directly and only x (16 rows) is read from shared memory.

Variants: `production` (skinny_linear as the engine calls it), `ptr_wx` (production's pointer loads, W as A),
`tma_xw` (TMA, production's operand order), `tma_wx` (TMA, W as A). Every variant except production is one kernel of
this file with production's split-K and in-kernel split merge (arrival counters, fixed summation order); each is
checked against the fp32 reference (x.float() @ (w.float() * scale).T) before it is timed and a variant past TOL is
reported failed, not timed. Launch configs: production's for the shape, plus a few around it (`candidates`), each
(BLOCK_N, BLOCK_K, SPLIT_K, warps, stages).

Timing (as scripts/gpu_fp8_widen.py): a CUDA graph of >= 20 calls over distinct weights filling >= 3x L2, so every
call streams its weight from HBM; us per call, median over replays; bandwidth = FP8 weight bytes / time, beside the
device-to-device copy bandwidth measured in the same run. Budget: no measurement starts that would end after
--budget-s (the longest one so far is the estimate); what is left is recorded as skipped.

Writes OUTDIR/fp8_tma.json (machine, versions, settings, every replay, errors, registers and spills per compiled
kernel) after every measurement and prints a table and, per layer and M, the best config of each variant.
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

SCRIPTS = os.path.dirname(os.path.abspath(__file__))
if __package__ in (None, "") and __name__ == "__main__":  # `python scripts/gpu_fp8_tma.py` without PYTHONPATH=.
    sys.path.insert(0, os.path.dirname(SCRIPTS))
sys.path.insert(0, SCRIPTS)  # the widening benchmark's shapes, data and checks (its sibling)

from gpu_fp8_widen import LAYERS, TOL, copy_bandwidth_gbps, max_rel_err, quantized_weight, reference  # noqa: E402

from spanllm.kernels import skinny_gemm as sg  # noqa: E402

try:
    import triton
    import triton.language as tl
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # the CPU torch wheel comes without Triton
    triton = tl = TensorDescriptor = None

VARIANTS = ("production", "ptr_wx", "tma_xw", "tma_wx")
TMA_MAX_BOX = 256  # elements per dimension of one tensor-descriptor box (the copy engine's limit)
SMEM_PER_SM = 227 * 1024  # Hopper: shared memory one SM gives its programs (228 KB less 1 KB reserved)


if triton is not None:

    @triton.jit
    def _store_or_merge(acc, y_ptr, ws_ptr, cnt_ptr, scale_ptr, M, N, stride_ym, pid_n, pid_k,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr):  # fmt: skip
        """Production's epilogue: acc [BLOCK_M, BLOCK_N] fp32 times the row scales into y, directly (SPLIT_K = 1)
        or through the fp32 partials, summed in split order by the tile's last program to arrive."""
        offs_m = tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        out_mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
        y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
        row_scale = tl.load(scale_ptr + offs_n, mask=offs_n < N, other=0.0)[None, :]
        if SPLIT_K == 1:
            tl.store(y_ptrs, (acc * row_scale).to(y_ptr.dtype.element_ty), mask=out_mask)
        else:
            tile = offs_m[:, None] * N + offs_n[None, :]
            tl.store(ws_ptr + pid_k * M * N + tile, acc, mask=out_mask)
            tl.debug_barrier()  # every warp's partial stored before the one acq_rel increment (arrival_counters)
            arrived = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel")
            if arrived == SPLIT_K - 1:
                total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                for s in tl.static_range(SPLIT_K):
                    total += tl.load(ws_ptr + s * M * N + tile, mask=out_mask, other=0.0, cache_modifier=".cg")
                tl.store(y_ptrs, (total * row_scale).to(y_ptr.dtype.element_ty), mask=out_mask)
                tl.atomic_xchg(cnt_ptr + pid_n, 0)

    @triton.jit
    def _w8a16_tma_kernel(x_desc, w_desc, y_ptr, ws_ptr, cnt_ptr, scale_ptr, M, N, K, k_chunk, stride_ym,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                          SPLIT_K: tl.constexpr, W_AS_A: tl.constexpr, NUM_STAGES: tl.constexpr):  # fmt: skip
        """W [N, K] e4m3 and x [M, K] bf16 through tensor descriptors (zero fill past N, M and K); the program's K
        chunk [pid_k * k_chunk, + k_chunk) is a multiple of BLOCK_K, so chunks never overlap."""
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        k_start = pid_k * k_chunk
        k_end = tl.minimum(k_start + k_chunk, K)
        if W_AS_A:
            acc_t = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            for k in tl.range(k_start, k_end, BLOCK_K, num_stages=NUM_STAGES):
                w = w_desc.load([pid_n * BLOCK_N, k])
                xt = x_desc.load([0, k])
                acc_t = tl.dot(w.to(xt.dtype), tl.trans(xt), acc_t)
            acc = tl.trans(acc_t)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k in tl.range(k_start, k_end, BLOCK_K, num_stages=NUM_STAGES):
                w = w_desc.load([pid_n * BLOCK_N, k])
                xt = x_desc.load([0, k])
                acc = tl.dot(xt, tl.trans(w.to(xt.dtype)), acc)
        _store_or_merge(acc, y_ptr, ws_ptr, cnt_ptr, scale_ptr, M, N, stride_ym, pid_n, pid_k,
                        BLOCK_M, BLOCK_N, SPLIT_K)  # fmt: skip

    @triton.jit
    def _w8a16_ptr_wx_kernel(x_ptr, w_ptr, y_ptr, ws_ptr, cnt_ptr, scale_ptr, M, N, K, k_chunk, stride_xm, stride_wn,
                             stride_ym, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                             SPLIT_K: tl.constexpr, NUM_STAGES: tl.constexpr):  # fmt: skip
        """Production's loads (pointer tensors, rows past N wrapped, K a multiple of BLOCK_K) with W as the MMA's A
        operand: acc^T [BLOCK_N, BLOCK_M] = widen(W) @ x^T."""
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        offs_m = tl.arange(0, BLOCK_M)
        rows = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N
        offs_k = tl.arange(0, BLOCK_K)
        k_start = pid_k * k_chunk
        k_end = tl.minimum(k_start + k_chunk, K)
        w_ptrs = w_ptr + rows.to(tl.int64)[:, None] * stride_wn + (k_start + offs_k)[None, :]
        x_ptrs = x_ptr + offs_m[:, None] * stride_xm + (k_start + offs_k)[None, :]
        m_mask = offs_m[:, None] < M
        acc_t = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for _ in tl.range(k_start, k_end, BLOCK_K, num_stages=NUM_STAGES):
            w = tl.load(w_ptrs, eviction_policy="evict_first")
            xt = tl.load(x_ptrs, mask=m_mask, other=0.0, eviction_policy="evict_last")
            acc_t = tl.dot(w.to(xt.dtype), tl.trans(xt), acc_t)
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
        _store_or_merge(tl.trans(acc_t), y_ptr, ws_ptr, cnt_ptr, scale_ptr, M, N, stride_ym, pid_n, pid_k,
                        BLOCK_M, BLOCK_N, SPLIT_K)  # fmt: skip


def check_variant_config(variant: str, cfg: sg.SkinnyConfig, k: int) -> str | None:
    """Why this variant cannot take this config, or None."""
    if variant.startswith("tma") and cfg.block_k > TMA_MAX_BOX:
        return f"BLOCK_K={cfg.block_k} > {TMA_MAX_BOX}, the largest tensor-descriptor box"
    if variant.startswith("tma") and k % 16:
        return f"K={k}: a tensor descriptor's row stride must be a multiple of 16 bytes"
    if variant.startswith("tma") and cfg.block_n > TMA_MAX_BOX:
        return f"BLOCK_N={cfg.block_n} > {TMA_MAX_BOX}, the largest tensor-descriptor box"
    if variant == "ptr_wx" and k % cfg.block_k:
        return f"K={k} is not a multiple of BLOCK_K={cfg.block_k} (the pointer variant has no K mask)"
    return None


def run_variant(variant: str, x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, cfg: sg.SkinnyConfig):
    """y [M, N] bf16 = x @ (q * scale[:, None])^T; returns (y, the compiled kernel or None)."""
    if variant == "production":
        return sg.skinny_linear(x, q, config=tuple(cfg), weight_scale=scale), None
    why = check_variant_config(variant, cfg, x.shape[1])
    if why:
        raise ValueError(f"{variant} {tuple(cfg)}: {why}")
    m, k = x.shape
    n = q.shape[0]
    split = sg.effective_split_k(k, cfg.block_k, cfg.split_k)
    chunk = sg.split_k_chunk(k, cfg.block_k, split)
    n_tiles = triton.cdiv(n, cfg.block_n)
    block_m = sg.block_m_for(m)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    ws, counters = sg.split_k_buffers(y, split, n_tiles)
    common = dict(BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT_K=split,
                  NUM_STAGES=cfg.num_stages, num_warps=cfg.num_warps, num_stages=cfg.num_stages)  # fmt: skip
    if variant == "ptr_wx":
        compiled = _w8a16_ptr_wx_kernel[(n_tiles, split)](
            x, q, y, ws, counters, scale, m, n, k, chunk, x.stride(0), q.stride(0), n, **common
        )
    else:
        x_desc = TensorDescriptor.from_tensor(x, [block_m, cfg.block_k])
        w_desc = TensorDescriptor.from_tensor(q, [cfg.block_n, cfg.block_k])
        compiled = _w8a16_tma_kernel[(n_tiles, split)](
            x_desc, w_desc, y, ws, counters, scale, m, n, k, chunk, n, W_AS_A=(variant == "tma_wx"), **common
        )
    return y, compiled


def stage_bytes(cfg: sg.SkinnyConfig, block_m: int) -> int:
    """Shared memory one pipeline stage holds: the W tile (1 byte a weight) and the x tile (bf16)."""
    return cfg.block_k * (cfg.block_n + 2 * block_m)


def candidates(m: int, n: int, k: int, sms: int) -> list[sg.SkinnyConfig]:
    """Production's config for the shape, then tilings around it: BLOCK_N 64 / 128, BLOCK_K 128 / 256, split-K to
    give each SM 2-4 programs, and as many stages as keep two programs' stages inside an SM's shared memory."""
    prod = sg.choose_config(m, n, k, sms, 1, x_bytes=2)
    out = [prod]
    block_m = sg.block_m_for(m)
    for bn, bk in ((64, 256), (128, 128), (128, 256)):
        tiles = triton.cdiv(n, bn) if triton is not None else -(-n // bn)
        split = 1
        while tiles * split < 2 * sms and split < 8 and k // (bk * split * 2) >= 2:
            split *= 2
        probe = sg.SkinnyConfig(bn, bk, split, 4, 2)
        stages = max(2, min(8, (SMEM_PER_SM // 2) // stage_bytes(probe, block_m)))
        cfg = sg.SkinnyConfig(bn, bk, split, 4, stages)
        if cfg not in out:
            out.append(cfg)
    return out


# ------------------------------------------------------------------------------------------- static (no GPU)


def compile_sm90(variant: str, cfg: sg.SkinnyConfig):
    """One variant's kernel (not `production`) at M <= 16, compiled for sm_90 with Triton's compiler: no GPU."""
    from triton.backends.compiler import GPUTarget

    scalars = {"M": "i32", "N": "i32", "K": "i32", "k_chunk": "i32"}
    common = {"y_ptr": "*bf16", "ws_ptr": "*fp32", "cnt_ptr": "*i32", "scale_ptr": "*fp32"}
    consts = {"BLOCK_M": 16, "BLOCK_N": cfg.block_n, "BLOCK_K": cfg.block_k, "SPLIT_K": cfg.split_k,
              "NUM_STAGES": cfg.num_stages}  # fmt: skip
    if variant == "ptr_wx":
        fn, sig = _w8a16_ptr_wx_kernel, {"x_ptr": "*bf16", "w_ptr": "*fp8e4nv", **common, **scalars}
        sig.update(stride_xm="i32", stride_wn="i32")
    else:
        fn = _w8a16_tma_kernel
        sig = {
            "x_desc": f"tensordesc<bf16[16, {cfg.block_k}]>",
            "w_desc": f"tensordesc<fp8e4nv[{cfg.block_n}, {cfg.block_k}]>",
            **common,
            **scalars,
        }
        consts["W_AS_A"] = variant == "tma_wx"
    sig["stride_ym"] = "i32"
    sig.update({c: "constexpr" for c in consts})
    src = triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=consts)
    options = {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def static_report(outdir: str) -> None:
    """Compile the TMA and pointer variants for sm_90 (Triton's compiler, its bundled ptxas) at each layer's
    candidate configs, M = 1: registers, spills, shared memory; writes OUTDIR/fp8_tma_static.json."""
    from sm90_registers import ptxas_report

    rows = []
    for layer, (n, k) in LAYERS.items():
        for cfg in candidates(1, n, k, 132):
            for variant in VARIANTS[1:]:
                if check_variant_config(variant, cfg, k):
                    continue
                row = {"layer": layer, "variant": variant, "config": list(cfg)}
                try:
                    kern = compile_sm90(variant, cfg)
                    row.update(shared_bytes_triton=kern.metadata.shared, **ptxas_report(kern.asm["ptx"]))
                    ptx = kern.asm["ptx"]
                    row["wgmma"] = "wgmma.mma_async" in ptx
                    row["tma"] = "cp.async.bulk.tensor" in ptx
                except Exception as e:  # noqa: BLE001 - one config failing to compile is a result
                    row["failed"] = f"{type(e).__name__}: {e}"[:400]
                rows.append(row)
                print(json.dumps(row), flush=True)
    os.makedirs(outdir, exist_ok=True)
    with open(os.path.join(outdir, "fp8_tma_static.json"), "w") as f:
        json.dump({"triton": triton.__version__, "target": "sm_90", "rows": rows}, f, indent=1)


# ------------------------------------------------------------------------------------------------ GPU driver


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("outdir")
    ap.add_argument("--budget-s", type=float, default=100.0, help="start no measurement that would end after this")
    ap.add_argument("--ms", default="1")
    ap.add_argument("--layers", default=",".join(LAYERS))
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--min-calls", type=int, default=20, help="calls per CUDA graph (at least)")
    ap.add_argument("--static", action="store_true", help="no GPU: compile for sm_90, registers and spills")
    args = ap.parse_args()
    if triton is None:
        raise SystemExit("scripts/gpu_fp8_tma.py: needs Triton (not installed)")
    if args.static:
        static_report(args.outdir)
        return
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
        raise SystemExit("scripts/gpu_fp8_tma.py: needs a Hopper GPU (tensor descriptors, wgmma); none found")
    variants = args.variants.split(",")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise SystemExit(f"scripts/gpu_fp8_tma.py: unknown variants {unknown}; known: {list(VARIANTS)}")
    run_gpu(args, ["production"] + [v for v in variants if v != "production"])


def run_gpu(args, variants: list[str]) -> None:
    from spanllm.measure.timing import graph_us_per_call

    t0 = time.monotonic()
    longest = 0.0
    ms = [int(v) for v in args.ms.split(",")]
    layers = args.layers.split(",")
    device = torch.device("cuda")
    props = torch.cuda.get_device_properties(0)
    l2 = getattr(props, "L2_cache_size", 50 << 20)
    os.makedirs(args.outdir, exist_ok=True)
    out_path = os.path.join(args.outdir, "fp8_tma.json")
    try:
        from spanllm.measure.report import versions

        vers = versions()
    except Exception as e:  # noqa: BLE001 - versions are nice to have
        vers = {"torch": torch.__version__, "triton": triton.__version__, "error": repr(e)}
    doc = {
        "machine": {
            "gpu": torch.cuda.get_device_name(0),
            "sms": props.multi_processor_count,
            "l2_MiB": round(l2 / 2**20, 1),
        },
        "versions": vers,
        "settings": {
            "budget_s": args.budget_s,
            "ms": ms,
            "layers": {name: LAYERS[name] for name in layers},
            "variants": variants,
            "replays": args.replays,
            "min_calls": args.min_calls,
            "tol": TOL,
            "timing": "CUDA graph of >= min_calls calls over >= 3x L2 of distinct weights, us per call, median",
            "skinny_gemm_table": sg.table_id(),
        },
        "copy_GBps": round(copy_bandwidth_gbps(), 1),
        "kernels": {},
        "rows": [],
    }
    print(f"{doc['machine']['gpu']}: device copy {doc['copy_GBps']:.0f} GB/s (read + write)", flush=True)

    def save() -> None:
        doc["seconds"] = round(time.monotonic() - t0, 1)
        with open(out_path, "w") as f:
            json.dump(doc, f, indent=1)

    gen = torch.Generator(device=device).manual_seed(0)
    for m in ms:
        for layer in layers:
            n, k = LAYERS[layer]
            count = max(4, math.ceil(3 * l2 / (n * k)))
            weights = [quantized_weight(n, k, device, gen) for _ in range(count)]
            calls = count * math.ceil(args.min_calls / count)
            x = torch.randn(m, k, device=device, generator=gen).to(torch.bfloat16)
            ref = reference(x, *weights[0])
            for cfg in candidates(m, n, k, props.multi_processor_count):
                for variant in variants:
                    row = {"layer": layer, "n": n, "k": k, "m": m, "variant": variant, "config": list(cfg)}
                    doc["rows"].append(row)
                    why = None if variant == "production" else check_variant_config(variant, cfg, k)
                    if why:
                        row["skipped"] = why
                        continue
                    if time.monotonic() - t0 + longest > args.budget_s:
                        row["skipped"] = "budget"
                        continue
                    started = time.monotonic()
                    try:
                        y, compiled = run_variant(variant, x, *weights[0], cfg)
                        row["err"] = max_rel_err(y, ref)
                        if compiled is not None and f"{variant} {list(cfg)}" not in doc["kernels"]:
                            doc["kernels"][f"{variant} {list(cfg)}"] = {
                                "n_regs": getattr(compiled, "n_regs", None),
                                "n_spills": getattr(compiled, "n_spills", None),
                                "shared_bytes": getattr(compiled.metadata, "shared", None),
                            }
                        if not row["err"] < TOL:
                            row["failed"] = f"max rel error {row['err']:.3g} >= {TOL}"
                        else:
                            fn = lambda i, v=variant, c=cfg, x=x, ws=weights, n=count: run_variant(v, x, *ws[i % n], c)
                            us = graph_us_per_call(fn, calls, args.replays)
                            med = statistics.median(us)
                            row.update(us=[round(t, 3) for t in us], median_us=round(med, 3))
                            row["GBps"] = round(n * k / med / 1e3, 1)
                    except Exception as e:  # noqa: BLE001 - a compile failure or out-of-resources is a result
                        row["failed"] = f"{type(e).__name__}: {e}"[:400]
                    longest = max(longest, time.monotonic() - started)
                    if "median_us" in row:
                        pct = 100 * row["GBps"] / doc["copy_GBps"]
                        what = f"{row['median_us']:8.2f} us {row['GBps']:7.0f} GB/s {pct:4.0f}%"
                    else:
                        what = row.get("failed", "")
                    print(f"{layer:8s} M={m:<3d} {variant:10s} {str(tuple(cfg)):26s} {what}", flush=True)
                    save()
            del weights
            torch.cuda.empty_cache()
    summary = {}
    for r in doc["rows"]:
        if "median_us" in r:
            key = f"{r['layer']} M={r['m']}"
            best = summary.setdefault(key, {}).get(r["variant"])
            if best is None or r["median_us"] < best["median_us"]:
                summary[key][r["variant"]] = {"median_us": r["median_us"], "config": r["config"], "GBps": r["GBps"]}
    doc["best"] = summary
    save()
    print("best per variant:", flush=True)
    for key, per in summary.items():
        base = per.get("production", {}).get("median_us")
        cells = "  ".join(
            f"{v} {b['median_us']:.2f}" + (f" ({base / b['median_us']:.2f}x)" if base else "") for v, b in per.items()
        )
        print(f"  {key:14s} {cells}", flush=True)
    print("wrote", out_path, flush=True)


if __name__ == "__main__":
    main()
