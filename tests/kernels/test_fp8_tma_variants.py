"""The FP8 decode GEMV variants of scripts/gpu_fp8_tma.py (TMA loads, W as the MMA's A operand), on CPU.

- Under Triton's interpreter (a child pytest with TRITON_INTERPRET=1, `test_interpreter_suite`): every variant
  against the fp32 reference within the script's TOL and bit for bit equal to production's skinny_linear (the same
  products summed in the same order), with split-K, an N tail (zero-filled by the descriptor, wrapped by the pointer
  variant), a K tail (TMA variants only: the pointer variant refuses it) and M = 1, 3 and 16. Host-made tensor
  descriptors run in the interpreter as they do on the GPU.
- Compiled for sm_90 with Triton's own compiler and ptxas (no GPU): the TMA variants issue bulk tensor copies
  (`cp.async.bulk.tensor`) and keep no spills; with BLOCK_N >= 64 and W as the A operand the MMA is Hopper's wgmma.
- Without a GPU the script exits non-zero with one line.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "scripts", "gpu_fp8_tma.py")
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def _load(name: str, path: str):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


tma = _load("gpu_fp8_tma", SCRIPT)
shims = _load("_triton_interpreter_shims", os.path.join(ROOT, "tests", "engine", "triton_interpreter.py"))


@pytest.fixture
def interp(monkeypatch):
    shims.require_interpreter(monkeypatch)
    shims.widen_bf16_dot(monkeypatch)
    return tma


# (N, K, config): split 2 with an N tail (96 rows of 64); a 130-row N tail under a 128-row tile, split 4; K = 208
# (a K tail: 128 + 80, zero-filled by the descriptor) with split 2 after rounding; M 16 uses the whole MMA tile.
CASES = [(96, 512, (64, 128, 2, 4, 2)), (130, 512, (128, 128, 4, 4, 2)), (70, 208, (32, 128, 2, 4, 2))]


@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize("n,k,config", CASES)
@pytest.mark.parametrize("variant", ["ptr_wx", "tma_xw", "tma_wx"])
def test_interp_variant(interp, variant, n, k, config, m):
    from spanllm.kernels import skinny_gemm as sg
    from spanllm.layers.fp8 import quantize_weight

    g = torch.Generator().manual_seed(n + k + m)
    q, scale = quantize_weight((torch.randn(n, k, generator=g) * 0.02).to(torch.bfloat16))
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    cfg = sg.SkinnyConfig(*config)
    why = interp.check_variant_config(variant, cfg, k)
    if why:
        assert variant == "ptr_wx" and k % cfg.block_k, why  # only the pointer variant refuses, and only a K tail
        with pytest.raises(ValueError, match="not a multiple of BLOCK_K"):
            interp.run_variant(variant, x, q, scale, cfg)
        return
    y, _ = interp.run_variant(variant, x, q, scale, cfg)
    assert y.shape == (m, n) and y.dtype == torch.bfloat16
    err = interp.max_rel_err(y, interp.reference(x, q, scale))
    assert err < interp.TOL, f"max rel error {err:.3g}"
    production = sg.skinny_linear(x, q, config=config, weight_scale=scale)
    assert torch.equal(y, production)


def test_interpreter_suite():
    if INTERPRETED:
        pytest.skip("this is the child")
    pytest.importorskip("triton")
    shims.run_child_suite(__file__, 3 * len(CASES) * 3, "interp_variant")


def test_candidates_fit_and_include_production():
    from spanllm.kernels import skinny_gemm as sg

    for n, k in tma.LAYERS.values():
        cands = tma.candidates(1, n, k, 132)
        assert cands[0] == sg.choose_config(1, n, k, 132, 1, x_bytes=2)
        assert len(set(cands)) == len(cands)
        for cfg in cands[1:]:
            assert 2 * cfg.num_stages * tma.stage_bytes(cfg, 16) <= tma.SMEM_PER_SM  # two programs per SM fit
            assert k % (cfg.block_k * cfg.split_k) == 0 or cfg.split_k == 1


@pytest.mark.parametrize(
    "variant,config,wgmma",
    [("tma_xw", (64, 256, 4, 4, 4), False), ("tma_wx", (64, 256, 4, 4, 4), True), ("ptr_wx", (64, 256, 4, 4, 4), True)],
)
def test_compiles_sm90(variant, config, wgmma):
    if INTERPRETED:
        pytest.skip("compiles real kernels: not under TRITON_INTERPRET=1")
    hopper = _load("_hopper_compile", os.path.join(ROOT, "tests", "kernels", "hopper_compile.py"))
    why = hopper.available()
    if why:
        pytest.skip(why)
    from spanllm.kernels import skinny_gemm as sg

    kern = tma.compile_sm90(variant, sg.SkinnyConfig(*config))
    ptx = kern.asm["ptx"]
    assert ("wgmma.mma_async" in ptx) == wgmma
    if variant.startswith("tma"):
        assert "cp.async.bulk.tensor" in ptx
        report = _load("_sm90_registers", os.path.join(ROOT, "scripts", "sm90_registers.py")).ptxas_report(ptx)
        assert report["spill_stores_bytes"] == 0 and report["registers"] < 128, report


def test_script_without_gpu_exits_with_one_line():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    pytest.importorskip("triton")
    r = subprocess.run(
        [sys.executable, SCRIPT, "/tmp/unused_fp8_tma"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": ROOT},
        timeout=120,
    )
    assert r.returncode != 0
    assert r.stderr.strip().splitlines()[-1] == (
        "scripts/gpu_fp8_tma.py: needs a Hopper GPU (tensor descriptors, wgmma); none found"
    )
