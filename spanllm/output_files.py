"""Writing a command's result files at the end of its run, without losing the run when the write fails.

`spanllm.checks.output_file` tries every output path before the work starts, but a path can still fail at the
end: the disk fills, a device opens but takes no data (/dev/full), the folder is removed meanwhile. Then the
result goes to a new file in the system's temporary folder and the command fails with one line naming the flag,
the path, the reason and where the result is, instead of a traceback after minutes of work with nothing kept.

A regular file is written through a temporary file beside it and renamed into place (a reader never sees half a
file); a path that exists and is not a regular file (a device, a pipe) is written directly: renaming over it
would replace the device node itself.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from spanllm.errors import SpanllmError


def write_result(
    path: str, kind: str, settings: dict[str, Any], rows: list[dict[str, Any]], flag: str = "--json", **extra: Any
) -> None:
    """A result file: kind, creation time, machine, versions, settings, rows (and `extra`), as `flag PATH` asked."""
    from spanllm.measure.report import machine_info, versions

    doc = {
        "kind": kind,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": machine_info(),
        "versions": versions(),
        "settings": settings,
        "rows": rows,
        **extra,
    }
    write_json(flag, path, doc, indent=1, default=str)


def write_text(flag: str, path: str | Path, text: str) -> None:
    """Writes `text` to `path` (the value of `flag`), creating its folder; see the module's docstring."""
    _write(flag, path, lambda f: f.write(text.encode()), ".txt")


def write_json(flag: str, path: str | Path, doc: Any, **dump_kwargs: Any) -> None:
    """`json.dumps(doc, **dump_kwargs)` written as `write_text` writes."""
    text = json.dumps(doc, **dump_kwargs)
    _write(flag, path, lambda f: f.write(text.encode()), ".json")


def save_figure(flag: str, path: str | Path, fig: Any, **savefig_kwargs: Any) -> None:
    """A matplotlib figure saved to `path` (its format from the suffix), with the same fallback."""
    fmt = Path(path).suffix.lstrip(".") or "png"
    _write(flag, path, lambda f: fig.savefig(f, format=fmt, **savefig_kwargs), f".{fmt}")


def _write(flag: str, path: str | Path, fill: Callable[[Any], None], kind_suffix: str) -> None:
    path = str(path)
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)) or ".", exist_ok=True)
        if os.path.exists(path) and not os.path.isfile(path):
            with open(path, "wb") as f:
                fill(f)
            return
        tmp = f"{path}.{os.getpid()}.tmp"
        try:
            with open(tmp, "wb") as f:
                fill(f)
            os.replace(tmp, path)
        finally:
            if os.path.lexists(tmp):
                os.remove(tmp)
    except OSError as e:
        reason = e.strerror or str(e)
        kept = _fallback(path, fill, kind_suffix)
        where = f"the result was saved to {kept} instead" if kept else "no copy could be saved either"
        raise SpanllmError(f"{flag} {path}: cannot be written ({reason}); {where}") from None


def _fallback(path: str, fill: Callable[[Any], None], kind_suffix: str) -> str | None:
    """A new file in the temporary folder, named after the path, with its suffix (else the content's)."""
    suffix = Path(path).suffix or kind_suffix
    try:
        fd, kept = tempfile.mkstemp(prefix=f"spanllm-{Path(path).stem or 'result'}-", suffix=suffix)
        with os.fdopen(fd, "wb") as f:
            fill(f)
        return kept
    except OSError:
        return None
