"""`spanllm bench throughput`: offline throughput of the serving engine, with vLLM's `bench throughput`
contract: requests from ShareGPT V3 (vLLM's sampling) or random lengths, every request with
temperature 1.0, top_p 1.0, ignore_eos and max_tokens = its output length, all handed to the engine at
once; prints "Throughput: X requests/s, Y total tokens/s, Z output tokens/s" and writes JSON. On a terminal,
rank 0 shows a progress bar on stderr while the requests run (spanllm.engine.progress).

    spanllm bench throughput --model tiny --dataset-name random --input-len 32 --output-len 16 --num-prompts 8
    spanllm bench throughput --model llama3.1-8b --num-prompts 1000 --json results/throughput.json     # GPU

The timed region is vLLM's: from handing the text prompts over (tokenization inside) to the last
output (detokenization inside). Before it, untimed: spanllm.engine.warmup (Triton compiles, every decode CUDA-graph
bucket, on a GPU a prompt of two full chunks), so no first-call cost lands inside the timing.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
import torch

from spanllm.commands.dataset_args import (
    add_dataset_arguments,
    check_dataset_arguments,
    distinct_files,
    get_samples,
    length_flags,
    num_requests_of,
    resolve_dataset_source,
)
from spanllm.commands.engine_args import (
    add_engine_arguments,
    add_model_arguments,
    build_llm,
    check_engine_arguments,
    resolve_dtype,
)
from spanllm.engine import cuda_allocator
from spanllm.engine.progress import RequestProgress
from spanllm.engine.warmup import warm_up, warm_up_worker
from spanllm.errors import UsageError
from spanllm.launch import DistContext, finish, launch
from spanllm.output_files import write_json

USES_COLLECTIVES = True  # its ranks join a process group (spanllm.launch): --pg-timeout applies
LONG_SAMPLE_REQUESTS = 100_000  # from this many requests on, sampling says on stderr that it runs (it takes a while)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    add_engine_arguments(parser)
    add_dataset_arguments(parser, default_dataset="sharegpt", seed=False)
    parser.add_argument("--json", "--output-json", dest="json", default=None, help="write the result here")
    parser.add_argument("--no-warmup", action="store_true", help="skip the untimed warm-up request and graph capture")
    parser.add_argument(
        "--samples-file", default=None, help="requests saved by --save-samples (its first --num-prompts)"
    )
    parser.add_argument("--save-samples", default=None, help="write the sampled requests here")
    parser.add_argument("--dry-run", action="store_true", help="sample (and --save-samples) only; start no engine")


def machine_info(device: torch.device) -> dict:
    """spanllm.measure.report's machine and versions, the rank's device, and transformers (the peer's library)."""
    from spanllm.measure import report

    versions = report.versions()
    try:
        import transformers

        versions["transformers"] = transformers.__version__
    except ImportError:
        pass
    return {**report.machine_info(), "device": str(device), "versions": versions}


def _rank(ctx: DistContext, args: argparse.Namespace, samples, tokenizer) -> dict | None:
    """`samples`: the requests run() sampled and checked with `tokenizer` (the model's), before any rank started."""
    from spanllm.engine.sampler import SamplingParams

    llm = build_llm(ctx, args)
    llm.get_tokenizer(tokenizer)
    try:
        core = llm.engine_core
        if core.rank != 0:
            if not args.no_warmup:
                warm_up_worker(llm)
            llm.generate([])  # the timed run's plans
            return None
        describe = llm.describe()
        print(describe, flush=True)
        warm = {} if args.no_warmup else warm_up(llm)
        prompts = [r.prompt for r in samples]
        params = [SamplingParams(temperature=1.0, top_p=1.0, ignore_eos=True, max_tokens=r.output_len) for r in samples]
        stats0 = dict(vars(core.stats))
        if ctx.device.type == "cuda":
            torch.cuda.synchronize()
        with RequestProgress(len(prompts)) as bar:  # a bar on a terminal only; its start and stop are not timed
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params, on_output=bar.on_output)
            elapsed = time.perf_counter() - t0
        prompt_tokens = sum(len(o.prompt_ids) for o in outs)
        output_tokens = sum(len(o.output_ids) for o in outs)
        expected = sum(r.output_len for r in samples)
        if output_tokens != expected:
            raise RuntimeError(f"generated {output_tokens} tokens but the requests asked for {expected} (ignore_eos)")
        s = core.stats
        queries = s.prefix_cache_queries - stats0["prefix_cache_queries"]
        hits = s.prefix_cache_hits - stats0["prefix_cache_hits"]
        gaps = [b - a for o in outs for a, b in zip(o.metrics["token_times"], o.metrics["token_times"][1:])]
        tpots = [
            (o.metrics["finished_at"] - o.metrics["first_token"]) / (len(o.output_ids) - 1)
            for o in outs
            if len(o.output_ids) > 1
        ]
        latency = {
            "median_itl_ms": 1e3 * float(np.median(gaps)) if gaps else None,
            "mean_tpot_ms": 1e3 * float(np.mean(tpots)) if tpots else None,
            "median_ttft_ms": 1e3 * float(np.median([o.metrics["first_token"] - o.metrics["arrival"] for o in outs])),
        }
        return {
            "elapsed_time": elapsed,
            "num_requests": len(outs),
            "total_num_tokens": prompt_tokens + output_tokens,
            "total_input_tokens": prompt_tokens,
            "total_output_tokens": output_tokens,
            "requests_per_second": len(outs) / elapsed,
            "tokens_per_second": (prompt_tokens + output_tokens) / elapsed,
            "output_tokens_per_second": output_tokens / elapsed,
            "mean_prompt_len": prompt_tokens / len(outs),
            "mean_output_len": output_tokens / len(outs),
            **latency,
            # vLLM's prefix-cache stats over the timed requests: prompt tokens looked up, found, their ratio
            "prefix_cache": {
                "enabled": core.blocks.enable_prefix_caching,
                "queries": queries,
                "hits": hits,
                "hit_rate": hits / queries if queries else None,
            },
            "engine": {
                "describe": describe,
                "steps": s.steps - stats0["steps"],
                "preemptions": s.preemptions - stats0["preemptions"],
                "graph_buckets_captured": core.runner.captured_buckets,
                "mixed_graph_token_buckets": core.runner.captured_token_buckets,
                "kv_cache_blocks": llm.kv_sizing.num_blocks - 1,
                "block_size": llm.kv_sizing.block_size,
                "kv_cache_tokens": llm.kv_sizing.capacity_tokens,
                **warm,
            },
            "dataset": samples.info,
            "machine": machine_info(ctx.device),
            "settings": {k: v for k, v in vars(args).items() if not callable(v)},
        }
    finally:
        llm.close()


