"""The API's pure pieces: the logprobs shapes, the seeds of n choices, what --max-queued-requests counts, the
refused-field and range messages of the request models."""

from __future__ import annotations

import pytest

from spanllm.engine.sampler import INT64_MAX, INT64_MIN, SamplingParams, TokenLogprob
from spanllm.engine.tokenizer import ByteTokenizer
from spanllm.serve.api import LogprobsFormatter, seed_for_choice
from spanllm.serve.async_engine import queued_estimate
from spanllm.serve.limits import ServerLimits
from spanllm.serve.protocol import APIError, validate

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


def test_seed_for_choice_stays_in_int64():
    assert [seed_for_choice(7, i) for i in range(3)] == [7, 8, 9]
    assert seed_for_choice(INT64_MAX, 1) == INT64_MIN and seed_for_choice(INT64_MIN, 0) == INT64_MIN


@pytest.mark.parametrize(
    "engine_waiting,running,in_transit,max_num_seqs,want",
    [
        (0, 0, 100, 256, 0),  # a burst on an idle server: every one has a slot
        (0, 250, 10, 256, 4),  # six free slots
        (3, 256, 5, 256, 8),  # full: all wait
        (10, 0, 0, 256, 10),
    ],
)
def test_queued_estimate(engine_waiting, running, in_transit, max_num_seqs, want):
    assert queued_estimate(engine_waiting, running, in_transit, max_num_seqs) == want


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
