"""The serving planner: spanllm's own scheduler replayed on a trace, each step priced by spanllm.perf.step_cost.

With ignore_eos every request runs to its output length, so the step plan depends only on the lengths, the
arrival times, the scheduler's limits and (through the clock) the step times: `simulate` runs the engine's
Scheduler and BlockManager (spanllm.engine.core, no model) in simulated time. Requests arriving by the clock join
the waiting queue; a step runs what the scheduler planned and advances the clock by its priced time; a token
sampled in a step is out when the step ends. Per request: TTFT = first token - arrival, TPOT = (last token -
first token) / (output - 1), as `spanllm bench serve` measures them (less the HTTP front end). The replay is
synchronous; the engine's async scheduling takes a step or so more per run (1,722 against 1,721 steps).

Layouts (`serve_layouts`): `replicas` independent engines of TP `tp` x `pp` stages each (requests dealt to the
replicas in turn); a PP engine runs one batch through its stages at a time (no micro-batches in flight), so PP
buys memory, not speed. Each layout is simulated three times: with the nominal step cost, and at the slow and the
fast corner of the step cost's ranges (step_cost.STEP_COST_RANGES) together with the cluster's guessed constants
(ClusterSpec.ranges) at the end that slows / speeds a typical decode step: the percentiles come with ranges.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np

from spanllm.model.config import ModelConfig
from spanllm.perf.hardware import ClusterSpec
from spanllm.perf.inference import MEMORY_USABLE_FRACTION, kv_heads_per_gpu
from spanllm.perf.model_shape import DTYPE_BYTES, embedding_params, kv_bytes_per_token_layer, layer_params
from spanllm.perf.step_cost import H200_STEP_COST, Step, StepCost, StepPricer, corner_cost
from spanllm.perf.uncertainty import corner, predict_range


class ServePlanError(ValueError):
    """A trace, limits or layout the serving planner cannot simulate."""


@dataclass(frozen=True)
class ServeRequest:
    prompt_len: int
    output_len: int
    arrival_s: float = 0.0


@dataclass(frozen=True)
class EngineLimits:
    """The scheduler's settings (spanllm.engine.core.scheduler.SchedulerConfig) and the KV pool."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    num_blocks: int = 55326  # the H200 8B run's pool (results/h200/engine_speed)
    block_size: int = 16
    min_admit: int = 1

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "num_blocks", "block_size", "min_admit"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ServePlanError(f"EngineLimits.{name}={v!r} must be an integer >= 1")


@dataclass(frozen=True)
class RequestTiming:
    arrival_s: float
    first_token_s: float
    finish_s: float
    output_len: int

    @property
    def ttft_s(self) -> float:
        return self.first_token_s - self.arrival_s

    @property
    def tpot_s(self) -> float | None:
        return (self.finish_s - self.first_token_s) / (self.output_len - 1) if self.output_len > 1 else None


@dataclass(frozen=True)
class ServeRun:
    timings: tuple[RequestTiming, ...]
    steps: int
    preemptions: int

    @property
    def duration_s(self) -> float:
        return max(t.finish_s for t in self.timings) - min(t.arrival_s for t in self.timings)

    @property
    def output_tokens(self) -> int:
        return sum(t.output_len for t in self.timings)

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.duration_s

    @property
    def request_s(self) -> float:
        return len(self.timings) / self.duration_s

    def percentile_ms(self, metric: str, q: float) -> float:
        """numpy's linear-interpolation percentile of 'ttft' or 'tpot' in ms (as `bench serve` reports them)."""
        if metric == "ttft":
            v = [t.ttft_s for t in self.timings]
        elif metric == "tpot":
            v = [t.tpot_s for t in self.timings if t.tpot_s is not None]
        else:
            raise ServePlanError(f"metric {metric!r}: choose ttft or tpot")
        return float(np.percentile(np.array(v) * 1e3, q)) if v else 0.0

    def summary(self) -> dict[str, float]:
        return {
            "output_tok_s": self.output_tok_s,
            "request_s": self.request_s,
            "steps": self.steps,
            **{f"{m}_p{q}_ms": self.percentile_ms(m, q) for m in ("ttft", "tpot") for q in (50, 90, 99)},
        }


