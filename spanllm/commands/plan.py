"""`spanllm plan`: rank parallel layouts for a model on a cluster.

Two questions. Without --serve, a static batch (spanllm.perf.plan): every TP x PP layout x all-reduce algorithm
priced for TTFT / TPOT / E2E of `--batch` sequences of `--prompt` + `--decode` tokens. With --serve, serving
(spanllm.perf.serving): the engine's scheduler replayed on a trace (a `--samples-file`, e.g. the committed
ShareGPT sample, or `--lengths P:O`) arriving at `--request-rate`, each step priced by the calibrated step cost;
every (TP, PP, replicas) layout with its output tok/s and TTFT / TPOT percentiles, with ranges, against an SLO.

Every argument is checked before any work; a bad one stops the command with one line naming the flag, the
value, what is allowed and the fix.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict
from pathlib import Path

from spanllm.errors import UsageError
from spanllm.model.config import ModelConfigError
from spanllm.output_files import save_figure, write_json
from spanllm.perf.hardware import PRESETS, ClusterSpecError, load_cluster
from spanllm.perf.inference import Workload, tp_group_shape
from spanllm.perf.model_shape import MODELS, get_model
from spanllm.perf.plan import (
    PREFILL_ALGO,
    PlanRow,
    best,
    candidate_layouts,
    fewest_nodes_that_fit,
    fits_somewhere,
    largest_batch_that_fits,
    nodes_with_layouts,
    plan,
    robustness,
    row_to_dict,
)
from spanllm.perf.quantization import get_quantization

MAX_NODES = 4096  # a bound on typos, far above any cluster the presets describe
MAX_SEED = 2**32 - 1  # numpy's legacy RandomState, which draws the arrivals (spanllm.bench.serve_metrics)
# Below this the replay's clock (arrival times up to --num-requests / rate seconds) loses the step times' precision
# (at 1e-300 every TTFT and TPOT came out 0); one request every 10,000 s is far below any serving question.
MIN_REQUEST_RATE = 1e-4
# Each mode's own options, None when not given (check_args refuses them in the other mode, then fills these in).
STATIC_DEFAULTS = {"batch": 16, "prompt": 2048, "decode": 256}
SERVE_DEFAULTS = {
    "num_requests": 1000,
    "request_rate": math.inf,
    "burstiness": 1.0,
    "seed": 0,
    "max_num_seqs": 256,
    "max_num_batched_tokens": 8192,
    "min_admit": 1,
}
STATIC_ONLY = (*STATIC_DEFAULTS, "no_cuda_graphs", "plot")
SERVE_ONLY = (*SERVE_DEFAULTS, "samples_file", "lengths", "gpus", "slo_tpot_ms", "slo_ttft_ms")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="llama3.1-405b", help=f"one of {', '.join(MODELS)}")
    parser.add_argument(
        "--cluster",
        default="perlmutter",
        help=f"preset ({', '.join(PRESETS)}) or a .json/.toml cluster file",
    )
    parser.add_argument("--nodes", type=int, default=8, help=f"nodes of the cluster to use (1..{MAX_NODES})")
    parser.add_argument("--batch", type=int, default=None, help="static batch: sequences (default: 16)")
    parser.add_argument(
        "--prompt", type=int, default=None, help="static batch: prompt tokens per sequence (default: 2048)"
    )
    parser.add_argument(
        "--decode", type=int, default=None, help="static batch: generated tokens per sequence (default: 256)"
    )
    parser.add_argument("--no-cuda-graphs", action="store_true", help="static batch: price decode launched eagerly")
    parser.add_argument(
        "--quantization",
        default=None,
        metavar="fp8",
        help="static batch: FP8 linear-layer weights (1 byte; embedding, LM head and KV cache stay bf16) and FP8 "
        "GEMMs at the cluster's fp8_gemm_speedup (default: bf16)",
    )
    parser.add_argument(
        "--kv-cache-dtype",
        choices=("auto", "fp8"),
        default="auto",
        help="static batch: fp8 = the KV cache in e4m3 (one byte an element: half the memory and the decode "
        "attention's reads; spanllm's --kv-cache-dtype fp8)",
    )
    parser.add_argument("--top", type=int, default=0, help="show only the best N rows (0: all)")
    parser.add_argument("--json", type=Path, default=None, help="also write every row to this JSON file ('-': stdout)")
    parser.add_argument("--plot", type=Path, default=None, help="static batch: a PNG of TTFT + decode time per row")
    parser.add_argument(
        "--no-ranges", action="store_true", help="nominal constants only: no ranges over the preset's guessed constants"
    )
    s = parser.add_argument_group("serving (--serve)")
    s.add_argument("--serve", action="store_true", help="plan for serving a trace instead of a static batch")
    s.add_argument("--samples-file", type=Path, default=None, help="requests (`bench ... --save-samples` JSON)")
    s.add_argument("--lengths", default=None, metavar="P:O", help="instead of a samples file: prompt:output tokens")
    s.add_argument("--num-requests", type=int, default=None, help="with --lengths: how many requests (default: 1000)")
    s.add_argument("--request-rate", type=float, default=None, help="requests per second (default: inf, all at once)")
    s.add_argument(
        "--burstiness", type=float, default=None, help="arrival gaps ~ gamma(burstiness) (default: 1, Poisson)"
    )
    s.add_argument("--seed", type=int, default=None, help="arrival draws (as `bench serve --seed`; default: 0)")
    s.add_argument("--gpus", type=int, default=None, help="GPUs to use in all (default: nodes x GPUs per node)")
    s.add_argument(
        "--max-num-seqs", type=int, default=None, help="the engine's max_num_seqs (per replica; default: 256)"
    )
    s.add_argument(
        "--max-num-batched-tokens", type=int, default=None, help="the engine's token budget per step (default: 8192)"
    )
    s.add_argument(
        "--min-admit", type=int, default=None, help="the engine's admission batching (serve --min-admit; default: 1)"
    )
    s.add_argument("--slo-tpot-ms", type=float, default=None, help="target p99 TPOT (ms)")
    s.add_argument("--slo-ttft-ms", type=float, default=None, help="target p99 TTFT (ms)")


def _positive_int(name: str, value: int, low: int = 1, high: int | None = None, fix: str = "") -> None:
    if not isinstance(value, int) or value < low or (high is not None and value > high):
        allowed = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise UsageError(f"{name} {value}: must be an integer {allowed}{'; ' + fix if fix else ''}")


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def check_modes(args: argparse.Namespace) -> None:
    """Refuse an option of the other mode (it would be ignored), then fill in this mode's defaults."""
    if args.serve:
        given = [d for d in STATIC_ONLY if getattr(args, d) not in (None, False)]
        if given:
            d = given[0]
            what = "draws the static batch's rows (serving has no plot)" if d == "plot" else "prices the static batch"
            value = "" if d == "no_cuda_graphs" else f" {getattr(args, d)}"
            raise UsageError(
                f"{_flag(d)}{value}: {what}, and --serve plans serving a trace (--samples-file / --lengths) "
                f"instead; drop {_flag(d)}, or drop --serve"
            )
    else:
        given = [d for d in SERVE_ONLY if getattr(args, d) is not None]
        if given:
            d = given[0]
            raise UsageError(
                f"{_flag(d)} {getattr(args, d)}: an option of serving (--serve); without --serve plan prices a "
                f"static batch (--batch / --prompt / --decode); add --serve, or drop {_flag(d)}"
            )
    for d, v in {**STATIC_DEFAULTS, **SERVE_DEFAULTS}.items():
        if getattr(args, d) is None:
            setattr(args, d, v)


