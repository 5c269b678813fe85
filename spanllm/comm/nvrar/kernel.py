"""The NVRAR all-reduce as ONE Triton kernel: intra-node reduce-scatter -> inter-node recursive
doubling -> intra-node all-gather, with LL8 cells and no barriers.

Importing this module imports triton; `spanllm.comm.nvrar.allreduce` imports it only when a GPU backend is built.

LL8 cells
    Every message travels as 8-byte cells: the low 32 bits carry data (two 16-bit elements or one
    32-bit element), the high 32 bits the call's sequence number. A cell is written with one 64-bit
    store (or one 64-bit word of a put), which is never torn, so a reader that sees the current
    sequence number in a cell also sees that cell's data: data and "ready" arrive together, and no
    fence, flag or barrier is needed between writer and reader. The price is 2x bytes on the wire.

SIMPLE protocol (PROTO=1, for larger messages)
    Raw data (4 bytes per cell, half of LL8's wire bytes) and one 64-bit flag word per tile and source:
    the writer stores the tile, synchronises the CTA and releases the flag at system scope; over
    NVSHMEM it is one putmem_signal_nbi_block, whose signal NVSHMEM delivers after the data. The
    reader spins on the flag, fences (acq_rel, system scope) and reads the data from L2 (.cg). Same
    parity double buffering and sequence numbers as LL8. Chosen per size by the tuning table.

Independent tiles
    The shard each rank reduces is cut into tiles of BLOCK cells; a program (CTA) carries its tiles
    through all three phases on its own. Every cross-rank dependency of a tile is between the programs
    that own the same tile on the ranks involved, so programs never wait for each other and no
    grid-wide synchronisation exists.
    Tile-major (default) takes one tile through every phase before the next tile; phase-major (PIPE=1)
    takes all of the program's tiles through one phase before the next, so a program with several tiles
    overlaps their flag round trips instead of paying one after another. Partial sums then wait in x
    (rounded to the wire dtype where tile-major rounds them: same result bitwise).

Buffer reuse without acknowledgements
    Receive slots are double-buffered by the parity of the sequence number. A rank writes call s+2
    into a peer's parity-(s mod 2) slot only after its own call s+1 finished, which needed every
    rank's call-(s+1) contribution, which each rank produced only after its call-s kernel finished
    (kernels on one stream run in order). So the slot being overwritten was already consumed. The
    same argument covers the nbi-put staging buffers: call s's puts were delivered before the peer
    could finish call s. This requires that every rank issues the same sequence of calls on one
    stream, which is the contract of any collective.

Sequence number
    A per-communicator int32 in device memory: every program reads it at start (s = seq + 1); the
    last program to finish (a ticket counter) writes s back. All reads happen before any program
    takes its ticket, so they all see the same value. It never touches the host, so a call captures
    into a CUDA graph and each replay advances it. It wraps after 2^32 calls; stale cells then hold
    s - 2, never s, and the zero-initialised buffers only matter for the first two calls.

Phase trace (TRACE=1, off by default)
    Each program accumulates %clock64 cycles per phase over its tiles -- issuing the intra-node pushes,
    waiting for the intra-node tiles, staging + putting inter-node, waiting inter-node, pushing and
    waiting in the all-gather -- and writes them with its %globaltimer start and end into
    trace[program] (layout and summary: `spanllm.comm.nvrar.trace`). "Push" is the time to issue the
    stores, "wait" includes the peer's skew and the link latency.

Timeouts
    Every wait polls with a deadline read from %globaltimer. On expiry the program writes
    (code, rank, phase, step, peer, seq) into a host-mapped record and traps: the stream is dead, the
    host reads the record and raises an error naming them. No wait can spin forever and no program
    continues with data it did not receive.
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch.distributed._symmetric_memory._nvshmem_triton import requires_nvshmem
from triton.language import core

from spanllm.comm.nvrar.trace import TRACE_WORDS

PHASE_REDUCE_SCATTER = 1
PHASE_INTER_NODE = 2
PHASE_ALL_GATHER = 3
PHASE_NAMES = {
    PHASE_REDUCE_SCATTER: "intra-node reduce-scatter",
    PHASE_INTER_NODE: "inter-node recursive doubling",
    PHASE_ALL_GATHER: "intra-node all-gather",
}
ERR_RECORD_LEN = 8  # int64 words: [code, rank, phase, step, peer, seq, program, waited_ns]
ERR_TIMEOUT = 1
# Phase trace record per program: layout in spanllm.comm.nvrar.trace.
_TRACE_LEN = tl.constexpr(TRACE_WORDS)  # the same, as the kernel sees it
# nvshmemx_signal_op_t in NVSHMEM 3.x (device_host_transport/nvshmem_common_transport.h):
# NVSHMEM_SIGNAL_SET = 9, NVSHMEM_SIGNAL_ADD = 10. (torch's _nvshmem_triton docstrings say 0 and 5; with
# 0 a P2P peer falls through to atomicAdd_system, so flags accumulate and the third call times out --
# found on the GPU.)
NVSHMEM_SIGNAL_SET = tl.constexpr(9)


@core.extern
def _putmem_nbi_block(dest, source, size_bytes, pe, _semantic=None):
    """nvshmemx_putmem_nbi_block: the whole CTA copies `size_bytes` to PE `pe`'s symmetric `dest`.

    `dest` is this PE's address of the symmetric buffer (the same offset on every PE); NVSHMEM picks
    the transport (NVLink stores for P2P peers, RDMA for remote nodes). Non-blocking: completion is
    implied by the protocol (see module docstring), not by a quiet.
    """
    return core.extern_elementwise(
        "",
        "",
        [dest, source, size_bytes, pe],
        {
            (core.dtype("int64"), core.dtype("int64"), core.dtype("int64"), core.dtype("int32")): (
                "nvshmemx_putmem_nbi_block",
                core.dtype("int32"),
            )
        },
        is_pure=False,
        _semantic=_semantic,
    )


@core.extern
def _putmem_signal_nbi_block(dest, source, size_bytes, sig_addr, signal, sig_op, pe, _semantic=None):
    """nvshmemx_putmem_signal_nbi_block: like the put, then sets the 64-bit word `sig_addr` on PE `pe` to
    `signal` (sig_op NVSHMEM_SIGNAL_SET) once the data is delivered: NVSHMEM orders the signal after
    the data, so a reader that sees the signal may read the data."""
    return core.extern_elementwise(
        "",
        "",
        [dest, source, size_bytes, sig_addr, signal, sig_op, pe],
        {
            (
                core.dtype("int64"),
                core.dtype("int64"),
                core.dtype("int64"),
                core.dtype("int64"),
                core.dtype("uint64"),
                core.dtype("int32"),
                core.dtype("int32"),
            ): ("nvshmemx_putmem_signal_nbi_block", core.dtype("int32"))
        },
        is_pure=False,
        _semantic=_semantic,
    )


@core.extern
def _my_pe(_semantic=None):
    """nvshmem_my_pe. Every kernel calls it so that its module always references NVSHMEM's device state:
    torch initialises each compiled module for NVSHMEM and fails on one that never uses it (R=0)."""
    return core.extern_elementwise(
        "", "", [], {(): ("nvshmem_my_pe", core.dtype("int32"))}, is_pure=False, _semantic=_semantic
    )


@triton.jit
def _globaltimer_ns():
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def _stamp(TRACE: tl.constexpr):
    """%clock64 of this SM when tracing, else 0 (compiled out). Cycle deltas inside one program only."""
    if TRACE:
        return tl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)
    else:
        return tl.full([], 0, tl.int64)


@triton.jit
def _trap():
    # membar.sys first so the error record written just before is visible to the host.
    tl.inline_asm_elementwise("membar.sys; trap; mov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _fence_acq_rel_sys():
    tl.inline_asm_elementwise("fence.acq_rel.sys; mov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _load_elems(x_ptr, cells, cell_mask, n, E: tl.constexpr):
    """Elements of the given cells as a [BLOCK, E] tile (zeros past n and outside cell_mask)."""
    offs = cells[:, None] * E + tl.arange(0, E)[None, :]
    return tl.load(x_ptr + offs, mask=(offs < n) & cell_mask[:, None], other=0)


@triton.jit
def _store_elems(x_ptr, cells, cell_mask, n, v, E: tl.constexpr):
    # cell_mask keeps a partial last tile of one shard from writing into the next shard's elements.
    offs = cells[:, None] * E + tl.arange(0, E)[None, :]
    tl.store(x_ptr + offs, v.to(x_ptr.dtype.element_ty), mask=(offs < n) & cell_mask[:, None])


@triton.jit
def _pack(v, flag, E: tl.constexpr, BLOCK: tl.constexpr):
    """[BLOCK, E] tile of 16-bit (E=2) or 32-bit (E=1) values -> [BLOCK] int64 cells tagged with `flag`."""
    if E == 2:
        lo, hi = tl.split(v)
        bits = lo.to(tl.uint16, bitcast=True).to(tl.int64) | (hi.to(tl.uint16, bitcast=True).to(tl.int64) << 16)
    else:
        bits = tl.reshape(v, [BLOCK]).to(tl.uint32, bitcast=True).to(tl.int64)
    return bits | (flag << 32)


@triton.jit
def _unpack(cells, DT: tl.constexpr, E: tl.constexpr, BLOCK: tl.constexpr):
    """[BLOCK] int64 cells -> [BLOCK, E] tile of DT."""
    if E == 2:
        lo = (cells & 0xFFFF).to(tl.uint16).to(DT, bitcast=True)
        hi = ((cells >> 16) & 0xFFFF).to(tl.uint16).to(DT, bitcast=True)
        return tl.join(lo, hi)
    else:
        return tl.reshape((cells & 0xFFFFFFFF).to(tl.uint32).to(DT, bitcast=True), [BLOCK, 1])


@triton.jit
def _report_timeout(err_ptr, rank, phase, step, peer, seq, waited_ns):
    tl.store(err_ptr + 1, rank)
    tl.store(err_ptr + 2, phase)
    tl.store(err_ptr + 3, step)
    tl.store(err_ptr + 4, peer)
    tl.store(err_ptr + 5, seq)
    tl.store(err_ptr + 6, tl.program_id(0))
    tl.store(err_ptr + 7, waited_ns)
    tl.store(err_ptr + 0, 1)
    _trap()


@triton.jit
def _wait_flag(flag_ptr, flag, deadline, err_ptr, rank, phase, step, peer, seq, t0):
    """SIMPLE protocol: spin until the 64-bit flag word equals `flag`, then acquire (system scope)."""
    f = tl.load(flag_ptr, volatile=True)
    now = _globaltimer_ns()
    while (f != flag) & (now < deadline):
        f = tl.load(flag_ptr, volatile=True)
        now = _globaltimer_ns()
    if f != flag:
        _report_timeout(err_ptr, rank, phase, step, peer, seq, now - t0)
    # Every thread fences after seeing the flag, so its data loads cannot be ordered before it; the
    # writer released the flag after its data stores (or NVSHMEM signalled after delivering the data).
    _fence_acq_rel_sys()


@triton.jit
def _wait_cells(ptr, mask, flag, deadline, err_ptr, rank, phase, step, peer, seq, t0):
    """Spin until every masked cell at `ptr` carries `flag`; return the cells. Traps on the deadline."""
    cells = tl.load(ptr, mask=mask, other=0, volatile=True)
    pending = tl.sum(((((cells >> 32) & 0xFFFFFFFF) != flag) & mask).to(tl.int32), axis=0)
    now = _globaltimer_ns()
    while (pending > 0) & (now < deadline):
        cells = tl.load(ptr, mask=mask, other=0, volatile=True)
        pending = tl.sum(((((cells >> 32) & 0xFFFFFFFF) != flag) & mask).to(tl.int32), axis=0)
        now = _globaltimer_ns()
    if pending > 0:
        _report_timeout(err_ptr, rank, phase, step, peer, seq, now - t0)
    return cells


@triton.jit
def _push(slot_ptr, flag_ptr, c, cm, v, flag, E: tl.constexpr, BLOCK: tl.constexpr, PROTO: tl.constexpr):
    """Write one tile `v` ([BLOCK, E] in the wire dtype) into a peer's slot through its mapped pointer.

    LL8 (PROTO 0): tagged cells, nothing else to do. SIMPLE (PROTO 1): raw elements (half the bytes),
    then, after the whole CTA's stores, one system-scope release of the tile's flag word."""
    if PROTO == 0:
        tl.store(slot_ptr + c, _pack(v, flag, E, BLOCK), mask=cm)
    else:
        # Raw data: cell c's 4 data bytes as 32-bit word c of the slot (the low half of its LL8 cell).
        words = slot_ptr.to(tl.pointer_type(tl.int32))
        tl.store(words + c, _pack(v, 0, E, BLOCK).to(tl.int32), mask=cm)
        tl.debug_barrier()  # the whole CTA's stores precede the flag (bar.sync, then a system-scope release)
        tl.atomic_xchg(flag_ptr, flag, sem="release", scope="sys")


@triton.jit
def _pull(
    slot_ptr,
    flag_ptr,
    c,
    cm,
    flag,
    deadline,
    err_ptr,
    rank,
    phase,
    step,
    peer,
    seq,
    t0,
    DT: tl.constexpr,
    E: tl.constexpr,
    BLOCK: tl.constexpr,
    PROTO: tl.constexpr,
):
    """Wait for one tile in my own slot and return it as [BLOCK, E] of DT."""
    if PROTO == 0:
        cells = _wait_cells(slot_ptr + c, cm, flag, deadline, err_ptr, rank, phase, step, peer, seq, t0)
        return _unpack(cells, DT, E, BLOCK)
    else:
        _wait_flag(flag_ptr, flag, deadline, err_ptr, rank, phase, step, peer, seq, t0)
        words = slot_ptr.to(tl.pointer_type(tl.int32))
        # .cg: L2, never a stale L1 line from the call that used this parity two calls ago.
        w = tl.load(words + c, mask=cm, other=0, cache_modifier=".cg")
        return _unpack(w.to(tl.int64) & 0xFFFFFFFF, DT, E, BLOCK)


@triton.jit
def _rs_push(
    x_ptr,
    peer_ws_ptr,
    intra_off,
    SLOT,
    flags_off,
    MAX_TILES,
    tile,
    c,
    cm,
    n,
    S,
    local_rank,
    flag,
    G: tl.constexpr,
    E: tl.constexpr,
    BLOCK: tl.constexpr,
    PROTO: tl.constexpr,
    ONE_SHOT: tl.constexpr,
):
    """Reduce-scatter, sending side: my elements of tile `tile` of every other local rank's shard (the whole
    message in one-shot mode) into that rank's receive slot for me."""
    for j in tl.static_range(G):
        if j != local_rank:
            if ONE_SHOT:
                base_j = 0
            else:
                base_j = j * S
            v = _load_elems(x_ptr, base_j + c, cm, n, E)
            peer = tl.load(peer_ws_ptr + j).to(tl.pointer_type(tl.int64))
            _push(
                peer + intra_off + local_rank * SLOT,
                peer + flags_off + local_rank * MAX_TILES + tile,
                c,
                cm,
                v,
                flag,
                E,
                BLOCK,
                PROTO,
            )


