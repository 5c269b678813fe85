"""`spanllm perf calibrate`: fit a cluster preset's all-reduce constants to measured sweeps.

Per algorithm, ordinary least squares (numpy) over the measured calls, with the algorithm's schedule
(`allreduce_model.cost_terms`) giving each call's step counts and wire bytes:

    time - launches - base_us [- eager_us]
        = nvlink_steps * nvlink_step_us + net_steps * net_step_us + (wire bytes / link GBps) / bw_efficiency

Unknowns: the step costs of the links the data exercises and one bandwidth efficiency. Launch and base
costs stay as the preset gives them (one topology cannot separate a fixed cost from a per-step cost).
For NCCL the fit lands on its low-latency protocol (LL, ring and tree), the one NCCL picks at the sizes
a sweep up to a few MiB covers; LL128 and Simple keep NCCL's own constants for large messages.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from spanllm.perf.allreduce_model import (
    MODELLED, NCCL_VARIANTS, NOT_MODELLED, cost_terms, model_name, place, time_from_terms_us,
)
from spanllm.perf.hardware import AlgoCost, ClusterSpec, load_cluster, save_cluster
from spanllm.perf.measurements import AllReduceMeasurement, load_results, result_files

FIT_TARGETS = {"nccl": ("nccl_ring/LL", "nccl_tree/LL")}
"""Bench algorithm -> the constant entries a fit on its rows replaces (default: its own name)."""


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


def fit_key(algo: str, ms: list[AllReduceMeasurement], cluster: ClusterSpec) -> str:
    """The AlgoCost entry whose schedule a fit of `algo` uses (NCCL: ring on one host, tree across hosts)."""
    if algo in FIT_TARGETS:
        one_host = all(not place(cluster, m.nodes, m.ranks_per_node).over_network for m in ms)
        return FIT_TARGETS[algo][0 if one_host else 1]
    return algo


def fit_algo_cost(algo: str, ms: list[AllReduceMeasurement], cluster: ClusterSpec) -> Fit:
    """Least-squares step costs and bandwidth efficiency of `algo` from its measurements."""
    if algo in NOT_MODELLED or algo not in MODELLED or algo == "auto":
        raise CalibrationError(f"cannot fit {algo!r}: not a GPU algorithm the model prices")
    if len({m.nbytes for m in ms}) < 2:
        raise CalibrationError(f"{algo}: {len(ms)} rows with {len({m.nbytes for m in ms})} distinct size(s); "
                               "a fit needs at least 2 sizes (sweep with -b/-e covering small and large)")
    key = fit_key(algo, ms, cluster)
    base = cluster.algo(key)
    X, y = [], []
    for m in ms:
        pl = place(cluster, m.nodes, m.ranks_per_node)
        t = cost_terms(key, m.nbytes, cluster, pl)
        fixed = time_from_terms_us(type(t)(), base, cluster, m.graph)  # launches + base (+ eager)
        bw_us = 0.0
        if t.nvlink_wire_bytes:
            bw_us += t.nvlink_wire_bytes / (cluster.nvlink_GBps * 1e3)
        if t.net_wire_bytes:
            bw_us += t.net_wire_bytes / (cluster.nic_GBps_per_gpu * 1e3)
        X.append([t.nvlink_steps, t.net_steps, bw_us])
        y.append(m.time_us - fixed)
    A, b = np.array(X, float), np.array(y, float)
    used = [j for j in range(3) if np.any(A[:, j])]
    coef = np.zeros(3)
    sol, *_ = np.linalg.lstsq(A[:, used], b, rcond=None)
    coef[used] = sol
    notes = []
    if coef[2] <= 0:
        raise CalibrationError(f"{algo}: time does not grow with size in these rows (slope {coef[2]:.3g}); "
                               "include larger sizes so the bandwidth term is visible")
    eff = 1.0 / coef[2]
    if eff > 1.0:
        notes.append(f"fitted efficiency {eff:.2f} > 1 capped at 1 (link bandwidth in the preset too low?)")
        eff = 1.0
    for j, name in ((0, "nvlink_step_us"), (1, "net_step_us")):
        if coef[j] < 0:
            notes.append(f"fitted {name} {coef[j]:.2f} < 0 set to 0 (launch/base costs in the preset too high?)")
            coef[j] = 0.0
    cost = replace(base, nvlink_step_us=float(coef[0]) if 0 in used else base.nvlink_step_us,
                   net_step_us=float(coef[1]) if 1 in used else base.net_step_us, bw_efficiency=float(eff))
    pred = np.array([time_from_terms_us(cost_terms(key, m.nbytes, cluster, place(cluster, m.nodes, m.ranks_per_node)),
                                        cost, cluster, m.graph) for m in ms])
    meas = np.array([m.time_us for m in ms])
    rms = float(np.sqrt(np.mean(((pred - meas) / meas) ** 2)))
    keys = FIT_TARGETS.get(algo, (algo,))
    return Fit(algo, keys, cost, len(ms), rms, tuple(notes))


def calibrate(ms: list[AllReduceMeasurement], cluster: ClusterSpec, max_bytes: int | None = None,
              name: str | None = None) -> tuple[ClusterSpec, list[Fit], list[str]]:
    """A new ClusterSpec with every measured algorithm's constants fitted; plus the fits and what was skipped."""
    by_algo: dict[str, list[AllReduceMeasurement]] = {}
    skipped = []
    for m in ms:
        if max_bytes is not None and m.nbytes > max_bytes:
            continue
        try:
            by_algo.setdefault(model_name(m.algo), []).append(m)
        except ValueError as e:
            skipped.append(str(e))
    algos = dict(cluster.algos)
    fits = []
    for algo, rows in sorted(by_algo.items()):
        try:
            f = fit_algo_cost(algo, rows, cluster)
        except ValueError as e:
            skipped.append(str(e))
            continue
        fits.append(f)
        for key in f.keys:
            algos[key] = replace(cluster.algo(key), nvlink_step_us=f.cost.nvlink_step_us,
                                 net_step_us=f.cost.net_step_us, bw_efficiency=f.cost.bw_efficiency)
        if algo in FIT_TARGETS:  # the library stayed on the fitted protocol over the whole measured range
            top = max(m.nbytes for m in rows)
            for key in NCCL_VARIANTS[algo]:
                if key not in f.keys:
                    algos[key] = replace(cluster.algo(key), picked_above_bytes=max(cluster.algo(key).picked_above_bytes, top))
    spec = replace(cluster, name=name or f"{cluster.name}-calibrated",
                   description=f"{cluster.description}; all-reduce constants fitted to measurements", algos=algos)
    return spec, fits, sorted(set(skipped))


