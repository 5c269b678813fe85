"""Prometheus metrics of the server, in vLLM's names with a `spanllm:` prefix (label model_name).

Each server owns its registry (tests run several servers in one process). The engine thread updates
everything after each step; `/metrics` renders the registry.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
ITL_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.015,
    0.02,
    0.025,
    0.03,
    0.04,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
LATENCY_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)


# EngineStats counters mirrored as Prometheus counters (same attribute name on ServerMetrics)
ENGINE_COUNTERS = ("prompt_tokens", "generation_tokens", "preemptions", "prefix_cache_queries", "prefix_cache_hits")


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = r = CollectorRegistry()
        self.model_name = model_name
        L = ["model_name"]

        def g(name, doc):
            return Gauge(f"spanllm:{name}", doc, L, registry=r).labels(model_name)

        def c(name, doc):
            return Counter(f"spanllm:{name}", doc, L, registry=r).labels(model_name)

        def h(name, doc, buckets):
            return Histogram(f"spanllm:{name}", doc, L, buckets=buckets, registry=r).labels(model_name)

        self.running = g("num_requests_running", "Requests in the running batch")
        self.waiting = g(
            "num_requests_waiting",
            "Requests waiting to be scheduled (engine queue + accepted ones no free slot and KV blocks will take)",
        )
        self.kv_usage = g("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = full)")
        self.preemptions = c("num_preemptions", "Preemptions (recomputation) since start")
        self.prompt_tokens = c("prompt_tokens", "Prefilled prompt tokens")
        self.generation_tokens = c("generation_tokens", "Generated tokens")
        self.prefix_cache_queries = c(
            "prefix_cache_queries", "Prompt tokens looked up in the prefix cache (at each request's admission)"
        )
        self.prefix_cache_hits = c("prefix_cache_hits", "Prompt tokens found in the prefix cache")
        self._success = Counter(
            "spanllm:request_success",
            "Finished requests by finish reason",
            ["model_name", "finished_reason"],
            registry=r,
        )
        for reason in ("stop", "length", "abort"):
            self._success.labels(model_name, reason)
        self.ttft = h("time_to_first_token_seconds", "Time to first token (arrival to first token)", TTFT_BUCKETS)
        self.itl = h("inter_token_latency_seconds", "Time between consecutive output tokens", ITL_BUCKETS)
        self.e2e = h("e2e_request_latency_seconds", "End-to-end request latency (arrival to finish)", LATENCY_BUCKETS)
        self.queue = h("request_queue_time_seconds", "Time waiting before first scheduled", LATENCY_BUCKETS)
        self._last = dict.fromkeys(ENGINE_COUNTERS, 0)

    def baseline(self, core) -> None:
        """Count from here (the warm-up request before the server started is not counted)."""
        for name in self._last:
            self._last[name] = getattr(core.stats, name)

    def update_engine(self, core, extra_waiting: int = 0) -> None:
        """Gauges and counters from the engine's state (engine thread, after a step)."""
        self.running.set(core.num_running)
        self.waiting.set(core.num_waiting + extra_waiting)
        self.kv_usage.set(core.blocks.usage)
        s = core.stats
        for name in ENGINE_COUNTERS:
            metric = getattr(self, name)
            now = getattr(s, name)
            if now > self._last[name]:
                metric.inc(now - self._last[name])
            self._last[name] = now

    def observe_finished(self, reason: str | None, m: dict) -> None:
        self._success.labels(self.model_name, reason or "abort").inc()
        arrival = m.get("arrival")
        if arrival is None:
            return
        if m.get("first_token") is not None:
            self.ttft.observe(max(0.0, m["first_token"] - arrival))
        times = m.get("token_times") or []
        for a, b in zip(times, times[1:]):
            self.itl.observe(max(0.0, b - a))
        if m.get("finished_at") is not None:
            self.e2e.observe(max(0.0, m["finished_at"] - arrival))
        if m.get("first_scheduled") is not None:
            self.queue.observe(max(0.0, m["first_scheduled"] - arrival))

    def apply(self, snap: dict) -> None:
        """A MetricsRelay snapshot from the engine process (the front end runs in its own process)."""
        self.running.set(snap["running"])
        self.waiting.set(snap["waiting"])
        self.kv_usage.set(snap["kv_usage"])
        for name in ENGINE_COUNTERS:
            metric = getattr(self, name)
            now = snap[name]
            if now > self._last[name]:
                metric.inc(now - self._last[name])
            self._last[name] = now
        for reason, m in snap["finished"]:
            self.observe_finished(reason, m)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class MetricsRelay:
    """The engine-process side of ServerMetrics when the HTTP front end runs in another process: the same
    calls (baseline, observe_finished, update_engine), turned into one snapshot message per engine-loop pass
    (`send(("metrics", snapshot))`) that the front end applies to its registry (ServerMetrics.apply).
    Counters travel as totals since the baseline; finished requests as (reason, metrics) since the last pass."""

    def __init__(self, send) -> None:
        self._send = send
        self._base = dict.fromkeys(ENGINE_COUNTERS, 0)
        self._finished: list = []
        # () -> (adds not yet in the engine, adds received in all), read under one lock (PipeEngine sets it)
        self.counts = None

    def baseline(self, core) -> None:
        for name in self._base:
            self._base[name] = getattr(core.stats, name)

    def observe_finished(self, reason: str | None, m: dict) -> None:
        self._finished.append((reason, m))

    def update_engine(self, core, extra_waiting: int = 0) -> None:
        s = core.stats
        received = None
        if self.counts is not None:
            extra_waiting, received = self.counts()
        snap = {
            "running": core.num_running,
            "waiting": core.num_waiting + extra_waiting,
            "engine_waiting": core.num_waiting,
            "kv_usage": core.blocks.usage,
            "finished": self._finished,
            **{k: getattr(s, k) - v for k, v in self._base.items()},
        }
        if received is not None:
            snap["adds_received"] = received
        self._finished = []
        self._send(("metrics", snap))
