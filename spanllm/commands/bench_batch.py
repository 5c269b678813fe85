"""`spanllm bench batch`: offline batch benchmark of the engine.

For every all-reduce backend and batch size: TTFT, time per output token (TPOT), end-to-end batch
latency and output throughput (median over `--iters` runs after `--warmup`, each run's time the
maximum over ranks), plus a breakdown of one decode step into GEMM / attention / all-reduce /
pipeline / idle / other. The breakdown comes from a separate eager pass with per-op timers (events
cannot be placed inside a CUDA graph, and timers would perturb the totals). On GPU that pass keeps
the host ahead of the device with short device spins, so its event intervals are the ops' GPU time,
not the host's launch gaps (`breakdown_mode` and `breakdown_steps_covered` say whether that held; see
engine/timers.py); `breakdown_step_ms` is that pass's GPU time per step, to set against TPOT.
`--no-breakdown` skips it. The pass reports per-step averages, so it decodes only `breakdown_steps`
steps (`--breakdown-steps`, default 32, at most decode_len - 1; each row's JSON says how many): the
first steps of the sequence, so attention there reads a slightly shorter context than the timed
runs' average.

Cost per row: warm-up runs (`--warmup`) decode only `warmup_decode_len` tokens (min(decode_len, 32)):
their job is to capture the row's CUDA graph and warm up the communicator, not to be timed. Decode
graphs stay captured across rows and iterations (one per batch size); only swapping the all-reduce
drops them.

    spanllm bench batch --model tiny --nprocs 2 --batch-sizes 1,4 --allreduce gloo,ref_ring
    torchrun --nproc-per-node 2 -m spanllm.cli bench batch --model llama3.1-70b --allreduce nccl,nvrar \\
        --workload decode-heavy --batch-sizes 1,8,32 --json results/batch.json --plot results/batch.png
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from spanllm import checks
from spanllm.commands.engine_args import add_model_arguments, check_model_arguments, resolve_dtype
from spanllm.engine import cuda_allocator
from spanllm.engine.config import EngineConfig
from spanllm.engine.sampler import SamplingParams
from spanllm.engine.timers import CATEGORIES
from spanllm.errors import UsageError
from spanllm.launch import DistContext, finish, launch
from spanllm.model.config import resolve_model
from spanllm.model.parallel_dims import ParallelDims
from spanllm.output_files import save_figure
from spanllm.workloads import WORKLOADS

USES_COLLECTIVES = True  # its ranks join a process group (spanllm.launch): --pg-timeout applies


@dataclass(frozen=True)
class BenchSettings:
    model: str
    batch_sizes: tuple[int, ...]
    prompt_len: int
    decode_len: int
    workload: str
    allreduce: tuple[str, ...]  # empty: the device default (nccl on GPU, gloo on CPU)
    warmup: int
    iters: int
    breakdown: bool
    dtype: str
    seed: int
    cuda_graphs: bool
    ranks_per_node: int | None
    tuning: str | None = None
    breakdown_steps: int = 32  # decode steps of the eager breakdown pass
    decode_gemm: str = "torch"  # EngineConfig.decode_gemm
    pdl: str = "auto"  # EngineConfig.pdl
    quantization: str | None = None  # EngineConfig.quantization (--quantization fp8)
    max_model_len: int | None = None
    json: str | None = None  # where the report goes; rows also land in partial_path(json) as they finish


WARMUP_DECODE_LEN = 32  # decode tokens of a warm-up run (captures the graph; not timed)


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    # The static-batch benchmarks keep F.linear unless asked (--decode-gemm auto / skinny): their rows feed the
    # perf model, whose engine constants describe the eager forward with F.linear (perf/measurements.py).
    parser.set_defaults(decode_gemm="torch")
    parser.add_argument("--batch-sizes", default="1,8", help="comma-separated batch sizes")
    parser.add_argument(
        "--workload",
        choices=sorted(WORKLOADS),
        default="decode-heavy",
        help="decode-heavy = prompt 128, decode 512; prefill-heavy = prompt 2048, decode 32",
    )
    parser.add_argument("--prompt-len", type=int, default=None, help="overrides the workload's prompt length")
    parser.add_argument("--decode-len", type=int, default=None, help="overrides the workload's decode length")
    parser.add_argument(
        "--allreduce",
        default=None,
        help="comma-separated registered all-reduce names (default: nccl on GPU, gloo on CPU)",
    )
    parser.add_argument(
        "--tuning", default=None, help="tuning table(s) from `spanllm tune` for nvrar / auto (comma-separated)"
    )
    parser.add_argument("--warmup", type=int, default=1, help="untimed runs of each batch first")
    parser.add_argument("--iters", type=int, default=3, help="timed runs of each batch (medians reported)")
    parser.add_argument("--no-breakdown", action="store_true", help="skip the eager per-op timing pass")
    parser.add_argument(
        "--breakdown-steps",
        type=int,
        default=None,
        help="decode steps of the eager per-op timing pass (per-step averages; at most decode length - 1; default: "
        "32, or decode length - 1 if less)",
    )
    parser.add_argument("--json", default=None, help="write the rows here")
    parser.add_argument("--plot", default=None, help="write a PNG of where decode time goes")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_bench_arguments(parser)
    parser.add_argument(
        "--tp",
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=None,
        help="tensor-parallel degree (default: world size / pp)",
    )
    parser.add_argument("--pp", type=int, default=1, help="pipeline stages")
    parser.add_argument("--micro-batches", type=int, default=1, help="pipeline micro-batches (1 = naive schedule)")


def _csv(text: str | None, cast=str, flag: str = "") -> tuple:
    """A comma-separated option's items (None: the option was not given, ()); an empty item is refused."""
    if text is None:
        return ()
    items = [t.strip() for t in text.split(",")]
    try:
        if "" in items:
            raise ValueError
        return tuple(cast(t) for t in items)
    except ValueError:
        raise UsageError(
            f"{flag + ' ' if flag else ''}{text!r}: expected a comma-separated list (no empty items)"
        ) from None


