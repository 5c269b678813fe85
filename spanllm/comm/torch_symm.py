"""torch symmetric-memory all-reduce ops as baselines: `one_shot_all_reduce` and `two_shot_all_reduce`.

Both need their input in symmetric memory and every rank P2P-reachable, so they are intra-node only
(one node in the topology). The caller's tensor is not symmetric: one-shot uses the `_copy_out`
variant, which copies the local input into the symmetric buffer inside the kernel; two-shot copies
in, then reduces in place with the result written straight to the caller's tensor (`_out`).
"""

from __future__ import annotations

import torch

from spanllm.comm.base import AllReduce, Capability
from spanllm.comm.topology import Topology

DEFAULT_MAX_BYTES = 8 << 20


def _single_node(t: Topology) -> str | None:
    if t.num_nodes != 1:
        return (
            f"torch symmetric-memory ops need every rank P2P-reachable (one node); topology {t} has "
            f"{t.num_nodes} nodes: use nvrar or nccl across nodes"
        )
    return None


class TorchSymmAllReduce(AllReduce):
    capability = Capability(
        dtypes=frozenset({torch.bfloat16, torch.float32}),
        device_types=frozenset({"cuda"}),
        size_multiple_bytes=4,
        topology_rule=_single_node,
    )

    def __init__(
        self, group=None, topology=None, *, max_bytes: int = DEFAULT_MAX_BYTES, device: torch.device | None = None
    ) -> None:
        super().__init__(group, topology)
        from spanllm.comm import symm

        self.device = device if device is not None else torch.device("cuda", torch.cuda.current_device())
        self._max_bytes = max_bytes
        self.buf, self.handle = symm.allocate(max_bytes, torch.uint8, self.device, self.group)
        self.group_name = self.group.group_name

    @property
    def max_bytes(self) -> int:
        return self._max_bytes

    def _symm_view(self, x: torch.Tensor) -> torch.Tensor:
        nbytes = x.numel() * x.element_size()
        return self.buf[:nbytes].view(x.dtype).view(x.shape)

    def close(self) -> None:
        self.buf = self.handle = None
        super().close()


class TorchOneShotAllReduce(TorchSymmAllReduce):
    name = "torch_one_shot"

    def _all_reduce_(self, x: torch.Tensor) -> None:
        torch.ops.symm_mem.one_shot_all_reduce_copy_out(self._symm_view(x), x, "sum", self.group_name, x)


def _single_node_of_2_4_8(t: Topology) -> str | None:
    if t.world_size not in (2, 4, 8):
        return f"torch's two_shot_all_reduce_out implements world sizes 2, 4 and 8, not {t.world_size}"
    return _single_node(t)


class TorchTwoShotAllReduce(TorchSymmAllReduce):
    name = "torch_two_shot"
    capability = Capability(
        dtypes=frozenset({torch.bfloat16, torch.float32}),
        device_types=frozenset({"cuda"}),
        size_multiple_bytes=4,
        topology_rule=_single_node_of_2_4_8,
    )

    def _all_reduce_(self, x: torch.Tensor) -> None:
        buf = self._symm_view(x)
        buf.copy_(x)
        torch.ops.symm_mem.two_shot_all_reduce_out(buf, "sum", self.group_name, x)
