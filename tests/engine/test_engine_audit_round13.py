"""Engine audit round 13, through the Python API (LLM, SamplingParams, EngineConfig) on the tiny preset:
- EngineConfig refuses values of the wrong kind by name (a string for a bool was taken as True, a float block count
  crashed in torch, dtype='float32' crashed in the model build), and a random-weight seed whose init overflows;
- a refused prompt of a batch is named by its index;
- invariants no test covered: greedy tokens the same under a pool that fits one request at a time (siblings,
  chunks, preemption, prefix caching, async scheduling); seeded sampling (top-k, top-p, min-p, penalties) equal to
  torch by hand on a direct forward pass's logits, whatever shares the batch; stop ids, EOS and stop strings after
  min_tokens, and the text they leave."""

from __future__ import annotations

import math

import pytest
import torch

from spanllm.engine.config import EngineConfig
from spanllm.engine.engine_core import RequestError
from spanllm.engine.llm import LLM
from spanllm.engine.sampler import SamplingParams
from spanllm.engine.scoring import prompt_logits
from spanllm.errors import UsageError

R = "\ufffd"


def _cfg(**kw) -> EngineConfig:
    base = dict(dtype=torch.float32, block_size=4, max_num_seqs=4, max_num_batched_tokens=16, num_kv_blocks=64,
                max_model_len=128)  # fmt: skip
    return EngineConfig(**{**base, **kw})


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def text_llm(request):
    llm = LLM("tiny", _cfg(async_scheduling=request.param))
    llm.get_tokenizer()
    return llm


def _streamed(llm, params):
    deltas = []
    out = llm.generate(["hello"], params, on_output=lambda o: deltas.append(o.new_text))[0]
    return out, "".join(deltas)


# --- text at the finish ----------------------------------------------------------------------------------------
# Id 247 is the byte 0xF4, a 4-byte character's lead: each one the next makes invalid decodes to U+FFFD; the last one
# starts a character that never completes and gives no text (vLLM's rule; the server's completions follow it).
def test_the_text_is_the_ids_text_up_to_an_incomplete_last_character(text_llm):
    out, streamed = _streamed(text_llm, SamplingParams(max_tokens=3, ignore_eos=True))
    assert (out.output_ids, out.finish_reason, out.text, streamed) == ([247] * 3, "length", R * 2, R * 2)


def test_a_stop_id_or_eos_leaves_no_text(text_llm):
    params = SamplingParams(max_tokens=5, logit_bias={7: 100.0}, stop_token_ids=[7], min_tokens=2)
    out, streamed = _streamed(text_llm, params)
    assert (out.output_ids, out.finish_reason, out.stop_reason, out.text, streamed) == ([247, 247, 7], "stop", 7, R, R)
    out, streamed = _streamed(text_llm, SamplingParams(max_tokens=6, logit_bias={2: 100.0}, min_tokens=3))
    assert (out.output_ids, out.finish_reason, out.stop_reason, out.text) == ([247, 247, 247, 2], "stop", None, R * 2)


def test_stop_strings_wait_for_min_tokens_and_cut_the_text(text_llm):
    params = SamplingParams(max_tokens=6, logit_bias={100: 100.0}, stop=["aa"], min_tokens=2)
    out, streamed = _streamed(text_llm, params)
    assert (out.output_ids, out.finish_reason, out.stop_reason) == ([100, 100], "stop", "aa")
    assert out.text == streamed == ""


# --- EngineConfig ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kw,match",
    [
        ({"enable_prefix_caching": "no"}, r"enable_prefix_caching='no' must be True or False"),  # was taken as True
        ({"cuda_graphs": 1}, r"cuda_graphs=1 must be True or False"),
        ({"async_scheduling": "off"}, r"async_scheduling='off' must be None \(auto\), True or False"),
        ({"num_kv_blocks": 2.5}, r"num_kv_blocks=2\.5 must be an integer >= 2"),  # was TypeError in torch.zeros
        ({"num_kv_blocks": True}, r"num_kv_blocks=True must be an integer >= 2"),
        ({"cpu_kv_cache_bytes": 0}, r"cpu_kv_cache_bytes=0 must be a positive integer"),
        ({"cpu_kv_cache_bytes": 1.5}, r"cpu_kv_cache_bytes=1\.5 must be a positive integer"),
        ({"block_size": True}, r"block_size=True must be a positive integer"),  # was a pool of 1-token blocks
        ({"min_admit": 0}, r"min_admit=0 must be a positive integer"),  # was refused only when the engine built
        ({"seed": 1.5}, r"seed=1\.5 must be an integer in \[-2\*\*63, 2\*\*63 - 1\] \(int64\)"),
        ({"seed": 2**63}, r"seed=9223372036854775808 must be an integer in"),
        ({"gpu_memory_utilization": "a"}, r"gpu_memory_utilization='a' must be a number in \(0, 1\]"),  # TypeError
        ({"dtype": "int8"}, r"dtype='int8' is not a model dtype: give torch\.float32, torch\.bfloat16 or"),
        ({"dtype": torch.int8}, r"dtype=torch\.int8 is not a model dtype"),  # was NotImplementedError in the init
    ],
)
def test_engine_config_refuses_values_of_the_wrong_kind(kw, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(**kw)


def test_engine_config_takes_dtype_names():
    """vLLM's dtype='float32' (was: TypeError 'empty(): argument dtype must be torch.dtype' in the model build)."""
    assert (EngineConfig(dtype="float32").dtype, EngineConfig(dtype="bf16").dtype) == (torch.float32, torch.bfloat16)
    llm = LLM("tiny", _cfg(dtype="float32"))
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, ignore_eos=True))[0]
    assert out.output_ids == [150, 125, 125, 309]


