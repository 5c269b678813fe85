"""The cascade prefill (spanllm.attention.cascade) on CPU, its parts on the float32 `reference_attention`,
against the gather + SDPA reference backend: prefixes shorter than / equal to / longer than a block, chunks that
start mid-block, block tables whose unused entries point at a block of NaNs, GQA; a whole step (decodes, two
long-prefix chunks, a short one) split the way the Triton backend splits it (its metadata on CPU); the
configuration, CLI flag and describe() line. The same code on CUDA with cuDNN / flash: tests/engine/test_gpu_paged.py.
"""

from __future__ import annotations

import argparse

import numpy as np
import pytest
import torch
from paged_pools import poisoned_paged_pool

from spanllm.attention import reference as ref
from spanllm.attention.cascade import (
    CUDNN_CASCADE_COST,
    CascadeCost,
    CascadeShape,
    attend_long_chunks,
    cascade_pairs,
    cascade_plan_parts,
    cascade_prefill,
    chunk_prefixes,
    chunk_shapes,
    paged_pairs,
    plan_cascade,
    reference_attention,
    warm_chunk_shapes,
)

BLOCK = 16


# (prefix, chunk): shorter than a block, exactly a block, longer (the chunk starting mid-block), no prefix,
# a chunk of one query, a long prefix ending mid-block
CASES = [(5, 9), (16, 16), (37, 21), (0, 13), (300, 1), (1000, 45)]


