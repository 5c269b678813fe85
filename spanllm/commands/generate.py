"""`spanllm generate`: generate tokens from a preset (random weights) or an HF checkpoint directory.

The prompts run as one fixed batch (LLM.generate_batch): every decode step runs all of them, so --max-num-seqs
must cover them; --max-num-batched-tokens cuts the prefill into steps.

spanllm generate --model tiny --prompt-ids 1,2,3 --max-new-tokens 8 --nprocs 2        # CPU, TP=2 on gloo
torchrun --nproc-per-node 2 -m spanllm.cli generate --model DIR --prompt "Hello" --allreduce nccl
"""

from __future__ import annotations

import argparse
import os

from spanllm import checks
from spanllm.commands.engine_args import (
    add_engine_arguments,
    add_model_arguments,
    build_llm,
    check_engine_arguments,
    check_model_arguments,
)
from spanllm.engine import cuda_allocator
from spanllm.engine.sampler import SamplingParams
from spanllm.errors import UsageError
from spanllm.launch import DistContext, launch
from spanllm.model.config import resolve_model

USES_COLLECTIVES = True  # its ranks join a process group (spanllm.launch): --pg-timeout applies


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    add_engine_arguments(parser, serving=False)
    parser.add_argument(
        "--prompt-ids",
        action="append",
        default=[],
        help="comma-separated token ids; repeat for a batch (the prompts run as one fixed batch: every decode step "
        "runs all of them, so --max-num-seqs must be at least their number)",
    )
    parser.add_argument(
        "--prompt",
        action="append",
        default=[],
        help="text prompt (needs a checkpoint dir with a tokenizer); repeat for a batch",
    )
    parser.add_argument("--max-new-tokens", type=int, default=16, help="tokens to generate per prompt")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1 = off)")
    parser.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = off)")
    parser.add_argument("--ignore-eos", action="store_true", help="always generate --max-new-tokens tokens")
    parser.add_argument(
        "--tp",
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=None,
        help="tensor-parallel degree (default: world size / pp)",
    )
    parser.add_argument("--pp", type=int, default=1, help="pipeline stages")
    parser.add_argument("--micro-batches", type=int, default=1, help="pipeline micro-batches")
    parser.add_argument(
        "--allreduce", default=None, help="registered all-reduce name (default: nccl on GPU, gloo on CPU)"
    )


def _parse_ids(text: str) -> list[int]:
    if not text.strip():
        return []  # an empty prompt: checks.prompts says so
    try:
        return [int(t) for t in text.split(",")]
    except ValueError:
        raise UsageError(
            f"--prompt-ids {text!r}: expected comma-separated integers like 1,2,3 (no empty items)"
        ) from None


def _sampling_params(args: argparse.Namespace) -> SamplingParams:
    """The run's sampling parameters (SamplingParams checks their ranges: SamplingParamsError is a usage error)."""
    return SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        max_tokens=args.max_new_tokens,
        ignore_eos=args.ignore_eos,
    )


def _tokenizer(cfg):
    from spanllm.engine.tokenizer import get_tokenizer

    return get_tokenizer(cfg.name, cfg.checkpoint_dir)


def _generate_rank(ctx: DistContext, args: argparse.Namespace, prompts: list[list[int]]) -> dict:
    """`prompts`: the token ids run() checked (from --prompt-ids, then the tokenized --prompt texts)."""

    cfg = resolve_model(args.model)
    tokenizer = _tokenizer(cfg) if args.prompt else None
    llm = build_llm(ctx, args, pp=args.pp)
    try:
        params = _sampling_params(args)
        out = llm.generate_batch(prompts, params, micro_batches=args.micro_batches)
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
    check_engine_arguments(args, serving=False)  # --allreduce too
    checks.at_least("--max-new-tokens", args.max_new_tokens, 1)
    checks.at_least("--top-k", args.top_k, 0, " (0 = off)")
    checks.temperature(args.temperature)
    if not 0.0 < args.top_p <= 1.0:
        raise UsageError(f"--top-p {args.top_p}: must be in (0, 1] (1 = no nucleus cut)")
    cut = [f for f, on in (("--top-k", args.top_k), ("--top-p", args.top_p != 1.0)) if on]
    if cut and args.temperature == 0.0:
        raise UsageError(
            f"{' and '.join(cut)}: greedy decoding (--temperature 0, the default) takes the most likely token, which "
            f"{'they' if len(cut) > 1 else 'it'} would never cut; give --temperature > 0 to sample, or drop "
            f"{' and '.join(cut)}"
        )
    prompts = [_parse_ids(p) for p in args.prompt_ids]
    names = [
        f"--prompt-ids #{i} ({p!r})" if len(p) <= 40 else f"--prompt-ids #{i}" for i, p in enumerate(args.prompt_ids)
    ]
    if args.prompt:
        tokenizer = _tokenizer(cfg)
        prompts += [tokenizer.encode(p) for p in args.prompt]
        names += [f"--prompt #{i}" for i in range(len(args.prompt))]
    checks.prompts(prompts, names, args.max_new_tokens, cfg, args.max_model_len)
    params = _sampling_params(args)
    if params.top_k > cfg.vocab_size:
        raise UsageError(
            f"--top-k {args.top_k}: exceeds the vocabulary of {cfg.vocab_size} tokens; use at most "
            f"{cfg.vocab_size}, or 0 (off)"
        )
    if args.micro_batches > len(prompts):
        raise UsageError(
            f"--micro-batches {args.micro_batches}: more than the {len(prompts)} prompt(s) of the batch; give at "
            f"most {len(prompts)}, or more prompts"
        )
    # one fixed batch: every decode step runs a whole micro-batch (FixedBatchExecutor), never split by max_num_seqs
    per_step = -(-len(prompts) // args.micro_batches)
    if per_step > args.max_num_seqs:
        split = f" (--micro-batches {args.micro_batches}: {per_step} a step)" if args.micro_batches > 1 else ""
        raise UsageError(
            f"--max-num-seqs {args.max_num_seqs}: generate runs its {len(prompts)} prompts as one fixed batch, "
            f"every decode step {per_step} sequences at once{split}; give --max-num-seqs {per_step} or more, or at "
            f"most {args.max_num_seqs * args.micro_batches} prompt(s)"
        )
    if args.num_kv_blocks is not None:
        longest = max(len(p) for p in prompts) + args.max_new_tokens
        need = 1 + len(prompts) * -(-longest // args.block_size)
        if need > args.num_kv_blocks:
            raise UsageError(
                f"--num-kv-blocks {args.num_kv_blocks}: {len(prompts)} sequence(s) of up to {longest} tokens need "
                f"{need} blocks of {args.block_size} tokens (block 0 is reserved); give at least {need}, or run "
                "fewer or shorter sequences"
            )
    return prompts


def run(args: argparse.Namespace) -> int:
    cuda_allocator.apply_default()  # before any rank starts CUDA (spawned ranks inherit it)
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
