"""Engine rows -> the inference model, and the fit of a cluster's engine constants (hardware.EngineCost).

`predict_row` prices one batch / study row as the engine ran it: its model, layout, workload, the
decode all-reduce it ran (`allreduce_ran`, e.g. 'nvrar[os/b8x256w4]' -> nvrar; the model picks the
faster nvrar launch itself) and prefill's (`allreduce_ran_prefill`; where a row lacks it, the engine's
rule: a buffered backend takes messages up to ENGINE_ALLREDUCE_MAX_BYTES, NCCL the larger ones).

`fit_engine` fits four constants to the rows it is given (the preset names them: hardware.ENGINE_FITS),
minimising the sum of squared relative errors of TPOT and TTFT:
  decode_layer_us, attn_position_ns      from TPOT (linear in both; positions vary with the workload)
  eager_layer_host_us, prefill_efficiency from TTFT (host-bound short prompts vs compute-bound long ones)
by a deterministic pattern search (compass search: try +-step on each constant, halve the steps when
nothing improves). Everything else -- HBM efficiency, launch costs, all-reduce constants -- stays the
cluster's, from separate measurements, and `attends_max_seq_len` is a fact of the engine's code.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from spanllm.model.config import ModelConfig
from spanllm.perf.allreduce_model import model_name
from spanllm.perf.hardware import ClusterSpec, EngineCost
from spanllm.perf.inference import Estimate, Layout, Workload, estimate
from spanllm.perf.measurements import EngineMeasurement, ran_algorithm
from spanllm.perf.model_shape import DTYPE_BYTES, get_model
from spanllm.workloads import BUFFERED_ALLREDUCE_MAX_BYTES

ENGINE_ALLREDUCE_MAX_BYTES = BUFFERED_ALLREDUCE_MAX_BYTES  # the engine's own default (spanllm.workloads)
"""spanllm.engine.config.EngineConfig.allreduce_max_bytes: larger all-reduces go to NCCL (prefill's)."""

FITTED = ("decode_layer_us", "attn_position_ns", "eager_layer_host_us", "prefill_efficiency")
BOUNDS = {
    "decode_layer_us": (0.0, 1000.0),
    "attn_position_ns": (0.0, 1000.0),
    "eager_layer_host_us": (0.0, 10000.0),
    "prefill_efficiency": (0.05, 1.0),
}
START = {"decode_layer_us": 0.0, "attn_position_ns": 0.0, "eager_layer_host_us": 0.0, "prefill_efficiency": 0.5}
STEP = {"decode_layer_us": 64.0, "attn_position_ns": 16.0, "eager_layer_host_us": 512.0, "prefill_efficiency": 0.25}
METRICS = ("ttft", "tpot")


class EngineFitError(ValueError):
    """Rows that cannot determine the engine constants."""


@dataclass(frozen=True)
class EngineCase:
    model: ModelConfig
    layout: Layout
    workload: Workload
    algo: str  # decode all-reduce (model name)
    prefill_algo: str
    cuda_graphs: bool

    @property
    def label(self) -> str:
        pre = f" (prefill {self.prefill_algo})" if self.prefill_algo != self.algo and self.layout.tp > 1 else ""
        return (
            f"{self.model.label} {self.layout} {self.algo if self.layout.tp > 1 else 'no-allreduce'}{pre} "
            f"b{self.workload.batch} p{self.workload.prompt_len} d{self.workload.decode_len}"
        )


def format_constant(v) -> str:
    """An EngineCost field for a table: flags as they are, numbers to 6 significant digits."""
    return str(v) if isinstance(v, bool) else f"{v:.6g}"


def _algo(ran: str) -> str:
    return model_name(ran_algorithm(ran))


def row_case(row: Mapping[str, Any]) -> EngineCase:
    """The model's view of one engine row (KeyError / ValueError when the row cannot be priced)."""
    model = get_model(str(row["model"]))
    if row.get("truncated_layers"):
        model = model.with_layers(int(row["truncated_layers"]))
    tp, rpn = int(row["tp"]), row.get("ranks_per_node")
    layout = Layout(
        tp,
        int(row.get("pp", 1)),
        int(row.get("micro_batches", 1)),
        tp_ranks_per_node=min(int(rpn), tp) if rpn else None,
    )
    w = Workload(int(row["batch"]), int(row["prompt_len"]), int(row["decode_len"]))
    ran = str(row.get("allreduce_ran") or row.get("allreduce") or "nccl")
    algo = "nccl" if tp == 1 or ran == "none" else _algo(ran)  # no all-reduce at tp 1
    ran_prefill = row.get("allreduce_ran_prefill")
    if tp == 1 or ran_prefill == "none":
        prefill = "nccl"
    elif ran_prefill:
        prefill = _algo(str(ran_prefill))
    else:  # not recorded (study logs): the engine's size rule
        nbytes = w.batch // layout.micro_batches * w.prompt_len * model.hidden_size * DTYPE_BYTES
        prefill = algo if nbytes <= ENGINE_ALLREDUCE_MAX_BYTES else "nccl"
    return EngineCase(model, layout, w, algo, prefill, bool(row.get("cuda_graphs", True)))


def predict(case: EngineCase, cluster: ClusterSpec) -> Estimate:
    return estimate(case.model, cluster, case.layout, case.workload, case.algo, case.cuda_graphs, case.prefill_algo)


def predict_row(row: Mapping[str, Any], cluster: ClusterSpec) -> Estimate:
    return predict(row_case(row), cluster)


@dataclass(frozen=True)
class EngineFit:
    cost: EngineCost
    rows: tuple[str, ...]  # "source: label" of every row fitted
    rms_rel_error: dict[str, float]  # per metric, over the rows fitted


def compass_search(
    loss: Callable[[dict[str, float]], float],
    start: dict[str, float],
    step: dict[str, float],
    bounds: dict[str, tuple[float, float]],
    rel_tol: float = 1e-5,
    max_evals: int = 20000,
):
    """Minimise `loss` over a box: try +-step on each coordinate in turn, keep any improvement, halve every
    step when a sweep improves nothing; stop when each step is below rel_tol x its initial value."""
    x, best = dict(start), loss(start)
    step, evals = dict(step), 1
    tol = {k: v * rel_tol for k, v in step.items()}
    while any(step[k] > tol[k] for k in step) and evals < max_evals:
        improved = False
        for k in step:
            for sign in (1.0, -1.0):
                lo, hi = bounds[k]
                trial = {**x, k: min(hi, max(lo, x[k] + sign * step[k]))}
                if trial[k] == x[k]:
                    continue
                value = loss(trial)
                evals += 1
                if value < best:
                    x, best, improved = trial, value, True
                    break
        if not improved:
            step = {k: v / 2 for k, v in step.items()}
    return x, best


def fit_engine(rows: list[EngineMeasurement], cluster: ClusterSpec, attends_max_seq_len: bool = True) -> EngineFit:
    """EngineCost fitted to `rows` (their TTFT and TPOT) on `cluster` (whose other constants stay)."""
    cases = []
    for e in rows:
        case = row_case(e.row)
        measured = {m: float(e.row[f"{m}_ms"]) for m in METRICS if e.row.get(f"{m}_ms")}
        cases.append((f"{e.source}: {case.label}", case, measured))
    if not any("tpot" in m for _, _, m in cases) or not any("ttft" in m for _, _, m in cases):
        raise EngineFitError(f"{len(rows)} engine rows: a fit needs rows with both TPOT and TTFT")

    # the size scaling of the prefill efficiency is kept as the cluster has it (fit_prefill_size_exponent)
    keep = {
        "attends_max_seq_len": attends_max_seq_len,
        "prefill_ref_layer_params": cluster.engine.prefill_ref_layer_params,
        "prefill_size_exponent": cluster.engine.prefill_size_exponent,
    }

    def errors(x: dict[str, float]) -> dict[str, list[float]]:
        c = replace(cluster, engine=EngineCost(**keep, **x))
        out: dict[str, list[float]] = {m: [] for m in METRICS}
        for _, case, measured in cases:
            est = predict(case, c)
            for m, v in measured.items():
                out[m].append((getattr(est, f"{m}_ms") - v) / v)
        return out

    def loss(x: dict[str, float]) -> float:
        return sum(r * r for errs in errors(x).values() for r in errs)

    x, _ = compass_search(loss, START, STEP, BOUNDS)
    rms = {m: (sum(r * r for r in v) / len(v)) ** 0.5 for m, v in errors(x).items() if v}
    return EngineFit(EngineCost(**keep, **x), tuple(lbl for lbl, _, _ in cases), rms)


def fit_prefill_size_exponent(rows: list[EngineMeasurement], cluster: ClusterSpec) -> tuple[float, float]:
    """EngineCost.prefill_size_exponent fitted to the TTFT of `rows` (rms relative error over a grid of
    0.005 in [0, 1]; the cluster's other engine constants, its reference size included, stay); and that rms."""
    cases = [(row_case(e.row), float(e.row["ttft_ms"])) for e in rows if e.row.get("ttft_ms")]
    if not cases:
        raise EngineFitError(f"{len(rows)} engine rows, none with a TTFT: nothing to fit the prefill size exponent to")
    if not cluster.engine.prefill_ref_layer_params:
        raise EngineFitError(f"{cluster.name}: EngineCost.prefill_ref_layer_params is 0; set the reference size first")

    def rms(alpha: float) -> float:
        c = replace(cluster, engine=replace(cluster.engine, prefill_size_exponent=alpha))
        return (sum(((predict(k, c).ttft_ms - v) / v) ** 2 for k, v in cases) / len(cases)) ** 0.5

    best = min((i * 0.005 for i in range(201)), key=rms)
    return best, rms(best)
