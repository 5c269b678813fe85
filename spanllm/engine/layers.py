"""Tensor-parallel building blocks (vLLM names): column- and row-parallel linears, vocab-parallel
embedding and LM head, RMSNorm.

Communication inside the model:
- `RowParallelLinear` is the only layer that calls the injected communicator (`comm.all_reduce_`):
  two calls per decoder layer (attention output and MLP down projection) when tp > 1.
- `VocabParallelEmbedding` sums the partial lookups with `torch.distributed.all_reduce` on the TP
  group, and `ParallelLMHead` gathers logit shards with an all-gather: process-group
  collectives, not the communicator, once per forward each, outside the decoder layers.

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

from spanllm.engine.skinny_gemm import MAX_M as SKINNY_MAX_M
from spanllm.engine.skinny_gemm import prefer_skinny
from spanllm.engine.timers import Timers


def skinny_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The opaque custom op (registered by spanllm.engine.skinny_gemm where Triton exists): one graph node
    under torch.compile. LLM checks once, before building the model, that GPU and Triton are there (no
    check here: this runs on every decode GEMM)."""
    return torch.ops.spanllm.skinny_linear(x, weight)


class Communicator(Protocol):
    """What the engine needs from an all-reduce backend (`spanllm.comm.AllReduce` or a stand-in)."""

    def all_reduce_(self, x: torch.Tensor) -> torch.Tensor: ...


@dataclass
class TPContext:
    """What a parallel layer needs: its place in the TP group, the group, the communicator, the timers."""

    rank: int = 0
    size: int = 1
    group: dist.ProcessGroup | None = None
    # The row-parallel layers' all-reduce. For a buffered backend (nvrar) LLM passes
    # spanllm.comm.fallback.SizeFallback(backend, the group's collective): messages above the buffer (prefill
    # activations) go to nccl / gloo. Which one ran is reported by LLM.allreduce_ran*.
    comm: Communicator | None = None
    timers: Timers = field(default_factory=Timers)
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    dtype: torch.dtype = torch.float32
    # torch.ops.spanllm.all_reduce_ handle of comm (spanllm.comm.op.register), set by LLM when
    # EngineConfig.compile_decode is on: the row-parallel all-reduce then calls the opaque custom op, which
    # torch.compile keeps as one node, instead of tracing into the communicator's Python. None: call directly.
    comm_handle: str | None = None
    # EngineConfig.decode_gemm, for weight GEMMs of <= skinny_gemm.MAX_M rows: "skinny" sends every one to
    # torch.ops.spanllm.skinny_linear (LLM checks GPU and Triton first), "auto" only those whose shape the
    # measured table says the skinny kernel runs faster (skinny_gemm.prefer_skinny; CUDA tensors only);
    # "torch" (and more rows): F.linear.
    decode_gemm: str = "torch"

    def __post_init__(self) -> None:
        if self.size > 1 and self.comm is None:
            raise ValueError(f"tp size {self.size} needs a communicator (an object with all_reduce_); got None")

    def all_reduce_(self, x: torch.Tensor) -> None:
        """Sum x in place over the TP group: directly, or through the custom op when a handle is registered
        (compile_decode)."""
        if self.comm_handle is None:
            self.comm.all_reduce_(x)
        else:
            torch.ops.spanllm.all_reduce_(x, self.comm_handle)

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


class ColumnParallelLinear(nn.Module):
    """y = x W^T with W split by output rows: each rank holds out_features/tp rows; no communication."""

    def __init__(self, in_features: int, out_features: int, tp: TPContext) -> None:
        super().__init__()
        self.tp = tp
        self.in_features = in_features
        self.out_local = divide(out_features, tp.size, "out_features")
        self.weight = tp.empty(self.out_local, in_features)  # [out/tp, in]

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out/tp]
        with self.tp.timers.region("gemm"):
            return self.tp.linear(x, self.weight)


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q/k/v projection. Rank r owns query heads [r*hq, (r+1)*hq) and the KV heads they read.

    tp <= kv heads: each rank owns kv/tp KV heads. tp > kv heads (kv must divide tp): each KV head is
    replicated on tp/kv consecutive ranks, and rank r holds KV head r // (tp/kv). Local output layout:
    [q (hq*d) | k (hkv*d) | v (hkv*d)].
    """

    def __init__(self, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int, tp: TPContext) -> None:
        self.num_heads_local = divide(num_heads, tp.size, "num_heads")
        if num_kv_heads >= tp.size:
            self.num_kv_heads_local = divide(num_kv_heads, tp.size, "num_kv_heads")
            self.kv_head_start = tp.rank * self.num_kv_heads_local
        else:
            if tp.size % num_kv_heads:
                raise ValueError(f"tp={tp.size} > num_kv_heads={num_kv_heads} but not a multiple of it: KV heads "
                                 f"cannot be replicated evenly; use a tp that divides or is a multiple of {num_kv_heads}")
            self.num_kv_heads_local = 1
            self.kv_head_start = tp.rank // (tp.size // num_kv_heads)
        self.q_head_start = tp.rank * self.num_heads_local
        self.head_dim = head_dim
        out_total = (self.num_heads_local + 2 * self.num_kv_heads_local) * head_dim * tp.size
        super().__init__(hidden, out_total, tp)
        self.q_size = self.num_heads_local * head_dim
        self.kv_size = self.num_kv_heads_local * head_dim


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Fused gate and up projections: local output [gate (ffn/tp) | up (ffn/tp)]."""

    def __init__(self, hidden: int, intermediate: int, tp: TPContext) -> None:
        self.intermediate_local = divide(intermediate, tp.size, "intermediate_size")
        self.start = tp.rank * self.intermediate_local
        super().__init__(hidden, 2 * intermediate, tp)


