"""Pre-quantized FP8 checkpoints (spanllm.model.fp8_checkpoint): a compressed-tensors FP8-dynamic checkpoint
written from the test model's weights loads as it is (no re-quantization) and generates exactly what the bf16
checkpoint does under --quantization fp8 (the same e4m3 values and scales); per-tensor scales load onto every row;
the checks before any rank starts (a missing scale, a weight that is not FP8, a scale of the wrong shape); and every
quantization_config the engine would not run as calibrated is refused, naming the field and the fix."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from spanllm.engine.config import EngineConfig
from spanllm.engine.llm import LLM
from spanllm.engine.sampler import SamplingParams
from spanllm.layers import fp8
from spanllm.layers.linear import linear_layers
from spanllm.model.config import ModelConfig, ModelConfigError
from spanllm.model.fp8_checkpoint import FP8Checkpoint, parse_quantization_config
from spanllm.model.loader import CheckpointError, check_checkpoint

safetensors_torch = pytest.importorskip("safetensors.torch")

CPU = torch.device("cpu")
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
DYNAMIC_TOKEN = {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True, "symmetric": True}


def compressed_tensors(strategy: str = "channel", **group_overrides) -> dict:
    group = {
        "targets": ["Linear"],
        "weights": {"num_bits": 8, "type": "float", "strategy": strategy, "dynamic": False, "symmetric": True},
        "input_activations": dict(DYNAMIC_TOKEN),
        **group_overrides,
    }
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "config_groups": {"group_0": group},
        "ignore": ["lm_head"],
    }


def _is_linear(name: str) -> bool:
    return name.endswith(".weight") and any(f".{m}." in name for m in LINEARS)


def write_fp8_checkpoint(src: str, dst: str, strategy: str = "channel", qc: dict | None = None) -> None:
    """src's weights with every decoder linear quantized as the engine quantizes at load (channel), or with one
    scale per tensor; config.json gains the quantization_config."""
    tensors = safetensors_torch.load_file(os.path.join(src, "model.safetensors"))
    out = {}
    for name, t in tensors.items():
        if not _is_linear(name):
            out[name] = t
            continue
        if strategy == "channel":
            q, scale = fp8.quantize_weight(t)
            out[name], out[name + "_scale"] = q, scale[:, None].contiguous()
        else:
            scale = t.float().abs().amax() / fp8.FP8_MAX
            out[name] = (t.float() / scale).clamp(-fp8.FP8_MAX, fp8.FP8_MAX).to(torch.float8_e4m3fn)
            out[name + "_scale"] = scale.reshape(())
    os.makedirs(dst, exist_ok=True)
    safetensors_torch.save_file(out, os.path.join(dst, "model.safetensors"))
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = qc or compressed_tensors(strategy)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f)
    for extra in ("generation_config.json",):
        if os.path.exists(os.path.join(src, extra)):
            shutil.copy(os.path.join(src, extra), dst)


PROMPTS = [[1, 5, 17, 42, 8, 90, 3, 61] * 5, [1, 7, 7, 20]]
ENGINE = dict(dtype=torch.float32, max_num_seqs=8, max_num_batched_tokens=16)


def _generate(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    return [list(o.output_ids) for o in llm.generate(PROMPTS, params)]


def test_fp8_dynamic_checkpoint_loads_as_is_and_equals_quantization_at_load(hf_checkpoint, tmp_path):
    single, _, _ = hf_checkpoint
    dst = str(tmp_path / "fp8")
    write_fp8_checkpoint(single, dst)
    cfg = ModelConfig.from_hf_config(dst)
    assert cfg.fp8_checkpoint == FP8Checkpoint("compressed-tensors", "channel")
    check_checkpoint(cfg)
    pre = LLM(dst, EngineConfig(**ENGINE), device=CPU)  # no --quantization: the checkpoint's config decides
    at_load = LLM(single, EngineConfig(quantization="fp8", **ENGINE), device=CPU)
    try:
        assert pre.engine.quantization == "fp8"
        assert "from the FP8 checkpoint (compressed-tensors, channel scales)" in pre.describe()
        assert "quantized at load" in at_load.describe()
        for a, b in zip(linear_layers(pre.model), linear_layers(at_load.model), strict=True):
            assert a.weight.dtype == torch.float8_e4m3fn
            assert torch.equal(a.weight.view(torch.uint8), b.weight.view(torch.uint8))
            assert torch.equal(a.weight_scale, b.weight_scale)
        assert pre.model.lm_head.weight.dtype == torch.float32
        assert _generate(pre) == _generate(at_load)
    finally:
        pre.close()
        at_load.close()


def tp2_fp8_worker(ctx, ckpt: str) -> dict:
    """One rank of a TP=2 engine over the FP8 checkpoint: its greedy tokens (rank 0's; [] on the other) and its
    shards' scales."""
    llm = LLM(ckpt, EngineConfig(**ENGINE), allreduce="gloo", device=ctx.device)
    try:
        layer = llm.model.model.layers["1"]
        return {
            "tokens": _generate(llm),
            "qkv_scale": layer.self_attn.qkv_proj.weight_scale.clone(),
            "down_scale": layer.mlp.down_proj.weight_scale.clone(),
        }
    finally:
        llm.close()


def test_fp8_checkpoint_at_tp2_shards_weights_and_scales(hf_checkpoint, tmp_path):
    """Each rank takes its rows' scales for the column-parallel layers (q, k, v of its heads) and every row's for
    the row-parallel ones; the greedy tokens equal TP=1's."""
    from spanllm.launch import launch

    single, _, _ = hf_checkpoint
    dst = str(tmp_path / "fp8_tp2")
    write_fp8_checkpoint(single, dst)
    stored = safetensors_torch.load_file(os.path.join(dst, "model.safetensors"))
    one = LLM(dst, EngineConfig(**ENGINE), device=CPU)
    try:
        want = _generate(one)
    finally:
        one.close()
    ranks = launch(tp2_fp8_worker, dst, nprocs=2)
    p = "model.layers.1."
    assert ranks[0]["tokens"] == want  # rank 0 returns the outputs (the other rank serves its steps)
    for r, res in enumerate(ranks):
        q, k, v = (stored[p + f"self_attn.{m}.weight_scale"].reshape(-1) for m in ("q_proj", "k_proj", "v_proj"))
        # 4 query heads and 2 KV heads of 16 over 2 ranks: rank r holds q rows [32r, 32r + 32), k / v rows [16r, ...)
        assert torch.equal(
            res["qkv_scale"], torch.cat([q[32 * r : 32 * r + 32], k[16 * r : 16 * r + 16], v[16 * r : 16 * r + 16]])
        )
        assert torch.equal(res["down_scale"], stored[p + "mlp.down_proj.weight_scale"].reshape(-1))


def test_per_tensor_scales_load_onto_every_row(hf_checkpoint, tmp_path):
    """One scale per checkpoint tensor: the fused qkv's rows carry q's, k's and v's scale in turn, and the
    engine computes with q * scale (checked against an unquantized engine given those weights by hand)."""
    single, _, _ = hf_checkpoint
    dst = str(tmp_path / "fp8_tensor")
    write_fp8_checkpoint(single, dst, strategy="tensor")
    stored = safetensors_torch.load_file(os.path.join(dst, "model.safetensors"))
    pre = LLM(dst, EngineConfig(**ENGINE), device=CPU)
    plain = LLM(single, EngineConfig(**ENGINE), device=CPU)
    try:
        layer = pre.model.model.layers["0"]
        qkv = layer.self_attn.qkv_proj
        want = torch.cat(
            [
                stored[f"model.layers.0.self_attn.{m}.weight_scale"].float().expand(n)
                for m, n in (("q_proj", qkv.q_size), ("k_proj", qkv.kv_size), ("v_proj", qkv.kv_size))
            ]
        )
        assert torch.equal(qkv.weight_scale, want)
        down = layer.mlp.down_proj
        assert torch.equal(down.weight_scale, stored["model.layers.0.mlp.down_proj.weight_scale"].float().expand(64))
        for a, b in zip(linear_layers(pre.model), linear_layers(plain.model), strict=True):
            with torch.no_grad():
                b.weight.copy_(fp8.dequantize_weight(a.weight, a.weight_scale, torch.float32))
        # the plain engine runs W unquantized against FP8's W8A16 / W8A8: chunks of <= 16 tokens keep every GEMM W8A16
        assert _generate(pre) == _generate(plain)
        assert "tensor scales" in pre.describe()
    finally:
        pre.close()
        plain.close()


def test_checks_before_any_rank_starts(hf_checkpoint, tmp_path):
    single, _, _ = hf_checkpoint
    dst = str(tmp_path / "broken")
    write_fp8_checkpoint(single, dst)
    path = os.path.join(dst, "model.safetensors")
    tensors = safetensors_torch.load_file(path)
    scale = "model.layers.2.mlp.up_proj.weight_scale"

    def check_with(change) -> None:
        t = dict(tensors)
        change(t)
        safetensors_torch.save_file(t, path)
        check_checkpoint(ModelConfig.from_hf_config(dst))

    with pytest.raises(CheckpointError, match=f"tensor '{scale}' is missing from the FP8 checkpoint"):
        check_with(lambda t: t.pop(scale))
    with pytest.raises(
        CheckpointError, match=r"has shape \(64, 2\); channel scales imply one of \[\(128, 1\), \(128,\)\]"
    ):
        check_with(lambda t: t.__setitem__(scale, torch.ones(64, 2)))
    name = "model.layers.1.self_attn.o_proj.weight"
    with pytest.raises(CheckpointError, match=f"tensor '{name}' is F32 .* says the linear weights are FP8"):
        check_with(lambda t: t.__setitem__(name, t[name].float()))


@pytest.mark.parametrize(
    "qc, message",
    [
        ({"quant_method": "gptq"}, r"quant_method='gptq' is not supported"),
        ({"quant_method": "fp8", "activation_scheme": "static"}, r"activation_scheme='static': static activation"),
        ({"quant_method": "fp8", "weight_block_size": [128, 128]}, r"weight_block_size=\[128, 128\]: block-wise"),
        ({**compressed_tensors(), "format": "pack-quantized"}, r"format='pack-quantized' is not supported"),
        (
            compressed_tensors(input_activations={**DYNAMIC_TOKEN, "strategy": "tensor", "dynamic": False}),
            r"input_activations=.*per token on the fly",
        ),
        (compressed_tensors(input_activations=None), r"input_activations=None"),
        (compressed_tensors(strategy="group"), r"weights.strategy='group'"),
        (compressed_tensors(weights={"num_bits": 4, "type": "int", "strategy": "channel"}), r"8-bit float symmetric"),
        ({**compressed_tensors(), "ignore": ["lm_head", "model.layers.0.mlp.down_proj"]}, r"leaves \['model.layers.0"),
        ({**compressed_tensors(), "config_groups": {}}, r"config_groups has 0 groups"),
    ],
)
def test_quantization_configs_refused_with_the_field_and_the_fix(qc, message):
    with pytest.raises(ValueError, match=message) as err:
        parse_quantization_config(qc, "ckpt")
    assert "--quantization fp8" in str(err.value) or "bf16 checkpoint" in str(err.value)


def test_refusal_surfaces_as_the_model_config_error(hf_checkpoint, tmp_path):
    single, _, _ = hf_checkpoint
    dst = str(tmp_path / "static")
    write_fp8_checkpoint(single, dst, qc={"quant_method": "fp8", "activation_scheme": "static"})
    with pytest.raises(ModelConfigError, match="static activation scales are not supported"):
        ModelConfig.from_hf_config(dst)


def test_accepted_schemes():
    assert parse_quantization_config(None, "x") is None
    assert parse_quantization_config(compressed_tensors("tensor"), "x") == FP8Checkpoint("compressed-tensors", "tensor")
    assert parse_quantization_config({"quant_method": "fp8", "activation_scheme": "dynamic"}, "x") == FP8Checkpoint(
        "fp8", "tensor"
    )
