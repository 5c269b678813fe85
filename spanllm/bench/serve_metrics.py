"""Arrival process and metrics of `bench serve`, as vLLM's `vllm/benchmarks/serve.py` defines them.

Arrivals: gaps ~ gamma(shape=burstiness, scale=1/(rate*burstiness)) (burstiness 1 = Poisson), drawn from
numpy's legacy RNG seeded with --seed (vLLM: `np.random.seed(seed)` then one `np.random.gamma` per request),
cumulated, then rescaled so the last request leaves at exactly num_prompts / rate. Rate inf: all at t=0.

Per completed request: TTFT, E2EL (send -> last token), TPOT = (E2EL - TTFT) / (output_tokens - 1) for
requests with more than one output token, ITL = every gap between token chunks (pooled over requests).
Statistics in ms: mean, median, std (population), and numpy's linear-interpolation percentiles. Goodput counts
completed requests that meet every SLO given (TPOT of a one-token request counts as 0), per second.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from spanllm.bench.serve_client import RequestOutput
from spanllm.errors import UsageError

METRICS = ("ttft", "tpot", "itl", "e2el", "client_queue_time", "e2el_including_client_queue")
GOODPUT_METRICS = ("ttft", "tpot", "e2el")


def arrival_offsets_s(num_requests: int, request_rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Send time of each request in seconds after the start (vLLM's get_request, without ramp-up)."""
    if num_requests < 1:
        raise UsageError(f"num_requests must be >= 1, got {num_requests}")
    if not request_rate > 0:
        raise UsageError(f"--request-rate must be > 0 (or inf), got {request_rate}")
    if not burstiness > 0:
        raise UsageError(f"--burstiness must be > 0, got {burstiness}")
    if math.isinf(request_rate):
        return [0.0] * num_requests
    if math.isinf(burstiness):
        gaps = np.full(num_requests, 1.0 / request_rate)
    else:
        # RandomState(seed).gamma(size=n) draws the same values as n scalar np.random.gamma calls after seed().
        gaps = np.random.RandomState(seed).gamma(
            shape=burstiness, scale=1.0 / (request_rate * burstiness), size=num_requests
        )
    t = np.cumsum(gaps)
    # vLLM: "the sum of gamma gaps is 1-2% off N/rate; rescale so runs with different seeds send equally fast".
    t *= (num_requests / request_rate) / t[-1]
    return t.tolist()


def parse_goodput(pairs: Sequence[str] | None) -> dict[str, float]:
    """["ttft:500", "tpot:50"] -> {"ttft": 500.0, "tpot": 50.0} (milliseconds)."""
    slos: dict[str, float] = {}
    for pair in pairs or []:
        name, sep, value = pair.partition(":")
        try:
            ms = float(value)
        except ValueError:
            ms = float("nan")
        if not sep or name not in GOODPUT_METRICS or not ms >= 0:
            raise UsageError(
                f"--goodput {pair!r}: expected NAME:MS with NAME in {GOODPUT_METRICS} and MS >= 0, "
                f"e.g. --goodput ttft:500 tpot:50"
            )
        slos[name] = ms
    return slos


def parse_rates(text: str | float) -> list[float]:
    """'1,2,4,inf' -> [1.0, 2.0, 4.0, inf]."""
    if isinstance(text, (int, float)):
        return [float(text)]
    rates = []
    for part in str(text).split(","):
        part = part.strip()
        try:
            r = float(part)
        except ValueError:
            raise UsageError(f"--request-rate: {part!r} is not a number or inf (e.g. 1,2,4,inf)") from None
        if not r > 0:
            raise UsageError(f"--request-rate: {part!r} must be > 0 (or inf)")
        rates.append(r)
    return rates


def percentile_word(p: float) -> str:
    """99 -> '99', 99.9 -> '99.9' (vLLM's key spelling: p99_ttft_ms, p99.9_ttft_ms)."""
    return str(int(p)) if int(p) == p else str(p)


def _stats(values: list[float], name: str, percentiles: Sequence[float], with_percentiles: bool) -> dict[str, float]:
    v = values or [0.0]  # vLLM: np.mean(x or 0): 0 when nothing was measured
    out = {
        f"mean_{name}_ms": float(np.mean(v)) * 1000,
        f"median_{name}_ms": float(np.median(v)) * 1000,
        f"std_{name}_ms": float(np.std(v)) * 1000,
    }
    if with_percentiles:
        for p in percentiles:
            out[f"p{percentile_word(p)}_{name}_ms"] = float(np.percentile(v, p)) * 1000
    return out


