"""`spanllm bench gemm`'s suggestions (GPU-free): the configs that beat the heuristic, with the times that
decode_gemm="auto" needs beside them (spanllm/kernels/skinny_gemm.py: CONFIG_OVERRIDES and MEASURED_US)."""

from __future__ import annotations

from spanllm.commands import bench_gemm as gemm


def _row(m, n, k, heur_us, best_us, f_us, cfg):
    return {
        "m": m,
        "n": n,
        "k": k,
        "weight_bytes": n * k * 2,
        "skinny_heuristic": {"median_us": heur_us},
        "best": {"config": cfg, "median_us": best_us},
        "f_linear": {"median_us": f_us},
    }


def test_suggestions_keep_the_times_beside_the_configs():
    rows = [
        _row(1, 6144, 4096, 17.2, 14.94, 15.48, [64, 256, 1, 4, 4]),
        _row(8, 6144, 4096, 21.5, 15.15, 15.68, [64, 256, 1, 4, 4]),
        _row(1, 4096, 4096, 11.7, 11.65, 12.28, [32, 256, 1, 4, 4]),
    ]  # within 3% of the heuristic: left out
    assert gemm.suggest_overrides(rows, 0.03) == {
        (1, 6144, 4096, 2): (64, 256, 1, 4, 4),
        (8, 6144, 4096, 2): (64, 256, 1, 4, 4),
    }
    assert gemm._suggested(rows, 0.03)[(1, 6144, 4096, 2)] == ((64, 256, 1, 4, 4), 14.94, 15.48)
