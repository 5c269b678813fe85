"""TPContext: what a tensor-parallel layer needs (its rank in the TP group, the group, the communicator, the
device and dtype, the decode-GEMM choice), and the communicator protocol the row-parallel layer calls.

Parameters are created with `torch.empty` on the target device (never initialized on the CPU and
copied); the loader fills them from a checkpoint or with seeded random values.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from spanllm.kernels.skinny_gemm import MAX_M as SKINNY_MAX_M
from spanllm.kernels.skinny_gemm import prefer_skinny


def skinny_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The custom op (registered by spanllm.kernels.skinny_gemm where Triton exists). LLM checks once, before
    building the model, that GPU and Triton are there (no check here: this runs on every decode GEMM)."""
    return torch.ops.spanllm.skinny_linear(x, weight)


class Communicator(Protocol):
    """What the engine needs from an all-reduce backend (`spanllm.comm.AllReduce` or a stand-in)."""

    def all_reduce_(self, x: torch.Tensor) -> torch.Tensor: ...


@dataclass
class TPContext:
    """What a parallel layer needs: its place in the TP group, the group, the communicator."""

    rank: int = 0
    size: int = 1
    group: dist.ProcessGroup | None = None
    # The row-parallel layers' all-reduce. For a buffered backend (nvrar) LLM passes
    # spanllm.comm.fallback.SizeFallback(backend, the group's collective): messages above the buffer (prefill
    # activations) go to nccl / gloo. Which one ran is reported by LLM.allreduce_ran*.
    comm: Communicator | None = None
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    dtype: torch.dtype = torch.float32
    # EngineConfig.decode_gemm, for weight GEMMs of <= skinny_gemm.MAX_M rows: "skinny" sends every one to
    # torch.ops.spanllm.skinny_linear (LLM checks GPU and Triton first), "auto" only those whose shape the
    # measured table says the skinny kernel runs faster (skinny_gemm.prefer_skinny; CUDA tensors only);
    # "torch" (and more rows): F.linear.
    decode_gemm: str = "torch"
    # The checkpoint's linear weights are FP8 (spanllm.model.fp8_checkpoint): the layers are built with float8
    # weights and float32 scales from the start (a model-dtype copy first would need the bf16 model's memory)
    fp8_weights: bool = False
    # EngineConfig.pdl resolved on this device: the forward launches its Triton kernels with programmatic dependent
    # launch (spanllm.kernels.pdl; LlamaForCausalLM.forward opens the scope)
    pdl: bool = False

    def __post_init__(self) -> None:
        if self.size > 1 and self.comm is None:
            raise ValueError(f"tp size {self.size} needs a communicator (an object with all_reduce_); got None")

    def all_reduce_(self, x: torch.Tensor) -> None:
        """Sum x in place over the TP group."""
        self.comm.all_reduce_(x)

    def use_skinny(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        """Whether x @ weight^T (weight [N, K]) runs the skinny kernel (see decode_gemm)."""
        if self.decode_gemm == "torch":
            return False
        rows = x.numel() // x.shape[-1]
        if rows > SKINNY_MAX_M:
            return False
        if self.decode_gemm == "skinny":
            return True
        n, k = weight.shape
        return x.is_cuda and prefer_skinny(rows, n, k, x.element_size())

    def linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """x @ weight^T: the skinny Triton GEMM where use_skinny says so, else F.linear."""
        if self.use_skinny(x, weight):
            return skinny_linear(x, weight)
        return F.linear(x, weight)

    def empty(self, *shape: int) -> nn.Parameter:
        return nn.Parameter(torch.empty(*shape, device=self.device, dtype=self.dtype), requires_grad=False)


def divide(total: int, parts: int, what: str) -> int:
    if total % parts:
        raise ValueError(f"{what}={total} is not divisible by tp={parts}; choose a tp that divides {total}")
    return total // parts
