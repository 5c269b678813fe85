"""The real model on the serving engine (module level, so spawned gloo ranks can import it)."""

from __future__ import annotations

import torch

from spanllm.engine.config import EngineConfig
from spanllm.engine.llm import LLM
from spanllm.engine.sampler import SamplingParams
from spanllm.engine.scoring import prompt_logits  # noqa: F401 (the tests import it from here)
from spanllm.model.config import resolve_model
from spanllm.model.parallel_dims import ParallelDims

CHAT_QUESTIONS = (
    "What is the capital of France?",
    "Name the three primary colors.",
    "How many days are there in a week?",
    "Write a haiku about the sea.",
    "What is 12 times 12?",
    "Give me one tip for learning to cook.",
    "Who wrote Romeo and Juliet?",
    "Explain in one sentence what a CPU does.",
)
NEW_TOKENS = 16


def make_llm(model: str, world: int = 1) -> LLM:
    cfg = resolve_model(model)
    return LLM(
        cfg,
        EngineConfig(dtype=torch.float32, max_num_seqs=8, max_model_len=min(1024, cfg.max_position_embeddings)),
        dims=ParallelDims.tp_only(world),
        device=torch.device("cpu"),
    )


def greedy(llm: LLM, prompts: list[list[int]], new_tokens: int = NEW_TOKENS) -> list[list[int]]:
    """Greedy continuations on the serving engine (every rank calls it; rank 0 returns them)."""
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=new_tokens))
    return [list(o.output_ids) for o in outs]


def greedy_rank(ctx, model: str, prompts: list[list[int]], new_tokens: int = NEW_TOKENS):
    llm = make_llm(model, ctx.world_size)
    try:
        out = greedy(llm, prompts, new_tokens)
        return out if ctx.rank == 0 else None
    finally:
        llm.close()


def tokens_rank(ctx, model: str, prompts: list[list[int]], new_tokens: int):
    """Exactly `new_tokens` greedy tokens per prompt (EOS ignored: random weights) at TP = the world size."""
    llm = make_llm(model, ctx.world_size)
    try:
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True))
        return [list(o.output_ids) for o in outs] if ctx.rank == 0 else None
    finally:
        llm.close()
