"""`spanllm generate`: generate tokens from a preset (random weights) or an HF checkpoint directory.

spanllm generate --model tiny --prompt-ids 1,2,3 --max-new-tokens 8 --nprocs 2        # CPU, TP=2 on gloo
torchrun --nproc-per-node 2 -m spanllm.cli generate --model DIR --prompt "Hello" --allreduce nccl
"""

from __future__ import annotations

import argparse
import os

import torch

from spanllm import checks
from spanllm.dtypes import model_dtype as parse_dtype
from spanllm.engine.config import COMPILE_SCOPES, DECODE_GEMMS, EngineConfig
from spanllm.engine.sampler import SamplingParams
from spanllm.errors import UsageError
from spanllm.launch import DistContext, launch
from spanllm.model.config import resolve_model
from spanllm.model.parallel_dims import ParallelDims


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """Options shared with `spanllm bench batch` / `bench study`."""
    parser.add_argument(
        "--model",
        required=True,
        help="preset (tiny, llama3.1-8b, llama3.1-70b, llama3.1-405b, NAME:layers=N, smollm2-135m-instruct), "
        "HF checkpoint dir or .gguf file",
    )
    parser.add_argument(
        "--dtype", default="auto", help="bfloat16 | float16 | float32 | auto (bf16 on GPU, fp32 on CPU)"
    )
    parser.add_argument("--seed", type=int, default=0, help="random-weight and sampling seed")
    parser.add_argument("--nprocs", type=int, default=1, help="local CPU ranks over gloo (ignored under torchrun)")
    parser.add_argument(
        "--ranks-per-node", type=int, default=None, help="ranks per (virtual) node; default LOCAL_WORLD_SIZE"
    )
    parser.add_argument("--no-cuda-graphs", action="store_true", help="decode eagerly on GPU")
    parser.add_argument(
        "--compile-decode",
        action="store_true",
        help="torch.compile the decode forward (dynamic=False: one compile per batch bucket; the "
        "all-reduce goes through torch.ops.spanllm.all_reduce_)",
    )
    parser.add_argument(
        "--compile-backend",
        default="inductor",
        help="torch.compile backend for --compile-decode (inductor; aot_eager traces only)",
    )
    parser.add_argument(
        "--compile-scope",
        choices=COMPILE_SCOPES,
        default="layer",
        help="--compile-decode: 'layer' compiles one decoder layer, shared by all (one compile "
        "per bucket at any depth); 'forward' the whole decode forward",
    )
    parser.add_argument(
        "--decode-gemm",
        choices=DECODE_GEMMS,
        default="auto",
        help="weight GEMMs of <= 16 rows (decode): 'torch' = F.linear (cuBLAS), 'skinny' = "
        "spanllm's Triton stream over the weights (GPU + Triton), 'auto' = skinny where its "
        "measured table (spanllm/kernels/skinny_gemm.py) says it is faster, else F.linear",
    )
    parser.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="tokens one sequence may hold, prompt + generated (default: the model's "
        "max_position_embeddings; more only with SPANLLM_ALLOW_LONG_MAX_MODEL_LEN=1)",
    )


def check_model_arguments(args: argparse.Namespace, world: int):
    """The shared options, before any rank starts; returns (ModelConfig, Topology, device type)."""
    device = checks.device_type()
    checks.engine_dtype(args.dtype)
    cfg = checks.model(args.model)
    topo = checks.topology(world, args.ranks_per_node)
    checks.decode_gemm(args.decode_gemm, device)
    checks.compile_backend(args.compile_decode, args.compile_backend)
    checks.context_limit(cfg, args.max_model_len)
    return cfg, topo, device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return parse_dtype(name)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    parser.add_argument(
        "--prompt-ids", action="append", default=[], help="comma-separated token ids; repeat for a batch"
    )
    parser.add_argument(
        "--prompt",
        action="append",
        default=[],
        help="text prompt (needs a checkpoint dir with a tokenizer); repeat for a batch",
    )
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--ignore-eos", action="store_true", help="always generate --max-new-tokens tokens")
    parser.add_argument("--tp", type=int, default=None, help="tensor-parallel degree (default: world size / pp)")
    parser.add_argument("--pp", type=int, default=1, help="pipeline stages")
    parser.add_argument("--micro-batches", type=int, default=1, help="pipeline micro-batches")
    parser.add_argument(
        "--allreduce", default=None, help="registered all-reduce name (default: nccl on GPU, gloo on CPU)"
    )


def _parse_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise UsageError(f"--prompt-ids {text!r}: expected comma-separated integers like 1,2,3") from None


