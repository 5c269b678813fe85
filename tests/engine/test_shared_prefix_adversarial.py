"""Shared-prefix decode attention (spanllm.attention.shared_prefix), adversarial cases beside
test_shared_prefix.py's: the host plan for rows diverging at different depths (in every row order), prefixes
exactly at min_keys and at each row's context - 1 rounded down to a block, contexts of 0 and 1, block-table
columns past a row's context that hold equal ids, tables past SORT_BLOCKS, groups cut at `members`, units
against the graph buffers' sizes (max_units, bucket // 2 groups) and the kernel's partial buffers
(MAX_PREFIX_SPLITS); then the kernels under Triton's interpreter against the gather + SDPA reference with
poisoned memory around them: table columns past each row's blocks name a block of NaNs, and every buffer the
wrapper allocates (partials, output) starts as NaN inside NaN guard zones, so a read of a key, partial or
table column that the step does not own, an unwritten output row, or a write past a partial buffer fails the
case. G of 1, 2, 3, 8 and 32 (64 to 2 members per group), block sizes 8, 16 and 32, stage-1 splits capped at
1 and 3, stage 2 in one and several splits with both key loops, a row of context 0 in the batch, an eager
mixed step (decodes and a prefill chunk), and the backend's decode-graph buffers over replays of a changing
step (fewer groups and units than the replay before, buckets above the batch, a unit buffer filled exactly).
As in test_shared_prefix.py, the kernel cases run in a child pytest with TRITON_INTERPRET=1
(`test_interpreter_suite`)."""

from __future__ import annotations

import inspect
import itertools
import os

import numpy as np
import pytest
import torch
from triton_interpreter import interpreted_module, run_child_suite

from spanllm.attention.shared_prefix import (
    SORT_BLOCKS,
    max_units,
    members_per_group,
    plan_shared_prefix,
)

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
BS = 16


def _tables(rows: list[list[int]], width: int | None = None, fill: int = 0) -> np.ndarray:
    w = width or max(len(r) for r in rows)
    t = np.full((len(rows), w), fill, np.int32)
    for i, r in enumerate(rows):
        t[i, : len(r)] = r
    return t


def _groups(plan) -> list[tuple[int, ...]]:
    return sorted(tuple(sorted(int(x) for x in g if x >= 0)) for g in plan.group_rows)


