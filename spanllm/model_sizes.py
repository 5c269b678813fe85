"""The sizes of the Llama 3.1 models, one table for the engine's presets and the performance model.

No torch here: `spanllm.perf` imports it on machines without torch. Values from the models' HF config.json
(vocab 128256 and 8 KV heads for all three).
"""

from __future__ import annotations

# name: (hidden_size, num_layers, num_heads, intermediate_size)
LLAMA31: dict[str, tuple[int, int, int, int]] = {
    "llama3.1-8b": (4096, 32, 32, 14336),
    "llama3.1-70b": (8192, 80, 64, 28672),
    "llama3.1-405b": (16384, 126, 128, 53248),
}
LLAMA31_VOCAB = 128256
LLAMA31_KV_HEADS = 8
