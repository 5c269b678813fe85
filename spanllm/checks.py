"""Argument checks the commands run in `run(args)`, before any rank starts.

Each check raises `spanllm.errors.UsageError` naming the option, the value, the limit and the fix, so a
mistake costs one line and no spawned rank. They look at plain values only: the registry's capability
tables (no GPU code is imported), a checkpoint's config.json and safetensors headers (no weights are read).
"""

from __future__ import annotations

import importlib.util
import os

from spanllm.errors import UsageError

# The longest collective timeout a run may set (--pg-timeout, SPANLLM_PG_TIMEOUT_S; spanllm.launch): finite, since inf
# (or a value past what the process group's timedelta holds) never fails. Here, so the CLI checks it without torch.
MAX_COLLECTIVE_TIMEOUT_S = 7 * 86400.0

ALLOW_LONG_CONTEXT_ENV = "SPANLLM_ALLOW_LONG_MAX_MODEL_LEN"  # vLLM's VLLM_ALLOW_LONG_MAX_MODEL_LEN

# Sampling temperature's range (SamplingParams checks it too; the HTTP API takes OpenAI's [0, 2]): 0 = greedy
MAX_TEMPERATURE = 100.0


def at_least(flag: str, value: int | float | None, minimum: int | float, what: str = "") -> None:
    if value is not None and value < minimum:
        raise UsageError(f"{flag} {value}: must be >= {minimum}{what}")


def not_empty(flag: str, value: str | None, fix: str) -> None:
    """A string option given but empty (or blank), which would otherwise fall back to a default or name nothing."""
    if value is not None and not value.strip():
        raise UsageError(f"{flag} {value!r}: empty; {fix}")


def temperature(value: float) -> None:
    """--temperature in [0, MAX_TEMPERATURE] (nan fails too)."""
    if not 0.0 <= value <= MAX_TEMPERATURE:
        raise UsageError(f"--temperature {value:g}: must be in [0, {MAX_TEMPERATURE:g}] (0 = greedy)")


def world_size(nprocs: int) -> int:
    """The ranks the command will run on: the launcher's WORLD_SIZE, else --nprocs local gloo ranks."""
    from spanllm.launch import launcher_world_size

    world = launcher_world_size()
    if world is not None:
        return world
    at_least("--nprocs", nprocs, 1, " (local gloo ranks)")
    limit = max_local_ranks()
    if nprocs > limit:
        raise UsageError(
            f"--nprocs {nprocs}: more local ranks than this machine runs usefully (at most {limit}: 4 per CPU core, "
            f"at least 8; each is a process with its own torch); give fewer, or launch on more machines with torchrun"
        )
    return nprocs


def max_local_ranks() -> int:
    """The most local gloo ranks --nprocs may start: 4 per CPU core, and never fewer than 8 (the 2 x 4 topologies)."""
    return max(8, 4 * (os.cpu_count() or 1))


def device_type(nprocs: int | None = None) -> str:
    """Where the ranks compute: CUDA under a launcher on a GPU machine, and for the one rank of `nprocs` 1 that
    launch() runs in this process on its GPU; local spawned ranks are CPU + gloo."""
    import torch

    from spanllm.launch import under_launcher

    on_gpu = under_launcher() or nprocs == 1
    return "cuda" if on_gpu and torch.cuda.is_available() else "cpu"


def topology(world: int, ranks_per_node: int | None):
    from spanllm.comm.topology import Topology, TopologyError

    try:
        return Topology.from_env(world, ranks_per_node)
    except TopologyError as e:
        raise UsageError(f"--ranks-per-node {ranks_per_node}: {e}") from None


def engine_dtype(name: str) -> None:
    from spanllm.dtypes import MODEL_DTYPES as DTYPES

    if name != "auto" and name not in DTYPES:
        raise UsageError(f"--dtype {name!r} is not supported; choose one of auto, {', '.join(DTYPES)}")


def _triton_missing() -> bool:
    return importlib.util.find_spec("triton") is None


