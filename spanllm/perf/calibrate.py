"""`spanllm perf calibrate`: fit a cluster preset's all-reduce constants to measured sweeps.

Per algorithm, least squares (numpy) over the measured calls, with the algorithm's schedule
(`allreduce_model.cost_terms`, with the nvrar launch each row names) giving each call's step counts,
wire bytes and local bytes:

    time - launches [- eager_us] - local bytes / HBM
        = base_us + nvlink_steps * nvlink_step_us + net_steps * net_step_us
          + (wire bytes / link GBps) / bw_efficiency

Residuals are relative (each row weighted by 1 / its measured time): the error the validation reports,
and small messages count as much as large ones. Unknowns: the step costs of the links the data
exercises, one bandwidth efficiency, and base_us when the rows separate it from the step costs (two
different step counts, e.g. nvrar one-shot = 1 phase and reduce-scatter = 2 phases on one node);
otherwise base_us stays as the preset gives it (a constant step count cannot be told apart from a
fixed cost). Launch costs (graph_node_us) and HBM bandwidth are the preset's measured figures.
For NCCL, rows up to the size where the preset lets NCCL leave its low-latency protocol fit LL (ring
and tree); larger rows, when at least two sizes exist, fit Simple (ring and tree) -- NCCL does not
report which protocol it ran, so this is the coarse two-regime split its tuner makes.

`--engine`: fit the cluster's engine constants (hardware.EngineCost) instead, to the batch / study rows
the preset's engine fit names (hardware.ENGINE_FITS), after calibrating the all-reduce constants on the
sweeps under --results as above (spanllm.perf.engine_fit); `perf validate` does the same.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from spanllm.perf.allreduce_model import (
    MODELLED,
    NCCL_VARIANTS,
    NOT_MODELLED,
    NvrarLaunch,
    allreduce_cost,
    cost_terms,
    fixed_us,
    local_us,
    model_name,
    parse_launch,
    place,
    time_from_terms_us,
)
from spanllm.perf.hardware import AlgoCost, ClusterSpec
from spanllm.perf.measurements import AllReduceMeasurement, ran_launch

FIT_TARGETS = {"nccl": ("nccl_ring/LL", "nccl_tree/LL")}
"""Bench algorithm -> the constant entries a fit on its rows replaces (default: its own name)."""
LARGE_FIT_TARGETS = {"nccl": ("nccl_ring/Simple", "nccl_tree/Simple")}
"""Bench algorithm -> the entries its rows above the low-latency protocol's range replace."""


class CalibrationError(ValueError):
    """Measurements that cannot determine the constants asked for."""


@dataclass(frozen=True)
class Fit:
    algo: str
    keys: tuple[str, ...]  # AlgoCost entries replaced
    cost: AlgoCost
    rows: int
    rms_rel_error: float  # over the rows it was fitted on
    notes: tuple[str, ...]
    fitted_base: bool = False  # base_us came from the rows (else from the preset)
    widened: tuple[str, ...] = ()  # ranges of the preset widened to hold the fitted values (widen_ranges)


def ll_limit_bytes(algo: str, cluster: ClusterSpec) -> int:
    """Largest size the fitted low-latency protocol covers (0: no limit), from the preset's protocol switch."""
    if algo not in LARGE_FIT_TARGETS:
        return 0
    return min(cluster.algo(k).picked_above_bytes for k in LARGE_FIT_TARGETS[algo])


def fit_key(algo: str, ms: list[AllReduceMeasurement], cluster: ClusterSpec, large: bool = False) -> str:
    """The AlgoCost entry whose schedule a fit of `algo` uses (NCCL: ring on one host, tree across hosts)."""
    targets = (LARGE_FIT_TARGETS if large else FIT_TARGETS).get(algo)
    if targets:
        one_host = all(not place(cluster, m.nodes, m.ranks_per_node).over_network for m in ms)
        return targets[0 if one_host else 1]
    return algo


def row_launch(m: AllReduceMeasurement, cluster: ClusterSpec) -> NvrarLaunch | None:
    """The nvrar launch a row ran with: from its `ran` column, else the one the model picks on `cluster`."""
    if m.algo != "nvrar":
        return None
    given = parse_launch(m.launch)
    if given is not None:
        return given
    variant = allreduce_cost("nvrar", m.nbytes, cluster, m.nodes, m.ranks_per_node, m.graph)[1]
    return parse_launch(ran_launch(variant))


