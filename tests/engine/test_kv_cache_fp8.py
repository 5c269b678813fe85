"""--kv-cache-dtype fp8 (EngineConfig.kv_cache_dtype): K and V stored as float8_e4m3fn (e4m3 values, scale 1,
saturating), widened to the model dtype by every reader. CPU: the writes are torch's cast byte for byte, the pool
holds twice the tokens in the same memory, the serving engine with an FP8 cache gives the same greedy tokens with
prefix caching on and off in every scenario (chunked prefill, tiny chunks, preemption, aborts), block accounting
exact; and those tokens, at TP = 1 and 2, are transformers' own greedy tokens when its KV cache rounds every key
and value to e4m3 the same way (an independent implementation of what the FP8 cache computes). Its quality on the
real model: tests/model/test_fp8_quality.py. The Triton kernels on an FP8 cache:
tests/engine/test_paged_kernels_interpreter.py and test_shared_prefix.py; the cache writes of the fused RoPE kernel
on a GPU: tests/engine/test_gpu_paged.py."""

from __future__ import annotations

import pytest
import torch
from prefix_cache_workers import PREFIX_MAX_TOKENS, PREFIX_PROMPTS, SCENARIOS, prefix_scenario, tp_fp8_kv_scenario
from serving_workers import hf_greedy, serving_config
from test_prefix_cache_engine import SCENARIO_HITS, SCENARIO_QUERIES

from spanllm.attention.backend import write_kv
from spanllm.attention.reference import reference_decode
from spanllm.engine.config import EngineConfig
from spanllm.engine.llm import LLM
from spanllm.engine.worker.kv_cache import bytes_per_block
from spanllm.kernels import paged_attention as pa

FP8 = torch.float8_e4m3fn


def test_write_kv_saturates_then_casts_and_readers_widen_it():
    k_cache = torch.zeros(3, 4, 2, 8, dtype=FP8)
    v_cache = torch.zeros_like(k_cache)
    g = torch.Generator().manual_seed(0)
    k = torch.randn(5, 2, 8, generator=g) * 100  # some past 448: saturated, not NaN
    v = torch.randn(5, 2, 8, generator=g)
    k[0, 0, 0], k[1, 1, 1] = 1000.0, -5000.0
    slots = torch.tensor([4, 5, 6, 7, 9])  # block 1 whole, then block 2's second slot
    write_kv(k_cache, v_cache, k, v, slots)
    flat_k, flat_v = k_cache.view(12, 2, 8), v_cache.view(12, 2, 8)
    # the cache's contract: saturate at +-448, then torch's cast (nearest even). Clamped first here too: torch's own
    # cast of 1000.0 saturates in torch 2.13 but gives NaN in 2.11 (the GPU machine's; seen there)
    assert torch.equal(flat_k[slots].view(torch.uint8), k.clamp(-448.0, 448.0).to(FP8).view(torch.uint8))
    assert torch.equal(flat_v[slots].view(torch.uint8), v.clamp(-448.0, 448.0).to(FP8).view(torch.uint8))
    assert flat_k[4, 0, 0].item() == 448.0 and flat_k[5, 1, 1].item() == -448.0
    assert flat_k[0].float().abs().sum() == 0  # other slots untouched
    # a decode reading them: the reference widens to the query's dtype, as the kernels do
    q = torch.randn(1, 4, 8, generator=g)
    tables = torch.tensor([[1, 2]], dtype=torch.int32)
    got = reference_decode(q, k_cache, v_cache, tables, [6])
    want = reference_decode(q, k_cache.float(), v_cache.float(), tables, [6])
    assert torch.equal(got, want)


