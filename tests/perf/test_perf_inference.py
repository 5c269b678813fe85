import pytest

from spanllm.model.config import ModelConfigError
from spanllm.perf.allreduce_model import allreduce_time_us
from spanllm.perf.hardware import PRESETS
from spanllm.perf.inference import (
    KERNELS_PER_LAYER,
    P2P_OVERHEAD_US,
    InferenceModelError,
    Layout,
    Workload,
    decode_attention_us,
    decode_positions,
    estimate,
    fill_ms,
    gemm_time_us,
    kv_heads_per_gpu,
    layer_gemm_us,
    memory_per_gpu,
    prefill_attention_us,
    stage_boundaries_over_network,
    tp_group_shape,
)
from spanllm.perf.model_shape import MODELS, embedding_params, get_model, kv_bytes_per_token_layer, layer_params, params


def test_model_shapes():
    m8, m70, m405 = MODELS["llama3.1-8b"], MODELS["llama3.1-70b"], MODELS["llama3.1-405b"]
    assert params(m8) == pytest.approx(8.03e9, rel=0.01)
    assert params(m70) == pytest.approx(70.6e9, rel=0.01)
    assert params(m405) == pytest.approx(405.9e9, rel=0.01)
    # the engine's own count (norms included) agrees to the norms' few hidden-sized vectors
    assert m8.num_params() - params(m8) == (2 * m8.num_layers + 1) * m8.hidden_size
    assert m405.head_dim == 128 and kv_bytes_per_token_layer(m405, 8) == 2 * 8 * 128 * 2
    assert get_model("meta-llama/Llama-3.1-70B-Instruct") is m70 and get_model("405b") is m405
    assert m405.with_layers(8).num_layers == 8 and "8 of 126" in m405.with_layers(8).label
    with pytest.raises(ModelConfigError, match="unknown model 'llama-7b'"):
        get_model("llama-7b")


def test_gemm_roofline_hand_computed(round_cluster):
    c = round_cluster  # 100 TFLOP/s, 1000 GB/s, efficiencies 1
    assert gemm_time_us(1e8, 1e3, c) == pytest.approx(1.0)  # compute-bound: 1e8 / 1e8 per us
    assert gemm_time_us(1e3, 1e6, c) == pytest.approx(1.0)  # memory-bound: 1e6 B / 1e6 B per us
    m = MODELS["llama3.1-8b"]
    # decode, 1 token, tp 1: reading the layer's weights dominates
    assert layer_gemm_us(m, 1, 1, c) == pytest.approx(layer_params(m) * 2 / 1e6, rel=0.01)
    # a long prefill is compute-bound: 2 x tokens x params FLOPs
    assert layer_gemm_us(m, 8192, 1, c) == pytest.approx(2 * 8192 * layer_params(m) / 1e8)


def test_attention_hand_computed(round_cluster):
    m = MODELS["llama3.1-70b"]
    # 8 KV heads over tp 4 -> 2 per GPU; 4 seqs x 1000 tokens x K,V x 2 heads x 128 x 2 B / 1e6 B/us
    assert decode_attention_us(m, 4, 1000, 4, round_cluster) == pytest.approx(4 * 1000 * 2 * 2 * 128 * 2 / 1e6)
    assert kv_heads_per_gpu(m, 16) == 1  # replicated past kv_heads
    # prefill: 2 x batch x T^2 x hidden / tp FLOPs at 1e8 FLOP/us
    assert prefill_attention_us(m, 2, 1024, 8, round_cluster) == pytest.approx(2 * 2 * 1024**2 * 8192 / 8 / 1e8)


def test_decode_step_tp_hand_computed(round_cluster):
    """TP4 on one node, pp 1: TPOT = layers x (gemm + attention + 2 all-reduces + graph launches) + LM head."""
    c, m = round_cluster, MODELS["llama3.1-8b"]
    w = Workload(batch=2, prompt_len=100, decode_len=21)
    e = estimate(m, c, Layout(4), w, "nvrar")
    ctx = 100 + 21 / 2
    layer = (
        layer_gemm_us(m, 2, 4, c)
        + decode_attention_us(m, 2, ctx, 4, c)
        + 2 * allreduce_time_us("nvrar", 2 * 4096 * 2, c, 1, 4)
        + KERNELS_PER_LAYER * 0.5
    )
    lm = max(2 * 2 * embedding_params(m) / 4 / 1e8, embedding_params(m) / 4 * 2 / 1e6)
    assert e.tpot_ms == pytest.approx((32 * layer + lm) / 1e3)
    assert e.e2e_ms == pytest.approx(e.ttft_ms + 20 * e.tpot_ms)
    assert e.throughput_tok_s == pytest.approx(2 * 21 / (e.e2e_ms / 1e3))
    assert sum(e.decode_ms.values()) == pytest.approx(e.tpot_ms)
    assert sum(e.prefill_ms.values()) == pytest.approx(e.ttft_ms)


