"""Compile the forward's Triton kernels for Hopper (sm_90) on a machine without a GPU: Triton's own compiler and the
ptxas it ships, ahead of time. The kernels' wrappers run as they do on a GPU, except that each launch is caught and
compiled instead of run (`capture`), so the variants compiled are exactly what the engine would launch: the
argument types, the constexprs, num_warps / num_stages and the PDL launch option.

A compile proves the kernel is valid Triton for the GPU backend (types, layouts, the inline PTX, the FP8
conversions, register and shared-memory limits at ptxas time): what Triton's interpreter, which the CPU tests run,
cannot show. It proves nothing about the numbers; the GPU tests do that."""

from __future__ import annotations

import contextlib

import torch

TARGET = ("cuda", 90, 32)  # Hopper: compute capability 9.0, warps of 32
_TYPES = {
    torch.float32: "fp32",
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.float8_e4m3fn: "fp8e4nv",
    torch.int32: "i32",
    torch.int64: "i64",
    torch.uint8: "u8",
}
LAUNCH_OPTIONS = ("num_warps", "num_stages", "launch_pdl", "enable_fp_fusion")


def available() -> str | None:
    """None when this machine can compile for sm_90 (Triton with its NVIDIA backend and ptxas), else why not."""
    try:
        import triton
        from triton.backends.compiler import GPUTarget  # noqa: F401
        from triton.backends.nvidia.compiler import get_ptxas  # noqa: F401
    except ImportError as e:
        return f"Triton's NVIDIA backend is missing: {e}"
    del triton
    return None


def signature_of(fn, args: tuple, kwargs: dict) -> tuple[dict, dict, dict]:
    """(signature, constexprs, options) of one launch of JITFunction `fn` with these arguments."""
    values = dict(zip([p.name for p in fn.params], args))
    values.update({k: v for k, v in kwargs.items() if k not in LAUNCH_OPTIONS})
    sig, consts = {}, {}
    for p in fn.params:
        v = values[p.name]
        if p.is_constexpr:
            sig[p.name], consts[p.name] = "constexpr", v
        elif isinstance(v, torch.Tensor):
            sig[p.name] = "*" + _TYPES[v.dtype]
        elif isinstance(v, bool):
            sig[p.name] = "i1"
        elif isinstance(v, int):
            sig[p.name] = "i64" if abs(v) >= 2**31 else "i32"
        elif isinstance(v, float):
            sig[p.name] = "fp32"
        else:
            raise TypeError(f"{fn.__name__}: argument {p.name}={v!r} of a type this harness does not map")
    options = {k: kwargs[k] for k in LAUNCH_OPTIONS if k in kwargs}
    return sig, consts, options


def compile_launch(fn, args: tuple, kwargs: dict):
    """Compile one caught launch for sm_90; returns Triton's compiled kernel (its .asm holds ptx and cubin)."""
    import triton
    from triton.backends.compiler import GPUTarget

    sig, consts, options = signature_of(fn, args, kwargs)
    src = triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=consts)
    return triton.compile(src, target=GPUTarget(*TARGET), options=options)


@contextlib.contextmanager
def capture(monkeypatch, pdl_on: bool):
    """Inside: every JITFunction launch is recorded (fn, args, kwargs) instead of run, the kernels' wrappers take
    CPU tensors as they take CUDA ones, and launch_options says what it says on a Hopper GPU (PDL on or off)."""
    from triton.runtime.jit import JITFunction

    from spanllm.kernels import fp8_gemm, fp8_quant, fused_ops, gemv, interpreter, skinny_gemm

    launches: list = []

    def run(self, *args, grid, warmup, **kwargs):
        launches.append((self, args, kwargs))

    def launch_options(device):
        return {"PDL": True, "launch_pdl": True} if pdl_on else {"PDL": False}

    monkeypatch.setattr(JITFunction, "run", run)
    monkeypatch.setattr(interpreter, "interpreting", lambda: True)
    for module in (fused_ops, fp8_gemm, fp8_quant, gemv, skinny_gemm):
        monkeypatch.setattr(module, "launch_options", launch_options)
    import spanllm.kernels.paged_attention as pa

    monkeypatch.setattr(pa, "launch_options", launch_options)
    yield launches
