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

import numpy as np
import torch

from spanllm.errors import UsageError

GGUF_SUFFIX = ".gguf"
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
    return reader


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
    if "rope_freqs.weight" in tensors:
        raise GGUFError(
            f"{path}: holds rope_freqs.weight (per-frequency rope factors, Llama 3.1-style scaling), which this "
            "engine does not apply from GGUF files; use the HF checkpoint folder of this model instead"
        )
    scaling = _field(reader, f"{arch}.rope.scaling.type", "none")
    if scaling not in ("none", None):
        raise GGUFError(f"{path}: {arch}.rope.scaling.type={scaling!r} is not supported; only unscaled rope is")

    def key(k):
        return _required(reader, path, f"{arch}.{k}")

    hidden, heads = int(key("embedding_length")), int(key("attention.head_count"))
    kv_heads = int(_field(reader, f"{arch}.attention.head_count_kv", heads))
    head_dim = int(_field(reader, f"{arch}.attention.key_length", hidden // heads))
    rot = int(_field(reader, f"{arch}.rope.dimension_count", head_dim))
    if rot != head_dim:
        raise GGUFError(
            f"{path}: rope.dimension_count={rot} differs from head_dim={head_dim} (partial rotary); not supported"
        )
    if "token_embd.weight" not in tensors:
        raise GGUFError(f"{path}: no token_embd.weight tensor; the file is incomplete")
    vocab = _field(reader, f"{arch}.vocab_size")
    if vocab is None:
        vocab = int(tensors["token_embd.weight"].shape[-1])  # GGUF shapes are innermost-first: (hidden, vocab)
    eos_ids = []
    for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        v = _field(reader, k)
        if v is not None and int(v) not in eos_ids:
            eos_ids.append(int(v))
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    stem = os.path.basename(path)[: -len(GGUF_SUFFIX)]
    try:
        return ModelConfig(
            name=name or stem,
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(key("feed_forward_length")),
            num_layers=int(key("block_count")),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(key("attention.layer_norm_rms_epsilon")),
            rope_theta=float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
            rope_scaling=None,
            max_position_embeddings=int(key("context_length")),
            tie_word_embeddings="output.weight" not in tensors,
            bos_token_id=None if bos is None else int(bos),
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
    for hf_name, shape in expected_tensors(cfg).items():
        name = gguf_tensor_name(hf_name, cfg.num_layers)
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
