"""spanllm.engine.cuda_allocator: expandable segments unless the user set PYTORCH_CUDA_ALLOC_CONF, and the
describe line says whose setting runs."""

from __future__ import annotations

import os
import subprocess
import sys

from spanllm.engine import cuda_allocator


def test_default_applies_only_where_unset(monkeypatch):
    monkeypatch.delenv(cuda_allocator.ENV, raising=False)
    assert cuda_allocator.describe() == "CUDA allocator: PyTorch's defaults"
    cuda_allocator.apply_default()
    assert os.environ[cuda_allocator.ENV] == "expandable_segments:True"
    assert cuda_allocator.describe() == (
        "CUDA allocator: expandable_segments:True (PYTORCH_CUDA_ALLOC_CONF; spanllm's default)"
    )
    monkeypatch.setenv(cuda_allocator.ENV, "expandable_segments:False")
    cuda_allocator.apply_default()
    assert os.environ[cuda_allocator.ENV] == "expandable_segments:False"
    assert cuda_allocator.describe() == "CUDA allocator: expandable_segments:False (PYTORCH_CUDA_ALLOC_CONF)"
    monkeypatch.setenv(cuda_allocator.ENV, "")  # empty: unset
    cuda_allocator.apply_default()
    assert os.environ[cuda_allocator.ENV] == "expandable_segments:True"


def test_the_engine_commands_apply_it_before_their_ranks_start():
    """`spanllm generate` on CPU: its rank process sees the default (printed by a rank through the env it
    inherited), while a user's value is kept."""
    code = (
        "import os, sys\n"
        "from spanllm.commands import generate\n"
        "from spanllm.engine import cuda_allocator\n"
        "calls = []\n"
        "generate.launch = lambda *a, **k: calls.append(os.environ.get(cuda_allocator.ENV)) or [None]\n"
        "generate.check_arguments = lambda args: []\n"
        "try:\n"
        "    generate.run(type('A', (), {'nprocs': 1})())\n"
        "except Exception:\n"
        "    pass\n"
        "print(calls[0])\n"
    )
    env = {k: v for k, v in os.environ.items() if k != cuda_allocator.ENV}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.stdout.strip().splitlines()[-1] == "expandable_segments:True", out.stderr[-2000:]
    env[cuda_allocator.ENV] = "garbage_collection_threshold:0.8"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.stdout.strip().splitlines()[-1] == "garbage_collection_threshold:0.8", out.stderr[-2000:]
