"""Shared-prefix decode attention (spanllm.attention.shared_prefix) on a GPU: the two kernels in bf16 at the 8B's
heads against the float32 reference and the plain decode kernel (groups over 2,048-token prefixes, rows in no
group, stage-1 splits), and the engine's greedy tokens with it on and off over prompts that share a cached
prefix, with the shared-prefix graphs replayed. Skipped without CUDA."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("triton")

from test_shared_prefix import _shared_pool  # noqa: E402

from spanllm.attention import reference as pa  # noqa: E402
from spanllm.attention.shared_prefix import members_per_group, plan_shared_prefix  # noqa: E402
from spanllm.attention.triton import TritonBackend  # noqa: E402
from spanllm.engine.config import EngineConfig  # noqa: E402
from spanllm.engine.llm import LLM  # noqa: E402
from spanllm.engine.sampler import SamplingParams  # noqa: E402
from spanllm.kernels import paged_attention as kt  # noqa: E402

DEV = torch.device("cuda")
BF16_TOL = 2e-2  # as tests/engine/test_gpu_paged.py
BS = 16


def _pool(prefixes: list[int], family: list[int], own: list[int], hkv: int, d: int, seed: int):
    """test_shared_prefix's pool (row r shares family[r]'s prefix blocks, -1: none, then own[r] keys of its own) in
    bf16 on the GPU; tables and context lengths as host arrays."""
    kc, vc, tables, ctx = _shared_pool(prefixes, family, own, hkv, d, seed)
    return kc.to(DEV, torch.bfloat16), vc.to(DEV, torch.bfloat16), tables.numpy(), ctx


@pytest.mark.parametrize("target_units", [4, 64])
def test_kernels_match_reference_and_plain_decode(target_units):
    hq, hkv, d = 32, 8, 128
    rng = np.random.default_rng(target_units)
    family = rng.integers(-1, 4, size=64).tolist()
    own = rng.integers(1, 300, size=64).tolist()
    kc, vc, tables, ctx = _pool([2048, 2048, 1024, 4096], family, own, hkv, d, seed=1)
    plan = plan_shared_prefix(
        tables, ctx, BS, kt.BLOCK_N, min_keys=512, members=members_per_group(hq // hkv), target_units=target_units
    )
    assert plan.num_groups >= 4 and plan.row_splits.max() >= (2 if target_units == 64 else 1)
    shared = kt.SharedPrefixTensors(
        *(torch.from_numpy(a).to(DEV) for a in (plan.group_rows, plan.units)),
        torch.from_numpy(plan.row_prefix).to(DEV),
        torch.from_numpy(plan.row_splits).to(DEV),
    )
    q = torch.randn(64, hq, d, device=DEV, dtype=torch.bfloat16)
    t, c = torch.from_numpy(tables).to(DEV), torch.from_numpy(ctx).to(DEV)
    splits = kt.num_splits_for(64, hkv, DEV)
    out = kt.decode(q, kc, vc, t, c, splits, shared=shared)
    plain = kt.decode(q, kc, vc, t, c, splits)
    want = pa.reference_decode(q.float(), kc.float(), vc.float(), t, ctx.tolist())
    torch.testing.assert_close(out.float(), want, atol=BF16_TOL, rtol=BF16_TOL)
    assert (out.float() - want).abs().max() <= (plain.float() - want).abs().max() * 1.5 + 1e-3


def test_engine_greedy_tokens_equal_with_and_without(monkeypatch):
    """12 prompts over two 1,200-token system prompts (cached after the first of each), random weights, float32
    (so that only a true near-tie may order two tokens differently: the two attentions sum in another order):
    the decode graphs with shared-prefix attention replay (prepare_decode_replay said so), and greedy tokens
    equal those with it off, token for token until a near-tie of 1e-3."""
    variants = []
    real = TritonBackend.prepare_decode_replay

    def spy(self, *a):
        v = real(self, *a)
        variants.append(v)
        return v

    monkeypatch.setattr(TritonBackend, "prepare_decode_replay", spy)
    rng = np.random.default_rng(0)
    systems = [rng.integers(1000, 100000, 1200).tolist() for _ in range(2)]
    prompts = [systems[i % 2] + rng.integers(1000, 100000, int(rng.integers(5, 60))).tolist() for i in range(12)]
    params = SamplingParams(max_tokens=24, ignore_eos=True, logprobs=2)
    runs = {}
    for mode in ("off", "on"):
        cfg = EngineConfig(
            dtype=torch.float32,
            max_num_seqs=16,
            max_num_batched_tokens=4096,
            num_kv_blocks=1200,
            max_model_len=4096,
            shared_prefix_attention=mode,
        )
        llm = LLM("llama3.1-8b:layers=2", cfg, device=DEV)
        assert ("once per group" in llm.describe()) == (mode == "on")
        llm.generate(prompts[:2], SamplingParams(max_tokens=1))  # cache both system prompts
        variants.clear()
        runs[mode] = llm.generate(prompts, params)
        llm.close()
        assert any(variants) == (mode == "on")
    for off, on in zip(runs["off"], runs["on"]):
        for i, (x, y) in enumerate(zip(off.output_ids, on.output_ids)):
            top = off.logprobs[i].top
            if top[0][1] - top[1][1] < 1e-3:
                break
            assert x == y, (i, top, on.logprobs[i].top, off.output_ids, on.output_ids)
