"""All-reduce cost model: per algorithm, how many steps cross which link and how many bytes they carry.

Notation: M payload bytes, P ranks, N nodes, g = P / N ranks per node, node-major numbering, w the
protocol's wire bytes per payload byte (LL / LL8 cells: 2). An algorithm's *schedule* (`cost_terms`)
is counted in plain numbers -- launches, NVLink steps, network steps, wire bytes per link, local
(HBM) bytes that sit on the critical path -- and the time is the alpha-beta sum over them with the
cluster's constants (`time_from_terms_us`):

    t = kernels * (graph_node_us | kernel_launch_us) [+ eager_us] + base_us
        + nvlink_steps * nvlink_step_us + net_steps * net_step_us
        + nvlink_wire_bytes / (nvlink_GBps * eff) + net_wire_bytes / (nic_GBps_per_gpu * eff)
        + local_bytes / (hbm_GBps * hbm_efficiency)

Schedules (bytes on the critical path of one GPU):
  nccl ring       2(P-1) steps; a chunk walks 2(P-1) consecutive edges of a ring whose P edges include N
                  network edges, so the critical path crosses the network ceil(2(P-1) N / P) times
                  (2N - 1 or 2N with several GPUs per node, as NCCL <= 2.18's tuner counts; 2(N-1) with
                  one GPU per node); 2(P-1)/P * w M per GPU, and across hosts
                  that traffic is spread over the node's g NICs (NCCL runs one ring per NIC and splits
                  the data among rings): 2(P-1)/P * w M / g on each per-GPU NIC
  nccl tree       2(g-1) NVLink steps + 2 ceil(log2 N) network steps; 2 w M through the node's g NICs
                  (one tree per NIC, data split among them): 2 w M / g per NIC; on one host 2 w M
  nccl            min over {ring, tree} x {LL, LL128, Simple}, as NCCL's own tuner picks
  torch one-shot  one kernel (`one_shot_all_reduce_copy_out`): copies the input into the symmetric
                  buffer (2M local bytes), barrier, reads (P-1) M from peers, barrier: 2 steps
  torch two-shot  two kernels (`buf.copy_(x)`, then `two_shot_all_reduce_out`): 2M local bytes,
                  3 barrier steps, 2(P-1)/P * M over NVLink (reduce-scatter + all-gather)
  recursive doubling (flat)  log2 P steps of w M (the first log2 g inside a node), LL8 cells
  nvrar           ONE kernel (spanllm.comm.nvrar.kernel), no barriers, LL8 cells (w = 2) unless the
                  launch says SIMPLE (w = 1):
                    one-shot (g > 1, launch 'os'): 1 NVLink exchange phase, (g-1) w M pushed
                    reduce-scatter (launch 'rs'):  2 NVLink exchange phases (push reduce-scatter,
                                                   push all-gather), (g-1)/g w M each
                    inter-node: log2 N recursive-doubling rounds on the shard S (S = M in one-shot
                    mode, M/g otherwise), each a local staging copy of w S (local bytes) and one
                    NVSHMEM block put of w S over the link (NVLink when the nodes are virtual)
                  os vs rs is what the tuned table chose (`launch`, from a bench row's `ran` column,
                  e.g. 'nvrar[os/b8x256w4]'); without it the faster of the two (what tuning picks).
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

MODELLED = ("nccl", "nccl_ring", "nccl_tree", "torch_one_shot", "torch_two_shot", "recursive_doubling", "nvrar", "auto")
"""Algorithm names the model answers for. Bench names map onto these (see `model_name`)."""

AUTO_CANDIDATES = ("nccl", "torch_one_shot", "torch_two_shot", "nvrar")
"""What spanllm's size-based `auto` chooses among; the model's `auto` is the fastest supported one."""

NOT_MODELLED = {
    "gloo": "CPU collective",
    "ref_ring": "CPU reference executor",
    "ref_rd": "CPU reference executor",
    "ref_hier": "CPU reference executor",
}


class AllReduceModelError(ValueError):
    """An algorithm / topology / cluster combination the model cannot answer for."""


def model_name(bench_algo: str) -> str:
    """The model's name for an algorithm named in `spanllm bench allreduce` output."""
    if bench_algo in MODELLED:
        return bench_algo
    if bench_algo in NOT_MODELLED:
        raise AllReduceModelError(
            f"algorithm {bench_algo!r} is a {NOT_MODELLED[bench_algo]}; the GPU performance model does not cover it"
        )
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
        raise AllReduceModelError(
            f"ranks_per_node={g!r} must lie in [1, {cluster.gpus_per_node}] "
            f"(cluster {cluster.name!r} has {cluster.gpus_per_node} GPUs per node)"
        )
    world = nodes * g
    if world <= cluster.gpus_per_node:
        return Placement(nodes, g, 1)  # one host; nodes > 1 are virtual
    if g != cluster.gpus_per_node:
        raise AllReduceModelError(
            f"{nodes} nodes x {g} ranks per node spans several hosts of {cluster.gpus_per_node} GPUs; the model "
            f"places multi-host groups on whole hosts only: use ranks_per_node={cluster.gpus_per_node}"
        )
    if not cluster.has_network:
        raise AllReduceModelError(
            f"cluster {cluster.name!r} has no network (nic_GBps_per_gpu=0) and {cluster.gpus_per_node} GPUs: "
            f"{world} ranks do not fit; use at most {cluster.gpus_per_node} ranks (virtual nodes allowed)"
        )
    return Placement(nodes, g, nodes)


