"""The Triton W8A8 GEMM (spanllm.kernels.fp8_gemm) and its measured table, on CPU and, where there is one, a GPU.

- Under Triton's interpreter (a child pytest with TRITON_INTERPRET=1, `test_interpreter_suite`): exact results on
  operands whose products and sums fp32 holds exactly (M and N tails wrapped and never stored, several M tiles,
  a K tail, split-K 1 / 2 / 4), and the split-K merge summing in split order.
- Compiled for sm_90 (Triton's compiler and ptxas, no GPU): FP8 wgmma with W as the wide operand, loads pipelined
  by cp.async, no spills, nothing read before the PDL wait.
- The table's rules: which GEMMs the kernel takes, the W8A16-or-W8A8 decision it feeds, the description line,
  refusals of bad tables, configs and arguments.
- On a GPU: the kernel against the fp32 reference and torch._scaled_mm at the 8B's shapes, reruns bit-identical.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
from kernel_table import use_entries

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
FP8 = torch.float8_e4m3fn


def _load(name: str, path: str):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


shims = _load("_triton_interpreter_shims", os.path.join(ROOT, "tests", "engine", "triton_interpreter.py"))


@pytest.fixture
def table(tmp_path, monkeypatch):
    """Point the W8A8 table at a file of the given entries (the caches cleared before and after)."""
    from spanllm.kernels import fp8_gemm, skinny_gemm

    caches = (fp8_gemm.measured_table, skinny_gemm.fp8_weight_only)
    yield from use_entries(tmp_path, monkeypatch, "fp8_gemm_configs.json", fp8_gemm.TABLE_ENV, caches)


@pytest.fixture
def interp(monkeypatch):
    shims.require_interpreter(monkeypatch)
    shims.widen_bf16_dot(monkeypatch)  # the interpreter's tl.dot would multiply e4m3 bit patterns as integers


def _small_int_operands(m: int, n: int, k: int, seed: int):
    """x_q, W in {-4 ... 4} (exact in e4m3), scales powers of two: every product, sum and scaled result is exact
    in fp32 (|sum| <= 16 K), so the kernel must equal the reference bit for bit whatever its sum order."""
    g = torch.Generator().manual_seed(seed)
    xq = torch.randint(-4, 5, (m, k), generator=g).float().to(FP8)
    w = torch.randint(-4, 5, (n, k), generator=g).float().to(FP8)
    xs = 2.0 ** torch.randint(-3, 4, (m, 1), generator=g).float()
    ws = 2.0 ** torch.randint(-3, 4, (n,), generator=g).float()
    ref = (xq.float() @ w.float().t()) * xs * ws[None, :]
    return xq, xs, w, ws, ref


# (M, N, K, config (BLOCK_N, BLOCK_M, BLOCK_K, SPLIT_K, warps, stages)): M and N tails in one tile, no split; three M
# tiles and split 2; a K tail (K % BLOCK_K != 0) with split 4 over uneven chunks
CASES = [
    (5, 70, 128, (32, 16, 64, 1, 4, 2)),
    (40, 64, 256, (16, 16, 64, 2, 4, 2)),
    (17, 48, 224, (16, 32, 32, 4, 4, 1)),
]


@pytest.mark.parametrize("m,n,k,config", CASES)
def test_interp_exact(interp, m, n, k, config):
    from spanllm.kernels import fp8_gemm

    xq, xs, w, ws, ref = _small_int_operands(m, n, k, m + n + k)
    y = fp8_gemm.w8a8_linear(xq, xs, w, ws, torch.float32, config=config)
    assert y.shape == (m, n) and y.dtype == torch.float32
    assert torch.equal(y, ref)
    y16 = fp8_gemm.w8a8_linear(xq, xs.view(m), w, ws, torch.bfloat16, config=config)  # x_scale [M] too
    # one rounding, at the store (the interpreter's fp32 -> bf16 cast does not always round to nearest as the GPU's
    # does: within one bf16 step of the exact value, not bit-equal to torch's cast)
    assert y16.dtype == torch.bfloat16 and ((y16.float() - ref).abs() <= ref.abs() * 2**-7).all()


def test_interp_split_merge_sums_in_split_order(interp):
    """Chunk sums +S, -S, t with S = 64 * 448^2 (~2^23.6) and t = 2^-18: added in split order from zero they give
    t exactly; any other order loses it to fp32 rounding (S + t needs 42 bits)."""
    from spanllm.kernels import fp8_gemm

    k, n = 3 * 64, 16
    xq = torch.zeros(1, k)
    xq[0, :64], xq[0, 64:128], xq[0, 128] = 448.0, -448.0, 2.0**-9
    w = torch.full((n, k), 448.0)
    w[:, 128:] = 2.0**-9
    y = fp8_gemm.w8a8_linear(
        xq.to(FP8), torch.ones(1, 1), w.to(FP8), torch.ones(n), torch.float32, (16, 16, 64, 3, 4, 1)
    )
    assert y.eq(2.0**-18).all(), y


def test_interp_engine_dispatch(interp, table, monkeypatch):
    """spanllm.layers.fp8.w8a8_gemm runs the kernel exactly where the table measured it faster, else _scaled_mm."""
    from spanllm.kernels import fp8_gemm
    from spanllm.layers import fp8

    m, n, k = 20, 64, 128
    xq, xs, w, ws, ref = _small_int_operands(m, n, k, 3)
    scaled_mm = []
    monkeypatch.setattr(torch, "_scaled_mm", lambda *a, **kw: scaled_mm.append(a[0].shape) or ref.clone())
    cfg = [32, 32, 64, 2, 4, 2]
    table([_entry(32, n, k, 5.0, 6.0) | {"config": cfg}])
    assert torch.equal(fp8.w8a8_gemm(xq, xs, w, ws, torch.float32), ref) and scaled_mm == []
    assert fp8_gemm.table_config(m, n, k) == tuple(cfg)
    table([_entry(32, n, k, 6.0, 6.0) | {"config": cfg}])  # a tie: torch._scaled_mm
    fp8.w8a8_gemm(xq, xs, w, ws, torch.float32)
    assert scaled_mm == [(m, k)]


def test_interpreter_suite():
    if INTERPRETED:
        pytest.skip("this is the child")
    pytest.importorskip("triton")
    shims.run_child_suite(__file__, len(CASES) + 2, "interp_")


def _entry(mb: int, n: int, k: int, kernel: float, scaled_mm: float, quant: float = 3.0, w8a16=None) -> dict:
    e = {"m_bucket": mb, "n": n, "k": k, "config": [64, min(mb, 128), 128, 1, 4, 4], "kernel_us": kernel}
    e |= {"scaled_mm_us": scaled_mm, "quant_us": quant}
    return e if w8a16 is None else e | {"w8a16_us": w8a16}


def test_table_rules(table):
    pytest.importorskip("triton")
    from spanllm.kernels import fp8_gemm
    from spanllm.layers import fp8

    table(
        [
            _entry(64, 4096, 4096, 10.0, 15.0, w8a16=12.0),  # W8A8 by the kernel (10 < 12), which beats _scaled_mm
            _entry(32, 4096, 4096, 10.0, 15.0, quant=3.0, w8a16=12.0),  # fused from 32 rows (a 3 us pass without)
            _entry(128, 4096, 4096, 20.0, 18.0, w8a16=30.0),  # _scaled_mm faster: the kernel is not taken
            _entry(256, 6144, 4096, 30.0, 31.0),  # past 128 rows no W8A16 time: W8A8 always
            _entry(64, 6144, 4096, 25.0, 24.0, w8a16=23.0),  # W8A16 beats both W8A8 GEMMs
        ]
    )
    assert fp8_gemm.takes(64, 4096, 4096) and fp8_gemm.takes(33, 4096, 4096)  # 33 rows: bucket 64
    assert not fp8_gemm.takes(128, 4096, 4096) and not fp8_gemm.takes(65, 6144, 4096)  # no bucket-128 entry
    assert fp8_gemm.takes(256, 6144, 4096) and fp8_gemm.takes(129, 6144, 4096)
    assert not fp8_gemm.takes(257, 6144, 4096) and not fp8_gemm.takes(0, 4096, 4096)
    assert fp8_gemm.table_config(40, 4096, 4096) == (64, 64, 128, 1, 4, 4)
    assert fp8.uses_activation_quant(64, 4096, 4096) and fp8.uses_activation_quant(32, 4096, 4096)
    assert fp8.uses_activation_quant(31, 4096, 4096)  # bucket 32's top is fused: every row of the bucket decides alike
    assert not fp8.uses_activation_quant(64, 4096, 4096, fused_input=False)  # o_proj pays the pass: 13 > 12: W8A16
    assert not fp8.uses_activation_quant(20, 4096, 4096, fused_input=False)
    assert fp8.uses_activation_quant(128, 4096, 4096)  # _scaled_mm's 18 < 30
    assert not fp8.uses_activation_quant(64, 6144, 4096)  # 23 < 24
    assert not fp8.uses_activation_quant(16, 4096, 4096)  # <= 16 rows: W8A16 whatever the table says
    assert fp8.producer_quantizes(64, 4096, 4096) and not fp8.producer_quantizes(64, 6144, 4096)
    text = fp8.describe_dispatch()
    assert "W8A8 GEMM Triton kernel at 3 measured (rows bucket, N, K) of buckets 32, 64, 256 rows, else " in text
    assert "torch._scaled_mm (table 5 entries from " in text, text
    table([])
    assert not fp8_gemm.takes(64, 4096, 4096)
    assert "W8A8 GEMM torch._scaled_mm (Triton W8A8 table 0 entries from " in fp8.describe_dispatch()


def test_bad_table_config_and_arguments(table):
    pytest.importorskip("triton")
    from spanllm.kernels import fp8_gemm

    bad = _entry(64, 4096, 4096, 10.0, 15.0)
    table([bad | {"config": [48, 64, 128, 1, 4, 4]}])
    with pytest.raises(RuntimeError, match=r"W8A8 GEMM table .* \(set by SPANLLM_FP8_GEMM_TABLE\).*block_n=48"):
        fp8_gemm.measured_table()
    table([{k: v for k, v in bad.items() if k != "quant_us"}])
    with pytest.raises(RuntimeError, match="quant_us"):
        fp8_gemm.measured_table()
    with pytest.raises(ValueError, match="block_k >= 32"):
        fp8_gemm.check_config((64, 16, 16, 1, 4, 2))
    with pytest.raises(ValueError, match="block_m >= 16"):
        fp8_gemm.check_config((64, 8, 64, 1, 4, 2))
    x, w = torch.zeros(2, 64, dtype=FP8), torch.zeros(32, 64, dtype=FP8)
    with pytest.raises(ValueError, match=r"x_q and weight must be torch.float8_e4m3fn, got torch.bfloat16"):
        fp8_gemm.w8a8_linear(x.bfloat16(), torch.ones(2), w, torch.ones(32), torch.bfloat16)
    with pytest.raises(ValueError, match=r"same K, got \(2, 64\) and \(32, 48\)"):
        fp8_gemm.w8a8_linear(x, torch.ones(2), w[:, :48], torch.ones(32), torch.bfloat16)
    with pytest.raises(ValueError, match=r"x_scale must be float32 with M=2 values"):
        fp8_gemm.w8a8_linear(x, torch.ones(3), w, torch.ones(32), torch.bfloat16)
    with pytest.raises(ValueError, match=r"weight_scale must be float32 \[N=32\]"):
        fp8_gemm.w8a8_linear(x, torch.ones(2), w, torch.ones(32, dtype=torch.float64), torch.bfloat16)
    if not INTERPRETED:
        with pytest.raises(ValueError, match="must be on a CUDA device"):
            fp8_gemm.w8a8_linear(x, torch.ones(2), w, torch.ones(32), torch.bfloat16)


def test_default_config_fills_the_gpu():
    from spanllm.kernels import fp8_gemm

    assert fp8_gemm.default_config(64, 4096, 4096) == (64, 64, 128, 4, 4, 4)  # 64 tiles x 4 splits
    assert fp8_gemm.default_config(200, 28672, 4096) == (64, 128, 128, 1, 4, 4)  # 896 programs: no split
    assert fp8_gemm.default_config(20, 64, 96).block_k == 128  # K 96: one 128-wide tile (masked tail)


def test_committed_table_is_valid_when_present():
    from spanllm.kernels import fp8_gemm

    if os.environ.get(fp8_gemm.TABLE_ENV):
        pytest.skip("SPANLLM_FP8_GEMM_TABLE points elsewhere")
    for (mb, n, k), e in fp8_gemm.measured_table().items():
        assert fp8_gemm.m_bucket(mb) == mb <= fp8_gemm.MAX_M and n % 16 == 0 and k % 16 == 0, (mb, n, k)
        assert e.kernel_us > 0 and e.scaled_mm_us > 0 and e.quant_us > 0
        assert (e.w8a16_us is None) == (mb > 128), (mb, n, k, e)


@pytest.mark.parametrize("pdl_on", [False, True])
def test_compiles_for_hopper_with_wgmma_and_cp_async(pdl_on):
    if INTERPRETED:
        pytest.skip("compiles real kernels: not under TRITON_INTERPRET=1")
    hopper = _load("_hopper_compile", os.path.join(ROOT, "tests", "kernels", "hopper_compile.py"))
    why = hopper.available()
    if why:
        pytest.skip(why)
    import triton
    from triton.backends.compiler import GPUTarget

    from spanllm.kernels import fp8_gemm

    sig = {"x_ptr": "*fp8e4nv", "xs_ptr": "*fp32", "w_ptr": "*fp8e4nv", "ws_ptr": "*fp32", "y_ptr": "*bf16",
           "part_ptr": "*fp32", "cnt_ptr": "*i32", "M": "i32", "N": "i32", "K": "i32", "k_chunk": "i32",
           "stride_xm": "i32", "stride_wn": "i32", "stride_ym": "i32"}  # fmt: skip
    names = list(sig)
    registers = _load("_sm90_registers", os.path.join(ROOT, "scripts", "sm90_registers.py"))
    for block_m, split in ((16, 1), (64, 4), (128, 2)):
        consts = {"BLOCK_N": 64, "BLOCK_M": block_m, "BLOCK_K": 128, "SPLIT_K": split, "EVEN_K": True,
                  "NUM_STAGES": 4, "PDL": pdl_on, "PROMOTE_K": 128}  # fmt: skip
        sig_c = sig | {c: "constexpr" for c in consts}
        # what Triton's launcher specializes: 16-byte aligned pointers, sizes multiples of 16 (M is any size)
        attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in names if a != "M"}
        src = triton.compiler.ASTSource(fn=fp8_gemm._w8a8_kernel, signature=sig_c, constexprs=consts, attrs=attrs)
        kern = triton.compile(src, target=GPUTarget(*hopper.TARGET), options={"num_warps": 4, "num_stages": 4})
        ptx = kern.asm["ptx"]
        assert f"wgmma.mma_async.sync.aligned.m64n{block_m}k32.f32.e4m3.e4m3" in ptx, block_m
        assert "cp.async.cg.shared.global" in ptx
        assert ("griddepcontrol.wait" in ptx) == pdl_on
        if pdl_on:
            assert "ld.global" not in ptx[: ptx.index("griddepcontrol.wait")]  # nothing is read before the wait
        report = registers.ptxas_report(ptx)
        assert report["spill_stores_bytes"] == 0 and report["registers"] < 255, report  # not at the cap


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU with FP8 tensor cores")
@pytest.mark.parametrize("m", [1, 17, 64, 200])
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 14336)])
def test_gpu_against_reference_and_scaled_mm(m, n, k):
    from spanllm.kernels import fp8_gemm
    from spanllm.kernels.fp8_quant import quantize_per_token
    from spanllm.layers.fp8 import quantize_weight

    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("no FP8 tensor cores")
    g = torch.Generator(device="cuda").manual_seed(m + n)
    w, ws = quantize_weight(torch.randn(n, k, device="cuda", generator=g) / k**0.5)
    xq, xs = quantize_per_token(torch.randn(m, k, device="cuda", generator=g, dtype=torch.bfloat16))
    ref = (xq.float() * xs) @ (w.float() * ws[:, None]).t()
    theirs = torch._scaled_mm(xq, w.t(), scale_a=xs, scale_b=ws.view(1, -1), out_dtype=torch.bfloat16)
    for cfg in (None, (64, 16, 128, 4, 4, 4), (128, 64, 256, 2, 8, 3), (64, 32, 64, 1, 4, 4)):
        # fp32 out: the sums alone. FP8 products kept in the MMA's narrow accumulator over all of K (Triton's
        # default on sm_90, _scaled_mm's use_fast_accum) drift past this bound at these K; promoted into fp32 every
        # 128 products, as _scaled_mm without fast accumulation, they stay well inside it
        y32 = fp8_gemm.w8a8_linear(xq, xs, w, ws, torch.float32, config=cfg)
        assert ((y32 - ref).abs().max() / ref.abs().max()).item() < 5e-4, cfg
        y = fp8_gemm.w8a8_linear(xq, xs, w, ws, torch.bfloat16, config=cfg)
        # fp32 sums in another order than the reference's, then one bf16 rounding (2^-8 relative)
        err = ((y.float() - ref).abs().max() / ref.abs().max()).item()
        assert err < 2**-7, (cfg, err)
        assert ((y.float() - theirs.float()).abs().max() / ref.abs().max()).item() < 2**-7, cfg
        assert torch.equal(y, fp8_gemm.w8a8_linear(xq, xs, w, ws, torch.bfloat16, config=cfg))  # reruns: bit-equal
