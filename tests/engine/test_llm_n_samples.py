"""SamplingParams.n in the offline API, as vLLM's: LLM.generate serves n samples of a prompt as n engine requests
(sample j seeded seed_for_sample(seed, j), as the server's choice j) and returns one RequestOutput per prompt whose
`outputs` holds the n samples in order; an engine request itself is one sample (the engine core refuses n != 1),
and generate_batch refuses n > 1. Exact tokens: the tiny preset's seeded random weights."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from spanllm.engine.config import EngineConfig
from spanllm.engine.engine_core import RequestError
from spanllm.engine.llm import LLM
from spanllm.engine.sampler import INT64_MAX, MAX_N, SamplingParams, SamplingParamsError, seed_for_sample
from spanllm.errors import UsageError

TINY_567 = [150, 125, 125, 309]  # the tiny preset's greedy 4 tokens after [5, 6, 7]
TINY_9_10 = [192, 365, 365, 365]  # ... after [9, 10]


@pytest.fixture(scope="module")
def llm():
    cfg = EngineConfig(
        dtype=torch.float32, block_size=4, max_num_seqs=4, max_num_batched_tokens=16, num_kv_blocks=64, max_model_len=64
    )
    with LLM("tiny", cfg) as llm:
        yield llm


def test_greedy_samples_are_the_greedy_output(llm):
    greedy = SamplingParams(max_tokens=4, ignore_eos=True, n=3)
    (out,) = llm.generate([5, 6, 7], greedy)
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert [c.token_ids for c in out.outputs] == [TINY_567] * 3
    assert out.output_ids == TINY_567 and out.prompt_token_ids == [5, 6, 7]  # the top-level fields: sample 0's
    assert all(c.finish_reason == "length" and c.finished for c in out.outputs)


def test_seeded_samples_are_the_seeds_of_the_servers_choices(llm):
    """Sample j of a seeded request equals a request of its own with seed_for_sample(seed, j), whatever else runs
    beside it; seeds near the int64 limit wrap as the server's do."""
    for seed in (7, INT64_MAX - 1):
        sp = SamplingParams(temperature=1.5, max_tokens=6, ignore_eos=True, seed=seed, n=4)
        outs = llm.generate([[5, 6, 7], [9, 10]], sp)
        assert [len(o.outputs) for o in outs] == [4, 4]
        for prompt, out in zip(([5, 6, 7], [9, 10]), outs, strict=True):
            alone = [
                llm.generate(prompt, dataclasses.replace(sp, n=1, seed=seed_for_sample(seed, j)))[0].output_ids
                for j in range(4)
            ]
            assert [c.token_ids for c in out.outputs] == alone
        assert len({tuple(c.token_ids) for c in outs[0].outputs}) > 1  # at temperature 1.5 the samples differ


def test_n_per_prompt_with_a_list_of_params(llm):
    outs = llm.generate(
        [[5, 6, 7], [9, 10]],
        [SamplingParams(max_tokens=4, ignore_eos=True, n=2), SamplingParams(max_tokens=4, ignore_eos=True)],
    )
    assert [[c.token_ids for c in o.outputs] for o in outs] == [[TINY_567, TINY_567], [TINY_9_10]]
    assert outs[1].samples is None  # one sample: the engine's own RequestOutput


def test_on_output_sees_every_samples_requests(llm):
    seen = []
    llm.generate([5, 6, 7], SamplingParams(max_tokens=2, ignore_eos=True, n=3), on_output=seen.append)
    assert len({o.request_id for o in seen if o.finished}) == 3


@pytest.mark.parametrize("n", [0, MAX_N + 1, True, 2.0, "2"])
def test_n_outside_its_range_is_refused(n):
    with pytest.raises(SamplingParamsError, match=rf"n={n!r} must be an integer in \[1, {MAX_N}\]"):
        SamplingParams(n=n)


def test_engine_requests_and_fixed_batches_are_one_sample(llm):
    sp = SamplingParams(max_tokens=2, n=2)
    with pytest.raises(RequestError, match="n=2: an engine request is one sample"):
        llm.engine_core.add_request([5, 6, 7], sp)
    with pytest.raises(UsageError, match="generate_batch takes temperature.*; n need the serving engine"):
        llm.generate_batch([[5, 6, 7]], sp)
    assert not llm.engine_core.has_unfinished()
