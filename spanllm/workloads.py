"""The benchmark workloads of the paper's study by name: (prompt_len, decode_len).

No torch here: `spanllm.bench` runs them and `spanllm.perf` reads them back from study logs.
"""

from __future__ import annotations

WORKLOADS: dict[str, tuple[int, int]] = {"decode-heavy": (128, 512), "prefill-heavy": (2048, 32)}
