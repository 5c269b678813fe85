"""W8A8 GEMM for decode batches on FP8 tensor cores: y = (x_q * s_x) @ (W * s_w)^T with both operands e4m3.

x_q is float8_e4m3fn [M, K] with one float32 scale per row (per token: spanllm.kernels.fp8_quant, or the norm /
SiLU kernel that produced x), W float8_e4m3fn [N, K] with one float32 scale per output channel, y [M, N] in the
model dtype. This is the GEMM torch._scaled_mm runs for FP8 prefill; at decode sizes (M = 17 ... 256) cuBLASLt's
kernels stream W at 35-75% of the copy bandwidth on an H100 (results/h100/fp8/README.md), and these steps read the
whole 8 GB of weights with few tokens to amortize it over. This kernel is built for that case.

Design
    W is the MMA's A operand and x its B (the "swap AB" of skinny FP8 GEMMs): a program computes the tile
    y^T[BLOCK_N, BLOCK_M] = W[BLOCK_N, K] @ x[BLOCK_M, K]^T, so the MMA's 64-row dimension runs along N (thousands
    of rows) and the few tokens fill its narrow one (wgmma takes 8 ... 256 there). Both tiles are K-contiguous as
    they lie in memory, the layout FP8 wgmma wants for both operands: no widening, no transposition, W goes from HBM
    to shared memory to the tensor cores as bytes. Grid (cdiv(M, BLOCK_M), cdiv(N, BLOCK_N), SPLIT_K): the M tiles
    of one W tile are neighbours in launch order, so past BLOCK_M rows W is read from HBM once and from L2 after.

Scales
    The fp32 sums of one (n, m) are multiplied by s_w[n] * s_x[m] once, in the epilogue (both factor out of the K
    sum). With split-K the partials are summed first, unscaled, by the tile's last program in split order
    (spanllm.kernels.arrival_counters: the protocol and its memory ordering), so y does not depend on which
    program came last: decode runs in CUDA graphs and must be reproducible.

Rows past N or M wrap onto valid rows (loaded, never stored), so the loads stay unpredicated vectors.

Configs come from a measured table (fp8_gemm_configs.json beside this file, written by `scripts/gpu_fp8_gemm.py
--sweep-w8a8`): (M bucket, N, K) -> launch config and the times of this kernel and of torch._scaled_mm at the same
shape. `takes` says whether this kernel runs a GEMM (the table measured it faster there); everything else runs
torch._scaled_mm, and the engine's description line names which GEMMs ran which.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from typing import NamedTuple

import torch

from spanllm.kernels import interpreter, skinny_gemm
from spanllm.kernels.fp8_quant import FP8_DTYPE
from spanllm.kernels.pdl import launch_options
from spanllm.kernels.split_k import cdiv, effective_split_k, split_k_buffers, split_k_chunk

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU torch wheel comes without Triton
    triton = None
    tl = None

MAX_M = 256  # rows of x this kernel is measured and tabled for (decode batches); prefill runs torch._scaled_mm
MIN_BLOCK_M = 16  # the MMA's narrow dimension: at least 16 tokens (rows past M wrap)
MAX_BLOCK_M = 128  # wider batches take several M tiles (each re-reads W from L2, not HBM)
PROMOTE_EVERY = 128  # K products an FP8 MMA accumulates before they are added into the fp32 sums (cuBLAS's interval)
_TABLE_FILE = os.path.join(os.path.dirname(__file__), "fp8_gemm_configs.json")
TABLE_ENV = "SPANLLM_FP8_GEMM_TABLE"


class W8A8Config(NamedTuple):
    """One launch: (BLOCK_N, BLOCK_M, BLOCK_K, SPLIT_K, num_warps, num_stages)."""

    block_n: int
    block_m: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int


def check_config(cfg: tuple) -> W8A8Config:
    cfg = W8A8Config(*cfg)
    for name in ("block_n", "block_m", "block_k", "num_warps"):
        v = getattr(cfg, name)
        if v < 1 or v & (v - 1):
            raise ValueError(f"W8A8 GEMM config {cfg}: {name}={v} must be a power of two")
    if cfg.block_n < 16 or cfg.block_m < MIN_BLOCK_M or cfg.block_k < 32:
        raise ValueError(
            f"W8A8 GEMM config {cfg}: block_n >= 16, block_m >= {MIN_BLOCK_M} and block_k >= 32 (FP8 MMA) required"
        )
    if cfg.split_k < 1 or cfg.num_stages < 1:
        raise ValueError(f"W8A8 GEMM config {cfg}: split_k and num_stages must be >= 1")
    return cfg


def m_bucket(m: int) -> int:
    """The table's bucket of M: the next power of two from 16 (16, 32, ... 256)."""
    return max(MIN_BLOCK_M, skinny_gemm.m_bucket(m))


