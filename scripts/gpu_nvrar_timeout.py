"""One rank skips an nvrar call: the other must raise an error naming rank, step and peer, not hang.

torchrun --nproc-per-node 2 scripts/gpu_nvrar_timeout.py --ranks-per-node 1 --out t.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist

from spanllm.comm import AllReduceError, Topology, registry
from spanllm.launch import init_from_launcher


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks-per-node", type=int, default=None)
    ap.add_argument("--timeout-s", type=float, default=1.0)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    ctx = init_from_launcher("nccl")
    topo = Topology.from_env(ctx.world_size, args.ranks_per_node)
    # Call 1 (everyone) under a generous timeout: the ranks compile the kernel at different speeds, and a
    # 1 s wait on the first call can expire before the slower rank arrives. The timeout is read per launch.
    comm = registry.create("nvrar", topology=topo, timeout_s=60.0, device=ctx.device)
    x = torch.ones(4096, dtype=torch.bfloat16, device=ctx.device)
    comm.all_reduce_(x)
    comm.synchronize()
    dist.barrier()
    comm.timeout_s = args.timeout_s
    outcome = {"rank": ctx.rank, "skipped": ctx.rank == ctx.world_size - 1}
    t0 = time.time()
    if ctx.rank != ctx.world_size - 1:
        try:
            comm.all_reduce_(x)  # call 2: the last rank never makes it
            comm.synchronize()
            outcome["error"] = None
        except AllReduceError as e:
            outcome["error"] = str(e)
        except RuntimeError as e:
            outcome["error"] = f"unrecorded: {e}"
    outcome["seconds"] = time.time() - t0
    with open(f"{args.out}.rank{ctx.rank}", "w") as f:
        json.dump(outcome, f)
    print(json.dumps(outcome), flush=True)
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
