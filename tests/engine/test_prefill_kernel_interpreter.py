"""The paged prefill attention kernel (spanllm.kernels.paged_attention.prefill) for long prefixes, on CPU tensors
under Triton's interpreter, against the gather + SDPA reference: prefixes of a few thousand keys, odd lengths,
chunks that start mid-block, several sequences per launch, GQA groups 1 / 4 / 8, every PrefillConfig option, and
block tables whose unused entries point at a block of NaNs (a kernel that reads a hole or a key past the context
returns NaN). The tiling itself (PrefillConfig, its defaults, the heaviest-first tile order) is pure and tested
in the parent process; the kernel cases run in a child pytest with TRITON_INTERPRET=1 (test_interpreter_suite).
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from paged_pools import poisoned_paged_pool
from triton_interpreter import interpreted_module, run_child_suite, widen_bf16_dot

from spanllm.kernels.prefill_config import PrefillConfig, load_prefill_config, prefill_block_q, prefill_config

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@pytest.fixture
def kernels(monkeypatch):
    mod = interpreted_module(monkeypatch, "spanllm.kernels.paged_attention")
    widen_bf16_dot(monkeypatch)
    return mod


def _run(kernels, q_lens, ctx, hq, hkv, d, dtype, config, seed=0, spikes=False):
    from spanllm.attention import reference as pa

    kc, vc, tables = poisoned_paged_pool(ctx, 16, hkv, d, seed, spikes)
    q = torch.randn(sum(q_lens), hq, d, generator=torch.Generator().manual_seed(seed + 1))
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    bq = None if config is None else config.block_q
    tiles = torch.tensor(
        kernels.prefill_tiles(q_lens, hq // hkv, context_lens=ctx, block_q=bq), dtype=torch.int32
    ).reshape(-1, 2)
    cl = torch.tensor(ctx, dtype=torch.int32)
    out = kernels.prefill(q.to(dtype), kc.to(dtype), vc.to(dtype), tables, cu, cl, tiles, config=config)
    ref = pa.reference_prefill(q.to(dtype).float(), kc.to(dtype).float(), vc.to(dtype).float(), tables, q_lens, ctx)
    return out.float(), ref


SMALL = PrefillConfig(block_q=4, block_n=32, num_warps=4, num_stages=2)
CONFIGS = {
    "default": None,
    "small": SMALL,
    "small_lazy": PrefillConfig(block_q=4, block_n=16, num_warps=4, num_stages=2, lazy_rescale=True),
    "wide_lazy": PrefillConfig(block_q=16, block_n=64, num_warps=8, num_stages=3, lazy_rescale=True),
}
# A chunk after a long prefix that ends mid-block; one query after a prefix; a whole odd-length prompt; a chunk
# starting mid-block after a short prefix; a chunk of exactly one block after a block-aligned prefix.
Q_LENS = [37, 1, 45, 19, 16]
CTX = [2011 + 37, 64 + 1, 45, 131 + 19, 160 + 16]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_long_prefix_several_sequences_fp32(kernels, name):
    out, ref = _run(kernels, Q_LENS, CTX, 8, 2, 16, torch.float32, CONFIGS[name], seed=3, spikes=True)
    assert not out.isnan().any()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("hq,hkv,config", [(8, 8, None), (8, 8, CONFIGS["wide_lazy"]), (8, 1, None), (16, 1, SMALL)])
def test_gqa_groups(kernels, hq, hkv, config):
    out, ref = _run(kernels, [23, 70], [23 + 300, 70], hq, hkv, 16, torch.float32, config, seed=5)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("lazy", [False, True])
def test_16_bit_caches(kernels, dtype, lazy):
    cfg = PrefillConfig(block_q=8, block_n=32, num_warps=4, num_stages=2, lazy_rescale=lazy)
    out, ref = _run(kernels, [29, 40], [29 + 700, 40 + 9], 8, 2, 32, dtype, cfg, seed=9, spikes=True)
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)  # one 16-bit rounding of p and of the output


def test_a_tile_order_does_not_change_the_result(kernels):
    """Programs are independent: the heaviest-first order and the plain order give the same output bit for bit."""
    from spanllm.attention import reference as pa

    q_lens, ctx = [30, 9], [30 + 300, 9 + 17]
    kc, vc, tables = poisoned_paged_pool(ctx, 16, 2, 16, seed=4)
    q = torch.randn(sum(q_lens), 8, 16, generator=torch.Generator().manual_seed(8))
    cu = torch.tensor([0, 30, 39], dtype=torch.int32)
    cl = torch.tensor(ctx, dtype=torch.int32)
    heavy = kernels.prefill_tiles(q_lens, 4, context_lens=ctx, block_q=4)
    plain = [(j, s) for j, t in enumerate(q_lens) for s in range(0, t, 4)]
    assert sorted(heavy) == sorted(plain) and heavy != plain
    outs = [
        kernels.prefill(q, kc, vc, tables, cu, cl, torch.tensor(t, dtype=torch.int32), config=SMALL)
        for t in (heavy, plain)
    ]
    assert torch.equal(outs[0], outs[1])
    torch.testing.assert_close(outs[0], pa.reference_prefill(q, kc, vc, tables, q_lens, ctx), rtol=1e-5, atol=1e-5)


INTERPRETER_TESTS = len(CONFIGS) + 4 + 2 * 2 + 1


def test_interpreter_suite():
    """This file's kernel cases again in a child pytest with TRITON_INTERPRET=1: every one must pass there."""
    if INTERPRETED:
        pytest.skip("this is the child")
    pytest.importorskip("triton")
    run_child_suite(__file__, INTERPRETER_TESTS, "not interpreter_suite and not pure")


