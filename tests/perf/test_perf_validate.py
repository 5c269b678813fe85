import json

import pytest

from spanllm.cli import main
from spanllm.perf import validate as val
from spanllm.perf.hardware import PRESETS
from spanllm.perf.inference import Layout, Workload, estimate
from spanllm.perf.model_shape import MODELS

SIZES = [2**k for k in range(12, 23)]


def engine_doc():
    m = MODELS["llama3.1-8b"]
    rows = []
    for tp, pp, algo in ((2, 1, "nccl"), (2, 1, "nvrar"), (1, 2, "nccl")):
        e = estimate(m, PRESETS["h200x2"], Layout(tp, pp), Workload(4, 256, 32), algo)
        rows.append(
            {
                "model": "llama3.1-8b",
                "truncated_layers": None,
                "tp": tp,
                "pp": pp,
                "micro_batches": 1,
                "batch": 4,
                "prompt_len": 256,
                "decode_len": 32,
                "workload": "decode-heavy",
                "allreduce": algo,
                "allreduce_ran": algo,
                "dtype": "bfloat16",
                "ttft_ms": e.ttft_ms * 1.2,
                "tpot_ms": e.tpot_ms * 0.9,
                "e2e_ms": e.e2e_ms,
                "throughput_tok_s": 1.0,
                "breakdown_ms": {},
                "cuda_graphs": True,
            }
        )
    rows[2]["allreduce_ran"] = "none"  # what the engine writes at tp 1
    rows[1]["model"] = "llama3.1-8b:layers=32"  # the engine's preset spelling
    rows[1]["allreduce_ran"] = "nvrar[os/b8x256w4]"  # the launch the tuned table chose, as the engine writes it
    rows.append({**rows[0], "model": "mystery-3b"})  # unknown models are skipped, with why
    return {"kind": "batch", "machine": {}, "versions": {}, "settings": {"ranks_per_node": 2}, "rows": rows}


@pytest.fixture
def results(tmp_path, bench):
    row, bench_doc = bench
    # a host sweep: linear truth per algorithm on both topologies (nvrar's intercept above the preset's
    # per-call cost 0.5 + 3.130 us: rows without a launch tag all price as one-shot on 1x2, one phase
    # count, so base_us is kept from the preset there)
    truth = {"nccl": (11.0, 80e3), "torch_two_shot": (6.5, 300e3), "nvrar": (5.0, 150e3)}
    rows = []
    for algo, (a, bw) in truth.items():
        for topo in ("1x2", "2x1") if algo == "nvrar" else ("1x2",):
            rows += [row(algo, s, a + s / bw, topology=topo) for s in SIZES]
    rows.append(row("ref_ring", 4096, 900.0))
    (tmp_path / "allreduce_h200.json").write_text(json.dumps(bench_doc(rows)))
    (tmp_path / "batch_8b.json").write_text(json.dumps(engine_doc()))
    (tmp_path / "notes.json").write_text(json.dumps({"kind": "tuning"}))
    return tmp_path


