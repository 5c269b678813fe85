"""The engine loop in its own thread (rank 0), bridged to the HTTP event loop.

Commands (add / abort / abort-all) go in through a thread-safe queue; outputs go out, per step, in one
`loop.call_soon_threadsafe` per event loop, onto one asyncio.Queue per request. The engine thread never
waits on the event loop: it blocks only on its command queue when it has nothing to run.

A request's queue receives `Delta`s (a copy of what the handler needs: the engine's RequestOutput
shares its output list with the live sequence) and, if the engine fails, one `EngineDead`.
"""

from __future__ import annotations

import asyncio
import os
import queue
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

from spanllm.engine.engine_core import RequestError, validate_request
from spanllm.serve.stats_log import StatsLogger, logger

# An idle engine thread sends the other TP ranks an empty plan this often (EngineCore.heartbeat), far below
# any sensible collective timeout (--pg-timeout), so idle servers keep the normal timeout.
HEARTBEAT_S = float(os.environ.get("SPANLLM_SERVE_HEARTBEAT_S", "10"))


class EngineUnavailable(Exception):
    """The engine thread is gone or shutting down (the server answers 503)."""


class QueueFull(Exception):
    """The waiting queue holds --max-queued-requests requests (the server answers 503)."""


@dataclass
class Delta:
    new_text: str
    new_ids: list[int]
    num_output: int
    finished: bool
    finish_reason: str | None
    stop_reason: int | str | None
    text: str | None = None  # whole text, on the finished delta
    new_logprobs: list | None = None  # TokenLogprob per new id (params.logprobs set)
    error: str | None = None  # the engine ended this request because handling its data failed


@dataclass
class EngineDead:
    message: str


