"""The sampling features through the serving engine on CPU (LLM.generate and EngineCore, both host loops: sync
and async scheduling), on the small transformers checkpoint: greedy requests with logit_bias and penalties
equal transformers' own generate (SequenceBias / RepetitionPenalty processors) or a step-by-step reference on
its logits (OpenAI's frequency / presence rule); logprobs equal the log-softmax of the logits the sampler got,
exactly, and transformers' within float32 rounding; outputs carry them aligned with the ids; the sampler's
per-request state is released; TP=2 (gloo) gives TP=1's tokens."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from serving_workers import SERVE_PROMPTS, serving_config

from spanllm.engine.engine_core import RequestError
from spanllm.engine.llm import LLM
from spanllm.engine.sampler import SamplingParams, TokenLogprob
from spanllm.launch import launch
from spanllm.model.parallel_dims import ParallelDims


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def llm(hf_checkpoint, request):
    return LLM(hf_checkpoint[0], serving_config(async_scheduling=request.param))


def _hf_generate(model, prompt: list[int], n: int, **kw) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=n,
            eos_token_id=None,
            pad_token_id=0,
            **kw,
        )
    return out[0, len(prompt) :].tolist()


def _hf_last_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, -1].float()


def _hf_additive_reference(model, prompt: list[int], n: int, frequency: float, presence: float) -> list[int]:
    """Greedy, step by step on transformers' logits, OpenAI's rule written out token by token:
    logit[t] -= frequency x count(t in the output) + presence x (t in the output)."""
    out: list[int] = []
    for _ in range(n):
        logits = _hf_last_logits(model, prompt + out)
        for t, c in Counter(out).items():
            logits[t] -= frequency * c + presence
        out.append(int(logits.argmax()))
    return out


FEATURE_PROMPTS = [SERVE_PROMPTS[0], SERVE_PROMPTS[3], SERVE_PROMPTS[4], SERVE_PROMPTS[1], SERVE_PROMPTS[2]]
N = 12


def test_greedy_penalties_and_biases_equal_transformers(llm, hf_checkpoint):
    """One generate call (chunked prefill, 4 sequences at a time) with a request per feature and a plain one."""
    model = hf_checkpoint[2]
    plain_ref = [_hf_generate(model, p, N) for p in FEATURE_PROMPTS]
    repeated = Counter(plain_ref[0]).most_common(1)[0]
    assert repeated[1] >= 3, plain_ref[0]  # the plain greedy output repeats a token: something to penalize
    banned = plain_ref[2][0]
    params = [
        SamplingParams(max_tokens=N, ignore_eos=True, frequency_penalty=0.5, presence_penalty=0.25),
        SamplingParams(max_tokens=N, ignore_eos=True, repetition_penalty=1.25, logit_bias={7: 3.0}),
        SamplingParams(max_tokens=N, ignore_eos=True, logit_bias={banned: -100.0}),
        SamplingParams(max_tokens=N, ignore_eos=True, logit_bias=((201, 100.0),)),
        SamplingParams(max_tokens=N, ignore_eos=True),
    ]
    outs = [o.output_ids for o in llm.generate(FEATURE_PROMPTS, params)]
    assert outs[0] == _hf_additive_reference(model, FEATURE_PROMPTS[0], N, 0.5, 0.25)
    assert outs[0].count(repeated[0]) < repeated[1]  # the frequency penalty stops the repeated token
    assert outs[1] == _hf_generate(model, FEATURE_PROMPTS[1], N, repetition_penalty=1.25, sequence_bias={(7,): 3.0})
    assert outs[1] != plain_ref[1]
    assert outs[2] == _hf_generate(model, FEATURE_PROMPTS[2], N, sequence_bias={(banned,): -100.0})
    assert banned not in outs[2]
    assert outs[3] == [201] * N
    assert outs[4] == plain_ref[4]
    assert llm.engine_core.sampler.counts.num_active == 0  # every request's token counts released


def _record_logprobs(monkeypatch, core) -> dict[str, list[torch.Tensor]]:
    """request id -> the log-softmax of each step's logits as the sampler received them."""
    seen: dict[str, list[torch.Tensor]] = {}
    real = core.sampler.sample

    def recording(logits, params, stop_masks, generators, requests=None):
        lsm = torch.log_softmax(logits, dim=-1)
        for row, seq in enumerate(requests):
            seen.setdefault(seq.request_id, []).append(lsm[row])
        return real(logits, params, stop_masks, generators, requests)

    monkeypatch.setattr(core.sampler, "sample", recording)
    return seen


