"""The GPU long-context scripts' CPU-testable parts: scripts/gpu_prefill_attention.py's sweep, check, best-tiling
choice and outputs with fake measurements, and scripts/gpu_long_context.py end to end on the tiny preset (CPU
engine, small prompts), including a stage failure that is recorded while the run goes on."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import time

import pytest
import torch

from spanllm.kernels.prefill_config import PrefillConfig, load_prefill_config

SCRIPTS = pathlib.Path(__file__).resolve().parents[2] / "scripts"


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_flops_count_causal_pairs_exactly():
    pa = _script("gpu_prefill_attention")
    assert pa.causal_pairs(4, 0) == 10  # 1 + 2 + 3 + 4
    assert pa.causal_pairs(4, 3) == 12 + 10
    assert pa.attention_flops(8192, 0) == 4 * 128 * 32 * (8192 * 8193 // 2)
    assert pa.tflops(10**12, 1000.0) == pytest.approx(1.0)
    cfgs = pa.sweep_configs(quick=False)
    assert len({c.label() for c in cfgs}) == len(cfgs) and all(c.rows(4) >= 64 for c in cfgs)
    assert len(pa.sweep_configs(quick=True)) == 3
    assert pa.parse_args(["out", "--quick"]).quick


def test_prefill_sweep_checks_excludes_wrong_and_failing_entries_and_writes_outputs(tmp_path):
    pa = _script("gpu_prefill_attention")
    ref = torch.zeros(4, 2, 8)
    fast_wrong = PrefillConfig(block_q=32, block_n=128, num_warps=8, num_stages=2)
    good = PrefillConfig(block_q=32, block_n=64, num_warps=8, num_stages=3)

    def entry(value, kind="kernel", config=None, fail_at=None):
        def make(prefix):
            if prefix == fail_at:
                raise RuntimeError("out of resources: shared memory")
            return (lambda: torch.full((4, 2, 8), value)), (lambda o: o)

        return {"make": make, "kind": kind, "config": config.to_dict() if config else None}

    entries = {
        "paged wrong": entry(1.0, config=fast_wrong),  # fastest, but 1.0 off: must not win
        "paged good": entry(1e-3, config=good),
        "paged broken": entry(0.0, config=good, fail_at=32768),  # right, but one prefix failed: not complete
        "sdpa flash": entry(0.0, kind="sdpa"),
    }
    speed = {"paged wrong": 1.0, "paged good": 2.0, "paged broken": 1.5, "sdpa flash": 3.0}
    current = {}

    def timer(fn, warmup, reps):
        fn()
        return [current["ms"]] * reps

    def make_wrapped(name, e):
        def make(prefix):
            current["ms"] = speed[name] * (1 + prefix / 8192)
            return e["make"](prefix)

        return {**e, "make": make}

    wrapped = {n: make_wrapped(n, e) for n, e in entries.items()}
    logs = []
    res = pa.run_sweep(
        wrapped, (0, 32768), timer, ref, warmup=1, reps=3, deadline=time.monotonic() + 60, log=logs.append
    )
    assert res["paged wrong"]["check"]["ok"] is False and res["paged good"]["check"]["ok"] is True
    assert "error" in res["paged broken"]["rows"][1] and "median_ms" in res["paged broken"]["rows"][0]
    assert res["paged good"]["rows"][0]["times_ms"] == [2.0] * 3
    assert res["paged good"]["rows"][0]["tflops"] == pytest.approx(pa.tflops(pa.attention_flops(8192, 0), 2.0))
    name, _ = pa.best_kernel(res)
    assert name == "paged good"
    doc = {"machine": {"device_name": "fake"}, "settings": {}, "results": res, "errors": []}
    pa.write_outputs(str(tmp_path), doc, log=logs.append)
    saved = json.loads((tmp_path / "prefill_attention.json").read_text())
    assert saved["best"]["name"] == "paged good"
    assert load_prefill_config(str(tmp_path / "best_prefill_config.json")) == good
    assert (tmp_path / "prefill_attention.png").stat().st_size > 1000
    # past the deadline: every entry recorded as skipped, nothing measured, no best tiling file
    late = pa.run_sweep(wrapped, (0,), timer, ref, warmup=1, reps=3, deadline=time.monotonic() - 1, log=logs.append)
    assert all(r["check"] == {"skipped": "time budget"} for r in late.values())
    out2 = tmp_path / "late"
    pa.write_outputs(str(out2), {"results": late}, log=logs.append)
    assert not (out2 / "best_prefill_config.json").exists()


def test_prefill_script_needs_a_gpu(tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the real run is the GPU machine's")
    pa = _script("gpu_prefill_attention")
    assert pa.main([str(tmp_path)]) == 2


def test_long_context_helpers():
    lc = _script("gpu_long_context")
    assert lc.percentile([1.0, 2.0, 3.0, 4.0], 50) == pytest.approx(2.5)
    assert lc.percentile([], 99) is None
    assert lc.gaps_in_window([[0.0, 1.0, 2.5, 4.0], [0.5, 3.0]], 1.0, 3.0) == [1.0, 1.5, 2.5]
    assert lc.kernel_class("_prefill_kernel") == "attention"
    assert lc.kernel_class("sm90_xmma_gemm_bf16bf16_bf16f32") == "gemm"
    assert lc.kernel_class("_rope_and_cache_kernel") == "rope_and_cache_write"
    s = lc.summarize_kernels([("nvjet_gemm", 10, 6.0), ("_prefill_kernel", 5, 3.0), ("x", 1, 1.0)], top=2)
    assert s["device_ms_total"] == 10.0 and s["by_class_ms"] == {"gemm": 6.0, "attention": 3.0, "other": 1.0}
    assert [k["name"] for k in s["top_kernels"]] == ["nvjet_gemm", "_prefill_kernel"]
    a = lc.parse_args(["out", "--quick"])
    assert a.chunks == (8192,) and a.prompt_lens == (36402,) and a.itl_prompt == 36402 and a.profile_chunk == 8192
    full = lc.parse_args(["out"])
    assert full.chunks == (8192, 16384, 32768) and full.itl_prompt == 111352 and full.decodes == 64


def test_long_context_runs_end_to_end_on_the_tiny_preset(tmp_path):
    lc = _script("gpu_long_context")
    args = ["--model", "tiny", "--prompt-lens", "40,150", "--chunks", "32,64", "--decodes", "4"]
    assert lc.main([str(tmp_path), *args, "--decode-max-tokens", "48"]) == 0
    doc = json.loads((tmp_path / "long_context.json").read_text())
    assert doc["errors"] == []
    st = doc["stages"]
    for c in (32, 64):
        assert "attention torch" in st[f"chunk{c}/build"]["describe"]
        assert st[f"chunk{c}/ttft150"]["output_tokens"] == 16 and st[f"chunk{c}/ttft150"]["ttft_s"] > 0
        itl = st[f"chunk{c}/itl_during_prefill150"]
        assert itl["decodes"] == 4 and itl["itl_during_ms"]["p99"] > 0 and itl["gaps_during_ms"]
    assert st["chunk32/profile150"]["top_kernels"] and "chunk64/profile150" not in st


def test_long_context_records_a_failed_stage_and_goes_on(tmp_path):
    """On CPU the Triton tiling cannot apply (the reference backend refuses it): the build stages fail, are
    recorded with their message, and the run still writes its JSON. A missing config file is recorded too."""
    lc = _script("gpu_long_context")
    cfg = tmp_path / "best.json"
    cfg.write_text(json.dumps({"config": PrefillConfig(16, 64, 4, 3).to_dict()}))
    args = ["--model", "tiny", "--prompt-lens", "40", "--chunks", "32", "--decodes", "2", "--quick"]
    assert lc.main([str(tmp_path / "a"), *args, "--prefill-config", str(cfg)]) == 0
    doc = json.loads((tmp_path / "a" / "long_context.json").read_text())
    assert doc["prefill_tiling"]["block_q"] == 16
    if not torch.cuda.is_available():
        assert "leave prefill_tiling unset" in doc["stages"]["chunk32/build"]["error"]
        assert doc["errors"][0]["stage"] == "chunk32/build"
    assert lc.main([str(tmp_path / "b"), *args, "--prefill-config", str(tmp_path / "missing.json")]) == 0
    doc = json.loads((tmp_path / "b" / "long_context.json").read_text())
    assert doc["errors"][0]["stage"] == "prefill_config" and "chunk32/ttft40" in doc["stages"]
    if not torch.cuda.is_available():
        assert lc.main([str(tmp_path / "c"), *args, "--prefill-attention", "flash-cascade"]) == 0
        doc = json.loads((tmp_path / "c" / "long_context.json").read_text())
        assert "leave prefill_attention='triton'" in doc["stages"]["chunk32/build"]["error"]


def test_prefill_reference_is_bottom_right_causal_over_the_paged_values(monkeypatch):
    """The check's reference (float32, per head) on a small problem: equal to SDPA with the explicit
    bottom-right mask on the same gathered values, at prefixes that end mid-block."""
    pa = _script("gpu_prefill_attention")
    for name, value in (("Q_LEN", 40), ("HQ", 8), ("HKV", 2), ("HEAD_DIM", 16)):
        monkeypatch.setattr(pa, name, value)
    p = pa.Problem(56, 16, torch.device("cpu"))
    for prefix in (0, 23, 56):
        q, k, v = p.contiguous_kv(prefix)
        n = prefix + 40
        mask = torch.arange(n)[None, :] <= (prefix + torch.arange(40))[:, None]
        sd = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask)
        torch.testing.assert_close(pa.reference_output(p, prefix), sd[0].transpose(0, 1), rtol=1e-5, atol=1e-5)


def test_cascade_entry_matches_the_check_reference(monkeypatch):
    """The script's cascade entries on a small problem, their attention swapped for the float32 reference one
    (cuDNN / flash need CUDA): within the check's tolerance of the exact answer, at prefixes ending mid-block;
    the best tiling is chosen among kernel entries only."""
    from spanllm.attention import cascade

    pa = _script("gpu_prefill_attention")
    for name, value in (("Q_LEN", 40), ("HQ", 8), ("HKV", 2), ("HEAD_DIM", 16)):
        monkeypatch.setattr(pa, name, value)
    monkeypatch.setitem(cascade.CASCADE_ATTENTION, "cudnn-cascade", cascade.reference_attention)
    p = pa.Problem(56, 16, torch.device("cpu"))
    make = pa.cascade_entry(p, "cudnn-cascade")
    for prefix in (0, 23, 56):
        fn, to_thd = make(prefix)
        err = (to_thd(fn()).float() - pa.reference_output(p, prefix)).abs().max().item()
        assert err <= pa.MAX_ABS_ERR, (prefix, err)
    rows = [{"prefix": 0, "median_ms": 0.1, "tflops": 1.0}]
    assert pa.best_kernel({"cudnn-cascade": {"kind": "cascade", "check": {"ok": True}, "rows": rows}}) is None


def test_long_context_prefill_attention_flag():
    """--prefill-attention takes the engine's choices (the CPU refusal: the failed-stage test above)."""
    from spanllm.attention.cascade import PREFILL_ATTENTION

    lc = _script("gpu_long_context")
    assert lc.PREFILL_ATTENTION == PREFILL_ATTENTION
    assert lc.parse_args(["out"]).prefill_attention == "triton"
    assert lc.parse_args(["out", "--prefill-attention", "cudnn-cascade"]).prefill_attention == "cudnn-cascade"
    with pytest.raises(SystemExit):
        lc.parse_args(["out", "--prefill-attention", "sdpa"])


