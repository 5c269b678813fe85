"""Failure isolation: an exception while handling one request's data (its sampling parameters, its
detokenization) ends that request with an error and the engine serves the others with their exact greedy text;
a failure of the step itself stops the engine, every open request is answered and the server stops with the
reason. Faults are injected by patching the engine's objects for one marked request."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from serve_helpers import make_llm, start_server, stop_server

from spanllm.engine.sampler import SamplingParams

PROMPTS = ["Hello, my name is", "The capital of France is"]


def _run_all(core, reqs):
    """Step the engine until every request ended; request id -> its last RequestOutput."""
    for rid, ids, params in reqs:
        core.add_request(ids, params, request_id=rid, with_text=True)
    last = {}
    for _ in range(200):
        if not core.has_unfinished():
            break
        for out in core.step():
            last[out.request_id] = out
    assert not core.has_unfinished()
    return last


@pytest.fixture(scope="module")
def llm():
    llm = make_llm()
    yield llm
    llm.close()


@pytest.fixture(scope="module")
def greedy(llm):
    return [o.text for o in llm.generate(PROMPTS, SamplingParams(max_tokens=8))]


def test_detokenizer_fault_ends_only_its_request(llm, greedy):
    core = llm.engine_core
    tok = llm.get_tokenizer()
    real = core.tokenizer.detokenizer

    class Broken:
        def push(self, token_id):
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")

    core.tokenizer.detokenizer = lambda ids: Broken() if ids == tok.encode("poison") else real(ids)
    try:
        ids = [tok.encode(p) for p in PROMPTS]
        last = _run_all(
            core,
            [
                ("a", ids[0], SamplingParams(max_tokens=8)),
                ("bad", tok.encode("poison"), SamplingParams(max_tokens=8)),
                ("b", ids[1], SamplingParams(max_tokens=8)),
            ],
        )
    finally:
        core.tokenizer.detokenizer = real
    assert last["bad"].finished and last["bad"].finish_reason == "error"
    assert "UnicodeDecodeError" in last["bad"].error and "injected" in last["bad"].error
    assert [last["a"].text, last["b"].text] == greedy and last["a"].error is None
    assert core.blocks.usage == 0  # the failed request's blocks were freed


def test_sampling_fault_ends_only_its_request(llm, greedy):
    """A row whose parameters make the batched sampler raise: found by sampling each row alone, ended; the
    others sample in the same step."""
    core = llm.engine_core
    tok = llm.get_tokenizer()
    real = core.sampler.sample

    def sample(logits, params, masks, gens, requests=None):
        if any(p.min_p == 0.5 for p in params):
            raise OverflowError("injected: this row's parameters")
        return real(logits, params, masks, gens, requests)

    core.sampler.sample = sample
    try:
        ids = [tok.encode(p) for p in PROMPTS]
        last = _run_all(
            core,
            [
                ("a", ids[0], SamplingParams(max_tokens=8)),
                ("bad", tok.encode("poison"), SamplingParams(max_tokens=8, min_p=0.5)),
                ("b", ids[1], SamplingParams(max_tokens=8)),
            ],
        )
    finally:
        core.sampler.sample = real
    assert last["bad"].finish_reason == "error" and "OverflowError: injected" in last["bad"].error
    assert last["bad"].output_ids == []
    assert [last["a"].text, last["b"].text] == greedy
    assert core.blocks.usage == 0


def test_generator_fault_ends_only_its_request(llm, greedy):
    """A seed that torch refuses (past the API's range check, as a direct engine user could pass one)."""
    core = llm.engine_core
    tok = llm.get_tokenizer()
    bad = SamplingParams(max_tokens=8, temperature=0.5, seed=1)
    object.__setattr__(bad, "seed", 2**70)  # past SamplingParams' own check: manual_seed raises
    ids = [tok.encode(p) for p in PROMPTS]
    last = _run_all(
        core,
        [
            ("a", ids[0], SamplingParams(max_tokens=8)),
            ("bad", ids[0], bad),
            ("b", ids[1], SamplingParams(max_tokens=8)),
        ],
    )
    assert last["bad"].finish_reason == "error" and "Overflow when unpacking long long" in last["bad"].error
    assert last["bad"].output_ids == []
    assert [last["a"].text, last["b"].text] == greedy
    assert core.blocks.usage == 0  # the failed request's blocks were freed with the others'


def test_server_answers_the_failed_request_500_and_serves_the_others(greedy):
    llm = make_llm()
    core = llm.engine_core
    tok = llm.get_tokenizer()
    real = core.tokenizer.detokenizer

    class Broken:
        def push(self, token_id):
            raise RuntimeError("injected detokenizer fault")

    core.tokenizer.detokenizer = lambda ids: Broken() if ids == tok.encode("poison") else real(ids)
    r = start_server(llm, model_name="tiny")
    try:
        url = r.base_url + "/v1/completions"
        bad = httpx.post(url, json={"prompt": "poison", "max_tokens": 8}, timeout=30)
        assert bad.status_code == 500
        err = bad.json()["error"]
        assert err["type"] == "InternalServerError" and "injected detokenizer fault" in err["message"]
        with httpx.Client(timeout=30) as h, h.stream("POST", url, json={"prompt": "poison", "stream": True}) as s:
            events = [line for line in s.iter_lines() if line.startswith("data:")]
        assert "injected detokenizer fault" in events[-2] and events[-1] == "data: [DONE]"
        for p, want in zip(PROMPTS, greedy):
            ok = httpx.post(url, json={"prompt": p, "max_tokens": 8, "temperature": 0}, timeout=30)
            assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == want
        assert httpx.get(r.base_url + "/health").status_code == 200
    finally:
        stop_server(r)
        llm.close()


def test_step_failure_answers_every_open_request_and_stops_the_server():
    llm = make_llm()
    core = llm.engine_core
    real = core.runner.execute

    def execute(*a, **k):
        # the step fails once all four requests are open (earlier, a request still on its way would find the
        # server gone: connection refused, not an answer)
        if core.num_running + core.num_waiting >= 4:
            raise RuntimeError("injected device error")
        return real(*a, **k)

    core.runner.execute = execute
    r = start_server(llm, model_name="tiny")
    try:
        results = []

        def one(i):
            body = {"prompt": f"p{i}", "max_tokens": 50, "ignore_eos": True}
            results.append(httpx.post(r.base_url + "/v1/completions", json=body, timeout=30))

        threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert len(results) == 4
        for x in results:
            assert x.status_code in (500, 503), x.text
            assert x.json()["error"]["code"] in (500, 503)
        assert any("injected device error" in x.json()["error"]["message"] for x in results)
        deadline = time.monotonic() + 15
        while r.thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not r.thread.is_alive(), "the server did not stop after the engine failed"
        assert "injected device error" in (r.server.engine.error or "")
    finally:
        if r.thread.is_alive():
            stop_server(r)
        llm.close()
