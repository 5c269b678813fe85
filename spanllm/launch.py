"""Run a function on every rank: under a launcher (torchrun, srun, mpiexec) or as local gloo processes.

`launch(fn, *args, nprocs=N)` spawns N local CPU processes joined by gloo when no launcher set RANK;
under a launcher it runs `fn` in this process with the launcher's rank. `fn(ctx, *args)` gets a
`DistContext`; whatever it returns is collected per rank and handed back to the caller of `launch`
(for spawned processes, through pickles in a private temporary folder).

Rendezvous of spawned processes goes through a file store in that folder: no port is chosen, so
concurrent jobs on one machine never collide.
"""

from __future__ import annotations

import datetime
import os
import pickle
import tempfile
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = float(os.environ.get("SPANLLM_PG_TIMEOUT_S", "300"))


@dataclass(frozen=True)
class DistContext:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    backend: str
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def under_launcher() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _env_int(*names: str, default: int) -> int:
    for n in names:
        if os.environ.get(n):
            return int(os.environ[n])
    return default


def init_from_launcher(backend: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> DistContext:
    """Join the job that torchrun/srun/mpiexec started (env:// rendezvous)."""
    rank = _env_int("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", default=0)
    world = _env_int("WORLD_SIZE", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE", default=1)
    local_rank = _env_int("LOCAL_RANK", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK", default=0)
    local_world = _env_int("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE", "OMPI_COMM_WORLD_LOCAL_SIZE",
                           default=world)
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        kwargs: dict[str, Any] = {}
        if backend == "nccl":
            kwargs["device_id"] = device
        dist.init_process_group(backend, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout_s), **kwargs)
    return DistContext(rank, world, local_rank, local_world, backend, device)


def _spawned_main(local_rank: int, fn: Callable, args: tuple, nprocs: int, workdir: str,
                  timeout_s: float, threads: int) -> None:
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=f"file://{workdir}/store", rank=local_rank,
                            world_size=nprocs, timeout=datetime.timedelta(seconds=timeout_s))
    ctx = DistContext(local_rank, nprocs, local_rank, nprocs, "gloo", torch.device("cpu"))
    try:
        result = fn(ctx, *args)
        with open(os.path.join(workdir, f"result{local_rank}.pkl"), "wb") as f:
            pickle.dump(result, f)
    finally:
        dist.destroy_process_group()


def launch(fn: Callable[..., Any], *args: Any, nprocs: int = 1, backend: str | None = None,
           timeout_s: float = DEFAULT_TIMEOUT_S) -> list[Any]:
    """Run `fn(ctx, *args)` on every rank; return the per-rank results (only this rank's under a launcher).

    Spawned ranks are CPU processes over gloo. If one of them raises, the others are terminated
    and the error is re-raised here: a failing rank never leaves the rest hanging.
    """
    if under_launcher():
        ctx = init_from_launcher(backend, timeout_s)
        return [fn(ctx, *args)]
    if nprocs < 1:
        raise ValueError(f"nprocs={nprocs} must be >= 1")
    if backend not in (None, "gloo"):
        raise ValueError(f"backend={backend!r}: local spawning uses gloo; start GPU jobs with torchrun")
    import torch.multiprocessing as mp

    threads = max(1, (os.cpu_count() or 1) // nprocs)
    with tempfile.TemporaryDirectory(prefix="spanllm-launch-") as workdir:
        mp.start_processes(_spawned_main, args=(fn, args, nprocs, workdir, timeout_s, threads),
                           nprocs=nprocs, join=True, start_method="spawn")
        results = []
        for r in range(nprocs):
            with open(os.path.join(workdir, f"result{r}.pkl"), "rb") as f:
                results.append(pickle.load(f))
        return results


def finish(code: int) -> int:
    """End a command: under a launcher on GPUs, leave the process at once after a barrier.

    Processes that captured NCCL calls in CUDA graphs were seen hanging in interpreter teardown until
    an outer timeout killed them (minutes of a GPU lease); results are written before this is called.
    """
    if under_launcher() and torch.cuda.is_available() and dist.is_initialized():
        import sys

        sys.stdout.flush()
        sys.stderr.flush()
        dist.barrier()
        os._exit(code)
    return code
