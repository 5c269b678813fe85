"""`spanllm bench serve`: load test for any OpenAI-compatible server (spanllm, vLLM, SGLang, transformers serve).

The flags, sampling, arrival process, metrics and JSON field names are those of vLLM's `vllm bench serve`
(`vllm/benchmarks/serve.py`), so the numbers compare one to one:

    spanllm bench serve --base-url http://127.0.0.1:8000 --tokenizer llama3.1-8b --dataset-name sharegpt \\
        --num-prompts 1000 --request-rate 1,2,4,8,16,32,inf --result-dir results/serve

One rate prints vLLM's result block (and with --save-result writes vLLM's JSON file). A comma-separated
--request-rate runs a sweep against the same server with the same requests, one run per rate, and writes one
table, one JSON (every rate, machine, versions, settings, the dataset note) and one PNG.

From Python:

    from spanllm.bench.datasets import sample_sharegpt
    from spanllm.commands.bench_serve import ServeBenchConfig, run_benchmark
    samples = sample_sharegpt(tokenizer, 1000, seed=0)
    result = run_benchmark(samples, ServeBenchConfig(base_url="http://127.0.0.1:8000", request_rate=8.0))
    result["output_throughput"], result["median_tpot_ms"]

Differences from vLLM's client, all deliberate: prompts are not re-aligned through the server's /tokenize;
a chunk that carries no token (chat role header, bare finish chunk) is not timed as one (see serve_client);
a request has a timeout (--request-timeout) instead of vLLM's six hours; start_times are seconds from the start
of the run; mean / median / std of TTFT, TPOT, ITL and E2EL are always in the result, percentiles only for
--percentile-metrics.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import time
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime
from typing import Any

from spanllm import checks
from spanllm.bench.datasets import SampleSet
from spanllm.bench.prefix_cache_metrics import prefix_cache_counters, prefix_cache_result
from spanllm.bench.serve_client import RequestInput, RequestOutput, first_model, send_request
from spanllm.bench.serve_metrics import METRICS, arrival_offsets_s, calculate_metrics, parse_goodput, parse_rates
from spanllm.bench.serve_report import rate_label
from spanllm.commands.dataset_args import (
    add_dataset_arguments,
    check_dataset_arguments,
    get_samples,
    resolve_dataset_source,
)
from spanllm.errors import SpanllmError, UsageError

BACKENDS = {"openai": "/v1/completions", "openai-chat": "/v1/chat/completions"}
STATUS_LINE_S = 30.0  # a status line this often while no live progress bar shows (benchmark_async)
DETAILED_FIELDS = (
    "input_lens",
    "output_lens",
    "ttfts",
    "itls",
    "latencies",
    "start_times",
    "queue_times",
    "generated_texts",
    "errors",
)


@dataclass(frozen=True)
class ServeBenchConfig:
    """One `bench serve` run against one server at one request rate."""

    base_url: str = "http://127.0.0.1:8000"
    endpoint: str | None = None  # default: the backend's (/v1/completions for openai)
    backend: str | None = None  # "openai" (completions) or "openai-chat"; default: from the endpoint
    model: str | None = None  # default: the first id of GET /v1/models
    tokenizer_id: str | None = None  # recorded in the result
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    seed: int = 0
    ignore_eos: bool = False
    percentile_metrics: tuple[str, ...] = ("ttft", "tpot", "itl")
    metric_percentiles: tuple[float, ...] = (99.0,)
    goodput: dict[str, float] = field(default_factory=dict)  # {"ttft": ms, "tpot": ms, "e2el": ms}
    num_warmups: int = 0
    ready_check_timeout_s: float = 0.0
    request_timeout_s: float = 1800.0
    extra_body: dict[str, Any] | None = None
    label: str | None = None
    request_id_prefix: str = ""
    show_progress: bool = True

    def __post_init__(self) -> None:
        if self.backend is not None and self.backend not in BACKENDS:
            raise UsageError(f"--backend {self.backend!r}: choose from {sorted(BACKENDS)}")
        if (
            self.backend
            and self.endpoint
            and self.backend == "openai-chat"
            and not self.endpoint.rstrip("/").endswith("chat/completions")
        ):
            raise UsageError(f"--backend openai-chat needs a chat endpoint, got --endpoint {self.endpoint}")
        if not self.request_rate > 0:
            raise UsageError(f"--request-rate must be > 0 or inf, got {self.request_rate}")
        if not self.burstiness > 0:
            raise UsageError(f"--burstiness must be > 0, got {self.burstiness}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise UsageError(f"--max-concurrency must be >= 1, got {self.max_concurrency}")
        if not self.request_timeout_s > 0:
            raise UsageError(f"--request-timeout must be > 0 s, got {self.request_timeout_s}")
        if self.num_warmups < 0:
            raise UsageError(f"--num-warmups must be >= 0, got {self.num_warmups}")
        bad = [m for m in self.percentile_metrics if m not in METRICS]
        if bad:
            raise UsageError(f"--percentile-metrics: unknown {bad}; choose from {METRICS}")
        bad_p = [p for p in self.metric_percentiles if not 0 < p <= 100]
        if bad_p:
            raise UsageError(f"--metric-percentiles must be in (0, 100], got {bad_p}")
        parse_goodput([f"{k}:{v}" for k, v in self.goodput.items()])  # validates names and values

    @property
    def resolved_backend(self) -> str:
        if self.backend:
            return self.backend
        return "openai-chat" if (self.endpoint or "").rstrip("/").endswith("chat/completions") else "openai"

    @property
    def api_url(self) -> str:
        return self.base_url.rstrip("/") + (self.endpoint or BACKENDS[self.resolved_backend])


def _inputs(samples: Sequence, cfg: ServeBenchConfig, model: str) -> list[RequestInput]:
    chat = cfg.resolved_backend == "openai-chat"
    return [
        RequestInput(
            prompt=s.prompt,
            prompt_len=s.prompt_len,
            output_len=s.output_len,
            model=model,
            api_url=cfg.api_url,
            chat=chat,
            ignore_eos=cfg.ignore_eos,
            extra_body=cfg.extra_body,
            request_id=f"{cfg.request_id_prefix}{i}" if cfg.request_id_prefix else None,
        )
        for i, s in enumerate(samples)
    ]


async def _ready_check(session, inp: RequestInput, cfg: ServeBenchConfig) -> None:
    """vLLM's --ready-check-timeout-sec: send the first request until it succeeds or the time is up."""
    deadline = time.monotonic() + cfg.ready_check_timeout_s
    while True:
        out = await send_request(session, inp, min(cfg.request_timeout_s, max(cfg.ready_check_timeout_s, 1.0)))
        if out.success:
            return
        if time.monotonic() > deadline:
            raise SpanllmError(
                f"{cfg.api_url} not ready after {cfg.ready_check_timeout_s:g} s "
                f"(--ready-check-timeout-sec); last error: {out.error}"
            )
        await asyncio.sleep(1.0)


