"""Whether this package's Triton kernels run for a call: on CUDA tensors, or on CPU tensors when Triton was imported
with TRITON_INTERPRET=1 (its interpreter: the CPU tests); elsewhere their wrappers take the torch references."""

from __future__ import annotations

import functools

import torch

try:
    import triton
except ImportError:  # the CPU torch wheel comes without Triton
    triton = None


@functools.cache
def interpreting() -> bool:
    """True when Triton builds interpreted kernels (it decides once, at import, from TRITON_INTERPRET)."""
    if triton is None:
        return False
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_probe, InterpretedFunction)


def runs_kernels(x: torch.Tensor) -> bool:
    """Whether a kernel wrapper given x launches its Triton kernel (else: its torch reference)."""
    return triton is not None and (x.is_cuda or interpreting())


if triton is not None:

    @triton.jit
    def _probe():
        pass
