"""`spanllm serve` (the default, `--frontend-process`): the HTTP front end in a process of its own.

With `--no-frontend-process` rank 0 runs uvicorn and the engine loop as two threads of one process, and they
share one GIL: under load the HTTP work then takes host time from the engine loop, which must keep the GPU fed
(measured: results/h200/engine_speed/README.md). Here rank 0 keeps the engine (it owns the GPU and the TP group)
and spawns the front end: uvicorn, FastAPI, tokenization of prompts, chat templates, JSON and SSE, the Prometheus
registry. They talk over one
duplex multiprocessing pipe:

    front end -> engine   ("add", rid, prompt_ids, params, arrival)  ("abort", rid)  ("abort_all",)
                          ("started", port)  ("exit",)
    engine -> front end   ("metrics", snapshot) before ("events", [(rid, Delta | EngineDead | Refusal)])
                          ("shutdown",)  ("dead", message)

The engine side is AsyncEngine's loop unchanged (`PipeEngine`: commands arrive from the pipe, events leave
through it); the front end holds an `EngineClient` with AsyncEngine's interface, so the HTTP handlers
(spanllm.serve.api) are the same code in both modes. Requests are validated in the front end against the
engine's fixed limits (spanllm.engine.engine_core.validate_request), before anything crosses the pipe.
Each engine-loop pass sends its metrics snapshot first, then its events: by the time a client sees its
request finish, /metrics counts it.

Lifetime: a signal to the front end (uvicorn) aborts every request and ends it; its pipe closing (or its
("exit",)) ends the engine loop, which releases the other TP ranks. A signal to rank 0 aborts everything and
tells the front end to shut down. If the engine loop fails, the front end answers 500 to open requests,
503 on /health, and exits; the engine process raises the error.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import signal
import threading
import time
from dataclasses import dataclass

from spanllm.engine.engine_core import RequestError
from spanllm.errors import SpanllmError
from spanllm.serve.async_engine import AsyncEngine, Delta, EngineDead, EngineUnavailable, FrontDoor, QueueLedger


@dataclass
class Refusal:
    """A request the engine refused after the front end's checks (the handler answers 400)."""

    message: str


