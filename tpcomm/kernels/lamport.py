"""Lamport one-shot all-reduce, plain or fused with residual add + RMSNorm: the data is its own flag.

Problem: as ``one_shot.py``, for small 16-bit messages where one flag round trip (a release fence that
waits for the NVLink stores, then a remote flag write, then a poll) is most of the time.

Algorithm: receive buffers hold the sentinel bit pattern 0x8000 (-0.0 in bf16 and fp16) in every element.
Program ``p`` pushes its rows into slot ``rank`` of every peer's buffer, storing +0.0 wherever the input
holds -0.0 (the sum is unchanged: the contract's accumulator starts at +0.0), so no pushed element ever
has the sentinel's bits. It then polls its own buffer until no element of the row's tile holds the
sentinel, sums in rank order with the same additions as every other algorithm (so the bits are the same;
rows of one tile are summed from the tiles as the poll's last round loaded them, not read again), runs
``epilogue.py``'s epilogue and writes the sentinel back into what it read (re-arming the buffer).

Call tags: after its rows, each program stores the call's signature (as ``one_shot.py``'s flags carry it)
into an int32 tag of every peer, indexed by parity, program and sender, and polls the tags its peers
sent it in the same loop as their rows' tiles, before reducing them; it re-arms them at its end. A peer
that made a different call (another op, size or dtype of the same bytes) is reported as
``ERR_MISMATCH``, or as a timeout when its program never ran, instead of returning wrong values.

Sync protocol: no flags, no fences and no barrier across ranks: a peer's 2-byte element is either the
sentinel or the value (elements are checked one by one, so a store can't tear). Polls are volatile loads
(never cached, never hoisted), bounded by the timeout. Buffers alternate by epoch parity; two are enough,
as for ``one_shot.py``: a peer can write into the buffer of call ``e`` again only in call ``e + 2``, after
finishing call ``e + 1``, which needed this rank's call-``e + 1`` data, sent after this rank's call ``e``
(and its re-arming) had completed in stream order.

When it wins: small bf16/fp16 messages (decode); the crossover with ``one_shot.py`` is in
``tpcomm/dispatch.py``, the measurements in ``docs/benchmarks.md``. 32-bit inputs use ``one_shot.py``
(the 16-bit sentinel has no 32-bit counterpart that no input can hold).
"""

import triton
import triton.language as tl

from .epilogue import (NO_QUANT, PRELOAD_EPILOGUE, SUM_GIVEN, SUM_REDUCE, no_quant_args, preload_row,
                       reduce_norm_row, round_to)
from .quant import widen
from .launch import KernelCall
from .sync import (ERR_MISMATCH, finish_program, launch_timeout, now_ns, peer_ptr, read_epoch, record_error,
                   record_timeout)

#: The sentinel's bits, as int16: 0x8000 (-0.0 in bf16 and fp16).
SENTINEL = tl.constexpr(-32768)
#: An unwritten call tag: two sentinels read as one int32 (0x80008000); signatures are positive.
TAG_SENTINEL = tl.constexpr(-2147450880)


@triton.jit
def _poll_code(p, mask, tag_ptr, signature, waited, timeout):
    """One round of :func:`_poll_tile`'s wait: ``(code, tile)``, the block-wide max of its per-lane code
    (see there) and the tile as loaded."""
    seen = tl.load(tag_ptr, volatile=True)
    tile = tl.load(p, mask=mask, other=0.0, volatile=True)
    bits = tile.to(tl.int16, bitcast=True)
    missing = (bits == SENTINEL) | (seen == TAG_SENTINEL)  # per lane
    code = ((bits == SENTINEL).to(tl.int32) + tl.where(seen == TAG_SENTINEL, 2, 0)
            + tl.where(missing & (waited >= timeout), 4, 0)  # expired: only where something is missing
            + tl.where((seen != signature) & (seen != TAG_SENTINEL), 8, 0))
    return tl.max(code, axis=0), tile


