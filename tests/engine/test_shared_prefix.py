"""Shared-prefix decode attention (spanllm.attention.shared_prefix): the host plan, exactly, for planned block
tables; and the two kernels (stage 1 over each group's shared prefix, the decode kernel over each row's own keys
folding the partials in) under Triton's interpreter against the gather + SDPA reference, which reads every
row's whole context: groups whose prefix ends inside a key tile and on a block edge, several stage-1 splits,
rows in no group beside grouped ones, stage 2 with one and several splits, both key loops, a graph-sized unit
buffer with padding units. As in test_paged_kernels_interpreter.py, the kernel cases run in a child pytest
with TRITON_INTERPRET=1 (`test_interpreter_suite`)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from triton_interpreter import interpreted_module, run_child_suite

from spanllm.attention.shared_prefix import (
    max_units,
    members_per_group,
    plan_shared_prefix,
)

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
BS = 16


def _tables(rows: list[list[int]], width: int | None = None) -> np.ndarray:
    w = width or max(len(r) for r in rows)
    t = np.zeros((len(rows), w), np.int32)
    for i, r in enumerate(rows):
        t[i, : len(r)] = r
    return t


def test_plan_groups_rows_sharing_leading_blocks():
    """Rows 0, 2, 5 share blocks 10-13 (64 keys); rows 1, 4 share 20-22 then differ; row 3 shares nothing.
    min_keys 32: two groups, prefixes 64 and 48 keys; row 3 in none."""
    shared_a, shared_b = [10, 11, 12, 13], [20, 21, 22]
    rows = [
        shared_a + [30, 31],
        shared_b + [40],
        shared_a + [32],
        [50, 51, 52, 53],
        shared_b + [41, 42],
        shared_a + [33],
    ]
    ctx = np.array([6 * BS - 3, 4 * BS, 5 * BS + 1, 4 * BS, 6 * BS, 5 * BS], np.int32)
    plan = plan_shared_prefix(_tables(rows), ctx, BS, key_tile=64, min_keys=32, members=16, target_units=2)
    groups = sorted(tuple(int(x) for x in g if x >= 0) for g in plan.group_rows)
    assert groups == [(0, 2, 5), (1, 4)]
    assert plan.row_prefix.tolist() == [64, 48, 64, 0, 48, 64]
    assert plan.row_splits.tolist() == [1, 1, 1, 0, 1, 1]  # one tile each: no split
    units = sorted(map(tuple, plan.units.tolist()), key=lambda u: u[4])
    gi_b, gi_a = units[0][0], units[1][0]
    assert units == [(gi_b, 0, 0, 1, 48), (gi_a, 0, 0, 1, 64)]
    assert plan.keys_saved() == (3 - 1) * 64 + (2 - 1) * 48


def test_plan_keeps_each_rows_newest_key_and_respects_min_keys():
    """A row whose whole context is the shared blocks keeps its last block for stage 2 (prefix <= context - 1
    rounded down to a block); a prefix below min_keys is no group."""
    blocks = [1, 2, 3, 4]
    rows = [blocks, blocks + [5], blocks + [6]]
    ctx = np.array([4 * BS, 4 * BS + 2, 4 * BS + 9], np.int32)  # row 0: its newest key is in block 4
    plan = plan_shared_prefix(_tables(rows), ctx, BS, key_tile=64, min_keys=16, members=16)
    assert plan.row_prefix.tolist() == [3 * BS, 3 * BS, 3 * BS]
    assert plan_shared_prefix(_tables(rows), ctx, BS, key_tile=64, min_keys=4 * BS + 1, members=16).num_groups == 0
    # context 1 and 2-row minimum: nothing to plan
    assert plan_shared_prefix(_tables([[1], [1]]), np.array([1, 1], np.int32), BS, 64, min_keys=1).num_groups == 0


def test_plan_cuts_groups_at_members_and_splits_long_prefixes():
    """20 rows over one 40-block prefix, groups of at most 8: 8 + 8 + 4 rows; target 12 units over 3 groups:
    4 splits of the 10 key tiles (3 + 3 + 3 + 1) per group, and every unit's tiles inside the prefix."""
    prefix = list(range(100, 140))
    rows = [prefix + [200 + i] for i in range(20)]
    ctx = np.full(20, 41 * BS, np.int32)
    plan = plan_shared_prefix(_tables(rows), ctx, BS, key_tile=64, min_keys=64, members=8, target_units=12)
    sizes = sorted(int((g >= 0).sum()) for g in plan.group_rows)
    assert sizes == [4, 8, 8]
    assert set(plan.row_prefix.tolist()) == {640}
    for gi in range(3):
        mine = plan.units[plan.units[:, 0] == gi]
        assert mine[:, 1].tolist() == [0, 1, 2, 3]
        assert mine[:, 2:4].tolist() == [[0, 3], [3, 6], [6, 9], [9, 10]]
    assert plan.row_splits.tolist() == [4] * 20
    assert len(plan.units) <= max_units(20, 12)
    # a lone row after a full group of 8 is left out (a group needs two members)
    plan = plan_shared_prefix(_tables(rows[:9]), ctx[:9], BS, key_tile=64, min_keys=64, members=8)
    assert sorted(int((g >= 0).sum()) for g in plan.group_rows) == [8]
    assert int((plan.row_prefix == 0).sum()) == 1