def test_logprobs_equal_the_log_softmax_of_the_logits(llm, hf_checkpoint, monkeypatch):
    """Greedy, sampled, penalized: each token's logprob and top-k are the log-softmax of the logits the sampler
    got (exactly; raw: before bias, penalty and temperature), and transformers' within float32 rounding."""
    model = hf_checkpoint[2]
    core = llm.engine_core
    seen = _record_logprobs(monkeypatch, core)
    params = [
        SamplingParams(max_tokens=N, ignore_eos=True, logprobs=5),
        SamplingParams(max_tokens=N, ignore_eos=True, logprobs=0, temperature=0.8, seed=3),
        SamplingParams(max_tokens=N, ignore_eos=True, logprobs=20, frequency_penalty=1.0, logit_bias={9: 5.0}),
        SamplingParams(max_tokens=N, ignore_eos=True),
    ]
    outs = llm.generate(FEATURE_PROMPTS[:4], params)
    assert outs[0].output_ids == _hf_generate(model, FEATURE_PROMPTS[0], N)
    for out, p in zip(outs[:3], params):
        assert len(out.logprobs) == len(out.output_ids) == N
        for i, (tok, lp) in enumerate(zip(out.output_ids, out.logprobs)):
            ref = seen[out.request_id][i]
            assert isinstance(lp, TokenLogprob) and lp.token_id == tok
            assert lp.logprob == ref[tok].item()
            top = ref.topk(p.logprobs)
            assert lp.top == tuple(zip(top.indices.tolist(), top.values.tolist()))
    for i, (tok, lp) in enumerate(zip(outs[0].output_ids, outs[0].logprobs)):
        hf = torch.log_softmax(_hf_last_logits(model, FEATURE_PROMPTS[0] + outs[0].output_ids[:i]), dim=-1)
        assert abs(lp.logprob - hf[tok].item()) < 1e-4 and lp.top[0][0] == tok  # greedy: its token is the top one
    assert outs[3].logprobs is None and outs[3].new_logprobs is None


def test_streamed_outputs_carry_logprobs_aligned_with_new_ids(llm):
    core = llm.engine_core
    asks = core.add_request(SERVE_PROMPTS[0], SamplingParams(max_tokens=8, ignore_eos=True, logprobs=2))
    plain = core.add_request(SERVE_PROMPTS[1], SamplingParams(max_tokens=8, ignore_eos=True))
    pen = core.add_request(SERVE_PROMPTS[2], SamplingParams(max_tokens=8, ignore_eos=True, presence_penalty=1.0))
    streamed: dict[str, list] = {asks.request_id: [], plain.request_id: []}
    for _ in range(5):
        for out in core.step():
            if out.request_id == asks.request_id:
                assert len(out.new_logprobs) == len(out.new_ids) == 1
                assert out.new_logprobs[0].token_id == out.new_ids[0] and len(out.new_logprobs[0].top) == 2
                streamed[asks.request_id] += out.new_logprobs
                assert out.logprobs == streamed[asks.request_id]
            elif out.request_id == plain.request_id:
                assert out.new_logprobs is None and out.logprobs is None
    assert core.sampler.counts.num_active == 1  # the penalized request's counts
    aborted = core.abort_request(asks.request_id)
    assert aborted.new_ids == [] and aborted.new_logprobs == [] and aborted.logprobs == streamed[asks.request_id]
    core.abort_request(plain.request_id)
    core.abort_request(pen.request_id)
    while core.has_unfinished():
        core.step()
    assert core.sampler.counts.num_active == 0 and not core._logprobs


