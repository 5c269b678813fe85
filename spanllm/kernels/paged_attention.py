"""Triton kernels for paged attention (GPU): decode with split context, and prefill chunks over a
paged prefix. Layouts and semantics: spanllm.attention.backend; the reference: spanllm.attention.reference.

GQA: a program owns one KV head and all g = hq / hkv query heads that read it, so each K/V tile is
loaded once for g queries. tl.dot needs at least 16 rows, so the decode kernel pads g to G_PAD >= 16
(the extra rows are masked; decode is bound by the K/V reads, not the math).

Decode, graph safety: the grid (batch, KV heads, splits) is fixed by the shapes a CUDA graph captured;
each program derives its range of keys from context_lens on the device, so one captured graph serves
every step. Split s of a sequence with n key tiles takes tiles [s*c, min(n, (s+1)*c)),
c = max(ceil(n/S), MIN_TILES_PER_SPLIT):
a split past a short sequence's end does nothing at all. The splits that own keys write partial (m, l, acc)
and count themselves in on a per-(sequence, head) counter; the last to arrive merges them in the same
kernel (no second launch: at batch 1 that launch cost more than the attention) and resets the counter
(the protocol and its memory ordering: spanllm.kernels.arrival_counters).

Prefill, long prefixes: a program owns PrefillConfig.block_q queries of one chunk x the g query heads of one KV
head (spanllm.kernels.prefill_config) and walks its keys in two loops: every key tile wholly before the tile's
first query (cached prefix and earlier chunks: no causal mask, no bounds mask, block ids one tile ahead), then
the few tiles on the diagonal with the causal mask. The host lists tiles heaviest first (prefill_tiles).

Numerics: scores and the softmax in float32 (exp2 with log2(e) folded into the scale), P cast to the
value dtype for the second dot, fp32 accumulation, one rounding at the store. An FP8 cache (--kv-cache-dtype
fp8: e4m3 values, scale 1) is widened to the query's dtype as each K/V tile is loaded (exact); the dots then
run as with a bf16 cache, on half the bytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from spanllm.kernels.arrival_counters import arrival_counters
from spanllm.kernels.pdl import launch_options, wait_then_release
from spanllm.kernels.prefill_config import PrefillConfig, prefill_block_q, prefill_config
from spanllm.kernels.shared_prefix_layout import MAX_PREFIX_SPLITS
from spanllm.kernels.skinny_gemm import num_sms_of

BLOCK_N = 64  # keys per inner iteration (several cache blocks)
MAX_SPLITS = 16
# The decode key loop has two forms: with the next tile's block ids loaded one iteration ahead and K and V
# issued together (one trip to memory per tile instead of three in a row), which wins while the grid is small,
# and without (both K and V tiles live at once cost occupancy on a full GPU). The first is taken while the grid
# (batch x KV heads x splits) is at most PREFETCH_WAVES programs per SM: exactly the grids num_splits_for fills
# by splitting.
PREFETCH_WAVES = 2
DECODE_NUM_STAGES = 3  # Triton's software pipelining of the key loop
# The decode key loop's (keys per tile, warps, pipeline stages) by the cache's bytes per element. An FP8 cache's
# tiles carry half the bytes of a bf16 one's at the same keys: 128-key tiles read it ~8% faster than 64 keys, 3
# stages (geometric mean over batches 1-256, contexts 256-8,192); widened to fp16 (FP8_DECODE_WIDEN), 3 stages beat
# 2 by 5%; for bf16, 64 keys, 3 stages stays the best (scripts/gpu_decode_launch.py on an H100:
# results/h100/decode_launch/, results/h100/decode_widen/).
DECODE_LAUNCH = {
    1: (128, 4, 3),
    2: (BLOCK_N, 4, DECODE_NUM_STAGES),
    4: (BLOCK_N, 4, DECODE_NUM_STAGES),
}
# A split takes at least this many key tiles: a short context runs in fewer splits (one, with no merge, up
# to MIN_TILES_PER_SPLIT tiles of keys: 128 keys a tile in bf16, 256 with an FP8 cache's 128-key tiles), where the
# merge's latency would cost more than the parallelism gains.
MIN_TILES_PER_SPLIT = 2
# Prefill with PrefillConfig.lazy_rescale: the running maximum is moved only when some row's grew by more than this
# (log2 units), so p stays <= 2^8 (FA-4's conditional rescaling).
RESCALE_THRESHOLD = tl.constexpr(8.0)


def _precision(x: torch.Tensor) -> str:
    """float32 caches multiply in IEEE fp32 (tests compare with the reference); 16-bit ones as usual."""
    return "ieee" if x.dtype == torch.float32 else "tf32"


def prefetch_block_ids(programs: int, device: torch.device) -> bool:
    """Whether a decode grid of this many programs takes the loop with block ids one tile ahead."""
    return programs <= PREFETCH_WAVES * num_sms_of(device)


# What an FP8 cache's tiles widen to under bf16 queries by default. fp16 costs one conversion instruction per two
# values where bf16 goes through fp16 and one more per value. Timed on an H100 at the four best launches, six
# batch x context shapes (results/h100/decode_widen/): fp16 is faster at every one, 1.14-1.25x at 128 keys, 4 warps,
# 3 stages except at 256 x 256 (1.01x), and the FP8 ShareGPT run gains 3.4%. (ptxas's spills of the fp16 form with
# block ids one tile ahead, results/cpu_sm90_compile/, do not show in those times.)
FP8_DECODE_WIDEN = "fp16"


def decode_widens_to_f16(q_dtype: torch.dtype, cache_dtype: torch.dtype, widen: str | None = None) -> bool:
    """Whether the decode kernel widens an FP8 cache to fp16 (with q in fp16) rather than to q's bf16 (widen None:
    FP8_DECODE_WIDEN)."""
    if widen not in (None, "fp16", "bf16"):
        raise ValueError(f"widen={widen!r}: one of None (the default, FP8_DECODE_WIDEN), 'fp16', 'bf16'")
    if cache_dtype != torch.float8_e4m3fn or q_dtype != torch.bfloat16:
        if widen is not None:
            raise ValueError(
                f"widen={widen!r} applies to an FP8 cache under bf16 queries; this is a {cache_dtype} cache under "
                f"{q_dtype} queries: pass widen=None"
            )
        return False
    return (widen or FP8_DECODE_WIDEN) == "fp16"


def num_splits_for(batch: int, kv_heads: int, device: torch.device) -> int:
    """Context splits for a decode batch: enough programs for about two waves of the GPU."""
    if device.type != "cuda":
        return 1
    return max(1, min(MAX_SPLITS, (2 * num_sms_of(device)) // max(1, batch * kv_heads)))


@triton.jit
def _fold_prefix_partials(m_i, l_i, acc, rs_ptr, pm_ptr, pl_ptr, pacc_ptr, b, h, g, g_ok, d, G, D, PS):
    """(m, l, acc) of row b, KV head h's query heads, merged with the row's stage-1 partials (its group's
    splits of the shared prefix; none when rs[b] = 0). Partials [B, PS, hq(, D)] float32, written by
    _shared_prefix_kernel in an earlier launch (stream order makes them visible). m is finite on both sides:
    every split owns keys, and every row keeps at least one key of its own."""
    hq = tl.num_programs(1) * G
    for j in range(0, tl.load(rs_ptr + b)):
        rows = (b * PS + j) * hq + h * G + g
        m_j = tl.load(pm_ptr + rows, mask=g_ok, other=0.0)
        l_j = tl.load(pl_ptr + rows, mask=g_ok, other=0.0)
        a_j = tl.load(pacc_ptr + rows[:, None] * D + d[None, :], mask=g_ok[:, None], other=0.0)
        m_i, l_i, acc = _merge_partial(m_i, l_i, acc, m_j, l_j, a_j)
    return m_i, l_i, acc


@triton.jit
def _merge_partial(m_i, l_i, acc, m_j, l_j, a_j):
    """Two partial softmax results over disjoint keys (m in log2 units, l, unnormalized acc) -> their union's,
    rescaled to the larger maximum. m_i may be -inf (nothing yet: its weight is 0); m_j is finite."""
    m_new = tl.maximum(m_i, m_j)
    c_old = tl.exp2(m_i - m_new)
    c_j = tl.exp2(m_j - m_new)
    return m_new, l_i * c_old + l_j * c_j, acc * c_old[:, None] + a_j * c_j[:, None]


@triton.jit
def _shared_prefix_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    bt_ptr,
    grp_ptr,
    unit_ptr,
    pm_ptr,
    pl_ptr,
    pacc_ptr,
    stride_qb,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_btb,
    scale_log2,
    G: tl.constexpr,
    G_PAD: tl.constexpr,
    MEMBERS: tl.constexpr,
    D: tl.constexpr,
    CACHE_BLOCK: tl.constexpr,
    BLOCK: tl.constexpr,
    PS: tl.constexpr,
    PREC: tl.constexpr,
    PDL: tl.constexpr,
):
    """Stage 1 of shared-prefix decode (spanllm.attention.shared_prefix): program (u, h) takes unit u = (group,
    split, key tiles [t0, t1), prefix keys P) and KV head h: the g query heads of every member of the group as
    MEMBERS x G_PAD rows of one tile, against the split's prefix keys (read once for all of them, through the
    first member's block table: the members' first P / CACHE_BLOCK block ids are equal), and stores each real
    row's partial (m, l, acc). A padding unit (t0 = t1) does nothing: a graph's grid is the buffer's size."""
    wait_then_release(PDL)
    u = tl.program_id(0)
    h = tl.program_id(1)
    gi = tl.load(unit_ptr + u * 5)
    split = tl.load(unit_ptr + u * 5 + 1)
    t0 = tl.load(unit_ptr + u * 5 + 2)
    t1 = tl.load(unit_ptr + u * 5 + 3)
    prefix = tl.load(unit_ptr + u * 5 + 4)
    if t1 > t0:
        r = tl.arange(0, MEMBERS * G_PAD)
        member = tl.load(grp_ptr + gi * MEMBERS + r // G_PAD)  # -1 past the group's last member
        head = h * G + r % G_PAD
        ok_r = (member >= 0) & (r % G_PAD < G)
        row = tl.where(ok_r, member, 0)
        first = tl.load(grp_ptr + gi * MEMBERS)
        d = tl.arange(0, D)
        q_rows = q_ptr + row[:, None] * stride_qb + head[:, None] * stride_qh + d[None, :]
        q = tl.load(q_rows, mask=ok_r[:, None], other=0.0)
        m_i = tl.full([MEMBERS * G_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([MEMBERS * G_PAD], tl.float32)
        acc = tl.zeros([MEMBERS * G_PAD, D], tl.float32)
        # block ids one tile ahead, K and V issued together (the decode kernel's PREFETCH loop)
        nxt = t0 * BLOCK + tl.arange(0, BLOCK)
        blk = tl.load(bt_ptr + first * stride_btb + nxt // CACHE_BLOCK, mask=nxt < prefix, other=0)
        for t in range(t0, t1):
            offs = t * BLOCK + tl.arange(0, BLOCK)
            ok = offs < prefix
            kv = blk.to(tl.int64) * stride_kb + (offs % CACHE_BLOCK) * stride_kt + h * stride_kh
            k = tl.load(k_ptr + kv[:, None] + d[None, :], mask=ok[:, None], other=0.0).to(q.dtype)
            v = tl.load(v_ptr + kv[:, None] + d[None, :], mask=ok[:, None], other=0.0).to(q.dtype)
            nxt = offs + BLOCK
            blk = tl.load(bt_ptr + first * stride_btb + nxt // CACHE_BLOCK, mask=nxt < prefix, other=0)
            scores = tl.where(ok[None, :], tl.dot(q, tl.trans(k), input_precision=PREC), float("-inf"))
            # m in log2 units of the scaled scores, as the decode kernel's partials it is merged with
            m_i, l_i, acc = _softmax_step(scores, v, m_i, l_i, acc, scale_log2, PREC, False)
        hq = tl.num_programs(1) * G
        dst = (row * PS + split) * hq + head
        tl.store(pm_ptr + dst, m_i, mask=ok_r)
        tl.store(pl_ptr + dst, l_i, mask=ok_r)
        tl.store(pacc_ptr + dst[:, None] * D + d[None, :], acc, mask=ok_r[:, None])


@triton.jit
def _decode_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    bt_ptr,
    cl_ptr,
    out_ptr,
    m_ptr,
    l_ptr,
    acc_ptr,
    sem_ptr,
    rp_ptr,
    rs_ptr,
    pm_ptr,
    pl_ptr,
    pacc_ptr,
    stride_qb,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_btb,
    stride_ob,
    stride_oh,
    scale_log2,
    G: tl.constexpr,
    G_PAD: tl.constexpr,
    D: tl.constexpr,
    CACHE_BLOCK: tl.constexpr,
    BLOCK: tl.constexpr,
    SPLITS: tl.constexpr,
    MIN_TILES: tl.constexpr,
    PREC: tl.constexpr,
    PREFETCH: tl.constexpr,
    HAS_PREFIX: tl.constexpr,
    PREFIX_SPLITS: tl.constexpr,
    WIDEN_F16: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_then_release(PDL)
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.program_id(2)
    n = tl.load(cl_ptr + b)
    # HAS_PREFIX: keys [0, start) are the row's group's shared prefix, attended by _shared_prefix_kernel (its
    # partials are folded in before the store); this kernel walks keys [start, n) (start 0: not in a group).
    start = 0
    if HAS_PREFIX:
        start = tl.load(rp_ptr + b)
    n_tiles = tl.cdiv(n - start, BLOCK)
    per_split = tl.maximum(tl.cdiv(n_tiles, SPLITS), MIN_TILES)  # short contexts: fewer splits, maybe no merge
    n_active = tl.cdiv(n_tiles, per_split)  # splits that own at least one key tile (0 when n = 0: not a decode)
    if s < n_active:
        t0 = s * per_split
        t1 = tl.minimum(t0 + per_split, n_tiles)
        g = tl.arange(0, G_PAD)
        d = tl.arange(0, D)
        g_ok = g < G
        q = tl.load(
            q_ptr + b * stride_qb + (h * G + g)[:, None] * stride_qh + d[None, :], mask=g_ok[:, None], other=0.0
        )
        score_scale = scale_log2
        if WIDEN_F16:
            # An FP8 cache widened to fp16, not bf16: e4m3 -> fp16 is one instruction per two values
            # (cvt.rn.f16x2.e4m3x2) and e4m3 -> bf16 goes through fp16 (one more instruction per value); the key
            # loop is bound by that work, not by its loads. q goes to fp16 already scaled (|q| up to 65504 /
            # scale_log2, ~5e5 at d = 128, fits), p is in [0, 1]: both keep more mantissa than in bf16.
            q = (q.to(tl.float32) * scale_log2).to(tl.float16)
            score_scale = 1.0
        m_i = tl.full([G_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([G_PAD], tl.float32)
        acc = tl.zeros([G_PAD, D], tl.float32)
        if PREFETCH:
            # Each tile's block ids are loaded one iteration ahead, so a tile costs one trip to memory (its K and
            # V, issued together) instead of three in a row (block ids, then K, then V after the scores).
            nxt = start + t0 * BLOCK + tl.arange(0, BLOCK)
            blk = tl.load(bt_ptr + b * stride_btb + nxt // CACHE_BLOCK, mask=nxt < n, other=0)
            for t in range(t0, t1):
                offs = start + t * BLOCK + tl.arange(0, BLOCK)
                ok = offs < n
                row = blk.to(tl.int64) * stride_kb + (offs % CACHE_BLOCK) * stride_kt + h * stride_kh
                k = tl.load(k_ptr + row[:, None] + d[None, :], mask=ok[:, None], other=0.0).to(q.dtype)
                v = tl.load(v_ptr + row[:, None] + d[None, :], mask=ok[:, None], other=0.0).to(q.dtype)
                nxt = offs + BLOCK
                blk = tl.load(bt_ptr + b * stride_btb + nxt // CACHE_BLOCK, mask=nxt < n, other=0)
                scores = tl.dot(q, tl.trans(k), input_precision=PREC) * score_scale  # [G_PAD, BLOCK], log2 units
                scores = tl.where(ok[None, :], scores, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(scores, 1))
                p = tl.exp2(scores - m_new[:, None])
                alpha = tl.exp2(m_i - m_new)
                l_i = l_i * alpha + tl.sum(p, 1)
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
                m_i = m_new
        else:
            for t in range(t0, t1):
                offs = start + t * BLOCK + tl.arange(0, BLOCK)
                ok = offs < n
                blk = tl.load(bt_ptr + b * stride_btb + offs // CACHE_BLOCK, mask=ok, other=0)
                row = blk.to(tl.int64) * stride_kb + (offs % CACHE_BLOCK) * stride_kt + h * stride_kh
                k = tl.load(k_ptr + row[:, None] + d[None, :], mask=ok[:, None], other=0.0).to(q.dtype)
                scores = tl.dot(q, tl.trans(k), input_precision=PREC) * score_scale  # [G_PAD, BLOCK], log2 units
                scores = tl.where(ok[None, :], scores, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(scores, 1))
                p = tl.exp2(scores - m_new[:, None])
                alpha = tl.exp2(m_i - m_new)
                l_i = l_i * alpha + tl.sum(p, 1)
                v = tl.load(v_ptr + row[:, None] + d[None, :], mask=ok[:, None], other=0.0).to(q.dtype)
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
                m_i = m_new
        out_rows = out_ptr + b * stride_ob + (h * G + g)[:, None] * stride_oh + d[None, :]
        if n_active == 1:  # the whole context in this split: no partials, no merge
            if HAS_PREFIX:
                m_i, l_i, acc = _fold_prefix_partials(
                    m_i, l_i, acc, rs_ptr, pm_ptr, pl_ptr, pacc_ptr, b, h, g, g_ok, d, G, D, PREFIX_SPLITS
                )
            tl.store(out_rows, (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=g_ok[:, None])
        else:
            # Partials [B, H, SPLITS, G_PAD(, D)], contiguous; only the G real rows are written and read.
            base = (b * tl.num_programs(1) + h) * SPLITS * G_PAD
            mine = base + s * G_PAD + g
            tl.store(m_ptr + mine, m_i, mask=g_ok)
            tl.store(l_ptr + mine, l_i, mask=g_ok)
            tl.store(acc_ptr + mine[:, None] * D + d[None, :], acc, mask=g_ok[:, None])
            # The last split of (b, h) to finish merges. Memory ordering: the counter's atomic is acq_rel at GPU
            # scope, so each split's partial stores above are visible before its increment (release), and the
            # last one's loads below (.cg: from L2, not a stale L1) come after it saw every increment (acquire).
            # It resets the counter, so the next call (or graph replay) starts from zero again. The atomic is issued
            # by one thread: the barrier first makes every warp's partial stores precede it (Triton 3.6 puts one
            # there anyway; this does not depend on how a compiler lowers a scalar atomic).
            tl.debug_barrier()
            arrived = tl.atomic_add(sem_ptr + b * tl.num_programs(1) + h, 1, sem="acq_rel")
            if arrived == n_active - 1:
                # One pass in split order (deterministic whichever split came last): each split's (m, l, acc)
                # loaded together, the running sums rescaled to the new maximum. Padding rows load m = 0 (no
                # inf - inf) and are never stored.
                m_max = tl.full([G_PAD], float("-inf"), tl.float32)
                l_sum = tl.zeros([G_PAD], tl.float32)
                acc_sum = tl.zeros([G_PAD, D], tl.float32)
                for j in range(0, n_active):
                    rows = base + j * G_PAD + g
                    m_j = tl.load(m_ptr + rows, mask=g_ok, other=0.0, cache_modifier=".cg")
                    l_j = tl.load(l_ptr + rows, mask=g_ok, other=0.0, cache_modifier=".cg")
                    a_j = tl.load(
                        acc_ptr + rows[:, None] * D + d[None, :], mask=g_ok[:, None], other=0.0, cache_modifier=".cg"
                    )
                    m_max, l_sum, acc_sum = _merge_partial(m_max, l_sum, acc_sum, m_j, l_j, a_j)
                if HAS_PREFIX:
                    m_max, l_sum, acc_sum = _fold_prefix_partials(
                        m_max, l_sum, acc_sum, rs_ptr, pm_ptr, pl_ptr, pacc_ptr, b, h, g, g_ok, d, G, D, PREFIX_SPLITS
                    )
                tl.store(out_rows, (acc_sum / l_sum[:, None]).to(out_ptr.dtype.element_ty), mask=g_ok[:, None])
                tl.atomic_xchg(sem_ptr + b * tl.num_programs(1) + h, 0)


def decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    num_splits: int,
    min_tiles: int | None = None,
    *,
    prefetch: bool | None = None,
    out: torch.Tensor | None = None,
    shared: SharedPrefixTensors | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    widen: str | None = None,
) -> torch.Tensor:
    """q [B, hq, d] -> [B, hq, d]. context_lens [B] int32, block_tables [B, W] int32. A row of context 0 is not
    a decode: its programs return at once and its output row is left as it was (a mixed-step graph runs the
    kernel over rows that are decodes in one step and prefill tokens in the next). out: where to write (a
    [B, hq, d] view; default a new tensor). min_tiles and prefetch (default: MIN_TILES_PER_SPLIT, and the key loop
    the grid's size selects) let the tests reach every split and both key loops on small inputs. shared: the
    step's shared-prefix plan on the device (spanllm.attention.shared_prefix): stage 1 runs first, over its
    units, then this kernel over each row's own keys, folding the row's stage-1 partials in. block_n, num_warps,
    num_stages: the key loop's launch shape (default: DECODE_LAUNCH for the cache's element size; a sweep sets them).
    widen: what an FP8 cache's keys and values widen to under bf16 queries, "fp16" (q in fp16, scaled first) or
    "bf16" (the queries' dtype); default FP8_DECODE_WIDEN. Other caches take q's dtype."""
    widen_f16 = decode_widens_to_f16(q.dtype, k_cache.dtype, widen)
    b, hq, d = q.shape
    _, cache_block, hkv, _ = k_cache.shape
    g = hq // hkv
    g_pad = max(16, triton.next_power_of_2(g))
    launch = DECODE_LAUNCH[k_cache.element_size()]
    out = torch.empty_like(q) if out is None else out
    scale_log2 = (1.0 / math.sqrt(d)) * 1.4426950408889634
    prefix_args = (context_lens,) * 5  # unused without a plan
    if shared is not None:
        pm = torch.empty(b, MAX_PREFIX_SPLITS, hq, device=q.device, dtype=torch.float32)
        pl = torch.empty_like(pm)
        pacc = torch.empty(b, MAX_PREFIX_SPLITS, hq, d, device=q.device, dtype=torch.float32)
        prefix_args = (shared.row_prefix, shared.row_splits, pm, pl, pacc)
        _shared_prefix(q, k_cache, v_cache, block_tables, shared, pm, pl, pacc, scale_log2)
    if num_splits > 1:
        m = torch.empty(b, hkv, num_splits, g_pad, device=q.device, dtype=torch.float32)
        l = torch.empty_like(m)
        acc = torch.empty(b, hkv, num_splits, g_pad, d, device=q.device, dtype=torch.float32)
        sem = arrival_counters(q.device, b * hkv)
    else:
        m = l = acc = out  # unused
        sem = context_lens
    _decode_kernel[(b, hkv, num_splits)](
        q,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        out,
        m,
        l,
        acc,
        sem,
        *prefix_args,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        scale_log2,
        G=g,
        G_PAD=g_pad,
        D=d,
        CACHE_BLOCK=cache_block,
        BLOCK=block_n or launch[0],
        SPLITS=num_splits,
        MIN_TILES=MIN_TILES_PER_SPLIT if min_tiles is None else min_tiles,
        PREC=_precision(q),
        PREFETCH=prefetch_block_ids(b * hkv * num_splits, q.device) if prefetch is None else prefetch,
        HAS_PREFIX=shared is not None,
        PREFIX_SPLITS=MAX_PREFIX_SPLITS,
        WIDEN_F16=widen_f16,
        num_warps=num_warps or launch[1],
        num_stages=num_stages or launch[2],
        **launch_options(q.device),
    )
    return out


@dataclass
class SharedPrefixTensors:
    """A step's SharedPrefixPlan (spanllm.attention.shared_prefix) on the device, int32: group_rows [G, members],
    units [U, 5] (a graph's buffers: U fixed, padding units empty), row_prefix and row_splits [B]."""

    group_rows: torch.Tensor
    units: torch.Tensor
    row_prefix: torch.Tensor
    row_splits: torch.Tensor


def _shared_prefix(q, k_cache, v_cache, block_tables, shared: SharedPrefixTensors, pm, pl, pacc, scale_log2) -> None:
    """Stage 1: grid (units, KV heads); the partials it writes are read by the decode kernel launched next."""
    b, hq, d = q.shape
    _, cache_block, hkv, _ = k_cache.shape
    g = hq // hkv
    members = shared.group_rows.shape[1]
    g_pad = triton.next_power_of_2(g)
    if members * g_pad < 16:
        raise ValueError(f"shared-prefix groups of {members} members x {g_pad} query heads: tl.dot needs >= 16 rows")
    if shared.units.shape[0] == 0:
        return
    _shared_prefix_kernel[(shared.units.shape[0], hkv)](
        q,
        k_cache,
        v_cache,
        block_tables,
        shared.group_rows,
        shared.units,
        pm,
        pl,
        pacc,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        scale_log2,
        G=g,
        G_PAD=g_pad,
        MEMBERS=members,
        D=d,
        CACHE_BLOCK=cache_block,
        BLOCK=BLOCK_N,
        PS=MAX_PREFIX_SPLITS,
        PREC=_precision(q),
        num_warps=4,
        num_stages=DECODE_NUM_STAGES,
        **launch_options(q.device),
    )


@triton.jit
def _softmax_step(s, v, m_i, l_i, acc, scale_log2, PREC: tl.constexpr, LAZY_RESCALE: tl.constexpr):
    """One key tile of the online softmax. s [ROWS, BLOCK_N] raw scores (-inf where masked), v [BLOCK_N, D].
    The scale goes into the exponent as one FMA per score (s * scale - m) rather than into q: q * scale rounded
    to 16 bits would perturb every score, and the FMA costs what the subtraction alone would."""
    m_new = tl.maximum(m_i, tl.max(s, 1) * scale_log2)
    if LAZY_RESCALE:
        # Keep the stale maximum while no row's grew by more than RESCALE_THRESHOLD: p is then at most
        # 2^RESCALE_THRESHOLD, which fp32 l / acc and a 16-bit p hold as exactly as p <= 1, and every row's
        # final acc / l is the same ratio (any reference maximum cancels). One decision per tile (uniform).
        if tl.max(m_new - m_i, 0) > RESCALE_THRESHOLD:
            alpha = tl.exp2(m_i - m_new)
            acc = acc * alpha[:, None]
            l_i = l_i * alpha
            m_i = m_new
    else:
        alpha = tl.exp2(m_i - m_new)
        acc = acc * alpha[:, None]
        l_i = l_i * alpha
        m_i = m_new
    p = tl.exp2(s * scale_log2 - m_i[:, None])
    l_i = l_i + tl.sum(p, 1)
    acc = tl.dot(p.to(v.dtype), v, acc, input_precision=PREC)
    return m_i, l_i, acc


@triton.jit
def _prefill_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    bt_ptr,
    cuq_ptr,
    cl_ptr,
    tiles_ptr,
    out_ptr,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_btb,
    stride_ot,
    stride_oh,
    scale_log2,
    HKV: tl.constexpr,
    G: tl.constexpr,
    D: tl.constexpr,
    CACHE_BLOCK: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PREC: tl.constexpr,
    LAZY_RESCALE: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_then_release(PDL)
    # One program per (tile, KV head), heads fastest: programs start in the tile list's order, which the host
    # sorts heaviest first (the tiles with the most keys), so the longest programs do not start last.
    pid = tl.program_id(0)
    tile = pid // HKV
    h = pid % HKV
    j = tl.load(tiles_ptr + 2 * tile)  # the chunk
    qs = tl.load(tiles_ptr + 2 * tile + 1)  # its first query in this tile
    q0 = tl.load(cuq_ptr + j)
    q_len = tl.load(cuq_ptr + j + 1) - q0
    n = tl.load(cl_ptr + j)
    first_pos = n - q_len  # position of the chunk's first query
    # A padding tile (the empty chunk of a mixed-step graph) does nothing at all: a graph of a few prompt
    # tokens has mostly those, and they must cost no more than their launch.
    if qs < q_len:
        r = tl.arange(0, BLOCK_Q * G)  # row = (query, head in group)
        tok = qs + r // G
        head = h * G + r % G
        row_ok = tok < q_len
        d = tl.arange(0, D)
        q = tl.load(
            q_ptr + (q0 + tok)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
            mask=row_ok[:, None],
            other=0.0,
        )
        pos = first_pos + tok  # padding rows (past the chunk) get positions >= n; they are never stored
        m_i = tl.full([BLOCK_Q * G], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_Q * G], tl.float32)
        acc = tl.zeros([BLOCK_Q * G, D], tl.float32)
        p0 = first_pos + qs  # the tile's first query: every row sees keys [0, p0]
        full_end = ((p0 + 1) // BLOCK_N) * BLOCK_N  # key tiles below this need no mask at all
        kv_end = tl.minimum(n, p0 + BLOCK_Q)  # the tile's last query sees keys < this
        bt_row = bt_ptr + j.to(tl.int64) * stride_btb
        offs_n = tl.arange(0, BLOCK_N)
        # Block ids are loaded one key tile ahead, clamped to the sequence's last key: entries of the table past
        # its blocks are holes (never read), and keys past n are masked in the diagonal loop.
        blk = tl.load(bt_row + tl.minimum(offs_n, n - 1) // CACHE_BLOCK)
        # The first key tile starts at key 0, which every row sees, so each row's maximum is finite from the
        # first iteration on: no -inf - -inf, and l > 0 at the end.
        for start in range(0, full_end, BLOCK_N):
            offs = start + offs_n
            kv_row = blk.to(tl.int64) * stride_kb + (offs % CACHE_BLOCK) * stride_kt + h * stride_kh
            k = tl.load(k_ptr + kv_row[:, None] + d[None, :]).to(q.dtype)  # [BLOCK_N, D]
            v = tl.load(v_ptr + kv_row[:, None] + d[None, :]).to(q.dtype)
            blk = tl.load(bt_row + tl.minimum(offs + BLOCK_N, n - 1) // CACHE_BLOCK)
            s = tl.dot(q, tl.trans(k), input_precision=PREC)  # [ROWS, BLOCK_N]
            m_i, l_i, acc = _softmax_step(s, v, m_i, l_i, acc, scale_log2, PREC, LAZY_RESCALE)
        for start in range(full_end, kv_end, BLOCK_N):  # the diagonal: causal mask, keys past n masked
            offs = start + offs_n
            ok = offs < kv_end
            kv_row = blk.to(tl.int64) * stride_kb + (offs % CACHE_BLOCK) * stride_kt + h * stride_kh
            k = tl.load(k_ptr + kv_row[:, None] + d[None, :], mask=ok[:, None], other=0.0).to(q.dtype)
            v = tl.load(v_ptr + kv_row[:, None] + d[None, :], mask=ok[:, None], other=0.0).to(q.dtype)
            blk = tl.load(bt_row + tl.minimum(offs + BLOCK_N, n - 1) // CACHE_BLOCK)
            s = tl.dot(q, tl.trans(k), input_precision=PREC)
            # a real row's pos < n, so pos excludes the masked keys too; padding rows may see zeros (not stored)
            s = tl.where(offs[None, :] <= pos[:, None], s, float("-inf"))
            m_i, l_i, acc = _softmax_step(s, v, m_i, l_i, acc, scale_log2, PREC, LAZY_RESCALE)
        tl.store(
            out_ptr + (q0 + tok)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
            (acc / l_i[:, None]).to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None],
        )


def prefill_tiles(
    q_lens: list[int],
    group: int,
    first_chunk: int = 0,
    *,
    context_lens: list[int] | None = None,
    block_q: int | None = None,
) -> list[tuple[int, int]]:
    """(chunk, first query) of every prefill tile, for the host to send with the step, heaviest first (most keys:
    a tile of chunk j starting at query s sees context_lens[j] - q_lens[j] + min(s + block_q, q_lens[j]) keys;
    without context_lens, chunks without a prefix). Chunk indices start at first_chunk (a mixed-step graph
    numbers its decodes' one-query chunks first and leaves them to the decode kernel). block_q: the kernel's
    (PrefillConfig.block_q; default prefill_block_q(group))."""
    bq = prefill_block_q(group) if block_q is None else block_q
    ctx = q_lens if context_lens is None else context_lens
    keyed = [
        (int(ctx[j]) - t + min(s + bq, t), first_chunk + j, s)
        for j, t in enumerate(int(x) for x in q_lens)
        for s in range(0, t, bq)
    ]
    keyed.sort(key=lambda e: -e[0])  # stable: equal tiles keep chunk and query order
    return [(c, s) for _, c, s in keyed]


def prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_q: torch.Tensor,
    context_lens: torch.Tensor,
    tiles: torch.Tensor,
    out: torch.Tensor | None = None,
    *,
    config: PrefillConfig | None = None,
) -> torch.Tensor:
    """q [T, hq, d] packed chunks -> [T, hq, d]. tiles [n_tiles, 2] int32 from prefill_tiles() with this
    config's block_q: only the chunks some tile names are computed (rows of other chunks are left as they were
    in `out`, default a new tensor). config: the tiling (default prefill_config(group, dtype))."""
    t, hq, d = q.shape
    _, cache_block, hkv, _ = k_cache.shape
    g = hq // hkv
    cfg = prefill_config(g, q.dtype) if config is None else config
    cfg.check_group(g)
    out = torch.empty_like(q) if out is None else out
    scale_log2 = (1.0 / math.sqrt(d)) * 1.4426950408889634
    _prefill_kernel[(tiles.shape[0] * hkv,)](
        q,
        k_cache,
        v_cache,
        block_tables,
        cu_q,
        context_lens,
        tiles,
        out,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        scale_log2,
        HKV=hkv,
        G=g,
        D=d,
        CACHE_BLOCK=cache_block,
        BLOCK_Q=cfg.block_q,
        BLOCK_N=cfg.block_n,
        PREC=_precision(q),
        LAZY_RESCALE=cfg.lazy_rescale,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **launch_options(q.device),
    )
    return out
