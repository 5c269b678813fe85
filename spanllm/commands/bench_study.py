"""`spanllm bench study`: TP vs TP x PP for one model, world size and workload, in one run.

Every valid layout of the world (TP=N; TP=g x PP=N/g for each divisor g; PP=N) runs with every
all-reduce backend asked for (layouts without TP run once: there is nothing to all-reduce), and,
for pipelined layouts, with the naive schedule (1 micro-batch) and with micro-batches. Rows have
the schema of `spanllm bench batch`; the PNG stacks where one decode step's time goes per layout.
Layouts or backends that cannot run are listed with the reason, never dropped silently.

    spanllm bench study --model tiny --nprocs 4 --ranks-per-node 2 --batch-sizes 4 --prompt-len 32 --decode-len 16
    torchrun --nproc-per-node 2 -m spanllm.cli bench study --model llama3.1-405b:layers=8 \\
        --allreduce nccl,nvrar --workload decode-heavy --batch-sizes 8 \\
        --json results/study.json --plot results/study.png
"""

from __future__ import annotations

import argparse
from dataclasses import replace

from spanllm import checks
from spanllm.comm.topology import Topology
from spanllm.comm.torch_dist import default_backend
from spanllm.commands.bench_batch import (
    BenchSettings,
    PartialRows,
    add_bench_arguments,
    check_micro_batches,
    report_from_rank0,
    run_layout,
    settings_from_args,
)
from spanllm.engine import cuda_allocator
from spanllm.errors import UsageError
from spanllm.launch import DistContext, launch
from spanllm.model.config import ModelConfig, resolve_model
from spanllm.model.parallel_dims import ParallelDims, ParallelLayoutError

USES_COLLECTIVES = True  # its ranks join a process group (spanllm.launch): --pg-timeout applies

COMPARED_WITH_DEFAULT = {"cuda": "nvrar", "cpu": "ref_ring"}  # without --allreduce: the group's collective vs this


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_bench_arguments(parser)
    parser.add_argument(
        "--micro-batches",
        default="1,pp",
        help="micro-batch counts for pipelined layouts; 'pp' means the layout's stage count",
    )
    parser.add_argument(
        "--pp",
        default=None,
        help="pipeline degrees to run, e.g. '2' (default: every valid layout); with --micro-batches, "
        "tops up the rows a cut run is missing without repeating the rest",
    )


