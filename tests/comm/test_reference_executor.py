"""The reference executors (ref_ring, ref_rd, ref_hier) and gloo on real gloo process groups.

One spawn per world size runs every case (spanllm.comm.conformance) for every backend and returns the
per-rank results; the tests below assert on them. Inputs are exact small integers, so each check is a
count of wrong elements that must be exactly zero.
"""

from __future__ import annotations

import functools

import pytest
from comm_workers import DTYPES, executor_suite, mismatch_only

from spanllm.launch import launch

LENGTHS = [1, 7, 131, 4099, 100_003]
# world -> (ranks_per_node choices for ref_hier, back-to-back calls); world 8 is the slowest on 2 cores.
CONFIG = {2: ([1, 2], 1000), 3: ([1, 3], 200), 4: ([1, 2], 200), 5: ([1, 5], 100), 6: ([2, 3], 100), 8: ([2, 4], 50)}
B2B_N = 64
SUBGROUP_N = 1001
WORLDS = sorted(CONFIG)
PG_TIMEOUT_S = 60  # a mismatch must raise, not wait for this


@functools.cache
def suite(world: int) -> list[dict]:
    rpns, calls = CONFIG[world]
    return launch(
        executor_suite,
        rpns,
        LENGTHS,
        calls,
        B2B_N,
        SUBGROUP_N if world == 4 else 0,
        nprocs=world,
        timeout_s=PG_TIMEOUT_S,
    )


def expected_labels(world: int) -> list[str]:
    return ["ref_ring", "ref_rd"] + [f"ref_hier:{world // g}x{g}" for g in CONFIG[world][0]] + ["gloo"]


def rows(world: int, case: str) -> list[tuple[int, dict]]:
    return [(res["rank"], r) for res in suite(world) for r in res["rows"] if r["case"] == case]


@pytest.mark.parametrize("world", WORLDS)
def test_every_rank_ran_every_backend(world):
    res = suite(world)
    assert [r["rank"] for r in res] == list(range(world))
    for r in res:
        assert r["labels"] == expected_labels(world)


@pytest.mark.parametrize("world", WORLDS)
def test_exact_sums_every_length_and_dtype(world):
    got = rows(world, "length")
    want = {
        (rank, label, n, str(dt))
        for rank in range(world)
        for label in expected_labels(world)
        for n in LENGTHS + [0]
        for dt in DTYPES
        if n or dt == DTYPES[0]
    }
    # Every combination ran (nothing skipped silently) and every element is exact.
    assert {(rank, r["comm"], r["detail"]["n"], r["detail"]["dtype"]) for rank, r in got} == want
    assert len(got) == len(want)
    wrong = [(rank, r) for rank, r in got if r["wrong"] != 0]
    assert wrong == []


@pytest.mark.parametrize("world", WORLDS)
def test_results_bitwise_identical_on_all_ranks(world):
    got = rows(world, "bitwise_identical")
    assert len(got) == world * len(expected_labels(world)) * 3
    assert {(r["detail"]["n"], r["detail"]["dtype"]) for _, r in got} == {
        (4099, "torch.float32"),
        (1031, "torch.bfloat16"),
        (777, "torch.float16"),
    }
    assert [r for _, r in got if r["wrong"] != 0] == []


@pytest.mark.parametrize("world", WORLDS)
def test_back_to_back_calls(world):
    got = rows(world, "back_to_back")
    assert len(got) == world * len(expected_labels(world))
    for _, r in got:
        assert r["detail"]["calls"] == CONFIG[world][1] and r["detail"]["n"] == B2B_N
        assert r["wrong"] == 0, r


@pytest.mark.parametrize("world", WORLDS)
def test_straggler_rank(world):
    got = rows(world, "straggler")
    assert len(got) == world * len(expected_labels(world))
    for _, r in got:
        assert r["detail"] == {"n": 1000, "sleep_s": 0.05}
        assert r["wrong"] == 0, r


@pytest.mark.parametrize("world", WORLDS)
def test_bad_inputs_raise_naming_the_problem(world):
    for case, needle in (
        ("non_contiguous", "is not contiguous; pass x.contiguous()"),
        ("bad_dtype", "dtype torch.complex64 not in"),
    ):
        got = rows(world, case)
        assert len(got) == world * len(expected_labels(world))
        for _, r in got:
            assert r["wrong"] == 0, r
            assert needle in r["detail"]["error"], r


@pytest.mark.parametrize("world", WORLDS)
def test_length_mismatch_raises_on_every_rank(world):
    sizes = ", ".join(f"rank {r}: {37 if r == 0 else 38} x torch.float32" for r in range(world))
    refs = [label for label in expected_labels(world) if label.startswith("ref_")]
    for res in suite(world):
        assert sorted(res["mismatch"]) == sorted(refs)
        for label, msg in res["mismatch"].items():
            name = label.split(":")[0]
            assert msg == (
                f"{name}: ranks passed different tensors ({sizes}); every rank must pass the same "
                "element count and dtype"
            ), (res["rank"], label)
        # The next (matching) call on the same communicator is exact: nothing was left in flight.
        assert res["after_mismatch"] == {label: 0 for label in refs}


def test_two_subgroups_reduce_concurrently():
    res = suite(4)
    for r in res:
        sub = r["subgroups"]
        assert sub["group"] == r["rank"] // 2
        assert sub["wrong"] == {
            f"{label}:{key}": (r["rank"] % 2 if key == "rank_in_group" else 0)
            for label in ("ref_ring", "ref_rd", "ref_hier:2x1", "gloo")
            for key in ("torch.float32", "torch.int32", "rank_in_group")
        }


@pytest.mark.parametrize("name", ["gloo", "auto"])
def test_length_mismatch_gloo_and_auto(name):
    msgs = launch(mismatch_only, name, nprocs=2, timeout_s=20)
    assert len(msgs) == 2, msgs  # one message per rank
    assert all("rank 0: 37 x torch.float32, rank 1: 38 x torch.float32" in m for m in msgs), msgs
