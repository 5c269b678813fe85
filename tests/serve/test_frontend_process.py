"""`spanllm serve --frontend-process` (TP=1, CPU, a subprocess): the HTTP front end in its own process gives the
offline engine's greedy text (streamed and not), refuses bad requests and keeps serving, counts what it served
in /metrics, frees a disconnected client's blocks, and stops with its front-end process on SIGTERM."""

from __future__ import annotations

import time

import pytest
from serve_helpers import children, make_llm, metric_of, sigterm_and_check, start_cli_server

from spanllm.engine.sampler import SamplingParams

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")  # the official client (a test extra); absent on the GPU machine

PROMPTS = ["Hello, my name is", "The capital of France is", "abc"]


def test_frontend_process_serves_the_engines_text_and_stops():
    llm = make_llm()
    want = [o.text for o in llm.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0.0))]
    llm.close()
    proc, base = start_cli_server(
        [
            "--model",
            "tiny",
            "--dtype",
            "float32",
            "--num-kv-blocks",
            "256",
            "--port",
            "0",
            "--no-warmup",
            "--frontend-process",
        ],
        time.monotonic() + 120,
    )
    try:
        frontends = children(proc.pid)
        assert frontends, "no front-end process under the server"
        c = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=60)
        done_tokens = 0
        for p, w in zip(PROMPTS, want):
            r = c.completions.create(model="tiny", prompt=p, max_tokens=12, temperature=0)
            assert r.choices[0].text == w and r.choices[0].finish_reason == "length"
            done_tokens += r.usage.completion_tokens
            chunks = list(
                c.completions.create(
                    model="tiny",
                    prompt=p,
                    max_tokens=12,
                    temperature=0,
                    stream=True,
                    stream_options={"include_usage": True},
                )
            )
            assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == w
            assert chunks[-1].usage.completion_tokens == 12
            done_tokens += 12
        chat = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
        assert chat.usage.completion_tokens == 4
        done_tokens += 4
        # Bad requests: refused in the front end, named, and the server goes on.
        bad = httpx.post(base + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": -1}, timeout=10)
        assert bad.status_code == 400 and "max_tokens" in bad.json()["error"]["message"]
        long = httpx.post(
            base + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 10_000}, timeout=10
        )
        assert long.status_code == 400 and "the whole pool holds 4080" in long.json()["error"]["message"]
        # /metrics counts exactly what was served (7 requests, their tokens), nothing running.
        assert metric_of(base, "spanllm:request_success_total", finished_reason="length") == 2 * len(PROMPTS) + 1
        assert metric_of(base, "spanllm:generation_tokens_total") == done_tokens
        # A client that goes away mid-stream: its request is aborted and its blocks are freed.
        with httpx.stream(
            "POST",
            base + "/v1/completions",
            timeout=30,
            json={"model": "tiny", "prompt": "abc", "max_tokens": 2000, "temperature": 0, "stream": True},
        ) as s:
            for n, _ in enumerate(s.iter_lines()):
                if n >= 3:
                    break
        deadline = time.monotonic() + 30
        while metric_of(base, "spanllm:request_success_total", finished_reason="abort") < 1:
            assert time.monotonic() < deadline, "the disconnected stream was not aborted"
            time.sleep(0.1)
        assert metric_of(base, "spanllm:num_requests_running") == 0
        assert metric_of(base, "spanllm:kv_cache_usage_perc") == 0.0
        assert (
            c.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=12, temperature=0).choices[0].text
            == want[0]
        )
        sigterm_and_check(proc, frontends, "the server", "the front-end process outlived the server")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_engine_side_refuses_adds_after_abort_all():
    """Shutdown (abort_all) then a request still in the pipe: it ends at once as aborted, nothing runs."""
    import multiprocessing as mp

    from spanllm.serve.frontend_process import PipeEngine

    llm = make_llm()
    mine, theirs = mp.Pipe(duplex=True)
    engine = PipeEngine(llm.engine_core, mine)
    engine.start()
    try:
        engine.abort_all()
        theirs.send(("add", "r1", [5, 6, 7], SamplingParams(max_tokens=200, ignore_eos=True), time.monotonic()))
        got, deadline = [], time.monotonic() + 10
        while not any(getattr(ev, "finished", False) for _, ev in got):
            assert time.monotonic() < deadline, f"no answer to the late request: {got}"
            if theirs.poll(0.1):
                msg = theirs.recv()
                if msg[0] == "events":
                    got += msg[1]
        ((rid, ev),) = got
        assert rid == "r1" and ev.finish_reason == "abort" and ev.num_output == 0
        assert llm.engine_core.stats.generation_tokens == 0
    finally:
        theirs.send(("exit",))
        engine.stop()
        llm.close()
