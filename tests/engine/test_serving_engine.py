"""The serving engine on CPU: scheduler and block manager units, then requests of mixed lengths arriving at
different steps, with chunked prefill, a pool small enough to preempt and aborts, at TP=1 and TP=2 (gloo):
every request's greedy tokens equal the same request run alone and transformers' own greedy tokens, and
after every run every block is free again."""

from __future__ import annotations

import pytest
import torch
from scheduler_steps import run_step
from serving_workers import (
    SERVE_MAX_TOKENS,
    SERVE_PROMPTS,
    alone,
    hf_greedy,
    run_scenario,
    serving_config,
    tp_scenarios,
)

from spanllm.engine.config import EngineConfig
from spanllm.engine.core.block_manager import BlockManager
from spanllm.engine.core.scheduler import Scheduler, SchedulerConfig, chunk_pairs, chunk_within_pairs
from spanllm.engine.core.sequence import FinishReason, Sequence, SequenceStatus
from spanllm.engine.engine_core import RequestError
from spanllm.engine.llm import LLM
from spanllm.engine.sampler import SamplingParams, SamplingParamsError
from spanllm.launch import launch


# --- block manager and scheduler, no model ----------------------------------------------------------------
def _seq(rid: str, n: int, max_tokens: int = 4) -> Sequence:
    return Sequence(rid, list(range(1, n + 1)), SamplingParams(max_tokens=max_tokens))


def test_block_manager_accounting():
    bm = BlockManager(num_blocks=6, block_size=4)
    assert (bm.num_usable, bm.num_free, bm.capacity_tokens) == (5, 5, 20)
    a, b = _seq("a", 5), _seq("b", 2)
    bm.grow(a, 5)
    assert a.block_table == [1, 2] and bm.num_free == 3
    bm.grow(a, 8)  # still two blocks
    assert len(a.block_table) == 2
    bm.grow(b, 9)
    assert b.block_table == [3, 4, 5] and bm.num_free == 0 and not bm.can_grow(a, 9)
    with pytest.raises(RuntimeError, match="needs 1 blocks, 0 free"):
        bm.grow(a, 9)
    bm.check([a, b])
    bm.free(a)
    assert bm.num_free == 2 and a.block_table == []
    bm.check([b])
    bm.free(b)
    bm.check([])
    assert sorted(bm.free_ids) == [1, 2, 3, 4, 5]
    with pytest.raises(AssertionError, match="disagree"):
        bm.check([_seq_with_blocks([1])])  # a sequence claiming a free block


def _seq_with_blocks(blocks):
    s = _seq("x", 1)
    s.block_table = list(blocks)
    return s


def test_budget_and_sequence_cap_respected():
    sched = Scheduler(
        SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=10, max_model_len=64), BlockManager(100, 4)
    )
    seqs = [_seq(f"r{i}", 4) for i in range(5)]
    for s in seqs:
        sched.add(s)
    b = sched.schedule()
    assert [(s.request_id, n) for s, n in b.entries] == [("r0", 4), ("r1", 4), ("r2", 2)]  # r2 chunked at the budget
    assert b.num_tokens == 10 and len(sched.running) == 3 and b.num_decode == 0
    run_step(sched, b)
    b = sched.schedule()  # two decodes first, then r2's last 2 prompt tokens; r3 waits (3 sequences max)
    assert [(s.request_id, n) for s, n in b.entries] == [("r0", 1), ("r1", 1), ("r2", 2)]
    assert b.num_decode == 2 and [s.request_id for s in sched.waiting] == ["r3", "r4"]


def test_decode_never_starved_by_a_long_prompt():
    sched = Scheduler(
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=6, max_model_len=128), BlockManager(200, 4)
    )
    short = [_seq("s0", 2, max_tokens=20), _seq("s1", 2, max_tokens=20)]
    for s in short:
        sched.add(s)
    run_step(sched, sched.schedule())
    sched.add(_seq("long", 50, max_tokens=2))
    for _ in range(8):  # the long prompt is prefilled 4 tokens a step while both decodes run every step
        b = sched.schedule()
        names = [(s.request_id, n) for s, n in b.entries]
        assert names[:2] == [("s0", 1), ("s1", 1)] and names[2] == ("long", 4)
        run_step(sched, b)


def test_chunk_within_pairs_is_the_largest_chunk_in_the_budget():
    assert chunk_within_pairs(0, 10) == 4  # 1+2+3+4 = 10
    assert chunk_within_pairs(100, 1000) == 9  # 9*100 + 45 = 945; 10 tokens: 1055
    assert chunk_within_pairs(5, 0) == 0 and chunk_within_pairs(200, 100) == 0
    for context in (0, 1, 7, 1000, 131071):
        for pairs in (0, 1, 2, 3, 999, 1 << 26, (1 << 40) + 3):
            n = chunk_within_pairs(context, pairs)
            assert chunk_pairs(context, n) <= pairs < chunk_pairs(context, n + 1), (context, pairs, n)


