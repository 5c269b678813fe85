"""The benchmark workloads of the paper's study by name: (prompt_len, decode_len).

No torch here: `spanllm.bench` runs them and `spanllm.perf` reads them back from study logs.
"""

from __future__ import annotations

WORKLOADS: dict[str, tuple[int, int]] = {"decode-heavy": (128, 512), "prefill-heavy": (2048, 32)}

# The engine's rule for TP all-reduces: a buffered backend (nvrar, torch symm-mem) takes messages up to this
# size (decode activations), the group's own collective the larger ones (prefill), as in the paper's engine.
# EngineConfig.allreduce_max_bytes defaults to it; the performance model prices engine rows by it.
BUFFERED_ALLREDUCE_MAX_BYTES = 2 << 20