async def benchmark_async(
    samples: Sequence,
    cfg: ServeBenchConfig,
    count_output_tokens: Callable[[str], int] | None = None,
    on_request_done: Callable[[], None] | None = None,
    status_lines: bool = False,
) -> dict[str, Any]:
    """Send every sample at its arrival time, wait for all, and return vLLM's result fields plus the per-request
    arrays (DETAILED_FIELDS) and error_counts. status_lines: where no live progress bar shows (a log file, a pipe,
    --disable-tqdm), a line on stderr every STATUS_LINE_S says how many requests have answered, so that a server
    that accepts connections and never answers is seen long before --request-timeout."""
    import aiohttp

    if not len(samples):
        raise UsageError("no requests to send")
    connector = aiohttp.TCPConnector(
        limit=cfg.max_concurrency or 0, limit_per_host=cfg.max_concurrency or 0, keepalive_timeout=60
    )
    async with aiohttp.ClientSession(connector=connector, trust_env=True) as session:
        # What the run waits for, told every STATUS_LINE_S where no bar shows: a step before the requests (the
        # model list, the ready check, warm-ups, the /metrics counters) can wait on a silent server too.
        phase = ["listing the server's models (/v1/models)"]
        answered, tasks, t0 = 0, [], time.perf_counter()

        async def report_status() -> None:
            while True:
                await asyncio.sleep(STATUS_LINE_S)
                what = phase[0] or f"{answered} of {len(samples)} requests answered, {len(tasks) - answered} in flight"
                print(
                    f"bench serve: {what}, {time.perf_counter() - t0:.0f} s (--request-timeout "
                    f"{cfg.request_timeout_s:g} s)",
                    file=sys.stderr,
                    flush=True,
                )

        status = asyncio.create_task(report_status()) if status_lines else None
        try:
            model = cfg.model or await first_model(session, cfg.base_url.rstrip("/"))
            inputs = _inputs(samples, cfg, model)
            probe = replace(inputs[0], request_id=None)  # ready check and warm-ups: copies of the first request
            if cfg.ready_check_timeout_s > 0:
                phase[0] = "waiting for the first answer (--ready-check-timeout-sec)"
                await _ready_check(session, probe, cfg)
            sem = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
            if cfg.num_warmups > 0:  # vLLM: num_warmups copies of the first request, under the same concurrency cap
                phase[0] = f"waiting for the {cfg.num_warmups} warm-up requests"

                async def warm() -> RequestOutput:
                    if sem is None:
                        return await send_request(session, probe, cfg.request_timeout_s)
                    async with sem:
                        return await send_request(session, probe, cfg.request_timeout_s)

                warm_outs = await asyncio.gather(*(warm() for _ in range(cfg.num_warmups)))
                failed = [o.error for o in warm_outs if not o.success]
                if failed:
                    print(
                        f"warning: {len(failed)} of {cfg.num_warmups} warm-up requests failed: {failed[0]}",
                        file=sys.stderr,
                    )

            async def one(inp: RequestInput) -> RequestOutput:
                nonlocal answered
                arrived = time.perf_counter()
                if sem is None:
                    out = await send_request(session, inp, cfg.request_timeout_s)
                else:
                    async with sem:
                        out = await send_request(session, inp, cfg.request_timeout_s)
                out.client_queue_time = out.start_time - arrived
                answered += 1
                if on_request_done:
                    on_request_done()
                return out

            phase[0] = "reading the server's prefix-cache counters (/metrics)"
            metrics_timeout_s = min(30.0, cfg.request_timeout_s)  # a shorter --request-timeout bounds /metrics too
            cache0 = await prefix_cache_counters(session, cfg.base_url, metrics_timeout_s)
            offsets = arrival_offsets_s(len(inputs), cfg.request_rate, cfg.burstiness, cfg.seed)
            phase[0] = ""  # the requests: their count
            start = time.perf_counter()
            for inp, offset in zip(inputs, offsets):
                delay = start + offset - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(one(inp)))
            outputs: list[RequestOutput] = await asyncio.gather(*tasks)
            duration = time.perf_counter() - start
            phase[0] = "reading the server's prefix-cache counters (/metrics)"
            cache1 = await prefix_cache_counters(session, cfg.base_url, metrics_timeout_s)
        finally:
            if status is not None:
                status.cancel()

    metrics = calculate_metrics(
        outputs, duration, cfg.metric_percentiles, cfg.percentile_metrics, cfg.goodput, count_output_tokens
    )
    backend = cfg.resolved_backend
    result: dict[str, Any] = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "endpoint_type": backend,
        "backend": backend,
        "label": cfg.label,
        "model_id": model,
        "tokenizer_id": cfg.tokenizer_id,
        "num_prompts": len(inputs),
        "request_rate": "inf" if math.isinf(cfg.request_rate) else cfg.request_rate,
        "burstiness": cfg.burstiness,
        "max_concurrency": cfg.max_concurrency,
        "base_url": cfg.base_url,
        "endpoint": cfg.endpoint or BACKENDS[backend],
        "ignore_eos": cfg.ignore_eos,
        "goodput_slos_ms": dict(cfg.goodput) or None,
        **metrics,
        **prefix_cache_result(cache0, cache1),
        "error_counts": dict(
            Counter((o.error or "unknown error").splitlines()[0][:200] for o in outputs if not o.success)
        ),
        "input_lens": [o.prompt_len for o in outputs],
        "ttfts": [o.ttft for o in outputs],
        "itls": [o.itl for o in outputs],
        "latencies": [o.latency for o in outputs],
        "start_times": [o.start_time - start for o in outputs],
        "queue_times": [o.client_queue_time for o in outputs],
        "generated_texts": [o.generated_text for o in outputs],
        "errors": [o.error for o in outputs],
    }
    return result


