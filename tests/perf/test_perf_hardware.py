import json

import pytest

from spanllm.perf.allreduce_model import allreduce_time_us
from spanllm.perf.hardware import (
    PRESETS, AlgoCost, ClusterSpecError, cluster_from_dict, cluster_to_dict, load_cluster, save_cluster,
)

KiB = 1024
# DESIGN.md section 7: bf16, 2 ranks, CUDA graph. NCCL, torch one-shot, torch two-shot (us).
DESIGN_TABLE = {4 * KiB: (11.5, 6.7, 6.6), 128 * KiB: (12.4, 7.8, 7.5), 512 * KiB: (14.7, 10.1, 7.8),
                1024 * KiB: (18.7, 13.5, 10.4), 2048 * KiB: (31.2, 19.0, 13.1)}
HELD_OUT = (128 * KiB, 1024 * KiB)  # the host constants were fitted on the other three rows


def test_presets_are_valid_and_named():
    assert set(PRESETS) == {"h200x2", "dgx-h100", "dgx-h200", "perlmutter", "vista"}
    for name, spec in PRESETS.items():
        assert spec.name == name
        assert {"nvrar", "nccl_ring/LL", "nccl_tree/Simple", "torch_one_shot"} <= set(spec.algos)
    assert PRESETS["vista"].gpus_per_node == 1 and PRESETS["perlmutter"].gpus_per_node == 4
    assert not PRESETS["h200x2"].has_network and PRESETS["dgx-h100"].has_network


def test_host_preset_predicts_held_out_design_rows_within_15_percent():
    host = PRESETS["h200x2"]
    for size in HELD_OUT:
        for algo, measured in zip(("nccl", "torch_one_shot", "torch_two_shot"), DESIGN_TABLE[size]):
            predicted = allreduce_time_us(algo, size, host, nodes=1, ranks_per_node=2)
            assert abs(predicted - measured) / measured < 0.15, (algo, size, predicted, measured)


def test_host_preset_constants_come_from_the_fit():
    """Re-running the calibration on the three fitted rows gives the constants in the table."""
    from spanllm.perf.calibrate import fit_algo_cost
    from spanllm.perf.measurements import AllReduceMeasurement

    host = PRESETS["h200x2"]
    for i, (algo, key) in enumerate((("nccl", "nccl_ring/LL"), ("torch_one_shot", "torch_one_shot"),
                                      ("torch_two_shot", "torch_two_shot"))):
        rows = [AllReduceMeasurement("design", algo, algo, s, "bfloat16", 1, 2, True, t[i])
                for s, t in DESIGN_TABLE.items() if s not in HELD_OUT]
        fit = fit_algo_cost(algo, rows, host)
        assert fit.cost.nvlink_step_us == pytest.approx(host.algos[key].nvlink_step_us, abs=0.01)
        assert fit.cost.bw_efficiency == pytest.approx(host.algos[key].bw_efficiency, abs=0.002)


def test_errors_name_the_value_and_the_fix():
    with pytest.raises(ClusterSpecError, match=r"bw_efficiency=1.5 must lie in \(0, 1\]"):
        AlgoCost(base_us=0, nvlink_step_us=1, net_step_us=1, wire_factor=1, bw_efficiency=1.5)
    d = cluster_to_dict(PRESETS["dgx-h100"])
    d["gpus_per_node"] = 0
    with pytest.raises(ClusterSpecError, match="gpus_per_node=0"):
        cluster_from_dict(d)
    with pytest.raises(ClusterSpecError, match="unknown cluster 'nope'.*presets are"):
        load_cluster("nope")
    with pytest.raises(ClusterSpecError, match=r"unknown field\(s\) \['nic_gbps'\]"):
        cluster_from_dict({"base": "vista", "nic_gbps": 3})


def test_user_cluster_files_json_and_toml(tmp_path):
    j = tmp_path / "mine.json"
    j.write_text(json.dumps({"base": "dgx-h100", "name": "mine", "nic_GBps_per_gpu": 25.0,
                             "algos": {"nvrar": {"net_step_us": 9.0}}}))
    spec = load_cluster(j)
    assert spec.name == "mine" and spec.nic_GBps_per_gpu == 25.0 and spec.gpus_per_node == 8
    assert spec.algos["nvrar"].net_step_us == 9.0 and spec.algos["nvrar"].wire_factor == 2.0
    t = tmp_path / "mine.toml"
    t.write_text('base = "vista"\nname = "v2"\nnic_latency_us = 2.5\n')
    spec = load_cluster(t)
    assert spec.name == "v2" and spec.algos["nvrar"].net_step_us == pytest.approx(2.5 + 0.5)
    out = tmp_path / "round.json"
    save_cluster(PRESETS["perlmutter"], out)
    assert load_cluster(out) == PRESETS["perlmutter"]


def test_perf_imports_no_torch():
    import subprocess
    import sys

    code = "import sys, spanllm.perf.plan, spanllm.perf.validate, spanllm.perf.calibrate; print('torch' in sys.modules)"
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=root).stdout.strip()
    assert out == "False"