def table_path() -> str:
    return os.environ.get(TABLE_ENV) or _TABLE_FILE


class TableEntry(NamedTuple):
    """One measured (M bucket, N, K): the kernel's best config and, from the same run, microseconds per GEMM of it,
    of torch._scaled_mm (both on x already quantized), of the separate quantization pass, and of W8A16 (None past
    128 rows, where it does not run)."""

    config: W8A8Config
    kernel_us: float
    scaled_mm_us: float
    quant_us: float
    w8a16_us: float | None


@functools.cache
def measured_table() -> dict[tuple[int, int, int], TableEntry]:
    """(m_bucket, n, k) -> TableEntry, read once. A missing committed file is an empty table (nothing measured:
    every W8A8 GEMM runs torch._scaled_mm); a file named by the environment must exist."""
    path = table_path()
    if path == _TABLE_FILE and not os.path.exists(path):
        return {}
    try:
        with open(path) as f:
            entries = json.load(f)["entries"]
        return {
            (e["m_bucket"], e["n"], e["k"]): TableEntry(
                check_config(e["config"]),
                float(e["kernel_us"]),
                float(e["scaled_mm_us"]),
                float(e["quant_us"]),
                None if e.get("w8a16_us") is None else float(e["w8a16_us"]),
            )
            for e in entries
        }
    except (OSError, ValueError, KeyError, TypeError) as e:
        origin = f" (set by {TABLE_ENV})" if path != _TABLE_FILE else ""
        raise RuntimeError(f"W8A8 GEMM table {path}{origin}: {e}") from e


def table_id() -> str:
    """A short fingerprint of the table, for the engine's description line and results."""
    table = measured_table()
    text = repr(sorted(table.items()))
    where = "" if table_path() == _TABLE_FILE else f" from {table_path()}"
    return f"{len(table)} entries{where}, sha1 {hashlib.sha1(text.encode()).hexdigest()[:10]}"


def times(m: int, n: int, k: int) -> TableEntry | None:
    """The table's entry for m's own bucket and W [n, k]; None if never measured (or m outside 1 ... MAX_M)."""
    if m < 1 or m > MAX_M:
        return None
    return measured_table().get((m_bucket(m), n, k))


def takes(m: int, n: int, k: int) -> bool:
    """Whether a W8A8 GEMM of m rows with W [n, k] runs this kernel: only where the table measured that shape at
    m's own bucket and this kernel was faster than torch._scaled_mm. A pure function of the table."""
    entry = times(m, n, k)
    return entry is not None and entry.kernel_us < entry.scaled_mm_us


def table_config(m: int, n: int, k: int) -> W8A8Config | None:
    entry = times(m, n, k)
    return None if entry is None else entry.config


def describe() -> str:
    """Which W8A8 GEMM runs, for the engine's description line."""
    wins = sorted({key for key, e in measured_table().items() if e.kernel_us < e.scaled_mm_us})
    if not wins:
        return f"W8A8 GEMM torch._scaled_mm (Triton W8A8 table {table_id()}: no shape where it is faster)"
    buckets = sorted({mb for mb, _, _ in wins})
    return (
        f"W8A8 GEMM Triton kernel at {len(wins)} measured (rows bucket, N, K) of buckets "
        f"{', '.join(map(str, buckets))} rows, else torch._scaled_mm (table {table_id()})"
    )


def default_config(m: int, n: int, k: int) -> W8A8Config:
    """A config for shapes off the table (tests, sweeps' starting point): 64 rows of W a program, the batch's
    bucket as the MMA's narrow side (at most MAX_BLOCK_M), 128 bytes of K a stage, split-K while the grid is
    short of ~2 programs per SM of an H100."""
    block_m = min(MAX_BLOCK_M, m_bucket(m))
    block_k = max(32, min(128, 1 << max(0, k - 1).bit_length()))
    programs = cdiv(n, 64) * cdiv(m, block_m)
    split = 1
    while programs * split * 2 <= 264 and split < 8 and split_k_chunk(k, block_k, split * 2) // block_k >= 4:
        split *= 2
    return W8A8Config(64, block_m, block_k, effective_split_k(k, block_k, split), 4, 4)


