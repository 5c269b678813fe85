"""The untimed warm-up (spanllm.engine.warmup): the prefill prompt's length and bounds, and that warming up,
the long prompt included, changes no later request's tokens."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from engine_workers import PROMPTS, engine_config

from spanllm.engine import warmup
from spanllm.engine.llm import LLM
from spanllm.engine.sampler import SamplingParams


def fake_llm(device: str, chunk: int, max_model_len: int, num_blocks: int, block_size: int = 16):
    runner = SimpleNamespace(device=torch.device(device))
    blocks = SimpleNamespace(capacity_tokens=(num_blocks - 1) * block_size)  # block 0 is reserved
    return SimpleNamespace(
        engine_core=SimpleNamespace(runner=runner, blocks=blocks),
        engine=SimpleNamespace(max_num_batched_tokens=chunk),
        max_model_len=max_model_len,
    )


def test_prefill_warmup_len_two_chunks_and_a_tail_within_the_bounds():
    # the 8B serving settings: 16,384-token chunks, 131,072 positions, 26,695 blocks
    assert warmup.prefill_warmup_len(fake_llm("cuda", 16384, 131072, 26695)) == 2 * 16384 + 77
    # max_model_len bounds it (one position left for the output token)
    assert warmup.prefill_warmup_len(fake_llm("cuda", 8192, 12000, 26695)) == 11999
    # half the KV cache bounds it: (1001 - 1) blocks x 16 = 16,000 tokens, half 8,000
    assert warmup.prefill_warmup_len(fake_llm("cuda", 4096, 131072, 1001)) == 8000
    # bounds that leave no more than one chunk: no prefill warm-up
    assert warmup.prefill_warmup_len(fake_llm("cuda", 8192, 8000, 26695)) == 0
    assert warmup.prefill_warmup_len(fake_llm("cuda", 8192, 131072, 1025)) == 0
    # off a GPU: none
    assert warmup.prefill_warmup_len(fake_llm("cpu", 16384, 131072, 26695)) == 0


def test_cpu_engine_warms_up_without_the_long_prompt():
    llm = LLM("tiny", engine_config())
    out = warmup.warm_up(llm)
    assert out["prefill_warmup_tokens"] == 0 and out["graph_buckets"] == []


def test_warm_up_with_the_long_prompt_changes_no_later_tokens(monkeypatch):
    """The GPU path on the CPU engine (its length forced): the warm-up prompt's two chunks and tail run, stay in
    the prefix cache, and later greedy tokens equal a cold engine's."""
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    cold = [o.output_ids for o in LLM("tiny", engine_config()).generate(PROMPTS, params)]
    llm = LLM("tiny", engine_config())
    chunk = llm.engine.max_num_batched_tokens
    monkeypatch.setattr(warmup, "prefill_warmup_len", lambda _llm: 2 * chunk + warmup.PREFILL_WARMUP_TAIL)
    n = 2 * chunk + 77
    assert warmup.warm_up(llm)["prefill_warmup_tokens"] == n
    sched, blocks = llm.engine_core.scheduler, llm.engine_core.blocks
    assert sched.prefix_cache_queries == 8 + n  # the short request and the long prompt ran
    # the long prompt's full blocks are in the prefix cache (the short request's 8 + 3 computed tokens fill none)
    assert len(blocks.cached) == n // blocks.block_size == 12
    assert [o.output_ids for o in llm.generate(PROMPTS, params)] == cold
    assert sched.prefix_cache_hits == 0  # real prompts share no block with the warm-up's random ids
    # still cached after the later requests: the warm-up prompt again hits all its blocks but the last token's
    llm.generate([warmup._prefill_warmup_prompt(llm, n)], SamplingParams(max_tokens=1, ignore_eos=True))
    assert sched.prefix_cache_hits == (n - 1) // blocks.block_size * blocks.block_size == 192


def test_the_chunk_shapes_warm_first_and_in_the_forwards_pdl_scope(monkeypatch):
    """On a (faked) GPU: the chunk shapes before the long prompt (with their plans known, auto's cascade runs the
    prompt's second chunk as a real prompt's, so its forward kernels compile in the warm-up), each in the PDL scope
    the forward launches in (a kernel's PDL variant is a compile of its own)."""
    from spanllm.kernels import pdl

    cuda = torch.device("cuda")
    order: list = []
    for engine_pdl in (True, False):
        llm = fake_llm("cuda", 64, 1000, 1000)
        llm.pdl = engine_pdl
        llm.engine_core.runner.dtype = torch.bfloat16
        llm.engine_core.runner.capture_all = lambda: order.append("capture") or []
        llm.engine_core.runner.graph_memory_bytes = 0
        llm.engine_core.runner.backend = SimpleNamespace(
            warm_up_prefill=lambda chunk, max_len, dtype: order.append(("shapes", pdl.launch_options(cuda))) or []
        )
        llm.get_tokenizer = lambda: SimpleNamespace(bos_token_id=1)
        llm.config = SimpleNamespace(vocab_size=1000)
        llm.generate = lambda prompts, params=None: order.append(("generate", len(prompts[0]) if prompts else 0))
        order.clear()
        out = warmup.warm_up(llm)
        assert out["prefill_warmup_tokens"] == 2 * 64 + 77
        want_pdl = {"PDL": True, "launch_pdl": True} if engine_pdl else {"PDL": False}
        assert order == [("generate", 8), "capture", ("shapes", want_pdl), ("generate", 2 * 64 + 77)]
        assert pdl.launch_options(cuda) == {"PDL": False}  # the scope closed after
        order.clear()
        warmup.warm_up_worker(llm)  # the other TP ranks: the same order
        assert order == [("generate", 0), "capture", ("shapes", want_pdl), ("generate", 0)]


def test_warm_up_request_fits_a_small_context():
    """The warm-up request (8 prompt tokens, 4 to generate) shrinks to the user's context or KV pool: with
    max_model_len 10 (found by a hostile test: `spanllm serve --max-model-len 10` died on its own warm-up) and
    with a 2-token context; a request of the user's own still runs after it."""
    from spanllm.engine.config import EngineConfig

    for max_len in (10, 2):
        llm = LLM("tiny", EngineConfig(dtype=torch.float32, max_model_len=max_len, num_kv_blocks=64))
        assert warmup.warm_up(llm)["prefill_warmup_tokens"] == 0
        out = llm.generate([[5]], SamplingParams(max_tokens=1, ignore_eos=True))[0]
        assert len(out.output_ids) == 1 and not llm.engine_core.has_unfinished()
