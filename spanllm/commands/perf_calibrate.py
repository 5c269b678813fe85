"""`spanllm perf calibrate`: fit a cluster preset's all-reduce constants (or, with --engine, its engine
constants) to benchmark JSON, and write the calibrated cluster file. The fit itself: spanllm.perf.calibrate.

A fitted value outside the range the preset guessed for it widens that range in the written file and is
reported; measurements that fit nothing stop the command with the reasons (exit 2), and nothing is written.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict, replace
from pathlib import Path

from spanllm.errors import UsageError
from spanllm.perf.calibrate import calibrate, parse_bytes
from spanllm.perf.hardware import ClusterSpec, ClusterSpecError, load_cluster, save_cluster
from spanllm.perf.measurements import load_results, result_files


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "files",
        nargs="*",
        type=Path,
        help="`spanllm bench allreduce --json` files (default: every results/*.json of kind allreduce)",
    )
    parser.add_argument("--cluster", default="h200x2", help="preset name or .json/.toml file to start from")
    parser.add_argument("--max-bytes", default="4MiB", help="fit only rows up to this size (the low-latency regime)")
    parser.add_argument("--name", default=None, help="name of the written preset")
    parser.add_argument("--out", type=Path, default=Path("calibrated_cluster.json"), help="preset file to write")
    parser.add_argument("--results", type=Path, default=Path("results"), help="folder searched when no files are given")
    parser.add_argument(
        "--engine",
        action="store_true",
        help="fit the engine constants (EngineCost) to the engine rows the preset's engine fit names "
        "(hardware.ENGINE_FITS), all-reduce constants first calibrated on the sweeps",
    )


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    cluster, max_bytes = check_args(args)
    console = Console(width=160) if not Console().is_terminal else Console()
    if getattr(args, "engine", False):
        return run_engine(args, cluster, console)
    files = args.files or result_files(args.results)
    ms, _, skipped_files = load_results(files)
    if not ms:
        where = ", ".join(str(f) for f in args.files) or f"the {len(files)} result files under {args.results}"
        why = f" ({'; '.join(skipped_files)})" if args.files and skipped_files else ""
        raise UsageError(
            f"no all-reduce measurements in {where}{why}: nothing to fit; pass `spanllm bench allreduce --json` files "
            "or --results DIR holding them; nothing written"
        )
    spec, fits, skipped = calibrate(ms, cluster, max_bytes, args.name)
    if not fits:
        files_used = sorted({m.source for m in ms})
        raise UsageError(
            f"{len(ms)} all-reduce rows in {len(files_used)} file(s) ({', '.join(files_used)}), none usable for a fit "
            f"on {cluster.name} (--max-bytes {args.max_bytes}): "
            f"{'; '.join(skipped) or 'no algorithm the model prices'}; nothing written"
        )
    table = Table(title=f"all-reduce constants fitted on {cluster.name} ({len(ms)} rows, <= {args.max_bytes})")
    for col in (
        "algorithm",
        "entries",
        "rows",
        "base us",
        "nvlink step us",
        "net step us",
        "bw efficiency",
        "rms rel err",
        "notes",
    ):
        table.add_column(col)
    for f in fits:
        base = f"{f.cost.base_us:.2f}{'' if f.fitted_base else ' (preset)'}"
        table.add_row(
            f.algo,
            ", ".join(f.keys),
            str(f.rows),
            base,
            f"{f.cost.nvlink_step_us:.2f}",
            f"{f.cost.net_step_us:.2f}",
            f"{f.cost.bw_efficiency:.3f}",
            f"{f.rms_rel_error:.1%}",
            "; ".join(f.notes),
        )
    console.print(table)
    for f in fits:
        for line in f.widened:
            console.print(f"range widened to hold the fit ({f.algo}): {line}")
    other = [s for s in skipped_files if "is not a measurement the model predicts" in s or "engine model" in s]
    for line in [s for s in skipped_files if s not in other] + skipped:
        console.print(f"skipped: {line}")
    if other:
        console.print(f"skipped: {len(other)} files that hold no all-reduce rows (engine runs, tuning tables, ...)")
    save_cluster(spec, args.out)
    console.print(f"wrote {args.out} (use it with --cluster {args.out})")
    return 0


def check_args(args: argparse.Namespace) -> tuple[ClusterSpec, int]:
    """Every argument, before any file is read: the cluster, --max-bytes, the files, the output's folder."""
    from spanllm import checks

    try:
        cluster = load_cluster(args.cluster)
    except (ClusterSpecError, OSError, ValueError) as e:
        raise UsageError(f"--cluster {args.cluster!r}: {e}") from None
    try:
        max_bytes = parse_bytes(args.max_bytes)
    except (ValueError, IndexError):
        max_bytes = 0
    if max_bytes < 1:
        raise UsageError(f"--max-bytes {args.max_bytes!r}: give a size >= 1 byte, e.g. 4MiB, 512K or 65536")
    checks.not_empty(
        "--name",
        args.name,
        f"give the written preset a name, e.g. --name {cluster.name}-calibrated, or leave --name out for the default",
    )
    missing = [str(f) for f in args.files if not Path(f).is_file()]
    if missing:
        raise UsageError(f"no such file: {', '.join(missing)}; pass `spanllm bench allreduce --json` files")
    if not args.files and not Path(args.results).is_dir():
        raise UsageError(f"--results {str(args.results)!r} is not a folder; pass the folder of benchmark JSON files")
    checks.output_file("--out", str(args.out))
    return cluster, max_bytes