def model_tokenizer(model: str):
    """The tokenizer of `--model`, without the model."""
    from spanllm.engine.tokenizer import get_tokenizer
    from spanllm.model.config import resolve_model

    cfg = resolve_model(model)
    return get_tokenizer(cfg.name, cfg.checkpoint_dir)


def requests_from_args(args: argparse.Namespace, tokenizer):
    from spanllm.bench.sample_file import load_first_samples, save_samples

    if args.samples_file:  # its first --num-prompts requests, as bench serve
        samples = load_first_samples(args.samples_file, args.num_prompts)
    else:
        samples = get_samples(args, tokenizer)
        if tokenizer is not None:  # a samples file names its tokenizer (check_requests compares it)
            samples.info["tokenizer"] = tokenizer.name
    if args.save_samples and int(os.environ.get("RANK", "0")) == 0:
        save_samples(samples, args.save_samples)
    return samples


def _length_flags(args: argparse.Namespace) -> str:
    return f"--samples-file {args.samples_file}" if args.samples_file else length_flags(args)


def check_kv_pool_fits(args: argparse.Namespace, cfg) -> None:
    """--num-kv-blocks on CPU ranks against this machine's memory, by the rank's own rule (kv_cache.size_pool), before
    the sampling and the model; a GPU's free memory is the rank's to read."""
    from spanllm import checks
    from spanllm.engine.config import FP8_KV_CACHE_DTYPES
    from spanllm.engine.worker.kv_cache import bytes_per_block, size_pool

    world = checks.world_size(args.nprocs)
    if args.num_kv_blocks is None or checks.device_type(world) != "cpu":
        return
    cpu = torch.device("cpu")
    kv_dtype = torch.float8_e4m3fn if args.kv_cache_dtype in FP8_KV_CACHE_DTYPES else resolve_dtype(args.dtype, cpu)
    kv_heads = max(cfg.num_kv_heads // (args.tp or world), 1)  # a TP rank's KV heads (replicated past them)
    per_block = bytes_per_block(cfg.num_layers, args.block_size, kv_heads, cfg.head_dim, kv_dtype)
    size_pool(
        device=cpu,
        per_block=per_block,
        block_size=args.block_size,
        gpu_memory_utilization=0.0,
        cpu_kv_cache_bytes=0,
        reserve_bytes=0,
        num_kv_blocks=args.num_kv_blocks,
    )


def check_requests(samples, tokenizer, cfg, args: argparse.Namespace) -> None:
    """The sampled requests against the engine's limits, before any rank starts: each prompt as the engine
    tokenizes it (its text) + its output within the context (--max-model-len) and the KV pool (--num-kv-blocks);
    a samples file's saved prompt_len against that count (another tokenizer made it otherwise)."""
    from spanllm import checks
    from spanllm.bench.datasets import _num_special_tokens, count_tokens

    reqs = samples.requests
    if not args.samples_file:  # ShareGPT's oversampled requests repeat its first unique_requests
        reqs = reqs[: samples.info.get("unique_requests", len(reqs))]
    # prompt_len: the random-token datasets (their ids kept) count the prompt without the special tokens
    n_special = _num_special_tokens(tokenizer)
    lens = [r.prompt_len + (n_special if r.prompt_token_ids else 0) for r in reqs]
    if args.samples_file:
        saved_lens, lens = lens, count_tokens(tokenizer, [r.prompt for r in reqs])
        bad = [i for i, (n, w) in enumerate(zip(lens, saved_lens)) if n != w]
        if bad:
            i = bad[0]
            saved = samples.info.get("tokenizer")
            raise UsageError(
                f"--samples-file {args.samples_file}: its prompts were counted by another tokenizer"
                f"{f' ({saved!r})' if saved else ''}: request {i} was saved as {reqs[i].prompt_len} tokens, and "
                f"--model {args.model}'s tokenizer ({tokenizer.name!r}) makes {lens[i]} of it ({len(bad)} of "
                f"{len(reqs)} requests differ; mean prompt {samples.mean_prompt_len:.1f} saved, "
                f"{sum(lens) / len(lens):.1f} here); run the model it was sampled for, or sample again for this one "
                "(--save-samples)"
            )
    totals = [n + r.output_len for n, r in zip(lens, reqs)]
    i = max(range(len(totals)), key=totals.__getitem__)
    what = f"the longest request of the sample, #{i} ({_length_flags(args)})"
    checks.sequence_fits(lens[i], reqs[i].output_len, cfg, args.max_model_len, what)
    if args.num_kv_blocks is not None:
        capacity = (args.num_kv_blocks - 1) * args.block_size
        if totals[i] > capacity:
            need = 1 + -(-totals[i] // args.block_size)
            raise UsageError(
                f"--num-kv-blocks {args.num_kv_blocks}: the KV pool holds {capacity} tokens (block 0 is reserved, "
                f"--block-size {args.block_size}), and {what}, needs {totals[i]} ({lens[i]} prompt + "
                f"{reqs[i].output_len} output); give --num-kv-blocks {need} or more, or shorter requests"
            )


def run(args: argparse.Namespace) -> int:
    cuda_allocator.apply_default()  # before any rank starts CUDA (spawned ranks inherit it)
    from spanllm import checks
    from spanllm.bench.sample_file import load_first_samples

    resolve_dataset_source(args)
    cfg = check_engine_arguments(args)
    checks.at_least("--num-prompts", args.num_prompts, 1)
    checks.output_file("--json", args.json)
    checks.output_file("--save-samples", args.save_samples)
    distinct_files(("--samples-file", args.samples_file), ("--save-samples", args.save_samples), ("--json", args.json))
    checks.no_result_in_dry_run(
        args.dry_run, args.json, "starts no engine", "--save-samples writes the sampled requests"
    )
    check_kv_pool_fits(args, cfg)
    if args.samples_file:
        load_first_samples(args.samples_file, args.num_prompts)  # refused here, before the tokenizer loads
    else:
        check_dataset_arguments(args, cfg)
    # the requests before any rank starts: a dataset that cannot be read, or requests the engine would refuse,
    # cost no model load (on every rank under a launcher: each decides alike)
    tokenizer = model_tokenizer(args.model)
    n = None if args.samples_file else num_requests_of(args)
    if n is not None and n >= LONG_SAMPLE_REQUESTS:
        print(f"sampling {n} {args.dataset_name} requests before the engine starts ...", file=sys.stderr)
    t0 = time.perf_counter()
    samples = requests_from_args(args, tokenizer)
    if n is not None and n >= LONG_SAMPLE_REQUESTS:
        print(f"sampled {len(samples)} requests in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    check_requests(samples, tokenizer, cfg, args)
    if args.dry_run:
        print(
            f"{len(samples)} requests: mean prompt {samples.mean_prompt_len:.1f}, mean output "
            f"{samples.mean_output_len:.1f} tokens"
            + (f"; wrote {args.save_samples}" if args.save_samples else "")
            + "; dry run: the engine flags were checked against them, no engine started"
        )
        return 0
    results = launch(_rank, args, samples, tokenizer, nprocs=args.nprocs)
    r = results[0]
    if r is None:
        return finish(0)
    print(
        f"Throughput: {r['requests_per_second']:.2f} requests/s, {r['tokens_per_second']:.2f} total tokens/s, "
        f"{r['output_tokens_per_second']:.2f} output tokens/s"
    )
    itl = f"; median inter-token {r['median_itl_ms']:.2f} ms" if r["median_itl_ms"] is not None else ""
    print(
        f"{r['num_requests']} requests, {r['total_input_tokens']} prompt + {r['total_output_tokens']} output tokens "
        f"in {r['elapsed_time']:.2f} s; {r['engine']['steps']} steps, {r['engine']['preemptions']} preemptions{itl}"
    )
    pc = r["prefix_cache"]
    print(
        f"prefix cache {'on' if pc['enabled'] else 'off'}: hit rate "
        + (f"{100 * pc['hit_rate']:.1f}% ({pc['hits']} of {pc['queries']} prompt tokens)" if pc["queries"] else "n/a")
    )
    if args.json:
        write_json("--json", args.json, r, indent=1, default=str)
        print(f"wrote {args.json}")
    return finish(0)
