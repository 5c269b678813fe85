"""The e4m3 widening variants of scripts/gpu_fp8_widen.py (the W8A16 skinny GEMM benchmark), on CPU.

- Under Triton's interpreter (TRITON_INTERPRET=1, set before Triton is imported: a child pytest over this file,
  `test_interpreter_suite`), every variant the interpreter can run, production's skinny_linear included:
  all 254 finite e4m3 codes (denormals, +-448, -0) exact through a split-K launch (one-hot x of amplitude 1 and
  2^-20), and small GEMMs of quantized randn weights with e4m3 denormals, +-448 and -0 written in, split-K, K and N
  tails, M = 1 and 3: within the script's TOL of the fp32 reference, and bit-identical to production's output for
  the variants that compute the same products (all but the bf16 fold).
  Interpreter shims (tests/engine/triton_interpreter.py for the scalar index): the interpreter keeps bf16 as raw
  uint16 and multiplies and dots those bits as integers; here bf16 operands of tl.dot and of a multiply are widened
  to fp32 exactly (bits << 16), not with the interpreter's own converter, which zeroes bf16 subnormals (the bit
  trick variants make e4m3 denormals into bf16 subnormals). numpy keeps fp32 subnormals, so the fold variants pass
  here; whether a GPU's MMA keeps them is what the script's `codes` check measures on the GPU.
- The inline-PTX variants cannot run in the interpreter (NotImplementedError for inline asm): their parametrized
  interpreter cases skip, saying so. Instead, in this process, their PTX text runs in a tiny emulator of its five
  instructions over every code in every byte position, and every variant compiles for sm_90 with Triton's bundled
  ptxas (no GPU needed), its K loop disassembled and checked for what the variant is for (no conversion-pipe
  instruction in the bit-trick variants, no shared-memory round trip in the PTX ones).
- The script exits non-zero with one line where there is no GPU.
"""

from __future__ import annotations

import importlib.util
import os
import struct
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "scripts", "gpu_fp8_widen.py")
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def _load(name: str, path: str):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


widen = _load("gpu_fp8_widen", SCRIPT)
shims = _load("_triton_interpreter_shims", os.path.join(ROOT, "tests", "engine", "triton_interpreter.py"))

INTERP_VARIANTS = [v.name for v in widen.VARIANTS if v.interpretable]
ASM_VARIANTS = [v.name for v in widen.VARIANTS if not v.interpretable]
ASM_REASON = "inline PTX: Triton's interpreter raises NotImplementedError (see test_asm_emulated, test_compiles_sm90)"
ALL = [pytest.param(n) for n in INTERP_VARIANTS] + [
    pytest.param(n, marks=pytest.mark.skip(reason=ASM_REASON)) for n in ASM_VARIANTS
]


def _exact_bf16_shims(monkeypatch) -> None:
    """bf16 operands of tl.dot and of a float multiply widened to fp32 exactly (bits << 16), the product rounded
    back to bf16 (nearest even), instead of the interpreter's integer arithmetic on the raw bits."""
    import numpy as np
    import triton
    from triton.runtime import interpreter

    tl = triton.language

    def f32(h):
        if h.dtype.scalar != tl.bfloat16:
            return h
        return interpreter.TensorHandle((h.data.astype(np.uint32) << 16).view(np.float32), tl.float32)

    def bf16_bits(a):
        b = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
        return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint16)

    orig_dot = interpreter.InterpreterBuilder.create_dot
    orig_fmul = interpreter.InterpreterBuilder.create_fmul

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return orig_dot(self, f32(a), f32(b), d, input_precision, max_num_imprecise_acc)

    def create_fmul(self, a, b):
        if a.dtype.scalar == tl.bfloat16:
            return interpreter.TensorHandle(bf16_bits(f32(a).data * f32(b).data), tl.bfloat16)
        return orig_fmul(self, a, b)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", create_dot)
    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_fmul", create_fmul)


@pytest.fixture
def interp(monkeypatch):
    """The script module with interpreted kernels (only in the TRITON_INTERPRET=1 child)."""
    shims.require_interpreter(monkeypatch)
    _exact_bf16_shims(monkeypatch)
    return widen


