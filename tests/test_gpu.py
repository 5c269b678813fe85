"""GPU conformance of the all-reduce backends: `python -m pytest -m gpu` launches the runs and asserts on them.

Each case starts `torchrun` (one process per GPU, a free port) on `scripts/gpu_allreduce_conformance.py`, which
executes the same case bodies as the CPU tests (spanllm.comm.conformance) against nvrar and the baselines,
then asserts that its JSON has every case and no wrong element; `scripts/gpu_nvrar_timeout.py` makes the last
rank skip an nvrar call, and rank 0 must raise an error naming itself, the peer and the phase. Cases are
parametrised over world sizes 2 and every GPU present (nvrar refuses a single rank); a case that needs more GPUs
than the host has skips,
saying so. The JSON files are a by-product: in $SPANLLM_GPU_OUT when set, else in pytest's tmp folder.
The checkers are plain functions over the documents: tests/test_committed_results.py applies them to the
committed results on any machine.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[1]
NGPU = torch.cuda.device_count()
WORLDS = sorted({2, max(NGPU, 2)})  # nvrar refuses 1 rank (symmetric memory needs 2): nothing to reduce there
MAX_BYTES = 8 << 20  # the conformance script's --max-bytes default, which gpu_check.sh keeps
BASE_LENGTHS = [1, 2, 3, 5, 7, 8, 31, 127, 128, 1000, 1023, 4097, 65537, 262147, 1_000_003]
ITEMSIZE = {"torch.float32": 4, "torch.bfloat16": 2, "torch.float16": 2, "torch.int32": 4}
NVRAR_DTYPES = {"torch.float32", "torch.bfloat16", "torch.float16"}
CALLS = 10_000  # gpu_check.sh's conformance stage (and the committed results)
TEST_CALLS = 1_000  # back-to-back calls of the run pytest launches (a shorter run of the same cases)
PHASES = {1: "inter-node recursive doubling", 2: "intra-node reduce-scatter"}  # ranks_per_node -> where rank 0 waits


def lengths(max_bytes: int) -> list[int]:
    """The element counts the conformance script runs: its list plus the buffer maximum for 4- and 2-byte dtypes."""
    return BASE_LENGTHS + [max_bytes // 4, max_bytes // 2]


# --------------------------------------------------------------------------------------------------
# checks (plain functions over the documents, so they read the same on any machine)


def conformance_problems(doc: dict, ranks_per_node: int, calls: int = CALLS, max_bytes: int = MAX_BYTES) -> list[str]:
    """Every way a conformance document falls short; empty when it passes. `calls` and `max_bytes`: the
    run's --calls and --max-bytes (gpu_check.sh's defaults, as in the committed results)."""
    problems = []
    if doc.get("kind") != "gpu_conformance":
        return [f"kind={doc.get('kind')!r}, expected 'gpu_conformance'"]
    world = doc["world_size"]
    want_topo = f"{world // ranks_per_node}x{ranks_per_node}"
    if doc["topology"] != want_topo:
        problems.append(f"topology {doc['topology']}, expected {want_topo}")
    results = doc["results"]
    if not results:
        problems.append("no results")
    problems += [f"{r['comm']} {r['case']} {r['detail']}: {r['wrong']} wrong" for r in results if r["wrong"] != 0]
    if not any(r["case"] == "alternating_protocols" for r in results):
        problems.append("no alternating_protocols case (LL8 / SIMPLE / one-shot on one communicator)")
    nvrar = sorted({r["comm"] for r in results if r["comm"].startswith("nvrar")})
    if doc.get("complete") is False:
        problems.append("the run stopped before every backend finished (complete=False)")
    want_variants = {
        "nvrar:default",
        "nvrar:rs_b4x256",
        "nvrar:rs_b64x1024",
        "nvrar:simple_rs_b16x512",
        "nvrar:pipe_rs_b2x256",
        "nvrar:pipe_simple_rs_b4x512",
    } | ({"nvrar:os_b8x512", "nvrar:simple_os_b8x256", "nvrar:pipe_os_b2x256"} if ranks_per_node > 1 else set())
    if set(nvrar) != want_variants:
        problems.append(f"nvrar variants {nvrar}, expected {sorted(want_variants)}")
    for comm in nvrar:
        mine = [r for r in results if r["comm"] == comm]
        cases = {r["case"] for r in mine}
        for case in (
            "length",
            "bitwise_identical",
            "straggler",
            "cuda_graph",
            "back_to_back",
            "non_contiguous",
            "bad_dtype",
        ):
            if case not in cases:
                problems.append(f"{comm}: no {case} case")
        for dtype in sorted(NVRAR_DTYPES):
            got = sorted(r["detail"]["n"] for r in mine if r["case"] == "length" and r["detail"]["dtype"] == dtype)
            want = sorted({n for n in lengths(max_bytes) if n * ITEMSIZE[dtype] <= max_bytes})
            if got != want:
                problems.append(f"{comm} {dtype}: lengths {got}, expected 1 .. {want[-1]} ({want})")
        b2b = [r["detail"]["calls"] for r in mine if r["case"] == "back_to_back"]
        if calls not in b2b:
            problems.append(f"{comm}: back_to_back calls {b2b}, expected a run of {calls}")
        strag = [r["detail"] for r in mine if r["case"] == "straggler"]
        if not any(d.get("sleep_s", 0) > 0 for d in strag):
            problems.append(f"{comm}: no straggler case with a sleeping rank ({strag})")
        graphs = [r["detail"] for r in mine if r["case"] == "cuda_graph"]
        if not any(d.get("replays", 0) > 1 for d in graphs):
            problems.append(f"{comm}: no CUDA-graph case replayed more than once ({graphs})")
    return problems


def timeout_problems(rec: dict, ranks_per_node: int) -> list[str]:
    problems = []
    err = rec.get("error")
    if rec.get("rank") != 0 or rec.get("skipped"):
        problems.append(f"record is not rank 0's waiting side: {rec}")
    if not err:
        return problems + ["rank 0 returned without an error: the skipped call went unnoticed"]
    if err.startswith("unrecorded"):
        problems.append(f"the kernel trapped without an error record: {err}")
    for needle in ("rank 0", "peer rank 1", PHASES[ranks_per_node]):
        if needle not in err:
            problems.append(f"error does not mention {needle!r}: {err}")
    if not rec["seconds"] < 10:
        problems.append(f"the error took {rec['seconds']:.1f} s (>= 10 s)")
    return problems


# --------------------------------------------------------------------------------------------------
# running the scripts


def needs_gpus(n: int) -> None:
    if NGPU < n:
        pytest.skip(f"needs {n} CUDA GPU{'s' if n > 1 else ''}, this host has {NGPU}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def out_dir(tmp_path: Path) -> Path:
    folder = Path(os.environ.get("SPANLLM_GPU_OUT") or tmp_path)
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def torchrun(script: str, nproc: int, *args: str, timeout_s: float) -> None:
    """One torchrun job on this host; fails the test with the output's tail when it does not exit 0."""
    env = {
        **os.environ,
        "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        "PYTHONUNBUFFERED": "1",
        "NCCL_NVLS_ENABLE": "0",
        "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
        "NVSHMEM_DISABLE_NVLS": "1",
    }  # no NVLink multicast on shared hosts
    env.setdefault("NVSHMEM_SYMMETRIC_SIZE", "8G")  # the conformance run holds several nvrar workspaces
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "1",
        "--nproc-per-node",
        str(nproc),
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
        str(ROOT / "scripts" / script),
        *args,
    ]
    try:
        p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{script} on {nproc} GPU(s) ran past {timeout_s:.0f} s:\n{(e.stdout or '')[-3000:]}")
    assert p.returncode == 0, f"{' '.join(cmd)} exited {p.returncode}:\n{(p.stdout + p.stderr)[-4000:]}"


