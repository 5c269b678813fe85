"""NVRAR: hierarchical all-reduce on GPUs (intra-node reduce-scatter over NVLink, inter-node recursive
doubling with GPU-initiated NVSHMEM puts, intra-node all-gather), one Triton kernel per call.

The kernel and its protocol are described in `spanllm.comm.nvrar.kernel`. This module owns the host
side: the workspace layout (pure functions, tested on CPU), the launch parameters per message size,
and the communicator object whose lifetime holds the symmetric buffers, the sequence counter and
the error record.

Launch parameters
    `LaunchParams(one_shot, num_blocks, block, num_warps, protocol, pipelined)`; protocol "ll8" (data+flag
    cells) or "simple" (raw data + a flag per tile: half the bytes, one more fence per tile); pipelined
    takes each program's tiles through the phases phase-major instead of tile-major. `one_shot` replaces the intra-node
    reduce-scatter + all-gather by one exchange of the whole message (every local rank then reduces
    everything, and the inter-node rounds carry the whole message): one NVLink latency instead of two,
    for g times the bytes. A tuning table (`spanllm tune`) picks per size; `default_launch` is the
    untuned rule.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

import torch
import torch.distributed as dist

from spanllm.comm.base import AllReduce, AllReduceError, AllReduceInputError, Capability
from spanllm.comm.nvrar.trace import TRACE_WORDS
from spanllm.comm.schedule import _recursive_doubling_rounds
from spanllm.comm.topology import Topology

DEFAULT_MAX_BYTES = 8 << 20
DEFAULT_ONE_SHOT_MAX_BYTES = 1 << 20
DEFAULT_TIMEOUT_S = 30.0
MAX_BUFFER_BYTES = 1 << 30
MAX_PROGRAMS = 1024  # programs (num_blocks) of one launch; also the phase trace's rows
SUPPORTED_DTYPES = frozenset({torch.float32, torch.bfloat16, torch.float16, torch.int32})


def elements_per_cell(dtype: torch.dtype) -> int:
    """An LL8 cell carries 4 data bytes: two 16-bit elements or one 32-bit element."""
    size = dtype.itemsize
    if size not in (2, 4):
        raise AllReduceInputError(f"nvrar: dtype {dtype} has {size}-byte elements; LL8 cells carry 2- or 4-byte ones")
    return 4 // size


PROTOCOLS = ("ll8", "simple")
SIMPLE_MIN_BLOCK = 256  # the SIMPLE flag area holds one word per tile of at least this many cells


@dataclass(frozen=True)
class LaunchParams:
    one_shot: bool = False
    num_blocks: int = 16
    block: int = 512  # cells per tile (power of two)
    num_warps: int = 4
    protocol: str = "ll8"  # "ll8": data+flag cells (2x bytes); "simple": raw data + one flag per tile
    # Phase-major: a program takes all its tiles through one phase before the next, so their flag round
    # trips overlap (tile-major handles one tile through every phase at a time). Same result bitwise.
    pipelined: bool = False

    def __post_init__(self) -> None:
        if self.block < 16 or self.block & (self.block - 1):
            raise ValueError(f"block={self.block} cells must be a power of two >= 16")
        if self.protocol not in PROTOCOLS:
            raise ValueError(f"protocol={self.protocol!r} must be one of {PROTOCOLS}")
        if self.protocol == "simple" and self.block < SIMPLE_MIN_BLOCK:
            raise ValueError(
                f"protocol 'simple' needs block >= {SIMPLE_MIN_BLOCK} cells (one flag word per tile); "
                f"got block={self.block}"
            )
        if not 1 <= self.num_blocks <= MAX_PROGRAMS:
            raise ValueError(f"num_blocks={self.num_blocks} must be in [1, {MAX_PROGRAMS}]")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"num_warps={self.num_warps} must be one of 1, 2, 4, 8, 16")

    def short(self) -> str:
        proto = "" if self.protocol == "ll8" else "/simple"
        pipe = "/pipe" if self.pipelined else ""
        return f"{'os' if self.one_shot else 'rs'}/b{self.num_blocks}x{self.block}w{self.num_warps}{proto}{pipe}"


def default_launch(
    nbytes: int, topology: Topology, one_shot_max_bytes: int = DEFAULT_ONE_SHOT_MAX_BYTES
) -> LaunchParams:
    """Untuned rule: one-shot for small messages inside a node, enough tiles to spread bigger ones."""
    g = topology.ranks_per_node
    one_shot = g > 1 and nbytes <= min(one_shot_max_bytes, 64 << 10)
    shard_bytes = nbytes if one_shot or g == 1 else -(-nbytes // g)
    cells = -(-shard_bytes // 4)
    block = 256 if cells <= 4096 else 1024
    num_blocks = max(1, min(64, -(-cells // block)))
    return LaunchParams(one_shot=one_shot, num_blocks=num_blocks, block=block, num_warps=4 if block <= 512 else 8)


@dataclass(frozen=True)
class InterRound:
    send_peer: int  # group rank to put to, -1 for none
    recv_peer: int  # group rank to receive from, -1 for none
    overwrite: bool  # the fold's last round copies the finished sum instead of adding


def inter_rounds(rank: int, topology: Topology) -> list[InterRound]:
    """The inter-node rounds of `rank`: the recursive-doubling schedule of its rail (same local rank on
    every node), folding non-power-of-two node counts exactly like the CPU reference schedule."""
    rail = topology.rail_ranks(topology.local_rank(rank))
    out = []
    for rnd in _recursive_doubling_rounds(rail, rank, 0, 1):
        send = rnd.sends[0].peer if rnd.sends else -1
        recv = rnd.recvs[0].peer if rnd.recvs else -1
        out.append(InterRound(send, recv, bool(rnd.recvs) and rnd.recvs[0].op == "copy"))
    return out


@dataclass(frozen=True)
class WorkspaceLayout:
    """Cell offsets of the symmetric workspace. One parity half holds, each of `slot` cells:
    G intra-node receive slots (one per local source), R inter-node receive slots, R staging slots
    (sources of the NVSHMEM puts) and G all-gather receive slots. Two halves alternate by call parity.
    After them, the SIMPLE protocol's flag words: [2 parities][2G + R regions][max_tiles]."""

    G: int
    R: int
    slot: int
    intra: int
    inter: int
    stage: int
    gather: int
    parity_cells: int
    max_tiles: int = 0
    # SIMPLE's own slots (raw 4-byte words: half a slot each). They must not alias LL8's: raw words written
    # into LL8 cells could later pass for a flag (a stale cell read as ready) when both protocols are used.
    simple_slot: int = 0
    simple_intra: int = 0
    simple_inter: int = 0
    simple_stage: int = 0
    simple_gather: int = 0

    def offsets(self, protocol: str) -> tuple[int, int, int, int, int]:
        """(intra, inter, stage, gather, slot) in cells for one protocol."""
        if protocol == "simple":
            return self.simple_intra, self.simple_inter, self.simple_stage, self.simple_gather, self.simple_slot
        return self.intra, self.inter, self.stage, self.gather, self.slot

    @property
    def flags(self) -> int:
        return 2 * self.parity_cells

    @property
    def flag_cells(self) -> int:
        return 2 * (2 * self.G + self.R) * self.max_tiles

    @property
    def total_cells(self) -> int:
        return 2 * self.parity_cells + self.flag_cells

    @property
    def total_bytes(self) -> int:
        return 8 * self.total_cells