def test_report_on_synthetic_results(results):
    rep = val.validate(results, PRESETS["h200x2"])
    cats = rep["summary"]
    assert {
        "allreduce/preset",
        "allreduce/holdout-sizes",
        "allreduce/cross-topology",
        "engine/ttft",
        "engine/tpot",
        "engine/e2e",
    } <= set(cats)
    # linear truths are recovered from every other size: held-out errors are small
    assert cats["allreduce/holdout-sizes"]["median_abs_rel_error"] < 0.05
    # the engine rows were built from the preset model with TTFT x 1.2 and TPOT x 0.9; validation prices
    # them with all-reduce constants calibrated on the sweep, so the errors are near |1/1.2 - 1|, |1/0.9 - 1|
    assert cats["engine/ttft"]["median_abs_rel_error"] == pytest.approx(1 - 1 / 1.2, abs=0.06)
    assert cats["engine/tpot"]["median_abs_rel_error"] == pytest.approx(1 / 0.9 - 1, abs=0.06)
    # no record was predicted by a fit that included it
    for r in rep["records"]:
        if r["category"] == "allreduce/holdout-sizes":
            size = int(r["label"].split()[2])
            assert str(size) not in r["fitted_on"].replace("[", " ").replace("]", " ").replace(",", " ").split()
        if r["category"] == "allreduce/cross-topology":
            topo = r["label"].split()[1]
            assert topo not in r["fitted_on"]
    assert any("ref_ring" in s for s in rep["skipped"]) and any("mystery-3b" in s for s in rep["skipped"])
    assert any("notes.json" in s for s in rep["skipped"])
    assert {c["cluster"] for c in rep["paper_claims"]} == {"perlmutter", "vista"}
    assert sum(r["category"] == "engine/tpot" for r in rep["records"]) == 3  # all three known-model rows
    assert not any("nvrar" in s for s in rep["skipped"])  # 'nvrar[os/...]' is nvrar with a launch
    assert {r["group"] for r in rep["records"] if r["category"] == "engine/e2e"} == {
        "llama3.1-8b TP2 nccl",
        "llama3.1-8b TP2 nvrar",
        "llama3.1-8b TP1xPP2 m=1",
    }
    # no file here holds the rows the preset's engine constants came from: nothing scored as fitted
    assert not any(r["category"].startswith("engine-fit/") for r in rep["records"])
    assert rep["engine_fit"]["n_rows"] == 0 and rep["engine_fit"]["refit"].startswith("not rerun")


def test_cli_writes_report_and_plot_where_out_says(results, tmp_path, capsys):
    before = sorted(p.name for p in results.iterdir())
    assert main(["perf", "validate", "--results", str(results), "--rows", "5"]) == 0
    assert "report not written" in capsys.readouterr().out
    assert sorted(p.name for p in results.iterdir()) == before  # without --out nothing is written
    out_file = results.parent / f"{results.name}-report" / "v.json"
    out_file.parent.mkdir()
    assert main(["perf", "validate", "--results", str(results), "--rows", "5", "--out", str(out_file)]) == 0
    rep = json.loads(out_file.read_text())
    assert rep["records"] and out_file.with_suffix(".png").stat().st_size > 1000
    assert sorted(p.name for p in results.iterdir()) == before
    out = capsys.readouterr().out
    assert "median |relative error| per category" in out
    # the report itself is not read back as a measurement
    assert val.validate(results, PRESETS["h200x2"])["measurements"] == rep["measurements"]


def test_no_measurements_is_said_clearly_and_nothing_is_written(tmp_path, capsys):
    assert main(["perf", "validate", "--results", str(tmp_path), "--out", str(tmp_path / "v.json")]) == 2
    err = capsys.readouterr().err
    assert "no measurement" in err and "nothing checked" in err and len(err.strip().splitlines()) == 1
    assert list(tmp_path.iterdir()) == []
    rep = val.validate(tmp_path, PRESETS["h200x2"])  # the report itself still holds the published points
    assert rep["records"] == [] and rep["summary"] == {} and len(rep["paper_claims"]) == 4 and rep["published"]


