"""Round-13 audit of spanllm.comm: regressions for the defects found by hostile testing on CPU (gloo).

1. The reference executors raised mid-schedule on a leaf tensor that requires grad (and on an inference
   tensor outside inference mode); on 3 ranks ref_rd's fold then left the other ranks waiting (a hang).
2. Input refused on one rank only (unsupported dtype, non-contiguous) raised there and left the other
   ranks waiting in the size check: now every rank raises, the others naming the refusing rank.
3. auto returned early on an empty tensor without the size check: 0 elements on one rank and 4 on the
   other returned on one and hung the other.
4. auto's refusal told the caller to "use algorithm 'auto'".
5. Tuning tables naming an unknown algorithm, a malformed topology, an unknown dtype, a negative size
   or bad nvrar launch parameters loaded silently (the entry was then never used); a table for
   another topology (or an empty one) was silently ignored by auto; `--tuning ,` raised IndexError.
6. A rank that timed out inside the reference executor or the size check did not say in which phase.
7. (Found while fixing 2.) Keeping the refusal as an exception object formed a reference cycle that held
   the process group past destroy_process_group; gloo then aborted a rank at exit now and then.
"""

from __future__ import annotations

import functools
import gc
import json
import time
import weakref

import pytest
import torch

from spanllm.comm import AllReduceInputError, Topology, registry
from spanllm.comm.schedule import hierarchical_schedule, recursive_doubling_schedule, ring_schedule
from spanllm.comm.tuning import TuningEntry, TuningTable
from spanllm.launch import launch

WORLD = 3


def _outcome(comm, x: torch.Tensor):
    try:
        comm.all_reduce_(x)
        return ("ok", x.tolist())
    except AllReduceInputError as e:
        return ("error", str(e))


def _suite(ctx) -> dict:
    W, r = ctx.world_size, ctx.rank
    topo = Topology(W, W)
    out: dict = {}
    comms = {n: registry.create(n, topology=topo) for n in ("ref_ring", "ref_rd", "ref_hier", "gloo", "auto")}
    for name, comm in comms.items():
        # 1. a leaf that requires grad, and an inference tensor used outside inference mode
        g = torch.full((5,), float(r + 1), requires_grad=True)
        out[(name, "grad")] = _outcome(comm, g)
        with torch.inference_mode():
            inf = torch.arange(7, dtype=torch.int64) + r
        out[(name, "inference")] = _outcome(comm, inf)
        # 2. only rank 0 passes a tensor this backend refuses
        bad_dtype = torch.ones(4, dtype=torch.int8 if r == 0 else torch.float32)
        out[(name, "dtype_on_rank0")] = _outcome(comm, bad_dtype)
        nc = torch.ones(4, 4)[:, ::2] if r == 0 else torch.ones(8)
        out[(name, "noncontig_on_rank0")] = _outcome(comm, nc)
        # 3. an empty tensor on rank 0 only
        out[(name, "empty_on_rank0")] = _outcome(comm, torch.ones(0 if r == 0 else 4))
        # the communicator is still usable, with exact sums
        y = torch.arange(11, dtype=torch.int32) * (r + 1)
        out[(name, "after")] = _outcome(comm, y)
    for comm in comms.values():
        comm.close()
    # 7. a refused call leaves no reference cycle holding the communicator (and its process group)
    gc.disable()
    try:
        for name in ("gloo", "ref_rd", "auto"):
            comm = registry.create(name, topology=topo)
            alive = weakref.ref(comm)
            try:
                comm.all_reduce_(torch.zeros(2, dtype=torch.complex64))
            except AllReduceInputError:
                pass
            del comm
            out[(name, "freed_after_refusal")] = alive() is None
    finally:
        gc.enable()
    # 5. auto refuses a table without an entry for its topology
    for label, table in {
        "other_topology": TuningTable([TuningEntry("1x2", "float", 64, "gloo")]),
        "empty": TuningTable([]),
    }.items():
        try:
            registry.create("auto", topology=topo, tuning=table).close()
            out[("auto_table", label)] = "no error"
        except AllReduceInputError as e:
            out[("auto_table", label)] = str(e)
    ok = TuningTable([TuningEntry(str(topo), "float", 64, "ref_hier")])
    auto = registry.create("auto", topology=topo, tuning=ok)
    x = torch.full((3,), float(r))
    auto.all_reduce_(x)
    out[("auto_table", "ok")] = (x.tolist(), auto.last_choice.algorithm)
    auto.close()
    return out


