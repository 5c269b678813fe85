"""`torch.distributed.all_reduce`: the process group's own collective library, registered by its name.

`nccl` is NCCL on GPU process groups, `gloo` is gloo on CPU ones. Under a CUDA graph, NCCL's
all-reduce is captured like any kernel on the current stream.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from spanllm.comm.base import AllReduce, AllReduceInputError, Capability


class TorchDistAllReduce(AllReduce):
    backend: str

    def __init__(self, group=None, topology=None) -> None:
        super().__init__(group, topology)
        actual = dist.get_backend(self.group)
        if self.backend not in actual.split(":")[-1] and self.backend not in actual:
            raise AllReduceInputError(
                f"{self.name}: the process group's backend is {actual!r}, not {self.backend!r}; "
                f"use the algorithm named after the group's backend")

    def _all_reduce_(self, x: torch.Tensor) -> None:
        dist.all_reduce(x, op=dist.ReduceOp.SUM, group=self.group)


class GlooAllReduce(TorchDistAllReduce):
    name = "gloo"
    backend = "gloo"
    capability = Capability(
        dtypes=frozenset({torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64}),
        device_types=frozenset({"cpu"}))


class NcclAllReduce(TorchDistAllReduce):
    name = "nccl"
    backend = "nccl"
    capability = Capability(
        dtypes=frozenset({torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64}),
        device_types=frozenset({"cuda"}))
