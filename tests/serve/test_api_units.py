"""The API's pure pieces: the logprobs shapes, the seeds of n choices, what --max-queued-requests counts, the
refused-field and range messages of the request models."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from spanllm.engine.sampler import INT64_MAX, INT64_MIN, SamplingParams, TokenLogprob, seed_for_sample
from spanllm.engine.tokenizer import ByteTokenizer
from spanllm.serve.api import LogprobsFormatter
from spanllm.serve.limits import ServerLimits
from spanllm.serve.protocol import APIError, validate
from spanllm.serve.response_body import dumps, encode_yielding

_D = ServerLimits()  # the server's defaults, as api.py hands them to validate
LIMITS = {
    "max_stop_strings": _D.max_stop_strings,
    "max_stop_length": _D.max_stop_string_length,
    "max_stop_token_ids": _D.max_stop_token_ids,
}

H, I = 75, 76  # "H", "I" under the byte tokenizer (byte + 3)
LPS = [TokenLogprob(H, -0.5, ((H, -0.5), (I, -1.25))), TokenLogprob(I, -0.25, ((I, -0.25), (H, -2.0)))]


def test_completion_logprobs_shape():
    out = LogprobsFormatter(ByteTokenizer(), chat=False, start=5).format(LPS)
    assert out == {
        "tokens": ["H", "I"],
        "token_logprobs": [-0.5, -0.25],
        "top_logprobs": [{"H": -0.5, "I": -1.25}, {"I": -0.25, "H": -2.0}],
        "text_offset": [5, 6],
    }


def test_chat_logprobs_shape():
    out = LogprobsFormatter(ByteTokenizer(), chat=True).format(LPS[:1])
    assert out == {
        "content": [
            {
                "token": "H",
                "logprob": -0.5,
                "bytes": [72],
                "top_logprobs": [
                    {"token": "H", "logprob": -0.5, "bytes": [72]},
                    {"token": "I", "logprob": -1.25, "bytes": [73]},
                ],
            }
        ]
    }


def test_seed_for_sample_stays_in_int64():
    assert [seed_for_sample(7, i) for i in range(3)] == [7, 8, 9]
    assert seed_for_sample(INT64_MAX, 1) == INT64_MIN and seed_for_sample(INT64_MIN, 0) == INT64_MIN


@pytest.mark.parametrize(
    "body,chat,param,words",
    [
        ({"prompt": "x", "top_p": 0}, False, "top_p", "top_p=0: must be in (0, 1]"),
        ({"prompt": "x", "presence_penalty": 3}, False, "presence_penalty", "[-2, 2]"),
        ({"prompt": "x", "repetition_penalty": 0}, False, "repetition_penalty", "(0, 2]"),
        ({"prompt": "x", "min_p": 1.5}, False, "min_p", "[0, 1]"),
        ({"prompt": "x", "n": 17}, False, "n", "[1, 16]"),
        (
            {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 21, "logprobs": True},
            True,
            "top_logprobs",
            "[0, 20]",
        ),
        ({"messages": [{"role": "user", "content": "x", "name": "bob"}]}, True, "messages", "unknown field"),
        ({"prompt": "x", "user": 5}, False, "user", "valid string"),
    ],
)
def test_validation_messages(body, chat, param, words):
    with pytest.raises(APIError) as e:
        validate(body, chat, **LIMITS)
    assert e.value.param == param and words in e.value.message, e.value.message


def test_stop_token_ids_are_bounded_and_kept_once():
    ok = validate({"prompt": "x", "stop_token_ids": [7] * 1024}, False, **LIMITS)
    assert len(ok.stop_token_ids) == 1024
    with pytest.raises(APIError) as e:
        validate({"prompt": "x", "stop_token_ids": [7] * 3}, False, **{**LIMITS, "max_stop_token_ids": 2})
    assert e.value.param == "stop_token_ids" and "3 ids; at most 2 (--max-stop-token-ids)" in e.value.message
    assert SamplingParams(stop_token_ids=[5, 5, 3, 5, 9, 3]).stop_token_ids == (5, 3, 9)  # once each, in order


def test_user_is_accepted():
    assert validate({"prompt": "x", "user": "alice"}, False, **LIMITS).user == "alice"


def test_chat_logprobs_bytes_of_partial_characters():
    """A character split across tokens: each token's `bytes` are its own, and joined they are the character's
    UTF-8 (not U+FFFD's bytes per token)."""
    tok = ByteTokenizer()
    ids = tok.encode("👨", add_special_tokens=False)  # four byte tokens
    out = LogprobsFormatter(tok, chat=True).format([TokenLogprob(i, -0.1, ()) for i in ids])
    assert [e["token"] for e in out["content"]] == ["\ufffd"] * 4
    assert bytes(b for e in out["content"] for b in e["bytes"]) == "👨".encode()


def test_completion_text_offset_is_where_each_token_starts():
    """Offsets count the detokenized text before each token: the four bytes of a partial character add nothing until
    it completes, so its tokens all start at the character, and the next token after it. The same whether the
    tokens come in one event or one at a time, and per choice."""
    tok = ByteTokenizer()
    ids = tok.encode("a👨b", add_special_tokens=False)  # a, four bytes of 👨, b
    lps = [TokenLogprob(i, -0.1, ()) for i in ids]
    assert LogprobsFormatter(tok, chat=False).format(lps)["text_offset"] == [0, 1, 1, 1, 1, 2]
    fmt = LogprobsFormatter(tok, chat=False, start=3)  # after an echoed prompt of 3 characters
    parts = {c: [fmt.format([lp], c) for lp in lps] for c in (0, 1)}  # two choices, interleaved by event
    for c in (0, 1):
        merged = fmt.merge(parts[c])
        assert merged["text_offset"] == [3, 4, 4, 4, 4, 5] and merged["tokens"] == [fmt.token(i) for i in ids]


@pytest.mark.parametrize(
    "body,chat,param,words",
    [
        ({"prompt": "x", "logit_bias": {"²": 5}}, False, "logit_bias", "not a token id"),
        ({"prompt": "x", "logit_bias": {"١٢": 5}}, False, "logit_bias", "not a token id"),
        ({"prompt": "x", "logit_bias": {"9" * 5000: 5}}, False, "logit_bias", "not a token id"),
        ({"prompt": "x", "best_of": 0}, False, "best_of", "only best_of=1"),
        ({"prompt": "x", "best_of": True}, False, "best_of", "only best_of=1"),
        ({"prompt": "x", "best_of": 1.0}, False, "best_of", "only best_of=1"),
        ({"messages": [{"role": "user", "content": "x"}], "store": 0}, True, "store", "store=true"),
        ({"prompt": "x", "stop": ""}, False, "stop", "empty string"),
        ({"prompt": "x", "stop": ["a", ""]}, False, "stop", "empty string"),
    ],
)
def test_refusals_of_lookalike_values(body, chat, param, words):
    with pytest.raises(APIError) as e:
        validate(body, chat, **LIMITS)
    assert e.value.param == param and words in e.value.message, e.value.message


class WordTokenizer:
    """Token id i is WORDS[i] (whole words: a token's text, and what it adds to the detokenized text)."""

    WORDS = [" Paris", ".", "\n\n", "The", " answer", " is", ":", " Rome"]

    def decode(self, ids):
        return "".join(self.WORDS[i] for i in ids)

    def token_bytes(self, tid):
        return self.WORDS[tid].encode()

    def detokenizer(self, prompt_ids):
        return SimpleNamespace(push=lambda tid: self.WORDS[tid])


def _delta(tid, new_text, finished=False, stop_reason=None):
    from spanllm.serve.async_engine import Delta

    lps = [TokenLogprob(tid, -1.0, ())]
    return Delta(new_text, [tid], 0, finished, "stop" if finished else None, stop_reason, None, lps)


# The engine's events of " Paris.\n\nThe answer is:" with stop "is:": the text's last 2 characters held back until
# the end (new_text), then ":" completes "is:" and the text is cut before it: " Paris.\n\nThe answer ".
STOP_EVENTS = [(0, " Par"), (1, "is"), (2, ".\n"), (3, "\nT"), (4, "he answ"), (5, "er "), (6, "")]


@pytest.mark.parametrize("chat", [False, True])
def test_logprobs_of_tokens_after_a_stop_string_cut_are_dropped(chat):
    """ ":" (at 22) gave the text (20 characters) nothing: dropped; " is" (at 19) straddles the cut: kept. Streamed, an
    entry waits until the text sent reaches its token ("." at 6 waits for ".\n"); the whole answer's entries are
    the stream's, in both representations."""
    fmt = LogprobsFormatter(WordTokenizer(), chat=chat, stop_strings=True)
    events = [_delta(t, x, t == 6, "is:" if t == 6 else None) for t, x in STOP_EVENTS]
    parts = [fmt.format(d.new_logprobs, 0, d.new_text, fmt.held(d)) for d in events]
    key = "content" if chat else "tokens"
    words = [[e["token"] for e in p[key]] if chat else p[key] for p in parts]
    assert words == [[" Paris"], [], [".", "\n\n"], ["The"], [" answer"], [" is"], []]
    merged = fmt.merge(parts)
    if chat:
        assert [e["token"] for e in merged[key]] == [" Paris", ".", "\n\n", "The", " answer", " is"]
    else:
        assert merged == {
            "tokens": [" Paris", ".", "\n\n", "The", " answer", " is"],
            "token_logprobs": [-1.0] * 6,
            "top_logprobs": [
                {" Paris": -1.0},
                {".": -1.0},
                {"\n\n": -1.0},
                {"The": -1.0},
                {" answer": -1.0},
                {" is": -1.0},
            ],
            "text_offset": [0, 6, 7, 9, 12, 19],
        }
    as_text = LogprobsFormatter(WordTokenizer(), chat=chat, stop_strings=True)
    got = as_text.merge_text([as_text.format_text(d.new_logprobs, 0, d.new_text, as_text.held(d)) for d in events])
    assert asyncio.run(encode_yielding(got)).decode() == dumps(merged)


def test_logprobs_a_stop_string_held_are_all_sent_when_the_choice_ends_otherwise():
    """With stop strings, a choice that ends at max_tokens (or EOS) keeps every entry: the held ones come with its
    last event."""
    fmt = LogprobsFormatter(WordTokenizer(), chat=False, stop_strings=True)
    events = [_delta(0, " Par"), _delta(7, "is"), _delta(1, " Rome.", finished=True)]
    parts = [fmt.format(d.new_logprobs, 0, d.new_text, fmt.held(d)) for d in events]
    assert [p["tokens"] for p in parts] == [[" Paris"], [], [" Rome", "."]]
    assert fmt.merge(parts)["text_offset"] == [0, 6, 11]


def test_engine_refusal_names_the_fields_sent():
    """validate_request's length refusals name the prompt and max_tokens; a chat's answer names its messages and the
    length field it sent."""
    from spanllm.engine.engine_core import RequestError, validate_request
    from spanllm.serve.api import engine_refusal

    def refusal(max_model_len: int, capacity_tokens: int) -> str:
        with pytest.raises(RequestError) as e:
            validate_request(
                [5] * 10,
                SamplingParams(max_tokens=100),
                vocab_size=512,
                max_model_len=max_model_len,
                capacity_tokens=capacity_tokens,
            )
        return str(e.value)

    context, pool = refusal(64, 4080), refusal(4096, 64)
    e = engine_refusal(context, chat=False)
    assert (e.param, e.message) == (
        "prompt",
        "this model's maximum context length is 64 tokens. However, you requested 110 tokens (10 in the prompt, 100 "
        "for the completion). Reduce the prompt or max_tokens",
    )
    e = engine_refusal(context, chat=True, max_tokens_field="max_completion_tokens")
    assert (e.param, e.message) == (
        "messages",
        "this model's maximum context length is 64 tokens. However, you requested 110 tokens (10 in the messages, 100 "
        "for the completion). Reduce the messages or max_completion_tokens",
    )
    e = engine_refusal(pool, chat=True)
    assert (e.param, e.message) == (
        "messages",
        "the request needs up to 110 tokens of KV cache but the whole pool holds 64; it could never run. Reduce the "
        "messages or max_tokens, or give the cache more memory",
    )
    e = engine_refusal(pool, chat=False)
    assert (e.param, e.message) == ("prompt", pool)
    stop_ids = engine_refusal("stop_token_ids holds 600, outside the vocabulary [0, 512)", chat=True)
    assert stop_ids.param == "stop_token_ids"


def test_best_of_one_is_accepted():
    assert validate({"prompt": "x", "best_of": 1}, False, **LIMITS).n == 1


def test_a_number_python_cannot_read_is_a_400():
    from spanllm.serve.protocol import parse_body

    with pytest.raises(APIError) as e:
        parse_body(b'{"prompt": "hi", "seed": ' + b"1" * 5000 + b"}")
    assert e.value.status == 400 and "cannot read" in e.value.message


def test_refused_param_names_top_k():
    from spanllm.serve.api import refused_param

    assert refused_param("top_k=100000 exceeds the vocabulary of 512 tokens; use at most 512, or 0 (off)") == "top_k"


def test_the_app_primes_the_request_path_without_the_engine():
    """build_app runs a completion's and a chat's parsing and tokenization once (their first-use costs paid at
    start), with nothing sent to the engine."""
    from types import SimpleNamespace

    from spanllm.serve.api import build_app

    class Recording(ByteTokenizer):
        def __init__(self):
            super().__init__()
            self.texts, self.chats = [], []

        def encode(self, text, add_special_tokens=True):
            self.texts.append(text)
            return super().encode(text, add_special_tokens)

        def apply_chat_template(self, messages):
            self.chats.append(messages)
            return super().apply_chat_template(messages)

    class NoEngine(SimpleNamespace):
        def add(self, *a, **k):
            raise AssertionError("priming must not reach the engine")

    tok = Recording()
    engine = NoEngine(capacity_tokens=4096, vocab_size=512, max_model_len=4096, has_tokenizer=True, alive=True)
    build_app(engine, tok, model_name="m", max_model_len=4096)
    assert "Hello" in tok.texts and tok.chats == [[{"role": "user", "content": "Hello"}]]


def test_priming_that_fails_is_logged_and_the_app_still_builds(caplog):
    """Priming is a speed-up: a tokenizer that breaks on the sample chat (not a client error) leaves a warning, and
    the app is built (the chat route then answers for itself)."""
    from types import SimpleNamespace

    from spanllm.serve.api import build_app

    class Broken(ByteTokenizer):
        def apply_chat_template(self, messages):
            raise RuntimeError("template engine missing")

    engine = SimpleNamespace(capacity_tokens=4096, vocab_size=512, max_model_len=4096, alive=True)
    with caplog.at_level("WARNING", logger="spanllm.serve"):
        assert build_app(engine, Broken(), model_name="m", max_model_len=4096) is not None
    assert "priming the chat route failed (RuntimeError: template engine missing)" in caplog.text


def test_large_bodies_are_prepared_in_a_thread_of_their_own():
    """Bodies above LARGE_BODY_BYTES queue for one thread of their own: huge prompts, tokenized for seconds each,
    never hold the threads that the small requests are prepared in (found by a hostile test: 24 refused 1.3 MB
    prompts delayed a 1-token request by 15-26 s)."""
    import threading

    from spanllm.serve.api import LARGE_BODY_BYTES, PreparePools

    pools = PreparePools(small_workers=3)
    assert pools.for_body(LARGE_BODY_BYTES + 1) is pools.large and pools.for_body(LARGE_BODY_BYTES) is pools.small
    assert pools.large._max_workers == 1 and pools.small._max_workers == 3
    name = lambda: threading.current_thread().name  # noqa: E731
    assert pools.large.submit(name).result().startswith("spanllm-prepare-large")
    assert pools.small.submit(name).result().startswith("spanllm-prepare_")


def test_a_sampling_refusal_names_its_field():
    """The duplicate logit_bias token (two keys for id 5) names logit_bias, not its whole message (found by a
    hostile test)."""
    from spanllm.serve.api import sampling_params

    req = validate({"prompt": "x", "logit_bias": {"05": 1, "5": -1}}, False, **LIMITS)
    with pytest.raises(APIError) as e:
        sampling_params(req, False)
    assert e.value.param == "logit_bias" and "names token 5 twice" in e.value.message