def check_args(args: argparse.Namespace):
    """(model, cluster) once every argument is known to be usable; else one UsageError naming the flag."""
    if (args.json is not None and str(args.json) != "-") or args.plot is not None:
        from spanllm import checks

        if args.json is not None and str(args.json) != "-":
            checks.output_file("--json", str(args.json))
        checks.png_file("--plot", args.plot)
    try:
        model = get_model(args.model)
    except ModelConfigError:
        raise UsageError(f"--model {args.model!r}: unknown model; choose one of {', '.join(MODELS)}") from None
    try:
        cluster = load_cluster(args.cluster)
    except (ClusterSpecError, OSError, ValueError) as e:
        if Path(str(args.cluster)).suffix:
            raise UsageError(f"--cluster {args.cluster!r}: {e}") from None
        raise UsageError(
            f"--cluster {args.cluster!r}: unknown cluster; choose one of {', '.join(PRESETS)}, or pass a .json / "
            ".toml cluster file"
        ) from None
    high = MAX_NODES if cluster.has_network else 1
    fix = "" if cluster.has_network else f"cluster {cluster.name} is one host without a network"
    _positive_int("--nodes", args.nodes, 1, high, fix)
    _positive_int("--top", args.top, 0)
    if args.quantization is not None and args.quantization != "fp8":
        raise UsageError(f"--quantization {args.quantization!r}: only fp8 is modelled; leave it out for bf16")
    if args.quantization is not None and args.serve:
        raise UsageError("--quantization fp8 prices the static batch; --serve prices bf16 only (drop one of them)")
    if args.kv_cache_dtype != "auto" and args.serve:
        raise UsageError("--kv-cache-dtype fp8 prices the static batch; --serve prices bf16 only (drop one of them)")
    for flag, value in (("--quantization", args.quantization), ("--kv-cache-dtype", args.kv_cache_dtype)):
        if value == "fp8" and not has_fp8(cluster):
            raise UsageError(
                f"{flag} fp8: cluster {cluster.name}'s {cluster.gpu} has no FP8 tensor cores (fp8_gemm_speedup "
                f"{cluster.fp8_gemm_speedup:g}), and spanllm refuses FP8 below compute capability 8.9 (Ada, Hopper); "
                f"drop {flag}, or give a cluster file with fp8_gemm_speedup > 1 for an FP8 GPU"
            )
    if args.serve:
        _serve_flags_that_would_be_ignored(args)
    check_modes(args)
    if not args.serve:
        for flag in ("--batch", "--prompt", "--decode"):
            _positive_int(flag, getattr(args, flag[2:]), 1, 10**7)
        _fits_context(model, "--prompt + --decode", args.prompt, args.decode)
        _has_layouts(args, model, cluster)
        return model, cluster
    gpus_all = args.nodes * cluster.gpus_per_node
    if args.gpus is not None:
        _positive_int("--gpus", args.gpus, 1, gpus_all, f"{args.nodes} node(s) x {cluster.gpus_per_node} GPUs")
    _positive_int("--max-num-seqs", args.max_num_seqs, 1, 65536)
    _positive_int("--max-num-batched-tokens", args.max_num_batched_tokens, 1, 1 << 20)
    _positive_int("--min-admit", args.min_admit, 1, args.max_num_seqs, "at most --max-num-seqs")
    _positive_int("--num-requests", args.num_requests, 1, 10**6)
    if not args.request_rate >= MIN_REQUEST_RATE:
        raise UsageError(
            f"--request-rate {args.request_rate:g}: must be > 0 requests per second and at least {MIN_REQUEST_RATE:g} "
            "(one every 10,000 s; slower, the replay's clock loses the step times), or inf (all at once)"
        )
    _positive_int("--seed", args.seed, 0, MAX_SEED, "numpy's RandomState draws the arrivals")
    if not (args.burstiness > 0 and math.isfinite(args.burstiness)):
        raise UsageError(f"--burstiness {args.burstiness:g}: must be a finite number > 0 (1: Poisson arrivals)")
    for flag in ("--slo-tpot-ms", "--slo-ttft-ms"):
        v = getattr(args, flag[2:].replace("-", "_"))
        if v is not None and not (v > 0 and math.isfinite(v)):
            raise UsageError(f"{flag} {v:g}: must be a finite number of milliseconds > 0")
    if args.samples_file is not None and args.lengths is not None:
        raise UsageError(
            f"--samples-file {str(args.samples_file)!r} and --lengths {args.lengths!r} are exclusive: the requests "
            "come from one of them; drop one"
        )
    if args.samples_file is None and args.lengths is None:
        raise UsageError(
            "--serve needs the requests, one of: --samples-file FILE (e.g. "
            "results/h200/inputs/sharegpt_llama3_seed0_n1000.json) or --lengths P:O (prompt and output tokens)"
        )
    if args.lengths is not None:
        try:
            p, o = (int(v) for v in args.lengths.split(":"))
        except ValueError:
            p = o = 0
        if p < 1 or o < 1:
            raise UsageError(f"--lengths {args.lengths!r}: expected PROMPT:OUTPUT, two integers >= 1, e.g. 1024:128")
        _fits_context(model, f"--lengths {args.lengths}", p, o)
    elif not Path(args.samples_file).is_file():
        raise UsageError(f"--samples-file {str(args.samples_file)!r}: no such file")
    return model, cluster


