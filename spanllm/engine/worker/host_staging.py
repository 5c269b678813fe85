"""HostStaging: a step's host -> device copies without the host waiting for the GPU.

A copy from pageable (ordinary) host memory is synchronous for the host: the driver stages it through
its own pinned buffer, and in practice the call returns only once the copy ran, i.e. after everything
queued before it on the stream. With async scheduling (spanllm.engine.engine_core) the host plans step
t+1 while step t runs, so one such copy would make it wait for step t and undo the overlap. Here every
array of a step is first written into a pinned buffer, then copied with `non_blocking=True`: the call
returns at once and the copy runs in stream order.

Two pinned buffers alternate, one per step: step t writes buffer t % 2 while the GPU may still be reading
buffer (t - 1) % 2. Before a buffer is written again (two steps later), the host waits on an event
recorded after the last copy that read it (in practice long complete: that step has run). An array that
does not fit in what is left of the step's buffer is copied from pageable memory instead (correct, only
slower; `overflows` counts them). On CPU every "copy" is the numpy array itself.
"""

from __future__ import annotations

import numpy as np
import torch

_ALIGN = 64

_TORCH_DTYPE = {
    np.dtype(np.int64): torch.int64,
    np.dtype(np.int32): torch.int32,
    np.dtype(np.float32): torch.float32,
    np.dtype(np.float64): torch.float64,
}


class HostStaging:
    def __init__(self, device: torch.device, capacity_bytes: int) -> None:
        self.device = device
        self.pinned = device.type == "cuda"
        self.capacity = capacity_bytes
        self.overflows = 0
        self._turn = 0
        self._offset = 0
        if self.pinned:
            self._buffers = [torch.empty(capacity_bytes, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
            self._events: list = [None, None]

    def begin_step(self) -> None:
        """Switch to the other buffer (the step before used this one's twin)."""
        if not self.pinned:
            return
        done = torch.cuda.Event()
        done.record()  # after every copy queued so far: all of the previous step's, out of the current buffer
        self._events[self._turn] = done
        self._turn ^= 1
        if self._events[self._turn] is not None:
            self._events[self._turn].synchronize()  # the copies that read this buffer two steps ago have run
        self._offset = 0

    def tensor(self, arr) -> torch.Tensor:
        """A tensor on the device holding `arr` (a numpy array or a list of numbers)."""
        arr = np.ascontiguousarray(arr)
        if not self.pinned:
            return torch.from_numpy(arr)
        staged = self._stage(arr)
        if staged is None:
            return torch.from_numpy(arr).to(self.device)
        return staged.to(self.device, non_blocking=True)

    def copy_(self, dst: torch.Tensor, arr) -> None:
        """dst.copy_(arr), in stream order, without waiting."""
        arr = np.ascontiguousarray(arr)
        if not self.pinned:
            dst.copy_(torch.from_numpy(arr))
            return
        staged = self._stage(arr)
        if staged is None:
            dst.copy_(torch.from_numpy(arr))
        else:
            dst.copy_(staged, non_blocking=True)

    def _stage(self, arr: np.ndarray) -> torch.Tensor | None:
        dtype = _TORCH_DTYPE.get(arr.dtype)
        start = -(-self._offset // _ALIGN) * _ALIGN
        if dtype is None or start + arr.nbytes > self.capacity:
            self.overflows += 1
            return None
        self._offset = start + arr.nbytes
        view = self._buffers[self._turn][start : start + arr.nbytes].view(dtype).view(arr.shape)
        view.numpy()[...] = arr
        return view
