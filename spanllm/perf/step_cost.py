"""What one serving-engine step costs: the work the scheduler planned (decodes and prompt chunks), priced with the
engine's kernel efficiencies measured on the H200 and its overheads fitted to a measured step trace.

A step on one GPU of a TP group of `tp` (pp stages run one after another: one batch in flight, as spanllm's
engine runs a step):

  weights    max(weight bytes / tp / (HBM x weight_read_efficiency),            every step reads every layer
                 GEMM FLOPs / tp / (peak bf16 x gemm_efficiency))               and the LM head once
             GEMM FLOPs = 2 x layer parameters x tokens + 2 x LM head x sampled rows
  attention  decode: each decode's context K/V / (HBM x attention_read_efficiency)
             prefill: causal QK^T and PV FLOPs of each chunk (a query at position p sees p + 1 keys) at the GEMM rate
  all-reduce 2 per layer on `tokens x hidden` bf16 (spanllm.perf.allreduce_model, the decode algorithm)
  pipeline   pp - 1 transfers of the step's hidden states
  overhead   layers x layer_us (the graph's small kernels and the gaps between its ~10 kernels a layer)
             + tokens x layers x hidden / tp x elem_ns (norms, RoPE, SiLU, residual adds: elementwise per token)
             + sampled rows x sample_us (logits copy and the sampler) + host_us (host work between forwards)

The efficiencies are kernel measurements (results/h200/engine_speed: GEMMs ~750 TFLOP/s in the 8192-token prefill,
weight GEMVs streaming at 3.6-4.0 TB/s, decode attention ~3.7 TB/s at 256 decodes); the four overheads are least
squares (relative) over the per-step GPU time of a 1000-request ShareGPT trace (`fit_step_cost`), so a prediction
of any other run (other max_num_seqs, arrivals, the serve sweep) is out of sample. Other GPUs take the H200's
efficiencies against their own datasheet peaks ([assumed]: ranges in STEP_COST_RANGES).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace

import numpy as np

from spanllm.model.config import ModelConfig
from spanllm.perf.allreduce_model import allreduce_cost
from spanllm.perf.hardware import ClusterSpec
from spanllm.perf.inference import kv_heads_per_gpu, pp_transfer_us
from spanllm.perf.model_shape import DTYPE_BYTES, embedding_params, kv_bytes_per_token_layer, layer_params

H200_TRACE = "results/h200/engine_speed/call14_final_kernels/profile/profile_steps.json"


class StepCostError(ValueError):
    """A step cost that cannot be priced or fitted."""


@dataclass(frozen=True)
class Step:
    """One scheduler step as plain data: its decodes (count, sum of their context lengths) and prompt chunks."""

    decodes: int
    decode_ctx: int  # sum over decodes of the positions each attends to (its context + the new token)
    chunks: tuple[tuple[int, int], ...]  # (positions already cached, tokens run) per prompt chunk
    sampling: int  # rows that sample a token this step
    preempted: int = 0  # sequences the scheduler preempted (by recompute) to plan this step

    @property
    def tokens(self) -> int:
        return self.decodes + sum(n for _, n in self.chunks)

    @property
    def seqs(self) -> int:
        return self.decodes + len(self.chunks)

    @property
    def prefill_pairs(self) -> int:
        """(query, key) pairs of the causal prompt chunks."""
        return sum(n * c0 + n * (n + 1) // 2 for c0, n in self.chunks)


@dataclass(frozen=True)
class StepCost:
    gemm_efficiency: float = 750.0 / 989.0  # [measured] GEMMs of the 8192-token prefill (~750 TFLOP/s)
    weight_read_efficiency: float = 3.8 / 4.8  # [measured] decode GEMVs stream 3.6-4.0 TB/s (calls 5, 14)
    attention_read_efficiency: float = (
        3.7 / 4.8
    )  # [measured] decode attention, 256 x 256 context: 2.31 ms / 2.0 at 4.28
    layer_us: float = 0.0  # [fit] per layer per step
    elem_ns: float = 0.0  # [fit] per token x layer x (hidden / tp)
    sample_us: float = 0.0  # [fit] per sampled row
    host_us: float = 0.0  # [fit] per step, between forwards (trace: step wall - GPU forward)

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise StepCostError(f"StepCost.{f.name}={v!r} must be a finite number >= 0")
        for name in ("gemm_efficiency", "weight_read_efficiency", "attention_read_efficiency"):
            if not 0 < getattr(self, name) <= 1:
                raise StepCostError(f"StepCost.{name}={getattr(self, name)!r} must lie in (0, 1]")


# [fit] fit_step_cost on H200_TRACE (1,722 steps of Llama 3.1 8B, TP=1, max_num_seqs 256): rms relative error per
# step 4.4%, total GPU time 18.27 s predicted against 18.33 s measured (tests/perf/test_perf_step_cost.py refits it).
H200_STEP_COST = StepCost(layer_us=22.65, elem_ns=0.0320, sample_us=6.25, host_us=345.2)

STEP_COST_RANGES: dict[str, tuple[float, float]] = {
    # [measured] spans on the H200: 700 (prefill GEMMs, README call 9) .. 790 (random-data GEMM) TFLOP/s;
    # weight GEMVs 3.6-4.0 TB/s; attention ~3.5-4.0 TB/s; the overheads +-25% (machine-to-machine spread of a
    # whole run is 2-3%, the per-step residuals 4%; the wider band covers other GPUs' launch gaps [assumed])
    # Not covered: an H100 streams its weights nearer its peak than an H200 does (its one-row bf16 GEMVs at 2.5-3.2
    # of 3.35 TB/s, gate_up and the LM head above 3.0, results/h100/gemv/README.md; this range gives 2.5-2.8 there),
    # so batch-1 bf16 decode on an H100 is predicted 21% slower than measured (6.75 ms against 5.56); its offline
    # ShareGPT, mostly large steps, within 1% (8,608 against 8,569 output tok/s).
    "gemm_efficiency": (700.0 / 989.0, 790.0 / 989.0),
    "weight_read_efficiency": (3.6 / 4.8, 4.0 / 4.8),
    "attention_read_efficiency": (3.5 / 4.8, 4.0 / 4.8),
    "layer_us": (0.75, 1.25),  # factors of the fitted value
    "elem_ns": (0.75, 1.25),
    "sample_us": (0.75, 1.25),
    "host_us": (0.75, 1.25),
}


def corner_cost(cost: StepCost, slow: bool) -> StepCost:
    """The step cost at the fast (slow=False) or slow end of every range in STEP_COST_RANGES."""
    out = {}
    for name, (lo, hi) in STEP_COST_RANGES.items():
        if name.endswith("efficiency"):
            out[name] = lo if slow else hi
        else:
            out[name] = getattr(cost, name) * (hi if slow else lo)
    return replace(cost, **out)


@dataclass(frozen=True)
class StepPricer:
    """Prices steps of `model` on a TP group of `tp` GPUs x `pp` stages of `cluster` (seconds)."""

    model: ModelConfig
    cluster: ClusterSpec
    cost: StepCost = H200_STEP_COST
    tp: int = 1
    pp: int = 1
    algo: str = "auto"  # the all-reduce of the TP group (spanllm's `auto`: the fastest modelled per size)

    def __post_init__(self) -> None:
        g = self.cluster.gpus_per_node
        if self.model.num_heads % self.tp or not (g % self.tp == 0 or self.tp % g == 0):
            raise StepCostError(
                f"tp={self.tp}: must divide the {self.model.num_heads} heads and a node of {g} GPUs (or span whole "
                "nodes)"
            )
        if not 1 <= self.pp <= self.model.num_layers:
            raise StepCostError(f"pp={self.pp}: must lie in [1, {self.model.num_layers}] (the model's layers)")

    def _group(self) -> tuple[int, int]:
        g = self.cluster.gpus_per_node
        return (1, self.tp) if self.tp <= g else (self.tp // g, g)

    def parts_s(self, step: Step) -> dict[str, float]:
        """The step's time by component (module docstring), seconds."""
        m, c, k, tp = self.model, self.cluster, self.cost, self.tp
        layers = m.num_layers
        hbm, fl = c.hbm_GBps * 1e9, c.bf16_TFLOPs * 1e12
        p_layers, p_head = layers * layer_params(m), embedding_params(m)
        tokens = step.tokens
        weights = DTYPE_BYTES * (p_layers + p_head) / tp / (hbm * k.weight_read_efficiency)
        gemm = (2 * p_layers * tokens + 2 * p_head * step.sampling) / tp / (fl * k.gemm_efficiency)
        kv = kv_bytes_per_token_layer(m, kv_heads_per_gpu(m, tp)) * layers * step.decode_ctx
        attn_flops = 4 * m.num_heads // tp * m.head_dim * layers * step.prefill_pairs
        parts = {
            "weights_or_gemm": max(weights, gemm),
            "attention": kv / (hbm * k.attention_read_efficiency) + attn_flops / (fl * k.gemm_efficiency),
            "allreduce": 0.0,
            "pp_transfer": 0.0,
            "overhead": (
                layers * k.layer_us
                + tokens * layers * m.hidden_size / tp * k.elem_ns / 1e3
                + step.sampling * k.sample_us
                + k.host_us
            )
            / 1e6,
        }
        if tp > 1 and tokens:
            nodes, rpn = self._group()
            us = allreduce_cost(self.algo, tokens * m.hidden_size * DTYPE_BYTES, c, nodes, rpn, True)[0]
            parts["allreduce"] = 2 * layers * us / 1e6
        if self.pp > 1 and tokens:
            g = c.gpus_per_node
            hops = [(s + 1) * tp % g == 0 for s in range(self.pp - 1)]
            parts["pp_transfer"] = sum(pp_transfer_us(tokens * m.hidden_size * DTYPE_BYTES, h, c) for h in hops) / 1e6
        return parts

    def step_s(self, step: Step) -> float:
        return sum(self.parts_s(step).values())