def has_fp8(cluster) -> bool:
    """Whether the cluster's GPUs run spanllm's FP8: FP8 tensor cores, which a ClusterSpec states as
    fp8_gemm_speedup > 1 (1.0, the default of a cluster file that leaves it out, means none: an A100)."""
    return cluster.fp8_gemm_speedup > 1.0


def _serve_flags_that_would_be_ignored(args: argparse.Namespace) -> None:
    """Refuse a serving option that the trace would not use: --burstiness when every request arrives at once (rate
    inf), and --num-requests with a samples file (its requests are the file's). (--seed stays allowed at rate inf,
    as `bench serve` takes one seed for every rate of a sweep; it draws nothing there.)"""
    if (args.request_rate is None or math.isinf(args.request_rate)) and args.burstiness is not None:
        raise UsageError(
            f"--burstiness {args.burstiness:g}: shapes the arrival gaps, but at --request-rate inf (the default) every "
            "request arrives at t=0; give --request-rate R, or drop --burstiness"
        )
    if args.num_requests is not None and args.samples_file is not None:
        raise UsageError(
            f"--num-requests {args.num_requests}: counts the requests of --lengths; --samples-file "
            f"{str(args.samples_file)!r} brings its own requests; drop --num-requests (or use --lengths P:O)"
        )