def output_token_counter(tokenizer) -> Callable[[str], int] | None:
    """Counts generated text in tokens without the special tokens encode adds (vLLM: add_special_tokens=False);
    used only for servers that send no usage chunk."""
    if tokenizer is None:
        return None
    n_special = len(tokenizer.encode(""))
    return lambda text: max(len(tokenizer.encode(text)) - n_special, 0)


def _progress():
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=Console(stderr=True),
    )


def run_benchmark(samples: Sequence, config: ServeBenchConfig, tokenizer=None, progress=None) -> dict[str, Any]:
    """One run (one request rate): vLLM's result dict (with the per-request arrays). `samples`: a SampleSet or any
    sequence of objects with prompt, prompt_len, output_len. A SampleSet's info goes in as result['dataset'].
    `progress`: a rich Progress to add this run's bar to (one is made when config.show_progress)."""
    own = progress is None and config.show_progress
    if own:
        progress = _progress()
        progress.start()
    try:
        on_done = None
        if progress is not None:
            task = progress.add_task(f"rate {rate_label(config.request_rate)} req/s", total=len(samples))
            on_done = lambda: progress.advance(task)  # noqa: E731
        bar_shown = progress is not None and progress.console.is_terminal
        result = asyncio.run(
            benchmark_async(samples, config, output_token_counter(tokenizer), on_done, status_lines=not bar_shown)
        )
    finally:
        if own:
            progress.stop()
    if isinstance(samples, SampleSet):
        result["dataset"] = samples.info
        if "dataset_note" in samples.info:
            result["dataset_note"] = samples.info["dataset_note"]
    return result


