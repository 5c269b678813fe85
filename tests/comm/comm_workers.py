"""Rank functions for the multi-process tests (module level so spawned children can import them).

Each function runs every check of one world size inside one spawn and returns plain dicts; the tests
assert on them. Inputs are exact small integers (spanllm.comm.conformance.pattern), so every check is a
count of wrong elements.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from spanllm.comm import AllReduceInputError, Topology, registry
from spanllm.comm import conformance as C

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int32]


def _comms(world: int, rpns: list[int], group=None) -> dict[str, object]:
    """label -> communicator, built in the same order on every rank (construction is collective)."""
    comms = {
        "ref_ring": registry.create("ref_ring", group, Topology(world, world)),
        "ref_rd": registry.create("ref_rd", group, Topology(world, world)),
    }
    for g in rpns:
        comms[f"ref_hier:{world // g}x{g}"] = registry.create("ref_hier", group, Topology(world, g))
    comms["gloo"] = registry.create("gloo", group, Topology(world, world))
    return comms


def _rows(label: str, results) -> list[dict]:
    return [{"comm": label, **r.as_dict()} for r in results if r is not None]


def executor_suite(ctx, rpns: list[int], lengths: list[int], b2b_calls: int, b2b_n: int, subgroup_n: int = 0) -> dict:
    """Every conformance case for the reference executors and gloo at this world size (and, with
    `subgroup_n`, the concurrent-subgroups case of `subgroup_suite`)."""
    dev = torch.device("cpu")
    world = ctx.world_size
    comms = _comms(world, rpns)
    rows: list[dict] = []
    mismatch: dict[str, str | None] = {}
    after_mismatch: dict[str, int] = {}
    for label, comm in comms.items():
        rows += _rows(label, C.case_lengths(comm, lengths, DTYPES, dev))
        rows += _rows(label, [C.case_lengths(comm, [0], [torch.float32], dev)[0]])
        rows += _rows(
            label,
            [
                C.case_bitwise_identical(comm, 4099, torch.float32, dev, seed=1),
                C.case_bitwise_identical(comm, 1031, torch.bfloat16, dev, seed=2),
                C.case_bitwise_identical(comm, 777, torch.float16, dev, seed=3),
            ],
        )
        rows += _rows(label, [C.case_back_to_back(comm, b2b_n, torch.float32, b2b_calls, dev)])
        rows += _rows(label, [C.case_straggler(comm, 1000, torch.float32, 0.05, dev)])
        rows += _rows(label, C.case_bad_inputs(comm, dev))
        if label.startswith("ref_"):
            # Rank 0 passes n elements, the others n + 1: an error on every rank, never a hang.
            n = 37
            x = C.pattern(n if ctx.rank == 0 else n + 1, ctx.rank, torch.float32, dev)
            try:
                comm.all_reduce_(x)
                mismatch[label] = None
            except AllReduceInputError as e:
                mismatch[label] = str(e)
            # The communicator is still usable afterwards (nothing left in flight).
            y = C.pattern(n, ctx.rank, torch.float32, dev)
            comm.all_reduce_(y)
            after_mismatch[label] = int((y != C.expected(n, world, torch.float32, dev)).sum())
    for comm in comms.values():
        comm.close()
    sub = subgroup_suite(ctx, subgroup_n) if subgroup_n else None
    return {
        "rank": ctx.rank,
        "rows": rows,
        "mismatch": mismatch,
        "after_mismatch": after_mismatch,
        "labels": list(comms),
        "subgroups": sub,
    }


def subgroup_suite(ctx, n: int) -> dict:
    """Groups [0, 1] and [2, 3] reduce at the same time with different data; each must get its own sum."""
    dev = torch.device("cpu")
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # collective: every rank creates both
    mine = ctx.rank // 2 if ctx.rank < 4 else None
    out: dict[str, int] = {}
    if mine is not None:
        group = groups[mine]
        salt = 0 if mine == 0 else 1000
        grank = dist.get_rank(group)
        comms = _comms(2, [1], group)
        for label, comm in comms.items():
            for dtype in (torch.float32, torch.int32):
                x = C.pattern(n, grank, dtype, dev, salt=salt)
                comm.all_reduce_(x)
                out[f"{label}:{dtype}"] = int((x != C.expected(n, 2, dtype, dev, salt=salt)).sum())
            out[f"{label}:rank_in_group"] = comm.rank
        for comm in comms.values():
            comm.close()
    dist.barrier()
    return {"rank": ctx.rank, "group": mine, "wrong": out}


def mismatch_only(ctx, name: str) -> str:
    """Rank 0 passes 37 elements, the others 38; returns the AllReduceInputError message."""
    comm = registry.create(name, topology=Topology(ctx.world_size, ctx.world_size))
    x = C.pattern(37 if ctx.rank == 0 else 38, ctx.rank, torch.float32, torch.device("cpu"))
    try:
        comm.all_reduce_(x)
    except AllReduceInputError as e:
        return str(e)
    return "no error"
