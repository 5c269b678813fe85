"""Model shapes the performance model needs: sizes only, no weights.

The Llama 3.1 sizes come from spanllm.model_sizes, the table the engine's presets are built from too,
so the model and the engine describe the same networks.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from spanllm.model_sizes import LLAMA31, LLAMA31_KV_HEADS, LLAMA31_VOCAB


class ModelShapeError(ValueError):
    """A shape with inconsistent sizes, or an unknown model name."""


@dataclass(frozen=True)
class ModelShape:
    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    dtype_bytes: int = 2  # bf16 weights, activations and KV cache
    truncated_from: int | None = None  # original layer count when the preset keeps only some layers

    def __post_init__(self) -> None:
        for name in ("hidden", "layers", "heads", "kv_heads", "ffn", "vocab", "dtype_bytes"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ModelShapeError(f"{self.name}: {name}={v!r} must be an integer >= 1")
        if self.hidden % self.heads:
            raise ModelShapeError(f"{self.name}: hidden={self.hidden} is not divisible by heads={self.heads}")
        if self.heads % self.kv_heads:
            raise ModelShapeError(f"{self.name}: heads={self.heads} is not divisible by kv_heads={self.kv_heads}")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def attn_params(self) -> int:
        """q and o projections (hidden x hidden each) + k and v (hidden x kv_heads*head_dim each)."""
        return 2 * self.hidden * self.hidden + 2 * self.hidden * self.kv_heads * self.head_dim

    @property
    def mlp_params(self) -> int:
        """gate, up and down projections (SwiGLU)."""
        return 3 * self.hidden * self.ffn

    @property
    def layer_params(self) -> int:
        return self.attn_params + self.mlp_params  # norms are negligible

    @property
    def embedding_params(self) -> int:
        """Input embedding or LM head (untied in Llama 3.1 8B/70B/405B): vocab x hidden each."""
        return self.vocab * self.hidden

    @property
    def params(self) -> int:
        return self.layers * self.layer_params + 2 * self.embedding_params

    def kv_bytes_per_token_layer(self, kv_heads_per_gpu: int) -> int:
        """K and V of one token in one layer on one GPU."""
        return 2 * kv_heads_per_gpu * self.head_dim * self.dtype_bytes

    def truncated(self, layers: int) -> ModelShape:
        """The same shapes with only `layers` layers, labelled as such."""
        if not 1 <= layers <= self.layers:
            raise ModelShapeError(f"{self.name}: truncated_layers={layers} must lie in [1, {self.layers}]")
        return replace(
            self, name=f"{self.name} ({layers} of {self.layers} layers)", layers=layers, truncated_from=self.layers
        )


MODELS: dict[str, ModelShape] = {
    name: ModelShape(name, hidden=h, layers=n, heads=q, kv_heads=LLAMA31_KV_HEADS, ffn=f, vocab=LLAMA31_VOCAB)
    for name, (h, n, q, f) in LLAMA31.items()
}


def get_model(name: str) -> ModelShape:
    """A shape by name; accepts 'llama3.1-70b', 'Llama-3.1-70B', 'meta-llama/Llama-3.1-70B-Instruct', '70b'.

    An engine suffix such as ':layers=8' is ignored here; truncation comes from `truncated_layers`."""
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
    raise ModelShapeError(f"unknown model {name!r}; known: {', '.join(MODELS)}")