# A sweep's later rate whose prompt tokens hit the prefix cache at least this often is flagged (run_sweep)
WARM_CACHE_HIT_RATE = 0.5


def run_sweep(
    samples: Sequence,
    config: ServeBenchConfig,
    rates: Sequence[float],
    tokenizer=None,
    on_result: Callable[[dict[str, Any]], None] | None = None,
) -> list[dict[str, Any]]:
    """One run per rate against the same server with the same requests (the arrival times re-drawn from the same
    seed at each rate, as separate vLLM invocations would). A later rate served mostly from the prefix cache the
    earlier rates filled carries `prefix_cache_warning`."""
    runs = []
    progress = _progress() if config.show_progress else None
    if progress is not None:
        progress.start()
    try:
        for k, rate in enumerate(rates):
            prefix = (
                f"{config.request_id_prefix}{k}-"
                if config.request_id_prefix and len(rates) > 1
                else config.request_id_prefix
            )  # request ids stay unique across the runs of a sweep
            r = run_benchmark(
                samples, replace(config, request_rate=rate, request_id_prefix=prefix), tokenizer, progress
            )
            hit = r.get("prefix_cache_hit_rate")
            if k > 0 and hit is not None and hit >= WARM_CACHE_HIT_RATE:
                # the same prompts again: the server answers them from the cache the earlier rates filled
                r["prefix_cache_warning"] = (
                    f"{100 * hit:.0f}% of this rate's prompt tokens hit the server's prefix cache, which the "
                    f"sweep's earlier rates filled with the same {len(samples)} prompts: its TTFT and throughput are "
                    "a warm cache's. For cold rates, run each against a fresh server or one started with "
                    "--no-enable-prefix-caching"
                )
            runs.append(r)
            if on_result:
                on_result(r)
    finally:
        if progress is not None:
            progress.stop()
    return runs


# --------------------------------------------------------------------------------------------- CLI


DEFAULT_HOST, DEFAULT_PORT = "127.0.0.1", 8000


