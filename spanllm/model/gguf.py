"""GGUF checkpoints (llama.cpp's single-file format), read with the `gguf` package (the llama.cpp project's reader).

One file holds everything: the architecture and shapes as metadata (`llama.block_count`, ...), the tokenizer and
chat template (`tokenizer.ggml.*`, `tokenizer.chat_template`: loaded through transformers, see
spanllm.engine.tokenizer) and the tensors, each in its own type (F32, F16, BF16 or a block quantization).

- `config_from_gguf(path)`: the ModelConfig (its `checkpoint_dir` is the .gguf file itself);
- `check_gguf(cfg)`: every tensor the config implies present, with its shape and a supported type (metadata only,
  in the launching process);
- `GGUFCheckpointReader`: the reader `spanllm.model.loader.load_checkpoint` uses for a .gguf path. It answers the
  same HF tensor names and slices as the safetensors reader, so TP sharding follows the one `checkpoint_plan`.

Tensors are dequantized to float32 with `gguf.quants.dequantize`, then copied into the run's dtype. llama.cpp's
converter permutes the rows of q_proj / k_proj (its rotary pairs dimensions (2i, 2i+1), HF's (i, i + d/2));
`_unpermute_rope_rows` undoes it exactly as transformers' GGUF loader does (LlamaTensorProcessor).
"""

from __future__ import annotations

import functools
import os
import re

import numpy as np
import torch

from spanllm.errors import UsageError

GGUF_SUFFIX = ".gguf"
_BLOCK = re.compile(r"blk\.(\d+)\.")
SUPPORTED_ARCHITECTURES = ("llama",)
# The types the loader is tested on (tests/model/test_gguf_quants.py); the reader is gguf.quants.dequantize.
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")


class GGUFError(UsageError):
    """A GGUF file this engine cannot load: damaged, another architecture, an unsupported tensor type."""


def is_gguf(path: str | None) -> bool:
    return path is not None and path.lower().endswith(GGUF_SUFFIX) and os.path.isfile(path)


def open_gguf(path: str):
    """A gguf.GGUFReader over `path` (memory-mapped: no tensor is read yet), or one GGUFError line. Parsing the
    metadata takes seconds (a tokenizer's vocabulary and merges), so one process parses a file once."""
    st = os.stat(path)
    return _open_gguf(os.path.abspath(path), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=2)
def _open_gguf(path: str, size: int, mtime_ns: int):
    try:
        from gguf import GGUFReader
    except ImportError:
        raise GGUFError(f"{path}: reading GGUF files needs the gguf package: pip install gguf") from None
    try:
        reader = GGUFReader(path)
    except Exception as e:  # noqa: BLE001 - the reader raises ValueError, IndexError, struct/numpy errors
        raise GGUFError(
            f"{path}: not a readable GGUF file ({type(e).__name__}: {' '.join(str(e).split())[:160]}); it is "
            f"truncated or corrupted ({size} bytes): copy or download it again"
        ) from None
    for t in reader.tensors:
        # The reader slices the memory map; a short last tensor means the file was cut.
        if t.data_offset + int(t.n_bytes) > size or t.data.nbytes != int(t.n_bytes):
            raise GGUFError(
                f"{path}: truncated: tensor {t.name!r} needs bytes up to {t.data_offset + int(t.n_bytes)} but the "
                f"file has {size}; copy or download it again"
            )
    _check_layout(reader, path, size)
    return reader


