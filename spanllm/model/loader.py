"""Weights: HF safetensors (one file or a sharded index) or a GGUF file (spanllm.model.gguf: same names, same
plan), each rank reading only its shard; or seeded random values generated on the device (for benchmarks with
preset shapes).

Checkpoint reading uses `safe_open(...).get_slice(name)[rows]`, so a rank touches only the bytes of
its own rows / columns. The fused parameters are filled piecewise: qkv_proj from q_proj, k_proj and
v_proj; gate_up_proj from gate_proj and up_proj.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass

import torch

from spanllm.errors import UsageError
from spanllm.layers.linear import linear_layers
from spanllm.layers.vocab import ParallelLMHead, VocabParallelEmbedding
from spanllm.model.fp8_checkpoint import FP8_SAFETENSORS_DTYPE, LINEAR_WEIGHTS, SCALE_SUFFIX, scale_shapes
from spanllm.model.gguf import GGUFCheckpointReader, check_gguf, is_gguf
from spanllm.model.llama import LlamaDecoderLayer, LlamaForCausalLM

INDEX_FILE = "model.safetensors.index.json"
_LAYER = re.compile(r"model\.layers\.(\d+)\.")
# safetensors dtypes of unquantized weights: copied into the run's dtype
WEIGHT_DTYPES = ("BF16", "F16", "F32", "F64")
SCALE_DTYPES = ("F32", "BF16", "F16")
FP8_TORCH_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
SINGLE_FILE = "model.safetensors"


class CheckpointError(UsageError):
    """A checkpoint that does not match the model built from its config (a ValueError; CLI exit code 2)."""


# --- checks before any rank starts: file names, headers and shapes, no weights read ------------------------
def expected_tensors(cfg) -> dict[str, tuple[int, ...]]:
    """Every tensor name an HF Llama checkpoint of `cfg` holds, with its full shape (as checkpoint_plan reads)."""
    h, d, ffn = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q, kv = cfg.num_heads * d, cfg.num_kv_heads * d
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, h), "model.norm.weight": (h,)}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        out.update(
            {
                p + "input_layernorm.weight": (h,),
                p + "post_attention_layernorm.weight": (h,),
                p + "self_attn.q_proj.weight": (q, h),
                p + "self_attn.k_proj.weight": (kv, h),
                p + "self_attn.v_proj.weight": (kv, h),
                p + "self_attn.o_proj.weight": (h, q),
                p + "mlp.gate_proj.weight": (ffn, h),
                p + "mlp.up_proj.weight": (ffn, h),
                p + "mlp.down_proj.weight": (h, ffn),
            }
        )
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = (cfg.vocab_size, h)
    return out


def read_safetensors_header(path: str) -> dict[str, dict]:
    """The tensor table of a safetensors file (name -> dtype, shape, data_offsets), after checking that the
    file holds every byte its header describes (a truncated copy fails here, naming the file)."""
    fix = "copy or download the file again"
    if not os.path.isfile(path):
        raise CheckpointError(f"{path}: no such file, though the checkpoint lists it; copy the whole checkpoint folder")
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(
                f"{path}: {size} bytes, too short for a safetensors header; the file is truncated: {fix}"
            )
        n = int.from_bytes(head, "little")
        if n > size - 8:
            raise CheckpointError(
                f"{path}: its header claims {n} bytes but the file has {size}; the file is truncated "
                f"or not safetensors: {fix}"
            )
        try:
            header = json.loads(f.read(n))
            tensors = {k: v for k, v in header.items() if k != "__metadata__"}
            spans = [(int(v["data_offsets"][0]), int(v["data_offsets"][1])) for v in tensors.values()]
            end = max((stop for _, stop in spans), default=0)
        except (ValueError, UnicodeDecodeError, KeyError, TypeError, IndexError, AttributeError):
            raise CheckpointError(f"{path}: the safetensors header is damaged: {fix}") from None
    if size < 8 + n + end:
        raise CheckpointError(
            f"{path}: truncated: the file has {size} bytes, its header describes {8 + n + end}; {fix}"
        )
    _check_safetensors_layout(path, tensors, size - 8 - n, fix)
    return tensors


# bits per element of safetensors' dtypes (its Dtype::bitsize)
_SAFETENSORS_BITS = {
    **dict.fromkeys(("BOOL", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E8M0"), 8),
    **dict.fromkeys(("I16", "U16", "F16", "BF16"), 16),
    **dict.fromkeys(("I32", "U32", "F32"), 32),
    **dict.fromkeys(("I64", "U64", "F64", "C64"), 64),
    "F4": 4,
    "F6_E2M3": 6,
    "F6_E3M2": 6,
}


def _check_safetensors_layout(path: str, tensors: dict, data_bytes: int, fix: str) -> None:
    """What safetensors checks when a rank opens the file (its header's tensors back to back from byte 0, each as
    many bytes as its shape and dtype make, covering the data exactly), here in the launching process: an edited
    shape or offset fails naming the tensor, not as a rank's SafetensorError traceback after the launch."""
    pos = 0
    for name, info in sorted(tensors.items(), key=lambda kv: (int(kv[1]["data_offsets"][0]), kv[0])):
        start, stop = (int(x) for x in info["data_offsets"])
        shape, dtype = info.get("shape"), info.get("dtype")
        bits = _SAFETENSORS_BITS.get(dtype)
        if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
            raise CheckpointError(
                f"{path}: the safetensors header is damaged: tensor {name!r} has shape {shape!r}; {fix}"
            )
        need = None if bits is None else -(-math.prod(shape) * bits // 8)
        if start != pos or stop < start or (need is not None and stop - start != need):
            size = f": {need} bytes" if need is not None else ""
            raise CheckpointError(
                f"{path}: the safetensors header is damaged: tensor {name!r} ({dtype}, shape {tuple(shape)}{size}) "
                f"takes bytes [{start}, {stop}) of the data, and the tensors before it end at {pos}; {fix}"
            )
        pos = stop
    if pos != data_bytes:
        raise CheckpointError(
            f"{path}: the safetensors header is damaged: its tensors cover {pos} bytes of data, and the file holds "
            f"{data_bytes} (safetensors refuses bytes no tensor covers); {fix}"
        )


def check_checkpoint(cfg) -> None:
    """Every file of the checkpoint folder present and whole, every tensor the config implies there with its
    shape. Reads only headers (safetensors' JSON table, GGUF metadata), so it runs in the launching process."""
    directory = cfg.checkpoint_dir
    if is_gguf(directory):
        return check_gguf(cfg)
    index = os.path.join(directory, INDEX_FILE)
    if os.path.isfile(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
            files = sorted(set(weight_map.values()))
        except (ValueError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(
                f"{index}: not a safetensors index ({type(e).__name__}: {e}); it needs a "
                "'weight_map' of tensor name -> file"
            ) from None
    elif os.path.isfile(os.path.join(directory, SINGLE_FILE)):
        files, weight_map = [SINGLE_FILE], None
    else:
        raise CheckpointError(
            f"{directory!r} has neither {SINGLE_FILE} nor {INDEX_FILE}; save the model with "
            "save_pretrained(..., safe_serialization=True)"
        )
    found: dict[str, tuple[str, tuple[int, ...]]] = {}
    dtypes: dict[str, str | None] = {}
    for fname in files:
        path = os.path.join(directory, fname)
        if not os.path.isfile(path):
            raise CheckpointError(
                f"{index}: lists {fname}, which is missing from {directory}; copy the whole checkpoint folder"
            )
        for name, info in read_safetensors_header(path).items():
            # the loader finds a tensor through the index: only where the index says it is does it count
            if weight_map is None or weight_map.get(name) == fname:
                found[name] = (path, tuple(info.get("shape", ())))
                dtypes[name] = info.get("dtype")
    where = index if weight_map is not None else None
    # the layer count against the layers present first: a corrupted count must not build its names (it would hang)
    layers = {int(m.group(1)) for m in map(_LAYER.match, found) if m}
    absent = next((i for i in range(min(cfg.num_layers, len(layers) + 1)) if i not in layers), None)
    if absent is not None:
        raise CheckpointError(
            _missing(f"model.layers.{absent}.input_layernorm.weight", directory, len(found), where)
            + f" (config.json: num_hidden_layers={cfg.num_layers}; layers present: {len(layers)})"
        )
    fp8_weights = {f"model.layers.{i}.{m}.weight" for i in range(cfg.num_layers) for m in LINEAR_WEIGHTS}
    for name, dtype in dtypes.items():
        if str(dtype).startswith("F8") and (cfg.fp8_checkpoint is None or name not in fp8_weights):
            why = (
                "config.json has no quantization_config saying how (its scales would be ignored)"
                if cfg.fp8_checkpoint is None
                else "the engine keeps everything but the decoder's linear layers in the model dtype"
            )
            raise CheckpointError(
                f"tensor {name!r} in {directory!r} is {dtype} (FP8), but {why}; use an FP8 checkpoint with its "
                "quantization_config (compressed-tensors FP8-dynamic), or the bf16 original with --quantization fp8"
            )
    if cfg.fp8_checkpoint is not None:
        _check_fp8_tensors(cfg, directory, found, dtypes)
    expected = expected_tensors(cfg)
    for name, shape in expected.items():
        if name not in found:
            raise CheckpointError(_missing(name, directory, len(found), where))
        path, have = found[name]
        if have != shape:
            raise CheckpointError(
                f"{path}: tensor {name!r} has shape {have} but config.json implies {shape}; the "
                "checkpoint and config.json disagree"
            )
        dtype = dtypes.get(name)
        if dtype not in WEIGHT_DTYPES and not str(dtype).startswith("F8"):  # FP8: checked above
            raise CheckpointError(
                f"{path}: tensor {name!r} is {dtype}; the engine loads floating-point weights "
                f"({', '.join(WEIGHT_DTYPES)}), and a cast of {dtype} values would run other weights than the "
                "checkpoint's: an integer-quantized checkpoint is not supported (FP8 ones load with their "
                "quantization_config), else the file is damaged: copy or download it again"
            )
    _check_unused_tensors(cfg, directory, found, expected, fp8_weights)


def _check_unused_tensors(cfg, directory: str, found: dict, expected: dict, fp8_weights: set) -> None:
    """Every tensor of the checkpoint is one the model loads: a bias or a layer past num_hidden_layers would be
    ignored, and the engine would run another model than the checkpoint's."""
    allowed = set(expected)
    if cfg.tie_word_embeddings:
        # fine-tuning tools may save the tied head beside the embedding: the head is the embedding all the same, and
        # vLLM skips the copy too (vllm-project/vllm#6758)
        allowed.add("lm_head.weight")
    if cfg.fp8_checkpoint is not None:
        allowed |= {n + SCALE_SUFFIX for n in fp8_weights}
        if cfg.fp8_checkpoint.kv_cache_scheme_unused:  # named in the engine's description as not applied
            allowed |= {f"model.layers.{i}.self_attn.{kv}_scale" for i in range(cfg.num_layers) for kv in "kv"}
    # rotary_emb.inv_freq: a buffer older transformers saved, computed from config.json all the same
    unused = sorted(n for n in found if n not in allowed and not n.endswith(".rotary_emb.inv_freq"))
    if not unused:
        return
    past = [n for n in unused if (m := _LAYER.match(n)) and int(m.group(1)) >= cfg.num_layers]
    name = (past or unused)[0]
    why = (
        f"of a layer past config.json's num_hidden_layers={cfg.num_layers}"
        if past
        else "which the model config.json describes has no place for (this engine builds bias-free Llama models; "
        "FP8 checkpoints: weight scales only, no static input scales)"
    )
    raise CheckpointError(
        f"{found[name][0]}: holds tensor {name!r} ({len(unused)} tensor(s) the model would not load), {why}; it "
        "would be ignored and another model run than the checkpoint's: config.json does not match the weights"
    )


def _missing(name: str, directory: str, present: int, index: str | None) -> str:
    where = f" where {index} maps it" if index else ""
    return (
        f"tensor {name!r} is missing from the checkpoint in {directory!r}{where} ({present} tensors found); does "
        "config.json match the weights (and the index its shards)?"
    )


def _check_fp8_tensors(cfg, directory: str, found: dict, dtypes: dict) -> None:
    """An FP8 checkpoint (config.json's quantization_config): every decoder linear weight stored as F8_E4M3, with
    its scale tensor of the shape the scheme implies."""
    strategy = cfg.fp8_checkpoint.weight_strategy
    shapes = expected_tensors(cfg)
    for i in range(cfg.num_layers):
        for mod in LINEAR_WEIGHTS:
            name = f"model.layers.{i}.{mod}.weight"
            if name in dtypes and dtypes[name] != FP8_SAFETENSORS_DTYPE:
                raise CheckpointError(
                    f"tensor {name!r} is {dtypes[name]} in {directory!r}, but config.json's quantization_config says "
                    f"the linear weights are FP8 ({FP8_SAFETENSORS_DTYPE}); the checkpoint and its config disagree"
                )
            scale = name + SCALE_SUFFIX
            if scale in dtypes and dtypes[scale] not in SCALE_DTYPES:
                raise CheckpointError(
                    f"tensor {scale!r} is {dtypes[scale]}; FP8 weight scales are floating point "
                    f"({', '.join(SCALE_DTYPES)}): the checkpoint is damaged or not an FP8 checkpoint"
                )
            if scale not in found:
                raise CheckpointError(
                    f"tensor {scale!r} is missing from the FP8 checkpoint in {directory!r} (each FP8 weight needs its "
                    "scale), or the index does not map it to the shard that holds it; copy the whole checkpoint folder"
                )
            allowed = scale_shapes(shapes[name][0], strategy)
            if found[scale][1] not in allowed:
                raise CheckpointError(
                    f"tensor {scale!r} has shape {found[scale][1]}; {strategy} scales imply one of {list(allowed)}: "
                    "the checkpoint and its quantization_config disagree"
                )


class CheckpointReader:
    """Name -> file map over an HF checkpoint directory; slices are read lazily."""

    def __init__(self, directory: str) -> None:
        from safetensors import safe_open  # optional dependency: only checkpoint loading needs it

        self._safe_open = safe_open
        self.directory = directory
        index = os.path.join(directory, INDEX_FILE)
        single = os.path.join(directory, SINGLE_FILE)
        if os.path.isfile(index):
            try:
                with open(index) as f:
                    self.weight_map: dict[str, str] = json.load(f)["weight_map"]
            except (ValueError, KeyError, TypeError) as e:
                raise CheckpointError(f"{index}: not a safetensors index ({type(e).__name__}: {e})") from None
        elif os.path.isfile(single):
            self.weight_map = {k: SINGLE_FILE for k in read_safetensors_header(single)}
        else:
            raise CheckpointError(
                f"{directory!r} has neither {SINGLE_FILE} nor {INDEX_FILE}; save the model with "
                "save_pretrained(..., safe_serialization=True)"
            )
        self._handles: dict[str, object] = {}

    def _file(self, name: str):
        if name not in self.weight_map:
            raise CheckpointError(
                f"tensor {name!r} is missing from the checkpoint in {self.directory!r} "
                f"({len(self.weight_map)} tensors present); does config.json match the weights?"
            )
        fname = self.weight_map[name]
        if fname not in self._handles:
            path = os.path.join(self.directory, fname)
            read_safetensors_header(path)  # a missing or truncated file names itself
            self._handles[fname] = self._safe_open(path, framework="pt")
        return self._handles[fname]

    def read(self, name: str, expected_shape: tuple[int, ...], dim: int, start: int, stop: int) -> torch.Tensor:
        """Rows (dim 0) or columns (dim 1) [start, stop) of tensor `name`, after checking its full shape."""
        sl = self._file(name).get_slice(name)
        shape = tuple(sl.get_shape())
        if shape != tuple(expected_shape):
            raise CheckpointError(
                f"tensor {name!r} has shape {shape} in the checkpoint but the config implies "
                f"{tuple(expected_shape)}; the checkpoint and config.json disagree"
            )
        if dim == 0:
            return sl[start:stop]
        return sl[:, start:stop]

    def read_scale(self, name: str, n: int, strategy: str) -> torch.Tensor:
        """An FP8 weight's scale tensor `name` as float32 [n] (a per-tensor scale repeated on every row)."""
        t = self._file(name).get_tensor(name)
        if tuple(t.shape) not in scale_shapes(n, strategy):
            raise CheckpointError(
                f"tensor {name!r} has shape {tuple(t.shape)}; config.json's {strategy} scales imply one of "
                f"{list(scale_shapes(n, strategy))}: the checkpoint and its quantization_config disagree"
            )
        t = t.float().reshape(-1)
        bad = ~(torch.isfinite(t) & (t > 0))
        if bad.any():  # a NaN / inf / zero / negative scale would silently poison or zero its rows
            i = int(bad.nonzero()[0])
            raise CheckpointError(
                f"tensor {name!r}: scale [{i}] = {float(t[i])}; FP8 weight scales must be finite and > 0: the "
                "checkpoint is damaged: copy or download it again (or load its bf16 original with --quantization fp8)"
            )
        return t.expand(n) if strategy == "tensor" else t

    def close(self) -> None:
        for h in self._handles.values():
            h.__exit__(None, None, None)
        self._handles.clear()


@dataclass(frozen=True)
class _Piece:
    """Copy rows/cols [start, stop) along `dim` of checkpoint tensor `name` into rows [offset, ...) of a param."""

    name: str
    full_shape: tuple[int, ...]
    dim: int
    start: int
    stop: int
    offset: int = 0


def _layer_pieces(layer: LlamaDecoderLayer, hidden: int, heads: int, kv_heads: int, ffn: int):
    p = f"model.layers.{layer.layer_id}."
    qkv = layer.self_attn.qkv_proj
    d = qkv.head_dim
    q0, kv0 = qkv.q_head_start * d, qkv.kv_head_start * d
    yield layer.input_layernorm.weight, [_Piece(p + "input_layernorm.weight", (hidden,), 0, 0, hidden)]
    yield (
        layer.post_attention_layernorm.weight,
        [_Piece(p + "post_attention_layernorm.weight", (hidden,), 0, 0, hidden)],
    )
    yield (
        qkv.weight,
        [
            _Piece(p + "self_attn.q_proj.weight", (heads * d, hidden), 0, q0, q0 + qkv.q_size, 0),
            _Piece(p + "self_attn.k_proj.weight", (kv_heads * d, hidden), 0, kv0, kv0 + qkv.kv_size, qkv.q_size),
            _Piece(
                p + "self_attn.v_proj.weight",
                (kv_heads * d, hidden),
                0,
                kv0,
                kv0 + qkv.kv_size,
                qkv.q_size + qkv.kv_size,
            ),
        ],
    )
    o = layer.self_attn.o_proj
    yield o.weight, [_Piece(p + "self_attn.o_proj.weight", (hidden, heads * d), 1, o.in_start, o.in_start + o.in_local)]
    gu = layer.mlp.gate_up_proj
    f0, fl = gu.start, gu.intermediate_local
    yield (
        gu.weight,
        [
            _Piece(p + "mlp.gate_proj.weight", (ffn, hidden), 0, f0, f0 + fl, 0),
            _Piece(p + "mlp.up_proj.weight", (ffn, hidden), 0, f0, f0 + fl, fl),
        ],
    )
    dn = layer.mlp.down_proj
    yield dn.weight, [_Piece(p + "mlp.down_proj.weight", (hidden, ffn), 1, dn.in_start, dn.in_start + dn.in_local)]


def _vocab_piece(mod: VocabParallelEmbedding, name: str, hidden: int) -> _Piece:
    return _Piece(name, (mod.vocab_size, hidden), 0, mod.vocab_start, mod.vocab_stop)


def checkpoint_plan(model: LlamaForCausalLM):
    """(parameter, pieces) for every parameter this stage holds."""
    cfg = model.config
    h = cfg.hidden_size
    emb = model.model.embed_tokens
    if emb is not None:
        yield emb.weight, [_vocab_piece(emb, "model.embed_tokens.weight", h)]
    for layer in model.model.layers.values():
        yield from _layer_pieces(layer, h, cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size)
    if model.model.norm is not None:
        yield model.model.norm.weight, [_Piece("model.norm.weight", (h,), 0, 0, h)]
    head: ParallelLMHead | None = model.lm_head
    if head is not None and not (emb is not None and head.weight is emb.weight):
        name = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
        yield head.weight, [_vocab_piece(head, name, h)]


@torch.no_grad()
def load_checkpoint(model: LlamaForCausalLM, directory: str) -> None:
    """Fill this stage's shard of every parameter from an HF safetensors checkpoint folder or a GGUF file."""
    reader = GGUFCheckpointReader(directory, model.config) if is_gguf(directory) else CheckpointReader(directory)
    fp8 = model.config.fp8_checkpoint
    # FP8 checkpoints: the linears hold float8 weights and float32 scales already (TPContext.fp8_weights), filled here
    scaled = {id(m.weight): m for m in linear_layers(model)} if fp8 is not None else {}
    try:
        for param, pieces in checkpoint_plan(model):
            if pieces[0].name in ("model.embed_tokens.weight", "lm_head.weight"):
                param.zero_()  # padding rows past the vocabulary stay zero
            for pc in pieces:
                t = reader.read(pc.name, pc.full_shape, pc.dim, pc.start, pc.stop)
                if not t.is_floating_point():  # an integer or bool tensor: a cast would load other weights
                    raise CheckpointError(
                        f"tensor {pc.name!r} is {t.dtype} in the checkpoint; the engine loads floating-point "
                        "weights (an integer-quantized checkpoint is not supported), else the file is damaged"
                    )
                if (t.dtype in FP8_TORCH_DTYPES) != (param.dtype in FP8_TORCH_DTYPES) or (
                    param.dtype in FP8_TORCH_DTYPES and t.dtype != param.dtype
                ):
                    # never a cast between FP8 and anything else: it would drop (or apply twice) the scales
                    raise CheckpointError(
                        f"tensor {pc.name!r} is {t.dtype} in the checkpoint, where this model expects "
                        f"{'float8_e4m3fn' if param.dtype in FP8_TORCH_DTYPES else 'unquantized weights'} (config.json"
                        f"{' has no' if fp8 is None else chr(39) + 's'} quantization_config); the checkpoint and its "
                        "config disagree"
                    )
                if param.dim() == 1:
                    param.copy_(t)
                elif pc.dim == 0:
                    param[pc.offset : pc.offset + t.shape[0]].copy_(t)
                else:
                    param.copy_(t)
                layer = scaled.get(id(param))
                if layer is not None:
                    # a row-sharded piece takes its rows' scales; a column-sharded one (row-parallel) every row's
                    s = reader.read_scale(pc.name + SCALE_SUFFIX, pc.full_shape[0], fp8.weight_strategy)
                    if pc.dim == 0:
                        layer.weight_scale[pc.offset : pc.offset + t.shape[0]].copy_(s[pc.start : pc.stop])
                    else:
                        layer.weight_scale.copy_(s)
    finally:
        reader.close()


# Rank r draws its random weights from a generator seeded with seed * RANDOM_INIT_SEED_STRIDE + r, which torch's
# manual_seed takes only within int64: the engine seeds that keep it there.
RANDOM_INIT_SEED_STRIDE = 1_000_003
RANDOM_INIT_SEEDS = (-(2**63 // RANDOM_INIT_SEED_STRIDE), (2**63 - 1) // RANDOM_INIT_SEED_STRIDE - 1)


def check_random_init_seed(seed: int, model_name: str, given: str) -> None:
    """Refuse an engine seed whose random-weight generator seed would overflow int64 (random_init), before any
    weight is drawn; `given`: how the user set it, up to the value ("--seed ", "EngineConfig seed=")."""
    lo, hi = RANDOM_INIT_SEEDS
    if not lo <= seed <= hi:
        raise UsageError(
            f"{given}{seed}: the random weights of {model_name} draw from seed x {RANDOM_INIT_SEED_STRIDE:,} + "
            f"rank, which must fit int64; give a seed in [{lo}, {hi}], e.g. 0"
        )


@torch.no_grad()
def random_init(model: LlamaForCausalLM, seed: int, rank: int, std: float = 0.02) -> None:
    """Seeded N(0, std) weights generated on the parameters' device (norm weights = 1).

    Each rank draws its own shard from a generator seeded by (seed, rank): fast (no host work, no
    copies) and reproducible, but a random model sharded at tp=2 is not the same network as at tp=4.
    """
    device = next(model.parameters()).device
    gen = torch.Generator(device=device)
    gen.manual_seed(seed * RANDOM_INIT_SEED_STRIDE + rank)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        else:
            param.normal_(0.0, std, generator=gen)
