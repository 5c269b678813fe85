"""Registers and spills of the forward's Triton kernels on Hopper (sm_90), without a GPU: each variant the engine
launches is compiled with Triton's GPU compiler (tests/kernels/hopper_compile.py: the wrappers run, their launches
are caught) and its PTX assembled by the ptxas Triton ships, `-v`. Spills (local-memory stores and loads) on a
memory-bound kernel are a lead for what its time is made of; registers bound the programs an SM holds.

    PYTHONPATH=. python scripts/sm90_registers.py [OUT.json]     (default results/cpu_sm90_compile/registers.json)
"""

from __future__ import annotations

import contextlib
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
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from hopper_compile import TARGET, capture, compile_launch  # noqa: E402

BF16, FP8 = torch.bfloat16, torch.float8_e4m3fn
LAYERS_8B = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}  # (N, K)
SHOWN = (
    "BLOCK",
    "BLOCK_N",
    "BLOCK_K",
    "SPLIT_K",
    "NUM_STAGES",
    "QUANT",
    "HAS_SCALE",
    "HAS_RES",
    "KV_FP8",
    "PREFETCH",
    "WIDEN_F16",
)


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

            @contextlib.contextmanager
            def case(label):  # every launch made inside is labelled `label`
                n = len(caught)
                yield
                labels.extend([label] * (len(caught) - n))

            x, res, w = torch.zeros(300, 4096, dtype=BF16), torch.zeros(300, 4096, dtype=BF16), torch.ones(4096)
            with case("add + RMSNorm"):
                fo.add_rms_norm(x, res, w.to(BF16), 1e-5)
            with case("add + RMSNorm, quantizing"):
                fo.add_rms_norm(x, res, w.to(BF16), 1e-5, quantize=True)
            with case("SiLU x up"):
                fo.silu_mul(torch.zeros(300, 2 * 14336, dtype=BF16))
            with case("SiLU x up, quantizing"):
                fo.silu_mul(torch.zeros(300, 2 * 14336, dtype=BF16), quantize=True)
            with case("per-token quantization"):
                quantize_per_token(torch.zeros(300, 14336, dtype=BF16))
            for name, (nn, kk) in LAYERS_8B.items():
                q, scale = fp8.quantize_weight(torch.zeros(nn, kk))
                for m in (1, 64):
                    with case(f"W8A16 {name} M={m}"):
                        sg.skinny_linear(torch.zeros(m, kk, dtype=BF16), q, weight_scale=scale)
                with case(f"bf16 skinny {name} M=1"):
                    sg.skinny_linear(torch.zeros(1, kk, dtype=BF16), torch.zeros(nn, kk, dtype=BF16))
            for kv in (BF16, FP8):
                kc, vc = torch.zeros(65, 16, 8, 128, dtype=kv), torch.zeros(65, 16, 8, 128, dtype=kv)
                tables, ctx = torch.zeros(4, 16, dtype=torch.int32), torch.full((4,), 250, dtype=torch.int32)
                with case(f"decode, {str(kv)[6:]} cache"):
                    pa.decode(torch.zeros(4, 32, 128, dtype=BF16), kc, vc, tables, ctx, 8, prefetch=True)
                if kv == FP8:  # the widening FP8_DECODE_WIDEN does not take (paged_attention)
                    other = "bf16" if pa.FP8_DECODE_WIDEN == "fp16" else "fp16"
                    with case(f"decode, {str(kv)[6:]} cache widened to {other}"):
                        q = torch.zeros(4, 32, 128, dtype=BF16)
                        pa.decode(q, kc, vc, tables, ctx, 8, prefetch=True, widen=other)
                cu_q, tiles = torch.tensor([0, 96], dtype=torch.int32), torch.zeros(6, 2, dtype=torch.int32)
                with case(f"prefill, {str(kv)[6:]} cache"):
                    pa.prefill(torch.zeros(96, 32, 128, dtype=BF16), kc, vc, tables[:1], cu_q, ctx[:1], tiles)
        return [(label, *launch) for label, launch in zip(labels, caught, strict=True)]
    finally:
        mp.undo()


# Three ways to write the W8A16 GEMV's K loop (the production kernel's tiling, without its split-K merge): how many
# registers each needs is a question for the compiler alone. `pointers` is production's (loop-carried
# [BLOCK_N, BLOCK_K] address tensors); `offsets` rebuilds the addresses from a scalar k each iteration; `descriptors`
# loads W and x tiles through Hopper's tensor descriptors (TMA: the copy engine, one descriptor per tensor).
@triton.jit
def _scaled_store(acc, y_ptr, s_ptr, offs_m, offs_n, M, N):
    """The formulations' common epilogue: each column times its row scale, rows < M stored."""
    acc = acc * tl.load(s_ptr + offs_n % N)[None, :]
    tl.store(y_ptr + offs_m[:, None] * N + offs_n[None, :], acc.to(y_ptr.dtype.element_ty), mask=offs_m[:, None] < M)


