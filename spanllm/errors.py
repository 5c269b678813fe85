"""The project's errors, and which exit code each one gives the `spanllm` command.

`spanllm.cli` prints a project error as one line, `spanllm: error: ...`, and exits with its code: 2 for
bad input (usage), 1 for a run that failed. `--debug` or `SPANLLM_DEBUG=1` adds the traceback.

Raise `UsageError` for input that can never work (a value outside its range, an unknown name, a
missing file), `SpanllmError` for a run that failed. The older input errors of the modules
(`ModelConfigError`, `ParallelLayoutError`, `TopologyError`, `AllReduceInputError`, the fixed batch's
`GenerationError`, the engine's `RequestError`) are ValueError subclasses; they count as usage errors too (`exit_code`).
`CheckpointError` is a UsageError. A rank of a local launch that fails reaches the caller as
`RankError` (spanllm.launch), carrying the original's exit code.
"""

from __future__ import annotations

import os


class SpanllmError(Exception):
    """A failure the command reports as one line (exit code 1)."""

    exit_code = 1


class UsageError(SpanllmError, ValueError):
    """Input that cannot work: the message names the value, the limit and the fix (exit code 2)."""

    exit_code = 2


class RankError(SpanllmError):
    """A rank of a local launch failed; `rank`, the original exception's type name and its traceback text.

    `exit_code` is the original's (2 when a rank rejected its input, 1 otherwise); `known` says whether
    the original was a project error (then the message alone says it all) or something else (a bug:
    the CLI prints the rank's traceback too).
    """

    def __init__(
        self,
        message: str,
        *,
        rank: int | None,
        type_name: str,
        traceback: str = "",
        exit_code: int = 1,
        known: bool = False,
    ) -> None:
        super().__init__(message)
        self.rank, self.type_name, self.traceback, self.exit_code, self.known = (
            rank,
            type_name,
            traceback,
            exit_code,
            known,
        )


class Interrupted(SpanllmError):
    """The command got SIGTERM or SIGINT; its local ranks were stopped and its temporary files removed."""

    def __init__(self, signum: int) -> None:
        import signal

        self.signum = signum
        self.exit_code = 128 + signum
        super().__init__(f"stopped by {signal.Signals(signum).name}; local ranks ended, temporary files removed")


def _input_error_types() -> tuple[type, ...]:
    """The modules' own input errors (imported lazily: this module must import anywhere, fast)."""
    from spanllm.comm.base import AllReduceInputError
    from spanllm.comm.topology import TopologyError
    from spanllm.engine.fixed_batch import GenerationError
    from spanllm.engine.sampler import SamplingParamsError
    from spanllm.engine.tokenizer import TokenizerError
    from spanllm.model.config import ModelConfigError
    from spanllm.model.parallel_dims import ParallelLayoutError

    # CheckpointError and the serving engine's RequestError are UsageErrors already.
    return (
        ModelConfigError,
        ParallelLayoutError,
        TopologyError,
        AllReduceInputError,
        SamplingParamsError,
        TokenizerError,
        GenerationError,
    )


def _runtime_error_types() -> tuple[type, ...]:
    from spanllm.comm.base import AllReduceError

    return (AllReduceError,)


def exit_code(exc: BaseException) -> int | None:
    """The exit code of a project error, or None for anything else (a bug: let its traceback show)."""
    if isinstance(exc, SpanllmError):
        return exc.exit_code
    try:
        if isinstance(exc, _input_error_types()):
            return 2
        if isinstance(exc, _runtime_error_types()):
            return 1
    except ImportError:  # a half-installed checkout: no project error types to match
        return None
    if isinstance(exc, SystemExit) and isinstance(exc.code, str):
        return 2  # `raise SystemExit("message")`: the older way commands rejected input
    return None


def debug_enabled() -> bool:
    return os.environ.get("SPANLLM_DEBUG", "") not in ("", "0")
