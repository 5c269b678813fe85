"""scheduling_policy="prefix" (spanllm.engine.core.scheduler): families of requests sharing a cached prompt prefix
are admitted first and together, oldest family first, within a bound on how often the oldest request is overtaken;
a family whose prefix a step computes waits for its first member's whole prompt (then it hits the cache instead of
computing the prefix again in parallel); preemption, aborts and finishes keep the
families in step with the waiting queue; a random walk ends with exact block accounting; greedy outputs are the
same as under fcfs; and the configurations that cannot work are refused."""

from __future__ import annotations

import argparse
import random

import pytest
import torch
from scheduler_steps import run_step
from test_prefix_cache import _drain

from spanllm.engine.core import scheduler as sched_mod
from spanllm.engine.core.block_manager import BlockManager
from spanllm.engine.core.scheduler import Scheduler, SchedulerConfig
from spanllm.engine.core.sequence import Sequence, SequenceStatus
from spanllm.engine.sampler import SamplingParams

BS = 4
FAMILY_BLOCKS = 2  # a family is the first 8 tokens here (monkeypatched: 32 blocks in the engine)
A, B, C = [1] * 8, [2] * 8, [3] * 8


@pytest.fixture(autouse=True)
def small_families(monkeypatch):
    monkeypatch.setattr(sched_mod, "PREFIX_FAMILY_BLOCKS", FAMILY_BLOCKS)


def _seq(rid: str, tokens, max_tokens: int = 2) -> Sequence:
    return Sequence(rid, list(tokens), SamplingParams(max_tokens=max_tokens))


def _admitted(batch) -> list[str]:
    return [s.request_id for s, _ in batch.entries[batch.num_decode :]]


def _scheduler(policy: str, blocks: int = 256, **kw) -> Scheduler:
    cfg = SchedulerConfig(
        max_num_seqs=16, max_num_batched_tokens=256, max_model_len=256, scheduling_policy=policy, **kw
    )
    return Scheduler(cfg, BlockManager(blocks, BS))


def _warm(sched: Scheduler, *prefixes) -> None:
    """Cache each prefix (one request per prefix run to its end)."""
    for i, p in enumerate(prefixes):
        sched.add(_seq(f"warm{i}", p + [90 + i], 1))
    _drain(sched, 500)


@pytest.mark.parametrize("policy", ["fcfs", "prefix"])
def test_cached_families_are_admitted_together_oldest_first(policy):
    sched = _scheduler(policy)
    _warm(sched, A, B, C)
    arrivals = [("a1", A), ("b1", B), ("a2", A), ("c1", C), ("x", [9] * 5), ("b2", B), ("a3", A)]
    for rid, p in arrivals:
        sched.add(_seq(rid, p + [50, 51, 52]))
    batch = sched.schedule()
    if policy == "fcfs":
        assert _admitted(batch) == [rid for rid, _ in arrivals]
    else:  # a1's family, then b1's, then c1's; x (a short prompt) in its place among the oldest
        assert _admitted(batch) == ["a1", "a2", "a3", "b1", "b2", "c1", "x"]
    assert all(s.num_cached_tokens == 8 for s, _ in batch.entries if s.request_id != "x")
    _drain(sched, 500)
    assert not sched.families and not sched.waiting
    sched.blocks.check([])


def test_a_family_whose_prefix_is_computed_this_step_waits_for_its_blocks():
    """Nothing cached: fcfs computes the shared prefix once per request admitted in the same step; prefix admits
    one request per family, and the rest hit the cache a step later."""
    hits = {}
    for policy in ("fcfs", "prefix"):
        sched = _scheduler(policy)
        for rid, p in [("a1", A), ("b1", B), ("a2", A), ("b2", B), ("a3", A)]:
            sched.add(_seq(rid, p + [50, 51]))
        first = sched.schedule()
        run_step(sched, first)
        second = sched.schedule()
        if policy == "fcfs":
            assert _admitted(first) == ["a1", "b1", "a2", "b2", "a3"] and _admitted(second) == []
        else:
            assert _admitted(first) == ["a1", "b1"]
            assert _admitted(second) == ["a2", "a3", "b2"]
            assert [s.num_cached_tokens for s, _ in second.entries[second.num_decode :]] == [8, 8, 8]
        run_step(sched, second)
        _drain(sched, 500)
        hits[policy] = sched.prefix_cache_hits
        sched.blocks.check([])
    assert hits == {"fcfs": 0, "prefix": 24}


