"""Scoring a fixed text with the engine: the logits of every position, and the text's log-likelihood.

What a quality check of a numerical change needs (FP8 against bf16, a kernel against its reference): the same
tokens through the engine's own runner and paged KV cache, every row's logits asked for (a generation step asks
for the last row only). `chunk` cuts the prompt into prefill steps of at most that many tokens, each attending to
the chunks before it in the cache, so a check can pick the GEMM sizes it exercises (spanllm.layers.fp8 runs W8A16
at <= 16 rows, and up to 128 where its measured table says so; W8A8 above).
"""

from __future__ import annotations

import numpy as np
import torch

from spanllm.engine.sampler import SamplingParams


@torch.no_grad()
def prompt_logits(llm, ids: list[int], chunk: int | None = None) -> torch.Tensor:
    """Logits [len(ids), vocab] float32 of every position of one prompt (single process: TP = PP = 1 or every
    rank calling it alike). The sequence's blocks come from (and go back to) the engine's block manager."""
    from spanllm.engine.core.sequence import Sequence
    from spanllm.engine.worker.model_runner import plan_step

    if not ids:
        raise ValueError("prompt_logits: the prompt is empty")
    if chunk is not None and chunk < 1:
        raise ValueError(f"prompt_logits: chunk={chunk} must be >= 1 (or None: one step)")
    core = llm.engine_core
    seq = Sequence("prompt-logits", list(ids), SamplingParams())
    core.blocks.grow(seq, len(ids))
    step = chunk or len(ids)
    out = []
    try:
        for start in range(0, len(ids), step):
            n = min(step, len(ids) - start)
            seq.num_computed = start
            x = plan_step([(seq, n)], 0, core.blocks.block_size)
            x.logits_rows = np.arange(n, dtype=np.int64)
            out.append(core.runner.execute(x).clone())
        seq.num_computed = len(ids)
        return torch.cat(out)
    finally:
        core.blocks.free(seq)


def token_logprobs(logits: torch.Tensor, ids: list[int]) -> torch.Tensor:
    """log p(ids[i+1] | ids[:i+1]) for i in [0, len(ids) - 1): [len(ids) - 1] float64."""
    lp = torch.log_softmax(logits[:-1].double(), dim=-1)
    return lp.gather(1, torch.tensor(ids[1:]).unsqueeze(1)).squeeze(1)
