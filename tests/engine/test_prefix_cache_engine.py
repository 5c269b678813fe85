"""Prefix caching in the serving engine (CPU, a small random Llama written by transformers): requests sharing
prefixes of every alignment give the same greedy tokens with caching on and off, and transformers' tokens, at
TP=1 (both host loops) and TP=2 (gloo), with chunked prefill, preemption and aborts; the hit counts of a planned
sequence of requests are exactly what the block-aligned common prefixes predict; every block is free or
evictable after every run (run_scenario checks the accounting)."""

from __future__ import annotations

import pytest
from prefix_cache_workers import (
    PREFIX_MAX_TOKENS,
    PREFIX_PROMPTS,
    SCENARIOS,
    prefix_scenario,
    tp_prefix_scenarios,
)
from serving_workers import hf_greedy, serving_config

from spanllm.engine.llm import LLM
from spanllm.engine.sampler import SamplingParams
from spanllm.launch import launch


@pytest.fixture(scope="module")
def hf_prefix_reference(hf_checkpoint):
    return hf_greedy(hf_checkpoint[2], PREFIX_PROMPTS, PREFIX_MAX_TOKENS)


def _expected_hit(prompt: list[int], history: list[list[int]], bs: int) -> int:
    """Tokens a request finds cached: the longest block-aligned common prefix with any earlier request's
    computed tokens (prompt and output but the last sampled token), at most (len(prompt) - 1) // bs blocks."""
    best = 0
    for h in history:
        n = 0
        while n < min(len(prompt), len(h)) and prompt[n] == h[n]:
            n += 1
        best = max(best, n // bs)
    return min(best, (len(prompt) - 1) // bs) * bs


# The scenarios' hit tokens (block size 4): each prompt arrives after the earlier ones were prefilled and finds
# their block-aligned common prefix cached (no output shares a block-aligned prefix with a later prompt), in every
# scenario, also where aborts and preemption free blocks: 4 + 4 + 16 + 4 + 20 = 48 of the prompts' 119 tokens.
SCENARIO_HITS = sum(_expected_hit(p, PREFIX_PROMPTS[:i], 4) for i, p in enumerate(PREFIX_PROMPTS))
SCENARIO_QUERIES = sum(len(p) for p in PREFIX_PROMPTS)
# the abort scenario's aborted requests (prompt index -> output tokens when aborted): 0 after step 4 and 3 after
# step 6; async scheduling reports each token a step later, so one fewer. TP=2 runs the sync loop.
ABORTED_LENGTHS = {False: {0: 4, 3: 3}, True: {0: 3, 3: 2}}


def _check(res: dict, reference: list[list[int]], aborts: dict, async_scheduling: bool = False) -> None:
    for i, ref in enumerate(reference):
        r = res["results"][i]
        if i in aborts:
            want = ref[: ABORTED_LENGTHS[async_scheduling][i]]
            assert r["finish_reason"] == "abort" and r["tokens"] == want, (i, r)
        else:
            assert r["finish_reason"] == "length" and r["tokens"] == ref, f"request {i}"
    assert res["free_blocks"] == res["usable_blocks"]


@pytest.mark.parametrize("name", list(SCENARIOS))
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_caching_on_equals_off_and_transformers(hf_checkpoint, hf_prefix_reference, name, async_scheduling):
    kw, aborts = SCENARIOS[name]
    runs = {}
    for on in (True, False):
        llm = LLM(hf_checkpoint[0], serving_config(**kw, enable_prefix_caching=on, async_scheduling=async_scheduling))
        runs[on] = prefix_scenario(llm, aborts)
        _check(runs[on], hf_prefix_reference, aborts, async_scheduling)
    assert [runs[True]["results"][i]["tokens"] for i in range(len(PREFIX_PROMPTS))] == [
        runs[False]["results"][i]["tokens"] for i in range(len(PREFIX_PROMPTS))
    ]
    assert SCENARIO_HITS == 48 and SCENARIO_QUERIES == 119
    assert runs[False]["hits"] == 0 and runs[True]["hits"] == SCENARIO_HITS
    assert runs[True]["queries"] == runs[False]["queries"] == SCENARIO_QUERIES
    if name == "preempt":
        assert runs[True]["preemptions"] > 0 and runs[False]["preemptions"] > 0


def test_tp2_caching_on_equals_off_and_transformers(hf_checkpoint, hf_prefix_reference):
    res = launch(tp_prefix_scenarios, hf_checkpoint[0], nprocs=2)[0]
    for name, (_, aborts) in SCENARIOS.items():
        for on in (True, False):
            _check(res[(name, on)], hf_prefix_reference, aborts)
        assert res[(name, True)]["hits"] == SCENARIO_HITS and res[(name, False)]["hits"] == 0, name
        assert res[(name, True)]["queries"] == res[(name, False)]["queries"] == SCENARIO_QUERIES, name


@pytest.mark.parametrize("block_size", [4, 16])
def test_hit_counts_of_a_planned_sequence(hf_checkpoint, hf_prefix_reference, block_size):
    llm = LLM(hf_checkpoint[0], serving_config(block_size=block_size, num_kv_blocks=512 // block_size))
    core = llm.engine_core
    history: list[list[int]] = []
    expected_hits = 0
    for p, n, ref in zip(PREFIX_PROMPTS, PREFIX_MAX_TOKENS, hf_prefix_reference):
        h0 = core.stats.prefix_cache_hits
        out = llm.generate([p], SamplingParams(max_tokens=n, ignore_eos=True))[0]
        assert out.output_ids == ref
        hit = _expected_hit(p, history, block_size)
        assert core.stats.prefix_cache_hits - h0 == hit, (p, history)
        expected_hits += hit
        history.append(p + out.output_ids[:-1])
        core.blocks.check([])
    assert core.stats.prefix_cache_hits == expected_hits > 0
    assert core.stats.prefix_cache_queries == core.stats.prompt_tokens == sum(len(p) for p in PREFIX_PROMPTS)
