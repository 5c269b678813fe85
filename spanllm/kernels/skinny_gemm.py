"""Skinny GEMM for decode: y = x @ W^T with few rows in x (M <= 16), as one Triton kernel.

x is [M, K] (the decode batch), W is [N, K] row-major (nn.Linear layout), y is [M, N] in x's dtype,
accumulated in fp32. At decode batch sizes these GEMMs are memory-bound: W is read once from HBM and
every other cost (x, y, the arithmetic) is small. The kernel is therefore a tuned stream over W, and
everything below is about keeping enough bytes of W in flight on every SM.

Design
    Grid (cdiv(N, BLOCK_N), SPLIT_K). A program owns BLOCK_N rows of W and one contiguous range of K
    (K is cut into SPLIT_K chunks, each a multiple of BLOCK_K). It loads W tiles [BLOCK_N, BLOCK_K],
    contiguous along K (coalesced, 16-byte vector loads) and x tiles [16, BLOCK_K], and accumulates
    acc[16, BLOCK_N] += x @ w^T with tl.dot in fp32. num_stages software-pipelines the loads.

Why M is padded to 16
    tl.dot needs at least 16 rows (the tensor-core MMA shape); rows >= M are loaded as 0 (masked)
    and never stored. The extra MMA work is free here: the kernel waits on HBM, not on tensor cores,
    and x is a few KiB that stays in L2.

Why split-K
    A 70B qkv projection at TP 2 (N = 5120) has only 80 row blocks of 64: not even one per SM on an
    H200 (132 SMs), and an SM alone cannot pull its share of HBM bandwidth with one short stream.
    Splitting K multiplies the programs (and the independent streams) by SPLIT_K, so every SM gets
    several and their sizes balance; the price is an fp32 partial [SPLIT_K, M, N] (tiny next to W at
    M <= 16), summed in the same launch.

Why the last program sums, and no atomic adds
    Each program of a split tile stores its fp32 partial and counts itself in on the tile's arrival counter
    (spanllm.kernels.arrival_counters); the last to arrive adds the SPLIT_K partials in a fixed order (split
    0, 1, ...) and stores y. Until 2026-12-02 a second kernel did that sum: in a CUDA graph its launch gap
    and tail cost ~1.5 us per GEMM, which kept the 8B's down projection (split 4) behind cuBLAS. fp32
    atomic adds into y would finish in whatever order the programs happen to run, so the result would
    change from run to run in its last bits; decode runs inside CUDA graphs and must be reproducible (a
    replay, a rerun and a TP peer must see bit-identical logits). The fixed order keeps it so.

FP8 weights (W8A16)
    With `weight_scale`, W is float8_e4m3fn [N, K] with one float32 scale per output row (per channel): the
    kernel streams half the bytes, widens each tile to x's dtype in registers (every e4m3 value is exact in
    bf16), and multiplies the fp32 sums by the row's scale once, in the epilogue (the scale of row n factors
    out of its K sum). x stays in its dtype: no activation quantization, no extra pass. Decode batches past
    16 rows still read W once, so this path takes up to FP8_MAX_M rows (BLOCK_M = 16 ... 128: the MMA tile
    grows with M). Whether it or W8A8 (x quantized, torch._scaled_mm) is faster past 16 rows depends on the
    shape: `fp8_weight_only` asks the measured table.

Programmatic dependent launch (spanllm.kernels.pdl)
    With PDL on, this kernel's programs become resident while the kernel before it (a norm, RoPE, the attention)
    still runs. W depends on no kernel (weights are written once, at load), so before its gdc_wait each program
    may ask L2 to fetch the first tiles of its W range (`prefetch.global.L2`, one per 32-byte sector: a hint that
    loads nothing into registers and writes nothing) and HBM streams W while the previous kernel finishes; the
    loads after the wait then find those tiles in L2. At most W_PREFETCH_BYTES per GEMM (spread over its
    programs), so that a prefetch never pushes its own first tiles out of the 50 MB L2. x and everything else is
    read after the wait, as the protocol requires. W_PREFETCH_BYTES is 0 by default: on an H100, batch-1 decode
    with 16 MiB was slower than with none (results/h100/pdl/).

Config
    `choose_config` is a pure function of (M, N, K, #SMs, element size) and the module's table
    measured table (skinny_gemm_configs.json beside this file): no benchmarking at call time, so
    `skinny_linear` can be called during CUDA-graph capture (triton.autotune would time kernels there). The
    table holds configs measured by `spanllm bench gemm`; shapes it lacks take a cost-model heuristic.

Why SiLU(gate) * up is not fused in here
    Each of the N/BLOCK_N programs would recompute the activation of its whole K range (16 padded rows of exp
    per tile) on the loop's critical path: slower than the separate silu_mul kernel + this GEMM.

The module imports without Triton (the CPU torch wheel does not bring it): the kernels exist only where Triton does, and
`skinny_linear` raises a RuntimeError without it.
"""

