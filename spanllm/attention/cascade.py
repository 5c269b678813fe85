"""Cascade prefill: a prefill chunk with a long cached prefix as two dense attentions merged by their
log-sum-exp, so each part runs on a fused SDPA kernel at its best shape (no mask tensor):

    o1, lse1 = attn(q_chunk, K_prefix, V_prefix)                 every prefix key, no mask
    o2, lse2 = attn(q_chunk, K_chunk, V_chunk, causal=True)      the chunk's own keys, square causal
    out = (exp(lse1 - m) o1 + exp(lse2 - m) o2) / (exp(lse1 - m) + exp(lse2 - m)),  m = max(lse1, lse2)

The keys are gathered from the paged cache (its block table) into dense tensors per chunk per layer. The
Triton backend runs this for the prefill chunks whose prefix is at least `min_prefix` keys (`plan_cascade`; with
`auto`, only those where `CascadeCost` estimates it faster than the paged kernel), on CUDA, in eager steps only
(the gather's sizes are the step's, not a graph's); the rest of the step keeps the paged kernels. The attention
of each part is one `Attention` function; on CPU the tests use `reference_attention` (float32 math) through the
same code.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from spanllm.attention.reference import gather
from spanllm.kernels.cascade_merge import merge_into

# --prefill-attention: the Triton prefill kernel for every chunk, or the cascade for long-prefix chunks with
# the parts on torch's cuDNN attention or on its flash attention (both through the aten op that returns the LSE);
# auto: cudnn-cascade on a Hopper GPU (where it was measured: ~590 TFLOPS at long prefixes against the paged
# kernel's ~380, results/h100/long_context/README.md) in bf16 / fp16, else triton
PREFILL_ATTENTION = ("auto", "triton", "cudnn-cascade", "flash-cascade")
DEFAULT_CASCADE_MIN_PREFIX = 4096
CASCADE_DTYPES = (torch.bfloat16, torch.float16)  # torch's cuDNN and flash attention take these only
AUTO_CASCADE_CAPABILITY_MAJOR = 9  # Hopper: the only GPUs the cascade was measured on


def resolve_prefill_attention(name: str, device: torch.device, dtype: torch.dtype) -> str:
    """The prefill attention that runs for `name` on this device at this compute dtype: auto resolved (a cascade
    on a Hopper GPU in bf16 / fp16, else triton); a named cascade in another dtype is a ValueError."""
    if name == "auto":
        hopper = device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == AUTO_CASCADE_CAPABILITY_MAJOR
        return "cudnn-cascade" if hopper and dtype in CASCADE_DTYPES else "triton"
    if name in CASCADE_ATTENTION and dtype not in CASCADE_DTYPES:
        raise ValueError(
            f"prefill_attention={name!r} runs torch's fused attention, which takes bf16 or fp16; this run computes in "
            f"{str(dtype).removeprefix('torch.')}: use prefill_attention='triton' or 'auto', or a bf16 / fp16 dtype"
        )
    return name


def cascade_gather_bytes(tokens: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, kv_itemsize: int) -> int:
    """The cascade's transient K/V for one chunk whose prompt reaches `tokens` positions: the gathered prefix and
    chunk of K and V in the compute dtype, plus the gather itself where the cache's element is smaller (an FP8
    cache is gathered, then widened)."""
    per_token = 2 * num_kv_heads * head_dim
    gathered = per_token * kv_itemsize if kv_itemsize != dtype.itemsize else 0
    return tokens * (per_token * dtype.itemsize + gathered)


# attention(q [1, H, Lq, d], k [1, Hkv, Lk, d], v [1, Hkv, Lk, d], causal) -> (out [1, H, Lq, d] in q's dtype,
# lse [1, H, Lq] float32, natural log of the softmax denominator of the scaled scores). Hkv divides H: query head
# h reads KV head h // (H / Hkv) (GQA). causal: Lq == Lk, query i sees keys [0, i].
Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, bool], tuple[torch.Tensor, torch.Tensor]]


def repeat_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """k, v with each KV head repeated for its query heads (for an attention that needs as many as q has)."""
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"GQA: {k.shape[1]} KV heads do not divide {q.shape[1]} query heads")
    g = q.shape[1] // k.shape[1]
    return (k, v) if g == 1 else (k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1))


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool):
    """The Attention contract in float32 math (CPU tests)."""
    k, v = repeat_kv(q, k, v)
    s = (q.float() @ k.float().transpose(-1, -2)) / q.shape[-1] ** 0.5  # [1, H, Lq, Lk]
    if causal:
        keep = torch.ones(s.shape[-2:], dtype=torch.bool, device=q.device).tril()
        s = s.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    return (torch.exp(s - lse[..., None]) @ v.float()).to(q.dtype), lse


def cudnn_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool):
    """torch's cuDNN attention: aten::_scaled_dot_product_cudnn_attention(query, key, value, attn_bias,
    compute_log_sumexp, dropout_p, is_causal, return_debug_mask, *, scale) -> (output, logsumexp, ...). Its
    logsumexp is [B, H, L, 1] float32 in recent torch ([B, H, L] in older): reshaped to [B, H, L]. cuDNN reads
    fewer KV heads than query heads itself (seen exact on torch 2.11: results/h100/long_context/call_f/)."""
    out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False)[:2]
    return out, lse.reshape(q.shape[:3])


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool):
    """torch's flash attention: aten::_scaled_dot_product_flash_attention(query, key, value, dropout_p,
    is_causal, return_debug_mask, *, scale) -> (output, logsumexp [B, H, L] float32, ...). K/V repeated to q's
    heads first (torch's flash op is not documented to take fewer)."""
    k, v = repeat_kv(q, k, v)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False)[:2]
    return out, lse.reshape(q.shape[:3])