# --- the engine side (rank 0's process) ------------------------------------------------------------------
class PipeEngine(AsyncEngine):
    """AsyncEngine's loop, fed by the front end's pipe and reporting through it."""

    def __init__(self, core, conn, *, on_dead=None, heartbeats=None, warm_up=None) -> None:
        from spanllm.serve.metrics import MetricsRelay

        self.conn = conn
        self._send_lock = threading.Lock()
        self._user_on_dead = on_dead
        super().__init__(
            core,
            max_queued_requests=None,
            metrics=MetricsRelay(self._send),
            on_dead=self._dead,
            heartbeats=heartbeats,
            warm_up=warm_up,
        )
        self.metrics.baseline(core)
        self.adds_received = 0
        self.metrics.counts = self._counts
        self.port: int | None = None
        self.started = threading.Event()
        self.frontend_done = threading.Event()
        self._reader = threading.Thread(target=self._read, name="spanllm-engine-pipe", daemon=True)

    def start(self, read: bool = True) -> None:
        """The engine thread and (read) the pipe's reader; ProcessServer reads once the front end runs, after the
        warm-up (start_reading)."""
        super().start()
        if read:
            self._reader.start()

    def start_reading(self) -> None:
        self._reader.start()

    def _send(self, msg) -> None:
        with self._send_lock:
            try:
                self.conn.send(msg)
            except (OSError, EOFError, ValueError):  # the front end is gone: nothing to tell
                pass

    def shutdown_frontend(self) -> None:
        self._send(("shutdown",))

    def _transit_for_stats(self) -> int:
        return self._pending_adds  # which of them wait is the front end's ledger's to say (its /metrics do)

    def _counts(self) -> tuple[int, int]:
        """(adds received but not yet in the engine, adds received in all), read together: the front end's
        waiting count is the engine's plus what it sent that the engine had not received."""
        with self._lock:
            return self._pending_adds, self.adds_received

    def _read(self) -> None:
        try:
            self._read_loop()
        except BaseException as e:  # noqa: BLE001 - a broken message: the front end cannot be served any more
            self.error = self.error or f"the engine's pipe reader failed: {type(e).__name__}: {e}"
            self.frontend_done.set()
            self.stop(timeout=0)

    def _read_loop(self) -> None:
        while True:
            try:
                msg = self.conn.recv()
            except (EOFError, OSError):
                msg = ("exit",)
            kind = msg[0]
            if kind == "add":
                rid = msg[1]
                if not self._accepting:  # after abort_all (shutdown): refuse at once, as an aborted request
                    with self._lock:
                        self.adds_received += 1
                    self._send(("events", [(rid, Delta("", [], 0, True, "abort", None, ""))]))
                    continue
                with self._lock:
                    self._pending_adds += 1
                    self.adds_received += 1
                self._streams[rid] = None  # known here; AsyncEngine's "add" admits only known requests
                self._cmds.put(msg)
            elif kind == "abort":
                if self._streams.pop(msg[1], "gone") != "gone":
                    self._cmds.put(msg)
            elif kind == "abort_all":
                self.abort_all()
            elif kind == "started":
                self.port = msg[1]
                self.started.set()
            elif kind == "exit":  # the front end ended (or died): end the loop, release the TP ranks
                self.frontend_done.set()
                self.stop(timeout=0)
                return

    def _deliver(self, events: list) -> None:
        out = []
        for rid, ev in events:
            if rid not in self._streams:
                continue
            if isinstance(ev, Delta) and not ev.finished:
                out.append((rid, ev))
                continue
            self._streams.pop(rid, None)
            out.append((rid, ev if isinstance(ev, (Delta, EngineDead)) else Refusal(str(ev))))
        if out:
            self._send(("events", out))

    def _dead(self, message: str) -> None:
        self._send(("dead", message))
        if self._user_on_dead is not None:
            self._user_on_dead(message)


class ProcessServer:
    """Rank 0 with the front end in its own process: `run()` blocks until the front end ends or a signal."""

    def __init__(
        self,
        llm,
        *,
        host: str = "127.0.0.1",
        port: int = 8000,
        model_name: str | None = None,
        max_queued_requests: int | None = None,
        log_level: str = "warning",
        limits=None,
        heartbeats=None,
        warm_up=None,
    ) -> None:
        core = llm.engine_core
        self.model_name = model_name or llm.config.name
        self.host = host
        ctx = mp.get_context("spawn")  # a fresh interpreter: no torch state, no engine threads copied
        self._conn, child = ctx.Pipe(duplex=True)
        cfg = {
            "model": llm.config.name,
            "checkpoint_dir": llm.config.checkpoint_dir,
            "model_name": self.model_name,
            "host": host,
            "port": port,
            "log_level": log_level,
            "max_queued_requests": max_queued_requests,
            "server_limits": limits,
            "heartbeats": heartbeats.path if heartbeats is not None else None,
            "limits": {
                "vocab_size": core.vocab_size,
                "capacity_tokens": core.blocks.capacity_tokens,
                "max_model_len": core.config.max_model_len,
                "max_num_seqs": core.config.max_num_seqs,
                "block_size": core.blocks.block_size,
                "has_tokenizer": core.tokenizer is not None,
                "eos_token_ids": tuple(core.eos_token_ids),
            },
        }
        self._proc = ctx.Process(target=frontend_main, args=(child, cfg), name="spanllm-frontend")
        self._child = child
        self.engine = PipeEngine(core, self._conn, heartbeats=heartbeats, warm_up=warm_up)
        self._stop_requested = threading.Event()  # stop() or a signal: the front end ends because we asked

    @property
    def port(self) -> int | None:
        return self.engine.port

    def run(self, on_started=None) -> None:
        # The warm-up first, on the engine thread (where the steps run); the front end starts after it.
        self.engine.start(read=False)
        self.engine.wait_ready()
        self._proc.start()
        self._child.close()  # the front end holds its end; ours closes when it exits
        self.engine.start_reading()
        if threading.current_thread() is threading.main_thread():
            # The handler only sets a flag (it may interrupt this thread inside a pipe send); the loop acts on it.
            for s in (signal.SIGTERM, signal.SIGINT):
                signal.signal(s, lambda signum, frame: self._stop_requested.set())
        notified, asked = False, False
        try:
            while self._proc.is_alive() and not self.engine.frontend_done.is_set() and self.engine.alive:
                if self._stop_requested.is_set() and not asked:
                    asked = True
                    self._shutdown()
                if not notified and self.engine.started.wait(0.1):
                    notified = True
                    if on_started is not None:
                        on_started(self)
                time.sleep(0.05)
        finally:
            self._shutdown()
            self.engine.stop()
            self._proc.join(15)
            if self._proc.is_alive():
                self._proc.terminate()
                self._proc.join(5)
        if self.engine.error:
            raise RuntimeError(self.engine.error)
        code = self._proc.exitcode
        # 0: it ended as asked (or after the engine's shutdown); -SIGINT / -SIGTERM: a signal reached it (a
        # terminal's Ctrl-C goes to both processes; uvicorn re-raises it after its graceful shutdown).
        if code not in (0, -signal.SIGINT, -signal.SIGTERM):
            raise SpanllmError(f"the HTTP front-end process exited with code {code} (its output above says why)")

    def stop(self) -> None:
        """From any thread: abort everything and end the front end (run()'s loop acts on it within ~0.1 s and
        returns)."""
        self._stop_requested.set()

    def _shutdown(self) -> None:
        self.engine.abort_all()
        self.engine.shutdown_frontend()


