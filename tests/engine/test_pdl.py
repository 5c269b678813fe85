"""Programmatic dependent launch (spanllm.kernels.pdl): the mode's resolution and refusals, and what a launch site
is given. That PDL changes no result is checked on a Hopper GPU (tests/engine/test_gpu_engine.py)."""

from __future__ import annotations

import pytest
import torch

from spanllm.engine.config import EngineConfig
from spanllm.kernels import pdl


def test_auto_and_off_are_off_on_cpu_and_on_is_refused():
    cpu = torch.device("cpu")
    assert pdl.resolve("auto", cpu) is False and pdl.resolve("off", cpu) is False
    with pytest.raises(
        ValueError,
        match=r"pdl='on': programmatic dependent launch needs a CUDA GPU of compute "
        r"capability >= 9.0 \(Hopper\) and Triton; this rank runs on device cpu",
    ):
        pdl.resolve("on", cpu)
    with pytest.raises(ValueError, match=r"pdl='sometimes' must be one of \('auto', 'on', 'off'\)"):
        pdl.resolve("sometimes", cpu)


def test_launch_options_inside_the_scope_and_only_for_cuda_tensors():
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")  # no GPU needed: nothing is launched
    assert pdl.launch_options(cuda) == {"PDL": False}  # outside any forward: off
    with pdl.launching(True):
        assert pdl.launch_options(cuda) == {"PDL": True, "launch_pdl": True}
        # CPU tensors (Triton's interpreter) never get the attribute or the PTX
        assert pdl.launch_options(cpu) == {"PDL": False}
        with pdl.launching(False):  # another engine's forward inside (nested scopes restore)
            assert pdl.launch_options(cuda) == {"PDL": False}
        assert pdl.launch_options(cuda) == {"PDL": True, "launch_pdl": True}
    assert pdl.launch_options(cuda) == {"PDL": False}
    with pytest.raises(RuntimeError), pdl.launching(True):
        raise RuntimeError("a forward that fails")
    assert pdl.launch_options(cuda) == {"PDL": False}  # restored by the failure too


def test_every_kernel_of_the_forward_waits_then_releases_first():
    """Each Triton kernel launched through launch_options takes the PDL constexpr and begins with
    wait_then_release(PDL) (after its docstring): nothing may touch memory before the wait, but the skinny GEMM's
    prefetch of its weights into L2 (a hint on memory no kernel writes)."""
    import ast
    import inspect

    from spanllm.kernels import cascade_merge, fp8_quant, fused_ops, paged_attention, skinny_gemm

    launched = 0
    for module in (fused_ops, skinny_gemm, fp8_quant, paged_attention, cascade_merge):
        tree = ast.parse(inspect.getsource(module))
        kernels = {
            n.name: n
            for n in ast.walk(tree)
            if isinstance(n, ast.FunctionDef) and any("jit" in ast.unparse(d) for d in n.decorator_list)
        }
        for call in ast.walk(tree):
            if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Subscript)):
                continue
            name = ast.unparse(call.func.value)
            if name not in kernels:
                continue
            # **launch_options(device), or **launch where launch = launch_options(device)
            spread = [ast.unparse(k.value) for k in call.keywords if k.arg is None]
            assert spread and all(v == "launch" or v.startswith("launch_options(") for v in spread), name
            if spread == ["launch"]:
                assert "launch = launch_options(" in ast.unparse(tree), name
            body = kernels[name].body
            if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                body = body[1:]
            if name == "_skinny_gemm_kernel":  # the weight prefetch into L2 (never a load) may come first
                first = ast.unparse(body[0])
                assert first.startswith("if PREFETCH:") and "tl.load" not in first and "_prefetch_w_tiles(" in first
                body = body[1:]
            assert ast.unparse(body[0]) == "wait_then_release(PDL)", name
            assert "PDL" in [a.arg for a in kernels[name].args.args], name
            launched += 1
    # rope + cache, add + RMSNorm, SiLU x up (two), the skinny GEMM, per-token quantization, decode, shared
    # prefix, prefill, the cascade's merge
    assert launched == 10


def test_weight_prefetch_budget(monkeypatch):
    from spanllm.kernels import skinny_gemm as sg

    monkeypatch.delenv(sg.PREFETCH_ENV, raising=False)
    assert sg.prefetch_budget() == 0  # measured slower than none (results/h100/pdl/)
    assert sg.prefetch_tiles(96, 8, 32 << 10) == 0
    monkeypatch.setenv(sg.PREFETCH_ENV, str(16 << 20))
    assert sg.prefetch_budget() == 16 << 20
    # 96 programs of 32 KiB tiles: 16 MiB / 3 MiB = 5 tiles each; never more than a program's own 4
    assert sg.prefetch_tiles(96, 8, 32 << 10) == 5 and sg.prefetch_tiles(96, 4, 32 << 10) == 4
    assert sg.prefetch_tiles(4096, 8, 32 << 10) == 0  # a grid too big for the budget prefetches nothing
    monkeypatch.setenv(sg.PREFETCH_ENV, "0")
    assert sg.prefetch_tiles(96, 8, 32 << 10) == 0
    monkeypatch.setenv(sg.PREFETCH_ENV, "-1")
    with pytest.raises(ValueError, match="SPANLLM_SKINNY_PREFETCH_BYTES=-1: must be >= 0"):
        sg.prefetch_budget()
    monkeypatch.setenv(sg.PREFETCH_ENV, "lots")
    with pytest.raises(ValueError, match="SPANLLM_SKINNY_PREFETCH_BYTES='lots': a number of bytes"):
        sg.prefetch_budget()


def test_every_command_defaults_to_auto():
    """The engine commands' --pdl, the study's settings and EngineConfig agree: auto (on where supported)."""
    import argparse
    import dataclasses

    from spanllm.commands import bench_batch
    from spanllm.commands.engine_args import add_engine_arguments, add_model_arguments

    ap = argparse.ArgumentParser()
    add_model_arguments(ap)
    add_engine_arguments(ap)
    assert ap.parse_args(["--model", "tiny"]).pdl == "auto"
    bench = argparse.ArgumentParser()
    bench_batch.add_arguments(bench)
    assert bench.parse_args(["--model", "tiny"]).pdl == "auto"
    field = {f.name: f for f in dataclasses.fields(bench_batch.BenchSettings)}["pdl"]
    assert field.default == "auto" == EngineConfig().pdl


def test_engine_config_validates_the_mode():
    assert EngineConfig().pdl == "auto"  # on where supported: off on CPU (below)
    with pytest.raises(ValueError, match=r"pdl='yes' must be one of \('auto', 'on', 'off'\)"):
        EngineConfig(pdl="yes")


def test_a_cpu_engine_reports_pdl_off():
    from spanllm.engine.llm import LLM
    from spanllm.model.config import resolve_model

    llm = LLM(
        resolve_model("tiny"), EngineConfig(dtype=torch.float32, pdl="auto", max_num_seqs=2, max_num_batched_tokens=64)
    )
    assert llm.pdl is False and "PDL off" in llm.describe()
