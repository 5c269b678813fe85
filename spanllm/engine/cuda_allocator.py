"""The CUDA caching allocator's settings for the engine commands (serve, bench throughput, generate).

spanllm turns on PyTorch's expandable segments unless PYTORCH_CUDA_ALLOC_CONF says otherwise: a long prompt's
prefill allocates K/V gathers and activations of sizes no earlier request had, and with fixed-size segments the
allocator first frees its cached blocks and maps new ones. On an H100 (results/h100/long_context/README.md, call H)
a server's first 111k-token request spent ~0.2 s more on the engine than a repeat with fixed segments, ~0.1 s with
expandable ones. PyTorch reads the variable when CUDA starts, so `apply_default` runs before any rank touches CUDA
(spawned ranks inherit it)."""

from __future__ import annotations

import os

ENV = "PYTORCH_CUDA_ALLOC_CONF"
DEFAULT = "expandable_segments:True"


def apply_default() -> None:
    """Set PYTORCH_CUDA_ALLOC_CONF to DEFAULT where the user has not set it (an empty value counts as unset)."""
    if not os.environ.get(ENV):
        os.environ[ENV] = DEFAULT


def describe() -> str:
    """The setting this process runs with, and whose it is."""
    value = os.environ.get(ENV)
    if not value:
        return "CUDA allocator: PyTorch's defaults"
    if value == DEFAULT:
        return f"CUDA allocator: {value} ({ENV}; spanllm's default)"
    return f"CUDA allocator: {value} ({ENV})"
