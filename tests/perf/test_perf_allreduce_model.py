import pytest

from spanllm.perf.allreduce_model import (
    AllReduceModelError,
    allreduce_cost,
    allreduce_time_us,
    cost_terms,
    place,
    recursive_doubling_steps,
    time_from_terms_us,
)
from spanllm.perf.hardware import PRESETS

MB = 1e6


def t(key, nbytes, c, nodes, rpn=None, graph=True):
    pl = place(c, nodes, rpn)
    return time_from_terms_us(cost_terms(key, nbytes, c, pl), c.algo(key), c, graph)


def test_recursive_doubling_steps_fold_non_powers_of_two():
    assert [recursive_doubling_steps(n) for n in (1, 2, 3, 4, 5, 6, 7, 8, 12, 16)] == [0, 1, 3, 2, 4, 4, 4, 3, 5, 4]


def test_nvrar_hand_computed(round_cluster):
    # 4 nodes x 4 GPUs, 1 MB, reduce-scatter launch ('rs'): launch 0.5, base 0
    # intra RS + AG: 2 phases x 2 us + 2 * 3/4 * 1e6 B x 2 (LL8) / 100 GB/s = 4 + 30
    # inter: log2(4) = 2 rounds x 5 us + 2 * (1e6/4 B x 2 wire) / 10 GB/s = 10 + 100
    # staging: 2 rounds x 1e6/4 B x 2 wire = 1e6 B copied locally at 1000 GB/s = 1
    rs = 0.5 + 34 + 110 + 1
    assert allreduce_time_us("nvrar", MB, round_cluster, 4, launch="rs/b64x1024w8") == pytest.approx(rs)
    # one-shot ('os'): 1 phase x 2 us + 3 x 1e6 x 2 / 100 GB/s = 2 + 60; the rounds carry the whole message:
    # 2 x 5 + 2 x 2e6 / 10 GB/s = 10 + 400; staging 4e6 B / 1000 GB/s = 4
    os_ = 0.5 + 62 + 410 + 4
    assert allreduce_time_us("nvrar", MB, round_cluster, 4, launch="os/b8x256w4") == pytest.approx(os_)
    # no launch given: the faster of the two (what tuning picks)
    assert allreduce_cost("nvrar", MB, round_cluster, 4) == (pytest.approx(rs), "nvrar[rs]")
    # SIMPLE protocol: raw data, 1x wire bytes
    assert allreduce_time_us("nvrar", MB, round_cluster, 4, launch="rs/b64x1024w8/simple") == pytest.approx(
        0.5 + 4 + 15 + 10 + 50 + 0.5
    )
    # 3 nodes fold: 1 + 2 = 3 rounds of the shard (5 us + 50 us + 0.5 us staging each)
    assert allreduce_time_us("nvrar", MB, round_cluster, 3) == pytest.approx(0.5 + 34 + 3 * 5 + 3 * 50 + 1.5)
    # eager: 5 us launch instead of 0.5
    assert allreduce_time_us("nvrar", MB, round_cluster, 4, graph=False) == pytest.approx(rs - 0.5 + 5)
    # small messages inside one node: one-shot wins (1 phase instead of 2)
    assert allreduce_cost("nvrar", 4096, round_cluster, 1)[1] == "nvrar[os]"


def test_flat_recursive_doubling_hand_computed(round_cluster):
    # 16 ranks: 4 steps of the full 1 MB with LL8 (2x): first 2 inside the node, last 2 across
    intra = 2 * (2.0 + 2 * MB / 100e3)
    inter = 2 * (5.0 + 2 * MB / 10e3)
    assert allreduce_time_us("recursive_doubling", MB, round_cluster, 4) == pytest.approx(0.5 + intra + inter)


