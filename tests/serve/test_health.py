"""`--health-port`: /health from a process of its own, reading the engine's and the front end's heartbeats.

The verdict over plain snapshots; the health process beside an in-process server whose engine step is made to
hang (503 naming the engine loop, then 200 again once it moves) or whose event loop is blocked by a handler (503
naming the front end, answered while the loop is still blocked); `spanllm serve --health-port` as a user runs
it, ended by SIGTERM (exit 0, no process left behind, the heartbeats' file removed); its flags refused with one
line before any engine is built."""

from __future__ import annotations

import os
import socket
import threading
import time

import httpx
import pytest
from serve_helpers import descendants, make_llm, sigterm_and_check, start_cli_server, start_server, stop_server

from spanllm.cli import main
from spanllm.serve import health
from spanllm.serve.health import HealthProcess, Heartbeats, Snapshot, verdict


def snap(
    engine_beat=100.0, frontend_beat=100.0, engine=health.ENGINE_RUNNING, frontend=health.FRONTEND_SERVING, msg=""
):
    return Snapshot(engine_beat, frontend_beat, engine, frontend, msg)


def test_verdict_fresh_heartbeats_is_200():
    status, body = verdict(snap(), now=101.0, stall_timeout_s=30)
    assert status == 200 and body == {"status": "ok", "engine_heartbeat_age_s": 1.0, "frontend_heartbeat_age_s": 1.0}


@pytest.mark.parametrize(
    "s,words",
    [
        (snap(engine_beat=60.0), "the engine loop has not completed a pass for 41.0 s (--health-stall-timeout 30 s)"),
        (snap(frontend_beat=60.0), "the HTTP front end's event loop has not run for 41.0 s"),
        (snap(engine=health.ENGINE_FAILED, msg="the engine loop failed: OSError: x"), "OSError: x"),
        (snap(engine=health.ENGINE_STOPPED), "shutting down"),
        (snap(frontend=health.FRONTEND_STOPPING), "shutting down"),
        (snap(engine_beat=0.0, engine=health.ENGINE_STARTING), "the engine loop has not started"),
        (snap(frontend_beat=0.0, frontend=health.FRONTEND_STARTING), "the HTTP front end has not started"),
    ],
    ids=[
        "engine stale",
        "frontend stale",
        "engine failed",
        "engine stopped",
        "frontend stopping",
        "no engine",
        "no frontend",
    ],
)
def test_verdict_503_names_the_reason(s, words):
    status, body = verdict(s, now=101.0, stall_timeout_s=30)
    assert status == 503 and words in body["error"]["message"], body
    assert body["error"]["type"] == "ServiceUnavailableError" and body["error"]["code"] == 503


def test_heartbeats_shared_between_two_mappings():
    beats = Heartbeats.create()
    other = Heartbeats.attach(beats.path)
    try:
        assert other.read() == Snapshot(0.0, 0.0, health.ENGINE_STARTING, health.FRONTEND_STARTING, "")
        t0 = time.monotonic()
        beats.beat_engine()
        t1 = time.monotonic()
        beats.set_engine(health.ENGINE_FAILED, "é" * 1000)  # longer than the struct holds: cut, still UTF-8
        s = other.read()
        assert t0 <= s.engine_beat <= t1 and s.frontend_beat == 0.0, s
        assert s.engine_state == health.ENGINE_FAILED
        assert s.message and set(s.message) <= {"é", "\ufffd"}
    finally:
        other.close()
        beats.close()
    assert not os.path.exists(beats.path)


@pytest.fixture(scope="module")
def llm():
    llm = make_llm()
    yield llm
    llm.close()


def test_engine_stall_answers_503_naming_the_engine_then_200(llm):
    """The engine's step hangs (a stuck device, say): the health port answers 503 naming the engine loop within
    the stall timeout, while the main port's front end (its own heartbeat fresh) still answers; 200 once the
    step returns."""
    beats = Heartbeats.create()
    proc = HealthProcess(beats, host="127.0.0.1", port=0, stall_timeout_s=0.5)
    r = start_server(llm, model_name="tiny", heartbeats=beats)
    core = llm.engine_core
    real_step, gate = core.step, threading.Event()

    def stuck_step():
        gate.wait(60)
        return real_step()

    try:
        url = f"http://127.0.0.1:{proc.start()}/health"
        deadline = time.monotonic() + 10
        while httpx.get(url, timeout=5).status_code != 200:  # the first heartbeats
            assert time.monotonic() < deadline, httpx.get(url).text
            time.sleep(0.05)
        assert httpx.get(url, timeout=5).json()["status"] == "ok"
        core.step = stuck_step
        answer: list = []
        t = threading.Thread(
            target=lambda: answer.append(
                httpx.post(r.base_url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60)
            )
        )
        t.start()
        time.sleep(1.5)
        h = httpx.get(url, timeout=5)
        assert h.status_code == 503, h.text
        msg = h.json()["error"]["message"]
        assert "the engine loop has not completed a pass" in msg and "--health-stall-timeout 0.5 s" in msg, msg
        assert httpx.get(r.base_url + "/health", timeout=5).status_code == 200  # the thread is alive, just stuck
        gate.set()
        t.join(30)
        assert answer and answer[0].status_code == 200, answer
        assert httpx.get(url, timeout=5).status_code == 200
    finally:
        gate.set()
        core.step = real_step
        stop_server(r)
        time.sleep(0.1)
        h = httpx.get(url, timeout=5)
        proc.close()
        beats.close()
    assert h.status_code == 503 and "shutting down" in h.json()["error"]["message"], h.text