def _has_layouts(args: argparse.Namespace, model, cluster) -> None:
    """Refuse a node count that admits no TP x PP layout of the model (spanllm.perf.plan.candidate_layouts)."""
    if candidate_layouts(model, cluster, args.nodes, args.batch):
        return
    high = MAX_NODES if cluster.has_network else 1
    below, above = nodes_with_layouts(model, cluster, args.nodes, high)
    fix = " or ".join(f"--nodes {n}" for n in (below, above) if n is not None) or "a cluster of another node size"
    g = cluster.gpus_per_node
    raise UsageError(
        f"--nodes {args.nodes}: {args.nodes} x {g} = {args.nodes * g} GPUs admit no layout of {model.label}: "
        f"the TP degree must be one that shards it ({', '.join(map(str, model.tp_degrees()))}) and divide a "
        f"node's {g} GPUs or span whole nodes, "
        f"and PP = GPUs / TP is at most its {model.num_layers} layers; use {fix}"
    )


def _fits_context(model, what: str, prompt: int, output: int, fix: str = "") -> None:
    """A sequence of prompt + output tokens within the model's context (max_position_embeddings), as the engine
    admits it."""
    limit = model.max_position_embeddings
    if prompt + output > limit:
        raise UsageError(
            f"{what}: {prompt} + {output} = {prompt + output} tokens exceed the {limit}-token context of "
            f"{model.label} (max_position_embeddings), which the engine would refuse; "
            + (fix or f"give at most {limit} in all")
        )


def run(args: argparse.Namespace) -> int:
    model, cluster = check_args(args)
    if args.serve:
        return run_serve(args, model, cluster)
    return run_static(args, model, cluster)


