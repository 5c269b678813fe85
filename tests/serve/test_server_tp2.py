"""`spanllm serve --nprocs 2` (TP=2 over gloo) as a subprocess: greedy text equals the offline engine's, and
SIGTERM ends it (and its ranks) within seconds.

The offline reference runs at TP=2 too: the tiny preset's random weights are drawn per rank shard
(loader.random_init), so a TP=1 and a TP=2 tiny model are different networks. Equality with TP=1 needs a
checkpoint with a tokenizer (not available offline here)."""

from __future__ import annotations

import os
import time

import pytest
from serve_helpers import descendants, offline_greedy, sigterm_and_check, start_cli_server

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")  # the official client (a test extra); absent on the GPU machine


PROMPTS = ["Hello, my name is", "The capital of France is"]


def test_tp2_server_matches_tp1_and_sigterm():
    from spanllm.launch import launch

    want = launch(offline_greedy, PROMPTS, 12, nprocs=2)[0]
    # Port 0: the server binds a free port itself and prints it (no window for another process to take it).
    # A 10 s collective timeout and a 0.5 s heartbeat: the idle pause below outlasts the timeout, so the server
    # only keeps answering because the idle engine thread keeps the worker rank's wait short.
    deadline = time.monotonic() + 180
    proc, base = start_cli_server(
        [
            "--model",
            "tiny",
            "--dtype",
            "float32",
            "--nprocs",
            "2",
            "--num-kv-blocks",
            "256",
            "--port",
            "0",
            "--no-warmup",
            "--pg-timeout",
            "10",
        ],
        deadline,
        "the TP=2 server",
        env={**os.environ, "SPANLLM_SERVE_HEARTBEAT_S": "0.5"},
    )
    try:
        while httpx.get(base + "/health", timeout=5).status_code != 200:
            assert time.monotonic() < deadline, "the TP=2 server never turned healthy"
            time.sleep(0.3)
        c = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=60)
        for p, w in zip(PROMPTS, want):
            assert c.completions.create(model="tiny", prompt=p, max_tokens=12, temperature=0).choices[0].text == w
            chunks = list(c.completions.create(model="tiny", prompt=p, max_tokens=12, temperature=0, stream=True))
            assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == w
        r = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
        assert r.usage.completion_tokens <= 4
        time.sleep(12)  # idle for longer than the collective timeout
        assert proc.poll() is None, "the idle TP=2 server exited"
        assert (
            c.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=12, temperature=0).choices[0].text
            == want[0]
        )
        below = descendants(proc.pid)  # the ranks, rank 0's front-end process, multiprocessing's helpers
        sigterm_and_check(proc, below, "the TP=2 server", "a rank or the front end outlived the server")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
