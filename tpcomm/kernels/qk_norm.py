"""Full-width QK RMSNorm: the mean of squares of q and of k summed over the ranks, then each rank's columns
normalised, in one launch.

Problem: MiniMax-M2 normalises the query and key projections with an RMSNorm over their full width (all
heads), ``q_out = q * rsqrt(mean(q^2 over Nq columns) + eps) * w_q`` (and the same for ``k``). Under tensor
parallelism rank ``r`` holds ``Nq / W`` columns of ``q`` and ``Nk / W`` of ``k``, so the mean needs a sum over
the ranks: per token, two float32 partial sums of squares (8 bytes), all that crosses the ranks.

Algorithm: program ``p`` owns blocks ``p, p + G, ...`` of ``ROWS`` rows (one row on a GPU; more under the
interpreter, whose cost is per operation). Pass 1: for each of its rows it sums the squares of its ``q``
columns and of its ``k`` columns in the fixed order of the fused norm (lanes of ``dispatch.row_config``'s
tile, then by pairs, ``epilogue.tree_sum``), and stores the two float32 sums into slot ``rank`` of every
rank's Lamport buffer, its own included. Then its call tag (below). Pass 2, per block: it waits until every
peer's words of those rows have landed, sums the ranks' partial sums in rank order in float32 from +0.0
(the all-reduce's additions, so the total is the same bits on every rank), re-arms the words, and
normalises its rows of ``q`` and ``k`` (read again) with the fused norm's operations and order
(``epilogue.rms_inverse``, ``epilogue.weight_first``) over the full widths ``W * Nq / W`` and ``W * Nk / W``.

Replicated k (``kv_replicas = R > 1``, more ranks than key-value heads): ranks ``g * R .. g * R + R - 1``
hold the same ``k`` columns, so the full k width is ``W / R`` shards. Only the first rank of each group
stores its k sum; the others store +0.0, and the width is ``HK * W / R``. Adding +0.0 to a float32 sum that
is never negative (+0.0, positive, +Inf or NaN) leaves its bits as they are (IEEE 754, round to nearest), so
the rank-order total is the one over the ``W / R`` distinct shards, the same bits as a group without
replication (docs/numerics.md, "Full-width QK norm"). The words stay never negative, so never the sentinel.
``kv_replicas`` is part of the call's signature (the host path's), so a peer with another value mismatches.

Sync protocol: Lamport, the data is its own flag. The Lamport buffers are armed with the word
0x80008000 (two 16-bit sentinels, ``spin.SENTINEL_WORD``), which as a float32 is a negative subnormal; a
sum of squares is +0.0, positive, +Inf or NaN (exponent all ones), never negative, so no pushed word has
the sentinel's bits and a word is checked whole (a 32-bit store does not tear). The words are re-armed
with the same pattern, so the buffers stay as the 16-bit Lamport kernels expect them. Call tags as in
``lamport.py`` (``spin.tag_value``: ``signature << 32 | 2 * epoch + 1``, into ``[parity][program][sender]``
of each peer after the program's data): a tag of this epoch with another signature (another op, width,
dtype, token count or eps) is ``ERR_MISMATCH``. The wait is ``spin.wait_peer``, the block-wide poll
``lamport._poll_tile`` runs (volatile loads, bounded by the timeout, abort word and grace). Buffers
alternate by epoch parity, with ``lamport.py``'s argument for why two are enough. The grid depends only
on the token count and the agreed grid cap, never on the widths, so a peer with another width runs the
same programs and every program sees the mismatch.

Buffers: word ``2 * row + j`` (``j`` 0: q, 1: k) of slot ``r`` of a rank's Lamport buffer holds rank
``r``'s partial sums of ``row``; a launch carries ``lamport_slot_bytes / 8`` rows.

When it wins: against the unfused path (an all-reduce of the ``(T, 2)`` float32 sums between the norm's
two halves: three launches and a round trip through memory), always; ``benchmarks/qk_norm_loopback.py``
measures both.
"""

import triton
import triton.language as tl

