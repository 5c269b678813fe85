"""The host side of NVRAR, pure Python (no GPU): inter-node rounds, workspace layout, launch parameters."""

from __future__ import annotations

import math

import pytest
import torch

from spanllm.comm.base import AllReduceInputError
from spanllm.comm.nvrar.allreduce import (
    DEFAULT_ONE_SHOT_MAX_BYTES,
    SIMPLE_MIN_BLOCK,
    SUPPORTED_DTYPES,
    InterRound,
    LaunchParams,
    NvrarAllReduce,
    default_launch,
    elements_per_cell,
    inter_rounds,
    workspace_layout,
)
from spanllm.comm.schedule import recursive_doubling_schedule
from spanllm.comm.topology import Topology

MiB = 1 << 20


def rd_rounds(p: int) -> int:
    if p == 1:
        return 0
    p2 = 1 << (p.bit_length() - 1)
    return int(math.log2(p2)) + (0 if p == p2 else 2)


# --------------------------------------------------------------------------------------------------
# inter_rounds


@pytest.mark.parametrize("nodes", range(1, 10))
@pytest.mark.parametrize("g", [1, 2, 3])
def test_inter_rounds_match_recursive_doubling_schedule(nodes, g):
    topo = Topology(nodes * g, g)
    for rank in range(topo.world_size):
        rail = topo.rail_ranks(topo.local_rank(rank))
        idx = topo.node_of(rank)
        ref = recursive_doubling_schedule(idx, nodes, 1).rounds  # the schedule over rail positions
        want = [
            InterRound(
                rail[r.sends[0].peer] if r.sends else -1,
                rail[r.recvs[0].peer] if r.recvs else -1,
                bool(r.recvs) and r.recvs[0].op == "copy",
            )
            for r in ref
        ]
        got = inter_rounds(rank, topo)
        assert got == want, (nodes, g, rank)
        assert len(got) == rd_rounds(nodes)
        for r in got:  # every partner is on my rail, never myself
            assert r.send_peer in rail + [-1] and r.recv_peer in rail + [-1]
            assert rank not in (r.send_peer, r.recv_peer)


@pytest.mark.parametrize("nodes", [3, 5, 6, 7, 9])
def test_inter_rounds_fold_first_sends_last_overwrites(nodes):
    topo = Topology(nodes, 1)
    p2 = 1 << (nodes.bit_length() - 1)
    for extra in range(p2, nodes):
        rounds = inter_rounds(extra, topo)
        partner = extra - p2
        assert rounds[0] == InterRound(partner, -1, False)  # hand everything to the partner
        assert all(r == InterRound(-1, -1, False) for r in rounds[1:-1])  # sit out
        assert rounds[-1] == InterRound(-1, partner, True)  # receive the finished sum, overwrite
        prounds = inter_rounds(partner, topo)
        assert prounds[0] == InterRound(-1, extra, False)  # partner adds the extra's data
        assert prounds[-1] == InterRound(extra, -1, False)  # and returns the result
    # Only fold and unfold rounds may overwrite.
    for rank in range(nodes):
        assert [r.overwrite for r in inter_rounds(rank, topo)[:-1]] == [False] * (rd_rounds(nodes) - 1)


def test_inter_rounds_explicit_2x2_and_4x1():
    assert inter_rounds(1, Topology(4, 2)) == [InterRound(3, 3, False)]
    assert inter_rounds(0, Topology(4, 1)) == [InterRound(1, 1, False), InterRound(2, 2, False)]
    assert inter_rounds(3, Topology(4, 1)) == [InterRound(2, 2, False), InterRound(1, 1, False)]
    assert inter_rounds(0, Topology(2, 2)) == []


# --------------------------------------------------------------------------------------------------
# workspace_layout


TOPOS = [
    Topology(1, 1),
    Topology(2, 1),
    Topology(2, 2),
    Topology(4, 2),
    Topology(6, 2),
    Topology(8, 4),
    Topology(9, 3),
    Topology(16, 8),
]
MAX_BYTES = [1, 4, 1000, 4099, MiB, 8 * MiB, 8 * MiB + 3]
ONE_SHOT = [0, 4096, MiB, 16 * MiB]


