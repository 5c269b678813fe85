"""skinny_linear (spanllm.kernels.skinny_gemm) on CPU tensors under Triton's interpreter, its input checks
and its config heuristic; on a GPU, also the compiled kernel against F.linear.

Triton decides at import whether it interprets: `triton.jit` (and triton.language's own jit helpers,
tl.zeros among them) build InterpretedFunctions only when TRITON_INTERPRET=1 is set before triton is
first imported. In a normal session something imports triton first (the engine, inductor), so the
interpreter tests run in a fresh child pytest over this file with TRITON_INTERPRET=1 from the start
(`test_interpreter_suite`); in the parent they skip, saying so. The GPU test runs in the parent, on
compiled kernels.

Exactness: inputs are small integers (-2..2), so every product and partial sum is an integer far below
2^24, exact in the fp32 accumulator in any order; the output then equals the fp32 reference rounded
once to the output dtype, bit for bit, with or without split-K.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from triton_interpreter import patch_scalar_index, run_child_suite, widen_bf16_dot

from spanllm.kernels import arrival_counters, interpreter
from spanllm.kernels import skinny_gemm as gemm

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

SHAPES_TP2 = {  # (N, K) per GPU at TP 2
    "70b": [(5120, 8192), (8192, 4096), (28672, 8192), (8192, 14336)],
    "8b": [(3072, 4096), (4096, 2048), (14336, 4096), (4096, 7168)],
}
SHAPES_8B_TP1 = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]  # qkv, o, gate_up, down
SHAPES_70B_TP8 = [(1280, 8192), (8192, 1024), (7168, 8192), (8192, 3584)]


def _triton():
    return pytest.importorskip("triton")


def _interpreter_shims(monkeypatch):
    """Two gaps of Triton 3.6's interpreter, patched while a test runs (triton_interpreter.py)."""
    _triton()
    patch_scalar_index(monkeypatch)
    widen_bf16_dot(monkeypatch)


