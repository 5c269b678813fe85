"""`spanllm tune`: measure every candidate per message size and write the tuning table (JSON).

Candidates: the process group's collective (nccl / gloo), torch symmetric memory where the topology
allows it, and nvrar over a grid of launch parameters (one-shot or reduce-scatter, programs, tile
size). Each is checked for exact results before it is timed; the fastest correct one per size
becomes the entry's `best`, and the fastest nvrar launch is kept too, so `nvrar` itself runs tuned.
Timing uses the benchmark's discipline (spanllm.measure.timing): CUDA graphs, max over ranks, median.
"""

from __future__ import annotations

import argparse
import itertools
from dataclasses import asdict

import torch
import torch.distributed as dist

from spanllm import checks
from spanllm.comm import Topology, registry
from spanllm.comm.conformance import check_exact
from spanllm.comm.torch_dist import default_backend
from spanllm.comm.tuning import TuningEntry, TuningTable
from spanllm.commands.bench_allreduce import check_buffer_bytes, check_host_memory, parse_size, sizes_from, sweep_bytes
from spanllm.dtypes import DTYPE_NAMES, dtype_from_name
from spanllm.errors import SpanllmError, UsageError
from spanllm.launch import DistContext, finish, launch
from spanllm.measure.report import machine_info, versions
from spanllm.measure.timing import time_calls

USES_COLLECTIVES = True  # its ranks join a process group (spanllm.launch): --pg-timeout applies


GPU_DEFAULTS = {
    "buffer_bytes": "16M",
    "blocks": "1,2,4,8,16,32,64,128,256",
    "tiles": "256,1024",
    "protocols": "ll8",
    "pipelined": "0,1",
}
CPU_CANDIDATES = ("ref_hier", "ref_rd", "ref_ring")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-b", "--minbytes", default="1K", help="smallest message (bytes; K/M suffixes)")
    p.add_argument("-e", "--maxbytes", default="16M", help="largest message")
    p.add_argument("-f", "--stepfactor", type=float, default=2.0, help="size multiplication factor")
    p.add_argument("-n", "--iters", type=int, default=7, help="timed samples per candidate")
    p.add_argument("--dtype", default="bfloat16", help="element type of the messages")
    p.add_argument(
        "--ranks-per-node", type=int, default=None, help="ranks per (virtual) node; default LOCAL_WORLD_SIZE"
    )
    # GPU candidates only (None: not given; check_arguments fills in the defaults on GPUs, refuses them on CPU)
    p.add_argument(
        "--buffer-bytes",
        default=None,
        help=f"symmetric buffer of the GPU backends (largest nvrar message; default: {GPU_DEFAULTS['buffer_bytes']})",
    )
    p.add_argument("--blocks", default=None, help=f"nvrar program counts to try (default: {GPU_DEFAULTS['blocks']})")
    p.add_argument("--tiles", default=None, help=f"nvrar tile sizes (cells) to try (default: {GPU_DEFAULTS['tiles']})")
    p.add_argument(
        "--protocols",
        default=None,
        help=f"nvrar protocols to try: ll8, simple (comma-separated; default: {GPU_DEFAULTS['protocols']})",
    )
    p.add_argument(
        "--pipelined",
        default=None,
        help=f"nvrar loop orders to try: 0 tile-major, 1 phase-major (default: {GPU_DEFAULTS['pipelined']})",
    )
    p.add_argument("--out", required=True, help="tuning table JSON to write")
    p.add_argument("--nprocs", type=int, default=2, help="local gloo ranks when not under a launcher")