def check_requests(requests: Sequence[ServeRequest]) -> None:
    if not requests:
        raise ServePlanError("no requests: give a trace (a samples file) or lengths")
    for i, r in enumerate(requests):
        if r.prompt_len < 1 or r.output_len < 1 or not (math.isfinite(r.arrival_s) and r.arrival_s >= 0):
            raise ServePlanError(
                f"request {i}: prompt_len={r.prompt_len}, output_len={r.output_len}, arrival_s={r.arrival_s}: "
                "lengths must be >= 1 and the arrival a finite time >= 0"
            )


def simulate(requests: Sequence[ServeRequest], limits: EngineLimits, step_s: Callable[[Step], float]) -> ServeRun:
    """The engine's scheduler on `requests` in simulated time (module docstring); `step_s` prices each step."""
    # The real scheduler, imported here: it brings the engine's sampler module (and torch) with it.
    from spanllm.engine.core.block_manager import BlockManager
    from spanllm.engine.core.scheduler import Scheduler, SchedulerConfig
    from spanllm.engine.core.sequence import Sequence as EngineSequence
    from spanllm.engine.core.sequence import SequenceStatus
    from spanllm.engine.sampler import SamplingParams

    check_requests(requests)
    longest = max(r.prompt_len + r.output_len for r in requests)
    if longest > limits.num_blocks * limits.block_size:
        raise ServePlanError(
            f"a request of {longest} tokens does not fit the KV pool of {limits.num_blocks} blocks x "
            f"{limits.block_size}; the layout has too little memory for this trace"
        )
    order = sorted(range(len(requests)), key=lambda i: requests[i].arrival_s)
    sched = Scheduler(
        SchedulerConfig(
            limits.max_num_seqs, limits.max_num_batched_tokens, max(longest, 1), min_admit=limits.min_admit
        ),
        # lengths only (every token id 0): no content to share, so the prefix cache stays off
        BlockManager(limits.num_blocks, limits.block_size, enable_prefix_caching=False),
    )
    clock, nxt, steps = 0.0, 0, 0
    first: dict[int, float] = {}
    done: dict[int, float] = {}
    while nxt < len(order) or sched.has_work():
        while nxt < len(order) and requests[order[nxt]].arrival_s <= clock:
            i = order[nxt]
            r = requests[i]
            sched.add(
                EngineSequence(str(i), [0] * r.prompt_len, SamplingParams(max_tokens=r.output_len, ignore_eos=True))
            )
            nxt += 1
        if not sched.has_work():
            clock = requests[order[nxt]].arrival_s
            continue
        batch = sched.schedule()
        if not batch:
            raise ServePlanError("the scheduler planned an empty step with work left (KV pool too small?)")
        dec = batch.entries[: batch.num_decode]
        chunks = tuple((s.num_computed, n) for s, n in batch.entries[batch.num_decode :])
        sampled = []
        for s, n in batch.entries:
            s.num_computed += n
            if s.num_computed == s.num_tokens:
                sampled.append(s)
        step = Step(len(dec), sum(s.num_computed for s, _ in dec), chunks, len(sampled), len(batch.preempted))
        clock += step_s(step)
        steps += 1
        for s in sampled:
            s.output_ids.append(0)
            i = int(s.request_id)
            first.setdefault(i, clock)
            if s.num_output >= s.params.max_tokens:
                sched.finish(s)
                s.status = SequenceStatus.FINISHED
                done[i] = clock
    timings = tuple(RequestTiming(r.arrival_s, first[i], done[i], r.output_len) for i, r in enumerate(requests))
    return ServeRun(timings, steps, sched.num_preemptions)


