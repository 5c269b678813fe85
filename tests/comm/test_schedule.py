"""The all-reduce schedules as data, checked symbolically (no processes): every rank ends with exactly one
contribution of every rank at every element, with the round and message counts each algorithm promises."""

from __future__ import annotations

import math

import numpy as np
import pytest

from spanllm.comm.schedule import (
    SCHEDULES,
    Recv,
    Round,
    Schedule,
    ScheduleError,
    Send,
    hierarchical_schedule,
    partition,
    recursive_doubling_schedule,
    ring_schedule,
    simulate,
)
from spanllm.comm.topology import Topology

LENGTHS = [0, 1, 2, 3, 5, 7, 16, 37, 1000]


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def build(name: str, topo: Topology, n: int) -> list[Schedule]:
    return [SCHEDULES[name](r, topo, n) for r in range(topo.world_size)]


def rd_rounds(p: int) -> int:
    """log2(P) for powers of two; log2(p2) + 2 (fold + unfold) otherwise; 0 for one rank."""
    if p == 1:
        return 0
    p2 = 1 << (p.bit_length() - 1)
    return int(math.log2(p2)) + (0 if p == p2 else 2)


def test_schedule_registry_names():
    assert set(SCHEDULES) == {"ring", "recursive_doubling", "hierarchical"}


@pytest.mark.parametrize("world", range(1, 17))
def test_every_schedule_sums_exactly_once(world):
    ones = {}
    for n in LENGTHS:
        ones[n] = np.ones((world, n, world), dtype=np.int64)
        for name in ("ring", "recursive_doubling"):
            state = simulate(build(name, Topology(world, world), n))
            assert state.shape == (world, n, world)
            assert np.array_equal(state, ones[n]), (name, world, n)
        for g in divisors(world):
            state = simulate(build("hierarchical", Topology(world, g), n))
            assert np.array_equal(state, ones[n]), ("hierarchical", world, g, n)


@pytest.mark.parametrize("world", range(1, 17))
def test_round_counts(world):
    for n in LENGTHS:
        for r in range(world):
            assert len(ring_schedule(r, world, n).rounds) == 2 * (world - 1)
            assert len(recursive_doubling_schedule(r, world, n).rounds) == rd_rounds(world)
            for g in divisors(world):
                topo = Topology(world, g)
                intra = 2 if g > 1 else 0
                assert len(hierarchical_schedule(r, topo, n).rounds) == intra + rd_rounds(topo.num_nodes)


def test_recursive_doubling_round_counts_explicit():
    assert [rd_rounds(p) for p in range(1, 17)] == [0, 1, 3, 2, 4, 4, 4, 3, 5, 5, 5, 5, 5, 5, 5, 4]
    assert [len(recursive_doubling_schedule(0, p, 10).rounds) for p in range(1, 17)] == [
        0,
        1,
        3,
        2,
        4,
        4,
        4,
        3,
        5,
        5,
        5,
        5,
        5,
        5,
        5,
        4,
    ]


@pytest.mark.parametrize("world", range(1, 17))
def test_elements_moved_totals(world):
    """Ring moves 2(P-1) x length in total; recursive doubling log2(p2) x p2 x length plus the fold's
    2 x (P-p2) x length."""
    p2 = 1 << (world.bit_length() - 1)
    for n in (7, 37, 1000):
        ring = [ring_schedule(r, world, n) for r in range(world)]
        assert sum(s.elements_sent for s in ring) == 2 * (world - 1) * n
        rd = [recursive_doubling_schedule(r, world, n) for r in range(world)]
        assert sum(s.elements_sent for s in rd) == (int(math.log2(p2)) * p2 + 2 * (world - p2)) * n


def test_ring_messages_per_rank():
    # length >= P: every chunk is non-empty, one send per round.
    for world in range(2, 17):
        for r in range(world):
            assert ring_schedule(r, world, 1000).num_messages == 2 * (world - 1)


def _expected_hier_messages(rank: int, topo: Topology) -> int:
    """All shards non-empty: g-1 sends in the reduce-scatter, g-1 in the all-gather, and the rail's
    recursive doubling: log2(p2) exchanges, plus the fold send (extra ranks: only that) and the unfold send."""
    g, N = topo.ranks_per_node, topo.num_nodes
    p2 = 1 << (N.bit_length() - 1)
    idx = topo.node_of(rank)  # position on its rail
    if N == 1:
        inter = 0
    elif idx >= p2:
        inter = 1
    elif idx < N - p2:
        inter = int(math.log2(p2)) + 1
    else:
        inter = int(math.log2(p2))
    return 2 * (g - 1) + inter


