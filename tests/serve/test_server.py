"""`spanllm serve` (TP=1, in a thread): the openai client, greedy text vs LLM.generate, 200 requests at rate
inf with /metrics counts, bad requests, a full queue, a client disconnect."""

from __future__ import annotations

import asyncio
import json
import math
import time

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")  # the official client (a test extra); absent on the GPU machine

from serve_helpers import make_llm, start_server, stop_server  # noqa: E402

from spanllm.engine.sampler import SamplingParams  # noqa: E402

PROMPTS = ["Hello, my name is", "The capital of France is", "abc"]


@pytest.fixture(scope="module")
def offline():
    """Greedy outputs of the offline engine (same preset, same seed: the same weights)."""
    llm = make_llm()
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0.0))
    chat = llm.generate(
        [llm.get_tokenizer().apply_chat_template([{"role": "user", "content": "hi"}])],
        SamplingParams(max_tokens=10, temperature=0.0),
    )
    llm.close()
    # per prompt: (finish_reason, completion tokens, prompt tokens)
    counts = [(o.finish_reason, len(o.output_ids), len(o.prompt_ids)) for o in outs]
    return [o.text for o in outs], chat[0].text, counts


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0, timeout=30)


def test_models_health(server):
    c = client(server)
    assert c.models.list().data[0].id == "tiny"
    assert c.models.retrieve("tiny").id == "tiny"  # OpenAI's retrieve-model route
    with pytest.raises(openai.NotFoundError, match="The model `gpt-4` does not exist"):
        c.models.retrieve("gpt-4")
    assert httpx.get(server.base_url + "/health").status_code == 200


def test_completions_match_offline(server, offline):
    texts, _, counts = offline
    c = client(server)
    for p, want, (reason, n_out, n_prompt) in zip(PROMPTS, texts, counts, strict=True):
        r = c.completions.create(model="tiny", prompt=p, max_tokens=12, temperature=0)
        assert r.choices[0].text == want
        assert r.choices[0].finish_reason == reason
        assert (r.usage.completion_tokens, r.usage.prompt_tokens) == (n_out, n_prompt), r.usage
        assert r.usage.total_tokens == n_prompt + n_out
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
        assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == want
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == r.usage.completion_tokens


