"""GEMV for batch-1 decode on CUDA cores: y[N] = W[N, K] @ x[K], W streamed once, no tensor cores, no shared memory.

At one row of x a decode GEMM is a stream over W and nothing else. The skinny GEMM (spanllm.kernels.skinny_gemm)
runs it on tensor cores: x padded to a 16-row MMA tile, W tiles staged through shared memory and, for FP8 weights,
widened there to bf16 and written back for the wgmma to read. On an H100 that streams the 8B's 16-25 MB layers at
52-65% of the copy bandwidth (results/h100/fp8/, tma/, widen/). This kernel does the same sum with fused
multiply-adds in registers: each thread loads 16-byte vectors of W rows, widens them to fp32 and accumulates
w * x elementwise into a [BLOCK_N, BLOCK_K] fp32 tile; the tile is reduced along K once, after the loop (no
cross-thread reduction inside it). x [K] is re-read by every program from L2 (8-28 KB).

Grid (cdiv(N, BLOCK_N), SPLIT_K), as the skinny GEMM: a program owns BLOCK_N rows and one K chunk (a multiple of
BLOCK_K). Rows past N wrap onto valid rows (loaded, never stored), so W loads need no mask along N. K must be a
multiple of BLOCK_K (no K mask: the shapes it is tuned for all are; `gemv` refuses others). Split-K partials
are merged in the same launch by the tile's last program, in split order (spanllm.kernels.arrival_counters):
bit-for-bit reproducible, as decode in CUDA graphs must be.

FP8 weights (with `weight_scale`, float32 [N]): e4m3 widened to fp32 (exact), the row scale applied once to the
sum. 16-bit weights: bf16 / fp16 widened to fp32 (exact). Products and sums in fp32.

Compiled for sm_90 (BLOCK_N 16 x BLOCK_K 512, 4 warps, 3 stages: 116 registers, no spills), a loop trip is
per thread 64 weights in 238 instructions: 32 F2FP (e4m3x2 -> f16x2, the conversion pipe), 64 HADD2 (f16 ->
f32, the FMA pipe), 64 FFMA, the cp.async issues and shared loads: ~2.5x the issue rate HBM needs on an H100.
"""

from __future__ import annotations

import functools
import json
import os
from typing import NamedTuple

import torch

from spanllm.kernels import interpreter
from spanllm.kernels.pdl import launch_options
from spanllm.kernels.split_k import effective_split_k, split_k_buffers, split_k_chunk

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU torch wheel comes without Triton
    triton = None
    tl = None

FP8_WEIGHT_DTYPE = torch.float8_e4m3fn
X_DTYPES = (torch.bfloat16, torch.float16)

# The measured table (gemv_configs.json beside this file, written by scripts/gpu_gemv.py): per weight shape and
# element size, the fastest launch config found and, from the same run, microseconds per call inside a CUDA graph
# of this kernel, of the skinny GEMM at its own config and (16-bit weights) of F.linear. A shape runs here only
# where it was measured faster than the skinny GEMM (`takes`). SPANLLM_GEMV_TABLE names another file of the
# same format (a sweep's output before it is committed). No file: no entries, the skinny GEMM runs.
_TABLE_FILE = os.path.join(os.path.dirname(__file__), "gemv_configs.json")
TABLE_ENV = "SPANLLM_GEMV_TABLE"


class GemvConfig(NamedTuple):
    """One launch: (BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages)."""

    block_n: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int


def check_config(cfg: tuple) -> GemvConfig:
    cfg = GemvConfig(*cfg)
    for name in ("block_n", "block_k", "num_warps"):
        v = getattr(cfg, name)
        if v < 1 or v & (v - 1):
            raise ValueError(f"GEMV config {cfg}: {name}={v} must be a power of two")
    if cfg.split_k < 1 or cfg.num_stages < 1:
        raise ValueError(f"GEMV config {cfg}: split_k and num_stages must be >= 1")
    return cfg


def table_path() -> str:
    return os.environ.get(TABLE_ENV) or _TABLE_FILE


def measured_table() -> dict[tuple[int, int, int], dict]:
    """(N, K, element bytes) -> {"config": GemvConfig, "gemv_us", "skinny_us", "torch_us" (16-bit only)} of the
    table table_path() names now (each file read once)."""
    return _read_table(table_path())


