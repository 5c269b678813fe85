"""Triton kernels for paged attention (GPU): decode with split context, and prefill chunks over a
paged prefix. Layouts and semantics: spanllm.engine.paged_attention (the reference is there).

GQA: a program owns one KV head and all g = hq / hkv query heads that read it, so each K/V tile is
loaded once for g queries. tl.dot needs at least 16 rows, so the decode kernel pads g to G_PAD >= 16
(the extra rows are masked; decode is bound by the K/V reads, not the math).

Decode, graph safety: the grid (batch, KV heads, splits) is fixed by the shapes a CUDA graph captured;
each program derives its range of keys from context_lens on the device, so one captured graph serves
every step. Split s of a sequence with n key tiles takes tiles [s*c, min(n, (s+1)*c)), c = ceil(n/S):
every split of a short sequence past its end does nothing (m = -inf, l = 0), and the merge weighs it 0.

Numerics: scores and the softmax in float32 (exp2 with log2(e) folded into the scale), P cast to the
value dtype for the second dot, fp32 accumulation, one rounding at the store.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from spanllm.engine.skinny_gemm import num_sms_of

BLOCK_N = 64  # keys per inner iteration (several cache blocks)
MAX_SPLITS = 16


def _precision(x: torch.Tensor) -> str:
    """float32 caches multiply in IEEE fp32 (tests compare with the reference); 16-bit ones as usual."""
    return "ieee" if x.dtype == torch.float32 else "tf32"


def num_splits_for(batch: int, kv_heads: int, device: torch.device) -> int:
    """Context splits for a decode batch: enough programs for about two waves of the GPU."""
    if device.type != "cuda":
        return 1
    return max(1, min(MAX_SPLITS, (2 * num_sms_of(device)) // max(1, batch * kv_heads)))


@triton.jit
def _decode_kernel(q_ptr, k_ptr, v_ptr, bt_ptr, cl_ptr, out_ptr, m_ptr, l_ptr, acc_ptr,
                   stride_qb, stride_qh, stride_kb, stride_kt, stride_kh, stride_btb,
                   stride_ob, stride_oh, scale_log2,
                   G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, CACHE_BLOCK: tl.constexpr,
                   BLOCK: tl.constexpr, SPLITS: tl.constexpr, PREC: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.program_id(2)
    n = tl.load(cl_ptr + b)
    n_tiles = tl.cdiv(n, BLOCK)
    per_split = tl.cdiv(n_tiles, SPLITS)
    t0 = s * per_split
    t1 = tl.minimum(t0 + per_split, n_tiles)

    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D)
    g_ok = g < G
    q = tl.load(q_ptr + b * stride_qb + (h * G + g)[:, None] * stride_qh + d[None, :], mask=g_ok[:, None], other=0.0)
    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D], tl.float32)
    for t in range(t0, t1):
        offs = t * BLOCK + tl.arange(0, BLOCK)
        ok = offs < n
        blk = tl.load(bt_ptr + b * stride_btb + offs // CACHE_BLOCK, mask=ok, other=0)
        row = blk.to(tl.int64) * stride_kb + (offs % CACHE_BLOCK) * stride_kt + h * stride_kh
        k = tl.load(k_ptr + row[:, None] + d[None, :], mask=ok[:, None], other=0.0)  # [BLOCK, D]
        scores = tl.dot(q, tl.trans(k), input_precision=PREC) * scale_log2  # [G_PAD, BLOCK], log2 units
        scores = tl.where(ok[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        p = tl.exp2(scores - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + row[:, None] + d[None, :], mask=ok[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
        m_i = m_new
    if SPLITS == 1:
        o = acc / l_i[:, None]
        tl.store(out_ptr + b * stride_ob + (h * G + g)[:, None] * stride_oh + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=g_ok[:, None])
    else:
        # Partials [B, H, SPLITS, G_PAD(, D)], contiguous.
        base = ((b * tl.num_programs(1) + h) * SPLITS + s) * G_PAD
        tl.store(m_ptr + base + g, m_i)
        tl.store(l_ptr + base + g, l_i)
        tl.store(acc_ptr + (base + g)[:, None] * D + d[None, :], acc)


@triton.jit
def _merge_kernel(m_ptr, l_ptr, acc_ptr, out_ptr, stride_ob, stride_oh,
                  G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, SPLITS: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D)
    base = (b * tl.num_programs(1) + h) * SPLITS * G_PAD
    m_max = tl.full([G_PAD], float("-inf"), tl.float32)
    for s in range(SPLITS):
        m_max = tl.maximum(m_max, tl.load(m_ptr + base + s * G_PAD + g))
    l_sum = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D], tl.float32)
    for s in range(SPLITS):
        m_s = tl.load(m_ptr + base + s * G_PAD + g)
        w = tl.where(m_s == float("-inf"), 0.0, tl.exp2(m_s - m_max))  # an empty split weighs nothing
        l_sum += w * tl.load(l_ptr + base + s * G_PAD + g)
        acc += w[:, None] * tl.load(acc_ptr + (base + s * G_PAD + g)[:, None] * D + d[None, :])
    o = acc / l_sum[:, None]
    tl.store(out_ptr + b * stride_ob + (h * G + g)[:, None] * stride_oh + d[None, :], o.to(out_ptr.dtype.element_ty),
             mask=(g < G)[:, None])


def decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
           context_lens: torch.Tensor, num_splits: int) -> torch.Tensor:
    """q [B, hq, d] -> [B, hq, d]. context_lens [B] int32 (>= 1), block_tables [B, W] int32."""
    b, hq, d = q.shape
    _, cache_block, hkv, _ = k_cache.shape
    g = hq // hkv
    g_pad = max(16, triton.next_power_of_2(g))
    out = torch.empty_like(q)
    scale_log2 = (1.0 / math.sqrt(d)) * 1.4426950408889634
    if num_splits > 1:
        m = torch.empty(b, hkv, num_splits, g_pad, device=q.device, dtype=torch.float32)
        l = torch.empty_like(m)
        acc = torch.empty(b, hkv, num_splits, g_pad, d, device=q.device, dtype=torch.float32)
    else:
        m = l = acc = out  # unused
    _decode_kernel[(b, hkv, num_splits)](
        q, k_cache, v_cache, block_tables, context_lens, out, m, l, acc,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        out.stride(0), out.stride(1), scale_log2,
        G=g, G_PAD=g_pad, D=d, CACHE_BLOCK=cache_block, BLOCK=BLOCK_N, SPLITS=num_splits, PREC=_precision(q),
        num_warps=4)
    if num_splits > 1:
        _merge_kernel[(b, hkv)](m, l, acc, out, out.stride(0), out.stride(1), G=g, G_PAD=g_pad, D=d,
                                SPLITS=num_splits, num_warps=4)
    return out


@triton.jit
def _prefill_kernel(q_ptr, k_ptr, v_ptr, bt_ptr, cuq_ptr, cl_ptr, tiles_ptr, out_ptr,
                    stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_btb, stride_ot, stride_oh,
                    scale_log2, G: tl.constexpr, D: tl.constexpr, CACHE_BLOCK: tl.constexpr,
                    BLOCK_Q: tl.constexpr, BLOCK: tl.constexpr, PREC: tl.constexpr):
    pid = tl.program_id(0)
    h = tl.program_id(1)
    j = tl.load(tiles_ptr + 2 * pid)  # the chunk
    qs = tl.load(tiles_ptr + 2 * pid + 1)  # its first query in this tile
    q0 = tl.load(cuq_ptr + j)
    q_len = tl.load(cuq_ptr + j + 1) - q0
    n = tl.load(cl_ptr + j)
    first_pos = n - q_len  # position of the chunk's first query

    r = tl.arange(0, BLOCK_Q * G)  # row = (query, head in group)
    tok = qs + r // G
    head = h * G + r % G
    row_ok = tok < q_len
    d = tl.arange(0, D)
    q = tl.load(q_ptr + (q0 + tok)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None], other=0.0)
    pos = first_pos + tok
    m_i = tl.full([BLOCK_Q * G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_Q * G], tl.float32)
    acc = tl.zeros([BLOCK_Q * G, D], tl.float32)
    kv_end = tl.minimum(n, first_pos + qs + BLOCK_Q)  # the tile's last query sees keys < this
    for start in range(0, kv_end, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        ok = offs < kv_end
        blk = tl.load(bt_ptr + j * stride_btb + offs // CACHE_BLOCK, mask=ok, other=0)
        kv_row = blk.to(tl.int64) * stride_kb + (offs % CACHE_BLOCK) * stride_kt + h * stride_kh
        k = tl.load(k_ptr + kv_row[:, None] + d[None, :], mask=ok[:, None], other=0.0)
        scores = tl.dot(q, tl.trans(k), input_precision=PREC) * scale_log2
        causal = (offs[None, :] <= pos[:, None]) & ok[None, :]
        scores = tl.where(causal, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        m_new = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows of padding queries see no key
        p = tl.exp2(scores - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + kv_row[:, None] + d[None, :], mask=ok[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
        m_i = m_new
    o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(out_ptr + (q0 + tok)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


def prefill_block_q(group: int) -> int:
    """Queries per prefill tile: about 64-128 rows of (query, head) for the dot."""
    return max(1, 64 // group) if group <= 8 else 1


def prefill_tiles(q_lens: list[int], group: int) -> list[tuple[int, int]]:
    """(chunk, first query) of every prefill tile, for the host to send with the step."""
    bq = prefill_block_q(group)
    return [(j, s) for j, t in enumerate(q_lens) for s in range(0, t, bq)]


def prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
            cu_q: torch.Tensor, context_lens: torch.Tensor, tiles: torch.Tensor) -> torch.Tensor:
    """q [T, hq, d] packed chunks -> [T, hq, d]. tiles [n_tiles, 2] int32 from prefill_tiles()."""
    t, hq, d = q.shape
    _, cache_block, hkv, _ = k_cache.shape
    g = hq // hkv
    rows = prefill_block_q(g) * g
    if rows & (rows - 1):
        raise ValueError(f"prefill tiles of {rows} rows (queries x {g} heads per KV head) are not a power of two; "
                         "the Triton prefill kernel needs query heads per KV head in 1, 2, 4, 8, 16, ...")
    out = torch.empty_like(q)
    scale_log2 = (1.0 / math.sqrt(d)) * 1.4426950408889634
    _prefill_kernel[(tiles.shape[0], hkv)](
        q, k_cache, v_cache, block_tables, cu_q, context_lens, tiles, out,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        out.stride(0), out.stride(1), scale_log2,
        G=g, D=d, CACHE_BLOCK=cache_block, BLOCK_Q=prefill_block_q(g), BLOCK=BLOCK_N, PREC=_precision(q), num_warps=4)
    return out
