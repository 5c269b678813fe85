"""The serving engine on a GPU: the Triton paged-attention kernels against the reference, decode CUDA
graphs against eager steps, and the engine's greedy tokens against the fixed batch. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
triton = pytest.importorskip("triton")

from spanllm.attention import reference as pa  # noqa: E402
from spanllm.engine.config import EngineConfig  # noqa: E402
from spanllm.engine.llm import LLM  # noqa: E402
from spanllm.engine.sampler import SamplingParams  # noqa: E402
from spanllm.kernels import arrival_counters  # noqa: E402
from spanllm.kernels import paged_attention as kt  # noqa: E402

DEV = torch.device("cuda")


def _pool(ctx: list[int], bs: int, hkv: int, d: int, dtype, seed: int = 0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    per = [-(-n // bs) for n in ctx]
    nb = sum(per) + 1
    kc = torch.randn(nb, bs, hkv, d, device=DEV, dtype=dtype, generator=g)
    vc = torch.randn(nb, bs, hkv, d, device=DEV, dtype=dtype, generator=g)
    ids = (torch.randperm(nb - 1, device=DEV, generator=g) + 1).to(torch.int32)
    tables = torch.zeros(len(ctx), max(per), dtype=torch.int32, device=DEV)
    k = 0
    for i, p in enumerate(per):
        tables[i, :p] = ids[k : k + p]
        k += p
    return kc, vc, tables


TOL = {torch.float32: 2e-4, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hq,hkv,d", [(32, 8, 128), (8, 4, 16), (8, 1, 64)])
@pytest.mark.parametrize("splits", [1, 3, 16])
@pytest.mark.parametrize("min_tiles", [1, None])  # 1: every split of a 1000-token context active; None: the default
@pytest.mark.parametrize("prefetch", [True, False])  # both key loops, whatever the grid size would pick
def test_decode_kernel_matches_reference(dtype, hq, hkv, d, splits, min_tiles, prefetch):
    ctx = [1, 15, 16, 17, 64, 65, 300, 1000]
    kc, vc, tables = _pool(ctx, 16, hkv, d, dtype)
    q = torch.randn(len(ctx), hq, d, device=DEV, dtype=dtype)
    ref = pa.reference_decode(q.float(), kc.float(), vc.float(), tables, ctx)
    out = kt.decode(
        q, kc, vc, tables, torch.tensor(ctx, dtype=torch.int32, device=DEV), splits, min_tiles, prefetch=prefetch
    )
    assert (out.float() - ref).abs().max().item() < TOL[dtype]


@pytest.mark.parametrize("prefetch", [True, False])
def test_split_decode_merges_right_on_every_call_and_replay(prefetch):
    """The last split of each (sequence, KV head) to finish merges and resets its counter: the same output (bit
    for bit: the merge order is fixed, whichever split arrives last) on 30 calls in a row and on 20 replays of
    a captured call, equal to the reference, and every counter back at zero afterwards."""
    from spanllm.cuda_graph import capture_graph

    ctx = [1, 63, 64, 65, 700, 3000]
    kc, vc, tables = _pool(ctx, 16, 8, 128, torch.bfloat16, seed=5)
    q = torch.randn(len(ctx), 32, 128, device=DEV, dtype=torch.bfloat16)
    cl = torch.tensor(ctx, dtype=torch.int32, device=DEV)
    ref = pa.reference_decode(q.float(), kc.float(), vc.float(), tables, ctx)
    first = kt.decode(q, kc, vc, tables, cl, 16, prefetch=prefetch)
    assert (first.float() - ref).abs().max().item() < TOL[torch.bfloat16]
    for _ in range(30):
        assert torch.equal(kt.decode(q, kc, vc, tables, cl, 16, prefetch=prefetch), first)
    outs: list[torch.Tensor] = []
    graph = capture_graph(lambda: outs.append(kt.decode(q, kc, vc, tables, cl, 16, prefetch=prefetch)), DEV, warmup=1)
    for _ in range(20):
        outs[-1].zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(outs[-1], first)
    assert arrival_counters.all_zero(q.device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hq,hkv,d", [(32, 8, 128), (8, 4, 16)])
def test_prefill_kernel_matches_reference(dtype, hq, hkv, d):
    q_lens = [1, 5, 16, 17, 100, 300]
    ctx = [1, 40, 16, 200, 100, 700]  # chunks after a cached prefix (40 - 5 earlier tokens, ...)
    kc, vc, tables = _pool(ctx, 16, hkv, d, dtype, seed=1)
    q = torch.randn(sum(q_lens), hq, d, device=DEV, dtype=dtype)
    cu = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32, device=DEV)
    tiles = torch.tensor(kt.prefill_tiles(q_lens, hq // hkv), dtype=torch.int32, device=DEV)
    ref = pa.reference_prefill(q.float(), kc.float(), vc.float(), tables, q_lens, ctx)
    out = kt.prefill(q, kc, vc, tables, cu, torch.tensor(ctx, dtype=torch.int32, device=DEV), tiles)
    assert (out.float() - ref).abs().max().item() < TOL[dtype]


PROMPTS = [[1, 5, 7, 9, 11], [3, 4], list(range(10, 60)), [100] * 17, list(range(200, 233))]


def _engine(**kw) -> LLM:
    cfg = dict(
        dtype=torch.float32,
        max_num_batched_tokens=24,
        block_size=16,
        num_kv_blocks=64,
        max_num_seqs=8,
    )
    cfg.update(kw)
    return LLM("tiny", EngineConfig(**cfg), device=DEV)


def test_engine_greedy_equals_fixed_batch_with_graphs_chunks_and_preemption():
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    llm = _engine()
    ref = [llm.generate_batch([p], params).token_ids[0] for p in PROMPTS]
    for kw in ({}, {"num_kv_blocks": 8}, {"cuda_graphs": False}):
        e = _engine(**kw)
        outs = e.generate(PROMPTS, params)
        assert [o.output_ids for o in outs] == ref, kw
        assert e.engine_core.runner.use_cuda_graphs == kw.get("cuda_graphs", True)
        if kw.get("cuda_graphs", True):  # decode-only steps and mixed steps both ran as graphs
            assert e.engine_core.runner.captured_buckets and e.engine_core.runner.captured_token_buckets
        e.engine_core.blocks.check([])
        if "num_kv_blocks" in kw:
            assert e.engine_core.stats.preemptions > 0


def test_every_bucket_captures_and_replays():
    e = _engine(max_num_seqs=24)
    assert e.engine_core.runner.capture_all() == [1, 2, 4, 8, 16, 24]
    assert e.engine_core.runner.captured_token_buckets == [16, 24]  # max_num_batched_tokens=24
    outs = e.generate(PROMPTS * 4, SamplingParams(max_tokens=8, ignore_eos=True))
    assert all(len(o.output_ids) == 8 for o in outs)
    assert [o.output_ids for o in outs[:5]] == [o.output_ids for o in outs[5:10]]


def test_mixed_graphs_match_eager_on_the_8b_shapes():
    """A 2-layer slice of the 8B preset (its real head layout: 32 query / 8 KV heads of 128; the fused RoPE +
    cache-write, add + RMSNorm and SiLU kernels at real sizes), float32 so that the different kernel choices
    of graph and eager steps (the mixed graph's fixed grids, GEMMs of padded M) stay far below
    a greedy token's margin: graphs (decode and mixed) against eager steps, chunked prompts."""
    prompts = [list(range(1000, 1000 + n)) for n in (3, 70, 200, 17)]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    outs = []
    for graphs in (True, False):
        cfg = EngineConfig(
            dtype=torch.float32,
            max_num_seqs=8,
            max_num_batched_tokens=64,
            num_kv_blocks=200,
            cuda_graphs=graphs,
            max_model_len=1024,
        )
        llm = LLM("llama3.1-8b:layers=2", cfg, device=DEV)
        outs.append([o.output_ids for o in llm.generate(prompts, params)])
        if graphs:
            assert llm.engine_core.runner.captured_token_buckets
        llm.close()
    assert outs[0] == outs[1]


def test_auto_decode_gemm_on_the_8b_shapes_in_bf16():
    """decode_gemm='auto' (the default) on a 2-layer slice of the 8B in bf16: the measured tables send one row of
    every GEMM to the CUDA-core GEMV, and qkv, o and down to the skinny kernel at 2-16 rows, gate_up and the LM head
    to F.linear, and the engine says so.
    Prefill (more than 16 rows) runs F.linear either way, so every request's first token equals the 'torch'
    engine's; two runs give the same tokens; the skinny kernels ran."""
    prompts = [list(range(1000, 1000 + n)) for n in (20, 70, 33)]
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    runs = {}
    for mode in ("auto", "torch", "auto"):
        cfg = EngineConfig(
            dtype=torch.bfloat16,
            max_num_seqs=8,
            max_num_batched_tokens=256,
            num_kv_blocks=200,
            max_model_len=1024,
            decode_gemm=mode,
        )
        llm = LLM("llama3.1-8b:layers=2", cfg, device=DEV)
        if mode == "auto":
            assert (
                "decode GEMMs auto (measured table) at 1 row: CUDA-core GEMV qkv, o, gate_up, down, lm_head (table 9"
                " entries); skinny -; F.linear - | 2-16 rows: skinny qkv, o, down; F.linear gate_up, lm_head"
            ) in llm.describe()
        outs = [o.output_ids for o in llm.generate(prompts, params)]
        assert all(len(o) == 10 for o in outs)
        runs.setdefault(mode, []).append(outs)
        llm.close()
    assert runs["auto"][0] == runs["auto"][1]
    assert [o[0] for o in runs["auto"][0]] == [o[0] for o in runs["torch"][0]]


def test_batch_sampler_one_pass_race_equals_the_unfused_ops():
    """On CUDA the serving sampler's temperature rows take the one-pass race (sampler_triton): on the same draws
    (the engine's generator, a seeded row's own) it picks what argmax(softmax(logits / T) / E) picks; greedy
    rows take the argmax; a top-p row sends the batch through the unfused ops, which still give the same draws'
    tokens for the other rows."""
    from spanllm.engine import sampler as sampler_mod

    assert sampler_mod.race_argmax is not None
    b, v = 64, 128256
    logits = torch.randn(b, v, device=DEV) * 4
    params = [SamplingParams(temperature=t, max_tokens=4) for t in (0.7, 1.0, 1.3, 0.0)] * (b // 4)
    gens = [None] * b
    gens[5] = torch.Generator(device=DEV)
    gens[5].manual_seed(9)
    fused = sampler_mod.BatchSampler(DEV, seed=5).sample(logits.clone(), params, [()] * b, gens).tokens
    g = torch.Generator(device=DEV)
    g.manual_seed(5)
    race = torch.empty_like(logits).exponential_(1.0, generator=g)
    own = torch.Generator(device=DEV)
    own.manual_seed(9)
    race[5].exponential_(1.0, generator=own)
    temps = torch.tensor([p.temperature or 1.0 for p in params], device=DEV)
    ref = (torch.softmax(logits / temps[:, None], dim=-1) / race).argmax(dim=-1)
    greedy = torch.tensor([p.greedy for p in params], device=DEV)
    ref = torch.where(greedy, logits.argmax(dim=-1), ref)
    # equal tokens, except where float32 rounding meets a near-tie: there the two tokens' log-space scores
    # (logits / T - log E) must agree to 1e-4 (Gumbel-max top-2 gaps are O(1): this almost never happens)
    score = logits / temps[:, None] - race.log()
    for i in (fused != ref).nonzero().flatten().tolist():
        assert not params[i].greedy, i
        assert abs(score[i, fused[i]].item() - score[i, ref[i]].item()) < 1e-4, i
    # with one top-p row the batch takes the unfused ops: the other rows' tokens are the same
    params_p = list(params)
    params_p[1] = SamplingParams(temperature=1.0, top_p=0.5, max_tokens=4)
    gens[5].manual_seed(9)
    unfused = sampler_mod.BatchSampler(DEV, seed=5).sample(logits.clone(), params_p, [()] * b, gens).tokens
    keep = [i for i in range(b) if i != 1]
    assert unfused[keep].tolist() == ref[keep].tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_ops_match_their_references(dtype):
    from spanllm.kernels import fused_ops as fo
    from spanllm.layers.rope import apply_rotary

    g = torch.Generator(device=DEV).manual_seed(3)
    x = torch.randn(37, 4096, device=DEV, dtype=dtype, generator=g)
    r = torch.randn(37, 4096, device=DEV, dtype=dtype, generator=g)
    w = torch.rand(4096, device=DEV, dtype=dtype, generator=g) + 0.5
    for res in (None, r):
        out, new_res = fo.add_rms_norm(x, res, w, 1e-5)
        ref, ref_res = fo.add_rms_norm_reference(x, res, w, 1e-5)
        assert torch.equal(new_res, ref_res)
        assert (out.float() - ref.float()).abs().max().item() <= (1e-5 if dtype == torch.float32 else 2e-2)
    gu = torch.randn(37, 2 * 7168, device=DEV, dtype=dtype, generator=g)
    assert (fo.silu_mul(gu).float() - fo.silu_mul_reference(gu).float()).abs().max().item() <= (
        1e-5 if dtype == torch.float32 else 2e-2
    )
    hq, hkv, d, n = 32, 8, 128, 21
    qkv = torch.randn(n, (hq + 2 * hkv) * d, device=DEV, dtype=dtype, generator=g)
    pos = torch.randint(0, 5000, (n,), device=DEV, generator=g)
    from spanllm.layers.rope import RotaryEmbedding
    from spanllm.model.config import preset

    c = preset("llama3.1-8b")
    rope = RotaryEmbedding(d, c.rope_theta, c.rope_scaling, 8192, DEV, dtype)
    cos, sin = rope.cos[pos].unsqueeze(1), rope.sin[pos].unsqueeze(1)
    kc = torch.zeros(8, 16, hkv, d, device=DEV, dtype=dtype)
    vc = torch.zeros_like(kc)
    slots = torch.randperm(8 * 16, device=DEV, generator=g)[:n]
    qk, v = qkv.split([(hq + hkv) * d, hkv * d], dim=-1)
    q = fo.rope_and_cache(qk, cos, sin, slots, kc, vc, hq, hkv, d)
    rot = apply_rotary(qk.reshape(n, hq + hkv, d), cos, sin)
    # The same roundings as the torch code, except where the compiler keeps a product unrounded (an FMA):
    # in bf16 that is one rounding of the operands' scale apart (seen on the H200: 14.5% of elements, one
    # bf16 ulp at |x| ~ 4), in fp32 a few fp32 ulps.
    scale = float(qk.abs().max())
    tol = dict(atol=2**-7 * scale, rtol=0) if dtype == torch.bfloat16 else dict(atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(q, rot[:, :hq], **tol)
    torch.testing.assert_close(kc.view(-1, hkv, d)[slots], rot[:, hq:], **tol)
    assert torch.equal(vc.view(-1, hkv, d)[slots], v.reshape(n, hkv, d))


@pytest.mark.parametrize(
    "config",
    [
        None,
        kt.PrefillConfig(block_q=32, block_n=128, num_warps=8, num_stages=2),
        kt.PrefillConfig(block_q=32, block_n=64, num_warps=8, num_stages=3, lazy_rescale=True),
        kt.PrefillConfig(block_q=16, block_n=64, num_warps=4, num_stages=3),
    ],
    ids=lambda c: "default" if c is None else c.label(),
)
def test_prefill_kernel_long_prefix_tilings(config):
    """The tilings scripts/gpu_prefill_attention.py sweeps, at a long prefix ending mid-block, in bf16."""
    q_lens, ctx = [300, 1, 77], [300 + 20011, 4097, 77]
    kc, vc, tables = _pool(ctx, 16, 8, 128, torch.bfloat16, seed=3)
    q = torch.randn(sum(q_lens), 32, 128, device=DEV, dtype=torch.bfloat16)
    cu = torch.tensor([0, 300, 301, 378], dtype=torch.int32, device=DEV)
    bq = None if config is None else config.block_q
    tiles = torch.tensor(kt.prefill_tiles(q_lens, 4, context_lens=ctx, block_q=bq), dtype=torch.int32, device=DEV)
    ref = pa.reference_prefill(q.float(), kc.float(), vc.float(), tables, q_lens, ctx)
    out = kt.prefill(q, kc, vc, tables, cu, torch.tensor(ctx, dtype=torch.int32, device=DEV), tiles, config=config)
    assert (out.float() - ref).abs().max().item() < TOL[torch.bfloat16]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_kv_cache_writes_and_reads(dtype):
    """--kv-cache-dtype fp8 on the GPU: the fused RoPE kernel writes into an FP8 cache exactly what it writes into a
    cache of the model dtype, cast by torch (saturating, nearest even); the decode and prefill kernels on that
    cache match the reference reading the same bytes."""
    from spanllm.kernels import fused_ops as fo

    g = torch.Generator(device=DEV).manual_seed(5)
    hq, hkv, d, n = 32, 8, 128, 21
    qkv = torch.randn(n, (hq + 2 * hkv) * d, device=DEV, dtype=dtype, generator=g) * 60
    qkv[3, hq * d + 5] = 7000.0  # a key and a value past 448: saturated, not NaN
    qkv[4, (hq + hkv) * d + 9] = -9000.0
    cos = torch.rand(n, 1, d, device=DEV, dtype=dtype, generator=g)
    sin = torch.rand(n, 1, d, device=DEV, dtype=dtype, generator=g)
    slots = torch.randperm(8 * 16, device=DEV, generator=g)[:n]
    qk, _ = qkv.split([(hq + hkv) * d, hkv * d], dim=-1)
    caches = {}
    for kv_dtype in (dtype, torch.float8_e4m3fn):
        kc = torch.zeros(8, 16, hkv, d, device=DEV, dtype=kv_dtype)
        vc = torch.zeros_like(kc)
        q = fo.rope_and_cache(qk, cos, sin, slots, kc, vc, hq, hkv, d)
        caches[kv_dtype] = (q, kc, vc)
    q_model, kc_model, vc_model = caches[dtype]
    q_fp8, kc_fp8, vc_fp8 = caches[torch.float8_e4m3fn]
    assert torch.equal(q_fp8, q_model)
    for fp8_cache, model_cache in ((kc_fp8, kc_model), (vc_fp8, vc_model)):
        # torch's cast does not saturate (past 448 it gives NaN): the cache's contract is saturate, then cast
        want = model_cache.float().clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
        bad = (fp8_cache.view(torch.uint8) != want.view(torch.uint8)).nonzero().tolist()
        assert not bad, f"{len(bad)} bytes differ, e.g. " + ", ".join(
            f"{i}: {model_cache[tuple(i)].item()!r} -> 0x{int(fp8_cache.view(torch.uint8)[tuple(i)]):02X}, "
            f"want 0x{int(want.view(torch.uint8)[tuple(i)]):02X}"
            for i in bad[:4]
        )
    assert kc_fp8.float().abs().max().item() == 448.0 and vc_fp8.float().min().item() == -448.0
    # the kernels reading an FP8 pool
    ctx = [1, 300, 1000]
    kc, vc, tables = _pool(ctx, 16, 8, 128, torch.float32, seed=9)
    kc, vc = (kc * 3).to(torch.float8_e4m3fn), (vc * 3).to(torch.float8_e4m3fn)
    qd = torch.randn(len(ctx), 32, 128, device=DEV, dtype=dtype, generator=g)
    cl = torch.tensor(ctx, dtype=torch.int32, device=DEV)
    got = kt.decode(qd, kc, vc, tables, cl, 8)
    want = pa.reference_decode(qd, kc, vc, tables, ctx)
    torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])
    assert arrival_counters.all_zero(DEV)


def test_engine_with_an_fp8_cache_graphs_equal_eager_and_reference_backend():
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    outs = {}
    for name, kw in {
        "graphs": {},
        "eager": {"cuda_graphs": False},
        "torch": {"attention_backend": "torch", "cuda_graphs": False},
    }.items():
        e = _engine(kv_cache_dtype="fp8", **kw)
        assert e.worker.cache.layer(0)[0].dtype == torch.float8_e4m3fn
        outs[name] = [o.output_ids for o in e.generate(PROMPTS, params)]
        e.engine_core.blocks.check([])
    assert outs["graphs"] == outs["eager"] == outs["torch"]
