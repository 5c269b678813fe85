"""spanllm.engine.cuda_allocator: expandable segments unless the user set an allocator variable (any of the names
PyTorch reads), the describe line says whose setting runs, and every engine command applies it first."""

from __future__ import annotations

import argparse
import importlib
import os

import pytest

from spanllm.engine import cuda_allocator as ca


@pytest.fixture
def clean_env(monkeypatch):
    for name in (*ca.USER_ENVS, ca.APPLIED_ENV):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_default_applies_only_where_no_allocator_variable_is_set(clean_env):
    assert ca.describe() == "CUDA allocator: PyTorch's defaults"
    ca.apply_default()
    assert os.environ[ca.ENV] == "expandable_segments:True"
    assert ca.describe() == "CUDA allocator: expandable_segments:True (PYTORCH_CUDA_ALLOC_CONF; spanllm's default)"
    clean_env.setenv(ca.ENV, "")  # empty: unset
    ca.apply_default()
    assert os.environ[ca.ENV] == "expandable_segments:True"


@pytest.mark.parametrize("name", ["PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF"])
def test_a_users_setting_under_any_name_is_kept(clean_env, name):
    clean_env.setenv(name, "expandable_segments:False,garbage_collection_threshold:0.6")
    ca.apply_default()
    assert os.environ.get(ca.ENV) == (os.environ[name] if name == ca.ENV else None)  # nothing added beside it
    assert ca.describe() == f"CUDA allocator: expandable_segments:False,garbage_collection_threshold:0.6 ({name})"
    clean_env.setenv(name, "expandable_segments:True")  # the user's own, equal to the default: still the user's
    assert ca.describe() == f"CUDA allocator: expandable_segments:True ({name})"


class _Applied(Exception):
    pass


@pytest.mark.parametrize("command", ["serve", "bench_throughput", "bench_batch", "bench_study", "generate"])
def test_every_engine_command_applies_it_before_anything_else(monkeypatch, command):
    """Each engine command's run() calls apply_default first (before checks and before any rank starts CUDA):
    a run stopped at that call has done nothing else."""
    mod = importlib.import_module(f"spanllm.commands.{command}")

    def stop():
        raise _Applied

    monkeypatch.setattr(ca, "apply_default", stop)
    with pytest.raises(_Applied):
        mod.run(argparse.Namespace())  # no attributes: anything before apply_default would fail differently
