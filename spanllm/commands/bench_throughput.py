"""`spanllm bench throughput`: offline throughput of the serving engine, with vLLM's `bench throughput`
contract: requests from ShareGPT V3 (vLLM's sampling) or random lengths, every request with
temperature 1.0, top_p 1.0, ignore_eos and max_tokens = its output length, all handed to the engine at
once; prints "Throughput: X requests/s, Y total tokens/s, Z output tokens/s" and writes JSON. On a terminal,
rank 0 shows a progress bar on stderr while the requests run (spanllm.bench.progress).

    spanllm bench throughput --model tiny --dataset-name random --input-len 32 --output-len 16 --num-prompts 8
    spanllm bench throughput --model llama3.1-8b --num-prompts 1000 --json results/throughput.json     # GPU

The timed region is vLLM's: from handing the text prompts over (tokenization inside) to the last
output (detokenization inside). Before it, untimed: spanllm.engine.warmup (Triton compiles, every decode CUDA-graph
bucket, on a GPU a prompt of two full chunks), so no first-call cost lands inside the timing.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from spanllm.bench.progress import RequestProgress
from spanllm.commands.dataset_args import (
    add_dataset_arguments,
    check_dataset_arguments,
    get_samples,
    resolve_dataset_source,
)
from spanllm.commands.engine_args import add_engine_arguments, add_model_arguments, build_llm, check_engine_arguments
from spanllm.engine import cuda_allocator
from spanllm.engine.warmup import warm_up, warm_up_worker
from spanllm.launch import DistContext, finish, launch
from spanllm.output_files import write_json

USES_COLLECTIVES = True  # its ranks join a process group (spanllm.launch): --pg-timeout applies


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


def _rank(ctx: DistContext, args: argparse.Namespace) -> dict | None:
    from spanllm.engine.sampler import SamplingParams

    samples, tokenizer = None, None
    if ctx.rank == 0:  # the requests before the model: a dataset that cannot be read costs no model load
        tokenizer = model_tokenizer(args.model)
        samples = requests_from_args(args, tokenizer)
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
    if args.save_samples:
        save_samples(samples, args.save_samples)
    return samples


def run(args: argparse.Namespace) -> int:
    cuda_allocator.apply_default()  # before any rank starts CUDA (spawned ranks inherit it)
    from spanllm import checks
    from spanllm.bench.sample_file import load_first_samples

    resolve_dataset_source(args)
    check_engine_arguments(args)
    checks.at_least("--num-prompts", args.num_prompts, 1)
    checks.output_file("--json", args.json)
    checks.output_file("--save-samples", args.save_samples)
    checks.no_result_in_dry_run(
        args.dry_run, args.json, "starts no engine", "--save-samples writes the sampled requests"
    )
    if args.samples_file:
        load_first_samples(args.samples_file, args.num_prompts)  # refused here, before any rank starts
    else:
        check_dataset_arguments(args)
    if args.dry_run:
        s = requests_from_args(args, model_tokenizer(args.model))
        print(
            f"{len(s)} requests: mean prompt {s.mean_prompt_len:.1f}, mean output {s.mean_output_len:.1f} tokens"
            + (f"; wrote {args.save_samples}" if args.save_samples else "")
        )
        return 0
    results = launch(_rank, args, nprocs=args.nprocs)
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
