"""`spanllm bench allreduce`: nccl-tests' all_reduce_perf contract for every registered algorithm.

Rows: `size count type redop | time(us) algbw busbw #wrong algo` (time = median per call, max over
ranks), one row per size and algorithm, `algo` naming what actually ran (auto names its choice).
`--json FILE` holds the same rows plus machine, versions and settings. On CPU `--nprocs N` spawns N
local gloo ranks; under torchrun it uses the launcher's ranks (NCCL on GPUs).
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import torch
import torch.distributed as dist

from spanllm import checks
from spanllm.comm import Topology, registry
from spanllm.comm.conformance import check_exact
from spanllm.comm.nvrar.compile import precompile_sizes
from spanllm.dtypes import DTYPE_NAMES, dtype_from_name
from spanllm.errors import UsageError
from spanllm.launch import DistContext, finish, launch, under_launcher
from spanllm.measure.report import algbw_GBps, allreduce_busbw_GBps
from spanllm.measure.timing import Timing, time_calls
from spanllm.output_files import write_result

USES_COLLECTIVES = True  # its ranks join a process group (spanllm.launch): --pg-timeout applies


def parse_size(text: str) -> int:
    """'8', '64K', '1M', '2G' (optionally with a trailing B) -> bytes."""
    t = text.strip().upper().removesuffix("B")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    try:
        if t and t[-1] in mult:
            return int(float(t[:-1]) * mult[t[-1]])
        return int(t)
    except ValueError:
        raise ValueError(f"size {text!r} is not a byte count; write e.g. 8, 64K, 1M or 2G") from None


def sizes_from(begin: int, end: int, factor: float) -> list[int]:
    if begin <= 0 or end < begin:
        raise ValueError(f"sizes -b {begin} -e {end}: need 0 < begin <= end")
    if not math.isfinite(factor):  # nan and inf would end the sweep after its first size
        raise ValueError(f"-f {factor}: the size factor must be a finite number > 1, e.g. -f 2")
    if factor <= 1:
        raise ValueError(f"-f {factor}: the size factor must be > 1")
    out, s = [], begin
    while s <= end:
        out.append(int(s))
        s = s * factor
    return out


DEFAULT_BUFFER_BYTES = "16M"
DEFAULT_TIMEOUT_S = 30.0
BUFFERED = ("nvrar", "torch_one_shot", "torch_two_shot")  # the backends --buffer-bytes sizes (auto's GPU candidates)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-b", "--minbytes", default="8", help="smallest message (bytes; K/M suffixes)")
    p.add_argument("-e", "--maxbytes", default="1M", help="largest message")
    p.add_argument("-f", "--stepfactor", type=float, default=2.0, help="size multiplication factor")
    p.add_argument("-n", "--iters", type=int, default=20, help="timed samples per size")
    p.add_argument("-w", "--warmup_iters", type=int, default=5, help="warm-up calls per size")
    p.add_argument("-c", "--check", type=int, default=1, help="check results (1) or not (0)")
    p.add_argument(
        "--calls-per-sample",
        type=int,
        default=None,
        help="back-to-back calls per timed sample (default: 20 on GPU, 1 on CPU)",
    )
    p.add_argument("--dtype", default="float", help="float, bfloat16, half, int32, double, int64")
    p.add_argument("--algos", default=None, help="comma-separated algorithms (default: all that run on this device)")
    p.add_argument(
        "--ranks-per-node", type=int, default=None, help="ranks per (virtual) node; default LOCAL_WORLD_SIZE"
    )
    p.add_argument("--graph", dest="graph", action="store_true", default=None, help="CUDA-graph mode (GPU default)")
    p.add_argument(
        "--no-graph", dest="graph", action="store_false", default=None, help="eager launches on GPU (default: graphs)"
    )
    p.add_argument(
        "--buffer-bytes",
        default=None,
        help=f"symmetric buffer size of the buffered GPU backends ({', '.join(BUFFERED)}, auto) "
        f"(default: {DEFAULT_BUFFER_BYTES})",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="interleave the algorithms this many times per size (A B C A B C ...), --iters samples "
        "split among the rounds and pooled: drift in time then hits every algorithm alike",
    )
    p.add_argument("--tuning", default=None, help="tuning table JSON for auto and nvrar (from spanllm tune)")
    p.add_argument(
        "--timeout-s",
        type=float,
        default=None,
        help=f"device spin-wait timeout of nvrar (default: {DEFAULT_TIMEOUT_S:g})",
    )
    p.add_argument("--json", default=None, help="write every row plus machine, versions and settings here")
    p.add_argument("--plot", default=None, help="write a PNG of latency vs size (needs --json and matplotlib)")
    p.add_argument("--nprocs", type=int, default=4, help="local gloo ranks to spawn when not under a launcher")


def comm_options(args, device: torch.device) -> dict:
    buffer = parse_size(args.buffer_bytes or DEFAULT_BUFFER_BYTES)
    timeout_s = DEFAULT_TIMEOUT_S if args.timeout_s is None else args.timeout_s
    opts = {"max_bytes": buffer, "one_shot_max_bytes": buffer, "timeout_s": timeout_s, "device": device}
    if args.tuning:
        from spanllm.comm.tuning import TuningTable

        opts["tuning"] = TuningTable.load(args.tuning)
    return opts


HEADER = (
    f"#{'size':>12} {'count':>12} {'type':>9} {'redop':>6} | {'time(us)':>10} {'p99(us)':>9} "
    f"{'algbw(GB/s)':>11} {'busbw(GB/s)':>11} {'#wrong':>7}  algo"
)


def format_row(r: dict) -> str:
    return (
        f" {r['size']:>12} {r['count']:>12} {r['type']:>9} {r['redop']:>6} | {r['time_us']:>10.2f} "
        f"{r['time_us_p99']:>9.2f} {r['algbw_GBps']:>11.3f} {r['busbw_GBps']:>11.3f} {r['wrong']:>7}  {r['ran']}"
    )


def bench_rank(ctx: DistContext, args) -> list[dict]:
    dtype = dtype_from_name(args.dtype)
    itemsize = dtype.itemsize
    topo = Topology.from_env(ctx.world_size, args.ranks_per_node)
    graph = (ctx.device.type == "cuda") if args.graph is None else args.graph  # check_arguments refused --graph on CPU
    K = args.calls_per_sample or (20 if ctx.device.type == "cuda" else 1)
    rounds = args.rounds
    names = algo_names(args, ctx.device.type)
    sizes = getattr(args, "sizes", None) or sizes_from(  # `sizes`: a caller's own list (demo's table)
        parse_size(args.minbytes), parse_size(args.maxbytes), args.stepfactor
    )
    opts = comm_options(args, ctx.device)
    main = ctx.rank == 0
    comms = {}
    for name in names:  # construction is collective: same order everywhere
        rule = registry.algorithm_class(name).capability.topology_rule
        reason = rule(topo) if rule else None
        if reason is not None:
            if main:
                print(f"# {name} skipped on topology {topo}: {reason}")
            continue
        comms[name] = registry.create(name, topology=topo, **opts)
    # nvrar's kernels for every size, compiled in parallel before timing starts (None: no nvrar here)
    pre = precompile_sizes(comms.values(), [max(1, s // itemsize) for s in sizes], [dtype])
    if main and pre is not None:
        print(f"# nvrar kernels precompiled: {pre}")
    if main:
        print(
            f"# spanllm bench allreduce: {ctx.world_size} ranks as {topo.num_nodes} node(s) x {topo.ranks_per_node}, "
            f"backend {ctx.backend}, dtype {DTYPE_NAMES[dtype]}, {'CUDA graph' if graph else 'eager'}, "
            f"{K} calls per sample, {args.iters} samples, {args.warmup_iters} warm-up calls"
        )
        print(f"# torch {torch.__version__}; algorithms: {', '.join(names)}")
        print(HEADER)
        sys.stdout.flush()
    rows = []
    for size in sizes:
        count = max(1, size // itemsize)
        x = torch.empty(count, dtype=dtype, device=ctx.device)
        x0 = (
            (torch.randn(count, device=ctx.device) * 1e-2).to(dtype)
            if dtype.is_floating_point
            else torch.randint(-3, 4, (count,), device=ctx.device, dtype=dtype)
        )
        runnable = {}
        for name, comm in comms.items():
            reason = comm.unsupported_reason(x)
            if reason is not None:
                if main:
                    print(f"# {name} skipped at {count * itemsize} bytes: {reason}")
                continue
            wrong = check_exact(comm, x, graph) if args.check else 0
            wrong_t = torch.tensor([wrong], dtype=torch.int64, device=ctx.device)
            dist.all_reduce(wrong_t)
            runnable[name] = (comm, int(wrong_t.item()))
        # Rounds: every algorithm's samples come from `rounds` stretches of time, interleaved with the others'.
        pooled: dict[str, list[float]] = {name: [] for name in runnable}
        for rnd in range(rounds):
            n_samples = args.iters // rounds + (1 if rnd < args.iters % rounds else 0)
            for name, (comm, _) in runnable.items():
                t = time_calls(
                    lambda: comm.all_reduce_(x),  # noqa: B023
                    reset=lambda: x.copy_(x0),  # noqa: B023
                    samples=n_samples,
                    warmup=args.warmup_iters,
                    calls_per_sample=K,
                    graph=graph,
                    device=ctx.device,
                )
                pooled[name] += t.samples_us
        for name, (comm, wrong) in runnable.items():
            t = Timing.from_samples(pooled[name])
            ran = comm.algorithm_for(x)
            nbytes = count * itemsize
            row = {
                "size": nbytes,
                "count": count,
                "type": DTYPE_NAMES[dtype],
                "redop": "sum",
                "algo": name,
                "ran": ran if name != "auto" else f"auto->{ran}",
                "world_size": ctx.world_size,
                "ranks_per_node": topo.ranks_per_node,
                "topology": str(topo),
                "time_us": t.median_us,
                "time_us_p99": t.p99_us,
                "algbw_GBps": algbw_GBps(nbytes, t.median_us),
                "busbw_GBps": allreduce_busbw_GBps(nbytes, t.median_us, ctx.world_size),
                "wrong": wrong,
                "graph": graph,
                "calls_per_sample": K,
                "rounds": rounds,
                "samples_us": t.samples_us,
            }
            rows.append(row)
            if main:
                print(format_row(row))
                sys.stdout.flush()
    for comm in comms.values():
        comm.close()
    if main:
        total_wrong = sum(r["wrong"] for r in rows)
        print(f"# Out of bounds values : {total_wrong} {'OK' if total_wrong == 0 else 'FAILED'}")
        if args.json:
            settings = {
                "world_size": ctx.world_size,
                "ranks_per_node": topo.ranks_per_node,
                "topology": str(topo),
                "dtype": DTYPE_NAMES[dtype],
                "graph": graph,
                "calls_per_sample": K,
                "iters": args.iters,
                "warmup": args.warmup_iters,
                "rounds": rounds,
                "algos": names,
                "backend": ctx.backend,
                "buffer_bytes": opts["max_bytes"] if readers(names, ctx.device.type, BUFFERED) else None,
                "tuning": args.tuning,
            }
            write_result(args.json, "allreduce", settings, rows)
            print(f"# wrote {args.json}")
            if args.plot:
                import json

                from spanllm.bench.allreduce_plot import plot_allreduce

                with open(args.json) as f:
                    plot_allreduce([json.load(f)], args.plot)
                print(f"# wrote {args.plot}")
    return rows


def check_rounds(rounds: int, iters: int) -> None:
    if not 1 <= rounds <= iters:
        raise UsageError(
            f"--rounds {rounds}: must be between 1 and --iters ({iters}): every round takes at least "
            "one sample of every algorithm"
        )


def sweep_bytes(args) -> tuple[torch.dtype, list[int]]:
    """--dtype and the sizes of -b / -e / -f, as usage errors naming the flag."""
    try:
        dtype = dtype_from_name(args.dtype)
    except ValueError as e:
        raise UsageError(f"--dtype: {e}") from None
    try:
        return dtype, sizes_from(parse_size(args.minbytes), parse_size(args.maxbytes), args.stepfactor)
    except ValueError as e:
        raise UsageError(str(e)) from None


def check_buffer_bytes(args) -> int:
    """--buffer-bytes in bytes (>= 1), as a usage error naming the flag."""
    try:
        n = parse_size(args.buffer_bytes or DEFAULT_BUFFER_BYTES)
    except ValueError as e:
        raise UsageError(f"--buffer-bytes: {e}") from None
    if n < 1:
        raise UsageError(f"--buffer-bytes {args.buffer_bytes}: the symmetric buffer must be >= 1 byte, e.g. 16M")
    return n


def algo_names(args, device: str) -> list[str]:
    """The algorithms the run times: --algos, else every one that runs on `device`."""
    return [a.strip() for a in args.algos.split(",")] if args.algos else registry.algorithms_for_device(device)


def readers(names, device: str, users) -> list[str]:
    """The algorithms among `names` that read an option of `users` (auto builds them on GPUs)."""
    return [n for n in names if n in users or (n == "auto" and device == "cuda")]


def used_by(flag: str, value, names, device: str, users) -> None:
    """Refuse `flag` when no algorithm of the run reads it: accepted, it would be silently ignored."""
    if value is None or readers(names, device, users):
        return
    why = (
        f"none of them is among the algorithms run ({', '.join(names)})"
        if any(device in registry.algorithm_class(u).capability.device_types for u in users)
        else f"these ranks run on {device.upper()}, where none of them runs (CUDA GPUs only)"
    )
    raise UsageError(f"{flag} {value}: read by {' / '.join(users)} only, and {why}; drop {flag}")


def buffers_bytes_per_rank(max_bytes: int, itemsize: int, check: bool) -> int:
    """Host memory one rank holds at the largest size: the message and its reset copy, plus the exactness
    check's int64 index temporaries (three of 8 bytes per element at its peak) or the float32 random fill."""
    count = max(1, max_bytes // itemsize)
    return 2 * count * itemsize + (24 if check else 4) * count


def check_host_memory(max_bytes: int, itemsize: int, check: bool, nprocs: int, flag: str = "-e/--maxbytes") -> None:
    """CPU ranks on this host (local gloo ranks, or LOCAL_WORLD_SIZE under a launcher) must fit in its memory."""
    if checks.device_type(nprocs) != "cpu":
        return
    here = int(os.environ.get("LOCAL_WORLD_SIZE") or nprocs) if under_launcher() else nprocs
    checks.host_memory(
        buffers_bytes_per_rank(max_bytes, itemsize, check),
        here,
        f"the largest message ({max_bytes} bytes, from {flag})",
        f"lower {flag}, or run fewer ranks on this host",
    )


def check_arguments(args, size_flag: str = "-e/--maxbytes") -> None:
    """Every option, before any rank starts."""
    checks.output_file("--json", args.json)
    checks.png_file("--plot", args.plot)
    if args.plot and not args.json:
        raise UsageError("--plot draws from the JSON rows: add --json FILE")
    world = checks.world_size(args.nprocs)
    device = checks.device_type(world)
    dtype, sizes = sweep_bytes(args)
    check_buffer_bytes(args)
    checks.at_least("-n/--iters", args.iters, 1, " (timed samples per size)")
    checks.at_least("-w/--warmup_iters", args.warmup_iters, 0, " (warm-up calls per size; 0 = none)")
    if args.check not in (0, 1):
        raise UsageError(f"-c/--check {args.check}: 1 checks every result, 0 skips the check")
    checks.at_least("--calls-per-sample", args.calls_per_sample, 1)
    if args.timeout_s is not None and not args.timeout_s > 0:
        raise UsageError(f"--timeout-s {args.timeout_s}: nvrar's spin-wait timeout must be > 0 seconds")
    check_rounds(args.rounds, args.iters)
    checks.topology(world, args.ranks_per_node)
    if args.graph and device != "cuda":
        raise UsageError("--graph needs GPUs (CUDA graphs); drop it on CPU")
    if args.algos:
        checks.allreduce_names([a.strip() for a in args.algos.split(",")], device, "--algos")
    names = algo_names(args, device)
    used_by("--buffer-bytes", args.buffer_bytes, names, device, BUFFERED)
    used_by("--timeout-s", args.timeout_s, names, device, ("nvrar",))
    used_by("--tuning", args.tuning, names, device, ("auto", "nvrar"))
    checks.tuning(args.tuning)
    itemsize = dtype.itemsize
    sizes = getattr(args, "sizes", None) or sizes  # demo's table: --maxbytes itself last
    check_host_memory(sizes[-1], itemsize, bool(args.check), world, size_flag)


def run(args) -> int:
    check_arguments(args)  # fail before spawning
    results = launch(bench_rank, args, nprocs=args.nprocs)
    rows = results[0]
    return finish(1 if any(r["wrong"] for r in rows) else 0)
