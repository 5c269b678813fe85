"""Ahead-of-time compilation of nvrar kernel specialisations, in parallel worker processes.

Every (dtype, launch) pair an nvrar communicator runs is its own Triton specialisation (constexprs G, R,
E, ONE_SHOT, BLOCK, PROTO, TRACE, PIPE and num_warps), and every compile links NVSHMEM's device
library: ~5 s each on the H200 host. A first call pays that inline and one at a time, so a conformance run over nine
launch variants and four dtypes spent most of its minutes in the compiler, while the host's other
cores idled.

`precompile([(comm, pairs), ...])` compiles what a run will need up front (`launches_for_sizes` lists
the (launch, dtype) pairs a communicator picks for given message sizes; `precompile_sizes` does both for
any communicators, auto's nvrar backend included). SPANLLM_NVRAR_PRECOMPILE=0 turns it off. The ranks of one host
that share a Triton cache directory (pinned: `pin_cache_dir`) split the union of their specialisations; each
rank compiles its share in spawned
worker processes (`Triton`'s `warmup`, from the very arguments `NvrarAllReduce.kernel_arguments`
builds for a real launch, tensors replaced by their dtypes). The workers fill Triton's on-disk cache;
the rank's own first launch then finds the cubin there and only loads it, and Triton's post-compile
hook registers the module with NVSHMEM in the rank itself (the workers turn that hook off: they have
no NVSHMEM). A specialisation the cache does not hold for whatever reason is simply compiled at its
first call, as without this module; nothing else depends on it.
"""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import socket
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch
import torch.distributed as dist

I32_MIN, I32_MAX = -(2**31), 2**31 - 1


def _canonical(arg):
    """What Triton's specialisation sees of one argument: a tensor's dtype; an int's width (every int
    argument of the kernel is do_not_specialize, so only i32 vs i64 matters)."""
    if isinstance(arg, torch.Tensor):
        return arg.dtype
    if isinstance(arg, bool) or not isinstance(arg, int):
        return arg
    return 1 if I32_MIN <= arg <= I32_MAX else 2**40


def launches_for_sizes(comm, sizes, dtypes) -> set[tuple]:
    """The (launch, dtype) pairs `comm` picks for messages of these element counts (tuning table, fixed
    launch or default rule, exactly as a call would); sizes over the communicator's max_bytes are left out."""
    out = set()
    for dt in dtypes:
        for n in sizes:
            x = torch.empty(n, dtype=dt, device="meta")
            if n * x.element_size() <= comm.max_bytes:
                out.add((comm.launch_for(x), dt))
    return out


def specialisations(comm, pairs) -> list[tuple]:
    """The distinct (positional args, constexpr items) this communicator launches for these (launch, dtype)
    pairs, in a canonical, picklable, sortable form."""
    from spanllm.comm.nvrar.allreduce import elements_per_cell

    out = set()
    for p, dt in pairs:
        n = elements_per_cell(dt) * p.block  # any length: only int widths reach the specialisation
        args, constexprs = comm.kernel_arguments(dt, p, n, p.block)
        args = tuple(_canonical(a) for a in args)
        out.add((args, tuple(sorted(constexprs.items()))))  # values as launched (True is not 1 in a cache key)
    return sorted(out, key=repr)


def nvrar_members(comm) -> list:
    """The nvrar communicators inside `comm`: itself, or the backends of an `auto` communicator."""
    from spanllm.comm.nvrar.allreduce import NvrarAllReduce

    if isinstance(comm, NvrarAllReduce):
        return [comm]
    return [b for b in getattr(comm, "backends", {}).values() if isinstance(b, NvrarAllReduce)]


def size_ladder(max_elems: int) -> list[int]:
    """Element counts 2, 3, 4, 6, 8, 12, ... up to max_elems: powers of two and their midpoints, enough to
    meet every launch a tuning table or the default rule picks between them."""
    return sorted(k for b in range(1, max_elems.bit_length()) for k in {1 << b, 3 << (b - 1)} if k <= max_elems)