def allreduce_names(names, device: str, flag: str = "--allreduce", world: int | None = None) -> None:
    """Registered names whose backend runs on `device` (and finds Triton, for nvrar); given the run's world size,
    not for a single rank, where no all-reduce runs (the name would be accepted and never used)."""
    from spanllm.comm import registry

    if world == 1 and names:
        raise UsageError(
            f"{flag} {','.join(names)}: this run has one rank, where no all-reduce runs; give --nprocs N (N > 1: "
            f"tensor parallel over N ranks) or drop {flag}"
        )
    for name in names:
        if name not in registry.ALGORITHMS:
            raise UsageError(
                f"{flag} {name!r}: no such all-reduce algorithm; registered: {', '.join(registry.ALGORITHMS)}"
            )
        runs_on = registry.algorithm_class(name).capability.device_types
        if device not in runs_on:
            import torch

            here = (
                "these ranks run on CUDA GPUs"
                if device == "cuda"
                else "local ranks run on CPU over gloo (start GPU jobs with torchrun)"
                if torch.cuda.is_available()
                else "this machine has no GPU"
            )
            raise UsageError(
                f"{flag} {name}: runs on {'/'.join(sorted(runs_on))} only, and {here}; choose one of "
                f"{', '.join(registry.algorithms_for_device(device))}"
            )
        if name == "nvrar" and _triton_missing():
            raise UsageError(
                f"{flag} nvrar: its kernel is Triton, and Triton is not installed here; "
                "`pip install triton`, or choose nccl"
            )


def no_triton_gpu(device: str) -> str | None:
    """What the ranks lack for a Triton kernel on a GPU ("no GPU", "no Triton"), or None."""
    return "no GPU" if device != "cuda" else "no Triton" if _triton_missing() else None


def decode_gemm(name: str, device: str) -> None:
    if name != "skinny":
        return
    if have := no_triton_gpu(device):
        raise UsageError(
            f"--decode-gemm skinny: a Triton kernel for CUDA GPUs, and these ranks have {have}; use --decode-gemm torch"
        )


def pdl(mode: str, device: str) -> None:
    """--pdl on needs a GPU of compute capability >= 9.0 and Triton (spanllm.kernels.pdl); checked for device 0."""
    if mode != "on":
        return
    import torch

    from spanllm.kernels.pdl import MIN_CAPABILITY

    if have := no_triton_gpu(device):
        raise UsageError(
            f"--pdl on: programmatic dependent launch of Triton kernels on a GPU, and these ranks have "
            f"{have}; use --pdl auto (on where supported) or off"
        )
    cap = torch.cuda.get_device_capability(0)
    if cap < MIN_CAPABILITY:
        raise UsageError(
            f"--pdl on: programmatic dependent launch needs compute capability >= 9.0 (Hopper); "
            f"{torch.cuda.get_device_name(0)} has {cap[0]}.{cap[1]}. Use --pdl auto or off"
        )


def model(spec: str):
    """The ModelConfig of a preset or checkpoint folder, the checkpoint's files checked (headers only)."""
    from spanllm.model.config import ModelConfigError, resolve_model

    try:
        cfg = resolve_model(spec)
    except (ModelConfigError, OSError) as e:
        raise UsageError(f"--model: {e}") from e
    if cfg.checkpoint_dir is not None:
        from spanllm.model.loader import check_checkpoint

        check_checkpoint(cfg)
    return cfg


