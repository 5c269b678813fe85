"""A progress bar over a batch of requests that an engine runs to completion (`LLM.generate(use_tqdm=True)`,
`spanllm bench throughput`): requests finished / total, output tokens/s since the start, time elapsed.

Shown on a terminal only (rich's Console on stderr decides: TTY_COMPATIBLE / FORCE_COLOR / TERM=dumb
are honoured). Elsewhere (a log file, a pipe, pytest) `on_output` is None, so the engine loop calls
nothing: runs whose output is captured time exactly what they timed before. On a terminal the hook costs
a few additions per output, and rich redraws from its own thread a few times a second.
"""

from __future__ import annotations

import time


class RequestProgress:
    """`with RequestProgress(n) as bar: llm.generate(prompts, params, on_output=bar.on_output)`."""

    REFRESH_S = 0.25  # the bar's numbers are pushed to rich at most this often (and at every finished request)

    def __init__(self, total: int, description: str = "requests", console=None) -> None:
        from rich.console import Console

        self.total = total
        self.finished = 0
        self.output_tokens = 0
        self.console = console if console is not None else Console(stderr=True)
        self._progress = None
        self._start = self._pushed = 0.0
        # The hook LLM.generate calls with every RequestOutput; None when no bar is shown.
        self.on_output = self._on_output if self.console.is_terminal else None
        self.description = description

    def __enter__(self) -> RequestProgress:
        if self.on_output is None:
            return self
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self._progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[tok_s]:,.0f} output tok/s"),
            TimeElapsedColumn(),
            console=self.console,
            refresh_per_second=4,
        )
        self._task = self._progress.add_task(self.description, total=self.total, tok_s=0.0)
        self._progress.start()
        self._start = self._pushed = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        if self._progress is not None:
            self._push(time.perf_counter())
            self._progress.stop()
            self._progress = None

    def _on_output(self, out) -> None:
        self.output_tokens += len(out.new_ids)
        self.finished += out.finished
        now = time.perf_counter()
        if out.finished or now - self._pushed >= self.REFRESH_S:
            self._push(now)

    def _push(self, now: float) -> None:
        if self._progress is None:
            return
        self._pushed = now
        tok_s = self.output_tokens / (now - self._start) if now > self._start else 0.0
        self._progress.update(self._task, completed=self.finished, tok_s=tok_s)
