"""The model sizes the performance model needs, read from `spanllm.model.config.ModelConfig`.

There is one model-shape description, the engine's `ModelConfig` (a preset or an HF config.json); this
module names the presets the planner knows and counts parameters and cache bytes from a config. Weights,
activations and the KV cache are bf16 (DTYPE_BYTES).
"""

from __future__ import annotations

from spanllm.model.config import PRESETS, ModelConfig, ModelConfigError
from spanllm.model_sizes import LLAMA31

DTYPE_BYTES = 2  # bf16 weights, activations and KV cache

MODELS: dict[str, ModelConfig] = {name: PRESETS[name] for name in LLAMA31}
"""The models `spanllm plan` prices by name (the engine's Llama 3.1 presets)."""


def get_model(name: str) -> ModelConfig:
    """A preset by name; accepts 'llama3.1-70b', 'Llama-3.1-70B', 'meta-llama/Llama-3.1-70B-Instruct', '70b'.

    An engine suffix such as ':layers=8' is ignored here; truncation comes from `ModelConfig.with_layers`."""
    key = (
        name.lower()
        .split(":")[0]
        .split("/")[-1]
        .replace("meta-", "")
        .replace("llama-3.1", "llama3.1")
        .replace("-instruct", "")
    )
    if key in MODELS:
        return MODELS[key]
    for k in MODELS:
        size = k.split("-")[-1]
        if key == size or key.endswith("-" + size):
            return MODELS[k]
    raise ModelConfigError(f"unknown model {name!r}; choose one of {', '.join(MODELS)}")


def attn_params(m: ModelConfig) -> int:
    """q, k, v and o projections of one layer."""
    return m.hidden_size * m.head_dim * (m.num_heads + 2 * m.num_kv_heads) + m.num_heads * m.head_dim * m.hidden_size


def mlp_params(m: ModelConfig) -> int:
    """gate, up and down projections (SwiGLU) of one layer."""
    return 3 * m.hidden_size * m.intermediate_size


def layer_params(m: ModelConfig) -> int:
    return attn_params(m) + mlp_params(m)  # norms are negligible


def embedding_params(m: ModelConfig) -> int:
    """Input embedding or LM head (untied in Llama 3.1): vocab x hidden each."""
    return m.vocab_size * m.hidden_size


def params(m: ModelConfig) -> int:
    return m.num_layers * layer_params(m) + 2 * embedding_params(m)


def kv_bytes_per_token_layer(m: ModelConfig, kv_heads_per_gpu: int) -> int:
    """K and V of one token in one layer on one GPU."""
    return 2 * kv_heads_per_gpu * m.head_dim * DTYPE_BYTES
