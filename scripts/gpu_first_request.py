"""What a request pays the first time the engine meets its prompt length, on an engine built as `spanllm serve`
builds it (the same flags, the same warm-up), without the HTTP front end: a sequence of prompt lengths, each
request alone on the idle engine, with every engine step synchronized and timed and the CUDA caching
allocator's counters (allocation retries, device allocations and frees, reserved bytes) read around each
request; then the cascade's attention alone at a new (queries, prefix) shape, first call against the next, to
price cuDNN's per-shape plan build at the sizes the requests' last chunks meet.

    python3 scripts/gpu_first_request.py OUT.json --lengths 36402,36402,111352,111352,111000 -- SERVE_FLAGS...

With --conversation the lengths are one conversation's prompts, each the one before it with new tokens after (a
chat's turns, or an agent's calls, with the conversation so far in the prefix cache). --no-cascade-cost runs auto's
cuDNN cascade on every long-prefix chunk (the rule before its cost model; an A/B).

SERVE_FLAGS are `spanllm serve`'s (the model first). GPU only."""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

ALLOC_COUNTERS = ("num_alloc_retries", "num_ooms", "num_device_alloc", "num_device_free", "num_sync_all_streams")


def allocator_state() -> dict:
    import torch

    s = torch.cuda.memory_stats()
    out = {k: s.get(k, 0) for k in ALLOC_COUNTERS}
    out["reserved_bytes"] = s.get("reserved_bytes.all.current", 0)
    out["allocated_peak_bytes"] = s.get("allocated_bytes.all.peak", 0)
    return out


def delta(a: dict, b: dict) -> dict:
    return {k: b[k] - a[k] for k in a}


def timed_request(core, prompt: list[int]) -> dict:
    """One request alone on the idle engine: every step synchronized and timed until it finishes."""
    import torch

    from spanllm.engine.sampler import SamplingParams

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    a = allocator_state()
    seq = core.add_request(prompt, SamplingParams(max_tokens=2, ignore_eos=True))
    steps = []
    while core.has_unfinished():
        t0 = time.perf_counter()
        core.step()
        torch.cuda.synchronize()
        steps.append(round(time.perf_counter() - t0, 4))
    b = allocator_state()
    return {
        "prompt_tokens": len(prompt),
        "cached_tokens": seq.num_cached_tokens,
        "ttft_s": round(seq.first_token - seq.arrival, 4),
        "step_s": steps,
        "allocator": delta(a, b),
        "reserved_gib_after": round(b["reserved_bytes"] / 2**30, 3),
        "allocated_peak_gib": round(b["allocated_peak_bytes"] / 2**30, 3),
    }


