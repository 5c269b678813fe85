"""A measured kernel table (the GEMV's, the W8A8 GEMM's) replaced by a test's own entries: written to a file, the
table's environment variable pointed at it, and the caches that read it cleared before and after the test."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator


def use_entries(
    tmp_path, monkeypatch, filename: str, env: str, caches: tuple
) -> Iterator[Callable[[list[dict]], None]]:
    """For a fixture to `yield from`: yields use(entries), which makes `entries` the table; clears `caches` after."""

    def use(entries: list[dict]) -> None:
        path = tmp_path / filename
        path.write_text(json.dumps({"entries": entries}))
        monkeypatch.setenv(env, str(path))
        for cache in caches:
            cache.cache_clear()

    yield use
    for cache in caches:
        cache.cache_clear()
