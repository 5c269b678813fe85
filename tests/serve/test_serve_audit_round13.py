"""The hostile-test audit of round 13 (streaming, the endpoints' edges, parameter semantics): the tests of fixed
defects failed before their fix (stream_options.continuous_usage_stats refused as an unknown field, best_of=1 with
n>1 accepted, client keys and model names echoed whole in errors, an empty or UTF-16 body answered with a decoder's
message); the others pin what held (a stop string straddling tokens while streaming, a disconnect of an n=2
stream). One in-process tiny server (the module's `server` fixture)."""

from __future__ import annotations

import json
import time

import httpx
import pytest

UNKNOWN = "unknown field (this server refuses what it would not honour)"
# the tiny preset's byte tokenizer: token id = byte + 3; with these four letters biased, greedy decoding from
# "hello" writes "bbbbbbiibbbbiiiiibbbbbbiiiiiiiibbbbbbbii"
LETTERS = {"104": 10, "101": 10, "108": 10, "111": 10}
GREEDY = "bbbbbbiibbbbiiiiibbbbbbiiiiiiiibbbbbbbii"


def _post(server, path: str, body: dict | None = None, content: bytes | None = None) -> httpx.Response:
    if content is not None:
        return httpx.post(server.base_url + path, content=content, headers={"content-type": "application/json"})
    return httpx.post(server.base_url + path, json=body, timeout=60)


def _error(r: httpx.Response, param: str | None, message: str, status: int = 400) -> None:
    assert r.status_code == status, r.text
    assert r.json()["error"]["message"] == message
    assert r.json()["error"]["param"] == param


def _events(server, path: str, body: dict) -> list[dict]:
    """The stream's data events as JSON, after checking that it ends with [DONE]."""
    with httpx.stream("POST", server.base_url + path, json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200, r.read()
        data = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


def test_continuous_usage_stats_put_the_usage_in_every_chunk(server):
    """vLLM's stream_options.continuous_usage_stats was refused as an unknown field. Every chunk now carries the
    usage so far, with its choice's completion tokens; the last chunk has all choices'. Without include_usage it
    would say nothing: refused."""
    opts = {"include_usage": True, "continuous_usage_stats": True}
    body = {"prompt": "hi", "max_tokens": 3, "ignore_eos": True, "echo": True, "stream_options": opts}
    events = _events(server, "/v1/completions", body)
    assert [e["usage"]["completion_tokens"] for e in events] == [0, 1, 2, 3, 3, 3]
    assert all(
        e["usage"]["prompt_tokens"] == 3 and e["usage"]["total_tokens"] == 3 + e["usage"]["completion_tokens"]
        for e in events
    )
    assert events[0]["choices"][0]["text"] == "hi" and events[-1]["choices"] == []

    msgs = [{"role": "user", "content": "hi"}]
    body = {"messages": msgs, "max_tokens": 2, "ignore_eos": True, "n": 2, "stream_options": opts}
    events = _events(server, "/v1/chat/completions", body)
    prompt = 1 + len(b"user: hi\nassistant:")
    for i in (0, 1):
        mine = [e for e in events if e["choices"] and e["choices"][0]["index"] == i]
        assert [e["usage"]["completion_tokens"] for e in mine] == [0, 1, 2, 2]
        assert mine[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert mine[-1]["choices"][0]["finish_reason"] == "length"
    assert events[-1] == {**events[-1], "choices": [], "usage": usage(prompt, 4)}

    plain = _events(
        server, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "stream_options": {"include_usage": True}}
    )
    assert ["usage" in e for e in plain] == [False] * (len(plain) - 1) + [True]

    r = _post(
        server, "/v1/completions", {"prompt": "hi", "stream": True, "stream_options": {"continuous_usage_stats": True}}
    )
    _error(
        r,
        "stream_options",
        "stream_options: continuous_usage_stats=true puts the usage in every chunk of a stream that has one; give "
        "include_usage=true too, or drop continuous_usage_stats",
    )


def usage(prompt: int, completion: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def test_best_of_below_n_is_refused(server):
    """best_of=1 with n=3 was served as n=3, best_of silently dropped (OpenAI and vLLM refuse best_of < n)."""
    _error(
        _post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 1, "best_of": 1, "n": 3}),
        "best_of",
        "best_of=1 with n=3: best_of candidates are generated and the best n of them returned, so best_of must be "
        ">= n; drop best_of (only best_of=1 is served)",
    )
    r = _post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 1, "best_of": 1, "n": 1})
    assert r.status_code == 200 and len(r.json()["choices"]) == 1