def plan_probe(cfg, dtype, shapes: list[tuple[int, int]], bucket: int) -> list[dict]:
    """The cascade over dense keys at (queries, prefix) shapes, rounded as the engine's backend rounds them: three
    calls each (a shape the engine has not met pays its plans in the first)."""
    import torch

    from spanllm.attention.cascade import CascadeShape, cascade_dense, cudnn_attention

    hq, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    rows = []
    for c, p in shapes:
        q = torch.randn(c, hq, d, dtype=dtype, device="cuda")
        k = torch.zeros(CascadeShape(c, p, bucket).keys, hkv, d, dtype=dtype, device="cuda")
        k[: p + c].normal_()
        v = torch.zeros_like(k)
        v[: p + c].normal_()
        times = []
        for _ in range(3):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            cascade_dense(q, k, v, p, cudnn_attention, None, bucket)
            torch.cuda.synchronize()
            times.append(round(time.perf_counter() - t0, 4))
        rows.append({"queries": c, "prefix": p, "bucket": bucket, "call_s": times})
        del q, k, v
    return rows


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--lengths", default="36402,36402,111352,111352,111000", help="prompt lengths, in order")
    ap.add_argument("--probe", default="3634:32768,13048:98304,12000:98304", help="queries:prefix shapes")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument(
        "--common-prefix",
        type=int,
        default=0,
        help="tokens every prompt starts with (the same random ones): requests after the first hit the prefix cache",
    )
    ap.add_argument(
        "--conversation",
        action="store_true",
        help="each prompt is the one before it plus new tokens (lengths increasing): every request after the first "
        "hits the prefix cache for the conversation so far",
    )
    ap.add_argument(
        "--no-cascade-cost",
        action="store_true",
        help="auto's cascade on every chunk past the min prefix, without its cost model (the rule before it)",
    )
    ap.add_argument(
        "--bucket",
        type=int,
        default=None,
        help="round the cascade's shapes to this many rows instead of the backend's own (1: exact shapes; an A/B)",
    )
    args = ap.parse_args(argv[:split])
    serve_argv = argv[split + 1 :]
    try:
        lengths = [int(x) for x in args.lengths.split(",")]
        if args.common_prefix < 0 or any(n <= args.common_prefix for n in lengths):
            raise ValueError
        if args.conversation and (args.common_prefix or any(b <= a for a, b in zip(lengths, lengths[1:]))):
            raise ValueError
        shapes = [tuple(int(v) for v in s.split(":")) for s in args.probe.split(",") if s]
    except ValueError:
        ap.error(
            f"--lengths {args.lengths!r} / --probe {args.probe!r} / --common-prefix {args.common_prefix}: give "
            "N,N,... (each > the common prefix; increasing, without a common prefix, with --conversation) and "
            "Q:P,Q:P,... ('' for none)"
        )

    import numpy as np
    import torch

    from spanllm.commands import serve
    from spanllm.commands.engine_args import build_llm
    from spanllm.engine import cuda_allocator
    from spanllm.engine.warmup import warm_up
    from spanllm.launch import DistContext

    if not torch.cuda.is_available():
        print("gpu_first_request.py measures a GPU's first-call costs: run it on the device machine", file=sys.stderr)
        return 2
    cuda_allocator.apply_default()
    sp = argparse.ArgumentParser()
    serve.add_arguments(sp)
    sargs = sp.parse_args(serve_argv)
    serve.check_args(sargs)
    dev = torch.device("cuda", 0)
    doc = {
        "cudnn": torch.backends.cudnn.version(),  # the GPU, torch and CUDA: write_result's machine and versions
        "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or os.environ.get("PYTORCH_ALLOC_CONF"),
        "settings": {
            "serve_argv": serve_argv,
            "lengths": args.lengths,
            "seed": args.seed,
            "bucket": args.bucket,
            "common_prefix": args.common_prefix,
            "conversation": args.conversation,
            "no_cascade_cost": args.no_cascade_cost,
        },
        "requests": [],
    }
    t0 = time.perf_counter()
    llm = build_llm(DistContext(0, 1, 0, 1, "nccl", dev), sargs)
    doc["build_s"] = round(time.perf_counter() - t0, 1)
    backend = llm.engine_core.runner.backend
    if args.bucket is not None:
        if getattr(backend, "cascade", None) is None:
            print("--bucket: this engine runs no cascade", file=sys.stderr)
            return 2
        if not 1 <= args.bucket <= backend.cascade_bucket:  # the memory reserve was sized for the backend's own
            print(f"--bucket {args.bucket}: give 1 .. {backend.cascade_bucket} (the backend's own)", file=sys.stderr)
            return 2
        backend.cascade_bucket = args.bucket
    if args.no_cascade_cost:
        if getattr(backend, "cascade_cost", None) is None:
            print("--no-cascade-cost: this engine's cascade has no cost model (not auto's cuDNN)", file=sys.stderr)
            return 2
        backend.cascade_cost = None
    doc["cascade_bucket"] = getattr(backend, "cascade_bucket", None)
    doc["cascade_cost"] = getattr(backend, "cascade_cost", None) is not None  # auto's cost model weighs each chunk
    doc["describe"] = llm.describe()
    print(doc["describe"], flush=True)
    free, total = torch.cuda.mem_get_info()
    doc["free_gib_after_build"] = round(free / 2**30, 2)
    a = allocator_state()
    doc["warm_up"] = warm_up(llm)
    doc["warm_up_allocator"] = delta(a, allocator_state())
    print(f"warm-up {doc['warm_up']['warmup_s']} s", flush=True)
    core = llm.engine_core
    rng = np.random.default_rng(args.seed)
    seen = set()
    common = rng.integers(10, llm.config.vocab_size - 10, size=args.common_prefix).tolist()
    prompt: list[int] = []
    for n in lengths:
        if args.conversation:  # the conversation so far, then this turn's new tokens
            prompt = prompt + rng.integers(10, llm.config.vocab_size - 10, size=n - len(prompt)).tolist()
        else:
            prompt = common + rng.integers(10, llm.config.vocab_size - 10, size=n - len(common)).tolist()
        row = timed_request(core, prompt)
        row["cascade_plans_known"] = len(getattr(backend, "_planned", ()))  # grows when a request built new ones
        row["first_of_its_length"] = n not in seen
        seen.add(n)
        doc["requests"].append(row)
        print(
            f"{n} tokens{' (first of its length)' if row['first_of_its_length'] else ''}, {row['cached_tokens']} "
            f"cached: TTFT {row['ttft_s']} s, "
            f"steps {row['step_s']}, allocator {row['allocator']}",
            flush=True,
        )
    free, _ = torch.cuda.mem_get_info()
    doc["free_gib_after_requests"] = round(free / 2**30, 2)
    write(args.out, doc)  # the requests' rows, whatever the probe does
    try:
        bucket = getattr(backend, "cascade_bucket", 1)
        doc["plan_probe"] = plan_probe(llm.config, llm.engine_core.runner.dtype, shapes, bucket)
        for r in doc["plan_probe"]:
            print(f"cascade alone at {r['queries']} queries after {r['prefix']}: {r['call_s']} s", flush=True)
    except Exception as exc:  # noqa: BLE001 (the requests' rows are written whatever the probe does)
        doc["plan_probe_error"] = f"{type(exc).__name__}: {exc}"
        print(doc["plan_probe_error"], flush=True)
    llm.close()
    write(args.out, doc)
    print(f"wrote {args.out}", flush=True)
    return 0


def write(path: str, doc: dict) -> None:
    from spanllm.output_files import write_result

    extra = {k: v for k, v in doc.items() if k not in ("settings", "requests")}
    write_result(path, "first_request", doc["settings"], doc["requests"], **extra)


if __name__ == "__main__":
    sys.exit(main())
