"""All-reduce cost model: per algorithm, how many steps cross which link and how many bytes they carry.

Notation: M payload bytes, P ranks, N nodes, g = P / N ranks per node, node-major numbering.
An algorithm's *schedule* (`cost_terms`) is counted in plain numbers -- launches, NVLink steps,
network steps, wire bytes per link -- and the time is the alpha-beta sum over them with the
cluster's constants (`time_from_terms_us`):

    t = kernels * (graph_node_us | kernel_launch_us) [+ eager_us] + base_us
        + nvlink_steps * nvlink_step_us + net_steps * net_step_us
        + nvlink_wire_bytes / (nvlink_GBps * eff) + net_wire_bytes / (nic_GBps_per_gpu * eff)

Schedules (bytes on the critical path of one GPU):
  nccl ring       2(P-1) steps, 2(N-1) of them over the network; 2(P-1)/P * M on the slowest link
  nccl tree       2(g-1) NVLink steps + 2 ceil(log2 N) network steps; 2M on the slowest link
  nccl            min over {ring, tree} x {LL, LL128, Simple}, as NCCL's own tuner picks
  torch one-shot  2 barrier steps; reads (P-1) M from peers (one host only)
  torch two-shot  3 barrier steps; 2(P-1)/P * M (reduce-scatter + all-gather; one host only)
  recursive doubling (flat)  log2 P steps of the full M (the first log2 g inside a node), LL8 cells
  nvrar           intra reduce-scatter (1 step, (g-1)/g M) -> recursive doubling across nodes on the
                  shard (log2 N steps of M/g, LL8 cells) -> intra all-gather (1 step, (g-1)/g M)
Non-power-of-two counts in recursive doubling fold: the extra ranks hand their data to a partner
first and get the result last, +2 steps of the same size.

Nodes may be *virtual* (several logical nodes on one host, e.g. 2 x 1 on the H200 host): the
hierarchical schedule follows the logical topology, but every step then crosses NVLink.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from spanllm.perf.hardware import AlgoCost, ClusterSpec

NCCL_VARIANTS = {
    "nccl_ring": ("nccl_ring/LL", "nccl_ring/LL128", "nccl_ring/Simple"),
    "nccl_tree": ("nccl_tree/LL", "nccl_tree/LL128", "nccl_tree/Simple"),
}
NCCL_VARIANTS["nccl"] = NCCL_VARIANTS["nccl_ring"] + NCCL_VARIANTS["nccl_tree"]

MODELLED = ("nccl", "nccl_ring", "nccl_tree", "torch_one_shot", "torch_two_shot", "recursive_doubling",
            "nvrar", "auto")
"""Algorithm names the model answers for. Bench names map onto these (see `model_name`)."""

AUTO_CANDIDATES = ("nccl", "torch_one_shot", "torch_two_shot", "nvrar")
"""What spanllm's size-based `auto` chooses among; the model's `auto` is the fastest supported one."""

NOT_MODELLED = {"gloo": "CPU collective", "ref_ring": "CPU reference executor",
                "ref_rd": "CPU reference executor", "ref_hier": "CPU reference executor"}


class AllReduceModelError(ValueError):
    """An algorithm / topology / cluster combination the model cannot answer for."""


def model_name(bench_algo: str) -> str:
    """The model's name for an algorithm named in `spanllm bench allreduce` output."""
    if bench_algo in MODELLED:
        return bench_algo
    if bench_algo in NOT_MODELLED:
        raise AllReduceModelError(f"algorithm {bench_algo!r} is a {NOT_MODELLED[bench_algo]}; the GPU "
                                  "performance model does not cover it")
    raise AllReduceModelError(f"unknown all-reduce algorithm {bench_algo!r}; modelled: {', '.join(MODELLED)}")


@dataclass(frozen=True)
class Placement:
    """A group of `nodes` x `ranks_per_node` logical ranks on a cluster."""

    nodes: int  # logical nodes (what the hierarchical schedule sees)
    ranks_per_node: int
    physical_nodes: int  # hosts actually spanned

    @property
    def world(self) -> int:
        return self.nodes * self.ranks_per_node

    @property
    def over_network(self) -> bool:
        return self.physical_nodes > 1

    @property
    def physical_ranks_per_node(self) -> int:
        return self.world // self.physical_nodes


