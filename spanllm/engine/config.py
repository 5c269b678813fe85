"""EngineConfig: how the engine runs a model (batch and sequence limits, dtype, CUDA graphs, the serving
engine's cache and scheduler sizes)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

# The model dtypes by name: spanllm.dtypes holds the one dtype table (the all-reduce library reads it too).
from spanllm.dtypes import MODEL_DTYPES as DTYPES  # noqa: F401
from spanllm.dtypes import model_dtype as parse_dtype  # noqa: F401
from spanllm.workloads import BUFFERED_ALLREDUCE_MAX_BYTES

COMPILE_SCOPES = ("layer", "forward")
DECODE_GEMMS = ("auto", "torch", "skinny")


@dataclass(frozen=True)
class EngineConfig:
    """How the engine runs a model: batch and sequence limits, dtype, CUDA graphs, timers, sampling seed."""

    max_batch_size: int = 8
    max_seq_len: int = 1024
    dtype: torch.dtype = torch.bfloat16
    cuda_graphs: bool = True  # decode only, GPU only; ignored (and reported False) on CPU
    breakdown: bool = False  # per-op decode timers; forces eager decode so events can be placed
    micro_batches: int = 1  # pipeline micro-batches (1 = naive schedule: the whole batch per stage)
    seed: int = 0
    # pp = 1 decode checks for stop tokens every this many steps (one device->host sync each time), so a
    # batch that has stopped runs up to eos_check_interval - 1 extra steps (their tokens are dropped).
    eos_check_interval: int = 16
    # A buffered all-reduce (nvrar, torch symm-mem) takes messages up to this size (decode); larger ones
    # (prefill activations) go to the group's own collective, as in the paper's engine.
    allreduce_max_bytes: int = BUFFERED_ALLREDUCE_MAX_BYTES
    # Decode forward (embedding -> layers -> norm -> LM head) through torch.compile (dynamic=False, default
    # mode: the engine captures its own CUDA graph around the compiled code). The row-parallel all-reduce
    # then goes through the opaque custom op torch.ops.spanllm.all_reduce_. One compile per decode bucket
    # shape (batch size, first cache slot, input kind); the warm-up before each graph capture compiles.
    # compile_backend: "inductor" (fuses the small kernels), or "aot_eager" (tracing only; CPU tests).
    # compile_scope: "layer" compiles one decoder layer's compute (every layer then runs the same compiled
    # code with its own weights and cache: one compile per bucket whatever the depth; embedding, final norm
    # and LM head stay eager inside the CUDA graph), "forward" the whole decode forward (fusion across layer
    # boundaries too, but the compile grows with the depth: 80 layers of 70B).
    compile_decode: bool = False
    compile_backend: str = "inductor"
    compile_scope: str = "layer"
    # The weight GEMMs (every column/row-parallel linear and the LM head) of calls with at most 16 rows, i.e.
    # decode up to batch 16: "torch" = F.linear (cuBLAS), "skinny" = spanllm.kernels.skinny_gemm (a Triton
    # stream over W with split-K, torch.ops.spanllm.skinny_linear; GPU + Triton only), "auto" = skinny for
    # the shapes where its measured table says it beats F.linear (skinny_gemm.MEASURED_US), F.linear for the
    # rest and on CPU. More rows (prefill, larger batches) always run F.linear. describe() names the choice.
    decode_gemm: str = "auto"
    # --- the serving engine (LLM.generate, spanllm serve): continuous batching over a paged KV cache ---
    # max_batch_size / max_seq_len above size the static path only (generate_static, bench batch / study).
    block_size: int = 16  # tokens per KV block
    max_num_seqs: int = 256  # sequences per step (and the largest decode CUDA-graph bucket)
    max_num_batched_tokens: int = 8192  # tokens per step (decodes + prefill chunks)
    max_model_len: int | None = None  # prompt + output limit; None: the model's max_position_embeddings
    gpu_memory_utilization: float = 0.9  # fraction of the GPU's memory for weights + activations + KV cache
    cpu_kv_cache_bytes: int = 1 << 30  # KV pool on CPU
    num_kv_blocks: int | None = None  # overrides the sizing (tests: a pool small enough to preempt)
    attention_backend: str = "auto"  # paged attention: auto (triton on CUDA), torch (reference), triton
    min_admit: int = 1  # admission batching (spanllm.engine.core.scheduler.SchedulerConfig.min_admit); 1 = off
    # The host plans step t+1 while step t runs (spanllm.engine.engine_core); None: on a GPU at TP = 1
    async_scheduling: bool | None = None

    def __post_init__(self) -> None:
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}={v!r} must be a positive integer")
        if self.max_model_len is not None and (not isinstance(self.max_model_len, int) or self.max_model_len < 2):
            raise ValueError(f"max_model_len={self.max_model_len!r} must be an integer >= 2 (or None)")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} is below max_num_seqs="
                f"{self.max_num_seqs}: a step of decodes alone would not fit the budget and the newest "
                "sequences would never decode; raise max_num_batched_tokens or lower max_num_seqs"
            )
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization={self.gpu_memory_utilization} must be in (0, 1]")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 2:
            raise ValueError(f"num_kv_blocks={self.num_kv_blocks} must be >= 2 (block 0 is reserved)")
        if self.attention_backend not in ("auto", "torch", "triton"):
            raise ValueError(f"attention_backend={self.attention_backend!r} must be auto, torch or triton")
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size={self.max_batch_size} must be >= 1")
        if self.max_seq_len < 2:
            raise ValueError(f"max_seq_len={self.max_seq_len} must be >= 2 (a prompt token and a generated one)")
        if self.micro_batches < 1:
            raise ValueError(f"micro_batches={self.micro_batches} must be >= 1")
        if self.eos_check_interval < 1:
            raise ValueError(f"eos_check_interval={self.eos_check_interval} must be >= 1")
        if self.compile_scope not in COMPILE_SCOPES:
            raise ValueError(f"compile_scope={self.compile_scope!r} must be one of {COMPILE_SCOPES}")
        if self.decode_gemm not in DECODE_GEMMS:
            raise ValueError(f"decode_gemm={self.decode_gemm!r} must be one of {DECODE_GEMMS}")
        if not isinstance(self.compile_backend, str) or not self.compile_backend:
            raise ValueError(
                f"compile_backend={self.compile_backend!r} must be a torch.compile backend name "
                "(inductor, aot_eager, eager)"
            )
