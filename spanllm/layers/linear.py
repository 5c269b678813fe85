"""Tensor-parallel linears (vLLM names): column-parallel (fused QKV, merged gate/up) and row-parallel.

`RowParallelLinear` is the model's one call site of the injected communicator (`comm.all_reduce_`): two calls
per decoder layer (attention output and MLP down projection) when tp > 1.
"""

from __future__ import annotations

import torch
from torch import nn

from spanllm.layers.tp import TPContext, divide


class ColumnParallelLinear(nn.Module):
    """y = x W^T with W split by output rows: each rank holds out_features/tp rows; no communication."""

    def __init__(self, in_features: int, out_features: int, tp: TPContext) -> None:
        super().__init__()
        self.tp = tp
        self.in_features = in_features
        self.out_local = divide(out_features, tp.size, "out_features")
        self.weight = tp.empty(self.out_local, in_features)  # [out/tp, in]

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out/tp]
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
                raise ValueError(
                    f"tp={tp.size} > num_kv_heads={num_kv_heads} but not a multiple of it: KV heads "
                    f"cannot be replicated evenly; use a tp that divides or is a multiple of {num_kv_heads}"
                )
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
        y = self.tp.linear(x, self.weight)
        if self.tp.size > 1:
            self.tp.all_reduce_(y)  # in place; y is a fresh contiguous tensor
        return y
