"""The Triton paged-attention kernels (spanllm.kernels.paged_attention) on CPU tensors under Triton's
interpreter, against the gather + SDPA reference: every variant of the decode kernel (block ids one tile ahead
or not, splits from 1 to 16 with the in-kernel merge, minimum tiles per split 1 and 2) and the prefill
kernel over a paged prefix. float32 tensors (the interpreter's tl.dot on bf16 needs a shim; the numerics of
16-bit caches are checked on the GPU in test_gpu_paged.py).

As in test_skinny_gemm.py, Triton decides at import whether it interprets, so the cases run in a child pytest
with TRITON_INTERPRET=1 set from the start (`test_interpreter_suite`); in the parent they skip, saying so.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
from triton_interpreter import interpreted_module, run_child_suite

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@pytest.fixture
def kernels(monkeypatch):
    return interpreted_module(monkeypatch, "spanllm.kernels.paged_attention")


def _pool(ctx: list[int], block: int, hkv: int, d: int, seed: int):
    """A shuffled block pool holding one sequence per context length (block 0 left unused)."""
    g = torch.Generator().manual_seed(seed)
    nblk = [-(-c // block) for c in ctx]
    total = sum(nblk) + 1
    kc = torch.randn(total, block, hkv, d, generator=g)
    vc = torch.randn(total, block, hkv, d, generator=g)
    tables = torch.zeros(len(ctx), max(nblk), dtype=torch.int32)
    perm = (torch.randperm(total - 1, generator=g) + 1).to(torch.int32)
    i = 0
    for r, nb in enumerate(nblk):
        tables[r, :nb] = perm[i : i + nb]
        i += nb
    return kc, vc, tables


CTX = [1, 63, 64, 65, 300]  # one key; a tile short of one; exactly one tile; one past; several splits


@pytest.mark.parametrize("prefetch", [True, False])
@pytest.mark.parametrize("splits,min_tiles", [(1, 2), (4, 1), (16, 1), (16, 2)])
def test_decode_variants_match_reference(kernels, prefetch, splits, min_tiles):
    from spanllm.attention import reference as pa
    from spanllm.kernels import arrival_counters

    kc, vc, tables = _pool(CTX, 16, 2, 16, seed=splits)
    q = torch.randn(len(CTX), 8, 16, generator=torch.Generator().manual_seed(1))
    cl = torch.tensor(CTX, dtype=torch.int32)
    out = kernels.decode(q, kc, vc, tables, cl, splits, min_tiles, prefetch=prefetch)
    ref = pa.reference_decode(q, kc, vc, tables, CTX)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert arrival_counters.all_zero(q.device)  # every merging split reset its sequence's counter


def test_prefill_over_a_paged_prefix_matches_reference(kernels):
    from spanllm.attention import reference as pa

    q_lens, ctx = [5, 1, 70], [5, 40, 130]  # a whole prompt; one query after a prefix; a chunk after a prefix
    kc, vc, tables = _pool(ctx, 16, 2, 16, seed=7)
    q = torch.randn(sum(q_lens), 8, 16, generator=torch.Generator().manual_seed(2))
    cu_q = torch.tensor([0, 5, 6, 76], dtype=torch.int32)
    tiles = torch.tensor(kernels.prefill_tiles(q_lens, 4), dtype=torch.int32)
    out = kernels.prefill(q, kc, vc, tables, cu_q, torch.tensor(ctx, dtype=torch.int32), tiles)
    torch.testing.assert_close(out, pa.reference_prefill(q, kc, vc, tables, q_lens, ctx), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("splits", [1, 4])
def test_mixed_step_layout_each_kernel_writes_only_its_rows(kernels, splits):
    """A mixed-step graph's attention: the decode kernel over the first rows (context 0: not a decode, the row
    is left alone) and the prefill kernel over the other chunks' tiles only (plus padding tiles of an empty
    chunk, which write nothing), both into one output."""
    from spanllm.attention import reference as pa

    # chunks: two decodes (one query each), then two prefill chunks; decode rows cover 4 rows: 2 decodes + 2
    # rows that are prefill tokens in this step (context 0 there)
    q_lens, ctx = [1, 1, 3, 70], [65, 300, 3, 130]
    kc, vc, tables = _pool(ctx, 16, 2, 16, seed=11)
    q = torch.randn(sum(q_lens), 8, 16, generator=torch.Generator().manual_seed(3))
    rows = 4
    out = torch.full_like(q, 7.0)
    dctx = torch.tensor(ctx[:2] + [0, 0], dtype=torch.int32)
    kernels.decode(q[:rows], kc, vc, tables[:rows], dctx, splits, out=out[:rows])
    assert (out[2:] == 7.0).all()  # rows of context 0 and everything past the decode rows untouched
    torch.testing.assert_close(out[:2], pa.reference_decode(q[:2], kc, vc, tables[:2], ctx[:2]), rtol=1e-5, atol=1e-5)
    # chunk 4 is the graph's empty chunk (no queries, context 0): the padding tiles point at it
    cu_q = torch.tensor([0, 1, 2, 5, 75, 75], dtype=torch.int32)
    tiles = torch.tensor(kernels.prefill_tiles(q_lens[2:], 4, first_chunk=2) + [(4, 0)] * 3, dtype=torch.int32)
    assert tiles[:, 0].min().item() == 2
    decoded = out[:2].clone()
    tables = torch.cat([tables, torch.zeros(1, tables.shape[1], dtype=torch.int32)])
    kernels.prefill(q, kc, vc, tables, cu_q, torch.tensor(ctx + [0], dtype=torch.int32), tiles, out=out)
    assert torch.equal(out[:2], decoded)  # the decode chunks have no tile: the prefill kernel left them
    ref = pa.reference_prefill(q[2:], kc, vc, tables[2:], q_lens[2:], ctx[2:])
    torch.testing.assert_close(out[2:], ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("splits", [1, 4])
def test_decode_and_prefill_read_an_fp8_cache(kernels, splits):
    """--kv-cache-dtype fp8: the kernels widen e4m3 K/V tiles to the query's dtype as they load them, so they
    match the reference on the same cache (which widens the gathered keys)."""
    from spanllm.attention import reference as pa

    kc, vc, tables = _pool(CTX, 16, 2, 16, seed=7)
    kc, vc = (kc * 4).to(torch.float8_e4m3fn), (vc * 4).to(torch.float8_e4m3fn)
    q = torch.randn(len(CTX), 8, 16, generator=torch.Generator().manual_seed(2))
    cl = torch.tensor(CTX, dtype=torch.int32)
    out = kernels.decode(q, kc, vc, tables, cl, splits)
    torch.testing.assert_close(out, pa.reference_decode(q, kc, vc, tables, CTX), rtol=1e-5, atol=1e-5)
    # prefill: the last 40 keys of each of the two longest sequences as chunks after their prefixes
    q_lens, ctx = [40, 40], [CTX[3], CTX[4]]
    qp = torch.randn(sum(q_lens), 8, 16, generator=torch.Generator().manual_seed(3))
    cu_q = torch.tensor([0, 40, 80], dtype=torch.int32)
    tiles = torch.tensor(kernels.prefill_tiles(q_lens, 4, context_lens=ctx), dtype=torch.int32)
    got = kernels.prefill(qp, kc, vc, tables[3:], cu_q, torch.tensor(ctx, dtype=torch.int32), tiles)
    want = pa.reference_prefill(qp, kc, vc, tables[3:], q_lens, ctx)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


# An FP8 cache's decode tiles are 128 keys (paged_attention.DECODE_LAUNCH): one short of a tile, exactly one, one past,
# two and one past, several splits
FP8_CTX = [127, 128, 129, 257, 300]


@pytest.mark.parametrize("splits,min_tiles", [(1, None), (4, 1)])
def test_decode_reads_an_fp8_cache_in_its_own_tiles(kernels, splits, min_tiles):
    from spanllm.attention import reference as pa

    assert kernels.DECODE_LAUNCH[1][0] == 128
    kc, vc, tables = _pool(FP8_CTX, 16, 2, 16, seed=11)
    kc, vc = (kc * 4).to(torch.float8_e4m3fn), (vc * 4).to(torch.float8_e4m3fn)
    q = torch.randn(len(FP8_CTX), 8, 16, generator=torch.Generator().manual_seed(5))
    cl = torch.tensor(FP8_CTX, dtype=torch.int32)
    out = kernels.decode(q, kc, vc, tables, cl, splits, min_tiles)
    torch.testing.assert_close(out, pa.reference_decode(q, kc, vc, tables, FP8_CTX), rtol=1e-5, atol=1e-5)


def _fp8_reference(q: torch.Tensor, kc, vc, tables, ctx: list[int], widen: str) -> torch.Tensor:
    """float64 attention over the FP8 cache's values with the kernel's query rounding: widen='fp16' scales q by
    log2(e) / sqrt(d) and rounds it to fp16, widen='bf16' keeps q as it is (bf16)."""
    d = q.shape[-1]
    scale_log2 = math.log2(math.e) / math.sqrt(d)
    q64 = (q.float() * scale_log2).half().double() if widen == "fp16" else q.double() * scale_log2
    hkv = kc.shape[2]
    out = torch.empty(q.shape, dtype=torch.float64)
    for r, n in enumerate(ctx):
        rows = torch.arange(n)
        blk = tables[r, rows // kc.shape[1]].long()
        k = kc[blk, rows % kc.shape[1]].double()  # [n, hkv, d]
        v = vc[blk, rows % kc.shape[1]].double()
        for h in range(q.shape[1]):
            s = k[:, h // (q.shape[1] // hkv)] @ q64[r, h]  # log2 units
            p = torch.exp2(s - s.max())
            out[r, h] = (p / p.sum()) @ v[:, h // (q.shape[1] // hkv)]
    return out


@pytest.mark.parametrize("widen", [None, "fp16", "bf16"])
def test_decode_of_bf16_queries_over_an_fp8_cache(kernels, monkeypatch, widen):
    """bf16 queries over an FP8 cache, as the engine runs them: widen='fp16' widens e4m3 to fp16 with q scaled into
    fp16 first, widen='bf16' to the queries' dtype, None as FP8_DECODE_WIDEN says. Each within the bf16 output's
    rounding of the float64 result on the same values (q rounded as the kernel rounds it). One row's queries reach
    2e5, past fp16's 65,504: q is scaled before it is narrowed, so they stay finite."""
    from triton_interpreter import widen_bf16_dot

    widen_bf16_dot(monkeypatch)
    kc, vc, tables = _pool(FP8_CTX, 16, 2, 16, seed=13)
    kc, vc = (kc * 4).to(torch.float8_e4m3fn), (vc * 4).to(torch.float8_e4m3fn)
    q = torch.randn(len(FP8_CTX), 8, 16, generator=torch.Generator().manual_seed(6))
    q[2] *= 4e4  # |q| up to ~2e5
    q = q.to(torch.bfloat16)
    cl = torch.tensor(FP8_CTX, dtype=torch.int32)
    to = widen or kernels.FP8_DECODE_WIDEN
    assert kernels.decode_widens_to_f16(q.dtype, kc.dtype, widen) == (to == "fp16")
    for splits in (1, 4):
        out = kernels.decode(q, kc, vc, tables, cl, splits, 1, widen=widen)
        assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
        want = _fp8_reference(q, kc, vc, tables, FP8_CTX, to)
        # p is rounded to the widened dtype before P @ V: 2^-11 (fp16) or 2^-8 (bf16) of |v| (~4 x 4); the output
        # to bf16 (2^-8 relative)
        atol = (2.0**-11 if to == "fp16" else 2.0**-8) * 4 * 16
        torch.testing.assert_close(out.double(), want, rtol=2.0**-8, atol=atol)