@pytest.mark.parametrize("world", range(1, 17))
def test_hierarchical_message_counts(world):
    for g in divisors(world):
        topo = Topology(world, g)
        for r in range(world):
            s = hierarchical_schedule(r, topo, 1000)
            assert s.num_messages == _expected_hier_messages(r, topo), (world, g, r)
            shard = partition(1000, g)[topo.local_rank(r)]
            shard_len = shard[1] - shard[0]
            # Reduce-scatter sends everything but my shard, all-gather sends my shard to g-1 peers.
            inter_msgs = _expected_hier_messages(r, topo) - 2 * (g - 1)
            assert s.elements_sent == (1000 - shard_len) + (g - 1) * shard_len + inter_msgs * shard_len


def test_hierarchical_explicit_2x2():
    topo = Topology(4, 2)
    s = hierarchical_schedule(1, topo, 10)  # node 0, local rank 1, shard [5, 10)
    assert s.rounds == (
        Round((Send(0, 0, 5),), (Recv(0, 5, 10, "reduce"),)),
        Round((Send(3, 5, 10),), (Recv(3, 5, 10, "reduce"),)),
        Round((Send(0, 5, 10),), (Recv(0, 0, 5, "copy"),)),
    )


def test_hierarchical_inter_rounds_only_on_the_rail():
    topo = Topology(6, 2)  # 3 nodes: rails [0, 2, 4] and [1, 3, 5]
    for r in range(6):
        s = hierarchical_schedule(r, topo, 100)
        rail = topo.rail_ranks(topo.local_rank(r))
        node = topo.node_ranks(topo.node_of(r))
        for rnd in s.rounds[1:-1]:
            assert all(x.peer in rail and x.peer != r for x in rnd.sends + rnd.recvs)
        for rnd in (s.rounds[0], s.rounds[-1]):
            assert all(x.peer in node and x.peer != r for x in rnd.sends + rnd.recvs)


def test_ring_explicit_3_ranks():
    s = ring_schedule(0, 3, 3)  # chunks [0,1) [1,2) [2,3)
    assert s.rounds == (
        Round((Send(1, 0, 1),), (Recv(2, 2, 3, "reduce"),)),
        Round((Send(1, 2, 3),), (Recv(2, 1, 2, "reduce"),)),
        Round((Send(1, 1, 2),), (Recv(2, 0, 1, "copy"),)),
        Round((Send(1, 0, 1),), (Recv(2, 2, 3, "copy"),)),
    )
    assert s.algorithm == "ring" and (s.rank, s.world_size, s.length) == (0, 3, 3)


def test_recursive_doubling_explicit_fold_3_ranks():
    r0, r1, r2 = (recursive_doubling_schedule(r, 3, 4).rounds for r in range(3))
    assert r0 == (
        Round((), (Recv(2, 0, 4, "reduce"),)),
        Round((Send(1, 0, 4),), (Recv(1, 0, 4, "reduce"),)),
        Round((Send(2, 0, 4),), ()),
    )
    assert r1 == (Round(), Round((Send(0, 0, 4),), (Recv(0, 0, 4, "reduce"),)), Round())
    # The extra rank: first round sends, last round overwrites with the finished sum.
    assert r2 == (Round((Send(0, 0, 4),), ()), Round(), Round((), (Recv(0, 0, 4, "copy"),)))


def test_empty_message_moves_nothing_but_keeps_round_counts():
    for world in (3, 4, 6):
        for name in SCHEDULES:
            for s in build(name, Topology(world, 1 if name == "hierarchical" else world), 0):
                assert s.num_messages == 0 and s.elements_sent == 0
    assert len(recursive_doubling_schedule(0, 6, 0).rounds) == 4


def test_short_messages_skip_empty_ranges():
    # length 1 over 4 ranks: ring chunks 1..3 are empty and never sent.
    for r in range(4):
        for rnd in ring_schedule(r, 4, 1).rounds:
            assert all(x.stop > x.start for x in rnd.sends + rnd.recvs)
    assert sum(ring_schedule(r, 4, 1).num_messages for r in range(4)) == 6  # 3 reduce hops + 3 gather hops


