"""Patches for Triton 3.6's interpreter (TRITON_INTERPRET=1, kernels on CPU tensors), applied with a pytest
monkeypatch while an interpreter test runs; the GPU path needs neither.

- `patch_scalar_index`: the interpreter turns a scalar into an int with int(array of shape (1,)), which numpy
  >= 2.4 refuses (triton-lang/triton#9171), so every loop with a runtime bound fails: apply the upstream fix
  (squeeze first), only where numpy needs it.
- `widen_bf16_dot`: it stores bf16 (and e4m3) as raw bits and its tl.dot multiplies those bits as integers: widen
  bf16 and float8_e4m3fn operands to fp32 first (exact: every bf16 and e4m3 value is an fp32), which is what the
  tensor cores compute.
"""

from __future__ import annotations


def require_interpreter(monkeypatch) -> None:
    """For an interpreter test: skip unless this is the TRITON_INTERPRET=1 child with Triton's interpreter building the
    kernels, then apply `patch_scalar_index` (every such test needs it)."""
    import os

    import pytest

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("runs in the child pytest with TRITON_INTERPRET=1 (test_interpreter_suite)")
    pytest.importorskip("triton")
    from spanllm.kernels import interpreter

    if not interpreter.interpreting():
        pytest.skip("the kernels were not built by Triton's interpreter")
    patch_scalar_index(monkeypatch)


def patch_scalar_index(monkeypatch) -> None:
    import numpy as np
    from triton.runtime import interpreter

    try:
        int(np.array([1]))
    except TypeError:
        orig_patch = interpreter._patch_lang_tensor

        def patch_lang_tensor(tensor, scope):
            orig_patch(tensor, scope)
            scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

        monkeypatch.setattr(interpreter, "_patch_lang_tensor", patch_lang_tensor)


def widen_bf16_dot(monkeypatch) -> None:
    import numpy as np
    import triton
    from triton.runtime import interpreter

    orig_dot = interpreter.InterpreterBuilder.create_dot
    narrow = (triton.language.bfloat16, triton.language.float8e4nv)

    def widen(h):
        if h.dtype.scalar not in narrow:
            return h
        data = interpreter._convert_float(h.data, h.dtype.scalar, triton.language.float32, None).view(np.float32)
        return interpreter.TensorHandle(data, triton.language.float32)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return orig_dot(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", create_dot)


def run_child_suite(path: str, expected_passed: int, selection: str) -> None:
    """The interpreter tests of test file `path` (pytest -k `selection`) in a child pytest with
    TRITON_INTERPRET=1 set from the start (Triton decides at import whether it interprets): all of them must
    pass, none skip, exactly `expected_passed` of them."""
    import os
    import re
    import subprocess
    import sys

    env = {**os.environ, "TRITON_INTERPRET": "1"}
    env.pop("PYTEST_ADDOPTS", None)  # e.g. a --junitxml of the parent's: the child must not overwrite it
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            path,
            "-q",
            "-p",
            "no:cacheprovider",
            "-k",
            selection,
            "-W",
            "ignore::RuntimeWarning",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    summary = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else out.stderr[-2000:]
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    passed = int(re.search(r"(\d+) passed", summary).group(1)) if "passed" in summary else 0
    assert passed == expected_passed and "skipped" not in summary, summary


def interpreted_module(monkeypatch, name: str):
    """The module `name` for an interpreter test: skips unless this is the TRITON_INTERPRET=1 child (see
    run_child_suite) with Triton installed, and applies patch_scalar_index first."""
    import importlib
    import os

    import pytest

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("runs in the child pytest with TRITON_INTERPRET=1 (test_interpreter_suite)")
    pytest.importorskip("triton")
    patch_scalar_index(monkeypatch)  # numpy >= 2.4
    return importlib.import_module(name)
