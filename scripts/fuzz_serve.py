"""Fuzz `spanllm serve` longer than the test suite does: generated bodies at /v1/completions and
/v1/chat/completions (spanllm.serve.fuzz), each answer a 2xx with a well-formed body or a 4xx in OpenAI's error
shape, never a 5xx; the server must still answer /health at the end. Exits 1 with the first failing body.

    python scripts/fuzz_serve.py --examples 2000                        # starts a tiny CPU server itself
    python scripts/fuzz_serve.py --url http://127.0.0.1:8000 --examples 5000   # a running server
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import httpx
from hypothesis import HealthCheck, given, settings

from spanllm.serve.fuzz import bodies, check_answer


def fuzz(base_url: str, chat: bool, examples: int, seed: int) -> dict:
    path = "/v1/chat/completions" if chat else "/v1/completions"
    counts: dict = {}

    @settings(max_examples=examples, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(bodies(chat))
    def one(body):
        r = httpx.post(
            base_url + path, content=json.dumps(body), headers={"content-type": "application/json"}, timeout=120
        )
        problem = check_answer(r.status_code, r.content, body.get("stream") is True and r.status_code == 200)
        assert problem is None, f"{body!r}: {problem}"
        counts[r.status_code] = counts.get(r.status_code, 0) + 1

    one = hypothesis_seed(seed)(one)
    one()
    return counts


def hypothesis_seed(seed: int):
    from hypothesis import seed as hseed

    return hseed(seed)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default=None, help="a running server (default: start a tiny CPU server here)")
    p.add_argument("--examples", type=int, default=1000, help="bodies per endpoint")
    p.add_argument("--seed", type=int, default=0, help="hypothesis seed")
    a = p.parse_args()
    if a.examples < 1:
        p.error(f"--examples {a.examples}: must be >= 1")
    running = None
    base = a.url
    if base is None:
        sys.path.insert(0, "tests/serve")
        from serve_helpers import make_llm, start_server

        running = start_server(make_llm(), model_name="tiny")
        base = running.base_url
    t0 = time.monotonic()
    try:
        for chat in (False, True):
            counts = fuzz(base, chat, a.examples, a.seed)
            print(f"{'chat' if chat else 'completions'}: {a.examples} bodies, statuses {dict(sorted(counts.items()))}")
        health = httpx.get(base + "/health", timeout=10).status_code
        print(f"/health after: {health}; {time.monotonic() - t0:.0f} s")
        return 0 if health == 200 else 1
    finally:
        if running is not None:
            from serve_helpers import stop_server

            stop_server(running)


if __name__ == "__main__":
    sys.exit(main())