from __future__ import annotations

import functools
import json
import math
import os
from typing import NamedTuple

import torch

from spanllm.kernels import gemv, interpreter
from spanllm.kernels.pdl import launch_options
from spanllm.kernels.split_k import cdiv, effective_split_k, split_k_buffers, split_k_chunk

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU torch wheel comes without Triton
    triton = None
    tl = None

MAX_M = 16  # rows of x the kernel handles with a bf16/fp16/fp32 W: one MMA tile of 16 rows
FP8_MAX_M = 128  # rows with an FP8 W (W8A16): BLOCK_M grows to 128
FP8_ALWAYS_WEIGHT_ONLY_M = 16  # up to here W8A16 always (one MMA tile); above, only where the table measured it faster
# With PDL: bytes of W a GEMM prefetches into L2 before its wait (module docstring), over all its programs; 0 = none.
# SPANLLM_SKINNY_PREFETCH_BYTES replaces it (benchmarks: scripts/gpu_pdl.sh measures with and without). 0 by
# default: with 16 MiB, batch-1 decode was slower than PDL without it, in FP8 (+5.7%) and bf16 (+0.5%) on an H100
# (results/h100/pdl/).
W_PREFETCH_BYTES = 0
PREFETCH_ENV = "SPANLLM_SKINNY_PREFETCH_BYTES"
PREFETCH_SECTOR = 32  # bytes one prefetch instruction asks for
BLOCK_M = 16
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
DEFAULT_NUM_SMS = 132  # H200; used when the tensors are not on a GPU (Triton's CPU interpreter)


class SkinnyConfig(NamedTuple):
    """One launch: (BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages)."""

    block_n: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int


# The measured table (spanllm/kernels/skinny_gemm_configs.json, written from `spanllm bench gemm --sweep small` and,
# for FP8 weights (element bytes 1), `scripts/gpu_fp8_gemm.py --sweep`): (m_bucket, n, k, element bytes) -> config,
# and the same runs' times in microseconds per GEMM inside a CUDA graph: (skinny, the alternative), the alternative
# being F.linear for bf16 entries and W8A8 (per-token quantization + torch._scaled_mm) for FP8 entries.
# SPANLLM_SKINNY_GEMM_TABLE names another file of the same format (a sweep's output, before it is committed).
# An M whose bucket has no entry takes the nearest measured bucket of the same (n, k, element
# bytes) (`table_config`): the kernel always computes 16 rows, so a config's time hardly depends on M. Shapes and
# dtypes without any entry take the heuristic (a bf16 tile pipeline can overflow shared memory in fp32).
_TABLE_FILE = os.path.join(os.path.dirname(__file__), "skinny_gemm_configs.json")
TABLE_ENV = "SPANLLM_SKINNY_GEMM_TABLE"


def table_path() -> str:
    return os.environ.get(TABLE_ENV) or _TABLE_FILE


@functools.cache
def measured_table() -> tuple[dict, dict]:
    """(configs, times): key -> config, key -> (skinny_us, alternative_us), read once."""
    path = table_path()
    try:
        with open(path) as f:
            entries = json.load(f)["entries"]
    except (OSError, ValueError, KeyError) as e:
        origin = f" (set by {TABLE_ENV})" if path != _TABLE_FILE else ""
        raise RuntimeError(f"skinny GEMM table {path}{origin}: {e}") from e
    key = lambda e: (e["m_bucket"], e["n"], e["k"], e["elem_bytes"])
    configs = {key(e): tuple(e["config"]) for e in entries}
    times = {
        key(e): (e["skinny_us"], e["torch_us"] if "torch_us" in e else e["w8a8_us"])
        for e in entries
        if "skinny_us" in e and ("torch_us" in e or "w8a8_us" in e)
    }
    return configs, times


