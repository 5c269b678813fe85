"""The FastAPI app: OpenAI's /v1/completions, /v1/chat/completions (streaming and not), /v1/models,
/health, /metrics.

Bodies are parsed by hand (not pydantic models) so every bad parameter answers OpenAI's error body
with status 400 (FastAPI's default would be 422): {"error": {"message", "type", "param", "code"}}.

max_tokens defaults: 16 for completions (OpenAI's); for chat, the rest of the context, i.e.
min(max_model_len, KV pool tokens) - prompt tokens (vLLM's choice).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from spanllm.engine.engine_core import RequestError
from spanllm.engine.sampler import SamplingParams, SamplingParamsError
from spanllm.serve.async_engine import AsyncEngine, EngineDead, EngineUnavailable, QueueFull

DISCONNECT_POLL_S = 0.25  # non-streaming requests: how often the handler checks that its client is still there


class APIError(Exception):
    def __init__(
        self, message: str, param: str | None = None, status: int = 400, type_: str = "BadRequestError"
    ) -> None:
        super().__init__(message)
        self.message, self.param, self.status, self.type = message, param, status, type_


def error_body(message: str, type_: str = "BadRequestError", param: str | None = None, code: int = 400) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_response(e: APIError) -> JSONResponse:
    return JSONResponse(error_body(e.message, e.type, e.param, e.status), status_code=e.status)


# --- parameters ---------------------------------------------------------------------------------------
def _opt(body: dict, name: str, types, what: str):
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        raise APIError(f"{name}={v!r}: expected {what}", name)
    if not isinstance(v, types):
        raise APIError(f"{name}={v!r}: expected {what}", name)
    return v


def sampling_params(body: dict, default_max_tokens: int | None, chat: bool) -> tuple[SamplingParams, int | None]:
    """SamplingParams from an OpenAI body (max_tokens None: decided once the prompt length is known)."""
    n = body.get("n")
    if n is not None and n != 1:
        raise APIError(f"n={n!r}: this server returns one choice per request; use n=1", "n")
    for unsupported in ("logprobs", "echo", "best_of", "top_logprobs", "tools", "suffix"):
        v = body.get(unsupported)
        if v not in (None, False, 1 if unsupported == "best_of" else None, []):
            raise APIError(f"{unsupported} is not supported by this server", unsupported)
    max_tokens = _opt(body, "max_tokens", int, "an integer >= 1")
    if max_tokens is None and chat:
        max_tokens = _opt(body, "max_completion_tokens", int, "an integer >= 1")
    if max_tokens is not None and max_tokens < 1:
        raise APIError(f"max_tokens={max_tokens} must be an integer >= 1", "max_tokens")
    kw: dict[str, Any] = {}
    for name, types, what in (
        ("temperature", (int, float), "a number in [0, 2]"),
        ("top_p", (int, float), "a number in (0, 1]"),
        ("top_k", int, "an integer (-1 or 0: off)"),
        ("seed", int, "an integer"),
        ("min_tokens", int, "an integer >= 0"),
        ("ignore_eos", bool, "true or false"),
    ):
        v = _opt(body, name, types, what)
        if v is not None:
            kw[name] = float(v) if name in ("temperature", "top_p") else v
    if "temperature" in kw and not 0.0 <= kw["temperature"] <= 2.0:
        raise APIError(f"temperature={kw['temperature']} must be in [0, 2] (0 = greedy)", "temperature")
    stop = body.get("stop")
    if stop is not None:
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise APIError(f"stop={stop!r}: expected a string or a list of strings", "stop")
        kw["stop"] = tuple(s for s in stop if s)
    sti = body.get("stop_token_ids")
    if sti is not None:
        if not isinstance(sti, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in sti):
            raise APIError(f"stop_token_ids={sti!r}: expected a list of token ids", "stop_token_ids")
        kw["stop_token_ids"] = tuple(sti)
    mt = max_tokens if max_tokens is not None else (default_max_tokens or 1)
    try:
        params = SamplingParams(max_tokens=mt, **kw)
    except SamplingParamsError as e:
        raise APIError(str(e), str(e).split("=", 1)[0] or None)
    return params, max_tokens


def completion_prompt(body: dict, tokenizer, vocab_size: int) -> list[int]:
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]
    if isinstance(p, str):
        if not p:
            raise APIError("the prompt is empty: give at least one character", "prompt")
        return _encode(tokenizer, p)
    if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        return list(p)
    if isinstance(p, list) and len(p) > 1:
        raise APIError("batched prompts are not supported: send one prompt per request", "prompt")
    raise APIError("prompt must be a string or a list of token ids (or a list of one of those)", "prompt")


def _encode(tokenizer, text: str) -> list[int]:
    from spanllm.engine.tokenizer import TokenizerError

    try:
        return tokenizer.encode(text)
    except TokenizerError as e:
        raise APIError(str(e), "prompt")


def chat_prompt(body: dict, tokenizer) -> list[int]:
    from spanllm.engine.tokenizer import TokenizerError

    msgs = body.get("messages")
    if isinstance(msgs, list):  # content given as a list of text parts (OpenAI's newer shape)
        fixed = []
        for m in msgs:
            if isinstance(m, dict) and isinstance(m.get("content"), list):
                parts = m["content"]
                if all(isinstance(x, dict) and x.get("type") == "text" for x in parts):
                    m = {**m, "content": "".join(x.get("text", "") for x in parts)}
            fixed.append({"role": m.get("role"), "content": m.get("content")} if isinstance(m, dict) else m)
        msgs = fixed
    try:
        return tokenizer.apply_chat_template(msgs)
    except TokenizerError as e:
        raise APIError(str(e), "messages")


# --- the app --------------------------------------------------------------------------------------------
def usage(num_prompt: int, num_output: int) -> dict:
    return {"prompt_tokens": num_prompt, "completion_tokens": num_output, "total_tokens": num_prompt + num_output}


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def build_app(engine: AsyncEngine, tokenizer, *, model_name: str, max_model_len: int, metrics=None) -> FastAPI:
    app = FastAPI(title="spanllm", docs_url=None, redoc_url=None)
    vocab = engine.vocab_size
    ctx_limit = min(max_model_len, engine.capacity_tokens)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        return error_response(e)

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception):
        return JSONResponse(error_body(f"{type(e).__name__}: {e}", "InternalServerError", None, 500), 500)

    @app.get("/health")
    async def health():
        if engine.alive:
            return Response(status_code=200)
        return JSONResponse(
            error_body(engine.error or "the engine is not running", "ServiceUnavailableError", None, 503), 503
        )

    @app.get("/metrics")
    async def metrics_():
        if metrics is None:
            return PlainTextResponse("")
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [
                {
                    "id": model_name,
                    "object": "model",
                    "created": int(time.time()),
                    "owned_by": "spanllm",
                    "root": model_name,
                    "max_model_len": max_model_len,
                }
            ],
        }

    async def parse(request: Request) -> dict:
        raw = await request.body()
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise APIError(f"the request body is not valid JSON: {e}", None)
        if not isinstance(body, dict):
            raise APIError("the request body must be a JSON object", None)
        m = body.get("model")
        if m is not None and m != model_name:
            raise APIError(f"the model {m!r} does not exist: this server serves {model_name!r}", "model")
        so = body.get("stream_options")
        if so is not None and not isinstance(so, dict):
            raise APIError("stream_options must be an object", "stream_options")
        return body

    def submit(prompt_ids: list[int], params: SamplingParams, max_tokens: int | None, rid: str):
        if max_tokens is None:  # chat without max_tokens: the rest of the context
            room = ctx_limit - len(prompt_ids)
            if room < 1:
                raise APIError(
                    f"the prompt has {len(prompt_ids)} tokens, which leaves no room in this model's "
                    f"context of {ctx_limit} tokens",
                    "messages",
                )
            params = SamplingParams(
                **{**params.__dict__, "max_tokens": room, "min_tokens": min(params.min_tokens, room)}
            )
        try:
            return engine.add(rid, prompt_ids, params, time.monotonic())
        except RequestError as e:
            raise APIError(str(e), "prompt")
        except QueueFull as e:
            raise APIError(str(e), None, 503, "ServiceUnavailableError")
        except EngineUnavailable as e:
            raise APIError(str(e), None, 503, "ServiceUnavailableError")

    async def next_event(q: asyncio.Queue, request: Request, state: dict):
        """The next Delta; None if the client went away (checked every DISCONNECT_POLL_S, tokens or not)."""
        while True:
            now = time.monotonic()
            if now - state.get("checked", now) >= DISCONNECT_POLL_S:
                state["checked"] = now
                if await request.is_disconnected():
                    return None
            state.setdefault("checked", now)
            try:
                return await asyncio.wait_for(q.get(), DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                continue

    async def handle(request: Request, chat: bool):
        body = await parse(request)
        params, max_tokens = sampling_params(body, None if chat else 16, chat)
        if chat:
            prompt_ids = chat_prompt(body, tokenizer)
        else:
            prompt_ids = completion_prompt(body, tokenizer, vocab)
            max_tokens = params.max_tokens
        stream = bool(body.get("stream"))
        include_usage = bool((body.get("stream_options") or {}).get("include_usage")) and stream
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        q = submit(prompt_ids, params, max_tokens, rid)
        created = int(time.time())
        obj = "chat.completion.chunk" if chat else "text_completion"
        base = {"id": rid, "object": obj, "created": created, "model": model_name}
        if not stream:
            return await complete(request, q, rid, base, chat, len(prompt_ids))
        return StreamingResponse(
            stream_gen(q, rid, base, chat, include_usage, len(prompt_ids)),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache"},
        )

    async def complete(request, q, rid, base, chat, num_prompt):
        finished = False
        state: dict = {}
        try:
            while True:
                d = await next_event(q, request, state)
                if d is None:
                    return Response(status_code=499)  # the client is gone; nobody reads this
                if isinstance(d, EngineDead):
                    raise APIError(d.message, None, 500, "InternalServerError")
                if isinstance(d, Exception):
                    raise APIError(str(d), "prompt")
                if d.finished:
                    finished = True
                    break
        finally:
            if not finished:
                engine.abort(rid)
        text = d.text or ""
        choice: dict[str, Any] = {
            "index": 0,
            "logprobs": None,
            "finish_reason": d.finish_reason,
            "stop_reason": d.stop_reason,
        }
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        obj = "chat.completion" if chat else "text_completion"
        return {**base, "object": obj, "choices": [choice], "usage": usage(num_prompt, d.num_output)}

    async def stream_gen(q, rid, base, chat, include_usage, num_prompt):
        finished = False
        num_output = 0
        try:
            if chat:
                yield sse(
                    {
                        **base,
                        "choices": [
                            {
                                "index": 0,
                                "delta": {"role": "assistant", "content": ""},
                                "logprobs": None,
                                "finish_reason": None,
                            }
                        ],
                    }
                )
            while True:
                d = await q.get()
                if isinstance(d, EngineDead):
                    yield sse(error_body(d.message, "InternalServerError", None, 500))
                    finished = True
                    break
                if isinstance(d, Exception):
                    yield sse(error_body(str(d), "BadRequestError", "prompt", 400))
                    finished = True
                    break
                num_output = d.num_output
                if d.new_ids or d.new_text:  # one chunk per token step (text may be "": a partial character)
                    if chat:
                        choice = {"index": 0, "delta": {"content": d.new_text}, "logprobs": None, "finish_reason": None}
                    else:
                        choice = {"index": 0, "text": d.new_text, "logprobs": None, "finish_reason": None}
                    yield sse({**base, "choices": [choice]})
                if d.finished:  # OpenAI's last chunk: no new text, the finish reason
                    if chat:
                        choice = {"index": 0, "delta": {}, "logprobs": None, "finish_reason": d.finish_reason}
                    else:
                        choice = {"index": 0, "text": "", "logprobs": None, "finish_reason": d.finish_reason}
                    choice["stop_reason"] = d.stop_reason
                    yield sse({**base, "choices": [choice]})
                if d.finished:
                    finished = True
                    break
            if include_usage:
                yield sse({**base, "choices": [], "usage": usage(num_prompt, num_output)})
            yield "data: [DONE]\n\n"
        finally:  # also on cancellation (the client disconnected)
            if not finished:
                engine.abort(rid)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle(request, chat=True)

    return app
