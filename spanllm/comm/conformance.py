"""Conformance cases every all-reduce backend must pass, shared by the CPU tests (gloo) and the GPU tests.

Each case runs on every rank of a job and returns a `CaseResult` with the number of wrong elements
(exact integer-valued inputs, so any error is a miscount, not a tolerance question). The same bodies
run against the CPU reference on gloo and against nvrar / NCCL / torch symmetric memory on GPUs.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist

from spanllm.comm.base import AllReduce
from spanllm.cuda_graph import capture_graph


@dataclass
class CaseResult:
    case: str
    algorithm: str
    wrong: int
    detail: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return asdict(self)


def pattern(n: int, rank: int, dtype: torch.dtype, device, salt: int = 0) -> torch.Tensor:
    """Small integers (i mod 13) + rank + 1 + salt: every partial sum is exact in bf16/fp16 up to 16 ranks."""
    i = torch.arange(n, device=device)
    return ((i % 13) + rank + 1 + salt).to(dtype)


def expected(n: int, world: int, dtype: torch.dtype, device, salt: int = 0) -> torch.Tensor:
    i = torch.arange(n, device=device)
    return (world * (i % 13) + world * (world + 1) // 2 + world * salt).to(dtype)


def wrong_elements(x: torch.Tensor, world: int, salt: int = 0) -> torch.Tensor:
    """How many elements of x differ from the exact sum of `pattern` over `world` ranks: an int64 scalar on
    x's device (no host sync, so back-to-back checks can accumulate it)."""
    return (x != expected(x.numel(), world, x.dtype, x.device, salt)).sum()


def check_exact(comm: AllReduce, x: torch.Tensor, graph: bool = False) -> int:
    """Wrong elements after one eager call on `pattern` input, and, with `graph` on a CUDA tensor, after one
    replay of a captured call with the input changed in place (what the benchmark and the tuner check before
    they time a backend). Collective: every rank of comm's group calls it."""
    x.copy_(pattern(x.numel(), comm.rank, x.dtype, x.device))
    comm.all_reduce_(x)
    wrong = int(wrong_elements(x, comm.world_size))
    if graph and x.is_cuda:
        g = capture_graph(lambda: comm.all_reduce_(x), x.device)
        x.copy_(pattern(x.numel(), comm.rank, x.dtype, x.device, salt=1))  # change the input in place, then replay
        g.replay()
        wrong += int(wrong_elements(x, comm.world_size, salt=1))
        del g
    return wrong


def _sync(x: torch.Tensor, comm: AllReduce | None = None) -> None:
    """Wait for the device. Through the communicator when it can (nvrar turns a trapped kernel into an
    error naming rank, phase and peer; a bare synchronize would only say "unspecified launch failure")."""
    if comm is not None and hasattr(comm, "synchronize"):
        comm.synchronize()
    elif x.is_cuda:
        torch.cuda.synchronize(x.device)


def _takes(comm: AllReduce, n: int, dtype: torch.dtype, device) -> bool:
    """Whether the backend's declared capability takes n elements of dtype (cases skip sizes it declines)."""
    return (
        comm.capability.unsupported_reason(
            nbytes=n * dtype.itemsize,
            dtype=dtype,
            topology=comm.topology,
            device_type=torch.device(device).type,
            max_bytes=comm.max_bytes,
        )
        is None
    )


def identical_across_ranks(x: torch.Tensor, group) -> bool:
    """Bitwise comparison of x on every rank (all-gather of the raw bytes)."""
    raw = x.contiguous().view(-1).view(torch.uint8) if x.element_size() > 1 else x.view(-1)
    raw = raw.to(torch.int32)
    world = dist.get_world_size(group)
    outs = [torch.empty_like(raw) for _ in range(world)]
    dist.all_gather(outs, raw, group=group)
    return all(torch.equal(outs[0], o) for o in outs[1:])


def case_lengths(comm: AllReduce, lengths: list[int], dtypes: list[torch.dtype], device) -> list[CaseResult]:
    out = []
    for dtype in dtypes:
        for n in lengths:
            if not _takes(comm, n, dtype, device):
                continue
            x = pattern(n, comm.rank, dtype, device)
            comm.all_reduce_(x)
            _sync(x, comm)
            wrong = int(wrong_elements(x, comm.world_size))
            out.append(CaseResult("length", comm.algorithm_for(x), wrong, {"n": n, "dtype": str(dtype)}))
    return out


