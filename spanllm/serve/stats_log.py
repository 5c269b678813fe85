"""The server's log line while it works (vLLM's "Avg prompt throughput ..." line): every LOG_INTERVAL_S seconds
while requests run or tokens were made since the last line, prompt and generation tokens/s over the interval,
running and waiting requests, KV-cache usage and preemptions; and, at shutdown, the requests served by outcome.
Logger `spanllm.serve` (the `spanllm serve` command shows it at INFO)."""

from __future__ import annotations

import logging
import time

logger = logging.getLogger("spanllm.serve")
LOG_INTERVAL_S = 5.0


class StatsLogger:
    def __init__(self, interval_s: float = LOG_INTERVAL_S) -> None:
        self.interval_s = interval_s
        self._t = time.monotonic()
        self._last: tuple[int, int] | None = None  # (prompt tokens, generation tokens) at the last line
        self._finished_before: dict[str, int] = {}  # the warm-up's requests, left out of the shutdown line

    def baseline(self, core) -> None:
        """Count from here: the warm-up's tokens and requests are not the server's."""
        s = core.stats
        self._last = (s.prompt_tokens, s.generation_tokens)
        self._finished_before = dict(s.finished)

    def maybe_log(self, core, in_transit: int = 0) -> None:
        """Engine thread, after each loop pass."""
        now = time.monotonic()
        if now - self._t < self.interval_s:
            return
        s = core.stats
        tokens = (s.prompt_tokens, s.generation_tokens)
        last = self._last if self._last is not None else tokens
        dt, self._t, self._last = now - self._t, now, tokens
        if tokens == last and not core.has_unfinished():
            return  # idle: no line
        logger.info(
            "prompt %.1f tok/s, generation %.1f tok/s, running %d, waiting %d, KV cache %.1f%%, preemptions %d",
            (tokens[0] - last[0]) / dt,
            (tokens[1] - last[1]) / dt,
            core.num_running,
            core.num_waiting + in_transit,
            100.0 * core.blocks.usage,
            s.preemptions,
        )

    def log_shutdown(self, core) -> None:
        done = {k: v - self._finished_before.get(k, 0) for k, v in core.stats.finished.items()}
        done = {k: v for k, v in done.items() if v}
        by = ", ".join(f"{k} {v}" for k, v in sorted(done.items())) or "none"
        logger.info("stopped after %d requests (%s)", sum(done.values()), by)
