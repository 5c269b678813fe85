"""Tensor-parallel linears (vLLM names): column-parallel (fused QKV, merged gate/up) and row-parallel.

`RowParallelLinear` is the model's one call site of the injected communicator (`comm.all_reduce_`): two calls
per decoder layer (attention output and MLP down projection) when tp > 1.

Each holds its weight in the model dtype, or, after `quantize_fp8_()` (EngineConfig.quantization="fp8", once the
weights are loaded), in float8_e4m3fn with per-channel scales (spanllm.layers.fp8).
"""

from __future__ import annotations

import torch
from torch import nn

from spanllm.layers import fp8
from spanllm.layers.tp import TPContext, divide


class _Linear(nn.Module):
    """A weight [N, K] (nn.Linear layout) and the GEMM that applies it: the TP context's (model dtype) or FP8's."""

    def __init__(self, tp: TPContext, out_local: int, in_local: int, fused_input: bool = True) -> None:
        super().__init__()
        self.tp = tp
        # FP8: whether the kernel producing this layer's input can quantize it (a norm, SiLU x up); o_proj's input,
        # the attention's output, never comes quantized, so W8A8 always pays the separate pass there
        self.fused_input = fused_input
        self.weight_scale: nn.Parameter | None = None  # float32 [N] once quantized to FP8
        self.weight_dequantized: torch.Tensor | None = None  # FP8 on CPU: q * scale in the model dtype
        if tp.fp8_weights:  # an FP8 checkpoint fills these (fp8_loaded_ after it)
            self._check_fp8_shape(out_local, in_local, checkpoint=True)
            self._model_dtype = tp.dtype
            f8 = torch.empty(out_local, in_local, dtype=fp8.FP8_DTYPE, device=tp.device)
            self.weight = nn.Parameter(f8, requires_grad=False)
            scale = torch.empty(out_local, dtype=torch.float32, device=tp.device)
            self.weight_scale = nn.Parameter(scale, requires_grad=False)
        else:
            self.weight = tp.empty(out_local, in_local)

    def gemm(self, x: torch.Tensor | fp8.Fp8Activation) -> torch.Tensor:  # [..., K] -> [..., N]
        if self.weight_scale is None:
            if isinstance(x, fp8.Fp8Activation):
                raise TypeError("an Fp8Activation reached a linear layer whose weight is not FP8 (quantizes_input)")
            return self.tp.linear(x, self.weight)
        return fp8.fp8_linear(x, self.weight, self.weight_scale, self.weight_dequantized, self.fused_input)

    def quantizes_input(self, rows: int) -> bool:
        """Whether the kernel producing this layer's input of `rows` rows should quantize it (fused_ops'
        quantize=True): the GEMM runs W8A8 and the fused quantization is on at that size (fp8.producer_quantizes)."""
        return self.weight_scale is not None and self.fused_input and fp8.producer_quantizes(rows, *self.weight.shape)

    @staticmethod
    def _check_fp8_shape(n: int, k: int, checkpoint: bool = False) -> None:
        if n % fp8.FP8_SHAPE_MULTIPLE or k % fp8.FP8_SHAPE_MULTIPLE:
            fix = (
                "This checkpoint is FP8 by its config.json's quantization_config: load its bf16 original instead, "
                if checkpoint
                else "Run without --quantization, "
            )
            raise ValueError(
                f"quantization='fp8': a linear layer of this model (per rank) is [{n}, {k}]; FP8 GEMMs "
                f"(torch._scaled_mm) need both sizes multiples of {fp8.FP8_SHAPE_MULTIPLE}. {fix}or run at a "
                "tensor-parallel degree that keeps the shards multiples of 16"
            )

    @torch.no_grad()
    def fp8_loaded_(self) -> None:
        """After the checkpoint filled weight and scale: the CPU path's dequantized copy (as quantize_fp8_)."""
        if not self.weight.is_cuda:
            self.weight_dequantized = fp8.dequantize_weight(self.weight, self.weight_scale, self._model_dtype)

    @torch.no_grad()
    def quantize_fp8_(self) -> None:
        """Replace the loaded weight by its FP8 quantization (the model-dtype copy is freed; on CPU the
        dequantized values are kept instead, for the CPU path)."""
        if self.weight_scale is not None:
            raise RuntimeError("quantize_fp8_: this layer's weight is FP8 already")
        self._check_fp8_shape(*self.weight.shape)
        q, scale = fp8.quantize_weight(self.weight)
        dtype = self.weight.dtype
        self.weight = nn.Parameter(q, requires_grad=False)
        self.weight_scale = nn.Parameter(scale, requires_grad=False)
        if not q.is_cuda:
            self.weight_dequantized = fp8.dequantize_weight(q, scale, dtype)


class ColumnParallelLinear(_Linear):
    """y = x W^T with W split by output rows: each rank holds out_features/tp rows; no communication."""

    def __init__(self, in_features: int, out_features: int, tp: TPContext) -> None:
        self.in_features = in_features
        self.out_local = divide(out_features, tp.size, "out_features")
        super().__init__(tp, self.out_local, in_features)  # W [out/tp, in]

    def forward(self, x: torch.Tensor | fp8.Fp8Activation) -> torch.Tensor:  # [..., in] -> [..., out/tp]
        return self.gemm(x)


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


class RowParallelLinear(_Linear):
    """y = sum over ranks of x_r W_r^T, W split by input columns. The model's one all-reduce call site."""

    def __init__(self, in_features: int, out_features: int, tp: TPContext, fused_input: bool = True) -> None:
        self.in_local = divide(in_features, tp.size, "in_features")
        self.in_start = tp.rank * self.in_local
        super().__init__(tp, out_features, self.in_local, fused_input)  # W [out, in/tp]

    def forward(self, x: torch.Tensor | fp8.Fp8Activation) -> torch.Tensor:  # [..., in/tp] -> [..., out]
        y = self.gemm(x)
        if self.tp.size > 1:
            self.tp.all_reduce_(y)  # in place; y is a fresh contiguous tensor
        return y


def quantize_fp8_(model: nn.Module) -> int:
    """Quantize every column- / row-parallel linear of `model` to FP8 in place (after its weights are loaded);
    returns how many. The embedding and LM head (spanllm.layers.vocab) are not these classes: they stay."""
    layers = [m for m in model.modules() if isinstance(m, _Linear)]
    for layer in layers:
        layer.quantize_fp8_()
    return len(layers)


def linear_layers(model: nn.Module) -> list[_Linear]:
    """Every column- / row-parallel linear of `model` (the layers FP8 applies to)."""
    return [m for m in model.modules() if isinstance(m, _Linear)]
