"""Every supported GGUF tensor type, written by gguf.GGUFWriter, read back through spanllm's loader
(spanllm.model.gguf.dequantize): the values the writer was given, within that type's rounding.

Types the gguf package quantizes (F32 .. Q5_1) start from random float32 values; the bound is half a
quantization step of each 32-value block (plus the rounding of the fp16 scale). The k-quants (Q4_K, Q5_K,
Q6_K), which the package cannot quantize, are built as raw blocks from chosen scales and quants by the
format's definition (ggml-common.h), so their expected values are exact."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as Q  # noqa: E402
from gguf_files import write_one_tensor  # noqa: E402

from spanllm.model.gguf import SUPPORTED_TYPES, dequantize, open_gguf  # noqa: E402

ROWS, COLS = 6, 512  # two k-quant super-blocks, sixteen 32-value blocks per row


def _read_back(path) -> np.ndarray:
    (t,) = open_gguf(str(path)).tensors
    return dequantize(t)


def _block_rounding(x: np.ndarray, qtype: Q) -> tuple[np.ndarray, np.ndarray]:
    """(x saturated to what its 32-value block can represent, the block's quantization step), as ggml's reference
    quantizer picks the scale: symmetric types map the largest-magnitude value to the end of the signed range, so
    values of the other sign saturate at (levels/2 - 1) steps; Q*_1 spans [min, max] exactly."""
    b = x.reshape(-1, 32)
    amax_i = np.abs(b).argmax(1)
    peak = b[np.arange(len(b)), amax_i]  # signed
    lo, hi = b.min(1), b.max(1)
    half = {Q.Q8_0: 128, Q.Q4_0: 8, Q.Q5_0: 16}.get(qtype)
    if half is None:  # Q4_1 / Q5_1
        step = (hi - lo) / {Q.Q4_1: 15, Q.Q5_1: 31}[qtype]
        sat = b
    else:
        step = np.abs(peak) / (127 if qtype == Q.Q8_0 else half)
        other = (half - 1) * step  # the far end on the side opposite the peak
        sat = np.where(
            peak[:, None] < 0, np.clip(b, peak[:, None], other[:, None]), np.clip(b, -other[:, None], peak[:, None])
        )
    return sat.reshape(x.shape), np.repeat(step, 32).reshape(x.shape)


@pytest.mark.parametrize("name", ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"])
def test_quantized_by_the_writer(tmp_path, name):
    qtype = Q[name]
    x = np.random.default_rng(7).normal(0, 1, (ROWS, COLS)).astype(np.float32)
    write_one_tensor(tmp_path / "t.gguf", "blk.0.attn_q.weight", x, qtype)
    got = _read_back(tmp_path / "t.gguf")
    assert got.shape == (ROWS, COLS) and got.dtype == np.float32
    err = np.abs(got - x)
    if name == "F32":
        assert np.array_equal(got, x)
    elif name == "F16":
        assert np.array_equal(got, x.astype(np.float16).astype(np.float32))
    elif name == "BF16":  # round to nearest even on the top 16 bits
        assert np.array_equal(got, torch.from_numpy(x).to(torch.bfloat16).float().numpy())
    else:
        sat, step = _block_rounding(x, qtype)
        amax = np.repeat(np.abs(x.reshape(-1, 32)).max(1), 32).reshape(x.shape)
        fp16_scales = 2.0**-9 * amax  # the scale (and Q*_1's minimum) are stored as fp16
        assert (np.abs(got - sat) <= 0.5 * step + fp16_scales).all(), float((np.abs(got - sat) / step).max())
        assert (err > 0).any()  # really quantized


# --- k-quants: raw super-blocks of 256 values from chosen scales and quants -----------------------------------
def _f16_bytes(v: np.ndarray) -> np.ndarray:
    return np.asarray(v, np.float16).reshape(-1, 1).view(np.uint8)


def _pack_k4_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """8 six-bit scales and mins -> 12 bytes (ggml's get_scale_min_k4, inverted)."""
    out = np.zeros((sc.shape[0], 12), np.uint8)
    for j in range(4):
        out[:, j] = (sc[:, j] & 63) | ((sc[:, j + 4] >> 4) << 6)
        out[:, j + 4] = (m[:, j] & 63) | ((m[:, j + 4] >> 4) << 6)
        out[:, j + 8] = (sc[:, j + 4] & 15) | ((m[:, j + 4] & 15) << 4)
    return out


def _k_quant(qtype: Q, rng) -> tuple[np.ndarray, np.ndarray]:
    """(raw bytes [ROWS, bytes per row], expected float values [ROWS, COLS])."""
    n = ROWS * COLS // 256  # super-blocks
    d = rng.choice([0.5, 0.25, 0.125, 2.0**-6], n).astype(np.float32)  # exact in fp16
    if qtype == Q.Q6_K:
        q = rng.integers(0, 64, (n, 256)).astype(np.uint8)  # stored q; value = d * scale[i // 16] * (q - 32)
        sc = rng.integers(-128, 128, (n, 16)).astype(np.int8)
        ql, qh = np.zeros((n, 128), np.uint8), np.zeros((n, 64), np.uint8)
        for half in range(2):
            y = q[:, 128 * half : 128 * half + 128]
            for part in range(4):  # y[32 * part + l] for l < 32
                v = y[:, 32 * part : 32 * part + 32]
                lo, hi = v & 15, v >> 4
                col = 64 * half + (32 if part % 2 else 0)
                ql[:, col : col + 32] |= lo << (4 if part >= 2 else 0)
                qh[:, 32 * half : 32 * half + 32] |= hi << (2 * part)
        raw = np.concatenate([ql, qh, sc.view(np.uint8), _f16_bytes(d).reshape(n, 2)], axis=1)
        want = d[:, None] * np.repeat(sc.astype(np.float32), 16, axis=1) * (q.astype(np.float32) - 32)
        return raw.reshape(ROWS, -1), want.reshape(ROWS, COLS)
    bits = 4 if qtype == Q.Q4_K else 5
    dmin = rng.choice([0.25, 0.0625, 1.0], n).astype(np.float32)
    sc = rng.integers(0, 64, (n, 8)).astype(np.uint8)
    m = rng.integers(0, 64, (n, 8)).astype(np.uint8)
    q = rng.integers(0, 2**bits, (n, 256)).astype(np.uint8)  # value = d * sc[i // 32] * q - dmin * m[i // 32]
    qs = np.zeros((n, 128), np.uint8)
    for j in range(4):  # 64 values per 32 bytes: low nibbles, then high nibbles
        qs[:, 32 * j : 32 * j + 32] = (q[:, 64 * j : 64 * j + 32] & 15) | ((q[:, 64 * j + 32 : 64 * j + 64] & 15) << 4)
    parts = [_f16_bytes(d).reshape(n, 2), _f16_bytes(dmin).reshape(n, 2), _pack_k4_scales(sc, m)]
    if bits == 5:  # bit s of qh[l]: the fifth bit of value 32 * s + l
        qh = np.zeros((n, 32), np.uint8)
        for s in range(8):
            qh |= (q[:, 32 * s : 32 * s + 32] >> 4) << s
        parts.append(qh)
    raw = np.concatenate([*parts, qs], axis=1)
    scale = np.repeat(sc.astype(np.float32), 32, axis=1)
    mins = np.repeat(m.astype(np.float32), 32, axis=1)
    want = d[:, None] * scale * q.astype(np.float32) - dmin[:, None] * mins
    return raw.reshape(ROWS, -1), want.reshape(ROWS, COLS)


@pytest.mark.parametrize("name", ["Q4_K", "Q5_K", "Q6_K"])
def test_k_quants_from_chosen_blocks(tmp_path, name):
    raw, want = _k_quant(Q[name], np.random.default_rng(3))
    write_one_tensor(tmp_path / "t.gguf", "blk.0.ffn_up.weight", want, Q[name], raw=raw)
    got = _read_back(tmp_path / "t.gguf")
    assert got.shape == (ROWS, COLS)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    assert len(np.unique(want)) > 100  # the chosen values are not a trivial pattern


def test_every_supported_type_is_tested():
    tested = {"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"}
    assert set(SUPPORTED_TYPES) == tested
