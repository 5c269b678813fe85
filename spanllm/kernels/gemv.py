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

Two fusions save the small kernels around it their launches (spanllm.kernels.gemv_fusion): with `glu_out`, gate_up's
GEMV ends with SiLU(gate) * up (each program's tile interleaves its features' gate and up rows); x may be a NormedRow,
RMSNorm(h + residual) * weight computed as it is loaded, whose sum of squares each program accumulates in the same
loop (merged in split order with the partials) and applies as 1 / rms to the sum.

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
from spanllm.kernels.gemv_fusion import NormedRow
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
        res_ptr,
        nw_ptr,
        res_out_ptr,
        ss_ptr,
        eps,
        N,
        K,
        k_chunk,
        stride_wn,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        SPLIT_K: tl.constexpr,
        HAS_SCALE: tl.constexpr,
        NORM_IN: tl.constexpr,
        HAS_RES: tl.constexpr,
        GLU_OUT: tl.constexpr,
        NUM_STAGES: tl.constexpr,
        PDL: tl.constexpr,
    ):
        wait_then_release(PDL)
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        i = tl.arange(0, BLOCK_N)
        if GLU_OUT:
            # W is [gate (N/2 rows) | up (N/2 rows)]: a program owns BLOCK_N / 2 features, its tile's rows
            # interleaved gate, up, gate, up, ... (each row's sum is the plain kernel's: same loop, same order)
            F = N // 2
            feat = pid_n * (BLOCK_N // 2) + i // 2
            rows = feat % F + (i % 2) * F
            row_ok = feat < F
        else:
            rows = (pid_n * BLOCK_N + i) % N  # rows past N wrap onto valid rows: loaded, never stored
            row_ok = pid_n * BLOCK_N + i < N
        offs_k = tl.arange(0, BLOCK_K)
        k_start = pid_k * k_chunk
        k_end = tl.minimum(k_start + k_chunk, K)
        w_ptrs = w_ptr + rows.to(tl.int64)[:, None] * stride_wn + (k_start + offs_k)[None, :]
        x_ptrs = x_ptr + k_start + offs_k
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        ss = tl.zeros((BLOCK_K,), dtype=tl.float32)  # NORM_IN: the chunk's sum of squares of x + residual
        keep_res = (offs_k >= 0) & (pid_n == 0)  # the first column of programs stores the residual sum, each its chunk
        # num_stages >= 2: Triton stages W and x through shared memory with cp.async (bytes in flight without
        # registers); x is then read in W's register layout. num_stages = 1 would convert x's layout through shared
        # memory with barriers on every trip: the sweep keeps stages >= 2.
        for kk in tl.range(k_start, k_end, BLOCK_K, num_stages=NUM_STAGES):
            w = tl.load(w_ptrs, eviction_policy="evict_first")  # W is streamed once: keep L2 for x
            if NORM_IN:  # x = (h + residual) * norm weight; 1 / rms applied to the sum (gemv_fusion)
                hv = tl.load(x_ptrs, eviction_policy="evict_last")
                if HAS_RES:
                    hv = hv.to(tl.float32) + tl.load(res_ptr + kk + offs_k, eviction_policy="evict_last").to(tl.float32)
                    hv = hv.to(res_out_ptr.dtype.element_ty)  # the new residual, rounded as the unfused add rounds it
                    tl.store(res_out_ptr + kk + offs_k, hv, mask=keep_res)
                hf = hv.to(tl.float32)
                ss += hf * hf
                xv = hf * tl.load(nw_ptr + kk + offs_k, eviction_policy="evict_last").to(tl.float32)
            else:
                xv = tl.load(x_ptrs, eviction_policy="evict_last").to(tl.float32)
            acc += w.to(tl.float32) * xv[None, :]
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
        y = tl.sum(acc, axis=1)  # [BLOCK_N] fp32
        if SPLIT_K == 1:
            if NORM_IN:
                y = y * tl.rsqrt(tl.sum(ss, axis=0) / K + eps)
            _gemv_epilogue(y, y_ptr, scale_ptr, rows, row_ok, pid_n, N, BLOCK_N, HAS_SCALE, GLU_OUT)
        else:
            # The skinny GEMM's merge (protocol and memory ordering: spanllm.kernels.arrival_counters): partials
            # [SPLIT_K, N] fp32 by weight row (with NORM_IN, each program's sum of squares in [SPLIT_K, programs
            # along N]); the barrier orders every warp's stores before the one acq_rel increment; the last program
            # to arrive sums them in split order from zero and resets the counter.
            tl.store(ws_ptr + pid_k * N + rows, y, mask=row_ok)
            if NORM_IN:
                tl.store(ss_ptr + pid_k * tl.num_programs(0) + pid_n, tl.sum(ss, axis=0))
            tl.debug_barrier()
            arrived = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel")
            if arrived == SPLIT_K - 1:
                total = tl.zeros((BLOCK_N,), dtype=tl.float32)
                ss_total = 0.0
                for s in tl.static_range(SPLIT_K):
                    total += tl.load(ws_ptr + s * N + rows, mask=row_ok, other=0.0, cache_modifier=".cg")
                    if NORM_IN:
                        ss_total += tl.load(ss_ptr + s * tl.num_programs(0) + pid_n, cache_modifier=".cg")
                if NORM_IN:
                    total = total * tl.rsqrt(ss_total / K + eps)
                _gemv_epilogue(total, y_ptr, scale_ptr, rows, row_ok, pid_n, N, BLOCK_N, HAS_SCALE, GLU_OUT)
                tl.atomic_xchg(cnt_ptr + pid_n, 0)

    @triton.jit
    def _gemv_epilogue(y, y_ptr, scale_ptr, rows, row_ok, pid_n, N, BLOCK_N: tl.constexpr, HAS_SCALE: tl.constexpr,
                       GLU_OUT: tl.constexpr):  # fmt: skip
        """Store the program's rows: scaled (FP8), rounded to y's dtype; with GLU_OUT, SiLU(gate) * up of its
        interleaved gate / up rows instead, rounded as the unfused chain rounds it (the GEMV's [gate | up] output in
        y's dtype, then fused_ops.silu_mul)."""
        if HAS_SCALE:
            y = y * tl.load(scale_ptr + rows)
        out_ty = y_ptr.dtype.element_ty
        if GLU_OUT:
            gate, up = tl.split(tl.reshape(y.to(out_ty).to(tl.float32), (BLOCK_N // 2, 2)))
            act = (gate / (1.0 + tl.exp(-gate))).to(out_ty)
            feat = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
            tl.store(y_ptr + feat, (act.to(tl.float32) * up).to(out_ty), mask=feat < N // 2)
        else:
            tl.store(y_ptr + pid_n * BLOCK_N + tl.arange(0, BLOCK_N), y.to(out_ty), mask=row_ok)


def gemv(
    x: torch.Tensor | NormedRow,
    weight: torch.Tensor,
    config: tuple | None = None,
    weight_scale: torch.Tensor | None = None,
    glu_out: bool = False,
) -> torch.Tensor:
    """y [1, N] = x [1, K] @ weight[N, K]^T (times weight_scale[:, None] for FP8 weights), in x's dtype; with
    glu_out, SiLU(gate) * up [1, N / 2] of that y laid out [gate | up] (rounded as fused_ops.silu_mul after it).

    x: the row, or a NormedRow (spanllm.kernels.gemv_fusion), whose residual_out this call writes.
    weight: contiguous [N, K] in x's dtype, or float8_e4m3fn with weight_scale float32 [N]. K a multiple of the
    config's BLOCK_K. `config` (BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages): a launch to run (benchmarks,
    tests); None takes the measured table's for the shape (an error where it has none). With glu_out a program's
    BLOCK_N rows are BLOCK_N / 2 features' gate and up rows: as many programs, each row summed as without.
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
    row, extra = _input_row(x, k)
    if row.dtype not in X_DTYPES:
        raise ValueError(f"gemv: x dtype {row.dtype} not supported ({', '.join(map(str, X_DTYPES))})")
    fp8 = weight_scale is not None
    if fp8 and weight.dtype != FP8_WEIGHT_DTYPE:
        raise ValueError(f"gemv: with weight_scale the weight must be {FP8_WEIGHT_DTYPE}, got {weight.dtype}")
    if not fp8 and weight.dtype != row.dtype:
        raise ValueError(f"gemv: dtype mismatch: x is {row.dtype}, weight is {weight.dtype} (FP8 needs weight_scale)")
    if fp8 and (weight_scale.dtype != torch.float32 or tuple(weight_scale.shape) != (n,)):
        raise ValueError(
            f"gemv: weight_scale must be float32 [{n}], got {weight_scale.dtype} {tuple(weight_scale.shape)}"
        )
    if k % cfg.block_k:
        raise ValueError(f"gemv: K={k} is not a multiple of BLOCK_K={cfg.block_k}; pick a BLOCK_K dividing K")
    if glu_out and (n % 2 or cfg.block_n < 2):
        raise ValueError(
            f"gemv: glu_out needs an even N ([gate | up]) and BLOCK_N >= 2 (a gate and an up row a feature), got "
            f"N={n}, BLOCK_N={cfg.block_n}"
        )
    if row.device.type != "cuda" and not interpreter.interpreting():
        raise ValueError(
            f"gemv: tensors must be on a CUDA device, got {row.device} (CPU runs only under TRITON_INTERPRET=1)"
        )
    split = effective_split_k(k, cfg.block_k, cfg.split_k)
    chunk = split_k_chunk(k, cfg.block_k, split)
    out_n = n // 2 if glu_out else n
    n_tiles = triton.cdiv(out_n, cfg.block_n // 2) if glu_out else triton.cdiv(n, cfg.block_n)
    y = torch.empty((1, out_n), dtype=row.dtype, device=row.device)
    ws, counters = split_k_buffers(y, split, n_tiles, n)  # partials [split, 1, N] by weight row
    norm = isinstance(x, NormedRow)
    ss = torch.empty((split, n_tiles), dtype=torch.float32, device=y.device) if norm and split > 1 else y
    _gemv_kernel[(n_tiles, split)](
        row,
        weight,
        y,
        ws,
        counters,
        weight_scale if fp8 else y,
        *extra,
        ss,
        x.eps if norm else 0.0,
        n,
        k,
        chunk,
        weight.stride(0),
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        SPLIT_K=split,
        HAS_SCALE=fp8,
        NORM_IN=norm,
        HAS_RES=norm and x.residual is not None,
        GLU_OUT=glu_out,
        NUM_STAGES=cfg.num_stages,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **launch_options(row.device),
    )
    lead = x.shape[:-1] if isinstance(x, torch.Tensor) else (1,)
    return y.view(*lead, out_n)


def _input_row(x: torch.Tensor | NormedRow, k: int) -> tuple[torch.Tensor, tuple]:
    """(the row the kernel reads at x_ptr, contiguous; its res_ptr, nw_ptr, res_out_ptr) for a GEMV of K=k,
    after checking the input's shapes."""

    def contiguous_row(t: torch.Tensor, what: str) -> torch.Tensor:
        if t.numel() != k or t.shape[-1] != k:
            raise ValueError(f"gemv: {what} must hold one row of K={k} values, got shape {tuple(t.shape)}")
        t = t.reshape(k)
        return t if t.stride(0) == 1 else t.contiguous()

    if isinstance(x, NormedRow):
        h = contiguous_row(x.h, "a NormedRow's h")
        w = contiguous_row(x.weight, "a NormedRow's norm weight")
        if x.residual is None:
            if x.residual_out is not x.h:
                raise ValueError("gemv: a NormedRow without a residual has residual_out = h (nothing to write)")
            return h, (h, w, h)
        res = contiguous_row(x.residual, "a NormedRow's residual")
        res_out = x.residual_out
        if not (res_out.is_contiguous() and res_out.numel() == k and res_out.dtype == h.dtype):
            raise ValueError(f"gemv: a NormedRow's residual_out must be a contiguous row of {k} values in {h.dtype}")
        if res_out.data_ptr() in (h.data_ptr(), res.data_ptr()):
            raise ValueError("gemv: a NormedRow's residual_out must not be h or residual (other programs read them)")
        return h, (res, w, res_out)
    return contiguous_row(x, "x"), (x, x, x)
