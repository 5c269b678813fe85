"""The attention backend interface: the model's attention layers call `forward`; the model runner asks the
backend for each step's metadata and, for CUDA graphs, for static metadata and the copies that refill it.

K/V live in fixed-size blocks of a shared pool (spanllm.engine.worker.kv_cache): per layer k, v
[num_blocks, block_size, kv_heads, head_dim]. Token position p of a sequence is slot
`block_table[p // block_size] * block_size + p % block_size`. Block 0 is never handed to a sequence: padded rows
of a captured graph write there and read only it.

Two backends, chosen once per runner (`resolve_backend`): "torch", the reference (gather a sequence's keys,
then SDPA; runs anywhere, the CPU tests' oracle), and "triton" (Hopper-tuned Triton kernels, CUDA graphs).
Asking for triton where it cannot run is an error, never a silent fallback.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

import numpy as np
import torch

from spanllm.attention.metadata import AttentionMetadata
from spanllm.attention.shared_prefix import SHARED_PREFIX_ATTENTION
from spanllm.kernels.fp8_quant import FP8_MAX
from spanllm.kernels.prefill_config import PrefillConfig

BACKENDS = ("auto", "torch", "triton")

# h2d(array) -> a device tensor holding the array (the runner's pinned staging: no host sync)
HostToDevice = Callable[[np.ndarray], torch.Tensor]


class AttentionBackend(ABC):
    """One per model runner: owns its metadata and, where it supports them, its CUDA-graph buffers."""

    name: str
    supports_cuda_graphs: bool = False

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, device: torch.device) -> None:
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.group = num_heads // num_kv_heads
        self.device = device

    def describe(self, dtype: torch.dtype) -> str:
        """The backend (and its kernels' settings) for LLM.describe()."""
        return self.name

    def eager_only(self, num_decode: int, q_lens: np.ndarray, context_lens: np.ndarray) -> bool:
        """Whether this step (host arrays, decodes first) must run eagerly even where graphs are on."""
        return False

    def warm_up_prefill(self, chunk: int, max_len: int, dtype: torch.dtype) -> list[tuple[int, int]]:
        """Pay the prefill attention's per-shape first-call costs now, at the shapes that chunks of `chunk` tokens
        in prompts of up to max_len tokens meet; returns the (queries, prefix) shapes warmed (none: nothing to
        warm)."""
        return []

    @abstractmethod
    def build_metadata(
        self,
        num_decode: int,
        q_lens: np.ndarray,
        context_lens: np.ndarray,
        block_tables: np.ndarray,
        cos: torch.Tensor,
        sin: torch.Tensor,
        slot_mapping: torch.Tensor,
        h2d: HostToDevice,
    ) -> AttentionMetadata:
        """An eager step's metadata. q_lens, context_lens [S] (decodes first), block_tables [S, W]: host arrays."""

    @abstractmethod
    def forward(
        self, qk: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """qk [N, (hq+hkv)*d] (queries then keys, as the fused projection lays them out, not yet rotated), v
        [N, hkv*d]: rotate, write the step's K/V into the cache, attend -> [N, hq*d]."""


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """k, v [N, hkv, d] into their slots (k_cache viewed as [num_blocks * block_size, hkv, d]), in the cache's
    dtype. An FP8 cache: saturated at +-448 first (torch before 2.12 casts an overflow to NaN), then torch's cast
    (nearest even), through byte views (index_copy_ has no float8 kernel on CPU)."""
    nb, bs, h, d = k_cache.shape
    if k_cache.dtype == torch.float8_e4m3fn:
        for cache, x in ((k_cache, k), (v_cache, v)):
            e4m3 = x.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
            cache.view(torch.uint8).view(nb * bs, h, d).index_copy_(0, slot_mapping, e4m3.view(torch.uint8))
        return
    k_cache.view(nb * bs, h, d).index_copy_(0, slot_mapping, k)
    v_cache.view(nb * bs, h, d).index_copy_(0, slot_mapping, v)


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def resolve_backend(
    name: str,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    device: torch.device,
    prefill_config: PrefillConfig | None = None,
    prefill_attention: str = "auto",
    cascade_min_prefix: int | None = None,
    shared_prefix: str = "auto",
    block_size: int = 16,
    dtype: torch.dtype = torch.bfloat16,
    num_layers: int | None = None,
) -> AttentionBackend:
    """The backend `name` (auto: triton on CUDA with Triton installed, else the reference) for this runner.
    prefill_config: the Triton prefill kernel's tiling (None: its default); prefill_attention (and
    cascade_min_prefix, None: its default): the Triton backend's prefill attention
    (spanllm.attention.cascade.PREFILL_ATTENTION; auto: a cascade where it pays). A cascade named for the reference
    is an error. shared_prefix:
    the Triton backend's shared-prefix decode attention (spanllm.attention.shared_prefix; auto: on there, off
    on the reference, which has none: "on" there is an error); block_size: the KV cache's; dtype: the run's
    compute dtype (a cascade takes bf16 / fp16 only); num_layers: the layers whose attention the runner's forward
    runs (auto's cascade weighs a plan build, once, against every layer's attention)."""
    if name not in BACKENDS:
        raise ValueError(f"attention_backend={name!r} must be one of {BACKENDS}")
    if shared_prefix not in SHARED_PREFIX_ATTENTION:
        raise ValueError(f"shared_prefix_attention={shared_prefix!r} must be one of {SHARED_PREFIX_ATTENTION}")
    has_triton = triton_available()
    if name == "auto":
        name = "triton" if device.type == "cuda" and has_triton else "torch"
    if name == "triton":
        if device.type != "cuda" or not has_triton:
            raise ValueError(
                f"attention_backend='triton' needs a CUDA device and Triton; this rank has {device} and Triton "
                f"{'installed' if has_triton else 'missing'}. Use attention_backend='torch' (the reference) here"
            )
        from spanllm.attention.triton import TritonBackend

        return TritonBackend(
            num_heads,
            num_kv_heads,
            head_dim,
            device,
            prefill_config,
            prefill_attention,
            cascade_min_prefix,
            shared_prefix=shared_prefix != "off",
            block_size=block_size,
            dtype=dtype,
            num_layers=num_layers,
        )
    if shared_prefix == "on":
        raise ValueError(
            f"shared_prefix_attention='on' is a feature of the Triton attention backend, but this runner uses the "
            f"{name} attention backend (on {device}); use 'auto' or 'off' here"
        )
    if prefill_config is not None:
        raise ValueError(
            f"prefill_tiling={prefill_config.label()} tiles the Triton prefill kernel, but this runner uses the "
            f"{name} attention backend (on {device}); leave prefill_tiling unset there"
        )
    if prefill_attention not in ("auto", "triton"):  # auto: the reference has no cascade to pick
        raise ValueError(
            f"prefill_attention={prefill_attention!r} is an option of the Triton attention backend, but this runner "
            f"uses the {name} attention backend (on {device}); leave prefill_attention='triton' there"
        )
    if cascade_min_prefix is not None:
        raise ValueError(
            f"cascade_min_prefix={cascade_min_prefix} chooses the chunks that run a cascade, but this runner uses the "
            f"{name} attention backend (on {device}), which has none; leave cascade_min_prefix unset there"
        )
    from spanllm.attention.reference import ReferenceBackend

    return ReferenceBackend(num_heads, num_kv_heads, head_dim, device)
