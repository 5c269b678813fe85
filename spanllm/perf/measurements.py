"""Reading measurement files: `spanllm bench allreduce --json` sweeps and engine batch / study runs.

Only plain records come out (dataclasses of numbers and names); nothing here knows the model.
A study's stdout (`study_*.log`) counts where its JSON is missing (a run cut short before writing it):
its row lines carry TTFT, TPOT and E2E, the layout and the all-reduce; the prompt and decode lengths
come from the workload name.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from spanllm.workloads import WORKLOADS

DTYPE_BYTES = {
    "bfloat16": 2,
    "half": 2,
    "float16": 2,
    "float": 4,
    "float32": 4,
    "int32": 4,
    "double": 8,
    "float64": 8,
    "int64": 8,
}


class MeasurementError(ValueError):
    """A results file that does not follow the schema."""


@dataclass(frozen=True)
class AllReduceMeasurement:
    source: str  # file it came from
    algo: str  # the algorithm that ran (row "ran", else "algo")
    requested: str
    nbytes: int
    dtype: str
    nodes: int
    ranks_per_node: int
    graph: bool
    time_us: float
    launch: str = ""  # nvrar launch the tuned table chose, from `ran` ('os/b8x256w4'); '' when not given


@dataclass(frozen=True)
class EngineMeasurement:
    source: str
    kind: str  # "batch" or "study"
    row: dict[str, Any]  # the row as written by the benchmark


def parse_topology(text: str) -> tuple[int, int]:
    """'2x4' -> (2 nodes, 4 ranks per node)."""
    try:
        a, b = str(text).lower().split("x")
        nodes, rpn = int(a), int(b)
    except ValueError:
        raise MeasurementError(f"topology {text!r} is not of the form NODESxRANKS_PER_NODE (e.g. '2x1')") from None
    if nodes < 1 or rpn < 1:
        raise MeasurementError(f"topology {text!r}: nodes and ranks per node must be >= 1")
    return nodes, rpn


def ran_algorithm(ran: str) -> str:
    """The modelled algorithm behind a benchmark's `ran` column: 'auto->nvrar[os/b8x256w4]' -> 'nvrar'."""
    return ran.split("->")[-1].split("[")[0]


def ran_launch(ran: str) -> str:
    """The launch parameters in a `ran` column: 'auto->nvrar[os/b8x256w4]' -> 'os/b8x256w4'; none -> ''."""
    last = ran.split("->")[-1]
    return last.split("[", 1)[1].rstrip("]") if "[" in last else ""


def allreduce_rows(doc: dict[str, Any], source: str) -> list[AllReduceMeasurement]:
    """Timed, correct rows of one all-reduce sweep (rows with wrong > 0 or no time are left out)."""
    settings = doc.get("settings", {})
    out = []
    for i, row in enumerate(doc.get("rows", [])):
        try:
            if row.get("wrong", 0) or row.get("time_us") is None:
                continue
            if "topology" in row:
                nodes, rpn = parse_topology(row["topology"])
            else:
                rpn = int(row.get("ranks_per_node", settings["ranks_per_node"]))
                nodes = int(row.get("world_size", settings["world_size"])) // rpn
            ran = str(row.get("ran") or row["algo"])
            out.append(
                AllReduceMeasurement(
                    source=source,
                    algo=ran_algorithm(ran),
                    requested=str(row["algo"]),
                    launch=ran_launch(ran),
                    nbytes=int(row["size"]),
                    dtype=str(row.get("type", settings.get("dtype", "bfloat16"))),
                    nodes=nodes,
                    ranks_per_node=rpn,
                    graph=bool(row.get("graph", settings.get("graph", True))),
                    time_us=float(row["time_us"]),
                )
            )
        except (KeyError, TypeError, ValueError) as e:
            raise MeasurementError(f"{source}: row {i} does not follow the all-reduce schema ({e!r})") from None
    return out


_LOG_HEADER = re.compile(r"^=== \S+ bench (?:study|batch) (\S+) (\S+)")
_LOG_ROW = re.compile(
    r"^\s*TP=(\d+) PP=(\d+) mb=(\d+) batch=(\d+) (\S+)->(\S+): TTFT ([\d.]+) ms, "
    r"TPOT ([\d.]+) ms, E2E ([\d.]+) ms"
)