def parse_bytes(text: str) -> int:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    mult = units.get(t[-1:], 1)
    return int(float(t[:-1] if t[-1:] in units else t) * mult)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("files", nargs="*", type=Path,
                        help="`spanllm bench allreduce --json` files (default: every results/*.json of kind allreduce)")
    parser.add_argument("--cluster", default="h200x2", help="preset name or .json/.toml file to start from")
    parser.add_argument("--max-bytes", default="4MiB", help="fit only rows up to this size (the low-latency regime)")
    parser.add_argument("--name", default=None, help="name of the written preset")
    parser.add_argument("--out", type=Path, default=Path("calibrated_cluster.json"), help="preset file to write")
    parser.add_argument("--results", type=Path, default=Path("results"), help="folder searched when no files are given")


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=160) if not Console().is_terminal else Console()
    cluster = load_cluster(args.cluster)
    files = args.files or result_files(args.results)
    ms, _, skipped_files = load_results(files)
    if not ms:
        console.print(f"no all-reduce measurements in {[str(f) for f in files] or str(args.results)}: nothing to fit")
        return 1
    spec, fits, skipped = calibrate(ms, cluster, parse_bytes(args.max_bytes), args.name)
    table = Table(title=f"all-reduce constants fitted on {cluster.name} ({len(ms)} rows, <= {args.max_bytes})")
    for col in ("algorithm", "entries", "rows", "nvlink step us", "net step us", "bw efficiency", "rms rel err", "notes"):
        table.add_column(col)
    for f in fits:
        table.add_row(f.algo, ", ".join(f.keys), str(f.rows), f"{f.cost.nvlink_step_us:.2f}", f"{f.cost.net_step_us:.2f}",
                      f"{f.cost.bw_efficiency:.3f}", f"{f.rms_rel_error:.1%}", "; ".join(f.notes))
    console.print(table)
    for line in skipped_files + skipped:
        console.print(f"skipped: {line}")
    save_cluster(spec, args.out)
    console.print(f"wrote {args.out} (use it with --cluster {args.out})")
    return 0 if fits else 1