@pytest.mark.parametrize("amplitude", [1.0, 2.0**-20], ids=["x1", "x2^-20"])
@pytest.mark.parametrize("variant", ALL)
def test_interp_codes_exact(interp, variant, amplitude):
    v = interp.VARIANT_BY_NAME[variant]
    x, q, scale, expect = interp.codes_case(64, amplitude, "cpu")
    y, _ = interp.run_variant(v, x, interp.prepare(q, scale), config=(32, 32, 2, 4, 2))
    assert y.dtype == torch.bfloat16 and y.shape == (16, 256)
    bad = (y.float() != expect).nonzero().tolist()
    assert not bad, f"{len(bad)} codes wrong, e.g. (m, n) {bad[:5]}"


SPECIAL_CODES = [0x7E, 0xFE, 0x01, 0x81, 0x07, 0x87, 0x80, 0x00, 0x08, 0x88]  # +-448, denormals, -0, 0, +-2^-6


def _realistic(m: int, n: int, k: int, seed: int):
    """x [m, k] bf16 (|x| >= 2^-10: fp16-normal, so the fp16 variants see the same x), W = quantized randn * 0.02
    with SPECIAL_CODES written into rows 0 and n-1 (every K chunk)."""
    from spanllm.layers.fp8 import quantize_weight

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    x = (x.sign() * x.abs().clamp_min(2.0**-10)).to(torch.bfloat16)
    q, scale = quantize_weight((torch.randn(n, k, generator=g) * 0.02).to(torch.bfloat16))
    qb = q.view(torch.uint8)
    for i, c in enumerate(SPECIAL_CODES):
        qb[0, i * (k // len(SPECIAL_CODES))] = c
        qb[n - 1, k - 1 - i] = c
    return x, q, scale


# (N, K, config): even K, split 2; K tail (200 = 128 + 72) and N tail (70 rows, BLOCK_N 32), split 2 after rounding
REALISTIC = [(64, 256, (32, 64, 2, 4, 2)), (70, 200, (32, 64, 3, 4, 2))]


@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("n,k,config", REALISTIC)
@pytest.mark.parametrize("variant", ALL)
def test_interp_realistic(interp, variant, n, k, config, m):
    from spanllm.kernels import skinny_gemm

    v = interp.VARIANT_BY_NAME[variant]
    x, q, scale = _realistic(m, n, k, seed=n + k + m)
    y, _ = interp.run_variant(v, x, interp.prepare(q, scale), config=config)
    ref = interp.reference(x, q, scale)
    err = interp.max_rel_err(y, ref)
    assert err < interp.TOL, f"max rel error {err:.3g}"
    if v.exact:
        production = skinny_gemm.skinny_linear(x, q, config=config, weight_scale=scale)
        assert torch.equal(y, production)


INTERPRETER_SELECTION = "interp_codes_exact or interp_realistic"
INTERPRETER_TESTS = len(INTERP_VARIANTS) * (2 + 2 * len(REALISTIC))


def test_interpreter_suite():
    """This file again in a child pytest with TRITON_INTERPRET=1: every interpreter test of an interpretable
    variant must pass there (the inline-PTX ones are deselected: they skip)."""
    if INTERPRETED:
        pytest.skip("this is the child")
    pytest.importorskip("triton")
    selection = f"({INTERPRETER_SELECTION}) and not ({' or '.join(ASM_VARIANTS)})"
    shims.run_child_suite(__file__, INTERPRETER_TESTS, selection)


# ----------------------------------------------------------------------------------- the PTX, without a GPU


def _prmt(a: int, b: int, sel: int) -> int:
    """PTX prmt.b32 (default mode): result byte i = byte (sel nibble i & 7) of {b, a}; nibble bit 3 replicates
    that byte's sign bit."""
    src = [(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)]
    out = 0
    for i in range(4):
        nib = (sel >> (4 * i)) & 0xF
        byte = src[nib & 7]
        if nib & 8:
            byte = 0xFF if byte & 0x80 else 0x00
        out |= byte << (8 * i)
    return out


def _bf16_value(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", (bits & 0xFFFF) << 16))[0]


def _bf16_bits(value: float) -> int:
    b = struct.unpack("<I", struct.pack("<f", value))[0]
    return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) & 0xFFFF


def _run_ptx(asm: str, word: int) -> tuple[int, int]:
    """Execute the variant's PTX (prmt, shl, and, mov, mul.rn.bf16x2 on .b32 registers) on one input word."""
    regs = {"$2": word}

    def val(tok: str) -> int:
        tok = tok.strip()
        return regs[tok] if tok in regs else int(tok, 0)

    for line in asm.splitlines():
        line = line.strip().rstrip(";")
        if not line or line in "{}" or line.startswith(".reg"):
            continue
        op, rest = line.split(None, 1)
        dst, *srcs = [t.strip() for t in rest.split(",")]
        if op == "prmt.b32":
            regs[dst] = _prmt(val(srcs[0]), val(srcs[1]), val(srcs[2]))
        elif op == "shl.b32":
            regs[dst] = (val(srcs[0]) << val(srcs[1])) & 0xFFFFFFFF
        elif op == "and.b32":
            regs[dst] = val(srcs[0]) & val(srcs[1])
        elif op == "mov.b32":
            regs[dst] = val(srcs[0])
        elif op == "mul.rn.bf16x2":
            a, b = val(srcs[0]), val(srcs[1])
            halves = [_bf16_bits(_bf16_value(a >> s) * _bf16_value(b >> s)) for s in (0, 16)]
            regs[dst] = halves[0] | (halves[1] << 16)
        else:
            raise AssertionError(f"the emulator does not know {op!r}")
    return regs["$0"], regs["$1"]


@pytest.mark.parametrize("variant", ASM_VARIANTS)
def test_asm_emulated(variant):
    """Every finite code in every byte position of the packed input: element i of the 4 comes out as the low
    (even i) or high half of output register i // 2, equal to the e4m3 value (mul) or value * 2^-120 (fold)."""
    v = widen.VARIANT_BY_NAME[variant]
    asm = widen.ASM_BF16_MUL if v.widen == widen.ASM_BF16_MUL_MODE else widen.ASM_BF16_FOLD
    codes = widen.finite_codes().tolist()
    decoded = torch.tensor(codes, dtype=torch.uint8).view(torch.float8_e4m3fn).float().tolist()
    for j in range(256):
        four = [codes[(j + 61 * i) % 256] for i in range(4)]  # 4 different codes, each code in every position
        word = sum(c << (8 * i) for i, c in enumerate(four))
        lo, hi = _run_ptx(asm, word)
        got = [_bf16_value(lo), _bf16_value(lo >> 16), _bf16_value(hi), _bf16_value(hi >> 16)]
        want = [decoded[(j + 61 * i) % 256] / v.scale_factor for i in range(4)]
        assert got == want, f"codes {[hex(c) for c in four]}: {got} != {want}"


def _static_ready() -> None:
    if INTERPRETED:
        pytest.skip("compiles real kernels: not under TRITON_INTERPRET=1")
    pytest.importorskip("triton")
    if widen.cuobjdump_path() is None:
        pytest.skip("Triton's bundled cuobjdump is missing")


@pytest.mark.parametrize("variant", [v.name for v in widen.VARIANTS if v.widen is not None])
def test_compiles_sm90(variant):
    """The variant compiles for sm_90 (ptxas accepts the inline PTX) at the qkv M=1 launch config, and its K loop
    has the instruction mix it is meant to have."""
    _static_ready()
    v = widen.VARIANT_BY_NAME[variant]
    cfg = (32, 256, 2, 4, 3)
    k = widen.compile_static(v, cfg, 90)
    mix = widen.kernel_loop_mix(k.asm["cubin"])
    assert mix is not None, "no K loop with an HMMA found in the SASS"
    per_weight = mix["conversions"] * 32 * cfg[3] / (cfg[0] * cfg[1])
    ops = mix["ops"]
    if v.widen == widen.CVT_BF16:
        assert ops.get("F2F", 0) > 0 and per_weight == 1.5  # cvt e4m3x2 -> f16x2, then f16 -> bf16 per weight
    elif v.widen == widen.CVT_F16 and v.x_fp16:
        assert per_weight == 0.5  # one cvt per two weights, nothing else
    elif v.widen != widen.CVT_F16:
        assert mix["conversions"] == 0, ops
    if not v.interpretable:
        assert ops.get("STS", 0) == 0, "the PTX widening should stay in registers (no shared-memory round trip)"


def test_no_gpu_one_line(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    out = subprocess.run([sys.executable, SCRIPT, str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert out.returncode != 0
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "scripts/gpu_fp8_widen.py" in lines[0], out.stderr[-2000:]
