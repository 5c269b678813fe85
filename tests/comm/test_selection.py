"""Algorithm selection as a pure function: default rule, tuning table, fallbacks with their reasons;
the tuning table's lookup and files; Capability.unsupported_reason."""

from __future__ import annotations

import json

import pytest
import torch

from spanllm.comm import registry
from spanllm.comm.base import Capability
from spanllm.comm.selection import Candidate, Choice, select
from spanllm.comm.topology import Topology
from spanllm.comm.tuning import TuningEntry, TuningTable

MiB = 1 << 20
ONE_NODE = Topology(2, 2)  # "1x2"
TWO_NODES = Topology(4, 2)  # "2x2"
BF16 = torch.bfloat16


def cand(name: str, max_bytes: int | None = None) -> Candidate:
    return Candidate(name, registry.algorithm_class(name).capability, max_bytes)


def gpu_candidates() -> list[Candidate]:
    """What `auto` builds on GPUs: nccl, nvrar with an 8 MiB buffer, torch symmetric memory with 8 MiB."""
    return [cand("nccl"), cand("nvrar", 8 * MiB), cand("torch_one_shot", 8 * MiB), cand("torch_two_shot", 8 * MiB)]


def table(*entries: tuple[str, str, int, str], **meta) -> TuningTable:
    return TuningTable([TuningEntry(t, d, s, b) for t, d, s, b in entries], dict(meta))


# --------------------------------------------------------------------------------------------------
# default rule, no table


def test_default_gpu_picks_nvrar_while_it_fits():
    c = select(MiB, BF16, TWO_NODES, "cuda", gpu_candidates())
    assert c == Choice("nvrar", "default rule: nvrar")
    assert select(8 * MiB, BF16, TWO_NODES, "cuda", gpu_candidates()).algorithm == "nvrar"  # exactly the buffer


def test_above_max_bytes_falls_back_to_nccl_and_says_why():
    c = select(8 * MiB + 2, BF16, TWO_NODES, "cuda", gpu_candidates())
    assert c == Choice("nccl", "nvrar: 8388610 bytes exceed its buffer of 8388608 bytes; default rule: nccl")


def test_dtype_nvrar_cannot_run_falls_back_to_nccl():
    c = select(1024, torch.float64, ONE_NODE, "cuda", gpu_candidates())
    assert c.algorithm == "nccl"
    assert c.reason == ("nvrar: dtype torch.float64 not in ['bfloat16', 'float', 'half', 'int32']; default rule: nccl")


def test_default_cpu_picks_gloo():
    cpu = [cand("gloo"), cand("ref_hier"), cand("ref_ring")]
    assert select(4096, torch.float32, TWO_NODES, "cpu", cpu) == Choice("gloo", "default rule: gloo")
    # Without gloo the next in the default order.
    assert select(4096, torch.float32, TWO_NODES, "cpu", cpu[1:]) == Choice("ref_hier", "default rule: ref_hier")
    # Neither default: the first candidate that runs.
    assert select(4096, torch.float32, TWO_NODES, "cpu", cpu[2:]) == Choice(
        "ref_ring", "first candidate that runs: ref_ring"
    )


def test_nothing_can_run_is_an_error_naming_every_reason():
    with pytest.raises(ValueError) as e:
        select(1024, torch.complex64, ONE_NODE, "cuda", [cand("nccl"), cand("nvrar", 8 * MiB)])
    msg = str(e.value)
    assert msg.startswith("no all-reduce candidate can run 1024 bytes of torch.complex64 on 1x2 (cuda): ")
    assert "nvrar: dtype torch.complex64 not in" in msg and "nccl: dtype torch.complex64 not in" in msg


# --------------------------------------------------------------------------------------------------
# with a tuning table