def workspace_layout(topology: Topology, num_rounds: int, max_bytes: int, one_shot_max_bytes: int) -> WorkspaceLayout:
    g = topology.ranks_per_node
    max_cells = -(-max_bytes // 4)  # 4 data bytes per cell
    slot = -(-max_cells // g)  # a reduce-scatter shard of the largest message
    if g > 1:
        slot = max(slot, -(-min(one_shot_max_bytes, max_bytes) // 4))  # one-shot moves whole messages
    slot = -(-slot // 64) * 64  # 512-byte aligned slots
    intra_slots = g if g > 1 else 0
    intra = 0
    inter = intra + intra_slots * slot
    stage = inter + num_rounds * slot
    gather = stage + num_rounds * slot
    simple_slot = -(-slot // 2)  # raw data: 4 bytes per cell instead of 8
    s_intra = gather + intra_slots * slot
    s_inter = s_intra + intra_slots * simple_slot
    s_stage = s_inter + num_rounds * simple_slot
    s_gather = s_stage + num_rounds * simple_slot
    parity = s_gather + intra_slots * simple_slot
    max_tiles = -(-slot // SIMPLE_MIN_BLOCK)
    return WorkspaceLayout(
        g,
        num_rounds,
        slot,
        intra,
        inter,
        stage,
        gather,
        max(parity, 64),
        max_tiles,
        simple_slot,
        s_intra,
        s_inter,
        s_stage,
        s_gather,
    )


class NvrarAllReduce(AllReduce):
    name = "nvrar"
    capability = Capability(dtypes=SUPPORTED_DTYPES, device_types=frozenset({"cuda"}))

    def __init__(
        self,
        group=None,
        topology=None,
        *,
        max_bytes: int = DEFAULT_MAX_BYTES,
        one_shot_max_bytes: int = DEFAULT_ONE_SHOT_MAX_BYTES,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        tuning=None,
        launch: LaunchParams | None = None,
        device: torch.device | None = None,
        trace: bool = False,
    ) -> None:
        super().__init__(group, topology)
        if self.world_size < 2:
            raise AllReduceInputError(
                f"nvrar: a group of {self.world_size} rank needs no all-reduce, and torch symmetric "
                "memory (its transport) needs at least 2 ranks; run nvrar on 2 or more"
            )
        from spanllm.comm import symm  # triton + NVSHMEM, GPU only
        from spanllm.comm.nvrar import kernel as nvrar_kernel  # triton + NVSHMEM, GPU only

        if not 0 < max_bytes < MAX_BUFFER_BYTES:
            raise AllReduceInputError(
                f"nvrar: max_bytes={max_bytes} must be in (0, {MAX_BUFFER_BYTES}): element "
                "offsets are 32-bit; larger messages belong to NCCL (use 'auto')"
            )
        self._kernel = nvrar_kernel
        self.device = device if device is not None else torch.device("cuda", torch.cuda.current_device())
        self._max_bytes = max_bytes
        self.one_shot_max_bytes = min(one_shot_max_bytes, max_bytes)
        self.timeout_s = timeout_s
        self.tuning = tuning
        self.fixed_launch = launch
        topo = self.topology
        self.rounds = inter_rounds(self.rank, topo)
        self.layout = workspace_layout(topo, len(self.rounds), max_bytes, self.one_shot_max_bytes)
        self.ws, self.handle = symm.allocate(self.layout.total_cells, torch.int64, self.device, self.group)
        node = topo.node_of(self.rank)
        self.node_first_rank = topo.rank_of(node, 0)
        ptrs = [self.handle.buffer_ptrs[r] for r in topo.node_ranks(node)]
        if any(p == 0 for p in ptrs):
            raise AllReduceError(
                f"nvrar: a local peer's buffer is not mapped for direct access (buffer_ptrs={ptrs}); ranks "
                f"{topo.node_ranks(node)} were declared one node but are not P2P-reachable. Declare "
                "ranks_per_node to match the GPUs that share NVLink"
            )
        self.peer_ptrs = torch.tensor(ptrs, dtype=torch.int64, device=self.device)
        to_pe = lambda r: dist.get_global_rank(self.group, r) if r >= 0 else -1  # NVSHMEM PE = global rank
        self.round_send_pe = torch.tensor(
            [to_pe(r.send_peer) for r in self.rounds] or [-1], dtype=torch.int32, device=self.device
        )
        self.round_recv_peer = torch.tensor(
            [r.recv_peer for r in self.rounds] or [-1], dtype=torch.int32, device=self.device
        )
        self.round_recv_op = torch.tensor(
            [int(r.overwrite) for r in self.rounds] or [0], dtype=torch.int32, device=self.device
        )
        self.seq = torch.zeros(1, dtype=torch.int32, device=self.device)
        self.ticket = torch.zeros(1, dtype=torch.int32, device=self.device)
        # Host-mapped so the record survives the trap that kills the CUDA context.
        self.err = torch.zeros(nvrar_kernel.ERR_RECORD_LEN, dtype=torch.int64, pin_memory=True)
        # Phase trace (spanllm.comm.nvrar.trace): one record per program of the last call; off by default
        # (a separate kernel specialisation, so the untraced kernel carries no clock reads).
        self.trace_enabled = trace
        self.trace = torch.zeros((MAX_PROGRAMS if trace else 1, TRACE_WORDS), dtype=torch.int64, device=self.device)
        self._last_grid = 0

    @property
    def max_bytes(self) -> int:
        return self._max_bytes

    def launch_for(self, x: torch.Tensor) -> LaunchParams:
        nbytes = x.numel() * x.element_size()
        if self.fixed_launch is not None:
            p = self.fixed_launch
        elif self.tuning is not None and self.tuning.nvrar_launch(nbytes, x.dtype, self.topology) is not None:
            p = self.tuning.nvrar_launch(nbytes, x.dtype, self.topology)
        else:
            p = default_launch(nbytes, self.topology, self.one_shot_max_bytes)
        if p.one_shot and (self.topology.ranks_per_node == 1 or nbytes > self.one_shot_max_bytes):
            p = replace(p, one_shot=False)
        return p

    def algorithm_for(self, x: torch.Tensor) -> str:
        return f"nvrar[{self.launch_for(x).short()}]"

    def _all_reduce_(self, x: torch.Tensor) -> None:
        if x.device != self.device:
            raise AllReduceInputError(
                f"nvrar: tensor on {x.device}, communicator on {self.device}; move it with .to({self.device})"
            )
        p = self.launch_for(x)
        n = x.numel()
        g = self.topology.ranks_per_node
        cells = -(-n // elements_per_cell(x.dtype))
        shard = cells if (p.one_shot or g == 1) else -(-cells // g)
        grid = (max(1, min(p.num_blocks, -(-shard // p.block))),)
        self._last_grid = grid[0]
        args, constexprs = self.kernel_arguments(x, p, n, shard)
        self._kernel.nvrar_kernel[grid](*args, **constexprs)

    def kernel_arguments(self, x, p: LaunchParams, n: int, shard: int) -> tuple[list, dict]:
        """Positional arguments and constexpr keywords (num_warps included) of one kernel launch on `x`
        (a tensor, or just its dtype for `spanllm.comm.nvrar.compile`, which compiles ahead of time from
        exactly these)."""
        dtype = x if isinstance(x, torch.dtype) else x.dtype
        L = self.layout
        args = [
            x,
            self.ws,
            self.peer_ptrs,
            self.round_send_pe,
            self.round_recv_peer,
            self.round_recv_op,
            self.seq,
            self.ticket,
            self.err,
            self.trace,
            n,
            shard,
            self.rank,
            self.topology.local_rank(self.rank),
            self.node_first_rank,
            int(self.timeout_s * 1e9),
            L.parity_cells,
            *L.offsets(p.protocol),
            L.flags,
            L.max_tiles,
        ]
        constexprs = dict(
            G=self.topology.ranks_per_node,
            R=len(self.rounds),
            E=elements_per_cell(dtype),
            ONE_SHOT=p.one_shot,
            BLOCK=p.block,
            PROTO=PROTOCOLS.index(p.protocol),
            TRACE=int(self.trace_enabled),
            PIPE=int(p.pipelined),
            num_warps=p.num_warps,
        )
        return args, constexprs

    def last_trace(self) -> list[list[int]]:
        """The phase-trace records of the last call's programs (synchronizes). Needs trace=True."""
        if not self.trace_enabled:
            raise AllReduceInputError(
                "nvrar: this communicator was built without trace=True; build one with "
                "registry.create('nvrar', ..., trace=True) to read phase traces"
            )
        self.synchronize()
        return self.trace[: self._last_grid].tolist()

    # ---- errors ---------------------------------------------------------------------------------

    def error(self) -> str | None:
        """The device-side error record as a sentence, or None. Readable even after the context died."""
        rec = self.err.tolist()
        if not rec[0]:
            return None
        from spanllm.comm.nvrar.kernel import PHASE_NAMES

        _, rank, phase, step, peer, seq, prog, waited = rec
        what = {1: f"local slot {step}", 2: f"inter-node round {step}", 3: f"local slot {step}"}.get(
            phase, f"step {step}"
        )
        return (
            f"nvrar timeout on rank {rank}: {PHASE_NAMES.get(phase, phase)}, {what}, waiting for peer rank {peer}, "
            f"call #{seq} (program {prog}), after {waited / 1e9:.3f} s (timeout {self.timeout_s} s). The peer did "
            "not issue the same call: every rank must make the same sequence of all-reduce calls"
        )

    def check_error(self) -> None:
        msg = self.error()
        if msg:
            raise AllReduceError(msg)

    def synchronize(self) -> None:
        """torch.cuda.synchronize that turns a kernel trap into the recorded error."""
        try:
            torch.cuda.synchronize(self.device)
        except RuntimeError as e:
            msg = self.error()
            if msg:
                raise AllReduceError(msg) from e
            raise
        self.check_error()

    def describe(self) -> dict:
        return {
            "layout": asdict(self.layout),
            "workspace_MiB": self.layout.total_bytes / 2**20,
            "rounds": [asdict(r) for r in self.rounds],
            "timeout_s": self.timeout_s,
        }

    def close(self) -> None:
        if not self.closed:
            self.ws = self.handle = None
        super().close()