def case_bitwise_identical(comm: AllReduce, n: int, dtype: torch.dtype, device, seed: int = 0) -> CaseResult | None:
    """Random (non-integer) inputs: the rounding may differ from other algorithms, but never between ranks.
    None when the backend does not take this size/dtype."""
    g = torch.Generator(device="cpu").manual_seed(seed + comm.rank)
    x = torch.randn(n, generator=g).to(dtype).to(device)
    if comm.unsupported_reason(x) is not None:
        return None
    comm.all_reduce_(x)
    same = identical_across_ranks(x, comm.group)
    return CaseResult("bitwise_identical", comm.algorithm_for(x), 0 if same else 1, {"n": n, "dtype": str(dtype)})


def case_back_to_back(comm: AllReduce, n: int, dtype: torch.dtype, calls: int, device) -> CaseResult | None:
    """`calls` consecutive calls with a different input each time, checked without host syncs in between.
    None when the backend does not take this size/dtype."""
    if not _takes(comm, n, dtype, device):
        return None
    x = torch.empty(n, dtype=dtype, device=device)
    wrong = torch.zeros((), dtype=torch.int64, device=device)
    for k in range(calls):
        x.copy_(pattern(n, comm.rank, dtype, device, salt=k % 7))
        comm.all_reduce_(x)
        wrong += wrong_elements(x, comm.world_size, salt=k % 7)
    _sync(x, comm)
    return CaseResult("back_to_back", comm.algorithm_for(x), int(wrong), {"n": n, "calls": calls, "dtype": str(dtype)})


def case_straggler(comm: AllReduce, n: int, dtype: torch.dtype, sleep_s: float, device) -> CaseResult | None:
    """The last rank sleeps before its call; everyone must still get the exact sum."""
    if not _takes(comm, n, dtype, device):
        return None
    x = pattern(n, comm.rank, dtype, device)
    _sync(x)
    dist.barrier(group=comm.group)
    if comm.rank == comm.world_size - 1:
        time.sleep(sleep_s)
    comm.all_reduce_(x)
    _sync(x, comm)
    wrong = int(wrong_elements(x, comm.world_size))
    return CaseResult("straggler", comm.algorithm_for(x), wrong, {"n": n, "sleep_s": sleep_s})


def case_cuda_graph(comm: AllReduce, n: int, dtype: torch.dtype, replays: int, device) -> CaseResult | None:
    """Capture one call, then replay it with the input changed in place before each replay.
    None when the backend does not take this size/dtype."""
    if not _takes(comm, n, dtype, device):
        return None
    x = pattern(n, comm.rank, dtype, device)
    comm.all_reduce_(x)  # warm up (compiles kernels outside the capture)
    torch.cuda.synchronize(device)
    graph = capture_graph(lambda: comm.all_reduce_(x), device)
    wrong = torch.zeros((), dtype=torch.int64, device=device)
    for k in range(replays):
        x.copy_(pattern(n, comm.rank, dtype, device, salt=k % 5))
        graph.replay()
        wrong += wrong_elements(x, comm.world_size, salt=k % 5)
    _sync(x, comm)
    del graph
    return CaseResult("cuda_graph", comm.algorithm_for(x), int(wrong), {"n": n, "replays": replays})


def case_bad_inputs(comm: AllReduce, device) -> list[CaseResult]:
    """Non-contiguous and unsupported-dtype tensors must raise, naming the problem (wrong=1 if not)."""
    out = []
    nc = torch.zeros(8, 8, device=device, dtype=torch.float32)[:, ::2]
    try:
        comm.all_reduce_(nc)
        out.append(CaseResult("non_contiguous", comm.name, 1, {"error": None}))
    except ValueError as e:
        out.append(CaseResult("non_contiguous", comm.name, 0 if "contiguous" in str(e) else 1, {"error": str(e)}))
    bad = torch.zeros(8, device=device, dtype=torch.complex64)
    try:
        comm.all_reduce_(bad)
        out.append(CaseResult("bad_dtype", comm.name, 1, {"error": None}))
    except ValueError as e:
        out.append(CaseResult("bad_dtype", comm.name, 0 if "dtype" in str(e) else 1, {"error": str(e)}))
    return out
