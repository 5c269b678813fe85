"""Cascade prefill: a prefill chunk with a long cached prefix as two dense attentions merged by their
log-sum-exp, so each part runs on a fused SDPA kernel at its best shape (no mask tensor):

    o1, lse1 = attn(q_chunk, K_prefix, V_prefix)                 every prefix key, no mask
    o2, lse2 = attn(q_chunk, K_chunk, V_chunk, causal=True)      the chunk's own keys, square causal
    out = (exp(lse1 - m) o1 + exp(lse2 - m) o2) / (exp(lse1 - m) + exp(lse2 - m)),  m = max(lse1, lse2)

The keys are gathered from the paged cache (its block table) into dense tensors per chunk per layer. The
Triton backend runs this for the prefill chunks whose prefix is at least `min_prefix` keys (`plan_cascade`),
on CUDA, in eager steps only (the gather's sizes are the step's, not a graph's); the rest of the step keeps
the paged kernels. The attention of each part is one `Attention` function; on CPU the tests use
`reference_attention` (float32 math) through the same code.
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


def plan_cascade(q_lens: list[int], context_lens: list[int], min_prefix: int) -> list[CascadeChunk]:
    """The prefill chunks (q_lens, context_lens: the step's prefill chunks, in order) with a prefix of at least
    min_prefix keys."""
    plan, start = [], 0
    for j, (t, n) in enumerate(zip(q_lens, context_lens)):
        if n - t >= min_prefix:
            plan.append(CascadeChunk(j, start, t, n - t))
        start += t
    return plan


def cascade_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    prefix: int,
    attention: Attention,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [c, hq, d]: one chunk at positions [prefix, prefix + c), whose K/V (and its prefix's) are in the cache
    at block_table [W] -> out [c, hq, d] (written in place when given: the step's rows of the chunk)."""
    c = q.shape[0]
    k = gather(k_cache, block_table, prefix + c).to(q.dtype)  # [prefix + c, hkv, d] (an FP8 cache widened)
    v = gather(v_cache, block_table, prefix + c).to(q.dtype)
    return cascade_dense(q, k, v, prefix, attention, out)


def cascade_dense(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix: int, attention: Attention, out: torch.Tensor | None
) -> torch.Tensor:
    """The cascade over dense keys: q [c, hq, d] at positions [prefix, prefix + c), k, v [prefix + c, hkv, d]
    contiguous (the gather's layout: the attentions see strided views of it) -> out [c, hq, d]."""
    c, hq, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    if out is None:
        out = torch.empty_like(q)
    # The chunk's own keys, square causal, GQA: the attention maps each query head to its KV head.
    kc = k[prefix:].transpose(0, 1)[None]  # [1, hkv, c, d]
    vc = v[prefix:].transpose(0, 1)[None]
    o2, lse2 = attention(q.transpose(0, 1)[None], kc, vc, True)  # [1, hq, c, d], [1, hq, c]
    if prefix == 0:
        out.copy_(o2[0].transpose(0, 1))
        return out
    # The prefix, no mask: GQA without copying the prefix's K/V, the g query heads of a KV head as g*c rows.
    qf = q.view(c, hkv, g, d).permute(1, 2, 0, 3).reshape(1, hkv, g * c, d)
    kp = k[:prefix].transpose(0, 1)[None]  # [1, hkv, prefix, d] (a strided view of the gather)
    vp = v[:prefix].transpose(0, 1)[None]
    o1, lse1 = attention(qf, kp, vp, False)  # [1, hkv, g*c, d], [1, hkv, g*c]
    # Both parts merged by their LSE into out, read in the layouts the attentions wrote (one kernel on CUDA)
    merge_into(out, o1[0], lse1[0], o2[0], lse2[0])
    return out


def full_chunk_prefixes(chunk: int, max_model_len: int) -> list[int]:
    """The prefixes at which a prompt's full chunks of `chunk` tokens run (chunk, 2 chunk, ...): every prompt's
    chunks but its last meet these shapes, whatever its length. A chunk ends at or before max_model_len - 1 (one
    position left for the output)."""
    return list(range(chunk, max_model_len - chunk, chunk))


def warm_full_chunks(
    attention: Attention,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
    chunk: int,
    prefixes: list[int],
) -> None:
    """Run the cascade once at each full chunk's shapes (zeros; the result is dropped), so that the attention's
    per-shape first-call cost (cuDNN: a graph and plan per (queries, keys) shape, ~45 ms on an H100) is paid here
    and not by a request. The same strided views as a request's: the parts read dense [prefix + chunk, hkv, d]
    K and V, allocated apart as a request's gathers are, once at the largest prefix (the caching allocator then
    holds blocks that a request's gathers fit in)."""
    if not prefixes:
        return
    k = torch.zeros(max(prefixes) + chunk, num_kv_heads, head_dim, dtype=dtype, device=device)
    v = torch.zeros_like(k)
    q = torch.zeros(chunk, num_heads, head_dim, dtype=dtype, device=device)
    out = torch.empty_like(q)
    for p in prefixes:
        cascade_dense(q, k[: p + chunk], v[: p + chunk], p, attention, out)


def attend_long_chunks(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    plan: list[CascadeChunk],
    attention: Attention,
    out: torch.Tensor,
) -> None:
    """q, out [T, hq, d]: the step's prefill tokens; the rows of each planned chunk of out get its cascade
    (block_tables [P, W]: the prefill chunks')."""
    for ch in plan:
        rows = slice(ch.q_start, ch.q_start + ch.q_len)
        cascade_prefill(q[rows], k_cache, v_cache, block_tables[ch.chunk], ch.prefix, attention, out[rows])