def check_micro_batches(counts: list[int], batch_sizes: tuple[int, ...], spec: str) -> None:
    """A micro-batch count above every batch size would measure nothing: refused before any rank starts (one above
    only some of them skips those rows, listed with the reason)."""
    if counts and min(counts) > max(batch_sizes):
        raise UsageError(
            f"--micro-batches {spec}: more micro-batches than the largest batch ({max(batch_sizes)} sequences, "
            f"--batch-sizes); give at most {max(batch_sizes)}, or larger batch sizes"
        )


def settings_from_args(args: argparse.Namespace) -> BenchSettings:
    """Every shared option checked (and the checkpoint), before any rank starts."""
    prompt_len, decode_len = WORKLOADS[args.workload]
    workload = args.workload
    if args.prompt_len is not None or args.decode_len is not None:
        prompt_len = args.prompt_len if args.prompt_len is not None else prompt_len
        decode_len = args.decode_len if args.decode_len is not None else decode_len
        workload = f"{args.workload} (prompt {prompt_len}, decode {decode_len})"
    if prompt_len < 1 or decode_len < 1:
        raise UsageError(f"prompt_len={prompt_len} and decode_len={decode_len} must be >= 1")
    if args.breakdown_steps is not None and args.no_breakdown:
        raise UsageError(
            f"--breakdown-steps {args.breakdown_steps} sizes the per-op timing pass, which --no-breakdown skips; "
            "drop one of them"
        )
    breakdown_steps = 32 if args.breakdown_steps is None else args.breakdown_steps
    checks.at_least("--breakdown-steps", breakdown_steps, 1)
    if args.breakdown_steps is not None and args.breakdown_steps > decode_len - 1:
        # the pass times the decode steps after the first token: the default is capped there, a given value refused
        length = "--decode-len" if args.decode_len is not None else f"decode length ({args.workload}: {decode_len})"
        if decode_len == 1:
            raise UsageError(
                f"--breakdown-steps {args.breakdown_steps}: --decode-len 1 leaves no decode step after the first "
                "token, so no per-op timing pass runs; raise --decode-len or drop --breakdown-steps"
            )
        raise UsageError(
            f"--breakdown-steps {args.breakdown_steps}: at most {length} - 1 = {decode_len - 1} (the decode steps "
            f"after the first token); give at most {decode_len - 1}, raise --decode-len, or leave --breakdown-steps out"
        )
    checks.at_least("--iters", args.iters, 1, " (timed runs per row)")
    checks.at_least("--warmup", args.warmup, 0, " (untimed runs per row; 0 = none)")
    world = checks.world_size(args.nprocs)
    cfg, _, device = check_model_arguments(args, world)
    checks.sequence_fits(prompt_len, decode_len, cfg, args.max_model_len, "--prompt-len + --decode-len")
    batch_sizes = _csv(args.batch_sizes, int, "--batch-sizes")
    if not batch_sizes or min(batch_sizes) < 1:
        raise UsageError(f"--batch-sizes {args.batch_sizes!r}: give positive integers like 1,8")
    allreduce = _csv(args.allreduce, str, "--allreduce")
    checks.allreduce_names(allreduce, device, world=world)
    checks.tuning(args.tuning)
    checks.output_file("--json", args.json)
    checks.png_file("--plot", args.plot)
    if args.plot:
        _check_matplotlib()
    return BenchSettings(
        model=args.model,
        batch_sizes=batch_sizes,
        prompt_len=prompt_len,
        decode_len=decode_len,
        workload=workload,
        allreduce=allreduce,
        warmup=args.warmup,
        iters=args.iters,
        breakdown=not args.no_breakdown,
        dtype=args.dtype,
        seed=args.seed,
        cuda_graphs=not args.no_cuda_graphs,
        ranks_per_node=args.ranks_per_node,
        breakdown_steps=breakdown_steps,
        tuning=args.tuning,
        max_model_len=args.max_model_len,
        decode_gemm=args.decode_gemm,
        pdl=args.pdl,
        quantization=args.quantization,
        json=args.json,
    )