def _check_plan(plan, tables: np.ndarray, ctx: np.ndarray, bs: int, key_tile: int, members: int, max_splits: int):
    """What the kernels rely on, exactly: each group's members (2 to `members`, each row in at most one group)
    share its prefix's blocks (within every member's own context, its newest key left out); units partition each
    group's key tiles [0, ceil(P / key_tile)) in split order 0..k-1, k = the members' row_splits <= max_splits;
    rows in no group have prefix 0 and no splits."""
    seen: set[int] = set()
    for gi, g in enumerate(plan.group_rows):
        mem = [int(x) for x in g if x >= 0]
        assert 2 <= len(mem) <= members and (g[: len(mem)] >= 0).all() and (g[len(mem) :] == -1).all()
        assert not seen & set(mem)
        seen |= set(mem)
        p = int(plan.row_prefix[mem[0]])
        assert p > 0 and p % bs == 0
        for m in mem:
            assert int(plan.row_prefix[m]) == p and p <= int(ctx[m]) - 1
            assert (tables[m, : p // bs] == tables[mem[0], : p // bs]).all()
        mine = plan.units[plan.units[:, 0] == gi]
        k = len(mine)
        assert 1 <= k <= max_splits and all(int(plan.row_splits[m]) == k for m in mem)
        assert mine[:, 1].tolist() == list(range(k)) and (mine[:, 4] == p).all()
        assert mine[0, 2] == 0 and mine[-1, 3] == -(-p // key_tile)
        assert (mine[1:, 2] == mine[:-1, 3]).all() and (mine[:, 3] > mine[:, 2]).all()
    rest = np.array(sorted(set(range(len(ctx))) - seen), np.int64)
    assert (plan.row_prefix[rest] == 0).all() and (plan.row_splits[rest] == 0).all()
    assert len(plan.units) == sum(int(plan.row_splits[int(g[0])]) for g in plan.group_rows)


# --- the host plan ------------------------------------------------------------------------------------------


def test_plan_rows_diverging_at_different_depths_in_every_order():
    """A shares 40 blocks with B, B shares 60 with C (C and A: 40), D shares 1 block with them: in each of the 24
    row orders, min_keys 2 blocks gives one group {A, B, C} over 40 blocks (the least common prefix of its members, a
    true common prefix of all three), min_keys 41 blocks gives {B, C} over 60 and A alone, and D is in none."""
    f = list(range(1000, 1100))
    rows = {"A": f[:40] + [1, 2], "B": f[:60] + [3, 4], "C": f[:80] + [5], "D": f[:1] + [6, 7, 8]}
    for order in itertools.permutations("ABCD"):
        t = _tables([rows[r] for r in order], width=90, fill=7)
        ctx = np.array([len(rows[r]) * BS for r in order], np.int32)
        idx = {r: i for i, r in enumerate(order)}
        plan = plan_shared_prefix(t, ctx, BS, 64, min_keys=2 * BS, members=16, target_units=1)
        assert _groups(plan) == [tuple(sorted(idx[r] for r in "ABC"))], order
        assert plan.row_prefix[[idx[r] for r in "ABCD"]].tolist() == [640, 640, 640, 0]
        assert plan.units.tolist() == [[0, 0, 0, 10, 640]]
        plan = plan_shared_prefix(t, ctx, BS, 64, min_keys=41 * BS, members=16, target_units=1)
        assert _groups(plan) == [tuple(sorted(idx[r] for r in "BC"))], order
        assert plan.row_prefix[[idx[r] for r in "ABCD"]].tolist() == [0, 960, 960, 0]
        assert plan.units.tolist() == [[0, 0, 0, 15, 960]]
        _check_plan(plan, t, ctx, BS, 64, 16, 8)


def test_plan_prefix_at_min_keys_and_at_context_minus_one():
    """Prefixes on the edges: a context of P + 1 keys keeps one key and shares P (P exactly min_keys: grouped;
    min_keys one more: not); a context that is a whole number of blocks (and of 64-key tiles) shares all but its
    last block; a context of exactly min_keys shares less than min_keys (no group)."""
    shared = list(range(10, 30))
    rows = [shared + [100 + i] for i in range(6)]
    t = _tables(rows)
    ctx = np.array([4 * BS + 1, 4 * BS + 1], np.int32)  # prefix 64 = min_keys: one key of its own each
    plan = plan_shared_prefix(t[:2], ctx, BS, 64, min_keys=64, members=8)
    assert plan.row_prefix.tolist() == [64, 64] and plan.units.tolist() == [[0, 0, 0, 1, 64]]
    assert plan_shared_prefix(t[:2], ctx, BS, 64, min_keys=65, members=8).num_groups == 0
    ctx = np.array([64, 64], np.int32)  # 4 blocks, one tile: the last block is the rows' own
    assert plan_shared_prefix(t[:2], ctx, BS, 64, min_keys=64, members=8).num_groups == 0
    plan = plan_shared_prefix(t[:2], ctx, BS, 64, min_keys=48, members=8)
    assert plan.row_prefix.tolist() == [48, 48]
    # 128 keys (two whole tiles), 129, 143, 144 and 145: 112, 128, 128, 128, 144 shareable; the group takes the least
    ctx = np.array([128, 129, 143, 144, 145], np.int32)
    plan = plan_shared_prefix(t[:5], ctx, BS, 64, min_keys=16, members=8, target_units=1)
    assert plan.row_prefix.tolist() == [112] * 5 and plan.units.tolist() == [[0, 0, 0, 2, 112]]
    plan = plan_shared_prefix(t[1:5], ctx[1:], BS, 64, min_keys=16, members=8, target_units=4)
    assert plan.row_prefix.tolist() == [128] * 4  # two tiles: one split (MIN_TILES_PER_SPLIT)
    assert plan.units.tolist() == [[0, 0, 0, 2, 128]]
    # min_keys not a multiple of the block: rounded up to whole blocks (100 keys -> 7 blocks = 112)
    ctx = np.array([7 * BS + 1, 7 * BS + 1], np.int32)
    assert plan_shared_prefix(t[:2], ctx, BS, 64, min_keys=100, members=8).row_prefix.tolist() == [112, 112]
    ctx = np.array([7 * BS, 7 * BS], np.int32)
    assert plan_shared_prefix(t[:2], ctx, BS, 64, min_keys=100, members=8).num_groups == 0


def test_plan_ignores_table_columns_past_each_context():
    """Columns past a row's context hold whatever the table was filled with (zeros, or ids equal across rows):
    rows that agree only there are no group, and a group's prefix stops at its members' contexts - 1."""
    same = list(range(50, 90))  # 40 equal ids in every row
    t = _tables([same, same, same])
    ctx = np.array([17, 20, 31], np.int32)  # one whole block before each newest key: 16 keys at most
    assert plan_shared_prefix(t, ctx, BS, 64, min_keys=32, members=8).num_groups == 0
    plan = plan_shared_prefix(t, ctx, BS, 64, min_keys=16, members=8)
    assert _groups(plan) == [(0, 1, 2)] and plan.row_prefix.tolist() == [16, 16, 16]
    # the real blocks differ at column 1; the tails (columns 2..) are equal garbage
    rows = [[5, 6] + same, [5, 7] + same]
    ctx = np.array([2 * BS, 2 * BS], np.int32)
    assert plan_shared_prefix(_tables(rows), ctx, BS, 64, min_keys=16, members=8).row_prefix.tolist() == [16, 16]
    assert plan_shared_prefix(_tables(rows), ctx, BS, 64, min_keys=32, members=8).num_groups == 0
    # a table many columns wider than any context (tails of zeros, or of an id the rows hold) plans exactly as a
    # trimmed one; rows 0 and 3 share only 10 and 3 of the 30 blocks rows 1 and 2 share: weak links (less than half
    # of a neighbouring pair's), left out rather than shrinking the group's prefix to theirs
    f = list(range(200, 260))
    rows = [f[:10] + [1], f[:30] + [2], f[:30] + [3], f[:4]]
    ctx = np.array([11 * BS, 31 * BS, 30 * BS + 5, 4 * BS], np.int32)
    a = plan_shared_prefix(_tables(rows), ctx, BS, 64, min_keys=32, members=8, target_units=8)
    b = plan_shared_prefix(_tables(rows, width=400, fill=0), ctx, BS, 64, min_keys=32, members=8, target_units=8)
    c = plan_shared_prefix(_tables(rows, width=400, fill=200), ctx, BS, 64, min_keys=32, members=8, target_units=8)
    for p in (b, c):
        assert _groups(p) == _groups(a) and np.array_equal(p.units, a.units)
        assert np.array_equal(p.row_prefix, a.row_prefix) and np.array_equal(p.row_splits, a.row_splits)
    assert _groups(a) == [(1, 2)] and a.row_prefix.tolist() == [0, 480, 480, 0] and a.keys_saved() == 480


def test_plan_context_zero_and_one_rows_are_never_grouped():
    """Mixed-step rows (context 0: not a decode) and one-key contexts share nothing, whatever their tables say."""
    f = list(range(300, 340))
    t = _tables([f, f, f, f, f])
    ctx = np.array([0, 40 * BS, 1, 40 * BS, 0], np.int32)
    plan = plan_shared_prefix(t, ctx, BS, 64, min_keys=16, members=8)
    assert _groups(plan) == [(1, 3)] and plan.row_prefix.tolist() == [0, 624, 0, 624, 0]
    assert plan.row_splits[[0, 2, 4]].tolist() == [0, 0, 0]
    assert plan_shared_prefix(t, np.array([0, 0, 1, 1, 0], np.int32), BS, 64, min_keys=1, members=8).num_groups == 0


def test_plan_members_more_than_rows_and_cut_groups():
    """members above the batch: one group padded with -1; 2 * members + 1 identical rows: two full groups in row
    order and the lone last row in none; members 2: pairs."""
    f = list(range(400, 420))
    t = _tables([f] * 17)
    ctx = np.full(17, 20 * BS, np.int32)
    plan = plan_shared_prefix(t[:3], ctx[:3], BS, 64, min_keys=16, members=64)
    assert plan.group_rows.shape == (1, 64) and plan.group_rows[0, :3].tolist() == [0, 1, 2]
    assert (plan.group_rows[0, 3:] == -1).all()
    plan = plan_shared_prefix(t, ctx, BS, 64, min_keys=16, members=8, target_units=2)
    assert plan.group_rows.tolist() == [list(range(8)), list(range(8, 16))]
    assert plan.row_prefix.tolist() == [304] * 16 + [0] and plan.row_splits.tolist() == [1] * 16 + [0]
    assert plan.units.tolist() == [[0, 0, 0, 5, 304], [1, 0, 0, 5, 304]]
    plan = plan_shared_prefix(t[:5], ctx[:5], BS, 64, min_keys=16, members=2, target_units=1)
    assert plan.group_rows.tolist() == [[0, 1], [2, 3]] and plan.row_prefix.tolist() == [304] * 4 + [0]
    assert plan_shared_prefix(t[:5], ctx[:5], BS, 64, min_keys=16, members=1).num_groups == 0


def test_plan_units_against_target_and_max_splits():
    """Units: fewer targets than groups: one each; max_splits 1: one each; a large target: splits of at least
    MIN_TILES_PER_SPLIT tiles, at most max_splits, tiles partitioned in order."""
    fams = [list(range(1000 * k, 1000 * k + 64)) for k in range(1, 5)]
    rows = [fams[i % 4] + [5000 + i] for i in range(8)]
    t = _tables(rows)
    ctx = np.full(8, 64 * BS + 3, np.int32)  # prefix 64 blocks = 1024 keys = 16 tiles
    plan = plan_shared_prefix(t, ctx, BS, 64, min_keys=16, members=8, target_units=3)
    assert _groups(plan) == [(0, 4), (1, 5), (2, 6), (3, 7)] and len(plan.units) == 4
    assert (plan.units[:, 1:4] == [0, 0, 16]).all()
    plan = plan_shared_prefix(t, ctx, BS, 64, min_keys=16, members=8, target_units=1000, max_splits=1)
    assert len(plan.units) == 4 and plan.row_splits.tolist() == [1] * 8
    plan = plan_shared_prefix(t, ctx, BS, 64, min_keys=16, members=8, target_units=1000, max_splits=8)
    assert plan.row_splits.tolist() == [8] * 8 and len(plan.units) == 32
    assert plan.units[plan.units[:, 0] == 0, 2:4].tolist() == [[2 * i, 2 * i + 2] for i in range(8)]
    plan = plan_shared_prefix(t, ctx, BS, 64, min_keys=16, members=8, target_units=12, max_splits=8)
    assert plan.row_splits.tolist() == [3] * 8  # 12 // 4 groups; 16 tiles as 6 + 6 + 4
    assert plan.units[plan.units[:, 0] == 2, 2:4].tolist() == [[0, 6], [6, 12], [12, 16]]
    # a short prefix: no split below MIN_TILES_PER_SPLIT tiles (3 tiles: 2 splits of 2 + 1)
    pair, short = t[[0, 4]], np.full(2, 12 * BS + 1, np.int32)
    plan = plan_shared_prefix(pair, short, BS, 64, min_keys=16, members=8)
    assert plan.units.tolist() == [[0, 0, 0, 2, 192], [0, 1, 2, 3, 192]]
    _check_plan(plan, pair, short, BS, 64, 8, 8)


def test_plan_tables_past_sort_blocks():
    """Tables wider than SORT_BLOCKS: rows equal in the sorted columns and diverging after them, at different
    depths, in an order the sort cannot see: one group over their least common prefix, a true one for all."""
    f = list(range(10_000, 10_400))
    x = f[:300] + [1]
    y = f[: SORT_BLOCKS + 4] + [2] * 40  # diverges from x at SORT_BLOCKS + 4
    z = f[:310] + [3]
    w = f[: SORT_BLOCKS - 1] + [4] * 60  # diverges inside the sorted columns
    for rows in ([x, y, z], [y, x, z], [z, y, x], [x, w, z, y]):
        t = _tables(rows)
        ctx = np.array([len(r) * BS for r in rows], np.int32)
        plan = plan_shared_prefix(t, ctx, BS, 64, min_keys=16, members=16, target_units=4)
        _check_plan(plan, t, ctx, BS, 64, 16, 8)
        want = SORT_BLOCKS - 1 if len(rows) == 4 else SORT_BLOCKS + 4
        assert _groups(plan) == [tuple(range(len(rows)))] and set(plan.row_prefix.tolist()) == {want * BS}


def _random_step(rng, b: int, max_depth: int = 80, garbage: int = 0):
    """b rows over a few nested families (a row takes a random depth of one, then 1-4 blocks of its own), the
    table's columns past each row's blocks filled with `garbage`; contexts anywhere in each row's last block."""
    fams = [rng.integers(1, 10_000, size=max_depth).tolist() for _ in range(int(rng.integers(1, 4)))]
    rows, ctx = [], []
    for _ in range(b):
        fam = fams[int(rng.integers(len(fams)))]
        rows.append(fam[: int(rng.integers(0, max_depth + 1))] + rng.integers(20_000, 30_000, 4).tolist())
        rows[-1] = rows[-1][: len(rows[-1]) - int(rng.integers(0, 4))]
        ctx.append((len(rows[-1]) - 1) * BS + int(rng.integers(1, BS + 1)))
    return _tables(rows, width=max(map(len, rows)) + int(rng.integers(0, 8)), fill=garbage), np.array(ctx, np.int32)


def test_plan_fits_every_graph_buffer():
    """Random steps (nested families, garbage tails, members 2 to 64, targets 1 to 300): units never exceed
    max_units(B, target) (the graph's unit buffer), groups never exceed max(1, B // 2) (its group_rows rows),
    splits never max_splits, and every plan is what the kernels rely on (_check_plan)."""
    rng = np.random.default_rng(7)
    for trial in range(300):
        b = int(rng.integers(2, 80))
        t, ctx = _random_step(rng, b, garbage=int(rng.choice([0, 1, 9999])))
        members = int(rng.choice([2, 4, 8, 16, 64]))
        target, max_splits = int(rng.integers(1, 300)), int(rng.integers(1, 9))
        min_keys = int(rng.choice([1, 16, 100, 512]))
        plan = plan_shared_prefix(
            t, ctx, BS, 64, min_keys=min_keys, members=members, target_units=target, max_splits=max_splits
        )
        assert len(plan.units) <= max_units(b, target), trial
        assert plan.num_groups <= max(1, b // 2), trial
        assert plan.group_rows.shape[1] == members and plan.row_splits.max(initial=0) <= max_splits
        _check_plan(plan, t, ctx, BS, 64, members, max_splits)


def test_plan_defaults_match_the_kernel_buffers():
    """The planner's default max_splits is the depth of the kernel's partial buffers (a split index past it would
    write into the next row's partials), and its key tile is the kernel's; members_per_group always gives a
    power of two (the stage-1 tile's rows are members x G_PAD, a tl.arange) with at least 16 rows where >= 2."""
    pytest.importorskip("triton")
    from spanllm.kernels import paged_attention as kt

    sig = inspect.signature(plan_shared_prefix)
    assert sig.parameters["max_splits"].default == kt.MAX_PREFIX_SPLITS
    assert kt.BLOCK_N == 64
    for g in range(1, 130):
        m = members_per_group(g)
        g_pad = 1 << (g - 1).bit_length()
        assert m & (m - 1) == 0 and (m < 2 or m * g_pad == 64)


def test_graph_buffers_hold_every_plan_and_padding_is_reset():
    """The decode-graph buffers (TritonBackend.init_graphs) over a sequence of random steps into random buckets
    (host only, no kernel): every plan fits its bucket's slices; after each replay the unit rows past the plan
    are zero (padding units: t0 = t1), the padding rows' prefix and splits are 0 and their contexts 1, and the
    group_rows rows the units name are this step's (rows past them may be stale: no unit names them)."""
    pytest.importorskip("triton")
    from spanllm.attention.triton import TritonBackend

    be = TritonBackend(8, 2, 16, torch.device("cpu"), min_shared_keys=32, block_size=BS)
    n = 48
    be.init_graphs(n, 64, 120)
    be.reset_decode_graph()
    st = be._decode

    def put(dst, arr):
        dst.copy_(torch.from_numpy(np.ascontiguousarray(arr)))

    rng = np.random.default_rng(3)
    replayed = 0
    for _ in range(150):
        b = int(rng.integers(1, n + 1))
        bucket = int(rng.choice([x for x in (1, 2, 4, 8, 16, 24, 32, 40, 48) if x >= b]))
        t, ctx = _random_step(rng, b, max_depth=100, garbage=int(rng.choice([0, 7])))
        variant = be.prepare_decode_replay(bucket, ctx, t, put)
        plan = be.plan_shared(ctx, t)
        assert variant == (plan is not None)
        assert st["ctx"][:bucket].tolist() == ctx.tolist() + [1] * (bucket - b)
        assert (st["tables"][b:bucket, : t.shape[1]] == 0).all()
        if not variant:
            continue
        replayed += 1
        meta = be.decode_graph_metadata(bucket, None, None, None, shared=True)
        sh = meta.shared
        u = len(plan.units)
        assert sh.units.shape[0] == max_units(bucket, be.target_units) >= u
        assert sh.units[:u].numpy().tolist() == plan.units.tolist() and (sh.units[u:] == 0).all()
        assert sh.group_rows.shape == (max(1, bucket // 2), be.members) and plan.num_groups <= sh.group_rows.shape[0]
        assert (sh.units[:u, 0] < plan.num_groups).all()
        assert np.array_equal(sh.group_rows[: plan.num_groups].numpy(), plan.group_rows)
        assert sh.row_prefix.tolist() == plan.row_prefix.tolist() + [0] * (bucket - b)
        assert sh.row_splits.tolist() == plan.row_splits.tolist() + [0] * (bucket - b)
    assert replayed >= 50


# --- the kernels, interpreted ------------------------------------------------------------------------------


@pytest.fixture
def kernels(monkeypatch):
    return interpreted_module(monkeypatch, "spanllm.kernels.paged_attention")


@pytest.fixture
def poisoned(monkeypatch):
    """torch.empty / empty_like give NaN-filled floating tensors inside NaN guard zones of 4,096 elements on
    each side (the wrapper's partials and output): returns check(), which asserts every guard is still NaN."""
    real_empty, real_like = torch.empty, torch.empty_like
    guards: list[tuple[torch.Tensor, torch.Tensor]] = []
    pad = 4096

    def guarded(t: torch.Tensor) -> torch.Tensor:
        if not t.is_floating_point() or t.numel() == 0:
            return t
        big = real_empty(t.numel() + 2 * pad, dtype=t.dtype, device=t.device).fill_(float("nan"))
        guards.append((big[:pad], big[-pad:]))
        return big[pad : pad + t.numel()].view(t.shape)

    monkeypatch.setattr(torch, "empty", lambda *a, **k: guarded(real_empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: guarded(real_like(*a, **k)))

    def check() -> None:
        assert guards, "nothing was allocated through torch.empty"
        for lo, hi in guards:
            assert torch.isnan(lo).all() and torch.isnan(hi).all(), "a kernel wrote past a buffer it owns"

    return check


POISON = 1  # block id whose keys and values are NaN: table columns past each row's blocks name it


def _pool(rows: list[list[int]], ctx: list[int], hkv: int, d: int, bs: int, seed: int):
    """rows: logical block ids per row (equal ids: the same physical block); each mapped to a distinct physical
    block >= 2 in a shuffled order. Returns (k, v, the kernel's table with POISON past each row's blocks, the
    reference's table with block 0 there, contexts)."""
    assert all(len(r) == -(-c // bs) for r, c in zip(rows, ctx) if c > 0)
    g = torch.Generator().manual_seed(seed)
    logical = sorted({x for r in rows for x in r})
    perm = (torch.randperm(len(logical), generator=g) + 2).tolist()
    phys = dict(zip(logical, perm))
    mapped = [[phys[x] for x in r] for r in rows]
    w = max(len(r) for r in rows) + 3
    kc = torch.randn(len(logical) + 2, bs, hkv, d, generator=g)
    vc = torch.randn(len(logical) + 2, bs, hkv, d, generator=g)
    kc[POISON] = float("nan")
    vc[POISON] = float("nan")
    poisoned_t = torch.from_numpy(_tables(mapped, width=w, fill=POISON))
    clean_t = torch.from_numpy(_tables(mapped, width=w, fill=0))
    return kc, vc, poisoned_t, clean_t, np.array(ctx, np.int32)


def _adversarial_rows(bs: int):
    """Family X: rows at depths 40, 60, 60 and 60 blocks (contexts a whole number of blocks, P + 1, a multiple of
    64 keys, and one block past 60); family Y: two rows sharing exactly 4 blocks with one key of their own
    (prefix = min_keys = 4 blocks); a one-key row; a row sharing X's first block only (below min_keys)."""
    x = list(range(100, 170))
    y = list(range(200, 204))
    own = iter(range(1000, 2000))

    def mine(k: int) -> list[int]:
        return [next(own) for _ in range(k)]

    tiled = 64 * -(-61 * bs // 64)  # the first multiple of 64 keys past 61 blocks
    rows = [
        x[:40] + mine(2),
        x[:60] + mine(1),
        x[:60] + mine(-(-tiled // bs) - 60),
        y + mine(1),
        y + mine(2),
        mine(1),
        x[:1] + mine(1),
        x[:60] + mine(1),
    ]
    ctx = [42 * bs, 60 * bs + 1, tiled, 4 * bs + 1, 5 * bs + 3, 1, 2 * bs - 2, 61 * bs]
    return rows, ctx


KERNEL_CASES = [
    # (G, KV heads, head dim, block size, target units, max splits, stage-2 splits, min tiles, prefetch)
    (1, 2, 16, 16, 32, 8, 1, 2, True),  # 64 members of one head each
    (2, 1, 32, 16, 1, 8, 3, 1, False),  # one unit per group; stage 2 split three ways and merged
    (8, 1, 16, 16, 64, 8, 4, 1, True),  # several stage-1 splits; stage 2 split and merged
    (8, 2, 16, 8, 64, 1, 2, 1, False),  # block 8; max_splits 1
    (32, 1, 16, 16, 8, 3, 2, 1, True),  # members 2: pairs; max_splits 3
    (3, 2, 16, 32, 16, 8, 1, 2, False),  # G 3 (padded to 4); block 32
]


@pytest.mark.parametrize("g,hkv,d,bs,target,max_splits,splits,min_tiles,prefetch", KERNEL_CASES)
def test_adversarial_decode_matches_reference(
    kernels, poisoned, g, hkv, d, bs, target, max_splits, splits, min_tiles, prefetch
):
    from spanllm.attention import reference as pa
    from spanllm.kernels import arrival_counters

    hq = g * hkv
    rows, ctx = _adversarial_rows(bs)
    kc, vc, tables, clean, ctx = _pool(rows, ctx, hkv, d, bs, seed=g + bs)
    members = members_per_group(g)
    plan = plan_shared_prefix(
        tables.numpy(),
        ctx,
        bs,
        kernels.BLOCK_N,
        min_keys=4 * bs,
        members=members,
        target_units=target,
        max_splits=max_splits,
    )
    _check_plan(plan, tables.numpy(), ctx, bs, kernels.BLOCK_N, members, max_splits)
    if members >= 4:
        assert plan.row_prefix.tolist() == [40 * bs] * 3 + [4 * bs] * 2 + [0, 0, 40 * bs]
    else:  # pairs: X's four rows in two pairs, Y's two in one
        assert plan.num_groups == 3 and (plan.row_prefix[[5, 6]] == 0).all()
    units = np.concatenate([plan.units, np.zeros((2, 5), np.int32)])  # two padding units, as in a graph
    shared = kernels.SharedPrefixTensors(
        torch.from_numpy(plan.group_rows.copy()),
        torch.from_numpy(units),
        torch.from_numpy(plan.row_prefix.copy()),
        torch.from_numpy(plan.row_splits.copy()),
    )
    q = torch.randn(len(ctx), hq, d, generator=torch.Generator().manual_seed(11))
    want = pa.reference_decode(q, kc, vc, clean, ctx.tolist())
    assert not torch.isnan(want).any()
    out = kernels.decode(q, kc, vc, tables, torch.from_numpy(ctx), splits, min_tiles, prefetch=prefetch, shared=shared)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    poisoned()
    assert arrival_counters.all_zero(q.device)


def test_context_zero_row_beside_groups_matches_reference(kernels, poisoned):
    """A row of context 0 (not a decode, as in a mixed-step graph) between grouped rows: its output row is left
    as it was, the others match the reference; a non-contiguous q (a view of a qkv row) and out (a view)."""
    from spanllm.attention import reference as pa

    hq, hkv, d = 8, 2, 16
    x = list(range(10, 30))
    rows = [x[:20] + [40], [50], x[:20] + [41], x[:12] + [42, 43]]
    ctx = [20 * BS + 5, 0, 21 * BS, 14 * BS]
    kc, vc, tables, clean, ctx = _pool(rows, ctx, hkv, d, BS, seed=4)
    plan = plan_shared_prefix(tables.numpy(), ctx, BS, kernels.BLOCK_N, min_keys=64, members=16, target_units=4)
    assert plan.row_prefix.tolist() == [192, 0, 192, 192] and plan.row_splits.tolist() == [2, 0, 2, 2]
    arrays = (plan.group_rows, plan.units, plan.row_prefix, plan.row_splits)
    shared = kernels.SharedPrefixTensors(*(torch.from_numpy(a.copy()) for a in arrays))
    qkv = torch.randn(4, hq + 2 * hkv, d, generator=torch.Generator().manual_seed(2))
    q = qkv[:, :hq]
    big = torch.full((6, hq, d), 7.0)
    out = big[1:5]
    kernels.decode(q, kc, vc, tables, torch.from_numpy(ctx), 2, 1, out=out, shared=shared)
    live = [0, 2, 3]
    want = pa.reference_decode(q[live].contiguous(), kc, vc, clean[live], ctx[live].tolist())
    torch.testing.assert_close(out[live], want, rtol=1e-5, atol=1e-5)
    assert (out[1] == 7.0).all() and (big[0] == 7.0).all() and (big[5] == 7.0).all()
    poisoned()


def test_eager_mixed_step_matches_reference(kernels, poisoned):
    """TritonBackend.build_metadata + attend for a step of five decodes (a group of three; two rows in none, one
    of them sharing the group's first block only) and one prefill chunk: the decode rows (their plan, q[:nd] and
    out[:nd]) and the chunk's rows match the reference."""
    from spanllm.attention import reference as pa
    from spanllm.attention.triton import TritonBackend

    hq, hkv, d = 4, 2, 16
    x = list(range(10, 30))
    rows = [x[:18] + [40], x[:18] + [41, 42], [43, 44], x[:18] + [45], x[:1] + [46, 47], x[:10] + [57, 58, 59]]
    ctx = [18 * BS + 1, 20 * BS, 2 * BS, 19 * BS, 3 * BS, 13 * BS]
    q_lens = np.array([1, 1, 1, 1, 1, 9], np.int32)
    kc, vc, tables, clean, ctx = _pool(rows, ctx, hkv, d, BS, seed=8)
    be = TritonBackend(hq, hkv, d, torch.device("cpu"), min_shared_keys=32, block_size=BS)
    n = int(q_lens.sum())
    cos = sin = torch.zeros(n, 1, d)
    meta = be.build_metadata(5, q_lens, ctx, tables.numpy(), cos, sin, torch.zeros(1), torch.from_numpy)
    assert meta.shared is not None and meta.shared.row_prefix.tolist() == [288, 288, 0, 288, 0]
    q = torch.randn(n, hq, d, generator=torch.Generator().manual_seed(3))
    out = be.attend(q, kc, vc, meta)
    want_d = pa.reference_decode(q[:5], kc, vc, clean[:5], ctx[:5].tolist())
    want_p = pa.reference_prefill(q[5:], kc, vc, clean[5:], [9], [int(ctx[5])])
    torch.testing.assert_close(out[:5], want_d, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out[5:], want_p, rtol=1e-5, atol=1e-5)
    poisoned()


def _family_step(fams: list[int], per_fam: list[int], own: list[int], tag: int):
    """Rows of families (family f's prefix: fams[f] blocks, logical ids tagged by `tag` so steps differ), per_fam
    rows each, then own[r] keys of row r's own."""
    rows, ctx, r = [], [], 0
    nxt = iter(range(tag * 10_000 + 5_000, tag * 10_000 + 9_000))
    for f, (nb, k) in enumerate(zip(fams, per_fam)):
        pre = list(range(tag * 10_000 + 100 * f, tag * 10_000 + 100 * f + nb))
        for _ in range(k):
            o = own[r]
            rows.append(pre + [next(nxt) for _ in range(-(-o // BS))])
            ctx.append(nb * BS + o)
            r += 1
    return rows, ctx


def test_graph_replay_sequence_matches_reference(kernels, poisoned):
    """One backend's decode-graph buffers over four replays (stage 2 in two splits): 16 rows in 8 pairs filling
    group_rows (bucket // 2 rows) and the unit buffer exactly (8 units); then 5 rows into the same bucket (11
    padding rows) in two groups, of 3 rows with 4 stage-1 splits and of 2 with one (stale groups and units of the
    replay before behind them); then 8 rows in bucket 8 in 4 pairs of 2 units each, max_units(8, 8) exactly; then
    3 rows with no group in bucket 8 (the plain variant): each matches the reference."""
    from spanllm.attention import reference as pa
    from spanllm.attention.triton import TritonBackend

    hq, hkv, d = 8, 2, 16
    be = TritonBackend(hq, hkv, d, torch.device("cpu"), min_shared_keys=32, block_size=BS)
    assert be.target_units == 8 and be.members == 16
    be.num_splits = lambda batch: 2
    steps = [
        (16, _family_step([2, 3, 2, 4, 2, 3, 2, 2], [2] * 8, [1, 5, 16, 17, 3, 64, 65, 2] * 2, 0)),
        (16, _family_step([40, 5], [3, 2], [1, 200, 64, 7, 9], 1)),
        (8, _family_step([12, 12, 9, 20], [2, 2, 2, 2], [130, 1, 16, 17, 33, 31, 2, 70], 2)),
        (8, _family_step([3, 1, 1], [1, 1, 1], [5, 140, 2], 3)),
    ]
    expect = [(8, 8), (2, 5), (4, 8), None]  # (groups, units) of each step's plan
    all_rows = [r for _, (rows, _) in steps for r in rows]
    all_ctx = [c for _, (_, ctx) in steps for c in ctx]
    kc, vc, tables, clean, ctx = _pool(all_rows, all_ctx, hkv, d, BS, seed=21)
    be.init_graphs(16, 64, tables.shape[1] + 4)
    be.reset_decode_graph()

    def put(dst, arr):
        dst.copy_(torch.from_numpy(np.ascontiguousarray(arr)))

    first = 0
    for (bucket, (rows, _)), exp in zip(steps, expect):
        sl = slice(first, first + len(rows))
        first += len(rows)
        t, c = tables[sl].numpy(), ctx[sl]
        variant = be.prepare_decode_replay(bucket, c, t, put)
        assert variant == (exp is not None)
        meta = be.decode_graph_metadata(bucket, None, None, None, shared=variant)
        if variant:
            plan = be.plan_shared(c, t)
            assert (plan.num_groups, len(plan.units)) == exp
            if exp != (2, 5):  # both buffers full
                assert plan.num_groups == meta.shared.group_rows.shape[0]
                assert len(plan.units) == meta.shared.units.shape[0]
        q = torch.randn(bucket, hq, d, generator=torch.Generator().manual_seed(bucket + first))
        out = be.attend(q, kc, vc, meta)[: len(rows)]
        want = pa.reference_decode(q[: len(rows)], kc, vc, clean[sl], c.tolist())
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    poisoned()


INTERPRETER_TESTS = len(KERNEL_CASES) + 3


def test_interpreter_suite():
    """The kernel cases again in a child pytest with TRITON_INTERPRET=1: every one must pass there."""
    if INTERPRETED:
        pytest.skip("this is the child")
    pytest.importorskip("triton")
    run_child_suite(__file__, INTERPRETER_TESTS, "matches_reference")


@pytest.mark.parametrize("outlier_block", [1, 99999])
def test_a_row_sharing_part_of_a_family_prefix_does_not_shrink_the_family(outlier_block):
    """8 rows share 128 blocks, a 9th only the first 32 (sorting puts it at the family's first or last place by
    its own block ids): the 8 form one group over 2,048 keys and the 9th is left out, wherever it sorts."""
    fam = list(range(1000, 1128))
    rows = [fam + [2000 + i] for i in range(8)] + [fam[:32] + [outlier_block]]
    ctx = np.array([129 * BS] * 8 + [33 * BS], np.int32)
    p = plan_shared_prefix(_tables(rows), ctx, BS, 64, min_keys=512, members=8)
    assert _groups(p) == [tuple(range(8))] and p.row_prefix.tolist() == [2048] * 8 + [0]
    assert p.keys_saved() == 7 * 2048


def test_plan_arguments_the_kernels_cannot_take_are_refused():
    t = np.tile(np.arange(1, 41, dtype=np.int32), (2, 1))
    ctx = np.array([641, 641], np.int32)
    with pytest.raises(ValueError, match=r"max_splits=0 must be in \[1, 8\]"):
        plan_shared_prefix(t, ctx, 16, 64, min_keys=16, members=8, max_splits=0)
    with pytest.raises(ValueError, match=r"max_splits=16 must be in \[1, 8\]"):
        plan_shared_prefix(t, ctx, 16, 64, min_keys=16, members=8, max_splits=16)
    with pytest.raises(ValueError, match="members=6 must be a power of two"):
        plan_shared_prefix(t, ctx, 16, 64, min_keys=16, members=6)