if triton is not None:
    from spanllm.kernels.pdl import wait_then_release

    @triton.jit
    def _w8a8_kernel(
        x_ptr,
        xs_ptr,
        w_ptr,
        ws_ptr,
        y_ptr,
        part_ptr,
        cnt_ptr,
        M,
        N,
        K,
        k_chunk,
        stride_xm,
        stride_wn,
        stride_ym,
        BLOCK_N: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_K: tl.constexpr,
        SPLIT_K: tl.constexpr,
        EVEN_K: tl.constexpr,
        NUM_STAGES: tl.constexpr,
        PDL: tl.constexpr,
        PROMOTE_K: tl.constexpr,
    ):
        """y[m, n] = s_w[n] * s_x[m] * sum_k W[n, k] x[m, k] (module docstring); SPLIT_K > 1: each program sums one
        K chunk into part[pid_k, m, n] and the last of the tile's SPLIT_K programs adds them up in split order."""
        wait_then_release(PDL)
        pid_m = tl.program_id(0)  # fastest: a batch's M tiles of one W tile run side by side, so W comes from HBM once
        pid_n = tl.program_id(1)
        pid_k = tl.program_id(2)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rows_w = offs_n % N  # wrapped: loaded, never stored
        rows_x = offs_m % M
        offs_k = tl.arange(0, BLOCK_K)
        k_start = pid_k * k_chunk
        k_end = tl.minimum(k_start + k_chunk, K)
        w_ptrs = w_ptr + rows_w.to(tl.int64)[:, None] * stride_wn + (k_start + offs_k)[None, :]
        x_ptrs = x_ptr + rows_x.to(tl.int64)[:, None] * stride_xm + (k_start + offs_k)[None, :]
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for k in tl.range(k_start, k_end, BLOCK_K, num_stages=NUM_STAGES):
            if EVEN_K:
                w = tl.load(w_ptrs, eviction_policy="evict_first")  # streamed once
                x = tl.load(x_ptrs, eviction_policy="evict_last")  # re-read by every program: keep it in L2
            else:
                k_ok = (k + offs_k) < K
                w = tl.load(w_ptrs, mask=k_ok[None, :], other=0.0, eviction_policy="evict_first")
                x = tl.load(x_ptrs, mask=k_ok[None, :], other=0.0, eviction_policy="evict_last")
            # FP8 wgmma adds products in a narrower accumulator than fp32; Triton on sm_90 would keep them there
            # for the whole K range. Promoting into the fp32 acc every PROMOTE_K products, as cuBLAS does for
            # torch._scaled_mm (use_fast_accum=False), keeps the sums as exact as _scaled_mm's.
            acc = tl.dot(w, tl.trans(x), acc, max_num_imprecise_acc=PROMOTE_K)
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
        out_ok = (offs_n[:, None] < N) & (offs_m[None, :] < M)
        y_ptrs = y_ptr + offs_m.to(tl.int64)[None, :] * stride_ym + offs_n[:, None]
        scale = tl.load(ws_ptr + rows_w)[:, None] * tl.load(xs_ptr + rows_x)[None, :]
        if SPLIT_K == 1:
            tl.store(y_ptrs, (acc * scale).to(y_ptr.dtype.element_ty), mask=out_ok)
        else:
            # Partials [SPLIT_K, M, N] fp32. The barrier orders every warp's partial stores before the one
            # thread's acq_rel increment; the last to arrive reads them from L2 (.cg), sums them in split order
            # and resets the tile's counter for the next launch or graph replay (arrival_counters).
            tile = offs_m.to(tl.int64)[None, :] * N + offs_n[:, None]  # int64: split * M * N may pass 2^31
            tl.store(part_ptr + pid_k.to(tl.int64) * M * N + tile, acc, mask=out_ok)
            tl.debug_barrier()
            counter = cnt_ptr + pid_n * tl.num_programs(0) + pid_m
            arrived = tl.atomic_add(counter, 1, sem="acq_rel")
            if arrived == SPLIT_K - 1:
                total = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
                for s in tl.static_range(SPLIT_K):
                    total += tl.load(
                        part_ptr + tl.cast(s, tl.int64) * M * N + tile, mask=out_ok, other=0.0, cache_modifier=".cg"
                    )
                tl.store(y_ptrs, (total * scale).to(y_ptr.dtype.element_ty), mask=out_ok)
                tl.atomic_xchg(counter, 0)


