"""The exponential race in one pass (GPU, Triton): token = argmax_i p_i / E_i for each row.

With p = softmax(logits / T), p_i / E_i orders the vocabulary as logits_i / T - log E_i does (the softmax's
normalizer is the same for every i of a row, and log is monotonic; in float32 the two orders can differ only
where two tokens' scores agree to ~1e-5, a near-tie), so the kernel reads each row's logits and its draws E
once and never forms the probabilities: three passes over [rows, vocab] float32 (the draws
written by torch's exponential_, then read here with the logits) instead of the ten of the unfused ops
(divide, softmax, divide, argmax). The draws still come from torch generators, so a seeded request keeps its
own stream. Ties: the lowest index wins, as torch.argmax. Rows whose scores are all -inf (every token masked)
give token 0. NaN logits never win here (torch.argmax would return a NaN's index); the engine's are finite.

Used by spanllm.engine.sampler.BatchSampler on CUDA for the rows that sample with a temperature and neither
top-k nor top-p (those need a sort and take the unfused path).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_V = 2048  # vocabulary entries per iteration of a row's program


@triton.jit
def _race_argmax_kernel(logits_ptr, race_ptr, inv_t_ptr, out_ptr, vocab, stride_l, stride_r, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    inv_t = tl.load(inv_t_ptr + row)
    lane = tl.arange(0, BLOCK)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_i = lane  # each lane's earliest index with the best score so far (its own first index while all -inf)
    for start in range(0, vocab, BLOCK):
        offs = start + lane
        ok = offs < vocab
        x = tl.load(logits_ptr + row.to(tl.int64) * stride_l + offs, mask=ok, other=float("-inf"))
        e = tl.load(race_ptr + row.to(tl.int64) * stride_r + offs, mask=ok, other=1.0)
        s = x * inv_t - tl.log(e)
        take = s > best  # strict: a lane keeps its earlier index on a tie
        best = tl.where(take, s, best)
        best_i = tl.where(take, offs, best_i)
    top = tl.max(best, 0)
    idx = tl.min(tl.where(best == top, best_i, vocab), 0)  # the lowest index reaching the row's maximum
    tl.store(out_ptr + row, idx.to(tl.int64))


def race_argmax(logits: torch.Tensor, race: torch.Tensor, inv_temperature: torch.Tensor) -> torch.Tensor:
    """logits, race [B, V] float32 (race: Exp(1) draws), inv_temperature [B] float32 -> [B] int64 tokens."""
    b, v = logits.shape
    if race.shape != logits.shape or logits.dtype != torch.float32 or race.dtype != torch.float32:
        raise ValueError(
            f"race_argmax needs float32 logits and draws of one shape; got {tuple(logits.shape)} "
            f"{logits.dtype} and {tuple(race.shape)} {race.dtype}"
        )
    if logits.stride(1) != 1 or race.stride(1) != 1:
        raise ValueError("race_argmax needs rows contiguous in the vocabulary (stride 1 along dim 1)")
    out = torch.empty(b, dtype=torch.int64, device=logits.device)
    _race_argmax_kernel[(b,)](
        logits, race, inv_temperature, out, v, logits.stride(0), race.stride(0), BLOCK=BLOCK_V, num_warps=8
    )
    return out
