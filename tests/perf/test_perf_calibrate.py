import json

import pytest

from spanllm.cli import main
from spanllm.perf.allreduce_model import allreduce_time_us
from spanllm.perf.calibrate import CalibrationError, calibrate, fit_algo_cost, parse_bytes
from spanllm.perf.hardware import PRESETS, load_cluster
from spanllm.perf.measurements import AllReduceMeasurement

SIZES = [2**k for k in range(12, 23)]


def test_fit_recovers_known_constants():
    host = PRESETS["h200x2"]
    # synthetic truth for the kernel's structure: 4 us per call, 1 us per NVLink phase, 50% efficiency;
    # 1x2 one-shot (1 phase) up to 256 KiB, reduce-scatter (2 phases) above; 2x1 one round + staging copy
    base, step, eff = 4.0, 1.0, 0.5
    ms = []
    for s in SIZES:
        one_shot = s <= 256 * 1024
        t = 0.5 + base + (1 if one_shot else 2) * step + 2 * s / (450e3 * eff)  # LL8: 2 x M wire bytes either way
        ms.append(
            AllReduceMeasurement(
                "x",
                "nvrar",
                "nvrar",
                s,
                "bfloat16",
                1,
                2,
                True,
                t,
                launch="os/b8x256w4" if one_shot else "rs/b64x1024w8",
            )
        )
    fit = fit_algo_cost("nvrar", ms, host)
    assert fit.fitted_base  # two phase counts separate the per-call cost from the per-phase cost
    assert (fit.cost.base_us, fit.cost.nvlink_step_us, fit.cost.bw_efficiency) == pytest.approx((base, step, eff))
    assert fit.rms_rel_error < 1e-9
    # 2x1 alone: one phase count, so base_us stays the preset's and the step cost absorbs the difference
    ms2 = [
        AllReduceMeasurement(
            "x",
            "nvrar",
            "nvrar",
            s,
            "bfloat16",
            2,
            1,
            True,
            0.5 + base + step + 2 * s / (450e3 * eff) + 2 * s / 4300e3,
            launch="rs/b8x256w4",
        )
        for s in SIZES
    ]
    fit2 = fit_algo_cost("nvrar", ms2, host)
    assert not fit2.fitted_base and fit2.cost.base_us == host.algo("nvrar").base_us
    assert fit2.cost.base_us + fit2.cost.nvlink_step_us == pytest.approx(base + step)
    assert fit2.cost.bw_efficiency == pytest.approx(eff)


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
    small = [s for s in SIZES if s <= 2 << 20]  # NCCL's low-latency range in the preset
    ms = [AllReduceMeasurement("x", "nccl", "nccl", s, "bfloat16", 1, 2, True, 12.0 + s / 100e3) for s in small]
    spec, fits, skipped = calibrate(ms, host)
    assert [f.algo for f in fits] == ["nccl"] and not skipped
    assert spec.algos["nccl_ring/LL"].bw_efficiency == spec.algos["nccl_tree/LL"].bw_efficiency
    assert spec.algos["nccl_ring/Simple"].picked_above_bytes >= max(small)
    for s in small:
        assert allreduce_time_us("nccl", s, spec, 1, 2) == pytest.approx(12.0 + s / 100e3, rel=0.02)
    # rows above the switch: a second line, fitted as Simple; LL128 is kept out of the measured range
    big = [4 << 20, 8 << 20, 16 << 20]
    ms += [AllReduceMeasurement("x", "nccl", "nccl", s, "bfloat16", 1, 2, True, 20.0 + s / 300e3) for s in big]
    spec, fits, skipped = calibrate(ms, host)
    assert [f.keys for f in fits] == [("nccl_ring/LL", "nccl_tree/LL"), ("nccl_ring/Simple", "nccl_tree/Simple")]
    assert spec.algos["nccl_ring/LL128"].picked_above_bytes >= max(big)
    for s in big:
        assert allreduce_time_us("nccl", s, spec, 1, 2) == pytest.approx(20.0 + s / 300e3, rel=0.02)
    # a single size above the switch cannot be fitted: left out, and said so
    one_big = [m for m in ms if m.nbytes <= 4 << 20]
    _, fits, skipped = calibrate(one_big, host)
    assert len(fits) == 1 and any("above 2097152 bytes" in x for x in skipped)


