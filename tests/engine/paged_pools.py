"""Paged K/V pools for the attention tests: shuffled blocks, and holes that read as NaN."""

from __future__ import annotations

import math

import torch


def poisoned_paged_pool(ctx: list[int], block: int, hkv: int, d: int, seed: int, spikes: bool = False):
    """A shuffled pool holding one sequence per context length; block 0 unused, and one extra block of NaNs that
    every unused table entry (a hole: past a sequence's blocks) points at. spikes: a few late keys with large
    scores, so the running maximum grows by more than the lazy rescale's threshold mid-sequence."""
    g = torch.Generator().manual_seed(seed)
    nblk = [-(-c // block) for c in ctx]
    poison = sum(nblk) + 1
    kc = torch.randn(poison + 1, block, hkv, d, generator=g)
    vc = torch.randn(poison + 1, block, hkv, d, generator=g)
    kc[poison] = float("nan")
    vc[poison] = float("nan")
    tables = torch.full((len(ctx), max(nblk) + 3), poison, dtype=torch.int32)
    perm = (torch.randperm(poison - 1, generator=g) + 1).to(torch.int32)
    i = 0
    for r, nb in enumerate(nblk):
        tables[r, :nb] = perm[i : i + nb]
        i += nb
    if spikes:
        flat = kc[1:poison].view(-1, hkv, d)
        idx = torch.randint(0, flat.shape[0], (max(1, flat.shape[0] // 200),), generator=g)
        flat[idx] *= 12.0
    return kc, vc, tables


def fp8_dots_reference(q: torch.Tensor, kc, vc, tables, ctx: list[int], round_p: bool) -> torch.Tensor:
    """float64 attention as the decode kernel's widen='e4m3' computes it: q scaled by log2(e) / sqrt(d) and
    quantized per (token, head) to e4m3 (the row's largest |value| to 448, in float32 as the kernel does), the
    scores restored by that scale; round_p: each weight exp2(s - max) scaled by 2^8 and rounded to e4m3, the output
    their weighted mean of the values (what the kernel computes where one tile holds every key), else the exact
    weights."""
    d = q.shape[-1]
    qf = q.float() * (math.log2(math.e) / math.sqrt(d))
    q_scale = (qf.abs().amax(-1, keepdim=True) / torch.full_like(qf[..., :1], 448.0)).clamp(min=1e-30)
    q8 = (qf / q_scale).clamp(-448, 448).to(torch.float8_e4m3fn).double()
    hkv = kc.shape[2]
    out = torch.empty(q.shape, dtype=torch.float64)
    for r, n in enumerate(ctx):
        rows = torch.arange(n)
        blk = tables[r, rows // kc.shape[1]].long()
        k = kc[blk, rows % kc.shape[1]].double()  # [n, hkv, d]
        v = vc[blk, rows % kc.shape[1]].double()
        for h in range(q.shape[1]):
            s = (k[:, h // (q.shape[1] // hkv)] @ q8[r, h]) * q_scale[r, h].double()  # log2 units
            p = torch.exp2(s - s.max())
            if round_p:
                p = (p * 256).float().to(torch.float8_e4m3fn).double()
            out[r, h] = (p / p.sum()) @ v[:, h // (q.shape[1] // hkv)]
    return out