def _lstsq(A: np.ndarray, b: np.ndarray, cols: list[int]) -> np.ndarray:
    coef = np.zeros(A.shape[1])
    sol, *_ = np.linalg.lstsq(A[:, cols], b, rcond=None)
    coef[cols] = sol
    return coef


def fit_algo_cost(algo: str, ms: list[AllReduceMeasurement], cluster: ClusterSpec, large: bool = False) -> Fit:
    """Least-squares (relative) base, step costs and bandwidth efficiency of `algo` from its measurements."""
    if algo in NOT_MODELLED or algo not in MODELLED or algo == "auto":
        raise CalibrationError(f"cannot fit {algo!r}: not a GPU algorithm the model prices")
    if len({m.nbytes for m in ms}) < 2:
        raise CalibrationError(
            f"{algo}: {len(ms)} rows with {len({m.nbytes for m in ms})} distinct size(s); "
            "a fit needs at least 2 sizes (sweep with -b/-e covering small and large)"
        )
    key = fit_key(algo, ms, cluster, large)
    base = cluster.algo(key)
    X, y, w, terms = [], [], [], []
    for m in ms:
        pl = place(cluster, m.nodes, m.ranks_per_node)
        t = cost_terms(key, m.nbytes, cluster, pl, row_launch(m, cluster))
        terms.append(t)
        fixed = fixed_us(replace(base, base_us=0.0), cluster, m.graph) + local_us(t, cluster)
        bw_us = 0.0
        if t.nvlink_wire_bytes:
            bw_us += t.nvlink_wire_bytes / (cluster.nvlink_GBps * 1e3)
        if t.net_wire_bytes:
            bw_us += t.net_wire_bytes / (cluster.nic_GBps_per_gpu * 1e3)
        X.append([1.0, t.nvlink_steps, t.net_steps, bw_us])
        y.append(m.time_us - fixed)
        w.append(1.0 / m.time_us)
    W = np.array(w)
    A, b = np.array(X, float) * W[:, None], np.array(y, float) * W
    cols = [j for j in (1, 2, 3) if np.any(A[:, j])]
    if np.linalg.matrix_rank(A[:, [0] + cols]) > np.linalg.matrix_rank(A[:, cols]):
        cols = [0] + cols  # the rows separate a fixed cost from the step costs
    else:
        b = b - base.base_us * W  # keep the preset's base_us
    notes = []
    held = {0: base.base_us, 1: base.nvlink_step_us, 2: base.net_step_us}  # values of columns not fitted
    coef = _lstsq(A, b, cols)
    for j, name in ((0, "base_us"), (1, "nvlink_step_us"), (2, "net_step_us")):
        if j in cols and coef[j] < 0:
            if j:
                held[j] = 0.0  # a step cost; a negative base is held at the preset's (already in held)
            notes.append(
                f"fitted {name} {coef[j]:.2f} < 0: held at {held[j]:.2f} and refitted "
                "(launch/base costs in the preset too high?)"
            )
            if j == 0:
                b = b - base.base_us * W
            cols.remove(j)
            coef = _lstsq(A, b, cols)
    if coef[3] <= 0:
        raise CalibrationError(
            f"{algo}: time does not grow with size in these rows (slope {coef[3]:.3g}); "
            "include larger sizes so the bandwidth term is visible"
        )
    eff = 1.0 / coef[3]
    if eff > 1.0:
        notes.append(f"fitted efficiency {eff:.2f} > 1 capped at 1 (link bandwidth in the preset too low?)")
        eff = 1.0
    value = {j: float(coef[j]) if j in cols else held[j] for j in (0, 1, 2)}
    cost = replace(base, base_us=value[0], nvlink_step_us=value[1], net_step_us=value[2], bw_efficiency=float(eff))
    pred = np.array([time_from_terms_us(t, cost, cluster, m.graph) for t, m in zip(terms, ms)])
    meas = np.array([m.time_us for m in ms])
    rms = float(np.sqrt(np.mean(((pred - meas) / meas) ** 2)))
    keys = (LARGE_FIT_TARGETS if large else FIT_TARGETS).get(algo, (algo,))
    return Fit(algo, keys, cost, len(ms), rms, tuple(notes), fitted_base=0 in cols)


