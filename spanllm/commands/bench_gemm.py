"""`spanllm bench gemm`: decode weight GEMMs on one GPU, F.linear (cuBLAS) against spanllm.kernels.skinny_gemm.

    spanllm bench gemm --models llama3.1-8b,llama3.1-70b --tp 2 --m 1,8,16 --json gemm.json

For each projection of each model (per GPU at tensor-parallel --tp) and each M: one CUDA graph per
method that runs the GEMM over --weights different weight tensors in turn (together at least 3x the L2
cache, so every weight comes from HBM, as in a decode step that walks the layers); the graph is replayed
--replays times, each timed with CUDA events. Reported: microseconds per GEMM (median over replays;
replay time / weights, so the gaps between kernels in a graph count, as they do in decode) and achieved
bandwidth = weight bytes / time. Methods: F.linear, skinny_linear with choose_config's heuristic (the
measured table CONFIG_OVERRIDES set aside; files of 2026-11-30 predate the table, so there it is the
same), skinny_linear with the table's config where the table has one (`skinny_table`), and a
sweep of explicit configs (--sweep small: BLOCK_N x BLOCK_K x SPLIT_K at the heuristic's warps/stages,
then num_warps x num_stages around the best three; --sweep full: the whole grid; --sweep none).
skinny_linear is checked against F.linear and an fp32 reference (max abs error / max |reference|).
The ceiling: a device-to-device copy of --copy-gib GiB ((read + write) bytes / time).

At the end: a table, and a suggested CONFIG_OVERRIDES dict for spanllm/kernels/skinny_gemm.py (entries
where the sweep's best beats the heuristic by more than --override-gain).
"""

from __future__ import annotations

import argparse
import itertools
import math
import statistics
import time

import torch
import torch.nn.functional as F

from spanllm import checks
from spanllm.dtypes import model_dtype
from spanllm.errors import UsageError
from spanllm.kernels import skinny_gemm as sg
from spanllm.measure.timing import graph_us_per_call
from spanllm.output_files import write_result
from spanllm.perf.model_shape import get_model

# The (N, K) of each projection per GPU at TP 2, written out as a check on shapes_for():
#   qkv     N = (heads + 2 kv_heads) * head_dim / tp   K = hidden
#   o       N = hidden                                  K = heads * head_dim / tp
#   gate_up N = 2 * ffn / tp                            K = hidden
#   down    N = hidden                                  K = ffn / tp
EXPECTED_TP2 = {
    "llama3.1-70b": {"qkv": (5120, 8192), "o": (8192, 4096), "gate_up": (28672, 8192), "down": (8192, 14336)},
    "llama3.1-8b": {"qkv": (3072, 4096), "o": (4096, 2048), "gate_up": (14336, 4096), "down": (4096, 7168)},
}
SMEM_LIMIT = 227 * 1024  # H100/H200 shared memory per block; configs above it cannot launch


