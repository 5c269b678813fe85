"""Adversarial FP8 checkpoints and quantization_configs (spanllm.model.fp8_checkpoint, the loader's FP8 path).

What loads as it should: scales in another shard of a sharded checkpoint, scales stored as bf16 / float16, channel
scales as [N], tensor scales as [1], an explicit --quantization fp8, tied embeddings, weights and scales of every
linear sharded at TP 2 and 4 and on a pipeline stage, realistic llm-compressor configs with their extra keys.
What is refused with a message: regex targets, decoder layers left unquantized (literal or regex), `quant_method: fp8`
with per-channel scales.

Every bug this review found is fixed, each with its test below (they were written as xfail(strict=True) tests
first, against the code as it was).
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import replace

import pytest
import torch
from test_fp8_checkpoint import DYNAMIC_TOKEN, ENGINE, _generate, compressed_tensors, write_fp8_checkpoint

from spanllm.engine.config import EngineConfig
from spanllm.engine.llm import LLM
from spanllm.layers import fp8
from spanllm.layers.tp import TPContext
from spanllm.model.config import ModelConfig, ModelConfigError
from spanllm.model.fp8_checkpoint import FP8Checkpoint, parse_quantization_config
from spanllm.model.llama import LlamaForCausalLM
from spanllm.model.loader import CheckpointError, check_checkpoint, load_checkpoint

safetensors_torch = pytest.importorskip("safetensors.torch")

CPU = torch.device("cpu")
SCALE = "model.layers.1.mlp.down_proj.weight_scale"
KV_CACHE_SCHEME = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}


# --- helpers ------------------------------------------------------------------------------------------------
def _tensors(d: str) -> dict[str, torch.Tensor]:
    return safetensors_torch.load_file(os.path.join(d, "model.safetensors"))


def _mutate(d: str, change) -> None:
    """Rewrite d's single-file checkpoint with change(tensors) applied."""
    t = _tensors(d)
    change(t)
    safetensors_torch.save_file(t, os.path.join(d, "model.safetensors"))


def _edit_config(d: str, change) -> None:
    path = os.path.join(d, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    change(cfg)
    with open(path, "w") as f:
        json.dump(cfg, f)


def _dequantize(t: dict[str, torch.Tensor]) -> None:
    """An llm-compressor 'frozen' save: each FP8 weight stored back in bf16 (q * scale), its scale beside it."""
    for k in [k for k in t if k + "_scale" in t]:
        t[k] = (t[k].float() * t[k + "_scale"].float()).to(torch.bfloat16)


def _fp8(src: str, dst, strategy: str = "channel", qc: dict | None = None, change=None) -> str:
    dst = str(dst)
    write_fp8_checkpoint(src, dst, strategy=strategy, qc=qc)
    if change is not None:
        _mutate(dst, change)
    return dst


def _shard(d: str, drop_from_index: str | None = None, index_file_of: dict | None = None) -> None:
    """Split d's model.safetensors in two: the weights in shard 1, every *_scale in shard 2, with an index.
    drop_from_index: a tensor left out of the index's weight_map (still in its shard); index_file_of: a tensor
    the index maps to the wrong shard."""
    t = _tensors(d)
    os.remove(os.path.join(d, "model.safetensors"))
    files = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
    parts: tuple[dict, dict] = ({}, {})
    for name, v in t.items():
        parts[name.endswith("_scale")][name] = v
    weight_map = {}
    for fname, part in zip(files, parts):
        safetensors_torch.save_file(part, os.path.join(d, fname))
        weight_map.update(dict.fromkeys(part, fname))
    if drop_from_index:
        weight_map.pop(drop_from_index)
    weight_map.update(index_file_of or {})
    with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)


def _load(d: str, **engine) -> LLM:
    return LLM(d, EngineConfig(**{**ENGINE, **engine}), device=CPU)


def _tokens(d: str, **engine) -> list[list[int]]:
    llm = _load(d, **engine)
    try:
        return _generate(llm)
    finally:
        llm.close()


@pytest.fixture(scope="module")
def fp8_ref(hf_checkpoint, tmp_path_factory):
    """(the bf16 checkpoint, a channel-scale FP8 checkpoint of it, that checkpoint's greedy tokens)."""
    single, _, _ = hf_checkpoint
    d = _fp8(single, tmp_path_factory.mktemp("fp8_ref"))
    return single, d, _tokens(d)