def run_engine(args: argparse.Namespace, cluster: ClusterSpec, console) -> int:
    """`spanllm perf calibrate --engine`: EngineCost fitted to the rows hardware.ENGINE_FITS names."""
    from rich.markup import escape
    from rich.table import Table

    from spanllm.perf.engine_fit import fit_engine, fit_prefill_size_exponent, format_constant
    from spanllm.perf.hardware import ENGINE_FITS, PREFILL_SIZE_FITS

    spec = ENGINE_FITS.get(cluster.name)
    if spec is None:
        raise UsageError(
            f"--engine: cluster {cluster.name!r} names no engine rows to fit (presets with an engine fit: "
            f"{', '.join(ENGINE_FITS)}); nothing written"
        )
    ar, eng, _ = load_results(args.files or result_files(args.results))
    if ar:
        cluster = replace(calibrate(ar, cluster)[0], name=cluster.name)
    rows = [e for e in eng if spec.selects(e.source, e.row)]
    if not rows:
        raise UsageError(f"--engine: no engine rows found for {spec.describe()} under {args.results}; nothing written")
    fit = fit_engine(rows, cluster, cluster.engine.attends_max_seq_len)
    t = Table(title=f"engine constants fitted to {len(rows)} rows: {spec.describe()}")
    for col in ("constant", "fitted", "preset now"):
        t.add_column(col)
    for name, v in asdict(fit.cost).items():
        t.add_row(name, format_constant(v), format_constant(getattr(cluster.engine, name)))
    console.print(t)
    console.print(
        "rms relative error over the rows fitted: " + ", ".join(f"{m} {v:.1%}" for m, v in fit.rms_rel_error.items())
    )
    for label in fit.rows:
        console.print(f"  fitted: {escape(label)}")
    cost = fit.cost
    size_rows_spec = PREFILL_SIZE_FITS.get(cluster.name)
    size_rows = [e for e in eng if size_rows_spec and size_rows_spec.selects(e.source, e.row)]
    if size_rows:  # the prefill efficiency's size exponent, refitted on its own rows with the new constants
        alpha, rms = fit_prefill_size_exponent(size_rows, replace(cluster, engine=cost))
        cost = replace(cost, prefill_size_exponent=alpha)
        console.print(
            f"prefill_size_exponent {alpha:.3f} fitted to the TTFT of {len(size_rows)} rows "
            f"({size_rows_spec.describe()}): rms relative error {rms:.1%}"
        )
    spec_out = replace(cluster, name=args.name or f"{cluster.name}-engine-fit", engine=cost)
    save_cluster(spec_out, args.out)
    console.print(f"wrote {args.out} (use it with --cluster {args.out})")
    return 0