def test_long_prefill_attention_budget_caps_chunks_only_beside_decodes():
    cfg = SchedulerConfig(
        max_num_seqs=8, max_num_batched_tokens=64, max_model_len=512, long_prefill_attention_budget=100
    )
    sched = Scheduler(cfg, BlockManager(200, 4))
    for s in (_seq("s0", 2, max_tokens=40), _seq("s1", 2, max_tokens=40)):
        sched.add(s)
    run_step(sched, sched.schedule())
    sched.add(_seq("long", 60, max_tokens=2))
    chunks = []
    for _ in range(4):
        b = sched.schedule()
        assert [(s.request_id, n) for s, n in b.entries][:2] == [("s0", 1), ("s1", 1)]
        chunks.append(b.entries[2][1])
        run_step(sched, b)
    # context 0: 13 tokens (91 pairs); 13: 6 (99); 19: 4 (86); 23: 3 (75)
    assert chunks == [13, 6, 4, 3]
    # a context whose one next token alone exceeds the budget still gets one token (the step's first prefill)
    sched2 = Scheduler(
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=512, long_prefill_attention_budget=10),
        BlockManager(200, 4),
    )
    sched2.add(_seq("d", 2, max_tokens=40))
    run_step(sched2, sched2.schedule())
    sched2.add(_seq("p", 30, max_tokens=2))
    sizes = []
    for _ in range(3):
        b = sched2.schedule()
        sizes.append(b.entries[1][1])
        run_step(sched2, b)
    assert sizes == [4, 1, 1]  # 1+2+3+4 = 10 pairs; then 4 keys + 1 = 5 <= 10, two tokens would be 11
    # an idle engine (no decodes) keeps the whole token budget
    idle = Scheduler(cfg, BlockManager(200, 4))
    idle.add(_seq("alone", 60))
    assert [(s.request_id, n) for s, n in idle.schedule().entries] == [("alone", 60)]


def test_fcfs_head_of_line_blocks_admission():
    sched = Scheduler(
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=128), BlockManager(5, 4)
    )  # 16 tokens of pool
    sched.add(_seq("a", 8))
    sched.add(_seq("big", 12))  # needs 3 blocks; only 2 are left after a
    sched.add(_seq("small", 2))  # would fit, but must not skip ahead of big
    b = sched.schedule()
    assert [s.request_id for s, _ in b.entries] == ["a", "big"]  # big gets the 2 blocks' worth (8 tokens), chunked
    assert [(s.request_id, n) for s, n in b.entries][1] == ("big", 8)
    assert [s.request_id for s in sched.waiting] == ["small"]


def test_preemption_by_recompute_takes_the_newest():
    sched = Scheduler(
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64), BlockManager(4, 4)
    )  # 12 tokens
    a, b = _seq("a", 4, max_tokens=8), _seq("b", 4, max_tokens=8)
    sched.add(a)
    sched.add(b)
    run_step(sched, sched.schedule())  # both prefilled: 2 blocks each? 1 block each (4 tokens), 1 token out each
    assert len(a.block_table) == 1 and len(b.block_table) == 1
    batch = sched.schedule()  # a's 5th token needs a block; so does b's: 3 usable blocks, 4 needed
    assert sched.num_preemptions == 1 and batch.preempted == [b]
    assert b.status is SequenceStatus.WAITING and b.num_computed == 0 and b.block_table == [] and b.output_ids == [7]
    assert sched.waiting[0] is b and [s.request_id for s, _ in batch.entries] == ["a"]


@pytest.mark.parametrize("caching", [True, False])
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_two_half_prefilled_prompts_never_hold_the_pool_forever(caching, async_scheduling):
    """A decode runs beside two 40-token prompts, and the attention budget cuts the first prompt's chunk, so the
    second is admitted with what is left. Once the decode is done, the two prompts hold all 11 blocks part-way
    through their prefills (36 and 8 of 40 tokens); neither could ever take another block. The oldest preempts
    the newest: both finish with the tokens each gives alone, and every block is free after."""
    from spanllm.engine.config import EngineConfig

    cfg = EngineConfig(dtype=torch.float32, block_size=4, num_kv_blocks=12, max_num_seqs=4, max_num_batched_tokens=64,
                       max_model_len=128, long_prefill_attention_budget=100, enable_prefix_caching=caching,
                       async_scheduling=async_scheduling)  # fmt: skip
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    prompts = [list(range(100, 140)), list(range(200, 240))]
    alone_llm = LLM("tiny", cfg)
    alone = [alone_llm.generate([p], params)[0].output_ids for p in prompts]
    core = LLM("tiny", cfg).engine_core
    core.add_request([7, 8], SamplingParams(max_tokens=4, ignore_eos=True), request_id="decode")
    core.step()
    for i, p in enumerate(prompts):
        core.add_request(p, params, request_id=f"p{i}")
    outs = {}
    for _ in range(100):
        outs.update({o.request_id: o.output_ids for o in core.step() if o.finished})
        if not core.has_unfinished():
            break
    assert not core.has_unfinished() and sorted(outs) == ["decode", "p0", "p1"]
    assert [outs["p0"], outs["p1"]] == alone and core.scheduler.num_preemptions >= 1
    assert core.blocks.num_free == core.blocks.num_usable


