"""The custom op: eager, through torch.compile's tracing (fake implementation), unknown handles."""

import pytest
import torch

from spanllm.launch import launch


def _op_worker(ctx):
    from spanllm.comm import create, op
    from spanllm.comm.conformance import expected, pattern

    comm = create("ref_hier")
    handle = op.register(comm)
    x = pattern(37, ctx.rank, torch.float32, "cpu")
    torch.ops.spanllm.all_reduce_(x, handle)
    eager_ok = torch.equal(x, expected(37, ctx.world_size, torch.float32, "cpu"))

    def f(y):
        y = y * 2
        torch.ops.spanllm.all_reduce_(y, handle)
        return y + 1

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    y = pattern(11, ctx.rank, torch.float32, "cpu")
    out = compiled(y)
    compiled_ok = torch.equal(out, expected(11, ctx.world_size, torch.float32, "cpu") * 2 + 1)
    op.unregister(handle)
    comm.close()
    return eager_ok, compiled_ok


def test_custom_op_eager_and_compiled():
    results = launch(_op_worker, nprocs=2)
    assert results == [(True, True), (True, True)]


def test_unknown_handle_names_the_fix():
    import spanllm.comm.op  # noqa: F401  (registers the op)

    with pytest.raises(KeyError, match="register"):
        torch.ops.spanllm.all_reduce_(torch.zeros(2), "nvrar@dead")
