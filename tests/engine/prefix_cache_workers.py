"""Prefix-cache scenarios for the engine tests, at module level so spawned gloo ranks can import them: requests
that share prefixes of every alignment with an earlier one (block size 4), arriving after it was prefilled."""

from __future__ import annotations

from serving_workers import run_scenario, serving_config

from spanllm.engine.llm import LLM
from spanllm.model.parallel_dims import ParallelDims

BASE = list(range(30, 50))  # 20 tokens: five blocks of 4
PREFIX_PROMPTS = [
    BASE,
    BASE[:3] + [200, 201, 202, 203, 204],  # shares less than a block
    BASE[:4] + [210, 211, 212],  # exactly a block
    BASE[:5] + [220, 221, 222, 223],  # a block and one token
    BASE,  # the whole prompt cached (its last block computed again)
    BASE[:8],  # exactly two cached blocks
    BASE + [5, 6, 7, 8, 9, 10],  # longer than a cached prompt
    list(range(100, 121)),  # shares nothing
]
PREFIX_MAX_TOKENS = [8, 6, 7, 9, 5, 6, 10, 8]
PREFIX_ARRIVALS = [0, 3, 3, 4, 5, 6, 6, 8]
SCENARIOS = {
    "chunked": ({}, {}),
    "tiny-chunks": ({"max_num_batched_tokens": 5, "max_num_seqs": 4}, {}),
    "preempt": ({"num_kv_blocks": 14, "max_num_batched_tokens": 8}, {}),
    "abort": ({}, {0: 4, 3: 6}),
}


def prefix_scenario(llm: LLM, aborts: dict[int, int] | None = None) -> dict | None:
    res = run_scenario(
        llm, aborts=aborts, prompts=PREFIX_PROMPTS, max_tokens=PREFIX_MAX_TOKENS, arrivals=PREFIX_ARRIVALS
    )
    if res is None:
        return None
    s = llm.engine_core.stats
    return {**res, "queries": s.prefix_cache_queries, "hits": s.prefix_cache_hits}


def tp_prefix_scenarios(ctx, checkpoint: str) -> dict | None:
    """Every scenario with caching on and off, at TP = world size (gloo)."""
    out = {}
    for name, (kw, aborts) in SCENARIOS.items():
        for on in (True, False):
            cfg = serving_config(**kw, enable_prefix_caching=on)
            llm = LLM(checkpoint, cfg, dims=ParallelDims(ctx.world_size, 1, ctx.world_size))
            out[(name, on)] = prefix_scenario(llm, aborts)
            llm.close()
    return out if ctx.rank == 0 else None


def tp_fp8_kv_scenario(ctx, checkpoint: str) -> dict | None:
    """The chunked scenario with prefix caching and an FP8 KV cache (each rank its heads' K/V in e4m3), at TP =
    world size (gloo)."""
    cfg = serving_config(kv_cache_dtype="fp8")
    llm = LLM(checkpoint, cfg, dims=ParallelDims(ctx.world_size, 1, ctx.world_size))
    out = prefix_scenario(llm, {})
    llm.close()
    return out if ctx.rank == 0 else None
