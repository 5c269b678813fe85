"""The sampling features on a GPU against the CPU path: the sampler on the same logits (greedy rows with
penalties, biases and logprobs: the same tokens, counts and logprobs; sampled rows with penalties, biases and
min_p take the one-pass Triton race: the token argmax(softmax(processed / T) / E) picks on the same draws), and
the engine (async scheduling and CUDA graphs on, as served) against the CPU engine. Skipped without CUDA."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("triton")

from serving_workers import SERVE_PROMPTS, serving_config  # noqa: E402

from spanllm.engine import sampler as sampler_mod  # noqa: E402
from spanllm.engine.llm import LLM  # noqa: E402
from spanllm.engine.sampler import BatchSampler, SamplingParams, apply_penalties  # noqa: E402

DEV = torch.device("cuda")
CPU = torch.device("cpu")
VOCAB = 128256


@dataclass
class Req:
    request_id: str
    prompt_ids: list[int]
    output_ids: list[int] = field(default_factory=list)


def _featured(b: int, greedy: bool) -> list[SamplingParams]:
    t = 0.0 if greedy else 0.9
    kinds = [
        dict(frequency_penalty=0.5, presence_penalty=0.25, logprobs=5),
        dict(repetition_penalty=1.3, logit_bias={11: 4.0, 12: -3.0}, logprobs=0),
        dict(min_p=0.05, logit_bias={13: 100.0}),
        dict(presence_penalty=-1.0, repetition_penalty=0.8, min_p=0.1, logprobs=20),
        dict(),  # plain
    ]
    return [SamplingParams(temperature=t, max_tokens=8, **kinds[i % len(kinds)]) for i in range(b)]


def test_greedy_featured_rows_match_the_cpu_path():
    """Six steps of 40 rows on fresh random logits each step: the same tokens on both devices (the processed
    logits are the same elementwise IEEE operations), the same device-side token counts, logprobs equal to
    float32 rounding and the same top ids."""
    b = 40
    g = torch.Generator().manual_seed(0)
    params = _featured(b, greedy=True)
    reqs = [Req(f"r{i}", torch.randint(0, VOCAB, (50,), generator=g).tolist()) for i in range(b)]
    samplers = {CPU: BatchSampler(CPU, seed=1), DEV: BatchSampler(DEV, seed=1)}
    for _ in range(6):
        logits = torch.randn(b, VOCAB, generator=g) * 4
        logits[:, :20] += 8.0  # a few strong tokens, so that penalties and the prompt's tokens matter
        outs = {d: s.sample(logits.clone().to(d), params, [()] * b, [None] * b, reqs) for d, s in samplers.items()}
        tokens = outs[CPU].tokens.tolist()
        assert outs[DEV].tokens.tolist() == tokens
        lp = {d: o.logprobs.token_logprobs(tokens) for d, o in outs.items()}
        for a, c in zip(lp[DEV], lp[CPU]):
            assert (a is None) == (c is None)
            if a is not None:
                assert (
                    a.token_id == c.token_id and abs(a.logprob - c.logprob) < 1e-4
                )  # log-softmax over 128k: float32 sums
                assert [t for t, _ in a.top] == [t for t, _ in c.top]
                assert max((abs(x - y) for (_, x), (_, y) in zip(a.top, c.top)), default=0.0) < 1e-4
    n = samplers[CPU].counts.num_active
    assert n == samplers[DEV].counts.num_active == 24  # 3 of the 5 kinds ask for a penalty, 8 rows each
    assert torch.equal(samplers[DEV].counts.output[:n].cpu(), samplers[CPU].counts.output[:n])
    assert torch.equal(samplers[DEV].counts.prompt[:n].cpu(), samplers[CPU].counts.prompt[:n])


def test_sampled_featured_rows_take_the_one_pass_race_on_the_same_draws():
    assert sampler_mod.race_argmax is not None
    b = 40
    g = torch.Generator(device=DEV).manual_seed(2)
    params = _featured(b, greedy=False)
    reqs = [Req(f"r{i}", [5, 6, 7, i], [8, 8, 9, i + 1]) for i in range(b)]  # output so far: counted at creation
    logits = torch.randn(b, VOCAB, device=DEV, generator=g) * 3
    logits[:, :20] += 6.0
    out = BatchSampler(DEV, seed=5).sample(logits.clone(), params, [()] * b, [None] * b, reqs).tokens
    # the reference, written out: bias, penalties, min_p, then the race on the engine generator's draws
    x = logits.clone()
    for i, p in enumerate(params):
        for t, bias in p.logit_bias:
            x[i, t] += bias
    counts = torch.zeros(b, VOCAB, dtype=torch.int32, device=DEV)
    prompt = torch.zeros(b, VOCAB, dtype=torch.bool, device=DEV)
    for i, r in enumerate(reqs):
        prompt[i, r.prompt_ids] = True
        for t in r.output_ids:
            counts[i, t] += 1

    def col(name):
        return torch.tensor([getattr(p, name) for p in params], device=DEV)

    x = apply_penalties(x, counts, prompt, col("presence_penalty"), col("frequency_penalty"), col("repetition_penalty"))
    temps = col("temperature")
    probs = torch.softmax(x / temps[:, None], dim=-1)
    x = x.masked_fill(probs < probs.amax(dim=-1, keepdim=True) * col("min_p")[:, None], float("-inf"))
    gen = torch.Generator(device=DEV)
    gen.manual_seed(5)
    race = torch.empty_like(x).exponential_(1.0, generator=gen)
    ref = (torch.softmax(x / temps[:, None], dim=-1) / race).argmax(dim=-1)
    score = x / temps[:, None] - race.log()
    for i in (out != ref).nonzero().flatten().tolist():  # only float32 near-ties may differ
        assert abs(score[i, out[i]].item() - score[i, ref[i]].item()) < 1e-4, i
    assert all(out[i].item() == 13 for i in range(2, b, 5))  # +100 forces it
    kept = torch.isfinite(x)
    assert all(kept[i, out[i]] for i in range(b))  # nothing min_p dropped was drawn


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_the_gpu_engine_samples_what_the_cpu_engine_samples(hf_checkpoint, async_scheduling):
    """float32 weights, CUDA graphs on: the greedy featured requests give the CPU engine's tokens (TF32 may be
    on for matmuls: logprobs within 1e-3), and every request's device state is released afterwards."""
    prompts = [SERVE_PROMPTS[i] for i in (0, 3, 4, 1, 2, 5)]
    params = [
        SamplingParams(max_tokens=10, ignore_eos=True, frequency_penalty=0.5, presence_penalty=0.25, logprobs=4),
        SamplingParams(max_tokens=10, ignore_eos=True, repetition_penalty=1.25, logit_bias={7: 3.0}, logprobs=0),
        SamplingParams(max_tokens=10, ignore_eos=True, logit_bias=((201, 100.0),)),
        SamplingParams(max_tokens=10, ignore_eos=True, logprobs=2),
        SamplingParams(max_tokens=10, ignore_eos=True, temperature=0.8, seed=3, min_p=0.1, frequency_penalty=1.0),
        SamplingParams(max_tokens=10, ignore_eos=True),
    ]
    cfg = dict(block_size=16, num_kv_blocks=32)  # the block size the GPU engine tests use
    gpu = LLM(hf_checkpoint[0], serving_config(**cfg, async_scheduling=async_scheduling), device=DEV)
    assert gpu.engine_core.async_scheduling == async_scheduling and gpu.engine_core.runner.use_cuda_graphs
    cpu = LLM(hf_checkpoint[0], serving_config(**cfg, async_scheduling=False), device=CPU)
    got, ref = gpu.generate(prompts, params), cpu.generate(prompts, params)
    for i in (0, 1, 2, 3, 5):  # greedy
        assert got[i].output_ids == ref[i].output_ids, i
        if params[i].logprobs is not None:
            assert [lp.token_id for lp in got[i].logprobs] == got[i].output_ids
            assert [lp.logprob for lp in got[i].logprobs] == pytest.approx(
                [lp.logprob for lp in ref[i].logprobs], abs=1e-3
            )
    assert got[2].output_ids == [201] * 10
    again = gpu.generate(prompts[4:5], params[4:5])[0]
    assert again.output_ids == got[4].output_ids and len(set(got[4].output_ids)) > 1  # seeded: reproducible
    assert gpu.engine_core.sampler.counts.num_active == 0