def layout(tp: int | None, pp: int, world: int, cfg, topo):
    """ParallelDims of --tp / --pp on `world` ranks, checked against the model and the node layout."""
    from spanllm.model.parallel_dims import ParallelDims, ParallelLayoutError

    at_least("--tp", tp, 1, " (tensor-parallel degree; leave it out for world size / --pp)")
    at_least("--pp", pp, 1, " (pipeline stages)")
    if world % pp:
        raise UsageError(f"--pp {pp} does not divide the {world} ranks; choose a pipeline degree that divides {world}")
    try:
        dims = ParallelDims(tp or world // pp, pp, world)
        dims.validate_for(cfg)
        dims.validate_for_topology(topo)
    except ParallelLayoutError as e:
        raise UsageError(f"--tp/--pp: {e}") from None
    return dims


def context_limit(cfg, max_model_len: int | None) -> int:
    """Tokens one sequence may hold: the model's max_position_embeddings, or --max-model-len below it (above
    it only with SPANLLM_ALLOW_LONG_MAX_MODEL_LEN=1: positions past the trained context give poor output)."""
    trained = cfg.max_position_embeddings
    if max_model_len is None:
        return trained
    at_least("--max-model-len", max_model_len, 2)
    if max_model_len > trained and os.environ.get(ALLOW_LONG_CONTEXT_ENV, "") in ("", "0"):
        raise UsageError(
            f"--max-model-len {max_model_len} exceeds the {trained} positions {cfg.label} was trained for "
            f"(max_position_embeddings); set {ALLOW_LONG_CONTEXT_ENV}=1 to allow it anyway"
        )
    return max_model_len


def sequence_fits(prompt_len: int, new_tokens: int, cfg, max_model_len: int | None, what: str) -> None:
    limit = context_limit(cfg, max_model_len)
    if prompt_len + new_tokens > limit:
        src = "--max-model-len" if max_model_len is not None else f"max_position_embeddings of {cfg.label}"
        raise UsageError(
            f"{what}: {prompt_len} + {new_tokens} = {prompt_len + new_tokens} tokens exceed the context "
            f"of {limit} ({src}); shorten them, or raise the limit with --max-model-len N "
            f"(past {cfg.max_position_embeddings} also {ALLOW_LONG_CONTEXT_ENV}=1)"
        )


def prompts(prompt_ids: list[list[int]], names: list[str], new_tokens: int, cfg, max_model_len: int | None) -> None:
    """Each prompt through the engine's own admission checks (spanllm.engine.engine_core.validate_request: the one
    validation the offline API and the server run too), before any rank starts; the error names the flag."""
    from spanllm.engine.engine_core import RequestError, validate_request
    from spanllm.engine.sampler import SamplingParams

    limit = context_limit(cfg, max_model_len)
    params = SamplingParams(max_tokens=new_tokens)
    for ids, name in zip(prompt_ids, names):
        try:
            validate_request(ids, params, vocab_size=cfg.vocab_size, max_model_len=limit, capacity_tokens=limit)
        except RequestError as e:
            where = ""
            if len(ids) + new_tokens > limit:
                src = "--max-model-len" if max_model_len is not None else f"max_position_embeddings of {cfg.label}"
                where = f" (the limit: {src})"
            raise UsageError(f"{name}: {e}{where}") from None


def tuning(path: str | None) -> None:
    if not path:
        return
    from spanllm.comm.tuning import TuningTable

    try:
        TuningTable.load(path)
    except ValueError as e:
        raise UsageError(f"--tuning: {e}") from None


def available_host_bytes() -> int | None:
    """MemAvailable (Linux), else None (no check)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _gib(n: float) -> str:
    return f"{n / (1 << 30):.1f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.1f} MiB"


def host_memory(bytes_per_rank: int, ranks_here: int, what: str, fix: str) -> None:
    """Refuse a CPU run whose buffers cannot fit in this host's free memory (instead of failing minutes in)."""
    avail = available_host_bytes()
    need = bytes_per_rank * ranks_here
    if avail is not None and need > avail:
        raise UsageError(
            f"{what} needs about {_gib(need)} of host memory ({ranks_here} ranks x "
            f"{_gib(bytes_per_rank)}) but {_gib(avail)} is available; {fix}"
        )


def port_free(host: str, port: int, flag: str = "--port") -> None:
    """`--host H --port P` can be bound now, as uvicorn will bind it (SO_REUSEADDR, every address H resolves
    to): checked before the engine is built, so a port in use costs one line, not a build and a traceback.
    `flag` names the port's option in the message (--port, --health-port)."""
    import errno
    import socket

    try:  # port 0 (any free port) binds too: the host is checked all the same
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise UsageError(
            f"--host {host!r}: cannot resolve it ({e.strerror}); give an address, e.g. 127.0.0.1"
        ) from None
    for family, kind, proto, _, addr in infos:
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                s.bind(addr)
            except OSError as e:
                where = f"{addr[0]}:{port}" if family == socket.AF_INET else f"[{addr[0]}]:{port}"
                if e.errno == errno.EADDRINUSE:
                    raise UsageError(
                        f"{flag} {port}: {where} is already in use (another server?); stop that process, or "
                        f"choose another port ({flag} 0 picks a free one)"
                    ) from None
                if e.errno == errno.EACCES:
                    raise UsageError(
                        f"{flag} {port}: binding {where} is not permitted (ports below 1024 need privileges); "
                        "choose a port from 1024 up"
                    ) from None
                if e.errno == errno.EADDRNOTAVAIL:
                    raise UsageError(
                        f"--host {host}: {addr[0]} is not an address of this machine; use 127.0.0.1, 0.0.0.0 "
                        "(every interface) or one of its own addresses"
                    ) from None
                raise UsageError(f"--host {host} {flag} {port}: cannot bind {where}: {e.strerror}") from None


def output_file(flag: str, path: str | None) -> None:
    """`flag PATH` names a file the command will write at its end: checked before the work, so that a typo costs
    one line, not a finished run. PATH must not be empty or a folder; its folder is created if missing (as
    `mkdir -p`: the folders above it must be folders) and must be writable. A file already there is overwritten."""
    if path is None:
        return
    if not path or not path.strip():
        raise UsageError(f"{flag} {path!r}: empty; give a file name, e.g. {flag} out.json")
    if os.path.isdir(path):
        raise UsageError(
            f"{flag} {path}: is a folder; give a file name inside it, e.g. {flag} {os.path.join(path, 'out.json')}"
        )
    folder = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as e:
        raise UsageError(
            f"{flag} {path}: cannot create its folder {folder} ({e.strerror}); choose another path"
        ) from None
    # opened, not asked (os.access says yes to root everywhere and knows nothing of /proc), and left as it was
    existed = os.path.exists(path)
    try:
        with open(path, "a"):
            pass
    except OSError as e:
        raise UsageError(f"{flag} {path}: not writable here ({e.strerror}); choose a path you can write") from None
    if not existed:
        os.remove(path)


def png_file(flag: str, path) -> None:
    """`flag PATH` names a PNG the command draws at its end: a writable file ending in .png (matplotlib takes
    the format from the suffix, and adds .png to a name without one), checked before the work."""
    if path is None:
        return
    output_file(flag, str(path))
    if not str(path).lower().endswith(".png"):
        stem = os.path.splitext(str(path))[0]
        raise UsageError(f"{flag} {path}: the plot is a PNG; give a file name ending in .png, e.g. {flag} {stem}.png")


def batched_tokens_cover_seqs(max_num_batched_tokens: int, max_num_seqs: int) -> None:
    """The scheduler's rule: a step of max_num_seqs decodes (one token each) must fit the step's token budget."""
    if max_num_batched_tokens < max_num_seqs:
        raise UsageError(
            f"--max-num-batched-tokens {max_num_batched_tokens} is below --max-num-seqs "
            f"{max_num_seqs}: a step of decodes alone would not fit; raise it or lower --max-num-seqs"
        )


def no_result_in_dry_run(dry_run: bool, json_path: str | None, runs: str, instead: str) -> None:
    """`--dry-run --json`: a dry run `runs` nothing, so it has no result to write; `instead` says what it can save."""
    if dry_run and json_path:
        raise UsageError(
            f"--json {json_path}: --dry-run {runs}, so there is no result to write; drop --json ({instead})"
        )
