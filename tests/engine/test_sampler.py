"""The serving sampler (spanllm.engine.sampler) on CPU, on synthetic logits: every SamplingParams field's range,
then each feature's effect with exact expectations (penalties against hand-computed values and step sequences,
logit_bias forcing and banning, min_p's cut after temperature, logprobs equal to the log-softmax of the raw
logits), rows with and without the features in one batch, seeded rows. Through the engine: test_sampler_engine.py;
on a GPU: test_sampler_gpu.py."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest
import torch

from spanllm.engine.sampler import (
    BatchSampler,
    SamplingParams,
    SamplingParamsError,
    TokenLogprob,
    apply_penalties,
)

CPU = torch.device("cpu")


@dataclass
class Req:
    """What the sampler reads of a request (an engine Sequence has these)."""

    request_id: str
    prompt_ids: list[int]
    output_ids: list[int] = field(default_factory=list)


def _sample(sampler, logits, params, reqs=None, gens=None):
    b = logits.shape[0]
    return sampler.sample(logits.clone(), params, [()] * b, gens or [None] * b, reqs)


# --- SamplingParams ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kw,match",
    [
        ({"presence_penalty": 2.5}, r"presence_penalty=2\.5 must be a number in \[-2, 2\]"),
        ({"presence_penalty": -2.01}, r"presence_penalty=-2\.01 must be a number in \[-2, 2\]"),
        ({"frequency_penalty": float("nan")}, r"frequency_penalty=nan must be a number in \[-2, 2\]"),
        ({"frequency_penalty": "1"}, r"frequency_penalty='1' must be a number in \[-2, 2\]"),
        ({"repetition_penalty": 0.0}, r"repetition_penalty=0\.0 must be a number in \(0, 2\] \(1 = off\)"),
        ({"repetition_penalty": 2.5}, r"repetition_penalty=2\.5 must be a number in \(0, 2\]"),
        ({"min_p": 1.5}, r"min_p=1\.5 must be a number in \[0, 1\]"),
        ({"min_p": -0.1}, r"min_p=-0\.1 must be a number in \[0, 1\]"),
        ({"logprobs": 21}, r"logprobs=21 must be None \(none\) or an integer in \[0, 20\]"),
        ({"logprobs": -1}, r"logprobs=-1 must be None"),
        ({"logprobs": 2.0}, r"logprobs=2\.0 must be None"),
        ({"logprobs": True}, r"logprobs=True must be None"),
        ({"logit_bias": ((5, 100.5),)}, r"logit_bias\[5\]=100\.5 must be a number in \[-100, 100\]"),
        ({"logit_bias": {7: -101}}, r"logit_bias\[7\]=-101 must be a number in \[-100, 100\]"),
        ({"logit_bias": ((-1, 1.0),)}, r"logit_bias token id -1 must be a non-negative integer"),
        ({"logit_bias": (("5", 1.0),)}, r"logit_bias token id '5' must be a non-negative integer"),
        ({"logit_bias": ((5, 1.0), (5, 2.0))}, r"logit_bias names token 5 twice"),
        ({"logit_bias": (5,)}, r"logit_bias=\(5,\) must be \(token id, bias\) pairs"),
        ({"seed": 2**64}, r"seed=18446744073709551616 must be an integer in \[-2\*\*63, 2\*\*63 - 1\] \(int64\)"),
        ({"seed": -(2**63) - 1}, r"seed=-9223372036854775809 must be an integer in \[-2\*\*63"),
        ({"seed": 1.5}, r"seed=1\.5 must be an integer"),
    ],
)
def test_new_fields_out_of_range_are_refused_naming_field_value_and_range(kw, match):
    with pytest.raises(SamplingParamsError, match=match):
        SamplingParams(**kw)


def test_the_ranges_edges_are_accepted_and_logit_bias_normalized():
    p = SamplingParams(
        presence_penalty=-2,
        frequency_penalty=2.0,
        repetition_penalty=2,
        min_p=1.0,
        logprobs=20,
        seed=-(2**63),
        logit_bias={9: 100, 3: -100.0},
    )
    assert p.logit_bias == ((9, 100.0), (3, -100.0)) and all(isinstance(b, float) for _, b in p.logit_bias)
    assert SamplingParams(logit_bias=[[4, 0.5]]).logit_bias == ((4, 0.5),)
    assert SamplingParams(seed=2**63 - 1, logprobs=0).logprobs == 0
    assert hash(p) == hash(SamplingParams(**{f: getattr(p, f) for f in p.__dataclass_fields__}))
    assert not SamplingParams().penalized and SamplingParams(repetition_penalty=1.1).penalized
    assert SamplingParams(temperature=1.0, top_k=5, seed=3).plain  # the sampler's extra steps: none
    assert not any(
        SamplingParams(**kw).plain
        for kw in ({"logprobs": 0}, {"logit_bias": {1: 0.5}}, {"presence_penalty": 0.1}, {"min_p": 0.1})
    )
    assert SamplingParams(temperature=1e-39).greedy and not SamplingParams(temperature=1e-5).greedy  # vLLM's eps


# --- penalties ----------------------------------------------------------------------------------------------
def test_apply_penalties_matches_hand_computed_values():
    """Row 0: repetition 2 on prompt / output tokens (divide positives, multiply the rest), then frequency 0.5
    x count and presence 0.25 on the output's tokens. Row 1: neutral values leave the logits bit-exact."""
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 0.0], [0.1, -0.3, 7.7, 1e-8, -1e30, 3.3]])
    counts = torch.tensor([[0, 2, 1, 0, 0, 3], [1, 2, 3, 4, 5, 6]], dtype=torch.int32)
    prompt = torch.tensor([[1, 0, 0, 0, 1, 0], [1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    out = apply_penalties(
        logits, counts, prompt, torch.tensor([0.25, 0.0]), torch.tensor([0.5, 0.0]), torch.tensor([2.0, 1.0])
    )
    # token 0: prompt, 2 / 2; token 1: output x2, -1 * 2 - 0.5 * 2 - 0.25; token 2: 0.5 / 2 - 0.5 - 0.25;
    # token 3: untouched; token 4: prompt, -2 * 2; token 5: 0 * 2 - 0.5 * 3 - 0.25
    assert out[0].tolist() == [1.0, -3.25, -0.5, 3.0, -4.0, -1.75]
    assert torch.equal(out[1], logits[1])


def _steps(params: SamplingParams, logits_row: list[float], n: int, prompt: list[int] = (0,)) -> list[int]:
    """n greedy steps of one request on the same logits each step. The request's output_ids are never
    updated: the sampler must count the tokens itself, on the device (what async scheduling relies on)."""
    s = BatchSampler(CPU, seed=0)
    req = Req("r", list(prompt))
    logits = torch.tensor([logits_row])
    return [_sample(s, logits, [params], [req]).tokens.item() for _ in range(n)]


def test_a_frequency_penalty_stops_a_repeated_token():
    """[5, 4, 3], frequency 0.6: token 0 wins until 0.6 x its count exceeds its lead (after 2), then the three
    alternate by their penalized logits: 4.4 > 4, 3.8 < 4, 3.8 > 3.4, 3.2 < 3.4, 3.2 > 3.0, 2.6 < 2.8 < 3.0."""
    assert _steps(SamplingParams(), [5.0, 4.0, 3.0], 7) == [0] * 7
    assert _steps(SamplingParams(frequency_penalty=0.6), [5.0, 4.0, 3.0], 7) == [0, 0, 1, 0, 1, 0, 2]


def test_a_presence_penalty_counts_a_token_once_and_not_the_prompt():
    """presence 1.5 (prompt [0], which it ignores): 0 first; then [3.5, 4, 3] -> 1; then [3.5, 2.5, 3] -> 0 for
    good (it does not grow with the count). A negative one rewards what was said: 3 + 1.5 beats 4 after one 2."""
    assert _steps(SamplingParams(presence_penalty=1.5), [5.0, 4.0, 3.0], 6) == [0, 1, 0, 0, 0, 0]
    assert _steps(SamplingParams(presence_penalty=-1.5), [2.0, 4.0, 3.0], 3) == [1, 1, 1]
    biased = SamplingParams(presence_penalty=-1.5, logit_bias={2: 2.0})  # 3 + 2 > 4: 2 first, then it stays
    assert _steps(biased, [2.0, 4.0, 3.0], 3) == [2, 2, 2]


def test_repetition_penalty_covers_prompt_and_output():
    """repetition 1.5, prompt [0] on [5, 4, 3.5]: 5 / 1.5 = 3.33 < 4 -> 1; then 4 / 1.5 = 2.67 -> 2 (3.5); then
    3.5 / 1.5 = 2.33 and every token is penalized: 3.33 -> 0 for good. A negative logit is multiplied:
    -1 x 1.5 = -1.5 < -1.2."""
    assert _steps(SamplingParams(repetition_penalty=1.5), [5.0, 4.0, 3.5], 5) == [1, 2, 0, 0, 0]
    assert _steps(SamplingParams(repetition_penalty=1.5), [-1.0, -1.2, -5.0], 2, prompt=[0]) == [1, 0]
    assert _steps(SamplingParams(repetition_penalty=1.5), [-1.0, -1.2, -5.0], 2, prompt=[2]) == [0, 1]


def test_a_tiny_repetition_penalty_favours_the_repeated_token_without_nan():
    """repetition 1e-38 (allowed: any value in (0, 2]) divides token 1's logit 5 to 5e38, past float32: capped at
    PENALIZED_LOGIT_MAX, token 1 (in the prompt) wins greedily and at temperature 0.7; an inf would make the
    softmax NaN and the sample arbitrary."""
    from spanllm.engine.sampler import PENALIZED_LOGIT_MAX

    out = apply_penalties(
        torch.tensor([[2.0, 5.0, -3.0]]),
        torch.zeros(1, 3, dtype=torch.int32),
        torch.tensor([[False, True, True]]),
        torch.zeros(1),
        torch.zeros(1),
        torch.tensor([1e-38]),
    )
    # float32: the cap as float32 rounds it, -3 x r in float32
    assert torch.equal(out, torch.tensor([[2.0, PENALIZED_LOGIT_MAX, -3.0]]) * torch.tensor([[1.0, 1.0, 1e-38]]))
    tiny = SamplingParams(repetition_penalty=1e-38)
    assert _steps(tiny, [2.0, 5.0, 3.0], 3, prompt=[1]) == [1, 1, 1]
    s = BatchSampler(CPU, seed=0)
    warm = SamplingParams(repetition_penalty=1e-38, temperature=0.7)
    reqs = [Req(f"r{i}", [1]) for i in range(8)]
    assert _sample(s, torch.tensor([[2.0, 5.0, 3.0]] * 8), [warm] * 8, reqs).tokens.tolist() == [1] * 8


def test_token_counts_persist_per_request_grow_and_are_released():
    """frequency 1.5 on [5, 4, 3]: 0, 1 (3.5 < 4), 0 (3.5 > 2.5, 3), 2 (2 < 2.5 < 3). A request that takes a
    released slot starts from zero counts: 0, 1."""
    s = BatchSampler(CPU, seed=0)
    p = SamplingParams(frequency_penalty=1.5)
    reqs = [Req(f"r{i}", [3]) for i in range(6)]  # 6 slots: the pool grows past its first 4
    logits = torch.tensor([[5.0, 4.0, 3.0, 0.0]] * 6)
    steps = [_sample(s, logits, [p] * 6, reqs).tokens.tolist() for _ in range(2)]
    assert steps == [[0] * 6, [1] * 6]
    assert s.counts.num_active == 6 and s.counts.output.shape[0] == 8
    assert s.counts.output[:6, :3].tolist() == [[1, 1, 0]] * 6
    s.release("r2")
    assert s.counts.num_active == 5
    reqs[2] = Req("new", [3])
    steps = [_sample(s, logits, [p] * 6, reqs).tokens.tolist() for _ in range(2)]
    assert steps == [[0] * 6, [2, 2, 1, 2, 2, 2]]
    assert s.counts.output[2, :3].tolist() == [1, 1, 0]  # the freed slot, reused
    assert s.counts.prompt[:6].nonzero()[:, 1].tolist() == [3] * 6
    with pytest.raises(ValueError, match="rows with a penalty need their requests"):
        _sample(s, logits[:1], [p])


# --- logit_bias and min_p -----------------------------------------------------------------------------------
def test_logit_bias_forces_and_bans_tokens():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(64, 100, generator=g) * 3
    s = BatchSampler(CPU, seed=0)
    force = [SamplingParams(logit_bias={37: 100.0}), SamplingParams(temperature=1.0, logit_bias={37: 100.0})] * 32
    assert _sample(s, logits, force).tokens.tolist() == [37] * 64
    top2 = logits.topk(2, dim=-1).indices
    ban = [SamplingParams(logit_bias={int(top2[i, 0]): -100.0}) for i in range(64)]
    assert _sample(s, logits, ban).tokens.tolist() == top2[:, 1].tolist()
    # a small bias moves the argmax exactly as adding it to the logits does
    small = [SamplingParams(logit_bias=((5, 2.5), (6, -1.0)))] * 64
    ref = logits.clone()
    ref[:, 5] += 2.5
    ref[:, 6] -= 1.0
    assert _sample(s, logits, small).tokens.tolist() == ref.argmax(dim=-1).tolist()


def test_min_p_cuts_the_tail_after_temperature():
    """p = [0.5, 0.3, 0.15, 0.05]. min_p 0.2 at T=1 keeps p >= 0.1: never token 3. At T=2, p ~ sqrt(p):
    token 3 has 0.316 of the top's, so min_p 0.2 keeps it and min_p 0.35 drops it (and keeps token 2, 0.548)."""
    logits = torch.tensor([[math.log(0.5), math.log(0.3), math.log(0.15), math.log(0.05)]]).repeat(4000, 1)
    s = BatchSampler(CPU, seed=0)

    def drawn(**kw) -> set[int]:
        return set(_sample(s, logits, [SamplingParams(**kw)] * 4000).tokens.tolist())

    assert drawn(temperature=1.0) == {0, 1, 2, 3}
    assert drawn(temperature=1.0, min_p=0.2) == {0, 1, 2}
    assert drawn(temperature=2.0, min_p=0.2) == {0, 1, 2, 3}
    assert drawn(temperature=2.0, min_p=0.35) == {0, 1, 2}
    assert drawn(temperature=1.0, min_p=1.0) == {0}
    # only the rows that ask are cut
    mixed = [SamplingParams(temperature=1.0, min_p=0.2), SamplingParams(temperature=1.0)] * 2000
    toks = _sample(s, logits, mixed).tokens
    assert set(toks[0::2].tolist()) == {0, 1, 2} and 3 in toks[1::2].tolist()


# --- logprobs -----------------------------------------------------------------------------------------------
def test_greedy_logprobs_equal_the_log_softmax_of_the_logits_exactly():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(6, 300, generator=g) * 4
    ref = torch.log_softmax(logits, dim=-1)
    params = [
        SamplingParams(logprobs=5),
        SamplingParams(),  # asks for none
        SamplingParams(logprobs=0),
        SamplingParams(logprobs=20, frequency_penalty=1.0, logit_bias={3: 7.0}),  # raw: before bias and penalty
        SamplingParams(logprobs=1, temperature=0.7, seed=4),  # sampled: still the raw logprobs
        SamplingParams(logprobs=3),
    ]
    s = BatchSampler(CPU, seed=0)
    reqs = [Req(f"r{i}", [1, 2, 3]) for i in range(6)]
    out = _sample(s, logits, params, reqs, [None] * 4 + [torch.Generator().manual_seed(4), None])
    tokens = out.tokens.tolist()
    lps = out.logprobs.token_logprobs(tokens)
    assert out.logprobs.rows == [0, 2, 3, 4, 5] and lps[1] is None
    for i in (0, 2, 3, 4, 5):
        k = params[i].logprobs
        lp = lps[i]
        assert isinstance(lp, TokenLogprob) and lp.token_id == tokens[i]
        assert lp.logprob == ref[i, tokens[i]].item()  # exact: the same log-softmax of the same row
        order = ref[i].argsort(descending=True)[:k].tolist()
        assert [t for t, _ in lp.top] == order
        assert [v for _, v in lp.top] == ref[i, order].tolist()
    assert tokens[0] == logits[0].argmax().item() and lps[0].top[0] == (tokens[0], lps[0].logprob)
    assert lps[2].top == ()
    # every row asking: the same values (no gather needed)
    all_rows = _sample(BatchSampler(CPU, seed=0), logits, [SamplingParams(logprobs=2)] * 6)
    lps = all_rows.logprobs.token_logprobs(all_rows.tokens.tolist())
    assert [lp.logprob for lp in lps] == ref.max(dim=-1).values.tolist()
    assert _sample(s, logits, [SamplingParams()] * 6).logprobs is None


# --- mixed batches and seeds --------------------------------------------------------------------------------
def test_plain_rows_are_untouched_by_featured_rows_in_their_batch():
    """The same batch with rows 1 and 3 asking for every feature, and with those rows plain: the other rows
    (greedy, seeded, unseeded: the same draws, since the batch has the same shape) sample the same tokens."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(5, 200, generator=g) * 2
    plain = [
        SamplingParams(),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.8, seed=11),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=1.2, top_k=50),
    ]
    featured = list(plain)
    featured[1] = SamplingParams(
        temperature=1.0, presence_penalty=1.0, frequency_penalty=0.5, repetition_penalty=1.3, min_p=0.1, logprobs=4
    )
    featured[3] = SamplingParams(logit_bias={0: 50.0}, top_p=0.5, logprobs=0, temperature=1.0)
    reqs = [Req(f"r{i}", [7, 8, 9], [1, 2]) for i in range(5)]

    def run(params):
        gens = [None, None, torch.Generator().manual_seed(11), None, None]
        return _sample(BatchSampler(CPU, seed=5), logits, params, reqs, gens).tokens.tolist()

    base, feat = run(plain), run(featured)
    assert [feat[i] for i in (0, 2, 4)] == [base[i] for i in (0, 2, 4)]
    assert feat[3] == 0  # its bias wins
    # a batch without the featured rows at all: the greedy and seeded rows again
    alone = _sample(
        BatchSampler(CPU, seed=5),
        logits[[0, 2]],
        [plain[0], plain[2]],
        gens=[None, torch.Generator().manual_seed(11)],
    ).tokens.tolist()
    assert alone == [base[0], base[2]]


def test_a_seeded_featured_request_samples_the_same_whatever_shares_its_batch():
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(8, 120, generator=g)
    p = SamplingParams(
        temperature=1.0, seed=99, frequency_penalty=0.4, repetition_penalty=1.2, min_p=0.05, top_k=60, logprobs=2
    )
    other = SamplingParams(temperature=1.0, presence_penalty=0.7)

    def steps(rows: list[int], mine: int) -> list[tuple[int, float]]:
        s = BatchSampler(CPU, seed=len(rows))
        gen = torch.Generator().manual_seed(99)
        reqs = [Req(f"r{i}", [i, 5]) for i in range(len(rows))]
        params = [p if i == mine else other for i in range(len(rows))]
        gens = [gen if i == mine else None for i in range(len(rows))]
        out = []
        for _ in range(6):
            o = _sample(s, logits[rows], params, reqs, gens)
            tok = o.tokens.tolist()
            out.append((tok[mine], o.logprobs.token_logprobs(tok)[mine].logprob))
        return out

    alone = steps([2], 0)
    assert steps([0, 2, 5], 1) == alone and steps([7, 1, 3, 2], 3) == alone
    assert len({t for t, _ in alone}) > 1  # it does sample


def test_batch_sampler_greedy_top_p_and_generator_seed():
    """Ported from the removed static Sampler's test: greedy rows take the argmax; top_p smaller than the top
    token's mass keeps only that token whatever the temperature; the engine's seed fixes the draws."""
    logits = torch.tensor([[0.0, 3.0, 1.0, -1.0], [2.0, 0.0, 0.0, 5.0]])
    s = BatchSampler(CPU, seed=7)
    assert _sample(s, logits, [SamplingParams(temperature=0.0)] * 2).tokens.tolist() == [1, 3]
    for _ in range(20):
        assert _sample(s, logits, [SamplingParams(temperature=5.0, top_p=0.05)] * 2).tokens.tolist() == [1, 3]
    draws = [
        _sample(BatchSampler(CPU, seed=3), logits.repeat(64, 1), [SamplingParams(temperature=1.0)] * 128)
        for _ in range(2)
    ]
    assert torch.equal(draws[0].tokens, draws[1].tokens)
    assert len(set(draws[0].tokens.tolist())) > 1  # temperature sampling does sample
    with pytest.raises(SamplingParamsError, match="top_p=0"):
        SamplingParams(top_p=0.0)
    with pytest.raises(SamplingParamsError, match="temperature=-1"):
        SamplingParams(temperature=-1)
