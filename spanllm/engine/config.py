"""EngineConfig: how the engine runs a model (dtype, CUDA graphs, the KV cache and the scheduler's limits, the
decode GEMM and all-reduce choices). One frozen dataclass, validated here; the CLI builds it from its flags."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from spanllm.attention.backend import BACKENDS as ATTENTION_BACKENDS
from spanllm.attention.cascade import PREFILL_ATTENTION
from spanllm.attention.shared_prefix import SHARED_PREFIX_ATTENTION
from spanllm.dtypes import MODEL_DTYPES
from spanllm.engine.core.scheduler import DEFAULT_LONG_PREFILL_ATTENTION_BUDGET, SCHEDULING_POLICIES
from spanllm.engine.sampler import INT64_MAX, INT64_MIN, is_int
from spanllm.kernels.pdl import PDL_MODES
from spanllm.kernels.prefill_config import PrefillConfig
from spanllm.layers.fp8 import QUANTIZATIONS
from spanllm.workloads import BUFFERED_ALLREDUCE_MAX_BYTES

DECODE_GEMMS = ("auto", "torch", "skinny")
# vLLM's names: the model dtype, or float8_e4m3fn (e4m3 values with scale 1; "fp8_e4m3" is the same)
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
# prefill_tokens_beside_decodes's auto on CPU: a 135M model's step of 256 prefill tokens takes ~1-2 s on two cores,
# so a long prompt delays the running streams by that much a step, not by its whole prefill (minutes at 8k tokens)
CPU_PREFILL_TOKENS_BESIDE_DECODES = 256
# long_prefill_token_threshold's auto on CPU, for the same reason: one prompt's chunk a step, so that an 8k-token
# prompt takes ~32 steps of 1-2 s, each of which admits the requests that arrived meanwhile, not one of minutes
CPU_LONG_PREFILL_TOKEN_THRESHOLD = 256
FP8_KV_CACHE_DTYPES = ("fp8", "fp8_e4m3")


@dataclass(frozen=True)
class EngineConfig:
    dtype: torch.dtype = torch.bfloat16
    cuda_graphs: bool = True  # GPU only; ignored (and reported off) on CPU and on pipeline stages
    seed: int = 0  # random weights (presets) and the sampler's generator
    # A buffered all-reduce (nvrar, torch symm-mem) takes messages up to this size (decode); larger ones
    # (prefill activations) go to the group's own collective, as in the paper's engine.
    allreduce_max_bytes: int = BUFFERED_ALLREDUCE_MAX_BYTES
    # The weight GEMMs (every column/row-parallel linear and the LM head) of calls with at most 16 rows, i.e.
    # decode up to batch 16: "torch" = F.linear (cuBLAS), "skinny" = spanllm.kernels.skinny_gemm (a Triton
    # stream over W with split-K; GPU + Triton only), "auto" = skinny for the shapes where its measured table
    # says it beats F.linear, F.linear for the rest and on CPU. More rows always run F.linear. LLM.describe()
    # names the choice.
    decode_gemm: str = "auto"
    # Programmatic dependent launch of the forward's Triton kernels (spanllm.kernels.pdl): each may start while
    # the one before it finishes. "auto" = on where supported (compute capability >= 9.0), "on" (refused
    # elsewhere), "off". Default auto: batch-1 decode 1.9% (bf16) and 3.4% (FP8) faster on an H100, ShareGPT
    # offline unchanged (results/h100/pdl/).
    pdl: str = "auto"
    # None: weights in `dtype`. "fp8": the decoder layers' linears quantized at load (spanllm.layers.fp8: e4m3
    # weights with per-channel scales; x per token where the GEMM runs W8A8); embedding and LM head stay in `dtype`.
    quantization: str | None = None
    # The KV cache's element type: "auto" (dtype) or "fp8" (float8_e4m3fn; K and V as e4m3 values with scale 1, vLLM's
    # default for a checkpoint without KV scales, saturating at +-448; widened to dtype as the attention reads
    # them): half the bytes per token, so twice the tokens in the same memory and half the reads per decode.
    kv_cache_dtype: str = "auto"
    block_size: int = 16  # tokens per KV block
    max_num_seqs: int = 256  # sequences per step (and the largest decode CUDA-graph bucket)
    max_num_batched_tokens: int = 8192  # tokens per step (decodes + prefill chunks)
    max_model_len: int | None = None  # prompt + output limit; None: the model's max_position_embeddings
    gpu_memory_utilization: float = 0.9  # fraction of the GPU's memory for weights + activations + KV cache
    cpu_kv_cache_bytes: int = 1 << 30  # KV pool on CPU
    num_kv_blocks: int | None = None  # overrides the sizing (tests: a pool small enough to preempt)
    # Automatic prefix caching (spanllm.engine.core.block_manager): full KV blocks are kept findable by the
    # hash of their prefix and shared by later requests that start with the same tokens (vLLM's default: on)
    enable_prefix_caching: bool = True
    attention_backend: str = "auto"  # auto (triton on CUDA), torch (the reference), triton
    # The Triton prefill attention kernel's tiling (spanllm.kernels.prefill_config; e.g. the best of
    # scripts/gpu_prefill_attention.py's sweep, load_prefill_config); None: its default. LLM.describe() names it.
    prefill_tiling: PrefillConfig | None = None
    # The Triton backend's prefill attention (spanllm.attention.cascade): "auto" (cudnn-cascade on a Hopper GPU,
    # else triton), "triton" (the paged kernel for every chunk), or a cascade (cudnn-cascade, flash-cascade: torch's
    # fused attention over the gathered prefix, no mask, merged with the chunk's square causal part) for chunks with
    # >= cascade_min_prefix cached keys in steps without decodes, which then run eagerly (0: every chunk, a prompt's
    # first included, whose cascade is the square causal part alone); beside decodes the paged kernel runs.
    # LLM.describe() names it.
    prefill_attention: str = "auto"
    # None: DEFAULT_CASCADE_MIN_PREFIX where a cascade runs; a value where none runs is refused (resolve_backend)
    cascade_min_prefix: int | None = None
    # Decodes whose block tables start with the same cached blocks (prefix caching's shared prompts) read those
    # keys once per group (spanllm.attention.shared_prefix): auto (on with the Triton backend), on, off
    shared_prefix_attention: str = "auto"
    min_admit: int = 1  # admission batching (spanllm.engine.core.scheduler.SchedulerConfig.min_admit); 1 = off
    # Admission order (spanllm.engine.core.scheduler): "fcfs", or "prefix" (requests that share a prompt prefix
    # admitted together, the oldest first; needs prefix caching)
    scheduling_policy: str = "fcfs"
    # Query-key pairs a step's prefill chunks may attend while decodes share the step, so that a long prompt's
    # chunks do not stall the running decodes (spanllm.engine.core.scheduler); 0 = no limit
    long_prefill_attention_budget: int = DEFAULT_LONG_PREFILL_ATTENTION_BUDGET
    # Tokens a step's prefill chunks may take while decodes share the step (spanllm.engine.core.scheduler): None =
    # auto (CPU_PREFILL_TOKENS_BESIDE_DECODES on CPU, where a step's time is its tokens; no limit on a GPU), 0 = no
    # limit but max_num_batched_tokens
    prefill_tokens_beside_decodes: int | None = None
    # Tokens one prompt's prefill chunk may take in any step (vLLM's setting; spanllm.engine.core.scheduler): None =
    # auto (CPU_LONG_PREFILL_TOKEN_THRESHOLD on CPU; no limit on a GPU), 0 = no limit
    long_prefill_token_threshold: int | None = None
    # The host plans step t+1 while step t runs (spanllm.engine.engine_core); None: on a GPU at TP = 1
    async_scheduling: bool | None = None

    @property
    def kv_dtype(self) -> torch.dtype:
        """The KV cache tensors' dtype."""
        return torch.float8_e4m3fn if self.kv_cache_dtype in FP8_KV_CACHE_DTYPES else self.dtype

    def __post_init__(self) -> None:
        if isinstance(self.dtype, str) and self.dtype in MODEL_DTYPES:  # vLLM's spelling: dtype="float32"
            object.__setattr__(self, "dtype", MODEL_DTYPES[self.dtype])
        if self.dtype not in MODEL_DTYPES.values():
            raise ValueError(
                f"dtype={self.dtype!r} is not a model dtype: give torch.float32, torch.bfloat16 or torch.float16 "
                "(or their names, e.g. 'float32')"
            )
        for name in ("cuda_graphs", "enable_prefix_caching"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} must be True or False")
        if self.async_scheduling is not None and not isinstance(self.async_scheduling, bool):
            raise ValueError(f"async_scheduling={self.async_scheduling!r} must be None (auto), True or False")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "min_admit", "cpu_kv_cache_bytes"):
            v = getattr(self, name)
            if not is_int(v) or v < 1:
                raise ValueError(f"{name}={v!r} must be a positive integer")
        if not is_int(self.seed) or not INT64_MIN <= self.seed <= INT64_MAX:
            raise ValueError(f"seed={self.seed!r} must be an integer in [-2**63, 2**63 - 1] (int64), e.g. seed=0")
        if self.max_model_len is not None and (not is_int(self.max_model_len) or self.max_model_len < 2):
            raise ValueError(f"max_model_len={self.max_model_len!r} must be an integer >= 2 (or None)")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} is below max_num_seqs="
                f"{self.max_num_seqs}: a step of decodes alone would not fit the budget and the newest "
                "sequences would never decode; raise max_num_batched_tokens or lower max_num_seqs"
            )
        v = self.gpu_memory_utilization
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not 0.0 < v <= 1.0:
            raise ValueError(f"gpu_memory_utilization={v!r} must be a number in (0, 1]")
        if self.num_kv_blocks is not None and (not is_int(self.num_kv_blocks) or self.num_kv_blocks < 2):
            raise ValueError(f"num_kv_blocks={self.num_kv_blocks!r} must be an integer >= 2 (block 0 is reserved)")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend={self.attention_backend!r} must be one of {ATTENTION_BACKENDS}")
        v = self.long_prefill_attention_budget
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ValueError(f"long_prefill_attention_budget={v!r} must be an integer >= 0 (0: no limit)")
        for name in ("prefill_tokens_beside_decodes", "long_prefill_token_threshold"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
                raise ValueError(f"{name}={v!r} must be None (auto) or an integer >= 0 (0: no limit)")
        if self.prefill_attention not in PREFILL_ATTENTION:
            raise ValueError(f"prefill_attention={self.prefill_attention!r} must be one of {PREFILL_ATTENTION}")
        v = self.cascade_min_prefix
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
            raise ValueError(f"cascade_min_prefix={v!r} must be None (the default) or an integer >= 0 (0: every chunk)")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy={self.scheduling_policy!r} must be one of {SCHEDULING_POLICIES}")
        if self.scheduling_policy == "prefix" and not self.enable_prefix_caching:
            raise ValueError(
                "scheduling_policy='prefix' admits requests that share a cached prompt prefix together; it needs "
                "enable_prefix_caching=True (or use scheduling_policy='fcfs')"
            )
        if self.shared_prefix_attention not in SHARED_PREFIX_ATTENTION:
            raise ValueError(
                f"shared_prefix_attention={self.shared_prefix_attention!r} must be one of {SHARED_PREFIX_ATTENTION}"
            )
        if self.prefill_tiling is not None and not isinstance(self.prefill_tiling, PrefillConfig):
            raise ValueError(f"prefill_tiling={self.prefill_tiling!r} must be a PrefillConfig (or None)")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(
                f"quantization={self.quantization!r} is not supported; use None (weights in dtype) or one of "
                f"{QUANTIZATIONS}"
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype={self.kv_cache_dtype!r} must be one of {KV_CACHE_DTYPES} (fp8_e5m2 is not supported)"
            )
        if self.pdl not in PDL_MODES:
            raise ValueError(f"pdl={self.pdl!r} must be one of {PDL_MODES}")
        if self.decode_gemm not in DECODE_GEMMS:
            raise ValueError(f"decode_gemm={self.decode_gemm!r} must be one of {DECODE_GEMMS}")