def test_table_choice_wins_when_usable():
    t = table(("1x2", "bfloat16", 4096, "torch_one_shot"), ("1x2", "bfloat16", MiB, "nccl"))
    assert select(4000, BF16, ONE_NODE, "cuda", gpu_candidates(), t) == Choice(
        "torch_one_shot", "tuning table: best at 4096 bytes"
    )
    assert select(8192, BF16, ONE_NODE, "cuda", gpu_candidates(), t) == Choice(
        "nccl", "tuning table: best at 1048576 bytes"
    )


def test_no_entry_for_topology_is_reported():
    t = table(("1x2", "bfloat16", 4096, "nccl"))
    c = select(4096, BF16, TWO_NODES, "cuda", gpu_candidates(), t)
    assert c == Choice("nvrar", "no table entry for 2x2/torch.bfloat16; default rule: nvrar")
    c = select(4096, torch.float32, ONE_NODE, "cuda", gpu_candidates(), t)
    assert c == Choice("nvrar", "no table entry for 1x2/torch.float32; default rule: nvrar")


def test_table_best_not_in_this_communicator():
    t = table(("2x2", "bfloat16", 4096, "nvrar"))
    c = select(4096, BF16, TWO_NODES, "cuda", [cand("nccl")], t)
    assert c == Choice("nccl", "table's nvrar unusable (not available in this communicator); default rule: nccl")


def test_table_best_above_its_buffer_falls_back_to_nccl():
    t = table(("2x2", "bfloat16", 4 * MiB, "nvrar"))  # lookup takes the largest entry for bigger messages
    c = select(16 * MiB, BF16, TWO_NODES, "cuda", gpu_candidates(), t)
    assert c.algorithm == "nccl"
    assert c.reason == (
        "table's nvrar unusable (16777216 bytes exceed its buffer of 8388608 bytes); "
        "nvrar: 16777216 bytes exceed its buffer of 8388608 bytes; default rule: nccl"
    )


@pytest.mark.parametrize("name", ["torch_one_shot", "torch_two_shot"])
def test_symm_mem_excluded_for_multi_node(name):
    t = table(("2x2", "bfloat16", 4096, name))
    c = select(4096, BF16, TWO_NODES, "cuda", gpu_candidates(), t)
    assert c.algorithm == "nvrar"
    assert c.reason == (
        f"table's {name} unusable (torch symmetric-memory ops need every rank P2P-reachable "
        "(one node); topology 2x2 has 2 nodes: use nvrar or nccl across nodes); default rule: nvrar"
    )


@pytest.mark.parametrize("name", ["torch_one_shot", "torch_two_shot"])
@pytest.mark.parametrize("count", [1, 3, 1001])
def test_symm_mem_excluded_for_sizes_not_multiple_of_4_bytes(name, count):
    nbytes = 2 * count  # odd bf16 counts: 2, 6, 2002 bytes
    t = table(("1x2", "bfloat16", 4096, name))
    c = select(nbytes, BF16, ONE_NODE, "cuda", gpu_candidates(), t)
    assert c == Choice(
        "nvrar", f"table's {name} unusable ({nbytes} bytes is not a multiple of 4 bytes); default rule: nvrar"
    )
    # An even count of the same dtype is a multiple of 4 bytes and the table's choice holds.
    assert select(nbytes + 2, BF16, ONE_NODE, "cuda", gpu_candidates(), t).algorithm == name


def test_two_shot_only_for_worlds_2_4_8():
    t = table(("1x6", "bfloat16", 4096, "torch_two_shot"))
    c = select(4096, BF16, Topology(6, 6), "cuda", gpu_candidates(), t)
    assert c.algorithm == "nvrar"
    assert "torch's two_shot_all_reduce_out implements world sizes 2, 4 and 8, not 6" in c.reason


# --------------------------------------------------------------------------------------------------
# TuningTable


