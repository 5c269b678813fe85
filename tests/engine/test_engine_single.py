"""One-rank engine (no process group) against transformers, loader errors, request errors, timers."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

import pytest
import torch
from engine_workers import NEW_TOKENS, PROMPTS, engine_config, generate, make_hf_model

from spanllm.engine.llm import LLM
from spanllm.engine.sampler import SamplingParams
from spanllm.model.config import ModelConfigError
from spanllm.model.loader import CheckpointError
from spanllm.model.parallel_dims import ParallelDims, ParallelLayoutError


def _check(result, hf_reference):
    hf_tokens, hf_logits = hf_reference
    assert result["tokens"] == hf_tokens
    for i in range(len(PROMPTS)):
        torch.testing.assert_close(result["logits"][:, i], hf_logits[i], atol=1e-4, rtol=0)


@pytest.mark.parametrize("layout", ["single", "sharded"])
def test_tp1_matches_transformers(hf_checkpoint, hf_reference, layout):
    single, sharded, _ = hf_checkpoint
    path = single if layout == "single" else sharded
    if layout == "sharded":
        assert os.path.isfile(os.path.join(path, "model.safetensors.index.json"))
    _check(generate(LLM(path, engine_config()), PROMPTS, NEW_TOKENS), hf_reference)


def test_micro_batches_without_pipeline_change_nothing(hf_checkpoint, hf_reference):
    _check(generate(LLM(hf_checkpoint[0], engine_config()), PROMPTS, NEW_TOKENS, micro_batches=3), hf_reference)


def test_tied_embeddings(tmp_path):
    model = make_hf_model(tie=True)
    model.save_pretrained(tmp_path, safe_serialization=True)
    llm = LLM(str(tmp_path), engine_config())
    assert llm.model.lm_head.weight is llm.model.model.embed_tokens.weight
    out = llm.generate_batch([PROMPTS[0]], SamplingParams(max_tokens=4, ignore_eos=True), keep_logits=True)
    with torch.no_grad():
        ref = model(torch.tensor([PROMPTS[0] + out.token_ids[0]])).logits[0, len(PROMPTS[0]) - 1 : -1]
    torch.testing.assert_close(out.logits[:, 0], ref, atol=1e-4, rtol=0)


def test_stops_at_eos(hf_checkpoint, hf_reference):
    """Declare the 3rd greedy token of prompt 0 a stop token: that sequence ends there, EOS included."""
    hf_tokens, _ = hf_reference
    llm = LLM(hf_checkpoint[0], engine_config())
    stop = hf_tokens[0][2]
    llm.config = dataclasses.replace(llm.config, eos_token_ids=(stop,))
    out = llm.generate_batch([PROMPTS[0]], SamplingParams(max_tokens=NEW_TOKENS))
    assert out.token_ids[0] == hf_tokens[0][: hf_tokens[0].index(stop) + 1]
    (served,) = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=NEW_TOKENS))
    assert served.output_ids == out.token_ids[0] and served.finish_reason == "stop"


def test_temperature_sampling_is_seeded(hf_checkpoint):
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=8, ignore_eos=True)
    runs = [LLM(hf_checkpoint[0], engine_config(seed=5)).generate_batch(PROMPTS, params).token_ids for _ in range(2)]
    assert runs[0] == runs[1]


def test_breakdown_timers_cover_decode_only(hf_checkpoint):
    llm = LLM(hf_checkpoint[0], engine_config())
    with llm.timed_ops():
        out = llm.generate_batch(PROMPTS, SamplingParams(max_tokens=5, ignore_eos=True))
    b = out.breakdown
    assert b.steps == 4 == out.decode_steps
    assert b.ms["gemm"] > 0 and b.ms["attention"] > 0
    assert b.ms["allreduce"] == 0 and b.ms["pipeline"] == 0 and b.ms["idle"] == 0  # one rank: none of these
    assert sum(b.ms.values()) == pytest.approx(b.total_ms)


def test_random_preset_is_seeded_and_labelled():
    a = LLM("tiny:layers=2", engine_config(seed=1))
    b = LLM("tiny:layers=2", engine_config(seed=1))
    assert "TRUNCATED: 2 of 4 layers" in a.describe()
    p = SamplingParams(max_tokens=4, ignore_eos=True)
    assert a.generate_batch([[1, 2, 3]], p).token_ids == b.generate_batch([[1, 2, 3]], p).token_ids
    assert a.allreduce_ran(4) == "none"


def _copy_with_config(src: str, dst, **changes) -> str:
    shutil.copytree(src, dst)
    with open(os.path.join(dst, "config.json")) as f:
        cfg = json.load(f)
    cfg.update(changes)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f)
    return str(dst)


def test_shape_mismatch_names_tensor_and_shapes(hf_checkpoint, tmp_path):
    bad = _copy_with_config(hf_checkpoint[0], tmp_path / "bad", intermediate_size=96)
    with pytest.raises(
        CheckpointError,
        match=r"'model.layers.0.mlp.gate_proj.weight' has shape \(128, 64\) in the "
        r"checkpoint but the config implies \(96, 64\)",
    ):
        LLM(bad, engine_config())


def test_missing_tensor_is_named(hf_checkpoint, tmp_path):
    bad = _copy_with_config(hf_checkpoint[0], tmp_path / "bad", num_hidden_layers=5)
    with pytest.raises(CheckpointError, match=r"tensor 'model.layers.4.input_layernorm.weight' is missing"):
        LLM(bad, engine_config())


def test_unsupported_architecture(hf_checkpoint, tmp_path):
    bad = _copy_with_config(hf_checkpoint[0], tmp_path / "bad", architectures=["GPT2LMHeadModel"])
    with pytest.raises(ModelConfigError, match="GPT2LMHeadModel.*not supported"):
        LLM(bad, engine_config())


def test_layout_errors_before_any_allocation(hf_checkpoint):
    with pytest.raises(ParallelLayoutError, match="tp=2 x pp=1 = 2 ranks, but the world has 1"):
        ParallelDims(2, 1, 1)
    with pytest.raises(ValueError, match="needs 2 ranks but this job has 1"):
        LLM("tiny", engine_config(), dims=ParallelDims(1, 2, 2))


def test_request_errors(hf_checkpoint):
    """The fixed batch takes the serving engine's admission checks (one validation for every entry point)."""
    llm = LLM(hf_checkpoint[0], engine_config(max_model_len=16))
    with pytest.raises(ValueError, match="maximum context length is 16 tokens. However, you requested 21 tokens"):
        llm.generate_batch([list(range(1, 11))], SamplingParams(max_tokens=11))
    with pytest.raises(ValueError, match="the prompt is empty"):
        llm.generate_batch([[]])
    with pytest.raises(ValueError, match=r"prompt token 1 is 999, outside the vocabulary \[0, 250\)"):
        llm.generate_batch([[1, 999]], SamplingParams(max_tokens=4))
    # the lengths are checked before the ids (O(1) before O(prompt)): a prompt both too long and out of range
    with pytest.raises(ValueError, match="maximum context length is 16 tokens"):
        llm.generate_batch([[1, 999] * 10], SamplingParams(max_tokens=4))