def m_bucket(m: int) -> int:
    """The table's bucket of M: the next power of two (1, 2, 4, ... 128)."""
    return 1 << max(0, m - 1).bit_length()


def _check_config(cfg: tuple) -> SkinnyConfig:
    cfg = SkinnyConfig(*cfg)
    for name in ("block_n", "block_k", "num_warps"):
        v = getattr(cfg, name)
        if v < 1 or v & (v - 1):
            raise ValueError(f"skinny GEMM config {cfg}: {name}={v} must be a power of two")
    if cfg.block_n < 16 or cfg.block_k < 16:
        raise ValueError(f"skinny GEMM config {cfg}: block_n and block_k must be >= 16 (tl.dot)")
    if cfg.split_k < 1 or cfg.num_stages < 1:
        raise ValueError(f"skinny GEMM config {cfg}: split_k and num_stages must be >= 1")
    return cfg


# Heuristic constants (guesses to be checked with `spanllm bench gemm`). An SM's share of HBM on an
# H200 is ~4.3 TB/s / 132 = ~33 KB per us; with ~1 us of memory latency an SM needs ~32 KiB in flight
# (Little's law), i.e. 16-32 KiB tiles with 2-3 of them in the pipeline.
_SMEM_BUDGET = 160 * 1024  # bytes of shared memory the pipeline may use (H100/H200 have 227 KiB/SM)
_SPLIT_OVERHEAD_US = 1.5  # split-K's merge: a guess from the old second kernel's gap + tail; the in-kernel merge
#                          costs less, not measured alone (it only moves the heuristic for shapes off the table)
_SM_BYTES_PER_US = 4.3e6 / 132  # one SM's share of HBM bandwidth, bytes per microsecond
_X_L2_WEIGHT = 0.4  # cost of a byte of x from L2 relative to a byte of W from HBM
_PROGRAM_OVERHEAD_US = 0.25  # per program: pipeline fill, the epilogue's stores


def _table_key(m: int, n: int, k: int, elem_bytes: int) -> tuple[int, int, int, int] | None:
    """The table key for this GEMM: M's bucket, else the nearest bucket of the same (n, k,
    elem_bytes) (ties: the larger bucket); None when the table has no entry for the shape."""
    buckets = [mb for (mb, n2, k2, e2) in measured_table()[0] if (n2, k2, e2) == (n, k, elem_bytes)]
    if not buckets:
        return None
    want = m_bucket(m)
    mb = min(buckets, key=lambda b: (abs(b.bit_length() - want.bit_length()), -b))
    return (mb, n, k, elem_bytes)


def table_config(m: int, n: int, k: int, elem_bytes: int = 2) -> SkinnyConfig | None:
    """The measured config for this shape (`_table_key`); None when the table has no entry for the shape."""
    key = _table_key(m, n, k, elem_bytes)
    return None if key is None else _check_config(measured_table()[0][key])


@functools.cache
def prefer_skinny(m: int, n: int, k: int, elem_bytes: int = 2) -> bool:
    """decode_gemm="auto": whether x [m, k] @ W[n, k]^T takes the skinny kernel. Yes only where the measured
    table has the shape and its config beat F.linear there; shapes never measured, more than
    MAX_M rows, or no Triton: F.linear."""
    if triton is None or m > MAX_M:
        return False
    if m == 1 and gemv.beats_torch(n, k, elem_bytes):
        return True  # skinny_linear runs one row on the CUDA-core GEMV (gemv.takes)
    key = _table_key(m, n, k, elem_bytes)
    if key is None:
        return False
    times = measured_table()[1].get(key)  # a config without its times (bench gemm prints both): not chosen
    return times is not None and times[0] < times[1]


