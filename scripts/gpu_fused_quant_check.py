"""Where the norm's fused FP8 quantization and norm-then-quantize disagree (tests/engine/test_fp8.py, GPU): is it a
race (runs of the same kernel on the same input differ) or arithmetic (they agree with themselves, not each other)?

    PYTHONPATH=. python scripts/gpu_fused_quant_check.py OUTDIR

For the test's inputs (rows 300 and 4,100; hidden 4,096, 5,120 and 100; with and without a residual), REPEATS runs
each of: add_rms_norm(quantize=True) (fused), add_rms_norm then quantize_per_token (unfused), in that order and in
the reverse order. Per case: whether each kernel's runs are bit-identical, the rows where fused and unfused differ
in any byte, and for the first few differing bytes the unfused bf16 value, the scale and both bytes. Writes
OUTDIR/fused_quant_check.json (machine, versions, settings, raw findings) and prints one line per case.
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from spanllm.kernels.fp8_quant import quantize_per_token, quantize_per_token_reference
from spanllm.kernels.fused_ops import add_rms_norm, add_rms_norm_reference
from spanllm.measure.report import machine_info, versions

REPEATS = 4


def _bytes(q: torch.Tensor) -> torch.Tensor:
    return q.view(torch.uint8).clone()


def check(m: int, h: int, with_residual: bool, fused_first: bool) -> dict:
    g = torch.Generator(device="cuda").manual_seed(m * 7 + h)
    x = torch.randn(m, h, device="cuda", dtype=torch.bfloat16, generator=g)
    res = torch.randn(m, h, device="cuda", dtype=torch.bfloat16, generator=g) if with_residual else None
    w = torch.rand(h, device="cuda", dtype=torch.bfloat16, generator=g) + 0.5
    fused, unfused, plains, scales = [], [], [], []

    def run_fused():
        out, _ = add_rms_norm(x, res, w, 1e-5, quantize=True)
        fused.append((_bytes(out.q), out.scale.clone()))

    def run_unfused():
        plain, _ = add_rms_norm(x, res, w, 1e-5)
        q, s = quantize_per_token(plain)
        plains.append(plain.clone())
        unfused.append((_bytes(q), s.clone()))
        scales.append(s.clone())

    for _ in range(REPEATS):
        for step in (run_fused, run_unfused) if fused_first else (run_unfused, run_fused):
            step()
    torch.cuda.synchronize()
    f0, fs0 = fused[0]
    u0, us0 = unfused[0]
    diff = f0 != u0
    rows = sorted({int(r) for r in diff.nonzero()[:, 0].tolist()})
    samples = []
    for r, c in diff.nonzero().tolist()[:8]:
        samples.append(
            {
                "row": r,
                "col": c,
                "unfused_bf16": plains[0][r, c].float().item(),
                "scale": us0[r, 0].item(),
                "fused_byte": int(f0[r, c]),
                "unfused_byte": int(u0[r, c]),
            }
        )
    # Which side is off: both against torch's chain (F.rms_norm in float32, rounded, times w, quantized by the
    # reference), row by row; and each differing row's sum of squares in float64 beside the one torch's float32 gives.
    ref_plain, _ = add_rms_norm_reference(x, res, w, 1e-5)
    rq, rs = quantize_per_token_reference(ref_plain)
    rq = _bytes(rq)
    xr = (x.float() + res.float()).to(torch.bfloat16).float() if res is not None else x.float()
    row_stats = []
    off_torch = sorted({int(r) for r in ((f0 != rq) | (u0 != rq)).nonzero()[:, 0].tolist()})
    for r in off_torch[:4]:  # the rows where either chain differs from torch's
        row = xr[r].double()
        row_stats.append(
            {
                "row": r,
                "mean_square_float64": float((row * row).mean()),
                "mean_square_float32": float((xr[r] * xr[r]).mean()),
                "kernel_bf16_vs_torch_elements": int((plains[0][r] != ref_plain[r]).sum()),
                "fused_vs_torch_bytes": int((f0[r] != rq[r]).sum()),
                "unfused_vs_torch_bytes": int((u0[r] != rq[r]).sum()),
                "scale_vs_torch": [us0[r, 0].item(), rs[r, 0].item()],
            }
        )
    return {
        "fused_vs_torch_rows": sorted({int(r) for r in (f0 != rq).nonzero()[:, 0].tolist()})[:20],
        "unfused_vs_torch_rows": sorted({int(r) for r in (u0 != rq).nonzero()[:, 0].tolist()})[:20],
        "kernel_bf16_vs_torch_rows": sorted({int(r) for r in (plains[0] != ref_plain).nonzero()[:, 0].tolist()})[:20],
        "differing_row_stats": row_stats,
        "rows": m,
        "hidden": h,
        "residual": with_residual,
        "fused_first": fused_first,
        "fused_runs_identical": all(torch.equal(f, f0) and torch.equal(s, fs0) for f, s in fused),
        "unfused_norm_runs_identical": all(torch.equal(p, plains[0]) for p in plains),
        "unfused_quant_runs_identical": all(torch.equal(q, u0) and torch.equal(s, us0) for q, s in unfused),
        "scales_equal": torch.equal(fs0, us0),
        "differing_bytes": int(diff.sum()),
        "differing_rows": rows[:20],
        "fused_runs_differing_bytes": [int((f != f0).sum()) for f, _ in fused],
        "samples": samples,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("outdir")
    args = ap.parse_args()
    os.makedirs(args.outdir, exist_ok=True)
    found = []
    for m in (300, 4100):
        for h in (4096, 5120, 100):
            for with_residual in (True, False):
                for fused_first in (True, False):
                    r = check(m, h, with_residual, fused_first)
                    found.append(r)
                    print(
                        f"m={m} h={h} residual={with_residual} fused_first={fused_first}: fused runs identical "
                        f"{r['fused_runs_identical']} {r['fused_runs_differing_bytes']}, unfused identical "
                        f"{r['unfused_norm_runs_identical']}/{r['unfused_quant_runs_identical']}, scales equal "
                        f"{r['scales_equal']}, {r['differing_bytes']} bytes differ in rows {r['differing_rows']}; "
                        f"against torch: "
                        f"fused rows {r['fused_vs_torch_rows'][:6]}, unfused rows {r['unfused_vs_torch_rows'][:6]}, "
                        f"bf16 norm rows {r['kernel_bf16_vs_torch_rows'][:6]}",
                        flush=True,
                    )
    path = os.path.join(args.outdir, "fused_quant_check.json")
    with open(path, "w") as f:
        json.dump({"machine": machine_info(), "versions": versions(), "repeats": REPEATS, "cases": found}, f, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
