"""GGUF files written by the gguf package's own GGUFWriter, for the loader's tests: one tensor of a given type,
and a tiny Llama (metadata + every tensor) with a chosen architecture name and tensor type."""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize

# The tiny Llama: 2 layers, hidden 64, 4 query / 2 KV heads of 16, vocab 96, ffn 128 (rows of 64: Q8_0's blocks).
TINY = dict(layers=2, hidden=64, heads=4, kv_heads=2, ffn=128, vocab=96)


def write_one_tensor(path, name: str, data: np.ndarray, qtype: GGMLQuantizationType, raw: np.ndarray | None = None):
    """A GGUF file holding `data` ([rows, cols] float32) as `qtype`: quantized by gguf.quants.quantize, or the
    raw block bytes `raw` ([rows, bytes per row] uint8) for types the package cannot quantize."""
    w = GGUFWriter(str(path), "llama")
    if raw is not None:
        w.add_tensor(name, raw, raw_dtype=qtype)
    elif qtype == GGMLQuantizationType.F32:
        w.add_tensor(name, data.astype(np.float32))
    elif qtype == GGMLQuantizationType.F16:
        w.add_tensor(name, data.astype(np.float16))
    else:
        w.add_tensor(name, quantize(data.astype(np.float32), qtype), raw_dtype=qtype)
    _finish(w)


def _finish(w: GGUFWriter) -> None:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_tiny_llama(path, arch: str = "llama", qtype: GGMLQuantizationType = GGMLQuantizationType.F32, seed=0):
    """A tiny Llama GGUF (random float32 weights, every matrix stored as `qtype`)."""
    t = TINY
    rng = np.random.default_rng(seed)
    w = GGUFWriter(str(path), arch)
    w.add_block_count(t["layers"])
    w.add_context_length(256)
    w.add_embedding_length(t["hidden"])
    w.add_feed_forward_length(t["ffn"])
    w.add_head_count(t["heads"])
    w.add_head_count_kv(t["kv_heads"])
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(t["hidden"] // t["heads"])
    w.add_vocab_size(t["vocab"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    h, d = t["hidden"], t["hidden"] // t["heads"]

    def mat(name, rows, cols):
        x = rng.normal(0, 0.05, (rows, cols)).astype(np.float32)
        if qtype == GGMLQuantizationType.F32:
            w.add_tensor(name, x)
        else:
            w.add_tensor(name, quantize(x, qtype), raw_dtype=qtype)

    mat("token_embd.weight", t["vocab"], h)
    w.add_tensor("output_norm.weight", np.ones(h, np.float32))
    for i in range(t["layers"]):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", np.ones(h, np.float32))
        w.add_tensor(p + "ffn_norm.weight", np.ones(h, np.float32))
        mat(p + "attn_q.weight", t["heads"] * d, h)
        mat(p + "attn_k.weight", t["kv_heads"] * d, h)
        mat(p + "attn_v.weight", t["kv_heads"] * d, h)
        mat(p + "attn_output.weight", h, t["heads"] * d)
        mat(p + "ffn_gate.weight", t["ffn"], h)
        mat(p + "ffn_up.weight", t["ffn"], h)
        mat(p + "ffn_down.weight", h, t["ffn"])
    _finish(w)
