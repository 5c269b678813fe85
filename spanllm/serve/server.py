"""`spanllm serve`: an OpenAI-compatible HTTP server on the serving engine.

    spanllm serve --model tiny --dtype float32 --port 8000                        # CPU, one process
    spanllm serve --model tiny --dtype float32 --nprocs 2                         # CPU, TP=2 over gloo
    torchrun --nproc-per-node 8 -m spanllm.cli serve --model llama3.1-70b          # one node, TP=8

Every rank builds the engine; rank 0 runs the engine loop and the HTTP front end: by default the front end
(uvicorn, FastAPI, tokenization, JSON / SSE) in a process of its own, fed over a pipe
(spanllm.serve.frontend_process), with `--no-frontend-process` in rank 0's main thread beside the engine loop's
thread (spanllm.serve.async_engine); the other ranks run `EngineCore.worker_loop()`.

Shutdown: SIGINT / SIGTERM on rank 0 stop uvicorn from accepting, abort every request (streams end with
finish_reason "abort"), then the engine thread calls `shutdown_workers()` and the other ranks leave their
worker loop and exit 0. A signal on another rank only arms a deadline (WORKER_EXIT_S): it waits for rank
0's shutdown plan, else exits. Under `--nprocs`, a signal to the launching process stops every rank.

A rank that dies: rank 0's next step fails (gloo / NCCL: connection closed), the engine thread records
the error, fails the open requests (500), and the server exits 1; under `--nprocs` (spanllm.launch) the
parent's error names the rank that died; under torchrun, torchrun reports the failed rank.

Idle servers: the other ranks wait for the next plan in a collective, which is bounded by the collective
timeout (--pg-timeout); an idle engine thread sends them an empty plan every SPANLLM_SERVE_HEARTBEAT_S
seconds (10), so the normal timeout holds and a rank that hangs (or dies) is noticed within it.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading

from spanllm.errors import UsageError

WORKER_EXIT_S = 5.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from spanllm.bench.throughput import add_engine_arguments
    from spanllm.engine.generate import add_model_arguments

    add_model_arguments(parser)
    add_engine_arguments(parser)
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0: every interface)")
    g.add_argument("--port", type=int, default=8000, help="TCP port (0: any free port, printed at start)")
    g.add_argument("--served-model-name", default=None, help="model id in the API (default: --model)")
    g.add_argument("--max-queued-requests", type=int, default=None,
                   help="waiting requests beyond which new ones get 503 (default: unbounded)")
    g.add_argument("--no-warmup", action="store_true", help="skip the warm-up request and decode-graph capture")
    g.add_argument("--log-level", default="warning", help="uvicorn log level (info logs every request)")
    g.add_argument("--frontend-process", action=argparse.BooleanOptionalAction, default=True,
                   help="run the HTTP front end (uvicorn, tokenization, JSON) in its own process (the default: "
                        "at rate inf on one H200 it served 9,592 output tok/s, 0.97 of offline, against 8,512 with "
                        "the thread; results/h200/engine_speed/README.md); --no-frontend-process runs it in a "
                        "thread beside the engine loop, in the engine's process")


def check_args(args: argparse.Namespace) -> None:
    from spanllm import checks
    from spanllm.bench.throughput import check_engine_arguments

    check_engine_arguments(args)
    if not 0 <= args.port <= 65535:
        raise UsageError(f"--port {args.port}: give a TCP port in [0, 65535]")
    checks.at_least("--max-queued-requests", args.max_queued_requests, 1, " (leave it out: unbounded)")


def make_uvicorn(app, *, host: str, port: int, log_level: str, on_signal):
    """The uvicorn server both modes run: on SIGINT / SIGTERM it first calls on_signal() (abort every request,
    so open streams end now), then shuts down gracefully (5 s)."""
    import uvicorn

    class _Uvicorn(uvicorn.Server):
        def handle_exit(self, sig, frame):
            on_signal()
            super().handle_exit(sig, frame)

    return _Uvicorn(uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5,
                                   lifespan="off"))


def bound_port(uv, port: int) -> int:
    """The port uvicorn listens on (port 0: the one the system chose, once it is started)."""
    if port == 0 and uv.servers:
        return uv.servers[0].sockets[0].getsockname()[1]
    return port


class Server:
    """Rank 0's front end: the engine thread and a uvicorn server (run() blocks; stop() from any thread)."""

    def __init__(self, llm, *, host: str = "127.0.0.1", port: int = 8000, model_name: str | None = None,
                 max_queued_requests: int | None = None, log_level: str = "warning") -> None:
        from spanllm.serve.api import build_app
        from spanllm.serve.async_engine import AsyncEngine
        from spanllm.serve.metrics import ServerMetrics

        core = llm.engine_core
        self.model_name = model_name or llm.config.name
        self.metrics = ServerMetrics(self.model_name)
        self.metrics.baseline(core)
        self.engine = AsyncEngine(core, max_queued_requests=max_queued_requests, metrics=self.metrics,
                                  on_dead=self._on_dead)
        self.app = build_app(self.engine, llm.get_tokenizer(), model_name=self.model_name,
                             max_model_len=core.config.max_model_len, metrics=self.metrics)
        self._uv = make_uvicorn(self.app, host=host, port=port, log_level=log_level, on_signal=self.engine.abort_all)
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
        """Serve until a signal (main thread) or stop(); then end the engine (releases the other ranks)."""
        self.engine.start()
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


def _worker(llm, warm: bool) -> None:
    """Ranks > 0: run rank 0's plans until its shutdown plan; a signal arms an exit deadline."""
    core = llm.engine_core

    def on_signal(signum, frame):
        t = threading.Timer(WORKER_EXIT_S, lambda: os._exit(128 + signum))
        t.daemon = True
        t.start()

    if threading.current_thread() is threading.main_thread():
        for s in (signal.SIGTERM, signal.SIGINT):
            signal.signal(s, on_signal)
    if warm:
        from spanllm.bench.throughput import warm_up_worker

        warm_up_worker(llm)
    core.worker_loop()


def _rank(ctx, args: argparse.Namespace):
    from spanllm.bench.throughput import build_llm, warm_up

    llm = build_llm(ctx, args)
    try:
        core = llm.engine_core
        if core.rank != 0:
            _worker(llm, not args.no_warmup)
            return None
        print(llm.describe_serving(), flush=True)
        if not args.no_warmup:
            warm_up(llm)
        if args.frontend_process:
            from spanllm.serve.frontend_process import ProcessServer

            server_cls = ProcessServer
        else:
            server_cls = Server
        server = server_cls(llm, host=args.host, port=args.port, model_name=args.served_model_name or args.model,
                            max_queued_requests=args.max_queued_requests, log_level=args.log_level)
        server.run(on_started=lambda s: print(f"spanllm serve: {s.model_name!r} on http://{s.host}:{s.port} "
                                              f"(world {ctx.world_size})", flush=True))
        return None
    finally:
        llm.close()


def run(args: argparse.Namespace) -> int:
    from spanllm.launch import DistContext, finish, launch, under_launcher

    check_args(args)
    if under_launcher() or args.nprocs > 1:
        launch(_rank, args, nprocs=args.nprocs)
    else:  # one local process: no spawn, signals reach uvicorn directly
        from spanllm.engine.llm import default_device

        dev = default_device()
        _rank(DistContext(0, 1, 0, 1, "nccl" if dev.type == "cuda" else "gloo", dev), args)
    return finish(0)


if __name__ == "__main__":
    from spanllm.cli import main

    sys.exit(main(["serve", *sys.argv[1:]]))