def test_nccl_ring_and_tree_hand_computed(round_cluster):
    c = round_cluster
    # ring LL, 4 nodes x 4: 30 steps; the slowest chunk walks 30 edges of a 16-edge ring with 4 network edges:
    # ceil(30 * 4 / 16) = 8 over the network; 2*15/16 MB x 2 wire, spread over the node's 4 NICs
    # (one ring per NIC), at 10 GB/s x 0.5 each: 0.5 + 6.6 + 13.2 + 21.6 + 187.5
    assert t("nccl_ring/LL", MB, c, 4) == pytest.approx(0.5 + 6.6 + 22 * 0.6 + 8 * 2.7 + 2 * 15 / 16 * MB * 2 / 4 / 5e3)
    assert t("nccl_ring/LL", MB, c, 4) == pytest.approx(229.4)
    # tree LL: 2*(4-1) NVLink steps + 2*log2(4) network steps; 2 MB x 2 wire over 4 NICs at 10 GB/s x 0.5
    assert t("nccl_tree/LL", MB, c, 4) == pytest.approx(0.5 + 6.8 + 6 * 0.6 + 4 * 5.0 + 2 * MB * 2 / 4 / 5e3)
    assert t("nccl_tree/LL", MB, c, 4) == pytest.approx(230.9)
    # one node: ring over NVLink only, no NIC split
    assert t("nccl_ring/Simple", MB, c, 1) == pytest.approx(0.5 + 8.4 + 6 * 3.4 + 2 * 3 / 4 * MB / 100e3)
    # nccl = the fastest variant NCCL's tuner may pick: every protocol at every size on a preset of its own
    # (the H200 host's measured LL-up-to-2-MiB rule is that host's)
    keys = (
        "nccl_ring/LL",
        "nccl_tree/LL",
        "nccl_ring/LL128",
        "nccl_tree/LL128",
        "nccl_ring/Simple",
        "nccl_tree/Simple",
    )
    best = min(t(k, MB, c, 4) for k in keys)
    # tree LL128: 0.5 + 14 + 6 x 1.25 + 4 x 8.5 = 56.0, + 2 MB x 128/120 / 4 NICs / (10 GB/s x 0.92) = 57.97
    assert best == pytest.approx(t("nccl_tree/LL128", MB, c, 4)) == pytest.approx(56.0 + 2 * MB * 128 / 120 / 4 / 9.2e3)
    assert allreduce_time_us("nccl", MB, c, 4) == pytest.approx(best)
    big = 64 * MB
    assert allreduce_cost("nccl", big, c, 4)[1] in (
        "nccl_ring/Simple",
        "nccl_tree/Simple",
        "nccl_tree/LL128",
        "nccl_ring/LL128",
    )
    assert allreduce_time_us("nccl", MB, c, 4, graph=False) == pytest.approx(best - 0.5 + 5.0 + 20.0)


def test_one_and_two_shot_hand_computed(round_cluster):
    c = round_cluster
    one, two = c.algo("torch_one_shot"), c.algo("torch_two_shot")
    # one kernel: copy-in 2 MB at 1000 GB/s = 2 us, 2 barriers, reads 3 x 1 MB from peers
    assert allreduce_time_us("torch_one_shot", MB, c, 1) == pytest.approx(
        0.5 + 2 + 2 * one.nvlink_step_us + 3 * MB / (100e3 * one.bw_efficiency)
    )
    # two kernels (copy + reduce): 2 x 0.5 us, copy 2 us, 3 barriers, 2 * 3/4 MB over NVLink
    assert two.kernels == 2
    assert allreduce_time_us("torch_two_shot", MB, c, 1) == pytest.approx(
        1.0 + 2 + 3 * two.nvlink_step_us + 2 * 3 / 4 * MB / (100e3 * two.bw_efficiency)
    )
    with pytest.raises(AllReduceModelError, match="needs every rank on one host"):
        allreduce_time_us("torch_one_shot", MB, c, 2)