def nvrar_grid(args, topo: Topology, nbytes: int, one_shot_max: int):
    from spanllm.comm.nvrar.allreduce import LaunchParams

    modes = [False, True] if topo.ranks_per_node > 1 and nbytes <= one_shot_max else [False]
    g = topo.ranks_per_node
    from spanllm.comm.nvrar.allreduce import SIMPLE_MIN_BLOCK

    for proto, one_shot, nb, tile, pipe in itertools.product(
        args.protocols.split(","),
        modes,
        [int(b) for b in args.blocks.split(",")],
        [int(t) for t in args.tiles.split(",")],
        [bool(int(p)) for p in args.pipelined.split(",")],
    ):
        shard_cells = -(-nbytes // 4) if (one_shot or g == 1) else -(-nbytes // (4 * g))
        tiles = -(-shard_cells // tile)
        if nb > 1 and nb > tiles:
            continue  # more programs than tiles: same kernel as a smaller grid
        if pipe and tiles <= nb:
            continue  # one tile per program: phase-major is the same schedule as tile-major
        if proto == "simple" and tile < SIMPLE_MIN_BLOCK:
            continue
        yield LaunchParams(
            one_shot=one_shot,
            num_blocks=nb,
            block=tile,
            num_warps=4 if tile <= 512 else 8,
            protocol=proto,
            pipelined=pipe,
        )


def tune_rank(ctx: DistContext, args) -> dict:
    dtype = dtype_from_name(args.dtype)
    itemsize = dtype.itemsize
    topo = Topology.from_env(ctx.world_size, args.ranks_per_node)
    gpu = ctx.device.type == "cuda"
    buffer_bytes = parse_size(args.buffer_bytes) if gpu else None  # check_arguments: given only on GPUs
    names = [default_backend(ctx.device.type)] + (
        ["torch_one_shot", "torch_two_shot", "nvrar"] if gpu else list(CPU_CANDIDATES)
    )
    comms = {}
    for name in names:
        rule = registry.algorithm_class(name).capability.topology_rule
        if rule and rule(topo):
            continue
        comms[name] = registry.create(
            name, topology=topo, max_bytes=buffer_bytes, one_shot_max_bytes=buffer_bytes, device=ctx.device
        )
    entries = []
    main = ctx.rank == 0
    sizes = sizes_from(parse_size(args.minbytes), parse_size(args.maxbytes), args.stepfactor)
    if "nvrar" in comms:  # every candidate's kernel, compiled in parallel before timing starts
        from spanllm.comm.nvrar.compile import precompile

        nv = comms["nvrar"]
        pairs = {
            (lp, dtype)
            for size in sizes
            for lp in nvrar_grid(args, topo, max(1, size // itemsize) * itemsize, nv.one_shot_max_bytes)
        }
        pre = precompile([(nv, pairs)])
        if main:
            print(f"# nvrar kernels precompiled: {pre}", flush=True)
    for size in sizes:
        count = max(1, size // itemsize)
        nbytes = count * itemsize
        x = torch.empty(count, dtype=dtype, device=ctx.device)
        x0 = (torch.randn(count, device=ctx.device) * 1e-2).to(dtype)
        times: dict[str, float] = {}
        best_launch, best_launch_t = None, float("inf")
        for name, comm in comms.items():
            if comm.unsupported_reason(x) is not None:
                continue
            launches = list(nvrar_grid(args, topo, nbytes, comm.one_shot_max_bytes)) if name == "nvrar" else [None]
            for lp in launches:
                if lp is not None:
                    comm.fixed_launch = lp
                wrong = torch.tensor([check_exact(comm, x, graph=gpu)], dtype=torch.int64, device=ctx.device)
                dist.all_reduce(wrong)  # every rank must skip the same candidates, or their calls mismatch
                if int(wrong.item()):
                    if main:
                        print(
                            f"# {name} {lp.short() if lp else ''} gave wrong results at {nbytes} bytes: not a candidate"
                        )
                    continue
                t = time_calls(
                    lambda: comm.all_reduce_(x),  # noqa: B023
                    reset=lambda: x.copy_(x0),  # noqa: B023
                    samples=args.iters,
                    warmup=3,
                    calls_per_sample=20 if gpu else 1,
                    graph=gpu,
                    device=ctx.device,
                ).median_us
                key = name if lp is None else f"nvrar[{lp.short()}]"
                times[key] = t
                if lp is not None and t < best_launch_t:
                    best_launch, best_launch_t = lp, t
            if name == "nvrar":
                comm.fixed_launch = None
        if not times:
            raise SpanllmError(
                f"no candidate gave correct results at {nbytes} bytes on topology {topo}; "
                "see the lines above and run `spanllm bench allreduce` on this size"
            )
        best_key = min(times, key=times.get)
        best = best_key.split("[")[0]
        entries.append(
            TuningEntry(
                str(topo), DTYPE_NAMES[dtype], nbytes, best, asdict(best_launch) if best_launch else None, times
            )
        )
        if main:
            ranked = sorted(times.items(), key=lambda kv: kv[1])[:4]
            print(
                f"{nbytes:>10} B  best {best_key:<28} {times[best_key]:8.2f} us   "
                + "  ".join(f"{k}={v:.2f}" for k, v in ranked[1:]),
                flush=True,
            )
    for c in comms.values():
        c.close()
    table = TuningTable(
        entries,
        {
            "machine": machine_info(),
            "versions": versions(),
            "settings": {
                "topology": str(topo),
                "dtype": DTYPE_NAMES[dtype],
                "buffer_bytes": buffer_bytes,
                "blocks": args.blocks,
                "tiles": args.tiles,
                "protocols": args.protocols,
                "pipelined": args.pipelined,
                "iters": args.iters,
            },
        },
    )
    if main:
        table.save(args.out)
        print(f"# wrote {args.out} ({len(entries)} sizes)")
    return {"entries": len(entries)}


def _ints(flag: str, text: str, allowed=None) -> list[int]:
    try:
        values = [int(t) for t in text.split(",")]
    except ValueError:
        values = []
    ok = bool(values) and (set(values) <= allowed if allowed is not None else min(values) >= 1)
    if not ok:
        want = f"values in {sorted(allowed)}" if allowed is not None else "integers >= 1"
        raise UsageError(f"{flag} {text!r}: give comma-separated {want}")
    return values


def check_arguments(args) -> None:
    """Every option, before any rank starts."""
    from spanllm.comm.nvrar.allreduce import MAX_PROGRAMS, PROTOCOLS

    checks.output_file("--out", args.out)
    world = checks.world_size(args.nprocs)
    dtype, sizes = sweep_bytes(args)
    checks.at_least("-n/--iters", args.iters, 1, " (timed samples per candidate)")
    checks.topology(world, args.ranks_per_node)
    given = {k: getattr(args, k) for k in GPU_DEFAULTS if getattr(args, k) is not None}
    device = checks.device_type(world)
    if device == "cuda":
        for k, v in GPU_DEFAULTS.items():
            setattr(args, k, v if getattr(args, k) is None else getattr(args, k))
    check_buffer_bytes(args)
    if args.blocks is not None:
        blocks = _ints("--blocks", args.blocks)
        if max(blocks) > MAX_PROGRAMS:
            raise UsageError(f"--blocks {args.blocks!r}: at most {MAX_PROGRAMS} programs per launch")
    if args.tiles is not None:
        _ints("--tiles", args.tiles)
    if args.pipelined is not None:
        _ints("--pipelined", args.pipelined, {0, 1})
    bad = [p for p in args.protocols.split(",") if p not in PROTOCOLS] if args.protocols is not None else []
    if bad:
        raise UsageError(
            f"--protocols {args.protocols!r}: {bad[0]!r} is not an nvrar protocol; choose from {', '.join(PROTOCOLS)}"
        )
    if given and device != "cuda":
        k, v = next(iter(given.items()))
        flag = "--" + k.replace("_", "-")
        what = (
            "sizes the symmetric buffer of the GPU candidates (nvrar, torch symmetric memory)"
            if k == "buffer_bytes"
            else "is an nvrar launch parameter, and nvrar does not run on CPU"
        )
        raise UsageError(
            f"{flag} {v!r}: {what}; these ranks run on CPU, where tune times {default_backend('cpu')}, "
            f"{', '.join(CPU_CANDIDATES)} only; drop {flag}"
        )
    check_host_memory(sizes[-1], dtype.itemsize, True, world)


def run(args) -> int:
    check_arguments(args)
    launch(tune_rank, args, nprocs=args.nprocs)
    return finish(0)
