"""Run a function on every rank: under a launcher (torchrun, srun, mpiexec) or as local gloo processes.

`launch(fn, *args, nprocs=N)` spawns N local CPU processes joined by gloo when no launcher set RANK;
under a launcher it runs `fn` in this process with the launcher's rank. One rank on a machine with a GPU and no
launcher runs in this process on the GPU (a one-rank NCCL group): `spanllm bench throughput --model X` on a GPU
machine uses the GPU, as a user expects; several local ranks still need torchrun for GPUs (said once on stderr).
`fn(ctx, *args)` gets a `DistContext`; whatever it returns is collected per rank and handed back to the caller of
`launch` (for spawned processes, through pickles in a private temporary folder).

Rendezvous of spawned processes goes through a file store in that folder: no port is chosen, so
concurrent jobs on one machine never collide.

Collective timeout
    A collective (or store wait) that waits longer than `timeout_s` fails. Default: the environment
    variable SPANLLM_PG_TIMEOUT_S (seconds, read at each call), else 300; `spanllm --pg-timeout S ...`
    sets that variable. Local ranks first wait (up to max(timeout, 120 s)) until every rank has started,
    so a short timeout does not trip over slow interpreter start-up.

When a spawned rank fails
    The rank records its exception (type, message, traceback, time, and whether it is only a symptom:
    "Connection closed by peer", a collective timeout) in `error{rank}.json` *before* it leaves the
    process group; its peers' collectives fail only after that. The parent gives the others
    FAILURE_GRACE_S to finish failing, stops the rest and raises `spanllm.errors.RankError` for the
    first real error: a rank's own exception (earliest first), else a rank that died without one (a
    signal), else a timeout, naming the ranks that had not failed and were still running (stopped or
    hung: the ranks that stopped answering), else the earliest connection error.

Lifetime
    Workers die with the parent: PR_SET_PDEATHSIG (Linux) and a watchdog thread on the parent's pid.
    SIGTERM / SIGINT to the parent stop the workers and remove the folder, then raise
    `spanllm.errors.Interrupted` (exit code 128 + signal). After a SIGKILL of the parent the workers
    still die, but nothing is left to remove the folder.
"""

from __future__ import annotations

import datetime
import json
import os
import pickle
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from spanllm.checks import MAX_COLLECTIVE_TIMEOUT_S
from spanllm.comm.torch_dist import default_backend
from spanllm.errors import Interrupted, RankError, UsageError, exit_code