# --- what loads as it should -----------------------------------------------------------------------------------
def test_sharded_checkpoint_with_scales_in_another_shard(fp8_ref, tmp_path):
    _, ref, want = fp8_ref
    d = str(tmp_path / "sharded")
    shutil.copytree(ref, d)
    _shard(d)
    check_checkpoint(ModelConfig.from_hf_config(d))
    assert _tokens(d) == want


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_scales_load_as_their_float32_values(fp8_ref, tmp_path, dtype):
    single, _, _ = fp8_ref

    def to_half(t):
        for k in [k for k in t if k.endswith("_scale")]:
            t[k] = t[k].to(dtype)

    d = _fp8(single, tmp_path / "half", change=to_half)
    check_checkpoint(ModelConfig.from_hf_config(d))
    stored = _tensors(d)
    llm = _load(d)
    try:
        down = llm.model.model.layers["1"].mlp.down_proj
        assert torch.equal(down.weight_scale, stored[SCALE].float().reshape(-1))
    finally:
        llm.close()


def test_channel_scales_as_n_and_tensor_scales_as_1(fp8_ref, tmp_path):
    single, _, want = fp8_ref

    def reshape(shape):
        def change(t):
            for k in [k for k in t if k.endswith("_scale")]:
                t[k] = t[k].reshape(shape).contiguous()

        return change

    flat = _fp8(single, tmp_path / "flat", change=reshape(-1))
    check_checkpoint(ModelConfig.from_hf_config(flat))
    assert _tokens(flat) == want
    one = _fp8(single, tmp_path / "one", strategy="tensor", change=reshape(1))
    check_checkpoint(ModelConfig.from_hf_config(one))
    scalar = _fp8(single, tmp_path / "scalar", strategy="tensor")
    assert _tokens(one) == _tokens(scalar)


def test_explicit_quantization_fp8_loads_the_checkpoint_as_it_is(fp8_ref):
    _, d, want = fp8_ref
    stored = _tensors(d)
    llm = _load(d, quantization="fp8")
    try:
        assert "from the FP8 checkpoint" in llm.describe()
        down = llm.model.model.layers["2"].mlp.down_proj
        w = stored["model.layers.2.mlp.down_proj.weight"]
        assert torch.equal(down.weight.view(torch.uint8), w.view(torch.uint8))  # not re-quantized
        assert _generate(llm) == want
    finally:
        llm.close()


def test_tied_embeddings(tmp_path):
    from engine_workers import make_hf_model

    src = str(tmp_path / "tied")
    make_hf_model(tie=True).save_pretrained(src, safe_serialization=True)
    d = _fp8(src, tmp_path / "tied_fp8")
    cfg = ModelConfig.from_hf_config(d)
    assert cfg.tie_word_embeddings and cfg.fp8_checkpoint is not None
    check_checkpoint(cfg)
    pre = _load(d)
    try:
        assert pre.model.lm_head.weight is pre.model.model.embed_tokens.weight
        assert pre.model.lm_head.weight.dtype == torch.float32
        assert _generate(pre) == _tokens(src, quantization="fp8")
    finally:
        pre.close()


class _NoComm:
    name = "none"

    def all_reduce_(self, x):  # never called: these tests only load
        raise AssertionError("no forward here")


