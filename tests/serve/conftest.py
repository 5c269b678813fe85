"""The module-scoped TP=1 server fixture (tiny preset, float32, CPU, a free port)."""

from __future__ import annotations

import pytest
from serve_helpers import make_llm, start_server, stop_server


@pytest.fixture(scope="module")
def server():
    llm = make_llm()
    r = start_server(llm, model_name="tiny")
    try:
        yield r
    finally:
        stop_server(r)
        llm.close()
