"""`spanllm bench host`: the serving engine's host time per step, without a model.

The engine's loop (schedule -> plan -> run -> sample -> append / finish) runs with a runner that returns
zero logits at once, so what is timed is the host's share of a step: the scheduler, `plan_step`, the
sampler's calls and the per-request outputs. On a GPU this time is serialized with the step's kernels
(nothing overlaps it yet), so it adds to every inter-token latency.

    spanllm bench host --requests 600 --prompt-len 230 --output-len 150 --max-num-seqs 256
"""

from __future__ import annotations

import argparse
import time

import torch

from spanllm.engine.core.scheduler import SCHEDULING_POLICIES
from spanllm.output_files import write_json

DEFAULT_QUESTION_LEN = 128
# Bounds of a run (the block manager holds max_num_seqs sequences' blocks in Python lists; every request is queued at
# once): a sequence of at most Llama 3.1's context, at most this many blocks and requests
MAX_SEQ_TOKENS = 131072
MAX_BLOCKS = 1 << 22
MAX_REQUESTS = 100_000


class _NoModel:
    """A runner that computes nothing: logits of zeros for the rows that sample."""

    device = torch.device("cpu")

    def __init__(self, vocab: int) -> None:
        from spanllm.engine.worker.host_staging import HostStaging

        self.vocab = vocab
        self.staging = HostStaging(self.device, 0)  # CPU: arrays as they are, as the real runner's

    def execute(self, x, prev_tokens=None):
        return torch.zeros(len(x.logits_rows), self.vocab)

    def reset_graphs(self) -> None:
        pass


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--requests", type=int, default=600, help="requests, all queued at once")
    parser.add_argument("--prompt-len", type=int, default=230, help="prompt tokens per request")
    parser.add_argument("--output-len", type=int, default=150, help="output tokens per request (ignore_eos)")
    parser.add_argument("--max-num-seqs", type=int, default=256, help="sequences per step")
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192, help="tokens per step")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block")
    parser.add_argument("--vocab", type=int, default=64, help="width of the fake logits (sampling cost scales with it)")
    parser.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0: greedy)")
    parser.add_argument("--repeats", type=int, default=3, help="runs; the fastest is reported")
    parser.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the block manager's prefix cache (every prompt is distinct: its hashing cost with no hit)",
    )
    parser.add_argument(
        "--families",
        type=int,
        default=0,
        help="prompts share a prefix with every N-th request (request i in family i %% N: arrivals interleaved, as a "
        "shuffled generated-shared-prefix dataset); 0: every prompt distinct",
    )
    parser.add_argument(
        "--question-len",
        type=int,
        default=None,
        help=f"with --families: tokens after the shared prefix (default: {DEFAULT_QUESTION_LEN})",
    )
    parser.add_argument(
        "--scheduling-policy",
        choices=SCHEDULING_POLICIES,
        default="fcfs",
        help="the scheduler's admission order (prefix: a family's requests together)",
    )
    parser.add_argument("--json", default=None, help="write settings and every run here")


def _distinct_prompt(i: int, length: int, vocab: int) -> list[int]:
    """Token 2 repeated, led by i's digits in base vocab - 2 (ids 2 .. vocab - 1)."""
    base, digits = max(vocab - 2, 1), []
    while True:
        digits.append(2 + i % base)
        i //= base
        if i == 0:
            break
    return (digits + [2] * length)[:length]


def _family_prompt(i: int, families: int, length: int, question: int, vocab: int) -> list[int]:
    """Family i % families' shared prefix (length - question tokens), then request i's own question tokens."""
    shared = _distinct_prompt(i % families, length - question, vocab)
    return shared + _distinct_prompt(i, question, vocab)


