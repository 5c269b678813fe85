"""What the tests of bad input read from `spanllm.cli.main`'s stderr (imported by basename: tests/conftest.py puts
this folder on sys.path)."""

from __future__ import annotations


def one_error_line(capsys) -> str:
    """The command's stderr: exactly one line, `spanllm: error: ...` (no traceback); returned for its words."""
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err  # one line, no traceback
    assert lines[0].startswith("spanllm: error: "), err
    return lines[0]