def conformance_cases() -> list:
    """(world, ranks per node): one node of `world` GPUs, and `world` single-GPU nodes."""
    return [pytest.param(w, rpn, id=f"{w // rpn}x{rpn}") for w in WORLDS for rpn in sorted({w, 1}, reverse=True)]


# --------------------------------------------------------------------------------------------------
# tests


@pytest.mark.parametrize("world,rpn", conformance_cases())
def test_conformance(world, rpn, tmp_path):
    needs_gpus(world)
    out = out_dir(tmp_path) / f"conformance_{world // rpn}x{rpn}.json"
    torchrun(
        "gpu_allreduce_conformance.py",
        world,
        "--ranks-per-node",
        str(rpn),
        "--calls",
        str(TEST_CALLS),
        "--out",
        str(out),
        timeout_s=600,
    )
    doc = json.loads(out.read_text())
    assert conformance_problems(doc, rpn, calls=TEST_CALLS) == []


@pytest.mark.parametrize("rpn", [2, 1])
def test_nvrar_timeout_names_rank_peer_and_phase(rpn, tmp_path):
    # 2 ranks whatever the host has: the last rank skips, rank 0 waits for rank 1 (the peer and phase the
    # checker expects are worked out for that pair)
    needs_gpus(2)
    out = out_dir(tmp_path) / f"timeout_{2 // rpn}x{rpn}.json"
    torchrun("gpu_nvrar_timeout.py", 2, "--ranks-per-node", str(rpn), "--out", str(out), timeout_s=180)
    rec = json.loads(Path(f"{out}.rank0").read_text())
    assert timeout_problems(rec, rpn) == []
