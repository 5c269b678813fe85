"""Every OpenAI field of /v1/completions and /v1/chat/completions, through the official `openai` client: either
its effect is asserted, or the request is refused with a 400 naming it (docs/serving.md's table).

The tiny preset's tokenizer is bytes (id = byte + 3): a logit_bias of +100 on ids 75 / 76 makes the output the
letters H / I, which shows what the sampler did in the text. Effects that need the engine's sampling fields
(penalties, min_p, logit_bias, logprobs) are skipped until the sampler honours them."""

from __future__ import annotations

import pytest

openai = pytest.importorskip("openai")

H, I = 75, 76  # the ids of "H" and "I"
LETTERS = {str(i): 100.0 for i in range(68, 88)}  # ids of "A".."T": equal large biases


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0, timeout=60)


def complete(server, stream=False, **kw):
    """(texts by choice, finish reasons, usage) of a completions request, streamed or not; greedy unless the test
    gives a temperature (the server's own default is OpenAI's 1: tests/serve/test_openai_compat.py)."""
    c = client(server)
    kw = {"model": "tiny", "prompt": "Hello", "max_tokens": 12, "temperature": 0, **kw}
    if not stream:
        r = c.completions.create(**kw)
        return [ch.text for ch in r.choices], [ch.finish_reason for ch in r.choices], r.usage
    n = kw.get("n", 1)
    texts, reasons, usage = [""] * n, [None] * n, None
    for ch in c.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
        if ch.usage is not None:
            usage = ch.usage
        for x in ch.choices:
            texts[x.index] += x.text
            reasons[x.index] = x.finish_reason or reasons[x.index]
    return texts, reasons, usage


def chat(server, stream=False, **kw):
    c = client(server)
    kw = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 12, "temperature": 0, **kw}
    if not stream:
        r = c.chat.completions.create(**kw)
        return [ch.message.content for ch in r.choices], [ch.finish_reason for ch in r.choices], r.usage
    n = kw.get("n", 1)
    texts, reasons, usage = [""] * n, [None] * n, None
    for ch in c.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
        if ch.usage is not None:
            usage = ch.usage
        for x in ch.choices:
            texts[x.index] += x.delta.content or ""
            reasons[x.index] = x.finish_reason or reasons[x.index]
    return texts, reasons, usage


