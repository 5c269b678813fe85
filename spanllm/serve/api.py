"""The FastAPI app: OpenAI's /v1/completions, /v1/chat/completions (streaming and not), /v1/models (list and
retrieve), /health, /metrics.

Request bodies are validated by spanllm.serve.protocol (pydantic models: types, ranges, refused fields); every
refusal, and every 404 / 405, answers OpenAI's error body {"error": {"message", "type", "param", "code"}}.
The prompt is checked against the model (vocabulary, context) by the engine's one admission function
(spanllm.engine.engine_core.validate_request, through the engine's `add`).

Defaults: max_tokens 16 for completions (OpenAI's); for chat the rest of the context, i.e.
min(max_model_len, KV pool tokens) - prompt tokens (vLLM's choice); max_completion_tokens wins over max_tokens.
temperature absent: 1 (OpenAI's default, and vLLM's for a model without generation defaults); below 1e-5 greedy,
where a top_k / top_p / min_p that would cut is refused (it would never cut the most likely token: it would be
accepted and ignored). `n` choices are n engine requests; with a seed, choice i samples with
seed_for_sample(seed, i), so the whole answer is reproducible. Logprobs are the model's raw log-probabilities
(before temperature and penalties: vLLM v1's default; spanllm.engine.sampler), for the sampled token and the top k.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import re
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from spanllm.engine.engine_core import RequestError
from spanllm.engine.sampler import (
    GREEDY_BELOW,
    INT32_MAX,
    SamplingParams,
    SamplingParamsError,
    seed_for_sample,
)
from spanllm.serve.async_engine import AsyncEngine, EngineDead, EngineUnavailable, QueueFull
from spanllm.serve.limits import BodyLimitMiddleware, ServerLimits
from spanllm.serve.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    clip,
    error_body,
    parse_body,
    validate,
)
from spanllm.serve.response_body import RawJSON, dumps, encode_yielding

DEFAULT_TEMPERATURE = 1.0  # a request without temperature samples at 1, as on OpenAI and vLLM
# Request bodies above this many bytes are parsed and tokenized in a thread of their own (PreparePools).
LARGE_BODY_BYTES = 256 * 1024
# A text prompt of more than TEXT_MARGIN x (max characters per token) x (context tokens) characters cannot fit and is
# refused without tokenizing it. The margin covers normalizers that merge characters (NFC-style: a letter and its
# combining mark become one); the tokenizers served here have none, for which a margin of 1 would be exact.
TEXT_MARGIN = 2
# Logprob entries (n x max_tokens x (top k + 1)) a non-streaming response may hold: ~60 MB of JSON at the top 20
MAX_RESPONSE_LOGPROB_ENTRIES = 1 << 20
DISCONNECT_POLL_S = 0.25  # non-streaming requests: how often the handler checks that its client is still there
_HTTP_ERROR_TYPES = {404: "NotFoundError", 405: "MethodNotAllowedError", 413: "RequestTooLargeError"}
_log = logging.getLogger("spanllm.serve")


def error_response(e: APIError) -> JSONResponse:
    return JSONResponse(error_body(e.message, e.type, e.param, e.status), status_code=e.status)


def sampling_params(req: CompletionRequest | ChatCompletionRequest, chat: bool) -> SamplingParams:
    """SamplingParams of choice 0 (chat without max_tokens: INT32_MAX until the prompt length is known)."""
    if chat:
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
    else:
        max_tokens = req.max_tokens if req.max_tokens is not None else 16
        logprobs = req.logprobs
    stop = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
    if max_tokens is not None and req.min_tokens > max_tokens:  # named as the client sent it (or its default)
        field = length_field(req, chat)
        raise APIError(
            f"min_tokens={req.min_tokens}: more than {field}={max_tokens}"
            f"{'' if chat or req.max_tokens is not None else ' (the default)'}, the most tokens the completion may "
            f"have; use min_tokens <= {max_tokens}, or a larger {field}",
            "min_tokens",
        )
    temperature = req.temperature if req.temperature is not None else DEFAULT_TEMPERATURE
    if temperature < GREEDY_BELOW:
        cuts = [
            f"{name}={value}"
            for name, value, cuts in (
                ("top_k", req.top_k, req.top_k not in (None, 0, -1)),
                ("top_p", req.top_p, req.top_p not in (None, 1.0)),
                ("min_p", req.min_p, req.min_p != 0.0),
            )
            if cuts
        ]
        if cuts:
            raise APIError(
                f"{' and '.join(cuts)}: temperature={temperature:g} decodes greedily (the most likely token), which "
                f"{'they' if len(cuts) > 1 else 'it'} would never cut; give temperature > 0 to sample, or drop "
                f"{' and '.join(c.split('=')[0] for c in cuts)}",
                cuts[0].split("=")[0],
            )
    try:
        return SamplingParams(
            max_tokens=max_tokens if max_tokens is not None else INT32_MAX,
            temperature=temperature,
            top_p=req.top_p if req.top_p is not None else 1.0,
            top_k=req.top_k if req.top_k is not None else 0,
            seed=req.seed,
            min_tokens=req.min_tokens,
            ignore_eos=req.ignore_eos,
            stop=tuple(stop),  # validate refused empty strings
            stop_token_ids=tuple(req.stop_token_ids or ()),
            presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty,
            repetition_penalty=req.repetition_penalty,
            min_p=req.min_p,
            logit_bias=tuple(sorted((int(k), v) for k, v in (req.logit_bias or {}).items())),
            logprobs=logprobs,
            include_stop_str_in_output=req.include_stop_str_in_output,
        )
    except SamplingParamsError as e:
        raise APIError(str(e), _leading_name(str(e))) from None


def length_field(req: CompletionRequest | ChatCompletionRequest, chat: bool) -> str:
    """The field that bounds the request's length, as the client sent it: a chat's max_completion_tokens wins over
    its max_tokens."""
    return "max_completion_tokens" if chat and req.max_completion_tokens is not None else "max_tokens"


def _leading_name(message: str) -> str | None:
    """The parameter a SamplingParamsError is about: the name its message starts with ("logit_bias[5]=...",
    "logit_bias names token 5 twice" -> "logit_bias")."""
    m = re.match(r"[A-Za-z_]+", message)
    return m.group(0) if m else None


def _encode(tokenizer, text: str) -> list[int]:
    from spanllm.engine.tokenizer import TokenizerError

    try:
        return tokenizer.encode(text)
    except TokenizerError as e:
        raise APIError(str(e), "prompt") from None


def completion_prompt(req: CompletionRequest, tokenizer, check_text=None) -> tuple[list[int], str | None]:
    """(prompt ids, prompt text for echo: the string given, or None for token ids). check_text(characters, param),
    if given, may refuse a text before it is tokenized."""
    p = req.prompt
    if isinstance(p, list) and p and isinstance(p[0], (str, list)):  # a batch of one (validate refused more)
        p = p[0]
    if isinstance(p, str):
        if not p:
            raise APIError("the prompt is empty: give at least one character", "prompt")
        if check_text is not None:
            check_text(len(p), "prompt")
        return _encode(tokenizer, p), p
    return list(p), None


def chat_prompt(req: ChatCompletionRequest, tokenizer, check_text=None) -> list[int]:
    from spanllm.engine.tokenizer import TokenizerError

    msgs = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in req.messages]
    if check_text is not None:
        check_text(sum(len(m["content"]) for m in msgs), "messages")
    try:
        return tokenizer.apply_chat_template(msgs)
    except TokenizerError as e:
        raise APIError(str(e), "messages") from None


def refused_param(message: str, chat: bool = False) -> str:
    """The field an engine refusal (validate_request's message) is about: the prompt (a chat's messages) unless it
    names another."""
    for name in ("stop_token_ids", "logit_bias", "stop strings", "top_k"):
        if name in message:
            return name.split()[0]
    return "messages" if chat else "prompt"


def engine_refusal(message: str, chat: bool, max_tokens_field: str = "max_tokens") -> APIError:
    """An engine refusal as the client's 400: its field (refused_param), and its message in the request's own names,
    where validate_request's uses the engine's ("the prompt", "max_tokens"): a chat's prompt is its messages, and its
    length is the field it sent (max_tokens or max_completion_tokens)."""
    if chat:
        message = message.replace(" in the prompt, ", " in the messages, ").replace(
            "Reduce the prompt ", "Reduce the messages "
        )
    message = message.replace(" or max_tokens", f" or {max_tokens_field}")
    return APIError(message, refused_param(message, chat))


def usage(num_prompt: int, num_output: int) -> dict:
    return {"prompt_tokens": num_prompt, "completion_tokens": num_output, "total_tokens": num_prompt + num_output}


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


_COMPLETION_LOGPROB_KEYS = ("tokens", "token_logprobs", "top_logprobs", "text_offset")


class LogprobsFormatter:
    """TokenLogprob lists -> OpenAI's shapes: completions' {tokens, token_logprobs, top_logprobs, text_offset}
    and chat's {content: [{token, logprob, bytes, top_logprobs}]}. A token's text is tokenizer.decode([id]).
    stop_strings: the request has some, which may cut a choice's text before its last tokens (`format`'s held)."""

    def __init__(
        self, tokenizer, chat: bool, prompt_ids: list[int] = (), start: int = 0, stop_strings: bool = False
    ) -> None:
        self.tokenizer, self.chat, self.stop_strings = tokenizer, chat, stop_strings
        # text_offset: each choice's characters so far, by its own detokenizer (the engine's text before stop
        # strings hold any back), from `start` (the echoed prompt's length)
        self._prompt_ids, self._start = list(prompt_ids), start
        self._choices: dict[int, _ChoiceText] = {}

    def token(self, tid: int) -> str:
        return self.tokenizer.decode([tid])

    def held(self, d) -> bool:
        """Whether engine event d's entries wait for their text (format): the choice may still lose text to a stop
        string, or (its last event) lost some to one."""
        return self.stop_strings and (not d.finished or isinstance(d.stop_reason, str))

    def format(self, lps, choice: int = 0, new_text: str = "", held: bool = False) -> dict:
        """The logprobs of one engine event's tokens of choice `choice` (new_text: the text the event emits), with
        those of earlier events that waited. text_offset (completions): characters of the choice's text before
        each token, as the detokenizer produces it: a token that ends inside a character adds none until the
        character completes, and text that a stop string may still remove counts (the offsets do not wait for it to
        be emitted), so they are the same streamed or not, with stop strings or without.
        held: an entry waits until the text emitted reaches past its token's start, so that none is sent for a
        token a stop string then cuts off; at the last event of a choice a stop string ended, those still waiting
        are the tokens at or after the cut, which gave the text nothing: they are dropped (a token straddling the
        cut stays). Streamed or not, a choice gets the same entries."""
        state = self._choices.get(choice)
        if state is None:
            state = self._choices[choice] = _ChoiceText(self.tokenizer.detokenizer(self._prompt_ids), self._start)
        for lp in lps:
            state.waiting.append((lp, state.chars))
            state.chars += len(state.detok.push(lp.token_id))
        state.emitted += len(new_text)
        ready = len(state.waiting)
        if held:
            ready = next((k for k, (_, off) in enumerate(state.waiting) if off >= state.emitted), ready)
        out, state.waiting = state.waiting[:ready], state.waiting[ready:]
        if self.chat:
            return {"content": [self._chat_entry(lp) for lp, _ in out]}
        return {
            "tokens": [self.token(lp.token_id) for lp, _ in out],
            "token_logprobs": [lp.logprob for lp, _ in out],
            "top_logprobs": [self._top_by_text(lp) for lp, _ in out],
            "text_offset": [off for _, off in out],
        }

    def merge(self, parts: list[dict]) -> dict:
        """The events' formatted logprobs of one choice, joined into the whole answer's."""
        if self.chat:
            return {"content": [e for p in parts for e in p["content"]]}
        return {k: [x for p in parts for x in p[k]] for k in _COMPLETION_LOGPROB_KEYS}

    def format_text(self, lps, choice: int = 0, new_text: str = "", held: bool = False) -> dict[str, str]:
        """`format`'s lists as JSON text without their brackets (a non-streaming answer keeps one string per key
        and event, not a dict per token: spanllm.serve.response_body)."""
        return {k: dumps(v)[1:-1] for k, v in self.format(lps, choice, new_text, held).items()}

    def merge_text(self, parts: list[dict[str, str]]) -> dict[str, RawJSON]:
        """format_text's events of one choice joined: `merge`'s lists, as RawJSON."""
        keys = ("content",) if self.chat else _COMPLETION_LOGPROB_KEYS
        return {k: RawJSON("[" + ",".join(p[k] for p in parts if p[k]) + "]") for k in keys}

    def _top_by_text(self, lp) -> dict[str, float]:
        """Completions' {text: logprob} of the top ids (most likely first), and of the sampled token where it is not
        among them (OpenAI: "up to logprobs + 1 elements", so that top_logprobs[i][tokens[i]] always exists). Ids
        that decode to the same text (a byte-level tokenizer's partial characters) share one key: it keeps the most
        likely one's logprob."""
        out: dict[str, float] = {}
        for t, v in lp.top:
            out.setdefault(self.token(t), v)
        out.setdefault(self.token(lp.token_id), lp.logprob)
        return out

    def _chat_entry(self, lp) -> dict:
        # bytes: the token's own (a partial character's too, where its text is U+FFFD), which a client joins
        # across tokens to rebuild a character split between them
        def one(tid: int, v: float) -> dict:
            return {"token": self.token(tid), "logprob": v, "bytes": list(self.tokenizer.token_bytes(tid))}

        return {**one(lp.token_id, lp.logprob), "top_logprobs": [one(t, v) for t, v in lp.top]}


class _ChoiceText:
    """LogprobsFormatter's state of one choice."""

    def __init__(self, detok, start: int) -> None:
        self.detok = detok
        self.chars = start  # the text's characters before the next token (its text_offset)
        self.emitted = start  # characters of the text sent (events' new_text)
        self.waiting: list[tuple] = []  # (TokenLogprob, text_offset) held back (format's held)


class PreparePools:
    """The worker threads that parse, validate and tokenize request bodies (CPU work proportional to the body: a
    megabyte of text tokenizes in seconds), off the event loop. Bodies above LARGE_BODY_BYTES queue for one thread
    of their own, so a burst of huge prompts (most of them refused once tokenized) waits behind itself and never in
    front of the small requests, which have `small_workers` threads."""

    def __init__(self, small_workers: int = 4) -> None:
        self.small = ThreadPoolExecutor(max_workers=small_workers, thread_name_prefix="spanllm-prepare")
        self.large = ThreadPoolExecutor(max_workers=1, thread_name_prefix="spanllm-prepare-large")

    def for_body(self, nbytes: int) -> ThreadPoolExecutor:
        return self.large if nbytes > LARGE_BODY_BYTES else self.small


def build_app(
    engine: AsyncEngine,
    tokenizer,
    *,
    model_name: str,
    max_model_len: int,
    metrics=None,
    limits: ServerLimits | None = None,
) -> FastAPI:
    limits = limits or ServerLimits()
    pools = PreparePools()
    app = FastAPI(title="spanllm", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(BodyLimitMiddleware, limits=limits)
    ctx_limit = min(max_model_len, engine.capacity_tokens)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        return error_response(e)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        what = {
            404: f"{request.url.path} is not a route of this server",
            405: f"{request.method} is not allowed on {request.url.path}",
        }.get(e.status_code, str(e.detail))
        return JSONResponse(
            error_body(what, _HTTP_ERROR_TYPES.get(e.status_code, "APIError"), None, e.status_code),
            e.status_code,
            headers=getattr(e, "headers", None),
        )

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception):
        return JSONResponse(error_body(f"{type(e).__name__}: {e}", "InternalServerError", None, 500), 500)

    def get(path: str):
        """A GET route that answers HEAD too (FastAPI's app.get does not: a load balancer probing with HEAD would get
        405); uvicorn sends a HEAD answer's status and headers without its body."""
        return app.api_route(path, methods=["GET", "HEAD"])

    @get("/health")
    async def health():
        if engine.alive:
            return Response(status_code=200)
        return JSONResponse(
            error_body(engine.error or "the engine is not running", "ServiceUnavailableError", None, 503), 503
        )

    @get("/metrics")
    async def metrics_():
        if metrics is None:
            return PlainTextResponse("")
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    def model_card() -> dict:
        return {
            "id": model_name,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "spanllm",
            "root": model_name,
            "max_model_len": ctx_limit,  # what a request can use: the KV pool may hold less than max_model_len
        }

    @get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @get("/v1/models/{model:path}")  # OpenAI's "retrieve model" (client.models.retrieve); ids may hold "/"
    async def model(model: str):
        if model != model_name:
            raise APIError(
                f"The model `{clip(model)}` does not exist: this server serves {model_name!r}",
                "model",
                404,
                "NotFoundError",
            )
        return model_card()

    def prepare(raw: bytes, chat: bool):
        """(request, sampling params of choice 0, prompt ids, echo text) from the raw body, or APIError."""
        req = parse(raw, chat)
        params = sampling_params(req, chat)
        prompt_ids, echo_text = tokenize(req, chat)
        return req, params, prompt_ids, echo_text

    def parse(raw: bytes, chat: bool):
        req = validate(
            parse_body(raw),
            chat,
            max_stop_strings=limits.max_stop_strings,
            max_stop_length=limits.max_stop_string_length,
            max_stop_token_ids=limits.max_stop_token_ids,
        )
        if req.model is not None and req.model != model_name:
            raise APIError(
                f"The model `{clip(req.model)}` does not exist: this server serves {model_name!r}",
                "model",
                404,
                "NotFoundError",
            )
        return req

    def submit(
        prompt_ids: list[int],
        params: SamplingParams,
        rid: str,
        n: int,
        chat: bool,
        max_tokens_field: str,
        chat_default: bool,
        most: int | None = None,
    ) -> list:
        """n engine requests (ids rid-0, rid-1, ...): their queues. Any refusal aborts those already in (the
        engine's named in the request's fields: engine_refusal). `most`: the tokens a chat without max_tokens may
        take at most besides the context (a non-streaming answer's logprobs)."""
        queued = engine.max_queued_requests
        if queued is not None:
            # the choices an idle server runs at once do not wait; more than it runs plus what its queue holds is
            # never admissible, even on an idle server: a 400, not a 503 to retry
            runs = engine.most_running(len(prompt_ids))
            if n > runs + queued:
                raise APIError(
                    f"n={n}: an idle server runs {runs} of these choices at once (--max-num-seqs and the KV cache) "
                    f"and the others wait in its queue, which holds {queued} requests (--max-queued-requests); "
                    f"use n <= {runs + queued}",
                    "n",
                )
        if chat_default:  # chat without max_tokens: the rest of the context
            room = ctx_limit - len(prompt_ids)
            if room < 1:
                raise APIError(
                    f"the messages take {len(prompt_ids)} tokens with the chat template, which leaves no room for "
                    f"an answer in this model's context of {ctx_limit} tokens; shorten them to at most "
                    f"{ctx_limit - 1} tokens",
                    "messages",
                )
            if params.min_tokens > room:  # refused, as with an explicit max_tokens, not lowered
                raise APIError(
                    f"min_tokens={params.min_tokens}: the prompt has {len(prompt_ids)} tokens, which leaves "
                    f"{room} of this model's context of {ctx_limit}; use min_tokens <= {room}",
                    "min_tokens",
                )
            if most is not None and most < room:
                if params.min_tokens > most:
                    raise APIError(
                        f"min_tokens={params.min_tokens}: with n={n} and the top {params.logprobs} logprobs, a "
                        f"non-streaming response holds at most {most} tokens ({MAX_RESPONSE_LOGPROB_ENTRIES} logprob "
                        "entries); stream it (stream=true), or lower min_tokens, n or top_logprobs",
                        "min_tokens",
                    )
                room = most  # the default stops where the response's logprob entries would pass their limit
            params = dataclasses.replace(params, max_tokens=room)
        queues = []
        try:
            for i in range(n):
                p = params
                if i and params.seed is not None:
                    # a copy by its fields: choice 0's params may already hold the sampler's cached properties
                    # (the in-process engine samples it on its own thread), which are not constructor arguments
                    p = dataclasses.replace(params, seed=seed_for_sample(params.seed, i))
                queues.append(engine.add(f"{rid}-{i}", prompt_ids, p, time.monotonic()))
        except RequestError as e:
            _abort_all(rid, len(queues))
            raise engine_refusal(str(e), chat, max_tokens_field) from None
        except (QueueFull, EngineUnavailable) as e:
            _abort_all(rid, len(queues))
            raise APIError(str(e), None, 503, "ServiceUnavailableError") from None
        return queues

    def _abort_all(rid: str, n: int) -> None:
        for i in range(n):
            engine.abort(f"{rid}-{i}")

    async def merged(queues: list, request: Request | None):
        """(choice index, event) from every choice's queue as they come; (None, None) if the client left
        (non-streaming: checked every DISCONNECT_POLL_S; streaming: the response's cancellation ends us)."""
        out: asyncio.Queue = asyncio.Queue()

        async def forward(i, q):
            while True:
                ev = await q.get()
                await out.put((i, ev))
                if not hasattr(ev, "finished") or ev.finished:
                    return

        tasks = [asyncio.create_task(forward(i, q)) for i, q in enumerate(queues)]
        checked = time.monotonic()
        try:
            while True:
                if request is not None and time.monotonic() - checked >= DISCONNECT_POLL_S:
                    checked = time.monotonic()  # checked by time, tokens or not
                    if await request.is_disconnected():
                        yield None, None
                        return
                try:
                    yield await asyncio.wait_for(out.get(), DISCONNECT_POLL_S)
                except asyncio.TimeoutError:
                    continue
        finally:
            for t in tasks:
                t.cancel()

    def event_error(ev, chat: bool) -> APIError | None:
        if isinstance(ev, EngineDead):
            return APIError(ev.message, None, 500, "InternalServerError")
        if isinstance(ev, Exception):
            return engine_refusal(str(ev), chat)
        if getattr(ev, "error", None):
            return APIError(f"handling this request failed: {ev.error}", None, 500, "InternalServerError")
        return None

    def check_logprob_entries(n: int, max_tokens: int, params: SamplingParams, field: str = "max_tokens") -> None:
        """A non-streaming response holds all its logprobs at once, in the front end's memory and its encoding
        time: at most MAX_RESPONSE_LOGPROB_ENTRIES (a stream holds none: each chunk goes out as it comes). field:
        the length field the client sent (length_field)."""
        entries = n * max_tokens * (params.logprobs + 1)
        if entries > MAX_RESPONSE_LOGPROB_ENTRIES:
            most = MAX_RESPONSE_LOGPROB_ENTRIES // (n * (params.logprobs + 1))
            raise APIError(
                f"logprobs: n={n} x {field}={max_tokens} x (top {params.logprobs} + the sampled token) = {entries} "
                f"logprob entries in one response, above the {MAX_RESPONSE_LOGPROB_ENTRIES} a non-streaming response "
                f"holds; stream them (stream=true), or use {field} <= {most}, or fewer choices or top logprobs",
                "logprobs",
            )

    def tokenize(req, chat: bool) -> tuple[list[int], str | None]:
        """(prompt ids, echo text). A text that must be longer than the context in tokens is refused before it is
        tokenized (text_fits)."""
        if chat:
            return chat_prompt(req, tokenizer, text_fits), None
        prompt_ids, echo_text = completion_prompt(req, tokenizer, text_fits)
        if req.echo and echo_text is None:
            echo_text = tokenizer.decode(prompt_ids)
        return prompt_ids, echo_text if req.echo else None

    def text_fits(chars: int, param: str) -> None:
        per_token = tokenizer.max_token_chars
        if chars <= TEXT_MARGIN * per_token * ctx_limit:
            return
        raise APIError(
            f"{param}: {chars} characters of text, which are more than {ctx_limit} tokens (this model's context) "
            f"whatever they say, since a token of this tokenizer covers at most {per_token} characters; shorten it",
            param,
        )

    async def handle(request: Request, chat: bool):
        raw = await request.body()
        # Parsing, validation and tokenizing are CPU work proportional to the body (8 MiB of text tokenizes in
        # seconds): a worker thread does it, so that the event loop keeps serving the other requests' streams, and
        # large bodies have a thread of their own (PreparePools).
        loop = asyncio.get_running_loop()
        req, params, prompt_ids, echo_text = await loop.run_in_executor(pools.for_body(len(raw)), prepare, raw, chat)
        chat_default = chat and req.max_completion_tokens is None and req.max_tokens is None
        max_tokens_field = length_field(req, chat)
        most = None
        if not req.stream and params.logprobs is not None:
            if chat_default:  # max_tokens defaults to the rest of the context, or what the entries allow
                most = MAX_RESPONSE_LOGPROB_ENTRIES // (req.n * (params.logprobs + 1))
            else:
                check_logprob_entries(req.n, params.max_tokens, params, max_tokens_field)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        queues = submit(prompt_ids, params, rid, req.n, chat, max_tokens_field, chat_default, most)
        lp = None
        if params.logprobs is not None:
            lp = LogprobsFormatter(tokenizer, chat, prompt_ids, len(echo_text or ""), stop_strings=bool(params.stop))
        base = {
            "id": rid,
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()),
            "model": model_name,
        }
        if not req.stream:
            return await complete(request, queues, rid, base, chat, len(prompt_ids), echo_text, lp)
        opts = req.stream_options
        include_usage = opts is not None and bool(opts.include_usage)
        continuous = include_usage and bool(opts.continuous_usage_stats)
        return StreamingResponse(
            stream_gen(queues, rid, base, chat, include_usage, continuous, len(prompt_ids), echo_text, lp),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache"},
        )

    async def complete(request, queues, rid, base, chat, num_prompt, echo_text, lp):
        n = len(queues)
        last: dict[int, Any] = {}
        lps: dict[int, list[dict]] = {i: [] for i in range(n)}  # each event's logprobs as JSON text (format_text)
        try:
            async for i, d in merged(queues, request):
                if d is None:
                    return Response(status_code=499)  # the client is gone; nobody reads this
                err = event_error(d, chat)
                if err is not None:
                    raise err
                if lp is not None:
                    lps[i].append(lp.format_text(d.new_logprobs or [], i, d.new_text, lp.held(d)))
                if d.finished:
                    last[i] = d
                    if len(last) == n:
                        break
        finally:
            for i in range(n):
                if i not in last:
                    engine.abort(f"{rid}-{i}")
        choices = []
        for i in range(n):
            d = last[i]
            text = (echo_text or "") + (d.text or "")
            choice: dict[str, Any] = {
                "index": i,
                "logprobs": None,
                "finish_reason": d.finish_reason,
                "stop_reason": d.stop_reason,
            }
            if lp is not None:
                choice["logprobs"] = lp.merge_text(lps[i])
            if chat:
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = text
            choices.append(choice)
        obj = "chat.completion" if chat else "text_completion"
        num_output = sum(last[i].num_output for i in range(n))
        body = {**base, "object": obj, "choices": choices, "usage": usage(num_prompt, num_output)}
        return Response(await encode_yielding(body), media_type="application/json")

    async def stream_gen(queues, rid, base, chat, include_usage, continuous, num_prompt, echo_text, lp):
        """continuous (stream_options.continuous_usage_stats): every chunk of choice i also carries the usage so far,
        with choice i's completion tokens (vLLM's count); the last chunk (include_usage) has all choices'."""
        n = len(queues)
        done: set[int] = set()
        num_output = [0] * n

        def chunk(i: int, text: str | None, logprobs=None, finish=None, role: bool = False, **extra) -> str:
            if chat:
                delta = {} if text is None else {"content": text}
                if role:
                    delta = {"role": "assistant", **delta}
                c = {"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": finish, **extra}
            else:
                c = {"index": i, "text": text or "", "logprobs": logprobs, "finish_reason": finish, **extra}
            if continuous:
                return sse({**base, "choices": [c], "usage": usage(num_prompt, num_output[i])})
            return sse({**base, "choices": [c]})

        try:
            for i in range(n):
                if chat:
                    yield chunk(i, "", role=True)
                elif echo_text:
                    yield chunk(i, echo_text)
            async for i, d in merged(queues, None):
                err = event_error(d, chat)
                if err is not None:
                    yield sse(error_body(err.message, err.type, err.param, err.status))
                    break
                num_output[i] = d.num_output
                if d.new_ids or d.new_text:  # one chunk per token step (text may be "": a partial character)
                    logprobs = None
                    if lp is not None:
                        logprobs = lp.format(d.new_logprobs or [], i, d.new_text, lp.held(d))
                        if not logprobs["content" if chat else "tokens"]:
                            logprobs = None  # this step's entries wait for their text (LogprobsFormatter.format)
                    yield chunk(i, d.new_text, logprobs)
                if d.finished:  # OpenAI's last chunk of a choice: no new text, the finish reason
                    done.add(i)
                    yield chunk(i, None if chat else "", None, d.finish_reason, stop_reason=d.stop_reason)
                    if len(done) == n:
                        break
            if include_usage and len(done) == n:
                yield sse({**base, "choices": [], "usage": usage(num_prompt, sum(num_output))})
            yield "data: [DONE]\n\n"
        finally:  # also on cancellation (the client disconnected)
            for i in range(n):
                if i not in done:
                    engine.abort(f"{rid}-{i}")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle(request, chat=True)

    _prime(prepare)
    return app


def _prime(prepare) -> None:
    """Pay the request path's first-use costs before the first client does (results/cpu_first_request/: a server's
    first chat stream sent its first byte after 64 ms, the later ones after 3 ms): the request parsing, validation
    and tokenization of a completion and a chat (its chat template compiled), and the modules a streaming response
    imports on first use. Nothing reaches the engine."""
    import anyio._core._sockets  # noqa: F401  (StreamingResponse's task group: imported on first use)
    import anyio.streams.memory  # noqa: F401
    import anyio.streams.stapled  # noqa: F401

    for body, chat in (
        ({"prompt": "Hello", "max_tokens": 1, "stream": True}, False),
        ({"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 1, "stream": True}, True),
    ):
        try:
            prepare(json.dumps(body).encode(), chat)
        except APIError:
            pass  # a tokenizer without a chat template refuses chat: nothing to prime there
        except Exception as e:  # priming is a speed-up only: the server starts, and the route answers for itself
            _log.warning("priming the %s route failed (%s: %s)", "chat" if chat else "completion", type(e).__name__, e)
