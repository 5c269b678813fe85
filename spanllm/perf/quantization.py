"""Weight bytes per parameter and the GEMM rate the performance model prices (`--quantization`).

spanllm's FP8 (spanllm/layers/fp8.py): the decoder layers' linear weights (q/k/v/o, gate/up/down) are e4m3, one
byte per parameter (the per-output-channel fp32 scales add 4 bytes per row: under 0.1% of a layer, not counted);
the embedding and the LM head stay bf16, and so do the KV cache and the activations. Decode up to W8A16_MAX_ROWS
rows runs W8A16 weight-streaming GEMVs: half the weight bytes, no faster math, streamed at
`ClusterSpec.fp8_read_w8a16` of the bf16 kernels' rate (`fp8_read_w8a8` above that: both measured below 1). Larger
M runs W8A8 on FP8 tensor cores at `ClusterSpec.fp8_gemm_speedup` times the bf16 GEMM rate (1.0 on a GPU without
them: weight-only FP8, which this module prices but the engine refuses, and so does `spanllm plan`). (The engine
also keeps W8A16 up to 128 rows for the shapes where its measured table found it faster; the model, which knows no
table, prices those rows at the FP8 rate.) The roofline (roofline.py) is a bound: it reads FP8 weights at the copy
rate.
"""

from __future__ import annotations

from dataclasses import dataclass

from spanllm.model.config import ModelConfig
from spanllm.perf.model_shape import DTYPE_BYTES, embedding_params, layer_params


class QuantizationError(ValueError):
    """A quantization the performance model does not price."""


@dataclass(frozen=True)
class Quantization:
    name: str
    linear_weight_bytes: float  # per parameter of the decoder layers' linear weights
    fp8_gemm: bool  # layer GEMMs run on FP8 tensor cores (at ClusterSpec.fp8_gemm_speedup) where M is large
    kv_element_bytes: float = DTYPE_BYTES  # the KV cache's (1: --kv-cache-dtype fp8; priced by the roofline only)

    def with_fp8_kv_cache(self) -> Quantization:
        """The same weights with an FP8 KV cache (--kv-cache-dtype fp8): one byte a K or V element."""
        return Quantization(f"{self.name}, fp8 KV cache", self.linear_weight_bytes, self.fp8_gemm, 1)

    def layer_weight_bytes(self, model: ModelConfig) -> float:
        """One decoder layer's linear weights (whole, before any TP split)."""
        return layer_params(model) * self.linear_weight_bytes

    def head_weight_bytes(self, model: ModelConfig) -> float:
        """The embedding or the LM head: bf16 in every quantization."""
        return embedding_params(model) * DTYPE_BYTES

    def weight_bytes(self, model: ModelConfig) -> float:
        """Every weight of the model: its layers, the embedding and the LM head."""
        return model.num_layers * self.layer_weight_bytes(model) + 2 * self.head_weight_bytes(model)


W8A16_MAX_ROWS = 16
"""Rows up to which spanllm's FP8 GEMM is always W8A16, bf16 math (spanllm.kernels.skinny_gemm's
FP8_ALWAYS_WEIGHT_ONLY_M; a test holds them equal)."""


def gemm_speedup(quant: Quantization, rows: int, fp8_gemm_speedup: float) -> float:
    """The layer GEMMs' rate over bf16's at `rows` tokens: FP8 tensor cores above W8A16_MAX_ROWS, else 1."""
    return fp8_gemm_speedup if quant.fp8_gemm and rows > W8A16_MAX_ROWS else 1.0


def weight_read_factor(quant: Quantization, rows: int, w8a16: float, w8a8: float) -> float:
    """The layer weights' streaming rate over bf16's at `rows` tokens (ClusterSpec.fp8_read_w8a16 / fp8_read_w8a8):
    the factor a weight-bound GEMM's bytes are divided by. 1 for 16-bit weights."""
    if quant.linear_weight_bytes >= DTYPE_BYTES:
        return 1.0
    return w8a16 if rows <= W8A16_MAX_ROWS else w8a8


BF16 = Quantization("bf16", DTYPE_BYTES, False)
FP8 = Quantization("fp8", 1, True)
QUANTIZATIONS = {"bf16": BF16, "fp8": FP8}


def get_quantization(name: str | None) -> Quantization:
    """None or 'bf16': the model dtype; 'fp8': spanllm's FP8 (module docstring)."""
    if name is None:
        return BF16
    if name not in QUANTIZATIONS:
        raise QuantizationError(f"quantization {name!r} is not modelled; choose one of {', '.join(QUANTIZATIONS)}")
    return QUANTIZATIONS[name]
