"""Algorithm name -> implementation. The CLI, the benchmark, `auto` and the engine all use this table.

Entries are import paths so that heavy imports (triton, NVSHMEM) happen only when a GPU backend is
created: `import spanllm.comm` works on any machine.
"""

from __future__ import annotations

import importlib
import inspect

import torch.distributed as dist

from spanllm.comm.base import AllReduce
from spanllm.comm.topology import Topology

ALGORITHMS: dict[str, str] = {
    # CPU reference executor running the schedules of spanllm.comm.schedule (gloo or NCCL point-to-point).
    "ref_ring": "spanllm.comm.reference:RefRingAllReduce",
    "ref_rd": "spanllm.comm.reference:RefRecursiveDoublingAllReduce",
    "ref_hier": "spanllm.comm.reference:RefHierarchicalAllReduce",
    # torch.distributed.all_reduce: the process group's own collective library.
    "gloo": "spanllm.comm.torch_dist:GlooAllReduce",
    "nccl": "spanllm.comm.torch_dist:NcclAllReduce",
    # torch symmetric memory (intra-node only).
    "torch_one_shot": "spanllm.comm.torch_symm:TorchOneShotAllReduce",
    "torch_two_shot": "spanllm.comm.torch_symm:TorchTwoShotAllReduce",
    # NVRAR: hierarchical all-reduce with Triton + NVSHMEM (GPU).
    "nvrar": "spanllm.comm.nvrar.allreduce:NvrarAllReduce",
    # Size-based selection over the others, from a tuning table.
    "auto": "spanllm.comm.auto:AutoAllReduce",
}


def algorithm_class(name: str) -> type[AllReduce]:
    if name not in ALGORITHMS:
        raise KeyError(f"unknown all-reduce algorithm {name!r}; registered: {', '.join(ALGORITHMS)}")
    module, cls = ALGORITHMS[name].split(":")
    return getattr(importlib.import_module(module), cls)


def algorithms_for_device(device_type: str) -> list[str]:
    """Registered names whose backend runs on this device type (auto included)."""
    out = []
    for name in ALGORITHMS:
        caps = algorithm_class(name).capability
        if device_type in caps.device_types:
            out.append(name)
    return out


def create(name: str, group: dist.ProcessGroup | None = None, topology: Topology | None = None, **options) -> AllReduce:
    """Build the named backend for a process group. Collective: call in the same order on every rank.

    `options` is one pool for all backends (max_bytes, timeout_s, tuning, device, ...): each backend
    receives the keyword arguments its constructor declares, so one call site can build any of them.
    """
    cls = algorithm_class(name)
    accepted = inspect.signature(cls.__init__).parameters
    takes_all = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values())
    mine = {k: v for k, v in options.items() if takes_all or k in accepted}
    return cls(group=group, topology=topology, **mine)