def place(cluster: ClusterSpec, nodes: int, ranks_per_node: int | None = None) -> Placement:
    """Where a logical nodes x ranks_per_node group sits: one host (virtual nodes allowed) or whole hosts."""
    if not isinstance(nodes, int) or nodes < 1:
        raise AllReduceModelError(f"nodes={nodes!r} must be an integer >= 1")
    g = cluster.gpus_per_node if ranks_per_node is None else ranks_per_node
    if not isinstance(g, int) or not 1 <= g <= cluster.gpus_per_node:
        raise AllReduceModelError(f"ranks_per_node={g!r} must lie in [1, {cluster.gpus_per_node}] "
                                  f"(cluster {cluster.name!r} has {cluster.gpus_per_node} GPUs per node)")
    world = nodes * g
    if world <= cluster.gpus_per_node:
        return Placement(nodes, g, 1)  # one host; nodes > 1 are virtual
    if g != cluster.gpus_per_node:
        raise AllReduceModelError(
            f"{nodes} nodes x {g} ranks per node spans several hosts of {cluster.gpus_per_node} GPUs; the model "
            f"places multi-host groups on whole hosts only: use ranks_per_node={cluster.gpus_per_node}")
    if not cluster.has_network:
        raise AllReduceModelError(
            f"cluster {cluster.name!r} has no network (nic_GBps_per_gpu=0) and {cluster.gpus_per_node} GPUs: "
            f"{world} ranks do not fit; use at most {cluster.gpus_per_node} ranks (virtual nodes allowed)")
    return Placement(nodes, g, nodes)


@dataclass(frozen=True)
class CostTerms:
    """One call, counted: what the alpha-beta sum runs over."""

    nvlink_steps: float = 0.0
    net_steps: float = 0.0
    nvlink_wire_bytes: float = 0.0
    net_wire_bytes: float = 0.0

    def __add__(self, other: "CostTerms") -> "CostTerms":
        return CostTerms(self.nvlink_steps + other.nvlink_steps, self.net_steps + other.net_steps,
                         self.nvlink_wire_bytes + other.nvlink_wire_bytes, self.net_wire_bytes + other.net_wire_bytes)


def recursive_doubling_steps(n: int) -> int:
    """Steps of recursive doubling over n participants: log2 n, or floor(log2 n) + 2 when folding."""
    if n < 1:
        raise AllReduceModelError(f"recursive doubling over n={n} participants: need n >= 1")
    k = n.bit_length() - 1
    return k if n == 1 << k else k + 2


def _steps(n: int, over_network: bool) -> CostTerms:
    return CostTerms(net_steps=n) if over_network else CostTerms(nvlink_steps=n)


def _bytes(b: float, over_network: bool) -> CostTerms:
    return CostTerms(net_wire_bytes=b) if over_network else CostTerms(nvlink_wire_bytes=b)


def ring_terms(nbytes: float, pl: Placement, wire: float) -> CostTerms:
    p, n = pl.world, pl.physical_nodes
    inter = 2 * (n - 1)
    return (CostTerms(nvlink_steps=2 * (p - 1) - inter, net_steps=inter)
            + _bytes(2 * (p - 1) / p * nbytes * wire, pl.over_network))


def tree_terms(nbytes: float, pl: Placement, wire: float) -> CostTerms:
    if pl.world == 1:
        return CostTerms()
    g, n = pl.physical_ranks_per_node, pl.physical_nodes
    return (CostTerms(nvlink_steps=2 * (g - 1), net_steps=2 * math.ceil(math.log2(n)))
            + _bytes(2 * nbytes * wire, pl.over_network))


def one_shot_terms(nbytes: float, pl: Placement, wire: float) -> CostTerms:
    return CostTerms(nvlink_steps=2, nvlink_wire_bytes=(pl.world - 1) * nbytes * wire)


def two_shot_terms(nbytes: float, pl: Placement, wire: float) -> CostTerms:
    p = pl.world
    return CostTerms(nvlink_steps=3, nvlink_wire_bytes=2 * (p - 1) / p * nbytes * wire)


def flat_rd_terms(nbytes: float, pl: Placement, wire: float) -> CostTerms:
    p, g = pl.world, pl.physical_ranks_per_node
    total = recursive_doubling_steps(p)
    # node-major numbering: partners at distance 2^s < g share a node (g a power of two)
    intra = min(total, (g.bit_length() - 1) if g & (g - 1) == 0 else 0) if pl.over_network else total
    inter = total - intra
    return CostTerms(nvlink_steps=intra, net_steps=inter, nvlink_wire_bytes=intra * nbytes * wire,
                     net_wire_bytes=inter * nbytes * wire)


