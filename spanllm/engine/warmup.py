"""The untimed warm-up a server or benchmark runs before its first real request, so that no first-call cost
lands in a measured request: Triton's compiles, every decode CUDA-graph bucket, and on a GPU the prefill path at
full chunks (cuDNN's library start-up and plans, the prefill and cascade kernels at their chunk-sized launches).

Under TP every rank runs the same sequence: rank 0 `warm_up`, the others `warm_up_worker`, whose empty generate
calls follow rank 0's (one per request rank 0 sends) and whose captures are collective."""

from __future__ import annotations

import time

import numpy as np

PREFILL_WARMUP_SEED = 20261206  # fixed: the same warm-up prompt on every rank and every start
PREFILL_WARMUP_TAIL = 77  # tokens after the full chunks: a last chunk that does not fill its launch tiles


def prefill_warmup_len(llm) -> int:
    """Tokens of the prefill warm-up prompt: two full chunks (the second one after a cached prefix, the way a long
    prompt's chunks run) plus a short tail, bounded by max_model_len and half the KV cache. 0 off a GPU (the eager
    CPU path has no first-call cost worth a long prompt) and where the bounds leave less than one chunk."""
    runner = llm.engine_core.runner
    if runner.device.type != "cuda":
        return 0
    chunk = llm.engine.max_num_batched_tokens
    capacity = llm.engine_core.blocks.capacity_tokens
    n = min(2 * chunk + PREFILL_WARMUP_TAIL, llm.max_model_len - 1, capacity // 2)
    return n if n > chunk else 0


def _prefill_warmup_prompt(llm, n: int) -> list[int]:
    vocab = llm.config.vocab_size
    return np.random.default_rng(PREFILL_WARMUP_SEED).integers(10, vocab - 10, size=n).tolist()


def warm_up(llm) -> dict:
    """Untimed, on rank 0: one short request (compiles), every decode graph bucket captured, the prefill attention
    at every shape a prompt's chunks meet (the cascade's cuDNN plans; a GPU only), then one prompt of
    prefill_warmup_len tokens (none off a GPU). The shapes come first: with them planned, `auto` runs the prompt's
    second chunk on the cascade as a real prompt's, so the kernels it launches in the forward compile here (the
    cascade's merge, in the forward's PDL variant) and not in a client's first request. The prompt's blocks stay in
    the prefix cache as evictable blocks of random ids, which no real prompt shares."""
    from spanllm.engine.sampler import SamplingParams

    t0 = time.perf_counter()
    # 8 prompt tokens and 4 to generate, fewer where the context or the KV pool is smaller (the user's limits, not
    # the warm-up's: a server with --max-model-len 10 must start); none where not even 1 + 1 tokens fit
    limit = min(llm.max_model_len, llm.engine_core.blocks.capacity_tokens)
    prompt_len = min(8, limit - 1)
    if prompt_len >= 1:
        sp = SamplingParams(max_tokens=min(4, limit - prompt_len), ignore_eos=True)
        llm.generate([[llm.get_tokenizer().bos_token_id or 1] * prompt_len], sp)
    runner = llm.engine_core.runner
    captured = runner.capture_all()
    warmed = _warm_chunk_shapes(llm)
    prefill = prefill_warmup_len(llm)
    if prefill:
        llm.generate([_prefill_warmup_prompt(llm, prefill)], SamplingParams(max_tokens=1, ignore_eos=True))
    return {
        "warmup_s": round(time.perf_counter() - t0, 2),
        "graph_buckets": captured,
        "graph_memory_gib": round(runner.graph_memory_bytes / 2**30, 3),
        "prefill_warmup_tokens": prefill,
        "prefill_shapes_warmed": warmed,
    }


def warm_up_worker(llm) -> None:
    """TP ranks other than 0, in step with rank 0's warm_up: its short request's plans, the same captures, the
    chunk shapes, then the prefill prompt's plans (prefill_warmup_len decides the same on every rank: config and
    device type)."""
    llm.generate([])
    llm.engine_core.runner.capture_all()
    _warm_chunk_shapes(llm)
    if prefill_warmup_len(llm):
        llm.generate([])


def _warm_chunk_shapes(llm) -> list[tuple[int, int]]:
    """The prefill attention at every (queries, prefix) shape a prompt's chunks meet (the backend's
    warm_up_prefill; on a GPU only), for prompts up to max_model_len and the KV cache's capacity, its Triton
    kernels launched as the forward launches them (PDL or not: a kernel's PDL variant is its own compile). Local to
    each rank (no collective)."""
    from spanllm.kernels import pdl

    runner = llm.engine_core.runner
    if runner.device.type != "cuda":
        return []
    capacity = llm.engine_core.blocks.capacity_tokens
    with pdl.launching(llm.pdl):
        return runner.backend.warm_up_prefill(
            llm.engine.max_num_batched_tokens, min(llm.max_model_len, capacity), runner.dtype
        )
