"""Inference time model: prefill and decode of a Llama-family model under TP x PP on a cluster.

Per layer on one GPU (tensor parallel degree tp, `tokens` rows in flight):
  GEMMs       max(FLOPs / (peak x eff), (weights + activations) bytes / (HBM x hbm_eff))
              FLOPs = 2 * tokens * layer_params / tp                         (roofline)
              weights in bf16 or FP8 (spanllm.perf.quantization); FP8 above 16 rows: peak x fp8_gemm_speedup
              eff = gemm_efficiency; eager prefill: EngineCost.prefill_efficiency when set, scaled by the
              layer's parameters per GPU (EngineCost.prefill_size_exponent: larger GEMMs run nearer peak)
  attention   decode: KV-cache bytes read / (HBM x hbm_eff), batch x positions x 2 x kv_heads/tp x head_dim x 2 B,
              + positions x EngineCost.attn_position_ns (serial key scan); positions = the mean context
              prompt + decode_len / 2, or prompt + decode_len where the engine scans the whole cache
              prefill: 2 * batch * prompt^2 * hidden / tp FLOPs (causal half of QK^T and PV)
  all-reduce  2 per layer (after attention-out and after MLP-down), tokens x hidden x 2 bytes each
  fixed       decode in a CUDA graph: kernels_per_layer x graph_node_us + EngineCost.decode_layer_us,
              serial with the work (each small kernel costs its launch and a few us of its own)
  host        eager: issuing a layer takes EngineCost.eager_layer_host_us (else kernels x
              kernel_launch_us); the host runs ahead of its GPU, so it costs only what the GPU hides not
Pipeline (pp stages of ceil(layers / pp) layers, m micro-batches of batch / m):
  TTFT  stage s finishes micro-batch j at max(input arrived and micro-batch j - 1 done + its GPU
        time, (j + 1) x its host time): without host limits the GPipe fill, sum of stage times
        + transfers + (m - 1) x slowest stage; every stage's host issues its layers in parallel
  TPOT  = max(m x slowest stage, sum of stage times + transfers + the sampled tokens' return)  (a token
          needs the whole pipe before its next step; m micro-batches keep every stage busy)
  E2E   = TTFT + (decode_len - 1) x TPOT
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from spanllm.model.config import ModelConfig
from spanllm.perf.allreduce_model import allreduce_cost, transfer_us
from spanllm.perf.hardware import ClusterSpec
from spanllm.perf.model_shape import DTYPE_BYTES, embedding_params, kv_bytes_per_token_layer, layer_params
from spanllm.perf.quantization import BF16, Quantization, gemm_speedup, weight_read_factor

KERNELS_PER_LAYER = 12  # [assumed] 2 norms, qkv, rope, attention, o-proj, 2 residual adds, gate_up, act, down, + comm
P2P_OVERHEAD_US = 10.0  # [assumed] one pipeline send/recv pair through torch.distributed, beyond the wire time
MEMORY_USABLE_FRACTION = 0.9  # [assumed] the rest: CUDA context, communication buffers, allocator slack


class InferenceModelError(ValueError):
    """A layout or workload the model cannot price."""


@dataclass(frozen=True)
class Layout:
    tp: int
    pp: int = 1
    micro_batches: int = 1
    tp_ranks_per_node: int | None = None  # None: as many of the TP group per node as fit (whole nodes)

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "micro_batches"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise InferenceModelError(f"Layout.{name}={v!r} must be an integer >= 1")

    @property
    def gpus(self) -> int:
        return self.tp * self.pp

    def __str__(self) -> str:
        s = f"TP{self.tp}" + (f" x PP{self.pp}" if self.pp > 1 else "")
        return s + (f" (m={self.micro_batches})" if self.micro_batches > 1 else "")


@dataclass(frozen=True)
class Workload:
    batch: int
    prompt_len: int
    decode_len: int

    def __post_init__(self) -> None:
        for name in ("batch", "prompt_len", "decode_len"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise InferenceModelError(f"Workload.{name}={v!r} must be an integer >= 1")


@dataclass(frozen=True)
class Memory:
    weights_GB: float
    kv_cache_GB: float
    activations_GB: float
    capacity_GB: float  # usable per GPU

    @property
    def total_GB(self) -> float:
        return self.weights_GB + self.kv_cache_GB + self.activations_GB

    @property
    def fits(self) -> bool:
        return self.total_GB <= self.capacity_GB


@dataclass(frozen=True)
class Estimate:
    ttft_ms: float
    tpot_ms: float
    e2e_ms: float
    throughput_tok_s: float
    prefill_ms: dict[str, float] = field(default_factory=dict)  # critical path of TTFT, by component
    decode_ms: dict[str, float] = field(default_factory=dict)  # critical path of one decode step
    decode_idle_fraction: float = 0.0  # pipeline bubble: share of a decode step a stage waits
    allreduce_variant: str = ""  # what the decode all-reduce resolves to (e.g. 'nccl_tree/LL')
    memory: Memory | None = None


# --- small pure pieces --------------------------------------------------------------------------------


def gemm_time_us(
    flops: float, nbytes: float, cluster: ClusterSpec, efficiency: float | None = None, speedup: float = 1.0
) -> float:
    """Roofline: compute-bound or HBM-bound, whichever is slower (1 TFLOP/s = 1e6 FLOP per us).
    `efficiency`: achieved / peak bf16 FLOP/s (default: the cluster's gemm_efficiency); `speedup`: the GEMM's
    rate over bf16's (FP8 tensor cores: ClusterSpec.fp8_gemm_speedup)."""
    return max(
        flops / (cluster.bf16_TFLOPs * 1e6 * (efficiency or cluster.gemm_efficiency) * speedup),
        nbytes / (cluster.hbm_GBps * 1e3 * cluster.hbm_efficiency),
    )


def prefill_efficiency(cluster: ClusterSpec, layer_params_per_gpu: float | None = None) -> float:
    """Achieved / peak FLOP/s of eager prefill: the engine's fitted figure (scaled with the GEMM size per GPU
    where the engine's cost says how: EngineCost.prefill_size_exponent), else the GEMM microbenchmark's."""
    e = cluster.engine
    if not e.prefill_efficiency:
        return cluster.gemm_efficiency
    if layer_params_per_gpu and e.prefill_size_exponent and e.prefill_ref_layer_params:
        return min(
            1.0, e.prefill_efficiency * (layer_params_per_gpu / e.prefill_ref_layer_params) ** e.prefill_size_exponent
        )
    return e.prefill_efficiency


def eager_layer_host_us(cluster: ClusterSpec) -> float:
    """Host time to issue one layer eagerly: the engine's fitted figure, else kernels x launch cost."""
    return cluster.engine.eager_layer_host_us or KERNELS_PER_LAYER * cluster.kernel_launch_us


def decode_positions(workload: Workload, cluster: ClusterSpec) -> float:
    """Cache positions a decode step's attention reads, averaged over the decode: the mean context, or
    max_seq_len = prompt + decode where the engine scans the whole cache under a mask (CUDA graphs)."""
    if cluster.engine.attends_max_seq_len:
        return float(workload.prompt_len + workload.decode_len)
    return workload.prompt_len + workload.decode_len / 2


def hbm_read_us(nbytes: float, cluster: ClusterSpec) -> float:
    return nbytes / (cluster.hbm_GBps * 1e3 * cluster.hbm_efficiency)


def kv_heads_per_gpu(model: ModelConfig, tp: int) -> int:
    """KV heads split over TP ranks; replicated (one per GPU) once tp exceeds kv_heads."""
    return max(1, model.num_kv_heads // tp)


def layer_gemm_us(
    model: ModelConfig,
    tokens: int,
    tp: int,
    cluster: ClusterSpec,
    efficiency: float | None = None,
    quant: Quantization = BF16,
) -> float:
    h, f, d = model.hidden_size, model.intermediate_size, DTYPE_BYTES
    kvd = kv_heads_per_gpu(model, tp) * model.head_dim
    # FP8 weights take fewer bytes but stream slower than bf16's (ClusterSpec.fp8_read_*): priced as more bytes
    read = weight_read_factor(quant, tokens, cluster.fp8_read_w8a16, cluster.fp8_read_w8a8)
    weights = quant.layer_weight_bytes(model) / tp / read
    # inputs + outputs of qkv, o, gate_up, down on this GPU
    acts = tokens * d * (h + (h / tp + 2 * kvd) + h / tp + h + h + 2 * f / tp + f / tp + h)
    speedup = gemm_speedup(quant, tokens, cluster.fp8_gemm_speedup)
    return gemm_time_us(2 * tokens * layer_params(model) / tp, weights + acts, cluster, efficiency, speedup)


def _kv_bytes(model: ModelConfig, tp: int, quant: Quantization) -> float:
    """K and V of one token in one layer on one GPU, in the KV cache's element type (quant.kv_element_bytes)."""
    return kv_bytes_per_token_layer(model, kv_heads_per_gpu(model, tp)) * quant.kv_element_bytes / DTYPE_BYTES


def decode_attention_us(
    model: ModelConfig, batch: int, positions: float, tp: int, cluster: ClusterSpec, quant: Quantization = BF16
) -> float:
    """One layer: the K and V of `positions` cache positions per sequence read at HBM speed, plus the
    engine's serial scan cost per position (one thread block walks its head's positions in order)."""
    kv = hbm_read_us(batch * positions * _kv_bytes(model, tp, quant), cluster)
    return kv + positions * cluster.engine.attn_position_ns / 1e3


def prefill_attention_us(
    model: ModelConfig,
    batch: int,
    prompt: int,
    tp: int,
    cluster: ClusterSpec,
    efficiency: float | None = None,
    quant: Quantization = BF16,
) -> float:
    flops = 2 * batch * prompt * prompt * model.hidden_size / tp
    kv_write = batch * prompt * _kv_bytes(model, tp, quant)
    return gemm_time_us(flops, kv_write, cluster, efficiency)


def lm_head_us(model: ModelConfig, rows: int, tp: int, cluster: ClusterSpec) -> float:
    """Vocab-parallel output projection for `rows` positions (the last token of each sequence)."""
    params = embedding_params(model) / tp
    return gemm_time_us(2 * rows * params, params * DTYPE_BYTES, cluster)


def tp_group_shape(layout: Layout, cluster: ClusterSpec) -> tuple[int, int]:
    """(nodes, ranks per node) of one TP group, node-major placement."""
    g = cluster.gpus_per_node
    if layout.tp_ranks_per_node is not None:
        rpn = layout.tp_ranks_per_node
        if layout.tp % rpn:
            raise InferenceModelError(f"tp={layout.tp} is not divisible by tp_ranks_per_node={rpn}")
        return layout.tp // rpn, rpn
    if layout.tp <= g:
        if g % layout.tp:
            raise InferenceModelError(f"tp={layout.tp} does not divide the {g} GPUs of a node; pick a divisor of {g}")
        return 1, layout.tp
    if layout.tp % g:
        raise InferenceModelError(f"tp={layout.tp} spans nodes but is not a multiple of {g} GPUs per node")
    return layout.tp // g, g


def stage_boundary_over_network(s: int, layout: Layout, cluster: ClusterSpec) -> bool:
    """Whether the boundary after stage s crosses hosts (stage s holds GPUs [s*tp, (s+1)*tp))."""
    return (s + 1) * layout.tp % cluster.gpus_per_node == 0


def stage_boundaries_over_network(layout: Layout, cluster: ClusterSpec) -> int:
    """How many of the pp - 1 stage boundaries cross hosts."""
    return sum(stage_boundary_over_network(s, layout, cluster) for s in range(layout.pp - 1))


def pp_transfer_us(nbytes: float, over_network: bool, cluster: ClusterSpec) -> float:
    if over_network:
        return P2P_OVERHEAD_US + cluster.nic_latency_us + transfer_us(nbytes, cluster.nic_GBps_per_gpu)
    return P2P_OVERHEAD_US + cluster.nvlink_latency_us + transfer_us(nbytes, cluster.nvlink_GBps)


def memory_per_gpu(
    model: ModelConfig, layout: Layout, workload: Workload, cluster: ClusterSpec, quant: Quantization = BF16
) -> Memory:
    """Worst stage: its layers' weight shards + embedding or LM head shard + KV cache (quant.kv_element_bytes an
    element) + one layer's activations (bf16)."""
    layers = math.ceil(model.num_layers / layout.pp)
    emb = quant.head_weight_bytes(model) / layout.tp * (2 if layout.pp == 1 else 1)
    weights = layers * quant.layer_weight_bytes(model) / layout.tp + emb
    kv = workload.batch * (workload.prompt_len + workload.decode_len) * layers * _kv_bytes(model, layout.tp, quant)
    rows = workload.batch // layout.micro_batches * workload.prompt_len
    acts = rows * DTYPE_BYTES * (4 * model.hidden_size + 3 * model.intermediate_size / layout.tp)
    return Memory(weights / 1e9, kv / 1e9, acts / 1e9, cluster.gpu_memory_GB * MEMORY_USABLE_FRACTION)


# --- the estimate -------------------------------------------------------------------------------------


def _layer_ms(
    model, cluster, layout, rows, attention_us, algo, graph, decode, efficiency=None, quant=BF16
) -> dict[str, float]:
    """One layer's GPU time by component (decode in a graph: + its fixed kernel time; eager decode: + the
    host time the GPU work does not hide). Eager prefill's host time is priced per stage (`_prefill_ms`)."""
    nodes, rpn = tp_group_shape(layout, cluster)
    ar = 0.0
    if layout.tp > 1:
        ar = 2 * allreduce_cost(algo, rows * model.hidden_size * DTYPE_BYTES, cluster, nodes, rpn, graph)[0]
    gemm = layer_gemm_us(model, rows, layout.tp, cluster, efficiency, quant)
    parts = {"gemm": gemm / 1e3, "attention": attention_us / 1e3, "allreduce": ar / 1e3}
    if decode and graph:
        parts["fixed"] = (KERNELS_PER_LAYER * cluster.graph_node_us + cluster.engine.decode_layer_us) / 1e3
    elif decode:
        parts["host"] = max(0.0, eager_layer_host_us(cluster) - (gemm + attention_us + ar)) / 1e3
    return parts


def fill_ms(stage_ms: float, last_extra: float, host_ms: float, hops_ms: list[float], m: int) -> float:
    """Prefill over len(hops_ms) + 1 equal stages and m micro-batches (module docstring, TTFT).

    Stage s finishes micro-batch j at max(max(its input arrived, micro-batch j - 1 done here) + GPU time,
    (j + 1) x host time): each stage's host issues its micro-batches in order, ahead of its GPU."""
    pp = len(hops_ms) + 1
    done = [0.0] * m
    for s in range(pp):
        gpu = stage_ms + (last_extra if s == pp - 1 else 0.0)
        arrive = [0.0] * m if s == 0 else [t + hops_ms[s - 1] for t in done]
        prev = 0.0
        for j in range(m):
            prev = done[j] = max(max(arrive[j], prev) + gpu, (j + 1) * host_ms)
    return done[-1]


def _prefill_ms(stage: dict[str, float], last_extra: float, host_ms: float, hops_ms: list[float], m: int):
    """(TTFT, its components): the GPU parts on the critical path of the fill, and the host time beyond them."""
    pp = len(hops_ms) + 1
    total = fill_ms(sum(stage.values()), last_extra, host_ms, hops_ms, m)
    parts = {k: v * (pp + m - 1) for k, v in stage.items()}
    parts["lm_head"], parts["pp_transfer"] = last_extra * m, sum(hops_ms)
    parts["host"] = max(0.0, total - sum(parts.values()))
    return total, parts


def _decode_ms(stage: dict[str, float], last_extra: float, xfer_ms: float, layout: Layout):
    """Critical path of one decode step over pp equal stages (+ the last stage's LM head) and m micro-batches;
    `xfer_ms` includes the sampled tokens' way back to the first stage.

    Returns (total ms, its components, the share of the time a stage waits)."""
    pp, m = layout.pp, layout.micro_batches
    stage_ms = sum(stage.values())
    slowest = stage_ms + last_extra
    traverse = pp * stage_ms + last_extra + xfer_ms
    if m * slowest >= traverse:  # stages saturated: transfers hide behind other micro-batches
        total = m * slowest
        parts = {k: v * m for k, v in stage.items()}
        parts["lm_head"], parts["pp_transfer"] = last_extra * m, 0.0
    else:  # latency-bound: one micro-batch's token walks through the whole pipe
        total = traverse
        parts = {k: v * pp for k, v in stage.items()}
        parts["lm_head"], parts["pp_transfer"] = last_extra, xfer_ms
    return total, parts, (1.0 - m * slowest / total) if total else 0.0


def estimate(
    model: ModelConfig,
    cluster: ClusterSpec,
    layout: Layout,
    workload: Workload,
    algo: str = "nccl",
    cuda_graphs: bool = True,
    prefill_algo: str | None = None,
    quant: Quantization = BF16,
) -> Estimate:
    """TTFT, time per output token and batch latency of `workload` on `layout` with all-reduce `algo`.

    `prefill_algo` (default: the same as `algo`) prices prefill's all-reduces separately, e.g. NCCL
    for prefill as YALIS does. `quant`: the weights' bytes and the layer GEMMs' rate (spanllm.perf.quantization).
    """
    b, m = workload.batch, layout.micro_batches
    if b % m:
        raise InferenceModelError(f"batch={b} is not divisible by micro_batches={m}; pick a divisor of {b}")
    if layout.pp > model.num_layers:
        raise InferenceModelError(f"pp={layout.pp} exceeds the model's {model.num_layers} layers")
    if layout.gpus > cluster.gpus_per_node and not cluster.has_network:
        raise InferenceModelError(
            f"{layout} needs {layout.gpus} GPUs; cluster {cluster.name!r} is one host of "
            f"{cluster.gpus_per_node} without a network"
        )
    mb = b // m
    layers = math.ceil(model.num_layers / layout.pp)
    g = cluster.gpus_per_node

    def hops_ms(rows: int) -> list[float]:
        """Each stage boundary's transfer of `rows` hidden states (a boundary at a host edge crosses the network)."""
        nbytes = rows * model.hidden_size * DTYPE_BYTES
        return [
            pp_transfer_us(nbytes, stage_boundary_over_network(s, layout, cluster), cluster) / 1e3
            for s in range(layout.pp - 1)
        ]

    # prefill: eager
    rows = mb * workload.prompt_len
    eff = prefill_efficiency(cluster, layer_params(model) / layout.tp)
    layer = _layer_ms(
        model,
        cluster,
        layout,
        rows,
        prefill_attention_us(model, mb, workload.prompt_len, layout.tp, cluster, eff, quant),
        prefill_algo or algo,
        False,
        False,
        eff,
        quant,
    )
    stage = {k: v * layers for k, v in layer.items()}
    ttft, prefill_parts = _prefill_ms(
        stage,
        lm_head_us(model, mb, layout.tp, cluster) / 1e3,
        layers * eager_layer_host_us(cluster) / 1e3,
        hops_ms(rows),
        m,
    )
    # decode
    positions = decode_positions(workload, cluster)
    layer = _layer_ms(
        model,
        cluster,
        layout,
        mb,
        decode_attention_us(model, mb, positions, layout.tp, cluster, quant),
        algo,
        cuda_graphs,
        True,
        quant=quant,
    )
    stage = {k: v * layers for k, v in layer.items()}
    xfer = sum(hops_ms(mb))
    if layout.pp > 1:  # the last stage sends the sampled token ids (int64) back to the first
        xfer += pp_transfer_us(mb * 8, layout.gpus > g, cluster) / 1e3
    tpot, decode_parts, idle = _decode_ms(stage, lm_head_us(model, mb, layout.tp, cluster) / 1e3, xfer, layout)
    e2e = ttft + (workload.decode_len - 1) * tpot
    variant = ""
    if layout.tp > 1:
        nodes, rpn = tp_group_shape(layout, cluster)
        variant = allreduce_cost(algo, mb * model.hidden_size * DTYPE_BYTES, cluster, nodes, rpn, cuda_graphs)[1]
    return Estimate(
        ttft_ms=ttft,
        tpot_ms=tpot,
        e2e_ms=e2e,
        throughput_tok_s=b * workload.decode_len / (e2e / 1e3),
        prefill_ms=prefill_parts,
        decode_ms=decode_parts,
        decode_idle_fraction=idle,
        allreduce_variant=variant,
        memory=memory_per_gpu(model, layout, workload, cluster, quant),
    )