def run_static(args: argparse.Namespace, model, cluster) -> int:
    from rich.console import Console
    from rich.table import Table

    workload = Workload(args.batch, args.prompt, args.decode)
    quant = _quantization(args, args.quantization)
    rows = plan(model, cluster, args.nodes, workload, not args.no_cuda_graphs, not args.no_ranges, quant)
    console = Console(width=170) if not Console().is_terminal else Console()
    if not rows:
        console.print(f"no layout of {model.name} fits the rules on {args.nodes} x {cluster.gpus_per_node} GPUs")
        return 1
    doc = {
        "model": model.name,
        "cluster": cluster.name,
        "nodes": args.nodes,
        "gpus": args.nodes * cluster.gpus_per_node,
        "workload": asdict(workload),
        "cuda_graphs": not args.no_cuda_graphs,
        "prefill_allreduce": PREFILL_ALGO,
        "quantization": quant.name,
        "rows": [row_to_dict(r, cluster) for r in rows],
    }
    b = best(rows)
    doc["best"] = row_to_dict(b, cluster) if b else None
    title = (
        f"{model.name} ({quant.name}) on {args.nodes} x {cluster.name} "
        f"({cluster.gpus_per_node} x {cluster.gpu}), batch {workload.batch}, prompt {workload.prompt_len}, "
        f"decode {workload.decode_len}"
    )
    if args.json is not None and str(args.json) == "-":
        print(json.dumps(doc, indent=2))
        if args.plot is not None:  # stdout holds the JSON: the note goes to stderr
            plot_rows(rows, args.plot, title)
            print(f"wrote {args.plot}", file=sys.stderr)
        return 0 if b else 1
    table = Table(title=title)
    ranged = any(r.e2e_range for r in rows)
    cols = [
        "#",
        "layout",
        "TP group",
        "all-reduce (decode)",
        "TTFT ms",
        "TPOT ms",
        "E2E ms",
        "tok/s",
        "decode % GEMM/attn/AR/PP/idle",
        "GB/GPU",
    ]
    if ranged:
        cols[5:7] = ["TPOT ms \\[range]", "E2E ms \\[range]"]
        cols += ["wins", "E2E driven by"]
    for col in cols:
        table.add_column(col, justify="left" if col in ("layout", "all-reduce (decode)", "E2E driven by") else "right")
    shown = rows[: args.top] if args.top else rows
    for i, r in enumerate(shown, 1):
        e, d = r.estimate, r.estimate.decode_ms
        tot = sum(d.values()) or 1.0
        split = "/".join(
            f"{100 * x:.0f}"
            for x in (
                d["gemm"] / tot,
                d["attention"] / tot,
                d["allreduce"] / tot,
                d["pp_transfer"] / tot,
                e.decode_idle_fraction,
            )
        )
        nodes, rpn = tp_group_shape(r.layout, cluster)
        mem = f"{e.memory.total_GB:.1f}" + ("" if r.fits else f" > {e.memory.capacity_GB:.0f} (does not fit)")
        algo = (
            r.algo
            if r.algo == "none"
            else f"{r.algo} ({e.allreduce_variant})"
            if e.allreduce_variant != r.algo
            else r.algo
        )
        tpot, e2e, extra = f"{e.tpot_ms:.2f}", f"{e.e2e_ms:.0f}", []
        if r.e2e_range:
            tpot = f"{e.tpot_ms:.2f} [{r.tpot_range.low:.2f}-{r.tpot_range.high:.2f}]"
            e2e = f"{e.e2e_ms:.0f} [{r.e2e_range.low:.0f}-{r.e2e_range.high:.0f}]"
            extra = [f"{r.wins}/{r.scenarios}", r.e2e_range.top(2) or "-"]
        table.add_row(
            str(i),
            str(r.layout),
            f"{nodes}x{rpn}",
            algo,
            f"{e.ttft_ms:.1f}",
            tpot,
            e2e,
            f"{e.throughput_tok_s:.0f}",
            split,
            mem,
            *extra,
            style=None if r.fits else "dim",
        )
    console.print(table)
    if ranged:
        console.print(
            f"Ranges in brackets: every constant the preset marks as a guess ({len(cluster.ranges)}: "
            f"{', '.join(sorted(cluster.ranges))}) at the end that lowers / raises the row; rows ranked "
            "by the high end. wins: scenarios (nominal, each guess at each end) in which the row is "
            "the fastest that fits. Replace guesses with your cluster's figures: `spanllm bench "
            "allreduce --json F`, then `spanllm perf calibrate F --cluster "
            f"{cluster.name} --out mine.json` and `--cluster mine.json` here."
        )
    console.print(
        f"prefill all-reduces priced with {PREFILL_ALGO}; decode with the listed algorithm. "
        f"Constants: {cluster.description} (sources in spanllm/perf/hardware.py)."
    )
    if b:
        console.print(
            f"[bold]best: {b.layout} with {b.algo}[/bold]: E2E {b.estimate.e2e_ms:.0f} ms, TTFT "
            f"{b.estimate.ttft_ms:.1f} ms, TPOT {b.estimate.tpot_ms:.2f} ms"
        )
        if b.e2e_range:
            console.print(robustness(rows))
    else:
        how = _how_to_fit(args, model, cluster, workload, quant)
        console.print(f"[bold red]no layout fits in GPU memory[/bold red]: {how}")
    if args.json is not None:
        write_json("--json", args.json, doc, indent=2)
        console.print(f"wrote {args.json}")
    if args.plot is not None:
        plot_rows(rows, args.plot, title)
        console.print(f"wrote {args.plot}")
    return 0 if b else 1