def test_plan_never_exceeds_the_graph_buffer():
    """Random tables with several prefix families: units never exceed max_units, splits never max_splits,
    each group's rows really share its prefix's blocks, and a row's prefix leaves it a key."""
    rng = np.random.default_rng(0)
    for trial in range(200):
        b = int(rng.integers(2, 64))
        fams = [rng.integers(1, 10_000, size=int(rng.integers(1, 80))).tolist() for _ in range(int(rng.integers(1, 5)))]
        rows, ctx = [], []
        for _ in range(b):
            fam = fams[int(rng.integers(len(fams)))]
            keep = int(rng.integers(0, len(fam) + 1))
            own = rng.integers(20_000, 30_000, size=int(rng.integers(1, 5))).tolist()
            rows.append(fam[:keep] + own)
            ctx.append((len(rows[-1]) - 1) * BS + int(rng.integers(1, BS + 1)))
        t, c = _tables(rows), np.array(ctx, np.int32)
        target = int(rng.integers(1, 40))
        plan = plan_shared_prefix(
            t, c, BS, key_tile=64, min_keys=int(rng.integers(1, 300)), members=8, target_units=target
        )
        assert len(plan.units) <= max_units(b, target)
        assert plan.row_splits.max(initial=0) <= 8  # plan_shared_prefix's max_splits
        for g in plan.group_rows:
            members = [int(x) for x in g if x >= 0]
            assert len(members) >= 2
            p = int(plan.row_prefix[members[0]])
            assert p % BS == 0 and all(int(plan.row_prefix[m]) == p for m in members)
            nb = p // BS
            assert all((t[m, :nb] == t[members[0], :nb]).all() and p <= c[m] - 1 for m in members), trial


def test_members_per_group():
    assert [members_per_group(g) for g in (1, 2, 4, 6, 8, 64)] == [64, 32, 16, 8, 8, 1]


# --- the kernels, interpreted ------------------------------------------------------------------------------


@pytest.fixture
def kernels(monkeypatch):
    return interpreted_module(monkeypatch, "spanllm.kernels.paged_attention")