def test_frontend_stall_answers_503_naming_the_front_end_while_it_is_blocked(llm, monkeypatch):
    """A handler that blocks the front end's event loop (here: the seed of one marked request is computed on the
    loop and waits for the test to release it): the main port cannot answer meanwhile; the health port answers
    while the loop is still blocked, 503 naming the front end's event loop, and 200 once it is released."""
    from spanllm.serve import api

    beats = Heartbeats.create()
    proc = HealthProcess(beats, host="127.0.0.1", port=0, stall_timeout_s=0.5)
    r = start_server(llm, model_name="tiny", heartbeats=beats)
    real_seed = api.seed_for_sample
    entered, gate = threading.Event(), threading.Event()

    def slow_seed(seed, i):
        if seed == 424242:
            entered.set()
            gate.wait(30)
        return real_seed(seed, i)

    try:
        url = f"http://127.0.0.1:{proc.start()}/health"
        deadline = time.monotonic() + 10
        while httpx.get(url, timeout=5).status_code != 200:
            assert time.monotonic() < deadline, httpx.get(url).text
            time.sleep(0.05)
        monkeypatch.setattr(api, "seed_for_sample", slow_seed)
        answer: list = []
        body = {"prompt": "block the event loop", "max_tokens": 2, "n": 2, "seed": 424242}
        t = threading.Thread(
            target=lambda: answer.append(httpx.post(r.base_url + "/v1/completions", json=body, timeout=60))
        )
        t.start()
        assert entered.wait(30), "the marked request's seed was never computed"
        deadline = time.monotonic() + 20  # the front end's heartbeat goes stale after the 0.5 s stall timeout
        while (h := httpx.get(url, timeout=5)).status_code == 200:
            assert time.monotonic() < deadline, h.text
            time.sleep(0.05)
        assert h.status_code == 503, h.text
        assert "the HTTP front end's event loop has not run" in h.json()["error"]["message"], h.text
        assert not gate.is_set() and t.is_alive() and not answer, "the event loop was released before /health"
        gate.set()
        t.join(30)
        assert not t.is_alive() and answer and answer[0].status_code == 200, answer
        assert httpx.get(url, timeout=5).status_code == 200
    finally:
        gate.set()
        stop_server(r)
        proc.close()
        beats.close()


