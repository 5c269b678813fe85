"""The OpenAI request bodies of /v1/completions and /v1/chat/completions as pydantic models (vLLM's names and
ranges, vllm/entrypoints/openai/protocol.py), and how a raw body becomes one.

Every field is typed strictly (a boolean is `true` / `false`, never `"false"` or `1`; an integer never `true`)
and every integer the engine stores is bounded by the type that holds it (seed: int64, token ids, top_k,
max_tokens: int32). A body is refused before validation if it is not UTF-8 JSON text, holds a lone surrogate
(`"\\ud800"`: valid JSON, not text), or nests deeper than MAX_JSON_DEPTH. Every refusal is an `APIError` (status
400 unless said) naming the field (`param`) and the allowed range; the app renders OpenAI's error body.

Fields OpenAI defines that this server does not serve are refused by name (REFUSED), and so is any key neither
model knows, except `user` (an end-user id for abuse tracking: it changes no output). A key given twice is refused
(JSON keeps the last silently: `{"model": "a", "model": "b"}` would ask for b without a word). A top-level field
given as null is absent (OpenAI declares its optional fields nullable), so it takes its default; so is a message's
optional field (name, refusal, audio, function_call, tool_calls, annotations) given as null or an empty list.

Shapes no request can use are refused from the parsed JSON before the models validate it (validation is CPU work in
the front end's process, proportional to the body): more than one prompt, more than MAX_MESSAGES messages, a
body of more than MAX_CONTENT_PARTS parts in all.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from spanllm.engine.sampler import INT32_MAX, INT64_MAX, INT64_MIN, MAX_N

MAX_JSON_DEPTH = 32  # objects / arrays inside each other; OpenAI's deepest body (tools' JSON schemas) fits easily
MAX_LOGPROBS = 20  # vLLM's default max_logprobs
MAX_MESSAGES = 4096
MAX_CONTENT_PARTS = 4096  # text parts of all messages together


class APIError(Exception):
    """A request the server refuses: OpenAI's error body {"error": {message, type, param, code}}."""

    def __init__(
        self, message: str, param: str | None = None, status: int = 400, type_: str = "BadRequestError"
    ) -> None:
        super().__init__(message)
        self.message, self.param, self.status, self.type = message, param, status, type_


def error_body(message: str, type_: str = "BadRequestError", param: str | None = None, code: int = 400) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]
# Lists validated to their first bad item (pydantic's fail_fast), not to the end: a 5 MB body of 2.6 million wrong
# items would otherwise build 2.6 million error records on the front end's event-loop thread (17 s, a hostile test).
TokenIds = Annotated[list[TokenId], Field(fail_fast=True)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool | None = None  # null or absent: no usage chunk
    # vLLM's: every chunk also carries the usage so far (its choice's completion tokens, as vLLM counts them)
    continuous_usage_stats: bool | None = None


class TextPart(_Strict):
    type: Literal["text"]
    text: str


# OpenAI's optional message fields, absent when null (as a top-level null is) or, for the lists, empty: they ask for
# nothing. An assistant message replayed as the openai client's `message.model_dump()` holds them all ("refusal":
# None, "annotations": None or [], "audio": None, "function_call": None, "tool_calls": None); refusing them broke
# that multi-turn idiom. Any other value is still refused by name (a name, a tool call: nothing the template honours).
_MESSAGE_FIELDS_EMPTY_IS_ABSENT = {"name": False, "refusal": False, "audio": False, "function_call": False}
_MESSAGE_FIELDS_EMPTY_IS_ABSENT |= {"tool_calls": True, "annotations": True}  # True: [] asks for nothing too


class ChatMessage(_Strict):
    """`developer` is OpenAI's newer name for `system` (o1 and later); it reaches the template as system. A content
    given as parts is their texts joined by newlines (vLLM's rule: "Say" and "hi" stay two words)."""

    role: Literal["system", "developer", "user", "assistant"]
    content: str | Annotated[list[TextPart], Field(fail_fast=True)]

    @model_validator(mode="before")
    @classmethod
    def _empty_optional_fields_are_absent(cls, data: Any) -> Any:
        if isinstance(data, dict) and not _MESSAGE_FIELDS_EMPTY_IS_ABSENT.keys().isdisjoint(data):
            data = {k: v for k, v in data.items() if not _asks_nothing(k, v)}
        return data

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "\n".join(p.text for p in self.content)


class _Sampling(_Strict):
    """The fields both endpoints share (OpenAI's, then vLLM's extras)."""

    model: str | None = None
    user: str | None = None  # harmless: identifies the end user to OpenAI; no effect on output
    n: int = Field(1, ge=1, le=MAX_N)
    max_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stop: str | Annotated[list[str], Field(fail_fast=True)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    logit_bias: Annotated[dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]], Field(fail_fast=True)] | None = None
    # vLLM's extra sampling parameters
    top_k: int | None = Field(None, ge=-1, le=INT32_MAX)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=2.0)
    min_tokens: int = Field(0, ge=0, le=INT32_MAX)
    ignore_eos: bool = False
    stop_token_ids: TokenIds | None = None
    include_stop_str_in_output: bool = False

    @model_validator(mode="after")
    def _stream_options_need_stream(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only allowed with stream=true")
        o = self.stream_options
        if o is not None and o.continuous_usage_stats and not o.include_usage:
            raise ValueError(
                "stream_options: continuous_usage_stats=true puts the usage in every chunk of a stream that has one; "
                "give include_usage=true too, or drop continuous_usage_stats"
            )
        return self


class CompletionRequest(_Sampling):
    prompt: (
        str | TokenIds | Annotated[list[str], Field(fail_fast=True)] | Annotated[list[TokenIds], Field(fail_fast=True)]
    )
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    @model_validator(mode="after")
    def _echo_logprobs(self):
        if self.echo and self.logprobs is not None:
            raise ValueError("echo: echo with logprobs (the prompt's logprobs) is not supported; drop one")
        return self


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES, fail_fast=True)
    max_completion_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs: needs logprobs=true")
        return self