def test_cached_families_overtake_an_older_uncached_request_within_the_bound():
    """Longest-prefix-match: an uncached request that is oldest waits while cached families are admitted whole,
    until max_num_seqs admissions have overtaken it; then it goes first. Per step: max_num_seqs = 4 here."""
    sched = Scheduler(
        SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=256, max_model_len=256, scheduling_policy="prefix"),
        BlockManager(256, BS),
    )
    _warm(sched, A, B)
    arrivals = [("x", [9] * 12)] + [(f"a{i}", A) for i in range(3)] + [(f"b{i}", B) for i in range(3)]
    for rid, p in arrivals:
        sched.add(_seq(rid, p + [50], max_tokens=1))
    order = []
    for _ in range(10):
        batch = sched.schedule()
        order.append(_admitted(batch))
        run_step(sched, batch)
        if not sched.waiting:
            break
    # step 1: family A (3) then b0 fill the 4 slots, overtaking x 4 times; step 2: x first, then b1, b2
    assert order[:2] == [["a0", "a1", "a2", "b0"], ["x", "b1", "b2"]]
    assert sched.prefix_cache_hits == 6 * 8
    _drain(sched, 500)
    sched.blocks.check([])


def test_a_family_waits_for_the_whole_prompt_of_the_member_computing_its_prefix():
    """The first member's prompt (shared part 24 tokens, beyond the 8-token family key) takes three chunks of
    8 tokens; the others wait for all of it and then hit all 24 shared tokens, not just the family key's 8."""
    sched = Scheduler(
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=8, max_model_len=256, scheduling_policy="prefix"),
        BlockManager(256, BS),
    )
    shared = list(range(10, 34))
    for i in range(3):
        sched.add(_seq(f"s{i}", shared + [60 + i], max_tokens=1))
    steps = []  # (request, tokens) of each step's prefills
    while sched.has_work():
        batch = sched.schedule()
        steps.append([(s.request_id, n) for s, n in batch.entries[batch.num_decode :]])
        run_step(sched, batch)
    # s0 in chunks of 8, 8, 8, then its last token (a one-token step runs as a decode, not listed); then s1 and
    # s2 each compute only their last token
    assert steps == [[("s0", 8)], [("s0", 8)], [("s0", 8)], [], [("s1", 1), ("s2", 1)]]
    assert sched.prefix_cache_hits == 2 * 24
    sched.blocks.check([])


def test_aborts_finishes_and_preemption_keep_families_in_step_with_the_queue():
    sched = _scheduler("prefix")
    _warm(sched, A)
    seqs = {rid: _seq(rid, A + [60 + i]) for i, rid in enumerate(["a1", "a2", "a3"])}
    for s in seqs.values():
        sched.add(s)
    family = seqs["a1"].family
    assert family is not None and list(sched.families[family]) == list(seqs.values())
    assert sched.abort("a2") is seqs["a2"]
    assert list(sched.families[family]) == [seqs["a1"], seqs["a3"]]
    short = _seq("short", [5, 5, 5])
    sched.add(short)
    assert short.family is None  # fewer than FAMILY_BLOCKS full blocks before its last token
    batch = sched.schedule()
    assert _admitted(batch) == ["a1", "a3", "short"] and not sched.families
    # a preempted family member goes back to the head of the queue and of its family
    victim = seqs["a3"]
    sched._preempt(victim, batch)
    assert sched.waiting[0] is victim and list(sched.families[family]) == [victim]
    assert victim.status is SequenceStatus.WAITING
    _drain(sched, 500)
    assert not sched.families
    sched.blocks.check([])


