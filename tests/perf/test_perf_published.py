import json

import numpy as np
import pytest

from spanllm.cli import main
from spanllm.perf.published import POINTS_FILE, load_points, point_records


def test_points_name_their_sources_and_roles():
    pts = load_points()
    assert len(pts) >= 4 and all(p.source_url.startswith("https://") and p.rows for p in pts)
    assert {p.role for p in pts} <= {"check", "model"}


def test_nccl_tuner_points_check_the_transcription_hand_computed():
    """NCCL's own tuner on 2 x 8 H100 (nccl#1453): tree/LL 25.9 us at 4 KiB. The table: graph node 0.5 + base 6.8
    + 2 x 7 NVLink steps x 0.6 + 2 network steps x 5.0 + 2 x 4096 x 2 / 8 NICs / (50 GB/s x 0.5) = 25.78192."""
    recs = {r["label"]: r for r in point_records(load_points())}
    r = recs["nccl_tree 2x8 4096 B (nccl-1453-2x8-h100-tuner)"]
    assert r["predicted"] == pytest.approx(0.5 + 6.8 + 8.4 + 10.0 + 2 * 4096 * 2 / 8 / 25e3)
    assert r["rel_error"] == pytest.approx(25.78192 / 25.874907 - 1) and r["in_range"]
    assert r["category"] == "published/model"


def test_every_record_has_an_error_and_a_range_around_its_prediction():
    for r in point_records(load_points()):
        assert r["range"][0] <= r["predicted"] <= r["range"][1]
        assert r["rel_error"] == pytest.approx((r["predicted"] - r["measured"]) / r["measured"])


def test_points_file_is_plain_json():
    assert json.loads(POINTS_FILE.read_text())["points"]


def test_plan_prints_ranges_and_accepts_a_calibrated_file(tmp_path, capsys):
    from spanllm.perf.hardware import PRESETS, save_cluster

    f = tmp_path / "mine.json"
    save_cluster(PRESETS["perlmutter"], f)
    out = tmp_path / "plan.json"
    argv = ["plan", "--model", "llama3.1-70b", "--cluster", str(f), "--nodes", "2", "--batch", "8", "--prompt", "128"]
    assert main([*argv, "--decode", "64", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    row = doc["rows"][0]
    lo, hi = row["e2e_ms_range"]
    assert lo <= row["e2e_ms"] <= hi and row["e2e_drivers"] and 0 <= row["wins"] <= row["scenarios"]
    # ranked by the high end of the range among fitting rows
    highs = [r["e2e_ms_range"][1] for r in doc["rows"] if r["fits"]]
    assert highs == sorted(highs)
    assert "Ranges in brackets" in capsys.readouterr().out


def test_prediction_band_is_the_student_t_interval_of_the_log_errors():
    from spanllm.perf.published import prediction_band

    # errors +10% and -10%: log(1.1), log(0.9); mean m, sd s; 80% interval with t(0.90, 1) = 3.078
    logs = np.log([1.1, 0.9])
    m, s = logs.mean(), logs.std(ddof=1)
    half = 3.078 * s * np.sqrt(1 + 1 / 2)
    lo, hi = prediction_band([0.1, -0.1])
    assert lo == pytest.approx(np.exp(-m - half)) and hi == pytest.approx(np.exp(-m + half))
    assert prediction_band([0.2]) == (0.0, float("inf"))
    # every source over-predicted by 25%: the band is centred on measured = predicted / 1.25 and has no width
    assert prediction_band([0.25, 0.25, 0.25]) == pytest.approx((0.8, 0.8))