def _tokenizer(cfg):
    from spanllm.engine.tokenizer import get_tokenizer

    return get_tokenizer(cfg.name, cfg.checkpoint_dir)


def _generate_rank(ctx: DistContext, args: argparse.Namespace, prompts: list[list[int]]) -> dict:
    """`prompts`: the token ids run() checked (from --prompt-ids, then the tokenized --prompt texts)."""
    from spanllm.engine.llm import LLM

    cfg = resolve_model(args.model)
    tokenizer = _tokenizer(cfg) if args.prompt else None
    tp = args.tp or ctx.world_size // args.pp
    engine = EngineConfig(
        max_batch_size=len(prompts),
        max_seq_len=max(map(len, prompts)) + args.max_new_tokens,
        dtype=resolve_dtype(args.dtype, ctx.device),
        cuda_graphs=not args.no_cuda_graphs,
        micro_batches=args.micro_batches,
        seed=args.seed,
        compile_decode=args.compile_decode,
        compile_backend=args.compile_backend,
        compile_scope=args.compile_scope,
        decode_gemm=args.decode_gemm,
    )
    llm = LLM(
        cfg,
        engine,
        dims=ParallelDims(tp, args.pp, ctx.world_size),
        allreduce=args.allreduce,
        device=ctx.device,
        ranks_per_node=args.ranks_per_node,
    )
    try:
        params = SamplingParams(
            temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_new_tokens, ignore_eos=args.ignore_eos
        )
        out = llm.generate_static(prompts, params)
        texts = [tokenizer.decode(t) for t in out.token_ids] if tokenizer is not None else None
        return {
            "describe": llm.describe(),
            "allreduce_ran": llm.allreduce_ran(len(prompts)),
            "prompts": prompts,
            "tokens": out.token_ids,
            "texts": texts,
            "ttft_ms": out.ttft_ms,
            "e2e_ms": out.e2e_ms,
        }
    finally:
        llm.close()


def check_arguments(args: argparse.Namespace) -> list[list[int]]:
    """Every argument and the checkpoint, before any rank starts; returns the prompts' token ids."""
    if not args.prompt and not args.prompt_ids:
        raise UsageError("give at least one --prompt-ids or --prompt")
    world = checks.world_size(args.nprocs)
    cfg, topo, device = check_model_arguments(args, world)
    if args.prompt and cfg.checkpoint_dir is None:
        raise UsageError(
            f"--prompt needs a checkpoint directory with a tokenizer; {args.model!r} is a preset (use --prompt-ids)"
        )
    checks.layout(args.tp, args.pp, world, cfg, topo)
    checks.at_least("--micro-batches", args.micro_batches, 1)
    if args.allreduce is not None:
        checks.allreduce_names([args.allreduce], device)
    checks.at_least("--max-new-tokens", args.max_new_tokens, 1)
    checks.at_least("--temperature", args.temperature, 0.0, " (0 = greedy)")
    if not 0.0 < args.top_p <= 1.0:
        raise UsageError(f"--top-p {args.top_p}: must be in (0, 1] (1 = no nucleus cut)")
    prompts = [_parse_ids(p) for p in args.prompt_ids]
    names = [
        f"--prompt-ids #{i} ({p!r})" if len(p) <= 40 else f"--prompt-ids #{i}" for i, p in enumerate(args.prompt_ids)
    ]
    if args.prompt:
        tokenizer = _tokenizer(cfg)
        prompts += [tokenizer.encode(p) for p in args.prompt]
        names += [f"--prompt #{i}" for i in range(len(args.prompt))]
    checks.token_ids(prompts, names, cfg.vocab_size, cfg.label)
    for ids, name in zip(prompts, names):
        checks.sequence_fits(
            len(ids), args.max_new_tokens, cfg, args.max_model_len, f"{name}: prompt + --max-new-tokens"
        )
    return prompts


def run(args: argparse.Namespace) -> int:
    prompts = check_arguments(args)
    results = launch(_generate_rank, args, prompts, nprocs=args.nprocs)
    if int(os.environ.get("RANK", "0")) != 0:
        return 0
    r = results[0]
    print(r["describe"])
    print(f"all-reduce that ran (decode step, batch {len(r['prompts'])}): {r['allreduce_ran']}")
    for i, toks in enumerate(r["tokens"]):
        print(f"[{i}] prompt ids: {','.join(map(str, r['prompts'][i]))}")
        print(f"[{i}] generated ids: {','.join(map(str, toks))}")
        if r["texts"] is not None:
            print(f"[{i}] text: {r['texts'][i]!r}")
    print(f"TTFT {r['ttft_ms']:.1f} ms, end-to-end {r['e2e_ms']:.1f} ms (rank 0)")
    return 0