def w8a8_linear(
    x_q: torch.Tensor,
    x_scale: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    out_dtype: torch.dtype,
    config: tuple | None = None,
) -> torch.Tensor:
    """y [M, N] = (x_q * x_scale) @ (weight * weight_scale[:, None])^T in out_dtype, fp32 sums.

    x_q float8_e4m3fn [M, K] (rows contiguous along K), x_scale float32 [M] or [M, 1], weight float8_e4m3fn [N, K]
    contiguous, weight_scale float32 [N]. config: a W8A8Config (benchmarks, tests); default the table's, else
    default_config. Allocates with torch.empty: safe inside CUDA-graph capture after one eager call (the split-K
    arrival counters are allocated outside any capture)."""
    if triton is None:
        raise RuntimeError("w8a8_linear needs Triton, which is not installed; use torch._scaled_mm")
    if x_q.dtype != FP8_DTYPE or weight.dtype != FP8_DTYPE:
        raise ValueError(f"w8a8_linear: x_q and weight must be {FP8_DTYPE}, got {x_q.dtype} and {weight.dtype}")
    if x_q.dim() != 2 or weight.dim() != 2 or x_q.shape[1] != weight.shape[1]:
        raise ValueError(
            f"w8a8_linear: x_q [M, K] and weight [N, K] with the same K, got {tuple(x_q.shape)} and "
            f"{tuple(weight.shape)}"
        )
    m, k = x_q.shape
    n = weight.shape[0]
    if x_scale.dtype != torch.float32 or x_scale.numel() != m:
        raise ValueError(
            f"w8a8_linear: x_scale must be float32 with M={m} values, got {x_scale.dtype} {tuple(x_scale.shape)}"
        )
    if weight_scale.dtype != torch.float32 or tuple(weight_scale.shape) != (n,):
        raise ValueError(
            f"w8a8_linear: weight_scale must be float32 [N={n}], got {weight_scale.dtype} {tuple(weight_scale.shape)}"
        )
    for name, ok in (
        ("weight", weight.is_contiguous()),
        ("weight_scale", weight_scale.is_contiguous()),
        ("x_q", x_q.stride(1) == 1),
    ):
        if not ok:
            raise ValueError(
                f"w8a8_linear: {name} must be contiguous (x_q: along K), got strides "
                f"{dict(weight=weight, weight_scale=weight_scale, x_q=x_q)[name].stride()}; pass .contiguous()"
            )
    if x_q.device.type != "cuda" and not interpreter.interpreting():
        raise ValueError(
            f"w8a8_linear: tensors must be on a CUDA device, got {x_q.device} "
            "(CPU tensors run only under TRITON_INTERPRET=1)"
        )
    if m == 0 or n == 0 or k == 0:
        return (torch.zeros if k == 0 else torch.empty)((m, n), dtype=out_dtype, device=x_q.device)
    cfg = check_config(config) if config is not None else (table_config(m, n, k) or default_config(m, n, k))
    split = effective_split_k(k, cfg.block_k, cfg.split_k)
    chunk = split_k_chunk(k, cfg.block_k, split)
    n_tiles, m_tiles = cdiv(n, cfg.block_n), cdiv(m, cfg.block_m)
    y = torch.empty((m, n), dtype=out_dtype, device=x_q.device)
    part, counters = split_k_buffers(y, split, n_tiles * m_tiles)
    _w8a8_kernel[(m_tiles, n_tiles, split)](
        x_q,
        x_scale.reshape(m).contiguous(),
        weight,
        weight_scale,
        y,
        part,
        counters,
        m,
        n,
        k,
        chunk,
        x_q.stride(0),
        weight.stride(0),
        n,
        BLOCK_N=cfg.block_n,
        BLOCK_M=cfg.block_m,
        BLOCK_K=cfg.block_k,
        SPLIT_K=split,
        EVEN_K=(k % cfg.block_k == 0),
        NUM_STAGES=cfg.num_stages,
        PROMOTE_K=min(PROMOTE_EVERY, cfg.block_k),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **launch_options(x_q.device),
    )
    return y
