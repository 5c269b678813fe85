"""EngineConfig.compile_decode: the decode forward through torch.compile (dynamic=False) and the
row-parallel all-reduce through torch.ops.spanllm.all_reduce_, against eager decode and transformers.

The CPU tests use backend="aot_eager" (dynamo + AOT tracing with the custom op, no code generation):
inductor on CPU compiles each bucket in ~10-30 s, so its one test is marked slow."""

from __future__ import annotations

import pytest
import torch
from engine_workers import NEW_TOKENS, PROMPTS, compiled_world2, engine_config

from spanllm.engine.llm import LLM
from spanllm.engine.sampler import SamplingParams
from spanllm.launch import launch

STEPS = 24


def _generate(llm: LLM, **kw):
    return llm.generate_static(PROMPTS, SamplingParams(max_tokens=STEPS, ignore_eos=True), keep_logits=True, **kw)


def test_compile_decode_off_by_default():
    cfg = engine_config()
    assert cfg.compile_decode is False and cfg.compile_backend == "inductor"
    llm = LLM("tiny", cfg)
    assert llm.runner._compiled_forward is None and not llm.runner.compiled_decode
    with pytest.raises(ValueError, match="compile_backend"):
        engine_config(compile_backend="")


def test_compiled_decode_tp1_equals_eager_and_transformers(hf_checkpoint, hf_reference):
    single, _, _ = hf_checkpoint
    llm = LLM(single, engine_config(compile_decode=True, compile_backend="aot_eager"))
    assert llm.runner.compiled_decode and "compiled decode (aot_eager, layer)" in llm.describe()
    out = llm.generate_static(PROMPTS, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))
    assert out.token_ids == hf_reference[0]
    # Longer runs on the tiny preset: tokens equal eager decode, whole batch and micro-batched buckets.
    ref = _generate(LLM("tiny", engine_config(max_seq_len=128)))
    comp = LLM("tiny", engine_config(max_seq_len=128, compile_decode=True, compile_backend="aot_eager"))
    for mb in (1, 3):
        out = _generate(comp, micro_batches=mb)
        assert out.token_ids == ref.token_ids
        torch.testing.assert_close(out.logits, ref.logits, atol=1e-4, rtol=0)


def test_compile_scope_layer_compiles_one_layer_for_all():
    """compile_scope="layer": one graph of one layer's ops serves all 4 layers of the tiny model (weights and
    cache views are inputs; nothing is specialised per layer), so the compile does not grow with depth.
    "forward": one graph holding every layer. Both give eager decode's tokens and logits."""
    from torch._dynamo.utils import counters

    ref = _generate(LLM("tiny", engine_config(max_seq_len=128)))
    captured = {}
    for scope in ("layer", "forward"):
        torch._dynamo.reset()
        counters.clear()
        llm = LLM(
            "tiny",
            engine_config(max_seq_len=128, compile_decode=True, compile_backend="aot_eager", compile_scope=scope),
        )
        out = _generate(llm)
        assert out.token_ids == ref.token_ids, scope
        torch.testing.assert_close(out.logits, ref.logits, atol=1e-4, rtol=0)
        assert counters["stats"]["unique_graphs"] == 1, scope  # one bucket (batch 3 at slot 0): one compile
        captured[scope] = counters["stats"]["calls_captured"]
    # the whole forward holds the ops of all 4 layers (plus embedding, mask, norm, head); a layer graph one's
    assert captured["forward"] > 4 * captured["layer"] > 0


def test_compile_scope_validation():
    with pytest.raises(ValueError, match="compile_scope='model' must be one of"):
        engine_config(compile_scope="model")


def test_breakdown_timers_use_the_eager_forward():
    llm = LLM("tiny", engine_config(compile_decode=True, compile_backend="aot_eager"))
    llm.timers.enabled = True
    assert not llm.runner.compiled_decode
    llm.timers.enabled = False
    assert llm.runner.compiled_decode


def test_compiled_decode_tp2_equals_eager_and_transformers(hf_checkpoint, hf_reference):
    single, _, _ = hf_checkpoint
    results = launch(compiled_world2, single, PROMPTS, NEW_TOKENS, nprocs=2)
    for r in results:
        assert r["eager"]["tokens"] == hf_reference[0]
        for key in ("compiled", "compiled_mb3", "capped"):
            assert r[key]["tokens"] == r["eager"]["tokens"], key
            torch.testing.assert_close(r[key]["logits"], r["eager"]["logits"], atol=1e-4, rtol=0)
        assert r["registered"] == (1, True, True)
        assert r["swapped"] == (True, 1, True)  # one handle: the SizeFallback (capped + the group collective)
        assert r["capped_calls"][0] == r["capped_calls"][1]
        assert r["closed"]


@pytest.mark.slow
def test_compiled_decode_inductor_tp1_equals_eager():
    ref = _generate(LLM("tiny", engine_config(max_seq_len=128)))
    out = _generate(LLM("tiny", engine_config(max_seq_len=128, compile_decode=True)))  # inductor (CPU C++)
    assert out.token_ids == ref.token_ids
    torch.testing.assert_close(out.logits, ref.logits, atol=1e-4, rtol=0)


def test_cli_compile_decode_flags(hf_checkpoint, hf_reference, tmp_path, capsys):
    import json

    from spanllm.cli import main

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
        "--compile-decode",
        "--compile-backend",
        "aot_eager",
    ]
    for p in PROMPTS:
        argv += ["--prompt-ids", ",".join(map(str, p))]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "compiled decode (aot_eager, layer)" in out
    for i, toks in enumerate(hf_reference[0]):
        assert f"[{i}] generated ids: {','.join(map(str, toks))}" in out

    js = tmp_path / "batch.json"
    assert (
        main(
            [
                "bench",
                "batch",
                "--model",
                "tiny:layers=2",
                "--batch-sizes",
                "2",
                "--prompt-len",
                "4",
                "--decode-len",
                "3",
                "--iters",
                "1",
                "--warmup",
                "0",
                "--no-breakdown",
                "--compile-decode",
                "--compile-backend",
                "aot_eager",
                "--json",
                str(js),
            ]
        )
        == 0
    )
    with open(js) as f:
        (row,) = json.load(f)["rows"]
    assert row["compile_decode"] is True and row["compile_backend"] == "aot_eager" and row["compile_scope"] == "layer"