def calibrate(
    ms: list[AllReduceMeasurement], cluster: ClusterSpec, max_bytes: int | None = None, name: str | None = None
) -> tuple[ClusterSpec, list[Fit], list[str]]:
    """A new ClusterSpec with every measured algorithm's constants fitted; plus the fits and what was skipped."""
    by_algo: dict[str, list[AllReduceMeasurement]] = {}
    skipped = []
    misplaced: dict[tuple[str, int, int], str] = {}
    for m in ms:
        if max_bytes is not None and m.nbytes > max_bytes:
            continue
        try:
            place(cluster, m.nodes, m.ranks_per_node)
        except ValueError as e:  # a topology this cluster cannot hold (e.g. 1x2 rows on 1 GPU per node)
            misplaced[(m.algo, m.nodes, m.ranks_per_node)] = str(e)
            continue
        try:
            by_algo.setdefault(model_name(m.algo), []).append(m)
        except ValueError as e:
            skipped.append(str(e))
    skipped += [f"{a} {n}x{g} rows left out: {why}" for (a, n, g), why in sorted(misplaced.items())]
    algos = dict(cluster.algos)
    fits = []
    for algo, rows in sorted(by_algo.items()):
        limit = ll_limit_bytes(algo, cluster)
        small = [m for m in rows if not limit or m.nbytes <= limit]
        large = [m for m in rows if limit and m.nbytes > limit]
        regimes = [(False, small)] + ([(True, large)] if len({m.nbytes for m in large}) >= 2 else [])
        if large and len(regimes) == 1:
            skipped.append(
                f"{algo}: {len(large)} row(s) above {limit} bytes (NCCL's large-message protocols) "
                "left out: at least 2 sizes are needed to fit them"
            )
        for is_large, part in regimes:
            try:
                f = fit_algo_cost(algo, part, cluster, large=is_large)
            except ValueError as e:
                skipped.append(str(e))
                continue
            fits.append(f)
            for key in f.keys:
                own = cluster.algo(key)  # an entry keeps its own base_us unless the rows determined one
                algos[key] = replace(
                    own,
                    base_us=f.cost.base_us if f.fitted_base else own.base_us,
                    nvlink_step_us=f.cost.nvlink_step_us,
                    net_step_us=f.cost.net_step_us,
                    bw_efficiency=f.cost.bw_efficiency,
                )
        if algo in FIT_TARGETS and not large:  # the library stayed on the fitted protocol over the measured range
            top = max(m.nbytes for m in rows)
            for key in NCCL_VARIANTS[algo]:
                if key not in FIT_TARGETS[algo]:
                    algos[key] = replace(algos[key], picked_above_bytes=max(cluster.algo(key).picked_above_bytes, top))
        elif algo in LARGE_FIT_TARGETS and len(regimes) == 2:  # only the fitted protocols above the switch
            for key in NCCL_VARIANTS[algo]:
                if key not in FIT_TARGETS[algo] + LARGE_FIT_TARGETS[algo]:
                    top = max(m.nbytes for m in rows)
                    algos[key] = replace(algos[key], picked_above_bytes=max(cluster.algo(key).picked_above_bytes, top))
    ranges, widened = widen_ranges(cluster.ranges, algos)
    fits = [replace(f, widened=tuple(w for w in widened if w.split(".")[1] in f.keys)) for f in fits]
    spec = replace(
        cluster,
        name=name or f"{cluster.name}-calibrated",
        description=f"{cluster.description}; all-reduce constants fitted to measurements",
        algos=algos,
        ranges=ranges,
    )
    return spec, fits, sorted(set(skipped))


def widen_ranges(
    ranges: dict[str, tuple[float, float]], algos: dict[str, AlgoCost]
) -> tuple[dict[str, tuple[float, float]], list[str]]:
    """The preset's ranges, each one of a fitted entry widened to hold its fitted value, and a line per widened
    range ('algos.nccl_tree/LL.net_step_us: (5.0, 13.0) -> (2.7, 13.0), fitted 2.7'). A fit that lands outside
    the guessed range is the usual case on a new cluster: the guess was wrong, the measurement stands."""
    out, widened = dict(ranges), []
    for path, (lo, hi) in ranges.items():
        parts = path.split(".")
        if parts[0] != "algos" or len(parts) != 3 or parts[1] not in algos:
            continue
        value = float(getattr(algos[parts[1]], parts[2]))
        if not lo <= value <= hi:
            out[path] = (min(lo, value), max(hi, value))
            widened.append(f"{path}: ({lo:g}, {hi:g}) -> ({out[path][0]:g}, {out[path][1]:g}), fitted {value:.3g}")
    return out, widened


def parse_bytes(text: str) -> int:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    mult = units.get(t[-1:], 1)
    return int(float(t[:-1] if t[-1:] in units else t) * mult)
