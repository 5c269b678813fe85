from __future__ import annotations

import pytest
import torch

from spanllm.engine.fixed_batch import GenerationError, split_batch
from spanllm.layers.rope import inverse_frequencies
from spanllm.model.config import ModelConfig, RopeScaling, preset
from spanllm.model.parallel_dims import ParallelDims, ParallelLayoutError, check_tp_for_model, stage_layers


def test_llama3_inverse_frequencies_match_transformers():
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = transformers.LlamaConfig(
        hidden_size=4096,
        num_attention_heads=32,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    )
    ref, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    ours = inverse_frequencies(128, 500000.0, RopeScaling(8.0, 1.0, 4.0, 8192))
    torch.testing.assert_close(ours, ref, atol=0, rtol=0)
    # All three bands are exercised: kept, divided by 8, blended.
    plain = inverse_frequencies(128, 500000.0, None)
    ratio = plain / ours
    assert ratio[0] == 1.0 and ratio[-1] == pytest.approx(8.0) and ((ratio > 1.01) & (ratio < 7.99)).any()


def test_parallel_dims_validation():
    assert str(ParallelDims(2, 4, 8)) == "TP=2 x PP=4"
    with pytest.raises(ParallelLayoutError, match=r"tp=3 x pp=2 = 6 ranks, but the world has 8"):
        ParallelDims(3, 2, 8)
    with pytest.raises(ParallelLayoutError, match="pp=0"):
        ParallelDims(8, 0, 8)
    with pytest.raises(ParallelLayoutError, match=r"pp=5 exceeds the 4 layers of tiny"):
        ParallelDims(1, 5, 5).validate_for(preset("tiny"))
    with pytest.raises(ParallelLayoutError, match=r"tp=3 does not divide num_heads=8"):
        check_tp_for_model(3, preset("tiny"))
    cfg = ModelConfig("m", 64, 48, 96, 2, 12, 4, 4)  # 12 heads, 4 kv heads
    with pytest.raises(ParallelLayoutError, match=r"tp=6 and num_kv_heads=4"):
        check_tp_for_model(6, cfg)
    check_tp_for_model(2, cfg)  # splits KV heads
    check_tp_for_model(4, cfg)
    check_tp_for_model(16, preset("llama3.1-405b"))  # replicates the 8 KV heads twice


def test_tp_across_node_boundary_rejected():
    from spanllm.comm.topology import Topology

    with pytest.raises(ParallelLayoutError, match="tp=3 neither divides nor is a multiple of ranks_per_node=2"):
        ParallelDims(3, 2, 6).validate_for_topology(Topology(6, 2))
    assert ParallelDims(4, 2, 8).tp_topology(Topology(8, 2)) == Topology(4, 2)
    assert ParallelDims(2, 4, 8).tp_topology(Topology(8, 4)) == Topology(2, 2)


def test_stage_layers_balanced_and_complete():
    spans = [stage_layers(126, 4, s) for s in range(4)]
    assert [(r.start, r.stop) for r in spans] == [(0, 32), (32, 64), (64, 95), (95, 126)]
    assert [(r.start, r.stop) for r in (stage_layers(4, 2, 0), stage_layers(4, 2, 1))] == [(0, 2), (2, 4)]


def test_split_batch():

    assert split_batch(7, 3) == [(0, 3), (3, 2), (5, 2)]
    assert split_batch(4, 1) == [(0, 4)]
    with pytest.raises(GenerationError, match="micro_batches=5 must be between 1 and the batch size 4"):
        split_batch(4, 5)