def test_tokenizing_a_long_prompt_blocks_no_one(llm):
    """Tokenizing runs in a worker thread: while one prompt's tokenizing is held (it waits for the test to
    release it), the main port answers /health and a second request completes."""
    r = start_server(llm, model_name="tiny")
    tok = llm.get_tokenizer()
    real_encode = tok.encode
    entered, gate = threading.Event(), threading.Event()

    def slow_encode(text, *a, **kw):
        if text == "tokenize me slowly":
            entered.set()
            gate.wait(30)
        return real_encode(text, *a, **kw)

    tok.encode = slow_encode
    try:
        answer: list = []
        body = {"prompt": "tokenize me slowly", "max_tokens": 2}
        t = threading.Thread(
            target=lambda: answer.append(httpx.post(r.base_url + "/v1/completions", json=body, timeout=60))
        )
        t.start()
        assert entered.wait(30), "the slow prompt was never tokenized"
        assert httpx.get(r.base_url + "/health", timeout=5).status_code == 200
        other = httpx.post(r.base_url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
        assert other.status_code == 200, other.text
        assert not gate.is_set() and t.is_alive() and not answer, "the slow request was released first"
        gate.set()
        t.join(30)
        assert not t.is_alive() and answer and answer[0].status_code == 200, answer
    finally:
        gate.set()
        tok.encode = real_encode
        stop_server(r)


def test_a_text_longer_than_any_context_is_refused_untokenized(llm):
    """A text of more than TEXT_MARGIN x max_token_chars x context characters cannot fit: refused with a 400 naming
    the numbers, without tokenizing it (the tokenizer would raise here); one character less is tokenized."""
    from spanllm.serve.api import TEXT_MARGIN

    r = start_server(llm, model_name="tiny")
    tok = llm.get_tokenizer()
    real_encode = tok.encode
    calls: list[int] = []

    def counting_encode(text, *a, **kw):
        calls.append(len(text))
        return real_encode(text, *a, **kw)

    tok.encode = counting_encode
    try:
        ctx = min(llm.engine_core.config.max_model_len, r.server.engine.capacity_tokens)
        limit = TEXT_MARGIN * tok.max_token_chars * ctx
        big = httpx.post(r.base_url + "/v1/completions", json={"prompt": "a" * (limit + 1)}, timeout=30)
        assert big.status_code == 400 and big.json()["error"]["param"] == "prompt", big.text
        assert f"{limit + 1} characters" in big.json()["error"]["message"] and not calls
        chat = {"messages": [{"role": "user", "content": "a" * (limit + 1)}]}
        big = httpx.post(r.base_url + "/v1/chat/completions", json=chat, timeout=30)
        assert big.status_code == 400 and big.json()["error"]["param"] == "messages", big.text
        fits = httpx.post(r.base_url + "/v1/completions", json={"prompt": "a" * limit}, timeout=30)
        assert fits.status_code == 400 and "the whole pool holds 4080" in fits.json()["error"]["message"], fits.text
        assert calls == [limit]  # tokenized, then refused by the engine's length check
    finally:
        tok.encode = real_encode
        stop_server(r)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _head_is_get_without_body(base: str, health_base: str) -> None:
    """A load balancer's HEAD probe of each GET route (the main port's and the health port's /health): GET's status
    and headers, no body (content-length is GET's where the body's length cannot change between the two)."""
    for url, status, same_length in (
        (base + "/health", 200, True),
        (base + "/v1/models", 200, True),
        (base + "/v1/models/tiny", 200, True),
        (base + "/v1/models/other", 404, True),
        (base + "/metrics", 200, False),
        (health_base + "/health", 200, False),
        (health_base + "/nothing", 404, True),
    ):
        get, head = httpx.get(url, timeout=5), httpx.head(url, timeout=5)
        assert (get.status_code, head.status_code, head.content) == (status, status, b""), url
        assert head.headers.get("content-type") == get.headers.get("content-type"), url
        if same_length:
            assert head.headers["content-length"] == get.headers["content-length"] == str(len(get.content)), url
        else:
            assert int(head.headers["content-length"]) > 0, url
    head = httpx.head(base + "/v1/completions", timeout=5)
    assert (head.status_code, head.content) == (405, b"")


@pytest.mark.parametrize("frontend", ["--frontend-process", "--no-frontend-process"])
def test_cli_health_port_answers_and_exits_with_the_server(frontend):
    hport = _free_port()
    proc, base = start_cli_server(
        ["tiny", "--dtype", "float32", "--port", "0", "--health-port", str(hport), "--no-warmup", frontend],
        time.monotonic() + 120,
    )
    try:
        h = httpx.get(f"http://127.0.0.1:{hport}/health", timeout=5)
        assert h.status_code == 200 and h.json()["status"] == "ok", h.text
        assert httpx.get(base + "/health", timeout=5).status_code == 200  # the main port's, as before
        nope = httpx.get(f"http://127.0.0.1:{hport}/v1/models", timeout=5)
        assert nope.status_code == 404 and nope.json()["error"]["type"] == "NotFoundError", nope.text
        _head_is_get_without_body(base, f"http://127.0.0.1:{hport}")
        below = descendants(proc.pid)
        cmdlines = {p: open(f"/proc/{p}/cmdline", "rb").read().split(b"\0") for p in below}
        (health_pid,) = [p for p, c in cmdlines.items() if b"spanllm.commands.serve_health" in c]
        state = cmdlines[health_pid][cmdlines[health_pid].index(b"--state") + 1].decode()
        assert os.path.exists(state)
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    sigterm_and_check(proc, below, "the server", "a process of the server outlived it (the health process?)")
    assert proc.returncode == 0
    assert not os.path.exists(state), "the heartbeats' file was left in /dev/shm"


BAD = [
    (["--health-port", "70000"], "--health-port 70000: give a TCP port in [0, 65535]"),
    (["--health-port", "-1"], "--health-port -1: give a TCP port in [0, 65535]"),
    (["--port", "8123", "--health-port", "8123"], "--health-port 8123: the same port as --port"),
    (["--health-port", "0", "--health-stall-timeout", "-1"], "--health-stall-timeout -1.0: give seconds in (0, 3600]"),
    (["--health-port", "0", "--health-stall-timeout", "nan"], "--health-stall-timeout nan: give seconds in (0, 3600]"),
    (["--health-stall-timeout", "5"], "--health-stall-timeout: applies to --health-port only"),
]


@pytest.mark.parametrize("argv,words", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_health_flags_are_one_line(argv, words, capsys):
    assert main(["serve", "--model", "tiny", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("spanllm: error: ") and words in err[0], err


def test_health_port_in_use_is_one_line_before_the_engine(capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert main(["serve", "--model", "tiny", "--port", "0", "--health-port", str(port)]) == 2
    err = capsys.readouterr()
    assert f"spanllm: error: --health-port {port}: 127.0.0.1:{port} is already in use" in err.err
    assert "building the engine" not in err.out + err.err


def test_health_process_that_cannot_bind_says_why():
    beats = Heartbeats.create()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        proc = HealthProcess(beats, host="127.0.0.1", port=s.getsockname()[1], stall_timeout_s=1)
        with pytest.raises(RuntimeError, match="the health process did not start: error: cannot bind"):
            proc.start()
    beats.close()
    assert proc.pid is None  # ended
