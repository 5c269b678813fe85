"""Paged K/V pools for the attention tests: shuffled blocks, and holes that read as NaN."""

from __future__ import annotations

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