@dataclass(frozen=True)
class CostTerms:
    """One call, counted: what the alpha-beta sum runs over."""

    nvlink_steps: float = 0.0
    net_steps: float = 0.0
    nvlink_wire_bytes: float = 0.0
    net_wire_bytes: float = 0.0
    local_bytes: float = 0.0  # HBM traffic on the critical path that no transfer hides (copies, staging)

    def __add__(self, other: CostTerms) -> CostTerms:
        return CostTerms(
            self.nvlink_steps + other.nvlink_steps,
            self.net_steps + other.net_steps,
            self.nvlink_wire_bytes + other.nvlink_wire_bytes,
            self.net_wire_bytes + other.net_wire_bytes,
            self.local_bytes + other.local_bytes,
        )


@dataclass(frozen=True)
class NvrarLaunch:
    """What the nvrar kernel was launched with, as far as the model needs it."""

    one_shot: bool
    protocol: str = "ll8"  # "ll8" (8-byte data+flag cells, 2x wire bytes) or "simple" (raw data + flag per tile)

    @property
    def tag(self) -> str:
        return ("os" if self.one_shot else "rs") + ("" if self.protocol == "ll8" else "/simple")


def parse_launch(text: str | None) -> NvrarLaunch | None:
    """'os/b8x256w4' -> one-shot LL8; 'rs/b64x1024w8/simple' -> reduce-scatter SIMPLE; '' or None -> None."""
    if not text:
        return None
    parts = str(text).strip("[]").split("/")
    if parts[0] not in ("os", "rs"):
        raise AllReduceModelError(f"nvrar launch {text!r}: expected 'os/...' or 'rs/...' (LaunchParams.short())")
    return NvrarLaunch(one_shot=parts[0] == "os", protocol="simple" if "simple" in parts[1:] else "ll8")


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


def ring_network_steps(world: int, nodes: int) -> int:
    """Network edges on the critical path of a ring all-reduce over `world` ranks on `nodes` hosts (node-major).

    The slowest chunk travels 2(world-1) consecutive ring edges, `nodes` of every `world` cross the network."""
    return math.ceil(2 * (world - 1) * nodes / world)


def ring_terms(nbytes: float, pl: Placement, wire: float, launch: NvrarLaunch | None = None) -> CostTerms:
    p, n = pl.world, pl.physical_nodes
    inter = ring_network_steps(p, n) if pl.over_network else 0
    nics = pl.physical_ranks_per_node if pl.over_network else 1  # rings share the data, one NIC each
    return CostTerms(nvlink_steps=2 * (p - 1) - inter, net_steps=inter) + _bytes(
        2 * (p - 1) / p * nbytes * wire / nics, pl.over_network
    )


def tree_terms(nbytes: float, pl: Placement, wire: float, launch: NvrarLaunch | None = None) -> CostTerms:
    if pl.world == 1:
        return CostTerms()
    g, n = pl.physical_ranks_per_node, pl.physical_nodes
    nics = g if pl.over_network else 1  # trees share the data, one NIC each
    return CostTerms(nvlink_steps=2 * (g - 1), net_steps=2 * math.ceil(math.log2(n))) + _bytes(
        2 * nbytes * wire / nics, pl.over_network
    )