def nvrar_terms(nbytes: float, pl: Placement, wire: float) -> CostTerms:
    g = pl.ranks_per_node
    shard = nbytes / g
    intra = CostTerms() if g == 1 else CostTerms(nvlink_steps=2, nvlink_wire_bytes=2 * (g - 1) / g * nbytes)
    k = recursive_doubling_steps(pl.nodes)
    return intra + _steps(k, pl.over_network) + _bytes(k * shard * wire, pl.over_network)


SCHEDULES = {
    "nccl_ring": ring_terms, "nccl_tree": tree_terms, "torch_one_shot": one_shot_terms,
    "torch_two_shot": two_shot_terms, "recursive_doubling": flat_rd_terms, "nvrar": nvrar_terms,
}
ONE_HOST_ONLY = ("torch_one_shot", "torch_two_shot")


def schedule_of(key: str) -> str:
    """'nccl_ring/LL' -> 'nccl_ring'."""
    return key.split("/")[0]


def cost_terms(key: str, nbytes: float, cluster: ClusterSpec, pl: Placement) -> CostTerms:
    return SCHEDULES[schedule_of(key)](nbytes, pl, cluster.algo(key).wire_factor)


def time_from_terms_us(terms: CostTerms, cost: AlgoCost, cluster: ClusterSpec, graph: bool = True) -> float:
    launch = cost.kernels * (cluster.graph_node_us if graph else cluster.kernel_launch_us)
    t = launch + (0.0 if graph else cost.eager_us) + cost.base_us
    t += terms.nvlink_steps * cost.nvlink_step_us + terms.net_steps * cost.net_step_us
    if terms.nvlink_wire_bytes:
        t += transfer_us(terms.nvlink_wire_bytes, cluster.nvlink_GBps * cost.bw_efficiency)
    if terms.net_wire_bytes:
        t += transfer_us(terms.net_wire_bytes, cluster.nic_GBps_per_gpu * cost.bw_efficiency)
    return t


def transfer_us(nbytes: float, GBps: float) -> float:
    """Bytes over a link of GBps (1 GB/s = 1e3 bytes per microsecond)."""
    if GBps <= 0:
        raise AllReduceModelError(f"transfer of {nbytes:.0f} bytes over a link of {GBps} GB/s; "
                                  "the cluster preset lacks this link's bandwidth")
    return nbytes / (GBps * 1e3)


def supports(algo: str, cluster: ClusterSpec, pl: Placement) -> str | None:
    """None if the model can price `algo` here, else why not."""
    if algo in ONE_HOST_ONLY and pl.over_network:
        return f"{algo} needs every rank on one host (peer memory over NVLink); this group spans {pl.physical_nodes}"
    if algo not in MODELLED:
        return f"unknown algorithm {algo!r}; modelled: {', '.join(MODELLED)}"
    return None


def allreduce_cost(algo: str, nbytes: float, cluster: ClusterSpec, nodes: int, ranks_per_node: int | None = None,
                   graph: bool = True) -> tuple[float, str]:
    """(time in us, the variant that gives it: e.g. 'nccl_tree/LL', or the algorithm `auto` chose)."""
    if nbytes < 0:
        raise AllReduceModelError(f"nbytes={nbytes} must be >= 0")
    pl = place(cluster, nodes, ranks_per_node)
    why = supports(algo, cluster, pl)
    if why:
        raise AllReduceModelError(why)
    if pl.world == 1:
        return 0.0, algo
    if algo == "auto":
        options = [(allreduce_cost(a, nbytes, cluster, nodes, ranks_per_node, graph)[0], a)
                   for a in AUTO_CANDIDATES if supports(a, cluster, pl) is None]
        return min(options)
    keys = [k for k in NCCL_VARIANTS.get(algo, (algo,)) if nbytes > cluster.algo(k).picked_above_bytes
            or cluster.algo(k).picked_above_bytes == 0]
    if not keys:
        raise AllReduceModelError(f"cluster {cluster.name!r}: no variant of {algo} is picked at {nbytes} bytes; "
                                  "fix the picked_above_bytes entries of its preset")
    return min((time_from_terms_us(cost_terms(k, nbytes, cluster, pl), cluster.algo(k), cluster, graph), k)
               for k in keys)


def allreduce_time_us(algo: str, nbytes: float, cluster: ClusterSpec, nodes: int, ranks_per_node: int | None = None,
                      graph: bool = True) -> float:
    """Modelled time of one all-reduce call of `nbytes` over nodes x ranks_per_node GPUs of `cluster`."""
    return allreduce_cost(algo, nbytes, cluster, nodes, ranks_per_node, graph)[0]