def _check_matplotlib() -> None:
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        raise UsageError("--plot needs matplotlib: pip install matplotlib (or drop --plot)")


def partial_path(json_path: str) -> str:
    """Rows written so far by a run that has not finished: X.json -> X.partial.json (removed by the report)."""
    root, ext = os.path.splitext(json_path)
    return f"{root}.partial{ext or '.json'}"


class PartialRows:
    """Rank 0 rewrites the partial JSON after every row, so a run cut by a time limit (the GPU machine
    grants minutes) still leaves the rows it measured, marked complete=False."""

    def __init__(self, kind: str, s: BenchSettings, world: int) -> None:
        self.kind, self.path, self.rows = kind, partial_path(s.json), []
        self.settings = {**asdict(s), "world_size": world}

    def add(self, row: dict) -> None:
        from spanllm.output_files import write_result

        self.rows.append(row)
        write_result(self.path, self.kind, self.settings, self.rows, complete=False)


def build_llm(ctx: DistContext, s: BenchSettings, dims: ParallelDims):
    """The engine for every row of this run: decode graph buckets up to the largest batch, and a token budget that
    holds the largest batch's prompts (its prefill is one step, as a fixed batch's is)."""
    from spanllm.engine.llm import LLM

    biggest = max(s.batch_sizes)
    engine = EngineConfig(
        dtype=resolve_dtype(s.dtype, ctx.device),
        cuda_graphs=s.cuda_graphs,
        seed=s.seed,
        decode_gemm=s.decode_gemm,
        pdl=s.pdl,
        quantization=s.quantization,
        max_num_seqs=biggest,
        max_num_batched_tokens=max(8192, biggest * s.prompt_len),
        max_model_len=s.max_model_len or s.prompt_len + s.decode_len,
    )
    tuning = None
    if s.tuning:
        from spanllm.comm.tuning import TuningTable

        tuning = TuningTable.load(s.tuning)
    return LLM(
        resolve_model(s.model), engine, dims=dims, device=ctx.device, ranks_per_node=s.ranks_per_node, tuning=tuning
    )