@triton.jit
def _poll_tile(x_row_ptr, recv_row_ptr, slot_stride, cols, mask, tag_ptr, rank, epoch, program, signature,
               timeout, err_ptr, state_ptr, WORLD: tl.constexpr, SUM: tl.constexpr):
    """Spin until, for every peer ``q``, this program's call tag from ``q`` (``tag_ptr + q``) has arrived
    and no element of this tile in ``q``'s slot holds the sentinel (bounded). A tag with another
    signature ends the wait at once and records ``ERR_MISMATCH``; an expired wait records
    ``ERR_TIMEOUT``. Returns ``(acc, timeout)``: with ``SUM``, the tile summed over the ranks in rank
    order in float32 from +0.0 (this rank's own row read from ``x_row_ptr``, every peer's as the last
    round of its poll loaded it: the same additions as ``epilogue.reduce_tile``, without reading the
    buffer again; -0.0 pushed as +0.0 adds the same; keep the two in step), else zeros; and the timeout
    left for later waits: ``timeout``, or 0 once a wait failed (``acc`` is then undefined). Reading the
    tiles again after the wait cost 0.3-0.5 µs a call: fused 1 / 16 x 6144 bf16 4.96 / 5.82 µs against
    5.46 / 6.21, all-reduce 3.13 against 3.45 (loopback ranks on one H200, ``benchmarks/dev_loopback.py
    --variants base,lamport_reload``, docs/benchmarks.md).

    The tag is polled in the same loop as the data, not in a wait of its own before it: that wait cost
    0.18-1.01 µs a call at 1-64 x 6144 bf16 against no tag at all, and polling it in the loop instead came
    out about even (fused -0.19 to +0.05 µs, FP8 +0.22 to +0.35, all-reduce -0.25 to +0.29; loopback on
    one H200, ``benchmarks/dev_loopback.py``, docs/benchmarks.md); it is kept for its exit, the same in
    every thread (below). Tags are re-armed at the kernel's end, after the barrier that precedes the last
    re-arming of data, so later rows of the program find the signature still there.

    Every thread loads the tag and reads the clock itself, so threads may disagree on both; the loop's
    condition is therefore one block-wide max of a per-lane code (1: this element holds the sentinel,
    2: this thread sees no tag yet, 4: this thread's wait expired with one of those still missing, 8:
    this thread sees another call's tag), the same value in every thread: the reduction's barriers
    inside the loop are reached by every warp the same number of times. A timeout of 0 (an earlier wait
    failed) leaves at once, and the call then counts as failed whatever arrived (the error recorded
    first stays)."""
    acc = tl.zeros(cols.shape, dtype=tl.float32)
    if SUM:
        own = widen(tl.load(x_row_ptr + cols, mask=mask, other=0.0))  # issued before the wait
    for q in tl.static_range(WORLD):
        if q == rank:
            if SUM:
                acc += own
        else:
            p = recv_row_ptr + q * slot_stride + cols
            start = now_ns()
            waited = start - start
            code, tile = _poll_code(p, mask, tag_ptr + q, signature, waited, timeout)
            while (code > 0) & (code < 4):  # data or tag still missing; no expiry, no other call seen
                waited = now_ns() - start
                code, tile = _poll_code(p, mask, tag_ptr + q, signature, waited, timeout)
            if (code >= 4) & (code < 8) & (timeout > 0):  # timeout 0: an earlier error is recorded already
                record_timeout(err_ptr, state_ptr, q, epoch, program, signature)
            if code >= 8:
                record_error(err_ptr, state_ptr, ERR_MISMATCH, q, epoch, program, signature)
            timeout = tl.where((code != 0) | (timeout == 0), 0, timeout)
            if SUM:
                acc += widen(tile)
    return acc, timeout