@functools.cache
def fp8_weight_only(m: int, n: int, k: int) -> bool:
    """Whether x [m, k] @ W[n, k]^T with FP8 W runs W8A16 (this kernel, x kept in its dtype) rather than W8A8.

    Up to FP8_ALWAYS_WEIGHT_ONLY_M rows: always (the GEMM only streams W; quantizing x would add a pass and
    _scaled_mm is slower than bf16 there). Up to FP8_MAX_M: where the table measured this shape at m's own bucket
    and W8A16 was faster. Otherwise W8A8. A pure function of the table, so the CPU path follows the GPU's rule."""
    if m <= FP8_ALWAYS_WEIGHT_ONLY_M:
        return True
    if m > FP8_MAX_M:
        return False
    times = measured_table()[1].get((m_bucket(m), n, k, 1))
    return times is not None and times[0] < times[1]


def describe_auto(gemms: list[tuple[str, int, int, int]]) -> str:
    """What decode_gemm="auto" runs for named GEMMs (name, N, K, element bytes) at 1..MAX_M rows, runs of row
    counts with the same choice together, e.g. '1-16 rows: skinny qkv, o, down; F.linear gate_up, lm_head'."""

    def picks(rows: int) -> str:
        skinny = [g for g in gemms if prefer_skinny(rows, *g[1:])]
        rest = [name for name, *_ in gemms if name not in [g[0] for g in skinny]]
        one_row = gemv.takes_names(skinny) if rows == 1 else []  # these run the CUDA-core GEMV (skinny_linear)
        text = (
            f"skinny {', '.join(g[0] for g in skinny if g[0] not in one_row) or '-'}; F.linear {', '.join(rest) or '-'}"
        )
        return f"{gemv.describe_one_row(skinny)}; {text}" if one_row else text

    runs: list[list] = []  # [first rows, last rows, picks]
    for rows in range(1, MAX_M + 1):
        p = picks(rows)
        if runs and runs[-1][2] == p:
            runs[-1][1] = rows
        else:
            runs.append([rows, rows, p])
    return " | ".join(f"{a}{'' if a == b else f'-{b}'} row{'s' if b > 1 else ''}: {p}" for a, b, p in runs)


def table_id() -> str:
    """A short fingerprint of the measured table, recorded with engine rows that ran the skinny GEMM."""
    import hashlib

    configs, times = measured_table()
    text = repr(sorted(configs.items())) + repr(sorted(times.items()))
    where = "" if table_path() == _TABLE_FILE else f" from {table_path()}"
    return f"{len(configs)} entries{where}, sha1 {hashlib.sha1(text.encode()).hexdigest()[:10]}"


