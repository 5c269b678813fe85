"""`spanllm serve --model smollm2-135m-instruct` (a subprocess, float32, CPU) with the openai client: greedy chat
answers, plain and streamed, equal transformers' greedy continuation of the same chat on the same GGUF file."""

from __future__ import annotations

import os
import signal
import sys
import time

import pytest

openai = pytest.importorskip("openai")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "serve"))
from gguf_workers import CHAT_QUESTIONS, NEW_TOKENS  # noqa: E402
from serve_helpers import start_cli_server  # noqa: E402

MODEL = "smollm2-135m-instruct"
ASKED = (0, 1, 6)  # indices into CHAT_QUESTIONS


@pytest.fixture(scope="module")
def client(real_model_path):
    args = ["--model", MODEL, "--dtype", "float32", "--port", "0", "--max-model-len", "1024", "--max-num-seqs", "4"]
    proc, base = start_cli_server(args, time.monotonic() + 300, "spanllm serve of the real model")
    try:
        yield openai.OpenAI(base_url=base + "/v1", api_key="none", timeout=120)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)


def _reference(hf_model, hf_greedy, i: int) -> tuple[str, int]:
    _, tok = hf_model
    return tok.decode(hf_greedy[i], skip_special_tokens=True), len(hf_greedy[i])


def test_chat_plain_equals_transformers(client, hf_model, hf_greedy):
    for i in ASKED:
        r = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": CHAT_QUESTIONS[i]}],
            temperature=0.0,
            max_tokens=NEW_TOKENS,
        )
        text, n = _reference(hf_model, hf_greedy, i)
        assert r.choices[0].message.content == text
        assert r.usage.completion_tokens == n
        assert r.choices[0].finish_reason == ("stop" if hf_greedy[i][-1] == hf_model[1].eos_token_id else "length")
    assert (
        "Paris"
        in client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": CHAT_QUESTIONS[0]}], temperature=0.0, max_tokens=16
        )
        .choices[0]
        .message.content
    )


def test_chat_streamed_equals_transformers(client, hf_model, hf_greedy):
    for i in ASKED:
        stream = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": CHAT_QUESTIONS[i]}],
            temperature=0.0,
            max_tokens=NEW_TOKENS,
            stream=True,
        )
        deltas = [c.choices[0].delta.content or "" for c in stream if c.choices]
        assert "".join(deltas) == _reference(hf_model, hf_greedy, i)[0]
        assert sum(1 for d in deltas if d) > 3  # really streamed, not one chunk