def test_pipeline_formulas():
    c, m = PRESETS["perlmutter"], MODELS["llama3.1-70b"]
    w = Workload(batch=8, prompt_len=512, decode_len=64)
    one = estimate(m, c, Layout(4, 2, 1), w)
    mb = estimate(m, c, Layout(4, 2, 2), w)
    # one micro-batch: a decode step walks both stages; half the time each stage waits
    assert one.decode_idle_fraction == pytest.approx(0.5, abs=0.05)
    assert one.decode_ms["pp_transfer"] > 0
    # micro-batches fill the bubble of prefill (TTFT drops) and of decode
    assert mb.ttft_ms < one.ttft_ms and mb.decode_idle_fraction < one.decode_idle_fraction
    assert stage_boundaries_over_network(Layout(4, 2), c) == 1
    assert stage_boundaries_over_network(Layout(2, 2), c) == 0  # both stages on one node
    assert stage_boundaries_over_network(Layout(1, 8), c) == 1  # 8 stages over 2 nodes: one crosses
    assert tp_group_shape(Layout(8), c) == (2, 4) and tp_group_shape(Layout(2), c) == (1, 2)
    with pytest.raises(InferenceModelError, match="batch=8 is not divisible by micro_batches=3"):
        estimate(m, c, Layout(4, 2, 3), w)
    with pytest.raises(InferenceModelError, match="tp=6 spans nodes but is not a multiple of 4"):
        tp_group_shape(Layout(6), c)


def test_memory_check():
    c, m = PRESETS["perlmutter"], MODELS["llama3.1-405b"]
    w = Workload(16, 2048, 256)
    assert not memory_per_gpu(m, Layout(4, 4), w, c).fits  # 16 x 40 GB < 810 GB of weights
    mem = memory_per_gpu(m, Layout(32), w, c)
    assert mem.fits and mem.weights_GB == pytest.approx(params(m) * 2 / 32 / 1e9)
    # KV: 16 seqs x 2304 tokens x 126 layers x (K,V x 1 replicated head x 128 x 2 B)
    assert mem.kv_cache_GB == pytest.approx(16 * 2304 * 126 * 2 * 1 * 128 * 2 / 1e9)


def test_decode_memory_bound_scales_with_tp_and_prefill_with_flops():
    c, m = PRESETS["dgx-h100"], MODELS["llama3.1-70b"]
    w = Workload(1, 1024, 16)
    t = [estimate(m, c, Layout(tp), w, "nccl").decode_ms["gemm"] for tp in (1, 2, 4, 8)]
    assert all(b < a for a, b in zip(t, t[1:]))
    assert t[0] / t[-1] == pytest.approx(8, rel=0.15)
    big = estimate(m, c, Layout(8), Workload(8, 4096, 16), "nccl")
    assert big.prefill_ms["gemm"] == pytest.approx(
        2 * 8 * 4096 * layer_params(m) / 8 * 80 / (c.bf16_TFLOPs * 1e6 * c.gemm_efficiency) / 1e3, rel=0.02
    )


# --- the engine's own costs (hardware.EngineCost), hand-computed on the round cluster -------------------

ENGINE = {
    "decode_layer_us": 20.0,
    "attn_position_ns": 10.0,
    "attends_max_seq_len": True,
    "eager_layer_host_us": 10000.0,
    "prefill_efficiency": 0.5,
}


def test_decode_attention_adds_a_serial_cost_per_position(make_cluster):
    c = make_cluster(engine={"attn_position_ns": 10.0})
    m = MODELS["llama3.1-70b"]
    # KV: 4 seqs x 1000 positions x (K,V x 2 heads x 128 x 2 B) / 1e6 B/us = 4.096 us; + 1000 x 10 ns = 10 us
    assert decode_attention_us(m, 4, 1000, 4, c) == pytest.approx(4.096 + 10.0)