def replay_steps(lengths: Sequence[tuple[int, int]], limits: EngineLimits) -> list[Step]:
    """The scheduler's step plan for requests (prompt_len, output_len) all arriving at once (no step costs)."""
    steps: list[Step] = []
    simulate([ServeRequest(p, o) for p, o in lengths], limits, lambda s: steps.append(s) or 0.0)
    return steps


# --- layouts ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ServeLayout:
    tp: int
    pp: int = 1
    replicas: int = 1

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.replicas

    def __str__(self) -> str:
        s = f"TP{self.tp}" + (f" x PP{self.pp}" if self.pp > 1 else "")
        return s + (f" x {self.replicas} replicas" if self.replicas > 1 else "")


def serve_layouts(model: ModelConfig, cluster: ClusterSpec, gpus: int) -> list[ServeLayout]:
    """Every (tp, pp, replicas) using all `gpus`: the TP group a divisor of a node (or whole nodes) dividing the
    attention heads; PP stages of whole TP groups."""
    g = cluster.gpus_per_node
    out = []
    for tp in range(1, gpus + 1):
        if gpus % tp or model.num_heads % tp or not (g % tp == 0 or tp % g == 0):
            continue
        for pp in range(1, gpus // tp + 1):
            if (gpus // tp) % pp or pp > model.num_layers:
                continue
            out.append(ServeLayout(tp, pp, gpus // (tp * pp)))
    return out


def weight_bytes_per_gpu(model: ModelConfig, layout: ServeLayout) -> float:
    layers = math.ceil(model.num_layers / layout.pp)
    emb = embedding_params(model) / layout.tp * (2 if layout.pp == 1 else 1)
    return (layers * layer_params(model) / layout.tp + emb) * DTYPE_BYTES


def kv_blocks(model: ModelConfig, cluster: ClusterSpec, layout: ServeLayout, limits: EngineLimits) -> int:
    """KV blocks one replica's pool holds: usable GPU memory less its weights and a step's activations, over the
    bytes a block takes on one GPU (<= 0: the weights alone do not fit)."""
    layers = math.ceil(model.num_layers / layout.pp)
    acts = (
        limits.max_num_batched_tokens * DTYPE_BYTES * (4 * model.hidden_size + 3 * model.intermediate_size / layout.tp)
    )
    logits = limits.max_num_seqs * model.vocab_size / layout.tp * 4 * 2  # float32 logits + the sampler's copy
    free = cluster.gpu_memory_GB * 1e9 * MEMORY_USABLE_FRACTION - weight_bytes_per_gpu(model, layout) - acts - logits
    per_block = limits.block_size * layers * kv_bytes_per_token_layer(model, kv_heads_per_gpu(model, layout.tp))
    return int(free // per_block)


# --- the plan --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ServeRow:
    layout: ServeLayout
    fits: bool
    why: str  # why it does not fit ('' when it does)
    nominal: dict[str, float]
    fast: dict[str, float]  # at the fast corner of the ranges
    slow: dict[str, float]  # at the slow corner
    num_blocks: int = 0
    preemptions: int = 0

    def range_of(self, key: str) -> tuple[float, float]:
        a, b = self.fast.get(key, 0.0), self.slow.get(key, 0.0)
        return (min(a, b, self.nominal[key]), max(a, b, self.nominal[key]))


@dataclass(frozen=True)
class Slo:
    tpot_p99_ms: float | None = None
    ttft_p99_ms: float | None = None

    def met(self, s: dict[str, float]) -> bool:
        return (self.tpot_p99_ms is None or s["tpot_p99_ms"] <= self.tpot_p99_ms) and (
            self.ttft_p99_ms is None or s["ttft_p99_ms"] <= self.ttft_p99_ms
        )


def cluster_corners(cluster: ClusterSpec, pricer: StepPricer, probe: Step) -> tuple[ClusterSpec, ClusterSpec]:
    """(fast, slow) clusters: every guessed constant at the end that speeds / slows the probe step."""
    if not cluster.ranges:
        return cluster, cluster
    r = predict_range(lambda c: replace(pricer, cluster=c).step_s(probe), cluster)
    fast = {d.path: d.low_value if d.delta_at_low <= d.delta_at_high else d.high_value for d in r.drivers}
    slow = {d.path: d.high_value if d.delta_at_low <= d.delta_at_high else d.low_value for d in r.drivers}
    return corner(cluster, fast), corner(cluster, slow)


def simulate_layout(
    requests: Sequence[ServeRequest],
    model: ModelConfig,
    cluster: ClusterSpec,
    layout: ServeLayout,
    limits: EngineLimits,
    cost: StepCost,
) -> ServeRun:
    """All replicas (requests dealt in turn), merged; a replica dealt no request (fewer requests than replicas)
    stays idle."""
    pricer = StepPricer(model, cluster, cost, layout.tp, layout.pp)
    busy = min(layout.replicas, len(requests))
    runs = [simulate(requests[r :: layout.replicas], limits, pricer.step_s) for r in range(busy)]
    return ServeRun(
        tuple(t for r in runs for t in r.timings), max(r.steps for r in runs), sum(r.preemptions for r in runs)
    )


def plan_serve(
    model: ModelConfig,
    cluster: ClusterSpec,
    gpus: int,
    requests: Sequence[ServeRequest],
    limits: EngineLimits,
    slo: Slo = Slo(),
    cost: StepCost = H200_STEP_COST,
    ranges: bool = True,
    layouts: list[ServeLayout] | None = None,
) -> list[ServeRow]:
    """Every layout on `gpus` GPUs, simulated; those that fit and meet the SLO first, by output tok/s."""
    check_requests(requests)
    rows = []
    longest = max(r.prompt_len + r.output_len for r in requests)
    for layout in layouts or serve_layouts(model, cluster, gpus):
        blocks = kv_blocks(model, cluster, layout, limits)
        if blocks * limits.block_size < longest:
            why = (
                "weights do not fit in GPU memory"
                if blocks <= 0
                else f"KV pool of {blocks * limits.block_size} tokens < the longest request ({longest})"
            )
            rows.append(ServeRow(layout, False, why, {}, {}, {}, max(blocks, 0)))
            continue
        lim = replace(limits, num_blocks=blocks)
        run = simulate_layout(requests, model, cluster, layout, lim, cost)
        fast = slow = run.summary()
        if ranges:
            pricer = StepPricer(model, cluster, cost, layout.tp, layout.pp)
            probe = Step(limits.max_num_seqs // 2, limits.max_num_seqs // 2 * 1024, (), limits.max_num_seqs // 2)
            c_fast, c_slow = cluster_corners(cluster, pricer, probe)
            fast = simulate_layout(requests, model, c_fast, layout, lim, corner_cost(cost, False)).summary()
            slow = simulate_layout(requests, model, c_slow, layout, lim, corner_cost(cost, True)).summary()
        rows.append(ServeRow(layout, True, "", run.summary(), fast, slow, blocks, run.preemptions))
    return sorted(
        rows, key=lambda r: (not r.fits, not (r.fits and slo.met(r.nominal)), -r.nominal.get("output_tok_s", 0))
    )


def row_to_dict(r: ServeRow, slo: Slo) -> dict:
    out = {
        "layout": str(r.layout),
        "tp": r.layout.tp,
        "pp": r.layout.pp,
        "replicas": r.layout.replicas,
        "fits": r.fits,
        "kv_blocks_per_replica": r.num_blocks,
    }
    if not r.fits:
        return out | {"why": r.why}
    return out | {
        "meets_slo": slo.met(r.nominal),
        "meets_slo_at_slow_end": slo.met(r.slow),
        "preemptions": r.preemptions,
        **r.nominal,
        **{f"{k}_range": list(r.range_of(k)) for k in r.nominal if k != "steps"},
    }