def test_abort_frees_blocks_from_either_queue():
    bm = BlockManager(20, 4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=64, max_model_len=64), bm)
    a, b = _seq("a", 9), _seq("b", 3)
    sched.add(a)
    sched.add(b)
    run_step(sched, sched.schedule())
    assert sched.abort("b").finish_reason is FinishReason.ABORT  # waiting
    assert sched.abort("a").finish_reason is FinishReason.ABORT  # running, with blocks
    assert sched.abort("a") is None and not sched.has_work()
    bm.check([])


# --- the engine, TP=1 ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def hf_serving_reference(hf_checkpoint):
    return hf_greedy(hf_checkpoint[2], SERVE_PROMPTS, SERVE_MAX_TOKENS)


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def tp1_llm(hf_checkpoint, request):
    """Both host loops: the host waits for each step's tokens (sync), or plans the next step first (async)."""
    return LLM(hf_checkpoint[0], serving_config(async_scheduling=request.param))


def test_prefill_tokens_beside_decodes_caps_chunks_only_beside_decodes():
    cfg = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=512, prefill_tokens_beside_decodes=5)
    sched = Scheduler(cfg, BlockManager(200, 4))
    sched.add(_seq("d", 2, max_tokens=40))
    run_step(sched, sched.schedule())
    sched.add(_seq("p1", 12, max_tokens=2))
    sched.add(Sequence("p2", list(range(100, 112)), SamplingParams(max_tokens=2)))  # no prefix shared with p1
    steps = []
    for _ in range(5):
        b = sched.schedule()
        steps.append([(s.request_id, n) for s, n in b.entries[b.num_decode :]])
        assert b.entries[0] == (b.entries[0][0], 1) and b.entries[0][0].request_id == "d"
        run_step(sched, b)
    # 5 prefill tokens a step together beside the decodes, oldest first: p1 5, 5, then its last 2 and p2's
    # first 3; p2 goes on beside p1's decode, 5 then its last 4
    assert steps == [[("p1", 5)], [("p1", 5)], [("p1", 2), ("p2", 3)], [("p2", 5)], [("p2", 4)]]
    idle = Scheduler(cfg, BlockManager(200, 4))
    idle.add(_seq("alone", 60))
    assert idle.schedule().entries[0][1] == 60  # no decodes: the whole token budget
    with pytest.raises(ValueError, match="prefill_tokens_beside_decodes=-1"):
        SchedulerConfig(prefill_tokens_beside_decodes=-1)


def test_long_prefill_token_threshold_caps_every_chunk_and_admits_beside_it():
    """A long prompt's chunk takes at most the threshold in every step, with or without decodes, so the requests that
    arrive meanwhile are admitted in the next step beside it (the budget left is theirs), not after its whole prompt."""
    cfg = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=512, long_prefill_token_threshold=16)
    sched = Scheduler(cfg, BlockManager(200, 4))
    sched.add(_seq("long", 50, max_tokens=2))
    steps = []
    for i in range(5):
        if i == 1:
            sched.add(Sequence("short", list(range(100, 103)), SamplingParams(max_tokens=2)))
        if i == 2:
            sched.add(Sequence("mid", list(range(200, 230)), SamplingParams(max_tokens=1)))
        b = sched.schedule()
        steps.append([(s.request_id, n) for s, n in b.entries])
        run_step(sched, b)
    # long: 16, 16, 16, then its last 2 (and samples); short's 3 tokens beside its second chunk, then its decode;
    # mid (30 tokens) in chunks of 16 and 14 beside both
    assert steps == [
        [("long", 16)],
        [("long", 16), ("short", 3)],
        [("short", 1), ("long", 16), ("mid", 16)],
        [("long", 2), ("mid", 14)],
        [("long", 1)],
    ]
    with pytest.raises(ValueError, match="long_prefill_token_threshold=-1 must be an integer >= 0"):
        SchedulerConfig(long_prefill_token_threshold=-1)
    with pytest.raises(ValueError, match="long_prefill_token_threshold=1.5 must be None"):
        EngineConfig(long_prefill_token_threshold=1.5)