def test_decode_positions_mean_context_or_whole_cache(make_cluster):
    w = Workload(batch=2, prompt_len=100, decode_len=21)
    assert decode_positions(w, make_cluster()) == 110.5
    assert decode_positions(w, make_cluster(engine={"attends_max_seq_len": True})) == 121.0


def test_decode_step_with_engine_costs_hand_computed(make_cluster):
    """TPOT = layers x (gemm + attention over 121 positions + 2 all-reduces + 12 graph nodes + 20 us) + LM head."""
    c, m = make_cluster(engine=ENGINE), MODELS["llama3.1-8b"]
    e = estimate(m, c, Layout(4), Workload(batch=2, prompt_len=100, decode_len=21), "nccl")
    kv = 2 * 121 * (2 * 2 * 128 * 2) / 1e6  # 8 KV heads / tp 4 = 2 per GPU
    layer = (
        layer_gemm_us(m, 2, 4, c)
        + kv
        + 121 * 0.010
        + 2 * allreduce_time_us("nccl", 2 * 4096 * 2, c, 1, 4)
        + KERNELS_PER_LAYER * 0.5
        + 20.0
    )
    lm = embedding_params(m) / 4 * 2 / 1e6
    assert e.tpot_ms == pytest.approx((32 * layer + lm) / 1e3)
    assert e.decode_ms["fixed"] == pytest.approx(32 * (6.0 + 20.0) / 1e3)


def test_prefill_efficiency_scales_the_compute_bound_gemms(make_cluster):
    assert gemm_time_us(1e8, 1e3, make_cluster(), 0.5) == pytest.approx(2.0)  # 1e8 FLOP at 0.5 x 1e8 per us
    c, m = make_cluster(engine={"prefill_efficiency": 0.5}), MODELS["llama3.1-8b"]
    e = estimate(m, c, Layout(1), Workload(batch=4, prompt_len=2048, decode_len=2), "nccl")
    # 8192 rows: compute-bound; 2 x rows x layer params / (1e8 x 0.5) FLOP per us, 32 layers
    assert e.prefill_ms["gemm"] == pytest.approx(32 * 2 * 8192 * layer_params(m) / 0.5e8 / 1e3)


def test_fill_hand_computed():
    # one stage: GPU 10 + LM head 1, or the host's 30 when it is slower
    assert fill_ms(10.0, 1.0, 0.0, [], 1) == 11.0 and fill_ms(10.0, 1.0, 30.0, [], 1) == 30.0
    # two stages, host-bound: stage 0 done at 30 (its host); stage 1's host is done by then too, its GPU
    # runs once the input arrives: 30 + 2 (transfer) + 11
    assert fill_ms(10.0, 1.0, 30.0, [2.0], 1) == 43.0
    # no host limit: the GPipe fill, pp x stage + head + transfers + (m - 1) x slowest = 30 + 2 + 2 + 3 x 12
    assert fill_ms(10.0, 2.0, 0.0, [1.0, 1.0], 4) == 70.0
    # two micro-batches, host 30 each: stage 0 at 30, 60; stage 1 at max(30 + 10, 30) = 40, max(60 + 10, 60) = 70
    assert fill_ms(10.0, 0.0, 30.0, [0.0], 2) == 70.0


def test_host_bound_prefill_hand_computed(make_cluster):
    """A short prompt on one GPU: 32 layers x 10 ms of host time hide every GPU cost."""
    c, m = make_cluster(engine=ENGINE), MODELS["llama3.1-8b"]
    e = estimate(m, c, Layout(1), Workload(batch=1, prompt_len=16, decode_len=2), "nccl")
    assert e.ttft_ms == pytest.approx(320.0)
    assert sum(e.prefill_ms.values()) == pytest.approx(320.0) and 0 < e.prefill_ms["host"] < 320.0


def test_pipeline_decode_returns_the_sampled_tokens(round_cluster):
    """PP2 on one node (4 GPUs): one hop of hidden states forward and one of int64 token ids back."""
    c, m = round_cluster, MODELS["llama3.1-8b"]
    e = estimate(m, c, Layout(1, 2), Workload(batch=2, prompt_len=100, decode_len=4), "nccl")
    forward = P2P_OVERHEAD_US + 1.0 + 2 * 4096 * 2 / 100e3  # overhead + NVLink latency + bytes at 100 GB/s
    back = P2P_OVERHEAD_US + 1.0 + 2 * 8 / 100e3
    assert e.decode_ms["pp_transfer"] == pytest.approx((forward + back) / 1e3)