# Each value a rank reads from its launcher (torchrun, srun, mpiexec), by the variables that may hold it: the first
# one set wins
_RANK_ENV = ("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK")
_WORLD_ENV = ("WORLD_SIZE", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE")
_LOCAL_RANK_ENV = ("LOCAL_RANK", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK")
_LOCAL_WORLD_ENV = ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE", "OMPI_COMM_WORLD_LOCAL_SIZE")

TIMEOUT_ENV = "SPANLLM_PG_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 300.0
MAX_TIMEOUT_S = MAX_COLLECTIVE_TIMEOUT_S
STARTUP_TIMEOUT_S = 120.0  # at least this long for every local rank to start (imports, spawn)
FAILURE_GRACE_S = 2.0  # after a rank fails, how long its peers get to fail on their own before they are stopped


def pg_timeout_s() -> float:
    """The collective timeout: SPANLLM_PG_TIMEOUT_S seconds, else DEFAULT_TIMEOUT_S."""
    text = os.environ.get(TIMEOUT_ENV, "").strip()
    if not text:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value <= MAX_TIMEOUT_S:
        raise UsageError(
            f"{TIMEOUT_ENV}={text!r}: the collective timeout must be a number of seconds in (0, {MAX_TIMEOUT_S:g}] "
            f"(a week: a rank that stops answering must fail the job some time); set e.g. {TIMEOUT_ENV}=300 or "
            "pass --pg-timeout 300"
        )
    return value


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
    from spanllm.errors import UsageError

    for n in names:
        if os.environ.get(n):
            text = os.environ[n]
            try:
                return int(text)
            except ValueError:
                raise UsageError(
                    f"{n}={text!r}: not an integer; under a launcher (RANK and WORLD_SIZE set) it is this rank's place "
                    "in the job: let torchrun / srun / mpiexec set it, or unset RANK and WORLD_SIZE to run local ranks"
                ) from None
    return default


def check_launcher_env() -> None:
    """Under a launcher (RANK and WORLD_SIZE set), the variables a rank reads as its place in the job: integers, with
    0 <= RANK < WORLD_SIZE, checked before any rank joins (a bad one used to end in a traceback, or a rendezvous that
    waits for ranks that do not exist)."""
    from spanllm.errors import UsageError

    if not under_launcher():
        return
    rank, world = _env_int(*_RANK_ENV, default=0), _env_int(*_WORLD_ENV, default=1)
    _env_int(*_LOCAL_RANK_ENV, default=0)
    _env_int(*_LOCAL_WORLD_ENV, default=world)
    if world < 1 or not 0 <= rank < world:
        raise UsageError(
            f"RANK={rank} WORLD_SIZE={world}: a rank must be in [0, WORLD_SIZE) of a world >= 1; let the launcher set "
            "them, or unset RANK and WORLD_SIZE to run local ranks"
        )


def launcher_world_size() -> int | None:
    """The world size a launcher set (WORLD_SIZE), or None when not under one."""
    return _env_int(*_WORLD_ENV, default=1) if under_launcher() else None


def init_from_launcher(backend: str | None = None, timeout_s: float | None = None) -> DistContext:
    """Join the job that torchrun/srun/mpiexec started (env:// rendezvous)."""
    timeout_s = pg_timeout_s() if timeout_s is None else timeout_s
    rank = _env_int(*_RANK_ENV, default=0)
    world = _env_int(*_WORLD_ENV, default=1)
    local_rank = _env_int(*_LOCAL_RANK_ENV, default=0)
    local_world = _env_int(*_LOCAL_WORLD_ENV, default=world)
    if backend is None:
        backend = default_backend("cuda" if torch.cuda.is_available() else "cpu")
    if backend == "nccl":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        kwargs: dict[str, Any] = {}
        if backend == "nccl":
            kwargs["device_id"] = device
        dist.init_process_group(
            backend, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout_s), **kwargs
        )
    return DistContext(rank, world, local_rank, local_world, backend, device)


# --- spawned ranks -------------------------------------------------------------------------------------
def _die_with_parent(parent_pid: int) -> None:
    """SIGKILL this process when its parent dies (Linux prctl), and a watchdog thread for everywhere else."""
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            PR_SET_PDEATHSIG = 1
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        except (OSError, AttributeError):
            pass  # the watchdog below still ends this process
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)

    def watchdog() -> None:
        while True:
            time.sleep(0.5)
            if os.getppid() != parent_pid:
                os._exit(1)

    threading.Thread(target=watchdog, name="spanllm-parent-watchdog", daemon=True).start()


_PEER_RE = re.compile(
    r"Connection closed by peer|Connection reset by peer|Broken pipe|ECONNRESET|"
    r"Connection refused|remote worker crashing",
    re.IGNORECASE,
)
_TIMEOUT_RE = re.compile(r"timed out|timeout", re.IGNORECASE)


def error_kind(exc: BaseException) -> str:
    """'peer' (a peer went away), 'timeout' (a collective waited too long), 'interrupt', or 'error' (its own).

    Only torch's distributed errors and bare RuntimeErrors are symptoms: a project error whose message
    mentions a timeout is still that rank's own error.
    """
    if isinstance(exc, KeyboardInterrupt):
        return "interrupt"
    t = type(exc)
    if t is RuntimeError or t.__module__.startswith("torch"):
        text = str(exc)
        if _PEER_RE.search(text):
            return "peer"
        if _TIMEOUT_RE.search(text):
            return "timeout"
    return "error"


