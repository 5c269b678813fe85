"""Generated request bodies for /v1/completions and /v1/chat/completions (hypothesis strategies) and the check
every answer must pass: a 2xx with a well-formed body, or a 4xx with OpenAI's error shape; never a 5xx. The
test suite runs a bounded number of examples (tests/serve/test_fuzz.py); scripts/fuzz_serve.py runs many.

Bodies mix the fields both endpoints know, with values of the right type and range, of the wrong type, and
at and past the edges of the types the engine stores (int32, int64), plus unknown keys. max_tokens stays small
in most examples so a run is bounded by the number of examples, not by generation."""

from __future__ import annotations

import json

from hypothesis import strategies as st

EDGE_INTS = [0, 1, -1, 2**31 - 1, 2**31, 2**63 - 1, 2**63, -(2**63), -(2**63) - 1, 2**64, 10**20]
json_leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from(EDGE_INTS),
    st.floats(allow_nan=False),
    st.text(max_size=20),
)
json_any = st.recursive(
    json_leaf, lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4), max_leaves=12
)


def _field(good, bad=json_any):
    return st.one_of(good, good, bad)  # two in three: the right type and range


def _small_tokens():
    return _field(st.integers(min_value=1, max_value=6), st.sampled_from([0, -1, 2**31, 2**63, 10**20, "4", True]))


SHARED = {
    "model": _field(st.just("tiny"), st.text(max_size=10)),
    "max_tokens": _small_tokens(),
    "n": _field(st.integers(min_value=1, max_value=3), st.sampled_from([0, 17, True, "2", 2**63])),
    "temperature": _field(st.floats(min_value=0, max_value=2), st.sampled_from([-1, 2.5, 1e-39, "1", True])),
    "top_p": _field(st.floats(min_value=0.01, max_value=1)),
    "top_k": _field(st.integers(min_value=-1, max_value=600), st.sampled_from(EDGE_INTS)),
    "seed": _field(st.integers(min_value=-(2**63), max_value=2**63 - 1), st.sampled_from(EDGE_INTS)),
    "stop": _field(st.one_of(st.text(max_size=4), st.lists(st.text(max_size=4), max_size=4))),
    "stream": _field(st.booleans(), st.sampled_from(["false", "true", 0, 1])),
    "stream_options": _field(st.fixed_dictionaries({"include_usage": st.booleans()})),
    "presence_penalty": _field(st.floats(min_value=-2, max_value=2)),
    "frequency_penalty": _field(st.floats(min_value=-2, max_value=2)),
    "repetition_penalty": _field(st.floats(min_value=0.01, max_value=2)),
    "min_p": _field(st.floats(min_value=0, max_value=1)),
    "logit_bias": _field(
        st.dictionaries(st.integers(0, 600).map(str), st.floats(min_value=-100, max_value=100), max_size=3)
    ),
    "min_tokens": _field(st.integers(min_value=0, max_value=6), st.sampled_from(EDGE_INTS)),
    "ignore_eos": _field(st.booleans()),
    "stop_token_ids": _field(st.lists(st.integers(0, 600), max_size=3), st.lists(st.sampled_from(EDGE_INTS))),
    "user": _field(st.text(max_size=8)),
    "unknown_field": json_any,
}
token_ids = st.lists(st.integers(min_value=0, max_value=600), min_size=1, max_size=16)
COMPLETION = {
    **SHARED,
    "prompt": _field(
        st.one_of(st.text(min_size=1, max_size=40), token_ids, st.lists(st.text(max_size=10), max_size=2)),
        st.sampled_from([[2**31], [-1], [2**64], "", [], [True]]),
    ),
    "echo": _field(st.booleans()),
    "logprobs": _field(st.integers(min_value=0, max_value=5), st.sampled_from([21, -1, True])),
    "best_of": _field(st.just(1)),
    "suffix": json_any,
}
message = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["system", "developer", "user", "assistant", "tool", "x"]),
        "content": st.text(max_size=30),
    }
)
CHAT = {
    **SHARED,
    "messages": _field(st.lists(message, min_size=1, max_size=3)),
    "max_completion_tokens": _small_tokens(),
    "logprobs": _field(st.booleans()),
    "top_logprobs": _field(st.integers(min_value=0, max_value=5), st.sampled_from([21, -1])),
    "response_format": _field(st.sampled_from([{"type": "text"}, {"type": "json_object"}])),
    "tools": json_any,
    "tool_choice": _field(st.sampled_from(["none", "auto"])),
}


def bodies(chat: bool):
    """A body: the prompt / messages (usually), a few other fields, and max_tokens small unless it is drawn."""
    fields = CHAT if chat else COMPLETION
    main = "messages" if chat else "prompt"
    names = sorted(k for k in fields if k != main)

    @st.composite
    def body(draw):
        out = {}
        if draw(st.integers(0, 9)) > 0:
            out[main] = draw(fields[main])
        for name in draw(st.lists(st.sampled_from(names), max_size=6, unique=True)):
            out[name] = draw(fields[name])
        if out.get("max_tokens") is None and out.get("max_completion_tokens") is None:
            out["max_tokens"] = 4  # not the chat default (the rest of the context): runs stay short
        return out

    return body()


def check_answer(status: int, raw: bytes, streamed: bool) -> str | None:
    """None if the answer is one the server may give; else what is wrong with it."""
    if status >= 500:
        return f"status {status}: {raw[:300]!r}"
    if 400 <= status < 500:
        try:
            err = json.loads(raw)["error"]
        except (ValueError, KeyError, TypeError):
            return f"status {status} without OpenAI's error body: {raw[:300]!r}"
        if set(err) != {"message", "type", "param", "code"} or err["code"] != status or not err["message"]:
            return f"status {status}, a malformed error body: {err}"
        return None
    if status != 200:
        return f"status {status}"
    if streamed:
        lines = [x for x in raw.decode().split("\n\n") if x.strip()]
        if not lines or lines[-1] != "data: [DONE]":
            return f"a stream that does not end with [DONE]: {raw[-300:]!r}"
        for x in lines[:-1]:
            obj = json.loads(x[len("data: ") :])
            if "error" in obj:
                return f"an error event in a stream: {obj}"
            if "choices" not in obj:
                return f"a chunk without choices: {obj}"
        return None
    obj = json.loads(raw)
    if not obj.get("choices") or "usage" not in obj:
        return f"a body without choices / usage: {obj}"
    for i, c in enumerate(obj["choices"]):
        if c["index"] != i or c["finish_reason"] not in ("stop", "length"):
            return f"a malformed choice: {c}"
    return None