class QueueLedger:
    """Which accepted requests the engine can run at once and which wait behind them: what --max-queued-requests
    counts. Every request is entered when the front door accepts it (before the engine has seen it) and left when it
    ends. It counts as running when no earlier request waits and its prompt plus its first token fit the KV blocks
    and sequence slots of those counted as running; else it waits, in arrival order, until the ones ahead of it
    end. Conservative, as the engine admits at least these: chunked prefill may start a prompt that fits only in
    part, and prefix caching may share blocks. Output growth is not counted: a running request that outgrows the
    pool is preempted back into the engine's queue, which the front door reads after each step. O(1) per request
    (amortized); not thread-safe (the front door holds its lock)."""

    def __init__(self, num_blocks: int, block_size: int, max_num_seqs: int) -> None:
        self.num_blocks = num_blocks
        self.free_blocks = num_blocks
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.running: dict[str, int] = {}  # request id -> the blocks counted for it
        self.waiting: OrderedDict[str, int] = OrderedDict()  # oldest first

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def blocks(self, prompt_len: int) -> int:
        return -(-(prompt_len + 1) // self.block_size)

    def most_running(self, prompt_len: int) -> int:
        """How many requests of this prompt length count as running at once on an idle engine."""
        return min(self.max_num_seqs, self.num_blocks // self.blocks(prompt_len))

    def add(self, request_id: str, prompt_len: int) -> bool:
        """Enter an accepted request; True when it counts as running."""
        n = self.blocks(prompt_len)
        if not self.waiting and len(self.running) < self.max_num_seqs and n <= self.free_blocks:
            self.running[request_id] = n
            self.free_blocks -= n
            return True
        self.waiting[request_id] = n
        return False

    def remove(self, request_id: str) -> None:
        """The request ended (or was never entered): the oldest waiting ones that now fit count as running."""
        n = self.running.pop(request_id, None)
        if n is not None:
            self.free_blocks += n
        elif self.waiting.pop(request_id, None) is None:
            return
        while self.waiting and len(self.running) < self.max_num_seqs:
            rid, n = next(iter(self.waiting.items()))
            if n > self.free_blocks:
                break
            del self.waiting[rid]
            self.running[rid] = n
            self.free_blocks -= n


class FrontDoor:
    """What the HTTP handlers hold, in either mode (AsyncEngine here, frontend_process.EngineClient): the
    engine's fixed limits (vocab_size, capacity_tokens, max_model_len, has_tokenizer, eos_token_ids), `alive`, `error`,
    `num_waiting()`, and the two halves every request goes through: `_open_stream` before it goes to the
    engine, `_deliver` for what comes back. Subclasses count an admitted request in `_count_add`, make the
    QueueLedger (`_ledger`) from the engine's KV pool and say what the engine reported waiting (`_engine_counts`)."""

    _ledger: QueueLedger

    def __init__(self, max_queued_requests: int | None) -> None:
        self.max_queued_requests = max_queued_requests
        self.error: str | None = None
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._lock = threading.Lock()
        self._accepting = True

    def _engine_counts(self) -> tuple[int, int]:
        """(requests in the engine's queue after its last step, accepted requests it had not received then)."""
        raise NotImplementedError

    def most_running(self, prompt_len: int) -> int:
        """How many requests of this prompt length an idle engine counts as running at once (the rest wait)."""
        return self._ledger.most_running(prompt_len)

    def waiting_in_transit(self, in_transit: int) -> int:
        """Of the requests on their way to the engine (the newest accepted), those the ledger counts as waiting."""
        return min(in_transit, self._ledger.num_waiting)

    def num_waiting(self) -> int:
        """What --max-queued-requests counts: the requests the ledger counts as waiting, or, where more, those the
        engine's queue held after its last step (a preempted request; a prompt its token budget held back) plus
        the ones on their way that the ledger counts as waiting."""
        engine_waiting, in_transit = self._engine_counts()
        return max(self._ledger.num_waiting, engine_waiting + self.waiting_in_transit(in_transit))

    def _open_stream(self, request_id: str, prompt_ids: list[int], params) -> asyncio.Queue:
        """Refuse when shutting down (EngineUnavailable), check the request against the engine's fixed limits
        (RequestError), check the queue bound (QueueFull), enter it in the ledger, and give it its queue."""
        if not self.alive or not self._accepting:
            raise EngineUnavailable(self.error or "the server is shutting down")
        validate_request(
            prompt_ids,
            params,
            vocab_size=self.vocab_size,
            max_model_len=self.max_model_len,
            capacity_tokens=self.capacity_tokens,
            eos_token_ids=self.eos_token_ids,
        )
        if params.stop and not self.has_tokenizer:
            raise RequestError("stop strings need a tokenizer")
        with self._lock:
            if self.max_queued_requests is not None and self.num_waiting() >= self.max_queued_requests:
                raise QueueFull(
                    f"the waiting queue is full ({self.max_queued_requests} requests, "
                    "--max-queued-requests); retry later"
                )
            self._ledger.add(request_id, len(prompt_ids))
            self._count_add()
        q: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), q)
        return q

    def _close_stream(self, request_id: str) -> bool:
        """The request ended or its client left: forget its queue and its place in the ledger. False if it had no
        queue (ended already)."""
        known = self._streams.pop(request_id, None) is not None
        with self._lock:
            self._ledger.remove(request_id)
        return known

    def _deliver(self, events: list) -> None:
        """Put each (request id, event) on its request's queue, from any thread: one call_soon_threadsafe per
        event loop. A request's stream ends with its finished Delta, or any other event (an error)."""
        by_loop: dict = {}
        ended = []
        for rid, ev in events:
            s = self._streams.get(rid)
            if s is None:
                continue
            if getattr(ev, "finished", True):
                self._streams.pop(rid, None)
                ended.append(rid)
            by_loop.setdefault(s[0], []).append((s[1], ev))
        if ended:
            with self._lock:
                for rid in ended:
                    self._ledger.remove(rid)
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # that event loop is closed (shutdown)
                pass