def study_log_rows(text: str, source: str) -> list[dict[str, Any]]:
    """Engine rows from a study's stdout: one per row line under a `=== TIME bench study MODEL WORKLOAD` header.
    The log does not name prefill's all-reduce (no `allreduce_ran_prefill`)."""
    rows, model, workload = [], None, None
    for i, line in enumerate(text.splitlines(), 1):
        if h := _LOG_HEADER.match(line):
            model, workload = h.group(1), h.group(2)
            continue
        r = _LOG_ROW.match(line)
        if not r:
            continue
        if model is None or workload not in WORKLOADS:
            raise MeasurementError(
                f"{source}:{i}: a study row before a header naming the model and a known "
                f"workload ({', '.join(WORKLOADS)})"
            )
        tp, pp, mb, batch = (int(r.group(k)) for k in (1, 2, 3, 4))
        prompt, decode = WORKLOADS[workload]
        rows.append(
            {
                "model": model,
                "truncated_layers": None,
                "tp": tp,
                "pp": pp,
                "micro_batches": mb,
                "batch": batch,
                "prompt_len": prompt,
                "decode_len": decode,
                "workload": workload,
                "allreduce": r.group(5),
                "allreduce_ran": r.group(6),
                "ttft_ms": float(r.group(7)),
                "tpot_ms": float(r.group(8)),
                "e2e_ms": float(r.group(9)),
                "cuda_graphs": True,
                "log_line": i,
            }
        )
    return rows


def load_results(paths: list[Path]) -> tuple[list[AllReduceMeasurement], list[EngineMeasurement], list[str]]:
    """All-reduce rows, engine rows, and one line per file that was skipped (with why)."""
    ar, eng, skipped = [], [], []
    for path in paths:
        if Path(path).suffix == ".log":
            rows = study_log_rows(Path(path).read_text(errors="replace"), str(path))
            eng += [EngineMeasurement(str(path), "study-log", row) for row in rows]
            if not rows:
                skipped.append(f"{path}: no study rows in this log")
            continue
        try:
            doc = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as e:
            skipped.append(f"{path}: not readable JSON ({e})")
            continue
        kind = doc.get("kind") if isinstance(doc, dict) else None
        machine = doc.get("machine") if isinstance(doc, dict) else None
        # Our benchmarks record the GPUs they ran on; an empty list is a CPU (gloo) run.
        if kind in ("allreduce", "batch", "study") and isinstance(machine, dict) and machine.get("gpus") == []:
            skipped.append(f"{path}: a CPU run (no GPUs in its 'machine' record): the presets model GPU machines")
            continue
        if kind == "allreduce":
            ar += allreduce_rows(doc, str(path))
        elif kind in ("batch", "study"):
            rpn = (doc.get("settings") or {}).get("ranks_per_node")
            extra = {"ranks_per_node": rpn} if rpn else {}
            rows = doc.get("rows", [])

            # The engine constants are per-layer costs of the eager forward replayed in CUDA graphs with
            # F.linear; a torch.compile'd step or the skinny GEMM is another kernel mix, not predicted.
            def modelled(r: dict) -> bool:
                return not r.get("compile_decode") and r.get("decode_gemm", "torch") == "torch"

            other = [r for r in rows if not modelled(r)]
            if other:
                skipped.append(
                    f"{path}: {len(other)} rows with a compiled decode step or decode_gemm other than 'torch': "
                    "the engine model's constants describe the eager forward with F.linear"
                )
            eng += [EngineMeasurement(str(path), kind, {**extra, **row}) for row in rows if modelled(row)]
        else:
            skipped.append(f"{path}: kind={kind!r} is not a measurement the model predicts")
    return ar, eng, skipped


def result_files(results_dir: Path) -> list[Path]:
    """Every JSON under results/ (machine sub-folders included), without the validation report itself, and
    every study_*.log whose JSON (final, or the partial one of a run cut short) is missing."""
    root = Path(results_dir)
    logs = [
        p
        for p in root.rglob("study_*.log")
        if not p.with_suffix(".json").exists() and not p.with_suffix(".partial.json").exists()
    ]
    return sorted([p for p in root.rglob("*.json") if p.name != "perf_validation.json"] + logs)