@triton.jit
def _w8a16_pointers(
    x_ptr,
    w_ptr,
    y_ptr,
    s_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    STAGES: tl.constexpr,
):
    offs_m, offs_n, offs_k = tl.arange(0, BM), tl.program_id(0) * BN + tl.arange(0, BN), tl.arange(0, BK)
    rows = offs_n % N
    w_ptrs = w_ptr + rows.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for _ in tl.range(0, K, BK, num_stages=STAGES):
        w = tl.load(w_ptrs, eviction_policy="evict_first")
        xt = tl.load(x_ptrs, mask=offs_m[:, None] < M, other=0.0, eviction_policy="evict_last")
        acc = tl.dot(xt, tl.trans(w.to(xt.dtype)), acc)
        w_ptrs += BK
        x_ptrs += BK
    _scaled_store(acc, y_ptr, s_ptr, offs_m, offs_n, M, N)


@triton.jit
def _w8a16_offsets(
    x_ptr,
    w_ptr,
    y_ptr,
    s_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    STAGES: tl.constexpr,
):
    offs_m, offs_n, offs_k = tl.arange(0, BM), tl.program_id(0) * BN + tl.arange(0, BN), tl.arange(0, BK)
    rows = offs_n % N
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * stride_wn
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k in tl.range(0, K, BK, num_stages=STAGES):
        w = tl.load(w_rows + (k + offs_k)[None, :], eviction_policy="evict_first")
        xt = tl.load(x_ptr + offs_m[:, None] * stride_xm + (k + offs_k)[None, :], mask=offs_m[:, None] < M, other=0.0)
        acc = tl.dot(xt, tl.trans(w.to(xt.dtype)), acc)
    _scaled_store(acc, y_ptr, s_ptr, offs_m, offs_n, M, N)


@triton.jit
def _w8a16_descriptors(
    x_ptr,
    w_ptr,
    y_ptr,
    s_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    STAGES: tl.constexpr,
):
    offs_m, offs_n = tl.arange(0, BM), tl.program_id(0) * BN + tl.arange(0, BN)
    w_desc = tl.make_tensor_descriptor(w_ptr, shape=[N, K], strides=[stride_wn, 1], block_shape=[BN, BK])
    x_desc = tl.make_tensor_descriptor(x_ptr, shape=[M, K], strides=[stride_xm, 1], block_shape=[BM, BK])
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k in tl.range(0, K, BK, num_stages=STAGES):
        w = w_desc.load([tl.program_id(0) * BN, k])
        xt = x_desc.load([0, k])
        acc = tl.dot(xt, tl.trans(w.to(xt.dtype)), acc)
    _scaled_store(acc, y_ptr, s_ptr, offs_m, offs_n, M, N)


FORMULATIONS = {"pointers": _w8a16_pointers, "offsets": _w8a16_offsets, "descriptors": _w8a16_descriptors}
TILES = [(16, 32, 256, 3), (16, 64, 256, 4), (64, 64, 128, 2)]  # (BM, BN, BK, stages): the FP8 table's M = 1 and 64


def formulation_rows() -> list[dict]:
    from triton.backends.compiler import GPUTarget

    sig = {
        "x_ptr": "*bf16",
        "w_ptr": "*fp8e4nv",
        "y_ptr": "*bf16",
        "s_ptr": "*fp32",
        "M": "i32",
        "N": "i32",
        "K": "i32",
        "stride_xm": "i32",
        "stride_wn": "i32",
    }
    sig.update({c: "constexpr" for c in ("BM", "BN", "BK", "STAGES")})
    rows = []
    for name, fn in FORMULATIONS.items():
        for bm, bn, bk, stages in TILES:
            consts = {"BM": bm, "BN": bn, "BK": bk, "STAGES": stages}
            src = triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=consts)
            k = triton.compile(src, target=GPUTarget(*TARGET), options={"num_warps": 4, "num_stages": stages})
            rows.append(
                {
                    "formulation": name,
                    "tile": f"{bm}x{bn}x{bk}, {stages} stages",
                    "shared_bytes_triton": k.metadata.shared,
                    **ptxas_report(k.asm["ptx"]),
                }
            )
            r = rows[-1]
            print(
                f"W8A16 K loop, {name:11s} {r['tile']}: {r['registers']} registers, spills "
                f"{r['spill_stores_bytes']} B, shared memory {r['shared_bytes_triton']} B",
                flush=True,
            )
    return rows


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
    formulations = formulation_rows()
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    doc = {
        "what": __doc__.strip().splitlines()[0],
        "target": f"sm_{TARGET[1]}a",
        "machine": {"platform": platform.platform(), "gpu": None},
        "versions": {"torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version()},
        "rows": rows,
        "w8a16_formulations": formulations,
    }
    with open(out, "w") as f:
        json.dump(doc, f, indent=1)
    print("wrote", out)


if __name__ == "__main__":
    main()