def _write_atomic(path: str, data: bytes) -> None:
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def _record_error(workdir: str, rank: int, exc: BaseException) -> None:
    message = exc.code if isinstance(exc, SystemExit) and isinstance(exc.code, str) else str(exc)
    t = type(exc)
    try:
        code = exit_code(exc)
    except Exception:  # noqa: BLE001 - recording must not fail
        code = None
    doc = {
        "rank": rank,
        "time": time.time(),
        "type": t.__name__,
        "module": t.__module__,
        "message": message,
        "traceback": traceback.format_exc(),
        "kind": error_kind(exc),
        "exit_code": code,
    }
    try:
        _write_atomic(os.path.join(workdir, f"error{rank}.json"), json.dumps(doc).encode())
    except OSError:
        pass  # the folder is gone: the parent is already cleaning up


def _wait_for_all(store: dist.Store, rank: int, world: int, timeout_s: float) -> None:
    """Every rank has started (a short collective timeout then does not trip over slow start-up)."""
    store.set(f"spanllm/started/{rank}", "1")
    store.wait([f"spanllm/started/{r}" for r in range(world)], datetime.timedelta(seconds=timeout_s))


def _spawned_main(
    local_rank: int,
    fn: Callable,
    args: tuple,
    nprocs: int,
    workdir: str,
    timeout_s: float,
    threads: int,
    parent_pid: int,
) -> None:
    _die_with_parent(parent_pid)
    torch.set_num_threads(threads)
    code = 0
    try:
        store = dist.FileStore(os.path.join(workdir, "store"), nprocs)
        _wait_for_all(store, local_rank, nprocs, max(timeout_s, STARTUP_TIMEOUT_S))
        store.set_timeout(datetime.timedelta(seconds=timeout_s))
        dist.init_process_group(
            "gloo", store=store, rank=local_rank, world_size=nprocs, timeout=datetime.timedelta(seconds=timeout_s)
        )
        ctx = DistContext(local_rank, nprocs, local_rank, nprocs, "gloo", torch.device("cpu"))
        result = fn(ctx, *args)
        _write_atomic(os.path.join(workdir, f"result{local_rank}.pkl"), pickle.dumps(result))
    except BaseException as e:  # noqa: BLE001 - recorded for the parent, which reports it
        _record_error(workdir, local_rank, e)  # before the group goes: peers fail only after this
        code = 1
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - the error that matters is recorded already
                pass
    sys.exit(code)  # quietly: the parent reports the error once