def _asks_nothing(key: str, value: Any) -> bool:
    """A message's optional field given as null (or an empty list where the field is one)."""
    lists = _MESSAGE_FIELDS_EMPTY_IS_ABSENT.get(key)
    return lists is not None and (value is None or (lists and isinstance(value, list) and not value))


def _absent_or(*allowed):
    """Absent (None), or one of `allowed` of the same type (true is not 1, 1.0 is not 1)."""
    return lambda v: v is None or any(type(v) is type(a) and v == a for a in allowed)


# OpenAI fields this server does not serve: refused with a 400 naming them unless the value asks for nothing.
REFUSED_COMPLETIONS = {
    "best_of": (_absent_or(1), "only best_of=1 (an integer) is served; for several completions use n"),
    "suffix": (_absent_or(), "suffix (insertion) is not supported"),
}
REFUSED_CHAT = {
    "response_format": (
        _absent_or({"type": "text"}),
        "response_format other than {'type': 'text'} (structured output) is not supported",
    ),
    "tools": (_absent_or([]), "tools (function calling) are not supported"),
    "tool_choice": (_absent_or("none"), "tool_choice other than 'none' is not supported (no tools)"),
    "parallel_tool_calls": (_absent_or(True, False), "true or false (no tools: either asks nothing)"),
    "functions": (_absent_or([]), "functions (function calling) are not supported"),
    "function_call": (_absent_or("none"), "function_call is not supported (no tools)"),
    "audio": (_absent_or(), "audio output is not supported"),
    "modalities": (_absent_or(["text"]), "modalities other than ['text'] are not supported"),
    "prediction": (_absent_or(), "prediction (predicted outputs) is not supported"),
    "reasoning_effort": (_absent_or(), "reasoning_effort is not supported (not a reasoning model)"),
    "web_search_options": (_absent_or(), "web_search_options is not supported"),
    "service_tier": (_absent_or("auto", "default"), "service_tier other than auto / default is not supported"),
    "store": (_absent_or(False), "store=true is not supported (nothing is stored)"),
    "metadata": (_absent_or(), "metadata is not supported (nothing is stored)"),
    "verbosity": (_absent_or(), "verbosity is not supported"),
}


def parse_body(raw: bytes) -> dict:
    """Raw bytes -> a JSON object (no key twice in any object); `validate` checks what it holds."""
    if not raw.strip():
        raise APIError("the request body is empty: send a JSON object (Content-Type: application/json)")
    encoding = json.detect_encoding(raw)
    if encoding.startswith("utf-16") or encoding.startswith("utf-32"):  # json.loads reads them; JSON is UTF-8
        raise APIError(
            f"the request body is not valid JSON: not UTF-8 (its first bytes are those of {encoding.upper()} "
            "text); send it as UTF-8 (RFC 8259)"
        )
    try:
        body = json.loads(raw, object_pairs_hook=_object_without_repeated_keys)
    except RecursionError:
        raise APIError(f"the request body nests deeper than {MAX_JSON_DEPTH} levels") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(f"the request body is not valid JSON: {e}") from None
    except ValueError as e:  # valid JSON Python will not read, e.g. an integer of more than 4,300 digits
        raise APIError(f"the request body holds a value this server cannot read: {e}") from None
    if not isinstance(body, dict):
        raise APIError("the request body must be a JSON object")
    return body


