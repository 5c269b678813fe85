"""Where a serving step's time goes, on one GPU (TP=1). Diagnostic for the serving engine's speed work.

    python3 scripts/gpu_profile_steps.py --model llama3.1-8b --samples-file S.json --out DIR [engine flags]

Writes DIR/profile_steps.json:
- `trace`: the offline throughput workload (the saved requests, ignore_eos, temperature 1) driven step by step
  through EngineCore with a CUDA event pair around each step's forward: per step the kind (decode-only or
  mixed), sequences, tokens, GPU forward time, and the host's wall time in step() (with async scheduling the
  host does not wait for the forward, so the two overlap; synchronously the wall time holds the forward).
  Totals by kind, so the gap to a throughput goal splits
  into "GPU forward" and "host".
- `kernels`: torch.profiler tables (CUDA time per kernel name, summed over replays) of decode steps at batch
  1 and 256 replayed from their CUDA graphs, the same steps eager (graphs off: launch gaps show as the
  difference), one step of max_num_batched_tokens prefill tokens, and mixed steps as a ShareGPT run has
  them (255 decodes and one prompt chunk). Each with the measured step time (CUDA events, median of the
  replays).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np
import torch


def parse() -> argparse.Namespace:
    from spanllm.commands import bench_throughput as throughput

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    throughput.add_arguments(p)
    p.add_argument("--out", required=True, help="folder for profile_steps.json")
    p.add_argument("--trace-prompts", type=int, default=1000, help="requests of the step trace (from the samples)")
    p.add_argument("--profile-batches", default="1,256", help="decode batch sizes profiled kernel by kernel")
    p.add_argument("--profile-context", type=int, default=256, help="context of the profiled decode steps")
    p.add_argument("--replays", type=int, default=20)
    p.add_argument(
        "--sampler-only",
        action="store_true",
        help="only the sampler table (no model, no trace), into profile_sampler.json",
    )
    p.add_argument("--mixed-decodes", type=int, default=255, help="decodes of the profiled mixed steps")
    p.add_argument("--mixed-context", type=int, default=384, help="their context")
    p.add_argument("--mixed-chunks", default="64,512,1024", help="prefill tokens of the profiled mixed steps")
    return p.parse_args()


def kernel_table(prof, limit: int = 40) -> list[dict]:
    """GPU-side events (kernels, copies, memsets) by name, largest total first."""
    rows = []
    for e in prof.key_averages():
        if "CUDA" not in str(getattr(e, "device_type", "")):
            continue
        us = float(getattr(e, "self_device_time_total", 0.0) or getattr(e, "device_time_total", 0.0))
        if us > 0:
            rows.append({"name": e.key[:160], "calls": int(e.count), "cuda_us_total": us})
    rows.sort(key=lambda r: -r["cuda_us_total"])
    return rows[:limit]


def trace_workload(llm, samples, n: int) -> dict:
    from spanllm.engine.sampler import SamplingParams

    core = llm.engine_core
    runner = core.runner
    tok = llm.get_tokenizer()
    steps = []
    for r in list(samples)[:n]:
        ids = list(r.prompt_token_ids) if r.prompt_token_ids else tok.encode(r.prompt)
        core.add_request(
            ids, SamplingParams(temperature=1.0, ignore_eos=True, max_tokens=r.output_len), with_text=False
        )
    execute = runner.execute
    timing: dict = {}

    def timed_execute(x, prev_tokens=None):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        out = execute(x, prev_tokens)
        b.record()
        timing["events"] = (a, b)
        timing["x"] = x
        return out

    runner.execute = timed_execute
    torch.cuda.synchronize()
    t_start = time.perf_counter()
    pending = []  # (kind, seqs, tokens, events, host wall of the step): read after the run, so no step waits
    try:
        while core.has_unfinished():
            t0 = time.perf_counter()
            timing.clear()
            core.step()
            wall = time.perf_counter() - t0
            if "events" not in timing:
                continue
            x = timing["x"]
            pending.append(
                (
                    int(x.num_decode == x.num_tokens),
                    len(x.q_lens),
                    x.num_tokens,
                    timing["events"],
                    wall,
                    x.num_decode,
                    int(x.context_lens[: x.num_decode].sum()),
                )
            )
    finally:
        runner.execute = execute
    torch.cuda.synchronize()
    total = time.perf_counter() - t_start
    for i, (kind, seqs, tokens, (a, b), wall, nd, dctx) in enumerate(pending):
        # from this forward's end to the next one's start: the sampler's kernels plus any time the GPU waited
        # for the host (0 after the last step)
        gap = b.elapsed_time(pending[i + 1][3][0]) / 1e3 if i + 1 < len(pending) else 0.0
        steps.append((kind, seqs, tokens, a.elapsed_time(b) / 1e3, wall, nd, dctx, gap))
    arr = np.asarray(steps, dtype=np.float64)
    out = {
        "requests": n,
        "wall_s": total,
        "steps": len(steps),
        "columns": [
            "decode_only",
            "seqs",
            "tokens",
            "gpu_forward_s",
            "step_wall_s",
            "decodes",
            "decode_context_sum",
            "gap_to_next_forward_s",
        ],
        "rows": [
            [int(s[0]), int(s[1]), int(s[2]), round(s[3], 6), round(s[4], 6), int(s[5]), int(s[6]), round(s[7], 6)]
            for s in steps
        ],
        "between_forwards_s": float(arr[:, 7].sum()) if len(arr) else 0.0,
    }
    for kind, mask in (("decode_only", arr[:, 0] == 1), ("mixed", arr[:, 0] == 0)):
        sub = arr[mask]
        out[kind] = {
            "steps": int(mask.sum()),
            "gpu_forward_s": float(sub[:, 3].sum()),
            "wall_s": float(sub[:, 4].sum()),
            "host_s": float((sub[:, 4] - sub[:, 3]).clip(min=0).sum()),
            "tokens": int(sub[:, 2].sum()),
            "mean_seqs": float(sub[:, 1].mean()) if len(sub) else 0.0,
        }
    return out


def profile_decode(llm, batch: int, context: int, replays: int, graphs: bool) -> dict:
    """`replays` decode steps of `batch` sequences at `context` tokens (block tables of real blocks)."""
    from spanllm.engine.worker.model_runner import StepInputs

    core = llm.engine_core
    runner = core.runner
    bs = runner.block_size
    nblk = -(-context // bs)
    # Nothing else runs: any blocks past the reserved block 0 serve (the block manager is not involved).
    tables = (1 + np.arange(batch * nblk, dtype=np.int32)).reshape(batch, nblk)
    pos = np.full(batch, context - 1, dtype=np.int64)
    slots = tables[:, (context - 1) // bs].astype(np.int64) * bs + (context - 1) % bs
    x = StepInputs(
        np.ones(batch, np.int64),
        pos,
        slots,
        batch,
        np.full(batch, context, np.int32),
        np.ones(batch, np.int32),
        tables,
        np.arange(batch, dtype=np.int64),
    )
    return _profile(runner, x, replays, graphs)


def profile_prefill(llm, tokens: int, chunk: int, replays: int) -> dict:
    from spanllm.engine.worker.model_runner import StepInputs

    core = llm.engine_core
    runner = core.runner
    bs = runner.block_size
    n = tokens // chunk
    nblk = -(-chunk // bs)
    tables = (1 + np.arange(n * nblk, dtype=np.int32)).reshape(n, nblk)
    pos = np.tile(np.arange(chunk, dtype=np.int64), n)
    slots = (tables[:, np.arange(chunk) // bs].astype(np.int64) * bs + np.arange(chunk) % bs).reshape(-1)
    x = StepInputs(
        np.ones(n * chunk, np.int64),
        pos,
        slots,
        0,
        np.full(n, chunk, np.int32),
        np.full(n, chunk, np.int32),
        tables,
        np.arange(chunk - 1, n * chunk, chunk, dtype=np.int64),
    )
    return _profile(runner, x, replays, True)


def profile_mixed(llm, decodes: int, context: int, chunk: int, replays: int) -> dict:
    """A mixed step as a ShareGPT run has them: `decodes` sequences at `context` tokens, then the first chunk
    of `chunk` tokens of a new prompt (it samples: it is the whole prompt)."""
    from spanllm.engine.worker.model_runner import StepInputs

    runner = llm.engine_core.runner
    bs = runner.block_size
    nblk = -(-context // bs)
    cblk = -(-chunk // bs)
    w = max(nblk, cblk)
    tables = np.zeros((decodes + 1, w), dtype=np.int32)
    tables[:decodes, :nblk] = (1 + np.arange(decodes * nblk, dtype=np.int32)).reshape(decodes, nblk)
    tables[decodes, :cblk] = 1 + decodes * nblk + np.arange(cblk, dtype=np.int32)
    dpos = np.full(decodes, context - 1, dtype=np.int64)
    dslots = tables[:decodes, (context - 1) // bs].astype(np.int64) * bs + (context - 1) % bs
    cpos = np.arange(chunk, dtype=np.int64)
    cslots = tables[decodes, cpos // bs].astype(np.int64) * bs + cpos % bs
    x = StepInputs(
        np.ones(decodes + chunk, np.int64),
        np.concatenate([dpos, cpos]),
        np.concatenate([dslots, cslots]),
        decodes,
        np.array([context] * decodes + [chunk], np.int32),
        np.array([1] * decodes + [chunk], np.int32),
        tables,
        np.concatenate([np.arange(decodes), [decodes + chunk - 1]]).astype(np.int64),
    )
    return _profile(runner, x, replays, True)


def profile_sampler(sampler, vocab: int, device: torch.device, batch: int, replays: int) -> dict:
    """The serving engine's sampler alone on [batch, vocab] float32 logits, as the ShareGPT run samples
    (temperature 1, ignore_eos: no masks), and greedy: milliseconds per call (CUDA events around each call,
    eager launches). temperature_1_unfused: the same rows through the unfused ops (the one-pass race off)."""
    from spanllm.engine import sampler as sampler_mod
    from spanllm.engine.sampler import SamplingParams

    logits = torch.randn(batch, vocab, device=device, dtype=torch.float32)
    out = {"batch": batch}
    fused = sampler_mod.race_argmax
    t1 = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    for name, params, race in (
        ("temperature_1", t1, fused),
        ("temperature_1_unfused", t1, None),
        ("greedy", SamplingParams(max_tokens=16, ignore_eos=True), fused),
    ):
        rows = [params] * batch
        sampler_mod.race_argmax = race
        try:
            for _ in range(3):
                sampler.sample(logits, rows, [()] * batch, [None] * batch)
            times = []
            for _ in range(replays):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                sampler.sample(logits, rows, [()] * batch, [None] * batch)
                b.record()
                b.synchronize()
                times.append(a.elapsed_time(b))
        finally:
            sampler_mod.race_argmax = fused
        out[f"{name}_ms_median"] = float(np.median(times))
    return out


def _profile(runner, x, replays: int, graphs: bool) -> dict:
    keep = runner.use_cuda_graphs
    runner.use_cuda_graphs = graphs and keep
    try:
        for _ in range(3):
            runner.execute(x)
        torch.cuda.synchronize()
        times = []
        for _ in range(replays):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            runner.execute(x)
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(replays):
                runner.execute(x)
            torch.cuda.synchronize()
        table = kernel_table(prof)
    finally:
        runner.use_cuda_graphs = keep
    return {
        "graphs": bool(graphs and keep),
        "tokens": x.num_tokens,
        "seqs": len(x.q_lens),
        "step_ms_median": float(np.median(times)),
        "step_ms": [round(t, 4) for t in times],
        "replays_profiled": replays,
        "kernel_us_per_step": [{**r, "us_per_step": r["cuda_us_total"] / replays} for r in table],
        "kernel_us_per_step_sum": sum(r["cuda_us_total"] for r in table) / replays,
    }


def sweep_min_tiles(llm, calls: int = 200) -> list[dict]:
    """The split decode kernel alone (8B heads) at small batches: microseconds per call for each minimum of
    key tiles per split (paged_attention_triton.MIN_TILES_PER_SPLIT picks one)."""
    from spanllm.cuda_graph import capture_graph
    from spanllm.kernels import paged_attention as kt

    cache = llm.engine_core.runner.cache
    layer = next(iter(cache.k))
    kc, vc = cache.k[layer], cache.v[layer]
    hkv, d = kc.shape[2], kc.shape[3]
    hq = hkv * llm.engine_core.runner.backend.group
    rows = []
    for b in (1, 8, 32):
        splits = kt.num_splits_for(b, hkv, kc.device)
        for ctx in (128, 256, 512, 1024, 2048, 4096):
            nblk = -(-ctx // cache.block_size)
            tables = (1 + torch.arange(b * nblk, dtype=torch.int32, device=kc.device)).reshape(b, nblk)
            cl = torch.full((b,), ctx, dtype=torch.int32, device=kc.device)
            q = torch.randn(b, hq, d, device=kc.device, dtype=llm.engine.dtype)  # an FP8 cache: the model's dtype
            for mt in (1, 2, 4, 8):
                # `calls` back-to-back kernels in one graph (as a step's layers run): no host launch cost inside
                graph = capture_graph(
                    lambda: [kt.decode(q, kc, vc, tables, cl, splits, mt) for _ in range(calls)],  # noqa: B023
                    kc.device,
                    warmup=1,
                )
                graph.replay()
                a, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                graph.replay()
                e.record()
                e.synchronize()
                rows.append(
                    {
                        "batch": b,
                        "context": ctx,
                        "splits": splits,
                        "min_tiles": mt,
                        "us_per_call": 1e3 * a.elapsed_time(e) / calls,
                    }
                )
    return rows


def sampler_table(sampler, vocab: int, device: torch.device, replays: int) -> list[dict]:
    return [profile_sampler(sampler, vocab, device, b, replays) for b in (1, 16, 64, 256)]


def main() -> int:
    from spanllm.bench.sample_file import load_samples
    from spanllm.commands.bench_throughput import machine_info
    from spanllm.commands.engine_args import engine_config_from_args
    from spanllm.engine.llm import LLM
    from spanllm.engine.warmup import warm_up
    from spanllm.model.config import resolve_model

    args = parse()
    if not torch.cuda.is_available():
        raise SystemExit(
            "gpu_profile_steps.py profiles CUDA kernels and graphs: this machine has no CUDA GPU "
            f"(torch {torch.__version__}); run it on the GPU machine (scripts/gpu_check.sh profile)"
        )
    os.makedirs(args.out, exist_ok=True)
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    if args.sampler_only:  # no model: the sampler on random logits of the model's vocabulary
        from spanllm.engine.sampler import BatchSampler

        result = {
            "machine": machine_info(device),
            "settings": {k: v for k, v in vars(args).items() if not callable(v)},
            "sampler": sampler_table(
                BatchSampler(device, 0), resolve_model(args.model).vocab_size, device, args.replays
            ),
        }
        print("sampler", result["sampler"], flush=True)
        with open(os.path.join(args.out, "profile_sampler.json"), "w") as f:
            json.dump(result, f, indent=1)
        return 0
    llm = LLM(resolve_model(args.model), engine_config_from_args(args, device), device=device)
    llm.get_tokenizer()
    result: dict = {
        "describe": llm.describe(),
        "machine": machine_info(device),
        "settings": {k: v for k, v in vars(args).items() if not callable(v)},
    }
    print(result["describe"], flush=True)
    result["warmup"] = warm_up(llm)
    path = os.path.join(args.out, "profile_steps.json")

    def save():
        with open(path, "w") as f:
            json.dump(result, f, indent=1)

    result["decode_min_tiles_sweep"] = sweep_min_tiles(llm)
    save()
    result["kernels"] = {}
    for b in [int(v) for v in args.profile_batches.split(",") if v]:
        if b > llm.engine.max_num_seqs:
            continue
        for graphs in (True, False):
            key = f"decode_b{b}_ctx{args.profile_context}_{'graph' if graphs else 'eager'}"
            result["kernels"][key] = profile_decode(llm, b, args.profile_context, args.replays, graphs)
            print(key, f"{result['kernels'][key]['step_ms_median']:.3f} ms", flush=True)
            save()
    t = llm.engine.max_num_batched_tokens
    key = f"prefill_{t}_tokens_chunks_of_512"
    result["kernels"][key] = profile_prefill(llm, t, 512, max(3, args.replays // 4))
    print(key, f"{result['kernels'][key]['step_ms_median']:.3f} ms", flush=True)
    save()
    runner = llm.engine_core.runner
    for chunk in [int(v) for v in args.mixed_chunks.split(",") if v]:
        key = f"mixed_d{args.mixed_decodes}_ctx{args.mixed_context}_p{chunk}"
        result["kernels"][key] = profile_mixed(
            llm, args.mixed_decodes, args.mixed_context, chunk, max(5, args.replays // 2)
        )
        print(key, f"{result['kernels'][key]['step_ms_median']:.3f} ms", flush=True)
        save()
    result["sampler"] = sampler_table(llm.engine_core.sampler, llm.config.vocab_size, device, args.replays)
    print("sampler", result["sampler"], flush=True)
    save()
    if args.samples_file:
        samples = load_samples(args.samples_file)
        runner.capture_all()  # every graph now, not inside the traced run
        tr = trace_workload(llm, samples, min(args.trace_prompts, len(samples)))
        out_tokens = sum(r.output_len for r in list(samples)[: tr["requests"]])
        tr["output_tokens"] = out_tokens
        tr["output_tokens_per_second"] = out_tokens / tr["wall_s"]
        result["trace"] = tr
        print(
            f"trace: {tr['steps']} steps in {tr['wall_s']:.2f} s = {tr['output_tokens_per_second']:.0f} output tok/s; "
            f"decode-only {tr['decode_only']}; mixed {tr['mixed']}; between forwards (sampler + GPU idle) "
            f"{tr['between_forwards_s']:.2f} s",
            flush=True,
        )
        save()
    llm.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