# --- refused: 400 naming the field ------------------------------------------------------------------------
REFUSED = [
    ("completions", {"best_of": 2}, "best_of"),
    ("completions", {"suffix": "end"}, "suffix"),
    ("completions", {"prompt": ["a", "b"]}, "prompt"),  # batched prompts
    ("completions", {"echo": True, "logprobs": 2}, "echo"),
    ("completions", {"unknown_key": 1}, "unknown_key"),
    ("chat", {"response_format": {"type": "json_object"}}, "response_format"),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ("chat", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ("chat", {"tool_choice": "auto"}, "tool_choice"),
    ("chat", {"parallel_tool_calls": "yes"}, "parallel_tool_calls"),  # true / false ask nothing without tools
    ("chat", {"functions": [{"name": "f"}]}, "functions"),
    ("chat", {"function_call": "auto"}, "function_call"),
    ("chat", {"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ("chat", {"modalities": ["text", "audio"]}, "modalities"),
    ("chat", {"prediction": {"type": "content", "content": "x"}}, "prediction"),
    ("chat", {"reasoning_effort": "low"}, "reasoning_effort"),
    ("chat", {"web_search_options": {}}, "web_search_options"),
    ("chat", {"service_tier": "flex"}, "service_tier"),
    ("chat", {"store": True}, "store"),
    ("chat", {"metadata": {"a": "b"}}, "metadata"),
    ("chat", {"top_logprobs": 2}, "top_logprobs"),  # without logprobs=true
    ("chat", {"messages": [{"role": "tool", "content": "x"}]}, "messages"),
    ("chat", {"unknown_key": 1}, "unknown_key"),
]


@pytest.mark.parametrize("endpoint,extra,param", REFUSED, ids=[f"{e}-{p}" for e, _, p in REFUSED])
@pytest.mark.parametrize("stream", [False, True])
def test_refused_field(server, endpoint, extra, param, stream):
    fn = complete if endpoint == "completions" else chat
    known = {"prompt", "messages"}
    kw = {k: v for k, v in extra.items() if k in known}
    extra_body = {k: v for k, v in extra.items() if k not in known}
    with pytest.raises(openai.BadRequestError) as e:
        fn(server, stream=stream, extra_body=extra_body, **kw)
    assert e.value.status_code == 400 and e.value.body["param"] == param, e.value.body
    assert param in e.value.body["message"]


# --- supported: the effect ----------------------------------------------------------------------------------
@pytest.mark.parametrize("fn", [complete, chat], ids=["completions", "chat"])
@pytest.mark.parametrize("stream", [False, True])
def test_max_tokens_n_seed_user_stop(server, fn, stream):
    # max_tokens (ignore_eos: exactly that many), user (harmless: same output)
    texts, reasons, usage = fn(server, stream, max_tokens=5, extra_body={"ignore_eos": True})
    assert reasons == ["length"] and usage.completion_tokens == 5
    assert fn(server, stream, max_tokens=5, user="alice", extra_body={"ignore_eos": True})[0] == texts
    # n: independent samples, reproducible with a seed (choice i: seed_for_sample(seed, i)); another seed differs
    kw = {"n": 4, "temperature": 1.0, "seed": 7, "max_tokens": 16, "extra_body": {"ignore_eos": True}}
    t1, r1, u1 = fn(server, stream, **kw)
    t2, _, _ = fn(server, stream, **kw)
    t3, _, _ = fn(server, stream, **{**kw, "seed": 8})
    assert len(t1) == 4 and t1 == t2 and t1 != t3 and len(set(t1)) > 1 and u1.completion_tokens == 4 * 16
    # stop: the output ends before the first stop string
    full = t1[0]
    cut = next(i for i in range(1, len(full)) if full[i] not in full[:i])  # a character not seen before
    t4, r4, _ = fn(server, stream, **{**kw, "n": 1, "stop": [full[cut]]})
    assert t4 == [full[:cut]] and r4 == ["stop"]


def test_n_streamed_equals_not_streamed(server):
    kw = {"n": 3, "temperature": 1.0, "seed": 11, "max_tokens": 10, "extra_body": {"ignore_eos": True}}
    assert complete(server, False, **kw)[0] == complete(server, True, **kw)[0]
    assert chat(server, False, **kw)[0] == chat(server, True, **kw)[0]


@pytest.mark.parametrize("stream", [False, True])
def test_echo(server, stream):
    kw = {"temperature": 1.0, "seed": 3, "max_tokens": 6}
    plain, _, _ = complete(server, stream, prompt="Echo me", **kw)
    echoed, _, usage = complete(server, stream, prompt="Echo me", echo=True, **kw)
    assert echoed == ["Echo me" + plain[0]] and usage.prompt_tokens == 8  # BOS + 7 bytes
    ids = [1] + [b + 3 for b in b"Echo me"]
    assert complete(server, stream, prompt=ids, echo=True, **kw)[0] == echoed


@pytest.mark.parametrize("stream", [False, True])
def test_developer_is_system_and_max_completion_tokens_wins(server, stream):
    kw = {"temperature": 1.0, "seed": 5, "max_tokens": 8}
    sys_msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    dev_msgs = [{"role": "developer", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert chat(server, stream, messages=dev_msgs, **kw)[0] == chat(server, stream, messages=sys_msgs, **kw)[0]
    _, reasons, usage = chat(server, stream, max_tokens=9, max_completion_tokens=3, extra_body={"ignore_eos": True})
    assert usage.completion_tokens == 3 and reasons == ["length"]


@pytest.mark.parametrize("stream", [False, True])
def test_stream_options_and_extras(server, stream):
    # top_k=1 and top_p tiny are greedy whatever the temperature; min_tokens masks EOS / stop ids
    greedy = complete(server, stream, max_tokens=8)[0]
    assert complete(server, stream, max_tokens=8, temperature=1.5, seed=1, extra_body={"top_k": 1})[0] == greedy
    assert complete(server, stream, max_tokens=8, temperature=1.5, seed=1, top_p=1e-6)[0] == greedy
    p = "Hello, my name is"  # the tiny preset's greedy token after it is 370
    _, reasons, usage = complete(server, stream, prompt=p, max_tokens=8, extra_body={"stop_token_ids": [370]})
    assert reasons == ["stop"] and usage.completion_tokens == 1
    stops = {"stop_token_ids": [370], "min_tokens": 4}
    _, reasons, usage = complete(server, stream, prompt=p, max_tokens=8, extra_body=stops)
    assert usage.completion_tokens >= 4


# --- the engine's sampling fields (branch sampling) --------------------------------------------------------
@pytest.mark.parametrize("fn", [complete, chat], ids=["completions", "chat"])
@pytest.mark.parametrize("stream", [False, True])
def test_logit_bias_forces_a_token(server, fn, stream):
    texts, _, _ = fn(server, stream, max_tokens=6, logit_bias={str(H): 100})
    assert texts == ["HHHHHH"]


@pytest.mark.parametrize("field", ["frequency_penalty", "presence_penalty", "repetition_penalty"])
def test_penalties_stop_a_repeat(server, field):
    """With 20 letters biased equally, greedy repeats one letter; a penalty on what was generated moves on."""
    base, _, _ = complete(server, max_tokens=12, logit_bias=LETTERS)
    assert len(set(base[0])) == 1 and len(base[0]) == 12
    value = 2.0
    kw = {field: value} if field != "repetition_penalty" else {"extra_body": {field: value}}
    pen, _, _ = complete(server, max_tokens=12, logit_bias=LETTERS, **kw)
    assert len(set(pen[0])) > 1


def test_min_p_one_is_greedy(server):
    greedy = complete(server, max_tokens=8, logit_bias=LETTERS)[0]
    assert (
        complete(server, max_tokens=8, temperature=1.5, seed=2, logit_bias=LETTERS, extra_body={"min_p": 1.0})[0]
        == greedy
    )


@pytest.mark.parametrize("stream", [False, True])
def test_logprobs_completions(server, stream):
    """Greedy without bias: the sampled token is the most likely of the raw distribution (the logprobs reported are
    the raw ones), its logprob the largest of the top k, all <= 0. The tiny preset's 5 greedy tokens after "Hello"
    are byte pieces: the first two make the one character "\u079f" of the text (each alone decodes to U+FFFD), the
    third and fifth have no text, the fourth is a partial character that never completes; text_offset counts the
    text's characters before each token, as the detokenizer completes them."""
    c = client(server)
    kw = {"model": "tiny", "prompt": "Hello", "max_tokens": 5, "logprobs": 3, "temperature": 0}
    if stream:
        chunks = [ch for ch in c.completions.create(stream=True, **kw) if ch.choices]
        text = "".join(ch.choices[0].text for ch in chunks)
        lps = [ch.choices[0].logprobs for ch in chunks if ch.choices[0].logprobs]
        tokens = sum((x.tokens for x in lps), [])
        token_lps = sum((x.token_logprobs for x in lps), [])
        tops = sum((x.top_logprobs for x in lps), [])
        offs = sum((x.text_offset for x in lps), [])
    else:
        choice = c.completions.create(**kw).choices[0]
        text, lp = choice.text, choice.logprobs
        tokens, token_lps, tops, offs = lp.tokens, lp.token_logprobs, lp.top_logprobs, lp.text_offset
    assert text == "\u079f" and tokens == ["\ufffd", "\ufffd", "", "\ufffd", ""], (text, tokens)
    assert offs == [0, 0, len(text), len(text), len(text)], offs
    assert len(tokens) == len(token_lps) == len(tops) == 5
    for lp_, top in zip(token_lps, tops):
        assert len(top) <= 3 and lp_ <= 0 and abs(lp_ - max(top.values())) < 1e-5


def test_text_offset_is_the_same_with_a_stop_string(server):
    """A stop string holds back text that might start it; the offsets do not wait for that text: with a stop string
    that never matches they equal those without, streamed or not (found by a hostile test: they lagged)."""
    c = client(server)
    kw = {"model": "tiny", "prompt": "Hello", "max_tokens": 8, "logprobs": 1, "temperature": 0}

    def offsets(stream: bool, **extra) -> list[int]:
        if not stream:
            return c.completions.create(**kw, **extra).choices[0].logprobs.text_offset
        chunks = c.completions.create(stream=True, **kw, **extra)
        return sum((ch.choices[0].logprobs.text_offset for ch in chunks if ch.choices and ch.choices[0].logprobs), [])

    want = offsets(False)
    assert len(want) == 8
    for stream in (False, True):
        assert offsets(stream, stop=["zzzzzzzzzzzzzzzzzzzz"]) == want and offsets(stream) == want


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("route", ["completions", "chat"])
def test_logprobs_end_where_a_stop_string_cut_the_text(server, route, stream):
    """Greedy over "A".."T": the completion of "Hello" (presence_penalty 2 varies the letters) is "NTLKQEDP..." and
    the chat's answer "QNENEQQQ..."; stop "QE" / "EQ" cuts them after 4 letters, at the 6th token. The entries of
    the stop string's two tokens (which gave the text nothing) are dropped, streamed or not: every text_offset is
    inside the text, at its token's text; usage counts the 6 tokens generated."""
    c = client(server)
    kw = {"model": "tiny", "max_tokens": 12, "temperature": 0, "logit_bias": LETTERS}
    if stream:
        kw |= {"stream": True, "stream_options": {"include_usage": True}}
    if route == "completions":
        r = c.completions.create(prompt="Hello", presence_penalty=2, stop=["QE"], logprobs=1, **kw)
    else:
        msgs = [{"role": "user", "content": "hi"}]
        r = c.chat.completions.create(messages=msgs, stop=["EQ"], logprobs=True, top_logprobs=1, **kw)
    text, tokens, offsets, finish, usage = "", [], [], None, None
    for ch in r if stream else [r]:
        usage = ch.usage or usage
        for x in ch.choices:
            finish = x.finish_reason or finish
            if route == "completions":
                text += x.text
            else:
                text += (x.delta.content or "") if stream else x.message.content
            if x.logprobs and route == "completions":
                tokens, offsets = tokens + x.logprobs.tokens, offsets + x.logprobs.text_offset
            elif x.logprobs:
                tokens += [e.token for e in x.logprobs.content]
    want = "NTLK" if route == "completions" else "QNEN"
    assert (text, tokens, finish, usage.completion_tokens) == (want, list(want), "stop", 6)
    if route == "completions":
        assert offsets == [0, 1, 2, 3]
        assert all(o < len(text) and text[o:].startswith(t) for o, t in zip(offsets, tokens))


@pytest.mark.parametrize("stream", [False, True])
def test_logprobs_chat(server, stream):
    c = client(server)
    kw = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4,
        "logprobs": True,
        "top_logprobs": 2,
        "logit_bias": {str(H): 100},  # forces "H"; the logprobs stay the raw model's (before the bias)
    }
    if stream:
        content = sum(
            (
                ch.choices[0].logprobs.content
                for ch in c.chat.completions.create(stream=True, **kw)
                if ch.choices and ch.choices[0].logprobs
            ),
            [],
        )
    else:
        content = c.chat.completions.create(**kw).choices[0].logprobs.content
    assert [x.token for x in content] == ["H"] * 4
    for x in content:
        assert x.bytes == [72] and len(x.top_logprobs) == 2
        top = [t.logprob for t in x.top_logprobs]
        assert top == sorted(top, reverse=True) and x.logprob <= top[0] <= 0
        if x.top_logprobs[0].token == "H":  # the raw distribution's favourite anyway
            assert abs(x.logprob - top[0]) < 1e-5
