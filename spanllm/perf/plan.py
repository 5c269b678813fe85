"""`spanllm plan`: rank parallel layouts x all-reduce algorithms for a model, cluster, node count and workload.

Layouts: every (tp, pp) with tp * pp = nodes * gpus_per_node whose TP group is a divisor of a node or
whole nodes and divides the attention heads (TP over all GPUs; TP inside a node x PP across nodes;
the splits between), each with 1 micro-batch and, for PP, with pp micro-batches when the batch
divides. All-reduce: every modelled algorithm the TP group supports; the choice prices decode, while
prefill's large all-reduces are priced with NCCL (NVRAR's LL8 doubles wire bytes; spanllm's `auto`
falls back to NCCL for large messages, and YALIS keeps NCCL for prefill). Layouts whose weights + KV
cache + activations exceed GPU memory are listed as not fitting and never named best.

How sure: where the cluster marks constants as guesses (ClusterSpec.ranges), every row is also priced in
each scenario of spanllm.perf.uncertainty (nominal, each guessed constant at its low and its high end)
and at the two corners of the box: E2E and TPOT come with a range and the constants that drive it. Rows
are ranked by the high end of their E2E range -- the latency that holds whichever way the guesses turn
out -- then by the nominal; `wins` counts the scenarios in which a row is the fastest that fits. A
calibrated cluster file (`spanllm perf calibrate --cluster ... --out FILE`, then `--cluster FILE`) has
its fitted entries fixed, so the guesses that fed them stop widening the ranges.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from spanllm.model.config import ModelConfig
from spanllm.perf.allreduce_model import place, supports
from spanllm.perf.hardware import ClusterSpec
from spanllm.perf.inference import Estimate, Layout, Workload, estimate, memory_per_gpu, tp_group_shape
from spanllm.perf.quantization import BF16, Quantization
from spanllm.perf.uncertainty import Range, predict_range, scenarios

PLAN_ALGOS = ("nccl", "nvrar", "torch_one_shot", "torch_two_shot")
PREFILL_ALGO = "nccl"


@dataclass(frozen=True)
class PlanRow:
    layout: Layout
    algo: str
    estimate: Estimate
    e2e_range: Range | None = None  # over the cluster's guessed constants (None: no ranges asked or none marked)
    tpot_range: Range | None = None
    wins: int = 0  # scenarios in which this row is the fastest that fits
    scenarios: int = 0  # scenarios priced

    @property
    def fits(self) -> bool:
        return self.estimate.memory is not None and self.estimate.memory.fits


def candidate_layouts(model: ModelConfig, cluster: ClusterSpec, nodes: int, batch: int) -> list[Layout]:
    """Every (tp, pp, m) of the module docstring on `nodes` nodes; empty where the GPU count admits none (every TP
    degree that divides the heads and tiles the nodes leaves more than `num_layers` stages: `nodes_with_layouts`)."""
    gpus = nodes * cluster.gpus_per_node
    g = cluster.gpus_per_node
    out = []
    # the TP degrees the engine can shard the model by (check_tp_for_model: heads, KV heads, MLP width)
    for tp in model.tp_degrees():
        if tp > gpus or gpus % tp or not (g % tp == 0 or tp % g == 0):
            continue
        pp = gpus // tp
        if pp > model.num_layers:
            continue
        for m in sorted({1, pp}):
            if batch % m == 0:
                out.append(Layout(tp, pp, m))
    return out


def nodes_with_layouts(
    model: ModelConfig, cluster: ClusterSpec, nodes: int, limit: int
) -> tuple[int | None, int | None]:
    """The nearest node counts below and above `nodes` (within 1..limit) that admit a layout (None: none does).
    A count admits one when some TP degree shards the model (heads, KV heads, MLP), tiles the nodes and leaves at
    most num_layers stages; a prime number of nodes above the layers often admits none (405B: 127 x 4 GPUs)."""

    def admits(n: int) -> bool:
        return bool(candidate_layouts(model, cluster, n, 1))

    below = next((n for n in range(nodes - 1, 0, -1) if admits(n)), None)
    above = next((n for n in range(nodes + 1, limit + 1) if admits(n)), None)
    return below, above


def tp_algos(layout: Layout, cluster: ClusterSpec) -> list[str]:
    if layout.tp == 1:
        return ["none"]
    pl = place(cluster, *tp_group_shape(layout, cluster))
    return [a for a in PLAN_ALGOS if supports(a, cluster, pl) is None]


def fits_somewhere(
    model: ModelConfig, cluster: ClusterSpec, nodes: int, workload: Workload, cuda_graphs: bool, quant: Quantization
) -> bool:
    """Whether any layout of `plan` on `nodes` nodes fits in GPU memory (what `PlanRow.fits` says of its rows).

    The memory does not depend on the all-reduce or on CUDA graphs (`cuda_graphs` is the plan's argument, kept so
    callers pass the same ones): no row is priced."""
    return any(
        memory_per_gpu(model, layout, workload, cluster, quant).fits
        for layout in candidate_layouts(model, cluster, nodes, workload.batch)
    )


def fewest_nodes_that_fit(
    model: ModelConfig,
    cluster: ClusterSpec,
    nodes: int,
    workload: Workload,
    cuda_graphs: bool,
    quant: Quantization,
    limit: int,
) -> int | None:
    """The fewest nodes above `nodes` (where nothing fits) on which some layout fits, up to `limit`; None if
    none does. Every count in turn: fitting is not monotone in the node count (a count whose stages do not divide
    the batch has only one micro-batch, so the whole batch's prompt activations; 8B on Perlmutter, batch 256,
    prompt 4096: 4 and 8 nodes fit, 5-7 do not), so neither doubling nor bisection finds the fewest."""
    return next(
        (n for n in range(nodes + 1, limit + 1) if fits_somewhere(model, cluster, n, workload, cuda_graphs, quant)),
        None,
    )


def largest_batch_that_fits(
    model: ModelConfig, cluster: ClusterSpec, nodes: int, workload: Workload, quant: Quantization
) -> int | None:
    """The largest batch below workload.batch (same prompt and decode) that some layout on `nodes` nodes holds in one
    micro-batch, so that every smaller batch fits too (memory grows with the batch at m = 1); None if not even one
    sequence fits. A larger batch may still fit where its stages divide it (micro-batches shrink the activations)."""

    def fits(b: int) -> bool:
        w = Workload(b, workload.prompt_len, workload.decode_len)
        return any(
            memory_per_gpu(model, Layout(t.tp, t.pp, 1), w, cluster, quant).fits
            for t in candidate_layouts(model, cluster, nodes, 1)
        )

    lo, hi = 0, workload.batch  # fits(lo) (0: nothing asked), not known at hi
    if fits(hi):
        return None  # the caller asks only where the batch does not fit
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo or None


def plan(
    model: ModelConfig,
    cluster: ClusterSpec,
    nodes: int,
    workload: Workload,
    cuda_graphs: bool = True,
    ranges: bool = True,
    quant: Quantization = BF16,
) -> list[PlanRow]:
    """Every layout x algorithm, fitting rows first; each group by the high end of its E2E range (module
    docstring), then by nominal E2E. `ranges=False` (or a cluster without guessed constants): nominal only.
    `quant`: the weights' bytes per parameter and the layer GEMMs' rate (spanllm.perf.quantization)."""
    cases = [
        (layout, algo)
        for layout in candidate_layouts(model, cluster, nodes, workload.batch)
        for algo in tp_algos(layout, cluster)
    ]

    def price(c: ClusterSpec, layout: Layout, algo: str) -> Estimate:
        return estimate(
            model,
            c,
            layout,
            workload,
            "nccl" if algo == "none" else algo,
            cuda_graphs,
            prefill_algo=PREFILL_ALGO,
            quant=quant,
        )

    rows = [PlanRow(layout, algo, price(cluster, layout, algo)) for layout, algo in cases]
    if ranges and cluster.ranges:
        rows = _with_ranges(rows, cluster, price)
    return sorted(
        rows, key=lambda r: (not r.fits, r.e2e_range.high if r.e2e_range else r.estimate.e2e_ms, r.estimate.e2e_ms)
    )


def _with_ranges(rows: list[PlanRow], cluster: ClusterSpec, price) -> list[PlanRow]:
    """Each row priced in every scenario (common to all rows), its E2E / TPOT ranges, and its wins."""
    scen = scenarios(cluster)
    per_row = [{label: price(c, r.layout, r.algo) for label, c in scen} for r in rows]
    wins = [0] * len(rows)
    for label, _ in scen:
        fitting = [i for i, r in enumerate(rows) if r.fits]
        if fitting:
            wins[min(fitting, key=lambda i: per_row[i][label].e2e_ms)] += 1
    out = []
    for r, ests, w in zip(rows, per_row, wins):
        e2e = predict_range(
            lambda c, r=r: price(c, r.layout, r.algo).e2e_ms, cluster, {k: e.e2e_ms for k, e in ests.items()}
        )
        tpot = predict_range(
            lambda c, r=r: price(c, r.layout, r.algo).tpot_ms, cluster, {k: e.tpot_ms for k, e in ests.items()}
        )
        out.append(PlanRow(r.layout, r.algo, r.estimate, e2e, tpot, w, len(scen)))
    return out


def best(rows: list[PlanRow]) -> PlanRow | None:
    fitting = [r for r in rows if r.fits]
    return fitting[0] if fitting else None


def robustness(rows: list[PlanRow]) -> str:
    """One line: whether the best row stays best across the guessed constants' ranges."""
    fitting = [r for r in rows if r.fits]
    b = fitting[0]
    if len(fitting) == 1:
        return "the only layout that fits"
    second = fitting[1]
    if b.wins == b.scenarios:
        return (
            f"holds across the range: fastest in all {b.scenarios} scenarios (nominal, each guess at each end); "
            f"the E2E ranges overlap the runner-up's ({second.layout} {second.algo}) only because the same "
            "guesses move both"
        )
    if b.e2e_range.high < second.e2e_range.low:
        return (
            f"holds across the range: its worst E2E ({b.e2e_range.high:.0f} ms) beats the runner-up's best "
            f"({second.layout} {second.algo}: {second.e2e_range.low:.0f} ms)"
        )
    return (
        f"not settled by the guesses: fastest in {b.wins} of {b.scenarios} scenarios; the runner-up "
        f"({second.layout} {second.algo}, E2E {second.e2e_range.low:.0f}-{second.e2e_range.high:.0f} ms) overlaps; "
        f"measure {b.e2e_range.top(1).split(' ')[0] or 'the network'} first"
    )


