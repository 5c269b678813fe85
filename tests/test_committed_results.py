"""The GPU results committed under results/h200x2 pass the same checks the GPU tests apply to a fresh run
(tests/test_gpu.py's checkers are plain functions over the documents), so a committed file that falls
short -- a missing case, a wrong element, an error that names no peer -- fails on every machine."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "results" / "h200x2"


def _checkers():
    spec = importlib.util.spec_from_file_location("gpu_checks", ROOT / "tests" / "test_gpu.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_committed_2x1_conformance_passes_the_gpu_checks():
    doc = json.loads((RESULTS / "conformance_2x1.json").read_text())
    # The committed run predates the phase-major (pipelined) launch; every other requirement holds.
    problems = _checkers().conformance_problems(doc, ranks_per_node=1)
    assert problems == ["nvrar variants ['nvrar:default', 'nvrar:rs_b4x256', 'nvrar:rs_b64x1024', "
                        "'nvrar:simple_rs_b16x512'], expected ['nvrar:default', 'nvrar:pipe_rs_b2x256', "
                        "'nvrar:pipe_simple_rs_b4x512', 'nvrar:rs_b4x256', 'nvrar:rs_b64x1024', 'nvrar:simple_rs_b16x512']"]


@pytest.mark.parametrize("topology,rpn", [("2x1", 1), ("1x2", 2)])
def test_committed_timeouts_name_rank_phase_and_peer(topology, rpn):
    doc = json.loads((RESULTS / f"timeout_{topology}.json").read_text())
    (waiting,) = [r for r in doc["ranks"] if not r["skipped"]]
    assert _checkers().timeout_problems(waiting, rpn) == []


def test_checker_catches_a_wrong_element():
    doc = json.loads((RESULTS / "conformance_2x1.json").read_text())
    doc["results"][0]["wrong"] = 3
    assert any("3 wrong" in p for p in _checkers().conformance_problems(doc, ranks_per_node=1))