def check_server_address(base_url: str | None, host: str | None, port: int | None, given: Sequence[str]) -> None:
    """--base-url, or --host and --port (`given`: those of them given): each well formed, and never both, so that no
    flag is dropped and a typo in the URL is one line before any request."""
    checks.not_empty("--host", host, f"give the server's host, e.g. --host {DEFAULT_HOST}")
    if port is not None and not 1 <= port <= 65535:
        raise UsageError(f"--port {port}: must be in [1, 65535], e.g. --port {DEFAULT_PORT}")
    if base_url is None:
        return
    if given:
        flag = "--" + given[0]
        raise UsageError(
            f"{flag} {host if given[0] == 'host' else port}: the server is --base-url {base_url}, which names its "
            f"host and port; drop {flag}, or drop --base-url"
        )
    if not base_url.startswith(("http://", "https://")) or not base_url.split("://", 1)[1].strip("/"):
        raise UsageError(
            f"--base-url {base_url!r}: give the server's URL with its scheme and host, e.g. "
            f"--base-url http://{DEFAULT_HOST}:{DEFAULT_PORT}"
        )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_dataset_arguments(parser, default_dataset="sharegpt")
    g = parser.add_argument_group("server and traffic (vLLM's bench serve flags)")
    g.add_argument("--base-url", default=None, help="server URL; default http://HOST:PORT")
    g.add_argument("--host", default=None, help=f"server host, without --base-url (default {DEFAULT_HOST})")
    g.add_argument("--port", type=int, default=None, help=f"server port, without --base-url (default {DEFAULT_PORT})")
    g.add_argument(
        "--endpoint",
        default=None,
        help="API path; default /v1/completions (/v1/chat/completions with --backend openai-chat)",
    )
    g.add_argument(
        "--backend",
        choices=sorted(BACKENDS),
        default=None,
        help="openai = completions, openai-chat = chat completions; default: from --endpoint",
    )
    g.add_argument("--model", default=None, help="model name sent; default: first id of GET /v1/models")
    g.add_argument(
        "--tokenizer",
        default=None,
        help="tokenizer (spanllm preset, checkpoint folder or HF id) that "
        "counts prompt tokens for sampling; default: --model",
    )
    g.add_argument(
        "--request-rate",
        default="inf",
        help="requests/s, Poisson (gamma with --burstiness); inf sends all at t=0; a comma-separated list runs a sweep",
    )
    g.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps; 1 = Poisson, <1 burstier")
    g.add_argument("--max-concurrency", type=int, default=None, help="client-side cap on requests in flight")
    g.add_argument(
        "--ignore-eos",
        action="store_true",
        help="send ignore_eos: true (forced on for random and generated-shared-prefix, as the peers do)",
    )
    g.add_argument(
        "--temperature", type=float, default=None, help="sent in every request (default: 0, greedy, as vLLM's client)"
    )
    g.add_argument("--top-p", type=float, default=None, help="sent in every request (default: not sent)")
    g.add_argument("--top-k", type=int, default=None, help="sent in every request (default: not sent)")
    g.add_argument("--extra-body", default=None, help="a JSON object merged into every request body")
    g.add_argument("--num-warmups", type=int, default=0, help="copies of the first request sent before timing")
    g.add_argument(
        "--ready-check-timeout-sec",
        type=float,
        default=0.0,
        help="retry the first request until the server answers, up to this long (0: no check)",
    )
    g.add_argument("--request-timeout", type=float, default=1800.0, help="seconds before a request counts as failed")
    g.add_argument("--request-id-prefix", default=f"bench-{uuid.uuid4().hex[:8]}-", help="request ids: PREFIX + index")
    g.add_argument(
        "--samples-file",
        default=None,
        help="requests saved by `bench throughput --save-samples` instead of sampling (the first "
        "--num-prompts of them, at most the file's count; all without it); no dataset needed",
    )
    r = parser.add_argument_group("results")
    r.add_argument("--percentile-metrics", default="ttft,tpot,itl", help=f"comma-separated, from {','.join(METRICS)}")
    r.add_argument("--metric-percentiles", default="99", help="comma-separated percentiles, e.g. 50,90,99")
    r.add_argument(
        "--goodput",
        nargs="+",
        default=None,
        metavar="NAME:MS",
        help="SLOs for goodput, e.g. ttft:500 tpot:50 (DistServe's definition)",
    )
    r.add_argument("--label", default=None, help="result file prefix; default: the backend")
    r.add_argument("--metadata", nargs="*", default=None, metavar="KEY=VALUE", help="recorded in the JSON")
    r.add_argument("--save-result", action="store_true", help="write the JSON of a single-rate run")
    r.add_argument("--save-detailed", action="store_true", help="keep per-request arrays in the JSON")
    r.add_argument(
        "--result-dir", default=None, help="where JSON (and a sweep's PNG) go; without it nothing is written"
    )
    r.add_argument("--result-filename", default=None, help="JSON file name; a sweep's PNG takes its stem")
    r.add_argument("--disable-tqdm", action="store_true", help="no progress bar")


def load_tokenizer(name: str):
    """spanllm's tokenizer for a preset, checkpoint folder or HF id (spanllm.engine.tokenizer.get_tokenizer)."""
    from spanllm.engine.tokenizer import get_tokenizer

    return get_tokenizer(name)


def samples_from_args(args: argparse.Namespace, tokenizer) -> SampleSet:
    """--samples-file (its first --num-prompts requests) or the dataset flags."""
    if not getattr(args, "samples_file", None):
        return get_samples(args, tokenizer)
    from spanllm.bench.sample_file import load_first_samples

    return load_first_samples(args.samples_file, args.num_prompts)