def choose_config(
    m: int, n: int, k: int, num_sms: int, elem_bytes: int = 2, use_table: bool = True, x_bytes: int | None = None
) -> SkinnyConfig:
    """(BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages) for x [m, k] @ W[n, k]^T; deterministic.

    The measured table wins (`table_config`; use_table=False skips it, for benchmarks of the heuristic).
    Otherwise a small cost model: the kernel takes as long
    as its most loaded SM needs to stream its programs' W bytes (programs are equal-sized, so an SM gets
    ceil(programs / num_sms) of them; each also re-reads its x tiles from L2 and pays a fixed cost),
    plus, for split-K, the fp32 partials (written and read back) and the in-kernel merge. Candidates with
    >= num_sms programs win (an idle SM is bandwidth never used); split chunks keep >= 2 K tiles (else
    the pipeline has nothing to overlap). Near-ties (1%) go to fewer splits, then to larger BLOCK_N.
    """
    if use_table:
        measured = table_config(m, n, k, elem_bytes)
        if measured is not None:
            return measured
    best, best_key = None, None
    for block_n in (128, 64, 32):
        # A W tile of up to 32 KiB, BLOCK_K 128-256 (a row of the tile: 256-1024 contiguous bytes, whole
        # 128-byte lines, 16-byte vectors). Short K (tests, tiny layers): the smallest power of two >= K.
        block_k = max(128, min(256, (32 * 1024) // (block_n * elem_bytes)))
        block_k = max(16, min(block_k, 1 << max(0, k - 1).bit_length()))
        n_tiles = cdiv(n, block_n)
        for split in (1, 2, 4, 8, 16):
            if split > 1 and split_k_chunk(k, block_k, split) // block_k < 2:
                continue  # chunks of one tile: nothing to pipeline
            split = effective_split_k(k, block_k, split)
            programs = n_tiles * split
            # W bytes plus x bytes re-read from L2 (weighted by _X_L2_WEIGHT: L2 serves faster than HBM;
            # masked rows >= M are not fetched), plus a fixed cost per program (pipeline fill, epilogue).
            chunk_bytes = split_k_chunk(k, block_k, split) * elem_bytes
            prog_us = chunk_bytes * (block_n + _X_L2_WEIGHT * m) / _SM_BYTES_PER_US + _PROGRAM_OVERHEAD_US
            t = math.ceil(programs / num_sms) * prog_us
            if split > 1:
                t += 2 * split * m * n * 4 / (num_sms * _SM_BYTES_PER_US) + _SPLIT_OVERHEAD_US
            fills = programs >= num_sms
            # Prefer configs that fill the SMs; among them the fastest (in 1% steps, so that near-ties
            # fall through to the deterministic tie-breakers: fewer splits, then larger BLOCK_N).
            key = (not fills, round(math.log(t) * 100), split, -block_n)
            if best_key is None or key < best_key:
                best, best_key = (block_n, block_k, split), key
    block_n, block_k, split = best
    return SkinnyConfig(
        block_n, block_k, split, *launch_for_tile(block_n, block_k, elem_bytes, block_m_for(m), x_bytes)
    )


def block_m_for(m: int) -> int:
    """The MMA tile's rows for M rows of x: 16, 32, 64 or 128 (rows >= M are masked zeros)."""
    return max(BLOCK_M, 1 << max(0, m - 1).bit_length())


def launch_for_tile(block_n: int, block_k: int, elem_bytes: int, block_m: int = BLOCK_M, x_bytes: int | None = None):
    """(num_warps, num_stages) the heuristic gives a tile: 8 warps from a 32 KiB W tile up, and as many
    pipeline stages (2-4) as the W + x tiles of one stage fit in _SMEM_BUDGET. x_bytes: x's element size
    when it differs from W's (FP8 weights, bf16 x)."""
    x_bytes = elem_bytes if x_bytes is None else x_bytes
    tile_bytes = (block_n * elem_bytes + block_m * x_bytes) * block_k  # W + x tile: shared memory per stage
    num_warps = 8 if block_n * block_k * elem_bytes >= 32 * 1024 else 4
    return num_warps, max(2, min(4, _SMEM_BUDGET // tile_bytes))


if triton is not None:
    from spanllm.kernels.pdl import wait_then_release

    @triton.jit
    def _prefetch_w_tiles(w_ptr, rows, stride_wn, k_start, k_end, tiles, BLOCK_K: tl.constexpr, SECTOR: tl.constexpr):
        """Ask L2 for `tiles` tiles [rows, BLOCK_K] of W from k_start (clamped below k_end), one prefetch per SECTOR
        elements (32 bytes). A hint: no register is loaded, nothing is written."""
        sec = tl.arange(0, BLOCK_K // SECTOR) * SECTOR
        base = w_ptr + rows.to(tl.int64)[:, None] * stride_wn
        for t in range(0, tiles):
            k = tl.minimum(k_start + t * BLOCK_K + sec, k_end - 1)
            tl.inline_asm_elementwise(
                "prefetch.global.L2 [$1]; // $0", "=r,l", [base + k[None, :]], dtype=tl.int32, is_pure=False, pack=1
            )

    @triton.jit
    def _skinny_gemm_kernel(
        x_ptr,
        w_ptr,
        y_ptr,
        ws_ptr,
        cnt_ptr,
        scale_ptr,
        M,
        N,
        K,
        k_chunk,
        stride_xm,
        stride_wn,
        stride_ym,
        prefetch_tiles,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        SPLIT_K: tl.constexpr,
        EVEN_K: tl.constexpr,
        IS_FP32: tl.constexpr,
        HAS_SCALE: tl.constexpr,
        NUM_STAGES: tl.constexpr,
        PREFETCH: tl.constexpr,
        PF_SECTOR: tl.constexpr,
        PDL: tl.constexpr,
    ):
        """y[m, n] = sum over k of x[m, k] * w[n, k]; with SPLIT_K > 1 each program sums one K chunk into the fp32
        workspace ws[pid_k, m, n] and the last of a tile's SPLIT_K programs adds them up (split 0, 1, ...).
        HAS_SCALE: w is FP8, widened to x's dtype per tile, and y[m, n] = scale[n] * sum (FP8 weights).
        PREFETCH (with PDL only): the first prefetch_tiles tiles of this program's W asked into L2 before the wait."""
        if PREFETCH:  # W only: no kernel writes it, so it may be touched before the wait (module docstring)
            rows_pf = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)) % N
            k0 = tl.program_id(1) * k_chunk
            k1 = tl.minimum(k0 + k_chunk, K)
            _prefetch_w_tiles(w_ptr, rows_pf, stride_wn, k0, k1, prefetch_tiles, BLOCK_K, PF_SECTOR)
        wait_then_release(PDL)
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        offs_m = tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        # Rows past N wrap onto valid rows (loaded, never stored): the W loads need no mask along N, so
        # they stay unpredicated 16-byte vectors; the N tail costs a few redundant rows in one program.
        rows = offs_n % N
        offs_k = tl.arange(0, BLOCK_K)
        k_start = pid_k * k_chunk
        k_end = tl.minimum(k_start + k_chunk, K)
        # int64 row offsets: N * K may exceed 2^31 elements
        w_ptrs = w_ptr + rows.to(tl.int64)[:, None] * stride_wn + (k_start + offs_k)[None, :]
        x_ptrs = x_ptr + offs_m[:, None] * stride_xm + (k_start + offs_k)[None, :]
        m_mask = offs_m[:, None] < M  # rows >= M are zeros: M padded to one 16-row MMA tile
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in tl.range(k_start, k_end, BLOCK_K, num_stages=NUM_STAGES):
            if EVEN_K:
                w = tl.load(w_ptrs, eviction_policy="evict_first")  # W is streamed once: keep L2 for x
                xt = tl.load(x_ptrs, mask=m_mask, other=0.0, eviction_policy="evict_last")
            else:
                k_mask = (k + offs_k) < K
                w = tl.load(w_ptrs, mask=k_mask[None, :], other=0.0, eviction_policy="evict_first")
                xt = tl.load(x_ptrs, mask=m_mask & k_mask[None, :], other=0.0, eviction_policy="evict_last")
            if HAS_SCALE:
                w = w.to(xt.dtype)  # e4m3 -> bf16 / fp16 / fp32: exact
            if IS_FP32:
                # fp32 inputs: full-precision products, as F.linear (tf32 would lose 13 mantissa bits).
                acc = tl.dot(xt, tl.trans(w), acc, input_precision="ieee")
            else:
                acc = tl.dot(xt, tl.trans(w), acc)
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
        out_mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
        y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
        if HAS_SCALE:
            row_scale = tl.load(scale_ptr + rows)[None, :]  # [1, BLOCK_N] fp32, one per output channel
        if SPLIT_K == 1:
            if HAS_SCALE:
                acc = acc * row_scale
            tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=out_mask)
        else:
            # Partials [SPLIT_K, M, N] fp32, contiguous. The tile's last program to arrive sums them (protocol
            # and memory ordering: spanllm.kernels.arrival_counters): the barrier orders every warp's partial
            # stores before the one thread's acq_rel increment; the winner reads the partials from L2 (.cg),
            # in split order from zero (the same sum, bit for bit, whichever program came last), and resets
            # the tile's counter for the next launch or graph replay.
            tile = offs_m[:, None] * N + offs_n[None, :]
            tl.store(ws_ptr + pid_k * M * N + tile, acc, mask=out_mask)
            tl.debug_barrier()
            arrived = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel")
            if arrived == SPLIT_K - 1:
                total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                for s in tl.static_range(SPLIT_K):
                    total += tl.load(ws_ptr + s * M * N + tile, mask=out_mask, other=0.0, cache_modifier=".cg")
                if HAS_SCALE:
                    total = total * row_scale
                tl.store(y_ptrs, total.to(y_ptr.dtype.element_ty), mask=out_mask)
                tl.atomic_xchg(cnt_ptr + pid_n, 0)


def prefetch_budget() -> int:
    """Bytes of W one GEMM prefetches into L2 under PDL: W_PREFETCH_BYTES, or SPANLLM_SKINNY_PREFETCH_BYTES."""
    v = os.environ.get(PREFETCH_ENV)
    if v is None:
        return W_PREFETCH_BYTES
    try:
        b = int(v)
    except ValueError:
        raise ValueError(f"{PREFETCH_ENV}={v!r}: a number of bytes (0: no prefetch)") from None
    if b < 0:
        raise ValueError(f"{PREFETCH_ENV}={b}: must be >= 0 (0: no prefetch)")
    return b


def prefetch_tiles(programs: int, tiles_per_program: int, tile_bytes: int) -> int:
    """W tiles each program of a launch prefetches before its PDL wait: the budget spread over the programs, at most
    a program's own tiles."""
    return max(0, min(tiles_per_program, prefetch_budget() // max(1, programs * tile_bytes)))


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def num_sms_of(device: torch.device) -> int:
    if device.type == "cuda":
        return _num_sms(device.index if device.index is not None else torch.cuda.current_device())
    return DEFAULT_NUM_SMS


def skinny_gemm_available(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether skinny_linear can take this call (else use F.linear)."""
    return (
        triton is not None
        and x.is_cuda
        and weight.is_cuda
        and x.device == weight.device
        and x.dtype in SUPPORTED_DTYPES
        and weight.dtype == x.dtype
        and weight.dim() == 2
        and weight.is_contiguous()
        and x.dim() >= 1
        and x.shape[-1] == weight.shape[1]
        and x.numel() // max(1, x.shape[-1]) <= MAX_M
    )


FP8_WEIGHT_DTYPE = torch.float8_e4m3fn


def skinny_linear(
    x: torch.Tensor, weight: torch.Tensor, config: tuple | None = None, weight_scale: torch.Tensor | None = None
) -> torch.Tensor:
    """y = x @ weight^T for x [..., K], weight [N, K] contiguous; y [..., N] in x's dtype.

    Without weight_scale: weight in x's dtype, at most MAX_M rows of x in all. With weight_scale (float32 [N],
    one per output channel): weight is float8_e4m3fn and y = x @ (weight * weight_scale[:, None])^T, at most
    FP8_MAX_M rows (W8A16: x is not quantized).
    `config` (BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages) replaces choose_config (benchmarks, tests).
    One row of x without `config` runs spanllm.kernels.gemv (CUDA cores) where its measured table says that is
    faster for the shape (gemv.takes).
    Allocates y (and the split-K workspace) with torch.empty: safe inside CUDA-graph capture once one eager call
    has run (split-K's arrival counters are allocated outside any capture: arrival_counters).
    """
    if triton is None:
        raise RuntimeError("skinny_linear needs Triton, which is not installed; use torch.nn.functional.linear")
    if weight.dim() != 2:
        raise ValueError(f"skinny_linear: weight must be 2-D [N, K], got shape {tuple(weight.shape)}")
    if x.dim() < 1:
        raise ValueError("skinny_linear: x must have at least one dimension (its last is K)")
    fp8 = weight_scale is not None
    if fp8:
        if weight.dtype != FP8_WEIGHT_DTYPE:
            raise ValueError(
                f"skinny_linear: with weight_scale the weight must be {FP8_WEIGHT_DTYPE}, got {weight.dtype}"
            )
        if weight_scale.dtype != torch.float32 or tuple(weight_scale.shape) != (weight.shape[0],):
            raise ValueError(
                f"skinny_linear: weight_scale must be float32 [N] = [{weight.shape[0]}], got "
                f"{weight_scale.dtype} {tuple(weight_scale.shape)}"
            )
        if not weight_scale.is_contiguous() or weight_scale.device != weight.device:
            raise ValueError("skinny_linear: weight_scale must be contiguous and on the weight's device")
    elif x.dtype != weight.dtype:
        raise ValueError(f"skinny_linear: dtype mismatch: x is {x.dtype}, weight is {weight.dtype}")
    if x.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"skinny_linear: dtype {x.dtype} not supported (bfloat16, float16, float32)")
    n, k = weight.shape
    if x.shape[-1] != k:
        raise ValueError(
            f"skinny_linear: K mismatch: x has K={x.shape[-1]} (shape {tuple(x.shape)}), "
            f"weight has K={k} (shape {tuple(weight.shape)})"
        )
    if not weight.is_contiguous():
        raise ValueError(
            f"skinny_linear: weight must be contiguous (row-major [N, K]); got strides "
            f"{weight.stride()} for shape {tuple(weight.shape)}"
        )
    if x.device != weight.device:
        raise ValueError(f"skinny_linear: x is on {x.device}, weight on {weight.device}")
    lead = x.shape[:-1]
    m = math.prod(lead)
    max_m = FP8_MAX_M if fp8 else MAX_M
    if m > max_m:
        raise ValueError(
            f"skinny_linear: M={m} rows (x shape {tuple(x.shape)}) exceeds the limit M <= {max_m}"
            f"{' (FP8 weights)' if fp8 else ''}; use {'torch._scaled_mm' if fp8 else 'torch.nn.functional.linear'} "
            "for larger batches"
        )
    if m == 0 or n == 0 or k == 0:
        return (torch.zeros if k == 0 else torch.empty)((*lead, n), dtype=x.dtype, device=x.device)
    if m == 1 and config is None and x.dtype in gemv.X_DTYPES and gemv.takes(n, k, weight.element_size()):
        return gemv.gemv(x, weight, weight_scale=weight_scale)  # one row: the CUDA-core GEMV measured faster
    x2 = x.reshape(m, k)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    cfg = (
        _check_config(config)
        if config is not None
        else choose_config(m, n, k, num_sms_of(x.device), weight.element_size(), x_bytes=x.element_size())
    )
    if x.device.type != "cuda" and not interpreter.interpreting():
        raise ValueError(
            f"skinny_linear: tensors must be on a CUDA device, got {x.device} "
            "(CPU tensors run only under TRITON_INTERPRET=1)"
        )
    split = effective_split_k(k, cfg.block_k, cfg.split_k)
    chunk = split_k_chunk(k, cfg.block_k, split)
    n_tiles = triton.cdiv(n, cfg.block_n)
    launch = launch_options(x.device)
    tile_bytes = cfg.block_n * cfg.block_k * weight.element_size()
    pf_tiles = prefetch_tiles(n_tiles * split, chunk // cfg.block_k, tile_bytes) if launch["PDL"] else 0
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    ws, counters = split_k_buffers(y, split, n_tiles)
    _skinny_gemm_kernel[(n_tiles, split)](
        x2,
        weight,
        y,
        ws,
        counters,
        weight_scale if fp8 else y,
        m,
        n,
        k,
        chunk,
        x2.stride(0),
        weight.stride(0),
        n,
        pf_tiles,
        BLOCK_M=block_m_for(m),
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        SPLIT_K=split,
        EVEN_K=(k % cfg.block_k == 0),
        IS_FP32=(x.dtype == torch.float32),
        HAS_SCALE=fp8,
        NUM_STAGES=cfg.num_stages,
        PREFETCH=pf_tiles > 0,
        PF_SECTOR=min(cfg.block_k, PREFETCH_SECTOR // weight.element_size()),  # elements per prefetch
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **launch,
    )
    return y.reshape(*lead, n)


# torch.ops.spanllm.skinny_linear: the same call as one opaque op, so that torch.compile (the engine's
# compiled decode) keeps the launch as a single graph node instead of tracing into the Python above
# (config choice, allocations, the launch). Registered where Triton exists; the fake returns y's shape.
if triton is not None:

    @torch.library.custom_op("spanllm::skinny_linear", mutates_args=())
    def skinny_linear_op(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return skinny_linear(x, weight)

    @skinny_linear_op.register_fake
    def _(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return x.new_empty((*x.shape[:-1], weight.shape[0]))

    @torch.library.custom_op("spanllm::fp8_weight_linear", mutates_args=())
    def fp8_weight_linear_op(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
        return skinny_linear(x, weight, weight_scale=weight_scale)

    @fp8_weight_linear_op.register_fake
    def _(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
        return x.new_empty((*x.shape[:-1], weight.shape[0]))
