"""The serving engine on a GPU: the Triton paged-attention kernels against the reference, decode CUDA
graphs against eager steps, and the engine's greedy tokens against the static path. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
triton = pytest.importorskip("triton")

from spanllm.engine import paged_attention as pa  # noqa: E402
from spanllm.engine import paged_attention_triton as kt  # noqa: E402
from spanllm.engine.config import EngineConfig  # noqa: E402
from spanllm.engine.llm import LLM  # noqa: E402
from spanllm.engine.sampler import SamplingParams  # noqa: E402

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
        tables[i, :p] = ids[k: k + p]
        k += p
    return kc, vc, tables


TOL = {torch.float32: 2e-4, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hq,hkv,d", [(32, 8, 128), (8, 4, 16), (8, 1, 64)])
@pytest.mark.parametrize("splits", [1, 3, 16])
def test_decode_kernel_matches_reference(dtype, hq, hkv, d, splits):
    ctx = [1, 15, 16, 17, 64, 65, 300, 1000]
    kc, vc, tables = _pool(ctx, 16, hkv, d, dtype)
    q = torch.randn(len(ctx), hq, d, device=DEV, dtype=dtype)
    ref = pa.reference_decode(q.float(), kc.float(), vc.float(), tables, ctx)
    out = kt.decode(q, kc, vc, tables, torch.tensor(ctx, dtype=torch.int32, device=DEV), splits)
    assert (out.float() - ref).abs().max().item() < TOL[dtype]


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
    cfg = dict(max_batch_size=len(PROMPTS), max_seq_len=128, dtype=torch.float32, max_num_batched_tokens=24,
               block_size=16, num_kv_blocks=64, max_num_seqs=8)
    cfg.update(kw)
    return LLM("tiny", EngineConfig(**cfg), device=DEV)


def test_engine_greedy_equals_static_path_with_graphs_chunks_and_preemption():
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    llm = _engine()
    ref = [llm.generate_static([p], params).token_ids[0] for p in PROMPTS]
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


def test_mixed_graphs_match_eager_in_bf16_on_the_8b_shapes():
    """A 2-layer slice of the 8B preset (its real head layout: 32 query / 8 KV heads of 128) in bf16:
    graphs (decode and mixed) against eager steps, greedy, chunked prompts."""
    prompts = [list(range(1000, 1000 + n)) for n in (3, 70, 200, 17)]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    outs = []
    for graphs in (True, False):
        cfg = EngineConfig(dtype=torch.bfloat16, max_num_seqs=8, max_num_batched_tokens=64, num_kv_blocks=200,
                           cuda_graphs=graphs, max_model_len=1024)
        llm = LLM("llama3.1-8b:layers=2", cfg, device=DEV)
        outs.append([o.output_ids for o in llm.generate(prompts, params)])
        if graphs:
            assert llm.engine_core.runner.captured_token_buckets
        llm.close()
    assert outs[0] == outs[1]
