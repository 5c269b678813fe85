"""`spanllm perf validate`: predicted vs measured for every measurement under a results folder, with the error
(what predicts what: spanllm.perf.validate). The report goes where --out says (and its plot next to it, or where
--plot says); without --out nothing is written, so a run never rewrites the committed
results/perf_validation.json unless asked to (`--out results/perf_validation.json`).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from spanllm.errors import UsageError
from spanllm.output_files import save_figure, write_json
from spanllm.perf.engine_fit import format_constant
from spanllm.perf.hardware import ClusterSpecError, load_cluster
from spanllm.perf.validate import validate


def plot_report(report: dict, path: Path, flag: str = "--plot") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 6))
    records = report["records"] + report.get("published", [])
    cats = sorted({r["category"] for r in records})
    for c in cats:
        rs = [r for r in records if r["category"] == c]
        ax.scatter(
            [r["measured"] for r in rs],
            [r["predicted"] for r in rs],
            label=c,
            s=14,
            marker="x" if c.startswith("published/") else "o",
        )
        if c.startswith("published/"):  # the prediction's range over the cluster's guessed constants
            ax.vlines(
                [r["measured"] for r in rs],
                [r["range"][0] for r in rs],
                [r["range"][1] for r in rs],
                lw=0.8,
                color="grey",
            )
    vals = [v for r in records for v in (r["measured"], r["predicted"]) if v > 0]
    lo, hi = min(vals) / 1.5, max(vals) * 1.5
    ax.plot([lo, hi], [lo, hi], "k--", lw=0.8)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("measured (us for all-reduce, ms for engine)")
    ax.set_ylabel("predicted")
    ax.set_title(f"spanllm.perf: predicted vs measured ({report['cluster']})")
    ax.legend(fontsize=7)
    fig.tight_layout()
    save_figure(flag, path, fig, dpi=120)
    plt.close(fig)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--results", type=Path, default=Path("results"), help="folder of measurement JSON files")
    parser.add_argument("--cluster", default="h200x2", help="preset or cluster file the measurements were taken on")
    parser.add_argument(
        "--out", type=Path, default=None, help="write the report (JSON) here; without it nothing is written"
    )
    parser.add_argument("--plot", type=Path, default=None, help="PNG path (default: next to --out, if given)")
    parser.add_argument("--rows", type=int, default=40, help="print at most this many records (all go to the report)")


def _error_table(title: str, key: str, summary: dict):
    from rich.table import Table

    t = Table(title=title)
    for col in (key, "n", "median |err|", "max |err|"):
        t.add_column(col)
    for c, v in summary.items():
        t.add_row(c, str(v["n"]), f"{v['median_abs_rel_error']:.1%}", f"{v['max_abs_rel_error']:.1%}")
    return t


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    if not Path(args.results).is_dir():
        raise UsageError(
            f"--results {str(args.results)!r} is not a folder (pass --results DIR, a folder of `spanllm bench` JSON "
            "files); nothing checked, nothing written"
        )
    try:
        cluster = load_cluster(args.cluster)
    except (ClusterSpecError, OSError, ValueError) as e:
        raise UsageError(f"--cluster {args.cluster!r}: {e}") from None
    if args.rows < 0:
        raise UsageError(f"--rows {args.rows}: must be >= 0 (0 prints no record; all go to the report)")
    if args.out is not None or args.plot is not None:
        from spanllm import checks

        checks.output_file("--out", None if args.out is None else str(args.out))
        if args.plot is None and args.out.suffix.lower() == ".png":
            raise UsageError(f"--out {args.out}: the report is JSON, its plot goes next to it as .png; name it .json")
        checks.png_file("--plot", args.plot or args.out.with_suffix(".png"))  # the default plot path: checked as --plot
    console = Console(width=160) if not Console().is_terminal else Console()
    report = validate(args.results, cluster)
    if not report["records"]:
        raise UsageError(
            f"--results {str(args.results)!r}: no measurement in it that the model predicts ({report['measurements']} "
            "rows read from its `spanllm bench allreduce --json` / `spanllm bench batch` JSON files); nothing "
            "checked, nothing written (run those on a GPU machine first, or pass the folder that holds them)"
        )
    t = Table(title=f"predicted vs measured ({len(report['records'])} records, cluster {report['cluster']})")
    for col in ("category", "measurement", "predicted", "measured", "error", "fitted on"):
        t.add_column(col)
    for r in report["records"][: args.rows]:
        t.add_row(
            r["category"],
            escape(r["label"]),
            f"{r['predicted']:.4g}",
            f"{r['measured']:.4g}",
            f"{r['rel_error']:+.1%}",
            escape(r["fitted_on"]),
        )
    console.print(t)
    console.print(_error_table("median |relative error| per category", "category", report["summary"]))
    if report["summary_by_group"]:
        console.print(
            _error_table(
                "engine rows per group (engine-fit/: the rows the engine constants were fitted to)",
                "category | group",
                report["summary_by_group"],
            )
        )
    if report.get("engine_fit"):
        f = report["engine_fit"]
        k = Table(
            title=f"preset {report['cluster']}: engine constants fitted to {f['rows']} ({f['n_rows']} rows found)"
        )
        for col in ("constant", "preset", "refit from the files"):
            k.add_column(col)
        refit = f["refit"] if isinstance(f["refit"], dict) else {}
        for name, v in f["preset"].items():
            k.add_row(
                name, format_constant(v), format_constant(refit[name]) if name in refit else escape(str(f["refit"]))
            )
        console.print(k)
    if report.get("preset_fit"):
        f = report["preset_fit"]
        k = Table(
            title=f"preset {report['cluster']}: constants fitted to {f['file']} ({f['topology']}, sizes "
            f"{', '.join(str(x) for x in f['sizes'])} B; those rows are not scored)"
        )
        for col in ("entry", "kernels", "base us", "nvlink step us", "bw efficiency", "wire factor"):
            k.add_column(col)
        for key, v in report["preset_constants"].items():
            k.add_row(
                key,
                str(v["kernels"]),
                f"{v['base_us']:.3f}",
                f"{v['nvlink_step_us']:.3f}",
                f"{v['bw_efficiency']:.3f}",
                f"{v['wire_factor']:.2f}",
            )
        console.print(k)
    console.print("method: " + escape(report["method"]))
    c = Table(title="paper headline claims on the presets (no constant fitted to them)")
    for col in ("claim", "cluster", "predicted min / median / max", "claimed", "consistent", "max at"):
        c.add_column(col)
    for k in report["paper_claims"]:
        c.add_row(
            k["claim"],
            k["cluster"],
            f"{k['predicted_min']:.2f} / {k['predicted_median']:.2f} / {k['predicted_max']:.2f}",
            f"{k['band'][0]:.2f}-{k['band'][1]:.2f}",
            "yes" if k["consistent"] else "NO",
            k["where_max"],
        )
    console.print(c)
    p = Table(
        title="published multi-node all-reduce figures: preset (no constant fitted to them; range: the cluster's "
        "guessed constants at their ends) and leave-one-source-out (loso: the hop model fitted to the other sources)"
    )
    for col in ("prediction", "point", "predicted us", "published us", "error", "range us", "inside", "from"):
        p.add_column(col)
    for r in report["published"]:
        p.add_row(
            r["category"].split("/")[1],
            escape(r["label"]),
            f"{r['predicted']:.1f}",
            f"{r['measured']:.1f}",
            f"{r['rel_error']:+.0%}",
            f"{r['range'][0]:.1f}-{r['range'][1]:.1f}",
            "yes" if r["in_range"] else "NO",
            escape(r.get("drivers") or r["fitted_on"]),
        )
    console.print(p)
    s = Table(title="leave-one-source-out residuals per source (explained: median |error| <= 25%)")
    for col in ("source", "network", "rows", "median error", "in range", "explained", "note"):
        s.add_column(col)
    for src, v in report["published_per_source"].items():
        s.add_row(
            src,
            v["network"],
            str(v["n"]),
            f"{v['median_rel_error']:+.0%}",
            f"{v['in_range']}/{v['n']}",
            "yes" if v["explained"] else "NO",
            escape(v["note"]),
        )
    console.print(s)
    console.print(_error_table("published figures: median |relative error|", "category", report["summary_published"]))
    for name, v in report["summary_published"].items():
        if "in_range_share" in v:
            console.print(f"{name}: {v['in_range_share']:.0%} of {v['n']} rows inside their range")
    for line in report["skipped"]:
        console.print(f"skipped: {escape(line)}")
    if args.out is None:
        console.print("no --out: report not written (pass --out FILE to keep it)")
        if args.plot is not None:
            plot_report(report, args.plot)
            console.print(f"wrote {args.plot}")
        return 0
    write_json("--out", args.out, report, indent=2)
    console.print(f"wrote {args.out}")
    png = args.plot or args.out.with_suffix(".png")
    plot_report(report, png, "--plot" if args.plot else "--out")
    console.print(f"wrote {png}")
    return 0
