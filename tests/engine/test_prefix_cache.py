"""Prefix caching without a model: block keys, lookup at every alignment, LRU eviction, the scheduler's budget
and hit counts for a planned sequence of requests, and a seeded random walk of thousands of operations that
checks, after each, that every hit reads the K/V its tokens would compute and that the accounting is exact."""

from __future__ import annotations

import random

import pytest
from scheduler_steps import run_step

from spanllm.engine.core.block_manager import BlockManager, hash_block
from spanllm.engine.core.scheduler import Scheduler, SchedulerConfig
from spanllm.engine.core.sequence import Sequence
from spanllm.engine.sampler import SamplingParams

BS = 4


def _seq(rid: str, tokens, max_tokens: int = 4) -> Sequence:
    return Sequence(rid, list(tokens), SamplingParams(max_tokens=max_tokens))


def _computed(bm: BlockManager, rid: str, tokens) -> Sequence:
    """A sequence that holds blocks for its tokens and has computed them all (then registered)."""
    s = _seq(rid, tokens)
    bm.grow(s, len(tokens))
    s.num_computed = len(tokens)
    bm.register(s)
    return s


def test_keys_chain_the_prefix():
    bm = BlockManager(32, BS)
    a = _seq("a", [1, 2, 3, 4, 5, 6, 7, 8])
    b = _seq("b", [9, 9, 9, 9, 5, 6, 7, 8])  # second block equal to a's, under another prefix
    ka, kb = bm.block_hashes(a, 2), bm.block_hashes(b, 2)
    assert ka[0] != kb[0] and ka[1] != kb[1]
    assert ka[1] == hash_block(ka[0], bytes(_int32([5, 6, 7, 8])))
    assert bm.block_hashes(_seq("c", [1, 2, 3, 4, 0]), 1) == ka[:1]  # same first block, same key


def _int32(ids):
    from array import array

    return array("i", ids).tobytes()


BASE = list(range(10, 30))  # 20 tokens: five full blocks


@pytest.mark.parametrize(
    "prompt, hit_blocks",
    [
        (BASE[:3] + [90, 91, 92, 93, 94], 0),  # shares less than a block
        (BASE[:4] + [90, 91, 92], 1),  # exactly one block
        (BASE[:5] + [90, 91, 92], 1),  # a block and one token
        (BASE[:9], 2),  # 9 tokens: two whole blocks cached, the ninth token computed
        (BASE[:8], 1),  # the whole prompt is cached: its last block is computed again (vLLM's rule)
        (BASE, 4),  # the same prompt: at most (20 - 1) // 4 blocks
        (BASE + [1, 2, 3], 5),  # longer: every cached block
        (BASE[:1], 0),
    ],
)
def test_lookup_at_every_alignment(prompt, hit_blocks):
    bm = BlockManager(32, BS)
    a = _computed(bm, "a", BASE)
    b = _seq("b", prompt)
    hits = bm.lookup(b)
    assert hits == a.block_table[:hit_blocks]
    assert bm.lookup(b) == hits  # lookup changes nothing
    bm.take(b, hits)
    assert [bm.ref_counts[x] for x in a.block_table[:hit_blocks]] == [2] * hit_blocks
    bm.check([a, b])
    bm.free(a)
    bm.free(b)
    bm.check([])
    assert bm.num_free == bm.num_usable and len(bm.evictable) == 5 and len(bm.cached) == 5


def test_only_computed_full_blocks_are_registered():
    bm = BlockManager(32, BS)
    s = _seq("a", BASE)
    bm.grow(s, 20)
    s.num_computed = 7  # a chunk of 7 ran: one full block computed
    bm.register(s)
    assert len(bm.cached) == 1
    assert bm.lookup(_seq("b", BASE)) == s.block_table[:1]
    s.num_computed = 20
    bm.register(s)
    assert len(bm.cached) == 5
    bm.free(s)
    bm.check([])


def test_disabled_caches_nothing():
    bm = BlockManager(32, BS, enable_prefix_caching=False)
    a = _computed(bm, "a", BASE)
    assert bm.lookup(_seq("b", BASE)) == [] and not bm.cached
    bm.free(a)
    assert len(bm.free_ids) == bm.num_usable and not bm.evictable
    bm.check([])


