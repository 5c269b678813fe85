"""Derived numbers for the engine results: TPOT against the weight-bandwidth bound, what nvrar saves per
all-reduce in decode against what the all-reduce benchmark says it should, and the most any all-reduce
could gain (Amdahl) on this machine. Reads the committed JSONs; prints a Markdown table. "decode" says how
the step ran: eager forward or torch.compile'd (EngineConfig.compile_scope), with F.linear or the skinny
Triton GEMM (EngineConfig.decode_gemm).

    python scripts/engine_summary.py [--results results/h200x2] [--hbm-tbps 4.8]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from spanllm.perf.model_shape import DTYPE_BYTES, get_model, params


def allreduce_us(rows: list[dict], algo: str, nbytes: int) -> float | None:
    for r in rows:
        if r["algo"] == algo and r["size"] == nbytes:
            return r["time_us"]
    return None


def decode_mode(row: dict, stem: str) -> str:
    """How the decode step ran: eager forward or torch.compile'd (scope), and which decode GEMM."""
    mode = f"compiled {row['compile_scope']}" if row.get("compile_decode") else "eager"
    if row.get("decode_gemm", "torch") != "torch":
        # the skinny kernel's configs: the measured overrides, or (files named *_heuristic) the heuristic
        mode += f" + {row['decode_gemm']}" + (" (heuristic)" if stem.endswith("_heuristic") else "")
    return mode


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--results", default="results/h200x2")
    ap.add_argument("--hbm-tbps", type=float, default=4.8, help="H200 HBM3e peak (datasheet)")
    args = ap.parse_args()
    res = Path(args.results)
    ar = json.loads((res / "allreduce_1x2_bf16.json").read_text())["rows"]
    print(
        "| file | decode | model | workload | batch | AR bytes | TPOT nccl ms | TPOT nvrar ms | TPOT / weight bound (nccl) | "  # noqa: E501
        "saved per AR in decode us | benchmark nccl - nvrar us | nccl AR share of TPOT | max gain, free AR |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for path in sorted(res.glob("study_*.json")) + sorted(res.glob("batch_*.json")):
        doc = json.loads(path.read_text())
        rows = [r for r in doc["rows"] if r["tp"] == 2 and r["pp"] == 1]
        for batch in sorted({r["batch"] for r in rows}):
            by = {r["allreduce"]: r for r in rows if r["batch"] == batch}
            if not {"nccl", "nvrar"} <= set(by):
                continue
            model = by["nccl"]["model"]
            decode = decode_mode(by["nccl"], path.stem)
            shape = get_model(model)
            n_ar = 2 * shape.num_layers  # two row-parallel all-reduces per layer per decode step
            nbytes = batch * shape.hidden_size * DTYPE_BYTES  # bf16 activations of one decode step
            bound_ms = params(shape) * DTYPE_BYTES / 2 / (args.hbm_tbps * 1e12) * 1e3  # weight bytes per GPU, TP=2
            t_nccl, t_nvrar = by["nccl"]["tpot_ms"], by["nvrar"]["tpot_ms"]
            bench_nccl, bench_nvrar = allreduce_us(ar, "nccl", nbytes), allreduce_us(ar, "nvrar", nbytes)
            saved = (t_nccl - t_nvrar) / n_ar * 1e3
            bench = f"{bench_nccl - bench_nvrar:.2f}" if bench_nccl and bench_nvrar else "-"
            share = n_ar * bench_nccl / 1e3 / t_nccl if bench_nccl else None
            print(
                f"| {path.stem.split('_')[0]} | {decode} | {model} | {by['nccl']['workload']} | {batch} | {nbytes // 1024} KiB | {t_nccl:.3f} | "  # noqa: E501
                f"{t_nvrar:.3f} | {t_nccl / bound_ms:.2f}x of {bound_ms:.2f} | {saved:.2f} | {bench} | "
                + (f"{share:.1%} | {1 / (1 - share):.3f}x |" if share is not None else "- | - |")
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