def test_lookup_smallest_measured_size_at_or_above_else_largest():
    t = table(
        ("1x2", "bfloat16", 1024, "a"),
        ("1x2", "bfloat16", 64, "b"),
        ("1x2", "bfloat16", 4096, "c"),
        ("2x1", "bfloat16", 100, "other_topology"),
        ("1x2", "float", 100, "other_dtype"),
    )
    best = lambda n: t.lookup(n, BF16, ONE_NODE).best  # noqa: E731
    assert [best(n) for n in (1, 64, 65, 1024, 1025, 4096, 4097, 1 << 30)] == ["b", "b", "a", "a", "c", "c", "c", "c"]
    assert t.lookup(65, BF16, ONE_NODE).size == 1024
    assert t.lookup(100, torch.float32, ONE_NODE).best == "other_dtype"
    assert t.lookup(100, BF16, Topology(2, 1)).best == "other_topology"
    assert t.lookup(100, torch.float16, ONE_NODE) is None
    assert t.lookup(100, BF16, Topology(8, 4)) is None
    assert TuningTable([]).lookup(100, BF16, ONE_NODE) is None


def test_save_load_roundtrip(tmp_path):
    launch = {"one_shot": True, "num_blocks": 8, "block": 512, "num_warps": 4}
    t = TuningTable(
        [
            TuningEntry("1x2", "bfloat16", 4096, "nvrar", launch, {"nvrar": 7.5, "nccl": 12.25}),
            TuningEntry("1x2", "bfloat16", MiB, "nccl", None, {"nccl": 80.0}),
        ],
        {"machine": {"host": "h"}},
    )
    path = tmp_path / "t.json"
    t.save(str(path))
    doc = json.loads(path.read_text())
    assert doc["kind"] == "tuning" and doc["machine"] == {"host": "h"} and len(doc["entries"]) == 2
    back = TuningTable.load(str(path))
    assert back.entries == t.entries and back.meta == {"machine": {"host": "h"}}
    # Selection through the loaded table.
    assert select(4096, BF16, ONE_NODE, "cuda", gpu_candidates(), back) == Choice(
        "nvrar", "tuning table: best at 4096 bytes"
    )
    p = back.nvrar_launch(100, BF16, ONE_NODE)
    assert (p.one_shot, p.num_blocks, p.block, p.num_warps) == (True, 8, 512, 4)
    assert back.nvrar_launch(MiB, BF16, ONE_NODE) is None  # entry without launch parameters
    assert back.nvrar_launch(100, torch.float32, ONE_NODE) is None  # no entry