def _quantization(args: argparse.Namespace, weights: str | None):
    """The perf model's quantization of `weights` (None: bf16), with the KV cache that --kv-cache-dtype asks."""
    quant = get_quantization(weights)
    return quant.with_fp8_kv_cache() if args.kv_cache_dtype == "fp8" else quant


def _how_to_fit(args: argparse.Namespace, model, cluster, workload: Workload, quant) -> str:
    """What would fit: more nodes (the fewest, where the cluster has a network), FP8 weights on these nodes (on
    GPUs with FP8), a smaller batch on these nodes, or a smaller model."""
    graphs = not args.no_cuda_graphs
    ways = []
    if cluster.has_network:
        n = fewest_nodes_that_fit(model, cluster, args.nodes, workload, graphs, quant, MAX_NODES)
        if n is not None:
            ways.append(f"--nodes {n} (the fewest {cluster.name} nodes on which a layout fits)")
    else:
        ways.append(f"a cluster with more GPUs ({cluster.name} is one node without a network)")
    if quant.linear_weight_bytes > 1 and has_fp8(cluster):  # 16-bit weights, on GPUs that run FP8
        if fits_somewhere(model, cluster, args.nodes, workload, graphs, _quantization(args, "fp8")):
            ways.append(f"--quantization fp8 (FP8 weights fit on {args.nodes} node(s))")
    b = largest_batch_that_fits(model, cluster, args.nodes, workload, quant)
    if b is not None:
        ways.append(f"--batch {b} or fewer sequences (fit on {args.nodes} node(s))")
    ways.append("a smaller model")
    return "; or ".join(ways)