def test_a_seeded_penalized_request_samples_the_same_whatever_shares_its_batch(llm):
    p = SamplingParams(
        temperature=1.0, seed=42, max_tokens=10, ignore_eos=True, frequency_penalty=0.7, min_p=0.02, logprobs=1
    )
    other = SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True, presence_penalty=0.5)
    alone = llm.generate([[5, 6, 7]], p)[0]
    crowd = llm.generate([[9, 9], [5, 6, 7], list(range(20, 40))], [other, p, other])[1]
    assert crowd.output_ids == alone.output_ids
    # the logits themselves differ in the last bits with the batch's shape (the forward's reductions)
    assert [lp.logprob for lp in crowd.logprobs] == pytest.approx([lp.logprob for lp in alone.logprobs], abs=1e-5)
    assert len(set(alone.output_ids)) > 1


@pytest.mark.parametrize(
    "params,match",
    [
        (SamplingParams(max_tokens=4, logit_bias={250: 1.0}), r"logit_bias names token 250, outside the vocabulary"),
        (SamplingParams(max_tokens=4, top_k=251), r"top_k=251 exceeds the vocabulary of 250 tokens"),
        (  # every token forbidden until min_tokens: nothing could be sampled
            SamplingParams(max_tokens=4, min_tokens=2, stop_token_ids=list(range(250)) * 2),
            r"stop_token_ids with the EOS ids cover all 250 tokens of the vocabulary and min_tokens=2 forbids them",
        ),
    ],
)
def test_ids_beyond_the_vocabulary_are_refused_at_admission(llm, params, match):
    with pytest.raises(RequestError, match=match):
        llm.generate([[1, 2, 3]], params)
    assert not llm.engine_core.has_unfinished()
    assert len(llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, top_k=250, temperature=1.0))[0].output_ids)


def test_a_top_k_beyond_int32_is_refused_by_the_parameters():
    with pytest.raises(ValueError, match=r"top_k=100000000000000000000 and max_tokens=4 must be <= 2147483647"):
        SamplingParams(max_tokens=4, top_k=10**20)


TP_PARAMS = [
    SamplingParams(max_tokens=N, ignore_eos=True, frequency_penalty=0.5, presence_penalty=0.25, logprobs=3),
    SamplingParams(max_tokens=N, ignore_eos=True, repetition_penalty=1.25, logit_bias={7: 3.0}),
    SamplingParams(max_tokens=N, ignore_eos=True, logprobs=0),
]


def _tp_generate(ctx, checkpoint: str):
    llm = LLM(checkpoint, serving_config(), dims=ParallelDims(ctx.world_size, 1, ctx.world_size))
    outs = llm.generate(FEATURE_PROMPTS[:3], TP_PARAMS)
    if ctx.rank != 0:
        return None
    return [(o.output_ids, [(lp.logprob, lp.top) for lp in o.logprobs or []]) for o in outs]


def test_tp2_samples_on_rank_0_what_tp1_samples(hf_checkpoint):
    """Only rank 0 samples (its token counts and logprobs stay there); the other rank needs nothing new."""
    tp2 = launch(_tp_generate, hf_checkpoint[0], nprocs=2)[0]
    tp1 = LLM(hf_checkpoint[0], serving_config()).generate(FEATURE_PROMPTS[:3], TP_PARAMS)
    for (ids, lps), ref in zip(tp2, tp1):
        assert ids == ref.output_ids
        for (lp, top), r in zip(lps, ref.logprobs or []):
            assert abs(lp - r.logprob) < 1e-5 and [t for t, _ in top] == [t for t, _ in r.top]


def test_a_temperature_below_vllms_epsilon_is_greedy(llm, hf_checkpoint):
    """temperature 1e-39 (1 / T overflows float32) samples greedily, as vLLM does below 1e-5."""
    out = llm.generate([SERVE_PROMPTS[0]], SamplingParams(max_tokens=N, ignore_eos=True, temperature=1e-39))[0]
    assert out.output_ids == _hf_generate(hf_checkpoint[2], SERVE_PROMPTS[0], N)