def test_long_prefill_token_threshold_auto_is_a_cpu_default(hf_checkpoint):
    from spanllm.engine.config import CPU_LONG_PREFILL_TOKEN_THRESHOLD

    auto = LLM(hf_checkpoint[0], serving_config())
    assert auto.long_prefill_token_threshold == CPU_LONG_PREFILL_TOKEN_THRESHOLD
    assert auto.engine_core.scheduler.config.long_prefill_token_threshold == CPU_LONG_PREFILL_TOKEN_THRESHOLD
    assert f"one prompt's prefill chunk <= {CPU_LONG_PREFILL_TOKEN_THRESHOLD} tokens" in auto.describe()
    off = LLM(hf_checkpoint[0], serving_config(long_prefill_token_threshold=0))
    assert off.long_prefill_token_threshold == 0 and "one prompt's prefill chunk unlimited" in off.describe()


def test_prefill_tokens_beside_decodes_auto_is_a_cpu_default(hf_checkpoint):
    from spanllm.engine.config import CPU_PREFILL_TOKENS_BESIDE_DECODES

    auto = LLM(hf_checkpoint[0], serving_config())
    assert auto.prefill_tokens_beside_decodes == CPU_PREFILL_TOKENS_BESIDE_DECODES
    assert f"prefill tokens beside decodes <= {CPU_PREFILL_TOKENS_BESIDE_DECODES} a step" in auto.describe()
    off = LLM(hf_checkpoint[0], serving_config(prefill_tokens_beside_decodes=0))
    assert off.prefill_tokens_beside_decodes == 0 and "prefill tokens beside decodes unlimited" in off.describe()


def _tokens(res: dict) -> list[list[int]]:
    return [res["results"][i]["tokens"] for i in range(len(SERVE_PROMPTS))]


def test_alone_equals_transformers(tp1_llm, hf_serving_reference):
    assert alone(tp1_llm) == hf_serving_reference


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"max_num_batched_tokens": 5},
        {"block_size": 16, "num_kv_blocks": 20},
        {"long_prefill_attention_budget": 40},
        {"prefill_tokens_beside_decodes": 3},
        {"long_prefill_token_threshold": 2},
    ],
)
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_mixed_arrivals_equal_alone_and_transformers(hf_checkpoint, hf_serving_reference, kw, async_scheduling):
    llm = LLM(hf_checkpoint[0], serving_config(**kw, async_scheduling=async_scheduling))
    res = run_scenario(llm)
    assert _tokens(res) == hf_serving_reference
    assert all(r["finish_reason"] == "length" for r in res["results"].values())
    assert res["free_blocks"] == res["usable_blocks"]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_preemption_keeps_tokens_and_frees_every_block(hf_checkpoint, hf_serving_reference, async_scheduling):
    llm = LLM(
        hf_checkpoint[0],
        serving_config(
            num_kv_blocks=14,
            max_num_batched_tokens=8,  # 52 tokens of pool
            async_scheduling=async_scheduling,
        ),
    )
    res = run_scenario(llm)
    assert res["preemptions"] > 0
    assert _tokens(res) == hf_serving_reference
    assert res["free_blocks"] == res["usable_blocks"] == 13


@pytest.mark.parametrize(
    "async_scheduling,aborted_lengths",
    [(False, {0: 3, 3: 0}), (True, {0: 2, 3: 0})],
    ids=["sync", "async"],
)
def test_aborts_lose_nothing_else(hf_checkpoint, hf_serving_reference, async_scheduling, aborted_lengths):
    """A fresh engine (the shared one's prefix cache would change how far request 3's prefill gets): request 0 is
    aborted after step 2 with the tokens reported so far (async reports a step late: one fewer), request 3 after
    step 4, still in its prefill (40 tokens at 16 a step from step 3), with none; the others are untouched."""
    llm = LLM(hf_checkpoint[0], serving_config(async_scheduling=async_scheduling))
    res = run_scenario(llm, aborts={3: 4, 0: 2})
    for i, ref in enumerate(hf_serving_reference):
        r = res["results"][i]
        if i in (0, 3):
            assert r["finish_reason"] == "abort" and r["tokens"] == ref[: aborted_lengths[i]], (i, r)
        else:
            assert r["finish_reason"] == "length" and r["tokens"] == ref
    assert res["free_blocks"] == res["usable_blocks"]