@functools.cache
def suite() -> list[dict]:
    return launch(_suite, nprocs=WORLD, timeout_s=30)


NAMES = ["ref_ring", "ref_rd", "ref_hier", "gloo", "auto"]


@pytest.mark.parametrize("name", NAMES)
def test_requires_grad_and_inference_tensors_reduce_like_gloo(name):
    for res in suite():
        assert res[(name, "grad")] == ("ok", [6.0] * 5)
        assert res[(name, "inference")] == ("ok", [3 * i + 3 for i in range(7)])
        assert res[(name, "after")] == ("ok", [6 * i for i in range(11)])


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("case", ["dtype_on_rank0", "noncontig_on_rank0"])
def test_input_refused_on_one_rank_raises_on_every_rank(name, case):
    res = suite()
    kind, msg0 = res[0][(name, case)]
    assert kind == "error"
    assert ("dtype torch.int8" in msg0) if case == "dtype_on_rank0" else ("not contiguous" in msg0)
    for rank in (1, 2):
        kind, msg = res[rank][(name, case)]
        assert kind == "error"
        assert msg.startswith(f"{name}: rank 0 refused its tensor (rank 0: ")
        assert "every rank raises so that none waits for it" in msg


@pytest.mark.parametrize("name", NAMES)
def test_empty_tensor_on_one_rank_raises_on_every_rank(name):
    want = (
        f"{name}: ranks passed different tensors (rank 0: 0 x torch.float32, rank 1: 4 x torch.float32, "
        "rank 2: 4 x torch.float32); every rank must pass the same element count and dtype"
    )
    for res in suite():
        assert res[(name, "empty_on_rank0")] == ("error", want)


@pytest.mark.parametrize("name", ["gloo", "ref_rd", "auto"])
def test_refused_call_leaves_no_cycle_holding_the_communicator(name):
    for res in suite():
        assert res[(name, "freed_after_refusal")] is True


def test_auto_refusal_does_not_point_at_auto():
    kind, msg = suite()[0][("auto", "dtype_on_rank0")]
    assert kind == "error"
    assert msg.startswith("auto cannot reduce this tensor: dtype torch.int8 not in")
    assert "use algorithm 'auto'" not in msg and "no candidate of auto takes it" in msg


def test_auto_refuses_table_of_another_topology_or_empty():
    for res in suite():
        msg = res[("auto_table", "other_topology")]
        assert msg.startswith("auto: the tuning table has no entry for this topology 1x3 (it covers 1x2)")
        assert "spanllm tune" in msg
        assert "it has no entries" in res[("auto_table", "empty")]
        assert res[("auto_table", "ok")] == ([3.0, 3.0, 3.0], "ref_hier")


# --------------------------------------------------------------------------------------------------
# 5. tuning table validation at load time (pure)

GOOD = {"topology": "1x2", "dtype": "bfloat16", "size": 4096, "best": "nvrar"}