def _probe_interpreter():
    """Run a trivial kernel on a CPU tensor; the error if the interpreter cannot (so the real tests skip,
    while a bug in the GEMM kernels still fails them)."""
    triton = _triton()
    tl = triton.language

    def copy(src, dst, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        for _ in tl.range(0, tl.program_id(0) + 1):  # a runtime loop bound, as in the GEMM kernel
            tl.store(dst + offs, tl.load(src + offs))

    try:
        kernel = triton.jit(copy)
        src, dst = torch.arange(32, dtype=torch.float32), torch.zeros(32)
        kernel[(2,)](src, dst, BLOCK=16)
    except Exception as e:  # noqa: BLE001 - any failure here means "no interpreter on CPU tensors"
        return repr(e)
    return None if torch.equal(src, dst) else f"the probe copied {dst}"


@pytest.fixture
def interp(monkeypatch):
    """The interpreter (in the child pytest of test_interpreter_suite); skip if it cannot run kernels on
    CPU tensors there (the parent then fails: it counts the child's passes)."""
    if not INTERPRETED:
        pytest.skip("runs in the child pytest with TRITON_INTERPRET=1 (test_interpreter_suite)")
    _triton()
    _interpreter_shims(monkeypatch)
    if not interpreter.interpreting():
        pytest.skip("the kernels were not built by Triton's interpreter")
    error = _probe_interpreter()
    if error is not None:
        pytest.skip(f"Triton's interpreter cannot run kernels on CPU tensors here: {error}")
    return gemm


def _ints(*shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-2, 3, shape, generator=g).to(dtype)


def _expect(x, w):
    return (x.float().reshape(-1, x.shape[-1]) @ w.float().T).to(x.dtype).reshape(*x.shape[:-1], w.shape[0])


# (N, K, config): K tail + N tail, split 1 and 3 (last chunk 8 of 96 elements); even K and N, split 4.
CASES = [
    (70, 200, (32, 64, 1, 4, 3)),
    (70, 200, (32, 32, 3, 4, 2)),
    (64, 256, (32, 32, 4, 4, 3)),
    (70, 200, None),  # the heuristic
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("m", [1, 3, 8, 16])
@pytest.mark.parametrize("n,k,config", CASES)
def test_exact_small_integers(interp, dtype, m, n, k, config):
    x = _ints(m, k, dtype=dtype, seed=m)
    w = _ints(n, k, dtype=dtype, seed=100 + n)
    y = interp.skinny_linear(x, w, config=config)
    assert y.shape == (m, n) and y.dtype == dtype
    assert torch.equal(y, _expect(x, w))


def test_split_k_forced_by_override_table(interp, monkeypatch):
    m, n, k = 5, 70, 200
    cfg = (32, 32, 3, 4, 2)
    monkeypatch.setattr(interp, "measured_table", lambda: ({(interp.m_bucket(m), n, k, 2): cfg}, {}))
    assert interp.choose_config(m, n, k, 132) == cfg
    assert interp.effective_split_k(k, 32, 3) == 3
    x, w = _ints(m, k, dtype=torch.bfloat16, seed=1), _ints(n, k, dtype=torch.bfloat16, seed=2)
    assert torch.equal(interp.skinny_linear(x, w), _expect(x, w))
    # The last program of each of the 3 tiles summed and reset its counter: all zero again, so a second
    # launch (another shape, fewer tiles) counts from zero too.
    assert arrival_counters.all_zero(x.device)
    x2, w2 = _ints(2, k, dtype=torch.bfloat16, seed=3), _ints(20, k, dtype=torch.bfloat16, seed=4)
    assert torch.equal(interp.skinny_linear(x2, w2, config=(16, 32, 2, 4, 2)), _expect(x2, w2))
    assert arrival_counters.all_zero(x.device)


def test_3d_input_and_strided_x(interp):
    b, t, n, k = 2, 3, 40, 96
    x = _ints(b, t, k, dtype=torch.bfloat16, seed=3)
    w = _ints(n, k, dtype=torch.bfloat16, seed=4)
    y = interp.skinny_linear(x, w, config=(16, 32, 2, 4, 2))
    assert y.shape == (b, t, n)
    assert torch.equal(y, _expect(x, w))
    # rows with a gap between them (a slice of a wider tensor): x's row stride is passed through
    wide = _ints(4, 2 * k, dtype=torch.float32, seed=5)
    xs = wide[:, :k]
    assert xs.stride() == (2 * k, 1)
    assert torch.equal(interp.skinny_linear(xs, w.float(), config=(16, 32, 1, 4, 2)), _expect(xs, w.float()))


def test_random_values_close_and_deterministic(interp):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 300, generator=g)
    w = torch.randn(50, 300, generator=g)
    y1 = interp.skinny_linear(x, w, config=(16, 32, 4, 4, 2))
    y2 = interp.skinny_linear(x, w, config=(16, 32, 4, 4, 2))
    assert torch.equal(y1, y2)
    torch.testing.assert_close(y1, F.linear(x.double(), w.double()).float(), rtol=1e-5, atol=1e-4)


def _fp8_case(m, n, k, seed):
    """Small-integer x, FP8 weights of small integers, power-of-two channel scales: every product, sum and
    scaling is exact in fp32, so the kernel's output equals the reference rounded once, bit for bit."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-3, 4, (n, k), generator=g).float().to(torch.float8_e4m3fn)
    scale = torch.tensor([2.0 ** (i % 5 - 2) for i in range(n)])
    return q, scale


# FP8 weights (W8A16): rows up to FP8_MAX_M (BLOCK_M 16 / 32 / 64 / 128), split 1 and 3, K and N tails, the heuristic.
FP8_CASES = [(70, 200, (32, 64, 1, 4, 3)), (70, 200, (32, 32, 3, 4, 2)), (64, 256, None)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("m", [1, 16, 17, 64, 128])
@pytest.mark.parametrize("n,k,config", FP8_CASES)
def test_fp8_weights_exact(interp, dtype, m, n, k, config):
    x = _ints(m, k, dtype=dtype, seed=m)
    q, scale = _fp8_case(m, n, k, seed=n + k)
    y = interp.skinny_linear(x, q, config=config, weight_scale=scale)
    assert y.shape == (m, n) and y.dtype == dtype
    expect = ((x.float() @ q.float().T) * scale).to(dtype)
    assert torch.equal(y, expect)


# The tests that take the `interp` fixture, and how many cases they have in all.
INTERPRETER_SELECTION = "exact_small_integers or split_k_forced or 3d_input or random_values_close or fp8_weights_exact"
INTERPRETER_TESTS = 4 * 3 * 4 + 3 + 2 * 5 * 3


def test_interpreter_suite():
    """This file again in a child pytest with TRITON_INTERPRET=1: every interpreter test must pass there."""
    if INTERPRETED:
        pytest.skip("this is the child")
    _triton()
    run_child_suite(__file__, INTERPRETER_TESTS, INTERPRETER_SELECTION)


def test_fp8_input_errors():
    _triton()
    x = torch.zeros(2, 32)
    q = torch.zeros(8, 32, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="with weight_scale the weight must be torch.float8_e4m3fn"):
        gemm.skinny_linear(x, q.float(), weight_scale=torch.ones(8))
    with pytest.raises(ValueError, match=r"weight_scale must be float32 \[N\] = \[8\]"):
        gemm.skinny_linear(x, q, weight_scale=torch.ones(7))
    with pytest.raises(ValueError, match="exceeds the limit M <= 128 \\(FP8 weights\\)"):
        gemm.skinny_linear(torch.zeros(129, 32), q, weight_scale=torch.ones(8))


def test_input_errors():
    _triton()  # without Triton skinny_linear raises before checking inputs (test_without_triton)
    w = torch.zeros(8, 32, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"M=17 rows .*limit M <= 16.*torch\.nn\.functional\.linear"):
        gemm.skinny_linear(torch.zeros(17, 32, dtype=torch.bfloat16), w)
    with pytest.raises(ValueError, match=r"M=18 .*\(x shape \(2, 9, 32\)\)"):
        gemm.skinny_linear(torch.zeros(2, 9, 32, dtype=torch.bfloat16), w)
    with pytest.raises(ValueError, match=r"dtype mismatch: x is torch.float16, weight is torch.bfloat16"):
        gemm.skinny_linear(torch.zeros(1, 32, dtype=torch.float16), w)
    with pytest.raises(ValueError, match=r"K mismatch: x has K=16 .*weight has K=32"):
        gemm.skinny_linear(torch.zeros(1, 16, dtype=torch.bfloat16), w)
    with pytest.raises(ValueError, match=r"weight must be contiguous"):
        gemm.skinny_linear(torch.zeros(1, 8, dtype=torch.bfloat16), w.t())
    with pytest.raises(ValueError, match=r"not supported"):
        gemm.skinny_linear(torch.zeros(1, 32, dtype=torch.float64), torch.zeros(8, 32, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"power of two"):
        gemm.skinny_linear(torch.zeros(1, 32, dtype=torch.bfloat16), w, config=(48, 32, 1, 4, 2))


def test_available():
    w = torch.zeros(8, 32, dtype=torch.bfloat16)
    assert not gemm.skinny_gemm_available(torch.zeros(1, 32, dtype=torch.bfloat16), w)  # CPU tensors
    if torch.cuda.is_available():
        wc = w.cuda()
        assert gemm.skinny_gemm_available(torch.zeros(16, 32, dtype=torch.bfloat16, device="cuda"), wc)
        assert not gemm.skinny_gemm_available(torch.zeros(17, 32, dtype=torch.bfloat16, device="cuda"), wc)
        assert not gemm.skinny_gemm_available(torch.zeros(1, 32, dtype=torch.float16, device="cuda"), wc)


def test_without_triton():
    """The module imports without Triton; skinny_linear then says so."""
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import importlib.util\n"
        f"spec = importlib.util.spec_from_file_location('sg', {str(gemm.__file__)!r})\n"
        "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)\n"
        "import torch\n"
        "assert m.triton is None and not hasattr(m, '_skinny_gemm_kernel')\n"
        "assert not m.skinny_gemm_available(torch.zeros(1, 4), torch.zeros(2, 4))\n"
        "assert m.choose_config(1, 5120, 8192, 132)\n"
        "try:\n    m.skinny_linear(torch.zeros(1, 4), torch.zeros(2, 4))\n"
        "except RuntimeError as e:\n    print('raised:', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "raised: skinny_linear needs Triton" in out.stdout


@pytest.mark.parametrize("num_sms", [132, 78])
@pytest.mark.parametrize("m", [1, 8, 16])
def test_choose_config_on_llama_shapes(m, num_sms, monkeypatch):
    """The heuristic (the measured table set aside) fills the SMs with valid, non-empty splits."""
    monkeypatch.setattr(gemm, "measured_table", lambda: ({}, {}))
    for n, k in SHAPES_TP2["70b"] + SHAPES_TP2["8b"]:
        cfg = gemm.choose_config(m, n, k, num_sms)
        assert cfg == gemm.choose_config(m, n, k, num_sms)  # a pure function
        bn, bk, split, warps, stages = cfg
        assert bn in (32, 64, 128) and bk in (128, 256) and warps in (4, 8) and 2 <= stages <= 5
        assert gemm.effective_split_k(k, bk, split) == split  # no empty splits
        chunk = gemm.split_k_chunk(k, bk, split)
        assert chunk % bk == 0 and chunk * split >= k and chunk * (split - 1) < k
        programs = math.ceil(n / bn) * split
        assert programs >= num_sms, (m, n, k, cfg, programs)
        assert (bn + 16) * bk * 2 * stages <= 200 * 1024  # shared memory of the pipeline


def test_config_overrides_are_valid_and_used():
    """Every measured override launches (power-of-two tiles, non-empty splits, its pipeline of W tiles and bf16 x
    tiles fits in shared memory) and is the config chosen for its key; bf16 entries (2 bytes) win for bf16 only
    (the fp32 key is absent, so fp32 takes the heuristic); FP8 entries (1 byte) carry their W8A8 time too."""
    configs, times = gemm.measured_table()
    assert configs and any(key[3] == 1 for key in configs)
    for (mb, n, k, elem), cfg in configs.items():
        assert elem in (1, 2) and mb == gemm.m_bucket(mb)
        assert (n, k) in SHAPES_TP2["70b"] + SHAPES_TP2["8b"] + SHAPES_8B_TP1 + SHAPES_70B_TP8
        c = gemm._check_config(cfg)
        assert gemm.effective_split_k(k, c.block_k, c.split_k) == c.split_k
        assert (c.block_n * elem + gemm.block_m_for(mb) * 2) * c.block_k * c.num_stages <= 227 * 1024
        assert gemm.choose_config(mb, n, k, 132, elem_bytes=elem) == c
        if elem == 1:
            assert (mb, n, k, elem) in times and mb <= gemm.FP8_MAX_M
        if elem == 1:
            continue
        heuristic = gemm.choose_config(mb, n, k, 132, elem_bytes=4)
        assert (heuristic.block_n + 16) * heuristic.block_k * 4 * heuristic.num_stages <= 227 * 1024


def test_table_lookup_takes_the_nearest_measured_bucket(monkeypatch):
    """Buckets without an entry take the nearest measured one of the same shape and element size (ties: the
    larger); another shape or dtype, or use_table=False, takes the heuristic."""
    a, b = (32, 128, 2, 4, 4), (64, 256, 1, 4, 5)
    monkeypatch.setattr(gemm, "measured_table", lambda: ({(1, 5120, 8192, 2): a, (8, 5120, 8192, 2): b}, {}))
    got = {m: tuple(gemm.table_config(m, 5120, 8192)) for m in (1, 2, 3, 4, 5, 8, 9, 16)}
    assert got == {1: a, 2: a, 3: b, 4: b, 5: b, 8: b, 9: b, 16: b}
    assert gemm.table_config(1, 5120, 8192, elem_bytes=4) is None and gemm.table_config(1, 5120, 4096) is None
    heuristic = gemm.choose_config(1, 5120, 8192, 132, use_table=False)
    assert gemm.choose_config(1, 5120, 8192, 132) == a and heuristic == gemm.choose_config(
        1, 5120, 4096 * 2, 132, 2, False
    )
    monkeypatch.setattr(gemm, "measured_table", lambda: ({}, {}))
    assert gemm.choose_config(1, 5120, 8192, 132) == heuristic
    assert gemm.table_id().startswith("0 entries, sha1 ")


def test_measured_times_cover_the_table():
    """decode_gemm="auto" decides from the measured times: one (skinny, F.linear) pair for every entry."""
    configs, times = gemm.measured_table()
    assert set(times) == set(configs)
    assert all(a > 0 and b > 0 for a, b in times.values())


def test_prefer_skinny_follows_the_measured_times(monkeypatch):
    """On the 8B's TP=1 shapes (bf16): qkv, o and down measured faster in the skinny kernel, gate_up
    slower; any M up to 16 takes the nearest measured bucket; unmeasured shapes, fp32, more than 16 rows, or
    no Triton: F.linear. One row: the CUDA-core GEMV's table (spanllm.kernels.gemv) measured it faster than
    F.linear for all four and the LM head, so the skinny path (which hands one row to the GEMV) takes them."""
    if gemm.triton is None:
        assert not gemm.prefer_skinny(1, 6144, 4096)
        pytest.skip("without Triton: only checked that F.linear is preferred; the measured table needs Triton")
    from spanllm.kernels import gemv

    qkv, o, gate_up, down = SHAPES_8B_TP1
    for m in (2, 8, 16):
        assert gemm.prefer_skinny(m, *qkv) and gemm.prefer_skinny(m, *o) and gemm.prefer_skinny(m, *down)
        assert not gemm.prefer_skinny(m, *gate_up)
    lm_head = (128256, 4096)
    for shape in (qkv, o, gate_up, down, lm_head):
        assert gemm.prefer_skinny(1, *shape) == gemv.beats_torch(*shape, 2) is True, shape
    assert not gemm.prefer_skinny(2, *lm_head)  # the LM head: never measured at more rows
    assert not gemm.prefer_skinny(17, *qkv)
    assert not gemm.prefer_skinny(1, *qkv, elem_bytes=4)
    gemm.prefer_skinny.cache_clear()
    monkeypatch.setattr(gemm, "triton", None)
    try:
        assert not gemm.prefer_skinny(1, *qkv)
    finally:
        gemm.prefer_skinny.cache_clear()


def test_describe_auto_groups_row_counts_with_the_same_choice(monkeypatch):
    """The engine's description of decode_gemm="auto": the 8B at TP=1 takes skinny for qkv, o and down at every
    row count; the 70B at TP=2 has o faster at bucket 1 (rows 1-2) and tied at bucket 8 (rows 3-16: F.linear); a
    config without its measured times is never chosen."""
    if gemm.triton is None:
        pytest.skip("prefer_skinny is False everywhere without Triton")
    qkv, o, gate_up, down = SHAPES_8B_TP1
    eight = [("qkv", *qkv, 2), ("o", *o, 2), ("gate_up", *gate_up, 2), ("down", *down, 2), ("lm_head", 128256, 4096, 2)]
    assert gemm.describe_auto(eight) == (
        "1 row: CUDA-core GEMV qkv, o, gate_up, down, lm_head (table 9 entries); skinny -; F.linear - | "
        "2-16 rows: skinny qkv, o, down; F.linear gate_up, lm_head"
    )  # one row: the GEMV's table (spanllm/kernels/gemv_configs.json) measured it faster than both
    q70, o70, gu70, d70 = SHAPES_TP2["70b"]
    seventy = [("qkv", *q70, 2), ("o", *o70, 2), ("gate_up", *gu70, 2), ("down", *d70, 2)]
    assert gemm.describe_auto(seventy) == (
        "1-2 rows: skinny qkv, o, down; F.linear gate_up | 3-16 rows: skinny qkv, down; F.linear o, gate_up"
    )
    gemm.prefer_skinny.cache_clear()
    configs, times = gemm.measured_table()
    kept = {k: v for k, v in times.items() if k[1:3] != qkv}
    monkeypatch.setattr(gemm, "measured_table", lambda: (configs, kept))
    try:
        assert not gemm.prefer_skinny(2, *qkv) and gemm.prefer_skinny(2, *o)
    finally:
        gemm.prefer_skinny.cache_clear()


def test_choose_config_small_and_fp32():
    bn, bk, split, _, _ = gemm.choose_config(3, 70, 200, 132)
    assert bk == 256 and split == 1  # one K tile: no split
    bn, bk, split, _, _ = gemm.choose_config(1, 5120, 8192, 132, elem_bytes=4)
    assert bk in (128, 256) and gemm.split_k_chunk(8192, bk, split) % bk == 0


def test_m_bucket():
    assert [gemm.m_bucket(m) for m in (1, 2, 3, 4, 5, 8, 9, 16)] == [1, 2, 4, 4, 8, 8, 16, 16]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_gpu_matches_f_linear(dtype):
    _triton()
    real = gemm  # compiled kernels (the parent session: TRITON_INTERPRET unset)
    if INTERPRETED:
        pytest.skip("TRITON_INTERPRET=1 in the environment")
    g = torch.Generator(device="cuda").manual_seed(0)
    for m in (1, 5, 16):
        for n, k, cfg in [(5120, 8192, None), (1000, 1000, None), (1000, 1000, (64, 128, 4, 4, 3))]:
            x = torch.randn(m, k, device="cuda", dtype=dtype, generator=g)
            w = torch.randn(n, k, device="cuda", dtype=dtype, generator=g) / k**0.5
            y = real.skinny_linear(x, w, config=cfg)
            ref = F.linear(x.double(), w.double())
            tol = 1e-5 if dtype == torch.float32 else 2e-2
            torch.testing.assert_close(y.double(), ref, rtol=tol, atol=tol)
            assert torch.equal(y, real.skinny_linear(x, w, config=cfg))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gpu_split_k_merge_in_a_cuda_graph():
    """Split-K's in-kernel merge on compiled kernels: exact on small integers (every sum is exact in fp32),
    the same bits on every eager call and graph replay, and every arrival counter back at zero; the 8B's
    down projection in its table config (split 4) too."""
    _triton()
    if INTERPRETED:
        pytest.skip("TRITON_INTERPRET=1 in the environment")
    from spanllm.cuda_graph import capture_graph

    dev = torch.device("cuda", torch.cuda.current_device())
    for m, n, k, cfg in [(3, 1000, 1000, (64, 128, 4, 4, 3)), (1, 4096, 14336, None), (8, 4096, 14336, None)]:
        x = _ints(m, k, dtype=torch.bfloat16, seed=m).to(dev)
        w = _ints(n, k, dtype=torch.bfloat16, seed=n).to(dev)
        first = gemm.skinny_linear(x, w, config=cfg)
        assert torch.equal(first, _expect(x, w))
        if cfg is None:
            assert gemm.choose_config(m, n, k, gemm.num_sms_of(dev)).split_k > 1
        xr = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        wr = torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k**0.5
        ref = gemm.skinny_linear(xr, wr, config=cfg)
        for _ in range(20):
            assert torch.equal(gemm.skinny_linear(xr, wr, config=cfg), ref)
        outs: list[torch.Tensor] = []
        graph = capture_graph(lambda: outs.append(gemm.skinny_linear(xr, wr, config=cfg)), dev, warmup=1)  # noqa: B023
        for _ in range(20):
            outs[-1].zero_()
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(outs[-1], ref)
        assert arrival_counters.all_zero(dev)


def test_tp_context_decode_gemm_modes():
    """Which decode GEMMs take the skinny kernel: 'torch' none, 'skinny' all of <= 16 rows, 'auto' those the
    measured table prefers, on CUDA tensors only (CPU tensors here: F.linear); the engine names the choice."""
    from spanllm.engine.config import EngineConfig
    from spanllm.engine.llm import LLM
    from spanllm.layers.tp import TPContext

    w = torch.zeros(6144, 4096, dtype=torch.bfloat16)  # the 8B's qkv at TP=1: auto's pick on a GPU
    x1, x16, x17 = (torch.zeros(m, 4096, dtype=torch.bfloat16) for m in (1, 16, 17))
    assert not any(TPContext(decode_gemm="torch").use_skinny(x, w) for x in (x1, x16))
    skinny = TPContext(decode_gemm="skinny")
    assert skinny.use_skinny(x1, w) and skinny.use_skinny(x16, w) and not skinny.use_skinny(x17, w)
    assert not TPContext(decode_gemm="auto").use_skinny(x1, w)  # CPU tensors
    assert EngineConfig().decode_gemm == "auto"
    llm = LLM("tiny", EngineConfig(dtype=torch.float32))
    try:
        assert llm.describe_decode_gemm() == "decode GEMMs auto: F.linear (no CUDA device)"
        assert "decode GEMMs auto: F.linear (no CUDA device)" in llm.describe()
    finally:
        llm.close()


def test_decode_gemm_defaults_of_the_commands():
    """The serving commands default to 'auto'; the static-batch benchmarks (bench batch / study) keep F.linear,
    the kernel mix the perf model's engine constants describe."""
    import argparse

    from spanllm.commands import bench_batch as batch
    from spanllm.commands import bench_study as study
    from spanllm.commands import bench_throughput as throughput

    def default(mod):
        p = argparse.ArgumentParser()
        mod.add_arguments(p)
        return p.parse_args(["--model", "tiny"]).decode_gemm

    assert default(throughput) == "auto"
    assert default(batch) == "torch" and default(study) == "torch"
