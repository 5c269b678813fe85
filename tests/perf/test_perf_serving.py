"""The serving planner: the scheduler replayed in simulated time, and `spanllm plan --serve` against the serving
runs committed under results/h200/engine_speed (Llama 3.1 8B on one H200, the committed ShareGPT sample)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from spanllm.cli import main
from spanllm.perf.hardware import PRESETS
from spanllm.perf.model_shape import get_model
from spanllm.perf.serving import EngineLimits, ServeLayout, ServeRequest, kv_blocks, serve_layouts, simulate

ROOT = Path(__file__).resolve().parents[2]
RUNS = ROOT / "results/h200/engine_speed"
SAMPLE = "results/h200/inputs/sharegpt_llama3_seed0_n1000.json"


def test_simulate_times_every_request_by_the_steps_it_waits():
    # every step costs 1 s. Request 0 (prompt 20, output 3) and 1 (prompt 5, output 1) at t=0, request 2
    # (prompt 4, output 2) at t=10.5, 16 tokens a step: steps 1-4 as in the replay test (request 1's token at
    # t=2, request 0's at t=2, 3, 4); the clock idles to 10.5; request 2's prompt runs in [10.5, 11.5], its
    # decode in [11.5, 12.5].
    reqs = [ServeRequest(20, 3), ServeRequest(5, 1), ServeRequest(4, 2, 10.5)]
    run = simulate(reqs, EngineLimits(2, 16, num_blocks=64, block_size=4), lambda step: 1.0)
    assert [(t.first_token_s, t.finish_s) for t in run.timings] == [(2.0, 4.0), (2.0, 2.0), (11.5, 12.5)]
    assert [t.ttft_s for t in run.timings] == [2.0, 2.0, 1.0]
    assert [t.tpot_s for t in run.timings] == [1.0, None, 1.0]
    assert run.steps == 6 and run.duration_s == 12.5 and run.output_tokens == 6
    assert run.percentile_ms("tpot", 50) == 1000.0 and run.percentile_ms("ttft", 50) == 2000.0


def test_layouts_and_memory():
    m70, c = get_model("70b"), PRESETS["dgx-h100"]
    lays = serve_layouts(m70, c, 16)
    assert ServeLayout(8, 2, 1) in lays and ServeLayout(8, 1, 2) in lays and ServeLayout(16, 1, 1) in lays
    assert all(x.gpus == 16 for x in lays) and ServeLayout(3, 1, 1) not in lays
    assert kv_blocks(m70, c, ServeLayout(1, 1, 16), EngineLimits()) <= 0  # 141 GB of weights on an 80 GB GPU
    assert kv_blocks(m70, c, ServeLayout(8, 1, 2), EngineLimits()) > 10_000


def _plan(tmp_path, *extra) -> dict:
    out = tmp_path / "serve.json"
    argv = ["plan", "--serve", "--model", "llama3.1-8b", "--cluster", "h200x2", "--nodes", "1", "--gpus", "1"]
    assert main([*argv, "--samples-file", SAMPLE, "--no-ranges", "--json", str(out), *extra]) == 0
    doc = json.loads(out.read_text())
    assert doc["rows"][0]["layout"] == "TP1" and len(doc["rows"]) == 1
    return doc["rows"][0]


@pytest.mark.parametrize(
    "max_num_seqs, files",
    [
        (256, ["call12_profile", "call13_mixed_decode", "call14_final_kernels", "call16_sampler", "call9_serve"]),
        (192, ["call13_mixed_decode/throughput_llama3.1-8b_s192.json"]),
    ],
)
def test_plan_serve_predicts_the_offline_throughput_runs(tmp_path, max_num_seqs, files):
    row = _plan(tmp_path, "--max-num-seqs", str(max_num_seqs))
    for f in files:
        path = RUNS / f if f.endswith(".json") else RUNS / f / "throughput_llama3.1-8b.json"
        run = json.loads(path.read_text())
        assert run["engine"]["describe"].count(f"max_num_seqs {max_num_seqs},") == 1
        measured = run["output_tokens_per_second"]
        assert row["output_tok_s"] == pytest.approx(measured, rel=0.15), (f, row["output_tok_s"], measured)


def test_plan_serve_predicts_the_rate_sweep(tmp_path):
    sweep = json.loads((RUNS / "call9_serve/serve_sweep_llama3.1-8b.json").read_text())
    assert sweep["settings"]["engine_flags"] == "--min-admit 32" and sweep["settings"]["seed"] == 0
    for measured in sweep["rows"]:
        rate = str(measured["request_rate"])
        row = _plan(tmp_path, "--request-rate", rate, "--min-admit", "32", "--seed", "0")
        assert row["tpot_p50_ms"] == pytest.approx(measured["median_tpot_ms"], rel=0.15), (rate, row)
        assert row["output_tok_s"] == pytest.approx(measured["output_throughput"], rel=0.15), (rate, row)


def test_plan_serve_ranges_hold_the_nominal_and_the_measured_offline_run(tmp_path):
    out = tmp_path / "serve.json"
    argv = ["plan", "--serve", "--model", "llama3.1-8b", "--cluster", "h200x2", "--nodes", "1", "--gpus", "1"]
    assert main([*argv, "--samples-file", SAMPLE, "--json", str(out), "--slo-tpot-ms", "200"]) == 0
    row = json.loads(out.read_text())["rows"][0]
    lo, hi = row["output_tok_s_range"]
    assert lo < row["output_tok_s"] < hi and lo < 9887 < hi  # call 14's offline run
    assert row["meets_slo"] is True and row["tpot_p99_ms_range"][0] <= row["tpot_p99_ms"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--cluster", "perlmuter"], "--cluster 'perlmuter': unknown cluster; choose one of h200x2, dgx-h100"),
        (["--model", "llama3.1-7b"], "--model 'llama3.1-7b': unknown model; choose one of llama3.1-8b"),
        (["--nodes", "0"], "--nodes 0: must be an integer in [1, 4096]"),
        (["--cluster", "h200x2", "--nodes", "2"], "--nodes 2: must be an integer in [1, 1]; cluster h200x2 is one"),
        (["--batch", "0"], "--batch 0: must be an integer in [1, 10000000]"),
        (["--prompt", "-3"], "--prompt -3: must be an integer in [1, 10000000]"),
        (["--top", "-1"], "--top -1: must be an integer >= 0"),
        (["--serve"], "--serve needs the requests, one of: --samples-file FILE"),
        (["--serve", "--lengths", "10"], "--lengths '10': expected PROMPT:OUTPUT"),
        (["--serve", "--lengths", "8:8", "--request-rate", "0"], "--request-rate 0: must be > 0"),
        (["--serve", "--lengths", "8:8", "--gpus", "99"], "--gpus 99: must be an integer in [1, 32]"),
        (["--serve", "--lengths", "8:8", "--max-num-seqs", "0"], "--max-num-seqs 0: must be an integer in [1, 65536]"),
        (["--serve", "--lengths", "8:8", "--min-admit", "300"], "--min-admit 300: must be an integer in [1, 256]"),
        (["--serve", "--lengths", "8:8", "--slo-tpot-ms", "-1"], "--slo-tpot-ms -1: must be a finite number"),
        (["--serve", "--samples-file", "nope.json"], "--samples-file 'nope.json': no such file"),
        (["--json", __file__ + "/x.json"], f"--json {__file__}/x.json: cannot create its folder {__file__}"),
    ],
)
def test_plan_errors_are_one_line_before_any_work(argv, message, capsys):
    assert main(["plan", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("spanllm: error: " + message), err