# --- pure: the tiling and its plumbing (no kernel) ----------------------------------------------------------


def test_pure_tiles_are_heaviest_first_and_cover_every_query():
    pa = pytest.importorskip("spanllm.kernels.paged_attention")
    q_lens, ctx = [70, 5, 40], [70, 5 + 1000, 40 + 10]
    tiles = pa.prefill_tiles(q_lens, 4, first_chunk=2, context_lens=ctx, block_q=16)
    assert sorted(tiles) == sorted((2 + j, s) for j, t in enumerate(q_lens) for s in range(0, t, 16))
    keys = [ctx[c - 2] - q_lens[c - 2] + min(s + 16, q_lens[c - 2]) for c, s in tiles]
    assert keys == sorted(keys, reverse=True)
    assert tiles[0] == (3, 0)  # the 5 queries after a 1000-token prefix see the most keys
    # without context lengths: chunks without a prefix, the last tile of the longest chunk first
    assert pa.prefill_tiles([70, 5], 4, block_q=16)[0] == (0, 64)


def test_pure_default_config_and_validation():
    for g in (1, 2, 4, 8, 16):
        for dt in (torch.bfloat16, torch.float16, torch.float32):
            c = prefill_config(g, dt)
            assert c.rows(g) == 128 and c.block_q == prefill_block_q(g)
            c.check_group(g)
    assert prefill_config(4, torch.bfloat16).block_q == 32
    with pytest.raises(ValueError, match="block_q=3"):
        PrefillConfig(block_q=3, block_n=64, num_warps=8, num_stages=3)
    with pytest.raises(ValueError, match="block_n=8"):
        PrefillConfig(block_q=4, block_n=8, num_warps=8, num_stages=3)
    with pytest.raises(ValueError, match="num_warps"):
        PrefillConfig(block_q=4, block_n=64, num_warps=3, num_stages=3)
    with pytest.raises(ValueError, match="8 rows"):
        PrefillConfig(block_q=2, block_n=64, num_warps=4, num_stages=3).check_group(4)
    with pytest.raises(ValueError, match="unknown PrefillConfig fields"):
        PrefillConfig.from_dict({"block_q": 4, "block_n": 64, "num_warps": 4, "num_stages": 3, "tma": True})


def test_pure_load_prefill_config_roundtrip(tmp_path):
    c = PrefillConfig(block_q=16, block_n=128, num_warps=8, num_stages=4, lazy_rescale=True)
    (tmp_path / "flat.json").write_text(json.dumps(c.to_dict()))
    (tmp_path / "best.json").write_text(json.dumps({"config": c.to_dict(), "tflops": 1.0}))
    assert load_prefill_config(str(tmp_path / "flat.json")) == c
    assert load_prefill_config(str(tmp_path / "best.json")) == c
    assert c.label() == "q16xn128 w8 s4 lazy"


def test_pure_engine_config_carries_the_tiling_to_the_triton_backend_only():
    from spanllm.attention.backend import resolve_backend
    from spanllm.engine.config import EngineConfig

    c = PrefillConfig(block_q=16, block_n=64, num_warps=8, num_stages=3)
    assert EngineConfig(prefill_tiling=c).prefill_tiling == c
    with pytest.raises(ValueError, match="must be a PrefillConfig"):
        EngineConfig(prefill_tiling={"block_q": 16})
    with pytest.raises(ValueError, match="leave prefill_tiling unset"):
        resolve_backend("torch", 8, 2, 16, torch.device("cpu"), c)
    assert resolve_backend("torch", 8, 2, 16, torch.device("cpu")).describe(torch.float32) == "torch"


def test_pure_triton_backend_tiles_with_its_config():
    pytest.importorskip("triton")
    from spanllm.attention.triton import TritonBackend

    c = PrefillConfig(block_q=8, block_n=64, num_warps=4, num_stages=2)
    b = TritonBackend(8, 2, 16, torch.device("cpu"), c)
    tiles = b.tiles([20, 3], [20, 103])
    assert tiles.tolist()[0] == [1, 0] and sorted(map(tuple, tiles.tolist())) == [(0, 0), (0, 8), (0, 16), (1, 0)]
    assert "q8xn64 w4 s2, set by prefill_tiling" in b.describe(torch.bfloat16)
    assert "the default" in TritonBackend(8, 2, 16, torch.device("cpu")).describe(torch.bfloat16)
    with pytest.raises(ValueError, match="power of two"):
        TritonBackend(8, 2, 16, torch.device("cpu"), PrefillConfig(block_q=2, block_n=64, num_warps=4, num_stages=2))


def test_pure_cli_flag_loads_the_tiling(tmp_path):
    import argparse

    from spanllm.commands.engine_args import add_engine_arguments, add_model_arguments, engine_config_from_args

    c = PrefillConfig(block_q=16, block_n=128, num_warps=8, num_stages=2)
    path = tmp_path / "best_prefill_config.json"
    path.write_text(json.dumps({"config": c.to_dict(), "name": "paged q16xn128 w8 s2"}))
    ap = argparse.ArgumentParser()
    add_model_arguments(ap)
    add_engine_arguments(ap)
    args = ap.parse_args(["--model", "tiny", "--prefill-tiling", str(path)])
    assert engine_config_from_args(args, torch.device("cpu")).prefill_tiling == c
    assert engine_config_from_args(ap.parse_args(["--model", "tiny"]), torch.device("cpu")).prefill_tiling is None