def test_async_scheduling_reports_a_step_late_and_drops_the_extra_step(hf_checkpoint, hf_serving_reference):
    """Async: step 1 (the prefill) reports nothing, its token is in flight; step 2 reports it while step 2's
    token is in flight. A request that ends on a stop id has one step more queued behind it, whose token is
    dropped: the output is the sync engine's, and every block is free afterwards."""
    llm = LLM(hf_checkpoint[0], serving_config(async_scheduling=True))
    core = llm.engine_core
    assert core.async_scheduling
    seq = core.add_request(SERVE_PROMPTS[0], SamplingParams(max_tokens=10, ignore_eos=True))
    assert core.step() == [] and seq.num_pending == 1 and seq.output_ids == []
    outs = core.step()
    assert [o.new_ids for o in outs] == [hf_serving_reference[0][:1]] and seq.num_pending == 1
    while core.has_unfinished():
        core.step()
    assert seq.output_ids == hf_serving_reference[0] and seq.num_pending == 0
    ref = hf_serving_reference[0]
    stop = ref[3]
    steps0 = core.stats.steps
    out = llm.generate([SERVE_PROMPTS[0]], SamplingParams(max_tokens=10, stop_token_ids=(stop,)))[0]
    assert out.output_ids == ref[: ref.index(stop) + 1] and out.finish_reason == "stop"
    assert core.stats.steps - steps0 == ref.index(stop) + 2  # one step ran behind the stop, its token dropped
    core.blocks.check([])
    assert core.blocks.num_free == core.blocks.num_usable


def test_async_scheduling_needs_tp1():
    from spanllm.engine.engine_core import EngineCore

    class _Runner:
        device = torch.device("cpu")

    with pytest.raises(ValueError, match="async_scheduling needs tp=1"):
        EngineCore(
            _Runner(),
            BlockManager(8, 4),
            SchedulerConfig(),
            vocab_size=8,
            eos_token_ids=(),
            tp_size=2,
            async_scheduling=True,
        )


# --- TP=2 over gloo ---------------------------------------------------------------------------------------
def test_tp2_equals_transformers_with_chunks_preemption_and_aborts(hf_checkpoint, hf_serving_reference):
    res = launch(tp_scenarios, hf_checkpoint[0], nprocs=2)[0]
    assert res["alone"] == hf_serving_reference
    assert _tokens(res["mixed"]) == hf_serving_reference
    assert res["preempt"]["preemptions"] > 0 and _tokens(res["preempt"]) == hf_serving_reference
    aborted_lengths = {0: 3, 3: 2}  # after the alone and mixed runs on the same engine: request 3's prefix cached
    for i, ref in enumerate(hf_serving_reference):
        r = res["abort"]["results"][i]
        assert r["tokens"] == (ref if i not in (0, 3) else ref[: aborted_lengths[i]]), (i, r)
        assert r["finish_reason"] == ("abort" if i in (0, 3) else "length"), (i, r)
    for k in ("mixed", "preempt", "abort"):
        assert res[k]["free_blocks"] == res[k]["usable_blocks"]


# --- bad requests: refused at admission, nothing else lost ---------------------------------------------------
@pytest.mark.parametrize(
    "prompt,params,match",
    [
        ([], SamplingParams(max_tokens=4), "the prompt is empty"),
        ([1, 250, 3], SamplingParams(max_tokens=4), r"prompt token 1 is 250, outside the vocabulary \[0, 250\)"),
        ([1, -1], SamplingParams(max_tokens=4), r"prompt token 1 is -1"),
        (
            list(range(1, 121)),
            SamplingParams(max_tokens=20),
            "maximum context length is 128 tokens. However, you "
            r"requested 140 tokens \(120 in the prompt, 20 for the",
        ),
        ([1, 2], SamplingParams(max_tokens=127), "maximum context length is 128"),
        ([1, 2], SamplingParams(max_tokens=4, stop_token_ids=(999,)), "stop_token_ids holds 999"),
        ([True, 2], SamplingParams(max_tokens=2), r"prompt token 0 is True \(bool\), not a token id"),
        ([1, 2.0], SamplingParams(max_tokens=2), r"prompt token 1 is 2.0 \(float\), not a token id"),
    ],
)
def test_bad_requests_are_refused_at_admission(tp1_llm, prompt, params, match):
    core = tp1_llm.engine_core
    with pytest.raises(RequestError, match=match):
        core.add_request(prompt, params)
    assert not core.has_unfinished()
    out = tp1_llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, ignore_eos=True))  # still serving
    assert len(out[0].output_ids) == 3


def test_request_that_never_fits_the_pool(hf_checkpoint):
    llm = LLM(hf_checkpoint[0], serving_config(num_kv_blocks=5))  # 16 tokens of pool
    with pytest.raises(RequestError, match="needs up to 20 tokens of KV cache but the whole pool holds 16"):
        llm.generate([[1] * 10], SamplingParams(max_tokens=10))
    assert not llm.engine_core.has_unfinished()


