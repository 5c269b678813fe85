"""ModelConfig (the network's shapes, from an HF config.json or a preset) and EngineConfig (how to run it).

Presets carry the exact shapes of Llama 3.1 8B / 70B / 405B. `"llama3.1-405b:layers=8"` keeps the
405B shapes with only 8 decoder layers; such a config has `truncated_from=126` and its `label`
says so, so no report can pass it off as the full model.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from spanllm.workloads import BUFFERED_ALLREDUCE_MAX_BYTES
from spanllm.model_sizes import LLAMA31, LLAMA31_KV_HEADS, LLAMA31_VOCAB

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM",)


class ModelConfigError(ValueError):
    """A config.json or preset that this engine cannot build."""


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1 frequency scaling ('llama3' rope_type): low frequencies are slowed down by `factor`."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class ModelConfig:
    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 131072
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    truncated_from: int | None = None  # full layer count when this config keeps fewer layers
    checkpoint_dir: str | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        for f in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                  "head_dim"):
            v = getattr(self, f)
            if not isinstance(v, int) or v < 1:
                raise ModelConfigError(f"{self.name}: {f}={v!r} must be a positive integer")
        if self.num_heads % self.num_kv_heads:
            raise ModelConfigError(
                f"{self.name}: num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}; "
                "grouped-query attention needs every KV head to serve the same number of query heads")
        if self.truncated_from is not None and not 1 <= self.num_layers <= self.truncated_from:
            raise ModelConfigError(
                f"{self.name}: layers={self.num_layers} must be between 1 and the full model's {self.truncated_from}")

    @property
    def truncated_layers(self) -> int | None:
        """The number of layers kept when truncated (the JSON field), else None."""
        return self.num_layers if self.truncated_from is not None else None

    @property
    def label(self) -> str:
        if self.truncated_from is None:
            return self.name
        return f"{self.name} (TRUNCATED: {self.num_layers} of {self.truncated_from} layers)"

    def num_params(self) -> int:
        """Parameter count (embedding and head counted separately unless tied)."""
        h, d = self.hidden_size, self.head_dim
        attn = h * d * (self.num_heads + 2 * self.num_kv_heads) + self.num_heads * d * h
        mlp = 3 * h * self.intermediate_size
        per_layer = attn + mlp + 2 * h
        emb = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + emb + h

    def with_layers(self, n: int) -> "ModelConfig":
        full = self.truncated_from or self.num_layers
        if n == full:
            return replace(self, num_layers=full, truncated_from=None)
        return replace(self, num_layers=n, truncated_from=full)

    @classmethod
    def from_hf_config(cls, path_or_dict: str | os.PathLike | dict[str, Any]) -> "ModelConfig":
        """Build from an HF `config.json` (a file, a checkpoint directory, or the parsed dict)."""
        checkpoint_dir = None
        if isinstance(path_or_dict, dict):
            cfg, name = path_or_dict, str(path_or_dict.get("_name_or_path") or "hf-config")
            where = "the config"
        else:
            path = os.fspath(path_or_dict)
            if os.path.isdir(path):
                checkpoint_dir = path
                path = os.path.join(path, "config.json")
            if not os.path.isfile(path):
                raise ModelConfigError(f"no config.json at {path!r}; pass an HF checkpoint directory or a preset "
                                       f"({', '.join(PRESETS)})")
            where = path
            try:
                with open(path) as f:
                    cfg = json.load(f)
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise ModelConfigError(f"{path}: not valid JSON ({e}); restore the checkpoint's config.json "
                                       "(save_pretrained writes it)") from None
            if not isinstance(cfg, dict):
                raise ModelConfigError(f"{path}: holds a JSON {type(cfg).__name__}, not an object of config keys; "
                                       "restore the checkpoint's config.json")
            name = os.path.basename(os.path.dirname(os.path.abspath(path)))
        try:
            return cls._from_hf_dict(cfg, name, checkpoint_dir)
        except KeyError as e:
            raise ModelConfigError(f"{where}: no {e.args[0]!r} key, which this engine needs; restore the "
                                   "checkpoint's config.json (save_pretrained writes every key)") from None
        except (TypeError, ValueError) as e:
            if isinstance(e, ModelConfigError):
                if checkpoint_dir is None and isinstance(path_or_dict, dict):
                    raise
                raise ModelConfigError(f"{where}: {e}") from None
            raise ModelConfigError(f"{where}: a value has the wrong type ({e}); restore the checkpoint's "
                                   "config.json") from None

    @classmethod
    def _from_hf_dict(cls, cfg: dict[str, Any], name: str, checkpoint_dir: str | None) -> "ModelConfig":
        archs = cfg.get("architectures") or (["LlamaForCausalLM"] if cfg.get("model_type") == "llama" else [])
        if not archs or any(a not in SUPPORTED_ARCHITECTURES for a in archs):
            raise ModelConfigError(
                f"architectures={archs or cfg.get('model_type')!r} is not supported; this engine builds "
                f"{', '.join(SUPPORTED_ARCHITECTURES)} only (Llama 3 / 3.1 family)")
        for flag in ("attention_bias", "mlp_bias"):
            if cfg.get(flag):
                raise ModelConfigError(f"{flag}=True is not supported (Llama 3 has no biases); use a bias-free checkpoint")
        if cfg.get("hidden_act", "silu") != "silu":
            raise ModelConfigError(f"hidden_act={cfg['hidden_act']!r} is not supported; Llama uses 'silu'")
        # transformers >= 5 writes `rope_parameters` (theta inside); older configs `rope_theta` + `rope_scaling`.
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type == "llama3":
            scaling = RopeScaling(float(rope["factor"]), float(rope["low_freq_factor"]),
                                  float(rope["high_freq_factor"]), int(rope["original_max_position_embeddings"]))
        elif rope_type == "default":
            scaling = None
        else:
            raise ModelConfigError(f"rope_type={rope_type!r} is not supported; use 'llama3' or 'default'")
        heads = int(cfg["num_attention_heads"])
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return cls(
            name=name, vocab_size=int(cfg["vocab_size"]), hidden_size=int(cfg["hidden_size"]),
            intermediate_size=int(cfg["intermediate_size"]), num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads, num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)), rope_theta=theta, rope_scaling=scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 8192)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            bos_token_id=cfg.get("bos_token_id"), eos_token_ids=eos_ids, checkpoint_dir=checkpoint_dir)


_LLAMA31_ROPE = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                            original_max_position_embeddings=8192)


def _llama31(name: str) -> ModelConfig:
    hidden, layers, heads, ffn = LLAMA31[name]
    return ModelConfig(name=name, vocab_size=LLAMA31_VOCAB, hidden_size=hidden, intermediate_size=ffn,
                       num_layers=layers, num_heads=heads, num_kv_heads=LLAMA31_KV_HEADS, head_dim=hidden // heads,
                       rms_norm_eps=1e-5,
                       rope_theta=500000.0, rope_scaling=_LLAMA31_ROPE, max_position_embeddings=131072,
                       tie_word_embeddings=False, bos_token_id=128000, eos_token_ids=(128001, 128008, 128009))


PRESETS: dict[str, ModelConfig] = {
    **{name: _llama31(name) for name in LLAMA31},
    # CPU-sized: 4 layers, 8 query / 4 KV heads so TP 2, 4 and 8 (replicated KV) are all valid.
    "tiny": ModelConfig(name="tiny", vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=4,
                        num_heads=8, num_kv_heads=4, head_dim=16, rms_norm_eps=1e-5, rope_theta=500000.0,
                        rope_scaling=RopeScaling(8.0, 1.0, 4.0, 64), max_position_embeddings=4096,
                        bos_token_id=1, eos_token_ids=(2,)),
}

_PRESET_RE = re.compile(r"^(?P<name>[^:]+)(?::layers=(?P<layers>\d+))?$")


def preset(spec: str) -> ModelConfig:
    """`"llama3.1-70b"` or `"llama3.1-405b:layers=8"` (truncated, labelled as such)."""
    m = _PRESET_RE.match(spec)
    if m is None and spec.split(":", 1)[0] in PRESETS:
        raise ModelConfigError(f"{spec!r}: after the preset name write ':layers=N' with N a whole number of "
                               f"layers, e.g. '{spec.split(':', 1)[0]}:layers=2'")
    if m is None or m["name"] not in PRESETS:
        raise ModelConfigError(f"unknown preset {spec!r}; choose one of {', '.join(PRESETS)} "
                               "(optionally with ':layers=N' to keep N layers), or pass an HF checkpoint folder")
    cfg = PRESETS[m["name"]]
    if m["layers"] is not None:
        n = int(m["layers"])
        if not 1 <= n <= cfg.num_layers:
            raise ModelConfigError(f"{spec!r}: layers={n} must be between 1 and {cfg.num_layers}")
        cfg = cfg.with_layers(n)
        cfg = replace(cfg, name=spec) if cfg.truncated_from is not None else cfg
    return cfg


def resolve_model(spec: str) -> ModelConfig:
    """A preset name or an HF checkpoint directory."""
    path = os.path.expanduser(spec)
    if os.path.isdir(path):
        return ModelConfig.from_hf_config(path)
    if os.sep in spec or "/" in spec or spec.startswith((".", "~")) or (
            os.path.isfile(path) and spec.split(":", 1)[0] not in PRESETS):
        if os.path.isfile(path):
            raise ModelConfigError(f"{spec!r} is a file; --model takes the checkpoint folder that holds config.json "
                                   "and the safetensors, or a preset")
        raise ModelConfigError(f"no such checkpoint folder {spec!r}; pass an existing HF checkpoint folder (hub names "
                               f"are not downloaded) or a preset ({', '.join(PRESETS)})")
    return preset(spec)


# The model dtypes by name: spanllm.dtypes holds the one dtype table (the all-reduce library reads it too).
from spanllm.dtypes import MODEL_DTYPES as DTYPES  # noqa: E402
from spanllm.dtypes import model_dtype as parse_dtype  # noqa: E402


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
    # decode up to batch 16: "torch" = F.linear (cuBLAS), "skinny" = spanllm.engine.skinny_gemm (a Triton
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
    min_admit: int = 1  # admission batching (spanllm.engine.scheduler.SchedulerConfig.min_admit); 1 = off
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
            raise ValueError(f"max_num_batched_tokens={self.max_num_batched_tokens} is below max_num_seqs="
                             f"{self.max_num_seqs}: a step of decodes alone would not fit the budget and the newest "
                             "sequences would never decode; raise max_num_batched_tokens or lower max_num_seqs")
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
            raise ValueError(f"compile_backend={self.compile_backend!r} must be a torch.compile backend name "
                             "(inductor, aot_eager, eager)")
