"""Topology: node-major rank mapping, rails, virtual nodes, LOCAL_WORLD_SIZE, and errors that name the fix."""

from __future__ import annotations

import pytest

from spanllm.comm.topology import Topology, TopologyError


def test_node_major_mapping_2x4():
    t = Topology(8, 4)
    assert t.num_nodes == 2 and str(t) == "2x4"
    assert [t.node_of(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [t.local_rank(r) for r in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert t.node_ranks(0) == [0, 1, 2, 3] and t.node_ranks(1) == [4, 5, 6, 7]
    assert [t.rail_ranks(i) for i in range(4)] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert t.rank_of(1, 2) == 6


def test_node_major_mapping_3x2():
    t = Topology(6, 2)
    assert t.num_nodes == 3 and str(t) == "3x2"
    assert [t.node_of(r) for r in range(6)] == [0, 0, 1, 1, 2, 2]
    assert [t.node_ranks(n) for n in range(3)] == [[0, 1], [2, 3], [4, 5]]
    assert [t.rail_ranks(i) for i in range(2)] == [[0, 2, 4], [1, 3, 5]]


@pytest.mark.parametrize("world", range(1, 17))
def test_mapping_roundtrip_every_divisor(world):
    for g in [d for d in range(1, world + 1) if world % d == 0]:
        t = Topology(world, g)
        assert t.num_nodes * t.ranks_per_node == world
        seen = []
        for r in range(world):
            assert t.rank_of(t.node_of(r), t.local_rank(r)) == r
            assert r in t.node_ranks(t.node_of(r)) and r in t.rail_ranks(t.local_rank(r))
        for n in range(t.num_nodes):
            seen += t.node_ranks(n)
        assert seen == list(range(world))
        rails = sorted(r for i in range(g) for r in t.rail_ranks(i))
        assert rails == list(range(world))


def test_virtual_nodes_on_one_host():
    # 2 GPUs declared as 2 nodes of 1: every rank is alone on its node, the rail holds both.
    t = Topology(2, 1)
    assert t.num_nodes == 2 and str(t) == "2x1"
    assert t.node_ranks(0) == [0] and t.node_ranks(1) == [1]
    assert t.rail_ranks(0) == [0, 1]
    # 4 ranks as 2 virtual nodes of 2.
    t = Topology(4, 2)
    assert t.node_ranks(1) == [2, 3] and t.rail_ranks(1) == [1, 3]


def test_single_rank():
    t = Topology(1, 1)
    assert t.num_nodes == 1 and t.node_ranks(0) == [0] and t.rail_ranks(0) == [0] and str(t) == "1x1"


def test_from_env_uses_local_world_size(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert Topology.from_env(8) == Topology(8, 2)
    # An explicit argument wins over the environment.
    assert Topology.from_env(8, 4) == Topology(8, 4)
    # LOCAL_WORLD_SIZE larger than the group (a subgroup of one node) is clamped to the group.
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert Topology.from_env(2) == Topology(2, 2)


def test_from_env_without_local_world_size_is_one_node(monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert Topology.from_env(6) == Topology(6, 6)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "")
    assert Topology.from_env(6) == Topology(6, 6)


def test_from_env_indivisible_local_world_size_names_values(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    with pytest.raises(TopologyError, match=r"world_size=6 is not divisible by ranks_per_node=4") as e:
        Topology.from_env(6)
    assert "divisors: [1, 2, 3, 6]" in str(e.value)


def test_indivisible_names_value_and_fix():
    with pytest.raises(TopologyError) as e:
        Topology(6, 4)
    msg = str(e.value)
    assert "world_size=6" in msg and "ranks_per_node=4" in msg
    assert "pick a ranks_per_node that divides" in msg and "divisors: [1, 2, 3, 6]" in msg


def test_ranks_per_node_larger_than_world_is_an_error():
    with pytest.raises(TopologyError, match=r"world_size=2 is not divisible by ranks_per_node=4.*divisors: \[1, 2\]"):
        Topology(2, 4)


@pytest.mark.parametrize(
    "world,g,needle",
    [
        (0, 1, "world_size=0 must be a positive integer"),
        (-2, 1, "world_size=-2 must be a positive integer"),
        (2.0, 1, "world_size=2.0 must be a positive integer"),
        (4, 0, "ranks_per_node=0 must be a positive integer (1 <= ranks_per_node <= world_size=4)"),
        (4, -1, "ranks_per_node=-1 must be a positive integer"),
        (4, "2", "ranks_per_node='2' must be a positive integer"),
    ],
)
def test_invalid_values_are_named(world, g, needle):
    with pytest.raises(TopologyError) as e:
        Topology(world, g)
    assert needle in str(e.value)


def test_topology_error_is_a_value_error():
    assert issubclass(TopologyError, ValueError)


def test_out_of_range_ranks_are_errors():
    t = Topology(4, 2)
    with pytest.raises(TopologyError, match=r"rank=4 is outside the world of 4 ranks"):
        t.node_of(4)
    with pytest.raises(TopologyError, match=r"rank=-1 is outside the world of 4 ranks"):
        t.local_rank(-1)
    with pytest.raises(TopologyError, match=r"\(node=2, local_rank=0\) is outside 2 nodes x 2 ranks per node"):
        t.rank_of(2, 0)
    with pytest.raises(TopologyError, match=r"\(node=0, local_rank=2\)"):
        t.rail_ranks(2)
    with pytest.raises(TopologyError, match=r"\(node=3, local_rank=0\)"):
        t.node_ranks(3)


def test_frozen_and_hashable():
    t = Topology(4, 2)
    with pytest.raises(AttributeError):
        t.world_size = 8  # type: ignore[misc]
    assert {t: 1}[Topology(4, 2)] == 1


def test_from_env_non_integer_local_world_size_names_the_variable(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "abc")
    with pytest.raises(TopologyError, match="LOCAL_WORLD_SIZE"):
        Topology.from_env(4)
