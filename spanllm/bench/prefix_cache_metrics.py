"""A server's prefix-cache hit rate, from its Prometheus `/metrics` read before and after a benchmark run.

The counters are vLLM's `prefix_cache_queries` and `prefix_cache_hits` (prompt tokens looked up in the cache and
found there), under any namespace (`spanllm:`, `vllm:`), summed over their labels. A server without them (or
without /metrics) gives no hit rate and a note saying why, never a made-up number.
"""

from __future__ import annotations

import asyncio
from typing import Any

PREFIX_CACHE_COUNTERS = ("prefix_cache_queries_total", "prefix_cache_hits_total")


def parse_prefix_cache_counters(text: str) -> tuple[float, float] | str:
    """(queries, hits) in tokens from a Prometheus /metrics page: vLLM's counters, under any namespace
    (spanllm:, vllm:), summed over their labels; a string saying what is missing otherwise."""
    from prometheus_client.parser import text_string_to_metric_families

    found = dict.fromkeys(PREFIX_CACHE_COUNTERS, None)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            base = sample.name.split(":")[-1]
            if base in found:
                found[base] = (found[base] or 0.0) + sample.value
    missing = [k for k, v in found.items() if v is None]
    if missing:
        return f"the server's /metrics has no {' or '.join('*' + m for m in missing)} counter"
    return found["prefix_cache_queries_total"], found["prefix_cache_hits_total"]


async def prefix_cache_counters(session, base_url: str, timeout_s: float = 30.0) -> tuple[float, float] | str:
    """GET {base_url}/metrics (given up after timeout_s: the command's --request-timeout) and parse the prefix-cache
    counters; a string naming the failure otherwise."""
    import aiohttp

    url = base_url.rstrip("/") + "/metrics"
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
            if r.status != 200:
                return f"GET {url} answered {r.status}"
            return parse_prefix_cache_counters(await r.text())
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
        return f"GET {url} failed: {type(e).__name__}: {e}"


def prefix_cache_result(before: tuple[float, float] | str, after: tuple[float, float] | str) -> dict[str, Any]:
    """The run's prefix-cache hit rate from the counters read before and after it, or why it is unknown.
    Other clients' requests during the run count too (the counters are the server's)."""
    why = before if isinstance(before, str) else after if isinstance(after, str) else None
    if why is not None:
        return {"prefix_cache_hit_rate": None, "prefix_cache_note": why}
    queries, hits = after[0] - before[0], after[1] - before[1]
    return {
        "prefix_cache_queries": int(queries),
        "prefix_cache_hits": int(hits),
        "prefix_cache_hit_rate": hits / queries if queries > 0 else None,
    }