def test_missing_results_folder_exits_nonzero_and_creates_nothing(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # outside the repo: the default --results is ./results

    assert main(["perf", "validate", "--results", "results"]) == 2
    err = capsys.readouterr().err
    assert "is not a folder" in err and len(err.strip().splitlines()) == 1
    assert list(tmp_path.iterdir()) == []


def test_rel_error():
    assert val.rel_error(11.0, 10.0) == pytest.approx(0.1) and val.rel_error(9.0, 10.0) == pytest.approx(-0.1)


def test_lab_results_meet_the_target_without_scoring_fitted_rows():
    """results/ as committed: the h200x2 preset's fitted rows are not scored, and every all-reduce category
    stays within the issue's 15% median |error| (this changes only when results/ or hardware.py do)."""
    from pathlib import Path

    from spanllm.perf.hardware import H200X2_FIT

    root = Path(__file__).resolve().parents[2]
    rep = val.validate(root / "results", PRESETS["h200x2"])
    for r in rep["records"]:
        if r["category"] == "allreduce/preset" and r["source"].endswith(H200X2_FIT.file):
            assert int(r["label"].split()[2]) not in H200X2_FIT.sizes, r["label"]
    assert any("rows left out, the preset's constants were fitted to them" in s for s in rep["skipped"])
    assert rep["preset_fit"]["file"] == H200X2_FIT.file and "nvrar" in rep["preset_constants"]
    for cat in ("allreduce/preset", "allreduce/holdout-sizes", "allreduce/cross-topology"):
        assert rep["summary"][cat]["median_abs_rel_error"] < 0.15, cat


def test_lab_engine_rows_held_out_from_the_engine_fit():
    """results/ as committed: the 6 rows the engine constants were fitted to and the 8 70B TP=2 NCCL rows the
    prefill size exponent was fitted to are scored apart (engine-fit/), every other engine row is held out; the
    held-out end-to-end median |error| is within 20%, TTFT within 10% and within 20% for every layout."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    rep = val.validate(root / "results", PRESETS["h200x2"])
    assert not any("engine row" in s for s in rep["skipped"])  # every engine row is priced
    fitted = [r for r in rep["records"] if r["category"] == "engine-fit/e2e"]
    assert len(fitted) == 14 and {r["group"] for r in fitted} == {"llama3.1-8b TP2 nccl", "llama3.1-70b TP2 nccl"}
    held = [r for r in rep["records"] if r["category"] == "engine/e2e"]
    # 8B and 70B studies (TP=2 nvrar, PP=2 with 1 and 2 micro-batches; 8B TP=2 nccl of the batch runs), the 8B
    # batch runs of 2026-11-30 (TP=2 nccl / nvrar, batch 1-64), and the two 70B prefill-heavy PP=2 m=2 rows of
    # the second 11-30 session (batch 32 / 64). Compiled / skinny rows are listed as skipped (not modelled).
    assert len(held) == 54
    assert all("batch_llama3.1-8b" in r["source"] for r in held if r["group"] == "llama3.1-8b TP2 nccl")
    assert any("study_llama3.1-70b_prefill-heavy.json" in r["source"] for r in held)
    assert rep["summary"]["engine/e2e"]["median_abs_rel_error"] <= 0.20
    assert rep["summary"]["engine/ttft"]["median_abs_rel_error"] <= 0.10
    for group, v in rep["summary_by_group"].items():
        if group.startswith("engine/ttft"):
            assert v["median_abs_rel_error"] <= 0.20, group
    assert rep["engine_fit"]["n_rows"] == 6 and isinstance(rep["engine_fit"]["refit"], dict)


def test_published_points_leave_one_source_out():
    """The published multi-node figures: each source predicted by the hop model fitted to the others; the
    per-source table names the sources it does not explain (this changes only with published_points.json)."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    rep = val.validate(root / "results", PRESETS["h200x2"])
    loso = [r for r in rep["published"] if r["category"] == "published/loso"]
    assert len(loso) == 29 and len({r["source"] for r in loso}) == 6
    assert all(r["range"][0] <= r["predicted"] <= r["range"][1] for r in loso)
    acc = rep["summary_published"]["published/loso (acceptance)"]
    # as committed: median |error| 16.3%, 25 of 29 rows inside their range (86%); the four outside are DGX Spark's
    assert acc["median_abs_rel_error"] == pytest.approx(0.163, abs=0.001) and acc["in_range_share"] == 25 / 29
    assert {r["source"] for r in loso if not r["in_range"]} == {
        "https://github.com/NVIDIA/dgx-spark-playbooks/pull/103"
    }
    per = rep["published_per_source"]
    assert per["https://github.com/NVIDIA/nccl/issues/1453"]["note"].startswith("its reporter called the run poor")
    unexplained = sorted(s for s, v in per.items() if not v["explained"])
    assert unexplained == [
        "https://github.com/NVIDIA/dgx-spark-playbooks/pull/103",
        "https://github.com/NVIDIA/nccl-tests/issues/150",
        "https://github.com/NVIDIA/nccl/issues/1453",
    ]