def _parse_metadata(items: Sequence[str] | None) -> dict[str, str]:
    out = {}
    for item in items or []:
        k, sep, v = item.partition("=")
        if not sep:
            raise UsageError(f"--metadata {item!r}: expected KEY=VALUE")
        out[k.strip()] = v.strip()
    return out


def parse_extra_body(text: str | None) -> dict[str, Any] | None:
    if text is None:
        return None
    try:
        body = json.loads(text)
    except json.JSONDecodeError as e:
        raise UsageError(
            f"--extra-body {text!r}: not JSON ({e.msg}); give an object, e.g. '{{\"min_p\": 0.1}}'"
        ) from None
    if not isinstance(body, dict):
        raise UsageError(
            f"--extra-body {text!r}: a JSON {type(body).__name__}, merged into a request body it must be an "
            "object, e.g. '{\"min_p\": 0.1}'"
        )
    return body


def parse_percentiles(text: str) -> tuple[float, ...]:
    """'50,90,99' -> (50.0, 90.0, 99.0), each in (0, 100]."""
    out = []
    for part in text.split(","):
        try:
            p = float(part)
        except ValueError:
            p = math.nan
        if not 0 < p <= 100:
            raise UsageError(
                f"--metric-percentiles {text!r}: {part.strip()!r} is not a percentile in (0, 100]; give "
                "comma-separated numbers, e.g. 50,90,99"
            )
        out.append(p)
    return tuple(out)


def check_result_file(args: argparse.Namespace, rates: Sequence[float]) -> None:
    """Where the result goes (--result-dir + --result-filename, the folder made as the run makes it), checked
    before any request is sent; the options that shape the file are refused when no file is written."""
    single = len(rates) == 1
    writes = bool(args.result_dir) and (args.save_result or not single)
    if args.result_dir and not writes:
        raise UsageError(
            f"--result-dir {args.result_dir}: a single-rate run writes its JSON only with --save-result; "
            "add --save-result, or drop --result-dir"
        )
    for flag, given in (
        ("--result-filename", args.result_filename is not None),
        ("--save-detailed", args.save_detailed),
        ("--metadata", args.metadata is not None),
    ):
        if given and not writes:
            raise UsageError(
                f"{flag} shapes the result file, and this run writes none; add --result-dir DIR"
                + (" --save-result" if single else "")
            )
    if not writes:
        return
    if args.result_filename is not None and not args.result_filename.strip():
        raise UsageError(
            f"--result-filename {args.result_filename!r}: empty; give a file name, e.g. --result-filename "
            "result.json, or leave it out for vLLM's name"
        )
    try:  # the folder, as checks.output_file makes any output file's folder (the run used to make it at the end)
        os.makedirs(args.result_dir, exist_ok=True)
    except OSError as e:
        raise UsageError(
            f"--result-dir {args.result_dir}: cannot create it ({e.strerror}); choose another folder"
        ) from None
    path = os.path.join(args.result_dir, args.result_filename or "result.json")
    checks.output_file("--result-filename" if args.result_filename else "--result-dir", path)


def check_numbers(args: argparse.Namespace) -> None:
    """The numeric flags ServeBenchConfig does not check itself, each against its range."""

    def within(flag: str, v, lo, hi, closed_lo: bool = True) -> None:
        if v is None:
            return
        if not ((lo <= v) if closed_lo else (lo < v)) or not v <= hi:
            raise UsageError(f"{flag} {v}: must be in {'[' if closed_lo else '('}{lo}, {hi}]")

    check_server_address(
        args.base_url, args.host, args.port, [k for k in ("host", "port") if getattr(args, k) is not None]
    )
    for flag, v in (("--tokenizer", args.tokenizer), ("--model", args.model), ("--label", args.label)):
        checks.not_empty(flag, v, f"give a value, or leave {flag} out for its default")
    if not [m for m in args.percentile_metrics.split(",") if m.strip()]:
        raise UsageError(
            f"--percentile-metrics {args.percentile_metrics!r}: no metric; give comma-separated names from "
            f"{', '.join(METRICS)}, e.g. ttft,tpot,itl"
        )
    if args.endpoint is not None and not args.endpoint.startswith("/"):
        raise UsageError(
            f"--endpoint {args.endpoint!r}: an API path, starting with '/', e.g. --endpoint /v1/completions"
        )
    within("--temperature", args.temperature, 0.0, 2.0)
    within("--top-p", args.top_p, 0.0, 1.0, closed_lo=False)
    within("--top-k", args.top_k, -1, 2**31 - 1)
    within("--seed", getattr(args, "seed", None), 0, 2**63 - 1)
    within("--num-prompts", getattr(args, "num_prompts", None), 1, 10**9)
    for flag in ("random_input_len", "random_output_len", "input_len", "output_len", "sharegpt_output_len"):
        within("--" + flag.replace("_", "-"), getattr(args, flag, None), 1, 2**31 - 1)
    within("--random-prefix-len", getattr(args, "random_prefix_len", None), 0, 2**31 - 1)
    rr = getattr(args, "random_range_ratio", None)
    if rr is not None and not 0.0 <= rr < 1.0:
        raise UsageError(f"--random-range-ratio {rr}: must be in [0, 1)")
    within("--ready-check-timeout-sec", args.ready_check_timeout_sec, 0.0, 86400.0)
    if args.save_result and not args.result_dir:
        raise UsageError("--save-result writes into --result-dir: give one (nothing is written to the cwd)")