# --- the front end (its own process) ----------------------------------------------------------------------
class EngineClient(FrontDoor):
    """AsyncEngine's interface for the HTTP handlers, talking to a PipeEngine in another process."""

    def __init__(
        self, conn, limits: dict, *, max_queued_requests: int | None, metrics, on_dead=None, on_shutdown=None
    ) -> None:
        super().__init__(max_queued_requests)
        self.conn = conn
        self.vocab_size = limits["vocab_size"]
        self.capacity_tokens = limits["capacity_tokens"]
        self.max_model_len = limits["max_model_len"]
        self.max_num_seqs = limits["max_num_seqs"]
        self._ledger = QueueLedger(
            limits["capacity_tokens"] // limits["block_size"], limits["block_size"], limits["max_num_seqs"]
        )
        self.has_tokenizer = limits["has_tokenizer"]
        self.eos_token_ids = tuple(limits["eos_token_ids"])
        self.metrics = metrics
        self.on_dead, self.on_shutdown = on_dead, on_shutdown
        self._send_lock = threading.Lock()
        self._snap = {"waiting": 0, "engine_waiting": 0, "running": 0}  # the engine's last snapshot
        self._adds_sent = 0
        self._adds_received = 0  # by the engine, from its last snapshot
        self._reader = threading.Thread(target=self._read, name="spanllm-frontend-pipe", daemon=True)

    def start(self) -> None:
        self._reader.start()

    @property
    def alive(self) -> bool:
        return self.error is None and self._reader.is_alive() and self._accepting

    def _engine_counts(self) -> tuple[int, int]:
        s = self._snap
        return s["engine_waiting"], (s["waiting"] - s["engine_waiting"]) + (self._adds_sent - self._adds_received)

    def _send(self, msg) -> None:
        with self._send_lock:
            self.conn.send(msg)

    def _count_add(self) -> None:  # under self._lock
        self._adds_sent += 1

    def add(self, request_id: str, prompt_ids: list[int], params, arrival: float) -> asyncio.Queue:
        q = self._open_stream(request_id, prompt_ids, params)
        try:
            self._send(("add", request_id, list(prompt_ids), params, arrival))
        except (OSError, EOFError, ValueError) as e:
            self._close_stream(request_id)
            raise EngineUnavailable(f"the engine process is gone ({type(e).__name__})") from None
        return q

    def abort(self, request_id: str) -> None:
        if self._close_stream(request_id):
            try:
                self._send(("abort", request_id))
            except (OSError, EOFError, ValueError):
                pass

    def abort_all(self) -> None:
        self._accepting = False
        try:
            self._send(("abort_all",))
        except (OSError, EOFError, ValueError):
            pass

    def stop(self, timeout: float = 0.0) -> None:
        self._accepting = False
        try:
            self._send(("exit",))
        except (OSError, EOFError, ValueError):
            pass

    def _read(self) -> None:
        try:
            self._read_loop()
        except BaseException as e:  # noqa: BLE001 - fail the open requests rather than leave them waiting
            self._fail(f"the front end's pipe reader failed: {type(e).__name__}: {e}")

    def _read_loop(self) -> None:
        while True:
            try:
                msg = self.conn.recv()
            except (EOFError, OSError):
                self._fail("the engine process closed its connection")
                return
            kind = msg[0]
            if kind == "metrics":
                snap = msg[1]
                self._snap = snap
                self._adds_received = snap.get("adds_received", self._adds_received)
                if self.metrics is not None:
                    # of the requests on their way, only those the ledger counts as waiting (the newest)
                    engine_waiting, in_transit = self._engine_counts()
                    self.metrics.apply({**snap, "waiting": engine_waiting + self.waiting_in_transit(in_transit)})
            elif kind == "events":
                self._deliver(
                    [(rid, RequestError(ev.message) if isinstance(ev, Refusal) else ev) for rid, ev in msg[1]]
                )
            elif kind == "shutdown":
                self._accepting = False
                if self.on_shutdown is not None:
                    self.on_shutdown()
            elif kind == "dead":
                self._fail(msg[1])
                return

    def _fail(self, message: str) -> None:
        if self.error is None:
            self.error = message
        dead = EngineDead(self.error)
        self._deliver([(rid, dead) for rid in list(self._streams)])
        if self.on_dead is not None:
            self.on_dead(self.error)


