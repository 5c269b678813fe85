"""The one-pass exponential race (spanllm.kernels.sampler) on CPU tensors under Triton's interpreter:
the token of every row equals the unfused ops' argmax(softmax(logits / T) / E) on the same draws E, ties go to
the lowest index (as torch.argmax), masked tokens never win, rows may be strided. As in
test_paged_kernels_interpreter.py, the cases run in a child pytest with TRITON_INTERPRET=1
(`test_interpreter_suite`); in the parent they skip, saying so. On the GPU: tests/engine/test_gpu_paged.py."""

from __future__ import annotations

import os

import pytest
import torch
from triton_interpreter import interpreted_module, run_child_suite

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@pytest.fixture
def kernel(monkeypatch):
    return interpreted_module(monkeypatch, "spanllm.kernels.sampler")


def test_race_argmax_equals_the_unfused_race(kernel):
    g = torch.Generator().manual_seed(0)
    v = 2 * kernel.BLOCK_V + 77  # three blocks, the last one partial
    logits = torch.randn(6, v, generator=g) * 3
    logits[2, 100:] = float("-inf")  # a masked tail (min_tokens masks, say): those never win
    race = torch.empty_like(logits).exponential_(1.0, generator=g)
    temps = torch.tensor([1.0, 0.5, 1.0, 2.0, 0.05, 100.0])
    out = kernel.race_argmax(logits, race, 1.0 / temps)
    ref = (torch.softmax(logits / temps[:, None], dim=-1) / race).argmax(dim=-1)
    assert out.dtype == torch.int64
    assert out.tolist() == ref.tolist()
    assert out[2].item() < 100


def test_ties_go_to_the_lowest_index_and_strided_rows_work(kernel):
    v = kernel.BLOCK_V + 5
    buf = torch.zeros(3, v + 9)  # rows of a wider buffer: stride(0) = v + 9
    logits = buf[:, :v]
    logits[0, 7] = logits[0, kernel.BLOCK_V + 3] = 5.0  # the same best score in two blocks and lanes
    logits[1, :] = float("-inf")  # every token masked: token 0
    race = torch.ones(3, v)
    out = kernel.race_argmax(logits, race, torch.ones(3))
    assert out.tolist() == [7, 0, 0]  # row 2: all equal, the first index
    with pytest.raises(ValueError, match="float32 logits and draws of one shape"):
        kernel.race_argmax(logits, torch.ones(3, v + 1), torch.ones(3))


INTERPRETER_TESTS = 2


def test_interpreter_suite():
    """This file again in a child pytest with TRITON_INTERPRET=1: every case must pass there."""
    if INTERPRETED:
        pytest.skip("this is the child")
    pytest.importorskip("triton")
    run_child_suite(__file__, INTERPRETER_TESTS, "not interpreter_suite")