@functools.cache
def _read_table(path: str) -> dict[tuple[int, int, int], dict]:
    if path == _TABLE_FILE and not os.path.exists(path):
        return {}
    try:
        with open(path) as f:
            entries = json.load(f)["entries"]
        table = {}
        for e in entries:
            n, k, eb, cfg = e["n"], e["k"], e["elem_bytes"], check_config(e["config"])
            if eb not in (1, 2) or k % cfg.block_k:
                raise ValueError(f"entry N={n} K={k} elem_bytes={eb}: needs elem_bytes 1 or 2 and BLOCK_K dividing K")
            times = {t: float(e[t]) for t in ("gemv_us", "skinny_us", "torch_us") if t in e}
            if "gemv_us" not in times or "skinny_us" not in times:
                raise ValueError(f"entry N={n} K={k}: gemv_us and skinny_us (measured in the same run) are required")
            table[(n, k, eb)] = {"config": cfg, **times}
        return table
    except (OSError, ValueError, KeyError, TypeError) as e:
        origin = f" (set by {TABLE_ENV})" if path != _TABLE_FILE else ""
        raise RuntimeError(f"GEMV table {path}{origin}: {e}") from e


def takes(n: int, k: int, elem_bytes: int) -> bool:
    """Whether one row times W [n, k] runs this kernel instead of the skinny GEMM: the table measured it faster."""
    e = measured_table().get((n, k, elem_bytes))
    return triton is not None and e is not None and e["gemv_us"] < e["skinny_us"]


def beats_torch(n: int, k: int, elem_bytes: int) -> bool:
    """Whether this kernel was measured faster than F.linear for one row times a 16-bit W [n, k] (an entry without
    F.linear's time never replaces it)."""
    e = measured_table().get((n, k, elem_bytes))
    return takes(n, k, elem_bytes) and "torch_us" in e and e["gemv_us"] < e["torch_us"]


def takes_names(gemms: list[tuple[str, int, int, int]]) -> list[str]:
    """The names of the GEMMs (name, N, K, element bytes) whose one-row call runs here."""
    return [g for g, n, k, e in gemms if takes(n, k, e)]


def describe_one_row(gemms: list[tuple[str, int, int, int]]) -> str:
    """e.g. 'CUDA-core GEMV qkv, o (table 5 entries)': which of the named GEMMs run one row here."""
    where = "" if table_path() == _TABLE_FILE else f" from {table_path()}"
    return f"CUDA-core GEMV {', '.join(takes_names(gemms)) or '-'} (table {len(measured_table())} entries{where})"


def table_config(n: int, k: int, elem_bytes: int) -> GemvConfig:
    return measured_table()[(n, k, elem_bytes)]["config"]