from .epilogue import rms_inverse, round_to, tree_sum, weight_first
from .launch import KernelCall
from .quant import widen
from .spin import SENTINEL_WORD, tag_value, wait_peer
from .sync import (
    base_ptr,
    check_abort,
    finish_program,
    grace_ns,
    launch_timeout,
    own_ptr,
    release_next,
    table_bases,
    take_ticket,
    wait_previous,
)

#: Rows a program takes at once under the interpreter (at most): its cost is per tile operation.
INTERPRETED_ROWS = 64


@triton.jit
def _rows_pairwise_sum(x):
    """Each row of ``x`` ``[R, B]`` (``B`` a power of two) summed by pairs, ``((x0 + x1) + (x2 + x3)) +
    ...``: :func:`epilogue.tree_sum`'s additions, row by row. Returns ``[R]``."""
    for _ in tl.static_range(14):  # up to 2**14 lanes
        if x.shape[1] > 1:
            x = tl.sum(tl.reshape(x, (x.shape[0], x.shape[1] // 2, 2)), axis=2)
    return tl.reshape(x, (x.shape[0],))


@triton.jit
def _squares(x_ptr, x_stride, rows, row_mask, H, ROWS: tl.constexpr, BLOCK: tl.constexpr, TILES: tl.constexpr):
    """This rank's sum of squares of rows ``rows`` (``[ROWS]``) of ``x`` (``H`` columns, unit column stride,
    ``x_stride`` between rows), float32 ``[ROWS]``: lane ``i`` adds ``f32(x[t * BLOCK + i])^2`` over the tiles
    from +0.0, then the lanes by pairs (``reference.sum_of_squares``)."""
    cols = tl.arange(0, BLOCK)
    offs = rows.to(tl.int64)[:, None] * x_stride
    acc = tl.zeros([ROWS, BLOCK], dtype=tl.float32)
    for t in tl.static_range(TILES):
        c = t * BLOCK + cols
        v = widen(tl.load(x_ptr + offs + c[None, :], mask=row_mask[:, None] & (c < H)[None, :], other=0.0))
        acc += v * v
    if ROWS == 1:
        return tl.zeros([1], dtype=tl.float32) + tree_sum(tl.reshape(acc, [BLOCK]))  # a sum is never -0.0
    else:
        return _rows_pairwise_sum(acc)


@triton.jit
def _norm_rows(x_ptr, x_stride, w_ptr, o_ptr, o_stride, rows, row_mask, H, total, width, eps,
               ROWS: tl.constexpr, BLOCK: tl.constexpr, TILES: tl.constexpr, IN_PLACE: tl.constexpr):
    """``out = T((v * inv) * w')`` (16-bit outputs with a finite non-zero ``inv``: ``T((v * w') * inv)``,
    ``epilogue.weight_first``) for rows ``rows`` of ``x``, ``inv = 1 / sqrt(total / width + eps)``
    (``total``: the rows' sums over every rank, ``[ROWS]``). ``IN_PLACE``: ``o_ptr`` is ``x_ptr``, so
    every thread has read its tile before any writes it."""
    DTYPE: tl.constexpr = o_ptr.dtype.element_ty
    inv = rms_inverse(total, width, eps)
    first = weight_first(inv, DTYPE)
    cols = tl.arange(0, BLOCK)
    r = rows.to(tl.int64)[:, None]
    for t in tl.static_range(TILES):
        c = t * BLOCK + cols
        cmask = c < H
        mask = row_mask[:, None] & cmask[None, :]
        v = widen(tl.load(x_ptr + r * x_stride + c[None, :], mask=mask, other=0.0))
        w = widen(tl.load(w_ptr + c, mask=cmask, other=0.0))[None, :]
        y = (v * inv[:, None]) * w
        if DTYPE.primitive_bitwidth == 16:
            y = tl.where(first[:, None], (v * w) * inv[:, None], y)
        if IN_PLACE:
            tl.debug_barrier()
        tl.store(o_ptr + r * o_stride + c[None, :], round_to(y, DTYPE), mask=mask)


@triton.jit(do_not_specialize=["rank", "kv_replicas"])  # one binary for every rank (tpcomm.loopback)
def _qk_norm_kernel(q_ptr, k_ptr, wq_ptr, wk_ptr, qo_ptr, ko_ptr, buf_table_ptr, state_ptr, err_ptr,
                    n_rows, HQ, HK, q_stride, k_stride, qo_stride, ko_stride, slot_stride, parity_stride,
                    eps, timeout, rank, signature, tag_off, max_programs, abort_off, kv_replicas,
                    WORLD: tl.constexpr, ROWS: tl.constexpr, BLOCK_Q: tl.constexpr, TILES_Q: tl.constexpr,
                    BLOCK_K: tl.constexpr, TILES_K: tl.constexpr, IN_PLACE: tl.constexpr, PDL: tl.constexpr):
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    bases = table_bases(buf_table_ptr, WORLD)  # before the start atomic: their latencies overlap
    wait_previous(PDL)
    epoch, ticket, word = take_ticket(state_ptr)
    timeout = launch_timeout(word, timeout)
    alive = check_abort(state_ptr, word, rank, epoch, pid, signature, err_ptr, timeout, WORLD)
    timeout = tl.where(alive, timeout, 0)
    par = epoch & 1
    n_blocks = tl.cdiv(n_rows, ROWS)
    lanes = tl.arange(0, 2 * ROWS)  # word j of a block: row j // 2, q's sum (j even) or k's (j odd)

    # 1. This rank's partial sums of its rows into slot `rank` of every rank's buffer (its own too).
    for b in range(pid, n_blocks, num_programs):
        rows = b * ROWS + tl.arange(0, ROWS)
        row_mask = rows < n_rows
        sq = _squares(q_ptr, q_stride, rows, row_mask, HQ, ROWS, BLOCK_Q, TILES_Q)
        sk = _squares(k_ptr, k_stride, rows, row_mask, HK, ROWS, BLOCK_K, TILES_K)
        sk = tl.where(rank % kv_replicas == 0, sk, 0.0)  # a replica of k columns adds +0.0 (module docstring)
        words = tl.reshape(tl.join(sq, sk), [2 * ROWS]).to(tl.int32, bitcast=True)
        dst = par * parity_stride + rank * slot_stride + b * (2 * ROWS) + lanes
        wmask = b * ROWS + lanes // 2 < n_rows
        for q in tl.static_range(WORLD):
            tl.store(base_ptr(bases, buf_table_ptr, q, tl.int32, WORLD) + dst, words, mask=wmask)
    # ... and this program's call tag into each peer's tag [par][pid][rank]: not when a peer gave up on
    # this call (check_abort), so that no peer completes it.
    tag_idx = tag_off + (par * max_programs + pid) * WORLD
    tell_idx = tag_idx - pid * WORLD + rank  # a peer's tag of program 0 from this rank (a mismatch's tell)
    if alive:
        tag = tag_value(epoch, signature)
        for q in tl.static_range(WORLD):
            if q != rank:
                tl.store(base_ptr(bases, buf_table_ptr, q, tl.int64, WORLD) + tag_idx + rank, tag)
    tl.debug_barrier()  # this rank's own words, stored by any thread, are read below

    # 2. Per block: wait for every peer's words, sum in rank order, re-arm, normalise.
    tags = own_ptr(bases, buf_table_ptr, rank, tl.int64, WORLD) + tag_idx
    recv = own_ptr(bases, buf_table_ptr, rank, tl.int32, WORLD) + par * parity_stride
    for b in range(pid, n_blocks, num_programs):
        rows = b * ROWS + tl.arange(0, ROWS)
        row_mask = rows < n_rows
        at = b * (2 * ROWS) + lanes
        wmask = b * ROWS + lanes // 2 < n_rows
        acc = tl.zeros([2 * ROWS], dtype=tl.float32)
        for q in tl.static_range(WORLD):
            if q == rank:
                acc += tl.load(recv + q * slot_stride + at, mask=wmask, other=0).to(tl.float32, bitcast=True)
            else:
                timeout, got = wait_peer(recv + q * slot_stride + at, wmask, tags + q, q, rank, epoch, pid,
                                         signature, timeout, timeout + grace_ns(timeout), err_ptr, state_ptr,
                                         buf_table_ptr, abort_off, tell_idx, max_programs, SENTINEL_WORD, WORLD)
                acc += got.to(tl.float32, bitcast=True)
        if b == pid:  # the first wait has ended: every peer's programs of this call have started
            release_next(PDL)
        tl.debug_barrier()  # every thread has loaded the words before any re-arms them
        for q in tl.static_range(WORLD):
            tl.store(recv + q * slot_stride + at, tl.full([2 * ROWS], SENTINEL_WORD, tl.int32), mask=wmask)
        total_q, total_k = tl.split(tl.reshape(acc, [ROWS, 2]))
        _norm_rows(q_ptr, q_stride, wq_ptr, qo_ptr, qo_stride, rows, row_mask, HQ, total_q, HQ * WORLD, eps,
                   ROWS, BLOCK_Q, TILES_Q, IN_PLACE)
        _norm_rows(k_ptr, k_stride, wk_ptr, ko_ptr, ko_stride, rows, row_mask, HK, total_k,
                   HK * WORLD // kv_replicas, eps, ROWS, BLOCK_K, TILES_K, IN_PLACE)

    finish_program(state_ptr, epoch, ticket, num_programs)


def rows_per_block(n_rows: int, max_programs: int, interpreted: bool) -> int:
    """Rows a program takes at once: 1 on a GPU (a decode token per program); under the interpreter
    enough that the grid cap covers the call, a power of two up to ``INTERPRETED_ROWS``. Depends only on
    what every rank agrees on (the token count, the grid cap), so every rank runs the same grid."""
    if not interpreted or n_rows <= max_programs:
        return 1
    per = -(-n_rows // max_programs)
    return min(INTERPRETED_ROWS, 1 << (per - 1).bit_length())


def qk_norm_call(q, k, q_weight, k_weight, q_out, k_out, ws, eps: float, signature: int, in_place: bool,
                 cfg_q, cfg_k, rows: int, kv_replicas: int = 1) -> KernelCall:
    """The launch of the QK-norm kernel on every row of ``q`` ``(n, Hq)`` and ``k`` ``(n, Hk)`` (unit column
    stride, any row stride), writing ``q_out`` and ``k_out`` (the same shapes, unit column stride).

    ``ws``: the :class:`~tpcomm.workspace.Workspace`; ``n`` rows must fit one Lamport slot
    (``lamport_slot_bytes // 8``). ``cfg_q``, ``cfg_k``: :func:`tpcomm.dispatch.row_config` of each width;
    ``rows``: :func:`rows_per_block`. ``in_place``: the outputs are the inputs themselves. ``kv_replicas``:
    the ranks of a group holding the same ``k`` columns (a divisor of the world size, checked by the caller).
    """
    n_rows = q.shape[0]
    if n_rows < 1:  # a program without rows would send its call tags and wait for none
        raise ValueError(f"qk_norm: rows must be >= 1, got {n_rows}")
    slot = ws.lamport_slot_bytes // 4  # int32 words
    grid = min(-(-n_rows // rows), ws.max_programs)
    return KernelCall(_qk_norm_kernel, grid, (
        q, k, q_weight, k_weight, q_out, k_out, ws.lamport_table, ws.state, ws.err,
        n_rows, q.shape[1], k.shape[1], q.stride(0), k.stride(0), q_out.stride(0), k_out.stride(0),
        slot, ws.world_size * slot,
        eps, ws.timeout, ws.rank, signature, ws.tag_offset(), ws.max_programs, ws.abort_offset("lamport"),
        kv_replicas,
    ), dict(
        WORLD=ws.world_size, ROWS=rows, BLOCK_Q=cfg_q.block_h, TILES_Q=cfg_q.num_tiles, BLOCK_K=cfg_k.block_h,
        TILES_K=cfg_k.num_tiles, IN_PLACE=in_place, num_warps=max(cfg_q.num_warps, cfg_k.num_warps),
        enable_fp_fusion=False, **ws.launch_options(),
    ))
