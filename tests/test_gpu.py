"""GPU conformance of the all-reduce backends, asserted on the files `scripts/gpu_check.sh` writes.

The conformance run (`scripts/gpu_allreduce_conformance.py`, torchrun, one process per GPU) executes the same
case bodies as the CPU tests (spanllm.comm.conformance) against nvrar and the baselines and writes every
CaseResult; the timeout run (`scripts/gpu_nvrar_timeout.py`) makes the last rank skip an nvrar call. The
folder comes from SPANLLM_GPU_RESULTS (gpu_check.sh's pytest stage sets it):

    scripts/gpu_check.sh conformance timeout pytest
"""

from __future__ import annotations

import json
import os

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2,
                       reason=f"needs >= 2 CUDA GPUs, found {torch.cuda.device_count()}"),
]

MAX_BYTES = 8 << 20  # the conformance script's --max-bytes default, which gpu_check.sh keeps
LENGTHS = [1, 2, 3, 5, 7, 8, 31, 127, 128, 1000, 1023, 4097, 65537, 262147, 1_000_003, MAX_BYTES // 4, MAX_BYTES // 2]
ITEMSIZE = {"torch.float32": 4, "torch.bfloat16": 2, "torch.float16": 2, "torch.int32": 4}
NVRAR_DTYPES = {"torch.float32", "torch.bfloat16", "torch.float16"}
CALLS = 10_000
PHASES = {1: "inter-node recursive doubling", 2: "intra-node reduce-scatter"}  # ranks_per_node -> where rank 0 waits


def results_file(name: str) -> str:
    folder = os.environ.get("SPANLLM_GPU_RESULTS")
    if not folder:
        pytest.skip("SPANLLM_GPU_RESULTS is not set: run `scripts/gpu_check.sh conformance timeout pytest`, "
                    "which writes the result files and points this variable at them")
    if not os.path.isdir(folder):
        pytest.skip(f"SPANLLM_GPU_RESULTS={folder!r} is not a folder")
    path = os.path.join(folder, name)
    if not os.path.exists(path):
        pytest.skip(f"{path} is missing: the stage of scripts/gpu_check.sh that writes it did not run or did not finish")
    return path


def load(name: str) -> dict:
    with open(results_file(name)) as f:
        return json.load(f)


# --------------------------------------------------------------------------------------------------
# checks (plain functions over the documents, so they read the same on any machine)


def conformance_problems(doc: dict, ranks_per_node: int) -> list[str]:
    """Every way a conformance document falls short; empty when it passes."""
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
    want_variants = {"nvrar:default", "nvrar:rs_b4x256", "nvrar:rs_b64x1024", "nvrar:simple_rs_b16x512",
                     "nvrar:pipe_rs_b2x256", "nvrar:pipe_simple_rs_b4x512"} | (
        {"nvrar:os_b8x512", "nvrar:simple_os_b8x256", "nvrar:pipe_os_b2x256"} if ranks_per_node > 1 else set())
    if set(nvrar) != want_variants:
        problems.append(f"nvrar variants {nvrar}, expected {sorted(want_variants)}")
    for comm in nvrar:
        mine = [r for r in results if r["comm"] == comm]
        cases = {r["case"] for r in mine}
        for case in ("length", "bitwise_identical", "straggler", "cuda_graph", "back_to_back", "non_contiguous",
                     "bad_dtype"):
            if case not in cases:
                problems.append(f"{comm}: no {case} case")
        for dtype in sorted(NVRAR_DTYPES):
            got = sorted(r["detail"]["n"] for r in mine if r["case"] == "length" and r["detail"]["dtype"] == dtype)
            want = [n for n in LENGTHS if n * ITEMSIZE[dtype] <= MAX_BYTES]
            if got != want:
                problems.append(f"{comm} {dtype}: lengths {got}, expected 1 .. {want[-1]} ({want})")
        b2b = [r["detail"]["calls"] for r in mine if r["case"] == "back_to_back"]
        if CALLS not in b2b:
            problems.append(f"{comm}: back_to_back calls {b2b}, expected a run of {CALLS}")
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
# tests


@pytest.mark.parametrize("rpn", [2, 1])
def test_conformance_results(rpn):
    doc = load(f"conformance_rpn{rpn}.json")
    assert conformance_problems(doc, rpn) == []


@pytest.mark.parametrize("rpn", [2, 1])
def test_nvrar_timeout_names_rank_peer_and_phase(rpn):
    if torch.cuda.device_count() != 2:
        pytest.skip("the peer and phase rank 0 waits in are worked out for 2 GPUs (last rank skips, rank 0 waits "
                    f"for rank 1); this machine has {torch.cuda.device_count()}")
    rec = load(f"timeout_rpn{rpn}.json.rank0")
    assert timeout_problems(rec, rpn) == []
