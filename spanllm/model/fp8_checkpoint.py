"""Pre-quantized FP8 checkpoints: which `quantization_config` of a config.json this engine loads as it is.

The engine's FP8 (`--quantization fp8`, spanllm.layers.fp8) is e4m3 weights with one float32 scale per output
channel and activations quantized per token on the fly. A checkpoint stored that way loads without re-quantizing:

- compressed-tensors (the layout of Hugging Face's "FP8-dynamic" Llama checkpoints, e.g. llm-compressor's FP8_DYNAMIC
  scheme): `quant_method: "compressed-tensors"`, format float-quantized or naive-quantized, one config group targeting
  Linear with 8-bit float symmetric weights, strategy "channel" (scale [N, 1]) or "tensor" (one scale, spread to
  every row: the same values), and dynamic per-token 8-bit float input activations; "ignore" may name lm_head only;
- vLLM's / transformers' `quant_method: "fp8"` with `activation_scheme: "dynamic"` and no block size: a per-tensor
  scale per weight.

Each quantized linear weight `<module>.weight` (F8_E4M3) comes with `<module>.weight_scale`. Everything else is
refused here, naming what the checkpoint asks for: static activation scales (`input_scale`: the engine quantizes
activations per token, and would not honour them), block-wise or group-wise weight scales, other bit widths,
integer quantization, layers left unquantized other than the LM head.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

LINEAR_WEIGHTS = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)
SCALE_SUFFIX = "_scale"  # <module>.weight -> <module>.weight_scale
# the decoder layers an ignore list's regex is matched against: more than any model has, few enough to match fast
REGEX_LAYERS = 100_000
FP8_SAFETENSORS_DTYPE = "F8_E4M3"
USE_INSTEAD = "load the bf16 checkpoint with --quantization fp8 (quantized at load) instead"


class FP8CheckpointError(ValueError):
    """A quantization_config this engine cannot load as it is (raised as the model config's error)."""


@dataclass(frozen=True)
class FP8Checkpoint:
    """What the checkpoint holds: its method and how its weight scales are laid out."""

    method: str  # "compressed-tensors" or "fp8"
    weight_strategy: str  # "channel": one scale per output row; "tensor": one scale per weight
    # The checkpoint also calibrated an FP8 KV cache (kv_cache_scheme); its scales are not applied: the engine keeps
    # K/V in the model dtype (more precise, twice the memory) or, with --kv-cache-dtype fp8, in e4m3 with scale 1;
    # its description says which
    kv_cache_scheme_unused: bool = False

    def describe(self, kv_fp8: bool = False) -> str:
        where = "e4m3 with scale 1 (--kv-cache-dtype fp8)" if kv_fp8 else "the model dtype"
        kv = f"; its kv_cache_scheme's scales not applied: K/V in {where}" if self.kv_cache_scheme_unused else ""
        return f"FP8 checkpoint ({self.method}, {self.weight_strategy} scales{kv})"


def parse_quantization_config(qc: Any, where: str, num_layers: int = 1) -> FP8Checkpoint | None:
    """config.json's `quantization_config` (None: an unquantized checkpoint) -> FP8Checkpoint, or an
    FP8CheckpointError naming the field, its value and the fix. num_layers: the decoder layers (regex entries of an
    ignore list are matched against their linear layers' names)."""
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise FP8CheckpointError(f"{where}: quantization_config={qc!r} must be an object")
    method = qc.get("quant_method")
    try:
        if method == "compressed-tensors":
            ckpt = _compressed_tensors(qc, where, num_layers)
        elif method == "fp8":
            ckpt = _vllm_fp8(qc, where, num_layers)
        else:
            ckpt = None
    except (AttributeError, TypeError, KeyError) as e:  # a field of the wrong type
        raise FP8CheckpointError(
            f"{where}: quantization_config is malformed ({type(e).__name__}: {e}) in {_groups_repr(qc)}; restore the "
            f"checkpoint's config.json, or {USE_INSTEAD}"
        ) from None
    if ckpt is not None:
        if qc.get("kv_cache_scheme"):
            ckpt = FP8Checkpoint(ckpt.method, ckpt.weight_strategy, kv_cache_scheme_unused=True)
        return ckpt
    raise FP8CheckpointError(
        f"{where}: quantization_config.quant_method={method!r} is not supported; this engine loads FP8 checkpoints "
        f"('compressed-tensors' FP8-dynamic, or 'fp8' with dynamic activations); {USE_INSTEAD}"
    )


def _groups_repr(qc: dict) -> str:
    return f"config_groups={qc.get('config_groups')!r}"[:300]


def _vllm_fp8(qc: dict, where: str, num_layers: int) -> FP8Checkpoint:
    scheme = qc.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise FP8CheckpointError(
            f"{where}: quantization_config.activation_scheme={scheme!r}: static activation scales are not supported "
            f"(the engine quantizes activations per token); {USE_INSTEAD}"
        )
    if qc.get("weight_block_size"):
        raise FP8CheckpointError(
            f"{where}: quantization_config.weight_block_size={qc['weight_block_size']!r}: block-wise weight scales are "
            f"not supported (per-channel or per-tensor only); {USE_INSTEAD}"
        )
    for key in ("ignored_layers", "modules_to_not_convert"):
        _only_lm_head_ignored(qc.get(key) or [], where, num_layers, key)
    return FP8Checkpoint("fp8", "tensor")


def _compressed_tensors(qc: dict, where: str, num_layers: int) -> FP8Checkpoint:
    if qc.get("transform_config"):
        raise FP8CheckpointError(
            f"{where}: quantization_config.transform_config is set (rotations such as SpinQuant / QuIP, some applied "
            f"to activations at run time): not supported; {USE_INSTEAD}"
        )
    sparsity = qc.get("sparsity_config") or {}
    if not isinstance(sparsity, dict) or sparsity.get("format", "dense") not in (None, "dense"):
        raise FP8CheckpointError(
            f"{where}: quantization_config.sparsity_config={sparsity!r}: compressed sparse weights are not supported "
            f"(only 'dense'); {USE_INSTEAD}"
        )
    fmt = qc.get("format")
    if fmt not in ("float-quantized", "naive-quantized"):
        raise FP8CheckpointError(
            f"{where}: compressed-tensors format={fmt!r} is not supported; FP8 weights stored as float8_e4m3fn "
            f"('float-quantized' or 'naive-quantized') load as they are; {USE_INSTEAD}"
        )
    groups = qc.get("config_groups") or {}
    if not isinstance(groups, dict) or len(groups) != 1:
        raise FP8CheckpointError(
            f"{where}: compressed-tensors config_groups has {len(groups) if isinstance(groups, dict) else groups!r} "
            f"groups; one group quantizing every Linear layer is supported; {USE_INSTEAD}"
        )
    ((name, group),) = groups.items()
    field = f"config_groups.{name}"
    if not isinstance(group, dict):
        raise FP8CheckpointError(f"{where}: {field}={group!r} must be an object; {USE_INSTEAD}")
    if group.get("format", fmt) != fmt:
        raise FP8CheckpointError(
            f"{where}: {field}.format={group.get('format')!r} differs from the checkpoint's format={fmt!r}; "
            f"{USE_INSTEAD}"
        )
    targets = group.get("targets")
    if targets != ["Linear"]:
        raise FP8CheckpointError(f"{where}: {field}.targets={targets!r}; ['Linear'] is supported; {USE_INSTEAD}")
    w = group.get("weights") or {}
    if (w.get("num_bits"), w.get("type"), w.get("symmetric", True)) != (8, "float", True):
        raise FP8CheckpointError(
            f"{where}: {field}.weights={w!r}: 8-bit float symmetric weights are supported; {USE_INSTEAD}"
        )
    strategy = w.get("strategy")
    if strategy not in ("channel", "tensor") or w.get("dynamic"):
        raise FP8CheckpointError(
            f"{where}: {field}.weights.strategy={strategy!r} (dynamic={w.get('dynamic')!r}): static 'channel' or "
            f"'tensor' scales are supported (not group- or block-wise); {USE_INSTEAD}"
        )
    a = group.get("input_activations")
    wanted = (8, "float", "token", True, True)
    if (
        not a
        or (a.get("num_bits"), a.get("type"), a.get("strategy"), a.get("dynamic"), a.get("symmetric", True)) != wanted
    ):
        raise FP8CheckpointError(
            f"{where}: {field}.input_activations={a!r}: the engine quantizes activations per token on the fly (8-bit "
            "float, strategy 'token', dynamic true, symmetric, the FP8-dynamic scheme); a checkpoint with static "
            f"activation scales or with bf16 activations would not be run as it was calibrated; {USE_INSTEAD}"
        )
    if group.get("output_activations"):
        raise FP8CheckpointError(f"{where}: {field}.output_activations are not supported; {USE_INSTEAD}")
    ignore = qc.get("ignore") or []
    ignore = ignore if isinstance(ignore, list) else [ignore]  # one name as a string: a list of it
    _only_lm_head_ignored(ignore, where, num_layers, "ignore")
    if not any(_names_lm_head(x) for x in ignore):
        # targets ['Linear'] covers the LM head unless it is ignored: the engine keeps it in the model dtype
        raise FP8CheckpointError(
            f"{where}: quantization_config.ignore={ignore!r} does not name lm_head, so the checkpoint's LM head is "
            f"quantized too; the engine runs the LM head in the model dtype only; {USE_INSTEAD}"
        )
    return FP8Checkpoint("compressed-tensors", strategy)


def _names_lm_head(entry: Any) -> bool:
    if entry == "lm_head":
        return True
    return isinstance(entry, str) and entry.startswith("re:") and _regex_matches(entry[3:], "lm_head")


def _regex_matches(pattern: str, name: str) -> bool:
    try:
        return re.match(pattern, name) is not None
    except re.error:
        return False


def _only_lm_head_ignored(ignored: Any, where: str, num_layers: int, key: str) -> None:
    """Every entry of an ignore list names the LM head and no decoder linear layer (a 're:' entry is a regex)."""
    entries = ignored if isinstance(ignored, list) else [ignored]
    others = []
    for x in entries:
        if not isinstance(x, str):
            others.append(x)
        elif x.startswith("re:"):
            # the decoder's names only for a regex (lazily), of at most REGEX_LAYERS layers: a corrupted count such as
            # 10**9 would take hours here, and the checkpoint check refuses it (no checkpoint holds those layers)
            layers = range(max(1, min(num_layers, REGEX_LAYERS)))
            decoder = (f"model.layers.{i}.{m}" for i in layers for m in LINEAR_WEIGHTS)
            if not _names_lm_head(x) or any(_regex_matches(x[3:], n) for n in decoder):
                others.append(x)
        elif x != "lm_head":
            others.append(x)
    if others:
        raise FP8CheckpointError(
            f"{where}: quantization_config.{key} leaves {others!r} unquantized; the engine runs every decoder linear "
            f"layer in FP8 (only lm_head stays in the model dtype); {USE_INSTEAD}"
        )


def scale_shapes(n: int, strategy: str) -> tuple[tuple[int, ...], ...]:
    """The shapes a weight's scale tensor may have in the checkpoint: [N, 1] or [N] (channel); [], [1] (tensor)."""
    return ((n, 1), (n,)) if strategy == "channel" else ((), (1,))
