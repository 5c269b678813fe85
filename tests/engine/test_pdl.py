"""Programmatic dependent launch (spanllm.kernels.pdl): the mode's resolution and refusals, and what a launch site
is given. That PDL changes no result is checked on a Hopper GPU (tests/engine/test_gpu_engine.py)."""

from __future__ import annotations

import pytest
import torch

from spanllm.engine.config import EngineConfig
from spanllm.kernels import pdl


@pytest.fixture(autouse=True)
def restore_mode():
    before = pdl._enabled
    yield
    pdl._enabled = before


def test_auto_and_off_are_off_on_cpu_and_on_is_refused():
    cpu = torch.device("cpu")
    assert pdl.configure("auto", cpu) is False and pdl.configure("off", cpu) is False
    assert not pdl.enabled() and pdl.launch_options(cpu) == {"PDL": False}
    with pytest.raises(
        ValueError,
        match=r"pdl='on': programmatic dependent launch needs a CUDA GPU of compute "
        r"capability >= 9.0 \(Hopper\) and Triton; this rank runs on device cpu",
    ):
        pdl.configure("on", cpu)
    with pytest.raises(ValueError, match=r"pdl='sometimes' must be one of \('auto', 'on', 'off'\)"):
        pdl.configure("sometimes", cpu)


def test_launch_options_only_on_cuda_tensors_when_on(monkeypatch):
    monkeypatch.setattr(pdl, "_enabled", True)
    assert pdl.launch_options(torch.device("cuda", 0)) == {"PDL": True, "launch_pdl": True}
    # CPU tensors (Triton's interpreter) never get the attribute or the PTX
    assert pdl.launch_options(torch.device("cpu")) == {"PDL": False}


def test_engine_config_validates_the_mode():
    assert EngineConfig().pdl == "off"
    with pytest.raises(ValueError, match=r"pdl='yes' must be one of \('auto', 'on', 'off'\)"):
        EngineConfig(pdl="yes")


def test_a_cpu_engine_reports_pdl_off():
    from spanllm.engine.llm import LLM
    from spanllm.model.config import resolve_model

    llm = LLM(
        resolve_model("tiny"), EngineConfig(dtype=torch.float32, pdl="auto", max_num_seqs=2, max_num_batched_tokens=64)
    )
    assert llm.pdl is False and "PDL off" in llm.describe()