def frontend_main(conn, cfg: dict) -> None:
    """The front-end process: tokenizer, app, uvicorn; tells the engine its port, then serves until a signal,
    the engine's ("shutdown",), or the engine's death."""
    from spanllm.engine.tokenizer import get_tokenizer
    from spanllm.serve.api import build_app
    from spanllm.serve.health import Heartbeats
    from spanllm.serve.metrics import ServerMetrics
    from spanllm.serve.server import bound_port, make_uvicorn

    beats = Heartbeats.attach(cfg["heartbeats"]) if cfg["heartbeats"] else None

    tokenizer = get_tokenizer(cfg["model"], cfg["checkpoint_dir"])
    metrics = ServerMetrics(cfg["model_name"])
    holder: dict = {}

    def end(_msg=None) -> None:
        uv = holder.get("uv")
        if uv is not None:
            uv.should_exit = True

    client = EngineClient(
        conn,
        cfg["limits"],
        max_queued_requests=cfg["max_queued_requests"],
        metrics=metrics,
        on_dead=end,
        on_shutdown=end,
    )
    app = build_app(
        client,
        tokenizer,
        model_name=cfg["model_name"],
        max_model_len=cfg["limits"]["max_model_len"],
        metrics=metrics,
        limits=cfg["server_limits"],
    )

    uv = holder["uv"] = make_uvicorn(
        app,
        host=cfg["host"],
        port=cfg["port"],
        log_level=cfg["log_level"],
        on_signal=client.abort_all,
        limits=cfg["server_limits"],
        heartbeats=beats,
    )
    client.start()

    def notify() -> None:
        while not uv.started and not uv.should_exit:
            time.sleep(0.02)
        if uv.started:
            client._send(("started", bound_port(uv, cfg["port"])))

    threading.Thread(target=notify, daemon=True).start()
    try:
        uv.run()
    finally:
        client.stop()
        conn.close()
        if beats is not None:
            beats.close()
