"""Issue 32's hostile requests against `spanllm serve` as a user runs it (a subprocess, the default front-end
process): each answers its 4xx with OpenAI's error body naming the field and the range, and afterwards the
server's process is the same one and still serves. Also: the connection limits, --max-queued-requests on an
idle server, and exit status 0 after SIGTERM / SIGINT in both front-end modes."""

from __future__ import annotations

import asyncio
import json
import re
import select
import signal
import socket
import time

import httpx
import pytest
from serve_helpers import make_llm, start_cli_server, start_server, stop_server

openai = pytest.importorskip("openai")

SERVE = ["--model", "tiny", "--dtype", "float32", "--port", "0", "--no-warmup", "--num-kv-blocks", "256"]
LIMITS = ["--max-body-bytes", "1000000", "--header-timeout", "2", "--body-timeout", "1", "--max-connections", "16"]


@pytest.fixture(scope="module")
def cli_server():
    proc, base = start_cli_server([*SERVE, *LIMITS], time.monotonic() + 120)
    try:
        yield proc, base
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)


def _still_serving(cli_server) -> None:
    proc, base = cli_server
    assert proc.poll() is None, "the server exited"
    r = httpx.post(base + "/v1/completions", json={"prompt": "ok", "max_tokens": 2}, timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def _read_all(s: socket.socket) -> str:
    """What the server sends until it closes the connection (its error answers say connection: close)."""
    out = b""
    while chunk := s.recv(65536):
        out += chunk
    return out.decode()


def _error(r: httpx.Response, status: int, param: str | None, *words: str) -> None:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status
    assert err["param"] == param, err
    for w in words:
        assert w in err["message"], err["message"]


BIG = 2**64
CASES = [
    # (body, param, words in the message)
    ({"seed": BIG}, "seed", ["18446744073709551616", "[-9223372036854775808, 9223372036854775807]"]),
    ({"seed": -(2**63) - 1}, "seed", ["-9223372036854775809", "9223372036854775807]"]),
    ({"top_k": 10**20}, "top_k", ["[-1, 2147483647]"]),
    ({"max_tokens": 2**31}, "max_tokens", ["[1, 2147483647]"]),
    ({"min_tokens": 2**40}, "min_tokens", ["[0, 2147483647]"]),
    ({"stop_token_ids": [2**63]}, "stop_token_ids", ["[0, 2147483647]"]),
    ({"prompt": [1, 2**40]}, "prompt", ["prompt.1=1099511627776", "[0, 2147483647]"]),
    ({"stream": "false"}, "stream", ["valid boolean"]),
    ({"n": True}, "n", ["valid integer"]),
    ({"echo": 1}, "echo", ["valid boolean"]),
    ({"temperature": "0.5"}, "temperature", ["valid number"]),
    ({"temperature": 2.5}, "temperature", ["[0, 2]"]),
    ({"stop": ["x"] * 10_000}, "stop", ["10000 strings", "at most 16", "--max-stop-strings"]),
    ({"stop": "x" * 100_000}, "stop", ["100000 characters", "at most 256"]),
    # a million ids slowed every other stream ~5x (each step checks them): bounded, duplicates counted
    ({"stop_token_ids": [5] * 1025}, "stop_token_ids", ["1025 ids", "at most 1024", "--max-stop-token-ids"]),
    ({"stream_options": {"include_usage": True}}, "stream_options", ["stream=true"]),
    ({"frobnicate": 1}, "frobnicate", ["unknown field"]),
    ({"logit_bias": {"abc": 1}}, "logit_bias", ["token id"]),
    ({"logit_bias": {"5": 101}}, "logit_bias", ["[-100, 100]"]),
    ({"logprobs": 21}, "logprobs", ["[0, 20]"]),
    ({"echo": True, "logprobs": 1}, "echo", ["echo with logprobs"]),
    ({"best_of": 3}, "best_of", ["best_of"]),
    ({"suffix": "x"}, "suffix", ["suffix"]),
]


@pytest.mark.parametrize("extra,param,words", CASES, ids=[c[1] + str(i) for i, c in enumerate(CASES)])
def test_hostile_field(cli_server, extra, param, words):
    proc, base = cli_server
    pid = proc.pid
    body = {"prompt": "Hello there", "max_tokens": 4, "temperature": 0.8, **extra}
    _error(httpx.post(base + "/v1/completions", json=body, timeout=30), 400, param, *words)
    assert proc.pid == pid
    _still_serving(cli_server)


def test_hostile_seed_through_the_openai_client(cli_server):
    proc, base = cli_server
    c = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=30)
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model="tiny", prompt="Hello there", max_tokens=4, temperature=0.8, seed=BIG)
    assert e.value.body["param"] == "seed"
    _still_serving(cli_server)


