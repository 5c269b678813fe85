"""Where an NVRAR call's time goes: the kernel's per-phase trace (TRACE=1) per message size.

    torchrun --nproc-per-node 2 scripts/gpu_nvrar_phases.py --ranks-per-node 1 --tuning t.json --out phases.json

For each size: warm-up calls, then `--calls` eager calls each read back (one synchronize per call, so
calls do not overlap); every program's record of every call goes into `spanllm.comm.nvrar.trace.summarize`.
Per rank and size the JSON holds the launch that ran, the median program time, the kernel span, and the
median time per phase (intra-node push / wait, inter-node send / wait, all-gather push / wait). A
traced kernel is its own specialisation; its times are a few clock reads slower than the untraced one,
so set them against `spanllm bench allreduce` for the totals, and read this file for the split.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist

from spanllm.comm import Topology, registry
from spanllm.comm.nvrar.compile import precompile_sizes
from spanllm.comm.nvrar.trace import summarize
from spanllm.comm.tuning import TuningTable
from spanllm.launch import init_from_launcher
from spanllm.measure.report import versions

SIZES = (4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks-per-node", type=int, default=None)
    ap.add_argument("--tuning", default=None, help="tuning table(s): the launch per size, as in the benchmark")
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    ctx = init_from_launcher("nccl")
    topo = Topology.from_env(ctx.world_size, args.ranks_per_node)
    tuning = TuningTable.load(args.tuning) if args.tuning else None
    comm = registry.create("nvrar", topology=topo, max_bytes=max(SIZES), tuning=tuning, trace=True, device=ctx.device)
    pre = precompile_sizes([comm], [n // 2 for n in SIZES], [torch.bfloat16])
    if ctx.rank == 0:
        print(f"nvrar kernels precompiled: {pre}", flush=True)
    rows = []
    for nbytes in SIZES:
        x = torch.ones(nbytes // 2, dtype=torch.bfloat16, device=ctx.device)
        for _ in range(10):
            comm.all_reduce_(x)
        comm.synchronize()
        calls = []
        for _ in range(args.calls):
            x.fill_(1)
            comm.all_reduce_(x)
            calls.append(comm.last_trace())
        wrong = int((x != ctx.world_size).sum())
        summary = summarize(calls)
        mine = {"rank": ctx.rank, "bytes": nbytes, "ran": comm.algorithm_for(x), "wrong": wrong, **summary}
        gathered = [None] * ctx.world_size
        dist.all_gather_object(gathered, mine)
        rows += gathered
        if ctx.rank == 0:
            for r in gathered:
                ph = " ".join(f"{k} {v:.2f}" for k, v in r["phases_us"].items())
                print(
                    f"{nbytes:>9} B rank {r['rank']} {r['ran']}: span {r['kernel_span_us']:.2f} us, program "
                    f"{r['program_us']:.2f} us | {ph} | {r['clock_ghz']:.2f} GHz, wrong {r['wrong']}",
                    flush=True,
                )
    if ctx.rank == 0:
        doc = {
            "kind": "nvrar_phases",
            "topology": str(topo),
            "world_size": ctx.world_size,
            "versions": versions(),
            "machine": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
            "settings": {
                "calls": args.calls,
                "tuning": args.tuning,
                "dtype": "bfloat16",
                "mode": "eager, one call at a time",
            },
            "rows": rows,
        }
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)
        print(f"wrote {args.out}", flush=True)
    dist.barrier()
    comm.close()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
