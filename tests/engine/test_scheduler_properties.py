"""The scheduler's invariants (spanllm.engine.core.scheduler's docstring) over random workloads: arrivals at random
steps, prompts that share prefixes or not, tight and loose KV pools, every token-budget knob (the step's budget, one
prompt's chunk, prefill beside decodes, the attention budget), prefix caching on and off, both admission policies.
Each step is checked, then run as the engine runs it (scheduler_steps.run_step); every request
must finish with exactly its max_tokens, and the pool must be whole again at the end."""

from __future__ import annotations

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from scheduler_steps import SAMPLED, run_step  # noqa: E402

from spanllm.engine.core.block_manager import BlockManager  # noqa: E402
from spanllm.engine.core.scheduler import Scheduler, SchedulerConfig, chunk_pairs  # noqa: E402
from spanllm.engine.core.sequence import Sequence  # noqa: E402
from spanllm.engine.sampler import SamplingParams  # noqa: E402

MAX_MODEL_LEN = 128
BASES = [list(range(1000 * b, 1000 * b + 90)) for b in range(3)]  # prompts start with a slice of one of these


@st.composite
def workloads(draw):
    block_size = draw(st.sampled_from([1, 2, 4, 16]))
    requests = []
    for i in range(draw(st.integers(1, 10))):
        n = draw(st.integers(1, 80))
        shared = draw(st.integers(0, n))  # the first `shared` ids from a base: prefix-cache hits, families
        base = BASES[draw(st.integers(0, len(BASES) - 1))]
        prompt = base[:shared] + [50_000 + 100 * i + j for j in range(n - shared)]
        requests.append((draw(st.integers(0, 15)), prompt, draw(st.integers(1, 12))))  # (arrival step, ...)
    longest = max(len(p) + m for _, p, m in requests)
    blocks = -(-longest // block_size) + draw(st.integers(0, 30)) + 1  # one request always fits (+ block 0)
    max_num_seqs = draw(st.integers(1, 8))
    caching = draw(st.booleans())
    cfg = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=draw(st.integers(max_num_seqs, 64)),
        max_model_len=MAX_MODEL_LEN,
        long_prefill_attention_budget=draw(st.sampled_from([0, 40, 400, 4000])),
        scheduling_policy=draw(st.sampled_from(["fcfs", "prefix"])) if caching else "fcfs",
        prefill_tokens_beside_decodes=draw(st.integers(0, 10)),
        long_prefill_token_threshold=draw(st.integers(0, 20)),
    )
    return cfg, BlockManager(blocks, block_size, caching), requests


def _check_step(sched: Scheduler, batch) -> None:
    cfg, blocks = sched.config, sched.blocks
    seqs = [s for s, _ in batch.entries]
    assert len({id(s) for s in seqs}) == len(seqs) <= cfg.max_num_seqs
    assert batch.num_tokens <= cfg.max_num_batched_tokens
    assert all(n == 1 for _, n in batch.entries[: batch.num_decode])
    prefills = batch.entries[batch.num_decode :]
    assert all(n >= 1 for _, n in prefills)
    if cfg.long_prefill_token_threshold:
        assert all(n <= cfg.long_prefill_token_threshold for _, n in prefills)
    if batch.num_decode and prefills:
        if cfg.prefill_tokens_beside_decodes:
            assert sum(n for _, n in prefills) <= cfg.prefill_tokens_beside_decodes
        if cfg.long_prefill_attention_budget:  # the first prefill always gets a token; the rest stay within
            pairs = [chunk_pairs(s.num_computed, n) for s, n in prefills]
            assert sum(pairs) <= cfg.long_prefill_attention_budget or len(prefills) == 1 and prefills[0][1] == 1
    for s, n in batch.entries:  # the KV of positions [0, num_computed + n) has blocks
        assert len(s.block_table) * blocks.block_size >= s.num_computed + n
        assert s.num_computed + n <= s.num_tokens
    held = {b for s in sched.running for b in s.block_table}
    assert all(not s.block_table for s in sched.waiting)
    assert len(held) + blocks.num_free == blocks.num_usable  # no block lost, none counted twice


@settings(max_examples=300, deadline=None)
@given(workloads())
def test_every_request_finishes_within_the_budgets_and_the_pool_comes_back(workload):
    cfg, blocks, requests = workload
    sched = Scheduler(cfg, blocks)
    finished: dict[str, Sequence] = {}
    total = sum(len(p) + m for _, p, m in requests)
    step = 0
    while len(finished) < len(requests):
        for i, (arrival, prompt, max_tokens) in enumerate(requests):
            if arrival == step:
                sched.add(Sequence(f"r{i}", list(prompt), SamplingParams(max_tokens=max_tokens)))
        batch = sched.schedule()
        _check_step(sched, batch)
        # an arrived request's step never comes up empty: decodes or a prompt's first token always fit
        assert batch or not sched.has_work()
        finished.update((s.request_id, s) for s in run_step(sched, batch))
        step += 1
        # far above any schedule's steps (each runs at least one token; preemption recomputes some): a livelock fails
        # here instead of hanging
        assert step <= 16 + 40 * total, "the workload did not finish"
    for i, (_, _, max_tokens) in enumerate(requests):
        assert finished[f"r{i}"].output_ids == [SAMPLED] * max_tokens
    assert not sched.has_work() and blocks.num_free == blocks.num_usable
