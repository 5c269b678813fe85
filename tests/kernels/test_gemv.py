"""The CUDA-core GEMV (spanllm.kernels.gemv), its measured table and the skinny GEMM's one-row dispatch to it, on CPU.

- Under Triton's interpreter (a child pytest with TRITON_INTERPRET=1, `test_interpreter_suite`): FP8 and bf16
  weights against the fp32 reference, split-K 1 / 2 / 4 (the merge in split order: reruns are bit-identical), an N
  tail (rows wrapped, never stored); `skinny_linear` at one row runs it exactly where the table measured it faster.
- Compiled for sm_90 (Triton's compiler and ptxas, no GPU): the loads are staged by cp.async, no spills.
- The table's rules (takes / beats_torch), refusals, and the sweep script's configs (scripts/gpu_gemv.py).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch
from kernel_table import use_entries

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "scripts", "gpu_gemv.py")
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def _load(name: str, path: str):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


shims = _load("_triton_interpreter_shims", os.path.join(ROOT, "tests", "engine", "triton_interpreter.py"))


@pytest.fixture
def table(tmp_path, monkeypatch):
    """Point the GEMV table at a file of the given entries (the caches cleared before and after)."""
    from spanllm.kernels import gemv, skinny_gemm

    caches = (gemv._read_table, skinny_gemm.prefer_skinny)
    yield from use_entries(tmp_path, monkeypatch, "gemv_configs.json", gemv.TABLE_ENV, caches)


@pytest.fixture
def interp(monkeypatch):
    shims.require_interpreter(monkeypatch)
    shims.widen_bf16_dot(monkeypatch)  # the skinny kernel's bf16 tl.dot, compared with the GEMV below


def _weight(dtype: str, n: int, k: int, seed: int):
    from spanllm.layers.fp8 import quantize_weight

    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * 0.02).to(torch.bfloat16)
    x = torch.randn(1, k, generator=g).to(torch.bfloat16)
    return (x, *quantize_weight(w)) if dtype == "fp8" else (x, w, None)


def _reference(x, w, scale):
    wf = w.float() if scale is None else w.float() * scale[:, None]
    return x.float() @ wf.T


# (N, K, config): an N tail under 16-row tiles with split 2; split 4 over 8 K tiles; no split, one K tile a program
CASES = [(70, 256, (16, 64, 2, 4, 2)), (64, 512, (8, 64, 4, 4, 3)), (48, 128, (32, 128, 1, 4, 2))]


@pytest.mark.parametrize("dtype", ["fp8", "bf16"])
@pytest.mark.parametrize("n,k,config", CASES)
def test_interp_gemv(interp, dtype, n, k, config):
    from spanllm.kernels import gemv

    x, w, scale = _weight(dtype, n, k, n + k)
    y = gemv.gemv(x, w, config, weight_scale=scale)
    assert y.shape == (1, n) and y.dtype == torch.bfloat16
    ref = _reference(x, w, scale)
    err = ((y.float() - ref).abs().max() / ref.abs().max()).item()
    assert err < 1e-2, f"max rel error {err:.3g}"
    assert torch.equal(y, gemv.gemv(x, w, config, weight_scale=scale))  # the split merge sums in a fixed order
    # the sum itself: fp32 partial sums per split chunk, added in split order, scaled, rounded once
    split = gemv.effective_split_k(k, config[1], config[2])
    chunk = gemv.split_k_chunk(k, config[1], split)
    wf = w.float()
    parts = [x.float()[:, i * chunk : (i + 1) * chunk] @ wf[:, i * chunk : (i + 1) * chunk].T for i in range(split)]
    total = sum(parts[1:], parts[0]) if split > 1 else parts[0]
    if scale is not None:
        total = total * scale
    assert (y.float() - total).abs().max().item() <= 2**-7 * total.abs().max().item()


@pytest.mark.parametrize("dtype", ["fp8", "bf16"])
def test_interp_split_merge_sums_in_split_order(interp, dtype):
    """Chunk partials 2^20, -2^20, 2^-5 (one weight of 1 times x per chunk): summed in split order from zero they
    give 2^-5 exactly; any other order loses it to fp32 rounding (2^20 + 2^-5 needs 25 bits)."""
    from spanllm.kernels import gemv

    k, n = 3 * 64, 16
    x = torch.zeros(1, k, dtype=torch.bfloat16)
    x[0, 0], x[0, 64], x[0, 128] = 2.0**20, -(2.0**20), 2.0**-5
    w = torch.ones(n, k, dtype=torch.bfloat16)
    scale = None
    if dtype == "fp8":
        w, scale = w.to(torch.float8_e4m3fn), torch.ones(n)
    y = gemv.gemv(x, w, (16, 64, 3, 4, 2), weight_scale=scale)
    assert y.float().eq(2.0**-5).all(), y


@pytest.mark.parametrize("dtype", ["fp8", "bf16"])
def test_interp_skinny_linear_takes_gemv_where_measured_faster(interp, table, dtype, monkeypatch):
    from spanllm.kernels import gemv, skinny_gemm

    n, k = 64, 256
    x, w, scale = _weight(dtype, n, k, 7)
    eb = w.element_size()
    cfg = [16, 128, 2, 4, 2]
    table([{"n": n, "k": k, "elem_bytes": eb, "config": cfg, "gemv_us": 5.0, "skinny_us": 6.0, "torch_us": 7.0}])
    assert gemv.takes(n, k, eb)
    calls = []
    real = gemv.gemv
    monkeypatch.setattr(gemv, "gemv", lambda *a, **kw: calls.append(a[1].shape) or real(*a, **kw))
    via_skinny = skinny_gemm.skinny_linear(x, w, weight_scale=scale)
    assert calls == [(n, k)] and torch.equal(via_skinny, real(x, w, cfg, weight_scale=scale))
    skinny_gemm.skinny_linear(x, w, config=(16, 128, 1, 4, 2), weight_scale=scale)  # an explicit skinny config
    skinny_gemm.skinny_linear(torch.cat([x, x]), w, weight_scale=scale)  # two rows
    assert calls == [(n, k)]
    err = ((via_skinny.float() - _reference(x, w, scale)).abs().max() / _reference(x, w, scale).abs().max()).item()
    assert err < 1e-2
    assert skinny_gemm.prefer_skinny(1, n, k, eb)  # the GEMV (5 us) beat F.linear (7 us): the skinny path takes it
    # two rows, or an explicit skinny config: the skinny kernel (its own sum order differs from the GEMV's)
    two = skinny_gemm.skinny_linear(torch.cat([x, x]), w, weight_scale=scale)
    assert torch.equal(two[0], two[1])
    two_ref = _reference(torch.cat([x, x]), w, scale)
    assert ((two.float() - two_ref).abs().max() / two_ref.abs().max()).item() < 1e-2
    table([{"n": n, "k": k, "elem_bytes": eb, "config": cfg, "gemv_us": 6.0, "skinny_us": 6.0}])  # a tie: skinny
    assert not gemv.takes(n, k, eb)
    assert torch.equal(skinny_gemm.skinny_linear(x, w, weight_scale=scale), two[:1])
    assert calls == [(n, k)]


def test_interpreter_suite():
    if INTERPRETED:
        pytest.skip("this is the child")
    pytest.importorskip("triton")
    shims.run_child_suite(__file__, 2 * len(CASES) + 4, "interp_")


def _entry(n: int, elem_bytes: int, gemv_us: float, skinny_us: float, torch_us: float | None = None) -> dict:
    """A GEMV table entry of W [n, 256] at the config (16, 128, 2, 4, 2), with its times."""
    times = {"gemv_us": gemv_us, "skinny_us": skinny_us} | ({} if torch_us is None else {"torch_us": torch_us})
    return {"n": n, "k": 256, "elem_bytes": elem_bytes, "config": [16, 128, 2, 4, 2], **times}


def test_table_rules(table):
    from spanllm.kernels import gemv, skinny_gemm

    pytest.importorskip("triton")
    table([_entry(64, 2, 5, 6, torch_us=4), _entry(96, 2, 5, 6, torch_us=9), _entry(64, 1, 7, 6)])
    assert gemv.takes(64, 256, 2) and not gemv.beats_torch(64, 256, 2)  # faster than skinny, slower than F.linear
    assert gemv.takes(96, 256, 2) and gemv.beats_torch(96, 256, 2)
    assert not gemv.takes(64, 256, 1) and not gemv.takes(128, 256, 2)
    assert skinny_gemm.prefer_skinny(1, 96, 256, 2)  # F.linear loses to the GEMV at one row
    assert not skinny_gemm.prefer_skinny(2, 96, 256, 2)  # two rows: the skinny table decides (no entry: F.linear)
    gemms = [("qkv", 96, 256, 2), ("o", 64, 256, 1), ("down", 64, 256, 2)]
    assert gemv.describe_one_row(gemms).startswith("CUDA-core GEMV qkv, down (table 3 entries from ")
    text = skinny_gemm.describe_auto(gemms)
    # one row: qkv on the GEMV (it beat F.linear), down stays on F.linear (the GEMV lost to it), o (FP8) too
    assert text.startswith("1 row: CUDA-core GEMV qkv (table 3 entries from ") and text.count("GEMV") == 1, text
    assert "; skinny -; F.linear o, down | 2-16 rows: skinny -; F.linear qkv, o, down" in text, text
    table([_entry(64, 2, 6, 6, torch_us=9), _entry(96, 2, 5, 6)])
    assert not gemv.takes(64, 256, 2)  # a tie keeps the skinny GEMM
    assert gemv.takes(96, 256, 2) and not gemv.beats_torch(96, 256, 2)  # F.linear never timed: never replaced
    assert gemv.describe_one_row(gemms).startswith("CUDA-core GEMV qkv (table 2 entries")  # where skinny_linear runs
    assert skinny_gemm.describe_auto(gemms) == "1-16 rows: skinny -; F.linear qkv, o, down"  # auto keeps F.linear
    split_chunk = lambda k, bk, s: (gemv.effective_split_k(k, bk, s), gemv.split_k_chunk(k, bk, s))  # noqa: E731
    assert split_chunk(512, 128, 16) == (4, 128) and split_chunk(1024, 128, 3) == (3, 384)


def test_bad_table_and_refusals(table, tmp_path, monkeypatch):
    from spanllm.kernels import gemv

    pytest.importorskip("triton")
    table([{"n": 64, "k": 256, "elem_bytes": 2, "config": [12, 128, 1, 4, 2], "gemv_us": 5, "skinny_us": 6}])
    with pytest.raises(RuntimeError, match=r"GEMV table .*gemv_configs.json \(set by SPANLLM_GEMV_TABLE\).*block_n=12"):
        gemv.measured_table()
    table([{"n": 64, "k": 256, "elem_bytes": 2, "config": [16, 512, 1, 4, 2], "gemv_us": 5, "skinny_us": 6}])
    with pytest.raises(RuntimeError, match="BLOCK_K dividing K"):
        gemv.measured_table()
    table([{"n": 64, "k": 256, "elem_bytes": 2, "config": [16, 128, 1, 4, 2], "gemv_us": 5}])
    with pytest.raises(RuntimeError, match="gemv_us and skinny_us"):
        gemv.measured_table()
    table([])
    x, w = torch.zeros(1, 256, dtype=torch.bfloat16), torch.zeros(64, 256, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"no measured config for weight \(64, 256\).*pass config= or measure"):
        gemv.gemv(x, w)
    with pytest.raises(ValueError, match="K=256 is not a multiple of BLOCK_K=512"):
        gemv.gemv(x, w, (16, 512, 1, 4, 2))
    with pytest.raises(ValueError, match="one row of K=256"):
        gemv.gemv(torch.zeros(2, 256, dtype=torch.bfloat16), w, (16, 128, 1, 4, 2))
    with pytest.raises(ValueError, match="FP8 needs weight_scale"):
        gemv.gemv(x, w.to(torch.float8_e4m3fn), (16, 128, 1, 4, 2))
    if not INTERPRETED:
        with pytest.raises(ValueError, match="must be on a CUDA device"):
            gemv.gemv(x, w, (16, 128, 1, 4, 2))


def test_committed_table_is_valid_when_present():
    from spanllm.kernels import gemv

    if os.environ.get(gemv.TABLE_ENV):
        pytest.skip("SPANLLM_GEMV_TABLE points elsewhere")
    entries = gemv.measured_table()
    for (n, k, eb), e in entries.items():
        assert k % e["config"].block_k == 0 and eb in (1, 2), (n, k, eb, e)
        assert e["gemv_us"] > 0 and e["skinny_us"] > 0


@pytest.mark.parametrize("dtype,stages", [("fp8", 3), ("bf16", 3), ("fp8", 2)])
def test_compiles_sm90_staged_without_spills(dtype, stages):
    if INTERPRETED:
        pytest.skip("compiles real kernels: not under TRITON_INTERPRET=1")
    hopper = _load("_hopper_compile", os.path.join(ROOT, "tests", "kernels", "hopper_compile.py"))
    why = hopper.available()
    if why:
        pytest.skip(why)
    import triton
    from triton.backends.compiler import GPUTarget

    from spanllm.kernels import gemv

    wt = "fp8e4nv" if dtype == "fp8" else "bf16"
    sig = {"x_ptr": "*bf16", "w_ptr": f"*{wt}", "y_ptr": "*bf16", "ws_ptr": "*fp32", "cnt_ptr": "*i32",
           "scale_ptr": "*fp32", "N": "i32", "K": "i32", "k_chunk": "i32", "stride_wn": "i32"}  # fmt: skip
    names = list(sig)
    consts = {"BLOCK_N": 16, "BLOCK_K": 512, "SPLIT_K": 2, "HAS_SCALE": dtype == "fp8", "NUM_STAGES": stages,
              "PDL": True}  # fmt: skip
    sig.update({c: "constexpr" for c in consts})
    # what Triton's launcher specializes for these tensors and sizes: 16-byte aligned pointers, multiples of 16
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in names}
    src = triton.compiler.ASTSource(fn=gemv._gemv_kernel, signature=sig, constexprs=consts, attrs=attrs)
    kern = triton.compile(src, target=GPUTarget(*hopper.TARGET), options={"num_warps": 4, "num_stages": stages})
    ptx = kern.asm["ptx"]
    assert "cp.async.cg.shared.global" in ptx and "griddepcontrol.wait" in ptx
    assert "ld.global" not in ptx[: ptx.index("griddepcontrol.wait")]  # nothing is read before the wait
    report = _load("_sm90_registers", os.path.join(ROOT, "scripts", "sm90_registers.py")).ptxas_report(ptx)
    assert report["spill_stores_bytes"] == 0 and report["registers"] <= 128, report


def test_sweep_configs():
    pytest.importorskip("triton")
    sweep = _load("gpu_gemv", SCRIPT)
    for n, k in {**sweep.LAYERS, **sweep.LM_HEAD}.values():
        configs = sweep.stage1(n, k, 132)
        assert len(configs) == len(set(configs)) >= 8
        for c in configs:
            assert k % c.block_k == 0 and (k // c.block_k) >= 2 * c.split_k
            assert c.block_n * c.block_k / (32 * c.num_warps) <= sweep.MAX_ACC_PER_THREAD
            tiles = -(-n // c.block_n)
            # >= 4 programs per SM unless K ran out of chunks of 2 tiles
            assert tiles * c.split_k >= 4 * 132 or (k // c.block_k) < 4 * c.split_k
        for c in sweep.stage2(configs[0], k):
            assert k % c.block_k == 0 and c.split_k >= 1 and c != configs[0]
    assert sweep.split_for(4096, 4096, 16, 512, 132) == 4  # 256 tiles: 2 programs an SM at split 2, 4 at split 4


def test_script_without_gpu_exits_with_one_line():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    pytest.importorskip("triton")
    r = subprocess.run(
        [sys.executable, SCRIPT, "/tmp/unused_gemv"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": ROOT},
        timeout=120,
    )
    assert r.returncode != 0
    assert r.stderr.strip().splitlines()[-1] == "scripts/gpu_gemv.py: needs a CUDA GPU; none found"
