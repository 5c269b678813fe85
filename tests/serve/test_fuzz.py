"""Property-based fuzzing of both endpoints (spanllm.serve.fuzz): generated bodies, streamed or not, answer a 2xx
with a well-formed body or a 4xx in OpenAI's error shape, never a 5xx, and the server serves afterwards.
Bounded: FUZZ_EXAMPLES per endpoint here; scripts/fuzz_serve.py runs as many as you ask."""

from __future__ import annotations

import json

import httpx
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402

from spanllm.serve.fuzz import bodies, check_answer  # noqa: E402

FUZZ_EXAMPLES = 60


def _post(base_url: str, path: str, body: dict) -> tuple[int, bytes, bool]:
    streamed = body.get("stream") is True
    data = json.dumps(body).encode()  # NaN never drawn; huge integers are plain JSON numbers
    r = httpx.post(base_url + path, content=data, headers={"content-type": "application/json"}, timeout=60)
    return r.status_code, r.content, streamed and r.status_code == 200


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_fuzz_endpoint(server, chat):
    path = "/v1/chat/completions" if chat else "/v1/completions"
    seen = {"2xx": 0, "4xx": 0}

    @settings(max_examples=FUZZ_EXAMPLES, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(bodies(chat))
    def one(body):
        status, raw, streamed = _post(server.base_url, path, body)
        problem = check_answer(status, raw, streamed)
        assert problem is None, f"{body!r}: {problem}"
        seen["2xx" if status < 300 else "4xx"] += 1

    one()
    assert seen["2xx"] > 0 and seen["4xx"] > 0, seen  # both kinds of answer were exercised
    assert httpx.get(server.base_url + "/health").status_code == 200
    ok = httpx.post(server.base_url + "/v1/completions", json={"prompt": "ok", "max_tokens": 2}, timeout=30)
    assert ok.status_code == 200