if triton is not None:
    from spanllm.kernels.pdl import wait_then_release

    @triton.jit
    def _gemv_kernel(
        x_ptr,
        w_ptr,
        y_ptr,
        ws_ptr,
        cnt_ptr,
        scale_ptr,
        N,
        K,
        k_chunk,
        stride_wn,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        SPLIT_K: tl.constexpr,
        HAS_SCALE: tl.constexpr,
        NUM_STAGES: tl.constexpr,
        PDL: tl.constexpr,
    ):
        wait_then_release(PDL)
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rows = offs_n % N
        offs_k = tl.arange(0, BLOCK_K)
        k_start = pid_k * k_chunk
        k_end = tl.minimum(k_start + k_chunk, K)
        w_ptrs = w_ptr + rows.to(tl.int64)[:, None] * stride_wn + (k_start + offs_k)[None, :]
        x_ptrs = x_ptr + k_start + offs_k
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        # num_stages >= 2: Triton stages W and x through shared memory with cp.async (bytes in flight without
        # registers); x is then read in W's register layout. num_stages = 1 would convert x's layout through shared
        # memory with barriers on every trip: the sweep keeps stages >= 2.
        for _ in tl.range(k_start, k_end, BLOCK_K, num_stages=NUM_STAGES):
            w = tl.load(w_ptrs, eviction_policy="evict_first")  # W is streamed once: keep L2 for x
            xv = tl.load(x_ptrs, eviction_policy="evict_last").to(tl.float32)
            acc += w.to(tl.float32) * xv[None, :]
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
        y = tl.sum(acc, axis=1)  # [BLOCK_N] fp32
        out_mask = offs_n < N
        if SPLIT_K == 1:
            if HAS_SCALE:
                y = y * tl.load(scale_ptr + rows)
            tl.store(y_ptr + offs_n, y.to(y_ptr.dtype.element_ty), mask=out_mask)
        else:
            # The skinny GEMM's merge (protocol and memory ordering: spanllm.kernels.arrival_counters): partials
            # [SPLIT_K, N] fp32; the barrier orders every warp's stores before the one acq_rel increment; the last
            # program to arrive sums them in split order from zero and resets the counter.
            tl.store(ws_ptr + pid_k * N + offs_n, y, mask=out_mask)
            tl.debug_barrier()
            arrived = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel")
            if arrived == SPLIT_K - 1:
                total = tl.zeros((BLOCK_N,), dtype=tl.float32)
                for s in tl.static_range(SPLIT_K):
                    total += tl.load(ws_ptr + s * N + offs_n, mask=out_mask, other=0.0, cache_modifier=".cg")
                if HAS_SCALE:
                    total = total * tl.load(scale_ptr + rows)
                tl.store(y_ptr + offs_n, total.to(y_ptr.dtype.element_ty), mask=out_mask)
                tl.atomic_xchg(cnt_ptr + pid_n, 0)


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    config: tuple | None = None,
    weight_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """y [1, N] = x [1, K] @ weight[N, K]^T (times weight_scale[:, None] for FP8 weights), in x's dtype.

    weight: contiguous [N, K] in x's dtype, or float8_e4m3fn with weight_scale float32 [N]. K a multiple of the
    config's BLOCK_K. `config` (BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages): a launch to run (benchmarks,
    tests); None takes the measured table's for the shape (an error where it has none).
    Allocates y and the split-K workspace with torch.empty: safe inside CUDA-graph capture once one eager call
    has run (the arrival counters are allocated outside any capture)."""
    if triton is None:
        raise RuntimeError("gemv needs Triton, which is not installed; use torch.nn.functional.linear")
    if weight.dim() != 2 or not weight.is_contiguous():
        raise ValueError(f"gemv: weight must be a contiguous [N, K] matrix, got shape {tuple(weight.shape)}")
    n, k = weight.shape
    if config is None:
        if (n, k, weight.element_size()) not in measured_table():
            raise ValueError(
                f"gemv: no measured config for weight {(n, k)} {weight.dtype} in {table_path()}; "
                "pass config= or measure the shape with scripts/gpu_gemv.py"
            )
        config = table_config(n, k, weight.element_size())
    cfg = check_config(config)
    if x.dtype not in X_DTYPES:
        raise ValueError(f"gemv: x dtype {x.dtype} not supported ({', '.join(map(str, X_DTYPES))})")
    fp8 = weight_scale is not None
    if fp8 and weight.dtype != FP8_WEIGHT_DTYPE:
        raise ValueError(f"gemv: with weight_scale the weight must be {FP8_WEIGHT_DTYPE}, got {weight.dtype}")
    if not fp8 and weight.dtype != x.dtype:
        raise ValueError(f"gemv: dtype mismatch: x is {x.dtype}, weight is {weight.dtype} (FP8 needs weight_scale)")
    if x.numel() != k or x.shape[-1] != k:
        raise ValueError(f"gemv: x must hold one row of K={k} values, got shape {tuple(x.shape)}")
    if fp8 and (weight_scale.dtype != torch.float32 or tuple(weight_scale.shape) != (n,)):
        raise ValueError(
            f"gemv: weight_scale must be float32 [{n}], got {weight_scale.dtype} {tuple(weight_scale.shape)}"
        )
    if k % cfg.block_k:
        raise ValueError(f"gemv: K={k} is not a multiple of BLOCK_K={cfg.block_k}; pick a BLOCK_K dividing K")
    if x.device.type != "cuda" and not interpreter.interpreting():
        raise ValueError(
            f"gemv: tensors must be on a CUDA device, got {x.device} (CPU runs only under TRITON_INTERPRET=1)"
        )
    x1 = x.reshape(k)
    if x1.stride(0) != 1:
        x1 = x1.contiguous()
    split = effective_split_k(k, cfg.block_k, cfg.split_k)
    chunk = split_k_chunk(k, cfg.block_k, split)
    n_tiles = triton.cdiv(n, cfg.block_n)
    y = torch.empty((*x.shape[:-1], n), dtype=x.dtype, device=x.device)
    ws, counters = split_k_buffers(y.view(1, n), split, n_tiles)  # partials [split, 1, N]: the kernel's [split, N]
    launch = launch_options(x.device)
    _gemv_kernel[(n_tiles, split)](
        x1,
        weight,
        y,
        ws,
        counters,
        weight_scale if fp8 else y,
        n,
        k,
        chunk,
        weight.stride(0),
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        SPLIT_K=split,
        HAS_SCALE=fp8,
        NUM_STAGES=cfg.num_stages,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **launch,
    )
    return y
