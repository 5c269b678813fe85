"""The cascade prefill (spanllm.attention.cascade) on a GPU: torch's cuDNN and flash attention ops as the cascade
uses them (shapes, strided views, the LSE's layout and natural-log base), the cascade against the Triton prefill
kernel and the float32 reference at a 20k prefix, a whole backend step (decodes, long and short chunks) against
the Triton-only backend, and the engine's greedy tokens and logprobs with the cascade against the Triton kernel.
Skipped without CUDA."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("triton")

from spanllm.attention import reference as pa  # noqa: E402
from spanllm.attention.cascade import CASCADE_ATTENTION, cascade_prefill, reference_attention  # noqa: E402
from spanllm.attention.triton import TritonBackend  # noqa: E402
from spanllm.engine.config import EngineConfig  # noqa: E402
from spanllm.engine.llm import LLM  # noqa: E402
from spanllm.engine.sampler import SamplingParams  # noqa: E402
from spanllm.kernels import paged_attention as kt  # noqa: E402

DEV = torch.device("cuda")
BF16_TOL = 2e-2  # as tests/engine/test_gpu_paged.py
KINDS = list(CASCADE_ATTENTION)


def _pool(ctx: list[int], hkv: int, d: int, seed: int, decodes: int = 0):
    """bf16 pool, one sequence per context length, shuffled blocks; block 0 unused; unused table entries of the
    prefill rows point at a block of NaNs (the first `decodes` rows': block 0, which the batched reference decode
    reads masked)."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    per = [-(-n // 16) for n in ctx]
    poison = sum(per) + 1
    kc = torch.randn(poison + 1, 16, hkv, d, device=DEV, dtype=torch.bfloat16, generator=g)
    vc = torch.randn(poison + 1, 16, hkv, d, device=DEV, dtype=torch.bfloat16, generator=g)
    kc[poison] = float("nan")
    vc[poison] = float("nan")
    ids = (torch.randperm(poison - 1, device=DEV, generator=g) + 1).to(torch.int32)
    tables = torch.full((len(ctx), max(per) + 2), poison, dtype=torch.int32, device=DEV)
    tables[:decodes] = 0
    k = 0
    for i, p in enumerate(per):
        tables[i, :p] = ids[k : k + p]
        k += p
    return kc, vc, tables


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("causal", [False, True])
def test_attention_op_returns_out_and_natural_log_lse(kind, causal):
    """The aten op as the cascade calls it, on the views it passes (BSHD-strided K/V, BHSD q): out and lse
    [B, H, L] float32 equal to the float32 math (a base-2 LSE would be off by a factor 1.44)."""
    g = torch.Generator(device=DEV).manual_seed(0)
    lq, lk = (300, 300) if causal else (300, 1000)
    q = torch.randn(1, 8, lq, 128, device=DEV, dtype=torch.bfloat16, generator=g)
    k = torch.randn(lk, 8, 128, device=DEV, dtype=torch.bfloat16, generator=g).transpose(0, 1)[None]
    v = torch.randn(lk, 8, 128, device=DEV, dtype=torch.bfloat16, generator=g).transpose(0, 1)[None]
    out, lse = CASCADE_ATTENTION[kind](q, k, v, causal)
    ref_out, ref_lse = reference_attention(q, k, v, causal)
    assert lse.shape == (1, 8, lq) and lse.dtype == torch.float32 and out.shape == q.shape
    assert (lse - ref_lse).abs().max().item() < 1e-2
    assert (out.float() - ref_out.float()).abs().max().item() < BF16_TOL