@pytest.mark.parametrize("strategy", ["channel", "tensor"])
def test_every_linear_sharded_with_its_scales_at_tp2_tp4_and_a_pipeline_stage(hf_checkpoint, tmp_path, strategy):
    """Each rank's qkv and gate_up take their rows' weights and scales (q / k / v and gate / up in turn, KV heads
    replicated at TP 4), o_proj and down_proj their columns with every row's scale: checked layer by layer against
    the stored tensors, without starting ranks (a TPContext per rank)."""
    single, _, _ = hf_checkpoint
    d = _fp8(single, tmp_path / strategy, strategy=strategy)
    cfg = ModelConfig.from_hf_config(d)
    st = _tensors(d)
    h, ffn, d_head = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q_rows, kv_rows = cfg.num_heads * d_head, cfg.num_kv_heads * d_head
    for tp, rank, layers, first, last in (
        [(2, 0, None, True, True), (2, 1, None, True, True)]
        + [(4, r, None, True, True) for r in range(4)]
        + [(1, 0, range(2, 4), False, True)]
    ):
        tpc = TPContext(rank=rank, size=tp, comm=_NoComm() if tp > 1 else None, fp8_weights=True)
        model = LlamaForCausalLM(cfg, tpc, layers, first, last)
        load_checkpoint(model, d)
        assert sorted(model.model.layers) == [str(i) for i in (layers or range(cfg.num_layers))]
        for i, layer in model.model.layers.items():
            p = f"model.layers.{i}."

            def scale(mod, n, p=p):
                return st[p + mod + ".weight_scale"].float().reshape(-1).expand(n)

            def weight(mod, p=p):
                return st[p + mod + ".weight"].view(torch.uint8)

            qkv = layer.self_attn.qkv_proj
            q0, k0, nq, nk = qkv.q_head_start * d_head, qkv.kv_head_start * d_head, qkv.q_size, qkv.kv_size
            rows = [("self_attn.q_proj", q_rows, q0, nq), ("self_attn.k_proj", kv_rows, k0, nk)]
            rows.append(("self_attn.v_proj", kv_rows, k0, nk))
            assert torch.equal(qkv.weight_scale, torch.cat([scale(m, n)[a : a + k] for m, n, a, k in rows]))
            assert torch.equal(qkv.weight.view(torch.uint8), torch.cat([weight(m)[a : a + k] for m, _, a, k in rows]))
            gu = layer.mlp.gate_up_proj
            f0, fl = gu.start, gu.intermediate_local
            mlp = ("mlp.gate_proj", "mlp.up_proj")
            assert torch.equal(gu.weight_scale, torch.cat([scale(m, ffn)[f0 : f0 + fl] for m in mlp]))
            assert torch.equal(gu.weight.view(torch.uint8), torch.cat([weight(m)[f0 : f0 + fl] for m in mlp]))
            for mod, lin in (("self_attn.o_proj", layer.self_attn.o_proj), ("mlp.down_proj", layer.mlp.down_proj)):
                assert torch.equal(lin.weight_scale, scale(mod, h)), (tp, rank, mod)
                cols = weight(mod)[:, lin.in_start : lin.in_start + lin.in_local]
                assert torch.equal(lin.weight.view(torch.uint8), cols), (tp, rank, mod)


REALISTIC_FP8_DYNAMIC = {  # the shape of llm-compressor's FP8_DYNAMIC config.json (RedHatAI/*-FP8-dynamic)
    "config_groups": {
        "group_0": {
            "input_activations": {
                "actorder": None,
                "block_structure": None,
                "dynamic": True,
                "group_size": None,
                "num_bits": 8,
                "observer": None,
                "observer_kwargs": {},
                "strategy": "token",
                "symmetric": True,
                "type": "float",
            },
            "output_activations": None,
            "targets": ["Linear"],
            "weights": {
                "actorder": None,
                "block_structure": None,
                "dynamic": False,
                "group_size": None,
                "num_bits": 8,
                "observer": "minmax",
                "observer_kwargs": {},
                "strategy": "channel",
                "symmetric": True,
                "type": "float",
            },
            "format": "float-quantized",
        }
    },
    "format": "float-quantized",
    "global_compression_ratio": 1.4634,
    "ignore": ["lm_head"],
    "kv_cache_scheme": None,
    "quant_method": "compressed-tensors",
    "quantization_status": "compressed",
    "sparsity_config": {},
    "version": "0.9.1",
}


def test_realistic_llm_compressor_config_with_extra_keys_is_accepted():
    assert parse_quantization_config(REALISTIC_FP8_DYNAMIC, "x") == FP8Checkpoint("compressed-tensors", "channel")


# --- what is refused, with the value and the fix -----------------------------------------------------------
@pytest.mark.parametrize(
    "qc, message",
    [
        (compressed_tensors(targets=["re:.*self_attn.*", "re:.*mlp.*"]), r"targets=\['re:\.\*self_attn"),
        ({**compressed_tensors(), "ignore": ["lm_head", "re:.*down_proj"]}, r"leaves \['re:\.\*down_proj'\]"),
        ({**compressed_tensors(), "ignore": ["lm_head", "model.layers.3.mlp.up_proj"]}, r"model\.layers\.3\.mlp"),
        ({"quant_method": "fp8", "ignored_layers": ["model.layers.0.self_attn.q_proj"]}, r"leaves"),
    ],
)
def test_refused_with_the_value_and_the_fix(qc, message):
    with pytest.raises(ValueError, match=message) as err:
        parse_quantization_config(qc, "ckpt")
    assert "--quantization fp8" in str(err.value)