def test_lone_surrogate_and_deep_nesting(cli_server):
    proc, base = cli_server
    url = base + "/v1/completions"
    h = {"content-type": "application/json"}
    _error(httpx.post(url, content=b'{"prompt": "\\ud800 hi"}', headers=h), 400, "prompt", "lone surrogate")
    chat = base + "/v1/chat/completions"
    body = b'{"messages": [{"role": "user", "content": "\\udfff"}]}'
    _error(httpx.post(chat, content=body, headers=h), 400, "messages", "lone surrogate")
    deep = b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    _error(httpx.post(url, content=deep, headers=h), 400, None, "nests deeper than 32")
    _error(httpx.post(url, content=b"\xff\xfe{}", headers=h), 400, None, "not valid JSON")
    _still_serving(cli_server)


def test_body_size_limit_before_reading(cli_server):
    proc, base = cli_server
    url = base + "/v1/completions"
    # Content-Length over the limit: 413 before the body, which is never sent (the client's headers alone); the
    # socket's timeout turns a server that waits for the body into a failure
    with socket.create_connection(("127.0.0.1", int(base.rsplit(":", 1)[1])), timeout=10) as s:
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 50000000\r\n\r\n"
        )
        reply = _read_all(s)
    assert reply.startswith("HTTP/1.1 413") and "--max-body-bytes" in reply and "1000000" in reply

    # no Content-Length (chunked): capped while it streams in
    def chunks():
        yield b'{"prompt": "'
        for _ in range(50):
            yield b"x" * 100_000
        yield b'"}'

    r = httpx.post(url, content=chunks(), headers={"content-type": "application/json"}, timeout=30)
    _error(r, 413, None, "more than 1000000 bytes")
    _still_serving(cli_server)


def test_body_and_header_timeouts(cli_server):
    proc, base = cli_server
    port = int(base.rsplit(":", 1)[1])
    # A server that never times the client out would leave recv waiting: the sockets' 10 s timeout (socket.timeout)
    # turns that hang into a failure. No wall-clock bounds beyond that.
    # a body 100 bytes shorter than its Content-Length: 408 after --body-timeout (1 s)
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        body = b'{"prompt": "hi"}'
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: " + str(len(body) + 100).encode() + b"\r\n\r\n" + body
        )
        reply = _read_all(s)
    assert reply.startswith("HTTP/1.1 408") and "--body-timeout" in reply
    # half-sent headers: still open a moment later (not closed before --header-timeout, 2 s), then closed by it
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        s.settimeout(0.5)
        with pytest.raises(socket.timeout):
            s.recv(65536)  # nothing sent back and not closed yet
        s.settimeout(10)
        assert s.recv(65536) == b""  # closed by the server
    # a connection that sends nothing: closed too
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        assert s.recv(65536) == b""
    _still_serving(cli_server)