def row_to_dict(r: PlanRow, cluster: ClusterSpec) -> dict:
    e = r.estimate
    nodes, rpn = tp_group_shape(r.layout, cluster)
    return {
        "layout": str(r.layout),
        "tp": r.layout.tp,
        "pp": r.layout.pp,
        "micro_batches": r.layout.micro_batches,
        "tp_group": f"{nodes}x{rpn}",
        "allreduce": r.algo,
        "allreduce_variant": e.allreduce_variant,
        "ttft_ms": e.ttft_ms,
        "tpot_ms": e.tpot_ms,
        "e2e_ms": e.e2e_ms,
        "throughput_tok_s": e.throughput_tok_s,
        "prefill_ms": e.prefill_ms,
        "decode_ms": e.decode_ms,
        "decode_idle_fraction": e.decode_idle_fraction,
        "memory_GB": asdict(e.memory) | {"total_GB": e.memory.total_GB},
        "fits": r.fits,
        **(_range_dict(r) if r.e2e_range else {}),
    }


def _range_dict(r: PlanRow) -> dict:
    e, t = r.e2e_range, r.tpot_range
    return {
        "e2e_ms_range": [e.low, e.high],
        "tpot_ms_range": [t.low, t.high],
        "wins": r.wins,
        "scenarios": r.scenarios,
        "e2e_drivers": [
            {
                "constant": d.path,
                "range": [d.low_value, d.high_value],
                "e2e_ms_at_low": e.nominal + d.delta_at_low,
                "e2e_ms_at_high": e.nominal + d.delta_at_high,
            }
            for d in e.drivers
        ],
    }