# --------------------------------------------------------------------------------------------------
# partition


@pytest.mark.parametrize("length", [0, 1, 2, 3, 5, 7, 16, 37, 1000])
@pytest.mark.parametrize("parts", [1, 2, 3, 4, 7, 16])
def test_partition_properties(length, parts):
    p = partition(length, parts)
    assert len(p) == parts
    assert p[0][0] == 0 and p[-1][1] == length
    assert all(a[1] == b[0] for a, b in zip(p, p[1:]))  # contiguous, in order
    sizes = [stop - start for start, stop in p]
    assert all(s >= 0 for s in sizes)
    assert max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes, reverse=True)  # the first ones are the larger ones
    assert sizes.count(length // parts + 1) == length % parts


def test_partition_explicit():
    assert partition(10, 3) == [(0, 4), (4, 7), (7, 10)]
    assert partition(2, 4) == [(0, 1), (1, 2), (2, 2), (2, 2)]
    assert partition(0, 2) == [(0, 0), (0, 0)]


@pytest.mark.parametrize("parts", [0, -1])
def test_partition_rejects_bad_parts(parts):
    with pytest.raises(ValueError, match=f"parts={parts} must be >= 1"):
        partition(10, parts)


# --------------------------------------------------------------------------------------------------
# the checker itself can fail


def _replace_round(s: Schedule, k: int, rnd: Round) -> Schedule:
    rounds = list(s.rounds)
    rounds[k] = rnd
    return Schedule(s.algorithm, s.rank, s.world_size, s.length, tuple(rounds))


def test_simulate_rejects_unmatched_receive():
    scheds = build("ring", Topology(3, 3), 6)
    rnd = scheds[1].rounds[0]
    bad = Round(rnd.sends, (Recv(2, 0, 2, "reduce"),))  # rank 2 sends [4, 6) to rank 0 in round 0
    scheds[1] = _replace_round(scheds[1], 0, bad)
    with pytest.raises(ScheduleError, match=r"round 0: rank 1 expects \[0, 2\) from 2, which sends no such range"):
        simulate(scheds)


def test_simulate_rejects_send_nobody_receives():
    scheds = build("recursive_doubling", Topology(4, 4), 8)
    rnd = scheds[0].rounds[1]
    scheds[0] = _replace_round(scheds[0], 1, Round(rnd.sends + (Send(3, 0, 8),), rnd.recvs))
    with pytest.raises(ScheduleError, match=r"round 1: sends nobody receives: \[\(0, 3, 0, 8\)\]"):
        simulate(scheds)


def test_simulate_rejects_round_count_disagreement():
    scheds = build("ring", Topology(3, 3), 6)
    s = scheds[2]
    scheds[2] = Schedule(s.algorithm, s.rank, s.world_size, s.length, s.rounds[:-1])
    with pytest.raises(ScheduleError, match=r"ranks disagree on the number of rounds: \[3, 4\]"):
        simulate(scheds)


def test_simulate_counts_reveal_a_wrong_op():
    """Matched messages but 'copy' where the ring must 'reduce': no ScheduleError, and the counts are not all ones."""
    scheds = build("ring", Topology(3, 3), 6)
    s = scheds[0]
    rnd = s.rounds[0]
    r = rnd.recvs[0]
    scheds[0] = _replace_round(s, 0, Round(rnd.sends, (Recv(r.peer, r.start, r.stop, "copy"),)))
    state = simulate(scheds)
    assert not np.array_equal(state, np.ones_like(state))
    # rank 0's own contribution to the chunk it received in round 0 was overwritten and never comes back.
    assert int((state != 1).sum()) > 0 and state[:, r.start : r.stop, 0].max() == 0


def test_simulate_counts_reveal_a_double_reduce():
    """Adding the same data twice is caught as a count of 2, not silently accepted."""
    scheds = build("recursive_doubling", Topology(2, 2), 4)
    s = scheds[0]
    rnd = s.rounds[0]
    scheds[0] = _replace_round(s, 0, Round(rnd.sends, rnd.recvs + rnd.recvs))
    scheds[1] = _replace_round(scheds[1], 0, Round(scheds[1].rounds[0].sends * 2, scheds[1].rounds[0].recvs))
    state = simulate(scheds)
    assert state[0, :, 1].tolist() == [2, 2, 2, 2] and state[1].tolist() == [[1, 1]] * 4
