"""docs/perf_model.md's FP8 table for 405B is what scripts/plan_fp8_table.py prints from today's model: a change of
the model or its constants that moves a prediction fails here until the doc is regenerated."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).parents[2]


def test_the_405b_fp8_table_in_the_doc_is_the_scripts_output():
    spec = importlib.util.spec_from_file_location("plan_fp8_table", ROOT / "scripts" / "plan_fp8_table.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    doc = (ROOT / "docs" / "perf_model.md").read_text()
    start = doc.index(script.HEADER.splitlines()[0])
    in_doc = doc[start : doc.index("\n\n", start)]
    assert in_doc == script.table()
    assert len(in_doc.splitlines()) == 2 + 2 * len(script.CASES) * len(script.RUNS) == 34
