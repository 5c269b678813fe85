"""Registers and spills of the forward's Triton kernels on Hopper (sm_90), without a GPU: each variant the engine
launches is compiled with Triton's GPU compiler (tests/kernels/hopper_compile.py: the wrappers run, their launches
are caught) and its PTX assembled by the ptxas Triton ships, `-v`. Spills (local-memory stores and loads) on a
memory-bound kernel are a lead for what its time is made of; registers bound the programs an SM holds.

    PYTHONPATH=. python scripts/sm90_registers.py [OUT.json]     (default results/cpu_sm90_compile/registers.json)
"""

from __future__ import annotations

import json
import os
import platform
import re
import subprocess
import sys
import tempfile

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "kernels"))
from hopper_compile import TARGET, capture, compile_launch  # noqa: E402

BF16, FP8 = torch.bfloat16, torch.float8_e4m3fn
SHOWN = ("BLOCK", "BLOCK_N", "BLOCK_K", "SPLIT_K", "NUM_STAGES", "QUANT", "HAS_SCALE", "HAS_RES", "KV_FP8", "PREFETCH")


def launches(pdl_on: bool) -> list[tuple[str, object, tuple, dict]]:
    """(label, kernel, args, kwargs) of the 8B preset's kernels at decode and prefill shapes."""
    from spanllm.kernels import fused_ops as fo
    from spanllm.kernels import paged_attention as pa
    from spanllm.kernels import skinny_gemm as sg
    from spanllm.kernels.fp8_quant import quantize_per_token
    from spanllm.layers import fp8

    labels = []
    mp = pytest.MonkeyPatch()
    try:
        with capture(mp, pdl_on) as caught:

            def mark(label, n_before):
                labels.extend([label] * (len(caught) - n_before))

            n = len(caught)
            x, res, w = torch.zeros(300, 4096, dtype=BF16), torch.zeros(300, 4096, dtype=BF16), torch.ones(4096)
            fo.add_rms_norm(x, res, w.to(BF16), 1e-5)
            mark("add + RMSNorm", n)
            n = len(caught)
            fo.add_rms_norm(x, res, w.to(BF16), 1e-5, quantize=True)
            mark("add + RMSNorm, quantizing", n)
            n = len(caught)
            fo.silu_mul(torch.zeros(300, 2 * 14336, dtype=BF16))
            mark("SiLU x up", n)
            n = len(caught)
            fo.silu_mul(torch.zeros(300, 2 * 14336, dtype=BF16), quantize=True)
            mark("SiLU x up, quantizing", n)
            n = len(caught)
            quantize_per_token(torch.zeros(300, 14336, dtype=BF16))
            mark("per-token quantization", n)
            for name, (nn, kk) in {
                "qkv": (6144, 4096),
                "o": (4096, 4096),
                "gate_up": (28672, 4096),
                "down": (4096, 14336),
            }.items():
                q, scale = fp8.quantize_weight(torch.zeros(nn, kk))
                for m in (1, 64):
                    n = len(caught)
                    sg.skinny_linear(torch.zeros(m, kk, dtype=BF16), q, weight_scale=scale)
                    mark(f"W8A16 {name} M={m}", n)
                n = len(caught)
                sg.skinny_linear(torch.zeros(1, kk, dtype=BF16), torch.zeros(nn, kk, dtype=BF16))
                mark(f"bf16 skinny {name} M=1", n)
            for kv in (BF16, FP8):
                kc, vc = torch.zeros(65, 16, 8, 128, dtype=kv), torch.zeros(65, 16, 8, 128, dtype=kv)
                tables, ctx = torch.zeros(4, 16, dtype=torch.int32), torch.full((4,), 250, dtype=torch.int32)
                n = len(caught)
                pa.decode(torch.zeros(4, 32, 128, dtype=BF16), kc, vc, tables, ctx, 8, prefetch=True)
                mark(f"decode, {str(kv)[6:]} cache", n)
                n = len(caught)
                cu_q, tiles = torch.tensor([0, 96], dtype=torch.int32), torch.zeros(6, 2, dtype=torch.int32)
                pa.prefill(torch.zeros(96, 32, 128, dtype=BF16), kc, vc, tables[:1], cu_q, ctx[:1], tiles)
                mark(f"prefill, {str(kv)[6:]} cache", n)
        return [(label, *launch) for label, launch in zip(labels, caught, strict=True)]
    finally:
        mp.undo()


def ptxas_report(ptx: str) -> dict:
    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    try:
        out = subprocess.run(
            [get_ptxas(TARGET[1]).path, "-v", "--gpu-name", f"sm_{TARGET[1]}a", f.name, "-o", os.devnull],
            capture_output=True,
            text=True,
            check=True,
        ).stderr
    finally:
        os.unlink(f.name)
    num = lambda pat: int(m.group(1)) if (m := re.search(pat, out)) else None  # noqa: E731
    return {
        "registers": num(r"Used (\d+) registers"),
        "spill_stores_bytes": num(r"(\d+) bytes spill stores"),
        "spill_loads_bytes": num(r"(\d+) bytes spill loads"),
        "shared_bytes": num(r"(\d+) bytes smem"),
    }


def main() -> None:
    out = sys.argv[1] if len(sys.argv) > 1 else "results/cpu_sm90_compile/registers.json"
    import triton

    rows = []
    for pdl_on in (False, True):
        for label, fn, args, kwargs in launches(pdl_on):
            k = compile_launch(fn, args, kwargs)
            row = {"kernel": fn.__name__, "case": label, "pdl": pdl_on, "num_warps": kwargs.get("num_warps")}
            row.update({c: kwargs[c] for c in SHOWN if c in kwargs})
            row.update(ptxas_report(k.asm["ptx"]))
            rows.append(row)
            print(
                f"{'pdl' if pdl_on else '   '} {label:28s} warps {row['num_warps']}: {row['registers']} registers, "
                f"spills {row['spill_stores_bytes']} B stored / {row['spill_loads_bytes']} B loaded",
                flush=True,
            )
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    doc = {
        "what": __doc__.strip().splitlines()[0],
        "target": f"sm_{TARGET[1]}a",
        "machine": {"platform": platform.platform(), "gpu": None},
        "versions": {"torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version()},
        "rows": rows,
    }
    with open(out, "w") as f:
        json.dump(doc, f, indent=1)
    print("wrote", out)


if __name__ == "__main__":
    main()
