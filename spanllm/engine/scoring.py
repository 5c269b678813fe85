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
    from spanllm.engine.engine_core import RequestError, token_ids
    from spanllm.engine.worker.model_runner import plan_step

    llm._check_open("prompt_logits")
    if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
        raise RequestError(
            f"prompt_logits: ids={ids!r} ({type(ids).__name__}) is not a list of token ids; encode a text first "
            "(llm.get_tokenizer().encode(text))"
        )
    ids = token_ids(ids)  # numpy / torch integer ids as Python ints
    if not ids:
        raise RequestError("prompt_logits: the prompt is empty; give at least one token id")
    if chunk is not None and (not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 1):
        raise RequestError(f"prompt_logits: chunk={chunk!r} must be an integer >= 1 (or None: one step)")
    vocab = llm.config.vocab_size
    for i, t in enumerate(ids):
        if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab:
            raise RequestError(
                f"prompt_logits: token {i} is {t!r} ({type(t).__name__}), not a token id of the vocabulary "
                f"[0, {vocab}); give ids from 0 to {vocab - 1}"
            )
    core = llm.engine_core
    limit = min(llm.max_model_len, core.blocks.capacity_tokens)
    if len(ids) > limit:
        raise RequestError(
            f"prompt_logits: the prompt has {len(ids)} tokens, more than the {limit} this engine holds (max_model_len "
            f"{llm.max_model_len}, KV cache {core.blocks.capacity_tokens} tokens); score a shorter text"
        )
    seq = Sequence("prompt-logits", list(ids), SamplingParams())
    if not core.blocks.can_grow(seq, len(ids)):
        raise RequestError(
            f"prompt_logits: the prompt needs {core.blocks.blocks_to_grow(seq, len(ids))} KV blocks but "
            f"{core.blocks.num_free} are free (the engine's running requests hold the rest); score when it is idle"
        )
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
    if logits.dim() != 2 or logits.shape[0] != len(ids):
        raise ValueError(
            f"token_logprobs: logits of shape {tuple(logits.shape)} for {len(ids)} ids; give the logits of these ids' "
            f"positions, [{len(ids)}, vocab] (prompt_logits(llm, ids))"
        )
    lp = torch.log_softmax(logits[:-1].double(), dim=-1)
    return lp.gather(1, torch.tensor(ids[1:]).unsqueeze(1)).squeeze(1)