@triton.jit(do_not_specialize=["rank"])  # one binary for every rank (tpcomm.loopback)
def _lamport_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, q_ptr, s_ptr, s_row_stride, s_group_stride,
                    buf_table_ptr, state_ptr, err_ptr,
                    n_rows, H, numel, row_stride, slot_stride, parity_stride,
                    eps, timeout, rank, signature, tag_off, max_programs,
                    WORLD: tl.constexpr, BLOCK_H: tl.constexpr, NUM_TILES: tl.constexpr,
                    NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr, GEMMA: tl.constexpr,
                    QUANT: tl.constexpr, STORE_OUT: tl.constexpr, FP8: tl.constexpr, NATIVE_FP8: tl.constexpr,
                    GROUP: tl.constexpr, PDL: tl.constexpr):
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    epoch = read_epoch(state_ptr, PDL)
    timeout = launch_timeout(state_ptr, timeout)
    par = epoch & 1
    offs = tl.arange(0, BLOCK_H)

    # 1. Push, -0.0 stored as +0.0 so no element carries the sentinel.
    for row in range(pid, n_rows, num_programs):
        row_start = row * H
        dst_off = par * parity_stride + rank * slot_stride + row * row_stride
        for t in tl.static_range(NUM_TILES):
            cols = t * BLOCK_H + offs
            mask = (cols < H) & (row_start + cols < numel)
            bits = tl.load(x_ptr + row_start + cols, mask=mask).to(tl.int16, bitcast=True)
            bits = tl.where(bits == SENTINEL, 0, bits).to(tl.int16)
            for q in tl.static_range(WORLD):
                if q != rank:
                    dst = peer_ptr(buf_table_ptr, q, tl.int16)
                    tl.store(dst + dst_off + cols, bits, mask=mask)
    # ... and this program's call tag (the call's signature) into each peer's tag [par][pid][rank].
    tag_idx = tag_off + (par * max_programs + pid) * WORLD
    for q in tl.static_range(WORLD):
        if q != rank:
            tl.store(peer_ptr(buf_table_ptr, q, tl.int32) + tag_idx + rank, signature)

    # The first row's residual and the weight, loaded now so that their latency hides under the wait.
    PRELOAD: tl.constexpr = PRELOAD_EPILOGUE and NORM and NUM_TILES == 1
    SUM_FROM: tl.constexpr = SUM_GIVEN if NUM_TILES == 1 else SUM_REDUCE
    if PRELOAD:
        res_pre, w_pre = preload_row(res_ptr + pid * H, w_ptr, pid * H, numel, H, BLOCK_H, HAS_RESIDUAL)
    else:
        res_pre, w_pre = offs, offs

    # 2. Per row: wait for every peer's tiles and call tag, reduce + epilogue, re-arm the tiles read.
    tags = peer_ptr(buf_table_ptr, rank, tl.int32) + tag_idx
    recv = peer_ptr(buf_table_ptr, rank, x_ptr.dtype.element_ty) + par * parity_stride
    recv_bits = peer_ptr(buf_table_ptr, rank, tl.int16) + par * parity_stride
    for row in range(pid, n_rows, num_programs):
        row_start = row * H
        if NUM_TILES == 1:  # the sum as the poll loaded the tiles (rows of several tiles read them again)
            mask = (offs < H) & (row_start + offs < numel)
            acc, timeout = _poll_tile(x_ptr + row_start, recv + row * row_stride, slot_stride, offs, mask, tags,
                                      rank, epoch, pid, signature, timeout, err_ptr, state_ptr, WORLD, True)
            s_pre = round_to(acc, x_ptr.dtype.element_ty)
        else:
            for t in tl.static_range(NUM_TILES):
                cols = t * BLOCK_H + offs
                mask = (cols < H) & (row_start + cols < numel)
                _, timeout = _poll_tile(x_ptr + row_start, recv + row * row_stride, slot_stride, cols, mask,
                                        tags, rank, epoch, pid, signature, timeout, err_ptr, state_ptr, WORLD,
                                        False)
            s_pre = offs
        reduce_norm_row(x_ptr + row_start, recv + row * row_stride, slot_stride,
                        res_ptr + row_start, res_out_ptr + row_start, w_ptr, out_ptr + row_start,
                        q_ptr + row_start, s_ptr + row * s_row_stride, s_group_stride,
                        row_start, numel, H, eps, rank, res_pre, w_pre, row == pid, s_pre,
                        WORLD, BLOCK_H, NUM_TILES, NORM, HAS_RESIDUAL, GEMMA, SUM_FROM,
                        QUANT, STORE_OUT, FP8, NATIVE_FP8, GROUP, PRELOAD)
        tl.debug_barrier()
        for t in tl.static_range(NUM_TILES):
            cols = t * BLOCK_H + offs
            mask = (cols < H) & (row_start + cols < numel)
            for q in tl.static_range(WORLD):
                if q != rank:
                    tl.store(recv_bits + q * slot_stride + row * row_stride + cols,
                             tl.full([BLOCK_H], SENTINEL, tl.int16), mask=mask)
    # 3. Re-arm the call tags: every thread's last load of them came before the barrier above (every
    #    program has at least one row: the grid is at most n_rows).
    for q in tl.static_range(WORLD):
        if q != rank:
            tl.store(tags + q, TAG_SENTINEL)

    finish_program(state_ptr, epoch, num_programs)


def lamport_call(x, out, residual, residual_out, weight, ws, n_rows: int, H: int, eps: float,
                 cfg, norm: bool, gemma: bool, signature: int, quant=None) -> KernelCall:
    """The launch of the Lamport kernel on rows ``[0, n_rows)``; arguments as :func:`one_shot.one_shot_call`.

    ``x`` must be bf16 or fp16 and ``n_rows`` rows must fit one Lamport slot
    (:meth:`~tpcomm.workspace.Workspace.lamport_rows_per_launch`).
    """
    if n_rows < 1:  # a program without rows would re-arm its call tags without waiting for them
        raise ValueError(f"lamport: n_rows must be >= 1, got {n_rows}")
    has_res = residual is not None
    return KernelCall(_lamport_kernel, cfg.grid(n_rows), (
        x, residual if has_res else x, weight if weight is not None else x, out,
        residual_out if has_res else out, *(quant.kernel_args() if quant else no_quant_args(out)),
        ws.lamport_table, ws.state, ws.err,
        n_rows, H, x.numel(), ws.row_stride(H, 2), ws.lamport_slot_bytes // 2,
        ws.world_size * ws.lamport_slot_bytes // 2,
        eps, ws.timeout, ws.rank, signature, ws.tag_offset(), ws.max_programs,
    ), dict(
        WORLD=ws.world_size, BLOCK_H=cfg.block_h, NUM_TILES=cfg.num_tiles, NORM=norm,
        HAS_RESIDUAL=has_res, GEMMA=gemma, **(quant.constexprs() if quant else NO_QUANT),
        num_warps=cfg.num_warps, enable_fp_fusion=False, **ws.launch_options(),
    ))
