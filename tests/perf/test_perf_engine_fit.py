import json
from dataclasses import replace
from pathlib import Path

import pytest

from spanllm.perf.engine_fit import ENGINE_ALLREDUCE_MAX_BYTES, compass_search, fit_engine, predict_row, row_case
from spanllm.perf.hardware import ENGINE_FITS, PRESETS, EngineCost
from spanllm.perf.measurements import EngineMeasurement, load_results, result_files, study_log_rows

ROOT = Path(__file__).resolve().parents[2]


def _row(**kw):
    row = {
        "model": "llama3.1-8b",
        "tp": 2,
        "pp": 1,
        "micro_batches": 1,
        "batch": 8,
        "prompt_len": 128,
        "decode_len": 512,
        "allreduce": "nccl",
        "allreduce_ran": "nccl",
        "cuda_graphs": True,
    }
    return {**row, **kw}


def test_row_case_reads_the_algorithm_the_engine_ran():
    case = row_case(
        _row(allreduce="nvrar", allreduce_ran="nvrar[os/b8x256w4]", allreduce_ran_prefill="nvrar[rs/b64x1024w8]")
    )
    assert (case.algo, case.prefill_algo) == ("nvrar", "nvrar")
    assert row_case(_row(allreduce_ran="auto->nvrar[os/b8x256w4]", allreduce_ran_prefill="nccl")).prefill_algo == "nccl"
    assert row_case(_row(tp=1, pp=2, allreduce_ran="none", allreduce_ran_prefill="none")).algo == "nccl"
    # not recorded (study logs): the engine's rule, buffered backend up to 2 MiB, NCCL above
    assert ENGINE_ALLREDUCE_MAX_BYTES == 2 * 1024 * 1024
    small = row_case(_row(allreduce_ran="nvrar[os/b8x256w4]", batch=1, prompt_len=128))  # 128 x 4096 x 2 = 1 MiB
    large = row_case(_row(allreduce_ran="nvrar[os/b8x256w4]", batch=1, prompt_len=2048))  # 16 MiB
    assert small.prefill_algo == "nvrar" and large.prefill_algo == "nccl"
    with pytest.raises(ValueError, match="unknown all-reduce algorithm 'mystery'"):
        row_case(_row(allreduce_ran="mystery[x]"))


def test_compass_search_finds_a_bowl_minimum():
    x, best = compass_search(
        lambda p: (p["a"] - 3.0) ** 2 + (p["b"] + 1.0) ** 2,
        {"a": 0.0, "b": 0.0},
        {"a": 1.0, "b": 1.0},
        {"a": (0.0, 10.0), "b": (-5.0, 5.0)},
    )
    assert x["a"] == pytest.approx(3.0, abs=1e-4) and x["b"] == pytest.approx(-1.0, abs=1e-4) and best < 1e-8
    # bounds hold: the minimum of (a + 2)^2 on a >= 0 is at 0
    x, _ = compass_search(lambda p: (p["a"] + 2.0) ** 2, {"a": 1.0}, {"a": 1.0}, {"a": (0.0, 10.0)})
    assert x["a"] == 0.0


def test_fit_recovers_known_engine_constants():
    """Rows the model itself produced with known constants (the fit set's layout and workloads) give them back."""
    truth = EngineCost(
        decode_layer_us=60.0,
        attn_position_ns=25.0,
        attends_max_seq_len=True,
        eager_layer_host_us=900.0,
        prefill_efficiency=0.5,
    )
    cluster = replace(PRESETS["h200x2"], engine=truth)
    rows = []
    for prompt, decode in ((128, 512), (2048, 32)):
        for b in (1, 8, 64):
            row = _row(batch=b, prompt_len=prompt, decode_len=decode)
            e = predict_row(row, cluster)
            rows.append(
                EngineMeasurement("synthetic.json", "study", {**row, "ttft_ms": e.ttft_ms, "tpot_ms": e.tpot_ms})
            )
    fit = fit_engine(rows, replace(cluster, engine=EngineCost()))
    for name in ("decode_layer_us", "attn_position_ns", "eager_layer_host_us", "prefill_efficiency"):
        assert getattr(fit.cost, name) == pytest.approx(getattr(truth, name), rel=1e-3), name
    assert fit.rms_rel_error["tpot"] < 1e-4 and len(fit.rows) == 6


def test_host_preset_engine_constants_come_from_the_fit():
    """Re-running the engine fit on the rows hardware.ENGINE_FITS names gives the preset's EngineCost."""
    from spanllm.perf.calibrate import calibrate

    ar, eng, _ = load_results(result_files(ROOT / "results"))
    host = PRESETS["h200x2"]
    cluster = calibrate(ar, host)[0]
    rows = [e for e in eng if ENGINE_FITS["h200x2"].selects(e.source, e.row)]
    assert len(rows) == 6 and {e.row["batch"] for e in rows} == {1, 8, 64}
    fit = fit_engine(rows, cluster)
    for name in ("decode_layer_us", "attn_position_ns", "eager_layer_host_us", "prefill_efficiency"):
        assert getattr(fit.cost, name) == pytest.approx(getattr(host.engine, name), rel=2e-3), name


