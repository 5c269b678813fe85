"""The `spanllm` command. Each subcommand lives in its own module, imported only when it runs.

A command module defines `add_arguments(parser: argparse.ArgumentParser)` and `run(args) -> int`, and
`USES_COLLECTIVES = True` when it starts ranks joined by a process group (spanllm.launch): only those commands
take `--pg-timeout S` (or SPANLLM_PG_TIMEOUT_S), the collective timeout of the ranks; the others refuse it.
`run` checks every argument (and the checkpoint) before any rank starts; project errors (`spanllm.errors`)
become one line, `spanllm: error: ...`, and exit code 2 (bad input) or 1 (the run failed); an argparse
mistake is the one-line usage and that line (exit 2). `--debug` (or SPANLLM_DEBUG=1) shows the traceback as
well. Output cut short by the reader (`spanllm -h | head -3`) ends quietly with exit code 141 (128 + SIGPIPE,
the status of a command a shell saw die of SIGPIPE).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import traceback

# (words, module, one-line help). Longest match of the leading words wins.
COMMANDS: list[tuple[str, str, str]] = [
    (
        "demo",
        "spanllm.commands.demo",
        "CPU main job: 4 local gloo ranks as 2 virtual nodes x 2, every algorithm, the benchmark table",
    ),
    (
        "bench allreduce",
        "spanllm.commands.bench_allreduce",
        "nccl-tests-style all-reduce benchmark over every registered algorithm",
    ),
    (
        "bench gemm",
        "spanllm.commands.bench_gemm",
        "decode weight GEMMs on one GPU: F.linear (cuBLAS) vs the skinny Triton kernel",
    ),
    (
        "bench batch",
        "spanllm.commands.bench_batch",
        "offline batch benchmark: TTFT, time per output token, batch latency, decode breakdown",
    ),
    (
        "bench study",
        "spanllm.commands.bench_study",
        "TP vs TP x PP study: every layout x every all-reduce backend in one run",
    ),
    (
        "bench throughput",
        "spanllm.commands.bench_throughput",
        "offline throughput of the serving engine (vLLM's bench throughput): ShareGPT or random",
    ),
    (
        "bench host",
        "spanllm.commands.bench_host",
        "the serving engine's host time per step (scheduler, planning, sampling calls), no model",
    ),
    (
        "bench attention",
        "spanllm.commands.bench_attention",
        "paged decode attention (Triton) vs its reference and the contiguous-cache SDPA",
    ),
    (
        "bench serve",
        "spanllm.commands.bench_serve",
        "load test of any OpenAI-compatible server (vLLM's bench serve): TTFT/TPOT/ITL vs request rate",
    ),
    (
        "bench multi-turn",
        "spanllm.commands.bench_multi_turn",
        "multi-turn ShareGPT against an OpenAI-compatible server: TTFT per turn, prefix-cache hit rate",
    ),
    ("serve", "spanllm.commands.serve", "OpenAI-compatible HTTP server on the serving engine"),
    ("tune", "spanllm.commands.tune", "measure the all-reduce algorithms per size and write the tuning table (JSON)"),
    ("generate", "spanllm.commands.generate", "generate tokens with the engine (preset or HF checkpoint)"),
    (
        "plan",
        "spanllm.commands.plan",
        "rank parallel layouts for a model on a cluster: a static batch, or serving a trace (--serve)",
    ),
    (
        "perf calibrate",
        "spanllm.commands.perf_calibrate",
        "fit a cluster preset's all-reduce constants from benchmark JSON",
    ),
    ("perf validate", "spanllm.commands.perf_validate", "predicted vs measured for every measurement under results/"),
]


GLOBAL_OPTIONS = """global options (before or after COMMAND):
  --debug            show the traceback of an error (also SPANLLM_DEBUG=1)
  --pg-timeout S     commands that start ranks (demo, generate, serve, tune, bench allreduce / attention /
                     batch / study / throughput): collective timeout of the ranks in seconds (also
                     SPANLLM_PG_TIMEOUT_S; default 300): a rank that stops answering fails the job after S
                     seconds, and the error names it"""

USAGE = "usage: spanllm [--debug] [--pg-timeout S] COMMAND [options]   (spanllm COMMAND --help for its options)"
PG_TIMEOUT_HELP = (
    "collective timeout of the ranks in seconds (also SPANLLM_PG_TIMEOUT_S; default 300): a rank that stops "
    "answering fails the job after S seconds, and the error names it"
)
BROKEN_PIPE_EXIT = 141  # 128 + SIGPIPE: what a shell reports for a command that died of SIGPIPE


def _usage() -> str:
    width = max(len(w) for w, _, _ in COMMANDS)
    lines = [USAGE, "", "commands:"]
    lines += [f"  {w.ljust(width)}  {h}" for w, _, h in COMMANDS]
    return "\n".join(lines + ["", GLOBAL_OPTIONS])


class HelpFormatter(argparse.HelpFormatter):
    """Every option's default said once: help text that mentions a default keeps its own words; otherwise
    "(default: X)" is added, except for defaults that say nothing (None, False, '', [])."""

    # Python < 3.14 appends this to every BooleanOptionalAction's help, whatever the help says already.
    _BOOLEAN_SUFFIX = " (default: %(default)s)"

    def _get_help_string(self, action: argparse.Action) -> str:
        text = (action.help or "").removesuffix(self._BOOLEAN_SUFFIX)
        if "default" in text.lower() or action.default is argparse.SUPPRESS:
            return text
        if action.default is None or action.default is False or action.default in ("", []):
            return text
        if action.option_strings or action.nargs in (argparse.OPTIONAL, argparse.ZERO_OR_MORE):
            return f"{text} (default: %(default)s)"
        return text


class ArgumentParser(argparse.ArgumentParser):
    """A command's parser: a mistake prints one usage line and `spanllm: error: ...` (exit code 2), not the
    full usage, which `--help` prints."""

    def print_help(self, file=None) -> None:
        # argparse drops a write error here; a closed pipe must reach main, which exits as for `spanllm -h`
        (file or sys.stdout).write(self.format_help())

    def error(self, message: str):
        self.exit(2, f"usage: {self.prog} [options]   ({self.prog} --help lists them)\nspanllm: error: {message}\n")


def uses_collectives(module) -> bool:
    """Whether a command module starts ranks joined by a process group (its USES_COLLECTIVES)."""
    return getattr(module, "USES_COLLECTIVES", False) is True


def add_global_arguments(parser: argparse.ArgumentParser, *, collectives: bool = True) -> None:
    """--debug after the command too, and --pg-timeout for commands with collectives (unless the command
    defines an option of that name). Without collectives --pg-timeout is parsed, hidden, and refused (_run)."""
    g = parser.add_argument_group("global options")
    taken = parser._option_string_actions
    if "--debug" not in taken:
        g.add_argument("--debug", action="store_true", help="show the traceback of an error (also SPANLLM_DEBUG=1)")
    if "--pg-timeout" not in taken:
        g.add_argument(
            "--pg-timeout",
            type=float,
            default=None,
            metavar="S",
            help=PG_TIMEOUT_HELP if collectives else argparse.SUPPRESS,
        )


def build_parser(words: str, module) -> ArgumentParser:
    """The parser of `spanllm WORDS` (module: the command's module), as `spanllm WORDS ...` parses."""
    help_ = next(h for w, _, h in COMMANDS if w == words)
    parser = ArgumentParser(prog=f"spanllm {words}", description=help_, formatter_class=HelpFormatter)
    module.add_arguments(parser)
    add_global_arguments(parser, collectives=uses_collectives(module))
    return parser


def _apply_global(debug: bool, pg_timeout: float | None) -> None:
    """The global options travel as environment variables, so spawned ranks see them too."""
    from spanllm.errors import UsageError

    if debug:
        os.environ["SPANLLM_DEBUG"] = "1"
    if pg_timeout is not None:
        from spanllm.checks import MAX_COLLECTIVE_TIMEOUT_S as MAX_TIMEOUT_S  # torch-free (spanllm.launch is not)

        if not 0 < pg_timeout <= MAX_TIMEOUT_S:
            raise UsageError(
                f"--pg-timeout {pg_timeout:g}: the collective timeout must be in (0, {MAX_TIMEOUT_S:g}] seconds (a "
                "week: a rank that stops answering must fail the job some time), e.g. 300"
            )
        os.environ["SPANLLM_PG_TIMEOUT_S"] = repr(pg_timeout)


def _leading_globals(argv: list[str]) -> tuple[bool, float | None, list[str]]:
    """`spanllm --debug --pg-timeout 5 COMMAND ...`: the global options before the command."""
    from spanllm.errors import UsageError

    debug, timeout = False, None
    while argv and (argv[0] == "--debug" or argv[0].split("=", 1)[0] == "--pg-timeout"):
        a = argv.pop(0)
        if a == "--debug":
            debug = True
            continue
        value = a.split("=", 1)[1] if "=" in a else (argv.pop(0) if argv else "")
        try:
            timeout = float(value)
        except ValueError:
            raise UsageError(
                f"--pg-timeout {value!r}: give the collective timeout in seconds, e.g. --pg-timeout 300"
            ) from None
    return debug, timeout, argv


def report_error(exc: BaseException, code: int) -> None:
    """One line on stderr (under a launcher every rank prints its own, ranks > 0 prefixed with their rank)."""
    from spanllm.errors import RankError, debug_enabled

    rank = os.environ.get("RANK")
    if isinstance(exc, RankError) and exc.traceback and (debug_enabled() or not exc.known):
        print(f"--- traceback of rank {exc.rank} ---\n{exc.traceback.rstrip()}", file=sys.stderr)
    elif debug_enabled():
        traceback.print_exception(exc, file=sys.stderr)
    message = exc.code if isinstance(exc, SystemExit) else str(exc)
    prefix = f"rank {rank}: " if rank not in (None, "0") and "WORLD_SIZE" in os.environ else ""
    hint = (
        ""
        if debug_enabled()
        else " (--debug shows the traceback)"
        if code == 1 and not isinstance(exc, RankError)
        else ""
    )
    print(f"spanllm: error: {prefix}{' '.join(str(message).split())}{hint}", file=sys.stderr)


def _run(words: str, module: str, argv: list[str], leading_pg_timeout: float | None) -> int:
    from spanllm.errors import UsageError

    mod = importlib.import_module(module)
    args = build_parser(words, mod).parse_args(argv)
    pg_timeout = getattr(args, "pg_timeout", None)
    if not uses_collectives(mod) and (pg_timeout is not None or leading_pg_timeout is not None):
        raise UsageError(
            f"--pg-timeout: `spanllm {words}` starts no ranks, so it has no collectives to time out; leave it out"
        )
    if uses_collectives(mod):
        from spanllm.launch import check_launcher_env

        check_launcher_env()
    _apply_global(getattr(args, "debug", False) is True, pg_timeout)
    return int(mod.run(args) or 0)


def _unknown_command(argv: list[str]) -> str:
    """One line for a command that is not in COMMANDS: the group's commands, or the closest command."""
    import difflib

    given = " ".join(argv[:2]) if len(argv) > 1 and not argv[1].startswith("-") else argv[0]
    group = [w.split()[1] for w, _, _ in COMMANDS if len(w.split()) == 2 and w.split()[0] == argv[0]]
    if group and given == argv[0]:
        return f"`spanllm {given}` needs one of: {', '.join(group)} (e.g. `spanllm {given} {group[0]} --help`)"
    if group:
        return f"unknown command {given!r}; `spanllm {argv[0]}` takes one of: {', '.join(group)}"
    close = difflib.get_close_matches(given, [w for w, _, _ in COMMANDS], n=1)
    hint = f"did you mean `spanllm {close[0]}`? " if close else ""
    return f"unknown command {given!r}; {hint}`spanllm --help` lists the commands"


GLOBAL_ENV = ("SPANLLM_DEBUG", "SPANLLM_PG_TIMEOUT_S")


def main(argv: list[str] | None = None) -> int:
    saved = {k: os.environ.get(k) for k in GLOBAL_ENV}
    try:
        try:
            return _main(list(sys.argv[1:] if argv is None else argv))
        finally:  # here, not at exit: a reader that left (`| head`) fails this flush, and it is caught
            sys.stdout.flush()
    except BrokenPipeError:
        _silence_stdout()
        return BROKEN_PIPE_EXIT
    finally:  # a call in-process (tests) leaves the environment as it found it
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _silence_stdout() -> None:
    """After EPIPE: point stdout at /dev/null, so the interpreter's last flush at exit fails no more."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):  # not a file descriptor (a test's capture): nothing to flush
        pass
    finally:
        os.close(devnull)


def _main(argv: list[str]) -> int:
    from spanllm.errors import exit_code

    try:
        debug, timeout, argv = _leading_globals(argv)
        _apply_global(debug, timeout)
        if not argv or argv[0] in ("-h", "--help", "help"):
            print(_usage())
            return 0
        if argv[0] == "--version":
            from spanllm import __version__

            print(__version__)
            return 0
        for words, module, _ in sorted(COMMANDS, key=lambda c: -len(c[0].split())):
            n = len(words.split())
            if argv[:n] == words.split():
                return _run(words, module, argv[n:], timeout)
    except SystemExit as e:
        if not isinstance(e.code, str):
            raise  # argparse (--help: 0, a bad option: 2) and sys.exit(int) keep their codes
        report_error(e, 2)
        return 2
    except Exception as e:  # noqa: BLE001 - project errors become one line; anything else keeps its traceback
        code = exit_code(e)
        if code is None:
            raise
        report_error(e, code)
        return code
    print(f"{USAGE}\nspanllm: error: {_unknown_command(argv)}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