def test_a_random_weight_seed_whose_init_overflows_is_refused():
    match = (
        r"seed=4611686018427387904: the random weights of tiny draw from seed x 1,000,003 \+ rank, which must fit "
        r"int64; give a seed in \[-9223344366821, 9223344366820\]"
    )
    with pytest.raises(UsageError, match=match):
        LLM("tiny", _cfg(seed=2**62))  # was ValueError: Overflow when unpacking long long


# --- admission ---------------------------------------------------------------------------------------------------
def test_a_refused_prompt_is_named_by_its_index():
    llm = LLM("tiny", _cfg(max_model_len=8))
    with pytest.raises(RequestError, match=r"^prompt 1: prompt token 1 is 600, outside the vocabulary \[0, 512\)"):
        llm.generate([[5, 6], [5, 600]], SamplingParams(max_tokens=2))
    match = r"^prompt 2: this model's maximum context length is 8 tokens\. However, you requested 9 tokens \(4 in the"
    with pytest.raises(RequestError, match=match):
        llm.generate([[5], [6], [5, 6, 7, 8]], SamplingParams(max_tokens=5))
    out = llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=4, ignore_eos=True))[0]
    assert out.output_ids == [125, 125, 125, 309]
    assert not llm.engine_core.has_unfinished()


# --- invariants --------------------------------------------------------------------------------------------------
P25 = list(range(20, 45))
ALONE = {  # greedy, each request alone in a pool of 199 blocks
    25: [66, 326, 494, 378, 66, 326, 494],
    10: [494, 4, 95, 208, 494, 4, 494, 76, 457, 4, 494, 76, 256, 494, 76, 256, 494, 76, 307, 440, 307, 440],
    1: [59, 80, 59, 266, 280, 487, 211, 3, 211, 5, 449, 272, 232] + [273] * 18,
}


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("caching", [True, False], ids=["cached", "uncached"])
def test_a_pool_of_one_request_serves_siblings_and_chunks_exactly(async_scheduling, caching):
    """8 usable blocks of 4 (32 tokens): every request needs up to the whole pool (25 + 7, 10 + 22, 1 + 31)."""
    specs = [(P25, 7), (P25, 7), (P25[:10], 22), (P25, 7), ([9], 31), (P25[:10], 22)]
    want = [ALONE[len(p)] for p, _ in specs]
    cfg = _cfg(
        num_kv_blocks=9,
        async_scheduling=async_scheduling,
        enable_prefix_caching=caching,
        long_prefill_token_threshold=3,
    )
    llm = LLM("tiny", cfg)
    got = llm.generate([p for p, _ in specs], [SamplingParams(max_tokens=m, ignore_eos=True) for _, m in specs])
    assert [o.output_ids for o in got] == want and [o.finish_reason for o in got] == ["length"] * 6
    core = llm.engine_core
    assert core.stats.preemptions > 0 and not core.has_unfinished()
    core.blocks.check([])
    assert core.blocks.num_free == core.blocks.num_usable


def _by_hand(llm, prompt, n, temperature, seed, top_k=0, top_p=1.0, min_p=0.0, presence=0.0, repetition=1.0):
    """The sampler's steps in torch on the logits of a direct forward pass (the race: argmax p / E, E ~ Exp(1))."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        x = prompt_logits(llm, prompt + out)[-1].float()
        seen = torch.zeros_like(x, dtype=torch.bool)
        seen[prompt + out] = True
        x = torch.where(seen, torch.where(x > 0, x / repetition, x * repetition), x)
        out_seen = torch.zeros_like(seen)
        out_seen[out] = True
        x = (x - presence * out_seen.float()) / temperature
        if min_p:
            p = torch.softmax(x, -1)
            x = x.masked_fill(p < p.max() * min_p, -math.inf)
        if top_k:
            x = x.masked_fill(x < x.sort(descending=True).values[top_k - 1], -math.inf)
        p = torch.softmax(x, -1)
        if top_p < 1.0:
            sp, order = p.sort(descending=True)
            p = torch.zeros_like(p).scatter_(-1, order, sp.masked_fill(sp.cumsum(-1) - sp > top_p, 0.0))
        out.append(int((p / torch.empty_like(p).exponential_(1.0, generator=g)).argmax()))
    return out


@pytest.mark.parametrize(
    "kw",
    [
        dict(temperature=1.0),
        dict(temperature=2.0, top_k=5, top_p=0.5),
        dict(temperature=0.7, min_p=0.5),
        dict(temperature=1.0, presence_penalty=1.5, repetition_penalty=1.8),
    ],
    ids=["plain", "top_k_top_p", "min_p", "penalties"],
)
def test_seeded_sampling_equals_torch_by_hand_whatever_shares_the_batch(kw):
    llm = LLM("tiny", _cfg(num_kv_blocks=24))
    prompt = [5, 6, 7, 5, 9]
    params = SamplingParams(max_tokens=6, ignore_eos=True, seed=11, **kw)
    others = SamplingParams(max_tokens=9, ignore_eos=True, temperature=1.0)
    keys = ("top_k", "top_p", "min_p", "presence_penalty", "repetition_penalty")
    hand = _by_hand(
        llm, prompt, 6, kw["temperature"], 11, *(kw.get(k, d) for k, d in zip(keys, (0, 1.0, 0.0, 0.0, 1.0)))
    )
    batch = llm.generate([list(range(30, 60)), prompt, [9, 10], prompt], [others, params, others, params])
    assert batch[1].output_ids == batch[3].output_ids == hand
    assert llm.generate([prompt], params)[0].output_ids == hand