def test_token_id_prompt(server, offline):
    texts, _, _ = offline
    from spanllm.engine.tokenizer import ByteTokenizer

    ids = ByteTokenizer().encode(PROMPTS[0])
    r = httpx.post(server.base_url + "/v1/completions", json={"prompt": [ids], "max_tokens": 12, "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == texts[0]


def test_chat_match_offline(server, offline):
    _, want, _ = offline
    c = client(server)
    msgs = [{"role": "user", "content": "hi"}]
    r = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=10, temperature=0)
    assert r.choices[0].message.content == want and r.choices[0].message.role == "assistant"
    chunks = list(
        c.chat.completions.create(
            model="tiny",
            messages=msgs,
            max_tokens=10,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == want
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens


def test_stop_and_sampling_params(server):
    c = client(server)
    r = c.completions.create(
        model="tiny",
        prompt="abc",
        max_tokens=8,
        temperature=0.8,
        top_p=0.9,
        seed=3,
        extra_body={"top_k": 20, "min_tokens": 8, "ignore_eos": True},
    )
    assert r.usage.completion_tokens == 8
    r2 = c.completions.create(
        model="tiny",
        prompt="abc",
        max_tokens=8,
        temperature=0.8,
        top_p=0.9,
        seed=3,
        extra_body={"top_k": 20, "min_tokens": 8, "ignore_eos": True},
    )
    assert r2.choices[0].text == r.choices[0].text  # seeded
    # The same seeded request offline (same weights: make_llm is deterministic) gives the same text, and a
    # different seed other tokens: the sampling parameters reached the sampler.
    offline = make_llm()
    params = dict(temperature=0.8, top_p=0.9, top_k=20, min_tokens=8, ignore_eos=True, max_tokens=8)
    out3, out4 = (offline.generate(["abc"], SamplingParams(seed=k, **params))[0] for k in (3, 4))
    assert out3.text == r.choices[0].text and out3.output_ids != out4.output_ids


@pytest.mark.parametrize(
    "body,param",
    [
        ({"prompt": "hi", "max_tokens": -1}, "max_tokens"),
        ({"prompt": "hi", "temperature": 5}, "temperature"),
        ({"prompt": "hi", "top_p": 0}, "top_p"),
        ({"prompt": "hi", "n": 0}, "n"),
        ({"prompt": "hi", "max_tokens": 5000}, "prompt"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": [99999]}, "prompt"),
        ({"messages": "nope"}, "messages"),
    ],
)
def test_bad_requests(server, body, param):
    url = server.base_url + ("/v1/chat/completions" if "messages" in body else "/v1/completions")
    r = httpx.post(url, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "BadRequestError" and err["code"] == 400 and err["param"] == param and err["message"]
    if body.get("max_tokens") == 5000:
        assert "the whole pool holds 4080" in err["message"] and "5003" in err["message"]  # the pool: the tighter limit
    # and the server keeps serving
    assert httpx.post(server.base_url + "/v1/completions", json={"prompt": "ok", "max_tokens": 2}).status_code == 200


def test_malformed_json(server):
    r = httpx.post(
        server.base_url + "/v1/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert r.status_code == 400 and r.json()["error"]["type"] == "BadRequestError"
    with pytest.raises(openai.BadRequestError):
        client(server).completions.create(model="tiny", prompt="x", max_tokens=0)


def _wait_idle(server, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.metric("spanllm:num_requests_running") == 0 and server.metric("spanllm:kv_cache_usage_perc") == 0:
            return True
        time.sleep(0.05)
    return False


def test_disconnect_frees_blocks(server):
    aborted0 = server.metric("spanllm:request_success_total", finished_reason="abort")
    body = {"prompt": "x" * 40, "max_tokens": 3000, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=30) as h:
        with h.stream("POST", server.base_url + "/v1/completions", json=body) as r:
            lines = r.iter_lines()  # kept referenced: a closed iterator closes the response
            next(line for line in lines if line.startswith("data:"))
            assert server.metric("spanllm:num_requests_running") == 1
            assert server.metric("spanllm:kv_cache_usage_perc") > 0
    assert _wait_idle(server)
    assert server.metric("spanllm:request_success_total", finished_reason="abort") == aborted0 + 1
    # non-streaming: the client times out and leaves
    with pytest.raises(httpx.TimeoutException):
        httpx.post(server.base_url + "/v1/completions", json={**body, "stream": False}, timeout=1.0)
    assert _wait_idle(server)
    assert server.metric("spanllm:request_success_total", finished_reason="abort") == aborted0 + 2


def test_200_requests_rate_inf_and_metrics(server):
    from spanllm.bench.datasets import sample_random
    from spanllm.commands.bench_serve import ServeBenchConfig, run_benchmark
    from spanllm.engine.tokenizer import ByteTokenizer

    assert _wait_idle(server)
    gen0 = server.metric("spanllm:generation_tokens_total")
    ok0 = server.metric("spanllm:request_success_total")
    ttft0 = server.metric("spanllm:time_to_first_token_seconds_count")
    samples = sample_random(ByteTokenizer(), 200, input_len=16, output_len=8)
    res = run_benchmark(
        samples, ServeBenchConfig(base_url=server.base_url, request_rate=math.inf, ignore_eos=True, show_progress=False)
    )
    assert res["completed"] == 200 and res["failed"] == 0, [e for e in res["errors"] if e][:3]
    assert sum(res["output_lens"]) == 200 * 8
    assert _wait_idle(server)
    assert server.metric("spanllm:generation_tokens_total") - gen0 == 200 * 8
    assert server.metric("spanllm:request_success_total") - ok0 == 200
    assert server.metric("spanllm:time_to_first_token_seconds_count") - ttft0 == 200
    assert server.metric("spanllm:num_requests_waiting") == 0


def test_queue_full_503_nothing_admitted_lost():
    llm = make_llm(max_num_seqs=1)
    r = start_server(llm, model_name="tiny", max_queued_requests=2)
    try:

        async def go():
            async with httpx.AsyncClient(base_url=r.base_url, timeout=60) as h:
                return await asyncio.gather(
                    *[
                        h.post("/v1/completions", json={"prompt": f"p{i}", "max_tokens": 16, "ignore_eos": True})
                        for i in range(12)
                    ]
                )

        resps = asyncio.run(go())
        codes = [x.status_code for x in resps]
        assert set(codes) <= {200, 503} and 503 in codes and 200 in codes, codes
        for x in resps:
            if x.status_code == 200:
                assert x.json()["usage"]["completion_tokens"] == 16
            else:
                assert x.json()["error"]["code"] == 503
        assert r.metric("spanllm:request_success_total", finished_reason="length") == codes.count(200)
        assert httpx.post(r.base_url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200
    finally:
        stop_server(r)
        llm.close()


def test_shutdown_aborts_open_streams():
    llm = make_llm()
    r = start_server(llm, model_name="tiny")
    try:
        with httpx.Client(timeout=30) as h:
            with h.stream(
                "POST",
                r.base_url + "/v1/completions",
                json={"prompt": "x", "max_tokens": 3000, "ignore_eos": True, "stream": True},
            ) as resp:
                lines = resp.iter_lines()
                next(line for line in lines if line.startswith("data:"))
                r.server.stop()
                rest = [line for line in lines if line.startswith("data:")]
        assert rest[-1] == "data: [DONE]"
        assert json.loads(rest[-2][5:])["choices"][0]["finish_reason"] == "abort"
        r.thread.join(10)
        assert not r.thread.is_alive(), "the server thread did not stop within 10 s"
    finally:
        stop_server(r)
        llm.close()


def test_async_scheduling_serves_the_same_text(offline):
    """The engine loop with async scheduling (the default on a GPU; forced on here): the same text, streamed or
    not, and /metrics counts every finished request."""
    texts, _, _ = offline
    running = start_server(make_llm(async_scheduling=True))
    try:
        assert running.server.engine.core.async_scheduling
        c = client(running)
        for p, want in zip(PROMPTS, texts):
            assert c.completions.create(model="tiny", prompt=p, max_tokens=12, temperature=0).choices[0].text == want
            chunks = list(c.completions.create(model="tiny", prompt=p, max_tokens=12, temperature=0, stream=True))
            assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == want
        assert running.metric("spanllm:request_success_total") == 2 * len(PROMPTS)
    finally:
        stop_server(running)


def test_the_warm_up_runs_on_the_engine_thread_before_the_port_opens(caplog):
    """Server(warm_up=...): the warm-up runs on the engine thread (torch keeps cuDNN's attention plans per thread),
    the port opens only after it, and its requests and tokens are not the server's (metrics, shutdown line)."""
    import threading
    import urllib.request

    from spanllm.engine.warmup import warm_up
    from spanllm.serve.server import Server

    llm = make_llm()
    seen = {}

    def warm():
        seen["thread"] = threading.current_thread().name
        seen["listening_during"] = server.started
        seen["result"] = warm_up(llm)

    server = Server(llm, host="127.0.0.1", port=0, warm_up=warm)
    t = threading.Thread(target=server.run, daemon=True)
    with caplog.at_level("INFO", logger="spanllm.serve"):
        t.start()
        deadline = time.monotonic() + 30
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.02)
        assert seen["thread"] == "spanllm-engine" and seen["listening_during"] is False
        base = f"http://127.0.0.1:{server.port}"
        metrics = urllib.request.urlopen(f"{base}/metrics", timeout=10).read().decode()
        assert 'spanllm:prompt_tokens_total{model_name="tiny"} 0.0' in metrics  # the warm-up's 8 tokens left out
        body = json.dumps({"prompt": "hi", "max_tokens": 2}).encode()
        req = urllib.request.Request(f"{base}/v1/completions", body, {"content-type": "application/json"})
        assert json.loads(urllib.request.urlopen(req, timeout=30).read())["usage"]["completion_tokens"] == 2
        server.stop()
        t.join(15)
    assert "stopped after 1 requests (length 1)" in caplog.text  # the warm-up's request is not counted


def test_a_failed_warm_up_stops_the_server_before_its_port_opens():
    from spanllm.serve.server import Server

    def warm():
        raise RuntimeError("no room for the warm-up prompt")

    server = Server(make_llm(), host="127.0.0.1", port=0, warm_up=warm)
    with pytest.raises(RuntimeError, match="the engine loop failed: RuntimeError: no room for the warm-up prompt"):
        server.run()
    assert not server.started