def test_eviction_is_lru_tail_first_and_only_when_the_free_list_is_empty():
    bm = BlockManager(9, BS)  # 8 usable blocks
    a = _computed(bm, "a", range(100, 108))  # blocks 1, 2
    b = _computed(bm, "b", range(200, 208))  # blocks 3, 4
    c = _computed(bm, "c", range(300, 306))  # blocks 5, 6 (6 half full: not registered)
    assert (a.block_table, b.block_table, c.block_table) == ([1, 2], [3, 4], [5, 6])
    bm.free(b)  # evictable: 4, 3 (tail first)
    bm.free(a)  # evictable: 4, 3, 2, 1
    bm.free(c)  # 6 to the free list, 5 evictable after 1
    assert list(bm.evictable) == [4, 3, 2, 1, 5] and sorted(bm.free_ids) == [6, 7, 8]
    hit = bm.lookup(_seq("a2", list(range(100, 108)) + [0]))
    assert hit == [1, 2]
    a2 = _seq("a2", list(range(100, 108)) + [0])
    bm.take(a2, hit)  # a hit takes blocks out of the pool
    assert list(bm.evictable) == [4, 3, 5]
    d = _seq("d", range(400, 424))
    bm.grow(d, 12)  # three blocks: the free list first
    assert d.block_table == [7, 8, 6] and bm.num_evictions == 0
    bm.grow(d, 20)  # two more: evict the least recently freed, b's tail block first
    assert d.block_table[3:] == [4, 3] and bm.num_evictions == 2
    assert bm.lookup(_seq("b2", list(range(200, 208)) + [0])) == []  # b is gone
    assert bm.lookup(_seq("c2", list(range(300, 306)))) == [5]  # c's first block is still there
    bm.free(a2)
    bm.free(d)
    bm.check([])


def test_reset_prefix_cache_keeps_blocks_in_use():
    bm = BlockManager(16, BS)
    a = _computed(bm, "a", BASE)
    b = _computed(bm, "b", range(50, 58))
    bm.free(b)
    assert bm.reset_prefix_cache() == 2
    assert bm.lookup(_seq("b2", range(50, 59))) == [] and len(bm.lookup(_seq("a2", BASE))) == 4
    bm.free(a)
    bm.check([])


# --- the scheduler: budget and hit counts ------------------------------------------------------------------


def _drain(sched: Scheduler, steps: int = 200) -> None:
    for _ in range(steps):
        if not sched.has_work():
            return
        run_step(sched, sched.schedule())
    raise AssertionError("did not drain")


def test_planned_requests_hit_exactly_and_cached_tokens_skip_the_budget():
    bm = BlockManager(64, BS)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=128), bm)
    a = _seq("a", BASE, max_tokens=2)
    sched.add(a)
    b = sched.schedule()
    assert [(s.request_id, n) for s, n in b.entries] == [("a", 20)]
    run_step(sched, b)
    # a's five blocks are registered at the next schedule; requests added now hit them in that step
    same, ext, one_block, short = (
        _seq("same", BASE, 1),
        _seq("ext", BASE + [1, 2, 3, 4, 5], 1),
        _seq("one", BASE[:4] + [99, 98], 1),
        _seq("short", BASE[:3] + [99], 1),
    )
    for s in (same, ext, one_block, short):
        sched.add(s)
    b = sched.schedule()
    assert [(s.request_id, n) for s, n in b.entries] == [
        ("a", 1),
        ("same", 4),  # 16 cached, the last block computed again
        ("ext", 5),  # 20 cached
        ("one", 2),  # 4 cached
        ("short", 4),  # nothing cached
    ]
    assert [s.num_cached_tokens for s in (same, ext, one_block, short)] == [16, 20, 4, 0]
    assert b.num_tokens == 16
    _drain(sched)
    assert sched.prefix_cache_queries == 20 + 20 + 25 + 6 + 4
    assert sched.prefix_cache_hits == 16 + 20 + 4
    bm.check([])
    # finished requests' blocks stay findable: a new request hits them (and outputs count: a's first output)
    again = _seq("again", BASE + [7, 1, 1, 1], 1)
    sched.add(again)
    _drain(sched)
    assert again.num_cached_tokens == 20 and sched.prefix_cache_hits == 40 + 20
    bm.check([])


def test_a_hit_on_evictable_blocks_counts_them_out_of_the_free_room():
    bm = BlockManager(7, BS)  # 6 usable blocks
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64), bm)
    sched.add(_seq("a", BASE[:16], max_tokens=1))
    _drain(sched)  # a's 4 full blocks evictable (the 17th position was never computed: a sampled 1 token)
    assert len(bm.evictable) == 4 and bm.num_free == 6
    # 16 cached + 9 more tokens = 7 blocks: the pool holds 6 (4 of them the hits), so only 8 tokens fit now
    big = _seq("big", BASE[:16] + list(range(60, 69)), max_tokens=1)
    sched.add(big)
    b = sched.schedule()
    assert [(s.request_id, n) for s, n in b.entries] == [("big", 8)]
    assert big.num_cached_tokens == 16 and bm.num_free == 0
    bm.check([big])
    sched.abort("big")
    bm.check([])
    assert bm.num_free == 6