def _gather(obj):
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def measure(llm, s: BenchSettings, batch: int, micro_batches: int, allreduce: str) -> dict:
    """One row: run the batch warmup + iters times (collective over all ranks)."""
    rng = random.Random(s.seed + batch)
    vocab = llm.config.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(s.prompt_len)] for _ in range(batch)]
    params = SamplingParams(temperature=0.0, max_tokens=s.decode_len, ignore_eos=True)
    mb = min(micro_batches, batch)
    warmup_len = min(s.decode_len, WARMUP_DECODE_LEN)
    for _ in range(s.warmup):
        llm.generate_batch(
            prompts, SamplingParams(temperature=0.0, max_tokens=warmup_len, ignore_eos=True), micro_batches=mb
        )
    ttft, e2e = [], []
    for _ in range(s.iters):
        out = llm.generate_batch(prompts, params, micro_batches=mb)
        per_rank = _gather((out.ttft_ms, out.e2e_ms)) if dist.is_initialized() else [(out.ttft_ms, out.e2e_ms)]
        ttft.append(max(r[0] for r in per_rank))
        e2e.append(max(r[1] for r in per_rank))
    ttft_ms, e2e_ms = statistics.median(ttft), statistics.median(e2e)
    tpot_ms = (e2e_ms - ttft_ms) / (s.decode_len - 1) if s.decode_len > 1 else 0.0

    breakdown = stage_breakdown = step_ms = breakdown_steps = covered_steps = mode = None
    if s.breakdown and s.decode_len > 1:
        breakdown_steps = min(s.breakdown_steps, s.decode_len - 1)
        with llm.timed_ops():
            # An untimed eager pass first: the first eager steps of a process pay one-time costs (kernel
            # selection, allocator growth) that hold the host back long enough to leave no step covered
            # (seen on 2 x H200: the first row's steps were all uncovered, later rows' all covered). Short
            # prompts: its prefill is not what it warms up (a 2048-token 70B prefill at batch 64 takes 18 s). At most
            # the timed pass's tokens: a prompt of <= 8 tokens plus 3 would pass a max_model_len of prompt + decode.
            llm.generate_batch(
                [p[:8] for p in prompts],
                SamplingParams(temperature=0.0, max_tokens=min(3, breakdown_steps + 1), ignore_eos=True),
                micro_batches=mb,
            )
            out = llm.generate_batch(
                prompts,
                SamplingParams(temperature=0.0, max_tokens=breakdown_steps + 1, ignore_eos=True),
                micro_batches=mb,
            )
        covered, uncovered = out.breakdown, out.breakdown_uncovered
        assert covered.steps + uncovered.steps == breakdown_steps, (covered.steps, uncovered.steps, breakdown_steps)
        tally = lambda b: (b.per_step(), b.total_ms / max(b.steps, 1), b.steps)
        mine = (llm.groups.stage, tally(covered), tally(uncovered))
        per_rank = _gather(mine) if dist.is_initialized() else [mine]
        # Every rank reports GPU time (covered steps) only if every rank has some; else all report the rest.
        covered_steps = min(r[1][2] for r in per_rank)
        pick = 1 if covered_steps else 2
        stage_breakdown = []
        for stage in range(llm.dims.pp):
            rows = [r[pick] for r in per_rank if r[0] == stage]
            stage_breakdown.append({c: statistics.fmean(r[0][c] for r in rows) for c in CATEGORIES})
        breakdown = {c: statistics.fmean(st[c] for st in stage_breakdown) for c in CATEGORIES}
        step_ms = statistics.fmean(r[pick][1] for r in per_rank)
        if llm.device.type != "cuda":
            mode = "eager pass with per-op timers (host wall clock)"
        elif covered_steps:
            mode = "eager pass with per-op CUDA events, enqueued ahead of the GPU: GPU time per op"
        else:
            mode = "eager pass with per-op CUDA events, host-bound: intervals include launch gaps"

    cfg = llm.config
    return {
        "model": cfg.name,
        "model_label": cfg.label,
        "truncated_layers": cfg.truncated_layers,
        "tp": llm.dims.tp,
        "pp": llm.dims.pp,
        "micro_batches": mb,
        "batch": batch,
        "prompt_len": s.prompt_len,
        "decode_len": s.decode_len,
        "workload": s.workload,
        "allreduce": allreduce,
        "allreduce_ran": llm.allreduce_ran(max(1, batch // mb)),
        "allreduce_ran_prefill": llm.allreduce_ran_prefill(max(1, batch // mb), s.prompt_len),
        "dtype": str(llm.engine.dtype).replace("torch.", ""),
        "ttft_ms": ttft_ms,
        "tpot_ms": tpot_ms,
        "e2e_ms": e2e_ms,
        "throughput_tok_s": batch * s.decode_len / (e2e_ms / 1e3) if e2e_ms > 0 else 0.0,
        "breakdown_ms": breakdown,
        "stage_breakdown_ms": stage_breakdown,
        "breakdown_step_ms": step_ms,
        "breakdown_mode": mode if breakdown is not None else None,
        "breakdown_steps": breakdown_steps,
        "breakdown_steps_covered": covered_steps,
        "warmup_decode_len": warmup_len if s.warmup else None,
        "cuda_graphs": llm.cuda_graphs,
        "decode_gemm": llm.engine.decode_gemm,
        "decode_gemm_configs": _skinny_table_id(llm.engine.decode_gemm),
        "iters": s.iters,
        "ttft_ms_all": ttft,
        "e2e_ms_all": e2e,
    }


def _skinny_table_id(decode_gemm: str) -> str | None:
    """Which measured config table the skinny GEMM ran with (its fingerprint), for decode_gemm skinny / auto."""
    if decode_gemm == "torch":
        return None
    from spanllm.kernels.skinny_gemm import table_id

    return table_id()


def run_layout(
    ctx: DistContext, s: BenchSettings, dims: ParallelDims, micro_batches: list[int], log=print, on_row=None
) -> tuple[list[dict], list[str]]:
    """Every all-reduce x micro-batching x batch size for one layout; returns (rows, skipped reasons)."""
    from spanllm.comm.base import AllReduceInputError

    t0 = time.perf_counter()
    llm = build_llm(ctx, s, dims)
    init_s = time.perf_counter() - t0  # weights (random on device, or read from the checkpoint) + KV cache
    rows, skipped = [], []
    names = s.allreduce or (llm.allreduce_name,)
    if dims.tp == 1:
        names = ("none",)  # no tensor parallelism: nothing to all-reduce
    try:
        described = llm.describe(fixed_batch=True)  # on every rank: it may build the worker, a collective step
        if ctx.is_main:
            log(f"{described} | built in {init_s:.1f} s")
        for name in names:
            if name != "none" and name != llm.allreduce_name:
                try:
                    llm.use_allreduce(name)
                except (AllReduceInputError, ImportError, KeyError) as e:
                    skipped.append(f"{dims} all-reduce {name}: {e}")
                    if ctx.is_main:
                        log(f"skipped {dims} with all-reduce {name}: {e}")
                    continue
            for mb in micro_batches:
                for batch in s.batch_sizes:
                    if mb > batch:  # run() refuses a count above every batch size; this one is listed
                        skipped.append(f"{dims} micro-batches {mb} at batch {batch}: more micro-batches than sequences")
                        if ctx.is_main:
                            log(f"skipped {dims} batch {batch} with {mb} micro-batches: more than its sequences")
                        continue
                    row = measure(llm, s, batch, mb, name)
                    row["init_s"] = init_s
                    rows.append(row)
                    if ctx.is_main:
                        log(_row_line(row))
                        if on_row is not None:
                            on_row(row)
    finally:
        llm.close()
        del llm
        if ctx.device.type == "cuda":
            torch.cuda.empty_cache()
    return rows, skipped


def _row_line(r: dict) -> str:
    return (
        f"  TP={r['tp']} PP={r['pp']} mb={r['micro_batches']} batch={r['batch']} {r['allreduce']}"
        f"->{r['allreduce_ran']}: TTFT {r['ttft_ms']:.2f} ms, TPOT {r['tpot_ms']:.3f} ms, "
        f"E2E {r['e2e_ms']:.1f} ms, {r['throughput_tok_s']:.1f} tok/s"
    )


def _bench_rank(ctx: DistContext, s: BenchSettings, tp: int | None, pp: int, micro_batches: int):
    dims = ParallelDims(tp or ctx.world_size // pp, pp, ctx.world_size)
    partial = PartialRows("batch", s, ctx.world_size) if ctx.is_main and s.json else None
    return run_layout(ctx, s, dims, [micro_batches], on_row=partial.add if partial else None)


# --- reporting --------------------------------------------------------------------------------------------
def print_table(rows: list[dict], title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for col in (
        "layout",
        "batch",
        "all-reduce (ran)",
        "graphs",
        "TTFT ms",
        "TPOT ms",
        "E2E ms",
        "tok/s",
        "decode step: gemm/attn/AR/pipe/idle/other ms",
    ):
        table.add_column(col, justify="right")
    for r in rows:
        b = r["breakdown_ms"]
        parts = "-" if b is None else "/".join(f"{b[c]:.2f}" for c in CATEGORIES)
        table.add_row(
            f"TP{r['tp']}xPP{r['pp']} mb{r['micro_batches']}",
            str(r["batch"]),
            f"{r['allreduce']} ({r['allreduce_ran']})",
            "yes" if r["cuda_graphs"] else "no",
            f"{r['ttft_ms']:.2f}",
            f"{r['tpot_ms']:.3f}",
            f"{r['e2e_ms']:.1f}",
            f"{r['throughput_tok_s']:.1f}",
            parts,
        )
    Console(width=max(Console().width, 160)).print(table)


def plot_breakdown(rows: list[dict], path: str, title: str) -> None:
    """Stacked bars: per row, the decode step split into categories (eager pass), and the measured TPOT."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"TP{r['tp']}xPP{r['pp']}\nmb{r['micro_batches']} b{r['batch']}\n{r['allreduce_ran']}" for r in rows]
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(rows) + 2), 5))
    x = range(len(rows))
    bottom = [0.0] * len(rows)
    colors = {
        "gemm": "#4c72b0",
        "attention": "#55a868",
        "allreduce": "#c44e52",
        "pipeline": "#8172b2",
        "idle": "#cccccc",
        "other": "#937860",
    }
    for c in CATEGORIES:
        vals = [(r["breakdown_ms"] or {}).get(c, 0.0) for r in rows]
        ax.bar(x, vals, bottom=bottom, label=c, color=colors[c])
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.scatter(
        list(x), [r["tpot_ms"] for r in rows], marker="_", s=600, color="black", zorder=3, label="TPOT (timed runs)"
    )
    ax.set_xticks(list(x))
    ax.set_xticklabels(labels, fontsize=7)
    ax.set_ylabel("ms per decode step")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    save_figure("--plot", path, fig, dpi=120)
    plt.close(fig)


def report(
    kind: str,
    s: BenchSettings,
    rows: list[dict],
    skipped: list[str],
    world: int,
    json_path: str | None,
    plot_path: str | None,
) -> None:
    label = rows[0]["model_label"] if rows else s.model
    title = f"{kind}: {label}, world {world}, {s.workload}"
    print_table(rows, title)
    if any(r["breakdown_ms"] is not None for r in rows):
        print(
            "breakdown columns: one decode step from a separate eager pass with per-op timers "
            "(no CUDA graphs there); TTFT/TPOT/E2E come from the timed runs"
            + (" with CUDA graphs" if any(r["cuda_graphs"] for r in rows) else "")
        )
        modes = sorted({r["breakdown_mode"] for r in rows if r["breakdown_mode"]})
        print("breakdown mode: " + "; ".join(modes))
    for line in skipped:
        print(f"skipped: {line}")
    if json_path:
        from spanllm.output_files import write_result

        settings = {**asdict(s), "world_size": world}
        write_result(json_path, kind, settings, rows, skipped=skipped, complete=True)
        print(f"wrote {json_path}")
        if os.path.exists(partial_path(json_path)):
            os.remove(partial_path(json_path))
    if plot_path and rows:
        plot_breakdown(rows, plot_path, title)
        print(f"wrote {plot_path}")


def report_from_rank0(kind: str, s: BenchSettings, results: list, args: argparse.Namespace) -> int:
    """Rank 0 (or the spawning process) reports the rows of `launch`; every rank then finishes."""
    rows, skipped = results[0]  # every rank holds the rows
    if int(os.environ.get("RANK", "0")) == 0:
        world = rows[0]["tp"] * rows[0]["pp"] if rows else args.nprocs
        report(kind, s, rows, skipped, world, s.json, args.plot)
        if not rows:  # a benchmark that measured nothing does not pass
            print(
                f"spanllm: error: bench {kind} measured no row: every layout / all-reduce was skipped (the reasons "
                "are listed above)",
                file=sys.stderr,
            )
    return finish(0 if rows else 1)


def run(args: argparse.Namespace) -> int:
    cuda_allocator.apply_default()  # before any rank starts CUDA (spawned ranks inherit it)
    s = settings_from_args(args)
    world = checks.world_size(args.nprocs)
    checks.at_least("--micro-batches", args.micro_batches, 1)
    check_micro_batches([args.micro_batches], s.batch_sizes, str(args.micro_batches))
    checks.layout(args.tp, args.pp, world, resolve_model(s.model), checks.topology(world, s.ranks_per_node))
    results = launch(_bench_rank, s, args.tp, args.pp, args.micro_batches, nprocs=args.nprocs)
    return report_from_rank0("batch", s, results, args)
