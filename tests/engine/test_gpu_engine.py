"""GPU-only (one GPU, no process group): the fixed batch with CUDA graphs against eager steps and transformers."""

from __future__ import annotations

import pytest
import torch
from engine_workers import NEW_TOKENS, PROMPTS, engine_config, generate

from spanllm.engine.llm import LLM
from spanllm.engine.sampler import SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_cuda_graph_fixed_batch_matches_transformers_fp32(hf_checkpoint, hf_reference):
    """The fixed batch on the worker with CUDA graphs (a mixed graph for the prefill, decode graphs after) and
    the Triton attention backend: tokens and logits of transformers."""
    llm = LLM(hf_checkpoint[0], engine_config(), device=torch.device("cuda", 0))
    assert llm.cuda_graphs and llm.worker.backend.name == "triton"
    res = generate(llm, PROMPTS, NEW_TOKENS)
    assert llm.worker.captured_buckets == [4] and llm.worker.captured_token_buckets == [16]
    assert res["tokens"] == hf_reference[0]
    for i in range(len(PROMPTS)):
        # TF32 may be on for matmuls: looser than the CPU tolerance.
        torch.testing.assert_close(res["logits"][:, i], hf_reference[1][i], atol=5e-3, rtol=0)
    # Micro-batches replay smaller buckets; the same tokens.
    again = generate(llm, PROMPTS, NEW_TOKENS, micro_batches=3)
    assert again["tokens"] == hf_reference[0]
    assert llm.worker.captured_buckets == [1, 4]


def test_cuda_graph_equals_eager_bf16(hf_checkpoint):
    dev = torch.device("cuda", 0)
    graphs = generate(LLM(hf_checkpoint[0], engine_config(dtype=torch.bfloat16), device=dev), PROMPTS, NEW_TOKENS)
    eager = generate(
        LLM(hf_checkpoint[0], engine_config(dtype=torch.bfloat16, cuda_graphs=False), device=dev), PROMPTS, NEW_TOKENS
    )
    assert graphs["tokens"] == eager["tokens"]
    torch.testing.assert_close(graphs["logits"], eager["logits"], atol=3e-2, rtol=0)


def test_timed_ops_run_eagerly_and_time_on_gpu(hf_checkpoint):
    llm = LLM(hf_checkpoint[0], engine_config(), device=torch.device("cuda", 0))
    with llm.timed_ops():
        assert not llm.cuda_graphs and "per-op timers on (eager)" in llm.describe()
        out = llm.generate_batch(PROMPTS, SamplingParams(max_tokens=4, ignore_eos=True))
    assert llm.cuda_graphs  # back on after
    # The spin lets the host enqueue each step ahead of the GPU, so the steps count as GPU time (covered);
    # a step that the host could not get ahead of would land in breakdown_uncovered instead.
    assert out.breakdown.steps + out.breakdown_uncovered.steps == 3
    assert out.breakdown.steps >= 1 and out.breakdown.ms["gemm"] > 0 and out.breakdown.ms["attention"] > 0


def test_fixed_batch_sampling_is_seeded_bf16(hf_checkpoint):
    """Temperature sampling in the fixed batch draws from the engine's seeded generator: two engines agree, and
    it samples (not one repeated draw)."""
    dev = torch.device("cuda", 0)
    params = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=24, ignore_eos=True)
    runs = [
        LLM(hf_checkpoint[0], engine_config(dtype=torch.bfloat16, seed=3), device=dev).generate_batch(PROMPTS, params)
        for _ in range(2)
    ]
    assert runs[0].token_ids == runs[1].token_ids
    assert len({t for row in runs[0].token_ids for t in row}) > 3


def test_skinny_decode_gemm_matches_transformers_fp32(hf_checkpoint, hf_reference, monkeypatch):
    """decode_gemm="skinny": every decode GEMM (<= 16 rows) runs spanllm's Triton kernel, in graphs and
    under torch.compile, and the tokens and logits still match transformers."""
    pytest.importorskip("triton")
    from spanllm.kernels import skinny_gemm

    calls = []
    real = skinny_gemm.skinny_linear
    monkeypatch.setattr(
        skinny_gemm, "skinny_linear", lambda x, w, config=None: calls.append(tuple(x.shape)) or real(x, w, config)
    )
    llm = LLM(hf_checkpoint[0], engine_config(decode_gemm="skinny"), device=torch.device("cuda", 0))
    assert "decode GEMMs skinny" in llm.describe()
    res = generate(llm, PROMPTS, NEW_TOKENS)
    assert calls and all(len(s) >= 2 and s[-1] > 0 for s in calls)
    assert res["tokens"] == hf_reference[0]
    for i in range(len(PROMPTS)):
        torch.testing.assert_close(res["logits"][:, i], hf_reference[1][i], atol=5e-3, rtol=0)


@pytest.mark.parametrize(
    "quantization, dtype, kv_cache_dtype",
    [
        (None, torch.bfloat16, "auto"),
        ("fp8", torch.bfloat16, "auto"),
        (None, torch.bfloat16, "fp8"),
        ("fp8", torch.bfloat16, "fp8"),
        (None, torch.float16, "auto"),
    ],
)
def test_pdl_on_equals_off_bit_for_bit(hf_checkpoint, quantization, dtype, kv_cache_dtype):
    """pdl="on" (every Triton kernel of the forward launched with programmatic dependent launch, in CUDA graphs and
    eagerly) changes when kernels start, never what they compute: tokens and logits equal pdl="off" bit for bit,
    with the skinny decode GEMMs (bf16 or fp16) or the FP8 ones, and over a bf16 or an FP8 KV cache, so that the
    chains norm -> GEMM -> RoPE -> attention are all Triton kernels waiting on each other."""
    pytest.importorskip("triton")
    from spanllm.kernels import pdl

    if not pdl.supported(torch.device("cuda", 0)):
        pytest.skip("programmatic dependent launch needs compute capability >= 9.0")
    dev = torch.device("cuda", 0)
    runs = {}
    for mode in ("off", "on"):
        for graphs in (True, False):
            cfg = engine_config(
                dtype=dtype,
                decode_gemm="skinny",
                quantization=quantization,
                kv_cache_dtype=kv_cache_dtype,
                pdl=mode,
                cuda_graphs=graphs,
            )
            llm = LLM(hf_checkpoint[0], cfg, device=dev)
            assert llm.pdl == (mode == "on") and f"PDL {mode}" in llm.describe()
            runs[mode, graphs] = generate(llm, PROMPTS, NEW_TOKENS)
    for graphs in (True, False):
        assert runs["on", graphs]["tokens"] == runs["off", graphs]["tokens"]
        assert torch.equal(runs["on", graphs]["logits"], runs["off", graphs]["logits"])