def test_cli_writes_a_preset_that_loads(tmp_path, bench):
    row, bench_doc = bench
    src = tmp_path / "sweep.json"
    rows = [row("nccl", s, 11.0 + s / 80e3) for s in SIZES] + [row("gloo", 4096, 100.0)]
    rows += [row("auto", s, 5.0 + s / 150e3, topology="2x1", ran="auto->nvrar[rs/b8x256w4]") for s in SIZES]
    rows += [row("nvrar", 4096, 1e9, wrong=3)]  # wrong results are not timings
    src.write_text(json.dumps(bench_doc(rows)))
    out = tmp_path / "fitted.json"
    assert main(["perf", "calibrate", str(src), "--cluster", "h200x2", "--name", "lab", "--out", str(out)]) == 0
    spec = load_cluster(out)
    assert spec.name == "lab"
    assert allreduce_time_us("nvrar", 2**20, spec, 2, 1) == pytest.approx(5.0 + 2**20 / 150e3, rel=0.05)


def test_parse_bytes():
    assert parse_bytes("4MiB") == 4 << 20 and parse_bytes("128K") == 128 << 10 and parse_bytes("100") == 100


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_calibrate_from_every_preset_on_the_committed_sweeps(preset, tmp_path, capsys):
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "mine.json"
    assert main(["perf", "calibrate", "--cluster", preset, "--results", str(root / "results"), "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "all-reduce constants fitted on" in text and f"wrote {out}" in text
    spec = load_cluster(out)  # a fitted value outside a guessed range widened the range: the file loads
    for path, (lo, hi) in spec.ranges.items():
        assert lo <= cal_value(spec, path) <= hi


def cal_value(spec, path):
    from spanllm.perf.hardware import constant_value

    return constant_value(spec, path)


def test_a_fit_outside_the_guessed_range_widens_it_and_says_so(tmp_path, bench, capsys):
    row, bench_doc = bench
    src = tmp_path / "sweep.json"
    # 2 nodes x 1 GPU, NCCL's tree at ~2 us a network step: below dgx-h100's guessed range for it
    src.write_text(json.dumps(bench_doc([row("nccl", s, 8.0 + s / 20e3, topology="2x1") for s in SIZES])))
    out = tmp_path / "fitted.json"
    assert main(["perf", "calibrate", str(src), "--cluster", "dgx-h100", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "range widened to hold the fit (nccl): algos.nccl_tree/LL.net_step_us" in text
    assert (
        load_cluster(out).ranges["algos.nccl_tree/LL.net_step_us"][0]
        < PRESETS["dgx-h100"].ranges["algos.nccl_tree/LL.net_step_us"][0]
    )


def test_no_usable_rows_is_an_error_with_the_reason_and_nothing_is_written(tmp_path, bench, capsys):
    row, bench_doc = bench
    src = tmp_path / "one_size.json"
    src.write_text(json.dumps(bench_doc([row("nccl", 4096, 12.0)])))
    out = tmp_path / "fitted.json"
    assert main(["perf", "calibrate", str(src), "--cluster", "h200x2", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "none usable for a fit on h200x2" in err
    assert "1 distinct size(s); a fit needs at least 2 sizes" in err and "nothing written" in err
    assert not out.exists()
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["perf", "calibrate", "--results", str(empty), "--out", str(out)]) == 2
    assert "no all-reduce measurements" in capsys.readouterr().err and not out.exists()
    assert main(["perf", "calibrate", "--cluster", "perlmuter", "--out", str(out)]) == 2
    assert "--cluster 'perlmuter': unknown cluster" in capsys.readouterr().err