CASCADE_ATTENTION: dict[str, Attention] = {"cudnn-cascade": cudnn_attention, "flash-cascade": flash_attention}


@dataclass(frozen=True)
class CascadeChunk:
    """A prefill chunk the cascade runs (host ints)."""

    chunk: int  # index among the step's prefill chunks: its row of the prefill block tables
    q_start: int  # its first row among the step's prefill tokens
    q_len: int
    prefix: int  # cached keys before it


def plan_cascade(
    q_lens: list[int], context_lens: list[int], min_prefix: int, takes: Callable[[int, int], bool] | None = None
) -> list[CascadeChunk]:
    """The prefill chunks (q_lens, context_lens: the step's prefill chunks, in order) with a prefix of at least
    min_prefix keys and, where `takes` is given, for which takes(queries, prefix) holds."""
    plan, start = [], 0
    for j, (t, n) in enumerate(zip(q_lens, context_lens)):
        if n - t >= min_prefix and (takes is None or takes(t, n - t)):
            plan.append(CascadeChunk(j, start, t, n - t))
        start += t
    return plan


# cuDNN builds a graph and plan per (queries, keys) shape, ~80 ms for a chunk's two on an H100
# (results/h100/long_context/first_request/): a prompt's last chunk has a length of its own, so without rounding
# nearly every long request paid it. The cuDNN cascade runs at shapes rounded to this many rows (its padding costs
# < 1,024 query rows of the last chunk; the warm-up builds every rounded shape up front). torch's flash attention
# has no per-shape plan: exact shapes.
CASCADE_SHAPE_BUCKET = {"cudnn-cascade": 1024, "flash-cascade": 1}


