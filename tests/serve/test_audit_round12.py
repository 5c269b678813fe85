"""The hostile-test audit of round 12 (`spanllm serve` against the OpenAI API as a demanding client uses it): each
test failed before its fix. A replayed assistant message (the openai client's `message.model_dump()`, its optional
fields null) is served; an unknown key that looks like a type name ("Temperature", "str", "") is named; min_tokens
past the length, and the logprob entries a non-streaming answer holds, name the length field the client sent;
messages that fill the context say how much to cut. One in-process tiny server (the module's `server` fixture)."""

from __future__ import annotations

import httpx
import pytest

openai = pytest.importorskip("openai")

UNKNOWN = "unknown field (this server refuses what it would not honour)"


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.base_url + path, json=body, timeout=60)


def _error(r: httpx.Response, param: str | None, message: str) -> None:
    assert r.status_code == 400, r.text
    assert r.json()["error"] == {"message": message, "type": "BadRequestError", "param": param, "code": 400}


def test_a_replayed_assistant_message_with_null_fields_is_served(server):
    """The openai client's ChatCompletionMessage.model_dump() holds refusal, annotations, audio, function_call and
    tool_calls as None (OpenAI itself answers annotations []): replayed in the next turn, they ask for nothing and
    are absent, as a top-level null is (they were refused as unknown fields). A value that asks for something is
    still refused by name. The tiny preset's template: "role: content" lines, then "assistant:", after BOS."""
    c = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0, timeout=60)
    first = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=1)
    replayed = first.choices[0].message.model_dump()
    assert replayed["refusal"] is None and replayed["tool_calls"] is None and replayed["annotations"] is None
    replayed["content"] = "hello"  # a fixed text, so the prompt's length is known
    msgs = [{"role": "user", "content": "hi", "name": None}, replayed, {"role": "user", "content": "more"}]
    r = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=2, extra_body={"ignore_eos": True})
    want = 1 + len(b"user: hi\nassistant: hello\nuser: more\nassistant:")
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (want, 2)
    with_lists = {**replayed, "annotations": [], "tool_calls": []}
    r = _post(server, "/v1/chat/completions", {"messages": [msgs[0], with_lists, msgs[2]], "max_tokens": 1})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == want, r.text
    for key, value in (("tool_calls", [{"id": "call_1", "type": "function"}]), ("refusal", "no"), ("name", "bob")):
        body = {"messages": [msgs[0], {**replayed, key: value}], "max_tokens": 1}
        _error(_post(server, "/v1/chat/completions", body), "messages", f"messages.1.{key}: {UNKNOWN}")


@pytest.mark.parametrize(
    "path, body, param, where",
    [
        ("/v1/completions", {"prompt": "hi", "Temperature": 0.5}, "Temperature", "Temperature"),
        ("/v1/completions", {"prompt": "hi", "MaxTokens": 5}, "MaxTokens", "MaxTokens"),
        ("/v1/completions", {"prompt": "hi", "str": 1}, "str", "str"),
        ("/v1/completions", {"prompt": "hi", "": 1}, "", "''"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi", "Name": "a"}]}, "messages", None),
        (
            "/v1/completions",
            {"prompt": "hi", "stream": True, "stream_options": {"Include_usage": True}},
            "stream_options",
            "stream_options.Include_usage",
        ),
    ],
)
def test_an_unknown_key_that_looks_like_a_type_name_is_named(server, path, body, param, where):
    """pydantic names a union's members ("str", "list[int]", "StreamOptions") in an error's location, which the
    server leaves out; a client's key of that look was left out with them: "the body: unknown field", param null."""
    where = where or "messages.0.Name"
    _error(_post(server, path, body), param, f"{where}: {UNKNOWN}")


def test_min_tokens_past_the_length_names_the_field_sent(server):
    """It named max_tokens=3 for a chat that sent max_completion_tokens=3 (and max_tokens=10: a contradiction), and
    the completions default of 16 as if the client had sent it."""
    msgs = [{"role": "user", "content": "hi"}]
    for extra in ({}, {"max_tokens": 10}):
        body = {"messages": msgs, "max_completion_tokens": 3, "min_tokens": 5, **extra}
        _error(
            _post(server, "/v1/chat/completions", body),
            "min_tokens",
            "min_tokens=5: more than max_completion_tokens=3, the most tokens the completion may have; use "
            "min_tokens <= 3, or a larger max_completion_tokens",
        )
    _error(
        _post(server, "/v1/chat/completions", {"messages": msgs, "max_tokens": 3, "min_tokens": 5}),
        "min_tokens",
        "min_tokens=5: more than max_tokens=3, the most tokens the completion may have; use min_tokens <= 3, or a "
        "larger max_tokens",
    )
    _error(
        _post(server, "/v1/completions", {"prompt": "hi", "min_tokens": 20}),
        "min_tokens",
        "min_tokens=20: more than max_tokens=16 (the default), the most tokens the completion may have; use "
        "min_tokens <= 16, or a larger max_tokens",
    )
    ok = _post(server, "/v1/completions", {"prompt": "hi", "min_tokens": 16, "stop_token_ids": [2]})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 16, ok.text


def test_the_logprob_entry_limit_names_max_completion_tokens(server):
    """16 choices x 4,000 tokens x (top 20 + 1) = 1,344,000 entries, above the 1,048,576 a non-streaming answer
    holds: the refusal names max_completion_tokens, which the chat sent (it said max_tokens)."""
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "max_completion_tokens": 4000,
        "n": 16,
        "logprobs": True,
        "top_logprobs": 20,
    }
    _error(
        _post(server, "/v1/chat/completions", body),
        "logprobs",
        "logprobs: n=16 x max_completion_tokens=4000 x (top 20 + the sampled token) = 1344000 logprob entries in one "
        "response, above the 1048576 a non-streaming response holds; stream them (stream=true), or use "
        "max_completion_tokens <= 3120, or fewer choices or top logprobs",
    )


def test_messages_that_fill_the_context_say_how_much_to_cut(server):
    """A chat without max_tokens whose messages leave no token of the 4,080 the fixture's pool holds: the refusal
    names the limit and the fix (it named neither the fix nor the chat template's share). 4,070 characters are
    4,088 tokens here: BOS, "user: ", the text, "\\nassistant:"."""
    body = {"messages": [{"role": "user", "content": "x" * 4070}]}
    for stream in (False, True):
        _error(
            _post(server, "/v1/chat/completions", {**body, "stream": stream}),
            "messages",
            "the messages take 4088 tokens with the chat template, which leaves no room for an answer in this "
            "model's context of 4080 tokens; shorten them to at most 4079 tokens",
        )
    r = _post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 4061}]})
    assert r.status_code == 200 and r.json()["usage"] == {
        "prompt_tokens": 4079,
        "completion_tokens": 1,
        "total_tokens": 4080,
    }, r.text