LOG = """# stdout of a study
=== 23:03:13 bench study llama3.1-70b prefill-heavy
study: llama3.1-70b on 2 ranks (1x2 nodes x ranks)
  TP=2 PP=1 mb=1 batch=8 nvrar->nvrar[os/b32x1024w8]: TTFT 2296.71 ms, TPOT 28.207 ms, E2E 3171.1 ms, 80.7 tok/s
  TP=1 PP=2 mb=1 batch=1 none->none: TTFT 495.96 ms, TPOT 41.789 ms, E2E 1791.4 ms, 17.9 tok/s
=== 23:05:00 done rc=1
"""


def test_study_log_rows(tmp_path):
    rows = study_log_rows(LOG, "x.log")
    assert len(rows) == 2
    r = rows[0]
    assert (r["model"], r["tp"], r["pp"], r["micro_batches"], r["batch"]) == ("llama3.1-70b", 2, 1, 1, 8)
    assert (r["prompt_len"], r["decode_len"], r["allreduce_ran"]) == (2048, 32, "nvrar[os/b32x1024w8]")
    assert (r["ttft_ms"], r["tpot_ms"], r["e2e_ms"], r["log_line"]) == (2296.71, 28.207, 3171.1, 4)
    assert "allreduce_ran_prefill" not in r and rows[1]["allreduce_ran"] == "none"
    # a log counts only while its study has no JSON
    (tmp_path / "study_a.log").write_text(LOG)
    (tmp_path / "study_b.log").write_text(LOG)
    (tmp_path / "study_b.json").write_text('{"kind": "study", "rows": []}')
    assert [p.name for p in result_files(tmp_path)] == ["study_a.log", "study_b.json"]
    (tmp_path / "study_a.partial.json").write_text('{"kind": "study", "rows": []}')  # a cut run's rows
    assert [p.name for p in result_files(tmp_path)] == ["study_a.partial.json", "study_b.json"]
    (tmp_path / "study_a.partial.json").unlink()
    _, eng, _ = load_results(result_files(tmp_path))
    assert len(eng) == 2 and {e.kind for e in eng} == {"study-log"}


def test_cpu_runs_are_skipped_with_a_reason(tmp_path):
    """The presets model GPU machines: a benchmark JSON whose machine record lists no GPUs is not priced."""
    row = {"size": 1024, "algo": "gloo", "ran": "gloo", "time_us": 50.0, "ranks_per_node": 2, "world_size": 4}
    (tmp_path / "cpu.json").write_text(
        json.dumps({"kind": "allreduce", "machine": {"gpus": []}, "settings": {"topology": "2x2"}, "rows": [row]})
    )
    (tmp_path / "tiny.json").write_text(
        json.dumps({"kind": "study", "machine": {"gpus": []}, "rows": [{"model": "tiny"}]})
    )
    ar, eng, skipped = load_results(result_files(tmp_path))
    assert ar == [] and eng == []
    assert sorted(skipped) == [
        f"{tmp_path / n}: a CPU run (no GPUs in its 'machine' record): the presets model GPU machines"
        for n in ("cpu.json", "tiny.json")
    ]


def test_compiled_and_skinny_rows_are_skipped_with_a_reason(tmp_path):
    """The engine constants describe the eager forward with F.linear: rows of a compiled step or of the
    skinny GEMM are listed as skipped, the file's other rows still count."""
    rows = [
        {"model": "llama3.1-8b", "batch": 1},
        {"model": "llama3.1-8b", "batch": 1, "compile_decode": True},
        {"model": "llama3.1-8b", "batch": 1, "decode_gemm": "skinny"},
        {"model": "llama3.1-8b", "batch": 8, "decode_gemm": "torch", "compile_decode": False},
    ]
    (tmp_path / "batch_x.json").write_text(json.dumps({"kind": "batch", "machine": {"gpus": ["H200"]}, "rows": rows}))
    _, eng, skipped = load_results(result_files(tmp_path))
    assert [e.row["batch"] for e in eng] == [1, 8] and not any(e.row.get("compile_decode") for e in eng)
    assert skipped == [
        f"{tmp_path / 'batch_x.json'}: 2 rows with a compiled decode step or decode_gemm other than 'torch': "
        "the engine model's constants describe the eager forward with F.linear"
    ]


def test_prefill_efficiency_grows_with_the_gemm_size_per_gpu(make_cluster):
    from spanllm.perf.inference import prefill_efficiency

    c = make_cluster(
        engine={"prefill_efficiency": 0.4, "prefill_ref_layer_params": 100.0, "prefill_size_exponent": 0.5}
    )
    assert prefill_efficiency(c, 100.0) == 0.4 and prefill_efficiency(c, 400.0) == pytest.approx(0.8)
    assert prefill_efficiency(c, 1e6) == 1.0  # never above peak
    assert prefill_efficiency(c) == 0.4  # no size given: the fitted figure


def test_the_size_exponent_is_the_fit_of_the_70b_rows():
    from spanllm.perf.calibrate import calibrate
    from spanllm.perf.engine_fit import fit_prefill_size_exponent
    from spanllm.perf.hardware import PREFILL_SIZE_FITS, PRESETS
    from spanllm.perf.measurements import load_results, result_files

    root = Path(__file__).resolve().parents[2]
    ar, eng, _ = load_results(result_files(root / "results"))
    cluster = replace(calibrate(ar, PRESETS["h200x2"])[0], name="h200x2")
    rows = [e for e in eng if PREFILL_SIZE_FITS["h200x2"].selects(e.source, e.row)]
    assert len(rows) == 8
    alpha, rms = fit_prefill_size_exponent(rows, cluster)
    assert alpha == pytest.approx(PRESETS["h200x2"].engine.prefill_size_exponent) and rms < 0.2