def shapes_for(model: str, tp: int) -> dict[str, tuple[int, int]]:
    """Sizes from spanllm.perf.model_shape (the table the engine's presets are built from)."""
    try:
        m = get_model(model)
    except ValueError as e:
        raise UsageError(f"--models: {e}") from e
    heads, kv, ffn, d = m.num_heads, m.num_kv_heads, m.intermediate_size, m.head_dim
    if heads % tp or kv % tp or ffn % tp:
        raise UsageError(
            f"--tp {tp}: does not divide {model}'s heads={heads}, kv_heads={kv}, ffn={ffn}; "
            "choose a divisor of all three"
        )
    shapes = {
        "qkv": ((heads + 2 * kv) * d // tp, m.hidden_size),
        "o": (m.hidden_size, heads * d // tp),
        "gate_up": (2 * ffn // tp, m.hidden_size),
        "down": (m.hidden_size, ffn // tp),
    }
    if tp == 2 and model in EXPECTED_TP2:
        assert shapes == EXPECTED_TP2[model], (model, shapes)
    return shapes


def fits(cfg: tuple, elem: int) -> bool:
    bn, bk, _, _, stages = cfg
    return (bn + sg.BLOCK_M) * bk * elem * stages <= SMEM_LIMIT


def normalize(cfg: tuple, k: int) -> tuple:
    """The config as it launches: SPLIT_K reduced to its non-empty chunks."""
    bn, bk, split, warps, stages = cfg
    return (bn, bk, sg.effective_split_k(k, bk, split), warps, stages)


def grid_configs(k: int, elem: int, warps=(4, 8), stages=(3, 4, 5)) -> list[tuple]:
    out = []
    for bn, bk, split, w, s in itertools.product((32, 64, 128), (128, 256), (1, 2, 4, 8), warps, stages):
        cfg = normalize((bn, bk, split, w, s), k)
        if fits(cfg, elem) and cfg not in out:
            out.append(cfg)
    return out


class Timer:
    def __init__(self, args, x: torch.Tensor, weights: list[torch.Tensor]):
        self.args, self.x, self.weights = args, x, weights

    def time(self, op) -> list[float]:
        """Per-replay microseconds per GEMM of a CUDA graph that applies op to every weight once."""
        x, weights = self.x, self.weights
        # op compiles / autotunes outside the capture; one warm-up pass on the capture stream (cuBLAS sets up its
        # per-stream workspace there)
        return graph_us_per_call(lambda i: op(x, weights[i]), len(weights), self.args.replays, self.args.warmup)


def copy_bandwidth(gib: float, iters: int = 10) -> dict:
    """Device-to-device copy of a gib-GiB tensor (dst.copy_(src): clone's kernel without the allocation)."""
    nbytes = int(gib * (1 << 30))
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for a, b in ev:
        a.record()
        dst.copy_(src)
        b.record()
    torch.cuda.synchronize()
    us = [a.elapsed_time(b) * 1e3 for a, b in ev]
    del src, dst
    torch.cuda.empty_cache()
    med = statistics.median(us)
    return {"bytes": nbytes, "us": us, "median_us": med, "TBps_read_plus_write": 2 * nbytes / med / 1e6}


def summarize(us: list[float], wbytes: int) -> dict:
    med = statistics.median(us)
    return {"median_us": med, "min_us": min(us), "TBps": wbytes / med / 1e6, "us": us}


def errors(y: torch.Tensor, ref: torch.Tensor) -> dict:
    scale = ref.abs().max().item() or 1.0
    err = (y.float() - ref).abs().max().item()
    return {"max_abs": err, "rel_to_max": err / scale}


def bench_case(args, model, layer, n, k, m, dtype, num_sms, log) -> dict:
    elem = torch.finfo(dtype).bits // 8
    wbytes = n * k * elem
    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 60 << 20)
    count = max(args.weights, math.ceil(3 * l2 / wbytes))
    gen = torch.Generator(device="cuda").manual_seed(1234 + n + k)
    # Random values, not zeros or a constant: compressible data could stream faster than real weights.
    weights = [torch.randn(n, k, device="cuda", dtype=dtype, generator=gen) / math.sqrt(k) for _ in range(count)]
    x = torch.randn(m, k, device="cuda", dtype=dtype, generator=gen)
    timer = Timer(args, x, weights)
    row = {
        "model": model,
        "layer": layer,
        "n": n,
        "k": k,
        "m": m,
        "dtype": str(dtype),
        "weight_bytes": wbytes,
        "weights_in_graph": count,
    }

    # correctness: against F.linear and an fp32 (no TF32) reference, on the first weight
    prev_tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    ref = x.float() @ weights[0].float().T
    torch.backends.cuda.matmul.allow_tf32 = prev_tf32
    # The heuristic alone (the measured table set aside), and the table's config where it has one.
    heur = sg.choose_config(m, n, k, num_sms, elem, use_table=False)
    table = sg.table_config(m, n, k, elem)
    y = sg.skinny_linear(x, weights[0], config=heur)
    row["heuristic_config"] = list(heur)
    row["table_config"] = list(table) if table is not None else None
    row["error_skinny"] = errors(y, ref)
    row["error_f_linear"] = errors(F.linear(x, weights[0]), ref)
    row["deterministic"] = bool(torch.equal(y, sg.skinny_linear(x, weights[0], config=heur)))

    row["f_linear"] = summarize(timer.time(F.linear), wbytes)
    row["skinny_heuristic"] = summarize(timer.time(lambda a, b: sg.skinny_linear(a, b, config=heur)), wbytes)
    if table is not None:
        row["skinny_table"] = summarize(timer.time(lambda a, b: sg.skinny_linear(a, b, config=table)), wbytes)

    sweep = []

    def run_cfg(cfg):
        if any(s["config"] == list(cfg) for s in sweep):
            return
        try:
            us = timer.time(lambda a, b, c=cfg: sg.skinny_linear(a, b, config=c))
            err = errors(sg.skinny_linear(x, weights[0], config=cfg), ref)
            sweep.append({"config": list(cfg), **summarize(us, wbytes), "error": err})
        except Exception as e:  # noqa: BLE001 - out of resources, compile failure: record, continue
            sweep.append({"config": list(cfg), "failed": f"{type(e).__name__}: {e}"[:300]})

    if args.sweep == "full":
        for cfg in grid_configs(k, elem):
            run_cfg(cfg)
    elif args.sweep == "small":
        for bn, bk, split in itertools.product((32, 64, 128), (128, 256), (1, 2, 4, 8)):
            cfg = normalize((bn, bk, split, *sg.launch_for_tile(bn, bk, elem)), k)
            if fits(cfg, elem):
                run_cfg(cfg)
        ok = sorted((s for s in sweep if "failed" not in s), key=lambda s: s["median_us"])
        for top in ok[:3]:
            bn, bk, split = top["config"][:3]
            for w, st in itertools.product((4, 8), (3, 4, 5)):
                cfg = (bn, bk, split, w, st)
                if fits(cfg, elem):
                    run_cfg(cfg)
    row["sweep"] = sweep
    ok = [s for s in sweep if "failed" not in s]
    if ok:
        best = min(ok, key=lambda s: s["median_us"])
        row["best"] = {"config": best["config"], "median_us": best["median_us"], "TBps": best["TBps"]}
    weights.clear()  # the timer holds the same list
    torch.cuda.empty_cache()
    log(row)
    return row


def fmt_row(r: dict) -> str:
    fl, he = r["f_linear"], r["skinny_heuristic"]
    best = r.get("best") or {"median_us": float("nan"), "TBps": float("nan"), "config": []}
    return (
        f"{r['model']:<13} {r['layer']:<8} {r['n']:>6} {r['k']:>6} {r['m']:>3} | "
        f"{fl['median_us']:8.1f} {fl['TBps']:5.2f} | {he['median_us']:8.1f} {he['TBps']:5.2f} "
        f"{','.join(map(str, r['heuristic_config'])):<16} | {best['median_us']:8.1f} {best['TBps']:5.2f} "
        f"{','.join(map(str, best['config'])):<16} | {r['error_skinny']['rel_to_max']:.1e} "
        f"{r['error_f_linear']['rel_to_max']:.1e}"
    )


HEADER = (
    f"{'model':<13} {'layer':<8} {'N':>6} {'K':>6} {'M':>3} | {'F.linear':>8} {'TB/s':>5} | "
    f"{'heur us':>8} {'TB/s':>5} {'heur cfg':<16} | {'best us':>8} {'TB/s':>5} {'best cfg':<16} | err: skinny F.linear (max abs / max |fp32 ref|)"  # noqa: E501
)


def _suggested(rows: list[dict], gain: float) -> dict:
    """key -> (best config, its median us, F.linear's median us) for rows whose sweep best beats the
    heuristic by more than `gain`; several M of one bucket: the largest M's (the bucket's worst case for x)."""
    out = {}
    for r in sorted(rows, key=lambda r: r["m"]):
        best = r.get("best")
        if best and best["median_us"] < r["skinny_heuristic"]["median_us"] * (1 - gain):
            key = (sg.m_bucket(r["m"]), r["n"], r["k"], r["weight_bytes"] // (r["n"] * r["k"]))
            out[key] = (tuple(best["config"]), round(best["median_us"], 2), round(r["f_linear"]["median_us"], 2))
    return out


def suggest_overrides(rows: list[dict], gain: float) -> dict:
    return {key: cfg for key, (cfg, _, _) in _suggested(rows, gain).items()}


DEFAULTS = {"--models": "llama3.1-8b,llama3.1-70b", "--layers": "qkv,o,gate_up,down"}


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--models", default=DEFAULTS["--models"], help="comma list of Llama 3.1 presets (8b, 70b, 405b)")
    ap.add_argument(
        "--tp", "--tensor-parallel-size", "-tp", type=int, default=2, help="tensor-parallel degree: shapes are per GPU"
    )
    ap.add_argument("--m", default="1,8,16", help="comma list of decode batch sizes (rows of x, <= 16)")
    ap.add_argument("--layers", default=DEFAULTS["--layers"], help="comma list of projections to time")
    ap.add_argument("--dtype", default="bf16", help="bf16, fp16 or fp32 (any model dtype name, spanllm.dtypes)")
    ap.add_argument(
        "--weights", type=int, default=20, help="distinct weight tensors per graph (raised so that they total >= 3x L2)"
    )
    ap.add_argument("--replays", type=int, default=20, help="timed graph replays per method")
    ap.add_argument("--warmup", type=int, default=3, help="untimed graph replays first")
    ap.add_argument("--sweep", default="small", choices=["none", "small", "full"], help="explicit configs to try")
    ap.add_argument("--copy-gib", type=float, default=4.0, help="size of the copy-bandwidth test (0: skip)")
    ap.add_argument(
        "--override-gain",
        type=float,
        default=0.03,
        help="suggest an override where the best config is this much faster than the heuristic",
    )
    ap.add_argument("--json", default=None, help="write settings, machine, versions and raw times here")


def check_arguments(args) -> tuple[torch.dtype, list[int], list[str], list[str]]:
    """Every option, before any GPU work: dtype, M values, models x tp, layers."""
    try:
        dtype = model_dtype(args.dtype)
    except ValueError as e:
        raise UsageError(f"--dtype: {e}") from None
    try:
        ms = [int(v) for v in args.m.split(",")]
    except ValueError:
        raise UsageError(f"--m {args.m!r}: give comma-separated integers in 1..{sg.MAX_M}") from None
    if any(not 1 <= m <= sg.MAX_M for m in ms):
        raise UsageError(f"--m {args.m!r}: values must be in 1..{sg.MAX_M} (the skinny kernel's rows)")
    checks.at_least("--tp", args.tp, 1)
    checks.at_least("--weights", args.weights, 1)
    checks.at_least("--replays", args.replays, 1)
    checks.at_least("--warmup", args.warmup, 0)
    models = [s for s in args.models.split(",") if s]
    layers = [s for s in args.layers.split(",") if s]
    for flag, text, items in (("--models", args.models, models), ("--layers", args.layers, layers)):
        if not items:
            raise UsageError(f"{flag} {text!r}: nothing to time; give a comma list, e.g. {flag} {DEFAULTS[flag]}")
    if not 0.0 <= args.copy_gib < float("inf"):  # nan fails too
        raise UsageError(f"--copy-gib {args.copy_gib}: must be a finite size >= 0 GiB (0: skip the copy test), e.g. 4")
    if not 0.0 <= args.override_gain < 1.0:
        raise UsageError(
            f"--override-gain {args.override_gain}: a fraction in [0, 1) of the heuristic's time, e.g. 0.03"
        )
    checks.output_file("--json", args.json)
    for mdl in models:
        shapes = shapes_for(mdl, args.tp)
        bad = [la for la in layers if la not in shapes]
        if bad:
            raise UsageError(f"--layers: {bad[0]!r} is not a projection; choose from {', '.join(shapes)}")
    if not torch.cuda.is_available():
        raise UsageError("spanllm bench gemm times GPU kernels: run it on a machine with a CUDA GPU")
    if sg.triton is None:
        raise UsageError("spanllm bench gemm needs Triton for the skinny kernel: pip install triton")
    return dtype, ms, models, layers


def run(args) -> int:
    dtype, ms, models, layers = check_arguments(args)
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 F.linear as an exact fp32 GEMM (as skinny_linear)
    props = torch.cuda.get_device_properties(0)
    num_sms = props.multi_processor_count
    device_info = {
        "name": torch.cuda.get_device_name(0),
        "capability": list(torch.cuda.get_device_capability(0)),
        "num_sms": num_sms,
        "l2_bytes": getattr(props, "L2_cache_size", None),
        "total_memory": props.total_memory,
    }
    print(
        f"{device_info['name']}: {num_sms} SMs, L2 {device_info['l2_bytes']} B; "
        f"torch {torch.__version__}, triton {sg.triton.__version__}",
        flush=True,
    )

    copy = copy_bandwidth(args.copy_gib) if args.copy_gib > 0 else None
    if copy:
        print(
            f"copy {args.copy_gib} GiB: {copy['median_us']:.0f} us, {copy['TBps_read_plus_write']:.2f} TB/s "
            "(read + write)",
            flush=True,
        )

    settings = vars(args)
    rows: list[dict] = []
    t0 = time.time()

    def save(complete: bool):
        if args.json:
            write_result(
                args.json,
                "gpu_gemm_bench",
                settings,
                rows,
                device=device_info,
                copy=copy,
                complete=complete,
                elapsed_s=time.time() - t0,
                suggested_overrides={str(k): list(v) for k, v in suggest_overrides(rows, args.override_gain).items()},
            )

    print(HEADER, flush=True)
    for mdl in models:
        shapes = shapes_for(mdl, args.tp)
        for layer in layers:
            n, k = shapes[layer]
            for m in ms:
                rows.append(
                    bench_case(args, mdl, layer, n, k, m, dtype, num_sms, lambda r: print(fmt_row(r), flush=True))
                )
                save(False)
    save(True)

    if copy:
        print(f"\nceiling: copy {copy['TBps_read_plus_write']:.2f} TB/s (read + write)")
    print(
        "\nsuggested CONFIG_OVERRIDES (m_bucket, N, K, element bytes) -> (BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages):"  # noqa: E501
    )
    suggested = sorted(_suggested(rows, args.override_gain).items())
    print("CONFIG_OVERRIDES = {")
    for key, (cfg, _, _) in suggested:
        print(f"    {key}: {cfg},")
    print("}")
    print("and their times (decode_gemm='auto' takes an entry only with its times, where skinny is faster):")
    print("MEASURED_US = {")
    for key, (_, us, f_us) in suggested:
        print(f"    {key}: ({us}, {f_us}),")
    print("}")
    print(f"({time.time() - t0:.0f} s)")
    return 0