class AsyncEngine(FrontDoor):
    def __init__(
        self,
        core,
        *,
        max_queued_requests: int | None = None,
        metrics=None,
        on_dead=None,
        heartbeats=None,
        warm_up=None,
    ) -> None:
        super().__init__(max_queued_requests)
        self.core = core
        # Run first on the engine thread (spanllm.engine.warmup): torch keeps cuDNN's attention plans per thread
        # (and the cuBLAS / cuDNN handles), so a warm-up on another thread leaves them to the first request.
        self._warm_up = warm_up
        self.ready = threading.Event()  # set once the warm-up is done and the loop takes requests
        self.metrics = metrics
        self.on_dead = on_dead  # called (engine thread) after the loop failed: the server stops
        self.heartbeats = heartbeats  # spanllm.serve.health.Heartbeats (--health-port): one beat per pass
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._pending_adds = 0  # submitted, not yet inside the engine
        self._engine_waiting = 0  # the engine's queue after its last step (engine thread)
        self._ledger = QueueLedger(core.blocks.num_usable, core.blocks.block_size, core.config.max_num_seqs)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="spanllm-engine", daemon=True)
        self.stats_log = StatsLogger()

    # --- any thread -------------------------------------------------------------------------------------
    # The engine's fixed limits, which the HTTP handlers read (spanllm.serve.frontend_process.EngineClient has
    # the same attributes, from the engine process).
    @property
    def vocab_size(self) -> int:
        return self.core.vocab_size

    @property
    def capacity_tokens(self) -> int:
        return self.core.blocks.capacity_tokens

    @property
    def max_model_len(self) -> int:
        return self.core.config.max_model_len

    @property
    def has_tokenizer(self) -> bool:
        return self.core.tokenizer is not None

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return tuple(self.core.eos_token_ids)

    def _count_add(self) -> None:  # under self._lock
        self._pending_adds += 1

    def start(self) -> None:
        self._thread.start()

    def wait_ready(self) -> None:
        """Block until the warm-up is done; where the engine thread failed or ended first, stop it and raise
        RuntimeError with its error (the server then never opens its port)."""
        while not self.ready.wait(0.1):
            if not self._thread.is_alive() or self.error is not None:
                self.stop()
                raise RuntimeError(self.error or "the engine thread ended during its warm-up")

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None and not self._stop.is_set()

    @property
    def max_num_seqs(self) -> int:
        return self.core.config.max_num_seqs

    def _engine_counts(self) -> tuple[int, int]:
        return self._engine_waiting, self._pending_adds

    def _transit_for_stats(self) -> int:
        """The submitted requests not yet inside the engine counted as waiting in /metrics and the log (engine
        thread)."""
        return self.waiting_in_transit(self._pending_adds)

    def abort_all(self) -> None:
        """Stop admitting; abort every request (shutdown): their handlers end with finish_reason abort."""
        self._accepting = False
        self._cmds.put(("abort_all",))

    def stop(self, timeout: float = 30.0) -> None:
        """Abort everything, release the other TP ranks (shutdown_workers) and end the thread."""
        self._accepting = False
        self._stop.set()
        self._cmds.put(("wake",))
        if self._thread.is_alive():
            self._thread.join(timeout)

    # --- the event loop -----------------------------------------------------------------------------------
    def add(self, request_id: str, prompt_ids: list[int], params, arrival: float) -> asyncio.Queue:
        """Validate (RequestError), check the queue bound (QueueFull), submit; returns the request's queue."""
        q = self._open_stream(request_id, prompt_ids, params)
        self._cmds.put(("add", request_id, list(prompt_ids), params, arrival))
        return q

    def abort(self, request_id: str) -> None:
        """The client went away: abort (frees its KV blocks); nothing more is delivered."""
        if self._close_stream(request_id):
            self._cmds.put(("abort", request_id))

    # --- the engine thread --------------------------------------------------------------------------------
    def _handle(self, cmd) -> list:
        core = self.core
        kind = cmd[0]
        if kind == "add":
            _, rid, ids, params, arrival = cmd
            with self._lock:
                self._pending_adds -= 1
            if rid not in self._streams:  # the client left before admission
                return []
            try:
                core.add_request(ids, params, request_id=rid, arrival=arrival, with_text=True)
            except (RequestError, ValueError) as e:  # validated already; a late refusal still reaches the client
                return [(rid, e)]
            except Exception as e:  # noqa: BLE001 - this request's data (its detokenizer, say): it alone fails
                core.abort_request(rid)
                return [(rid, Delta("", [], 0, True, "error", None, "", None, f"{type(e).__name__}: {e}"))]
            return []
        if kind == "abort":
            out = core.abort_request(cmd[1])
            if out is not None and self.metrics is not None:
                self.metrics.observe_finished(out.finish_reason, out.metrics)
            return []
        if kind == "abort_all":
            return self._abort_everything()
        return []

    def _abort_everything(self) -> list:
        core = self.core
        events = []
        for seq in list(core.scheduler.running) + list(core.scheduler.waiting):
            out = core.abort_request(seq.request_id)
            if out is not None:
                if self.metrics is not None:
                    self.metrics.observe_finished(out.finish_reason, out.metrics)
                events.append((out.request_id, _delta(out)))
        return events

    def _run(self) -> None:
        from spanllm.serve import health

        core = self.core
        beats = self.heartbeats
        try:
            if self._warm_up is not None:
                self._warm_up()
                if self.metrics is not None:
                    self.metrics.baseline(core)  # the warm-up's tokens and requests are not the server's
                self.stats_log.baseline(core)
            last_broadcast = time.monotonic()
            if beats is not None:
                beats.beat_engine()
                beats.set_engine(health.ENGINE_RUNNING)
            self.ready.set()
            while not self._stop.is_set():
                if beats is not None:
                    beats.beat_engine()
                if not core.has_unfinished() and time.monotonic() - last_broadcast > HEARTBEAT_S:
                    core.heartbeat()  # idle: keep the TP workers' collective wait under its timeout
                    last_broadcast = time.monotonic()
                block = not core.has_unfinished()
                events: list = []
                while True:
                    try:
                        cmd = self._cmds.get(timeout=0.5) if block else self._cmds.get_nowait()
                    except queue.Empty:
                        break
                    block = False
                    events += self._handle(cmd)
                if self._stop.is_set():
                    break
                if core.has_unfinished():
                    last_broadcast = time.monotonic()
                    for out in core.step():
                        events.append((out.request_id, _delta(out)))
                        if out.finished and self.metrics is not None:
                            self.metrics.observe_finished(out.finish_reason, out.metrics)
                # read here, not live: between taking its commands and its step the queue holds requests the
                # step admits
                self._engine_waiting = core.num_waiting
                in_transit = self._transit_for_stats()
                if self.metrics is not None:
                    self.metrics.update_engine(core, in_transit)
                self.stats_log.maybe_log(core, in_transit)
                if events:
                    self._deliver(events)
            self._deliver(self._abort_everything())
            if self.metrics is not None:
                self.metrics.update_engine(core, 0)
            if beats is not None:
                beats.set_engine(health.ENGINE_STOPPED)
            core.shutdown_workers()
            self.stats_log.log_shutdown(core)
        except BaseException as e:  # noqa: BLE001 - a failed step (a dead TP rank): fail every request, stop
            self.error = f"the engine loop failed: {type(e).__name__}: {e}"
            logger.error("%s", self.error, exc_info=e)
            if beats is not None:
                beats.set_engine(health.ENGINE_FAILED, self.error)
            dead = EngineDead(self.error)
            self._deliver([(rid, dead) for rid in list(self._streams)])
            if self.on_dead is not None:
                self.on_dead(self.error)


def _put_all(items) -> None:
    for q, ev in items:
        q.put_nowait(ev)


def _delta(out) -> Delta:
    """What a handler needs of one step's output (new_ids is a fresh list per step already)."""
    return Delta(
        out.new_text,
        out.new_ids,
        len(out.output_ids),
        out.finished,
        out.finish_reason,
        out.stop_reason,
        out.text if out.finished else None,
        getattr(out, "new_logprobs", None),
        getattr(out, "error", None),
    )