def precompile_sizes(comms, sizes, dtypes) -> dict | None:
    """`precompile` for every nvrar communicator in `comms` (auto's included) at these element counts;
    None when there is none. Collective: every rank passes the same kinds of communicators."""
    jobs = [(m, launches_for_sizes(m, sizes, dtypes)) for c in comms for m in nvrar_members(c)]
    return precompile(jobs) if jobs else None


# Done-markers: a worker that compiled a specialisation leaves an empty file named by a hash of what Triton's
# cache key depends on (Triton's version, the GPU architecture, the kernel source and everything it calls,
# the NVSHMEM device library, the specialisation). A later process on the host skips those specs without
# starting workers
# (~10-15 s per process for a pool that would only find cache hits). A marker whose cubin has since left
# Triton's cache costs only an inline compile at the first call, as without this module.
MARKER_DIR_NAME = "spanllm_nvrar_compiled"


def marker_dir() -> Path:
    import triton

    return Path(triton.knobs.cache.dir) / MARKER_DIR_NAME  # inside the (pinned) cache the markers describe


def kernel_fingerprint() -> str:
    """What, besides a specialisation, goes into Triton's cache key for this kernel: Triton itself
    (`triton_key`), the GPU architecture, the cache-invalidating TRITON_* variables, the kernel source and
    everything it calls, and the NVSHMEM device library (path, size, mtime). GPU machine only."""
    import triton
    from triton._C.libtriton import get_cache_invalidating_env_vars
    from triton.runtime.cache import triton_key

    from spanllm.comm.nvrar import kernel as nvrar_kernel

    k = nvrar_kernel.nvrar_kernel
    arch = torch.cuda.get_device_capability() if torch.cuda.is_available() else None
    libs = [
        (name, path, *(os.stat(path)[6:9:2] if os.path.exists(path) else ()))
        for name, path in sorted(k.extern_libs.items())
    ]  # (name, path, size, mtime)
    env = sorted(get_cache_invalidating_env_vars().items())
    return f"{triton.__version__}|{triton_key()}|{arch}|{env}|{k.jit_func.cache_key}|{libs}"


def marker_name(spec: tuple, fingerprint: str) -> str:
    return hashlib.sha256(f"{fingerprint}|{spec!r}".encode()).hexdigest()[:40]


def not_yet_compiled(specs: list[tuple], fingerprint: str, directory: Path) -> list[tuple]:
    """The specs without a done-marker in `directory`."""
    return [s for s in specs if not (directory / marker_name(s, fingerprint)).exists()]


def _compile_one(spec, fingerprint: str = "", directory: str = "") -> float:
    """Worker: compile one specialisation into Triton's on-disk cache, then leave its done-marker."""
    import triton

    from spanllm.comm.nvrar import kernel as nvrar_kernel

    triton.knobs.runtime.jit_post_compile_hook = None  # NVSHMEM module init belongs to the rank, not here
    args, constexprs = spec
    t0 = time.perf_counter()
    nvrar_kernel.nvrar_kernel.warmup(*args, grid=(1,), **dict(constexprs))
    if directory:
        os.makedirs(directory, exist_ok=True)
        (Path(directory) / marker_name(spec, fingerprint)).touch()
    return time.perf_counter() - t0


def pin_cache_dir() -> str:
    """Fix TRITON_CACHE_DIR to the directory Triton uses now, for this process and the workers it spawns.
    The workers' compiles must land where this rank's first launch looks, and that can move: the first
    inductor kernel of a process (a compiled decode) points TRITON_CACHE_DIR at a per-device directory
    under /tmp/torchinductor_$USER unless it is already set."""
    if "TRITON_CACHE_DIR" not in os.environ:
        import triton

        os.environ["TRITON_CACHE_DIR"] = os.path.realpath(triton.knobs.cache.dir)
    return os.path.realpath(os.environ["TRITON_CACHE_DIR"])