def _shared_pool(families: list[int], members: list[int], own: list[int], hkv: int, d: int, seed: int):
    """Row r belongs to family members[r] (-1: none) whose prefix has families[f] keys, all in whole blocks
    shared by the family's rows; then own[r] keys of its own. Block ids shuffled; block 0 unused."""
    g = torch.Generator().manual_seed(seed)
    fam_blocks = [-(-p // BS) for p in families]
    assert all(p % BS == 0 for p in families)
    own_blocks = [-(-k // BS) for k in own]
    total = sum(fam_blocks) + sum(own_blocks) + 1
    perm = (torch.randperm(total - 1, generator=g) + 1).tolist()
    fam_ids, i = [], 0
    for nb in fam_blocks:
        fam_ids.append(perm[i : i + nb])
        i += nb
    rows, ctx = [], []
    for f, k in zip(members, own):
        pre = fam_ids[f] if f >= 0 else []
        nb = -(-k // BS)
        rows.append(pre + perm[i : i + nb])
        i += nb
        ctx.append((families[f] if f >= 0 else 0) + k)
    kc = torch.randn(total, BS, hkv, d, generator=g)
    vc = torch.randn(total, BS, hkv, d, generator=g)
    return kc, vc, torch.from_numpy(_tables(rows)), np.array(ctx, np.int32)


def _device_plan(kernels, plan, units_rows: int | None = None):
    units = plan.units
    if units_rows is not None:  # a graph's buffer: padding units (t0 = t1) after the real ones
        pad = np.zeros((units_rows - len(units), 5), np.int32)
        units = np.concatenate([units, pad])
    return kernels.SharedPrefixTensors(
        torch.from_numpy(plan.group_rows.copy()),
        torch.from_numpy(np.ascontiguousarray(units)),
        torch.from_numpy(plan.row_prefix.copy()),
        torch.from_numpy(plan.row_splits.copy()),
    )


CASES = [
    # (families' prefix keys, family of each row, own keys of each row, stage-1 target units, stage-2 splits)
    ([96], [0, 0, 0], [1, 17, 70], 1, 1),  # prefix ends mid key tile (64 + 32)
    ([128, 48], [0, 1, 0, -1, 1, 0], [5, 1, 33, 90, 16, 64], 8, 1),  # two groups, a row in none, several splits
    ([256], [0, 0, -1, 0], [3, 130, 200, 64], 16, 4),  # stage 2 split and merged too
]


@pytest.mark.parametrize(
    "families,members,own,target,splits,kv_dtype",
    [(*c, torch.float32) for c in CASES] + [(*CASES[1], torch.float8_e4m3fn)],
)
@pytest.mark.parametrize("prefetch", [True, False])
def test_shared_prefix_decode_matches_reference(kernels, families, members, own, target, splits, kv_dtype, prefetch):
    """kv_dtype float8_e4m3fn: an FP8 cache (--kv-cache-dtype fp8), widened by both stages as they load it."""
    from spanllm.attention import reference as pa
    from spanllm.kernels import arrival_counters

    hq, hkv, d = 8, 2, 16
    kc, vc, tables, ctx = _shared_pool(families, members, own, hkv, d, seed=len(own) + target)
    kc, vc = (kc * 3).to(kv_dtype), (vc * 3).to(kv_dtype)
    plan = plan_shared_prefix(
        tables.numpy(), ctx, BS, kernels.BLOCK_N, min_keys=16, members=members_per_group(hq // hkv), target_units=target
    )
    assert plan.num_groups == len(families)  # every family is one group here
    q = torch.randn(len(own), hq, d, generator=torch.Generator().manual_seed(5))
    want = pa.reference_decode(q, kc, vc, tables, ctx.tolist())
    shared = _device_plan(kernels, plan, units_rows=len(plan.units) + 3)
    out = kernels.decode(q, kc, vc, tables, torch.from_numpy(ctx), splits, 1, prefetch=prefetch, shared=shared)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    assert arrival_counters.all_zero(q.device)


@pytest.mark.parametrize("graph", [False, True])
def test_shared_prefix_backend_step_matches_reference(kernels, graph):
    """The Triton backend's own path on CPU: an eager decode step (build_metadata plans the groups and hands them
    to the kernel) and the shared-prefix decode graph's buffers (prepare_decode_replay into a bucket of 8 with 3
    padding rows, then the graph's metadata), both against the reference; a step with no group replays the plain
    variant."""
    from spanllm.attention import reference as pa
    from spanllm.attention.triton import TritonBackend

    hq, hkv, d = 8, 2, 16
    kc, vc, tables, ctx = _shared_pool([64, 32], [0, 1, 0, -1, 1], [3, 40, 1, 50, 16], hkv, d, seed=9)
    q = torch.randn(len(ctx), hq, d, generator=torch.Generator().manual_seed(6))
    want = pa.reference_decode(q, kc, vc, tables, ctx.tolist())
    b = TritonBackend(hq, hkv, d, torch.device("cpu"), min_shared_keys=32, block_size=BS)
    assert "read them once per group" in b.describe(torch.float32)
    assert b.decode_graph_variants() == (False, True)
    nd = len(ctx)
    if not graph:
        cos = sin = torch.zeros(nd, 1, d)
        meta = b.build_metadata(
            nd, np.ones(nd, np.int32), ctx, tables.numpy(), cos, sin, torch.zeros(1), torch.from_numpy
        )
        assert meta.shared is not None and meta.shared.row_prefix.tolist() == [64, 32, 64, 0, 32]
        out = b.attend(q, kc, vc, meta)
    else:
        b.init_graphs(8, 64, tables.shape[1] + 2)
        b.reset_decode_graph()

        def put(dst, arr):
            dst.copy_(torch.from_numpy(np.ascontiguousarray(arr)))

        assert b.prepare_decode_replay(8, ctx, tables.numpy(), put) is True
        meta = b.decode_graph_metadata(8, None, None, None, shared=True)
        qpad = torch.cat([q, torch.zeros(3, hq, d)])
        out = b.attend(qpad, kc, vc, meta)[:nd]
        # no two rows share 32 keys: the plain variant, nothing planned
        lone = np.array([0, 3], np.int64)
        assert b.prepare_decode_replay(8, ctx[lone], tables.numpy()[lone], put) is False
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


INTERPRETER_TESTS = (len(CASES) + 1) * 2 + 2


def test_interpreter_suite():
    """The kernel cases again in a child pytest with TRITON_INTERPRET=1: every one must pass there."""
    if INTERPRETED:
        pytest.skip("this is the child")
    pytest.importorskip("triton")
    run_child_suite(__file__, INTERPRETER_TESTS, "matches_reference")
