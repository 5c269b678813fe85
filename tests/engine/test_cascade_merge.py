"""The cascade prefill's one-pass merge (spanllm.kernels.cascade_merge): the kernel, under Triton's interpreter (a
child pytest, as test_paged_kernels_interpreter.py), against the torch reference on the layouts the cascade hands
it (the prefix part GQA-folded and contiguous, the chunk's part a transposed view, the output a slice of the step's
rows), rows that do not fill a tile; and the reference itself against one attention over all the keys. The GPU
runs it inside the cascade (tests/engine/test_gpu_cascade.py)."""

from __future__ import annotations

import os

import pytest
import torch
from triton_interpreter import interpreted_module, run_child_suite

from spanllm.attention.cascade import reference_attention
from spanllm.kernels.cascade_merge import merge_into, merge_into_reference

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def _parts(c: int, hq: int, hkv: int, d: int, seed: int, fold: int | None = None):
    """Attention of c queries over 23 prefix keys (GQA-folded, as the cascade runs it: `fold` rows per query head,
    the rows past c zero queries, as at a rounded shape) and over 11 other keys (per query head) -> (o1, lse1, o2,
    lse2, the attention over all 34 keys [c, hq, d])."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(c, hq, d, generator=g)
    k, v = torch.randn(34, hkv, d, generator=g), torch.randn(34, hkv, d, generator=g)
    gq, f = hq // hkv, fold or c
    qf = torch.zeros(hkv, gq, f, d)
    qf[:, :, :c] = q.view(c, hkv, gq, d).permute(1, 2, 0, 3)
    qf = qf.view(1, hkv, gq * f, d)
    o1, lse1 = reference_attention(qf, k[:23].transpose(0, 1)[None], v[:23].transpose(0, 1)[None], False)
    kr, vr = (t[23:].transpose(0, 1).repeat_interleave(gq, dim=0)[None] for t in (k, v))
    o2, lse2 = reference_attention(q.transpose(0, 1)[None], kr, vr, False)
    o2 = o2[0].transpose(0, 1).contiguous().transpose(0, 1)[None]  # [1, hq, c, d] over a [c, hq, d] buffer, as cuDNN's
    whole, _ = reference_attention(
        q.transpose(0, 1)[None], *(t.transpose(0, 1).repeat_interleave(gq, dim=0)[None] for t in (k, v)), False
    )
    return o1[0], lse1[0], o2[0], lse2[0], whole[0].transpose(0, 1)


@pytest.mark.parametrize("hq,hkv", [(8, 2), (4, 4)])
@pytest.mark.parametrize("fold", [None, 16, 32])
def test_reference_merge_equals_one_attention_over_all_keys(hq, hkv, fold):
    o1, lse1, o2, lse2, whole = _parts(13, hq, hkv, 16, seed=hq, fold=fold)
    out = torch.empty(13, hq, 16)
    merge_into_reference(out, o1, lse1, o2, lse2, fold)
    torch.testing.assert_close(out, whole, atol=1e-6, rtol=1e-5)
    merge_into(out, o1, lse1, o2, lse2, fold)  # outside the interpreter: the reference (CPU tensors)
    torch.testing.assert_close(out, whole, atol=1e-6, rtol=1e-5)


def test_mismatched_shapes_are_refused():
    o1, lse1, o2, lse2, _ = _parts(5, 8, 2, 16, seed=0)
    with pytest.raises(ValueError, match="shapes out"):
        merge_into(torch.empty(6, 8, 16), o1, lse1, o2, lse2)
    with pytest.raises(ValueError, match="lse shapes"):
        merge_into(torch.empty(5, 8, 16), o1, lse1[:, :-1], o2, lse2)
    with pytest.raises(ValueError, match="fold 4"):  # fewer rows per query head than queries
        merge_into(torch.empty(5, 8, 16), o1[:, :16], lse1[:, :16], o2, lse2, fold=4)


@pytest.fixture
def kernels(monkeypatch):
    return interpreted_module(monkeypatch, "spanllm.kernels.cascade_merge")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("c,hq,hkv,fold", [(37, 8, 2, None), (5, 4, 4, None), (64, 8, 1, None), (37, 8, 2, 48)])
def test_merge_kernel_equals_the_reference(kernels, c, hq, hkv, fold, dtype):
    d = 16
    o1, lse1, o2, lse2, whole = _parts(c, hq, hkv, d, seed=c, fold=fold)
    o1, o2 = o1.to(dtype), o2.to(dtype)
    # the output: rows 3 .. 3 + c of a step's [T, hq, d] (strided like the engine's out[rows]); NaN elsewhere
    step = torch.full((c + 7, hq, d), float("nan"), dtype=dtype)
    out = step[3 : 3 + c]
    kernels.merge_into(out, o1, lse1, o2, lse2, fold)
    want = torch.empty(c, hq, d, dtype=dtype)
    merge_into_reference(want, o1, lse1, o2, lse2, fold)
    if dtype == torch.float32:
        torch.testing.assert_close(out, want, atol=1e-6, rtol=1e-6)
    else:  # both round the same float32 value once, up to exp's last bit: at most one bf16 step apart
        torch.testing.assert_close(out.float(), want.float(), atol=0, rtol=2**-7)
    assert step[:3].isnan().all() and step[3 + c :].isnan().all()  # no row outside its slice written
    torch.testing.assert_close(out.float(), whole, atol=3e-2 if dtype == torch.bfloat16 else 1e-5, rtol=0)


INTERPRETER_TESTS = 2 * 4


def test_interpreter_suite():
    """This file's kernel cases again in a child pytest with TRITON_INTERPRET=1: every one must pass there."""
    if INTERPRETED:
        pytest.skip("this is the child")
    pytest.importorskip("triton")
    run_child_suite(__file__, INTERPRETER_TESTS, "kernel_equals")
