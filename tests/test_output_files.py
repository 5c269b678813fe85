"""Result files written at a command's end (spanllm.output_files): the bytes land where asked, a device node is
written into and never replaced, and a path that fails at the end (a full disk: /dev/full) keeps the result in a
temporary file named by the one-line error, instead of a traceback after the run."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from spanllm.cli import main
from spanllm.errors import SpanllmError
from spanllm.output_files import save_figure, write_json, write_text

FULL = "/dev/full"  # every write to it fails with ENOSPC
needs_dev_full = pytest.mark.skipif(not os.path.exists(FULL), reason="no /dev/full on this system")


def _kept(message: str) -> Path:
    m = re.search(r"the result was saved to (\S+) instead", message)
    assert m, message
    return Path(m.group(1))


def test_write_text_creates_the_folder_and_leaves_only_the_file(tmp_path):
    target = tmp_path / "a" / "b" / "out.json"
    write_json("--json", target, {"x": [1, 2]}, indent=1)
    assert json.loads(target.read_text()) == {"x": [1, 2]}
    write_text("--json", target, "second\n")  # overwritten in place, through a temporary file
    assert target.read_text() == "second\n"
    assert sorted(p.name for p in target.parent.iterdir()) == ["out.json"]


@needs_dev_full
def test_a_full_device_keeps_the_result_in_a_temporary_file():
    with pytest.raises(SpanllmError) as e:
        write_text("--json", FULL, "the result\n")
    message = str(e.value)
    assert message.startswith(f"--json {FULL}: cannot be written (No space left on device); "), message
    kept = _kept(message)
    try:
        assert kept.read_text() == "the result\n" and kept.suffix == ".txt"
    finally:
        kept.unlink()
    assert os.path.exists(FULL) and not os.path.isfile(FULL)  # the device node was written into, not replaced


@needs_dev_full
def test_a_figure_that_cannot_be_saved_is_kept_as_png():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    ax.plot([0, 1], [1, 0])
    with pytest.raises(SpanllmError, match=r"^--plot /dev/full: cannot be written") as e:
        save_figure("--plot", FULL, fig)
    plt.close(fig)
    kept = _kept(str(e.value))
    try:
        assert kept.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # a folder-less path gets the PNG default
    finally:
        kept.unlink()


@needs_dev_full
def test_plan_json_to_a_full_device_is_one_error_line_with_the_result_kept(capsys):
    rc = main(["plan", "--model", "llama3.1-8b", "--cluster", "h200x2", "--nodes", "1", "--json", FULL])
    out, err = capsys.readouterr()
    assert rc == 1, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"spanllm: error: --json {FULL}: cannot be written"), err
    kept = _kept(lines[0].removeprefix("spanllm: error: "))
    try:
        assert kept.suffix == ".json"
        doc = json.loads(kept.read_text())
        assert doc["model"] == "llama3.1-8b" and doc["rows"], sorted(doc)
    finally:
        kept.unlink()
    assert "llama3.1-8b" in out  # the table was printed before the write failed
