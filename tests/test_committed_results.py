"""The GPU results committed under results/h200x2 pass the same checks the GPU tests apply to a fresh run
(tests/test_gpu.py's checkers are plain functions over the documents), so a committed file that falls
short -- a missing case, a wrong element, an error that names no peer -- fails on every machine."""

from __future__ import annotations

import functools
import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "results" / "h200x2"


@functools.cache
def _checkers():
    spec = importlib.util.spec_from_file_location("gpu_checks", ROOT / "tests" / "test_gpu.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("topology,rpn", [("2x1", 1), ("1x2", 2)])
def test_committed_conformance_passes_the_gpu_checks(topology, rpn):
    doc = json.loads((RESULTS / f"conformance_{topology}.json").read_text())
    assert _checkers().conformance_problems(doc, ranks_per_node=rpn) == []


@pytest.mark.parametrize("topology", ["1x2", "2x1"])
def test_committed_allreduce_benchmark_is_exact_and_names_what_ran(topology):
    doc = json.loads((RESULTS / f"allreduce_{topology}_bf16.json").read_text())
    rows = doc["rows"]
    assert {r["algo"] for r in rows} >= {"nccl", "nvrar", "auto"}
    assert all(r["wrong"] == 0 and r["graph"] for r in rows)
    sizes = sorted({r["size"] for r in rows})
    assert sizes[0] == 1024 and sizes[-1] == 16 << 20 and len(sizes) == 15
    for r in rows:  # no silent fallback: auto says which backend (and nvrar which launch) ran
        if r["algo"] == "auto":
            assert r["ran"].startswith("auto->") and r["ran"] != "auto->auto"
        if r["algo"] == "nvrar":
            assert r["ran"].startswith("nvrar[")


@pytest.mark.parametrize("topology", ["1x2", "2x1"])
def test_committed_phase_traces_are_exact_and_cover_both_ranks(topology):
    doc = json.loads((RESULTS / f"phases_{topology}.json").read_text())
    by_size: dict[int, set] = {}
    for r in doc["rows"]:
        assert r["wrong"] == 0
        by_size.setdefault(r["bytes"], set()).add(r["rank"])
    assert by_size and all(ranks == {0, 1} for ranks in by_size.values())


@pytest.mark.parametrize("topology,rpn", [("2x1", 1), ("1x2", 2)])
def test_committed_timeouts_name_rank_phase_and_peer(topology, rpn):
    doc = json.loads((RESULTS / f"timeout_{topology}.json").read_text())
    (waiting,) = [r for r in doc["ranks"] if not r["skipped"]]
    assert _checkers().timeout_problems(waiting, rpn) == []


def test_checker_catches_a_wrong_element():
    doc = json.loads((RESULTS / "conformance_2x1.json").read_text())
    doc["results"][0]["wrong"] = 3
    assert any("3 wrong" in p for p in _checkers().conformance_problems(doc, ranks_per_node=1))