@triton.jit
def _rs_reduce(
    acc,
    x_ptr,
    ws_ptr,
    intra_off,
    SLOT,
    flags_off,
    MAX_TILES,
    tile,
    c,
    cm,
    n,
    my_base,
    local_rank,
    node_first_rank,
    flag,
    deadline,
    err_ptr,
    rank,
    seq,
    t0,
    DT: tl.constexpr,
    G: tl.constexpr,
    E: tl.constexpr,
    BLOCK: tl.constexpr,
    PROTO: tl.constexpr,
):
    """Reduce-scatter, receiving side: acc + every local rank's tile of my shard, in local-rank order (the
    same order on every rank, so the sum is deterministic)."""
    for j in tl.static_range(G):
        if j == local_rank:
            acc += _load_elems(x_ptr, my_base + c, cm, n, E).to(acc.dtype)
        else:
            v = _pull(
                ws_ptr + intra_off + j * SLOT,
                ws_ptr + flags_off + j * MAX_TILES + tile,
                c,
                cm,
                flag,
                deadline,
                err_ptr,
                rank,
                1,
                j,
                node_first_rank + j,
                seq,
                t0,
                DT,
                E,
                BLOCK,
                PROTO,
            )
            acc += v.to(acc.dtype)
    return acc


@triton.jit
def _inter_send(
    acc,
    ws_ptr,
    ws_addr,
    par,
    INTER_OFF,
    STAGE_OFF,
    SLOT,
    r,
    flag_word,
    tile,
    c,
    cm,
    S,
    send_pe,
    flag,
    DT: tl.constexpr,
    E: tl.constexpr,
    BLOCK: tl.constexpr,
    PROTO: tl.constexpr,
):
    """Inter-node round r, sending side: stage the tile locally (LL8 cells or raw), then one block-wide
    NVSHMEM put of it into the partner's round-r slot (SIMPLE: put with signal on the tile's flag word)."""
    first = tile.to(tl.int64) * BLOCK  # int64: byte offsets below exceed 2^31 for big shards
    ncells = tl.minimum(S - first, BLOCK).to(tl.int64)
    off_bytes = (par + INTER_OFF + r * SLOT) * 8
    src_bytes = (par + STAGE_OFF + r * SLOT) * 8
    if PROTO == 0:
        tl.store(ws_ptr + par + STAGE_OFF + r * SLOT + c, _pack(acc.to(DT), flag, E, BLOCK), mask=cm)
        tl.debug_barrier()  # the whole CTA's staging stores precede the block-wide put
        _putmem_nbi_block(ws_addr + off_bytes + first * 8, ws_addr + src_bytes + first * 8, ncells * 8, send_pe)
    else:
        stage = (ws_ptr + par + STAGE_OFF + r * SLOT).to(tl.pointer_type(tl.int32))
        tl.store(stage + c, _pack(acc.to(DT), 0, E, BLOCK).to(tl.int32), mask=cm)
        tl.debug_barrier()
        # Raw data of cell c sits at bytes [4c, 4c + 4) of the slot.
        _putmem_signal_nbi_block(
            ws_addr + off_bytes + first * 4,
            ws_addr + src_bytes + first * 4,
            ncells * 4,
            ws_addr + flag_word * 8,
            flag.to(tl.uint64),
            NVSHMEM_SIGNAL_SET,
            send_pe,
        )