def test_decode_widen_is_refused_where_it_does_not_apply(kernels):
    from spanllm.kernels import paged_attention as pa

    assert pa.FP8_DECODE_WIDEN in ("fp16", "bf16")
    with pytest.raises(ValueError, match="widen='fp32': one of None"):
        pa.decode_widens_to_f16(torch.bfloat16, torch.float8_e4m3fn, "fp32")
    with pytest.raises(ValueError, match="applies to an FP8 cache under bf16 queries; this is a torch.bfloat16 cache"):
        pa.decode_widens_to_f16(torch.bfloat16, torch.bfloat16, "fp16")
    assert not pa.decode_widens_to_f16(torch.float32, torch.float8_e4m3fn)
    assert not pa.decode_widens_to_f16(torch.float16, torch.float8_e4m3fn)
    assert pa.decode_widens_to_f16(torch.bfloat16, torch.float8_e4m3fn) == (pa.FP8_DECODE_WIDEN == "fp16")
    assert pa.decode_widens_to_f16(torch.bfloat16, torch.float8_e4m3fn, "fp16")


INTERPRETER_TESTS = 2 * 4 + 1 + 2 + 2 + 2 + 3 + 1


def test_interpreter_suite():
    """This file again in a child pytest with TRITON_INTERPRET=1: every case must pass there."""
    if INTERPRETED:
        pytest.skip("this is the child")
    pytest.importorskip("triton")
    run_child_suite(__file__, INTERPRETER_TESTS, "not interpreter_suite")
