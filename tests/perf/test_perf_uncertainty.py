import pytest

from spanllm.perf.hardware import PRESETS, ClusterSpecError, cluster_from_dict, constant_value, with_constant
from spanllm.perf.uncertainty import predict_range, scenarios


def _two_guess_cluster(make_cluster):
    return make_cluster(ranges={"nic_latency_us": [2.0, 8.0], "graph_node_us": [0.25, 1.0]})


def test_range_of_a_linear_prediction_hand_computed(make_cluster):
    c = _two_guess_cluster(make_cluster)
    # f = 10 x nic latency - 4 x graph node: nominal 40 - 2 = 38; low corner 20 - 4 = 16; high corner 80 - 1 = 79
    r = predict_range(lambda s: 10 * s.nic_latency_us - 4 * s.graph_node_us, c)
    assert (r.nominal, r.low, r.high) == pytest.approx((38.0, 16.0, 79.0))
    assert [d.path for d in r.drivers] == ["nic_latency_us", "graph_node_us"]
    d = r.drivers[0]
    assert (d.delta_at_low, d.delta_at_high) == pytest.approx((-20.0, 40.0))
    assert r.holds(38.0) and not r.holds(80.0) and r.holds(80.0, rel_tol=0.02)
    assert r.top(1) == "nic_latency_us +105%"


def test_constants_that_do_not_move_the_prediction_drop_out(make_cluster):
    c = _two_guess_cluster(make_cluster)
    r = predict_range(lambda s: 3 * s.graph_node_us, c)
    assert [d.path for d in r.drivers] == ["graph_node_us"] and (r.low, r.high) == pytest.approx((0.75, 3.0))
    assert len(scenarios(c)) == 1 + 2 * 2


def test_with_constant_rebuilds_default_entries_but_keeps_fitted_ones(make_cluster):
    c = make_cluster(algos={"nvrar": {"net_step_us": 9.0}})  # fitted; recursive_doubling stays a default
    moved = with_constant(c, "nic_latency_us", 6.0)
    assert moved.algos["nvrar"].net_step_us == 9.0
    # default round: phase 0.765 + IBGDA (1.0 + wire) + 1.0
    assert moved.algos["recursive_doubling"].net_step_us == pytest.approx(0.765 + 7.0 + 1.0)
    assert c.algos["recursive_doubling"].net_step_us == pytest.approx(0.765 + 5.0 + 1.0)
    assert constant_value(with_constant(c, "transport.post_us", 2.0), "transport.post_us") == 2.0
    assert with_constant(c, "algos.nccl_tree/LL.net_step_us", 7.0).algos["nccl_tree/LL"].net_step_us == 7.0


def test_every_assumed_preset_constant_has_a_range_that_holds_it():
    for name, spec in PRESETS.items():
        for path, (lo, hi) in spec.ranges.items():
            assert lo <= constant_value(spec, path) <= hi, (name, path)
    assert {"nic_latency_us", "transport.proxy_us", "kernel.call_us"} <= set(PRESETS["perlmutter"].ranges)
    with pytest.raises(ClusterSpecError, match="does not hold the value"):
        cluster_from_dict({"base": "vista", "ranges": {"nic_latency_us": [5.0, 6.0]}})
    with pytest.raises(ClusterSpecError, match="names no constant"):
        cluster_from_dict({"base": "vista", "ranges": {"nic_latency": [1.0, 6.0]}})


def test_a_file_that_sets_a_guess_drops_its_range():
    spec = cluster_from_dict({"base": "perlmutter", "name": "mine", "nic_latency_us": 1.0})
    assert "nic_latency_us" not in spec.ranges and "transport.proxy_us" in spec.ranges
