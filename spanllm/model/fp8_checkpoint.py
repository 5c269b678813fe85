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
FP8_SAFETENSORS_DTYPE = "F8_E4M3"
USE_INSTEAD = "load the bf16 checkpoint with --quantization fp8 (quantized at load) instead"


class FP8CheckpointError(ValueError):
    """A quantization_config this engine cannot load as it is (raised as the model config's error)."""


@dataclass(frozen=True)
class FP8Checkpoint:
    """What the checkpoint holds: its method and how its weight scales are laid out."""

    method: str  # "compressed-tensors" or "fp8"
    weight_strategy: str  # "channel": one scale per output row; "tensor": one scale per weight

    def describe(self) -> str:
        return f"FP8 checkpoint ({self.method}, {self.weight_strategy} scales)"


def parse_quantization_config(qc: Any, where: str) -> FP8Checkpoint | None:
    """config.json's `quantization_config` (None: an unquantized checkpoint) -> FP8Checkpoint, or an
    FP8CheckpointError naming the field, its value and the fix."""
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise FP8CheckpointError(f"{where}: quantization_config={qc!r} must be an object")
    method = qc.get("quant_method")
    if method == "compressed-tensors":
        return _compressed_tensors(qc, where)
    if method == "fp8":
        return _vllm_fp8(qc, where)
    raise FP8CheckpointError(
        f"{where}: quantization_config.quant_method={method!r} is not supported; this engine loads FP8 checkpoints "
        f"('compressed-tensors' FP8-dynamic, or 'fp8' with dynamic activations); {USE_INSTEAD}"
    )


def _vllm_fp8(qc: dict, where: str) -> FP8Checkpoint:
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
    _only_lm_head_ignored(qc.get("ignored_layers") or qc.get("modules_to_not_convert") or [], where)
    return FP8Checkpoint("fp8", "tensor")


def _compressed_tensors(qc: dict, where: str) -> FP8Checkpoint:
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
    if not a or (a.get("num_bits"), a.get("type"), a.get("strategy"), a.get("dynamic")) != (8, "float", "token", True):
        raise FP8CheckpointError(
            f"{where}: {field}.input_activations={a!r}: the engine quantizes activations per token on the fly (8-bit "
            "float, strategy 'token', dynamic true, the FP8-dynamic scheme); a checkpoint with static activation "
            f"scales or with bf16 activations would not be run as it was calibrated; {USE_INSTEAD}"
        )
    if group.get("output_activations"):
        raise FP8CheckpointError(f"{where}: {field}.output_activations are not supported; {USE_INSTEAD}")
    _only_lm_head_ignored(qc.get("ignore") or [], where)
    return FP8Checkpoint("compressed-tensors", strategy)


def _only_lm_head_ignored(ignored: Any, where: str) -> None:
    others = [x for x in ignored if x != "lm_head"] if isinstance(ignored, list) else [ignored]
    if others:
        raise FP8CheckpointError(
            f"{where}: quantization_config leaves {others!r} unquantized; the engine runs every decoder linear layer "
            f"in FP8 (only lm_head stays in the model dtype); {USE_INSTEAD}"
        )


def scale_shapes(n: int, strategy: str) -> tuple[tuple[int, ...], ...]:
    """The shapes a weight's scale tensor may have in the checkpoint: [N, 1] or [N] (channel); [], [1] (tensor)."""
    return ((n, 1), (n,)) if strategy == "channel" else ((), (1,))