def test_min_tokens_refused_where_stop_ids_and_eos_forbid_every_token(tp1_llm):
    """Before min_tokens EOS and the stop ids are masked: stop ids covering every other id leave nothing to sample."""
    core = tp1_llm.engine_core
    vocab, eos = core.vocab_size, core.eos_token_ids
    others = tuple(t for t in range(vocab) if t not in eos)
    with pytest.raises(RequestError, match=f"stop_token_ids with the EOS ids cover all {vocab} tokens"):
        tp1_llm.generate([[5, 6]], SamplingParams(max_tokens=4, min_tokens=3, stop_token_ids=others))
    assert not core.has_unfinished()
    # ignore_eos leaves EOS samplable: the first 3 tokens are EOS (every other id masked), the 4th a stop id
    (eos_id,) = eos
    p = SamplingParams(max_tokens=4, min_tokens=3, stop_token_ids=others, ignore_eos=True)
    out = tp1_llm.generate([[5, 6]], p)[0]
    assert out.output_ids[:3] == [eos_id] * 3 and len(out.output_ids) == 4, out.output_ids
    assert out.finish_reason == "stop" and out.stop_reason == out.output_ids[3] and out.stop_reason in others
    # without min_tokens nothing is masked: the first token is a stop id or EOS, and ends the request
    out = tp1_llm.generate([[5, 6]], SamplingParams(max_tokens=4, stop_token_ids=others))[0]
    assert len(out.output_ids) == 1 and out.finish_reason == "stop", (out.output_ids, out.finish_reason)
    assert out.stop_reason == out.output_ids[0] and out.stop_reason in others, out.stop_reason


def test_generate_takes_integer_ids_of_any_kind(tp1_llm):
    """numpy and torch integer ids are token ids (as Python ints); bools and None are refused by name."""
    import numpy as np

    params = SamplingParams(max_tokens=3, ignore_eos=True)
    want = tp1_llm.generate([[5, 6, 7]], params)[0].output_ids
    for prompt in (np.array([5, 6, 7]), torch.tensor([5, 6, 7]), [np.int32(5), np.int64(6), 7]):
        assert tp1_llm.generate([prompt], params)[0].output_ids == want
    with pytest.raises(RequestError, match="a prompt is None"):
        tp1_llm.generate([None], params)
    assert not tp1_llm.engine_core.has_unfinished()


def test_generate_checks_every_request_before_admitting_any(tp1_llm):
    with pytest.raises(RequestError, match="outside the vocabulary"):
        tp1_llm.generate([[1, 2, 3], [4, 999]], SamplingParams(max_tokens=2))
    assert not tp1_llm.engine_core.has_unfinished()


@pytest.mark.parametrize(
    "kw,match",
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": "0.5"}, r"top_p='0.5' must be a number in \(0, 1\]"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"top_k": -5}, "top_k"),
        ({"min_tokens": 9, "max_tokens": 4}, "min_tokens"),
    ],
)
def test_sampling_params_out_of_range(kw, match):
    with pytest.raises(SamplingParamsError, match=match):
        SamplingParams(**kw)


# --- sampling and stopping ----------------------------------------------------------------------------------
def test_seeded_request_samples_the_same_whatever_shares_its_batch(tp1_llm):
    p = SamplingParams(temperature=1.0, top_k=20, top_p=0.9, seed=42, max_tokens=8, ignore_eos=True)
    other = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)
    alone_run = tp1_llm.generate([[5, 6, 7]], p)[0].output_ids
    crowd = tp1_llm.generate([[9, 9], [5, 6, 7], list(range(20, 40))], [other, p, other])
    assert crowd[1].output_ids == alone_run


def test_stop_token_ids_min_tokens_and_eos(tp1_llm, hf_serving_reference):
    ref = hf_serving_reference[0]  # greedy continuation of prompt 0 (10 tokens)
    stop = ref[3]
    first = ref.index(stop)
    out = tp1_llm.generate([SERVE_PROMPTS[0]], SamplingParams(max_tokens=10, stop_token_ids=(stop,)))[0]
    assert out.output_ids == ref[: first + 1] and out.finish_reason == "stop" and out.stop_reason == stop
    # min_tokens masks the stop id until that many tokens exist: greedy then takes the next best token.
    out = tp1_llm.generate([SERVE_PROMPTS[0]], SamplingParams(max_tokens=10, min_tokens=10, stop_token_ids=(stop,)))[0]
    assert len(out.output_ids) == 10 and stop not in out.output_ids and out.finish_reason == "length"


def test_text_prompts_stop_strings_and_detokenization():
    llm = LLM("tiny", serving_config(max_model_len=256))
    tok = llm.get_tokenizer()
    base = llm.generate(["héllo wörld"], SamplingParams(max_tokens=30, ignore_eos=True))[0]
    assert base.prompt_ids == tok.encode("héllo wörld") and base.text == tok.decode(base.output_ids)
    if len(base.text) < 6:
        pytest.skip("greedy output of the random tiny model is too short to cut")
    stop = base.text[3:5]
    cut = base.text.index(stop)
    out = llm.generate(["héllo wörld"], SamplingParams(max_tokens=30, ignore_eos=True, stop=[stop]))[0]
    assert out.text == base.text[:cut] and out.finish_reason == "stop" and out.stop_reason == stop


