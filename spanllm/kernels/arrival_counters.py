"""Arrival counters on the GPU: the int32 array through which a kernel's last program to finish learns it is
the last, so it can merge the others' partial results in the same launch (no second kernel).

Used by the paged decode attention (splits of one sequence's context) and the skinny GEMM (split-K chunks
of one tile of output columns). The protocol, in each kernel: a program stores its partial, a CTA barrier
orders every warp's stores before the one thread that then increments its counter with an acq_rel atomic at
GPU scope (release: the partial is visible before the count); the program that reads count == parts - 1
(acquire: it saw every other increment, so every other partial) loads the partials from L2 (.cg), merges
them in a fixed order (deterministic whichever program came last) and writes 0 back to its counter.

Invariant: every counter is zero between launches. So one array serves every such kernel on a device, as
long as those kernels run one after another: one engine per GPU on one stream (two engines decoding on two
streams of one GPU at once would mix their counts). The array is state across CUDA-graph replays, so a graph
must not own it: it is allocated outside any capture (the warm-up runs before a capture come first); a
larger one replaces it only outside a capture, and the old one stays alive (a captured graph may point at it).
"""

from __future__ import annotations

import torch

MIN_COUNTERS = 1 << 16  # more than a launch here needs (GEMM: N / BLOCK_N, e.g. 4,008 for a 128k vocabulary in
#                        tiles of 32; decode: batch x KV heads)
_counters: dict[torch.device, torch.Tensor] = {}
_outgrown: list[torch.Tensor] = []  # smaller arrays that captured graphs may still point at: never freed


def arrival_counters(device: torch.device, n: int) -> torch.Tensor:
    """At least n zeroed int32 counters on `device`, the same array for every caller on that device."""
    t = _counters.get(device)
    if t is None or t.numel() < n:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"a kernel needs {n} arrival counters but {0 if t is None else t.numel()} exist on "
                f"{device}; run the same call once outside CUDA-graph capture first (a warm-up)"
            )
        if t is not None:
            _outgrown.append(t)
        t = _counters[device] = torch.zeros(max(n, MIN_COUNTERS), dtype=torch.int32, device=device)
    return t


def all_zero(device: torch.device) -> bool:
    """Whether every counter on `device` is back at zero (tests: each merging program reset its own)."""
    t = _counters.get(device)
    return t is None or int(t.abs().sum()) == 0