@pytest.mark.parametrize("prefix,c", CASES)
@pytest.mark.parametrize("hq,hkv", [(8, 2), (4, 4)])
@pytest.mark.parametrize("bucket", [1, 16, 48])
def test_cascade_equals_reference(prefix, c, hq, hkv, bucket):
    """Exact shapes (bucket 1) and shapes rounded to 16 / 48 rows (padding queries and keys; part of the prefix
    moved to the causal part; 48: padding past the sequence's last block). The last block's rows past the sequence
    hold NaN (unwritten slots): the padding keys and values that read them must be zeroed."""
    d = 16
    kc, vc, tables = poisoned_paged_pool([prefix + c], BLOCK, hkv, d, seed=prefix + c)
    _poison_tail(kc, vc, tables[0], prefix + c)
    q = torch.randn(c, hq, d, generator=torch.Generator().manual_seed(1))
    out = cascade_prefill(q, kc, vc, tables[0], prefix, reference_attention, bucket=bucket)
    want = ref.reference_prefill(q, kc, vc, tables, [c], [prefix + c])
    assert not out.isnan().any()
    torch.testing.assert_close(out, want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("prefix,c", [(37, 21), (1000, 45)])
def test_cascade_over_an_fp8_cache_widens_it_exactly(prefix, c):  # at rounded shapes (padding zeroed after widening)
    """An FP8 (e4m3) cache: the gathered K/V widened to the queries' dtype, the same keys the reference reads
    (the cache has no scale: values are stored saturated, spanllm.attention.backend.write_kv)."""
    kc, vc, tables = poisoned_paged_pool([prefix + c], BLOCK, 2, 16, seed=prefix)
    _poison_tail(kc, vc, tables[0], prefix + c)  # e4m3 has a NaN: it widens to NaN, then zeroed
    kc8, vc8 = kc.to(torch.float8_e4m3fn), vc.to(torch.float8_e4m3fn)
    q = torch.randn(c, 8, 16, generator=torch.Generator().manual_seed(2))
    out = cascade_prefill(q, kc8, vc8, tables[0], prefix, reference_attention, bucket=32)
    want = ref.reference_prefill(q, kc8, vc8, tables, [c], [prefix + c])
    assert not out.isnan().any()
    torch.testing.assert_close(out, want, atol=2e-5, rtol=2e-5)


def _poison_tail(kc: torch.Tensor, vc: torch.Tensor, table: torch.Tensor, n: int) -> None:
    """NaN in the rows of the sequence's last block past its n tokens."""
    if n % BLOCK:
        last = int(table[(n - 1) // BLOCK])
        kc[last, n % BLOCK :] = float("nan")
        vc[last, n % BLOCK :] = float("nan")


def test_padding_keys_are_zeroed():
    """Without the zeroing, the NaN rows of the last block would reach real rows (0 * NaN in P @ V): a chunk whose
    rounded shape reads them."""
    from spanllm.attention.cascade import gather_rows

    prefix, c = 37, 21
    kc, vc, tables = poisoned_paged_pool([prefix + c], BLOCK, 2, 16, seed=9)
    _poison_tail(kc, vc, tables[0], prefix + c)
    assert gather_rows(kc, tables[0], prefix + c, 64)[prefix + c :].isnan().any()  # what the zeroing must clear
    out = cascade_prefill(torch.randn(c, 8, 16), kc, vc, tables[0], prefix, reference_attention, bucket=32)
    assert not out.isnan().any()


def test_reference_attention_reads_each_query_heads_kv_head():
    """GQA in the Attention contract: 6 query heads over 2 KV heads equal the same with K/V repeated (heads 0-2
    read KV head 0, heads 3-5 KV head 1)."""
    g = torch.Generator().manual_seed(5)
    q, k, v = torch.randn(1, 6, 9, 8, generator=g), torch.randn(1, 2, 9, 8, generator=g), torch.randn(1, 2, 9, 8)
    for causal in (False, True):
        out, lse = reference_attention(q, k, v, causal)
        want, want_lse = reference_attention(q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1), causal)
        assert torch.equal(out, want) and torch.equal(lse, want_lse)
        one, _ = reference_attention(q[:, 4:5], k[:, 1:2], v[:, 1:2], causal)
        torch.testing.assert_close(out[:, 4:5], one)


def test_the_lse_is_the_natural_log_of_the_softmax_denominator():
    """The Attention contract's LSE (what the merge weighs the parts by; the merge: test_cascade_merge.py)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(1, 3, 7, 8, generator=g), torch.randn(1, 3, 20, 8, generator=g), torch.randn(1, 3, 20, 8)
    _, lse = reference_attention(q, k, v, False)
    s = (q @ k.transpose(-1, -2)) / 8**0.5
    torch.testing.assert_close(lse, torch.log(torch.exp(s).sum(-1)))


def test_plan_picks_the_long_prefixes():
    plan = plan_cascade([10, 3, 7], [10 + 5000, 3, 7 + 4096], 4096)
    assert [(p.chunk, p.q_start, p.q_len, p.prefix) for p in plan] == [(0, 0, 10, 5000), (2, 13, 7, 4096)]
    assert plan_cascade([10], [4105], 4096) == []
    # min_prefix 0: every chunk, a prompt's first (no prefix) included
    plan = plan_cascade([10, 3], [10, 3 + 8], 0)
    assert [(p.chunk, p.q_start, p.q_len, p.prefix) for p in plan] == [(0, 0, 10, 0), (1, 10, 3, 8)]


def test_a_step_of_long_and_short_chunks_split_as_the_triton_backend_splits_it():
    """Two long-prefix chunks and a short one, no decodes: the backend's metadata (built on CPU) leaves the long
    chunks out of the kernel's tiles and plans them for the cascade; the short chunk on the reference, the long ones
    through attend_long_chunks -> every row equals the reference step. The same chunks beside decodes: no cascade
    (the paged kernel runs them, the step may use a graph)."""
    pytest.importorskip("triton")
    from spanllm.attention.triton import TritonBackend

    hq, hkv, d, min_prefix = 8, 2, 16, 64
    q_lens = np.array([21, 9, 40], dtype=np.int32)
    context_lens = np.array([100 + 21, 30 + 9, 64 + 40], dtype=np.int32)
    kc, vc, tables = poisoned_paged_pool(context_lens.tolist(), BLOCK, hkv, d, seed=3)
    b = TritonBackend(hq, hkv, d, torch.device("cpu"), prefill_attention="cudnn-cascade", cascade_min_prefix=min_prefix)
    assert b.eager_only(0, q_lens, context_lens)
    assert not b.eager_only(0, q_lens[[1]], context_lens[[1]])  # the short chunk alone
    assert "prefill cudnn-cascade for prefixes >= 64 keys in steps without decodes" in b.describe(torch.bfloat16)
    cos = sin = torch.zeros(int(q_lens.sum()), 1, d)
    meta = b.build_metadata(0, q_lens, context_lens, tables.numpy(), cos, sin, torch.zeros(1), torch.from_numpy)
    assert [(p.chunk, p.q_start, p.prefix) for p in meta.cascade] == [(0, 0, 100), (2, 30, 64)]
    assert set(meta.prefill_tiles[:, 0].tolist()) == {1}  # the kernel runs the short chunk only
    assert not TritonBackend(hq, hkv, d, torch.device("cpu")).eager_only(0, q_lens, context_lens)

    # beside two decodes: no cascade, every chunk in the kernel's tiles
    dq, dctx = np.array([1, 1] + q_lens.tolist(), dtype=np.int32), np.array([50, 7] + context_lens.tolist())
    assert not b.eager_only(2, dq, dctx)
    _, _, dtables = poisoned_paged_pool(dctx.tolist(), BLOCK, hkv, d, seed=3)
    dcos = torch.zeros(int(dq.sum()), 1, d)
    dmeta = b.build_metadata(2, dq, dctx, dtables.numpy(), dcos, dcos, torch.zeros(1), torch.from_numpy)
    assert not dmeta.cascade and set(dmeta.prefill_tiles[:, 0].tolist()) == {0, 1, 2}

    q = torch.randn(int(q_lens.sum()), hq, d, generator=torch.Generator().manual_seed(4))
    rmeta = ref.ReferenceBackend(hq, hkv, d, torch.device("cpu")).build_metadata(
        0, q_lens, context_lens, tables.numpy(), cos, sin, torch.zeros(1), torch.from_numpy
    )
    want = ref.reference_attend(q, kc, vc, rmeta)
    out = torch.full_like(q, float("nan"))
    cu = np.concatenate([[0], np.cumsum(q_lens)])
    rows = slice(cu[1], cu[2])  # the short chunk: what the Triton kernel's tiles cover
    out[rows] = ref.reference_prefill(q[rows], kc, vc, meta.prefill_block_tables[1:2], [9], [39])
    attend_long_chunks(q, kc, vc, meta.prefill_block_tables, meta.cascade, reference_attention, out)
    assert not out.isnan().any()
    torch.testing.assert_close(out, want, atol=2e-5, rtol=2e-5)
    # the same step at shapes rounded to 32 rows (prefix 100: its last 4 keys in the causal part; queries padded)
    out = torch.full_like(q, float("nan"))
    out[rows] = ref.reference_prefill(q[rows], kc, vc, meta.prefill_block_tables[1:2], [9], [39])
    attend_long_chunks(q, kc, vc, meta.prefill_block_tables, meta.cascade, reference_attention, out, 32)
    assert not out.isnan().any()
    torch.testing.assert_close(out, want, atol=2e-5, rtol=2e-5)


def test_cascade_shape_rounds_to_the_bucket():
    s = CascadeShape(c=3634, prefix=32768, bucket=1024)  # a 36,402-token prompt's last chunk at chunk 16,384
    assert (s.split, s.lead, s.side, s.rows, s.keys) == (32768, 0, 4096, 4096, 36864)
    s = CascadeShape(c=100, prefix=5000, bucket=1024)  # a prefix off the bucket: 904 keys go to the causal part
    assert (s.split, s.lead, s.side, s.rows, s.keys) == (4096, 904, 1024, 1024, 5120)
    s = CascadeShape(c=200, prefix=5000, bucket=1024)
    assert (s.split, s.lead, s.side, s.rows, s.keys) == (4096, 904, 2048, 1024, 6144)
    s = CascadeShape(c=77, prefix=700, bucket=1024)  # the whole prefix in the causal part: no prefix part
    assert (s.split, s.lead, s.side, s.rows, s.keys) == (0, 700, 1024, 1024, 1024)
    s = CascadeShape(c=13048, prefix=98304)  # bucket 1: the exact shapes
    assert (s.split, s.lead, s.side, s.rows, s.keys) == (98304, 0, 13048, 13048, 111352)


def test_chunk_prefixes_and_shapes():
    """A prompt of up to max_model_len - 1 tokens: its chunks after the first start at chunk, 2 chunk, ...; the
    cuDNN cascade meets one shape per rounded query count at each (the largest count stands for it); bucket 1:
    the full chunks only."""
    assert chunk_prefixes(16384, 131072) == [16384, 32768, 49152, 65536, 81920, 98304, 114688]
    assert chunk_prefixes(8192, 8193) == [] and chunk_prefixes(8192, 8194) == [8192]
    assert chunk_prefixes(100, 301) == [100, 200] and chunk_prefixes(100, 300) == [100, 200]
    shapes = chunk_shapes(16384, 131072, 4096, 1024)
    assert len(shapes) == 7 * 16 + 1 and shapes[:2] == [(1024, 16384), (2048, 16384)]
    # at 114688 the last chunk holds at most 131071 - 114688 = 16383 queries: rows 16384 all the same
    assert [c for c, p in shapes if p == 114688][-2:] == [15360, 16383]
    # and the causal side of a full chunk after < 1024 cached keys (a prefix-cache hit): 17408, alone
    assert shapes[-1] == (17408, 0)
    assert chunk_shapes(16384, 131072, 4096, 1) == [(16384, p) for p in chunk_prefixes(16384, 131072)[:-1]]
    # min_prefix 0: the first chunk (prefix 0) too; a chunk off the bucket: the causal part's side varies too
    # (at 100: split 64, lead 36; queries 1-28: rows 64, side 64; 29-64: 64, 128; 65-92: 128, 128; 93-100: 128, 192)
    want = [(64, 0), (100, 0), (28, 100), (64, 100), (92, 100), (100, 100), (56, 200), (64, 200), (100, 200)]
    assert chunk_shapes(100, 301, 0, 64) == want
    assert chunk_shapes(100, 301, 150, 1) == [(100, 200)] and chunk_shapes(100, 300, 150, 1) == []


def _recording_attention(seen: list):
    def attention(q, k, v, causal):
        seen.append((tuple(q.shape), q.stride(), tuple(k.shape), k.stride(), causal))
        return reference_attention(q, k, v, causal)

    return attention


@pytest.mark.parametrize(
    "chunk,bucket,min_prefix,hits", [(32, 32, 32, (0, 16)), (32, 1, 32, (0,)), (40, 16, 0, (0,)), (64, 32, 0, (0, 16))]
)
def test_the_warm_up_meets_every_shape_and_stride_a_prompts_chunks_meet(chunk, bucket, min_prefix, hits):
    """warm_chunk_shapes calls the attention with every (queries, keys) shape and stride that the chunks of any
    prompt of up to max_len - 1 tokens meet in cascade_prefill (a cuDNN plan is keyed on them), its first `hit`
    tokens cached (every hit under the bucket: the chunks start past a multiple of the chunk): at rounded shapes
    every chunk, at exact ones (bucket 1) the full chunks after no hit. The warm-up meets no other shape but causal
    sides (every side up to chunk + bucket)."""
    hq, hkv, d, max_len = 8, 2, 16, 120
    warm: list = []
    shapes = chunk_shapes(chunk, max_len, min_prefix, bucket)
    warm_chunk_shapes(_recording_attention(warm), hq, hkv, d, torch.float32, torch.device("cpu"), shapes, bucket)
    kc, vc, tables = poisoned_paged_pool([max_len], BLOCK, hkv, d, seed=5)
    met: list = []
    for hit in hits:
        for n in range(hit + 1, max_len):  # every prompt length: its chunks
            for prefix in range(hit, n, chunk):
                c = min(chunk, n - prefix)
                if prefix < min_prefix or (bucket == 1 and c < chunk):
                    continue
                q = torch.randn(c, hq, d)
                cascade_prefill(q, kc, vc, tables[0], prefix, _recording_attention(met), bucket=bucket)
    assert set(met) <= set(warm)
    assert all(s[4] for s in set(warm) - set(met))  # extra: causal parts only
    if bucket > 1:  # every causal side up to chunk + bucket - 1 rows
        sides = {s[0][2] for s in warm if s[4]}
        assert sides == set(range(bucket, -(-(chunk + bucket - 1) // bucket) * bucket + 1, bucket))
    if set(hits) == set(range(0, bucket, BLOCK)) and chunk % bucket == 0:  # every hit under the bucket met
        assert set(met) == set(warm)


def test_the_backend_warms_the_chunk_shapes_its_cascade_runs():
    pytest.importorskip("triton")
    from spanllm.attention.triton import TritonBackend

    hq, hkv, d = 8, 2, 16
    b = TritonBackend(hq, hkv, d, torch.device("cpu"), prefill_attention="cudnn-cascade", cascade_min_prefix=64)
    assert b.cascade_bucket == 1024 and "at shapes rounded to 1024 rows" in b.describe(torch.bfloat16)
    b.cascade_bucket = 16  # small shapes on CPU
    seen: list = []
    b.cascade = _recording_attention(seen)  # reference math on CPU in place of cuDNN
    # prefixes 32 ... 192 (a prompt of up to 199 tokens); 32 is below min_prefix: the kernel's
    assert b.warm_up_prefill(32, 200, torch.float32) == chunk_shapes(32, 200, 64, 16)
    assert sorted({s[2][2] for s in seen if not s[4]}) == [64, 96, 128, 160, 192]  # the prefix parts' keys
    # the backend knows cuDNN holds their plans (auto's cost model counts none for them)
    assert b._planned == {
        part for c, p in chunk_shapes(32, 200, 64, 16) for part in cascade_plan_parts(CascadeShape(c, p, 16))
    }
    flash = TritonBackend(hq, hkv, d, torch.device("cpu"), prefill_attention="flash-cascade", cascade_min_prefix=64)
    assert flash.cascade_bucket == 1 and "rounded" not in flash.describe(torch.bfloat16)
    assert TritonBackend(hq, hkv, d, torch.device("cpu")).warm_up_prefill(32, 200, torch.float32) == []
    assert ref.ReferenceBackend(hq, hkv, d, torch.device("cpu")).warm_up_prefill(32, 200, torch.float32) == []


def test_pair_counts_and_plan_parts_of_a_rounded_shape():
    """300 queries after 50,000 cached keys at the cuDNN cascade's 1,024-row rounding: the prefix part computes
    1,024 rows over 49,152 keys, the causal part a 2,048-row square half (848 cached keys moved in front of the
    chunk); the paged kernel computes 300 x 50,000 pairs plus the chunk's own causal half."""
    s = CascadeShape(300, 50_000, 1024)
    assert (s.split, s.lead, s.side, s.rows) == (49_152, 848, 2048, 1024)
    assert cascade_pairs(s) == 1024 * 49_152 + 2048 * 2049 // 2 == 52_429_824
    assert paged_pairs(300, 50_000) == 300 * 50_000 + 300 * 301 // 2 == 15_045_150
    assert cascade_plan_parts(s) == [("causal", 2048, 2048), ("prefix", 1024, 49_152)]
    assert cascade_plan_parts(CascadeShape(300, 500, 1024)) == [("causal", 1024, 1024)]  # no prefix part
    f = 4 * 32 * 128 * 32  # FLOP a pair over Llama 3.1 8B's 32 query heads of 128 and 32 layers
    cost = CascadeCost(cascade_tflops=500.0, paged_tflops=250.0, plan_s=0.5)
    assert cost.cascade_s(s, f, 2) == 52_429_824 * f / 500e12 + 1.0
    assert cost.paged_s(300, 50_000, f) == 15_045_150 * f / 250e12


def test_auto_takes_the_cascade_where_it_is_estimated_faster(monkeypatch):
    """auto on a (faked) Hopper GPU, at Llama 3.1 8B's shapes (only the host-side planning runs): a short chunk
    after a long prefix runs the paged kernel, planned or not (the cascade would compute 1,024 rows for its 300); a
    long prompt's warmed last chunk runs the cascade; 2,000 queries after 50,000 keys are faster on the cascade once
    its two plans exist (100.5 ms against 137.1 ms) but not by the plans' 90 ms: declined twice, each decline adding
    its 36.6 ms to their account (through eager_only when the step replays a graph, through plan_chunks when it
    runs eagerly), then taken, and taken after without an account. A cascade the user names runs on every chunk
    its min prefix lets in."""
    pytest.importorskip("triton")
    from spanllm.attention import triton as triton_backend
    from spanllm.attention.triton import TritonBackend

    monkeypatch.setattr(triton_backend.kernels, "num_sms_of", lambda device: 132)  # no CUDA device to ask
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    cuda = torch.device("cuda")
    b = TritonBackend(32, 8, 128, cuda, prefill_attention="auto", num_layers=32)
    assert b.prefill_attention == "cudnn-cascade" and b.cascade_cost is CUDNN_CASCADE_COST
    assert "cudnn-cascade (auto) for prefixes >= 4096 keys where estimated faster than the paged kernel" in b.describe(
        torch.bfloat16
    )
    b.planned(300, 50_000)
    assert not b.takes_cascade(300, 50_000)
    b.planned(4856, 106_496)  # the 111,352-token prompt's last chunk (8,192-token chunks), as the warm-up builds it
    assert b.takes_cascade(4856, 106_496)

    q, ctx = np.array([2000], dtype=np.int32), np.array([52_000], dtype=np.int32)
    assert not b.takes_cascade(2000, 50_000)
    assert not b.eager_only(0, q, ctx)  # a graph replays this step: the decline is recorded here
    assert b.plan_chunks([2000], [52_000]) == []  # an eager step (graphs off) declines it again
    assert b.takes_cascade(2000, 50_000) and b.eager_only(0, q, ctx)  # 3 x 36.6 ms > 90 ms
    tables = np.arange(52_000 // 16 + 1, dtype=np.int32)[None]
    cos = sin = torch.zeros(2000, 1, 128)
    meta = b.build_metadata(0, q, ctx, tables, cos, sin, torch.zeros(1), torch.from_numpy)
    assert [(p.q_len, p.prefix) for p in meta.cascade] == [(2000, 50_000)] and meta.prefill_tiles.shape[0] == 0
    # its plans are known now, and their account closed: the same rounded shape is taken on its saving alone
    assert set(cascade_plan_parts(CascadeShape(2000, 50_000, 1024))) <= b._planned and not b._forgone
    assert b.takes_cascade(2000, 50_000) and b.takes_cascade(1900, 50_100)
    assert not b.eager_only(2, np.array([1, 1, 2000]), np.array([9, 9, 52_000]))  # beside decodes: never
    assert not b.eager_only(0, np.array([2000]), np.array([2000 + 4000]))  # below the min prefix: never

    named = TritonBackend(32, 8, 128, cuda, prefill_attention="cudnn-cascade", num_layers=32)
    assert named.cascade_cost is None and named.takes_cascade(300, 50_000)
    assert "estimated" not in named.describe(torch.bfloat16)
    with pytest.raises(ValueError, match="num_layers=None: auto's cascade weighs a plan build against the attention"):
        TritonBackend(32, 8, 128, cuda, prefill_attention="auto")  # the count the cost model needs, not a guess


def test_the_engine_gives_its_backend_its_own_layer_count(monkeypatch):
    """LLM builds its attention backend with the layers its forward runs (auto's cost model weighs a plan build
    against all of them): the tiny preset's 4 layers at PP = 1."""
    from spanllm.attention import backend as backend_module
    from spanllm.engine.config import EngineConfig
    from spanllm.engine.llm import LLM
    from spanllm.model.config import resolve_model

    seen = {}
    real = backend_module.resolve_backend

    def spy(*args, **kwargs):
        seen.update(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(backend_module, "resolve_backend", spy)  # LLM imports it from there when it builds
    cfg = resolve_model("tiny")
    worker = LLM(cfg, EngineConfig(dtype=torch.float32, max_num_seqs=2, max_num_batched_tokens=64)).worker  # builds it
    assert worker.backend.name == "torch"  # the reference on CPU; the count reaches whichever backend
    assert seen["num_layers"] == cfg.num_layers == 4


def test_configuration_and_cli_flag():
    from spanllm.attention.backend import resolve_backend
    from spanllm.commands.engine_args import engine_config_from_args
    from spanllm.engine.config import EngineConfig

    assert EngineConfig().prefill_attention == "auto"
    with pytest.raises(ValueError, match="must be one of"):
        EngineConfig(prefill_attention="sdpa")
    with pytest.raises(ValueError, match="cascade_min_prefix=-1 must be None \\(the default\\) or an integer >= 0"):
        EngineConfig(cascade_min_prefix=-1)
    assert EngineConfig(cascade_min_prefix=0).cascade_min_prefix == 0  # every chunk
    with pytest.raises(ValueError, match="leave prefill_attention='triton'"):
        resolve_backend("torch", 8, 2, 16, torch.device("cpu"), prefill_attention="flash-cascade")
    ap = _engine_parser()
    args = ap.parse_args(["--model", "tiny", "--prefill-attention", "flash-cascade"])
    assert engine_config_from_args(args, torch.device("cpu")).prefill_attention == "flash-cascade"
    for flags, want in [([], "auto"), (["--prefill-attention", "triton"], "triton")]:
        cfg = engine_config_from_args(ap.parse_args(["--model", "tiny", *flags]), torch.device("cpu"))
        assert cfg.prefill_attention == want  # triton named reaches the config (auto is the default)
    # auto on the reference backend: nothing to pick, no error; a cascade named there: an error (above)
    assert resolve_backend("torch", 8, 2, 16, torch.device("cpu"), prefill_attention="auto").name == "torch"


def test_auto_prefill_attention_resolves_by_device_and_dtype(monkeypatch):
    """auto: cudnn-cascade on a Hopper GPU (compute capability 9.x, where it was measured) in bf16 / fp16, triton
    elsewhere (other GPUs, float32, CPU); a named cascade in float32 is refused (torch's fused attention takes half
    types only); describe() says it was auto and what it chose."""
    from spanllm.attention import cascade
    from spanllm.attention.triton import TritonBackend

    bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32
    assert cascade.resolve_prefill_attention("auto", torch.device("cpu"), bf16) == "triton"
    assert cascade.resolve_prefill_attention("flash-cascade", torch.device("cpu"), bf16) == "flash-cascade"
    cases = [((9, 0), bf16, "cudnn-cascade"), ((9, 0), fp16, "cudnn-cascade"), ((9, 0), fp32, "triton")]
    cases += [((10, 0), bf16, "triton"), ((8, 9), bf16, "triton"), ((8, 0), bf16, "triton")]
    for cap, dtype, want in cases:
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=cap: c)
        assert cascade.resolve_prefill_attention("auto", torch.device("cuda"), dtype) == want
    monkeypatch.undo()
    with pytest.raises(ValueError, match="prefill_attention='cudnn-cascade' runs torch's fused attention, which takes"):
        cascade.resolve_prefill_attention("cudnn-cascade", torch.device("cpu"), fp32)
    pytest.importorskip("triton")
    b = TritonBackend(8, 2, 16, torch.device("cpu"), prefill_attention="auto")
    assert b.cascade is None and b.prefill_attention == "triton"
    assert "prefill triton (auto: no cascade on this device)" in b.describe(torch.bfloat16)
    named = TritonBackend(8, 2, 16, torch.device("cpu"), prefill_attention="cudnn-cascade")
    assert "prefill cudnn-cascade for prefixes >= 4096 keys" in named.describe(torch.bfloat16)
    assert "(auto)" not in named.describe(torch.bfloat16)
    # a min prefix where no cascade runs: refused, not ignored (the engine's API as the CLI)
    with pytest.raises(ValueError, match="cascade_min_prefix=0 chooses the chunks that run a cascade"):
        TritonBackend(8, 2, 16, torch.device("cpu"), prefill_attention="auto", cascade_min_prefix=0)
    from spanllm.attention.backend import resolve_backend

    with pytest.raises(ValueError, match="the torch attention backend .* which has none"):
        resolve_backend("torch", 8, 2, 16, torch.device("cpu"), cascade_min_prefix=0)


def test_cascade_min_prefix_flag():
    """--cascade-min-prefix reaches the config (0 included); refused below 0 and without a cascade attention."""
    from spanllm.commands.engine_args import (
        check_engine_arguments,
        engine_config_from_args,
    )
    from spanllm.errors import UsageError

    ap = _engine_parser()
    args = ap.parse_args(["--model", "tiny", "--prefill-attention", "cudnn-cascade", "--cascade-min-prefix", "0"])
    assert engine_config_from_args(args, torch.device("cpu")).cascade_min_prefix == 0
    if not torch.cuda.is_available():  # the cascade runs on the triton backend only: refused before ranks start
        with pytest.raises(UsageError, match="--prefill-attention cudnn-cascade is an option of the triton"):
            check_engine_arguments(args, serving=False)
    else:
        check_engine_arguments(args, serving=False)
    with pytest.raises(UsageError, match="--cascade-min-prefix -5: must be >= 0"):
        check_engine_arguments(ap.parse_args(["--model", "tiny", "--cascade-min-prefix", "-5"]), serving=False)
    with pytest.raises(UsageError, match="--prefill-attention is triton"):
        check_engine_arguments(
            ap.parse_args(["--model", "tiny", "--prefill-attention", "triton", "--cascade-min-prefix", "0"]),
            serving=False,
        )
    # the default's value typed where no cascade runs: refused as any other (the flag's default is "not given")
    if not torch.cuda.is_available():  # auto runs no cascade on CPU ranks: a min prefix would be ignored
        with pytest.raises(UsageError, match="runs none on CPU ranks, which have no GPU for the triton backend"):
            check_engine_arguments(ap.parse_args(["--model", "tiny", "--cascade-min-prefix", "4096"]), serving=False)
    assert engine_config_from_args(ap.parse_args(["--model", "tiny"]), torch.device("cpu")).cascade_min_prefix is None


def test_cascade_flags_on_a_hopper_gpu_name_the_real_reason(monkeypatch):
    """On a (faked) Hopper GPU with one rank: --attention-backend torch makes the min prefix meaningless (the
    backend, not auto, is the reason); float32 refuses a named cascade and makes auto run none."""
    from spanllm import checks
    from spanllm.commands.engine_args import check_engine_arguments
    from spanllm.errors import UsageError

    monkeypatch.setattr(checks, "device_type", lambda nprocs=None: "cuda")
    monkeypatch.setattr(checks, "no_triton_gpu", lambda device: None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    ap = _engine_parser()

    def refused(*flags) -> str:
        with pytest.raises(UsageError) as e:
            check_engine_arguments(ap.parse_args(["--model", "tiny", *flags]), serving=False)
        return str(e.value)

    msg = refused("--attention-backend", "torch", "--cascade-min-prefix", "0")
    assert "runs none with --attention-backend torch (the reference) on a GPU" in msg
    assert "drop --attention-backend torch, or drop --cascade-min-prefix" in msg
    msg = refused("--dtype", "float32", "--prefill-attention", "cudnn-cascade")
    assert "which takes bf16 or fp16, and --dtype float32 computes in float32" in msg
    msg = refused("--dtype", "float32", "--cascade-min-prefix", "0")
    assert "is auto, which runs none here (a cascade on a Hopper GPU in bf16 / fp16; this run: float32)" in msg
    check_engine_arguments(ap.parse_args(["--model", "tiny", "--cascade-min-prefix", "0"]), serving=False)  # runs
    monkeypatch.setattr(checks, "no_triton_gpu", lambda device: "no Triton")  # a GPU without Triton installed
    msg = refused("--cascade-min-prefix", "0")
    assert "runs none on a GPU, which have no Triton for the triton backend" in msg and "--attention-backend" not in msg

    # the engine's API names the same reasons: float32 on a Hopper GPU, and a GPU that is not a Hopper
    from spanllm.attention import triton as triton_backend
    from spanllm.attention.triton import TritonBackend

    monkeypatch.setattr(triton_backend.kernels, "num_sms_of", lambda device: 132)  # no CUDA device to ask

    with pytest.raises(ValueError, match="auto runs none in float32: a cascade takes bf16 / fp16"):
        TritonBackend(
            8, 2, 16, torch.device("cuda"), cascade_min_prefix=0, prefill_attention="auto", dtype=torch.float32
        )
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(ValueError, match="auto runs a cascade on a Hopper GPU only"):
        TritonBackend(8, 2, 16, torch.device("cuda"), cascade_min_prefix=0, prefill_attention="auto")


def test_shared_prefix_attention_flag():
    """--shared-prefix-attention reaches the config; 'on' is refused before any rank starts where the triton
    backend cannot run (here: no GPU, or the torch backend named), and by the reference backend itself."""
    from spanllm.attention.backend import resolve_backend
    from spanllm.commands.engine_args import (
        check_engine_arguments,
        engine_config_from_args,
    )
    from spanllm.engine.config import EngineConfig
    from spanllm.errors import UsageError

    ap = _engine_parser()
    args = ap.parse_args(["--model", "tiny", "--shared-prefix-attention", "off"])
    check_engine_arguments(args, serving=False)
    assert engine_config_from_args(args, torch.device("cpu")).shared_prefix_attention == "off"
    assert EngineConfig().shared_prefix_attention == "auto"
    with pytest.raises(ValueError, match="shared_prefix_attention='sometimes' must be one of"):
        EngineConfig(shared_prefix_attention="sometimes")
    on = ["--model", "tiny", "--shared-prefix-attention", "on", "--attention-backend", "torch"]
    with pytest.raises(UsageError, match="--shared-prefix-attention on is a feature of the triton attention backend"):
        check_engine_arguments(ap.parse_args(on), serving=False)
    with pytest.raises(ValueError, match="shared_prefix_attention='on' is a feature of the Triton attention backend"):
        resolve_backend("torch", 8, 2, 16, torch.device("cpu"), shared_prefix="on")
    assert resolve_backend("torch", 8, 2, 16, torch.device("cpu"), shared_prefix="auto").name == "torch"


def test_triton_only_options_are_judged_by_where_the_ranks_run(monkeypatch):
    """On a GPU machine, `--nprocs 2` spawns CPU ranks (gloo): the Triton-only options are refused there as on a
    machine without a GPU, whatever this process sees (the GPU seen here made the check pass before)."""
    from spanllm.commands.engine_args import check_engine_arguments
    from spanllm.errors import UsageError

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    ap = _engine_parser()
    for flags, message in [
        (["--prefill-attention", "cudnn-cascade"], "--prefill-attention cudnn-cascade is an option of the triton"),
        (["--shared-prefix-attention", "on"], "--shared-prefix-attention on is a feature of the triton attention"),
    ]:
        with pytest.raises(UsageError, match=message) as e:
            check_engine_arguments(ap.parse_args(["--model", "tiny", "--nprocs", "2", *flags]), serving=False)
        assert "--attention-backend auto on CPU ranks" in str(e.value)


def _engine_parser() -> argparse.ArgumentParser:
    """The model and engine options of a command that builds an engine."""
    from spanllm.commands.engine_args import add_engine_arguments, add_model_arguments

    ap = argparse.ArgumentParser()
    add_model_arguments(ap)
    add_engine_arguments(ap)
    return ap