def _trickle(port: int, head: bytes, pieces: list[bytes], every_s: float) -> str:
    """Send head, then a piece every every_s until the server answers; what it sends until it closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(head)
        for piece in pieces:
            if select.select([s], [], [], every_s)[0]:
                break
            s.sendall(piece)
        return _read_all(s)


SLOW = (
    r"the request body arrived too slowly: \d+{} bytes in {} s; a body must arrive within --body-timeout \(1 s\) "
    r"plus 1 s per 16384 bytes \(a minimum rate of 16 KiB/s\); send it faster"
)


def test_a_body_trickled_in_is_refused_below_the_minimum_rate(cli_server):
    """A byte every 0.3 s never leaves the --body-timeout (1 s) gap, but a body must arrive within 1 s plus 1 s per
    16 KiB (Content-Length's bytes, else those so far): 408 naming the rate, and the server still serves. A body
    sent in pieces at a client's pace is served."""
    proc, base = cli_server
    port = int(base.rsplit(":", 1)[1])
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    for framing, pieces, slow in (
        (b"Content-Length: 1000\r\n", [b" "] * 30, SLOW.format(" of 1000", "1.06")),
        (b"Transfer-Encoding: chunked\r\n", [b"1\r\n \r\n"] * 30, SLOW.format("", "1")),
    ):
        reply = _trickle(port, head + framing + b"\r\n", pieces, 0.3)
        assert reply.startswith("HTTP/1.1 408 "), reply
        err = json.loads(reply.split("\r\n\r\n", 1)[1])["error"]
        assert err["type"] == "RequestTimeoutError" and re.fullmatch(slow, err["message"]), err
        _still_serving(cli_server)
    body = b'{"prompt": "ok", "max_tokens": 2}'
    reply = _trickle(port, head + b"Content-Length: %d\r\n\r\n" % len(body), [body[:10], body[10:20], body[20:]], 0.2)
    assert reply.startswith("HTTP/1.1 200 ") and '"completion_tokens":2' in reply.replace(" ", ""), reply


def test_context_refusals_name_the_fields_sent(cli_server):
    """A prompt past the context: `messages` for a chat (it has no `prompt`), and the length field the client sent."""
    proc, base = cli_server
    chat = base + "/v1/chat/completions"
    msgs = [{"role": "user", "content": "hi"}]
    n = httpx.post(chat, json={"messages": msgs, "max_tokens": 1}, timeout=30).json()["usage"]["prompt_tokens"]
    for url, body, param, field in (
        (chat, {"messages": msgs, "max_completion_tokens": 5000}, "messages", "max_completion_tokens"),
        (chat, {"messages": msgs, "max_tokens": 5000, "stream": True}, "messages", "max_tokens"),
        (base + "/v1/completions", {"prompt": [5] * n, "max_tokens": 5000}, "prompt", "max_tokens"),
    ):
        r = httpx.post(url, json=body, timeout=30)
        _error(r, 400, param)
        assert r.json()["error"]["message"] == (
            f"the request needs up to {n + 5000} tokens of KV cache but the whole pool holds 4080; it could never "
            f"run. Reduce the {param} or {field}, or give the cache more memory"
        )
    _still_serving(cli_server)


def test_connection_limit(cli_server):
    """--max-connections 16: with 15 open, a 16th is served; with 16 open, a 17th gets OpenAI's 503 body, and the
    16 within the limit are still served (all within the 2 s header timeout that closes idle connections)."""
    proc, base = cli_server
    port = int(base.rsplit(":", 1)[1])
    socks = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(15)]
    try:
        time.sleep(0.2)
        assert httpx.get(base + "/health", timeout=10).status_code == 200  # the 16th
        socks.append(socket.create_connection(("127.0.0.1", port), timeout=10))
        time.sleep(0.2)
        _error(httpx.get(base + "/health", timeout=10), 503, None, "limit of 16 connections", "--max-connections")
        socks[0].sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")  # one within the limit
        assert socks[0].recv(65536).startswith(b"HTTP/1.1 200")
    finally:
        for s in socks:
            s.close()
    time.sleep(0.2)
    assert httpx.get(base + "/health", timeout=10).status_code == 200
    _still_serving(cli_server)


def test_openai_error_bodies_for_404_405_and_unknown_model(cli_server):
    proc, base = cli_server
    _error(httpx.get(base + "/v1/nothing"), 404, None, "/v1/nothing")
    assert httpx.get(base + "/v1/nothing").json()["error"]["type"] == "NotFoundError"
    _error(httpx.get(base + "/v1/completions"), 405, None, "GET")
    r = httpx.post(base + "/v1/completions", json={"model": "gpt-4", "prompt": "hi"})
    _error(r, 404, "model", "gpt-4", "tiny")
    assert r.json()["error"]["type"] == "NotFoundError"
    c = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=30)
    with pytest.raises(openai.NotFoundError):
        c.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "hi"}], max_tokens=2)


def test_tiny_temperature_is_greedy(cli_server):
    """temperature 1e-39 samples greedily (below 1e-5, vLLM's rule) instead of dividing the logits into NaN. The
    tiny preset's greedy token after this prompt is 370 (no text under the byte tokenizer): a stop id shows it."""
    proc, base = cli_server
    url = base + "/v1/completions"
    body = {"prompt": "Hello, my name is", "max_tokens": 12, "stop_token_ids": [370]}
    for temperature in (0, 1e-39, 1e-6):
        c = httpx.post(url, json={**body, "temperature": temperature}, timeout=30).json()["choices"][0]
        assert (c["finish_reason"], c["stop_reason"]) == ("stop", 370), (temperature, c)