def config_from_args(args: argparse.Namespace) -> tuple[ServeBenchConfig, list[float]]:
    check_numbers(args)
    rates = parse_rates(args.request_rate)
    sampling = {
        k: v
        for k, v in (("temperature", args.temperature), ("top_p", args.top_p), ("top_k", args.top_k))
        if v is not None
    }
    cuts = [f for f, v in (("--top-p", args.top_p), ("--top-k", args.top_k)) if v is not None]
    if cuts and not (args.temperature or 0.0) > 0.0:
        raise UsageError(
            f"{' and '.join(cuts)}: the requests decode greedily (--temperature {args.temperature or 0:g}, the default "
            f"0 as vLLM's client), which a server refuses or ignores with a cut; give --temperature > 0 to sample"
        )
    body = parse_extra_body(args.extra_body) or {}
    both = [k for k in sampling if k in body]
    if both:
        raise UsageError(
            f"--{both[0].replace('_', '-')} {sampling[both[0]]} and --extra-body {args.extra_body!r} both set "
            f"{both[0]!r} (the body would win); give it once"
        )
    extra = {**sampling, **body} or None
    cfg = ServeBenchConfig(
        base_url=args.base_url or f"http://{args.host or DEFAULT_HOST}:{args.port or DEFAULT_PORT}",
        endpoint=args.endpoint,
        backend=args.backend,
        model=args.model,
        request_rate=rates[0],
        burstiness=args.burstiness,
        max_concurrency=args.max_concurrency,
        seed=args.seed,
        ignore_eos=args.ignore_eos or args.dataset_name in ("random", "generated-shared-prefix"),
        percentile_metrics=tuple(m.strip() for m in args.percentile_metrics.split(",") if m.strip()),
        metric_percentiles=parse_percentiles(args.metric_percentiles),
        goodput=parse_goodput(args.goodput),
        num_warmups=args.num_warmups,
        ready_check_timeout_s=args.ready_check_timeout_sec,
        request_timeout_s=args.request_timeout,
        extra_body=extra,
        label=args.label,
        request_id_prefix=args.request_id_prefix,
        show_progress=not args.disable_tqdm,
    )
    return cfg, rates


def _strip_detailed(result: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in result.items() if k not in DETAILED_FIELDS}


