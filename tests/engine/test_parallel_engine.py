"""Multi-rank engine runs on gloo against transformers: TP=2, TP=4 (replicated KV heads), PP, TP x PP.

Two launches (world 2 and world 4) carry all the checks; each returns tokens and the logits every
token was sampled from, compared here with the HF reference (float32: 1e-4 absolute on logits of
magnitude ~2).
"""

from __future__ import annotations

import pytest
import torch
from engine_workers import NEW_TOKENS, PROMPTS, world2, world4

from spanllm.launch import launch

ATOL = 1e-4


def _check(result: dict, hf_reference, what: str) -> None:
    hf_tokens, hf_logits = hf_reference
    assert result["tokens"] == hf_tokens, what
    for i in range(len(PROMPTS)):
        torch.testing.assert_close(result["logits"][:, i], hf_logits[i], atol=ATOL, rtol=0, msg=what)


@pytest.fixture(scope="module")
def world2_results(hf_checkpoint):
    single, sharded, _ = hf_checkpoint
    return launch(world2, single, sharded, PROMPTS, NEW_TOKENS, nprocs=2)


@pytest.fixture(scope="module")
def world4_results(hf_checkpoint):
    single, _, _ = hf_checkpoint
    return launch(world4, single, PROMPTS, NEW_TOKENS, nprocs=4)


@pytest.mark.parametrize("key", ["tp2", "tp2_ref_ring", "tp2_capped", "tp2_sharded", "pp2", "pp2_mb3"])
def test_world2_matches_transformers(world2_results, hf_reference, key):
    for rank, res in enumerate(world2_results):
        _check(res[key], hf_reference, f"{key} rank {rank}")


@pytest.mark.parametrize("key", ["tp4", "tp2pp2", "tp2pp2_mb2", "pp4_mb3"])
def test_world4_matches_transformers(world4_results, hf_reference, key):
    for rank, res in enumerate(world4_results):
        _check(res[key], hf_reference, f"{key} rank {rank}")


def test_decode_step_issues_two_allreduces_per_layer(world2_results, world4_results):
    for res in world2_results:
        assert res["tp2_counts"] == {"prefill": 8, "decode": 8, "layers": 4}
    for res in world4_results:
        assert res["tp4_counts"] == {"prefill": 8, "decode": 8, "layers": 4}


def test_buffered_allreduce_takes_decode_and_falls_back_for_prefill(world2_results):
    for res in world2_results:
        assert res["tp2_capped_swapped"]
        calls, expected = res["tp2_capped_calls"]
        assert calls == expected


def test_allreduce_that_ran_is_named(world2_results):
    assert [r["tp2_allreduce_ran"] for r in world2_results] == ["gloo", "gloo"]


def test_pipeline_stages_hold_their_parts(world2_results, world4_results):
    assert [r["pp2_layers"] for r in world2_results] == [[0, 1], [2, 3]]
    assert [r["pp2_parts"] for r in world2_results] == [(True, False), (False, True)]
    assert [r["tp2pp2_stage"] for r in world4_results] == [
        (0, 0, [0, 1]),
        (0, 1, [0, 1]),
        (1, 0, [2, 3]),
        (1, 1, [2, 3]),
    ]


def test_replicated_kv_heads(world4_results):
    # 2 KV heads over 4 ranks: ranks 0,1 hold head 0 and ranks 2,3 hold head 1.
    assert [r["tp4_kv"] for r in world4_results] == [(1, 0), (1, 0), (1, 1), (1, 1)]


def test_pipeline_decode_steps_do_not_wait_for_the_prefill(world2_results):
    """The first stage receives the prefill's tokens before decode step 1, so the timed decode steps hold
    only decode receives: first stage, a token per step from step 2 on; last stage, activations every
    step (per micro-batch). Otherwise the later stages' prefill is booked as decode idle time."""
    steps = NEW_TOKENS - 1  # timed decode steps
    for mb_index, mb in enumerate((1, 3)):
        chunks = min(mb, len(PROMPTS))
        first, last = (r["pp2_timed_receives"][mb_index] for r in world2_results)
        assert (first, last) == ((steps - 1) * chunks, steps * chunks)
