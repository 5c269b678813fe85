"""What fusing the W8A8 GEMM's activation quantization into the kernel that produces the activation saves, at the
Llama 3.1 8B's shapes on one GPU, PDL off and on (spanllm.kernels.fused_ops quantize=True, spanllm.kernels.pdl).

    PYTHONPATH=. python scripts/gpu_fused_quant.py OUTDIR [--ms 32,64,128,256,1024,4096,8192]

Per M, microseconds per call (CUDA graph of `calls` calls, replays timed with CUDA events; medians and every
replay in the JSON):
- norm_unfused: residual add + RMSNorm to bf16, then quantize_per_token; norm_fused: the same kernel quantizing
  its own output (hidden 4096)
- silu_unfused: SiLU(gate) * up to bf16, then quantize_per_token; silu_fused: quantizing itself (ffn 14336)
- qkv_unfused / qkv_fused: the norm chain followed by the qkv GEMM (torch._scaled_mm, W 6144 x 4096 FP8; four
  weights in turn so W comes from HBM); down_unfused / down_fused: the SiLU chain and the down GEMM (4096 x 14336)
Writes OUTDIR/fused_quant.json (machine, versions, settings, raw numbers). The M from which the fused rows win
(qkv and down both) is what spanllm.layers.fp8.FUSED_QUANT_MIN_ROWS should say.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch

from spanllm.kernels import pdl
from spanllm.kernels.fp8_quant import quantize_per_token
from spanllm.kernels.fused_ops import add_rms_norm, silu_mul
from spanllm.layers import fp8
from spanllm.measure.report import machine_info, versions
from spanllm.measure.timing import graph_us_per_call

HIDDEN, FFN, QKV = 4096, 14336, 6144
WEIGHTS = 4  # distinct FP8 weights per GEMM, used in turn (4 x 25-58 MB: more than the 50 MB L2)


def _gemm(a: fp8.Fp8Activation, w: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return torch._scaled_mm(a.q, w[0].t(), scale_a=a.scale, scale_b=w[1].view(1, -1), out_dtype=torch.bfloat16)


def make_cases(m: int, dev, g, norm_w, w_qkv, w_down) -> dict:
    """name -> fn(i) for one M (module docstring)."""
    x = torch.randn(m, HIDDEN, device=dev, dtype=torch.bfloat16, generator=g)
    res = torch.randn(m, HIDDEN, device=dev, dtype=torch.bfloat16, generator=g)
    gu = torch.randn(m, 2 * FFN, device=dev, dtype=torch.bfloat16, generator=g)

    def norm_unfused(i):
        y, _ = add_rms_norm(x, res, norm_w, 1e-5)
        return fp8.Fp8Activation(*quantize_per_token(y), y.dtype)

    def norm_fused(i):
        return add_rms_norm(x, res, norm_w, 1e-5, quantize=True)[0]

    def silu_unfused(i):
        y = silu_mul(gu)
        return fp8.Fp8Activation(*quantize_per_token(y), y.dtype)

    def silu_fused(i):
        return silu_mul(gu, quantize=True)

    return {
        "norm_unfused": norm_unfused,
        "norm_fused": norm_fused,
        "silu_unfused": silu_unfused,
        "silu_fused": silu_fused,
        "qkv_unfused": lambda i: _gemm(norm_unfused(i), w_qkv[i % WEIGHTS]),
        "qkv_fused": lambda i: _gemm(norm_fused(i), w_qkv[i % WEIGHTS]),
        "down_unfused": lambda i: _gemm(silu_unfused(i), w_down[i % WEIGHTS]),
        "down_fused": lambda i: _gemm(silu_fused(i), w_down[i % WEIGHTS]),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("outdir")
    ap.add_argument("--ms", default="32,64,128,256,1024,4096,8192")
    ap.add_argument("--calls", type=int, default=16)
    args = ap.parse_args()
    os.makedirs(args.outdir, exist_ok=True)
    dev = torch.device("cuda", 0)
    g = torch.Generator(device="cuda").manual_seed(0)
    w_qkv = [fp8.quantize_weight(torch.randn(QKV, HIDDEN, device=dev, generator=g) / 64) for _ in range(WEIGHTS)]
    w_down = [fp8.quantize_weight(torch.randn(HIDDEN, FFN, device=dev, generator=g) / 120) for _ in range(WEIGHTS)]
    norm_w = torch.rand(HIDDEN, device=dev, dtype=torch.bfloat16, generator=g) + 0.5
    doc = {
        "kind": "fused_activation_quantization",
        "machine": machine_info(),
        "versions": versions(),
        "settings": {"ms": args.ms, "calls": args.calls, "hidden": HIDDEN, "ffn": FFN, "qkv": QKV},
        "rows": [],
    }

    modes = ("off", "on") if pdl.supported(dev) else ("off",)
    for mode in modes:
        for m in [int(v) for v in args.ms.split(",")]:
            cases = make_cases(m, dev, g, norm_w, w_qkv, w_down)
            row = {"m": m, "pdl": mode}
            for name, fn in cases.items():
                with pdl.launching(mode == "on"):
                    us = graph_us_per_call(fn, args.calls)
                row[name + "_us"] = statistics.median(us)
                row[name + "_replays_us"] = us
            doc["rows"].append(row)
            with open(os.path.join(args.outdir, "fused_quant.json"), "w") as f:
                json.dump(doc, f, indent=1)
            print(f"pdl {mode} M={m}: " + ", ".join(f"{name} {row[name + '_us']:.1f}" for name in cases), flush=True)


if __name__ == "__main__":
    main()