def test_single_host_nvrar_virtual_nodes_use_nvlink():
    host = PRESETS["h200x2"]
    cost = host.algo("nvrar")
    small = 4096
    fixed = 0.5 + cost.base_us  # one graph node + the kernel's per-call cost
    bw = 450e3 * cost.bw_efficiency
    # 1 node x 2 GPUs, one-shot: 1 NVLink phase, the whole message pushed as LL8 cells (2x)
    assert allreduce_time_us("nvrar", small, host, 1, 2, launch="os/b4x256w4") == pytest.approx(
        fixed + cost.nvlink_step_us + 2 * small / bw
    )
    # reduce-scatter: 2 phases of M/2 each, LL8 cells: the same 2M wire bytes
    assert allreduce_time_us("nvrar", small, host, 1, 2, launch="rs/b4x256w4") == pytest.approx(
        fixed + 2 * cost.nvlink_step_us + 2 * small / bw
    )
    # 2 virtual nodes x 1 GPU: one recursive-doubling round of the whole message in LL8 cells over NVLink,
    # plus its local staging copy at the host's HBM copy bandwidth (4300 GB/s)
    assert allreduce_time_us("nvrar", small, host, 2, 1) == pytest.approx(
        fixed + cost.nvlink_step_us + 2 * small / bw + 2 * small / 4300e3
    )
    # not fitted to any 2x1 row: results/h200x2/allreduce_2x1_bf16.json measured 4.08 us at 4 KiB
    assert abs(allreduce_time_us("nvrar", small, host, 2, 1) / 4.08 - 1) < 0.15


def test_placement_errors():
    host = PRESETS["h200x2"]
    with pytest.raises(AllReduceModelError, match="has no network"):
        place(host, 2, 2)
    with pytest.raises(AllReduceModelError, match="ranks_per_node=3 must lie in"):
        place(host, 1, 3)
    with pytest.raises(AllReduceModelError, match="whole hosts only"):
        place(PRESETS["perlmutter"], 4, 2)
    assert place(PRESETS["perlmutter"], 2, 2).physical_nodes == 1  # 4 ranks fit one node: virtual nodes
    with pytest.raises(AllReduceModelError, match="not a GPU|unknown"):
        allreduce_time_us("ring", MB, host, 1)


@pytest.mark.parametrize("cluster", ["perlmutter", "vista", "dgx-h100", "h200x2"])
@pytest.mark.parametrize("algo", ["nccl", "nvrar", "recursive_doubling", "auto"])
def test_monotone_in_size_latency_bound_small_bandwidth_bound_large(cluster, algo):
    c = PRESETS[cluster]
    nodes = 1 if not c.has_network else 4
    sizes = [2**k for k in range(8, 31, 2)]
    times = [allreduce_time_us(algo, s, c, nodes) for s in sizes]
    assert all(b >= a for a, b in zip(times, times[1:]))
    # latency-bound: 256 B and 1 KiB cost nearly the same; bandwidth-bound: 4x bytes ~ 4x time
    assert times[1] / times[0] < 1.1
    assert 3.0 < times[-1] / times[-2] <= 4.0 + 1e-9


def test_more_nodes_cost_more():
    c = PRESETS["perlmutter"]
    for algo in ("nccl", "nvrar"):
        ts = [allreduce_time_us(algo, 512 * 1024, c, n) for n in (2, 4, 8, 16)]
        assert ts == sorted(ts)


def test_nvrar_beats_nccl_small_and_loses_large_on_gh200():
    c = PRESETS["vista"]  # one GPU per node: NVRAR is pure recursive doubling with LL8's 2x wire bytes
    assert allreduce_time_us("nvrar", 128 * 1024, c, 8) < allreduce_time_us("nccl", 128 * 1024, c, 8)
    assert allreduce_time_us("nvrar", 256 * 2**20, c, 8) > allreduce_time_us("nccl", 256 * 2**20, c, 8)


def test_auto_is_the_fastest_supported():
    c = PRESETS["dgx-h100"]
    for s in (4096, 2**20, 2**28):
        t_auto, chosen = allreduce_cost("auto", s, c, 1)
        assert t_auto == min(
            allreduce_time_us(a, s, c, 1) for a in ("nccl", "torch_one_shot", "torch_two_shot", "nvrar")
        )
        assert chosen in ("nccl", "torch_one_shot", "torch_two_shot", "nvrar")
    assert allreduce_time_us("nccl", 123, c, 1, 1) == 0.0  # a group of one rank has nothing to reduce