@pytest.mark.parametrize("seed", range(4))
def test_random_walk_under_the_prefix_policy(seed):
    """Random arrivals over a few families into a small pool (preemptions), random aborts: every request ends,
    the families mirror the waiting queue after every step, and the block accounting is exact at the end."""
    rng = random.Random(seed)
    sched = _scheduler("prefix", blocks=20)
    prefixes = [[10 + f] * (4 * rng.randint(1, 4)) for f in range(4)]
    live: list[Sequence] = []
    n = 0
    for _ in range(300):
        if rng.random() < 0.5 and n < 120:
            p = rng.choice(prefixes) + [rng.randint(100, 200) for _ in range(rng.randint(1, 9))]
            s = _seq(f"r{n}", p, max_tokens=rng.randint(1, 16))
            n += 1
            sched.add(s)
            live.append(s)
        if rng.random() < 0.05 and live:
            victim = rng.choice(live)
            if not victim.is_finished:
                sched.abort(victim.request_id)
        run_step(sched, sched.schedule())
        in_families = [s for fam in sched.families.values() for s in fam]
        assert sorted(map(id, in_families)) == sorted(id(s) for s in sched.waiting if s.family is not None)
    _drain(sched, 3000)
    assert all(s.is_finished for s in live)
    assert sched.num_preemptions > 0 and sched.prefix_cache_hits > 0  # the walk preempted and hit
    assert not sched.families
    sched.blocks.check([])


def test_configurations_refused():
    with pytest.raises(ValueError, match=r"scheduling_policy='lpm' must be one of \('fcfs', 'prefix'\)"):
        SchedulerConfig(scheduling_policy="lpm")
    with pytest.raises(ValueError, match="needs prefix caching on"):
        Scheduler(SchedulerConfig(scheduling_policy="prefix"), BlockManager(16, BS, enable_prefix_caching=False))
    from spanllm.commands.engine_args import (
        add_engine_arguments,
        add_model_arguments,
        check_engine_arguments,
        engine_config_from_args,
    )
    from spanllm.engine.config import EngineConfig
    from spanllm.errors import UsageError

    with pytest.raises(ValueError, match="needs enable_prefix_caching=True"):
        EngineConfig(scheduling_policy="prefix", enable_prefix_caching=False)
    ap = argparse.ArgumentParser()
    add_model_arguments(ap)
    add_engine_arguments(ap)
    args = ap.parse_args(["--model", "tiny", "--scheduling-policy", "prefix"])
    check_engine_arguments(args)
    assert engine_config_from_args(args, torch.device("cpu")).scheduling_policy == "prefix"
    bad = ap.parse_args(["--model", "tiny", "--scheduling-policy", "prefix", "--no-enable-prefix-caching"])
    with pytest.raises(UsageError, match="--scheduling-policy prefix .* drop --no-enable-prefix-caching"):
        check_engine_arguments(bad)


def test_engine_outputs_equal_under_both_policies(monkeypatch):
    """Greedy tokens per request are the same whichever order requests are admitted in (tiny model, CPU); the
    policies did admit them in different orders (the prefix policy groups the requests of one system prompt)."""
    from spanllm.engine.config import EngineConfig
    from spanllm.engine.llm import LLM

    rng = random.Random(0)
    systems = [[rng.randint(10, 200) for _ in range(40)] for _ in range(3)]
    prompts = [systems[i % 3] + [rng.randint(10, 200) for _ in range(rng.randint(1, 9))] for i in range(12)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    outs, orders = {}, {}
    for policy in ("fcfs", "prefix"):
        llm = LLM(
            "tiny",
            EngineConfig(dtype=torch.float32, max_num_seqs=8, max_num_batched_tokens=64, scheduling_policy=policy),
            device=torch.device("cpu"),
        )
        sched = llm.engine_core.scheduler
        real_schedule, order = sched.schedule, orders.setdefault(policy, [])

        def schedule(*a, real_schedule=real_schedule, order=order, **k):
            batch = real_schedule(*a, **k)
            order.append(_admitted(batch))  # the prefills (new or continued chunks) of each step, in order
            return batch

        monkeypatch.setattr(sched, "schedule", schedule)
        try:
            outs[policy] = [list(o.output_ids) for o in llm.generate(prompts, params)]
            if policy == "prefix":
                assert "scheduling policy prefix" in llm.describe()
        finally:
            llm.close()
    assert len(outs["fcfs"]) == 12 and outs["fcfs"] == outs["prefix"]
    assert orders["fcfs"] != orders["prefix"], orders
    # the order of first admission: fcfs by arrival; prefix takes the families (prompt i has system prompt i % 3)
    # together, after the two requests already admitted at the first step
    first = {
        p: [int(r.removeprefix("req-")) for r in dict.fromkeys(r for step in o for r in step)]
        for p, o in orders.items()
    }
    assert first["fcfs"] == list(range(12)), orders
    assert first["prefix"] == [0, 1, 3, 6, 9, 4, 7, 10, 2, 5, 8, 11], orders