class RowParallelLinear(nn.Module):
    """y = sum over ranks of x_r W_r^T, W split by input columns. The model's one all-reduce call site."""

    def __init__(self, in_features: int, out_features: int, tp: TPContext) -> None:
        super().__init__()
        self.tp = tp
        self.in_local = divide(in_features, tp.size, "in_features")
        self.in_start = tp.rank * self.in_local
        self.weight = tp.empty(out_features, self.in_local)  # [out, in/tp]

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in/tp] -> [..., out]
        timers = self.tp.timers
        with timers.region("gemm"):
            y = self.tp.linear(x, self.weight)
        if self.tp.size > 1:
            with timers.region("allreduce"):
                self.tp.all_reduce_(y)  # in place; y is a fresh contiguous tensor
        return y


class VocabParallelEmbedding(nn.Module):
    """Embedding with the vocabulary split in rows: rank r holds ids [r*Vp, (r+1)*Vp), Vp = ceil(V/tp).

    Rows past the real vocabulary (padding on the last rank) exist only to keep shards equal.
    """

    def __init__(self, vocab_size: int, hidden: int, tp: TPContext) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.vocab_local = -(-vocab_size // tp.size)
        self.vocab_start = tp.rank * self.vocab_local
        self.vocab_stop = min(self.vocab_start + self.vocab_local, vocab_size)  # real rows: [start, stop)
        self.weight = tp.empty(self.vocab_local, hidden)  # [Vp, hidden]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [B, T] int64 -> [B, T, hidden]
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.vocab_start
        owned = (local >= 0) & (local < self.vocab_local)
        out = F.embedding(local.clamp(0, self.vocab_local - 1), self.weight)
        out = out * owned.unsqueeze(-1).to(out.dtype)
        dist.all_reduce(out, group=self.tp.group)  # process-group collective, not the communicator
        return out


class ParallelLMHead(VocabParallelEmbedding):
    """logits = h W^T over the local vocabulary rows, then gathered: every TP rank gets the full row."""

    def forward(self, h: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] float32, written into `out` when given (the serving engine's graphs share
        one logits buffer instead of each keeping its own)."""
        with self.tp.timers.region("gemm"):
            local = self.tp.linear(h, self.weight)  # [N, Vp]
        n, tp, vl = local.shape[0], self.tp.size, self.vocab_local
        if tp > 1:
            gathered = torch.empty(tp * n, vl, device=local.device, dtype=local.dtype)
            _all_gather_single(gathered, local, group=self.tp.group)  # [tp*N, Vp], rank-major
            exact = tp * vl == self.vocab_size  # no padding rows in the vocabulary
            dst = out if out is not None and exact else torch.empty(n, tp * vl, device=local.device, dtype=torch.float32)
            # One pass: rank-major -> row-major ([tp, N, Vp] -> [N, tp, Vp]) and to float32 together.
            dst.view(n, tp, vl).copy_(gathered.view(tp, n, vl).transpose(0, 1))
            if dst is out:
                return out
            full = dst[:, : self.vocab_size]
            return full if out is None else out.copy_(full)
        if out is None:
            return local[:, : self.vocab_size].float()
        return out.copy_(local[:, : self.vocab_size])


# torch >= 2.13 renamed all_gather_into_tensor to all_gather_single (the old name warns); 2.11 has only the old.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class RMSNorm(nn.Module):
    """x / rms(x) * w, computed in float32 and cast back (as HF Llama does)."""

    def __init__(self, hidden: int, eps: float, tp: TPContext) -> None:
        super().__init__()
        self.eps = eps
        self.weight = tp.empty(hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., hidden]
        # F.rms_norm (x * rsqrt(mean(x^2) + eps), fused on recent CUDA builds) replaces five elementwise
        # kernels per norm; the weight is applied after the cast back, as HF does.
        x32 = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * x32.to(x.dtype)
