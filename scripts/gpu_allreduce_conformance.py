"""GPU conformance run of the all-reduce backends (torchrun, one process per GPU).

    torchrun --nproc-per-node 2 scripts/gpu_allreduce_conformance.py --ranks-per-node 1 --out r.json

Runs the cases of spanllm.comm.conformance for nvrar (several launch variants) and the baselines, and
writes every CaseResult to --out. tests/test_gpu.py asserts on that file; scripts/gpu_check.sh runs it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist

from spanllm.comm import Topology, registry
from spanllm.comm import conformance as C
from spanllm.comm.nvrar.allreduce import LaunchParams
from spanllm.comm.nvrar.compile import launches_for_sizes, precompile
from spanllm.launch import init_from_launcher


def write(path: str, topo, ctx, t_start: float, results: list[dict], complete: bool, precompiled: dict) -> None:
    """The report so far (rank 0). Rewritten after every backend, so a run cut by a time limit keeps the
    backends that finished, marked complete=False."""
    doc = {
        "kind": "gpu_conformance",
        "topology": str(topo),
        "world_size": ctx.world_size,
        "complete": complete,
        "torch": torch.__version__,
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        "seconds": time.time() - t_start,
        "precompile": precompiled,
        "results": results,
    }
    with open(path + ".tmp", "w") as f:
        json.dump(doc, f, indent=1)
    os.replace(path + ".tmp", path)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks-per-node", type=int, default=None)
    ap.add_argument("--calls", type=int, default=10000)
    ap.add_argument("--max-bytes", type=int, default=8 << 20)
    ap.add_argument("--baselines", default="nccl,torch_one_shot,torch_two_shot")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    ctx = init_from_launcher("nccl")
    dev = ctx.device
    topo = Topology.from_env(ctx.world_size, args.ranks_per_node)
    t_start = time.time()
    results: list[dict] = []
    variants = {
        "default": None,
        "rs_b4x256": LaunchParams(one_shot=False, num_blocks=4, block=256, num_warps=4),
        "rs_b64x1024": LaunchParams(one_shot=False, num_blocks=64, block=1024, num_warps=8),
    }
    variants["simple_rs_b16x512"] = LaunchParams(
        one_shot=False, num_blocks=16, block=512, num_warps=4, protocol="simple"
    )
    # Phase-major loops with few programs, so each program carries many tiles through every phase.
    variants["pipe_rs_b2x256"] = LaunchParams(one_shot=False, num_blocks=2, block=256, num_warps=4, pipelined=True)
    variants["pipe_simple_rs_b4x512"] = LaunchParams(
        one_shot=False, num_blocks=4, block=512, num_warps=4, protocol="simple", pipelined=True
    )
    if topo.ranks_per_node > 1:
        variants["os_b8x512"] = LaunchParams(one_shot=True, num_blocks=8, block=512, num_warps=4)
        variants["simple_os_b8x256"] = LaunchParams(
            one_shot=True, num_blocks=8, block=256, num_warps=4, protocol="simple"
        )
        variants["pipe_os_b2x256"] = LaunchParams(one_shot=True, num_blocks=2, block=256, num_warps=4, pipelined=True)
    comms = {}
    for name, launch in variants.items():
        comms[f"nvrar:{name}"] = registry.create(
            "nvrar",
            topology=topo,
            max_bytes=args.max_bytes,
            launch=launch,
            one_shot_max_bytes=args.max_bytes,
            device=dev,
        )
    for name in [b for b in args.baselines.split(",") if b]:
        cls = registry.algorithm_class(name)
        if cls.capability.topology_rule and cls.capability.topology_rule(topo):
            continue
        comms[name] = registry.create(name, topology=topo, max_bytes=args.max_bytes, device=dev)
    itemmax = args.max_bytes
    lengths = [1, 2, 3, 5, 7, 8, 31, 127, 128, 1000, 1023, 4097, 65537, 262147, 1_000_003]
    dtypes = [torch.float32, torch.bfloat16, torch.float16, torch.int32]
    # Protocols and modes alternating on ONE communicator (a tuning table does this per size): the
    # regions must not alias, or stale data of one protocol passes for a flag of the other.
    mixed_launches = [
        LaunchParams(protocol="ll8", block=512, num_blocks=8),
        LaunchParams(protocol="simple", block=512, num_blocks=8),
        LaunchParams(protocol="ll8", block=256, num_blocks=2, pipelined=True),
    ]
    if topo.ranks_per_node > 1:
        mixed_launches += [
            LaunchParams(one_shot=True, protocol="simple", block=256, num_blocks=4),
            LaunchParams(one_shot=True, protocol="ll8", block=256, num_blocks=4),
        ]
    # Compile every kernel the cases below launch first, in parallel (otherwise one at a time, inline).
    lens = lengths + [itemmax // 4, itemmax // 2]  # the buffer maximum for 4- and 2-byte dtypes
    case_sizes = lens + [300_001, 4099, 65_536, 12_289, 12_290, 1 << 20, 8192, 100_003]
    jobs = [(c, launches_for_sizes(c, case_sizes, dtypes)) for k, c in comms.items() if k.startswith("nvrar")]
    jobs.append((comms["nvrar:default"], {(lp, dt) for lp in mixed_launches for dt in (torch.bfloat16, torch.int32)}))
    pre = precompile(jobs)
    if ctx.rank == 0:
        print(f"[precompile] {pre}", flush=True)
    for key, comm in comms.items():
        t0 = time.time()
        res = C.case_lengths(comm, lens, dtypes if key.startswith("nvrar") else [torch.float32, torch.bfloat16], dev)
        res += [
            r
            for r in (
                C.case_bitwise_identical(comm, 300_001, torch.bfloat16, dev),
                C.case_bitwise_identical(comm, 4099, torch.float32, dev),
            )
            if r is not None
        ]
        res += [
            r
            for r in (
                C.case_straggler(comm, 65536, torch.bfloat16, 0.05, dev),
                C.case_cuda_graph(comm, 12_289, torch.bfloat16, 200, dev),  # odd: baselines may decline
                C.case_cuda_graph(comm, 12_290, torch.bfloat16, 200, dev),
                C.case_cuda_graph(comm, 1 << 20, torch.bfloat16, 50, dev),
            )
            if r is not None
        ]
        calls = args.calls if key.startswith("nvrar") else min(args.calls, 1000)
        res += [
            r
            for r in (
                C.case_back_to_back(comm, 8192, torch.bfloat16, calls, dev),
                C.case_back_to_back(comm, 100_003, torch.float32, max(1, calls // 10), dev),
            )
            if r is not None
        ]
        res += C.case_bad_inputs(comm, dev)
        if hasattr(comm, "synchronize"):
            comm.synchronize()
        for r in res:
            d = r.as_dict()
            d["comm"] = key
            results.append(d)
        if ctx.rank == 0:
            bad = sum(r.wrong for r in res)
            print(f"[{key}] {len(res)} cases, {bad} wrong, {time.time() - t0:.1f}s", flush=True)
            write(args.out, topo, ctx, t_start, results, complete=False, precompiled=pre)
    mixed = comms["nvrar:default"]  # the alternating launches (defined above) on one communicator
    wrong = torch.zeros((), dtype=torch.int64, device=dev)
    for k in range(400):
        mixed.fixed_launch = mixed_launches[k % len(mixed_launches)]
        n = (4099, 65_536, 300_001)[k % 3]
        x = C.pattern(n, ctx.rank, torch.int32 if k % 2 else torch.bfloat16, dev, salt=k % 7)
        mixed.all_reduce_(x)
        wrong += (x != C.expected(n, ctx.world_size, x.dtype, dev, salt=k % 7)).sum()
    mixed.fixed_launch = None
    mixed.synchronize()
    results.append(
        {
            "case": "alternating_protocols",
            "algorithm": "nvrar",
            "wrong": int(wrong),
            "comm": "nvrar:default",
            "detail": {"calls": 400, "launches": [p.short() for p in mixed_launches]},
        }
    )
    if ctx.rank == 0:
        print(f"[nvrar alternating protocols] 400 calls, {int(wrong)} wrong", flush=True)
        write(args.out, topo, ctx, t_start, results, complete=True, precompiled=pre)
        print(f"wrote {args.out}: {sum(r['wrong'] for r in results)} wrong in {len(results)} cases", flush=True)
    sys.stdout.flush()
    dist.barrier()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