@triton.jit
def _inter_recv(
    acc,
    ws_ptr,
    slot_off,
    flag_word,
    round_recv_op,
    r,
    c,
    cm,
    recv_peer,
    flag,
    deadline,
    err_ptr,
    rank,
    seq,
    t0,
    DT: tl.constexpr,
    E: tl.constexpr,
    BLOCK: tl.constexpr,
    PROTO: tl.constexpr,
):
    """Inter-node round r, receiving side: the partner's tile, added to acc (or replacing it: the fold's
    last round)."""
    v = _pull(
        ws_ptr + slot_off,
        ws_ptr + flag_word,
        c,
        cm,
        flag,
        deadline,
        err_ptr,
        rank,
        2,
        r,
        recv_peer,
        seq,
        t0,
        DT,
        E,
        BLOCK,
        PROTO,
    ).to(acc.dtype)
    if tl.load(round_recv_op + r) == 0:
        acc = acc + v
    else:
        acc = v
    return acc


@triton.jit
def _ag_push(
    out,
    peer_ws_ptr,
    gather_off,
    SLOT,
    flags_off,
    MAX_TILES,
    tile,
    c,
    cm,
    local_rank,
    flag,
    G: tl.constexpr,
    R: tl.constexpr,
    E: tl.constexpr,
    BLOCK: tl.constexpr,
    PROTO: tl.constexpr,
):
    """All-gather, sending side: my reduced tile into every other local rank's gather slot for me."""
    for j in tl.static_range(G):
        if j != local_rank:
            peer = tl.load(peer_ws_ptr + j).to(tl.pointer_type(tl.int64))
            _push(
                peer + gather_off + local_rank * SLOT,
                peer + flags_off + (G + R + local_rank) * MAX_TILES + tile,
                c,
                cm,
                out,
                flag,
                E,
                BLOCK,
                PROTO,
            )


