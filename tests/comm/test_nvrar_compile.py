"""Ahead-of-time compilation of nvrar kernels (spanllm.comm.nvrar.compile), host side, no GPU: the
specialisations it compiles are exactly those a real launch asks for, deduplicated, rank-independent."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from spanllm.comm.nvrar.allreduce import LaunchParams, NvrarAllReduce, elements_per_cell, inter_rounds, workspace_layout
from spanllm.comm.nvrar.compile import (
    _canonical,
    _host_share,
    launches_for_sizes,
    marker_name,
    not_yet_compiled,
    nvrar_members,
    precompile,
    specialisations,
)
from spanllm.comm.topology import Topology


def stub_comm(rank: int, topo: Topology, max_bytes: int = 1 << 20, launch=None) -> NvrarAllReduce:
    """An NvrarAllReduce with its host state on CPU and no GPU resources (kernel_arguments and launch_for
    only read these fields)."""
    c = object.__new__(NvrarAllReduce)
    c.topology, c.rank, c.timeout_s, c.tuning, c.fixed_launch = topo, rank, 30.0, None, launch
    c.group = None
    c._max_bytes, c.one_shot_max_bytes, c.trace_enabled = max_bytes, max_bytes, False
    c.rounds = inter_rounds(rank, topo)
    c.layout = workspace_layout(topo, len(c.rounds), max_bytes, max_bytes)
    c.node_first_rank = topo.rank_of(topo.node_of(rank), 0)
    c.ws = torch.zeros(4, dtype=torch.int64)
    c.peer_ptrs = torch.zeros(topo.ranks_per_node, dtype=torch.int64)
    c.round_send_pe = c.round_recv_peer = c.round_recv_op = torch.zeros(1, dtype=torch.int32)
    c.seq, c.ticket = torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    c.err, c.trace = torch.zeros(8, dtype=torch.int64), torch.zeros((1, 9), dtype=torch.int64)
    return c


def test_canonical_keeps_what_triton_specialises_on():
    assert _canonical(torch.zeros(3, dtype=torch.bfloat16)) is torch.bfloat16
    assert _canonical(7) == _canonical(123456) == 1  # i32
    assert _canonical(2**31) == _canonical(2**40 + 3) == 2**40  # i64
    assert _canonical(True) is True and _canonical(False) is False


def test_num_blocks_is_not_a_specialisation_but_dtype_tile_order_and_mode_are():
    c = stub_comm(0, Topology(2, 2))
    same = [(LaunchParams(num_blocks=b, block=256), torch.bfloat16) for b in (1, 8, 64)]
    assert len(specialisations(c, same)) == 1
    different = [
        (LaunchParams(block=256), torch.bfloat16),
        (LaunchParams(block=256), torch.float16),
        (LaunchParams(block=256), torch.float32),
        (LaunchParams(block=1024, num_warps=8), torch.bfloat16),
        (LaunchParams(block=256, pipelined=True), torch.bfloat16),
        (LaunchParams(block=256, one_shot=True), torch.bfloat16),
        (LaunchParams(block=256, protocol="simple"), torch.bfloat16),
    ]
    assert len(specialisations(c, different)) == 7


@pytest.mark.parametrize("topo", [Topology(2, 2), Topology(2, 1), Topology(4, 2), Topology(6, 2)])
def test_ranks_of_one_shape_need_the_same_kernels(topo):
    """Ranks differ only in int arguments (rank, peers), so a host can split one list among its ranks.
    (With a fold, ranks outside the power-of-two core run a different number of rounds R.)"""
    pairs = [(LaunchParams(block=256), torch.bfloat16), (LaunchParams(block=1024, num_warps=8), torch.int32)]
    by_rounds: dict[int, list] = {}
    for r in range(topo.world_size):
        c = stub_comm(r, topo)
        by_rounds.setdefault(len(c.rounds), []).append(specialisations(c, pairs))
    for specs in by_rounds.values():
        assert all(s == specs[0] for s in specs)


@pytest.mark.parametrize("n", [1, 7, 4097, 65_537, 262_147])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int32])
def test_precompiled_specialisation_is_the_one_a_real_call_launches(n, dtype):
    """The canonical form of a real launch's arguments (a tensor of n elements, its real shard) equals the
    spec compiled from the dtype alone."""
    topo = Topology(2, 2)
    c = stub_comm(1, topo)
    x = torch.zeros(n, dtype=dtype)
    p = c.launch_for(x)
    cells = -(-n // elements_per_cell(dtype))
    shard = cells if p.one_shot else -(-cells // topo.ranks_per_node)
    args, constexprs = c.kernel_arguments(x, p, n, shard)
    real = (tuple(_canonical(a) for a in args), tuple(sorted(constexprs.items())))
    assert specialisations(c, [(p, dtype)]) == [real]


def test_launches_for_sizes_follows_launch_for_and_drops_oversized():
    topo = Topology(2, 2)
    c = stub_comm(0, topo, max_bytes=64 << 10)
    pairs = launches_for_sizes(c, [16, 4096, 32 << 10, 1 << 20], [torch.bfloat16, torch.float32])
    # bf16: 32 B, 8 KiB, 64 KiB fit (2 MiB does not); fp32: 64 B, 16 KiB fit (128 KiB, 4 MiB do not)
    expect = {
        (c.launch_for(torch.zeros(n, dtype=dt)), dt)
        for n, dt in [
            (16, torch.bfloat16),
            (4096, torch.bfloat16),
            (32 << 10, torch.bfloat16),
            (16, torch.float32),
            (4096, torch.float32),
        ]
    }
    assert pairs == expect
    fixed = stub_comm(0, topo, launch=LaunchParams(num_blocks=3, block=512))
    assert launches_for_sizes(fixed, [16, 4096], [torch.bfloat16]) == {
        (LaunchParams(num_blocks=3, block=512), torch.bfloat16)
    }


def test_nvrar_members_finds_auto_backends():
    c = stub_comm(0, Topology(2, 2))
    auto = SimpleNamespace(backends={"nccl": object(), "nvrar": c})
    assert nvrar_members(c) == [c]
    assert nvrar_members(auto) == [c]
    assert nvrar_members(object()) == []


def test_host_share_without_a_process_group_is_everything():
    specs = [("a",), ("b",), ("c",)]
    assert _host_share(None, specs) == (specs, 0, 1)


def test_precompile_needs_jobs_and_can_be_turned_off(monkeypatch):
    with pytest.raises(ValueError, match="no .* jobs"):
        precompile([])
    monkeypatch.setenv("SPANLLM_NVRAR_PRECOMPILE", "0")
    out = precompile([(stub_comm(0, Topology(2, 2)), [(LaunchParams(), torch.bfloat16)])])
    assert "SPANLLM_NVRAR_PRECOMPILE=0" in out["skipped"]


def test_done_markers_skip_what_was_compiled(tmp_path):
    c = stub_comm(0, Topology(2, 2))
    specs = specialisations(
        c, [(LaunchParams(block=256), torch.bfloat16), (LaunchParams(block=1024, num_warps=8), torch.bfloat16)]
    )
    assert not_yet_compiled(specs, "fp1", tmp_path) == specs
    (tmp_path / marker_name(specs[0], "fp1")).touch()
    assert not_yet_compiled(specs, "fp1", tmp_path) == specs[1:]
    # another kernel source / Triton / NVSHMEM library: nothing counts as compiled
    assert not_yet_compiled(specs, "fp2", tmp_path) == specs
    assert marker_name(specs[0], "fp1") != marker_name(specs[1], "fp1")


def test_precompile_starts_no_workers_when_everything_is_compiled(tmp_path, monkeypatch):
    import spanllm.comm.nvrar.compile as nc

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))  # precompile pins it; restored after the test

    c = stub_comm(0, Topology(2, 2))
    pairs = [(LaunchParams(block=256), torch.bfloat16), (LaunchParams(block=256), torch.int32)]
    monkeypatch.setattr(nc, "kernel_fingerprint", lambda: "fp")
    monkeypatch.setattr(nc, "marker_dir", lambda: tmp_path)
    for s in specialisations(c, pairs):
        (tmp_path / marker_name(s, "fp")).touch()
    monkeypatch.setattr(nc, "ProcessPoolExecutor", None)  # would raise if a pool were started
    out = precompile([(c, pairs)])
    assert out["specialisations"] == out["already_compiled"] == 2
    assert out["compiled_here"] == out["workers"] == 0 and "error" not in out


def _stuck(spec, fingerprint, directory):  # a worker that never finishes (spawned: must be importable)
    import time

    time.sleep(3600)


def _quick(spec, fingerprint, directory):
    if spec == ("bad",):
        raise RuntimeError("no NVSHMEM device library here")
    return 0.25


def test_worker_pool_reports_failures_and_never_hangs(tmp_path, monkeypatch):
    import spanllm.comm.nvrar.compile as nc

    times, err = nc._run_pool([("a",), ("b",)], 2, "fp", tmp_path, compile_one=_quick)
    assert times == [0.25, 0.25] and err is None
    times, err = nc._run_pool([("a",), ("bad",)], 2, "fp", tmp_path, compile_one=_quick)
    assert times == [0.25] and err == "RuntimeError: no NVSHMEM device library here"
    monkeypatch.setattr(nc, "PRECOMPILE_TIMEOUT_S", 3.0)
    times, err = nc._run_pool([("a",)], 1, "fp", tmp_path, compile_one=_stuck)
    assert times == [] and err == "1 of 1 compiles unfinished after 3 s"


def test_pin_cache_dir_keeps_a_set_directory(tmp_path, monkeypatch):
    import spanllm.comm.nvrar.compile as nc

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    assert nc.pin_cache_dir() == str(tmp_path.resolve())


def test_pin_cache_dir_makes_tritons_default_explicit(monkeypatch):
    import os

    import spanllm.comm.nvrar.compile as nc

    triton = pytest.importorskip("triton")  # the CPU torch wheel comes without it
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    default = os.path.realpath(triton.knobs.cache.dir)
    assert nc.pin_cache_dir() == default and os.environ["TRITON_CACHE_DIR"] == default


def test_size_ladder_is_powers_of_two_and_midpoints():
    from spanllm.comm.nvrar.compile import size_ladder

    assert size_ladder(16) == [2, 3, 4, 6, 8, 12, 16]
    assert size_ladder(20) == [2, 3, 4, 6, 8, 12, 16]
