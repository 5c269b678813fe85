from __future__ import annotations

import json

import pytest

from spanllm.model.config import ModelConfig, ModelConfigError, RopeScaling, preset

LLAMA31_ROPE = RopeScaling(8.0, 1.0, 4.0, 8192)


@pytest.mark.parametrize(
    "name,hidden,layers,heads,ffn",
    [
        ("llama3.1-8b", 4096, 32, 32, 14336),
        ("llama3.1-70b", 8192, 80, 64, 28672),
        ("llama3.1-405b", 16384, 126, 128, 53248),
    ],
)
def test_presets_have_llama31_shapes(name, hidden, layers, heads, ffn):
    c = preset(name)
    assert (c.hidden_size, c.num_layers, c.num_heads, c.num_kv_heads, c.intermediate_size) == (
        hidden,
        layers,
        heads,
        8,
        ffn,
    )
    assert (c.vocab_size, c.rope_theta, c.rms_norm_eps, c.head_dim) == (128256, 500000.0, 1e-5, 128)
    assert c.rope_scaling == LLAMA31_ROPE
    assert c.tie_word_embeddings is False
    assert c.truncated_layers is None and c.label == name


def test_parameter_counts_match_published_sizes():
    assert round(preset("llama3.1-8b").num_params() / 1e9, 2) == 8.03
    assert round(preset("llama3.1-70b").num_params() / 1e9, 1) == 70.6
    assert round(preset("llama3.1-405b").num_params() / 1e9, 0) == 406


def test_truncated_preset_is_labelled():
    c = preset("llama3.1-405b:layers=8")
    assert (c.num_layers, c.truncated_from, c.truncated_layers) == (8, 126, 8)
    assert c.hidden_size == 16384
    assert "TRUNCATED: 8 of 126 layers" in c.label
    assert preset("llama3.1-8b:layers=32").truncated_layers is None  # all layers kept: not truncated


@pytest.mark.parametrize(
    "spec,match",
    [
        ("llama9", "unknown preset"),
        ("llama3.1-8b:layers=33", "between 1 and 32"),
        ("llama3.1-8b:layers=0", "between 1 and 32"),
    ],
)
def test_bad_presets(spec, match):
    with pytest.raises(ModelConfigError, match=match):
        preset(spec)


BASE = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 100,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-6,
}


def test_from_hf_config_transformers5_rope_parameters():
    c = ModelConfig.from_hf_config(
        {
            **BASE,
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
            "eos_token_id": [1, 2],
        }
    )
    assert c.rope_theta == 500000.0 and c.rope_scaling == LLAMA31_ROPE
    assert (c.head_dim, c.num_kv_heads, c.rms_norm_eps, c.eos_token_ids) == (16, 2, 1e-6, (1, 2))


def test_from_hf_config_legacy_rope_scaling(tmp_path):
    cfg = {
        **BASE,
        "rope_theta": 500000.0,
        "tie_word_embeddings": True,
        "eos_token_id": 5,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    }
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    c = ModelConfig.from_hf_config(tmp_path)
    assert c.rope_scaling == LLAMA31_ROPE and c.tie_word_embeddings and c.eos_token_ids == (5,)
    assert c.checkpoint_dir == str(tmp_path)


@pytest.mark.parametrize(
    "change,match",
    [
        ({"architectures": ["MistralForCausalLM"]}, "MistralForCausalLM.*not supported.*LlamaForCausalLM"),
        ({"attention_bias": True}, "attention_bias=True is not supported"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_type='yarn' is not supported"),
        ({"num_key_value_heads": 3}, "num_heads=4 is not a multiple of num_kv_heads=3"),
    ],
)
def test_from_hf_config_rejects(change, match):
    with pytest.raises(ModelConfigError, match=match):
        ModelConfig.from_hf_config({**BASE, **change})


def test_missing_config_json(tmp_path):
    with pytest.raises(ModelConfigError, match="no config.json"):
        ModelConfig.from_hf_config(tmp_path)


def test_prefill_tiling_file_errors_name_the_problem(tmp_path):
    from spanllm.kernels.prefill_config import load_prefill_config

    partial = tmp_path / "partial.json"
    partial.write_text('{"block_q": 32}')
    with pytest.raises(ValueError, match=r"fields \['block_n', 'num_stages', 'num_warps'\] are missing"):
        load_prefill_config(str(partial))
    broken = tmp_path / "broken.json"
    broken.write_text("{")
    with pytest.raises(ValueError, match=r"broken.json: Expecting property name"):
        load_prefill_config(str(broken))
