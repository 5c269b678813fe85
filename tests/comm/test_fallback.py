"""SizeFallback: the primary takes what it can, the group's collective the rest; the default-backend rule."""

import pytest
import torch

from spanllm.comm.base import Capability
from spanllm.comm.torch_dist import GlooAllReduce, default_backend
from spanllm.launch import launch


class CappedGloo(GlooAllReduce):
    """gloo with a 64-byte buffer: stands in for nvrar's limit on CPU."""

    name = "capped"
    capability = Capability(dtypes=frozenset({torch.float32}), device_types=frozenset({"cpu"}), max_bytes=64)


def _fallback_worker(ctx):
    from spanllm.comm import create
    from spanllm.comm.conformance import pattern, wrong_elements
    from spanllm.comm.fallback import SizeFallback, with_group_fallback

    plain = create("gloo")
    assert with_group_fallback(plain) is plain  # no buffer: nothing to fall back from
    comm = with_group_fallback(CappedGloo())
    assert isinstance(comm, SizeFallback) and comm.name == "capped"
    out = []
    for n in (3, 16, 17, 1000):  # 16 float32 = 64 bytes: the last size the primary takes
        x = pattern(n, ctx.rank, torch.float32, "cpu")
        ran = comm.algorithm_for(x)
        comm.all_reduce_(x)
        out.append((n, ran, int(wrong_elements(x, ctx.world_size))))
    comm.close()
    plain.close()
    return out


def test_size_fallback_sends_large_messages_to_the_group_collective():
    results = launch(_fallback_worker, nprocs=2)
    assert results[0] == results[1] == [(3, "capped", 0), (16, "capped", 0), (17, "gloo", 0), (1000, "gloo", 0)]


def test_default_backend():
    assert (default_backend("cuda"), default_backend("cpu")) == ("nccl", "gloo")
    with pytest.raises(ValueError, match="'xpu' has no default backend"):
        default_backend("xpu")