@pytest.mark.parametrize("topo", TOPOS, ids=str)
def test_workspace_layout_disjoint_and_large_enough(topo):
    R = len(inter_rounds(0, topo))
    for max_bytes in MAX_BYTES:
        for os_max in ONE_SHOT:
            L = workspace_layout(topo, R, max_bytes, os_max)
            g = topo.ranks_per_node
            assert (L.G, L.R) == (g, R)
            assert L.slot % 64 == 0 and L.slot > 0
            shard_cells = -(-(-(-max_bytes // 4)) // g)  # noqa: B002 (two nested ceiling divisions)
            assert L.slot >= shard_cells
            if g > 1:
                assert L.slot >= -(-min(os_max, max_bytes) // 4)
            intra_slots = g if g > 1 else 0
            ss = L.simple_slot
            assert ss * 8 >= shard_cells * 4  # raw data: 4 bytes per cell
            regions = sorted(
                [
                    (L.intra, L.intra + intra_slots * L.slot),
                    (L.inter, L.inter + R * L.slot),
                    (L.stage, L.stage + R * L.slot),
                    (L.gather, L.gather + intra_slots * L.slot),
                    (L.simple_intra, L.simple_intra + intra_slots * ss),
                    (L.simple_inter, L.simple_inter + R * ss),
                    (L.simple_stage, L.simple_stage + R * ss),
                    (L.simple_gather, L.simple_gather + intra_slots * ss),
                ]
            )
            for (a0, a1), (b0, b1) in zip(regions, regions[1:]):  # noqa: B007
                assert a1 <= b0, (L, regions)
            assert regions[0][0] >= 0 and regions[-1][1] <= L.parity_cells
            assert L.parity_cells >= 64
            # SIMPLE flags: one word per (parity, region, tile of >= SIMPLE_MIN_BLOCK cells), after both halves.
            assert L.max_tiles == -(-L.slot // SIMPLE_MIN_BLOCK)
            assert L.flags == 2 * L.parity_cells and L.flag_cells == 2 * (2 * g + R) * L.max_tiles
            assert L.total_cells == 2 * L.parity_cells + L.flag_cells and L.total_bytes == 8 * L.total_cells


def test_workspace_layout_explicit_2x2_8MiB():
    L = workspace_layout(Topology(4, 2), 1, 8 * MiB, MiB)
    slot = 1 << 20  # 2 Mi cells of 4 data bytes, halved by 2 local ranks
    assert (L.slot, L.intra, L.inter, L.stage, L.gather, L.parity_cells) == (
        slot,
        0,
        2 * slot,
        3 * slot,
        4 * slot,
        9 * slot,
    )
    half = slot // 2  # SIMPLE's own slots after LL8's: raw data needs half the bytes
    assert (L.simple_slot, L.simple_intra, L.simple_inter, L.simple_stage, L.simple_gather) == (
        half,
        6 * slot,
        7 * slot,
        7 * slot + half,
        8 * slot,
    )
    assert L.offsets("ll8") == (0, 2 * slot, 3 * slot, 4 * slot, slot)
    assert L.offsets("simple") == (6 * slot, 7 * slot, 7 * slot + half, 8 * slot, half)
    assert L.max_tiles == slot // 256 and L.flag_cells == 2 * 5 * (slot // 256)
    assert L.total_bytes == 144 * MiB + 8 * 2 * 5 * 4096


def test_workspace_layout_one_shot_sizes_the_slot():
    # One-shot moves whole messages: with 4 local ranks and a 1 MiB one-shot limit, the slot holds 256 Ki cells,
    # more than the 128 Ki cells of a reduce-scatter shard of 2 MiB.
    L = workspace_layout(Topology(4, 4), 0, 2 * MiB, MiB)
    assert L.slot == 256 * 1024
    assert L.inter == L.stage == L.gather == 4 * L.slot
    assert L.parity_cells == 8 * L.slot + 8 * L.simple_slot  # LL8's 8 slots, then SIMPLE's 8 half-size ones


def test_workspace_layout_one_rank_per_node_has_no_intra_slots():
    L = workspace_layout(Topology(4, 1), 2, 4096, MiB)
    assert (L.slot, L.intra, L.inter, L.stage, L.gather) == (1024, 0, 0, 2048, 4096)
    assert (L.simple_slot, L.simple_inter, L.simple_stage, L.parity_cells) == (512, 4096, 5120, 6144)


def test_workspace_layout_minimum_parity():
    assert workspace_layout(Topology(1, 1), 0, 4, 4).parity_cells == 64


# --------------------------------------------------------------------------------------------------
# LaunchParams and default_launch


def test_launch_params_defaults_and_short():
    assert LaunchParams() == LaunchParams(False, 16, 512, 4)
    assert LaunchParams().short() == "rs/b16x512w4"
    assert LaunchParams(True, 8, 256, 2).short() == "os/b8x256w2"


@pytest.mark.parametrize(
    "kw,needle",
    [
        ({"block": 8}, "block=8 cells must be a power of two >= 16"),
        ({"block": 48}, "block=48 cells must be a power of two >= 16"),
        ({"block": 0}, "block=0 cells must be a power of two >= 16"),
        ({"num_blocks": 0}, "num_blocks=0 must be in [1, 1024]"),
        ({"num_blocks": 1025}, "num_blocks=1025 must be in [1, 1024]"),
        ({"num_warps": 3}, "num_warps=3 must be one of 1, 2, 4, 8, 16"),
        ({"num_warps": 32}, "num_warps=32 must be one of 1, 2, 4, 8, 16"),
    ],
)
def test_launch_params_validation(kw, needle):
    with pytest.raises(ValueError) as e:
        LaunchParams(**kw)
    assert needle in str(e.value)


def test_launch_params_limits_accepted():
    """The limits themselves are accepted as given: nothing clamped, swapped or defaulted."""
    lo = LaunchParams(num_blocks=1, block=16, num_warps=1)
    assert (lo.num_blocks, lo.block, lo.num_warps, lo.one_shot, lo.protocol) == (1, 16, 1, False, "ll8")
    assert lo.short() == "rs/b1x16w1"
    hi = LaunchParams(num_blocks=1024, block=1 << 14, num_warps=16)
    assert (hi.num_blocks, hi.block, hi.num_warps, hi.one_shot, hi.protocol) == (1024, 16384, 16, False, "ll8")
    assert hi.short() == "rs/b1024x16384w16"


@pytest.mark.parametrize("nbytes", [2, 8, 1000, 64 << 10])
def test_default_launch_one_shot_for_small_messages_inside_a_node(nbytes):
    assert default_launch(nbytes, Topology(4, 2)).one_shot is True
    assert default_launch(nbytes, Topology(8, 8)).one_shot is True
    # One rank per node has nothing to exchange inside the node.
    assert default_launch(nbytes, Topology(2, 1)).one_shot is False
    assert default_launch(nbytes, Topology(1, 1)).one_shot is False


@pytest.mark.parametrize("nbytes", [(64 << 10) + 1, MiB, 8 * MiB])
def test_default_launch_reduce_scatter_for_larger_messages(nbytes):
    assert default_launch(nbytes, Topology(4, 2)).one_shot is False


def test_default_launch_respects_one_shot_limit():
    assert default_launch(4096, Topology(4, 2), one_shot_max_bytes=1024).one_shot is False
    assert default_launch(1024, Topology(4, 2), one_shot_max_bytes=1024).one_shot is True


def test_default_launch_tiles():
    assert default_launch(8, Topology(4, 2)) == LaunchParams(True, 1, 256, 4)
    # 1 MiB over 2 local ranks: 512 KiB shard = 128 Ki cells, 1024-cell tiles, capped at 64 blocks.
    assert default_launch(MiB, Topology(4, 2)) == LaunchParams(False, 64, 1024, 8)
    # 64 KiB one-shot: 16 Ki cells -> 16 tiles of 1024.
    assert default_launch(64 << 10, Topology(4, 2)) == LaunchParams(True, 16, 1024, 8)
    # 16 KiB, one rank per node: 4 Ki cells fit 256-cell tiles, 16 of them.
    assert default_launch(16 << 10, Topology(2, 1)) == LaunchParams(False, 16, 256, 4)
    assert DEFAULT_ONE_SHOT_MAX_BYTES == MiB


def test_default_launch_always_valid():
    for topo in TOPOS:
        for nbytes in [0, 1, 2, 3, 4, 1023, 4096, 65536, 65537, MiB, 8 * MiB, 1 << 30]:
            p = default_launch(nbytes, topo)
            assert 1 <= p.num_blocks <= 64 and p.block in (256, 1024)


# --------------------------------------------------------------------------------------------------
# cells and dtypes


def test_elements_per_cell():
    assert elements_per_cell(torch.float32) == 1
    assert elements_per_cell(torch.int32) == 1
    assert elements_per_cell(torch.bfloat16) == 2
    assert elements_per_cell(torch.float16) == 2


@pytest.mark.parametrize("dtype,size", [(torch.float64, 8), (torch.int64, 8), (torch.int8, 1), (torch.uint8, 1)])
def test_elements_per_cell_rejects_other_sizes(dtype, size):
    with pytest.raises(
        AllReduceInputError, match=rf"dtype {dtype} has {size}-byte elements; LL8 cells carry 2- or 4-byte"
    ):
        elements_per_cell(dtype)


def test_nvrar_capability_is_gpu_only():
    cap = NvrarAllReduce.capability
    assert cap.device_types == frozenset({"cuda"})
    assert cap.dtypes == SUPPORTED_DTYPES == frozenset({torch.float32, torch.bfloat16, torch.float16, torch.int32})
    for dtype in SUPPORTED_DTYPES:
        assert elements_per_cell(dtype) in (1, 2)


def test_launch_params_protocol_validation():
    assert LaunchParams(protocol="simple", block=256).short().endswith("/simple")
    assert LaunchParams().protocol == "ll8" and "/simple" not in LaunchParams().short()
    with pytest.raises(ValueError, match="protocol='ll16' must be one of"):
        LaunchParams(protocol="ll16")
    with pytest.raises(ValueError, match="needs block >= 256 cells"):
        LaunchParams(protocol="simple", block=128)


def test_pipelined_launch_is_named_and_tuned_only_where_programs_hold_several_tiles():
    from argparse import Namespace

    from spanllm.commands.tune import nvrar_grid

    assert LaunchParams(pipelined=True).short() == "rs/b16x512w4/pipe"
    assert LaunchParams(protocol="simple", block=256, pipelined=True).short().endswith("/simple/pipe")
    args = Namespace(protocols="ll8", blocks="1,4", tiles="256", pipelined="0,1")
    topo = Topology(2, 1)  # 2 nodes x 1: the shard is the whole message
    # 4 KiB = 1024 cells = 4 tiles of 256: 1 program holds 4 tiles (pipelined is offered), 4 programs hold 1 each (not)
    grid = [p.short() for p in nvrar_grid(args, topo, 4096, 1 << 20)]
    assert grid == ["rs/b1x256w4", "rs/b1x256w4/pipe", "rs/b4x256w4"]
    # 1 KiB = 1 tile: nothing to pipeline
    assert [p.short() for p in nvrar_grid(args, topo, 1024, 1 << 20)] == ["rs/b1x256w4"]


def test_tuning_tables_without_the_pipelined_field_still_load(tmp_path):
    import json

    import torch

    from spanllm.comm.tuning import TuningTable

    old = {
        "kind": "tuning",
        "entries": [
            {
                "topology": "2x1",
                "dtype": "bfloat16",
                "size": 4096,
                "best": "nvrar",
                "nvrar_launch": {"one_shot": False, "num_blocks": 4, "block": 256, "num_warps": 4, "protocol": "ll8"},
                "times_us": {},
            }
        ],
    }
    path = tmp_path / "t.json"
    path.write_text(json.dumps(old))
    p = TuningTable.load(str(path)).nvrar_launch(4096, torch.bfloat16, Topology(2, 1))
    assert p == LaunchParams(num_blocks=4, block=256, num_warps=4) and p.pipelined is False