@dataclass(frozen=True)
class CascadeShape:
    """The dense shapes the cascade runs a chunk of c queries after `prefix` cached keys at, rounded to `bucket`
    rows so that prompts of different lengths meet the same few shapes (bucket 1: the exact shapes):
      split  the prefix part reads keys [0, split): prefix rounded down to the bucket;
      lead   the cached keys [split, prefix) go to the causal part instead, each with a query row in front of the
             chunk's (computed, dropped), so that the causal part stays square: the chunk's query i, at row
             lead + i, sees keys [split, prefix + i] there and [0, split) in the prefix part, as it should;
      side   the causal part's rows: lead + c rounded up (rows past lead + c: zero queries over zero keys);
      rows   the prefix part's query rows per query head: c rounded up (rows past c: zeros, dropped);
      keys   the dense K/V rows both parts read: split + side (rows past prefix + c: zeros)."""

    c: int
    prefix: int
    bucket: int = 1

    @property
    def split(self) -> int:
        return self.prefix // self.bucket * self.bucket

    @property
    def lead(self) -> int:
        return self.prefix - self.split

    @property
    def side(self) -> int:
        return -(-(self.lead + self.c) // self.bucket) * self.bucket

    @property
    def rows(self) -> int:
        return -(-self.c // self.bucket) * self.bucket

    @property
    def keys(self) -> int:
        return self.split + self.side


def cascade_pairs(s: CascadeShape) -> int:
    """Query-key pairs the cascade computes for a chunk at shape s, its padding included: the prefix part's rows
    over the split's keys, and the causal part's square half."""
    return s.rows * s.split + s.side * (s.side + 1) // 2


def paged_pairs(c: int, prefix: int) -> int:
    """Query-key pairs the paged prefill kernel computes for c queries after `prefix` keys (causal in the chunk)."""
    return c * prefix + c * (c + 1) // 2


def cascade_plan_parts(s: CascadeShape) -> list[tuple[str, int, int]]:
    """The attentions whose shapes cuDNN builds a plan for when the cascade runs at shape s: the prefix part
    (rows over split keys; none without a prefix part) and the causal part (side)."""
    parts = [("causal", s.side, s.side)]
    if s.split:
        parts.append(("prefix", s.rows, s.split))
    return parts


@dataclass(frozen=True)
class CascadeCost:
    """`auto`'s choice for one long-prefix chunk: the cascade where it is estimated faster than the paged prefill
    kernel, each at its measured rate over the pairs it computes (the cascade's rounded padding included), plus
    plan_s for each of the cascade's parts at a shape cuDNN has not met (its graph and plan, built in that call).
    So a chunk of a few hundred queries after a long prefix (a chat's next turn with the conversation cached) runs
    the paged kernel: the cascade would compute its rows rounded up to the bucket and build a plan for a new
    prefix length; a long prompt's chunks, at shapes the warm-up built, run the cascade."""

    cascade_tflops: float
    paged_tflops: float
    plan_s: float

    def cascade_s(self, s: CascadeShape, flop_per_pair: float, new_plans: int) -> float:
        return cascade_pairs(s) * flop_per_pair / (self.cascade_tflops * 1e12) + new_plans * self.plan_s

    def paged_s(self, c: int, prefix: int, flop_per_pair: float) -> float:
        return paged_pairs(c, prefix) * flop_per_pair / (self.paged_tflops * 1e12)


# Measured on an H100 (results/h100/long_context/README.md): the cuDNN cascade at 446-587 TFLOPS over 8,192-query
# chunks after 0-123k cached keys, the paged kernel at its best tiling 384-398; cuDNN's first call at a new shape
# 40-50 ms more than the next. Only `auto` asks it: a cascade named by the user runs on every chunk min_prefix lets in.
CUDNN_CASCADE_COST = CascadeCost(cascade_tflops=550.0, paged_tflops=390.0, plan_s=0.045)


def gather_rows(cache: torch.Tensor, block_table: torch.Tensor, n: int, rows: int) -> torch.Tensor:
    """The first n tokens of one sequence in a dense [rows, hkv, d] (rows >= n; the rows past n hold whatever the
    blocks read held: the caller zeroes them)."""
    if rows == n:
        return gather(cache, block_table, n)
    bs = cache.shape[1]
    have, need = -(-n // bs), -(-rows // bs)
    blocks = block_table[:have].long()
    if need > have:  # the first block again, to fill the padding rows in the same gather
        blocks = torch.cat([blocks, blocks[:1].expand(need - have)])
    return cache[blocks].reshape(-1, cache.shape[2], cache.shape[3])[:rows]


def cascade_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    prefix: int,
    attention: Attention,
    out: torch.Tensor | None = None,
    bucket: int = 1,
) -> torch.Tensor:
    """q [c, hq, d]: one chunk at positions [prefix, prefix + c), whose K/V (and its prefix's) are in the cache
    at block_table [W] -> out [c, hq, d] (written in place when given: the step's rows of the chunk); the
    attentions at shapes rounded to `bucket` rows (CascadeShape)."""
    c = q.shape[0]
    n, keys = prefix + c, CascadeShape(c, prefix, bucket).keys
    k = gather_rows(k_cache, block_table, n, keys).to(q.dtype)  # [keys, hkv, d] (an FP8 cache widened)
    v = gather_rows(v_cache, block_table, n, keys).to(q.dtype)
    if keys > n:  # padding rows: zero keys and values (a NaN there would reach real rows as 0 * NaN)
        k[n:].zero_()
        v[n:].zero_()
    return cascade_dense(q, k, v, prefix, attention, out, bucket)


def _rows_at(q: torch.Tensor, start: int, rows: int) -> torch.Tensor:
    """q [c, hq, d] at rows [start, start + c) of a zero [rows, hq, d]."""
    buf = q.new_zeros(rows, *q.shape[1:])
    buf[start : start + q.shape[0]] = q
    return buf


def cascade_dense(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    prefix: int,
    attention: Attention,
    out: torch.Tensor | None,
    bucket: int = 1,
) -> torch.Tensor:
    """The cascade over dense keys: q [c, hq, d] at positions [prefix, prefix + c), k, v [keys, hkv, d]
    contiguous with keys = CascadeShape(c, prefix, bucket).keys, rows past prefix + c zero (the gather's layout:
    the attentions see strided views of it) -> out [c, hq, d]."""
    c, hq, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    s = CascadeShape(c, prefix, bucket)
    if k.shape[0] != s.keys or v.shape[0] != s.keys:
        raise ValueError(f"cascade_dense: {k.shape[0]} key rows for {c} queries after {prefix} keys; want {s.keys}")
    if out is None:
        out = torch.empty_like(q)
    # The causal part, square, GQA (the attention maps each query head to its KV head): keys [split, split + side),
    # the chunk's queries at rows [lead, lead + c)
    qc = q if s.side == c else _rows_at(q, s.lead, s.side)
    kc = k[s.split :].transpose(0, 1)[None]  # [1, hkv, side, d]
    vc = v[s.split :].transpose(0, 1)[None]
    o2, lse2 = attention(qc.transpose(0, 1)[None], kc, vc, True)  # [1, hq, side, d], [1, hq, side]
    o2, lse2 = o2[0, :, s.lead : s.lead + c], lse2[0, :, s.lead : s.lead + c]
    if s.split == 0:
        out.copy_(o2.transpose(0, 1))
        return out
    # The prefix, no mask: GQA without copying the prefix's K/V, the g query heads of a KV head as g*rows rows
    # (exact shapes: a reshape, a view where g is 1; rounded: always a copy, so that every chunk of a rounded shape
    # meets the same strides as the warm-up's, padded or not)
    if bucket == 1:
        qf = q.view(c, hkv, g, d).permute(1, 2, 0, 3).reshape(1, hkv, g * c, d)
    else:
        qf = q.new_empty(hkv, g, s.rows, d)
        qf[:, :, :c] = q.view(c, hkv, g, d).permute(1, 2, 0, 3)
        qf[:, :, c:].zero_()
        qf = qf.view(1, hkv, g * s.rows, d)
    kp = k[: s.split].transpose(0, 1)[None]  # [1, hkv, split, d] (a strided view of the gather)
    vp = v[: s.split].transpose(0, 1)[None]
    o1, lse1 = attention(qf, kp, vp, False)  # [1, hkv, g*rows, d], [1, hkv, g*rows]
    # Both parts merged by their LSE into out, read in the layouts the attentions wrote (one kernel on CUDA)
    merge_into(out, o1[0], lse1[0], o2, lse2, fold=s.rows)
    return out


def chunk_prefixes(chunk: int, max_model_len: int) -> list[int]:
    """The prefixes at which a prompt's chunks after its first start (chunk, 2 chunk, ...), for prompts of up to
    max_model_len - 1 tokens (one position left for the output)."""
    return list(range(chunk, max_model_len - 1, chunk))


def chunk_shapes(chunk: int, max_model_len: int, min_prefix: int, bucket: int) -> list[tuple[int, int]]:
    """(queries, prefix) pairs whose cascades meet every rounded shape (CascadeShape's split, rows, side) that a
    prompt's chunks meet alone in a step (chunks of `chunk` tokens, a last one shorter) at the prefixes
    chunk_prefixes gives from min_prefix on (and prefix 0 where min_prefix is 0), once each (the largest query
    count stands for its shape); and every causal side up to chunk + bucket, the sides a prompt whose first
    < bucket tokens hit the prefix cache meets (its chunks start past a multiple of the chunk: the keys past the
    split go to the causal part). A hit of a bucket or more starts the prefix parts at other splits, not warmed
    (chunk/bucket shapes per split: too many to build up front). Bucket 1 (exact shapes): the full chunks only (a
    last chunk's length is the prompt's own)."""
    prefixes = [p for p in chunk_prefixes(chunk, max_model_len) if p >= min_prefix]
    if min_prefix == 0:
        prefixes.insert(0, 0)
    if bucket == 1:
        return [(chunk, p) for p in prefixes if p + chunk <= max_model_len - 1]
    largest: dict[tuple[int, int, int], tuple[int, int]] = {}
    for p in prefixes:
        for c in range(1, min(chunk, max_model_len - 1 - p) + 1):
            s = CascadeShape(c, p, bucket)
            largest[(s.split, s.rows if s.split else 0, s.side)] = (c, p)  # no prefix part: the side alone
    sides = {key[2] for key in largest}
    longest = min(chunk + bucket - 1, max_model_len - 1)  # a chunk after < bucket cached keys
    for side in range(bucket, -(-longest // bucket) * bucket + 1, bucket):
        if side not in sides:  # the causal part alone (prefix 0) at this side
            largest[(0, 0, side)] = (side, 0)
    return list(largest.values())


def warm_chunk_shapes(
    attention: Attention,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
    shapes: list[tuple[int, int]],
    bucket: int,
) -> None:
    """Run the cascade once at each (queries, prefix) of `shapes` (zeros; the result is dropped), so that the
    attention's per-shape first-call cost (cuDNN: a graph and plan per shape) is paid here and not by a request.
    The same strided views as a request's: the parts read dense K and V allocated apart as a request's gathers
    are, once at the largest (the caching allocator then holds blocks that a request's gathers fit in)."""
    if not shapes:
        return
    most = max(CascadeShape(c, p, bucket).keys for c, p in shapes)
    k = torch.zeros(most, num_kv_heads, head_dim, dtype=dtype, device=device)
    v = torch.zeros_like(k)
    q = torch.zeros(max(c for c, _ in shapes), num_heads, head_dim, dtype=dtype, device=device)
    out = torch.empty_like(q)
    for c, p in shapes:
        keys = CascadeShape(c, p, bucket).keys
        cascade_dense(q[:c], k[:keys], v[:keys], p, attention, out[:c], bucket)


def attend_long_chunks(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    plan: list[CascadeChunk],
    attention: Attention,
    out: torch.Tensor,
    bucket: int = 1,
) -> None:
    """q, out [T, hq, d]: the step's prefill tokens; the rows of each planned chunk of out get its cascade
    (block_tables [P, W]: the prefill chunks'), at shapes rounded to `bucket` rows."""
    for ch in plan:
        rows = slice(ch.q_start, ch.q_start + ch.q_len)
        cascade_prefill(q[rows], k_cache, v_cache, block_tables[ch.chunk], ch.prefix, attention, out[rows], bucket)