# --- the fit -------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TraceStep:
    """One row of a profile trace (scripts/gpu_profile_steps.py `trace`): what ran and its measured GPU time."""

    decodes: int
    decode_ctx: int
    tokens: int
    seqs: int
    gpu_forward_s: float
    step_wall_s: float

    def as_step(self) -> Step:
        """The trace does not record chunk offsets: each prompt chunk is taken as a whole prompt from position 0
        (ShareGPT prompts mostly fit one chunk), the prefill tokens split evenly over the chunks."""
        k = self.seqs - self.decodes
        pf = self.tokens - self.decodes
        chunks = tuple((0, pf // k + (1 if i < pf % k else 0)) for i in range(k)) if k > 0 and pf > 0 else ()
        return Step(self.decodes, self.decode_ctx, chunks, self.seqs)


def trace_steps(doc: dict) -> list[TraceStep]:
    """The `trace` of a profile_steps.json document."""
    try:
        t = doc["trace"]
        col = {c: i for i, c in enumerate(t["columns"])}
        return [
            TraceStep(
                int(r[col["decodes"]]),
                int(r[col["decode_context_sum"]]),
                int(r[col["tokens"]]),
                int(r[col["seqs"]]),
                float(r[col["gpu_forward_s"]]),
                float(r[col["step_wall_s"]]),
            )
            for r in t["rows"]
        ]
    except (KeyError, TypeError, ValueError, IndexError) as e:
        raise StepCostError(
            f"not a profile trace (scripts/gpu_profile_steps.py `trace`): {type(e).__name__}: {e}"
        ) from None


def fit_step_cost(
    rows: list[TraceStep], model: ModelConfig, cluster: ClusterSpec, base: StepCost = StepCost()
) -> tuple[StepCost, float]:
    """The four overheads of `base` fitted to a trace of one GPU (TP=1), efficiencies kept; and the rms relative
    error per step. Relative least squares on the GPU forward time, a negative coefficient held at 0 and refitted;
    host_us = (sum of step wall - sum of GPU forward) / steps."""
    if len(rows) < 8:
        raise StepCostError(f"{len(rows)} trace rows: a fit of 3 overheads needs at least 8 steps")
    zero = StepPricer(model, cluster, replace(base, layer_us=0.0, elem_ns=0.0, sample_us=0.0, host_us=0.0))
    t = np.array([r.gpu_forward_s for r in rows])
    if np.any(t <= 0):
        raise StepCostError("a trace row has gpu_forward_s <= 0")
    work = np.array([zero.step_s(r.as_step()) for r in rows])
    layers, h = model.num_layers, model.hidden_size
    A = np.array([[layers, r.tokens * layers * h / 1e3, r.seqs] for r in rows], float) / 1e6
    w = 1.0 / t
    Aw, bw = A * w[:, None], (t - work) * w
    cols = [0, 1, 2]
    while True:
        coef = np.zeros(3)
        sol, *_ = np.linalg.lstsq(Aw[:, cols], bw, rcond=None)
        coef[cols] = sol
        neg = [j for j in cols if coef[j] < 0]
        if not neg:
            break
        cols.remove(min(neg, key=lambda j: coef[j]))
    host = max(0.0, sum(r.step_wall_s - r.gpu_forward_s for r in rows) / len(rows)) * 1e6
    cost = replace(base, layer_us=float(coef[0]), elem_ns=float(coef[1]), sample_us=float(coef[2]), host_us=host)
    pred = work + A @ coef
    return cost, float(np.sqrt(np.mean(((pred - t) / t) ** 2)))
