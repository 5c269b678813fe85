"""What every result file carries: machine, versions, settings; and the bandwidth definitions (once)."""

from __future__ import annotations

import copy
import functools
import os
import platform
import socket
import subprocess
from typing import Any

import torch


def algbw_GBps(nbytes: int, time_us: float) -> float:
    """Algorithm bandwidth: message bytes over time (nccl-tests' algbw)."""
    return nbytes / (time_us * 1e-6) / 1e9 if time_us > 0 else 0.0


def allreduce_busbw_GBps(nbytes: int, time_us: float, world_size: int) -> float:
    """Bus bandwidth of an all-reduce: algbw x 2(n-1)/n, comparable with the link speed (nccl-tests)."""
    return algbw_GBps(nbytes, time_us) * (2 * (world_size - 1) / world_size if world_size > 1 else 0.0)


def machine_info() -> dict[str, Any]:
    """Host, CPU and GPUs (driver and topology from nvidia-smi: measured once per process)."""
    return copy.deepcopy(_machine_info())


@functools.cache
def _machine_info() -> dict[str, Any]:
    info: dict[str, Any] = {
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "processor": platform.processor() or platform.machine(),
    }
    if torch.cuda.is_available():
        info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        try:
            out = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=10,
            )
            info["driver"] = out.stdout.strip().splitlines()[0] if out.returncode == 0 else None
        except (OSError, subprocess.TimeoutExpired, IndexError):
            info["driver"] = None
        try:
            out = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=10)
            info["gpu_topology"] = out.stdout.strip() if out.returncode == 0 else None
        except (OSError, subprocess.TimeoutExpired):
            info["gpu_topology"] = None
    else:
        info["gpus"] = []
    return info


def versions() -> dict[str, Any]:
    from spanllm import __version__

    v: dict[str, Any] = {
        "spanllm": __version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
    }
    try:
        v["nccl"] = ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else None
    except Exception:  # torch built without NCCL
        v["nccl"] = None
    try:
        import triton

        v["triton"] = triton.__version__
    except ImportError:
        v["triton"] = None
    try:
        from importlib.metadata import version

        v["nvshmem"] = version("nvidia-nvshmem-cu13")
    except Exception:
        try:
            from importlib.metadata import version

            v["nvshmem"] = version("nvidia-nvshmem-cu12")
        except Exception:
            v["nvshmem"] = None
    v["env"] = {
        k: os.environ[k]
        for k in (
            "NCCL_NVLS_ENABLE",
            "TORCH_SYMM_MEM_DISABLE_MULTICAST",
            "NVSHMEM_DISABLE_NVLS",
            "NCCL_ALGO",
            "NCCL_PROTO",
            "CUDA_DEVICE_MAX_CONNECTIONS",
        )
        if k in os.environ
    }
    return v