def test_an_fp8_pool_holds_twice_the_tokens(monkeypatch):
    assert bytes_per_block(32, 16, 8, 128, FP8) * 2 == bytes_per_block(32, 16, 8, 128, torch.bfloat16)
    assert EngineConfig(kv_cache_dtype="fp8").kv_dtype == FP8
    assert EngineConfig(dtype=torch.float16).kv_dtype == torch.float16
    assert EngineConfig(kv_cache_dtype="fp8_e4m3").kv_dtype == FP8  # vLLM's other name for it
    with pytest.raises(ValueError, match=r"kv_cache_dtype='fp8_e5m2' must be one of \('auto', 'fp8', 'fp8_e4m3'\)"):
        EngineConfig(kv_cache_dtype="fp8_e5m2")
    sizes = {}
    for kv in ("auto", "fp8"):
        engine = EngineConfig(dtype=torch.bfloat16, kv_cache_dtype=kv, cpu_kv_cache_bytes=64 << 20, max_num_seqs=2)
        llm = LLM("tiny", engine, device=torch.device("cpu"))
        try:
            runner = llm.worker
            sizes[kv] = llm.kv_sizing.num_blocks
            layer = runner.cache.layer(0)
            assert layer[0].dtype == layer[1].dtype == (FP8 if kv == "fp8" else torch.bfloat16)
            assert f"KV cache: {sizes[kv] - 1} blocks" in llm.describe()
            assert ("torch.float8_e4m3fn, " in llm.describe()) == (kv == "fp8")
            assert "decode attention:" not in llm.describe()  # the reference backend gathers and widens in torch
            if kv == "fp8":  # the Triton backend's decode kernel names what it widens the cache to
                monkeypatch.setattr(runner.backend, "name", "triton")
                assert ", decode attention: keys and values widened to fp16" in llm.describe()
                monkeypatch.setattr(pa, "FP8_DECODE_WIDEN", "bf16")
                assert ", decode attention: keys and values widened to bf16" in llm.describe()
        finally:
            llm.close()
    assert sizes["fp8"] == 2 * sizes["auto"]


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_fp8_cache_caching_on_equals_off(hf_checkpoint, name):
    kw, aborts = SCENARIOS[name]
    runs = {}
    for on in (True, False):
        llm = LLM(hf_checkpoint[0], serving_config(**kw, enable_prefix_caching=on, kv_cache_dtype="fp8"))
        assert llm.worker.cache.layer(0)[0].dtype == FP8
        runs[on] = prefix_scenario(llm, aborts)
        assert runs[on]["free_blocks"] == runs[on]["usable_blocks"]
    for i in range(len(PREFIX_PROMPTS)):
        a, b = runs[True]["results"][i], runs[False]["results"][i]
        assert a["tokens"] == b["tokens"] and a["finish_reason"] == b["finish_reason"], f"request {i}"
    assert runs[False]["hits"] == 0 and runs[True]["hits"] == SCENARIO_HITS  # 48: as with a float32 cache
    assert runs[True]["queries"] == runs[False]["queries"] == SCENARIO_QUERIES
    if name == "preempt":
        assert runs[True]["preemptions"] > 0 and runs[False]["preemptions"] > 0


@pytest.fixture(scope="module")
def hf_fp8_kv_reference(hf_checkpoint):
    """transformers' greedy tokens with every key and value it caches rounded to e4m3 (saturated), as the engine's
    FP8 cache stores them; and how many cached elements the rounding changed (so the check cannot be vacuous)."""
    from transformers.cache_utils import DynamicLayer

    real, changed = DynamicLayer.update, []

    def update(self, key_states, value_states, *args, **kwargs):
        rounded = [x.clamp(-448, 448).to(FP8).to(x.dtype) for x in (key_states, value_states)]
        changed.append(sum(int((r != x).sum()) for r, x in zip(rounded, (key_states, value_states))))
        return real(self, *rounded, *args, **kwargs)

    DynamicLayer.update = update
    try:
        tokens = hf_greedy(hf_checkpoint[2], PREFIX_PROMPTS, PREFIX_MAX_TOKENS)
    finally:
        DynamicLayer.update = real
    exact = hf_greedy(hf_checkpoint[2], PREFIX_PROMPTS, PREFIX_MAX_TOKENS)  # its cache in float32
    return tokens, sum(changed), sum(a != b for x, y in zip(tokens, exact) for a, b in zip(x, y))


def test_fp8_cache_equals_transformers_with_e4m3_rounded_kv(hf_checkpoint, hf_fp8_kv_reference):
    want, changed, differ = hf_fp8_kv_reference
    # the rounding moved most cached values, and enough of them to change tokens (16 of 59 with this model): the
    # comparison tells an FP8 cache from a float32 one
    assert changed > 1000 and differ > 0
    llm = LLM(hf_checkpoint[0], serving_config(kv_cache_dtype="fp8"))
    res = prefix_scenario(llm, {})
    for i, ref in enumerate(want):
        assert res["results"][i]["tokens"] == ref, f"request {i}"
    assert res["free_blocks"] == res["usable_blocks"]


def test_tp2_fp8_cache_equals_transformers_with_e4m3_rounded_kv(hf_checkpoint, hf_fp8_kv_reference):
    from spanllm.launch import launch

    want, _, _ = hf_fp8_kv_reference
    res = launch(tp_fp8_kv_scenario, hf_checkpoint[0], nprocs=2)[0]
    for i, ref in enumerate(want):
        assert res["results"][i]["tokens"] == ref, f"request {i}"
    assert res["free_blocks"] == res["usable_blocks"]
    assert res["hits"] == SCENARIO_HITS and res["queries"] == SCENARIO_QUERIES


def test_bench_attention_inputs_in_an_fp8_cache():
    """`bench attention --kv-cache-dtype fp8` (a GPU command) times the kernel on an FP8 pool: its inputs."""
    from spanllm.commands.bench_attention import random_decode_inputs

    cpu = torch.device("cpu")
    q, kc, vc, tables, ctx = random_decode_inputs(2, 40, 8, 2, 16, 16, torch.bfloat16, cpu, FP8)
    q2, kc2, vc2, tables2, _ = random_decode_inputs(2, 40, 8, 2, 16, 16, torch.bfloat16, cpu)
    assert q.dtype == torch.bfloat16 and kc.dtype == vc.dtype == FP8 and kc2.dtype == torch.bfloat16
    assert torch.equal(kc.view(torch.uint8), kc2.to(FP8).view(torch.uint8)) and torch.equal(tables, tables2)
    assert torch.equal(q, q2) and ctx.tolist() == [40, 40]
