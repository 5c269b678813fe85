"""`spanllm serve`: an OpenAI-compatible HTTP server on the serving engine (the server itself: spanllm.serve).

    spanllm serve tiny --dtype float32 --port 8000                                # CPU, one process (or --model)
    spanllm serve --model tiny --dtype float32 --nprocs 2                         # CPU, TP=2 over gloo
    torchrun --nproc-per-node 8 -m spanllm.cli serve --model llama3.1-70b          # one node, TP=8

Every rank builds the engine; rank 0 runs the engine loop and the HTTP front end: by default the front end
(uvicorn, FastAPI, tokenization, JSON / SSE) in a process of its own, fed over a pipe
(spanllm.serve.frontend_process), with `--no-frontend-process` in rank 0's main thread beside the engine loop's
thread (spanllm.serve.async_engine); the other ranks run `EngineCore.worker_loop()`.

Exit status: 0 after a clean SIGINT / SIGTERM shutdown, in every front-end mode; 1 when the engine loop failed
(the reason is logged, every open request answered 500 first); 2 for a bad flag.

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
import logging
import os
import signal
import sys
import threading

from spanllm.engine import cuda_allocator
from spanllm.errors import UsageError
from spanllm.serve.health import DEFAULT_STALL_TIMEOUT_S, HealthPort
from spanllm.serve.limits import ServerLimits
from spanllm.serve.server import Server

USES_COLLECTIVES = True  # its ranks join a process group (spanllm.launch): --pg-timeout applies

WORKER_EXIT_S = 5.0
_log = logging.getLogger("spanllm.serve")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from spanllm.commands.engine_args import add_engine_arguments, add_model_arguments

    add_model_arguments(parser, positional=True)  # `spanllm serve MODEL`, as vLLM's, or --model
    add_engine_arguments(parser)
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0: every interface)")
    g.add_argument("--port", type=int, default=8000, help="TCP port (0: any free port, printed at start)")
    g.add_argument("--served-model-name", default=None, help="model id in the API (default: --model)")
    g.add_argument(
        "--max-queued-requests",
        type=int,
        default=None,
        help="waiting requests beyond which new ones get 503 (default: unbounded)",
    )
    d = ServerLimits()
    g.add_argument(
        "--max-body-bytes",
        type=int,
        default=d.max_body_bytes,
        help="largest request body; a larger Content-Length (or body) answers 413 before it is read",
    )
    g.add_argument(
        "--header-timeout",
        type=float,
        default=d.header_timeout_s,
        help="seconds a connection may take to send its request line and headers",
    )
    g.add_argument(
        "--body-timeout",
        type=float,
        default=d.body_timeout_s,
        help="seconds a request body may pause between two chunks; then 408",
    )
    g.add_argument(
        "--keep-alive-timeout",
        type=float,
        default=d.keep_alive_s,
        help="seconds an idle keep-alive connection stays open",
    )
    g.add_argument(
        "--max-connections",
        type=int,
        default=d.max_connections,
        help="connections open at once; one opened beyond them is answered 503 (OpenAI's error body) and closed",
    )
    g.add_argument("--max-stop-strings", type=int, default=d.max_stop_strings, help="stop strings per request")
    g.add_argument(
        "--max-stop-string-length",
        type=int,
        default=d.max_stop_string_length,
        help="characters per stop string",
    )
    g.add_argument("--max-stop-token-ids", type=int, default=d.max_stop_token_ids, help="stop_token_ids per request")
    g.add_argument(
        "--health-port",
        type=int,
        default=None,
        help="also answer GET /health on this port, from a small process of its own that reads the engine's and "
        "the front end's heartbeats: it answers within milliseconds however busy the server is (0: any free "
        "port, printed at start; default: off, /health on --port only)",
    )
    g.add_argument(
        "--health-stall-timeout",
        type=float,
        default=None,
        help=f"seconds without a heartbeat from the engine loop or the front end's event loop after which "
        f"--health-port answers 503 (default {DEFAULT_STALL_TIMEOUT_S:g})",
    )
    g.add_argument("--no-warmup", action="store_true", help="skip the warm-up request and decode-graph capture")
    g.add_argument(
        "--log-level",
        default="warning",
        choices=("critical", "error", "warning", "info", "debug", "trace"),
        help="uvicorn log level (info logs every request)",
    )
    g.add_argument(
        "--frontend-process",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run the HTTP front end (uvicorn, tokenization, JSON) in its own process, so that it takes no host "
        "time from the engine loop (the default); --no-frontend-process runs it in a thread beside the engine "
        "loop, in the engine's process",
    )


def check_args(args: argparse.Namespace) -> None:
    from spanllm import checks
    from spanllm.commands.engine_args import check_engine_arguments, check_tokenizer_fits, model_from_args

    model_from_args(args, "spanllm serve")
    cfg = check_engine_arguments(args)
    if not 0 <= args.port <= 65535:
        raise UsageError(f"--port {args.port}: give a TCP port in [0, 65535]")
    if args.health_port is not None:
        if not 0 <= args.health_port <= 65535:
            raise UsageError(f"--health-port {args.health_port}: give a TCP port in [0, 65535]")
        if args.health_port == args.port != 0:
            raise UsageError(
                f"--health-port {args.health_port}: the same port as --port; give it another one (0: any free port)"
            )
    if args.health_stall_timeout is not None:
        if args.health_port is None:
            raise UsageError("--health-stall-timeout: applies to --health-port only; give --health-port too")
        if not 0 < args.health_stall_timeout <= 3600:  # nan fails too
            raise UsageError(f"--health-stall-timeout {args.health_stall_timeout}: give seconds in (0, 3600]")
    checks.at_least("--max-queued-requests", args.max_queued_requests, 1, " (leave it out: unbounded)")
    for flag in ("max_body_bytes", "max_connections", "max_stop_string_length"):
        checks.at_least("--" + flag.replace("_", "-"), getattr(args, flag), 1)
    checks.at_least("--max-stop-strings", args.max_stop_strings, 0)
    checks.at_least("--max-stop-token-ids", args.max_stop_token_ids, 0)
    for flag in ("header_timeout", "body_timeout", "keep_alive_timeout"):
        v = getattr(args, flag)
        if not 0 < v <= 3600:  # nan fails too
            raise UsageError(f"--{flag.replace('_', '-')} {v}: give seconds in (0, 3600]")
    checks.at_least("--nprocs", args.nprocs, 1, " (local gloo ranks)")
    checks.at_least("--ranks-per-node", args.ranks_per_node, 1)
    checks.at_least("--tp", args.tp, 1)
    checks.at_least("--max-model-len", args.max_model_len, 1)
    if cfg is not None:  # last: it loads the tokenizer (bench throughput loads its own and checks its ids)
        check_tokenizer_fits(cfg)


def server_limits(args: argparse.Namespace) -> ServerLimits:
    return ServerLimits(
        max_body_bytes=args.max_body_bytes,
        header_timeout_s=args.header_timeout,
        body_timeout_s=args.body_timeout,
        keep_alive_s=args.keep_alive_timeout,
        max_connections=args.max_connections,
        max_stop_strings=args.max_stop_strings,
        max_stop_string_length=args.max_stop_string_length,
        max_stop_token_ids=args.max_stop_token_ids,
    )


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
        from spanllm.engine.warmup import warm_up_worker

        warm_up_worker(llm)
    core.worker_loop()


def _rank(ctx, args: argparse.Namespace):
    from spanllm.commands.engine_args import build_llm
    from spanllm.engine.warmup import warm_up

    if ctx.rank == 0:
        _log.info("building the engine: model %s", args.model)
    llm = build_llm(ctx, args)
    llm.get_tokenizer()
    try:
        core = llm.engine_core
        if core.rank != 0:
            _worker(llm, not args.no_warmup)
            return None
        print(llm.describe(), flush=True)

        def warm() -> None:  # on the engine thread, where the steps will run (spanllm.serve.async_engine)
            _log.info("warming up (a short request, decode-graph capture, on a GPU a prompt of two full chunks)")
            w = warm_up(llm)
            _log.info(
                "warm-up done in %.1f s: %d decode graphs, a %d-token prefill, the prefill attention at %d chunk "
                "shapes",
                w["warmup_s"],
                len(w["graph_buckets"]),
                w["prefill_warmup_tokens"],
                len(w["prefill_shapes_warmed"]),
            )

        _log.info(
            "starting the server: %sthe HTTP front end (%s)",
            "" if args.no_warmup else "the warm-up on the engine thread, then ",
            "own process" if args.frontend_process else "thread",
        )
        if args.frontend_process:
            from spanllm.serve.frontend_process import ProcessServer

            server_cls = ProcessServer
        else:
            server_cls = Server
        stall = args.health_stall_timeout if args.health_stall_timeout is not None else DEFAULT_STALL_TIMEOUT_S
        with HealthPort(args.host, args.health_port, stall) as beats:
            server = server_cls(
                llm,
                host=args.host,
                port=args.port,
                model_name=args.served_model_name or args.model,
                max_queued_requests=args.max_queued_requests,
                log_level=args.log_level,
                limits=server_limits(args),
                heartbeats=beats,
                warm_up=None if args.no_warmup else warm,
            )
            server.run(
                on_started=lambda s: print(
                    f"spanllm serve: {s.model_name!r} on http://{s.host}:{s.port} (world {ctx.world_size})",
                    flush=True,
                )
            )
        return None
    finally:
        llm.close()


def _setup_logging() -> None:
    """The server's own lines (spanllm.serve: start, the periodic stats line, shutdown) at INFO on stdout."""
    log = logging.getLogger("spanllm.serve")
    if not log.handlers:
        h = logging.StreamHandler(sys.stdout)
        h.setFormatter(logging.Formatter("%(asctime)s spanllm serve: %(message)s", "%H:%M:%S"))
        log.addHandler(h)
        log.setLevel(logging.INFO)
        log.propagate = False


def run(args: argparse.Namespace) -> int:
    cuda_allocator.apply_default()  # before any rank starts CUDA (spawned ranks inherit it)
    from spanllm.launch import DistContext, finish, launch, under_launcher

    check_args(args)
    if os.environ.get("RANK", "0") == "0":  # the rank that will serve: a port in use says so before the build
        from spanllm import checks

        checks.port_free(args.host, args.port)
        if args.health_port is not None:
            checks.port_free(args.host, args.health_port, "--health-port")
    _setup_logging()
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