def test_max_queued_requests_counts_only_what_waits():
    """--max-queued-requests 50, a burst of 100 on an idle server with 256 free slots: nothing waits, all 200."""
    llm = make_llm(max_num_seqs=256)
    r = start_server(llm, model_name="tiny", max_queued_requests=50)
    try:

        async def burst():
            async with httpx.AsyncClient(base_url=r.base_url, timeout=120) as h:
                body = {"prompt": "p", "max_tokens": 2, "ignore_eos": True}
                return await asyncio.gather(*[h.post("/v1/completions", json=body) for _ in range(100)])

        codes = [x.status_code for x in asyncio.run(burst())]
        assert codes == [200] * 100, codes
    finally:
        stop_server(r)
        llm.close()


def test_requests_that_no_idle_server_could_take_are_400_not_503():
    """--max-num-seqs 2, --max-queued-requests 2: of n = 5 choices an idle server runs 2 and 3 would wait, which the
    queue never holds: a 400 naming n (a 503 says retry, and the openai client retries it); n = 4 is served. Chat
    without max_tokens: a min_tokens beyond the context's room is refused as it is with an explicit max_tokens, not
    lowered to the room."""
    llm = make_llm(max_num_seqs=2)
    r = start_server(llm, model_name="tiny", max_queued_requests=2)
    try:
        body = {"prompt": "p", "max_tokens": 2, "ignore_eos": True}
        _error(
            httpx.post(r.base_url + "/v1/completions", json={**body, "n": 5}, timeout=60),
            400,
            "n",
            "n=5",
            "runs 2 of these choices at once",
            "use n <= 4",
        )
        ok = httpx.post(r.base_url + "/v1/completions", json={**body, "n": 4}, timeout=60)
        assert ok.status_code == 200 and len(ok.json()["choices"]) == 4
        chat = {"messages": [{"role": "user", "content": "hi"}], "min_tokens": 100_000}
        _error(
            httpx.post(r.base_url + "/v1/chat/completions", json=chat, timeout=60),
            400,
            "min_tokens",
            "min_tokens=100000",
            "use min_tokens <=",
        )
    finally:
        stop_server(r)
        llm.close()


@pytest.mark.parametrize("mode", ["--frontend-process", "--no-frontend-process"])
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_clean_shutdown_exits_0(mode, sig):
    proc, base = start_cli_server([*SERVE, mode], time.monotonic() + 120)
    try:
        assert httpx.post(base + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200
        proc.send_signal(sig)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_sse_chunks_are_json(cli_server):
    """max_tokens 3: four JSON chunks of one choice each (one per token, then the last saying "length"), then
    [DONE]; greedy, their text joined is the text of the same request unstreamed (U+FFFD: the tiny preset's
    greedy bytes end inside a character)."""
    proc, base = cli_server
    body = {"prompt": "hi", "max_tokens": 3, "temperature": 0}
    with httpx.stream("POST", base + "/v1/completions", json={**body, "stream": True}, timeout=30) as r:
        lines = [x for x in r.iter_lines() if x.startswith("data:")]
    assert len(lines) == 5 and lines[-1] == "data: [DONE]", lines
    chunks = [json.loads(x[5:]) for x in lines[:-1]]
    assert [len(ch["choices"]) for ch in chunks] == [1, 1, 1, 1], chunks
    assert [ch["choices"][0]["finish_reason"] for ch in chunks] == [None, None, None, "length"], chunks
    whole = httpx.post(base + "/v1/completions", json=body, timeout=30).json()["choices"][0]["text"]
    assert whole == "\ufffd" and "".join(ch["choices"][0]["text"] for ch in chunks) == whole, chunks


def test_engine_refusals_name_their_field(cli_server):
    """validate_request (the engine's one admission check) against the tiny preset's vocabulary of 512."""
    proc, base = cli_server
    url = base + "/v1/completions"
    _error(httpx.post(url, json={"prompt": [5, 512]}), 400, "prompt", "512", "[0, 512)")
    _error(httpx.post(url, json={"prompt": "hi", "stop_token_ids": [600]}), 400, "stop_token_ids", "[0, 512)")
    _error(httpx.post(url, json={"prompt": "hi", "logit_bias": {"600": 1}}), 400, "logit_bias", "[0, 512)")
    _error(httpx.post(url, json={"prompt": "hi", "max_tokens": 5000}), 400, "prompt", "the whole pool holds 4080")
    _still_serving(cli_server)