def plot_rows(rows: list[PlanRow], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if r.fits][:20] or rows[:20]
    labels = [f"{r.layout} {r.algo}" for r in rows]
    ttft = [r.estimate.ttft_ms / 1e3 for r in rows]
    dec = [(r.estimate.e2e_ms - r.estimate.ttft_ms) / 1e3 for r in rows]
    fig, ax = plt.subplots(figsize=(9, 0.35 * len(rows) + 1.5))
    y = range(len(rows))
    ax.barh(y, ttft, label="TTFT (prefill)")
    ax.barh(y, dec, left=ttft, label="decode")
    ax.set_yticks(list(y), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("predicted end-to-end batch latency (s)")
    ax.set_title(title, fontsize=9)
    ax.legend()
    fig.tight_layout()
    save_figure("--plot", path, fig, dpi=120)
    plt.close(fig)


def serve_requests(args: argparse.Namespace, model) -> list:
    """The trace: the samples file's (or --lengths') requests at the arrival times `bench serve` would send; a saved
    request past the model's context is refused (--lengths is checked in check_args)."""
    from spanllm.bench.sample_file import load_samples
    from spanllm.bench.serve_metrics import arrival_offsets_s
    from spanllm.perf.serving import ServeRequest

    if args.lengths is not None:
        p, o = (int(v) for v in args.lengths.split(":"))
        lengths = [(p, o)] * args.num_requests
    else:
        try:
            lengths = [(r.prompt_len, r.output_len) for r in load_samples(str(args.samples_file)).requests]
        except ValueError as e:
            raise UsageError(str(e)) from None
        for i, (p, o) in enumerate(lengths):
            _fits_context(model, f"--samples-file {args.samples_file}: request {i}", p, o, "drop it from the file")
    arrivals = arrival_offsets_s(len(lengths), args.request_rate, args.burstiness, args.seed)
    return [ServeRequest(p, o, a) for (p, o), a in zip(lengths, arrivals)]


def run_serve(args: argparse.Namespace, model, cluster) -> int:
    from rich.console import Console
    from rich.table import Table

    from spanllm.perf.serving import EngineLimits, Slo, plan_serve, row_to_dict
    from spanllm.perf.step_cost import STEP_COST_RANGES

    requests = serve_requests(args, model)
    gpus = args.gpus or args.nodes * cluster.gpus_per_node
    limits = EngineLimits(args.max_num_seqs, args.max_num_batched_tokens, min_admit=args.min_admit)
    slo = Slo(args.slo_tpot_ms, args.slo_ttft_ms)
    rows = plan_serve(model, cluster, gpus, requests, limits, slo, ranges=not args.no_ranges)
    rate = "inf" if math.isinf(args.request_rate) else f"{args.request_rate:g}"
    trace = str(args.samples_file) if args.samples_file else f"{args.num_requests} x {args.lengths}"
    doc = {
        "model": model.name,
        "cluster": cluster.name,
        "gpus": gpus,
        "trace": trace,
        "requests": len(requests),
        "request_rate": rate,
        "limits": asdict(limits),
        "slo": asdict(slo),
        "rows": [row_to_dict(r, slo) for r in rows],
    }
    good = [r for r in rows if r.fits and slo.met(r.nominal)]
    doc["best"] = row_to_dict(good[0], slo) if good else None
    if args.json is not None and str(args.json) == "-":
        print(json.dumps(doc, indent=2))
        return 0 if good else 1
    console = Console(width=170) if not Console().is_terminal else Console()
    table = Table(
        title=f"serving {model.name} on {gpus} GPUs of {cluster.name} ({cluster.gpu}): {trace}, rate {rate}/s, "
        f"max_num_seqs {limits.max_num_seqs}, {limits.max_num_batched_tokens} tokens/step"
    )
    for col in (
        "#",
        "layout",
        "output tok/s \\[range]",
        "req/s",
        "TTFT p50 / p99 ms \\[p99 range]",
        "TPOT p50 / p99 ms \\[p99 range]",
        "SLO",
        "KV blocks",
    ):
        table.add_column(col, justify="left" if col in ("layout", "SLO") else "right")
    shown = rows[: args.top] if args.top else rows
    for i, r in enumerate(shown, 1):
        if not r.fits:
            table.add_row(str(i), str(r.layout), "-", "-", "-", "-", f"does not fit: {r.why}", "-", style="dim")
            continue
        n, (tlo, thi), (plo, phi), (olo, ohi) = (
            r.nominal,
            r.range_of("ttft_p99_ms"),
            r.range_of("tpot_p99_ms"),
            r.range_of("output_tok_s"),
        )
        verdict = ("yes" if slo.met(r.slow) else "yes (not at the slow end)") if slo.met(n) else "no"
        table.add_row(
            str(i),
            str(r.layout),
            f"{n['output_tok_s']:,.0f} [{olo:,.0f}-{ohi:,.0f}]",
            f"{n['request_s']:.2f}",
            f"{n['ttft_p50_ms']:,.1f} / {n['ttft_p99_ms']:,.1f} [{tlo:,.1f}-{thi:,.1f}]",
            f"{n['tpot_p50_ms']:.2f} / {n['tpot_p99_ms']:.2f} [{plo:.2f}-{phi:.2f}]",
            verdict if (slo.tpot_p99_ms or slo.ttft_p99_ms) else "-",
            str(r.num_blocks),
        )
    console.print(table)
    console.print(
        "Each layout: the engine's scheduler replayed on the trace (spanllm.perf.serving), every step priced by the "
        "step cost calibrated on the H200 (spanllm.perf.step_cost). Ranges: the step cost's ranges ("
        f"{', '.join(STEP_COST_RANGES)}) and the cluster's guessed constants at their fast / slow ends. TTFT leaves "
        "out the HTTP front end and tokenization."
    )
    if good:
        b = good[0]
        console.print(
            f"[bold]best: {b.layout}[/bold]: {b.nominal['output_tok_s']:,.0f} output tok/s, TPOT p99 "
            f"{b.nominal['tpot_p99_ms']:.2f} ms, TTFT p99 {b.nominal['ttft_p99_ms']:,.1f} ms"
        )
    else:
        console.print(
            "[bold red]no layout fits and meets the SLO[/bold red]: add GPUs, lower the rate or relax the SLO"
        )
    if args.json is not None:
        write_json("--json", args.json, doc, indent=2)
        console.print(f"wrote {args.json}")
    return 0 if good else 1
