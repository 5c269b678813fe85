"""`spanllm generate`, `spanllm bench batch` and `spanllm bench study` end to end on local gloo ranks."""

from __future__ import annotations

import json

import pytest
from engine_workers import NEW_TOKENS, PROMPTS

from spanllm.cli import main

ROW_KEYS = {
    "model",
    "truncated_layers",
    "tp",
    "pp",
    "micro_batches",
    "batch",
    "prompt_len",
    "decode_len",
    "workload",
    "allreduce",
    "allreduce_ran",
    "dtype",
    "ttft_ms",
    "tpot_ms",
    "e2e_ms",
    "throughput_tok_s",
    "breakdown_ms",
    "cuda_graphs",
}
BREAKDOWN_KEYS = {"gemm", "attention", "allreduce", "pipeline", "idle", "other"}


def test_generate_cli_tp2_matches_transformers(hf_checkpoint, hf_reference, capsys):
    single, _, _ = hf_checkpoint
    argv = [
        "generate",
        "--model",
        single,
        "--max-new-tokens",
        str(NEW_TOKENS),
        "--ignore-eos",
        "--nprocs",
        "2",
        "--allreduce",
        "gloo",
    ]
    for p in PROMPTS:
        argv += ["--prompt-ids", ",".join(map(str, p))]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "TP=2 x PP=1" in out and "all-reduce that ran (decode step, batch 3): gloo" in out
    for i, toks in enumerate(hf_reference[0]):
        assert f"[{i}] generated ids: {','.join(map(str, toks))}" in out


def test_generate_cli_rejects_text_prompt_for_preset(capsys):
    assert main(["generate", "--model", "tiny", "--prompt", "hello"]) == 2
    assert "spanllm: error: --prompt needs a checkpoint directory" in capsys.readouterr().err


def _load(path) -> dict:
    with open(path) as f:
        return json.load(f)


def test_bench_batch_json_schema(tmp_path, capsys):
    js, png = tmp_path / "batch.json", tmp_path / "batch.png"
    assert (
        main(
            [
                "bench",
                "batch",
                "--model",
                "tiny:layers=2",
                "--nprocs",
                "2",
                "--batch-sizes",
                "1,2",
                "--prompt-len",
                "8",
                "--decode-len",
                "4",
                "--allreduce",
                "gloo,ref_ring",
                "--iters",
                "1",
                "--warmup",
                "0",
                "--json",
                str(js),
                "--plot",
                str(png),
            ]
        )
        == 0
    )
    doc = _load(js)
    assert doc["kind"] == "batch" and {"machine", "versions", "settings", "rows"} <= set(doc)
    rows = doc["rows"]
    assert [(r["allreduce"], r["batch"]) for r in rows] == [("gloo", 1), ("gloo", 2), ("ref_ring", 1), ("ref_ring", 2)]
    for r in rows:
        assert ROW_KEYS <= set(r)
        assert set(r["breakdown_ms"]) == BREAKDOWN_KEYS
        assert r["allreduce_ran"] == r["allreduce"]
        assert (r["truncated_layers"], r["tp"], r["pp"], r["prompt_len"], r["decode_len"]) == (2, 2, 1, 8, 4)
        assert r["cuda_graphs"] is False and r["dtype"] == "float32"
        assert r["e2e_ms"] > r["ttft_ms"] > 0
        assert r["throughput_tok_s"] == pytest.approx(r["batch"] * 4 / (r["e2e_ms"] / 1e3))
    assert png.stat().st_size > 0
    assert "TRUNCATED: 2 of 4 layers" in capsys.readouterr().out


def test_bench_study_runs_every_layout(tmp_path):
    js = tmp_path / "study.json"
    assert (
        main(
            [
                "bench",
                "study",
                "--model",
                "tiny",
                "--nprocs",
                "2",
                "--batch-sizes",
                "2",
                "--prompt-len",
                "8",
                "--decode-len",
                "4",
                "--allreduce",
                "gloo",
                "--iters",
                "1",
                "--warmup",
                "0",
                "--no-breakdown",
                "--json",
                str(js),
            ]
        )
        == 0
    )
    rows = _load(js)["rows"]
    assert [(r["tp"], r["pp"], r["micro_batches"], r["allreduce"]) for r in rows] == [
        (2, 1, 1, "gloo"),
        (1, 2, 1, "none"),
        (1, 2, 2, "none"),
    ]
    assert all(r["breakdown_ms"] is None for r in rows)
    assert all(ROW_KEYS <= set(r) for r in rows)


def test_bench_study_pp_filter_tops_up_pipelined_rows(tmp_path):
    js = tmp_path / "study.json"
    assert (
        main(
            [
                "bench",
                "study",
                "--model",
                "tiny",
                "--nprocs",
                "2",
                "--batch-sizes",
                "2",
                "--prompt-len",
                "8",
                "--decode-len",
                "4",
                "--allreduce",
                "gloo",
                "--iters",
                "1",
                "--warmup",
                "0",
                "--no-breakdown",
                "--pp",
                "2",
                "--micro-batches",
                "2",
                "--json",
                str(js),
            ]
        )
        == 0
    )
    doc = _load(js)
    assert [(r["tp"], r["pp"], r["micro_batches"]) for r in doc["rows"]] == [(1, 2, 2)]
    assert any("not asked for (--pp 2)" in line for line in doc["skipped"])


@pytest.mark.parametrize("spec", ["two", "0", ","])
def test_bench_study_bad_pp_fails_before_any_rank_starts(monkeypatch, capsys, spec):
    import spanllm.commands.bench_study as study

    monkeypatch.setattr(study, "launch", lambda *a, **k: pytest.fail("ranks started for a bad --pp"))
    assert main(["bench", "study", "--model", "tiny", "--nprocs", "2", "--pp", spec]) == 2
    assert "spanllm: error: --pp" in capsys.readouterr().err


def test_bad_model_fails_before_any_rank_starts(monkeypatch, capsys):
    import spanllm.commands.bench_study as study
    from spanllm.cli import main

    monkeypatch.setattr(study, "launch", lambda *a, **k: pytest.fail("ranks started for a bad --model"))
    assert main(["bench", "study", "--model", "tiny:layers=8", "--nprocs", "2"]) == 2
    assert "--model: 'tiny:layers=8': layers=8 must be between 1 and 4" in capsys.readouterr().err
