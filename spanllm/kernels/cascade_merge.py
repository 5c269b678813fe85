"""The cascade prefill's merge (spanllm.attention.cascade) in one pass (Triton): two attentions of a chunk's
queries, over its cached prefix (o1, lse1) and over its own keys (o2, lse2), combined by their log-sum-exp and
written in the model dtype straight into the step's output rows:

    m = max(lse1, lse2),  w1 = exp(lse1 - m),  w2 = exp(lse2 - m)
    out[r, h] = (w1 o1[r, h] + w2 o2[r, h]) / (w1 + w2)

Each part is read where its attention left it: the prefix part in the GQA-folded layout that the cascade gives
cuDNN (the g query heads of a KV head as g*f rows, f >= c of them per query head, the first c real: o1
[hkv, g*f, d], lse1 [hkv, g*f]), the chunk's part per query head (o2 [hq, c, d], lse2 [hq, c]). In torch the same
merge is ~10 kernels over float32 copies of both outputs plus the permutes back to [c, hq, d]; on a 111k-token
prefill on an H100 those took ~0.35 s of device time (results/h100/long_context/README.md, "other").

`merge_into_reference` is the same math in torch (the CPU path); the kernel rounds once, at the store.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU torch wheel comes without Triton
    triton = None

from spanllm.kernels import interpreter
from spanllm.kernels.pdl import launch_options


def merge_into_reference(
    out: torch.Tensor,
    o1: torch.Tensor,
    lse1: torch.Tensor,
    o2: torch.Tensor,
    lse2: torch.Tensor,
    fold: int | None = None,
) -> None:
    """out [c, hq, d] <- the merge of o1 [hkv, g*f, d], lse1 [hkv, g*f] (the prefix part, GQA-folded, f = fold
    rows per query head, default c, the first c of them real) and o2 [hq, c, d], lse2 [hq, c] (the chunk's own
    keys), in float32, rounded once to out's dtype."""
    c, hq, d = out.shape
    hkv = o1.shape[0]
    g = hq // hkv
    f = c if fold is None else fold
    o1 = o1.reshape(hkv, g, f, d)[:, :, :c].permute(2, 0, 1, 3).reshape(c, hq, d)
    lse1 = lse1.reshape(hkv, g, f)[:, :, :c].permute(2, 0, 1).reshape(c, hq)
    o2, lse2 = o2.transpose(0, 1), lse2.transpose(0, 1)
    m = torch.maximum(lse1, lse2)
    w1, w2 = torch.exp(lse1 - m)[..., None], torch.exp(lse2 - m)[..., None]
    out.copy_((w1 * o1.float() + w2 * o2.float()) / (w1 + w2))


if triton is not None:
    from spanllm.kernels.pdl import wait_then_release

    @triton.jit
    def _merge_kernel(
        out_ptr,
        o1_ptr,
        lse1_ptr,
        o2_ptr,
        lse2_ptr,
        c,
        fold,
        G,
        s_out_r,
        s_out_h,
        s_o1_h,
        s_o1_r,
        s_l1_h,
        s_l1_r,
        s_o2_h,
        s_o2_r,
        s_l2_h,
        s_l2_r,
        D: tl.constexpr,
        BLOCK_R: tl.constexpr,
        PDL: tl.constexpr,
    ):
        wait_then_release(PDL)
        # one program: BLOCK_R rows of one query head h (KV head h // G, its (h % G)-th query head). Offsets in
        # int64: a chunk's c x hq x d outputs pass 2^31 elements from c = 2^19 at 32 heads of 128.
        h = tl.program_id(1).to(tl.int64)
        rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
        ok = rows < c
        cols = tl.arange(0, D)
        kv = h // G
        r1 = (h % G) * fold + rows  # the row of the folded prefix part
        lse1 = tl.load(lse1_ptr + kv * s_l1_h + r1 * s_l1_r, mask=ok, other=0.0)
        lse2 = tl.load(lse2_ptr + h * s_l2_h + rows * s_l2_r, mask=ok, other=0.0)
        m = tl.maximum(lse1, lse2)
        w1 = tl.exp(lse1 - m)
        w2 = tl.exp(lse2 - m)
        o1 = tl.load(o1_ptr + kv * s_o1_h + r1[:, None] * s_o1_r + cols[None, :], mask=ok[:, None], other=0.0)
        o2 = tl.load(o2_ptr + h * s_o2_h + rows[:, None] * s_o2_r + cols[None, :], mask=ok[:, None], other=0.0)
        acc = w1[:, None] * o1.to(tl.float32) + w2[:, None] * o2.to(tl.float32)
        acc = acc / (w1 + w2)[:, None]
        ptrs = out_ptr + rows[:, None] * s_out_r + h * s_out_h + cols[None, :]
        tl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=ok[:, None])


def merge_into(
    out: torch.Tensor,
    o1: torch.Tensor,
    lse1: torch.Tensor,
    o2: torch.Tensor,
    lse2: torch.Tensor,
    fold: int | None = None,
) -> None:
    """out [c, hq, d] <- the merge (shapes as `merge_into_reference`); the kernel on CUDA (and under the
    interpreter), the reference elsewhere. Each tensor's last dimension must be contiguous (the attentions'
    outputs are); any other strides are taken as they are."""
    c, hq, d = out.shape
    hkv = o1.shape[0]
    f = c if fold is None else fold
    if hq % hkv or f < c or o1.shape != (hkv, hq // hkv * f, d) or o2.shape != (hq, c, d):
        raise ValueError(
            f"merge_into: shapes out {tuple(out.shape)}, o1 {tuple(o1.shape)}, o2 {tuple(o2.shape)}, fold {fold}"
        )
    if lse1.shape != o1.shape[:2] or lse2.shape != o2.shape[:2]:
        raise ValueError(f"merge_into: lse shapes {tuple(lse1.shape)}, {tuple(lse2.shape)} do not match the outputs")
    if not interpreter.runs_kernels(out) or d & (d - 1) or any(t.stride(-1) != 1 for t in (out, o1, o2)):
        merge_into_reference(out, o1, lse1, o2, lse2, f)
        return
    block_r = 32
    grid = (triton.cdiv(c, block_r), hq)
    _merge_kernel[grid](
        out,
        o1,
        lse1,
        o2,
        lse2,
        c,
        f,
        hq // hkv,
        out.stride(0),
        out.stride(1),
        o1.stride(0),
        o1.stride(1),
        lse1.stride(0),
        lse1.stride(1),
        o2.stride(0),
        o2.stride(1),
        lse2.stride(0),
        lse2.stride(1),
        D=d,
        BLOCK_R=block_r,
        num_warps=4,
        **launch_options(out.device),
    )