def test_fp8_method_with_channel_scales_refused_before_ranks_start(fp8_ref, tmp_path):
    """vLLM's `quant_method: fp8` is one scale per tensor; a [N, 1] scale under it disagrees with the config."""
    single, _, _ = fp8_ref
    d = _fp8(single, tmp_path / "fp8_channel", qc={"quant_method": "fp8", "activation_scheme": "dynamic"})
    cfg = ModelConfig.from_hf_config(d)
    assert cfg.fp8_checkpoint == FP8Checkpoint("fp8", "tensor")
    with pytest.raises(CheckpointError, match=r"has shape \(64, 1\); tensor scales imply one of \[\(\), \(1,\)\]"):
        check_checkpoint(cfg)


def test_quantization_config_over_bf16_weights_refused_by_the_check(fp8_ref, tmp_path):
    """A 'frozen' (not compressed) llm-compressor save: bf16 weights beside their scales."""
    single, _, _ = fp8_ref

    d = _fp8(single, tmp_path / "frozen", change=_dequantize)
    with pytest.raises(CheckpointError, match=r"q_proj.weight' is BF16 .* says the linear weights are FP8"):
        check_checkpoint(ModelConfig.from_hf_config(d))


# --- the bugs this review found, fixed ---------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -1.0, 0.0])
def test_non_finite_or_non_positive_scale_is_refused(fp8_ref, tmp_path, bad):
    single, _, _ = fp8_ref

    def damage(t):
        t[SCALE][3] = bad

    d = _fp8(single, tmp_path / "bad_scale", change=damage)
    with pytest.raises(CheckpointError, match=SCALE):
        _load(d).close()


def test_integer_scale_dtype_refused_before_ranks_start(fp8_ref, tmp_path):
    single, _, _ = fp8_ref
    d = _fp8(
        single, tmp_path / "int_scale", change=lambda t: t.__setitem__(SCALE, torch.ones(64, 1, dtype=torch.int32))
    )
    with pytest.raises(CheckpointError, match=SCALE):
        check_checkpoint(ModelConfig.from_hf_config(d))


def test_fp8_weights_without_quantization_config_refused(fp8_ref, tmp_path):
    """e.g. an NVIDIA ModelOpt export (its quantization in hf_quant_config.json), or a config.json edited by hand."""
    _, ref, _ = fp8_ref
    d = str(tmp_path / "no_qc")
    shutil.copytree(ref, d)
    _edit_config(d, lambda c: c.pop("quantization_config"))
    cfg = ModelConfig.from_hf_config(d)
    assert cfg.fp8_checkpoint is None
    with pytest.raises(CheckpointError, match=r"F8_E4M3.*quantization_config"):
        check_checkpoint(cfg)


def test_quantized_lm_head_refused(fp8_ref, tmp_path):
    single, _, _ = fp8_ref

    def quantize_head(t):
        q, s = fp8.quantize_weight(t["lm_head.weight"])
        t["lm_head.weight"], t["lm_head.weight_scale"] = q, s[:, None].contiguous()

    d = _fp8(single, tmp_path / "head", qc={**compressed_tensors(), "ignore": []}, change=quantize_head)
    with pytest.raises(ValueError, match="lm_head"):
        check_checkpoint(ModelConfig.from_hf_config(d))


def test_llm_api_refuses_bf16_weights_under_an_fp8_config(fp8_ref, tmp_path):
    single, _, _ = fp8_ref

    d = _fp8(single, tmp_path / "frozen_api", change=_dequantize)
    with pytest.raises(CheckpointError, match="bfloat16 in the checkpoint, where this model expects float8_e4m3fn"):
        _load(d).close()


@pytest.mark.parametrize("how", ["left out of the index", "mapped to the wrong shard"])
def test_index_that_disagrees_with_the_shards_is_caught_by_the_check(fp8_ref, tmp_path, how):
    _, ref, _ = fp8_ref
    d = str(tmp_path / "index")
    shutil.copytree(ref, d)
    if how == "left out of the index":
        _shard(d, drop_from_index=SCALE)
    else:
        _shard(d, index_file_of={SCALE: "model-00001-of-00002.safetensors"})
    with pytest.raises(CheckpointError, match=SCALE):
        check_checkpoint(ModelConfig.from_hf_config(d))