@pytest.mark.parametrize("kind", KINDS)
def test_attention_op_takes_fewer_kv_heads(kind):
    """GQA as the cascade's causal part calls it (32 query heads, 8 KV heads, BSHD-strided K/V): equal to the
    same call with K/V repeated to 32 heads (cuDNN reads the groups itself; flash gets them repeated)."""
    g = torch.Generator(device=DEV).manual_seed(2)
    q = torch.randn(1, 32, 700, 128, device=DEV, dtype=torch.bfloat16, generator=g)
    k = torch.randn(700, 8, 128, device=DEV, dtype=torch.bfloat16, generator=g).transpose(0, 1)[None]
    v = torch.randn(700, 8, 128, device=DEV, dtype=torch.bfloat16, generator=g).transpose(0, 1)[None]
    out, lse = CASCADE_ATTENTION[kind](q, k, v, True)
    want, want_lse = CASCADE_ATTENTION[kind](q, k.repeat_interleave(4, dim=1), v.repeat_interleave(4, dim=1), True)
    assert out.shape == q.shape and lse.shape == (1, 32, 700)
    assert (lse - want_lse).abs().max().item() < 1e-5
    assert (out.float() - want.float()).abs().max().item() < 1e-2


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("bucket", [1, 1024])
def test_cascade_matches_the_triton_kernel_at_a_20k_prefix(kind, bucket):
    """A chunk of 1000 queries starting mid-block after 20,011 cached keys, 32 / 8 heads of 128, bf16; at the
    exact shapes and at shapes rounded to 1024 rows (what the cuDNN cascade runs: 555 keys moved to the causal
    part, padding queries and keys)."""
    prefix, c = 20011, 1000
    kc, vc, tables = _pool([prefix + c], 8, 128, seed=1)
    q = torch.randn(c, 32, 128, device=DEV, dtype=torch.bfloat16)
    out = cascade_prefill(q, kc, vc, tables[0], prefix, CASCADE_ATTENTION[kind], bucket=bucket)
    tiles = torch.tensor(kt.prefill_tiles([c], 4, context_lens=[prefix + c]), dtype=torch.int32, device=DEV)
    cu = torch.tensor([0, c], dtype=torch.int32, device=DEV)
    cl = torch.tensor([prefix + c], dtype=torch.int32, device=DEV)
    tri = kt.prefill(q, kc, vc, tables, cu, cl, tiles)
    ref = pa.reference_prefill(q.float(), kc.float(), vc.float(), tables, [c], [prefix + c])
    assert not out.isnan().any()
    assert (out.float() - ref).abs().max().item() < BF16_TOL
    assert (out.float() - tri.float()).abs().max().item() < BF16_TOL


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("nd", [0, 3])
def test_a_backend_step_with_long_and_short_chunks(kind, nd):
    """Chunks after prefixes of 20,011 / 100 / 5,000 keys, alone or after 3 decodes: the cascade backend (prefixes
    >= 4096; beside decodes the paged kernel runs every chunk) against the Triton-only backend and the reference,
    every row."""
    hq, hkv, d = 32, 8, 128
    q_lens = np.array([1, 1, 1, 700, 50, 333][3 - nd :], dtype=np.int32)
    context_lens = np.array([40, 3000, 17, 20011 + 700, 100 + 50, 5000 + 333][3 - nd :], dtype=np.int32)
    kc, vc, tables = _pool(context_lens.tolist(), hkv, d, seed=2, decodes=nd)
    q = torch.randn(int(q_lens.sum()), hq, d, device=DEV, dtype=torch.bfloat16)
    cos = sin = torch.zeros(len(q), 1, d, device=DEV)

    def h2d(a):
        return torch.from_numpy(np.ascontiguousarray(a)).to(DEV)

    outs = []
    for b in (TritonBackend(hq, hkv, d, DEV, prefill_attention=kind), TritonBackend(hq, hkv, d, DEV)):
        meta = b.build_metadata(nd, q_lens, context_lens, tables.cpu().numpy(), cos, sin, None, h2d)
        outs.append(b.attend(q, kc, vc, meta).float())
        assert len(meta.cascade or []) == (2 if b.cascade and nd == 0 else 0)
    rmeta = pa.ReferenceBackend(hq, hkv, d, DEV).build_metadata(
        nd, q_lens, context_lens, tables.cpu().numpy(), cos, sin, None, h2d
    )
    ref = pa.reference_attend(q.float(), kc.float(), vc.float(), rmeta)
    assert not outs[0].isnan().any()
    assert (outs[0] - ref).abs().max().item() < BF16_TOL
    assert (outs[0] - outs[1]).abs().max().item() < BF16_TOL


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
@pytest.mark.parametrize("kind", KINDS)
def test_engine_short_prompt_after_a_long_cached_prefix(kind, kv_cache_dtype, monkeypatch):
    """A 2-layer slice of the 8B preset in bf16 (cuDNN and flash take no float32): a 6,000-token prompt in
    chunks of 1024 (chunks after >= 1024 keys on the cascade), then that prompt plus 40 tokens (its one chunk
    after a cached prefix of ~6,000 keys). Against the Triton kernel: the first token's top-5 logprobs within
    bf16 noise, and the greedy tokens equal up to the first near-tie of the Triton run (a bf16 reordering can
    flip a tie; none of these is a tie of the models' own making)."""
    import spanllm.attention.triton as tb

    calls = []
    real = tb.attend_long_chunks
    monkeypatch.setattr(tb, "attend_long_chunks", lambda *a: calls.append(len(a[4])) or real(*a))
    rng = np.random.default_rng(0)
    long = rng.integers(1000, 100000, 6000).tolist()
    prompts = [long, long + rng.integers(1000, 100000, 40).tolist()]
    params = SamplingParams(max_tokens=8, ignore_eos=True, logprobs=5)
    runs = {}
    for mode in ("triton", kind):
        cfg = EngineConfig(
            dtype=torch.bfloat16,
            max_num_seqs=8,
            max_num_batched_tokens=1024,
            num_kv_blocks=1200,
            max_model_len=8192,
            prefill_attention=mode,
            cascade_min_prefix=None if mode == "triton" else 1024,  # refused where no cascade runs
            kv_cache_dtype=kv_cache_dtype,  # fp8: the cascade reads the e4m3 cache as the paged kernel does
        )
        llm = LLM("llama3.1-8b:layers=2", cfg, device=DEV)
        assert (kind in llm.describe()) == (mode == kind)
        runs[mode] = [llm.generate([p], params)[0] for p in prompts]  # the second hits the first's cached blocks
        llm.close()
    assert sum(calls) >= 5  # chunks 2..6 of the long prompt and the short one ran the cascade
    for tri, cas in zip(runs["triton"], runs[kind]):
        a = dict(tri.logprobs[0].top)
        b = dict(cas.logprobs[0].top)
        shared = a.keys() & b.keys()
        assert len(shared) >= 4 and max(abs(a[t] - b[t]) for t in shared) < 0.05, (a, b)
        for i, (x, y) in enumerate(zip(tri.output_ids, cas.output_ids)):
            top = tri.logprobs[i].top
            if top[0][1] - top[1][1] < 0.05:
                break  # a near-tie: bf16 may order it either way, and the rest follows another token
            assert x == y, (i, tri.output_ids, cas.output_ids)