def peak_output_rate(outputs: Sequence[RequestOutput]) -> tuple[float, int]:
    """(the most output tokens per second in one window, most requests in flight at once), vLLM's
    max_output_tokens_per_s and max_concurrent_requests (one token per chunk). The windows tile the span from
    the first request's start to the last token exactly (ceil(span) windows of span / ceil(span) <= 1 s), so
    the busiest holds at least its share: the peak is never below the average over the span, which is itself
    >= the reported output throughput (tokens / the benchmark's whole duration)."""
    ok = [o for o in outputs if o.success]
    if not ok:
        return 0.0, 0
    t0 = min(o.start_time for o in ok)
    times = [o.start_time + o.ttft + np.concatenate([[0.0], np.cumsum(o.itl)]) - t0 for o in ok]
    span = max(float(t.max()) for t in times)
    n = max(1, int(np.ceil(span)))
    width = span / n if span > 0 else 1.0
    tokens = np.zeros(n)
    for t in times:
        np.add.at(tokens, np.clip((t / width).astype(int), 0, n - 1), 1)
    events = sorted([(o.start_time, 1) for o in ok] + [(o.start_time + o.latency, -1) for o in ok])
    level = peak = 0
    for _, d in events:
        level += d
        peak = max(peak, level)
    return float(tokens.max()) / width, peak


def calculate_metrics(
    outputs: Sequence[RequestOutput],
    duration_s: float,
    percentiles: Sequence[float] = (99,),
    percentile_metrics: Sequence[str] = ("ttft", "tpot", "itl"),
    goodput: dict[str, float] | None = None,
    count_output_tokens: Callable[[str], int] | None = None,
) -> dict[str, Any]:
    """vLLM's result fields from the per-request outputs. Output tokens per request: the usage chunk's count;
    without one, `count_output_tokens(generated_text)` when given, else the number of token chunks.
    mean / median / std of ttft, tpot, itl, e2el are always there; percentiles for `percentile_metrics`."""
    for m in percentile_metrics:
        if m not in METRICS:
            raise UsageError(f"--percentile-metrics: unknown metric {m!r}; choose from {METRICS}")
    output_lens: list[int] = []
    ttfts, tpots, all_tpots, itls, e2els, queue, e2el_q = [], [], [], [], [], [], []
    total_input = completed = 0
    for o in outputs:
        if not o.success:
            output_lens.append(0)
            continue
        n = o.output_tokens or (count_output_tokens(o.generated_text) if count_output_tokens else o.chunks)
        output_lens.append(n)
        total_input += o.prompt_len
        tpot = 0.0
        if n > 1:
            tpot = (o.latency - o.ttft) / (n - 1)
            tpots.append(tpot)
        all_tpots.append(tpot)
        itls += o.itl
        ttfts.append(o.ttft)
        e2els.append(o.latency)
        queue.append(o.client_queue_time)
        e2el_q.append(o.latency + o.client_queue_time)
        completed += 1
    good = 0
    if goodput:
        per_request = {"ttft": ttfts, "tpot": all_tpots, "e2el": e2els}
        names = list(goodput)
        for values in zip(*(per_request[n] for n in names)):
            good += all(v <= goodput[n] / 1000 for n, v in zip(names, values))
    total_output = sum(output_lens)
    peak_tokens, peak_requests = peak_output_rate(outputs)
    result: dict[str, Any] = {
        "duration": duration_s,
        "completed": completed,
        "failed": len(outputs) - completed,
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": completed / duration_s,
        "request_goodput": good / duration_s if goodput else None,
        "output_throughput": total_output / duration_s,
        "total_token_throughput": (total_input + total_output) / duration_s,
        "max_output_tokens_per_s": peak_tokens,
        "max_concurrent_requests": peak_requests,
    }
    values = {
        "ttft": ttfts,
        "tpot": tpots,
        "itl": itls,
        "e2el": e2els,
        "client_queue_time": queue,
        "e2el_including_client_queue": e2el_q,
    }
    for name in METRICS:
        if name in ("ttft", "tpot", "itl", "e2el") or name in percentile_metrics:
            result.update(_stats(values[name], name, percentiles, name in percentile_metrics))
    result["output_lens"] = output_lens
    return result