def _object_without_repeated_keys(pairs: list[tuple[str, Any]]) -> dict:
    d = dict(pairs)
    if len(d) != len(pairs):
        seen: set[str] = set()
        key = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise APIError(f"the key {key[:80]!r} appears twice in one JSON object; give each key once")
    return d


def _check_tree(body: dict) -> None:
    """Depth and text, without recursion: a lone surrogate is valid JSON but no UTF-8 text. Scalars are checked in
    place (a 7 MB list of token ids is a loop, not millions of stack entries); a path is built for containers only."""
    todo: list[tuple[Any, str, int]] = [(body, "", 1)]
    while todo:
        v, path, depth = todo.pop()
        if depth > MAX_JSON_DEPTH:
            raise APIError(f"the request body nests deeper than {MAX_JSON_DEPTH} levels", _top(path))
        if isinstance(v, dict):
            for k, x in v.items():
                _check_text(k, path)
                child = f"{path}.{k}" if path else k
                if isinstance(x, str):
                    _check_text(x, child)
                elif isinstance(x, (dict, list)):
                    todo.append((x, child, depth + 1))
        else:
            for i, x in enumerate(v):
                if isinstance(x, str):
                    _check_text(x, f"{path}[{i}]")
                elif isinstance(x, (dict, list)):
                    todo.append((x, f"{path}[{i}]", depth + 1))


def _check_text(s: str, path: str) -> None:
    if s.isascii():
        return
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise APIError(
            f"{clip(path, 200) or 'a key'}: not valid UTF-8 text (a lone surrogate {s[e.start]!r} at character "
            f"{e.start})",
            _top(path),
        ) from None