def measure(args: argparse.Namespace) -> dict:
    from spanllm.engine.core.block_manager import BlockManager
    from spanllm.engine.core.scheduler import SchedulerConfig
    from spanllm.engine.engine_core import EngineCore
    from spanllm.engine.sampler import SamplingParams

    per_seq = -(-(args.prompt_len + args.output_len) // args.block_size)
    core = EngineCore(
        _NoModel(args.vocab),
        BlockManager(args.max_num_seqs * per_seq + 2, args.block_size, getattr(args, "enable_prefix_caching", True)),
        SchedulerConfig(
            args.max_num_seqs,
            args.max_num_batched_tokens,
            args.prompt_len + args.output_len,
            scheduling_policy=getattr(args, "scheduling_policy", "fcfs"),
        ),
        vocab_size=max(args.vocab, 2),
        eos_token_ids=(1,),
    )
    params = SamplingParams(temperature=args.temperature, max_tokens=args.output_len, ignore_eos=True)
    families = getattr(args, "families", 0)
    family_of = {}
    for i in range(args.requests):  # distinct prompts (a different first block each): no prefix-cache hit
        if families:
            prompt = _family_prompt(i, families, args.prompt_len, args.question_len, args.vocab)
        else:
            prompt = _distinct_prompt(i, args.prompt_len, args.vocab)
        family_of[core.add_request(prompt, params).request_id] = i % families if families else i
    t0 = time.perf_counter()
    steps = 0
    groups = []  # families among a step's running sequences (what shared-prefix decode attention reads per step)
    while core.has_unfinished():
        core.step()
        steps += 1
        if families and core.scheduler.running:
            groups.append(len({family_of[s.request_id] for s in core.scheduler.running}))
    elapsed = time.perf_counter() - t0
    sampled = core.stats.generation_tokens  # one per sequence and step that sampled
    sched = core.scheduler
    return {
        "steps": steps,
        "seconds": elapsed,
        "ms_per_step": 1e3 * elapsed / steps,
        "mean_sampled_per_step": sampled / steps,
        "us_per_sampled_token": 1e6 * elapsed / max(sampled, 1),
        "prefix_cache_hit_rate": sched.prefix_cache_hits / max(sched.prefix_cache_queries, 1),
        "mean_families_running": sum(groups) / len(groups) if groups else None,
    }


def run(args: argparse.Namespace) -> int:
    from spanllm import checks
    from spanllm.errors import UsageError

    checks.output_file("--json", args.json)
    for name in ("requests", "prompt_len", "output_len", "max_num_seqs", "block_size", "repeats", "vocab"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} {getattr(args, name)}: must be >= 1")
    if args.prompt_len + args.output_len > MAX_SEQ_TOKENS:
        raise UsageError(
            f"--prompt-len {args.prompt_len} + --output-len {args.output_len}: more than {MAX_SEQ_TOKENS} tokens a "
            "sequence (Llama 3.1's context); give shorter lengths"
        )
    blocks = args.max_num_seqs * -(-(args.prompt_len + args.output_len) // args.block_size) + 2
    if blocks > MAX_BLOCKS:
        raise UsageError(
            f"--max-num-seqs {args.max_num_seqs} sequences of {args.prompt_len + args.output_len} tokens in blocks of "
            f"{args.block_size}: {blocks} KV blocks, more than {MAX_BLOCKS}; give fewer sequences, shorter lengths or "
            "larger blocks"
        )
    if args.requests > MAX_REQUESTS:
        raise UsageError(f"--requests {args.requests}: at most {MAX_REQUESTS} (all are queued at once)")
    if args.families < 0:
        raise UsageError(f"--families {args.families}: must be >= 0 (0: every prompt distinct)")
    if args.question_len is not None and not args.families:
        raise UsageError(
            f"--question-len {args.question_len}: the tokens after a family's shared prefix, and without --families "
            "every prompt is distinct; add --families N or drop --question-len"
        )
    default = " (the default)" if args.question_len is None else ""
    if args.families and args.question_len is None:
        args.question_len = DEFAULT_QUESTION_LEN
    if args.families and not 1 <= args.question_len < args.prompt_len:
        raise UsageError(
            f"--question-len {args.question_len}{default}: must be in [1, --prompt-len {args.prompt_len}) "
            "(the rest is shared)"
        )
    checks.temperature(args.temperature)
    checks.batched_tokens_cover_seqs(args.max_num_batched_tokens, args.max_num_seqs)
    if args.scheduling_policy == "prefix" and not args.enable_prefix_caching:
        raise UsageError("--scheduling-policy prefix needs prefix caching: drop --no-enable-prefix-caching")
    rows = [measure(args) for _ in range(args.repeats)]
    best = min(rows, key=lambda r: r["ms_per_step"])
    print(
        f"host time per engine step: {best['ms_per_step']:.2f} ms (best of {args.repeats}; {best['steps']} steps, "
        f"{best['mean_sampled_per_step']:.0f} tokens sampled per step on average, {best['us_per_sampled_token']:.1f} "
        "us per sampled token)"
    )
    if args.families:
        print(
            f"prefix-cache hit rate {best['prefix_cache_hit_rate']:.1%}; families among the running sequences: "
            f"{best['mean_families_running']:.1f} per step on average ({args.scheduling_policy})"
        )
    if args.json:
        write_json("--json", args.json, {"settings": vars(args), "runs": rows}, indent=1)
    return 0
