"""GPU-only (one GPU, no process group): CUDA-graph decode against eager decode and transformers."""

from __future__ import annotations

import pytest
import torch
from engine_workers import NEW_TOKENS, PROMPTS, engine_config, generate

from spanllm.engine.llm import LLM
from spanllm.engine.sampler import SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_cuda_graph_decode_matches_transformers_fp32(hf_checkpoint, hf_reference):
    llm = LLM(hf_checkpoint[0], engine_config(), device=torch.device("cuda", 0))
    assert llm.cuda_graphs
    res = generate(llm, PROMPTS, NEW_TOKENS)
    assert llm.runner.captured_buckets == [(len(PROMPTS), 0)]
    assert res["tokens"] == hf_reference[0]
    for i in range(len(PROMPTS)):
        # TF32 may be on for matmuls: looser than the CPU tolerance.
        torch.testing.assert_close(res["logits"][:, i], hf_reference[1][i], atol=5e-3, rtol=0)
    # Replaying the captured graphs again (micro-batches: one more bucket per slot range) gives the same tokens.
    again = generate(llm, PROMPTS, NEW_TOKENS, micro_batches=3)
    assert again["tokens"] == hf_reference[0]
    assert llm.runner.captured_buckets == [(1, 0), (1, 1), (1, 2), (3, 0)]


def test_cuda_graph_equals_eager_bf16(hf_checkpoint):
    dev = torch.device("cuda", 0)
    graphs = generate(LLM(hf_checkpoint[0], engine_config(dtype=torch.bfloat16), device=dev), PROMPTS, NEW_TOKENS)
    eager = generate(
        LLM(hf_checkpoint[0], engine_config(dtype=torch.bfloat16, cuda_graphs=False), device=dev), PROMPTS, NEW_TOKENS
    )
    assert graphs["tokens"] == eager["tokens"]
    torch.testing.assert_close(graphs["logits"], eager["logits"], atol=3e-2, rtol=0)


def test_breakdown_disables_graphs_and_times_on_gpu(hf_checkpoint):
    llm = LLM(hf_checkpoint[0], engine_config(breakdown=True), device=torch.device("cuda", 0))
    assert not llm.cuda_graphs and "breakdown timers need eager decode" in llm.describe()
    out = llm.generate_static(PROMPTS, SamplingParams(max_tokens=4, ignore_eos=True))
    # The spin lets the host enqueue each step ahead of the GPU, so the steps count as GPU time (covered);
    # a step that the host could not get ahead of would land in breakdown_uncovered instead.
    assert out.breakdown.steps + out.breakdown_uncovered.steps == 3
    assert out.breakdown.steps >= 1 and out.breakdown.ms["gemm"] > 0


def test_whole_step_graph_sampling_and_stops_bf16(hf_checkpoint):
    """The captured whole-model step (pp = 1) with in-graph sampling on the sampler's generator: seeded
    (two engines agree), it samples (not one repeated draw), and stop tokens end the batch as eagerly."""
    dev = torch.device("cuda", 0)
    params = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=24, ignore_eos=True)
    runs = [
        LLM(hf_checkpoint[0], engine_config(dtype=torch.bfloat16, seed=3), device=dev).generate_static(PROMPTS, params)
        for _ in range(2)
    ]
    assert runs[0].token_ids == runs[1].token_ids
    assert len({t for row in runs[0].token_ids for t in row}) > 3
    greedy = SamplingParams(max_tokens=24, ignore_eos=True)
    for interval in (1, 16):
        outs = []
        for graphs in (True, False):
            llm = LLM(
                hf_checkpoint[0],
                engine_config(dtype=torch.bfloat16, cuda_graphs=graphs, eos_check_interval=interval),
                device=dev,
            )
            ref = llm.generate_static(PROMPTS, greedy).token_ids
            stop = (ref[0][len(ref[0]) // 2],)
            outs.append(llm.executor.generate(PROMPTS, SamplingParams(max_tokens=24), 1, stop))
        assert outs[0].token_ids == outs[1].token_ids and outs[0].decode_steps == outs[1].decode_steps


@pytest.mark.parametrize("scope", ["layer", "forward"])
def test_compiled_decode_in_cuda_graph_matches_transformers_fp32(hf_checkpoint, hf_reference, scope):
    """compile_decode (inductor) inside our own CUDA graph: compiled in the warm-up, captured, replayed."""
    llm = LLM(hf_checkpoint[0], engine_config(compile_decode=True, compile_scope=scope), device=torch.device("cuda", 0))
    assert llm.cuda_graphs and llm.runner.compiled_decode
    res = generate(llm, PROMPTS, NEW_TOKENS)
    assert res["tokens"] == hf_reference[0]
    again = generate(llm, PROMPTS, NEW_TOKENS, micro_batches=3)
    assert again["tokens"] == hf_reference[0]
    assert llm.runner.captured_buckets == [(1, 0), (1, 1), (1, 2), (3, 0)]


@pytest.mark.parametrize("compiled", [False, True])
def test_skinny_decode_gemm_matches_transformers_fp32(hf_checkpoint, hf_reference, monkeypatch, compiled):
    """decode_gemm="skinny": every decode GEMM (<= 16 rows) runs spanllm's Triton kernel, in graphs and
    under torch.compile, and the tokens and logits still match transformers."""
    pytest.importorskip("triton")
    from spanllm.kernels import skinny_gemm

    calls = []
    real = skinny_gemm.skinny_linear
    monkeypatch.setattr(
        skinny_gemm, "skinny_linear", lambda x, w, config=None: calls.append(tuple(x.shape)) or real(x, w, config)
    )
    llm = LLM(
        hf_checkpoint[0], engine_config(decode_gemm="skinny", compile_decode=compiled), device=torch.device("cuda", 0)
    )
    assert "decode GEMMs skinny" in llm.describe()
    res = generate(llm, PROMPTS, NEW_TOKENS)
    assert calls and all(len(s) >= 2 and s[-1] > 0 for s in calls)
    assert res["tokens"] == hf_reference[0]
    for i in range(len(PROMPTS)):
        torch.testing.assert_close(res["logits"][:, i], hf_reference[1][i], atol=5e-3, rtol=0)
