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
# Every name PyTorch reads its allocator settings from (PYTORCH_ALLOC_CONF is the newer, device-generic one; where
# several are set, PyTorch prefers the device's own): a user who set any of them keeps exactly that.
USER_ENVS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF")
DEFAULT = "expandable_segments:True"
APPLIED_ENV = "SPANLLM_CUDA_ALLOC_DEFAULT"  # "1" where apply_default set ENV (the ranks inherit it)


def _user_setting() -> tuple[str, str] | None:
    """(name, value) of the first allocator variable set (an empty value counts as unset), else None."""
    for name in USER_ENVS:
        if os.environ.get(name):
            return name, os.environ[name]
    return None


def apply_default() -> None:
    """Set PYTORCH_CUDA_ALLOC_CONF to DEFAULT where the user has set none of USER_ENVS."""
    if _user_setting() is None:
        os.environ[ENV] = DEFAULT
        os.environ[APPLIED_ENV] = "1"


def describe() -> str:
    """The setting this process runs with, and whose it is (spanllm's default is the value apply_default set)."""
    setting = _user_setting()
    if setting is None:
        return "CUDA allocator: PyTorch's defaults"
    name, value = setting
    if name == ENV and value == DEFAULT and os.environ.get(APPLIED_ENV) == "1":
        return f"CUDA allocator: {value} ({name}; spanllm's default)"
    return f"CUDA allocator: {value} ({name})"