@pytest.mark.parametrize("ignore", [["re:.*lm_head"], ["re:.*lm_head$"], ["lm_head", "re:.*lm_head"]])
def test_regex_ignore_naming_only_the_lm_head_is_accepted(ignore):
    qc = {**compressed_tensors(), "ignore": ignore}
    assert parse_quantization_config(qc, "x") == FP8Checkpoint("compressed-tensors", "channel")


def test_kv_cache_scheme_is_refused_or_named(fp8_ref, tmp_path):
    single, _, _ = fp8_ref

    def kv_scales(t):
        for i in range(4):
            t[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(0.01)
            t[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor(0.01)

    qc = {**compressed_tensors(), "kv_cache_scheme": dict(KV_CACHE_SCHEME)}
    d = _fp8(single, tmp_path / "kv", qc=qc, change=kv_scales)
    try:
        cfg = ModelConfig.from_hf_config(d)
    except ModelConfigError as e:  # refusing it is right
        assert "kv_cache_scheme" in str(e)
        return
    llm = LLM(cfg, EngineConfig(**ENGINE), device=CPU)  # accepting it is right only if the engine says so
    try:
        assert "kv_cache_scheme" in llm.describe()
    finally:
        llm.close()


@pytest.mark.parametrize(
    "qc",
    [
        {
            **compressed_tensors(),
            "transform_config": {
                "config_groups": {
                    "R4": {"type": "hadamard", "apply": [{"targets": ["re:.*down_proj$"], "location": "input"}]}
                }
            },
        },
        {**compressed_tensors(), "sparsity_config": {"format": "sparse-24-bitmask", "targets": ["Linear"]}},
        compressed_tensors(input_activations={**DYNAMIC_TOKEN, "symmetric": False}),
        compressed_tensors(format="pack-quantized"),
        {
            "quant_method": "fp8",
            "activation_scheme": "dynamic",
            "ignored_layers": ["lm_head"],
            "modules_to_not_convert": ["model.layers.0.mlp.down_proj"],
        },
    ],
    ids=["transform_config", "sparse_24_bitmask", "asymmetric_activations", "group_format", "modules_to_not_convert"],
)
def test_keys_that_change_the_numerics_are_refused(qc):
    with pytest.raises(ValueError):
        parse_quantization_config(qc, "ckpt")


@pytest.mark.parametrize("group", [None, {"targets": ["Linear"], "weights": [8]}])
def test_malformed_config_group_is_a_model_config_error(hf_checkpoint, tmp_path, group):
    single, _, _ = hf_checkpoint
    d = str(tmp_path / "malformed")
    write_fp8_checkpoint(single, d, qc={**compressed_tensors(), "config_groups": {"group_0": group}})
    with pytest.raises(ModelConfigError, match="group_0"):
        ModelConfig.from_hf_config(d)


def test_fp8_checkpoint_on_a_gpu_without_fp8_names_the_checkpoint(fp8_ref, monkeypatch):
    _, d, _ = fp8_ref
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(ValueError, match="8.0") as err:
        LLM(d, EngineConfig(dtype=torch.bfloat16), device=torch.device("cuda"))
    assert "quantization_config" in str(err.value) and "Run without --quantization" not in str(err.value)


def test_fp8_checkpoint_shape_error_names_the_checkpoint(fp8_ref):
    _, d, _ = fp8_ref
    cfg = replace(ModelConfig.from_hf_config(d), intermediate_size=72)  # down_proj [64, 72]: 72 % 16 != 0
    with pytest.raises(ValueError, match=r"\[64, 72\]") as err:
        LLM(cfg, EngineConfig(**ENGINE), device=CPU)
    assert "quantization_config" in str(err.value) and "Run without --quantization" not in str(err.value)


def test_ignore_given_as_one_string():
    """llm-compressor writes a list; a single name as a string means the same list of one."""
    assert parse_quantization_config({**compressed_tensors(), "ignore": "lm_head"}, "x") == FP8Checkpoint(
        "compressed-tensors", "channel"
    )
    with pytest.raises(ValueError, match=r"leaves \['model.layers.0.mlp.up_proj'\]"):
        parse_quantization_config({**compressed_tensors(), "ignore": "model.layers.0.mlp.up_proj"}, "x")
