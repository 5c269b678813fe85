"""FP8's quality on the real model (SmolLM2-135M-Instruct, CPU path: weights quantized then dequantized, x per
token above 16 rows; and the FP8 KV cache, below), on the fixed text of spanllm.bench.quantization_quality.

Thresholds: the issue's (log-likelihood within 2% of bf16's) and a top-1 agreement floor of 0.88. Measured on
this path (results/cpu_smollm2/fp8_quality.json): -0.50% / -0.27% and 0.915 / 0.942 (one step / chunks of 16); bf16
itself against float32 agrees on 0.978 of the positions. The floor leaves room for a BLAS that sums in another
order flipping near-tied positions; a broken quantization (a wrong scale axis, a missing scale) agrees on far
fewer and moves the likelihood by far more than 2%.
"""

from __future__ import annotations

import torch

from spanllm.bench.quantization_quality import compare

TOP1_FLOOR = 0.88
LL_TOLERANCE = 0.02


def test_fp8_log_likelihood_and_top1_agreement_with_bf16(real_model_path):
    report = compare("smollm2-135m-instruct", "fp8", torch.bfloat16)
    assert report["text_tokens"] > 300
    for shape, row in report["shapes"].items():
        assert row["positions"] == report["text_tokens"] - 1
        assert abs(row["log_likelihood_rel_change"]) <= LL_TOLERANCE, (shape, row)
        assert row["top1_agreement"] >= TOP1_FLOOR, (shape, row)


def test_fp8_kv_cache_log_likelihood_and_top1_agreement_with_bf16(real_model_path):
    """--kv-cache-dtype fp8 (weights bf16): every K and V the text's positions attend rounded to e4m3 (scale 1).
    Measured on this path (results/cpu_smollm2/fp8_quality.json, fp8_kv_vs_bf16): -0.23% / -0.15% and 0.945 /
    0.953 (one step / chunks of 16). Same thresholds as the weights'."""
    report = compare("smollm2-135m-instruct", None, torch.bfloat16, kv_cache_dtype="fp8")
    assert report["quantized"]["kv_cache_dtype"] == "fp8"
    for shape, row in report["shapes"].items():
        assert row["positions"] == report["text_tokens"] - 1
        assert abs(row["log_likelihood_rel_change"]) <= LL_TOLERANCE, (shape, row)
        assert row["top1_agreement"] >= TOP1_FLOOR, (shape, row)