def test_long_serve_script_end_to_end_on_the_tiny_preset(tmp_path):
    """scripts/gpu_long_serve.sh on CPU (tiny preset, its flags overridden): a server on a free port, one request per
    `bench serve` call with a seed per request, a result JSON per request, the server's TTFT and queue time read from
    /metrics around each, the server stopped after. The tiny preset's byte tokenizer turns every random prompt into
    the same bytes, so the later prompts hit the cache: the script must report them INVALID and exit non-zero (on
    a real tokenizer the seeds give prompts that share no block)."""
    import os
    import subprocess

    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    env = {**os.environ, "MODEL": "tiny", "SERVE_FLAGS": "--max-num-batched-tokens 256", "LENGTHS": "300,700"}
    env.update(NUM="2", START_TIMEOUT="120", REQUEST_TIMEOUT="60")
    out = tmp_path / "out"
    run = subprocess.run(
        ["bash", str(SCRIPTS / "gpu_long_serve.sh"), str(out)], env=env, capture_output=True, text=True, timeout=300
    )
    rows = [json.loads(line) for line in (out / "long_serve_summary.jsonl").read_text().splitlines()]
    assert [(r["request"], r["first_of_its_length"]) for r in rows] == [(1, True), (2, False), (3, True), (4, False)]
    assert rows[0]["prefix_cache_hits"] == 0  # the server's first request found nothing cached
    hit = [r["request"] for r in rows if r["prefix_cache_hits"]]
    assert hit and run.returncode == 1 and run.stdout.count("INVALID: the prompt hit the prefix cache") == len(hit)
    for r in rows:
        assert 0 <= r["server_queue_s"] <= r["server_ttft_s"] <= r["ttft_s"]  # the server's view inside the client's
    for length in (300, 700):
        for rep in (1, 2):
            d = json.loads((out / f"long_serve_{length}_{rep}.json").read_text())
            # the byte tokenizer may re-tokenize the decoded random prompt a token or two longer
            assert d["completed"] == 1 and abs(d["input_lens"][0] - length) <= 4 and d["ttfts"][0] > 0
            assert d["dataset"]["seed"] == length * 100 + rep  # a seed per request
            assert d["serve_flags"] == "--max-num-batched-tokens 256"
    assert "spanllm serve: stopped" in (out / "serve.log").read_text()
