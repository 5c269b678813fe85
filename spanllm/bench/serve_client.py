"""One streamed request to an OpenAI-compatible server, timed as vLLM's `bench serve` times it.

`send_request` posts to /v1/completions or /v1/chat/completions with `stream: true` and
`stream_options: {include_usage: true}`, reads the server-sent events and records:
- ttft: send -> first token chunk; itl: the gaps between token chunks; latency (E2EL): send -> last token chunk;
- output_tokens and prompt_len from the usage chunk when the server sends one (0 / the sample's otherwise).

What counts as a token chunk (vLLM's `lib/endpoint_request_func.py`, plus one rule for chunks that carry no token):
a chunk with `choices` whose text (completions) or delta content (chat) is non-empty, or empty with no
`finish_reason` (a token that decodes to nothing, such as a special token). Not counted: the chat role header
(`delta: {role: assistant, content: ""}`) and a bare final chunk (empty text with a finish_reason), which some
servers send and vLLM's client would count as a token.
"""

from __future__ import annotations

import asyncio
import codecs
import json
import os
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from spanllm.errors import SpanllmError


@dataclass
class RequestInput:
    prompt: str
    prompt_len: int
    output_len: int
    model: str
    api_url: str
    chat: bool = False
    ignore_eos: bool = False
    extra_body: dict[str, Any] | None = None
    request_id: str | None = None


@dataclass
class RequestOutput:
    success: bool = False
    generated_text: str = ""
    latency: float = 0.0  # s, send -> last token chunk
    output_tokens: int = 0  # from the usage chunk; 0 when the server sent none
    ttft: float = 0.0  # s
    itl: list[float] = field(default_factory=list)  # s, gaps between token chunks
    chunks: int = 0  # token chunks received
    prompt_len: int = 0  # the usage chunk's prompt_tokens when present, else the sample's
    error: str = ""
    start_time: float = 0.0  # time.perf_counter() when the request was sent
    client_queue_time: float = 0.0  # s waited for the --max-concurrency semaphore


def payload(inp: RequestInput) -> dict[str, Any]:
    """The request body vLLM's benchmark client sends: greedy unless the extra body says otherwise (vLLM's bench
    serve sends temperature 0 when none is given; a server's own default, OpenAI's 1, would sample)."""
    body: dict[str, Any] = {
        "model": inp.model,
        "max_tokens": inp.output_len,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if inp.chat:
        body["messages"] = [{"role": "user", "content": inp.prompt}]
    else:
        body["prompt"] = inp.prompt
    if inp.ignore_eos:
        body["ignore_eos"] = True
    if inp.extra_body:
        body.update(inp.extra_body)
    return body


def headers(inp: RequestInput) -> dict[str, str]:
    h = {"Content-Type": "application/json"}
    if key := os.environ.get("OPENAI_API_KEY"):
        h["Authorization"] = f"Bearer {key}"
    if inp.request_id:
        h["x-request-id"] = inp.request_id
    return h


class SSEReader:
    """Incremental server-sent-events parser: feed bytes, get the `data` payload of each complete event."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")()
        self._buf = ""

    def feed(self, data: bytes) -> list[str]:
        self._buf += self._decoder.decode(data).replace("\r\n", "\n").replace("\r", "\n")
        events = []
        while "\n\n" in self._buf:
            block, self._buf = self._buf.split("\n\n", 1)
            lines = [ln[5:].removeprefix(" ") for ln in block.split("\n") if ln.startswith("data:")]
            if lines:  # comments (":ping") and other fields carry no data
                events.append("\n".join(lines))
        return events

    def close(self) -> list[str]:
        return self.feed(b"\n\n") if self._buf.strip() else []


def token_text(chunk: dict[str, Any], chat: bool) -> str | None:
    """The text of a token chunk, or None when the chunk carries no token (see the module docstring)."""
    choices = chunk.get("choices")
    if not choices:
        return None
    c = choices[0]
    if chat:
        delta = c.get("delta") or {}
        text = delta.get("content") or delta.get("reasoning_content") or ""
        if text or (c.get("finish_reason") is None and "role" not in delta):
            return text
        return None
    text = c.get("text") or ""
    return text if text or c.get("finish_reason") is None else None


async def send_request(session: aiohttp.ClientSession, inp: RequestInput, timeout_s: float) -> RequestOutput:
    """Send one streamed request; never raises: errors (HTTP status and body, timeouts, broken streams) are in
    `error` with success=False."""
    out = RequestOutput(prompt_len=inp.prompt_len)
    text_parts: list[str] = []
    st = time.perf_counter()
    out.start_time = last = st
    try:
        async with session.post(
            inp.api_url, json=payload(inp), headers=headers(inp), timeout=aiohttp.ClientTimeout(total=timeout_s)
        ) as resp:
            if resp.status != 200:
                body = (await resp.text())[:1000]
                out.error = f"HTTP {resp.status} {resp.reason}: {body}"
                return out
            reader = SSEReader()
            events_done = False
            async for data in resp.content.iter_any():
                for event in reader.feed(data):
                    if event.strip() == "[DONE]":
                        events_done = True
                        continue
                    now = time.perf_counter()
                    chunk = json.loads(event)
                    if "error" in chunk and not chunk.get("choices"):
                        raise SpanllmError(f"server error in stream: {chunk['error']}")
                    text = token_text(chunk, inp.chat)
                    if text is not None:
                        if out.chunks == 0:
                            out.ttft = now - st
                        else:
                            out.itl.append(now - last)
                        last = now
                        out.chunks += 1
                        text_parts.append(text)
                    if usage := chunk.get("usage"):
                        out.output_tokens = int(usage.get("completion_tokens") or 0)
                        if usage.get("prompt_tokens") is not None:
                            out.prompt_len = int(usage["prompt_tokens"])
            out.generated_text = "".join(text_parts)
            if out.chunks == 0:
                out.error = "the stream ended without a token chunk (no TTFT)" + (
                    "" if events_done else " and without data: [DONE]"
                )
                return out
            out.latency = last - st
            out.success = True
    except asyncio.TimeoutError:
        out.error = f"timed out after {timeout_s:g} s (--request-timeout)"
    except Exception as e:  # the request failed; the benchmark counts it and goes on
        out.error = f"{type(e).__name__}: {e}"
    return out


async def first_model(session: aiohttp.ClientSession, base_url: str, timeout_s: float = 30.0) -> str:
    """The id of the first model GET /v1/models lists (what vLLM's bench serve uses when --model is not given)."""
    url = f"{base_url}/v1/models"
    try:
        async with session.get(
            url,
            headers={k: v for k, v in headers(RequestInput("", 0, 0, "", "")).items() if k != "Content-Type"},
            timeout=aiohttp.ClientTimeout(total=timeout_s),
        ) as resp:
            resp.raise_for_status()
            data = await resp.json(content_type=None)
    except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError) as e:
        raise SpanllmError(
            f"could not list models at {url} ({type(e).__name__}: {e}); is the server up at "
            f"--base-url {base_url}? Or pass --model"
        ) from e
    models = data.get("data") or []
    if not models:
        raise SpanllmError(f"{url} lists no models; pass --model")
    return models[0]["id"]
