"""A tiny OpenAI-compatible streaming server for the bench serve tests (aiohttp.web in its own thread and loop).

Deterministic: a completion has exactly max_tokens chunks "tok0 ", "tok1 ", ...; usage reports
prompt_tokens = the number of words in the prompt and completion_tokens = max_tokens. A prompt containing
FAIL gets a 400 OpenAI error body; one containing SLOW waits 30 s before answering (for timeout tests).
"""

from __future__ import annotations

import asyncio
import json
import threading

from aiohttp import web


class FakeServer:
    def __init__(self, token_delay_s: float = 0.001, usage: bool = True, model: str = "fake-model") -> None:
        self.token_delay_s = token_delay_s
        self.usage = usage
        self.model = model
        self.bodies: list[dict] = []  # every generation request body received
        self.in_flight = 0
        self.max_in_flight = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._thread: threading.Thread | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> FakeServer:
        ready = threading.Event()
        errors: list[BaseException] = []

        def serve() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            asyncio.set_event_loop(loop)
            try:
                loop.run_until_complete(self._start())
            except BaseException as e:  # reported to the test thread
                errors.append(e)
                ready.set()
                return
            ready.set()
            loop.run_forever()
            loop.run_until_complete(self._runner.cleanup())
            loop.close()

        self._thread = threading.Thread(target=serve, daemon=True)
        self._thread.start()
        if not ready.wait(10) or errors:
            raise RuntimeError(f"fake server did not start: {errors}")
        return self

    def __exit__(self, *exc) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        assert not self._thread.is_alive(), "fake server thread did not stop"

    async def _start(self) -> None:
        app = web.Application()
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        self._runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=1.0, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)  # a free port
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "object": "list",
                "data": [{"id": self.model, "object": "model"}, {"id": "other-model", "object": "model"}],
            }
        )

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    async def _generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        prompt = body["messages"][0]["content"] if chat else body["prompt"]
        if "FAIL" in prompt:
            return web.json_response(
                {"error": {"message": "bad prompt", "type": "BadRequestError", "code": 400}}, status=400
            )
        if "SLOW" in prompt:
            await asyncio.sleep(30)
        n = int(body["max_tokens"])
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)

            async def send(obj) -> None:
                await resp.write(f"data: {json.dumps(obj)}\n\n".encode())

            base = {"id": "cmpl-1", "model": body["model"], "created": 0}
            if chat:  # role header first, as vLLM's and OpenAI's chat streams do
                await send(
                    {
                        **base,
                        "object": "chat.completion.chunk",
                        "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}],
                    }
                )
            await resp.write(b": keep-alive comment\n\n")
            for i in range(n):
                await asyncio.sleep(self.token_delay_s)
                if chat:
                    choice = {"index": 0, "delta": {"content": f"tok{i} "}, "finish_reason": None}
                else:
                    choice = {"index": 0, "text": f"tok{i} ", "finish_reason": None}
                await send({**base, "choices": [choice]})
            # a bare final chunk carrying only the finish reason (transformers serve and others send one)
            final = (
                {"index": 0, "delta": {}, "finish_reason": "length"}
                if chat
                else {"index": 0, "text": "", "finish_reason": "length"}
            )
            await send({**base, "choices": [final]})
            if self.usage and body.get("stream_options", {}).get("include_usage"):
                p = len(prompt.split())
                await send(
                    {
                        **base,
                        "choices": [],
                        "usage": {"prompt_tokens": p, "completion_tokens": n, "total_tokens": p + n},
                    }
                )
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp
        finally:
            self.in_flight -= 1