def one_shot_terms(nbytes: float, pl: Placement, wire: float, launch: NvrarLaunch | None = None) -> CostTerms:
    # copy-in of the caller's tensor (read + write M) precedes the first barrier
    return CostTerms(nvlink_steps=2, nvlink_wire_bytes=(pl.world - 1) * nbytes * wire, local_bytes=2 * nbytes)


def two_shot_terms(nbytes: float, pl: Placement, wire: float, launch: NvrarLaunch | None = None) -> CostTerms:
    p = pl.world
    # the separate copy kernel (read + write M) runs before the reduce kernel
    return CostTerms(nvlink_steps=3, nvlink_wire_bytes=2 * (p - 1) / p * nbytes * wire, local_bytes=2 * nbytes)


def flat_rd_terms(nbytes: float, pl: Placement, wire: float, launch: NvrarLaunch | None = None) -> CostTerms:
    p, g = pl.world, pl.physical_ranks_per_node
    total = recursive_doubling_steps(p)
    # node-major numbering: partners at distance 2^s < g share a node (g a power of two)
    intra = min(total, (g.bit_length() - 1) if g & (g - 1) == 0 else 0) if pl.over_network else total
    inter = total - intra
    return CostTerms(
        nvlink_steps=intra,
        net_steps=inter,
        nvlink_wire_bytes=intra * nbytes * wire,
        net_wire_bytes=inter * nbytes * wire,
    )


def nvrar_terms(nbytes: float, pl: Placement, wire: float, launch: NvrarLaunch | None = None) -> CostTerms:
    """The kernel's phases (module docstring); `launch` None means reduce-scatter mode (call `nvrar_launches`)."""
    g = pl.ranks_per_node
    one_shot = g > 1 and launch is not None and launch.one_shot
    if launch is not None and launch.protocol == "simple":
        wire = 1.0
    shard = nbytes if one_shot else nbytes / g
    if g == 1:
        intra = CostTerms()
    elif one_shot:
        intra = CostTerms(nvlink_steps=1, nvlink_wire_bytes=(g - 1) * nbytes * wire)
    else:
        intra = CostTerms(nvlink_steps=2, nvlink_wire_bytes=2 * (g - 1) / g * nbytes * wire)
    k = recursive_doubling_steps(pl.nodes)
    staging = CostTerms(local_bytes=k * shard * wire)
    return intra + staging + _steps(k, pl.over_network) + _bytes(k * shard * wire, pl.over_network)


def nvrar_launches(pl: Placement) -> tuple[NvrarLaunch, ...]:
    """The launch modes a tuned table chooses among here (one-shot only with several ranks per node)."""
    return (NvrarLaunch(True), NvrarLaunch(False)) if pl.ranks_per_node > 1 else (NvrarLaunch(False),)


SCHEDULES = {
    "nccl_ring": ring_terms,
    "nccl_tree": tree_terms,
    "torch_one_shot": one_shot_terms,
    "torch_two_shot": two_shot_terms,
    "recursive_doubling": flat_rd_terms,
    "nvrar": nvrar_terms,
}
ONE_HOST_ONLY = ("torch_one_shot", "torch_two_shot")


def schedule_of(key: str) -> str:
    """'nccl_ring/LL' -> 'nccl_ring'."""
    return key.split("/")[0]


def cost_terms(
    key: str, nbytes: float, cluster: ClusterSpec, pl: Placement, launch: NvrarLaunch | None = None
) -> CostTerms:
    return SCHEDULES[schedule_of(key)](nbytes, pl, cluster.algo(key).wire_factor, launch)


def fixed_us(cost: AlgoCost, cluster: ClusterSpec, graph: bool = True) -> float:
    """Per-call cost that no step or byte count scales: launches (graph nodes or eager), host path, base."""
    launch = cost.kernels * (cluster.graph_node_us if graph else cluster.kernel_launch_us)
    return launch + (0.0 if graph else cost.eager_us) + cost.base_us


def local_us(terms: CostTerms, cluster: ClusterSpec) -> float:
    """Critical-path local copies at the measured HBM copy bandwidth."""
    return transfer_us(terms.local_bytes, cluster.hbm_GBps * cluster.hbm_efficiency) if terms.local_bytes else 0.0


