"""The one table of dtype names: every spelling the CLI, the all-reduce library and the engine accept.

`DTYPE_NAMES` gives nccl-tests' name of each dtype we reduce (the `type` column of `spanllm bench allreduce`
and the key of tuning-table entries); `dtype_from_name` reads any spelling of those. `MODEL_DTYPES` is the
subset a model's weights and activations may use (the engine's `--dtype`), in the order the errors list it.
"""

from __future__ import annotations

import torch

DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float32: "float",
    torch.bfloat16: "bfloat16",
    torch.float16: "half",
    torch.int32: "int32",
    torch.float64: "double",
    torch.int64: "int64",
}

ALIASES: dict[str, str] = {
    "float32": "float",
    "fp32": "float",
    "bf16": "bfloat16",
    "fp16": "half",
    "float16": "half",
    "float64": "double",
    "fp64": "double",
    "int": "int32",
}
"""Other spellings -> the nccl-tests name."""

MODEL_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def dtype_from_name(name: str) -> torch.dtype:
    """Any spelling of a dtype we reduce ('bf16', 'bfloat16', 'float', 'fp32', ...) -> torch.dtype."""
    name = ALIASES.get(name, name)
    for dtype, n in DTYPE_NAMES.items():
        if n == name:
            return dtype
    raise ValueError(f"unknown dtype {name!r}; choose one of {sorted(DTYPE_NAMES.values())}")


def model_dtype(name: str | torch.dtype) -> torch.dtype:
    """A model dtype by name (MODEL_DTYPES), or a torch.dtype as given."""
    if isinstance(name, torch.dtype):
        return name
    if name not in MODEL_DTYPES:
        raise ValueError(f"dtype={name!r} is not supported; choose one of {', '.join(MODEL_DTYPES)}")
    return MODEL_DTYPES[name]
