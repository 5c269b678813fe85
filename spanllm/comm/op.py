"""`torch.ops.spanllm.all_reduce_`: the in-place all-reduce as a torch custom op.

torch.compile and CUDA graphs see one opaque, in-place op (with a fake implementation for tracing)
instead of tracing into a backend's Python. The communicator is named by a string handle because
custom ops take plain values: `handle = register(comm)` once, then `all_reduce_(x, handle)`
anywhere, also inside compiled or captured code. `unregister(handle)` when the communicator closes.

    handle = op.register(comm)
    torch.ops.spanllm.all_reduce_(x, handle)    # same as comm.all_reduce_(x)
"""

from __future__ import annotations

import torch

from spanllm.comm.base import AllReduce

# handle -> live communicator. Several communicators (groups, algorithms) can be registered at once.
_LIVE: dict[str, AllReduce] = {}


def register(comm: AllReduce) -> str:
    name = comm.name if isinstance(getattr(comm, "name", None), str) else type(comm).__name__
    handle = f"{name}@{id(comm):x}"
    _LIVE[handle] = comm
    return handle


def unregister(handle: str) -> None:
    _LIVE.pop(handle, None)


def communicator(handle: str) -> AllReduce:
    try:
        return _LIVE[handle]
    except KeyError:
        raise KeyError(
            f"no live communicator registered as {handle!r} (registered: {sorted(_LIVE)}); "
            "call spanllm.comm.op.register(comm) first, and keep it registered while code uses it"
        ) from None


@torch.library.custom_op("spanllm::all_reduce_", mutates_args=("x",))
def all_reduce_(x: torch.Tensor, handle: str) -> None:
    """Sum x in place over the communicator's group."""
    communicator(handle).all_reduce_(x)


@all_reduce_.register_fake
def _all_reduce_fake(x: torch.Tensor, handle: str) -> None:
    return None