def _host_share(group, specs: list[tuple], cache_dir: str = "") -> tuple[list[tuple], int, int]:
    """(this rank's share of the specialisations of the ranks that share its host and Triton cache
    directory, its index among them, their number)."""
    if not (dist.is_available() and dist.is_initialized()):
        return specs, 0, 1
    world = dist.get_world_size(group)
    place = (socket.gethostname(), cache_dir)
    gathered: list = [None] * world
    dist.all_gather_object(gathered, (place, specs), group=group)
    peers = [r for r, (pl, _) in enumerate(gathered) if pl == place]
    union = sorted({s for pl, ss in gathered if pl == place for s in ss}, key=repr)
    idx = peers.index(dist.get_rank(group))
    return union[idx :: len(peers)], idx, len(peers)


PRECOMPILE_TIMEOUT_S = 600.0  # a worker pool that has not finished by then is stopped (an error, reported)


def _run_pool(
    share: list[tuple], workers: int, fingerprint: str, directory: Path, compile_one=None
) -> tuple[list[float], str | None]:
    """Compile `share` in `workers` spawned processes; (seconds per spec, error or None). Never hangs: past
    PRECOMPILE_TIMEOUT_S the workers are killed and the rest compiles at its first call."""
    from concurrent.futures import wait

    ctx = multiprocessing.get_context("spawn")  # never fork a process that holds a CUDA context
    pool = ProcessPoolExecutor(max_workers=workers, mp_context=ctx)
    try:
        futures = [pool.submit(compile_one or _compile_one, s, fingerprint, str(directory)) for s in share]
        done, pending = wait(futures, timeout=PRECOMPILE_TIMEOUT_S)
        if pending:
            for proc in list(getattr(pool, "_processes", {}).values()):  # no public way to stop a stuck worker
                proc.kill()
            return (
                [f.result() for f in done if f.exception() is None],
                f"{len(pending)} of {len(share)} compiles unfinished after {PRECOMPILE_TIMEOUT_S:.0f} s",
            )
        errors = [f.exception() for f in futures if f.exception() is not None]
        if errors:
            return [f.result() for f in futures if f.exception() is None], f"{type(errors[0]).__name__}: {errors[0]}"
        return [f.result() for f in futures], None
    finally:
        pool.shutdown(wait=False, cancel_futures=True)


def precompile(jobs, workers: int | None = None) -> dict:
    """Compile ahead of the first calls. `jobs`: (communicator, (launch, dtype) pairs) for nvrar
    communicators of one group. Collective over that group: every rank calls it, with its own jobs.
    Returns what it did: specialisations, this rank's share, workers, seconds."""
    t0 = time.perf_counter()
    jobs = list(jobs)
    if not jobs:
        raise ValueError("precompile: no (communicator, pairs) jobs given")
    if os.environ.get("SPANLLM_NVRAR_PRECOMPILE", "1") == "0":
        return {"skipped": "SPANLLM_NVRAR_PRECOMPILE=0: kernels compile at their first call"}
    specs = sorted({s for comm, pairs in jobs for s in specialisations(comm, pairs)}, key=repr)
    cache_dir = pin_cache_dir()
    fingerprint, directory = kernel_fingerprint(), marker_dir()
    todo = not_yet_compiled(specs, fingerprint, directory)  # every rank lists before any compile starts
    group = jobs[0][0].group
    share, idx, host_ranks = _host_share(group, todo, cache_dir)
    if workers is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 2)
        workers = max(1, cores // host_ranks)
    workers = max(1, min(workers, len(share)))
    compile_s: list[float] = []
    error = None
    if share:
        try:
            compile_s, error = _run_pool(share, workers, fingerprint, directory)
        except Exception as e:  # reported, not hidden: the kernels then compile at their first call
            error = f"{type(e).__name__}: {e}"
    if dist.is_available() and dist.is_initialized():
        dist.barrier(group=group)  # the host's cache is complete before anyone launches
    out = {
        "specialisations": len(specs),
        "already_compiled": len(specs) - len(todo),
        "compiled_here": len(share),
        "workers": workers if share else 0,
        "host_ranks": host_ranks,
        "compile_s_max": round(max(compile_s, default=0.0), 2),
        "seconds": round(time.perf_counter() - t0, 2),
    }
    if error:
        out["error"] = f"{error} (these kernels compile at their first call instead)"
    return out