def result_path(args: argparse.Namespace, label: str, model_id: str, rates: Sequence[float], dt: str) -> str:
    """vLLM's file name for one rate ({label}-{rate}qps[-concurrency{c}]-{model}-{date}.json); for a sweep,
    {label}-sweep-{first}-{last}qps[...]...json."""
    conc = f"-concurrency{args.max_concurrency}" if args.max_concurrency is not None else ""
    rate = f"{rates[0]}qps" if len(rates) == 1 else f"sweep-{rate_label(rates[0])}-{rate_label(rates[-1])}qps"
    name = args.result_filename or f"{label}-{rate}{conc}-{model_id.split('/')[-1]}-{dt}.json"
    return os.path.join(args.result_dir, name)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from spanllm.bench.serve_report import plot_sweep, summary_lines, sweep_table
    from spanllm.measure.report import machine_info, versions
    from spanllm.output_files import write_json, write_result

    resolve_dataset_source(args)
    cfg, rates = config_from_args(args)
    check_result_file(args, rates)
    if not args.samples_file:
        check_dataset_arguments(args)
    metadata = _parse_metadata(args.metadata)
    model = cfg.model
    if model is None:

        async def _first() -> str:
            import aiohttp

            async with aiohttp.ClientSession(trust_env=True) as s:
                return await first_model(s, cfg.base_url.rstrip("/"))

        model = asyncio.run(_first())
        print(f"model (first of {cfg.base_url}/v1/models): {model}")
    tokenizer_id = args.tokenizer or model
    tokenizer = load_tokenizer(tokenizer_id)
    samples = samples_from_args(args, tokenizer)
    cfg = replace(cfg, model=model, tokenizer_id=tokenizer_id, label=cfg.label or cfg.resolved_backend)
    print(
        f"{len(samples)} requests ({samples.info.get('dataset_name')}), mean output {samples.mean_output_len:.1f} "
        f"tokens; {cfg.api_url}, model {model}; "
        f"burstiness {cfg.burstiness} ({'Poisson' if cfg.burstiness == 1 else 'gamma'}), "
        f"max concurrency {cfg.max_concurrency}" + (", ignore_eos" if cfg.ignore_eos else "")
    )

    def report_run(r: dict[str, Any]) -> None:
        print("\n".join(summary_lines(r, cfg.metric_percentiles, cfg.percentile_metrics)))
        if r.get("prefix_cache_hit_rate") is not None:
            print(
                f"Prefix cache hit rate: {100 * r['prefix_cache_hit_rate']:.1f}% ({r['prefix_cache_hits']} of "
                f"{r['prefix_cache_queries']} prompt tokens, from the server's /metrics)"
            )
        else:
            print(f"Prefix cache hit rate: unknown ({r.get('prefix_cache_note', 'no prompt tokens counted')})")
        if r.get("prefix_cache_warning"):
            print(f"warning: rate {rate_label(r['request_rate'])}: {r['prefix_cache_warning']}", file=sys.stderr)
        if r["failed"]:
            errs = "; ".join(f"{n} x {e}" for e, n in list(r["error_counts"].items())[:10])
            print(f"warning: {r['failed']} of {r['num_prompts']} requests failed: {errs}", file=sys.stderr)

    dt = datetime.now().strftime("%Y%m%d-%H%M%S")
    done: list[dict[str, Any]] = []

    def on_result(r: dict[str, Any]) -> None:
        report_run(r)
        done.append(r if args.save_detailed else _strip_detailed(r))
        if args.result_dir and len(rates) > 1 and len(done) < len(rates):  # a sweep cut short keeps what it did
            settings = {
                **{k: v for k, v in asdict(cfg).items() if k != "request_rate"},
                "request_rates": [rate_label(x) for x in rates],
                **metadata,
                "partial": True,
            }
            write_result(
                result_path(args, cfg.label, model, rates, dt),
                "bench_serve_sweep",
                settings,
                done,
                flag="--result-dir",
                dataset=samples.info,
            )

    runs = run_sweep(samples, cfg, rates, tokenizer, on_result=on_result)
    extra = {
        "dataset": samples.info,
        **({"dataset_note": samples.info["dataset_note"]} if "dataset_note" in samples.info else {}),
    }
    saved = [r if args.save_detailed else _strip_detailed(r) for r in runs]
    if len(rates) == 1:
        if args.save_result:
            path = result_path(args, cfg.label, model, rates, dt)
            doc = {**saved[0], **metadata, **extra, "machine": machine_info(), "versions": versions()}
            write_json("--result-dir", path, doc, indent=1, default=str)
            print(f"wrote {path}")
    else:
        title = (
            f"bench serve {cfg.api_url} model {model}, {len(samples)} {samples.info.get('dataset_name')} "
            f"requests, burstiness {cfg.burstiness}, max concurrency {cfg.max_concurrency}"
        )
        Console(width=max(Console().width, 160)).print(sweep_table(saved, title))
        if not args.result_dir:
            print("no files written (give --result-dir for the sweep's JSON and PNG)")
            return 0 if all(r["completed"] > 0 for r in runs) else 1
        path = result_path(args, cfg.label, model, rates, dt)
        settings = {
            **{k: v for k, v in asdict(cfg).items() if k != "request_rate"},
            "request_rates": [rate_label(r) for r in rates],
            **metadata,
        }
        write_result(path, "bench_serve_sweep", settings, saved, flag="--result-dir", **extra)
        png = os.path.splitext(path)[0] + ".png"
        plot_sweep(saved, png, title)
        print(f"wrote {path}\nwrote {png}")
    if "dataset_note" in samples.info:
        print(f"note: {samples.info['dataset_note']}", file=sys.stderr)
    return 0 if all(r["completed"] > 0 for r in runs) else 1