def test_stop_strings_need_text_output(tp1_llm):
    with pytest.raises(RequestError, match="stop strings need text output"):
        tp1_llm.engine_core.add_request([1, 2], SamplingParams(max_tokens=2, stop=["x"]))


def _stream(core, prompt: str, params) -> tuple[list[str], object]:
    """Deltas of one text request driven through EngineCore, and its final output."""
    ids = core.tokenizer.encode(prompt)
    seq = core.add_request(ids, params, with_text=True)
    deltas, final = [], None
    while final is None:
        for out in core.step():
            if out.request_id == seq.request_id:
                deltas.append(out.new_text)
                final = out if out.finished else None
    return deltas, final


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def tiny_text(request):
    """The tiny preset with its LM head restricted to printable ASCII bytes (other rows zeroed, these scaled
    up), so that its greedy output is readable text of the byte tokenizer. Both host loops (sync, async)."""
    llm = LLM("tiny", serving_config(max_model_len=256, async_scheduling=request.param))
    llm.get_tokenizer()
    with torch.no_grad():
        w = llm.model.lm_head.weight
        printable = torch.zeros(w.shape[0], dtype=torch.bool)
        printable[3 + 32 : 3 + 127] = True
        w[~printable] = 0.0
        w[printable] *= 10.0
    core = llm.engine_core
    base_deltas, base = _stream(core, "héllo wörld", SamplingParams(max_tokens=40, ignore_eos=True))
    assert len(base.text) == 40 and base.text.isprintable()  # one printable byte per token
    return core, base, base_deltas


def test_stream_deltas_join_to_the_text_and_hold_back_stop_prefixes(tiny_text):
    core, base, base_deltas = tiny_text
    assert "".join(base_deltas) == base.text
    stop = base.text[4:7]  # three characters, the first of them streamed before the rest exists
    cut = base.text.index(stop)
    deltas, out = _stream(core, "héllo wörld", SamplingParams(max_tokens=40, ignore_eos=True, stop=[stop]))
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == base.text[:cut] and "".join(deltas) == out.text  # no prefix of the stop leaked


def test_stop_strings_wait_for_min_tokens(tiny_text):
    """vLLM: no stop string is looked for before min_tokens; from then on each new piece of text is searched,
    so (one character per token here) the first match starting at character min_tokens - 1 or later ends it."""
    core, base, _ = tiny_text
    stop = base.text[0]
    out = _stream(core, "héllo wörld", SamplingParams(max_tokens=40, ignore_eos=True, stop=[stop], min_tokens=12))[1]
    cut = base.text.find(stop, 11)
    if cut == -1:
        assert out.finish_reason == "length" and out.text == base.text
    else:
        assert out.finish_reason == "stop" and out.stop_reason == stop
        assert out.text == base.text[:cut] and out.output_ids == base.output_ids[: cut + 1]


def test_a_stop_id_leaves_no_text(tiny_text):
    core, base, _ = tiny_text
    tok = core.tokenizer
    k = next(i for i, t in enumerate(base.output_ids) if 3 <= t < 128 + 3 and i > 0)  # an ASCII byte token
    stop_id = base.output_ids[k]
    first = base.output_ids.index(stop_id)
    out = _stream(core, "héllo wörld", SamplingParams(max_tokens=40, ignore_eos=True, stop_token_ids=(stop_id,)))[1]
    assert out.output_ids == base.output_ids[: first + 1] and out.stop_reason == stop_id
    assert out.text == tok.decode(base.output_ids[:first])


def test_a_refused_generate_leaves_nothing_queued(tp1_llm):
    core = tp1_llm.engine_core
    with pytest.raises(RequestError, match="stop strings need text output"):
        tp1_llm.generate([[5, 6, 7], [8, 9]], [SamplingParams(max_tokens=2), SamplingParams(max_tokens=2, stop=("x",))])
    assert not core.has_unfinished()
    gen0 = core.stats.generation_tokens
    tp1_llm.generate([[1, 2]], SamplingParams(max_tokens=3, ignore_eos=True))
    assert core.stats.generation_tokens - gen0 == 3


def test_engine_config_refuses_a_budget_below_the_sequence_cap():
    from spanllm.engine.config import EngineConfig

    with pytest.raises(ValueError, match="max_num_batched_tokens=8 is below max_num_seqs=16"):
        EngineConfig(max_num_seqs=16, max_num_batched_tokens=8)


def test_bench_host_runs_the_loop_it_times():
    """`spanllm bench host`: 4 requests of 8 prompt tokens fit one step's budget (prefill + first token), then
    4 more tokens take 4 decode steps: exactly 5 steps, 4 sequences each."""
    import argparse

    from spanllm.commands.bench_host import measure

    args = argparse.Namespace(
        requests=4,
        prompt_len=8,
        output_len=5,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        block_size=4,
        vocab=8,
        temperature=0.0,
    )
    r = measure(args)
    assert r["steps"] == 5 and r["mean_sampled_per_step"] == 4.0