def clip(text: str, limit: int = 80) -> str:
    """A client's string as an error message quotes it: at most `limit` characters, "..." marking a cut."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _top(path: str) -> str | None:
    return clip(path.split(".")[0].split("[")[0]) or None


def validate(body: dict, chat: bool, *, max_stop_strings: int, max_stop_length: int, max_stop_token_ids: int):
    """A parsed body -> ChatCompletionRequest / CompletionRequest, or APIError naming the field and its range. The
    shapes no request can use are refused first (list lengths alone), then the body's depth and text are walked,
    then the models validate it."""
    _refuse_unusable_shapes(body, chat)
    _check_tree(body)
    refused = REFUSED_CHAT if chat else REFUSED_COMPLETIONS
    for name, (ok, why) in refused.items():
        if name in body and not ok(body[name]):
            raise APIError(f"{name}: {why}", name)
    model = ChatCompletionRequest if chat else CompletionRequest
    body_best_of = body.get("best_of")  # 1 or None (REFUSED_COMPLETIONS)
    body = {k: v for k, v in body.items() if k not in refused and v is not None}  # null: absent
    try:
        req = model.model_validate(body)
    except ValidationError as e:
        raise _as_api_error(e, model, body) from None
    if not chat and body_best_of is not None and req.n > body_best_of:
        raise APIError(
            f"best_of={body_best_of} with n={req.n}: best_of candidates are generated and the best n of them "
            f"returned, so best_of must be >= n; drop best_of (only best_of=1 is served)",
            "best_of",
        )
    stops = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
    if len(stops) > max_stop_strings:
        raise APIError(f"stop: {len(stops)} strings; at most {max_stop_strings} (--max-stop-strings)", "stop")
    for s in stops:
        if not s:
            raise APIError("stop: an empty string would end every completion before it starts; drop it", "stop")
        if len(s) > max_stop_length:
            raise APIError(
                f"stop: a string of {len(s)} characters; at most {max_stop_length} (--max-stop-string-length)", "stop"
            )
    if req.stop_token_ids and len(req.stop_token_ids) > max_stop_token_ids:
        raise APIError(
            f"stop_token_ids: {len(req.stop_token_ids)} ids; at most {max_stop_token_ids} (--max-stop-token-ids)",
            "stop_token_ids",
        )
    if req.logit_bias:
        for k in req.logit_bias:
            if not _TOKEN_ID_KEY.fullmatch(k) or int(k) > INT32_MAX:
                raise APIError(f"logit_bias: key {k[:40]!r} is not a token id in [0, {INT32_MAX}]", "logit_bias")
    return req


_TOKEN_ID_KEY = re.compile(r"[0-9]{1,10}")  # ASCII digits only: str.isdigit() also accepts '²' and Arabic-Indic digits
_UNION_TAG = re.compile(r"^(str|int|float|bool|list\[.*\]|dict\[.*\]|function-.*|constrained-.*|[A-Z]\w*)$")


def _refuse_unusable_shapes(body: dict, chat: bool) -> None:
    """Before validation: the shapes no request can use, found from list lengths alone."""
    if not chat:
        p = body.get("prompt")
        if isinstance(p, list) and len(p) > 1 and isinstance(p[0], (str, list)):
            raise APIError("batched prompts are not supported: send one prompt per request (or use n)", "prompt")
        return
    msgs = body.get("messages")
    if not isinstance(msgs, list):
        return
    if len(msgs) > MAX_MESSAGES:
        raise APIError(f"messages: {len(msgs)} messages; at most {MAX_MESSAGES}", "messages")
    parts = sum(len(m["content"]) for m in msgs if isinstance(m, dict) and isinstance(m.get("content"), list))
    if parts > MAX_CONTENT_PARTS:
        raise APIError(
            f"messages: {parts} content parts in all; at most {MAX_CONTENT_PARTS} (join the texts)", "messages"
        )


def _real_loc(body: Any, loc: tuple) -> list[str]:
    """An error's location in the body: its keys and indices, without the names pydantic gives a union's members
    ("str", "list[TextPart]", "StreamOptions"). Walked through the body itself, so that a key of the client's that
    looks like such a name ("Temperature", "str", "") is kept: a tag is what the body does not hold there."""
    out, node = [], body
    for x in loc:
        if isinstance(node, dict) and isinstance(x, str) and x in node:
            node = node[x]
        elif isinstance(node, list) and isinstance(x, int) and 0 <= x < len(node):
            node = node[x]
        elif _UNION_TAG.match(str(x)):
            continue  # a union member's name: the body has nothing there
        else:
            node = None  # a required field the body lacks (the last element)
        out.append(str(x))
    return out


def _as_api_error(e: ValidationError, model: type[BaseModel], body: dict) -> APIError:
    errors = e.errors(include_url=False)
    # a union (prompt, stop) reports one error per member: the deepest says most (which item, which bound)
    err = max((x for x in errors if x["loc"][:1] == errors[0]["loc"][:1]), key=lambda x: len(x["loc"]))
    loc = _real_loc(body, err["loc"])
    if err["type"] == "value_error":  # our own model validators: "field: reason"
        msg = str(err.get("ctx", {}).get("error", err["msg"]))
        return APIError(msg, msg.split(":", 1)[0])
    # the client's keys are clipped: an error names them, it does not echo a megabyte key back (twice: param too)
    loc = [clip(x) for x in loc]
    param = loc[0] if loc else None
    where = ".".join(x if x else "''" for x in loc) or "the body"
    if err["type"] == "extra_forbidden":
        return APIError(f"{where}: unknown field (this server refuses what it would not honour)", param)
    if err["type"] == "missing":
        return APIError(f"{where}: required", param)
    got = clip(repr(err.get("input")), 60)
    bounds = None
    if err["type"] in _BOUND_ERRORS:
        bounds = _bounds(model, loc[0]) if len(loc) == 1 else _ITEM_RANGES.get(loc[0])
    return APIError(f"{where}={got}: {f'must be in {bounds}' if bounds else err['msg']}", param)


_ITEM_RANGES = {  # the range of each item of a list / dict field
    "logit_bias": "[-100, 100]",
    "stop_token_ids": f"[0, {INT32_MAX}]",
    "prompt": f"[0, {INT32_MAX}] (token ids)",
}
_BOUND_ERRORS = ("greater_than", "greater_than_equal", "less_than", "less_than_equal")


def _bounds(model: type[BaseModel], name: str) -> str | None:
    """A field's allowed range as an interval, "[0, 2]" or "(0, 1]", from its Field constraints."""
    field = model.model_fields.get(name)
    if field is None:
        return None
    lo, hi = "(-inf", "inf)"
    for m in field.metadata:
        for attr, side in (("ge", "["), ("gt", "("), ("le", "]"), ("lt", ")")):
            v = getattr(m, attr, None)
            if v is not None:
                if side in "[(":
                    lo = f"{side}{v:g}" if isinstance(v, float) else f"{side}{v}"
                else:
                    hi = f"{v:g}{side}" if isinstance(v, float) else f"{v}{side}"
    return None if (lo, hi) == ("(-inf", "inf)") else f"{lo}, {hi}"
