"""`torch.distributed.all_reduce`: the process group's own collective library, registered by its name.

`nccl` is NCCL on GPU process groups, `gloo` is gloo on CPU ones. Under a CUDA graph, NCCL's
all-reduce is captured like any kernel on the current stream.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from spanllm.comm.base import AllReduce, AllReduceInputError, Capability, collective_failure

GROUP_COLLECTIVE = {"cuda": "nccl", "cpu": "gloo"}
"""Device type -> the process group's own collective: torch.distributed's backend name, which is also the
name of our algorithm that calls it."""


def default_backend(device_type: str) -> str:
    """'nccl' on 'cuda', 'gloo' on 'cpu': the backend a process group on this device type is created with,
    and the all-reduce that takes any message (the fallback of the buffered backends, spanllm.comm.fallback)."""
    try:
        return GROUP_COLLECTIVE[device_type]
    except KeyError:
        raise ValueError(
            f"device type {device_type!r} has no default backend; choose one of {', '.join(GROUP_COLLECTIVE)}"
        ) from None


def device_type_of(group: dist.ProcessGroup | None = None) -> str:
    """'cuda' for a process group on NCCL, else 'cpu': the group's backend decides, not whether this
    machine has GPUs."""
    backend = str(dist.get_backend(group if group is not None else dist.group.WORLD))
    return "cuda" if GROUP_COLLECTIVE["cuda"] in backend else "cpu"


class TorchDistAllReduce(AllReduce):
    """`check_sizes` (default: on for gloo, off for NCCL's hot path) first verifies that every rank passed
    the same element count and dtype: gloo aborts the process on a mismatch; NCCL's watchdog would
    time out after minutes."""

    backend: str
    check_sizes_default: bool

    def __init__(self, group=None, topology=None, *, check_sizes: bool | None = None) -> None:
        super().__init__(group, topology)
        self.check_sizes = self.check_sizes_default if check_sizes is None else check_sizes
        actual = dist.get_backend(self.group)
        if self.backend not in actual.split(":")[-1] and self.backend not in actual:
            raise AllReduceInputError(
                f"{self.name}: the process group's backend is {actual!r}, not {self.backend!r}; "
                f"use the algorithm named after the group's backend"
            )

    def _all_reduce_(self, x: torch.Tensor) -> None:
        try:
            dist.all_reduce(x, op=dist.ReduceOp.SUM, group=self.group)
        except RuntimeError as e:  # a peer timed out or went away (gloo raises here; NCCL reports later)
            where = f"{self.name}: rank {self.rank} failed in {self.backend}'s all_reduce of {x.numel()} elements"
            raise collective_failure(e, where) from e


_DTYPES = frozenset({torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64})


class GlooAllReduce(TorchDistAllReduce):
    name = "gloo"
    backend = "gloo"
    check_sizes_default = True
    capability = Capability(dtypes=_DTYPES, device_types=frozenset({"cpu"}))


class NcclAllReduce(TorchDistAllReduce):
    name = "nccl"
    backend = "nccl"
    check_sizes_default = False
    capability = Capability(dtypes=_DTYPES, device_types=frozenset({"cuda"}))