def test_preempted_request_takes_its_own_blocks_back():
    bm = BlockManager(6, BS)  # 5 usable blocks
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64), bm)
    a, b = _seq("a", range(1, 4), max_tokens=6), _seq("b", range(40, 52), max_tokens=6)
    sched.add(a)
    sched.add(b)
    run_step(sched, sched.schedule())  # a: 1 block, b: 3 blocks
    run_step(sched, sched.schedule())  # b's 13th position takes the last free block
    assert bm.num_free == 0 and sched.num_preemptions == 0
    run_step(sched, sched.schedule())  # a needs a block: b (newest) is preempted; its 3 full blocks stay findable
    assert sched.num_preemptions == 1 and b.num_computed == 0 and len(bm.evictable) == 3
    _drain(sched)
    assert b.num_cached_tokens == 12  # re-admitted on its own blocks
    assert sched.prefix_cache_queries == 15 and sched.prefix_cache_hits == 0  # counted at first admissions only
    bm.check([])


# --- a random walk against a model of what the cache must hold ----------------------------------------------
class _KV:
    """What each slot of each block holds, as the prefix whose K/V it is (K/V at position p are a function of
    the tokens [0, p])."""

    def __init__(self, num_blocks: int) -> None:
        self.slots = [[None] * BS for _ in range(num_blocks)]

    def write(self, bm: BlockManager, seq: Sequence, start: int, stop: int) -> None:
        toks = seq.prompt_ids + seq.output_ids
        for p in range(start, stop):
            b = seq.block_table[p // BS]
            assert bm.ref_counts[b] == 1 and bm.block_keys[b] is None, "a write into a shared or findable block"
            self.slots[b][p % BS] = tuple(toks[: p + 1])

    def holds(self, seq: Sequence, blocks: list[int]) -> bool:
        toks = seq.prompt_ids + seq.output_ids
        return all(self.slots[b][i] == tuple(toks[: j * BS + i + 1]) for j, b in enumerate(blocks) for i in range(BS))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_walk_against_a_model(seed):
    rng = random.Random(seed)
    num_blocks = 24
    bm = BlockManager(num_blocks, BS)
    kv = _KV(num_blocks)
    live: list[Sequence] = []
    lru: list[int] = []  # the model's evictable pool, least recently freed first
    hits_total = 0
    for op in range(3000):
        r = rng.random()
        if r < 0.3 or not live:  # a new sequence: a few prompt families over a tiny alphabet, so prefixes repeat
            fam = rng.randrange(3)
            prompt = [fam] * rng.randrange(0, 6) + [rng.randrange(3) for _ in range(rng.randrange(1, 12))]
            s = _seq(f"s{op}", prompt)
            hits = bm.lookup(s)
            assert len(hits) <= (len(prompt) - 1) // BS
            assert kv.holds(s, hits), "a hit on blocks that hold another prefix's K/V"
            need = -(-len(prompt) // BS) - len(hits)
            if need > bm.num_free - bm.num_unreferenced(hits):
                continue  # refused: nothing may change
            for b in hits:
                if b in lru:
                    lru.remove(b)
            bm.take(s, hits)
            hits_total += len(hits)
            s.num_computed = len(hits) * BS
            _grow(bm, s, len(prompt), lru)
            kv.write(bm, s, s.num_computed, len(prompt))
            s.num_computed = len(prompt)
            live.append(s)
        elif r < 0.75:  # a decode: one more token computed
            s = rng.choice(live)
            s.output_ids.append(rng.randrange(3))
            if not bm.can_grow(s, s.num_tokens):
                continue
            _grow(bm, s, s.num_tokens, lru)
            kv.write(bm, s, s.num_computed, s.num_tokens)
            s.num_computed = s.num_tokens
        elif r < 0.98:  # finish, abort or preempt: the blocks go back
            s = live.pop(rng.randrange(len(live)))
            table = list(s.block_table)
            bm.free(s)
            for b in reversed(table):
                if bm.ref_counts[b] == 0 and bm.block_keys[b] is not None and b not in lru:
                    lru.append(b)
        else:
            bm.reset_prefix_cache()
            lru.clear()
        assert list(bm.evictable) == lru
        bm.check(live)
    for s in live:
        bm.free(s)
    bm.check([])
    assert bm.num_free == bm.num_usable and bm.num_evictions > 50 and hits_total > 100


def _grow(bm: BlockManager, seq: Sequence, n: int, lru: list[int]) -> None:
    """grow, checking the model's eviction rule: the free list first, then the least recently freed block."""
    free_before, evictions = len(bm.free_ids), bm.num_evictions
    need = bm.blocks_to_grow(seq, n)
    expect_evicted = lru[: max(0, need - free_before)]
    bm.grow(seq, n)
    assert bm.num_evictions - evictions == len(expect_evicted)
    if expect_evicted:
        assert seq.block_table[-len(expect_evicted) :] == expect_evicted
        del lru[: len(expect_evicted)]