# --- the parent ----------------------------------------------------------------------------------------
def _process_state(pid: int) -> str:
    """'stopped', 'sleeping', 'running', ... from /proc (Linux), else 'running'."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "running"
    return {
        "R": "running",
        "S": "sleeping",
        "D": "in uninterruptible wait",
        "T": "stopped",
        "t": "stopped",
        "Z": "exiting",
    }.get(state, f"state {state}")


def _signal_name(code: int) -> str:
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


def _first_error(
    workdir: str, nprocs: int, exits: dict[int, tuple[int, float]], still_running: dict[int, str], timeout_s: float
) -> RankError:
    """The error to report: see the module docstring for the order."""
    recorded = {}
    for r in range(nprocs):
        path = os.path.join(workdir, f"error{r}.json")
        if os.path.exists(path):
            try:
                with open(path) as f:
                    recorded[r] = json.load(f)
            except (OSError, ValueError):
                pass

    def from_record(e: dict, message: str | None = None, known: bool | None = None) -> RankError:
        code = e["exit_code"]
        known = code is not None if known is None else known
        if message is None:
            message = (
                f"rank {e['rank']}: {e['message']}" if known else f"rank {e['rank']} raised {e['type']}: {e['message']}"
            )
        return RankError(
            message,
            rank=e["rank"],
            type_name=e["type"],
            traceback=e["traceback"],
            exit_code=1 if code is None else code,
            known=known,
        )

    def earliest(kind: str) -> dict | None:
        found = [e for e in recorded.values() if e["kind"] == kind]
        return min(found, key=lambda e: e["time"]) if found else None

    own = earliest("error")
    if own is not None:
        return from_record(own)
    died = sorted((t, r, code) for r, (code, t) in exits.items() if code != 0 and r not in recorded)
    if died:
        _, r, code = died[0]
        how = (
            f"was killed by {_signal_name(code)}"
            if code < 0
            else f"exited with code {code} before it could report an error (see its output above)"
        )
        return RankError(f"rank {r} {how}", rank=r, type_name="exit", exit_code=1)
    timed_out = earliest("timeout")
    if timed_out is not None:
        waiting = sorted(r for r, e in recorded.items() if e["kind"] == "timeout")
        fix = f"if it is only slow, raise the timeout with --pg-timeout or {TIMEOUT_ENV} (now {timeout_s:g} s)"
        if still_running:
            stuck = ", ".join(f"rank {r} ({state})" for r, state in sorted(still_running.items()))
            message = (
                f"{stuck} stopped answering: rank{'s' if len(waiting) > 1 else ''} "
                f"{', '.join(map(str, waiting))} timed out after {timeout_s:g} s waiting in a collective "
                f"and the rank{'s' if len(still_running) > 1 else ''} named had not failed; {fix}"
            )
        else:
            message = (
                f"ranks {', '.join(map(str, waiting))} timed out after {timeout_s:g} s in a collective "
                f"({timed_out['message'][:200]}); a rank did not make the same collective call, or {fix}"
            )
        return from_record(timed_out, message, known=True)  # the message says it all: no traceback without --debug
    other = earliest("interrupt") or earliest("peer")
    if other is not None:
        return from_record(other, f"rank {other['rank']} raised {other['type']}: {other['message']}")
    return RankError("a rank failed without a report (see the output above)", rank=None, type_name="unknown")


class _Signals:
    """SIGTERM / SIGINT raise Interrupted in the launching thread (main thread only), so cleanup runs."""

    def __init__(self) -> None:
        self.old: dict[int, Any] = {}
        self.cleaning = False

    def _handler(self, signum, frame) -> None:
        if not self.cleaning:
            raise Interrupted(signum)

    def __enter__(self) -> _Signals:
        if threading.current_thread() is threading.main_thread():
            for s in (signal.SIGTERM, signal.SIGINT):
                old = signal.getsignal(s)
                if old is signal.SIG_IGN:
                    continue  # e.g. a background job ignoring SIGINT: keep ignoring it
                self.old[s] = old
                signal.signal(s, self._handler)
        return self

    def __exit__(self, *exc) -> None:
        for s, old in self.old.items():
            signal.signal(s, old)


def _stop(procs: list) -> None:
    """SIGTERM every live worker, then SIGKILL the ones still there (a stopped process only dies of that)."""
    procs = [p for p in procs if p.pid is not None]  # started ones
    for p in procs:
        if p.exitcode is None:
            p.terminate()
    deadline = time.monotonic() + 1.0
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.exitcode is None:
            p.kill()
            p.join(5.0)


def _launch_local(fn: Callable, args: tuple, nprocs: int, timeout_s: float) -> list[Any]:
    from multiprocessing.connection import wait

    import torch.multiprocessing as mp

    threads = max(1, (os.cpu_count() or 1) // nprocs)
    procs: list = []
    with _Signals() as sig:
        workdir = None
        try:
            workdir = tempfile.mkdtemp(prefix="spanllm-launch-")
            spawn = mp.get_context("spawn")
            for r in range(nprocs):
                p = spawn.Process(
                    target=_spawned_main,
                    name=f"spanllm-rank{r}",
                    args=(r, fn, args, nprocs, workdir, timeout_s, threads, os.getpid()),
                )
                procs.append(p)  # before start: a signal during start() still finds it in _stop
                p.start()
            exits: dict[int, tuple[int, float]] = {}  # rank -> (exit code, when the parent saw it)
            first_failure = None
            while len(exits) < nprocs:
                if first_failure is not None and time.monotonic() - first_failure > FAILURE_GRACE_S:
                    break
                wait([p.sentinel for r, p in enumerate(procs) if r not in exits], timeout=0.2)
                for r, p in enumerate(procs):
                    if r not in exits and p.exitcode is not None:
                        exits[r] = (p.exitcode, time.time())
                        if p.exitcode != 0 and first_failure is None:
                            first_failure = time.monotonic()
            if first_failure is not None:
                running = {r: _process_state(p.pid) for r, p in enumerate(procs) if r not in exits}
                raise _first_error(workdir, nprocs, exits, running, timeout_s)
            results = []
            for r in range(nprocs):
                path = os.path.join(workdir, f"result{r}.pkl")
                if not os.path.exists(path):
                    raise RankError(f"rank {r} exited with code 0 but returned no result", rank=r, type_name="exit")
                with open(path, "rb") as f:
                    results.append(pickle.load(f))
            return results
        finally:
            sig.cleaning = True  # a second signal must not cut the cleanup short
            _stop(procs)
            if workdir is not None:
                shutil.rmtree(workdir, ignore_errors=True)


def launch(
    fn: Callable[..., Any], *args: Any, nprocs: int = 1, backend: str | None = None, timeout_s: float | None = None
) -> list[Any]:
    """Run `fn(ctx, *args)` on every rank; return the per-rank results (only this rank's under a launcher).

    Spawned ranks are CPU processes over gloo. If one of them raises, the others are stopped and
    `spanllm.errors.RankError` names the rank and carries its message and traceback: a failing rank
    never leaves the rest hanging. `timeout_s` defaults to SPANLLM_PG_TIMEOUT_S (else 300 s).
    """
    timeout_s = pg_timeout_s() if timeout_s is None else timeout_s
    if under_launcher():
        ctx = init_from_launcher(backend, timeout_s)
        return [fn(ctx, *args)]
    if not isinstance(nprocs, int) or nprocs < 1:
        raise UsageError(f"--nprocs {nprocs}: the number of local ranks must be >= 1")
    if nprocs == 1 and backend in (None, "nccl") and torch.cuda.is_available():
        return [fn(_init_single_gpu(timeout_s), *args)]
    if backend not in (None, "gloo"):
        raise UsageError(f"backend={backend!r}: local spawning uses gloo; start GPU jobs with torchrun")
    if torch.cuda.is_available():
        print(
            f"spanllm: {nprocs} local ranks run on CPU over gloo; for {nprocs} GPUs start the command with "
            f"torchrun --nproc-per-node {nprocs} -m spanllm.cli ...",
            file=sys.stderr,
        )
    return _launch_local(fn, args, nprocs, timeout_s)


_single_gpu = False  # this process runs the one rank of launch() on its GPU (no launcher)


def _init_single_gpu(timeout_s: float) -> DistContext:
    """A one-rank NCCL group in this process, on the current GPU (an in-memory store: no port, no file)."""
    global _single_gpu
    device = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group(
            "nccl",
            store=dist.HashStore(),
            rank=0,
            world_size=1,
            timeout=datetime.timedelta(seconds=timeout_s),
            device_id=device,
        )
    _single_gpu = True
    return DistContext(0, 1, device.index, 1, "nccl", device)


def finish(code: int) -> int:
    """End a command: under a launcher on GPUs, leave the process at once after a barrier.

    Processes that captured NCCL calls in CUDA graphs were seen hanging in interpreter teardown until
    an outer timeout killed them (minutes of a GPU lease); results are written before this is called.
    """
    if (under_launcher() or _single_gpu) and torch.cuda.is_available() and dist.is_initialized():
        sys.stdout.flush()
        sys.stderr.flush()
        dist.barrier()
        os._exit(code)
    return code