def test_decode_gemm_choice_is_validated_and_routed(monkeypatch):
    """decode_gemm: a bad name and a machine without GPU are refused (no silent fallback); with "skinny"
    the linears send <= 16 rows to the skinny op and more rows to F.linear."""
    with pytest.raises(ValueError, match="decode_gemm='cublas' must be one of"):
        engine_config(decode_gemm="cublas")
    with pytest.raises(
        ValueError, match="decode_gemm='skinny' needs a CUDA device and Triton; this rank has device cpu"
    ):
        LLM("tiny", engine_config(decode_gemm="skinny"), device=torch.device("cpu"))
    from spanllm.layers import tp as tp_module
    from spanllm.layers.linear import ColumnParallelLinear

    seen = []
    monkeypatch.setattr(tp_module, "skinny_linear", lambda x, w: seen.append(x.shape[:-1]) or x @ w.T)
    tp = tp_module.TPContext(decode_gemm="skinny")
    lin = ColumnParallelLinear(8, 6, tp)
    lin.weight.data = torch.arange(48, dtype=torch.float32).reshape(6, 8) % 5 - 2
    for rows in (1, 16, 17):
        x = (torch.arange(rows * 8, dtype=torch.float32).reshape(rows, 1, 8) % 3) - 1
        assert torch.equal(lin(x), x @ lin.weight.T)
    assert seen == [torch.Size([1, 1]), torch.Size([16, 1])]  # 17 rows went to F.linear
