"""Programmatic dependent launch (PDL) for the model forward's Triton kernels, on Hopper and later GPUs.

A small-batch decode step is a chain of ~300 short kernels (norms, GEMVs, RoPE, attention), and the GPU idles
between two of them: a kernel is launched only once the one before it has finished and flushed, and its programs
then take a microsecond or more to be scheduled and to start loading. With PDL (CUDA's programmatic stream
serialization, compute capability >= 9.0), a kernel launched with the attribute may start while the kernel before
it in the stream is still running. The protocol every kernel here follows (`wait_then_release`, first thing in the
kernel):
- `griddepcontrol.wait` (tl.extra.cuda.gdc_wait) returns only once the previous kernel has completed and its
  memory writes are visible. Nothing may touch global memory before it: the previous kernel may still be writing
  what this one reads, or reading what this one overwrites. (One exception: the skinny GEMM asks L2 for the first
  tiles of its weights before it waits, a hint on memory no kernel writes: spanllm.kernels.skinny_gemm.)
- `griddepcontrol.launch_dependents` then lets the next kernel's programs be scheduled as soon as every program of
  this one has passed that point and an SM has room: they park in their own wait.
So the launch latency and the programs' start overlap the previous kernel's tail, and memory effects keep the
order they have without PDL. The wait is transitive (a kernel past its wait knows its predecessor was past its
own, so every earlier kernel has completed). A kernel launched without the attribute (cuBLAS, torch's own, the
all-reduce) waits for the one before it to complete, as always, and so breaks the overlap there; a PDL kernel
after it waits in gdc_wait until it has completed (whether or not it released its dependents early). Captured in a
CUDA graph, the attribute becomes a programmatic edge (CUDA >= 12.3).

Scope: an engine resolves EngineConfig.pdl once (`resolve`), and its model's forward runs inside `launching(on)`
(spanllm.model.llama), eager or captured; launch sites ask `launch_options(device)`, which is off outside any
forward. So two engines in one process each launch as configured, and a kernel called on its own (tests,
benchmarks) launches without PDL unless its caller opens the scope.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU torch wheel comes without Triton
    triton = None

PDL_MODES = ("auto", "on", "off")  # EngineConfig.pdl
MIN_CAPABILITY = (9, 0)

_enabled = False


def supported(device: torch.device) -> bool:
    """Whether kernels on `device` can be launched with PDL: a CUDA GPU of compute capability >= 9.0, Triton."""
    return triton is not None and device.type == "cuda" and torch.cuda.get_device_capability(device) >= MIN_CAPABILITY


def resolve(mode: str, device: torch.device) -> bool:
    """EngineConfig.pdl on `device`: "auto" (on where supported), "on" (refused where not), "off". Returns whether
    the engine's forward launches its Triton kernels with PDL."""
    if mode not in PDL_MODES:
        raise ValueError(f"pdl={mode!r} must be one of {PDL_MODES}")
    ok = supported(device)
    if mode == "on" and not ok:
        what = (
            f"{torch.cuda.get_device_name(device)} (compute capability "
            f"{'.'.join(map(str, torch.cuda.get_device_capability(device)))})"
            if device.type == "cuda"
            else f"device {device}"
        )
        raise ValueError(
            f"pdl='on': programmatic dependent launch needs a CUDA GPU of compute capability >= 9.0 (Hopper) and "
            f"Triton; this rank runs on {what}{'' if triton is not None else ' without Triton'}. Use pdl='auto' "
            "(on where supported) or 'off'"
        )
    return ok and mode != "off"


@contextlib.contextmanager
def launching(on: bool) -> Iterator[None]:
    """The kernels launched inside use PDL iff `on` (the previous setting comes back after)."""
    global _enabled
    before, _enabled = _enabled, on
    try:
        yield
    finally:
        _enabled = before


def launch_options(device: torch.device) -> dict:
    """Extra keyword arguments of a Triton launch on `device`: the kernel's PDL constexpr and, when on, the
    launch attribute. Off (and on CPU tensors under the interpreter): PDL=False and nothing else."""
    if _enabled and device.type == "cuda":
        return {"PDL": True, "launch_pdl": True}
    return {"PDL": False}


if triton is not None:

    @triton.jit
    def wait_then_release(PDL: tl.constexpr):
        """The first statement of every kernel launched through launch_options (protocol: module docstring)."""
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