def layouts(cfg: ModelConfig, world: int, topology: Topology) -> tuple[list[ParallelDims], list[str]]:
    """Every (tp, pp) with tp * pp = world, TP=N first; plus the reasons the invalid ones were left out."""
    valid, skipped = [], []
    for tp in sorted((d for d in range(1, world + 1) if world % d == 0), reverse=True):
        dims = ParallelDims(tp, world // tp, world)
        try:
            dims.validate_for(cfg)
            dims.validate_for_topology(topology)
        except ParallelLayoutError as e:
            skipped.append(f"{dims}: {e}")
            continue
        valid.append(dims)
    return valid, skipped


def micro_batch_counts(spec: str, pp: int) -> list[int]:
    """'1,pp' -> [1, pp] for a pipelined layout; [1] without a pipeline (the spec is checked either way)."""
    out = []
    for t in spec.split(","):
        t = t.strip()
        try:
            n = pp if t == "pp" else int(t)
        except ValueError:
            n = 0
        if n < 1:
            raise UsageError(
                f"--micro-batches {spec!r}: {t!r} is not a count; give integers >= 1 or 'pp' "
                "(the layout's stage count), e.g. 1,pp"
            )
        if n not in out:
            out.append(n)
    return [1] if pp == 1 else out


def pp_filter(spec: str | None) -> set[int] | None:
    """--pp '1,2' -> {1, 2}; None -> every layout."""
    if spec is None:
        return None
    try:
        out = {int(t) for t in spec.split(",") if t.strip()}
    except ValueError:
        raise UsageError(f"--pp {spec!r}: pipeline degrees are integers, e.g. --pp 2 or --pp 1,2") from None
    if not out or min(out) < 1:
        raise UsageError(f"--pp {spec!r}: give one or more pipeline degrees >= 1")
    return out


def _study_rank(
    ctx: DistContext, s: BenchSettings, mb_spec: str, pp_spec: str | None = None
) -> tuple[list[dict], list[str]]:
    cfg = resolve_model(s.model)
    topology = Topology.from_env(ctx.world_size, s.ranks_per_node)
    if not s.allreduce:
        s = replace(s, allreduce=(default_backend(ctx.device.type), COMPARED_WITH_DEFAULT[ctx.device.type]))
    valid, skipped = layouts(cfg, ctx.world_size, topology)
    wanted = pp_filter(pp_spec)
    if wanted is not None:
        skipped += [f"{d}: not asked for (--pp {pp_spec})" for d in valid if d.pp not in wanted]
        valid = [d for d in valid if d.pp in wanted]
        if not valid:
            raise UsageError(f"--pp {pp_spec}: no valid layout of {ctx.world_size} ranks has that pipeline degree")
    if ctx.is_main:
        print(
            f"study: {cfg.label} on {ctx.world_size} ranks ({topology} nodes x ranks), layouts: "
            f"{', '.join(map(str, valid))}; all-reduce: {', '.join(s.allreduce)}"
        )
        for line in skipped:
            print(f"skipped layout {line}")
    rows: list[dict] = []
    partial = PartialRows("study", s, ctx.world_size) if ctx.is_main and s.json else None
    for dims in valid:
        r, sk = run_layout(ctx, s, dims, micro_batch_counts(mb_spec, dims.pp), on_row=partial.add if partial else None)
        rows += r
        skipped += sk
    return rows, skipped


def check_layouts(s: BenchSettings, args: argparse.Namespace) -> None:
    """Before any rank starts: some layout runs, --pp picks one, --micro-batches parses for each."""
    world = checks.world_size(args.nprocs)
    cfg = resolve_model(s.model)
    valid, skipped = layouts(cfg, world, checks.topology(world, s.ranks_per_node))
    if not valid:
        raise UsageError(f"no layout of {world} ranks can run {cfg.label}: {'; '.join(skipped)}")
    wanted = pp_filter(args.pp)
    listed = ", ".join(str(d) for d in valid)
    if wanted is not None and not any(d.pp in wanted for d in valid):
        raise UsageError(f"--pp {args.pp}: no valid layout of {world} ranks has that pipeline degree; valid: {listed}")
    for pp in sorted(wanted or ()):
        if world % pp:
            raise UsageError(f"--pp {pp}: does not divide the {world} ranks; valid layouts: {listed} (drop {pp})")
        if pp not in {d.pp for d in valid}:
            why = next(line for line in skipped if line.startswith(f"{ParallelDims(world // pp, pp, world)}: "))
            raise UsageError(f"--pp {pp}: layout {why}; valid layouts: {listed} (drop {pp})")
    runs = [d for d in valid if wanted is None or d.pp in wanted]
    for d in valid:
        counts = micro_batch_counts(args.micro_batches, d.pp)
        if d in runs:
            check_micro_batches(counts, s.batch_sizes, repr(args.micro_batches))
    # counts above 1 shape pipelined layouts only (one without a pipeline runs one micro-batch)
    above_one = [t.strip() for t in args.micro_batches.split(",") if t.strip() != "pp" and int(t) > 1]
    if above_one and all(d.pp == 1 for d in runs):
        fix = (
            f"add a pipeline degree to --pp (e.g. --pp {args.pp},{max(d.pp for d in valid)})"
            if any(d.pp > 1 for d in valid)
            else "run more ranks (--nprocs) for a pipelined layout"
        )
        raise UsageError(
            f"--micro-batches {','.join(above_one)}: applies to pipeline layouts (pp > 1), and this study runs none "
            f"({', '.join(str(d) for d in runs)}); {fix}, or drop --micro-batches"
        )


def run(args: argparse.Namespace) -> int:
    cuda_allocator.apply_default()  # before any rank starts CUDA (spawned ranks inherit it)
    s = settings_from_args(args)
    check_layouts(s, args)  # bad values fail before any rank starts
    results = launch(_study_rank, s, args.micro_batches, args.pp, nprocs=args.nprocs)
    return report_from_rank0("study", s, results, args)