@pytest.mark.parametrize(
    "change, needle",
    [
        ({"best": "bogus"}, "best='bogus' is not a registered algorithm (one of ref_ring,"),
        ({"best": "auto"}, "best='auto' is not a registered algorithm"),
        ({"topology": "2-by-4"}, "topology='2-by-4' is not NODESxRANKS_PER_NODE"),
        ({"topology": "0x2"}, "topology='0x2' is not NODESxRANKS_PER_NODE"),
        ({"dtype": "int8"}, "dtype='int8' is not one of ["),
        ({"size": -1}, "size=-1 must be a byte count"),
        ({"size": "4K"}, "size='4K' must be a byte count"),
        ({"nvrar_launch": {"block": 100}}, "nvrar_launch={'block': 100} is not valid nvrar launch parameters"),
        ({"nvrar_launch": {"blocks": 4}}, "nvrar_launch={'blocks': 4} is not valid nvrar launch parameters"),
    ],
)
def test_load_refuses_unusable_entries_naming_file_entry_value_and_fix(tmp_path, change, needle):
    p = tmp_path / "t.json"
    p.write_text(json.dumps({"kind": "tuning", "entries": [GOOD, {**GOOD, **change}]}))
    with pytest.raises(ValueError) as e:
        TuningTable.load(str(p))
    msg = str(e.value)
    assert msg.startswith(f"{str(p)!r}: entry 1: ")
    assert needle in msg
    assert msg.endswith("fix that entry or regenerate the table with `spanllm tune`")


def test_load_entries_not_a_list_and_empty_path_list(tmp_path):
    p = tmp_path / "t.json"
    p.write_text(json.dumps({"kind": "tuning", "entries": {"a": 1}}))
    with pytest.raises(ValueError, match=r"'entries' is a dict, not a list of tuning entries"):
        TuningTable.load(str(p))
    with pytest.raises(ValueError, match=r"tuning table list ',' names no file"):
        TuningTable.load(",")
    p.write_text(json.dumps({"kind": "tuning", "entries": [GOOD]}))
    assert TuningTable.load(str(p)).entries == [TuningEntry("1x2", "bfloat16", 4096, "nvrar")]


# --------------------------------------------------------------------------------------------------
# 6. phases, and a rank that never calls: the others fail naming rank and phase


def test_schedule_rounds_name_their_phase():
    assert [r.phase for r in ring_schedule(0, 3, 4).rounds] == ["reduce-scatter"] * 2 + ["all-gather"] * 2
    assert [r.phase for r in recursive_doubling_schedule(0, 5, 9).rounds] == [
        "recursive doubling fold",
        "recursive doubling exchange 1 of 2",
        "recursive doubling exchange 2 of 2",
        "recursive doubling unfold",
    ]
    assert [r.phase for r in hierarchical_schedule(4, Topology(6, 2), 1).rounds] == [
        "intra-node reduce-scatter",
        "inter-node recursive doubling fold",
        "inter-node recursive doubling exchange 1 of 1",
        "inter-node recursive doubling unfold",
        "intra-node all-gather",
    ]


def _rank0_skips(ctx):
    W, r = ctx.world_size, ctx.rank
    out = {}
    comms = [
        ("ref_hier", registry.create("ref_hier", topology=Topology(W, 1), check_sizes=False)),
        ("ref_rd", registry.create("ref_rd", topology=Topology(W, W))),
    ]
    if r == 0:
        time.sleep(6)  # the others time out (2 s each) while rank 0 never calls
        return out
    for name, comm in comms:
        try:
            comm.all_reduce_(torch.ones(10))
            out[name] = "no error"
        except RuntimeError as e:
            out[name] = (type(e).__name__, str(e))
    return out


def test_rank_that_never_calls_fails_the_others_naming_rank_and_phase():
    res = launch(_rank0_skips, nprocs=WORLD, timeout_s=2)
    kind, msg = res[1]["ref_hier"]
    assert kind == "RuntimeError"  # torch's type: the launcher still tells a peer's timeout from an own error
    assert msg.startswith(
        "ref_hier: rank 1 failed in round 2 of 3 (inter-node recursive doubling exchange 1 of 1) "
        "exchanging 10 elements with ranks [0]: "
    )
    assert "every rank must make the same all-reduce calls in the same order" in msg
    for rank in (1, 2):
        kind, msg = res[rank]["ref_rd"]
        assert msg.startswith(
            f"ref_rd: rank {rank} failed in the size check before any data moved (all-gather of element count"
        )
