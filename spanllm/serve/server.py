"""The OpenAI-compatible HTTP server on rank 0: the engine thread and a uvicorn front end (`Server`), and the
uvicorn settings both front-end modes share. `spanllm serve` (spanllm.commands.serve) builds it.

Rank 0 runs the engine loop and the HTTP front end: by default the front end (uvicorn, FastAPI, tokenization,
JSON / SSE) in a process of its own, fed over a pipe (spanllm.serve.frontend_process), with
`--no-frontend-process` in rank 0's main thread beside the engine loop's thread (spanllm.serve.async_engine).
"""

from __future__ import annotations

import threading

from spanllm.serve.limits import ServerLimits, limited_h11_protocol


def make_uvicorn(
    app,
    *,
    host: str,
    port: int,
    log_level: str,
    on_signal,
    limits: ServerLimits | None = None,
    heartbeats=None,
):
    """The uvicorn server both modes run: on SIGINT / SIGTERM it first calls on_signal() (abort every request,
    so open streams end now), then shuts down gracefully (5 s). A signal is a request to stop, and a clean stop
    exits 0: uvicorn would re-raise the signal after its shutdown (exit status -15 / 143); it is not recorded.
    The connection limits (ServerLimits): header timeout, keep-alive, concurrent connections (503 beyond).
    heartbeats (spanllm.serve.health.Heartbeats, --health-port): the front end's heartbeat, on each of
    uvicorn's ticks (every 0.1 s while its event loop runs), and its state."""
    import uvicorn

    from spanllm.serve import health

    limits = limits or ServerLimits()

    class _Uvicorn(uvicorn.Server):
        def handle_exit(self, sig, frame):
            if heartbeats is not None:
                heartbeats.set_frontend(health.FRONTEND_STOPPING)
            on_signal()
            super().handle_exit(sig, frame)
            self._captured_signals.clear()

        async def on_tick(self, counter: int) -> bool:
            if heartbeats is not None:
                heartbeats.beat_frontend()
                heartbeats.set_frontend(health.FRONTEND_STOPPING if self.should_exit else health.FRONTEND_SERVING)
            return await super().on_tick(counter)

    return _Uvicorn(
        uvicorn.Config(
            app,
            host=host,
            port=port,
            log_level=log_level,
            timeout_graceful_shutdown=5,
            lifespan="off",
            http=limited_h11_protocol(limits.header_timeout_s, limits.max_connections),
            timeout_keep_alive=limits.keep_alive_s,
        )
    )


def bound_port(uv, port: int) -> int:
    """The port uvicorn listens on (port 0: the one the system chose, once it is started)."""
    if port == 0 and uv.servers:
        return uv.servers[0].sockets[0].getsockname()[1]
    return port


class Server:
    """Rank 0's front end: the engine thread and a uvicorn server (run() blocks; stop() from any thread)."""

    def __init__(
        self,
        llm,
        *,
        host: str = "127.0.0.1",
        port: int = 8000,
        model_name: str | None = None,
        max_queued_requests: int | None = None,
        log_level: str = "warning",
        limits: ServerLimits | None = None,
        heartbeats=None,
        warm_up=None,
    ) -> None:
        from spanllm.serve.api import build_app
        from spanllm.serve.async_engine import AsyncEngine
        from spanllm.serve.metrics import ServerMetrics

        core = llm.engine_core
        self.model_name = model_name or llm.config.name
        self.metrics = ServerMetrics(self.model_name)
        self.metrics.baseline(core)
        self.engine = AsyncEngine(
            core,
            max_queued_requests=max_queued_requests,
            metrics=self.metrics,
            on_dead=self._on_dead,
            heartbeats=heartbeats,
            warm_up=warm_up,
        )
        self.app = build_app(
            self.engine,
            llm.get_tokenizer(),
            model_name=self.model_name,
            max_model_len=core.config.max_model_len,
            metrics=self.metrics,
            limits=limits,
        )
        self._uv = make_uvicorn(
            self.app,
            host=host,
            port=port,
            log_level=log_level,
            on_signal=self.engine.abort_all,
            limits=limits,
            heartbeats=heartbeats,
        )
        self.host = host
        self._port = port

    @property
    def started(self) -> bool:
        return self._uv.started

    @property
    def port(self) -> int:
        return bound_port(self._uv, self._port)

    def _on_dead(self, message: str) -> None:
        self._uv.should_exit = True

    def run(self, on_started=None) -> None:
        """Warm up on the engine thread (warm_up; the port opens after it), serve until a signal (main thread) or
        stop(); then end the engine (releases the other ranks)."""
        self.engine.start()
        self.engine.wait_ready()
        try:
            if on_started is not None:
                threading.Thread(target=self._notify, args=(on_started,), daemon=True).start()
            self._uv.run()
        finally:
            self.engine.stop()
        if self.engine.error:
            raise RuntimeError(self.engine.error)

    def _notify(self, cb) -> None:
        import time

        while not self._uv.started and not self._uv.should_exit:
            time.sleep(0.02)
        if self._uv.started:
            cb(self)

    def stop(self) -> None:
        self.engine.abort_all()
        self._uv.should_exit = True
