"""Symmetric-memory allocation shared by the GPU backends (nvrar, torch_one_shot, torch_two_shot).

torch picks the symmetric-memory backend once per process, at the first allocation, and the first
allocation is also where torch bootstraps NVSHMEM: a hidden collective. So every rank must allocate
its symmetric buffers in the same order, and the backend must be chosen before the first one.
spanllm uses NVSHMEM whenever torch has it (nvrar needs it; torch's one-shot / two-shot ops run on
NVSHMEM buffers too), so mixing backends in one benchmark run is safe.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def symm_mem():
    import torch.distributed._symmetric_memory as sm

    return sm


def ensure_nvshmem_backend(device: torch.device) -> None:
    """Select NVSHMEM before the first symmetric allocation; raise clearly if that is impossible."""
    sm = symm_mem()
    if not sm.is_nvshmem_available():
        raise RuntimeError(
            "NVSHMEM is not available to torch on this machine (torch.distributed._symmetric_memory."
            "is_nvshmem_available() is False): install the nvidia-nvshmem wheel that matches your torch build, "
            "or choose an algorithm that does not need it ('nccl')"
        )
    current = sm.get_backend(device)
    if current != "NVSHMEM":
        try:
            sm.set_backend("NVSHMEM")
        except Exception as e:  # torch refuses once something was allocated with another backend
            raise RuntimeError(
                f"cannot switch symmetric memory to NVSHMEM (current backend {current!r}): create spanllm's GPU "
                "communicators before anything else allocates symmetric memory in this process"
            ) from e


def allocate(numel: int, dtype: torch.dtype, device: torch.device, group: dist.ProcessGroup):
    """A zeroed symmetric tensor and its rendezvous handle. Collective over `group`."""
    sm = symm_mem()
    ensure_nvshmem_backend(device)
    try:
        t = sm.empty(numel, dtype=dtype, device=device)
    except (RuntimeError, torch.OutOfMemoryError) as e:
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        raise RuntimeError(
            f"symmetric allocation of {nbytes / 2**20:.1f} MiB failed ({e}). NVSHMEM's symmetric heap is "
            "NVSHMEM_SYMMETRIC_SIZE per GPU (default 1 GiB) and holds every communicator's buffers: raise it "
            "(e.g. NVSHMEM_SYMMETRIC_SIZE=8G) or create communicators with a smaller max_bytes"
        ) from e
    t.zero_()
    hdl = sm.rendezvous(t, group)
    torch.cuda.synchronize(device)
    dist.barrier(group=group)  # nobody writes into a peer's buffer before that peer zeroed it
    return t, hdl