def test_client_strings_in_errors_are_clipped(server):
    """An unknown key of 100,000 characters came back whole in the message and again as param (200 KB of error);
    a model name too. Both are now quoted to 80 characters."""
    key = "k" * 100_000
    r = _post(server, "/v1/completions", {"prompt": "hi", key: 1})
    _error(r, "k" * 77 + "...", "k" * 77 + f"...: {UNKNOWN}")
    msgs = [{"role": "user", "content": "hi", "x" * 50_000: 1}]
    _error(
        _post(server, "/v1/chat/completions", {"messages": msgs}), "messages", f"messages.0.{'x' * 77}...: {UNKNOWN}"
    )
    r = _post(server, "/v1/completions", {"prompt": "hi", "model": "m" * 100_000})
    _error(r, "model", f"The model `{'m' * 77}...` does not exist: this server serves 'tiny'", 404)
    r = httpx.get(server.base_url + "/v1/models/" + "m" * 5000)
    _error(r, "model", f"The model `{'m' * 77}...` does not exist: this server serves 'tiny'", 404)
    raw = b'{"prompt": "hi", "' + b"s" * 1000 + b'": "\\ud800"}'
    _error(
        _post(server, "/v1/completions", content=raw),
        "s" * 77 + "...",
        "s" * 197 + "...: not valid UTF-8 text (a lone surrogate '\\ud800' at character 0)",
    )
    assert len(r.content) < 300


def test_empty_and_utf16_bodies_say_what_is_wrong(server):
    """An empty body got the decoder's "Expecting value: line 1 column 1 (char 0)"; a UTF-16 body (json.loads
    reads UTF-16 and UTF-32 bytes) was served, though JSON is UTF-8 and the module says so."""
    for raw in (b"", b" \n"):
        _error(
            _post(server, "/v1/completions", content=raw),
            None,
            "the request body is empty: send a JSON object (Content-Type: application/json)",
        )
    for encoding, name in (("utf-16", "UTF-16"), ("utf-32", "UTF-32"), ("utf-16-le", "UTF-16-LE")):
        raw = json.dumps({"prompt": "hi", "max_tokens": 1}).encode(encoding)
        _error(
            _post(server, "/v1/completions", content=raw),
            None,
            f"the request body is not valid JSON: not UTF-8 (its first bytes are those of {name} text); send it as "
            "UTF-8 (RFC 8259)",
        )
    r = _post(server, "/v1/completions", content=b'\xef\xbb\xbf{"prompt": "hi", "max_tokens": 1}')  # a UTF-8 BOM
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("stop", ["bi", ["xyz", "iib"]])
def test_a_stop_string_straddling_tokens_streams_the_text_before_it_once(server, stop):
    """Each letter is a token: the stop string spans two or three. Streamed, the text before it arrives once, no
    chunk holds any of the stop string, and the logprobs are the non-streaming answer's."""
    body = {"prompt": "hello", "max_tokens": 40, "temperature": 0, "logit_bias": LETTERS, "stop": stop, "logprobs": 1}
    want = {"bi": "bbbbb", "iib": "bbbbbb"}[stop if isinstance(stop, str) else stop[1]]
    plain = _post(server, "/v1/completions", body).json()["choices"][0]
    assert (plain["text"], plain["finish_reason"]) == (want, "stop") and GREEDY.startswith(want)
    events = _events(server, "/v1/completions", body)
    texts = [e["choices"][0]["text"] for e in events]
    assert "".join(texts) == want and all("i" not in t for t in texts)
    assert events[-1]["choices"][0]["finish_reason"] == "stop"
    assert events[-1]["choices"][0]["stop_reason"] == (stop if isinstance(stop, str) else stop[1])
    streamed = [t for e in events if e["choices"][0]["logprobs"] for t in e["choices"][0]["logprobs"]["tokens"]]
    assert streamed == plain["logprobs"]["tokens"] and "".join(streamed).startswith(want)


def test_a_client_leaving_an_n2_stream_aborts_both_choices(server):
    def metric(name, **labels):
        return server.metric(name, **labels)

    aborted0 = metric("spanllm:request_success_total", finished_reason="abort")
    msgs = [{"role": "user", "content": "x"}]
    body = {"messages": msgs, "max_tokens": 3000, "ignore_eos": True, "stream": True, "n": 2, "stop": ["zz"]}
    with httpx.Client(timeout=30) as h:
        with h.stream("POST", server.base_url + "/v1/chat/completions", json=body) as r:
            lines = r.iter_lines()
            for _ in range(6):
                next(line for line in lines if line.startswith("data:"))
            assert metric("spanllm:num_requests_running") == 2
    deadline = time.monotonic() + 10
    while metric("spanllm:num_requests_running") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert metric("spanllm:num_requests_running") == 0 and metric("spanllm:kv_cache_usage_perc") == 0
    assert metric("spanllm:request_success_total", finished_reason="abort") == aborted0 + 2
    r = _post(server, "/v1/completions", {"prompt": "hello", "max_tokens": 5, "temperature": 0, "logit_bias": LETTERS})
    assert r.json()["choices"][0]["text"] == GREEDY[:5]