def _check_layout(reader, path: str, size: int) -> None:
    """The tensors' data lie back to back in the order of their infos, each padded to the alignment, as llama.cpp
    writes them and requires ("tensor has offset X, expected Y"): a tensor's type or shape edited in the header
    changes its byte count, so its bytes would overlap the next tensor's or leave a gap, and the reader would
    dequantize the wrong bytes without a word."""
    align = int(reader.alignment)
    expected, before = 0, None
    for t in reader.tensors:
        offset = t.data_offset - reader.data_offset
        if offset != expected:
            prev = (
                f"the tensor before it, {before.name!r} ({before.tensor_type.name}, shape {_torch_shape(before)}), "
                f"ends at {expected}"
                if before is not None
                else "the first tensor starts at 0"
            )
            raise GGUFError(
                f"{path}: tensor {t.name!r} starts at data offset {offset}, but {prev}: a tensor's type or shape in "
                "the header does not match its data (the file is corrupted); copy or download it again"
            )
        expected += -(-int(t.n_bytes) // align) * align
        before = t
    if reader.tensors and size > reader.data_offset + expected:
        last = reader.tensors[-1]
        raise GGUFError(
            f"{path}: {size - reader.data_offset - expected} bytes follow the last tensor {last.name!r} "
            f"({last.tensor_type.name}, shape {_torch_shape(last)}), more than its padding: a tensor's type or shape "
            "in the header does not match its data (the file is corrupted); copy or download it again"
        )


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def _required(reader, path: str, key: str):
    v = _field(reader, key)
    if v is None:
        raise GGUFError(f"{path}: metadata key {key!r} is missing, which this engine needs; the file is incomplete")
    return v


def _typed(path: str, key: str, v, kind: type):
    """A metadata value of the kind the key holds (an integer for counts and ids, a number for floats): a list (a
    per-layer value), a string or a float where an integer belongs is refused, naming the key."""
    ok = isinstance(v, int) and not isinstance(v, bool)
    if kind is float:
        ok = ok or isinstance(v, float)
    if not ok:
        what = "one integer" if kind is int else "one number"
        per_layer = " (per-layer values are not supported)" if isinstance(v, list) else ""
        raise GGUFError(
            f"{path}: metadata key {key!r} = {str(v)[:80]} must be {what}{per_layer}; this engine cannot load the "
            "file as it is"
        )
    return kind(v)


def _check_unscaled_rope(reader, path: str, arch: str, tensors: dict) -> None:
    """The file's rope is the plain one the engine runs for GGUF files: no per-frequency factors, no scaling."""
    if "rope_freqs.weight" in tensors:
        raise GGUFError(
            f"{path}: holds rope_freqs.weight (per-frequency rope factors, Llama 3.1-style scaling), which this "
            "engine does not apply from GGUF files; use the HF checkpoint folder of this model instead"
        )
    scaling = _field(reader, f"{arch}.rope.scaling.type", "none")
    if scaling not in ("none", None):
        raise GGUFError(f"{path}: {arch}.rope.scaling.type={scaling!r} is not supported; only unscaled rope is")
    # llama.cpp scales the positions by a factor (its old key: rope.scale_linear) whatever the type says
    for k in (f"{arch}.rope.scaling.factor", f"{arch}.rope.scale_linear"):
        factor = _field(reader, k)
        if factor not in (None, 0, 1):
            raise GGUFError(
                f"{path}: {k}={factor} (rope positions scaled by 1/{factor}, as llama.cpp runs it) is not "
                "supported; only unscaled rope is (or Llama 3.1's, from the model's HF checkpoint folder)"
            )


def config_from_gguf(path: str, name: str | None = None):
    """The ModelConfig described by a GGUF file's metadata (architecture, shapes, rope, BOS/EOS)."""
    from spanllm.model.config import ModelConfig, ModelConfigError

    reader = open_gguf(path)
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise GGUFError(
            f"{path}: general.architecture={arch!r} is not supported; this engine builds "
            f"{', '.join(SUPPORTED_ARCHITECTURES)} (Llama-family) GGUF files only"
        )
    tensors = {t.name: t for t in reader.tensors}
    _check_unscaled_rope(reader, path, arch, tensors)

    def key(k, kind=int):
        return _typed(path, f"{arch}.{k}", _required(reader, path, f"{arch}.{k}"), kind)

    def optional(k, default, kind=int):
        v = _field(reader, k)
        return default if v is None else _typed(path, k, v, kind)

    experts = optional(f"{arch}.expert_count", 0)
    if experts:
        raise GGUFError(
            f"{path}: {arch}.expert_count={experts}: a mixture-of-experts model (Mixtral-style); this engine builds "
            "dense Llama models only"
        )
    hidden, heads = key("embedding_length"), key("attention.head_count")
    for k, v in (("embedding_length", hidden), ("attention.head_count", heads)):
        if v < 1:
            raise GGUFError(f"{path}: metadata {arch}.{k}={v} must be a positive integer; the file is corrupted")
    kv_heads = optional(f"{arch}.attention.head_count_kv", heads)
    head_dim = optional(f"{arch}.attention.key_length", hidden // heads)
    rot = optional(f"{arch}.rope.dimension_count", head_dim)
    if rot != head_dim:
        derived = _field(reader, f"{arch}.attention.key_length") is None
        raise GGUFError(
            f"{path}: rope.dimension_count={rot} differs from head_dim={head_dim} (partial rotary); not supported"
            + (
                f" (head_dim = {arch}.embedding_length {hidden} // {arch}.attention.head_count {heads}"
                + (", which does not divide it: is the head count corrupted?)" if hidden % heads else ")")
                if derived
                else ""
            )
        )
    if "token_embd.weight" not in tensors:
        raise GGUFError(f"{path}: no token_embd.weight tensor; the file is incomplete")
    # GGUF shapes are innermost-first: (hidden, vocab)
    vocab = optional(f"{arch}.vocab_size", int(tensors["token_embd.weight"].shape[-1]))
    eos_ids = []
    for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        v = optional(k, None)
        if v is not None and v not in eos_ids:
            eos_ids.append(v)
    bos = optional("tokenizer.ggml.bos_token_id", None)
    stem = os.path.basename(path)[: -len(GGUF_SUFFIX)]
    try:
        return ModelConfig(
            name=name or stem,
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=key("feed_forward_length"),
            num_layers=key("block_count"),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=key("attention.layer_norm_rms_epsilon", float),
            rope_theta=optional(f"{arch}.rope.freq_base", 10000.0, float),
            rope_scaling=None,
            max_position_embeddings=key("context_length"),
            tie_word_embeddings="output.weight" not in tensors,
            bos_token_id=bos,
            eos_token_ids=tuple(eos_ids),
            checkpoint_dir=os.path.abspath(path),
        )
    except ModelConfigError as e:
        raise GGUFError(f"{path}: {e}") from None


@functools.lru_cache(maxsize=4)
def _name_map(num_layers: int):
    from gguf import MODEL_ARCH, get_tensor_name_map

    return get_tensor_name_map(MODEL_ARCH.LLAMA, num_layers)


def gguf_tensor_name(hf_name: str, num_layers: int) -> str:
    """The GGUF name of an HF Llama tensor name (gguf's own name table: model.layers.3.mlp.up_proj.weight ->
    blk.3.ffn_up.weight)."""
    name = _name_map(num_layers).get_name(hf_name, try_suffixes=(".weight",))
    if name is None:
        raise GGUFError(f"no GGUF name for tensor {hf_name!r}")
    return name


def _torch_shape(t) -> tuple[int, ...]:
    """A GGUF tensor's shape in torch order (GGUF lists dimensions innermost first)."""
    return tuple(int(n) for n in reversed(t.shape.tolist()))


def check_gguf(cfg) -> None:
    """Every tensor `cfg` implies present in its GGUF file, with its shape and a supported type (metadata only)."""
    from spanllm.model.loader import expected_tensors

    path = cfg.checkpoint_dir
    tensors = {t.name: t for t in open_gguf(path).tensors}
    # the block count against the blocks present first: a corrupted count (up to 2**32) must not build its names
    blocks = {int(m.group(1)) for m in map(_BLOCK.match, tensors) if m}
    absent = next((i for i in range(min(cfg.num_layers, len(blocks) + 1)) if i not in blocks), None)
    if absent is not None:
        raise GGUFError(
            f"{path}: tensor 'blk.{absent}.attn_norm.weight' (model.layers.{absent}.input_layernorm.weight) is "
            f"missing ({len(tensors)} tensors present); the file is incomplete or its metadata does not match its "
            f"tensors (block_count={cfg.num_layers}, blocks present: {len(blocks)})"
        )
    expected = {gguf_tensor_name(n, cfg.num_layers): (n, shape) for n, shape in expected_tensors(cfg).items()}
    extra = sorted(set(tensors) - set(expected), key=lambda n: (n.startswith("blk."), n))
    if extra:
        beyond = [n for n in extra if (m := _BLOCK.match(n)) and int(m.group(1)) >= cfg.num_layers]
        why = (
            f"of a block past block_count={cfg.num_layers} (blocks 0 to {max(blocks)} are present)"
            if beyond
            else "which a Llama model of this engine has no place for (biases, other architectures' tensors)"
        )
        raise GGUFError(
            f"{path}: holds tensor {(beyond or extra)[0]!r} ({len(extra)} such tensor(s)), {why}; it would be "
            "ignored and the model run without it: the file's metadata and tensors disagree, or it is not a plain "
            "Llama model"
        )
    for name, (hf_name, shape) in expected.items():
        t = tensors.get(name)
        if t is None:
            raise GGUFError(
                f"{path}: tensor {name!r} ({hf_name}) is missing ({len(tensors)} tensors present); the file is "
                "incomplete or its metadata does not match its tensors"
            )
        if _torch_shape(t) != shape:
            raise GGUFError(
                f"{path}: tensor {name!r} has shape {_torch_shape(t)} but the metadata implies {shape}; the file's "
                "metadata and tensors disagree"
            )
        check_tensor_type(path, t)


def check_tensor_type(path: str, t) -> None:
    kind = t.tensor_type.name
    if kind not in SUPPORTED_TYPES:
        raise GGUFError(
            f"{path}: tensor {t.name!r} is of type {kind}, which this engine does not load; supported types: "
            f"{', '.join(SUPPORTED_TYPES)} (requantize the model with llama.cpp's llama-quantize to one of them)"
        )


def dequantize(t) -> np.ndarray:
    """A GGUF tensor as float32 in torch order (rows x cols)."""
    from gguf.quants import dequantize as gguf_dequantize

    return gguf_dequantize(t.data, t.tensor_type).reshape(_torch_shape(t)).astype(np.float32, copy=False)


def _unpermute_rope_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation: within each head, its rows are stored as (pair, 2) of HF's
    (2, d/2) halves (transformers' LlamaTensorProcessor._reverse_permute_weights)."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


class GGUFCheckpointReader:
    """The safetensors CheckpointReader's interface over one GGUF file: HF names in, row/column slices out."""

    def __init__(self, path: str, cfg) -> None:
        self.path = path
        self.cfg = cfg
        self._tensors = {t.name: t for t in open_gguf(path).tensors}

    def read(self, name: str, expected_shape: tuple[int, ...], dim: int, start: int, stop: int) -> torch.Tensor:
        cfg = self.cfg
        gname = gguf_tensor_name(name, cfg.num_layers)
        t = self._tensors.get(gname)
        if t is None:
            raise GGUFError(f"{self.path}: tensor {gname!r} ({name}) is missing; the file is incomplete")
        check_tensor_type(self.path, t)
        if _torch_shape(t) != tuple(expected_shape):
            raise GGUFError(
                f"{self.path}: tensor {gname!r} has shape {_torch_shape(t)} but the metadata implies "
                f"{tuple(expected_shape)}; the file's metadata and tensors disagree"
            )
        w = dequantize(t)
        if name.endswith("self_attn.q_proj.weight"):
            w = _unpermute_rope_rows(w, cfg.num_heads)
        elif name.endswith("self_attn.k_proj.weight"):
            w = _unpermute_rope_rows(w, cfg.num_kv_heads)
        w = w[start:stop] if dim == 0 else w[:, start:stop]
        return torch.from_numpy(np.array(w))  # a copy: the dequantized array may be a read-only view of the file

    def close(self) -> None:
        self._tensors.clear()
