"""Where the server met OpenAI's API differently than OpenAI / vLLM (the API audit of 2026-12-06), now each as
OpenAI does it or refused by name: the default temperature (1), greedy decoding refusing the cuts it would ignore,
chat content parts joined by newlines, completions' top_logprobs holding the sampled token, null as absent, a key
given twice refused, batched prompts and part floods refused before validation, the logprob entries a
non-streaming response may hold, its JSON encoded in slices that let other streams through, and /v1/models
advertising the context a request can use."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from serve_helpers import NUM_KV_BLOCKS

from spanllm.engine.sampler import TokenLogprob
from spanllm.engine.tokenizer import ByteTokenizer
from spanllm.serve.api import MAX_RESPONSE_LOGPROB_ENTRIES, LogprobsFormatter, sampling_params
from spanllm.serve.limits import ServerLimits
from spanllm.serve.protocol import MAX_CONTENT_PARTS, APIError, parse_body, validate
from spanllm.serve.response_body import SLICE, encode_yielding

_D = ServerLimits()
LIMITS = {
    "max_stop_strings": _D.max_stop_strings,
    "max_stop_length": _D.max_stop_string_length,
    "max_stop_token_ids": _D.max_stop_token_ids,
}
H, I, J = 75, 76, 77  # "H", "I", "J" under the byte tokenizer (byte + 3)


def params(body: dict, chat: bool = False):
    return sampling_params(validate(body, chat, **LIMITS), chat)


def test_temperature_absent_samples_at_one_as_openai_does():
    assert params({"prompt": "x"}).temperature == 1.0
    assert params({"messages": [{"role": "user", "content": "x"}]}, chat=True).temperature == 1.0
    assert params({"prompt": "x", "temperature": None}).temperature == 1.0
    assert params({"prompt": "x", "temperature": 0}).greedy


@pytest.mark.parametrize(
    "extra, param, named",
    [
        ({"top_k": 5}, "top_k", "top_k=5"),
        ({"top_p": 0.5}, "top_p", "top_p=0.5"),
        ({"min_p": 0.2}, "min_p", "min_p=0.2"),
        ({"top_k": 3, "top_p": 0.9}, "top_k", "top_k=3 and top_p=0.9"),
    ],
)
def test_greedy_decoding_refuses_the_cuts_it_would_ignore(extra, param, named):
    with pytest.raises(APIError) as e:
        params({"prompt": "x", "temperature": 0, **extra})
    assert e.value.param == param
    assert e.value.message.startswith(f"{named}: temperature=0 decodes greedily (the most likely token)")
    assert "give temperature > 0 to sample" in e.value.message


def test_greedy_decoding_takes_the_neutral_cuts():
    for extra in ({"top_k": 0}, {"top_k": -1}, {"top_p": 1.0}, {"min_p": 0.0}, {"top_k": None, "top_p": None}):
        assert params({"prompt": "x", "temperature": 0, **extra}).greedy, extra
    assert params({"prompt": "x", "top_k": 5, "top_p": 0.5}).top_k == 5  # sampling (the default temperature)


def test_chat_content_parts_are_joined_by_newlines():
    req = validate(
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "Say"}, {"type": "text", "text": "hi"}]}]},
        True,
        **LIMITS,
    )
    assert req.messages[0].text() == "Say\nhi"


def test_completions_top_logprobs_hold_the_sampled_token():
    lps = [TokenLogprob(J, -3.0, ((H, -0.5),)), TokenLogprob(H, -0.5, ((H, -0.5),))]
    out = LogprobsFormatter(ByteTokenizer(), chat=False).format(lps)
    assert out["tokens"] == ["J", "H"]
    assert out["top_logprobs"] == [{"H": -0.5, "J": -3.0}, {"H": -0.5}]  # k + 1 where the sampled one is not in k


def test_null_is_absent():
    req = validate(
        {"prompt": "x", "n": None, "stream": None, "presence_penalty": None, "frequency_penalty": None, "echo": None},
        False,
        **LIMITS,
    )
    assert (req.n, req.stream, req.presence_penalty, req.frequency_penalty, req.echo) == (1, False, 0.0, 0.0, False)
    chat = validate(
        {
            "messages": [{"role": "user", "content": "x"}],
            "logprobs": None,
            "stream": True,
            "stream_options": {"include_usage": None},
            "parallel_tool_calls": True,
        },
        True,
        **LIMITS,
    )
    assert chat.logprobs is False and not chat.stream_options.include_usage


@pytest.mark.parametrize(
    "raw, key",
    [
        (b'{"model": "no-such-model", "model": "tiny", "prompt": "x"}', "model"),
        (b'{"prompt": "x", "max_tokens": 1, "max_tokens": 6}', "max_tokens"),
        (b'{"messages": [{"role": "user", "role": "system", "content": "x"}]}', "role"),
    ],
)
def test_a_key_given_twice_is_refused(raw, key):
    with pytest.raises(APIError) as e:
        parse_body(raw)
    assert e.value.message == f"the key {key!r} appears twice in one JSON object; give each key once"


def test_batched_prompts_and_part_floods_are_refused_before_validation(monkeypatch):
    import spanllm.serve.protocol as protocol

    def never(*a, **k):
        raise AssertionError("validated")

    monkeypatch.setattr(protocol.CompletionRequest, "model_validate", never)
    monkeypatch.setattr(protocol.ChatCompletionRequest, "model_validate", never)
    with pytest.raises(APIError, match="batched prompts are not supported") as e:
        validate({"prompt": [[1]] * 100_000}, False, **LIMITS)
    assert e.value.param == "prompt"
    half = [{"type": "text", "text": "a"}] * (MAX_CONTENT_PARTS // 2)  # the limit counts every message's parts
    msgs = [{"role": "user", "content": "x"}, {"role": "user", "content": half}, {"role": "user", "content": half}]
    with pytest.raises(APIError) as e:
        validate({"messages": [*msgs, {"role": "user", "content": half[:1]}]}, True, **LIMITS)
    assert e.value.param == "messages"
    want = f"messages: {MAX_CONTENT_PARTS + 1} content parts in all; at most {MAX_CONTENT_PARTS} (join the texts)"
    assert e.value.message == want


def test_the_encoded_body_is_json_dumps_and_lets_other_tasks_run():
    rows = range(3 * SLICE + 5)
    body = {
        "id": "cmpl-1",
        "choices": [
            {
                "index": i,
                "text": 'é"\n',
                "logprobs": {"content": [{"token": f"t{j}", "logprob": -j / 8} for j in rows]},
            }
            for i in range(2)
        ],
        "usage": {"prompt_tokens": 1},
        "empty": [],
        "none": None,
    }
    ticks = []

    async def run():
        async def other():
            while True:
                ticks.append(1)
                await asyncio.sleep(0)

        t = asyncio.create_task(other())
        await asyncio.sleep(0)
        before = len(ticks)
        out = await encode_yielding(body)
        during = len(ticks) - before
        t.cancel()
        return out, during

    out, during = asyncio.run(run())
    assert out == json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()
    assert during >= 2 * 4  # each choice's list in 4 slices, a yield after each


def test_a_non_streaming_response_holds_a_bounded_number_of_logprob_entries(server):
    n, k = 16, 20
    max_tokens = MAX_RESPONSE_LOGPROB_ENTRIES // (n * (k + 1)) + 1
    body = {"model": "tiny", "prompt": "Hi", "n": n, "logprobs": k, "max_tokens": max_tokens}
    r = httpx.post(server.base_url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "logprobs"
    assert err["message"] == (
        f"logprobs: n={n} x max_tokens={max_tokens} x (top {k} + the sampled token) = {n * max_tokens * (k + 1)} "
        f"logprob entries in one response, above the {MAX_RESPONSE_LOGPROB_ENTRIES} a non-streaming response holds; "
        f"stream them (stream=true), or use max_tokens <= {max_tokens - 1}, or fewer choices or top logprobs"
    )
    ok = httpx.post(server.base_url + "/v1/completions", json={**body, "max_tokens": 2, "temperature": 0}, timeout=60)
    assert ok.status_code == 200 and ok.headers["content-type"] == "application/json"
    choices = ok.json()["choices"]
    assert len(choices) == n and all(len(c["logprobs"]["tokens"]) == 2 for c in choices)


def test_models_advertise_the_context_a_request_can_use(server):
    """The fixture's pool (NUM_KV_BLOCKS blocks of 16 tokens, one of them the engine's own: 4,080 tokens) holds less
    than the tiny preset's max_model_len: the card says 4,080, what a request can use (a longer prompt is refused
    naming the pool)."""
    engine = server.server.engine
    assert engine.capacity_tokens == (NUM_KV_BLOCKS - 1) * 16 == 4080 < engine.max_model_len
    card = httpx.get(server.base_url + "/v1/models", timeout=30).json()["data"][0]
    assert card["max_model_len"] == 4080
    assert httpx.get(server.base_url + "/v1/models/tiny", timeout=30).json()["max_model_len"] == 4080


def test_a_request_without_temperature_samples(server):
    """n choices of one seeded request without temperature: OpenAI's default 1 samples, so they differ, and the
    same seed gives the same ones again; temperature 0 gives n copies of the greedy text."""
    body = {"model": "tiny", "prompt": "Hello", "n": 4, "seed": 7, "max_tokens": 12, "ignore_eos": True}
    texts = [
        [c["text"] for c in httpx.post(server.base_url + "/v1/completions", json=b, timeout=60).json()["choices"]]
        for b in (body, body, {**body, "temperature": 0})
    ]
    assert len(set(texts[0])) > 1 and texts[0] == texts[1]
    assert len(set(texts[2])) == 1 and texts[2][0] not in texts[0]


def test_a_chat_without_max_tokens_stops_where_its_logprobs_would_pass_the_limit(server, monkeypatch):
    """A non-streaming chat with logprobs and no max_tokens is not refused for the context it might use: its
    default max_tokens is the rest of the context or what the entries allow, whichever is less (here the limit is
    lowered to 4 x (top 1 + 1) = 8 entries: 4 tokens, finish_reason length)."""
    import spanllm.serve.api as api

    monkeypatch.setattr(api, "MAX_RESPONSE_LOGPROB_ENTRIES", 8)
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 1}
    r = httpx.post(server.base_url + "/v1/chat/completions", json={**body, "ignore_eos": True}, timeout=60)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "length" and len(choice["logprobs"]["content"]) == 4
    assert r.json()["usage"]["completion_tokens"] == 4
    r = httpx.post(server.base_url + "/v1/chat/completions", json={**body, "min_tokens": 5}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "min_tokens", r.text
    assert "a non-streaming response holds at most 4 tokens (8 logprob entries)" in r.json()["error"]["message"]


def test_a_prompt_past_the_pool_names_the_pool_not_max_model_len(server):
    """The pool (4,080 tokens) is the tighter limit: a 9,000-token prompt is refused naming it, not the larger
    max_model_len that /v1/models no longer advertises."""
    r = httpx.post(server.base_url + "/v1/completions", json={"prompt": [5] * 9000, "max_tokens": 1}, timeout=60)
    assert r.status_code == 400
    assert r.json()["error"]["message"].startswith(
        "the request needs up to 9001 tokens of KV cache but the whole pool holds 4080"
    )


@pytest.mark.parametrize(
    "body, chat, where",
    [
        ({"prompt": "x", "stop": [1] * 200_000}, False, "stop.0=1"),
        ({"prompt": [1] + ["a"] * 200_000}, False, "prompt.1='a'"),
        ({"prompt": "x", "stop_token_ids": ["a"] * 200_000}, False, "stop_token_ids.0='a'"),
        ({"prompt": "x", "logit_bias": {str(i): "a" for i in range(200_000)}}, False, "logit_bias.0='a'"),
        ({"messages": [{"role": "user", "content": [1] * 4000}]}, True, "messages.0.content.0=1"),
    ],
)
def test_a_list_of_wrong_items_is_refused_at_its_first(body, chat, where):
    """Validation stops at the first bad item (pydantic's fail_fast): 200,000 wrong items build one error, not
    200,000 (a 5 MB body of them held the front end for 17 s)."""
    from pydantic import ValidationError

    import spanllm.serve.protocol as protocol

    model = protocol.ChatCompletionRequest if chat else protocol.CompletionRequest
    with pytest.raises(ValidationError) as e:
        model.model_validate(body)
    assert e.value.error_count() <= 4  # one per member of the field's union at most
    with pytest.raises(APIError) as e:
        validate(body, chat, **LIMITS)
    assert e.value.message.startswith(where + ": "), e.value.message


@pytest.mark.parametrize("chat", [False, True])
def test_logprobs_kept_as_text_encode_to_the_same_bytes(chat):
    """A non-streaming answer keeps each event's logprobs as JSON text (format_text / merge_text: a string per
    event, not a dict per token); the body it encodes is byte for byte the one of the dicts (format / merge)."""
    from spanllm.serve.response_body import dumps

    events = [
        [TokenLogprob(H, -0.5, ((H, -0.5), (I, -1.25)))],
        [],
        [TokenLogprob(0xC3 + 3, -2.0, ((J, -0.1),)), TokenLogprob(0xA9 + 3, -0.25, ((I, -0.25),))],  # "é" in 2 bytes
    ]
    as_dicts = LogprobsFormatter(ByteTokenizer(), chat=chat)
    as_text = LogprobsFormatter(ByteTokenizer(), chat=chat)
    want = {"logprobs": as_dicts.merge([as_dicts.format(e) for e in events])}
    got = {"logprobs": as_text.merge_text([as_text.format_text(e) for e in events])}
    assert asyncio.run(encode_yielding(got)).decode() == dumps(want)
    assert len(want["logprobs"]["content" if chat else "tokens"]) == 3
