"""Rank functions for the multi-process engine tests (module level so spawned ranks can import them)."""

from __future__ import annotations

import torch

from spanllm.engine.config import EngineConfig
from spanllm.engine.llm import LLM
from spanllm.engine.sampler import SamplingParams
from spanllm.model.parallel_dims import ParallelDims

# 4 query heads / 2 KV heads: TP 2 splits the KV heads, TP 4 replicates them. vocab 250 is not a
# multiple of 4, so the vocab-parallel shards carry padding rows. llama3 rope scaling with a short
# original context so the scaled, blended and unscaled frequency bands are all present.
HF_CONFIG = dict(
    vocab_size=250,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    initializer_range=0.08,
    rope_scaling={
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
    },
    rope_theta=10000.0,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
)

PROMPTS = [[5, 17, 42, 8, 99, 3, 61], [7, 7, 200], [11, 23, 5, 6, 77]]
NEW_TOKENS = 6


def make_hf_model(tie: bool = False):
    import transformers

    cfg = transformers.LlamaConfig(**{**HF_CONFIG, "tie_word_embeddings": tie})
    torch.manual_seed(1234)
    model = transformers.LlamaForCausalLM(cfg).eval()
    return model


class CountingComm:
    """A communicator that counts the all-reduces it is asked for and delegates them."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.name = f"counting({inner.name})"
        self.calls = 0

    def all_reduce_(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.inner.all_reduce_(x)


class CappedComm(CountingComm):
    """A counting communicator with a message limit, like a buffered backend (nvrar): the engine puts the
    group's collective behind it for what exceeds it (spanllm.comm.fallback.SizeFallback)."""

    def __init__(self, inner, max_bytes: int) -> None:
        super().__init__(inner)
        self.name = f"capped({inner.name})"
        self.max_bytes = max_bytes

    def unsupported_reason(self, x: torch.Tensor) -> str | None:
        n = x.numel() * x.element_size()
        return f"{n} bytes exceed {self.max_bytes}" if n > self.max_bytes else None

    def close(self) -> None:
        self.inner.close()


def engine_config(**kw) -> EngineConfig:
    return EngineConfig(**{"dtype": torch.float32, "max_num_seqs": 4, "max_num_batched_tokens": 64, **kw})


def generate(llm: LLM, prompts, new_tokens: int, micro_batches: int = 1) -> dict:
    out = llm.generate_batch(
        prompts, SamplingParams(max_tokens=new_tokens, ignore_eos=True), micro_batches=micro_batches, keep_logits=True
    )
    return {"tokens": out.token_ids, "logits": out.logits}


def count_decode_allreduces(llm: LLM, comm: CountingComm, prompts) -> dict:
    """All-reduces of a prefill and of exactly one decode step (this rank's stage)."""
    comm.calls = 0
    llm.generate_batch(prompts, SamplingParams(max_tokens=1, ignore_eos=True))  # prefill only
    prefill = comm.calls
    comm.calls = 0
    llm.generate_batch(prompts, SamplingParams(max_tokens=2, ignore_eos=True))  # prefill + one decode step
    return {"prefill": prefill, "decode": comm.calls - prefill, "layers": len(llm.model.layer_ids)}


def timed_receives(llm: LLM, prompts, new_tokens: int, micro_batches: int) -> int:
    """Pipeline receives ("idle" regions) made inside timed decode steps by this rank during one generate."""
    count = 0
    region = llm.timers.region

    def counting_region(name: str):
        nonlocal count
        if name == "idle" and llm.timers._in_step:
            count += 1
        return region(name)

    llm.timers.region = counting_region
    try:
        with llm.timed_ops():
            llm.generate_batch(
                prompts, SamplingParams(max_tokens=new_tokens, ignore_eos=True), micro_batches=micro_batches
            )
    finally:
        del llm.timers.region
    return count


def world2(ctx, single: str, sharded: str, prompts, new_tokens: int) -> dict:
    """World 2: TP=2 (both checkpoint layouts, two registered communicators), PP=2 (naive and micro-batched)."""
    from spanllm.comm import create

    res = {}
    llm = LLM(single, engine_config(), allreduce="gloo", device=ctx.device)
    res["tp2"] = generate(llm, prompts, new_tokens)
    res["tp2_allreduce_ran"] = llm.allreduce_ran(len(prompts))
    llm.use_allreduce("ref_ring")  # the CPU reference executor, same weights
    res["tp2_ref_ring"] = generate(llm, prompts, new_tokens)
    # A buffered communicator (a message limit, like nvrar): decode all-reduces ([3, 64] float32, 768 bytes) run on
    # it, prefill ones (15 packed tokens, 3,840 bytes) go to the group's collective (SizeFallback).
    from spanllm.comm.fallback import SizeFallback

    capped = CappedComm(create("gloo"), max_bytes=2048)
    llm.use_allreduce(comm=capped)
    res["tp2_capped"] = generate(llm, prompts, new_tokens)
    res["tp2_capped_swapped"] = isinstance(llm.model.tp.comm, SizeFallback) and llm.model.tp.comm.primary is capped
    capped.calls = 0
    generate(llm, prompts, 3)  # prefill on the fallback; 2 decode steps x 2 all-reduces x layers on capped
    res["tp2_capped_calls"] = (capped.calls, 2 * 2 * len(llm.model.layer_ids))
    llm.close()
    capped.close()

    counting = CountingComm(create("gloo"))
    llm = LLM(sharded, engine_config(), comm=counting, device=ctx.device)
    res["tp2_sharded"] = generate(llm, prompts, new_tokens)
    res["tp2_counts"] = count_decode_allreduces(llm, counting, prompts)

    dims = ParallelDims(tp=1, pp=2, world_size=2)
    llm = LLM(single, engine_config(), dims=dims, device=ctx.device)
    res["pp2"] = generate(llm, prompts, new_tokens)
    res["pp2_mb3"] = generate(llm, prompts, new_tokens, micro_batches=3)
    res["pp2_timed_receives"] = [timed_receives(llm, prompts, new_tokens, m) for m in (1, 3)]
    res["pp2_layers"] = list(llm.model.layer_ids)
    res["pp2_parts"] = (llm.model.model.embed_tokens is not None, llm.model.lm_head is not None)
    return res


def world4(ctx, single: str, prompts, new_tokens: int) -> dict:
    """World 4: TP=4 (KV heads replicated), TP=2 x PP=2 with and without micro-batches, PP=4."""
    from spanllm.comm import create

    res = {}
    counting = CountingComm(create("gloo"))
    llm = LLM(single, engine_config(), comm=counting, device=ctx.device)
    res["tp4"] = generate(llm, prompts, new_tokens)
    res["tp4_counts"] = count_decode_allreduces(llm, counting, prompts)
    qkv = llm.model.model.layers["0"].self_attn.qkv_proj
    res["tp4_kv"] = (qkv.num_kv_heads_local, qkv.kv_head_start)

    llm = LLM(
        single, engine_config(), dims=ParallelDims(2, 2, 4), allreduce="gloo", device=ctx.device, ranks_per_node=2
    )
    res["tp2pp2"] = generate(llm, prompts, new_tokens)
    res["tp2pp2_mb2"] = generate(llm, prompts, new_tokens, micro_batches=2)
    res["tp2pp2_stage"] = (llm.groups.stage, llm.groups.tp_rank, list(llm.model.layer_ids))
    llm.close()

    llm = LLM(single, engine_config(), dims=ParallelDims(1, 4, 4), device=ctx.device)
    res["pp4_mb3"] = generate(llm, prompts, new_tokens, micro_batches=3)
    return res
