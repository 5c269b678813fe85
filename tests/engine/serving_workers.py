"""Scenarios for the serving-engine tests, at module level so spawned gloo ranks can import them.

`run_scenario` drives one EngineCore the way a server does: requests arrive at given steps, some are
aborted part-way, the loop steps until nothing is left. Rank 0 schedules; other TP ranks run the plans
it sends (worker_loop) and return None.
"""

from __future__ import annotations

import torch

from spanllm.engine.config import EngineConfig
from spanllm.engine.llm import LLM
from spanllm.engine.sampler import SamplingParams
from spanllm.model.parallel_dims import ParallelDims

# Mixed lengths: 1 token, shorter and longer than a block (4) and than the chunk budgets used (8, 16).
SERVE_PROMPTS = [
    [5, 17, 42, 8, 99, 3, 61],
    [7, 7, 200],
    [11],
    list(range(30, 70)),
    [9, 8, 7, 6, 5, 4, 3, 2, 1, 4, 5, 6],
    list(range(100, 121)),
    [13, 13],
]
SERVE_MAX_TOKENS = [10, 6, 12, 9, 7, 11, 8]
ARRIVAL_STEPS = [0, 0, 1, 3, 3, 6, 9]  # the engine step before which each request is added


def serving_config(**kw) -> EngineConfig:
    base = dict(
        dtype=torch.float32,
        block_size=4,
        max_num_seqs=4,
        max_num_batched_tokens=16,
        num_kv_blocks=64,
        max_model_len=128,
    )
    base.update(kw)
    return EngineConfig(**base)


def run_scenario(
    llm: LLM, aborts: dict[int, int] | None = None, prompts=None, max_tokens=None, arrivals=None
) -> dict | None:
    """Outputs by prompt index: {"tokens", "finish_reason", "preemptions_total", "blocks_ok"}.
    aborts: prompt index -> the step after which it is aborted."""
    prompts = prompts or SERVE_PROMPTS
    max_tokens = max_tokens or SERVE_MAX_TOKENS
    arrivals = arrivals or ARRIVAL_STEPS
    aborts = aborts or {}
    core = llm.engine_core
    if core.rank != 0:
        core.worker_loop()
        return None
    ids: dict[str, int] = {}
    results: dict[int, dict] = {}
    step = 0
    try:
        while len(results) < len(prompts):
            for i, a in enumerate(arrivals):
                if a == step:
                    seq = core.add_request(prompts[i], SamplingParams(max_tokens=max_tokens[i], ignore_eos=True))
                    ids[seq.request_id] = i
            for out in core.step():
                if out.finished:
                    results[ids[out.request_id]] = {"tokens": list(out.output_ids), "finish_reason": out.finish_reason}
            for i, when in aborts.items():
                if when == step and i not in results:
                    rid = next(r for r, j in ids.items() if j == i)
                    out = core.abort_request(rid)
                    results[i] = {"tokens": list(out.output_ids), "finish_reason": out.finish_reason}
            step += 1
            if step > 500:
                raise RuntimeError("scenario did not finish in 500 steps")
    finally:
        core.shutdown_workers()
    core.blocks.check([])
    return {
        "results": results,
        "preemptions": core.stats.preemptions,
        "free_blocks": core.blocks.num_free,
        "usable_blocks": core.blocks.num_usable,
    }


def alone(llm: LLM, prompts=None, max_tokens=None) -> list[list[int]] | None:
    """Each request run alone on a fresh engine state (one after another)."""
    prompts = prompts or SERVE_PROMPTS
    max_tokens = max_tokens or SERVE_MAX_TOKENS
    out = []
    for p, n in zip(prompts, max_tokens):
        res = llm.generate([p], SamplingParams(max_tokens=n, ignore_eos=True))
        out.append(None if not res else res[0].output_ids)
    return out if llm.engine_core.rank == 0 else None


def tp_scenarios(ctx, checkpoint: str) -> dict | None:
    """TP=2 over gloo on a transformers checkpoint: alone, mixed arrivals with chunks, preemption, aborts."""
    res = {}
    llm = LLM(checkpoint, serving_config(), dims=ParallelDims(ctx.world_size, 1, ctx.world_size))
    res["alone"] = alone(llm)
    res["mixed"] = run_scenario(llm)
    llm2 = LLM(
        checkpoint,
        serving_config(num_kv_blocks=14, max_num_batched_tokens=8),
        dims=ParallelDims(ctx.world_size, 1, ctx.world_size),
    )
    res["preempt"] = run_scenario(llm2)
    res["abort"] = run_scenario(llm, aborts={3: 4, 0: 2})
    return res if ctx.rank == 0 else None


def hf_greedy(model, prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
    """transformers' greedy continuation of each prompt (no EOS stop): the reference the engine tests compare with."""
    out = []
    with torch.no_grad():
        for p, n in zip(prompts, max_tokens):
            ids = torch.tensor([p])
            g = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=n,
                eos_token_id=None,
                pad_token_id=0,
            )
            out.append(g[0, len(p) :].tolist())
    return out