def test_comma_separated_tables_merge(tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    table(("1x2", "bfloat16", 4096, "torch_one_shot"), meta_of="a").save(str(a))
    table(("2x1", "bfloat16", 4096, "nccl"), ("2x1", "bfloat16", 64, "nvrar"), meta_of="b").save(str(b))
    merged = TuningTable.load(f"{a},{b}")
    assert [(e.topology, e.size, e.best) for e in merged.entries] == [
        ("1x2", 4096, "torch_one_shot"),
        ("2x1", 4096, "nccl"),
        ("2x1", 64, "nvrar"),
    ]
    assert merged.meta == {"meta_of": "a"}
    cands = gpu_candidates()
    assert select(4096, BF16, ONE_NODE, "cuda", cands, merged).algorithm == "torch_one_shot"
    assert select(4096, BF16, Topology(2, 1), "cuda", cands, merged).algorithm == "nccl"
    assert select(8, BF16, Topology(2, 1), "cuda", cands, merged).algorithm == "nvrar"
    # A trailing comma is tolerated.
    assert len(TuningTable.load(f"{a},").entries) == 1


def test_load_non_table_json_is_a_clear_value_error(tmp_path):
    p = tmp_path / "bench.json"
    p.write_text(json.dumps({"kind": "allreduce", "rows": []}))
    with pytest.raises(ValueError, match=r"is not a tuning table \(kind='allreduce'\); write one with `spanllm tune`"):
        TuningTable.load(str(p))
    p.write_text(json.dumps({"kind": "tuning"}))  # no entries
    with pytest.raises(ValueError, match=r"is not a tuning table \(kind='tuning'\)"):
        TuningTable.load(str(p))


def test_load_missing_or_broken_file_is_a_clear_value_error(tmp_path):
    missing = tmp_path / "nope.json"
    with pytest.raises(ValueError, match=r"cannot read tuning table .*nope.json.*spanllm tune --out"):
        TuningTable.load(str(missing))
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    with pytest.raises(ValueError, match=r"cannot read tuning table .*broken.json"):
        TuningTable.load(str(broken))


def test_load_json_array_is_a_clear_value_error(tmp_path):
    p = tmp_path / "list.json"
    p.write_text("[1, 2]")
    with pytest.raises(ValueError, match="is not a tuning table"):
        TuningTable.load(str(p))


def test_load_malformed_entry_is_a_clear_value_error(tmp_path):
    p = tmp_path / "bad_entry.json"
    p.write_text(json.dumps({"kind": "tuning", "entries": [{"topology": "1x2"}]}))
    with pytest.raises(ValueError, match="bad_entry.json"):
        TuningTable.load(str(p))


# --------------------------------------------------------------------------------------------------
# Capability.unsupported_reason


def _single_node(t: Topology) -> str | None:
    return None if t.num_nodes == 1 else f"{t.num_nodes} nodes"


CAP = Capability(
    dtypes=frozenset({torch.float32, torch.bfloat16}),
    device_types=frozenset({"cuda"}),
    max_bytes=1024,
    size_multiple_bytes=4,
    topology_rule=_single_node,
)


def reason(**kw):
    args = dict(nbytes=512, dtype=torch.float32, topology=ONE_NODE, device_type="cuda")
    args.update(kw)
    return CAP.unsupported_reason(**args)


def test_capability_accepts_supported_call():
    assert reason() is None
    assert reason(nbytes=0) is None
    assert reason(nbytes=1024) is None


def test_capability_reasons():
    assert reason(device_type="cpu") == "runs on ['cuda'], not cpu"
    assert reason(dtype=torch.float16) == "dtype torch.float16 not in ['bfloat16', 'float']"
    assert reason(nbytes=6) == "6 bytes is not a multiple of 4 bytes"
    assert reason(nbytes=1028) == "1028 bytes exceed its buffer of 1024 bytes"
    assert reason(topology=TWO_NODES) == "2 nodes"


def test_capability_instance_max_bytes_overrides_class_limit():
    assert reason(nbytes=2048, max_bytes=4096) is None
    assert reason(nbytes=512, max_bytes=256) == "512 bytes exceed its buffer of 256 bytes"


def test_capability_checks_in_order_device_dtype_size_buffer_topology():
    assert reason(device_type="cpu", dtype=torch.int64, nbytes=7) == "runs on ['cuda'], not cpu"
    assert reason(dtype=torch.int64, nbytes=7) == "dtype torch.int64 not in ['bfloat16', 'float']"
    assert reason(nbytes=2047, topology=TWO_NODES) == "2047 bytes is not a multiple of 4 bytes"
    assert reason(nbytes=2048, topology=TWO_NODES) == "2048 bytes exceed its buffer of 1024 bytes"


def test_capability_without_limits():
    cap = Capability(dtypes=frozenset({torch.int32}), device_types=frozenset({"cpu", "cuda"}))
    assert (
        cap.unsupported_reason(nbytes=(1 << 40) + 1, dtype=torch.int32, topology=Topology(16, 1), device_type="cpu")
        is None
    )


def test_registered_capabilities():
    """What the registry declares: the CPU list is what the benchmark runs on CPU."""
    assert registry.algorithms_for_device("cpu") == ["ref_ring", "ref_rd", "ref_hier", "gloo", "auto"]
    assert set(registry.algorithms_for_device("cuda")) == {
        "ref_ring",
        "ref_rd",
        "ref_hier",
        "nccl",
        "torch_one_shot",
        "torch_two_shot",
        "nvrar",
        "auto",
    }
    with pytest.raises(KeyError, match=r"unknown all-reduce algorithm 'nope'; registered: ref_ring, "):
        registry.algorithm_class("nope")