def test_bench_host_families_and_the_prefix_policy():
    """`bench host --families 3`: 12 requests of 140 tokens, 132 of them shared per family (interleaved arrivals),
    4 running at a time. Both policies hit the same cached tokens (the token budget admits one uncached family
    prefix per step either way); under prefix the running sequences span fewer families per step."""
    import argparse

    from spanllm.commands.bench_host import measure

    rows = {}
    for policy in ("fcfs", "prefix"):
        args = argparse.Namespace(
            requests=12,
            prompt_len=140,
            output_len=3,
            max_num_seqs=4,
            max_num_batched_tokens=300,
            block_size=4,
            vocab=8,
            temperature=0.0,
            families=3,
            question_len=8,
            scheduling_policy=policy,
            enable_prefix_caching=True,
        )
        rows[policy] = measure(args)
    for r in rows.values():
        assert r["steps"] == 10 and r["prefix_cache_hit_rate"] == 1188 / (12 * 140)
    assert rows["fcfs"]["mean_families_running"] == 22 / 9
    assert rows["prefix"]["mean_families_running"] == 2.0


def test_graph_ladders_cover_every_size_with_little_padding():
    from spanllm.engine.worker.model_runner import bucket_ladder, token_ladder

    for max_tokens in (16, 100, 1024, 8192, 16384):
        ladder = token_ladder(max_tokens)
        assert ladder == sorted(set(ladder)) and ladder[-1] == max_tokens and ladder[0] <= 16
        for n in range(1, max_tokens + 1, 7):  # the bucket a step of n tokens pads to
            b = next(x for x in ladder if x >= n)
            assert b - n < (64 if n <= 1024 else 128 if n <= 2048 else 512), (max_tokens, n, b)
    assert bucket_ladder(256)[:5] == [1, 2, 4, 8, 16] and bucket_ladder(256)[-1] == 256
    assert all(b - a == 8 for a, b in zip(bucket_ladder(256)[4:], bucket_ladder(256)[5:]))


def test_mixed_graphs_stop_at_8192_tokens_larger_steps_run_eagerly():
    """A raised max_num_batched_tokens (long prompts in big chunks) keeps the mixed-graph ladder at 8,192 tokens:
    bigger steps run eagerly instead of each holding its activations in the graph pool."""
    from spanllm.engine.config import EngineConfig
    from spanllm.engine.llm import LLM
    from spanllm.engine.worker.model_runner import MIXED_GRAPH_MAX_TOKENS

    assert MIXED_GRAPH_MAX_TOKENS == 8192
    for chunk, top in ((32768, 8192), (4096, 4096)):
        llm = LLM("tiny", EngineConfig(max_num_batched_tokens=chunk, num_kv_blocks=64), device=torch.device("cpu"))
        try:
            runner = llm.engine_core.runner
            assert runner.max_tokens == top and runner.token_ladder[-1] == top
        finally:
            llm.close()


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_failed_step_loses_no_request(hf_checkpoint, hf_serving_reference, async_scheduling):
    """A step whose sampling fails for every row runs again (the same tokens come out); a request whose token
    fails to land (its detokenization, its stop strings) ends alone with finish_reason error (the engine goes
    on). Either way nothing waits forever and every block comes back."""
    llm = LLM(hf_checkpoint[0], serving_config(async_scheduling=async_scheduling))
    core = llm.engine_core
    seq = core.add_request(SERVE_PROMPTS[0], SamplingParams(max_tokens=10, ignore_eos=True))
    core.step()
    core.step()
    real = core.sampler.sample

    def boom(*a, **k):
        raise RuntimeError("transient")

    core.sampler.sample = boom
    with pytest.raises(RuntimeError, match="transient"):
        core.step()
    core.sampler.sample = real
    for _ in range(50):
        if not core.has_unfinished():
            break
        core.step()
    assert seq.output_ids == hf_serving_reference[0] and seq.finish_reason is FinishReason.LENGTH
    seq = core.add_request(SERVE_PROMPTS[1], SamplingParams(max_tokens=6, ignore_eos=True))
    core.step()
    core.step()
    real_append = core._append
    core._append = boom
    outs = []
    for _ in range(3):  # async: the token lands one step after it is sampled
        outs += core.step()
    core._append = real_append
    failed = [o for o in outs if o.finish_reason == "error"]
    assert [o.request_id for o in failed] == [seq.request_id] and "RuntimeError: transient" in failed[0].error
    for _ in range(50):
        if not core.has_unfinished():
            break
        core.step()
    assert not core.has_unfinished() and seq.finish_reason is FinishReason.ABORT
    core.blocks.check([])
    assert core.blocks.num_free == core.blocks.num_usable