def time_from_terms_us(terms: CostTerms, cost: AlgoCost, cluster: ClusterSpec, graph: bool = True) -> float:
    t = fixed_us(cost, cluster, graph) + local_us(terms, cluster)
    t += terms.nvlink_steps * cost.nvlink_step_us + terms.net_steps * cost.net_step_us
    if terms.nvlink_wire_bytes:
        t += transfer_us(terms.nvlink_wire_bytes, cluster.nvlink_GBps * cost.bw_efficiency)
    if terms.net_wire_bytes:
        t += transfer_us(terms.net_wire_bytes, cluster.nic_GBps_per_gpu * cost.bw_efficiency)
    return t


def transfer_us(nbytes: float, GBps: float) -> float:
    """Bytes over a link of GBps (1 GB/s = 1e3 bytes per microsecond)."""
    if GBps <= 0:
        raise AllReduceModelError(
            f"transfer of {nbytes:.0f} bytes over a link of {GBps} GB/s; the cluster preset lacks this link's bandwidth"
        )
    return nbytes / (GBps * 1e3)


def supports(algo: str, cluster: ClusterSpec, pl: Placement) -> str | None:
    """None if the model can price `algo` here, else why not."""
    if algo in ONE_HOST_ONLY and pl.over_network:
        return f"{algo} needs every rank on one host (peer memory over NVLink); this group spans {pl.physical_nodes}"
    if algo not in MODELLED:
        return f"unknown algorithm {algo!r}; modelled: {', '.join(MODELLED)}"
    return None


def allreduce_cost(
    algo: str,
    nbytes: float,
    cluster: ClusterSpec,
    nodes: int,
    ranks_per_node: int | None = None,
    graph: bool = True,
    launch: str | NvrarLaunch | None = None,
) -> tuple[float, str]:
    """(time in us, the variant that gives it: e.g. 'nccl_tree/LL', 'nvrar[os]', or what `auto` chose).

    `launch`: for nvrar, the launch the tuned table chose ('os/b8x256w4', a bench row's `ran` bracket);
    None: the faster of one-shot and reduce-scatter (what tuning picks)."""
    if nbytes < 0:
        raise AllReduceModelError(f"nbytes={nbytes} must be >= 0")
    pl = place(cluster, nodes, ranks_per_node)
    why = supports(algo, cluster, pl)
    if why:
        raise AllReduceModelError(why)
    if pl.world == 1:
        return 0.0, algo
    if algo == "auto":
        options = [
            (allreduce_cost(a, nbytes, cluster, nodes, ranks_per_node, graph)[0], a)
            for a in AUTO_CANDIDATES
            if supports(a, cluster, pl) is None
        ]
        return min(options)
    if algo == "nvrar":
        given = parse_launch(launch) if isinstance(launch, str) or launch is None else launch
        cost = cluster.algo("nvrar")
        return min(
            (
                time_from_terms_us(nvrar_terms(nbytes, pl, cost.wire_factor, lc), cost, cluster, graph),
                f"nvrar[{lc.tag}]",
            )
            for lc in ((given,) if given else nvrar_launches(pl))
        )
    keys = [
        k
        for k in NCCL_VARIANTS.get(algo, (algo,))
        if nbytes > cluster.algo(k).picked_above_bytes or cluster.algo(k).picked_above_bytes == 0
    ]
    if not keys:
        raise AllReduceModelError(
            f"cluster {cluster.name!r}: no variant of {algo} is picked at {nbytes} bytes; "
            "fix the picked_above_bytes entries of its preset"
        )
    return min(
        (time_from_terms_us(cost_terms(k, nbytes, cluster, pl), cluster.algo(k), cluster, graph), k) for k in keys
    )


def allreduce_time_us(
    algo: str,
    nbytes: float,
    cluster: ClusterSpec,
    nodes: int,
    ranks_per_node: int | None = None,
    graph: bool = True,
    launch: str | NvrarLaunch | None = None,
) -> float:
    """Modelled time of one all-reduce call of `nbytes` over nodes x ranks_per_node GPUs of `cluster`."""
    return allreduce_cost(algo, nbytes, cluster, nodes, ranks_per_node, graph, launch)[0]
