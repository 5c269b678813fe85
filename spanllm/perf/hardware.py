"""Cluster presets: the one table of hardware and per-algorithm constants the performance model uses.

Every number carries its source in a comment. Tags: [measured] on the lab's 2 x H200 host (results/h200x2/:
the files, and the floor numbers in results/h200x2/NOTES_nvrar.md), [datasheet] vendor figure, [NCCL] NCCL's
own tuning model (src/graph/tuning.cc, baseLat / hwLat tables and the LL / LL128 / tree bandwidth factors),
[fit] least squares over measured points (named), [source] a public figure other than a datasheet (named where
it is used), [assumed] an engineering guess that no measurement backs yet -- these are the first numbers to
replace with `spanllm perf calibrate` once a sweep on that cluster exists.

Units are in the field names: GB = 1e9 bytes, GBps = 1e9 bytes/s (= 1e3 bytes/us), us = microseconds.
Link bandwidths are per GPU and per direction.

Three kinds of constants are kept apart: the links (NVLink / NIC bandwidth and one-way latency:
ClusterSpec fields), the NVSHMEM transport that drives the NIC (`transport`, spanllm.perf.transport),
and what spanllm's own all-reduce kernel costs on the GPU (`kernel`, KernelCost: measured on the H200
host and carried to every preset). The nvrar / recursive-doubling entries of `algos` are built from the
three (`default_algo_costs`) unless a sweep on that cluster fitted them.

Every [assumed] constant of a preset has a plausible range in `ClusterSpec.ranges` (path -> (low, high)),
e.g. "nic_latency_us", "transport.proxy_us", "kernel.call_us"; spanllm.perf.uncertainty turns them into
ranges of the predictions (`spanllm plan`, `spanllm perf validate`).

A user cluster is a JSON or TOML file with the same field names (see `load_cluster`); `algos` entries
that it leaves out are filled from the defaults below, built from its own link latencies.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import tomllib

from spanllm.perf.transport import TRANSPORTS, Transport, TransportError, get_transport


class ClusterSpecError(ValueError):
    """A cluster preset or preset file with a missing or impossible value."""


@dataclass(frozen=True)
class AlgoCost:
    """Per-call constants of one all-reduce algorithm (one protocol) on one cluster.

    time = launches + base_us + nvlink_steps * nvlink_step_us + net_steps * net_step_us
           + wire_factor * payload bytes / (link bandwidth * bw_efficiency)
    A step's cost includes the link's own latency (flag seen by the peer) and the algorithm's work
    per step (poll, reduce, fence).
    """

    base_us: float  # fixed per-call cost beyond launches (NCCL's baseLat; 0 for a single fused kernel)
    nvlink_step_us: float  # cost of one step whose transfer crosses NVLink
    net_step_us: float  # cost of one step whose transfer crosses the network
    wire_factor: float  # wire bytes per payload byte (LL: 8-byte line carries 4 data bytes -> 2)
    bw_efficiency: float  # fraction of the link bandwidth the protocol reaches
    kernels: int = 1  # kernel launches (CUDA-graph nodes) per call
    eager_us: float = 0.0  # extra host cost per call outside a CUDA graph
    picked_above_bytes: int = 0  # a protocol variant the library was measured not to pick up to this size

    def __post_init__(self) -> None:
        for name in ("base_us", "nvlink_step_us", "net_step_us", "eager_us"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and v >= 0 and math.isfinite(v)):
                raise ClusterSpecError(f"AlgoCost.{name}={v!r} must be a finite number >= 0 (microseconds)")
        if not 1.0 <= self.wire_factor <= 8.0:
            raise ClusterSpecError(
                f"AlgoCost.wire_factor={self.wire_factor!r} must lie in [1, 8] "
                "(wire bytes per payload byte; LL protocols use 2)"
            )
        if not 0.0 < self.bw_efficiency <= 1.0:
            raise ClusterSpecError(
                f"AlgoCost.bw_efficiency={self.bw_efficiency!r} must lie in (0, 1] (fraction of link bandwidth reached)"
            )
        if not isinstance(self.picked_above_bytes, int) or self.picked_above_bytes < 0:
            raise ClusterSpecError(f"AlgoCost.picked_above_bytes={self.picked_above_bytes!r} must be an integer >= 0")
        if not isinstance(self.kernels, int) or self.kernels < 1:
            raise ClusterSpecError(f"AlgoCost.kernels={self.kernels!r} must be an integer >= 1")


@dataclass(frozen=True)
class EngineCost:
    """What the spanllm engine's own implementation costs beyond the roofline and the launch costs, on one cluster.

    All zero (the default): an ideal engine -- KERNELS_PER_LAYER graph nodes per decode layer, decode
    attention over the mean context at HBM speed, eager prefill at `gemm_efficiency` whose launches hide
    behind the GPU work. Fitted per cluster from engine runs with `spanllm perf calibrate --engine`
    (spanllm.perf.engine_fit).
    """

    decode_layer_us: float = 0.0  # fixed GPU time per decoder layer per decode step, beyond its graph nodes
    attn_position_ns: float = 0.0  # decode attention: time per cache position scanned, per layer (serial key scan)
    attends_max_seq_len: bool = False  # decode attention scans every position up to prompt + decode (masked)
    eager_layer_host_us: float = 0.0  # eager prefill: host time to issue one layer (0: kernels x kernel_launch_us)
    prefill_efficiency: float = (
        0.0  # eager prefill: achieved / peak bf16 over GEMM + attention FLOPs (0: gemm_efficiency)
    )
    # Larger GEMMs run closer to peak: prefill_efficiency holds at prefill_ref_layer_params (one layer's
    # parameters on one GPU, i.e. / tp); a layer of P per GPU runs at prefill_efficiency x (P / ref) ** exponent,
    # at most 1 (0: the same efficiency for every size)
    prefill_ref_layer_params: float = 0.0
    prefill_size_exponent: float = 0.0

    def __post_init__(self) -> None:
        for name in (
            "decode_layer_us",
            "attn_position_ns",
            "eager_layer_host_us",
            "prefill_ref_layer_params",
            "prefill_size_exponent",
        ):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and v >= 0 and math.isfinite(v)):
                raise ClusterSpecError(f"EngineCost.{name}={v!r} must be a finite number >= 0")
        if not (isinstance(self.prefill_efficiency, (int, float)) and 0 <= self.prefill_efficiency <= 1):
            raise ClusterSpecError(
                f"EngineCost.prefill_efficiency={self.prefill_efficiency!r} must lie in [0, 1] (0: use gemm_efficiency)"
            )


@dataclass(frozen=True)
class KernelCost:
    """spanllm's NVSHMEM all-reduce kernel (spanllm.comm.nvrar.kernel, LL8 cells) on the GPU itself, apart from
    any link: measured on the 2 x H200 host (`_HOST_NVRAR_FIT` below) and carried to every preset, where the
    same kernel runs (other GPUs: ranges in ClusterSpec.ranges)."""

    call_us: float = 3.130  # per call beyond its graph node: sequence load, program start, the call's first flag wait
    phase_us: float = 0.765  # per exchange phase or round: push the cells, poll the partner's, add
    bw_efficiency: float = 0.813  # fraction of the link bandwidth its LL8 stores reach

    def __post_init__(self) -> None:
        for name in ("call_us", "phase_us"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and v >= 0 and math.isfinite(v)):
                raise ClusterSpecError(f"KernelCost.{name}={v!r} must be a finite number >= 0 (microseconds)")
        if not 0.0 < self.bw_efficiency <= 1.0:
            raise ClusterSpecError(f"KernelCost.bw_efficiency={self.bw_efficiency!r} must lie in (0, 1]")


@dataclass(frozen=True)
class ClusterSpec:
    name: str
    description: str
    gpu: str
    gpus_per_node: int
    gpu_memory_GB: float
    hbm_GBps: float  # datasheet peak
    hbm_efficiency: float  # achieved / peak for streaming reads (weights, KV cache)
    bf16_TFLOPs: float  # datasheet dense peak
    gemm_efficiency: float  # achieved / peak for large bf16 GEMMs
    nvlink_GBps: float  # per GPU, per direction; 0 only with one GPU per node
    nvlink_latency_us: float  # one-way: a flag stored to the peer is seen after this long
    nic_GBps_per_gpu: float  # network bandwidth per GPU, per direction; 0 = no network (one host)
    nic_latency_us: float  # one-way small put GPU -> remote GPU, through the transport actually used
    graph_node_us: float  # one kernel node inside a replayed CUDA graph
    kernel_launch_us: float  # one eager kernel launch from Python
    # FP8 (e4m3) GEMM rate / bf16 GEMM rate at large M (prefill; W8A8 on FP8 tensor cores); 1.0: no FP8 tensor
    # cores, FP8 weights only halve the bytes read
    fp8_gemm_speedup: float = 1.0
    # FP8 layer weights' streaming rate over bf16's at the same rows, where a GEMM is bound by its weight reads (1.0:
    # the FP8 kernels stream as fast as the bf16 ones, so half the bytes take half the time). w8a16: up to
    # quantization.W8A16_MAX_ROWS rows (the weight-only GEMV / skinny GEMM); w8a8: more rows (per-token quantization
    # and FP8 tensor cores)
    fp8_read_w8a16: float = 1.0
    fp8_read_w8a8: float = 1.0
    algos: Mapping[str, AlgoCost] = field(default_factory=dict)
    engine: EngineCost = EngineCost()  # the spanllm engine's costs on this cluster (zeros: an ideal engine)
    transport: Transport = TRANSPORTS["ibgda"]  # NVSHMEM's remote transport (unused without a network)
    kernel: KernelCost = KernelCost()  # spanllm's all-reduce kernel on this GPU
    ranges: Mapping[str, tuple[float, float]] = field(default_factory=dict)  # [assumed] constant -> (low, high)

    def __post_init__(self) -> None:
        if not isinstance(self.transport, Transport):
            raise ClusterSpecError(f"{self.name}: transport is {type(self.transport).__name__}, expected Transport")
        if not isinstance(self.kernel, KernelCost):
            raise ClusterSpecError(f"{self.name}: kernel is {type(self.kernel).__name__}, expected KernelCost")
        if not isinstance(self.engine, EngineCost):
            raise ClusterSpecError(f"{self.name}: engine is {type(self.engine).__name__}, expected EngineCost")
        if not isinstance(self.gpus_per_node, int) or self.gpus_per_node < 1:
            raise ClusterSpecError(f"{self.name}: gpus_per_node={self.gpus_per_node!r} must be an integer >= 1")
        positive = (
            "gpu_memory_GB",
            "hbm_GBps",
            "bf16_TFLOPs",
            "graph_node_us",
            "kernel_launch_us",
            "nvlink_latency_us",
            "nic_latency_us",
        )
        for name in positive:
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and v > 0 and math.isfinite(v)):
                raise ClusterSpecError(f"{self.name}: {name}={v!r} must be a finite number > 0")
        if not (isinstance(self.fp8_gemm_speedup, (int, float)) and 1.0 <= self.fp8_gemm_speedup <= 2.0):
            raise ClusterSpecError(
                f"{self.name}: fp8_gemm_speedup={self.fp8_gemm_speedup!r} must lie in [1, 2] "
                "(FP8 / bf16 tensor-core rate; 1 without FP8 tensor cores)"
            )
        for name in ("hbm_efficiency", "gemm_efficiency"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and 0 < v <= 1):
                raise ClusterSpecError(f"{self.name}: {name}={v!r} must lie in (0, 1] (achieved / peak)")
        for name in ("fp8_read_w8a16", "fp8_read_w8a8"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and 0 < v <= 1):
                raise ClusterSpecError(
                    f"{self.name}: {name}={v!r} must lie in (0, 1] (FP8 weights' streaming rate / bf16's)"
                )
        if self.nvlink_GBps < 0 or self.nic_GBps_per_gpu < 0:
            raise ClusterSpecError(
                f"{self.name}: link bandwidths must be >= 0 "
                f"(nvlink_GBps={self.nvlink_GBps}, nic_GBps_per_gpu={self.nic_GBps_per_gpu})"
            )
        if self.gpus_per_node > 1 and self.nvlink_GBps <= 0:
            raise ClusterSpecError(
                f"{self.name}: nvlink_GBps={self.nvlink_GBps} but gpus_per_node="
                f"{self.gpus_per_node}; give the intra-node link bandwidth per GPU per direction"
            )
        for key, cost in self.algos.items():
            if not isinstance(cost, AlgoCost):
                raise ClusterSpecError(f"{self.name}: algos[{key!r}] is {type(cost).__name__}, expected AlgoCost")
        for path, bounds in self.ranges.items():
            value = constant_value(self, path)  # raises on a path that names no constant
            lo, hi = bounds
            if not lo <= value <= hi:
                raise ClusterSpecError(
                    f"{self.name}: ranges[{path!r}] = ({lo}, {hi}) does not hold the value {value}; "
                    "a range must contain the constant it bounds"
                )

    @property
    def has_network(self) -> bool:
        return self.nic_GBps_per_gpu > 0

    def algo(self, key: str) -> AlgoCost:
        if key not in self.algos:
            raise ClusterSpecError(
                f"cluster {self.name!r} has no constants for {key!r}; known: {', '.join(sorted(self.algos))}"
            )
        return self.algos[key]


# ---------------------------------------------------------------------------------------------------
# Per-algorithm defaults.

# [NCCL] src/graph/tuning.cc (2.2x): baseLat per call, hwLat per hop on NVLink / network, for
# (algorithm, protocol). Bandwidth: NCCL caps LL at 1/4 of the bus bandwidth (= 2x wire bytes at 50%
# efficiency), LL128 at 0.92 x (120/128 payload per line), tree at 0.92 x. Simple: full bandwidth.
# NCCL's tuner takes the protocol its model prices fastest at every size: so do the presets with a network
# (picked_above_bytes 0). A cross-check of the transcription: NCCL 2.2x's own tuner printed 25.2-26.6 us for
# tree/LL at 64 B - 8 KiB on 2 x 8 H100 (NVIDIA/nccl#1453, NCCL_DEBUG=INFO); this table gives 25.7 us there
# (spanllm.perf.published, `perf validate` scores it).
# [measured] eager_us: NCCL through torch.distributed took 29-34 us per call without graphs vs 11.5 us
# captured at small sizes on the H200 host (captured: results/h200x2/allreduce_*_bf16.json; eager: a
# `bench allreduce --no-graph` run there, not committed): ~20 us of host path per call.
NCCL_EAGER_US = 20.0
# [measured on the H200 host only] NCCL's nominal model would switch to LL128 / Simple well below 2 MiB
# (20 us at 2 MiB on 2 H200s) but the measured calls stay on the LL-like line (31.2 us at 2 MiB): on that
# host LL128 and Simple are only considered above this size (`_HOST_NCCL_FIT`).
NCCL_LL_UP_TO_BYTES = 2 * 1024 * 1024
_LL = dict(wire_factor=2.0, bw_efficiency=0.5, eager_us=NCCL_EAGER_US)
_LL128 = dict(wire_factor=128 / 120, bw_efficiency=0.92, eager_us=NCCL_EAGER_US)
_SIMPLE = dict(wire_factor=1.0, eager_us=NCCL_EAGER_US)
NCCL_PROTOCOLS: dict[str, AlgoCost] = {
    "nccl_ring/LL": AlgoCost(base_us=6.6, nvlink_step_us=0.6, net_step_us=2.7, **_LL),
    "nccl_ring/LL128": AlgoCost(base_us=14.0, nvlink_step_us=1.9, net_step_us=4.0, **_LL128),
    "nccl_ring/Simple": AlgoCost(base_us=8.4, nvlink_step_us=3.4, net_step_us=14.0, bw_efficiency=1.0, **_SIMPLE),
    "nccl_tree/LL": AlgoCost(base_us=6.8, nvlink_step_us=0.6, net_step_us=5.0, **_LL),
    "nccl_tree/LL128": AlgoCost(base_us=14.0, nvlink_step_us=1.25, net_step_us=8.5, **_LL128),
    "nccl_tree/Simple": AlgoCost(base_us=8.4, nvlink_step_us=4.0, net_step_us=14.0, bw_efficiency=0.92, **_SIMPLE),
}

# [fit] torch symmetric-memory one-shot / two-shot on the H200 host, fitted by `spanllm perf calibrate`
# (relative least squares) to results/h200x2/allreduce_1x2_bf16.json (the 2026-11-30 sweep), rows of the
# sizes H200X2_FIT_SIZES below (every other size of the sweep, 1 KiB .. 16 MiB; the rest are held out for
# `perf validate`): 8 torch_one_shot rows, 9 torch_two_shot rows (1 of them `auto->torch_two_shot`).
# base_us is not separable from the barrier cost (every call has the same barrier count) and stays 0.
# Structure (allreduce_model): one-shot = 1 kernel, in-kernel copy-in + 2 barriers; two-shot = 2 kernels
# (`buf.copy_(x)` + `two_shot_all_reduce_out`, spanllm.comm.torch_symm) + copy + 3 barriers. The two
# fits agree on the barrier cost (3.36 vs 3.36 us), which the old single-kernel two-shot model missed
# (it predicted ~6.4 us at small sizes vs 10.9-12 us measured). Used on every NVLink cluster: same
# kernels, same flag protocol.
TORCH_ONE_SHOT = AlgoCost(base_us=0.0, nvlink_step_us=3.355, net_step_us=0.0, wire_factor=1.0, bw_efficiency=0.336)
TORCH_TWO_SHOT = AlgoCost(
    base_us=0.0, nvlink_step_us=3.363, net_step_us=0.0, wire_factor=1.0, bw_efficiency=0.647, kernels=2
)


def ll8_cost(nvlink_latency_us: float, nic_latency_us: float, kernel: KernelCost, transport: Transport) -> AlgoCost:
    """nvrar / flat recursive doubling (LL8 cells) from the kernel's own costs, the links and the transport.

    base_us = kernel.call_us; an NVLink phase costs kernel.phase_us (the NVLink flag latency is paid once
    per call, inside call_us: the H200 fit, and peers push before they poll, so later phases overlap it);
    a network round costs kernel.phase_us + transport.round_us(nic_latency_us) (a put and its signal,
    spanllm.perf.transport), since a round's put waits for the previous round's data."""
    return AlgoCost(
        base_us=kernel.call_us,
        nvlink_step_us=kernel.phase_us,
        net_step_us=kernel.phase_us + transport.round_us(nic_latency_us),
        wire_factor=2.0,
        bw_efficiency=kernel.bw_efficiency,
    )


def default_algo_costs(
    nvlink_latency_us: float,
    nic_latency_us: float,
    kernel: KernelCost | None = None,
    transport: Transport | None = None,
) -> dict[str, AlgoCost]:
    """The per-algorithm table for a cluster with these links, kernel and transport (NCCL's own constants are fixed)."""
    ll8 = ll8_cost(nvlink_latency_us, nic_latency_us, kernel or KernelCost(), transport or TRANSPORTS["ibgda"])
    return {
        **NCCL_PROTOCOLS,
        "torch_one_shot": TORCH_ONE_SHOT,
        "torch_two_shot": TORCH_TWO_SHOT,
        "nvrar": ll8,
        "recursive_doubling": ll8,
    }


def spec_defaults(spec: ClusterSpec) -> dict[str, AlgoCost]:
    return default_algo_costs(spec.nvlink_latency_us, spec.nic_latency_us, spec.kernel, spec.transport)


# ---------------------------------------------------------------------------------------------------
# Constants by path (ranges, calibration, uncertainty).

_SUB = {"transport": Transport, "kernel": KernelCost, "engine": EngineCost}


def constant_value(spec: ClusterSpec, path: str) -> float:
    """The number a path names: 'nic_latency_us', 'transport.proxy_us', 'kernel.call_us', 'algos.nvrar.base_us'."""
    parts = path.split(".")
    try:
        if parts[0] == "algos" and len(parts) == 3:
            v = getattr(spec.algos[parts[1]], parts[2])
        elif parts[0] in _SUB and len(parts) == 2:
            v = getattr(getattr(spec, parts[0]), parts[1])
        elif len(parts) == 1 and parts[0] not in ("algos", "ranges", *_SUB):
            v = getattr(spec, parts[0])
        else:
            raise AttributeError(path)
    except (AttributeError, KeyError):
        raise ClusterSpecError(
            f"{spec.name}: {path!r} names no constant; use a ClusterSpec field ('nic_latency_us'), "
            "'transport.FIELD', 'kernel.FIELD', 'engine.FIELD' or 'algos.KEY.FIELD'"
        ) from None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ClusterSpecError(f"{spec.name}: {path!r} is {v!r}, not a number a range can bound")
    return float(v)


def with_constant(spec: ClusterSpec, path: str, value: float) -> ClusterSpec:
    """`spec` with one constant replaced. Entries of `algos` built from the links, kernel and transport
    (equal to their defaults) are rebuilt from the new values; fitted entries stay as they are."""
    constant_value(spec, path)
    parts = path.split(".")
    if parts[0] == "algos":
        algos = {**spec.algos, parts[1]: replace(spec.algos[parts[1]], **{parts[2]: value})}
        return replace(spec, algos=algos)
    if parts[0] in _SUB:
        new = replace(spec, **{parts[0]: replace(getattr(spec, parts[0]), **{parts[1]: value})})
    else:
        value = int(value) if isinstance(getattr(spec, parts[0]), int) else value
        new = replace(spec, **{parts[0]: value})
    old_defaults, new_defaults = spec_defaults(spec), spec_defaults(new)
    algos = {k: new_defaults[k] if old_defaults.get(k) == v and k in new_defaults else v for k, v in spec.algos.items()}
    return replace(new, algos=algos)


# ---------------------------------------------------------------------------------------------------
# The presets.

# This lab host: 2 x H200 joined by NVLink (NV18), no network card.
_H200_NVLINK_LATENCY_US = (
    1.3  # [measured] flag ping-pong over NVLink, one way (results/h200x2/NOTES_nvrar.md, "The two numbers"; the
    # probe that measured it is not committed)
)


@dataclass(frozen=True)
class PresetFit:
    """Which measurements a preset's [fit] constants came from (so validation never scores them)."""

    file: str  # path relative to the repository root
    topology: str  # NODESxRANKS_PER_NODE of the rows used
    sizes: tuple[int, ...]  # message sizes of the rows used (every algorithm in `algos`)
    algos: tuple[str, ...]  # the algorithms (bench `ran` names) whose rows were used
    constants: tuple[str, ...]  # the AlgoCost entries fitted to them

    def describe(self) -> str:
        return (
            f"{', '.join(self.constants)} fitted to {self.file} ({self.topology}; {', '.join(self.algos)}; "
            f"sizes {', '.join(str(s) for s in self.sizes)} B)"
        )


H200X2_FIT_SIZES = tuple(1 << k for k in range(10, 25, 2))  # 1 KiB, 4 KiB, ..., 16 MiB: every other sweep size
H200X2_FIT = PresetFit(
    file="results/h200x2/allreduce_1x2_bf16.json",
    topology="1x2",
    sizes=H200X2_FIT_SIZES,
    algos=("nccl", "torch_one_shot", "torch_two_shot", "nvrar"),
    constants=(
        "nccl_ring/LL",
        "nccl_tree/LL",
        "nccl_ring/Simple",
        "nccl_tree/Simple",
        "torch_one_shot",
        "torch_two_shot",
        "nvrar",
    ),
)


@dataclass(frozen=True)
class EngineFitRows:
    """Which engine rows a preset's EngineCost was fitted to (`perf validate` scores them apart, as fitted-on)."""

    files: tuple[str, ...]  # paths relative to the repository root
    model: str  # the rows' `model`
    tp: int
    pp: int
    allreduce_ran: str  # the rows' decode all-reduce as written (`allreduce_ran`)

    def selects(self, source: str, row: Mapping[str, Any]) -> bool:
        path = Path(source).as_posix()
        return (
            any(path.endswith(f) for f in self.files)
            and row.get("model") == self.model
            and int(row.get("tp", 0)) == self.tp
            and int(row.get("pp", 0)) == self.pp
            and row.get("allreduce_ran") == self.allreduce_ran
        )

    def describe(self) -> str:
        return f"{self.model} TP={self.tp} PP={self.pp} {self.allreduce_ran} rows of {', '.join(self.files)}"


# [fit] The engine's own costs on this host (EngineCost), fitted by `spanllm perf calibrate --engine`
# (spanllm.perf.engine_fit) to these 6 rows only: Llama 3.1 8B, TP=2, NCCL, batch 1 / 8 / 64, of the
# decode-heavy (prompt 128, decode 512) and prefill-heavy (prompt 2048, decode 32) studies -- their TPOT
# and TTFT. Every other engine row (8B NVRAR and PP=2, all of 70B) is held out. HBM efficiency stays the
# separately measured copy figure; all-reduce constants come from the all-reduce sweeps.
H200X2_ENGINE_FIT = EngineFitRows(
    files=("results/h200x2/study_llama3.1-8b_decode-heavy.json", "results/h200x2/study_llama3.1-8b_prefill-heavy.json"),
    model="llama3.1-8b",
    tp=2,
    pp=1,
    allreduce_ran="nccl",
)

# [fit] NCCL 2.28.9 on 2 ranks, results/h200x2/allreduce_1x2_bf16.json, nccl rows of H200X2_FIT_SIZES:
# LL (ring and tree) on the 6 rows <= 2 MiB (1 KiB .. 1 MiB), Simple (ring and tree) on the 2 rows above
# (4 MiB, 16 MiB: NCCL has left LL there, 31.5 -> 35.0 us for 2x the bytes). base_us stays NCCL's own
# (2 ranks: always 2 ring steps, a fixed cost is not separable); the step cost and efficiency are fitted.
# LL128 keeps NCCL's nominal constants but, as `calibrate` does, is considered only above the measured range
# (16 MiB): every row above 2 MiB lies on the one fitted line, and nominal LL128 would undercut it by ~20%.
_HOST_NCCL_FIT = {
    **{
        k: replace(NCCL_PROTOCOLS[k], nvlink_step_us=1.579, bw_efficiency=0.629)
        for k in ("nccl_ring/LL", "nccl_tree/LL")
    },
    **{
        k: replace(NCCL_PROTOCOLS[k], nvlink_step_us=5.996, bw_efficiency=0.662, picked_above_bytes=NCCL_LL_UP_TO_BYTES)
        for k in ("nccl_ring/Simple", "nccl_tree/Simple")
    },
    **{
        k: replace(NCCL_PROTOCOLS[k], picked_above_bytes=16 * 1024 * 1024)
        for k in ("nccl_ring/LL128", "nccl_tree/LL128")
    },
}
# [fit] NVRAR (spanllm.comm.nvrar.kernel, LL8 cells) on 1 node x 2 GPUs, results/h200x2/allreduce_1x2_bf16.json
# (2026-11-30: up to 256 programs, phase-major launches in the grid), the 15 nvrar rows (8 `nvrar`, 7
# `auto->nvrar`) of H200X2_FIT_SIZES, each priced with the launch its `ran` column names: one-shot (1 NVLink
# exchange phase) up to 512 KiB, reduce-scatter (2 phases) above. rms error 3.3% over those rows.
#   base_us        3.130  per-call kernel cost beyond the 0.5 us graph node (sequence load, programs, ticket)
#   nvlink_step_us 0.765  per NVLink exchange phase (one-shot and reduce-scatter rows share no size here; the
#                         tuning sweep tuning_1x2_bf16.json shows rs - os 0.8-1.2 us at <= 128 KiB: the fit
#                         puts part of the second phase in the bandwidth term)
#   bw_efficiency  0.813  effective P2P store bandwidth 0.813 x 450 = 366 GB/s of LL8 wire bytes (2x payload)
# (The 2026-11-29 sweep, at most 64 programs, gave 3.654 / 0.353 / 0.594: more programs raised the bandwidth.)
# These are the kernel's own costs (KernelCost: call_us, phase_us, bw_efficiency), carried to every preset. The
# phase trace (results/h200x2/phases_{1x2,2x1}.json, the late rank, whose partner's cells are already there) agrees
# on the split: one phase's push 0.25-0.49 us + poll and add ~0.5 us up to 64 KiB, ~1 us per program per call.
# net_step_us is not measured on this host (no network): the kernel's phase + an IBGDA round (ll8_cost).
H200_KERNEL = KernelCost(call_us=3.130, phase_us=0.765, bw_efficiency=0.813)
_HOST_NVRAR_FIT = ll8_cost(_H200_NVLINK_LATENCY_US, _H200_NVLINK_LATENCY_US, H200_KERNEL, TRANSPORTS["ibgda"])

# Ranges of the [assumed] constants (ClusterSpec.ranges). Shared reasoning, stated once:
#   kernel.*        the H200 fit carried to another GPU: same kernel, other clocks and SM counts. call_us 2.5-4.5 on
#                   Hopper (the 2026-11-29 sweep, fewer programs, gave 3.65), up to 6.0 on A100 (1.41 vs 1.98 GHz
#                   boost: x1.4); phase_us 0.5-1.5; bw_efficiency 0.6-0.9 (0.59 at most 64 programs, 11-29 sweep)
#   graph_node_us   0.5 measured on H200 (0.86 for a torch elementwise op): 0.4-1.0
#   kernel_launch_us eager launch from Python, not measured: 3-10
#   hbm/gemm eff.   the H200 measurements carried to another part: +-0.1 around them, capped
#   nvlink_latency  H200 flag ping-pong 1.3 us carried: 1.0-2.0 (Hopper), 1.2-2.5 (A100 NVLink 3)
#   nic_latency_us  one-way small put through the fabric, transport costs apart: IB NDR 1.5-4.0 (not measured by us);
#                   Slingshot-11 2.0-4.5 (LCI #190: 6.44 us per put to completion, i.e. ~3.2 one way)
#   transport.*     post_us 0.5-2.5 (IBGDA) / 0.1-1.0 (proxied); proxy_us 1.5-8.0 (pplx-kernels: IBRC 2.8-4.2x
#                   IBGDA for 1-token dispatch; per-operation figure not published)
_KERNEL_RANGES_HOPPER = {
    "kernel.call_us": (2.5, 4.5),
    "kernel.phase_us": (0.5, 1.5),
    "kernel.bw_efficiency": (0.6, 0.9),
}
_KERNEL_RANGES_A100 = {"kernel.call_us": (2.5, 6.0), "kernel.phase_us": (0.5, 1.5), "kernel.bw_efficiency": (0.6, 0.9)}
_LAUNCH_RANGES = {"graph_node_us": (0.4, 1.0), "kernel_launch_us": (3.0, 10.0)}
# NCCL's latency constants are NCCL's tuner model, not measurements: on the H200 host the fitted NCCL step cost came
# out 2.6x the tuner's NVLink figure (0.6 -> 1.579 us, `_HOST_NCCL_FIT`). [assumed] the same factor bounds them
# elsewhere: each LL step between the tuner's figure and 2.6x it (network hops rounded up).
_NCCL_RANGES = {
    "algos.nccl_ring/LL.nvlink_step_us": (0.6, 1.6),
    "algos.nccl_tree/LL.nvlink_step_us": (0.6, 1.6),
    "algos.nccl_ring/LL.net_step_us": (2.7, 7.0),
    "algos.nccl_tree/LL.net_step_us": (5.0, 13.0),
}
# FP8 GEMMs against bf16 F.linear at the 8B's four layer shapes, their times summed, M = 256-8,192
# (results/h100/fp8/fp8_gemm.json; an H100's FP8 and bf16 tensor cores are an H200's): 1.50-1.68x as the engine runs
# them (activations quantized by the norm / SiLU kernel that produces them for qkv, gate_up and down; o by a pass of
# its own), 1.54-1.70x for torch._scaled_mm alone, 1.33-1.57x with a separate quantization pass before every GEMM.
# The larger M, the higher. (The team's earlier H200 notes, not in this repository, gave 1.6-1.8x for _scaled_mm.)
FP8_GEMM_SPEEDUP = 1.55  # [measured on H100] the engine's, the middle of M = 256-8,192
FP8_GEMM_SPEEDUP_RANGE = (1.5, 1.7)  # [measured on H100] the engine's, M = 256 ... 8,192
# Where the layer GEMMs are bound by their weight reads (decode), FP8 halves the bytes but its kernels stream them
# slower than the bf16 ones stream theirs: weight bytes / time of the four layer GEMMs summed, FP8 (the engine's
# dispatch) over bf16 at the same rows, on one H100 (results/h100/fp8/fp8_gemm.json, 8B; gemm70b/fp8_gemm.json, 70B
# at TP 2 and 8; results/h100/gemv/README.md, the one-row GEMVs of both):
#   W8A16, 1-16 rows: 0.79-0.85 (8B), 0.71-0.89 (70B TP 2), 0.64-0.75 (70B TP 8); the one-row GEMV 0.90 (8B)
#   W8A8, 32-256 rows: 0.66-0.73 (8B), 0.69-0.78 (70B TP 2), 0.46-0.55 (70B TP 8, whose thin qkv loses to bf16)
# so an FP8 decode GEMM is 1.6-1.8x faster than bf16's at a few rows and 1.3-1.5x at 32-256, not 2x.
FP8_READ_W8A16 = 0.82  # [measured on H100] the middle of the 8B's and 70B TP 2's 1-16 rows
FP8_READ_W8A16_RANGE = (0.64, 0.90)  # [measured on H100] every shape above, 1-16 rows
FP8_READ_W8A8 = 0.70  # [measured on H100] the middle of the 8B's and 70B TP 2's 32-256 rows
FP8_READ_W8A8_RANGE = (0.46, 0.78)  # [measured on H100] every shape above, 32-256 rows
_FP8_RANGES = {
    "fp8_gemm_speedup": FP8_GEMM_SPEEDUP_RANGE,
    "fp8_read_w8a16": FP8_READ_W8A16_RANGE,
    "fp8_read_w8a8": FP8_READ_W8A8_RANGE,
}
_DGX_RANGES = {
    **_FP8_RANGES,
    **_KERNEL_RANGES_HOPPER,
    **_LAUNCH_RANGES,
    **_NCCL_RANGES,
    "nvlink_latency_us": (1.0, 2.0),
    "nic_latency_us": (1.5, 4.0),
    "transport.post_us": (0.5, 2.5),
}
# GPU memory in 1e9 bytes, what the engine and the model count in (spanllm.perf.inference.MEMORY_USABLE_FRACTION
# of it is usable, as the engine's default --gpu-memory-utilization). A datasheet's "141GB" or "80GB" is GiB, less
# what the driver keeps: torch reports 139.8 GiB on the H200s (the engine's log lines in results/h200/engine_speed/)
# and 79.18 GiB on the H100s (the out-of-memory messages in results/h100/); a part not measured takes its
# datasheet's size in GiB less the same 1% [assumed].
GIB = 2**30 / 1e9
H200_MEMORY_GB = 139.8 * GIB  # [measured] 150.1
H100_MEMORY_GB = 79.18 * GIB  # [measured] 85.0
GIB_NOMINAL_GB = GIB * 0.99  # [assumed] the H100's 79.18 of 80 and the H200's 139.8 of 141 keep 0.99
# The H200 presets' large-GEMM rate, 790 TFLOP/s bf16 on random data, is an early microbenchmark on the H200 host
# whose run is not committed. The committed figures are lower: ~750 TFLOP/s for the engine's GEMMs in an 8,192-token
# prefill (results/h200/engine_speed/, StepCost.gemm_efficiency) and 696 for F.linear at the 8B's four layer shapes
# at M = 8,192 on an H100 (results/h100/fp8/fp8_gemm.json): DGX H200's range covers 700-790.
_IB_NDR_LATENCY_US = 2.5  # [assumed] one-way small GPU-to-GPU RDMA write over NDR, one switch tier, transport apart

# [fit] The spanllm engine of 2026-11 on this host (bf16, CUDA-graph decode): the static-batch engine, since replaced
# by the one continuous-batching engine, whose own costs the serving planner prices (spanllm.perf.step_cost: `plan
# --serve`). Its studies' rows (results/h200x2/) are what `perf validate` scores, so the fit stays as they measured
# it; today's engine decodes the 8B at batch 1 faster (4.47 ms on one H200, results/h200/engine_speed/, where this
# fit prices 6.2 ms at TP 1). `spanllm perf calibrate --engine`: least
# squares (relative) over the TPOT and TTFT of the 6 rows H200X2_ENGINE_FIT names (8B, TP=2, NCCL, batch
# 1 / 8 / 64, prompt 128 / decode 512 and prompt 2048 / decode 32), all-reduce constants from the sweeps.
# rms error over those rows: TPOT 3.6%, TTFT 15.6% (refitted with the 2026-11-30 all-reduce constants).
# Held out (scored by `perf validate`): every other row.
#   decode_layer_us     69.85  per layer and decode step on top of its 12 graph nodes (6 us): norms, RoPE,
#                              KV write, SDPA, SiLU, residual adds -- a few us each even inside a graph.
#                              (A two-equation estimate from the held-out 70B TP=2 vs PP=2 TPOT gave ~70-74 us
#                              in all; not used.)
#   attn_position_ns    20.47  decode SDPA per cache position and layer: with few (batch x KV heads) thread
#                              blocks each block scans its positions serially (8B TP=2: +1.0 ms TPOT at
#                              batch 1 and 8 for 1440 more positions, 640 -> 2080)
#   eager_layer_host_us 1213   eager prefill, host time per layer: short prompts (batch 1 / 8 x 128 tokens)
#                              take 33-53 ms for 32 layers whatever their FLOPs (noisy: iters=1)
#   prefill_efficiency  0.432  eager prefill, achieved / peak over GEMM + attention FLOPs (428 TFLOP/s; the
#                              GEMM microbenchmark's 790 is not reached by the engine's TP-split shapes)
# [code] attends_max_seq_len: inside a CUDA graph that engine's decode attended over max_seq_len = prompt + decode
# under a mask (its model runner; bench batch set max_seq_len = prompt + decode).
# HBM efficiency stays the measured copy figure (4.3 TB/s); the fit does not touch it.
# [fit] prefill_size_exponent 0.175: the TTFT of the 8 Llama 3.1 70B TP=2 NCCL rows of the two 70B studies
# (H200X2_PREFILL_SIZE_FIT; engine_fit.fit_prefill_size_exponent, rms relative error), the reference size the 8B
# TP=2 fit's layer (218.1 M parameters / 2). The 8B fit alone priced every larger GEMM at 428 TFLOP/s and
# overpredicted the 70B TTFT by 22-38% (and 8B at TP=1, i.e. PP=2, by 16-21%): 70B at TP=2 runs its prefill
# at ~1.27x the 8B's efficiency, at TP=1 ~1.40x (the GEMM microbenchmark's 790 TFLOP/s is the ceiling).
_HOST_ENGINE_FIT = EngineCost(
    decode_layer_us=69.85,
    attn_position_ns=20.47,
    attends_max_seq_len=True,
    eager_layer_host_us=1213.3,
    prefill_efficiency=0.4323,
    prefill_ref_layer_params=218_103_808 / 2,
    prefill_size_exponent=0.175,
)

PRESETS: dict[str, ClusterSpec] = {
    "h200x2": ClusterSpec(
        name="h200x2",
        description="the lab's 2 x H200 host (NVLink NV18, no NIC; nodes are virtual; engine costs: the 2026-11 "
        "static-batch engine's fit, slower than today's engine at batch 1)",
        gpu="H200 141GB",
        gpus_per_node=2,
        gpu_memory_GB=H200_MEMORY_GB,  # [measured] H200_MEMORY_GB (above)
        hbm_GBps=4800.0,  # [datasheet] H200 HBM3e 4.8 TB/s
        hbm_efficiency=4300.0 / 4800.0,  # [measured] ~4.3 TB/s device-to-device copy
        bf16_TFLOPs=989.0,  # [datasheet] H100/H200 SXM dense bf16
        gemm_efficiency=790.0 / 989.0,  # [measured, not committed] H200_GEMM_TFLOPS (above)
        nvlink_GBps=450.0,  # [datasheet] NVLink 4, 18 links x 25 GB/s per direction
        nvlink_latency_us=_H200_NVLINK_LATENCY_US,
        nic_GBps_per_gpu=0.0,  # [measured] no network card on this host (only rdma_cm)
        nic_latency_us=_H200_NVLINK_LATENCY_US,  # unused: virtual nodes talk over NVLink
        graph_node_us=0.5,  # [measured] empty Triton kernel as a CUDA-graph node (NOTES_nvrar.md; probe not committed)
        fp8_gemm_speedup=FP8_GEMM_SPEEDUP,  # [measured on H100] FP8_GEMM_SPEEDUP (above)
        fp8_read_w8a16=FP8_READ_W8A16,  # [measured on H100] FP8_READ_W8A16 (above)
        fp8_read_w8a8=FP8_READ_W8A8,  # [measured on H100] FP8_READ_W8A8 (above)
        kernel_launch_us=5.0,  # [assumed] eager launch from Python; not measured yet
        algos={
            **default_algo_costs(_H200_NVLINK_LATENCY_US, _H200_NVLINK_LATENCY_US, H200_KERNEL),
            **_HOST_NCCL_FIT,
            "nvrar": _HOST_NVRAR_FIT,
        },
        engine=_HOST_ENGINE_FIT,
        kernel=H200_KERNEL,  # [fit] this host's sweep (above)
        ranges={"kernel_launch_us": (3.0, 10.0), **_FP8_RANGES},
    ),
    "dgx-h100": ClusterSpec(
        name="dgx-h100",
        description="DGX H100: 8 x H100 80GB over NVLink 4 / NVSwitch, 8 x 400 Gb/s NDR",
        gpu="H100 80GB",
        gpus_per_node=8,
        gpu_memory_GB=H100_MEMORY_GB,  # [measured] H100_MEMORY_GB (above)
        hbm_GBps=3350.0,  # [datasheet] H100 SXM HBM3 3.35 TB/s
        hbm_efficiency=0.9,  # [assumed] same copy efficiency as measured on H200 (4.3 / 4.8)
        bf16_TFLOPs=989.0,  # [datasheet]
        gemm_efficiency=0.8,  # [assumed] as measured on H200 (790 / 989)
        nvlink_GBps=450.0,  # [datasheet] 900 GB/s bidirectional per GPU
        nvlink_latency_us=1.3,  # [assumed] as measured on the H200 host (same NVLink generation)
        nic_GBps_per_gpu=50.0,  # [datasheet] one ConnectX-7 400 Gb/s NDR per GPU
        nic_latency_us=_IB_NDR_LATENCY_US,  # [assumed] range below
        graph_node_us=0.5,  # [assumed] as measured on H200
        fp8_gemm_speedup=FP8_GEMM_SPEEDUP,  # [measured on H100] same FP8 tensor cores
        fp8_read_w8a16=FP8_READ_W8A16,  # [measured on H100] FP8_READ_W8A16 (above)
        fp8_read_w8a8=FP8_READ_W8A8,  # [measured on H100] FP8_READ_W8A8 (above)
        kernel_launch_us=5.0,  # [assumed]
        algos=default_algo_costs(1.3, _IB_NDR_LATENCY_US, H200_KERNEL, TRANSPORTS["ibgda"]),
        transport=TRANSPORTS["ibgda"],  # [assumed] IBGDA enabled (NVSHMEM_IB_ENABLE_IBGDA=1); NVSHMEM's default is ibrc
        kernel=H200_KERNEL,  # [measured on H200] carried: same kernel on Hopper
        ranges={**_DGX_RANGES, "hbm_efficiency": (0.8, 0.92), "gemm_efficiency": (0.65, 0.85)},
    ),
    "dgx-h200": ClusterSpec(
        name="dgx-h200",
        description="DGX H200: 8 x H200 141GB over NVLink 4 / NVSwitch, 8 x 400 Gb/s NDR",
        gpu="H200 141GB",
        gpus_per_node=8,
        gpu_memory_GB=H200_MEMORY_GB,  # [measured] on the H200 host
        hbm_GBps=4800.0,  # [datasheet]
        hbm_efficiency=4300.0 / 4800.0,  # [measured] on the H200 host
        bf16_TFLOPs=989.0,  # [datasheet]
        gemm_efficiency=790.0 / 989.0,  # [measured, not committed] H200_GEMM_TFLOPS (above)
        nvlink_GBps=450.0,  # [datasheet]
        nvlink_latency_us=1.3,  # [measured] on the H200 host
        nic_GBps_per_gpu=50.0,  # [datasheet] 8 x 400 Gb/s NDR, one per GPU
        nic_latency_us=_IB_NDR_LATENCY_US,  # [assumed] as DGX H100
        graph_node_us=0.5,  # [measured] on the H200 host
        fp8_gemm_speedup=FP8_GEMM_SPEEDUP,  # [measured on H100] FP8_GEMM_SPEEDUP (above)
        fp8_read_w8a16=FP8_READ_W8A16,  # [measured on H100] FP8_READ_W8A16 (above)
        fp8_read_w8a8=FP8_READ_W8A8,  # [measured on H100] FP8_READ_W8A8 (above)
        kernel_launch_us=5.0,  # [assumed]
        algos=default_algo_costs(1.3, _IB_NDR_LATENCY_US, H200_KERNEL, TRANSPORTS["ibgda"]),
        transport=TRANSPORTS["ibgda"],  # [assumed] as DGX H100
        kernel=H200_KERNEL,  # [measured] on the H200 host
        ranges={
            **{k: v for k, v in _DGX_RANGES.items() if k not in ("graph_node_us", "nvlink_latency_us")},
            "gemm_efficiency": (700.0 / 989.0, 790.0 / 989.0),
        },
    ),
    "perlmutter": ClusterSpec(
        name="perlmutter",
        description="NERSC Perlmutter GPU node: 4 x A100 40GB over NVLink 3, 4 x Slingshot-11",
        gpu="A100 40GB",
        gpus_per_node=4,
        gpu_memory_GB=40 * GIB_NOMINAL_GB,  # [datasheet] A100 SXM4 40GB, in GiB (the NVRAR artifact names this part)
        hbm_GBps=1555.0,  # [datasheet] A100 40GB HBM2
        hbm_efficiency=0.85,  # [assumed] typical achieved copy bandwidth on A100
        bf16_TFLOPs=312.0,  # [datasheet] A100 dense bf16
        gemm_efficiency=0.75,  # [assumed] typical large-GEMM efficiency on A100
        nvlink_GBps=300.0,  # [datasheet] NVLink 3, 600 GB/s bidirectional per GPU
        nvlink_latency_us=1.5,  # [assumed] a little above Hopper's measured 1.3 us
        nic_GBps_per_gpu=25.0,  # [datasheet] 4 x Slingshot-11 (Cassini) 200 Gb/s per node, one per GPU
        nic_latency_us=3.2,  # [source] LCI #190 (uiuc-hpc/lci PR 190): 6.44 us per put to completion on Slingshot-11
        #                      (libfabric 2.6 cxi, 4-192 B, CPU-initiated): half of it one way; the proxy is apart
        graph_node_us=0.6,  # [assumed] slightly above the H200 measurement
        kernel_launch_us=5.0,  # [assumed]
        algos=default_algo_costs(1.5, 3.2, H200_KERNEL, TRANSPORTS["libfabric"]),
        transport=TRANSPORTS[
            "libfabric"
        ],  # [source] NVSHMEM on Slingshot: libfabric cxi through the CPU proxy, no IBGDA
        kernel=H200_KERNEL,  # [measured on H200] carried; A100 ranges below
        ranges={
            **_KERNEL_RANGES_A100,
            **_LAUNCH_RANGES,
            **_NCCL_RANGES,
            "graph_node_us": (0.4, 1.2),
            "hbm_efficiency": (0.75, 0.92),
            "gemm_efficiency": (0.6, 0.85),
            "nvlink_latency_us": (1.2, 2.5),
            "nic_latency_us": (2.0, 4.5),
            "transport.post_us": (0.1, 1.0),
            "transport.proxy_us": (1.5, 8.0),
            # [assumed] NCCL's network hwLat is its InfiniBand figure; on Slingshot through aws-ofi-nccl
            # (libfabric cxi, NCCL's own CPU proxy) a hop may pay a proxy hand-off and the cxi latency more
            "algos.nccl_ring/LL.net_step_us": (2.7, 10.0),
            "algos.nccl_tree/LL.net_step_us": (5.0, 15.0),
            "algos.nccl_tree/LL128.net_step_us": (8.5, 20.0),
        },
    ),
    "vista": ClusterSpec(
        name="vista",
        description="TACC Vista GH200 node: 1 x GH200 96GB per node, InfiniBand NDR 400 Gb/s",
        gpu="GH200 96GB",
        gpus_per_node=1,
        gpu_memory_GB=96 * GIB_NOMINAL_GB,  # [datasheet] GH200 HBM3 96 GB, in GiB
        hbm_GBps=4000.0,  # [datasheet] GH200 96GB HBM3 4 TB/s
        hbm_efficiency=0.9,  # [assumed] as measured on H200
        bf16_TFLOPs=989.0,  # [datasheet] Hopper dense bf16
        gemm_efficiency=0.8,  # [assumed] as measured on H200
        nvlink_GBps=0.0,  # one GPU per node: no intra-node link
        nvlink_latency_us=1.3,  # unused with one GPU per node
        nic_GBps_per_gpu=50.0,  # [datasheet] one NDR 400 Gb/s port per node
        nic_latency_us=_IB_NDR_LATENCY_US,  # [assumed] one switch tier, transport apart
        graph_node_us=0.5,  # [assumed] as measured on H200
        fp8_gemm_speedup=FP8_GEMM_SPEEDUP,  # [measured on H100] same FP8 tensor cores
        fp8_read_w8a16=FP8_READ_W8A16,  # [measured on H100] FP8_READ_W8A16 (above)
        fp8_read_w8a8=FP8_READ_W8A8,  # [measured on H100] FP8_READ_W8A8 (above)
        kernel_launch_us=5.0,  # [assumed]
        algos=default_algo_costs(1.3, _IB_NDR_LATENCY_US, H200_KERNEL, TRANSPORTS["ibrc"]),
        transport=TRANSPORTS["ibrc"],  # [source] NVSHMEM_REMOTE_TRANSPORT's default; which one the paper ran: unknown
        kernel=H200_KERNEL,  # [measured on H200] carried: same kernel on GH200
        ranges={
            **_FP8_RANGES,  # [measured on H100] same FP8 tensor cores
            **_KERNEL_RANGES_HOPPER,
            **_LAUNCH_RANGES,
            **_NCCL_RANGES,
            "hbm_efficiency": (0.8, 0.92),
            "gemm_efficiency": (0.65, 0.85),
            "nic_latency_us": (1.5, 4.0),
            "transport.post_us": (0.1, 1.0),
            "transport.proxy_us": (1.5, 8.0),
        },
    ),
}

PRESET_FITS: dict[str, PresetFit] = {"h200x2": H200X2_FIT}
"""Preset name -> the measurements its [fit] constants came from (`perf validate` leaves those rows out)."""
ENGINE_FITS: dict[str, EngineFitRows] = {"h200x2": H200X2_ENGINE_FIT}
# The rows EngineCost.prefill_size_exponent was fitted to (their TTFT only), per preset: scored as engine-fit too.
H200X2_PREFILL_SIZE_FIT = EngineFitRows(
    files=(
        "results/h200x2/study_llama3.1-70b_decode-heavy.json",
        "results/h200x2/study_llama3.1-70b_prefill-heavy.json",
    ),
    model="llama3.1-70b",
    tp=2,
    pp=1,
    allreduce_ran="nccl",
)
PREFILL_SIZE_FITS: dict[str, EngineFitRows] = {"h200x2": H200X2_PREFILL_SIZE_FIT}
"""Preset name -> the engine rows its EngineCost was fitted to (`perf validate` scores them as fitted-on)."""


# ---------------------------------------------------------------------------------------------------
# Files.


def cluster_to_dict(spec: ClusterSpec) -> dict[str, Any]:
    d = asdict(spec)
    d["algos"] = {k: asdict(v) for k, v in spec.algos.items()}
    d["ranges"] = {k: list(v) for k, v in spec.ranges.items()}
    return d


def _transport_from(value: Any, base: Mapping[str, Any] | None, source: str) -> Transport:
    """A transport from a name ('ibrc'), a dict naming one ({'name': 'ibrc', 'proxy_us': 2.0}), or the base's."""
    try:
        if isinstance(value, Transport):
            return value
        if isinstance(value, str):
            return get_transport(value)
        if isinstance(value, Mapping):
            name = value.get("name") or (base or {}).get("name") or "ibgda"
            start = asdict(get_transport(name)) if "name" in value or not base else dict(base)
            return Transport(**{**start, **value})
        if value is None and base is not None:
            return Transport(**base)
        return TRANSPORTS["ibgda"]
    except (TypeError, TransportError) as e:
        raise ClusterSpecError(f"{source}: transport: {e}") from None


# FP8 constants a cluster file may leave out: 1.0 (no FP8 tensor cores; FP8 weights stream as fast as bf16's)
_OPTIONAL_FP8 = ("fp8_gemm_speedup", "fp8_read_w8a16", "fp8_read_w8a8")


def cluster_from_dict(d: Mapping[str, Any], source: str = "<dict>") -> ClusterSpec:
    """A ClusterSpec from plain values. `base` names a preset whose values fill the fields left out."""
    d = dict(d)
    base_name = d.pop("base", None)
    base: dict[str, Any] = {}
    if base_name is not None:
        if base_name not in PRESETS:
            raise ClusterSpecError(f"{source}: base={base_name!r} is not a preset; presets: {', '.join(PRESETS)}")
        base = cluster_to_dict(PRESETS[base_name])
    known = {f.name for f in fields(ClusterSpec)}
    unknown = sorted(set(d) - known)
    if unknown:
        raise ClusterSpecError(f"{source}: unknown field(s) {unknown}; known fields: {sorted(known)}")
    merged = {**base, **d}
    missing = sorted(known - set(merged) - {"algos", "engine", "transport", "kernel", "ranges", *_OPTIONAL_FP8})
    if missing:
        raise ClusterSpecError(f"{source}: missing field(s) {missing}; give them or set base = one of {list(PRESETS)}")
    merged["transport"] = _transport_from(d.get("transport"), base.get("transport"), source)
    try:  # kernel and engine costs: the base preset's, with the fields the file gives replaced
        merged["kernel"] = KernelCost(**{**base.get("kernel", {}), **d.get("kernel", {})})
        merged["engine"] = EngineCost(**{**base.get("engine", {}), **d.get("engine", {})})
    except TypeError as e:
        raise ClusterSpecError(f"{source}: kernel / engine: {e}") from None
    defaults = default_algo_costs(
        float(merged["nvlink_latency_us"]), float(merged["nic_latency_us"]), merged["kernel"], merged["transport"]
    )
    # from the base preset keep only entries that are not its defaults (fitted ones), so that a file
    # changing a latency, the kernel or the transport also moves the defaults built from them
    algos_in = {}
    if base_name is not None:
        spec = PRESETS[base_name]
        base_defaults = spec_defaults(spec)
        algos_in = {k: asdict(v) for k, v in spec.algos.items() if base_defaults.get(k) != v}
    algos_in.update(d.get("algos", {}))
    algos: dict[str, AlgoCost] = {}
    for key in set(defaults) | set(algos_in):
        if key in algos_in:
            start = asdict(defaults[key]) if key in defaults else {}
            try:
                algos[key] = AlgoCost(**{**start, **algos_in[key]})
            except TypeError as e:
                raise ClusterSpecError(f"{source}: algos[{key!r}]: {e}") from None
        else:
            algos[key] = defaults[key]
    merged["algos"] = algos

    # a constant the file sets is no longer the preset's guess: the base's range for it goes (unless the file
    # gives one); a null range removes the base's
    def set_by_file(path: str) -> bool:
        parts = path.split(".")
        if parts[0] == "transport":
            return "transport" in d
        if parts[0] in ("kernel", "engine"):
            return parts[1] in d.get(parts[0], {})
        if parts[0] == "algos":
            return parts[2] in d.get("algos", {}).get(parts[1], {})
        return parts[0] in d

    ranges = {**{k: v for k, v in base.get("ranges", {}).items() if not set_by_file(k)}, **d.get("ranges", {})}
    try:
        merged["ranges"] = {k: (float(v[0]), float(v[1])) for k, v in ranges.items() if v is not None}
    except (TypeError, ValueError, IndexError):
        raise ClusterSpecError(f"{source}: ranges must map a constant's path to [low, high]") from None
    return ClusterSpec(**merged)


def load_cluster(name_or_path: str | Path) -> ClusterSpec:
    """A preset by name, or a cluster file (.json or .toml) with ClusterSpec's field names."""
    s = str(name_or_path)
    if s in PRESETS:
        return PRESETS[s]
    path = Path(s)
    if not path.suffix:
        raise ClusterSpecError(
            f"unknown cluster {s!r}: presets are {', '.join(PRESETS)}; "
            "or pass a .json / .toml file with ClusterSpec's fields"
        )
    if not path.is_file():
        raise ClusterSpecError(f"cluster file {s!r} does not exist")
    text = path.read_text()
    try:
        if path.suffix == ".json":
            data = json.loads(text)
        elif path.suffix == ".toml":
            data = tomllib.loads(text)
        else:
            raise ClusterSpecError(f"cluster file {s!r}: suffix {path.suffix!r} not understood; use .json or .toml")
    except (json.JSONDecodeError, tomllib.TOMLDecodeError) as e:
        raise ClusterSpecError(f"cluster file {s!r} is not valid {path.suffix[1:].upper()}: {e}") from None
    if not isinstance(data, dict):
        raise ClusterSpecError(
            f"cluster file {s!r} holds a {type(data).__name__}; it must be one object of ClusterSpec's fields"
        )
    return cluster_from_dict(data, source=s)


def save_cluster(spec: ClusterSpec, path: str | Path, flag: str = "--out") -> None:
    from spanllm.output_files import write_json

    write_json(flag, path, cluster_to_dict(spec), indent=2)