@triton.jit
def _ag_pull(
    x_ptr,
    ws_ptr,
    gather_off,
    SLOT,
    flags_off,
    MAX_TILES,
    tile,
    c,
    cm,
    n,
    S,
    local_rank,
    node_first_rank,
    flag,
    deadline,
    err_ptr,
    rank,
    seq,
    t0,
    DT: tl.constexpr,
    G: tl.constexpr,
    R: tl.constexpr,
    E: tl.constexpr,
    BLOCK: tl.constexpr,
    PROTO: tl.constexpr,
):
    """All-gather, receiving side: every other local rank's reduced tile into its place in x."""
    for j in tl.static_range(G):
        if j != local_rank:
            v = _pull(
                ws_ptr + gather_off + j * SLOT,
                ws_ptr + flags_off + (G + R + j) * MAX_TILES + tile,
                c,
                cm,
                flag,
                deadline,
                err_ptr,
                rank,
                3,
                j,
                node_first_rank + j,
                seq,
                t0,
                DT,
                E,
                BLOCK,
                PROTO,
            )
            _store_elems(x_ptr, j * S + c, cm, n, v, E)


@requires_nvshmem
@triton.jit(
    do_not_specialize=[
        "n",
        "S",
        "rank",
        "local_rank",
        "node_first_rank",
        "timeout_ns",
        "PARITY_CELLS",
        "INTRA_OFF",
        "INTER_OFF",
        "STAGE_OFF",
        "GATHER_OFF",
        "SLOT",
        "FLAG_OFF",
        "MAX_TILES",
    ]
)
def nvrar_kernel(
    x_ptr,  # the caller's tensor, reduced in place (local memory, any allocation)
    ws_ptr,  # int64 symmetric workspace of this rank (cells)
    peer_ws_ptr,  # int64[G]: every local peer's workspace, mapped for direct stores (P2P)
    round_send_pe,  # int32[R]: NVSHMEM PE I put to in inter round r, or -1
    round_recv_peer,  # int32[R]: group rank I receive from in inter round r, or -1
    round_recv_op,  # int32[R]: 0 = add what arrives, 1 = overwrite with it (fold's last round)
    seq_ptr,  # int32[1]: sequence number of the last finished call
    ticket_ptr,  # int32[1]: programs finished in the current call
    err_ptr,  # int64[ERR_RECORD_LEN], host-mapped error record
    trace_ptr,  # int64[programs, TRACE_WORDS] phase trace (read only when TRACE)
    n,  # elements in x
    S,  # cells each rank reduces (the shard; the whole message in one-shot mode)
    rank,
    local_rank,
    node_first_rank,
    timeout_ns: tl.int64,  # always i64: by value Triton would pick i32 below 2^31 ns and recompile on a change
    PARITY_CELLS,  # cells in one parity half of the workspace
    INTRA_OFF,
    INTER_OFF,
    STAGE_OFF,
    GATHER_OFF,  # region offsets (cells) inside a parity half
    SLOT,  # cells per slot (the largest S the workspace was sized for)
    FLAG_OFF,  # SIMPLE only: first cell of the per-tile flag words, [2 parities][2G+R regions][MAX_TILES]
    MAX_TILES,
    G: tl.constexpr,  # ranks per node
    R: tl.constexpr,  # inter-node rounds (recursive doubling + fold)
    E: tl.constexpr,  # elements per cell (LL8: per 4 data bytes): 2 for 16-bit dtypes, 1 for 32-bit
    ONE_SHOT: tl.constexpr,  # intra-node: every rank reduces the whole message (no all-gather)
    BLOCK: tl.constexpr,  # cells per tile
    PROTO: tl.constexpr,  # 0 = LL8 cells, 1 = SIMPLE (raw data + per-tile flag / NVSHMEM signal)
    TRACE: tl.constexpr = 0,  # 1 = write the per-program phase trace
    PIPE: tl.constexpr = 0,  # 1 = phase-major: all of a program's tiles through each phase in turn
):
    DT: tl.constexpr = x_ptr.dtype.element_ty
    if DT == tl.int32:
        ACC: tl.constexpr = tl.int32
    else:
        ACC: tl.constexpr = tl.float32
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    if _my_pe() < 0:  # never true; keeps the NVSHMEM reference (see _my_pe)
        tl.store(err_ptr, -1)
    seq = tl.load(seq_ptr) + 1
    flag = seq.to(tl.int64) & 0xFFFFFFFF
    t0 = _globaltimer_ns()
    c_start = _stamp(TRACE)
    rs_push = tl.full([], 0, tl.int64)
    rs_wait = tl.full([], 0, tl.int64)
    inter_send = tl.full([], 0, tl.int64)
    inter_wait = tl.full([], 0, tl.int64)
    ag_push = tl.full([], 0, tl.int64)
    ag_wait = tl.full([], 0, tl.int64)
    deadline = t0 + timeout_ns
    parity = (seq & 1).to(tl.int64)
    par = parity * PARITY_CELLS
    # SIMPLE flag words of this parity: region k (0..G-1 intra sources, G..G+R-1 inter rounds,
    # G+R..2G+R-1 gather sources), tile t -> flags + k * MAX_TILES + t.
    flags_off = FLAG_OFF + parity * (2 * G + R) * MAX_TILES
    ws_addr = ws_ptr.to(tl.int64)  # NVSHMEM wants this rank's address of the symmetric buffer
    if ONE_SHOT:
        my_base = 0
    else:
        my_base = local_rank * S
    n_tiles = tl.cdiv(S, BLOCK)
    if not PIPE:
        # Tile-major: each tile goes through every phase before the program takes its next tile.
        for tile in range(pid, n_tiles, nprog):
            c = tile * BLOCK + tl.arange(0, BLOCK)  # cell index inside the shard
            cm = c < S
            # ---- intra-node reduce-scatter (or one-shot exchange)
            acc = tl.zeros([BLOCK, E], dtype=ACC)
            if G > 1:
                c_a = _stamp(TRACE)
                _rs_push(
                    x_ptr,
                    peer_ws_ptr,
                    par + INTRA_OFF,
                    SLOT,
                    flags_off,
                    MAX_TILES,
                    tile,
                    c,
                    cm,
                    n,
                    S,
                    local_rank,
                    flag,
                    G,
                    E,
                    BLOCK,
                    PROTO,
                    ONE_SHOT,
                )
                c_b = _stamp(TRACE)
                rs_push += c_b - c_a
                acc = _rs_reduce(
                    acc,
                    x_ptr,
                    ws_ptr,
                    par + INTRA_OFF,
                    SLOT,
                    flags_off,
                    MAX_TILES,
                    tile,
                    c,
                    cm,
                    n,
                    my_base,
                    local_rank,
                    node_first_rank,
                    flag,
                    deadline,
                    err_ptr,
                    rank,
                    seq,
                    t0,
                    DT,
                    G,
                    E,
                    BLOCK,
                    PROTO,
                )
                rs_wait += _stamp(TRACE) - c_b
            else:
                acc += _load_elems(x_ptr, my_base + c, cm, n, E).to(ACC)
            # ---- inter-node recursive doubling on the shard, between ranks of the same local rank
            for r in tl.static_range(R):
                send_pe = tl.load(round_send_pe + r)
                recv_peer = tl.load(round_recv_peer + r)
                # Round to the wire dtype first so both partners add the same two values and agree bitwise.
                acc = acc.to(DT).to(ACC)
                flag_word = flags_off + (G + r) * MAX_TILES + tile
                c_a = _stamp(TRACE)
                if send_pe >= 0:
                    _inter_send(
                        acc,
                        ws_ptr,
                        ws_addr,
                        par,
                        INTER_OFF,
                        STAGE_OFF,
                        SLOT,
                        r,
                        flag_word,
                        tile,
                        c,
                        cm,
                        S,
                        send_pe,
                        flag,
                        DT,
                        E,
                        BLOCK,
                        PROTO,
                    )
                c_b = _stamp(TRACE)
                inter_send += c_b - c_a
                if recv_peer >= 0:
                    acc = _inter_recv(
                        acc,
                        ws_ptr,
                        par + INTER_OFF + r * SLOT,
                        flag_word,
                        round_recv_op,
                        r,
                        c,
                        cm,
                        recv_peer,
                        flag,
                        deadline,
                        err_ptr,
                        rank,
                        seq,
                        t0,
                        DT,
                        E,
                        BLOCK,
                        PROTO,
                    )
                inter_wait += _stamp(TRACE) - c_b
            out = acc.to(DT)
            _store_elems(x_ptr, my_base + c, cm, n, out, E)
            # ---- intra-node all-gather: push my reduced shard to each local peer, collect theirs
            if G > 1:
                if not ONE_SHOT:
                    c_a = _stamp(TRACE)
                    _ag_push(
                        out,
                        peer_ws_ptr,
                        par + GATHER_OFF,
                        SLOT,
                        flags_off,
                        MAX_TILES,
                        tile,
                        c,
                        cm,
                        local_rank,
                        flag,
                        G,
                        R,
                        E,
                        BLOCK,
                        PROTO,
                    )
                    c_b = _stamp(TRACE)
                    ag_push += c_b - c_a
                    _ag_pull(
                        x_ptr,
                        ws_ptr,
                        par + GATHER_OFF,
                        SLOT,
                        flags_off,
                        MAX_TILES,
                        tile,
                        c,
                        cm,
                        n,
                        S,
                        local_rank,
                        node_first_rank,
                        flag,
                        deadline,
                        err_ptr,
                        rank,
                        seq,
                        t0,
                        DT,
                        G,
                        R,
                        E,
                        BLOCK,
                        PROTO,
                    )
                    ag_wait += _stamp(TRACE) - c_b
    else:
        # Phase-major (PIPE): every tile of the program through one phase before the next phase, so the
        # program's flag round trips overlap instead of queueing one per tile. Partial sums wait in x
        # (this rank's shard), rounded to the wire dtype exactly where tile-major rounds them, so both
        # orders give bitwise the same result. The CTA barriers order one phase's stores to x before
        # the next phase's loads (different threads may own an element in the two phases).
        if G > 1:
            c_a = _stamp(TRACE)
            for tile in range(pid, n_tiles, nprog):
                c = tile * BLOCK + tl.arange(0, BLOCK)
                _rs_push(
                    x_ptr,
                    peer_ws_ptr,
                    par + INTRA_OFF,
                    SLOT,
                    flags_off,
                    MAX_TILES,
                    tile,
                    c,
                    c < S,
                    n,
                    S,
                    local_rank,
                    flag,
                    G,
                    E,
                    BLOCK,
                    PROTO,
                    ONE_SHOT,
                )
            c_b = _stamp(TRACE)
            rs_push += c_b - c_a
            for tile in range(pid, n_tiles, nprog):
                c = tile * BLOCK + tl.arange(0, BLOCK)
                cm = c < S
                acc = _rs_reduce(
                    tl.zeros([BLOCK, E], dtype=ACC),
                    x_ptr,
                    ws_ptr,
                    par + INTRA_OFF,
                    SLOT,
                    flags_off,
                    MAX_TILES,
                    tile,
                    c,
                    cm,
                    n,
                    my_base,
                    local_rank,
                    node_first_rank,
                    flag,
                    deadline,
                    err_ptr,
                    rank,
                    seq,
                    t0,
                    DT,
                    G,
                    E,
                    BLOCK,
                    PROTO,
                )
                _store_elems(x_ptr, my_base + c, cm, n, acc.to(DT), E)
            rs_wait += _stamp(TRACE) - c_b
            tl.debug_barrier()
        for r in tl.static_range(R):
            send_pe = tl.load(round_send_pe + r)
            recv_peer = tl.load(round_recv_peer + r)
            c_a = _stamp(TRACE)
            if send_pe >= 0:
                for tile in range(pid, n_tiles, nprog):
                    c = tile * BLOCK + tl.arange(0, BLOCK)
                    cm = c < S
                    acc = _load_elems(x_ptr, my_base + c, cm, n, E).to(ACC)
                    _inter_send(
                        acc,
                        ws_ptr,
                        ws_addr,
                        par,
                        INTER_OFF,
                        STAGE_OFF,
                        SLOT,
                        r,
                        flags_off + (G + r) * MAX_TILES + tile,
                        tile,
                        c,
                        cm,
                        S,
                        send_pe,
                        flag,
                        DT,
                        E,
                        BLOCK,
                        PROTO,
                    )
            c_b = _stamp(TRACE)
            inter_send += c_b - c_a
            if recv_peer >= 0:
                for tile in range(pid, n_tiles, nprog):
                    c = tile * BLOCK + tl.arange(0, BLOCK)
                    cm = c < S
                    acc = _load_elems(x_ptr, my_base + c, cm, n, E).to(ACC)
                    acc = _inter_recv(
                        acc,
                        ws_ptr,
                        par + INTER_OFF + r * SLOT,
                        flags_off + (G + r) * MAX_TILES + tile,
                        round_recv_op,
                        r,
                        c,
                        cm,
                        recv_peer,
                        flag,
                        deadline,
                        err_ptr,
                        rank,
                        seq,
                        t0,
                        DT,
                        E,
                        BLOCK,
                        PROTO,
                    )
                    _store_elems(x_ptr, my_base + c, cm, n, acc.to(DT), E)
            inter_wait += _stamp(TRACE) - c_b
            tl.debug_barrier()
        if G > 1:
            if not ONE_SHOT:
                c_a = _stamp(TRACE)
                for tile in range(pid, n_tiles, nprog):
                    c = tile * BLOCK + tl.arange(0, BLOCK)
                    cm = c < S
                    out = _load_elems(x_ptr, my_base + c, cm, n, E)
                    _ag_push(
                        out,
                        peer_ws_ptr,
                        par + GATHER_OFF,
                        SLOT,
                        flags_off,
                        MAX_TILES,
                        tile,
                        c,
                        cm,
                        local_rank,
                        flag,
                        G,
                        R,
                        E,
                        BLOCK,
                        PROTO,
                    )
                c_b = _stamp(TRACE)
                ag_push += c_b - c_a
                for tile in range(pid, n_tiles, nprog):
                    c = tile * BLOCK + tl.arange(0, BLOCK)
                    _ag_pull(
                        x_ptr,
                        ws_ptr,
                        par + GATHER_OFF,
                        SLOT,
                        flags_off,
                        MAX_TILES,
                        tile,
                        c,
                        c < S,
                        n,
                        S,
                        local_rank,
                        node_first_rank,
                        flag,
                        deadline,
                        err_ptr,
                        rank,
                        seq,
                        t0,
                        DT,
                        G,
                        R,
                        E,
                        BLOCK,
                        PROTO,
                    )
                ag_wait += _stamp(TRACE) - c_b

    if TRACE:
        rec = trace_ptr + pid * _TRACE_LEN
        tl.store(rec + 0, t0)
        tl.store(rec + 1, _globaltimer_ns())
        tl.store(rec + 2, _stamp(TRACE) - c_start)
        tl.store(rec + 3, rs_push)
        tl.store(rec + 4, rs_wait)
        tl.store(rec + 5, inter_send)
        tl.store(rec + 6, inter_wait)
        tl.store(rec + 7, ag_push)
        tl.store(rec + 8, ag_wait)

    # ---- ticket: the last program to finish publishes the new sequence number
    done = tl.atomic_add(ticket_ptr, 1)
    if done == nprog - 1:
        tl.store(ticket_ptr, 0)
        tl.store(seq_ptr, seq)
