import json
import statistics
from pathlib import Path

import pytest

from spanllm.perf.allreduce_model import allreduce_time_us
from spanllm.perf.hardware import (
    H200X2_FIT,
    PRESETS,
    AlgoCost,
    ClusterSpecError,
    cluster_from_dict,
    cluster_to_dict,
    load_cluster,
    save_cluster,
)

ROOT = Path(__file__).resolve().parents[2]


def _host_rows():
    from spanllm.perf.measurements import load_results

    ms, _, _ = load_results([ROOT / H200X2_FIT.file])
    return ms


def test_presets_are_valid_and_named():
    assert set(PRESETS) == {"h200x2", "dgx-h100", "dgx-h200", "perlmutter", "vista"}
    for name, spec in PRESETS.items():
        assert spec.name == name
        assert {"nvrar", "nccl_ring/LL", "nccl_tree/Simple", "torch_one_shot"} <= set(spec.algos)
    assert PRESETS["vista"].gpus_per_node == 1 and PRESETS["perlmutter"].gpus_per_node == 4
    assert not PRESETS["h200x2"].has_network and PRESETS["dgx-h100"].has_network


def test_host_preset_predicts_held_out_sizes_of_its_file():
    """The 1x2 rows of sizes the preset was not fitted to: median |error| within 15%, none off by 25%."""
    host = PRESETS["h200x2"]
    errs = []
    for m in _host_rows():
        if m.nbytes in H200X2_FIT.sizes:
            continue
        p = allreduce_time_us(m.algo, m.nbytes, host, m.nodes, m.ranks_per_node, launch=m.launch or None)
        errs.append(abs(p - m.time_us) / m.time_us)
    assert len(errs) == 35
    assert statistics.median(errs) < 0.15 and max(errs) < 0.25


def test_host_preset_constants_come_from_the_fit():
    """Re-running the calibration on the rows hardware.py names gives the constants in the table."""
    from spanllm.perf.calibrate import calibrate

    host = PRESETS["h200x2"]
    rows = [m for m in _host_rows() if m.nbytes in H200X2_FIT.sizes and m.algo in H200X2_FIT.algos]
    assert f"{rows[0].nodes}x{rows[0].ranks_per_node}" == H200X2_FIT.topology
    spec, fits, skipped = calibrate(rows, host)
    assert not skipped and len(fits) == 5
    for key in H200X2_FIT.constants:
        got, shipped = spec.algos[key], host.algos[key]
        for name in ("base_us", "nvlink_step_us", "bw_efficiency"):
            assert getattr(got, name) == pytest.approx(getattr(shipped, name), abs=6e-4), (key, name)
    assert {f.fitted_base for f in fits if f.algo == "nvrar"} == {True}  # one-shot + reduce-scatter rows


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
    j.write_text(
        json.dumps(
            {"base": "dgx-h100", "name": "mine", "nic_GBps_per_gpu": 25.0, "algos": {"nvrar": {"net_step_us": 9.0}}}
        )
    )
    spec = load_cluster(j)
    assert spec.name == "mine" and spec.nic_GBps_per_gpu == 25.0 and spec.gpus_per_node == 8
    assert spec.algos["nvrar"].net_step_us == 9.0 and spec.algos["nvrar"].wire_factor == 2.0
    t = tmp_path / "mine.toml"
    t.write_text('base = "vista"\nname = "v2"\nnic_latency_us = 2.5\n')
    spec = load_cluster(t)
    # vista runs NVSHMEM's default IBRC: a round = kernel phase 0.765 + put (0.3 post + 3.0 proxy + 2.5 wire)
    # + signal (0.3 + 3.0, ordered behind the put) = 9.865 us
    assert spec.name == "v2" and spec.algos["nvrar"].net_step_us == pytest.approx(0.765 + 5.8 + 3.3)
    t.write_text('base = "vista"\nname = "v3"\nnic_latency_us = 3.5\ntransport = "ibgda"\n')
    spec = load_cluster(t)  # GPU-initiated: 0.765 + (1.0 + 3.5) + 1.0; the range's nominal moved with the file
    assert spec.algos["nvrar"].net_step_us == pytest.approx(6.265) and spec.transport.gpu_initiated
    out = tmp_path / "round.json"
    save_cluster(PRESETS["perlmutter"], out)
    assert load_cluster(out) == PRESETS["perlmutter"]


def test_perf_imports_no_torch():
    import subprocess
    import sys

    code = "import sys, spanllm.perf.plan, spanllm.perf.validate, spanllm.perf.calibrate; print('torch' in sys.modules)"
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=root
    ).stdout.strip()
    assert out == "False"


def test_engine_costs_in_presets_and_files(tmp_path):
    from spanllm.perf.hardware import EngineCost

    assert PRESETS["perlmutter"].engine == EngineCost()  # an ideal engine where nothing was measured
    host = PRESETS["h200x2"].engine
    assert host.attends_max_seq_len and host.decode_layer_us > 0 and 0 < host.prefill_efficiency < 1
    out = tmp_path / "host.json"
    save_cluster(PRESETS["h200x2"], out)
    assert load_cluster(out) == PRESETS["h200x2"]
    # a file on a base preset replaces only the engine fields it gives
    spec = cluster_from_dict({"base": "h200x2", "name": "h2", "engine": {"decode_layer_us": 50.0}})
    assert spec.engine.decode_layer_us == 50.0 and spec.engine.attn_position_ns == host.attn_position_ns
    with pytest.raises(ClusterSpecError, match=r"prefill_efficiency=1.5 must lie in \[0, 1\]"):
        EngineCost(prefill_efficiency=1.5)
    with pytest.raises(ClusterSpecError, match="decode_layer_us=-1"):
        EngineCost(decode_layer_us=-1.0)
    with pytest.raises(ClusterSpecError, match="engine: .*unexpected keyword argument 'nope'"):
        cluster_from_dict({"base": "vista", "engine": {"nope": 1}})
