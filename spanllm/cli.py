"""The `spanllm` command. Each subcommand lives in its own module, imported only when it runs.

A command module defines `add_arguments(parser: argparse.ArgumentParser)` and `run(args) -> int`.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# (words, module, one-line help). Longest match of the leading words wins.
COMMANDS: list[tuple[str, str, str]] = [
    ("demo", "spanllm.demo", "CPU main job: 4 local gloo ranks as 2 virtual nodes x 2, every algorithm, the benchmark table"),
    ("bench allreduce", "spanllm.bench.allreduce", "nccl-tests-style all-reduce benchmark over every registered algorithm"),
    ("bench batch", "spanllm.bench.batch", "offline batch benchmark: TTFT, time per output token, batch latency, decode breakdown"),
    ("bench study", "spanllm.bench.study", "TP vs TP x PP study: every layout x every all-reduce backend in one run"),
    ("tune", "spanllm.comm.tune", "measure the all-reduce algorithms per size and write the tuning table (JSON)"),
    ("generate", "spanllm.engine.generate", "generate tokens with the engine (preset or HF checkpoint)"),
    ("plan", "spanllm.perf.plan", "rank parallel layouts x all-reduce algorithms for a model on a cluster"),
    ("perf calibrate", "spanllm.perf.calibrate", "fit a cluster preset's all-reduce constants from benchmark JSON"),
    ("perf validate", "spanllm.perf.validate", "predicted vs measured for every measurement under results/"),
]


def _usage() -> str:
    width = max(len(w) for w, _, _ in COMMANDS)
    lines = ["usage: spanllm COMMAND [options]   (spanllm COMMAND --help for its options)", "", "commands:"]
    lines += [f"  {w.ljust(width)}  {h}" for w, _, h in COMMANDS]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    if argv[0] == "--version":
        from spanllm import __version__
        print(__version__)
        return 0
    for words, module, help_ in sorted(COMMANDS, key=lambda c: -len(c[0].split())):
        n = len(words.split())
        if argv[:n] == words.split():
            mod = importlib.import_module(module)
            parser = argparse.ArgumentParser(prog=f"spanllm {words}", description=help_,
                                             formatter_class=argparse.ArgumentDefaultsHelpFormatter)
            mod.add_arguments(parser)
            args = parser.parse_args(argv[n:])
            return int(mod.run(args) or 0)
    print(f"spanllm: unknown command {' '.join(argv[:2])!r}\n\n{_usage()}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
