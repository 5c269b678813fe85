import json
from argparse import Namespace

import pytest

from spanllm.perf import calibrate as cal
from spanllm.perf.allreduce_model import allreduce_time_us
from spanllm.perf.calibrate import CalibrationError, calibrate, fit_algo_cost, parse_bytes
from spanllm.perf.hardware import PRESETS, load_cluster
from spanllm.perf.measurements import AllReduceMeasurement

SIZES = [2 ** k for k in range(12, 23)]


def test_fit_recovers_known_constants():
    host = PRESETS["h200x2"]
    # synthetic truth: nvrar with 3 us per NVLink step and 50% efficiency, on both host topologies
    truth = 3.0, 0.5
    ms = []
    for topo, (n, g) in (("1x2", (1, 2)), ("2x1", (2, 1))):
        for s in SIZES:
            steps = 2 if g == 2 else 1
            wire = s / 2 * 2 if g == 2 else 2 * s  # RS + AG move (g-1)/g M each; RD moves 2x M (LL8)
            t = 0.5 + steps * truth[0] + wire / (450e3 * truth[1])
            ms.append(AllReduceMeasurement("x", "nvrar", "nvrar", s, "bfloat16", n, g, True, t))
    fit = fit_algo_cost("nvrar", ms, host)
    assert fit.cost.nvlink_step_us == pytest.approx(3.0) and fit.cost.bw_efficiency == pytest.approx(0.5)
    assert fit.rms_rel_error < 1e-9


def test_fit_refuses_what_it_cannot_determine():
    host = PRESETS["h200x2"]
    one = [AllReduceMeasurement("x", "nvrar", "nvrar", 4096, "bfloat16", 1, 2, True, 5.0)]
    with pytest.raises(CalibrationError, match="at least 2 sizes"):
        fit_algo_cost("nvrar", one, host)
    flat = [AllReduceMeasurement("x", "nvrar", "nvrar", s, "bfloat16", 1, 2, True, 9.0 - s / 1e6) for s in SIZES]
    with pytest.raises(CalibrationError, match="does not grow with size"):
        fit_algo_cost("nvrar", flat, host)


def test_calibrate_nccl_moves_the_ll_entries_and_keeps_the_protocol_switch():
    host = PRESETS["h200x2"]
    ms = [AllReduceMeasurement("x", "nccl", "nccl", s, "bfloat16", 1, 2, True, 12.0 + s / 100e3) for s in SIZES]
    spec, fits, skipped = calibrate(ms, host)
    assert [f.algo for f in fits] == ["nccl"] and not skipped
    assert spec.algos["nccl_ring/LL"].bw_efficiency == spec.algos["nccl_tree/LL"].bw_efficiency
    assert spec.algos["nccl_ring/Simple"].picked_above_bytes >= max(SIZES)
    for s in SIZES:
        assert allreduce_time_us("nccl", s, spec, 1, 2) == pytest.approx(12.0 + s / 100e3, rel=0.02)


def test_cli_writes_a_preset_that_loads(tmp_path, bench):
    row, bench_doc = bench
    src = tmp_path / "sweep.json"
    rows = [row("nccl", s, 11.0 + s / 80e3) for s in SIZES] + [row("gloo", 4096, 100.0)]
    rows += [row("auto", s, 2.0 + s / 150e3, topology="2x1", ran="nvrar") for s in SIZES]
    rows += [row("nvrar", 4096, 1e9, wrong=3)]  # wrong results are not timings
    src.write_text(json.dumps(bench_doc(rows)))
    out = tmp_path / "fitted.json"
    args = Namespace(files=[src], cluster="h200x2", max_bytes="4MiB", name="lab", out=out, results=tmp_path)
    assert cal.run(args) == 0
    spec = load_cluster(out)
    assert spec.name == "lab"
    assert allreduce_time_us("nvrar", 2 ** 20, spec, 2, 1) == pytest.approx(2.0 + 2 ** 20 / 150e3, rel=0.05)


def test_parse_bytes():
    assert parse_bytes("4MiB") == 4 << 20 and parse_bytes("128K") == 128 << 10 and parse_bytes("100") == 100
